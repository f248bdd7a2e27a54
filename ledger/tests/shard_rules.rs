//! One test per rule of an emergency shard's local book (docs/design.md §5),
//! named after it. The numbers are docs/design.md §4.7 steps 8–10 and 12,
//! written as there:
//!
//! ```text
//! allocated = localAvailable + localReserved + localSpent + localRetired
//! ```
//!
//! Every operation runs through `support::ShardHarness`, which checks the
//! shard equation after it, asserts that refusals, conflicts and duplicates
//! journaled nothing and left the book as it was, and rebuilds the book from
//! its journal.

mod support;

use ledger::invariants::Violation;
use ledger::{
    ShardChange, ShardLedger, ShardReleaseOutcome, ShardReserveOutcome, ShardSettleOutcome,
    ShardStartOutcome, ShardTerms,
};
use shard_format::limits::UNITS_MAX;
use shard_format::{ReservationState, ShardCloseReason, sign_document, verify_document};
use support::{ShardHarness, at, gateway_signer, identity, op, rid, signed_shard, verifier};

/// Hold of every local reservation here: 30 s of the agent's clock.
const HOLD_MS: u64 = 30_000;

/// docs/design.md §4.7 steps 8–9 on the book: open S1 (200), reserve 120,
/// settle 50, reserve 40 and start it; the executor's outcome is unknown.
fn partitioned() -> ShardHarness {
    // 8. The shard arrives: everything available.
    let mut h = ShardHarness::open(signed_shard(200));
    h.assert_terms("200 = 200 + 0 + 0 + 0");

    // 9. Partitioned.
    let ShardReserveOutcome::Reserved(first) = h.reserve("rl-1", 120, HOLD_MS) else {
        panic!("120 of 200 are available");
    };
    assert_eq!(first.state, ReservationState::Reserved);
    assert_eq!(first.expires_at_ms, HOLD_MS);
    h.assert_terms("200 = 80 + 120 + 0 + 0");
    h.at(1_000);
    let ShardStartOutcome::Started(_) = h.start("rl-1", "op-1") else {
        panic!("a held reservation starts");
    };
    h.at(2_000);
    let ShardSettleOutcome::Settled(settled) = h.settle("rl-1", "op-1", 50) else {
        panic!("a started reservation settles");
    };
    assert_eq!(settled.state, ReservationState::Settled);
    assert_eq!(settled.actual_units, Some(50));
    assert_eq!(settled.overdraft_units, 0);
    h.assert_terms("200 = 150 + 0 + 50 + 0");
    h.at(3_000);
    let ShardReserveOutcome::Reserved(_) = h.reserve("rl-2", 40, HOLD_MS) else {
        panic!("40 of 150 are available");
    };
    let ShardStartOutcome::Started(_) = h.start("rl-2", "op-2") else {
        panic!("a held reservation starts");
    };
    h.assert_terms("200 = 110 + 40 + 50 + 0");
    h
}

