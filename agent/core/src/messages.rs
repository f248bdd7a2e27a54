//! What goes in and out of the agent core: gateway requests and responses,
//! central calls and their results, and journal records.

use std::num::NonZeroU64;

use nonmax::NonMaxU64;

use ledger::protocol::{Answer, Body, ErrorCode};
use serde::{Deserialize, Serialize};
use shard_format::{
    BootNonce, Digest, EmergencyShardV1, IdempotencyKey, LimitReservationV1, OperationId,
    ReservationId, ReservationState, Route, SettlementReceiptV1, ShardId, ShardTerminalReceiptV1,
    Subject, Timestamp,
};
use thin_vec::ThinVec;

use ledger::{
    LegActual, LegAsk, LocalReservation, PairKey, Reconciliation, Rejection, ReservationOrigin,
    ReserveRequest, SettleActuals, ShardChange,
};

/// The two clocks the core is told about. Local decisions (holds, shard
/// validity, deadlines, timers) use `mono_ms`, the agent's monotonic clock;
/// `wall` only stamps documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    pub mono_ms: u64,
    pub wall: Timestamp,
}

/// Identifies one gateway call, chosen by the shell.
pub type CallId = u64;

/// Identifies one central call, chosen by the core.
pub type RequestId = u64;

/// A gateway's request over the agent socket.
#[derive(Debug, Clone, PartialEq)]
pub enum GatewayRequest {
    Reserve(GatewayReserve),
    Get {
        reservation: ReservationId,
    },
    Start {
        reservation: ReservationId,
        operation_id: OperationId,
    },
    Settle {
        reservation: ReservationId,
        operation_id: OperationId,
        actual_units: u64,
    },
    /// A multi-leg reservation's settle: actual units per leg, by pair; a
    /// leg left out settles at its reserved units.
    SettleLegs {
        reservation: ReservationId,
        operation_id: OperationId,
        legs: Vec<LegActual>,
    },
    Release {
        reservation: ReservationId,
    },
    /// The gateway cancelled the work. Recorded; it ends no state.
    Cancel {
        reservation: ReservationId,
    },
}

/// `POST /v1/reservations` on the agent socket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GatewayReserve {
    pub idempotency_key: IdempotencyKey,
    pub subject: Subject,
    pub route: Route,
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = shard_format::limits::UNITS_MAX)))]
    pub units: u64,
    /// A flexible reservation: admit the largest amount from `minUnits` to
    /// `units` that can be covered now (the answer's `reservedUnits`),
    /// rather than refusing what cannot be covered whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = shard_format::limits::UNITS_MAX)))]
    pub min_units: Option<u64>,
    /// How long the gateway will wait for the execution, from the reserve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    /// At least 1, at most the agent's `deadline_ms_max` (default one hour).
    #[cfg_attr(feature = "schema", schemars(range(min = 1)))]
    pub deadline_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u8>,
    /// Free-form description of the request, covered by the request digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<serde_json::Value>,
    /// A multi-leg reservation: the legs after the first (which is
    /// `subject`, `route`, `units`, `minUnits`), admitted all or none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub more_legs: Vec<LegAsk>,
}

impl GatewayReserve {
    /// Every leg, the first included.
    pub fn legs(&self) -> Vec<LegAsk> {
        let mut legs = vec![LegAsk {
            subject: self.subject.clone(),
            route: self.route.clone(),
            units: self.units,
            min_units: self.min_units,
        }];
        legs.extend(self.more_legs.iter().cloned());
        legs
    }
}

/// One leg of a multi-leg reservation, as the agent records and answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentLeg {
    pub subject: Subject,
    pub route: Route,
    /// The units asked for.
    pub units: u64,
    // One word each, as in the record (see `AgentReservation::min_units`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<u64>"))]
    pub min_units: Option<NonMaxU64>,
    /// The leg's grant once admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<u64>"))]
    pub reserved_units: Option<NonMaxU64>,
    /// The leg's actual units once settled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<u64>"))]
    pub actual_units: Option<NonMaxU64>,
    /// Admitted while partitioned: the emergency shard the leg's units
    /// come from (none for a leg on a route that holds nothing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardId>,
    /// The leg's hold in `shard`'s book: see [`AgentReservation::hold`].
    #[serde(skip)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub hold_state: Option<ReservationState>,
    #[serde(skip)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub hold_expires_at_ms: u64,
    #[serde(skip)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub hold_overdraft_units: u64,
}

