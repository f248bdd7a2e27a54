//! Emergency shards: requesting them, accepting them (signature, identity,
//! boot, fence), admitting from them while partitioned, their holds and
//! ends, closing them and their signed terminal receipts.

use std::collections::BTreeSet;
use std::ops::Bound::{Excluded, Unbounded};

use ledger::protocol::ErrorCode;
use ledger::{LocalReservation, PairKey, ShardBook, ShardChange};
use shard_format::{
    EmergencyShardV1, ReservationId, ReservationState, RouteMode, ShardCloseReason, ShardId,
    sign_document, verify_document,
};

use crate::responses::expired_response;
use crate::{
    AcceptedShard, AgentCore, AgentLeg, AgentReservation, AgentState, CentralCall, CentralReply,
    InFlight, JournalRecord, NonMaxU64, Now, ReservationPath, ShardDueInputs, ShardDueMemo,
    ShardSlot, Waiter, one_word,
};

impl AgentCore {
    /// A definite answer to a shard request.
    pub(crate) fn shard_reply(&mut self, pair: &PairKey, reply: CentralReply, now: Now) {
        let backoff = match reply {
            CentralReply::Shard(shard) => match self.accept_shard((*shard).clone(), now) {
                Ok(()) => 0,
                Err(refusal) => {
                    self.hand_back_refused_shard(&shard, &refusal, now);
                    self.config.retry_interval_ms * 10
                }
            },
            CentralReply::Rejected(rejection) => rejection
                .retry_after_seconds
                .map_or(self.config.retry_interval_ms * 30, |seconds| seconds * 1000),
            // Another registration of this identity (a duplicated or retried
            // one) superseded our boot: register again.
            CentralReply::Refused {
                code: ErrorCode::SupersededBoot,
                ..
            } => {
                self.boot = None;
                0
            }
            // Emergency disabled by policy, no policy, too many open shards …
            _ => self.config.retry_interval_ms * 60,
        };
        self.pairs.change(pair, |health| {
            health.next_shard_request_ms = now.mono_ms.saturating_add(backoff);
        });
    }

    /// Verifies and accepts a shard: signed by a trusted central key, bound
    /// to this identity and this boot (epoch and nonce), fenced above every
    /// fence accepted for its pair, still valid.
    pub fn accept_shard(&mut self, shard: EmergencyShardV1, now: Now) -> Result<(), ShardRefusal> {
        self.observe(now);
        verify_document(&shard, self.verifier.as_ref()).map_err(ShardRefusal::Signature)?;
        if shard.gateway_identity != self.config.identity {
            return Err(ShardRefusal::OtherIdentity);
        }
        let boot = self.boot.ok_or(ShardRefusal::NotRegistered)?;
        if shard.boot_epoch != boot.epoch || shard.boot_nonce != boot.nonce {
            return Err(ShardRefusal::OtherBoot);
        }
        let pair = PairKey::new(shard.subject.clone(), shard.route.clone());
        let fence = self.fences.get(&pair).copied().unwrap_or(0);
        if shard.fence <= fence {
            return Err(ShardRefusal::StaleFence {
                fence: shard.fence,
                accepted: fence,
            });
        }
        if self.shards.contains_key(&shard.shard) {
            return Err(ShardRefusal::Duplicate);
        }
        let validity_ms = shard
            .not_after
            .unix_ms()
            .saturating_sub(shard.not_before.unix_ms());
        let usable_ms = validity_ms.saturating_sub(self.config.shard_skew_margin_ms);
        if usable_ms == 0 {
            return Err(ShardRefusal::Expired);
        }
        let accepted = AcceptedShard {
            shard: shard.clone(),
            usable_until_ms: now.mono_ms.saturating_add(usable_ms),
        };
        let (book, opened) = ShardBook::open(shard.clone());
        self.fences.insert(pair.clone(), shard.fence);
        self.append(JournalRecord::Fence {
            pair,
            fence: shard.fence,
        });
        self.append(JournalRecord::Shard(Box::new(accepted.clone())));
        self.journal_shard(&shard.shard, vec![opened]);
        self.shards
            .insert(shard.shard.clone(), ShardSlot { accepted, book });
        Ok(())
    }

