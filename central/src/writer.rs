//! The single writer: group commit over a [`BatchStore`].
//!
//! Handlers send an [`Operation`] ([`LedgerHandle::call`]), or several in
//! order ([`LedgerHandle::call_many`], a batch request: they enter the
//! queue together, so no other caller's operation lands between them), and
//! wait on a oneshot per operation for its [`Reply`]. At most
//! `queue_depth_max` operations wait; callers wait for room beyond. One
//! writer loop, the same for every store, takes up to `batch_size_max`
//! operations (operations to retry first, then the rest of a submission
//! the last batch had no room for), then:
//!
//! 1. answers the whole-store reads (audit, gauges) from the store;
//! 2. computes the batch's scope ([`batch_scope`]) and lets the store
//!    complete it ([`BatchStore::complete_scope`]);
//! 3. opens the batch ([`BatchStore::begin`]) and applies each operation in
//!    arrival order with [`ledger::protocol::apply`]; an operation whose
//!    named record lives under a pair the batch did not lock is put back
//!    for a later batch;
//! 4. commits all of the batch's changes in one durable transaction and
//!    only then releases the replies.
//!
//! Step 4 runs behind the writer when the store can
//! ([`BatchStore::commit_behind`]: the resident stores, redb and memory):
//! while group N is on its way to disk, the operations that arrive go
//! through steps 1 to 3 at once, on top of N, and form group N+1 (up to
//! `batch_size_max` operations); its commit starts when N's resolved, so
//! commits keep their order and one is under way at a time. Every reply,
//! a whole-store read's too, still waits for the commit of its own group:
//! nothing is answered before what it saw is durable. PostgreSQL commits in
//! series ([`BatchStore::commit`]): its next batch locks and loads its rows
//! from the database, which must not be read before the last commit landed.
//!
//! A settle whose overdraft breaches the policy freezes its route in the
//! ledger; once that commit is durable the writer logs it as a security
//! event (`event=breach_freeze`, warn, with subject, route and reservation)
//! and counts it (`reservoir_breach_freezes_total`).
//!
//! If a commit fails, every operation of its group, and of the group
//! applied on top of it, is answered [`Unavailable::CommitFailed`] (503)
//! and the store rebuilds ([`BatchStore::abort`]: a resident store reloads
//! from disk, which drops both; PostgreSQL rolls back). A conflict between
//! replicas before anything was applied sends the operations to a later
//! batch, at most [`ATTEMPTS_MAX`] tries.
//!
//! The loop runs on a thread of its own, "ledger-writer", on a
//! current-thread tokio runtime: redb's blocking commits never stall the
//! HTTP runtime, and PostgreSQL's client is driven there too.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use ledger::protocol::{Context, Operation, Reply};
use ledger::{CentralLedger, Change, PairKey, SettleOutcome};
use shard_format::Ed25519Signer;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use crate::clock::Clock;
use crate::keys::GatewayKeys;
use crate::metrics::{BatchStep, Metrics};
use crate::service::StartError;
use crate::store::{BatchStore, CommitUnderWay, batch_scope};

/// Most operations one commit carries.
pub const BATCH_SIZE_MAX: usize = 256;
/// Most operations waiting for the writer; callers wait for room beyond.
pub const QUEUE_DEPTH_MAX: usize = 4096;
/// Most batches an operation is tried in (after a conflict between
/// replicas, or because a record it names lived under a pair its batch did
/// not lock) before it is answered 503.
const ATTEMPTS_MAX: u32 = 4;

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

/// One queued operation.
#[derive(Debug)]
struct Job {
    operation: Operation,
    reply: oneshot::Sender<Result<Reply, Unavailable>>,
    attempts: u32,
}

/// Operations sent together, in order: they enter the queue as one, so no
/// other caller's operation lands between them, and the writer takes them
/// in that order. `room` holds their places in the queue
/// ([`QUEUE_DEPTH_MAX`]) until the writer takes the last of them.
#[derive(Debug)]
struct Submission {
    jobs: Vec<Job>,
    room: OwnedSemaphorePermit,
}

/// The way into the writer. Cheap to clone.
#[derive(Debug, Clone)]
pub struct LedgerHandle {
    sender: mpsc::UnboundedSender<Submission>,
    /// One permit per operation that may wait for the writer.
    room: Arc<Semaphore>,
    /// The permits `room` was created with.
    room_max: usize,
}

