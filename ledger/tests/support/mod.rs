//! A small data-driven harness for the seed-rule tests.
//!
//! [`Harness`] owns a [`CentralLedger`], a [`MemoryStore`] and a `now`. Every
//! operation goes through [`Harness::run`], which after *every* transition:
//!
//! 1. runs [`audit`] and asserts it clean (conservation of every account,
//!    reserved and retired terms matching their reservations and shards);
//! 2. asserts the negative space: an outcome that must change nothing
//!    (a rejection, a conflict, a duplicate) returned no changes and left
//!    every view of the ledger as it was, and a transition without changes
//!    left the ledger as it was;
//! 3. commits the changes to the store and rebuilds a second ledger from it
//!    with [`CentralLedger::from_records`], asserting it equals the live one:
//!    a transition's changes carry everything it did.
//!
//! [`ShardHarness`] does the same for one [`ShardLedger`] and its journal.
//!
//! Equations are written as in docs/design.md §4.7 and parsed, so a test
//! reads like the worked example: `"1000 + 0 + 100 = 0 + 0 + 1100 + 0 + 0"` is
//! `opening + minted + overdraftIssued = available + reserved + spent +
//! retiredForEmergency + overdraftRepaid`, and `"200 = 80 + 120 + 0 + 0"` is
//! `allocated = localAvailable + localReserved + localSpent + localRetired`.

// Each test binary uses its own part of the harness.
#![allow(dead_code)]

use std::collections::BTreeSet;
use std::fmt::Debug;

use ledger::invariants::{audit, check_shard};
use ledger::store::{LedgerStore, MemoryStore};
use ledger::{
    AbandonOutcome, AbandonRequest, AccountKey, AccountRecord, AccountTerms, Caller, CentralConfig,
    CentralLedger, Change, EnrollOutcome, GatewayRecord, IssueShardOutcome, IssueShardRequest,
    PairKey, PairRecord, PublishOutcome, ReconcileOutcome, RegisterOutcome, Rejection,
    ReleaseOutcome, ReservationOrigin, ReservationRecord, ReserveOutcome, ReserveRequest,
    RouteControlOutcome, SettleOutcome, ShardChange, ShardLedger, ShardRecord, ShardReleaseOutcome,
    ShardReserveOutcome, ShardSettleOutcome, ShardStartOutcome, ShardTerms, ShardTransition,
    StartOutcome, TombstoneRecord, Transition, epoch_start,
};
use shard_format::{
    AdmissionBudgetV1, BootNonce, Digest, Ed25519Signer, Ed25519Verifier, EmergencyMode,
    EmergencyShardV1, GatewayIdentity, IdempotencyKey, LimitReservationV1, OperationId, Refill,
    ReservationId, Route, RouteMode, SettlementReceiptV1, ShardId, Signature, Subject, Timestamp,
    sign_document,
};

// ----- names and time -----

/// 2026-07-19T14:00:00.000Z: the start of an accounting epoch of one hour.
pub const T0_MS: u64 = 1_784_469_600_000;

/// `accountingEpochMs` of [`policy`].
pub const EPOCH_MS: u64 = 3_600_000;

/// `T0 + ms`.
/// A boot request with `nonce`, sent at `requested_at`.
pub fn fresh_boot(nonce: BootNonce, requested_at: Timestamp) -> ledger::BootRequest {
    ledger::BootRequest {
        request_nonce: nonce,
        requested_at,
    }
}

pub fn at(ms: u64) -> Timestamp {
    Timestamp::from_unix_ms(T0_MS + ms).expect("a valid instant")
}

pub fn subject(name: &str) -> Subject {
    Subject::new(name).expect("a valid subject")
}

pub fn route(name: &str) -> Route {
    Route::new(name).expect("a valid route")
}

/// The ID gateway `g-a` ([`owner`]) derives for idempotency key `name` on
/// the seed's pair: every reservation of these tests is `g-a`'s.
pub fn rid(name: &str) -> ReservationId {
    ReservationId::derive(
        &owner(),
        &subject("tenant-7"),
        &route("chat.generate"),
        &key(name),
    )
}

pub fn key(name: &str) -> IdempotencyKey {
    IdempotencyKey::new(name).expect("a valid idempotency key")
}

/// The identity that makes the seed tests' reservations: gateway `g-a`.
pub fn owner() -> GatewayIdentity {
    identity(&gateway_signer())
}

