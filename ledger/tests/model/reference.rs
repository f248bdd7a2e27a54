//! The model test's side of the reference model: the abstract operations
//! of `ops.rs` resolved against the model's state into concrete commands,
//! applied to the shared reference ledger (`ledger-reference`), and the
//! step recorded with the records it is expected to write.

use std::collections::BTreeMap;
use std::fmt;

use ledger::{
    AbandonOutcome, AbandonRequest, BootRequest, Caller, CentralConfig, Change, EnrollOutcome,
    ForgetOutcome, GatewayRecord, IssueShardOutcome, IssueShardRequest, LegActual, LegAsk, PairKey,
    PublishOutcome, ReconcileOutcome, RecordKey, RegisterOutcome, ReleaseOutcome, ReserveOutcome,
    ReserveRequest, RouteControlOutcome, SettleActuals, SettleOutcome, StartOutcome,
};
use ledger_reference::ReferenceLedger;
use shard_format::{
    AdmissionBudgetV1, BootNonce, GatewayIdentity, OperationId, ReservationId, ReservationState,
    ShardCloseReason, ShardId, ShardTerminalReceiptSchema, ShardTerminalReceiptV1, Signature,
    sign_document,
};

use super::fixtures::{
    self, GATEWAYS, LEG_PAIRS, PAIRS, PolicyParams, RESERVATIONS, SHARDS, boot_nonce,
    central_signer, foreign_nonce, gateway_identity, gateway_index, gateway_signer,
    idempotency_key, operation_id, origin, owner, pair_key, receipt_verifier, request_digest,
    reservation_id, shard_id,
};
use super::ops::{
    ActualChoice, BootChoice, ExtraLeg, Forgery, GenerationAsk, GenerationChoice, Hints, Op,
    SettleForm,
};

/// The retention window the test runs the ledger with: longer than the
/// longest reservation life of any generated policy plus the margin
/// (`ledger::RETENTION_MARGIN_MS`), short enough that records are
/// forgotten within a case.
pub const RETENTION_MS: u64 = 60_000;

/// The grace after `notAfter` before the ledger the test runs marks an
/// unreconciled shard lost: short, so that cases reach it.
pub const SHARD_LOST_GRACE_MS: u64 = 5_000;

/// The ledger's configuration (the model's too): the default, with a short
/// retention window and lost-shard grace.
pub fn ledger_config() -> CentralConfig {
    CentralConfig {
        retention_ms: RETENTION_MS,
        shard_lost_grace_ms: SHARD_LOST_GRACE_MS,
        ..CentralConfig::default()
    }
}

/// A concrete call on the ledger (or the shell), resolved from an [`Op`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Publish(Box<AdmissionBudgetV1>),
    Reserve(ReserveRequest),
    Start {
        reservation: ReservationId,
        operation: OperationId,
        deadline_ms: Option<u64>,
    },
    Settle {
        reservation: ReservationId,
        operation: OperationId,
        actuals: SettleActuals,
    },
    Release(ReservationId),
    Abandon(AbandonRequest),
    AdvanceTime(u64),
    BeginExpiry,
    CompleteExpiry,
    HandleUsageDeadlines,
    HandleRefill,
    SetFrozen {
        pair: PairKey,
        frozen: bool,
    },
    SetAdmissionStopped {
        pair: PairKey,
        generation: u64,
        stopped: bool,
    },
    Enroll(GatewayIdentity),
    Register {
        identity: GatewayIdentity,
        nonce: BootNonce,
    },
    IssueShard(IssueShardRequest),
    Reconcile(Box<ShardTerminalReceiptV1>),
    Forget,
    MarkLostShards,
    Crash,
    FailNextCommit,
}

impl Command {
    /// Whether the shell calls the ledger and commits the transition.
    pub fn commits(&self) -> bool {
        !matches!(
            self,
            Self::AdvanceTime(_) | Self::Crash | Self::FailNextCommit
        )
    }
}

