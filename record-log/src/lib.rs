//! [`RecordLog`]: records under text keys, written by durable group
//! commits to an append-only log file and folded into a redb table by a
//! thread of its own — the agent's journal and the central ledger's
//! embedded store are both one.
//!
//! # Contract
//!
//! - [`RecordLog::commit`] appends every `(key, value)` given as **one**
//!   frame to the write-ahead log and `fdatasync`s it once: when it returns
//!   `Ok` the records are on disk; on `Err` nothing of the commit is stored
//!   (a partly written frame is cut off again before the error is
//!   returned). A later record under the same key replaces an earlier one,
//!   within a commit and across commits; a value of `None` deletes the key
//!   (retention: forgotten records leave the files).
//! - A commit may also be made in two halves, [`RecordLog::append`] (the
//!   frame written, not durable) and [`Appended::sync`] (its
//!   `fdatasync`), so that a shell keeps up to [`COMMITS_IN_FLIGHT_MAX`]
//!   commits in flight: the next frame is written while the last one
//!   syncs. A sync returns `Ok` once its frame and every frame appended
//!   before it are durable, so commits are acknowledged in order.
//! - [`RecordLog::load`] returns the latest value of every key, in key
//!   order.
//! - One process per store: a second open of the same file fails (redb's
//!   lock on the checkpoint file; the log files are only opened after it).
//!
//! # Layout: a write-ahead log in front of a redb checkpoint
//!
//! The store at `<path>` is two kinds of file:
//!
//! - `<path>`, a redb file: the **checkpoint**, the table
//!   [`Layout::records`] (key → latest folded value), the table
//!   [`Layout::groups`] (the records kept in groups, below) and the table `meta`
//!   (`schema` = the layout version, `wal-folded-generation` and
//!   `wal-folded-sequence` = the last log file and frame folded into the
//!   table);
//! - `<path>.wal.<generation>`, **log files** (generations counting up
//!   from 1), each a sequence of frames, then an end mark and whatever
//!   follows it (zeros written ahead, or a recycled file's earlier frames);
//! - `<path>.wal.spare`, at most one: a log file folded and kept to be the
//!   next generation (see "Recycled log files" below); no state.
//!
//! ```text
//! file    = frame* [end-mark any-byte*]
//! end-mark = 16 zero bytes (fewer at the end of the file)
//! frame   = length u32 LE | crc32 u32 LE | sequence u64 LE | payload
//! payload = record*        (`length` bytes)
//! record  = key-length u32 LE | key (UTF-8)
//!         | value-length u32 LE | value    (value-length 0xFFFF_FFFF: a deletion, no value)
//! ```
//!
//! `crc32` (CRC-32/ISO-HDLC, the `crc32fast` crate) covers the length, the
//! sequence and the payload. Sequence numbers rise by one per commit across
//! log files. The payload is the log entry of layout versions 2 and 3.
//!
//! A commit writes its frame with one `pwrite` after the last frame of the
//! newest log file and `fdatasync`s it: no redb transaction on a commit's
//! path. The first frame of a new log file also `fsync`s the directory, so
//! the file's name is as durable as its frame. A frame that passes the end
//! of the file is followed by [`Layout::preallocate_bytes`] of zeros in the
//! same commit, so that the frames after it overwrite blocks the file
//! already has: their `fdatasync` then writes their data, not the file's
//! size as well (see [`PREALLOCATE_BYTES`] for what that saves). Open reads
//! the zeros after the last frame as the end of the file's frames (no
//! frame header is zeros: sequence numbers start at 1). Before this layout
//! a commit was a redb write transaction with `Durability::Immediate`
//! appending the same payload to a redb log table and folding a slice of
//! the pending keys (110 KiB in 14 page writes per commit at one in
//! flight; 0.52 ms of the agent's 0.73 ms reserve).
//!
//! **Recycled log files.** In a store that writes zeros ahead, the folder
//! keeps the last file it folded instead of deleting it: it writes an end
//! mark over its first frame, makes that durable and renames the file
//! `<path>.wal.spare`; the commit that starts the next log file renames
//! the spare to it. Its blocks are written already, so its frames need no
//! zeros ahead until they pass its length, and each is written with an end
//! mark after it (`END_MARK`) over the earlier generation's frames, which
//! are never read again (their sequence numbers are lower than any since).
//!
//! # The fold, on its own thread
//!
//! The store keeps in memory each key written to the newest log file and
//! where in the file its latest write lies ("fresh"; the value itself is
//! read back from the file when it is needed, so memory holds keys, not
//! values). When the newest file holds [`Layout::log_commits`]
//! frames and no fold is running, the commit that filled it **seals** it:
//! the file is complete (the next commit starts a new generation), and its
//! writes — the fresh map, taken whole — go to the **folder**, a thread
//! that reads their values from the sealed file and writes them into the
//! table, in key order, in one redb transaction
//! with `Durability::Immediate` that also records the sealed files as
//! folded in `meta`; then it deletes them (or keeps the last as the spare,
//! above). A commit never waits for a fold:
//! while one runs, the newest file grows past `log_commits` frames and is
//! sealed at the first commit after the fold ends. So at most two log files
//! exist in steady running (the sealed one being folded and the newest),
//! and a key's latest write reaches the table once per fold however often
//! it was written (a reservation's reserve, start and settle become one
//! write).
//!
//! **Fold lag is bounded.** While a fold runs, the newest file takes at
//! most [`FOLD_LAG_FILES`] × `log_commits` frames; a commit beyond that
//! waits until the fold ends (logged once per fold as
//! `event=commits_wait_for_fold`). Without it a machine too busy to give
//! the folder CPU would grow the newest file and its writes in memory
//! without end; with it, the commits' threads stop taking the CPU the
//! folder needs. A failed fold releases the waiting commits (they go on
//! into the log, durable there, while the fold is retried).
//!
//! The fold runs off the commit's path because a redb commit costs more
//! than the frame's `fdatasync` (its `fsync`s and copied B-tree pages):
//! folding a slice in every commit made every commit pay both, and folding
//! inline every 16th commit made those commits the p99 (12–14 ms against
//! 2.5–3.4 in a probe). The folder runs at the lowest priority (nice
//! 19), taking the CPU the service's request threads leave. A failed fold
//! (a full disk, or a panic in the fold: the thread catches it) is logged as
//! `event=fold_failed` and retried every [`FOLD_RETRY`]; commits go on
//! into the newest file meanwhile, durable there.
//!
//! # Groups of records
//!
//! A layout may keep records in **groups** ([`Layout::group`]): a key's
//! group is named by a prefix of the key, and the table [`Layout::groups`]
//! holds each group's records as one value (group name → its records in
//! key order, each key without the group's name, encoded as a payload is,
//! with no deletions); a record in no group stays alone in
//! [`Layout::records`]. The agent's journal groups a reservation's
//! records with those of the fifteen ordinals next to it
//! ([`ordinal_group`]): reservations come in order, so a fold writes most
//! groups whole. (The central store keeps its larger records alone.) A
//! store grouped by one rule is not opened with a layout of another
//! ([`RecordLogError::OtherGrouping`]).
//!
//! The writes of a fold come in key order, so a group's come together (a
//! group whose keys another group's lie between is handled once per run of
//! its writes): the fold reads the group's stored value (one `get`), merges
//! the writes into it (the later value winning, deletions dropped) and
//! inserts it again (one `insert`, or a `remove` of a group left empty).
//! redb's work per insert into a table of some hundred thousand records was
//! most of a fold's cost on its thread; inserting sixteen records a key
//! instead of one took about half of what the fold added to the agent's p99
//! in a probe (docs/benchmarks-history.md). A record written into an older group
//! rewrites the whole group: that is what bounds a group's size.
//!
//! A load under a prefix reads the groups whose name starts with the
//! prefix, and those whose name the prefix starts with (their records
//! filtered by the prefix).
//!
//! # Crash rules (open)
//!
//! Open reads `meta`, deletes the log files the table already covers
//! (generation ≤ `wal-folded-generation`: a crash between a fold's commit
//! and the deletion), then reads the remaining files in generation order,
//! frame by frame, each frame's sequence the one after the last; they are
//! sealed together, folded by the folder at once, and commits start a new
//! file:
//!
//! - a file's frames end at an end mark (zeros written ahead, or a crash
//!   that left a frame's blocks unwritten) or at a valid frame with an
//!   earlier sequence number (a recycled file's earlier generation, where
//!   a crash left the end mark after the last frame unwritten). In the
//!   newest file whatever follows that is not zeros is cut off, as a torn
//!   tail is; a valid frame of a later commit after it is corruption (next
//!   rules).
//! - the **newest** file may end in a torn frame (a crash mid-append; its
//!   commit was never acknowledged): a frame cut short, or failing its
//!   checksum, with no valid frame after it. The file is truncated to its
//!   last whole frame (and that made durable) before anything is appended;
//!   logged as `event=wal_torn_tail_truncated`.
//! - a bad frame **followed by a valid frame** (any later offset holding a
//!   frame with a later sequence number and a good checksum), a bad end of
//!   an older file, or a valid frame numbered past the next is corruption of
//!   acknowledged data: open fails with [`RecordLogError::Corrupt`] naming
//!   the file and offset, and never drops what follows.
//! - a frame whose checksum holds but whose payload is not valid records
//!   fails with [`RecordLogError::Damaged`].
//!
//! A fold may write into the table values from the newest file too (fresh
//! writes made while it ran are not in its map, but a key sealed and
//! rewritten later is folded with the sealed value): after a crash the
//! newest file is replayed over the table, so each key ends at its latest
//! write either way.
//!
//! A failed `pwrite` is undone by truncating the file to where the frame
//! began and `fdatasync`ing that; if the undo fails too, the store refuses
//! every later commit ([`RecordLogError::Broken`]) until it is reopened,
//! because a frame appended after a torn one would turn a torn tail into
//! corruption. A failed `fdatasync` breaks the store as well (after the
//! same undo, from the first frame not known durable): Linux may drop the
//! pages whose writeback failed, so what the file holds on disk is no
//! longer known, and the next open's crash rules settle it.
//!
//! **Commits in flight.** With up to [`COMMITS_IN_FLIGHT_MAX`] frames
//! appended before the first of them is durable, a crash may leave a bad
//! frame followed by a valid one, neither acknowledged (a sync is
//! acknowledged only once every frame before it is durable). So a bad
//! frame in the newest file is a torn tail when no valid frame with a
//! sequence number `COMMITS_IN_FLIGHT_MAX` or more past it follows; the
//! frames after it are cut off with it. An append beyond the bound, and
//! the seal of a full file, first make the frames in flight durable
//! themselves, so a sealed file (and so every older file) holds durable
//! frames only, and the fold reads nothing a failed sync could undo. Each
//! sync in flight `fdatasync`s through an open file description of its
//! own: Linux reports a failed writeback once per description.
//!
//! # Space
//!
//! A deletion frees its record's space once a fold removes the key from
//! the table; each fold deletes the log files it folded; redb reuses the
//! pages folds free, so a steady workload does not grow the files.
//! `tests/contract.rs` checks it: 20,000 commits of (put a new key, delete
//! the key put 500 commits earlier) leave the redb file the same size
//! after the second half as after the first.
//!
//! # File mode
//!
//! The files hold a service's whole state (the agent's reservations, the
//! center's accounts), read by that service's user alone: the redb file and
//! each log file are created with mode [`FILE_MODE`] (0600), whatever the
//! process umask, and an existing file readable or writable by its group or
//! others is tightened to 0600 at open, logged as
//! `event=file_mode_tightened`.
//!
//! # Layout versions
//!
//! Version 5 is the write-ahead log with groups of records. Version 4 kept
//! every record alone in the keyed table; such a file is upgraded at open:
//! its records that the layout puts in groups move to their groups, in one
//! durable transaction (logged as `event=store_upgraded` with
//! `records_grouped`), and its log files are read as before. Versions 2 and
//! 3 kept the log as a redb table ([`Layout::log`], one entry per commit,
//! the payload above; version 3's callers write MessagePack values, version
//! 2's JSON, which [`value`] still reads); such a file is upgraded at open:
//! its log table is replayed into the keyed table and dropped in one
//! durable transaction. Version 1 (the keyed table alone) is upgraded in
//! place. Every older version's records then move into their groups as
//! version 4's do. A binary of an older version refuses a newer file, which
//! it could not read correctly.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::fs::{File, OpenOptions, Permissions};
use std::ops::Bound;
use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

