//! Multi-leg reservations (docs/design.md, commit e0c1789): a reserve of up
//! to 8 legs, each a `(subject, route)` pair of its own, is admitted whole
//! or not at all, and every later transition (start, settle, release,
//! abandon, expiry, usage deadlines) moves every leg at once. One test per
//! rule, each at its boundary, against the real [`CentralLedger`] through
//! the [`Harness`] (audit clean after every step, refusals change nothing,
//! the store rebuilds the ledger), with every leg's account read.
//!
//! Three pairs of one tenant, as a gateway limits one model call:
//! - tokens (`tenant-7/chat.generate`, leg 0): docs/design.md §4.7's
//!   policy: opening 1000, refill 100 a second, reservations of at most
//!   800, holds of 30 s, hard limit 600 s;
//! - requests (`tenant-7/chat.requests`): opening 60, refill 1 a second,
//!   holds of 20 s (the shortest), hard limit 300 s, overdraft at most 10;
//! - concurrency (`tenant-7/chat.concurrency`): opening 4, no refill, one
//!   unit a reservation, holds of 60 s, hard limit 120 s (the shortest).

mod support;

use ledger::invariants::Violation;
use ledger::{
    AbandonOutcome, AccountKey, CentralConfig, CentralLedger, Dimension, LegActual, LegAsk,
    LegProblem, PairKey, RETENTION_DEFAULT_MS, RETRY_AFTER_NO_HORIZON_SECONDS, ReleaseOutcome,
    ReservationRecord, ReserveOutcome, ReserveRequest, SettleActuals, SettleOutcome, StartOutcome,
};
use shard_format::limits::{DURATION_MS_MAX, UNITS_MAX};
use shard_format::{
    AdmissionBudgetV1, LimitReservationV1, Refill, ReservationId, ReservationLegV1,
    ReservationState, RouteMode, SettledLegV1, SettlementReceiptV1,
};
use support::{Harness, at, key, op, owner, pair, policy, policy_for, request_on, route, subject};

// ----- the three pairs and their policies -----

fn tokens() -> PairKey {
    pair()
}

fn requests() -> PairKey {
    PairKey::new(subject("tenant-7"), route("chat.requests"))
}

fn concurrency() -> PairKey {
    PairKey::new(subject("tenant-7"), route("chat.concurrency"))
}

/// A pair no policy is published for.
fn unpoliced() -> PairKey {
    PairKey::new(subject("tenant-9"), route("chat.generate"))
}

/// `holdTtlMs` of the requests policy: the shortest of the three.
const REQUESTS_HOLD_MS: u64 = 20_000;
/// `executionHardLimitMs` of the concurrency policy: the shortest.
const CONCURRENCY_HARD_LIMIT_MS: u64 = 120_000;

fn tokens_policy() -> AdmissionBudgetV1 {
    policy(31)
}

fn requests_policy() -> AdmissionBudgetV1 {
    AdmissionBudgetV1 {
        route: requests().route,
        capacity_unit: "requests".into(),
        policy_generation: 5,
        opening: 60,
        burst: 60,
        refill: Refill {
            units: 1,
            interval_ms: 1000,
        },
        reservation_units_max: 60,
        hold_ttl_ms: REQUESTS_HOLD_MS,
        overdraft_units_max: 10,
        execution_hard_limit_ms: 300_000,
        emergency_shard_units: 10,
        ..policy(5)
    }
}

/// A concurrency limit (docs/design.md §3.12): no refill, one epoch as long
/// as allowed.
fn concurrency_policy() -> AdmissionBudgetV1 {
    AdmissionBudgetV1 {
        route: concurrency().route,
        capacity_unit: "requests".into(),
        policy_generation: 2,
        opening: 4,
        burst: 4,
        refill: Refill {
            units: 0,
            interval_ms: 1000,
        },
        accounting_epoch_ms: DURATION_MS_MAX,
        reservation_units_max: 1,
        hold_ttl_ms: 60_000,
        overdraft_units_max: 0,
        execution_hard_limit_ms: CONCURRENCY_HARD_LIMIT_MS,
        emergency_shard_units: 1,
        ..policy(2)
    }
}

/// A ledger with the three policies published, in `modes` (tokens,
/// requests, concurrency).
fn three_pairs_in(modes: [RouteMode; 3]) -> Harness {
    three_pairs_on(Harness::new(), modes)
}

fn three_pairs_on(mut h: Harness, modes: [RouteMode; 3]) -> Harness {
    let policies = [tokens_policy(), requests_policy(), concurrency_policy()];
    for (mut policy, mode) in policies.into_iter().zip(modes) {
        policy.mode = mode;
        assert_eq!(h.publish(policy), ledger::PublishOutcome::Published);
    }
    h
}

/// The three policies, all enforced.
fn three_pairs() -> Harness {
    three_pairs_in([RouteMode::Enforce; 3])
}

// ----- requests -----

fn leg(pair: &PairKey, units: u64) -> LegAsk {
    LegAsk {
        subject: pair.subject.clone(),
        route: pair.route.clone(),
        units,
        min_units: None,
    }
}

fn flexible(pair: &PairKey, min_units: u64, units: u64) -> LegAsk {
    LegAsk {
        min_units: Some(min_units),
        ..leg(pair, units)
    }
}

/// A reserve of `legs` under idempotency key `name`. The digest stands for
/// `name` alone, so that a request with other legs under the same key is
/// told apart by its legs, not by its digest.
fn multi(name: &str, legs: &[LegAsk]) -> ReserveRequest {
    let first = &legs[0];
    let mut request = request_on(&first.pair(), name, first.units, name);
    request.min_units = first.min_units;
    request.with_legs(legs[1..].to_vec())
}

/// tokens 100, requests 1, concurrency 1: one model call.
fn call(name: &str) -> ReserveRequest {
    multi(
        name,
        &[
            leg(&tokens(), 100),
            leg(&requests(), 1),
            leg(&concurrency(), 1),
        ],
    )
}

/// The ID `g-a` derives for key `name` on `pair`: a leg's reservation ID.
fn leg_id(pair: &PairKey, name: &str) -> ReservationId {
    ReservationId::derive(&owner(), &pair.subject, &pair.route, &key(name))
}

/// The IDs of the legs of the three-pair reservation `name`, in leg order.
fn call_ids(name: &str) -> Vec<ReservationId> {
    [tokens(), requests(), concurrency()]
        .iter()
        .map(|pair| leg_id(pair, name))
        .collect()
}

/// A one-leg reserve of `units` on `pair` under key `name`.
fn alone(h: &mut Harness, pair: &PairKey, name: &str, units: u64) -> LimitReservationV1 {
    support::reserved(h.reserve_request(request_on(pair, name, units, name)))
}

fn actual(pair: &PairKey, actual_units: u64) -> LegActual {
    LegActual {
        subject: pair.subject.clone(),
        route: pair.route.clone(),
        actual_units,
    }
}

// ----- operations by leg ID -----

#[track_caller]
fn start(h: &mut Harness, id: &ReservationId, operation: &str) -> StartOutcome {
    let operation = op(operation);
    h.run(|ledger, now| ledger.start(id, operation, None, now))
}

