//! Agent request signatures: a minimal profile of RFC 9421 (HTTP Message
//! Signatures) with ed25519, over a Content-Digest (RFC 9530).
//!
//! Every agent call carries three headers:
//!
//! ```text
//! Content-Digest: sha-256=:<base64 of SHA-256(body)>:
//! Signature-Input: sig1=("@method" "@path" "content-digest");created=<unix s>;keyid="ed25519:<hex>";alg="ed25519"
//! Signature: sig1=:<base64 of the ed25519 signature>:
//! ```
//!
//! The signature covers the signature base of RFC 9421 §2.5:
//!
//! ```text
//! "@method": POST
//! "@path": /v1/reservations
//! "content-digest": sha-256=:…:
//! "@signature-params": ("@method" "@path" "content-digest");created=…;keyid="…";alg="ed25519"
//! ```
//!
//! (lines joined by `\n`, no trailing newline). The profile is fixed: the
//! label is `sig1`, the covered components are exactly these three in this
//! order, the parameters are exactly `created`, `keyid`, `alg` in this order,
//! and `keyid` is the gateway identity. A verifier rebuilds the
//! `Signature-Input` value from the parsed parameters and refuses anything
//! written otherwise, and refuses a `created` more than
//! [`CREATED_SKEW_SECONDS_MAX`] away from its clock. Requests without a body
//! sign the digest of the empty body.
//!
//! Replays inside the window are harmless by construction: every call is
//! idempotent under its reservation ID, boot registration aside (a replayed
//! boot only supersedes the agent's own epoch, which it notices).

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use sha2::{Digest as _, Sha256};
use shard_format::{DocumentSigner, DocumentVerifier, Ed25519Verifier, KeyId, Signature};

/// The one signature label of the profile.
pub const LABEL: &str = "sig1";
/// Furthest `created` may be from the verifier's clock, either way.
pub const CREATED_SKEW_SECONDS_MAX: u64 = 300;

pub const CONTENT_DIGEST: &str = "content-digest";
pub const SIGNATURE_INPUT: &str = "signature-input";
pub const SIGNATURE: &str = "signature";

/// Why a request signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureRefusal {
    /// A header of the profile is absent.
    #[error("the {0} header is missing; agent calls must be signed (RFC 9421)")]
    Missing(&'static str),
    /// A header is not written as the profile writes it.
    #[error("the {header} header is malformed: {reason}")]
    Malformed {
        header: &'static str,
        reason: String,
    },
    /// `created` is too far from the verifier's clock.
    #[error(
        "the signature was created at {created}, more than {CREATED_SKEW_SECONDS_MAX} s from now ({now}); check the agent's clock"
    )]
    Stale { created: u64, now: u64 },
    /// The body does not hash to the Content-Digest.
    #[error("the content-digest header does not match the body")]
    DigestMismatch,
    /// The signature does not verify under the named key.
    #[error("the signature does not verify under key {0}")]
    BadSignature(KeyId),
}

/// `sha-256=:<base64>:` of `body`.
pub fn content_digest(body: &[u8]) -> String {
    format!("sha-256=:{}:", BASE64.encode(Sha256::digest(body)))
}

/// The `@signature-params` value (and the `Signature-Input` member value).
pub fn signature_params(created: u64, key_id: &KeyId) -> String {
    format!(
        "(\"@method\" \"@path\" \"content-digest\");created={created};keyid=\"{key_id}\";alg=\"ed25519\""
    )
}

/// The signature base of RFC 9421 §2.5 for the profile.
pub fn signature_base(method: &str, path: &str, content_digest: &str, params: &str) -> String {
    format!(
        "\"@method\": {}\n\"@path\": {path}\n\"content-digest\": {content_digest}\n\"@signature-params\": {params}",
        method.to_ascii_uppercase()
    )
}

/// The three header values of a signed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedHeaders {
    pub content_digest: String,
    pub signature_input: String,
    pub signature: String,
}

