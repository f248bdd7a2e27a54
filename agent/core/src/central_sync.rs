//! The central ledger's side: results of central calls, each reservation's
//! sync operation (sent, answered, lost), the retry timer and the
//! resolution of unknown outcomes (abandon, refresh).

use std::collections::BTreeSet;
use std::num::NonZeroU64;

use ledger::protocol::ErrorCode;
use ledger::{LegActual, LegAsk, ReservationOrigin, ReserveRequest, SettleActuals};
use shard_format::{
    LimitReservationV1, ReservationId, ReservationState, ShardCloseReason, ShardId,
    ShardTerminalReceiptV1,
};

use crate::responses::{
    expired_response, refused_response, reservation_response, unknown_response,
};
use crate::{
    AgentCore, AgentReservation, AgentState, Boot, CentralCall, CentralReply, CentralResult,
    GatewayResponse, InFlight, JournalRecord, Now, RequestId, ReservationPath, SyncOp, Waiter,
};

impl AgentCore {
    /// The result of a central call.
    pub fn handle_central(&mut self, request: RequestId, result: CentralResult, now: Now) {
        self.observe(now);
        let Some(what) = self.in_flight.remove(&request) else {
            return; // a late answer to a call we gave up on: harmless, resent later
        };
        let pair = match &what {
            InFlight::Sync(id, _) => {
                self.syncing.remove(id);
                self.reservation(id).map(AgentReservation::pair)
            }
            InFlight::IssueShard(pair) => {
                self.pairs
                    .change(pair, |health| health.shard_request_in_flight = false);
                Some(pair.clone())
            }
            InFlight::Register | InFlight::Health | InFlight::UploadReceipt(_) => None,
        };
        let reply = match result {
            CentralResult::OutcomeUnknown => {
                self.note_failure(pair.as_ref());
                if let InFlight::Sync(id, _) = &what {
                    self.sync_outcome_unknown(id);
                }
                return;
            }
            CentralResult::Reply(reply) => reply,
        };
        self.note_success(pair.as_ref());
        match what {
            InFlight::Register => match reply {
                CentralReply::Registered {
                    boot_epoch,
                    boot_nonce,
                } => {
                    self.boot = Some(Boot {
                        epoch: boot_epoch,
                        nonce: boot_nonce,
                    });
                    // Shards of any earlier boot are dead from here on.
                    let keep_old = self.canary_accept_shard_after_restart();
                    let stale: Vec<ShardId> = self
                        .shards
                        .iter()
                        .filter(|(_, slot)| {
                            !keep_old
                                && !slot.book.is_closed()
                                && slot.accepted.shard.boot_epoch != boot_epoch
                        })
                        .map(|(id, _)| id.clone())
                        .collect();
                    for id in stale {
                        self.close_shard(&id, ShardCloseReason::Restart, now);
                    }
                }
                _ => {
                    // Not enrolled (or refused): try again on the retry timer.
                }
            },
            InFlight::Health => {}
            InFlight::Sync(id, op) => self.sync_reply(&id, op, reply, now),
            InFlight::IssueShard(pair) => self.shard_reply(&pair, reply, now),
            InFlight::UploadReceipt(shard) => {
                let definite = matches!(
                    reply,
                    CentralReply::ReceiptAccepted(_)
                        | CentralReply::Refused { .. }
                        | CentralReply::Invalid { .. }
                );
                // A refusal is final too (unknown shard, wrong identity):
                // retrying would never succeed.
                if definite && let Some(receipt) = self.receipts.acknowledge(&shard) {
                    let record = JournalRecord::TerminalReceipt {
                        receipt: Box::new(receipt.clone()),
                        acknowledged: true,
                    };
                    self.append(record);
                }
            }
        }
    }