/// What `g-a` derived [`rid`]`(name)` from.
pub fn origin(name: &str) -> ReservationOrigin {
    ReservationOrigin {
        subject: subject("tenant-7"),
        route: route("chat.generate"),
        idempotency_key: key(name),
    }
}

pub fn op(name: &str) -> OperationId {
    OperationId::new(name).expect("a valid operation ID")
}

pub fn shard_id(name: &str) -> ShardId {
    ShardId::new(name).expect("a valid shard ID")
}

/// `tenant-7/chat.generate`, the seed's pair.
pub fn pair() -> PairKey {
    PairKey::new(subject("tenant-7"), route("chat.generate"))
}

/// A boot nonce that differs per `seed`.
pub fn nonce(seed: u8) -> BootNonce {
    BootNonce([seed; 16])
}

/// The central ledger's shard signing key.
pub fn central_signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&[1; 32])
}

/// Gateway `g-a`'s identity key.
pub fn gateway_signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&[2; 32])
}

/// Another gateway's identity key (`g-b`).
pub fn other_gateway_signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&[3; 32])
}

pub fn identity(signer: &Ed25519Signer) -> GatewayIdentity {
    shard_format::DocumentSigner::key_id(signer).clone()
}

/// A verifier trusting exactly the given signers' keys.
pub fn verifier(signers: &[&Ed25519Signer]) -> Ed25519Verifier {
    Ed25519Verifier::new(signers.iter().map(|signer| identity(signer)))
}

/// The policy of docs/design.md §4.7 for `tenant-7/chat.generate`: opening
/// 1000, burst 1000, refill 100 units per 1000 ms, one-hour epochs,
/// reservations of at most 800, holds of 30 s, overdraft at most 200,
/// execution hard limit 600 s, emergency shards of 200 enabled, enforcing.
pub fn policy(generation: u64) -> AdmissionBudgetV1 {
    policy_for("tenant-7", generation)
}

pub fn policy_for(subject_name: &str, generation: u64) -> AdmissionBudgetV1 {
    AdmissionBudgetV1 {
        schema: Default::default(),
        subject: subject(subject_name),
        route: route("chat.generate"),
        region: "eu-west-1".into(),
        capacity_unit: "tokens".into(),
        policy_generation: generation,
        opening: 1000,
        refill: Refill {
            units: 100,
            interval_ms: 1000,
        },
        burst: 1000,
        accounting_epoch_ms: EPOCH_MS,
        estimator_digest: Digest([7; 32]),
        reservation_units_max: 800,
        hold_ttl_ms: 30_000,
        priority: 0,
        fairness_weight: 1,
        overdraft_units_max: 200,
        execution_hard_limit_ms: 600_000,
        emergency_mode: EmergencyMode::Enabled,
        mode: RouteMode::Enforce,
        emergency_shard_units: 200,
        emergency_shard_validity_ms: 600_000,
    }
}

/// A reserve request for the seed's pair; the digest stands for the
/// request `name` describes.
/// [`request`] on another pair (the ID derived for that pair).
pub fn request_on(pair: &PairKey, reservation: &str, units: u64, name: &str) -> ReserveRequest {
    ReserveRequest::new(
        owner(),
        key(reservation),
        pair.subject.clone(),
        pair.route.clone(),
        units,
        Digest::sha256(name.as_bytes()),
    )
}

pub fn request(reservation: &str, units: u64, name: &str) -> ReserveRequest {
    ReserveRequest::new(
        owner(),
        key(reservation),
        subject("tenant-7"),
        route("chat.generate"),
        units,
        Digest::sha256(name.as_bytes()),
    )
}

// ----- equations -----

fn parse_sum(side: &str, equation: &str) -> Vec<u64> {
    side.split('+')
        .map(|term| {
            term.trim()
                .parse()
                .unwrap_or_else(|_| panic!("bad term {term:?} in {equation:?}"))
        })
        .collect()
}

/// Parses `"opening + minted + overdraftIssued = available + reserved +
/// spent + retiredForEmergency + overdraftRepaid"` (all eight terms).
pub fn account_terms(equation: &str) -> AccountTerms {
    let (left, right) = equation
        .split_once('=')
        .unwrap_or_else(|| panic!("no `=` in {equation:?}"));
    let left = parse_sum(left, equation);
    let right = parse_sum(right, equation);
    assert!(
        left.len() == 3 && right.len() == 5,
        "{equation:?} must have 3 + 5 terms"
    );
    let terms = AccountTerms {
        opening: left[0],
        minted: left[1],
        overdraft_issued: left[2],
        available: right[0],
        reserved: right[1],
        spent: right[2],
        retired_for_emergency: right[3],
        overdraft_repaid: right[4],
    };
    assert!(
        terms.is_balanced(),
        "the test's own equation {equation:?} does not balance"
    );
    terms
}