    /// A shard this process refused although it names this identity and
    /// its current boot (a wrong central signature, a tampered field, a
    /// stale fence, a validity too short): the center retired its units
    /// for this boot, so a signed terminal receipt reporting every unit
    /// unused goes back at once, queued like any other, and the center
    /// re-mints them instead of waiting for the shard to be marked lost.
    /// If the tampering changed the shard's facts (units, pair, boot
    /// epoch), the center refuses the receipt as a mismatch and the lost
    /// sweep frees the cap later. The shard itself is never used. Returns
    /// whether a receipt was queued.
    pub fn hand_back_refused_shard(
        &mut self,
        shard: &EmergencyShardV1,
        refusal: &ShardRefusal,
        now: Now,
    ) -> bool {
        let Some(boot) = self.boot else {
            return false;
        };
        let bound_here = shard.gateway_identity == self.config.identity
            && shard.boot_epoch == boot.epoch
            && shard.boot_nonce == boot.nonce;
        let refused_here = !matches!(
            refusal,
            ShardRefusal::Duplicate | ShardRefusal::OtherIdentity | ShardRefusal::OtherBoot
        );
        if !bound_here
            || !refused_here
            || self.shards.contains_key(&shard.shard)
            || self.receipts.contains_key(&shard.shard)
        {
            return false;
        }
        let (mut book, _) = ShardBook::open(shard.clone());
        let _ = book.close(ShardCloseReason::Restart, now.wall);
        let Some(mut receipt) = book.terminal_receipt() else {
            return false;
        };
        debug_assert_eq!(receipt.confirmed_unused_units, shard.allocated_units);
        sign_document(&mut receipt, self.signer.as_ref());
        self.receipts.insert(receipt.clone(), false);
        self.append(JournalRecord::TerminalReceipt {
            receipt: Box::new(receipt),
            acknowledged: false,
        });
        self.refused_shards.push(RefusedShard {
            shard: shard.shard.clone(),
            units: shard.allocated_units,
            reason: refusal.to_string(),
        });
        true
    }

    /// Shards refused since the last call, each answered with an
    /// all-unused terminal receipt: the daemon logs them (`shard_refused`).
    pub fn poll_refused_shards(&mut self) -> Vec<RefusedShard> {
        std::mem::take(&mut self.refused_shards)
    }

    /// An open, valid, unpaused shard of the pair with `units` available.
    /// The shard to admit from: of those that cover `floor`, the oldest
    /// fence that covers all of `units` (so older shards drain before
    /// newer), or else the one with the most left (the largest grant).
    pub(crate) fn usable_shard(
        &self,
        pair: &PairKey,
        floor: u64,
        units: u64,
        now: Now,
    ) -> Option<ShardId> {
        let boot = self.boot;
        let usable = self.shards.of_pair(pair).filter(|slot| {
            let shard = &slot.accepted.shard;
            (boot.is_some_and(|boot| {
                shard.boot_epoch == boot.epoch && shard.boot_nonce == boot.nonce
            }) || self.canary_accept_shard_after_restart())
                && !slot.book.is_closed()
                && !slot.book.is_paused()
                && now.mono_ms < slot.accepted.usable_until_ms
                && slot.book.terms().local_available >= floor
        });
        let available = |slot: &&ShardSlot| slot.book.terms().local_available;
        let whole = usable
            .clone()
            .filter(|slot| available(slot) >= units)
            .min_by_key(|slot| slot.accepted.shard.fence);
        whole
            .or_else(|| {
                usable.max_by_key(|slot| {
                    (
                        available(slot),
                        std::cmp::Reverse(slot.accepted.shard.fence),
                    )
                })
            })
            .map(|slot| slot.accepted.shard.shard.clone())
    }

