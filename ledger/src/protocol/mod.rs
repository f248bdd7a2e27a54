//! The central ledger's protocol: every request as an [`Operation`], what
//! it reads ([`Operation::scope`]), the one [`apply`] that decides it, the
//! [`Reply`], and the reply's wire form ([`Reply::into_answer`]) with its
//! stable [`ErrorCode`]s.
//!
//! The central service, the simulator's central node and the tests all call
//! this same [`apply`]; the service layer only parses, authenticates,
//! draws randomness (boot nonces, shard IDs) into the operation, commits the
//! changes and writes the answer.
//!
//! # Adding an operation
//!
//! 1. The ledger: a method on [`CentralLedger`] with its outcome enum
//!    (`outcomes.rs`), an [`Operation`] variant, its [`Reply`] variant, its
//!    arm in [`apply`], its read set in [`Operation::scope`] and
//!    [`Operation::named_records`], and its wire form in
//!    [`Reply::into_answer`] (`answer.rs`).
//! 2. Its request body (if any) and a typed call in `central-client`.
//! 3. One handler in `central/src/http.rs`.

mod answer;
mod code;
pub mod views;

use std::collections::BTreeSet;

use shard_format::{
    AdmissionBudgetV1, BootNonce, DocumentSigner, DocumentVerifier, GatewayIdentity,
    LimitReservationV1, OperationId, ReservationId, ShardId, ShardTerminalReceiptV1, Timestamp,
};

pub use answer::{About, Answer, Answered, Body, Refusal, RefusalDetails};
pub use code::{ErrorCode, Outcome};
pub use views::Gauges;

use crate::central::{CentralLedger, Transition, epoch_start};
use crate::outcomes::{
    AbandonOutcome, AbandonRequest, Caller, EnrollOutcome, ForgetOutcome, IssueShardOutcome,
    IssueShardRequest, LostShard, PublishOutcome, RateLimitState, ReconcileOutcome,
    RegisterOutcome, ReleaseOutcome, ReserveOutcome, ReserveRequest, RouteControlOutcome,
    SettleActuals, SettleOutcome, StartOutcome,
};
use crate::records::{AccountKey, BootRequest, Change, PairKey, RecordKey};
use views::{AccountsResponse, AuditResponse};

/// One request to the ledger: parsed, authenticated input with everything
/// random already drawn (boot nonces, shard IDs), so applying it is
/// deterministic.
#[derive(Debug, Clone)]
pub enum Operation {
    Publish(Box<AdmissionBudgetV1>),
    Enroll(GatewayIdentity),
    SetAdmissionStopped {
        pair: PairKey,
        generation: u64,
        stopped: bool,
    },
    SetFrozen {
        pair: PairKey,
        frozen: bool,
    },
    /// A reserve; its `owner` is the identity the call is signed with.
    Reserve(ReserveRequest),
    Start {
        reservation: ReservationId,
        operation_id: OperationId,
        deadline_ms: Option<u64>,
        caller: GatewayIdentity,
    },
    Settle {
        reservation: ReservationId,
        operation_id: OperationId,
        actuals: SettleActuals,
        caller: GatewayIdentity,
    },
    Release {
        reservation: ReservationId,
        caller: GatewayIdentity,
    },
    Abandon(AbandonRequest),
    Register {
        identity: GatewayIdentity,
        boot_nonce: BootNonce,
        /// The agent's request nonce and clock (replays are refused).
        request: BootRequest,
    },
    IssueShard(IssueShardRequest),
    Reconcile {
        receipt: Box<ShardTerminalReceiptV1>,
        /// The agent that sent the receipt: only the shard's own identity may.
        caller: GatewayIdentity,
    },
    GetReservation {
        reservation: ReservationId,
        caller: Caller,
    },
    GetAccounts(PairKey),
    IsEnrolled(GatewayIdentity),
    Audit,
    Gauges,
    BeginExpiry,
    CompleteExpiry,
    UsageDeadlines,
    Refill,
    /// The retention sweep: forgets what ended more than the retention
    /// window ago ([`CentralLedger::forget_expired`]).
    Forget,
    /// The lost-shard sweep ([`CentralLedger::mark_lost_shards`]).
    MarkLostShards,
}

