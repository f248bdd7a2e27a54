//! The request digest: what makes "the same idempotency key with a different
//! request" detectable.

use serde::Serialize;

use crate::document::canonical_json;
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
    let input = RequestDigestInput {
        subject,
        route,
        units,
        request: request.unwrap_or(&serde_json::Value::Null),
    };
    Digest::sha256(&canonical_json(&input))
}
