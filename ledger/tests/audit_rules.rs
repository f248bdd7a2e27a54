//! The audit names each broken rule (docs/design.md §4.1): a ledger with a
//! little of everything — a live hold, a refunded settlement, a settlement
//! with debt, a reconciled shard and a lost one — audits clean and counts
//! what it checked; each corrupted record refuses to load with exactly the
//! violation that names it, and nothing else.

mod support;

use ledger::invariants::{AuditReport, Violation, audit, audit_touched};
use ledger::{CentralConfig, CentralLedger, Change, LoadError, ReconcileOutcome, ReleaseOutcome};
use shard_format::{ReservationState, ShardCloseReason, Timestamp, sign_document};
use support::{Harness, at, gateway_signer, nonce, policy, rid, shard_id, verifier};

/// The policy of docs/design.md §4.7 at generation 31 and, at `T0 + 100 ms`
/// on: `rl-live` holds 100; `rl-set` reserved 300 and settled 250; shard
/// `s1` (200) was issued and reconciled all unused; shard `s2` (200) was
/// issued; `rl-debt` reserved 400 and settled 470, 20 of it debt; at
/// `s2`'s `notAfter` plus the grace, `s2` was marked lost.
fn history() -> Harness {
    let mut h = Harness::with_policy(policy(31));
    h.at(100);
    h.reserved("rl-live", 100);
    h.reserved("rl-set", 300);
    h.started("rl-set", "op-set");
    h.settled("rl-set", "op-set", 250);

    let gateway = gateway_signer();
    h.enroll(&gateway);
    let boot = h.register(&gateway, nonce(1));
    let s1 = h.issued("s1", &gateway, boot, nonce(1));
    let (mut book, _) = ledger::ShardLedger::open(s1);
    let _ = book.close(ShardCloseReason::Restart, at(150));
    let mut receipt = book.terminal_receipt().expect("closed");
    sign_document(&mut receipt, &gateway);
    let ReconcileOutcome::Reconciled(done) = h.reconcile(&receipt, &verifier(&[&gateway])) else {
        panic!("s1's receipt reconciles");
    };
    assert_eq!(done.reminted_units, 200);
    let s2 = h.issued("s2", &gateway, boot, nonce(1));

    h.reserved("rl-debt", 400);
    h.started("rl-debt", "op-debt");
    assert_eq!(h.settled("rl-debt", "op-debt", 470).overdraft_units, 20);

    h.now = s2
        .not_after
        .saturating_add_ms(ledger::SHARD_LOST_GRACE_DEFAULT_MS);
    assert_eq!(h.mark_lost().len(), 1);
    let account = h.account_at(at(0), 31);
    h.assert_account(&account, "1000 + 200 + 20 = 0 + 100 + 720 + 400 + 0");
    h
}

/// The violations the load audit finds in `records` (none: it loaded).
fn violations(records: Vec<Change>) -> Vec<Violation> {
    match CentralLedger::from_records(CentralConfig::default(), records) {
        Ok(_) => Vec::new(),
        Err(LoadError::Invariants(violations)) => violations,
    }
}

/// `records` with the reservation `name` rewritten by `edit`.
fn edit_reservation(
    records: Vec<Change>,
    name: &str,
    edit: impl Fn(&mut ledger::ReservationRecord),
) -> Vec<Change> {
    records
        .into_iter()
        .map(|change| match change {
            Change::Reservation(mut record) if record.receipt.reservation == rid(name) => {
                edit(&mut record);
                Change::Reservation(record)
            }
            other => other,
        })
        .collect()
}

/// `records` with the shard `name` rewritten by `edit`.
fn edit_shard(
    records: Vec<Change>,
    name: &str,
    edit: impl Fn(&mut ledger::ShardRecord),
) -> Vec<Change> {
    records
        .into_iter()
        .map(|change| match change {
            Change::Shard(mut record) if record.shard.shard == shard_id(name) => {
                edit(&mut record);
                Change::Shard(record)
            }
            other => other,
        })
        .collect()
}

#[test]
fn a_clean_history_audits_clean_and_counts_what_it_checked() {
    let h = history();
    assert_eq!(
        audit(&h.ledger),
        AuditReport {
            accounts: 1,
            reservations: 3,
            shards: 2,
            debt: 20,
            violations: Vec::new(),
        }
    );
}

