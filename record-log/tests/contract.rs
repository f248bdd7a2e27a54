//! The record log's contract: what a commit returns `Ok` for survives a
//! reopen; a commit that fails stores nothing; a later value under the same
//! key replaces the earlier one — across the log, its folds into the keyed
//! table, and an upgrade from the layout without a log. Deletions
//! (retention): a deleted key is gone after a reopen, whether its deletion
//! is still in the log or already folded; the last write per key wins,
//! deletion or not; a failed commit deletes nothing; a steady put/delete
//! workload keeps the file from growing (freed pages are reused). The fold
//! (a thread of its own): a full log file is sealed and folded while
//! commits go on, a checkpoint leaves no log behind, and a load after any
//! commit of a mixed workload — folds running or not, reopened or not —
//! returns exactly the latest values.

use std::collections::BTreeMap;
use std::path::Path;

use record_log::{RecordLog, RecordLogError};
use redb::{ReadableDatabase as _, ReadableTable as _};

mod common;

use common::{LAYOUT, open};

fn expected(pairs: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
    pairs
        .iter()
        .map(|(key, value)| ((*key).to_owned(), value.as_bytes().to_vec()))
        .collect()
}

/// Commits `count` times: each sets "a" to `i` and adds `s<i>`.
fn commit_many(store: &RecordLog, count: u64) {
    for i in 0..count {
        let value = i.to_string();
        let key = format!("s{i:04}");
        store
            .commit([
                ("a", Some(value.as_bytes())),
                (key.as_str(), Some(value.as_bytes())),
            ])
            .expect("commit");
    }
}

fn expected_after(count: u64) -> BTreeMap<String, Vec<u8>> {
    let mut expected: BTreeMap<String, Vec<u8>> = (0..count)
        .map(|i| (format!("s{i:04}"), i.to_string().into_bytes()))
        .collect();
    expected.insert("a".to_owned(), (count - 1).to_string().into_bytes());
    expected
}

#[test]
fn committed_records_survive_a_reopen_and_the_latest_value_wins() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    {
        let store = open(&path);
        assert!(store.load().expect("load").is_empty());
        store
            .commit([("a", Some(b"1".as_slice())), ("b", Some(b"1"))])
            .expect("commit");
        store
            .commit([
                ("a", Some(b"2".as_slice())),
                ("c", Some(b"1")),
                ("a", Some(b"3")),
            ])
            .expect("commit");
    }
    let store = open(&path);
    assert_eq!(
        store.load().expect("load"),
        expected(&[("a", "3"), ("b", "1"), ("c", "1")])
    );
}

#[test]
fn a_failed_commit_stores_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    {
        let store = open(&path);
        store
            .commit([("a", Some(b"1".as_slice()))])
            .expect("commit");
        let error = store
            .commit_then_abort([("a", Some(b"9".as_slice())), ("b", Some(b"9"))])
            .expect_err("aborted");
        assert!(matches!(error, RecordLogError::Aborted), "{error}");
        assert_eq!(store.load().expect("load"), expected(&[("a", "1")]));
    }
    assert_eq!(open(&path).load().expect("load"), expected(&[("a", "1")]));
}

#[test]
fn the_log_folds_into_the_table_and_loads_the_latest_value_per_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let count = LAYOUT.log_commits * 4 + 7;
    {
        let store = open(&path);
        commit_many(&store, count);
        assert_eq!(store.load().expect("load"), expected_after(count));
        store.checkpoint().expect("checkpoint");
        assert_eq!(store.log_len(), 0, "every commit is folded");
        assert_eq!(store.load().expect("load"), expected_after(count));
    }
    assert_eq!(open(&path).load().expect("load"), expected_after(count));
}

#[test]
fn a_full_log_file_is_sealed_and_commits_go_on_into_the_next() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    store.hold_folds(true);
    // While no fold runs, the newest file grows past `log_commits` only
    // if one is sealed and not folded yet.
    commit_many(&store, LAYOUT.log_commits);
    assert_eq!(store.log_len(), LAYOUT.log_commits, "sealed, not folded");
    commit_many(&store, LAYOUT.log_commits * 3);
    assert_eq!(
        store.log_len(),
        LAYOUT.log_commits * 4,
        "a fold held back keeps every commit in the log"
    );
    store.hold_folds(false);
    store.checkpoint().expect("checkpoint");
    assert_eq!(store.log_len(), 0);
    assert_eq!(
        store.load().expect("load"),
        expected_after(LAYOUT.log_commits * 3)
    );
    drop(store);
    assert_eq!(
        open(&path).load().expect("load"),
        expected_after(LAYOUT.log_commits * 3)
    );
}