#[track_caller]
fn settle(
    h: &mut Harness,
    id: &ReservationId,
    operation: &str,
    actuals: SettleActuals,
) -> SettleOutcome {
    let operation = op(operation);
    h.run(|ledger, now| ledger.settle_legs(id, &operation, &actuals, now))
}

#[track_caller]
fn release(h: &mut Harness, id: &ReservationId) -> ReleaseOutcome {
    h.run(|ledger, now| ledger.release(id, now))
}

// ----- views -----

/// The one account of `pair` (every test stays within one epoch).
#[track_caller]
fn account_of(h: &Harness, pair: &PairKey) -> AccountKey {
    let mut keys = h.ledger.accounts().filter(|(key, _)| key.pair == *pair);
    let (key, _) = keys.next().expect("the pair's account is open");
    assert!(keys.next().is_none(), "one account per pair");
    key
}

/// Asserts the account of each pair, written as in docs/design.md §4.7:
/// `opening + minted + overdraftIssued = available + reserved + spent +
/// retiredForEmergency + overdraftRepaid`.
#[track_caller]
fn assert_accounts(h: &Harness, expected: &[(PairKey, &str)]) {
    for (pair, equation) in expected {
        let key = account_of(h, pair);
        h.assert_account(&key, equation);
    }
}

/// The three pairs' accounts as published: nothing held.
#[track_caller]
fn assert_untouched(h: &Harness) {
    assert_accounts(
        h,
        &[
            (tokens(), "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 60 + 0 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 4 + 0 + 0 + 0 + 0"),
        ],
    );
}

/// What the ledger holds, for a before-and-after comparison (without the
/// harness's tombstone list, which grows with every ID it sees).
fn unchanged_view(h: &Harness) -> support::Snapshot {
    let mut snapshot = h.snapshot();
    snapshot.tombstones.clear();
    snapshot
}

#[track_caller]
fn record<'h>(h: &'h Harness, id: &ReservationId) -> &'h ReservationRecord {
    h.ledger
        .reservation(id)
        .unwrap_or_else(|| panic!("leg {id} is recorded"))
}

#[track_caller]
fn assert_no_records(h: &Harness, ids: &[ReservationId]) {
    for id in ids {
        assert!(h.ledger.reservation(id).is_none(), "no record for leg {id}");
    }
}

#[track_caller]
fn assert_states(h: &Harness, ids: &[ReservationId], state: ReservationState) {
    for id in ids {
        assert_eq!(record(h, id).receipt.state, state, "leg {id}");
    }
}

#[track_caller]
fn leg_rejected(outcome: ReserveOutcome) -> (usize, ledger::Rejection) {
    match outcome {
        ReserveOutcome::LegRejected { index, rejection } => (index, rejection),
        other => panic!("expected a leg rejection, got {other:?}"),
    }
}

#[track_caller]
fn settled(outcome: SettleOutcome) -> SettlementReceiptV1 {
    match outcome {
        SettleOutcome::Settled(receipt) => receipt,
        other => panic!("expected a settlement, got {other:?}"),
    }
}

/// What the receipts list of a leg: `(pair, reservedUnits, requestedUnits,
/// minUnits)`.
fn granted(legs: &[ReservationLegV1]) -> Vec<(PairKey, u64, Option<u64>, Option<u64>)> {
    legs.iter()
        .map(|leg| {
            (
                PairKey::new(leg.subject.clone(), leg.route.clone()),
                leg.reserved_units,
                leg.requested_units,
                leg.min_units,
            )
        })
        .collect()
}

/// What the settlements list of a leg: `(pair, reserved, actual,
/// overdraft)`.
fn settled_legs(legs: &[SettledLegV1]) -> Vec<(PairKey, u64, u64, u64)> {
    legs.iter()
        .map(|leg| {
            (
                PairKey::new(leg.subject.clone(), leg.route.clone()),
                leg.reserved_units,
                leg.actual_units,
                leg.overdraft_units,
            )
        })
        .collect()
}

// ----- 1. all or nothing -----

#[test]
fn all_legs_are_reserved_or_none_one_unit_short_on_one_leg_refuses_all() {
    let mut h = three_pairs();
    // 50 of the 60 requests are held, 1 of them on its own.
    alone(&mut h, &requests(), "rq-49", 49);
    alone(&mut h, &requests(), "rq-1", 1);
    let before = unchanged_view(&h);
    // 11 requests asked, 10 available: one unit short on leg 1 only.
    let (index, rejection) = leg_rejected(h.reserve_request(multi(
        "rl-call",
        &[
            leg(&tokens(), 100),
            leg(&requests(), 11),
            leg(&concurrency(), 1),
        ],
    )));
    assert_eq!(index, 1, "the requests leg is the one refused");
    assert_eq!(rejection.dimension, Dimension::Capacity);
    assert_eq!(rejection.policy_generation, 5);
    assert_eq!(rejection.retry_after_seconds, Some(1), "one tick of 1");
    assert_eq!(unchanged_view(&h), before, "nothing held, nothing recorded");
    assert_no_records(&h, &call_ids("rl-call"));
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 10 + 50 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 4 + 0 + 0 + 0 + 0"),
        ],
    );
    // The unit comes back: the same request is admitted whole.
    assert!(matches!(
        release(&mut h, &leg_id(&requests(), "rq-1")),
        ReleaseOutcome::Released(_)
    ));
    let receipt = support::reserved(h.reserve_request(multi(
        "rl-call",
        &[
            leg(&tokens(), 100),
            leg(&requests(), 11),
            leg(&concurrency(), 1),
        ],
    )));
    let ids = call_ids("rl-call");
    assert_eq!(receipt.reservation, ids[0], "the answer is leg 0's receipt");
    assert_eq!(
        granted(receipt.legs.as_deref().expect("every leg listed")),
        vec![
            (tokens(), 100, None, None),
            (requests(), 11, None, None),
            (concurrency(), 1, None, None),
        ]
    );
    for (id, grant) in ids.iter().zip([100, 11, 1]) {
        let leg = record(&h, id);
        assert_eq!(leg.receipt.state, ReservationState::Reserved);
        assert_eq!(leg.receipt.reserved_units, grant);
        assert_eq!(leg.receipt.legs, receipt.legs, "every leg lists all");
        assert!(!leg.shadow);
    }
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 0 + 60 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 3 + 1 + 0 + 0 + 0"),
        ],
    );
}

// ----- 2. the limiting leg -----

