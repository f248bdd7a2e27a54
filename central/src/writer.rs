//! The single writer: group commit over the ledger.
//!
//! Handlers send an [`Operation`] over a bounded channel
//! ([`LedgerHandle::call`]) and wait on a oneshot for its [`Reply`]. One
//! writer drains up to `batch_size_max` operations, applies each to the
//! ledger in arrival order, commits all their changes in one durable
//! transaction, and only then releases the replies. If the commit fails,
//! every operation of the batch is answered [`Unavailable::CommitFailed`]
//! (503) and the ledger is rebuilt from the store.
//!
//! - Resident stores (redb, memory): the writer is an OS thread that owns
//!   the whole ledger in memory and the synchronous store.
//! - PostgreSQL: the writer is a task that, per batch, locks the rows of the
//!   pairs the batch touches, loads their records, builds a ledger of just
//!   those, applies and commits ([`crate::store::postgres`]). Several
//!   replicas may run over one database.

use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ledger::protocol::views::{audit_of_records, audit_view};
use ledger::protocol::{Context, Operation, Reply, Scope, apply};
use ledger::store::{InjectedFault, LedgerStore, MemoryStore};
use ledger::{CentralConfig, CentralLedger, Change, PairKey};
use shard_format::{
    DocumentVerifier, Ed25519Signer, Ed25519Verifier, KeyId, Signature, SignatureError,
};
use tokio::sync::{mpsc, oneshot};

use crate::clock::Clock;
use crate::metrics::Metrics;
use crate::store::postgres::{BatchFailure, Loaded};
use crate::store::{PostgresError, PostgresStore, encode_key};

/// Most operations one commit carries.
pub const BATCH_SIZE_MAX: usize = 256;
/// Most operations waiting for the writer; callers wait for room beyond.
pub const QUEUE_DEPTH_MAX: usize = 4096;
/// Most times a PostgreSQL batch is tried again after a conflict before
/// its operations are answered 503.
const POSTGRES_ATTEMPTS_MAX: u32 = 4;
/// Most pairs one PostgreSQL worker batch locks.
const WORKER_PAIRS_MAX: i64 = 256;

/// Why an operation got no reply from the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    /// The batch's commit failed: nothing of it was acknowledged. (With
    /// PostgreSQL a failed COMMIT may still have landed: callers treat the
    /// outcome as unknown and repeat under the same ID.)
    #[error("the store failed to commit; nothing was acknowledged, retry under the same ID")]
    CommitFailed,
    /// The writer has stopped (shutdown or a fatal store error).
    #[error("the ledger writer has stopped")]
    Stopped,
}

/// Verifies a gateway's signature under the ed25519 public key its identity
/// names. The ledger asks it only after checking that the key is the
/// identity a shard is bound to.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct GatewayKeys;

impl DocumentVerifier for GatewayKeys {
    fn verify(
        &self,
        key_id: &KeyId,
        message: &[u8],
        signature: &Signature,
    ) -> Result<(), SignatureError> {
        Ed25519Verifier::new([key_id.clone()]).verify(key_id, message, signature)
    }
}

/// One queued operation.
#[derive(Debug)]
struct Job {
    operation: Operation,
    reply: oneshot::Sender<Result<Reply, Unavailable>>,
    attempts: u32,
}

/// The way into the writer. Cheap to clone.
#[derive(Debug, Clone)]
pub struct LedgerHandle {
    sender: mpsc::Sender<Job>,
}

impl LedgerHandle {
    /// Sends `operation` and waits until its batch is committed.
    pub async fn call(&self, operation: Operation) -> Result<Reply, Unavailable> {
        let (reply, answer) = oneshot::channel();
        self.sender
            .send(Job {
                operation,
                reply,
                attempts: 0,
            })
            .await
            .map_err(|_| Unavailable::Stopped)?;
        answer.await.map_err(|_| Unavailable::Stopped)?
    }
}

/// What every writer needs besides its store.
#[derive(Debug, Clone)]
pub(crate) struct WriterParts {
    pub clock: Arc<dyn Clock>,
    pub signer: Arc<Ed25519Signer>,
    pub metrics: Arc<Metrics>,
    pub config: CentralConfig,
    pub batch_size_max: usize,
}

