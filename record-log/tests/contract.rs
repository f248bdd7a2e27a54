//! The record log's contract: what a commit returns `Ok` for survives a
//! reopen; a commit that fails stores nothing; a later value under the same
//! key replaces the earlier one — across the log, its folds into the keyed
//! table, and an upgrade from the layout without a log. Deletions
//! (retention): a deleted key is gone after a reopen, whether its deletion
//! is still in the log or already folded; the last write per key wins,
//! deletion or not; a failed commit deletes nothing; a steady put/delete
//! workload keeps the file from growing (freed pages are reused). Folding
//! in steps (a sweep over the pending keys, `log_commits` commits long):
//! the log holds fewer than `2 × log_commits` entries after any commit, a
//! longer log (a file written with a longer bound) is back under it within
//! one sweep, and a reopen after any commit of a mixed workload loads
//! exactly the latest values.

use std::collections::BTreeMap;
use std::path::Path;

use record_log::{Layout, RecordLog, RecordLogError};
use redb::ReadableDatabase as _;

const LAYOUT: Layout = Layout {
    records: "records",
    log: "records-log",
    log_commits: 16,
    cache_bytes: 1 << 20,
};

fn open(path: &Path) -> RecordLog {
    RecordLog::open(path, LAYOUT).expect("open")
}

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

/// A commit of two keys no commit wrote before, sorting after every key
/// written before: each step of the sweep finds at least two keys ahead of
/// its cursor, so every sweep lasts its full `log_commits` commits and the
/// log reaches its bound.
fn commit_two_new_keys(store: &RecordLog, i: u64) {
    let (first, second) = (format!("z{i:06}a"), format!("z{i:06}b"));
    store
        .commit([
            (first.as_str(), Some(b"1".as_slice())),
            (second.as_str(), Some(b"1")),
        ])
        .expect("commit");
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

/// The most entries the log holds after a commit: a sweep lasts at most
/// `log_commits` commits and, when it ends, deletes the entries up to the
/// one before it began.
const LOG_MAX: u64 = LAYOUT.log_commits * 2 - 1;

#[test]
fn the_log_folds_into_the_table_and_loads_the_latest_value_per_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let count = LAYOUT.log_commits * 4 + 7;
    {
        let store = open(&path);
        commit_many(&store, count);
        let length = store.log_len().expect("log");
        assert!(length <= LOG_MAX, "older commits were folded: {length}");
        assert_eq!(store.load().expect("load"), expected_after(count));
    }
    assert_eq!(open(&path).load().expect("load"), expected_after(count));
}

#[test]
fn the_log_reaches_its_bound_and_no_further() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    let mut lengths = Vec::new();
    for i in 0..LAYOUT.log_commits * 6 {
        commit_two_new_keys(&store, i);
        lengths.push(store.log_len().expect("log"));
    }
    assert_eq!(lengths.iter().max(), Some(&LOG_MAX), "{lengths:?}");
}
#[test]
fn an_aborted_fold_stores_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    let count = LAYOUT.log_commits;
    commit_many(&store, count);
    let length = store.log_len().expect("log");
    // This commit would take a step of the sweep and fold some keys.
    let error = store
        .commit_then_abort([("a", Some(b"999".as_slice()))])
        .expect_err("aborted");
    assert!(matches!(error, RecordLogError::Aborted), "{error}");
    assert_eq!(store.log_len().expect("log"), length, "nothing folded");
    assert_eq!(store.load().expect("load"), expected_after(count));
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
    {
        let db = redb::Database::create(&path).expect("create");
        let transaction = db.begin_write().expect("begin");
        transaction
            .open_table(redb::TableDefinition::<&str, u64>::new("meta"))
            .expect("meta")
            .insert("schema", 4)
            .expect("schema");
        transaction.commit().expect("commit");
    }
    let error = RecordLog::open(&path, LAYOUT).expect_err("refused");
    assert!(
        matches!(error, RecordLogError::Version { found: 4, .. }),
        "{error}"
    );
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

#[test]
fn a_version_2_store_is_stamped_3_and_read_as_it_is() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    // Records folded into the table and records still in the log, as a
    // version 2 binary left them (its values were JSON: bytes are bytes
    // to the store).
    {
        let store = open(&path);
        for i in 0..300_u32 {
            let value = format!("{{\"n\":{i}}}");
            store
                .commit([(format!("k{}", i % 7).as_str(), Some(value.as_bytes()))])
                .expect("commit");
        }
    }
    {
        let db = redb::Database::create(&path).expect("open");
        let transaction = db.begin_write().expect("begin");
        transaction
            .open_table(redb::TableDefinition::<&str, u64>::new("meta"))
            .expect("meta")
            .insert("schema", 2)
            .expect("schema");
        transaction.commit().expect("commit");
    }
    assert_eq!(stamped_version(&path), Some(2));
    let expected: BTreeMap<String, Vec<u8>> = (293..300_u32)
        .map(|i| (format!("k{}", i % 7), format!("{{\"n\":{i}}}").into_bytes()))
        .collect();
    let store = open(&path);
    assert_eq!(store.load().expect("load"), expected);
    drop(store);
    assert_eq!(stamped_version(&path), Some(3));
}

