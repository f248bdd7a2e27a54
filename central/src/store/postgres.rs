//! [`PostgresStore`]: the ledger's records in PostgreSQL, for many service
//! replicas over one database.
//!
//! # Schema (versioned, created and migrated on connect)
//!
//! - `reservoir_schema_version(version)`: one row, the applied migration.
//! - `reservoir_records`: one row per [`ledger::RecordKey`]: `record_key`
//!   ([`super::encode_key`]), `kind`, the record's `pair_key`
//!   (`subject/route`) and `account_key` where it has them, `live` (an
//!   account with debt or reserved units, a reservation that holds units or
//!   awaits a worker, an unreconciled shard), `due_at` (unix ms when a worker
//!   must next look at a live reservation) and `body`, the [`Change`] as
//!   JSONB.
//! - `reservoir_locks(lock_key)`: one row per `pair/<subject>/<route>`,
//!   `gateway/<identity>` and `rid/<reservation>` ever locked. Rows are never
//!   deleted; they exist to be locked.
//!
//! # One batch = one transaction ([`PostgresStore::run_batch`])
//!
//! 1. The lock rows of the batch's [`Scope`] are created if missing (outside
//!    the transaction) and then locked with `SELECT … ORDER BY lock_key FOR
//!    UPDATE`: always in key order, so two replicas never deadlock.
//! 2. Under the locks, the records the scope's operations can touch are
//!    loaded: the pairs' policies and pair rows, their current accounts (for
//!    `now`), every live account, reservation and shard of the pairs, and
//!    the target records by key.
//! 3. The caller builds a [`ledger::CentralLedger`] from them, applies the
//!    batch's operations and hands back the changes, which are upserted;
//!    then the transaction commits.
//!
//! Every record an operation reads or writes belongs to a locked pair (or
//! gateway, or reservation ID), and is read after the lock was taken, so
//! operations on one pair are serialized across replicas: linearizable per
//! account. A target that exists under a pair the batch did not lock (it
//! appeared between the unlocked lookup and the lock) is reported in
//! [`Loaded::unlocked`] and its operation must be retried in a later batch.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use ledger::store::LedgerStore;
use ledger::{AccountKey, Change, PairKey, RecordKey, epoch_start};
use shard_format::{ReservationState, Timestamp};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Json;
use tokio_postgres::{Client, GenericClient, NoTls};

use super::{encode_key, last_per_key, pair_key, parse_pair_key, sort_by_key};
use ledger::protocol::{Gauges, Scope};

/// The migrations, in order; `reservoir_schema_version.version` counts the
/// applied ones.
const MIGRATIONS: &[&str] = &[
    // 1: records and lock rows.
    "CREATE TABLE reservoir_records (
        record_key text PRIMARY KEY,
        kind text NOT NULL,
        pair_key text,
        account_key text,
        live boolean NOT NULL,
        due_at bigint,
        body jsonb NOT NULL
    );
    CREATE INDEX reservoir_records_pair ON reservoir_records (pair_key, kind);
    CREATE INDEX reservoir_records_account ON reservoir_records (account_key)
        WHERE account_key IS NOT NULL;
    CREATE INDEX reservoir_records_due ON reservoir_records (due_at)
        WHERE due_at IS NOT NULL;
    CREATE TABLE reservoir_locks (lock_key text PRIMARY KEY);",
    // 2: every batch loads the live records of its pairs; settled history
    // must not be scanned for them.
    "CREATE INDEX reservoir_records_live ON reservoir_records (pair_key, kind) WHERE live;",
];

/// Any number, the same in every replica: serializes concurrent migrations.
const MIGRATION_LOCK: i64 = 0x7265_7365_7276_6f69;

/// Why the PostgreSQL store failed.
#[derive(Debug, thiserror::Error)]
pub enum PostgresError {
    #[error("postgresql: {0}")]
    Database(#[from] tokio_postgres::Error),
    /// The database was migrated by a newer binary.
    #[error(
        "the database schema is at version {found}; this binary knows up to {known}: upgrade it"
    )]
    NewerSchema { found: i64, known: i64 },
    /// A `pair_key` column does not name a pair.
    #[error("stored record {0} has a malformed pair key")]
    Corrupt(String),
    /// The blocking adapter could not start its runtime.
    #[error("cannot start a runtime for the blocking store: {0}")]
    Runtime(std::io::Error),
}

