//! Retention: records at rest are kept `retention_ms` (wall time) after they
//! ended, for idempotent replay, then forgotten from memory and journal.
//!
//! What is forgotten, and when:
//!
//! - a reservation at rest ([`AgentReservation::is_at_rest`]: terminal or
//!   rejected, nothing left to sync) once `ended_at + retention_ms` has
//!   passed, unless a call or a gateway still waits on it. A shard-path
//!   reservation waits for its shard: while the shard's book still holds
//!   its local reservation, the same (derived) reservation ID must not be
//!   reserved again there;
//! - a closed shard whose terminal receipt was acknowledged, once
//!   `closedAt + retention_ms` has passed and every reservation it admitted
//!   is at rest with its own window passed: the shard, its book, its local
//!   reservations, its receipt and those reservations go together. The
//!   pair's `Fence` record stays: fencing must outlive every shard.
//!
//! Never forgotten: a live reservation, one with sync work (a pending
//! operation, an unknown outcome), an open shard, an unacknowledged
//! receipt, fences, partition state. Each forgotten key is journaled as
//! [`JournalRecord::Forget`], which a journal turns into a deletion.

use shard_format::{ReservationId, ShardId};

use crate::{
    AgentCore, AgentReservation, JournalKey, JournalRecord, Now, ReservationPath,
    reservations::needs_retry,
};

impl AgentCore {
    /// Whether a record at rest waits in the retention queue: central-path
    /// ones always, shard-path ones once their shard is gone.
    pub(crate) fn joins_retention_queue(&self, record: &AgentReservation) -> bool {
        match &record.path {
            ReservationPath::Central => true,
            ReservationPath::Shard(shard) => !self.shards.contains_key(shard),
        }
    }

    /// The wall time (Unix ms) from which a record that ended at `ended_at`
    /// may be forgotten.
    fn forget_at(&self, ended_at: u64) -> u64 {
        ended_at.saturating_add(self.config.retention_ms)
    }

    /// A wall time as a monotonic one, through the latest input's clocks.
    fn wall_to_mono(&self, wall_ms: u64) -> u64 {
        let now_wall = self.clock.wall.unix_ms();
        self.clock
            .mono_ms
            .saturating_add(wall_ms.saturating_sub(now_wall))
    }

    /// When the retention sweep has work next (monotonic), if ever.
    pub(crate) fn next_forget_due(&self) -> Option<u64> {
        let reservation = self
            .retained
            .first()
            .map(|(ended_at, _)| self.forget_at(*ended_at));
        let shard = self
            .receipts
            .iter()
            .filter(|(shard, (_, acknowledged))| *acknowledged && self.shards.contains_key(*shard))
            .map(|(_, (receipt, _))| self.forget_at(receipt.closed_at.unix_ms()))
            .min();
        let due = reservation.into_iter().chain(shard).min()?;
        Some(self.wall_to_mono(due).max(self.forget_not_before_ms))
    }

    /// Whether nothing still refers to a reservation at rest.
    fn untouched(&self, id: &ReservationId) -> bool {
        !self.waiters.contains_key(id)
            && !self.syncing.contains_key(id)
            && !self.usage_deadlines.contains_key(id)
            && !self.retry_work.contains(id)
    }

    /// Whether a reservation may be forgotten at wall time `wall_ms`.
    fn reservation_forgettable(&self, record: &AgentReservation, wall_ms: u64) -> bool {
        record.is_at_rest()
            && record
                .ended_at
                .is_some_and(|ended_at| self.forget_at(ended_at) <= wall_ms)
            && self.untouched(&record.reservation)
    }

    /// Whether a shard and everything it admitted may be forgotten.
    fn shard_forgettable(&self, shard: &ShardId, wall_ms: u64) -> bool {
        let Some(slot) = self.shards.get(shard) else {
            return false;
        };
        let Some((receipt, true)) = self.receipts.get(shard) else {
            return false;
        };
        slot.ledger.is_closed()
            && self.forget_at(receipt.closed_at.unix_ms()) <= wall_ms
            && !self
                .in_flight
                .values()
                .any(|what| *what == crate::InFlight::UploadReceipt(shard.clone()))
            && self
                .reservations
                .values()
                .filter(|r| r.path == ReservationPath::Shard(shard.clone()))
                .all(|r| self.reservation_forgettable(r, wall_ms))
    }

