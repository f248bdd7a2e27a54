//! Settlement happens exactly once (docs/design.md §3.4, §4.4): a replayed
//! settle gets the same receipt back and books nothing again, debt
//! included.

mod support;

use ledger::SettleOutcome;
use support::{Harness, pair, policy};

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
