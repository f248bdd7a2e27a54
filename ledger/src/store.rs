//! The persistence boundary of the central ledger.
//!
//! A [`LedgerStore`] keeps the latest version of every record. Its contract:
//!
//! 1. **Atomic**: [`LedgerStore::commit`] makes all of its changes visible or
//!    none of them, also across a crash.
//! 2. **Durable**: once `commit` returns `Ok`, a crash of the process or the
//!    machine loses none of its changes. Nothing may be acknowledged to a
//!    caller before that.
//! 3. **Keyed**: a change replaces the stored record with the same
//!    [`RecordKey`], and [`Change::Forget`] deletes it;
//!    [`LedgerStore::load_all`] returns exactly one record per key still
//!    stored, the last committed, and never a `Forget`.
//! 4. **Failed commits change nothing**: after an `Err`, the store holds what
//!    it held before; the caller must rebuild its ledger from the store.
//!
//! [`MemoryStore`] keeps records in memory (the simulator's store, with fault
//! injection); the central service keeps its resident ledger's records in
//! redb. Both pass [`contract::check_store`]. (The central service's
//! PostgreSQL store loads part of the ledger per batch instead; it passes
//! the central service's batch-store contract.)

use std::collections::BTreeMap;

use crate::records::{Change, RecordKey};

/// Durable storage for the central ledger's records. See the module
/// documentation for the contract.
pub trait LedgerStore {
    type Error: std::error::Error + Send + Sync + 'static;

    /// Commits `changes` atomically and durably (contract items 1, 2, 4).
    fn commit(&mut self, changes: &[Change]) -> Result<(), Self::Error>;

    /// Every stored record, one per key (contract item 3), in key order.
    fn load_all(&self) -> Result<Vec<Change>, Self::Error>;
}

/// A commit the in-memory store was told to fail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("injected storage fault: commit failed")]
pub struct InjectedFault;

/// Records in a map. Faults are injected on request: the next `n` commits
/// fail without changing anything, as a crash before the commit would.
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    records: BTreeMap<RecordKey, Change>,
    failing_commits: u32,
    commits: u64,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes the next `count` commits fail.
    pub fn fail_next_commits(&mut self, count: u32) {
        self.failing_commits = count;
    }

    /// Successful commits so far.
    pub fn commits(&self) -> u64 {
        self.commits
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The committed record under `key`, if any (no copy of the store).
    pub fn get(&self, key: &RecordKey) -> Option<&Change> {
        self.records.get(key)
    }

    /// Every committed record with its key, in key order (what
    /// [`LedgerStore::load_all`] returns, borrowed).
    pub fn records(&self) -> impl Iterator<Item = (&RecordKey, &Change)> {
        self.records.iter()
    }
}

impl LedgerStore for MemoryStore {
    type Error = InjectedFault;

    fn commit(&mut self, changes: &[Change]) -> Result<(), InjectedFault> {
        if self.failing_commits > 0 {
            self.failing_commits -= 1;
            return Err(InjectedFault);
        }
        for change in changes {
            match change {
                Change::Forget(key) => {
                    self.records.remove(key);
                }
                _ => {
                    self.records.insert(change.key(), change.clone());
                }
            }
        }
        self.commits += 1;
        Ok(())
    }

    fn load_all(&self) -> Result<Vec<Change>, InjectedFault> {
        Ok(self.records.values().cloned().collect())
    }
}

/// The contract tests every [`LedgerStore`] passes.
pub mod contract {
    use shard_format::{
        AdmissionBudgetV1, Digest, EmergencyMode, IdempotencyKey, KeyId, Refill, Route, RouteMode,
        Subject, Timestamp,
    };

    use super::LedgerStore;
    use crate::central::{CentralConfig, CentralLedger};
    use crate::invariants::audit;
    use crate::outcomes::{ReserveOutcome, ReserveRequest};
    use crate::records::{Change, PairKey};

    /// A small enforcing policy for `tenant-7/chat.generate`.
    pub fn sample_policy(generation: u64) -> AdmissionBudgetV1 {
        AdmissionBudgetV1 {
            schema: Default::default(),
            subject: Subject::new("tenant-7").expect("valid"),
            route: Route::new("chat.generate").expect("valid"),
            region: "eu-west-1".into(),
            capacity_unit: "tokens".into(),
            policy_generation: generation,
            opening: 1000,
            refill: Refill {
                units: 100,
                interval_ms: 1000,
            },
            burst: 1000,
            accounting_epoch_ms: 3_600_000,
            estimator_digest: Digest([7; 32]),
            reservation_units_max: 800,
            hold_ttl_ms: 30_000,
            priority: 0,
            fairness_weight: 1,
            overdraft_units_max: 200,
            execution_hard_limit_ms: 600_000,
            emergency_mode: EmergencyMode::Enabled,
            mode: RouteMode::Enforce,
            emergency_shard_units: 200,
            emergency_shard_validity_ms: 600_000,
        }
    }

