//! The central ledger: the one place that spends capacity.
//!
//! [`CentralLedger`] holds every record in memory and changes them only
//! through its operations. Each operation is one atomic transition: it takes
//! the request and `now`, validates in a fixed order (each check a named
//! outcome), and only past the last check changes state. It returns a
//! [`Transition`]: the outcome and exactly the records that must be committed
//! together before anyone is answered.
//!
//! If a commit fails the shell must drop this value and rebuild it from the
//! store ([`CentralLedger::from_records`]): the in-memory state is ahead of
//! the durable one.

use std::collections::{BTreeMap, BTreeSet};

use shard_format::{
    AdmissionBudgetV1, BootNonce, Document, EmergencyMode, EmergencyShardV1, GatewayIdentity,
    LimitReservationV1, OperationId, Refill, ReservationId, ReservationState, RouteMode,
    SettlementReceiptV1, ShardId, ShardTerminalReceiptV1, Signature, Timestamp, document_digest,
    limits::{LEGS_MAX, UNITS_MAX},
    sign_document, verify_document,
};

use crate::IdMap;
use crate::invariants::{self, Violation};
use crate::outcomes::{
    AbandonOutcome, AbandonRequest, BootReplay, Caller, Dimension, EnrollOutcome, ForgetOutcome,
    IssueShardOutcome, IssueShardRequest, LegAsk, LegProblem, LostShard, PublishOutcome,
    ReconcileOutcome, RegisterOutcome, Rejection, ReleaseOutcome, ReserveOutcome, ReserveRequest,
    RouteControlOutcome, SettleActuals, SettleOutcome, StartOutcome,
};
use crate::record_counts::{Count, RecordCounts};
use crate::records::{
    AccountKey, AccountRecord, BootRequest, Change, ClosedHistory, ForgottenHistory, GatewayRecord,
    PairKey, PairRecord, Reconciliation, RecordKey, ReservationRecord, ShardRecord,
    TombstoneRecord,
};
use crate::terms::{AccountTerms, Overflow, add, sub};

/// Limits of the central ledger that are not policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CentralConfig {
    /// Open (unreconciled) shards one gateway boot may hold per pair: two
    /// lets an agent refresh a shard before the old one runs out.
    pub open_shards_per_gateway_pair_max: usize,
    /// Most reservations one sweep call moves (and most records one
    /// retention sweep forgets), so a tick stays short.
    pub sweep_batch_max: usize,
    /// The idempotency window: terminal reservations, tombstones and
    /// reconciled shards are forgotten this long after they ended. At least
    /// [`CentralLedger::retention_floor_ms`].
    pub retention_ms: u64,
    /// The cap on one identity's unreconciled, not-lost shard units per
    /// pair, over all its boots, as a multiple of the policy's
    /// `emergencyShardUnits`: boot and shard loops cannot retire more.
    pub unreconciled_shard_units_factor: u64,
    /// A shard still unreconciled this long after its `notAfter` is marked
    /// lost by the sweep ([`CentralLedger::mark_lost_shards`]).
    pub shard_lost_grace_ms: u64,
}

/// The default grace after a shard's `notAfter` before an unreconciled
/// shard is marked lost: 10 minutes, time for an agent that came back to
/// upload its receipt.
pub const SHARD_LOST_GRACE_DEFAULT_MS: u64 = 10 * 60_000;

/// How far a boot request's `requestedAt` may be from the ledger's `now`
/// (the signature's own skew window, `CREATED_SKEW_SECONDS_MAX`).
pub const BOOT_SKEW_MS_MAX: u64 = 10_000;

/// The default idempotency window: 24 hours.
pub const RETENTION_DEFAULT_MS: u64 = 24 * 3_600_000;

/// What the retention window keeps beyond the longest life of a
/// reservation (`holdTtlMs + executionHardLimitMs`): time for a gateway's
/// last retry, an agent's abandon and clock skew between hosts.
pub const RETENTION_MARGIN_MS: u64 = 30_000;

/// A retention window shorter than a policy needs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "retention {retention_ms} ms is shorter than {floor_ms} ms: policy {subject}/{route} generation {generation} keeps a reservation live for up to holdTtlMs + executionHardLimitMs = {life_ms} ms, plus a margin of {RETENTION_MARGIN_MS} ms"
)]
pub struct RetentionTooShort {
    pub retention_ms: u64,
    pub floor_ms: u64,
    pub life_ms: u64,
    pub subject: shard_format::Subject,
    pub route: shard_format::Route,
    pub generation: u64,
}

impl Default for CentralConfig {
    fn default() -> Self {
        Self {
            open_shards_per_gateway_pair_max: 2,
            sweep_batch_max: 1024,
            retention_ms: RETENTION_DEFAULT_MS,
            unreconciled_shard_units_factor: 2,
            shard_lost_grace_ms: SHARD_LOST_GRACE_DEFAULT_MS,
        }
    }
}

/// An operation's outcome and the records to commit together.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "the changes must be committed before the outcome is acted on"]
pub struct Transition<O> {
    pub outcome: O,
    pub changes: Vec<Change>,
}

/// One account as the ledger holds it: its terms, and what retention
/// needs to know about its records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AccountState {
    pub terms: AccountTerms,
    /// Reservation and shard records of the account still stored (`None`:
    /// unknown, see [`AccountRecord::records`]).
    pub records: Option<u64>,
    pub forgotten: ForgottenHistory,
}

/// A new account: no records yet.
impl Default for AccountState {
    fn default() -> Self {
        Self {
            terms: AccountTerms::default(),
            records: Some(0),
            forgotten: ForgottenHistory::default(),
        }
    }
}

/// A pair's policies, ledger row and accounts.
#[derive(Debug, Clone, Default)]
struct PairState {
    record: Option<PairRecord>,
    policies: BTreeMap<u64, AdmissionBudgetV1>,
    /// Keyed by `(accountingEpoch, policyGeneration)`: oldest first.
    accounts: BTreeMap<(Timestamp, u64), AccountState>,
}

impl PairState {
    fn current_policy(&self) -> Option<&AdmissionBudgetV1> {
        let record = self.record.as_ref()?;
        self.policies.get(&record.current_generation)
    }

    /// Whether a refill at `now` changes this pair: its account for
    /// `now`'s epoch is still to open, or a tick is due. What
    /// [`CentralLedger::refill_pair`] would do nothing for is not due.
    fn refill_due(&self, now: Timestamp) -> bool {
        let (Some(record), Some(policy)) = (&self.record, self.current_policy()) else {
            return false;
        };
        let epoch = epoch_start(now, policy.accounting_epoch_ms);
        if !self
            .accounts
            .contains_key(&(epoch, policy.policy_generation))
        {
            return true;
        }
        ticks_due(record, policy.refill, now) > 0
    }

    fn debt(&self) -> u64 {
        self.accounts.values().fold(0u64, |sum, account| {
            sum.saturating_add(account.terms.debt())
        })
    }
}

/// Why stored records could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The records break an invariant: the ledger must not run on them.
    #[error("stored records break {} invariant(s); first: {}", .0.len(), .0[0])]
    Invariants(Vec<Violation>),
}

/// Whether `policy`'s reservations fit in the retention window.
pub fn check_policy_retention(
    policy: &AdmissionBudgetV1,
    retention_ms: u64,
) -> Result<(), RetentionTooShort> {
    let life_ms = policy
        .hold_ttl_ms
        .saturating_add(policy.execution_hard_limit_ms);
    let floor_ms = life_ms.saturating_add(RETENTION_MARGIN_MS);
    if retention_ms >= floor_ms {
        return Ok(());
    }
    Err(RetentionTooShort {
        retention_ms,
        floor_ms,
        life_ms,
        subject: policy.subject.clone(),
        route: policy.route.clone(),
        generation: policy.policy_generation,
    })
}

/// The central ledger state machine. See the module documentation.
#[derive(Debug, Clone, Default)]
pub struct CentralLedger {
    config: CentralConfig,
    pairs: BTreeMap<PairKey, PairState>,
    /// By ID in a hash map: every operation looks its reservation up, and
    /// an ordered map compared the 35-character IDs some twenty times per
    /// search (docs/benchmarks-history.md). Iteration order is the map's, fixed for a
    /// given history; whoever needs an order sorts. Boxed: the table's
    /// free slots, up to half of it after it doubles, are then a pointer
    /// each rather than a whole record of some 400 bytes.
    reservations: IdMap<ReservationId, Box<ReservationRecord>>,
    tombstones: IdMap<ReservationId, TombstoneRecord>,
    gateways: BTreeMap<GatewayIdentity, GatewayRecord>,
    shards: BTreeMap<ShardId, ShardRecord>,
    /// `RESERVED` items by `expiresAt` (derived; rebuilt on load).
    expiry_queue: BTreeSet<(Timestamp, ReservationId)>,
    /// `EXPIRING` items, whose refund is still to be made (derived).
    expiring: BTreeSet<ReservationId>,
    /// `STARTED` items by usage deadline and `USAGE_UNKNOWN` items by hard
    /// limit (derived).
    usage_queue: BTreeSet<(Timestamp, ReservationId)>,
    /// Terminal reservations, tombstones and reconciled or lost shards by
    /// the time their retention window started (derived).
    retention_queue: BTreeSet<(Timestamp, RecordKey)>,
    /// Open (neither reconciled nor lost) shards by `notAfter` (derived).
    open_shards: BTreeSet<(Timestamp, ShardId)>,
    /// The stored reservations and shards counted by kind, for the gauges
    /// (derived).
    record_counts: RecordCounts,
    /// Unreconciled (open or lost) shards by their gateway and pair
    /// (derived): a shard request counts its gateway's shards of the pair
    /// without a pass over every shard kept (docs/benchmarks-history.md).
    unreconciled_shards: BTreeMap<ShardOwner, BTreeSet<ShardId>>,
    /// Changes of the transition under way.
    pending: Vec<Change>,
    /// Loaded from live records only (settled history left out): the
    /// usage check, which sums that history, cannot run.
    live_only: bool,
    #[cfg(feature = "canaries")]
    canaries: crate::Canaries,
}

/// The gateway a shard is bound to and the pair it was carved for.
type ShardOwner = (GatewayIdentity, PairKey);

fn owner_of(shard: &EmergencyShardV1) -> ShardOwner {
    (
        shard.gateway_identity.clone(),
        PairKey::new(shard.subject.clone(), shard.route.clone()),
    )
}

/// `now` floored to the start of its accounting epoch.
pub fn epoch_start(now: Timestamp, accounting_epoch_ms: u64) -> Timestamp {
    let ms = now.unix_ms();
    Timestamp::from_unix_ms(ms - ms % accounting_epoch_ms.max(1)).unwrap_or(now)
}

/// Whole seconds, rounded up, to mint `missing` units at the policy's rate;
/// `None` if the policy never refills. At least 1.
fn seconds_to_refill(policy: &AdmissionBudgetV1, missing: u64) -> Option<u64> {
    if policy.refill.units == 0 {
        return None;
    }
    let ticks = missing.div_ceil(policy.refill.units);
    let ms = ticks.saturating_mul(policy.refill.interval_ms);
    Some(ms.div_ceil(1000).max(1))
}

fn seconds_until(now: Timestamp, then: Timestamp) -> u64 {
    then.unix_ms()
        .saturating_sub(now.unix_ms())
        .div_ceil(1000)
        .max(1)
}

/// How many refill ticks fell due since the pair's last refill (a policy's
/// interval is positive).
fn ticks_due(record: &PairRecord, refill: Refill, now: Timestamp) -> u64 {
    now.unix_ms()
        .saturating_sub(record.last_refill_at.unix_ms())
        / refill.interval_ms
}

/// The pair's record with its refill clock moved over the ticks due at
/// `now`, and how many there are; `None` when none is due. The clock moves
/// on every tick, minted or not: the record is written even when the
/// account is at its burst.
fn refill_ticks(record: &PairRecord, refill: Refill, now: Timestamp) -> Option<(PairRecord, u64)> {
    let ticks = ticks_due(record, refill, now);
    if ticks == 0 {
        return None;
    }
    let mut moved = record.clone();
    moved.last_refill_at = record
        .last_refill_at
        .saturating_add_ms(ticks.saturating_mul(refill.interval_ms));
    Some((moved, ticks))
}

/// Adds up to `units` to the account's `minted` and `available`, as far as
/// `burst` leaves room above `available + reserved`; returns what it added.
fn mint_up_to_burst(terms: &mut AccountTerms, burst: u64, units: u64) -> Result<u64, Overflow> {
    let room = burst.saturating_sub(add(terms.available, terms.reserved)?);
    let minted = units.min(room);
    terms.minted = add(terms.minted, minted)?;
    terms.available = add(terms.available, minted)?;
    Ok(minted)
}

