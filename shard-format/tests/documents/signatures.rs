//! Signatures: the central key signs shards, the gateway key signs terminal
//! receipts. A signature verifies only for the exact signed members, under
//! the key its `keyId` names, when that key is trusted, and only for the kind
//! of document it was made for.
//!
//! ed25519 verification takes about 15 ms in a debug build, so these tests
//! count their verifications; `PROPTEST_CASES=N` sets the random ones.

use proptest::prelude::*;
use proptest::sample::Index;
use shard_format::{
    BootNonce, Document, DocumentSigner, DocumentVerifier, Ed25519Signer, Ed25519Verifier,
    EmergencyShardV1, KeyId, Route, ShardCloseReason, ShardId, ShardTerminalReceiptV1, Signature,
    SignatureError, SignedDocument, Subject, Timestamp, canonical_bytes, document_digest, parse,
    sign_document, signing_bytes, verify_document,
};

use crate::support::{
    CENTRAL_SECRET, central_signer, config, gateway_signer, stranger_signer, vector,
};

/// The golden shard, signed afresh by the central key.
fn signed_shard() -> EmergencyShardV1 {
    let mut shard: EmergencyShardV1 = vector("emergencyShard.v1");
    shard.signature = Signature::UNSIGNED;
    sign_document(&mut shard, &central_signer());
    shard
}

/// The golden terminal receipt, signed afresh by the gateway key.
fn signed_receipt() -> ShardTerminalReceiptV1 {
    let mut receipt: ShardTerminalReceiptV1 = vector("shardTerminalReceipt.v1");
    receipt.signature = Signature::UNSIGNED;
    sign_document(&mut receipt, &gateway_signer());
    receipt
}

fn trusting(signers: &[&Ed25519Signer]) -> Ed25519Verifier {
    Ed25519Verifier::new(signers.iter().map(|signer| signer.key_id().clone()))
}

#[test]
fn signed_documents_verify_under_the_trusted_key() {
    let central = central_signer();
    let gateway = gateway_signer();

    let shard = signed_shard();
    assert_eq!(shard.key_id(), central.key_id());
    assert_ne!(*shard.signature(), Signature::UNSIGNED);
    assert_eq!(shard, vector("emergencyShard.v1"), "the golden shard");
    verify_document(&shard, &trusting(&[&central])).expect("shard verifies");

    let receipt = signed_receipt();
    assert_eq!(receipt.key_id(), gateway.key_id());
    assert_eq!(
        receipt,
        vector("shardTerminalReceipt.v1"),
        "the golden receipt"
    );
    verify_document(&receipt, &trusting(&[&gateway])).expect("receipt verifies");

    // Through canonical bytes and back, as documents travel.
    let shard: EmergencyShardV1 = parse(&canonical_bytes(&shard)).expect("shard parses");
    verify_document(&shard, &trusting(&[&central, &gateway])).expect("shard verifies");
    let receipt: ShardTerminalReceiptV1 =
        parse(&canonical_bytes(&receipt)).expect("receipt parses");
    verify_document(&receipt, &trusting(&[&central, &gateway])).expect("receipt verifies");
}

#[test]
fn signing_sets_the_key_id_and_covers_everything_but_the_signature() {
    let mut shard = signed_shard();
    let signing = signing_bytes(&shard);
    let digest = document_digest(&shard);
    let text = String::from_utf8(signing.clone()).expect("UTF-8");
    assert!(!text.contains("\"signature\""), "{text}");
    assert!(text.contains("\"keyId\""), "{text}");
    assert!(text.contains("\"schema\":\"emergencyShard.v1\""), "{text}");

    // The signature is not signed; the digest covers it.
    shard.signature = Signature([7; 64]);
    assert_eq!(signing_bytes(&shard), signing);
    assert_ne!(document_digest(&shard), digest);

    // Signing replaces whatever key ID the document named.
    shard.key_id = stranger_signer().key_id().clone();
    sign_document(&mut shard, &central_signer());
    assert_eq!(shard, signed_shard());
}

