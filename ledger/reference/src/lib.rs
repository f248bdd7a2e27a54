//! An independent reference model of the central ledger's accounting: the
//! ledger's records as plain maps, changed by rules written down from
//! docs/design.md §3–§5, one function per operation. It predicts every
//! outcome (variant and payload) and every record a transition writes.
//!
//! Two checks drive it: the ledger's model test (`ledger/tests/model`),
//! which compares outcome, changed records and the whole state after every
//! generated step, and the simulator's exact oracle (`reservoir-tests`),
//! which compares every central transition of every simulated run
//! ([`ReferenceLedger::predict`]) and every shard book an agent journals
//! ([`ReferenceShardBook`]).
//!
//! Not modelled: the sweeps' batch cap (`sweep_batch_max`; the model
//! sweeps everything due, and both checks stay far below the cap), and the
//! whole-ledger views (accounts, audit, gauges).
//!
//! The model holds the same record types the ledger commits (they are plain
//! data), so "the whole state" is one map from record key to record on
//! either side ([`ReferenceLedger::snapshot`]). It shares no code with the
//! ledger's rules: only the record types, the documents' own validation and
//! their signatures.

mod shard_book;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use ledger::protocol::{Context, Operation, Reply};
use ledger::{
    AbandonOutcome, AbandonRequest, AccountKey, AccountTerms, BootReplay, BootRequest, Caller,
    CentralConfig, Change, ClosedHistory, Dimension, EnrollOutcome, ForgetOutcome,
    ForgottenHistory, GatewayRecord, IssueShardOutcome, IssueShardRequest, LegProblem, LostShard,
    PairKey, PairRecord, PublishOutcome, RateLimitState, ReconcileOutcome, Reconciliation,
    RecordKey, RegisterOutcome, Rejection, ReleaseOutcome, ReservationRecord, ReserveOutcome,
    ReserveRequest, RouteControlOutcome, SettleActuals, SettleOutcome, ShardRecord, StartOutcome,
    TombstoneRecord,
};
use shard_format::{
    AdmissionBudgetV1, BootNonce, Document, DocumentSigner, DocumentVerifier, EmergencyMode,
    EmergencyShardV1, GatewayIdentity, LimitReservationV1, OperationId, ReservationId,
    ReservationLegV1, ReservationState, RouteMode, SettledLegV1, SettlementReceiptV1, ShardId,
    ShardTerminalReceiptV1, Signature, Timestamp, document_digest,
    limits::{LEGS_MAX, UNITS_MAX},
    sign_document, verify_document,
};

pub use shard_book::ReferenceShardBook;

/// How far a boot request's `requestedAt` may be from `now`
/// (docs/design.md §5.2).
const BOOT_SKEW_MS_MAX: u64 = 10_000;

/// One pair's records.
#[derive(Debug, Clone)]
pub struct PairModel {
    pub record: PairRecord,
    pub policies: BTreeMap<u64, AdmissionBudgetV1>,
    /// Keyed by `(accountingEpoch, policyGeneration)`: oldest first.
    pub accounts: BTreeMap<(Timestamp, u64), AccountTerms>,
}

impl PairModel {
    fn policy(&self) -> &AdmissionBudgetV1 {
        &self.policies[&self.record.current_generation]
    }

    fn debt(&self) -> u64 {
        self.accounts
            .values()
            .map(|terms| terms.overdraft_issued - terms.overdraft_repaid)
            .sum()
    }
}

/// The reference model's state: every record the ledger would hold.
#[derive(Clone)]
pub struct ReferenceLedger {
    /// The ledger's settings (retention, shard caps, sweep batches).
    pub config: CentralConfig,
    pub now: Timestamp,
    pub pairs: BTreeMap<PairKey, PairModel>,
    pub reservations: BTreeMap<ReservationId, ReservationRecord>,
    pub tombstones: BTreeMap<ReservationId, TombstoneRecord>,
    pub gateways: BTreeMap<GatewayIdentity, GatewayRecord>,
    pub shards: BTreeMap<ShardId, ShardRecord>,
    /// What each account's forgotten records accounted for.
    pub forgotten: BTreeMap<AccountKey, ForgottenHistory>,
    /// Set when a step opens an account ([`ReferenceLedger::take_opened_account`]).
    opened_account: bool,
}

impl fmt::Debug for ReferenceLedger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The transitions tell the story; the state is compared in full by
        // the test and printed there on a mismatch.
        f.debug_struct("ReferenceLedger")
            .field("now", &self.now)
            .field("pairs", &self.pairs.len())
            .field("reservations", &self.reservations.len())
            .finish_non_exhaustive()
    }
}

/// `now` floored to the start of its accounting epoch.
fn epoch_start(now: Timestamp, accounting_epoch_ms: u64) -> Timestamp {
    let ms = now.unix_ms();
    Timestamp::from_unix_ms(ms - ms % accounting_epoch_ms).expect("earlier than now")
}

/// Whole seconds (at least 1) until refills mint `missing` units, or `None`
/// when the policy never refills.
fn refill_seconds(policy: &AdmissionBudgetV1, missing: u64) -> Option<u64> {
    (policy.refill.units > 0).then(|| {
        let ticks = missing.div_ceil(policy.refill.units);
        (ticks * policy.refill.interval_ms).div_ceil(1000).max(1)
    })
}

/// Units a reservation holds in its account's `reserved` (docs/design.md
/// §3.1: held from reserve until settle, release or expiry; USAGE_UNKNOWN
/// holds).
fn held_units(record: &ReservationRecord) -> u64 {
    let holds = matches!(
        record.receipt.state,
        ReservationState::Reserved
            | ReservationState::Started
            | ReservationState::Expiring
            | ReservationState::UsageUnknown
    );
    if holds && !record.shadow {
        record.receipt.reserved_units
    } else {
        0
    }
}

fn account_key(pair: &PairKey, (epoch, generation): (Timestamp, u64)) -> AccountKey {
    AccountKey {
        pair: pair.clone(),
        accounting_epoch: epoch,
        policy_generation: generation,
    }
}

impl ReferenceLedger {
    /// An empty ledger at `now`, run with `config`.
    pub fn new(config: CentralConfig, now: Timestamp) -> Self {
        Self {
            config,
            now,
            pairs: BTreeMap::new(),
            reservations: BTreeMap::new(),
            tombstones: BTreeMap::new(),
            gateways: BTreeMap::new(),
            shards: BTreeMap::new(),
            forgotten: BTreeMap::new(),
            opened_account: false,
        }
    }

    /// Whether an account was opened (a new epoch or generation) since the
    /// last call: a refused reserve or shard request may do that.
    pub fn take_opened_account(&mut self) -> bool {
        std::mem::take(&mut self.opened_account)
    }

    /// Moves the model's clock to `now` (never backwards).
    pub fn advance_to(&mut self, now: Timestamp) {
        self.now = self.now.max(now);
    }

    /// The record under `key` as the store would hold it, if any: what
    /// one transition's changes are compared with.
    pub fn record(&self, key: &RecordKey) -> Option<Change> {
        match key {
            RecordKey::Policy(pair, generation) => self
                .pairs
                .get(pair)?
                .policies
                .get(generation)
                .map(|policy| Change::Policy(Box::new(policy.clone()))),
            RecordKey::Pair(pair) => Some(Change::Pair(self.pairs.get(pair)?.record.clone())),
            RecordKey::Account(key) => {
                let terms = self
                    .pairs
                    .get(&key.pair)?
                    .accounts
                    .get(&(key.accounting_epoch, key.policy_generation))?;
                Some(self.account_record(key.clone(), *terms))
            }
            RecordKey::Reservation(id) => self
                .reservations
                .get(id)
                .map(|record| Change::Reservation(Box::new(record.clone()))),
            RecordKey::Tombstone(id) => self.tombstones.get(id).cloned().map(Change::Tombstone),
            RecordKey::Gateway(identity) => {
                self.gateways.get(identity).cloned().map(Change::Gateway)
            }
            RecordKey::Shard(id) => self
                .shards
                .get(id)
                .map(|record| Change::Shard(Box::new(record.clone()))),
        }
    }

    fn account_record(&self, key: AccountKey, terms: AccountTerms) -> Change {
        Change::Account(ledger::AccountRecord {
            records: Some(self.records_of(&key)),
            forgotten: self.forgotten.get(&key).copied().unwrap_or_default(),
            key,
            terms,
        })
    }

