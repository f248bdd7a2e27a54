//! [`RecordLog`]: records under text keys in one redb file, written by
//! durable group commits — the agent's journal and the central ledger's
//! embedded store are both one.
//!
//! # Contract
//!
//! - [`RecordLog::commit`] stores every `(key, value)` given in **one**
//!   write transaction with `Durability::Immediate`: when it returns `Ok`
//!   the records are on disk; on `Err` the transaction was aborted and
//!   nothing of the commit is stored. A later record under the same key
//!   replaces an earlier one, within a commit and across commits; a value
//!   of `None` deletes the key (retention: forgotten records leave the
//!   file).
//! - [`RecordLog::load`] returns the latest value of every key, in key
//!   order.
//! - One process per file: a second open of the same file fails.
//!
//! # Layout: a log in front of a table
//!
//! A commit appends **one** value to the log table — its records, framed —
//! under the next sequence number, instead of updating each record's own
//! key: the callers' keys are random (reservation IDs), so keyed updates
//! touched one B-tree leaf per record, and a group commit of 167 records
//! wrote about 900 KiB (the benchmark's profile of the agent). Loading
//! reads the table, then replays the log in order.
//!
//! The fold into the keyed table is spread over commits, as a **sweep**:
//! the store keeps in memory the keys the log writes that no fold has
//! written since ("pending", each with its latest value; rebuilt from the
//! log at the first commit after open and after a failed commit), and each
//! commit, in its own transaction, folds the next pending keys after the
//! sweep's cursor, in key order — as many as it takes to reach the last
//! key within [`Layout::log_commits`] commits (`ceil(keys ahead / steps
//! left)`). The commit that reaches the last key deletes the log entries
//! that were in the log when the sweep began (every write in them is
//! folded now, or superseded by a later entry), and the next sweep starts.
//! So no commit pays for a whole fold (the version before folded all 256
//! entries in the commit that reached 256, and that commit was the agent's
//! p99), the log holds fewer than `2 × log_commits` entries after any
//! commit, and a key's latest write reaches the table once per sweep
//! however often it was written (a reservation's reserve, start and settle
//! become one write).
//!
//! The sweep folds keys in key order, not log entry by log entry, because
//! of redb's B-tree: a fold of one entry's random keys copies about two
//! pages per key, and folding each entry as it left the log wrote 1.3 MiB
//! per commit of 150 fresh keys against 0.35 MiB for the whole-log fold.
//! A sweep's step writes a contiguous key range, sharing leaves as the
//! whole fold did: 0.46 MiB per commit, worst commit 9 ms instead of
//! 550 ms (`log_commits` 256, in release).
//!
//! Pending keys keep their values in memory rather than where they are in
//! the log: a fold step's keys come from as many log entries, and reading
//! a value back read its whole entry (redb reads a value's leaf whole).
//! The agent read 500-600 MiB/s from its journal at 128 in flight that
//! way (60 MiB/s since), and a commit of 40 new 400-byte records plus 40
//! rewrites read 5.6 MiB and took 2.7 ms at the median (0.19 MiB and
//! 1.7-2.1 ms since, a third less CPU). The values cost memory for the
//! keys written within about two sweeps, the keys the map held anyway:
//! about 10 MiB for an agent with 100,000 open reservations.
//!
//! # Space
//!
//! A deletion frees its record's space once the fold removes the key from
//! the table, and each sweep frees the log entries it covered; redb reuses
//! freed pages for later commits, so a steady workload does not grow the
//! file. `tests/contract.rs` checks it: 20,000 commits of (put a new key,
//! delete the key put 500 commits earlier) leave the file the same size
//! after the second half as after the first (about 300 KiB). No compaction
//! is needed for that.
//!
//! # File mode
//!
//! The file holds a service's whole state (the agent's reservations, the
//! center's accounts), read by that service's user alone: it is created
//! with mode [`FILE_MODE`] (0600) before redb opens it, whatever the
//! process umask, and an existing file readable or writable by its group
//! or others is tightened to 0600 at open, logged as
//! `event=file_mode_tightened`.
//!
//! Layout version 2 added the log. A version 1 file (the keyed table alone)
//! is upgraded in place on open; a version 1 binary refuses a version 2
//! file, which it could not read correctly. Folding in steps did not change
//! the format (a log in front of a table, loaded table first): a version 2
//! file written by a binary that folded the whole log every 256 commits
//! opens and loads as it is, and its log is folded by the first sweep.
//! Version 3 changed the values callers write from JSON to MessagePack
//! ([`value`]): a version 2 file is upgraded by stamping it (its JSON
//! values are still read, until their keys are written again), and a
//! version 2 binary refuses a version 3 file instead of failing on its
//! first binary value.