impl PostgresError {
    /// A conflict between concurrent transactions that a retry resolves.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Database(error) => matches!(
                error.code(),
                Some(code) if *code == SqlState::T_R_SERIALIZATION_FAILURE
                    || *code == SqlState::T_R_DEADLOCK_DETECTED
            ),
            _ => false,
        }
    }
}

/// The lock rows of a batch's scope, in key order.
fn lock_keys(scope: &Scope) -> Vec<String> {
    let keys: BTreeSet<String> = scope
        .pairs
        .iter()
        .map(|pair| format!("pair/{}", pair_key(pair)))
        .chain(scope.gateways.iter().map(|id| format!("gateway/{id}")))
        .chain(scope.reservation_locks.iter().map(|id| format!("rid/{id}")))
        .collect();
    keys.into_iter().collect()
}

/// The records of a batch's scope, as loaded under its locks.
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    pub records: Vec<Change>,
    /// Record keys of targets that exist under a pair the batch did not
    /// lock: their operations must go to a later batch.
    pub unlocked: BTreeSet<String>,
}

/// The indexed columns of a record.
struct Columns {
    kind: &'static str,
    pair_key: Option<String>,
    account_key: Option<String>,
    live: bool,
    due_at: Option<i64>,
}

fn ms(timestamp: Timestamp) -> i64 {
    i64::try_from(timestamp.unix_ms()).unwrap_or(i64::MAX)
}

fn account_record_key(key: &AccountKey) -> String {
    encode_key(&RecordKey::Account(key.clone()))
}

fn columns(change: &Change) -> Columns {
    match change {
        Change::Policy(policy) => Columns {
            kind: "policy",
            pair_key: Some(format!("{}/{}", policy.subject, policy.route)),
            account_key: None,
            live: false,
            due_at: None,
        },
        Change::Pair(record) => Columns {
            kind: "pair",
            pair_key: Some(pair_key(&record.pair)),
            account_key: None,
            live: false,
            due_at: None,
        },
        Change::Account(account) => Columns {
            kind: "account",
            pair_key: Some(pair_key(&account.key.pair)),
            account_key: Some(account_record_key(&account.key)),
            live: account.terms.debt() > 0 || account.terms.reserved > 0,
            due_at: None,
        },
        Change::Reservation(record) => {
            let due_at = match record.receipt.state {
                ReservationState::Reserved => Some(ms(record.receipt.expires_at)),
                ReservationState::Expiring => Some(0),
                ReservationState::Started => record.usage_deadline.map(ms),
                ReservationState::UsageUnknown => record.hard_limit_at.map(ms),
                _ => None,
            };
            let key = record.account_key();
            Columns {
                kind: "reservation",
                pair_key: Some(pair_key(&key.pair)),
                account_key: Some(account_record_key(&key)),
                live: record.receipt.state.holds_units(),
                due_at,
            }
        }
        Change::Tombstone(_) => Columns {
            kind: "tombstone",
            pair_key: None,
            account_key: None,
            live: false,
            due_at: None,
        },
        Change::Gateway(_) => Columns {
            kind: "gateway",
            pair_key: None,
            account_key: None,
            live: false,
            due_at: None,
        },
        Change::Shard(record) => {
            let key = record.account_key();
            Columns {
                kind: "shard",
                pair_key: Some(pair_key(&key.pair)),
                account_key: Some(account_record_key(&key)),
                live: record.reconciliation.is_none(),
                due_at: None,
            }
        }
    }
}

const UPSERT: &str = "INSERT INTO reservoir_records
        (record_key, kind, pair_key, account_key, live, due_at, body)
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bool[],
                         $6::int8[], $7::jsonb[])
    ON CONFLICT (record_key) DO UPDATE SET
        kind = EXCLUDED.kind, pair_key = EXCLUDED.pair_key,
        account_key = EXCLUDED.account_key, live = EXCLUDED.live,
        due_at = EXCLUDED.due_at, body = EXCLUDED.body";