#[test]
fn partitioned_reserve_settle_start_then_restart_closes() {
    let mut h = partitioned();

    // 10. g-a restarts: S1 is closed. The 110 available are confirmed
    //     unused, the 40 in flight are unknown; both move to retired.
    let closure = h.close(ShardCloseReason::Restart, at(4_000));
    assert_eq!(closure.reason, ShardCloseReason::Restart);
    assert_eq!(closure.closed_at, at(4_000));
    assert_eq!(closure.confirmed_unused_units, 110);
    assert_eq!(closure.unknown_units, 40);
    h.assert_terms("200 = 0 + 0 + 50 + 150");
    assert!(h.book.is_closed());

    // Terminal receipt: spent 50, confirmed unused 110, unknown 40, debt 0,
    // bound to the shard's gateway and boot.
    let mut receipt = h.book.terminal_receipt().expect("the shard is closed");
    assert_eq!(receipt.shard, h.book.shard().shard);
    assert_eq!(receipt.allocated_units, 200);
    assert_eq!(receipt.spent_units, 50);
    assert_eq!(receipt.confirmed_unused_units, 110);
    assert_eq!(receipt.unknown_units, 40);
    assert_eq!(receipt.overdraft_debt_units, 0);
    assert_eq!(receipt.reason, ShardCloseReason::Restart);
    assert_eq!(receipt.boot_epoch, 4);
    assert_eq!(receipt.gateway_identity, identity(&gateway_signer()));
    let gateway = gateway_signer();
    sign_document(&mut receipt, &gateway);
    verify_document(&receipt, &verifier(&[&gateway])).expect("signed by g-a");
    shard_format::Document::validate(&receipt).expect("the receipt's own equation holds");

    // The 40 stay retired even if their operation receipt later shows 30
    // used: the closed book is final.
    assert_eq!(h.settle("rl-2", "op-2", 30), ShardSettleOutcome::Closed);
    h.assert_terms("200 = 0 + 0 + 50 + 150");
    assert_eq!(
        h.book
            .terminal_receipt()
            .map(|unsigned| unsigned.unknown_units),
        Some(40)
    );
}

#[test]
fn overage_gives_the_last_units_and_travels_as_debt() {
    // 12. At local available 150, reserve 100 and settle it at 180.
    let mut h = ShardHarness::open(signed_shard(200));
    let _ = h.reserve("rl-1", 120, HOLD_MS);
    let _ = h.start("rl-1", "op-1");
    let _ = h.settle("rl-1", "op-1", 50);
    h.assert_terms("200 = 150 + 0 + 50 + 0");
    let ShardReserveOutcome::Reserved(_) = h.reserve("rl-2", 100, HOLD_MS) else {
        panic!("100 of 150 are available");
    };
    h.assert_terms("200 = 50 + 100 + 50 + 0");
    let _ = h.start("rl-2", "op-2");
    let ShardSettleOutcome::Settled(settled) = h.settle("rl-2", "op-2", 180) else {
        panic!("an overage still settles");
    };
    // The shard gives its last 50; the 30 beyond it are debt.
    assert_eq!(settled.state, ReservationState::SettledWithDebt);
    assert_eq!(settled.overdraft_units, 30);
    h.assert_terms("200 = 0 + 0 + 200 + 0");
    assert_eq!(h.book.overdraft_debt(), 30);
    assert!(h.book.is_paused());

    // Local admission for the pair pauses, even for what would fit.
    assert_eq!(h.reserve("rl-3", 1, HOLD_MS), ShardReserveOutcome::Paused);
    // A repeat of the settle is a duplicate; another amount a conflict.
    assert_eq!(
        h.settle("rl-2", "op-2", 180),
        ShardSettleOutcome::Duplicate(settled.clone())
    );
    assert_eq!(
        h.settle("rl-2", "op-2", 190),
        ShardSettleOutcome::SettlementConflict(settled)
    );
    assert_eq!(h.book.overdraft_debt(), 30);

    // The debt travels in the terminal receipt.
    let _ = h.close(ShardCloseReason::Reconnect, at(5_000));
    h.assert_terms("200 = 0 + 0 + 200 + 0");
    let receipt = h.book.terminal_receipt().expect("closed");
    assert_eq!(receipt.spent_units, 200);
    assert_eq!(receipt.confirmed_unused_units, 0);
    assert_eq!(receipt.unknown_units, 0);
    assert_eq!(receipt.overdraft_debt_units, 30);
}

