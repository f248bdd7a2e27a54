//! [`Journal`]: the agent's durable record of everything the core asked to
//! persist, in one redb file — a [`record_log::RecordLog`] of records
//! (MessagePack, [`record_log::value`]; a reservation's record in the
//! compact form of [`compact`]) under a string encoding of their
//! [`JournalKey`] (see "Keys in the order reservations came").
//!
//! # Contract
//!
//! - [`Journal::commit`] writes every record of every batch given in **one**
//!   durable commit (one log frame, one `fdatasync`): when it returns `Ok`
//!   the records are on disk; on `Err` nothing of any batch is stored. A later record with the same
//!   [`JournalKey`] replaces an earlier one, within a call and across calls;
//!   a [`JournalRecord::Forget`] deletes its key (a later record under the
//!   key stores it again).
//! - [`Journal::append`] and [`AppendedBatches::sync`] are the two halves
//!   of a commit, for the daemon's [`COMMITS_IN_FLIGHT_MAX`] commits in
//!   flight: the daemon takes a [`Turn`] per commit in the order the core
//!   made the batches, and each append waits for the turns before it, so
//!   the frames follow that order whichever committer thread runs first; a
//!   sync returns `Ok` once its commit and every earlier one are durable.
//! - [`Journal::load`] returns the latest record of every key, in key order,
//!   for [`agent_core::AgentCore::recover`].
//! - One process per file: a second open of the same file fails.
//!
//! # Keys in the order reservations came
//!
//! A reservation's record (with its holds, see
//! [`JournalRecord::ReservationWithHolds`]) is stored under
//! `reservations/{ordinal}/{id}`, the ordinal (16 hex digits) given at the
//! reservation's first write and counting up. Journals written before
//! holds joined their reservation's record stored each hold under
//! `reservations/{ordinal}/{id}/shard/{shard}`: still read, and deleted
//! when the reservation is next written or forgotten.
//!
//! Reservation IDs are hashes: keyed by ID, each reservation a fold wrote
//! landed in a B-tree leaf of its own, so a fold of a few thousand keys
//! rewrote a few thousand 4 KiB pages spread over the whole table (redb's
//! leaves hold about five records). Keyed in
//! the order they came, the reservations a fold writes — the newest — are
//! neighbours, and share leaves: at 32 and 128 requests in flight on the
//! emergency path, 40-50 % fewer bytes written per commit, 10-30 % less
//! agent CPU per answer and a journal file half the size (docs/benchmarks-history.md).
//! The journal keeps each stored reservation's ordinal in memory
//! (`Places`, about 55 bytes a reservation), read from the keys at open,
//! to find its keys again.
//!
//! A journal written before a key's encoding changed is rewritten under
//! the current encoding when it is opened ([`Journal::open`]), in commits
//! of `REKEY_CHUNK` records, so that a later record replaces the earlier
//! one under the key both now share.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use agent_core::{JournalBatch, JournalKey, JournalRecord};
use ledger::IdMap;
use record_log::value::{self, DecodeError};
use record_log::{Appended, Layout, RecordLog, RecordLogError};
use shard_format::{ReservationId, ShardId};

pub use record_log::COMMITS_IN_FLIGHT_MAX;

mod compact;

/// The journal's tables; a commit appends one frame to the write-ahead log,
/// and every 256 commits the log file is folded into the keyed table on the
/// store's own thread.
pub const LAYOUT: Layout = Layout {
    records: "journal",
    log: "journal-log",
    log_commits: 256,
    // The journal is read once, at start; a small cache keeps the agent's
    // memory to its open reservations (64 MiB of cache was a quarter of
    // its RSS with 100,000 open). 2 MiB: with a reservation's records in
    // groups, the fold reads one value per sixteen reservations, and 8
    // MiB held about 8.6 MiB more RSS there for no CPU per answer that
    // alternated runs could tell apart (docs/benchmarks-history.md). Before groups, 4
    // MiB cost the healthy path 10-15 % more CPU per answer.
    cache_bytes: 2 << 20,
    preallocate_bytes: record_log::PREALLOCATE_BYTES,
    groups: "journal-groups",
    group: reservation_group,
};

