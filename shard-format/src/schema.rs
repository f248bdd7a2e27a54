//! JSON Schemas (2020-12) of the scalar values and `schema` tags, for the
//! OpenAPI documents the daemons serve (feature `schema`). The documents
//! derive theirs from their serde attributes; the scalars are newtypes that
//! (de)serialize through a string, so their schemas are written here, next
//! to the rules they state: the patterns and lengths their parsers enforce.

use std::borrow::Cow;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};

use crate::limits::IDENTIFIER_LENGTH_MAX;
use crate::values::{
    BootNonce, Digest, IdempotencyKey, KeyId, OperationId, ReservationId, Route, ShardId,
    Signature, Subject, Timestamp,
};

/// The characters of an identifier (`check_identifier` in `values.rs`).
pub const IDENTIFIER_PATTERN: &str = "^[A-Za-z0-9._~:@-]+$";

fn identifier(description: &str) -> Schema {
    json_schema!({
        "type": "string",
        "description": description,
        "minLength": 1,
        "maxLength": IDENTIFIER_LENGTH_MAX,
        "pattern": IDENTIFIER_PATTERN,
        // A path segment of its own in an API path.
        "not": {"enum": [".", ".."]},
    })
}

fn pattern(description: &str, pattern: &str) -> Schema {
    json_schema!({
        "type": "string",
        "description": description,
        "pattern": pattern,
    })
}

macro_rules! schema {
    ($name:ident, $schema:expr) => {
        impl JsonSchema for $name {
            fn schema_name() -> Cow<'static, str> {
                stringify!($name).into()
            }

            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                $schema
            }
        }
    };
}

schema!(
    Subject,
    identifier("Who is admitted: a tenant, an API key, a user.")
);
schema!(
    Route,
    identifier("What is admitted: the route or operation class.")
);
schema!(ReservationId, identifier("A reservation's ID."));
schema!(
    OperationId,
    identifier("The executor operation bound to a reservation by its start.")
);
schema!(ShardId, identifier("An emergency shard's ID."));
schema!(
    IdempotencyKey,
    identifier("The gateway's key for one logical request.")
);
schema!(
    Digest,
    pattern(
        "A SHA-256 digest: `sha256:` and 64 lowercase hex digits.",
        "^sha256:[0-9a-f]{64}$"
    )
);
schema!(
    BootNonce,
    pattern(
        "16 random bytes: 32 lowercase hex digits.",
        "^[0-9a-f]{32}$"
    )
);
schema!(
    Signature,
    pattern(
        "An ed25519 signature: 128 lowercase hex digits.",
        "^[0-9a-f]{128}$"
    )
);
schema!(
    KeyId,
    pattern(
        "A signing key's ID, which is the key: `ed25519:` and the 64 lowercase hex digits of the public key. A gateway's identity is its agent's key ID.",
        "^ed25519:[0-9a-f]{64}$"
    )
);
schema!(
    Timestamp,
    pattern(
        "RFC 3339 UTC with exactly three fraction digits and `Z`, e.g. `2026-07-19T14:00:00.000Z`.",
        "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z$"
    )
);

/// The schema of a `schema` tag: the one string it is.
pub(crate) fn tag(value: &str) -> Schema {
    json_schema!({"type": "string", "const": value})
}
