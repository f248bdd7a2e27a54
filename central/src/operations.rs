//! What the HTTP shell asks of the ledger, and what comes back.
//!
//! An [`Operation`] is parsed, authenticated input with everything random
//! already drawn (boot nonces, shard IDs): applying it is deterministic.
//! [`apply`] feeds it to a [`CentralLedger`] with `now` and returns the
//! [`Reply`] and the changes to commit before anyone sees the reply. Every
//! decision is the ledger's; this module only picks the operation and shapes
//! read-only views.

use std::collections::BTreeMap;

use central_client::wire::{
    AccountView, AccountsResponse, AuditGeneration, AuditPair, AuditResponse, AuditViolation,
};
use ledger::invariants::{Violation, audit};
use ledger::{
    AbandonOutcome, AccountKey, AccountTerms, CentralLedger, Change, EnrollOutcome,
    IssueShardOutcome, IssueShardRequest, PairKey, PairRecord, PublishOutcome, ReconcileOutcome,
    RegisterOutcome, ReleaseOutcome, ReserveOutcome, ReserveRequest, RouteControlOutcome,
    SettleOutcome, ShardRecord, StartOutcome, Transition, epoch_start,
};
use shard_format::{
    AdmissionBudgetV1, BootNonce, Ed25519Signer, Ed25519Verifier, EmergencyShardV1,
    GatewayIdentity, LimitReservationV1, OperationId, ReservationId, ShardTerminalReceiptV1,
    Timestamp,
};

/// One request to the ledger.
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
    Reserve(ReserveRequest),
    Start {
        reservation: ReservationId,
        operation_id: OperationId,
        deadline_ms: Option<u64>,
    },
    Settle {
        reservation: ReservationId,
        operation_id: OperationId,
        actual_units: u64,
    },
    Release(ReservationId),
    Abandon(ReservationId),
    Register {
        identity: GatewayIdentity,
        boot_nonce: BootNonce,
    },
    IssueShard(IssueShardRequest),
    Reconcile {
        receipt: Box<ShardTerminalReceiptV1>,
        /// The agent that sent the receipt: only the shard's own identity may.
        caller: GatewayIdentity,
    },
    GetReservation(ReservationId),
    GetAccounts(PairKey),
    IsEnrolled(GatewayIdentity),
    Audit,
    Gauges,
    BeginExpiry,
    CompleteExpiry,
    UsageDeadlines,
    Refill,
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
            Self::Release(_) => "release",
            Self::Abandon(_) => "abandon",
            Self::Register { .. } => "register",
            Self::IssueShard(_) => "issue_shard",
            Self::Reconcile { .. } => "reconcile",
            Self::GetReservation(_) => "get_reservation",
            Self::GetAccounts(_) => "get_accounts",
            Self::IsEnrolled(_) => "is_enrolled",
            Self::Audit => "audit",
            Self::Gauges => "gauges",
            Self::BeginExpiry => "begin_expiry",
            Self::CompleteExpiry => "complete_expiry",
            Self::UsageDeadlines => "usage_deadlines",
            Self::Refill => "refill",
        }
    }
}

/// The caller's own limit state on a 429, for the `RateLimit` fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateLimitState {
    /// The policy's `burst`.
    pub quota: u64,
    /// Seconds a full `burst` takes to refill.
    pub window_seconds: u64,
    /// `available` in the pair's current account.
    pub remaining: u64,
}

/// Totals for the Prometheus gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gauges {
    pub debt_outstanding: u64,
    pub frozen_routes: u64,
    pub shard_units_out: u64,
    pub open_shards: u64,
    pub units_reserved: u64,
}

/// What an operation came to.
#[derive(Debug, Clone)]
pub enum Reply {
    Publish(PublishOutcome),
    Enroll(EnrollOutcome),
    RouteControl(RouteControlOutcome),
    Reserve {
        outcome: ReserveOutcome,
        rate_limit: Option<RateLimitState>,
    },
    Start(StartOutcome),
    Settle(SettleOutcome),
    Release(ReleaseOutcome),
    Abandon(AbandonOutcome),
    Register(RegisterOutcome),
    IssueShard(IssueShardOutcome),
    /// The shard ID was issued before, to the same gateway boot and pair.
    ShardDuplicate(Box<EmergencyShardV1>),
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
}

