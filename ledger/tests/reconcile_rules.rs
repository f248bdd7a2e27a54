//! A terminal receipt is reconciled only if it is the shard's own
//! (docs/design.md §5.9): handed in by the identity the shard is bound to,
//! naming that identity, signed with its key, and for the shard's pair.

mod support;

use ledger::ReconcileOutcome;
use shard_format::{ShardCloseReason, ShardTerminalReceiptV1, sign_document};
use support::{
    Harness, at, gateway_signer, identity, nonce, other_gateway_signer, owner, policy, route,
    subject, verifier,
};

/// `s1` issued to `g-a` and closed all unused; its receipt, unsigned.
fn issued_and_closed() -> (Harness, ShardTerminalReceiptV1) {
    let mut h = Harness::with_policy(policy(31));
    h.enroll(&gateway_signer());
    let boot = h.register(&gateway_signer(), nonce(1));
    let shard = h.issued("s1", &gateway_signer(), boot, nonce(1));
    let (mut book, _) = ledger::ShardLedger::open(shard);
    let _ = book.close(ShardCloseReason::Restart, at(150));
    (h, book.terminal_receipt().expect("closed"))
}

#[test]
fn a_receipt_naming_another_identity_is_refused_even_from_the_owner() {
    let (mut h, mut receipt) = issued_and_closed();
    receipt.gateway_identity = identity(&other_gateway_signer());
    sign_document(&mut receipt, &gateway_signer());
    let trusted = verifier(&[&gateway_signer(), &other_gateway_signer()]);
    let outcome = h.run(|ledger, now| ledger.reconcile_shard(&receipt, &owner(), &trusted, now));
    assert_eq!(outcome, ReconcileOutcome::WrongIdentity);
}

#[test]
fn a_receipt_for_another_subject_or_route_is_a_mismatch() {
    let (mut h, receipt) = issued_and_closed();
    let trusted = verifier(&[&gateway_signer()]);
    let mut other_subject = receipt.clone();
    other_subject.subject = subject("tenant-8");
    sign_document(&mut other_subject, &gateway_signer());
    assert_eq!(
        h.reconcile(&other_subject, &trusted),
        ReconcileOutcome::Mismatch("subject and route")
    );
    let mut other_route = receipt;
    other_route.route = route("chat.embed");
    sign_document(&mut other_route, &gateway_signer());
    assert_eq!(
        h.reconcile(&other_route, &trusted),
        ReconcileOutcome::Mismatch("subject and route")
    );
}