/// Signs a request: `method` (`POST`), `path` (`/v1/reservations`, as sent,
/// without the query), `body`, at `created` (unix seconds).
pub fn sign(
    signer: &dyn DocumentSigner,
    method: &str,
    path: &str,
    body: &[u8],
    created: u64,
) -> SignedHeaders {
    let digest = content_digest(body);
    let params = signature_params(created, signer.key_id());
    let base = signature_base(method, path, &digest, &params);
    let signature = signer.sign(base.as_bytes());
    SignedHeaders {
        content_digest: digest,
        signature_input: format!("{LABEL}={params}"),
        signature: format!("{LABEL}=:{}:", BASE64.encode(signature.0)),
    }
}

/// A parsed, not yet verified, request signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedSignature {
    /// The signer: a gateway identity.
    pub key_id: KeyId,
    pub created: u64,
    content_digest: String,
    signature: Signature,
}

/// Parses the three headers (`None` when absent). Checks only their form.
pub fn parse(
    content_digest: Option<&str>,
    signature_input: Option<&str>,
    signature: Option<&str>,
) -> Result<ParsedSignature, SignatureRefusal> {
    let input = signature_input.ok_or(SignatureRefusal::Missing(SIGNATURE_INPUT))?;
    let signature = signature.ok_or(SignatureRefusal::Missing(SIGNATURE))?;
    let digest = content_digest.ok_or(SignatureRefusal::Missing(CONTENT_DIGEST))?;
    let malformed = |header, reason: &str| SignatureRefusal::Malformed {
        header,
        reason: reason.to_owned(),
    };
    let params = input
        .strip_prefix(LABEL)
        .and_then(|rest| rest.strip_prefix('='))
        .ok_or_else(|| malformed(SIGNATURE_INPUT, "must start with `sig1=`"))?;
    let rest = params
        .strip_prefix("(\"@method\" \"@path\" \"content-digest\");created=")
        .ok_or_else(|| {
            malformed(
                SIGNATURE_INPUT,
                "must cover (\"@method\" \"@path\" \"content-digest\") followed by ;created=",
            )
        })?;
    let (created, rest) = rest
        .split_once(";keyid=\"")
        .ok_or_else(|| malformed(SIGNATURE_INPUT, "must name keyid after created"))?;
    let created: u64 = created
        .parse()
        .map_err(|_| malformed(SIGNATURE_INPUT, "created must be unix seconds"))?;
    let (key_id, _) = rest
        .split_once('"')
        .ok_or_else(|| malformed(SIGNATURE_INPUT, "keyid must be a quoted string"))?;
    let key_id = KeyId::new(key_id)
        .map_err(|error| malformed(SIGNATURE_INPUT, &format!("keyid {error}")))?;
    if params != signature_params(created, &key_id) {
        return Err(malformed(
            SIGNATURE_INPUT,
            "must be exactly (\"@method\" \"@path\" \"content-digest\");created=<s>;keyid=\"<key>\";alg=\"ed25519\"",
        ));
    }
    let encoded = signature
        .strip_prefix(LABEL)
        .and_then(|rest| rest.strip_prefix("=:"))
        .and_then(|rest| rest.strip_suffix(':'))
        .ok_or_else(|| malformed(SIGNATURE, "must be sig1=:<base64>:"))?;
    let bytes: [u8; 64] = BASE64
        .decode(encoded)
        .ok()
        .and_then(|bytes| bytes.try_into().ok())
        .ok_or_else(|| malformed(SIGNATURE, "must hold 64 bytes of base64"))?;
    if !digest.starts_with("sha-256=:") || !digest.ends_with(':') {
        return Err(malformed(CONTENT_DIGEST, "must be sha-256=:<base64>:"));
    }
    Ok(ParsedSignature {
        key_id,
        created,
        content_digest: digest.to_owned(),
        signature: Signature(bytes),
    })
}

