//! Gateway requests: reserve, get, start, settle, release and cancel, the
//! reservation records' bookkeeping and the start slots they hold.

use ledger::protocol::ErrorCode;
use ledger::{
    PairKey, ShardReleaseOutcome, ShardReserveOutcome, ShardSettleOutcome, ShardStartOutcome,
};
use shard_format::{OperationId, ReservationId, RouteMode, request_digest};

use crate::responses::{expired_response, illegal_state, reservation_response, unknown_response};
use crate::scheduler::Admission;
use crate::{
    AgentCore, AgentReservation, AgentState, CallId, GatewayRequest, GatewayReserve,
    GatewayResponse, JournalRecord, Now, ReservationPath, SyncOp, Waiter,
};

impl AgentCore {
    /// A gateway call.
    pub fn handle_gateway(&mut self, call: CallId, request: GatewayRequest, now: Now) {
        self.observe(now);
        match request {
            GatewayRequest::Reserve(reserve) => self.gateway_reserve(call, reserve, now),
            GatewayRequest::Get { reservation } => {
                let response = match self.reservations.get(&reservation) {
                    Some(record) => reservation_response(record, false),
                    None => GatewayResponse::NotFound,
                };
                self.reply(call, response);
            }
            GatewayRequest::Start {
                reservation,
                operation_id,
            } => self.gateway_start(call, &reservation, operation_id, now),
            GatewayRequest::Settle {
                reservation,
                operation_id,
                actual_units,
            } => self.gateway_settle(call, &reservation, operation_id, actual_units, now),
            GatewayRequest::Release { reservation } => {
                self.gateway_release(call, &reservation, now)
            }
            GatewayRequest::Cancel { reservation } => {
                let Some(mut record) = self.reservations.get(&reservation).cloned() else {
                    return self.reply(call, GatewayResponse::NotFound);
                };
                if !record.cancel_requested {
                    record.cancel_requested = true;
                    self.put_reservation(record.clone());
                }
                self.reply(call, reservation_response(&record, false));
            }
        }
    }

    fn gateway_reserve(&mut self, call: CallId, reserve: GatewayReserve, now: Now) {
        if reserve.units == 0 || reserve.units > shard_format::limits::UNITS_MAX {
            return self.reply(
                call,
                GatewayResponse::Invalid {
                    code: ErrorCode::InvalidUnits,
                    field: "units",
                    message: format!(
                        "field `units`: must be between 1 and {}",
                        shard_format::limits::UNITS_MAX
                    ),
                },
            );
        }
        if reserve
            .min_units
            .is_some_and(|min| min == 0 || min > reserve.units)
        {
            return self.reply(
                call,
                GatewayResponse::Invalid {
                    code: ErrorCode::InvalidUnits,
                    field: "minUnits",
                    message: format!(
                        "field `minUnits`: must be between 1 and `units` ({})",
                        reserve.units
                    ),
                },
            );
        }
        if reserve
            .deadline_ms
            .is_some_and(|deadline| deadline == 0 || deadline > self.config.deadline_ms_max)
        {
            return self.reply(
                call,
                GatewayResponse::Invalid {
                    code: ErrorCode::InvalidBody,
                    field: "deadlineMs",
                    message: format!(
                        "field `deadlineMs`: must be between 1 and {}",
                        self.config.deadline_ms_max
                    ),
                },
            );
        }
        let digest = request_digest(
            &reserve.subject,
            &reserve.route,
            reserve.units,
            reserve.request.as_ref(),
        );
        let mode = self.route_mode(&reserve.route);
        if mode == RouteMode::Off {
            return self.reply(call, GatewayResponse::PassThrough);
        }
        let pair = PairKey::new(reserve.subject.clone(), reserve.route.clone());
        self.pairs.entry(pair.clone()).or_default();
        // The key names a reservation of this pair only: its ID derives
        // from the agent's identity, the pair and the key (§3.3).
        let id = ReservationId::derive(
            &self.config.identity,
            &reserve.subject,
            &reserve.route,
            &reserve.idempotency_key,
        );
        if let Some(record) = self.reservations.get(&id).cloned() {
            if record.request_digest != digest || record.min_units != reserve.min_units {
                return self.reply(
                    call,
                    GatewayResponse::Conflict {
                        code: ErrorCode::IdempotencyConflict,
                        message: format!(
                            "idempotency key {} was used for another request (reservation {id})",
                            reserve.idempotency_key
                        ),
                    },
                );
            }
            return self.retry_reserve(call, record, now);
        }
        let in_flight = self.in_flight_count;
        if in_flight >= self.config.open_reservations_max {
            return self.reply(
                call,
                GatewayResponse::Unavailable {
                    code: ErrorCode::TooManyOpenReservations,
                    message: format!(
                        "the agent holds {in_flight} open reservations, its maximum; settle or release some first"
                    ),
                    retry_after_seconds: 1,
                },
            );
        }
        let record = AgentReservation {
            reservation: id,
            idempotency_key: reserve.idempotency_key,
            subject: reserve.subject,
            route: reserve.route,
            units: reserve.units,
            min_units: reserve.min_units,
            reserved_units: None,
            request_digest: digest,
            priority: reserve.priority.unwrap_or(0),
            deadline_ms: reserve.deadline_ms,
            path: ReservationPath::Central,
            state: AgentState::Requested,
            operation_id: None,
            actual_units: None,
            receipt: None,
            settlement: None,
            rejection: None,
            sync: None,
            cancel_requested: false,
            shadow: mode == RouteMode::Shadow,
            boot_epoch: self.boot_epoch().unwrap_or(0),
            ended_at: None,
        };
        self.decide_reserve(call, record, now);
    }