#[test]
fn the_limiting_leg_is_the_refused_one_with_the_longest_retry_after_ties_to_the_lower_index() {
    let mut h = three_pairs();
    h.reserved("rl-700", 700); // 300 tokens available, 100 a second
    alone(&mut h, &requests(), "rq-55", 55); // 5 requests available, 1 a second
    // Tokens 500: 200 short, 2 s. Requests 10: 5 short, 5 s. Concurrency fits.
    let (index, rejection) = leg_rejected(h.reserve_request(multi(
        "rl-apart",
        &[
            leg(&tokens(), 500),
            leg(&requests(), 10),
            leg(&concurrency(), 1),
        ],
    )));
    assert_eq!(index, 1, "the later refused leg waits longer");
    assert_eq!(rejection.dimension, Dimension::Capacity);
    assert_eq!(rejection.retry_after_seconds, Some(5));
    // Requests 7: 2 short, 2 s, as long as the tokens leg: the lower index.
    let (index, rejection) = leg_rejected(h.reserve_request(multi(
        "rl-tied",
        &[
            leg(&concurrency(), 1),
            leg(&tokens(), 500),
            leg(&requests(), 7),
        ],
    )));
    assert_eq!(index, 1, "a tie goes to the lower index");
    assert_eq!(rejection.policy_generation, 31, "the tokens leg's");
    assert_eq!(rejection.retry_after_seconds, Some(2));
    // One unit less on each and both wait 1 s less: the tie stays.
    let (index, rejection) = leg_rejected(h.reserve_request(multi(
        "rl-tied-less",
        &[
            leg(&concurrency(), 1),
            leg(&requests(), 6),
            leg(&tokens(), 400),
        ],
    )));
    assert_eq!((index, rejection.retry_after_seconds), (1, Some(1)));
    assert_eq!(rejection.policy_generation, 5, "now the requests leg's");
    for name in ["rl-apart", "rl-tied", "rl-tied-less"] {
        assert_no_records(&h, &call_ids(name));
    }
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 300 + 700 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 5 + 55 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 4 + 0 + 0 + 0 + 0"),
        ],
    );
}

// ----- 3. a flexible leg -----

#[test]
fn a_flexible_leg_beside_fixed_legs_is_granted_what_is_available_down_to_its_floor() {
    let mut h = three_pairs();
    h.reserved("rl-700", 700); // 300 tokens available
    let ask = |floor| {
        [
            leg(&requests(), 1),
            flexible(&tokens(), floor, 500),
            leg(&concurrency(), 1),
        ]
    };
    // A floor one unit above what is available refuses every leg.
    let (index, rejection) = leg_rejected(h.reserve_request(multi("rl-301", &ask(301))));
    assert_eq!(index, 1);
    assert_eq!(rejection.dimension, Dimension::Capacity);
    assert_no_records(&h, &call_ids("rl-301"));
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 300 + 700 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 60 + 0 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 4 + 0 + 0 + 0 + 0"),
        ],
    );
    // A floor at what is available: granted min(units 500, available 300).
    let receipt = support::reserved(h.reserve_request(multi("rl-300", &ask(300))));
    assert_eq!(receipt.subject, requests().subject);
    assert_eq!(receipt.route, requests().route, "leg 0 answers");
    let expected = vec![
        (requests(), 1, None, None),
        (tokens(), 300, Some(500), Some(300)),
        (concurrency(), 1, None, None),
    ];
    assert_eq!(granted(receipt.legs.as_deref().expect("legs")), expected);
    let flexible_leg = record(&h, &leg_id(&tokens(), "rl-300"));
    assert_eq!(flexible_leg.receipt.reserved_units, 300);
    assert_eq!(flexible_leg.receipt.legs, receipt.legs);
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 0 + 1000 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 59 + 1 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 3 + 1 + 0 + 0 + 0"),
        ],
    );
    // Asking less than is available, the flexible leg gets all it asks.
    let mut h = three_pairs();
    h.reserved("rl-700", 700);
    let receipt = support::reserved(h.reserve_request(multi(
        "rl-299",
        &[
            leg(&requests(), 1),
            flexible(&tokens(), 1, 299),
            leg(&concurrency(), 1),
        ],
    )));
    assert_eq!(
        granted(receipt.legs.as_deref().expect("legs"))[1],
        (tokens(), 299, Some(299), Some(1))
    );
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 1 + 999 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 59 + 1 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 3 + 1 + 0 + 0 + 0"),
        ],
    );
}

// ----- 4. bad input -----

/// `tenant-0` … `tenant-{n-1}` on `chat.generate`.
fn tenants(n: usize) -> Vec<PairKey> {
    (0..n)
        .map(|i| PairKey::new(subject(&format!("tenant-{i}")), route("chat.generate")))
        .collect()
}

fn one_each(pairs: &[PairKey]) -> Vec<LegAsk> {
    pairs.iter().map(|pair| leg(pair, 1)).collect()
}

#[test]
fn bad_legs_are_refused_at_their_index_and_hold_nothing() {
    let mut h = Harness::new();
    let pairs = tenants(9);
    for pair in &pairs[..8] {
        let name = pair.subject.to_string();
        assert_eq!(
            h.publish(policy_for(&name, 1)),
            ledger::PublishOutcome::Published
        );
    }
    let untouched: Vec<(PairKey, &str)> = pairs[..8]
        .iter()
        .map(|pair| (pair.clone(), "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0"))
        .collect();
    let invalid = |outcome: ReserveOutcome| match outcome {
        ReserveOutcome::InvalidLeg { index, problem } => (index, problem),
        other => panic!("expected an invalid leg, got {other:?}"),
    };
    let ids = |name: &str, pairs: &[PairKey]| -> Vec<ReservationId> {
        pairs.iter().map(|pair| leg_id(pair, name)).collect()
    };
    let before = unchanged_view(&h);

    // Nine legs: one too many, whatever the ninth (it has no policy).
    let nine = one_each(&pairs);
    assert_eq!(
        invalid(h.reserve_request(multi("rl-nine", &nine))),
        (8, LegProblem::TooMany)
    );
    assert_no_records(&h, &ids("rl-nine", &pairs));

    // A pair repeated: refused at the repeat.
    let repeated = one_each(&[
        pairs[0].clone(),
        pairs[1].clone(),
        pairs[2].clone(),
        pairs[1].clone(),
    ]);
    assert_eq!(
        invalid(h.reserve_request(multi("rl-repeat", &repeated))),
        (3, LegProblem::RepeatedPair)
    );

    // Units out of range on leg 2: 0, and one above the largest count.
    for units in [0, UNITS_MAX + 1] {
        let mut legs = one_each(&pairs[..3]);
        legs[2].units = units;
        assert_eq!(
            invalid(h.reserve_request(multi("rl-units", &legs))),
            (2, LegProblem::Units),
            "units {units}"
        );
    }

    // A floor of 0, or one above units, on leg 1.
    for floor in [0, 11] {
        let legs = [
            leg(&pairs[0], 1),
            flexible(&pairs[1], floor, 10),
            leg(&pairs[2], 1),
        ];
        assert_eq!(
            invalid(h.reserve_request(multi("rl-floor", &legs))),
            (1, LegProblem::MinUnits),
            "floor {floor}"
        );
    }

    // A leg whose pair has no policy.
    let legs = one_each(&[pairs[0].clone(), pairs[1].clone(), unpoliced()]);
    assert_eq!(
        invalid(h.reserve_request(multi("rl-nopolicy", &legs))),
        (2, LegProblem::NoPolicy)
    );

    for name in ["rl-repeat", "rl-units", "rl-floor", "rl-nopolicy"] {
        assert_no_records(&h, &ids(name, &pairs[..3]));
    }
    assert_eq!(unchanged_view(&h), before, "nothing held, nothing recorded");
    assert_accounts(&h, &untouched);

    // At the bounds: eight distinct legs, a floor equal to units.
    let mut eight = one_each(&pairs[..8]);
    eight[1] = flexible(&pairs[1], 10, 10);
    let receipt = support::reserved(h.reserve_request(multi("rl-eight", &eight)));
    assert_eq!(receipt.legs.as_ref().map(Vec::len), Some(8));
    for (index, pair) in pairs[..8].iter().enumerate() {
        let held = if index == 1 { 10 } else { 1 };
        let equation = format!("1000 + 0 + 0 = {} + {held} + 0 + 0 + 0", 1000 - held);
        assert_accounts(&h, &[(pair.clone(), &equation)]);
        assert_eq!(
            record(&h, &leg_id(pair, "rl-eight")).receipt.reserved_units,
            held
        );
    }
}

