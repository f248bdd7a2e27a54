//! The daemon shell around [`AgentCore`]: one task owns the core and feeds
//! it events (gateway calls, central results, the timer); it carries out
//! the effects the core returns — journal commits on two threads of its
//! own, central calls through [`CentralClient`], gateway answers over
//! oneshot channels — and nothing else. Every decision is the core's.
//!
//! # Order of effects
//!
//! After every event the driver (1) starts a journal commit if records
//! wait and fewer than [`COMMITS_IN_FLIGHT_MAX`] are under way (group
//! commit: every ready batch goes into one durable frame; requests
//! arriving meanwhile share the next one, whose frame is written while the
//! last one's `fdatasync` runs; commits end in the order they started),
//! (2) sends the central calls the core released — the
//! reservation calls ready together as one `POST /v1/batch` (at most
//! [`CENTRAL_BATCH_MAX`] each, at most [`CENTRAL_REQUESTS_IN_FLIGHT_MAX`]
//! requests under way; the rest wait in the core for the next), each
//! result fed back exactly as a single call's — and (3) answers every
//! gateway call the core released. The core releases a call or an answer only after
//! the records made before it are committed (journal first).
//!
//! # Failure
//!
//! A failed journal commit leaves the core ahead of the disk: the driver
//! stops with [`DaemonError::Journal`] and the process must restart (the
//! journal is the truth; [`AgentCore::recover`] rebuilds from it).
//!
//! # Shutdown
//!
//! [`Daemon::shutdown`] stops taking gateway calls, handles the calls
//! already queued, waits for the commits under way and commits what is
//! pending, answers what the core released, then returns. Central calls
//! still under way are dropped: their reservations stay journaled with
//! their pending sync and the next boot resolves them.
//!
//! # What the shell keeps beside the core
//!
//! One thing the core does not model and the process around it needs:
//! this boot's registration as a watch ([`DaemonHandle::registered`], for
//! readiness). (A rejection carries the center's rate-limit state itself,
//! so the gateway's 429 gets its `RateLimit` fields from the core's answer.)

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use agent_core::{
    AgentConfig, AgentCore, AgentGauges, AgentState, AgentStatus, CallId, CentralCall,
    CentralReply, CentralResult, GatewayRequest, GatewayResponse, JournalBatch, Now, OutgoingCall,
    RequestId, ShardPage,
};
use central_client::{
    AgentCall, CallError, CentralClient,
    wire::{BATCH_OPERATIONS_MAX, BootBody, IssueShardBody, SettleBody, StartBody},
};
use ledger::protocol::Answer;
use shard_format::{Ed25519Signer, Ed25519Verifier, KeyId, ReservationId, ShardId, Timestamp};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::journal::{COMMITS_IN_FLIGHT_MAX, Journal, JournalError, Turn};

/// Most gateway events queued for the driver before callers wait.
pub const GATEWAY_QUEUE_MAX: usize = 4096;
/// Most central calls one batch request carries (the center's limit).
pub const CENTRAL_BATCH_MAX: usize = BATCH_OPERATIONS_MAX;
/// Most requests to the center under way at once (a batch, or a call
/// alone, each counts one); calls ready beyond wait in the core and go
/// together in the next request. Boots, shards, receipts and health
/// probes, which never share a request, are sent as soon as they are
/// ready.
pub const CENTRAL_REQUESTS_IN_FLIGHT_MAX: usize = 4;

/// What the daemon needs besides the keys.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    pub agent: AgentConfig,
    /// The journal's redb file.
    pub journal_path: PathBuf,
    /// Central public keys whose shards this agent accepts.
    pub trusted_central_keys: Vec<KeyId>,
    /// Most gateway events queued for the driver (`GATEWAY_QUEUE_MAX`).
    pub gateway_queue_max: usize,
}

impl DaemonConfig {
    pub fn new(agent: AgentConfig, journal_path: PathBuf, trusted: Vec<KeyId>) -> Self {
        Self {
            agent,
            journal_path,
            trusted_central_keys: trusted,
            gateway_queue_max: GATEWAY_QUEUE_MAX,
        }
    }
}

/// Why the daemon failed.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The journal could not be opened, loaded or committed to; restart
    /// the process (the journal on disk is the truth).
    #[error("journal: {0}")]
    Journal(#[from] JournalError),
    /// The identity key in the configuration is not the signer's.
    #[error("the configured identity {configured} is not the identity key's {key}")]
    IdentityMismatch { configured: KeyId, key: KeyId },
    /// A blocking journal task panicked or was cancelled.
    #[error("the journal task failed: {0}")]
    Task(String),
}

/// The daemon stopped before answering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the agent is stopping or stopped")]
pub struct Stopped;

