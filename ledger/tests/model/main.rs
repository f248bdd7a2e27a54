//! The central ledger against a reference model (STYLE 10–11).
//!
//! Proptest generates sequences of operations (`model/ops.rs`): policy
//! publications, reserves from a small ID pool (so duplicates, other digests
//! and other units under one ID happen), one in four with more legs (up to
//! four of distinct pairs, a pair repeated, or nine), start, settle (below,
//! at and above the reservation, repeated; per leg with legs left out, a
//! pair that is not a leg, or one number on several legs), release,
//! abandon, time, the expiry, usage and
//! refill workers, freezing, gateways and shards with genuine, duplicated and
//! forged terminal receipts, restarts and failed commits. A shell in the
//! style the ledger documents carries each out: it calls the operation,
//! commits `changes` to a `MemoryStore`, and on a restart or a failed commit
//! rebuilds the ledger with `CentralLedger::from_records`.
//!
//! The reference model (`model/reference.rs`) predicts each outcome and each
//! record written. After every step the test asserts:
//!
//! - the outcome is the predicted one, and the whole state (every policy,
//!   pair, account, reservation, tombstone, gateway and shard) equals the
//!   model's;
//! - `changes` is exactly the set of records that differ, and the store holds
//!   exactly what the ledger holds (a failed commit loses the step, in the
//!   model too);
//! - `invariants::audit` is clean, the sum of `available` fits in `u64`,
//!   `available` never exceeds its generation's `burst` (docs/design.md §4), every
//!   receipt and shard passes its document's own validation, and per
//!   account `opening` never changes while `overdraftIssued`,
//!   `overdraftRepaid` and `retiredForEmergency` never shrink;
//! - a refusal changes nothing (except the lazy opening of the epoch's
//!   account by a refused reserve or shard request, which the model
//!   predicts);
//! - independently of the model: no reservation ID reserves twice, a
//!   tombstoned ID never reserves, admission (a reservation or a shard) never
//!   happens while the pair owes debt, is frozen or is stopped, every
//!   reservation only takes transitions of docs/design.md §3, each settlement
//!   (and each correction) happens once, `USAGE_UNKNOWN` units are only ever
//!   released by a settlement, and a shard is reconciled (re-minted) at most
//!   once — across restarts too — and otherwise only marked lost, by the
//!   sweep, after `notAfter` plus the grace.
//!
//! The generator looks at the model's state (`Model::hints`) to name
//! existing reservations, registered gateways and issued shards more often
//! than not, so that the deep paths (settle after start, correction after a
//! conservative settlement, reconciliation after issuance) are reached.
//! Fixed sequences replay through the same harness below: the worked
//! examples of docs/design.md §4.7, and the minimal sequences of bugs this
//! test found.
//!
//! `PROPTEST_CASES` overrides the number of cases (256 by default, about
//! 8 seconds in a debug build).

mod fixtures;
mod ops;
mod reference;

use std::collections::{BTreeMap, BTreeSet};

use ledger::invariants::audit;
use ledger::store::{LedgerStore, MemoryStore};
use ledger::{
    AccountTerms, CentralLedger, Change, IssueShardOutcome, RecordKey, ReserveOutcome, Transition,
};
use proptest::prelude::*;
use proptest::test_runner::Config;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};
use shard_format::{Document, ReservationId, ReservationState, ShardId, Timestamp};

use fixtures::{RESERVATIONS, central_signer, receipt_verifier, reservation_id};
use ops::{ActualChoice, GenerationAsk, Op};
use reference::{Command, Model, Outcome, Step, ledger_config};

type Records = BTreeMap<RecordKey, Change>;

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = Op;

    fn init_state() -> BoxedStrategy<Model> {
        Just(Model::initial()).boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<Op> {
        ops::op(&state.hints())
    }

    fn apply(state: Model, op: &Op) -> Model {
        state.step(op)
    }
}

/// What the shell has observed and committed so far: the ground truth for
/// the properties that must hold whatever the model says.
#[derive(Debug, Clone, Default)]
struct Ghost {
    /// Every reservation ID that ever got a record (reserved once).
    admitted: BTreeSet<ReservationId>,
    tombstoned: BTreeSet<ReservationId>,
    settled: BTreeSet<ReservationId>,
    corrected: BTreeSet<ReservationId>,
    reconciled: BTreeSet<ShardId>,
}

/// The system under test: the ledger, its store and the shell's memory.
#[derive(Debug)]
struct Harness {
    ledger: CentralLedger,
    store: MemoryStore,
    ghost: Ghost,
}

struct LedgerTest;

impl StateMachineTest for LedgerTest {
    type SystemUnderTest = Harness;
    type Reference = Reference;

