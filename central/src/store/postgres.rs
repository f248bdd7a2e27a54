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
//!   awaits a worker, an open shard: neither reconciled nor lost), `due_at`
//!   (unix ms when a worker must next look at a live reservation; an open
//!   shard's `notAfter`), `ended_at` (unix ms when the retention window of
//!   a terminal reservation, a tombstone, a reconciled shard or a lost one
//!   started) and `body`, the [`Change`] as JSONB.
//! - `reservoir_locks(lock_key)`: one row per `pair/<subject>/<route>`,
//!   `gateway/<identity>` and `rid/<reservation>` locked. They exist to be
//!   locked; the `rid/` row of a forgotten reservation ID is deleted with
//!   its records, the others stay.
//!
//! # Retention
//!
//! The retention sweep ([`Scope::forget_sweep`]) finds the records whose
//! `ended_at` is at or before `now − retention`, oldest first, and locks
//! their pairs (with every account: folding an emptied account needs them
//! all) and reservation IDs like any batch, with every leg of a due
//! multi-leg reservation (the ledger forgets legs together or not at
//! all). A forgotten record ([`Change::Forget`]) is `DELETE`d in the
//! batch's own transaction, with the lock row of its reservation ID; a
//! batch forgets at most `sweep_batch_max` records, so no lock is held
//! longer than one batch.
//!
//! # One batch = one transaction ([`BatchStore`])
//!
//! 1. [`BatchStore::complete_scope`] adds the pairs only the database knows,
//!    outside any transaction: the pairs of records named by ID (a record's
//!    pair never changes once written), the pairs with reservations due
//!    (expiry and usage-deadline sweeps), and the next [`WORKER_PAIRS_MAX`]
//!    pairs of the refill cursor.
//! 2. [`BatchStore::begin`] opens a transaction (`BEGIN`), creates the lock
//!    rows of the [`Scope`] if missing (outside the transaction) and locks
//!    them with `SELECT … ORDER BY lock_key FOR UPDATE`: always in key
//!    order, so two replicas never deadlock. Under the locks it loads the
//!    records the scope's operations can touch (the pairs' policies and pair
//!    rows, their current accounts for `now`, every live account,
//!    reservation and shard of the pairs, and the named records by key) into
//!    a fresh ledger ([`CentralLedger::from_live_records`]).
//! 3. The writer applies the batch to that ledger; [`BatchStore::commit`]
//!    upserts the changes (deletes the forgotten ones) and sends `COMMIT`; [`BatchStore::abort`] sends
//!    `ROLLBACK`.
//!
//! The store does not commit behind the writer
//! ([`BatchStore::commit_behind`]): the next batch's look-ups and loads read
//! the database, which holds the last batch's changes only once its
//! `COMMIT` returned, and the batch's transaction holds the one client.
//!
//! The transaction is held across those calls with explicit `BEGIN`,
//! `COMMIT` and `ROLLBACK` statements on the one client. The batch's
//! statements are prepared once per connection. A connection found
//! closed (or one that could not even roll back) is replaced before the next
//! batch, as a restart would.
//!
//! Every record an operation reads or writes belongs to a locked pair (or
//! gateway, or reservation ID), and is read after the lock was taken, so
//! operations on one pair are serialized across replicas: linearizable per
//! account. A named record that lives under a pair the batch did not lock
//! (an operation that names its own pair reused an ID of another pair, or
//! the record appeared between the look-up and the lock) is left out of the
//! ledger and reported in [`Batch::unlocked`]: its operation goes to a later
//! batch, whose look-up finds the pair.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ledger::protocol::views::{AuditResponse, audit_of_records, audit_view};
use ledger::protocol::{Gauges, Operation, Reply, Scope};
use ledger::{
    AccountKey, CentralConfig, CentralLedger, Change, LoadError, PairKey, RecordKey, epoch_start,
};
use shard_format::{
    AdmissionBudgetV1, ReservationId, ReservationState, Route, ShardId, Subject, Timestamp,
};
use tokio::sync::Semaphore;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Json;
use tokio_postgres::{Client, Statement};

use super::{
    Batch, BatchStore, ReadBeside, encode_key, last_per_key, pair_key, parse_pair_key, sort_by_key,
};

/// Most pairs one sweep (expiry, usage deadlines) or one refill round adds
/// to a batch.
pub const WORKER_PAIRS_MAX: i64 = 256;

/// How many sweep batches the retention look-up reads past the oldest due
/// record, as [`CentralLedger::forget_expired`] does: records kept for
/// debt still owed must not stall the sweep.
const FORGET_LOOKAHEAD: usize = 4;

/// Times a batch creates its lock rows again when some vanished under the
/// lock (forgotten by a concurrent sweep) before it gives up for now.
const LOCK_ATTEMPTS_MAX: u32 = 8;