/// Counters behind `GET /metrics`.
#[derive(Debug, Default)]
pub struct Metrics {
    pub journal_commits: AtomicU64,
    pub journal_batches: AtomicU64,
    pub journal_records: AtomicU64,
    pub journal_commit_micros: AtomicU64,
    pub central_calls: AtomicU64,
    /// HTTP requests carrying them: a batch counts one.
    pub central_requests: AtomicU64,
    /// Their time from sending to the answer (or the deadline), in µs.
    pub central_request_micros: AtomicU64,
    pub central_outcome_unknown: AtomicU64,
    pub central_refused: AtomicU64,
    /// Gateway answers by HTTP status.
    pub gateway_responses: Mutex<BTreeMap<u16, u64>>,
    /// When the oldest journal commit under way began (none: `None`).
    pub journal_commit_started: Mutex<Option<std::time::Instant>>,
    /// Why the last call to the center got no answer (unreachable, TLS
    /// refused its certificate, …); `None` once a call is answered.
    pub central_error: Mutex<Option<String>>,
    /// When each reservation now unknown was first seen so by a `/metrics`
    /// scrape (this process only): the age the alerts read.
    pub unknown_since: Mutex<HashMap<ReservationId, std::time::Instant>>,
}

impl Metrics {
    /// How long the oldest journal commit under way has taken so far: a watchdog
    /// withholds its ping when the disk hangs, though the core answers.
    pub fn journal_commit_running_for(&self) -> Option<Duration> {
        let started = *self.journal_commit_started.lock().ok()?;
        started.map(|started| started.elapsed())
    }

    /// Why the center could not be reached, if the last call failed so.
    pub fn central_error(&self) -> Option<String> {
        self.central_error.lock().ok()?.clone()
    }

    fn set_central_error(&self, error: Option<String>) {
        if let Ok(mut slot) = self.central_error.lock() {
            if *slot != error {
                match &error {
                    Some(error) => tracing::warn!(%error, "the central ledger cannot be reached"),
                    None => tracing::info!("the central ledger answers again"),
                }
            }
            *slot = error;
        }
    }

    /// Adds the time of a request to the center sent at `sent_at`.
    fn time_central_request(&self, sent_at: std::time::Instant) {
        let micros = u64::try_from(sent_at.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.central_request_micros
            .fetch_add(micros, Ordering::Relaxed);
    }

    fn set_journal_commit_started(&self, started: Option<std::time::Instant>) {
        if let Ok(mut slot) = self.journal_commit_started.lock() {
            *slot = started;
        }
    }

    pub fn count_response(&self, status: u16) {
        if let Ok(mut counts) = self.gateway_responses.lock() {
            *counts.entry(status).or_default() += 1;
        }
    }

    /// The core's gauges in Prometheus text exposition: partitioned
    /// pairs, reservations by state and how long the oldest unknown
    /// outcome has been unknown.
    pub fn render_gauges(&self, gauges: &AgentGauges) -> String {
        use std::fmt::Write as _;
        let oldest_unknown = self.oldest_unknown(&gauges.unknown, std::time::Instant::now());
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, value: f64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            let _ = writeln!(out, "{name} {value}");
        };
        gauge(
            "reservoir_agent_partitioned_pairs",
            "Pairs (subject, route) the agent holds partitioned from the center.",
            gauges.partitioned_pairs as f64,
        );
        gauge(
            "reservoir_agent_unknown_oldest_seconds",
            "How long the oldest unknown outcome has been unknown (0: none), as this process observed it.",
            oldest_unknown.as_secs_f64(),
        );
        gauge(
            "reservoir_agent_pending_receipts",
            "Terminal shard receipts not yet acknowledged by the center.",
            gauges.pending_receipts as f64,
        );
        gauge(
            "reservoir_agent_reservations_in_flight",
            "Reservations holding or using units.",
            gauges.reservations_in_flight as f64,
        );
        let name = "reservoir_agent_unknown_reservations";
        let _ = writeln!(
            out,
            "# HELP {name} Reservations whose outcome at the center is unknown, by state."
        );
        let _ = writeln!(out, "# TYPE {name} gauge");
        for state in [AgentState::ReservationUnknown, AgentState::UsageUnknown] {
            let count = gauges.unknown.iter().filter(|(_, s)| *s == state).count();
            let label = serde_json::to_value(state)
                .ok()
                .and_then(|value| value.as_str().map(str::to_owned))
                .unwrap_or_default();
            let _ = writeln!(out, "{name}{{state=\"{label}\"}} {count}");
        }
        out
    }