/// Parses `"allocated = localAvailable + localReserved + localSpent +
/// localRetired"`.
pub fn shard_terms(equation: &str) -> ShardTerms {
    let (left, right) = equation
        .split_once('=')
        .unwrap_or_else(|| panic!("no `=` in {equation:?}"));
    let left = parse_sum(left, equation);
    let right = parse_sum(right, equation);
    assert!(
        left.len() == 1 && right.len() == 4,
        "{equation:?} must have 1 + 4 terms"
    );
    let terms = ShardTerms {
        allocated: left[0],
        local_available: right[0],
        local_reserved: right[1],
        local_spent: right[2],
        local_retired: right[3],
    };
    assert!(
        terms.is_balanced(),
        "the test's own equation {equation:?} does not balance"
    );
    terms
}

// ----- outcomes that must change nothing -----

/// An outcome that says whether it must have left the ledger untouched.
pub trait Outcome: Debug {
    /// Every rejection, conflict, refusal and duplicate: nothing moves.
    fn changes_nothing(&self) -> bool;
}

impl Outcome for ReserveOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Reserved(_) | Self::Shadow { .. })
    }
}

impl Outcome for StartOutcome {
    fn changes_nothing(&self) -> bool {
        // `Expired` completes the expiry when the start found the item
        // still held, so it may change the ledger.
        !matches!(self, Self::Started(_) | Self::Expired(_))
    }
}

impl Outcome for SettleOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Settled(_) | Self::Corrected(_))
    }
}

impl Outcome for ReleaseOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Released(_))
    }
}

impl Outcome for AbandonOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Tombstoned | Self::Abandoned(_))
    }
}

impl Outcome for PublishOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Published)
    }
}

impl Outcome for RouteControlOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Done)
    }
}

impl Outcome for EnrollOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Enrolled)
    }
}

impl Outcome for RegisterOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Registered { .. })
    }
}

impl Outcome for IssueShardOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Issued(_))
    }
}

impl Outcome for ReconcileOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Reconciled(_))
    }
}

/// The lost-shard sweep: none marked, nothing changed.
impl Outcome for Vec<ledger::LostShard> {
    fn changes_nothing(&self) -> bool {
        self.is_empty()
    }
}

/// The workers' outcome: the IDs they moved. None moved, nothing changed.
impl Outcome for Vec<ReservationId> {
    fn changes_nothing(&self) -> bool {
        self.is_empty()
    }
}

/// `handle_refill` says nothing; the generic checks still apply.
/// A reply of [`ledger::protocol::apply`]: what changes nothing is what
/// its inner outcome says, plus every read and refusal of the protocol.
impl Outcome for ledger::protocol::Reply {
    fn changes_nothing(&self) -> bool {
        use ledger::protocol::Reply;
        match self {
            Reply::Reserve(outcome) => outcome.changes_nothing(),
            Reply::Start(outcome) => outcome.changes_nothing(),
            Reply::Settle(outcome) => outcome.changes_nothing(),
            Reply::Release(outcome) => outcome.changes_nothing(),
            Reply::Abandon(outcome) => outcome.changes_nothing(),
            Reply::Reservation { .. } | Reply::NotOwner { .. } => true,
            _ => false,
        }
    }
}

impl Outcome for () {
    fn changes_nothing(&self) -> bool {
        false
    }
}

// ----- the central harness -----

/// Everything a caller can see of a central ledger, for comparison.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub accounts: Vec<(AccountKey, AccountTerms)>,
    pub pairs: Vec<PairRecord>,
    pub policies: Vec<Option<AdmissionBudgetV1>>,
    pub reservations: Vec<ReservationRecord>,
    pub tombstones: Vec<Option<TombstoneRecord>>,
    pub gateways: Vec<GatewayRecord>,
    pub shards: Vec<ShardRecord>,
}

