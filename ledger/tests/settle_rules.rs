//! Settlement happens exactly once (docs/design.md §3.4, §4.4): a replayed
//! settle gets the same receipt back and books nothing again, debt
//! included.

mod support;

use ledger::{SettleOutcome, StartOutcome};
use support::{Harness, pair, policy, rid};

#[test]
fn a_replayed_settle_with_debt_is_a_duplicate_and_books_the_debt_once() {
    let mut h = Harness::with_policy(policy(31));
    h.reserved("rl-1", 800);
    h.started("rl-1", "op-1");
    // 800 reserved + the 200 available + 50 of debt.
    let receipt = h.settled("rl-1", "op-1", 1050);
    assert_eq!(receipt.overdraft_units, 50);
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 50 = 0 + 0 + 1050 + 0 + 0");
    h.at(10);
    assert_eq!(
        h.settle("rl-1", "op-1", 1050),
        SettleOutcome::Duplicate(receipt)
    );
    h.assert_account(&account, "1000 + 0 + 50 = 0 + 0 + 1050 + 0 + 0");
    assert_eq!(h.ledger.pair_debt(&pair()), 50);
}

/// docs/design.md §3.6: a late genuine receipt corrects a conservative
/// settlement; refills may have filled the bucket since, so the part of
/// the refund above `burst` undoes those mints instead.
#[test]
fn a_correction_refunds_up_to_burst_and_undoes_the_mints_above_it() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    h.reserved("rl-u", 600);
    let StartOutcome::Started(_) = h.start_with_deadline("rl-u", "op-u", Some(5_000)) else {
        panic!("a held reservation starts");
    };
    h.at(5_000);
    assert_eq!(h.usage_deadlines(), vec![rid("rl-u")]);
    h.at(600_000);
    assert_eq!(h.usage_deadlines(), vec![rid("rl-u")]);
    h.assert_account(&account, "1000 + 0 + 0 = 400 + 0 + 600 + 0 + 0");
    // Refills fill the bucket to burst: 600 minted.
    h.refill();
    h.assert_account(&account, "1000 + 600 + 0 = 1000 + 0 + 600 + 0 + 0");
    // 300 spent: room for 300 below burst.
    h.reserved("rl-x", 300);
    h.started("rl-x", "op-x");
    h.settled("rl-x", "op-x", 300);
    h.assert_account(&account, "1000 + 600 + 0 = 700 + 0 + 900 + 0 + 0");

    // The genuine usage was 200: 400 to refund, 300 fit, 100 of the mints
    // are undone.
    let SettleOutcome::Corrected(corrected) = h.settle("rl-u", "op-u", 200) else {
        panic!("a late genuine receipt corrects a conservative settlement");
    };
    assert_eq!(corrected.refunded_units, 400);
    h.assert_account(&account, "1000 + 500 + 0 = 1000 + 0 + 500 + 0 + 0");
}
