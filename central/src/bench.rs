//! Durable reservations per second, end to end: a real service on loopback
//! (HTTP, signature checks, the writer, a durable commit before each
//! answer), driven by `in_flight` concurrent agent lanes through
//! [`central_client::CentralClient`].
//!
//! Each lane loops: reserve 1 unit under a fresh ID (timed), then release
//! it, so open holds stay at most `in_flight` however long the run. The
//! report counts acknowledged reservations per second over the whole run
//! (releases included in the time) and every durable operation per second.
//! A run uses its own subject, so several runs may share one database.
//!
//! This is a function for the benchmark report to call, not a test:
//!
//! ```no_run
//! # async fn example() -> Result<(), central::bench::BenchError> {
//! use central::bench::{BenchConfig, BenchStore, durable_reservations};
//! let report = durable_reservations(BenchConfig::new(BenchStore::Redb, 128, 10_000)).await?;
//! println!("{report}");
//! # Ok(()) }
//! ```

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use central_client::{CallError, CentralClient, ClientConfig, ReserveReply, RetryPolicy};
use ledger::ReserveRequest;
use shard_format::limits::{HOLD_TTL_MS_MAX, UNITS_MAX};
use shard_format::{
    AdmissionBudgetV1, Digest, DocumentSigner as _, Ed25519Signer, EmergencyMode, Refill,
    ReservationId, Route, RouteMode, Subject,
};

use crate::{Service, ServiceConfig, StoreConfig, SystemClock};

/// Which store the benchmarked service runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BenchStore {
    /// A fresh redb file in a temporary directory (removed afterwards).
    Redb,
    /// An existing PostgreSQL database (the schema is created if missing).
    Postgres(String),
}

/// One benchmark run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchConfig {
    pub store: BenchStore,
    /// Concurrent lanes, each with one request outstanding.
    pub in_flight: usize,
    /// Reservations in all (split over the lanes).
    pub reservations: usize,
    /// Release each reservation after it is acknowledged (keeps open holds
    /// bounded). Without it, holds accumulate.
    pub release: bool,
}