impl AgentLeg {
    pub fn pair(&self) -> PairKey {
        PairKey::new(self.subject.clone(), self.route.clone())
    }

    /// The smallest grant the leg accepts.
    pub fn floor_units(&self) -> u64 {
        self.min_units.map_or(self.units, u64::from)
    }
}

impl From<LegAsk> for AgentLeg {
    fn from(leg: LegAsk) -> Self {
        Self {
            subject: leg.subject,
            route: leg.route,
            units: leg.units,
            min_units: leg.min_units.map(one_word),
            reserved_units: None,
            actual_units: None,
            shard: None,
            hold_state: None,
            hold_expires_at_ms: 0,
            hold_overdraft_units: 0,
        }
    }
}

/// Where a reservation's units come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", tag = "kind", content = "shard")]
pub enum ReservationPath {
    /// The central ledger.
    Central,
    /// A local emergency shard.
    Shard(ShardId),
}

/// The agent's view of a reservation's life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum AgentState {
    /// Journaled; the reserve is on its way to the central ledger.
    Requested,
    /// The reserve's reply was lost: resolved only by re-sending it under the
    /// same ID or by abandoning the ID.
    ReservationUnknown,
    /// A definite no. A retry under the same idempotency key asks again
    /// with the same reservation ID.
    Rejected,
    Reserved,
    /// The start is on its way to the central ledger.
    Starting,
    Started,
    /// Started, and the executor's outcome is unknown (deadline passed):
    /// only an operation receipt (settle) ends it.
    UsageUnknown,
    /// The settle is journaled and on its way to the central ledger.
    Settling,
    Settled,
    SettledWithDebt,
    /// The release is journaled and on its way.
    Releasing,
    Released,
    Expired,
    Abandoned,
}

impl AgentState {
    /// Units may be in use or held: never counted as unconsumed.
    pub fn is_in_flight(self) -> bool {
        matches!(
            self,
            Self::Requested
                | Self::ReservationUnknown
                | Self::Reserved
                | Self::Starting
                | Self::Started
                | Self::UsageUnknown
                | Self::Settling
                | Self::Releasing
        )
    }

    /// The outcome at the center is not known: only a retry (or an
    /// abandon) or an operation receipt resolves it.
    pub fn is_unknown(self) -> bool {
        matches!(self, Self::ReservationUnknown | Self::UsageUnknown)
    }

    pub fn is_final(self) -> bool {
        matches!(
            self,
            Self::Settled
                | Self::SettledWithDebt
                | Self::Released
                | Self::Expired
                | Self::Abandoned
        )
    }
}

/// An operation the central ledger must still receive for a reservation,
/// retried under the same IDs until acknowledged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum SyncOp {
    Reserve,
    /// The start, with the record's `deadlineMs`.
    // Records journaled before held a copy of the deadline here
    // (`deadline_ms`); reading ignores it, the record has the same value.
    Start,
    Settle,
    Release,
    Abandon,
    /// Ask the central ledger how a `USAGE_UNKNOWN` reservation ended: a
    /// settlement there proves the operation receipt arrived.
    Refresh,
}

/// `value` as one of a record's one-word numbers (see
/// [`AgentReservation::min_units`]). No unit count or time reaches
/// `u64::MAX`; one that did would be kept as `u64::MAX - 1`.
pub fn one_word(value: u64) -> NonMaxU64 {
    NonMaxU64::new(value).unwrap_or(NonMaxU64::MAX)
}