use std::collections::BTreeMap;
use std::fs::{OpenOptions, Permissions};
use std::ops::Bound;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

pub mod value;

use redb::{
    Database, Durability, ReadableDatabase as _, ReadableTable as _, ReadableTableMetadata as _,
    Table, TableDefinition,
};

/// `"schema"` → the layout version of the file.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const LAYOUT_VERSION: u64 = 3;
/// The layout before the log: the keyed table alone.
const LAYOUT_VERSION_KEYED_ONLY: u64 = 1;
/// The log in front of the table, its values JSON.
const LAYOUT_VERSION_JSON_VALUES: u64 = 2;
/// The store file's mode: its owner reads and writes it, nobody else.
pub const FILE_MODE: u32 = 0o600;

/// The names of a store's tables, and how long its log is.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Key → the latest value folded from the log.
    pub records: &'static str,
    /// Commit sequence number → that commit's records, framed.
    pub log: &'static str,
    /// How many commits a sweep of the fold lasts at most; the log holds
    /// fewer than twice this many entries after any commit.
    pub log_commits: u64,
    /// redb's page cache, in bytes. The store is read once, at open;
    /// commits append to the log and fold slices of it, so the cache
    /// mostly holds pages that are never read again. redb's default
    /// (1 GiB) let an agent with 100,000 open reservations grow to about
    /// 500 MiB of RSS.
    pub cache_bytes: usize,
}

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub enum RecordLogError {
    /// The storage engine failed (I/O, a full disk, a locked file).
    #[error("redb: {0}")]
    Redb(#[from] redb::Error),
    /// The file could not be created or its mode read or tightened.
    #[error("cannot prepare {path}: {source}", path = .path.display())]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A log entry is not a valid sequence of framed records.
    #[error("log entry {sequence} of {path} is damaged: {reason}", path = .path.display())]
    Damaged {
        path: PathBuf,
        sequence: u64,
        reason: &'static str,
    },
    /// The file was written with another layout.
    #[error("{path} holds store layout version {found}; this binary reads version {LAYOUT_VERSION}", path = .path.display())]
    Version { path: PathBuf, found: u64 },
    /// A deliberate abort ([`RecordLog::commit_then_abort`]).
    #[error("the commit was aborted before it completed")]
    Aborted,
}

/// The value length that marks a deletion in a log entry (no value bytes
/// follow). No record reaches 4 GiB, so no stored value has it.
const DELETED: u32 = u32::MAX;

/// One write of a commit: the key, and its new value or `None` to delete it.
pub type Write<'a> = (&'a str, Option<&'a [u8]>);

fn redb_error(error: impl Into<redb::Error>) -> RecordLogError {
    RecordLogError::Redb(error.into())
}

/// Creates the file at `path` with [`FILE_MODE`] if it is missing (an
/// existing file is left as it is, contents and all), and tightens an
/// existing file that its group or others may read or write to
/// [`FILE_MODE`]. The mode is given at creation, so the umask cannot widen
/// it, and changed through the open file, so it is the file just checked.
fn prepare_file(path: &Path) -> Result<(), RecordLogError> {
    let error = |source| RecordLogError::File {
        path: path.to_owned(),
        source,
    };
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(FILE_MODE)
        .open(path)
        .map_err(error)?;
    let mode = file.metadata().map_err(error)?.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        file.set_permissions(Permissions::from_mode(FILE_MODE))
            .map_err(error)?;
        tracing::warn!(
            event = "file_mode_tightened",
            path = %path.display(),
            from = format!("{mode:04o}"),
            to = format!("{FILE_MODE:04o}"),
            "the store file was open to its group or others; its mode is now 0600"
        );
    }
    Ok(())
}

/// The store. See the crate documentation.
#[derive(Debug)]
pub struct RecordLog {
    db: Database,
    path: PathBuf,
    layout: Layout,
    /// The fold in progress; `None` until the first commit, and after a
    /// commit that failed (rebuilt from the log on disk then).
    sweep: Mutex<Option<Sweep>>,
}

