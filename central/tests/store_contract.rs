//! The resident stores' record stores (memory, redb) pass the ledger core's
//! storage contract (`ledger::store::contract::check_store`), including a
//! reopen over the same data; the PostgreSQL schema is versioned and its
//! migration is idempotent across restarts.

mod common;

use central::SharedMemoryStore;
use central::store::{BatchStore, PostgresStore, RedbStore};
use common::{ThrowawayDatabase, postgres_url, t0, temp_dir};
use ledger::protocol::Scope;
use ledger::store::LedgerStore as _;
use ledger::store::contract::{check_store, sample_policy};
use ledger::{CentralConfig, Change, RecordKey};

fn config() -> CentralConfig {
    CentralConfig::default()
}

#[test]
fn memory_and_redb_record_stores_pass_the_ledger_contract() {
    check_store(SharedMemoryStore::new, |store| store);
    let root = temp_dir("redb-contract");
    let mut next = 0;
    check_store(
        || {
            next += 1;
            RedbStore::open(&root.join(format!("ledger-{next}.redb"))).expect("open")
        },
        |store| {
            let path = store.path().to_owned();
            drop(store);
            RedbStore::open(&path).expect("reopen")
        },
    );
    std::fs::remove_dir_all(root).ok();
}

#[test]
fn redb_refuses_a_second_writer_on_one_file() {
    let root = temp_dir("redb-exclusive");
    let path = root.join("ledger.redb");
    let _first = RedbStore::open(&path).expect("open");
    assert!(RedbStore::open(&path).is_err(), "one writer per file");
    std::fs::remove_dir_all(root).ok();
}

#[tokio::test]
async fn postgres_schema_is_versioned_and_migrations_are_idempotent() {
    let Some(url) = postgres_url() else { return };
    let database = ThrowawayDatabase::create(&url).await;
    let mut first = PostgresStore::connect(&database.url, config())
        .await
        .expect("connect");
    assert_eq!(first.schema_version().await.expect("version"), 2);
    let policy = Change::Policy(Box::new(sample_policy(1)));
    first.begin(&Scope::default(), t0()).await.expect("begin");
    first
        .commit(std::slice::from_ref(&policy))
        .await
        .expect("commit");
    drop(first);
    // A second replica (or a restart) migrates nothing and loses nothing.
    let second = PostgresStore::connect(&database.url, config())
        .await
        .expect("reconnect");
    assert_eq!(second.schema_version().await.expect("version"), 2);
    let loaded = second.load_all().await.expect("load");
    assert_eq!(loaded.len(), 1);
    assert!(matches!(loaded[0].key(), RecordKey::Policy(_, 1)));
    drop(second);
    database.drop_database().await;
}

#[test]
fn redb_records_survive_a_reopen_in_key_order() {
    let root = temp_dir("redb-order");
    let path = root.join("ledger.redb");
    let mut store = RedbStore::open(&path).expect("open");
    let changes: Vec<Change> = (1..=3)
        .rev()
        .map(|generation| Change::Policy(Box::new(sample_policy(generation))))
        .collect();
    store.commit(&changes).expect("commit");
    drop(store);
    let loaded = RedbStore::open(&path)
        .expect("reopen")
        .load_all()
        .expect("load");
    let generations: Vec<u64> = loaded
        .iter()
        .map(|change| match change.key() {
            RecordKey::Policy(_, generation) => generation,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(generations, vec![1, 2, 3]);
    std::fs::remove_dir_all(root).ok();
}