    fn init_test(_model: &Model) -> Harness {
        let mut ledger = CentralLedger::new(ledger_config());
        let mut store = MemoryStore::new();
        for policy in Model::initial_policies() {
            let transition = ledger.publish_policy(policy, fixtures::start_time());
            assert_eq!(transition.outcome, ledger::PublishOutcome::Published);
            store.commit(&transition.changes).expect("commit");
        }
        Harness {
            ledger,
            store,
            ghost: Ghost::default(),
        }
    }

    fn apply(harness: Harness, model: &Model, _op: Op) -> Harness {
        harness.step(
            model.last.as_ref().expect("the model recorded the step"),
            model.now(),
        )
    }

    fn check_invariants(harness: &Harness, model: &Model) {
        harness.check_against(model);
    }
}

fn config() -> Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(256);
    Config {
        cases,
        ..Config::default()
    }
}

prop_state_machine! {
    #![proptest_config(config())]

    #[test]
    fn central_ledger_follows_the_model(sequential 1..=100 => LedgerTest);
}

// ----- replays of fixed sequences -----

/// Runs `ops` through the same model and harness as the property test;
/// returns the harness and the outcomes (checked equal to the model's).
fn replay_with_outcomes(ops: &[Op]) -> (Harness, Vec<Outcome>) {
    let mut model = Model::initial();
    let mut harness = LedgerTest::init_test(&model);
    harness.check_against(&model);
    let mut outcomes = Vec::new();
    for op in ops {
        model = model.step(op);
        let step = model.last.as_ref().expect("a step");
        harness = harness.step(step, model.now());
        harness.check_against(&model);
        outcomes.push(step.outcome.clone());
    }
    (harness, outcomes)
}

fn replay(ops: &[Op]) -> Harness {
    replay_with_outcomes(ops).0
}

fn reserve(reservation: usize, units: u64) -> Op {
    Op::Reserve {
        pair: 0,
        reservation,
        units,
        digest: 0,
        generation: GenerationAsk::Unnamed,
        hold_ttl_ms: None,
        floor: None,
        more_legs: Vec::new(),
    }
}

fn start(reservation: usize) -> Op {
    Op::Start {
        reservation,
        operation: 0,
        deadline_ms: None,
    }
}

fn settle(reservation: usize, actual: ActualChoice) -> Op {
    Op::Settle {
        reservation,
        operation: 0,
        actual,
        form: ops::SettleForm::Auto,
    }
}

fn advance(ms: u64) -> Op {
    Op::AdvanceTime { ms }
}

/// Gateway 0 enrolled and registered, and its shard 0 issued on pair 0.
fn issue_shard() -> Vec<Op> {
    vec![
        Op::Enroll { gateway: 0 },
        Op::Register { gateway: 0 },
        Op::IssueShard {
            gateway: 0,
            pair: 0,
            shard: 0,
            boot: ops::BootChoice::Current,
        },
    ]
}

/// Shard 0's genuine terminal receipt: a quarter spent, 27 % unknown, the
/// rest confirmed unused.
fn reconcile_shard() -> Op {
    Op::Reconcile {
        shard: 0,
        spent_percent: 25,
        unknown_percent: 27,
        debt: 0,
        forgery: ops::Forgery::Genuine,
    }
}

/// The terms of pair 0's account of the first epoch under generation 1.
fn first_account(harness: &Harness) -> AccountTerms {
    let (_, terms) = harness
        .ledger
        .accounts()
        .next()
        .expect("pair 0's first account");
    *terms
}

fn terms(
    [opening, minted, overdraft_issued]: [u64; 3],
    [
        available,
        reserved,
        spent,
        retired_for_emergency,
        overdraft_repaid,
    ]: [u64; 5],
) -> AccountTerms {
    AccountTerms {
        opening,
        minted,
        overdraft_issued,
        available,
        reserved,
        spent,
        retired_for_emergency,
        overdraft_repaid,
    }
}

