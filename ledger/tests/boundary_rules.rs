//! Every limit a rule names, tested exactly at the limit and one past it
//! (docs/design.md §3.6, §3.7, §4.2, §4.4, §5.3, §5.10), on the central
//! ledger and on a shard's book, through the public API. The policy is
//! docs/design.md §4.7's: opening and burst 1000, refill 100 a second,
//! reservations of at most 800, holds of 30 s, overdraft at most 200,
//! execution hard limit 600 s, shards of 200 valid 600 s.
//!
//! Every operation runs through `support::Harness` or
//! `support::ShardHarness`, which audit the ledger (or check the shard
//! equation) after it and assert that refusals changed nothing.

mod support;

use ledger::{
    Dimension, IssueShardOutcome, ReserveOutcome, SettleOutcome, ShardReserveOutcome,
    ShardSettleOutcome, ShardStartOutcome, StartOutcome,
};
use shard_format::ReservationState;
use shard_format::limits::UNITS_MAX;
use support::{
    EPOCH_MS, Harness, ShardHarness, at, gateway_signer, nonce, pair, policy, rejected, reserved,
    rid, signed_shard,
};

/// `holdTtlMs` of the policy.
const HOLD_MS: u64 = 30_000;
/// `executionHardLimitMs` of the policy.
const HARD_LIMIT_MS: u64 = 600_000;

/// The §4.7 policy at generation 31, with 800 of its 1000 units reserved
/// as `rl-big` and started as `op-big` at `T0`: 200 stay available.
fn with_800_started() -> Harness {
    let mut h = Harness::with_policy(policy(31));
    h.reserved("rl-big", 800);
    h.started("rl-big", "op-big");
    h
}

/// Enrolls gateway `g-a` if it is not yet and registers a boot with
/// `nonce(seed)`; returns its boot epoch.
fn boot_gateway(h: &mut Harness, seed: u8) -> u64 {
    if h.ledger.gateway(&support::owner()).is_none() {
        h.enroll(&gateway_signer());
    }
    h.register(&gateway_signer(), nonce(seed))
}

/// A ledger whose pair owes exactly `debt` units (not frozen: `debt` is at
/// most `overdraftUnitsMax`), with nothing available: 800 reserved, settled
/// at 800 + 200 + `debt`.
fn owing(debt: u64) -> Harness {
    let mut h = with_800_started();
    let receipt = h.settled("rl-big", "op-big", 1000 + debt);
    assert_eq!(receipt.overdraft_units, debt);
    assert_eq!(h.ledger.pair_debt(&pair()), debt);
    assert!(!h.ledger.pair(&pair()).expect("pair").frozen);
    h
}

// ----- debt (§4.4) -----

#[test]
fn debt_of_one_unit_admits_nothing() {
    let mut h = owing(1);
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 1 = 0 + 0 + 1001 + 0 + 0");
    assert!(!h.ledger.admission_open(&pair()));
    // The debt plus the unit asked, one tick of 100: a second.
    let rejection = rejected(h.reserve("rl-1", 1));
    assert_eq!(rejection.dimension, Dimension::Debt);
    assert_eq!(rejection.retry_after_seconds, Some(1));
    // Shard issuance passes the same gate.
    let boot = boot_gateway(&mut h, 1);
    let IssueShardOutcome::Rejected(rejection) = h.issue("s1", &gateway_signer(), boot, nonce(1))
    else {
        panic!("a pair owing 1 unit gets no shard");
    };
    assert_eq!(rejection.dimension, Dimension::Debt);

    // One refill tick repays the unit first; the other 99 reach available.
    h.at(1000);
    h.refill();
    h.assert_account(&account, "1000 + 100 + 1 = 99 + 0 + 1001 + 0 + 1");
    assert_eq!(h.ledger.pair_debt(&pair()), 0);
    assert!(h.ledger.admission_open(&pair()));
    h.reserved("rl-1", 1);
}

