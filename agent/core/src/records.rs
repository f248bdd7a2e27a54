//! The core's reservation records, each found by the ID it holds.

use std::hash::BuildHasher;

use foldhash::fast::FixedState;
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;
use shard_format::ReservationId;

use crate::AgentReservation;

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
