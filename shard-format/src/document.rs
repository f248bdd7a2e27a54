//! What every v1 document shares: its `schema` tag, strict parsing, canonical
//! bytes and (for signed documents) the bytes a signature covers.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::limits::DOCUMENT_SIZE_MAX;
use crate::values::{Digest, KeyId, Signature};

/// Why a document was refused. `field` is the JSON path of the offending
/// value (`refill.units`), or empty for the document as a whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{message}", if field.is_empty() { String::new() } else { format!("field `{field}`: ") })]
pub struct ParseError {
    pub field: String,
    pub message: String,
}

impl ParseError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// A v1 document.
pub trait Document: Serialize + DeserializeOwned {
    /// The `schema` string that names this document, e.g. `admissionBudget.v1`.
    const SCHEMA: &'static str;

    /// Whether the JSON form carries `SCHEMA` in a `schema` member, as every
    /// v1 document does (request bodies do not): an object without one is
    /// refused for it first, whatever member the type declares first.
    const SCHEMA_MEMBER: bool = false;

    /// Rules across fields and limits that serde's types cannot express.
    /// Returns the first violation, naming its field.
    fn validate(&self) -> Result<(), ParseError>;
}

/// A document that carries `keyId` and `signature`.
pub trait SignedDocument: Document {
    fn key_id(&self) -> &KeyId;
    fn signature(&self) -> &Signature;
    fn set_signature(&mut self, key_id: KeyId, signature: Signature);
}

/// Parses `bytes` as a `D`: the right `schema`, no unknown field, every value
/// in range, every rule of [`Document::validate`]. Never panics.
pub fn parse<D: Document>(bytes: &[u8]) -> Result<D, ParseError> {
    if bytes.len() > DOCUMENT_SIZE_MAX {
        return Err(ParseError::new(
            "",
            format!(
                "document is {} bytes; at most {DOCUMENT_SIZE_MAX} are allowed",
                bytes.len()
            ),
        ));
    }
    // The common case, a valid document: typed straight from the bytes.
    // A document that fails is parsed again, tracking the path, so that the
    // refusal names the member at fault (the tracking allocates every
    // member's name: a cost only a refusal needs to pay).
    let deserializer = &mut serde_json::Deserializer::from_slice(bytes);
    let document = match <D as serde::Deserialize>::deserialize(&mut *deserializer) {
        Ok(document) => document,
        Err(error) => {
            let schema_missing = if D::SCHEMA_MEMBER {
                without_schema(bytes)
            } else {
                None
            };
            return Err(schema_missing
                .or_else(|| naming_the_member::<D>(bytes))
                .unwrap_or_else(|| ParseError::new("", strip_position(&error.to_string()))));
        }
    };
    // Nothing may follow the document (`{…}xyz`).
    deserializer
        .end()
        .map_err(|error| ParseError::new("", strip_position(&error.to_string())))?;
    document.validate()?;
    // serde also takes other JSON for the same value: an array for an object,
    // `{"enforce": null}` for `"enforce"`, `null` for an absent member. Refuse
    // any member written otherwise than the document writes it. Bytes that
    // are the document's own JSON, or its canonical bytes (as every
    // Reservoir service sends them), have no such member: that is checked
    // without parsing the input a second time.
    if written_as_these_bytes(&document, bytes) {
        return Ok(document);
    }
    let written = serde_json::to_value(&document).expect("v1 documents always serialize to JSON");
    if canonical_value(&written) == bytes {
        return Ok(document);
    }
    let input: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|error| ParseError::new("", strip_position(&error.to_string())))?;
    check_written_as("", &input, &written)?;
    Ok(document)
}

/// The refusal of an object without a `schema` member: what it lacks first
/// of all, whichever member its type declares first (the receipts declare
/// theirs in name order, see `LimitReservationV1`).
fn without_schema(bytes: &[u8]) -> Option<ParseError> {
    let members: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(bytes).ok()?;
    (!members.contains_key("schema")).then(|| ParseError::new("schema", "missing field `schema`"))
}

/// The refusal of bytes that do not deserialize as a `D`, naming the member
/// at fault (`None` if they do: the caller's own error then stands).
fn naming_the_member<D: Document>(bytes: &[u8]) -> Option<ParseError> {
    let deserializer = &mut serde_json::Deserializer::from_slice(bytes);
    let error = serde_path_to_error::deserialize::<_, D>(deserializer).err()?;
    let path = field_path(error.path());
    let message = strip_position(&error.into_inner().to_string());
    Some(ParseError::new(named_field(&path, &message), message))
}

