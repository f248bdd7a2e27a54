//! What the agent's socket tests share: keys, a temporary directory and a
//! central client with short retries.

use std::path::PathBuf;
use std::time::Duration;

use central_client::{ClientConfig, RetryPolicy};
use shard_format::Ed25519Signer;

pub const OPERATOR_TOKEN: &str = "test-operator-token";

pub fn temp_dir(name: &str) -> PathBuf {
    let mut suffix = [0u8; 8];
    getrandom::fill(&mut suffix).expect("randomness");
    let dir = std::env::temp_dir().join(format!("reservoir-{name}-{}", hex::encode(suffix)));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

pub fn central_signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&[0xc0; 32])
}

pub fn agent_signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&[0x07; 32])
}

pub fn client_config(base_url: &str) -> ClientConfig {
    let mut config = ClientConfig::new(base_url);
    config.retry = RetryPolicy {
        attempts_max: 3,
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        deadline: Duration::from_secs(5),
    };
    config
}
