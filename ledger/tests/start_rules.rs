//! Start binds one operation, exactly once (docs/design.md §3.4): a
//! repeated start with the same operation gets the same receipt back, a
//! start with another operation is a conflict naming the bound one.

mod support;

use ledger::StartOutcome;
use shard_format::ReservationState;
use support::{Harness, op, policy};

#[test]
fn a_repeated_start_is_a_duplicate_another_operation_a_conflict() {
    let mut h = Harness::with_policy(policy(31));
    h.reserved("rl-1", 100);
    let started = h.started("rl-1", "op-1");
    assert_eq!(started.state, ReservationState::Started);
    h.at(10);
    assert_eq!(h.start("rl-1", "op-1"), StartOutcome::Duplicate(started));
    assert_eq!(
        h.start("rl-1", "op-2"),
        StartOutcome::OperationConflict { bound: op("op-1") }
    );
}