#[test]
fn debt_retry_after_counts_the_debt_and_the_request() {
    // 200 owed, nothing available: 200 + 100 units are three ticks.
    let mut h = owing(200);
    let rejection = rejected(h.reserve("rl-1", 100));
    assert_eq!(rejection.dimension, Dimension::Debt);
    assert_eq!(rejection.retry_after_seconds, Some(3));
    // 200 + 101 are four.
    assert_eq!(
        rejected(h.reserve("rl-2", 101)).retry_after_seconds,
        Some(4)
    );
}

// ----- capacity (§4.4 step 6) -----

#[test]
fn available_equal_to_the_request_is_admitted() {
    let mut h = with_800_started();
    let account = h.account(31);
    let receipt = h.reserved("rl-exact", 200);
    assert_eq!(receipt.reserved_units, 200);
    h.assert_account(&account, "1000 + 0 + 0 = 0 + 1000 + 0 + 0 + 0");
}

#[test]
fn one_unit_above_available_is_refused_for_capacity() {
    let mut h = with_800_started();
    let rejection = rejected(h.reserve("rl-over", 201));
    assert_eq!(rejection.dimension, Dimension::Capacity);
    // One unit missing: one tick of the refill, a second.
    assert_eq!(rejection.retry_after_seconds, Some(1));
    // 101 missing are two ticks.
    h.reserved("rl-small", 100);
    assert_eq!(
        rejected(h.reserve("rl-over", 201)).retry_after_seconds,
        Some(2)
    );
}

#[test]
fn shard_issued_when_available_equals_its_units_refused_one_below() {
    // 800 reserved: 200 available, exactly `emergencyShardUnits`.
    let mut h = with_800_started();
    let boot = boot_gateway(&mut h, 1);
    let shard = h.issued("s1", &gateway_signer(), boot, nonce(1));
    assert_eq!(shard.allocated_units, 200);
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 0 = 0 + 800 + 0 + 200 + 0");

    // 199 available: one short of a shard.
    let mut h = Harness::with_policy(policy(31));
    h.reserved("rl-big", 800);
    h.reserved("rl-one", 1);
    let boot = boot_gateway(&mut h, 1);
    let IssueShardOutcome::Rejected(rejection) = h.issue("s1", &gateway_signer(), boot, nonce(1))
    else {
        panic!("199 available do not make a shard of 200");
    };
    assert_eq!(rejection.dimension, Dimension::Capacity);
}

// ----- units (§2.2 reservationUnitsMax, §2.1 the unit maximum) -----

#[test]
fn units_at_reservation_units_max_admitted_one_above_refused() {
    let mut h = Harness::with_policy(policy(31));
    let rejection = rejected(h.reserve("rl-801", 801));
    assert_eq!(rejection.dimension, Dimension::ReservationUnitsMax);
    assert_eq!(
        rejection.retry_after_seconds, None,
        "waiting never makes 801 fit"
    );
    assert_eq!(h.reserved("rl-800", 800).reserved_units, 800);
}

#[test]
fn units_at_the_unit_maximum_admitted_one_above_invalid() {
    let mut huge = policy(31);
    huge.opening = UNITS_MAX;
    huge.burst = UNITS_MAX;
    huge.reservation_units_max = UNITS_MAX;
    let mut h = Harness::with_policy(huge);
    assert_eq!(h.reserve("rl-0", 0), ReserveOutcome::InvalidUnits);
    assert_eq!(
        h.reserve("rl-above", UNITS_MAX + 1),
        ReserveOutcome::InvalidUnits
    );
    assert_eq!(h.reserved("rl-max", UNITS_MAX).reserved_units, UNITS_MAX);
    let account = h.account(31);
    assert_eq!(h.terms(&account).reserved, UNITS_MAX);
    assert_eq!(h.terms(&account).available, 0);
}

#[test]
fn settled_usage_at_the_unit_maximum_settles_one_above_overflows() {
    let mut h = with_800_started();
    assert_eq!(
        h.settle("rl-big", "op-big", UNITS_MAX + 1),
        SettleOutcome::Overflow(ledger::Overflow)
    );
    // At the maximum: a breach, recorded in full.
    let receipt = h.settled("rl-big", "op-big", UNITS_MAX);
    assert_eq!(receipt.overdraft_units, UNITS_MAX - 1000);
}

