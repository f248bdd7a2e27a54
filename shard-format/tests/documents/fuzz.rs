//! A fuzz target per parser, driven by proptest (cargo-fuzz needs nightly).
//! Each parser gets random bytes, random JSON-like text, and valid documents
//! (canonical or pretty) mutated: truncated, bytes flipped or replaced, JSON
//! tokens inserted, ranges deleted or duplicated. `parse` must never panic,
//! and must accept only what re-parses identically: the canonical bytes of
//! what it accepted parse to the same document, and every member of the
//! accepted input is written as the document writes it.
//!
//! `FUZZ_CASES=N` sets the cases per parser (the default keeps the suite
//! fast), e.g. `FUZZ_CASES=200000 cargo test -p shard-format --release fuzz`.

use std::fmt::Debug;

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::{Index, select};
use serde_json::Value;
use shard_format::{
    AdmissionBudgetV1, Document, EmergencyShardV1, LimitReservationV1, OperationReceiptV1,
    SettlementReceiptV1, ShardTerminalReceiptV1, canonical_bytes, parse,
};

use crate::support::{
    admission_budget, config, emergency_shard, limit_reservation, operation_receipt,
    settlement_receipt, shard_terminal_receipt,
};

proptest! {
    #![proptest_config(config("FUZZ_CASES", 512))]

    #[test]
    fn fuzz_admission_budget(bytes in input(admission_budget())) {
        check_parser::<AdmissionBudgetV1>(&bytes)?;
    }

    #[test]
    fn fuzz_limit_reservation(bytes in input(limit_reservation())) {
        check_parser::<LimitReservationV1>(&bytes)?;
    }

    #[test]
    fn fuzz_settlement_receipt(bytes in input(settlement_receipt())) {
        check_parser::<SettlementReceiptV1>(&bytes)?;
    }

    #[test]
    fn fuzz_operation_receipt(bytes in input(operation_receipt())) {
        check_parser::<OperationReceiptV1>(&bytes)?;
    }

    #[test]
    fn fuzz_emergency_shard(bytes in input(emergency_shard())) {
        check_parser::<EmergencyShardV1>(&bytes)?;
    }

    #[test]
    fn fuzz_shard_terminal_receipt(bytes in input(shard_terminal_receipt())) {
        check_parser::<ShardTerminalReceiptV1>(&bytes)?;
    }
}

/// The oracle: no panic (proptest reports one as a failure), a refusal
/// says why, and an acceptance re-parses identically.
fn check_parser<D: Document + PartialEq + Debug>(bytes: &[u8]) -> Result<(), TestCaseError> {
    let document = match parse::<D>(bytes) {
        Ok(document) => document,
        Err(error) => {
            prop_assert!(!error.message.is_empty(), "refusal without a message");
            return Ok(());
        }
    };
    let canonical = canonical_bytes(&document);
    let again = parse::<D>(&canonical).map_err(|error| {
        TestCaseError::fail(format!(
            "accepted {:?}, but its canonical bytes are refused: {error}",
            String::from_utf8_lossy(bytes)
        ))
    })?;
    prop_assert_eq!(&again, &document);
    prop_assert_eq!(&canonical_bytes(&again), &canonical);
    // Parsing is a function of the bytes.
    prop_assert_eq!(parse::<D>(bytes).ok(), Some(document));

    // Whatever was accepted is a JSON object whose members are written as
    // the document writes them (members it lacks took their defaults).
    let input: Value = serde_json::from_slice(bytes)
        .map_err(|error| TestCaseError::fail(format!("accepted bytes are not JSON: {error}")))?;
    let written: Value = serde_json::from_slice(&canonical).expect("canonical bytes are JSON");
    prop_assert!(
        same_members(&input, &written),
        "accepted {} as {}",
        input,
        written
    );
    Ok(())
}

fn same_members(input: &Value, written: &Value) -> bool {
    match (input, written) {
        (Value::Object(input), Value::Object(written)) => input.iter().all(|(name, member)| {
            written
                .get(name)
                .is_some_and(|expected| same_members(member, expected))
        }),
        _ => input == written,
    }
}