// ----- 5. retries -----

#[test]
fn a_retry_is_a_duplicate_other_legs_under_the_key_conflict() {
    let mut h = three_pairs();
    h.reserved("rl-700", 700);
    let ask = |requests_units| {
        [
            flexible(&tokens(), 100, 500),
            leg(&requests(), requests_units),
            leg(&concurrency(), 1),
        ]
    };
    let first = support::reserved(h.reserve_request(multi("rl-retry", &ask(1))));
    assert_eq!(first.reserved_units, 300);
    // More becomes available; the retry gets the first grants.
    h.release("rl-700");
    assert_eq!(
        h.reserve_request(multi("rl-retry", &ask(1))),
        ReserveOutcome::Duplicate(first.clone())
    );
    // The same key and digest, one leg's units changed: another request.
    assert_eq!(
        h.reserve_request(multi("rl-retry", &ask(2))),
        ReserveOutcome::IdempotencyConflict {
            existing: first.clone()
        }
    );
    // ... and so is a leg dropped.
    assert_eq!(
        h.reserve_request(multi("rl-retry", &ask(1)[..2])),
        ReserveOutcome::IdempotencyConflict {
            existing: first.clone()
        }
    );
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 700 + 300 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 59 + 1 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 3 + 1 + 0 + 0 + 0"),
        ],
    );

    // A key used on the requests pair alone: its ID is leg 1's.
    let lone = alone(&mut h, &requests(), "rl-lone", 1);
    let before = unchanged_view(&h);
    assert_eq!(
        h.reserve_request(call("rl-lone")),
        ReserveOutcome::IdempotencyConflict { existing: lone }
    );
    assert_eq!(unchanged_view(&h), before);
    let ids = call_ids("rl-lone");
    assert_no_records(&h, &[ids[0].clone(), ids[2].clone()]);
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 700 + 300 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 58 + 2 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 3 + 1 + 0 + 0 + 0"),
        ],
    );
}

// ----- 6. debt -----

#[test]
fn debt_of_one_unit_on_one_legs_pair_refuses_the_whole_reservation() {
    let mut h = three_pairs();
    // Debt 1 on the requests pair: 10 held and started, the other 50 held,
    // settled at 11 with nothing available.
    alone(&mut h, &requests(), "rq-10", 10);
    alone(&mut h, &requests(), "rq-50", 50);
    assert!(matches!(
        start(&mut h, &leg_id(&requests(), "rq-10"), "op-10"),
        StartOutcome::Started(_)
    ));
    let receipt = settled(settle(
        &mut h,
        &leg_id(&requests(), "rq-10"),
        "op-10",
        SettleActuals::One(11),
    ));
    assert_eq!(receipt.overdraft_units, 1);
    release(&mut h, &leg_id(&requests(), "rq-50"));
    assert_eq!(h.ledger.pair_debt(&requests()), 1);
    assert!(!h.ledger.pair(&requests()).expect("pair").frozen);
    let (index, rejection) = leg_rejected(h.reserve_request(call("rl-call")));
    assert_eq!(index, 1);
    assert_eq!(rejection.dimension, Dimension::Debt);
    assert_no_records(&h, &call_ids("rl-call"));
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 1 = 50 + 0 + 11 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 4 + 0 + 0 + 0 + 0"),
        ],
    );
    // One refill tick repays the unit: debt 0, the reservation is admitted.
    h.at(1000).refill();
    assert_eq!(h.ledger.pair_debt(&requests()), 0);
    support::reserved(h.reserve_request(call("rl-call")));
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0"),
            (requests(), "60 + 1 + 1 = 49 + 1 + 11 + 0 + 1"),
            (concurrency(), "4 + 0 + 0 = 3 + 1 + 0 + 0 + 0"),
        ],
    );
}

// ----- 7. start -----

#[test]
fn start_moves_every_leg_with_one_operation_and_the_shortest_deadline() {
    let mut h = three_pairs();
    support::reserved(h.reserve_request(call("rl-a")));
    support::reserved(h.reserve_request(call("rl-b")));
    let (a, b) = (call_ids("rl-a"), call_ids("rl-b"));
    for id in a.iter().chain(&b) {
        // The shortest hold of the three policies: the requests pair's.
        assert_eq!(record(&h, id).receipt.expires_at, at(REQUESTS_HOLD_MS));
    }
    // One millisecond before expiry the start wins.
    h.at(REQUESTS_HOLD_MS - 1);
    let StartOutcome::Started(receipt) = start(&mut h, &a[0], "op-a") else {
        panic!("a start before expiry starts");
    };
    assert_eq!(receipt.operation_id, Some(op("op-a")));
    for id in &a {
        let leg = record(&h, id);
        assert_eq!(leg.receipt.state, ReservationState::Started);
        assert_eq!(leg.receipt.operation_id, Some(op("op-a")));
        assert_eq!(leg.started_at, Some(at(REQUESTS_HOLD_MS - 1)));
        // The requests hold (20 s) is the shortest deadline, the
        // concurrency limit (120 s) the shortest hard limit.
        assert_eq!(
            leg.usage_deadline,
            Some(at(REQUESTS_HOLD_MS - 1 + REQUESTS_HOLD_MS))
        );
        assert_eq!(
            leg.hard_limit_at,
            Some(at(REQUESTS_HOLD_MS - 1 + CONCURRENCY_HARD_LIMIT_MS))
        );
    }
    // A start naming another leg is the same start.
    assert!(matches!(
        start(&mut h, &a[2], "op-a"),
        StartOutcome::Duplicate(_)
    ));
    // At expiry the start loses: every leg expires, every account refunds.
    h.at(REQUESTS_HOLD_MS);
    let StartOutcome::Expired(receipt) = start(&mut h, &b[0], "op-b") else {
        panic!("a start at expiry expires");
    };
    assert_eq!(receipt.state, ReservationState::Expired);
    assert_states(&h, &b, ReservationState::Expired);
    for id in &b {
        assert_eq!(record(&h, id).receipt.operation_id, None);
    }
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 59 + 1 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 3 + 1 + 0 + 0 + 0"),
        ],
    );
}

// ----- 8. settle per leg -----