#[test]
fn a_store_without_a_log_is_upgraded_in_place() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    // Layout version 1: the keyed table alone.
    {
        let db = redb::Database::create(&path).expect("create");
        let transaction = db.begin_write().expect("begin");
        {
            let mut meta = transaction
                .open_table(redb::TableDefinition::<&str, u64>::new("meta"))
                .expect("meta");
            meta.insert("schema", 1).expect("schema");
            let mut records = transaction
                .open_table(redb::TableDefinition::<&str, &[u8]>::new(LAYOUT.records))
                .expect("records");
            records.insert("a", b"1".as_slice()).expect("insert");
        }
        transaction.commit().expect("commit");
    }
    let store = open(&path);
    assert_eq!(store.load().expect("load"), expected(&[("a", "1")]));
    store
        .commit([("a", Some(b"2".as_slice()))])
        .expect("commit");
    drop(store);
    assert_eq!(open(&path).load().expect("load"), expected(&[("a", "2")]));
}

#[test]
fn a_newer_layout_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    stamp_version(&path, 6);
    let error = RecordLog::open(&path, LAYOUT).expect_err("refused");
    assert!(
        matches!(error, RecordLogError::Version { found: 6, .. }),
        "{error}"
    );
}

/// Stamps layout `version` in the file at `path` (opened by redb alone,
/// created if missing).
fn stamp_version(path: &Path, version: u64) {
    let db = redb::Database::create(path).expect("create");
    let transaction = db.begin_write().expect("begin");
    insert_version(&transaction, version);
    transaction.commit().expect("commit");
}

/// Writes layout `version` into the file's `meta` table in `transaction`.
fn insert_version(transaction: &redb::WriteTransaction, version: u64) {
    transaction
        .open_table(redb::TableDefinition::<&str, u64>::new("meta"))
        .expect("meta")
        .insert("schema", version)
        .expect("schema");
}

/// The layout version stamped in the file at `path` (opened by redb alone).
fn stamped_version(path: &Path) -> Option<u64> {
    let db = redb::Database::create(path).expect("open");
    let transaction = db.begin_read().expect("begin");
    let meta = transaction
        .open_table(redb::TableDefinition::<&str, u64>::new("meta"))
        .expect("meta");
    meta.get("schema")
        .expect("schema")
        .map(|value| value.value())
}

/// One log table entry of layout versions 2 and 3 (the payload of a log
/// frame): each key and value preceded by its length, a deletion with the
/// length `u32::MAX` and no value.
fn log_entry(writes: &[(&str, Option<&str>)]) -> Vec<u8> {
    let mut entry = Vec::new();
    for (key, value) in writes {
        entry.extend_from_slice(&u32::try_from(key.len()).expect("short").to_le_bytes());
        entry.extend_from_slice(key.as_bytes());
        match value {
            Some(value) => {
                entry.extend_from_slice(&u32::try_from(value.len()).expect("short").to_le_bytes());
                entry.extend_from_slice(value.as_bytes());
            }
            None => entry.extend_from_slice(&u32::MAX.to_le_bytes()),
        }
    }
    entry
}

/// A file as a binary of layout `version` (2 or 3) left it: records folded
/// into the table, and later ones still in its log table.
fn write_log_table_store(path: &Path, version: u64, log: &[Vec<u8>]) {
    let db = redb::Database::create(path).expect("create");
    let transaction = db.begin_write().expect("begin");
    {
        insert_version(&transaction, version);
        let mut records = transaction
            .open_table(redb::TableDefinition::<&str, &[u8]>::new(LAYOUT.records))
            .expect("records");
        for (key, value) in [("a", "folded"), ("b", "folded"), ("c", "folded")] {
            records.insert(key, value.as_bytes()).expect("insert");
        }
        let mut table = transaction
            .open_table(redb::TableDefinition::<u64, &[u8]>::new(LAYOUT.log))
            .expect("log");
        for (sequence, entry) in (1..).zip(log) {
            table.insert(sequence, entry.as_slice()).expect("insert");
        }
    }
    transaction.commit().expect("commit");
}

