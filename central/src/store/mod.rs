//! The two durable stores of the central ledger's records.
//!
//! - [`RedbStore`]: one redb file under the data directory; each commit is
//!   one write transaction with `Durability::Immediate` (fsync before
//!   `commit` returns). The default, for one node.
//! - [`PostgresStore`]: one table of records in PostgreSQL, for many
//!   stateless replicas over one database. Its per-batch protocol (lock the
//!   pairs' rows, load their records, apply, commit) lives in
//!   [`postgres`]; [`BlockingPostgresStore`] adapts it to the synchronous
//!   [`ledger::store::LedgerStore`] contract.
//!
//! Both keep one record per [`RecordKey`] under the text key of
//! [`encode_key`], with the [`Change`] as JSON, and both pass
//! [`ledger::store::contract::check_store`].

pub mod postgres;
mod redb_store;

use ledger::{Change, PairKey, RecordKey};

pub use postgres::{BlockingPostgresStore, PostgresError, PostgresStore};
pub use redb_store::{RedbStore, RedbStoreError};

/// The text key of a record: `kind/…` with identifiers as they are (they
/// never hold `/`) and numbers as 16 hex digits, so keys of one kind sort
/// like the [`RecordKey`]s they encode.
pub fn encode_key(key: &RecordKey) -> String {
    match key {
        RecordKey::Policy(pair, generation) => {
            format!("policy/{}/{generation:016x}", pair_key(pair))
        }
        RecordKey::Pair(pair) => format!("pair/{}", pair_key(pair)),
        RecordKey::Account(account) => format!(
            "account/{}/{:016x}/{:016x}",
            pair_key(&account.pair),
            account.accounting_epoch.unix_ms(),
            account.policy_generation
        ),
        RecordKey::Reservation(id) => format!("reservation/{id}"),
        RecordKey::Tombstone(id) => format!("tombstone/{id}"),
        RecordKey::Gateway(identity) => format!("gateway/{identity}"),
        RecordKey::Shard(id) => format!("shard/{id}"),
    }
}

/// `subject/route`.
pub fn pair_key(pair: &PairKey) -> String {
    format!("{}/{}", pair.subject, pair.route)
}

/// The pair of a `subject/route` key.
pub fn parse_pair_key(text: &str) -> Option<PairKey> {
    let (subject, route) = text.split_once('/')?;
    Some(PairKey::new(subject.parse().ok()?, route.parse().ok()?))
}

/// Records in [`RecordKey`] order (the order `load_all` promises).
pub(crate) fn sort_by_key(mut records: Vec<Change>) -> Vec<Change> {
    records.sort_by_key(Change::key);
    records
}

/// The last change per key, in first-write order: what one commit writes.
pub(crate) fn last_per_key(changes: &[Change]) -> Vec<&Change> {
    let mut last = std::collections::BTreeMap::new();
    for (index, change) in changes.iter().enumerate() {
        last.insert(change.key(), index);
    }
    let mut kept: Vec<usize> = last.into_values().collect();
    kept.sort_unstable();
    kept.into_iter().map(|index| &changes[index]).collect()
}
