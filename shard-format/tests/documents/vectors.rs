//! Golden test vectors (`tests/vectors/`, described in its README.md),
//! checked byte for byte: any change to the canonical encoding, the digest or
//! the signing bytes breaks these tests, as it would break every other
//! implementation and every stored signature.
//!
//! Each vector `NAME` has a pretty-printed `NAME.input.json` and the expected
//! `NAME.canonical.json` (exact bytes, no final newline) and `NAME.digest`;
//! the signed documents also have `NAME.signing.json` (the bytes the signature
//! covers) and `NAME.signature` (hex). A document vector is named after its
//! schema, with an optional `-variant`; a vector without `schema` is a request
//! digest.
//!
//! `UPDATE_VECTORS=1 cargo test -p shard-format vectors` rewrites the
//! expected files from the inputs (and re-signs the signed inputs with the
//! fixed test keys) instead of comparing. Do that only for an intended change
//! of encoding, and review the diff.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::fs;

use serde::Deserialize;
use shard_format::{
    AdmissionBudgetV1, Digest, Document, DocumentSigner, Ed25519Signer, Ed25519Verifier,
    EmergencyShardV1, LimitReservationV1, OperationReceiptV1, Route, SettlementReceiptV1,
    ShardTerminalReceiptV1, SignedDocument, Subject, canonical_bytes, canonical_json,
    document_digest, parse, request_digest, sign_document, signing_bytes, verify_document,
};

use crate::support::{Kind, central_signer, gateway_signer, vector_input, vectors_dir};

/// Every vector; each has its own test below.
const NAMES: [&str; 13] = [
    "admissionBudget.v1",
    "admissionBudget.v1-emergency",
    "limitReservation.v1",
    "limitReservation.v1-settled",
    "limitReservation.v1-flexible",
    "limitReservation.v1-legs",
    "settlementReceipt.v1",
    "settlementReceipt.v1-legs",
    "operationReceipt.v1",
    "emergencyShard.v1",
    "shardTerminalReceipt.v1",
    "requestDigest",
    "requestDigest-null",
];

#[test]
fn admission_budget() {
    check("admissionBudget.v1");
}

#[test]
fn admission_budget_with_emergency_shards_and_limits_at_their_maximum() {
    check("admissionBudget.v1-emergency");
}

#[test]
fn limit_reservation_reserved() {
    check("limitReservation.v1");
}

#[test]
fn limit_reservation_settled() {
    check("limitReservation.v1-settled");
}

#[test]
fn limit_reservation_flexible_granted_below_its_ask() {
    check("limitReservation.v1-flexible");
}

#[test]
fn limit_reservation_of_three_legs_one_flexible() {
    check("limitReservation.v1-legs");
}

#[test]
fn settlement_receipt_of_three_legs() {
    check("settlementReceipt.v1-legs");
}

#[test]
fn settlement_receipt() {
    check("settlementReceipt.v1");
}

#[test]
fn operation_receipt() {
    check("operationReceipt.v1");
}

#[test]
fn emergency_shard_signed_by_the_central_key() {
    check("emergencyShard.v1");
}

#[test]
fn shard_terminal_receipt_signed_by_the_gateway_key() {
    check("shardTerminalReceipt.v1");
}

#[test]
fn request_digest_of_a_request_with_floats_escapes_and_astral_keys() {
    check("requestDigest");
}

#[test]
fn request_digest_without_a_request() {
    check("requestDigest-null");
}

