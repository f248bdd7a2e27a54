//! ed25519 key files: the central service's shard-signing key
//! (`central.key` in its data directory) and each agent's identity key.
//!
//! # Format
//!
//! One JSON object, mode `0600`, written once and never rewritten:
//!
//! ```json
//! {"schema":"reservoirKey.v1","keyId":"ed25519:<64 hex digits of the public key>","secretKey":"<64 hex digits of the 32-byte ed25519 seed>"}
//! ```
//!
//! `keyId` is redundant (it follows from `secretKey`) and checked on load, so
//! a file can be identified without reading the secret. Loading refuses a
//! file that others than its owner can read (like ssh does), a file whose
//! `keyId` does not match its secret, and any other member.

use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use shard_format::{DocumentSigner as _, Ed25519Signer, KeyId};

const SCHEMA: &str = "reservoirKey.v1";

/// Why a key file could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    /// The file exists: keys are never overwritten.
    #[error("{0} exists already; keys are never overwritten (move it away first)")]
    Exists(PathBuf),
    #[error("cannot access key file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Group or others may read the file.
    #[error("key file {path} has mode {mode:o}; run `chmod 600 {path}`", path = .path.display())]
    Permissions { path: PathBuf, mode: u32 },
    #[error("key file {path} is malformed: {reason}", path = .path.display())]
    Malformed { path: PathBuf, reason: String },
    /// The operating system gave no randomness.
    #[error("no randomness available to draw a key: {0}")]
    Randomness(String),
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct KeyFileV1 {
    schema: String,
    key_id: KeyId,
    secret_key: String,
}

/// Draws a fresh ed25519 key, writes it to `path` (mode 0600, refusing to
/// overwrite) and returns its key ID.
pub fn generate(path: &Path) -> Result<KeyId, KeyFileError> {
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).map_err(|error| KeyFileError::Randomness(error.to_string()))?;
    let signer = Ed25519Signer::from_secret_bytes(&secret);
    let key_id = signer.key_id().clone();
    let contents = serde_json::to_string(&KeyFileV1 {
        schema: SCHEMA.to_owned(),
        key_id: key_id.clone(),
        secret_key: hex::encode(secret),
    })
    .expect("a key file serializes");
    write_secret_file(path, format!("{contents}\n").as_bytes())?;
    Ok(key_id)
}

/// Writes `contents` to a new file at `path` with mode 0600, synced.
pub fn write_secret_file(path: &Path, contents: &[u8]) -> Result<(), KeyFileError> {
    let io = |source| KeyFileError::Io {
        path: path.to_owned(),
        source,
    };
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|error| {
            if error.kind() == std::io::ErrorKind::AlreadyExists {
                KeyFileError::Exists(path.to_owned())
            } else {
                io(error)
            }
        })?;
    file.write_all(contents).map_err(io)?;
    file.sync_all().map_err(io)
}

/// Reads a file only its owner may read (mode `0600` or stricter).
pub fn read_secret_file(path: &Path) -> Result<String, KeyFileError> {
    let io = |source| KeyFileError::Io {
        path: path.to_owned(),
        source,
    };
    let mode = fs::metadata(path).map_err(io)?.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(KeyFileError::Permissions {
            path: path.to_owned(),
            mode,
        });
    }
    fs::read_to_string(path).map_err(io)
}

/// Loads the signer of a key file.
pub fn load(path: &Path) -> Result<Ed25519Signer, KeyFileError> {
    let contents = read_secret_file(path)?;
    let malformed = |reason: String| KeyFileError::Malformed {
        path: path.to_owned(),
        reason,
    };
    let file: KeyFileV1 =
        serde_json::from_str(&contents).map_err(|error| malformed(error.to_string()))?;
    if file.schema != SCHEMA {
        return Err(malformed(format!("schema must be {SCHEMA:?}")));
    }
    let mut secret = [0u8; 32];
    hex::decode_to_slice(&file.secret_key, &mut secret)
        .map_err(|_| malformed("secretKey must be 64 hex digits".to_owned()))?;
    let signer = Ed25519Signer::from_secret_bytes(&secret);
    if signer.key_id() != &file.key_id {
        return Err(malformed(format!(
            "keyId {} does not belong to the secret key (it is {})",
            file.key_id,
            signer.key_id()
        )));
    }
    Ok(signer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let mut suffix = [0u8; 8];
        getrandom::fill(&mut suffix).expect("randomness");
        let dir = std::env::temp_dir().join(format!("reservoir-{name}-{}", hex::encode(suffix)));
        fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn a_generated_key_loads_back_and_is_private() {
        let dir = temp_dir("key");
        let path = dir.join("agent.key");
        let key_id = generate(&path).expect("generated");
        let mode = fs::metadata(&path).expect("exists").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(load(&path).expect("loads").key_id(), &key_id);
        assert!(matches!(generate(&path), Err(KeyFileError::Exists(_))));
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).expect("chmod");
        assert!(matches!(
            load(&path),
            Err(KeyFileError::Permissions { mode: 0o644, .. })
        ));
        fs::remove_dir_all(dir).ok();
    }
}