    /// Local holds and shard ends: each open shard with work due, and each
    /// one a reconnect hands back, at its turn in ID order, as the turns
    /// before it left it. No other shard has anything to do at its turn,
    /// and a pass over all of them on each firing of the timer took
    /// 100–270 µs at 1,000 shards (docs/benchmarks-history.md).
    pub(crate) fn expire_shard_holds(&mut self, now: Now) {
        let closing = self
            .shards
            .used()
            .filter(|(_, slot)| self.should_close_after_reconnect(slot));
        let mut pending: BTreeSet<ShardId> = self
            .shards
            .work_due_by(now.mono_ms)
            .chain(closing.map(|(id, _)| id))
            .cloned()
            .collect();
        self.shards.start_noting();
        while let Some(shard_id) = pending.pop_first() {
            self.shard_turn(&shard_id, now);
            // A turn may change books of shards still to come (a close
            // gives back the other legs of its reservations), and so what
            // they have to do at their turns: they get them too. Nothing
            // else a turn changes (no pair's health) matters to them.
            let changed = self.shards.take_noted();
            pending.extend(changed.range((Excluded(&shard_id), Unbounded)).cloned());
        }
        self.shards.stop_noting();
    }

    /// One open shard's turn: its due holds expire; then it closes if its
    /// use ended, or if a reconnect hands it back.
    fn shard_turn(&mut self, shard_id: &ShardId, now: Now) {
        let Some(slot) = self.shards.get(shard_id) else {
            return;
        };
        if slot.book.is_closed() {
            return;
        }
        let ended = now.mono_ms >= slot.accepted.usable_until_ms;
        let reservations = &self.reservations;
        let transition = self
            .shards
            .change_book(shard_id, |book| {
                book.expire_due(now.mono_ms, |id| {
                    reservations
                        .get(id)
                        .and_then(|record| record.hold(shard_id))
                })
            })
            .expect("listed");
        self.keep_holds(shard_id, &transition.changes);
        self.journal_shard(shard_id, transition.changes);
        for id in transition.outcome {
            if let Some(mut record) = self.reservation(&id).cloned() {
                record.state = AgentState::Expired;
                self.finish_slot(&record, now);
                self.answer_waiters(&id, Waiter::Start, expired_response(&record));
                self.put_reservation(record);
            }
        }
        if ended {
            self.close_shard(shard_id, ShardCloseReason::ValidityEnded, now);
        } else if self.should_close_after_reconnect(&self.shards[shard_id]) {
            self.close_shard(shard_id, ShardCloseReason::Reconnect, now);
        }
    }

    /// A shard used while partitioned is handed back once its pair is
    /// healthy again and nothing of it is in flight, so its receipt (and
    /// any debt) reaches the central ledger promptly.
    pub(crate) fn should_close_after_reconnect(&self, slot: &ShardSlot) -> bool {
        let terms = slot.book.terms();
        if terms.local_available >= terms.allocated || terms.local_reserved > 0 {
            return false;
        }
        let pair = PairKey::new(
            slot.accepted.shard.subject.clone(),
            slot.accepted.shard.route.clone(),
        );
        self.pairs
            .get(&pair)
            .is_some_and(|health| !health.partitioned)
    }

    /// Asks for a shard for every healthy pair without a fresh one.
    pub(crate) fn request_shards(&mut self, now: Now) {
        let Some(boot) = self.boot else {
            return;
        };
        let wanted: Vec<PairKey> = self
            .shard_due_by_pair(boot.epoch)
            .filter(|(_, due)| *due <= now.mono_ms)
            .map(|(pair, _)| pair.clone())
            .collect();
        for pair in wanted {
            self.pairs
                .change(&pair, |health| health.shard_request_in_flight = true);
            let call = CentralCall::IssueShard {
                subject: pair.subject.clone(),
                route: pair.route.clone(),
                boot_epoch: boot.epoch,
                boot_nonce: boot.nonce,
            };
            self.send(InFlight::IssueShard(pair), call, now);
        }
    }