/// The vector directory holds the files of [`NAMES`] and nothing else, so a
/// vector cannot be added or renamed without a test.
#[test]
fn every_vector_file_belongs_to_a_tested_vector() {
    const SUFFIXES: [&str; 5] = [
        ".input.json",
        ".canonical.json",
        ".digest",
        ".signing.json",
        ".signature",
    ];
    let mut inputs = BTreeSet::new();
    for entry in fs::read_dir(vectors_dir()).expect("tests/vectors") {
        let file = entry.expect("directory entry").file_name();
        let file = file.to_str().expect("UTF-8 file name");
        if matches!(file, "README.md" | ".gitattributes") {
            continue;
        }
        let name = SUFFIXES
            .iter()
            .find_map(|suffix| file.strip_suffix(suffix))
            .unwrap_or_else(|| panic!("tests/vectors/{file}: unknown kind of vector file"));
        assert!(
            NAMES.contains(&name),
            "tests/vectors/{file} belongs to no vector in NAMES"
        );
        if file.ends_with(".input.json") {
            inputs.insert(name.to_owned());
        }
    }
    let names = NAMES.map(String::from);
    assert_eq!(inputs, BTreeSet::from(names), "vectors without an input");
}

/// Checks the vector `name`: parses its input and compares every derived
/// file byte for byte (or rewrites them under `UPDATE_VECTORS=1`).
fn check(name: &str) {
    let input = vector_input(name);
    let json: serde_json::Value = serde_json::from_slice(&input).expect("input is JSON");
    if json.get("schema").is_none() {
        return check_request_digest(name, &input);
    }
    match Kind::of_vector(name) {
        Kind::AdmissionBudget => {
            check_document::<AdmissionBudgetV1>(name, &input);
        }
        Kind::LimitReservation => {
            let receipt = check_document::<LimitReservationV1>(name, &input);
            written_canonical_by_serde(name, &receipt);
        }
        Kind::SettlementReceipt => {
            let receipt = check_document::<SettlementReceiptV1>(name, &input);
            written_canonical_by_serde(name, &receipt);
        }
        Kind::OperationReceipt => {
            check_document::<OperationReceiptV1>(name, &input);
        }
        Kind::EmergencyShard => check_signed::<EmergencyShardV1>(name, input, &central_signer()),
        Kind::ShardTerminalReceipt => {
            check_signed::<ShardTerminalReceiptV1>(name, input, &gateway_signer());
        }
    }
}

fn check_document<D: Document + Clone + PartialEq + Debug>(name: &str, input: &[u8]) -> D {
    let document: D = parse(input).unwrap_or_else(|error| panic!("vector {name}: {error}"));
    let canonical = canonical_bytes(&document);
    expect_file(name, "canonical.json", &canonical);
    let digest = document_digest(&document);
    assert_eq!(digest, Digest::sha256(&canonical), "{name}: digest");
    expect_file(name, "digest", format!("{digest}\n").as_bytes());
    // The canonical bytes are a fixed point.
    let reparsed: D = parse(&canonical).unwrap_or_else(|error| panic!("{name}: {error}"));
    assert_eq!(reparsed, document, "{name}: canonical bytes re-parse");
    assert_eq!(canonical_bytes(&reparsed), canonical, "{name}: fixed point");
    // So is serde_json's own form of it (members in the struct's order).
    let compact = serde_json::to_vec(&document).expect("documents serialize");
    let reparsed: D = parse(&compact).unwrap_or_else(|error| panic!("{name}: {error}"));
    assert_eq!(reparsed, document, "{name}: serde_json bytes re-parse");
    document
}

/// The receipts every call answers declare their fields in the order of
/// their JSON names, so that serde_json writes their canonical bytes itself
/// (the fast way of `canonical_bytes`, and of `parse` reading them back).
/// A field added out of that order fails here instead of slowing them.
fn written_canonical_by_serde<D: Document>(name: &str, document: &D) {
    let written = serde_json::to_vec(document).expect("documents serialize");
    assert_eq!(
        String::from_utf8(written).expect("UTF-8"),
        String::from_utf8(canonical_bytes(document)).expect("UTF-8"),
        "{name}: serde_json's order is not the canonical one"
    );
}

