//! The redb journal's contract: what a commit returns `Ok` for survives a
//! reopen; a commit that fails stores nothing of any batch it was given; a
//! later record under the same key replaces the earlier one; a journal
//! written with JSON values and an earlier key encoding is read and
//! rekeyed; reservations are keyed in the order they came, and a failed
//! commit moves none; a reservation's record with its holds replaces the
//! holds an older journal stored on their own; a reservation's record
//! written with field names is read, and written again in the compact
//! form. Appends taken in turns land in turn order whichever thread comes
//! first, and a failed append refuses the turns after it. (The log, its
//! folds and
//! layout upgrades are the `record-log` crate's tests.)

use std::path::PathBuf;

use agent::journal::{Journal, JournalError};
use agent_core::{
    AgentReservation, AgentState, JournalBatch, JournalKey, JournalRecord, ReservationPath,
    ShardHold, one_word,
};
use ledger::{LocalReservation, PairKey, ShardChange};
use record_log::RecordLogError;
use shard_format::{
    Digest, IdempotencyKey, ReservationId, ReservationState, Route, ShardId, Subject,
};

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
    // And as the binary before reservations were keyed in order wrote one.
    let keyed_by_id = local_reservation("sh-1", "rl-2", ReservationState::Reserved);
    {
        let store = record_log::RecordLog::open(&path, agent::journal::LAYOUT).expect("open");
        let json = serde_json::to_vec(&old).expect("JSON");
        let packed = record_log::value::encode(&keyed_by_id);
        store
            .commit([
                ("shard-reservation/sh-1/rl-1", Some(json.as_slice())),
                ("reservation/rl-2/shard/sh-1", Some(packed.as_slice())),
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
    assert_eq!(
        loaded,
        vec![fence("a", 4), old.clone(), keyed_by_id.clone()]
    );
    journal
        .commit(&[batch(1, vec![JournalRecord::Forget(keyed_by_id.key())])])
        .expect("commit");
    // The record now lives under its current key: a later record replaces
    // it and a forget removes it, with no copy left under the old key.
    let settled = local_reservation("sh-1", "rl-1", ReservationState::Released);
    journal
        .commit(&[batch(2, vec![settled.clone()])])
        .expect("commit");
    assert_eq!(journal.load().expect("load").len(), 2);
    assert!(journal.load().expect("load").contains(&settled));
    journal
        .commit(&[batch(3, vec![JournalRecord::Forget(settled.key())])])
        .expect("commit");
    assert_eq!(journal.load().expect("load"), vec![fence("a", 4)]);
    drop(journal);
    let journal = Journal::open(&path).expect("reopen");
    assert_eq!(journal.load().expect("load"), vec![fence("a", 4)]);
    drop(journal);
    let store = record_log::RecordLog::open(&path, agent::journal::LAYOUT).expect("open");
    assert_eq!(
        store.load().expect("load").len(),
        1,
        "no copy under an old key"
    );
    drop(store);
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

/// The keys of every reservation record in the journal at `path` (closed).
fn reservation_keys(path: &std::path::Path) -> Vec<String> {
    let store = record_log::RecordLog::open(path, agent::journal::LAYOUT).expect("open");
    store.keys_under("reservations/").expect("keys")
}

#[test]
fn reservations_are_keyed_in_the_order_they_came_and_keep_their_place() {
    let dir = temp_dir("journal-order");
    let path = dir.join("journal.redb");
    let reserved = ReservationState::Reserved;
    {
        let journal = Journal::open(&path).expect("open");
        journal
            .commit(&[batch(1, vec![local_reservation("sh-1", "rl-z", reserved)])])
            .expect("commit");
        journal
            .commit(&[
                batch(2, vec![local_reservation("sh-1", "rl-a", reserved)]),
                batch(3, vec![local_reservation("sh-2", "rl-z", reserved)]),
            ])
            .expect("commit");
        // A later record of a reservation stays under its first ordinal.
        journal
            .commit(&[batch(
                4,
                vec![local_reservation(
                    "sh-1",
                    "rl-z",
                    ReservationState::Released,
                )],
            )])
            .expect("commit");
    }
    assert_eq!(
        reservation_keys(&path),
        [
            "reservations/0000000000000000/rl-z/shard/sh-1",
            "reservations/0000000000000000/rl-z/shard/sh-2",
            "reservations/0000000000000001/rl-a/shard/sh-1",
        ]
    );
    {
        // Reopened, the ordinals are read from the keys: old reservations
        // are found under them, a new one comes after them.
        let journal = Journal::open(&path).expect("reopen");
        let forget_z1 = local_reservation("sh-1", "rl-z", reserved).key();
        journal
            .commit(&[batch(
                5,
                vec![
                    JournalRecord::Forget(forget_z1),
                    local_reservation("sh-1", "rl-b", reserved),
                ],
            )])
            .expect("commit");
        // rl-z keeps its place while a record of it (sh-2's) is stored.
        let forget_z2 = local_reservation("sh-2", "rl-z", reserved).key();
        journal
            .commit(&[batch(6, vec![JournalRecord::Forget(forget_z2)])])
            .expect("commit");
        assert_eq!(
            journal.load().expect("load"),
            vec![
                local_reservation("sh-1", "rl-a", reserved),
                local_reservation("sh-1", "rl-b", reserved),
            ]
        );
        // Forgotten whole, a reservation written again comes last.
        journal
            .commit(&[batch(7, vec![local_reservation("sh-3", "rl-z", reserved)])])
            .expect("commit");
    }
    assert_eq!(
        reservation_keys(&path),
        [
            "reservations/0000000000000001/rl-a/shard/sh-1",
            "reservations/0000000000000002/rl-b/shard/sh-1",
            "reservations/0000000000000003/rl-z/shard/sh-3",
        ]
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Reservation `id`'s record, admitted from shard `shard`, with its hold.
fn reservation_with_hold(shard: &str, id: &str, state: ReservationState) -> JournalRecord {
    let JournalRecord::ShardBook {
        change: ShardChange::Reservation(local),
        ..
    } = local_reservation(shard, id, state)
    else {
        unreachable!("a hold")
    };
    let shard = ShardId::new(shard).expect("valid");
    let record = AgentReservation {
        reservation: local.reservation.clone(),
        idempotency_key: IdempotencyKey::new(format!("key-{id}")).expect("valid"),
        subject: Subject::new("tenant-a").expect("valid"),
        route: Route::new("chat.generate").expect("valid"),
        units: local.units,
        min_units: None,
        reserved_units: Some(one_word(local.units)),
        request_digest: Digest::sha256(id.as_bytes()),
        priority: 0,
        deadline_ms: None,
        path: ReservationPath::Shard(shard.clone()),
        state: AgentState::Reserved,
        operation_id: None,
        actual_units: None,
        receipt: None,
        settlement: None,
        rejection: None,
        sync: None,
        cancel_requested: false,
        shadow: false,
        boot_epoch: 1,
        ended_at: None,
        legs: Default::default(),
        hold_state: None,
        hold_expires_at_ms: 0,
        hold_overdraft_units: 0,
    };
    JournalRecord::ReservationWithHolds {
        record: Box::new(record),
        holds: vec![ShardHold { shard, local }],
    }
}

#[test]
fn a_reservation_written_with_its_holds_deletes_the_holds_stored_on_their_own() {
    let dir = temp_dir("journal-holds");
    let path = dir.join("journal.redb");
    let reserved = ReservationState::Reserved;
    let released = ReservationState::Released;
    let journal = Journal::open(&path).expect("open");
    // As the binary before holds joined their reservation's record wrote
    // them: a hold of rl-a on two shards, of rl-b on one.
    journal
        .commit(&[batch(
            1,
            vec![
                local_reservation("sh-1", "rl-a", reserved),
                local_reservation("sh-2", "rl-a", reserved),
                local_reservation("sh-1", "rl-b", reserved),
            ],
        )])
        .expect("commit");
    // rl-a's record with its holds replaces both; rl-b's forget deletes its
    // hold.
    let rl_a = reservation_with_hold("sh-1", "rl-a", released);
    let forget_b = JournalRecord::Forget(JournalKey::Reservation(
        ReservationId::new("rl-b").expect("valid"),
    ));
    journal
        .commit(&[batch(2, vec![rl_a.clone(), forget_b])])
        .expect("commit");
    assert_eq!(journal.load().expect("load"), vec![rl_a]);
    drop(journal);
    assert_eq!(
        reservation_keys(&path),
        ["reservations/0000000000000000/rl-a"],
        "one record per reservation, under its first ordinal"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_failed_commit_leaves_every_reservation_where_it_was() {
    let dir = temp_dir("journal-order-abort");
    let path = dir.join("journal.redb");
    let reserved = ReservationState::Reserved;
    let journal = Journal::open(&path).expect("open");
    journal
        .commit(&[batch(1, vec![local_reservation("sh-1", "rl-a", reserved)])])
        .expect("commit");
    let forget = JournalRecord::Forget(local_reservation("sh-1", "rl-a", reserved).key());
    journal
        .commit_then_abort(&[batch(
            2,
            vec![forget.clone(), local_reservation("sh-1", "rl-b", reserved)],
        )])
        .expect_err("aborted");
    // Had the aborted forget dropped rl-a's place, this one would find no
    // key to delete and rl-a would stay.
    journal
        .commit(&[batch(
            2,
            vec![forget, local_reservation("sh-1", "rl-c", reserved)],
        )])
        .expect("commit");
    assert_eq!(
        journal.load().expect("load"),
        vec![local_reservation("sh-1", "rl-c", reserved)]
    );
    drop(journal);
    // The aborted commit's new reservation took no ordinal.
    assert_eq!(
        reservation_keys(&path),
        ["reservations/0000000000000001/rl-c/shard/sh-1"]
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A reservation's records, its holds' included, go in the group of its
/// ordinal's sixteen; the other records stay alone.
#[test]
fn a_reservations_records_are_kept_in_the_group_of_sixteen_ordinals() {
    let group = agent::journal::LAYOUT.group;
    assert_eq!(
        group("reservations/000000000000002f/rl-1"),
        Some("reservations/000000000000002")
    );
    assert_eq!(
        group("reservations/0000000000000030/rl-2/shard/sh-1"),
        Some("reservations/000000000000003")
    );
    assert_eq!(group("reservation/rl-1/shard/sh-2"), None);
    assert_eq!(group("fence/a"), None);
}

#[test]
fn a_key_under_reservations_that_this_journal_did_not_write_is_refused() {
    let dir = temp_dir("journal-bad-key");
    let path = dir.join("journal.redb");
    for key in [
        "reservations/rl-1",
        "reservations/000000000000000g/rl-1",
        "reservations/000000000000000A/rl-1",
        "reservations/+00000000000000a/rl-1",
        "reservations/1/rl-1",
        "reservations/0000000000000000/rl-1/book/sh-1",
        "reservations/0000000000000000/rl-1/shard/sh-1/x",
    ] {
        {
            let store = record_log::RecordLog::open(&path, agent::journal::LAYOUT).expect("open");
            store
                .commit([(key, Some(b"x".as_slice()))])
                .expect("commit");
        }
        let error = Journal::open(&path).expect_err(key);
        assert!(
            matches!(&error, JournalError::UnreadableKey { key: named } if named == key),
            "{key}: {error}"
        );
        let store = record_log::RecordLog::open(&path, agent::journal::LAYOUT).expect("open");
        store.commit([(key, None)]).expect("commit");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_rekey_cut_short_by_a_crash_is_finished_at_the_next_open() {
    let dir = temp_dir("journal-rekey-resumed");
    let path = dir.join("journal.redb");
    let reserved = ReservationState::Reserved;
    // rl-1's record in sh-1 was moved before the crash, its record in sh-2
    // and rl-2 not yet; thousands more wait under old keys (more than one
    // commit of the rekey takes).
    let old: Vec<JournalRecord> = (0..5_000)
        .map(|i| local_reservation("sh-3", &format!("rl-old-{i:04}"), reserved))
        .collect();
    {
        let store = record_log::RecordLog::open(&path, agent::journal::LAYOUT).expect("open");
        let moved = record_log::value::encode(&local_reservation("sh-1", "rl-1", reserved));
        let left = record_log::value::encode(&local_reservation("sh-2", "rl-1", reserved));
        let other = record_log::value::encode(&local_reservation("sh-1", "rl-2", reserved));
        let packed: Vec<(String, Vec<u8>)> = old
            .iter()
            .map(|record| {
                let JournalRecord::ShardBook {
                    change: ShardChange::Reservation(local),
                    ..
                } = record
                else {
                    unreachable!("built above")
                };
                (
                    format!("reservation/{}/shard/sh-3", local.reservation),
                    record_log::value::encode(record),
                )
            })
            .collect();
        store
            .commit(
                [
                    (
                        "reservations/0000000000000007/rl-1/shard/sh-1",
                        Some(moved.as_slice()),
                    ),
                    ("reservation/rl-1/shard/sh-2", Some(left.as_slice())),
                    ("reservation/rl-2/shard/sh-1", Some(other.as_slice())),
                ]
                .into_iter()
                .chain(
                    packed
                        .iter()
                        .map(|(key, value)| (key.as_str(), Some(value.as_slice()))),
                ),
            )
            .expect("commit");
    }
    let journal = Journal::open(&path).expect("open finishes the rekey");
    assert_eq!(journal.load().expect("load").len(), 5_003);
    drop(journal);
    let keys = reservation_keys(&path);
    assert_eq!(keys.len(), 5_003, "nothing left under an old key");
    // rl-1 keeps the ordinal it was given; the rest come after it.
    assert!(keys.contains(&"reservations/0000000000000007/rl-1/shard/sh-1".to_owned()));
    assert!(keys.contains(&"reservations/0000000000000007/rl-1/shard/sh-2".to_owned()));
    assert!(
        keys.iter()
            .filter(|key| !key.contains("/rl-1/"))
            .all(|key| key.as_str() > "reservations/0000000000000007/"),
        "{keys:?}"
    );
    let store = record_log::RecordLog::open(&path, agent::journal::LAYOUT).expect("open");
    assert_eq!(store.load().expect("load").len(), 5_003);
    drop(store);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_reservation_written_with_field_names_is_read_and_rewritten_compact() {
    let dir = temp_dir("journal-compact");
    let path = dir.join("journal.redb");
    let key = "reservations/0000000000000000/rl-a";
    let named = reservation_with_hold("sh-1", "rl-a", ReservationState::Reserved);
    {
        // As the binary before the compact form wrote it.
        let store = record_log::RecordLog::open(&path, agent::journal::LAYOUT).expect("open");
        let value = record_log::value::encode(&named);
        store
            .commit([(key, Some(value.as_slice()))])
            .expect("commit");
    }
    let journal = Journal::open(&path).expect("open");
    assert_eq!(journal.load().expect("load"), vec![named]);
    let settled = reservation_with_hold("sh-1", "rl-a", ReservationState::Settled);
    journal
        .commit(&[batch(1, vec![settled.clone()])])
        .expect("commit");
    assert_eq!(journal.load().expect("load"), vec![settled.clone()]);
    drop(journal);
    let store = record_log::RecordLog::open(&path, agent::journal::LAYOUT).expect("open");
    let stored = store.load().expect("load");
    assert_eq!(stored.keys().collect::<Vec<_>>(), [key], "under its place");
    assert!(
        record_log::value::is_positional(&stored[key]),
        "written compact"
    );
    drop(store);
    assert_eq!(
        Journal::open(&path).expect("open").load().expect("load"),
        vec![settled]
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// The daemon takes turns in the order the core made the batches, then
/// appends from two threads: the later turn waits for the earlier one, so
/// the later record of a key is the one kept.
#[test]
fn appends_land_in_the_order_of_their_turns_whichever_thread_comes_first() {
    let dir = temp_dir("journal-turns");
    let path = dir.join("journal.redb");
    {
        let journal = Journal::open(&path).expect("open");
        let earlier = journal.turn();
        let later = journal.turn();
        std::thread::scope(|scope| {
            let second = scope.spawn(|| {
                journal
                    .append(later, &[batch(2, vec![fence("a", 2)])])
                    .and_then(|appended| appended.sync())
            });
            journal
                .append(earlier, &[batch(1, vec![fence("a", 1), fence("b", 1)])])
                .and_then(|appended| appended.sync())
                .expect("earlier turn");
            second.join().expect("thread").expect("later turn");
        });
    }
    let journal = Journal::open(&path).expect("reopen");
    let mut loaded = journal.load().expect("load");
    loaded.sort_by_key(|record| format!("{record:?}"));
    assert_eq!(loaded, vec![fence("a", 2), fence("b", 1)]);
    drop(journal);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_failed_append_refuses_the_turns_after_it() {
    let dir = temp_dir("journal-turn-failed");
    let path = dir.join("journal.redb");
    let journal = Journal::open(&path).expect("open");
    // A commit appended and dropped unsynced breaks the store: the next
    // append fails.
    let dropped = journal
        .append(journal.turn(), &[batch(1, vec![fence("a", 1)])])
        .expect("append");
    drop(dropped);
    let failing = journal.turn();
    let after = journal.turn();
    assert!(matches!(
        journal.append(failing, &[batch(2, vec![fence("a", 2)])]),
        Err(JournalError::Store(RecordLogError::Broken { .. }))
    ));
    assert!(matches!(
        journal.append(after, &[batch(3, vec![fence("a", 3)])]),
        Err(JournalError::EarlierAppendFailed)
    ));
    drop(journal);
    let _ = std::fs::remove_dir_all(dir);
}
