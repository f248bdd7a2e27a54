//! The JSON bodies of the central API (docs/design.md §6.3) besides the v1
//! documents themselves. The service parses request bodies with
//! [`shard_format::parse`] (each body implements [`Document`] for that
//! reason), so they are as strict as the documents: unknown members, `null`
//! for an absent member, out-of-range numbers and malformed identifiers are
//! refused with the field named.

use ledger::{LegActual, LegAsk, ReservationOrigin, ReserveRequest, SettleActuals};
use serde::{Deserialize, Serialize};
use shard_format::limits::{COUNTER_MAX, DURATION_MS_MAX, HOLD_TTL_MS_MAX, UNITS_MAX};
use shard_format::{
    BootNonce, Digest, Document, GatewayIdentity, IdempotencyKey, OperationId, ParseError,
    ReservationId, Route, ShardId, Subject, Timestamp,
};

/// Response header naming which outcome a 2xx answer carries
/// (`reserved`, `duplicate`, `shadow`, `not_enforced`, `started`, `settled`,
/// `corrected`, `released`, `tombstoned`, `abandoned`, `reconciled`, …).
pub const OUTCOME_HEADER: &str = "reservoir-outcome";
/// Response header on a shadow-mode admission: the dimension enforcement
/// would have rejected on, if any.
pub const WOULD_REJECT_HEADER: &str = "reservoir-would-reject";

fn check_at_most(field: &str, value: u64, max: u64) -> Result<(), ParseError> {
    if value > max {
        return Err(ParseError::new(
            field,
            format!("{value} is above the maximum {max}"),
        ));
    }
    Ok(())
}

fn check_positive_at_most(field: &str, value: u64, max: u64) -> Result<(), ParseError> {
    if value == 0 {
        return Err(ParseError::new(field, "must be at least 1"));
    }
    check_at_most(field, value, max)
}

/// `POST /v1/reservations`: `{reservation, idempotencyKey, subject, route,
/// units, minUnits?, policyGeneration?, requestDigest, holdTtlMs?}`. `reservation` must
/// be the ID the signing identity derives from the key and the pair
/// ([`ReservationId::derive`]); the owner is the signer, never the body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReserveBody {
    pub reservation: ReservationId,
    pub idempotency_key: IdempotencyKey,
    pub subject: Subject,
    pub route: Route,
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = UNITS_MAX)))]
    pub units: u64,
    /// A flexible reservation: grant the largest amount from `minUnits` to
    /// `units` the account can cover (the receipt's `reservedUnits`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = UNITS_MAX)))]
    pub min_units: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = COUNTER_MAX)))]
    pub policy_generation: Option<u64>,
    pub request_digest: Digest,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = HOLD_TTL_MS_MAX)))]
    pub hold_ttl_ms: Option<u64>,
    /// A multi-leg reservation: the legs after the first (which is
    /// `subject`, `route`, `units`, `minUnits` above), 1 to 7 of them, each
    /// a pair of its own. All legs are admitted in one transition or none;
    /// the ledger judges them and names a bad one as `legs[i]` (the first
    /// leg is `legs[0]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub more_legs: Vec<LegBody>,
}

/// One leg of a multi-leg reserve.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LegBody {
    pub subject: Subject,
    pub route: Route,
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = UNITS_MAX)))]
    pub units: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = UNITS_MAX)))]
    pub min_units: Option<u64>,
}

impl From<LegBody> for LegAsk {
    fn from(leg: LegBody) -> Self {
        Self {
            subject: leg.subject,
            route: leg.route,
            units: leg.units,
            min_units: leg.min_units,
        }
    }
}

impl From<LegAsk> for LegBody {
    fn from(leg: LegAsk) -> Self {
        Self {
            subject: leg.subject,
            route: leg.route,
            units: leg.units,
            min_units: leg.min_units,
        }
    }
}

impl Document for ReserveBody {
    const SCHEMA: &'static str = "reserveRequest";

    fn validate(&self) -> Result<(), ParseError> {
        check_positive_at_most("units", self.units, UNITS_MAX)?;
        if let Some(min_units) = self.min_units {
            check_positive_at_most("minUnits", min_units, self.units)?;
        }
        if let Some(generation) = self.policy_generation {
            check_positive_at_most("policyGeneration", generation, COUNTER_MAX)?;
        }
        if let Some(hold_ttl_ms) = self.hold_ttl_ms {
            check_positive_at_most("holdTtlMs", hold_ttl_ms, HOLD_TTL_MS_MAX)?;
        }
        Ok(())
    }
}

