//! Every operation's result: one enum per operation, one variant per reason
//! (TigerBeetle's result codes are the model). Rejections change nothing,
//! except that a reserve or shard request may open the epoch's account (a new
//! epoch began), which its changes then carry.

use serde::{Deserialize, Serialize};
use shard_format::{
    BootNonce, Digest, EmergencyShardV1, GatewayIdentity, IdempotencyKey, LimitReservationV1,
    OperationId, ReservationId, ReservationState, SettlementReceiptV1, ShardId,
};

use crate::records::{PairKey, Reconciliation};
use crate::terms::Overflow;

/// The limit a rejected reservation hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub enum Dimension {
    /// Not enough `available` in the account.
    Capacity,
    /// The pair owes debt; admission is 0 until it is repaid.
    Debt,
    /// A breach froze the pair until an operator unfreezes it.
    Frozen,
    /// The request named a generation that is not the current one, or the
    /// current one was rolled back.
    PolicyGeneration,
    /// More units than the policy's `reservationUnitsMax`.
    ReservationUnitsMax,
}

impl Dimension {
    /// The wire name (as serde writes it).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Capacity => "capacity",
            Self::Debt => "debt",
            Self::Frozen => "frozen",
            Self::PolicyGeneration => "policyGeneration",
            Self::ReservationUnitsMax => "reservationUnitsMax",
        }
    }
}

/// A refusal to admit, as the caller sees it: never another tenant's
/// balance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct Rejection {
    pub dimension: Dimension,
    /// The generation whose rules were applied.
    pub policy_generation: u64,
    /// Conservative whole seconds after which a retry may succeed; `None`
    /// when waiting alone will not help.
    pub retry_after_seconds: Option<u64>,
    /// The caller's own limit state, for the `RateLimit-Policy`/`RateLimit`
    /// fields (a reserve rejected by the central ledger carries it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimitState>,
}

/// The caller's own limit state on a rejection, for the IETF
/// `RateLimit-Policy`/`RateLimit` fields: never another tenant's numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RateLimitState {
    /// The policy's `burst`.
    pub quota: u64,
    /// Seconds a full `burst` takes to refill.
    pub window_seconds: u64,
    /// `available` in the pair's current account.
    pub remaining: u64,
}

impl RateLimitState {
    /// The `RateLimit-Policy` field value.
    pub fn policy_field(&self) -> String {
        format!("\"budget\";q={};w={}", self.quota, self.window_seconds)
    }

    /// The `RateLimit` field value for a rejection that may succeed after
    /// `retry_after_seconds` (a full window when there is no horizon).
    pub fn limit_field(&self, retry_after_seconds: Option<u64>) -> String {
        let reset = retry_after_seconds.unwrap_or(self.window_seconds);
        format!("\"budget\";r={};t={reset}", self.remaining)
    }
}

/// `Retry-After` of a 429 when waiting alone will not help (a frozen route,
/// a replaced or rolled-back generation, units above `reservationUnitsMax`):
/// docs/design.md §6.4 wants a value on every 429, an operator has to act
/// first, and a caller asking again once a minute costs nothing.
pub const RETRY_AFTER_NO_HORIZON_SECONDS: u64 = 60;

impl Rejection {
    /// The `Retry-After` to send: the ledger's horizon, or
    /// [`RETRY_AFTER_NO_HORIZON_SECONDS`] when there is none.
    pub fn retry_after_header_seconds(&self) -> u64 {
        self.retry_after_seconds
            .unwrap_or(RETRY_AFTER_NO_HORIZON_SECONDS)
    }
}

/// Who asks the ledger to act on or read a reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// An enrolled gateway (agent), by the identity its call is signed with.
    Gateway(GatewayIdentity),
    /// The operator token: may read and abandon any reservation.
    Operator,
}

impl std::fmt::Display for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Gateway(identity) => identity.fmt(f),
            Self::Operator => f.write_str("the operator"),
        }
    }
}

/// What a reservation ID was derived from, besides its owner's identity
/// ([`ReservationId::derive`]): a gateway proves an ID is its own with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationOrigin {
    pub subject: shard_format::Subject,
    pub route: shard_format::Route,
    pub idempotency_key: IdempotencyKey,
}

