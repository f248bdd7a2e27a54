//! [`RedbStore`]: the embedded store, a [`record_log::RecordLog`] of the
//! ledger's changes (MessagePack, [`record_log::value`]) under
//! [`encode_key`], except reservations, whose records are in their
//! compact form ([`compact`]) under keys of their own.
//!
//! # Reservations in the order they came
//!
//! A reservation's record is stored under `reservations/{ordinal}/{id}`,
//! the ordinal (16 hex digits) given at its first write and counting up.
//! Reservation IDs are hashes: keyed by ID (`reservation/{id}`, as stores
//! written before are), each reservation a fold wrote landed in a B-tree
//! leaf of its own, so every fold rewrote pages all over the table — a
//! quarter of the central's CPU on the agent's healthy path, two thirds
//! of it the kernel writing pages (docs/benchmarks-history.md). Keyed in the order
//! they came, the reservations a fold writes — the newest — share leaves.
//! The store keeps each stored reservation's ordinal in memory (a hash
//! map of ID → ordinal), read from the keys at open, to find its key
//! again.
//!
//! A store of reservations keyed by ID is rekeyed when it is opened, in
//! commits of [`REKEY_CHUNK`] records (`event=ledger_rekeyed`). Every
//! store opened gets [`KEYS_LAYOUT_KEY`] (in the first of those commits,
//! or in one of its own), whose value is not a change: an older binary,
//! which decodes every value as one, refuses the file
//! (`stored record keys-layout is unreadable`) instead of writing
//! `reservation/{id}` beside the record stored under the ordinal.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::{Mutex, PoisonError};

use ledger::store::LedgerStore;
use ledger::{Change, IdMap, RecordKey};
use record_log::value::{self, DecodeError, decode, encode};
use record_log::{Layout, RecordLog, RecordLogError};
use shard_format::ReservationId;

use super::{compact, encode_key, last_per_key, sort_by_key};

/// The store's tables; a commit appends one frame to the write-ahead log,
/// and every 256 commits the log file is folded into the keyed table on the
/// store's own thread.
pub const LAYOUT: Layout = Layout {
    records: "records",
    log: "records-log",
    log_commits: 256,
    cache_bytes: 64 << 20,
    preallocate_bytes: record_log::PREALLOCATE_BYTES,
    groups: "records-groups",
    // Every record alone. Grouped by sixteen ordinals as the agent's
    // journal is, the soak's redb file doubled to 2.2 GB where it held
    // at 1.1 (docs/benchmarks-history.md): the central's records are larger (about
    // 2 KB), and so would be its groups' values, some 30 KB each.
    group: record_log::ungrouped,
};

/// The prefix of a reservation's key (see "Reservations in the order they
/// came").
const RESERVATIONS: &str = "reservations/";

/// The prefix of a reservation's key in stores written before: its ID.
const RESERVATIONS_BY_ID: &str = "reservation/";

/// The record that says how reservations are keyed; no change has this
/// key (theirs start with a kind: `policy/`, `reservation/`, …).
const KEYS_LAYOUT_KEY: &str = "keys-layout";

/// [`KEYS_LAYOUT_KEY`]'s value, MessagePack text: what a store of
/// another layout holds there is refused.
const KEYS_LAYOUT: &str = "reservations/<ordinal>/<id>";

/// How many records a rekey moves in one commit: a store of millions of
/// reservations would not fit in one log frame (4 GiB). A crash between
/// two of them is safe: the next open finds the moved records under their
/// ordinals and moves the rest.
const REKEY_CHUNK: usize = 4096;

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
    /// A stored key under `reservations/` or `reservation/` is not one this
    /// store writes, or names a reservation stored under another key too.
    #[error(
        "stored key {key} is not a reservation key this store writes \
         (reservations/<ordinal>/<id>, or reservation/<id> before), or its reservation is stored twice"
    )]
    UnreadableKey { key: String },
    /// The file keys its reservations in a layout this binary does not
    /// know (a newer binary wrote it).
    #[error("the store keys its reservations as {found:?}; this binary reads {KEYS_LAYOUT:?}")]
    UnknownKeysLayout { found: String },
}

/// The ledger's records in one redb file. See the module documentation of
/// [`crate::store`] and of this module.
#[derive(Debug)]
pub struct RedbStore {
    store: RecordLog,
    ordinals: Ordinals,
    /// The records read at open, for the first [`LedgerStore::load_all`]:
    /// one read of the table, not two (a restart reads every record to
    /// learn the ordinals from their keys). A commit drops them.
    loaded: Mutex<Option<Vec<Change>>>,
}