    /// When the next pair needs a shard (requested or refreshed).
    /// The answer is kept until a pair or the shard listing changes, or
    /// the boot: the daemon polls the timer once per turn.
    pub(crate) fn next_shard_due(&self) -> Option<u64> {
        let epoch = self.boot?.epoch;
        if let Some(due) = self.kept_shard_due(epoch) {
            return due;
        }
        let due = self.fresh_shard_due(epoch);
        let inputs = self.shard_due_inputs(epoch);
        self.shard_due_memo.set(Some(ShardDueMemo { inputs, due }));
        due
    }

    fn shard_due_inputs(&self, epoch: u64) -> ShardDueInputs {
        ShardDueInputs {
            pairs: self.pairs.generation(),
            shards: self.shards.generation(),
            epoch,
        }
    }

    /// The kept answer of [`Self::next_shard_due`], if what it read is
    /// unchanged.
    pub(crate) fn kept_shard_due(&self, epoch: u64) -> Option<Option<u64>> {
        let memo = self.shard_due_memo.get()?;
        (memo.inputs == self.shard_due_inputs(epoch)).then_some(memo.due)
    }

    /// [`Self::next_shard_due`] from one pass over the pairs.
    pub(crate) fn fresh_shard_due(&self, epoch: u64) -> Option<u64> {
        self.shard_due_by_pair(epoch).map(|(_, due)| due).min()
    }

    /// Each pair that takes shards (healthy, none asked for yet, its route
    /// enforced), with when it needs one: without an open shard of boot
    /// `epoch`, when it may ask; with, not before the latest end of their
    /// use less the refresh margin. The pairs and the shards' listing by
    /// pair come in the same order, so one pass over both finds each
    /// pair's shards: a table of the pairs' ends, built on each poll of
    /// the timer (once per turn of the daemon), took 30 of the poll's 46
    /// µs at 1,000 pairs with a shard each (docs/benchmarks-history.md).
    fn shard_due_by_pair(&self, epoch: u64) -> impl Iterator<Item = (&PairKey, u64)> {
        let margin = self.config.shard_refresh_margin_ms;
        let mut ends = self.shards.open_ends_by_pair().peekable();
        self.pairs
            .iter()
            .filter(|(pair, health)| {
                !health.partitioned
                    && !health.shard_request_in_flight
                    && self.route_mode(&pair.route) == RouteMode::Enforce
            })
            .map(move |(pair, health)| {
                while ends.next_if(|(listed, _)| *listed < pair).is_some() {}
                let refresh = ends
                    .next_if(|(listed, _)| *listed == pair)
                    .and_then(|(_, open)| {
                        open.filter(|(shard_epoch, _)| *shard_epoch == epoch)
                            .map(|(_, usable_until)| usable_until)
                            .max()
                    })
                    .map_or(0, |latest| latest.saturating_sub(margin));
                (pair, refresh.max(health.next_shard_request_ms))
            })
    }

