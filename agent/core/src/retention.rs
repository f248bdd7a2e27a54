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
//!   reservations, its receipt and those reservations go together (a
//!   multi-leg reservation with the last of its shards: until then another
//!   shard's book holds one of its legs). The pair's `Fence` record stays:
//!   fencing must outlive every shard.
//!
//! Never forgotten: a live reservation, one with sync work (a pending
//! operation, an unknown outcome), an open shard, an unacknowledged
//! receipt, fences, partition state. Each forgotten key is journaled as
//! [`JournalRecord::Forget`], which a journal turns into a deletion.
//!
//! The window has a floor ([`AgentConfig::retention_floor_ms`]): a
//! reservation this agent holds can stay live for up to `local_hold_ms`
//! plus its execution deadline, and a gateway's retry must find it for
//! that long and a margin ([`ledger::RETENTION_MARGIN_MS`]) after. Shells
//! refuse to start with a shorter window ([`AgentConfig::check_retention`]).

use std::collections::BTreeSet;

use ledger::RETENTION_MARGIN_MS;
use shard_format::{ReservationId, ReservationState, ShardId};

use crate::{
    AgentConfig, AgentCore, AgentReservation, AgentState, JournalKey, JournalRecord, Now,
    RecordTally, reservations::needs_retry,
};

/// A retention window shorter than the agent's longest reservation life.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "retention {retention_ms} ms is shorter than {floor_ms} ms: a reservation this agent holds can stay live for up to local_hold_ms + {deadline_setting} = {local_hold_ms} + {deadline_ms} ms, plus a margin of {RETENTION_MARGIN_MS} ms"
)]
pub struct RetentionTooShort {
    pub retention_ms: u64,
    pub floor_ms: u64,
    pub local_hold_ms: u64,
    pub deadline_ms: u64,
    /// The setting the longest execution deadline comes from:
    /// `deadline_ms_max`, or `default_deadline_ms` when that is longer.
    pub deadline_setting: &'static str,
}

impl AgentConfig {
    /// The longest execution deadline a reservation here can get and the
    /// setting it comes from: what a gateway may ask for at most, or the
    /// default (given to a gateway that names none) when that is longer.
    fn longest_deadline(&self) -> (u64, &'static str) {
        if self.default_deadline_ms > self.deadline_ms_max {
            (self.default_deadline_ms, "default_deadline_ms")
        } else {
            (self.deadline_ms_max, "deadline_ms_max")
        }
    }

    /// The shortest retention window this configuration allows: the
    /// longest life of a reservation (`local_hold_ms` + the longest
    /// execution deadline) plus [`RETENTION_MARGIN_MS`].
    pub fn retention_floor_ms(&self) -> u64 {
        self.local_hold_ms
            .saturating_add(self.longest_deadline().0)
            .saturating_add(RETENTION_MARGIN_MS)
    }

    /// Whether `retention_ms` covers [`Self::retention_floor_ms`].
    pub fn check_retention(&self) -> Result<(), RetentionTooShort> {
        let floor_ms = self.retention_floor_ms();
        if self.retention_ms >= floor_ms {
            return Ok(());
        }
        let (deadline_ms, deadline_setting) = self.longest_deadline();
        Err(RetentionTooShort {
            retention_ms: self.retention_ms,
            floor_ms,
            local_hold_ms: self.local_hold_ms,
            deadline_ms,
            deadline_setting,
        })
    }
}

impl AgentCore {
    /// Whether a record at rest waits in the retention queue: central-path
    /// ones always, shard-path ones once their shard is gone.
    pub(crate) fn joins_retention_queue(&self, record: &AgentReservation) -> bool {
        record
            .shard_ids()
            .all(|shard| !self.shards.contains_key(shard))
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
        // Acknowledged receipts: of a closed shard, or of a refused one
        // (no slot) handed back.
        let shard = self
            .receipts
            .acknowledged_by_close()
            .next()
            .map(|(closed_at, _)| self.forget_at(closed_at));
        let due = reservation.into_iter().chain(shard).min()?;
        Some(self.wall_to_mono(due).max(self.forget_not_before_ms))
    }

    /// Whether nothing still refers to a reservation at rest.
    fn untouched(&self, id: &ReservationId) -> bool {
        !self.waiters.contains_key(id)
            && !self.syncing.contains_key(id)
            && !self.usage_deadlines.contains(id)
            && !self.retry_work.contains(id)
    }

    /// Whether a reservation may be forgotten at wall time `wall_ms`.
    fn reservation_forgettable(&self, record: &AgentReservation, wall_ms: u64) -> bool {
        record.is_at_rest()
            && record
                .ended_at
                .is_some_and(|ended_at| self.forget_at(ended_at.get()) <= wall_ms)
            && self.untouched(&record.reservation)
    }

