//! A fully deterministic implementation of Reservoir's accounting: the
//! central ledger, the reservation state machine, the emergency shard ledger
//! and the invariants that bind them. It contains no I/O and does not read a
//! clock or draw random numbers: time, IDs and nonces come in as arguments,
//! and every operation returns its outcome together with the records to
//! commit.
//!
//! - [`CentralLedger`]: accounts keyed by `(subject, route, accountingEpoch,
//!   policyGeneration)`, reservations, gateways and shards. The one place
//!   capacity is spent.
//! - [`ShardBook`]: an agent's local book of one emergency shard (the
//!   holds kept by the caller); [`ShardLedger`]: the book with its holds.
//! - [`invariants`]: the conservation equations as functions, asserted after
//!   every transition in debug builds and run by the operator's audit.
//! - [`protocol`]: every request as an operation, its read set, the one
//!   `apply`, and the wire form of its reply with stable error codes.
//! - [`store`]: the persistence boundary, a trait with written contracts,
//!   an in-memory implementation and the contract tests every store passes.
//!
//! # Calling order
//!
//! A shell calls one operation, commits [`Transition::changes`] in one
//! durable transaction, and only then acts on [`Transition::outcome`]. Several
//! transitions may share one commit (group commit) as long as no outcome is
//! released before that commit. If a commit fails, the shell rebuilds the
//! ledger from the store with [`CentralLedger::from_records`].

mod canaries;
mod central;
mod id_map;
pub mod invariants;
mod outcomes;
pub mod protocol;
mod record_counts;
mod records;
mod shard_ledger;
pub mod store;
mod terms;

pub use canaries::Canaries;
pub use central::{
    AccountState, BOOT_SKEW_MS_MAX, CentralConfig, CentralLedger, LoadError, RETENTION_DEFAULT_MS,
    RETENTION_MARGIN_MS, RetentionTooShort, SHARD_LOST_GRACE_DEFAULT_MS, Transition, check_legs,
    check_policy_retention, epoch_start,
};
pub use id_map::IdMap;
pub use outcomes::{
    AbandonOutcome, AbandonRequest, BootReplay, Caller, Dimension, EnrollOutcome, ForgetOutcome,
    IssueShardOutcome, IssueShardRequest, LegActual, LegAsk, LegProblem, LostShard, PublishOutcome,
    RETRY_AFTER_NO_HORIZON_SECONDS, RateLimitState, ReconcileOutcome, RegisterOutcome, Rejection,
    ReleaseOutcome, ReservationOrigin, ReserveOutcome, ReserveRequest, RouteControlOutcome,
    SettleActuals, SettleOutcome, StartOutcome,
};
pub use record_counts::RecordCounts;
pub use records::{
    AccountKey, AccountRecord, BootRequest, Change, ClosedHistory, ForgottenHistory, GatewayRecord,
    PairKey, PairRecord, Reconciliation, RecordKey, ReservationRecord, ShardRecord,
    TombstoneRecord,
};
pub use shard_ledger::{
    LocalReservation, ShardBook, ShardChange, ShardClosure, ShardLedger, ShardReleaseOutcome,
    ShardReserveOutcome, ShardSettleOutcome, ShardStartOutcome, ShardTransition,
};
pub use terms::{AccountTerms, Overflow, ShardTerms};
