//! Starting, running and stopping the service: the store, the writer, the
//! HTTP server and the workers.

use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use ledger::CentralConfig;
use ledger::protocol::Operation;
use ledger::store::InjectedFault;
use shard_format::Ed25519Signer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::clock::Clock;
use crate::http::{AppState, router};
use crate::keys::GatewayKeys;
use crate::metrics::Metrics;
use crate::store::{PostgresStore, RedbStore, ResidentError, ResidentStore, SharedMemoryStore};
use crate::writer::{
    self, BATCH_SIZE_MAX, LedgerHandle, QUEUE_DEPTH_MAX, Unavailable, WriterParts,
};
use ledger::protocol::Reply;

/// File names inside the data directory.
pub const LEDGER_FILE: &str = "ledger.redb";
pub const KEY_FILE: &str = "central.key";
pub const OPERATOR_TOKEN_FILE: &str = "operator.token";

/// Where the records live.
#[derive(Debug, Clone)]
pub enum StoreConfig {
    /// The embedded redb file (one node).
    Redb(PathBuf),
    /// PostgreSQL at this URL (many replicas).
    Postgres(String),
    /// In memory, with fault injection: tests only, nothing is durable.
    Memory(SharedMemoryStore),
}

/// How often the workers run. Each is idempotent and safe with several
/// replicas: expiry only moves items still `RESERVED` past `expiresAt`,
/// deadlines only items past theirs, refills only ticks due since the
/// pair's `lastRefillAt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerIntervals {
    pub expiry: Duration,
    pub usage_deadlines: Duration,
    pub refill: Duration,
    /// The full audit of every equation. Each transition already checks
    /// the accounts it touched; this catches what no single transition
    /// shows (records that disagree with their accounts).
    pub audit: Duration,
    /// The retention sweep ([`Operation::Forget`]): each round forgets at
    /// most `sweep_batch_max` records past the window; a round that forgot
    /// a full batch is followed by another at once, so a backlog drains
    /// without waiting an interval per batch.
    pub retention: Duration,
}

impl Default for WorkerIntervals {
    fn default() -> Self {
        Self {
            expiry: Duration::from_millis(250),
            usage_deadlines: Duration::from_millis(500),
            refill: Duration::from_millis(250),
            audit: Duration::from_secs(600),
            retention: Duration::from_secs(1),
        }
    }
}

/// Everything the service needs to start.
#[derive(Debug)]
pub struct ServiceConfig {
    pub store: StoreConfig,
    /// The key shards are signed with.
    pub signer: Ed25519Signer,
    pub operator_token: String,
    /// `None`: no periodic workers (tests drive them with
    /// [`Service::run_workers_once`]).
    pub workers: Option<WorkerIntervals>,
    pub ledger: CentralConfig,
    pub batch_size_max: usize,
    pub queue_depth_max: usize,
    /// Serve HTTPS with this certificate and key; `None`: plain HTTP (the
    /// command refuses that on a non-loopback address unless told it is
    /// insecure).
    pub tls: Option<http_serve::Tls>,
    /// Header-read and idle timeouts and the connection cap
    /// ([`http_serve::Limits::CENTRAL`] unless set).
    pub limits: http_serve::Limits,
}

impl ServiceConfig {
    pub fn new(store: StoreConfig, signer: Ed25519Signer, operator_token: String) -> Self {
        Self {
            store,
            signer,
            operator_token,
            workers: Some(WorkerIntervals::default()),
            ledger: CentralConfig::default(),
            batch_size_max: BATCH_SIZE_MAX,
            queue_depth_max: QUEUE_DEPTH_MAX,
            tls: None,
            limits: http_serve::Limits::CENTRAL,
        }
    }
}