/// The ordinal of every stored reservation.
#[derive(Debug, Default)]
struct Ordinals {
    /// The ordinal of the next reservation new to the store.
    next: u64,
    of: IdMap<ReservationId, u64>,
}

impl Ordinals {
    /// Takes the stored reservation key `key` (`ordinal` and `id`) in.
    fn learn(&mut self, key: &str, ordinal: u64, id: ReservationId) -> Result<(), RedbStoreError> {
        if self.of.insert(id, ordinal).is_some() {
            // One reservation under two ordinals: not written by this store.
            return Err(RedbStoreError::UnreadableKey {
                key: key.to_owned(),
            });
        }
        self.next = self.next.max(ordinal + 1);
        Ok(())
    }
}

/// The stored key of a reservation's record.
fn reservation_key(ordinal: u64, id: &ReservationId) -> String {
    let mut key = String::with_capacity(RESERVATIONS.len() + 16 + 1 + id.as_str().len());
    let _ = write!(key, "{RESERVATIONS}{ordinal:016x}/{id}");
    key
}

/// The ordinal and the reservation ID's text of a key [`reservation_key`]
/// made: only 16 lower-case hex digits, as it writes them, so that no
/// other key names the same reservation.
fn parse_reservation_key(key: &str) -> Option<(u64, &str)> {
    let (ordinal, id) = key.strip_prefix(RESERVATIONS)?.split_once('/')?;
    let hex = ordinal.len() == 16
        && ordinal
            .bytes()
            .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    Some((u64::from_str_radix(ordinal, 16).ok().filter(|_| hex)?, id))
}

impl RedbStore {
    /// Opens (or creates) the store at `path`, rekeying the reservations
    /// of a store written before their ordinals. A second open of the same
    /// file, by this process or another, fails: one writer per file.
    pub fn open(path: &Path) -> Result<Self, RedbStoreError> {
        let mut store = Self {
            store: RecordLog::open(path, LAYOUT)?,
            ordinals: Ordinals::default(),
            loaded: Mutex::new(None),
        };
        let marked = store.check_keys_layout()?;
        let (ordinals, records) = store.read()?;
        store.ordinals = ordinals;
        // Moving records changes their keys, not what a load returns.
        store.rekey(marked)?;
        *store
            .loaded
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner) = Some(records);
        Ok(store)
    }

    /// Every stored record, in [`RecordKey`] order, and the ordinals of
    /// the reservations among them.
    fn read(&self) -> Result<(Ordinals, Vec<Change>), RedbStoreError> {
        let mut ordinals = Ordinals::default();
        let stored = self.store.load()?;
        let mut records = Vec::with_capacity(stored.len());
        for (key, value) in stored {
            if key == KEYS_LAYOUT_KEY {
                continue;
            }
            // A reservation's record is compact since this form came;
            // one written before, or any other record, has names.
            let decoded = if value::is_positional(&value) && key.starts_with(RESERVATIONS) {
                compact::decode(&value)
            } else {
                decode(&value)
            };
            let change: Change = match decoded {
                Ok(change) => change,
                Err(source) => return Err(RedbStoreError::Corrupt { key, source }),
            };
            if key.starts_with(RESERVATIONS) {
                // The key names the reservation its record is of.
                let (ordinal, id) = match (&change, parse_reservation_key(&key)) {
                    (Change::Reservation(record), Some((ordinal, id)))
                        if record.receipt.reservation.as_str() == id =>
                    {
                        (ordinal, record.receipt.reservation.clone())
                    }
                    _ => return Err(RedbStoreError::UnreadableKey { key }),
                };
                ordinals.learn(&key, ordinal, id)?;
            }
            records.push(change);
        }
        Ok((ordinals, sort_by_key(records)))
    }

    pub fn path(&self) -> &Path {
        self.store.path()
    }

    /// Whether the store holds the keys' layout; an error if it holds
    /// another one.
    fn check_keys_layout(&self) -> Result<bool, RedbStoreError> {
        let layout = self.store.load_under(KEYS_LAYOUT_KEY)?;
        match layout.get(KEYS_LAYOUT_KEY) {
            None => Ok(false),
            Some(value) if decode::<String>(value).is_ok_and(|found| found == KEYS_LAYOUT) => {
                Ok(true)
            }
            Some(value) => Err(RedbStoreError::UnknownKeysLayout {
                found: decode::<String>(value).unwrap_or_else(|_| format!("{value:?}")),
            }),
        }
    }

    /// Writes the keys' layout, unless the store holds it (`marked`), and
    /// moves every reservation stored under its ID to a new ordinal, after
    /// those [`Self::read`] found under theirs (moved before a crash).
    fn rekey(&mut self, marked: bool) -> Result<(), RedbStoreError> {
        let mut marker = (!marked).then(|| (KEYS_LAYOUT_KEY.to_owned(), Some(encode(KEYS_LAYOUT))));
        let by_id: Vec<(String, Vec<u8>)> = self
            .store
            .load_under(RESERVATIONS_BY_ID)?
            .into_iter()
            .collect();
        if by_id.is_empty() {
            if let Some(marker) = marker {
                self.commit_writes(&[marker])?;
            }
            return Ok(());
        }
        for chunk in by_id.chunks(REKEY_CHUNK) {
            let mut moved = Vec::with_capacity(chunk.len());
            let mut writes: Vec<(String, Option<Vec<u8>>)> = Vec::with_capacity(chunk.len() * 2);
            // The layout in the first commit: from then on an older binary
            // refuses the file, whatever a crash leaves unmoved.
            writes.extend(marker.take());
            for (stored, value) in chunk {
                let id = stored
                    .strip_prefix(RESERVATIONS_BY_ID)
                    .and_then(|id| ReservationId::new(id).ok())
                    .filter(|id| !self.ordinals.of.contains_key(id))
                    .ok_or_else(|| RedbStoreError::UnreadableKey {
                        key: stored.clone(),
                    })?;
                let ordinal = self.ordinals.next + moved.len() as u64;
                writes.push((stored.clone(), None));
                writes.push((reservation_key(ordinal, &id), Some(value.clone())));
                moved.push((id, ordinal));
            }
            self.commit_writes(&writes)?;
            self.ordinals.next += moved.len() as u64;
            self.ordinals.of.extend(moved);
        }
        tracing::info!(
            event = "ledger_rekeyed",
            path = %self.path().display(),
            records = by_id.len(),
            "reservation records stored under their IDs were moved under the order they came"
        );
        Ok(())
    }

    /// Commits `writes` (a value, or `None`: a deletion) as one frame.
    fn commit_writes(&self, writes: &[(String, Option<Vec<u8>>)]) -> Result<(), RedbStoreError> {
        self.store.commit(
            writes
                .iter()
                .map(|(key, value)| (key.as_str(), value.as_deref())),
        )?;
        Ok(())
    }
}

