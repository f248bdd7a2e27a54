//! The scalar values the documents are made of: identifiers, digests,
//! timestamps, nonces, key IDs and signatures. Each is a newtype that can only
//! hold a valid value, and each (de)serializes as a JSON string.

use std::fmt;
use std::str::FromStr;

use arcstr::ArcStr;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::limits::IDENTIFIER_LENGTH_MAX;

/// Why a scalar value was refused. The parser adds the field's path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ValueError(pub(crate) String);

impl ValueError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

/// Bytes allowed in identifiers: URL path-safe without escaping (RFC 3986
/// unreserved characters plus `:` and `@`), so every identifier can stand in
/// an API path as it is.
fn is_identifier_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~' | b':' | b'@')
}

fn check_identifier(value: &str) -> Result<(), ValueError> {
    if value.is_empty() {
        return Err(ValueError::new("must not be empty"));
    }
    if value.len() > IDENTIFIER_LENGTH_MAX {
        return Err(ValueError::new(format!(
            "is {} bytes long; at most {IDENTIFIER_LENGTH_MAX} are allowed",
            value.len()
        )));
    }
    if let Some(bad) = value.bytes().find(|byte| !is_identifier_byte(*byte)) {
        return Err(ValueError::new(format!(
            "contains {:?}; only ASCII letters, digits and - . _ ~ : @ are allowed",
            char::from(bad)
        )));
    }
    // A path segment of its own in an API path: `.` and `..` would name
    // another resource once a client or proxy normalizes the path.
    if value == "." || value == ".." {
        return Err(ValueError::new(format!(
            "{value:?} is a relative path segment, not an identifier"
        )));
    }
    Ok(())
}

/// Deserializes `$name` with `$parse` (`fn(&str) -> Result<$name,
/// ValueError>`) from the text as the format lends it: no `String` on the
/// way.
macro_rules! deserialize_from_text {
    ($name:ident, $parse:expr) => {
        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                struct Text;
                impl serde::de::Visitor<'_> for Text {
                    type Value = $name;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("a string")
                    }
                    fn visit_str<E: serde::de::Error>(self, value: &str) -> Result<$name, E> {
                        let parse: fn(&str) -> Result<$name, ValueError> = $parse;
                        parse(value).map_err(E::custom)
                    }
                }
                deserializer.deserialize_str(Text)
            }
        }
    };
}

// An identifier is shared, not copied: the cores key several maps and
// records by the same IDs (a reservation's ID sits in the agent's map, its
// record, the shard book and its expiry index), so a clone is a reference
// count, not an allocation and a copy — in the agent's memory with 100,000
// open reservations and in the simulator's profile both. And it is one
// pointer wide (`ArcStr` keeps the length with the text, where `Arc<str>`
// kept it beside the pointer): every record, map slot and index entry
// that holds one is a word smaller.
macro_rules! identifier {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(ArcStr);

        impl $name {
            /// Checks `value` against the identifier rules.
            pub fn new(value: impl Into<String>) -> Result<Self, ValueError> {
                Self::checked(&value.into())
            }

            fn checked(value: &str) -> Result<Self, ValueError> {
                check_identifier(value)?;
                Ok(Self(value.into()))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = ValueError;
            fn try_from(value: String) -> Result<Self, ValueError> {
                Self::new(value)
            }
        }

        impl FromStr for $name {
            type Err = ValueError;
            fn from_str(value: &str) -> Result<Self, ValueError> {
                Self::checked(value)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.0.as_str().to_owned()
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        // Read from the borrowed text: one allocation, for the shared copy.
        deserialize_from_text!($name, $name::checked);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.0)
            }
        }
    };
}