impl Snapshot {
    fn of(ledger: &CentralLedger, ids: &BTreeSet<ReservationId>) -> Self {
        Self {
            accounts: ledger
                .accounts()
                .map(|(key, terms)| (key, *terms))
                .collect(),
            pairs: ledger.pairs().cloned().collect(),
            policies: ledger
                .pairs()
                .map(|record| ledger.policy(&record.pair).cloned())
                .collect(),
            reservations: {
                // The ledger's own order is its hash map's.
                let mut records: Vec<_> = ledger.reservations().cloned().collect();
                records.sort_by(|a, b| a.receipt.reservation.cmp(&b.receipt.reservation));
                records
            },
            tombstones: ids.iter().map(|id| ledger.tombstone(id).cloned()).collect(),
            gateways: ledger.gateways().cloned().collect(),
            shards: ledger.shards().cloned().collect(),
        }
    }
}

/// A central ledger with its store and clock. See the module documentation.
#[derive(Debug)]
pub struct Harness {
    pub ledger: CentralLedger,
    pub store: MemoryStore,
    pub now: Timestamp,
    /// Reservation IDs the harness has seen, to compare their tombstones.
    ids: BTreeSet<ReservationId>,
}

impl Default for Harness {
    fn default() -> Self {
        Self::new()
    }
}

impl Harness {
    /// An empty ledger at `T0`.
    pub fn new() -> Self {
        Self {
            ledger: CentralLedger::new(CentralConfig::default()),
            store: MemoryStore::new(),
            now: at(0),
            ids: BTreeSet::new(),
        }
    }

    /// A ledger at `T0` with `policy` published.
    pub fn with_policy(policy: AdmissionBudgetV1) -> Self {
        let mut harness = Self::new();
        assert_eq!(harness.publish(policy), PublishOutcome::Published);
        harness
    }

    /// A ledger loaded from `records` (which must pass the load audit).
    pub fn from_records(records: Vec<Change>) -> Self {
        let mut harness = Self::new();
        harness.store.commit(&records).expect("commit");
        harness.reload();
        harness
    }

    /// Moves the clock to `T0 + ms`.
    pub fn at(&mut self, ms: u64) -> &mut Self {
        self.now = at(ms);
        self
    }

    // ----- views and assertions -----

    /// The seed pair's account for `now`'s epoch under `generation`.
    pub fn account(&self, generation: u64) -> AccountKey {
        self.account_at(self.now, generation)
    }

    /// The seed pair's account of the epoch holding `instant`.
    pub fn account_at(&self, instant: Timestamp, generation: u64) -> AccountKey {
        AccountKey {
            pair: pair(),
            accounting_epoch: epoch_start(instant, EPOCH_MS),
            policy_generation: generation,
        }
    }

    pub fn terms(&self, key: &AccountKey) -> AccountTerms {
        *self
            .ledger
            .account(key)
            .unwrap_or_else(|| panic!("account {key:?} is open"))
    }

    /// Asserts an account's eight terms, written as in docs/design.md §4.7.
    #[track_caller]
    pub fn assert_account(&self, key: &AccountKey, equation: &str) {
        assert_eq!(
            self.terms(key),
            account_terms(equation),
            "account {key:?} should read {equation}"
        );
    }

    pub fn reservation(&self, id: &str) -> &ReservationRecord {
        self.ledger
            .reservation(&rid(id))
            .unwrap_or_else(|| panic!("reservation {id} exists"))
    }

    /// Every committed record.
    pub fn records(&self) -> Vec<Change> {
        self.store.load_all().expect("the store loads")
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot::of(&self.ledger, &self.ids)
    }

    // ----- the one way operations run -----

    /// Runs one operation at `now`, checks it (see the module
    /// documentation) and commits its changes.
    #[track_caller]
    pub fn run<O: Outcome>(
        &mut self,
        operation: impl FnOnce(&mut CentralLedger, Timestamp) -> Transition<O>,
    ) -> O {
        let Transition { outcome, changes } = self.apply(operation);
        self.store.commit(&changes).expect("the store commits");
        self.assert_store_mirrors_ledger(&outcome);
        outcome
    }

    /// Runs one operation whose commit fails (the process crashed before
    /// its changes were durable, so the caller never heard back), then
    /// rebuilds the ledger from the store as the shell must.
    #[track_caller]
    pub fn run_with_failed_commit<O: Outcome>(
        &mut self,
        operation: impl FnOnce(&mut CentralLedger, Timestamp) -> Transition<O>,
    ) -> O {
        let Transition { outcome, changes } = self.apply(operation);
        self.store.fail_next_commits(1);
        assert!(self.store.commit(&changes).is_err(), "the commit fails");
        self.reload();
        outcome
    }

