//! The stores of the central ledger's records, behind one interface the
//! writer drives per batch: [`BatchStore`].
//!
//! - [`ResidentStore`] over redb ([`RedbStore`], the default, one node) or
//!   memory ([`SharedMemoryStore`], tests): the whole ledger lives in memory
//!   and every commit goes to a [`ledger::store::LedgerStore`].
//! - [`PostgresStore`]: one table of records in PostgreSQL, for many
//!   stateless replicas over one database. Each batch locks its scope's rows
//!   and loads just their records ([`postgres`]).
//!
//! Both durable stores keep one record per [`RecordKey`] under the text key
//! of [`encode_key`] (the redb store's reservations keyed in the order
//! they came instead, see [`RedbStore`]), with the [`Change`] as JSON
//! (PostgreSQL) or MessagePack (redb). Every [`BatchStore`]
//! passes [`contract::check_batch_store`]; the resident stores' record
//! stores also pass [`ledger::store::contract::check_store`].

mod compact;
pub mod contract;
pub mod postgres;
pub mod postgres_tls;
mod redb_store;
mod resident;

use std::collections::BTreeSet;
use std::future::Future;
use std::pin::Pin;

use ledger::protocol::views::AuditResponse;
use ledger::protocol::{Context, Gauges, Operation, Reply, Scope, apply};
use ledger::{CentralLedger, Change, PairKey, RecordKey};
use shard_format::Timestamp;

pub use postgres::{PostgresError, PostgresStore};
pub use redb_store::{RedbStore, RedbStoreError};
pub use resident::{ResidentError, ResidentStore, SharedMemoryStore};

/// Where the writer applies batches of operations and commits their changes.
///
/// Per batch the writer calls, in this order:
///
/// 1. [`complete_scope`](Self::complete_scope) with what the batch's
///    operations read ([`batch_scope`]);
/// 2. [`begin`](Self::begin) with that scope, which hands out the ledger to
///    apply the batch to (and the records it could not lock);
/// 3. [`ledger::protocol::apply`] for each operation ([`Batch::apply`]);
/// 4. [`commit`](Self::commit) with all of the batch's changes; the replies
///    are released only after it returned `Ok`;
/// 5. after a failed commit (or to drop a batch unapplied),
///    [`abort`](Self::abort).
///
/// [`audit`](Self::audit) and [`gauges`](Self::gauges) read the whole store
/// and are only called between batches; the future of
/// [`read_beside`](Self::read_beside), taken between batches while nothing
/// applied waits for its commit, runs beside the next ones.
///
/// A store that holds the whole ledger in memory may commit behind the
/// writer ([`commit_behind`](Self::commit_behind), contract item 5): step 4
/// only starts the commit, and the writer applies the next operations
/// (steps 1 to 3, `audit`, `gauges`) to the same ledger while it is on its
/// way to disk.
///
/// The contract, checked by [`contract::check_batch_store`]:
///
/// 1. **Scoped**: the ledger `begin` returns holds every record the scope's
///    operations can read or write, as last committed, and no other writer
///    (another replica) changes those records until the batch commits or is
///    aborted. A record named by ID that lives under a pair the scope does
///    not hold is reported in [`Batch::unlocked`] instead; operations naming
///    it are deferred to a later batch.
/// 2. **Atomic and durable**: `commit` stores all of its changes or none of
///    them, also across a crash; once it returned `Ok`, a crash loses none
///    of them. A reopened store (a restart) loads exactly what was
///    committed.
/// 3. **Failed batches change nothing**: after `begin` returned `Err`, no
///    batch is open; after a failed `commit`, or a batch applied but never
///    committed, `abort` brings the store back to what was last committed
///    (a resident store reloads it from disk). An `Err` from `abort` means
///    the store cannot go on: the writer ends the process.
/// 4. **Conflicts are retryable**: an error for which
///    [`is_conflict`](Self::is_conflict) holds (a serialization failure
///    between replicas) left nothing changed, and the same operations may be
///    tried again in a later batch.
/// 5. **Commits behind keep their order**: a store whose
///    [`commit_behind`](Self::commit_behind) takes the changes starts their
///    commit and closes the batch at once. The writer starts no other commit
///    before that one resolved; meanwhile `complete_scope`, `begin` (any
///    number of times), `audit` and `gauges` work on the ledger with those
///    changes applied, and everything applied meanwhile goes to the next
///    commit. A commit that resolved `Err` stored nothing; `abort` then
///    drops its changes and everything applied on top of them.
///
/// The futures need not be `Send`: the writer runs the store on a
/// current-thread runtime of its own thread.
#[allow(async_fn_in_trait)]
pub trait BatchStore {
    type Error: std::error::Error + Send + Sync + 'static;

