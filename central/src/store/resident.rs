//! [`ResidentStore`]: the whole ledger in memory over a
//! [`LedgerStore`] that keeps its records (redb for the service, memory for
//! tests).
//!
//! A batch needs no look-ups and no locks: `begin` hands out the resident
//! ledger itself, `commit` writes the batch's changes through the record
//! store (a blocking fsync for redb, which is why the writer has a thread of
//! its own), and `abort` rebuilds the ledger from the record store, since
//! the operations already applied to it were not committed.
//!
//! The store commits behind the writer ([`BatchStore::commit_behind`]): the
//! record store's commit (encoding and fsync) runs on tokio's blocking pool
//! while the writer applies the next operations to the resident ledger,
//! which already holds the committing changes. The writer starts one commit
//! at a time, so they reach the record store in order; if one fails,
//! `abort` reloads from the record store and so drops it and everything
//! applied on top of it.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ledger::protocol::views::{self, AuditResponse};
use ledger::protocol::{Gauges, Scope};
use ledger::store::{InjectedFault, LedgerStore, MemoryStore};
use ledger::{CentralConfig, CentralLedger, Change, LoadError, RecordKey};
use shard_format::Timestamp;

use super::{Batch, BatchStore, CommitUnderWay};

/// Times a failed reload is tried again (10 ms, doubling) before the store
/// gives up and the writer ends the process.
const RELOAD_ATTEMPTS_MAX: u32 = 8;

/// Why a resident store failed.
#[derive(Debug, thiserror::Error)]
pub enum ResidentError<E: std::error::Error + 'static> {
    /// The record store failed to commit or to load.
    #[error(transparent)]
    Store(E),
    /// The stored records break an invariant: the ledger must not run on
    /// them.
    #[error("the stored records cannot be loaded: {0}")]
    Load(#[from] LoadError),
    /// A commit behind the writer was cancelled before it finished (the
    /// runtime shut down): whether it landed is unknown.
    #[error("a commit was cancelled before it finished")]
    CommitCancelled,
}

/// The whole ledger in memory, its records in `S`. See the module
/// documentation.
#[derive(Debug)]
pub struct ResidentStore<S> {
    ledger: CentralLedger,
    /// Shared with the commit under way, if any (on the blocking pool).
    store: Arc<Mutex<S>>,
    config: CentralConfig,
    /// The store's file, for the bytes-on-disk gauge.
    disk_file: Option<std::path::PathBuf>,
}

impl<S: LedgerStore> ResidentStore<S> {
    /// Loads the ledger from `store`'s records.
    pub fn open(store: S, config: CentralConfig) -> Result<Self, ResidentError<S::Error>> {
        let records = store.load_all().map_err(ResidentError::Store)?;
        Ok(Self {
            ledger: CentralLedger::from_records(config, records)?,
            store: Arc::new(Mutex::new(store)),
            config,
            disk_file: None,
        })
    }

    /// The resident ledger, as last committed (or loaded).
    pub fn ledger(&self) -> &CentralLedger {
        &self.ledger
    }

    /// Reports the size of `path` (the store's file) in the gauges.
    pub fn with_disk_file(mut self, path: &std::path::Path) -> Self {
        self.disk_file = Some(path.to_owned());
        self
    }

    /// The record store (to reopen it, or to inject faults in tests); it
    /// waits for a commit under way.
    pub fn store(&self) -> MutexGuard<'_, S> {
        lock(&self.store)
    }

    /// Closes the ledger and hands back the record store.
    ///
    /// # Panics
    ///
    /// If a commit behind ([`BatchStore::commit_behind`]) was dropped
    /// before it resolved and is still running.
    pub fn into_store(self) -> S {
        Arc::into_inner(self.store)
            .expect("no commit is under way when the store is closed")
            .into_inner()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// Rebuilds the ledger from the record store. A store that cannot be
    /// read is tried again a few times; records that break an invariant are
    /// an error at once.
    async fn reload(&mut self) -> Result<(), ResidentError<S::Error>> {
        let mut delay = Duration::from_millis(10);
        let mut attempt = 1;
        loop {
            let loaded = lock(&self.store).load_all();
            match loaded {
                Ok(records) => {
                    self.ledger = CentralLedger::from_records(self.config, records)?;
                    return Ok(());
                }
                Err(error) if attempt >= RELOAD_ATTEMPTS_MAX => {
                    return Err(ResidentError::Store(error));
                }
                Err(error) => {
                    tracing::error!(%error, attempt, "cannot reload the ledger; retrying");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                    attempt += 1;
                }
            }
        }
    }
}

/// Locks the record store. A commit that panicked holding it ends the
/// process (the writer resumes the panic), so a poisoned lock is never
/// served from.
fn lock<S>(store: &Mutex<S>) -> MutexGuard<'_, S> {
    store.lock().unwrap_or_else(|poison| poison.into_inner())
}

impl<S: LedgerStore + Send + 'static> BatchStore for ResidentStore<S> {
    type Error = ResidentError<S::Error>;

    /// The whole ledger is loaded: nothing to look up.
    async fn complete_scope(
        &mut self,
        _scope: &mut Scope,
        _named: &BTreeSet<RecordKey>,
        _now: Timestamp,
    ) -> Result<(), Self::Error> {
        Ok(())
    }

    /// The resident ledger itself; nothing is ever unlocked.
    async fn begin(&mut self, _scope: &Scope, _now: Timestamp) -> Result<Batch<'_>, Self::Error> {
        Ok(Batch {
            ledger: &mut self.ledger,
            unlocked: BTreeSet::new(),
        })
    }

    /// One commit of the record store (none for a batch without changes).
    async fn commit(&mut self, changes: &[Change]) -> Result<(), Self::Error> {
        if changes.is_empty() {
            return Ok(());
        }
        lock(&self.store)
            .commit(changes)
            .map_err(ResidentError::Store)
    }

    /// The record store's commit on tokio's blocking pool (none for a batch
    /// without changes). A panic there is resumed on the awaiting thread:
    /// the writer ends the process, as if it had committed itself.
    fn commit_behind(
        &mut self,
        changes: Vec<Change>,
    ) -> Result<CommitUnderWay<Self::Error>, Vec<Change>> {
        if changes.is_empty() {
            return Ok(Box::pin(std::future::ready(Ok(()))));
        }
        let store = Arc::clone(&self.store);
        let committing = tokio::task::spawn_blocking(move || lock(&store).commit(&changes));
        Ok(Box::pin(async move {
            match committing.await {
                Ok(committed) => committed.map_err(ResidentError::Store),
                Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
                Err(_) => Err(ResidentError::CommitCancelled),
            }
        }))
    }

    /// Rebuilds the ledger from what the record store holds.
    async fn abort(&mut self) -> Result<(), Self::Error> {
        self.reload().await
    }

    async fn audit(&mut self) -> Result<AuditResponse, Self::Error> {
        Ok(views::audit_view(&self.ledger))
    }

    async fn gauges(&mut self) -> Result<Gauges, Self::Error> {
        let mut gauges = views::gauges(&self.ledger);
        if let Some(path) = &self.disk_file {
            // The redb file and its write-ahead log files.
            gauges.store_bytes = record_log::store_bytes(path);
        }
        Ok(gauges)
    }
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