impl Operation {
    /// A short stable name, for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Publish(_) => "publish",
            Self::Enroll(_) => "enroll",
            Self::SetAdmissionStopped { .. } => "set_admission_stopped",
            Self::SetFrozen { .. } => "set_frozen",
            Self::Reserve(_) => "reserve",
            Self::Start { .. } => "start",
            Self::Settle { .. } => "settle",
            Self::Release { .. } => "release",
            Self::Abandon(_) => "abandon",
            Self::Register { .. } => "register",
            Self::IssueShard(_) => "issue_shard",
            Self::Reconcile { .. } => "reconcile",
            Self::GetReservation { .. } => "get_reservation",
            Self::GetAccounts(_) => "get_accounts",
            Self::IsEnrolled(_) => "is_enrolled",
            Self::Audit => "audit",
            Self::Gauges => "gauges",
            Self::BeginExpiry => "begin_expiry",
            Self::CompleteExpiry => "complete_expiry",
            Self::UsageDeadlines => "usage_deadlines",
            Self::Refill => "refill",
            Self::Forget => "forget",
            Self::MarkLostShards => "mark_lost_shards",
        }
    }

    /// Whether the operation reads the whole ledger (the audit and the
    /// gauges) rather than a scope of it.
    pub fn reads_everything(&self) -> bool {
        matches!(self, Self::Audit | Self::Gauges)
    }

    /// Adds what this operation reads to `scope`: a store that loads only
    /// part of the ledger per batch (PostgreSQL) locks and loads exactly
    /// this. Records named only by ID ([`Operation::named_records`]) add
    /// their pairs once the store has looked them up.
    pub fn scope(&self, scope: &mut Scope) {
        match self {
            Self::Publish(policy) => {
                scope
                    .pairs
                    .insert(PairKey::new(policy.subject.clone(), policy.route.clone()));
            }
            Self::Enroll(identity)
            | Self::Register { identity, .. }
            | Self::IsEnrolled(identity) => {
                scope.gateways.insert(identity.clone());
            }
            Self::SetAdmissionStopped { pair, .. } | Self::SetFrozen { pair, .. } => {
                scope.pairs.insert(pair.clone());
            }
            Self::Reserve(request) => {
                // Every leg: its pair, and its ID (derived from the pair).
                for (leg, id) in request.legs().iter().zip(request.leg_ids()) {
                    scope.pairs.insert(leg.pair());
                    scope.reservations.insert(id.clone());
                    scope.reservation_locks.insert(id);
                }
            }
            Self::Abandon(request) => {
                scope.reservations.insert(request.reservation.clone());
                scope.reservation_locks.insert(request.reservation.clone());
            }
            Self::Start { reservation, .. }
            | Self::Settle { reservation, .. }
            | Self::Release { reservation, .. }
            | Self::GetReservation { reservation, .. } => {
                scope.reservations.insert(reservation.clone());
            }
            Self::IssueShard(request) => {
                scope
                    .pairs
                    .insert(PairKey::new(request.subject.clone(), request.route.clone()));
                scope.gateways.insert(request.identity.clone());
                scope.shards.insert(request.shard.clone());
            }
            Self::Reconcile { receipt, .. } => {
                scope.shards.insert(receipt.shard.clone());
            }
            Self::GetAccounts(pair) => {
                scope.pairs.insert(pair.clone());
                scope.all_accounts.insert(pair.clone());
            }
            Self::BeginExpiry | Self::CompleteExpiry | Self::UsageDeadlines => {
                scope.due_sweep = true;
            }
            Self::Refill => scope.refill = true,
            Self::Forget => scope.forget_sweep = true,
            Self::MarkLostShards => scope.lost_sweep = true,
            Self::Audit | Self::Gauges => {}
        }
    }

    /// The records this operation reads by ID, whose pair must be in scope
    /// too: a store looks their pairs up before it locks.
    pub fn named_records(&self) -> Vec<RecordKey> {
        match self {
            Self::Reserve(request) => request
                .leg_ids()
                .into_iter()
                .map(RecordKey::Reservation)
                .collect(),
            Self::Start { reservation, .. }
            | Self::Settle { reservation, .. }
            | Self::Release { reservation, .. }
            | Self::Abandon(AbandonRequest { reservation, .. })
            | Self::GetReservation { reservation, .. } => {
                vec![RecordKey::Reservation(reservation.clone())]
            }
            Self::IssueShard(request) => vec![RecordKey::Shard(request.shard.clone())],
            Self::Reconcile { receipt, .. } => vec![RecordKey::Shard(receipt.shard.clone())],
            _ => Vec::new(),
        }
    }

    /// Whether the operation names its own pair, so that its named records
    /// need a look-up only when it is retried (a record found under another
    /// pair on the first try sends it to a later batch).
    pub fn names_its_pair(&self) -> bool {
        matches!(self, Self::Reserve(_) | Self::IssueShard(_))
    }
}