/// Writes `changes` (the last per key) in one statement.
async fn upsert(client: &impl GenericClient, changes: &[Change]) -> Result<(), PostgresError> {
    let changes: Vec<&Change> = last_per_key(changes);
    if changes.is_empty() {
        return Ok(());
    }
    let mut keys = Vec::with_capacity(changes.len());
    let mut kinds = Vec::with_capacity(changes.len());
    let mut pairs = Vec::with_capacity(changes.len());
    let mut accounts = Vec::with_capacity(changes.len());
    let mut live = Vec::with_capacity(changes.len());
    let mut due = Vec::with_capacity(changes.len());
    let mut bodies = Vec::with_capacity(changes.len());
    for change in changes {
        let columns = columns(change);
        keys.push(encode_key(&change.key()));
        kinds.push(columns.kind);
        pairs.push(columns.pair_key);
        accounts.push(columns.account_key);
        live.push(columns.live);
        due.push(columns.due_at);
        bodies.push(Json(change));
    }
    client
        .execute(
            UPSERT,
            &[&keys, &kinds, &pairs, &accounts, &live, &due, &bodies],
        )
        .await?;
    Ok(())
}

fn decode(rows: &[tokio_postgres::Row]) -> Result<Vec<Change>, PostgresError> {
    rows.iter()
        .map(|row| {
            row.try_get::<_, Json<Change>>("body")
                .map(|json| json.0)
                .map_err(PostgresError::from)
        })
        .collect()
}

/// The ledger's records in PostgreSQL. See the module documentation.
#[derive(Debug)]
pub struct PostgresStore {
    client: Client,
    connection: tokio::task::JoinHandle<()>,
}