impl BenchConfig {
    pub fn new(store: BenchStore, in_flight: usize, reservations: usize) -> Self {
        Self {
            store,
            in_flight: in_flight.max(1),
            reservations,
            release: true,
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchReport {
    pub store: &'static str,
    pub in_flight: usize,
    pub reservations: usize,
    pub elapsed: Duration,
    /// Acknowledged reservations per second of the whole run.
    pub reservations_per_second: f64,
    /// Durable operations (reservations and releases) per second.
    pub operations_per_second: f64,
    /// Latency of one reservation, from send to answer.
    pub reserve_p50: Duration,
    pub reserve_p99: Duration,
    /// Mean operations per durable commit, from the service's histogram.
    pub mean_commit_batch: f64,
}

impl fmt::Display for BenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<8} in-flight {:>4}: {:>8.0} reservations/s ({:>8.0} durable ops/s), reserve p50 {:>7.2} ms p99 {:>7.2} ms, {:.1} ops/commit, {} reservations in {:.2} s",
            self.store,
            self.in_flight,
            self.reservations_per_second,
            self.operations_per_second,
            self.reserve_p50.as_secs_f64() * 1e3,
            self.reserve_p99.as_secs_f64() * 1e3,
            self.mean_commit_batch,
            self.reservations,
            self.elapsed.as_secs_f64(),
        )
    }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("the service did not start: {0}")]
    Start(#[from] crate::StartError),
    #[error("cannot bind a loopback port: {0}")]
    Bind(std::io::Error),
    #[error("a call failed: {0}")]
    Call(#[from] CallError),
    #[error("cannot build the client: {0}")]
    Client(#[from] central_client::BuildError),
    #[error("a reservation was not admitted: {0}")]
    NotAdmitted(String),
}

fn random_hex() -> String {
    let mut bytes = [0u8; 8];
    getrandom::fill(&mut bytes).expect("randomness for a run ID");
    hex::encode(bytes)
}

/// A policy that never runs out during a run.
fn bench_policy(subject: Subject, route: Route) -> AdmissionBudgetV1 {
    let capacity = UNITS_MAX / 2;
    AdmissionBudgetV1 {
        schema: Default::default(),
        subject,
        route,
        region: "bench".into(),
        capacity_unit: "tokens".into(),
        policy_generation: 1,
        opening: capacity,
        refill: Refill {
            units: 0,
            interval_ms: 1000,
        },
        burst: capacity,
        accounting_epoch_ms: 24 * 3_600_000,
        estimator_digest: Digest([0; 32]),
        reservation_units_max: 1,
        hold_ttl_ms: HOLD_TTL_MS_MAX,
        priority: 0,
        fairness_weight: 1,
        overdraft_units_max: 0,
        execution_hard_limit_ms: 600_000,
        emergency_mode: EmergencyMode::Disabled,
        mode: RouteMode::Enforce,
        emergency_shard_units: 0,
        emergency_shard_validity_ms: 600_000,
    }
}

/// Runs one benchmark: starts a service, measures, shuts it down.
pub async fn durable_reservations(config: BenchConfig) -> Result<BenchReport, BenchError> {
    let run = random_hex();
    let temp: Option<PathBuf> = match config.store {
        BenchStore::Redb => {
            let dir = std::env::temp_dir().join(format!("reservoir-bench-{run}"));
            std::fs::create_dir_all(&dir).map_err(BenchError::Bind)?;
            Some(dir)
        }
        BenchStore::Postgres(_) => None,
    };
    let (store, store_name) = match (&config.store, &temp) {
        (BenchStore::Postgres(url), _) => (StoreConfig::Postgres(url.clone()), "postgres"),
        (BenchStore::Redb, Some(dir)) => (StoreConfig::Redb(dir.join("ledger.redb")), "redb"),
        (BenchStore::Redb, None) => unreachable!("a redb run has a directory"),
    };
    let token = format!("bench-{run}");
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).expect("randomness for a key");
    let service_config = ServiceConfig::new(
        store,
        Ed25519Signer::from_secret_bytes(&secret),
        token.clone(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(BenchError::Bind)?;
    let service = Service::start(service_config, listener, Arc::new(SystemClock)).await?;
    let result = measure(&service, &config, &run, &token, store_name).await;
    service.shutdown().await;
    if let Some(dir) = temp {
        let _ = std::fs::remove_dir_all(dir);
    }
    result
}

async fn measure(
    service: &Service,
    config: &BenchConfig,
    run: &str,
    token: &str,
    store_name: &'static str,
) -> Result<BenchReport, BenchError> {
    let base_url = format!("http://{}", service.local_addr());
    let mut client_config = ClientConfig::new(&base_url);
    client_config.call_timeout = Duration::from_secs(60);
    client_config.retry = RetryPolicy {
        attempts_max: 1,
        ..RetryPolicy::default()
    };
    let subject = Subject::new(format!("bench-{run}")).expect("a valid subject");
    let route = Route::new("bench.reserve").expect("a valid route");
    let operator = CentralClient::new(client_config.clone())?.with_operator_token(token);
    operator
        .publish_policy(&bench_policy(subject.clone(), route.clone()))
        .await?;
    let mut secret = [0u8; 32];
    getrandom::fill(&mut secret).expect("randomness for a key");
    let agent_key = Ed25519Signer::from_secret_bytes(&secret);
    operator.enroll_gateway(agent_key.key_id()).await?;
    let agent = CentralClient::new(client_config)?.with_identity(agent_key);
    let per_lane = config.reservations.div_ceil(config.in_flight);
    let started = Instant::now();
    let lanes: Vec<_> = (0..config.in_flight)
        .map(|lane| {
            let agent = agent.clone();
            let subject = subject.clone();
            let route = route.clone();
            let release = config.release;
            let count = per_lane.min(config.reservations.saturating_sub(lane * per_lane));
            let run = run.to_owned();
            tokio::spawn(async move {
                let mut latencies = Vec::with_capacity(count);
                for index in 0..count {
                    let request = ReserveRequest {
                        reservation: ReservationId::new(format!("rl-{run}-{lane}-{index}"))
                            .expect("a valid ID"),
                        subject: subject.clone(),
                        route: route.clone(),
                        units: 1,
                        policy_generation: None,
                        request_digest: shard_format::request_digest(&subject, &route, 1, None),
                        hold_ttl_ms: None,
                    };
                    let sent = Instant::now();
                    match agent.reserve(&request).await? {
                        ReserveReply::Reserved(_) => {}
                        other => return Err(BenchError::NotAdmitted(format!("{other:?}"))),
                    }
                    latencies.push(sent.elapsed());
                    if release {
                        agent.release(&request.reservation).await?;
                    }
                }
                Ok::<_, BenchError>(latencies)
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(config.reservations);
    for lane in lanes {
        latencies.extend(lane.await.expect("a bench lane does not panic")?);
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    // The `per_mille`-th of a thousand, nearest rank.
    let percentile = |per_mille: usize| {
        latencies
            .get((latencies.len() * per_mille / 1000).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    let reservations = latencies.len();
    let operations = if config.release {
        reservations * 2
    } else {
        reservations
    };
    let seconds = elapsed.as_secs_f64().max(f64::EPSILON);
    Ok(BenchReport {
        store: store_name,
        in_flight: config.in_flight,
        reservations,
        elapsed,
        reservations_per_second: reservations as f64 / seconds,
        operations_per_second: operations as f64 / seconds,
        reserve_p50: percentile(500),
        reserve_p99: percentile(990),
        mean_commit_batch: service.metrics().mean_commit_batch(),
    })
}
