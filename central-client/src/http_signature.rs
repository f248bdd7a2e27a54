//! Agent request signatures: a minimal profile of RFC 9421 (HTTP Message
//! Signatures) with ed25519, over a Content-Digest (RFC 9530).
//!
//! Every agent call carries three headers:
//!
//! ```text
//! Content-Digest: sha-256=:<base64 of SHA-256(body)>:
//! Signature-Input: sig1=("@method" "@path" "content-digest");created=<unix s>;nonce="<32 hex>";keyid="ed25519:<hex>";alg="ed25519"
//! Signature: sig1=:<base64 of the ed25519 signature>:
//! ```
//!
//! The signature covers the signature base of RFC 9421 §2.5:
//!
//! ```text
//! "@method": POST
//! "@path": /v1/reservations
//! "content-digest": sha-256=:…:
//! "@signature-params": ("@method" "@path" "content-digest");created=…;nonce="…";keyid="…";alg="ed25519"
//! ```
//!
//! (lines joined by `\n`, no trailing newline). The profile is fixed: the
//! label is `sig1`, the covered components are exactly these three in this
//! order, the parameters are exactly `created`, `nonce`, `keyid`, `alg` in
//! this order, `nonce` is 16 random bytes in lowercase hex, fresh for every
//! request (a retry signs again), and `keyid` is the gateway identity. A
//! verifier rebuilds the `Signature-Input` value from the parsed parameters
//! and refuses anything written otherwise, and refuses a `created` more than
//! [`CREATED_SKEW_SECONDS_MAX`] away from its clock. Requests without a body
//! sign the digest of the empty body.
//!
//! **Replays** are refused: a verifier remembers the nonces it accepted for
//! as long as their `created` can pass the skew check ([`ReplayGuard`]), so a
//! captured request cannot be sent again, not even inside the window.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use sha2::{Digest as _, Sha256};
use shard_format::{DocumentSigner, Ed25519PublicKey, KeyId, Signature};

/// The one signature label of the profile.
pub const LABEL: &str = "sig1";
/// Furthest `created` may be from the verifier's clock, either way: hosts
/// keep their clocks within this (NTP); it bounds how long a nonce must be
/// remembered.
pub const CREATED_SKEW_SECONDS_MAX: u64 = 10;

/// Random bytes of a nonce.
pub const NONCE_BYTES: usize = 16;

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
    /// The nonce was accepted before: the request is a replay.
    #[error("the signature's nonce was used before: a request is signed once and sent once")]
    Replayed,
}

/// A signature nonce: [`NONCE_BYTES`] random bytes, drawn by the signer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Nonce(pub [u8; NONCE_BYTES]);

impl Nonce {
    /// A fresh nonce from the operating system's random source.
    pub fn random() -> Self {
        let mut bytes = [0u8; NONCE_BYTES];
        getrandom::fill(&mut bytes).expect("the operating system provides randomness");
        Self(bytes)
    }
}

impl std::fmt::Display for Nonce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&hex::encode(self.0))
    }
}

/// `sha-256=:<base64>:` of `body`.
pub fn content_digest(body: &[u8]) -> String {
    format!("sha-256=:{}:", BASE64.encode(Sha256::digest(body)))
}