    pub(crate) fn close_shard(&mut self, shard_id: &ShardId, reason: ShardCloseReason, now: Now) {
        let Some(slot) = self.shards.get(shard_id) else {
            return;
        };
        if slot.book.is_closed() {
            return;
        }
        // Its reservations end with it: unstarted ones can never start,
        // started ones' usage is unknown to the shard from here on. Their
        // holds here are RESERVED or STARTED, so the book lists them: a
        // pass over every record, once for each shard that closes, was a
        // burst on the daemon's thread when a partition healed.
        let mut affected: Vec<ReservationId> = slot
            .book
            .open_holds()
            .filter(|id| {
                self.reservations.get(id).is_some_and(|r| {
                    r.uses_shard(shard_id)
                        && matches!(r.state, AgentState::Reserved | AgentState::Started)
                })
            })
            .cloned()
            .collect();
        affected.sort_unstable();
        affected.dedup();
        for id in affected {
            let mut record = self.reservations[&id].clone();
            record.state = if record.state == AgentState::Reserved {
                // Legs end together: the other legs' holds go back now.
                for other in record.shards() {
                    if other != *shard_id
                        && let Some(transition) = self
                            .shards
                            .change_book(&other, |book| book.release(record.hold(&other)))
                    {
                        record.keep_holds(&other, &transition.changes);
                        self.journal_shard(&other, transition.changes);
                    }
                }
                AgentState::Expired
            } else {
                AgentState::UsageUnknown
            };
            self.usage_deadlines.remove(&id);
            self.finish_slot(&record, now);
            self.answer_waiters(&id, Waiter::Start, expired_response(&record));
            self.put_reservation(record);
        }
        let Some((transition, receipt)) = self.shards.change_book(shard_id, |book| {
            (book.close(reason, now.wall), book.terminal_receipt())
        }) else {
            return;
        };
        self.journal_shard(shard_id, transition.changes);
        if let Some(mut receipt) = receipt
            && !self.receipts.contains_key(shard_id)
        {
            sign_document(&mut receipt, self.signer.as_ref());
            self.receipts.insert(receipt.clone(), false);
            self.append(JournalRecord::TerminalReceipt {
                receipt: Box::new(receipt),
                acknowledged: false,
            });
        }
    }

    /// Journals a shard transition's changes: the book's totals as they
    /// are, a hold with its reservation's record (see
    /// [`JournalRecord::ReservationWithHolds`]).
    /// Keeps the holds among `changes` in their reservations' records as
    /// they are stored (a step that changes a record of its own keeps
    /// them in its copy: [`AgentReservation::keep_holds`]).
    pub(crate) fn keep_holds(&mut self, shard: &ShardId, changes: &[ShardChange]) {
        for change in changes {
            if let ShardChange::Reservation(local) = change
                && let Some(record) = self.reservations.get_mut(&local.reservation)
            {
                record.keep_hold(shard, local);
            }
        }
    }

    pub(crate) fn journal_shard(&mut self, shard: &ShardId, changes: Vec<ShardChange>) {
        for change in changes {
            match change {
                ShardChange::Reservation(local) => self.append_reservation(local.reservation),
                change => self.append(JournalRecord::ShardBook {
                    shard: shard.clone(),
                    change,
                }),
            }
        }
    }

    #[cfg(feature = "canaries")]
    pub(crate) fn canary_accept_shard_after_restart(&self) -> bool {
        self.config.canaries.accept_shard_after_restart
    }

    #[cfg(not(feature = "canaries"))]
    pub(crate) fn canary_accept_shard_after_restart(&self) -> bool {
        false
    }

    #[cfg(feature = "canaries")]
    pub(crate) fn canary_admit_legs_without_shards(&self) -> bool {
        self.config.canaries.admit_legs_without_shards
    }

    #[cfg(not(feature = "canaries"))]
    pub(crate) fn canary_admit_legs_without_shards(&self) -> bool {
        false
    }

    #[cfg(feature = "canaries")]
    pub(crate) fn canary_admit_below_floor_from_shards(&self) -> bool {
        self.config.canaries.admit_below_floor_from_shards
    }

    #[cfg(not(feature = "canaries"))]
    pub(crate) fn canary_admit_below_floor_from_shards(&self) -> bool {
        false
    }
}

/// A shard this process refused and handed back with an all-unused
/// terminal receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusedShard {
    pub shard: ShardId,
    pub units: u64,
    /// Why it was refused ([`ShardRefusal`]'s sentence).
    pub reason: String,
}

/// Why a shard was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardRefusal {
    #[error("signature refused: {0}")]
    Signature(shard_format::SignatureError),
    #[error("the shard is bound to another gateway identity")]
    OtherIdentity,
    #[error("this process has not registered a boot epoch yet")]
    NotRegistered,
    #[error("the shard is bound to another boot epoch or nonce")]
    OtherBoot,
    #[error("fence {fence} is not above the accepted fence {accepted}")]
    StaleFence { fence: u64, accepted: u64 },
    #[error("the shard was accepted already")]
    Duplicate,
    #[error("the shard's validity is shorter than the skew margin")]
    Expired,
}