/// How long the writer waits after a failed reconnect before it answers
/// the next batch (each batch tries again).
const RECONNECT_PAUSE: Duration = Duration::from_millis(100);

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
    // 3: retention. `ended_at` is when a record's retention window started
    // (a terminal reservation's `retainedSince`, a tombstone's
    // `abandonedAt`, a shard's `reconciledAt`); the sweep finds what is due
    // by it. Accounts learn how many reservation and shard records they
    // hold, so that an emptied account of a past epoch can be folded.
    "ALTER TABLE reservoir_records ADD COLUMN ended_at bigint;
    UPDATE reservoir_records SET ended_at =
        round(extract(epoch FROM (CASE kind
            WHEN 'reservation' THEN CASE
                WHEN body->'record'->'receipt'->>'state'
                     IN ('SETTLED', 'SETTLED_WITH_DEBT', 'RELEASED', 'EXPIRED', 'ABANDONED')
                THEN COALESCE(body->'record'->>'endedAt',
                              body->'record'->'settlement'->>'settledAt',
                              body->'record'->'receipt'->>'expiresAt')
                END
            WHEN 'tombstone' THEN body->'record'->>'abandonedAt'
            WHEN 'shard' THEN body->'record'->'reconciliation'->>'reconciledAt'
        END)::timestamptz) * 1000)::bigint
    WHERE kind IN ('reservation', 'tombstone', 'shard');
    UPDATE reservoir_records account SET body = jsonb_set(account.body, '{record,records}',
        to_jsonb((SELECT count(*) FROM reservoir_records counted
                  WHERE counted.account_key = account.record_key
                    AND counted.kind IN ('reservation', 'shard'))))
    WHERE account.kind = 'account' AND account.body->'record'->'records' IS NULL;
    CREATE INDEX reservoir_records_ended ON reservoir_records (ended_at)
        WHERE ended_at IS NOT NULL;",
    // 4: lost shards. An open shard is due at its `notAfter` (the
    // lost-shard sweep finds it `shard_lost_grace_ms` later); a shard
    // marked lost is no longer live and its retention window starts then.
    "UPDATE reservoir_records SET due_at =
        round(extract(epoch FROM (body->'record'->'shard'->>'notAfter')::timestamptz) * 1000)::bigint
    WHERE kind = 'shard' AND live;",
];

/// Any number, the same in every replica: serializes concurrent migrations.
const MIGRATION_LOCK: i64 = 0x7265_7365_7276_6f69;

/// Why the PostgreSQL store failed.
#[derive(Debug, thiserror::Error)]
pub enum PostgresError {
    #[error("postgresql: {0}")]
    Database(#[from] tokio_postgres::Error),
    /// The connection (with the URL's `sslmode`) could not be made.
    #[error(transparent)]
    Connect(#[from] super::postgres_tls::ConnectError),
    /// The database was migrated by a newer binary.
    #[error(
        "the database schema is at version {found}; this binary knows up to {known}: upgrade it"
    )]
    NewerSchema { found: i64, known: i64 },
    /// A `pair_key` column does not name a pair.
    #[error("stored record {0} has a malformed pair key")]
    Corrupt(String),
    /// Lock rows kept vanishing under the lock (each forgotten by a
    /// retention sweep right after it was created): a later batch tries
    /// again.
    #[error("the lock rows of a batch were deleted {0} times while it locked them")]
    LocksVanished(u32),
    /// The records loaded for a batch break an invariant: nothing of the
    /// batch is written.
    #[error("the records loaded for a batch are inconsistent: {0}")]
    Inconsistent(LoadError),
    /// The audit read beside the batches did not finish (its task
    /// panicked or the runtime is stopping).
    #[error("the audit's task did not finish: {0}")]
    AuditTask(String),
}

impl PostgresError {
    /// A conflict between concurrent transactions that a retry resolves.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::LocksVanished(_) => true,
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
#[derive(Debug, Default)]
struct Loaded {
    records: Vec<Change>,
    /// Named records that exist under a pair the batch did not lock.
    unlocked: BTreeSet<RecordKey>,
}

/// The indexed columns of a record.
struct Columns {
    kind: &'static str,
    pair_key: Option<String>,
    account_key: Option<String>,
    live: bool,
    due_at: Option<i64>,
    /// When its retention window started (terminal records only).
    ended_at: Option<i64>,
}

fn ms(timestamp: Timestamp) -> i64 {
    i64::try_from(timestamp.unix_ms()).unwrap_or(i64::MAX)
}

fn account_record_key(key: &AccountKey) -> String {
    encode_key(&RecordKey::Account(key.clone()))
}

/// The columns of a record to write.
fn columns(change: &Change) -> Columns {
    match change {
        Change::Policy(policy) => Columns {
            kind: "policy",
            pair_key: Some(format!("{}/{}", policy.subject, policy.route)),
            account_key: None,
            live: false,
            due_at: None,
            ended_at: None,
        },
        Change::Pair(record) => Columns {
            kind: "pair",
            pair_key: Some(pair_key(&record.pair)),
            account_key: None,
            live: false,
            due_at: None,
            ended_at: None,
        },
        Change::Account(account) => Columns {
            kind: "account",
            pair_key: Some(pair_key(&account.key.pair)),
            account_key: Some(account_record_key(&account.key)),
            live: account.terms.debt() > 0 || account.terms.reserved > 0,
            due_at: None,
            ended_at: None,
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
                ended_at: record.retained_since().map(ms),
            }
        }
        Change::Tombstone(tombstone) => Columns {
            kind: "tombstone",
            pair_key: None,
            account_key: None,
            live: false,
            due_at: None,
            ended_at: Some(ms(tombstone.abandoned_at)),
        },
        Change::Gateway(_) => Columns {
            kind: "gateway",
            pair_key: None,
            account_key: None,
            live: false,
            due_at: None,
            ended_at: None,
        },
        Change::Shard(record) => {
            let key = record.account_key();
            Columns {
                kind: "shard",
                pair_key: Some(pair_key(&key.pair)),
                account_key: Some(account_record_key(&key)),
                live: record.is_open(),
                due_at: record.is_open().then(|| ms(record.shard.not_after)),
                ended_at: record.retained_since().map(ms),
            }
        }
        // `write` deletes these; they have no row to describe.
        Change::Forget(_) => Columns {
            kind: "forgotten",
            pair_key: None,
            account_key: None,
            live: false,
            due_at: None,
            ended_at: None,
        },
    }
}