/// A signed member and a change of it to another valid value.
type Change<D> = (&'static str, fn(&mut D));

/// One change per signed member of the shard.
const SHARD_CHANGES: [Change<EmergencyShardV1>; 14] = [
    ("schema", |_| {}), // a schema cannot change within the type: see below
    ("shard", |s| s.shard = ShardId::new("shard-43").expect("ID")),
    ("subject", |s| {
        s.subject = Subject::new("tenant-8").expect("ID")
    }),
    ("route", |s| s.route = Route::new("chat.embed").expect("ID")),
    ("policyGeneration", |s| s.policy_generation += 1),
    ("accountingEpoch", |s| {
        s.accounting_epoch = s.accounting_epoch.saturating_add_ms(1);
    }),
    ("allocatedUnits", |s| s.allocated_units += 1),
    ("gatewayIdentity", |s| {
        s.gateway_identity = stranger_signer().key_id().clone();
    }),
    ("bootEpoch", |s| s.boot_epoch += 1),
    ("bootNonce", |s| s.boot_nonce = BootNonce([0; 16])),
    ("fence", |s| s.fence += 1),
    ("notBefore", |s| {
        s.not_before = Timestamp::from_unix_ms(s.not_before.unix_ms() - 1).expect("time");
    }),
    ("notAfter", |s| {
        s.not_after = s.not_after.saturating_add_ms(1)
    }),
    // Another trusted key: the signature must not transfer to it.
    ("keyId", |s| s.key_id = gateway_signer().key_id().clone()),
];

/// One change per signed member of the terminal receipt. `keyId` and
/// `gatewayIdentity` change together, as parsing requires.
const RECEIPT_CHANGES: [Change<ShardTerminalReceiptV1>; 14] = [
    ("schema", |_| {}),
    ("shard", |r| r.shard = ShardId::new("shard-43").expect("ID")),
    ("subject", |r| {
        r.subject = Subject::new("tenant-8").expect("ID")
    }),
    ("route", |r| r.route = Route::new("chat.embed").expect("ID")),
    ("gatewayIdentity", |r| {
        r.gateway_identity = central_signer().key_id().clone();
        r.key_id = r.gateway_identity.clone();
    }),
    ("bootEpoch", |r| r.boot_epoch += 1),
    ("allocatedUnits", |r| {
        r.allocated_units += 1;
        r.unknown_units += 1;
    }),
    ("spentUnits", |r| {
        r.spent_units += 1;
        r.confirmed_unused_units -= 1;
    }),
    ("confirmedUnusedUnits", |r| {
        r.confirmed_unused_units += 1;
        r.unknown_units -= 1;
    }),
    ("unknownUnits", |r| {
        r.unknown_units += 1;
        r.spent_units -= 1;
    }),
    ("overdraftDebtUnits", |r| r.overdraft_debt_units += 1),
    ("reason", |r| r.reason = ShardCloseReason::Restart),
    ("closedAt", |r| {
        r.closed_at = r.closed_at.saturating_add_ms(1)
    }),
    ("keyId", |r| {
        r.key_id = central_signer().key_id().clone();
        r.gateway_identity = r.key_id.clone();
    }),
];

/// Applies every change in turn to a signed document; each must leave a
/// valid document whose signature no longer verifies, even though every key
/// involved is trusted.
fn check_changes<D: SignedDocument + Clone + PartialEq + std::fmt::Debug>(
    signed: &D,
    changes: &[Change<D>],
) {
    let verifier = trusting(&[&central_signer(), &gateway_signer(), &stranger_signer()]);
    // The changes cover every member but the signature.
    let value = serde_json::to_value(signed).expect("serializes");
    let mut members: Vec<&str> = value
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .filter(|member| *member != "signature")
        .collect();
    let mut changed: Vec<&str> = changes.iter().map(|(member, _)| *member).collect();
    members.sort_unstable();
    changed.sort_unstable();
    assert_eq!(members, changed, "one change per signed member");

    for (member, change) in changes {
        if *member == "schema" {
            continue;
        }
        let mut document = signed.clone();
        change(&mut document);
        assert_ne!(&document, signed, "{member}: no change");
        document
            .validate()
            .unwrap_or_else(|error| panic!("{member}: {error}"));
        assert_eq!(
            verify_document(&document, &verifier),
            Err(SignatureError::Mismatch),
            "{member} changed but the signature still verifies"
        );
    }
}

#[test]
fn a_shard_with_any_member_changed_does_not_verify() {
    check_changes(&signed_shard(), &SHARD_CHANGES);
}

#[test]
fn a_terminal_receipt_with_any_member_changed_does_not_verify() {
    check_changes(&signed_receipt(), &RECEIPT_CHANGES);
}

/// Flips one bit in each byte of the signature (a different bit each time).
fn check_signature_bit_flips<D: SignedDocument + Clone>(signed: &D, verifier: &Ed25519Verifier) {
    for byte in 0..64 {
        let mut document = signed.clone();
        let mut signature = *document.signature();
        signature.0[byte] ^= 1 << (byte % 8);
        document.set_signature(document.key_id().clone(), signature);
        assert_eq!(
            verify_document(&document, verifier),
            Err(SignatureError::Mismatch),
            "signature byte {byte} flipped"
        );
    }
}

#[test]
fn a_shard_with_a_flipped_signature_bit_does_not_verify() {
    check_signature_bit_flips(&signed_shard(), &trusting(&[&central_signer()]));
}

#[test]
fn a_terminal_receipt_with_a_flipped_signature_bit_does_not_verify() {
    check_signature_bit_flips(&signed_receipt(), &trusting(&[&gateway_signer()]));
}

proptest! {
    #![proptest_config(config("PROPTEST_CASES", 24))]

    /// Any byte of a signed document's canonical bytes, changed: the result
    /// either does not parse or does not verify.
    #[test]
    fn a_changed_byte_never_verifies(
        shard in any::<bool>(),
        at in any::<Index>(),
        mask in 1..=255u8,
    ) {
        let verifier = trusting(&[&central_signer(), &gateway_signer()]);
        if shard {
            check_changed_byte(&signed_shard(), &verifier, at, mask)?;
        } else {
            check_changed_byte(&signed_receipt(), &verifier, at, mask)?;
        }
    }
}

fn check_changed_byte<D: SignedDocument + PartialEq + std::fmt::Debug>(
    signed: &D,
    verifier: &Ed25519Verifier,
    at: Index,
    mask: u8,
) -> Result<(), TestCaseError> {
    let mut bytes = canonical_bytes(signed);
    let at = at.index(bytes.len());
    bytes[at] ^= mask;
    if let Ok(document) = parse::<D>(&bytes) {
        prop_assert_ne!(&document, signed);
        // A changed `keyId` names a key nobody trusts; any other change
        // breaks the signature.
        let outcome = verify_document(&document, verifier);
        let expected = if document.key_id() == signed.key_id() {
            SignatureError::Mismatch
        } else {
            SignatureError::UntrustedKey(document.key_id().clone())
        };
        prop_assert_eq!(
            outcome,
            Err(expected),
            "byte {} changed to {:?}",
            at,
            char::from(bytes[at])
        );
    }
    Ok(())
}

#[test]
fn a_signature_by_another_key_under_a_trusted_key_id_does_not_verify() {
    let central = central_signer();
    let verifier = trusting(&[&central]);
    for impostor in [stranger_signer(), gateway_signer()] {
        let mut shard = signed_shard();
        sign_document(&mut shard, &impostor);
        assert_eq!(shard.key_id(), impostor.key_id());
        // Claim the trusted key, keep the impostor's signature.
        let signature = *shard.signature();
        shard.set_signature(central.key_id().clone(), signature);
        assert_eq!(
            verify_document(&shard, &verifier),
            Err(SignatureError::Mismatch),
            "signed by {:?}",
            impostor.key_id()
        );
    }
}

#[test]
fn a_signature_by_an_untrusted_key_does_not_verify() {
    let stranger = stranger_signer();
    let mut shard = signed_shard();
    sign_document(&mut shard, &stranger);
    // A correct signature, but by a key the verifier does not trust.
    for verifier in [
        Ed25519Verifier::default(),
        trusting(&[&central_signer()]),
        trusting(&[&central_signer(), &gateway_signer()]),
    ] {
        assert_eq!(
            verify_document(&shard, &verifier),
            Err(SignatureError::UntrustedKey(stranger.key_id().clone()))
        );
    }
    assert_eq!(verify_document(&shard, &trusting(&[&stranger])), Ok(()));

    // A receipt signed by its gateway is no good to a verifier that trusts
    // only the central key, and a shard none to one that trusts only the
    // gateway.
    let receipt = signed_receipt();
    assert_eq!(
        verify_document(&receipt, &trusting(&[&central_signer()])),
        Err(SignatureError::UntrustedKey(receipt.key_id.clone()))
    );
    assert_eq!(
        verify_document(&signed_shard(), &trusting(&[&gateway_signer()])),
        Err(SignatureError::UntrustedKey(
            central_signer().key_id().clone()
        ))
    );
}

#[test]
fn a_key_id_that_is_no_ed25519_key_does_not_verify() {
    let shard = signed_shard();
    let message = signing_bytes(&shard);
    // Trusted, but a scheme the ed25519 verifier cannot check.
    let simulated = KeyId::new("sim:central-1").expect("key ID");
    let verifier = Ed25519Verifier::new([simulated.clone()]);
    assert_eq!(
        verifier.verify(&simulated, &message, shard.signature()),
        Err(SignatureError::UnsupportedScheme(simulated))
    );
    // Trusted, but 32 bytes that are no point on the curve.
    let mut not_a_point = [0; 32];
    not_a_point[0] = 2;
    let malformed = KeyId::ed25519(&not_a_point);
    let verifier = Ed25519Verifier::new([malformed.clone()]);
    assert_eq!(
        verifier.verify(&malformed, &message, shard.signature()),
        Err(SignatureError::MalformedKey(malformed))
    );
    // Trusted, but a weak (small-order) key, which strict verification
    // refuses whatever the signature.
    let mut identity = [0; 32];
    identity[0] = 1;
    let weak = KeyId::ed25519(&identity);
    let verifier = Ed25519Verifier::new([weak.clone()]);
    assert_eq!(
        verifier.verify(&weak, &message, shard.signature()),
        Err(SignatureError::Mismatch)
    );
}

/// `schema` is covered: a signature over one kind of document never verifies
/// another, even from the same key.
#[test]
fn a_signature_over_one_schema_does_not_verify_another() {
    let central = central_signer();
    let verifier = trusting(&[&central]);
    let shard = signed_shard();
    let signing = String::from_utf8(signing_bytes(&shard)).expect("UTF-8");

    // The shard's own bytes verify; re-tagged as a terminal receipt they do
    // not.
    assert_eq!(
        verifier.verify(central.key_id(), signing.as_bytes(), shard.signature()),
        Ok(())
    );
    let retagged = signing.replace(
        "\"schema\":\"emergencyShard.v1\"",
        "\"schema\":\"shardTerminalReceipt.v1\"",
    );
    assert_ne!(retagged, signing);
    assert_eq!(
        verifier.verify(central.key_id(), retagged.as_bytes(), shard.signature()),
        Err(SignatureError::Mismatch)
    );

    // A terminal receipt whose gateway is the central key, carrying the
    // shard's signature, does not verify; signed properly it does.
    let mut receipt = signed_receipt();
    receipt.gateway_identity = central.key_id().clone();
    receipt.set_signature(central.key_id().clone(), *shard.signature());
    receipt.validate().expect("valid receipt");
    assert_eq!(
        verify_document(&receipt, &verifier),
        Err(SignatureError::Mismatch)
    );
    sign_document(&mut receipt, &central);
    assert_eq!(verify_document(&receipt, &verifier), Ok(()));
    assert_ne!(receipt.signature(), shard.signature());

    // And the other way: the receipt's signature on the shard.
    let mut shard = shard;
    shard.set_signature(central.key_id().clone(), *receipt.signature());
    assert_eq!(
        verify_document(&shard, &verifier),
        Err(SignatureError::Mismatch)
    );
}

#[test]
fn a_signer_never_prints_its_secret() {
    let printed = format!("{:?}", central_signer());
    assert!(
        printed.contains(central_signer().key_id().as_str()),
        "{printed}"
    );
    assert!(!printed.contains(&hex_of(&CENTRAL_SECRET)), "{printed}");
    assert!(!printed.contains("[1, 1, 1"), "{printed}");
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}