/// An operation's outcome, whichever operation it was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The step does not call the ledger.
    Shell,
    Publish(PublishOutcome),
    Reserve(ReserveOutcome),
    Start(StartOutcome),
    Settle(SettleOutcome),
    Release(ReleaseOutcome),
    Abandon(AbandonOutcome),
    /// `begin_expiry`, `complete_expiry`, `handle_usage_deadlines`.
    Swept(Vec<ReservationId>),
    Refilled,
    RouteControl(RouteControlOutcome),
    Enroll(EnrollOutcome),
    Register(RegisterOutcome),
    IssueShard(IssueShardOutcome),
    Reconcile(ReconcileOutcome),
    Forgotten(ForgetOutcome),
    /// The lost-shard sweep: the shards it marked lost.
    Lost(Vec<ShardId>),
}

impl Outcome {
    /// Equality, except that an invalid policy's message is not predicted.
    pub fn matches(&self, actual: &Self) -> bool {
        match (self, actual) {
            (
                Self::Publish(PublishOutcome::Invalid(_)),
                Self::Publish(PublishOutcome::Invalid(_)),
            ) => true,
            _ => self == actual,
        }
    }

    /// A refusal, a duplicate or a no-op: it must change nothing (a reserve
    /// or shard refusal may still open the epoch's account; see
    /// [`Step::opened_account`]).
    pub fn is_refusal(&self) -> bool {
        match self {
            Self::Shell | Self::Swept(_) | Self::Refilled | Self::Forgotten(_) | Self::Lost(_) => {
                false
            }
            Self::Publish(outcome) => !matches!(outcome, PublishOutcome::Published),
            Self::Reserve(outcome) => !matches!(
                outcome,
                ReserveOutcome::Reserved(_) | ReserveOutcome::Shadow { .. }
            ),
            Self::Start(outcome) => matches!(
                outcome,
                StartOutcome::Duplicate(_)
                    | StartOutcome::NotFound
                    | StartOutcome::OperationConflict { .. }
                    | StartOutcome::IllegalState(_)
            ),
            Self::Settle(outcome) => !matches!(
                outcome,
                SettleOutcome::Settled(_) | SettleOutcome::Corrected(_)
            ),
            Self::Release(outcome) => !matches!(outcome, ReleaseOutcome::Released(_)),
            Self::Abandon(outcome) => !matches!(
                outcome,
                AbandonOutcome::Tombstoned | AbandonOutcome::Abandoned(_)
            ),
            Self::RouteControl(outcome) => !matches!(outcome, RouteControlOutcome::Done),
            Self::Enroll(outcome) => !matches!(outcome, EnrollOutcome::Enrolled),
            Self::Register(outcome) => !matches!(outcome, RegisterOutcome::Registered { .. }),
            Self::IssueShard(outcome) => !matches!(outcome, IssueShardOutcome::Issued(_)),
            Self::Reconcile(outcome) => !matches!(outcome, ReconcileOutcome::Reconciled(_)),
        }
    }
}

/// What the model expects of the step just applied.
#[derive(Debug, Clone)]
pub struct Step {
    pub command: Command,
    pub outcome: Outcome,
    /// Exactly the records the transition writes (what differs afterwards).
    pub changes: BTreeMap<RecordKey, Change>,
    /// The step opened an account (a new epoch or generation), which a
    /// refusal of `reserve` or `issue_shard` may do.
    pub opened_account: bool,
    /// The commit fails: the ledger is rebuilt from the store and the step
    /// is lost (the model kept its state from before).
    pub rolled_back: bool,
}

/// The reference ledger and what the test's shell adds to it.
#[derive(Clone)]
pub struct Model {
    pub ledger: ReferenceLedger,
    /// A `FailNextCommit` is pending.
    pub fail_next_commit: bool,
    /// Boot nonces drawn so far (the shell's randomness, made a counter).
    pub nonces_drawn: u64,
    /// The step just applied.
    pub last: Option<Step>,
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The transitions tell the story; the state is compared in full by
        // the test and printed there on a mismatch.
        f.debug_struct("Model")
            .field("now", &self.ledger.now)
            .field("pairs", &self.ledger.pairs.len())
            .field("reservations", &self.ledger.reservations.len())
            .finish_non_exhaustive()
    }
}