#[test]
fn settle_charges_each_leg_its_actuals_and_debt_lands_on_that_pair_only() {
    let mut h = three_pairs();
    alone(&mut h, &requests(), "rq-50", 50);
    support::reserved(h.reserve_request(multi(
        "rl-s",
        &[
            leg(&tokens(), 100),
            leg(&requests(), 5),
            leg(&concurrency(), 1),
        ],
    )));
    let ids = call_ids("rl-s");
    assert!(matches!(
        start(&mut h, &ids[0], "op-s"),
        StartOutcome::Started(_)
    ));
    let held = [
        (tokens(), "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0"),
        (requests(), "60 + 0 + 0 = 5 + 55 + 0 + 0 + 0"),
        (concurrency(), "4 + 0 + 0 = 3 + 1 + 0 + 0 + 0"),
    ];
    assert_accounts(&h, &held);

    // The wrong form, or a pair that is not a leg: nothing moves.
    let before = unchanged_view(&h);
    assert_eq!(
        settle(&mut h, &ids[0], "op-s", SettleActuals::One(80)),
        SettleOutcome::InvalidLeg {
            index: 0,
            problem: LegProblem::SettleForm
        }
    );
    let stray = SettleActuals::Legs(vec![actual(&tokens(), 80), actual(&unpoliced(), 1)]);
    assert_eq!(
        settle(&mut h, &ids[0], "op-s", stray),
        SettleOutcome::InvalidLeg {
            index: 1,
            problem: LegProblem::NotALeg
        }
    );
    // One unit above the largest unit count, on one leg: nothing moves.
    let too_many = SettleActuals::Legs(vec![
        actual(&tokens(), 80),
        actual(&concurrency(), UNITS_MAX + 1),
    ]);
    assert_eq!(
        settle(&mut h, &ids[0], "op-s", too_many),
        SettleOutcome::InvalidLeg {
            index: 1,
            problem: LegProblem::ActualUnits
        }
    );
    assert_eq!(unchanged_view(&h), before);
    assert_states(&h, &ids, ReservationState::Started);
    assert_accounts(&h, &held);

    // Tokens 80 (20 back), requests 12 (7 over: the 5 available, then 2 of
    // debt); concurrency left out, settled at its 1 reserved.
    let actuals = || SettleActuals::Legs(vec![actual(&requests(), 12), actual(&tokens(), 80)]);
    let receipt = settled(settle(&mut h, &ids[0], "op-s", actuals()));
    assert_eq!(receipt.reservation, ids[0]);
    assert_eq!(
        (
            receipt.actual_units,
            receipt.refunded_units,
            receipt.overdraft_units
        ),
        (80, 20, 0)
    );
    let all = vec![
        (tokens(), 100, 80, 0),
        (requests(), 5, 12, 2),
        (concurrency(), 1, 1, 0),
    ];
    assert_eq!(settled_legs(receipt.legs.as_deref().expect("legs")), all);
    let states = [
        ReservationState::Settled,
        ReservationState::SettledWithDebt,
        ReservationState::Settled,
    ];
    for (id, state) in ids.iter().zip(states) {
        let leg = record(&h, id);
        assert_eq!(leg.receipt.state, state, "leg {id}");
        let settlement = leg.settlement.as_ref().expect("settled");
        assert_eq!(settlement.state, state);
        assert!(!settlement.conservative);
        assert_eq!(settled_legs(settlement.legs.as_deref().expect("legs")), all);
    }
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 920 + 0 + 80 + 0 + 0"),
            (requests(), "60 + 0 + 2 = 0 + 50 + 12 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 3 + 0 + 1 + 0 + 0"),
        ],
    );
    assert_eq!(h.ledger.pair_debt(&tokens()), 0);
    assert_eq!(h.ledger.pair_debt(&requests()), 2);
    assert_eq!(h.ledger.pair_debt(&concurrency()), 0);
    assert!(
        !h.ledger.pair(&requests()).expect("pair").frozen,
        "2 is within the requests pair's overdraft of 10"
    );

    // The same settle again, naming any leg: that leg's settlement.
    assert_eq!(
        settle(&mut h, &ids[0], "op-s", actuals()),
        SettleOutcome::Duplicate(receipt.clone())
    );
    let requests_settlement = record(&h, &ids[1]).settlement.clone().expect("settled");
    assert_eq!(
        settle(&mut h, &ids[1], "op-s", actuals()),
        SettleOutcome::Duplicate(requests_settlement)
    );
    // Other actuals conflict: one unit more, or requests left out (its
    // reserved 5 is not the 12 settled).
    let before = unchanged_view(&h);
    for other in [
        vec![actual(&requests(), 12), actual(&tokens(), 81)],
        vec![actual(&tokens(), 80)],
    ] {
        assert_eq!(
            settle(&mut h, &ids[0], "op-s", SettleActuals::Legs(other)),
            SettleOutcome::SettlementConflict(receipt.clone())
        );
    }
    assert_eq!(unchanged_view(&h), before);
}

/// A leg's record kept for its debt keeps every other leg's record: a
/// retry is still judged on every leg's actuals (found by the model test:
/// the retry was taken for a duplicate, when the other legs had gone), and
/// no leg's ID is reserved anew while a sibling still lists it (found by
/// the model test too: a forgotten first leg's ID reserved alone left the
/// kept leg naming a reservation that was no longer its own). The legs go
/// together once the debt is repaid.
#[test]
fn legs_kept_for_one_legs_debt_go_together_once_it_is_repaid() {
    let mut h = three_pairs();
    h.at(0);
    alone(&mut h, &requests(), "rq-50", 50);
    support::reserved(h.reserve_request(multi(
        "rl-f",
        &[
            leg(&tokens(), 100),
            leg(&requests(), 5),
            leg(&concurrency(), 1),
        ],
    )));
    let ids = call_ids("rl-f");
    start(&mut h, &ids[0], "op-f");
    let actuals = |tokens_used| {
        SettleActuals::Legs(vec![
            actual(&tokens(), tokens_used),
            actual(&requests(), 12),
        ])
    };
    settled(settle(&mut h, &ids[0], "op-f", actuals(80)));
    let kept = record(&h, &ids[1]).settlement.clone().expect("settled");
    assert_eq!(kept.overdraft_units, 2);

    // A retention window later the requests leg is kept for its debt of
    // 2, and the tokens and concurrency legs with it.
    h.at(RETENTION_DEFAULT_MS);
    let outcome = h.run(|ledger, now| ledger.forget_expired(now));
    assert_eq!(outcome.reservations, 0);
    for id in &ids {
        assert!(h.ledger.reservation(id).is_some(), "{id} is kept");
    }

    let before = unchanged_view(&h);
    assert_eq!(
        settle(&mut h, &ids[1], "op-f", actuals(81)),
        SettleOutcome::SettlementConflict(kept.clone()),
        "one unit more on another leg"
    );
    assert_eq!(
        settle(&mut h, &ids[1], "op-f", actuals(80)),
        SettleOutcome::Duplicate(kept)
    );
    assert_eq!(unchanged_view(&h), before);

    // The next epoch's opening repays the debt: every leg goes, in one
    // sweep.
    h.at(RETENTION_DEFAULT_MS + 1);
    h.refill();
    assert_eq!(h.ledger.pair_debt(&requests()), 0);
    let outcome = h.run(|ledger, now| ledger.forget_expired(now));
    assert_eq!(outcome.reservations, 3);
    assert_no_records(&h, &ids);
}

// ----- 9. release and abandon -----