impl CentralLedger {
    pub fn new(config: CentralConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// Rebuilds the ledger from committed records (a later record with the
    /// same key replaces an earlier one) and audits it.
    pub fn from_records(
        config: CentralConfig,
        records: impl IntoIterator<Item = Change>,
    ) -> Result<Self, LoadError> {
        Self::load(config, records, false)
    }

    /// Rebuilds the part of a ledger that a transition on some pairs can
    /// touch: their policies, pair rows and accounts, every live
    /// reservation and every shard of those accounts, and the gateways and
    /// reservations named by the operations. Settled history may be left
    /// out, so the audit skips the usage check (the full audit over all
    /// records still runs it). This is how a replica over a shared database
    /// loads one batch.
    pub fn from_live_records(
        config: CentralConfig,
        records: impl IntoIterator<Item = Change>,
    ) -> Result<Self, LoadError> {
        Self::load(config, records, true)
    }

    fn load(
        config: CentralConfig,
        records: impl IntoIterator<Item = Change>,
        live_only: bool,
    ) -> Result<Self, LoadError> {
        let mut ledger = Self::new(config);
        ledger.live_only = live_only;
        for change in records {
            ledger.apply(change);
        }
        ledger.pending.clear();
        if !live_only {
            ledger.count_unknown_records();
        }
        let violations = invariants::audit(&ledger).violations;
        if violations.is_empty() {
            Ok(ledger)
        } else {
            Err(LoadError::Invariants(violations))
        }
    }

    /// Counts the records of accounts written before the count existed
    /// (`records: None`): the whole ledger is loaded, so the count is
    /// known. Counts already stored stay, for the audit to check.
    fn count_unknown_records(&mut self) {
        let unknown = self.pairs.values().any(|state| {
            state
                .accounts
                .values()
                .any(|account| account.records.is_none())
        });
        if !unknown {
            // Every ledger written since the count existed: a restart
            // need not walk every record for it.
            return;
        }
        let mut stored: BTreeMap<AccountKey, u64> = BTreeMap::new();
        let keys = self
            .reservations()
            .map(ReservationRecord::account_key)
            .chain(self.shards.values().map(ShardRecord::account_key));
        for key in keys {
            *stored.entry(key).or_default() += 1;
        }
        for (pair, state) in &mut self.pairs {
            for ((epoch, generation), account) in &mut state.accounts {
                if account.records.is_none() {
                    let key = AccountKey {
                        pair: pair.clone(),
                        accounting_epoch: *epoch,
                        policy_generation: *generation,
                    };
                    account.records = Some(stored.get(&key).copied().unwrap_or(0));
                }
            }
        }
    }

    /// Plants known bugs (simulator only).
    #[cfg(feature = "canaries")]
    pub fn plant_canaries(&mut self, canaries: crate::Canaries) {
        self.canaries = canaries;
    }

    #[cfg(feature = "canaries")]
    fn canary(&self, pick: fn(&crate::Canaries) -> bool) -> bool {
        pick(&self.canaries)
    }

    #[cfg(not(feature = "canaries"))]
    fn canary(&self, _pick: fn(&crate::Canaries) -> bool) -> bool {
        false
    }

    /// Whether the ledger holds its whole settled history (see
    /// [`Self::from_live_records`]).
    pub fn holds_history(&self) -> bool {
        !self.live_only
    }

    // ----- views -----

    pub fn config(&self) -> &CentralConfig {
        &self.config
    }

    pub fn policy(&self, pair: &PairKey) -> Option<&AdmissionBudgetV1> {
        self.pairs.get(pair)?.current_policy()
    }

    pub fn policy_at(&self, pair: &PairKey, generation: u64) -> Option<&AdmissionBudgetV1> {
        self.pairs.get(pair)?.policies.get(&generation)
    }

    pub fn pair(&self, pair: &PairKey) -> Option<&PairRecord> {
        self.pairs.get(pair)?.record.as_ref()
    }

    pub fn pairs(&self) -> impl Iterator<Item = &PairRecord> {
        self.pairs
            .values()
            .filter_map(|state| state.record.as_ref())
    }

    /// Every account of every pair, oldest first within a pair.
    pub fn accounts(&self) -> impl Iterator<Item = (AccountKey, &AccountTerms)> {
        self.account_states()
            .map(|(key, account)| (key, &account.terms))
    }

    /// Every account with its retention bookkeeping, oldest first within a
    /// pair.
    pub fn account_states(&self) -> impl Iterator<Item = (AccountKey, &AccountState)> {
        self.pairs.iter().flat_map(|(pair, state)| {
            state
                .accounts
                .iter()
                .map(move |((epoch, generation), account)| {
                    (
                        AccountKey {
                            pair: pair.clone(),
                            accounting_epoch: *epoch,
                            policy_generation: *generation,
                        },
                        account,
                    )
                })
        })
    }

    pub fn account(&self, key: &AccountKey) -> Option<&AccountTerms> {
        self.account_state(key).map(|account| &account.terms)
    }

    pub fn account_state(&self, key: &AccountKey) -> Option<&AccountState> {
        self.pairs
            .get(&key.pair)?
            .accounts
            .get(&(key.accounting_epoch, key.policy_generation))
    }

    /// Outstanding debt of the pair across all its accounts.
    pub fn pair_debt(&self, pair: &PairKey) -> u64 {
        self.pairs.get(pair).map_or(0, PairState::debt)
    }

    pub fn reservation(&self, id: &ReservationId) -> Option<&ReservationRecord> {
        self.reservations.get(id).map(Box::as_ref)
    }

    /// Every reservation, in no particular order.
    pub fn reservations(&self) -> impl Iterator<Item = &ReservationRecord> {
        self.reservations.values().map(Box::as_ref)
    }

    pub fn tombstone(&self, id: &ReservationId) -> Option<&TombstoneRecord> {
        self.tombstones.get(id)
    }

    pub fn tombstone_count(&self) -> u64 {
        self.tombstones.len() as u64
    }

    /// Every tombstone, in no particular order.
    pub fn tombstones(&self) -> impl Iterator<Item = &TombstoneRecord> {
        self.tombstones.values()
    }

    /// Whether `caller` may read or act on reservation `id`: its owner may,
    /// the operator may, and anyone may on what has no owner recorded (an
    /// unknown ID, a record from before reservations had owners). What the
    /// operator may *do* is the operation's business (read and abandon).
    pub fn may_act_on(&self, id: &ReservationId, caller: &Caller) -> bool {
        let Caller::Gateway(identity) = caller else {
            return true;
        };
        if self.canary(|c| c.skip_owner_check) {
            return true;
        }
        let owner = match (self.reservations.get(id), self.tombstones.get(id)) {
            (Some(record), _) => record.owner.as_ref(),
            (None, Some(tombstone)) => tombstone.owner.as_ref(),
            (None, None) => None,
        };
        owner.is_none_or(|owner| owner == identity)
    }

    pub fn gateway(&self, identity: &GatewayIdentity) -> Option<&GatewayRecord> {
        self.gateways.get(identity)
    }

    pub fn gateways(&self) -> impl Iterator<Item = &GatewayRecord> {
        self.gateways.values()
    }

    pub fn shard(&self, id: &ShardId) -> Option<&ShardRecord> {
        self.shards.get(id)
    }

    pub fn shards(&self) -> impl Iterator<Item = &ShardRecord> {
        self.shards.values()
    }

    /// The stored reservations and shards counted by kind, as kept while
    /// the records changed: no pass over them.
    pub fn record_counts(&self) -> RecordCounts {
        self.record_counts
    }

    /// Whether a reserve for the pair could be admitted at all now
    /// (policy enforcing, not stopped, not frozen, no debt).
    pub fn admission_open(&self, pair: &PairKey) -> bool {
        let Some(state) = self.pairs.get(pair) else {
            return false;
        };
        let Some(record) = &state.record else {
            return false;
        };
        !record.frozen && !record.admission_stopped && state.debt() == 0
    }

    // ----- operator operations -----

    /// Publishes a policy generation for its pair. The generation must rise;
    /// the old one stops admitting at once. Opens the current epoch's
    /// account for the new generation.
    pub fn publish_policy(
        &mut self,
        policy: AdmissionBudgetV1,
        now: Timestamp,
    ) -> Transition<PublishOutcome> {
        if let Err(error) = policy.validate() {
            return self.finish(PublishOutcome::Invalid(error.to_string()));
        }
        if let Err(error) = check_policy_retention(&policy, self.config.retention_ms) {
            return self.finish(PublishOutcome::Invalid(error.to_string()));
        }
        let pair = PairKey::new(policy.subject.clone(), policy.route.clone());
        let previous = self.pairs.get(&pair).and_then(|state| state.record.clone());
        if let Some(previous) = &previous
            && policy.policy_generation <= previous.current_generation
        {
            return self.finish(PublishOutcome::GenerationNotRising {
                current: previous.current_generation,
            });
        }
        // After this point, the publish succeeds.
        let record = match previous {
            Some(previous) => PairRecord {
                current_generation: policy.policy_generation,
                admission_stopped: false,
                ..previous
            },
            None => PairRecord {
                pair: pair.clone(),
                current_generation: policy.policy_generation,
                admission_stopped: false,
                frozen: false,
                last_refill_at: now,
                next_fence: 1,
                closed_history: ClosedHistory::default(),
            },
        };
        self.put(Change::Policy(Box::new(policy)));
        self.put(Change::Pair(record));
        if let Err(overflow) = self.current_account(&pair, now) {
            debug_assert!(false, "opening an account overflowed: {overflow}");
        }
        self.finish(PublishOutcome::Published)
    }

    /// Stops (or resumes) admission under the pair's current generation:
    /// the rollback switch. Settlement, debt and reconciliation go on.
    pub fn set_admission_stopped(
        &mut self,
        pair: &PairKey,
        generation: u64,
        stopped: bool,
    ) -> Transition<RouteControlOutcome> {
        let Some(mut record) = self.pair(pair).cloned() else {
            return self.finish(RouteControlOutcome::NoPolicy);
        };
        if record.current_generation != generation {
            return self.finish(RouteControlOutcome::NotCurrentGeneration {
                current: record.current_generation,
            });
        }
        if record.admission_stopped == stopped {
            return self.finish(RouteControlOutcome::Unchanged);
        }
        record.admission_stopped = stopped;
        self.put(Change::Pair(record));
        self.finish(RouteControlOutcome::Done)
    }

    /// Freezes or unfreezes a pair. Unfreezing does not clear debt: admission
    /// stays 0 until it is repaid.
    pub fn set_frozen(&mut self, pair: &PairKey, frozen: bool) -> Transition<RouteControlOutcome> {
        let Some(mut record) = self.pair(pair).cloned() else {
            return self.finish(RouteControlOutcome::NoPolicy);
        };
        if record.frozen == frozen {
            return self.finish(RouteControlOutcome::Unchanged);
        }
        record.frozen = frozen;
        self.put(Change::Pair(record));
        self.finish(RouteControlOutcome::Done)
    }

    /// Enrolls an agent identity so it may register, take shards and hand in
    /// receipts.
    pub fn enroll_gateway(
        &mut self,
        identity: GatewayIdentity,
        now: Timestamp,
    ) -> Transition<EnrollOutcome> {
        if self.gateways.contains_key(&identity) {
            return self.finish(EnrollOutcome::AlreadyEnrolled);
        }
        self.put(Change::Gateway(GatewayRecord {
            identity,
            enrolled_at: now,
            boot_epoch: 0,
            boot_nonce: None,
            last_boot_request: None,
        }));
        self.finish(EnrollOutcome::Enrolled)
    }

    // ----- reservations -----

    /// `reserveCapacity`: the single admission point. A reservation of
    /// several legs (`more_legs`) is admitted whole or not at all: every
    /// leg's gates are judged first, then every leg is written, each as a
    /// reservation of its own pair under the ID its owner derives from that
    /// pair and the shared idempotency key.
    pub fn reserve(
        &mut self,
        request: ReserveRequest,
        now: Timestamp,
    ) -> Transition<ReserveOutcome> {
        let derived = ReservationId::derive(
            &request.owner,
            &request.subject,
            &request.route,
            &request.idempotency_key,
        );
        if derived != request.reservation && !self.canary(|c| c.skip_owner_check) {
            return self.finish(ReserveOutcome::ForeignId);
        }
        if self.tombstones.contains_key(&request.reservation) {
            return self.finish(ReserveOutcome::Abandoned);
        }
        let legs = request.legs();
        let multi = legs.len() > 1;
        let ids = request.leg_ids();
        if !self.canary(|c| c.skip_idempotency_check) {
            if let Some(existing) = self.reservations.get(&request.reservation) {
                let receipt = &existing.receipt;
                let same_request = receipt.request_digest == request.request_digest
                    && legs_asked_alike(receipt, &legs);
                let outcome = if receipt.state == ReservationState::Abandoned {
                    ReserveOutcome::Abandoned
                } else if same_request {
                    ReserveOutcome::Duplicate(receipt.clone())
                } else {
                    ReserveOutcome::IdempotencyConflict {
                        existing: receipt.clone(),
                    }
                };
                return self.finish(outcome);
            }
            // Another leg's ID is taken (the same key was used on that
            // pair alone): the request is not the one that made it.
            for id in &ids[1..] {
                if self.tombstones.contains_key(id) {
                    return self.finish(ReserveOutcome::Abandoned);
                }
                if let Some(existing) = self.reservations.get(id) {
                    let existing = existing.receipt.clone();
                    return self.finish(ReserveOutcome::IdempotencyConflict { existing });
                }
            }
        }
        if let Err((index, problem)) = check_legs(&legs) {
            return self.finish(if multi {
                ReserveOutcome::InvalidLeg { index, problem }
            } else if problem == LegProblem::Units {
                ReserveOutcome::InvalidUnits
            } else {
                ReserveOutcome::InvalidMinUnits
            });
        }
        let mut policies = Vec::with_capacity(legs.len());
        for (index, leg) in legs.iter().enumerate() {
            match self.policy(&leg.pair()) {
                Some(policy) => policies.push(policy.clone()),
                None if multi => {
                    let problem = LegProblem::NoPolicy;
                    return self.finish(ReserveOutcome::InvalidLeg { index, problem });
                }
                None => return self.finish(ReserveOutcome::NoPolicy),
            }
        }
        if policies.iter().all(|policy| policy.mode == RouteMode::Off) {
            return self.finish(ReserveOutcome::NotEnforced);
        }
        let mut accounts = Vec::with_capacity(legs.len());
        for leg in &legs {
            match self.current_account(&leg.pair(), now) {
                Ok(key) => accounts.push(key),
                Err(overflow) => return self.finish(ReserveOutcome::Overflow(overflow)),
            }
        }
        // A leg on a route in `shadow` (or `off`, beside enforced legs) is
        // recorded and holds nothing: only enforced legs decide.
        let enforced: Vec<bool> = policies
            .iter()
            .map(|policy| policy.mode == RouteMode::Enforce)
            .collect();
        let admissions: Vec<Result<u64, Rejection>> = (0..legs.len())
            .map(|index| {
                let generation = if index == 0 {
                    request.policy_generation
                } else {
                    None
                };
                self.admission_check(
                    &policies[index],
                    &accounts[index],
                    &legs[index],
                    generation,
                    now,
                )
            })
            .collect();
        // The limiting leg: the refused one whose retry is furthest away.
        let limiting = |only_enforced: bool| {
            admissions
                .iter()
                .enumerate()
                .filter(|(index, _)| !only_enforced || enforced[*index])
                .filter_map(|(index, admission)| {
                    admission.err().map(|rejection| (index, rejection))
                })
                .max_by_key(|(index, rejection)| {
                    (
                        rejection.retry_after_header_seconds(),
                        std::cmp::Reverse(*index),
                    )
                })
        };
        let hold_ttl_ms = policies
            .iter()
            .map(|policy| {
                request.hold_ttl_ms.map_or(policy.hold_ttl_ms, |asked| {
                    asked.clamp(1, policy.hold_ttl_ms)
                })
            })
            .min()
            .expect("at least one leg");
        let expires_at = now.saturating_add_ms(hold_ttl_ms);
        let mut receipts: Vec<LimitReservationV1> = (0..legs.len())
            .map(|index| LimitReservationV1 {
                schema: Default::default(),
                reservation: ids[index].clone(),
                subject: legs[index].subject.clone(),
                route: legs[index].route.clone(),
                policy_generation: policies[index].policy_generation,
                accounting_epoch: accounts[index].accounting_epoch,
                request_digest: request.request_digest,
                // A leg that holds nothing grants the whole ask: the
                // gateway's traffic is not changed by a policy on trial.
                reserved_units: match (&admissions[index], enforced[index]) {
                    (Ok(granted), true) => *granted,
                    _ => legs[index].units,
                },
                requested_units: legs[index].min_units.map(|_| legs[index].units),
                min_units: legs[index].min_units,
                actual_units: None,
                operation_id: None,
                expires_at,
                state: ReservationState::Reserved,
                legs: None,
            })
            .collect();
        if multi {
            let all: Vec<_> = receipts.iter().map(LimitReservationV1::as_leg).collect();
            for receipt in &mut receipts {
                receipt.legs = Some(all.clone());
            }
        }
        if !enforced.contains(&true) {
            let would_reject = limiting(false).map(|(_, rejection)| rejection);
            for receipt in &receipts {
                self.put_reservation(new_record(receipt.clone(), true, request.owner.clone()));
            }
            let receipt = receipts.swap_remove(0);
            return self.finish(ReserveOutcome::Shadow {
                receipt,
                would_reject,
            });
        }
        if let Some((index, rejection)) = limiting(true) {
            if multi && self.canary(|c| c.admit_legs_before_refusal) {
                let refused = (0..legs.len())
                    .find(|index| enforced[*index] && admissions[*index].is_err())
                    .expect("a leg refused");
                for index in 0..refused {
                    let receipt = receipts[index].clone();
                    if enforced[index] {
                        let mut terms = *self.account(&accounts[index]).expect("current account");
                        terms.available -= receipt.reserved_units;
                        terms.reserved += receipt.reserved_units;
                        self.put_account(accounts[index].clone(), terms);
                    }
                    let record = new_record(receipt, !enforced[index], request.owner.clone());
                    self.put_reservation(record);
                }
            }
            // Opening the epoch's accounts may have written records (a new
            // epoch began); those are not part of the rejection and stay,
            // the reservation itself changed nothing.
            return self.finish(if multi {
                ReserveOutcome::LegRejected { index, rejection }
            } else {
                ReserveOutcome::Rejected(rejection)
            });
        }
        // Every leg is admitted: the new terms of each enforced leg's
        // account first (legs name distinct pairs, so distinct accounts),
        // then the writes, so that an overflow changes nothing.
        let mut held = Vec::with_capacity(legs.len());
        for index in (0..legs.len()).filter(|index| enforced[*index]) {
            let granted = receipts[index].reserved_units;
            let mut terms = *self
                .account(&accounts[index])
                .expect("current account exists");
            debug_assert!(terms.available >= granted);
            terms.available -= granted;
            terms.reserved = match add(terms.reserved, granted) {
                Ok(reserved) => reserved,
                Err(overflow) => return self.finish(ReserveOutcome::Overflow(overflow)),
            };
            held.push((accounts[index].clone(), terms));
        }
        // The receipts are written before `available` drops.
        for (index, receipt) in receipts.iter().enumerate() {
            let record = new_record(receipt.clone(), !enforced[index], request.owner.clone());
            self.put_reservation(record);
        }
        for (key, terms) in held {
            self.put_account(key, terms);
        }
        let receipt = receipts.swap_remove(0);
        self.finish(ReserveOutcome::Reserved(receipt))
    }

    /// The checks of `reserve` on one leg after the request itself is known
    /// valid, in order: generation, units max, then [`Self::pair_gate`] and
    /// [`Self::capacity_check`]. Admitted, it is the grant: all of `units`,
    /// or for a flexible leg the largest amount from `minUnits` to `units`
    /// that the units max and the account's `available` allow.
    fn admission_check(
        &self,
        policy: &AdmissionBudgetV1,
        account_key: &AccountKey,
        leg: &LegAsk,
        policy_generation: Option<u64>,
        now: Timestamp,
    ) -> Result<u64, Rejection> {
        let reject = |dimension| {
            Err(Rejection {
                dimension,
                policy_generation: policy.policy_generation,
                retry_after_seconds: None,
                rate_limit: None,
            })
        };
        if policy_generation.is_some_and(|asked| asked != policy.policy_generation) {
            return reject(Dimension::PolicyGeneration);
        }
        let floor = leg.floor_units();
        if floor > policy.reservation_units_max {
            return reject(Dimension::ReservationUnitsMax);
        }
        let capacity_floor = if self.canary(|c| c.admit_below_floor) {
            1
        } else {
            floor
        };
        if let Some(rejection) = self
            .pair_gate(&account_key.pair, policy, account_key, floor, now)
            .or_else(|| self.capacity_check(policy, account_key, capacity_floor, now))
        {
            return Err(rejection);
        }
        let available = self.account(account_key).map_or(0, |terms| terms.available);
        Ok(leg.units.min(policy.reservation_units_max).min(available))
    }

    /// What closes a pair to any spending of `units`: a rolled-back
    /// generation, a freeze, or debt (admission is 0 until it is repaid).
    fn pair_gate(
        &self,
        pair: &PairKey,
        policy: &AdmissionBudgetV1,
        account_key: &AccountKey,
        units: u64,
        now: Timestamp,
    ) -> Option<Rejection> {
        let state = &self.pairs[pair];
        let record = state
            .record
            .as_ref()
            .expect("a pair with a policy has a record");
        let debt = state.debt();
        let (dimension, retry_after_seconds) = if record.admission_stopped {
            (Dimension::PolicyGeneration, None)
        } else if record.frozen {
            (Dimension::Frozen, None)
        } else if debt > 0 {
            // Refills repay the debt first, then must still cover `units`.
            let needed = debt.saturating_add(units);
            (
                Dimension::Debt,
                self.retry_after(policy, account_key, needed, now),
            )
        } else {
            return None;
        };
        Some(Rejection {
            dimension,
            policy_generation: policy.policy_generation,
            retry_after_seconds,
            rate_limit: None,
        })
    }

    /// Refuses `units` the account does not have `available`.
    fn capacity_check(
        &self,
        policy: &AdmissionBudgetV1,
        account_key: &AccountKey,
        units: u64,
        now: Timestamp,
    ) -> Option<Rejection> {
        let terms = self.account(account_key).copied().unwrap_or_default();
        if terms.available >= units {
            return None;
        }
        let mut retry_after_seconds = self.retry_after(policy, account_key, units, now);
        // Nothing refills (a concurrency limit): units come back as holds
        // end, and every hold not yet started ends within `holdTtlMs`.
        if policy.refill.units == 0 && terms.available.saturating_add(terms.reserved) >= units {
            let by_holds = policy.hold_ttl_ms.div_ceil(1000).max(1);
            retry_after_seconds = Some(retry_after_seconds.map_or(by_holds, |r| r.min(by_holds)));
        }
        Some(Rejection {
            dimension: Dimension::Capacity,
            policy_generation: policy.policy_generation,
            retry_after_seconds,
            rate_limit: None,
        })
    }

    /// A conservative Retry-After for `needed` units (debt to repay plus the
    /// request): the sooner of enough refill ticks beyond what is available
    /// now and the next epoch's opening, if that opening covers `needed`.
    fn retry_after(
        &self,
        policy: &AdmissionBudgetV1,
        account_key: &AccountKey,
        needed: u64,
        now: Timestamp,
    ) -> Option<u64> {
        let available = self.account(account_key).map_or(0, |terms| terms.available);
        let by_refill = seconds_to_refill(policy, needed.saturating_sub(available));
        let next_epoch = account_key
            .accounting_epoch
            .saturating_add_ms(policy.accounting_epoch_ms);
        let by_epoch = (policy.opening >= needed).then(|| seconds_until(now, next_epoch));
        match (by_refill, by_epoch) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// CAS `RESERVED → STARTED`, binding one operation ID. `deadline_ms`
    /// is the caller's execution deadline; past it (capped by the execution
    /// hard limit) without a receipt the reservation becomes `USAGE_UNKNOWN`.
    pub fn start(
        &mut self,
        id: &ReservationId,
        operation_id: OperationId,
        deadline_ms: Option<u64>,
        now: Timestamp,
    ) -> Transition<StartOutcome> {
        let Some(record) = self.reservation(id).cloned() else {
            return self.finish(StartOutcome::NotFound);
        };
        let state = record.receipt.state;
        if let Some(bound) = &record.receipt.operation_id {
            let outcome = if *bound == operation_id {
                StartOutcome::Duplicate(record.receipt)
            } else {
                StartOutcome::OperationConflict {
                    bound: bound.clone(),
                }
            };
            return self.finish(outcome);
        }
        match state {
            ReservationState::Reserved if now < record.receipt.expires_at => {}
            ReservationState::Reserved | ReservationState::Expiring => {
                // The hold ran out: the start lost the race to expiry.
                let legs = self.legs_of(&record);
                return match self.refund_unstarted(legs, ReservationState::Expired, now) {
                    Ok(()) => {
                        let receipt = self.reservations[id].receipt.clone();
                        self.finish(StartOutcome::Expired(receipt))
                    }
                    Err(overflow) => {
                        debug_assert!(false, "refund on expiry overflowed: {overflow}");
                        self.finish(StartOutcome::IllegalState(state))
                    }
                };
            }
            ReservationState::Expired => return self.finish(StartOutcome::Expired(record.receipt)),
            other => return self.finish(StartOutcome::IllegalState(other)),
        }
        // After this point, the start must succeed. Legs start together and
        // share the earliest deadline and hard limit of their policies.
        let legs = self.legs_of(&record);
        let (deadline_ms, hard_limit_ms) = legs
            .iter()
            .map(|leg| {
                let policy = self
                    .policy_at(&leg.account_key().pair, leg.receipt.policy_generation)
                    .expect("a reservation's generation has a policy");
                let hard_limit_ms = policy.execution_hard_limit_ms;
                let deadline_ms = deadline_ms.unwrap_or(policy.hold_ttl_ms).min(hard_limit_ms);
                (deadline_ms, hard_limit_ms)
            })
            .fold((u64::MAX, u64::MAX), |(d, h), (leg_d, leg_h)| {
                (d.min(leg_d), h.min(leg_h))
            });
        for mut leg in legs {
            leg.receipt.state = ReservationState::Started;
            leg.receipt.operation_id = Some(operation_id.clone());
            leg.started_at = Some(now);
            leg.usage_deadline = Some(now.saturating_add_ms(deadline_ms));
            leg.hard_limit_at = Some(now.saturating_add_ms(hard_limit_ms));
            self.put_reservation(leg);
        }
        let receipt = self.reservations[id].receipt.clone();
        self.finish(StartOutcome::Started(receipt))
    }

    /// The records of every leg of `record`'s reservation, in leg order:
    /// `record` alone for one leg. A leg not in memory (forgotten after it
    /// ended, or under a pair a scoped store did not load) is left out.
    fn legs_of(&self, record: &ReservationRecord) -> Vec<ReservationRecord> {
        match &record.receipt.legs {
            None => vec![record.clone()],
            Some(legs) => legs
                .iter()
                .filter_map(|leg| self.reservation(&leg.reservation).cloned())
                .collect(),
        }
    }

    /// Whether every leg of `id`'s reservation is in memory.
    fn all_legs_loaded(&self, id: &ReservationId) -> bool {
        self.reservations.get(id).is_some_and(|record| {
            record.receipt.legs.as_ref().is_none_or(|legs| {
                legs.iter()
                    .all(|leg| self.reservations.contains_key(&leg.reservation))
            })
        })
    }

    /// `settleUsage`: writes the settlement and refunds the unused difference
    /// exactly once. Overage takes `available` first; the rest is debt.
    pub fn settle(
        &mut self,
        id: &ReservationId,
        operation_id: &OperationId,
        actual_units: u64,
        now: Timestamp,
    ) -> Transition<SettleOutcome> {
        self.settle_legs(id, operation_id, &SettleActuals::One(actual_units), now)
    }

    /// [`Self::settle`] with the actual units of each leg: every leg of the
    /// reservation settles in this one transition, a leg left out at its
    /// reserved units.
    pub fn settle_legs(
        &mut self,
        id: &ReservationId,
        operation_id: &OperationId,
        actuals: &SettleActuals,
        now: Timestamp,
    ) -> Transition<SettleOutcome> {
        let Some(record) = self.reservation(id).cloned() else {
            return self.finish(SettleOutcome::NotFound);
        };
        if let Some(bound) = &record.receipt.operation_id
            && bound != operation_id
        {
            return self.finish(SettleOutcome::OperationConflict {
                bound: bound.clone(),
            });
        }
        let per_leg = match actuals_per_leg(&record.receipt, actuals) {
            Ok(per_leg) => per_leg,
            Err((index, problem)) => {
                return self.finish(SettleOutcome::InvalidLeg { index, problem });
            }
        };
        let actual_units = per_leg[&record.receipt.reservation];
        if actual_units > UNITS_MAX {
            return self.finish(SettleOutcome::Overflow(Overflow));
        }
        let legs: Vec<(ReservationRecord, u64)> = self
            .legs_of(&record)
            .into_iter()
            .map(|leg| {
                let actual = per_leg[&leg.receipt.reservation];
                (leg, actual)
            })
            .collect();
        if let Some(settlement) = &record.settlement {
            if settlement.actual_units == actual_units
                && settlement.overdraft_units > 0
                && self.canary(|c| c.skip_debt_on_replayed_settle)
            {
                return self.canary_erase_debt(record);
            }
            // The settlement lists every leg's actual units, so a retry is
            // judged on it alone, even after a leg's record was forgotten.
            let same = match &settlement.legs {
                Some(settled) => settled
                    .iter()
                    .all(|leg| per_leg.get(&leg.reservation) == Some(&leg.actual_units)),
                None => settlement.actual_units == actual_units,
            };
            let outcome = if same {
                SettleOutcome::Duplicate(settlement.clone())
            } else if settlement.conservative && !record.corrected {
                return self.correct(id, legs, now);
            } else {
                SettleOutcome::SettlementConflict(settlement.clone())
            };
            return self.finish(outcome);
        }
        match record.receipt.state {
            ReservationState::Started | ReservationState::UsageUnknown => {}
            ReservationState::Reserved => {
                return self.finish(SettleOutcome::NotStarted(ReservationState::Reserved));
            }
            other => return self.finish(SettleOutcome::IllegalState(other)),
        }
        match self.settle_started(legs, false, now) {
            Ok(()) => {
                let settlement = self.reservations[id].settlement.clone();
                self.finish(SettleOutcome::Settled(
                    settlement.expect("a settled reservation has its settlement"),
                ))
            }
            Err(overflow) => self.finish(SettleOutcome::Overflow(overflow)),
        }
    }

    /// Settles the started legs of one reservation, each at its actual
    /// units. Changes nothing on error: every account's new terms are
    /// computed before any is written.
    fn settle_started(
        &mut self,
        legs: Vec<(ReservationRecord, u64)>,
        conservative: bool,
        now: Timestamp,
    ) -> Result<(), Overflow> {
        let mut planned = Vec::with_capacity(legs.len());
        for (record, actual_units) in &legs {
            let key = record.account_key();
            let reserved = record.receipt.reserved_units;
            let mut overdraft = 0;
            let mut terms = None;
            if !record.shadow {
                let mut new = *self.account(&key).expect("a reservation's account exists");
                new.reserved = sub(new.reserved, reserved)?;
                new.spent = add(new.spent, *actual_units)?;
                if *actual_units <= reserved {
                    new.available = add(new.available, reserved - actual_units)?;
                } else {
                    let overage = actual_units - reserved;
                    let from_available = overage.min(new.available);
                    new.available -= from_available;
                    overdraft = overage - from_available;
                    new.overdraft_issued = add(new.overdraft_issued, overdraft)?;
                }
                terms = Some((key, new));
            }
            planned.push((terms, overdraft));
        }
        let mut settled = Vec::with_capacity(legs.len());
        for ((mut record, actual_units), (terms, overdraft)) in legs.into_iter().zip(planned) {
            if let Some((key, terms)) = terms {
                self.put_account(key, terms);
            }
            let receipt =
                self.settlement_receipt(&record, actual_units, overdraft, conservative, now);
            record.receipt.state = receipt.state;
            record.receipt.actual_units = Some(actual_units);
            record.settlement = Some(receipt);
            record.ended_at = Some(now);
            settled.push((record, overdraft));
        }
        self.put_settled(settled, now);
        Ok(())
    }

    /// Writes settled legs: each settlement lists every leg's (several
    /// legs), then each overdraft is judged against its own pair's policy.
    fn put_settled(&mut self, mut settled: Vec<(ReservationRecord, u64)>, now: Timestamp) {
        if settled.len() > 1 {
            let all: Vec<_> = settled
                .iter()
                .filter_map(|(record, _)| record.settlement.as_ref().map(|s| s.as_leg()))
                .collect();
            for (record, _) in &mut settled {
                if let Some(settlement) = &mut record.settlement {
                    settlement.legs = Some(all.clone());
                }
            }
        }
        for (record, overdraft) in settled {
            self.note_breach(&record, overdraft, now);
            self.put_reservation(record);
        }
    }

    /// A late genuine receipt corrects a conservative settlement, once
    /// (every leg of it at once).
    fn correct(
        &mut self,
        id: &ReservationId,
        legs: Vec<(ReservationRecord, u64)>,
        now: Timestamp,
    ) -> Transition<SettleOutcome> {
        let mut planned = Vec::with_capacity(legs.len());
        for (record, actual_units) in &legs {
            let key = record.account_key();
            let charged = record
                .receipt
                .actual_units
                .unwrap_or(record.receipt.reserved_units);
            let burst = self
                .policy_at(&key.pair, key.policy_generation)
                .map_or(0, |policy| policy.burst);
            let mut overdraft = 0;
            let mut terms = None;
            if !record.shadow {
                let Some(old) = self.account(&key).copied() else {
                    return self.finish(SettleOutcome::IllegalState(record.receipt.state));
                };
                let mut new = old;
                let result = (|| {
                    if *actual_units <= charged {
                        // Refills may have refilled the bucket since the
                        // conservative charge: what the refund would lift
                        // above `burst` undoes those mints instead (never
                        // more than was minted and not spent on repayment).
                        let refund = charged - actual_units;
                        let room = burst.saturating_sub(add(new.available, new.reserved)?);
                        let cut =
                            (refund - refund.min(room)).min(sub(new.minted, new.overdraft_repaid)?);
                        new.spent = sub(new.spent, refund)?;
                        new.available = add(new.available, refund - cut)?;
                        new.minted = sub(new.minted, cut)?;
                    } else {
                        let overage = actual_units - charged;
                        let from_available = overage.min(new.available);
                        new.available -= from_available;
                        overdraft = overage - from_available;
                        new.spent = add(new.spent, overage)?;
                        new.overdraft_issued = add(new.overdraft_issued, overdraft)?;
                    }
                    Ok(())
                })();
                if let Err(overflow) = result {
                    return self.finish(SettleOutcome::Overflow(overflow));
                }
                // A leg corrected to what it was charged changes nothing
                // of its account (only another leg's correction does).
                terms = (new != old).then_some((key, new));
            }
            planned.push((terms, overdraft));
        }
        let mut settled = Vec::with_capacity(legs.len());
        for ((mut record, actual_units), (terms, overdraft)) in legs.into_iter().zip(planned) {
            if let Some((key, terms)) = terms {
                self.put_account(key, terms);
            }
            let receipt = self.settlement_receipt(&record, actual_units, overdraft, false, now);
            record.receipt.state = receipt.state;
            record.receipt.actual_units = Some(actual_units);
            record.settlement = Some(receipt);
            record.corrected = true;
            settled.push((record, overdraft));
        }
        self.put_settled(settled, now);
        let settlement = self.reservations[id].settlement.clone();
        self.finish(SettleOutcome::Corrected(
            settlement.expect("a corrected reservation has its settlement"),
        ))
    }

    fn settlement_receipt(
        &self,
        record: &ReservationRecord,
        actual_units: u64,
        overdraft_units: u64,
        conservative: bool,
        now: Timestamp,
    ) -> SettlementReceiptV1 {
        let receipt = &record.receipt;
        SettlementReceiptV1 {
            schema: Default::default(),
            reservation: receipt.reservation.clone(),
            operation_id: receipt
                .operation_id
                .clone()
                .expect("a settled reservation was started"),
            subject: receipt.subject.clone(),
            route: receipt.route.clone(),
            policy_generation: receipt.policy_generation,
            accounting_epoch: receipt.accounting_epoch,
            reserved_units: receipt.reserved_units,
            actual_units,
            refunded_units: receipt.reserved_units.saturating_sub(actual_units),
            overdraft_units,
            state: if overdraft_units > 0 {
                ReservationState::SettledWithDebt
            } else {
                ReservationState::Settled
            },
            conservative,
            settled_at: now,
            legs: None,
        }
    }

    /// Freezes the pair when an overdraft breaches the policy: above
    /// `overdraftUnitsMax`, or made by an execution past its hard limit.
    fn note_breach(&mut self, record: &ReservationRecord, overdraft: u64, now: Timestamp) {
        if overdraft == 0 {
            return;
        }
        let key = record.account_key();
        let overdraft_max = self
            .policy_at(&key.pair, key.policy_generation)
            .map_or(0, |policy| policy.overdraft_units_max);
        let past_hard_limit = record.hard_limit_at.is_some_and(|limit| now > limit);
        if overdraft > overdraft_max || past_hard_limit {
            let mut pair = self.pair(&key.pair).cloned().expect("pair exists");
            if !pair.frozen {
                pair.frozen = true;
                self.put(Change::Pair(pair));
            }
        }
    }

    /// `RESERVED → RELEASED`: the work never started; all units go back.
    pub fn release(&mut self, id: &ReservationId, now: Timestamp) -> Transition<ReleaseOutcome> {
        let Some(record) = self.reservation(id).cloned() else {
            return self.finish(ReleaseOutcome::NotFound);
        };
        match record.receipt.state {
            ReservationState::Reserved => {}
            ReservationState::Released => {
                return self.finish(ReleaseOutcome::Duplicate(record.receipt));
            }
            other => return self.finish(ReleaseOutcome::IllegalState(other)),
        }
        let legs = self.legs_of(&record);
        match self.refund_unstarted(legs, ReservationState::Released, now) {
            Ok(()) => {
                let receipt = self.reservations[id].receipt.clone();
                self.finish(ReleaseOutcome::Released(receipt))
            }
            Err(overflow) => self.finish(ReleaseOutcome::Overflow(overflow)),
        }
    }

    /// Tombstones an ID whose reserve outcome is unknown to its caller, so a
    /// late duplicate never reserves. A `RESERVED` one is released.
    ///
    /// A gateway abandons only IDs of its own namespace: it shows the
    /// request's origin, from which its identity derives the ID. The
    /// operator abandons any reservation that exists.
    pub fn abandon(
        &mut self,
        request: &AbandonRequest,
        now: Timestamp,
    ) -> Transition<AbandonOutcome> {
        let id = &request.reservation;
        let owner = match &request.caller {
            Caller::Gateway(identity) => {
                let own = request
                    .origin
                    .as_ref()
                    .is_some_and(|origin| origin.derives(identity, id));
                if !own && !self.canary(|c| c.skip_owner_check) {
                    return self.finish(AbandonOutcome::NotOwner);
                }
                Some(identity.clone())
            }
            Caller::Operator => None,
        };
        if !self.may_act_on(id, &request.caller) {
            return self.finish(AbandonOutcome::NotOwner);
        }
        if self.tombstones.contains_key(id) {
            return self.finish(AbandonOutcome::Duplicate);
        }
        let Some(record) = self.reservation(id).cloned() else {
            if owner.is_none() {
                return self.finish(AbandonOutcome::NotFound);
            }
            self.put(Change::Tombstone(TombstoneRecord {
                reservation: id.clone(),
                abandoned_at: now,
                owner,
            }));
            return self.finish(AbandonOutcome::Tombstoned);
        };
        match record.receipt.state {
            ReservationState::Reserved => {}
            ReservationState::Abandoned => return self.finish(AbandonOutcome::Duplicate),
            _ => return self.finish(AbandonOutcome::IllegalState(record.receipt)),
        }
        let legs = self.legs_of(&record);
        match self.refund_unstarted(legs, ReservationState::Abandoned, now) {
            Ok(()) => {
                let receipt = self.reservations[id].receipt.clone();
                self.finish(AbandonOutcome::Abandoned(receipt))
            }
            Err(overflow) => self.finish(AbandonOutcome::Overflow(overflow)),
        }
    }

    /// Moves the units of an unstarted reservation's legs back to
    /// `available` and puts each leg in the terminal `state`, ended at
    /// `now`. Changes nothing on error.
    fn refund_unstarted(
        &mut self,
        legs: Vec<ReservationRecord>,
        state: ReservationState,
        now: Timestamp,
    ) -> Result<(), Overflow> {
        let mut refunds = Vec::with_capacity(legs.len());
        for record in &legs {
            debug_assert!(!record.receipt.state.is_started());
            let units = record.held_units();
            if units > 0 {
                let key = record.account_key();
                let mut terms = *self.account(&key).expect("a reservation's account exists");
                terms.reserved = sub(terms.reserved, units)?;
                terms.available = add(terms.available, units)?;
                refunds.push((key, terms));
            }
        }
        for (key, terms) in refunds {
            self.put_account(key, terms);
        }
        for mut record in legs {
            record.receipt.state = state;
            record.ended_at = Some(now);
            self.put_reservation(record);
        }
        Ok(())
    }

    // ----- workers -----

    /// Expiry, first half: items still `RESERVED` past `expiresAt` become
    /// `EXPIRING` (a start can no longer win them). Returns their IDs.
    pub fn begin_expiry(&mut self, now: Timestamp) -> Transition<Vec<ReservationId>> {
        let due: Vec<ReservationId> = self
            .expiry_queue
            .iter()
            .take_while(|(expires_at, _)| *expires_at <= now)
            .take(self.config.sweep_batch_max)
            .map(|(_, id)| id.clone())
            .collect();
        let mut expiring = Vec::with_capacity(due.len());
        for id in due {
            // Legs expire together: a leg's siblings are due at the same
            // instant, and move with the first of them found.
            if self.reservations[&id].receipt.state != ReservationState::Reserved {
                continue;
            }
            if !self.all_legs_loaded(&id) {
                debug_assert!(false, "a due leg's siblings are not loaded");
                continue;
            }
            let record = ReservationRecord::clone(&self.reservations[&id]);
            for mut leg in self.legs_of(&record) {
                debug_assert_eq!(leg.receipt.state, ReservationState::Reserved);
                leg.receipt.state = ReservationState::Expiring;
                expiring.push(leg.receipt.reservation.clone());
                self.put_reservation(leg);
            }
        }
        let due = expiring;
        if self.canary(|c| c.expire_started) {
            self.canary_expire_started(now);
        }
        self.finish(due)
    }

    /// Expiry, second half: `EXPIRING → EXPIRED`, units back to `available`.
    pub fn complete_expiry(&mut self, now: Timestamp) -> Transition<Vec<ReservationId>> {
        let due: Vec<ReservationId> = self
            .expiring
            .iter()
            .take(self.config.sweep_batch_max)
            .cloned()
            .collect();
        let mut expired = Vec::with_capacity(due.len());
        for id in due {
            let record = ReservationRecord::clone(&self.reservations[&id]);
            if record.receipt.state != ReservationState::Expiring {
                continue; // expired with a sibling leg
            }
            if !self.all_legs_loaded(&id) {
                debug_assert!(false, "an expiring leg's siblings are not loaded");
                continue;
            }
            let legs = self.legs_of(&record);
            let ids: Vec<ReservationId> = legs
                .iter()
                .map(|leg| leg.receipt.reservation.clone())
                .collect();
            match self.refund_unstarted(legs, ReservationState::Expired, now) {
                Ok(()) => expired.extend(ids),
                Err(overflow) => debug_assert!(false, "refund on expiry overflowed: {overflow}"),
            }
        }
        self.finish(expired)
    }

    /// `STARTED` items past their usage deadline become `USAGE_UNKNOWN`
    /// (units stay reserved); `USAGE_UNKNOWN` items past the execution hard
    /// limit are settled conservatively at the full reservation. Returns the
    /// IDs changed.
    pub fn handle_usage_deadlines(&mut self, now: Timestamp) -> Transition<Vec<ReservationId>> {
        let mut changed = Vec::new();
        while changed.len() < self.config.sweep_batch_max {
            let Some((due_at, id)) = self.usage_queue.first().cloned() else {
                break;
            };
            if due_at > now {
                break;
            }
            let record = ReservationRecord::clone(&self.reservations[&id]);
            if !self.all_legs_loaded(&id) {
                debug_assert!(false, "a due leg's siblings are not loaded");
                self.usage_queue.remove(&(due_at, id.clone()));
                continue;
            }
            // Legs share their deadlines and move together.
            let legs = self.legs_of(&record);
            let ids: Vec<ReservationId> = legs
                .iter()
                .map(|leg| leg.receipt.reservation.clone())
                .collect();
            match record.receipt.state {
                ReservationState::Started if self.canary(|c| c.refund_on_timeout) => {
                    let at_zero = legs.into_iter().map(|leg| (leg, 0)).collect();
                    if self.settle_started(at_zero, false, now).is_err() {
                        self.usage_queue.remove(&(due_at, id.clone()));
                    }
                }
                ReservationState::Started => {
                    for mut leg in legs {
                        leg.receipt.state = ReservationState::UsageUnknown;
                        self.put_reservation(leg);
                    }
                }
                ReservationState::UsageUnknown => {
                    let at_reserved = legs
                        .into_iter()
                        .map(|leg| {
                            let reserved = leg.receipt.reserved_units;
                            (leg, reserved)
                        })
                        .collect();
                    if let Err(overflow) = self.settle_started(at_reserved, true, now) {
                        debug_assert!(false, "conservative settlement overflowed: {overflow}");
                        // Leave it queued-out rather than loop forever.
                        self.usage_queue.remove(&(due_at, id.clone()));
                    }
                }
                other => {
                    debug_assert!(false, "usage queue held a {other:?} item");
                    self.usage_queue.remove(&(due_at, id.clone()));
                }
            }
            // Every leg changed, as the expiry sweeps list them.
            for id in ids {
                if !changed.contains(&id) {
                    changed.push(id);
                }
            }
        }
        self.finish(changed)
    }

    /// Refill ticks and epoch openings for every pair: due ticks are minted,
    /// the oldest debt repaid first, the rest capped so that
    /// `available + reserved` stays within `burst`.
    pub fn handle_refill(&mut self, now: Timestamp) -> Transition<()> {
        // The worker runs every 250 ms and a tick is often a second or a
        // minute: most rounds find most pairs with nothing due. Those are
        // passed over in one read of each pair's state, where each cost a
        // clone of its key and four lookups (100,000 pairs: 66 ms a round,
        // now 7; docs/benchmarks-history.md). A pair's refill touches only
        // that pair, so what is due can be read before any is refilled.
        let due: Vec<PairKey> = self
            .pairs
            .iter()
            .filter(|(_, state)| state.refill_due(now))
            .map(|(pair, _)| pair.clone())
            .collect();
        for pair in due {
            if let Err(overflow) = self.refill_pair(&pair, now) {
                debug_assert!(false, "refill overflowed: {overflow}");
            }
        }
        self.finish(())
    }

    fn refill_pair(&mut self, pair: &PairKey, now: Timestamp) -> Result<(), Overflow> {
        // The usual case, in one search for the pair where the steps below
        // take about ten (each by the pair's string key): its account for
        // `now`'s epoch is open and it owes nothing, so a tick moves its
        // clock and mints up to `burst`, nothing else. Opening an account
        // or repaying debt takes the steps (`refill_pair_in_steps`).
        let Some(state) = self.pairs.get(pair) else {
            return Ok(());
        };
        let (Some(record), Some(policy)) = (&state.record, state.current_policy()) else {
            return Ok(());
        };
        let (accounting_epoch, policy_generation) = (
            epoch_start(now, policy.accounting_epoch_ms),
            policy.policy_generation,
        );
        let account = match state.accounts.get(&(accounting_epoch, policy_generation)) {
            Some(account) if state.debt() == 0 => *account,
            _ => return self.refill_pair_in_steps(pair, now),
        };
        let (refill, burst) = (policy.refill, policy.burst);
        let Some((record, ticks)) = refill_ticks(record, refill, now) else {
            return Ok(());
        };
        self.put(Change::Pair(record));
        let mut terms = account.terms;
        let due = ticks.saturating_mul(refill.units).min(UNITS_MAX);
        if mint_up_to_burst(&mut terms, burst, due)? > 0 {
            let key = AccountKey {
                pair: pair.clone(),
                accounting_epoch,
                policy_generation,
            };
            self.put_account_state(key, AccountState { terms, ..account });
        }
        Ok(())
    }

    fn refill_pair_in_steps(&mut self, pair: &PairKey, now: Timestamp) -> Result<(), Overflow> {
        let Some(refill) = self.policy(pair).map(|policy| policy.refill) else {
            return Ok(());
        };
        self.current_account(pair, now)?;
        let record = self.pair(pair).expect("pair exists");
        let Some((record, ticks)) = refill_ticks(record, refill, now) else {
            return Ok(());
        };
        self.put(Change::Pair(record));
        let due = ticks.saturating_mul(refill.units).min(UNITS_MAX);
        self.mint(pair, due, now).map(|_| ())
    }

    /// Mints `units` for the pair: repays the oldest debt first, then adds
    /// to the current account up to `burst`. Returns (repaid, minted, cut).
    fn mint(
        &mut self,
        pair: &PairKey,
        units: u64,
        now: Timestamp,
    ) -> Result<(u64, u64, u64), Overflow> {
        let (repaid, remainder) = self.repay_debt(pair, units)?;
        let key = self.current_account(pair, now)?;
        let burst = self.policy(pair).map_or(0, |policy| policy.burst);
        let mut terms = *self.account(&key).expect("current account exists");
        let minted = mint_up_to_burst(&mut terms, burst, remainder)?;
        if minted > 0 {
            self.put_account(key, terms);
        }
        Ok((repaid, minted, remainder - minted))
    }

    /// Repays the pair's debt, oldest account first, from `units`: `minted`
    /// and `overdraftRepaid` rise together there. Returns (repaid, left).
    fn repay_debt(&mut self, pair: &PairKey, units: u64) -> Result<(u64, u64), Overflow> {
        let indebted: Vec<((Timestamp, u64), AccountTerms)> = self
            .pairs
            .get(pair)
            .map(|state| {
                state
                    .accounts
                    .iter()
                    .filter(|(_, account)| account.terms.debt() > 0)
                    .map(|(key, account)| (*key, account.terms))
                    .collect()
            })
            .unwrap_or_default();
        let mut left = units;
        for ((epoch, generation), mut terms) in indebted {
            if left == 0 {
                break;
            }
            let repay = terms.debt().min(left);
            terms.minted = add(terms.minted, repay)?;
            terms.overdraft_repaid = add(terms.overdraft_repaid, repay)?;
            left -= repay;
            let key = AccountKey {
                pair: pair.clone(),
                accounting_epoch: epoch,
                policy_generation: generation,
            };
            self.put_account(key, terms);
        }
        Ok((units - left, left))
    }

    /// The key of the pair's account for `now`'s epoch under the current
    /// generation, opening it if needed: its `opening` repays the oldest
    /// debt first and the account opens with the rest.
    fn current_account(&mut self, pair: &PairKey, now: Timestamp) -> Result<AccountKey, Overflow> {
        let policy = self.policy(pair).expect("pair has a policy");
        let (accounting_epoch_ms, policy_generation, opening) = (
            policy.accounting_epoch_ms,
            policy.policy_generation,
            policy.opening,
        );
        let epoch = epoch_start(now, accounting_epoch_ms);
        let key = AccountKey {
            pair: pair.clone(),
            accounting_epoch: epoch,
            policy_generation,
        };
        if self.account(&key).is_some() {
            return Ok(key);
        }
        let (_, opening) = self.repay_debt(pair, opening)?;
        self.put_account(key.clone(), AccountTerms::open(opening));
        let mut record = self.pair(pair).cloned().expect("pair exists");
        if record.last_refill_at < epoch {
            // Ticks of a closed epoch stay there (fixed window).
            record.last_refill_at = epoch;
            self.put(Change::Pair(record));
        }
        Ok(key)
    }

    // ----- gateways and shards -----

    /// Registers a boot of an enrolled gateway: the next boot epoch, bound to
    /// `boot_nonce` (random, drawn by the shell). Shards of earlier epochs
    /// are dead from here on.
    ///
    /// `request` is what the agent sent: a fresh nonce and its clock. A
    /// request more than [`BOOT_SKEW_MS_MAX`] from `now`, not later than
    /// the current boot's request, or with its nonce, is a replay: refused,
    /// durably (the current boot's request is in its record), whatever the
    /// signature layer's nonce cache remembers.
    pub fn register_gateway(
        &mut self,
        identity: &GatewayIdentity,
        boot_nonce: BootNonce,
        request: BootRequest,
        now: Timestamp,
    ) -> Transition<RegisterOutcome> {
        let Some(mut gateway) = self.gateways.get(identity).cloned() else {
            return self.finish(RegisterOutcome::UnknownGateway);
        };
        let skew_ms = request.requested_at.unix_ms().abs_diff(now.unix_ms());
        if skew_ms > BOOT_SKEW_MS_MAX {
            return self.finish(RegisterOutcome::Replayed(BootReplay::OutsideSkew {
                skew_ms,
            }));
        }
        if let Some(last) = gateway.last_boot_request {
            if request.request_nonce == last.request_nonce {
                return self.finish(RegisterOutcome::Replayed(BootReplay::SameNonce));
            }
            if request.requested_at <= last.requested_at {
                return self.finish(RegisterOutcome::Replayed(BootReplay::NotAfterCurrentBoot));
            }
        }
        gateway.last_boot_request = Some(request);
        gateway.boot_epoch = match add(gateway.boot_epoch, 1) {
            Ok(epoch) => epoch,
            Err(overflow) => return self.finish(RegisterOutcome::Overflow(overflow)),
        };
        gateway.boot_nonce = Some(boot_nonce);
        let boot_epoch = gateway.boot_epoch;
        self.put(Change::Gateway(gateway));
        self.finish(RegisterOutcome::Registered {
            boot_epoch,
            boot_nonce,
        })
    }

    /// Carves an emergency shard out of the pair's current account
    /// (`available → retiredForEmergency`), bound to the gateway's current
    /// boot and the next fence, signed by `signer`.
    pub fn issue_shard(
        &mut self,
        request: IssueShardRequest,
        signer: &dyn shard_format::DocumentSigner,
        now: Timestamp,
    ) -> Transition<IssueShardOutcome> {
        if let Some(existing) = self.shards.get(&request.shard) {
            let shard = &existing.shard;
            if shard.gateway_identity == request.identity
                && shard.boot_epoch == request.boot_epoch
                && shard.boot_nonce == request.boot_nonce
                && shard.subject == request.subject
                && shard.route == request.route
            {
                let shard = Box::new(shard.clone());
                return self.finish(IssueShardOutcome::Duplicate(shard));
            }
        }
        let Some(gateway) = self.gateways.get(&request.identity) else {
            return self.finish(IssueShardOutcome::UnknownGateway);
        };
        if gateway.boot_epoch == 0
            || gateway.boot_epoch != request.boot_epoch
            || gateway.boot_nonce != Some(request.boot_nonce)
        {
            let current_epoch = gateway.boot_epoch;
            return self.finish(IssueShardOutcome::SupersededBoot { current_epoch });
        }
        let pair = PairKey::new(request.subject.clone(), request.route.clone());
        let Some(policy) = self.policy(&pair).cloned() else {
            return self.finish(IssueShardOutcome::NoPolicy);
        };
        if policy.emergency_mode != EmergencyMode::Enabled || policy.mode != RouteMode::Enforce {
            return self.finish(IssueShardOutcome::EmergencyDisabled);
        }
        if self.shards.contains_key(&request.shard) {
            return self.finish(IssueShardOutcome::ShardIdTaken);
        }
        let owner = (request.identity.clone(), pair.clone());
        let open = self
            .unreconciled_shards_of(&owner)
            .filter(|record| record.shard.boot_epoch == request.boot_epoch)
            .count();
        if open >= self.config.open_shards_per_gateway_pair_max {
            return self.finish(IssueShardOutcome::TooManyOpenShards);
        }
        if let Some(retry_after_seconds) = self.unreconciled_cap_reached(&owner, &policy, now) {
            return self.finish(IssueShardOutcome::UnreconciledCap {
                retry_after_seconds,
            });
        }
        let account_key = match self.current_account(&pair, now) {
            Ok(key) => key,
            Err(overflow) => return self.finish(IssueShardOutcome::Overflow(overflow)),
        };
        let rejection = self
            .pair_gate(
                &pair,
                &policy,
                &account_key,
                policy.emergency_shard_units,
                now,
            )
            .or_else(|| {
                self.capacity_check(&policy, &account_key, policy.emergency_shard_units, now)
            });
        if let Some(rejection) = rejection {
            return self.finish(IssueShardOutcome::Rejected(rejection));
        }
        // After this point, the issuance must succeed.
        let units = policy.emergency_shard_units;
        let mut terms = *self.account(&account_key).expect("current account exists");
        debug_assert!(terms.available >= units);
        terms.available -= units;
        terms.retired_for_emergency = match add(terms.retired_for_emergency, units) {
            Ok(retired) => retired,
            Err(overflow) => return self.finish(IssueShardOutcome::Overflow(overflow)),
        };
        let mut pair = self.pair(&account_key.pair).cloned().expect("pair exists");
        let fence = pair.next_fence;
        pair.next_fence += 1;
        let mut shard = EmergencyShardV1 {
            schema: Default::default(),
            shard: request.shard,
            subject: request.subject,
            route: request.route,
            policy_generation: policy.policy_generation,
            accounting_epoch: account_key.accounting_epoch,
            allocated_units: units,
            gateway_identity: request.identity,
            boot_epoch: request.boot_epoch,
            boot_nonce: request.boot_nonce,
            fence,
            not_before: now,
            not_after: now.saturating_add_ms(policy.emergency_shard_validity_ms),
            key_id: signer.key_id().clone(),
            signature: Signature::UNSIGNED,
        };
        sign_document(&mut shard, signer);
        self.put(Change::Pair(pair));
        self.put_account(account_key.clone(), terms);
        self.count_record(&account_key, None);
        self.put(Change::Shard(Box::new(ShardRecord {
            shard: shard.clone(),
            reconciliation: None,
            lost_at: None,
        })));
        self.finish(IssueShardOutcome::Issued(Box::new(shard)))
    }

    /// The unreconciled shards of `owner`, in ID order.
    fn unreconciled_shards_of(&self, owner: &ShardOwner) -> impl Iterator<Item = &ShardRecord> {
        self.unreconciled_shards
            .get(owner)
            .into_iter()
            .flatten()
            .map(|id| &self.shards[id])
    }

    /// Whether one more shard of `policy` would take the identity's open
    /// (unreconciled, not lost) shard units of the pair, over all its
    /// boots, above the cap; if so, whole seconds until the oldest of them
    /// becomes lost.
    fn unreconciled_cap_reached(
        &self,
        owner: &ShardOwner,
        policy: &AdmissionBudgetV1,
        now: Timestamp,
    ) -> Option<u64> {
        let cap = policy
            .emergency_shard_units
            .saturating_mul(self.config.unreconciled_shard_units_factor);
        let mut units = 0u64;
        let mut oldest_not_after: Option<Timestamp> = None;
        for record in self
            .unreconciled_shards_of(owner)
            .filter(|record| record.is_open())
        {
            units = units.saturating_add(record.shard.allocated_units);
            let not_after = record.shard.not_after;
            oldest_not_after = Some(oldest_not_after.map_or(not_after, |old| old.min(not_after)));
        }
        if units.saturating_add(policy.emergency_shard_units) <= cap {
            return None;
        }
        let lost_at = oldest_not_after.map_or(now, |not_after| {
            not_after.saturating_add_ms(self.config.shard_lost_grace_ms)
        });
        Some(seconds_until(now, lost_at))
    }

    /// Marks lost the open shards whose `notAfter` plus
    /// [`CentralConfig::shard_lost_grace_ms`] is at or before `now`, oldest
    /// first, at most `sweep_batch_max`. Nothing moves in any account: the
    /// units stay retired (only a receipt re-mints them, and a late one is
    /// still reconciled); the shard stops counting toward its identity's
    /// cap. Returns what it marked.
    pub fn mark_lost_shards(&mut self, now: Timestamp) -> Transition<Vec<LostShard>> {
        let grace = self.config.shard_lost_grace_ms;
        let due: Vec<ShardId> = self
            .open_shards
            .iter()
            .take_while(|(not_after, _)| not_after.saturating_add_ms(grace) <= now)
            .take(self.config.sweep_batch_max.max(1))
            .map(|(_, id)| id.clone())
            .collect();
        let mut lost = Vec::with_capacity(due.len());
        for id in due {
            let mut record = self.shards[&id].clone();
            debug_assert!(record.is_open());
            record.lost_at = Some(now);
            let shard = &record.shard;
            lost.push(LostShard {
                shard: shard.shard.clone(),
                identity: shard.gateway_identity.clone(),
                boot_epoch: shard.boot_epoch,
                subject: shard.subject.clone(),
                route: shard.route.clone(),
                units: shard.allocated_units,
                not_after: shard.not_after,
            });
            self.put(Change::Shard(Box::new(record)));
        }
        self.finish(lost)
    }

    /// Reconciles a shard's terminal receipt, exactly once: receipt debt
    /// becomes `overdraftIssued` (and `spent`) in the shard's account;
    /// confirmed unused units are re-minted into the pair's current account
    /// (debt first, capped by `burst`, the cut reported). Spent and unknown
    /// units stay retired.
    ///
    /// Only the identity the shard is bound to may hand its receipt in
    /// (`caller`), and only a receipt signed by that identity counts.
    pub fn reconcile_shard(
        &mut self,
        receipt: &ShardTerminalReceiptV1,
        caller: &GatewayIdentity,
        verifier: &dyn shard_format::DocumentVerifier,
        now: Timestamp,
    ) -> Transition<ReconcileOutcome> {
        let Some(record) = self.shards.get(&receipt.shard).cloned() else {
            return self.finish(ReconcileOutcome::UnknownShard);
        };
        let shard = &record.shard;
        if *caller != shard.gateway_identity
            || receipt.gateway_identity != shard.gateway_identity
            || receipt.key_id != shard.gateway_identity
        {
            return self.finish(ReconcileOutcome::WrongIdentity);
        }
        if let Err(error) = verify_document(receipt, verifier) {
            return self.finish(ReconcileOutcome::BadSignature(error));
        }
        if let Some(done) = &record.reconciliation {
            return self.finish(ReconcileOutcome::Duplicate(done.clone()));
        }
        let mismatch = if receipt.subject != shard.subject || receipt.route != shard.route {
            Some("subject and route")
        } else if receipt.allocated_units != shard.allocated_units {
            Some("allocatedUnits")
        } else if receipt.boot_epoch != shard.boot_epoch {
            Some("bootEpoch")
        } else if receipt.validate().is_err() {
            Some("the receipt's own equation")
        } else {
            None
        };
        if let Some(field) = mismatch {
            return self.finish(ReconcileOutcome::Mismatch(field));
        }
        // After this point, the reconciliation must succeed.
        let origin = record.account_key();
        let debt = receipt.overdraft_debt_units;
        if debt > 0 {
            let mut terms = *self.account(&origin).expect("a shard's account exists");
            let updated = add(terms.spent, debt)
                .and_then(|spent| Ok((spent, add(terms.overdraft_issued, debt)?)));
            match updated {
                Ok((spent, issued)) => {
                    terms.spent = spent;
                    terms.overdraft_issued = issued;
                }
                Err(overflow) => return self.finish(ReconcileOutcome::Overflow(overflow)),
            }
            self.put_account(origin.clone(), terms);
        }
        let (repaid, reminted, cut) =
            match self.mint(&origin.pair, receipt.confirmed_unused_units, now) {
                Ok(split) => split,
                Err(overflow) => return self.finish(ReconcileOutcome::Overflow(overflow)),
            };
        let reconciliation = Reconciliation {
            receipt_digest: document_digest(receipt),
            spent_units: receipt.spent_units,
            confirmed_unused_units: receipt.confirmed_unused_units,
            unknown_units: receipt.unknown_units,
            overdraft_debt_units: debt,
            repaid_units: repaid,
            reminted_units: reminted,
            cut_units: cut,
            reconciled_at: now,
        };
        self.put(Change::Shard(Box::new(ShardRecord {
            reconciliation: Some(reconciliation.clone()),
            ..record
        })));
        self.finish(ReconcileOutcome::Reconciled(reconciliation))
    }

    // ----- planted bugs (simulator only) -----

    /// Canary: a replayed settle erases the debt its first run recorded.
    fn canary_erase_debt(&mut self, mut record: ReservationRecord) -> Transition<SettleOutcome> {
        let mut settlement = record.settlement.clone().expect("settled");
        let key = record.account_key();
        if let Some(mut terms) = self.account(&key).copied() {
            let debt = settlement.overdraft_units.min(terms.debt());
            terms.overdraft_issued -= debt;
            terms.spent = terms.spent.saturating_sub(debt);
            self.put_account(key, terms);
        }
        settlement.overdraft_units = 0;
        settlement.state = ReservationState::Settled;
        record.receipt.state = ReservationState::Settled;
        record.settlement = Some(settlement.clone());
        self.put_reservation(record);
        self.finish(SettleOutcome::Duplicate(settlement))
    }

    /// Canary: expiry takes `STARTED` items past their hold too, refunding
    /// work that may still run.
    fn canary_expire_started(&mut self, now: Timestamp) {
        let mut started: Vec<ReservationRecord> = self
            .reservations()
            .filter(|r| r.receipt.state == ReservationState::Started && r.receipt.expires_at <= now)
            .cloned()
            .collect();
        // In ID order, as the ordered map gave them: a seed replays alike.
        started.sort_by(|a, b| a.receipt.reservation.cmp(&b.receipt.reservation));
        for mut record in started {
            let units = record.held_units();
            let key = record.account_key();
            if let Some(mut terms) = self.account(&key).copied() {
                terms.reserved -= units;
                terms.available += units;
                self.put_account(key, terms);
            }
            record.receipt.state = ReservationState::Expired;
            self.put_reservation(record);
        }
    }

    // ----- retention -----

    /// Forgets what ended more than the retention window before `now`, at
    /// most `sweep_batch_max` records, oldest first.
    ///
    /// It never forgets a live reservation, an unreconciled shard, or a
    /// settlement or receipt that made debt still owed in its account (the
    /// record shows where the debt came from), and forgets a multi-leg
    /// reservation's legs together or not at all. A forgotten record's usage
    /// moves into its account's [`ForgottenHistory`]; accounts of past
    /// epochs or generations left with no record and no debt fold into
    /// their pair's [`ClosedHistory`]. Both keep the audit exact.
    pub fn forget_expired(&mut self, now: Timestamp) -> Transition<ForgetOutcome> {
        let cutoff = now.unix_ms().saturating_sub(self.config.retention_ms);
        let batch_max = self.config.sweep_batch_max.max(1);
        // Records kept for their debt stay queued: look a bounded way past
        // them.
        let mut due: Vec<RecordKey> = self
            .retention_queue
            .iter()
            .take_while(|(since, _)| since.unix_ms() <= cutoff)
            .take(batch_max.saturating_mul(4))
            .filter(|(_, key)| self.forgettable(key, cutoff))
            .take(batch_max)
            .map(|(_, key)| key.clone())
            .collect();
        // A leg goes with every other leg, in the same transition
        // (`forgettable`), even where the batch's end fell between them.
        let mut chosen: BTreeSet<RecordKey> = due.iter().cloned().collect();
        let mut siblings = Vec::new();
        for key in &due {
            let RecordKey::Reservation(id) = key else {
                continue;
            };
            for leg in self.reservations[id].receipt.legs.iter().flatten() {
                let sibling = RecordKey::Reservation(leg.reservation.clone());
                if self.reservations.contains_key(&leg.reservation)
                    && chosen.insert(sibling.clone())
                {
                    siblings.push(sibling);
                }
            }
        }
        due.extend(siblings);
        let mut outcome = ForgetOutcome::default();
        let mut pairs = BTreeSet::new();
        for key in due {
            let gone = match &key {
                RecordKey::Reservation(id) => {
                    let record = &self.reservations[id];
                    let mut gone = ForgottenHistory {
                        reservations: 1,
                        ..ForgottenHistory::default()
                    };
                    if let Some(settlement) = &record.settlement
                        && !record.shadow
                    {
                        gone.spent = settlement.actual_units;
                        gone.overdraft_issued = settlement.overdraft_units;
                    }
                    outcome.reservations += 1;
                    Some((record.account_key(), gone))
                }
                RecordKey::Shard(id) => {
                    let record = &self.shards[id];
                    let debt = record
                        .reconciliation
                        .as_ref()
                        .map_or(0, |done| done.overdraft_debt_units);
                    let lost = u64::from(record.is_lost());
                    outcome.shards += 1;
                    Some((
                        record.account_key(),
                        ForgottenHistory {
                            shards: 1,
                            spent: debt,
                            overdraft_issued: debt,
                            shard_units: record.shard.allocated_units,
                            lost_shards: lost,
                            lost_units: lost * record.shard.allocated_units,
                            ..ForgottenHistory::default()
                        },
                    ))
                }
                _ => {
                    outcome.tombstones += 1;
                    None
                }
            };
            if let Some((account, gone)) = gone {
                self.count_record(&account, Some(gone));
                pairs.insert(account.pair);
            }
            self.put(Change::Forget(key));
        }
        for pair in pairs {
            outcome.accounts_folded += self.fold_closed_accounts(&pair, now);
        }
        self.finish(outcome)
    }

    /// Whether the record under `key` (in the retention queue) may go at
    /// `cutoff` (unix ms): it is terminal, its window has passed, and no
    /// debt it made is still owed in its account. A leg of a multi-leg
    /// reservation goes only with every other leg still stored
    /// (docs/design.md §3.13): forgotten alone, its ID could be reserved
    /// anew while a sibling kept for its debt still lists it as a leg.
    fn forgettable(&self, key: &RecordKey, cutoff: u64) -> bool {
        match key {
            RecordKey::Tombstone(_) => true,
            RecordKey::Reservation(id) => {
                let Some(record) = self.reservations.get(id) else {
                    return false;
                };
                match &record.receipt.legs {
                    Some(legs) => legs.iter().all(|leg| {
                        self.reservations
                            .get(&leg.reservation)
                            .is_none_or(|leg| self.reservation_may_go(leg, cutoff))
                    }),
                    None => self.reservation_may_go(record, cutoff),
                }
            }
            RecordKey::Shard(id) => {
                let Some(record) = self.shards.get(id) else {
                    return false;
                };
                let made_debt = match &record.reconciliation {
                    Some(done) => done.overdraft_debt_units > 0,
                    // Lost and never reconciled: it made no debt.
                    None if record.lost_at.is_some() => return true,
                    None => return false,
                };
                !made_debt || self.debt_repaid(&record.account_key())
            }
            _ => false,
        }
    }

    /// Whether one reservation's record may go at `cutoff`, by itself.
    fn reservation_may_go(&self, record: &ReservationRecord, cutoff: u64) -> bool {
        let made_debt = record
            .settlement
            .as_ref()
            .is_some_and(|settlement| settlement.overdraft_units > 0);
        // Only a terminal record has a retention window.
        record
            .retained_since()
            .is_some_and(|since| since.unix_ms() <= cutoff)
            && (!made_debt || self.debt_repaid(&record.account_key()))
    }

    fn debt_repaid(&self, account: &AccountKey) -> bool {
        self.account(account).is_some_and(|terms| terms.debt() == 0)
    }

    /// Folds the pair's accounts that can never change again into its
    /// closed history: older than the current epoch or generation, with no
    /// record left and no debt. Returns how many it folded.
    fn fold_closed_accounts(&mut self, pair: &PairKey, now: Timestamp) -> usize {
        let Some(state) = self.pairs.get(pair) else {
            return 0;
        };
        let (Some(record), Some(policy)) = (state.record.clone(), state.current_policy()) else {
            return 0;
        };
        let current_epoch = epoch_start(now, policy.accounting_epoch_ms);
        let closed: Vec<((Timestamp, u64), AccountState)> = state
            .accounts
            .iter()
            .filter(|((epoch, generation), account)| {
                (*epoch < current_epoch || *generation < record.current_generation)
                    && account.records == Some(0)
                    && account.terms.debt() == 0
                    && account.terms.reserved == 0
            })
            .map(|(key, account)| (*key, *account))
            .collect();
        let mut history = record.closed_history;
        let mut folded = 0;
        for ((epoch, generation), account) in closed {
            let Ok(sum) = history.plus(&account) else {
                break;
            };
            history = sum;
            folded += 1;
            self.put(Change::Forget(RecordKey::Account(AccountKey {
                pair: pair.clone(),
                accounting_epoch: epoch,
                policy_generation: generation,
            })));
        }
        if folded > 0 {
            self.put(Change::Pair(PairRecord {
                closed_history: history,
                ..record
            }));
        }
        folded
    }

    /// Whether `retention_ms` is at least what every current policy needs:
    /// the longest life of its reservations (`holdTtlMs +
    /// executionHardLimitMs`) plus [`RETENTION_MARGIN_MS`].
    pub fn check_retention(&self, retention_ms: u64) -> Result<(), RetentionTooShort> {
        self.pairs
            .values()
            .filter_map(PairState::current_policy)
            .try_for_each(|policy| check_policy_retention(policy, retention_ms))
    }

    // ----- the transition machinery -----

    /// Writes an account's terms; its retention bookkeeping stays.
    fn put_account(&mut self, key: AccountKey, terms: AccountTerms) {
        let account = self.account_state(&key).copied().unwrap_or_default();
        self.put_account_state(key, AccountState { terms, ..account });
    }

    fn put_account_state(&mut self, key: AccountKey, account: AccountState) {
        self.put(Change::Account(AccountRecord {
            key,
            terms: account.terms,
            records: account.records,
            forgotten: account.forgotten,
        }));
    }

    /// Counts a new reservation or shard record of the account `key` (or,
    /// with `forgotten`, one that leaves the store, and what it accounted
    /// for).
    fn count_record(&mut self, key: &AccountKey, forgotten: Option<ForgottenHistory>) {
        let mut account = *self.account_state(key).expect("a record's account exists");
        account.records = match forgotten {
            None => account.records.map(|count| count.saturating_add(1)),
            Some(gone) => {
                account.forgotten = account.forgotten.plus(&gone);
                account.records.map(|count| count.saturating_sub(1))
            }
        };
        self.put_account_state(key.clone(), account);
    }

    fn put_reservation(&mut self, record: ReservationRecord) {
        if !self.reservations.contains_key(&record.receipt.reservation) {
            self.count_record(&record.account_key(), None);
        }
        self.put(Change::Reservation(Box::new(record)));
    }

    /// Applies one record to the in-memory state and remembers it for the
    /// transition's change list.
    fn put(&mut self, change: Change) {
        self.apply(change.clone());
        self.pending.push(change);
    }

    /// Applies one record: the only place state is written, shared by
    /// transitions and loading.
    fn apply(&mut self, change: Change) {
        match change {
            Change::Policy(policy) => {
                let pair = PairKey::new(policy.subject.clone(), policy.route.clone());
                self.pairs
                    .entry(pair)
                    .or_default()
                    .policies
                    .insert(policy.policy_generation, *policy);
            }
            Change::Pair(record) => {
                let pair = record.pair.clone();
                self.pairs.entry(pair).or_default().record = Some(record);
            }
            Change::Account(AccountRecord {
                key,
                terms,
                records,
                forgotten,
            }) => {
                self.pairs.entry(key.pair).or_default().accounts.insert(
                    (key.accounting_epoch, key.policy_generation),
                    AccountState {
                        terms,
                        records,
                        forgotten,
                    },
                );
            }
            Change::Reservation(record) => {
                let id = record.receipt.reservation.clone();
                let key = RecordKey::Reservation(id.clone());
                self.record_counts.reservation(&record, Count::Add);
                if let Some(old) = self.reservations.get(&id) {
                    self.record_counts.reservation(old, Count::Remove);
                    if let Some(since) = old.retained_since() {
                        self.retention_queue.remove(&(since, key.clone()));
                    }
                    self.expiry_queue
                        .remove(&(old.receipt.expires_at, id.clone()));
                    self.expiring.remove(&id);
                    if let Some(due) = usage_due(old) {
                        self.usage_queue.remove(&(due, id.clone()));
                    }
                }
                match record.receipt.state {
                    ReservationState::Reserved => {
                        self.expiry_queue
                            .insert((record.receipt.expires_at, id.clone()));
                    }
                    ReservationState::Expiring => {
                        self.expiring.insert(id.clone());
                    }
                    _ => {}
                }
                if let Some(due) = usage_due(&record) {
                    self.usage_queue.insert((due, id.clone()));
                }
                if let Some(since) = record.retained_since() {
                    self.retention_queue.insert((since, key));
                }
                self.reservations.insert(id, record);
            }
            Change::Tombstone(tombstone) => {
                self.retention_queue.insert((
                    tombstone.abandoned_at,
                    RecordKey::Tombstone(tombstone.reservation.clone()),
                ));
                self.tombstones
                    .insert(tombstone.reservation.clone(), tombstone);
            }
            Change::Gateway(gateway) => {
                self.gateways.insert(gateway.identity.clone(), gateway);
            }
            Change::Shard(record) => {
                let id = record.shard.shard.clone();
                self.forget_shard_queues(&id);
                self.record_counts.shard(&record, Count::Add);
                if let Some(since) = record.retained_since() {
                    self.retention_queue
                        .insert((since, RecordKey::Shard(id.clone())));
                }
                if record.is_open() {
                    self.open_shards
                        .insert((record.shard.not_after, id.clone()));
                }
                if record.reconciliation.is_none() {
                    self.unreconciled_shards
                        .entry(owner_of(&record.shard))
                        .or_default()
                        .insert(id.clone());
                }
                self.shards.insert(id, *record);
            }
            Change::Forget(key) => self.forget(key),
        }
    }

    /// Removes the record under `key` and everything derived from it.
    fn forget(&mut self, key: RecordKey) {
        match &key {
            RecordKey::Policy(pair, generation) => {
                if let Some(state) = self.pairs.get_mut(pair) {
                    state.policies.remove(generation);
                }
            }
            RecordKey::Pair(pair) => {
                if let Some(state) = self.pairs.get_mut(pair) {
                    state.record = None;
                }
            }
            RecordKey::Account(account) => {
                if let Some(state) = self.pairs.get_mut(&account.pair) {
                    state
                        .accounts
                        .remove(&(account.accounting_epoch, account.policy_generation));
                }
            }
            RecordKey::Reservation(id) => {
                if let Some(old) = self.reservations.remove(id) {
                    self.record_counts.reservation(&old, Count::Remove);
                    self.expiry_queue
                        .remove(&(old.receipt.expires_at, id.clone()));
                    self.expiring.remove(id);
                    if let Some(due) = usage_due(&old) {
                        self.usage_queue.remove(&(due, id.clone()));
                    }
                    if let Some(since) = old.retained_since() {
                        self.retention_queue.remove(&(since, key.clone()));
                    }
                }
            }
            RecordKey::Tombstone(id) => {
                if let Some(old) = self.tombstones.remove(id) {
                    self.retention_queue
                        .remove(&(old.abandoned_at, key.clone()));
                }
            }
            RecordKey::Gateway(identity) => {
                self.gateways.remove(identity);
            }
            RecordKey::Shard(id) => {
                self.forget_shard_queues(id);
                self.shards.remove(id);
            }
        }
    }

    /// Takes the stored shard `id` out of the derived queues and counts.
    fn forget_shard_queues(&mut self, id: &ShardId) {
        if let Some(old) = self.shards.get(id) {
            self.record_counts.shard(old, Count::Remove);
            if let Some(since) = old.retained_since() {
                self.retention_queue
                    .remove(&(since, RecordKey::Shard(id.clone())));
            }
            self.open_shards.remove(&(old.shard.not_after, id.clone()));
            if old.reconciliation.is_none() {
                let owner = owner_of(&old.shard);
                if let Some(ids) = self.unreconciled_shards.get_mut(&owner) {
                    ids.remove(id);
                    if ids.is_empty() {
                        self.unreconciled_shards.remove(&owner);
                    }
                }
            }
        }
    }

    /// Ends a transition: takes its changes (one per record key, the last
    /// write winning) and, in debug builds, checks the invariants.
    fn finish<O>(&mut self, outcome: O) -> Transition<O> {
        if self.pending.is_empty() {
            return Transition {
                outcome,
                changes: Vec::new(),
            };
        }
        let mut changes = std::mem::take(&mut self.pending);
        // Keep the last write of each key, where it was written. Each key
        // is made once: making one clones its identifiers. Hashed, not
        // ordered: a refill round writes a record for each of thousands of
        // pairs, and an ordered map compared their string keys.
        let keys: Vec<RecordKey> = changes.iter().map(Change::key).collect();
        let mut last_write = IdMap::with_capacity_and_hasher(keys.len(), Default::default());
        for (index, key) in keys.iter().enumerate() {
            last_write.insert(key, index);
        }
        // Fewer keys than changes: a key was written more than once.
        if last_write.len() != changes.len() {
            let mut index = 0;
            changes.retain(|_| {
                let keep = last_write[&keys[index]] == index;
                index += 1;
                keep
            });
        }
        invariants::assert_after_transition(self, &changes);
        Transition { outcome, changes }
    }
}

/// The actual units of each leg of the reservation `receipt` belongs to,
/// by leg ID ([`SettleActuals::per_leg`]).
fn actuals_per_leg(
    receipt: &LimitReservationV1,
    actuals: &SettleActuals,
) -> Result<BTreeMap<ReservationId, u64>, (usize, LegProblem)> {
    let legs = receipt
        .legs
        .clone()
        .unwrap_or_else(|| vec![receipt.as_leg()]);
    let pairs: Vec<(PairKey, u64)> = legs
        .iter()
        .map(|leg| {
            let pair = PairKey::new(leg.subject.clone(), leg.route.clone());
            (pair, leg.reserved_units)
        })
        .collect();
    let pairs: Vec<(&PairKey, u64)> = pairs.iter().map(|(pair, grant)| (pair, *grant)).collect();
    let per_leg = actuals.per_leg(&pairs)?;
    Ok(legs
        .into_iter()
        .map(|leg| leg.reservation)
        .zip(per_leg)
        .collect())
}

/// Whether a receipt's legs were asked for exactly as `legs` ask (pairs,
/// units and floors, in order): a retry of the same reserve.
fn legs_asked_alike(receipt: &LimitReservationV1, legs: &[LegAsk]) -> bool {
    fn asked(
        subject: &shard_format::Subject,
        route: &shard_format::Route,
        units: u64,
        min_units: Option<u64>,
        leg: &LegAsk,
    ) -> bool {
        leg.subject == *subject
            && leg.route == *route
            && leg.units == units
            && leg.min_units == min_units
    }
    match &receipt.legs {
        None => {
            legs.len() == 1
                && asked(
                    &receipt.subject,
                    &receipt.route,
                    receipt.asked_units(),
                    receipt.min_units,
                    &legs[0],
                )
        }
        Some(theirs) => {
            theirs.len() == legs.len()
                && theirs.iter().zip(legs).all(|(their, leg)| {
                    asked(
                        &their.subject,
                        &their.route,
                        their.asked_units(),
                        their.min_units,
                        leg,
                    )
                })
        }
    }
}

/// The first fault of a reserve's legs (in leg order), if any: too many,
/// a repeated pair, units or a floor out of range.
pub fn check_legs(legs: &[LegAsk]) -> Result<(), (usize, LegProblem)> {
    if legs.len() > LEGS_MAX {
        return Err((LEGS_MAX, LegProblem::TooMany));
    }
    for (index, leg) in legs.iter().enumerate() {
        if legs[..index]
            .iter()
            .any(|earlier| earlier.subject == leg.subject && earlier.route == leg.route)
        {
            return Err((index, LegProblem::RepeatedPair));
        }
        if leg.units == 0 || leg.units > UNITS_MAX {
            return Err((index, LegProblem::Units));
        }
        if leg.min_units.is_some_and(|min| min == 0 || min > leg.units) {
            return Err((index, LegProblem::MinUnits));
        }
    }
    Ok(())
}

fn new_record(
    receipt: LimitReservationV1,
    shadow: bool,
    owner: GatewayIdentity,
) -> ReservationRecord {
    ReservationRecord {
        owner: Some(owner),
        receipt,
        shadow,
        started_at: None,
        usage_deadline: None,
        hard_limit_at: None,
        settlement: None,
        corrected: false,
        ended_at: None,
    }
}

/// When the usage worker must next look at a reservation, if ever.
fn usage_due(record: &ReservationRecord) -> Option<Timestamp> {
    match record.receipt.state {
        ReservationState::Started => record.usage_deadline,
        ReservationState::UsageUnknown => record.hard_limit_at,
        _ => None,
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    /// An account that balances but says 100 units are reserved that no
    /// reservation holds: only the whole-ledger audit can see it.
    fn reserved_by_nobody() -> Change {
        let mut terms = AccountTerms::open(1000);
        terms.available -= 100;
        terms.reserved += 100;
        invariants::tests::account(terms)
    }

    /// Debug and test builds audit the whole (small) ledger after every
    /// transition that changed something, not only the touched equations.
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "ledger invariants broken by a transition")]
    fn debug_builds_audit_the_whole_ledger_after_a_change() {
        let mut ledger = CentralLedger::new(CentralConfig::default());
        let change = reserved_by_nobody();
        ledger.apply(change.clone());
        invariants::assert_after_transition(&ledger, &[change]);
    }
}