/// The group a record is kept in: a reservation's records go in the group
/// of sixteen consecutive ordinals ([`record_log::ordinal_group`]), which
/// a fold writes as one value. One insert per record was most of the
/// fold's cost, and so of the p99 it adds to the requests beside it
/// (docs/benchmarks-history.md).
fn reservation_group(key: &str) -> Option<&str> {
    record_log::ordinal_group(key, RESERVATIONS)
}

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
    /// A stored key under `reservations/` is not one this journal writes.
    #[error(
        "journal key {key} is not a reservation key (reservations/<ordinal>/<id>[/shard/<shard>])"
    )]
    UnreadableKey { key: String },
    /// An append taken before this one failed: this one would follow a
    /// gap, so it is not written (restart: the journal is the truth).
    #[error("an earlier journal append failed; later ones are refused until restart")]
    EarlierAppendFailed,
}

/// The prefix of every key of a reservation's records (see "Keys in the
/// order reservations came").
const RESERVATIONS: &str = "reservations/";

/// The stored key of a reservation's record (`shard`: of its record in
/// that shard's book).
fn reservation_key(ordinal: u64, id: &ReservationId, shard: Option<&ShardId>) -> String {
    use std::fmt::Write as _;
    // Sized up front (`format!` grew it as it wrote, at every record of
    // every commit): the prefix, 16 hex digits, a slash, the ID.
    let shard_len = shard.map_or(0, |shard| "/shard/".len() + shard.as_str().len());
    let mut key =
        String::with_capacity(RESERVATIONS.len() + 16 + 1 + id.as_str().len() + shard_len);
    let _ = write!(key, "{RESERVATIONS}{ordinal:016x}/{id}");
    if let Some(shard) = shard {
        let _ = write!(key, "/shard/{shard}");
    }
    key
}

/// The ordinal, reservation and shard of a key [`reservation_key`] made:
/// only a key it makes again from them byte for byte (an ordinal of
/// upper-case digits, say, would name another key than the one stored).
fn parse_reservation_key(key: &str) -> Option<(u64, ReservationId, Option<ShardId>)> {
    let mut parts = key.strip_prefix(RESERVATIONS)?.split('/');
    let ordinal = u64::from_str_radix(parts.next()?, 16).ok()?;
    let id = ReservationId::new(parts.next()?).ok()?;
    let shard = match (parts.next(), parts.next()) {
        (None, _) => None,
        (Some("shard"), Some(shard)) => Some(ShardId::new(shard).ok()?),
        _ => return None,
    };
    (reservation_key(ordinal, &id, shard.as_ref()) == key).then_some((ordinal, id, shard))
}

/// Key prefixes no longer written: a reservation's records were keyed by
/// its ID alone (`reservation/{id}`, `reservation/{id}/shard/{shard}`),
/// and before that a shard's reservation by the shard
/// (`shard-reservation/{shard}/{id}`).
const RETIRED_KEY_PREFIXES: &[&str] = &["shard-reservation/", "reservation/"];

/// How many records [`Journal::rekey`] moves in one commit: a journal
/// of millions of records would not fit in one log frame (4 GiB). A crash
/// between two of them is safe: the next open finds the moved records
/// under their ordinals and moves the rest.
const REKEY_CHUNK: usize = 4096;

/// What a record does to its key: store a value, or (a
/// [`JournalRecord::Forget`]) delete it.
type Stored = Option<Vec<u8>>;

/// Every stored reservation's ordinal and stored records.
#[derive(Debug, Default)]
struct Places {
    /// The ordinal of the next reservation new to the journal.
    next_ordinal: u64,
    /// The ordinal of every reservation with a record stored: one word
    /// beside its ID, for every reservation the journal holds (100,000
    /// open ones are 100,000 entries; a whole [`Place`] in each took 24
    /// bytes more a slot).
    ordinals: IdMap<ReservationId, u64>,
    /// The reservations with a hold stored under a key of its own, as
    /// journals did before holds joined their reservation's record: empty
    /// in a journal written since. A reservation in `ordinals` and not here
    /// has its own record stored and nothing else.
    legacy: IdMap<ReservationId, LegacyPlace>,
}