// ----- overdraft (§4.4, overdraftUnitsMax) -----

#[test]
fn overdraft_at_overdraft_units_max_is_debt_without_a_freeze() {
    let mut h = owing(200);
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 200 = 0 + 0 + 1200 + 0 + 0");
    assert_eq!(rejected(h.reserve("rl-1", 1)).dimension, Dimension::Debt);
}

#[test]
fn overdraft_one_past_overdraft_units_max_freezes_the_pair() {
    let mut h = with_800_started();
    let receipt = h.settled("rl-big", "op-big", 1201);
    assert_eq!(receipt.overdraft_units, 201);
    assert_eq!(receipt.state, ReservationState::SettledWithDebt);
    assert!(h.ledger.pair(&pair()).expect("pair").frozen);
    assert_eq!(rejected(h.reserve("rl-1", 1)).dimension, Dimension::Frozen);
}

#[test]
fn overage_covered_by_available_is_no_debt() {
    // 800 + the 200 available: overage without overdraft.
    let mut h = with_800_started();
    let receipt = h.settled("rl-big", "op-big", 1000);
    assert_eq!(receipt.overdraft_units, 0);
    assert_eq!(receipt.refunded_units, 0);
    assert_eq!(receipt.state, ReservationState::Settled);
    assert!(h.ledger.admission_open(&pair()));
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 0 = 0 + 0 + 1000 + 0 + 0");
}

// ----- the execution hard limit (§3.6) -----

#[test]
fn overdraft_at_the_hard_limit_is_no_breach() {
    let mut h = with_800_started();
    h.at(HARD_LIMIT_MS);
    let receipt = h.settled("rl-big", "op-big", 1001);
    assert_eq!(receipt.overdraft_units, 1);
    assert!(!h.ledger.pair(&pair()).expect("pair").frozen);
}

#[test]
fn overdraft_one_millisecond_past_the_hard_limit_freezes() {
    let mut h = with_800_started();
    h.at(HARD_LIMIT_MS + 1);
    let receipt = h.settled("rl-big", "op-big", 1001);
    assert_eq!(receipt.overdraft_units, 1);
    assert!(h.ledger.pair(&pair()).expect("pair").frozen);
}

#[test]
fn usage_deadline_passes_at_its_millisecond() {
    // Started at T0 without a deadline: the hold's 30 s are its deadline.
    let mut h = with_800_started();
    h.at(HOLD_MS - 1);
    assert!(h.usage_deadlines().is_empty());
    assert_eq!(
        h.reservation("rl-big").receipt.state,
        ReservationState::Started
    );
    h.at(HOLD_MS);
    assert_eq!(h.usage_deadlines(), vec![rid("rl-big")]);
    assert_eq!(
        h.reservation("rl-big").receipt.state,
        ReservationState::UsageUnknown
    );
    // The hard limit settles it conservatively, at its millisecond.
    h.at(HARD_LIMIT_MS - 1);
    assert!(h.usage_deadlines().is_empty());
    h.at(HARD_LIMIT_MS);
    assert_eq!(h.usage_deadlines(), vec![rid("rl-big")]);
    let settlement = h
        .reservation("rl-big")
        .settlement
        .clone()
        .expect("settled conservatively");
    assert!(settlement.conservative);
    assert_eq!(settlement.actual_units, 800);
}

#[test]
fn a_deadline_beyond_the_hard_limit_is_capped_by_it() {
    let mut h = Harness::with_policy(policy(31));
    h.reserved("rl-1", 100);
    let StartOutcome::Started(_) = h.start_with_deadline("rl-1", "op-1", Some(HARD_LIMIT_MS + 1))
    else {
        panic!("a held reservation starts");
    };
    h.at(HARD_LIMIT_MS - 1);
    assert!(h.usage_deadlines().is_empty());
    // At the hard limit the deadline passes and the conservative
    // settlement follows in the same sweep.
    h.at(HARD_LIMIT_MS);
    assert_eq!(h.usage_deadlines(), vec![rid("rl-1")]);
    let settlement = h
        .reservation("rl-1")
        .settlement
        .clone()
        .expect("settled conservatively");
    assert!(settlement.conservative);
}