pub mod value;

use redb::{Database, Durability, ReadableDatabase as _, ReadableTable as _, TableDefinition};
use thread_priority::ThreadPriority;

/// `"schema"` → the layout version of the file; the two `wal-folded-*`
/// keys → how far the log files are folded into the table.
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const SCHEMA: &str = "schema";
/// Every log file up to this generation is folded: it may be deleted.
const FOLDED_GENERATION: &str = "wal-folded-generation";
/// The sequence number of the last frame folded: the first frame of the
/// log files that follow has the next one.
const FOLDED_SEQUENCE: &str = "wal-folded-sequence";
const LAYOUT_VERSION: u64 = 5;
/// The write-ahead log, every record alone in the keyed table.
const LAYOUT_VERSION_UNGROUPED: u64 = 4;
/// The layout before the log: the keyed table alone.
const LAYOUT_VERSION_KEYED_ONLY: u64 = 1;
/// The log as a redb table, its values JSON.
const LAYOUT_VERSION_JSON_VALUES: u64 = 2;
/// The log as a redb table, its values MessagePack.
const LAYOUT_VERSION_LOG_TABLE: u64 = 3;

/// The frame header: length, crc32, sequence number.
const FRAME_HEADER: usize = 16;

/// The end mark: a frame header of zeros, which no frame has (sequence
/// numbers start at 1). A log file's frames end at the first end mark (or
/// at the file's end): what follows is zeros written ahead or, in a
/// recycled file ([`Spare`]), frames of an earlier generation, never read
/// again. In a recycled file each frame is written with an end mark after
/// it, in the same `pwrite` (the next frame writes over it); elsewhere
/// the zeros written ahead are the mark.
const END_MARK: [u8; FRAME_HEADER] = [0; FRAME_HEADER];

/// How long the folder waits after a failed fold before it tries again.
pub const FOLD_RETRY: Duration = Duration::from_secs(1);

/// While a fold runs, the newest log file takes at most this many times
/// [`Layout::log_commits`] frames; a commit beyond waits for the fold.
/// Folds took 80-200 ms for a sealed file's 2,000-7,000 keys in the
/// benchmarks, at about one commit per millisecond: the newest file grows
/// by less than one `log_commits` during a fold, far from the bound.
pub const FOLD_LAG_FILES: u64 = 8;

/// At most this many commits are appended and not yet durable
/// ([`RecordLog::append`]): an append beyond makes them durable first.
/// Open's crash rules follow from it: a torn frame may be followed by at
/// most this many minus one valid frames, none of them acknowledged.
pub const COMMITS_IN_FLIGHT_MAX: u64 = 2;

/// A fold (and a load) reads the values of at most this many keys at a
/// time (and at most [`FOLD_READ_BYTES`] of values), ordered by where they
/// lie in the log files, before it inserts them in key order.
const FOLD_READ_VALUES: usize = 1024;

/// See [`FOLD_READ_VALUES`].
const FOLD_READ_BYTES: u64 = 1 << 20;

/// Values at most this far apart in a log file are read by one read,
/// which reads the bytes between too (keys, and values written over since).
const FOLD_READ_GAP: u64 = 4096;

/// The zeros a service's store writes ahead of its log frames
/// ([`Layout::preallocate_bytes`]). Commits of one 6 KiB frame on this
/// project's ext4 machines took 0.21 to 0.29 ms at the median appended and
/// 0.13 to 0.14 written over zeros (mean 0.21 to 0.31 against 0.15 to 0.16,
/// the zeros' writes included); of 40 KiB, 0.34 to 0.40 against 0.20 to
/// 0.22 ms (mean 0.40 to 0.52 against 0.36 to 0.40). Writing the zeros adds
/// about 0.5 ms to the commit that writes them: 1 MiB at a time added 2 to
/// 3 ms to one commit in 25 of 40 KiB, the p99.
pub const PREALLOCATE_BYTES: u64 = 256 << 10;

/// The name of a log file folded and kept for reuse ([`Spare`]): no
/// generation, so no open reads it; open deletes it.
const SPARE_SUFFIX: &str = ".wal.spare";

/// The store files' mode: their owner reads and writes them, nobody else.
pub const FILE_MODE: u32 = 0o600;

/// The names of a store's tables, and how much its log holds.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Key → the latest value folded from the log.
    pub records: &'static str,
    /// The redb log table of layout versions 2 and 3 (commit sequence
    /// number → that commit's records): replayed into `records` and
    /// dropped when such a file is opened.
    pub log: &'static str,
    /// How many frames the newest log file takes before it is sealed and
    /// folded (more while a fold runs).
    pub log_commits: u64,
    /// redb's page cache, in bytes. The table is read once, at open; folds
    /// write it, so the cache mostly holds pages that are never read again.
    /// redb's default (1 GiB) let an agent with 100,000 open reservations
    /// grow to about 500 MiB of RSS.
    pub cache_bytes: usize,
    /// Zeros written ahead of the frames: a frame that passes the end of
    /// the newest log file extends the file by this many bytes of zeros
    /// beyond it, in the same commit. Later frames overwrite blocks the
    /// file has, so their `fdatasync` flushes their data and not the
    /// file's size too. 0: every frame is a plain append.
    pub preallocate_bytes: u64,
    /// Group name → the records of a group, as one value (see "Groups of
    /// records" in the crate documentation).
    pub groups: &'static str,
    /// The group a key's record is kept in: a prefix of the key, the
    /// group's name, shared by the keys written near each other; `None`:
    /// the record stays alone in [`Layout::records`]. [`ungrouped`] puts
    /// every record alone. A key's group must never change once records
    /// are stored: the fold writes a key into the group this returns.
    /// Open refuses a store whose first group another rule made
    /// ([`RecordLogError::OtherGrouping`]); a rule that groups keys a
    /// store keeps alone needs a new layout version, whose upgrade moves
    /// them (as version 4's does), or a record kept alone would stay
    /// beside its group's newer value.
    pub group: fn(&str) -> Option<&str>,
}

/// A [`Layout::group`] that keeps every record alone.
pub fn ungrouped(_key: &str) -> Option<&str> {
    None
}

/// A [`Layout::group`] for keys `<prefix><16 lower-case hex digits>…`
/// written in the order of that number (an ordinal): the key up to the
/// ordinal's first [`ORDINAL_GROUP_DIGITS`] digits, so that each group
/// holds the records of 16 consecutive ordinals. Any other key stays
/// alone.
pub fn ordinal_group<'k>(key: &'k str, prefix: &str) -> Option<&'k str> {
    let ordinal = key.strip_prefix(prefix)?.as_bytes().get(..16)?;
    ordinal
        .iter()
        .all(|digit| matches!(digit, b'0'..=b'9' | b'a'..=b'f'))
        .then(|| &key[..prefix.len() + ORDINAL_GROUP_DIGITS])
}

/// The digits of an ordinal that name its group ([`ordinal_group`]): 15 of
/// 16, so sixteen ordinals a group. Each record written into an older
/// group rewrites the group, so a larger group costs more where records
/// change long after they are written (a long-lived reservation settled,
/// a record forgotten); see docs/benchmarks-history.md for what groups saved.
pub const ORDINAL_GROUP_DIGITS: usize = 15;

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub enum RecordLogError {
    /// The storage engine failed (I/O, a full disk, a locked file).
    #[error("redb: {0}")]
    Redb(#[from] redb::Error),
    /// A file could not be created, opened, listed or its mode read or
    /// tightened.
    #[error("cannot prepare {path}: {source}", path = .path.display())]
    File {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Writing, syncing or reading a log file failed.
    #[error("log file {path}: {source}", path = .path.display())]
    Log {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A log entry (a log table entry of layout 2 or 3, or a log frame
    /// whose checksum holds) is not a valid sequence of framed records.
    #[error("log entry {sequence} of {path} is damaged: {reason}", path = .path.display())]
    Damaged {
        path: PathBuf,
        sequence: u64,
        reason: &'static str,
    },
    /// A log file is damaged where acknowledged commits follow (or before
    /// the end of a file that a newer one follows): cutting it off would
    /// drop acknowledged data, so the store does not open.
    #[error(
        "log file {path} is corrupt at byte {offset}: {reason}; acknowledged commits follow, so it is not cut off: restore the store from a backup",
        path = .path.display()
    )]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: &'static str,
    },
    /// A frame's `fdatasync` failed, or an append failed and cutting its
    /// partial frame off failed too: what the log holds on disk is not
    /// known, so no commit (or read) is taken until the store is reopened.
    #[error("a failed write or sync of the log of {path} left it in an unknown state; reopen the store", path = .path.display())]
    Broken { path: PathBuf },
    /// A commit's records do not fit one frame (4 GiB).
    #[error("a commit of {bytes} bytes does not fit one log frame (under 4 GiB)")]
    TooLarge { bytes: usize },
    /// Folding the log into the table failed ([`RecordLog::checkpoint`];
    /// the folder retries, the log keeps every commit meanwhile).
    #[error("folding the log of {path} into its table failed: {message}", path = .path.display())]
    Fold { path: PathBuf, message: String },
    /// The fold panicked (a bug): reported as the fold's failure, and the
    /// fold retried.
    #[error("the fold panicked: {message}")]
    FoldPanicked { message: String },
    /// A group's value (see "Groups of records") is not a valid sequence
    /// of records.
    #[error("the record group {group} of {path} is damaged: {reason}", path = .path.display())]
    DamagedGroup {
        path: PathBuf,
        group: String,
        reason: &'static str,
    },
    /// The store's records were grouped by another [`Layout::group`]
    /// than the one it is opened with.
    #[error("{path} keeps {key} in a group this binary's layout does not put it in; open it with the layout that wrote it", path = .path.display())]
    OtherGrouping { path: PathBuf, key: String },
    /// The file was written with another layout.
    #[error("{path} holds store layout version {found}; this binary reads version {LAYOUT_VERSION}", path = .path.display())]
    Version { path: PathBuf, found: u64 },
    /// A deliberate abort ([`RecordLog::commit_then_abort`]).
    #[error("the commit was aborted before it completed")]
    Aborted,
}

/// The value length that marks a deletion in a payload (no value bytes
/// follow). No record reaches 4 GiB, so no stored value has it.
const DELETED: u32 = u32::MAX;

/// One write of a commit: the key, and its new value or `None` to delete it.
pub type Write<'a> = (&'a str, Option<&'a [u8]>);

/// Key → its latest write (`None`: deleted), as where its value lies in
/// the log files.
type Writes = BTreeMap<String, Option<Logged>>;

/// Where a value written to a log file lies in it: the value is read back
/// from there (normally still in the page cache) when it is folded or
/// loaded, so the writes not folded yet cost memory for their keys only.
/// Holding the values themselves cost each store one copy of everything
/// written since the last fold — two while a fold ran — about a tenth of
/// the agent's heap with 100,000 reservations open (docs/benchmarks-history.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Logged {
    generation: u64,
    offset: u64,
    length: u32,
}