/// What a journal written before holds joined their reservation's record
/// stores of one reservation besides its ordinal.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LegacyPlace {
    /// Whether the reservation's own record is stored.
    reservation: bool,
    /// The shards whose book holds a record of it under a key of its own.
    holds: Vec<ShardId>,
}

/// A reservation's place as a commit changes it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Place {
    ordinal: u64,
    /// Whether the reservation's own record is stored.
    reservation: bool,
    /// The shards whose book holds a record of it stored under a key of
    /// its own ([`LegacyPlace::holds`]).
    legacy_holds: Vec<ShardId>,
}

impl Place {
    fn is_empty(&self) -> bool {
        !self.reservation && self.legacy_holds.is_empty()
    }

    fn add_legacy_hold(&mut self, shard: &ShardId) {
        if !self.legacy_holds.contains(shard) {
            self.legacy_holds.push(shard.clone());
        }
    }

    fn remove_legacy_hold(&mut self, shard: &ShardId) {
        self.legacy_holds.retain(|kept| kept != shard);
    }
}

impl Places {
    /// The places of the stored reservation keys `keys`.
    fn from_keys(keys: Vec<String>) -> Result<Self, JournalError> {
        let mut read: IdMap<ReservationId, Place> = IdMap::default();
        let mut places = Self::default();
        for key in keys {
            let Some((ordinal, id, shard)) = parse_reservation_key(&key) else {
                return Err(JournalError::UnreadableKey { key });
            };
            let place = read.entry(id).or_insert_with(|| Place {
                ordinal,
                ..Place::default()
            });
            if place.ordinal != ordinal {
                // One reservation under two ordinals: the keys were not
                // written by this journal.
                return Err(JournalError::UnreadableKey { key });
            }
            match shard {
                None => place.reservation = true,
                Some(shard) => place.add_legacy_hold(&shard),
            }
            places.next_ordinal = places.next_ordinal.max(ordinal + 1);
        }
        places.ordinals.reserve(read.len());
        for (id, place) in read {
            places.put(id, place);
        }
        Ok(places)
    }

    fn contains(&self, id: &ReservationId) -> bool {
        self.ordinals.contains_key(id)
    }

    /// The place of `id`, if anything of it is stored.
    fn get(&self, id: &ReservationId) -> Option<Place> {
        let ordinal = *self.ordinals.get(id)?;
        Some(match self.legacy.get(id) {
            None => Place {
                ordinal,
                reservation: true,
                legacy_holds: Vec::new(),
            },
            Some(legacy) => Place {
                ordinal,
                reservation: legacy.reservation,
                legacy_holds: legacy.holds.clone(),
            },
        })
    }

    fn legacy_holds(&self, id: &ReservationId) -> &[ShardId] {
        self.legacy
            .get(id)
            .map_or(&[], |legacy| legacy.holds.as_slice())
    }

    /// Keeps `place` as the place of `id`; an empty one is forgotten.
    fn put(&mut self, id: ReservationId, place: Place) {
        if place.is_empty() {
            self.ordinals.remove(&id);
            self.legacy.remove(&id);
            return;
        }
        self.ordinals.insert(id.clone(), place.ordinal);
        if place.reservation && place.legacy_holds.is_empty() {
            self.legacy.remove(&id);
        } else {
            let legacy = LegacyPlace {
                reservation: place.reservation,
                holds: place.legacy_holds,
            };
            self.legacy.insert(id, legacy);
        }
    }

    /// Takes the changes of a commit that is durable.
    fn apply(&mut self, staged: Staged) {
        self.next_ordinal = staged.next_ordinal;
        for (id, place) in staged.changed {
            self.put(id, place);
        }
    }
}

