//! The redb journal's contract: what a commit returns `Ok` for survives a
//! reopen; a commit that fails stores nothing of any batch it was given; a
//! later record under the same key replaces the earlier one — across the
//! log, its checkpoints into the keyed table, and an upgrade from the
//! layout without a log.

use std::path::PathBuf;

use agent::core::{JournalBatch, JournalRecord};
use agent::journal::{CHECKPOINT_COMMITS, Journal, JournalError, encode_key};
use ledger::PairKey;
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
        assert!(matches!(error, JournalError::Aborted), "{error}");
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

/// Commits `count` times: each moves fence "a" to `i` and adds fence `s<i>`.
fn commit_many(journal: &Journal, from: u64, count: u64) {
    for i in from..from + count {
        journal
            .commit(&[batch(i, vec![fence("a", i), fence(&format!("s{i}"), i)])])
            .expect("commit");
    }
}

fn expected_after(count: u64) -> Vec<JournalRecord> {
    let mut expected: Vec<JournalRecord> = (0..count)
        .map(|i| fence(&format!("s{i}"), i))
        .chain([fence("a", count - 1)])
        .collect();
    expected.sort_by_key(|record| encode_key(&record.key()));
    expected
}

#[test]
fn the_log_folds_into_the_table_and_loads_the_latest_record_per_key() {
    let dir = temp_dir("journal-checkpoint");
    let path = dir.join("journal.redb");
    let count = CHECKPOINT_COMMITS * 2 + 7;
    {
        let journal = Journal::open(&path).expect("open");
        commit_many(&journal, 0, count);
        assert_eq!(journal.log_len().expect("log"), 7, "two checkpoints ran");
        assert_eq!(journal.load().expect("load"), expected_after(count));
    }
    let journal = Journal::open(&path).expect("reopen");
    assert_eq!(journal.load().expect("load"), expected_after(count));
    drop(journal);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_aborted_checkpoint_stores_nothing() {
    let dir = temp_dir("journal-checkpoint-abort");
    let path = dir.join("journal.redb");
    let journal = Journal::open(&path).expect("open");
    let count = CHECKPOINT_COMMITS - 1;
    commit_many(&journal, 0, count);
    // This commit would reach the mark and fold the log.
    let error = journal
        .commit_then_abort(&[batch(count, vec![fence("a", 999)])])
        .expect_err("aborted");
    assert!(matches!(error, JournalError::Aborted), "{error}");
    assert_eq!(journal.log_len().expect("log"), count, "nothing folded");
    assert_eq!(journal.load().expect("load"), expected_after(count));
    drop(journal);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_journal_without_a_log_is_upgraded_in_place() {
    let dir = temp_dir("journal-upgrade");
    let path = dir.join("journal.redb");
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
                .open_table(redb::TableDefinition::<&str, &[u8]>::new("journal"))
                .expect("journal");
            let record = fence("a", 1);
            let value = serde_json::to_vec(&record).expect("JSON");
            records
                .insert(encode_key(&record.key()).as_str(), value.as_slice())
                .expect("insert");
        }
        transaction.commit().expect("commit");
    }
    let journal = Journal::open(&path).expect("open upgrades");
    assert_eq!(journal.load().expect("load"), vec![fence("a", 1)]);
    journal
        .commit(&[batch(1, vec![fence("a", 2)])])
        .expect("commit");
    drop(journal);
    let journal = Journal::open(&path).expect("reopen");
    assert_eq!(journal.load().expect("load"), vec![fence("a", 2)]);
    drop(journal);
    let _ = std::fs::remove_dir_all(dir);
}