/// The agent's record of one reservation (journaled).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentReservation {
    pub reservation: ReservationId,
    pub idempotency_key: IdempotencyKey,
    pub subject: Subject,
    pub route: Route,
    /// The units asked for.
    pub units: u64,
    // The four optional numbers below are `Option<NonMaxU64>`: one word
    // each, not two, so that the record fits the allocator's 192-byte size
    // class (see the test `a_record_fits_the_192_byte_size_class`). Units
    // are at most `UNITS_MAX` and times are Unix milliseconds: neither
    // reaches `u64::MAX`.
    /// A flexible reservation's floor (see [`GatewayReserve::min_units`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<u64>"))]
    pub min_units: Option<NonMaxU64>,
    /// The units held once admitted: `units`, or a flexible reservation's
    /// grant. Absent before admission (and in journals written before
    /// flexible reservations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<u64>"))]
    pub reserved_units: Option<NonMaxU64>,
    pub request_digest: Digest,
    pub priority: u8,
    /// The gateway's `deadlineMs`.
    // Non-zero (the reserve refuses 0): one word, not two, in a record the
    // agent keeps for every open reservation.
    pub deadline_ms: Option<NonZeroU64>,
    pub path: ReservationPath,
    pub state: AgentState,
    pub operation_id: Option<OperationId>,
    #[cfg_attr(feature = "schema", schemars(with = "Option<u64>"))]
    pub actual_units: Option<NonMaxU64>,
    // The documents are boxed: most records hold none of them, and an
    // agent keeps every open reservation in memory (808 bytes inline each
    // before, 3.1 KB of RSS per open reservation in the memory benchmark).
    /// The central ledger's receipt (central path).
    pub receipt: Option<Box<LimitReservationV1>>,
    pub settlement: Option<Box<SettlementReceiptV1>>,
    pub rejection: Option<Box<Rejection>>,
    /// What the central ledger must still be told.
    pub sync: Option<SyncOp>,
    pub cancel_requested: bool,
    /// Decided under `mode: shadow`: always admitted, nothing spent locally.
    pub shadow: bool,
    /// Boot epoch of the process that made it (0 before registration).
    pub boot_epoch: u64,
    /// Wall time (Unix ms) at which the record came to rest: terminal (or
    /// rejected) with nothing left to tell the central ledger. The
    /// retention window runs from here; `None` while it is live. Absent in
    /// journals written before retention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "schema", schemars(with = "Option<u64>"))]
    pub ended_at: Option<NonMaxU64>,
    /// A multi-leg reservation: every leg, the first (the fields above)
    /// included, with its grant and actual units. Empty for one leg.
    #[serde(default, skip_serializing_if = "ThinVec::is_empty")]
    #[cfg_attr(feature = "schema", schemars(with = "Vec<AgentLeg>"))]
    pub legs: ThinVec<AgentLeg>,
    /// A one-leg shard-path reservation's hold in its shard's book, as
    /// far as the fields above do not already say it (the units held, the
    /// operation, the usage): the hold's own state, its expiry (agent
    /// monotonic ms) and the overdraft its settlement left. A multi-leg
    /// reservation keeps these per leg. The book keeps no copy: an open
    /// emergency reservation is one record, not a record and a hold.
    /// Journaled as [`ShardHold`]s beside the record, not in it.
    #[serde(skip)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub hold_state: Option<ReservationState>,
    #[serde(skip)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub hold_expires_at_ms: u64,
    #[serde(skip)]
    #[cfg_attr(feature = "schema", schemars(skip))]
    pub hold_overdraft_units: u64,
}

impl AgentReservation {
    pub fn pair(&self) -> PairKey {
        PairKey::new(self.subject.clone(), self.route.clone())
    }

    /// The smallest grant the reservation accepts.
    pub fn floor_units(&self) -> u64 {
        self.min_units.map_or(self.units, u64::from)
    }

    /// Takes the central ledger's receipt as the truth, with its grant
    /// (and every leg's, for several legs).
    pub fn accept_receipt(&mut self, receipt: LimitReservationV1) {
        self.reserved_units = Some(one_word(receipt.reserved_units));
        for leg in &mut self.legs {
            let granted = receipt
                .legs
                .iter()
                .flatten()
                .find(|granted| granted.subject == leg.subject && granted.route == leg.route);
            if let Some(granted) = granted {
                leg.reserved_units = Some(one_word(granted.reserved_units));
            }
        }
        self.receipt = Some(Box::new(receipt));
    }

    /// Whether any leg's units come from `shard`.
    pub fn uses_shard(&self, shard: &ShardId) -> bool {
        self.shards_used().any(|used| used == shard)
    }

    /// Every shard [`Self::uses_shard`] names: its path's and its legs'
    /// (one may come twice).
    pub(crate) fn shards_used(&self) -> impl Iterator<Item = &ShardId> + Clone {
        let path = match &self.path {
            ReservationPath::Shard(own) => Some(own),
            ReservationPath::Central => None,
        };
        path.into_iter()
            .chain(self.legs.iter().filter_map(|leg| leg.shard.as_ref()))
    }