impl ReserveBody {
    /// The ledger's request, owned by `owner` (the identity that signed it).
    pub fn into_request(self, owner: GatewayIdentity) -> ReserveRequest {
        ReserveRequest {
            owner,
            idempotency_key: self.idempotency_key,
            reservation: self.reservation,
            subject: self.subject,
            route: self.route,
            units: self.units,
            min_units: self.min_units,
            policy_generation: self.policy_generation,
            request_digest: self.request_digest,
            hold_ttl_ms: self.hold_ttl_ms,
            more_legs: self.more_legs.into_iter().map(LegAsk::from).collect(),
        }
    }
}

impl From<ReserveRequest> for ReserveBody {
    fn from(request: ReserveRequest) -> Self {
        Self {
            reservation: request.reservation,
            idempotency_key: request.idempotency_key,
            subject: request.subject,
            route: request.route,
            units: request.units,
            min_units: request.min_units,
            policy_generation: request.policy_generation,
            request_digest: request.request_digest,
            hold_ttl_ms: request.hold_ttl_ms,
            more_legs: request.more_legs.into_iter().map(LegBody::from).collect(),
        }
    }
}

/// `POST /v1/reservations/{reservation}/abandon` from an agent: what the
/// reservation ID was derived from (`{subject, route, idempotencyKey}`), so
/// the center can tell it is the caller's own. The operator sends no body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AbandonBody {
    pub subject: Subject,
    pub route: Route,
    pub idempotency_key: IdempotencyKey,
}

impl Document for AbandonBody {
    const SCHEMA: &'static str = "abandonRequest";

    fn validate(&self) -> Result<(), ParseError> {
        Ok(())
    }
}

impl From<ReservationOrigin> for AbandonBody {
    fn from(origin: ReservationOrigin) -> Self {
        Self {
            subject: origin.subject,
            route: origin.route,
            idempotency_key: origin.idempotency_key,
        }
    }
}

impl From<AbandonBody> for ReservationOrigin {
    fn from(body: AbandonBody) -> Self {
        Self {
            subject: body.subject,
            route: body.route,
            idempotency_key: body.idempotency_key,
        }
    }
}

/// `POST /v1/reservations/{reservation}/start`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StartBody {
    pub operation_id: OperationId,
    /// The caller's execution deadline; past it without a receipt the
    /// reservation becomes `USAGE_UNKNOWN`. Defaults to the policy's hold TTL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = DURATION_MS_MAX)))]
    pub deadline_ms: Option<u64>,
}

impl Document for StartBody {
    const SCHEMA: &'static str = "startRequest";

    fn validate(&self) -> Result<(), ParseError> {
        if let Some(deadline_ms) = self.deadline_ms {
            check_positive_at_most("deadlineMs", deadline_ms, DURATION_MS_MAX)?;
        }
        Ok(())
    }
}

/// `POST /v1/reservations/{reservation}/settle`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SettleBody {
    pub operation_id: OperationId,
    /// The one-leg form: what the operation used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 0, max = UNITS_MAX)))]
    pub actual_units: Option<u64>,
    /// The per-leg form (a multi-leg reservation): what each leg used, by
    /// pair; a leg left out settles at its reserved units.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub legs: Option<Vec<LegActual>>,
}

impl SettleBody {
    /// The one-leg form.
    pub fn one(operation_id: OperationId, actual_units: u64) -> Self {
        Self {
            operation_id,
            actual_units: Some(actual_units),
            legs: None,
        }
    }

    /// The ledger's actuals; the form is checked by [`Document::validate`].
    pub fn actuals(&self) -> SettleActuals {
        match (&self.legs, self.actual_units) {
            (Some(legs), _) => SettleActuals::Legs(legs.clone()),
            (None, actual_units) => SettleActuals::One(actual_units.unwrap_or_default()),
        }
    }
}

impl From<(OperationId, SettleActuals)> for SettleBody {
    fn from((operation_id, actuals): (OperationId, SettleActuals)) -> Self {
        match actuals {
            SettleActuals::One(actual_units) => Self::one(operation_id, actual_units),
            SettleActuals::Legs(legs) => Self {
                operation_id,
                actual_units: None,
                legs: Some(legs),
            },
        }
    }
}

