//! Every store the writer runs on passes the [`BatchStore`] contract
//! (`central::store::contract`): memory and redb as resident stores, and
//! PostgreSQL as the production path runs it (per-batch locks, loads, and
//! a reconnect after a lost connection). Their record stores pass the
//! ledger core's storage contract (`ledger::store::contract::check_store`)
//! too; two PostgreSQL replicas hold batches over disjoint pairs at once
//! and serialize batches over one pair; the PostgreSQL schema is versioned
//! and its migration is idempotent across restarts.

mod common;

use std::time::Duration;

use central::store::contract::{
    check_batch_store, check_commit_behind, check_failed_commit, check_failed_commit_behind,
};
use central::store::{Batch, BatchStore, PostgresStore, RedbStore, ResidentStore, batch_scope};
use central::{Operation, SharedMemoryStore};
use common::{ThrowawayDatabase, postgres_url, t0, temp_dir};
use ledger::protocol::{Context, Scope};
use ledger::store::LedgerStore as _;
use ledger::store::contract::{check_store, sample_policy};
use ledger::{CentralConfig, Change, PairKey, RecordKey, ReserveRequest};
use shard_format::{Digest, Ed25519Signer, Ed25519Verifier, KeyId};

fn config() -> CentralConfig {
    CentralConfig::default()
}

#[tokio::test]
async fn memory_store_passes_the_batch_contract() {
    check_batch_store(
        async || ResidentStore::open(SharedMemoryStore::new(), config()).expect("open"),
        async |store: ResidentStore<SharedMemoryStore>| {
            ResidentStore::open(store.into_store(), config()).expect("reopen")
        },
    )
    .await;
}

#[tokio::test]
async fn memory_store_survives_a_failed_commit() {
    let store = ResidentStore::open(SharedMemoryStore::new(), config()).expect("open");
    check_failed_commit(
        store,
        async |store: &mut ResidentStore<SharedMemoryStore>| {
            store.store().fail_next_commits(1);
        },
    )
    .await;
}

#[tokio::test]
async fn memory_store_commits_behind() {
    let store = ResidentStore::open(SharedMemoryStore::new(), config()).expect("open");
    check_commit_behind(store, async |store: ResidentStore<SharedMemoryStore>| {
        ResidentStore::open(store.into_store(), config()).expect("reopen")
    })
    .await;
    let store = ResidentStore::open(SharedMemoryStore::new(), config()).expect("open");
    check_failed_commit_behind(
        store,
        async |store: &mut ResidentStore<SharedMemoryStore>| {
            store.store().fail_next_commits(1);
        },
    )
    .await;
}

#[tokio::test]
async fn redb_store_commits_behind() {
    let root = temp_dir("redb-commit-behind");
    let path = root.join("ledger.redb");
    let store = RedbStore::open(&path).expect("open");
    check_commit_behind(
        ResidentStore::open(store, config()).expect("load"),
        async |store: ResidentStore<RedbStore>| {
            drop(store);
            ResidentStore::open(RedbStore::open(&path).expect("reopen"), config()).expect("load")
        },
    )
    .await;
    std::fs::remove_dir_all(root).ok();
}

#[tokio::test]
async fn redb_store_passes_the_batch_contract() {
    let root = temp_dir("redb-batch-contract");
    let mut next = 0;
    check_batch_store(
        async || {
            next += 1;
            let store = RedbStore::open(&root.join(format!("ledger-{next}.redb"))).expect("open");
            ResidentStore::open(store, config()).expect("load")
        },
        async |store: ResidentStore<RedbStore>| {
            let path = store.store().path().to_owned();
            drop(store);
            ResidentStore::open(RedbStore::open(&path).expect("reopen"), config()).expect("load")
        },
    )
    .await;
    std::fs::remove_dir_all(root).ok();
}