/// The places a commit changes, kept aside until the commit is durable
/// (a failed commit changes nothing).
struct Staged {
    next_ordinal: u64,
    changed: IdMap<ReservationId, Place>,
}

impl Staged {
    fn new(places: &Places) -> Self {
        Self {
            next_ordinal: places.next_ordinal,
            changed: IdMap::default(),
        }
    }

    /// The key a record under `key` is stored under.
    fn written(&mut self, places: &Places, key: &JournalKey) -> String {
        match key {
            JournalKey::Reservation(id) => {
                let place = self.place(places, id);
                place.reservation = true;
                reservation_key(place.ordinal, id, None)
            }
            JournalKey::ShardReservation(shard, id) => {
                let place = self.place(places, id);
                place.add_legacy_hold(shard);
                reservation_key(place.ordinal, id, Some(shard))
            }
            JournalKey::Shard(id) => format!("shard/{id}"),
            JournalKey::ShardBook(id) => format!("shard-book/{id}"),
            JournalKey::Fence(pair) => format!("fence/{}/{}", pair.subject, pair.route),
            JournalKey::TerminalReceipt(id) => format!("terminal-receipt/{id}"),
        }
    }

    /// The stored key a forget of `key` deletes; `None` for a
    /// reservation's key that is not stored.
    fn deleted(&mut self, places: &Places, key: &JournalKey) -> Option<String> {
        let (id, shard) = match key {
            JournalKey::Reservation(id) => (id, None),
            JournalKey::ShardReservation(shard, id) => (id, Some(shard)),
            other => return Some(self.written(places, other)),
        };
        if !self.changed.contains_key(id) && !places.contains(id) {
            return None;
        }
        let place = self.place(places, id);
        match shard {
            None => place.reservation = false,
            Some(shard) => place.remove_legacy_hold(shard),
        }
        Some(reservation_key(place.ordinal, id, shard))
    }

    /// The place of `id` as this commit leaves it: a new ordinal for a
    /// reservation new to the journal.
    fn place(&mut self, places: &Places, id: &ReservationId) -> &mut Place {
        let next_ordinal = &mut self.next_ordinal;
        self.changed.entry(id.clone()).or_insert_with(|| {
            places.get(id).unwrap_or_else(|| {
                *next_ordinal += 1;
                Place {
                    ordinal: *next_ordinal - 1,
                    ..Place::default()
                }
            })
        })
    }
}

/// The agent's journal in one redb file. See the module documentation.
#[derive(Debug)]
pub struct Journal {
    store: RecordLog,
    places: Mutex<Places>,
    /// Turns handed out ([`Journal::turn`]).
    turns: AtomicU64,
    /// The appends done, in turn order.
    appends: Mutex<Appends>,
    /// Signalled when an append's turn ends.
    append_done: Condvar,
}

/// A place in the order of appends: a shell that commits from several
/// threads takes turns in the order the core made the batches, and each
/// append waits for the turns before its own.
#[derive(Debug)]
pub struct Turn(u64);

#[derive(Debug, Default)]
struct Appends {
    /// The turn whose append is next.
    next: u64,
    /// Set when an append failed: the turns after it are refused.
    failed: bool,
}

/// A commit appended to the journal, not yet durable
/// ([`Journal::append`]).
#[derive(Debug)]
pub struct AppendedBatches(Appended);

impl AppendedBatches {
    /// Makes the commit durable; `Ok` once it and every commit appended
    /// before it are on disk ([`Appended::sync`]).
    pub fn sync(self) -> Result<(), JournalError> {
        Ok(self.0.sync()?)
    }
}

/// Notifies the waiting appends when an append's turn ends, whether it
/// returned or panicked (then the turns after it see the lock poisoned).
struct NotifyOnDrop<'c>(&'c Condvar);

impl Drop for NotifyOnDrop<'_> {
    fn drop(&mut self) {
        self.0.notify_all();
    }
}