/// Bytes for one parser: mostly mutated valid documents of its type, some
/// random bytes and random JSON-like text.
fn input<D: Document + Debug>(
    documents: impl Strategy<Value = D> + Clone + 'static,
) -> impl Strategy<Value = Vec<u8>> {
    let mutated = (documents, any::<bool>(), vec(mutation(), 1..4)).prop_map(
        |(document, pretty, mutations)| {
            let mut bytes = if pretty {
                serde_json::to_vec_pretty(&document).expect("documents serialize")
            } else {
                canonical_bytes(&document)
            };
            for mutation in &mutations {
                mutation.apply(&mut bytes);
            }
            bytes
        },
    );
    prop_oneof![
        6 => mutated,
        1 => vec(any::<u8>(), 0..256),
        1 => "[{}\\[\\]\":,0-9a-zA-Z .+\\-\\\\]{0,128}".prop_map(String::into_bytes),
    ]
}

/// One change to a document's bytes; positions are taken relative to the
/// length at the time of the change.
#[derive(Debug, Clone)]
enum Mutation {
    Truncate(Index),
    Flip(Index, u8),
    Replace(Index, u8),
    Insert(Index, &'static str),
    InsertBytes(Index, Vec<u8>),
    Delete(Index, usize),
    Duplicate(Index, Index, usize),
}

/// Fragments that make JSON, numbers, timestamps or UTF-8 go wrong in
/// interesting ways.
const TOKENS: [&str; 36] = [
    "{",
    "}",
    "[",
    "]",
    "\"",
    "\\",
    ",",
    ":",
    " ",
    "\n",
    "0",
    "9",
    "-",
    ".",
    "e",
    "null",
    "true",
    "-1",
    "1.5",
    "1e3",
    "18446744073709551616",
    "9007199254740992",
    "\"\"",
    "{}",
    "[]",
    "\\u0000",
    "\\ud800",
    "\\u0041",
    "\"extra\":1,",
    "\"schema\":\"operationReceipt.v1\",",
    "\u{0}",
    "é",
    "\u{2028}",
    "+",
    "Z",
    ".000",
];

/// Bytes a flip rarely reaches: structure, quotes, escapes, invalid UTF-8.
const BYTES: [u8; 14] = [
    b'{', b'}', b'[', b']', b'"', b'\\', b',', b':', b'0', b'-', b'A', 0x00, 0x80, 0xff,
];

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<Index>().prop_map(Mutation::Truncate),
        (any::<Index>(), 1..=255u8).prop_map(|(at, mask)| Mutation::Flip(at, mask)),
        (any::<Index>(), select(BYTES.to_vec())).prop_map(|(at, byte)| Mutation::Replace(at, byte)),
        (any::<Index>(), select(TOKENS.to_vec()))
            .prop_map(|(at, token)| Mutation::Insert(at, token)),
        (any::<Index>(), vec(any::<u8>(), 1..8))
            .prop_map(|(at, bytes)| Mutation::InsertBytes(at, bytes)),
        (any::<Index>(), 1..16usize).prop_map(|(at, length)| Mutation::Delete(at, length)),
        (any::<Index>(), any::<Index>(), 1..32usize)
            .prop_map(|(from, to, length)| Mutation::Duplicate(from, to, length)),
    ]
}

impl Mutation {
    fn apply(&self, bytes: &mut Vec<u8>) {
        let length = bytes.len();
        if length == 0 {
            return;
        }
        match self {
            Self::Truncate(at) => bytes.truncate(at.index(length)),
            Self::Flip(at, mask) => bytes[at.index(length)] ^= mask,
            Self::Replace(at, byte) => bytes[at.index(length)] = *byte,
            Self::Insert(at, token) => {
                let at = at.index(length + 1);
                bytes.splice(at..at, token.bytes());
            }
            Self::InsertBytes(at, inserted) => {
                let at = at.index(length + 1);
                bytes.splice(at..at, inserted.iter().copied());
            }
            Self::Delete(at, count) => {
                let at = at.index(length);
                bytes.drain(at..(at + count).min(length));
            }
            Self::Duplicate(from, to, count) => {
                let from = from.index(length);
                let copied = bytes[from..(from + count).min(length)].to_vec();
                let to = to.index(length + 1);
                bytes.splice(to..to, copied);
            }
        }
    }
}
