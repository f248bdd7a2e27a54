//! Flexible reservations (docs/design.md §3.2): a reserve that gives
//! `minUnits` is granted the largest amount from `minUnits` to `units` that
//! the units max and the account's `available` allow, after the same gates
//! as any reserve; the grant is the receipt's `reservedUnits`. Tested at
//! each bound and one past it, on the central ledger and on a shard's book.
//!
//! The policy is docs/design.md §4.7's: opening 1000, refill 100 a second,
//! reservations of at most 800, overdraft at most 200.

mod support;

use ledger::{Dimension, ReserveOutcome, SettleOutcome, ShardReserveOutcome};
use shard_format::{Document, RouteMode};
use support::{Harness, ShardHarness, pair, policy, rejected, reserved, signed_shard};

/// `holdTtlMs` of the policy.
const HOLD_MS: u64 = 30_000;

/// The §4.7 policy with 700 of its 1000 units held: 300 stay available.
fn with_300_available() -> Harness {
    let mut h = Harness::with_policy(policy(31));
    h.reserved("rl-700", 700);
    h
}

#[test]
fn a_flexible_reserve_is_granted_what_is_available_down_to_its_floor() {
    let mut h = with_300_available();
    let receipt = reserved(h.reserve_between("rl-flex", 100, 500));
    assert_eq!(receipt.reserved_units, 300, "all that is available");
    assert_eq!(receipt.requested_units, Some(500));
    assert_eq!(receipt.min_units, Some(100));
    assert_eq!(receipt.validate(), Ok(()));
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 0 = 0 + 1000 + 0 + 0 + 0");
}

#[test]
fn available_exactly_at_the_floor_is_granted_one_below_is_rejected() {
    let mut h = with_300_available();
    let rejection = rejected(h.reserve_between("rl-301", 301, 500));
    assert_eq!(rejection.dimension, Dimension::Capacity);
    // Retry-After counts the floor, not the ask: one tick of 100 covers 301.
    assert_eq!(rejection.retry_after_seconds, Some(1));
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 0 = 300 + 700 + 0 + 0 + 0");
    let receipt = reserved(h.reserve_between("rl-300", 300, 500));
    assert_eq!(receipt.reserved_units, 300);
    h.assert_account(&account, "1000 + 0 + 0 = 0 + 1000 + 0 + 0 + 0");
}

#[test]
fn a_flexible_reserve_that_fits_whole_is_granted_its_units() {
    let mut h = with_300_available();
    let receipt = reserved(h.reserve_between("rl-fits", 1, 299));
    assert_eq!(receipt.reserved_units, 299);
    assert_eq!(receipt.requested_units, Some(299));
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 0 = 1 + 999 + 0 + 0 + 0");
}

#[test]
fn a_floor_equal_to_units_is_an_exact_reserve() {
    let mut h = with_300_available();
    assert_eq!(
        rejected(h.reserve_between("rl-301", 301, 301)).dimension,
        Dimension::Capacity
    );
    assert_eq!(
        reserved(h.reserve_between("rl-300", 300, 300)).reserved_units,
        300
    );
}

#[test]
fn the_grant_is_capped_by_the_units_max_and_the_floor_judged_against_it() {
    let mut h = Harness::with_policy(policy(31));
    // 1000 available, at most 800 a reservation: the grant stops at 800.
    let receipt = reserved(h.reserve_between("rl-900", 100, 900));
    assert_eq!(receipt.reserved_units, 800);
    assert_eq!(receipt.requested_units, Some(900));
    // A floor of 801 can never be granted.
    let mut h = Harness::with_policy(policy(31));
    assert_eq!(
        rejected(h.reserve_between("rl-801", 801, 900)).dimension,
        Dimension::ReservationUnitsMax
    );
    assert_eq!(
        reserved(h.reserve_between("rl-800", 800, 900)).reserved_units,
        800
    );
}

#[test]
fn a_floor_of_zero_or_above_units_is_invalid_and_holds_nothing() {
    let mut h = with_300_available();
    assert_eq!(
        h.reserve_between("rl-zero", 0, 100),
        ReserveOutcome::InvalidMinUnits
    );
    assert_eq!(
        h.reserve_between("rl-above", 101, 100),
        ReserveOutcome::InvalidMinUnits
    );
    assert!(h.ledger.reservation(&support::rid("rl-zero")).is_none());
    // At the bounds it is valid.
    assert_eq!(
        reserved(h.reserve_between("rl-one", 1, 100)).reserved_units,
        100
    );
    assert_eq!(
        reserved(h.reserve_between("rl-same", 100, 100)).reserved_units,
        100
    );
}

