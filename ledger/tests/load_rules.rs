//! How a ledger comes back from its records (docs/design.md §7.3) and the
//! defaults it runs with when nothing is configured (§3.10, §5.3, §5.10).

mod support;

use ledger::{CentralConfig, CentralLedger, LoadError};
use support::{Harness, edit_accounts, policy};

#[test]
fn defaults_are_the_documented_ones() {
    let config = CentralConfig::default();
    assert_eq!(config.retention_ms, 24 * 60 * 60 * 1000, "24 hours");
    assert_eq!(config.shard_lost_grace_ms, 10 * 60 * 1000, "10 minutes");
    assert_eq!(config.open_shards_per_gateway_pair_max, 2);
    assert_eq!(config.unreconciled_shard_units_factor, 2);
}

/// A replica over a shared database loads one batch's live records: the
/// same accounts and reservations, without the settled history's check.
#[test]
fn live_records_load_the_same_ledger_without_its_history() {
    let mut h = Harness::with_policy(policy(31));
    h.at(100);
    h.reserved("rl-live", 100);
    h.reserved("rl-set", 300);
    h.started("rl-set", "op-set");
    h.settled("rl-set", "op-set", 250);

    let live = CentralLedger::from_live_records(CentralConfig::default(), h.records())
        .expect("balanced records load");
    assert!(!live.holds_history());
    assert!(h.ledger.holds_history());
    assert_eq!(
        live.accounts().collect::<Vec<_>>(),
        h.ledger.accounts().collect::<Vec<_>>()
    );
    let by_id = |ledger: &CentralLedger| {
        let mut records: Vec<_> = ledger.reservations().cloned().collect();
        records.sort_by(|a, b| a.receipt.reservation.cmp(&b.receipt.reservation));
        records
    };
    assert_eq!(by_id(&live), by_id(&h.ledger));

    // An equation off by one unit still refuses to load.
    let broken = edit_accounts(h.records(), |account| account.terms.available += 1);
    assert!(matches!(
        CentralLedger::from_live_records(CentralConfig::default(), broken),
        Err(LoadError::Invariants(_))
    ));
}