/// Why the service did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Redb(#[from] crate::store::RedbStoreError),
    #[error(transparent)]
    Postgres(#[from] crate::store::PostgresError),
    /// The in-memory test store failed to load (an injected fault).
    #[error(transparent)]
    Memory(#[from] InjectedFault),
    #[error("the stored records cannot be loaded: {0}")]
    Load(#[from] ledger::LoadError),
    /// The retention window is shorter than a stored policy needs
    /// ([`CentralConfig::retention_ms`]).
    #[error(transparent)]
    Retention(#[from] ledger::RetentionTooShort),
    #[error("cannot read the listener's address: {0}")]
    Listener(std::io::Error),
    /// The writer thread or its runtime did not start.
    #[error("cannot start the ledger writer: {0}")]
    Writer(std::io::Error),
}

impl<E> From<ResidentError<E>> for StartError
where
    E: std::error::Error + 'static,
    StartError: From<E>,
{
    fn from(error: ResidentError<E>) -> Self {
        match error {
            ResidentError::Store(error) => error.into(),
            ResidentError::Load(error) => error.into(),
            // Opening commits nothing; kept for completeness.
            error @ ResidentError::CommitCancelled => {
                StartError::Writer(std::io::Error::other(error.to_string()))
            }
        }
    }
}

/// A running service.
#[derive(Debug)]
pub struct Service {
    local_addr: SocketAddr,
    ledger: LedgerHandle,
    metrics: Arc<Metrics>,
    shutdown: watch::Sender<bool>,
    server: JoinHandle<()>,
    workers: Vec<JoinHandle<()>>,
    /// The "ledger-writer" thread.
    writer: std::thread::JoinHandle<()>,
}

impl Service {
    /// Opens the store, loads the ledger, checks that the retention window
    /// fits every current policy ([`StartError::Retention`] if not), starts
    /// the writer, the workers and the HTTP server on `listener`.
    pub async fn start(
        config: ServiceConfig,
        listener: TcpListener,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, StartError> {
        let metrics = Arc::new(Metrics::default());
        let gateway_keys = GatewayKeys::default();
        let parts = WriterParts {
            clock,
            signer: Arc::new(config.signer),
            metrics: metrics.clone(),
            batch_size_max: config.batch_size_max.max(1),
            gateway_keys: gateway_keys.clone(),
        };
        let (ledger, queue) = writer::channel(config.queue_depth_max);
        // Each store is opened on the writer's own thread and runtime.
        let ledger_config = config.ledger;
        let writer = match config.store {
            StoreConfig::Redb(path) => {
                writer::spawn(
                    move || async move {
                        let store = ResidentStore::open(RedbStore::open(&path)?, ledger_config)?
                            .with_disk_file(&path);
                        store.ledger().check_retention(ledger_config.retention_ms)?;
                        Ok(store)
                    },
                    queue,
                    parts,
                )
                .await?
            }
            StoreConfig::Memory(store) => {
                writer::spawn(
                    move || async move {
                        let store = ResidentStore::open(store, ledger_config)?;
                        store.ledger().check_retention(ledger_config.retention_ms)?;
                        Ok(store)
                    },
                    queue,
                    parts,
                )
                .await?
            }
            StoreConfig::Postgres(url) => {
                writer::spawn(
                    move || async move {
                        let store = PostgresStore::connect(&url, ledger_config).await?;
                        for policy in store.current_policies().await? {
                            ledger::check_policy_retention(&policy, ledger_config.retention_ms)?;
                        }
                        Ok(store)
                    },
                    queue,
                    parts,
                )
                .await?
            }
        };
        let local_addr = listener.local_addr().map_err(StartError::Listener)?;
        let (shutdown, mut stopping) = watch::channel(false);
        let state = AppState {
            ledger: ledger.clone(),
            operator_token: Arc::from(config.operator_token),
            enrolled: Arc::new(RwLock::new(HashSet::new())),
            metrics: metrics.clone(),
            replays: Default::default(),
            gateway_keys,
        };
        let app = router(state);
        let server = tokio::spawn(http_serve::serve(
            listener,
            config.tls,
            config.limits,
            move |_, _| app.clone(),
            async move {
                let _ = stopping.wait_for(|stop| *stop).await;
            },
        ));
        let workers = config
            .workers
            .map(|intervals| spawn_workers(&ledger, intervals, ledger_config, &metrics, &shutdown))
            .unwrap_or_default();
        tracing::info!(%local_addr, "central ledger service listening");
        Ok(Self {
            local_addr,
            ledger,
            metrics,
            shutdown,
            server,
            workers,
            writer,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The way into the writer, for in-process callers.
    pub fn ledger(&self) -> &LedgerHandle {
        &self.ledger
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// One round of every worker, in order: expiry (both halves), usage
    /// deadlines, refill.
    pub async fn run_workers_once(&self) -> Result<(), Unavailable> {
        run_workers_once(&self.ledger).await
    }

    /// Graceful shutdown: stop accepting, let in-flight requests finish,
    /// stop the workers, then let the writer drain its queue and stop.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        if let Err(error) = self.server.await {
            tracing::error!(%error, "the HTTP server task failed");
        }
        for worker in self.workers {
            let _ = worker.await;
        }
        // The writer stops once every handle is gone.
        drop(self.ledger);
        let writer = self.writer;
        let _ = tokio::task::spawn_blocking(move || writer.join()).await;
        tracing::info!("central ledger service stopped");
    }

    /// Runs until `signal` completes, then shuts down gracefully.
    pub async fn run_until(self, signal: impl Future<Output = ()>) {
        signal.await;
        tracing::info!("shutting down: draining in-flight requests");
        self.shutdown().await;
    }
}

async fn run_workers_once(ledger: &LedgerHandle) -> Result<(), Unavailable> {
    for operation in [
        Operation::BeginExpiry,
        Operation::CompleteExpiry,
        Operation::UsageDeadlines,
        Operation::Refill,
        Operation::MarkLostShards,
    ] {
        ledger.call(operation).await?;
    }
    Ok(())
}

fn spawn_workers(
    ledger: &LedgerHandle,
    intervals: WorkerIntervals,
    config: CentralConfig,
    metrics: &Arc<Metrics>,
    shutdown: &watch::Sender<bool>,
) -> Vec<JoinHandle<()>> {
    let spawn = |every: Duration, operations: &'static [fn() -> Operation]| {
        let ledger = ledger.clone();
        let mut stopping = shutdown.subscribe();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = ticks.tick() => {}
                    _ = stopping.wait_for(|stop| *stop) => break,
                }
                for operation in operations {
                    let operation = operation();
                    let name = operation.name();
                    if let Err(error) = ledger.call(operation).await {
                        tracing::warn!(worker = name, %error, "worker round failed");
                    }
                }
            }
        })
    };
    vec![
        spawn(
            intervals.expiry,
            &[|| Operation::BeginExpiry, || Operation::CompleteExpiry],
        ),
        spawn(intervals.usage_deadlines, &[|| Operation::UsageDeadlines]),
        spawn(intervals.refill, &[|| Operation::Refill]),
        spawn_audit(ledger, intervals.audit, shutdown),
        spawn_lost_shards(ledger, intervals.retention, metrics, shutdown),
        spawn_retention(
            ledger,
            intervals.retention,
            config.sweep_batch_max.max(1),
            metrics,
            shutdown,
        ),
    ]
}

/// The retention sweep: forgets what ended more than the retention window
/// ago, at most `batch_max` records a round. A full batch means more may be
/// due: the next round follows at once (yielding to the other tasks), so
/// one interval never limits the sweep to one batch.
fn spawn_retention(
    ledger: &LedgerHandle,
    every: Duration,
    batch_max: usize,
    metrics: &Arc<Metrics>,
    shutdown: &watch::Sender<bool>,
) -> JoinHandle<()> {
    let ledger = ledger.clone();
    let metrics = metrics.clone();
    let mut stopping = shutdown.subscribe();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut again = false;
        loop {
            if again {
                tokio::task::yield_now().await;
                if *stopping.borrow() {
                    break;
                }
            } else {
                tokio::select! {
                    _ = ticks.tick() => {}
                    _ = stopping.wait_for(|stop| *stop) => break,
                }
            }
            again = false;
            match ledger.call(Operation::Forget).await {
                Ok(Reply::Forgotten(outcome)) => {
                    let unix_seconds = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |elapsed| elapsed.as_secs());
                    metrics.record_forgotten(&outcome, unix_seconds);
                    if outcome.forgotten() > 0 {
                        tracing::info!(
                            reservations = outcome.reservations,
                            tombstones = outcome.tombstones,
                            shards = outcome.shards,
                            accounts_folded = outcome.accounts_folded,
                            "retention sweep forgot records past the window"
                        );
                    }
                    // Folded accounts ride along with the records that
                    // emptied them: only the records count toward the batch.
                    again = outcome.reservations + outcome.tombstones + outcome.shards >= batch_max;
                }
                Ok(other) => tracing::error!(?other, "the retention sweep answered another reply"),
                Err(error) => {
                    tracing::warn!(worker = "forget", %error, "worker round failed");
                }
            }
        }
    })
}