identifier!(
    /// Who is admitted: a tenant, an API key, a user (`tenant-7`).
    Subject
);
identifier!(
    /// What is admitted: the route or operation class (`chat.generate`).
    Route
);
identifier!(
    /// A reservation's ID, chosen by the caller once, before the first send,
    /// and reused by every retry (`rl-01J…`).
    ReservationId
);
impl ReservationId {
    /// The ID of the reservation `identity` makes for its idempotency `key`
    /// on the pair: `rl-` and 32 hex digits of SHA-256 over the
    /// length-prefixed identity, subject, route and key.
    ///
    /// The same key always maps to the same ID — a retry can never reserve
    /// twice, even after an agent lost its journal — and the identity is part
    /// of the input, so reservation IDs live in a per-identity namespace: the
    /// central ledger accepts a reserve (or a first abandon) only for the ID
    /// derived from the caller's own identity, so no identity can take an ID
    /// another will use.
    pub fn derive(
        identity: &GatewayIdentity,
        subject: &Subject,
        route: &Route,
        key: &IdempotencyKey,
    ) -> Self {
        let parts = [
            identity.as_str(),
            subject.as_str(),
            route.as_str(),
            key.as_str(),
        ];
        // Sized up front: derived at every reserve, and grown as it was
        // written it reallocated about three times.
        let mut input = Vec::with_capacity(parts.iter().map(|part| 8 + part.len()).sum());
        for part in parts {
            input.extend_from_slice(&(part.len() as u64).to_be_bytes());
            input.extend_from_slice(part.as_bytes());
        }
        let digest = Sha256::digest(&input);
        Self(HexText::new("rl-", &digest[..16]).as_str().into())
    }
}

identifier!(
    /// The executor operation bound to a reservation by `start`.
    OperationId
);
identifier!(
    /// An emergency shard's ID, chosen by the central ledger.
    ShardId
);
identifier!(
    /// The gateway's key for one logical request; the agent maps it to one
    /// reservation ID.
    IdempotencyKey
);

/// A value's text, `prefix` and the lowercase hex of at most 64 bytes,
/// made on the stack: digests and derived IDs are written on every
/// admission (journal records, answers, the simulator's steps), and
/// `hex::encode` builds its `String` one character at a time.
struct HexText {
    buffer: [u8; HEX_TEXT_MAX],
    len: usize,
}

/// The longest text: an 8-byte prefix and a signature's 128 digits.
const HEX_TEXT_MAX: usize = 8 + 2 * 64;

impl HexText {
    fn new(prefix: &str, bytes: &[u8]) -> Self {
        let mut buffer = [0; HEX_TEXT_MAX];
        let len = prefix.len() + 2 * bytes.len();
        buffer[..prefix.len()].copy_from_slice(prefix.as_bytes());
        hex::encode_to_slice(bytes, &mut buffer[prefix.len()..len])
            .expect("the slice holds two digits per byte");
        Self { buffer, len }
    }

    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.buffer[..self.len]).expect("hex digits are ASCII")
    }
}

/// Serializes a fixed-size byte value as its text (`$prefix` and lowercase
/// hex) and reads it back with `$parse`, borrowing the text where the
/// format allows: no `String` on the way either side.
macro_rules! hex_text {
    ($name:ident, $prefix:expr, $parse:expr) => {
        impl $name {
            fn hex_text(&self) -> HexText {
                HexText::new($prefix, &self.0)
            }
        }

        impl From<$name> for String {
            fn from(value: $name) -> String {
                value.hex_text().as_str().to_owned()
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.hex_text().as_str())
            }
        }

        deserialize_from_text!($name, $parse);
    };
}

/// A SHA-256 digest, written `sha256:<64 lowercase hex digits>`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Digest(pub [u8; 32]);
hex_text!(Digest, Digest::PREFIX, str::parse);

impl Digest {
    const PREFIX: &'static str = "sha256:";

    /// The SHA-256 digest of `bytes`.
    pub fn sha256(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }
}

impl TryFrom<String> for Digest {
    type Error = ValueError;
    fn try_from(value: String) -> Result<Self, ValueError> {
        value.parse()
    }
}

impl FromStr for Digest {
    type Err = ValueError;
    fn from_str(value: &str) -> Result<Self, ValueError> {
        let hex_digits = value
            .strip_prefix(Self::PREFIX)
            .ok_or_else(|| ValueError::new("must start with `sha256:`"))?;
        Ok(Self(decode_lower_hex(hex_digits)?))
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.hex_text().as_str())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({self})")
    }
}