/// What the shell lends the ledger: the shard-signing key.
#[derive(Debug)]
pub struct Context<'a> {
    pub signer: &'a Ed25519Signer,
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
    context: &Context<'_>,
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
            let pair = PairKey::new(request.subject.clone(), request.route.clone());
            let transition = ledger.reserve(request, now);
            let rate_limit = match transition.outcome {
                ReserveOutcome::Rejected(_) => rate_limit_state(ledger, &pair, now),
                _ => None,
            };
            take(transition, |outcome| Reply::Reserve {
                outcome,
                rate_limit,
            })
        }
        Operation::Start {
            reservation,
            operation_id,
            deadline_ms,
        } => take(
            ledger.start(&reservation, operation_id, deadline_ms, now),
            Reply::Start,
        ),
        Operation::Settle {
            reservation,
            operation_id,
            actual_units,
        } => take(
            ledger.settle(&reservation, &operation_id, actual_units, now),
            Reply::Settle,
        ),
        Operation::Release(reservation) => take(ledger.release(&reservation), Reply::Release),
        Operation::Abandon(reservation) => take(ledger.abandon(&reservation, now), Reply::Abandon),
        Operation::Register {
            identity,
            boot_nonce,
        } => take(
            ledger.register_gateway(&identity, boot_nonce),
            Reply::Register,
        ),
        Operation::IssueShard(request) => {
            if let Some(existing) = ledger.shard(&request.shard) {
                let shard = &existing.shard;
                if shard.gateway_identity == request.identity
                    && shard.boot_epoch == request.boot_epoch
                    && shard.boot_nonce == request.boot_nonce
                    && shard.subject == request.subject
                    && shard.route == request.route
                {
                    return (Reply::ShardDuplicate(Box::new(shard.clone())), Vec::new());
                }
            }
            take(
                ledger.issue_shard(request, context.signer, now),
                Reply::IssueShard,
            )
        }
        Operation::Reconcile { receipt, caller } => {
            // The verifier trusts exactly the identity the shard is bound to,
            // and only that identity may hand the receipt in.
            let trusted = ledger
                .shard(&receipt.shard)
                .map(|record| record.shard.gateway_identity.clone());
            if trusted.as_ref().is_some_and(|bound| *bound != caller) {
                return (
                    Reply::Reconcile(ReconcileOutcome::WrongIdentity),
                    Vec::new(),
                );
            }
            let verifier = Ed25519Verifier::new(trusted);
            take(
                ledger.reconcile_shard(&receipt, &verifier, now),
                Reply::Reconcile,
            )
        }
        Operation::GetReservation(reservation) => (
            Reply::Reservation {
                receipt: ledger
                    .reservation(&reservation)
                    .map(|record| record.receipt.clone()),
                tombstoned: ledger.tombstone(&reservation).is_some(),
            },
            Vec::new(),
        ),
        Operation::GetAccounts(pair) => (Reply::Accounts(accounts_view(ledger, &pair)), Vec::new()),
        Operation::IsEnrolled(identity) => (
            Reply::IsEnrolled(ledger.gateway(&identity).is_some()),
            Vec::new(),
        ),
        Operation::Audit => (Reply::Audit(audit_view(ledger)), Vec::new()),
        Operation::Gauges => (Reply::Gauges(gauges(ledger)), Vec::new()),
        Operation::BeginExpiry => take(ledger.begin_expiry(now), |ids| Reply::Swept(ids.len())),
        Operation::CompleteExpiry => take(ledger.complete_expiry(), |ids| Reply::Swept(ids.len())),
        Operation::UsageDeadlines => take(ledger.handle_usage_deadlines(now), |ids| {
            Reply::Swept(ids.len())
        }),
        Operation::Refill => take(ledger.handle_refill(now), |()| Reply::Swept(0)),
    }
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

/// `GET /v1/accounts/{subject}/{route}`: every account of the pair.
pub fn accounts_view(ledger: &CentralLedger, pair: &PairKey) -> Option<AccountsResponse> {
    let record = ledger.pair(pair)?;
    let accounts: Vec<AccountView> = ledger
        .accounts()
        .filter(|(key, _)| &key.pair == pair)
        .map(|(key, terms)| AccountView {
            accounting_epoch: key.accounting_epoch,
            policy_generation: key.policy_generation,
            terms: *terms,
            debt: terms.debt(),
        })
        .collect();
    Some(AccountsResponse {
        subject: pair.subject.clone(),
        route: pair.route.clone(),
        current_generation: record.current_generation,
        admission_stopped: record.admission_stopped,
        frozen: record.frozen,
        debt: accounts
            .iter()
            .fold(0u64, |sum, account| sum.saturating_add(account.debt)),
        accounts,
    })
}

/// The Prometheus gauges over the loaded ledger.
pub fn gauges(ledger: &CentralLedger) -> Gauges {
    let mut gauges = Gauges::default();
    for (_, terms) in ledger.accounts() {
        gauges.debt_outstanding = gauges.debt_outstanding.saturating_add(terms.debt());
        gauges.units_reserved = gauges.units_reserved.saturating_add(terms.reserved);
    }
    gauges.frozen_routes = ledger.pairs().filter(|pair| pair.frozen).count() as u64;
    for record in ledger
        .shards()
        .filter(|record| record.reconciliation.is_none())
    {
        gauges.open_shards += 1;
        gauges.shard_units_out = gauges
            .shard_units_out
            .saturating_add(record.shard.allocated_units);
    }
    gauges
}