/// A fold of the log spread over commits: each commit folds the next keys,
/// in key order, of those the log writes and no fold has written since.
struct Sweep {
    /// Key → its latest value in the log (`None`: deleted).
    pending: BTreeMap<String, Option<Box<[u8]>>>,
    /// The last key this sweep folded; `None` at its start.
    cursor: Option<String>,
    /// How many pending keys sort after the cursor (all of them at the
    /// sweep's start): kept as keys come and go, because counting them
    /// took a walk of the pending map on every commit.
    ahead: usize,
    /// The last entry of the log when this sweep began: when it ends,
    /// every write in the entries up to this one is folded or superseded.
    covers: u64,
    /// Commits into this sweep.
    steps: u64,
}

impl std::fmt::Debug for Sweep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sweep")
            .field("pending", &self.pending.len())
            .field("ahead", &self.ahead)
            .field("covers", &self.covers)
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

impl Sweep {
    fn pend(&mut self, key: &str, value: Option<&[u8]>) {
        let value = value.map(Box::from);
        match self.pending.get_mut(key) {
            Some(latest) => *latest = value,
            None => {
                if self.cursor.as_deref().is_none_or(|cursor| key > cursor) {
                    self.ahead += 1;
                }
                self.pending.insert(key.to_owned(), value);
            }
        }
    }
}

impl RecordLog {
    /// Opens (or creates) the store at `path`, upgrading a version 1 file.
    pub fn open(path: &Path, layout: Layout) -> Result<Self, RecordLogError> {
        prepare_file(path)?;
        let db = Database::builder()
            .set_cache_size(layout.cache_bytes)
            .create(path)
            .map_err(redb_error)?;
        let store = Self {
            db,
            path: path.to_owned(),
            layout,
            sweep: Mutex::new(None),
        };
        store.check_layout()?;
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn records(&self) -> TableDefinition<'static, &'static str, &'static [u8]> {
        TableDefinition::new(self.layout.records)
    }

    fn log(&self) -> TableDefinition<'static, u64, &'static [u8]> {
        TableDefinition::new(self.layout.log)
    }

