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
//! 4. commits all of the batch's changes in one durable transaction
//!    ([`BatchStore::commit`]) and only then releases the replies.
//!
//! A settle whose overdraft breaches the policy freezes its route in the
//! ledger; once that commit is durable the writer logs it as a security
//! event (`event=breach_freeze`, warn, with subject, route and reservation)
//! and counts it (`reservoir_breach_freezes_total`).
//!
//! If the commit fails, every operation of the batch is answered
//! [`Unavailable::CommitFailed`] (503) and the store rebuilds
//! ([`BatchStore::abort`]: a resident store reloads from disk, PostgreSQL
//! rolls back). A conflict between replicas before anything was applied
//! sends the operations to a later batch, at most [`ATTEMPTS_MAX`] tries.
//!
//! The loop runs on a thread of its own, "ledger-writer", on a
//! current-thread tokio runtime: redb's blocking commits never stall the
//! HTTP runtime, and PostgreSQL's client is driven there too.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use ledger::protocol::{Context, Operation, Reply};
use ledger::{CentralLedger, PairKey, SettleOutcome};
use shard_format::Ed25519Signer;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use crate::clock::Clock;
use crate::keys::GatewayKeys;
use crate::metrics::Metrics;
use crate::service::StartError;
use crate::store::{BatchStore, batch_scope};

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

/// The writer loop: one batch after another until every handle is gone
/// and nothing is left to retry.
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
    while let Some(jobs) = incoming.next_batch(parts.batch_size_max).await {
        run_batch(&mut store, jobs, &mut incoming.again, parts).await;
    }
    tracing::info!("ledger writer stopped");
}

/// One batch: whole-store reads, scope, begin, apply, commit, replies. See
/// the module documentation.
async fn run_batch<S: BatchStore>(
    store: &mut S,
    mut jobs: Vec<Job>,
    again: &mut VecDeque<Job>,
    parts: &WriterParts,
) {
    let whole: Vec<Job> = jobs
        .extract_if(.., |job| job.operation.reads_everything())
        .collect();
    for job in whole {
        let reply = whole_store_reply(store, &job.operation).await;
        let _ = job.reply.send(reply);
    }
    if jobs.is_empty() {
        return;
    }
    let now = parts.clock.now();
    let (mut scope, named) = batch_scope(jobs.iter().map(|job| (&job.operation, job.attempts > 0)));
    if let Err(error) = store.complete_scope(&mut scope, &named, now).await {
        tracing::error!(%error, "cannot look up the batch's scope: answering 503");
        fail(jobs, Unavailable::CommitFailed);
        return;
    }
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
    let context = Context {
        signer: parts.signer.as_ref(),
        gateway_verifier: &parts.gateway_keys,
    };
    let mut changes = Vec::new();
    let mut replies = Vec::with_capacity(jobs.len());
    let mut later = Vec::new();
    let mut breaches = Vec::new();
    for Job {
        operation,
        reply,
        attempts,
    } in jobs
    {
        let unfrozen = unfrozen_pair_of_settle(&operation, batch.ledger);
        match batch.apply(operation, now, context, &mut changes) {
            Ok(answer) => {
                breaches.extend(breach_freeze(unfrozen, batch.ledger, &answer));
                replies.push((reply, answer));
            }
            Err(operation) => later.push(Job {
                operation: *operation,
                reply,
                attempts,
            }),
        }
    }
    let started = Instant::now();
    let result = store.commit(&changes).await;
    if !changes.is_empty() {
        parts
            .metrics
            .observe_commit(replies.len(), started.elapsed(), result.is_ok());
    }
    match result {
        Ok(()) => {
            for breach in breaches {
                breach.log();
                parts.metrics.count_breach_freeze();
            }
            for (sender, reply) in replies {
                let _ = sender.send(Ok(reply));
            }
            requeue(again, later);
        }
        Err(error) => {
            tracing::error!(
                %error,
                operations = replies.len(),
                "commit failed: answering 503 and rebuilding from the store"
            );
            for (sender, _) in replies {
                let _ = sender.send(Err(Unavailable::CommitFailed));
            }
            fail(later, Unavailable::CommitFailed);
            // A store that cannot be rebuilt, or records that break an
            // invariant, end the process (`CrashOnPanic`): the ledger must
            // never run on a state it cannot trust.
            if let Err(error) = store.abort().await {
                panic!("the store cannot be rebuilt after a failed commit: {error}");
            }
        }
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
    reply.map_err(|error| {
        tracing::error!(%error, operation = operation.name(), "cannot read the whole store");
        Unavailable::CommitFailed
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(jobs: &[Job]) -> Vec<&'static str> {
        jobs.iter().map(|job| job.operation.name()).collect()
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
