//! [`Journal`]: the agent's durable record of everything the core asked to
//! persist, in one redb file.
//!
//! # Contract
//!
//! - [`Journal::commit`] writes every record of every batch given in **one**
//!   write transaction with `Durability::Immediate`: when it returns `Ok`
//!   the records are on disk; on `Err` the transaction was aborted and
//!   nothing of any batch is stored. A later record with the same
//!   [`JournalKey`] replaces an earlier one, within a call and across calls.
//! - [`Journal::load`] returns the latest record of every key, in key order,
//!   for [`crate::core::AgentCore::recover`].
//! - One process per file: a second open of the same file fails.
//!
//! Records are stored as JSON under a string encoding of their key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use redb::{Database, Durability, ReadableDatabase as _, ReadableTable as _, TableDefinition};

use crate::core::{JournalBatch, JournalKey, JournalRecord};

/// `encode_key(record.key())` → the record as JSON.
const RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("journal");
/// `"schema"` → the layout version of this file.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const SCHEMA_VERSION: u64 = 1;

/// Why the journal failed.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The storage engine failed (I/O, a full disk, a locked file).
    #[error("redb: {0}")]
    Redb(#[from] redb::Error),
    /// A stored record is not a valid journal record (the file was written
    /// by something else, or is damaged).
    #[error("journal record {key} is unreadable: {source}")]
    Corrupt {
        key: String,
        source: serde_json::Error,
    },
    /// The file was written by another layout version.
    #[error("{path} holds journal layout version {found}; this binary reads version {SCHEMA_VERSION}", path = .path.display())]
    Version { path: PathBuf, found: u64 },
    /// A deliberate abort, for tests of atomicity.
    #[error("the commit was aborted before it completed")]
    Aborted,
}

fn redb_error(error: impl Into<redb::Error>) -> JournalError {
    JournalError::Redb(error.into())
}

/// The stored form of a [`JournalKey`]: a kind prefix and the IDs, `/`
/// separated. Identifiers never contain `/`, so the encoding is unambiguous.
pub fn encode_key(key: &JournalKey) -> String {
    match key {
        JournalKey::Reservation(id) => format!("reservation/{id}"),
        JournalKey::Shard(id) => format!("shard/{id}"),
        JournalKey::ShardBook(id) => format!("shard-book/{id}"),
        JournalKey::ShardReservation(shard, id) => format!("shard-reservation/{shard}/{id}"),
        JournalKey::Fence(pair) => format!("fence/{}/{}", pair.subject, pair.route),
        JournalKey::TerminalReceipt(id) => format!("terminal-receipt/{id}"),
    }
}

/// The agent's journal in one redb file. See the module documentation.
#[derive(Debug)]
pub struct Journal {
    db: Database,
    path: PathBuf,
}

impl Journal {
    /// Opens (or creates) the journal at `path`.
    pub fn open(path: &Path) -> Result<Self, JournalError> {
        let db = Database::create(path).map_err(redb_error)?;
        let journal = Self {
            db,
            path: path.to_owned(),
        };
        journal.check_version()?;
        Ok(journal)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check_version(&self) -> Result<(), JournalError> {
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
                    return Err(JournalError::Version {
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

    /// Commits every record of `batches` in one durable transaction (group
    /// commit: a shell passes every batch that is ready).
    pub fn commit(&self, batches: &[JournalBatch]) -> Result<(), JournalError> {
        self.write(batches, None)
    }

    /// Writes the first `abort_after` records of `batches`, then aborts the
    /// transaction as a failed commit would: for tests that a batch is all
    /// or nothing.
    #[doc(hidden)]
    pub fn commit_aborting_after(
        &self,
        batches: &[JournalBatch],
        abort_after: usize,
    ) -> Result<(), JournalError> {
        self.write(batches, Some(abort_after))
    }

    fn write(
        &self,
        batches: &[JournalBatch],
        abort_after: Option<usize>,
    ) -> Result<(), JournalError> {
        // The last record per key wins: encode once per key.
        let mut latest: BTreeMap<String, &JournalRecord> = BTreeMap::new();
        for record in batches.iter().flat_map(|batch| &batch.records) {
            latest.insert(encode_key(&record.key()), record);
        }
        let mut transaction = self.db.begin_write().map_err(redb_error)?;
        transaction
            .set_durability(Durability::Immediate)
            .map_err(redb_error)?;
        {
            let mut table = transaction.open_table(RECORDS).map_err(redb_error)?;
            for (written, (key, record)) in latest.iter().enumerate() {
                if abort_after == Some(written) {
                    drop(table);
                    transaction.abort().map_err(redb_error)?;
                    return Err(JournalError::Aborted);
                }
                let value = serde_json::to_vec(record).expect("journal records serialize to JSON");
                table
                    .insert(key.as_str(), value.as_slice())
                    .map_err(redb_error)?;
            }
        }
        transaction.commit().map_err(redb_error)
    }

    /// Every stored record (the latest per key), in key order.
    pub fn load(&self) -> Result<Vec<JournalRecord>, JournalError> {
        let transaction = self.db.begin_read().map_err(redb_error)?;
        let table = transaction.open_table(RECORDS).map_err(redb_error)?;
        let mut records = Vec::new();
        for entry in table.iter().map_err(redb_error)? {
            let (key, value) = entry.map_err(redb_error)?;
            let record: JournalRecord =
                serde_json::from_slice(value.value()).map_err(|source| JournalError::Corrupt {
                    key: key.value().to_owned(),
                    source,
                })?;
            records.push(record);
        }
        Ok(records)
    }
}