    /// A repeat of a known idempotency key with the same request.
    fn retry_reserve(&mut self, call: CallId, record: AgentReservation, now: Now) {
        match record.state {
            AgentState::Requested => self.wait(call, &record.reservation, Waiter::Reserve),
            AgentState::ReservationUnknown | AgentState::Rejected => {
                let partitioned = self.is_partitioned(&record.pair());
                if record.state == AgentState::ReservationUnknown && partitioned {
                    return self.reply(call, unknown_response(&record));
                }
                // Ask again under the same reservation ID.
                let mut record = record;
                record.rejection = None;
                record.ended_at = None;
                self.decide_reserve(call, record, now);
            }
            _ => self.reply(call, reservation_response(&record, false)),
        }
    }

    /// Healthy: journal, then forward. Partitioned: admit from a shard.
    fn decide_reserve(&mut self, call: CallId, mut record: AgentReservation, now: Now) {
        let pair = record.pair();
        let resolving_unknown = record.state == AgentState::ReservationUnknown;
        if !self.is_partitioned(&pair) || resolving_unknown {
            record.state = if resolving_unknown {
                AgentState::ReservationUnknown
            } else {
                AgentState::Requested
            };
            record.path = ReservationPath::Central;
            record.sync = Some(SyncOp::Reserve);
            let id = record.reservation.clone();
            self.put_reservation(record);
            self.wait(call, &id, Waiter::Reserve);
            self.send_sync(&id, now);
            return;
        }
        if record.shadow {
            record.state = AgentState::Reserved;
            record.reserved_units = Some(record.units);
            record.sync = None;
            self.put_reservation(record.clone());
            return self.reply(call, reservation_response(&record, true));
        }
        let floor = if self.canary_admit_below_floor_from_shards() {
            1
        } else {
            record.floor_units()
        };
        let Some(shard_id) = self.usable_shard(&pair, floor, record.units, now) else {
            // Nothing to admit from: the caller may retry once we are back.
            let partitioned_shard_paused = self.shards.values().any(|slot| {
                slot.accepted.shard.subject == record.subject
                    && slot.accepted.shard.route == record.route
                    && slot.ledger.is_paused()
                    && !slot.ledger.is_closed()
            });
            record.state = AgentState::Rejected;
            self.put_reservation(record.clone());
            let (code, message) = if partitioned_shard_paused {
                (
                    ErrorCode::EmergencyDebt,
                    "the central ledger is unreachable and local overage left debt: admission is paused until reconciliation",
                )
            } else {
                (
                    ErrorCode::CentralUnreachable,
                    "the central ledger is unreachable and no emergency shard can admit this request",
                )
            };
            return self.reply(
                call,
                GatewayResponse::Unavailable {
                    code,
                    message: message.to_owned(),
                    retry_after_seconds: self.config.retry_interval_ms.div_ceil(1000).max(1),
                },
            );
        };
        let transition = self
            .shards
            .get_mut(&shard_id)
            .expect("usable shard")
            .ledger
            .reserve_between(
                record.reservation.clone(),
                floor,
                record.units,
                self.config.local_hold_ms,
                now.mono_ms,
            );
        self.journal_shard(&shard_id, transition.changes);
        match transition.outcome {
            ShardReserveOutcome::Reserved(local) | ShardReserveOutcome::Duplicate(local) => {
                record.state = AgentState::Reserved;
                record.reserved_units = Some(local.units);
                record.path = ReservationPath::Shard(shard_id);
                record.sync = None;
                self.put_reservation(record.clone());
                self.reply(call, reservation_response(&record, true));
            }
            other => {
                debug_assert!(false, "a usable shard refused: {other:?}");
                record.state = AgentState::Rejected;
                self.put_reservation(record.clone());
                self.reply(call, unknown_response(&record));
            }
        }
    }

