//! Boots and shards under a hostile agent (issue 13, docs/design.md §5):
//! a replayed boot request is refused durably by the ledger; one
//! identity's open shard units per pair are capped over all its boots, so
//! a boot + shard loop cannot retire a pair's budget; a shard unreconciled
//! past `notAfter` plus the grace is marked lost, stops counting toward
//! the cap and keeps its units retired until a (late) receipt re-mints
//! them. Every operation runs through `support::Harness` (audit after each
//! step, rebuild from the committed changes), each rule at its boundary.

mod support;

use ledger::protocol::{About, ErrorCode};
use ledger::{
    BOOT_SKEW_MS_MAX, BootReplay, ForgetOutcome, IssueShardOutcome, ReconcileOutcome,
    RegisterOutcome, SHARD_LOST_GRACE_DEFAULT_MS, ShardClosure, ShardLedger,
};
use shard_format::{EmergencyShardV1, ShardCloseReason, ShardTerminalReceiptV1, sign_document};
use support::{
    Harness, at, fresh_boot, gateway_signer, identity, nonce, other_gateway_signer, pair, policy,
    verifier,
};

/// Validity of the policy's shards (`emergencyShardValidityMs`).
const VALIDITY_MS: u64 = 600_000;

/// The terminal receipt of `shard` closed untouched: every unit unused.
fn unused_receipt(shard: EmergencyShardV1) -> ShardTerminalReceiptV1 {
    let (mut book, _) = ShardLedger::open(shard);
    let ShardClosure { .. } = book.close(ShardCloseReason::Restart, at(0)).outcome;
    let mut receipt = book.terminal_receipt().expect("the shard is closed");
    sign_document(&mut receipt, &gateway_signer());
    receipt
}

fn registered(outcome: RegisterOutcome) -> u64 {
    match outcome {
        RegisterOutcome::Registered { boot_epoch, .. } => boot_epoch,
        other => panic!("expected a registration, got {other:?}"),
    }
}

#[test]
fn a_boot_request_at_the_skew_registers_and_one_second_past_is_refused() {
    let mut h = Harness::with_policy(policy(1));
    let gateway = gateway_signer();
    h.enroll(&gateway);
    h.at(100_000);
    // One second past the skew, either way: refused, nothing written.
    let late = fresh_boot(nonce(1), at(100_000 - BOOT_SKEW_MS_MAX - 1_000));
    assert_eq!(
        h.register_request(&gateway, nonce(1), late),
        RegisterOutcome::Replayed(BootReplay::OutsideSkew {
            skew_ms: BOOT_SKEW_MS_MAX + 1_000
        })
    );
    let early = fresh_boot(nonce(1), at(100_000 + BOOT_SKEW_MS_MAX + 1_000));
    assert!(matches!(
        h.register_request(&gateway, nonce(1), early),
        RegisterOutcome::Replayed(BootReplay::OutsideSkew { .. })
    ));
    assert_eq!(
        h.ledger
            .gateway(&identity(&gateway))
            .expect("enrolled")
            .boot_epoch,
        0
    );
    // Exactly at the skew: registered.
    let edge = fresh_boot(nonce(1), at(100_000 - BOOT_SKEW_MS_MAX));
    assert_eq!(registered(h.register_request(&gateway, nonce(1), edge)), 1);
}