/// The lost-shard sweep, on the retention sweep's interval: shards
/// unreconciled past `notAfter` plus the grace are marked lost, each
/// logged as `shard_lost` (an agent that took units and never came back).
fn spawn_lost_shards(
    ledger: &LedgerHandle,
    every: Duration,
    metrics: &Arc<Metrics>,
    shutdown: &watch::Sender<bool>,
) -> JoinHandle<()> {
    let ledger = ledger.clone();
    let metrics = metrics.clone();
    let mut stopping = shutdown.subscribe();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                _ = stopping.wait_for(|stop| *stop) => break,
            }
            match ledger.call(Operation::MarkLostShards).await {
                Ok(Reply::ShardsLost(lost)) => {
                    metrics.record_lost(&lost);
                    for shard in &lost {
                        tracing::warn!(event = "shard_lost", shard = %shard.shard,
                            identity = %shard.identity, boot_epoch = shard.boot_epoch,
                            subject = %shard.subject, route = %shard.route, units = shard.units,
                            not_after = %shard.not_after,
                            "an emergency shard was not reconciled in time; its units stay retired until a receipt comes");
                    }
                }
                Ok(other) => tracing::error!(?other, "the lost-shard sweep answered another reply"),
                Err(error) => {
                    tracing::warn!(worker = "mark_lost_shards", %error, "worker round failed");
                }
            }
        }
    })
}

