//! [`RedbStore`]: the embedded store.

use std::path::{Path, PathBuf};

use ledger::Change;
use ledger::store::LedgerStore;
use redb::{Database, Durability, ReadableDatabase as _, ReadableTable as _, TableDefinition};

use super::{encode_key, last_per_key, sort_by_key};

/// `encode_key(change.key())` → the change as JSON.
const RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("records");
/// `"schema"` → the layout version of this file.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const SCHEMA_VERSION: u64 = 1;

/// Why the redb store failed.
#[derive(Debug, thiserror::Error)]
pub enum RedbStoreError {
    #[error("redb: {0}")]
    Redb(#[from] redb::Error),
    /// A stored record is not a valid change (the file was written by
    /// something else, or is damaged).
    #[error("stored record {key} is unreadable: {source}")]
    Corrupt {
        key: String,
        source: serde_json::Error,
    },
    #[error("{path} holds store layout version {found}; this binary reads version {SCHEMA_VERSION}", path = .path.display())]
    Version { path: PathBuf, found: u64 },
}

fn redb_error(error: impl Into<redb::Error>) -> RedbStoreError {
    RedbStoreError::Redb(error.into())
}

/// The ledger's records in one redb file. See the module documentation of
/// [`crate::store`].
#[derive(Debug)]
pub struct RedbStore {
    db: Database,
    path: PathBuf,
}

impl RedbStore {
    /// Opens (or creates) the store at `path`. A second open of the same
    /// file, by this process or another, fails: one writer per file.
    pub fn open(path: &Path) -> Result<Self, RedbStoreError> {
        let db = Database::create(path).map_err(redb_error)?;
        let store = Self {
            db,
            path: path.to_owned(),
        };
        store.check_version()?;
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check_version(&self) -> Result<(), RedbStoreError> {
        let mut transaction = self.db.begin_write().map_err(redb_error)?;
        transaction
            .set_durability(Durability::Immediate)
            .map_err(redb_error)?;
        {
            let mut meta = transaction.open_table(META).map_err(redb_error)?;
            let found = meta
                .get("schema")
                .map_err(redb_error)?
                .map(|value| value.value());
            match found {
                Some(SCHEMA_VERSION) => {}
                Some(found) => {
                    return Err(RedbStoreError::Version {
                        path: self.path.clone(),
                        found,
                    });
                }
                None => {
                    meta.insert("schema", SCHEMA_VERSION).map_err(redb_error)?;
                }
            }
            transaction.open_table(RECORDS).map_err(redb_error)?;
        }
        transaction.commit().map_err(redb_error)
    }
}

impl LedgerStore for RedbStore {
    type Error = RedbStoreError;

    /// One write transaction, `Durability::Immediate`: when this returns
    /// `Ok` the changes are on disk; on `Err` the transaction was aborted
    /// and nothing changed.
    fn commit(&mut self, changes: &[Change]) -> Result<(), RedbStoreError> {
        let mut transaction = self.db.begin_write().map_err(redb_error)?;
        transaction
            .set_durability(Durability::Immediate)
            .map_err(redb_error)?;
        {
            let mut table = transaction.open_table(RECORDS).map_err(redb_error)?;
            for change in last_per_key(changes) {
                let value = serde_json::to_vec(change).expect("records serialize to JSON");
                table
                    .insert(encode_key(&change.key()).as_str(), value.as_slice())
                    .map_err(redb_error)?;
            }
        }
        transaction.commit().map_err(redb_error)
    }

    fn load_all(&self) -> Result<Vec<Change>, RedbStoreError> {
        let transaction = self.db.begin_read().map_err(redb_error)?;
        let table = transaction.open_table(RECORDS).map_err(redb_error)?;
        let mut records = Vec::new();
        for entry in table.iter().map_err(redb_error)? {
            let (key, value) = entry.map_err(redb_error)?;
            let change: Change = serde_json::from_slice(value.value()).map_err(|source| {
                RedbStoreError::Corrupt {
                    key: key.value().to_owned(),
                    source,
                }
            })?;
            records.push(change);
        }
        Ok(sort_by_key(records))
    }
}