/// docs/design.md §4.7, steps 1–7 (the seed's story, overage and debt), on
/// the standard policy: the model and the ledger agree at every step and end
/// on the design's numbers.
#[test]
fn the_worked_examples_of_the_seed_story_hold() {
    let (harness, outcomes) = replay_with_outcomes(&[
        reserve(0, 600),
        reserve(1, 600),
        reserve(2, 600),
        start(0),
        reserve(0, 600),
        settle(0, ActualChoice::Units(200)),
        settle(0, ActualChoice::Units(200)),
    ]);
    // One admitted; two get 429, capacity, Retry-After 2 (200 missing at
    // 100/s); the retry and the replayed settle get the same receipts.
    let Outcome::Reserve(ReserveOutcome::Reserved(receipt)) = &outcomes[0] else {
        panic!("the first reserve is admitted: {:?}", outcomes[0]);
    };
    for outcome in &outcomes[1..3] {
        assert!(
            matches!(
                outcome,
                Outcome::Reserve(ReserveOutcome::Rejected(ledger::Rejection {
                    dimension: ledger::Dimension::Capacity,
                    policy_generation: 1,
                    retry_after_seconds: Some(2),
                    rate_limit: None,
                }))
            ),
            "{outcome:?}"
        );
    }
    let Outcome::Start(ledger::StartOutcome::Started(started)) = &outcomes[3] else {
        panic!("start binds op-0: {:?}", outcomes[3]);
    };
    assert_eq!(
        outcomes[4],
        Outcome::Reserve(ReserveOutcome::Duplicate(started.clone()))
    );
    assert_eq!(started.reservation, receipt.reservation);
    let Outcome::Settle(ledger::SettleOutcome::Settled(settlement)) = &outcomes[5] else {
        panic!("settled: {:?}", outcomes[5]);
    };
    assert_eq!(settlement.refunded_units, 400);
    assert_eq!(
        outcomes[6],
        Outcome::Settle(ledger::SettleOutcome::Duplicate(settlement.clone()))
    );
    // 1000 = 800 + 0 + 200 + 0 + 0
    assert_eq!(
        first_account(&harness),
        terms([1000, 0, 0], [800, 0, 200, 0, 0])
    );
    let harness = replay(&[
        reserve(0, 600),
        start(0),
        settle(0, ActualChoice::Units(200)),
        reserve(3, 500),
        start(3),
        settle(3, ActualChoice::Units(900)),
    ]);
    // 1000 + 0 + 100 = 0 + 0 + 1100 + 0 + 0, and admission is 0.
    assert_eq!(
        first_account(&harness),
        terms([1000, 0, 100], [0, 0, 1100, 0, 0])
    );
    assert!(!harness.ledger.admission_open(&fixtures::pair_key(0)));
    let harness = replay(&[
        reserve(0, 600),
        start(0),
        settle(0, ActualChoice::Units(200)),
        reserve(3, 500),
        start(3),
        settle(3, ActualChoice::Units(900)),
        advance(1_000),
        Op::HandleRefill,
        advance(1_000),
        Op::HandleRefill,
    ]);
    // 1000 + 200 + 100 = 100 + 0 + 1100 + 0 + 100, and admission resumes.
    assert_eq!(
        first_account(&harness),
        terms([1000, 200, 100], [100, 0, 1100, 0, 100])
    );
    assert!(harness.ledger.admission_open(&fixtures::pair_key(0)));
}

/// docs/design.md §4.7, steps 8–11: a shard of 200 for gateway 0, its
/// terminal receipt (spent 50, confirmed unused 110, unknown 40) re-mints 110
/// once.
#[test]
fn the_worked_example_of_a_shard_holds() {
    let harness = replay(&[issue_shard(), vec![reconcile_shard(); 2]].concat());
    // 1000 + 110 = 910 + 0 + 0 + 200 + 0
    assert_eq!(
        first_account(&harness),
        terms([1000, 110, 0], [910, 0, 0, 200, 0])
    );
}

/// Found by the property test. A reservation whose execution outlived the
/// hard limit is settled conservatively at its full units; refills then
/// refill the account up to `burst`; the late genuine receipt says it used
/// less. The correction must not lift `available` above `burst` (DESIGN
/// §4): the refund is credited like a mint, and what the cap cuts leaves
/// through `minted`.
#[test]
fn a_correction_never_lifts_available_above_burst() {
    let harness = replay(&[
        reserve(4, 1),
        start(4),
        advance(20_000),
        Op::HandleUsageDeadlines,
        Op::HandleRefill,
        settle(4, ActualChoice::Zero),
    ]);
    // The 1 unit refilled after the conservative charge is cut.
    assert_eq!(
        first_account(&harness),
        terms([1000, 0, 0], [1000, 0, 0, 0, 0])
    );
}

/// Found by the property test (CI, stop 62): the lost-shard sweep marks an
/// unreconciled shard lost once `notAfter` plus the grace has passed. That
/// is a legal change of a shard record besides its reconciliation, which
/// the watcher of record changes must accept (and check).
#[test]
fn a_shard_marked_lost_is_a_legal_change_of_its_record() {
    let (harness, outcomes) = replay_with_outcomes(
        &[
            issue_shard(),
            vec![advance(605_000), Op::MarkLostShards, Op::MarkLostShards],
        ]
        .concat(),
    );
    let lost = |outcome: &Outcome| match outcome {
        Outcome::Lost(lost) => lost.len(),
        other => panic!("the sweep answered {other:?}"),
    };
    assert_eq!((lost(&outcomes[4]), lost(&outcomes[5])), (1, 0));
    let shard = harness.ledger.shards().next().expect("the shard");
    assert!(shard.is_lost(), "{shard:?}");
}