impl Logged {
    /// The location of `value`, a slice of `payload`, the payload of the
    /// frame at `frame_offset` of log file `generation`.
    fn of(generation: u64, frame_offset: u64, payload: &[u8], value: &[u8]) -> Self {
        let within = value.as_ptr() as usize - payload.as_ptr() as usize;
        debug_assert!(within + value.len() <= payload.len());
        Self {
            generation,
            offset: frame_offset + (FRAME_HEADER + within) as u64,
            // `encode_records` refused longer values.
            length: u32::try_from(value.len()).unwrap_or(u32::MAX),
        }
    }
}

/// Handles on log files, to read the values [`Logged`] locates. They are
/// cloned under the store's lock; the folder reads through its own outside
/// the lock, where a log file folded and deleted meanwhile stays readable
/// through them.
struct LogFiles {
    /// The store's path.
    store: PathBuf,
    files: Vec<(u64, File, PathBuf)>,
}

impl LogFiles {
    fn of<'s>(
        store: &Path,
        segments: impl IntoIterator<Item = &'s Segment>,
    ) -> Result<Self, RecordLogError> {
        let files = segments
            .into_iter()
            .map(|segment| {
                let file = segment.file.try_clone().map_err(log_error(&segment.path))?;
                Ok((segment.generation, file, segment.path.clone()))
            })
            .collect::<Result<_, RecordLogError>>()?;
        Ok(Self {
            store: store.to_owned(),
            files,
        })
    }

    /// The open log file `generation`, and its path.
    fn file(&self, generation: u64) -> Result<(&File, &Path), RecordLogError> {
        match self.files.iter().find(|(held, ..)| *held == generation) {
            Some((_, file, path)) => Ok((file, path)),
            // Not reached: a write not folded yet lies in a log file the
            // store holds open until the fold of that file ends.
            None => Err(log_error(&segment_path(&self.store, generation))(
                std::io::Error::other("the log file of a write not folded yet is not open"),
            )),
        }
    }

    /// Hands `write` each of `writes` in order, with its value read from
    /// the files (`None`: a delete). The values are read in batches of at
    /// most [`FOLD_READ_VALUES`] writes or [`FOLD_READ_BYTES`] (at least
    /// one write a batch, whatever the bounds), each batch by
    /// [`Self::read_many`].
    fn read_in_batches<'w>(
        &self,
        writes: impl IntoIterator<Item = (&'w String, &'w Option<Logged>)>,
        mut write: impl FnMut(&'w str, Option<&[u8]>) -> Result<(), RecordLogError>,
    ) -> Result<(), RecordLogError> {
        let mut writes = writes.into_iter().peekable();
        let mut keys = Vec::with_capacity(FOLD_READ_VALUES);
        let mut locations = Vec::with_capacity(FOLD_READ_VALUES);
        let mut values = ReadValues::default();
        while writes.peek().is_some() {
            keys.clear();
            locations.clear();
            let mut bytes = 0;
            while keys.is_empty() || (keys.len() < FOLD_READ_VALUES && bytes < FOLD_READ_BYTES) {
                let Some((key, logged)) = writes.next() else {
                    break;
                };
                bytes += logged.map_or(0, |logged| u64::from(logged.length));
                keys.push(key.as_str());
                locations.push(*logged);
            }
            self.read_many(&locations, &mut values)?;
            for (index, (key, logged)) in keys.iter().zip(&locations).enumerate() {
                write(key, logged.map(|_| values.value(index)))?;
            }
        }
        Ok(())
    }

    /// Reads the values `locations` locate (a `None` reads nothing) into
    /// `out`, in the order they lie in the files, neighbours at most
    /// [`FOLD_READ_GAP`] apart by one read: a fold read each value with a
    /// read of its own, 18 % of the folder's time.
    fn read_many(
        &self,
        locations: &[Option<Logged>],
        out: &mut ReadValues,
    ) -> Result<(), RecordLogError> {
        let ReadValues {
            bytes,
            ranges,
            order,
        } = out;
        bytes.clear();
        ranges.clear();
        ranges.resize(locations.len(), 0..0);
        order.clear();
        order.extend(
            locations
                .iter()
                .enumerate()
                .filter_map(|(index, logged)| logged.map(|logged| (logged, index))),
        );
        order.sort_unstable_by_key(|(logged, _)| (logged.generation, logged.offset));
        let mut next = 0;
        while let Some((first, _)) = order.get(next).copied() {
            let start = first.offset;
            let mut end = start + u64::from(first.length);
            let mut last = next + 1;
            while let Some((logged, _)) = order.get(last)
                && logged.generation == first.generation
                && logged.offset <= end + FOLD_READ_GAP
            {
                end = end.max(logged.offset + u64::from(logged.length));
                last += 1;
            }
            let base = bytes.len();
            let length = usize::try_from(end - start)
                .map_err(|_| RecordLogError::TooLarge { bytes: usize::MAX })?;
            bytes.resize(base + length, 0);
            let (file, path) = self.file(first.generation)?;
            file.read_exact_at(&mut bytes[base..], start)
                .map_err(log_error(path))?;
            for (logged, index) in &order[next..last] {
                let from = base
                    + usize::try_from(logged.offset - start)
                        .expect("within the read, whose length is a usize");
                ranges[*index] = from..from + logged.length as usize;
            }
            next = last;
        }
        Ok(())
    }
}

/// What [`LogFiles::read_many`] read: the value asked for at index `i` is
/// `bytes[ranges[i]]`. Kept across batches for its room.
#[derive(Default)]
struct ReadValues {
    bytes: Vec<u8>,
    ranges: Vec<std::ops::Range<usize>>,
    /// The values asked for, by where they lie: (location, index asked).
    order: Vec<(Logged, usize)>,
}

impl ReadValues {
    fn value(&self, index: usize) -> &[u8] {
        &self.bytes[self.ranges[index].clone()]
    }
}

fn redb_error(error: impl Into<redb::Error>) -> RecordLogError {
    RecordLogError::Redb(error.into())
}

fn file_error(path: &Path) -> impl Fn(std::io::Error) -> RecordLogError + '_ {
    |source| RecordLogError::File {
        path: path.to_owned(),
        source,
    }
}

fn damaged_group<'a>(
    path: &'a Path,
    group: &'a str,
) -> impl Fn(&'static str) -> RecordLogError + 'a {
    move |reason| RecordLogError::DamagedGroup {
        path: path.to_owned(),
        group: group.to_owned(),
        reason,
    }
}

fn log_error(path: &Path) -> impl Fn(std::io::Error) -> RecordLogError + '_ {
    |source| RecordLogError::Log {
        path: path.to_owned(),
        source,
    }
}

/// Opens the file at `path` for reading and writing — creating it with
/// [`FILE_MODE`] if `create` (an existing file is left as it is, contents
/// and all) — and tightens a file that its group or others may read or
/// write to [`FILE_MODE`]. The mode is given at creation, so the umask
/// cannot widen it, and changed through the open file, so it is the file
/// just checked.
fn open_private(path: &Path, create: bool) -> Result<File, RecordLogError> {
    let error = file_error(path);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .mode(FILE_MODE)
        .open(path)
        .map_err(&error)?;
    let mode = file.metadata().map_err(&error)?.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        file.set_permissions(Permissions::from_mode(FILE_MODE))
            .map_err(&error)?;
        tracing::warn!(
            event = "file_mode_tightened",
            path = %path.display(),
            from = format!("{mode:04o}"),
            to = format!("{FILE_MODE:04o}"),
            "the store file was open to its group or others; its mode is now 0600"
        );
    }
    Ok(file)
}

/// The store. See the crate documentation.
pub struct RecordLog {
    shared: Arc<Shared>,
    /// The folder thread; joined on drop.
    folder: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RecordLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordLog")
            .field("path", &self.shared.path)
            .field("state", &*self.shared.lock())
            .finish_non_exhaustive()
    }
}

/// A commit's frame, appended to the newest log file and not yet durable
/// ([`RecordLog::append`]). [`Appended::sync`] makes it durable; dropped
/// unsynced, it breaks the store (the frames after it could never be
/// acknowledged).
#[must_use = "a commit is durable only once its frame is synced"]
pub struct Appended {
    shared: Arc<Shared>,
    sequence: u64,
    generation: u64,
    /// Where the frame begins (a failed sync cuts the file off there) and
    /// ends.
    start: u64,
    end: u64,
    /// A file description of the sync's own (see [`Segment::sync_files`]);
    /// `None` once synced.
    file: Option<File>,
    /// Whether the file's directory entry is to be made durable too (its
    /// first frames).
    name_directory: bool,
}

impl std::fmt::Debug for Appended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Appended")
            .field("sequence", &self.sequence)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl Appended {
    /// `fdatasync`s the frame (and the directory, for a new file's first
    /// frames), then returns once every frame appended before it is
    /// durable too: `Ok` means this commit and every earlier one are on
    /// disk. A failed `fdatasync` cuts the file off where the frame begins
    /// (the frames after it go too; frames already known durable stay)
    /// and breaks the store: Linux may have
    /// dropped the pages whose writeback failed, so the file's cached
    /// contents are no longer known to be on disk. Every later commit and
    /// read fails with [`RecordLogError::Broken`] until it is reopened,
    /// and open's crash rules settle what is on disk.
    pub fn sync(mut self) -> Result<(), RecordLogError> {
        let Some(file) = self.file.take() else {
            unreachable!("an appended frame is synced once: `sync` takes it");
        };
        let shared = &self.shared;
        let synced = sync_log_file(&file, &shared.path, !self.name_directory);
        let mut state = shared.lock();
        if let Err(source) = synced {
            let path = segment_path(&shared.path, self.generation);
            tracing::error!(
                event = "wal_sync_failed",
                path = %path.display(),
                error = %source,
                "a log frame's fdatasync failed; the store takes no more commits until reopened"
            );
            shared.break_at(&mut state, self.generation, self.start);
            return Err(log_error(&path)(source));
        }
        // The frames before this one are synced by their own calls; a
        // commit is acknowledged only with all of them.
        while state.synced_through + 1 < self.sequence && !state.broken {
            state = shared.wait(state);
        }
        if state.broken {
            return Err(RecordLogError::Broken {
                path: shared.path.clone(),
            });
        }
        // (Made durable already by a later append's sync of the frames in
        // flight, perhaps.)
        state.synced_through = state.synced_through.max(self.sequence);
        if let Some(newest) = state.newest.as_mut()
            && newest.generation == self.generation
        {
            newest.named = true;
            newest.synced_len = newest.synced_len.max(self.end);
            if (newest.sync_files.len() as u64) < COMMITS_IN_FLIGHT_MAX {
                newest.sync_files.push(file);
            }
        }
        if state.may_seal(shared.layout.log_commits) {
            state.seal();
        }
        shared.changed.notify_all();
        Ok(())
    }
}

impl Drop for Appended {
    fn drop(&mut self) {
        if self.file.is_some() {
            let shared = &self.shared;
            let mut state = shared.lock();
            tracing::error!(
                event = "wal_frame_dropped_unsynced",
                path = %shared.path.display(),
                sequence = self.sequence,
                "an appended log frame was dropped before its sync; the store takes no more commits until reopened"
            );
            shared.break_at(&mut state, self.generation, self.start);
        }
    }
}

/// What the committing threads and the folder share.
struct Shared {
    db: Database,
    path: PathBuf,
    layout: Layout,
    state: Mutex<State>,
    /// Signalled when a seal hands the folder work, a fold ends (or
    /// fails), and at drop.
    changed: Condvar,
}