    /// The age of the oldest reservation still `unknown`, timed from the
    /// first status that showed it unknown; forgets those no longer so.
    fn oldest_unknown(
        &self,
        unknown: &[(ReservationId, AgentState)],
        now: std::time::Instant,
    ) -> Duration {
        let Ok(mut since) = self.unknown_since.lock() else {
            return Duration::ZERO;
        };
        let still: HashSet<&ReservationId> = unknown.iter().map(|(id, _)| id).collect();
        since.retain(|id, _| still.contains(id));
        unknown
            .iter()
            .map(|(id, _)| now - *since.entry(id.clone()).or_insert(now))
            .max()
            .unwrap_or(Duration::ZERO)
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let mut counter = |name: &str, help: &str, value: &AtomicU64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {}", value.load(Ordering::Relaxed));
        };
        counter(
            "reservoir_agent_journal_commits_total",
            "Durable journal transactions.",
            &self.journal_commits,
        );
        counter(
            "reservoir_agent_journal_batches_total",
            "Core journal batches committed (several per transaction under load).",
            &self.journal_batches,
        );
        counter(
            "reservoir_agent_journal_records_total",
            "Journal records committed.",
            &self.journal_records,
        );
        counter(
            "reservoir_agent_journal_commit_microseconds_total",
            "Time spent in journal commits.",
            &self.journal_commit_micros,
        );
        counter(
            "reservoir_agent_central_calls_total",
            "Calls sent to the central ledger.",
            &self.central_calls,
        );
        counter(
            "reservoir_agent_central_requests_total",
            "HTTP requests to the central ledger carrying those calls (a batch of many is one).",
            &self.central_requests,
        );
        counter(
            "reservoir_agent_central_request_microseconds_total",
            "Time those requests took, from sending to the answer or the deadline.",
            &self.central_request_micros,
        );
        counter(
            "reservoir_agent_central_outcome_unknown_total",
            "Central calls without a definite answer by their deadline.",
            &self.central_outcome_unknown,
        );
        counter(
            "reservoir_agent_central_refused_total",
            "Central calls answered with a definite refusal.",
            &self.central_refused,
        );
        let _ = writeln!(
            out,
            "# HELP reservoir_agent_gateway_responses_total Gateway answers by HTTP status."
        );
        let _ = writeln!(
            out,
            "# TYPE reservoir_agent_gateway_responses_total counter"
        );
        if let Ok(counts) = self.gateway_responses.lock() {
            for (status, count) in counts.iter() {
                let _ = writeln!(
                    out,
                    "reservoir_agent_gateway_responses_total{{status=\"{status}\"}} {count}"
                );
            }
        }
        out
    }
}

/// One event for the driver.
#[derive(Debug)]
enum Event {
    Gateway {
        request: GatewayRequest,
        answer: oneshot::Sender<GatewayResponse>,
    },
    Status(oneshot::Sender<AgentStatus>),
    Shards {
        after: Option<ShardId>,
        limit: usize,
        answer: oneshot::Sender<ShardPage>,
    },
    Gauges(oneshot::Sender<AgentGauges>),
}

/// The way into a running daemon. Cheap to clone.
#[derive(Debug, Clone)]
pub struct DaemonHandle {
    events: mpsc::Sender<Event>,
    metrics: Arc<Metrics>,
    boot: watch::Receiver<Option<u64>>,
    /// The journal's redb file, for its size on disk.
    journal_path: Arc<PathBuf>,
}

#[cfg(test)]
impl DaemonHandle {
    /// A handle whose daemon has stopped: every call answers [`Stopped`].
    pub(crate) fn stopped() -> Self {
        let (events, _) = mpsc::channel(1);
        let (_, boot) = watch::channel(None);
        Self {
            events,
            metrics: Arc::default(),
            boot,
            journal_path: Arc::new(PathBuf::new()),
        }
    }
}

impl DaemonHandle {
    /// Bytes the journal takes on disk, its redb file and write-ahead log
    /// files together (0 for what cannot be read).
    pub fn journal_bytes(&self) -> u64 {
        record_log::store_bytes(self.journal_path.as_ref())
    }

    /// Hands a gateway request to the core and waits for its answer.
    pub async fn call(&self, request: GatewayRequest) -> Result<GatewayResponse, Stopped> {
        self.ask(|answer| Event::Gateway { request, answer }).await
    }

    /// The core's status view.
    pub async fn status(&self) -> Result<AgentStatus, Stopped> {
        self.ask(Event::Status).await
    }

    /// A page of the shards the core holds, closed ones too: at most
    /// `limit` after `after`, in ID order.
    pub async fn shards(&self, after: Option<ShardId>, limit: usize) -> Result<ShardPage, Stopped> {
        self.ask(|answer| Event::Shards {
            after,
            limit,
            answer,
        })
        .await
    }

    /// What `/metrics` reports of the core: cheap where the status is not.
    pub async fn gauges(&self) -> Result<AgentGauges, Stopped> {
        self.ask(Event::Gauges).await
    }

