//! How callers encode a record's value: MessagePack with field names
//! ([`encode`]), the compact binary form the stores write since layout
//! version 3; [`decode`] also reads the JSON values of layout version 2
//! files, which stay in the file until their key is written again.
//!
//! MessagePack rather than a positional format (bincode, postcard):
//! records use `skip_serializing_if`, defaults for fields added later and
//! tagged enums, which need a self-describing format to read back.
//!
//! A caller's hot record may instead be written **positionally**
//! ([`encode_positional`]): MessagePack with structs as arrays, behind the
//! byte [`POSITIONAL_MARKER`]. It names no field, so it only suits a type
//! written for it — one that skips no field (a skipped field would shift
//! every position after it), whose fields are only ever appended.

use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Why a stored value could not be read as the record asked for.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("MessagePack: {0}")]
    MessagePack(#[from] rmp_serde::decode::Error),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("not a positional value (its first byte is not {POSITIONAL_MARKER:#04x})")]
    NotPositional,
}

/// `value` as MessagePack, structs as maps of field names.
///
/// # Panics
///
/// If `value`'s `Serialize` implementation fails: the stores' records are
/// plain data whose serialization cannot fail.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(ENCODE_CAPACITY);
    rmp_serde::encode::write_named(&mut bytes, value).expect("records serialize to MessagePack");
    bytes
}

/// Room for a typical record in one allocation: `to_vec_named` starts
/// with 128 bytes and reallocates on the way. The records written most
/// are positional ([`encode_positional`]: a settled reservation is 344
/// bytes in the agent's journal and 402 in the central's store); a named
/// one is an account, a shard or a receipt inside a positional record.
/// 2 KiB, sized for the agent's reservation records when they had names,
/// made every record of the agent's emergency path ask for 2 KiB:
/// finding free 2 KiB blocks, and faulting their pages in, cost its
/// commit threads more than the encoding itself (docs/benchmarks-history.md). A
/// larger record grows the vector.
const ENCODE_CAPACITY: usize = 512;

/// Reads a value written by [`encode`], or a JSON object (a layout version
/// 2 value: its first byte is `{`, which as MessagePack would be a bare
/// integer, never a record).
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, DecodeError> {
    if bytes.first() == Some(&b'{') {
        return Ok(serde_json::from_slice(bytes)?);
    }
    Ok(rmp_serde::from_slice(bytes)?)
}

/// The first byte of a positional value: `0xc1`, the one byte MessagePack
/// never uses, and not `{`, so no value [`encode`] wrote (nor a JSON value)
/// starts with it.
pub const POSITIONAL_MARKER: u8 = 0xc1;

/// `value` as MessagePack with structs as arrays of their fields, behind
/// [`POSITIONAL_MARKER`]. `T` must skip no field (see the module
/// documentation).
///
/// # Panics
///
/// As [`encode`].
pub fn encode_positional<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(ENCODE_CAPACITY);
    bytes.push(POSITIONAL_MARKER);
    rmp_serde::encode::write(&mut bytes, value).expect("records serialize to MessagePack");
    bytes
}

/// Whether `bytes` is a value [`encode_positional`] wrote.
pub fn is_positional(bytes: &[u8]) -> bool {
    bytes.first() == Some(&POSITIONAL_MARKER)
}

/// Reads a value [`encode_positional`] wrote.
pub fn decode_positional<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, DecodeError> {
    let Some((&POSITIONAL_MARKER, positional)) = bytes.split_first() else {
        return Err(DecodeError::NotPositional);
    };
    Ok(rmp_serde::from_slice(positional)?)
}

/// A value in its own MessagePack with names ([`encode`]), as a byte
/// string: what a positional record carries only sometimes, in a type that
/// skips empty fields (which a positional form cannot hold).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Named(Vec<u8>);

impl Named {
    pub fn of<T: Serialize + ?Sized>(value: &T) -> Self {
        Self(encode(value))
    }

    pub fn read<T: DeserializeOwned>(self) -> Result<T, DecodeError> {
        decode(&self.0)
    }
}

impl Serialize for Named {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Named {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer
            .deserialize_byte_buf(BytesVisitor { length: None })
            .map(Self)
    }
}

/// `N` bytes as one byte string (a digest's 32 bytes, where its text is 71).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteArray<const N: usize>(pub [u8; N]);

impl<const N: usize> Serialize for ByteArray<N> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.0)
    }
}

impl<'de, const N: usize> Deserialize<'de> for ByteArray<N> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let visitor = BytesVisitor { length: Some(N) };
        let bytes = deserializer.deserialize_byte_buf(visitor)?;
        let array = <[u8; N]>::try_from(bytes.as_slice())
            .map_err(|_| serde::de::Error::invalid_length(bytes.len(), &visitor))?;
        Ok(Self(array))
    }
}

/// Reads a byte string (of `length` bytes, if given: the caller checks).
#[derive(Clone, Copy)]
struct BytesVisitor {
    length: Option<usize>,
}