    fn gateway_start(
        &mut self,
        call: CallId,
        id: &ReservationId,
        operation_id: OperationId,
        now: Now,
    ) {
        let Some(record) = self.reservations.get(id).cloned() else {
            return self.reply(call, GatewayResponse::NotFound);
        };
        if let Some(bound) = &record.operation_id {
            if *bound != operation_id {
                return self.reply(
                    call,
                    GatewayResponse::Conflict {
                        code: ErrorCode::OperationConflict,
                        message: format!("reservation {id} is bound to operation {bound}"),
                    },
                );
            }
            if record.state == AgentState::Starting {
                return self.wait(call, id, Waiter::Start);
            }
            return self.reply(call, reservation_response(&record, false));
        }
        if record.state == AgentState::Expired {
            return self.reply(call, expired_response(&record));
        }
        if record.state != AgentState::Reserved {
            return self.reply(call, illegal_state(&record, "start"));
        }
        if record.path == ReservationPath::Central && self.is_partitioned(&record.pair()) {
            // The start must win against expiry at the center: no guessing.
            return self.reply(
                call,
                GatewayResponse::Unavailable {
                    code: ErrorCode::CentralUnreachable,
                    message: "the start must reach the central ledger, which is unreachable".into(),
                    retry_after_seconds: self.config.retry_interval_ms.div_ceil(1000).max(1),
                },
            );
        }
        let mut record = record;
        record.operation_id = Some(operation_id);
        match self
            .scheduler
            .request(&record.route, &record.subject, record.priority, id)
        {
            Admission::Granted => {
                self.wait(call, id, Waiter::Start);
                self.begin_start(record, now);
            }
            Admission::Queued => {
                // The binding is journaled now; the start goes out when granted.
                self.put_reservation(record);
                self.wait(call, id, Waiter::Start);
            }
        }
    }