impl Model {
    /// The state every case starts from: pair 0 and the pairs only further
    /// legs name have the standard policy at generation 1; pair 1 has none
    /// yet.
    pub fn initial() -> Self {
        let mut ledger = ReferenceLedger::new(ledger_config(), fixtures::start_time());
        for policy in Self::initial_policies() {
            let outcome = ledger.publish(policy);
            assert_eq!(outcome, PublishOutcome::Published);
        }
        ledger.take_opened_account();
        Self {
            ledger,
            fail_next_commit: false,
            nonces_drawn: 0,
            last: None,
        }
    }

    /// The policies that publish first, as the harness publishes them.
    pub fn initial_policies() -> Vec<AdmissionBudgetV1> {
        [0].into_iter()
            .chain(PAIRS..LEG_PAIRS)
            .map(|pair| fixtures::policy(pair, 1, PolicyParams::standard()))
            .collect()
    }

    pub fn now(&self) -> shard_format::Timestamp {
        self.ledger.now
    }

    pub fn snapshot(&self) -> BTreeMap<RecordKey, Change> {
        self.ledger.snapshot()
    }

    /// Pool indices worth naming now (see [`Hints`]).
    pub fn hints(&self) -> Hints {
        let reservations = |wanted: &dyn Fn(ReservationState) -> bool| -> Vec<usize> {
            (0..RESERVATIONS)
                .filter(|index| {
                    self.ledger
                        .reservations
                        .get(&reservation_id(*index))
                        .is_some_and(|record| wanted(record.receipt.state))
                })
                .collect()
        };
        let gateways = |wanted: &dyn Fn(&GatewayRecord) -> bool| -> Vec<usize> {
            (0..GATEWAYS)
                .filter(|index| {
                    self.ledger
                        .gateways
                        .get(&gateway_identity(*index))
                        .is_some_and(wanted)
                })
                .collect()
        };
        Hints {
            existing: reservations(&|_| true),
            reserved: reservations(&|state| state == ReservationState::Reserved),
            started: reservations(&|state| state.is_started() || state.is_settled()),
            running: reservations(&|state| state.is_started()),
            conservative: (0..RESERVATIONS)
                .filter(|index| {
                    self.ledger
                        .reservations
                        .get(&reservation_id(*index))
                        .is_some_and(|record| {
                            !record.corrected
                                && record
                                    .settlement
                                    .as_ref()
                                    .is_some_and(|settlement| settlement.conservative)
                        })
                })
                .collect(),
            enrolled: gateways(&|_| true),
            registered: gateways(&|gateway| gateway.boot_epoch > 0),
            shards: (0..SHARDS)
                .filter(|index| self.ledger.shards.contains_key(&shard_id(*index)))
                .collect(),
        }
    }

    // ----- the whole state, as records -----

    // ----- applying one abstract operation -----

    /// Resolves `op` against the state, predicts its outcome and records,
    /// and returns the state after it (the state before, if its commit is
    /// to fail).
    pub fn step(self, op: &Op) -> Self {
        let before = self.snapshot();
        let mut next = self.clone();
        next.last = None;
        next.ledger.take_opened_account();
        let (command, outcome) = next.apply(op);
        let after = next.snapshot();
        let mut changes = BTreeMap::new();
        for (key, record) in &after {
            if before.get(key) != Some(record) {
                changes.insert(key.clone(), record.clone());
            }
        }
        for key in before.keys().filter(|key| !after.contains_key(*key)) {
            changes.insert(key.clone(), Change::Forget(key.clone()));
        }
        let rolled_back = command.commits() && self.fail_next_commit;
        let step = Step {
            outcome,
            changes,
            opened_account: next.ledger.take_opened_account(),
            rolled_back,
            command,
        };
        let mut state = if rolled_back { self } else { next };
        if step.command.commits() {
            state.fail_next_commit = false;
        }
        state.last = Some(step);
        state
    }