    /// A sync call's reply was lost.
    fn sync_outcome_unknown(&mut self, id: &ReservationId) {
        let Some(mut record) = self.reservation(id).cloned() else {
            return;
        };
        match record.state {
            AgentState::Requested => {
                record.state = AgentState::ReservationUnknown;
                self.put_reservation(record.clone());
                self.answer_waiters(id, Waiter::Reserve, unknown_response(&record));
            }
            AgentState::ReservationUnknown => {
                self.answer_waiters(id, Waiter::Reserve, unknown_response(&record));
            }
            AgentState::Starting => self.answer_waiters(
                id,
                Waiter::Start,
                GatewayResponse::Unavailable {
                    code: ErrorCode::StartUnknown,
                    message: format!(
                        "the start of {id} may not have reached the central ledger; retry it with the same operation ID"
                    ),
                    retry_after_seconds: 1,
                },
            ),
            AgentState::Settling => {
                self.answer_waiters(id, Waiter::Settle, GatewayResponse::Accepted(Box::new(record)));
            }
            AgentState::Releasing => {
                self.answer_waiters(id, Waiter::Release, GatewayResponse::Accepted(Box::new(record)));
            }
            _ => {}
        }
    }

    /// A definite central answer to the sync operation `op` that was sent.
    /// The record's pending operation may have changed meanwhile (a
    /// gateway retried while an abandon was under way): the answer is
    /// applied for what was sent, and a different pending operation stays
    /// pending.
    fn sync_reply(&mut self, id: &ReservationId, op: SyncOp, reply: CentralReply, now: Now) {
        let Some(mut record) = self.reservation(id).cloned() else {
            return;
        };
        let pending = record.sync.clone();
        // Only a reserve is judged field by field at the center (its legs);
        // to any other call a 400 is a definite refusal like the others.
        let reply = match reply {
            CentralReply::Invalid {
                code,
                field,
                message,
            } if op == SyncOp::Reserve => {
                record.sync = still_pending(&pending, &op);
                record.state = AgentState::Rejected;
                self.put_reservation(record);
                let invalid = GatewayResponse::Invalid {
                    code,
                    field,
                    message,
                };
                return self.answer_waiters(id, Waiter::Reserve, invalid);
            }
            CentralReply::Invalid { code, message, .. } => CentralReply::Refused {
                status: 400,
                code,
                message,
            },
            reply => reply,
        };
        match (op.clone(), reply) {
            (SyncOp::Reserve, CentralReply::Reservation(receipt)) => {
                record.sync = still_pending(&pending, &op);
                record.state = agent_state_of(&receipt);
                let created = record.receipt.is_none();
                record.accept_receipt(*receipt);
                self.put_and_answer_waiters(record, Waiter::Reserve, created);
            }
            (
                SyncOp::Reserve,
                reply @ (CentralReply::Rejected(_) | CentralReply::LegRejected { .. }),
            ) => {
                let (rejection, leg) = match reply {
                    CentralReply::LegRejected { index, rejection } => {
                        (rejection, record.leg_pair(index).map(|pair| (index, pair)))
                    }
                    CentralReply::Rejected(rejection) => (rejection, None),
                    _ => unreachable!("matched above"),
                };
                record.sync = still_pending(&pending, &op);
                record.state = AgentState::Rejected;
                record.rejection = Some(Box::new(rejection));
                let response = if record.shadow {
                    reservation_response(self.put_reservation(record), true)
                } else {
                    self.put_reservation(record);
                    GatewayResponse::Rejected {
                        reservation: id.clone(),
                        rejection,
                        leg,
                    }
                };
                self.answer_waiters(id, Waiter::Reserve, response);
            }
            (SyncOp::Reserve, CentralReply::NotEnforced) => {
                // The route is off at the center: admitted without a hold
                // (§3.8). The record ends as a refusal does, so a retry
                // asks the center again.
                record.sync = still_pending(&pending, &op);
                record.state = AgentState::Rejected;
                self.put_reservation(record);
                self.answer_waiters(id, Waiter::Reserve, GatewayResponse::PassThrough);
            }
            (
                SyncOp::Reserve,
                CentralReply::Refused {
                    status,
                    code,
                    message,
                },
            ) => {
                record.sync = still_pending(&pending, &op);
                record.state = if code == ErrorCode::ReservationAbandoned {
                    AgentState::Abandoned
                } else {
                    AgentState::Rejected
                };
                self.put_reservation(record);
                self.answer_waiters(id, Waiter::Reserve, refused_response(status, code, message));
            }
            (SyncOp::Abandon, CentralReply::Tombstoned) => {
                record.sync = still_pending(&pending, &op);
                record.state = AgentState::Abandoned;
                self.put_reservation(record);
            }
            (SyncOp::Abandon, CentralReply::Reservation(receipt)) => {
                // Abandoned (it was RESERVED and is released now) — or it
                // had moved on; either way the central receipt is the truth.
                record.sync = still_pending(&pending, &op);
                record.state = agent_state_of(&receipt);
                record.accept_receipt(*receipt);
                self.put_reservation(record);
            }
            (SyncOp::Abandon, CentralReply::Refused { .. }) => {
                record.sync = still_pending(&pending, &op);
                record.state = AgentState::Abandoned;
                self.put_reservation(record);
            }
            (SyncOp::Start, CentralReply::Reservation(receipt)) => {
                record.sync = still_pending(&pending, &op);
                record.state = agent_state_of(&receipt);
                record.accept_receipt(*receipt);
                let started = matches!(
                    record.state,
                    AgentState::Started
                        | AgentState::UsageUnknown
                        | AgentState::Settled
                        | AgentState::SettledWithDebt
                );
                let response = if started {
                    if record.state.is_final() {
                        // Settled at the center already (at the hard limit):
                        // nothing left to pace here.
                        self.finish_slot(&record, now);
                    }
                    if record.state == AgentState::Started {
                        let deadline = record
                            .deadline_ms
                            .map_or(self.config.default_deadline_ms, NonZeroU64::get);
                        self.usage_deadlines
                            .insert(id.clone(), now.mono_ms.saturating_add(deadline));
                    }
                    reservation_response(&record, false)
                } else {
                    // The hold ran out first: the start lost against expiry.
                    self.finish_slot(&record, now);
                    expired_response(&record)
                };
                self.put_reservation(record);
                self.answer_waiters(id, Waiter::Start, response);
            }
            (
                SyncOp::Start,
                CentralReply::Refused {
                    status,
                    code,
                    message,
                },
            ) => {
                record.sync = still_pending(&pending, &op);
                record.state = AgentState::Reserved;
                record.operation_id = None;
                self.finish_slot(&record, now);
                self.put_reservation(record);
                self.answer_waiters(id, Waiter::Start, refused_response(status, code, message));
            }
            (SyncOp::Settle, CentralReply::Settled(settlement)) => {
                record.sync = still_pending(&pending, &op);
                record.state = if settlement.any_overdraft() {
                    AgentState::SettledWithDebt
                } else {
                    AgentState::Settled
                };
                // The center's receipt reads settled now: keep the copy in
                // step with the record.
                if let Some(receipt) = &mut record.receipt {
                    receipt.state = settlement.state;
                    receipt.actual_units = Some(settlement.actual_units);
                }
                record.settlement = Some(settlement);
                self.put_and_answer_waiters(record, Waiter::Settle, false);
            }
            (
                SyncOp::Settle,
                CentralReply::Refused {
                    status,
                    code,
                    message,
                },
            ) => {
                // A definite refusal (e.g. a conflicting earlier settlement):
                // retrying would not change it.
                record.sync = still_pending(&pending, &op);
                self.put_reservation(record);
                self.answer_waiters(id, Waiter::Settle, refused_response(status, code, message));
            }
            (SyncOp::Release, CentralReply::Reservation(receipt)) => {
                record.sync = still_pending(&pending, &op);
                record.state = agent_state_of(&receipt);
                record.accept_receipt(*receipt);
                self.put_and_answer_waiters(record, Waiter::Release, false);
            }
            (
                SyncOp::Release,
                CentralReply::Refused {
                    status,
                    code,
                    message,
                },
            ) => {
                // The center's reservation moved on (expired, abandoned):
                // ask it how, so the record does not stay RELEASING.
                record.sync = still_pending(&pending, &op).or(Some(SyncOp::Refresh));
                self.put_reservation(record);
                self.answer_waiters(id, Waiter::Release, refused_response(status, code, message));
            }
            (SyncOp::Refresh, CentralReply::Reservation(receipt)) => {
                record.sync = still_pending(&pending, &op);
                if record.state == AgentState::Releasing {
                    // The release was refused: the center's reservation ends
                    // otherwise (`EXPIRING` always ends `EXPIRED`). Until it
                    // has, ask again, so the record never stays RELEASING.
                    if !agent_state_of(&receipt).is_final() {
                        record.sync = record.sync.or(Some(SyncOp::Refresh));
                        self.put_reservation(record);
                        return;
                    }
                    record.state = agent_state_of(&receipt);
                    record.accept_receipt(*receipt);
                    self.put_and_answer_waiters(record, Waiter::Release, false);
                    return;
                }
                if receipt.state.is_settled() {
                    // Settled at the center (perhaps conservatively, at the
                    // hard limit). `actual_units` stays unset here, so a
                    // genuine receipt from the gateway is still forwarded and
                    // corrects a conservative settlement once.
                    record.state = agent_state_of(&receipt);
                    record.accept_receipt(*receipt);
                    self.finish_slot(&record, now);
                }
                self.put_reservation(record);
            }
            (SyncOp::Refresh, _) => {
                record.sync = still_pending(&pending, &op);
                self.put_reservation(record);
            }
            (op, reply) => {
                debug_assert!(false, "unexpected reply {reply:?} to {op:?}");
            }
        }
    }