// ----- holds (§3.7) -----

#[test]
fn hold_starts_until_the_millisecond_before_expires_at() {
    let mut h = Harness::with_policy(policy(31));
    let receipt = h.reserved("rl-1", 100);
    assert_eq!(receipt.expires_at, at(HOLD_MS));
    h.at(HOLD_MS - 1);
    assert!(h.begin_expiry().is_empty(), "still held");
    let started = h.started("rl-1", "op-1");
    assert_eq!(started.state, ReservationState::Started);
}

#[test]
fn hold_expires_at_expires_at() {
    let mut h = Harness::with_policy(policy(31));
    h.reserved("rl-1", 100);
    h.reserved("rl-2", 100);
    let account = h.account(31);
    h.at(HOLD_MS);
    // A start at `expiresAt` loses the race to expiry.
    let StartOutcome::Expired(expired) = h.start("rl-1", "op-1") else {
        panic!("the hold ended at expiresAt");
    };
    assert_eq!(expired.state, ReservationState::Expired);
    // The worker takes the other at the same millisecond.
    assert_eq!(h.begin_expiry(), vec![rid("rl-2")]);
    assert_eq!(h.complete_expiry(), vec![rid("rl-2")]);
    h.assert_account(&account, "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");
}

#[test]
fn a_hold_asked_beyond_the_policy_is_capped_at_hold_ttl() {
    let mut h = Harness::with_policy(policy(31));
    let mut request = support::request("rl-1", 100, "rl-1/100");
    request.hold_ttl_ms = Some(HOLD_MS + 1);
    assert_eq!(reserved(h.reserve_request(request)).expires_at, at(HOLD_MS));
    let mut request = support::request("rl-2", 100, "rl-2/100");
    request.hold_ttl_ms = Some(HOLD_MS - 1);
    assert_eq!(
        reserved(h.reserve_request(request)).expires_at,
        at(HOLD_MS - 1)
    );
    let mut request = support::request("rl-3", 100, "rl-3/100");
    request.hold_ttl_ms = Some(0);
    assert_eq!(reserved(h.reserve_request(request)).expires_at, at(1));
}

// ----- accounting epochs (§4.2) -----

#[test]
fn accounting_epoch_ends_at_its_last_millisecond() {
    let mut h = Harness::with_policy(policy(31));
    h.at(EPOCH_MS - 1);
    assert_eq!(h.reserved("rl-last", 100).accounting_epoch, at(0));
    h.at(EPOCH_MS);
    assert_eq!(
        h.reserved("rl-next", 100).accounting_epoch,
        at(EPOCH_MS),
        "the next epoch opens at its first millisecond"
    );
}

// ----- shards: validity and the lost-shard rule (§5.3, §5.10) -----

#[test]
fn shard_valid_for_its_validity_from_issuance() {
    let mut h = Harness::with_policy(policy(31));
    h.at(5);
    let boot = boot_gateway(&mut h, 1);
    let shard = h.issued("s1", &gateway_signer(), boot, nonce(1));
    assert_eq!(shard.not_before, at(5));
    assert_eq!(shard.not_after, at(5 + 600_000));
}

#[test]
fn shard_lost_at_not_after_plus_grace_not_before() {
    let mut h = Harness::with_policy(policy(31));
    let boot = boot_gateway(&mut h, 1);
    let shard = h.issued("s1", &gateway_signer(), boot, nonce(1));
    let grace = ledger::SHARD_LOST_GRACE_DEFAULT_MS;
    h.at(600_000 + grace - 1);
    assert!(h.mark_lost().is_empty());
    h.at(600_000 + grace);
    let lost = h.mark_lost();
    assert_eq!(lost.len(), 1);
    assert_eq!(lost[0].shard, shard.shard);
    assert_eq!(lost[0].units, 200);
    assert_eq!(lost[0].not_after, at(600_000));
}