/// A channel for a writer to serve.
pub(crate) fn channel(queue_depth_max: usize) -> (LedgerHandle, WriterQueue) {
    let (sender, receiver) = mpsc::channel(queue_depth_max.max(1));
    (LedgerHandle { sender }, WriterQueue { receiver })
}

/// The receiving end of a [`LedgerHandle`].
#[derive(Debug)]
pub(crate) struct WriterQueue {
    receiver: mpsc::Receiver<Job>,
}

/// A [`MemoryStore`] that a test can still reach after handing it to the
/// service (to inject commit faults). No durability: for tests only.
#[derive(Debug, Clone, Default)]
pub struct SharedMemoryStore(Arc<Mutex<MemoryStore>>);

impl SharedMemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the next `count` commits fail.
    pub fn fail_next_commits(&self, count: u32) {
        self.0
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .fail_next_commits(count);
    }
}

impl LedgerStore for SharedMemoryStore {
    type Error = InjectedFault;

    fn commit(&mut self, changes: &[Change]) -> Result<(), InjectedFault> {
        self.0
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .commit(changes)
    }

    fn load_all(&self) -> Result<Vec<Change>, InjectedFault> {
        self.0
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .load_all()
    }
}

/// Ends the process if the writer panics: a panic there is a broken
/// invariant or an unreadable store, and the ledger must not keep serving
/// (or silently stop serving) on a state it cannot trust. The supervisor
/// (systemd) restarts the service, which reloads from the store.
struct CrashOnPanic;

impl Drop for CrashOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!("the ledger writer panicked: aborting the process");
            std::process::abort();
        }
    }
}

// ----- resident writer -----

/// Starts the writer thread of a resident store over `ledger`.
pub(crate) fn spawn_resident<S>(
    ledger: CentralLedger,
    store: S,
    queue: WriterQueue,
    parts: WriterParts,
) -> std::thread::JoinHandle<()>
where
    S: LedgerStore + Send + 'static,
{
    std::thread::Builder::new()
        .name("ledger-writer".to_owned())
        .spawn(move || run_resident(ledger, store, queue.receiver, &parts))
        .expect("the writer thread starts")
}

