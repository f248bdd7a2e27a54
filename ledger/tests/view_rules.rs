//! What the ledger's views list (the operator's accounts, audit and status
//! pages read them, docs/design.md §6.3): every account with its terms,
//! every tombstone, every enrolled gateway, and the configuration it runs
//! with.

mod support;

use ledger::{AbandonOutcome, CentralConfig, CentralLedger};
use support::{Harness, at, gateway_signer, identity, owner, policy, rid};

#[test]
fn the_ledger_runs_with_the_configuration_it_was_given() {
    let config = CentralConfig {
        retention_ms: 2 * 24 * 60 * 60 * 1000,
        sweep_batch_max: 7,
        ..CentralConfig::default()
    };
    assert_eq!(CentralLedger::new(config).config(), &config);
}

#[test]
fn views_list_every_account_tombstone_and_gateway() {
    let mut h = Harness::with_policy(policy(31));
    h.at(100);
    h.reserved("rl-1", 100);
    assert_eq!(h.abandon("rl-lost"), AbandonOutcome::Tombstoned);
    h.enroll(&gateway_signer());

    let accounts: Vec<_> = h.ledger.accounts().collect();
    assert_eq!(accounts.len(), 1);
    assert_eq!(accounts[0].0, h.account(31));
    assert_eq!(
        (accounts[0].1.available, accounts[0].1.reserved),
        (900, 100)
    );

    let tombstones: Vec<_> = h.ledger.tombstones().collect();
    assert_eq!(tombstones.len(), 1);
    assert_eq!(tombstones[0].reservation, rid("rl-lost"));
    assert_eq!(tombstones[0].abandoned_at, at(100));

    let gateways: Vec<_> = h.ledger.gateways().collect();
    assert_eq!(gateways.len(), 1);
    assert_eq!(gateways[0].identity, identity(&gateway_signer()));
    assert_eq!(gateways[0].identity, owner());
}
