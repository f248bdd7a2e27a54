//! What the agent's socket tests share: keys, a temporary directory, a
//! central client with short retries and a real central service.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use central::{ManualClock, Service, ServiceConfig, StoreConfig};
use central_client::{CentralClient, ClientConfig, RetryPolicy};
use shard_format::{DocumentSigner as _, Ed25519Signer, EmergencyMode};

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

/// A real central service on loopback over redb in `dir`, with the policy of
/// docs/design.md §4.7 (shards disabled: this is healthy mode) and the
/// agent's identity enrolled.
pub async fn start_central(dir: &Path) -> (Service, String, CentralClient) {
    start_central_on(dir, "127.0.0.1:0", true).await
}

/// The central service on `address`; `fresh` publishes the policy and
/// enrols the agent (a restart on the same store has them already).
pub async fn start_central_on(
    dir: &Path,
    address: &str,
    fresh: bool,
) -> (Service, String, CentralClient) {
    let now = central::Clock::now(&central::SystemClock);
    let mut service_config = ServiceConfig::new(
        StoreConfig::Redb(dir.join("ledger.redb")),
        central_signer(),
        OPERATOR_TOKEN.to_owned(),
    );
    service_config.workers = None;
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .expect("bind loopback");
    let service = Service::start(service_config, listener, Arc::new(ManualClock::new(now)))
        .await
        .expect("the central service starts");
    let base_url = format!("http://{}", service.local_addr());
    let operator = CentralClient::new(client_config(&base_url))
        .expect("client")
        .with_operator_token(OPERATOR_TOKEN);
    if !fresh {
        return (service, base_url, operator);
    }
    let mut policy = ledger::store::contract::sample_policy(1);
    // Shards would retire units from the account; this story is healthy mode.
    policy.emergency_mode = EmergencyMode::Disabled;
    operator.publish_policy(&policy).await.expect("publish");
    operator
        .enroll_gateway(agent_signer().key_id())
        .await
        .expect("enrol the agent");
    (service, base_url, operator)
}