#[test]
fn shard_cap_admits_its_units_exactly_and_refuses_one_shard_more() {
    // Factor 2 × 200: two open shards fill the cap; a new boot does not
    // reset it.
    let mut h = Harness::with_policy(policy(31));
    let boot = boot_gateway(&mut h, 1);
    h.issued("s1", &gateway_signer(), boot, nonce(1));
    h.at(1000);
    h.issued("s2", &gateway_signer(), boot, nonce(1));
    h.at(2000);
    let boot = h.register(&gateway_signer(), nonce(2));
    let IssueShardOutcome::UnreconciledCap {
        retry_after_seconds,
    } = h.issue("s3", &gateway_signer(), boot, nonce(2))
    else {
        panic!("400 open units are the cap");
    };
    // Until the oldest (s1, notAfter T0 + 600 s) is lost, 10 min later.
    let grace = ledger::SHARD_LOST_GRACE_DEFAULT_MS;
    assert_eq!(retry_after_seconds, (600_000 + grace - 2000) / 1000);
}

// ----- a shard's book (§4.6, §5.7) -----

#[test]
fn shard_admits_its_local_available_exactly() {
    let mut h = ShardHarness::open(signed_shard(200));
    assert_eq!(
        h.reserve("rl-over", 201, HOLD_MS),
        ShardReserveOutcome::Capacity {
            local_available: 200
        }
    );
    let ShardReserveOutcome::Reserved(_) = h.reserve("rl-all", 200, HOLD_MS) else {
        panic!("200 of 200 are available");
    };
    h.assert_terms("200 = 0 + 200 + 0 + 0");
    assert_eq!(
        h.reserve("rl-one", 1, HOLD_MS),
        ShardReserveOutcome::Capacity { local_available: 0 }
    );
}

#[test]
fn shard_units_at_the_unit_maximum_then_one_above_are_invalid() {
    let mut h = ShardHarness::open(signed_shard(200));
    assert_eq!(
        h.reserve("rl-0", 0, HOLD_MS),
        ShardReserveOutcome::InvalidUnits
    );
    assert_eq!(
        h.reserve("rl-above", UNITS_MAX + 1, HOLD_MS),
        ShardReserveOutcome::InvalidUnits
    );
    // At the maximum the units are valid, just not there.
    assert_eq!(
        h.reserve("rl-max", UNITS_MAX, HOLD_MS),
        ShardReserveOutcome::Capacity {
            local_available: 200
        }
    );
}

#[test]
fn shard_hold_starts_until_the_millisecond_before_it_ends() {
    let mut h = ShardHarness::open(signed_shard(200));
    h.at(1_000);
    let ShardReserveOutcome::Reserved(held) = h.reserve("rl-1", 100, HOLD_MS) else {
        panic!("100 of 200 are available");
    };
    assert_eq!(held.expires_at_ms, 1_000 + HOLD_MS);
    h.at(1_000 + HOLD_MS - 1);
    assert!(h.expire_due().is_empty());
    let ShardStartOutcome::Started(started) = h.start("rl-1", "op-1") else {
        panic!("the hold still runs");
    };
    assert_eq!(started.state, ReservationState::Started);
}

#[test]
fn shard_hold_ends_at_its_millisecond() {
    let mut h = ShardHarness::open(signed_shard(200));
    let ShardReserveOutcome::Reserved(_) = h.reserve("rl-1", 100, HOLD_MS) else {
        panic!("100 of 200 are available");
    };
    let ShardReserveOutcome::Reserved(_) = h.reserve("rl-2", 50, HOLD_MS) else {
        panic!("50 of 100 are available");
    };
    h.at(HOLD_MS);
    let ShardStartOutcome::Expired(expired) = h.start("rl-1", "op-1") else {
        panic!("the hold ended");
    };
    assert_eq!(expired.state, ReservationState::Expired);
    assert_eq!(h.expire_due(), vec![rid("rl-2")]);
    h.assert_terms("200 = 200 + 0 + 0 + 0");
}