#[test]
fn a_store_with_a_log_table_is_upgraded_to_the_write_ahead_log() {
    for version in [2, 3] {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("store.redb");
        write_log_table_store(
            &path,
            version,
            &[
                log_entry(&[("a", Some("1")), ("d", Some("1"))]),
                log_entry(&[("b", None), ("a", Some("2")), ("e", Some("1"))]),
                log_entry(&[("e", None)]),
            ],
        );
        let want = expected(&[("a", "2"), ("c", "folded"), ("d", "1")]);
        let store = open(&path);
        assert_eq!(store.load().expect("load"), want, "version {version}");
        assert_eq!(store.log_len(), 0, "the log table was folded at open");
        store
            .commit([("c", Some(b"2".as_slice()))])
            .expect("commit");
        drop(store);
        assert_eq!(stamped_version(&path), Some(5), "version {version}");
        let mut want = want;
        want.insert("c".to_owned(), b"2".to_vec());
        assert_eq!(open(&path).load().expect("load"), want, "version {version}");
    }
}

/// The keys of the table `name` of the file at `path` (opened by redb
/// alone).
fn table_keys(path: &Path, name: &str) -> Vec<String> {
    let db = redb::Database::create(path).expect("open");
    let transaction = db.begin_read().expect("begin");
    let table = transaction
        .open_table(redb::TableDefinition::<&str, &[u8]>::new(name))
        .expect("table");
    table
        .iter()
        .expect("iterate")
        .map(|entry| entry.expect("entry").0.value().to_owned())
        .collect()
}

/// Layout version 4 kept every record alone, as a store whose layout
/// groups none does: its records move into their groups at open, and
/// the writes still in its log files are folded into them.
#[test]
fn a_store_of_records_alone_is_upgraded_to_groups() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let alone = record_log::Layout {
        group: record_log::ungrouped,
        ..LAYOUT
    };
    let mut want = BTreeMap::new();
    {
        let store = RecordLog::open(&path, alone).expect("open");
        let mut commit = |writes: &[(&str, Option<&str>)]| {
            store
                .commit(
                    writes
                        .iter()
                        .map(|(key, value)| (*key, value.map(str::as_bytes))),
                )
                .expect("commit");
            for (key, value) in writes {
                match value {
                    Some(value) => want.insert((*key).to_owned(), value.as_bytes().to_vec()),
                    None => want.remove(*key),
                };
            }
        };
        commit(&[
            ("a", Some("1")),
            ("abc", Some("1")),
            ("abd", Some("1")),
            ("old/1", Some("1")),
            ("old", Some("1")),
        ]);
        store.checkpoint().expect("checkpoint");
        store.hold_folds(true);
        commit(&[("abd", None), ("abe", Some("2")), ("old/2", Some("2"))]);
    }
    assert_eq!(
        table_keys(&path, LAYOUT.records),
        ["a", "abc", "abd", "old", "old/1"]
    );
    stamp_version(&path, 4);
    let store = open(&path);
    assert_eq!(store.load().expect("load"), want);
    assert_eq!(store.keys_under("ab").expect("keys"), ["abc", "abe"]);
    store.checkpoint().expect("checkpoint");
    assert_eq!(store.load().expect("load"), want);
    drop(store);
    assert_eq!(stamped_version(&path), Some(5));
    assert_eq!(table_keys(&path, LAYOUT.records), ["a"]);
    assert_eq!(table_keys(&path, LAYOUT.groups), ["ab", "ol", "old/"]);
    assert_eq!(open(&path).load().expect("load"), want);
}

/// A closed store in a new temporary directory (removed when dropped)
/// whose `records` are folded into its table: the directory and the
/// store's path.
fn folded_store(records: &[(&str, &str)]) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    store
        .commit(
            records
                .iter()
                .map(|(key, value)| (*key, Some(value.as_bytes()))),
        )
        .expect("commit");
    store.checkpoint().expect("checkpoint");
    (dir, path)
}

