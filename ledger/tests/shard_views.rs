//! What a shard's book shows the agent (docs/design.md §4.6, §5.8): its
//! reservations, the next hold to expire and its closure. The agent core
//! schedules its timer and builds its status from these.

mod support;

use ledger::{ShardReleaseOutcome, ShardReserveOutcome, ShardSettleOutcome, ShardStartOutcome};
use shard_format::ShardCloseReason;
use support::{ShardHarness, at, rid, signed_shard};

#[test]
fn next_expiry_is_the_earliest_hold_still_reserved() {
    let mut h = ShardHarness::open(signed_shard(200));
    assert_eq!(h.book.next_expiry_ms(), None, "nothing held");
    h.at(5);
    let ShardReserveOutcome::Reserved(_) = h.reserve("rl-long", 10, 9_000) else {
        panic!("10 of 200 are available");
    };
    let ShardReserveOutcome::Reserved(_) = h.reserve("rl-short", 10, 2_000) else {
        panic!("10 of 190 are available");
    };
    assert_eq!(h.book.next_expiry_ms(), Some(2_005));
    // A started item no longer expires.
    let ShardStartOutcome::Started(_) = h.start("rl-short", "op-1") else {
        panic!("a held reservation starts");
    };
    assert_eq!(h.book.next_expiry_ms(), Some(9_005));
    let ids: Vec<_> = h
        .book
        .reservations()
        .map(|reservation| reservation.reservation.clone())
        .collect();
    assert_eq!(ids.len(), 2);
    assert!(ids.contains(&rid("rl-long")) && ids.contains(&rid("rl-short")));
}

#[test]
fn closure_is_shown_once_the_shard_is_closed() {
    let mut h = ShardHarness::open(signed_shard(200));
    assert_eq!(h.book.closure(), None);
    let closure = h.close(ShardCloseReason::ValidityEnded, at(600_000));
    assert_eq!(h.book.closure(), Some(&closure));
    assert_eq!(closure.reason, ShardCloseReason::ValidityEnded);
    assert_eq!(closure.confirmed_unused_units, 200);
}

/// The holds a close ends: RESERVED and STARTED ones, and no other. The
/// agent finds a closing shard's reservations by them.
#[test]
fn open_holds_are_the_reserved_and_the_started() {
    let mut h = ShardHarness::open(signed_shard(200));
    for id in [
        "rl-held",
        "rl-running",
        "rl-settled",
        "rl-released",
        "rl-unknown",
    ] {
        let ShardReserveOutcome::Reserved(_) = h.reserve(id, 10, 9_000) else {
            panic!("10 units are available for {id}");
        };
    }
    for id in ["rl-running", "rl-settled", "rl-unknown"] {
        let ShardStartOutcome::Started(_) = h.start(id, "op-1") else {
            panic!("{id} starts");
        };
    }
    let ShardSettleOutcome::Settled(_) = h.settle("rl-settled", "op-1", 4) else {
        panic!("a started hold settles");
    };
    let ShardReleaseOutcome::Released(_) = h.release("rl-released") else {
        panic!("a held reservation is released");
    };
    assert!(h.mark_usage_unknown("rl-unknown"));
    let open_holds = |h: &ShardHarness| {
        let mut ids: Vec<_> = h.book.book().open_holds().cloned().collect();
        ids.sort_unstable();
        ids
    };
    assert_eq!(open_holds(&h), [rid("rl-held"), rid("rl-running")]);
    assert_eq!(
        (
            h.book.book().reserved_holds(),
            h.book.book().started_holds()
        ),
        (1, 1)
    );
    // A rebuilt book lists the same.
    assert_eq!(h.rebuilt().book().open_holds().count(), 2);
    let ShardStartOutcome::Started(_) = h.start("rl-held", "op-2") else {
        panic!("a held reservation starts");
    };
    assert_eq!(open_holds(&h), [rid("rl-held"), rid("rl-running")]);
    assert_eq!(
        (
            h.book.book().reserved_holds(),
            h.book.book().started_holds()
        ),
        (0, 2)
    );
}
