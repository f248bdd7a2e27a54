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
//! # Layout: a log in front of a table
//!
//! Records are JSON under a string encoding of their key. A commit appends
//! **one** value to the `journal-log` table — its records, framed — under
//! the next sequence number, instead of updating each record's own key:
//! reservation IDs are random, so keyed updates touched one B-tree leaf per
//! record and a group commit of 167 records wrote about 900 KiB (the
//! benchmark's profile). Every [`CHECKPOINT_COMMITS`] commits, the commit
//! that reaches the mark also folds the log into the keyed `journal` table
//! (the latest record per key; a reservation's reserve, start and settle
//! become one write) and empties the log, in the same transaction. Loading
//! reads the table, then replays the log in order.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use redb::{
    Database, Durability, ReadableDatabase as _, ReadableTable as _, ReadableTableMetadata as _,
    TableDefinition,
};

use crate::core::{JournalBatch, JournalKey, JournalRecord};

/// `encode_key(record.key())` → the record as JSON (the checkpointed state).
const RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("journal");
/// Commit sequence number → that commit's records, framed (see
/// [`encode_frames`]); newer than anything in `RECORDS`.
const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("journal-log");
/// `"schema"` → the layout version of this file.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// Version 2 added the log. A version 1 file (no log) is upgraded in place
/// on open; a version 1 binary refuses a version 2 file, which it could not
/// read correctly.
const SCHEMA_VERSION: u64 = 2;
/// The log is folded into `RECORDS` by the commit that brings it to this
/// many entries.
pub const CHECKPOINT_COMMITS: u64 = 256;

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
    /// A log entry is not a valid sequence of framed records (the file is
    /// damaged).
    #[error("journal log entry {sequence} is damaged: {reason}")]
    CorruptLog { sequence: u64, reason: &'static str },
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
                Some(1) => {
                    meta.insert("schema", SCHEMA_VERSION).map_err(redb_error)?;
                }
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
            transaction.open_table(LOG).map_err(redb_error)?;
        }
        transaction.commit().map_err(redb_error)
    }

    /// Commits every record of `batches` in one durable transaction (group
    /// commit: a shell passes every batch that is ready).
    pub fn commit(&self, batches: &[JournalBatch]) -> Result<(), JournalError> {
        self.write(batches, false)
    }

    /// Does everything a commit of `batches` does (the log entry, and the
    /// checkpoint if this commit reaches it), then aborts the transaction as
    /// a failed commit would: for tests that a commit is all or nothing.
    #[doc(hidden)]
    pub fn commit_then_abort(&self, batches: &[JournalBatch]) -> Result<(), JournalError> {
        self.write(batches, true)
    }

    /// How many commits the log holds (not yet folded into the table).
    #[doc(hidden)]
    pub fn log_len(&self) -> Result<u64, JournalError> {
        let transaction = self.db.begin_read().map_err(redb_error)?;
        let log = transaction.open_table(LOG).map_err(redb_error)?;
        log.len().map_err(redb_error)
    }

    fn write(&self, batches: &[JournalBatch], abort: bool) -> Result<(), JournalError> {
        // The last record per key wins: encode once per key.
        let mut latest: BTreeMap<String, &JournalRecord> = BTreeMap::new();
        for record in batches.iter().flat_map(|batch| &batch.records) {
            latest.insert(encode_key(&record.key()), record);
        }
        let frames = encode_frames(latest.iter().map(|(key, record)| {
            let value = serde_json::to_vec(record).expect("journal records serialize to JSON");
            (key.as_str(), value)
        }));
        let mut transaction = self.db.begin_write().map_err(redb_error)?;
        transaction
            .set_durability(Durability::Immediate)
            .map_err(redb_error)?;
        {
            let mut log = transaction.open_table(LOG).map_err(redb_error)?;
            let first = log.first().map_err(redb_error)?.map(|(key, _)| key.value());
            let last = log.last().map_err(redb_error)?.map(|(key, _)| key.value());
            let sequence = last.map_or(1, |last| last + 1);
            log.insert(sequence, frames.as_slice())
                .map_err(redb_error)?;
            if sequence + 1 - first.unwrap_or(sequence) >= CHECKPOINT_COMMITS {
                let mut records = transaction.open_table(RECORDS).map_err(redb_error)?;
                checkpoint(&mut log, &mut records)?;
            }
        }
        if abort {
            transaction.abort().map_err(redb_error)?;
            return Err(JournalError::Aborted);
        }
        transaction.commit().map_err(redb_error)
    }

    /// Every stored record (the latest per key), in key order.
    pub fn load(&self) -> Result<Vec<JournalRecord>, JournalError> {
        let transaction = self.db.begin_read().map_err(redb_error)?;
        let table = transaction.open_table(RECORDS).map_err(redb_error)?;
        let mut latest: BTreeMap<String, Vec<u8>> = BTreeMap::new();
        for entry in table.iter().map_err(redb_error)? {
            let (key, value) = entry.map_err(redb_error)?;
            latest.insert(key.value().to_owned(), value.value().to_vec());
        }
        let log = transaction.open_table(LOG).map_err(redb_error)?;
        for entry in log.iter().map_err(redb_error)? {
            let (sequence, frames) = entry.map_err(redb_error)?;
            for (key, value) in decode_frames(sequence.value(), frames.value())? {
                latest.insert(key.to_owned(), value.to_vec());
            }
        }
        latest
            .into_iter()
            .map(|(key, value)| {
                serde_json::from_slice(&value)
                    .map_err(|source| JournalError::Corrupt { key, source })
            })
            .collect()
    }
}