/// Whether serde_json writes `document` as exactly `bytes`, compared as it
/// writes, without a copy.
fn written_as_these_bytes<D: Serialize>(document: &D, bytes: &[u8]) -> bool {
    /// Fails the write at the first byte that differs from `rest`.
    struct SameBytes<'a> {
        rest: &'a [u8],
    }
    impl std::io::Write for SameBytes<'_> {
        fn write(&mut self, written: &[u8]) -> std::io::Result<usize> {
            match self.rest.strip_prefix(written) {
                Some(rest) => {
                    self.rest = rest;
                    Ok(written.len())
                }
                None => Err(std::io::ErrorKind::InvalidData.into()),
            }
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut same = SameBytes { rest: bytes };
    serde_json::to_writer(&mut same, document).is_ok() && same.rest.is_empty()
}

/// The JSON path serde was at (`refill.units`), up to the first member it
/// could not name: after a syntax error between members, which it would
/// write `?`.
fn field_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut field = String::new();
    for segment in path {
        match segment {
            Segment::Seq { index } => field.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !field.is_empty() {
                    field.push('.');
                }
                field.push_str(key);
            }
            Segment::Unknown => break,
        }
    }
    field
}

/// serde names a missing or duplicate member only in its message; put it in
/// the path.
fn named_field(path: &str, message: &str) -> String {
    let member = ["missing field `", "duplicate field `"]
        .iter()
        .find_map(|prefix| message.strip_prefix(prefix)?.strip_suffix('`'));
    match member {
        Some(member) if path.is_empty() => member.to_owned(),
        Some(member) => format!("{path}.{member}"),
        None => path.to_owned(),
    }
}

/// Returns an error naming the first member of `input` whose JSON differs
/// from the same member of `written` (the parsed document's own JSON form).
/// Members `written` has and `input` lacks took their defaults.
fn check_written_as(
    path: &str,
    input: &serde_json::Value,
    written: &serde_json::Value,
) -> Result<(), ParseError> {
    use serde_json::Value;
    match (input, written) {
        (Value::Object(input), Value::Object(written)) => {
            for (name, value) in input {
                let field = if path.is_empty() {
                    name.clone()
                } else {
                    format!("{path}.{name}")
                };
                match written.get(name) {
                    Some(expected) => check_written_as(&field, value, expected)?,
                    None if value.is_null() => {
                        return Err(ParseError::new(field, "must be omitted, not null"));
                    }
                    None => return Err(ParseError::new(field, "is not a member")),
                }
            }
            Ok(())
        }
        (_, Value::Object(_)) => Err(ParseError::new(path, "must be a JSON object")),
        _ if input == written => Ok(()),
        _ => Err(ParseError::new(path, format!("must be written {written}"))),
    }
}

/// serde_json appends " at line L column C"; the field path says more.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_owned(),
        None => message.to_owned(),
    }
}

/// The canonical bytes of a document: RFC 8785 (JSON Canonicalization
/// Scheme) over its JSON form. See the crate documentation for the rules.
pub fn canonical_bytes<D: Document>(document: &D) -> Vec<u8> {
    canonical_json(document)
}

/// The digest of a document's canonical bytes.
pub fn document_digest<D: Document>(document: &D) -> Digest {
    Digest::sha256(&canonical_bytes(document))
}

/// RFC 8785 bytes of any serializable value whose numbers are integers.
pub fn canonical_json<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    // Serializing our own types to JSON cannot fail: every map key is a
    // string and every number an integer.
    let written = serde_json::to_vec(value).expect("v1 documents always serialize to JSON");
    // The hot documents declare their fields in name order, so serde
    // already wrote the canonical bytes: no JSON tree to build and write
    // again (3 % of the central service's CPU on the agent's healthy path,
    // by perf; docs/benchmarks-history.md).
    if is_canonical(&written) {
        return written;
    }
    let value = serde_json::to_value(value).expect("v1 documents always serialize to JSON");
    canonical_value(&value)
}

