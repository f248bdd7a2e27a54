//! Reservoir's v1 documents and their bytes. This crate does no I/O: it
//! parses, validates, canonicalizes, digests, signs and verifies.
//!
//! # Documents
//!
//! | `schema`                  | type                         | signed by |
//! |---------------------------|------------------------------|-----------|
//! | `admissionBudget.v1`      | [`AdmissionBudgetV1`]        | —         |
//! | `limitReservation.v1`     | [`LimitReservationV1`]       | —         |
//! | `settlementReceipt.v1`    | [`SettlementReceiptV1`]      | —         |
//! | `operationReceipt.v1`     | [`OperationReceiptV1`]       | —         |
//! | `emergencyShard.v1`       | [`EmergencyShardV1`]         | central ledger key |
//! | `shardTerminalReceipt.v1` | [`ShardTerminalReceiptV1`]   | gateway identity key |
//!
//! # Strict parsing
//!
//! [`parse`] refuses, naming the field: a missing or wrong `schema`, an
//! unknown or missing field, a number that is negative, fractional, above
//! `u64` or above the field's named limit ([`limits`]), an identifier that is
//! empty, longer than [`limits::IDENTIFIER_LENGTH_MAX`] bytes or holds a byte
//! other than ASCII letters, digits and `- . _ ~ : @`, a malformed digest,
//! nonce, key ID, signature or timestamp, and any cross-field rule of the
//! document. It also refuses anything after the document, and JSON that serde
//! alone would read as the same value but that the document never writes (an
//! array for an object, `{"enforce": null}` for `"enforce"`, `null` for an
//! absent member). Documents over [`limits::DOCUMENT_SIZE_MAX`] bytes are
//! refused before parsing.
//!
//! # Canonical bytes (for implementers in other languages)
//!
//! Canonical bytes are RFC 8785 (JSON Canonicalization Scheme) applied to the
//! document's JSON form. Because every number in a v1 document is an integer
//! no larger than 2^53 − 1, and every member name is ASCII, this reduces to:
//! members sorted by name (byte order), no insignificant whitespace, integers
//! in shortest decimal form, strings with only `"`, `\` and control
//! characters escaped (`\b \t \n \f \r` by name, others as `\u00xx`), UTF-8.
//! Optional members that are absent are omitted, never written as `null`.
//! Values keep their one spelling:
//!
//! - digests: `sha256:` followed by 64 lowercase hex digits;
//! - timestamps: RFC 3339 UTC with exactly three fraction digits and `Z`,
//!   e.g. `2026-07-19T14:00:00.000Z`;
//! - boot nonces: 32 lowercase hex digits; signatures: 128 lowercase hex digits;
//! - key IDs: `ed25519:` followed by the 64 lowercase hex digits of the
//!   public key (the key ID is the key; a gateway's identity is its key ID).
//!
//! A document's digest is `sha256:` of its canonical bytes.
//!
//! # Signatures
//!
//! A signed document's signature is ed25519 (RFC 8032, verified strictly)
//! over its *signing bytes*: the canonical bytes of the document with the
//! `signature` member removed. `keyId` and `schema` are covered, so a
//! signature never verifies for another key or another kind of document.
//!
//! # Request digests
//!
//! [`request_digest`] is `sha256:` of the canonical bytes of
//! `{"request": R, "route": …, "subject": …, "units": N}`, where `R` is the
//! gateway's free-form request description or `null` (RFC 8785 applies in
//! full to `R`, floats included).

mod budget;
mod digest;
mod document;
pub mod limits;
mod reservation;
#[cfg(feature = "schema")]
pub mod schema;
mod shard;
mod signing;
mod values;

pub use budget::{AdmissionBudgetSchema, AdmissionBudgetV1, EmergencyMode, Refill, RouteMode};
pub use digest::request_digest;
pub use document::{
    Document, MemberName, ParseError, SignedDocument, canonical_bytes, canonical_json,
    document_digest, parse, signing_bytes,
};
pub use reservation::{
    LimitReservationSchema, LimitReservationV1, OperationReceiptSchema, OperationReceiptV1,
    ReservationLegV1, ReservationState, SettledLegV1, SettlementReceiptSchema, SettlementReceiptV1,
};
pub use shard::{
    EmergencyShardSchema, EmergencyShardV1, ShardCloseReason, ShardTerminalReceiptSchema,
    ShardTerminalReceiptV1,
};
pub use signing::{
    DocumentSigner, DocumentVerifier, Ed25519PublicKey, Ed25519Signer, Ed25519Verifier,
    SignatureError, sign_document, verify_document,
};
pub use values::{
    BootNonce, Digest, GatewayIdentity, IdempotencyKey, KeyId, OperationId, ReservationId, Route,
    ShardId, Signature, Subject, Timestamp, ValueError,
};