    /// The scheduler granted a start: carry it out on the reservation's path.
    fn begin_start(&mut self, mut record: AgentReservation, now: Now) {
        let id = record.reservation.clone();
        let operation_id = record.operation_id.clone().expect("bound before start");
        let deadline = record
            .deadline_ms
            .unwrap_or(self.config.default_deadline_ms);
        match record.path.clone() {
            ReservationPath::Central if record.shadow && record.receipt.is_none() => {
                record.state = AgentState::Started;
                self.put_reservation(record.clone());
                self.usage_deadlines
                    .insert(id.clone(), now.mono_ms.saturating_add(deadline));
                self.answer_waiters(&id, Waiter::Start, reservation_response(&record, false));
            }
            ReservationPath::Central => {
                record.state = AgentState::Starting;
                record.sync = Some(SyncOp::Start {
                    deadline_ms: record.deadline_ms,
                });
                self.put_reservation(record);
                self.send_sync(&id, now);
            }
            ReservationPath::Shard(shard_id) => {
                let Some(slot) = self.shards.get_mut(&shard_id) else {
                    return self.answer_waiters(&id, Waiter::Start, GatewayResponse::NotFound);
                };
                let transition = slot.ledger.start(&id, operation_id, now.mono_ms);
                self.journal_shard(&shard_id, transition.changes);
                let response = match transition.outcome {
                    ShardStartOutcome::Started(_) | ShardStartOutcome::Duplicate(_) => {
                        record.state = AgentState::Started;
                        self.usage_deadlines
                            .insert(id.clone(), now.mono_ms.saturating_add(deadline));
                        reservation_response(&record, false)
                    }
                    ShardStartOutcome::Expired(_) => {
                        record.state = AgentState::Expired;
                        self.finish_slot(&record, now);
                        expired_response(&record)
                    }
                    ShardStartOutcome::Closed => {
                        record.state = AgentState::Expired;
                        self.finish_slot(&record, now);
                        expired_response(&record)
                    }
                    other => {
                        debug_assert!(false, "shard start refused unexpectedly: {other:?}");
                        illegal_state(&record, "start")
                    }
                };
                self.put_reservation(record);
                self.answer_waiters(&id, Waiter::Start, response);
            }
        }
    }

    fn gateway_settle(
        &mut self,
        call: CallId,
        id: &ReservationId,
        operation_id: OperationId,
        actual_units: u64,
        now: Now,
    ) {
        let Some(mut record) = self.reservations.get(id).cloned() else {
            return self.reply(call, GatewayResponse::NotFound);
        };
        if actual_units > shard_format::limits::UNITS_MAX {
            return self.reply(
                call,
                GatewayResponse::Invalid {
                    code: ErrorCode::InvalidBody,
                    field: "actualUnits",
                    message: format!(
                        "field `actualUnits`: must be at most {}",
                        shard_format::limits::UNITS_MAX
                    ),
                },
            );
        }
        if record.operation_id.as_ref() != Some(&operation_id) {
            return self.reply(
                call,
                match &record.operation_id {
                    Some(bound) => GatewayResponse::Conflict {
                        code: ErrorCode::OperationConflict,
                        message: format!("reservation {id} is bound to operation {bound}"),
                    },
                    // As the center answers: a settle before the start
                    // bound an operation.
                    None if record.state == AgentState::Reserved => GatewayResponse::Conflict {
                        code: ErrorCode::NotStarted,
                        message: format!(
                            "reservation {id} was not started; start it first (the start binds the operation)"
                        ),
                    },
                    None => illegal_state(&record, "settle"),
                },
            );
        }
        if let Some(settled) = record.actual_units {
            if settled != actual_units {
                return self.reply(
                    call,
                    GatewayResponse::Conflict {
                        code: ErrorCode::SettlementConflict,
                        message: format!(
                            "reservation {id} was settled with {settled} actual units"
                        ),
                    },
                );
            }
            if record.state == AgentState::Settling {
                // Still on its way to the central ledger: wait for it, or
                // (partitioned) answer what the first settle answered.
                if self.is_partitioned(&record.pair()) {
                    return self.reply(call, GatewayResponse::Accepted(Box::new(record)));
                }
                return self.wait(call, id, Waiter::Settle);
            }
            return self.reply(call, reservation_response(&record, false));
        }
        let settled_at_center = record.path == ReservationPath::Central
            && matches!(
                record.state,
                AgentState::Settled | AgentState::SettledWithDebt
            );
        if !matches!(record.state, AgentState::Started | AgentState::UsageUnknown)
            && !settled_at_center
        {
            return self.reply(call, illegal_state(&record, "settle"));
        }
        record.actual_units = Some(actual_units);
        self.usage_deadlines.remove(id);
        match record.path.clone() {
            ReservationPath::Central if record.shadow && record.receipt.is_none() => {
                record.state = AgentState::Settled;
                self.finish_slot(&record, now);
                self.put_reservation(record.clone());
                self.reply(call, reservation_response(&record, false));
            }
            ReservationPath::Central => {
                record.state = AgentState::Settling;
                record.sync = Some(SyncOp::Settle);
                self.finish_slot(&record, now);
                self.put_reservation(record.clone());
                if self.is_partitioned(&record.pair()) {
                    // Durable here; delivered exactly once on reconnect.
                    self.reply(call, GatewayResponse::Accepted(Box::new(record)));
                } else {
                    self.wait(call, id, Waiter::Settle);
                    self.send_sync(id, now);
                }
            }
            ReservationPath::Shard(shard_id) => {
                let Some(slot) = self.shards.get_mut(&shard_id) else {
                    return self.reply(call, GatewayResponse::NotFound);
                };
                let transition = slot.ledger.settle(id, &operation_id, actual_units);
                self.journal_shard(&shard_id, transition.changes);
                record.state = match transition.outcome {
                    ShardSettleOutcome::Settled(local) | ShardSettleOutcome::Duplicate(local) => {
                        if local.overdraft_units > 0 {
                            AgentState::SettledWithDebt
                        } else {
                            AgentState::Settled
                        }
                    }
                    // The shard's book is final (closed): the usage is
                    // recorded here, its units stay retired as unknown.
                    ShardSettleOutcome::Closed => AgentState::Settled,
                    other => {
                        debug_assert!(false, "shard settle refused unexpectedly: {other:?}");
                        return self.reply(call, illegal_state(&record, "settle"));
                    }
                };
                self.finish_slot(&record, now);
                self.put_reservation(record.clone());
                self.reply(call, reservation_response(&record, false));
            }
        }
    }