/// Decodes exactly `N` bytes from lowercase hex; uppercase is refused so that
/// every value has one spelling.
fn decode_lower_hex<const N: usize>(digits: &str) -> Result<[u8; N], ValueError> {
    if digits.len() != 2 * N {
        return Err(ValueError::new(format!(
            "needs {} hex digits, found {}",
            2 * N,
            digits.len()
        )));
    }
    if digits
        .bytes()
        .any(|byte| !matches!(byte, b'0'..=b'9' | b'a'..=b'f'))
    {
        return Err(ValueError::new("must be lowercase hex digits (0-9, a-f)"));
    }
    let mut bytes = [0; N];
    hex::decode_to_slice(digits, &mut bytes)
        .map_err(|error| ValueError::new(format!("bad hex: {error}")))?;
    Ok(bytes)
}

/// The random nonce the central ledger hands an agent with each boot epoch;
/// the agent keeps it in memory only. 16 bytes, 32 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BootNonce(pub [u8; 16]);
hex_text!(BootNonce, "", |value| decode_lower_hex(value)
    .map(BootNonce));

impl TryFrom<String> for BootNonce {
    type Error = ValueError;
    fn try_from(value: String) -> Result<Self, ValueError> {
        Ok(Self(decode_lower_hex(&value)?))
    }
}

impl fmt::Debug for BootNonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BootNonce({})", hex::encode(self.0))
    }
}

/// An ed25519 signature: 64 bytes, 128 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Signature(pub [u8; 64]);
hex_text!(Signature, "", |value| decode_lower_hex(value)
    .map(Signature));

impl Signature {
    /// The all-zero placeholder a document carries before it is signed.
    pub const UNSIGNED: Self = Self([0; 64]);
}

impl TryFrom<String> for Signature {
    type Error = ValueError;
    fn try_from(value: String) -> Result<Self, ValueError> {
        Ok(Self(decode_lower_hex(&value)?))
    }
}

impl fmt::Debug for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Signature({})", hex::encode(self.0))
    }
}

/// Names a signing key. Real keys are `ed25519:<64 lowercase hex digits of the
/// public key>`, so the ID is the key: a verifier needs only the set of IDs it
/// trusts. Other schemes (the simulator's cheap signer) use other prefixes.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct KeyId(String);

impl KeyId {
    pub const ED25519_PREFIX: &'static str = "ed25519:";

    /// The key ID of an ed25519 public key.
    pub fn ed25519(public_key: &[u8; 32]) -> Self {
        Self(format!(
            "{}{}",
            Self::ED25519_PREFIX,
            hex::encode(public_key)
        ))
    }

    pub fn new(value: impl Into<String>) -> Result<Self, ValueError> {
        let value = value.into();
        check_identifier(&value)?;
        let (scheme, rest) = value
            .split_once(':')
            .ok_or_else(|| ValueError::new("must be `<scheme>:<key>`, e.g. `ed25519:<hex>`"))?;
        if scheme.is_empty() || rest.is_empty() {
            return Err(ValueError::new(
                "must be `<scheme>:<key>`, e.g. `ed25519:<hex>`",
            ));
        }
        if scheme == "ed25519" {
            decode_lower_hex::<32>(rest)?;
        }
        Ok(Self(value))
    }

    /// Whether this is an `ed25519:` key ID whose bytes are a point on the
    /// curve and not of small order: a key that could verify a signature
    /// (enrolment accepts nothing else).
    pub fn is_usable_ed25519_key(&self) -> bool {
        self.ed25519_public_key()
            .and_then(|bytes| ed25519_dalek::VerifyingKey::from_bytes(&bytes).ok())
            .is_some_and(|key| !key.is_weak())
    }

