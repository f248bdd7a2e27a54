//! `Retry-After` under a policy that never refills (docs/design.md §4.5): a
//! concurrency limit gives units back as holds end, so a capacity
//! rejection says `holdTtlMs` (rounded up to whole seconds) when what is
//! held would cover the request — not the months until the next epoch.

mod support;

use ledger::Dimension;
use shard_format::{AdmissionBudgetV1, Refill};
use support::{Harness, T0_MS, policy, rejected};

/// Three concurrent requests at a time: opening and burst 3, no refill, a
/// long epoch (a year), holds of 2.5 s.
fn concurrency_policy() -> AdmissionBudgetV1 {
    let mut policy = policy(1);
    policy.opening = 3;
    policy.burst = 3;
    policy.reservation_units_max = 3;
    policy.overdraft_units_max = 0;
    policy.emergency_shard_units = 1;
    policy.refill = Refill {
        units: 0,
        interval_ms: 1000,
    };
    policy.accounting_epoch_ms = 365 * 24 * 3_600_000;
    policy.hold_ttl_ms = 2_500;
    policy
}

#[test]
fn a_full_concurrency_limit_says_the_hold_time_not_the_next_epoch() {
    let mut h = Harness::with_policy(concurrency_policy());
    for id in ["rl-1", "rl-2", "rl-3"] {
        h.reserved(id, 1);
    }
    let rejection = rejected(h.reserve("rl-4", 1));
    assert_eq!(rejection.dimension, Dimension::Capacity);
    // 2.5 s of hold, rounded up.
    assert_eq!(rejection.retry_after_seconds, Some(3));
}

#[test]
fn holds_that_could_never_cover_the_request_give_the_next_epoch() {
    let mut h = Harness::with_policy(concurrency_policy());
    h.reserved("rl-1", 1);
    // 2 available + 1 held cover 3, but not 4 (above the opening too: no
    // horizon at all).
    assert_eq!(
        rejected(h.reserve("rl-big", 4)).dimension,
        Dimension::ReservationUnitsMax
    );
    // Settled units never come back: with all 3 spent, only the next epoch
    // opens more.
    h.started("rl-1", "op-1");
    h.settled("rl-1", "op-1", 1);
    h.reserved("rl-2", 2);
    h.started("rl-2", "op-2");
    h.settled("rl-2", "op-2", 2);
    let rejection = rejected(h.reserve("rl-3", 1));
    assert_eq!(rejection.dimension, Dimension::Capacity);
    // Epochs start at multiples of their length since the Unix epoch.
    let epoch_ms = concurrency_policy().accounting_epoch_ms;
    let next_epoch_ms = (T0_MS / epoch_ms + 1) * epoch_ms;
    assert_eq!(
        rejection.retry_after_seconds,
        Some((next_epoch_ms - T0_MS).div_ceil(1000))
    );
}