    /// Sends the reservation's pending sync operation, unless one is under way.
    pub(crate) fn send_sync(&mut self, id: &ReservationId, now: Now) {
        if self.syncing.contains_key(id) {
            return;
        }
        let Some(record) = self.reservations.get(id) else {
            return;
        };
        let Some(op) = record.sync.clone() else {
            return;
        };
        let call = match op.clone() {
            SyncOp::Reserve => CentralCall::Reserve(ReserveRequest {
                owner: self.config.identity.clone(),
                idempotency_key: record.idempotency_key.clone(),
                reservation: id.clone(),
                subject: record.subject.clone(),
                route: record.route.clone(),
                units: record.units,
                min_units: record.min_units.map(u64::from),
                policy_generation: None,
                request_digest: record.request_digest,
                hold_ttl_ms: None,
                more_legs: record
                    .legs
                    .iter()
                    .skip(1)
                    .map(|leg| LegAsk {
                        subject: leg.subject.clone(),
                        route: leg.route.clone(),
                        units: leg.units,
                        min_units: leg.min_units.map(u64::from),
                    })
                    .collect(),
            }),
            SyncOp::Start => CentralCall::Start {
                reservation: id.clone(),
                operation_id: record.operation_id.clone().expect("bound before start"),
                deadline_ms: record.deadline_ms.map(NonZeroU64::get),
            },
            SyncOp::Settle => CentralCall::Settle {
                reservation: id.clone(),
                operation_id: record.operation_id.clone().expect("bound before settle"),
                actuals: if record.legs.is_empty() {
                    SettleActuals::One(record.actual_units.expect("recorded before settle").get())
                } else {
                    SettleActuals::Legs(
                        record
                            .legs
                            .iter()
                            .map(|leg| LegActual {
                                subject: leg.subject.clone(),
                                route: leg.route.clone(),
                                actual_units: leg
                                    .actual_units
                                    .expect("every leg recorded before settle")
                                    .get(),
                            })
                            .collect(),
                    )
                },
            },
            SyncOp::Release => CentralCall::Release {
                reservation: id.clone(),
            },
            SyncOp::Abandon => CentralCall::Abandon {
                reservation: id.clone(),
                origin: ReservationOrigin {
                    subject: record.subject.clone(),
                    route: record.route.clone(),
                    idempotency_key: record.idempotency_key.clone(),
                },
            },
            SyncOp::Refresh => CentralCall::Get {
                reservation: id.clone(),
            },
        };
        let request = self.send(InFlight::Sync(id.clone(), op), call, now);
        self.syncing.insert(id.clone(), request);
    }

