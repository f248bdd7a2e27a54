//! Signing and verifying documents behind two small traits, so the daemons
//! use ed25519 while the simulator may plug in a cheap deterministic scheme.

use std::collections::BTreeMap;

use ed25519_dalek::{Signer as _, SigningKey, VerifyingKey};

use crate::document::{SignedDocument, signing_bytes};
use crate::values::{KeyId, Signature};

/// Why a signature was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    /// The document names a key this verifier does not trust.
    #[error("key {0} is not trusted")]
    UntrustedKey(KeyId),
    /// The key ID names a scheme this verifier cannot check.
    #[error("key {0} uses a scheme this verifier does not support")]
    UnsupportedScheme(KeyId),
    /// The key ID does not hold a valid public key.
    #[error("key {0} is not a valid public key")]
    MalformedKey(KeyId),
    /// The signature does not match the document's bytes and key.
    #[error("signature does not match the document")]
    Mismatch,
}

/// Produces signatures under one key.
pub trait DocumentSigner {
    fn key_id(&self) -> &KeyId;
    fn sign(&self, message: &[u8]) -> Signature;
}

/// Checks signatures under the keys it trusts.
pub trait DocumentVerifier {
    fn verify(
        &self,
        key_id: &KeyId,
        message: &[u8],
        signature: &Signature,
    ) -> Result<(), SignatureError>;
}

/// Signs `document` in place: sets its `keyId` to the signer's, then its
/// `signature` over the document's signing bytes.
pub fn sign_document<D: SignedDocument>(document: &mut D, signer: &dyn DocumentSigner) {
    document.set_signature(signer.key_id().clone(), Signature::UNSIGNED);
    let signature = signer.sign(&signing_bytes(document));
    document.set_signature(signer.key_id().clone(), signature);
}

/// Verifies `document`'s signature under the key its `keyId` names.
pub fn verify_document<D: SignedDocument>(
    document: &D,
    verifier: &dyn DocumentVerifier,
) -> Result<(), SignatureError> {
    verifier.verify(
        document.key_id(),
        &signing_bytes(document),
        document.signature(),
    )
}

/// An ed25519 signing key with its key ID (`ed25519:<public key hex>`).
pub struct Ed25519Signer {
    key: SigningKey,
    key_id: KeyId,
}

impl Ed25519Signer {
    /// The signer for a 32-byte ed25519 secret key (seed).
    pub fn from_secret_bytes(secret: &[u8; 32]) -> Self {
        let key = SigningKey::from_bytes(secret);
        let key_id = KeyId::ed25519(key.verifying_key().as_bytes());
        Self { key, key_id }
    }

    pub fn public_key_bytes(&self) -> [u8; 32] {
        self.key.verifying_key().to_bytes()
    }
}

impl std::fmt::Debug for Ed25519Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        f.debug_struct("Ed25519Signer")
            .field("key_id", &self.key_id)
            .finish()
    }
}

impl DocumentSigner for Ed25519Signer {
    fn key_id(&self) -> &KeyId {
        &self.key_id
    }
    fn sign(&self, message: &[u8]) -> Signature {
        Signature(self.key.sign(message).to_bytes())
    }
}

/// An ed25519 public key, decompressed once from the key ID that names it:
/// verifying under it skips the point decompression (about a third of a
/// verification) that verifying under a [`KeyId`] pays every time. Keep
/// one per identity where the same keys verify again and again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ed25519PublicKey {
    key: VerifyingKey,
}

impl Ed25519PublicKey {
    /// The key `key_id` names: [`SignatureError::UnsupportedScheme`] for a
    /// key ID that is not `ed25519:`, [`SignatureError::MalformedKey`] for
    /// bytes that are not a point on the curve.
    pub fn of(key_id: &KeyId) -> Result<Self, SignatureError> {
        let public_key = key_id
            .ed25519_public_key()
            .ok_or_else(|| SignatureError::UnsupportedScheme(key_id.clone()))?;
        let key = VerifyingKey::from_bytes(&public_key)
            .map_err(|_| SignatureError::MalformedKey(key_id.clone()))?;
        Ok(Self { key })
    }

