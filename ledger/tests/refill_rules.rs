//! Refill and the sweeps' batches (docs/design.md §4.3, §3.6): ticks of a
//! closed epoch are dropped when the next opens, and one sweep moves at
//! most `sweep_batch_max` reservations.

mod support;

use ledger::{CentralConfig, CentralLedger, ReserveOutcome, StartOutcome};
use support::{EPOCH_MS, Harness, at, op, policy, request, rid};

#[test]
fn ticks_of_a_closed_epoch_are_dropped_when_the_next_opens() {
    let mut h = Harness::with_policy(policy(31));
    // Half a second into the next epoch its account opens with 1000.
    h.at(EPOCH_MS + 500);
    h.reserved("rl-1", 800);
    h.started("rl-1", "op-1");
    h.settled("rl-1", "op-1", 800);
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 0 = 200 + 0 + 800 + 0 + 0");
    // One tick since the epoch began, not the 3601 since the last refill.
    h.at(EPOCH_MS + 1_000);
    h.refill();
    h.assert_account(&account, "1000 + 100 + 0 = 300 + 0 + 800 + 0 + 0");
}

#[test]
fn one_usage_sweep_moves_at_most_sweep_batch_max() {
    let config = CentralConfig {
        sweep_batch_max: 2,
        ..CentralConfig::default()
    };
    let mut ledger = CentralLedger::new(config);
    let now = at(0);
    let _ = ledger.publish_policy(policy(31), now);
    for name in ["rl-1", "rl-2", "rl-3"] {
        let ReserveOutcome::Reserved(_) = ledger.reserve(request(name, 100, name), now).outcome
        else {
            panic!("100 are available");
        };
        let StartOutcome::Started(_) = ledger.start(&rid(name), op(name), Some(5_000), now).outcome
        else {
            panic!("a held reservation starts");
        };
    }
    let due = at(5_000);
    assert_eq!(
        ledger.handle_usage_deadlines(due).outcome,
        vec![rid("rl-1"), rid("rl-2")]
    );
    assert_eq!(
        ledger.handle_usage_deadlines(due).outcome,
        vec![rid("rl-3")]
    );
    assert!(ledger.handle_usage_deadlines(due).outcome.is_empty());
}
