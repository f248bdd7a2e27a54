//! The record log's contract: what a commit returns `Ok` for survives a
//! reopen; a commit that fails stores nothing; a later value under the same
//! key replaces the earlier one — across the log, its folds into the keyed
//! table, and an upgrade from the layout without a log.

use std::collections::BTreeMap;
use std::path::Path;

use record_log::{Layout, RecordLog, RecordLogError};

const LAYOUT: Layout = Layout {
    records: "records",
    log: "records-log",
    checkpoint_commits: 16,
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
    let count = LAYOUT.checkpoint_commits * 2 + 7;
    {
        let store = open(&path);
        commit_many(&store, count);
        assert_eq!(store.log_len().expect("log"), 7, "two folds ran");
        assert_eq!(store.load().expect("load"), expected_after(count));
    }
    assert_eq!(open(&path).load().expect("load"), expected_after(count));
}

#[test]
fn an_aborted_fold_stores_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    let count = LAYOUT.checkpoint_commits - 1;
    commit_many(&store, count);
    // This commit would reach the mark and fold the log.
    let error = store
        .commit_then_abort([("a", Some(b"999".as_slice()))])
        .expect_err("aborted");
    assert!(matches!(error, RecordLogError::Aborted), "{error}");
    assert_eq!(store.log_len().expect("log"), count, "nothing folded");
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
            .insert("schema", 3)
            .expect("schema");
        transaction.commit().expect("commit");
    }
    let error = RecordLog::open(&path, LAYOUT).expect_err("refused");
    assert!(
        matches!(error, RecordLogError::Version { found: 3, .. }),
        "{error}"
    );
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