    fn apply(&mut self, op: &Op) -> (Command, Outcome) {
        match *op {
            Op::Publish {
                pair,
                generation,
                params,
            } => {
                let current = self.ledger.current_generation(&pair_key(pair));
                let generation = match generation {
                    GenerationChoice::Next => current + 1,
                    GenerationChoice::Same => current.max(1),
                    GenerationChoice::Skip => current + 2,
                };
                let policy = fixtures::policy(pair, generation, params);
                let outcome = self.ledger.publish(policy.clone());
                (
                    Command::Publish(Box::new(policy)),
                    Outcome::Publish(outcome),
                )
            }
            Op::Reserve {
                pair,
                reservation,
                units,
                digest,
                generation,
                hold_ttl_ms,
                floor,
                ref more_legs,
            } => {
                let key = pair_key(pair);
                let more_legs = more_legs
                    .iter()
                    .map(|leg| {
                        let key = pair_key((pair + leg.offset) % LEG_PAIRS);
                        LegAsk {
                            subject: key.subject,
                            route: key.route,
                            units: leg.units,
                            min_units: leg.floor.map(|floor| floor.of(leg.units)),
                        }
                    })
                    .collect();
                let request = ReserveRequest {
                    owner: owner(),
                    idempotency_key: idempotency_key(reservation),
                    reservation: reservation_id(reservation),
                    subject: key.subject.clone(),
                    route: key.route.clone(),
                    units,
                    min_units: floor.map(|floor| floor.of(units)),
                    policy_generation: self.asked_generation(&key, generation),
                    request_digest: request_digest(reservation, digest),
                    hold_ttl_ms,
                    more_legs,
                };
                let outcome = self.ledger.reserve(&request);
                (Command::Reserve(request), Outcome::Reserve(outcome))
            }
            Op::Start {
                reservation,
                operation,
                deadline_ms,
            } => {
                let reservation = reservation_id(reservation);
                let operation = operation_id(operation);
                let outcome = self.ledger.start(&reservation, &operation, deadline_ms);
                (
                    Command::Start {
                        reservation,
                        operation,
                        deadline_ms,
                    },
                    Outcome::Start(outcome),
                )
            }
            Op::Settle {
                reservation,
                operation,
                actual,
                ref form,
            } => {
                let reservation = reservation_id(reservation);
                let operation = operation_id(operation);
                let actuals = self.actuals(&reservation, actual, form);
                let outcome = self.ledger.settle_legs(&reservation, &operation, &actuals);
                (
                    Command::Settle {
                        reservation,
                        operation,
                        actuals,
                    },
                    Outcome::Settle(outcome),
                )
            }
            Op::Release { reservation } => {
                let reservation = reservation_id(reservation);
                let outcome = self.ledger.release(&reservation);
                (Command::Release(reservation), Outcome::Release(outcome))
            }
            Op::Abandon { reservation } => {
                let request = AbandonRequest {
                    reservation: reservation_id(reservation),
                    caller: Caller::Gateway(owner()),
                    origin: Some(origin(reservation)),
                };
                let outcome = self.ledger.abandon(&request);
                (Command::Abandon(request), Outcome::Abandon(outcome))
            }
            Op::AdvanceTime { ms } => {
                self.ledger.now = self.ledger.now.saturating_add_ms(ms);
                (Command::AdvanceTime(ms), Outcome::Shell)
            }
            Op::Forget => (Command::Forget, Outcome::Forgotten(self.ledger.forget())),
            Op::MarkLostShards => (
                Command::MarkLostShards,
                Outcome::Lost(
                    self.ledger
                        .mark_lost()
                        .into_iter()
                        .map(|lost| lost.shard)
                        .collect(),
                ),
            ),
            Op::BeginExpiry => (
                Command::BeginExpiry,
                Outcome::Swept(self.ledger.begin_expiry()),
            ),
            Op::CompleteExpiry => (
                Command::CompleteExpiry,
                Outcome::Swept(self.ledger.complete_expiry()),
            ),
            Op::HandleUsageDeadlines => (
                Command::HandleUsageDeadlines,
                Outcome::Swept(self.ledger.handle_usage_deadlines()),
            ),
            Op::HandleRefill => {
                self.ledger.handle_refill();
                (Command::HandleRefill, Outcome::Refilled)
            }
            Op::SetFrozen { pair, frozen } => {
                let pair = pair_key(pair);
                let outcome = self.ledger.set_frozen(&pair, frozen);
                (
                    Command::SetFrozen { pair, frozen },
                    Outcome::RouteControl(outcome),
                )
            }
            Op::SetAdmissionStopped {
                pair,
                generation,
                stopped,
            } => {
                let pair = pair_key(pair);
                let generation = self
                    .asked_generation(&pair, generation)
                    .unwrap_or_else(|| self.ledger.current_generation(&pair));
                let outcome = self
                    .ledger
                    .set_admission_stopped(&pair, generation, stopped);
                (
                    Command::SetAdmissionStopped {
                        pair,
                        generation,
                        stopped,
                    },
                    Outcome::RouteControl(outcome),
                )
            }
            Op::Enroll { gateway } => {
                let identity = gateway_identity(gateway);
                let outcome = self.ledger.enroll(&identity);
                (Command::Enroll(identity), Outcome::Enroll(outcome))
            }
            Op::Register { gateway } => {
                let identity = gateway_identity(gateway);
                let nonce = boot_nonce(self.nonces_drawn);
                self.nonces_drawn += 1;
                let outcome = self.ledger.register(
                    &identity,
                    nonce,
                    BootRequest {
                        request_nonce: nonce,
                        requested_at: self.ledger.now,
                    },
                );
                (
                    Command::Register { identity, nonce },
                    Outcome::Register(outcome),
                )
            }
            Op::IssueShard {
                gateway,
                pair,
                shard,
                boot,
            } => {
                let identity = gateway_identity(gateway);
                let (boot_epoch, boot_nonce) = match self.ledger.gateways.get(&identity) {
                    Some(record) => {
                        let nonce = record.boot_nonce.unwrap_or(foreign_nonce());
                        match boot {
                            BootChoice::Current => (record.boot_epoch, nonce),
                            BootChoice::Stale => (record.boot_epoch.saturating_sub(1), nonce),
                            BootChoice::ForeignNonce => (record.boot_epoch, foreign_nonce()),
                        }
                    }
                    None => (1, foreign_nonce()),
                };
                let key = pair_key(pair);
                let request = IssueShardRequest {
                    identity,
                    boot_epoch,
                    boot_nonce,
                    subject: key.subject,
                    route: key.route,
                    shard: shard_id(shard),
                };
                let outcome = self.ledger.issue_shard(&request, &central_signer());
                (Command::IssueShard(request), Outcome::IssueShard(outcome))
            }
            Op::Reconcile {
                shard,
                spent_percent,
                unknown_percent,
                debt,
                forgery,
            } => {
                let receipt =
                    self.terminal_receipt(shard, spent_percent, unknown_percent, debt, forgery);
                let outcome =
                    self.ledger
                        .reconcile(&receipt, &receipt.gateway_identity, &receipt_verifier());
                (
                    Command::Reconcile(Box::new(receipt)),
                    Outcome::Reconcile(outcome),
                )
            }
            Op::Crash => (Command::Crash, Outcome::Shell),
            Op::FailNextCommit => {
                self.fail_next_commit = true;
                (Command::FailNextCommit, Outcome::Shell)
            }
        }
    }