impl LedgerHandle {
    /// Sends `operation` and waits until its batch is committed.
    pub async fn call(&self, operation: Operation) -> Result<Reply, Unavailable> {
        let mut replies = self.call_many(vec![operation]).await;
        replies.pop().unwrap_or(Err(Unavailable::Stopped))
    }

    /// Sends `operations` together, in order, and waits until every one's
    /// batch is committed: one reply per operation, in the same order. The
    /// operations enter the queue contiguously, so they share the writer's
    /// batches (up to its `batch_size_max` per commit) and are applied in
    /// this order; nothing is answered before its commit is durable.
    pub async fn call_many(&self, operations: Vec<Operation>) -> Vec<Result<Reply, Unavailable>> {
        let count = operations.len();
        if count == 0 {
            return Vec::new();
        }
        // More operations than the queue holds still go in as one: they
        // take every place.
        let places = u32::try_from(count.min(self.room_max)).unwrap_or(u32::MAX);
        let Ok(room) = self.room.clone().acquire_many_owned(places).await else {
            return vec![Err(Unavailable::Stopped); count];
        };
        let mut answers = Vec::with_capacity(count);
        let jobs = operations
            .into_iter()
            .map(|operation| {
                let (reply, answer) = oneshot::channel();
                answers.push(answer);
                Job {
                    operation,
                    reply,
                    attempts: 0,
                }
            })
            .collect();
        let submission = Submission { jobs, room };
        if self.sender.send(submission).is_err() {
            return vec![Err(Unavailable::Stopped); count];
        }
        let mut replies = Vec::with_capacity(count);
        for answer in answers {
            replies.push(answer.await.unwrap_or(Err(Unavailable::Stopped)));
        }
        replies
    }
}

/// What every writer needs besides its store.
#[derive(Debug, Clone)]
pub(crate) struct WriterParts {
    pub clock: Arc<dyn Clock>,
    pub signer: Arc<Ed25519Signer>,
    pub metrics: Arc<Metrics>,
    pub batch_size_max: usize,
    /// Gateways' keys, shared with the HTTP shell.
    pub gateway_keys: GatewayKeys,
}

impl WriterParts {
    /// Observes a batch's `step`, begun at `started`; returns when it
    /// ended, the next step's start.
    fn step_done(&self, step: BatchStep, started: Instant) -> Instant {
        let ended = Instant::now();
        self.metrics
            .observe_batch_step(step, ended.saturating_duration_since(started));
        ended
    }
}

/// A channel for a writer to serve: at most `queue_depth_max` operations
/// wait in it; callers wait for room beyond.
pub(crate) fn channel(queue_depth_max: usize) -> (LedgerHandle, WriterQueue) {
    let room_max = queue_depth_max.clamp(1, Semaphore::MAX_PERMITS);
    let (sender, receiver) = mpsc::unbounded_channel();
    let handle = LedgerHandle {
        sender,
        room: Arc::new(Semaphore::new(room_max)),
        room_max,
    };
    (handle, WriterQueue { receiver })
}

/// The receiving end of a [`LedgerHandle`].
#[derive(Debug)]
pub(crate) struct WriterQueue {
    receiver: mpsc::UnboundedReceiver<Submission>,
}

/// What the writer takes its batches from: operations to retry first,
/// then the rest of a submission a batch had no room for, then the queue.
#[derive(Debug)]
struct Incoming {
    receiver: mpsc::UnboundedReceiver<Submission>,
    again: VecDeque<Job>,
    /// The jobs of a submission after those a batch took, and its room.
    rest: VecDeque<Job>,
    rest_room: Option<OwnedSemaphorePermit>,
}