/// One log file.
#[derive(Debug)]
struct Segment {
    generation: u64,
    path: PathBuf,
    file: File,
    /// The bytes of its whole frames: where the next frame goes.
    len: u64,
    /// The file's length: `len` and, past it, zeros written ahead
    /// ([`Layout::preallocate_bytes`]).
    size: u64,
    frames: u64,
    /// The bytes of its frames known durable: where a failed sync cuts
    /// the file off.
    synced_len: u64,
    /// Whether its directory entry is durable (the directory `fsync`ed
    /// after its first frame).
    named: bool,
    /// Open file descriptions of its own for the `fdatasync`s in flight,
    /// kept for the next ones. Linux reports a failed writeback once per
    /// file description: two `fdatasync`s through one description could
    /// each return success while the other saw the failure of its frame's
    /// pages.
    sync_files: Vec<File>,
    /// Made of a spare ([`Spare`]): each frame is followed by an end mark.
    recycled: bool,
}

/// A log file folded and kept, renamed, for the next generation: its
/// blocks are written already, so the frames written over them need no
/// zeros ahead ([`PREALLOCATE_BYTES`]), and their `fdatasync`s write data
/// alone. Its first bytes are an end mark ([`END_MARK`]), durable before
/// the rename: whatever a crash leaves, it holds no frame of its own until
/// one is written over the mark. The commit that starts a new log file
/// renames it (the directory is synced with the first frame, as for a file
/// created). In `agent_emergency_128` about one commit in ten wrote 256
/// KiB of zeros, 15 of the 41 KiB written per commit (docs/benchmarks-history.md).
#[derive(Debug)]
struct Spare {
    path: PathBuf,
    file: File,
    /// The file's length: zeros and old frames to write over.
    size: u64,
}

/// The log files, the writes not folded yet, and the folder's progress.
struct State {
    /// The log file new frames go to; `None` until the first frame after
    /// an open or a seal creates it.
    newest: Option<Segment>,
    /// The latest write of each key in the newest file.
    fresh: Writes,
    /// Complete log files, being folded; deleted once they are.
    sealed: Vec<Segment>,
    /// The latest write of each key in the sealed files: what the folder
    /// writes into the table (`None`: nothing sealed).
    sealed_writes: Option<Arc<Writes>>,
    next_generation: u64,
    next_sequence: u64,
    /// Every frame up to this sequence number is durable; the frames after
    /// it are appended and their `fdatasync`s in flight.
    synced_through: u64,
    /// Set when an `fdatasync` failed, or a failed append could not be
    /// cut off again.
    broken: bool,
    /// Folds completed since open.
    folds: u64,
    /// The last fold's error, until a fold succeeds.
    fold_failure: Option<String>,
    /// Set while the folder writes a fold.
    folding: bool,
    /// Set by [`RecordLog::hold_folds`]: the folder starts no fold.
    folds_held: bool,
    /// Commits waiting for a fold to end ([`FOLD_LAG_FILES`]).
    commits_waiting: usize,
    /// Whether a wait for the running fold was logged already.
    lag_logged: bool,
    /// Set at drop: the folder exits.
    stop: bool,
    /// The last log file folded, kept for the next generation (only in a
    /// store that writes zeros ahead: [`Layout::preallocate_bytes`]).
    spare: Option<Spare>,
    /// Makes the next fold panic: for the test that a panic is a failed
    /// fold.
    #[cfg(test)]
    panic_in_next_fold: bool,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("newest", &self.newest)
            .field("fresh", &self.fresh.len())
            .field("sealed", &self.sealed)
            .field(
                "sealed_writes",
                &self.sealed_writes.as_ref().map(|writes| writes.len()),
            )
            .field("next_sequence", &self.next_sequence)
            .field("broken", &self.broken)
            .field("folds", &self.folds)
            .field("fold_failure", &self.fold_failure)
            .finish_non_exhaustive()
    }
}

impl State {
    /// Frames appended whose `fdatasync` has not returned.
    fn unsynced(&self) -> u64 {
        self.next_sequence - 1 - self.synced_through
    }

    /// Whether the newest file is full and may be sealed now: no fold
    /// runs and all its frames are durable (a fold never reads a frame
    /// that a failed sync may leave out).
    fn may_seal(&self, log_commits: u64) -> bool {
        self.full(log_commits) && self.unsynced() == 0
    }

    /// Whether the newest file holds `log_commits` frames and no fold
    /// runs: it is to be sealed once its frames are durable.
    fn full(&self, log_commits: u64) -> bool {
        self.sealed_writes.is_none()
            && self
                .newest
                .as_ref()
                .is_some_and(|newest| newest.frames >= log_commits)
    }

    fn frames(&self) -> u64 {
        self.sealed
            .iter()
            .chain(&self.newest)
            .map(|segment| segment.frames)
            .sum()
    }

    /// Hands the newest file and its writes to the folder; the next commit
    /// starts a new file. Only while no fold runs.
    fn seal(&mut self) {
        debug_assert!(self.sealed.is_empty() && self.sealed_writes.is_none());
        if let Some(newest) = self.newest.take() {
            self.sealed.push(newest);
            self.sealed_writes = Some(Arc::new(std::mem::take(&mut self.fresh)));
            self.fold_failure = None;
        }
    }
}

/// Applies one write to a map of latest writes.
fn apply(writes: &mut Writes, key: &str, value: Option<Logged>) {
    match writes.get_mut(key) {
        Some(latest) => *latest = value,
        None => {
            writes.insert(key.to_owned(), value);
        }
    }
}

/// The path of the spare log file of the store at `path` ([`Spare`]).
fn spare_path(path: &Path) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(SPARE_SUFFIX);
    PathBuf::from(name)
}

/// The path of log file `generation` of the store at `path`.
fn segment_path(path: &Path, generation: u64) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(format!(".wal.{generation}"));
    PathBuf::from(name)
}

/// Every file of the store at `path`: the redb file and its log files
/// present, in generation order. A backup copies all of them (with the
/// store closed), and a restore replaces all of them: a log file of
/// another state left beside a restored redb file fails the next open.
pub fn store_files(path: &Path) -> Result<Vec<PathBuf>, RecordLogError> {
    let mut files = vec![path.to_owned()];
    files.extend(
        list_segments(path)?
            .into_iter()
            .map(|generation| segment_path(path, generation)),
    );
    Ok(files)
}

/// The bytes the store at `path` holds on disk, all its files together
/// and the spare log file (0 for files missing).
pub fn store_bytes(path: &Path) -> u64 {
    store_files(path)
        .unwrap_or_default()
        .iter()
        .chain([&spare_path(path)])
        .filter_map(|file| std::fs::metadata(file).ok())
        .map(|metadata| metadata.len())
        .sum()
}

/// The directory holding the store's files.
fn directory(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

/// The generations of the store's log files present, in order.
fn list_segments(path: &Path) -> Result<Vec<u64>, RecordLogError> {
    let directory = directory(path);
    let Some(name) = path.file_name().and_then(|name| name.to_str()) else {
        // `segment_path` would still name log files that this listing
        // could not find again, so refuse such a name up front.
        return Err(RecordLogError::File {
            path: path.to_owned(),
            source: std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the store file name is not UTF-8",
            ),
        });
    };
    let prefix = format!("{name}.wal.");
    let mut generations = Vec::new();
    for entry in std::fs::read_dir(directory).map_err(file_error(directory))? {
        let entry = entry.map_err(file_error(directory))?;
        let name = entry.file_name();
        let Some(suffix) = name.to_str().and_then(|name| name.strip_prefix(&prefix)) else {
            continue;
        };
        if !suffix.is_empty()
            && suffix.bytes().all(|byte| byte.is_ascii_digit())
            && let Ok(generation) = suffix.parse::<u64>()
        {
            generations.push(generation);
        }
    }
    generations.sort_unstable();
    Ok(generations)
}

fn sync_directory(path: &Path) -> std::io::Result<()> {
    File::open(directory(path))?.sync_all()
}

/// `fdatasync`s a log file through `file`, and the directory of the store
/// at `path` too while the file's name is not yet durable (`named`).
fn sync_log_file(file: &File, path: &Path, named: bool) -> std::io::Result<()> {
    file.sync_data()?;
    if !named {
        sync_directory(path)?;
    }
    Ok(())
}

/// Why a frame at some offset is not the next valid frame.
enum BadFrame {
    /// Not a valid frame: cut short, or failing its checksum.
    Invalid(&'static str),
    /// A valid frame numbered past the expected one.
    OutOfSequence,
    /// The end of the frames: an end mark ([`END_MARK`]; fewer zeros at
    /// the end of the file), or a valid frame of an earlier commit — in a
    /// recycled file, a frame of its earlier generation ([`Spare`]) where
    /// a crash left the end mark unwritten.
    End,
}

/// The frame at `offset` of `bytes`, if it is valid with sequence number
/// `sequence`: its payload.
fn parse_frame(bytes: &[u8], offset: usize, sequence: u64) -> Result<&[u8], BadFrame> {
    let rest = bytes.get(offset..).unwrap_or_default();
    if rest.iter().take(FRAME_HEADER).all(|byte| *byte == 0) {
        return Err(BadFrame::End);
    }
    let (payload, found) = parse_any_frame(bytes, offset)?;
    if found < sequence {
        return Err(BadFrame::End);
    }
    if found != sequence {
        return Err(BadFrame::OutOfSequence);
    }
    Ok(payload)
}

/// The frame at `offset` of `bytes` if it is valid: its payload and
/// sequence number.
fn parse_any_frame(bytes: &[u8], offset: usize) -> Result<(&[u8], u64), BadFrame> {
    let rest = bytes.get(offset..).unwrap_or_default();
    let Some((header, rest)) = rest.split_first_chunk::<FRAME_HEADER>() else {
        return Err(BadFrame::Invalid("a frame header is cut short"));
    };
    let [l0, l1, l2, l3, c0, c1, c2, c3, sequence @ ..] = *header;
    let length = u32::from_le_bytes([l0, l1, l2, l3]);
    let crc = u32::from_le_bytes([c0, c1, c2, c3]);
    let sequence = u64::from_le_bytes(sequence);
    let Some(payload) = usize::try_from(length)
        .ok()
        .and_then(|length| rest.get(..length))
    else {
        return Err(BadFrame::Invalid("a frame is cut short"));
    };
    if frame_crc(length, sequence, payload) != crc {
        return Err(BadFrame::Invalid("a frame fails its checksum"));
    }
    Ok((payload, sequence))
}

/// Whether a valid frame with a sequence number from `sequence` on starts
/// anywhere after `offset`: then a bad frame at `offset` is not a torn
/// tail but damage before acknowledged commits (a frame is acknowledged
/// only once every frame before it is durable, and at most
/// [`COMMITS_IN_FLIGHT_MAX`] are in flight). The sequence check first
/// keeps the scan to a compare per byte.
fn valid_frame_after(bytes: &[u8], offset: usize, sequence: u64) -> bool {
    (offset + 1..bytes.len().saturating_sub(FRAME_HEADER - 1)).any(|at| {
        let Some(found) = bytes
            .get(at + 8..at + FRAME_HEADER)
            .and_then(|field| <[u8; 8]>::try_from(field).ok())
            .map(u64::from_le_bytes)
        else {
            return false;
        };
        found >= sequence
            && found - sequence <= u64::from(u32::MAX)
            && parse_any_frame(bytes, at).is_ok()
    })
}

/// Writes `count` zeros at `offset` of `file`, a page at a time. One
/// large write let Linux (6.18, ext4) cache the range in large folios, and
/// a frame written over part of one later dirtied it whole: each commit's
/// `fdatasync` then wrote 350 KiB for a 6 KiB frame, against 8 KiB after
/// writes of a page.
fn write_zeros_at(file: &File, offset: u64, count: u64) -> std::io::Result<()> {
    const PAGE: [u8; 4096] = [0; 4096];
    let end = offset + count;
    let mut at = offset;
    while at < end {
        let length = usize::try_from(end - at).map_or(PAGE.len(), |rest| rest.min(PAGE.len()));
        file.write_all_at(&PAGE[..length], at)?;
        at += length as u64;
    }
    Ok(())
}

fn frame_crc(length: u32, sequence: u64, payload: &[u8]) -> u32 {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&length.to_le_bytes());
    hasher.update(&sequence.to_le_bytes());
    hasher.update(payload);
    hasher.finalize()
}