    // ----- helpers -----

    /// The actual units a settle of `reservation` reports, as `form` says.
    fn actuals(
        &self,
        reservation: &ReservationId,
        actual: ActualChoice,
        form: &SettleForm,
    ) -> SettleActuals {
        let units = |choice: ActualChoice, reserved: u64| match choice {
            ActualChoice::Zero => 0,
            ActualChoice::Half => reserved / 2,
            ActualChoice::Equal => reserved,
            ActualChoice::Above => reserved + 50,
            ActualChoice::FarAbove => reserved + 700,
            ActualChoice::Units(units) => units,
        };
        let receipt = self
            .ledger
            .reservations
            .get(reservation)
            .map(|record| &record.receipt);
        let reserved = receipt.map_or(100, |receipt| receipt.reserved_units);
        let legs = receipt.map_or_else(Vec::new, |receipt| {
            receipt
                .legs
                .clone()
                .unwrap_or_else(|| vec![receipt.as_leg()])
        });
        let leg_actual = |leg: &shard_format::ReservationLegV1, choice| LegActual {
            subject: leg.subject.clone(),
            route: leg.route.clone(),
            actual_units: units(choice, leg.reserved_units),
        };
        match form {
            SettleForm::Auto if legs.len() > 1 => {
                SettleActuals::Legs(legs.iter().map(|leg| leg_actual(leg, actual)).collect())
            }
            SettleForm::Auto | SettleForm::One => SettleActuals::One(units(actual, reserved)),
            SettleForm::PerLeg { actuals, extra } => {
                let mut given: Vec<LegActual> = legs
                    .iter()
                    .zip(actuals)
                    .filter_map(|(leg, choice)| Some(leg_actual(leg, (*choice)?)))
                    .collect();
                match extra {
                    Some(ExtraLeg::NotALeg) => {
                        let stranger = pair_key(LEG_PAIRS);
                        given.push(LegActual {
                            subject: stranger.subject,
                            route: stranger.route,
                            actual_units: units(actual, reserved),
                        });
                    }
                    Some(ExtraLeg::Repeat) => {
                        if let Some(first) = legs.first() {
                            given.push(leg_actual(first, actual));
                        }
                    }
                    None => {}
                }
                SettleActuals::Legs(given)
            }
        }
    }

