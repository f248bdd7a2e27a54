//! Per-pair partition state: a `(subject, route)` is partitioned after
//! `partition_failures_max` consecutive failed or timed-out central calls,
//! and healthy again after the first definite answer.

use ledger::PairKey;

use crate::{AgentCore, PairHealth};

impl AgentCore {
    /// Whether any pair is treated as partitioned.
    pub fn any_partitioned(&self) -> bool {
        self.pairs.any_partitioned()
    }

    pub fn is_partitioned(&self, pair: &PairKey) -> bool {
        self.pairs
            .get(pair)
            .is_some_and(|health| health.partitioned)
    }

    pub(crate) fn note_failure(&mut self, pair: Option<&PairKey>) {
        let max = self.config.partition_failures_max;
        let mark = |health: &mut PairHealth| {
            health.consecutive_failures = health.consecutive_failures.saturating_add(1);
            if health.consecutive_failures >= max {
                health.partitioned = true;
            }
        };
        match pair {
            Some(pair) => self.pairs.change_or_add(pair, mark),
            None => self.pairs.change_all(mark),
        }
    }

    /// Only a definite answer from the central ledger ends a partition.
    pub(crate) fn note_success(&mut self, pair: Option<&PairKey>) {
        let clear = |health: &mut PairHealth| {
            health.consecutive_failures = 0;
            health.partitioned = false;
        };
        match pair {
            Some(pair) => self.pairs.change_or_add(pair, clear),
            None => self.pairs.change_all(clear),
        }
    }
}