    /// Periodic work: registration, sync retries, probes, receipts, shards.
    pub(crate) fn retry(&mut self, now: Now) {
        if self.boot.is_none() && !self.in_flight.values().any(|w| *w == InFlight::Register) {
            self.send(InFlight::Register, CentralCall::Register, now);
        }
        let any_partitioned = self.any_partitioned();
        if any_partitioned && !self.in_flight.values().any(|w| *w == InFlight::Health) {
            self.send(InFlight::Health, CentralCall::Health, now);
        }
        // Unknown reserves nobody waits for any more are abandoned (after a
        // grace period in which the gateway may still retry), never re-sent
        // under a new ID.
        let retry_work = &self.retry_work;
        self.unknown_seen_at.retain(|id, _| retry_work.contains(id));
        let grace = self.config.unknown_abandon_grace_ms;
        let unknown: Vec<ReservationId> = self
            .retry_work
            .iter()
            .map(|id| &self.reservations[id])
            .filter(|r| {
                r.state == AgentState::ReservationUnknown
                    && r.sync == Some(SyncOp::Reserve)
                    && !self.waiters.contains_key(&r.reservation)
                    && !self.syncing.contains_key(&r.reservation)
            })
            .map(|r| r.reservation.clone())
            .collect();
        let unknown: Vec<ReservationId> = unknown
            .into_iter()
            .filter(|id| {
                let seen = *self
                    .unknown_seen_at
                    .entry(id.clone())
                    .or_insert(now.mono_ms);
                now.mono_ms.saturating_sub(seen) >= grace
            })
            .collect();
        for id in unknown {
            let mut record = self.reservations[&id].clone();
            record.sync = Some(SyncOp::Abandon);
            self.put_reservation(record);
        }
        // Usage in doubt that nobody settles here may have been settled at
        // the center (by a receipt sent before a restart, or the hard limit).
        let in_doubt: Vec<ReservationId> = self
            .retry_work
            .iter()
            .map(|id| &self.reservations[id])
            .filter(|r| {
                r.state == AgentState::UsageUnknown
                    && r.path == ReservationPath::Central
                    && r.sync.is_none()
                    && !self.waiters.contains_key(&r.reservation)
            })
            .map(|r| r.reservation.clone())
            .collect();
        for id in in_doubt {
            let mut record = self.reservations[&id].clone();
            record.sync = Some(SyncOp::Refresh);
            self.put_reservation(record);
        }
        let pending: Vec<ReservationId> = self
            .retry_work
            .iter()
            .map(|id| &self.reservations[id])
            .filter(|r| r.sync.is_some() && !self.syncing.contains_key(&r.reservation))
            .filter(|r| !self.is_partitioned(&r.pair()))
            .map(|r| r.reservation.clone())
            .collect();
        for id in pending {
            self.send_sync(&id, now);
        }
        if !any_partitioned {
            // The uploads in flight, gathered once: looked up by a pass
            // over every call in flight for each receipt, the retry took
            // 5 ms at 1,000 receipts waiting and 135 ms at 5,000.
            let uploading: BTreeSet<&ShardId> = self
                .in_flight
                .values()
                .filter_map(|what| match what {
                    InFlight::UploadReceipt(shard) => Some(shard),
                    _ => None,
                })
                .collect();
            let uploads: Vec<ShardTerminalReceiptV1> = self
                .receipts
                .unacknowledged()
                .filter(|shard| !uploading.contains(shard))
                .filter_map(|shard| self.receipts.get(shard))
                .map(|(receipt, _)| receipt.clone())
                .collect();
            for receipt in uploads {
                self.send(
                    InFlight::UploadReceipt(receipt.shard.clone()),
                    CentralCall::UploadReceipt(Box::new(receipt)),
                    now,
                );
            }
        }
        self.request_shards(now);
    }