impl Drop for PostgresStore {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host:port/database` or the
    /// key-value form) and creates or migrates the schema.
    pub async fn connect(url: &str) -> Result<Self, PostgresError> {
        let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
        let connection = tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::error!(%error, "postgresql connection ended");
            }
        });
        let mut store = Self { client, connection };
        store.migrate().await?;
        Ok(store)
    }

    /// Whether the connection is gone (the service then reconnects).
    pub fn is_closed(&self) -> bool {
        self.client.is_closed()
    }

    async fn migrate(&mut self) -> Result<(), PostgresError> {
        let transaction = self.client.transaction().await?;
        transaction
            .execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await?;
        transaction
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS reservoir_schema_version (version bigint NOT NULL)",
            )
            .await?;
        let found: Option<i64> = transaction
            .query_opt("SELECT version FROM reservoir_schema_version", &[])
            .await?
            .map(|row| row.get(0));
        let known = MIGRATIONS.len() as i64;
        let applied = found.unwrap_or(0);
        if applied > known {
            return Err(PostgresError::NewerSchema {
                found: applied,
                known,
            });
        }
        for (index, migration) in MIGRATIONS.iter().enumerate() {
            if (index as i64) < applied {
                continue;
            }
            tracing::info!(version = index + 1, "migrating the postgresql schema");
            transaction.batch_execute(migration).await?;
        }
        if found.is_none() {
            transaction
                .execute(
                    "INSERT INTO reservoir_schema_version (version) VALUES ($1)",
                    &[&known],
                )
                .await?;
        } else if applied < known {
            transaction
                .execute(
                    "UPDATE reservoir_schema_version SET version = $1",
                    &[&known],
                )
                .await?;
        }
        transaction.commit().await?;
        Ok(())
    }

    /// The schema version the database is at.
    pub async fn schema_version(&self) -> Result<i64, PostgresError> {
        let row = self
            .client
            .query_one("SELECT version FROM reservoir_schema_version", &[])
            .await?;
        Ok(row.get(0))
    }

    /// Commits `changes` in one transaction (contract items 1, 2, 4:
    /// PostgreSQL's commit is durable with the default `synchronous_commit`).
    pub async fn commit(&mut self, changes: &[Change]) -> Result<(), PostgresError> {
        let transaction = self.client.transaction().await?;
        upsert(&transaction, changes).await?;
        transaction.commit().await?;
        Ok(())
    }

    /// Every record, in key order, from one consistent snapshot.
    pub async fn load_all(&self) -> Result<Vec<Change>, PostgresError> {
        let rows = self
            .client
            .query("SELECT body FROM reservoir_records", &[])
            .await?;
        Ok(sort_by_key(decode(&rows)?))
    }

    /// The pairs of existing records by key (unlocked: a record's pair never
    /// changes once written).
    pub async fn pairs_of(
        &self,
        record_keys: &[String],
    ) -> Result<BTreeMap<String, PairKey>, PostgresError> {
        if record_keys.is_empty() {
            return Ok(BTreeMap::new());
        }
        let rows = self
            .client
            .query(
                "SELECT record_key, pair_key FROM reservoir_records
                 WHERE record_key = ANY($1) AND pair_key IS NOT NULL",
                &[&record_keys],
            )
            .await?;
        rows.iter()
            .map(|row| {
                let key: String = row.get(0);
                let pair: String = row.get(1);
                let pair =
                    parse_pair_key(&pair).ok_or_else(|| PostgresError::Corrupt(key.clone()))?;
                Ok((key, pair))
            })
            .collect()
    }

    /// Pairs with a live reservation due at `now` (expiry, usage deadline,
    /// hard limit), at most `limit`.
    pub async fn due_pairs(
        &self,
        now: Timestamp,
        limit: i64,
    ) -> Result<Vec<PairKey>, PostgresError> {
        let rows = self
            .client
            .query(
                "SELECT DISTINCT pair_key FROM reservoir_records
                 WHERE kind = 'reservation' AND live AND due_at <= $1
                 ORDER BY pair_key LIMIT $2",
                &[&ms(now), &limit],
            )
            .await?;
        Self::pairs_from(&rows)
    }

    /// Pairs with a policy after `after` (from the first when `None`), at
    /// most `limit`, in key order: a cursor over every pair.
    pub async fn pairs_after(
        &self,
        after: Option<&PairKey>,
        limit: i64,
    ) -> Result<Vec<PairKey>, PostgresError> {
        let after = after.map(pair_key).unwrap_or_default();
        let rows = self
            .client
            .query(
                "SELECT pair_key FROM reservoir_records WHERE kind = 'pair' AND pair_key > $1
                 ORDER BY pair_key LIMIT $2",
                &[&after, &limit],
            )
            .await?;
        Self::pairs_from(&rows)
    }

    fn pairs_from(rows: &[tokio_postgres::Row]) -> Result<Vec<PairKey>, PostgresError> {
        rows.iter()
            .map(|row| {
                let text: String = row.get(0);
                parse_pair_key(&text).ok_or(PostgresError::Corrupt(text))
            })
            .collect()
    }

    /// Totals for the Prometheus gauges, in one statement.
    pub async fn gauges(&self) -> Result<Gauges, PostgresError> {
        let row = self
            .client
            .query_one(
                "SELECT
                   COALESCE(SUM((body->'record'->'terms'->>'overdraftIssued')::bigint
                              - (body->'record'->'terms'->>'overdraftRepaid')::bigint)
                            FILTER (WHERE kind = 'account'), 0)::bigint,
                   COALESCE(SUM((body->'record'->'terms'->>'reserved')::bigint)
                            FILTER (WHERE kind = 'account'), 0)::bigint,
                   COUNT(*) FILTER (WHERE kind = 'pair'
                                    AND (body->'record'->>'frozen')::boolean),
                   COALESCE(SUM((body->'record'->'shard'->>'allocatedUnits')::bigint)
                            FILTER (WHERE kind = 'shard' AND live), 0)::bigint,
                   COUNT(*) FILTER (WHERE kind = 'shard' AND live)
                 FROM reservoir_records",
                &[],
            )
            .await?;
        let unsigned = |index: usize| u64::try_from(row.get::<_, i64>(index)).unwrap_or(0);
        Ok(Gauges {
            debt_outstanding: unsigned(0),
            units_reserved: unsigned(1),
            frozen_routes: unsigned(2),
            shard_units_out: unsigned(3),
            open_shards: unsigned(4),
        })
    }

    /// Runs one batch in one transaction: lock the scope, load its records,
    /// let `apply` decide over them and `input` (it returns the changes to
    /// write and its output), write, commit. See the module documentation.
    /// On failure the input comes back if `apply` never ran, else its output.
    pub async fn run_batch<T, R>(
        &mut self,
        scope: &Scope,
        now: Timestamp,
        input: T,
        apply: impl FnOnce(Loaded, T) -> (Vec<Change>, R),
    ) -> Result<R, BatchFailure<T, R>> {
        let lock_keys = lock_keys(scope);
        // Lock rows are created on first use, outside the transaction: if
        // the lock finds fewer rows than keys, create them and lock again.
        let mut created = false;
        let transaction = loop {
            let transaction = match self.client.transaction().await {
                Ok(transaction) => transaction,
                Err(error) => {
                    return Err(BatchFailure::BeforeApply {
                        error: error.into(),
                        input,
                    });
                }
            };
            let locked = if lock_keys.is_empty() {
                Ok(Vec::new())
            } else {
                transaction
                    .query(
                        "SELECT lock_key FROM reservoir_locks WHERE lock_key = ANY($1)
                         ORDER BY lock_key FOR UPDATE",
                        &[&lock_keys],
                    )
                    .await
            };
            match locked {
                Ok(rows) if rows.len() == lock_keys.len() || created => break transaction,
                Ok(_) => {}
                Err(error) => {
                    return Err(BatchFailure::BeforeApply {
                        error: error.into(),
                        input,
                    });
                }
            }
            drop(transaction);
            if let Err(error) = self
                .client
                .execute(
                    "INSERT INTO reservoir_locks (lock_key) SELECT unnest($1::text[])
                     ON CONFLICT DO NOTHING",
                    &[&lock_keys],
                )
                .await
            {
                return Err(BatchFailure::BeforeApply {
                    error: error.into(),
                    input,
                });
            }
            created = true;
        };
        let loaded = match load_scope(&transaction, scope, now).await {
            Ok(loaded) => loaded,
            Err(error) => return Err(BatchFailure::BeforeApply { error, input }),
        };
        let (changes, output) = apply(loaded, input);
        if let Err(error) = upsert(&transaction, &changes).await {
            return Err(BatchFailure::AfterApply { error, output });
        }
        if let Err(error) = transaction.commit().await {
            return Err(BatchFailure::AfterApply {
                error: error.into(),
                output,
            });
        }
        Ok(output)
    }
}

/// A batch that did not commit.
#[derive(Debug)]
pub enum BatchFailure<T, R> {
    /// Failed while locking or loading: `input` was not used.
    BeforeApply { error: PostgresError, input: T },
    /// Failed while writing or committing: nothing was written (unless the
    /// connection died during COMMIT, when PostgreSQL may have committed).
    AfterApply { error: PostgresError, output: R },
}

/// Step 2 of a batch: the records the scope's operations may touch, in two
/// round trips (the first three queries are pipelined).
async fn load_scope(
    client: &impl GenericClient,
    scope: &Scope,
    now: Timestamp,
) -> Result<Loaded, PostgresError> {
    let pairs: Vec<String> = scope.pairs.iter().map(pair_key).collect();
    let targets: Vec<String> = scope
        .reservations
        .iter()
        .flat_map(|id| {
            [
                encode_key(&RecordKey::Reservation(id.clone())),
                encode_key(&RecordKey::Tombstone(id.clone())),
            ]
        })
        .chain(
            scope
                .shards
                .iter()
                .map(|id| encode_key(&RecordKey::Shard(id.clone()))),
        )
        .chain(
            scope
                .gateways
                .iter()
                .map(|id| encode_key(&RecordKey::Gateway(id.clone()))),
        )
        .collect();
    // Policies and pair rows; targets by key; every live reservation of the
    // pairs (they make up `reserved`).
    let pairs_parameter: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&pairs];
    let targets_parameter: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&targets];
    let (head_rows, target_rows, live_rows) = tokio::try_join!(
        client.query(
            "SELECT body FROM reservoir_records
             WHERE pair_key = ANY($1) AND kind IN ('policy', 'pair')",
            &pairs_parameter,
        ),
        client.query(
            "SELECT record_key, body FROM reservoir_records WHERE record_key = ANY($1)",
            &targets_parameter,
        ),
        client.query(
            "SELECT body FROM reservoir_records
             WHERE kind = 'reservation' AND live AND pair_key = ANY($1)",
            &pairs_parameter,
        ),
    )?;
    let mut loaded = Loaded::default();
    let head = decode(&head_rows)?;
    let policies: BTreeMap<(PairKey, u64), u64> = head
        .iter()
        .filter_map(|change| match change {
            Change::Policy(policy) => Some((
                (
                    PairKey::new(policy.subject.clone(), policy.route.clone()),
                    policy.policy_generation,
                ),
                policy.accounting_epoch_ms,
            )),
            _ => None,
        })
        .collect();
    // The current account of each pair, for `now`.
    let mut account_keys: Vec<String> = Vec::new();
    for change in &head {
        if let Change::Pair(record) = change
            && let Some(epoch_ms) = policies.get(&(record.pair.clone(), record.current_generation))
        {
            account_keys.push(account_record_key(&AccountKey {
                pair: record.pair.clone(),
                accounting_epoch: epoch_start(now, *epoch_ms),
                policy_generation: record.current_generation,
            }));
        }
    }
    loaded.records.extend(head);
    for (row, change) in target_rows.iter().zip(decode(&target_rows)?) {
        let account = match &change {
            Change::Reservation(record) => Some(record.account_key()),
            Change::Shard(record) => Some(record.account_key()),
            _ => None,
        };
        if let Some(account) = account {
            if !scope.pairs.contains(&account.pair) {
                loaded.unlocked.insert(row.get(0));
                continue;
            }
            account_keys.push(account_record_key(&account));
        }
        loaded.records.push(change);
    }
    if pairs.is_empty() {
        return Ok(loaded);
    }
    loaded.records.extend(decode(&live_rows)?);
    // Accounts (current, live, targeted, holding open shards, or all of a
    // pair), and every shard of those accounts (they make up
    // `retiredForEmergency`).
    let all_accounts: Vec<String> = scope.all_accounts.iter().map(pair_key).collect();
    let rows = client
        .query(
            "WITH accounts AS (
               SELECT record_key, body FROM reservoir_records
               WHERE kind = 'account' AND pair_key = ANY($1)
                 AND (live OR record_key = ANY($2) OR pair_key = ANY($3)
                      OR record_key IN (SELECT account_key FROM reservoir_records
                                        WHERE kind = 'shard' AND live AND pair_key = ANY($1))))
             SELECT body FROM accounts
             UNION ALL
             SELECT body FROM reservoir_records
             WHERE kind = 'shard' AND account_key IN (SELECT record_key FROM accounts)",
            &[&pairs, &account_keys, &all_accounts],
        )
        .await?;
    loaded.records.extend(decode(&rows)?);
    Ok(loaded)
}

/// [`PostgresStore`] behind the synchronous [`LedgerStore`] trait, with its
/// own single-threaded runtime: for the storage contract tests and tools
/// that are not async. Never use it inside an async runtime.
#[derive(Debug)]
pub struct BlockingPostgresStore {
    runtime: Arc<tokio::runtime::Runtime>,
    store: PostgresStore,
}

impl BlockingPostgresStore {
    pub fn connect(url: &str) -> Result<Self, PostgresError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(PostgresError::Runtime)?;
        let store = runtime.block_on(PostgresStore::connect(url))?;
        Ok(Self {
            runtime: Arc::new(runtime),
            store,
        })
    }

    /// Closes the connection and connects again to the same database.
    pub fn reconnect(self, url: &str) -> Result<Self, PostgresError> {
        let runtime = self.runtime.clone();
        drop(self.store);
        let store = runtime.block_on(PostgresStore::connect(url))?;
        Ok(Self { runtime, store })
    }
}

impl LedgerStore for BlockingPostgresStore {
    type Error = PostgresError;

    fn commit(&mut self, changes: &[Change]) -> Result<(), PostgresError> {
        let runtime = self.runtime.clone();
        runtime.block_on(self.store.commit(changes))
    }

    fn load_all(&self) -> Result<Vec<Change>, PostgresError> {
        self.runtime.block_on(self.store.load_all())
    }
}