/// A late terminal receipt still reconciles a shard marked lost; the
/// watcher accepts that second change of its record.
#[test]
fn a_shard_marked_lost_is_still_reconciled_once() {
    let harness = replay(
        &[
            issue_shard(),
            vec![
                advance(605_000),
                Op::MarkLostShards,
                reconcile_shard(),
                reconcile_shard(),
            ],
        ]
        .concat(),
    );
    let shard = harness.ledger.shards().next().expect("the shard");
    assert!(
        shard.reconciliation.is_some() && shard.lost_at.is_some(),
        "{shard:?}"
    );
}

/// Found by the property test: when several reservations cross both their
/// usage deadline and their hard limit before one sweep, the sweep reports
/// each changed reservation once.
#[test]
fn the_usage_sweep_lists_each_reservation_once() {
    replay(&[
        reserve(0, 1),
        reserve(1, 1),
        start(0),
        start(1),
        advance(20_000),
        Op::HandleUsageDeadlines,
    ]);
}

/// A reserve of `units` on pair 0 under reservation `reservation` with
/// more legs, each `(offset, units)` (see [`ops::LegDraw`]).
fn reserve_legs(reservation: usize, units: u64, more: &[(usize, u64)]) -> Op {
    let Op::Reserve {
        pair,
        digest,
        generation,
        hold_ttl_ms,
        floor,
        ..
    } = reserve(reservation, units)
    else {
        unreachable!("a reserve")
    };
    Op::Reserve {
        pair,
        reservation,
        units,
        digest,
        generation,
        hold_ttl_ms,
        floor,
        more_legs: more
            .iter()
            .map(|&(offset, units)| ops::LegDraw {
                offset,
                units,
                floor: None,
            })
            .collect(),
    }
}

/// Found by the property test: the usage sweep moves every leg of a due
/// reservation and must list every leg it changed (as the expiry sweeps
/// do), not only the first one it found.
#[test]
fn the_usage_sweep_lists_every_leg() {
    let (_, outcomes) = replay_with_outcomes(&[
        reserve_legs(0, 1, &[(3, 1)]),
        start(0),
        advance(5_000),
        Op::HandleUsageDeadlines,
    ]);
    let Outcome::Swept(changed) = &outcomes[3] else {
        panic!("a sweep: {:?}", outcomes[3]);
    };
    assert_eq!(changed.len(), 2, "both legs: {changed:?}");
}

/// Found by the property test: legs settle together, but only a leg with
/// overdraft is `SETTLED_WITH_DEBT`; the audit (`LegsApart`) must not take
/// that for legs apart (debug builds panicked on the settle).
#[test]
fn legs_settled_with_and_without_debt_are_together() {
    let (harness, outcomes) = replay_with_outcomes(&[
        reserve_legs(0, 400, &[(2, 1)]),
        start(0),
        Op::Settle {
            reservation: 0,
            operation: 0,
            actual: ActualChoice::Zero,
            form: ops::SettleForm::PerLeg {
                actuals: vec![Some(ActualChoice::Units(1_100))],
                extra: None,
            },
        },
    ]);
    let Outcome::Settle(ledger::SettleOutcome::Settled(settlement)) = &outcomes[2] else {
        panic!("settled: {:?}", outcomes[2]);
    };
    let legs = settlement.legs.as_ref().expect("two legs listed");
    assert_eq!(
        legs.iter()
            .map(|leg| (leg.actual_units, leg.overdraft_units))
            .collect::<Vec<_>>(),
        [(1_100, 100), (1, 0)]
    );
    let states: Vec<ReservationState> = harness
        .ledger
        .reservations()
        .map(|record| record.receipt.state)
        .collect();
    assert!(states.contains(&ReservationState::SettledWithDebt));
    assert!(states.contains(&ReservationState::Settled));
}

/// Found by the property test: a correction of several legs where one
/// leg's late actual equals what it was charged changes nothing of that
/// leg's account, and the ledger must not write it (`changes` are exactly
/// the records that differ).
#[test]
fn a_correction_writes_no_account_it_leaves_unchanged() {
    let (harness, outcomes) = replay_with_outcomes(&[
        reserve_legs(0, 1, &[(2, 1)]),
        start(0),
        advance(60_000),
        Op::HandleUsageDeadlines,
        Op::Settle {
            reservation: 0,
            operation: 0,
            actual: ActualChoice::Zero,
            form: ops::SettleForm::PerLeg {
                actuals: vec![Some(ActualChoice::Units(51)), Some(ActualChoice::Equal)],
                extra: None,
            },
        },
    ]);
    assert!(
        matches!(
            outcomes[4],
            Outcome::Settle(ledger::SettleOutcome::Corrected(_))
        ),
        "{:?}",
        outcomes[4]
    );
    assert!(harness.ledger.reservations().all(|record| record.corrected));
}