#[test]
fn release_and_abandon_of_leg_0_end_every_leg_and_refund_every_account() {
    let mut h = three_pairs();
    support::reserved(h.reserve_request(call("rl-rel")));
    support::reserved(h.reserve_request(call("rl-ab")));
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 800 + 200 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 58 + 2 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 2 + 2 + 0 + 0 + 0"),
        ],
    );
    let ReleaseOutcome::Released(receipt) = h.release("rl-rel") else {
        panic!("a reserved reservation releases");
    };
    assert_eq!(receipt.state, ReservationState::Released);
    let released = call_ids("rl-rel");
    assert_states(&h, &released, ReservationState::Released);
    for id in &released {
        assert_eq!(record(&h, id).ended_at, Some(at(0)));
    }
    // Named by another leg, the release is done already.
    assert!(matches!(
        release(&mut h, &released[2]),
        ReleaseOutcome::Duplicate(_)
    ));
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 59 + 1 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 3 + 1 + 0 + 0 + 0"),
        ],
    );
    let AbandonOutcome::Abandoned(receipt) = h.abandon("rl-ab") else {
        panic!("a reserved reservation is abandoned");
    };
    assert_eq!(receipt.state, ReservationState::Abandoned);
    assert_states(&h, &call_ids("rl-ab"), ReservationState::Abandoned);
    assert_untouched(&h);
    // A late duplicate of the abandoned reserve never reserves.
    assert_eq!(h.reserve_request(call("rl-ab")), ReserveOutcome::Abandoned);
    assert_untouched(&h);
}

// ----- 10. expiry and retention in batches of one -----

/// [`three_pairs`] whose sweeps take one record a batch.
fn three_pairs_in_batches_of_one() -> Harness {
    let mut h = Harness::new();
    h.ledger = CentralLedger::new(CentralConfig {
        sweep_batch_max: 1,
        ..CentralConfig::default()
    });
    three_pairs_on(h, [RouteMode::Enforce; 3])
}

#[test]
fn expiry_moves_every_leg_of_a_reservation_in_one_step_even_in_batches_of_one() {
    let mut h = three_pairs_in_batches_of_one();
    support::reserved(h.reserve_request(call("rl-1")));
    h.at(1);
    support::reserved(h.reserve_request(call("rl-2")));
    let (first, second) = (call_ids("rl-1"), call_ids("rl-2"));
    let sorted = |mut ids: Vec<ReservationId>| {
        ids.sort();
        ids
    };
    h.at(REQUESTS_HOLD_MS - 1);
    assert!(h.begin_expiry().is_empty(), "not yet due");
    // Both due; one reservation a step, all its legs at once.
    h.at(REQUESTS_HOLD_MS + 1);
    assert_eq!(sorted(h.begin_expiry()), sorted(first.clone()));
    assert_states(&h, &first, ReservationState::Expiring);
    assert_states(&h, &second, ReservationState::Reserved);
    assert_eq!(sorted(h.begin_expiry()), sorted(second.clone()));
    assert_states(&h, &second, ReservationState::Expiring);
    assert!(h.begin_expiry().is_empty());
    let one_held = [
        (tokens(), "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0"),
        (requests(), "60 + 0 + 0 = 59 + 1 + 0 + 0 + 0"),
        (concurrency(), "4 + 0 + 0 = 3 + 1 + 0 + 0 + 0"),
    ];
    let done = sorted(h.complete_expiry());
    let (done_first, pending) = if done == sorted(first.clone()) {
        (first, second)
    } else {
        assert_eq!(done, sorted(second.clone()), "one reservation's legs");
        (second, first)
    };
    assert_states(&h, &done_first, ReservationState::Expired);
    assert_states(&h, &pending, ReservationState::Expiring);
    assert_accounts(&h, &one_held);
    assert_eq!(sorted(h.complete_expiry()), sorted(pending.clone()));
    assert_states(&h, &pending, ReservationState::Expired);
    assert!(h.complete_expiry().is_empty());
    assert_untouched(&h);
}

/// The retention sweep forgets a reservation's legs in one transition,
/// even where its batch ends after the first: no leg's ID is unknown while
/// a sibling still lists it.
#[test]
fn a_sweep_forgets_every_leg_of_a_reservation_at_once_even_in_batches_of_one() {
    let mut h = three_pairs_in_batches_of_one();
    support::reserved(h.reserve_request(call("rl-1")));
    let ids = call_ids("rl-1");
    assert_eq!(ids.len(), 3);
    assert!(matches!(
        release(&mut h, &ids[0]),
        ReleaseOutcome::Released(_)
    ));
    h.at(RETENTION_DEFAULT_MS - 1);
    assert_eq!(
        h.run(|ledger, now| ledger.forget_expired(now)).reservations,
        0
    );
    h.at(RETENTION_DEFAULT_MS);
    assert_eq!(
        h.run(|ledger, now| ledger.forget_expired(now)).reservations,
        3
    );
    assert_no_records(&h, &ids);
}

// ----- 11. usage deadlines -----

#[test]
fn past_the_deadlines_every_leg_is_unknown_then_settled_conservatively_then_corrected_once() {
    let mut h = three_pairs();
    support::reserved(h.reserve_request(multi(
        "rl-u",
        &[
            leg(&tokens(), 100),
            leg(&requests(), 5),
            leg(&concurrency(), 1),
        ],
    )));
    let ids = call_ids("rl-u");
    assert!(matches!(
        start(&mut h, &ids[0], "op-u"),
        StartOutcome::Started(_)
    ));
    let held = [
        (tokens(), "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0"),
        (requests(), "60 + 0 + 0 = 55 + 5 + 0 + 0 + 0"),
        (concurrency(), "4 + 0 + 0 = 3 + 1 + 0 + 0 + 0"),
    ];
    h.at(REQUESTS_HOLD_MS - 1);
    assert!(h.usage_deadlines().is_empty(), "before the deadline");
    h.at(REQUESTS_HOLD_MS);
    let moved = h.usage_deadlines();
    assert!(!moved.is_empty() && moved.iter().all(|id| ids.contains(id)));
    assert_states(&h, &ids, ReservationState::UsageUnknown);
    assert_accounts(&h, &held);
    h.at(CONCURRENCY_HARD_LIMIT_MS - 1);
    assert!(h.usage_deadlines().is_empty(), "before the hard limit");
    assert_states(&h, &ids, ReservationState::UsageUnknown);
    // At the shared hard limit every leg is charged its reserved units.
    h.at(CONCURRENCY_HARD_LIMIT_MS);
    let moved = h.usage_deadlines();
    assert!(!moved.is_empty() && moved.iter().all(|id| ids.contains(id)));
    let conservative = vec![
        (tokens(), 100, 100, 0),
        (requests(), 5, 5, 0),
        (concurrency(), 1, 1, 0),
    ];
    for id in &ids {
        let leg = record(&h, id);
        assert_eq!(leg.receipt.state, ReservationState::Settled);
        let settlement = leg.settlement.as_ref().expect("settled");
        assert!(settlement.conservative);
        assert_eq!(
            settled_legs(settlement.legs.as_deref().expect("legs")),
            conservative
        );
    }
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 900 + 0 + 100 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 55 + 0 + 5 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 3 + 0 + 1 + 0 + 0"),
        ],
    );
    // The genuine receipt arrives late: every leg is corrected at once.
    h.at(CONCURRENCY_HARD_LIMIT_MS + 1000);
    let late = || {
        SettleActuals::Legs(vec![
            actual(&tokens(), 40),
            actual(&requests(), 2),
            actual(&concurrency(), 0),
        ])
    };
    let SettleOutcome::Corrected(receipt) = settle(&mut h, &ids[0], "op-u", late()) else {
        panic!("a late genuine receipt corrects");
    };
    assert!(!receipt.conservative);
    let corrected = vec![
        (tokens(), 100, 40, 0),
        (requests(), 5, 2, 0),
        (concurrency(), 1, 0, 0),
    ];
    assert_eq!(
        settled_legs(receipt.legs.as_deref().expect("legs")),
        corrected
    );
    for id in &ids {
        let leg = record(&h, id);
        assert!(leg.corrected, "leg {id}");
        let settlement = leg.settlement.as_ref().expect("settled");
        assert!(!settlement.conservative);
        assert_eq!(
            settled_legs(settlement.legs.as_deref().expect("legs")),
            corrected
        );
    }
    let corrected_accounts = [
        (tokens(), "1000 + 0 + 0 = 960 + 0 + 40 + 0 + 0"),
        (requests(), "60 + 0 + 0 = 58 + 0 + 2 + 0 + 0"),
        (concurrency(), "4 + 0 + 0 = 4 + 0 + 0 + 0 + 0"),
    ];
    assert_accounts(&h, &corrected_accounts);
    // Once: the same receipt is a duplicate, another one a conflict.
    assert_eq!(
        settle(&mut h, &ids[0], "op-u", late()),
        SettleOutcome::Duplicate(receipt.clone())
    );
    let other = SettleActuals::Legs(vec![actual(&tokens(), 30)]);
    assert_eq!(
        settle(&mut h, &ids[0], "op-u", other),
        SettleOutcome::SettlementConflict(receipt)
    );
    assert_accounts(&h, &corrected_accounts);
}

