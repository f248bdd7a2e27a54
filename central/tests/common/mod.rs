//! Shared by the central service's integration tests: real servers on
//! loopback over each store, throwaway PostgreSQL databases, signed clients,
//! and bounded polling instead of sleeps.

#![allow(dead_code)]

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use central::{ManualClock, Service, ServiceConfig, StoreConfig};
use central_client::http_signature;
use central_client::wire::AccountsResponse;
use central_client::{CentralClient, ClientConfig, RetryPolicy};
use ledger::protocol::Refusal;
use ledger::store::contract::sample_policy;
use ledger::{Dimension, ReserveRequest};
use reqwest::{Method, StatusCode};
use shard_format::{
    AdmissionBudgetV1, Digest, DocumentSigner as _, Ed25519Signer, IdempotencyKey, ReservationId,
    Route, Subject, Timestamp,
};

/// The env var naming a PostgreSQL server (a URL whose database the tests
/// may create databases from). `scripts/test` starts one and sets it.
pub const POSTGRES_ENV: &str = "RESERVOIR_TEST_POSTGRES_URL";

/// 2026-07-19T14:00:00.000Z: the start of an accounting epoch.
pub const T0_MS: u64 = 1_784_469_600_000;

pub fn t0() -> Timestamp {
    Timestamp::from_unix_ms(T0_MS).expect("valid")
}

/// A fresh directory under the system's temp dir.
pub fn temp_dir(name: &str) -> PathBuf {
    let mut suffix = [0u8; 8];
    getrandom::fill(&mut suffix).expect("randomness");
    let dir = std::env::temp_dir().join(format!("reservoir-{name}-{}", hex::encode(suffix)));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// The PostgreSQL server URL, or `None` (with a note) when it is not set
/// outside CI. In CI (`CI=true`) a missing server fails the test.
pub fn postgres_url() -> Option<String> {
    match std::env::var(POSTGRES_ENV) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            let in_ci = std::env::var("CI").is_ok_and(|value| value == "true" || value == "1");
            assert!(
                !in_ci,
                "{POSTGRES_ENV} is not set: CI must test the PostgreSQL store (scripts/test starts a server)"
            );
            eprintln!(
                "note: {POSTGRES_ENV} is not set; skipping the PostgreSQL half of this test (run scripts/test)"
            );
            None
        }
    }
}

/// `url` with its database replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let (base, _) = url
        .rsplit_once('/')
        .expect("a postgres:// URL with a database");
    format!("{base}/{database}")
}

/// A database created for one test, dropped when the test is done.
#[derive(Debug)]
pub struct ThrowawayDatabase {
    admin_url: String,
    pub name: String,
    pub url: String,
}

impl ThrowawayDatabase {
    pub async fn create(admin_url: &str) -> Self {
        let mut suffix = [0u8; 8];
        getrandom::fill(&mut suffix).expect("randomness");
        let name = format!("reservoir_test_{}", hex::encode(suffix));
        let (client, connection) = tokio_postgres::connect(admin_url, tokio_postgres::NoTls)
            .await
            .expect("the test PostgreSQL server accepts connections");
        let task = tokio::spawn(connection);
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create the throwaway database");
        drop(client);
        let _ = task.await;
        Self {
            admin_url: admin_url.to_owned(),
            url: with_database(admin_url, &name),
            name,
        }
    }

    /// Drops the database (closing any connection still open to it).
    pub async fn drop_database(self) {
        if let Ok((client, connection)) =
            tokio_postgres::connect(&self.admin_url, tokio_postgres::NoTls).await
        {
            let task = tokio::spawn(connection);
            let _ = client
                .batch_execute(&format!(
                    "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                    self.name
                ))
                .await;
            drop(client);
            let _ = task.await;
        }
    }
}

/// Which store a test server runs on.
#[derive(Debug)]
pub enum TestStore {
    Redb(PathBuf),
    Postgres(ThrowawayDatabase),
}

impl TestStore {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Redb(_) => "redb",
            Self::Postgres(_) => "postgres",
        }
    }

    fn config(&self) -> StoreConfig {
        match self {
            Self::Redb(dir) => StoreConfig::Redb(dir.join("ledger.redb")),
            Self::Postgres(database) => StoreConfig::Postgres(database.url.clone()),
        }
    }

    async fn clean_up(self) {
        match self {
            Self::Redb(dir) => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Self::Postgres(database) => database.drop_database().await,
        }
    }
}