// ----- the shell -----

fn split<O>(transition: Transition<O>, wrap: impl FnOnce(O) -> Outcome) -> (Outcome, Vec<Change>) {
    (wrap(transition.outcome), transition.changes)
}

/// Calls the ledger operation `command` names.
fn execute(
    ledger: &mut CentralLedger,
    command: &Command,
    now: Timestamp,
) -> (Outcome, Vec<Change>) {
    match command {
        Command::Publish(policy) => split(
            ledger.publish_policy((**policy).clone(), now),
            Outcome::Publish,
        ),
        Command::Reserve(request) => split(ledger.reserve(request.clone(), now), Outcome::Reserve),
        Command::Start {
            reservation,
            operation,
            deadline_ms,
        } => split(
            ledger.start(reservation, operation.clone(), *deadline_ms, now),
            Outcome::Start,
        ),
        Command::Settle {
            reservation,
            operation,
            actuals,
        } => split(
            ledger.settle_legs(reservation, operation, actuals, now),
            Outcome::Settle,
        ),
        Command::Release(reservation) => split(ledger.release(reservation, now), Outcome::Release),
        Command::Abandon(request) => split(ledger.abandon(request, now), Outcome::Abandon),
        Command::BeginExpiry => split(ledger.begin_expiry(now), Outcome::Swept),
        Command::CompleteExpiry => split(ledger.complete_expiry(now), Outcome::Swept),
        Command::Forget => split(ledger.forget_expired(now), Outcome::Forgotten),
        Command::MarkLostShards => split(ledger.mark_lost_shards(now), |lost| {
            Outcome::Lost(lost.into_iter().map(|shard| shard.shard).collect())
        }),
        Command::HandleUsageDeadlines => split(ledger.handle_usage_deadlines(now), Outcome::Swept),
        Command::HandleRefill => split(ledger.handle_refill(now), |()| Outcome::Refilled),
        Command::SetFrozen { pair, frozen } => {
            split(ledger.set_frozen(pair, *frozen), Outcome::RouteControl)
        }
        Command::SetAdmissionStopped {
            pair,
            generation,
            stopped,
        } => split(
            ledger.set_admission_stopped(pair, *generation, *stopped),
            Outcome::RouteControl,
        ),
        Command::Enroll(identity) => split(
            ledger.enroll_gateway(identity.clone(), now),
            Outcome::Enroll,
        ),
        Command::Register { identity, nonce } => {
            let request = ledger::BootRequest {
                request_nonce: *nonce,
                requested_at: now,
            };
            split(
                ledger.register_gateway(identity, *nonce, request, now),
                Outcome::Register,
            )
        }
        Command::IssueShard(request) => split(
            ledger.issue_shard(request.clone(), &central_signer(), now),
            Outcome::IssueShard,
        ),
        Command::Reconcile(receipt) => split(
            ledger.reconcile_shard(receipt, &receipt.gateway_identity, &receipt_verifier(), now),
            Outcome::Reconcile,
        ),
        Command::AdvanceTime(_) | Command::Crash | Command::FailNextCommit => {
            unreachable!("not a ledger operation")
        }
    }
}

/// Every record the ledger holds, as the store would hold it.
fn ledger_records(ledger: &CentralLedger) -> Records {
    let mut records = Records::new();
    let mut put = |change: Change| {
        records.insert(change.key(), change);
    };
    for pair in ledger.pairs() {
        put(Change::Pair(pair.clone()));
        for generation in 1..=pair.current_generation {
            if let Some(policy) = ledger.policy_at(&pair.pair, generation) {
                put(Change::Policy(Box::new(policy.clone())));
            }
        }
    }
    for (key, account) in ledger.account_states() {
        put(Change::Account(ledger::AccountRecord {
            key,
            terms: account.terms,
            records: account.records,
            forgotten: account.forgotten,
        }));
    }
    for record in ledger.reservations() {
        put(Change::Reservation(Box::new(record.clone())));
    }
    for index in 0..RESERVATIONS {
        if let Some(tombstone) = ledger.tombstone(&reservation_id(index)) {
            put(Change::Tombstone(tombstone.clone()));
        }
    }
    for gateway in ledger.gateways() {
        put(Change::Gateway(gateway.clone()));
    }
    for shard in ledger.shards() {
        put(Change::Shard(Box::new(shard.clone())));
    }
    records
}