#[test]
fn a_damaged_log_entry_is_reported_not_skipped() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    drop(open(&path));
    {
        let db = redb::Database::create(&path).expect("reopen raw");
        let transaction = db.begin_write().expect("begin");
        transaction
            .open_table(redb::TableDefinition::<u64, &[u8]>::new(LAYOUT.log))
            .expect("log")
            .insert(1, [9u8, 0, 0, 0, b'a'].as_slice())
            .expect("insert");
        transaction.commit().expect("commit");
    }
    let error = open(&path).load().expect_err("damaged");
    assert!(
        matches!(error, RecordLogError::Damaged { sequence: 1, .. }),
        "{error}"
    );
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

/// Commits that only touch `filler` until every earlier commit is folded
/// (the sweep in progress ends, and the next one, which covers them).
fn fill_until_folded(store: &RecordLog) {
    for _ in 0..LAYOUT.log_commits * 2 {
        store
            .commit([("filler", Some(b"x".as_slice()))])
            .expect("commit");
    }
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
        assert_eq!(store.log_len().expect("log"), 2, "nothing folded yet");
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
        assert_eq!(
            store.load().expect("load"),
            expected(&[("b", "1"), ("filler", "x")])
        );
    }
    assert_eq!(
        open(&path).load().expect("load"),
        expected(&[("b", "1"), ("filler", "x")])
    );
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
        let mut folded = want.clone();
        folded.insert("filler".to_owned(), b"x".to_vec());
        assert_eq!(store.load().expect("load"), folded, "from the table");
    }
    let mut folded = want;
    folded.insert("filler".to_owned(), b"x".to_vec());
    assert_eq!(open(&path).load().expect("load"), folded, "after a reopen");
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
    let size = || std::fs::metadata(&path).expect("metadata").len();
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
    for (key, value) in &writes {
        match value {
            Some(value) => model.insert(key.clone(), value.clone()),
            None => model.remove(key),
        };
    }
    writes
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

/// Runs the mixed workload for 12 bounds' worth of commits, checking the
/// log's length and a load after every commit, and a load after a reopen
/// after every `reopen_every`-th commit. Between reopens the in-memory
/// index of latest writes carries over; a reopen rebuilds it.
fn mixed_workload_with_reopens(reopen_every: u64) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let mut random = Xorshift(0x9e37_79b9_7f4a_7c15);
    let mut model = BTreeMap::new();
    let rounds = LAYOUT.log_commits * 12;
    let mut store = open(&path);
    for round in 0..rounds {
        let writes = mixed_commit(&mut random, round, &mut model);
        commit_writes(&store, &writes);
        let length = store.log_len().expect("log");
        assert!(length <= LOG_MAX, "{length} entries after commit {round}");
        assert_eq!(store.load().expect("load"), model, "after commit {round}");
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
    mixed_workload_with_reopens(1);
}

#[test]
fn folds_across_commits_without_a_reopen_load_exactly_the_latest_values() {
    mixed_workload_with_reopens(7);
}

#[test]
fn a_longer_log_is_back_under_its_bound_within_one_sweep() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    // A file written with a bound 4 times longer (as the version that
    // folded the whole log every 256 commits left up to 255 entries).
    let long = Layout {
        log_commits: LAYOUT.log_commits * 4,
        ..LAYOUT
    };
    let mut random = Xorshift(0x2545_f491_4f6c_dd1d);
    let mut model = BTreeMap::new();
    let mut round = 0;
    {
        let store = RecordLog::open(&path, long).expect("open");
        for _ in 0..long.log_commits * 2 - 1 {
            let writes = mixed_commit(&mut random, round, &mut model);
            commit_writes(&store, &writes);
            commit_two_new_keys(&store, round);
            for suffix in ["a", "b"] {
                model.insert(format!("z{round:06}{suffix}"), b"1".to_vec());
            }
            round += 1;
        }
        let length = store.log_len().expect("log");
        assert!(
            length > LOG_MAX * 2,
            "the longer bound let the log grow: {length}"
        );
    }
    let store = open(&path);
    assert_eq!(store.load().expect("load"), model, "opened as it is");
    for step in 0..LAYOUT.log_commits * 4 {
        let writes = mixed_commit(&mut random, round, &mut model);
        commit_writes(&store, &writes);
        let length = store.log_len().expect("log");
        if step + 1 >= LAYOUT.log_commits {
            assert!(length <= LOG_MAX, "{length} entries after step {step}");
        }
        assert_eq!(store.load().expect("load"), model, "after step {step}");
        round += 1;
    }
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
    for _ in 1..LAYOUT.log_commits {
        store
            .commit([("filler", Some(b"x".as_slice()))])
            .expect("commit");
    }
    // This commit would write "k" again and fold its first write; it is
    // aborted, so the first write is still the latest and must reach the
    // table when the next commit folds it.
    let error = store
        .commit_then_abort([("k", Some(b"2".as_slice()))])
        .expect_err("aborted");
    assert!(matches!(error, RecordLogError::Aborted), "{error}");
    fill_until_folded(&store);
    let want = expected(&[("filler", "x"), ("k", "1")]);
    assert_eq!(store.load().expect("load"), want);
    drop(store);
    assert_eq!(open(&path).load().expect("load"), want, "after a reopen");
}

#[test]
fn a_load_under_a_prefix_returns_exactly_the_latest_values_of_its_keys() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    store
        .commit([
            ("old/1", Some(b"1".as_slice())),
            ("old/2", Some(b"1")),
            ("old", Some(b"1")),
            ("older/1", Some(b"1")),
            ("p", Some(b"1")),
        ])
        .expect("commit");
    // Enough commits that the first one's keys are folded into the table,
    // then later writes that are still in the log.
    commit_many(&store, LAYOUT.log_commits * 2);
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
}