/// The periodic full audit: drift is logged as `audit_drift` with every
/// violation (operators alert on it; `reservoir audit` shows the table).
fn spawn_audit(
    ledger: &LedgerHandle,
    every: Duration,
    shutdown: &watch::Sender<bool>,
) -> JoinHandle<()> {
    let ledger = ledger.clone();
    let mut stopping = shutdown.subscribe();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick fires at once: the load already checked the records.
        ticks.tick().await;
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                _ = stopping.wait_for(|stop| *stop) => break,
            }
            match ledger.call(Operation::Audit).await {
                Ok(Reply::Audit(report)) if report.ok => {
                    tracing::debug!(accounts = report.accounts, "periodic audit clean");
                }
                Ok(Reply::Audit(report)) => {
                    for violation in &report.violations {
                        tracing::error!(event = "audit_drift", message = %violation.message,
                            "the periodic audit found drift");
                    }
                }
                Ok(other) => tracing::error!(?other, "the audit answered another reply"),
                Err(error) => tracing::warn!(worker = "audit", %error, "worker round failed"),
            }
        }
    })
}

/// The files of a data directory.
#[derive(Debug, Clone)]
pub struct DataDir {
    path: PathBuf,
}

/// Why a data directory could not provide a file.
#[derive(Debug, thiserror::Error)]
pub enum DataDirError {
    #[error("cannot create the data directory {path}: {source}", path = .path.display())]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no signing key at {path}; create one with `reservoir keygen --data {dir}`", path = .path.display(), dir = .dir.display())]
    NoKey { path: PathBuf, dir: PathBuf },
    #[error(transparent)]
    Key(#[from] central_client::key_file::KeyFileError),
    #[error("the operator token in {path} is empty", path = .path.display())]
    EmptyToken { path: PathBuf },
}

impl DataDir {
    /// The directory, created (mode 0700) if missing.
    pub fn open(path: &Path) -> Result<Self, DataDirError> {
        use std::os::unix::fs::DirBuilderExt as _;
        if !path.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(path)
                .map_err(|source| DataDirError::Create {
                    path: path.to_owned(),
                    source,
                })?;
        }
        Ok(Self {
            path: path.to_owned(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn ledger_path(&self) -> PathBuf {
        self.path.join(LEDGER_FILE)
    }

    pub fn key_path(&self) -> PathBuf {
        self.path.join(KEY_FILE)
    }

    /// The service's shard-signing key (created by `reservoir keygen`).
    pub fn signer(&self) -> Result<Ed25519Signer, DataDirError> {
        let path = self.key_path();
        if !path.exists() {
            return Err(DataDirError::NoKey {
                path,
                dir: self.path.clone(),
            });
        }
        Ok(central_client::key_file::load(&path)?)
    }

    /// The operator token: read from `file` if given, else from
    /// `operator.token` in the directory, created (32 random bytes as hex,
    /// mode 0600) on first start.
    pub fn operator_token(&self, file: Option<&Path>) -> Result<String, DataDirError> {
        use central_client::key_file::{read_secret_file, write_secret_file};
        let path = match file {
            Some(file) => file.to_owned(),
            None => {
                let path = self.path.join(OPERATOR_TOKEN_FILE);
                if !path.exists() {
                    let mut token = [0u8; 32];
                    getrandom::fill(&mut token).map_err(|error| {
                        central_client::key_file::KeyFileError::Randomness(error.to_string())
                    })?;
                    write_secret_file(&path, format!("{}\n", hex::encode(token)).as_bytes())?;
                    tracing::info!(path = %path.display(), "created the operator token");
                }
                path
            }
        };
        let token = read_secret_file(&path)?.trim().to_owned();
        if token.is_empty() {
            return Err(DataDirError::EmptyToken { path });
        }
        Ok(token)
    }
}