    /// The retention sweep: forgets at most `forget_batch_max` records
    /// whose window passed (a shard counts as one).
    pub(crate) fn forget_expired(&mut self, now: Now) {
        let wall_ms = now.wall.unix_ms();
        let budget = self.config.forget_batch_max.max(1);
        let mut forgotten = 0;
        let mut blocked = false;
        let shards: Vec<ShardId> = self
            .receipts
            .iter()
            .filter(|(shard, (_, acknowledged))| *acknowledged && self.shards.contains_key(*shard))
            .filter(|(_, (receipt, _))| self.forget_at(receipt.closed_at.unix_ms()) <= wall_ms)
            .map(|(shard, _)| shard.clone())
            .collect();
        for shard in shards {
            if forgotten >= budget {
                break;
            }
            if self.shard_forgettable(&shard, wall_ms) {
                self.forget_shard(&shard);
                forgotten += 1;
            } else {
                blocked = true;
            }
        }
        // Due records in end order; ones something still refers to are
        // skipped (and counted against the budget, so a sweep stays bounded).
        let mut scanned = 0;
        let due: Vec<ReservationId> = self
            .retained
            .iter()
            .take_while(|(ended_at, _)| self.forget_at(*ended_at) <= wall_ms)
            .map(|(_, id)| id.clone())
            .take(budget.saturating_mul(4))
            .collect();
        for id in due {
            if forgotten >= budget {
                break;
            }
            scanned += 1;
            let forgettable = self
                .reservations
                .get(&id)
                .is_some_and(|record| self.reservation_forgettable(record, wall_ms));
            if forgettable {
                self.forget_reservation(&id);
                forgotten += 1;
            } else {
                blocked = true;
            }
        }
        let more = forgotten >= budget || scanned >= budget.saturating_mul(4);
        self.forget_not_before_ms = if more {
            now.mono_ms
        } else if blocked {
            now.mono_ms.saturating_add(self.config.retry_interval_ms)
        } else {
            0
        };
        self.check_derived();
    }

    /// Forgets one reservation from memory and journal.
    fn forget_reservation(&mut self, id: &ReservationId) {
        let Some(record) = self.reservations.remove(id) else {
            return;
        };
        debug_assert!(!record.state.is_in_flight() && !needs_retry(&record));
        if let Some(ended_at) = record.ended_at {
            self.retained.remove(&(ended_at, id.clone()));
        }
        if self.by_key.get(&record.idempotency_key) == Some(id) {
            self.by_key.remove(&record.idempotency_key);
        }
        self.unknown_seen_at.remove(id);
        self.append(JournalRecord::Forget(JournalKey::Reservation(id.clone())));
    }

    /// Forgets a closed, acknowledged shard with its book, its local
    /// reservations, its receipt and the reservations it admitted. The
    /// pair's fence stays.
    fn forget_shard(&mut self, shard: &ShardId) {
        let Some(slot) = self.shards.remove(shard) else {
            return;
        };
        for local in slot.ledger.reservations() {
            self.append(JournalRecord::Forget(JournalKey::ShardReservation(
                shard.clone(),
                local.reservation.clone(),
            )));
        }
        self.append(JournalRecord::Forget(JournalKey::ShardBook(shard.clone())));
        self.append(JournalRecord::Forget(JournalKey::Shard(shard.clone())));
        if self.receipts.remove(shard).is_some() {
            self.append(JournalRecord::Forget(JournalKey::TerminalReceipt(
                shard.clone(),
            )));
        }
        let admitted: Vec<ReservationId> = self
            .reservations
            .values()
            .filter(|r| r.path == ReservationPath::Shard(shard.clone()))
            .map(|r| r.reservation.clone())
            .collect();
        for id in admitted {
            self.forget_reservation(&id);
        }
    }

    /// Debug builds: every derived map agrees with the records.
    pub(crate) fn check_derived(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        for (key, id) in &self.by_key {
            debug_assert!(
                self.reservations
                    .get(id)
                    .is_some_and(|r| r.idempotency_key == *key),
                "by_key names {id} for {key}, which holds no such record"
            );
        }
        for record in self.reservations.values() {
            debug_assert!(
                self.by_key.contains_key(&record.idempotency_key),
                "{} is not reachable by its idempotency key",
                record.reservation
            );
        }
        for (ended_at, id) in &self.retained {
            debug_assert!(
                self.reservations
                    .get(id)
                    .is_some_and(|r| r.ended_at == Some(*ended_at) && r.is_at_rest()),
                "the retention queue names {id}, which is not at rest since {ended_at}"
            );
        }
        for id in self
            .retry_work
            .iter()
            .chain(self.usage_deadlines.keys())
            .chain(self.waiters.keys())
            .chain(self.syncing.keys())
        {
            debug_assert!(
                self.reservations.contains_key(id),
                "a derived map names forgotten reservation {id}"
            );
        }
    }
}