    /// Whether a shard and everything it admitted (`records`: the IDs of
    /// the records that use it) may be forgotten.
    fn shard_forgettable(&self, shard: &ShardId, records: &[ReservationId], wall_ms: u64) -> bool {
        let Some(slot) = self.shards.get(shard) else {
            return false;
        };
        let Some((receipt, true)) = self.receipts.get(shard) else {
            return false;
        };
        slot.book.is_closed()
            && self.forget_at(receipt.closed_at.unix_ms()) <= wall_ms
            && !self
                .in_flight
                .values()
                .any(|what| matches!(what, crate::InFlight::UploadReceipt(up) if up == shard))
            && records
                .iter()
                .filter_map(|id| self.reservations.get(id))
                .all(|r| self.reservation_forgettable(r, wall_ms))
    }

    /// The IDs of the records that use `shard`, in ID order, if all of
    /// them are at rest.
    fn records_of_shard(&self, shard: &ShardId) -> Option<Vec<ReservationId>> {
        let mut ids: Vec<ReservationId> = self
            .shards
            .records_at_rest(shard)?
            .iter()
            .filter(|id| {
                self.reservations
                    .get(id)
                    .is_some_and(|record| record.uses_shard(shard))
            })
            .cloned()
            .collect();
        ids.sort_unstable();
        ids.dedup();
        Some(ids)
    }

