//! The core's reservation records, each found by the ID it holds.

use std::collections::BTreeMap;
use std::hash::BuildHasher;

use foldhash::fast::FixedState;
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;
use shard_format::ReservationId;

use crate::{AgentReservation, AgentState};

/// Every reservation record, boxed, found by its own reservation ID: one
/// pointer a slot, where a map from ID to box kept the ID a second time
/// beside it (16 bytes a slot, 2 MiB of hash table for 100,000 open
/// reservations, against 1 MiB now). The hasher is `IdMap`'s, with its fixed
/// seed: the same inputs iterate in the same order on every run.
#[derive(Debug, Clone, Default)]
pub(crate) struct RecordMap {
    table: HashTable<Box<AgentReservation>>,
    hasher: FixedState,
}

impl RecordMap {
    fn hash(&self, id: &ReservationId) -> u64 {
        self.hasher.hash_one(id)
    }

    pub(crate) fn get(&self, id: &ReservationId) -> Option<&AgentReservation> {
        self.table
            .find(self.hash(id), |record| record.reservation == *id)
            .map(Box::as_ref)
    }

    pub(crate) fn get_mut(&mut self, id: &ReservationId) -> Option<&mut AgentReservation> {
        let hash = self.hash(id);
        self.table
            .find_mut(hash, |record| record.reservation == *id)
            .map(Box::as_mut)
    }

    pub(crate) fn contains_key(&self, id: &ReservationId) -> bool {
        self.get(id).is_some()
    }

    /// Puts `record` under its ID, in place of the one there; returns it
    /// as stored.
    pub(crate) fn insert(&mut self, record: Box<AgentReservation>) -> &AgentReservation {
        let hasher = &self.hasher;
        let hash = hasher.hash_one(&record.reservation);
        match self.table.entry(
            hash,
            |stored| stored.reservation == record.reservation,
            |stored| hasher.hash_one(&stored.reservation),
        ) {
            Entry::Occupied(mut stored) => {
                *stored.get_mut() = record;
                stored.into_mut()
            }
            Entry::Vacant(slot) => slot.insert(record).into_mut(),
        }
    }

    pub(crate) fn remove(&mut self, id: &ReservationId) -> Option<Box<AgentReservation>> {
        let hash = self.hash(id);
        let stored = self
            .table
            .find_entry(hash, |record| record.reservation == *id)
            .ok()?;
        Some(stored.remove().0)
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &AgentReservation> {
        self.table.iter().map(Box::as_ref)
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut AgentReservation> {
        self.table.iter_mut().map(Box::as_mut)
    }
}

impl std::ops::Index<&ReservationId> for RecordMap {
    type Output = AgentReservation;

    fn index(&self, id: &ReservationId) -> &AgentReservation {
        self.get(id).expect("a record under this ID")
    }
}

/// What admission and the status read of every record, kept as each
/// record changes: the status (`GET /v1/status`, and each scrape of
/// `/metrics`) counted them by a pass over every record, 43 ms at a
/// million on the daemon's thread.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RecordTally {
    /// Records holding or using units.
    pub(crate) in_flight: usize,
    /// Records in a final state.
    pub(crate) ended: usize,
    /// Records waiting to be synced with the center.
    pub(crate) pending_sync: usize,
    /// Records whose outcome at the center is unknown, with their state.
    pub(crate) unknown: BTreeMap<ReservationId, AgentState>,
}

impl RecordTally {
    pub(crate) fn of<'a>(records: impl Iterator<Item = &'a AgentReservation>) -> Self {
        let mut tally = Self::default();
        for record in records {
            tally.change(None, Some(record));
        }
        tally
    }

    /// Counts a record's change from `before` to `after` (`None`: not
    /// stored).
    pub(crate) fn change(
        &mut self,
        before: Option<&AgentReservation>,
        after: Option<&AgentReservation>,
    ) {
        if let Some(before) = before {
            self.in_flight -= usize::from(before.state.is_in_flight());
            self.ended -= usize::from(before.state.is_final());
            self.pending_sync -= usize::from(before.sync.is_some());
            if before.state.is_unknown() {
                self.unknown.remove(&before.reservation);
            }
        }
        if let Some(after) = after {
            self.in_flight += usize::from(after.state.is_in_flight());
            self.ended += usize::from(after.state.is_final());
            self.pending_sync += usize::from(after.sync.is_some());
            if after.state.is_unknown() {
                self.unknown.insert(after.reservation.clone(), after.state);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SyncOp;
    use crate::tests::shard_record;

    fn record(id: &str, state: AgentState) -> AgentReservation {
        let mut record = shard_record(Default::default());
        record.reservation = ReservationId::new(id).expect("valid");
        record.state = state;
        record
    }

    #[test]
    fn a_tally_follows_each_record_through_its_states() {
        let reserved = record("r-1", AgentState::Reserved);
        let other = record("r-2", AgentState::Released);
        let mut tally = RecordTally::of([&reserved, &other].into_iter());
        assert_eq!(
            (tally.in_flight, tally.ended, tally.pending_sync),
            (1, 1, 0)
        );
        assert!(tally.unknown.is_empty());

        let mut unknown = record("r-1", AgentState::ReservationUnknown);
        unknown.sync = Some(SyncOp::Reserve);
        tally.change(Some(&reserved), Some(&unknown));
        assert_eq!(
            (tally.in_flight, tally.ended, tally.pending_sync),
            (1, 1, 1),
            "an unknown reserve is still in flight"
        );
        assert_eq!(
            tally.unknown.iter().collect::<Vec<_>>(),
            [(&unknown.reservation, &AgentState::ReservationUnknown)]
        );
        let mut usage_unknown = unknown.clone();
        usage_unknown.state = AgentState::UsageUnknown;
        tally.change(Some(&unknown), Some(&usage_unknown));
        assert_eq!(
            tally.unknown.get(&unknown.reservation),
            Some(&AgentState::UsageUnknown)
        );
        assert_eq!(tally.unknown.len(), 1);

        let settled = record("r-1", AgentState::Settled);
        tally.change(Some(&usage_unknown), Some(&settled));
        assert_eq!(
            (tally.in_flight, tally.ended, tally.pending_sync),
            (0, 2, 0)
        );
        assert!(tally.unknown.is_empty());
        tally.change(Some(&settled), None);
        tally.change(Some(&other), None);
        assert_eq!(tally, RecordTally::default());
    }
}