impl Document for SettleBody {
    const SCHEMA: &'static str = "settleRequest";

    fn validate(&self) -> Result<(), ParseError> {
        match (self.actual_units, &self.legs) {
            (Some(actual_units), None) => check_at_most("actualUnits", actual_units, UNITS_MAX),
            (None, Some(legs)) => {
                for (index, leg) in legs.iter().enumerate() {
                    check_at_most(
                        &format!("legs[{index}].actualUnits"),
                        leg.actual_units,
                        UNITS_MAX,
                    )?;
                }
                Ok(())
            }
            (None, None) => Err(ParseError::new(
                "actualUnits",
                "is required (or `legs`, the per-leg form)",
            )),
            (Some(_), Some(_)) => Err(ParseError::new(
                "legs",
                "give `actualUnits` (one leg) or `legs` (per leg), not both",
            )),
        }
    }
}

/// Most operations one `POST /v1/batch` carries.
pub const BATCH_OPERATIONS_MAX: usize = 256;
/// Largest `POST /v1/batch` body: [`BATCH_OPERATIONS_MAX`] operations of
/// 4 KiB on average (each operation on its own is still held to the
/// single call's limits).
pub const BATCH_BODY_SIZE_MAX: usize = 1024 * 1024;

/// `POST /v1/batch` (agent): reservation calls of the signing agent, one
/// signature over them all, applied in order and answered in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BatchBody {
    /// 1 to [`BATCH_OPERATIONS_MAX`] operations.
    #[cfg_attr(feature = "schema", schemars(length(min = 1, max = BATCH_OPERATIONS_MAX)))]
    pub operations: Vec<BatchOperation>,
}

/// One operation of a batch: `op` names the call, the other members are
/// the single call's body, with the reservation of the call's path as
/// `reservation`. Each is parsed as strictly as its single call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(tag = "op", rename_all = "camelCase", deny_unknown_fields)]
pub enum BatchOperation {
    /// `POST /v1/reservations`: the reserve body.
    Reserve(ReserveBody),
    /// `GET /v1/reservations/{reservation}`.
    GetReservation { reservation: ReservationId },
    /// `POST /v1/reservations/{reservation}/start`.
    Start {
        reservation: ReservationId,
        #[serde(flatten)]
        body: StartBody,
    },
    /// `POST /v1/reservations/{reservation}/settle`.
    Settle {
        reservation: ReservationId,
        #[serde(flatten)]
        body: SettleBody,
    },
    /// `POST /v1/reservations/{reservation}/release`.
    Release { reservation: ReservationId },
    /// `POST /v1/reservations/{reservation}/abandon`.
    Abandon {
        reservation: ReservationId,
        #[serde(flatten)]
        body: AbandonBody,
    },
}

impl BatchOperation {
    /// Which call this is.
    pub fn op(&self) -> BatchOp {
        match self {
            Self::Reserve(_) => BatchOp::Reserve,
            Self::GetReservation { .. } => BatchOp::GetReservation,
            Self::Start { .. } => BatchOp::Start,
            Self::Settle { .. } => BatchOp::Settle,
            Self::Release { .. } => BatchOp::Release,
            Self::Abandon { .. } => BatchOp::Abandon,
        }
    }
}

/// The `op` of a batch operation; its serde names are the wire names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum BatchOp {
    Reserve,
    GetReservation,
    Start,
    Settle,
    Release,
    Abandon,
}

impl BatchOp {
    pub const ALL: [Self; 6] = [
        Self::Reserve,
        Self::GetReservation,
        Self::Start,
        Self::Settle,
        Self::Release,
        Self::Abandon,
    ];

    /// Whether the operation names its reservation in `reservation` (the
    /// single call's path); a reserve's `reservation` is part of its body.
    pub fn names_reservation(self) -> bool {
        self != Self::Reserve
    }
}

/// `POST /v1/gateways/{identity}/boot` (agent): a nonce drawn for this
/// request and the agent's clock when it sent it. The ledger refuses a
/// request whose `requestedAt` is more than [`ledger::BOOT_SKEW_MS_MAX`]
/// from its own clock or not after the current boot's request, or whose
/// nonce is the current boot's: a replayed boot request never registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BootBody {
    pub request_nonce: BootNonce,
    pub requested_at: Timestamp,
}