/// What one batch of operations reads: a store that holds only part of the
/// ledger in memory locks and loads this before it applies the batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scope {
    /// Pairs to lock and load (policies, pair row, current and live
    /// accounts, live reservations, every account holding an open shard
    /// (neither reconciled nor lost: what the cap on a gateway's
    /// unreconciled shard units counts), and every shard of the loaded
    /// accounts).
    pub pairs: BTreeSet<PairKey>,
    /// Pairs whose every account is loaded (for views).
    pub all_accounts: BTreeSet<PairKey>,
    /// Reservation IDs whose reservation and tombstone are loaded.
    pub reservations: BTreeSet<ReservationId>,
    /// Reservation IDs to lock (creating a reservation or a tombstone).
    pub reservation_locks: BTreeSet<ReservationId>,
    /// Shards loaded by ID.
    pub shards: BTreeSet<ShardId>,
    /// Gateways to lock and load.
    pub gateways: BTreeSet<GatewayIdentity>,
    /// The expiry and usage-deadline workers run: the store adds the pairs
    /// with reservations due.
    pub due_sweep: bool,
    /// The refill worker runs: the store adds the next pairs of its cursor.
    pub refill: bool,
    /// The retention sweep runs: the store adds the records that ended
    /// before `now − retention` (at most `sweep_batch_max`, oldest first),
    /// their pairs with every account of those pairs, and locks their IDs.
    pub forget_sweep: bool,
    /// The lost-shard sweep runs: the store adds the pairs with open
    /// shards whose `notAfter` is at or before `now − shard_lost_grace_ms`.
    pub lost_sweep: bool,
}

impl Scope {
    /// The scope of a batch of operations.
    pub fn of<'a>(operations: impl IntoIterator<Item = &'a Operation>) -> Self {
        let mut scope = Self::default();
        for operation in operations {
            operation.scope(&mut scope);
        }
        scope
    }

    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// What an operation came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Publish(PublishOutcome),
    Enroll(EnrollOutcome),
    RouteControl(RouteControlOutcome),
    Reserve(ReserveOutcome),
    Start(StartOutcome),
    Settle(SettleOutcome),
    Release(ReleaseOutcome),
    Abandon(AbandonOutcome),
    Register(RegisterOutcome),
    IssueShard(IssueShardOutcome),
    Reconcile(ReconcileOutcome),
    Reservation {
        receipt: Option<LimitReservationV1>,
        tombstoned: bool,
    },
    Accounts(Option<AccountsResponse>),
    IsEnrolled(bool),
    Audit(AuditResponse),
    Gauges(Gauges),
    /// A worker's sweep: how many items it moved.
    Swept(usize),
    /// The retention sweep: what it forgot.
    Forgotten(ForgetOutcome),
    /// The caller does not own the reservation it named; nothing was read
    /// or changed. On the wire it is the answer for a missing reservation,
    /// so another identity's reservations stay unseen.
    NotOwner {
        reservation: ReservationId,
        caller: Caller,
    },
    /// The lost-shard sweep: the shards it marked lost.
    ShardsLost(Vec<LostShard>),
}

/// What a shell lends the ledger: the central ledger's shard-signing key,
/// and the verifier of gateway signatures. The ledger checks that a
/// receipt's key is the identity its shard is bound to before it asks
/// `gateway_verifier`, so that verifier may accept any well-formed gateway
/// key.
#[derive(Clone, Copy)]
pub struct Context<'a> {
    pub signer: &'a dyn DocumentSigner,
    pub gateway_verifier: &'a dyn DocumentVerifier,
}

impl std::fmt::Debug for Context<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("signer", self.signer.key_id())
            .finish_non_exhaustive()
    }
}

fn take<O>(transition: Transition<O>, wrap: impl FnOnce(O) -> Reply) -> (Reply, Vec<Change>) {
    (wrap(transition.outcome), transition.changes)
}