    /// Rebuilds the ledger from the store: a central restart.
    #[track_caller]
    pub fn reload(&mut self) {
        let records = self.store.load_all().expect("the store loads");
        self.ledger = CentralLedger::from_records(CentralConfig::default(), records)
            .expect("committed records load into a clean ledger");
        let report = audit(&self.ledger);
        assert!(report.is_clean(), "audit after reload: {report:?}");
    }

    #[track_caller]
    fn apply<O: Outcome>(
        &mut self,
        operation: impl FnOnce(&mut CentralLedger, Timestamp) -> Transition<O>,
    ) -> Transition<O> {
        let before = self.snapshot();
        let transition = operation(&mut self.ledger, self.now);
        let outcome = &transition.outcome;
        let report = audit(&self.ledger);
        assert!(
            report.is_clean(),
            "audit after {outcome:?}: {:?}",
            report.violations
        );
        if outcome.changes_nothing() {
            assert!(
                transition.changes.is_empty(),
                "{outcome:?} must change nothing, yet returned {:?}",
                transition.changes
            );
        }
        if transition.changes.is_empty() {
            assert_eq!(
                self.snapshot(),
                before,
                "{outcome:?} returned no changes, yet the ledger changed"
            );
        }
        transition
    }

    #[track_caller]
    fn assert_store_mirrors_ledger<O: Debug>(&self, outcome: &O) {
        let records = self.store.load_all().expect("the store loads");
        let rebuilt = CentralLedger::from_records(CentralConfig::default(), records)
            .unwrap_or_else(|error| panic!("after {outcome:?} the store does not load: {error}"));
        assert_eq!(
            Snapshot::of(&rebuilt, &self.ids),
            self.snapshot(),
            "after {outcome:?} the committed changes do not rebuild the ledger"
        );
    }

    // ----- operations -----

    #[track_caller]
    pub fn publish(&mut self, policy: AdmissionBudgetV1) -> PublishOutcome {
        self.run(|ledger, now| ledger.publish_policy(policy, now))
    }

    #[track_caller]
    pub fn reserve_request(&mut self, request: ReserveRequest) -> ReserveOutcome {
        self.ids.insert(request.reservation.clone());
        self.run(|ledger, now| ledger.reserve(request, now))
    }

    /// Reserves `units` under `id`; the request digest is derived from
    /// `id` and `units`, so a retry of the same call is the same request.
    #[track_caller]
    pub fn reserve(&mut self, id: &str, units: u64) -> ReserveOutcome {
        self.reserve_request(request(id, units, &format!("{id}/{units}")))
    }

    /// A flexible reserve under `id`: anything from `min_units` to `units`.
    #[track_caller]
    pub fn reserve_between(&mut self, id: &str, min_units: u64, units: u64) -> ReserveOutcome {
        let name = format!("{id}/{min_units}..{units}");
        self.reserve_request(request(id, units, &name).flexible(min_units))
    }

    /// Reserves and asserts the reservation was made.
    #[track_caller]
    pub fn reserved(&mut self, id: &str, units: u64) -> LimitReservationV1 {
        reserved(self.reserve(id, units))
    }

    #[track_caller]
    pub fn start(&mut self, id: &str, operation: &str) -> StartOutcome {
        self.start_with_deadline(id, operation, None)
    }

    #[track_caller]
    pub fn start_with_deadline(
        &mut self,
        id: &str,
        operation: &str,
        deadline_ms: Option<u64>,
    ) -> StartOutcome {
        let (id, operation) = (rid(id), op(operation));
        self.run(|ledger, now| ledger.start(&id, operation, deadline_ms, now))
    }

    /// Starts and asserts the start took.
    #[track_caller]
    pub fn started(&mut self, id: &str, operation: &str) -> LimitReservationV1 {
        match self.start(id, operation) {
            StartOutcome::Started(receipt) => receipt,
            other => panic!("expected {id} to start, got {other:?}"),
        }
    }

    #[track_caller]
    pub fn settle(&mut self, id: &str, operation: &str, actual_units: u64) -> SettleOutcome {
        let (id, operation) = (rid(id), op(operation));
        self.run(|ledger, now| ledger.settle(&id, &operation, actual_units, now))
    }