    /// Adds what only the store can look up to `scope`: the pairs of the
    /// records in `named`, the pairs with reservations due at `now` (when
    /// [`Scope::due_sweep`]), the next pairs of the refill cursor (when
    /// [`Scope::refill`]), the records past the retention window with their
    /// pairs and IDs (when [`Scope::forget_sweep`]). A store that holds the
    /// whole ledger needs none.
    async fn complete_scope(
        &mut self,
        scope: &mut Scope,
        named: &BTreeSet<RecordKey>,
        now: Timestamp,
    ) -> Result<(), Self::Error>;

    /// Opens a batch over `scope` at `now` (contract item 1): the ledger to
    /// apply it to, valid until [`commit`](Self::commit) or
    /// [`abort`](Self::abort).
    async fn begin(&mut self, scope: &Scope, now: Timestamp) -> Result<Batch<'_>, Self::Error>;

    /// Commits the open batch's `changes` atomically and durably and closes
    /// the batch (contract item 2). After an `Err`, call
    /// [`abort`](Self::abort).
    async fn commit(&mut self, changes: &[Change]) -> Result<(), Self::Error>;

    /// Starts the commit of the open batch's `changes` and closes the batch
    /// without waiting for them to be durable (contract item 5): the
    /// returned future resolves once they are, or with why they are not
    /// (then call [`abort`](Self::abort)). A store that cannot hand out the
    /// next batch before this commit is durable gives the changes back, and
    /// the writer commits them with [`commit`](Self::commit): the default.
    fn commit_behind(
        &mut self,
        changes: Vec<Change>,
    ) -> Result<CommitUnderWay<Self::Error>, Vec<Change>> {
        Err(changes)
    }

    /// Drops the open batch, if any, and whatever it changed in memory
    /// (contract item 3).
    async fn abort(&mut self) -> Result<(), Self::Error>;

    /// The audit of every committed record.
    async fn audit(&mut self) -> Result<AuditResponse, Self::Error>;

    /// The gauges over every committed record.
    async fn gauges(&mut self) -> Result<Gauges, Self::Error>;

    /// `operation` (the audit or the gauges) over every committed record,
    /// read beside the batches: a future that holds nothing of the store,
    /// which the writer runs while it goes on with the next batch. `None`
    /// (the default): the writer awaits [`audit`](Self::audit) or
    /// [`gauges`](Self::gauges) between two batches, as a store that reads
    /// them from memory does.
    fn read_beside(&self, operation: &Operation) -> Option<ReadBeside<Self::Error>> {
        let _ = operation;
        None
    }

    /// Whether `error` was a conflict with another writer that a later
    /// batch may retry (contract item 4).
    fn is_conflict(error: &Self::Error) -> bool {
        let _ = error;
        false
    }
}

/// A commit on its way to disk ([`BatchStore::commit_behind`]): resolves
/// once its changes are durable, or with why they are not.
pub type CommitUnderWay<E> = Pin<Box<dyn Future<Output = Result<(), E>>>>;

/// A whole-store read beside the batches ([`BatchStore::read_beside`]).
pub type ReadBeside<E> = Pin<Box<dyn Future<Output = Result<Reply, E>> + Send>>;

/// An open batch: the ledger to apply its operations to.
#[derive(Debug)]
pub struct Batch<'a> {
    pub ledger: &'a mut CentralLedger,
    /// Records named by the batch's operations that live under a pair the
    /// batch did not lock (so they are not in `ledger`).
    pub unlocked: BTreeSet<RecordKey>,
}