/// A store whose records were grouped is not opened with a layout that
/// groups them otherwise (or not at all): its loads would miss them.
#[test]
fn a_store_grouped_by_another_layout_is_refused() {
    let (_dir, path) = folded_store(&[("abc", "1")]);
    let alone = record_log::Layout {
        group: record_log::ungrouped,
        ..LAYOUT
    };
    let error = RecordLog::open(&path, alone).expect_err("refused");
    assert!(
        matches!(&error, RecordLogError::OtherGrouping { key, .. } if key == "abc"),
        "{error}"
    );
    assert_eq!(
        open(&path).load().expect("its own layout opens it"),
        expected(&[("abc", "1")])
    );
}

/// A group's value that is not a sequence of records fails a load with
/// the group's name, and the fold that would write into it (and the open,
/// were it the first group: see `a_store_grouped_by_another_layout_is_refused`).
#[test]
fn a_damaged_group_is_reported_not_skipped() {
    let (_dir, path) = folded_store(&[("abc", "1"), ("xyz", "1")]);
    {
        let db = redb::Database::create(&path).expect("open");
        let transaction = db.begin_write().expect("begin");
        transaction
            .open_table(redb::TableDefinition::<&str, &[u8]>::new(LAYOUT.groups))
            .expect("groups")
            .insert("xy", [9u8, 0, 0, 0, b'z'].as_slice())
            .expect("damage");
        transaction.commit().expect("commit");
    }
    let store = open(&path);
    let error = store.load().expect_err("damaged");
    assert!(
        matches!(&error, RecordLogError::DamagedGroup { group, .. } if group == "xy"),
        "{error}"
    );
    assert_eq!(
        store.load_under("ab").expect("another group loads"),
        expected(&[("abc", "1")])
    );
    store
        .commit([("xyw", Some(b"2".as_slice()))])
        .expect("the log takes the commit");
    let error = store.checkpoint().expect_err("the fold fails");
    assert!(error.to_string().contains("record group xy"), "{error}");
}

#[test]
fn a_damaged_log_table_entry_is_reported_not_skipped() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    write_log_table_store(
        &path,
        3,
        &[
            log_entry(&[("a", Some("1"))]),
            [9u8, 0, 0, 0, b'a'].to_vec(),
        ],
    );
    let error = RecordLog::open(&path, LAYOUT).expect_err("damaged");
    assert!(
        matches!(error, RecordLogError::Damaged { sequence: 2, .. }),
        "{error}"
    );
    assert_eq!(stamped_version(&path), Some(3), "nothing upgraded");
}

#[test]
fn a_second_open_of_the_same_file_fails() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    assert!(
        RecordLog::open(&path, LAYOUT).is_err(),
        "one process per file"
    );
    drop(store);
}

// ----- deletions (retention) -----

/// Folds every earlier commit into the table.
fn fill_until_folded(store: &RecordLog) {
    store.checkpoint().expect("checkpoint");
    assert_eq!(store.log_len(), 0, "folded");
}

#[test]
fn a_deletion_still_in_the_log_survives_a_reopen() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    {
        let store = open(&path);
        store
            .commit([("a", Some(b"1".as_slice())), ("b", Some(b"1"))])
            .expect("commit");
        store.commit([("a", None)]).expect("commit");
        assert_eq!(store.log_len(), 2, "nothing folded yet");
        assert_eq!(store.load().expect("load"), expected(&[("b", "1")]));
    }
    assert_eq!(open(&path).load().expect("load"), expected(&[("b", "1")]));
}

#[test]
fn a_folded_deletion_leaves_the_table_and_survives_a_reopen() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    {
        let store = open(&path);
        // "a" reaches the table first, then its deletion is folded too.
        store
            .commit([("a", Some(b"1".as_slice())), ("b", Some(b"1"))])
            .expect("commit");
        fill_until_folded(&store);
        store.commit([("a", None)]).expect("commit");
        fill_until_folded(&store);
        assert_eq!(store.load().expect("load"), expected(&[("b", "1")]));
    }
    assert_eq!(open(&path).load().expect("load"), expected(&[("b", "1")]));
}