/// Folds every log entry into the keyed table, oldest first, and empties
/// the log.
fn checkpoint(
    log: &mut redb::Table<'_, u64, &'static [u8]>,
    records: &mut redb::Table<'_, &'static str, &'static [u8]>,
) -> Result<(), JournalError> {
    let mut latest: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    for entry in log.iter().map_err(redb_error)? {
        let (sequence, frames) = entry.map_err(redb_error)?;
        for (key, value) in decode_frames(sequence.value(), frames.value())? {
            latest.insert(key.to_owned(), value.to_vec());
        }
    }
    for (key, value) in &latest {
        records
            .insert(key.as_str(), value.as_slice())
            .map_err(redb_error)?;
    }
    log.retain(|_, _| false).map_err(redb_error)
}

/// A log entry: for each record, its key and its JSON, each preceded by its
/// length as a little-endian `u32`.
fn encode_frames<'a>(records: impl Iterator<Item = (&'a str, Vec<u8>)>) -> Vec<u8> {
    let mut out = Vec::new();
    for (key, value) in records {
        for part in [key.as_bytes(), value.as_slice()] {
            let length = u32::try_from(part.len()).expect("a journal record is under 4 GiB");
            out.extend_from_slice(&length.to_le_bytes());
            out.extend_from_slice(part);
        }
    }
    out
}

/// The `(key, JSON)` frames of one log entry.
fn decode_frames(sequence: u64, mut bytes: &[u8]) -> Result<Vec<(&str, &[u8])>, JournalError> {
    let damaged = |reason| JournalError::CorruptLog { sequence, reason };
    let mut frames = Vec::new();
    while !bytes.is_empty() {
        let key = split_frame(&mut bytes).ok_or_else(|| damaged("a key frame is cut short"))?;
        let value =
            split_frame(&mut bytes).ok_or_else(|| damaged("a record frame is cut short"))?;
        let key = std::str::from_utf8(key).map_err(|_| damaged("a key is not UTF-8"))?;
        frames.push((key, value));
    }
    Ok(frames)
}

/// Splits one length-prefixed frame off the front of `bytes`.
fn split_frame<'a>(bytes: &mut &'a [u8]) -> Option<&'a [u8]> {
    let (length, rest) = bytes.split_first_chunk::<4>()?;
    let length = usize::try_from(u32::from_le_bytes(*length)).ok()?;
    if rest.len() < length {
        return None;
    }
    let (frame, rest) = rest.split_at(length);
    *bytes = rest;
    Some(frame)
}
