//! The redb journal's contract: what a commit returns `Ok` for survives a
//! reopen; a commit that fails stores nothing of any batch it was given; a
//! later record under the same key replaces the earlier one. (The log,
//! its folds and layout upgrades are the `record-log` crate's tests.)

use std::path::PathBuf;

use agent::journal::{Journal, JournalError};
use agent_core::{JournalBatch, JournalRecord};
use ledger::PairKey;
use record_log::RecordLogError;
use shard_format::{Route, Subject};

fn temp_dir(name: &str) -> PathBuf {
    let mut suffix = [0u8; 8];
    getrandom::fill(&mut suffix).expect("randomness");
    let dir = std::env::temp_dir().join(format!("reservoir-{name}-{}", hex::encode(suffix)));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn fence(subject: &str, value: u64) -> JournalRecord {
    JournalRecord::Fence {
        pair: PairKey::new(
            Subject::new(subject).expect("valid"),
            Route::new("chat.generate").expect("valid"),
        ),
        fence: value,
    }
}

fn batch(seq: u64, records: Vec<JournalRecord>) -> JournalBatch {
    JournalBatch { seq, records }
}

#[test]
fn committed_records_survive_a_reopen() {
    let dir = temp_dir("journal-reopen");
    let path = dir.join("journal.redb");
    {
        let journal = Journal::open(&path).expect("open");
        assert!(journal.load().expect("load").is_empty());
        journal
            .commit(&[batch(1, vec![fence("a", 1), fence("b", 1)])])
            .expect("commit");
        // Group commit: two batches, one transaction; a later record under
        // the same key replaces the earlier one.
        journal
            .commit(&[
                batch(2, vec![fence("a", 2)]),
                batch(3, vec![fence("c", 1), fence("a", 3)]),
            ])
            .expect("commit");
    }
    let journal = Journal::open(&path).expect("reopen");
    let mut loaded = journal.load().expect("load");
    loaded.sort_by_key(|record| format!("{record:?}"));
    let mut expected = vec![fence("a", 3), fence("b", 1), fence("c", 1)];
    expected.sort_by_key(|record| format!("{record:?}"));
    assert_eq!(loaded, expected);
    drop(journal);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_failed_commit_stores_nothing_of_its_batches() {
    let dir = temp_dir("journal-atomic");
    let path = dir.join("journal.redb");
    {
        let journal = Journal::open(&path).expect("open");
        journal
            .commit(&[batch(1, vec![fence("a", 1)])])
            .expect("commit");
        // The transaction aborts: neither the new records nor the
        // overwrite of "a" may be visible.
        let error = journal
            .commit_then_abort(&[
                batch(2, vec![fence("a", 9), fence("b", 9)]),
                batch(3, vec![fence("c", 9)]),
            ])
            .expect_err("aborted");
        assert!(
            matches!(error, JournalError::Store(RecordLogError::Aborted)),
            "{error}"
        );
        assert_eq!(journal.load().expect("load"), vec![fence("a", 1)]);
    }
    let journal = Journal::open(&path).expect("reopen");
    assert_eq!(journal.load().expect("load"), vec![fence("a", 1)]);
    drop(journal);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_second_open_of_the_same_file_fails() {
    let dir = temp_dir("journal-lock");
    let path = dir.join("journal.redb");
    let journal = Journal::open(&path).expect("open");
    assert!(Journal::open(&path).is_err(), "one process per journal");
    drop(journal);
    let _ = std::fs::remove_dir_all(dir);
}