fn store_records(store: &MemoryStore) -> Records {
    let loaded = store.load_all().expect("load");
    let records: Records = loaded
        .iter()
        .map(|change| (change.key(), change.clone()))
        .collect();
    assert_eq!(records.len(), loaded.len(), "one stored record per key");
    records
}

/// The records of `after` that `before` lacks or holds otherwise, and a
/// `Forget` for each record of `before` that `after` lacks.
fn differing(before: &Records, after: &Records) -> Records {
    let forgotten = before
        .keys()
        .filter(|key| !after.contains_key(*key))
        .map(|key| (key.clone(), Change::Forget(key.clone())));
    after
        .iter()
        .filter(|(key, record)| before.get(*key) != Some(*record))
        .map(|(key, record)| (key.clone(), record.clone()))
        .chain(forgotten)
        .collect()
}

/// A readable account of where two record sets differ.
fn describe_difference(
    left_name: &str,
    left: &Records,
    right_name: &str,
    right: &Records,
) -> String {
    let keys: BTreeSet<&RecordKey> = left.keys().chain(right.keys()).collect();
    let mut lines = Vec::new();
    for key in keys {
        let (a, b) = (left.get(key), right.get(key));
        if a != b {
            lines.push(format!(
                "  {key:?}\n    {left_name}: {a:?}\n    {right_name}: {b:?}"
            ));
        }
    }
    lines.join("\n")
}

impl Harness {
    fn rebuild(&mut self) {
        let records = self.store.load_all().expect("load");
        self.ledger = CentralLedger::from_records(ledger_config(), records)
            .expect("committed records load into a clean ledger");
    }

    fn step(mut self, step: &Step, now: Timestamp) -> Self {
        match step.command {
            Command::Crash => {
                let before = ledger_records(&self.ledger);
                self.rebuild();
                let after = ledger_records(&self.ledger);
                assert!(
                    before == after,
                    "a restart changed the ledger:\n{}",
                    describe_difference("before", &before, "rebuilt", &after)
                );
                return self;
            }
            Command::FailNextCommit => {
                self.store.fail_next_commits(1);
                return self;
            }
            Command::AdvanceTime(_) => return self,
            _ => {}
        }
        let before = ledger_records(&self.ledger);
        let (outcome, changes) = execute(&mut self.ledger, &step.command, now);
        assert!(
            step.outcome.matches(&outcome),
            "outcome of {:?}\n  expected: {:?}\n    actual: {:?}",
            step.command,
            step.outcome,
            outcome
        );
        let after = ledger_records(&self.ledger);
        // The transition's contract: `changes` are exactly the records that
        // differ afterwards, one per key — and the ones the model wrote.
        let written: Records = changes
            .iter()
            .map(|change| (change.key(), change.clone()))
            .collect();
        assert_eq!(written.len(), changes.len(), "one change per record key");
        let differ = differing(&before, &after);
        assert!(
            written == differ,
            "`changes` of {:?} are not what changed:\n{}",
            step.command,
            describe_difference("changes", &written, "differ", &differ)
        );
        assert!(
            written == step.changes,
            "records written by {:?} differ from the model's:\n{}",
            step.command,
            describe_difference("ledger", &written, "model", &step.changes)
        );

        // A refusal changes nothing; a refused reserve or shard request may
        // only have opened the epoch's account (with its debt repayment).
        if outcome.is_refusal() {
            let opening_only = step.opened_account
                && matches!(
                    outcome,
                    Outcome::Reserve(
                        ReserveOutcome::Rejected(_) | ReserveOutcome::LegRejected { .. }
                    ) | Outcome::IssueShard(IssueShardOutcome::Rejected(_))
                )
                && changes
                    .iter()
                    .all(|change| matches!(change, Change::Account(_) | Change::Pair(_)));
            assert!(
                changes.is_empty() || opening_only,
                "the refusal {outcome:?} changed {changes:?}"
            );
        }

        let mut ghost = self.ghost.clone();
        ghost.observe(&self.ledger, &before, &after, &outcome, now);
        ghost.observe_forgetting(&before, &after, now);

        let committed = self.store.commit(&changes);
        if step.rolled_back {
            assert!(committed.is_err(), "the injected fault fails the commit");
            self.rebuild();
            let rebuilt = ledger_records(&self.ledger);
            assert!(
                rebuilt == before,
                "a failed commit left traces:\n{}",
                describe_difference("before", &before, "rebuilt", &rebuilt)
            );
        } else {
            committed.expect("commit");
            self.ghost = ghost;
        }
        self
    }