fn check_signed<D: SignedDocument + Clone + PartialEq + Debug>(
    name: &str,
    mut input: Vec<u8>,
    signer: &Ed25519Signer,
) {
    if updating() {
        input = resign_input::<D>(name, input, signer);
    }
    let document: D = check_document(name, &input);
    expect_file(name, "signing.json", &signing_bytes(&document));
    let signature = String::from(*document.signature());
    expect_file(name, "signature", format!("{signature}\n").as_bytes());
    assert_eq!(document.key_id(), signer.key_id(), "{name}: keyId");
    // ed25519 signatures are deterministic: signing again changes nothing.
    let mut resigned = document.clone();
    sign_document(&mut resigned, signer);
    assert_eq!(
        resigned, document,
        "{name}: signature is not the test key's"
    );
    let verifier = Ed25519Verifier::new([signer.key_id().clone()]);
    verify_document(&document, &verifier)
        .unwrap_or_else(|error| panic!("{name}: signature does not verify: {error}"));
}

/// Re-signs a signed input with `signer`, replacing its `keyId` and
/// `signature` text in place so that the rest of the file keeps its layout.
fn resign_input<D: SignedDocument + Clone>(
    name: &str,
    input: Vec<u8>,
    signer: &Ed25519Signer,
) -> Vec<u8> {
    let document: D = parse(&input).unwrap_or_else(|error| panic!("vector {name}: {error}"));
    let mut signed = document.clone();
    sign_document(&mut signed, signer);
    let text = String::from_utf8(input)
        .expect("input is UTF-8")
        .replace(
            &format!("\"keyId\": \"{}\"", document.key_id()),
            &format!("\"keyId\": \"{}\"", signed.key_id()),
        )
        .replace(
            &String::from(*document.signature()),
            &String::from(*signed.signature()),
        );
    let path = vectors_dir().join(format!("{name}.input.json"));
    fs::write(&path, &text).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    text.into_bytes()
}

/// A request digest vector: `request` is optional (absent means `null`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestDigestVector {
    subject: Subject,
    route: Route,
    units: u64,
    #[serde(default)]
    request: Option<serde_json::Value>,
}

fn check_request_digest(name: &str, input: &[u8]) {
    let vector: RequestDigestVector =
        serde_json::from_slice(input).unwrap_or_else(|error| panic!("vector {name}: {error}"));
    // The documented input of the digest, built independently.
    let canonical = canonical_json(&serde_json::json!({
        "subject": vector.subject.as_str(),
        "route": vector.route.as_str(),
        "units": vector.units,
        "request": vector.request.clone().unwrap_or(serde_json::Value::Null),
    }));
    expect_file(name, "canonical.json", &canonical);
    let digest = request_digest(
        &vector.subject,
        &vector.route,
        vector.units,
        vector.request.as_ref(),
    );
    assert_eq!(digest, Digest::sha256(&canonical), "{name}: digest");
    expect_file(name, "digest", format!("{digest}\n").as_bytes());
}

fn updating() -> bool {
    std::env::var_os("UPDATE_VECTORS").is_some_and(|value| value == "1")
}

/// Compares `actual` with `tests/vectors/NAME.SUFFIX` byte for byte, or
/// writes the file under `UPDATE_VECTORS=1`.
fn expect_file(name: &str, suffix: &str, actual: &[u8]) {
    let path = vectors_dir().join(format!("{name}.{suffix}"));
    if updating() {
        fs::write(&path, actual).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
        return;
    }
    let expected = fs::read(&path).unwrap_or_else(|error| {
        panic!(
            "{}: {error}; run with UPDATE_VECTORS=1 to write it",
            path.display()
        )
    });
    assert!(
        expected == actual,
        "{} differs from what the code produces now\n expected: {}\n   actual: {}\n\
         If the encoding was meant to change, rerun with UPDATE_VECTORS=1 and review the diff",
        path.display(),
        String::from_utf8_lossy(&expected),
        String::from_utf8_lossy(actual),
    );
}