    fn check_layout(&self) -> Result<(), RecordLogError> {
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
                Some(LAYOUT_VERSION) => {}
                None | Some(LAYOUT_VERSION_KEYED_ONLY | LAYOUT_VERSION_JSON_VALUES) => {
                    meta.insert("schema", LAYOUT_VERSION).map_err(redb_error)?;
                }
                Some(found) => {
                    return Err(RecordLogError::Version {
                        path: self.path.clone(),
                        found,
                    });
                }
            }
            transaction.open_table(self.records()).map_err(redb_error)?;
            transaction.open_table(self.log()).map_err(redb_error)?;
        }
        transaction.commit().map_err(redb_error)
    }

    /// Stores `records` durably in one transaction (group commit: a shell
    /// passes everything that is ready).
    pub fn commit<'a>(
        &self,
        records: impl IntoIterator<Item = Write<'a>>,
    ) -> Result<(), RecordLogError> {
        self.write(records, false)
    }

    /// Does everything a commit of `records` does (the log entry, and the
    /// fold steps if this commit takes any), then aborts the transaction as a
    /// failed commit would: for tests that a commit is all or nothing.
    #[doc(hidden)]
    pub fn commit_then_abort<'a>(
        &self,
        records: impl IntoIterator<Item = Write<'a>>,
    ) -> Result<(), RecordLogError> {
        self.write(records, true)
    }

    /// How many commits the log holds (not yet folded into the table).
    pub fn log_len(&self) -> Result<u64, RecordLogError> {
        let transaction = self.db.begin_read().map_err(redb_error)?;
        let log = transaction.open_table(self.log()).map_err(redb_error)?;
        log.len().map_err(redb_error)
    }

    fn write<'a>(
        &self,
        records: impl IntoIterator<Item = Write<'a>>,
        abort: bool,
    ) -> Result<(), RecordLogError> {
        let frames = encode_frames(records);
        let mut sweep = self.sweep.lock().unwrap_or_else(PoisonError::into_inner);
        // Taken while the transaction runs: it is put back only if the
        // transaction commits, so a failed commit leaves `None` and the next
        // one rebuilds the sweep from what is on disk.
        let taken = sweep.take();
        *sweep = Some(self.write_transaction(&frames, taken, abort)?);
        Ok(())
    }

    /// Appends `frames` as the next log entry and takes one step of the
    /// sweep, in one transaction; returns the sweep as of its commit.
    fn write_transaction(
        &self,
        frames: &[u8],
        sweep: Option<Sweep>,
        abort: bool,
    ) -> Result<Sweep, RecordLogError> {
        let mut transaction = self.db.begin_write().map_err(redb_error)?;
        transaction
            .set_durability(Durability::Immediate)
            .map_err(redb_error)?;
        let sweep = {
            let mut log = transaction.open_table(self.log()).map_err(redb_error)?;
            let mut sweep = match sweep {
                Some(sweep) => sweep,
                None => self.start_sweep(&log)?,
            };
            let last = log.last().map_err(redb_error)?.map(|(key, _)| key.value());
            let sequence = last.map_or(1, |last| last + 1);
            log.insert(sequence, frames).map_err(redb_error)?;
            self.replay(sequence, frames, |key, value| sweep.pend(key, value))?;
            let mut table = transaction.open_table(self.records()).map_err(redb_error)?;
            self.step(&mut sweep, sequence, &mut log, &mut table)?;
            sweep
        };
        if abort {
            transaction.abort().map_err(redb_error)?;
            return Err(RecordLogError::Aborted);
        }
        transaction.commit().map_err(redb_error)?;
        Ok(sweep)
    }

    /// A sweep over the log as it is: every write in it pending (some may
    /// be folded already; folding them again is harmless). A log of `n`
    /// entries between `log_commits` and `2 × log_commits` gets a sweep
    /// `n - log_commits` steps shorter, so that the log stays under
    /// `2 × log_commits`; a longer one (written with a longer bound) gets
    /// a full sweep and is back under the bound when it ends.
    fn start_sweep(&self, log: &Table<'_, u64, &'static [u8]>) -> Result<Sweep, RecordLogError> {
        let mut sweep = Sweep {
            pending: BTreeMap::new(),
            cursor: None,
            ahead: 0,
            covers: 0,
            steps: 0,
        };
        let mut entries = 0;
        for entry in log.iter().map_err(redb_error)? {
            let (sequence, frames) = entry.map_err(redb_error)?;
            let sequence = sequence.value();
            self.replay(sequence, frames.value(), |key, value| {
                sweep.pend(key, value);
            })?;
            sweep.covers = sequence;
            entries += 1;
        }
        if entries < self.layout.log_commits * 2 {
            sweep.steps = entries.saturating_sub(self.layout.log_commits);
        }
        Ok(sweep)
    }

    /// Folds the next pending keys after the cursor, in key order: as many
    /// as this sweep's remaining steps need to reach the end of the keys
    /// within [`Layout::log_commits`] steps. The step that reaches the end
    /// deletes the entries the sweep covers and starts the next sweep at
    /// the entry just appended (`sequence`).
    fn step(
        &self,
        sweep: &mut Sweep,
        sequence: u64,
        log: &mut Table<'_, u64, &'static [u8]>,
        table: &mut Table<'_, &'static str, &'static [u8]>,
    ) -> Result<(), RecordLogError> {
        let ahead = sweep.ahead;
        debug_assert_eq!(
            ahead,
            match &sweep.cursor {
                Some(cursor) => sweep
                    .pending
                    .range::<str, _>((Bound::Excluded(cursor.as_str()), Bound::Unbounded))
                    .count(),
                None => sweep.pending.len(),
            },
            "the running count of keys ahead of the cursor"
        );
        let remaining = self.layout.log_commits.saturating_sub(sweep.steps).max(1);
        let take = ahead.div_ceil(usize::try_from(remaining).unwrap_or(usize::MAX));
        let start = match &sweep.cursor {
            Some(cursor) => Bound::Excluded(cursor.as_str()),
            None => Bound::Unbounded,
        };
        let keys: Vec<String> = sweep
            .pending
            .range::<str, _>((start, Bound::Unbounded))
            .take(take)
            .map(|(key, _)| key.clone())
            .collect();
        for key in &keys {
            match sweep.pending.remove(key).flatten() {
                Some(value) => table.insert(key.as_str(), &*value).map(drop),
                None => table.remove(key.as_str()).map(drop),
            }
            .map_err(redb_error)?;
        }
        sweep.ahead -= keys.len();
        if let Some(key) = keys.into_iter().last() {
            sweep.cursor = Some(key);
        }
        sweep.steps += 1;
        if take == ahead {
            let covers = sweep.covers;
            log.retain_in(..=covers, |_, _| false).map_err(redb_error)?;
            sweep.covers = sequence;
            sweep.cursor = None;
            sweep.ahead = sweep.pending.len();
            sweep.steps = 0;
        }
        Ok(())
    }

    fn damaged(&self, sequence: u64, reason: &'static str) -> RecordLogError {
        RecordLogError::Damaged {
            path: self.path.clone(),
            sequence,
            reason,
        }
    }

    /// The latest value of every key, in key order.
    pub fn load(&self) -> Result<BTreeMap<String, Vec<u8>>, RecordLogError> {
        self.load_under("")
    }

    /// The latest value of every key that starts with `prefix`, in key
    /// order: reads only those keys of the table (and the whole log).
    pub fn load_under(&self, prefix: &str) -> Result<BTreeMap<String, Vec<u8>>, RecordLogError> {
        let transaction = self.db.begin_read().map_err(redb_error)?;
        let table = transaction.open_table(self.records()).map_err(redb_error)?;
        let mut latest = BTreeMap::new();
        for entry in table.range(prefix..).map_err(redb_error)? {
            let (key, value) = entry.map_err(redb_error)?;
            if !key.value().starts_with(prefix) {
                break;
            }
            latest.insert(key.value().to_owned(), value.value().to_vec());
        }
        let log = transaction.open_table(self.log()).map_err(redb_error)?;
        for entry in log.iter().map_err(redb_error)? {
            let (sequence, frames) = entry.map_err(redb_error)?;
            self.replay(sequence.value(), frames.value(), |key, value| {
                if !key.starts_with(prefix) {
                    return;
                }
                match value {
                    Some(value) => {
                        latest.insert(key.to_owned(), value.to_vec());
                    }
                    None => {
                        latest.remove(key);
                    }
                }
            })?;
        }
        Ok(latest)
    }

    /// Hands each write of one log entry, in order, to `write`: its key
    /// and its value.
    fn replay<'f>(
        &self,
        sequence: u64,
        entry: &'f [u8],
        mut write: impl FnMut(&'f str, Option<&'f [u8]>),
    ) -> Result<(), RecordLogError> {
        let damaged = |reason| self.damaged(sequence, reason);
        let mut frames = entry;
        while !frames.is_empty() {
            let key = split_frame(&mut frames)
                .flatten()
                .ok_or_else(|| damaged("a key is cut short"))?;
            let value = split_frame(&mut frames).ok_or_else(|| damaged("a record is cut short"))?;
            let key = std::str::from_utf8(key).map_err(|_| damaged("a key is not UTF-8"))?;
            write(key, value);
        }
        Ok(())
    }
}