    fn check_against(&self, model: &Model) {
        let report = audit(&self.ledger);
        assert!(report.is_clean(), "audit: {:?}", report.violations);
        let ledger = ledger_records(&self.ledger);
        let expected = model.snapshot();
        assert!(
            ledger == expected,
            "the ledger's state differs from the model's after {:?}:\n{}",
            model.last.as_ref().map(|step| &step.command),
            describe_difference("ledger", &ledger, "model", &expected)
        );
        let stored = store_records(&self.store);
        assert!(
            stored == ledger,
            "the store does not hold what the ledger holds:\n{}",
            describe_difference("store", &stored, "ledger", &ledger)
        );
        let available = self
            .ledger
            .accounts()
            .try_fold(0u64, |sum, (_, terms)| sum.checked_add(terms.available));
        assert!(available.is_some(), "the sum of `available` overflows");
        for (key, terms) in self.ledger.accounts() {
            let burst = self
                .ledger
                .policy_at(&key.pair, key.policy_generation)
                .expect("an account's generation has a policy")
                .burst;
            assert!(
                terms.available <= burst,
                "docs/design.md §4: available never exceeds burst ({burst}): {key:?} {terms:?}"
            );
        }
        for record in self.ledger.reservations() {
            record
                .receipt
                .validate()
                .expect("a valid limitReservation.v1");
            if let Some(settlement) = &record.settlement {
                settlement.validate().expect("a valid settlementReceipt.v1");
            }
        }
        for record in self.ledger.shards() {
            record.shard.validate().expect("a valid emergencyShard.v1");
        }
        for record in self.ledger.reservations() {
            if record.receipt.state == ReservationState::UsageUnknown {
                assert_eq!(
                    record.held_units(),
                    if record.shadow {
                        0
                    } else {
                        record.receipt.reserved_units
                    },
                    "USAGE_UNKNOWN units stay reserved"
                );
            }
        }
    }
}

/// Reservation transitions of docs/design.md §3 (a settled one changes only
/// by its one correction, checked apart).
fn legal_transition(from: ReservationState, to: ReservationState) -> bool {
    use ReservationState::*;
    from == to
        || matches!(
            (from, to),
            (
                Reserved,
                Started | Released | Expiring | Expired | Abandoned
            ) | (Expiring, Expired)
                | (Started, UsageUnknown | Settled | SettledWithDebt)
                | (UsageUnknown, Settled | SettledWithDebt)
                | (Settled | SettledWithDebt, Settled | SettledWithDebt)
        )
}

impl Ghost {
    /// Checks one transition against what was committed before it and
    /// remembers it.
    /// Records that left the ledger: only what ended a whole retention
    /// window ago, and accounts nothing refers to any more. A forgotten ID
    /// may be reserved (or tombstoned) anew.
    fn observe_forgetting(&mut self, before: &Records, after: &Records, now: Timestamp) {
        let passed = |since: Timestamp| since.unix_ms() + reference::RETENTION_MS <= now.unix_ms();
        for (key, record) in before.iter().filter(|(key, _)| !after.contains_key(*key)) {
            match record {
                Change::Reservation(record) => {
                    let id = &record.receipt.reservation;
                    assert!(
                        record.receipt.state.is_terminal() && record.ended_at.is_some_and(passed),
                        "{id} forgotten while live or within its window: {record:?}"
                    );
                    self.admitted.remove(id);
                    self.settled.remove(id);
                    self.corrected.remove(id);
                }
                Change::Tombstone(tombstone) => {
                    assert!(
                        passed(tombstone.abandoned_at),
                        "{key:?} forgotten too early"
                    );
                    self.tombstoned.remove(&tombstone.reservation);
                }
                Change::Shard(record) => {
                    assert!(
                        record.retained_since().is_some_and(passed),
                        "{key:?} forgotten open (neither reconciled nor lost) or within its window"
                    );
                    self.reconciled.remove(&record.shard.shard);
                }
                Change::Account(account) => {
                    assert!(
                        account.terms.debt() == 0 && account.terms.reserved == 0,
                        "{key:?} folded with debt or reserved units: {account:?}"
                    );
                    let referred = after.values().any(|change| match change {
                        Change::Reservation(record) => record.account_key() == account.key,
                        Change::Shard(record) => record.account_key() == account.key,
                        _ => false,
                    });
                    assert!(!referred, "{key:?} folded while records refer to it");
                }
                other => panic!("{other:?} must never be forgotten"),
            }
        }
    }