#[test]
fn shard_debt_of_one_unit_pauses_the_shard() {
    let mut h = ShardHarness::open(signed_shard(200));
    let ShardReserveOutcome::Reserved(_) = h.reserve("rl-1", 150, HOLD_MS) else {
        panic!("150 of 200 are available");
    };
    let ShardStartOutcome::Started(_) = h.start("rl-1", "op-1") else {
        panic!("a held reservation starts");
    };
    // 150 reserved + the 50 available + 1.
    let ShardSettleOutcome::Settled(settled) = h.settle("rl-1", "op-1", 201) else {
        panic!("a started reservation settles");
    };
    assert_eq!(settled.overdraft_units, 1);
    assert_eq!(settled.state, ReservationState::SettledWithDebt);
    h.assert_terms("200 = 0 + 0 + 200 + 0");
    assert_eq!(h.book.overdraft_debt(), 1);
    assert!(h.book.is_paused());
    assert_eq!(h.reserve("rl-2", 1, HOLD_MS), ShardReserveOutcome::Paused);
}

#[test]
fn shard_overage_covered_by_local_available_is_no_debt() {
    let mut h = ShardHarness::open(signed_shard(200));
    let ShardReserveOutcome::Reserved(_) = h.reserve("rl-1", 150, HOLD_MS) else {
        panic!("150 of 200 are available");
    };
    let ShardStartOutcome::Started(_) = h.start("rl-1", "op-1") else {
        panic!("a held reservation starts");
    };
    let ShardSettleOutcome::Settled(settled) = h.settle("rl-1", "op-1", 200) else {
        panic!("a started reservation settles");
    };
    assert_eq!(settled.overdraft_units, 0);
    assert_eq!(settled.state, ReservationState::Settled);
    h.assert_terms("200 = 0 + 0 + 200 + 0");
    assert!(!h.book.is_paused());
}

#[test]
fn shard_debt_at_the_unit_maximum_settles_one_more_overflows() {
    let mut h = ShardHarness::open(signed_shard(200));
    for (id, units) in [("rl-1", 100), ("rl-2", 50), ("rl-3", 50)] {
        let ShardReserveOutcome::Reserved(_) = h.reserve(id, units, HOLD_MS) else {
            panic!("{units} are available");
        };
        let ShardStartOutcome::Started(_) = h.start(id, &format!("op-{id}")) else {
            panic!("a held reservation starts");
        };
    }
    let ShardSettleOutcome::Settled(_) = h.settle("rl-1", "op-rl-1", UNITS_MAX) else {
        panic!("usage at the unit maximum settles");
    };
    assert_eq!(h.book.overdraft_debt(), UNITS_MAX - 100);
    // 100 more: the debt reaches the unit maximum exactly.
    let ShardSettleOutcome::Settled(_) = h.settle("rl-2", "op-rl-2", 150) else {
        panic!("a debt of exactly the unit maximum settles");
    };
    assert_eq!(h.book.overdraft_debt(), UNITS_MAX);
    // One unit more would pass it.
    assert_eq!(
        h.settle("rl-3", "op-rl-3", 51),
        ShardSettleOutcome::Overflow(ledger::Overflow)
    );
    let ShardSettleOutcome::Settled(_) = h.settle("rl-3", "op-rl-3", 50) else {
        panic!("no overage, no new debt");
    };
}

#[test]
fn a_shard_id_taken_by_another_gateway_is_refused_not_returned() {
    // docs/design.md §5.3: a repeat returns the same shard only to the
    // gateway boot that asked for it; another gateway's request with the
    // same ID (even the same boot nonce and pair) is refused.
    let mut h = Harness::with_policy(policy(31));
    let boot = boot_gateway(&mut h, 1);
    let shard = h.issued("s1", &gateway_signer(), boot, nonce(1));
    assert_eq!(
        h.issue("s1", &gateway_signer(), boot, nonce(1)),
        IssueShardOutcome::Duplicate(Box::new(shard))
    );
    let other = support::other_gateway_signer();
    h.enroll(&other);
    let other_boot = h.register(&other, nonce(1));
    assert_eq!(
        h.issue("s1", &other, other_boot, nonce(1)),
        IssueShardOutcome::ShardIdTaken
    );
}