/// Whether `json`, compact JSON as serde_json writes it, is already in
/// RFC 8785 form: the members of every object in strictly ascending order
/// of their names, and every number an integer of at most 2^53 in
/// magnitude. Names must be ASCII without escapes, whose byte order is
/// their UTF-16 order; any other name, and anything but compact JSON,
/// answers `false` (the caller then takes the long way). Strings need no
/// check: serde_json escapes them as [`write_string`] does.
fn is_canonical(json: &[u8]) -> bool {
    /// An open object holds the name of its last member.
    enum Open<'a> {
        Object(Option<&'a [u8]>),
        Array,
    }
    let mut open: Vec<Open<'_>> = Vec::new();
    // Whether the next string is a member's name.
    let mut name_next = false;
    let mut at = 0;
    while let Some(&byte) = json.get(at) {
        match byte {
            b'{' => {
                open.push(Open::Object(None));
                name_next = true;
                at += 1;
            }
            b'[' => {
                open.push(Open::Array);
                at += 1;
            }
            b'}' | b']' => {
                if open.pop().is_none() {
                    return false;
                }
                at += 1;
            }
            b',' => {
                name_next = matches!(open.last(), Some(Open::Object(_)));
                at += 1;
            }
            b':' => at += 1,
            b'"' => {
                let start = at + 1;
                let mut end = start;
                loop {
                    match json.get(end) {
                        Some(b'"') => break,
                        Some(b'\\') => end += 2,
                        Some(_) => end += 1,
                        None => return false,
                    }
                }
                if name_next {
                    let name = &json[start..end];
                    if !name.iter().all(|byte| byte.is_ascii() && *byte != b'\\') {
                        return false;
                    }
                    let Some(Open::Object(last)) = open.last_mut() else {
                        return false;
                    };
                    if last.is_some_and(|last| last >= name) {
                        return false;
                    }
                    *last = Some(name);
                    name_next = false;
                }
                at = end + 1;
            }
            b'-' | b'0'..=b'9' => {
                let start = at + usize::from(byte == b'-');
                let mut end = start;
                while json.get(end).is_some_and(u8::is_ascii_digit) {
                    end += 1;
                }
                let plain = std::str::from_utf8(&json[start..end])
                    .ok()
                    .and_then(|digits| digits.parse::<u64>().ok())
                    .is_some_and(|magnitude| magnitude <= EXACT_MAX);
                // A fraction or an exponent follows: not an integer.
                if !plain || matches!(json.get(end), Some(b'.' | b'e' | b'E')) {
                    return false;
                }
                at = end;
            }
            b't' if json[at..].starts_with(b"true") => at += 4,
            b'f' if json[at..].starts_with(b"false") => at += 5,
            b'n' if json[at..].starts_with(b"null") => at += 4,
            _ => return false,
        }
    }
    open.is_empty()
}

/// The bytes a signature covers: the canonical bytes of the document with its
/// `signature` member removed (`keyId` stays covered).
pub fn signing_bytes<D: SignedDocument>(document: &D) -> Vec<u8> {
    let mut value = serde_json::to_value(document).expect("v1 documents always serialize to JSON");
    if let serde_json::Value::Object(members) = &mut value {
        members.remove("signature");
    }
    canonical_value(&value)
}

/// RFC 8785 bytes of a JSON value. Written directly when every number is
/// an integer of at most 2^53 in magnitude (every number of a v1 document:
/// the limits keep them there), which JCS writes as its plain digits;
/// any other number goes the long way, through `serde_jcs`, which formats
/// it as ECMAScript does.
fn canonical_value(value: &serde_json::Value) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(512);
    match write_canonical(value, &mut bytes) {
        Ok(()) => bytes,
        Err(NotPlainInteger) => {
            serde_jcs::to_vec(value).expect("JSON values always serialize to JSON")
        }
    }
}

/// A number [`write_canonical`] leaves to `serde_jcs`.
pub(crate) struct NotPlainInteger;

/// Integers JCS writes exactly as their digits (an IEEE double holds them
/// exactly, and ECMAScript prints such a double's digits).
pub(crate) const EXACT_MAX: u64 = 1 << 53;