    /// Whether this is the key `key_id` names.
    pub fn is_named_by(&self, key_id: &KeyId) -> bool {
        key_id.ed25519_public_key() == Some(self.key.to_bytes())
    }

    /// Checks `signature` over `message` (strict ed25519 verification).
    pub fn verify(&self, message: &[u8], signature: &Signature) -> Result<(), SignatureError> {
        let signature = ed25519_dalek::Signature::from_bytes(&signature.0);
        self.key
            .verify_strict(message, &signature)
            .map_err(|_| SignatureError::Mismatch)
    }
}

/// Verifies ed25519 signatures from a set of trusted key IDs. The key ID
/// holds the public key, so trusting a key is naming its ID; each trusted
/// key is decompressed once, when it is trusted.
#[derive(Debug, Clone, Default)]
pub struct Ed25519Verifier {
    trusted: BTreeMap<KeyId, Result<Ed25519PublicKey, SignatureError>>,
}

impl Ed25519Verifier {
    pub fn new(trusted: impl IntoIterator<Item = KeyId>) -> Self {
        let mut verifier = Self::default();
        for key_id in trusted {
            verifier.trust(key_id);
        }
        verifier
    }

    pub fn trust(&mut self, key_id: KeyId) {
        let key = Ed25519PublicKey::of(&key_id);
        self.trusted.insert(key_id, key);
    }

    pub fn is_trusted(&self, key_id: &KeyId) -> bool {
        self.trusted.contains_key(key_id)
    }
}

impl DocumentVerifier for Ed25519Verifier {
    fn verify(
        &self,
        key_id: &KeyId,
        message: &[u8],
        signature: &Signature,
    ) -> Result<(), SignatureError> {
        match self.trusted.get(key_id) {
            None => Err(SignatureError::UntrustedKey(key_id.clone())),
            Some(Err(error)) => Err(error.clone()),
            Some(Ok(key)) => key.verify(message, signature),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signer_s_public_key_is_the_one_its_key_id_names() {
        let signer = Ed25519Signer::from_secret_bytes(&[7; 32]);
        let public_key = signer.public_key_bytes();
        assert_eq!(signer.key_id().ed25519_public_key(), Some(public_key));
        assert_eq!(*signer.key_id(), KeyId::ed25519(&public_key));
        assert_ne!(
            Ed25519Signer::from_secret_bytes(&[8; 32]).public_key_bytes(),
            public_key
        );
    }

    #[test]
    fn a_verifier_trusts_exactly_the_keys_it_was_given_or_told_to_trust() {
        let first = Ed25519Signer::from_secret_bytes(&[7; 32]);
        let second = Ed25519Signer::from_secret_bytes(&[8; 32]);
        let message = b"signed bytes";
        let signature = second.sign(message);

        let mut verifier = Ed25519Verifier::new([first.key_id().clone()]);
        assert!(verifier.is_trusted(first.key_id()));
        assert!(!verifier.is_trusted(second.key_id()));
        assert_eq!(
            verifier.verify(second.key_id(), message, &signature),
            Err(SignatureError::UntrustedKey(second.key_id().clone()))
        );

        verifier.trust(second.key_id().clone());
        assert!(verifier.is_trusted(second.key_id()));
        assert!(verifier.is_trusted(first.key_id()));
        assert_eq!(
            verifier.verify(second.key_id(), message, &signature),
            Ok(())
        );
    }

    #[test]
    fn a_decompressed_key_verifies_as_its_key_id_does() {
        let signer = Ed25519Signer::from_secret_bytes(&[7; 32]);
        let other = Ed25519Signer::from_secret_bytes(&[8; 32]);
        let message = b"signed bytes";
        let key = Ed25519PublicKey::of(signer.key_id()).expect("a valid key");
        assert!(key.is_named_by(signer.key_id()));
        assert!(!key.is_named_by(other.key_id()));
        assert_eq!(key.verify(message, &signer.sign(message)), Ok(()));
        assert_eq!(
            key.verify(message, &other.sign(message)),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(
            key.verify(b"other bytes", &signer.sign(message)),
            Err(SignatureError::Mismatch)
        );
    }
}