impl Batch<'_> {
    /// Whether `operation` must go to a later batch: a record it names lives
    /// under a pair this batch did not lock.
    pub fn defers(&self, operation: &Operation) -> bool {
        !self.unlocked.is_empty()
            && operation
                .named_records()
                .iter()
                .any(|key| self.unlocked.contains(key))
    }

    /// Applies `operation` at `now` and appends its changes to `changes`; or
    /// hands it back unapplied when it must go to a later batch.
    pub fn apply(
        &mut self,
        operation: Operation,
        now: Timestamp,
        context: Context<'_>,
        changes: &mut Vec<Change>,
    ) -> Result<Reply, Box<Operation>> {
        if self.defers(&operation) {
            return Err(Box::new(operation));
        }
        let (reply, operation_changes) = apply(self.ledger, operation, now, context);
        changes.extend(operation_changes);
        Ok(reply)
    }
}

/// What a batch of operations reads before the store completes it
/// ([`BatchStore::complete_scope`]): [`Scope::of`] the operations, and the
/// records named only by ID whose pairs the store must look up. An operation
/// that names its own pair needs no look-up until it is retried (`true`
/// beside it): a record of its found under another pair sent it to a later
/// batch.
pub fn batch_scope<'a>(
    operations: impl IntoIterator<Item = (&'a Operation, bool)>,
) -> (Scope, BTreeSet<RecordKey>) {
    let mut scope = Scope::default();
    let mut named = BTreeSet::new();
    for (operation, retried) in operations {
        operation.scope(&mut scope);
        if retried || !operation.names_its_pair() {
            named.extend(operation.named_records());
        }
    }
    (scope, named)
}

/// The text key of a record: `kind/…` with identifiers as they are (they
/// never hold `/`) and numbers as 16 hex digits, so keys of one kind sort
/// like the [`RecordKey`]s they encode.
pub fn encode_key(key: &RecordKey) -> String {
    match key {
        RecordKey::Policy(pair, generation) => {
            format!("policy/{}/{generation:016x}", pair_key(pair))
        }
        RecordKey::Pair(pair) => format!("pair/{}", pair_key(pair)),
        RecordKey::Account(account) => format!(
            "account/{}/{:016x}/{:016x}",
            pair_key(&account.pair),
            account.accounting_epoch.unix_ms(),
            account.policy_generation
        ),
        RecordKey::Reservation(id) => format!("reservation/{id}"),
        RecordKey::Tombstone(id) => format!("tombstone/{id}"),
        RecordKey::Gateway(identity) => format!("gateway/{identity}"),
        RecordKey::Shard(id) => format!("shard/{id}"),
    }
}

/// `subject/route`.
pub fn pair_key(pair: &PairKey) -> String {
    format!("{}/{}", pair.subject, pair.route)
}

/// The pair of a `subject/route` key.
pub fn parse_pair_key(text: &str) -> Option<PairKey> {
    let (subject, route) = text.split_once('/')?;
    Some(PairKey::new(subject.parse().ok()?, route.parse().ok()?))
}

/// Records in [`RecordKey`] order (the order `load_all` promises). Each
/// key is made once: the redb store reads reservations in the order they
/// came, not by ID, and a key made at every comparison (clones of its
/// identifiers) was a seventh of a restart's CPU.
pub(crate) fn sort_by_key(mut records: Vec<Change>) -> Vec<Change> {
    records.sort_by_cached_key(Change::key);
    records
}

/// The last change per key, in first-write order: what one commit writes.
pub(crate) fn last_per_key(changes: &[Change]) -> Vec<&Change> {
    let mut last = std::collections::BTreeMap::new();
    for (index, change) in changes.iter().enumerate() {
        last.insert(change.key(), index);
    }
    let mut kept: Vec<usize> = last.into_values().collect();
    kept.sort_unstable();
    kept.into_iter().map(|index| &changes[index]).collect()
}