impl ReservationOrigin {
    /// Whether `reservation` is the ID `identity` derives from this origin.
    pub fn derives(&self, identity: &GatewayIdentity, reservation: &ReservationId) -> bool {
        ReservationId::derive(identity, &self.subject, &self.route, &self.idempotency_key)
            == *reservation
    }
}

/// An abandon: of an ID whose reserve outcome its owner does not know, or
/// (operator) of any reservation still held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AbandonRequest {
    pub reservation: ReservationId,
    pub caller: Caller,
    /// Required from a gateway: what its ID was derived from, so that an
    /// identity can tombstone only IDs of its own namespace.
    pub origin: Option<ReservationOrigin>,
}

/// A reservation's request, with the caller-chosen ID.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReserveRequest {
    /// The identity that reserves: the shell sets it from the call's
    /// signature, never from the body.
    pub owner: GatewayIdentity,
    /// The gateway's key for the request; `reservation` must be the ID
    /// derived from it ([`ReservationId::derive`]).
    pub idempotency_key: IdempotencyKey,
    pub reservation: ReservationId,
    pub subject: shard_format::Subject,
    pub route: shard_format::Route,
    pub units: u64,
    /// A flexible reservation: the ledger grants the largest amount between
    /// this and `units` that the account can cover (`1 ≤ minUnits ≤
    /// units`). `None`: exactly `units` or nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_units: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_generation: Option<u64>,
    pub request_digest: Digest,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_ttl_ms: Option<u64>,
    /// A multi-leg reservation: its legs after the first (the first is
    /// `subject`, `route`, `units` and `minUnits` above). Empty for one leg.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub more_legs: Vec<LegAsk>,
}

/// One leg of a multi-leg reserve: its own pair, units and floor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LegAsk {
    pub subject: shard_format::Subject,
    pub route: shard_format::Route,
    pub units: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_units: Option<u64>,
}

impl LegAsk {
    pub fn pair(&self) -> PairKey {
        PairKey::new(self.subject.clone(), self.route.clone())
    }

    /// The smallest grant this leg accepts.
    pub fn floor_units(&self) -> u64 {
        self.min_units.unwrap_or(self.units)
    }
}

/// What is wrong with one leg of a multi-leg request (`index` 0 is the
/// first leg).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegProblem {
    /// More than [`shard_format::limits::LEGS_MAX`] legs.
    TooMany,
    /// The leg's pair is another leg's too.
    RepeatedPair,
    /// `units` is 0 or above the largest unit count.
    Units,
    /// `minUnits` is 0 or above `units`.
    MinUnits,
    /// No policy was published for the leg's pair.
    NoPolicy,
    /// A settle names a pair that is not one of the reservation's legs.
    NotALeg,
    /// A settle's actual units are above the largest unit count.
    ActualUnits,
    /// A multi-leg reservation is settled leg by leg, not with one
    /// `actualUnits` (or a one-leg one with `actualUnits` and not both).
    SettleForm,
}

impl LegProblem {
    /// The wire name of the field at fault for leg `index`.
    pub fn field(self, index: usize) -> String {
        match self {
            Self::TooMany => "legs".to_owned(),
            Self::RepeatedPair | Self::NoPolicy | Self::NotALeg => format!("legs[{index}].route"),
            Self::Units => format!("legs[{index}].units"),
            Self::MinUnits => format!("legs[{index}].minUnits"),
            Self::ActualUnits => format!("legs[{index}].actualUnits"),
            Self::SettleForm => "actualUnits".to_owned(),
        }
    }

    /// What is wrong, in a sentence.
    pub fn message(self) -> String {
        match self {
            Self::TooMany => format!(
                "a reservation has at most {} legs",
                shard_format::limits::LEGS_MAX
            ),
            Self::RepeatedPair => "each leg must name a (subject, route) pair of its own".to_owned(),
            Self::Units => format!(
                "units must be from 1 to {}",
                shard_format::limits::UNITS_MAX
            ),
            Self::MinUnits => "minUnits must be from 1 to the leg's units".to_owned(),
            Self::NoPolicy => "no policy is published for the leg's pair".to_owned(),
            Self::NotALeg => "the pair is not one of the reservation's legs".to_owned(),
            Self::ActualUnits => format!(
                "actualUnits must be at most {}",
                shard_format::limits::UNITS_MAX
            ),
            Self::SettleForm => "a multi-leg reservation is settled with legs (per-leg actualUnits); a one-leg one with actualUnits".to_owned(),
        }
    }
}