    /// Settles and asserts the settlement took.
    #[track_caller]
    pub fn settled(&mut self, id: &str, operation: &str, actual_units: u64) -> SettlementReceiptV1 {
        match self.settle(id, operation, actual_units) {
            SettleOutcome::Settled(receipt) => receipt,
            other => panic!("expected {id} to settle, got {other:?}"),
        }
    }

    #[track_caller]
    pub fn release(&mut self, id: &str) -> ReleaseOutcome {
        let id = rid(id);
        self.run(|ledger, now| ledger.release(&id, now))
    }

    #[track_caller]
    pub fn abandon(&mut self, name: &str) -> AbandonOutcome {
        let id = rid(name);
        self.ids.insert(id.clone());
        let request = AbandonRequest {
            reservation: id,
            caller: Caller::Gateway(owner()),
            origin: Some(origin(name)),
        };
        self.run(|ledger, now| ledger.abandon(&request, now))
    }

    #[track_caller]
    pub fn begin_expiry(&mut self) -> Vec<ReservationId> {
        self.run(|ledger, now| ledger.begin_expiry(now))
    }

    #[track_caller]
    pub fn complete_expiry(&mut self) -> Vec<ReservationId> {
        self.run(|ledger, now| ledger.complete_expiry(now))
    }

    #[track_caller]
    pub fn usage_deadlines(&mut self) -> Vec<ReservationId> {
        self.run(|ledger, now| ledger.handle_usage_deadlines(now))
    }

    #[track_caller]
    pub fn refill(&mut self) {
        self.run(|ledger, now| ledger.handle_refill(now));
    }

    #[track_caller]
    pub fn set_frozen(&mut self, frozen: bool) -> RouteControlOutcome {
        self.run(|ledger, _| ledger.set_frozen(&pair(), frozen))
    }

    #[track_caller]
    pub fn set_admission_stopped(&mut self, generation: u64, stopped: bool) -> RouteControlOutcome {
        self.run(|ledger, _| ledger.set_admission_stopped(&pair(), generation, stopped))
    }

    #[track_caller]
    pub fn enroll(&mut self, signer: &Ed25519Signer) -> EnrollOutcome {
        let identity = identity(signer);
        self.run(|ledger, now| ledger.enroll_gateway(identity, now))
    }

    /// Sends a boot registration of the gateway with `request` (its nonce
    /// and clock).
    #[track_caller]
    pub fn register_request(
        &mut self,
        signer: &Ed25519Signer,
        boot_nonce: BootNonce,
        request: ledger::BootRequest,
    ) -> RegisterOutcome {
        let identity = identity(signer);
        self.run(|ledger, now| ledger.register_gateway(&identity, boot_nonce, request, now))
    }

    /// The lost-shard sweep at the current time.
    #[track_caller]
    pub fn mark_lost(&mut self) -> Vec<ledger::LostShard> {
        self.run(|ledger, now| ledger.mark_lost_shards(now))
    }

    /// Registers a boot of the gateway (a fresh request: `boot_nonce` as
    /// its nonce, sent now, or a millisecond after the current boot's
    /// request when that was sent now too); returns its boot epoch.
    #[track_caller]
    pub fn register(&mut self, signer: &Ed25519Signer, boot_nonce: BootNonce) -> u64 {
        let last = self
            .ledger
            .gateway(&identity(signer))
            .and_then(|gateway| gateway.last_boot_request);
        let requested_at = match last {
            Some(last) if last.requested_at >= self.now => last.requested_at.saturating_add_ms(1),
            _ => self.now,
        };
        let request = ledger::BootRequest {
            request_nonce: boot_nonce,
            requested_at,
        };
        match self.register_request(signer, boot_nonce, request) {
            RegisterOutcome::Registered {
                boot_epoch,
                boot_nonce: bound,
            } => {
                assert_eq!(bound, boot_nonce);
                boot_epoch
            }
            other => panic!("expected a registration, got {other:?}"),
        }
    }

    /// Asks for a shard of the seed's pair for the gateway's boot
    /// `(boot_epoch, boot_nonce)`; the central key signs it.
    #[track_caller]
    pub fn issue(
        &mut self,
        shard: &str,
        signer: &Ed25519Signer,
        boot_epoch: u64,
        boot_nonce: BootNonce,
    ) -> IssueShardOutcome {
        self.issue_for("tenant-7", shard, signer, boot_epoch, boot_nonce)
    }