/// Every store this run tests: redb always, PostgreSQL when a server is
/// configured (always in CI).
pub async fn stores(name: &str) -> Vec<TestStore> {
    let mut stores = vec![TestStore::Redb(temp_dir(name))];
    if let Some(url) = postgres_url() {
        stores.push(TestStore::Postgres(ThrowawayDatabase::create(&url).await));
    }
    stores
}

pub const OPERATOR_TOKEN: &str = "test-operator-token";

/// The service's shard-signing key in tests.
pub fn service_signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&[0xc0; 32])
}

/// An agent identity from a seed byte.
pub fn agent_signer(seed: u8) -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&[seed; 32])
}

/// A client with short deadlines and quick retries.
pub fn client_config(base_url: &str) -> ClientConfig {
    let mut config = ClientConfig::new(base_url);
    config.call_timeout = Duration::from_secs(10);
    config.retry = RetryPolicy {
        attempts_max: 3,
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        deadline: Duration::from_secs(20),
    };
    config
}

/// A real server on an ephemeral loopback port, driven by a manual clock
/// (no periodic workers: tests run them with [`Harness::workers`]).
#[derive(Debug)]
pub struct Harness {
    pub service: Service,
    pub store: TestStore,
    pub clock: ManualClock,
    pub base_url: String,
    pub operator: CentralClient,
}

impl Harness {
    /// A fresh boot request sent at the service's (manual) clock: the
    /// ledger refuses one more than 10 s from its own `now`.
    pub fn boot_request(&self) -> central_client::wire::BootBody {
        let mut body = central_client::wire::BootBody::fresh().expect("randomness");
        body.requested_at = central::Clock::now(&self.clock);
        body
    }

    pub async fn start(store: TestStore) -> Self {
        let clock = ManualClock::new(t0());
        Self::start_with(store, clock).await
    }

    pub async fn start_with(store: TestStore, clock: ManualClock) -> Self {
        let mut config =
            ServiceConfig::new(store.config(), service_signer(), OPERATOR_TOKEN.to_owned());
        config.workers = None;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let service = Service::start(config, listener, Arc::new(clock.clone()))
            .await
            .expect("the service starts");
        let base_url = format!("http://{}", service.local_addr());
        let operator = CentralClient::new(client_config(&base_url))
            .expect("client")
            .with_operator_token(OPERATOR_TOKEN);
        Self {
            service,
            store,
            clock,
            base_url,
            operator,
        }
    }

    /// An agent client signing with `signer`, enrolled first.
    pub async fn agent(&self, signer: Ed25519Signer) -> CentralClient {
        self.operator
            .enroll_gateway(signer.key_id())
            .await
            .expect("enrol the agent");
        CentralClient::new(client_config(&self.base_url))
            .expect("client")
            .with_identity(signer)
    }

    /// An agent client that is not enrolled.
    pub fn stranger(&self, signer: Ed25519Signer) -> CentralClient {
        CentralClient::new(client_config(&self.base_url))
            .expect("client")
            .with_identity(signer)
    }

    pub async fn publish(&self, policy: &AdmissionBudgetV1) {
        self.operator
            .publish_policy(policy)
            .await
            .expect("publish the policy");
    }

    pub async fn workers(&self) {
        self.service
            .run_workers_once()
            .await
            .expect("the workers run");
    }

    pub async fn accounts(&self) -> AccountsResponse {
        self.operator
            .accounts(&subject(), &route())
            .await
            .expect("the accounts")
    }

    /// Asserts the audit is clean.
    pub async fn assert_audit_clean(&self) {
        let report = self.operator.audit().await.expect("the audit answers");
        assert!(
            report.ok,
            "[{}] the audit found drift: {:#?}",
            self.store.name(),
            report.violations
        );
    }

    pub async fn stop(self) {
        self.service.shutdown().await;
        self.store.clean_up().await;
    }
}

pub fn subject() -> Subject {
    Subject::new("tenant-7").expect("valid")
}

pub fn route() -> Route {
    Route::new("chat.generate").expect("valid")
}