    /// The shards its legs' units come from (the one of a one-leg
    /// reservation on the shard path).
    pub fn shards(&self) -> Vec<ShardId> {
        self.shard_ids().cloned().collect()
    }

    /// [`Self::shards`], borrowed.
    pub fn shard_ids(&self) -> impl Iterator<Item = &ShardId> {
        let single = match (&self.path, self.legs.is_empty()) {
            (ReservationPath::Shard(shard), true) => Some(shard),
            _ => None,
        };
        single
            .into_iter()
            .chain(self.legs.iter().filter_map(|leg| leg.shard.as_ref()))
    }

    /// The pair of leg `index` (0 is the reservation's own pair).
    pub fn leg_pair(&self, index: usize) -> Option<PairKey> {
        match self.legs.get(index) {
            Some(leg) => Some(leg.pair()),
            None => (index == 0).then(|| self.pair()),
        }
    }

    /// Whether the record is at rest: it ended (terminal, or a definite
    /// no) and the retry timer has nothing left to do for it. Only such a
    /// record's retention window runs.
    pub fn is_at_rest(&self) -> bool {
        (self.state.is_final() || self.state == AgentState::Rejected)
            && !crate::reservations::needs_retry(self)
    }
}

/// What the agent answers a gateway. The shell maps each to an HTTP status.
#[derive(Debug, Clone, PartialEq)]
pub enum GatewayResponse {
    /// 201 for a new reservation, 200 otherwise.
    Reservation {
        created: bool,
        reservation: Box<AgentReservation>,
    },
    /// 202: recorded durably, to be delivered to the central ledger.
    Accepted(Box<AgentReservation>),
    /// 429: not admitted now.
    Rejected {
        reservation: ReservationId,
        rejection: Rejection,
        /// A multi-leg reservation: the limiting leg's index and pair.
        leg: Option<(usize, PairKey)>,
    },
    /// `mode: off`: admitted without a record.
    PassThrough,
    /// 409: the request contradicts what the agent recorded.
    Conflict { code: ErrorCode, message: String },
    /// 404 `reservation_not_found`.
    NotFound,
    /// The center's definite refusal, passed on with its status and code
    /// (`no_policy` 404, `idempotency_conflict` 409, …).
    Refused {
        status: u16,
        code: ErrorCode,
        message: String,
    },
    /// 400 (`invalid_units`, `invalid_body`, `invalid_legs`), naming the
    /// field.
    Invalid {
        code: ErrorCode,
        field: String,
        message: String,
    },
    /// 503: nothing can be decided now (central unreachable and no shard,
    /// or the reservation's outcome is unknown). Safe to retry with the same
    /// idempotency key.
    Unavailable {
        code: ErrorCode,
        message: String,
        retry_after_seconds: u64,
    },
}

/// A call to the central ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CentralCall {
    /// Register this boot: the reply carries the new boot epoch and nonce.
    Register,
    Reserve(ReserveRequest),
    Start {
        reservation: ReservationId,
        operation_id: OperationId,
        deadline_ms: Option<u64>,
    },
    Settle {
        reservation: ReservationId,
        operation_id: OperationId,
        actuals: SettleActuals,
    },
    Release {
        reservation: ReservationId,
    },
    /// Tombstone (or release) an ID whose reserve outcome is unknown;
    /// `origin` shows the center the ID is this agent's own.
    Abandon {
        reservation: ReservationId,
        origin: ReservationOrigin,
    },
    /// Read a reservation's receipt.
    Get {
        reservation: ReservationId,
    },
    IssueShard {
        subject: Subject,
        route: Route,
        boot_epoch: u64,
        boot_nonce: BootNonce,
    },
    UploadReceipt(Box<ShardTerminalReceiptV1>),
    /// A cheap probe while partitioned.
    Health,
}

