//! The redb journal's contract: what a commit returns `Ok` for survives a
//! reopen; a commit that fails stores nothing of any batch it was given; a
//! later record under the same key replaces the earlier one; a journal
//! written with JSON values and an earlier key encoding is read and
//! rekeyed. (The log, its folds and layout upgrades are the `record-log`
//! crate's tests.)

use std::path::PathBuf;

use agent::journal::{Journal, JournalError};
use agent_core::{JournalBatch, JournalRecord};
use ledger::{LocalReservation, PairKey, ShardChange};
use record_log::RecordLogError;
use shard_format::{ReservationId, ReservationState, Route, ShardId, Subject};

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

fn local_reservation(shard: &str, id: &str, state: ReservationState) -> JournalRecord {
    JournalRecord::ShardBook {
        shard: ShardId::new(shard).expect("valid"),
        change: ShardChange::Reservation(LocalReservation {
            reservation: ReservationId::new(id).expect("valid"),
            units: 3,
            state,
            operation_id: None,
            expires_at_ms: 60_000,
            actual_units: None,
            overdraft_units: 0,
        }),
    }
}

#[test]
fn a_journal_of_json_records_under_old_keys_is_read_and_rekeyed() {
    let dir = temp_dir("journal-rekey");
    let path = dir.join("journal.redb");
    // As the binary before MessagePack values and co-located keys wrote
    // it: JSON values, a shard reservation under `shard-reservation/…`.
    let old = local_reservation("sh-1", "rl-1", ReservationState::Reserved);
    {
        let store = record_log::RecordLog::open(&path, agent::journal::LAYOUT).expect("open");
        let json = serde_json::to_vec(&old).expect("JSON");
        store
            .commit([
                ("shard-reservation/sh-1/rl-1", Some(json.as_slice())),
                (
                    "fence/a/chat.generate",
                    Some(serde_json::to_vec(&fence("a", 4)).expect("JSON").as_slice()),
                ),
            ])
            .expect("commit");
    }
    let journal = Journal::open(&path).expect("open rekeys");
    let mut loaded = journal.load().expect("load");
    loaded.sort_by_key(|record| format!("{record:?}"));
    assert_eq!(loaded, vec![fence("a", 4), old.clone()]);
    // The record now lives under its current key: a later record replaces
    // it and a forget removes it, with no copy left under the old key.
    let settled = local_reservation("sh-1", "rl-1", ReservationState::Released);
    journal
        .commit(&[batch(1, vec![settled.clone()])])
        .expect("commit");
    assert_eq!(journal.load().expect("load").len(), 2);
    assert!(journal.load().expect("load").contains(&settled));
    journal
        .commit(&[batch(2, vec![JournalRecord::Forget(settled.key())])])
        .expect("commit");
    assert_eq!(journal.load().expect("load"), vec![fence("a", 4)]);
    drop(journal);
    let journal = Journal::open(&path).expect("reopen");
    assert_eq!(journal.load().expect("load"), vec![fence("a", 4)]);
    drop(journal);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_damaged_record_is_an_error_naming_its_key() {
    let dir = temp_dir("journal-damaged");
    let path = dir.join("journal.redb");
    {
        let store = record_log::RecordLog::open(&path, agent::journal::LAYOUT).expect("open");
        store
            .commit([("fence/a/chat.generate", Some(b"\x82\xa4kind".as_slice()))])
            .expect("commit");
    }
    // Opening reads only what it rekeys; loading, as the daemon does
    // next, reads every record.
    let journal = Journal::open(&path).expect("open");
    let error = journal.load().expect_err("refused");
    assert!(
        matches!(&error, JournalError::Corrupt { key, .. } if key == "fence/a/chat.generate"),
        "{error}"
    );
    drop(journal);
    let _ = std::fs::remove_dir_all(dir);
}