/// Takes `first` and whatever else is queued, up to the batch limit.
fn drain_blocking(first: Job, receiver: &mut mpsc::Receiver<Job>, max: usize) -> Vec<Job> {
    let mut batch = vec![first];
    while batch.len() < max {
        match receiver.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
    batch
}

fn run_resident<S: LedgerStore>(
    mut ledger: CentralLedger,
    mut store: S,
    mut receiver: mpsc::Receiver<Job>,
    parts: &WriterParts,
) {
    let _crash = CrashOnPanic;
    let context = Context {
        signer: parts.signer.as_ref(),
        gateway_verifier: &GatewayKeys,
    };
    while let Some(first) = receiver.blocking_recv() {
        let batch = drain_blocking(first, &mut receiver, parts.batch_size_max);
        let now = parts.clock.now();
        let mut changes = Vec::new();
        let mut replies = Vec::with_capacity(batch.len());
        for job in batch {
            let (reply, job_changes) = apply(&mut ledger, job.operation, now, context);
            changes.extend(job_changes);
            replies.push((job.reply, reply));
        }
        if !changes.is_empty() {
            let started = Instant::now();
            let result = store.commit(&changes);
            parts
                .metrics
                .observe_commit(replies.len(), started.elapsed(), result.is_ok());
            if let Err(error) = result {
                tracing::error!(
                    %error,
                    operations = replies.len(),
                    "commit failed: answering 503 and rebuilding the ledger from the store"
                );
                for (sender, _) in replies {
                    let _ = sender.send(Err(Unavailable::CommitFailed));
                }
                ledger = reload(&store, parts.config);
                continue;
            }
        }
        for (sender, reply) in replies {
            let _ = sender.send(Ok(reply));
        }
    }
    tracing::info!("ledger writer stopped");
}

/// Rebuilds the ledger from the store after a failed commit. A store that
/// cannot be read, or records that break an invariant, end the process:
/// the ledger must never run on a state it cannot trust.
fn reload<S: LedgerStore>(store: &S, config: CentralConfig) -> CentralLedger {
    let mut delay = Duration::from_millis(10);
    for _ in 0..8 {
        match store.load_all() {
            Ok(records) => {
                return CentralLedger::from_records(config, records)
                    .unwrap_or_else(|error| panic!("stored records are inconsistent: {error}"));
            }
            Err(error) => {
                tracing::error!(%error, "cannot reload the ledger; retrying");
                std::thread::sleep(delay);
                delay *= 2;
            }
        }
    }
    panic!("the store cannot be read back after a failed commit");
}

// ----- PostgreSQL writer -----

/// Starts the writer task of a PostgreSQL store.
pub(crate) fn spawn_postgres(
    store: PostgresStore,
    url: String,
    queue: WriterQueue,
    parts: WriterParts,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(run_postgres(store, url, queue.receiver, parts))
}

/// The record keys a job reads by ID; its pair must be locked.
fn target_keys(operation: &Operation) -> Vec<String> {
    operation.named_records().iter().map(encode_key).collect()
}

/// The locks and loads a batch needs. `refill_cursor` walks the pairs for
/// the refill worker, [`WORKER_PAIRS_MAX`] per round.
async fn batch_scope(
    store: &PostgresStore,
    jobs: &[Job],
    now: shard_format::Timestamp,
    refill_cursor: &mut Option<PairKey>,
) -> Result<Scope, PostgresError> {
    let scope_of_jobs = Scope::of(jobs.iter().map(|job| &job.operation));
    let mut scope = scope_of_jobs.clone();
    // The pairs of records named only by ID; a reservation or shard request
    // names its pair, and is looked up only when it turned out to exist under
    // another pair (a retried job).
    let targets: Vec<String> = jobs
        .iter()
        .filter(|job| job.attempts > 0 || !job.operation.names_its_pair())
        .flat_map(|job| target_keys(&job.operation))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    scope
        .pairs
        .extend(store.pairs_of(&targets).await?.into_values());
    if scope_of_jobs.due_sweep {
        scope
            .pairs
            .extend(store.due_pairs(now, WORKER_PAIRS_MAX).await?);
    }
    if scope_of_jobs.refill {
        let mut pairs = store
            .pairs_after(refill_cursor.as_ref(), WORKER_PAIRS_MAX)
            .await?;
        if pairs.is_empty() && refill_cursor.is_some() {
            pairs = store.pairs_after(None, WORKER_PAIRS_MAX).await?;
        }
        *refill_cursor = if (pairs.len() as i64) < WORKER_PAIRS_MAX {
            None
        } else {
            pairs.last().cloned()
        };
        scope.pairs.extend(pairs);
    }
    Ok(scope)
}

type Replies = Vec<(oneshot::Sender<Result<Reply, Unavailable>>, Reply)>;

/// What applying a batch to its loaded records came to.
enum Applied {
    Done {
        replies: Replies,
        later: Vec<Job>,
    },
    /// The loaded records break an invariant: nothing is written.
    Corrupt {
        error: String,
        jobs: Vec<Job>,
    },
}

fn apply_loaded(
    loaded: Loaded,
    jobs: Vec<Job>,
    now: shard_format::Timestamp,
    parts: &WriterParts,
) -> (Vec<Change>, Applied) {
    let mut ledger = match CentralLedger::from_live_records(parts.config, loaded.records) {
        Ok(ledger) => ledger,
        Err(error) => {
            return (
                Vec::new(),
                Applied::Corrupt {
                    error: error.to_string(),
                    jobs,
                },
            );
        }
    };
    let context = Context {
        signer: parts.signer.as_ref(),
        gateway_verifier: &GatewayKeys,
    };
    let mut changes = Vec::new();
    let mut replies = Vec::with_capacity(jobs.len());
    let mut later = Vec::new();
    for job in jobs {
        if target_keys(&job.operation)
            .iter()
            .any(|key| loaded.unlocked.contains(key))
        {
            later.push(job);
            continue;
        }
        let (reply, job_changes) = apply(&mut ledger, job.operation, now, context);
        changes.extend(job_changes);
        replies.push((job.reply, reply));
    }
    (changes, Applied::Done { replies, later })
}

async fn run_postgres(
    mut store: PostgresStore,
    url: String,
    mut receiver: mpsc::Receiver<Job>,
    parts: WriterParts,
) {
    let _crash = CrashOnPanic;
    let mut again: VecDeque<Job> = VecDeque::new();
    let mut refill_cursor: Option<PairKey> = None;
    loop {
        let first = match again.pop_front() {
            Some(job) => job,
            None => match receiver.recv().await {
                Some(job) => job,
                None => break,
            },
        };
        let mut batch = vec![first];
        while batch.len() < parts.batch_size_max {
            if let Some(job) = again.pop_front() {
                batch.push(job);
            } else if let Ok(job) = receiver.try_recv() {
                batch.push(job);
            } else {
                break;
            }
        }
        if store.is_closed() {
            match PostgresStore::connect(&url).await {
                Ok(fresh) => store = fresh,
                Err(error) => {
                    tracing::error!(%error, "cannot reconnect to postgresql");
                    fail(batch, Unavailable::CommitFailed);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            }
        }
        let (whole, batch): (Vec<Job>, Vec<Job>) = batch
            .into_iter()
            .partition(|job| job.operation.reads_everything());
        for job in whole {
            let reply = whole_store_reply(&store, &job.operation, &parts).await;
            let _ = job.reply.send(reply);
        }
        if batch.is_empty() {
            continue;
        }
        let now = parts.clock.now();
        let scope = match batch_scope(&store, &batch, now, &mut refill_cursor).await {
            Ok(scope) => scope,
            Err(error) => {
                tracing::error!(%error, "cannot look up the batch's pairs");
                fail(batch, Unavailable::CommitFailed);
                continue;
            }
        };
        let started = Instant::now();
        let operations = batch.len();
        let result = store
            .run_batch(&scope, now, batch, |loaded, jobs| {
                apply_loaded(loaded, jobs, now, &parts)
            })
            .await;
        parts
            .metrics
            .observe_commit(operations, started.elapsed(), result.is_ok());
        match result {
            Ok(Applied::Done { replies, later }) => {
                for (sender, reply) in replies {
                    let _ = sender.send(Ok(reply));
                }
                requeue(&mut again, later);
            }
            Ok(Applied::Corrupt { error, jobs }) => {
                tracing::error!(%error, "loaded records break an invariant; nothing written");
                fail(jobs, Unavailable::CommitFailed);
            }
            Err(BatchFailure::BeforeApply { error, input }) if error.is_retryable() => {
                tracing::warn!(%error, "postgresql batch conflicted; retrying");
                requeue(&mut again, input);
            }
            Err(BatchFailure::BeforeApply { error, input }) => {
                tracing::error!(%error, "postgresql batch failed: answering 503");
                fail(input, Unavailable::CommitFailed);
            }
            Err(BatchFailure::AfterApply { error, output }) => {
                tracing::error!(%error, "postgresql commit failed: answering 503");
                match output {
                    Applied::Done { replies, later } => {
                        for (sender, _) in replies {
                            let _ = sender.send(Err(Unavailable::CommitFailed));
                        }
                        fail(later, Unavailable::CommitFailed);
                    }
                    Applied::Corrupt { jobs, .. } => fail(jobs, Unavailable::CommitFailed),
                }
            }
        }
    }
    tracing::info!("ledger writer stopped");
}

/// Puts jobs back at the head of the queue, or answers 503 to those that
/// were tried too often.
fn requeue(again: &mut VecDeque<Job>, jobs: Vec<Job>) {
    for mut job in jobs {
        job.attempts += 1;
        if job.attempts >= POSTGRES_ATTEMPTS_MAX {
            let _ = job.reply.send(Err(Unavailable::CommitFailed));
        } else {
            again.push_back(job);
        }
    }
}

fn fail(jobs: Vec<Job>, why: Unavailable) {
    for job in jobs {
        let _ = job.reply.send(Err(why));
    }
}

/// Operations over the whole store: the audit and the gauges.
async fn whole_store_reply(
    store: &PostgresStore,
    operation: &Operation,
    parts: &WriterParts,
) -> Result<Reply, Unavailable> {
    match operation {
        Operation::Gauges => store.gauges().await.map(Reply::Gauges).map_err(|error| {
            tracing::error!(%error, "cannot compute the gauges");
            Unavailable::CommitFailed
        }),
        _ => {
            let records = store.load_all().await.map_err(|error| {
                tracing::error!(%error, "cannot load the records for the audit");
                Unavailable::CommitFailed
            })?;
            Ok(Reply::Audit(
                match CentralLedger::from_records(parts.config, records.clone()) {
                    Ok(ledger) => audit_view(&ledger),
                    Err(ledger::LoadError::Invariants(violations)) => {
                        audit_of_records(&records, &violations)
                    }
                },
            ))
        }
    }
}
