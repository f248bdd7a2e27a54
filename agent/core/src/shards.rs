//! Emergency shards: requesting them, accepting them (signature, identity,
//! boot, fence), admitting from them while partitioned, their holds and
//! ends, closing them and their signed terminal receipts.

use ledger::protocol::ErrorCode;
use ledger::{PairKey, ShardBook, ShardChange};
use shard_format::{
    EmergencyShardV1, RouteMode, ShardCloseReason, ShardId, sign_document, verify_document,
};

use crate::responses::expired_response;
use crate::{
    AcceptedShard, AgentCore, AgentState, CentralCall, CentralReply, InFlight, JournalRecord, Now,
    ShardSlot, Waiter,
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
        if let Some(health) = self.pairs.get_mut(pair) {
            health.next_shard_request_ms = now.mono_ms.saturating_add(backoff);
        }
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
        self.receipts
            .insert(shard.shard.clone(), (receipt.clone(), false));
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
        let usable = self.shards.values().filter(|slot| {
            let shard = &slot.accepted.shard;
            shard.subject == pair.subject
                && shard.route == pair.route
                && (boot.is_some_and(|boot| {
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

    /// Local holds and shard ends.
    pub(crate) fn expire_shard_holds(&mut self, now: Now) {
        // Closed shards stay until retention forgets them; they have no
        // holds and no end left.
        let shard_ids: Vec<ShardId> = self
            .shards
            .iter()
            .filter(|(_, slot)| !slot.book.is_closed())
            .map(|(shard_id, _)| shard_id.clone())
            .collect();
        for shard_id in shard_ids {
            let slot = self.shards.get_mut(&shard_id).expect("listed");
            if slot.book.is_closed() {
                continue;
            }
            let reservations = &self.reservations;
            let transition = slot.book.expire_due(now.mono_ms, |id| {
                reservations
                    .get(id)
                    .and_then(|record| record.hold(&shard_id))
            });
            let ended = now.mono_ms >= slot.accepted.usable_until_ms;
            self.keep_holds(&shard_id, &transition.changes);
            self.journal_shard(&shard_id, transition.changes);
            for id in transition.outcome {
                if let Some(mut record) = self.reservation(&id).cloned() {
                    record.state = AgentState::Expired;
                    self.finish_slot(&record, now);
                    self.answer_waiters(&id, Waiter::Start, expired_response(&record));
                    self.put_reservation(record);
                }
            }
            if ended {
                self.close_shard(&shard_id, ShardCloseReason::ValidityEnded, now);
            } else if self.should_close_after_reconnect(&shard_id) {
                self.close_shard(&shard_id, ShardCloseReason::Reconnect, now);
            }
        }
    }

    /// A shard used while partitioned is handed back once its pair is
    /// healthy again and nothing of it is in flight, so its receipt (and
    /// any debt) reaches the central ledger promptly.
    pub(crate) fn should_close_after_reconnect(&self, shard_id: &ShardId) -> bool {
        let slot = &self.shards[shard_id];
        let terms = slot.book.terms();
        if terms.local_available >= terms.allocated || terms.local_reserved > 0 {
            return false;
        }
        let pair = PairKey::new(
            slot.accepted.shard.subject.clone(),
            slot.accepted.shard.route.clone(),
        );
        !self.is_partitioned(&pair) && self.pairs.contains_key(&pair)
    }

    /// Asks for a shard for every healthy pair without a fresh one.
    pub(crate) fn request_shards(&mut self, now: Now) {
        let Some(boot) = self.boot else {
            return;
        };
        let wanted: Vec<PairKey> = self
            .pairs
            .iter()
            .filter(|(pair, health)| {
                !health.partitioned
                    && !health.shard_request_in_flight
                    && now.mono_ms >= health.next_shard_request_ms
                    && self.route_mode(&pair.route) == RouteMode::Enforce
            })
            .map(|(pair, _)| pair.clone())
            .collect();
        for pair in wanted {
            let fresh = self.shards.values().any(|slot| {
                slot.accepted.shard.subject == pair.subject
                    && slot.accepted.shard.route == pair.route
                    && slot.accepted.shard.boot_epoch == boot.epoch
                    && !slot.book.is_closed()
                    && slot.accepted.usable_until_ms
                        > now
                            .mono_ms
                            .saturating_add(self.config.shard_refresh_margin_ms)
            });
            if fresh {
                continue;
            }
            if let Some(health) = self.pairs.get_mut(&pair) {
                health.shard_request_in_flight = true;
            }
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
    pub(crate) fn next_shard_due(&self) -> Option<u64> {
        let boot = self.boot?;
        self.pairs
            .iter()
            .filter(|(pair, health)| {
                !health.partitioned
                    && !health.shard_request_in_flight
                    && self.route_mode(&pair.route) == RouteMode::Enforce
            })
            .map(|(pair, health)| {
                let refresh = self
                    .shards
                    .values()
                    .filter(|slot| {
                        slot.accepted.shard.subject == pair.subject
                            && slot.accepted.shard.route == pair.route
                            && slot.accepted.shard.boot_epoch == boot.epoch
                            && !slot.book.is_closed()
                    })
                    .map(|slot| {
                        slot.accepted
                            .usable_until_ms
                            .saturating_sub(self.config.shard_refresh_margin_ms)
                    })
                    .max()
                    .unwrap_or(0);
                refresh.max(health.next_shard_request_ms)
            })
            .min()
    }

    pub(crate) fn close_shard(&mut self, shard_id: &ShardId, reason: ShardCloseReason, now: Now) {
        let Some(slot) = self.shards.get_mut(shard_id) else {
            return;
        };
        if slot.book.is_closed() {
            return;
        }
        // Its reservations end with it: unstarted ones can never start,
        // started ones' usage is unknown to the shard from here on.
        let affected = self.sorted_ids(|r| {
            r.uses_shard(shard_id) && matches!(r.state, AgentState::Reserved | AgentState::Started)
        });
        for id in affected {
            let mut record = self.reservations[&id].clone();
            record.state = if record.state == AgentState::Reserved {
                // Legs end together: the other legs' holds go back now.
                for other in record.shards() {
                    if other != *shard_id
                        && let Some(slot) = self.shards.get_mut(&other)
                    {
                        let transition = slot.book.release(record.hold(&other));
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
        let Some(slot) = self.shards.get_mut(shard_id) else {
            return;
        };
        let transition = slot.book.close(reason, now.wall);
        let receipt = slot.book.terminal_receipt();
        self.journal_shard(shard_id, transition.changes);
        if let Some(mut receipt) = receipt
            && !self.receipts.contains_key(shard_id)
        {
            sign_document(&mut receipt, self.signer.as_ref());
            self.receipts
                .insert(shard_id.clone(), (receipt.clone(), false));
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