/// Applies `operation` to `ledger` at `now`: the reply, and the changes to
/// commit before the reply is released.
pub fn apply(
    ledger: &mut CentralLedger,
    operation: Operation,
    now: Timestamp,
    context: Context<'_>,
) -> (Reply, Vec<Change>) {
    match operation {
        Operation::Publish(policy) => take(ledger.publish_policy(*policy, now), Reply::Publish),
        Operation::Enroll(identity) => take(ledger.enroll_gateway(identity, now), Reply::Enroll),
        Operation::SetAdmissionStopped {
            pair,
            generation,
            stopped,
        } => take(
            ledger.set_admission_stopped(&pair, generation, stopped),
            Reply::RouteControl,
        ),
        Operation::SetFrozen { pair, frozen } => {
            take(ledger.set_frozen(&pair, frozen), Reply::RouteControl)
        }
        Operation::Reserve(request) => {
            let legs = request.legs();
            let mut transition = ledger.reserve(request, now);
            match &mut transition.outcome {
                ReserveOutcome::Rejected(rejection) => {
                    rejection.rate_limit = rate_limit_state(ledger, &legs[0].pair(), now);
                }
                ReserveOutcome::LegRejected { index, rejection } => {
                    rejection.rate_limit = rate_limit_state(ledger, &legs[*index].pair(), now);
                }
                _ => {}
            }
            take(transition, Reply::Reserve)
        }
        Operation::Start {
            reservation,
            operation_id,
            deadline_ms,
            caller,
        } => {
            if let Some(refused) = not_owner(ledger, &reservation, Caller::Gateway(caller)) {
                return (refused, Vec::new());
            }
            take(
                ledger.start(&reservation, operation_id, deadline_ms, now),
                Reply::Start,
            )
        }
        Operation::Settle {
            reservation,
            operation_id,
            actuals,
            caller,
        } => {
            if let Some(refused) = not_owner(ledger, &reservation, Caller::Gateway(caller)) {
                return (refused, Vec::new());
            }
            take(
                ledger.settle_legs(&reservation, &operation_id, &actuals, now),
                Reply::Settle,
            )
        }
        Operation::Release {
            reservation,
            caller,
        } => {
            if let Some(refused) = not_owner(ledger, &reservation, Caller::Gateway(caller)) {
                return (refused, Vec::new());
            }
            take(ledger.release(&reservation, now), Reply::Release)
        }
        Operation::Abandon(request) => take(ledger.abandon(&request, now), Reply::Abandon),
        Operation::Register {
            identity,
            boot_nonce,
            request,
        } => take(
            ledger.register_gateway(&identity, boot_nonce, request, now),
            Reply::Register,
        ),
        Operation::IssueShard(request) => take(
            ledger.issue_shard(request, context.signer, now),
            Reply::IssueShard,
        ),
        Operation::Reconcile { receipt, caller } => take(
            ledger.reconcile_shard(&receipt, &caller, context.gateway_verifier, now),
            Reply::Reconcile,
        ),
        Operation::GetReservation {
            reservation,
            caller,
        } => {
            if let Some(refused) = not_owner(ledger, &reservation, caller) {
                return (refused, Vec::new());
            }
            (
                Reply::Reservation {
                    receipt: ledger
                        .reservation(&reservation)
                        .map(|record| record.receipt.clone()),
                    tombstoned: ledger.tombstone(&reservation).is_some(),
                },
                Vec::new(),
            )
        }
        Operation::GetAccounts(pair) => (
            Reply::Accounts(views::accounts_view(ledger, &pair)),
            Vec::new(),
        ),
        Operation::IsEnrolled(identity) => (
            Reply::IsEnrolled(ledger.gateway(&identity).is_some()),
            Vec::new(),
        ),
        Operation::Audit => (Reply::Audit(views::audit_view(ledger)), Vec::new()),
        Operation::Gauges => (Reply::Gauges(views::gauges(ledger)), Vec::new()),
        Operation::BeginExpiry => take(ledger.begin_expiry(now), |ids| Reply::Swept(ids.len())),
        Operation::CompleteExpiry => {
            take(ledger.complete_expiry(now), |ids| Reply::Swept(ids.len()))
        }
        Operation::UsageDeadlines => take(ledger.handle_usage_deadlines(now), |ids| {
            Reply::Swept(ids.len())
        }),
        Operation::Refill => take(ledger.handle_refill(now), |()| Reply::Swept(0)),
        Operation::Forget => take(ledger.forget_expired(now), Reply::Forgotten),
        Operation::MarkLostShards => take(ledger.mark_lost_shards(now), Reply::ShardsLost),
    }
}

/// The [`Reply::NotOwner`] to answer with when `caller` may not act on
/// `reservation` ([`CentralLedger::may_act_on`]); nothing is changed.
fn not_owner(ledger: &CentralLedger, reservation: &ReservationId, caller: Caller) -> Option<Reply> {
    (!ledger.may_act_on(reservation, &caller)).then(|| Reply::NotOwner {
        reservation: reservation.clone(),
        caller,
    })
}

/// Seconds to refill `units` at the policy's rate, rounded up (at least 1).
fn refill_seconds(policy: &AdmissionBudgetV1, units: u64) -> u64 {
    if policy.refill.units == 0 {
        return policy.accounting_epoch_ms.div_ceil(1000).max(1);
    }
    units
        .div_ceil(policy.refill.units)
        .saturating_mul(policy.refill.interval_ms)
        .div_ceil(1000)
        .max(1)
}

/// The caller's own subject's limit state: its policy's burst and refill
/// window, and what its current account has available.
fn rate_limit_state(
    ledger: &CentralLedger,
    pair: &PairKey,
    now: Timestamp,
) -> Option<RateLimitState> {
    let policy = ledger.policy(pair)?;
    let key = AccountKey {
        pair: pair.clone(),
        accounting_epoch: epoch_start(now, policy.accounting_epoch_ms),
        policy_generation: policy.policy_generation,
    };
    let remaining = ledger.account(&key).map_or(0, |terms| terms.available);
    Some(RateLimitState {
        quota: policy.burst,
        window_seconds: refill_seconds(policy, policy.burst),
        remaining,
    })
}
