//! Deletions (retention): a deleted key is gone after a reopen, whether its
//! deletion is still in the log or already folded into the table; the last
//! write per key wins, deletion or not, within a commit and across commits;
//! a failed commit deletes nothing; and a steady put/delete workload keeps
//! the file from growing (freed pages are reused).

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

/// Commits that only touch `filler` until the log is folded.
fn fill_until_folded(store: &RecordLog) {
    while store.log_len().expect("log") > 0 {
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