    /// Whether the retry timer has anything to do besides shard supply.
    pub(crate) fn has_retry_work(&self) -> bool {
        self.boot.is_none()
            || self.any_partitioned()
            || !self.retry_work.is_empty()
            || self.receipts.unacknowledged_count() > 0
            || self
                .shards
                .used()
                .any(|(_, slot)| self.should_close_after_reconnect(slot))
    }
}

/// What stays pending after `sent` was answered: nothing, unless another
/// operation replaced it meanwhile.
fn still_pending(pending: &Option<SyncOp>, sent: &SyncOp) -> Option<SyncOp> {
    pending.clone().filter(|op| op != sent)
}

fn agent_state_of(receipt: &LimitReservationV1) -> AgentState {
    match receipt.state {
        ReservationState::Requested => AgentState::Requested,
        ReservationState::Reserved => AgentState::Reserved,
        ReservationState::Started => AgentState::Started,
        ReservationState::Settled => AgentState::Settled,
        ReservationState::SettledWithDebt => AgentState::SettledWithDebt,
        ReservationState::Released => AgentState::Released,
        ReservationState::Expiring | ReservationState::Expired => AgentState::Expired,
        ReservationState::ReservationUnknown => AgentState::ReservationUnknown,
        ReservationState::UsageUnknown => AgentState::UsageUnknown,
        ReservationState::Abandoned => AgentState::Abandoned,
    }
}

