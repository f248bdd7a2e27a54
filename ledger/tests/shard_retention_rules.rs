//! Retention of reconciled shards and of settlements beside debt
//! (docs/design.md §3.10): a record that made debt stays while that debt
//! is owed; a record that made none goes when its window ends, whatever
//! else its account owes; what a forgotten shard accounted for stays in
//! its pair's history.

mod support;

use ledger::{ForgetOutcome, RETENTION_DEFAULT_MS, ReconcileOutcome};
use shard_format::{ShardCloseReason, sign_document};
use support::{Harness, at, gateway_signer, nonce, op, pair, policy, rid, verifier};

const WINDOW: u64 = RETENTION_DEFAULT_MS;

fn forget(h: &mut Harness) -> ForgetOutcome {
    h.run(|ledger, now| ledger.forget_expired(now))
}

#[test]
fn a_reconciled_shard_with_debt_stays_until_repaid_then_leaves_its_history() {
    let mut h = Harness::with_policy(policy(31));
    h.enroll(&gateway_signer());
    let boot = h.register(&gateway_signer(), nonce(1));
    let shard = h.issued("s1", &gateway_signer(), boot, nonce(1));
    // Partitioned: all 200 reserved and settled at 250, 50 of receipt debt.
    let (mut book, _) = ledger::ShardLedger::open(shard);
    let _ = book.reserve(rid("rl-1"), 200, 30_000, 0);
    let _ = book.start(&rid("rl-1"), op("op-1"), 1);
    let _ = book.settle(&rid("rl-1"), &op("op-1"), 250);
    let _ = book.close(ShardCloseReason::Restart, at(50));
    let mut receipt = book.terminal_receipt().expect("closed");
    assert_eq!(receipt.overdraft_debt_units, 50);
    sign_document(&mut receipt, &gateway_signer());
    h.at(100);
    let ReconcileOutcome::Reconciled(_) = h.reconcile(&receipt, &verifier(&[&gateway_signer()]))
    else {
        panic!("the receipt reconciles");
    };
    assert_eq!(h.ledger.pair_debt(&pair()), 50);

    // Past the window, the debt still owed keeps the shard.
    h.at(100 + WINDOW);
    assert_eq!(forget(&mut h), ForgetOutcome::default());
    // Repaid, it goes, and its account folds with what the shard
    // accounted for.
    h.refill();
    assert_eq!(h.ledger.pair_debt(&pair()), 0);
    assert_eq!(
        forget(&mut h),
        ForgetOutcome {
            shards: 1,
            accounts_folded: 1,
            ..ForgetOutcome::default()
        }
    );
    let forgotten = h
        .ledger
        .pair(&pair())
        .expect("pair")
        .closed_history
        .forgotten;
    assert_eq!(forgotten.shards, 1);
    assert_eq!(forgotten.spent, 50);
    assert_eq!(forgotten.overdraft_issued, 50);
    assert_eq!(forgotten.shard_units, 200);
}

#[test]
fn a_settlement_without_debt_goes_while_its_account_owes_other_debt() {
    let mut h = Harness::with_policy(policy(31));
    h.reserved("rl-clean", 100);
    h.started("rl-clean", "op-clean");
    h.settled("rl-clean", "op-clean", 100);
    h.reserved("rl-debt", 800);
    h.started("rl-debt", "op-debt");
    // 800 + the 100 available + 50 of debt.
    assert_eq!(h.settled("rl-debt", "op-debt", 950).overdraft_units, 50);

    h.at(WINDOW);
    assert_eq!(
        forget(&mut h),
        ForgetOutcome {
            reservations: 1,
            ..ForgetOutcome::default()
        }
    );
    assert!(h.ledger.reservation(&rid("rl-clean")).is_none());
    assert!(h.ledger.reservation(&rid("rl-debt")).is_some());
}

#[test]
fn a_reconciled_shard_without_debt_goes_while_its_account_owes_other_debt() {
    let mut h = Harness::with_policy(policy(31));
    h.enroll(&gateway_signer());
    let boot = h.register(&gateway_signer(), nonce(1));
    let shard = h.issued("s1", &gateway_signer(), boot, nonce(1));
    let (mut book, _) = ledger::ShardLedger::open(shard);
    let _ = book.close(ShardCloseReason::Restart, at(50));
    let mut receipt = book.terminal_receipt().expect("closed");
    sign_document(&mut receipt, &gateway_signer());
    h.at(100);
    let ReconcileOutcome::Reconciled(_) = h.reconcile(&receipt, &verifier(&[&gateway_signer()]))
    else {
        panic!("the receipt reconciles");
    };
    // Then debt from a settlement: 800 + the 200 available + 50.
    h.reserved("rl-debt", 800);
    h.started("rl-debt", "op-debt");
    assert_eq!(h.settled("rl-debt", "op-debt", 1050).overdraft_units, 50);

    h.at(100 + WINDOW);
    assert_eq!(
        forget(&mut h),
        ForgetOutcome {
            shards: 1,
            ..ForgetOutcome::default()
        }
    );
    assert!(h.ledger.reservation(&rid("rl-debt")).is_some());
}

#[test]
fn an_older_generation_folds_within_the_current_epoch() {
    // Week-long epochs: the window ends inside the same epoch, so only the
    // newer generation makes generation 31's account closed.
    let week = |generation| {
        let mut weekly = policy(generation);
        weekly.accounting_epoch_ms = 7 * 24 * 3_600_000;
        weekly
    };
    let mut h = Harness::with_policy(week(31));
    h.reserved("rl-1", 100);
    h.started("rl-1", "op-1");
    h.settled("rl-1", "op-1", 100);
    h.at(10);
    h.publish(week(32));
    h.at(WINDOW);
    assert_eq!(
        ledger::epoch_start(at(0), 7 * 24 * 3_600_000),
        ledger::epoch_start(at(WINDOW), 7 * 24 * 3_600_000),
        "the same epoch"
    );
    assert_eq!(
        forget(&mut h),
        ForgetOutcome {
            reservations: 1,
            accounts_folded: 1,
            ..ForgetOutcome::default()
        }
    );
    let history = h.ledger.pair(&pair()).expect("pair").closed_history;
    assert_eq!(history.accounts, 1);
    assert_eq!(history.terms.spent, 100);
}