    /// The public key bytes, for an `ed25519:` key ID.
    pub fn ed25519_public_key(&self) -> Option<[u8; 32]> {
        let digits = self.0.strip_prefix(Self::ED25519_PREFIX)?;
        decode_lower_hex(digits).ok()
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for KeyId {
    type Error = ValueError;
    fn try_from(value: String) -> Result<Self, ValueError> {
        Self::new(value)
    }
}

impl FromStr for KeyId {
    type Err = ValueError;
    fn from_str(value: &str) -> Result<Self, ValueError> {
        Self::new(value)
    }
}

impl From<KeyId> for String {
    fn from(value: KeyId) -> String {
        value.0
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({:?})", self.0)
    }
}

/// A gateway's identity is its agent's signing key: the key ID of the agent's
/// public key (docs/design.md §5.1). Terminal receipts are verified with it.
pub type GatewayIdentity = KeyId;

/// A point in time, as milliseconds since the Unix epoch. In documents it is
/// RFC 3339 UTC with exactly three fraction digits and `Z`
/// (`2026-07-19T14:00:00.000Z`): one spelling per instant, so canonical bytes
/// and signatures are reproducible.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

// Written and read as text with no `String` on the way: a receipt carries
// three or four timestamps, and every document the services sign, send,
// parse and journal writes them.
impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}
deserialize_from_text!(Timestamp, str::parse);

impl Timestamp {
    /// The largest timestamp: the last millisecond of year 9999.
    pub const MAX: Self = Self(253_402_300_799_999);

    /// A timestamp `ms` milliseconds after the Unix epoch, if not past [`Self::MAX`].
    pub fn from_unix_ms(ms: u64) -> Result<Self, ValueError> {
        if ms > Self::MAX.0 {
            return Err(ValueError::new("is after year 9999"));
        }
        Ok(Self(ms))
    }

    pub fn unix_ms(self) -> u64 {
        self.0
    }

    /// `self + ms`, capped at [`Self::MAX`].
    pub fn saturating_add_ms(self, ms: u64) -> Self {
        Self(self.0.saturating_add(ms).min(Self::MAX.0))
    }