#[test]
fn local_started_vs_expired() {
    let mut h = ShardHarness::open(signed_shard(200));

    // Start before the sweep: the start wins; the sweep never takes a
    // STARTED item.
    let _ = h.reserve("rl-start-first", 10, 1_000);
    h.at(999);
    let ShardStartOutcome::Started(started) = h.start("rl-start-first", "op-1") else {
        panic!("the hold has not run out");
    };
    assert_eq!(started.state, ReservationState::Started);
    h.at(1_000);
    assert_eq!(h.expire_due(), vec![]);
    h.at(60_000);
    assert_eq!(h.expire_due(), vec![]);
    h.assert_terms("200 = 190 + 10 + 0 + 0");

    // The sweep before the start: the start finds it expired.
    h.at(100_000);
    let _ = h.reserve("rl-expire-first", 20, 1_000);
    h.assert_terms("200 = 170 + 30 + 0 + 0");
    h.at(101_000);
    assert_eq!(h.expire_due(), vec![rid("rl-expire-first")]);
    h.assert_terms("200 = 190 + 10 + 0 + 0");
    let expired = h
        .book
        .reservation(&rid("rl-expire-first"))
        .expect("kept")
        .clone();
    assert_eq!(expired.state, ReservationState::Expired);
    assert_eq!(
        h.start("rl-expire-first", "op-2"),
        ShardStartOutcome::Expired(expired)
    );
    h.assert_terms("200 = 190 + 10 + 0 + 0");

    // A start at the end of the hold loses even before any sweep, and
    // gives the units back itself, once.
    h.at(200_000);
    let _ = h.reserve("rl-late-start", 30, 1_000);
    h.at(201_000);
    let ShardStartOutcome::Expired(late) = h.start("rl-late-start", "op-3") else {
        panic!("a start at expiresAt must lose");
    };
    assert_eq!(late.state, ReservationState::Expired);
    assert_eq!(late.operation_id, None);
    h.assert_terms("200 = 190 + 10 + 0 + 0");
    assert_eq!(h.expire_due(), vec![]);
    h.assert_terms("200 = 190 + 10 + 0 + 0");

    // An expired item neither releases nor settles.
    assert_eq!(
        h.release("rl-late-start"),
        ShardReleaseOutcome::IllegalState(ReservationState::Expired)
    );
    assert_eq!(
        h.settle("rl-late-start", "op-3", 5),
        ShardSettleOutcome::IllegalState(ReservationState::Expired)
    );
}

#[test]
fn closed_shard_refuses_everything() {
    let mut h = ShardHarness::open(signed_shard(200));
    let _ = h.reserve("rl-held", 50, HOLD_MS);
    let _ = h.reserve("rl-running", 30, HOLD_MS);
    let _ = h.start("rl-running", "op-1");
    h.assert_terms("200 = 120 + 80 + 0 + 0");
    let closure = h.close(ShardCloseReason::ValidityEnded, at(10_000));
    // Whatever is in flight is unknown, never confirmed unused.
    assert_eq!(closure.confirmed_unused_units, 120);
    assert_eq!(closure.unknown_units, 80);
    h.assert_terms("200 = 0 + 0 + 0 + 200");
    let receipt = h.book.terminal_receipt().expect("closed");

    assert_eq!(
        h.reserve("rl-new", 10, HOLD_MS),
        ShardReserveOutcome::Closed
    );
    assert_eq!(h.start("rl-held", "op-2"), ShardStartOutcome::Closed);
    assert_eq!(h.release("rl-held"), ShardReleaseOutcome::Closed);
    assert_eq!(
        h.settle("rl-running", "op-1", 20),
        ShardSettleOutcome::Closed
    );
    assert!(!h.mark_usage_unknown("rl-running"));
    h.at(HOLD_MS + 1);
    assert_eq!(h.expire_due(), vec![]);
    // Closing again keeps the first closure and changes nothing.
    let before = h.journal.len();
    assert_eq!(h.close(ShardCloseReason::Restart, at(20_000)), closure);
    assert_eq!(h.journal.len(), before);
    h.assert_terms("200 = 0 + 0 + 0 + 200");
    assert_eq!(h.book.terminal_receipt(), Some(receipt));
}

