//! How many reservations and shards the central ledger stores, by kind,
//! kept as the records change.

use crate::records::{ReservationRecord, ShardRecord};

/// The counts of the stored reservations and shards that the gauges
/// report (derived; rebuilt as records load). The gauges read them on the
/// ledger's thread at each scrape of `/metrics`, where a pass over every
/// record held for the retention window (a day's by default) kept every
/// other operation waiting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordCounts {
    /// Reservations not yet terminal.
    pub reservations_live: u64,
    /// Terminal reservations kept for the retention window.
    pub reservations_retained: u64,
    /// Shards neither reconciled nor lost, and their units.
    pub open_shards: u64,
    pub shard_units_out: u64,
    /// Shards marked lost and not reconciled, and their units.
    pub lost_shards: u64,
    pub lost_shard_units: u64,
    /// Reconciled shards kept for the retention window.
    pub shards_reconciled: u64,
}

impl RecordCounts {
    /// Counted by a pass over `reservations` and `shards` (the debug
    /// checks' reference).
    pub fn of<'a>(
        reservations: impl Iterator<Item = &'a ReservationRecord>,
        shards: impl Iterator<Item = &'a ShardRecord>,
    ) -> Self {
        let mut counts = Self::default();
        reservations.for_each(|record| counts.reservation(record, Count::Add));
        shards.for_each(|record| counts.shard(record, Count::Add));
        counts
    }

    /// Counts `record` in (a record stored) or out (the record it
    /// replaces, or one forgotten).
    pub(crate) fn reservation(&mut self, record: &ReservationRecord, count: Count) {
        if record.receipt.state.is_terminal() {
            count.apply(&mut self.reservations_retained, 1);
        } else {
            count.apply(&mut self.reservations_live, 1);
        }
    }

    /// As [`Self::reservation`], for a shard.
    pub(crate) fn shard(&mut self, record: &ShardRecord, count: Count) {
        let units = record.shard.allocated_units;
        if record.reconciliation.is_some() {
            count.apply(&mut self.shards_reconciled, 1);
        } else if record.is_lost() {
            count.apply(&mut self.lost_shards, 1);
            count.apply(&mut self.lost_shard_units, units);
        } else {
            count.apply(&mut self.open_shards, 1);
            count.apply(&mut self.shard_units_out, units);
        }
    }
}

/// Whether a record is counted in or out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Count {
    Add,
    Remove,
}

impl Count {
    fn apply(self, total: &mut u64, by: u64) {
        // A count out of one never counted in is a bug the debug checks
        // see (they recount); the gauge stays at 0 rather than wrap.
        *total = match self {
            Self::Add => total.saturating_add(by),
            Self::Remove => total.saturating_sub(by),
        };
    }
}
