//! The retention window (docs/design.md, "Retention"): what the sweep
//! forgets, when, what it keeps, and that the audit stays exact over a
//! pair's whole life. Every operation runs through `support::Harness`
//! (audit after each step, rebuild from the committed changes).

mod support;

use ledger::{
    AbandonOutcome, CentralConfig, CentralLedger, Change, ForgetOutcome, PublishOutcome,
    RETENTION_DEFAULT_MS, RETENTION_MARGIN_MS, ReserveOutcome, SettleOutcome,
};
use shard_format::ReservationState;
use support::{Harness, policy, request, rid};

const WINDOW: u64 = RETENTION_DEFAULT_MS;

fn forget(h: &mut Harness) -> ForgetOutcome {
    h.run(|ledger, now| ledger.forget_expired(now))
}

/// `rl-a`: 100 reserved at T0 + 0 ms, started and settled at 60 at 1 s.
fn settled_story() -> Harness {
    let mut h = Harness::with_policy(policy(1));
    h.reserved("rl-a", 100);
    h.at(1_000);
    h.started("rl-a", "op-a");
    h.settled("rl-a", "op-a", 60);
    h
}

#[test]
fn a_settled_reservation_is_replayed_within_the_window_and_forgotten_after_it() {
    let mut h = settled_story();
    // One millisecond before the window has passed: kept, and a retry is
    // answered from the record.
    h.at(1_000 + WINDOW - 1);
    assert_eq!(forget(&mut h), ForgetOutcome::default());
    assert!(matches!(
        h.reserve("rl-a", 100),
        ReserveOutcome::Duplicate(receipt) if receipt.state == ReservationState::Settled
    ));
    // Exactly at the window's end: forgotten, and the epoch's account,
    // which nothing refers to any more, folds into the closed history with
    // what the settlement spent.
    h.at(1_000 + WINDOW);
    assert_eq!(
        forget(&mut h),
        ForgetOutcome {
            reservations: 1,
            accounts_folded: 1,
            ..ForgetOutcome::default()
        }
    );
    assert!(h.ledger.reservation(&rid("rl-a")).is_none());
    let history = h
        .ledger
        .pair(&support::pair())
        .expect("pair")
        .closed_history;
    assert_eq!(history.terms.spent, 60);
    assert_eq!(history.forgotten.spent, 60);
    assert_eq!(history.forgotten.reservations, 1);
    // After the window the same key is a new request.
    assert!(matches!(
        h.reserve("rl-a", 100),
        ReserveOutcome::Reserved(_)
    ));
}

/// The gauges read counts kept as the records change, not a pass over
/// them: a reservation counts live, then retained, then not at all, and a
/// rebuilt ledger counts the same.
#[test]
fn the_gauges_count_a_reservation_live_then_retained_then_not_at_all() {
    let counts = |h: &Harness| {
        let gauges = ledger::protocol::views::gauges(&h.ledger);
        (gauges.reservations_live, gauges.reservations_retained)
    };
    let mut h = Harness::with_policy(policy(1));
    assert_eq!(counts(&h), (0, 0));
    h.reserved("rl-a", 100);
    h.reserved("rl-b", 100);
    assert_eq!(counts(&h), (2, 0));
    h.at(1_000);
    h.started("rl-a", "op-a");
    assert_eq!(counts(&h), (2, 0), "started is still live");
    h.settled("rl-a", "op-a", 60);
    assert_eq!(counts(&h), (1, 1));
    let rebuilt = CentralLedger::from_records(CentralConfig::default(), h.records())
        .expect("the records load");
    assert_eq!(rebuilt.record_counts(), h.ledger.record_counts());
    h.at(1_000 + WINDOW);
    assert_eq!(forget(&mut h).reservations, 1);
    assert_eq!(counts(&h), (1, 0));
}

#[test]
fn a_tombstone_lasts_exactly_the_window() {
    let mut h = Harness::with_policy(policy(1));
    let tombstones = |h: &Harness| ledger::protocol::views::gauges(&h.ledger).tombstones;
    h.at(5_000);
    assert_eq!(tombstones(&h), 0);
    assert_eq!(h.abandon("rl-lost"), AbandonOutcome::Tombstoned);
    assert_eq!(h.abandon("rl-also-lost"), AbandonOutcome::Tombstoned);
    h.at(5_000 + WINDOW - 1);
    assert_eq!(forget(&mut h), ForgetOutcome::default());
    assert_eq!(tombstones(&h), 2, "the gauge counts both");
    assert_eq!(
        h.reserve_request(request("rl-lost", 10, "rl-lost")),
        ReserveOutcome::Abandoned
    );
    h.at(5_000 + WINDOW);
    assert_eq!(forget(&mut h).tombstones, 2);
    assert_eq!(tombstones(&h), 0);
    assert!(matches!(
        h.reserve_request(request("rl-lost", 10, "rl-lost")),
        ReserveOutcome::Reserved(_)
    ));
}

#[test]
fn live_reservations_are_never_forgotten() {
    let mut h = Harness::with_policy(policy(1));
    h.reserved("rl-held", 100);
    h.reserved("rl-running", 100);
    h.started("rl-running", "op-r");
    // Long past any window, but nothing ran the expiry or usage workers:
    // both are still live.
    h.at(10 * WINDOW);
    assert_eq!(forget(&mut h), ForgetOutcome::default());
    assert!(h.ledger.reservation(&rid("rl-held")).is_some());
    assert!(h.ledger.reservation(&rid("rl-running")).is_some());
}