/// The actual units a settle reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SettleActuals {
    /// One number: the one-leg form.
    One(u64),
    /// Per leg, by pair; a leg left out settles at its reserved units.
    Legs(Vec<LegActual>),
}

impl SettleActuals {
    /// The actual units of each of `legs` (each leg's pair and grant, in
    /// leg order): one number fits a one-leg reservation only; per pair, a
    /// leg left out settles at its grant. Errors name the fault's index.
    pub fn per_leg(&self, legs: &[(&PairKey, u64)]) -> Result<Vec<u64>, (usize, LegProblem)> {
        match self {
            Self::One(actual_units) if legs.len() == 1 => Ok(vec![*actual_units]),
            Self::One(_) => Err((0, LegProblem::SettleForm)),
            Self::Legs(given) => {
                let mut per_leg: Vec<Option<u64>> = vec![None; legs.len()];
                for (index, actual) in given.iter().enumerate() {
                    let Some(position) = legs.iter().position(|(pair, _)| {
                        pair.subject == actual.subject && pair.route == actual.route
                    }) else {
                        return Err((index, LegProblem::NotALeg));
                    };
                    if per_leg[position].is_some() {
                        return Err((index, LegProblem::RepeatedPair));
                    }
                    if actual.actual_units > shard_format::limits::UNITS_MAX {
                        return Err((index, LegProblem::ActualUnits));
                    }
                    per_leg[position] = Some(actual.actual_units);
                }
                Ok(per_leg
                    .into_iter()
                    .zip(legs)
                    .map(|(actual, (_, granted))| actual.unwrap_or(*granted))
                    .collect())
            }
        }
    }
}

/// One leg's actual units in a settle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LegActual {
    pub subject: shard_format::Subject,
    pub route: shard_format::Route,
    pub actual_units: u64,
}

impl ReserveRequest {
    /// A request for `units` on the pair, under the ID `owner` derives from
    /// `idempotency_key`; no generation pinned, the policy's hold.
    pub fn new(
        owner: GatewayIdentity,
        idempotency_key: IdempotencyKey,
        subject: shard_format::Subject,
        route: shard_format::Route,
        units: u64,
        request_digest: Digest,
    ) -> Self {
        Self {
            reservation: ReservationId::derive(&owner, &subject, &route, &idempotency_key),
            owner,
            idempotency_key,
            subject,
            route,
            units,
            min_units: None,
            policy_generation: None,
            request_digest,
            hold_ttl_ms: None,
            more_legs: Vec::new(),
        }
    }

    /// The same request with more legs after the first.
    pub fn with_legs(mut self, more_legs: Vec<LegAsk>) -> Self {
        self.more_legs = more_legs;
        self
    }

    /// Every leg's reservation ID, the first (`reservation`) included.
    pub fn leg_ids(&self) -> Vec<ReservationId> {
        let mut ids = Vec::with_capacity(1 + self.more_legs.len());
        ids.push(self.reservation.clone());
        ids.extend(self.more_legs.iter().map(|leg| {
            ReservationId::derive(&self.owner, &leg.subject, &leg.route, &self.idempotency_key)
        }));
        ids
    }

    /// Every leg, the first one included.
    pub fn legs(&self) -> Vec<LegAsk> {
        let mut legs = Vec::with_capacity(1 + self.more_legs.len());
        legs.push(LegAsk {
            subject: self.subject.clone(),
            route: self.route.clone(),
            units: self.units,
            min_units: self.min_units,
        });
        legs.extend(self.more_legs.iter().cloned());
        legs
    }

    /// The smallest grant this request accepts: `minUnits`, or all of
    /// `units`.
    pub fn floor_units(&self) -> u64 {
        self.min_units.unwrap_or(self.units)
    }