#[test]
fn from_records_rebuilds_the_same_book() {
    // The harness rebuilds after every step; here the whole journal of
    // steps 8–10 rebuilds the closed book, and a journal that breaks the
    // equation refuses to load.
    let mut h = partitioned();
    let open = h.rebuilt();
    assert_eq!(open, h.book);
    assert!(!open.is_closed());
    let _ = h.close(ShardCloseReason::Restart, at(4_000));
    let closed = h.rebuilt();
    assert_eq!(closed, h.book);
    assert_eq!(closed.terminal_receipt(), h.book.terminal_receipt());
    assert_eq!(
        closed.reservation(&rid("rl-2")).map(|r| r.state),
        Some(ReservationState::Started)
    );

    let mut corrupt = h.journal.clone();
    corrupt.push(ShardChange::Book {
        terms: ShardTerms {
            allocated: 200,
            local_available: 1,
            local_reserved: 0,
            local_spent: 50,
            local_retired: 150,
        },
        overdraft_debt: 0,
        closure: h.book.closure().copied(),
    });
    let error = ShardLedger::from_records(h.book.shard().clone(), corrupt)
        .expect_err("a book off by one unit must not load");
    assert!(matches!(*error, Violation::ShardEquation { .. }));
}

#[test]
fn shard_reserve_is_idempotent_and_bounded() {
    let mut h = ShardHarness::open(signed_shard(200));
    for units in [0, UNITS_MAX + 1, u64::MAX] {
        assert_eq!(
            h.reserve("rl-bad", units, HOLD_MS),
            ShardReserveOutcome::InvalidUnits
        );
    }
    assert_eq!(
        h.reserve("rl-big", 201, HOLD_MS),
        ShardReserveOutcome::Capacity {
            local_available: 200
        }
    );
    let ShardReserveOutcome::Reserved(first) = h.reserve("rl-1", 150, HOLD_MS) else {
        panic!("150 of 200 are available");
    };
    assert_eq!(
        h.reserve("rl-1", 150, HOLD_MS),
        ShardReserveOutcome::Duplicate(first)
    );
    assert_eq!(
        h.reserve("rl-2", 51, HOLD_MS),
        ShardReserveOutcome::Capacity {
            local_available: 50
        }
    );
    h.assert_terms("200 = 50 + 150 + 0 + 0");
}

#[test]
fn shard_release_only_from_reserved() {
    let mut h = ShardHarness::open(signed_shard(200));
    let _ = h.reserve("rl-1", 100, HOLD_MS);
    let ShardReleaseOutcome::Released(released) = h.release("rl-1") else {
        panic!("a RESERVED item releases");
    };
    assert_eq!(released.state, ReservationState::Released);
    h.assert_terms("200 = 200 + 0 + 0 + 0");
    assert_eq!(h.release("rl-1"), ShardReleaseOutcome::Duplicate(released));
    assert_eq!(
        h.start("rl-1", "op-1"),
        ShardStartOutcome::IllegalState(ReservationState::Released)
    );

    let _ = h.reserve("rl-2", 100, HOLD_MS);
    assert_eq!(
        h.settle("rl-2", "op-2", 10),
        ShardSettleOutcome::NotStarted(ReservationState::Reserved)
    );
    let _ = h.start("rl-2", "op-2");
    assert_eq!(
        h.start("rl-2", "op-other"),
        ShardStartOutcome::OperationConflict { bound: op("op-2") }
    );
    assert_eq!(
        h.release("rl-2"),
        ShardReleaseOutcome::IllegalState(ReservationState::Started)
    );
    assert_eq!(
        h.settle("rl-2", "op-other", 10),
        ShardSettleOutcome::OperationConflict { bound: op("op-2") }
    );
    assert_eq!(h.release("rl-unknown"), ShardReleaseOutcome::NotFound);
    assert_eq!(h.start("rl-unknown", "op-3"), ShardStartOutcome::NotFound);
    assert_eq!(
        h.settle("rl-unknown", "op-3", 1),
        ShardSettleOutcome::NotFound
    );
    h.assert_terms("200 = 100 + 100 + 0 + 0");
}