    /// Every record, keyed as the store keys it.
    pub fn snapshot(&self) -> BTreeMap<RecordKey, Change> {
        let mut records = BTreeMap::new();
        let mut put = |change: Change| {
            records.insert(change.key(), change);
        };
        for (pair, state) in &self.pairs {
            put(Change::Pair(state.record.clone()));
            for policy in state.policies.values() {
                put(Change::Policy(Box::new(policy.clone())));
            }
            for (key, terms) in &state.accounts {
                put(self.account_record(account_key(pair, *key), *terms));
            }
        }
        for record in self.reservations.values() {
            put(Change::Reservation(Box::new(record.clone())));
        }
        for tombstone in self.tombstones.values() {
            put(Change::Tombstone(tombstone.clone()));
        }
        for gateway in self.gateways.values() {
            put(Change::Gateway(gateway.clone()));
        }
        for shard in self.shards.values() {
            put(Change::Shard(Box::new(shard.clone())));
        }
        records
    }

    // ----- helpers -----

    /// The pair's current policy generation (0 before its first policy).
    pub fn current_generation(&self, pair: &PairKey) -> u64 {
        self.pairs
            .get(pair)
            .map_or(0, |state| state.record.current_generation)
    }

    fn policy(&self, pair: &PairKey) -> Option<&AdmissionBudgetV1> {
        self.pairs.get(pair).map(PairModel::policy)
    }

    fn terms_mut(&mut self, key: &AccountKey) -> &mut AccountTerms {
        self.pairs
            .get_mut(&key.pair)
            .expect("pair")
            .accounts
            .get_mut(&(key.accounting_epoch, key.policy_generation))
            .expect("account")
    }

    fn terms(&self, key: &AccountKey) -> AccountTerms {
        self.pairs[&key.pair].accounts[&(key.accounting_epoch, key.policy_generation)]
    }

    /// docs/design.md §4: refills and openings repay the pair's oldest debt first;
    /// `minted` and `overdraftRepaid` rise together there. Returns
    /// `(repaid, left)`.
    fn repay_debt(&mut self, pair: &PairKey, units: u64) -> (u64, u64) {
        let mut left = units;
        if let Some(state) = self.pairs.get_mut(pair) {
            for terms in state.accounts.values_mut() {
                let repay = (terms.overdraft_issued - terms.overdraft_repaid).min(left);
                terms.minted += repay;
                terms.overdraft_repaid += repay;
                left -= repay;
            }
        }
        (units - left, left)
    }

    /// The account of `now`'s epoch under the current generation, opened
    /// (its `opening` repaying debt first) when it does not exist yet. An
    /// epoch's refill clock starts at the epoch's start (fixed window).
    fn current_account(&mut self, pair: &PairKey) -> AccountKey {
        let policy = self.policy(pair).expect("a policy");
        let (accounting_epoch_ms, generation, opening) = (
            policy.accounting_epoch_ms,
            policy.policy_generation,
            policy.opening,
        );
        let epoch = epoch_start(self.now, accounting_epoch_ms);
        let key = (epoch, generation);
        if !self.pairs[pair].accounts.contains_key(&key) {
            let (_, opening) = self.repay_debt(pair, opening);
            let state = self.pairs.get_mut(pair).expect("pair");
            state.accounts.insert(
                key,
                AccountTerms {
                    opening,
                    available: opening,
                    ..AccountTerms::default()
                },
            );
            if state.record.last_refill_at < epoch {
                state.record.last_refill_at = epoch;
            }
            self.opened_account = true;
        }
        account_key(pair, key)
    }

    /// Mints for the pair: debt first, then the current account, with
    /// `available + reserved` capped by `burst`; the cut is reported.
    /// Returns `(repaid, minted, cut)`.
    fn mint(&mut self, pair: &PairKey, units: u64) -> (u64, u64, u64) {
        let (repaid, left) = self.repay_debt(pair, units);
        let key = self.current_account(pair);
        let burst = self.policy(pair).expect("a policy").burst;
        let terms = self.terms_mut(&key);
        let room = burst.saturating_sub(terms.available + terms.reserved);
        let minted = left.min(room);
        terms.minted += minted;
        terms.available += minted;
        (repaid, minted, left - minted)
    }

    fn rejection(
        policy: &AdmissionBudgetV1,
        dimension: Dimension,
        retry_after_seconds: Option<u64>,
    ) -> Rejection {
        Rejection {
            dimension,
            policy_generation: policy.policy_generation,
            retry_after_seconds,
            rate_limit: None,
        }
    }

    /// Rollback, freeze, then debt: each closes the pair to spending.
    fn pair_gate(&self, pair: &PairKey, key: &AccountKey, units: u64) -> Option<Rejection> {
        let state = &self.pairs[pair];
        let policy = state.policy();
        if state.record.admission_stopped {
            Some(Self::rejection(policy, Dimension::PolicyGeneration, None))
        } else if state.record.frozen {
            Some(Self::rejection(policy, Dimension::Frozen, None))
        } else if state.debt() > 0 {
            // Refills repay the debt first and must then still cover `units`.
            let retry = self.retry_after(key, state.debt() + units);
            Some(Self::rejection(policy, Dimension::Debt, retry))
        } else {
            None
        }
    }

    /// Not enough `available` for `units`.
    fn capacity_check(&self, key: &AccountKey, units: u64) -> Option<Rejection> {
        let policy = self.policy(&key.pair).expect("a policy");
        let terms = self.terms(key);
        if terms.available >= units {
            return None;
        }
        let mut retry = self.retry_after(key, units);
        // docs/design.md §4.5: without refills, units return as holds end,
        // each unstarted one within holdTtlMs.
        if policy.refill.units == 0 && terms.available + terms.reserved >= units {
            let by_holds = policy.hold_ttl_ms.div_ceil(1000).max(1);
            retry = Some(retry.map_or(by_holds, |r| r.min(by_holds)));
        }
        Some(Self::rejection(policy, Dimension::Capacity, retry))
    }