#[test]
fn a_replayed_boot_request_is_refused_and_the_current_boot_stands() {
    let mut h = Harness::with_policy(policy(1));
    let gateway = gateway_signer();
    h.enroll(&gateway);
    h.at(50_000);
    let first = fresh_boot(nonce(1), at(50_000));
    assert_eq!(registered(h.register_request(&gateway, nonce(9), first)), 1);
    // The same request again (a replay, even much later within the skew
    // window, or after a restart of the service: the ledger remembers).
    h.reload();
    h.at(55_000);
    assert_eq!(
        h.register_request(&gateway, nonce(10), first),
        RegisterOutcome::Replayed(BootReplay::SameNonce)
    );
    // A new nonce with a `requestedAt` not after the current boot's.
    let same_time = fresh_boot(nonce(2), at(50_000));
    assert_eq!(
        h.register_request(&gateway, nonce(10), same_time),
        RegisterOutcome::Replayed(BootReplay::NotAfterCurrentBoot)
    );
    let gateway_record = h.ledger.gateway(&identity(&gateway)).expect("enrolled");
    assert_eq!(
        (gateway_record.boot_epoch, gateway_record.boot_nonce),
        (1, Some(nonce(9)))
    );
    // One millisecond later with a fresh nonce: a new boot.
    let next = fresh_boot(nonce(2), at(50_001));
    assert_eq!(registered(h.register_request(&gateway, nonce(10), next)), 2);
    // The wire form: 409 boot_replayed.
    let about = About {
        identity: Some(identity(&gateway)),
        ..About::default()
    };
    let refusal =
        ledger::protocol::Reply::Register(RegisterOutcome::Replayed(BootReplay::SameNonce))
            .into_answer(&about)
            .expect_err("a refusal");
    assert_eq!(
        (refusal.status, refusal.error),
        (409, ErrorCode::BootReplayed)
    );
}

#[test]
fn the_cap_spans_boots_at_exactly_two_shards_and_one_more_is_refused() {
    let mut h = Harness::with_policy(policy(1));
    let account = h.account(1);
    let gateway = gateway_signer();
    h.enroll(&gateway);
    // A boot + shard loop: each boot may hold two open shards, but the
    // identity holds at most 2 × 200 open units of the pair over all boots.
    let boot = h.register(&gateway, nonce(1));
    h.issued("s1", &gateway, boot, nonce(1));
    h.at(1_000);
    let boot = h.register(&gateway, nonce(2));
    // Exactly at the cap: 400.
    h.issued("s2", &gateway, boot, nonce(2));
    h.assert_account(&account, "1000 + 0 + 0 = 600 + 0 + 0 + 400 + 0");
    // One shard more, from this boot or the next: refused until the oldest
    // (s1, not after 600 s) is lost at 600 s + 600 s grace.
    assert_eq!(
        h.issue("s3", &gateway, boot, nonce(2)),
        IssueShardOutcome::UnreconciledCap {
            retry_after_seconds: (VALIDITY_MS + SHARD_LOST_GRACE_DEFAULT_MS - 1_000) / 1_000
        }
    );
    h.at(2_000);
    let boot = h.register(&gateway, nonce(3));
    assert!(matches!(
        h.issue("s3", &gateway, boot, nonce(3)),
        IssueShardOutcome::UnreconciledCap { .. }
    ));
    h.assert_account(&account, "1000 + 0 + 0 = 600 + 0 + 0 + 400 + 0");
    // Another identity has a cap of its own.
    let other = other_gateway_signer();
    h.enroll(&other);
    let other_boot = h.register(&other, nonce(4));
    h.issued("s4", &other, other_boot, nonce(4));
    // A receipt makes room at once.
    let s1 = h
        .ledger
        .shard(&support::shard_id("s1"))
        .expect("issued")
        .shard
        .clone();
    let ReconcileOutcome::Reconciled(_) = h.reconcile(&unused_receipt(s1), &verifier(&[&gateway]))
    else {
        panic!("the receipt reconciles");
    };
    h.issued("s3", &gateway, boot, nonce(3));
    // The wire form: 429 shard_cap_reached with Retry-After.
    let refusal = ledger::protocol::Reply::IssueShard(IssueShardOutcome::UnreconciledCap {
        retry_after_seconds: 7,
    })
    .into_answer(&About::default())
    .expect_err("a refusal");
    assert_eq!(
        (
            refusal.status,
            refusal.error,
            refusal.details.retry_after_seconds
        ),
        (429, ErrorCode::ShardCapReached, Some(7))
    );
}