impl ParsedSignature {
    /// Verifies the signature over `method`, `path` and `body` at `now`
    /// (unix seconds), under the key the signature names.
    pub fn verify(
        &self,
        method: &str,
        path: &str,
        body: &[u8],
        now: u64,
    ) -> Result<(), SignatureRefusal> {
        if self.created.abs_diff(now) > CREATED_SKEW_SECONDS_MAX {
            return Err(SignatureRefusal::Stale {
                created: self.created,
                now,
            });
        }
        if content_digest(body) != self.content_digest {
            return Err(SignatureRefusal::DigestMismatch);
        }
        let params = signature_params(self.created, &self.key_id);
        let base = signature_base(method, path, &self.content_digest, &params);
        Ed25519Verifier::new([self.key_id.clone()])
            .verify(&self.key_id, base.as_bytes(), &self.signature)
            .map_err(|_| SignatureRefusal::BadSignature(self.key_id.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shard_format::Ed25519Signer;

    fn signer(seed: u8) -> Ed25519Signer {
        Ed25519Signer::from_secret_bytes(&[seed; 32])
    }

    fn check(headers: &SignedHeaders) -> Result<ParsedSignature, SignatureRefusal> {
        parse(
            Some(&headers.content_digest),
            Some(&headers.signature_input),
            Some(&headers.signature),
        )
    }

    #[test]
    fn a_signed_request_verifies() {
        let signer = signer(1);
        let headers = sign(&signer, "POST", "/v1/reservations", b"{}", 1000);
        let parsed = check(&headers).expect("parses");
        assert_eq!(&parsed.key_id, DocumentSigner::key_id(&signer));
        parsed
            .verify("POST", "/v1/reservations", b"{}", 1100)
            .expect("verifies");
    }

    #[test]
    fn every_covered_part_is_bound() {
        let signer = signer(2);
        let headers = sign(&signer, "POST", "/v1/reservations", b"{}", 1000);
        let parsed = check(&headers).expect("parses");
        assert!(matches!(
            parsed.verify("PUT", "/v1/reservations", b"{}", 1000),
            Err(SignatureRefusal::BadSignature(_))
        ));
        assert!(matches!(
            parsed.verify("POST", "/v1/shards", b"{}", 1000),
            Err(SignatureRefusal::BadSignature(_))
        ));
        assert_eq!(
            parsed.verify("POST", "/v1/reservations", b"{ }", 1000),
            Err(SignatureRefusal::DigestMismatch)
        );
        assert!(matches!(
            parsed.verify("POST", "/v1/reservations", b"{}", 1000 + 301),
            Err(SignatureRefusal::Stale { .. })
        ));
    }

    #[test]
    fn another_key_cannot_claim_the_identity() {
        let honest = signer(3);
        let forger = signer(4);
        let mut headers = sign(&forger, "POST", "/v1/shards", b"", 5);
        let honest_id = DocumentSigner::key_id(&honest).clone();
        headers.signature_input = format!("{LABEL}={}", signature_params(5, &honest_id));
        let parsed = check(&headers).expect("parses");
        assert_eq!(
            parsed.verify("POST", "/v1/shards", b"", 5),
            Err(SignatureRefusal::BadSignature(honest_id))
        );
    }

    #[test]
    fn malformed_headers_are_named() {
        let headers = sign(&signer(5), "GET", "/v1/audit", b"", 5);
        assert_eq!(
            parse(
                None,
                Some(&headers.signature_input),
                Some(&headers.signature)
            ),
            Err(SignatureRefusal::Missing(CONTENT_DIGEST))
        );
        let reordered = headers.signature_input.replace(
            "\"@path\" \"content-digest\"",
            "\"content-digest\" \"@path\"",
        );
        assert!(matches!(
            parse(
                Some(&headers.content_digest),
                Some(&reordered),
                Some(&headers.signature)
            ),
            Err(SignatureRefusal::Malformed {
                header: SIGNATURE_INPUT,
                ..
            })
        ));
        assert!(matches!(
            parse(
                Some(&headers.content_digest),
                Some(&headers.signature_input),
                Some("sig1=:AAAA:")
            ),
            Err(SignatureRefusal::Malformed {
                header: SIGNATURE,
                ..
            })
        ));
    }
}