#[test]
fn the_last_write_per_key_wins_deletion_or_not() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let want = expected(&[("back", "2"), ("kept", "1"), ("put-after", "2")]);
    {
        let store = open(&path);
        store
            .commit([
                ("kept", Some(b"1".as_slice())),
                ("gone", Some(b"1")),
                ("back", Some(b"1")),
            ])
            .expect("commit");
        // Within one commit: delete then put, put then delete.
        store
            .commit([
                ("back", None),
                ("back", Some(b"2".as_slice())),
                ("fleeting", Some(b"1")),
                ("fleeting", None),
                ("never", None),
            ])
            .expect("commit");
        // Across commits: put then delete, delete then put.
        store.commit([("gone", None)]).expect("commit");
        store
            .commit([("put-after", Some(b"1".as_slice()))])
            .expect("commit");
        store.commit([("put-after", None)]).expect("commit");
        store
            .commit([("put-after", Some(b"2".as_slice()))])
            .expect("commit");
        assert_eq!(store.load().expect("load"), want, "from the log");
        fill_until_folded(&store);
        assert_eq!(store.load().expect("load"), want, "from the table");
    }
    assert_eq!(open(&path).load().expect("load"), want, "after a reopen");
}

#[test]
fn a_failed_commit_deletes_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    {
        let store = open(&path);
        store
            .commit([("a", Some(b"1".as_slice())), ("b", Some(b"1"))])
            .expect("commit");
        let error = store
            .commit_then_abort([("a", None), ("c", Some(b"1".as_slice()))])
            .expect_err("aborted");
        assert!(matches!(error, RecordLogError::Aborted), "{error}");
        assert_eq!(
            store.load().expect("load"),
            expected(&[("a", "1"), ("b", "1")])
        );
    }
    assert_eq!(
        open(&path).load().expect("load"),
        expected(&[("a", "1"), ("b", "1")])
    );
}

/// Rounds of the steady workload, and how many keys stay alive.
const ROUNDS: u64 = 20_000;
const _: () = assert!(ROUNDS.is_multiple_of(LAYOUT.log_commits * 2));
const ALIVE: u64 = 500;
/// The second half may grow the file by at most this much: redb reuses
/// the pages that deletions and folds free.
const GROWTH_MAX_BYTES: u64 = 256 << 10;

#[test]
fn a_steady_put_delete_workload_does_not_grow_the_file() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    let value = vec![7u8; 256];
    let size = || record_log::store_bytes(&path);
    let mut half = 0;
    for round in 0..ROUNDS {
        let key = format!("r{round:08}");
        let old = round.checked_sub(ALIVE).map(|old| format!("r{old:08}"));
        match &old {
            Some(old) => {
                store.commit([(key.as_str(), Some(value.as_slice())), (old.as_str(), None)])
            }
            None => store.commit([(key.as_str(), Some(value.as_slice()))]),
        }
        .expect("commit");
        // Each fold covers one full log file, whatever the folder's thread
        // would otherwise get to: the sizes compared are those of the same
        // sequence of transactions on every run.
        if (round + 1) % LAYOUT.log_commits == 0 {
            store.checkpoint().expect("checkpoint");
        }
        if round + 1 == ROUNDS / 2 {
            half = size();
        }
    }
    let end = size();
    assert_eq!(store.load().expect("load").len() as u64, ALIVE);
    assert!(
        end <= half + GROWTH_MAX_BYTES,
        "the file grew from {half} to {end} bytes over the second half"
    );
    eprintln!("file size: {half} bytes at half time, {end} at the end");
}

// ----- folding in steps -----

/// A deterministic stream of pseudo-random numbers (xorshift), so a failing
/// workload replays exactly.
struct Xorshift(u64);

impl Xorshift {
    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }
}

/// One commit of the mixed workload: up to 6 writes over 40 keys, a third
/// of them deletions, some keys written twice in the commit. Returns the
/// writes, applied to `model` as a commit applies them.
fn mixed_commit(
    random: &mut Xorshift,
    round: u64,
    model: &mut BTreeMap<String, Vec<u8>>,
) -> Vec<(String, Option<Vec<u8>>)> {
    let writes: Vec<(String, Option<Vec<u8>>)> = (0..=random.below(6))
        .map(|write| {
            let key = format!("k{:02}", random.below(40));
            let value = (random.below(3) != 0).then(|| format!("{round}.{write}").into_bytes());
            (key, value)
        })
        .collect();
    apply_to_model(model, &writes);
    writes
}