impl Incoming {
    /// Up to `max` jobs, those to retry first; waits for the first. `None`
    /// once the channel is closed and nothing is left to retry. A
    /// submission's jobs are taken in order; those a batch has no room
    /// for open the next.
    async fn next_batch(&mut self, max: usize) -> Option<Vec<Job>> {
        let mut batch = Vec::new();
        while batch.len() < max {
            if let Some(job) = self.again.pop_front() {
                batch.push(job);
            } else if let Some(job) = self.rest.pop_front() {
                batch.push(job);
            } else {
                // The last submission is fully taken: its places free up.
                self.rest_room = None;
                let submission = if batch.is_empty() {
                    self.receiver.recv().await?
                } else {
                    match self.receiver.try_recv() {
                        Ok(submission) => submission,
                        Err(_) => break,
                    }
                };
                self.rest = submission.jobs.into();
                self.rest_room = Some(submission.room);
            }
        }
        if self.rest.is_empty() {
            self.rest_room = None;
        }
        Some(batch)
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

/// Starts the writer thread. On its own current-thread runtime it opens the
/// store with `open`, reports how that went (the `Err` of `open`, or the
/// thread's own failure to start), then serves `queue` until every
/// [`LedgerHandle`] is gone and the queue is drained.
pub(crate) async fn spawn<S, Open, Opening>(
    open: Open,
    queue: WriterQueue,
    parts: WriterParts,
) -> Result<std::thread::JoinHandle<()>, StartError>
where
    S: BatchStore,
    Open: FnOnce() -> Opening + Send + 'static,
    Opening: Future<Output = Result<S, StartError>>,
{
    let (opened, ready) = oneshot::channel();
    let thread = std::thread::Builder::new()
        .name("ledger-writer".to_owned())
        .spawn(move || {
            let _crash = CrashOnPanic;
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(error) => {
                    let _ = opened.send(Err(StartError::Writer(error)));
                    return;
                }
            };
            runtime.block_on(async move {
                let store = match open().await {
                    Ok(store) => {
                        let _ = opened.send(Ok(()));
                        store
                    }
                    Err(error) => {
                        let _ = opened.send(Err(error));
                        return;
                    }
                };
                run(store, queue.receiver, &parts).await;
            });
        })
        .map_err(StartError::Writer)?;
    match ready.await {
        Ok(Ok(())) => Ok(thread),
        Ok(Err(error)) => {
            let _ = thread.join();
            Err(error)
        }
        Err(_) => Err(StartError::Writer(std::io::Error::other(
            "the writer thread ended while opening the store",
        ))),
    }
}

/// Operations applied to the ledger whose commit has not started: the
/// group the next commit carries.
#[derive(Debug, Default)]
struct Applied {
    changes: Vec<Change>,
    /// Answers that wait for the commit (whole-store reads among them).
    replies: Vec<(ReplySender, Reply)>,
    breaches: Vec<BreachFreeze>,
    /// Jobs for a later batch once this one is committed.
    later: Vec<Job>,
}

type ReplySender = oneshot::Sender<Result<Reply, Unavailable>>;

impl Applied {
    fn operations(&self) -> usize {
        self.replies.len() + self.later.len()
    }