/// How far the log files are folded, as `meta` records it.
struct Folded {
    generation: u64,
    sequence: u64,
}

impl RecordLog {
    /// Opens (or creates) the store at `path`, upgrading a file of an
    /// older layout, reads its log files (see the crate documentation for
    /// what a damaged one does) and starts the folder.
    pub fn open(path: &Path, layout: Layout) -> Result<Self, RecordLogError> {
        open_private(path, true)?;
        let db = Database::builder()
            .set_cache_size(layout.cache_bytes)
            .create(path)
            .map_err(redb_error)?;
        let folded = check_layout(&db, path, layout)?;
        let state = recover(path, &folded)?;
        let shared = Arc::new(Shared {
            db,
            path: path.to_owned(),
            layout,
            state: Mutex::new(state),
            changed: Condvar::new(),
        });
        let folder = std::thread::Builder::new()
            .name("record-log-fold".to_owned())
            .spawn({
                let shared = Arc::clone(&shared);
                move || shared.run_folder()
            })
            .map_err(file_error(path))?;
        Ok(Self {
            shared,
            folder: Some(folder),
        })
    }

    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Stores `records` durably as one log frame (group commit: a shell
    /// passes everything that is ready): [`Self::append`], then
    /// [`Appended::sync`].
    pub fn commit<'a>(
        &self,
        records: impl IntoIterator<Item = Write<'a>>,
    ) -> Result<(), RecordLogError> {
        self.append(records)?.sync()
    }

    /// Appends `records` as one log frame, not yet durable: the first half
    /// of a commit, for a shell that keeps up to [`COMMITS_IN_FLIGHT_MAX`]
    /// commits in flight (the next frame written while the last one's
    /// `fdatasync` runs). Frames follow in the order of the `append`
    /// calls, and are synced in that order or from threads of their own (a
    /// sync waits for the earlier frames' syncs); an append beyond the
    /// bound makes the frames in flight durable first. A failed append
    /// stores nothing, and the store takes later commits.
    pub fn append<'a>(
        &self,
        records: impl IntoIterator<Item = Write<'a>>,
    ) -> Result<Appended, RecordLogError> {
        self.shared
            .write(records, false)?
            .ok_or(RecordLogError::Aborted)
    }

    /// Does everything a commit of `records` does (the frame's append and
    /// `fdatasync`), then undoes it as a failed append would (the frame cut
    /// off again): for tests that a commit is all or nothing.
    #[doc(hidden)]
    pub fn commit_then_abort<'a>(
        &self,
        records: impl IntoIterator<Item = Write<'a>>,
    ) -> Result<(), RecordLogError> {
        match self.shared.write(records, true)? {
            Some(_) => unreachable!("an aborted write returns no frame"),
            None => Err(RecordLogError::Aborted),
        }
    }

    /// How many commits the log files hold (not yet deleted by a fold).
    pub fn log_len(&self) -> u64 {
        self.shared.lock().frames()
    }

    /// Seals the newest log file and waits until the folder has folded
    /// every log file into the table and deleted it (after a fold already
    /// running). Commits may go on meanwhile; what they add is not waited
    /// for. Fails with the fold's error if that fold fails.
    pub fn checkpoint(&self) -> Result<(), RecordLogError> {
        let shared = &self.shared;
        let mut state = shared.lock();
        // A fold already running (or failing) first.
        while state.sealed_writes.is_some() {
            if let Some(message) = &state.fold_failure {
                return Err(shared.fold_error(message));
            }
            state = shared.wait(state);
        }
        if state.newest.is_none() {
            return Ok(());
        }
        // The frames in flight first: a fold reads durable frames only.
        shared.sync_in_flight(&mut state)?;
        state.seal();
        let target = state.folds + 1;
        shared.changed.notify_all();
        while state.folds < target {
            if let Some(message) = &state.fold_failure {
                return Err(shared.fold_error(message));
            }
            state = shared.wait(state);
        }
        Ok(())
    }

    /// How many commits wait for a fold to end ([`FOLD_LAG_FILES`]): for
    /// tests of the bound.
    #[doc(hidden)]
    pub fn commits_waiting(&self) -> usize {
        self.shared.lock().commits_waiting
    }

    /// Holds folds (`true`: the folder starts none until released; one
    /// already running ends) or releases them: for tests of what the files
    /// hold between folds.
    #[doc(hidden)]
    pub fn hold_folds(&self, held: bool) {
        let mut state = self.shared.lock();
        state.folds_held = held;
        self.shared.changed.notify_all();
        while held && state.folding {
            state = self.shared.wait(state);
        }
    }

    /// The latest value of every key, in key order.
    pub fn load(&self) -> Result<BTreeMap<String, Vec<u8>>, RecordLogError> {
        self.load_under("")
    }

    /// The latest value of every key that starts with `prefix`, in key
    /// order: reads only those keys of the table, then the writes not
    /// folded yet (from the log files).
    pub fn load_under(&self, prefix: &str) -> Result<BTreeMap<String, Vec<u8>>, RecordLogError> {
        self.latest_under(prefix, Some(<[u8]>::to_vec))
    }

    /// Every key that starts with `prefix`, in key order: what
    /// [`Self::load_under`] returns without the values, so without
    /// reading the log files (whose keys are in memory).
    pub fn keys_under(&self, prefix: &str) -> Result<Vec<String>, RecordLogError> {
        Ok(self
            .latest_under(prefix, None::<fn(&[u8])>)?
            .into_keys()
            .collect())
    }

    /// The latest value of every key under `prefix`, as `value_of` makes
    /// it; `None`: keys alone (each with `V::default()`), and the writes
    /// not folded yet are not read back from the log files.
    fn latest_under<V: Default>(
        &self,
        prefix: &str,
        value_of: Option<impl Fn(&[u8]) -> V>,
    ) -> Result<BTreeMap<String, V>, RecordLogError> {
        let shared = &self.shared;
        // Under the lock: a fold that commits meanwhile only writes values
        // the sealed writes below hold as well (they are dropped under the
        // lock after the fold's commit), so table + sealed + fresh is the
        // latest state whichever table this reads. The frames in flight
        // first: a read returns durable commits only.
        let mut state = shared.lock();
        shared.sync_in_flight(&mut state)?;
        let transaction = shared.db.begin_read().map_err(redb_error)?;
        let table = transaction
            .open_table(shared.records())
            .map_err(redb_error)?;
        let mut latest = BTreeMap::new();
        for entry in table.range(prefix..).map_err(redb_error)? {
            let (key, value) = entry.map_err(redb_error)?;
            if !key.value().starts_with(prefix) {
                break;
            }
            let value = value_of
                .as_ref()
                .map_or_else(V::default, |value_of| value_of(value.value()));
            latest.insert(key.value().to_owned(), value);
        }
        // The groups whose names start with the prefix, and those whose
        // names it starts with (a group's name is a prefix of its keys).
        let groups = transaction
            .open_table(shared.groups())
            .map_err(redb_error)?;
        let mut unpack = |name: &str, value: &[u8]| -> Result<(), RecordLogError> {
            let records = records_of_group(value).map_err(damaged_group(&shared.path, name))?;
            for (member, value) in records {
                let mut key = String::with_capacity(name.len() + member.len());
                key.push_str(name);
                key.push_str(member);
                if key.starts_with(prefix) {
                    let value = value_of
                        .as_ref()
                        .map_or_else(V::default, |value_of| value_of(value));
                    latest.insert(key, value);
                }
            }
            Ok(())
        };
        for length in (0..prefix.len()).filter(|length| prefix.is_char_boundary(*length)) {
            if let Some(value) = groups.get(&prefix[..length]).map_err(redb_error)? {
                unpack(&prefix[..length], value.value())?;
            }
        }
        for entry in groups.range(prefix..).map_err(redb_error)? {
            let (name, value) = entry.map_err(redb_error)?;
            if !name.value().starts_with(prefix) {
                break;
            }
            unpack(name.value(), value.value())?;
        }
        let values = match value_of {
            Some(value_of) => Some((
                LogFiles::of(&shared.path, state.sealed.iter().chain(&state.newest))?,
                value_of,
            )),
            None => None,
        };
        let sealed = state.sealed_writes.as_deref().into_iter();
        for writes in sealed.chain([&state.fresh]) {
            let under_prefix = writes
                .range::<str, _>((Bound::Included(prefix), Bound::Unbounded))
                .take_while(|(key, _)| key.starts_with(prefix));
            let mut apply = |key: &str, value: Option<V>| {
                match value {
                    Some(value) => latest.insert(key.to_owned(), value),
                    None => latest.remove(key),
                };
            };
            match &values {
                Some((files, value_of)) => files.read_in_batches(under_prefix, |key, value| {
                    apply(key, value.map(value_of));
                    Ok(())
                })?,
                None => {
                    for (key, logged) in under_prefix {
                        apply(key, logged.as_ref().map(|_| V::default()));
                    }
                }
            }
        }
        Ok(latest)
    }
}

impl Drop for RecordLog {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        if let Some(folder) = self.folder.take()
            && folder.join().is_err()
        {
            tracing::error!(
                event = "fold_thread_panicked",
                path = %self.shared.path.display(),
                "the record log's folder panicked; the log keeps every commit, the next open folds it"
            );
        }
    }
}

/// Checks the layout version, upgrading a file of an older layout, and
/// returns how far the log files are folded.
fn check_layout(db: &Database, path: &Path, layout: Layout) -> Result<Folded, RecordLogError> {
    let records: TableDefinition<&str, &[u8]> = TableDefinition::new(layout.records);
    let groups_table: TableDefinition<&str, &[u8]> = TableDefinition::new(layout.groups);
    let log_table: TableDefinition<u64, &[u8]> = TableDefinition::new(layout.log);
    let mut transaction = db.begin_write().map_err(redb_error)?;
    transaction
        .set_durability(Durability::Immediate)
        .map_err(redb_error)?;
    let folded = {
        let mut meta = transaction.open_table(META).map_err(redb_error)?;
        let found = meta
            .get(SCHEMA)
            .map_err(redb_error)?
            .map(|value| value.value());
        let mut table = transaction.open_table(records).map_err(redb_error)?;
        // Opened (so created) in every store: a load reads it.
        let mut groups = transaction.open_table(groups_table).map_err(redb_error)?;
        match found {
            Some(LAYOUT_VERSION) => {}
            None | Some(LAYOUT_VERSION_KEYED_ONLY | LAYOUT_VERSION_UNGROUPED) => {
                meta.insert(SCHEMA, LAYOUT_VERSION).map_err(redb_error)?;
            }
            Some(from @ (LAYOUT_VERSION_JSON_VALUES | LAYOUT_VERSION_LOG_TABLE)) => {
                // The log table, replayed in order over the table: its
                // entries are folded or superseded by later ones, so the
                // last write per key wins as a load of that version read it.
                let mut entries = 0_u64;
                {
                    let log = transaction.open_table(log_table).map_err(redb_error)?;
                    for entry in log.iter().map_err(redb_error)? {
                        let (sequence, payload) = entry.map_err(redb_error)?;
                        let sequence = sequence.value();
                        replay(payload.value(), |key, value| {
                            match value {
                                Some(value) => table.insert(key, value).map(drop),
                                None => table.remove(key).map(drop),
                            }
                            .map_err(redb_error)
                        })
                        .map_err(|error| error.at(path, sequence))?;
                        entries += 1;
                    }
                }
                transaction.delete_table(log_table).map_err(redb_error)?;
                meta.insert(SCHEMA, LAYOUT_VERSION).map_err(redb_error)?;
                tracing::info!(
                    event = "store_upgraded",
                    path = %path.display(),
                    from,
                    to = LAYOUT_VERSION,
                    log_entries_folded = entries,
                    "the redb log table was folded into the records; commits go to log files now"
                );
            }
            Some(found) => {
                return Err(RecordLogError::Version {
                    path: path.to_owned(),
                    found,
                });
            }
        }
        if found == Some(LAYOUT_VERSION) {
            check_grouping(&groups, path, layout.group)?;
        } else {
            let grouped = move_into_groups(&mut table, &mut groups, path, layout.group)?;
            if grouped > 0 {
                tracing::info!(
                    event = "store_upgraded",
                    path = %path.display(),
                    from = found.unwrap_or(LAYOUT_VERSION_KEYED_ONLY),
                    to = LAYOUT_VERSION,
                    records_grouped = grouped,
                    "records written near each other were moved into groups, one value a group"
                );
            }
        }
        let read = |key| -> Result<u64, RecordLogError> {
            Ok(meta
                .get(key)
                .map_err(redb_error)?
                .map_or(0, |value| value.value()))
        };
        Folded {
            generation: read(FOLDED_GENERATION)?,
            sequence: read(FOLDED_SEQUENCE)?,
        }
    };
    transaction.commit().map_err(redb_error)?;
    Ok(folded)
}