/// Applies `writes` to `model` as a commit applies them to the store.
fn apply_to_model(model: &mut BTreeMap<String, Vec<u8>>, writes: &[(String, Option<Vec<u8>>)]) {
    for (key, value) in writes {
        match value {
            Some(value) => model.insert(key.clone(), value.clone()),
            None => model.remove(key),
        };
    }
}

fn commit_writes(store: &RecordLog, writes: &[(String, Option<Vec<u8>>)]) {
    store
        .commit(
            writes
                .iter()
                .map(|(key, value)| (key.as_str(), value.as_deref())),
        )
        .expect("commit");
}

/// Runs the mixed workload for 12 log files' worth of commits, checking a
/// load after every commit, a checkpoint after every `checkpoint_every`-th
/// and a load after a reopen after every `reopen_every`-th. Folds run on
/// their own meanwhile, wherever the folder's thread gets to; a reopen
/// seals whatever the log holds.
fn mixed_workload(reopen_every: u64, checkpoint_every: u64) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let mut random = Xorshift(0x9e37_79b9_7f4a_7c15);
    let mut model = BTreeMap::new();
    let rounds = LAYOUT.log_commits * 12;
    let mut store = open(&path);
    for round in 0..rounds {
        let writes = mixed_commit(&mut random, round, &mut model);
        commit_writes(&store, &writes);
        assert_eq!(store.load().expect("load"), model, "after commit {round}");
        if (round + 1) % checkpoint_every == 0 {
            store.checkpoint().expect("checkpoint");
            assert_eq!(store.log_len(), 0, "after a checkpoint at {round}");
            assert_eq!(
                store.load().expect("load"),
                model,
                "after a checkpoint at commit {round}"
            );
        }
        if (round + 1) % reopen_every == 0 {
            drop(store);
            store = open(&path);
            assert_eq!(
                store.load().expect("load"),
                model,
                "after a reopen at commit {round}"
            );
        }
    }
    assert!(model.len() > 5, "the workload keeps some keys");
}

#[test]
fn a_reopen_after_any_commit_loads_exactly_the_latest_values() {
    mixed_workload(1, u64::MAX);
}

#[test]
fn folds_across_commits_without_a_reopen_load_exactly_the_latest_values() {
    mixed_workload(7, u64::MAX);
}

#[test]
fn checkpoints_between_commits_load_exactly_the_latest_values() {
    mixed_workload(29, 5);
}

#[test]
fn commits_from_another_thread_during_folds_load_exactly_the_latest_values() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    let mut random = Xorshift(0x2545_f491_4f6c_dd1d);
    let mut model = BTreeMap::new();
    std::thread::scope(|scope| {
        let committer = scope.spawn(|| {
            for round in 0..LAYOUT.log_commits * 40 {
                let writes = mixed_commit(&mut random, round, &mut model);
                commit_writes(&store, &writes);
            }
        });
        // Checkpoints race the commits: each seals whatever the newest
        // file holds at that moment.
        while !committer.is_finished() {
            store.checkpoint().expect("checkpoint");
        }
        committer.join().expect("committer");
    });
    assert_eq!(store.load().expect("load"), model);
    drop(store);
    assert_eq!(open(&path).load().expect("load"), model, "after a reopen");
}

#[test]
fn a_log_longer_than_a_file_is_folded_whole_after_a_reopen() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let mut random = Xorshift(0x2545_f491_4f6c_dd1d);
    let mut model = BTreeMap::new();
    let long = LAYOUT.log_commits * 5 + 3;
    {
        let store = open(&path);
        store.hold_folds(true);
        for round in 0..long {
            let writes = mixed_commit(&mut random, round, &mut model);
            commit_writes(&store, &writes);
        }
        assert_eq!(store.log_len(), long, "nothing folded");
    }
    let store = open(&path);
    assert_eq!(store.load().expect("load"), model, "opened as it is");
    store.checkpoint().expect("checkpoint");
    assert_eq!(store.log_len(), 0);
    assert_eq!(store.load().expect("load"), model, "folded");
    drop(store);
    assert_eq!(open(&path).load().expect("load"), model, "after a reopen");
}