/// A shard hold as a reservation's record keeps it: the shard's book keeps
/// none, so an open emergency reservation is one record. The record (or
/// the leg whose units come from the shard) keeps the hold's own state,
/// expiry and overdraft; the units held, the operation and the usage are
/// the record's own fields.
impl AgentReservation {
    /// Its hold in the book of `shard`, if it holds units there.
    pub fn hold(&self, shard: &ShardId) -> Option<LocalReservation> {
        let local = |state: ReservationState,
                     units: Option<NonMaxU64>,
                     actual: Option<NonMaxU64>,
                     expires_at_ms: u64,
                     overdraft_units: u64| {
            // A hold has the operation once started, the usage once settled.
            let started = matches!(
                state,
                ReservationState::Started
                    | ReservationState::UsageUnknown
                    | ReservationState::Settled
                    | ReservationState::SettledWithDebt
            );
            let settled = matches!(
                state,
                ReservationState::Settled | ReservationState::SettledWithDebt
            );
            LocalReservation {
                reservation: self.reservation.clone(),
                units: units.map_or(0, u64::from),
                state,
                operation_id: self.operation_id.clone().filter(|_| started),
                expires_at_ms,
                actual_units: actual.map(u64::from).filter(|_| settled),
                overdraft_units,
            }
        };
        if self.legs.is_empty() {
            if !matches!(&self.path, ReservationPath::Shard(own) if own == shard) {
                return None;
            }
            Some(local(
                self.hold_state?,
                self.reserved_units,
                self.actual_units,
                self.hold_expires_at_ms,
                self.hold_overdraft_units,
            ))
        } else {
            let leg = self
                .legs
                .iter()
                .find(|leg| leg.shard.as_ref() == Some(shard))?;
            Some(local(
                leg.hold_state?,
                leg.reserved_units,
                leg.actual_units,
                leg.hold_expires_at_ms,
                leg.hold_overdraft_units,
            ))
        }
    }

    /// Keeps the holds among a shard transition's `changes` that are this
    /// reservation's: the shard's book keeps none.
    pub fn keep_holds(&mut self, shard: &ShardId, changes: &[ShardChange]) {
        for change in changes {
            if let ShardChange::Reservation(local) = change
                && local.reservation == self.reservation
            {
                self.keep_hold(shard, local);
            }
        }
    }

    /// Keeps `local` as the hold in the book of `shard`: in the leg whose
    /// units come from `shard`, or (one leg) in the record itself.
    pub fn keep_hold(&mut self, shard: &ShardId, local: &LocalReservation) {
        if local.operation_id.is_some() {
            self.operation_id.clone_from(&local.operation_id);
        }
        if self.legs.is_empty() {
            keep_hold_fields(
                local,
                &mut self.reserved_units,
                &mut self.actual_units,
                &mut self.hold_state,
                &mut self.hold_expires_at_ms,
                &mut self.hold_overdraft_units,
            );
        } else if let Some(leg) = self
            .legs
            .iter_mut()
            .find(|leg| leg.shard.as_ref() == Some(shard))
        {
            leg.keep_hold(local);
        } else {
            debug_assert!(false, "no leg of {} holds in {shard}", self.reservation);
        }
    }
}

impl AgentLeg {
    /// Keeps `local` as the leg's hold (the operation is the record's:
    /// see [`AgentReservation::keep_hold`]).
    pub fn keep_hold(&mut self, local: &LocalReservation) {
        keep_hold_fields(
            local,
            &mut self.reserved_units,
            &mut self.actual_units,
            &mut self.hold_state,
            &mut self.hold_expires_at_ms,
            &mut self.hold_overdraft_units,
        );
    }
}