const UPSERT: &str = "INSERT INTO reservoir_records
        (record_key, kind, pair_key, account_key, live, due_at, ended_at, body)
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bool[],
                         $6::int8[], $7::int8[], $8::jsonb[])
    ON CONFLICT (record_key) DO UPDATE SET
        kind = EXCLUDED.kind, pair_key = EXCLUDED.pair_key,
        account_key = EXCLUDED.account_key, live = EXCLUDED.live,
        due_at = EXCLUDED.due_at, ended_at = EXCLUDED.ended_at, body = EXCLUDED.body";

const DELETE_RECORDS: &str = "DELETE FROM reservoir_records WHERE record_key = ANY($1)";

/// Lock rows of forgotten reservation IDs: `reservoir_locks` must not grow
/// forever.
const DELETE_LOCKS: &str = "DELETE FROM reservoir_locks WHERE lock_key = ANY($1)";

/// Records whose retention window started at or before the cutoff, oldest
/// first: key, kind, pair (none for a tombstone) and a multi-leg
/// reservation's legs (the receipt's `legs`; none for one leg).
const DUE_FORGET: &str = "SELECT record_key, kind, pair_key,
        CASE WHEN kind = 'reservation'
              AND jsonb_typeof(body->'record'->'receipt'->'legs') = 'array'
             THEN body->'record'->'receipt'->'legs' END
    FROM reservoir_records
    WHERE ended_at IS NOT NULL AND ended_at <= $1
    ORDER BY ended_at, record_key LIMIT $2";

/// The gauges in one statement over the whole table, without loading the
/// records.
const GAUGES: &str = "SELECT
       COALESCE(SUM((body->'record'->'terms'->>'overdraftIssued')::bigint
                  - (body->'record'->'terms'->>'overdraftRepaid')::bigint)
                FILTER (WHERE kind = 'account'), 0)::bigint,
       COALESCE(SUM((body->'record'->'terms'->>'reserved')::bigint)
                FILTER (WHERE kind = 'account'), 0)::bigint,
       COUNT(*) FILTER (WHERE kind = 'pair'
                        AND (body->'record'->>'frozen')::boolean),
       COALESCE(SUM((body->'record'->'shard'->>'allocatedUnits')::bigint)
                FILTER (WHERE kind = 'shard' AND live), 0)::bigint,
       COUNT(*) FILTER (WHERE kind = 'shard' AND live),
       COUNT(*) FILTER (WHERE kind = 'reservation' AND ended_at IS NULL),
       COUNT(*) FILTER (WHERE kind = 'reservation' AND ended_at IS NOT NULL),
       COUNT(*) FILTER (WHERE kind = 'shard'
                        AND body->'record'->>'reconciliation' IS NOT NULL),
       COUNT(*) FILTER (WHERE kind = 'account'),
       COALESCE(SUM((body->'record'->'closedHistory'->>'accounts')::bigint)
                FILTER (WHERE kind = 'pair'), 0)::bigint,
       COALESCE(SUM((body->'record'->'forgotten'->>'reservations')::bigint)
                FILTER (WHERE kind = 'account'), 0)::bigint
       + COALESCE(SUM((body->'record'->'closedHistory'->'forgotten'->>'reservations')::bigint)
                FILTER (WHERE kind = 'pair'), 0)::bigint,
       pg_total_relation_size('reservoir_records'),
       COUNT(*) FILTER (WHERE kind = 'tombstone'),
       COUNT(*) FILTER (WHERE kind = 'shard' AND NOT live
                        AND body->'record'->>'reconciliation' IS NULL)
       + COALESCE(SUM((body->'record'->'forgotten'->>'lostShards')::bigint)
                FILTER (WHERE kind = 'account'), 0)::bigint
       + COALESCE(SUM((body->'record'->'closedHistory'->'forgotten'->>'lostShards')::bigint)
                FILTER (WHERE kind = 'pair'), 0)::bigint,
       COALESCE(SUM((body->'record'->'shard'->>'allocatedUnits')::bigint)
                FILTER (WHERE kind = 'shard' AND NOT live
                        AND body->'record'->>'reconciliation' IS NULL), 0)::bigint
       + COALESCE(SUM((body->'record'->'forgotten'->>'lostUnits')::bigint)
                FILTER (WHERE kind = 'account'), 0)::bigint
       + COALESCE(SUM((body->'record'->'closedHistory'->'forgotten'->>'lostUnits')::bigint)
                FILTER (WHERE kind = 'pair'), 0)::bigint
     FROM reservoir_records";

/// The audit of `records` (every record stored).
fn audit_records(config: CentralConfig, records: &[Change]) -> AuditResponse {
    match CentralLedger::from_records(config, records.iter().cloned()) {
        Ok(ledger) => audit_view(&ledger),
        Err(LoadError::Invariants(violations)) => audit_of_records(records, &violations),
    }
}

/// Every record stored, read on `client`, in key order.
async fn load_all(client: &Client) -> Result<Vec<Change>, PostgresError> {
    let rows = client
        .query("SELECT body FROM reservoir_records", &[])
        .await?;
    Ok(sort_by_key(decode(&rows)?))
}

/// The audit of every record read on `client`, the ledger rebuilt on the
/// blocking pool.
async fn audit_beside(
    client: &Client,
    config: CentralConfig,
) -> Result<AuditResponse, PostgresError> {
    let records = load_all(client).await?;
    tokio::task::spawn_blocking(move || audit_records(config, &records))
        .await
        .map_err(|error| PostgresError::AuditTask(error.to_string()))
}