#[tokio::test]
async fn postgres_store_passes_the_batch_contract() {
    let Some(url) = postgres_url() else { return };
    let mut databases = Vec::new();
    check_batch_store(
        async || {
            let database = ThrowawayDatabase::create(&url).await;
            let store = PostgresStore::connect(&database.url, config())
                .await
                .expect("connect");
            databases.push(database);
            store
        },
        async |store: PostgresStore| {
            let url = store.url().to_owned();
            drop(store);
            PostgresStore::connect(&url, config())
                .await
                .expect("reconnect")
        },
    )
    .await;
    for database in databases {
        database.drop_database().await;
    }
}

/// A connection lost in the middle of a batch: the commit fails, nothing
/// of the batch is stored, and the next batch runs on a new connection.
#[tokio::test]
async fn postgres_store_survives_a_lost_connection() {
    let Some(url) = postgres_url() else { return };
    let database = ThrowawayDatabase::create(&url).await;
    let store = PostgresStore::connect(&database.url, config())
        .await
        .expect("connect");
    let (admin, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("admin connection");
    let task = tokio::spawn(connection);
    check_failed_commit(store, async |_: &mut PostgresStore| {
        let rows = admin
            .query(
                "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity
                 WHERE datname = $1",
                &[&database.name],
            )
            .await
            .expect("terminate");
        assert_eq!(rows.len(), 1, "the store's one connection is cut");
    })
    .await;
    drop(admin);
    let _ = task.await;
    database.drop_database().await;
}

fn pair(subject: &str) -> PairKey {
    PairKey::new(
        subject.parse().expect("valid"),
        "chat.generate".parse().expect("valid"),
    )
}

/// The gateway that owns these tests' reservations.
fn owner() -> shard_format::GatewayIdentity {
    format!("ed25519:{}", "33".repeat(32))
        .parse()
        .expect("valid")
}

fn request_on(pair: &PairKey, name: &str) -> ReserveRequest {
    ReserveRequest::new(
        owner(),
        name.parse().expect("valid"),
        pair.subject.clone(),
        pair.route.clone(),
        10,
        Digest::sha256(name.as_bytes()),
    )
}

fn reserve(pair: &PairKey, name: &str) -> Operation {
    Operation::Reserve(request_on(pair, name))
}

fn publish(pair: &PairKey) -> Operation {
    let mut policy = sample_policy(1);
    policy.subject = pair.subject.clone();
    policy.route = pair.route.clone();
    Operation::Publish(Box::new(policy))
}

/// Applies `operations` to an open batch: their changes.
fn apply_all(batch: &mut Batch<'_>, operations: Vec<Operation>) -> Vec<Change> {
    let signer = Ed25519Signer::from_secret_bytes(&[9; 32]);
    let verifier = Ed25519Verifier::new(Vec::<KeyId>::new());
    let context = Context {
        signer: &signer,
        gateway_verifier: &verifier,
    };
    let mut changes = Vec::new();
    for operation in operations {
        batch
            .apply(operation, t0(), context, &mut changes)
            .expect("not deferred");
    }
    changes
}

/// Two replicas over one database: batches over disjoint pairs run at the
/// same time; a batch over a pair another replica holds waits for its
/// commit and then sees it.
#[tokio::test]
async fn postgres_replicas_lock_per_pair() {
    let Some(url) = postgres_url() else { return };
    let database = ThrowawayDatabase::create(&url).await;
    let mut first = PostgresStore::connect(&database.url, config())
        .await
        .expect("connect");
    let mut second = PostgresStore::connect(&database.url, config())
        .await
        .expect("connect");
    let (pair_a, pair_b) = (pair("tenant-7"), pair("tenant-8"));
    let setup = vec![publish(&pair_a), publish(&pair_b)];
    let (scope, _) = batch_scope(setup.iter().map(|operation| (operation, false)));
    let mut batch = first.begin(&scope, t0()).await.expect("begin");
    let changes = apply_all(&mut batch, setup);
    first.commit(&changes).await.expect("commit");

    let on_a = reserve(&pair_a, "rl-a");
    let on_b = reserve(&pair_b, "rl-b");
    let (scope_a, _) = batch_scope([(&on_a, false)]);
    let (scope_b, _) = batch_scope([(&on_b, false)]);
    let mut batch = first.begin(&scope_a, t0()).await.expect("begin on A");
    assert!(
        batch.ledger.policy(&pair_a).is_some(),
        "the scope's records are loaded"
    );
    assert!(
        batch.ledger.policy(&pair_b).is_none(),
        "records outside the scope are not"
    );
    let held = apply_all(&mut batch, vec![on_a]);
    // While the first replica holds pair A, the second runs a batch on B.
    tokio::time::timeout(Duration::from_secs(30), async {
        let mut batch = second.begin(&scope_b, t0()).await.expect("begin on B");
        let changes = apply_all(&mut batch, vec![on_b]);
        second.commit(&changes).await.expect("commit on B");
    })
    .await
    .expect("a batch over another pair does not wait for the lock on A");
    // A batch of the second replica on A waits for the first's commit, and
    // then loads what it committed.
    let (committed, seen) = tokio::join!(first.commit(&held), async {
        let batch = second.begin(&scope_a, t0()).await.expect("begin on A");
        batch
            .ledger
            .reservation(&request_on(&pair_a, "rl-a").reservation)
            .is_some()
    });
    committed.expect("commit on A");
    assert!(seen, "the waiting batch sees the first replica's commit");
    second.abort().await.expect("abort");
    drop((first, second));
    database.drop_database().await;
}

/// A batch that reserves holds its reservation ID's lock row from its
/// first round trip: the row, new, is created with the lock (no retry, as
/// a new pair's row takes) and held until the batch ends; it stays
/// (created outside the transaction), free.
#[tokio::test]
async fn postgres_reserve_creates_and_holds_its_reservation_lock() {
    let Some(url) = postgres_url() else { return };
    let database = ThrowawayDatabase::create(&url).await;
    let mut store = PostgresStore::connect(&database.url, config())
        .await
        .expect("connect");
    assert_eq!(store.lock_retries(), 0);
    let pair_a = pair("tenant-7");
    let setup = vec![publish(&pair_a)];
    let (scope, _) = batch_scope(setup.iter().map(|operation| (operation, false)));
    let mut batch = store.begin(&scope, t0()).await.expect("begin");
    let changes = apply_all(&mut batch, setup);
    store.commit(&changes).await.expect("commit");
    assert_eq!(
        store.lock_retries(),
        1,
        "a new pair's lock row is created on a retry"
    );

    let (client, connection) = tokio_postgres::connect(&database.url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    let task = tokio::spawn(connection);
    let key = format!("rid/{}", request_on(&pair_a, "rl-a").reservation);
    let lock_now = "SELECT lock_key FROM reservoir_locks WHERE lock_key = $1 FOR UPDATE NOWAIT";
    let missing = client.query(lock_now, &[&key]).await.expect("query");
    assert!(missing.is_empty(), "no lock row before the reserve");

    let on_a = reserve(&pair_a, "rl-a");
    let (scope, _) = batch_scope([(&on_a, false)]);
    let _batch = store.begin(&scope, t0()).await.expect("begin the reserve");
    assert_eq!(
        store.lock_retries(),
        1,
        "the reserve's lock row came with the lock, without a retry"
    );
    let error = client
        .query(lock_now, &[&key])
        .await
        .expect_err("the batch holds the row");
    assert_eq!(
        error.code(),
        Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE),
        "{error}"
    );
    store.abort().await.expect("abort");
    let rows = client.query(lock_now, &[&key]).await.expect("free");
    assert_eq!(rows.len(), 1, "the row stays for the next batch");
    drop(client);
    task.abort();
    drop(store);
    database.drop_database().await;
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
    assert_eq!(first.schema_version().await.expect("version"), 4);
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
    assert_eq!(second.schema_version().await.expect("version"), 4);
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

/// Migration 3 on a database a version 2 binary wrote: terminal records
/// learn when their window started (`ended_at`, from the JSON body as the
/// ledger's `retained_since` does) and accounts their record count, so the
/// retention sweep finds old records and folds old accounts.
#[tokio::test]
async fn postgres_migration_3_backfills_retention_columns() {
    let Some(url) = postgres_url() else { return };
    let database = ThrowawayDatabase::create(&url).await;
    let mut store = PostgresStore::connect(&database.url, config())
        .await
        .expect("connect");
    let mut ledger = ledger::CentralLedger::new(config());
    let mut changes = ledger.publish_policy(sample_policy(1), t0()).changes;
    let reserve = |id: &str| request_on(&sample_pair(), id);
    changes.extend(ledger.reserve(reserve("rl-released"), t0()).changes);
    changes.extend(ledger.reserve(reserve("rl-held"), t0()).changes);
    let released_at = t0().saturating_add_ms(2_000);
    changes.extend(
        ledger
            .release(&ledger_id("rl-released"), released_at)
            .changes,
    );
    let abandoned_at = t0().saturating_add_ms(3_000);
    let lost = request_on(&sample_pair(), "rl-lost");
    let abandon = ledger::AbandonRequest {
        reservation: lost.reservation.clone(),
        caller: ledger::Caller::Gateway(owner()),
        origin: Some(lost.origin()),
    };
    changes.extend(ledger.abandon(&abandon, abandoned_at).changes);
    store.begin(&Scope::default(), t0()).await.expect("begin");
    store.commit(&changes).await.expect("commit");
    drop(store);

    // Make it what a version 2 binary left behind.
    let (client, connection) = tokio_postgres::connect(&database.url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    client
        .batch_execute(
            "UPDATE reservoir_records SET body = body #- '{record,endedAt}' #- '{record,records}';
             ALTER TABLE reservoir_records DROP COLUMN ended_at;
             UPDATE reservoir_schema_version SET version = 2;",
        )
        .await
        .expect("downgrade");

    let store = PostgresStore::connect(&database.url, config())
        .await
        .expect("migrate");
    assert_eq!(store.schema_version().await.expect("version"), 4);
    let ended = |key: &str| {
        let client = &client;
        let key = key.to_owned();
        async move {
            client
                .query_one(
                    "SELECT ended_at FROM reservoir_records WHERE record_key = $1",
                    &[&key],
                )
                .await
                .expect("row")
                .get::<_, Option<i64>>(0)
        }
    };
    // A record without `endedAt` counts from its hold's expiry (it never
    // settled); a tombstone from when it was abandoned; a live one never.
    let hold_ms = sample_policy(1).hold_ttl_ms;
    assert_eq!(
        ended(&format!("reservation/{}", ledger_id("rl-released"))).await,
        Some((t0().unix_ms() + hold_ms) as i64)
    );
    assert_eq!(
        ended(&format!("tombstone/{}", ledger_id("rl-lost"))).await,
        Some(abandoned_at.unix_ms() as i64)
    );
    assert_eq!(
        ended(&format!("reservation/{}", ledger_id("rl-held"))).await,
        None
    );
    let counts: Vec<Option<i64>> = client
        .query(
            "SELECT (body->'record'->>'records')::bigint FROM reservoir_records WHERE kind = 'account'",
            &[],
        )
        .await
        .expect("accounts")
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(counts, vec![Some(2)], "two reservations in the one account");
    // The migrated records load into a clean ledger.
    let loaded = store.load_all().await.expect("load");
    let reloaded = ledger::CentralLedger::from_records(config(), loaded).expect("clean");
    assert!(ledger::invariants::audit(&reloaded).is_clean());
    drop(store);
    database.drop_database().await;
}

/// The ID [`owner`] derives for `id` on the sample policy's pair.
fn ledger_id(id: &str) -> shard_format::ReservationId {
    request_on(&sample_pair(), id).reservation
}

fn sample_pair() -> PairKey {
    let policy = sample_policy(1);
    PairKey::new(policy.subject, policy.route)
}