/// Writes `value` as RFC 8785 does: no whitespace, members sorted by the
/// UTF-16 code units of their names, strings escaped as ECMAScript's
/// `JSON.stringify` escapes them (serde_json's compact escaping is that
/// one: `\"`, `\\`, `\b`, `\f`, `\n`, `\r`, `\t`, other controls as
/// lowercase `\u00xx`, everything else as is), integers as their digits.
pub(crate) fn write_canonical(
    value: &serde_json::Value,
    bytes: &mut Vec<u8>,
) -> Result<(), NotPlainInteger> {
    use serde_json::Value;
    use std::io::Write as _;
    match value {
        Value::Null => bytes.extend_from_slice(b"null"),
        Value::Bool(true) => bytes.extend_from_slice(b"true"),
        Value::Bool(false) => bytes.extend_from_slice(b"false"),
        Value::Number(number) => {
            let written = match (number.as_u64(), number.as_i64()) {
                (Some(n), _) if n <= EXACT_MAX => write!(bytes, "{n}"),
                (None, Some(n)) if n.unsigned_abs() <= EXACT_MAX => write!(bytes, "{n}"),
                _ => return Err(NotPlainInteger),
            };
            written.expect("writing to a Vec cannot fail");
        }
        Value::String(string) => write_string(string, bytes),
        Value::Array(items) => {
            bytes.push(b'[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    bytes.push(b',');
                }
                write_canonical(item, bytes)?;
            }
            bytes.push(b']');
        }
        Value::Object(members) => {
            let mut sorted: Vec<(&String, &Value)> = members.iter().collect();
            sorted.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            bytes.push(b'{');
            for (index, (name, member)) in sorted.into_iter().enumerate() {
                if index > 0 {
                    bytes.push(b',');
                }
                write_string(name, bytes);
                bytes.push(b':');
                write_canonical(member, bytes)?;
            }
            bytes.push(b'}');
        }
    }
    Ok(())
}

pub(crate) fn write_string(string: &str, bytes: &mut Vec<u8>) {
    serde_json::to_writer(&mut *bytes, string).expect("writing a string to a Vec cannot fail");
}

/// Defines a zero-sized `schema` tag: it serializes as its string and
/// deserializes only from exactly that string.
macro_rules! schema_tag {
    ($(#[$meta:meta])* $name:ident = $schema:literal) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
        pub struct $name;

        impl $name {
            pub const SCHEMA: &'static str = $schema;
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str($schema)
            }
        }

        #[cfg(feature = "schema")]
        impl schemars::JsonSchema for $name {
            fn schema_name() -> std::borrow::Cow<'static, str> {
                stringify!($name).into()
            }

            fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
                crate::schema::tag($schema)
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let found = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
                if found == $schema {
                    Ok($name)
                } else {
                    Err(serde::de::Error::custom(format!(
                        "expected schema {:?}, found {:?}",
                        $schema, found
                    )))
                }
            }
        }
    };
}
pub(crate) use schema_tag;

/// Returns an error naming `field` unless `value <= max`.
pub(crate) fn check_at_most(field: &str, value: u64, max: u64) -> Result<(), ParseError> {
    if value > max {
        return Err(ParseError::new(
            field,
            format!("{value} is above the maximum {max}"),
        ));
    }
    Ok(())
}

/// Returns an error naming `field` unless `1 <= value <= max`.
pub(crate) fn check_positive_at_most(field: &str, value: u64, max: u64) -> Result<(), ParseError> {
    if value == 0 {
        return Err(ParseError::new(field, "must be at least 1"));
    }
    check_at_most(field, value, max)
}

/// Returns an error naming `field` unless the label is 1..=max bytes of
/// printable ASCII.
pub(crate) fn check_label(field: &str, value: &str, max: usize) -> Result<(), ParseError> {
    if value.is_empty() || value.len() > max {
        return Err(ParseError::new(
            field,
            format!("must be 1 to {max} bytes long, found {}", value.len()),
        ));
    }
    if !value.bytes().all(|byte| (0x20..0x7f).contains(&byte)) {
        return Err(ParseError::new(field, "must be printable ASCII"));
    }
    Ok(())
}

/// A JSON member's name, as a [`serde::de::DeserializeSeed`]: borrowed from
/// the input unless it has escapes, so that reading an object's names
/// allocates nothing in the common case (serde's `Cow<str>` always copies).
#[derive(Debug, Clone, Copy)]
pub struct MemberName;

impl<'de> serde::de::DeserializeSeed<'de> for MemberName {
    type Value = std::borrow::Cow<'de, str>;

    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> serde::de::Visitor<'de> for MemberName {
    type Value = std::borrow::Cow<'de, str>;

    fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("a member name")
    }

    fn visit_borrowed_str<E>(self, name: &'de str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Borrowed(name))
    }

    fn visit_str<E>(self, name: &str) -> Result<Self::Value, E> {
        Ok(std::borrow::Cow::Owned(name.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member_name(json: &str) -> Result<std::borrow::Cow<'_, str>, serde_json::Error> {
        serde::de::DeserializeSeed::deserialize(
            MemberName,
            &mut serde_json::Deserializer::from_str(json),
        )
    }

    /// A name is borrowed from the input; one with an escape is read into
    /// its own string; anything but a string is refused as a member name.
    #[test]
    fn a_member_name_is_borrowed_unless_it_has_escapes() {
        let plain = member_name(r#""operationId""#).expect("a name");
        assert!(
            matches!(&plain, std::borrow::Cow::Borrowed("operationId")),
            "{plain:?}"
        );
        let escaped = member_name(r#""op\u0065rationId""#).expect("a name");
        assert!(
            matches!(&escaped, std::borrow::Cow::Owned(name) if name == "operationId"),
            "{escaped:?}"
        );
        let error = member_name("12").expect_err("a number is no name");
        assert!(
            error.to_string().contains("expected a member name"),
            "{error}"
        );
    }

    /// The fast check of [`parse`] holds only for the very bytes serde_json
    /// writes: not a prefix of them, not more, not one byte changed.
    #[test]
    fn only_the_written_bytes_are_written_as_these_bytes() {
        let value = serde_json::json!({"units": 1, "route": "chat"});
        let written = serde_json::to_vec(&value).expect("serializes");
        assert!(written_as_these_bytes(&value, &written));
        assert!(!written_as_these_bytes(
            &value,
            &written[..written.len() - 1]
        ));
        assert!(!written_as_these_bytes(
            &value,
            &[&written[..], b" "].concat()
        ));
        let mut changed = written.clone();
        changed[1] ^= 1;
        assert!(!written_as_these_bytes(&value, &changed));
        assert!(!written_as_these_bytes(&value, b""));
    }

    /// Only compact JSON with every object's names strictly ascending, ASCII
    /// and unescaped, and integers of at most 2^53, passes as canonical.
    #[test]
    fn only_ordered_plain_integer_json_is_canonical() {
        let canonical: [&[u8]; 9] = [
            br#"{"a":1,"b":{"c":[1,2,{"a":null,"b":true}]},"c":false}"#,
            br#"{"":"x","a":[]}"#,
            br#"{"a":"}\"{,:","b":"\\"}"#,
            br#"[{"b":1},{"a":2}]"#,
            b"-9007199254740992",
            b"9007199254740992",
            br#""text""#,
            b"{}",
            b"[]",
        ];
        for json in canonical {
            assert!(is_canonical(json), "{}", String::from_utf8_lossy(json));
        }
        let not_canonical: [&[u8]; 17] = [
            br#"{"b":1,"a":2}"#,
            br#"{"a":1,"a":1}"#,
            br#"{"a":{"d":1,"c":2}}"#,
            br#"{"b":{},"a":1}"#,
            "{\"é\":1}".as_bytes(),
            br#"{"a\"":1}"#,
            b"9007199254740993",
            b"-9007199254740993",
            b"1.5",
            b"1e21",
            br#"{"a": 1}"#,
            br#"{"a":1"#,
            b"}",
            br#"{"a":tru}"#,
            // Not a literal, though as long as one.
            br#"{"a":tabc}"#,
            br#"{"a":fabcd}"#,
            br#"{"a":nabc}"#,
        ];
        for json in not_canonical {
            assert!(!is_canonical(json), "{}", String::from_utf8_lossy(json));
        }
    }

    /// The direct writer and `serde_jcs` agree byte for byte, on what the
    /// writer writes itself and on what it hands over.
    #[test]
    fn canonical_bytes_are_serde_jcs_bytes() {
        let values = [
            serde_json::json!(null),
            serde_json::json!({"b": 1, "a": [true, false, null], "": "x"}),
            serde_json::json!({"z": {"y": {"x": [1, -1, 0, 9_007_199_254_740_992_u64]}}}),
            serde_json::json!({"big": 9_007_199_254_740_993_u64, "small": 1}),
            serde_json::json!({"neg": -9_007_199_254_740_993_i64}),
            serde_json::json!({"max": u64::MAX, "min": i64::MIN}),
            serde_json::json!({"float": 1.5, "whole": 2.0, "tiny": 1e-7, "huge": 1e21}),
            serde_json::json!(
                "quote \" backslash \\ slash / controls \u{0} \u{8} \u{c} \n \r \t \u{1f} \u{7f}"
            ),
            serde_json::json!({"é": 1, "e": 2, "\u{ffff}": 3, "\u{10000}": 4, "Z": 5, "\u{e000}": 6}),
            serde_json::json!(["ü", "日本", "😀", ""]),
            serde_json::json!([]),
            serde_json::json!({}),
        ];
        for value in values {
            assert_eq!(
                String::from_utf8(canonical_json(&value)).expect("UTF-8"),
                serde_jcs::to_string(&value).expect("serializes"),
                "{value}"
            );
        }
    }
}