    fn gateway_release(&mut self, call: CallId, id: &ReservationId, now: Now) {
        let Some(mut record) = self.reservations.get(id).cloned() else {
            return self.reply(call, GatewayResponse::NotFound);
        };
        match record.state {
            AgentState::Released => return self.reply(call, reservation_response(&record, false)),
            AgentState::Releasing if record.sync.is_none() => {
                return self.reply(call, illegal_state(&record, "release"));
            }
            AgentState::Releasing if !self.is_partitioned(&record.pair()) => {
                return self.wait(call, id, Waiter::Release);
            }
            AgentState::Releasing => {
                return self.reply(call, GatewayResponse::Accepted(Box::new(record)));
            }
            AgentState::Reserved if record.operation_id.is_none() => {}
            _ => return self.reply(call, illegal_state(&record, "release")),
        }
        match record.path.clone() {
            ReservationPath::Central if record.shadow && record.receipt.is_none() => {
                record.state = AgentState::Released;
                self.put_reservation(record.clone());
                self.reply(call, reservation_response(&record, false));
            }
            ReservationPath::Central => {
                record.state = AgentState::Releasing;
                record.sync = Some(SyncOp::Release);
                self.put_reservation(record.clone());
                if self.is_partitioned(&record.pair()) {
                    self.reply(call, GatewayResponse::Accepted(Box::new(record)));
                } else {
                    self.wait(call, id, Waiter::Release);
                    self.send_sync(id, now);
                }
            }
            ReservationPath::Shard(shard_id) => {
                let Some(slot) = self.shards.get_mut(&shard_id) else {
                    return self.reply(call, GatewayResponse::NotFound);
                };
                let transition = slot.ledger.release(id);
                self.journal_shard(&shard_id, transition.changes);
                record.state = match transition.outcome {
                    ShardReleaseOutcome::Released(_) | ShardReleaseOutcome::Duplicate(_) => {
                        AgentState::Released
                    }
                    ShardReleaseOutcome::Closed => AgentState::Expired,
                    other => {
                        debug_assert!(false, "shard release refused unexpectedly: {other:?}");
                        return self.reply(call, illegal_state(&record, "release"));
                    }
                };
                self.put_reservation(record.clone());
                self.reply(call, reservation_response(&record, false));
            }
        }
    }