#[cfg(test)]
mod tests {
    use ledger::protocol::ErrorCode;

    use crate::tests::{
        at, calls, commit, new_core, recovered, register, registered, replies, reserve,
        terminal_receipt, the_call,
    };
    use crate::{
        AgentCore, AgentState, CentralCall, CentralReply, CentralResult, GatewayResponse,
        JournalRecord, SyncOp,
    };

    /// The shards whose receipts `core` uploads next.
    fn uploads(core: &mut AgentCore) -> Vec<(crate::RequestId, String)> {
        calls(core)
            .into_iter()
            .filter_map(|call| match call.call {
                CentralCall::UploadReceipt(receipt) => {
                    Some((call.request, receipt.shard.as_str().to_owned()))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_receipt_is_not_uploaded_again_while_its_upload_is_in_flight() {
        let journal = ["sh-1", "sh-2"].map(|shard| JournalRecord::TerminalReceipt {
            receipt: Box::new(terminal_receipt(shard, 1_784_469_000_000)),
            acknowledged: false,
        });
        let mut core = recovered(0, |_| {}, journal);
        register(&mut core, 0);
        commit(&mut core);
        core.handle_timeout(at(1_000));
        let sent = uploads(&mut core);
        let shards: Vec<&str> = sent.iter().map(|(_, shard)| shard.as_str()).collect();
        assert_eq!(shards, ["sh-1", "sh-2"]);

        // Both still in flight a retry later: neither is sent again.
        core.handle_timeout(at(2_000));
        assert!(uploads(&mut core).is_empty());

        // One is lost: only that one goes again.
        core.handle_central(sent[0].0, CentralResult::OutcomeUnknown, at(2_500));
        core.handle_timeout(at(3_000));
        let again: Vec<String> = uploads(&mut core).into_iter().map(|(_, s)| s).collect();
        assert_eq!(again, ["sh-1"]);
    }

    #[test]
    fn registration_is_sent_again_only_once_the_last_one_failed() {
        let mut core = new_core(0, |_| {});
        let sent = calls(&mut core);
        let register = the_call(&sent, |call| *call == CentralCall::Register);
        core.handle_timeout(at(0));
        assert!(calls(&mut core).is_empty(), "one registration at a time");
        core.handle_central(register, CentralResult::OutcomeUnknown, at(500));
        core.handle_timeout(at(1_000));
        let again = calls(&mut core);
        the_call(&again, |call| *call == CentralCall::Register);
    }

    #[test]
    fn a_partitioned_agent_probes_one_call_at_a_time_and_a_healthy_one_never() {
        let mut core = registered(0, |config| config.partition_failures_max = 1);
        core.handle_gateway(1, reserve("k-1", 10), at(0));
        let sent = calls(&mut core);
        let reserve_call = the_call(&sent, |call| matches!(call, CentralCall::Reserve(_)));
        core.handle_central(reserve_call, CentralResult::OutcomeUnknown, at(0));
        assert!(core.any_partitioned());
        core.handle_timeout(at(1_000));
        let sent = calls(&mut core);
        assert_eq!(sent.len(), 1, "{sent:?}");
        let probe = the_call(&sent, |call| *call == CentralCall::Health);
        core.handle_timeout(at(2_000));
        assert!(calls(&mut core).is_empty(), "the probe is still under way");
        core.handle_central(
            probe,
            CentralResult::Reply(CentralReply::Healthy),
            at(2_500),
        );
        assert!(!core.any_partitioned());
        core.handle_timeout(at(3_000));
        let sent = calls(&mut core);
        assert!(
            sent.iter().all(|call| call.call != CentralCall::Health),
            "{sent:?}"
        );
        the_call(&sent, |call| matches!(call, CentralCall::Reserve(_)));
    }

    /// The gateway retries an unknown reserve while its abandon is under
    /// way: the abandon's answer leaves the retry pending, and the retry
    /// learns the ID is abandoned.
    #[test]
    fn a_reserve_retried_during_its_abandon_is_sent_after_it_and_told_abandoned() {
        let mut core = registered(0, |config| config.unknown_abandon_grace_ms = 0);
        core.handle_gateway(1, reserve("k-1", 10), at(0));
        let sent = calls(&mut core);
        let first = the_call(&sent, |call| matches!(call, CentralCall::Reserve(_)));
        core.handle_central(first, CentralResult::OutcomeUnknown, at(0));
        assert_eq!(replies(&mut core).len(), 1, "answered unknown");
        core.handle_timeout(at(1_000));
        let sent = calls(&mut core);
        let abandon = the_call(&sent, |call| matches!(call, CentralCall::Abandon { .. }));
        core.handle_gateway(2, reserve("k-1", 10), at(1_100));
        assert!(
            calls(&mut core).is_empty(),
            "one call per reservation at a time"
        );
        core.handle_central(
            abandon,
            CentralResult::Reply(CentralReply::Tombstoned),
            at(1_200),
        );
        let id = core.reservations().next().unwrap().reservation.clone();
        let record = core.reservation(&id).unwrap();
        assert_eq!(record.state, AgentState::Abandoned);
        assert_eq!(
            record.sync,
            Some(SyncOp::Reserve),
            "the retry is still to send"
        );
        core.handle_timeout(at(2_000));
        let sent = calls(&mut core);
        let resent = the_call(&sent, |call| matches!(call, CentralCall::Reserve(_)));
        core.handle_central(
            resent,
            CentralResult::Reply(CentralReply::Refused {
                status: 409,
                code: ErrorCode::ReservationAbandoned,
                message: "abandoned".into(),
            }),
            at(2_000),
        );
        let answers = replies(&mut core);
        assert_eq!(answers.len(), 1);
        assert_eq!(answers[0].0, 2);
        assert!(
            matches!(
                &answers[0].1,
                GatewayResponse::Refused {
                    status: 409,
                    code: ErrorCode::ReservationAbandoned,
                    ..
                }
            ),
            "{answers:?}"
        );
        let record = core.reservation(&id).unwrap();
        assert_eq!(
            (record.state, record.sync.clone()),
            (AgentState::Abandoned, None)
        );
    }

    /// Pending sync work keeps the retry timer running whether or not the
    /// pair is partitioned.
    #[test]
    fn a_healthy_agent_with_a_reserve_to_resend_wakes_at_the_retry_interval() {
        let mut core = registered(0, |_| {});
        core.handle_gateway(1, reserve("k-1", 10), at(0));
        let sent = calls(&mut core);
        let first = the_call(&sent, |call| matches!(call, CentralCall::Reserve(_)));
        core.handle_central(first, CentralResult::OutcomeUnknown, at(0));
        assert!(!core.any_partitioned(), "one failure of three");
        core.handle_timeout(at(0));
        let sent = calls(&mut core);
        // The resend and a shard request (which stays unanswered).
        let resent = the_call(&sent, |call| matches!(call, CentralCall::Reserve(_)));
        the_call(&sent, |call| matches!(call, CentralCall::IssueShard { .. }));
        core.handle_central(resent, CentralResult::OutcomeUnknown, at(0));
        assert_eq!(core.poll_timeout(), Some(1_000));
    }
}