    /// Sends the driver the event `event` makes of an answer's sender, and
    /// waits for the answer.
    async fn ask<T>(&self, event: impl FnOnce(oneshot::Sender<T>) -> Event) -> Result<T, Stopped> {
        let (answer, answered) = oneshot::channel();
        self.events.send(event(answer)).await.map_err(|_| Stopped)?;
        answered.await.map_err(|_| Stopped)
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// This boot's epoch once the central ledger registered it; waits
    /// until then (forever while the center stays unreachable: bound it
    /// with a timeout).
    pub async fn registered(&self) -> Result<u64, Stopped> {
        let mut boot = self.boot.clone();
        let epoch = *boot.wait_for(Option::is_some).await.map_err(|_| Stopped)?;
        epoch.ok_or(Stopped)
    }
}

/// A running daemon: the driver task and the way into it.
#[derive(Debug)]
pub struct Daemon {
    handle: DaemonHandle,
    stop: oneshot::Sender<()>,
    driver: JoinHandle<Result<(), DaemonError>>,
}

impl Daemon {
    /// Opens the journal, recovers the core from it and starts the driver.
    /// `client` must sign with the same identity as `signer`.
    pub async fn start(
        config: DaemonConfig,
        signer: Ed25519Signer,
        client: CentralClient,
    ) -> Result<Self, DaemonError> {
        use shard_format::DocumentSigner as _;
        if signer.key_id() != &config.agent.identity {
            return Err(DaemonError::IdentityMismatch {
                configured: config.agent.identity.clone(),
                key: signer.key_id().clone(),
            });
        }
        let path = config.journal_path.clone();
        let (journal, records) = tokio::task::spawn_blocking(move || {
            let journal = Journal::open(&path)?;
            let records = journal.load()?;
            Ok::<_, JournalError>((journal, records))
        })
        .await
        .map_err(|error| DaemonError::Task(error.to_string()))??;
        tracing::info!(
            journal = %config.journal_path.display(),
            records = records.len(),
            identity = %config.agent.identity,
            "agent journal loaded"
        );
        let clock = Clock::new();
        let verifier = Ed25519Verifier::new(config.trusted_central_keys.iter().cloned());
        let core = AgentCore::recover(
            config.agent,
            Box::new(signer),
            Box::new(verifier),
            records,
            clock.now(),
        );
        let metrics = Arc::new(Metrics::default());
        let (boot_tx, boot) = watch::channel(core.boot_epoch());
        let (events, gateway_rx) = mpsc::channel(config.gateway_queue_max.max(1));
        let (central_tx, central_rx) = mpsc::unbounded_channel();
        let (stop, stopping) = oneshot::channel();
        let journal = Arc::new(journal);
        let committers = Committers::start(&journal)?;
        let driver = Driver {
            core,
            journal,
            client,
            clock,
            metrics: metrics.clone(),
            waiting: HashMap::new(),
            next_call: 1,
            commits: VecDeque::new(),
            committers,
            central_tx,
            requests: Arc::new(Semaphore::new(CENTRAL_REQUESTS_IN_FLIGHT_MAX)),
            boot: boot_tx,
        };
        let driver = tokio::spawn(driver.run(gateway_rx, central_rx, stopping));
        Ok(Self {
            handle: DaemonHandle {
                events,
                metrics,
                boot,
                journal_path: Arc::new(config.journal_path.clone()),
            },
            stop,
            driver,
        })
    }

    pub fn handle(&self) -> DaemonHandle {
        self.handle.clone()
    }

    /// Drains and stops (see the module documentation).
    pub async fn shutdown(self) -> Result<(), DaemonError> {
        let _ = self.stop.send(());
        self.driver
            .await
            .map_err(|error| DaemonError::Task(error.to_string()))?
    }
}

/// The shell's clocks: monotonic milliseconds since start, wall time from
/// the system.
#[derive(Debug, Clone, Copy)]
struct Clock {
    start: Instant,
}

impl Clock {
    fn new() -> Self {
        Self {
            start: Instant::now(),
        }
    }

    fn now(&self) -> Now {
        let mono_ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        let wall_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| {
                u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
            });
        Now {
            mono_ms,
            wall: Timestamp::from_unix_ms(wall_ms).unwrap_or(Timestamp::MAX),
        }
    }

    /// The instant of monotonic `ms`, if it is representable.
    fn instant_of(&self, ms: u64) -> Option<Instant> {
        self.start.checked_add(Duration::from_millis(ms))
    }
}

/// What a finished journal commit reports.
#[derive(Debug)]
struct CommitDone {
    /// The last batch's sequence number.
    seq: u64,
    batches: usize,
    records: usize,
    took: Duration,
    result: Result<(), JournalError>,
}

/// A journal commit under way: when it started, and where it reports.
type CommitTask = (std::time::Instant, oneshot::Receiver<CommitDone>);

/// A journal commit for the committer threads.
struct CommitJob {
    turn: Turn,
    batches: Vec<JournalBatch>,
    done: oneshot::Sender<CommitDone>,
}

