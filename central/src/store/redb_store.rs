//! [`RedbStore`]: the embedded store, a [`record_log::RecordLog`] of the
//! ledger's changes (MessagePack, [`record_log::value`]) under
//! [`encode_key`].

use std::path::Path;

use ledger::Change;
use ledger::store::LedgerStore;
use record_log::value::{DecodeError, decode, encode};
use record_log::{Layout, RecordLog, RecordLogError};

use super::{encode_key, last_per_key, sort_by_key};

/// The store's tables; a commit appends one frame to the write-ahead log,
/// and every 256 commits the log file is folded into the keyed table on the
/// store's own thread.
pub const LAYOUT: Layout = Layout {
    records: "records",
    log: "records-log",
    log_commits: 256,
    cache_bytes: 64 << 20,
    preallocate_bytes: record_log::PREALLOCATE_BYTES,
};

/// Why the redb store failed.
#[derive(Debug, thiserror::Error)]
pub enum RedbStoreError {
    /// The store failed (I/O, a full disk, a locked file, a damaged or
    /// newer file).
    #[error(transparent)]
    Store(#[from] RecordLogError),
    /// A stored record is not a valid change (the file was written by
    /// something else, or is damaged).
    #[error("stored record {key} is unreadable: {source}")]
    Corrupt { key: String, source: DecodeError },
}

/// The ledger's records in one redb file. See the module documentation of
/// [`crate::store`].
#[derive(Debug)]
pub struct RedbStore {
    store: RecordLog,
}

impl RedbStore {
    /// Opens (or creates) the store at `path`. A second open of the same
    /// file, by this process or another, fails: one writer per file.
    pub fn open(path: &Path) -> Result<Self, RedbStoreError> {
        Ok(Self {
            store: RecordLog::open(path, LAYOUT)?,
        })
    }

    pub fn path(&self) -> &Path {
        self.store.path()
    }
}

impl LedgerStore for RedbStore {
    type Error = RedbStoreError;

    /// One write transaction, `Durability::Immediate`: when this returns
    /// `Ok` the changes are on disk; on `Err` the transaction was aborted
    /// and nothing changed.
    fn commit(&mut self, changes: &[Change]) -> Result<(), RedbStoreError> {
        let records: Vec<(String, Option<Vec<u8>>)> = last_per_key(changes)
            .into_iter()
            .map(|change| {
                let value = match change {
                    Change::Forget(_) => None,
                    _ => Some(encode(change)),
                };
                (encode_key(&change.key()), value)
            })
            .collect();
        self.store.commit(
            records
                .iter()
                .map(|(key, value)| (key.as_str(), value.as_deref())),
        )?;
        Ok(())
    }

    fn load_all(&self) -> Result<Vec<Change>, RedbStoreError> {
        let records = self
            .store
            .load()?
            .into_iter()
            .map(|(key, value)| {
                decode(&value).map_err(|source| RedbStoreError::Corrupt { key, source })
            })
            .collect::<Result<Vec<Change>, _>>()?;
        Ok(sort_by_key(records))
    }
}