// ----- 12. shadow legs -----

#[test]
fn a_shadow_leg_holds_nothing_and_grants_its_ask_all_shadow_is_a_shadow_outcome() {
    let mut h = three_pairs_in([RouteMode::Enforce, RouteMode::Shadow, RouteMode::Enforce]);
    // 500 requests: above the units max and all that is available.
    let legs = [
        leg(&tokens(), 100),
        leg(&requests(), 500),
        leg(&concurrency(), 1),
    ];
    let receipt = support::reserved(h.reserve_request(multi("rl-mixed", &legs)));
    assert_eq!(
        granted(receipt.legs.as_deref().expect("legs")),
        vec![
            (tokens(), 100, None, None),
            (requests(), 500, None, None),
            (concurrency(), 1, None, None),
        ]
    );
    let ids = call_ids("rl-mixed");
    let shadows: Vec<bool> = ids.iter().map(|id| record(&h, id).shadow).collect();
    assert_eq!(shadows, [false, true, false]);
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 60 + 0 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 3 + 1 + 0 + 0 + 0"),
        ],
    );
    // Settled far above its grant, the shadow leg spends nothing either.
    assert!(matches!(
        start(&mut h, &ids[0], "op-m"),
        StartOutcome::Started(_)
    ));
    let actuals = SettleActuals::Legs(vec![actual(&requests(), 700), actual(&concurrency(), 0)]);
    settled(settle(&mut h, &ids[0], "op-m", actuals));
    assert_eq!(h.ledger.pair_debt(&requests()), 0);
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 900 + 0 + 100 + 0 + 0"),
            (requests(), "60 + 0 + 0 = 60 + 0 + 0 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 4 + 0 + 0 + 0 + 0"),
        ],
    );

    // Every leg in shadow: a shadow reservation, and what would have refused.
    let mut h = three_pairs_in([RouteMode::Shadow; 3]);
    let ReserveOutcome::Shadow {
        receipt,
        would_reject,
    } = h.reserve_request(multi("rl-shadow", &legs))
    else {
        panic!("all legs in shadow make a shadow reservation");
    };
    assert_eq!(receipt.reservation, leg_id(&tokens(), "rl-shadow"));
    assert_eq!(receipt.reserved_units, 100);
    assert_eq!(
        granted(receipt.legs.as_deref().expect("legs"))[1],
        (requests(), 500, None, None)
    );
    let would_reject = would_reject.expect("the requests leg would be refused");
    assert_eq!(would_reject.dimension, Dimension::ReservationUnitsMax);
    assert_eq!(
        would_reject.retry_after_header_seconds(),
        RETRY_AFTER_NO_HORIZON_SECONDS
    );
    for id in call_ids("rl-shadow") {
        let leg = record(&h, &id);
        assert!(leg.shadow);
        assert_eq!(leg.receipt.state, ReservationState::Reserved);
    }
    assert_untouched(&h);
}

#[test]
fn a_late_correction_over_one_legs_grant_is_debt_on_that_pair_only() {
    let mut h = three_pairs();
    alone(&mut h, &requests(), "rq-50", 50);
    support::reserved(h.reserve_request(multi(
        "rl-c",
        &[
            leg(&tokens(), 100),
            leg(&requests(), 5),
            leg(&concurrency(), 1),
        ],
    )));
    let ids = call_ids("rl-c");
    assert!(matches!(
        start(&mut h, &ids[0], "op-c"),
        StartOutcome::Started(_)
    ));
    h.at(REQUESTS_HOLD_MS);
    assert!(!h.usage_deadlines().is_empty());
    h.at(CONCURRENCY_HARD_LIMIT_MS);
    assert!(!h.usage_deadlines().is_empty());
    assert_states(&h, &ids, ReservationState::Settled);
    // Requests 12 on a conservative charge of 5: 7 more, the 5 available
    // and then 2 of debt, made past the hard limit (a breach: the requests
    // pair freezes). Tokens left out stay at their charge of 100.
    h.at(CONCURRENCY_HARD_LIMIT_MS + 1000);
    let late = SettleActuals::Legs(vec![actual(&requests(), 12), actual(&concurrency(), 0)]);
    let SettleOutcome::Corrected(receipt) = settle(&mut h, &ids[0], "op-c", late) else {
        panic!("a late genuine receipt corrects");
    };
    assert_eq!(
        settled_legs(receipt.legs.as_deref().expect("legs")),
        vec![
            (tokens(), 100, 100, 0),
            (requests(), 5, 12, 2),
            (concurrency(), 1, 0, 0),
        ]
    );
    let states = [
        ReservationState::Settled,
        ReservationState::SettledWithDebt,
        ReservationState::Settled,
    ];
    for (id, state) in ids.iter().zip(states) {
        assert_eq!(record(&h, id).receipt.state, state, "leg {id}");
        assert!(record(&h, id).corrected);
    }
    assert_accounts(
        &h,
        &[
            (tokens(), "1000 + 0 + 0 = 900 + 0 + 100 + 0 + 0"),
            (requests(), "60 + 0 + 2 = 0 + 50 + 12 + 0 + 0"),
            (concurrency(), "4 + 0 + 0 = 4 + 0 + 0 + 0 + 0"),
        ],
    );
    let debts: Vec<u64> = [tokens(), requests(), concurrency()]
        .iter()
        .map(|pair| h.ledger.pair_debt(pair))
        .collect();
    assert_eq!(debts, [0, 2, 0]);
    let frozen: Vec<bool> = [tokens(), requests(), concurrency()]
        .iter()
        .map(|pair| h.ledger.pair(pair).expect("pair").frozen)
        .collect();
    assert_eq!(frozen, [false, true, false]);
}