impl BootBody {
    /// A fresh request: 16 random bytes and the wall clock now.
    pub fn fresh() -> Result<Self, getrandom::Error> {
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce)?;
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |since| {
                u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
            });
        Ok(Self {
            request_nonce: BootNonce(nonce),
            requested_at: Timestamp::from_unix_ms(now_ms).unwrap_or(Timestamp::MAX),
        })
    }
}

impl Document for BootBody {
    const SCHEMA: &'static str = "bootRequest";

    fn validate(&self) -> Result<(), ParseError> {
        Ok(())
    }
}

impl From<BootBody> for ledger::BootRequest {
    fn from(body: BootBody) -> Self {
        Self {
            request_nonce: body.request_nonce,
            requested_at: body.requested_at,
        }
    }
}

/// The body of calls that take none (`release`, `abandon`): empty, or
/// `{}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(deny_unknown_fields)]
pub struct EmptyBody {}

impl Document for EmptyBody {
    const SCHEMA: &'static str = "empty";

    fn validate(&self) -> Result<(), ParseError> {
        Ok(())
    }
}

/// `POST /v1/accounts/{subject}/{route}/admission` (operator): stop (roll
/// back) or resume admission under the pair's current generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AdmissionBody {
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = COUNTER_MAX)))]
    pub policy_generation: u64,
    pub stopped: bool,
}

impl Document for AdmissionBody {
    const SCHEMA: &'static str = "admissionControl";

    fn validate(&self) -> Result<(), ParseError> {
        check_positive_at_most("policyGeneration", self.policy_generation, COUNTER_MAX)
    }
}

/// `POST /v1/accounts/{subject}/{route}/freeze` (operator).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FreezeBody {
    pub frozen: bool,
}

impl Document for FreezeBody {
    const SCHEMA: &'static str = "freezeControl";

    fn validate(&self) -> Result<(), ParseError> {
        Ok(())
    }
}

/// `POST /v1/shards` (agent): an emergency shard for the caller's current
/// boot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IssueShardBody {
    pub subject: Subject,
    pub route: Route,
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = COUNTER_MAX)))]
    pub boot_epoch: u64,
    pub boot_nonce: BootNonce,
    /// An ID the agent chose, which makes the call idempotent: a repeat
    /// returns the same shard. Without it the service draws one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardId>,
}

impl Document for IssueShardBody {
    const SCHEMA: &'static str = "shardRequest";

    fn validate(&self) -> Result<(), ParseError> {
        check_positive_at_most("bootEpoch", self.boot_epoch, COUNTER_MAX)
    }
}

pub use ledger::protocol::views::{
    AbandonResponse, AccountView, AccountsResponse, AuditGeneration, AuditPair, AuditResponse,
    AuditViolation, BootResponse, EnrollResponse, NotEnforcedResponse, PublishResponse,
    ReconcileResponse, RouteControlResponse,
};

/// Every error body: `{"error": "<stable_code>", "message": "<sentence>",
/// …details}` — the ledger protocol's [`Refusal`].
pub use ledger::protocol::{ErrorCode, Outcome, Refusal, RefusalDetails};

#[cfg(test)]
mod tests {
    use super::*;

    /// The `op` a batch operation is written with is its [`BatchOp`]'s
    /// name, and the single call's body members sit beside it.
    #[test]
    fn a_batch_operation_is_written_flat_with_its_op() {
        let reservation: ReservationId =
            "r-0123456789abcdef0123456789abcdef".parse().expect("valid");
        let start = BatchOperation::Start {
            reservation: reservation.clone(),
            body: StartBody {
                operation_id: "op-1".parse().expect("valid"),
                deadline_ms: Some(5),
            },
        };
        let written = serde_json::to_value(&start).expect("serializes");
        assert_eq!(
            written,
            serde_json::json!({"op": "start", "reservation": reservation, "operationId": "op-1", "deadlineMs": 5})
        );
        let release = BatchOperation::Release { reservation };
        for operation in [start, release] {
            let written = serde_json::to_value(&operation).expect("serializes");
            assert_eq!(
                written["op"],
                serde_json::to_value(operation.op()).expect("serializes")
            );
        }
    }
}