/// A definite answer from the central ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CentralReply {
    Registered {
        boot_epoch: u64,
        boot_nonce: BootNonce,
    },
    /// A reservation receipt (reserve, start, release, abandon; duplicates too).
    Reservation(Box<LimitReservationV1>),
    /// The ID was unknown and is now tombstoned (abandon).
    Tombstoned,
    Rejected(Rejection),
    /// A multi-leg reserve refused: the limiting leg's index and rejection.
    LegRejected {
        index: usize,
        rejection: Rejection,
    },
    Settled(Box<SettlementReceiptV1>),
    Shard(Box<EmergencyShardV1>),
    /// The receipt was reconciled (now or before).
    ReceiptAccepted(Box<Reconciliation>),
    Healthy,
    /// `mode: off` at the center: nothing was recorded (a reserve).
    NotEnforced,
    /// A 400 naming the field at fault (a leg the center judged: a pair
    /// without a policy), passed on to the gateway as it came.
    Invalid {
        code: ErrorCode,
        field: String,
        message: String,
    },
    /// A definite refusal (4xx): conflict, not found, emergency disabled …
    /// with the center's status, passed on to the gateway as it came.
    Refused {
        status: u16,
        code: ErrorCode,
        message: String,
    },
}

impl CentralReply {
    /// Reads the central ledger's answer ([`ledger::protocol::Answer`], the
    /// wire form of every reply) as the core needs it. The one mapping: the
    /// daemon reads HTTP answers through it, the simulator's central node
    /// the answers of the very same `ledger::protocol::apply`.
    pub fn from_answer(answer: Answer) -> Self {
        match answer {
            Ok(answered) => match answered.body {
                Body::Reservation(receipt) => Self::Reservation(receipt),
                Body::Settlement(receipt) => Self::Settled(receipt),
                Body::Shard(shard) => Self::Shard(shard),
                Body::Boot(boot) => Self::Registered {
                    boot_epoch: boot.boot_epoch,
                    boot_nonce: boot.boot_nonce,
                },
                Body::Reconciled(done) => Self::ReceiptAccepted(Box::new(done.reconciliation)),
                // A reserved ID was released by the abandon: its receipt
                // is the truth. Otherwise the ID is tombstoned.
                Body::Abandon(abandon) => match abandon.receipt {
                    Some(receipt) => Self::Reservation(receipt),
                    None => Self::Tombstoned,
                },
                Body::NotEnforced(_) => Self::NotEnforced,
                Body::Published(_)
                | Body::Enrolled(_)
                | Body::RouteControl(_)
                | Body::Accounts(_)
                | Body::Audit(_) => Self::Refused {
                    status: 500,
                    code: ErrorCode::Internal,
                    message: "an operator answer to an agent call".to_owned(),
                },
            },
            Err(refusal) => {
                if let Some(rejection) = refusal.rejection() {
                    return match refusal.details.leg {
                        Some(index) => Self::LegRejected { index, rejection },
                        None => Self::Rejected(rejection),
                    };
                }
                // A refusal that proves how the reservation ended (a start
                // that lost against expiry, an abandon of a known outcome).
                if let Some(receipt) = refusal.details.receipt {
                    return Self::Reservation(receipt);
                }
                if refusal.status == 400
                    && let Some(field) = refusal.details.field
                {
                    return Self::Invalid {
                        code: refusal.error,
                        field,
                        message: refusal.message,
                    };
                }
                Self::Refused {
                    status: refusal.status,
                    code: refusal.error,
                    message: refusal.message,
                }
            }
        }
    }
}

/// What became of a central call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CentralResult {
    Reply(CentralReply),
    /// Timed out or the connection broke after sending: the call may or may
    /// not have taken effect.
    OutcomeUnknown,
}

/// A shard the agent accepted, with what it knows locally.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AcceptedShard {
    pub shard: EmergencyShardV1,
    /// Monotonic ms until which this process may admit from it (judged on
    /// the monotonic clock from receipt, minus the skew margin).
    pub usable_until_ms: u64,
}

/// One journaled record; a later record with the same key replaces it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind", content = "record")]
pub enum JournalRecord {
    /// A reservation's record with its holds: one record for everything an
    /// admission step changes in the reservation and in the shard books
    /// its units come from (the books' totals are `ShardBook` records).
    ReservationWithHolds {
        record: Box<AgentReservation>,
        holds: Vec<ShardHold>,
    },
    /// A reservation's record as journals wrote it before holds joined
    /// it (a hold was a `ShardBook` record of its own): read, no longer
    /// written.
    Reservation(Box<AgentReservation>),
    Shard(Box<AcceptedShard>),
    /// A shard book's totals (`ShardChange::Book`), or a hold as journals
    /// wrote it before holds joined their reservation's record
    /// (`ShardChange::Reservation`: read, no longer written).
    ShardBook {
        shard: ShardId,
        change: ShardChange,
    },
    /// The highest fence accepted for a pair.
    Fence {
        pair: PairKey,
        fence: u64,
    },
    /// A signed terminal receipt and whether the central ledger acknowledged it.
    TerminalReceipt {
        receipt: Box<ShardTerminalReceiptV1>,
        acknowledged: bool,
    },
    /// The record under this key is forgotten (its retention window
    /// passed): a journal deletes the key instead of storing this record.
    Forget(JournalKey),
}