    /// [`Self::issue`] for `subject_name`'s pair on `chat.generate`.
    #[track_caller]
    pub fn issue_for(
        &mut self,
        subject_name: &str,
        shard: &str,
        signer: &Ed25519Signer,
        boot_epoch: u64,
        boot_nonce: BootNonce,
    ) -> IssueShardOutcome {
        let request = IssueShardRequest {
            identity: identity(signer),
            boot_epoch,
            boot_nonce,
            subject: subject(subject_name),
            route: route("chat.generate"),
            shard: shard_id(shard),
        };
        let signer = central_signer();
        self.run(|ledger, now| ledger.issue_shard(request, &signer, now))
    }

    /// Issues and asserts the shard was issued.
    #[track_caller]
    pub fn issued(
        &mut self,
        shard: &str,
        signer: &Ed25519Signer,
        boot_epoch: u64,
        boot_nonce: BootNonce,
    ) -> EmergencyShardV1 {
        match self.issue(shard, signer, boot_epoch, boot_nonce) {
            IssueShardOutcome::Issued(shard) => *shard,
            other => panic!("expected a shard, got {other:?}"),
        }
    }

    #[track_caller]
    pub fn reconcile(
        &mut self,
        receipt: &shard_format::ShardTerminalReceiptV1,
        verifier: &Ed25519Verifier,
    ) -> ReconcileOutcome {
        self.run(|ledger, now| {
            ledger.reconcile_shard(receipt, &receipt.gateway_identity, verifier, now)
        })
    }
}

/// The receipt of a `Reserved` outcome.
#[track_caller]
pub fn reserved(outcome: ReserveOutcome) -> LimitReservationV1 {
    match outcome {
        ReserveOutcome::Reserved(receipt) => receipt,
        other => panic!("expected a reservation, got {other:?}"),
    }
}

/// The rejection of a `Rejected` outcome.
#[track_caller]
pub fn rejected(outcome: ReserveOutcome) -> Rejection {
    match outcome {
        ReserveOutcome::Rejected(rejection) => rejection,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// Every account record of `records` rewritten by `edit` (for building
/// states no sequence of operations reaches, such as terms near `u64::MAX`).
pub fn edit_accounts(records: Vec<Change>, edit: impl Fn(&mut AccountRecord)) -> Vec<Change> {
    records
        .into_iter()
        .map(|change| match change {
            Change::Account(mut account) => {
                edit(&mut account);
                Change::Account(account)
            }
            other => other,
        })
        .collect()
}

// ----- the shard harness -----

/// An outcome of a shard operation that says whether it must have left the
/// book untouched.
pub trait ShardOutcome: Debug {
    fn changes_nothing(&self) -> bool;
}

impl ShardOutcome for ShardReserveOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Reserved(_))
    }
}

impl ShardOutcome for ShardStartOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Started(_) | Self::Expired(_))
    }
}

impl ShardOutcome for ShardSettleOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Settled(_))
    }
}

impl ShardOutcome for ShardReleaseOutcome {
    fn changes_nothing(&self) -> bool {
        !matches!(self, Self::Released(_))
    }
}

/// `expire_due`: none expired, nothing changed.
impl ShardOutcome for Vec<ReservationId> {
    fn changes_nothing(&self) -> bool {
        self.is_empty()
    }
}

/// `mark_usage_unknown`: `false`, nothing changed.
impl ShardOutcome for bool {
    fn changes_nothing(&self) -> bool {
        !*self
    }
}

/// `close`: the first close changes the book, a repeat does not.
impl ShardOutcome for ledger::ShardClosure {
    fn changes_nothing(&self) -> bool {
        false
    }
}

/// An emergency shard as the central ledger issues it (docs/design.md §4.7
/// step 8: 200 units for gateway `g-a`, boot epoch 4), signed by the central
/// key.
pub fn signed_shard(allocated_units: u64) -> EmergencyShardV1 {
    let mut shard = EmergencyShardV1 {
        schema: Default::default(),
        shard: shard_id("s1"),
        subject: subject("tenant-7"),
        route: route("chat.generate"),
        policy_generation: 31,
        accounting_epoch: at(0),
        allocated_units,
        gateway_identity: identity(&gateway_signer()),
        boot_epoch: 4,
        boot_nonce: nonce(4),
        fence: 1,
        not_before: at(0),
        not_after: at(600_000),
        key_id: identity(&central_signer()),
        signature: Signature::UNSIGNED,
    };
    sign_document(&mut shard, &central_signer());
    shard
}