/// The `@signature-params` value (and the `Signature-Input` member value).
pub fn signature_params(created: u64, nonce: &Nonce, key_id: &KeyId) -> String {
    format!(
        "(\"@method\" \"@path\" \"content-digest\");created={created};nonce=\"{nonce}\";keyid=\"{key_id}\";alg=\"ed25519\""
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
/// without the query), `body`, at `created` (unix seconds), with a fresh
/// `nonce` (never reuse one: the center refuses a replay).
pub fn sign(
    signer: &dyn DocumentSigner,
    method: &str,
    path: &str,
    body: &[u8],
    created: u64,
    nonce: &Nonce,
) -> SignedHeaders {
    let digest = content_digest(body);
    let params = signature_params(created, nonce, signer.key_id());
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
    pub nonce: Nonce,
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
        .split_once(";nonce=\"")
        .ok_or_else(|| malformed(SIGNATURE_INPUT, "must name a nonce after created"))?;
    let created: u64 = created
        .parse()
        .map_err(|_| malformed(SIGNATURE_INPUT, "created must be unix seconds"))?;
    let (nonce, rest) = rest
        .split_once("\";keyid=\"")
        .ok_or_else(|| malformed(SIGNATURE_INPUT, "must name keyid after the nonce"))?;
    let nonce = hex::decode(nonce)
        .ok()
        .and_then(|bytes| <[u8; NONCE_BYTES]>::try_from(bytes).ok())
        .filter(|_| nonce.bytes().all(|byte| !byte.is_ascii_uppercase()))
        .map(Nonce)
        .ok_or_else(|| {
            malformed(
                SIGNATURE_INPUT,
                "the nonce must be 32 lowercase hex digits (16 random bytes)",
            )
        })?;
    let (key_id, _) = rest
        .split_once('"')
        .ok_or_else(|| malformed(SIGNATURE_INPUT, "keyid must be a quoted string"))?;
    let key_id = KeyId::new(key_id)
        .map_err(|error| malformed(SIGNATURE_INPUT, &format!("keyid {error}")))?;
    if params != signature_params(created, &nonce, &key_id) {
        return Err(malformed(
            SIGNATURE_INPUT,
            "must be exactly (\"@method\" \"@path\" \"content-digest\");created=<s>;nonce=\"<hex>\";keyid=\"<key>\";alg=\"ed25519\"",
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
        nonce,
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
        let key = Ed25519PublicKey::of(&self.key_id)
            .map_err(|_| SignatureRefusal::BadSignature(self.key_id.clone()))?;
        self.verify_under(&key, method, path, body, now)
    }

    /// [`Self::verify`] under `key`, the signature's key decompressed
    /// before (a verifier that keeps them per identity). A key the
    /// signature does not name is refused.
    pub fn verify_under(
        &self,
        key: &Ed25519PublicKey,
        method: &str,
        path: &str,
        body: &[u8],
        now: u64,
    ) -> Result<(), SignatureRefusal> {
        if !key.is_named_by(&self.key_id) {
            return Err(SignatureRefusal::BadSignature(self.key_id.clone()));
        }
        if self.created.abs_diff(now) > CREATED_SKEW_SECONDS_MAX {
            return Err(SignatureRefusal::Stale {
                created: self.created,
                now,
            });
        }
        if content_digest(body) != self.content_digest {
            return Err(SignatureRefusal::DigestMismatch);
        }
        let params = signature_params(self.created, &self.nonce, &self.key_id);
        let base = signature_base(method, path, &self.content_digest, &params);
        key.verify(base.as_bytes(), &self.signature)
            .map_err(|_| SignatureRefusal::BadSignature(self.key_id.clone()))
    }
}

/// The nonces a verifier accepted, kept while their `created` could still
/// pass the skew check: two generations of [`CREATED_SKEW_SECONDS_MAX`] × 2
/// seconds each, so memory is bounded by the request rate over twice the
/// window. Keyed by identity and nonce (a nonce is the signer's to draw).
#[derive(Debug, Default)]
pub struct ReplayGuard {
    /// Start (unix seconds) of the current generation.
    since: u64,
    current: std::collections::HashSet<(KeyId, Nonce)>,
    previous: std::collections::HashSet<(KeyId, Nonce)>,
}

impl ReplayGuard {
    pub fn new() -> Self {
        Self::default()
    }

    /// Remembers a verified signature's nonce at `now` (unix seconds), or
    /// refuses it as a replay if it was remembered before.
    pub fn admit(&mut self, signature: &ParsedSignature, now: u64) -> Result<(), SignatureRefusal> {
        // Any nonce older than a generation's span can no longer pass the
        // skew check, so two generations cover every nonce that could.
        let span = 2 * CREATED_SKEW_SECONDS_MAX;
        if now >= self.since.saturating_add(span) {
            self.previous = std::mem::take(&mut self.current);
            if now >= self.since.saturating_add(2 * span) {
                self.previous.clear();
            }
            self.since = now;
        }
        let entry = (signature.key_id.clone(), signature.nonce);
        if self.previous.contains(&entry) || !self.current.insert(entry) {
            return Err(SignatureRefusal::Replayed);
        }
        Ok(())
    }

    /// Nonces remembered now.
    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shard_format::Ed25519Signer;

    const NONCE: Nonce = Nonce([0xab; NONCE_BYTES]);

    fn signer(seed: u8) -> Ed25519Signer {
        Ed25519Signer::from_secret_bytes(&[seed; 32])
    }

    #[test]
    fn a_nonce_is_admitted_once_while_it_could_verify() {
        let signer = signer(6);
        let headers = sign(&signer, "POST", "/v1/reservations", b"{}", 1000, &NONCE);
        let parsed = check(&headers).expect("parses");
        let mut guard = ReplayGuard::new();
        guard.admit(&parsed, 1000).expect("first use");
        assert_eq!(guard.admit(&parsed, 1000), Err(SignatureRefusal::Replayed));
        // Still refused at the last second its `created` passes the skew
        // check, generations rotating in between.
        for now in 1001..=1000 + CREATED_SKEW_SECONDS_MAX {
            let other = sign(&signer, "GET", "/v1/audit", b"", now, &Nonce::random());
            guard
                .admit(&check(&other).expect("parses"), now)
                .expect("fresh");
            assert_eq!(guard.admit(&parsed, now), Err(SignatureRefusal::Replayed));
        }
        // Another identity's request with the same nonce is its own.
        let other = sign(
            &signer_other(),
            "POST",
            "/v1/reservations",
            b"{}",
            1000,
            &NONCE,
        );
        guard
            .admit(
                &check(&other).expect("parses"),
                1000 + CREATED_SKEW_SECONDS_MAX,
            )
            .expect("another signer's nonce");
        // Long after, the guard has forgotten it: the skew check refuses
        // such a request anyway.
        let later = 1000 + 10 * CREATED_SKEW_SECONDS_MAX;
        guard.admit(&parsed, later).expect("forgotten");
        assert!(
            guard.len() <= 2,
            "old generations are dropped: {}",
            guard.len()
        );
        assert!(
            parsed
                .verify("POST", "/v1/reservations", b"{}", later)
                .is_err()
        );
    }

    fn signer_other() -> Ed25519Signer {
        signer(9)
    }

    #[test]
    fn the_nonce_is_signed_and_well_formed() {
        let signer = signer(8);
        let headers = sign(&signer, "POST", "/v1/reservations", b"{}", 1000, &NONCE);
        let swapped = headers
            .signature_input
            .replace(&NONCE.to_string(), &Nonce([8; NONCE_BYTES]).to_string());
        let parsed = parse(
            Some(&headers.content_digest),
            Some(&swapped),
            Some(&headers.signature),
        )
        .expect("parses");
        assert!(matches!(
            parsed.verify("POST", "/v1/reservations", b"{}", 1000),
            Err(SignatureRefusal::BadSignature(_))
        ));
        for bad in [
            "\"abc\"",
            &format!("\"{}\"", NONCE.to_string().to_uppercase()),
        ] {
            let input = headers
                .signature_input
                .replace(&format!("\"{NONCE}\""), bad);
            assert!(
                matches!(
                    parse(
                        Some(&headers.content_digest),
                        Some(&input),
                        Some(&headers.signature)
                    ),
                    Err(SignatureRefusal::Malformed { .. })
                ),
                "{bad}"
            );
        }
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
        let headers = sign(&signer, "POST", "/v1/reservations", b"{}", 1000, &NONCE);
        let parsed = check(&headers).expect("parses");
        assert_eq!(&parsed.key_id, DocumentSigner::key_id(&signer));
        parsed
            .verify(
                "POST",
                "/v1/reservations",
                b"{}",
                1000 + CREATED_SKEW_SECONDS_MAX,
            )
            .expect("verifies");
    }

    #[test]
    fn every_covered_part_is_bound() {
        let signer = signer(2);
        let headers = sign(&signer, "POST", "/v1/reservations", b"{}", 1000, &NONCE);
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
            parsed.verify(
                "POST",
                "/v1/reservations",
                b"{}",
                1000 + CREATED_SKEW_SECONDS_MAX + 1
            ),
            Err(SignatureRefusal::Stale { .. })
        ));
    }

    #[test]
    fn another_key_cannot_claim_the_identity() {
        let honest = signer(3);
        let forger = signer(4);
        let mut headers = sign(&forger, "POST", "/v1/shards", b"", 5, &NONCE);
        let honest_id = DocumentSigner::key_id(&honest).clone();
        headers.signature_input = format!("{LABEL}={}", signature_params(5, &NONCE, &honest_id));
        let parsed = check(&headers).expect("parses");
        assert_eq!(
            parsed.verify("POST", "/v1/shards", b"", 5),
            Err(SignatureRefusal::BadSignature(honest_id))
        );
    }

    #[test]
    fn malformed_headers_are_named() {
        let headers = sign(&signer(5), "GET", "/v1/audit", b"", 5, &NONCE);
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