/// A store that loads part of the ledger (PostgreSQL loads the pairs a
/// batch names) must load every leg's pair before a sweep moves a leg: a
/// due leg whose sibling is not loaded is never expired alone. Debug builds
/// stop there; the PostgreSQL store's look-up of due pairs adds every
/// leg's pair (`central/src/store/postgres.rs`, `DUE_PAIRS`).
#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "a due leg's siblings are not loaded")]
fn a_sweep_never_expires_a_leg_whose_sibling_is_not_loaded() {
    let mut h = three_pairs();
    let two_legs = multi("scoped", &[leg(&tokens(), 100), leg(&requests(), 1)]);
    assert!(matches!(
        h.reserve_request(two_legs),
        ReserveOutcome::Reserved(_)
    ));
    // The records of the tokens pair only, as a scoped load of it reads them.
    let tokens_pair = tokens();
    let scoped: Vec<ledger::Change> = h
        .records()
        .into_iter()
        .filter(|change| match change.key() {
            ledger::RecordKey::Policy(pair, _) | ledger::RecordKey::Pair(pair) => {
                pair == tokens_pair
            }
            ledger::RecordKey::Account(account) => account.pair == tokens_pair,
            ledger::RecordKey::Reservation(_) => match change {
                ledger::Change::Reservation(record) => record.account_key().pair == tokens_pair,
                _ => false,
            },
            _ => false,
        })
        .collect();
    let mut scoped = CentralLedger::from_live_records(CentralConfig::default(), scoped)
        .expect("the tokens pair loads alone");
    let _ = scoped.begin_expiry(at(REQUESTS_HOLD_MS + 1));
}

/// The largest unit count is a valid actual for a leg (the boundary of
/// `legs[i].actualUnits`): it settles, the overage is that pair's debt.
#[test]
fn a_leg_settles_at_the_largest_unit_count() {
    let mut h = three_pairs();
    support::reserved(
        h.reserve_request(multi("rl-max", &[leg(&tokens(), 100), leg(&requests(), 1)])),
    );
    let ids = call_ids("rl-max");
    assert!(matches!(
        start(&mut h, &ids[0], "op-max"),
        StartOutcome::Started(_)
    ));
    let actuals = SettleActuals::Legs(vec![actual(&requests(), UNITS_MAX)]);
    let receipt = settled(settle(&mut h, &ids[0], "op-max", actuals));
    let legs = settled_legs(receipt.legs.as_deref().expect("legs"));
    assert_eq!(
        legs,
        vec![
            (tokens(), 100, 100, 0),
            (requests(), 1, UNITS_MAX, UNITS_MAX - 1 - 59)
        ]
    );
    assert_eq!(h.ledger.pair_debt(&requests()), UNITS_MAX - 60);
    assert!(h.ledger.pair(&requests()).expect("pair").frozen);
    assert_eq!(h.ledger.pair_debt(&tokens()), 0);
}

// ----- the LegsApart invariant -----

/// The records of `h` with `edit` applied to the record of leg `id`, as
/// [`CentralLedger::from_records`] judges them: the violations it reports
/// (none when they load).
fn violations_with(
    h: &Harness,
    id: &ReservationId,
    edit: impl FnOnce(&mut ReservationRecord),
) -> Vec<Violation> {
    let mut edit = Some(edit);
    let records: Vec<ledger::Change> = h
        .records()
        .into_iter()
        .map(|mut change| {
            if let ledger::Change::Reservation(record) = &mut change
                && record.receipt.reservation == *id
            {
                (edit.take().expect("one record per leg"))(record);
            }
            change
        })
        .collect();
    assert!(edit.is_none(), "leg {id} is recorded");
    match CentralLedger::from_records(CentralConfig::default(), records) {
        Ok(_) => Vec::new(),
        Err(ledger::LoadError::Invariants(violations)) => violations,
    }
}

/// Whether `violations` hold a LegsApart between `a` and `b` (either way).
fn apart(violations: &[Violation], a: &ReservationId, b: &ReservationId) -> bool {
    violations.iter().any(|violation| {
        matches!(violation, Violation::LegsApart { reservation, sibling }
            if (reservation == a && sibling == b) || (reservation == b && sibling == a))
    })
}

/// Stored legs of one reservation that differ in any one of their legs
/// list, state, operation, expiry or usage deadline are apart, each alone;
/// the same records unedited, or a leg SETTLED beside one SETTLED_WITH_DEBT,
/// are not.
#[test]
fn legs_differing_in_one_field_alone_are_apart() {
    let mut h = three_pairs();
    support::reserved(h.reserve_request(multi(
        "rl-apart",
        &[leg(&tokens(), 100), leg(&requests(), 1)],
    )));
    let ids = [
        leg_id(&tokens(), "rl-apart"),
        leg_id(&requests(), "rl-apart"),
    ];
    let (a, b) = (&ids[0], &ids[1]);
    assert!(violations_with(&h, b, |_| {}).is_empty(), "unedited: clean");

    // The legs listed in another order.
    let violations = violations_with(&h, b, |record| {
        record.receipt.legs.as_mut().expect("two legs").reverse();
    });
    assert!(apart(&violations, a, b), "legs list: {violations:?}");
    // Another state that holds the same units.
    let violations = violations_with(&h, b, |record| {
        record.receipt.state = ReservationState::Expiring;
    });
    assert!(apart(&violations, a, b), "state: {violations:?}");
    // An expiry one millisecond later.
    let violations = violations_with(&h, b, |record| {
        record.receipt.expires_at = record.receipt.expires_at.saturating_add_ms(1);
    });
    assert!(apart(&violations, a, b), "expiresAt: {violations:?}");

    h.at(1);
    assert!(matches!(
        start(&mut h, a, "op-apart"),
        StartOutcome::Started(_)
    ));
    assert!(violations_with(&h, b, |_| {}).is_empty(), "started: clean");
    // Another operation.
    let violations = violations_with(&h, b, |record| {
        record.receipt.operation_id = Some(op("op-other"));
    });
    assert!(apart(&violations, a, b), "operation: {violations:?}");
    // A usage deadline one millisecond later.
    let violations = violations_with(&h, b, |record| {
        let deadline = record.usage_deadline.expect("a started leg's deadline");
        record.usage_deadline = Some(deadline.saturating_add_ms(1));
    });
    assert!(apart(&violations, a, b), "usage deadline: {violations:?}");

    // The requests leg overspends into debt, the tokens leg does not:
    // SETTLED beside SETTLED_WITH_DEBT is one state, not apart.
    let actuals = SettleActuals::Legs(vec![actual(&requests(), 65)]);
    settled(settle(&mut h, a, "op-apart", actuals));
    assert_eq!(record(&h, a).receipt.state, ReservationState::Settled);
    assert_eq!(
        record(&h, b).receipt.state,
        ReservationState::SettledWithDebt
    );
    assert!(violations_with(&h, b, |_| {}).is_empty(), "settled: clean");
}
