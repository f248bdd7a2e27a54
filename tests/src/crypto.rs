//! The simulator's cheap deterministic signature scheme: most runs use it so
//! a million runs stay fast; a fraction use real ed25519.
//!
//! A "signature" is SHA-256 over the key's secret and the message, twice.
//! It is not secure, only deterministic and tamper-evident, which is what a
//! simulation needs.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};
use shard_format::{DocumentSigner, DocumentVerifier, KeyId, Signature, SignatureError};

#[derive(Debug, Clone)]
pub struct SimSigner {
    key_id: KeyId,
    secret: u64,
}

impl SimSigner {
    pub fn new(name: &str, secret: u64) -> Self {
        Self {
            key_id: KeyId::new(format!("sim:{name}")).expect("valid key id"),
            secret,
        }
    }
}

fn sim_signature(secret: u64, message: &[u8]) -> Signature {
    let half: [u8; 32] = Sha256::new()
        .chain_update(secret.to_le_bytes())
        .chain_update(message)
        .finalize()
        .into();
    let mut bytes = [0; 64];
    bytes[..32].copy_from_slice(&half);
    bytes[32..].copy_from_slice(&half);
    Signature(bytes)
}

impl DocumentSigner for SimSigner {
    fn key_id(&self) -> &KeyId {
        &self.key_id
    }
    fn sign(&self, message: &[u8]) -> Signature {
        sim_signature(self.secret, message)
    }
}

/// Trusts `sim:` keys by their secrets; delegates `ed25519:` keys to a real
/// verifier, so runs may mix both schemes.
#[derive(Debug, Clone, Default)]
pub struct SimVerifier {
    secrets: BTreeMap<KeyId, u64>,
    ed25519: shard_format::Ed25519Verifier,
}

impl SimVerifier {
    pub fn trust_sim(&mut self, signer: &SimSigner) {
        self.secrets.insert(signer.key_id.clone(), signer.secret);
    }

    pub fn trust_ed25519(&mut self, key_id: KeyId) {
        self.ed25519.trust(key_id);
    }
}

impl DocumentVerifier for SimVerifier {
    fn verify(
        &self,
        key_id: &KeyId,
        message: &[u8],
        signature: &Signature,
    ) -> Result<(), SignatureError> {
        if key_id.ed25519_public_key().is_some() {
            return self.ed25519.verify(key_id, message, signature);
        }
        let secret = self
            .secrets
            .get(key_id)
            .ok_or_else(|| SignatureError::UntrustedKey(key_id.clone()))?;
        if sim_signature(*secret, message) == *signature {
            Ok(())
        } else {
            Err(SignatureError::Mismatch)
        }
    }
}