/// Refuses a store whose groups another [`Layout::group`] made: a load
/// would not find their records (the first group's first record is
/// checked; a layout's grouping is one rule for all its keys).
fn check_grouping(
    groups: &redb::Table<&str, &[u8]>,
    path: &Path,
    group: fn(&str) -> Option<&str>,
) -> Result<(), RecordLogError> {
    let Some((name, value)) = groups.first().map_err(redb_error)? else {
        return Ok(());
    };
    let name = name.value();
    let damaged = damaged_group(path, name);
    let records = records_of_group(value.value()).map_err(&damaged)?;
    let Some((member, _)) = records.first() else {
        return Err(damaged("a group holds no record"));
    };
    let key = format!("{name}{member}");
    match split_group(group, &key) {
        Some((found, _)) if found == name => Ok(()),
        _ => Err(RecordLogError::OtherGrouping {
            path: path.to_owned(),
            key,
        }),
    }
}

/// Moves every record of `table` that `group` puts in a group into its
/// group in `groups`, as a fold writes them (the upgrade from a layout
/// that kept them alone); returns how many moved.
fn move_into_groups(
    table: &mut redb::Table<&str, &[u8]>,
    groups: &mut redb::Table<&str, &[u8]>,
    path: &Path,
    group: fn(&str) -> Option<&str>,
) -> Result<u64, RecordLogError> {
    let mut writes = GroupWrites::default();
    let mut moved = Vec::new();
    for entry in table.iter().map_err(redb_error)? {
        let (key, value) = entry.map_err(redb_error)?;
        let key = key.value();
        if let Some((name, member)) = split_group(group, key) {
            writes.add(groups, path, name, member, Some(value.value()))?;
            moved.push(key.to_owned());
        }
    }
    writes.write(groups, path)?;
    for key in &moved {
        table.remove(key.as_str()).map_err(redb_error)?;
    }
    Ok(moved.len() as u64)
}

/// Deletes the log files the table covers, reads the others (cutting off
/// a torn tail) and seals them, for the folder to fold at once.
fn recover(path: &Path, folded: &Folded) -> Result<State, RecordLogError> {
    let generations = list_segments(path)?;
    let mut state = State {
        newest: None,
        fresh: Writes::new(),
        sealed: Vec::new(),
        sealed_writes: None,
        next_generation: generations
            .last()
            .copied()
            .unwrap_or(0)
            .max(folded.generation)
            + 1,
        next_sequence: folded.sequence + 1,
        synced_through: folded.sequence,
        broken: false,
        folds: 0,
        fold_failure: None,
        folding: false,
        folds_held: false,
        commits_waiting: 0,
        #[cfg(test)]
        panic_in_next_fold: false,
        lag_logged: false,
        stop: false,
        spare: None,
    };
    // A spare is only ever a folded file: nothing to read.
    let spare = spare_path(path);
    if let Err(error) = std::fs::remove_file(&spare)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        return Err(file_error(&spare)(error));
    }
    let (done, live): (Vec<u64>, Vec<u64>) = generations
        .into_iter()
        .partition(|generation| *generation <= folded.generation);
    for generation in done {
        let path = segment_path(path, generation);
        std::fs::remove_file(&path).map_err(file_error(&path))?;
    }
    let newest = live.last().copied();
    let mut writes = Writes::new();
    for generation in live {
        let path = segment_path(path, generation);
        let file = open_private(&path, false)?;
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut &file, &mut bytes).map_err(log_error(&path))?;
        let corrupt = |offset: usize, reason| RecordLogError::Corrupt {
            path: path.clone(),
            offset: offset as u64,
            reason,
        };
        let mut offset = 0;
        let mut frames = 0;
        while offset < bytes.len() {
            let sequence = state.next_sequence;
            // The frames in flight with this one were not acknowledged
            // either: a valid frame of a later one is corruption.
            let acknowledged = sequence + COMMITS_IN_FLIGHT_MAX;
            let payload = match parse_frame(&bytes, offset, sequence) {
                Ok(payload) => payload,
                Err(BadFrame::End) => {
                    if valid_frame_after(&bytes, offset, acknowledged) {
                        return Err(corrupt(offset, "a frame follows the end of the frames"));
                    }
                    // The newest file is cut to its frames, as after a torn
                    // frame: a frame in flight whose first blocks the crash
                    // left unwritten, or a recycled file's earlier frames.
                    if Some(generation) == newest && bytes[offset..].iter().any(|byte| *byte != 0) {
                        let torn = valid_frame_after(&bytes, offset, sequence)
                            .then_some("a frame's header is zeros");
                        cut_off(&file, &path, &mut bytes, offset, torn)?;
                    }
                    break;
                }
                Err(BadFrame::OutOfSequence) => {
                    return Err(corrupt(offset, "a frame is out of sequence"));
                }
                Err(BadFrame::Invalid(reason)) => {
                    if Some(generation) != newest || valid_frame_after(&bytes, offset, acknowledged)
                    {
                        return Err(corrupt(offset, reason));
                    }
                    cut_off(&file, &path, &mut bytes, offset, Some(reason))?;
                    break;
                }
            };
            replay(payload, |key, value| {
                let logged =
                    value.map(|value| Logged::of(generation, offset as u64, payload, value));
                apply(&mut writes, key, logged);
                Ok(())
            })
            .map_err(|error| error.at(&path, sequence))?;
            offset += FRAME_HEADER + payload.len();
            frames += 1;
            state.next_sequence += 1;
        }
        state.sealed.push(Segment {
            generation,
            path,
            file,
            len: offset as u64,
            size: bytes.len() as u64,
            frames,
            synced_len: offset as u64,
            named: true,
            sync_files: Vec::new(),
            recycled: false,
        });
    }
    state.synced_through = state.next_sequence - 1;
    if !state.sealed.is_empty() {
        state.sealed_writes = Some(Arc::new(writes));
    }
    Ok(state)
}