    /// Retry-After for `needed` units (debt plus the request): the sooner
    /// of enough refill ticks beyond what is available now and the next
    /// epoch's opening, when that opening covers `needed` (docs/design.md
    /// §4.7 step 2: 200 missing at 100/s is 2 seconds).
    fn retry_after(&self, key: &AccountKey, needed: u64) -> Option<u64> {
        let policy = self.policy(&key.pair).expect("a policy");
        let available = self.terms(key).available;
        let by_refill = refill_seconds(policy, needed.saturating_sub(available));
        let next_epoch = key.accounting_epoch.unix_ms() + policy.accounting_epoch_ms;
        let by_epoch = (policy.opening >= needed).then(|| {
            next_epoch
                .saturating_sub(self.now.unix_ms())
                .div_ceil(1000)
                .max(1)
        });
        match (by_refill, by_epoch) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Moves an unstarted reservation's held units back to `available`.
    fn refund_unstarted(
        &mut self,
        mut record: ReservationRecord,
        state: ReservationState,
    ) -> LimitReservationV1 {
        let units = held_units(&record);
        if units > 0 {
            let terms = self.terms_mut(&record.account_key());
            terms.reserved -= units;
            terms.available += units;
        }
        record.receipt.state = state;
        record.ended_at = Some(self.now);
        let receipt = record.receipt.clone();
        self.reservations
            .insert(record.receipt.reservation.clone(), record);
        receipt
    }

    // ----- operator operations -----

    /// A policy that fails its document's validation or needs a longer
    /// retention window than the ledger keeps is refused (the message is
    /// the validation's own).
    pub fn publish(&mut self, policy: AdmissionBudgetV1) -> PublishOutcome {
        if let Err(error) = policy.validate() {
            return PublishOutcome::Invalid(error.to_string());
        }
        // Retention must outlast a reservation's longest life plus the margin.
        let life_ms = policy.hold_ttl_ms + policy.execution_hard_limit_ms;
        let floor_ms = life_ms + ledger::RETENTION_MARGIN_MS;
        if self.config.retention_ms < floor_ms {
            let error = ledger::RetentionTooShort {
                retention_ms: self.config.retention_ms,
                floor_ms,
                life_ms,
                subject: policy.subject.clone(),
                route: policy.route.clone(),
                generation: policy.policy_generation,
            };
            return PublishOutcome::Invalid(error.to_string());
        }
        let pair = PairKey::new(policy.subject.clone(), policy.route.clone());
        let generation = policy.policy_generation;
        match self.pairs.get_mut(&pair) {
            Some(state) if generation <= state.record.current_generation => {
                return PublishOutcome::GenerationNotRising {
                    current: state.record.current_generation,
                };
            }
            Some(state) => {
                state.record.current_generation = generation;
                state.record.admission_stopped = false;
                state.policies.insert(generation, policy);
            }
            None => {
                let record = PairRecord {
                    pair: pair.clone(),
                    current_generation: generation,
                    admission_stopped: false,
                    frozen: false,
                    last_refill_at: self.now,
                    next_fence: 1,
                    closed_history: ClosedHistory::default(),
                };
                self.pairs.insert(
                    pair.clone(),
                    PairModel {
                        record,
                        policies: BTreeMap::from([(generation, policy)]),
                        accounts: BTreeMap::new(),
                    },
                );
            }
        }
        self.current_account(&pair);
        PublishOutcome::Published
    }

    pub fn set_frozen(&mut self, pair: &PairKey, frozen: bool) -> RouteControlOutcome {
        let Some(state) = self.pairs.get_mut(pair) else {
            return RouteControlOutcome::NoPolicy;
        };
        if state.record.frozen == frozen {
            return RouteControlOutcome::Unchanged;
        }
        state.record.frozen = frozen;
        RouteControlOutcome::Done
    }

    pub fn set_admission_stopped(
        &mut self,
        pair: &PairKey,
        generation: u64,
        stopped: bool,
    ) -> RouteControlOutcome {
        let Some(state) = self.pairs.get_mut(pair) else {
            return RouteControlOutcome::NoPolicy;
        };
        if state.record.current_generation != generation {
            return RouteControlOutcome::NotCurrentGeneration {
                current: state.record.current_generation,
            };
        }
        if state.record.admission_stopped == stopped {
            return RouteControlOutcome::Unchanged;
        }
        state.record.admission_stopped = stopped;
        RouteControlOutcome::Done
    }

    pub fn enroll(&mut self, identity: &GatewayIdentity) -> EnrollOutcome {
        if self.gateways.contains_key(identity) {
            return EnrollOutcome::AlreadyEnrolled;
        }
        self.gateways.insert(
            identity.clone(),
            GatewayRecord {
                identity: identity.clone(),
                enrolled_at: self.now,
                boot_epoch: 0,
                boot_nonce: None,
                last_boot_request: None,
            },
        );
        EnrollOutcome::Enrolled
    }

    // ----- reservations (docs/design.md §3) -----

    /// docs/design.md §3 with legs: a reserve of one leg is the reserve it
    /// always was; more legs (`moreLegs`) are judged together and written
    /// all or none, each a reservation of its own pair under the ID its
    /// owner derives from that pair.
    pub fn reserve(&mut self, request: &ReserveRequest) -> ReserveOutcome {
        let multi = !request.more_legs.is_empty();
        let legs = request.legs();
        let ids = request.leg_ids();
        let own = ReservationId::derive(
            &request.owner,
            &request.subject,
            &request.route,
            &request.idempotency_key,
        );
        if own != request.reservation {
            return ReserveOutcome::ForeignId;
        }
        if self.tombstones.contains_key(&ids[0]) {
            return ReserveOutcome::Abandoned;
        }
        if let Some(existing) = self.reservations.get(&ids[0]) {
            let receipt = &existing.receipt;
            if receipt.state == ReservationState::Abandoned {
                return ReserveOutcome::Abandoned;
            }
            let stored = receipt
                .legs
                .clone()
                .unwrap_or_else(|| vec![receipt.as_leg()]);
            let same = receipt.request_digest == request.request_digest
                && stored.len() == legs.len()
                && stored.iter().zip(&legs).all(|(stored, asked)| {
                    stored.subject == asked.subject
                        && stored.route == asked.route
                        && stored.asked_units() == asked.units
                        && stored.min_units == asked.min_units
                });
            return if same {
                ReserveOutcome::Duplicate(receipt.clone())
            } else {
                ReserveOutcome::IdempotencyConflict {
                    existing: receipt.clone(),
                }
            };
        }
        for id in &ids[1..] {
            if self.tombstones.contains_key(id) {
                return ReserveOutcome::Abandoned;
            }
            if let Some(existing) = self.reservations.get(id) {
                return ReserveOutcome::IdempotencyConflict {
                    existing: existing.receipt.clone(),
                };
            }
        }
        // Validation, leg by leg.
        if !multi {
            if request.units == 0 || request.units > UNITS_MAX {
                return ReserveOutcome::InvalidUnits;
            }
            if request
                .min_units
                .is_some_and(|min| min == 0 || min > request.units)
            {
                return ReserveOutcome::InvalidMinUnits;
            }
        } else {
            let invalid = |index, problem| ReserveOutcome::InvalidLeg { index, problem };
            if legs.len() > LEGS_MAX {
                return invalid(LEGS_MAX, LegProblem::TooMany);
            }
            for (index, leg) in legs.iter().enumerate() {
                if legs[..index]
                    .iter()
                    .any(|earlier| earlier.subject == leg.subject && earlier.route == leg.route)
                {
                    return invalid(index, LegProblem::RepeatedPair);
                }
                if leg.units == 0 || leg.units > UNITS_MAX {
                    return invalid(index, LegProblem::Units);
                }
                if leg.min_units.is_some_and(|min| min == 0 || min > leg.units) {
                    return invalid(index, LegProblem::MinUnits);
                }
            }
        }
        let mut policies = Vec::new();
        for (index, leg) in legs.iter().enumerate() {
            match self.policy(&leg.pair()) {
                Some(policy) => policies.push(policy.clone()),
                None if multi => {
                    return ReserveOutcome::InvalidLeg {
                        index,
                        problem: LegProblem::NoPolicy,
                    };
                }
                None => return ReserveOutcome::NoPolicy,
            }
        }
        if policies.iter().all(|policy| policy.mode == RouteMode::Off) {
            return ReserveOutcome::NotEnforced;
        }
        let keys: Vec<AccountKey> = legs
            .iter()
            .map(|leg| self.current_account(&leg.pair()))
            .collect();
        // Each leg judged on its own, as a reserve of one leg is; a leg
        // not enforced (shadow, or off beside other legs) holds nothing
        // and grants its whole ask, its refusal only a would-be one.
        let mut judged = Vec::new();
        for (index, leg) in legs.iter().enumerate() {
            let (policy, key) = (&policies[index], &keys[index]);
            let least = leg.min_units.unwrap_or(leg.units);
            let asked_generation = if index == 0 {
                request.policy_generation
            } else {
                None
            };
            let rejection =
                if asked_generation.is_some_and(|asked| asked != policy.policy_generation) {
                    Some(Self::rejection(policy, Dimension::PolicyGeneration, None))
                } else if least > policy.reservation_units_max {
                    Some(Self::rejection(
                        policy,
                        Dimension::ReservationUnitsMax,
                        None,
                    ))
                } else {
                    self.pair_gate(&key.pair, key, least)
                        .or_else(|| self.capacity_check(key, least))
                };
            let enforced = policy.mode == RouteMode::Enforce;
            let granted = if enforced {
                [
                    leg.units,
                    policy.reservation_units_max,
                    self.terms(key).available,
                ]
                .into_iter()
                .min()
                .expect("three bounds")
            } else {
                leg.units
            };
            judged.push((enforced, rejection, granted));
        }
        // The limiting leg: the refused one with the longest Retry-After,
        // the first of equals.
        let limiting = |only_enforced: bool| {
            let mut limiting: Option<(usize, Rejection)> = None;
            for (index, (enforced, rejection, _)) in judged.iter().enumerate() {
                let Some(rejection) = rejection else { continue };
                if only_enforced && !enforced {
                    continue;
                }
                if limiting.as_ref().is_none_or(|(_, worst)| {
                    rejection.retry_after_header_seconds() > worst.retry_after_header_seconds()
                }) {
                    limiting = Some((index, *rejection));
                }
            }
            limiting
        };
        let any_enforced = judged.iter().any(|(enforced, _, _)| *enforced);
        if any_enforced && let Some((index, rejection)) = limiting(true) {
            return if multi {
                ReserveOutcome::LegRejected { index, rejection }
            } else {
                ReserveOutcome::Rejected(rejection)
            };
        }
        let hold_ttl_ms = policies
            .iter()
            .map(|policy| {
                request.hold_ttl_ms.map_or(policy.hold_ttl_ms, |asked| {
                    asked.clamp(1, policy.hold_ttl_ms)
                })
            })
            .min()
            .expect("a leg");
        let listed: Option<Vec<ReservationLegV1>> = multi.then(|| {
            legs.iter()
                .zip(&ids)
                .zip(&judged)
                .map(|((leg, id), (_, _, granted))| ReservationLegV1 {
                    reservation: id.clone(),
                    subject: leg.subject.clone(),
                    route: leg.route.clone(),
                    reserved_units: *granted,
                    requested_units: leg.min_units.map(|_| leg.units),
                    min_units: leg.min_units,
                })
                .collect()
        });
        let mut receipts = Vec::new();
        for (index, leg) in legs.iter().enumerate() {
            let (enforced, _, granted) = judged[index];
            let key = &keys[index];
            let receipt = LimitReservationV1 {
                schema: Default::default(),
                reservation: ids[index].clone(),
                subject: leg.subject.clone(),
                route: leg.route.clone(),
                policy_generation: policies[index].policy_generation,
                accounting_epoch: key.accounting_epoch,
                request_digest: request.request_digest,
                reserved_units: granted,
                requested_units: leg.min_units.map(|_| leg.units),
                min_units: leg.min_units,
                actual_units: None,
                operation_id: None,
                expires_at: self.now.saturating_add_ms(hold_ttl_ms),
                state: ReservationState::Reserved,
                legs: listed.clone(),
            };
            if enforced {
                let terms = self.terms_mut(key);
                terms.available -= granted;
                terms.reserved += granted;
            }
            self.reservations.insert(
                ids[index].clone(),
                ReservationRecord {
                    receipt: receipt.clone(),
                    shadow: !enforced,
                    started_at: None,
                    usage_deadline: None,
                    hard_limit_at: None,
                    settlement: None,
                    corrected: false,
                    ended_at: None,
                    owner: Some(request.owner.clone()),
                },
            );
            receipts.push(receipt);
        }
        let receipt = receipts.swap_remove(0);
        if any_enforced {
            ReserveOutcome::Reserved(receipt)
        } else {
            ReserveOutcome::Shadow {
                receipt,
                would_reject: limiting(false).map(|(_, rejection)| rejection),
            }
        }
    }

    /// The stored records of every leg of `record`'s reservation, in leg
    /// order (just `record` for one leg).
    fn legs_of(&self, record: &ReservationRecord) -> Vec<ReservationRecord> {
        record
            .receipt
            .leg_ids()
            .iter()
            .filter_map(|id| self.reservations.get(id).cloned())
            .collect()
    }

    /// Ends every leg of `record`'s unstarted reservation in `state`, its
    /// units back to `available`; returns `record`'s receipt.
    fn end_unstarted(
        &mut self,
        record: &ReservationRecord,
        state: ReservationState,
    ) -> LimitReservationV1 {
        for leg in self.legs_of(record) {
            self.refund_unstarted(leg, state);
        }
        self.reservations[&record.receipt.reservation]
            .receipt
            .clone()
    }

    pub fn start(
        &mut self,
        id: &ReservationId,
        operation: &OperationId,
        deadline_ms: Option<u64>,
    ) -> StartOutcome {
        let Some(record) = self.reservations.get(id).cloned() else {
            return StartOutcome::NotFound;
        };
        if let Some(bound) = &record.receipt.operation_id {
            return if bound == operation {
                StartOutcome::Duplicate(record.receipt)
            } else {
                StartOutcome::OperationConflict {
                    bound: bound.clone(),
                }
            };
        }
        match record.receipt.state {
            ReservationState::Reserved if self.now < record.receipt.expires_at => {}
            // The hold ran out: the start loses the race to expiry.
            ReservationState::Reserved | ReservationState::Expiring => {
                return StartOutcome::Expired(
                    self.end_unstarted(&record, ReservationState::Expired),
                );
            }
            ReservationState::Expired => return StartOutcome::Expired(record.receipt),
            other => return StartOutcome::IllegalState(other),
        }
        // The legs share the earliest usage deadline and hard limit.
        let legs = self.legs_of(&record);
        let mut usage_ms = u64::MAX;
        let mut hard_limit_ms = u64::MAX;
        for leg in &legs {
            let key = leg.account_key();
            let policy = &self.pairs[&key.pair].policies[&key.policy_generation];
            let hard = policy.execution_hard_limit_ms;
            usage_ms = usage_ms.min(deadline_ms.unwrap_or(policy.hold_ttl_ms).min(hard));
            hard_limit_ms = hard_limit_ms.min(hard);
        }
        for mut leg in legs {
            leg.receipt.state = ReservationState::Started;
            leg.receipt.operation_id = Some(operation.clone());
            leg.started_at = Some(self.now);
            leg.usage_deadline = Some(self.now.saturating_add_ms(usage_ms));
            leg.hard_limit_at = Some(self.now.saturating_add_ms(hard_limit_ms));
            self.reservations
                .insert(leg.receipt.reservation.clone(), leg);
        }
        StartOutcome::Started(self.reservations[id].receipt.clone())
    }

    /// Overage takes the account's `available` first; the rest is
    /// overdraft (debt), recorded in full. Returns the overdraft.
    fn charge_overage(terms: &mut AccountTerms, overage: u64) -> u64 {
        let from_available = overage.min(terms.available);
        terms.available -= from_available;
        let overdraft = overage - from_available;
        terms.overdraft_issued += overdraft;
        overdraft
    }

    /// docs/design.md §3.6: an overdraft above `overdraftUnitsMax`, or made
    /// past the execution hard limit, freezes the pair.
    fn note_breach(&mut self, record: &ReservationRecord, overdraft: u64) {
        let key = record.account_key();
        let overdraft_max =
            self.pairs[&key.pair].policies[&key.policy_generation].overdraft_units_max;
        let past_hard_limit = record.hard_limit_at.is_some_and(|limit| self.now > limit);
        if overdraft > 0 && (overdraft > overdraft_max || past_hard_limit) {
            self.pairs.get_mut(&key.pair).expect("pair").record.frozen = true;
        }
    }

    /// `settleUsage` of one started (or usage-unknown) leg on its account.
    /// Returns the overdraft.
    fn charge_leg(&mut self, record: &ReservationRecord, actual_units: u64) -> u64 {
        if record.shadow {
            return 0;
        }
        let reserved = record.receipt.reserved_units;
        let terms = self.terms_mut(&record.account_key());
        terms.reserved -= reserved;
        terms.spent += actual_units;
        if actual_units <= reserved {
            terms.available += reserved - actual_units;
            0
        } else {
            Self::charge_overage(terms, actual_units - reserved)
        }
    }

    /// docs/design.md §3.6: a late genuine receipt corrects one leg's
    /// conservative settlement. Returns the correction's overdraft.
    fn correct_leg(&mut self, record: &ReservationRecord, actual_units: u64) -> u64 {
        if record.shadow {
            return 0;
        }
        let charged = record.settlement.as_ref().expect("settled").actual_units;
        let key = record.account_key();
        let burst = self.pairs[&key.pair].policies[&key.policy_generation].burst;
        let terms = self.terms_mut(&key);
        if actual_units <= charged {
            // docs/design.md §4: `available` never exceeds `burst`. Refills
            // may have refilled the conservatively charged units
            // already; the refund is credited like a mint, up to
            // `burst − (available + reserved)`, and the rest is cut:
            // it leaves through `minted` (the refills it duplicates).
            let refund = charged - actual_units;
            let room = burst.saturating_sub(terms.available + terms.reserved);
            let cut = (refund - refund.min(room)).min(terms.minted - terms.overdraft_repaid);
            terms.spent -= refund;
            terms.available += refund - cut;
            terms.minted -= cut;
            0
        } else {
            let overage = actual_units - charged;
            terms.spent += overage;
            Self::charge_overage(terms, overage)
        }
    }

    /// Writes the settlement of every leg (`legs`: record, actual units,
    /// overdraft, in leg order); each leg's receipt lists all legs when
    /// there are several.
    fn write_settlements(
        &mut self,
        legs: Vec<(ReservationRecord, u64, u64)>,
        conservative: bool,
        correction: bool,
    ) {
        let listed: Option<Vec<SettledLegV1>> = (legs.len() > 1).then(|| {
            legs.iter()
                .map(|(record, actual_units, overdraft_units)| SettledLegV1 {
                    reservation: record.receipt.reservation.clone(),
                    subject: record.receipt.subject.clone(),
                    route: record.receipt.route.clone(),
                    reserved_units: record.receipt.reserved_units,
                    actual_units: *actual_units,
                    overdraft_units: *overdraft_units,
                })
                .collect()
        });
        for (mut record, actual_units, overdraft_units) in legs {
            let receipt = &record.receipt;
            let settlement = SettlementReceiptV1 {
                schema: Default::default(),
                reservation: receipt.reservation.clone(),
                operation_id: receipt.operation_id.clone().expect("started"),
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
                settled_at: self.now,
                legs: listed.clone(),
            };
            record.receipt.state = settlement.state;
            record.receipt.actual_units = Some(actual_units);
            record.settlement = Some(settlement);
            if correction {
                record.corrected = true;
            } else {
                record.ended_at = Some(self.now);
            }
            self.note_breach(&record, overdraft_units);
            self.reservations
                .insert(record.receipt.reservation.clone(), record);
        }
    }

    /// Settles every leg of the started (or usage-unknown) `record`'s
    /// reservation, each at its actual units (by leg ID).
    fn settle_started(
        &mut self,
        record: &ReservationRecord,
        actuals: &BTreeMap<ReservationId, u64>,
        conservative: bool,
    ) {
        let mut settled = Vec::new();
        for leg in self.legs_of(record) {
            let actual = actuals[&leg.receipt.reservation];
            let overdraft = self.charge_leg(&leg, actual);
            settled.push((leg, actual, overdraft));
        }
        self.write_settlements(settled, conservative, false);
    }

    /// The actual units of every leg of `receipt`'s reservation, by leg
    /// ID: one number settles a reservation of one leg; per pair, a leg
    /// left out at its reserved units.
    fn actuals_by_leg(
        receipt: &LimitReservationV1,
        actuals: &SettleActuals,
    ) -> Result<BTreeMap<ReservationId, u64>, (usize, LegProblem)> {
        let legs = receipt
            .legs
            .clone()
            .unwrap_or_else(|| vec![receipt.as_leg()]);
        let mut by_leg: BTreeMap<ReservationId, u64> = legs
            .iter()
            .map(|leg| (leg.reservation.clone(), leg.reserved_units))
            .collect();
        match actuals {
            SettleActuals::One(actual_units) => {
                if legs.len() > 1 {
                    return Err((0, LegProblem::SettleForm));
                }
                by_leg.insert(receipt.reservation.clone(), *actual_units);
            }
            SettleActuals::Legs(given) => {
                for (index, actual) in given.iter().enumerate() {
                    let Some(leg) = legs
                        .iter()
                        .find(|leg| leg.subject == actual.subject && leg.route == actual.route)
                    else {
                        return Err((index, LegProblem::NotALeg));
                    };
                    if given[..index].iter().any(|earlier| {
                        earlier.subject == actual.subject && earlier.route == actual.route
                    }) {
                        return Err((index, LegProblem::RepeatedPair));
                    }
                    if actual.actual_units > UNITS_MAX {
                        return Err((index, LegProblem::ActualUnits));
                    }
                    by_leg.insert(leg.reservation.clone(), actual.actual_units);
                }
            }
        }
        Ok(by_leg)
    }

    /// `settle` with one number (the one-leg form).
    pub fn settle(
        &mut self,
        id: &ReservationId,
        operation: &OperationId,
        actual_units: u64,
    ) -> SettleOutcome {
        self.settle_legs(id, operation, &SettleActuals::One(actual_units))
    }

    /// `settleUsage`: every leg of the reservation settles in one step.
    pub fn settle_legs(
        &mut self,
        id: &ReservationId,
        operation: &OperationId,
        actuals: &SettleActuals,
    ) -> SettleOutcome {
        let Some(record) = self.reservations.get(id).cloned() else {
            return SettleOutcome::NotFound;
        };
        if let Some(bound) = &record.receipt.operation_id
            && bound != operation
        {
            return SettleOutcome::OperationConflict {
                bound: bound.clone(),
            };
        }
        let by_leg = match Self::actuals_by_leg(&record.receipt, actuals) {
            Ok(by_leg) => by_leg,
            Err((index, problem)) => return SettleOutcome::InvalidLeg { index, problem },
        };
        if let Some(settlement) = &record.settlement {
            let settled: BTreeMap<ReservationId, u64> = match &settlement.legs {
                Some(legs) => legs
                    .iter()
                    .map(|leg| (leg.reservation.clone(), leg.actual_units))
                    .collect(),
                None => BTreeMap::from([(id.clone(), settlement.actual_units)]),
            };
            if settled == by_leg {
                return SettleOutcome::Duplicate(settlement.clone());
            }
            if !settlement.conservative || record.corrected {
                return SettleOutcome::SettlementConflict(settlement.clone());
            }
            // docs/design.md §3.6: a late genuine receipt corrects a
            // conservative settlement exactly once, every leg.
            let mut corrected = Vec::new();
            for leg in self.legs_of(&record) {
                let actual = by_leg[&leg.receipt.reservation];
                let overdraft = self.correct_leg(&leg, actual);
                corrected.push((leg, actual, overdraft));
            }
            self.write_settlements(corrected, false, true);
            return SettleOutcome::Corrected(self.settlement_of(id));
        }
        match record.receipt.state {
            ReservationState::Started | ReservationState::UsageUnknown => {
                self.settle_started(&record, &by_leg, false);
                SettleOutcome::Settled(self.settlement_of(id))
            }
            ReservationState::Reserved => SettleOutcome::NotStarted(ReservationState::Reserved),
            other => SettleOutcome::IllegalState(other),
        }
    }

    fn settlement_of(&self, id: &ReservationId) -> SettlementReceiptV1 {
        self.reservations[id]
            .settlement
            .clone()
            .expect("just settled")
    }

    pub fn release(&mut self, id: &ReservationId) -> ReleaseOutcome {
        let Some(record) = self.reservations.get(id).cloned() else {
            return ReleaseOutcome::NotFound;
        };
        match record.receipt.state {
            ReservationState::Reserved => {
                ReleaseOutcome::Released(self.end_unstarted(&record, ReservationState::Released))
            }
            ReservationState::Released => ReleaseOutcome::Duplicate(record.receipt),
            other => ReleaseOutcome::IllegalState(other),
        }
    }

    /// Whether `caller` may read or act on reservation `id`
    /// (docs/design.md §3.11): its owner, the operator, and anyone on what
    /// has no owner recorded.
    pub fn may_act_on(&self, id: &ReservationId, caller: &Caller) -> bool {
        let Caller::Gateway(identity) = caller else {
            return true;
        };
        let owner = match (self.reservations.get(id), self.tombstones.get(id)) {
            (Some(record), _) => record.owner.as_ref(),
            (None, Some(tombstone)) => tombstone.owner.as_ref(),
            (None, None) => None,
        };
        owner.is_none_or(|owner| owner == identity)
    }

    /// docs/design.md §3.11: a gateway abandons only IDs it derives from
    /// the origin it shows (tombstoning an unknown one); the operator
    /// abandons what exists and lays no tombstone.
    pub fn abandon(&mut self, request: &AbandonRequest) -> AbandonOutcome {
        let id = &request.reservation;
        let owner = match &request.caller {
            Caller::Gateway(identity) => {
                let derived = request.origin.as_ref().map(|origin| {
                    ReservationId::derive(
                        identity,
                        &origin.subject,
                        &origin.route,
                        &origin.idempotency_key,
                    )
                });
                if derived.as_ref() != Some(id) {
                    return AbandonOutcome::NotOwner;
                }
                Some(identity.clone())
            }
            Caller::Operator => None,
        };
        if !self.may_act_on(id, &request.caller) {
            return AbandonOutcome::NotOwner;
        }
        if self.tombstones.contains_key(id) {
            return AbandonOutcome::Duplicate;
        }
        let Some(record) = self.reservations.get(id).cloned() else {
            if owner.is_none() {
                return AbandonOutcome::NotFound;
            }
            self.tombstones.insert(
                id.clone(),
                TombstoneRecord {
                    reservation: id.clone(),
                    abandoned_at: self.now,
                    owner,
                },
            );
            return AbandonOutcome::Tombstoned;
        };
        match record.receipt.state {
            ReservationState::Reserved => {
                AbandonOutcome::Abandoned(self.end_unstarted(&record, ReservationState::Abandoned))
            }
            ReservationState::Abandoned => AbandonOutcome::Duplicate,
            _ => AbandonOutcome::IllegalState(record.receipt),
        }
    }

    // ----- retention -----

    /// Reservation and shard records of the account.
    fn records_of(&self, key: &AccountKey) -> u64 {
        let reservations = self
            .reservations
            .values()
            .filter(|record| record.is_in_account(key))
            .count();
        let shards = self
            .shards
            .values()
            .filter(|record| record.is_in_account(key))
            .count();
        (reservations + shards) as u64
    }

    fn account_debt(&self, key: &AccountKey) -> u64 {
        let terms = self.terms(key);
        terms.overdraft_issued - terms.overdraft_repaid
    }

    /// docs/design.md (retention): terminal reservations, tombstones and
    /// reconciled shards whose window (`RETENTION_MS` from their end) has
    /// passed are forgotten, except a settlement or receipt that made debt
    /// its account still owes; then each touched pair folds its accounts
    /// older than the current epoch or generation that hold no record and
    /// no debt into its closed history. A multi-leg reservation's legs go
    /// together, once every one of them may (§3.13).
    pub fn forget(&mut self) -> ForgetOutcome {
        let retention_ms = self.config.retention_ms;
        let due =
            |since: Timestamp, now: Timestamp| since.unix_ms() + retention_ms <= now.unix_ms();
        let mut outcome = ForgetOutcome::default();
        let mut touched = BTreeSet::new();
        let may_go = |record: &ReservationRecord| {
            record.receipt.state.is_terminal()
                && due(record.ended_at.expect("terminal records end"), self.now)
                && (record
                    .settlement
                    .as_ref()
                    .is_none_or(|s| s.overdraft_units == 0)
                    || self.account_debt(&record.account_key()) == 0)
        };
        let reservations: Vec<ReservationRecord> = self
            .reservations
            .values()
            .filter(|record| match &record.receipt.legs {
                Some(legs) => legs
                    .iter()
                    .all(|leg| self.reservations.get(&leg.reservation).is_none_or(may_go)),
                None => may_go(record),
            })
            .cloned()
            .collect();
        for record in reservations {
            let key = record.account_key();
            let tally = self.forgotten.entry(key.clone()).or_default();
            tally.reservations += 1;
            if let Some(settlement) = record.settlement.as_ref().filter(|_| !record.shadow) {
                tally.spent += settlement.actual_units;
                tally.overdraft_issued += settlement.overdraft_units;
            }
            self.reservations.remove(&record.receipt.reservation);
            touched.insert(key.pair);
            outcome.reservations += 1;
        }
        let now = self.now;
        let tombstones = self.tombstones.len();
        self.tombstones
            .retain(|_, tombstone| !due(tombstone.abandoned_at, now));
        outcome.tombstones = tombstones - self.tombstones.len();
        // Reconciled shards, and shards lost and never reconciled (from
        // when they were marked lost).
        let shards: Vec<ShardRecord> = self
            .shards
            .values()
            .filter(|record| match &record.reconciliation {
                Some(done) => {
                    due(done.reconciled_at, now)
                        && (done.overdraft_debt_units == 0
                            || self.account_debt(&record.account_key()) == 0)
                }
                None => record.lost_at.is_some_and(|lost_at| due(lost_at, now)),
            })
            .cloned()
            .collect();
        for record in shards {
            let key = record.account_key();
            let debt = record
                .reconciliation
                .as_ref()
                .map_or(0, |done| done.overdraft_debt_units);
            let tally = self.forgotten.entry(key.clone()).or_default();
            tally.shards += 1;
            tally.spent += debt;
            tally.overdraft_issued += debt;
            tally.shard_units += record.shard.allocated_units;
            if record.reconciliation.is_none() {
                tally.lost_shards += 1;
                tally.lost_units += record.shard.allocated_units;
            }
            self.shards.remove(&record.shard.shard);
            touched.insert(key.pair);
            outcome.shards += 1;
        }
        for pair in touched {
            let state = &self.pairs[&pair];
            let current = (
                epoch_start(now, state.policy().accounting_epoch_ms),
                state.record.current_generation,
            );
            let closed: Vec<(Timestamp, u64)> = state
                .accounts
                .iter()
                .filter(|((epoch, generation), terms)| {
                    (*epoch < current.0 || *generation < current.1)
                        && terms.reserved == 0
                        && terms.overdraft_issued == terms.overdraft_repaid
                })
                .map(|(key, _)| *key)
                .filter(|key| self.records_of(&account_key(&pair, *key)) == 0)
                .collect();
            for key in closed {
                let account = account_key(&pair, key);
                let terms = self
                    .pairs
                    .get_mut(&pair)
                    .expect("pair")
                    .accounts
                    .remove(&key)
                    .expect("account");
                let tally = self.forgotten.remove(&account).unwrap_or_default();
                let history: &mut ClosedHistory = &mut self
                    .pairs
                    .get_mut(&pair)
                    .expect("pair")
                    .record
                    .closed_history;
                history.accounts += 1;
                let sum = &mut history.terms;
                sum.opening += terms.opening;
                sum.minted += terms.minted;
                sum.overdraft_issued += terms.overdraft_issued;
                sum.available += terms.available;
                sum.reserved += terms.reserved;
                sum.spent += terms.spent;
                sum.retired_for_emergency += terms.retired_for_emergency;
                sum.overdraft_repaid += terms.overdraft_repaid;
                let gone = &mut history.forgotten;
                gone.reservations += tally.reservations;
                gone.shards += tally.shards;
                gone.spent += tally.spent;
                gone.overdraft_issued += tally.overdraft_issued;
                gone.shard_units += tally.shard_units;
                outcome.accounts_folded += 1;
            }
        }
        outcome
    }

    // ----- workers -----

    /// Items still `RESERVED` past `expiresAt` become `EXPIRING`, oldest
    /// `expiresAt` first; a leg's siblings (due at the same instant) with
    /// the first of them, in leg order.
    pub fn begin_expiry(&mut self) -> Vec<ReservationId> {
        let mut due: Vec<(Timestamp, ReservationId)> = self
            .reservations
            .values()
            .filter(|record| {
                record.receipt.state == ReservationState::Reserved
                    && record.receipt.expires_at <= self.now
            })
            .map(|record| {
                (
                    record.receipt.expires_at,
                    record.receipt.reservation.clone(),
                )
            })
            .collect();
        due.sort();
        let mut expiring = Vec::new();
        for (_, id) in due {
            let record = self.reservations[&id].clone();
            if record.receipt.state != ReservationState::Reserved {
                continue;
            }
            for mut leg in self.legs_of(&record) {
                leg.receipt.state = ReservationState::Expiring;
                expiring.push(leg.receipt.reservation.clone());
                self.reservations
                    .insert(leg.receipt.reservation.clone(), leg);
            }
        }
        expiring
    }

    /// `EXPIRING → EXPIRED`, units back to `available`, by ID; a leg's
    /// siblings with the first of them, in leg order.
    pub fn complete_expiry(&mut self) -> Vec<ReservationId> {
        let due: Vec<ReservationId> = self
            .reservations
            .values()
            .filter(|record| record.receipt.state == ReservationState::Expiring)
            .map(|record| record.receipt.reservation.clone())
            .collect();
        let mut expired = Vec::new();
        for id in due {
            let record = self.reservations[&id].clone();
            if record.receipt.state != ReservationState::Expiring {
                continue;
            }
            for leg in self.legs_of(&record) {
                expired.push(leg.receipt.reservation.clone());
                self.refund_unstarted(leg, ReservationState::Expired);
            }
        }
        expired
    }

    /// `STARTED` past its usage deadline → `USAGE_UNKNOWN` (units stay
    /// reserved); `USAGE_UNKNOWN` past the hard limit → settled
    /// conservatively at the full reservation. Processed in due order; an
    /// item can take both steps in one call. Each changed ID is listed once,
    /// in the order of its first change.
    pub fn handle_usage_deadlines(&mut self) -> Vec<ReservationId> {
        let due_at = |record: &ReservationRecord| match record.receipt.state {
            ReservationState::Started => record.usage_deadline,
            ReservationState::UsageUnknown => record.hard_limit_at,
            _ => None,
        };
        let mut queue: BTreeSet<(Timestamp, ReservationId)> = self
            .reservations
            .values()
            .filter_map(|record| Some((due_at(record)?, record.receipt.reservation.clone())))
            .collect();
        let mut changed = Vec::new();
        while let Some((due, id)) = queue.pop_first() {
            if due > self.now {
                break;
            }
            let record = self.reservations[&id].clone();
            // A sibling leg due at the same time moved this one already.
            if due_at(&record) != Some(due) {
                continue;
            }
            let legs = self.legs_of(&record);
            if record.receipt.state == ReservationState::Started {
                for mut leg in legs.iter().cloned() {
                    leg.receipt.state = ReservationState::UsageUnknown;
                    let leg_id = leg.receipt.reservation.clone();
                    queue.insert((due_at(&leg).expect("hard limit"), leg_id.clone()));
                    self.reservations.insert(leg_id, leg);
                }
            } else {
                let reserved = legs
                    .iter()
                    .map(|leg| (leg.receipt.reservation.clone(), leg.receipt.reserved_units))
                    .collect();
                self.settle_started(&record, &reserved, true);
            }
            for leg in legs {
                if !changed.contains(&leg.receipt.reservation) {
                    changed.push(leg.receipt.reservation);
                }
            }
        }
        changed
    }

    /// Due refill ticks per pair, counted from `lastRefillAt` (moved to the
    /// epoch's start when an epoch opens), minted debt first, capped.
    pub fn handle_refill(&mut self) {
        let pairs: Vec<PairKey> = self.pairs.keys().cloned().collect();
        for pair in pairs {
            self.current_account(&pair);
            let state = self.pairs.get_mut(&pair).expect("pair");
            let refill = state.policy().refill;
            let elapsed = self.now.unix_ms() - state.record.last_refill_at.unix_ms();
            let ticks = elapsed / refill.interval_ms;
            if ticks == 0 {
                continue;
            }
            state.record.last_refill_at = state
                .record
                .last_refill_at
                .saturating_add_ms(ticks * refill.interval_ms);
            self.mint(&pair, ticks * refill.units);
        }
    }

    // ----- gateways and shards (docs/design.md §5) -----

    /// docs/design.md §5.2: the boot request must be fresh — within the
    /// skew window of `now`, under another nonce and later than the current
    /// boot's request; the new boot gets the next epoch and `boot_nonce`.
    pub fn register(
        &mut self,
        identity: &GatewayIdentity,
        boot_nonce: BootNonce,
        request: BootRequest,
    ) -> RegisterOutcome {
        let now = self.now;
        let Some(gateway) = self.gateways.get_mut(identity) else {
            return RegisterOutcome::UnknownGateway;
        };
        let skew_ms = request.requested_at.unix_ms().abs_diff(now.unix_ms());
        if skew_ms > BOOT_SKEW_MS_MAX {
            return RegisterOutcome::Replayed(BootReplay::OutsideSkew { skew_ms });
        }
        if let Some(last) = gateway.last_boot_request {
            if last.request_nonce == request.request_nonce {
                return RegisterOutcome::Replayed(BootReplay::SameNonce);
            }
            if request.requested_at <= last.requested_at {
                return RegisterOutcome::Replayed(BootReplay::NotAfterCurrentBoot);
            }
        }
        gateway.last_boot_request = Some(request);
        gateway.boot_epoch += 1;
        gateway.boot_nonce = Some(boot_nonce);
        RegisterOutcome::Registered {
            boot_epoch: gateway.boot_epoch,
            boot_nonce,
        }
    }

    /// docs/design.md §5.3: carves the pair's `emergencyShardUnits` out of
    /// its current account, bound to the gateway's current boot and the
    /// pair's next fence, signed by `signer`.
    pub fn issue_shard(
        &mut self,
        request: &IssueShardRequest,
        signer: &dyn DocumentSigner,
    ) -> IssueShardOutcome {
        // A repeat of the very request that issued the shard gets it again.
        if let Some(existing) = self.shards.get(&request.shard)
            && existing.shard.gateway_identity == request.identity
            && existing.shard.boot_epoch == request.boot_epoch
            && existing.shard.boot_nonce == request.boot_nonce
            && existing.shard.subject == request.subject
            && existing.shard.route == request.route
        {
            return IssueShardOutcome::Duplicate(Box::new(existing.shard.clone()));
        }
        let Some(gateway) = self.gateways.get(&request.identity) else {
            return IssueShardOutcome::UnknownGateway;
        };
        if gateway.boot_epoch == 0
            || gateway.boot_epoch != request.boot_epoch
            || gateway.boot_nonce != Some(request.boot_nonce)
        {
            return IssueShardOutcome::SupersededBoot {
                current_epoch: gateway.boot_epoch,
            };
        }
        let pair = PairKey::new(request.subject.clone(), request.route.clone());
        let Some(policy) = self.policy(&pair).cloned() else {
            return IssueShardOutcome::NoPolicy;
        };
        if policy.emergency_mode != EmergencyMode::Enabled || policy.mode != RouteMode::Enforce {
            return IssueShardOutcome::EmergencyDisabled;
        }
        if self.shards.contains_key(&request.shard) {
            return IssueShardOutcome::ShardIdTaken;
        }
        let open = self
            .shards
            .values()
            .filter(|record| {
                record.reconciliation.is_none()
                    && record.shard.gateway_identity == request.identity
                    && record.shard.boot_epoch == request.boot_epoch
                    && record.shard.subject == request.subject
                    && record.shard.route == request.route
            })
            .count();
        if open >= self.config.open_shards_per_gateway_pair_max {
            return IssueShardOutcome::TooManyOpenShards;
        }
        // Open (neither reconciled nor lost) units of this identity and
        // pair over all its boots, capped.
        let counted: Vec<&ShardRecord> = self
            .shards
            .values()
            .filter(|record| {
                record.reconciliation.is_none()
                    && record.lost_at.is_none()
                    && record.shard.gateway_identity == request.identity
                    && record.shard.subject == request.subject
                    && record.shard.route == request.route
            })
            .collect();
        let held: u64 = counted.iter().map(|r| r.shard.allocated_units).sum();
        if held + policy.emergency_shard_units
            > self.config.unreconciled_shard_units_factor * policy.emergency_shard_units
        {
            let oldest = counted
                .iter()
                .map(|r| r.shard.not_after)
                .min()
                .map_or(self.now, |t| {
                    t.saturating_add_ms(self.config.shard_lost_grace_ms)
                });
            let wait_ms = oldest.unix_ms().saturating_sub(self.now.unix_ms());
            return IssueShardOutcome::UnreconciledCap {
                retry_after_seconds: wait_ms.div_ceil(1000).max(1),
            };
        }
        let key = self.current_account(&pair);
        let units = policy.emergency_shard_units;
        if let Some(rejection) = self
            .pair_gate(&pair, &key, units)
            .or_else(|| self.capacity_check(&key, units))
        {
            return IssueShardOutcome::Rejected(rejection);
        }
        let terms = self.terms_mut(&key);
        terms.available -= units;
        terms.retired_for_emergency += units;
        let record = &mut self.pairs.get_mut(&pair).expect("pair").record;
        let fence = record.next_fence;
        record.next_fence += 1;
        let mut shard = EmergencyShardV1 {
            schema: Default::default(),
            shard: request.shard.clone(),
            subject: request.subject.clone(),
            route: request.route.clone(),
            policy_generation: policy.policy_generation,
            accounting_epoch: key.accounting_epoch,
            allocated_units: units,
            gateway_identity: request.identity.clone(),
            boot_epoch: request.boot_epoch,
            boot_nonce: request.boot_nonce,
            fence,
            not_before: self.now,
            not_after: self
                .now
                .saturating_add_ms(policy.emergency_shard_validity_ms),
            key_id: signer.key_id().clone(),
            signature: Signature::UNSIGNED,
        };
        sign_document(&mut shard, signer);
        self.shards.insert(
            request.shard.clone(),
            ShardRecord {
                shard: shard.clone(),
                reconciliation: None,
                lost_at: None,
            },
        );
        IssueShardOutcome::Issued(Box::new(shard))
    }

    /// docs/design.md §5.9: a terminal receipt from the shard's own
    /// identity (caller, receipt and key), signed by it, reconciles the
    /// shard exactly once; a second receipt re-mints nothing; a receipt
    /// that disagrees with its shard or breaks its own equation is refused.
    pub fn reconcile(
        &mut self,
        receipt: &ShardTerminalReceiptV1,
        caller: &GatewayIdentity,
        verifier: &dyn DocumentVerifier,
    ) -> ReconcileOutcome {
        let Some(record) = self.shards.get(&receipt.shard).cloned() else {
            return ReconcileOutcome::UnknownShard;
        };
        let bound = &record.shard.gateway_identity;
        if caller != bound || &receipt.gateway_identity != bound || &receipt.key_id != bound {
            return ReconcileOutcome::WrongIdentity;
        }
        if let Err(error) = verify_document(receipt, verifier) {
            return ReconcileOutcome::BadSignature(error);
        }
        if let Some(done) = record.reconciliation {
            return ReconcileOutcome::Duplicate(done);
        }
        let shard = &record.shard;
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
            return ReconcileOutcome::Mismatch(field);
        }
        // Receipt debt becomes overdraft (and spending) of the shard's own
        // account; confirmed unused units are re-minted into the current
        // account; spent and unknown units stay retired.
        let origin = record.account_key();
        let debt = receipt.overdraft_debt_units;
        let terms = self.terms_mut(&origin);
        terms.spent += debt;
        terms.overdraft_issued += debt;
        let (repaid, reminted, cut) = self.mint(&origin.pair, receipt.confirmed_unused_units);
        let reconciliation = Reconciliation {
            receipt_digest: document_digest(receipt),
            spent_units: receipt.spent_units,
            confirmed_unused_units: receipt.confirmed_unused_units,
            unknown_units: receipt.unknown_units,
            overdraft_debt_units: debt,
            repaid_units: repaid,
            reminted_units: reminted,
            cut_units: cut,
            reconciled_at: self.now,
        };
        self.shards.insert(
            receipt.shard.clone(),
            ShardRecord {
                reconciliation: Some(reconciliation.clone()),
                ..record
            },
        );
        ReconcileOutcome::Reconciled(reconciliation)
    }