/// [`COMMITS_IN_FLIGHT_MAX`] long-lived threads that commit to the
/// journal the jobs sent to them. Threads of their own, not tokio's
/// blocking pool: with two commits in flight the pool grew to four
/// threads, each keeping an allocator heap of its own (5-10 MiB more RSS
/// in the memory case). Dropped, they finish the job under way and are
/// joined, so that the journal is closed when the driver ends.
///
/// Each thread has a queue of its own and the jobs are dealt to them in
/// turn. The commits end in the order they started and the driver starts
/// one only while fewer than [`COMMITS_IN_FLIGHT_MAX`] are under way, so
/// a job never waits behind its thread's previous one. One queue shared
/// behind a lock cost a wake-up more per commit: the thread that took a
/// job woke the other, waiting on the lock, only for it to wait on the
/// queue instead.
struct Committers {
    queues: Vec<std::sync::mpsc::Sender<CommitJob>>,
    /// The queue of the next job.
    next: usize,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Committers {
    fn start(journal: &Arc<Journal>) -> Result<Self, DaemonError> {
        let mut committers = Self {
            queues: Vec::new(),
            next: 0,
            threads: Vec::new(),
        };
        for index in 0..COMMITS_IN_FLIGHT_MAX {
            let (queue, jobs) = std::sync::mpsc::channel::<CommitJob>();
            let journal = Arc::clone(journal);
            let thread = std::thread::Builder::new()
                .name(format!("journal-commit-{index}"))
                .spawn(move || {
                    // Ends when the queue's sender is dropped.
                    while let Ok(job) = jobs.recv() {
                        commit(&journal, job);
                    }
                })
                .map_err(|error| {
                    DaemonError::Task(format!("cannot start a journal commit thread: {error}"))
                })?;
            committers.queues.push(queue);
            committers.threads.push(thread);
        }
        Ok(committers)
    }

    /// Queues `job` for the next thread; if that thread is gone, `job`
    /// (and its `done`) is dropped: its report fails and the driver stops.
    fn send(&mut self, job: CommitJob) {
        if let Some(queue) = self.queues.get(self.next) {
            let _ = queue.send(job);
            self.next = (self.next + 1) % self.queues.len();
        }
    }
}

impl Drop for Committers {
    fn drop(&mut self) {
        self.queues.clear();
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                tracing::error!("a journal commit thread panicked");
            }
        }
    }
}

/// Appends `job`'s batches in its turn, syncs them, and reports.
fn commit(journal: &Journal, job: CommitJob) {
    let CommitJob {
        turn,
        batches,
        done,
    } = job;
    let started = std::time::Instant::now();
    let result = journal
        .append(turn, &batches)
        .and_then(|appended| appended.sync());
    let _ = done.send(CommitDone {
        seq: batches.last().map_or(0, |batch| batch.seq),
        batches: batches.len(),
        records: batches.iter().map(|batch| batch.records.len()).sum(),
        took: started.elapsed(),
        result,
    });
}

/// The task that owns the core.
struct Driver {
    core: AgentCore,
    journal: Arc<Journal>,
    client: CentralClient,
    clock: Clock,
    metrics: Arc<Metrics>,
    waiting: HashMap<CallId, oneshot::Sender<GatewayResponse>>,
    next_call: CallId,
    /// The journal commits under way, oldest first (at most
    /// [`COMMITS_IN_FLIGHT_MAX`]).
    commits: VecDeque<CommitTask>,
    committers: Committers,
    central_tx: mpsc::UnboundedSender<(RequestId, CentralResult)>,
    /// Places for requests to the center ([`CENTRAL_REQUESTS_IN_FLIGHT_MAX`]).
    requests: Arc<Semaphore>,
    /// This boot's epoch, for [`DaemonHandle::registered`].
    boot: watch::Sender<Option<u64>>,
}

impl Driver {
    async fn run(
        mut self,
        mut gateway_rx: mpsc::Receiver<Event>,
        mut central_rx: mpsc::UnboundedReceiver<(RequestId, CentralResult)>,
        mut stopping: oneshot::Receiver<()>,
    ) -> Result<(), DaemonError> {
        let mut accepting = true;
        let mut gateway_open = true;
        // When the timer last fired: a core that asks for a time already
        // past again is served at most once a millisecond, never in a spin.
        let mut fired: Option<Instant> = None;
        loop {
            self.carry_out_effects();
            let epoch = self.core.boot_epoch();
            self.boot.send_if_modified(|known| {
                let changed = *known != epoch;
                *known = epoch;
                changed
            });
            if !accepting
                && !gateway_open
                && self.commits.is_empty()
                && !self.core.has_pending_journal()
            {
                break;
            }
            let timer = self
                .core
                .poll_timeout()
                .and_then(|ms| self.clock.instant_of(ms))
                .map(|at| match fired {
                    Some(fired) => at.max(fired + Duration::from_millis(1)),
                    None => at,
                });
            tokio::select! {
                biased;
                finished = async { (&mut self.commits.front_mut().expect("guarded").1).await }, if !self.commits.is_empty() => {
                    self.commits.pop_front();
                    self.metrics.set_journal_commit_started(self.commits.front().map(|(started, _)| *started));
                    self.committed(finished)?;
                }
                _ = &mut stopping, if accepting => {
                    accepting = false;
                    gateway_rx.close();
                }
                event = gateway_rx.recv(), if gateway_open => match event {
                    Some(event) => {
                        // Take what else is queued now: one commit for all,
                        // and one reading of the clock, taken after each of
                        // them arrived.
                        let now = self.clock.now();
                        self.handle_event(event, now);
                        while let Ok(event) = gateway_rx.try_recv() {
                            self.handle_event(event, now);
                        }
                    }
                    None => {
                        gateway_open = false;
                        accepting = false;
                    }
                },
                Some((request, result)) = central_rx.recv() => {
                    let now = self.clock.now();
                    self.core.handle_central(request, result, now);
                    // A batch's answers arrive together: handled in one
                    // turn, they share one journal commit instead of
                    // spreading over several (healthy path at 32 in
                    // flight: +16 % requests/s; docs/benchmarks-history.md).
                    while let Ok((request, result)) = central_rx.try_recv() {
                        self.core.handle_central(request, result, now);
                    }
                    for refused in self.core.poll_refused_shards() {
                        tracing::warn!(event = "shard_refused", shard = %refused.shard,
                            units = refused.units, reason = %refused.reason,
                            "a shard bound to this boot was refused; an all-unused terminal receipt hands its units back");
                    }
                }
                () = sleep_until_opt(timer), if timer.is_some() => {
                    fired = Some(Instant::now());
                    self.core.handle_timeout(self.clock.now());
                }
            }
        }
        tracing::info!("agent daemon drained and stopped");
        Ok(())
    }