/// Cuts the newest log file at `path`, read into `bytes`, off at `offset`
/// durably; logged when what is cut is a torn frame (`torn`: why).
fn cut_off(
    file: &File,
    path: &Path,
    bytes: &mut Vec<u8>,
    offset: usize,
    torn: Option<&str>,
) -> Result<(), RecordLogError> {
    if let Some(reason) = torn {
        tracing::warn!(
            event = "wal_torn_tail_truncated",
            path = %path.display(),
            offset,
            cut_bytes = bytes.len() - offset,
            reason,
            "the log ended in a torn frame (a crash mid-append, never acknowledged); cut off"
        );
    }
    file.set_len(offset as u64).map_err(log_error(path))?;
    file.sync_data().map_err(log_error(path))?;
    bytes.truncate(offset);
    Ok(())
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, state: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed
            .wait(state)
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn records(&self) -> TableDefinition<'static, &'static str, &'static [u8]> {
        TableDefinition::new(self.layout.records)
    }

    fn groups(&self) -> TableDefinition<'static, &'static str, &'static [u8]> {
        TableDefinition::new(self.layout.groups)
    }

    fn fold_error(&self, message: &str) -> RecordLogError {
        RecordLogError::Fold {
            path: self.path.clone(),
            message: message.to_owned(),
        }
    }

    /// Writes `records` as the next frame: an [`Appended`] to sync, or
    /// for an `abort` the frame synced and cut off again (`None`).
    fn write<'a>(
        self: &Arc<Self>,
        records: impl IntoIterator<Item = Write<'a>>,
        abort: bool,
    ) -> Result<Option<Appended>, RecordLogError> {
        // The frame with room for its header, filled in under the lock
        // once the sequence number is known.
        let mut frame = vec![0; FRAME_HEADER];
        encode_records(&mut frame, records)?;
        let length =
            u32::try_from(frame.len() - FRAME_HEADER).map_err(|_| RecordLogError::TooLarge {
                bytes: frame.len() - FRAME_HEADER,
            })?;
        let mut state = self.wait_for_fold_lag(self.lock());
        // Beyond the bound (for an abort, which cuts its own frame off
        // again: any), and before a full file is sealed, the frames in
        // flight are made durable here; their own syncs then find them so.
        let in_flight_max = if abort { 1 } else { COMMITS_IN_FLIGHT_MAX };
        let full = state.full(self.layout.log_commits);
        if state.unsynced() >= in_flight_max || full {
            self.sync_in_flight(&mut state)?;
        } else if state.broken {
            return Err(RecordLogError::Broken {
                path: self.path.clone(),
            });
        }
        if full {
            state.seal();
            self.changed.notify_all();
        }
        let sequence = state.next_sequence;
        let crc = frame_crc(length, sequence, &frame[FRAME_HEADER..]);
        frame[..4].copy_from_slice(&length.to_le_bytes());
        frame[4..8].copy_from_slice(&crc.to_le_bytes());
        frame[8..FRAME_HEADER].copy_from_slice(&sequence.to_le_bytes());
        frame.extend_from_slice(&END_MARK);
        let (start, sync_file) = self.append(&mut state, &frame)?;
        frame.truncate(frame.len() - END_MARK.len());
        let Some(segment) = state.newest.as_mut() else {
            unreachable!("append leaves a newest log file");
        };
        let name_directory = !segment.named;
        if abort {
            let synced = sync_log_file(&sync_file, &self.path, !name_directory);
            let error = synced.err().map(log_error(&segment.path));
            self.undo_append(&mut state, start);
            return error.map_or(Ok(None), Err);
        }
        let end = start + frame.len() as u64;
        segment.len = end;
        segment.frames += 1;
        let generation = segment.generation;
        state.next_sequence += 1;
        let State { fresh, .. } = &mut *state;
        let payload = &frame[FRAME_HEADER..];
        replay(payload, |key, value| {
            let logged = value.map(|value| Logged::of(generation, start, payload, value));
            apply(fresh, key, logged);
            Ok(())
        })
        .unwrap_or_else(|_| unreachable!("a payload this process encoded replays"));
        Ok(Some(Appended {
            shared: Arc::clone(self),
            sequence,
            generation,
            start,
            end,
            file: Some(sync_file),
            name_directory,
        }))
    }

    /// Makes every frame appended so far durable (their own syncs, still
    /// in flight, then find them so), through the writer's file
    /// description: the only one no commit's sync uses, so it reports every
    /// failed writeback of the file at least once. Fails if the store is
    /// broken, or breaks it.
    fn sync_in_flight(&self, state: &mut State) -> Result<(), RecordLogError> {
        if state.broken {
            return Err(RecordLogError::Broken {
                path: self.path.clone(),
            });
        }
        if state.unsynced() == 0 {
            return Ok(());
        }
        let Some(newest) = state.newest.as_mut() else {
            unreachable!("frames in flight are in the newest log file");
        };
        let synced = sync_log_file(&newest.file, &self.path, newest.named);
        if let Err(source) = synced {
            let error = log_error(&newest.path)(source);
            let (generation, start) = (newest.generation, newest.synced_len);
            tracing::error!(
                event = "wal_sync_failed",
                path = %newest.path.display(),
                %error,
                "a log file's fdatasync failed; the store takes no more commits until reopened"
            );
            self.break_at(state, generation, start);
            return Err(error);
        }
        newest.named = true;
        newest.synced_len = newest.len;
        state.synced_through = state.next_sequence - 1;
        self.changed.notify_all();
        Ok(())
    }

    /// Waits while a fold runs and the newest file holds
    /// [`FOLD_LAG_FILES`] × `log_commits` frames or more (see the module
    /// documentation); returns at once if the last fold failed.
    fn wait_for_fold_lag<'s>(&self, mut state: MutexGuard<'s, State>) -> MutexGuard<'s, State> {
        let lag_max = self.layout.log_commits.saturating_mul(FOLD_LAG_FILES);
        let behind = |state: &State| {
            !state.stop
                && state.sealed_writes.is_some()
                && state.fold_failure.is_none()
                && state
                    .newest
                    .as_ref()
                    .is_some_and(|newest| newest.frames >= lag_max)
        };
        if !behind(&state) {
            return state;
        }
        if !state.lag_logged {
            state.lag_logged = true;
            tracing::warn!(
                event = "commits_wait_for_fold",
                path = %self.path.display(),
                frames = state.frames(),
                "the fold fell behind the commits; commits wait until it ends"
            );
        }
        state.commits_waiting += 1;
        while behind(&state) {
            state = self.wait(state);
        }
        state.commits_waiting -= 1;
        state
    }

    /// Writes `frame` (its end mark included: the last [`FRAME_HEADER`]
    /// bytes, written in a recycled file only) after the last frame of
    /// the newest log file (made of the spare, or created, if there is
    /// none), not synced: returns where it begins, and a file
    /// description to sync it through. On failure, cuts the frame off
    /// again.
    fn append(&self, state: &mut State, frame: &[u8]) -> Result<(u64, File), RecordLogError> {
        if state.newest.is_none() {
            let generation = state.next_generation;
            let path = segment_path(&self.path, generation);
            // A spare that cannot be renamed is left; the next fold's
            // replaces it, the next open deletes it.
            let spare = state
                .spare
                .take()
                .filter(|spare| std::fs::rename(&spare.path, &path).is_ok());
            let (file, size, recycled) = match spare {
                Some(spare) => (spare.file, spare.size, true),
                None => (
                    OpenOptions::new()
                        .read(true)
                        .write(true)
                        .create_new(true)
                        .mode(FILE_MODE)
                        .open(&path)
                        .map_err(file_error(&path))?,
                    0,
                    false,
                ),
            };
            state.next_generation += 1;
            state.newest = Some(Segment {
                generation,
                path,
                file,
                len: 0,
                size,
                frames: 0,
                synced_len: 0,
                named: false,
                sync_files: Vec::new(),
                recycled,
            });
        }
        let Some(segment) = state.newest.as_mut() else {
            unreachable!("the newest log file was just created");
        };
        let sync_file = match segment.sync_files.pop() {
            Some(file) => file,
            None => File::open(&segment.path).map_err(log_error(&segment.path))?,
        };
        // Past a frame in a recycled file lie its earlier frames: the end
        // mark goes too. Elsewhere zeros (or nothing) lie there already.
        let frame = if segment.recycled {
            frame
        } else {
            &frame[..frame.len() - END_MARK.len()]
        };
        let start = segment.len;
        let end = start + frame.len() as u64;
        let written = segment.file.write_all_at(frame, start).map(|()| {
            // Past the zeros written ahead: write more behind the frame. They
            // only save later commits time, so a failure to write them (a
            // full disk) fails nothing: whatever was written is zeros.
            if end > segment.size {
                let ahead = self.layout.preallocate_bytes;
                segment.size = match write_zeros_at(&segment.file, end, ahead) {
                    Ok(()) => end + ahead,
                    Err(_) => end,
                };
            }
        });
        if let Err(source) = written {
            let error = log_error(&segment.path)(source);
            self.undo_append(state, start);
            return Err(error);
        }
        Ok((start, sync_file))
    }

    /// Breaks the store after the frame at `start` of log file
    /// `generation` failed to become durable: the newest file is cut off
    /// there (the frames after it were never acknowledged either), or
    /// where its durable frames end if that is later.
    fn break_at(&self, state: &mut State, generation: u64, start: u64) {
        if let Some(newest) = state.newest.as_ref()
            && newest.generation == generation
        {
            let cut = start.max(newest.synced_len);
            if cut < newest.size {
                self.undo_append(state, cut);
            }
        }
        state.broken = true;
        self.changed.notify_all();
    }

    /// Cuts the newest log file back to `start` (where a failed frame
    /// began; the zeros written ahead go too) and makes that durable; if
    /// that fails the store is broken.
    fn undo_append(&self, state: &mut State, start: u64) {
        let Some(segment) = state.newest.as_mut() else {
            return;
        };
        segment.size = start;
        let undone = segment
            .file
            .set_len(start)
            .and_then(|()| segment.file.sync_data());
        if let Err(error) = undone {
            tracing::error!(
                event = "wal_append_undo_failed",
                path = %segment.path.display(),
                %error,
                "a failed append could not be cut off; the store takes no more commits until reopened"
            );
            state.broken = true;
        }
    }

    /// The folder: folds whatever is sealed, until the store is dropped.
    fn run_folder(&self) {
        // The fold is background work: it takes the CPU that the service's
        // request threads leave. At normal priority its bursts (100-200 ms
        // of redb inserts per sealed file) delayed the agent's answers on a
        // two-core machine: at 128 in flight, nice 19 raised the emergency
        // path from 20-28k to 30-32k requests/s and cut its p99 from 13-17
        // to 11 ms (docs/benchmarks-history.md). Lowering one's own priority needs no
        // privilege; if it fails anyway the fold runs at normal priority.
        if let Err(error) = thread_priority::set_current_thread_priority(ThreadPriority::Min) {
            tracing::warn!(
                event = "fold_priority_unchanged",
                path = %self.path.display(),
                error = ?error,
                "the folder thread runs at normal priority"
            );
        }
        loop {
            let (writes, files, generation, sequence) = {
                let mut state = self.lock();
                loop {
                    if state.stop {
                        return;
                    }
                    if !state.folds_held
                        && state.sealed_writes.is_some()
                        && state.fold_failure.is_none()
                    {
                        break;
                    }
                    state = self.wait(state);
                }
                let Some(writes) = state.sealed_writes.clone() else {
                    unreachable!("checked above");
                };
                state.folding = true;
                let files = LogFiles::of(&self.path, &state.sealed);
                let generation = state.sealed.last().map_or(0, |last| last.generation);
                let first = state.newest.as_ref().map_or(state.next_sequence, |newest| {
                    state.next_sequence - newest.frames
                });
                (writes, files, generation, first - 1)
            };
            // A panic in the fold (a bug here or in redb) is a failed fold:
            // the thread lives on to retry, and `checkpoint` returns the
            // failure. Uncaught, it ended the thread and left `checkpoint`
            // waiting for a fold that never came.
            let folded = std::panic::catch_unwind(AssertUnwindSafe(|| {
                #[cfg(test)]
                if std::mem::take(&mut self.lock().panic_in_next_fold) {
                    panic!("a panic the test asked for");
                }
                files.and_then(|files| self.fold(&writes, &files, generation, sequence))
            }))
            .unwrap_or_else(|panic| {
                Err(RecordLogError::FoldPanicked {
                    message: panic_message(panic.as_ref()),
                })
            });
            match folded {
                Ok(()) => {
                    // Deleted before the fold counts as ended, so that no
                    // seal starts a third file meanwhile. The sealed files
                    // change only when a fold ends, which is here.
                    let (mut paths, recycle): (Vec<PathBuf>, bool) = {
                        let state = self.lock();
                        let paths = state
                            .sealed
                            .iter()
                            .map(|segment| segment.path.clone())
                            .collect();
                        let recycle = self.layout.preallocate_bytes > 0 && state.spare.is_none();
                        (paths, recycle)
                    };
                    if recycle && let Some(last) = paths.pop() {
                        match self.recycle(&last) {
                            Ok(spare) => self.lock().spare = Some(spare),
                            Err(error) => {
                                tracing::warn!(
                                    event = "wal_recycle_failed",
                                    path = %last.display(),
                                    %error,
                                    "a folded log file could not be kept for reuse; it is deleted"
                                );
                                paths.push(last);
                            }
                        }
                    }
                    for path in paths {
                        // A file left behind is deleted at the next open:
                        // the table records it as folded.
                        if let Err(error) = std::fs::remove_file(&path) {
                            tracing::warn!(
                                event = "wal_delete_failed",
                                path = %path.display(),
                                %error,
                                "a folded log file could not be deleted; the next open deletes it"
                            );
                        }
                    }
                    let mut state = self.lock();
                    state.sealed.clear();
                    state.sealed_writes = None;
                    state.folding = false;
                    state.folds += 1;
                    state.lag_logged = false;
                    self.changed.notify_all();
                }
                Err(error) => {
                    tracing::error!(
                        event = "fold_failed",
                        path = %self.path.display(),
                        %error,
                        retry_in_s = FOLD_RETRY.as_secs_f64(),
                        "folding the log into the table failed; commits go on into the log"
                    );
                    let mut state = self.lock();
                    state.folding = false;
                    state.fold_failure = Some(error.to_string());
                    self.changed.notify_all();
                    if !state.stop {
                        state = self
                            .changed
                            .wait_timeout(state, FOLD_RETRY)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                    state.fold_failure = None;
                }
            }
        }
    }

    /// Keeps the folded log file at `path` as the spare ([`Spare`]): an
    /// end mark written at its start and made durable, then renamed.
    fn recycle(&self, path: &Path) -> std::io::Result<Spare> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        file.write_all_at(&END_MARK, 0)?;
        file.sync_data()?;
        let size = file.metadata()?.len();
        let spare = spare_path(&self.path);
        std::fs::rename(path, &spare)?;
        Ok(Spare {
            path: spare,
            file,
            size,
        })
    }

    /// Writes `writes` (their values read from `files`) into the table, in
    /// key order, and records the log files up to `generation` (frames up
    /// to `sequence`) as folded, in one durable transaction.
    fn fold(
        &self,
        writes: &Writes,
        files: &LogFiles,
        generation: u64,
        sequence: u64,
    ) -> Result<(), RecordLogError> {
        let mut transaction = self.db.begin_write().map_err(redb_error)?;
        transaction
            .set_durability(Durability::Immediate)
            .map_err(redb_error)?;
        {
            let mut table = transaction.open_table(self.records()).map_err(redb_error)?;
            let mut groups = transaction.open_table(self.groups()).map_err(redb_error)?;
            // The writes come in key order, so a group's come together
            // (a group's name is a prefix of its keys): each group is
            // read and written once (once per run of its writes, where
            // another group's keys lie between its own).
            let mut group = GroupWrites::default();
            files.read_in_batches(writes, |key, value| {
                let Some((name, member)) = split_group(self.layout.group, key) else {
                    return match value {
                        Some(value) => table.insert(key, value).map(drop),
                        None => table.remove(key).map(drop),
                    }
                    .map_err(redb_error);
                };
                group.add(&mut groups, &self.path, name, member, value)
            })?;
            group.write(&mut groups, &self.path)?;
            let mut meta = transaction.open_table(META).map_err(redb_error)?;
            meta.insert(FOLDED_GENERATION, generation)
                .map_err(redb_error)?;
            meta.insert(FOLDED_SEQUENCE, sequence).map_err(redb_error)?;
        }
        transaction.commit().map_err(redb_error)
    }
}

