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
    let deserializer = &mut serde_json::Deserializer::from_slice(bytes);
    let document: D = serde_path_to_error::deserialize(&mut *deserializer).map_err(|error| {
        let path = field_path(error.path());
        let message = strip_position(&error.into_inner().to_string());
        ParseError::new(named_field(&path, &message), message)
    })?;
    // Nothing may follow the document (`{…}xyz`).
    deserializer
        .end()
        .map_err(|error| ParseError::new("", strip_position(&error.to_string())))?;
    document.validate()?;
    // serde also takes other JSON for the same value: an array for an object,
    // `{"enforce": null}` for `"enforce"`, `null` for an absent member. Refuse
    // any member written otherwise than the document writes it.
    let input: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|error| ParseError::new("", strip_position(&error.to_string())))?;
    let written = serde_json::to_value(&document).expect("v1 documents always serialize to JSON");
    check_written_as("", &input, &written)?;
    Ok(document)
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
    serde_jcs::to_vec(value).expect("v1 documents always serialize to JSON")
}

/// The bytes a signature covers: the canonical bytes of the document with its
/// `signature` member removed (`keyId` stays covered).
pub fn signing_bytes<D: SignedDocument>(document: &D) -> Vec<u8> {
    let mut value = serde_json::to_value(document).expect("v1 documents always serialize to JSON");
    if let serde_json::Value::Object(members) = &mut value {
        members.remove("signature");
    }
    canonical_json(&value)
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
