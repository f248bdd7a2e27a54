//! The request digest: what makes "the same idempotency key with a different
//! request" detectable.

use std::io::Write as _;

use serde::Serialize;

use crate::document::{EXACT_MAX, canonical_json, write_canonical, write_string};
use crate::values::{Digest, Route, Subject};

#[derive(Serialize)]
struct RequestDigestInput<'a> {
    subject: &'a Subject,
    route: &'a Route,
    units: u64,
    request: &'a serde_json::Value,
}

/// `sha256:` of the RFC 8785 bytes of
/// `{"request": <request or null>, "route": …, "subject": …, "units": …}`.
pub fn request_digest(
    subject: &Subject,
    route: &Route,
    units: u64,
    request: Option<&serde_json::Value>,
) -> Digest {
    if let Some(bytes) = canonical_input(subject, route, units, request) {
        return Digest::sha256(&bytes);
    }
    let input = RequestDigestInput {
        subject,
        route,
        units,
        request: request.unwrap_or(&serde_json::Value::Null),
    };
    Digest::sha256(&canonical_json(&input))
}

/// The canonical bytes of the digest's input written member by member, in
/// the order RFC 8785 sorts their names (`request`, `route`, `subject`,
/// `units`): every reserve digests its request, and the general path
/// built a `Value` of the whole input (the request copied into it) and
/// sorted its members first. `None` where a number is not a plain
/// integer, which only the general path formats as JCS does.
fn canonical_input(
    subject: &Subject,
    route: &Route,
    units: u64,
    request: Option<&serde_json::Value>,
) -> Option<Vec<u8>> {
    if units > EXACT_MAX {
        return None;
    }
    let mut bytes = Vec::with_capacity(64 + subject.as_str().len() + route.as_str().len());
    bytes.extend_from_slice(b"{\"request\":");
    match request {
        Some(request) => write_canonical(request, &mut bytes).ok()?,
        None => bytes.extend_from_slice(b"null"),
    }
    bytes.extend_from_slice(b",\"route\":");
    write_string(route.as_str(), &mut bytes);
    bytes.extend_from_slice(b",\"subject\":");
    write_string(subject.as_str(), &mut bytes);
    write!(bytes, ",\"units\":{units}}}").expect("writing to a Vec cannot fail");
    Some(bytes)
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    /// The general path's bytes, which the direct one must equal.
    fn general(subject: &Subject, route: &Route, units: u64, request: Option<&Value>) -> Vec<u8> {
        canonical_json(&RequestDigestInput {
            subject,
            route,
            units,
            request: request.unwrap_or(&Value::Null),
        })
    }

    #[test]
    fn the_direct_input_is_the_general_canonical_bytes() {
        let subject = Subject::new("tenant-7").expect("valid");
        let route = Route::new("chat.generate").expect("valid");
        let requests = [
            None,
            Some(Value::Null),
            Some(json!({"model": "m", "b": [1, -2, true, null], "a": {"z": 1, "\u{e9}": "x\n"}})),
            // Names sorted by UTF-16 code units: U+FF61 sorts after a
            // surrogate pair (U+1F600) there, before it in UTF-8 order.
            Some(json!({"\u{ff61}": 1, "\u{1f600}": 2, "": 3})),
            Some(json!([9007199254740992_u64, -9007199254740992_i64, "s"])),
            Some(json!("just a string")),
        ];
        for request in &requests {
            for units in [1, 2, EXACT_MAX - 1, EXACT_MAX] {
                let direct = canonical_input(&subject, &route, units, request.as_ref())
                    .expect("plain integers only");
                assert_eq!(
                    String::from_utf8(direct).expect("UTF-8"),
                    String::from_utf8(general(&subject, &route, units, request.as_ref()))
                        .expect("UTF-8"),
                    "units {units}, request {request:?}"
                );
            }
        }
    }

    #[test]
    fn numbers_that_are_not_plain_integers_take_the_general_path() {
        let subject = Subject::new("tenant-7").expect("valid");
        let route = Route::new("chat").expect("valid");
        let fractional = json!({"temperature": 0.5});
        let huge = json!({"n": 9007199254740993_u64});
        for (units, request) in [
            (EXACT_MAX + 1, None),
            (u64::MAX, None),
            (1, Some(&fractional)),
            (1, Some(&huge)),
        ] {
            assert!(canonical_input(&subject, &route, units, request).is_none());
            assert_eq!(
                request_digest(&subject, &route, units, request),
                Digest::sha256(&general(&subject, &route, units, request)),
            );
        }
        // One unit under the bound stays on the direct path.
        assert!(canonical_input(&subject, &route, EXACT_MAX, None).is_some());
    }

    #[test]
    fn the_digest_is_sha256_of_the_canonical_input() {
        let subject = Subject::new("tenant-7").expect("valid");
        let route = Route::new("chat").expect("valid");
        let request = json!({"model": "m"});
        assert_eq!(
            request_digest(&subject, &route, 5, Some(&request)),
            Digest::sha256(
                br#"{"request":{"model":"m"},"route":"chat","subject":"tenant-7","units":5}"#
            ),
        );
    }
}