/// One shard's book, its journal and the agent's monotonic clock. Every
/// operation goes through [`ShardHarness::run`]: the shard equation holds
/// after it, an outcome that must change nothing journaled nothing and left
/// the book as it was, and the journal rebuilds the live book.
#[derive(Debug)]
pub struct ShardHarness {
    pub book: ShardLedger,
    pub journal: Vec<ShardChange>,
    pub now_ms: u64,
}

impl ShardHarness {
    pub fn open(shard: EmergencyShardV1) -> Self {
        let (book, change) = ShardLedger::open(shard);
        Self {
            book,
            journal: vec![change],
            now_ms: 0,
        }
    }

    pub fn at(&mut self, now_ms: u64) -> &mut Self {
        self.now_ms = now_ms;
        self
    }

    /// Asserts the book's four terms, written as in docs/design.md §4.7.
    #[track_caller]
    pub fn assert_terms(&self, equation: &str) {
        assert_eq!(
            *self.book.terms(),
            shard_terms(equation),
            "the shard should read {equation}"
        );
    }

    /// The book rebuilt from the journal.
    pub fn rebuilt(&self) -> ShardLedger {
        ShardLedger::from_records(self.book.shard().clone(), self.journal.clone())
            .expect("the journal rebuilds a balanced book")
    }

    #[track_caller]
    pub fn run<O: ShardOutcome>(
        &mut self,
        operation: impl FnOnce(&mut ShardLedger, u64) -> ShardTransition<O>,
    ) -> O {
        let before = self.book.clone();
        let ShardTransition { outcome, changes } = operation(&mut self.book, self.now_ms);
        assert_eq!(
            check_shard(&self.book.shard().shard, self.book.terms()),
            None,
            "after {outcome:?}"
        );
        if outcome.changes_nothing() {
            assert!(
                changes.is_empty(),
                "{outcome:?} must change nothing, yet returned {changes:?}"
            );
        }
        if changes.is_empty() {
            assert_eq!(
                self.book, before,
                "{outcome:?} returned no changes, yet the book changed"
            );
        }
        self.journal.extend(changes);
        assert_eq!(
            self.rebuilt(),
            self.book,
            "after {outcome:?} the journal does not rebuild the book"
        );
        outcome
    }

    #[track_caller]
    pub fn reserve(&mut self, id: &str, units: u64, hold_ms: u64) -> ShardReserveOutcome {
        let id = rid(id);
        self.run(|book, now_ms| book.reserve(id, units, hold_ms, now_ms))
    }

    /// A flexible reserve: anything from `min_units` to `units`.
    #[track_caller]
    pub fn reserve_between(
        &mut self,
        id: &str,
        min_units: u64,
        units: u64,
        hold_ms: u64,
    ) -> ShardReserveOutcome {
        let id = rid(id);
        self.run(|book, now_ms| book.reserve_between(id, min_units, units, hold_ms, now_ms))
    }

    #[track_caller]
    pub fn start(&mut self, id: &str, operation: &str) -> ShardStartOutcome {
        let (id, operation) = (rid(id), op(operation));
        self.run(|book, now_ms| book.start(&id, operation, now_ms))
    }

    #[track_caller]
    pub fn settle(&mut self, id: &str, operation: &str, actual_units: u64) -> ShardSettleOutcome {
        let (id, operation) = (rid(id), op(operation));
        self.run(|book, _| book.settle(&id, &operation, actual_units))
    }

    #[track_caller]
    pub fn release(&mut self, id: &str) -> ShardReleaseOutcome {
        let id = rid(id);
        self.run(|book, _| book.release(&id))
    }

    #[track_caller]
    pub fn expire_due(&mut self) -> Vec<ReservationId> {
        self.run(|book, now_ms| book.expire_due(now_ms))
    }

    #[track_caller]
    pub fn mark_usage_unknown(&mut self, id: &str) -> bool {
        let id = rid(id);
        self.run(|book, _| book.mark_usage_unknown(&id))
    }

    #[track_caller]
    pub fn close(
        &mut self,
        reason: shard_format::ShardCloseReason,
        closed_at: Timestamp,
    ) -> ledger::ShardClosure {
        self.run(|book, _| book.close(reason, closed_at))
    }
}

/// The retention sweep: nothing forgotten, nothing changed.
impl Outcome for ledger::ForgetOutcome {
    fn changes_nothing(&self) -> bool {
        self.forgotten() == 0
    }
}