/// Writes `local` into the fields a record, or a leg, keeps of its hold:
/// the units held, the usage once settled, and the hold's own state,
/// expiry and overdraft.
fn keep_hold_fields(
    local: &LocalReservation,
    reserved_units: &mut Option<NonMaxU64>,
    actual_units: &mut Option<NonMaxU64>,
    hold_state: &mut Option<ReservationState>,
    hold_expires_at_ms: &mut u64,
    hold_overdraft_units: &mut u64,
) {
    *reserved_units = Some(one_word(local.units));
    if local.actual_units.is_some() {
        *actual_units = local.actual_units.map(one_word);
    }
    *hold_state = Some(local.state);
    *hold_expires_at_ms = local.expires_at_ms;
    *hold_overdraft_units = local.overdraft_units;
}

#[cfg(test)]
mod tests {
    use ledger::LegAsk;
    use shard_format::{OperationId, ReservationId, Route, Subject};
    use thin_vec::ThinVec;

    use super::*;
    use crate::tests::shard_record;

    fn leg_on(shard: &ShardId) -> AgentLeg {
        AgentLeg {
            shard: Some(shard.clone()),
            ..AgentLeg::from(LegAsk {
                subject: Subject::new("tenant-a").expect("valid"),
                route: Route::new(format!("route-{shard}")).expect("valid"),
                units: 10,
                min_units: None,
            })
        }
    }

    /// A record gives back the shard hold it keeps, in every state a hold
    /// takes, for one leg and per leg; and only in the shard it holds in.
    #[test]
    fn a_record_gives_back_the_hold_it_keeps() {
        let one = ShardId::new("sh-1").expect("valid");
        let other = ShardId::new("sh-2").expect("valid");
        let operation = Some(OperationId::new("op-1").expect("valid"));
        let holds = [
            (ReservationState::Reserved, None, None, 0),
            (ReservationState::Started, operation.clone(), None, 0),
            (ReservationState::UsageUnknown, operation.clone(), None, 0),
            // Zero used is a settlement, not an absent one.
            (ReservationState::Settled, operation.clone(), Some(0), 0),
            (ReservationState::SettledWithDebt, operation, Some(14), 2),
            (ReservationState::Released, None, None, 0),
            (ReservationState::Expired, None, None, 0),
        ];
        for (state, operation_id, actual_units, overdraft_units) in holds {
            let local = LocalReservation {
                reservation: ReservationId::new("rl-1").expect("valid"),
                units: 8,
                state,
                operation_id,
                expires_at_ms: 5_000,
                actual_units,
                overdraft_units,
            };
            let mut record = shard_record(ThinVec::new());
            assert_eq!(record.hold(&one), None, "nothing kept yet");
            record.keep_hold(&one, &local);
            assert_eq!(record.hold(&one).as_ref(), Some(&local), "{state:?}");
            assert_eq!(record.hold(&other), None, "not its shard");

            let mut record = shard_record([leg_on(&one), leg_on(&other)].into_iter().collect());
            record.keep_hold(&other, &local);
            assert_eq!(record.hold(&other).as_ref(), Some(&local), "{state:?}");
            assert_eq!(record.hold(&one), None, "the first leg holds nothing yet");
        }
    }

    /// The record takes the usage before its shard settles: the hold has
    /// none until its own settlement.
    #[test]
    fn a_started_hold_has_no_usage_though_its_record_has() {
        let shard = ShardId::new("sh-1").expect("valid");
        let mut record = shard_record(ThinVec::new());
        let started = LocalReservation {
            reservation: record.reservation.clone(),
            units: 10,
            state: ReservationState::Started,
            operation_id: Some(OperationId::new("op-1").expect("valid")),
            expires_at_ms: 5_000,
            actual_units: None,
            overdraft_units: 0,
        };
        record.keep_hold(&shard, &started);
        record.actual_units = Some(one_word(7));
        assert_eq!(record.hold(&shard), Some(started));
    }
}