/// The gauges read on `client`.
async fn gauges_of(client: &Client) -> Result<Gauges, PostgresError> {
    let row = client.query_one(GAUGES, &[]).await?;
    let unsigned = |index: usize| u64::try_from(row.get::<_, i64>(index)).unwrap_or(0);
    Ok(Gauges {
        debt_outstanding: unsigned(0),
        units_reserved: unsigned(1),
        frozen_routes: unsigned(2),
        shard_units_out: unsigned(3),
        open_shards: unsigned(4),
        // `ended_at` is set exactly when a reservation is terminal.
        reservations_live: unsigned(5),
        reservations_retained: unsigned(6),
        shards_reconciled: unsigned(7),
        accounts: unsigned(8),
        accounts_folded: unsigned(9),
        reservations_forgotten: unsigned(10),
        store_bytes: unsigned(11),
        tombstones: unsigned(12),
        lost_shards: unsigned(13),
        lost_shard_units: unsigned(14),
    })
}

/// A leg of a due multi-leg reservation, as its receipt lists it.
#[derive(serde::Deserialize)]
struct DueLeg {
    reservation: ReservationId,
    subject: Subject,
    route: Route,
}

/// The pairs of the records, and of every leg of a multi-leg reservation
/// among them: an operation on one leg acts on every leg.
const PAIRS_OF: &str = "SELECT record_key, pair_key FROM reservoir_records
    WHERE record_key = ANY($1) AND pair_key IS NOT NULL
    UNION
    SELECT record.record_key, (leg->>'subject') || '/' || (leg->>'route')
    FROM reservoir_records record, jsonb_array_elements(
        CASE WHEN jsonb_typeof(record.body->'record'->'receipt'->'legs') = 'array'
             THEN record.body->'record'->'receipt'->'legs' ELSE '[]'::jsonb END) leg
    WHERE record.record_key = ANY($1) AND record.kind = 'reservation'";

/// Pairs with a live reservation due, and the pairs of every leg of those
/// reservations (legs are due together and move together).
const DUE_PAIRS: &str = "WITH due AS (SELECT DISTINCT pair_key FROM reservoir_records
        WHERE kind = 'reservation' AND live AND due_at <= $1
        ORDER BY pair_key LIMIT $2)
    SELECT pair_key FROM due
    UNION
    SELECT (leg->>'subject') || '/' || (leg->>'route')
    FROM reservoir_records record, jsonb_array_elements(
        CASE WHEN jsonb_typeof(record.body->'record'->'receipt'->'legs') = 'array'
             THEN record.body->'record'->'receipt'->'legs' ELSE '[]'::jsonb END) leg
    WHERE record.kind = 'reservation' AND record.live AND record.due_at <= $1
      AND record.pair_key IN (SELECT pair_key FROM due)";

/// Pairs with an open shard whose `notAfter` is at or before `$1` (now
/// minus the lost-shard grace).
const DUE_LOST_PAIRS: &str = "SELECT DISTINCT pair_key FROM reservoir_records
    WHERE kind = 'shard' AND live AND due_at <= $1
    ORDER BY pair_key LIMIT $2";

const PAIRS_AFTER: &str = "SELECT pair_key FROM reservoir_records
    WHERE kind = 'pair' AND pair_key > $1
    ORDER BY pair_key LIMIT $2";

const LOCK: &str = "SELECT lock_key FROM reservoir_locks WHERE lock_key = ANY($1)
    ORDER BY lock_key FOR UPDATE";

const CREATE_LOCKS: &str = "INSERT INTO reservoir_locks (lock_key) SELECT unnest($1::text[])
    ON CONFLICT DO NOTHING";

/// Policies and pair rows of the pairs.
const LOAD_HEADS: &str = "SELECT body FROM reservoir_records
    WHERE pair_key = ANY($1) AND kind IN ('policy', 'pair')";

const LOAD_TARGETS: &str = "SELECT body FROM reservoir_records WHERE record_key = ANY($1)";

/// Every live reservation of the pairs (they make up `reserved`).
const LOAD_LIVE: &str = "SELECT body FROM reservoir_records
    WHERE kind = 'reservation' AND live AND pair_key = ANY($1)";

/// Accounts of the pairs (current, live, targeted, holding open shards, or
/// all of a pair), and every shard of those accounts (they make up
/// `retiredForEmergency`). Every open shard of the pairs is among them,
/// whatever its boot, epoch or generation: the cap on an identity's
/// unreconciled shard units counts them all.
const LOAD_ACCOUNTS: &str = "WITH accounts AS (
       SELECT record_key, body FROM reservoir_records
       WHERE kind = 'account' AND pair_key = ANY($1)
         AND (live OR record_key = ANY($2) OR pair_key = ANY($3)
              OR record_key IN (SELECT account_key FROM reservoir_records
                                WHERE kind = 'shard' AND live AND pair_key = ANY($1))))
     SELECT body FROM accounts
     UNION ALL
     SELECT body FROM reservoir_records
     WHERE kind = 'shard' AND account_key IN (SELECT record_key FROM accounts)";

/// The statements of a batch, prepared once per connection: a query by
/// text would cost a round trip of its own to prepare, every time.
#[derive(Debug)]
struct Statements {
    pairs_of: Statement,
    due_pairs: Statement,
    due_lost_pairs: Statement,
    pairs_after: Statement,
    lock: Statement,
    create_locks: Statement,
    load_heads: Statement,
    load_targets: Statement,
    load_live: Statement,
    load_accounts: Statement,
    upsert: Statement,
    delete_records: Statement,
    delete_locks: Statement,
    due_forget: Statement,
}