/// The audit of a loaded ledger.
pub fn audit_view(ledger: &CentralLedger) -> AuditResponse {
    let report = audit(ledger);
    let pairs = pair_table(
        ledger.pairs(),
        ledger.accounts().map(|(key, terms)| (key, *terms)),
        ledger.shards(),
    );
    AuditResponse {
        ok: report.is_clean(),
        accounts: report.accounts,
        reservations: report.reservations,
        shards: report.shards,
        debt: report.debt,
        pairs,
        violations: report.violations.iter().map(violation_view).collect(),
    }
}

/// The audit of records that could not even be loaded into a ledger (the
/// load itself found the violations).
pub fn audit_of_records(records: &[Change], violations: &[Violation]) -> AuditResponse {
    let pairs_records = records.iter().filter_map(|change| match change {
        Change::Pair(record) => Some(record),
        _ => None,
    });
    let accounts = records.iter().filter_map(|change| match change {
        Change::Account(account) => Some((account.key.clone(), account.terms)),
        _ => None,
    });
    let shards = records.iter().filter_map(|change| match change {
        Change::Shard(record) => Some(record.as_ref()),
        _ => None,
    });
    let pairs = pair_table(pairs_records, accounts, shards);
    let count = |kind: fn(&Change) -> bool| records.iter().filter(|change| kind(change)).count();
    AuditResponse {
        ok: violations.is_empty(),
        accounts: count(|change| matches!(change, Change::Account(_))),
        reservations: count(|change| matches!(change, Change::Reservation(_))),
        shards: count(|change| matches!(change, Change::Shard(_))),
        debt: pairs
            .iter()
            .fold(0u64, |sum, pair| sum.saturating_add(pair.debt)),
        pairs,
        violations: violations.iter().map(violation_view).collect(),
    }
}

fn pair_table<'a>(
    pairs: impl Iterator<Item = &'a PairRecord>,
    accounts: impl Iterator<Item = (AccountKey, AccountTerms)>,
    shards: impl Iterator<Item = &'a ShardRecord>,
) -> Vec<AuditPair> {
    let mut table: BTreeMap<PairKey, AuditPair> = pairs
        .map(|record| {
            (
                record.pair.clone(),
                AuditPair {
                    subject: record.pair.subject.clone(),
                    route: record.pair.route.clone(),
                    current_generation: record.current_generation,
                    admission_stopped: record.admission_stopped,
                    frozen: record.frozen,
                    accounts: 0,
                    reserved: 0,
                    debt: 0,
                    open_shard_units: 0,
                    open_shards: 0,
                    balanced: true,
                    generations: Vec::new(),
                },
            )
        })
        .collect();
    fn generation(line: &mut AuditPair, policy_generation: u64) -> &mut AuditGeneration {
        let index = match line
            .generations
            .binary_search_by_key(&policy_generation, |entry| entry.policy_generation)
        {
            Ok(index) => index,
            Err(index) => {
                line.generations.insert(
                    index,
                    AuditGeneration {
                        policy_generation,
                        reserved: 0,
                        debt: 0,
                        open_shard_units: 0,
                    },
                );
                index
            }
        };
        &mut line.generations[index]
    }
    for (key, terms) in accounts {
        if let Some(line) = table.get_mut(&key.pair) {
            line.accounts += 1;
            line.reserved = line.reserved.saturating_add(terms.reserved);
            line.debt = line.debt.saturating_add(terms.debt());
            line.balanced &= ledger::invariants::check_account(&key, &terms).is_none();
            let entry = generation(line, key.policy_generation);
            entry.reserved = entry.reserved.saturating_add(terms.reserved);
            entry.debt = entry.debt.saturating_add(terms.debt());
        }
    }
    for record in shards.filter(|record| record.reconciliation.is_none()) {
        let key = record.account_key();
        if let Some(line) = table.get_mut(&key.pair) {
            line.open_shards += 1;
            line.open_shard_units = line
                .open_shard_units
                .saturating_add(record.shard.allocated_units);
            let entry = generation(line, key.policy_generation);
            entry.open_shard_units = entry
                .open_shard_units
                .saturating_add(record.shard.allocated_units);
        }
    }
    table.into_values().collect()
}

fn violation_view(violation: &Violation) -> AuditViolation {
    let mut view = AuditViolation {
        subject: None,
        route: None,
        accounting_epoch: None,
        policy_generation: None,
        reservation: None,
        shard: None,
        message: violation.to_string(),
    };
    let account = match violation {
        Violation::AccountEquation { account, .. }
        | Violation::RepaidAboveIssued { account, .. }
        | Violation::ReservedMismatch { account, .. }
        | Violation::RetiredMismatch { account, .. }
        | Violation::UsageMismatch { account, .. }
        | Violation::MissingAccount { account } => Some(account),
        Violation::Settlement { reservation } => {
            view.reservation = Some(reservation.clone());
            None
        }
        Violation::Reconciliation { shard } | Violation::ShardEquation { shard, .. } => {
            view.shard = Some(shard.clone());
            None
        }
    };
    if let Some(account) = account {
        view.subject = Some(account.pair.subject.clone());
        view.route = Some(account.pair.route.clone());
        view.accounting_epoch = Some(account.accounting_epoch);
        view.policy_generation = Some(account.policy_generation);
    }
    view
}