/// A log entry: for each write, its key and its value, each preceded by
/// its length as a little-endian `u32`; a deletion has the length
/// [`DELETED`] and no value.
fn encode_frames<'a>(records: impl IntoIterator<Item = Write<'a>>) -> Vec<u8> {
    let mut out = Vec::new();
    for (key, value) in records {
        for part in [Some(key.as_bytes()), value] {
            let length = match part {
                Some(part) => {
                    let length = u32::try_from(part.len()).expect("a record is under 4 GiB");
                    assert!(length < DELETED, "a record is under 4 GiB");
                    length
                }
                None => DELETED,
            };
            out.extend_from_slice(&length.to_le_bytes());
            out.extend_from_slice(part.unwrap_or_default());
        }
    }
    out
}

/// Splits one length-prefixed frame off the front of `bytes`: `Some(None)`
/// for a deletion mark, `None` if the frame is cut short.
fn split_frame<'a>(bytes: &mut &'a [u8]) -> Option<Option<&'a [u8]>> {
    let (length, rest) = bytes.split_first_chunk::<4>()?;
    let length = u32::from_le_bytes(*length);
    if length == DELETED {
        *bytes = rest;
        return Some(None);
    }
    let length = usize::try_from(length).ok()?;
    if rest.len() < length {
        return None;
    }
    let (frame, rest) = rest.split_at(length);
    *bytes = rest;
    Some(Some(frame))
}