/// A reservation's record in the book of one shard its units come from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ShardHold {
    pub shard: ShardId,
    pub local: LocalReservation,
}

/// The natural key of a [`JournalRecord`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind", content = "key")]
pub enum JournalKey {
    Reservation(ReservationId),
    Shard(ShardId),
    ShardBook(ShardId),
    /// A hold journaled as a record of its own, as journals did before
    /// holds joined their reservation's record.
    ShardReservation(ShardId, ReservationId),
    Fence(PairKey),
    TerminalReceipt(ShardId),
}

impl JournalRecord {
    pub fn key(&self) -> JournalKey {
        match self {
            Self::ReservationWithHolds { record, .. } | Self::Reservation(record) => {
                JournalKey::Reservation(record.reservation.clone())
            }
            Self::Shard(accepted) => JournalKey::Shard(accepted.shard.shard.clone()),
            Self::ShardBook { shard, change } => match change {
                ShardChange::Book { .. } => JournalKey::ShardBook(shard.clone()),
                ShardChange::Reservation(LocalReservation { reservation, .. }) => {
                    JournalKey::ShardReservation(shard.clone(), reservation.clone())
                }
            },
            Self::Fence { pair, .. } => JournalKey::Fence(pair.clone()),
            Self::TerminalReceipt { receipt, .. } => {
                JournalKey::TerminalReceipt(receipt.shard.clone())
            }
            Self::Forget(key) => key.clone(),
        }
    }
}

/// Records to commit together; effects wait for `seq` to be committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalBatch {
    pub seq: u64,
    pub records: Vec<JournalRecord>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The agent keeps one boxed record per open reservation: at 192 bytes
    /// or less the allocator serves it from its 192-byte size class, one
    /// class below the 224 that 200 bytes already take (about 3 MiB more
    /// at 100,000 open reservations). It is 192 with identifiers one
    /// pointer wide, a shard hold's own fields (which took a hash table's
    /// 56-byte slot in the shard's book before) and its four optional
    /// numbers one word each.
    #[test]
    fn a_record_fits_the_192_byte_size_class() {
        assert!(
            size_of::<AgentReservation>() <= 192,
            "{} bytes",
            size_of::<AgentReservation>()
        );
    }

    /// The one-word numbers read and write as plain integers: a journal or
    /// an answer written before them reads the same.
    #[test]
    fn one_word_numbers_read_as_integers() {
        let leg: AgentLeg = serde_json::from_str(
            r#"{"subject":"tenant-a","route":"chat","units":9,"minUnits":1,"reservedUnits":0,"actualUnits":18446744073709551614}"#,
        )
        .expect("reads");
        assert_eq!(leg.min_units, Some(one_word(1)));
        assert_eq!(leg.reserved_units, Some(one_word(0)));
        assert_eq!(leg.actual_units, Some(one_word(u64::MAX - 1)));
        assert_eq!(
            serde_json::to_value(&leg).expect("writes")["actualUnits"],
            serde_json::json!(u64::MAX - 1)
        );
        // `u64::MAX` is no unit count: refused, not taken as absent.
        assert!(
            serde_json::from_str::<AgentLeg>(
                r#"{"subject":"tenant-a","route":"chat","units":9,"actualUnits":18446744073709551615}"#,
            )
            .is_err()
        );
        assert_eq!(one_word(u64::MAX), one_word(u64::MAX - 1));
    }

    /// A start's sync operation once carried a copy of the deadline;
    /// records journaled then still read, and a start is written without it.
    #[test]
    fn a_start_written_with_its_deadline_still_reads() {
        let old: SyncOp =
            serde_json::from_str(r#"{"kind":"start","deadline_ms":5000}"#).expect("reads");
        assert_eq!(old, SyncOp::Start);
        assert_eq!(
            serde_json::to_string(&SyncOp::Start).expect("writes"),
            r#"{"kind":"start"}"#
        );
    }
}