    fn observe(
        &mut self,
        ledger: &CentralLedger,
        before: &Records,
        after: &Records,
        outcome: &Outcome,
        now: Timestamp,
    ) {
        for (key, record) in after {
            let previous = before.get(key);
            if previous == Some(record) {
                continue;
            }
            match record {
                Change::Reservation(record) => {
                    let id = &record.receipt.reservation;
                    let previous = match previous {
                        Some(Change::Reservation(previous)) => Some(previous),
                        _ => None,
                    };
                    match previous {
                        None => {
                            assert!(self.admitted.insert(id.clone()), "{id} reserved twice");
                            assert!(!self.tombstoned.contains(id), "tombstoned {id} reserved");
                            assert_eq!(record.receipt.state, ReservationState::Reserved);
                            if !record.shadow {
                                let pair = record.account_key().pair;
                                let pair_record = ledger.pair(&pair).expect("pair");
                                assert!(
                                    ledger.pair_debt(&pair) == 0
                                        && !pair_record.frozen
                                        && !pair_record.admission_stopped,
                                    "{id} admitted while {pair:?} is closed: debt {}, {pair_record:?}",
                                    ledger.pair_debt(&pair)
                                );
                            }
                        }
                        Some(previous) => {
                            let (from, to) = (previous.receipt.state, record.receipt.state);
                            assert!(legal_transition(from, to), "{id}: {from:?} → {to:?}");
                            if previous.settlement.is_some() {
                                assert!(
                                    previous.settlement.as_ref().is_some_and(|s| s.conservative)
                                        && !previous.corrected
                                        && record.corrected
                                        && self.corrected.insert(id.clone()),
                                    "{id}: a settled reservation changed other than by its one correction"
                                );
                            } else if record.settlement.is_some() {
                                assert!(from.is_started(), "{id} settled from {from:?}");
                                assert!(self.settled.insert(id.clone()), "{id} settled twice");
                            }
                        }
                    }
                }
                Change::Account(account) => {
                    if let Some(Change::Account(previous)) = previous {
                        let (old, new) = (&previous.terms, &account.terms);
                        assert!(
                            new.opening == old.opening
                                && new.overdraft_issued >= old.overdraft_issued
                                && new.overdraft_repaid >= old.overdraft_repaid
                                && new.retired_for_emergency >= old.retired_for_emergency,
                            "{:?}: opening is fixed; overdraft and retired units never shrink: {old:?} → {new:?}",
                            account.key
                        );
                    }
                }
                Change::Tombstone(tombstone) => {
                    let id = &tombstone.reservation;
                    assert!(previous.is_none(), "tombstone of {id} rewritten");
                    assert!(
                        !self.admitted.contains(id) && ledger.reservation(id).is_none(),
                        "an admitted {id} was tombstoned"
                    );
                    self.tombstoned.insert(id.clone());
                }
                Change::Shard(shard) => {
                    let id = &shard.shard.shard;
                    match previous {
                        None => {
                            assert!(shard.reconciliation.is_none());
                            let pair = shard.account_key().pair;
                            let pair_record = ledger.pair(&pair).expect("pair");
                            assert!(
                                ledger.pair_debt(&pair) == 0
                                    && !pair_record.frozen
                                    && !pair_record.admission_stopped,
                                "shard {id} issued while {pair:?} is closed"
                            );
                        }
                        Some(Change::Shard(previous)) => {
                            assert!(
                                previous.shard == shard.shard && previous.reconciliation.is_none(),
                                "shard {id} changed other than by its reconciliation or \
                                 its marking as lost: {previous:?} → {shard:?}"
                            );
                            if shard.reconciliation.is_some() {
                                assert_eq!(
                                    previous.lost_at, shard.lost_at,
                                    "shard {id}: its reconciliation moved its loss"
                                );
                                assert!(
                                    self.reconciled.insert(id.clone()),
                                    "shard {id} reconciled (re-minted) twice"
                                );
                            } else {
                                // Marked lost: by the sweep, once, and only
                                // after `notAfter` plus the grace.
                                let grace = ledger_config().shard_lost_grace_ms;
                                let swept =
                                    matches!(outcome, Outcome::Lost(lost) if lost.contains(id));
                                assert!(
                                    previous.is_open()
                                        && shard.lost_at == Some(now)
                                        && shard.shard.not_after.saturating_add_ms(grace) <= now
                                        && swept,
                                    "shard {id} marked lost other than by the sweep after \
                                     notAfter plus the grace: {previous:?} → {shard:?}"
                                );
                            }
                        }
                        Some(other) => unreachable!("a shard key held {other:?}"),
                    }
                }
                _ => {}
            }
        }
        if let Outcome::Reserve(ReserveOutcome::Reserved(receipt)) = outcome {
            assert!(
                self.admitted.contains(&receipt.reservation),
                "a `Reserved` outcome without a new record"
            );
        }
    }
}