#[test]
fn a_settlement_whose_debt_is_owed_stays_until_the_debt_is_repaid() {
    let mut h = Harness::with_policy(policy(1));
    // Everything reserved, then 100 over: 100 of debt.
    h.reserved("rl-d", 800);
    h.reserved("rl-e", 200);
    h.started("rl-d", "op-d");
    let SettleOutcome::Settled(settlement) = h.settle("rl-d", "op-d", 900) else {
        panic!("the overage settles");
    };
    assert_eq!(settlement.overdraft_units, 100);
    h.release("rl-e");
    // The debt is still owed when the window passes: the record stays (it
    // says where the debt came from); the released one goes.
    h.at(WINDOW);
    assert_eq!(
        forget(&mut h),
        ForgetOutcome {
            reservations: 1,
            ..ForgetOutcome::default()
        }
    );
    assert!(h.ledger.reservation(&rid("rl-d")).is_some());
    assert!(h.ledger.reservation(&rid("rl-e")).is_none());
    // Refills of the past window's epoch stay there; the next epoch's
    // opening repays the debt. Then the settlement may go, and the old
    // account folds.
    h.at(WINDOW + 1);
    h.refill();
    assert_eq!(h.ledger.pair_debt(&support::pair()), 0);
    let outcome = forget(&mut h);
    assert_eq!(outcome.reservations, 1);
    assert_eq!(outcome.accounts_folded, 1);
}

#[test]
fn past_accounts_fold_into_a_closed_history_that_balances() {
    let mut h = settled_story();
    h.reserved("rl-b", 50);
    h.release("rl-b");
    let first = h.account_at(support::at(0), 1);
    let terms = h.terms(&first);
    // A day later, in another epoch: both records go, and the epoch's
    // account, which nothing refers to any more, folds.
    h.at(1_000 + WINDOW);
    let outcome = forget(&mut h);
    assert_eq!(outcome.reservations, 2);
    assert_eq!(outcome.accounts_folded, 1);
    assert!(h.ledger.account(&first).is_none());
    let history = h
        .ledger
        .pair(&support::pair())
        .expect("pair")
        .closed_history;
    assert_eq!(history.accounts, 1);
    assert_eq!(history.terms, terms);
    assert_eq!(history.forgotten.spent, 60);
    assert_eq!(history.forgotten.reservations, 2);
    // The audit checks the history's equation: one unit off is a finding.
    let mut records = h.records();
    for change in &mut records {
        if let Change::Pair(pair) = change {
            pair.closed_history.terms.spent += 1;
            pair.closed_history.terms.opening += 1;
        }
    }
    let error = CentralLedger::from_records(CentralConfig::default(), records)
        .expect_err("an unbalanced closed history does not load");
    assert!(error.to_string().contains("closed history"), "{error}");
}

#[test]
fn the_current_account_never_folds() {
    let mut h = settled_story();
    // Within the same epoch (one hour): the record goes, the account stays.
    let config = CentralConfig {
        retention_ms: 120_000,
        ..CentralConfig::default()
    };
    let records = h.records();
    h.ledger = CentralLedger::from_records(config, records).expect("loads");
    h.at(1_000 + 120_000);
    let outcome = h.ledger.forget_expired(h.now).outcome;
    assert_eq!(outcome.reservations, 1);
    assert_eq!(outcome.accounts_folded, 0);
    assert!(h.ledger.account(&h.account(1)).is_some());
}

#[test]
fn a_record_count_that_disagrees_with_the_records_is_an_audit_finding() {
    let h = settled_story();
    let mut records = h.records();
    for change in &mut records {
        if let Change::Account(account) = change {
            account.records = Some(account.records.expect("counted") + 1);
        }
    }
    let error = CentralLedger::from_records(CentralConfig::default(), records)
        .expect_err("a wrong count does not load");
    assert!(error.to_string().contains("records"), "{error}");
}

#[test]
fn accounts_written_before_the_count_existed_are_counted_on_load() {
    let h = settled_story();
    let mut records = h.records();
    for change in &mut records {
        if let Change::Account(account) = change {
            account.records = None;
        }
    }
    let ledger = CentralLedger::from_records(CentralConfig::default(), records).expect("loads");
    let state = ledger
        .account_state(&h.account_at(support::at(0), 1))
        .expect("account");
    assert_eq!(state.records, Some(1));
}

#[test]
fn the_window_must_outlast_every_policy_by_the_margin() {
    let life = policy(1).hold_ttl_ms + policy(1).execution_hard_limit_ms;
    let floor = life + RETENTION_MARGIN_MS;
    let mut h = Harness::with_policy(policy(1));
    assert!(h.ledger.check_retention(floor).is_ok());
    let error = h
        .ledger
        .check_retention(floor - 1)
        .expect_err("one millisecond short");
    assert_eq!(error.floor_ms, floor);
    assert!(
        error.to_string().contains("tenant-7/chat.generate"),
        "{error}"
    );
    // A policy that would outlive the window is refused at publish.
    let mut long = policy(2);
    long.execution_hard_limit_ms = WINDOW - long.hold_ttl_ms - RETENTION_MARGIN_MS + 1;
    assert!(
        matches!(h.publish(long), PublishOutcome::Invalid(message) if message.contains("retention"))
    );
    let mut fits = policy(2);
    fits.execution_hard_limit_ms = WINDOW - fits.hold_ttl_ms - RETENTION_MARGIN_MS;
    assert_eq!(h.publish(fits), PublishOutcome::Published);
}