impl Journal {
    /// Opens (or creates) the journal at `path`, reads where its
    /// reservations' records are, and rewrites records stored under an
    /// earlier encoding of their key.
    pub fn open(path: &Path) -> Result<Self, JournalError> {
        let store = RecordLog::open(path, LAYOUT)?;
        let places = Places::from_keys(store.keys_under(RESERVATIONS)?)?;
        let journal = Self {
            store,
            places: Mutex::new(places),
            turns: AtomicU64::new(0),
            appends: Mutex::new(Appends::default()),
            append_done: Condvar::new(),
        };
        journal.rekey()?;
        Ok(journal)
    }

    fn places(&self) -> MutexGuard<'_, Places> {
        self.places.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves every record stored under a retired key encoding
    /// ([`RETIRED_KEY_PREFIXES`]) to its current key, [`REKEY_CHUNK`]
    /// records a commit (nothing if none is). Only those keys are read:
    /// the daemon reads the whole journal right after, in
    /// [`Journal::load`].
    fn rekey(&self) -> Result<(), JournalError> {
        let mut retired = Vec::new();
        for prefix in RETIRED_KEY_PREFIXES {
            retired.extend(self.store.load_under(prefix)?);
        }
        if retired.is_empty() {
            return Ok(());
        }
        let mut places = self.places();
        for chunk in retired.chunks(REKEY_CHUNK) {
            let mut staged = Staged::new(&places);
            let mut moves = Vec::with_capacity(chunk.len() * 2);
            for (stored, value) in chunk {
                let record = decode_record(stored, value)?;
                let current = staged.written(&places, &record.key());
                moves.push((stored.clone(), None));
                moves.push((current, Some(value.as_slice())));
            }
            self.store
                .commit(moves.iter().map(|(key, value)| (key.as_str(), *value)))?;
            places.apply(staged);
        }
        tracing::info!(
            event = "journal_rekeyed",
            path = %self.path().display(),
            records = retired.len(),
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
        self.append(self.turn(), batches)?.sync()
    }

    /// The next place in the order of appends.
    pub fn turn(&self) -> Turn {
        Turn(self.turns.fetch_add(1, Ordering::Relaxed))
    }

    /// Appends every record of `batches` as one commit, not yet durable,
    /// once the appends of the turns before `turn` are done: the first
    /// half of [`Journal::commit`], for a shell that keeps up to
    /// [`COMMITS_IN_FLIGHT_MAX`] commits in flight. After a failed append
    /// every later turn fails with [`JournalError::EarlierAppendFailed`].
    pub fn append(
        &self,
        turn: Turn,
        batches: &[JournalBatch],
    ) -> Result<AppendedBatches, JournalError> {
        let _notify = NotifyOnDrop(&self.append_done);
        let poisoned = |_| JournalError::EarlierAppendFailed;
        let mut appends = self.appends.lock().map_err(poisoned)?;
        while appends.next != turn.0 && !appends.failed {
            appends = self.append_done.wait(appends).map_err(poisoned)?;
        }
        if appends.failed {
            return Err(JournalError::EarlierAppendFailed);
        }
        let appended = self.append_now(batches);
        appends.next += 1;
        appends.failed = appended.is_err();
        appended
    }

    fn append_now(&self, batches: &[JournalBatch]) -> Result<AppendedBatches, JournalError> {
        let mut places = self.places();
        let mut staged = Staged::new(&places);
        let records = encode(&places, &mut staged, batches);
        let appended = self.store.append(
            records
                .iter()
                .map(|(key, value)| (key.as_str(), value.as_deref())),
        )?;
        // Applied before the frame is durable: if its sync fails the store
        // is broken and the journal takes no more commits.
        places.apply(staged);
        Ok(AppendedBatches(appended))
    }

    /// Does everything a commit of `batches` does, then aborts the
    /// transaction as a failed commit would: for tests that a batch is all
    /// or nothing.
    #[doc(hidden)]
    pub fn commit_then_abort(&self, batches: &[JournalBatch]) -> Result<(), JournalError> {
        let places = self.places();
        let mut staged = Staged::new(&places);
        let records = encode(&places, &mut staged, batches);
        Ok(self.store.commit_then_abort(
            records
                .iter()
                .map(|(key, value)| (key.as_str(), value.as_deref())),
        )?)
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
    let record = if value::is_positional(value) {
        compact::decode(value)
    } else {
        value::decode(value)
    };
    record.map_err(|source| JournalError::Corrupt {
        key: key.to_owned(),
        source,
    })
}

/// The last record per key of `batches`, encoded once each, under its
/// stored key; a forget becomes a deletion (none for a reservation key
/// that is not stored).
///
/// A reservation's record written with its holds, or forgotten, also
/// deletes the holds an older journal stored as records of their own
/// (`JournalKey::ShardReservation`).
fn encode(places: &Places, staged: &mut Staged, batches: &[JournalBatch]) -> Vec<(String, Stored)> {
    let mut latest: BTreeMap<JournalKey, &JournalRecord> = BTreeMap::new();
    for record in batches.iter().flat_map(|batch| &batch.records) {
        latest.insert(record.key(), record);
    }
    let mut writes = Vec::with_capacity(latest.len());
    staged.changed.reserve(latest.len());
    for (key, record) in latest {
        match record {
            JournalRecord::Forget(_) => {
                writes.extend(staged.deleted(places, &key).map(|k| (k, None)))
            }
            JournalRecord::ReservationWithHolds { record, holds } => writes.push((
                staged.written(places, &key),
                Some(compact::encode(record, holds)),
            )),
            record => writes.push((staged.written(places, &key), Some(value::encode(record)))),
        }
        if let (
            JournalKey::Reservation(id),
            JournalRecord::ReservationWithHolds { .. } | JournalRecord::Forget(_),
        ) = (&key, record)
        {
            for shard in places.legacy_holds(id) {
                let hold = JournalKey::ShardReservation(shard.clone(), id.clone());
                writes.extend(staged.deleted(places, &hold).map(|k| (k, None)));
            }
        }
    }
    writes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(id: &str) -> ShardId {
        ShardId::new(id).expect("valid")
    }

    #[test]
    fn places_give_back_what_was_put() {
        let id = ReservationId::new("rl-7").expect("valid");
        let places_of = [
            // A journal written since holds joined their record.
            Place {
                ordinal: 3,
                reservation: true,
                legacy_holds: Vec::new(),
            },
            // Older journals: holds under keys of their own, with and
            // without the reservation's own record.
            Place {
                ordinal: 4,
                reservation: true,
                legacy_holds: vec![shard("sh-1")],
            },
            Place {
                ordinal: 5,
                reservation: false,
                legacy_holds: vec![shard("sh-1"), shard("sh-2")],
            },
        ];
        for place in places_of {
            let mut places = Places::default();
            places.put(id.clone(), place.clone());
            assert!(places.contains(&id));
            assert_eq!(places.get(&id), Some(place.clone()));
            assert_eq!(places.legacy_holds(&id), place.legacy_holds.as_slice());
        }
    }

    #[test]
    fn an_empty_place_is_forgotten_and_a_plain_one_has_no_legacy_entry() {
        let id = ReservationId::new("rl-7").expect("valid");
        let mut places = Places::default();
        places.put(
            id.clone(),
            Place {
                ordinal: 1,
                reservation: false,
                legacy_holds: vec![shard("sh-1")],
            },
        );
        // The reservation's record is written again and its legacy hold
        // deleted: only its ordinal is left.
        places.put(
            id.clone(),
            Place {
                ordinal: 1,
                reservation: true,
                legacy_holds: Vec::new(),
            },
        );
        assert!(places.legacy.is_empty());
        assert_eq!(places.ordinals.get(&id), Some(&1));
        places.put(
            id.clone(),
            Place {
                ordinal: 1,
                ..Place::default()
            },
        );
        assert!(!places.contains(&id));
        assert_eq!(places.get(&id), None);
        assert!(places.ordinals.is_empty() && places.legacy.is_empty());
    }
}
