//! Properties of every document type, over generated valid documents:
//!
//! - `parse(canonical_bytes(x)) == x`, and the digest is SHA-256 of those
//!   bytes;
//! - the canonical bytes are what the crate documentation says, written here
//!   independently (sorted members, no whitespace, minimal escapes);
//! - the canonical bytes do not depend on how the input was written: member
//!   order shuffled at every level, random whitespace between tokens, string
//!   characters randomly written as `\uXXXX` escapes.
//!
//! `PROPTEST_CASES=N` changes the number of cases.

use std::fmt::{Debug, Write as _};

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::Value;
use shard_format::{Digest, Document, canonical_bytes, document_digest, parse};

use crate::support::{
    admission_budget, config, emergency_shard, limit_reservation, operation_receipt,
    settlement_receipt, shard_terminal_receipt,
};

proptest! {
    #![proptest_config(config("PROPTEST_CASES", 128))]

    #[test]
    fn admission_budget_round_trips(document in admission_budget(), seed in any::<u64>()) {
        round_trip(&document, seed)?;
    }

    #[test]
    fn limit_reservation_round_trips(document in limit_reservation(), seed in any::<u64>()) {
        round_trip(&document, seed)?;
    }

    #[test]
    fn settlement_receipt_round_trips(document in settlement_receipt(), seed in any::<u64>()) {
        round_trip(&document, seed)?;
    }

    #[test]
    fn operation_receipt_round_trips(document in operation_receipt(), seed in any::<u64>()) {
        round_trip(&document, seed)?;
    }

    #[test]
    fn emergency_shard_round_trips(document in emergency_shard(), seed in any::<u64>()) {
        round_trip(&document, seed)?;
    }

    #[test]
    fn shard_terminal_receipt_round_trips(
        document in shard_terminal_receipt(),
        seed in any::<u64>(),
    ) {
        round_trip(&document, seed)?;
    }
}

/// Every property, for one document; `seed` drives the scrambling.
fn round_trip<D: Document + PartialEq + Debug>(
    document: &D,
    seed: u64,
) -> Result<(), TestCaseError> {
    let canonical = canonical_bytes(document);
    prop_assert_eq!(&parse::<D>(&canonical)?, document);
    prop_assert_eq!(document_digest(document), Digest::sha256(&canonical));

    let value = serde_json::to_value(document).expect("documents serialize");
    prop_assert_eq!(
        String::from_utf8_lossy(&canonical),
        documented_encoding(&value),
        "canonical bytes differ from the documented encoding"
    );

    let pretty = serde_json::to_vec_pretty(document).expect("documents serialize");
    prop_assert_eq!(&parse::<D>(&pretty)?, document);

    let mut scrambler = Scrambler(seed);
    let mut scrambled = String::new();
    scrambler.write(&value, &mut scrambled);
    let parsed = parse::<D>(scrambled.as_bytes())
        .map_err(|error| TestCaseError::fail(format!("{error} in {scrambled}")))?;
    prop_assert_eq!(&parsed, document);
    prop_assert_eq!(canonical_bytes(&parsed), canonical);
    Ok(())
}

/// The canonical encoding as `lib.rs` documents it for documents (integers
/// only, ASCII member names): members sorted by name, no insignificant
/// whitespace, integers in shortest decimal form, strings with only `"`,
/// `\` and control characters escaped (`\b \t \n \f \r` by name, others as
/// `\u00xx`).
fn documented_encoding(value: &Value) -> String {
    let mut out = String::new();
    write_documented(value, &mut out);
    out
}

fn write_documented(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(flag) => out.push_str(if *flag { "true" } else { "false" }),
        Value::Number(number) => {
            let integer = number.as_u64().expect("documents hold only u64 numbers");
            write!(out, "{integer}").expect("writing to a String");
        }
        Value::String(text) => {
            out.push('"');
            for character in text.chars() {
                match character {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\u{8}' => out.push_str("\\b"),
                    '\t' => out.push_str("\\t"),
                    '\n' => out.push_str("\\n"),
                    '\u{c}' => out.push_str("\\f"),
                    '\r' => out.push_str("\\r"),
                    control if control < ' ' => {
                        write!(out, "\\u{:04x}", u32::from(control)).expect("writing to a String");
                    }
                    other => out.push(other),
                }
            }
            out.push('"');
        }
        Value::Array(items) => {
            out.push('[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                write_documented(item, out);
            }
            out.push(']');
        }
        Value::Object(members) => {
            let mut names: Vec<&String> = members.keys().collect();
            names.sort_by(|left, right| left.as_bytes().cmp(right.as_bytes()));
            out.push('{');
            for (index, name) in names.into_iter().enumerate() {
                if index > 0 {
                    out.push(',');
                }
                write_documented(&Value::String(name.clone()), out);
                out.push(':');
                write_documented(&members[name], out);
            }
            out.push('}');
        }
    }
}

/// Writes JSON that means the same as a value but is spelled differently:
/// members shuffled, whitespace sprinkled, characters escaped at random. A
/// SplitMix64 generator seeded by proptest makes it reproducible.
struct Scrambler(u64);

impl Scrambler {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut mixed = self.0;
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        mixed ^ (mixed >> 31)
    }

    /// A number in `0..bound`.
    fn below(&mut self, bound: usize) -> usize {
        let bound = u64::try_from(bound).expect("small bound");
        usize::try_from(self.next() % bound).expect("below a usize bound")
    }

    fn whitespace(&mut self, out: &mut String) {
        for _ in 0..self.below(4) {
            out.push([' ', '\t', '\n', '\r'][self.below(4)]);
        }
    }

    fn write(&mut self, value: &Value, out: &mut String) {
        self.whitespace(out);
        match value {
            Value::String(text) => self.write_string(text, out),
            Value::Array(items) => {
                out.push('[');
                for (index, item) in items.iter().enumerate() {
                    if index > 0 {
                        out.push(',');
                    }
                    self.write(item, out);
                }
                self.whitespace(out);
                out.push(']');
            }
            Value::Object(members) => {
                let mut members: Vec<(&String, &Value)> = members.iter().collect();
                // Fisher–Yates.
                for last in (1..members.len()).rev() {
                    let other = self.below(last + 1);
                    members.swap(last, other);
                }
                out.push('{');
                for (index, (name, member)) in members.into_iter().enumerate() {
                    if index > 0 {
                        out.push(',');
                    }
                    self.whitespace(out);
                    self.write_string(name, out);
                    self.whitespace(out);
                    out.push(':');
                    self.write(member, out);
                }
                self.whitespace(out);
                out.push('}');
            }
            other => out.push_str(&other.to_string()),
        }
        self.whitespace(out);
    }

    /// A JSON string for `text`, each character escaped with probability 1/4
    /// (as `\uXXXX` in upper or lower case hex, or `\/` for `/`); `"`, `\`
    /// and control characters always.
    fn write_string(&mut self, text: &str, out: &mut String) {
        out.push('"');
        for character in text.chars() {
            let must = matches!(character, '"' | '\\') || character < ' ';
            if !must && self.below(4) != 0 {
                out.push(character);
                continue;
            }
            if character == '/' && self.below(2) == 0 {
                out.push_str("\\/");
                continue;
            }
            let mut units = [0; 2];
            for unit in character.encode_utf16(&mut units) {
                if self.below(2) == 0 {
                    write!(out, "\\u{unit:04x}").expect("writing to a String");
                } else {
                    write!(out, "\\u{unit:04X}").expect("writing to a String");
                }
            }
        }
        out.push('"');
    }
}
