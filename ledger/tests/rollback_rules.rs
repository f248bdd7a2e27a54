//! The rollback switch (docs/design.md §4.2): an operator stops admission
//! under the current generation; reserves are refused with dimension
//! `policyGeneration` until admission is resumed or a newer generation is
//! published.

mod support;

use ledger::{Dimension, RouteControlOutcome};
use support::{Harness, pair, policy, rejected};

#[test]
fn a_newer_generation_resumes_admission_after_a_rollback() {
    let mut h = Harness::with_policy(policy(31));
    assert_eq!(h.set_admission_stopped(31, true), RouteControlOutcome::Done);
    assert!(!h.ledger.admission_open(&pair()));
    assert_eq!(
        rejected(h.reserve("rl-1", 100)).dimension,
        Dimension::PolicyGeneration
    );
    h.publish(policy(32));
    assert!(!h.ledger.pair(&pair()).expect("pair").admission_stopped);
    assert!(h.ledger.admission_open(&pair()));
    let receipt = h.reserved("rl-2", 100);
    assert_eq!(receipt.policy_generation, 32);
}