#[test]
fn a_write_superseded_in_an_aborted_commit_is_still_folded() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    store
        .commit([("k", Some(b"1".as_slice()))])
        .expect("commit");
    // This commit writes "k" again; it is aborted, so the first write is
    // still the latest and must reach the table when the log is folded.
    let error = store
        .commit_then_abort([("k", Some(b"2".as_slice()))])
        .expect_err("aborted");
    assert!(matches!(error, RecordLogError::Aborted), "{error}");
    fill_until_folded(&store);
    let want = expected(&[("k", "1")]);
    assert_eq!(store.load().expect("load"), want);
    drop(store);
    assert_eq!(open(&path).load().expect("load"), want, "after a reopen");
}

#[test]
fn a_load_under_a_prefix_returns_exactly_the_latest_values_of_its_keys_and_keys_under_their_keys() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    store
        .commit([
            ("old/1", Some(b"1".as_slice())),
            ("old/2", Some(b"1")),
            ("old", Some(b"1")),
            ("older/1", Some(b"1")),
            ("ole", Some(b"1")),
            ("p", Some(b"1")),
        ])
        .expect("commit");
    // The first commit's keys folded into the table, then later writes
    // that are still in the log.
    store.checkpoint().expect("checkpoint");
    store
        .commit([("old/2", None), ("old/3", Some(b"2".as_slice()))])
        .expect("commit");
    assert_eq!(
        store.load_under("old/").expect("load"),
        expected(&[("old/1", "1"), ("old/3", "2")])
    );
    assert_eq!(
        store.load_under("").expect("load"),
        store.load().expect("load")
    );
    assert!(store.load_under("zz").expect("load").is_empty());
    assert_eq!(store.keys_under("old/").expect("keys"), ["old/1", "old/3"]);
    assert!(store.keys_under("zz").expect("keys").is_empty());
}

#[test]
fn keys_under_a_prefix_do_not_read_the_log_files() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    store
        .commit([("old/1", Some(b"1".as_slice())), ("old/2", Some(b"1"))])
        .expect("commit");
    store.checkpoint().expect("checkpoint");
    store
        .commit([("old/2", None), ("old/3", Some(b"2".as_slice()))])
        .expect("commit");
    // The unfolded writes' values are gone from the log file: only the
    // keys the store holds in memory can answer.
    let mut log = path.clone().into_os_string();
    log.push(".wal.2");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&log)
        .expect("the second log file")
        .set_len(0)
        .expect("truncate");
    assert_eq!(store.keys_under("old/").expect("keys"), ["old/1", "old/3"]);
    assert!(
        store.load_under("old/").is_err(),
        "the values are read from the log file"
    );
}

/// A fold reads its values in batches, in the order they lie in the log
/// files, neighbours by one read: 2,000 keys (more than a batch takes)
/// with values of up to 12 KiB (more bytes than a batch reads), most
/// written over or deleted in later commits (so that the values still live
/// lie apart by gaps of every size), load exactly after the fold and after
/// a reopen.
#[test]
fn a_fold_of_many_large_values_written_over_loads_exactly_the_latest_values() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    let mut random = Xorshift(0x2545_f491_4f6c_dd1d);
    let mut model = BTreeMap::new();
    for round in 0..60_u64 {
        let writes: Vec<(String, Option<Vec<u8>>)> = (0..100)
            .map(|_| {
                let key = format!("key{:05}", random.below(2000));
                let length = usize::try_from(random.below(12 * 1024)).expect("below 12 KiB");
                let text = format!("{key}@{round};");
                let value = (random.below(5) != 0)
                    .then(|| text.bytes().cycle().take(length).collect::<Vec<u8>>());
                (key, value)
            })
            .collect();
        apply_to_model(&mut model, &writes);
        commit_writes(&store, &writes);
    }
    assert!(
        model.len() > 1024,
        "more keys than a batch: {}",
        model.len()
    );
    store.checkpoint().expect("checkpoint");
    assert_eq!(store.log_len(), 0, "everything folded");
    assert_eq!(store.load().expect("load"), model, "after the fold");
    drop(store);
    let store = open(&path);
    assert_eq!(store.load().expect("load"), model, "after a reopen");
}