impl serde::de::Visitor<'_> for BytesVisitor {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.length {
            Some(length) => write!(f, "a byte string of {length} bytes"),
            None => f.write_str("a byte string"),
        }
    }

    fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<Vec<u8>, E> {
        Ok(bytes.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    use super::{
        ByteArray, Named, decode, decode_positional, encode, encode_positional, is_positional,
    };

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    struct Reservation {
        id: String,
        units: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        min_units: Option<u64>,
        state: State,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        legs: Vec<u64>,
    }

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    enum State {
        Reserved,
        Settled { actual: u64 },
    }

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", tag = "kind", content = "record")]
    enum Record {
        Reservation(Box<Reservation>),
        Fence { pair: String, fence: u64 },
    }

    fn records() -> Vec<Record> {
        vec![
            Record::Reservation(Box::new(Reservation {
                id: "rl-1".to_owned(),
                units: u64::MAX,
                min_units: None,
                state: State::Reserved,
                legs: Vec::new(),
            })),
            Record::Reservation(Box::new(Reservation {
                id: "rl-2".to_owned(),
                units: 7,
                min_units: Some(1),
                state: State::Settled { actual: 3 },
                legs: vec![1, 2],
            })),
            Record::Fence {
                pair: "a|b".to_owned(),
                fence: 9,
            },
        ]
    }

    #[test]
    fn records_round_trip_through_messagepack() {
        for record in records() {
            let bytes = encode(&record);
            assert_ne!(bytes.first(), Some(&b'{'), "never taken for JSON");
            assert_eq!(decode::<Record>(&bytes).expect("decodes"), record);
        }
    }

    #[test]
    fn json_values_of_layout_2_are_read() {
        for record in records() {
            let json = serde_json::to_vec(&record).expect("JSON");
            assert_eq!(decode::<Record>(&json).expect("decodes"), record);
        }
    }

    #[test]
    fn messagepack_is_smaller_than_json() {
        for record in records() {
            let json = serde_json::to_vec(&record).expect("JSON");
            assert!(encode(&record).len() < json.len(), "{record:?}");
        }
    }

    /// A record written for the positional form: it skips no field.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    struct Hot {
        id: String,
        units: u64,
        min_units: Option<u64>,
        state: State,
        legs: Vec<u64>,
    }

    fn hot() -> [Hot; 2] {
        [
            Hot {
                id: "rl-1".to_owned(),
                units: 7,
                min_units: None,
                state: State::Reserved,
                legs: Vec::new(),
            },
            Hot {
                id: "rl-2".to_owned(),
                units: u64::MAX,
                min_units: Some(1),
                state: State::Settled { actual: 3 },
                legs: vec![1, 2],
            },
        ]
    }

    #[test]
    fn positional_values_round_trip_and_are_told_apart() {
        for record in hot() {
            let positional = encode_positional(&record);
            assert!(is_positional(&positional));
            assert_eq!(
                decode_positional::<Hot>(&positional).expect("decodes"),
                record
            );
            let named = encode(&record);
            assert!(positional.len() < named.len(), "{record:?}");
            assert!(!is_positional(&named));
            assert!(decode_positional::<Hot>(&named).is_err());
        }
        for record in records() {
            assert!(!is_positional(&encode(&record)));
            assert!(!is_positional(&serde_json::to_vec(&record).expect("JSON")));
        }
    }

    #[test]
    fn a_damaged_positional_value_is_an_error_not_a_panic() {
        let bytes = encode_positional(&hot()[1]);
        for cut in 0..bytes.len() {
            assert!(
                decode_positional::<Hot>(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn named_values_and_byte_arrays_are_byte_strings_in_a_positional_value() {
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct Carrier {
            legs: Named,
            digest: ByteArray<4>,
        }
        let carrier = Carrier {
            legs: Named::of(&records()[1]),
            digest: ByteArray([1, 2, 3, 0xff]),
        };
        let bytes = encode_positional(&carrier);
        let read: Carrier = decode_positional(&bytes).expect("decodes");
        assert_eq!(read.legs.read::<Record>().expect("reads"), records()[1]);
        assert_eq!(read.digest, carrier.digest);
        // The four bytes as one byte string (bin 8), closing the value.
        assert_eq!(bytes[bytes.len() - 6..], [0xc4, 4, 1, 2, 3, 0xff]);
        let mut short = bytes[..bytes.len() - 6].to_vec();
        short.extend_from_slice(&[0xc4, 3, 1, 2, 3]);
        let error = decode_positional::<Carrier>(&short).expect_err("3 bytes are not 4");
        assert!(
            error
                .to_string()
                .contains("invalid length 3, expected a byte string of 4 bytes"),
            "{error}"
        );
    }

    #[test]
    fn a_damaged_value_is_an_error_not_a_panic() {
        let bytes = encode(&records()[1]);
        for cut in 0..bytes.len() {
            assert!(decode::<Record>(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        assert!(decode::<Record>(b"{not json").is_err());
    }
}