    fn handle_event(&mut self, event: Event, now: Now) {
        match event {
            Event::Gateway { request, answer } => {
                let call = self.next_call;
                self.next_call += 1;
                self.waiting.insert(call, answer);
                self.core.handle_gateway(call, request, now);
            }
            Event::Status(answer) => {
                let _ = answer.send(self.core.status());
            }
            Event::Shards {
                after,
                limit,
                answer,
            } => {
                let _ = answer.send(self.core.shards(after.as_ref(), limit));
            }
            Event::Gauges(answer) => {
                let _ = answer.send(self.core.gauges());
            }
        }
    }

    fn committed(
        &mut self,
        finished: Result<CommitDone, oneshot::error::RecvError>,
    ) -> Result<(), DaemonError> {
        let CommitDone {
            seq,
            batches,
            records,
            took,
            result,
        } = finished.map_err(|_| DaemonError::Task("a journal commit thread ended".to_owned()))?;
        if let Err(error) = result {
            tracing::error!(%error, "journal commit failed; stopping so a restart recovers from the journal");
            return Err(error.into());
        }
        let metrics = &self.metrics;
        metrics.journal_commits.fetch_add(1, Ordering::Relaxed);
        metrics
            .journal_batches
            .fetch_add(batches as u64, Ordering::Relaxed);
        metrics
            .journal_records
            .fetch_add(records as u64, Ordering::Relaxed);
        metrics.journal_commit_micros.fetch_add(
            u64::try_from(took.as_micros()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        self.core.handle_journal_committed(seq);
        Ok(())
    }

    /// Journal, then central calls, then gateway answers.
    fn carry_out_effects(&mut self) {
        if (self.commits.len() as u64) < COMMITS_IN_FLIGHT_MAX && self.core.has_pending_journal() {
            let batches: Vec<JournalBatch> =
                std::iter::from_fn(|| self.core.poll_journal()).collect();
            let started = std::time::Instant::now();
            if self.commits.is_empty() {
                self.metrics.set_journal_commit_started(Some(started));
            }
            let (done, report) = oneshot::channel();
            // The turn taken here, in the order the core made the batches.
            self.committers.send(CommitJob {
                turn: self.journal.turn(),
                batches,
                done,
            });
            self.commits.push_back((started, report));
        }
        // Every ready call, at most CENTRAL_BATCH_MAX to a request, while
        // fewer than CENTRAL_REQUESTS_IN_FLIGHT_MAX requests are under way:
        // beyond, calls wait in the core and share the next request.
        while let Ok(permit) = self.requests.clone().try_acquire_owned() {
            let calls = self.core.poll_central_batch(CENTRAL_BATCH_MAX);
            if calls.is_empty() {
                break;
            }
            self.send_central(calls, permit);
        }
        while let Some((call, response)) = self.core.poll_reply() {
            if let Some(answer) = self.waiting.remove(&call) {
                // The caller may have gone away; the record is journaled.
                let _ = answer.send(response);
            }
        }
    }

    /// Sends `outgoing`: the reservation calls together as one batch
    /// request (one alone as its own call), and boots, shards, receipts and
    /// health probes each as their own. `permit` is the batch's (or the
    /// lone call's) place among the requests in flight; it is given back
    /// before the results are, so the driver that reads them can send
    /// again.
    fn send_central(&self, outgoing: Vec<OutgoingCall>, permit: OwnedSemaphorePermit) {
        let mut batched = Vec::new();
        for call in outgoing {
            self.metrics.central_calls.fetch_add(1, Ordering::Relaxed);
            let deadline = self.clock.instant_of(call.deadline_ms);
            match carried(call.call) {
                Carried::Call(agent_call) if agent_call.is_batchable() => {
                    batched.push((call.request, agent_call, deadline));
                }
                alone => self.send_alone(call.request, alone, deadline, None),
            }
        }
        if batched.len() < 2 {
            if let Some((request, call, deadline)) = batched.pop() {
                self.send_alone(request, Carried::Call(call), deadline, Some(permit));
            }
            return;
        }
        self.metrics
            .central_requests
            .fetch_add(1, Ordering::Relaxed);
        let client = self.client.clone();
        let results = self.central_tx.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            // The batch waits no longer than its most urgent call may.
            let deadline = batched
                .iter()
                .filter_map(|(_, _, deadline)| *deadline)
                .min();
            let (requests, calls): (Vec<RequestId>, Vec<AgentCall>) = batched
                .into_iter()
                .map(|(request, call, _)| (request, call))
                .unzip();
            let count = calls.len();
            let sent_at = std::time::Instant::now();
            let sent = async {
                client
                    .batch(&calls)
                    .await
                    .into_iter()
                    .map(reported)
                    .collect()
            };
            let answers: Vec<(CentralResult, Option<String>)> = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, sent)
                    .await
                    .unwrap_or_else(|_| vec![(CentralResult::OutcomeUnknown, None); count]),
                None => sent.await,
            };
            drop(permit);
            metrics.time_central_request(sent_at);
            for (request, (result, error)) in requests.into_iter().zip(answers) {
                report(&metrics, &result, error);
                let _ = results.send((request, result));
            }
        });
    }

    /// Sends one call as its own request.
    fn send_alone(
        &self,
        request: RequestId,
        call: Carried,
        deadline: Option<Instant>,
        permit: Option<OwnedSemaphorePermit>,
    ) {
        self.metrics
            .central_requests
            .fetch_add(1, Ordering::Relaxed);
        let client = self.client.clone();
        let results = self.central_tx.clone();
        let metrics = self.metrics.clone();
        tokio::spawn(async move {
            let sent_at = std::time::Instant::now();
            let call = call.execute(&client);
            let (result, error) = match deadline {
                Some(deadline) => tokio::time::timeout_at(deadline, call)
                    .await
                    .unwrap_or((CentralResult::OutcomeUnknown, None)),
                None => call.await,
            };
            drop(permit);
            metrics.time_central_request(sent_at);
            report(&metrics, &result, error);
            let _ = results.send((request, result));
        });
    }
}