#[test]
fn a_shard_is_lost_at_exactly_not_after_plus_grace_and_a_late_receipt_still_reconciles() {
    let mut h = Harness::with_policy(policy(1));
    let account = h.account(1);
    let gateway = gateway_signer();
    h.enroll(&gateway);
    let boot = h.register(&gateway, nonce(1));
    let s1 = h.issued("s1", &gateway, boot, nonce(1));
    h.issued("s2", &gateway, boot, nonce(1));
    let lost_at = VALIDITY_MS + SHARD_LOST_GRACE_DEFAULT_MS;
    // One millisecond before: nothing is lost, the cap still holds.
    h.at(lost_at - 1);
    assert!(h.mark_lost().is_empty());
    let boot = h.register(&gateway, nonce(2));
    assert!(matches!(
        h.issue("s3", &gateway, boot, nonce(2)),
        IssueShardOutcome::UnreconciledCap {
            retry_after_seconds: 1
        }
    ));
    // Exactly at notAfter + grace: both are lost; nothing moves in the
    // account (their units stay retired), and they no longer count.
    h.at(lost_at);
    let lost = h.mark_lost();
    assert_eq!(lost.len(), 2);
    assert_eq!(
        (lost[0].units, lost[0].identity.clone()),
        (200, identity(&gateway))
    );
    assert!(h.mark_lost().is_empty(), "marked once");
    h.assert_account(&account, "1000 + 0 + 0 = 600 + 0 + 0 + 400 + 0");
    let view = ledger::protocol::views::accounts_view(&h.ledger, &pair()).expect("policy");
    assert_eq!(
        (view.accounts[0].lost_shards, view.accounts[0].lost_units),
        (2, 400)
    );
    let gauges = ledger::protocol::views::gauges(&h.ledger);
    assert_eq!((gauges.lost_shards, gauges.lost_shard_units), (2, 400));
    assert_eq!((gauges.open_shards, gauges.shard_units_out), (0, 0));
    h.issued("s3", &gateway, boot, nonce(2));
    // A late receipt is reconciled normally: its unused units re-mint.
    let ReconcileOutcome::Reconciled(done) =
        h.reconcile(&unused_receipt(s1), &verifier(&[&gateway]))
    else {
        panic!("a lost shard's late receipt reconciles");
    };
    assert_eq!(done.reminted_units, 200);
    let record = h.ledger.shard(&support::shard_id("s1")).expect("kept");
    assert_eq!(record.lost_at, Some(at(lost_at)));
    let gauges = ledger::protocol::views::gauges(&h.ledger);
    assert_eq!((gauges.lost_shards, gauges.lost_shard_units), (1, 200));
}

#[test]
fn a_lost_shard_never_reconciled_is_forgotten_a_retention_window_after_it_was_lost() {
    let mut h = Harness::with_policy(policy(1));
    let gateway = gateway_signer();
    h.enroll(&gateway);
    let boot = h.register(&gateway, nonce(1));
    h.issued("s1", &gateway, boot, nonce(1));
    let lost_at = VALIDITY_MS + SHARD_LOST_GRACE_DEFAULT_MS;
    h.at(lost_at);
    assert_eq!(h.mark_lost().len(), 1);
    let retention = h.ledger.config().retention_ms;
    h.at(lost_at + retention - 1);
    assert_eq!(h.run(|ledger, now| ledger.forget_expired(now)).shards, 0);
    h.at(lost_at + retention);
    let ForgetOutcome { shards, .. } = h.run(|ledger, now| ledger.forget_expired(now));
    assert_eq!(shards, 1);
    assert!(h.ledger.shard(&support::shard_id("s1")).is_none());
    // Its units stay retired: its account, of a past epoch and now empty,
    // folded into the pair's closed history with them.
    let history = h.ledger.pair(&pair()).expect("pair").closed_history;
    assert_eq!(history.terms.retired_for_emergency, 200);
    assert_eq!(
        (history.forgotten.lost_shards, history.forgotten.lost_units),
        (1, 200)
    );
    let gauges = ledger::protocol::views::gauges(&h.ledger);
    assert_eq!((gauges.lost_shards, gauges.lost_shard_units), (1, 200));
}