#[test]
fn usage_unknown_stays_reserved_until_a_receipt_or_the_close() {
    let mut h = ShardHarness::open(signed_shard(200));
    let _ = h.reserve("rl-1", 60, HOLD_MS);
    let _ = h.start("rl-1", "op-1");
    let _ = h.reserve("rl-2", 40, HOLD_MS);
    let _ = h.start("rl-2", "op-2");
    // The executor's deadlines pass: the units stay reserved.
    assert!(h.mark_usage_unknown("rl-1"));
    assert!(h.mark_usage_unknown("rl-2"));
    assert!(!h.mark_usage_unknown("rl-2"), "once");
    h.at(HOLD_MS * 10);
    assert_eq!(h.expire_due(), vec![]);
    h.assert_terms("200 = 100 + 100 + 0 + 0");
    assert_eq!(
        h.release("rl-1"),
        ShardReleaseOutcome::IllegalState(ReservationState::UsageUnknown)
    );

    // Only an operation receipt ends it.
    let ShardSettleOutcome::Settled(settled) = h.settle("rl-1", "op-1", 45) else {
        panic!("an operation receipt settles USAGE_UNKNOWN");
    };
    assert_eq!(settled.state, ReservationState::Settled);
    h.assert_terms("200 = 115 + 40 + 45 + 0");

    // Or the close, which counts it as unknown, never as unused.
    let closure = h.close(ShardCloseReason::Reconnect, at(1_000));
    assert_eq!(closure.unknown_units, 40);
    assert_eq!(closure.confirmed_unused_units, 115);
    h.assert_terms("200 = 0 + 0 + 45 + 155");
}

#[test]
fn shard_overflow_is_a_named_rejection() {
    // Units outside the documents' range are refused by name and change
    // nothing, so that the terminal receipt always stays a valid
    // `shardTerminalReceipt.v1` the central ledger can reconcile.
    let mut h = ShardHarness::open(signed_shard(200));
    for units in [UNITS_MAX + 1, u64::MAX] {
        assert_eq!(
            h.reserve("rl-bad", units, HOLD_MS),
            ShardReserveOutcome::InvalidUnits
        );
    }
    let _ = h.reserve("rl-1", 100, HOLD_MS);
    let _ = h.start("rl-1", "op-1");
    let _ = h.reserve("rl-2", 50, HOLD_MS);
    let _ = h.start("rl-2", "op-2");
    h.assert_terms("200 = 50 + 150 + 0 + 0");
    for actual in [UNITS_MAX + 1, u64::MAX] {
        assert!(
            matches!(
                h.settle("rl-1", "op-1", actual),
                ShardSettleOutcome::Overflow(_)
            ),
            "actual {actual} is above UNITS_MAX"
        );
    }
    h.assert_terms("200 = 50 + 150 + 0 + 0");
    assert_eq!(h.book.overdraft_debt(), 0);

    // The largest actual is accepted; debt that would leave the range is not.
    let ShardSettleOutcome::Settled(_) = h.settle("rl-1", "op-1", UNITS_MAX) else {
        panic!("UNITS_MAX is a valid actual");
    };
    h.assert_terms("200 = 0 + 50 + 150 + 0");
    assert_eq!(h.book.overdraft_debt(), UNITS_MAX - 150);
    assert!(
        matches!(
            h.settle("rl-2", "op-2", UNITS_MAX),
            ShardSettleOutcome::Overflow(_)
        ),
        "the receipt's debt would exceed UNITS_MAX"
    );
    let _ = h.close(ShardCloseReason::Reconnect, at(1_000));
    let receipt = h.book.terminal_receipt().expect("closed");
    shard_format::Document::validate(&receipt)
        .expect("every accepted settle keeps the terminal receipt valid");
}