/// The audit of what changes touched looks at every record of a touched
/// account, and at nothing the changes did not name: touching all of the
/// history is the full audit; touching one reservation checks its account
/// with all its records; touching only a pair row checks no account.
#[test]
fn an_audit_of_touched_records_checks_their_accounts_whole_and_nothing_else() {
    let h = history();
    let records = h.records();
    assert_eq!(audit_touched(&h.ledger, &records), audit(&h.ledger));
    let one_reservation: Vec<Change> = records
        .iter()
        .filter(|change| matches!(change, Change::Reservation(record) if record.receipt.reservation == rid("rl-live")))
        .cloned()
        .collect();
    assert_eq!(one_reservation.len(), 1);
    assert_eq!(
        audit_touched(&h.ledger, &one_reservation),
        AuditReport {
            accounts: 1,
            reservations: 3,
            shards: 2,
            debt: 20,
            violations: Vec::new(),
        }
    );
    let pair_only: Vec<Change> = records
        .iter()
        .filter(|change| matches!(change, Change::Pair(_)))
        .cloned()
        .collect();
    assert_eq!(pair_only.len(), 1);
    assert_eq!(audit_touched(&h.ledger, &pair_only), AuditReport::default());
    assert_eq!(audit_touched(&h.ledger, &[]), AuditReport::default());
}

#[test]
fn a_settlement_that_disagrees_with_its_reservation_is_named() {
    let h = history();
    let named = vec![Violation::Settlement {
        reservation: rid("rl-set"),
    }];
    let state = edit_reservation(h.records(), "rl-set", |record| {
        if let Some(settlement) = &mut record.settlement {
            settlement.state = ReservationState::SettledWithDebt;
        }
    });
    assert_eq!(violations(state), named, "another state");
    let actual = edit_reservation(h.records(), "rl-set", |record| {
        record.receipt.actual_units = Some(251);
    });
    assert_eq!(violations(actual), named, "other units");
    let reservation = edit_reservation(h.records(), "rl-set", |record| {
        if let Some(settlement) = &mut record.settlement {
            settlement.reservation = rid("rl-other");
        }
    });
    assert_eq!(violations(reservation), named, "another reservation's");
    let unsettled = edit_reservation(h.records(), "rl-live", |record| {
        record.settlement = h.reservation("rl-set").settlement.clone();
    });
    assert!(
        violations(unsettled).contains(&Violation::Settlement {
            reservation: rid("rl-live")
        }),
        "a settlement on a live reservation"
    );
}

#[test]
fn a_shard_lost_before_its_not_after_is_named() {
    let h = history();
    let not_after = h.ledger.shard(&shard_id("s2")).expect("s2").shard.not_after;
    let early = Timestamp::from_unix_ms(not_after.unix_ms() - 1).expect("valid");
    let lost_early = edit_shard(h.records(), "s2", |record| record.lost_at = Some(early));
    assert_eq!(
        violations(lost_early),
        vec![Violation::LostEarly {
            shard: shard_id("s2")
        }]
    );
    let lost_at_not_after = edit_shard(h.records(), "s2", |record| {
        record.lost_at = Some(not_after);
    });
    assert_eq!(violations(lost_at_not_after), Vec::new());
}

#[test]
fn spent_that_disagrees_with_the_settlements_is_named() {
    let h = history();
    let account = h.account_at(at(0), 31);
    let records = support::edit_accounts(h.records(), |record| {
        record.terms.spent += 1;
        record.terms.available += 1;
        record.terms.minted += 2;
    });
    assert_eq!(
        violations(records),
        vec![Violation::UsageMismatch {
            account,
            spent: 721,
            settled: 720,
            overdraft_issued: 20,
            debts: 20,
        }]
    );
}

#[test]
fn reconciliation_parts_that_do_not_add_up_are_named() {
    let h = history();
    let records = edit_shard(h.records(), "s1", |record| {
        if let Some(done) = &mut record.reconciliation {
            done.cut_units += 1;
        }
    });
    assert_eq!(
        violations(records),
        vec![Violation::Reconciliation {
            shard: shard_id("s1")
        }]
    );
}

#[test]
fn units_held_in_a_missing_account_are_named_once_per_kind() {
    let mut h = history();
    let account = h.account_at(at(0), 31);
    let without_account = |records: Vec<Change>| -> Vec<Change> {
        records
            .into_iter()
            .filter(|change| !matches!(change, Change::Account(_)))
            .collect()
    };
    // 100 held by `rl-live`, 400 retired by the shards.
    assert_eq!(
        violations(without_account(h.records())),
        vec![
            Violation::MissingAccount {
                account: account.clone()
            },
            Violation::MissingAccount {
                account: account.clone()
            },
        ]
    );
    // Released, no reservation holds anything: only the shards' units
    // are missing.
    assert!(matches!(h.release("rl-live"), ReleaseOutcome::Released(_)));
    assert_eq!(
        violations(without_account(h.records())),
        vec![Violation::MissingAccount { account }]
    );
}
