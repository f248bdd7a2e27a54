//! [`Journal`]: the agent's durable record of everything the core asked to
//! persist, in one redb file — a [`record_log::RecordLog`] of records
//! (MessagePack, [`record_log::value`]) under a string encoding of their
//! [`JournalKey`] ([`encode_key`]).
//!
//! # Contract
//!
//! - [`Journal::commit`] writes every record of every batch given in **one**
//!   write transaction with `Durability::Immediate`: when it returns `Ok`
//!   the records are on disk; on `Err` the transaction was aborted and
//!   nothing of any batch is stored. A later record with the same
//!   [`JournalKey`] replaces an earlier one, within a call and across calls;
//!   a [`JournalRecord::Forget`] deletes its key (a later record under the
//!   key stores it again).
//! - [`Journal::load`] returns the latest record of every key, in key order,
//!   for [`agent_core::AgentCore::recover`].
//! - One process per file: a second open of the same file fails.
//!
//! A journal written before a key's encoding changed is rewritten under
//! the current encoding when it is opened ([`Journal::open`]), in one
//! commit, so that a later record replaces the earlier one under the key
//! both now share.

use std::collections::BTreeMap;
use std::path::Path;

use agent_core::{JournalBatch, JournalKey, JournalRecord};
use record_log::value::{self, DecodeError};
use record_log::{Layout, RecordLog, RecordLogError};

/// The journal's tables; a commit appends one frame to the write-ahead log,
/// and every 256 commits the log file is folded into the keyed table on the
/// store's own thread.
pub const LAYOUT: Layout = Layout {
    records: "journal",
    log: "journal-log",
    log_commits: 256,
    // The journal is read once, at start; a small cache keeps the agent's
    // memory to its open reservations (64 MiB of cache was a quarter of
    // its RSS with 100,000 open). 8 MiB: 16 cost 7 MiB more RSS there for
    // no measurable speed, 4 cost the healthy path 10-15 % more CPU per
    // answer (its fold reads leaves the cache no longer holds).
    cache_bytes: 8 << 20,
};

/// Why the journal failed.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The store failed (I/O, a full disk, a locked file, a damaged or
    /// newer file).
    #[error(transparent)]
    Store(#[from] RecordLogError),
    /// A stored record is not a valid journal record (the file was written
    /// by something else, or is damaged).
    #[error("journal record {key} is unreadable: {source}")]
    Corrupt { key: String, source: DecodeError },
}

/// The stored form of a [`JournalKey`]: a kind prefix and the IDs, `/`
/// separated. Identifiers never contain `/`, so the encoding is unambiguous.
///
/// A reservation's shard records sort right after the reservation itself
/// (`reservation/{id}` then `reservation/{id}/shard/{shard}`): an
/// emergency admission writes both, and the store's fold then writes them
/// into one B-tree leaf instead of two far apart (the IDs are hashes, so
/// nothing else keeps a step's keys together).
pub fn encode_key(key: &JournalKey) -> String {
    match key {
        JournalKey::Reservation(id) => format!("reservation/{id}"),
        JournalKey::Shard(id) => format!("shard/{id}"),
        JournalKey::ShardBook(id) => format!("shard-book/{id}"),
        JournalKey::ShardReservation(shard, id) => format!("reservation/{id}/shard/{shard}"),
        JournalKey::Fence(pair) => format!("fence/{}/{}", pair.subject, pair.route),
        JournalKey::TerminalReceipt(id) => format!("terminal-receipt/{id}"),
    }
}

/// Key prefixes [`encode_key`] no longer writes: a shard's reservation was
/// `shard-reservation/{shard}/{id}` before it was keyed after the agent's
/// reservation.
const RETIRED_KEY_PREFIXES: &[&str] = &["shard-reservation/"];

/// What a record does to its key: store a value, or (a
/// [`JournalRecord::Forget`]) delete it.
type Stored = Option<Vec<u8>>;

/// The agent's journal in one redb file. See the module documentation.
#[derive(Debug)]
pub struct Journal {
    store: RecordLog,
}

impl Journal {
    /// Opens (or creates) the journal at `path`, and rewrites records
    /// stored under an earlier encoding of their key.
    pub fn open(path: &Path) -> Result<Self, JournalError> {
        let journal = Self {
            store: RecordLog::open(path, LAYOUT)?,
        };
        journal.rekey()?;
        Ok(journal)
    }

    /// Moves every record stored under a retired key encoding
    /// ([`RETIRED_KEY_PREFIXES`]) to [`encode_key`] of its key, in one
    /// commit (nothing if none is). Only those keys are read: the daemon
    /// reads the whole journal right after, in [`Journal::load`].
    fn rekey(&self) -> Result<(), JournalError> {
        let mut moves: Vec<(String, String, Vec<u8>)> = Vec::new();
        for prefix in RETIRED_KEY_PREFIXES {
            for (stored, value) in self.store.load_under(prefix)? {
                let record = decode_record(&stored, &value)?;
                let current = encode_key(&record.key());
                if current != stored {
                    moves.push((stored, current, value));
                }
            }
        }
        if moves.is_empty() {
            return Ok(());
        }
        self.store
            .commit(moves.iter().flat_map(|(stored, current, value)| {
                [
                    (stored.as_str(), None),
                    (current.as_str(), Some(value.as_slice())),
                ]
            }))?;
        tracing::info!(
            event = "journal_rekeyed",
            path = %self.path().display(),
            records = moves.len(),
            "journal records moved to the current encoding of their keys"
        );
        Ok(())
    }

    pub fn path(&self) -> &Path {
        self.store.path()
    }

    /// Commits every record of `batches` in one durable transaction (group
    /// commit: a shell passes every batch that is ready).
    pub fn commit(&self, batches: &[JournalBatch]) -> Result<(), JournalError> {
        let records = encode(batches);
        self.store.commit(
            records
                .iter()
                .map(|(key, value)| (key.as_str(), value.as_deref())),
        )?;
        Ok(())
    }

    /// Does everything a commit of `batches` does, then aborts the
    /// transaction as a failed commit would: for tests that a batch is all
    /// or nothing.
    #[doc(hidden)]
    pub fn commit_then_abort(&self, batches: &[JournalBatch]) -> Result<(), JournalError> {
        let records = encode(batches);
        self.store.commit_then_abort(
            records
                .iter()
                .map(|(key, value)| (key.as_str(), value.as_deref())),
        )?;
        Ok(())
    }

    /// Every stored record (the latest per key), in key order.
    pub fn load(&self) -> Result<Vec<JournalRecord>, JournalError> {
        self.store
            .load()?
            .into_iter()
            .map(|(key, value)| decode_record(&key, &value))
            .collect()
    }
}

fn decode_record(key: &str, value: &[u8]) -> Result<JournalRecord, JournalError> {
    value::decode(value).map_err(|source| JournalError::Corrupt {
        key: key.to_owned(),
        source,
    })
}

/// The last record per key of `batches`, encoded once each; a forget
/// becomes a deletion.
fn encode(batches: &[JournalBatch]) -> BTreeMap<String, Stored> {
    let mut latest: BTreeMap<String, &JournalRecord> = BTreeMap::new();
    for record in batches.iter().flat_map(|batch| &batch.records) {
        latest.insert(encode_key(&record.key()), record);
    }
    latest
        .into_iter()
        .map(|(key, record)| {
            let value = match record {
                JournalRecord::Forget(_) => None,
                record => Some(value::encode(record)),
            };
            (key, value)
        })
        .collect()
}
