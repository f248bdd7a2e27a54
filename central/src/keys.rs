//! Gateways' verifying keys, each decompressed once.
//!
//! An identity is its ed25519 public key ([`KeyId`]); verifying under a
//! key ID decompresses the curve point first, about a third of the cost of
//! a verification. The service verifies the same few identities over and
//! over (every agent call's HTTP signature, every terminal receipt), so it
//! keeps each identity's [`Ed25519PublicKey`] here. Only keys that verify
//! for an enrolled identity are asked for (the HTTP shell checks enrolment
//! first; the ledger asks only for a shard's own identity), and the map
//! never holds more than [`VERIFYING_KEYS_MAX`]: past it a key is
//! decompressed per call, as without the cache.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use shard_format::{DocumentVerifier, Ed25519PublicKey, KeyId, Signature, SignatureError};

/// Most identities whose decompressed key is kept.
pub const VERIFYING_KEYS_MAX: usize = 65_536;

/// The decompressed keys of the identities seen, shared by the HTTP shell
/// and the writer. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct GatewayKeys {
    keys: Arc<RwLock<HashMap<KeyId, Ed25519PublicKey>>>,
}

impl GatewayKeys {
    /// The key `key_id` names, decompressed at most once while there is
    /// room.
    pub fn key(&self, key_id: &KeyId) -> Result<Ed25519PublicKey, SignatureError> {
        if let Some(key) = self
            .keys
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
            .get(key_id)
        {
            return Ok(*key);
        }
        let key = Ed25519PublicKey::of(key_id)?;
        let mut keys = self
            .keys
            .write()
            .unwrap_or_else(|poison| poison.into_inner());
        if keys.len() < VERIFYING_KEYS_MAX {
            keys.insert(key_id.clone(), key);
        }
        Ok(key)
    }

    /// How many keys are kept.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.keys
            .read()
            .unwrap_or_else(|poison| poison.into_inner())
            .len()
    }
}

/// Verifies a gateway's signature under the ed25519 public key its identity
/// names. The ledger asks it only after checking that the key is the
/// identity a shard is bound to.
impl DocumentVerifier for GatewayKeys {
    fn verify(
        &self,
        key_id: &KeyId,
        message: &[u8],
        signature: &Signature,
    ) -> Result<(), SignatureError> {
        self.key(key_id)?.verify(message, signature)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shard_format::{DocumentSigner as _, Ed25519Signer};

    #[test]
    fn a_key_is_decompressed_once_and_verifies_as_its_key_id() {
        let keys = GatewayKeys::default();
        let signer = Ed25519Signer::from_secret_bytes(&[3; 32]);
        let other = Ed25519Signer::from_secret_bytes(&[4; 32]);
        let signature = signer.sign(b"message");
        assert_eq!(keys.verify(signer.key_id(), b"message", &signature), Ok(()));
        assert_eq!(keys.len(), 1);
        assert_eq!(keys.verify(signer.key_id(), b"message", &signature), Ok(()));
        assert_eq!(keys.len(), 1, "the second call uses the kept key");
        assert_eq!(
            keys.verify(other.key_id(), b"message", &signature),
            Err(SignatureError::Mismatch)
        );
        assert_eq!(keys.len(), 2);
    }
}
