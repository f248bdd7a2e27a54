//! The usage deadline of every started reservation, by reservation and by
//! time.
//!
//! The core asks for its next deadline after every step
//! ([`crate::AgentCore::poll_timeout`]) and for the overdue ones at every
//! timeout: kept only by reservation, each was a scan of every started
//! reservation — one per step, thousands long for a gateway with that many
//! executions under way.

use std::collections::{BTreeMap, BTreeSet};

use shard_format::ReservationId;

#[derive(Debug, Clone, Default)]
pub(crate) struct UsageDeadlines {
    /// Monotonic deadline of each started reservation.
    by_reservation: BTreeMap<ReservationId, u64>,
    /// The same deadlines, earliest first.
    by_time: BTreeSet<(u64, ReservationId)>,
}

impl UsageDeadlines {
    /// Sets `id`'s deadline to `at` (replacing an earlier one).
    pub(crate) fn insert(&mut self, id: ReservationId, at: u64) {
        if let Some(before) = self.by_reservation.insert(id.clone(), at) {
            self.by_time.remove(&(before, id.clone()));
        }
        self.by_time.insert((at, id));
    }

    pub(crate) fn remove(&mut self, id: &ReservationId) {
        if let Some(at) = self.by_reservation.remove(id) {
            self.by_time.remove(&(at, id.clone()));
        }
    }

    pub(crate) fn contains(&self, id: &ReservationId) -> bool {
        self.by_reservation.contains_key(id)
    }

    pub(crate) fn ids(&self) -> impl Iterator<Item = &ReservationId> {
        self.by_reservation.keys()
    }

    /// The earliest deadline.
    pub(crate) fn next(&self) -> Option<u64> {
        self.by_time.first().map(|(at, _)| *at)
    }

    /// Removes every deadline at or before `now_ms` and returns their
    /// reservations in ID order (the order in which they were handled when
    /// the deadlines were kept by reservation only).
    pub(crate) fn take_due(&mut self, now_ms: u64) -> Vec<ReservationId> {
        let mut due = Vec::new();
        while let Some((at, _)) = self.by_time.first()
            && *at <= now_ms
        {
            let Some((_, id)) = self.by_time.pop_first() else {
                break;
            };
            self.by_reservation.remove(&id);
            due.push(id);
        }
        due.sort_unstable();
        due
    }

    /// Whether both indexes hold the same deadlines.
    pub(crate) fn is_consistent(&self) -> bool {
        self.by_reservation.len() == self.by_time.len()
            && self
                .by_time
                .iter()
                .all(|(at, id)| self.by_reservation.get(id) == Some(at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(text: &str) -> ReservationId {
        ReservationId::new(text).expect("a valid ID")
    }

    #[test]
    fn the_next_deadline_is_the_earliest_and_follows_replacements_and_removals() {
        let mut deadlines = UsageDeadlines::default();
        assert_eq!(deadlines.next(), None);
        deadlines.insert(id("b"), 30);
        deadlines.insert(id("a"), 20);
        deadlines.insert(id("c"), 25);
        assert_eq!(deadlines.next(), Some(20));
        // A later start of the same reservation moves its deadline.
        deadlines.insert(id("a"), 40);
        assert_eq!(deadlines.next(), Some(25));
        deadlines.remove(&id("c"));
        assert_eq!(deadlines.next(), Some(30));
        assert!(deadlines.is_consistent());
        assert!(deadlines.contains(&id("a")));
        assert!(!deadlines.contains(&id("c")));
    }

    #[test]
    fn indexes_that_disagree_are_not_consistent() {
        let mut deadlines = UsageDeadlines::default();
        deadlines.insert(id("a"), 10);
        deadlines.insert(id("b"), 20);
        assert!(deadlines.is_consistent());
        // The same reservations, one at another time.
        let mut moved = deadlines.clone();
        moved.by_time.remove(&(20, id("b")));
        moved.by_time.insert((21, id("b")));
        assert!(!moved.is_consistent());
        // A reservation missing from the time index.
        let mut missing = deadlines.clone();
        missing.by_time.remove(&(20, id("b")));
        assert!(!missing.is_consistent());
    }

    #[test]
    fn due_deadlines_are_taken_up_to_and_including_now_in_id_order() {
        let mut deadlines = UsageDeadlines::default();
        deadlines.insert(id("z"), 10);
        deadlines.insert(id("m"), 11);
        deadlines.insert(id("a"), 11);
        deadlines.insert(id("k"), 12);
        assert_eq!(deadlines.take_due(9), Vec::<ReservationId>::new());
        assert_eq!(deadlines.take_due(11), vec![id("a"), id("m"), id("z")]);
        assert_eq!(deadlines.ids().collect::<Vec<_>>(), vec![&id("k")]);
        assert_eq!(deadlines.next(), Some(12));
        assert!(deadlines.is_consistent());
    }
}