    /// The same request made flexible: granted anything from `min_units`
    /// to `units`.
    pub fn flexible(mut self, min_units: u64) -> Self {
        self.min_units = Some(min_units);
        self
    }

    /// What its ID was derived from, besides the owner.
    pub fn origin(&self) -> ReservationOrigin {
        ReservationOrigin {
            subject: self.subject.clone(),
            route: self.route.clone(),
            idempotency_key: self.idempotency_key.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReserveOutcome {
    /// Units moved from `available` to `reserved`.
    Reserved(LimitReservationV1),
    /// The same reservation ID and digest again: the first receipt, as it is now.
    Duplicate(LimitReservationV1),
    /// `mode: shadow`: recorded and admitted, nothing held. `would_reject`
    /// says what enforcement would have done.
    Shadow {
        receipt: LimitReservationV1,
        would_reject: Option<Rejection>,
    },
    /// `mode: off`: admitted without a record.
    NotEnforced,
    Rejected(Rejection),
    /// The reservation ID exists with another request digest.
    IdempotencyConflict {
        existing: LimitReservationV1,
    },
    /// The reservation ID was abandoned; it never reserves.
    Abandoned,
    /// The reservation ID is not the one derived from the owner's identity,
    /// the pair and the idempotency key: it is not in the owner's namespace.
    ForeignId,
    /// No policy was published for the pair.
    NoPolicy,
    /// `units` is 0 or above the largest unit count.
    InvalidUnits,
    /// `minUnits` is 0 or above `units`.
    InvalidMinUnits,
    /// A multi-leg request with a bad leg; nothing was held.
    InvalidLeg {
        index: usize,
        problem: LegProblem,
    },
    /// A multi-leg request refused: `rejection` is the limiting leg's (the
    /// longest `Retry-After` over the refused legs); nothing was held.
    LegRejected {
        index: usize,
        rejection: Rejection,
    },
    Overflow(Overflow),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartOutcome {
    /// `RESERVED → STARTED`, operation bound.
    Started(LimitReservationV1),
    /// Already started (or settled) with this operation ID.
    Duplicate(LimitReservationV1),
    NotFound,
    /// Bound to another operation.
    OperationConflict {
        bound: OperationId,
    },
    /// The hold ran out before the start: the reservation is (now) expired
    /// and its units are back in `available`.
    Expired(LimitReservationV1),
    /// No start from this state (`RELEASED`, `ABANDONED`, …).
    IllegalState(ReservationState),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SettleOutcome {
    Settled(SettlementReceiptV1),
    /// The same settle again: the first settlement receipt; nothing moves.
    Duplicate(SettlementReceiptV1),
    /// A genuine receipt corrected a conservative settlement (once).
    Corrected(SettlementReceiptV1),
    NotFound,
    OperationConflict {
        bound: OperationId,
    },
    /// Settled already with other actual units.
    SettlementConflict(SettlementReceiptV1),
    /// Only a started reservation is settled (start binds the operation first).
    NotStarted(ReservationState),
    IllegalState(ReservationState),
    /// The actual units do not fit the reservation's legs; nothing moved.
    InvalidLeg {
        index: usize,
        problem: LegProblem,
    },
    Overflow(Overflow),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// `RESERVED → RELEASED`, units back in `available`.
    Released(LimitReservationV1),
    Duplicate(LimitReservationV1),
    NotFound,
    /// Only a `RESERVED` item is released: a started one must settle.
    IllegalState(ReservationState),
    Overflow(Overflow),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AbandonOutcome {
    /// The ID was unknown: it is tombstoned and never reserves.
    Tombstoned,
    /// The ID was `RESERVED`: released and marked `ABANDONED`.
    Abandoned(LimitReservationV1),
    /// Already tombstoned or abandoned.
    Duplicate,
    /// Started or finished: its outcome is known, nothing to abandon.
    IllegalState(LimitReservationV1),
    /// The operator abandons an ID that names nothing.
    NotFound,
    /// The caller does not own the ID (or, for an unknown ID, cannot show it
    /// is derived from its own identity).
    NotOwner,
    Overflow(Overflow),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublishOutcome {
    Published,
    /// The generation is not above the pair's current one.
    GenerationNotRising {
        current: u64,
    },
    /// The policy violates a rule of `admissionBudget.v1`.
    Invalid(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteControlOutcome {
    Done,
    /// Already in the asked state.
    Unchanged,
    NoPolicy,
    /// The generation named is not the pair's current one.
    NotCurrentGeneration {
        current: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnrollOutcome {
    Enrolled,
    AlreadyEnrolled,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterOutcome {
    /// The new boot epoch, bound to the nonce the caller provided.
    Registered {
        boot_epoch: u64,
        boot_nonce: BootNonce,
    },
    UnknownGateway,
    /// The request cannot be a fresh boot: a replay (or a clock too far
    /// off). Nothing changed; the current boot stands.
    Replayed(BootReplay),
    Overflow(Overflow),
}

/// Why a boot registration was taken for a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootReplay {
    /// `requestedAt` is more than [`crate::BOOT_SKEW_MS_MAX`] from `now`.
    OutsideSkew { skew_ms: u64 },
    /// `requestedAt` is not after the current boot's request.
    NotAfterCurrentBoot,
    /// The request nonce is the current boot's.
    SameNonce,
}

/// A shard the lost-shard sweep marked lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostShard {
    pub shard: ShardId,
    pub identity: GatewayIdentity,
    pub boot_epoch: u64,
    pub subject: shard_format::Subject,
    pub route: shard_format::Route,
    pub units: u64,
    pub not_after: shard_format::Timestamp,
}

/// A gateway's request for an emergency shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssueShardRequest {
    pub identity: GatewayIdentity,
    pub boot_epoch: u64,
    pub boot_nonce: BootNonce,
    pub subject: shard_format::Subject,
    pub route: shard_format::Route,
    /// Chosen by the shell (unique); the core only checks it is new.
    pub shard: ShardId,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IssueShardOutcome {
    Issued(Box<EmergencyShardV1>),
    /// The shard ID was issued before to this very request (same identity,
    /// boot and pair): the same shard again, nothing moved.
    Duplicate(Box<EmergencyShardV1>),
    UnknownGateway,
    /// The boot epoch or nonce is not the gateway's current one.
    SupersededBoot {
        current_epoch: u64,
    },
    NoPolicy,
    EmergencyDisabled,
    /// The gateway holds the most open shards allowed for the pair.
    TooManyOpenShards,
    /// The identity's unreconciled, not-lost shards of the pair, over all
    /// its boots, already hold the cap
    /// ([`crate::CentralConfig::unreconciled_shard_units_factor`] ×
    /// `emergencyShardUnits`): receipts, or the oldest shard becoming lost
    /// in `retry_after_seconds`, make room.
    UnreconciledCap {
        retry_after_seconds: u64,
    },
    Rejected(Rejection),
    ShardIdTaken,
    Overflow(Overflow),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReconcileOutcome {
    Reconciled(Reconciliation),
    /// The shard was reconciled already; nothing is re-minted again.
    Duplicate(Reconciliation),
    UnknownShard,
    /// The receipt comes from an identity the shard is not bound to.
    WrongIdentity,
    BadSignature(shard_format::SignatureError),
    /// The receipt's shard facts (subject, route, allocated, boot epoch)
    /// differ from the issued shard's.
    Mismatch(&'static str),
    Overflow(Overflow),
}

/// What one retention sweep ([`crate::CentralLedger::forget_expired`])
/// forgot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForgetOutcome {
    /// Terminal reservations past the retention window.
    pub reservations: usize,
    /// Tombstones past the window.
    pub tombstones: usize,
    /// Reconciled shards, and lost shards never reconciled, past the window.
    pub shards: usize,
    /// Accounts of past epochs or generations folded into their pair's
    /// closed history.
    pub accounts_folded: usize,
}

impl ForgetOutcome {
    /// Records that left the store.
    pub fn forgotten(&self) -> usize {
        self.reservations + self.tombstones + self.shards + self.accounts_folded
    }
}