    /// The document's spelling, `2026-07-19T14:00:00.000Z`: the calendar
    /// from `time`, the digits put in place here (28 ns against 155 for
    /// `time`'s formatting by the format description, which also returns
    /// a `String`). `None` past year 9999, which a `Timestamp` never is.
    fn text(self) -> Option<[u8; 24]> {
        fn put(text: &mut [u8], mut value: u32) {
            for place in text.iter_mut().rev() {
                *place = b"0123456789"[(value % 10) as usize];
                value /= 10;
            }
        }
        let nanos = i128::from(self.0) * 1_000_000;
        let at = time::OffsetDateTime::from_unix_timestamp_nanos(nanos).ok()?;
        let (year, month, day) = at.to_calendar_date();
        let (hour, minute, second, milli) = at.to_hms_milli();
        let year = u32::try_from(year).ok().filter(|year| *year <= 9999)?;
        let mut text = *b"0000-00-00T00:00:00.000Z";
        put(&mut text[0..4], year);
        put(&mut text[5..7], u8::from(month).into());
        put(&mut text[8..10], day.into());
        put(&mut text[11..13], hour.into());
        put(&mut text[14..16], minute.into());
        put(&mut text[17..19], second.into());
        put(&mut text[20..23], milli.into());
        Some(text)
    }
}

impl FromStr for Timestamp {
    type Err = ValueError;
    /// The one spelling [`Self::text`] writes: the digits read here, the
    /// calendar (month lengths, leap days, no second 60) checked by `time`.
    /// 16 ns a timestamp, against about 100 for `time`'s parsing by the
    /// format description, which also took a signed year and so had to be
    /// written back and compared.
    fn from_str(value: &str) -> Result<Self, ValueError> {
        let refused = || {
            ValueError::new(format!(
                "{value:?} is not RFC 3339 UTC with milliseconds, e.g. 2026-07-19T14:00:00.000Z"
            ))
        };
        const SHAPE: &[u8; 24] = b"0000-00-00T00:00:00.000Z";
        let text: &[u8; 24] = value.as_bytes().try_into().map_err(|_| refused())?;
        let shaped = text.iter().zip(SHAPE).all(|(byte, shape)| match shape {
            b'0' => byte.is_ascii_digit(),
            _ => byte == shape,
        });
        if !shaped {
            return Err(refused());
        }
        let number = |at: std::ops::Range<usize>| {
            text[at]
                .iter()
                .fold(0u16, |number, digit| number * 10 + u16::from(digit - b'0'))
        };
        // Each field has at most four digits: it fits its type.
        let narrow = |at| u8::try_from(number(at)).map_err(|_| refused());
        let month = time::Month::try_from(narrow(5..7)?).map_err(|_| refused())?;
        let date = time::Date::from_calendar_date(i32::from(number(0..4)), month, narrow(8..10)?)
            .map_err(|_| refused())?;
        let time_of_day = time::Time::from_hms_milli(
            narrow(11..13)?,
            narrow(14..16)?,
            narrow(17..19)?,
            number(20..23),
        )
        .map_err(|_| refused())?;
        let ms = time::PrimitiveDateTime::new(date, time_of_day)
            .assume_utc()
            .unix_timestamp_nanos()
            / 1_000_000;
        u64::try_from(ms)
            .map(Self)
            .map_err(|_| ValueError::new("is before 1970-01-01T00:00:00.000Z"))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = self.text().ok_or(fmt::Error)?;
        f.write_str(std::str::from_utf8(&text).map_err(|_| fmt::Error)?)
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Timestamp({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_read_and_write_as_checked_text() {
        let id: ReservationId = serde_json::from_str("\"rl-7\"").expect("valid");
        assert_eq!(id.as_str(), "rl-7");
        assert_eq!(serde_json::to_string(&id).expect("JSON"), "\"rl-7\"");
        assert_eq!(String::from(id.clone()), "rl-7");
        // Read through the same rules as `new`: never a panic, the rule's
        // sentence in the error.
        let error = serde_json::from_str::<ReservationId>("\"rl/7\"").expect_err("a slash");
        assert!(error.to_string().contains("only ASCII letters"), "{error}");
        assert!(serde_json::from_str::<Subject>("\"..\"").is_err());
        assert!(serde_json::from_str::<Subject>("\"\"").is_err());
        let error = serde_json::from_str::<Route>("7").expect_err("not text");
        assert!(error.to_string().contains("expected a string"), "{error}");
    }

    /// Records, map slots and index entries hold identifiers by the
    /// hundred thousand: each is one pointer, `None` included, and a clone
    /// shares the text.
    #[test]
    fn an_identifier_is_one_pointer_wide_and_shared_by_its_clones() {
        assert_eq!(size_of::<ReservationId>(), size_of::<usize>());
        assert_eq!(size_of::<Option<OperationId>>(), size_of::<usize>());
        let id = ReservationId::new("rl-7").expect("valid");
        let clone = id.clone();
        assert_eq!(clone, id);
        assert!(std::ptr::eq(clone.as_str(), id.as_str()));
    }

    #[test]
    fn hex_values_read_and_write_as_lowercase_text() {
        // SHA-256 of nothing, as every tool prints it.
        let empty = Digest::sha256(b"");
        let text = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
        assert_eq!(empty.to_string(), text);
        assert_eq!(String::from(empty), text);
        assert_eq!(
            serde_json::to_string(&empty).expect("JSON"),
            format!("\"{text}\"")
        );
        let read: Digest = serde_json::from_str(&format!("\"{text}\"")).expect("valid");
        assert_eq!(read, empty);
        let error = serde_json::from_str::<Digest>(&format!("\"{}\"", text.to_uppercase()))
            .expect_err("uppercase");
        assert!(
            error.to_string().contains("must start with `sha256:`"),
            "{error}"
        );
        let error = serde_json::from_str::<Digest>("\"sha256:E3\"").expect_err("short");
        assert!(error.to_string().contains("needs 64 hex digits"), "{error}");
        let error = serde_json::from_str::<Digest>("7").expect_err("not text");
        assert!(error.to_string().contains("expected a string"), "{error}");

        let signature = Signature([0xab; 64]);
        let json = serde_json::to_string(&signature).expect("JSON");
        assert_eq!(json, format!("\"{}\"", "ab".repeat(64)));
        assert_eq!(
            serde_json::from_str::<Signature>(&json).expect("valid"),
            signature
        );
        let nonce = BootNonce([0x01; 16]);
        assert_eq!(String::from(nonce), "01".repeat(16));
        let json = serde_json::to_string(&nonce).expect("JSON");
        assert_eq!(
            serde_json::from_str::<BootNonce>(&json).expect("valid"),
            nonce
        );
        assert!(serde_json::from_str::<BootNonce>("\"0g\"").is_err());
    }

    #[test]
    fn a_derived_reservation_id_is_rl_and_the_first_16_bytes_of_sha256_in_hex() {
        let identity = GatewayIdentity::new("test:gw-1").expect("valid");
        let subject = Subject::new("tenant-7").expect("valid");
        let route = Route::new("chat.generate").expect("valid");
        let key = IdempotencyKey::new("req-42").expect("valid");
        let mut input = Vec::new();
        for part in ["test:gw-1", "tenant-7", "chat.generate", "req-42"] {
            input.extend_from_slice(&(part.len() as u64).to_be_bytes());
            input.extend_from_slice(part.as_bytes());
        }
        let expected = format!("rl-{}", hex::encode(&Sha256::digest(&input)[..16]));
        let derived = ReservationId::derive(&identity, &subject, &route, &key);
        assert_eq!(derived.as_str(), expected);
        assert_eq!(derived.as_str().len(), 35);
    }

    #[test]
    fn dot_segments_are_not_identifiers() {
        for value in [".", ".."] {
            let error = ReservationId::new(value).expect_err(value);
            assert!(
                error.to_string().contains("relative path segment"),
                "{error}"
            );
            assert!(Subject::new(value).is_err(), "{value}");
        }
        for value in ["...", ".a", "rl-1.2", "a..b"] {
            assert!(ReservationId::new(value).is_ok(), "{value}");
        }
    }

    #[test]
    fn only_curve_points_of_full_order_are_usable_keys() {
        let real = crate::Ed25519Signer::from_secret_bytes(&[7; 32]);
        assert!(crate::DocumentSigner::key_id(&real).is_usable_ed25519_key());
        // y = 2 has no x on the curve.
        let mut off_curve = [0u8; 32];
        off_curve[0] = 2;
        let key = KeyId::ed25519(&off_curve);
        assert!(key.ed25519_public_key().is_some(), "well-formed hex");
        assert!(ed25519_dalek::VerifyingKey::from_bytes(&off_curve).is_err());
        assert!(!key.is_usable_ed25519_key());
        // The neutral element (y = 1) is a point of small order.
        let mut neutral = [0u8; 32];
        neutral[0] = 1;
        assert!(!KeyId::ed25519(&neutral).is_usable_ed25519_key());
        assert!(
            !KeyId::new("sim:gateway-1")
                .expect("valid")
                .is_usable_ed25519_key()
        );
    }

    #[test]
    fn the_last_millisecond_of_year_9999_is_a_timestamp_one_more_is_refused() {
        let last = Timestamp::MAX.unix_ms();
        assert_eq!(last, 253_402_300_799_999);
        assert_eq!(Timestamp::from_unix_ms(last), Ok(Timestamp::MAX));
        assert_eq!(
            Timestamp::from_unix_ms(last - 1).map(Timestamp::unix_ms),
            Ok(last - 1)
        );
        assert!(Timestamp::from_unix_ms(last + 1).is_err());
        assert!(Timestamp::from_unix_ms(u64::MAX).is_err());
        assert_eq!(Timestamp::MAX.to_string(), "9999-12-31T23:59:59.999Z");
    }

    const TIMESTAMP_FORMAT: &[time::format_description::BorrowedFormatItem<'static>] = time::macros::format_description!(
        "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
    );

    /// The parse this crate had before it read the digits itself: `time`'s
    /// by the format description, then the one spelling kept by writing
    /// the instant back.
    fn parsed_by_the_format_description(value: &str) -> Option<Timestamp> {
        let parsed = time::PrimitiveDateTime::parse(value, TIMESTAMP_FORMAT).ok()?;
        let ms = parsed.assume_utc().unix_timestamp_nanos() / 1_000_000;
        let timestamp = Timestamp(u64::try_from(ms).ok()?);
        (timestamp.to_string() == value).then_some(timestamp)
    }

    /// Every text one character away from a valid timestamp (each place
    /// given each character that a timestamp spells with, and a few it
    /// does not), and a few lengths off: read as the format description
    /// reads it, no more and no less.
    #[test]
    fn a_timestamp_is_read_as_the_format_description_reads_it() {
        let valid = [
            "1970-01-01T00:00:00.000Z",
            "2026-07-19T14:00:00.000Z",
            "2024-02-29T23:59:59.999Z",
            "2026-02-28T12:34:56.789Z",
            "2000-12-31T09:19:29.909Z",
            "9999-12-31T23:59:59.999Z",
        ];
        let characters = "0123456789-:.TZtz+ ,/";
        let mut texts: Vec<String> = Vec::new();
        for text in valid {
            texts.push(text.to_owned());
            texts.push(format!("{text} "));
            texts.push(text[..23].to_owned());
            texts.push(format!("+{text}"));
            for place in 0..text.len() {
                for character in characters.chars() {
                    let mut changed = text.to_owned();
                    changed.replace_range(place..=place, character.encode_utf8(&mut [0; 4]));
                    texts.push(changed);
                }
            }
        }
        let mut accepted = 0;
        for text in &texts {
            let expected = parsed_by_the_format_description(text);
            assert_eq!(text.parse::<Timestamp>().ok(), expected, "{text:?}");
            accepted += usize::from(expected.is_some());
        }
        // Both ways are exercised: many changed digits still spell a date.
        assert!(
            accepted > 300 && accepted < texts.len() / 2,
            "{accepted} of {}",
            texts.len()
        );
    }

    /// The digits written by hand are the ones `time` writes by the format
    /// description that parses them: at the ends of the range, around leap
    /// days and year ends, and at a spread of instants between.
    #[test]
    fn a_timestamp_is_written_as_the_format_description_writes_it() {
        let day = 86_400_000;
        let mut instants = vec![0, 1, 999, 1_000, day - 1, day, Timestamp::MAX.0];
        // 2024-02-28 .. 2024-03-01 (a leap day), 2025-12-31 .. 2026-01-01.
        instants.extend((0..4).map(|n| 1_709_078_400_000 + n * day - 1));
        instants.extend((0..3).map(|n| 1_767_139_200_000 + n * day - 1));
        instants.extend((0..1_000).map(|n| n * (Timestamp::MAX.0 / 1_000) + n * 7_919));
        for ms in instants {
            let at = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
                .expect("in range");
            let expected = at.format(TIMESTAMP_FORMAT).expect("formats");
            let timestamp = Timestamp::from_unix_ms(ms).expect("in range");
            assert_eq!(timestamp.to_string(), expected, "{ms}");
            assert_eq!(expected.parse::<Timestamp>(), Ok(timestamp), "{ms}");
            assert_eq!(
                serde_json::to_string(&timestamp).expect("serializes"),
                format!("\"{expected}\"")
            );
        }
    }

    #[test]
    fn adding_milliseconds_to_a_timestamp_stops_at_its_maximum() {
        let at = Timestamp::from_unix_ms(1_000).expect("timestamp");
        assert_eq!(at.saturating_add_ms(0), at);
        assert_eq!(at.saturating_add_ms(234).unix_ms(), 1_234);
        let before_max = Timestamp::from_unix_ms(Timestamp::MAX.unix_ms() - 1).expect("timestamp");
        assert_eq!(before_max.saturating_add_ms(1), Timestamp::MAX);
        assert_eq!(before_max.saturating_add_ms(2), Timestamp::MAX);
        assert_eq!(Timestamp::MAX.saturating_add_ms(1), Timestamp::MAX);
        assert_eq!(at.saturating_add_ms(u64::MAX), Timestamp::MAX);
    }
}