#[test]
fn debt_of_one_unit_closes_flexible_admission_too() {
    let mut h = Harness::with_policy(policy(31));
    h.reserved("rl-big", 800);
    h.started("rl-big", "op-big");
    assert_eq!(h.settled("rl-big", "op-big", 1001).overdraft_units, 1);
    let rejection = rejected(h.reserve_between("rl-flex", 1, 100));
    assert_eq!(rejection.dimension, Dimension::Debt);
}

#[test]
fn a_retry_is_answered_with_the_first_grant_and_a_different_floor_conflicts() {
    let mut h = with_300_available();
    let first = reserved(h.reserve_between("rl-flex", 100, 500));
    assert_eq!(first.reserved_units, 300);
    // More becomes available; the retry still gets the first grant.
    h.release("rl-700");
    assert_eq!(
        h.reserve_between("rl-flex", 100, 500),
        ReserveOutcome::Duplicate(first.clone())
    );
    // The same key with another floor, or as an exact reserve, is another
    // request.
    let conflict = |outcome| matches!(outcome, ReserveOutcome::IdempotencyConflict { .. });
    assert!(conflict(h.reserve_between("rl-flex", 101, 500)));
    let exact = support::request("rl-flex", 500, "rl-flex/100..500");
    assert!(conflict(h.reserve_request(exact)));
}

#[test]
fn settling_above_the_grant_is_overage_against_the_grant() {
    let mut h = with_300_available();
    reserved(h.reserve_between("rl-flex", 100, 500));
    h.started("rl-flex", "op-flex");
    // Actual 450 on a grant of 300: 150 over, with nothing available it is
    // all overdraft (debt), within overdraftUnitsMax.
    let receipt = h.settled("rl-flex", "op-flex", 450);
    assert_eq!(receipt.reserved_units, 300);
    assert_eq!(receipt.refunded_units, 0);
    assert_eq!(receipt.overdraft_units, 150);
    assert_eq!(h.ledger.pair_debt(&pair()), 150);
}

#[test]
fn settling_below_the_grant_refunds_the_difference() {
    let mut h = with_300_available();
    reserved(h.reserve_between("rl-flex", 100, 500));
    h.started("rl-flex", "op-flex");
    let SettleOutcome::Settled(receipt) = h.settle("rl-flex", "op-flex", 120) else {
        panic!("a settle within the grant settles");
    };
    assert_eq!(receipt.refunded_units, 180);
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 0 = 180 + 700 + 120 + 0 + 0");
}

#[test]
fn shadow_mode_grants_the_whole_ask_and_holds_nothing() {
    let mut shadow = policy(31);
    shadow.mode = RouteMode::Shadow;
    let mut h = Harness::with_policy(shadow);
    let ReserveOutcome::Shadow {
        receipt,
        would_reject,
    } = h.reserve_between("rl-flex", 100, 500)
    else {
        panic!("shadow mode records a shadow reservation");
    };
    assert_eq!(receipt.reserved_units, 500);
    assert_eq!(would_reject, None, "the floor of 100 would have fitted");
    // A floor above the units max would have been rejected; still granted.
    let ReserveOutcome::Shadow {
        receipt,
        would_reject,
    } = h.reserve_between("rl-big", 801, 900)
    else {
        panic!("shadow mode records a shadow reservation");
    };
    assert_eq!(receipt.reserved_units, 900);
    assert_eq!(
        would_reject.map(|rejection| rejection.dimension),
        Some(Dimension::ReservationUnitsMax)
    );
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");
}

// ----- a shard's book (§4.6) -----

#[test]
fn a_shard_grants_its_local_available_down_to_the_floor() {
    let mut h = ShardHarness::open(signed_shard(200));
    let ShardReserveOutcome::Reserved(first) = h.reserve_between("rl-150", 150, 150, HOLD_MS)
    else {
        panic!("150 of 200 are available");
    };
    assert_eq!(first.units, 150);
    // 50 left: a floor of 51 is refused, one of 50 is granted all 50.
    assert_eq!(
        h.reserve_between("rl-51", 51, 120, HOLD_MS),
        ShardReserveOutcome::Capacity {
            local_available: 50
        }
    );
    let ShardReserveOutcome::Reserved(second) = h.reserve_between("rl-50", 50, 120, HOLD_MS) else {
        panic!("50 are available");
    };
    assert_eq!(second.units, 50);
    h.assert_terms("200 = 0 + 200 + 0 + 0");
}

#[test]
fn a_shard_refuses_a_floor_of_zero_or_above_units() {
    let mut h = ShardHarness::open(signed_shard(200));
    assert_eq!(
        h.reserve_between("rl-zero", 0, 10, HOLD_MS),
        ShardReserveOutcome::InvalidUnits
    );
    assert_eq!(
        h.reserve_between("rl-above", 11, 10, HOLD_MS),
        ShardReserveOutcome::InvalidUnits
    );
    h.assert_terms("200 = 200 + 0 + 0 + 0");
}