    fn asked_generation(&self, pair: &PairKey, ask: GenerationAsk) -> Option<u64> {
        let current = self.ledger.current_generation(pair);
        match ask {
            GenerationAsk::Unnamed => None,
            GenerationAsk::Current => Some(current.max(1)),
            GenerationAsk::Previous => Some(current.saturating_sub(1).max(1)),
            GenerationAsk::Next => Some(current + 1),
        }
    }

    /// The terminal receipt an agent would hand in for pool shard `index`
    /// (or for a shard never issued), made as `forgery` says.
    fn terminal_receipt(
        &self,
        index: usize,
        spent_percent: u64,
        unknown_percent: u64,
        debt: u64,
        forgery: Forgery,
    ) -> ShardTerminalReceiptV1 {
        let id = shard_id(index);
        let (pair, gateway, boot_epoch, allocated) = match self.ledger.shards.get(&id) {
            Some(record) => (
                PairKey::new(record.shard.subject.clone(), record.shard.route.clone()),
                gateway_index(&record.shard.gateway_identity),
                record.shard.boot_epoch,
                record.shard.allocated_units,
            ),
            None => (pair_key(0), 0, 1, 100),
        };
        let spent = allocated * spent_percent / 100;
        let unknown = (allocated - spent) * unknown_percent / 100;
        let mut receipt = ShardTerminalReceiptV1 {
            schema: ShardTerminalReceiptSchema,
            shard: id,
            subject: pair.subject,
            route: pair.route,
            gateway_identity: gateway_identity(gateway),
            boot_epoch,
            allocated_units: allocated,
            spent_units: spent,
            confirmed_unused_units: allocated - spent - unknown,
            unknown_units: unknown,
            overdraft_debt_units: debt,
            reason: ShardCloseReason::Restart,
            closed_at: self.ledger.now,
            key_id: gateway_identity(gateway),
            signature: Signature::UNSIGNED,
        };
        let other = (gateway + 1) % GATEWAYS;
        match forgery {
            Forgery::Genuine | Forgery::BadSignature => {}
            Forgery::OtherGateway => receipt.gateway_identity = gateway_identity(other),
            Forgery::ForeignKey => {}
            Forgery::AllocatedMismatch => {
                receipt.allocated_units += 1;
                receipt.confirmed_unused_units += 1;
            }
            Forgery::BootEpochMismatch => receipt.boot_epoch += 1,
            Forgery::BrokenEquation => receipt.unknown_units += 1,
        }
        let signer = match forgery {
            Forgery::OtherGateway | Forgery::ForeignKey => gateway_signer(other),
            _ => gateway_signer(gateway),
        };
        sign_document(&mut receipt, &signer);
        if forgery == Forgery::BadSignature {
            receipt.signature.0[0] ^= 1;
        }
        receipt
    }
}