    fn is_empty(&self) -> bool {
        self.operations() == 0 && self.changes.is_empty()
    }
}

/// A group whose commit is on its way to disk
/// ([`BatchStore::commit_behind`]).
struct UnderWay<E> {
    commit: CommitUnderWay<E>,
    /// The group, its changes handed to the store.
    group: Applied,
    /// Whether it had changes (a commit to count in the metrics).
    changed: bool,
    started: Instant,
}

/// The writer loop: one batch after another until every handle is gone
/// and nothing is left to retry or to commit. With a store that commits
/// behind, the operations that arrive while a group commits are applied at
/// once and form the next group, committed when that one resolved.
async fn run<S: BatchStore>(
    mut store: S,
    receiver: mpsc::UnboundedReceiver<Submission>,
    parts: &WriterParts,
) {
    let mut incoming = Incoming {
        receiver,
        again: VecDeque::new(),
        rest: VecDeque::new(),
        rest_room: None,
    };
    let mut under_way: Option<UnderWay<S::Error>> = None;
    let mut applied = Applied::default();
    let mut closed = false;
    loop {
        let Some(committing) = under_way.as_mut() else {
            // Nothing is on its way to disk, so nothing is applied either:
            // a group starts its commit as soon as the previous resolved.
            let Some(jobs) = incoming.next_batch(parts.batch_size_max).await else {
                break;
            };
            apply_jobs(
                &mut store,
                jobs,
                &mut applied,
                false,
                &mut incoming.again,
                parts,
            )
            .await;
            under_way = commit(
                &mut store,
                std::mem::take(&mut applied),
                &mut incoming.again,
                parts,
            )
            .await;
            continue;
        };
        let room = parts.batch_size_max.saturating_sub(applied.operations());
        tokio::select! {
            // Releasing replies and starting the next commit come first.
            biased;
            result = &mut committing.commit => {
                let Some(done) = under_way.take() else { continue };
                if committed(done.group, done.changed, done.started, result, &mut incoming.again, parts) {
                    under_way = commit(&mut store, std::mem::take(&mut applied), &mut incoming.again, parts).await;
                } else {
                    // Applied on top of what failed: none of it may stand.
                    let group = std::mem::take(&mut applied);
                    for (sender, _) in group.replies {
                        let _ = sender.send(Err(Unavailable::CommitFailed));
                    }
                    fail(group.later, Unavailable::CommitFailed);
                    rebuild(&mut store).await;
                }
            }
            jobs = incoming.next_batch(room), if room > 0 && !closed => match jobs {
                Some(jobs) => {
                    apply_jobs(&mut store, jobs, &mut applied, true, &mut incoming.again, parts).await;
                }
                // Whatever is left to retry is taken once the commit resolved.
                None => closed = true,
            },
        }
    }
    tracing::info!("ledger writer stopped");
}

/// Answers the whole-store reads among `jobs` (audit, gauges), then scopes,
/// begins and applies the others, adding them to `applied`. While
/// `pending` (a commit under way or operations applied before), a
/// whole-store read saw changes that are not durable yet: it waits for the
/// group's commit like any other reply. Otherwise a store that reads them
/// beside the batches ([`BatchStore::read_beside`]) answers them from a
/// task of their own.
async fn apply_jobs<S: BatchStore>(
    store: &mut S,
    mut jobs: Vec<Job>,
    applied: &mut Applied,
    pending: bool,
    again: &mut VecDeque<Job>,
    parts: &WriterParts,
) {
    let whole: Vec<Job> = jobs
        .extract_if(.., |job| job.operation.reads_everything())
        .collect();
    for job in whole {
        // With nothing applied that is not durable yet, the read may run
        // beside the batches where the store can: the writer goes on.
        if !pending
            && applied.is_empty()
            && let Some(read) = store.read_beside(&job.operation)
        {
            tokio::spawn(async move {
                let reply = read.await;
                let _ = job
                    .reply
                    .send(reply.map_err(|error| whole_store_failed(&error, &job.operation)));
            });
            continue;
        }
        match whole_store_reply(store, &job.operation).await {
            Ok(reply) if pending || !applied.is_empty() => applied.replies.push((job.reply, reply)),
            reply => {
                let _ = job.reply.send(reply);
            }
        }
    }
    if jobs.is_empty() {
        return;
    }
    let now = parts.clock.now();
    let step_started = Instant::now();
    let (mut scope, named) = batch_scope(jobs.iter().map(|job| (&job.operation, job.attempts > 0)));
    if let Err(error) = store.complete_scope(&mut scope, &named, now).await {
        tracing::error!(%error, "cannot look up the batch's scope: answering 503");
        fail(jobs, Unavailable::CommitFailed);
        return;
    }
    let step_started = parts.step_done(BatchStep::Scope, step_started);
    let mut batch = match store.begin(&scope, now).await {
        Ok(batch) => batch,
        Err(error) if S::is_conflict(&error) => {
            tracing::warn!(%error, "the batch conflicted with another writer; retrying");
            requeue(again, jobs);
            return;
        }
        Err(error) => {
            tracing::error!(%error, "cannot begin the batch: answering 503");
            fail(jobs, Unavailable::CommitFailed);
            return;
        }
    };
    let step_started = parts.step_done(BatchStep::Begin, step_started);
    let context = Context {
        signer: parts.signer.as_ref(),
        gateway_verifier: &parts.gateway_keys,
    };
    for Job {
        operation,
        reply,
        attempts,
    } in jobs
    {
        let unfrozen = unfrozen_pair_of_settle(&operation, batch.ledger);
        match batch.apply(operation, now, context, &mut applied.changes) {
            Ok(answer) => {
                applied
                    .breaches
                    .extend(breach_freeze(unfrozen, batch.ledger, &answer));
                applied.replies.push((reply, answer));
            }
            Err(operation) => applied.later.push(Job {
                operation: *operation,
                reply,
                attempts,
            }),
        }
    }
    parts.step_done(BatchStep::Apply, step_started);
}

/// Commits `group`: behind the writer if the store can (the commit under
/// way is returned), or else at once, releasing its replies.
async fn commit<S: BatchStore>(
    store: &mut S,
    mut group: Applied,
    again: &mut VecDeque<Job>,
    parts: &WriterParts,
) -> Option<UnderWay<S::Error>> {
    if group.is_empty() {
        return None;
    }
    let started = Instant::now();
    let changed = !group.changes.is_empty();
    match store.commit_behind(std::mem::take(&mut group.changes)) {
        Ok(commit) => Some(UnderWay {
            commit,
            group,
            changed,
            started,
        }),
        Err(changes) => {
            let result = store.commit(&changes).await;
            if !committed(group, changed, started, result, again, parts) {
                rebuild(store).await;
            }
            None
        }
    }
}

/// Releases `group`'s replies once its commit resolved `Ok`; after an
/// `Err`, answers 503 to all of it (the caller then rebuilds the store).
/// Whether it was committed.
fn committed<E: std::fmt::Display>(
    group: Applied,
    changed: bool,
    started: Instant,
    result: Result<(), E>,
    again: &mut VecDeque<Job>,
    parts: &WriterParts,
) -> bool {
    if changed {
        parts
            .metrics
            .observe_commit(group.replies.len(), started.elapsed(), result.is_ok());
    }
    match result {
        Ok(()) => {
            for breach in group.breaches {
                breach.log();
                parts.metrics.count_breach_freeze();
            }
            for (sender, reply) in group.replies {
                let _ = sender.send(Ok(reply));
            }
            requeue(again, group.later);
            true
        }
        Err(error) => {
            tracing::error!(
                %error,
                operations = group.replies.len(),
                "commit failed: answering 503 and rebuilding from the store"
            );
            for (sender, _) in group.replies {
                let _ = sender.send(Err(Unavailable::CommitFailed));
            }
            fail(group.later, Unavailable::CommitFailed);
            false
        }
    }
}

/// Brings the store back to what was last committed after a failed commit.
async fn rebuild<S: BatchStore>(store: &mut S) {
    // A store that cannot be rebuilt, or records that break an invariant,
    // end the process (`CrashOnPanic`): the ledger must never run on a
    // state it cannot trust.
    if let Err(error) = store.abort().await {
        panic!("the store cannot be rebuilt after a failed commit: {error}");
    }
}

/// A route a settle froze: its overdraft breached the policy (above
/// `overdraftUnitsMax`, or the execution ran past its hard limit).
#[derive(Debug, Clone, PartialEq, Eq)]
struct BreachFreeze {
    pair: PairKey,
    reservation: shard_format::ReservationId,
    overdraft_units: u64,
}

impl BreachFreeze {
    fn log(&self) {
        tracing::warn!(
            event = "breach_freeze",
            subject = %self.pair.subject,
            route = %self.pair.route,
            reservation = %self.reservation,
            overdraft_units = self.overdraft_units,
            "a settlement's overdraft breached the policy: the route is frozen until an operator unfreezes it"
        );
    }
}

/// The pair of the reservation `operation` settles, if that pair is not
/// frozen now: only a settle freezes a pair without an operator, so only a
/// settle is watched.
fn unfrozen_pair_of_settle(operation: &Operation, ledger: &CentralLedger) -> Option<PairKey> {
    let Operation::Settle { reservation, .. } = operation else {
        return None;
    };
    let receipt = &ledger.reservation(reservation)?.receipt;
    let pair = PairKey::new(receipt.subject.clone(), receipt.route.clone());
    let frozen = ledger.pair(&pair).is_some_and(|record| record.frozen);
    (!frozen).then_some(pair)
}

/// The breach freeze a settle made: `unfrozen` (from
/// [`unfrozen_pair_of_settle`] before it) is frozen after it.
fn breach_freeze(
    unfrozen: Option<PairKey>,
    ledger: &CentralLedger,
    reply: &Reply,
) -> Option<BreachFreeze> {
    let pair = unfrozen?;
    let Reply::Settle(SettleOutcome::Settled(receipt) | SettleOutcome::Corrected(receipt)) = reply
    else {
        return None;
    };
    ledger
        .pair(&pair)
        .is_some_and(|record| record.frozen)
        .then(|| BreachFreeze {
            pair,
            reservation: receipt.reservation.clone(),
            overdraft_units: receipt.overdraft_units,
        })
}

/// Puts jobs back for the next batch, or answers 503 to those tried
/// [`ATTEMPTS_MAX`] times.
fn requeue(again: &mut VecDeque<Job>, jobs: Vec<Job>) {
    for mut job in jobs {
        job.attempts += 1;
        if job.attempts >= ATTEMPTS_MAX {
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
async fn whole_store_reply<S: BatchStore>(
    store: &mut S,
    operation: &Operation,
) -> Result<Reply, Unavailable> {
    let reply = match operation {
        Operation::Gauges => store.gauges().await.map(Reply::Gauges),
        _ => store.audit().await.map(Reply::Audit),
    };
    reply.map_err(|error| whole_store_failed(&error, operation))
}

/// Logs why a whole-store read failed; the caller is answered 503.
fn whole_store_failed(error: &dyn std::fmt::Display, operation: &Operation) -> Unavailable {
    tracing::error!(%error, operation = operation.name(), "cannot read the whole store");
    Unavailable::CommitFailed
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use ledger::protocol::views::AuditResponse;
    use ledger::protocol::{Gauges, Scope};
    use ledger::store::contract::sample_policy;
    use ledger::store::{InjectedFault, LedgerStore};
    use ledger::{CentralConfig, PublishOutcome, RecordKey};
    use shard_format::{Route, Subject, Timestamp};
    use tokio::sync::oneshot::error::TryRecvError;

    use super::*;
    use crate::clock::ManualClock;
    use crate::store::{Batch, ReadBeside, ResidentStore, SharedMemoryStore, encode_key};

    /// A record store whose commits wait for the test: each reports its
    /// record keys when it starts, then commits (`true`) or fails
    /// (`false`) as told.
    #[derive(Debug)]
    struct GatedStore {
        records: SharedMemoryStore,
        started: mpsc::UnboundedSender<Vec<String>>,
        verdicts: std::sync::mpsc::Receiver<bool>,
    }

    impl LedgerStore for GatedStore {
        type Error = InjectedFault;

        fn commit(&mut self, changes: &[Change]) -> Result<(), InjectedFault> {
            let keys = changes.iter().map(|change| encode_key(&change.key()));
            let _ = self.started.send(keys.collect());
            // A test that is gone fails the commit rather than hang it.
            if !self.verdicts.recv().unwrap_or(false) {
                self.records.fail_next_commits(1);
            }
            self.records.commit(changes)
        }

        fn load_all(&self) -> Result<Vec<Change>, InjectedFault> {
            self.records.load_all()
        }
    }

    /// The test's side of a [`GatedStore`].
    struct Gate {
        records: SharedMemoryStore,
        started: mpsc::UnboundedReceiver<Vec<String>>,
        verdicts: std::sync::mpsc::Sender<bool>,
    }

    impl Gate {
        /// The record keys of the next commit, once it started.
        async fn started(&mut self) -> Vec<String> {
            self.started.recv().await.expect("a commit starts")
        }

        fn decide(&self, commits: bool) {
            self.verdicts.send(commits).expect("the commit waits");
        }
    }

    fn gated_store() -> (ResidentStore<GatedStore>, Gate) {
        let records = SharedMemoryStore::new();
        let (started, started_receiver) = mpsc::unbounded_channel();
        let (verdicts, verdicts_receiver) = std::sync::mpsc::channel();
        let store = GatedStore {
            records: records.clone(),
            started,
            verdicts: verdicts_receiver,
        };
        let gate = Gate {
            records,
            started: started_receiver,
            verdicts,
        };
        let store = ResidentStore::open(store, CentralConfig::default()).expect("open");
        (store, gate)
    }

    fn parts() -> WriterParts {
        WriterParts {
            clock: Arc::new(ManualClock::new(
                Timestamp::from_unix_ms(1_784_469_600_000).expect("valid"),
            )),
            signer: Arc::new(Ed25519Signer::from_secret_bytes(&[7; 32])),
            metrics: Arc::new(Metrics::default()),
            batch_size_max: BATCH_SIZE_MAX,
            gateway_keys: GatewayKeys::default(),
        }
    }

    /// Publishes the sample policy for `subject`'s pair.
    fn publish(subject: &str) -> Operation {
        let mut policy = sample_policy(1);
        policy.subject = Subject::new(subject).expect("valid");
        policy.route = Route::new("chat.generate").expect("valid");
        Operation::Publish(Box::new(policy))
    }

    /// Whether every key of a commit belongs to `subject`.
    fn all_of(keys: &[String], subject: &str) -> bool {
        !keys.is_empty() && keys.iter().all(|key| key.contains(subject))
    }

    /// Queues `operation` as one submission: its reply comes on the
    /// returned receiver.
    async fn submit(
        handle: &LedgerHandle,
        operation: Operation,
    ) -> oneshot::Receiver<Result<Reply, Unavailable>> {
        let room = handle
            .room
            .clone()
            .acquire_many_owned(1)
            .await
            .expect("open");
        let (reply, answer) = oneshot::channel();
        let job = Job {
            operation,
            reply,
            attempts: 0,
        };
        let submission = Submission {
            jobs: vec![job],
            room,
        };
        handle.sender.send(submission).expect("the writer runs");
        answer
    }

    /// Waits until the writer took every submission. It applies what it
    /// takes before it yields (the resident store never waits), so they
    /// are applied too.
    async fn taken(handle: &LedgerHandle) {
        while handle.room.available_permits() < handle.room_max {
            tokio::task::yield_now().await;
        }
    }

    fn published(reply: Result<Result<Reply, Unavailable>, oneshot::error::RecvError>) -> bool {
        matches!(reply, Ok(Ok(Reply::Publish(PublishOutcome::Published))))
    }

    #[tokio::test]
    async fn replies_wait_for_their_own_commit_and_commits_keep_their_order() {
        let (store, mut gate) = gated_store();
        let parts = parts();
        let (handle, queue) = channel(16);
        let scenario = async move {
            let mut first = submit(&handle, publish("tenant-7")).await;
            assert!(all_of(&gate.started().await, "tenant-7"));
            // Applied while the first commit is on its way to disk.
            let mut second = submit(&handle, publish("tenant-8")).await;
            let mut audit = submit(&handle, Operation::Audit).await;
            taken(&handle).await;
            for answer in [&mut first, &mut second, &mut audit] {
                assert_eq!(answer.try_recv(), Err(TryRecvError::Empty));
            }
            assert!(gate.started.try_recv().is_err(), "one commit at a time");
            gate.decide(true);
            assert!(published(first.await));
            assert!(all_of(&gate.started().await, "tenant-8"));
            assert_eq!(second.try_recv(), Err(TryRecvError::Empty));
            assert_eq!(
                audit.try_recv(),
                Err(TryRecvError::Empty),
                "the audit saw the second publish: it waits for its commit"
            );
            gate.decide(true);
            assert!(published(second.await));
            assert!(matches!(audit.await, Ok(Ok(Reply::Audit(_)))));
            let stored = gate.records.load_all().expect("load");
            let stored: Vec<String> = stored.iter().map(|c| encode_key(&c.key())).collect();
            assert!(stored.iter().any(|key| key.contains("tenant-7")));
            assert!(stored.iter().any(|key| key.contains("tenant-8")));
        };
        tokio::join!(run(store, queue.receiver, &parts), scenario);
    }

    #[tokio::test]
    async fn a_failed_commit_fails_what_was_applied_on_top_of_it() {
        let (store, mut gate) = gated_store();
        let parts = parts();
        let (handle, queue) = channel(16);
        let scenario = async move {
            let first = submit(&handle, publish("tenant-7")).await;
            assert!(all_of(&gate.started().await, "tenant-7"));
            let second = submit(&handle, publish("tenant-8")).await;
            let audit = submit(&handle, Operation::Audit).await;
            taken(&handle).await;
            gate.decide(false);
            assert_eq!(first.await, Ok(Err(Unavailable::CommitFailed)));
            // Answered with the first, before the writer waits again.
            for mut answer in [second, audit] {
                assert_eq!(answer.try_recv(), Ok(Err(Unavailable::CommitFailed)));
            }
            assert!(
                gate.records.load_all().expect("load").is_empty(),
                "nothing of either group is stored"
            );
            // The rebuilt ledger holds neither: each publishes anew, and
            // nothing of the second group is committed with the first.
            let first = submit(&handle, publish("tenant-7")).await;
            assert!(all_of(&gate.started().await, "tenant-7"));
            gate.decide(true);
            assert!(published(first.await));
            let second = submit(&handle, publish("tenant-8")).await;
            assert!(all_of(&gate.started().await, "tenant-8"));
            gate.decide(true);
            assert!(published(second.await));
        };
        tokio::join!(run(store, queue.receiver, &parts), scenario);
        assert!(
            parts
                .metrics
                .render(None)
                .contains("reservoir_commit_failures_total 1")
        );
    }

    fn names(jobs: &[Job]) -> Vec<&'static str> {
        jobs.iter().map(|job| job.operation.name()).collect()
    }

    /// A store that reads its gauges beside the batches, as the
    /// PostgreSQL store does: the read waits for the test's word.
    struct BesideStore {
        inner: ResidentStore<SharedMemoryStore>,
        read: std::sync::Mutex<Option<oneshot::Receiver<()>>>,
    }

    impl BatchStore for BesideStore {
        type Error = <ResidentStore<SharedMemoryStore> as BatchStore>::Error;

        async fn complete_scope(
            &mut self,
            scope: &mut Scope,
            named: &BTreeSet<RecordKey>,
            now: Timestamp,
        ) -> Result<(), Self::Error> {
            self.inner.complete_scope(scope, named, now).await
        }

        async fn begin(&mut self, scope: &Scope, now: Timestamp) -> Result<Batch<'_>, Self::Error> {
            self.inner.begin(scope, now).await
        }

        async fn commit(&mut self, changes: &[Change]) -> Result<(), Self::Error> {
            self.inner.commit(changes).await
        }

        async fn abort(&mut self) -> Result<(), Self::Error> {
            self.inner.abort().await
        }

        async fn audit(&mut self) -> Result<AuditResponse, Self::Error> {
            self.inner.audit().await
        }

        async fn gauges(&mut self) -> Result<Gauges, Self::Error> {
            panic!("the gauges are read beside the batches")
        }

        fn read_beside(&self, operation: &Operation) -> Option<ReadBeside<Self::Error>> {
            assert!(matches!(operation, Operation::Gauges), "{operation:?}");
            let read = self.read.lock().expect("unpoisoned").take();
            let read = read.expect("the gauges are read once");
            Some(Box::pin(async move {
                let _ = read.await;
                Ok(Reply::Gauges(Gauges {
                    frozen_routes: 7,
                    ..Gauges::default()
                }))
            }))
        }
    }

    #[tokio::test]
    async fn the_gauges_read_beside_the_batches_hold_none_of_them() {
        let (release, read) = oneshot::channel();
        let store = BesideStore {
            inner: ResidentStore::open(SharedMemoryStore::new(), CentralConfig::default())
                .expect("open"),
            read: std::sync::Mutex::new(Some(read)),
        };
        let parts = parts();
        let (handle, queue) = channel(16);
        let scenario = async move {
            let mut gauges = submit(&handle, Operation::Gauges).await;
            let publish = submit(&handle, publish("tenant-7")).await;
            assert!(
                published(publish.await),
                "answered while the gauges are read"
            );
            assert_eq!(gauges.try_recv(), Err(TryRecvError::Empty));
            release.send(()).expect("the read waits");
            assert!(matches!(
                gauges.await,
                Ok(Ok(Reply::Gauges(Gauges {
                    frozen_routes: 7,
                    ..
                })))
            ));
        };
        tokio::join!(run(store, queue.receiver, &parts), scenario);
    }

    #[tokio::test]
    async fn a_submission_is_taken_whole_and_in_order_across_batches() {
        let (handle, queue) = channel(4);
        let mut incoming = Incoming {
            receiver: queue.receiver,
            again: VecDeque::new(),
            rest: VecDeque::new(),
            rest_room: None,
        };
        let many = handle.clone();
        let sent = tokio::spawn(async move {
            many.call_many(vec![Operation::Audit, Operation::Gauges, Operation::Refill])
                .await
        });
        let single = handle.clone();
        // The three hold three of four places; the single call takes the
        // fourth once they are queued.
        while handle.room.available_permits() == 4 {
            tokio::task::yield_now().await;
        }
        let alone = tokio::spawn(async move { single.call(Operation::BeginExpiry).await });
        while handle.room.available_permits() > 0 {
            tokio::task::yield_now().await;
        }
        let first = incoming.next_batch(2).await.expect("a batch");
        assert_eq!(names(&first), ["audit", "gauges"]);
        assert_eq!(handle.room.available_permits(), 0, "one of the three waits");
        let second = incoming.next_batch(2).await.expect("a batch");
        assert_eq!(names(&second), ["refill", "begin_expiry"]);
        assert_eq!(handle.room.available_permits(), 4, "every place is free");
        for job in first.into_iter().chain(second) {
            let _ = job.reply.send(Err(Unavailable::Stopped));
        }
        assert_eq!(sent.await.expect("joins").len(), 3);
        assert_eq!(alone.await.expect("joins"), Err(Unavailable::Stopped));
    }
}