impl LedgerStore for RedbStore {
    type Error = RedbStoreError;

    /// One write transaction, `Durability::Immediate`: when this returns
    /// `Ok` the changes are on disk; on `Err` the transaction was aborted
    /// and nothing changed.
    fn commit(&mut self, changes: &[Change]) -> Result<(), RedbStoreError> {
        *self
            .loaded
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner) = None;
        let mut next = self.ordinals.next;
        // What the commit does to the ordinals, applied once it is durable.
        let mut added = Vec::new();
        let mut forgotten = Vec::new();
        let mut records: Vec<(String, Option<Vec<u8>>)> = Vec::with_capacity(changes.len());
        for change in last_per_key(changes) {
            let value = match change {
                Change::Forget(_) => None,
                Change::Reservation(record) => Some(compact::encode(record)),
                _ => Some(encode(change)),
            };
            let key = match change.key() {
                RecordKey::Reservation(id) => match self.ordinals.of.get(&id) {
                    Some(&ordinal) => {
                        let key = reservation_key(ordinal, &id);
                        if value.is_none() {
                            forgotten.push(id);
                        }
                        key
                    }
                    // Forgetting a reservation never stored: nothing to do.
                    None if value.is_none() => continue,
                    None => {
                        let key = reservation_key(next, &id);
                        added.push((id, next));
                        next += 1;
                        key
                    }
                },
                key => encode_key(&key),
            };
            records.push((key, value));
        }
        self.commit_writes(&records)?;
        self.ordinals.next = next;
        self.ordinals.of.extend(added);
        for id in forgotten {
            self.ordinals.of.remove(&id);
        }
        Ok(())
    }

    fn load_all(&self) -> Result<Vec<Change>, RedbStoreError> {
        let loaded = self
            .loaded
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match loaded {
            Some(records) => Ok(records),
            None => Ok(self.read()?.1),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use ledger::store::contract::sample_policy;
    use ledger::{CentralConfig, CentralLedger, ReserveRequest};
    use shard_format::{Digest, IdempotencyKey, KeyId, Route, Subject, Timestamp};

    use super::*;

    /// A fresh directory of this test's own.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "reservoir-redb-store-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch directory");
        dir
    }

    /// A reservation's record under the ID `rl-{index}`.
    fn reservation(index: u64) -> Change {
        let start = Timestamp::from_unix_ms(1_784_469_600_000).expect("valid");
        let mut ledger = CentralLedger::new(CentralConfig::default());
        let _ = ledger.publish_policy(sample_policy(1), start);
        let request = ReserveRequest::new(
            KeyId::new(format!("ed25519:{}", "11".repeat(32))).expect("valid"),
            IdempotencyKey::new("req-1").expect("valid"),
            Subject::new("tenant-7").expect("valid"),
            Route::new("chat.generate").expect("valid"),
            10,
            Digest::sha256(b"request"),
        );
        let mut record = ledger
            .reserve(request, start)
            .changes
            .into_iter()
            .find_map(|change| match change {
                Change::Reservation(record) => Some(record),
                _ => None,
            })
            .expect("a reservation's record");
        record.receipt.reservation = ReservationId::new(format!("rl-{index}")).expect("valid");
        Change::Reservation(record)
    }

    fn id(index: u64) -> ReservationId {
        ReservationId::new(format!("rl-{index}")).expect("valid")
    }

    fn stored_keys(store: &RedbStore) -> Vec<String> {
        store.store.keys_under("").expect("keys")
    }

    #[test]
    fn reservations_are_keyed_in_the_order_they_came_and_keep_their_key() {
        let dir = scratch("ordinals");
        let path = dir.join("ledger.redb");
        let mut store = RedbStore::open(&path).expect("open");
        store
            .commit(&[reservation(30), reservation(10), reservation(20)])
            .expect("commit");
        // Written again, before and after a reopen: the same key.
        store.commit(&[reservation(10)]).expect("commit");
        drop(store);
        let mut store = RedbStore::open(&path).expect("reopen");
        store
            .commit(&[
                reservation(20),
                Change::Forget(RecordKey::Reservation(id(30))),
            ])
            .expect("commit");
        store.commit(&[reservation(40)]).expect("commit");
        assert_eq!(
            store.load_all().expect("load"),
            vec![reservation(10), reservation(20), reservation(40)],
            "what was read at open is not what a load returns after a commit"
        );
        drop(store);
        let store = RedbStore::open(&path).expect("reopen");
        assert_eq!(
            stored_keys(&store),
            [
                "keys-layout",
                "reservations/0000000000000001/rl-10",
                "reservations/0000000000000002/rl-20",
                "reservations/0000000000000003/rl-40",
            ],
            "first writes in order, one key per reservation, the forgotten one gone, \
             ordinals not reused"
        );
        assert_eq!(
            store.load_all().expect("load"),
            vec![reservation(10), reservation(20), reservation(40)]
        );
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn reservations_written_with_names_are_read_and_written_again_compact() {
        let dir = scratch("named");
        let path = dir.join("ledger.redb");
        {
            // As a binary of before the compact form wrote them.
            let old = RecordLog::open(&path, LAYOUT).expect("open");
            let marker = encode(KEYS_LAYOUT);
            let named: Vec<(String, Vec<u8>)> = [1, 2]
                .into_iter()
                .map(|index| {
                    (
                        reservation_key(index, &id(index)),
                        encode(&reservation(index)),
                    )
                })
                .collect();
            old.commit(
                [(KEYS_LAYOUT_KEY, Some(marker.as_slice()))]
                    .into_iter()
                    .chain(
                        named
                            .iter()
                            .map(|(key, value)| (key.as_str(), Some(value.as_slice()))),
                    ),
            )
            .expect("commit");
        }
        let mut store = RedbStore::open(&path).expect("open");
        assert_eq!(
            store.load_all().expect("load"),
            vec![reservation(1), reservation(2)]
        );
        store.commit(&[reservation(2)]).expect("commit");
        drop(store);
        let stored = RecordLog::open(&path, LAYOUT)
            .expect("open")
            .load()
            .expect("load");
        assert!(!value::is_positional(&stored[&reservation_key(1, &id(1))]));
        assert!(value::is_positional(&stored[&reservation_key(2, &id(2))]));
        let store = RedbStore::open(&path).expect("reopen");
        assert_eq!(
            store.load_all().expect("load"),
            vec![reservation(1), reservation(2)]
        );
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn a_store_keyed_by_id_is_rekeyed_at_open_in_chunks() {
        let dir = scratch("rekey");
        let path = dir.join("ledger.redb");
        let count = REKEY_CHUNK as u64 + 3;
        let written: Vec<Change> = (0..count).map(reservation).collect();
        let policy = Change::Policy(Box::new(sample_policy(1)));
        {
            // As a binary of before wrote it: every key by `encode_key`.
            let old = RecordLog::open(&path, LAYOUT).expect("open");
            let records: Vec<(String, Vec<u8>)> = written
                .iter()
                .chain([&policy])
                .map(|change| (encode_key(&change.key()), encode(change)))
                .collect();
            old.commit(
                records
                    .iter()
                    .map(|(key, value)| (key.as_str(), Some(value.as_slice()))),
            )
            .expect("commit");
        }
        let store = RedbStore::open(&path).expect("open rekeys");
        let keys = stored_keys(&store);
        assert!(
            keys.iter().all(|key| !key.starts_with(RESERVATIONS_BY_ID)),
            "no key by ID is left"
        );
        let by_ordinal = store.store.keys_under(RESERVATIONS).expect("keys");
        assert_eq!(by_ordinal.len() as u64, count);
        let expected = sort_by_key(written.into_iter().chain([policy]).collect());
        assert_eq!(store.load_all().expect("load"), expected);
        drop(store);
        let mut store = RedbStore::open(&path).expect("reopen");
        assert_eq!(
            store.store.keys_under(RESERVATIONS).expect("keys"),
            by_ordinal
        );
        store.commit(&[reservation(count)]).expect("commit");
        assert_eq!(
            store.store.keys_under(RESERVATIONS).expect("keys").last(),
            Some(&reservation_key(count, &id(count))),
            "a new reservation comes after the moved ones"
        );
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn an_older_binary_cannot_read_the_keys_layout_as_a_change() {
        let dir = scratch("older");
        let path = dir.join("ledger.redb");
        let mut store = RedbStore::open(&path).expect("open");
        store.commit(&[reservation(1)]).expect("commit");
        drop(store);
        // An older binary decodes every stored value as a change: it reads
        // neither the layout nor a compact reservation, and refuses the file.
        let old = RecordLog::open(&path, LAYOUT).expect("open");
        let mut unreadable: Vec<String> = old
            .load()
            .expect("load")
            .into_iter()
            .filter(|(_, value)| decode::<Change>(value).is_err())
            .map(|(key, _)| key)
            .collect();
        unreadable.sort();
        let mut expected = vec![KEYS_LAYOUT_KEY.to_owned(), reservation_key(0, &id(1))];
        expected.sort();
        assert_eq!(unreadable, expected);
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn another_keys_layout_or_a_reservation_stored_twice_is_refused() {
        let dir = scratch("refused");
        let newer = dir.join("newer.redb");
        {
            let old = RecordLog::open(&newer, LAYOUT).expect("open");
            let value = encode("reservations/<something else>");
            old.commit([(KEYS_LAYOUT_KEY, Some(value.as_slice()))])
                .expect("commit");
        }
        assert!(matches!(
            RedbStore::open(&newer),
            Err(RedbStoreError::UnknownKeysLayout { found }) if found == "reservations/<something else>"
        ));
        let twice = dir.join("twice.redb");
        let mut store = RedbStore::open(&twice).expect("open");
        store.commit(&[reservation(1)]).expect("commit");
        drop(store);
        {
            let old = RecordLog::open(&twice, LAYOUT).expect("open");
            let value = encode(&reservation(1));
            old.commit([("reservation/rl-1", Some(value.as_slice()))])
                .expect("commit");
        }
        assert!(matches!(
            RedbStore::open(&twice),
            Err(RedbStoreError::UnreadableKey { key }) if key == "reservation/rl-1"
        ));
        // Keys this store never writes under `reservations/`: upper-case
        // digits, a short ordinal, another reservation's record.
        for (index, key) in [
            "reservations/000000000000000A/rl-1",
            "reservations/0a/rl-1",
            "reservations/0000000000000000/rl-2",
        ]
        .into_iter()
        .enumerate()
        {
            let path = dir.join(format!("foreign-{index}.redb"));
            {
                let old = RecordLog::open(&path, LAYOUT).expect("open");
                let value = encode(&reservation(1));
                old.commit([(key, Some(value.as_slice()))]).expect("commit");
            }
            assert!(
                matches!(
                    RedbStore::open(&path),
                    Err(RedbStoreError::UnreadableKey { key: found }) if found == key
                ),
                "{key}"
            );
        }
        std::fs::remove_dir_all(dir).ok();
    }
}