    /// Executions past their deadline without a receipt: usage unknown.
    pub(crate) fn expire_usage_deadlines(&mut self, now: Now) {
        let overdue: Vec<ReservationId> = self
            .usage_deadlines
            .iter()
            .filter(|(_, deadline)| **deadline <= now.mono_ms)
            .map(|(id, _)| id.clone())
            .collect();
        for id in overdue {
            self.usage_deadlines.remove(&id);
            let Some(mut record) = self.reservations.get(&id).cloned() else {
                continue;
            };
            if record.state != AgentState::Started {
                continue;
            }
            record.state = AgentState::UsageUnknown;
            if let ReservationPath::Shard(shard_id) = &record.path
                && let Some(slot) = self.shards.get_mut(shard_id)
            {
                let transition = slot.ledger.mark_usage_unknown(&id);
                let shard_id = shard_id.clone();
                self.journal_shard(&shard_id, transition.changes);
            }
            self.finish_slot(&record, now);
            self.put_reservation(record);
        }
    }

    fn wait(&mut self, call: CallId, id: &ReservationId, waiter: Waiter) {
        self.waiters
            .entry(id.clone())
            .or_default()
            .push((call, waiter));
    }

    pub(crate) fn answer_waiters(
        &mut self,
        id: &ReservationId,
        kind: Waiter,
        response: GatewayResponse,
    ) {
        let Some(waiters) = self.waiters.get_mut(id) else {
            return;
        };
        let (answered, kept): (Vec<_>, Vec<_>) = waiters.drain(..).partition(|(_, w)| *w == kind);
        *waiters = kept;
        if waiters.is_empty() {
            self.waiters.remove(id);
        }
        for (call, _) in answered {
            self.reply(call, response.clone());
        }
    }

    /// Frees the reservation's start slot and starts whatever it unblocks.
    pub(crate) fn finish_slot(&mut self, record: &AgentReservation, now: Now) {
        let granted = self.scheduler.finish(&record.route, &record.reservation);
        for id in granted {
            if let Some(next) = self.reservations.get(&id).cloned()
                && next.state == AgentState::Reserved
            {
                self.begin_start(next, now);
            }
        }
    }

    pub(crate) fn put_reservation(&mut self, mut record: AgentReservation) {
        // The retention window runs from the moment the record comes to
        // rest; anything that wakes it again (a retried rejection) stops it.
        if record.is_at_rest() {
            record.ended_at = record
                .ended_at
                .or_else(|| self.reservations.get(&record.reservation)?.ended_at)
                .or(Some(self.clock.wall.unix_ms()));
        } else {
            record.ended_at = None;
        }
        self.append(JournalRecord::Reservation(Box::new(record.clone())));
        if let Some(old) = self.reservations.get(&record.reservation)
            && let Some(ended_at) = old.ended_at
        {
            self.retained.remove(&(ended_at, old.reservation.clone()));
        }
        if let Some(ended_at) = record.ended_at
            && self.joins_retention_queue(&record)
        {
            self.retained.insert((ended_at, record.reservation.clone()));
        }
        let was_in_flight = self
            .reservations
            .get(&record.reservation)
            .is_some_and(|old| old.state.is_in_flight());
        match (was_in_flight, record.state.is_in_flight()) {
            (false, true) => self.in_flight_count += 1,
            (true, false) => self.in_flight_count -= 1,
            _ => {}
        }
        if needs_retry(&record) {
            self.retry_work.insert(record.reservation.clone());
        } else {
            self.retry_work.remove(&record.reservation);
        }
        self.reservations.insert(record.reservation.clone(), record);
    }
}

/// A record the retry timer has work for.
pub(crate) fn needs_retry(record: &AgentReservation) -> bool {
    record.sync.is_some()
        || record.state == AgentState::ReservationUnknown
        || (record.state == AgentState::UsageUnknown && record.path == ReservationPath::Central)
}