impl Statements {
    /// Prepares them all, pipelined: one round trip.
    async fn prepare(client: &Client) -> Result<Self, PostgresError> {
        let (
            pairs_of,
            due_pairs,
            due_lost_pairs,
            pairs_after,
            lock,
            create_locks,
            load_heads,
            load_targets,
            load_live,
            load_accounts,
            upsert,
            delete_records,
            delete_locks,
            due_forget,
        ) = tokio::try_join!(
            client.prepare(PAIRS_OF),
            client.prepare(DUE_PAIRS),
            client.prepare(DUE_LOST_PAIRS),
            client.prepare(PAIRS_AFTER),
            client.prepare(LOCK),
            client.prepare(CREATE_LOCKS),
            client.prepare(LOAD_HEADS),
            client.prepare(LOAD_TARGETS),
            client.prepare(LOAD_LIVE),
            client.prepare(LOAD_ACCOUNTS),
            client.prepare(UPSERT),
            client.prepare(DELETE_RECORDS),
            client.prepare(DELETE_LOCKS),
            client.prepare(DUE_FORGET),
        )?;
        Ok(Self {
            pairs_of,
            due_pairs,
            due_lost_pairs,
            pairs_after,
            lock,
            create_locks,
            load_heads,
            load_targets,
            load_live,
            load_accounts,
            upsert,
            delete_records,
            delete_locks,
            due_forget,
        })
    }
}

