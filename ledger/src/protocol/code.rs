//! The stable names the wire carries: [`ErrorCode`], the `error` member of
//! every error body, and [`Outcome`], the outcome header of every success.
//! Each is one enum whose serde names are the wire names; nothing compares
//! these strings by hand.

use serde::{Deserialize, Serialize};

/// Declares a wire-name enum: the serde names and [`as_str`] come from one
/// list, so they cannot disagree.
macro_rules! wire_names {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$variant_meta:meta])* $variant:ident = $wire:literal, )*
        }
        unrecognized: $(#[$other_meta:meta])* $other:ident
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum $name {
            $( $(#[$variant_meta])* #[serde(rename = $wire)] $variant, )*
            $(#[$other_meta])*
            #[serde(other)]
            $other,
        }

        impl $name {
            /// Every variant but the catch-all, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant,)*];

            /// The wire name.
            pub fn as_str(self) -> &'static str {
                match self {
                    $( Self::$variant => $wire, )*
                    Self::$other => "unrecognized",
                }
            }

            /// The variant of a wire name; the catch-all for a name this
            /// build does not know (a newer peer).
            pub fn from_wire(name: &str) -> Self {
                use serde::de::IntoDeserializer;
                let name: serde::de::value::StrDeserializer<'_, serde::de::value::Error> =
                    name.into_deserializer();
                Self::deserialize(name).unwrap_or(Self::$other)
            }
        }

        /// The wire names (not the catch-all, which is no name).
        #[cfg(feature = "schema")]
        impl schemars::JsonSchema for $name {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($name).into()
            }

            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                let names: Vec<&str> = Self::ALL.iter().map(|name| name.as_str()).collect();
                schemars::json_schema!({"type": "string", "enum": names})
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

wire_names! {
    /// Why a call was refused: the `error` member of every error body of the
    /// central API and of the agent socket. Names are stable snake_case;
    /// clients match on the variant, never on the text. One code means one
    /// thing on both APIs: the agent answers the center's code, with the
    /// center's status, for the same refusal, and passes the center's
    /// refusals on as they came (docs/design.md §6.1).
    pub enum ErrorCode {
        // ----- ledger refusals (central API; the agent passes them on) -----
        /// 429: not admitted now (capacity, debt, frozen, generation, size).
        RateLimited = "rate_limited",
        /// 409: the reservation ID exists with another request digest.
        IdempotencyConflict = "idempotency_conflict",
        /// 409 (404 on a read): the reservation ID was abandoned
        /// (tombstoned): it never reserves.
        ReservationAbandoned = "reservation_abandoned",
        /// 404: no policy is published for the pair.
        NoPolicy = "no_policy",
        /// 400: units outside 1..=2^53-1 (or a floor outside 1..=units).
        InvalidUnits = "invalid_units",
        /// 400: a reservation's legs break a rule: more than 8, a pair
        /// twice, a pair without a policy, a settle naming a pair that is
        /// not a leg or mixing the one-leg and the per-leg forms.
        InvalidLegs = "invalid_legs",
        /// 409: a unit sum would overflow; nothing changed.
        Overflow = "overflow",
        /// 404: no reservation with that ID (or none the caller owns: saying
        /// another identity's exists would leak it).
        ReservationNotFound = "reservation_not_found",
        /// 403: the reservation ID is not the one derived from the caller's
        /// identity, the pair and the idempotency key (not in its namespace).
        ReservationIdForeign = "reservation_id_foreign",
        /// 409: the reservation is bound to another operation ID.
        OperationConflict = "operation_conflict",
        /// 409: the start lost against expiry; the receipt says `EXPIRED`.
        ReservationExpired = "reservation_expired",
        /// 409: the transition is not allowed from the reservation's state.
        IllegalState = "illegal_state",
        /// 409: a settle before the start bound an operation.
        NotStarted = "not_started",
        /// 409: settled already with other actual units.
        SettlementConflict = "settlement_conflict",
        /// 409: a published generation must rise.
        GenerationNotRising = "generation_not_rising",
        /// 400: the policy document breaks a rule.
        InvalidPolicy = "invalid_policy",
        /// 409: route control must name the current generation.
        NotCurrentGeneration = "not_current_generation",
        /// 401: the gateway identity is not enrolled.
        UnknownIdentity = "unknown_identity",
        /// 403: the call acts for another identity than the caller's.
        WrongIdentity = "wrong_identity",
        /// 409: the boot named is not the identity's current boot.
        SupersededBoot = "superseded_boot",
        /// 409: the pair's policy does not enable emergency shards.
        EmergencyDisabled = "emergency_disabled",
        /// 409: the boot holds the most open shards allowed for the pair.
        TooManyOpenShards = "too_many_open_shards",
        /// 409: a boot request that is a replay (its nonce or `requestedAt`
        /// is not fresh, or its clock is too far off).
        BootReplayed = "boot_replayed",
        /// 429: the identity's unreconciled shard units of the pair, over
        /// all its boots, are at the cap; `Retry-After` says when the
        /// oldest becomes lost.
        ShardCapReached = "shard_cap_reached",
        /// 409: the shard ID was issued to another request.
        ShardIdTaken = "shard_id_taken",
        /// 404: no shard with that ID was issued.
        ShardNotFound = "shard_not_found",
        /// 400: a terminal receipt disagrees with its shard.
        ReceiptMismatch = "receipt_mismatch",
        // ----- the edges (both servers) -----
        /// 400: the body breaks the document's rules (the field is named).
        InvalidBody = "invalid_body",
        /// 400: a path segment is malformed.
        InvalidPath = "invalid_path",
        /// 400: a query parameter is malformed or out of range (the
        /// parameter is named).
        InvalidQuery = "invalid_query",
        /// 413: the body is above the limit.
        BodyTooLarge = "body_too_large",
        /// 400: the body could not be read.
        UnreadableBody = "unreadable_body",
        /// 401/400: an agent call's signature is missing or wrong.
        SignatureInvalid = "signature_invalid",
        /// 401: an operator call without a bearer token.
        OperatorTokenRequired = "operator_token_required",
        /// 401: the operator token does not match.
        OperatorTokenInvalid = "operator_token_invalid",
        /// 404: no endpoint at that path.
        NoSuchEndpoint = "no_such_endpoint",
        /// 405: the path exists but does not answer that method; `Allow`
        /// names the methods it does.
        MethodNotAllowed = "method_not_allowed",
        /// 503: the store failed to commit; nothing was acknowledged.
        CommitFailed = "commit_failed",
        /// 503: the service cannot answer now.
        Unavailable = "unavailable",
        /// 500: a bug.
        Internal = "internal",
        /// 500: `GET /v1/audit` found an equation that does not hold; the
        /// body is the audit, `violations` listed.
        AuditDrift = "audit_drift",
        // ----- the agent socket (codes only the agent answers) -----
        /// 403: the peer's uid/gid may not use the socket.
        PeerNotAllowed = "peer_not_allowed",
        /// 503: too many requests are under way.
        Overloaded = "overloaded",
        /// 503: the agent is stopping.
        Stopping = "stopping",
        /// 503: the agent holds its most open reservations.
        TooManyOpenReservations = "too_many_open_reservations",
        /// 503: no central ledger and no usable shard.
        CentralUnreachable = "central_unreachable",
        /// 503: partitioned, and local overage left debt: admission pauses
        /// until reconciliation.
        EmergencyDebt = "emergency_debt",
        /// 503: the reserve's outcome is not known yet; retry the same key.
        ReservationUnknown = "reservation_unknown",
        /// 503: the start's outcome is not known yet.
        StartUnknown = "start_unknown",
    }
    unrecognized:
        /// A code this build does not know, or an error body it cannot read.
        Unrecognized
}

wire_names! {
    /// What a successful answer came to: the outcome header
    /// (`reservoir-outcome`) of every 2xx of the central API.
    pub enum Outcome {
        Reserved = "reserved",
        /// A repeat of an earlier call: the same receipt, nothing moved.
        Duplicate = "duplicate",
        /// `mode: shadow`: decided and recorded, nothing spent.
        Shadow = "shadow",
        /// `mode: off`: nothing recorded.
        NotEnforced = "not_enforced",
        Started = "started",
        Settled = "settled",
        /// A genuine receipt corrected a conservative settlement.
        Corrected = "corrected",
        Released = "released",
        /// An unknown ID is tombstoned: a late duplicate never reserves.
        Tombstoned = "tombstoned",
        /// A reserved ID was abandoned and its units released.
        Abandoned = "abandoned",
        Registered = "registered",
        Issued = "issued",
        Reconciled = "reconciled",
        Published = "published",
        Enrolled = "enrolled",
        Changed = "changed",
        Unchanged = "unchanged",
        Found = "found",
        Clean = "clean",
        Drift = "drift",
    }
    unrecognized:
        /// An outcome this build does not know.
        Unrecognized
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serde_names_are_the_wire_names() {
        for code in ErrorCode::ALL {
            let json = format!("\"{}\"", code.as_str());
            assert_eq!(serde_json::to_string(code).expect("serializes"), json);
            assert_eq!(
                serde_json::from_str::<ErrorCode>(&json).expect("parses"),
                *code
            );
            assert_eq!(ErrorCode::from_wire(code.as_str()), *code);
        }
        for outcome in Outcome::ALL {
            let json = format!("\"{}\"", outcome.as_str());
            assert_eq!(serde_json::to_string(outcome).expect("serializes"), json);
            assert_eq!(Outcome::from_wire(outcome.as_str()), *outcome);
        }
        assert_eq!(
            ErrorCode::from_wire("no_such_code"),
            ErrorCode::Unrecognized
        );
        assert_eq!(
            serde_json::from_str::<ErrorCode>("\"no_such_code\"").expect("parses"),
            ErrorCode::Unrecognized
        );
    }
}