/// Counts a central result and keeps why the center was unreachable.
fn report(metrics: &Metrics, result: &CentralResult, error: Option<String>) {
    match (result, error) {
        (CentralResult::Reply(_), _) => metrics.set_central_error(None),
        (CentralResult::OutcomeUnknown, Some(error)) => {
            metrics.set_central_error(Some(error));
        }
        // A deadline passed: says nothing of reachability.
        (CentralResult::OutcomeUnknown, None) => {}
    }
    match result {
        CentralResult::OutcomeUnknown => {
            metrics
                .central_outcome_unknown
                .fetch_add(1, Ordering::Relaxed);
        }
        CentralResult::Reply(CentralReply::Refused { .. } | CentralReply::Invalid { .. }) => {
            metrics.central_refused.fetch_add(1, Ordering::Relaxed);
        }
        CentralResult::Reply(_) => {}
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Carries out one central call: the call as an HTTP request, and its
/// answer read by [`CentralReply::from_answer`], the same mapping the
/// simulator's central node uses. Anything that may have taken effect
/// unseen (no answer, not sent, unreadable) is
/// [`CentralResult::OutcomeUnknown`]: the core retries under the same IDs.
pub async fn execute(client: &CentralClient, call: CentralCall) -> CentralResult {
    execute_reporting(client, call).await.0
}

/// [`execute`], with why a call got no answer (the connection or TLS
/// error), for the status.
pub async fn execute_reporting(
    client: &CentralClient,
    call: CentralCall,
) -> (CentralResult, Option<String>) {
    carried(call).execute(client).await
}

/// How a central call goes over HTTP.
#[derive(Debug)]
enum Carried {
    /// `GET /healthz`.
    Health,
    /// An agent call (a reservation call may go in a batch).
    Call(AgentCall),
    /// Nothing could be sent (no randomness for a boot request).
    NotSent,
}

impl Carried {
    async fn execute(self, client: &CentralClient) -> (CentralResult, Option<String>) {
        match self {
            Self::Health => match client.health().await {
                Ok(()) => (CentralResult::Reply(CentralReply::Healthy), None),
                Err(error) => (CentralResult::OutcomeUnknown, unreached(&error)),
            },
            Self::Call(call) => reported(client.answer(call).await),
            Self::NotSent => (CentralResult::OutcomeUnknown, None),
        }
    }
}

/// The HTTP form of `call`.
fn carried(call: CentralCall) -> Carried {
    Carried::Call(match call {
        CentralCall::Health => return Carried::Health,
        // A fresh request each time (a boot is never retried): the
        // ledger refuses a replayed one.
        CentralCall::Register => match BootBody::fresh() {
            Ok(body) => AgentCall::Boot(body),
            Err(error) => {
                tracing::error!(%error, "no randomness for a boot request nonce");
                return Carried::NotSent;
            }
        },
        CentralCall::Reserve(request) => AgentCall::Reserve(request),
        CentralCall::Get { reservation } => AgentCall::Get(reservation),
        CentralCall::Start {
            reservation,
            operation_id,
            deadline_ms,
        } => AgentCall::Start(
            reservation,
            StartBody {
                operation_id,
                deadline_ms,
            },
        ),
        CentralCall::Settle {
            reservation,
            operation_id,
            actuals,
        } => AgentCall::Settle(reservation, SettleBody::from((operation_id, actuals))),
        CentralCall::Release { reservation } => AgentCall::Release(reservation),
        CentralCall::Abandon {
            reservation,
            origin,
        } => AgentCall::Abandon(reservation, origin.into()),
        CentralCall::IssueShard {
            subject,
            route,
            boot_epoch,
            boot_nonce,
        } => AgentCall::IssueShard(IssueShardBody {
            subject,
            route,
            boot_epoch,
            boot_nonce,
            shard: None,
        }),
        CentralCall::UploadReceipt(receipt) => AgentCall::Reconcile(receipt),
    })
}

/// An answer read by [`CentralReply::from_answer`], the same mapping the
/// simulator's central node uses; no answer is an unknown outcome.
fn reported(answer: Result<Answer, CallError>) -> (CentralResult, Option<String>) {
    match answer {
        Ok(answer) => (
            CentralResult::Reply(CentralReply::from_answer(answer)),
            None,
        ),
        Err(error) => (CentralResult::OutcomeUnknown, unreached(&error)),
    }
}

/// The error text of a call that reached no answer.
fn unreached(error: &CallError) -> Option<String> {
    match error {
        CallError::NotSent(text) | CallError::OutcomeUnknown(text) => Some(text.clone()),
        CallError::Rejected(_) | CallError::Protocol(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_jobs_are_dealt_to_the_threads_in_turn_and_each_is_reported() {
        let dir = std::env::temp_dir().join(format!(
            "reservoir-committers-{}-{}",
            std::process::id(),
            std::thread::current()
                .name()
                .unwrap_or("test")
                .replace("::", "-")
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        let journal = Arc::new(Journal::open(&dir.join("journal.redb")).expect("a journal"));
        let mut committers = Committers::start(&journal).expect("the threads start");
        let mut reports = Vec::new();
        for sent in 1..=4u64 {
            let (done, report) = oneshot::channel();
            committers.send(CommitJob {
                turn: journal.turn(),
                batches: Vec::new(),
                done,
            });
            // The next job goes to the next thread, the first after the last.
            assert_eq!(
                u64::try_from(committers.next),
                Ok(sent % COMMITS_IN_FLIGHT_MAX)
            );
            reports.push(report);
        }
        for report in reports {
            let done = report.blocking_recv().expect("the job is reported");
            assert!(done.result.is_ok(), "{:?}", done.result);
        }
        // Dropped, the threads end and are joined: the journal is closed.
        drop(committers);
        drop(Arc::into_inner(journal).expect("no thread holds the journal"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_running_journal_commit_reports_its_age_and_a_finished_one_none() {
        let metrics = Metrics::default();
        assert_eq!(metrics.journal_commit_running_for(), None);
        let started = std::time::Instant::now()
            .checked_sub(Duration::from_secs(7))
            .expect("the clock is past 7 s");
        metrics.set_journal_commit_started(Some(started));
        let running = metrics.journal_commit_running_for().expect("running");
        assert!(running >= Duration::from_secs(7), "{running:?}");
        metrics.set_journal_commit_started(None);
        assert_eq!(metrics.journal_commit_running_for(), None);
    }

    #[test]
    fn an_unknown_outcome_ages_from_when_it_was_first_seen_until_it_resolves() {
        let metrics = Metrics::default();
        let id = |n: u8| ReservationId::new(format!("rl-{n}")).expect("a valid ID");
        let start = std::time::Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        let reserve = |n| (id(n), AgentState::ReservationUnknown);
        let usage = |n| (id(n), AgentState::UsageUnknown);

        assert_eq!(metrics.oldest_unknown(&[], at(0)), Duration::ZERO);
        assert_eq!(
            metrics.oldest_unknown(&[reserve(1)], at(10)),
            Duration::ZERO
        );
        assert_eq!(
            metrics.oldest_unknown(&[reserve(1), usage(2)], at(25)),
            Duration::from_secs(15),
            "the oldest, timed from the first scrape that saw it"
        );
        // The first resolves: the second is the oldest now.
        assert_eq!(
            metrics.oldest_unknown(&[usage(2)], at(40)),
            Duration::from_secs(15)
        );
        // Unknown again later counts afresh.
        assert_eq!(
            metrics.oldest_unknown(&[reserve(1), usage(2)], at(41)),
            Duration::from_secs(16)
        );
        assert_eq!(
            metrics.oldest_unknown(&[reserve(1)], at(50)),
            Duration::from_secs(9)
        );
        assert_eq!(metrics.oldest_unknown(&[], at(60)), Duration::ZERO);
        assert!(metrics.unknown_since.lock().expect("unpoisoned").is_empty());
    }

    #[test]
    fn far_timers_do_not_overflow() {
        let clock = Clock::new();
        let _ = clock.instant_of(u64::MAX);
        assert!(clock.now().mono_ms < 60_000);
    }
}