/// Writes `changes` (the last per key): one statement for the records
/// written, one for those forgotten and one for the lock rows of forgotten
/// reservation IDs, pipelined.
async fn write(
    client: &Client,
    statements: &Statements,
    changes: &[Change],
) -> Result<(), PostgresError> {
    let (forgotten, written): (Vec<&Change>, Vec<&Change>) = last_per_key(changes)
        .into_iter()
        .partition(|change| matches!(change, Change::Forget(_)));
    let deleted: Vec<String> = forgotten
        .iter()
        .map(|change| encode_key(&change.key()))
        .collect();
    let locks: Vec<String> = forgotten
        .iter()
        .filter_map(|change| match change {
            Change::Forget(RecordKey::Reservation(id) | RecordKey::Tombstone(id)) => {
                Some(format!("rid/{id}"))
            }
            _ => None,
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let delete = async {
        if !deleted.is_empty() {
            client
                .execute(&statements.delete_records, &[&deleted])
                .await?;
        }
        Ok::<_, PostgresError>(())
    };
    let unlock = async {
        if !locks.is_empty() {
            client.execute(&statements.delete_locks, &[&locks]).await?;
        }
        Ok::<_, PostgresError>(())
    };
    tokio::try_join!(upsert(client, statements, &written), delete, unlock)?;
    Ok(())
}

/// Upserts `changes` (at most one per key, none forgotten) in one
/// statement.
async fn upsert(
    client: &Client,
    statements: &Statements,
    changes: &[&Change],
) -> Result<(), PostgresError> {
    if changes.is_empty() {
        return Ok(());
    }
    let mut keys = Vec::with_capacity(changes.len());
    let mut kinds = Vec::with_capacity(changes.len());
    let mut pairs = Vec::with_capacity(changes.len());
    let mut accounts = Vec::with_capacity(changes.len());
    let mut live = Vec::with_capacity(changes.len());
    let mut due = Vec::with_capacity(changes.len());
    let mut ended = Vec::with_capacity(changes.len());
    let mut bodies = Vec::with_capacity(changes.len());
    for change in changes {
        let columns = columns(change);
        keys.push(encode_key(&change.key()));
        kinds.push(columns.kind);
        pairs.push(columns.pair_key);
        accounts.push(columns.account_key);
        live.push(columns.live);
        due.push(columns.due_at);
        ended.push(columns.ended_at);
        bodies.push(Json(*change));
    }
    client
        .execute(
            &statements.upsert,
            &[
                &keys, &kinds, &pairs, &accounts, &live, &due, &ended, &bodies,
            ],
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
    statements: Statements,
    url: String,
    config: CentralConfig,
    /// The ledger of the open batch, loaded by `begin`.
    batch: Option<CentralLedger>,
    /// A transaction is open on `client`.
    in_transaction: bool,
    /// The connection must be replaced before the next batch: a `ROLLBACK`
    /// failed, so the server may still hold the transaction.
    broken: bool,
    /// The last pair the refill worker's previous round covered.
    refill_cursor: Option<PairKey>,
    /// Times a batch found lock rows missing and locked again.
    lock_retries: u64,
    /// One permit each: the gauges, and the audits, read beside the
    /// batches one at a time.
    gauges_reads: Arc<Semaphore>,
    audit_reads: Arc<Semaphore>,
}

impl Drop for PostgresStore {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

/// A connection, the task that drives it, and its prepared statements.
type Connection = (Client, tokio::task::JoinHandle<()>, Statements);

/// Connects to `url`, creates or migrates the schema, and prepares the
/// statements.
async fn open(url: &str) -> Result<Connection, PostgresError> {
    let (mut client, connection) = super::postgres_tls::connect(url).await?;
    migrate(&mut client).await?;
    // The statements are prepared once but still planned for each batch's
    // own pairs and keys, as queries by text were: a generic plan (which
    // PostgreSQL may switch to after five runs) knows neither.
    client
        .batch_execute("SET plan_cache_mode = force_custom_plan")
        .await?;
    let statements = Statements::prepare(&client).await?;
    Ok((client, connection, statements))
}

async fn migrate(client: &mut Client) -> Result<(), PostgresError> {
    let transaction = client.transaction().await?;
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

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host:port/database` or the
    /// key-value form) and creates or migrates the schema. Batches load
    /// their ledgers with `config`.
    pub async fn connect(url: &str, config: CentralConfig) -> Result<Self, PostgresError> {
        let (client, connection, statements) = open(url).await?;
        Ok(Self {
            client,
            connection,
            statements,
            url: url.to_owned(),
            config,
            batch: None,
            in_transaction: false,
            broken: false,
            refill_cursor: None,
            lock_retries: 0,
            gauges_reads: Arc::new(Semaphore::new(1)),
            audit_reads: Arc::new(Semaphore::new(1)),
        })
    }

    /// The URL it connects (and reconnects) to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Times a batch found lock rows missing under its lock and created
    /// them and locked again, two round trips more: a new pair or gateway,
    /// or rows a sweep deleted meanwhile (a reserve's new reservation IDs
    /// are created with the lock).
    pub fn lock_retries(&self) -> u64 {
        self.lock_retries
    }

    /// The schema version the database is at.
    pub async fn schema_version(&self) -> Result<i64, PostgresError> {
        let row = self
            .client
            .query_one("SELECT version FROM reservoir_schema_version", &[])
            .await?;
        Ok(row.get(0))
    }

    /// Every record, in key order, from one consistent snapshot.
    pub async fn load_all(&self) -> Result<Vec<Change>, PostgresError> {
        load_all(&self.client).await
    }

    /// The current policy of every pair (the one its pair row names): what
    /// the retention window must fit at start.
    pub async fn current_policies(&self) -> Result<Vec<AdmissionBudgetV1>, PostgresError> {
        let rows = self
            .client
            .query(
                "SELECT policy.body FROM reservoir_records pair
                 JOIN reservoir_records policy
                   ON policy.kind = 'policy' AND policy.pair_key = pair.pair_key
                  AND (policy.body->'record'->>'policyGeneration')::bigint
                      = (pair.body->'record'->>'currentGeneration')::bigint
                 WHERE pair.kind = 'pair'",
                &[],
            )
            .await?;
        Ok(decode(&rows)?
            .into_iter()
            .filter_map(|change| match change {
                Change::Policy(policy) => Some(*policy),
                _ => None,
            })
            .collect())
    }

    /// Replaces a closed (or broken) connection; an open batch died with
    /// it. After a failed reconnect it pauses [`RECONNECT_PAUSE`], so that
    /// a database that is down is not hammered batch after batch.
    async fn ready(&mut self) -> Result<(), PostgresError> {
        if !self.broken && !self.client.is_closed() {
            return Ok(());
        }
        self.batch = None;
        self.in_transaction = false;
        tracing::warn!("the postgresql connection is gone; reconnecting");
        match open(&self.url).await {
            Ok((client, connection, statements)) => {
                self.connection.abort();
                self.client = client;
                self.connection = connection;
                self.statements = statements;
                self.broken = false;
                Ok(())
            }
            Err(error) => {
                tokio::time::sleep(RECONNECT_PAUSE).await;
                Err(error)
            }
        }
    }

    /// Ends the open transaction, if any, without writing. A connection
    /// that cannot even roll back is replaced before the next batch.
    async fn rollback(&mut self) {
        self.batch = None;
        if !self.in_transaction {
            return;
        }
        self.in_transaction = false;
        if let Err(error) = self.client.batch_execute("ROLLBACK").await {
            tracing::warn!(%error, "cannot roll back; reconnecting before the next batch");
            self.broken = true;
        }
    }

    /// Opens the transaction and locks the scope's rows in key order. Lock
    /// rows are created on first use, outside the transaction. The rows of
    /// the reservation IDs reserves name are new as a rule: they are
    /// created first, in the same pipelined round trip as `BEGIN` and the
    /// lock (one round trip, where finding them missing took two more and
    /// a second lock). If the lock still finds fewer rows than keys (a new
    /// pair or gateway), they are created and locked again. A row may
    /// vanish between its creation and the lock (a retention sweep forgot
    /// its reservation ID and deleted it): then it is created again, up to
    /// [`LOCK_ATTEMPTS_MAX`] times. `ROLLBACK` goes out with the creation,
    /// in one pipelined round trip.
    async fn lock(&mut self, scope: &Scope) -> Result<(), PostgresError> {
        let lock_keys = lock_keys(scope);
        let parameters: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&lock_keys];
        // In key order, as every creation: two replicas creating the same
        // rows wait for each other in one order, never in a cycle.
        let reserved_keys: Vec<String> = scope
            .reservation_locks
            .iter()
            .map(|id| format!("rid/{id}"))
            .collect();
        let reserved_parameters: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&reserved_keys];
        // Only before the first lock: a retry creates every row.
        let mut create_reserved = !reserved_keys.is_empty();
        let mut attempts = 0;
        loop {
            self.in_transaction = true;
            if lock_keys.is_empty() {
                self.client.batch_execute("BEGIN").await?;
                return Ok(());
            }
            let rows = if std::mem::take(&mut create_reserved) {
                let (_, (), rows) = tokio::try_join!(
                    self.client
                        .execute(&self.statements.create_locks, &reserved_parameters),
                    self.client.batch_execute("BEGIN"),
                    self.client.query(&self.statements.lock, &parameters),
                )?;
                rows
            } else {
                let ((), rows) = tokio::try_join!(
                    self.client.batch_execute("BEGIN"),
                    self.client.query(&self.statements.lock, &parameters),
                )?;
                rows
            };
            if rows.len() == lock_keys.len() {
                return Ok(());
            }
            if attempts >= LOCK_ATTEMPTS_MAX {
                return Err(PostgresError::LocksVanished(attempts));
            }
            tokio::try_join!(
                self.client.batch_execute("ROLLBACK"),
                self.client
                    .execute(&self.statements.create_locks, &parameters),
            )?;
            self.in_transaction = false;
            attempts += 1;
            self.lock_retries += 1;
        }
    }

    /// The pairs of existing records by key (unlocked: a record's pair never
    /// changes once written).
    async fn pairs_of(&self, record_keys: &[String]) -> Result<Vec<PairKey>, PostgresError> {
        if record_keys.is_empty() {
            return Ok(Vec::new());
        }
        let rows = self
            .client
            .query(&self.statements.pairs_of, &[&record_keys])
            .await?;
        rows.iter()
            .map(|row| {
                let key: String = row.get(0);
                let pair: String = row.get(1);
                parse_pair_key(&pair).ok_or(PostgresError::Corrupt(key))
            })
            .collect()
    }

    /// Pairs with a live reservation due at `now` (expiry, usage deadline,
    /// hard limit), at most `limit`.
    async fn due_pairs(&self, now: Timestamp, limit: i64) -> Result<Vec<PairKey>, PostgresError> {
        let rows = self
            .client
            .query(&self.statements.due_pairs, &[&ms(now), &limit])
            .await?;
        Self::pairs_from(&rows)
    }

    /// Pairs with a policy after `after` (from the first when `None`), at
    /// most `limit`, in key order: a cursor over every pair.
    async fn pairs_after(
        &self,
        after: Option<&PairKey>,
        limit: i64,
    ) -> Result<Vec<PairKey>, PostgresError> {
        let after = after.map(pair_key).unwrap_or_default();
        let rows = self
            .client
            .query(&self.statements.pairs_after, &[&after, &limit])
            .await?;
        Self::pairs_from(&rows)
    }

    /// Adds the records due to be forgotten at `now` to `scope`, oldest
    /// first: their pairs with every account (folding needs them all), the
    /// IDs of reservations and tombstones (loaded and locked) and of
    /// shards. It looks as far as the ledger's sweep does,
    /// [`FORGET_LOOKAHEAD`] batches, past records still kept for their
    /// debt; the sweep itself forgets at most `sweep_batch_max`.
    async fn due_to_forget(&self, scope: &mut Scope, now: Timestamp) -> Result<(), PostgresError> {
        let cutoff =
            ms(now).saturating_sub(i64::try_from(self.config.retention_ms).unwrap_or(i64::MAX));
        let limit = i64::try_from(
            self.config
                .sweep_batch_max
                .max(1)
                .saturating_mul(FORGET_LOOKAHEAD),
        )
        .unwrap_or(i64::MAX);
        let rows = self
            .client
            .query(&self.statements.due_forget, &[&cutoff, &limit])
            .await?;
        for row in &rows {
            let key: String = row.get(0);
            let kind: String = row.get(1);
            let pair: Option<String> = row.get(2);
            let id = key
                .split_once('/')
                .map(|(_, id)| id)
                .ok_or_else(|| PostgresError::Corrupt(key.clone()))?;
            if let Some(pair) = pair {
                let pair =
                    parse_pair_key(&pair).ok_or_else(|| PostgresError::Corrupt(key.clone()))?;
                scope.all_accounts.insert(pair.clone());
                scope.pairs.insert(pair);
            }
            // Every leg of a due reservation, with its pair: the ledger
            // forgets a reservation's legs together or not at all, and the
            // limit may have cut between them.
            let legs: Option<serde_json::Value> = row.get(3);
            if let Some(legs) = legs {
                let legs: Vec<DueLeg> = serde_json::from_value(legs)
                    .map_err(|_| PostgresError::Corrupt(key.clone()))?;
                for leg in legs {
                    let pair = PairKey::new(leg.subject, leg.route);
                    scope.all_accounts.insert(pair.clone());
                    scope.pairs.insert(pair);
                    scope.reservations.insert(leg.reservation.clone());
                    scope.reservation_locks.insert(leg.reservation);
                }
            }
            match kind.as_str() {
                "reservation" | "tombstone" => {
                    let id: ReservationId = id
                        .parse()
                        .map_err(|_| PostgresError::Corrupt(key.clone()))?;
                    scope.reservations.insert(id.clone());
                    scope.reservation_locks.insert(id);
                }
                "shard" => {
                    let id: ShardId = id
                        .parse()
                        .map_err(|_| PostgresError::Corrupt(key.clone()))?;
                    scope.shards.insert(id);
                }
                _ => return Err(PostgresError::Corrupt(key)),
            }
        }
        Ok(())
    }

    fn pairs_from(rows: &[tokio_postgres::Row]) -> Result<Vec<PairKey>, PostgresError> {
        rows.iter()
            .map(|row| {
                let text: String = row.get(0);
                parse_pair_key(&text).ok_or(PostgresError::Corrupt(text))
            })
            .collect()
    }
}

impl BatchStore for PostgresStore {
    type Error = PostgresError;

    /// Step 1 of the module documentation.
    async fn complete_scope(
        &mut self,
        scope: &mut Scope,
        named: &BTreeSet<RecordKey>,
        now: Timestamp,
    ) -> Result<(), PostgresError> {
        self.ready().await?;
        let named: Vec<String> = named.iter().map(encode_key).collect();
        scope.pairs.extend(self.pairs_of(&named).await?);
        if scope.due_sweep {
            scope
                .pairs
                .extend(self.due_pairs(now, WORKER_PAIRS_MAX).await?);
        }
        if scope.forget_sweep {
            self.due_to_forget(scope, now).await?;
        }
        if scope.lost_sweep {
            let cutoff = now
                .unix_ms()
                .saturating_sub(self.config.shard_lost_grace_ms);
            let cutoff = i64::try_from(cutoff).unwrap_or(i64::MAX);
            let rows = self
                .client
                .query(
                    &self.statements.due_lost_pairs,
                    &[&cutoff, &WORKER_PAIRS_MAX],
                )
                .await?;
            scope.pairs.extend(Self::pairs_from(&rows)?);
        }
        if scope.refill {
            let mut pairs = self
                .pairs_after(self.refill_cursor.as_ref(), WORKER_PAIRS_MAX)
                .await?;
            if pairs.is_empty() && self.refill_cursor.is_some() {
                pairs = self.pairs_after(None, WORKER_PAIRS_MAX).await?;
            }
            self.refill_cursor = if (pairs.len() as i64) < WORKER_PAIRS_MAX {
                None
            } else {
                pairs.last().cloned()
            };
            scope.pairs.extend(pairs);
        }
        Ok(())
    }

    /// Step 2 of the module documentation. On an error the transaction is
    /// rolled back.
    async fn begin(&mut self, scope: &Scope, now: Timestamp) -> Result<Batch<'_>, PostgresError> {
        debug_assert!(!self.in_transaction, "a batch is already open");
        self.ready().await?;
        if let Err(error) = self.lock(scope).await {
            self.rollback().await;
            return Err(error);
        }
        let loaded = match load_scope(&self.client, &self.statements, scope, now).await {
            Ok(loaded) => loaded,
            Err(error) => {
                self.rollback().await;
                return Err(error);
            }
        };
        let ledger = match CentralLedger::from_live_records(self.config, loaded.records) {
            Ok(ledger) => ledger,
            Err(error) => {
                self.rollback().await;
                return Err(PostgresError::Inconsistent(error));
            }
        };
        Ok(Batch {
            ledger: self.batch.insert(ledger),
            unlocked: loaded.unlocked,
        })
    }

    /// Upserts the changes (the last per key, in one statement) and commits:
    /// durable with PostgreSQL's default `synchronous_commit`. If the
    /// connection dies during `COMMIT`, the changes may have landed: the
    /// writer answers 503, an unknown outcome that clients repeat under the
    /// same ID.
    async fn commit(&mut self, changes: &[Change]) -> Result<(), PostgresError> {
        debug_assert!(self.in_transaction, "no batch is open");
        self.batch = None;
        write(&self.client, &self.statements, changes).await?;
        self.client.batch_execute("COMMIT").await?;
        self.in_transaction = false;
        Ok(())
    }

    /// `ROLLBACK`: the batch's ledger is dropped, nothing was written.
    async fn abort(&mut self) -> Result<(), PostgresError> {
        self.rollback().await;
        Ok(())
    }

    /// Loads every record; records that break an invariant still get an
    /// audit, which names the violations.
    async fn audit(&mut self) -> Result<AuditResponse, PostgresError> {
        self.ready().await?;
        let records = self.load_all().await?;
        Ok(audit_records(self.config, &records))
    }

    /// Totals in one statement, without loading the records.
    async fn gauges(&mut self) -> Result<Gauges, PostgresError> {
        self.ready().await?;
        gauges_of(&self.client).await
    }

    /// On a connection of its own: both read the whole table (a day's
    /// records), which on the writer's connection held every batch behind
    /// it for as long as the read took. The audit rebuilds the ledger from
    /// what it read on the blocking pool, off the writer's thread.
    fn read_beside(&self, operation: &Operation) -> Option<ReadBeside<PostgresError>> {
        let url = self.url.clone();
        let config = self.config;
        // A read that comes while one of its kind is under way waits for
        // it, rather than open a connection and a scan each.
        let (turns, audit) = match operation {
            Operation::Gauges => (self.gauges_reads.clone(), false),
            Operation::Audit => (self.audit_reads.clone(), true),
            _ => return None,
        };
        Some(Box::pin(async move {
            let _turn = turns.acquire_owned().await;
            let (client, connection) = super::postgres_tls::connect(&url).await?;
            let read = if audit {
                audit_beside(&client, config).await.map(Reply::Audit)
            } else {
                gauges_of(&client).await.map(Reply::Gauges)
            };
            connection.abort();
            read
        }))
    }

    /// Serialization failures and deadlocks between replicas.
    fn is_conflict(error: &PostgresError) -> bool {
        error.is_retryable()
    }
}

/// Step 2 of a batch, under the locks: the records the scope's operations
/// may touch, in two round trips (the first three queries are pipelined).
async fn load_scope(
    client: &Client,
    statements: &Statements,
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
    let pairs_parameter: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&pairs];
    let targets_parameter: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&targets];
    let (head_rows, target_rows, live_rows) = tokio::try_join!(
        client.query(&statements.load_heads, &pairs_parameter),
        client.query(&statements.load_targets, &targets_parameter),
        client.query(&statements.load_live, &pairs_parameter),
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
    for change in decode(&target_rows)? {
        let account = match &change {
            Change::Reservation(record) => Some(record.account_key()),
            Change::Shard(record) => Some(record.account_key()),
            _ => None,
        };
        if let Some(account) = account {
            if !scope.pairs.contains(&account.pair) {
                loaded.unlocked.insert(change.key());
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
    let all_accounts: Vec<String> = scope.all_accounts.iter().map(pair_key).collect();
    let rows = client
        .query(
            &statements.load_accounts,
            &[&pairs, &account_keys, &all_accounts],
        )
        .await?;
    loaded.records.extend(decode(&rows)?);
    Ok(loaded)
}
