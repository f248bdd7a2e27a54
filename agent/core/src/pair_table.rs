//! The core's pairs and their health, with what the timer reads of them.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;

use ledger::PairKey;

use crate::PairHealth;

/// Every pair the core has met, with its health. Each change goes through
/// here, so the table counts the partitioned pairs and moves its
/// generation on whenever a pair is added or its health changes: the timer
/// polled once per turn of the daemon keeps what it derives from the pairs
/// until then instead of a pass over all of them (see
/// `AgentCore::next_shard_due`).
#[derive(Debug, Clone, Default)]
pub(crate) struct PairTable {
    health: BTreeMap<PairKey, PairHealth>,
    counts: Counts,
}

#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    /// How many pairs are partitioned.
    partitioned: usize,
    generation: u64,
}

impl Counts {
    fn changed(&mut self, before: PairHealth, after: PairHealth) {
        if before != after {
            self.generation += 1;
            self.partitioned =
                self.partitioned + usize::from(after.partitioned) - usize::from(before.partitioned);
        }
    }
}

impl PairTable {
    pub(crate) fn get(&self, pair: &PairKey) -> Option<&PairHealth> {
        self.health.get(pair)
    }

    pub(crate) fn get_key_value(&self, pair: &PairKey) -> Option<(&PairKey, &PairHealth)> {
        self.health.get_key_value(pair)
    }

    /// Every pair, in pair order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&PairKey, &PairHealth)> {
        self.health.iter()
    }

    pub(crate) fn any_partitioned(&self) -> bool {
        self.counts.partitioned > 0
    }

    pub(crate) fn partitioned_count(&self) -> usize {
        self.counts.partitioned
    }

    /// Moves on with each pair added and each change of a pair's health.
    pub(crate) fn generation(&self) -> u64 {
        self.counts.generation
    }

    /// Adds `pair`, healthy, unless the table has it.
    pub(crate) fn add(&mut self, pair: PairKey) {
        if let Entry::Vacant(entry) = self.health.entry(pair) {
            entry.insert(PairHealth::default());
            self.counts.generation += 1;
        }
    }

    /// Changes the health of `pair`, if the table has it.
    pub(crate) fn change(&mut self, pair: &PairKey, change: impl FnOnce(&mut PairHealth)) {
        if let Some(health) = self.health.get_mut(pair) {
            let before = *health;
            change(health);
            self.counts.changed(before, *health);
        }
    }

    /// Changes the health of `pair`, added healthy first if new.
    pub(crate) fn change_or_add(&mut self, pair: &PairKey, change: impl FnOnce(&mut PairHealth)) {
        if !self.health.contains_key(pair) {
            self.add(pair.clone());
        }
        self.change(pair, change);
    }

    /// Changes the health of every pair.
    pub(crate) fn change_all(&mut self, mut change: impl FnMut(&mut PairHealth)) {
        for health in self.health.values_mut() {
            let before = *health;
            change(health);
            self.counts.changed(before, *health);
        }
    }

    /// Whether the count of partitioned pairs is right (debug checks).
    pub(crate) fn is_consistent(&self) -> bool {
        self.counts.partitioned
            == self
                .health
                .values()
                .filter(|health| health.partitioned)
                .count()
    }
}

#[cfg(test)]
mod tests {
    use shard_format::{Route, Subject};

    use super::*;

    fn pair(subject: &str) -> PairKey {
        PairKey::new(
            Subject::new(subject).expect("valid"),
            Route::new("chat").expect("valid"),
        )
    }

    fn partition(health: &mut PairHealth) {
        health.partitioned = true;
    }

    #[test]
    fn the_generation_moves_on_only_with_a_change() {
        let mut pairs = PairTable::default();
        pairs.add(pair("a"));
        let added = pairs.generation();
        assert_eq!(added, 1, "a pair came");
        pairs.add(pair("a"));
        pairs.change(&pair("a"), |health| health.consecutive_failures = 0);
        pairs.change(&pair("unknown"), partition);
        assert_eq!(pairs.generation(), added, "nothing changed");
        assert!(pairs.get(&pair("unknown")).is_none());

        pairs.change(&pair("a"), |health| health.next_shard_request_ms = 1);
        assert_eq!(pairs.generation(), added + 1);
        pairs.change_or_add(&pair("b"), |health| health.consecutive_failures = 1);
        assert_eq!(pairs.generation(), added + 3, "added, then changed");
        assert_eq!(
            pairs
                .get(&pair("b"))
                .map(|health| health.consecutive_failures),
            Some(1)
        );
    }

    #[test]
    fn the_partitioned_pairs_are_counted() {
        let mut pairs = PairTable::default();
        assert!(!pairs.any_partitioned());
        pairs.change_or_add(&pair("a"), partition);
        pairs.add(pair("b"));
        assert!(pairs.any_partitioned());
        assert_eq!(pairs.partitioned_count(), 1);
        assert!(pairs.is_consistent());

        pairs.change_all(partition);
        assert_eq!(pairs.partitioned_count(), 2);

        pairs.change_all(partition);
        pairs.change(&pair("a"), |health| health.partitioned = false);
        assert!(pairs.any_partitioned(), "b is still partitioned");
        assert_eq!(pairs.partitioned_count(), 1);
        assert!(pairs.is_consistent());

        pairs.change_all(|health| health.partitioned = false);
        assert!(!pairs.any_partitioned());
        assert_eq!(pairs.partitioned_count(), 0);
        assert!(pairs.is_consistent());
    }

    #[test]
    fn a_wrong_count_of_partitioned_pairs_is_seen() {
        let mut pairs = PairTable::default();
        pairs.change_or_add(&pair("a"), partition);
        pairs.counts.partitioned = 0;
        assert!(!pairs.is_consistent());
    }
}