    /// Shards open `SHARD_LOST_GRACE_MS` past their `notAfter` are marked
    /// lost, oldest `notAfter` first; nothing else moves.
    pub fn mark_lost(&mut self) -> Vec<LostShard> {
        let now = self.now;
        let mut due: Vec<(Timestamp, ShardId)> = self
            .shards
            .values()
            .filter(|record| {
                record.reconciliation.is_none()
                    && record.lost_at.is_none()
                    && record
                        .shard
                        .not_after
                        .saturating_add_ms(self.config.shard_lost_grace_ms)
                        <= now
            })
            .map(|record| (record.shard.not_after, record.shard.shard.clone()))
            .collect();
        due.sort();
        due.into_iter()
            .map(|(_, id)| {
                let record = self.shards.get_mut(&id).expect("due shard");
                record.lost_at = Some(now);
                let shard = &record.shard;
                LostShard {
                    shard: id,
                    identity: shard.gateway_identity.clone(),
                    boot_epoch: shard.boot_epoch,
                    subject: shard.subject.clone(),
                    route: shard.route.clone(),
                    units: shard.allocated_units,
                    not_after: shard.not_after,
                }
            })
            .collect()
    }
    // ----- the protocol (ledger::protocol::apply) -----

    /// Applies `operation` at `now` to the model and predicts the reply
    /// `ledger::protocol::apply` gives; `None` for the whole-ledger views
    /// (accounts, audit, gauges), which the model does not predict.
    pub fn predict(
        &mut self,
        operation: &Operation,
        now: Timestamp,
        context: Context<'_>,
    ) -> Option<Reply> {
        self.now = now;
        let reply = match operation {
            Operation::Publish(policy) => Reply::Publish(self.publish((**policy).clone())),
            Operation::Enroll(identity) => Reply::Enroll(self.enroll(identity)),
            Operation::SetAdmissionStopped {
                pair,
                generation,
                stopped,
            } => Reply::RouteControl(self.set_admission_stopped(pair, *generation, *stopped)),
            Operation::SetFrozen { pair, frozen } => {
                Reply::RouteControl(self.set_frozen(pair, *frozen))
            }
            Operation::Reserve(request) => {
                let mut outcome = self.reserve(request);
                // The refused leg's own pair (the first for one leg).
                let legs = request.legs();
                match &mut outcome {
                    ReserveOutcome::Rejected(rejection) => {
                        rejection.rate_limit = self.rate_limit_state(&legs[0].pair());
                    }
                    ReserveOutcome::LegRejected { index, rejection } => {
                        rejection.rate_limit = self.rate_limit_state(&legs[*index].pair());
                    }
                    _ => {}
                }
                Reply::Reserve(outcome)
            }
            Operation::Start {
                reservation,
                operation_id,
                deadline_ms,
                caller,
            } => self
                .refuse_not_owner(reservation, caller)
                .unwrap_or_else(|| {
                    Reply::Start(self.start(reservation, operation_id, *deadline_ms))
                }),
            Operation::Settle {
                reservation,
                operation_id,
                actuals,
                caller,
            } => self
                .refuse_not_owner(reservation, caller)
                .unwrap_or_else(|| {
                    Reply::Settle(self.settle_legs(reservation, operation_id, actuals))
                }),
            Operation::Release {
                reservation,
                caller,
            } => self
                .refuse_not_owner(reservation, caller)
                .unwrap_or_else(|| Reply::Release(self.release(reservation))),
            Operation::Abandon(request) => Reply::Abandon(self.abandon(request)),
            Operation::Register {
                identity,
                boot_nonce,
                request,
            } => Reply::Register(self.register(identity, *boot_nonce, *request)),
            Operation::IssueShard(request) => {
                Reply::IssueShard(self.issue_shard(request, context.signer))
            }
            Operation::Reconcile { receipt, caller } => {
                Reply::Reconcile(self.reconcile(receipt, caller, context.gateway_verifier))
            }
            Operation::GetReservation {
                reservation,
                caller,
            } => {
                if !self.may_act_on(reservation, caller) {
                    Reply::NotOwner {
                        reservation: reservation.clone(),
                        caller: caller.clone(),
                    }
                } else {
                    Reply::Reservation {
                        receipt: self
                            .reservations
                            .get(reservation)
                            .map(|record| record.receipt.clone()),
                        tombstoned: self.tombstones.contains_key(reservation),
                    }
                }
            }
            Operation::IsEnrolled(identity) => {
                Reply::IsEnrolled(self.gateways.contains_key(identity))
            }
            Operation::GetAccounts(_) | Operation::Audit | Operation::Gauges => return None,
            Operation::BeginExpiry => Reply::Swept(self.begin_expiry().len()),
            Operation::CompleteExpiry => Reply::Swept(self.complete_expiry().len()),
            Operation::UsageDeadlines => Reply::Swept(self.handle_usage_deadlines().len()),
            Operation::Refill => {
                self.handle_refill();
                Reply::Swept(0)
            }
            Operation::Forget => Reply::Forgotten(self.forget()),
            Operation::MarkLostShards => Reply::ShardsLost(self.mark_lost()),
        };
        Some(reply)
    }

    /// The refusal of a gateway's start, settle or release on another
    /// identity's reservation: nothing is read or changed.
    fn refuse_not_owner(&self, id: &ReservationId, caller: &GatewayIdentity) -> Option<Reply> {
        let caller = Caller::Gateway(caller.clone());
        (!self.may_act_on(id, &caller)).then(|| Reply::NotOwner {
            reservation: id.clone(),
            caller,
        })
    }

    /// What a refused reserve tells its caller of its own pair: the
    /// policy's burst, the time refills take to mint it (the epoch when
    /// nothing refills), and what the current account has available.
    fn rate_limit_state(&self, pair: &PairKey) -> Option<RateLimitState> {
        let policy = self.policy(pair)?;
        let key = (
            epoch_start(self.now, policy.accounting_epoch_ms),
            policy.policy_generation,
        );
        let remaining = self.pairs[pair]
            .accounts
            .get(&key)
            .map_or(0, |terms| terms.available);
        let window_seconds = refill_seconds(policy, policy.burst)
            .unwrap_or_else(|| policy.accounting_epoch_ms.div_ceil(1000).max(1));
        Some(RateLimitState {
            quota: policy.burst,
            window_seconds,
            remaining,
        })
    }
}