    fn reserve_request(index: u64) -> ReserveRequest {
        ReserveRequest::new(
            KeyId::new(format!("ed25519:{}", "11".repeat(32))).expect("valid"),
            IdempotencyKey::new(format!("req-{index}")).expect("valid"),
            Subject::new("tenant-7").expect("valid"),
            Route::new("chat.generate").expect("valid"),
            10 + index,
            Digest::sha256(&index.to_le_bytes()),
        )
    }

    /// Runs every contract check. `fresh` makes an empty store; `reopen`
    /// closes a store and opens it again over the same data (a restart).
    /// Panics with the failed contract item.
    pub fn check_store<S: LedgerStore>(mut fresh: impl FnMut() -> S, reopen: impl Fn(S) -> S) {
        empty_store_loads_nothing(fresh());
        replays_one_record_per_key(fresh(), &reopen);
        forgotten_records_are_gone(fresh(), &reopen);
        ledger_rebuilds_identically(fresh(), &reopen);
    }

    fn empty_store_loads_nothing<S: LedgerStore>(store: S) {
        assert!(
            store.load_all().expect("load").is_empty(),
            "contract 3: an empty store loads nothing"
        );
    }

    fn replays_one_record_per_key<S: LedgerStore>(mut store: S, reopen: &impl Fn(S) -> S) {
        let first = Change::Policy(Box::new(sample_policy(1)));
        let mut replaced = sample_policy(1);
        replaced.opening = 500;
        let second = Change::Policy(Box::new(replaced));
        let other = Change::Policy(Box::new(sample_policy(2)));
        store.commit(&[first, other.clone()]).expect("commit");
        store.commit(std::slice::from_ref(&second)).expect("commit");
        let store = reopen(store);
        let loaded = store.load_all().expect("load");
        assert_eq!(
            loaded,
            vec![second, other],
            "contract 3: the last committed record per key survives a reopen"
        );
    }

    fn forgotten_records_are_gone<S: LedgerStore>(mut store: S, reopen: &impl Fn(S) -> S) {
        let policy = |generation| Change::Policy(Box::new(sample_policy(generation)));
        let (kept, forgotten, back, fleeting) = (policy(1), policy(2), policy(3), policy(4));
        store
            .commit(&[kept.clone(), forgotten.clone(), back.clone()])
            .expect("commit");
        let never_stored = policy(9).key();
        store
            .commit(&[
                Change::Forget(forgotten.key()),
                Change::Forget(back.key()),
                Change::Forget(never_stored),
            ])
            .expect("contract 3: forgetting a key never stored is harmless");
        store.commit(std::slice::from_ref(&back)).expect("commit");
        store
            .commit(&[fleeting.clone(), Change::Forget(fleeting.key())])
            .expect("commit");
        let store = reopen(store);
        assert_eq!(
            store.load_all().expect("load"),
            vec![kept, back],
            "contract 3: a forgotten key stays gone across a reopen, a later write brings it back, \
             and within one commit the last change per key wins"
        );
    }

    fn ledger_rebuilds_identically<S: LedgerStore>(mut store: S, reopen: &impl Fn(S) -> S) {
        let start = Timestamp::from_unix_ms(1_784_469_600_000).expect("valid");
        let mut ledger = CentralLedger::new(CentralConfig::default());
        let transition = ledger.publish_policy(sample_policy(1), start);
        store.commit(&transition.changes).expect("commit");
        for index in 0..20 {
            let transition = ledger.reserve(reserve_request(index), start);
            assert!(matches!(
                transition.outcome,
                ReserveOutcome::Reserved(_) | ReserveOutcome::Rejected(_)
            ));
            store.commit(&transition.changes).expect("commit");
        }
        let store = reopen(store);
        let reloaded =
            CentralLedger::from_records(CentralConfig::default(), store.load_all().expect("load"))
                .expect("contract 2: committed records load into a clean ledger");
        let pair = PairKey::new(
            Subject::new("tenant-7").expect("valid"),
            Route::new("chat.generate").expect("valid"),
        );
        assert_eq!(
            reloaded.accounts().collect::<Vec<_>>(),
            ledger.accounts().collect::<Vec<_>>(),
            "contract 2: every committed account survives"
        );
        assert_eq!(
            reloaded.reservations().count(),
            ledger.reservations().count()
        );
        assert_eq!(reloaded.policy(&pair), ledger.policy(&pair));
        assert!(audit(&reloaded).is_clean());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_store_passes_the_contract() {
        contract::check_store(MemoryStore::new, |store| store);
    }

    #[test]
    fn failed_commit_changes_nothing() {
        let mut store = MemoryStore::new();
        store.fail_next_commits(1);
        let change = Change::Policy(Box::new(contract::sample_policy(1)));
        assert!(store.commit(std::slice::from_ref(&change)).is_err());
        assert!(store.is_empty());
        store.commit(&[change]).expect("the fault was used up");
        assert_eq!(store.len(), 1);
    }
}