/// The group `key` is kept in and the key's rest after the group's name
/// (its name in the group), if [`Layout::group`] puts it in one.
fn split_group(group: fn(&str) -> Option<&str>, key: &str) -> Option<(&str, &str)> {
    let name = group(key)?;
    Some((name, key.strip_prefix(name)?))
}

/// A fold's writes into one group, collected in key order.
#[derive(Default)]
struct GroupWrites {
    name: String,
    /// The writes, encoded as a payload is: each key its name in the
    /// group, deletions included.
    writes: Vec<u8>,
    /// The group's new value; kept for its room.
    merged: Vec<u8>,
}

impl GroupWrites {
    /// Collects the write of `member` (its key's rest after the group's
    /// name) in group `name`, first writing the group collected so far if
    /// `name` is another. Writes come in key order.
    fn add(
        &mut self,
        groups: &mut redb::Table<&str, &[u8]>,
        path: &Path,
        name: &str,
        member: &str,
        value: Option<&[u8]>,
    ) -> Result<(), RecordLogError> {
        if self.name != name {
            self.write(groups, path)?;
            name.clone_into(&mut self.name);
        }
        encode_records(&mut self.writes, [(member, value)])
    }

    /// Merges the writes collected into the group's stored records (one
    /// `get`, one `insert`; a group left empty is removed) and clears them.
    fn write(
        &mut self,
        groups: &mut redb::Table<&str, &[u8]>,
        path: &Path,
    ) -> Result<(), RecordLogError> {
        if self.writes.is_empty() {
            return Ok(());
        }
        let name = self.name.as_str();
        // Copied: the table is written below.
        let stored = groups
            .get(name)
            .map_err(redb_error)?
            .map(|value| value.value().to_vec());
        self.merged.clear();
        merge_group(
            stored.as_deref().unwrap_or_default(),
            &self.writes,
            &mut self.merged,
        )
        .map_err(damaged_group(path, name))?;
        if self.merged.is_empty() {
            groups.remove(name).map_err(redb_error)?;
        } else {
            groups
                .insert(name, self.merged.as_slice())
                .map_err(redb_error)?;
        }
        self.writes.clear();
        Ok(())
    }
}

/// The records of a group's value, in key order (their names in the
/// group), or why it is damaged.
fn records_of_group(value: &[u8]) -> Result<Vec<(&str, &[u8])>, &'static str> {
    let mut records = Vec::new();
    let mut deletions = false;
    replay(value, |member, value| {
        match value {
            Some(value) => records.push((member, value)),
            None => deletions = true,
        }
        Ok(())
    })
    .map_err(|error| match error {
        Replay::Damaged(reason) => reason,
        Replay::Write(_) => unreachable!("the callback never fails"),
    })?;
    if deletions {
        return Err("a group holds a deletion");
    }
    Ok(records)
}

/// Writes into `out` the group whose stored value is `stored` (empty: a
/// new group) after `writes` (a payload of writes in key order, each key
/// once): both merged in key order, the later write winning, deletions
/// dropped.
fn merge_group(stored: &[u8], writes: &[u8], out: &mut Vec<u8>) -> Result<(), &'static str> {
    let stored = records_of_group(stored)?;
    let mut new = Vec::new();
    replay(writes, |member, value| {
        new.push((member, value));
        Ok(())
    })
    .map_err(|_| "a fold's writes do not replay")?;
    debug_assert!(new.is_sorted_by(|a, b| a.0 < b.0), "writes in key order");
    let (mut stored, mut new) = (stored.into_iter().peekable(), new.into_iter().peekable());
    let mut keep = |member: &str, value: &[u8]| encode_records(out, [(member, Some(value))]);
    loop {
        let next = match (stored.peek(), new.peek()) {
            (None, None) => return Ok(()),
            (Some(_), None) => stored.next().map(|(member, value)| (member, Some(value))),
            (Some((old, _)), Some((member, _))) if old < member => {
                stored.next().map(|(member, value)| (member, Some(value)))
            }
            (Some((old, _)), Some((member, _))) => {
                if old == member {
                    stored.next();
                }
                new.next()
            }
            (None, Some(_)) => new.next(),
        };
        if let Some((member, Some(value))) = next {
            keep(member, value).map_err(|_| "a group does not fit one value")?;
        }
    }
}

/// What a caught panic said (its payload, when it is a string).
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|message| (*message).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Why replaying a payload stopped.
enum Replay {
    /// The payload is not a valid sequence of records.
    Damaged(&'static str),
    /// The callback failed.
    Write(RecordLogError),
}

impl Replay {
    /// The store's error for a replay of log entry `sequence` of `path`.
    fn at(self, path: &Path, sequence: u64) -> RecordLogError {
        match self {
            Self::Damaged(reason) => RecordLogError::Damaged {
                path: path.to_owned(),
                sequence,
                reason,
            },
            Self::Write(error) => error,
        }
    }
}

impl From<RecordLogError> for Replay {
    fn from(error: RecordLogError) -> Self {
        Self::Write(error)
    }
}

/// Hands each write of one payload, in order, to `write`: its key and its
/// value.
fn replay<'f>(
    payload: &'f [u8],
    mut write: impl FnMut(&'f str, Option<&'f [u8]>) -> Result<(), RecordLogError>,
) -> Result<(), Replay> {
    let mut rest = payload;
    while !rest.is_empty() {
        let key = split_field(&mut rest)
            .flatten()
            .ok_or(Replay::Damaged("a key is cut short"))?;
        let value = split_field(&mut rest).ok_or(Replay::Damaged("a record is cut short"))?;
        let key = std::str::from_utf8(key).map_err(|_| Replay::Damaged("a key is not UTF-8"))?;
        write(key, value)?;
    }
    Ok(())
}

fn field_length(field: &[u8]) -> Result<u32, RecordLogError> {
    u32::try_from(field.len())
        .ok()
        .filter(|length| *length < DELETED)
        .ok_or(RecordLogError::TooLarge { bytes: field.len() })
}

/// Appends one commit's payload to `out`: for each write, its key and its
/// value, each preceded by its length as a little-endian `u32`; a
/// deletion has the length [`DELETED`] and no value.
fn encode_records<'a>(
    out: &mut Vec<u8>,
    records: impl IntoIterator<Item = Write<'a>>,
) -> Result<(), RecordLogError> {
    for (key, value) in records {
        out.extend_from_slice(&field_length(key.as_bytes())?.to_le_bytes());
        out.extend_from_slice(key.as_bytes());
        match value {
            Some(value) => {
                out.extend_from_slice(&field_length(value)?.to_le_bytes());
                out.extend_from_slice(value);
            }
            None => out.extend_from_slice(&DELETED.to_le_bytes()),
        }
    }
    Ok(())
}

/// Splits one length-prefixed field off the front of `bytes`: `Some(None)`
/// for a deletion mark, `None` if the field is cut short.
fn split_field<'a>(bytes: &mut &'a [u8]) -> Option<Option<&'a [u8]>> {
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
    let (field, rest) = rest.split_at(length);
    *bytes = rest;
    Some(Some(field))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::{Layout, RecordLog, RecordLogError};

    const LAYOUT: Layout = Layout {
        records: "records",
        log: "records-log",
        log_commits: 4,
        cache_bytes: 1 << 20,
        preallocate_bytes: 0,
        groups: "records-groups",
        group: super::ungrouped,
    };

    /// Sixteen consecutive ordinals share a group, the seventeenth starts
    /// the next; keys of another shape stay alone.
    #[test]
    fn an_ordinal_group_holds_sixteen_consecutive_ordinals() {
        let group = |key| super::ordinal_group(key, "r/");
        assert_eq!(group("r/000000000000000f/a"), Some("r/000000000000000"));
        assert_eq!(group("r/0000000000000000"), Some("r/000000000000000"));
        assert_eq!(group("r/0000000000000010/a"), Some("r/000000000000001"));
        assert_eq!(group("r/ffffffffffffffff/b/c"), Some("r/fffffffffffffff"));
        for alone in [
            "r/000000000000000",
            "r/000000000000000F/a",
            "s/0000000000000000/a",
            "r/",
        ] {
            assert_eq!(group(alone), None, "{alone}");
        }
    }

    /// A full file is sealed once its frames are durable, and not before:
    /// a fold must never read a frame whose sync may still fail.
    #[test]
    fn a_full_log_file_is_sealed_by_the_sync_that_makes_its_last_frame_durable() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let layout = Layout {
            log_commits: 1,
            ..LAYOUT
        };
        let store = RecordLog::open(&dir.path().join("store.redb"), layout).expect("open");
        store.hold_folds(true);
        let appended = store.append([("a", Some(&[1][..]))]).expect("append");
        {
            let state = store.shared.lock();
            assert!(state.sealed_writes.is_none());
            assert!(!state.may_seal(1), "the file's frame is in flight");
        }
        appended.sync().expect("sync");
        let state = store.shared.lock();
        assert!(
            state.sealed_writes.is_some() && state.newest.is_none(),
            "sealed by the sync: {state:?}"
        );
    }

    /// An append beyond `COMMITS_IN_FLIGHT_MAX` makes the frames in flight
    /// durable first; their own syncs then find them so.
    #[test]
    fn an_append_beyond_the_bound_makes_the_frames_in_flight_durable() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let store = RecordLog::open(&dir.path().join("store.redb"), LAYOUT).expect("open");
        let in_flight: Vec<_> = (0..super::COMMITS_IN_FLIGHT_MAX)
            .map(|i| {
                let key = format!("key-{i}");
                store
                    .append([(key.as_str(), Some(&[1][..]))])
                    .expect("append")
            })
            .collect();
        assert_eq!(store.shared.lock().unsynced(), super::COMMITS_IN_FLIGHT_MAX);
        let beyond = store.append([("beyond", Some(&[2][..]))]).expect("append");
        assert_eq!(
            store.shared.lock().unsynced(),
            1,
            "only the last one in flight"
        );
        for appended in in_flight {
            appended.sync().expect("sync");
        }
        beyond.sync().expect("sync");
        assert_eq!(store.shared.lock().unsynced(), 0);
        assert_eq!(
            store.load().expect("load").len() as u64,
            super::COMMITS_IN_FLIGHT_MAX + 1
        );
    }

    #[test]
    fn a_panic_in_the_fold_is_a_failed_fold_and_the_log_keeps_every_commit() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("store.redb");
        let store = RecordLog::open(&path, LAYOUT).expect("open");
        for i in 0..10u8 {
            let key = format!("key-{i}");
            store
                .commit([(key.as_str(), Some(&[i][..]))])
                .expect("commit");
        }
        store.checkpoint().expect("a fold without a panic");
        store.shared.lock().panic_in_next_fold = true;
        store.commit([("key-10", Some(&[10][..]))]).expect("commit");
        // Before, the folder thread died of the panic and this waited for
        // a fold that never came.
        match store.checkpoint() {
            Err(RecordLogError::Fold { message, .. }) => assert!(
                message.contains("the fold panicked: a panic the test asked for"),
                "{message}"
            ),
            other => panic!("checkpoint after a panicking fold: {other:?}"),
        }
        store
            .commit([("key-11", Some(&[11][..]))])
            .expect("commits go on");
        let expected: BTreeMap<String, Vec<u8>> =
            (0..12u8).map(|i| (format!("key-{i}"), vec![i])).collect();
        assert_eq!(store.load().expect("load"), expected);
        drop(store);
        let reopened = RecordLog::open(&path, LAYOUT).expect("reopen");
        reopened.checkpoint().expect("the reopened store folds");
        assert_eq!(reopened.log_len(), 0, "every commit folded");
        assert_eq!(reopened.load().expect("load"), expected);
    }
}