/// The policy of docs/design.md §4.7: opening 1000, burst 1000, refill 100
/// per second, reservationUnitsMax 800, overdraftUnitsMax 200, emergency
/// shards of 200.
pub fn policy(generation: u64) -> AdmissionBudgetV1 {
    sample_policy(generation)
}

/// The ID [`agent_signer`]`(1)` derives for idempotency key `name` on
/// `tenant-7/chat.generate`.
pub fn reservation_id(name: &str) -> ReservationId {
    reserve_request(name, 1).reservation
}

/// A reservation request of [`agent_signer`]`(1)`, the tests' usual agent,
/// for `tenant-7/chat.generate` under idempotency key `key`.
pub fn reserve_request(key: &str, units: u64) -> ReserveRequest {
    reserve_request_by(&agent_signer(1), key, units)
}

/// [`reserve_request`] of the agent signing with `signer`.
pub fn reserve_request_by(signer: &Ed25519Signer, key: &str, units: u64) -> ReserveRequest {
    ReserveRequest::new(
        signer.key_id().clone(),
        IdempotencyKey::new(key).expect("valid"),
        subject(),
        route(),
        units,
        shard_format::request_digest(&subject(), &route(), units, None),
    )
}

pub fn digest_of(text: &str) -> Digest {
    Digest::sha256(text.as_bytes())
}

/// The rate-limit dimension of a rejected call.
pub fn rejected_dimension(error: &central_client::CallError) -> Option<Dimension> {
    error
        .rejection()
        .and_then(|refusal| refusal.rejection())
        .map(|rejection| rejection.dimension)
}

/// Polls `condition` until it holds, at most `tries` times, `every` apart.
/// Panics with `what` if it never does.
pub async fn wait_until<F, Fut>(what: &str, tries: u32, every: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    for _ in 0..tries {
        if condition().await {
            return;
        }
        tokio::time::sleep(every).await;
    }
    panic!("gave up waiting for {what}");
}

// ----- raw HTTP -----

/// A raw HTTP client. reqwest is built without a default crypto provider
/// (the project uses ring): install it once, as every process must before
/// `reqwest::Client::new()`.
pub fn http() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::new()
}

/// A signed raw request; returns status, headers and the parsed body.
pub async fn signed(
    base_url: &str,
    signer: &Ed25519Signer,
    method: Method,
    path: &str,
    body: &[u8],
    created_offset: i64,
) -> (StatusCode, reqwest::header::HeaderMap, serde_json::Value) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    let created = now.saturating_add_signed(created_offset);
    let headers = http_signature::sign(
        signer,
        method.as_str(),
        path,
        body,
        created,
        &http_signature::Nonce::random(),
    );
    send(
        http()
            .request(method, format!("{base_url}{path}"))
            .header(http_signature::CONTENT_DIGEST, headers.content_digest)
            .header(http_signature::SIGNATURE_INPUT, headers.signature_input)
            .header(http_signature::SIGNATURE, headers.signature)
            .body(body.to_vec()),
    )
    .await
}

pub async fn send(
    request: reqwest::RequestBuilder,
) -> (StatusCode, reqwest::header::HeaderMap, serde_json::Value) {
    let response = request.send().await.expect("answered");
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response.bytes().await.expect("body");
    let body = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
    (status, headers, body)
}

pub fn error_of(body: &serde_json::Value) -> Refusal {
    serde_json::from_value(body.clone()).expect("an error body")
}

/// A service on redb with the usual policy and the agent of `seed`
/// enrolled: the raw-HTTP tests' start.
pub async fn redb_with_agent(name: &str, seed: u8) -> (Harness, Ed25519Signer) {
    let harness = Harness::start(TestStore::Redb(temp_dir(name))).await;
    harness.publish(&policy(1)).await;
    let signer = agent_signer(seed);
    harness
        .operator
        .enroll_gateway(signer.key_id())
        .await
        .expect("enrol");
    (harness, signer)
}

/// A request carrying signature `headers` (made for some body).
pub fn with_signature(
    request: reqwest::RequestBuilder,
    headers: &http_signature::SignedHeaders,
) -> reqwest::RequestBuilder {
    request
        .header(http_signature::CONTENT_DIGEST, &headers.content_digest)
        .header(http_signature::SIGNATURE_INPUT, &headers.signature_input)
        .header(http_signature::SIGNATURE, &headers.signature)
}