    /// The retention sweep: forgets at most `forget_batch_max` records
    /// whose window passed (a shard counts as one).
    pub(crate) fn forget_expired(&mut self, now: Now) {
        let wall_ms = now.wall.unix_ms();
        let budget = self.config.forget_batch_max.max(1);
        let mut forgotten = 0;
        let mut blocked = false;
        // Acknowledged receipts past the window, found in close order and
        // forgotten in shard order, the order of the journal's forgets
        // before. Those of refused shards (never accepted, nothing
        // admitted from them) leave alone.
        let mut due: Vec<ShardId> = self
            .receipts
            .acknowledged_by_close()
            .take_while(|(closed_at, _)| self.forget_at(*closed_at) <= wall_ms)
            .map(|(_, shard)| shard.clone())
            .collect();
        due.sort_unstable();
        let (shards, handed_back): (Vec<ShardId>, Vec<ShardId>) = due
            .into_iter()
            .partition(|shard| self.shards.contains_key(shard));
        for shard in handed_back {
            if forgotten >= budget {
                break;
            }
            self.receipts.remove(&shard);
            self.append(JournalRecord::Forget(JournalKey::TerminalReceipt(shard)));
            forgotten += 1;
        }
        for shard in shards {
            if forgotten >= budget {
                break;
            }
            let forgettable = self
                .records_of_shard(&shard)
                .filter(|records| self.shard_forgettable(&shard, records, wall_ms));
            if let Some(records) = forgettable {
                self.forget_shard(&shard, &records);
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
        self.tally.change(Some(&record), None);
        if let Some(ended_at) = record.ended_at {
            self.retained.remove(&(ended_at.get(), id.clone()));
        }
        self.unknown_seen_at.remove(id);
        self.append(JournalRecord::Forget(JournalKey::Reservation(id.clone())));
    }

    /// Forgets a closed, acknowledged shard with its book, its local
    /// reservations, its receipt and the reservations it admitted
    /// (`records`: the IDs of the records that use it, in ID order). The
    /// pair's fence stays.
    fn forget_shard(&mut self, shard: &ShardId, records: &[ReservationId]) {
        if self.shards.remove(shard).is_none() {
            return;
        }
        self.append(JournalRecord::Forget(JournalKey::ShardBook(shard.clone())));
        self.append(JournalRecord::Forget(JournalKey::Shard(shard.clone())));
        if self.receipts.remove(shard) {
            self.append(JournalRecord::Forget(JournalKey::TerminalReceipt(
                shard.clone(),
            )));
        }
        // A multi-leg reservation is forgotten with the last of its shards:
        // until then another shard's book still holds one of its legs.
        for id in records {
            if self
                .reservations
                .get(id)
                .is_some_and(|r| self.joins_retention_queue(r))
            {
                self.forget_reservation(id);
            }
        }
    }

    /// Debug builds: every derived map agrees with the records.
    pub(crate) fn check_derived(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        for (ended_at, id) in &self.retained {
            debug_assert!(
                self.reservations
                    .get(id)
                    .is_some_and(|r| r.ended_at.map(u64::from) == Some(*ended_at) && r.is_at_rest()),
                "the retention queue names {id}, which is not at rest since {ended_at}"
            );
        }
        debug_assert!(
            self.shards.is_consistent(),
            "the shards' listing by pair differs from their slots"
        );
        debug_assert!(
            self.shards.records_are_noted(self.reservations.values()),
            "what the shards noted of their records differs from the records"
        );
        debug_assert_eq!(
            self.tally,
            RecordTally::of(self.reservations.values()),
            "the records' tally differs from the records"
        );
        debug_assert!(
            self.receipts.is_consistent(),
            "the receipts' orders differ from the receipts"
        );
        debug_assert!(
            self.pairs.is_consistent(),
            "the count of partitioned pairs is wrong"
        );
        if let Some(boot) = self.boot
            && let Some(kept) = self.kept_shard_due(boot.epoch)
        {
            debug_assert_eq!(
                kept,
                self.fresh_shard_due(boot.epoch),
                "the kept time of the next shard request is stale"
            );
        }
        for (shard, slot) in self.shards.iter() {
            let holds_in = |state: ReservationState| {
                self.reservations
                    .values()
                    .filter_map(|record| record.hold(shard))
                    .filter(|hold| hold.state == state)
                    .count()
            };
            debug_assert_eq!(
                slot.book.reserved_holds(),
                holds_in(ReservationState::Reserved),
                "the expiry index of {shard} lists exactly the RESERVED holds its records keep"
            );
            debug_assert_eq!(
                slot.book.started_holds(),
                holds_in(ReservationState::Started),
                "the book of {shard} lists exactly the STARTED holds its records keep"
            );
            // A close ends the reservations among the book's open holds:
            // each one it must end is there.
            let open: BTreeSet<&ReservationId> = slot.book.open_holds().collect();
            for record in self.reservations.values() {
                if record.uses_shard(shard)
                    && matches!(record.state, AgentState::Reserved | AgentState::Started)
                {
                    debug_assert!(
                        open.contains(&record.reservation),
                        "{} is {:?} but its hold in {shard} is not open",
                        record.reservation,
                        record.state
                    );
                }
            }
        }
        debug_assert!(
            self.usage_deadlines.is_consistent(),
            "the usage deadlines by reservation and by time differ"
        );
        for id in self
            .retry_work
            .iter()
            .chain(self.usage_deadlines.ids())
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

#[cfg(test)]
mod tests {
    use super::*;
    use shard_format::KeyId;

    fn config(local_hold_ms: u64, default_deadline_ms: u64, deadline_ms_max: u64) -> AgentConfig {
        let identity: KeyId =
            "ed25519:0000000000000000000000000000000000000000000000000000000000000000"
                .parse()
                .unwrap();
        let mut config = AgentConfig::new(identity);
        config.local_hold_ms = local_hold_ms;
        config.default_deadline_ms = default_deadline_ms;
        config.deadline_ms_max = deadline_ms_max;
        config
    }

    #[test]
    fn the_default_window_covers_the_default_settings() {
        let config = config(30_000, 60_000, 3_600_000);
        assert_eq!(config.retention_floor_ms(), 3_660_000);
        assert_eq!(config.retention_ms, ledger::RETENTION_DEFAULT_MS);
        assert_eq!(config.check_retention(), Ok(()));
    }

    #[test]
    fn exactly_the_floor_is_accepted_one_ms_less_refused() {
        let mut config = config(5_000, 20_000, 20_000);
        assert_eq!(config.retention_floor_ms(), 55_000);
        config.retention_ms = 55_000;
        assert_eq!(config.check_retention(), Ok(()));
        config.retention_ms = 54_999;
        let error = config.check_retention().unwrap_err();
        assert_eq!(
            error,
            RetentionTooShort {
                retention_ms: 54_999,
                floor_ms: 55_000,
                local_hold_ms: 5_000,
                deadline_ms: 20_000,
                deadline_setting: "deadline_ms_max",
            }
        );
        let message = error.to_string();
        assert!(
            message.contains("local_hold_ms + deadline_ms_max"),
            "{message}"
        );
        assert!(message.contains("55000 ms"), "{message}");
    }

    #[test]
    fn a_default_deadline_longer_than_the_maximum_sets_the_floor() {
        // A gateway that names no deadline gets the default, whatever the
        // maximum a gateway may ask for.
        let mut config = config(5_000, 40_000, 20_000);
        assert_eq!(config.retention_floor_ms(), 75_000);
        config.retention_ms = 74_999;
        let error = config.check_retention().unwrap_err();
        assert_eq!(error.deadline_setting, "default_deadline_ms");
        assert_eq!(error.deadline_ms, 40_000);
        config.retention_ms = 75_000;
        assert_eq!(config.check_retention(), Ok(()));
    }

    /// The debug self-check of the derived maps fires on a map that names
    /// a reservation the core does not hold (a bug elsewhere would put it
    /// there).
    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "the retention queue names")]
    fn the_self_check_fires_on_a_retention_entry_without_its_record() {
        let signer = shard_format::Ed25519Signer::from_secret_bytes(&[1; 32]);
        let config = AgentConfig::new(shard_format::DocumentSigner::key_id(&signer).clone());
        let now = Now {
            mono_ms: 0,
            wall: shard_format::Timestamp::from_unix_ms(0).expect("valid"),
        };
        let verifier = shard_format::Ed25519Verifier::new([]);
        let mut core = AgentCore::recover(
            config,
            Box::new(signer),
            Box::new(verifier),
            Vec::new(),
            now,
        );
        core.retained
            .insert((0, ReservationId::new("rl-nobody").expect("valid")));
        core.check_derived();
    }

    #[test]
    fn huge_settings_saturate_instead_of_wrapping() {
        let mut config = config(u64::MAX, 1, 1);
        assert_eq!(config.retention_floor_ms(), u64::MAX);
        config.retention_ms = u64::MAX - 1;
        assert!(config.check_retention().is_err());
    }
}
