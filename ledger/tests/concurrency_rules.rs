//! A concurrency limit is a policy, not a new kind (docs/design.md §3.12):
//! `opening` N, no refill, one reservation of 1 unit per request, settled
//! with actual 0. Tested on the example policy
//! `examples/policies/tenant-7-gpt-4o.concurrency.json`, moved onto the
//! harness's pair.

mod support;

use ledger::{Dimension, ReserveOutcome};
use shard_format::limits::DURATION_MS_MAX;
use shard_format::{AdmissionBudgetV1, parse};
use support::{Harness, pair, rejected, reserved};

fn example_concurrency_policy() -> AdmissionBudgetV1 {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/policies/tenant-7-gpt-4o.concurrency.json"
    );
    let bytes = std::fs::read(path).expect("the example policy");
    let mut policy: AdmissionBudgetV1 = parse(&bytes).expect("a valid policy");
    assert_eq!((policy.opening, policy.refill.units), (16, 0));
    assert_eq!(
        policy.accounting_epoch_ms, DURATION_MS_MAX,
        "one epoch as long as allowed: each epoch opens a fresh account"
    );
    policy.subject = pair().subject;
    policy.route = pair().route;
    policy
}

#[test]
fn the_example_concurrency_limit_admits_16_in_flight_and_frees_one_per_settle() {
    let policy = example_concurrency_policy();
    let hold_seconds = policy.hold_ttl_ms / 1000;
    let mut h = Harness::with_policy(policy);
    for request in 0..16 {
        let id = format!("rq-{request}");
        reserved(h.reserve(&id, 1));
        h.started(&id, &format!("op-{request}"));
    }
    // The 17th waits: all 16 are held; the soonest any hold not yet
    // started could end is `holdTtlMs` (nothing refills).
    let rejection = rejected(h.reserve("rq-16", 1));
    assert_eq!(rejection.dimension, Dimension::Capacity);
    assert_eq!(rejection.retry_after_seconds, Some(hold_seconds));
    // A request ends: settled with actual 0, its unit is back at once.
    h.settled("rq-3", "op-3", 0);
    assert!(matches!(h.reserve("rq-16", 1), ReserveOutcome::Reserved(_)));
    assert_eq!(
        rejected(h.reserve("rq-17", 1)).dimension,
        Dimension::Capacity
    );
    // One account (one epoch a year): 16 opened, 16 held, nothing spent.
    let (account, _) = h.ledger.accounts().last().expect("the account");
    h.assert_account(&account, "16 + 0 + 0 = 0 + 16 + 0 + 0 + 0");
}
