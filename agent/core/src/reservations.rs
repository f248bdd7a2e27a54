//! Gateway requests: reserve, get, start, settle, release and cancel, the
//! reservation records' bookkeeping and the start slots they hold.

use std::num::NonZeroU64;

use ledger::protocol::ErrorCode;
use ledger::{
    LegProblem, PairKey, SettleActuals, ShardReleaseOutcome, ShardReserveOutcome,
    ShardSettleOutcome, ShardStartOutcome,
};
use shard_format::{
    OperationId, ReservationId, ReservationState, RouteMode, ShardId, request_digest,
};
use thin_vec::ThinVec;

use crate::responses::{
    expired_response, illegal_state, invalid_leg, reservation_response, unknown_response,
};
use crate::scheduler::Admission;
use crate::shard_slots::each_once;
use crate::{
    AgentCore, AgentLeg, AgentReservation, AgentState, CallId, GatewayRequest, GatewayReserve,
    GatewayResponse, Now, ReservationPath, SyncOp, Waiter, one_word,
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
            } => self.gateway_settle(
                call,
                &reservation,
                operation_id,
                SettleActuals::One(actual_units),
                now,
            ),
            GatewayRequest::SettleLegs {
                reservation,
                operation_id,
                legs,
            } => self.gateway_settle(
                call,
                &reservation,
                operation_id,
                SettleActuals::Legs(legs),
                now,
            ),
            GatewayRequest::Release { reservation } => {
                self.gateway_release(call, &reservation, now)
            }
            GatewayRequest::Cancel { reservation } => {
                let Some(mut record) = self.reservation(&reservation).cloned() else {
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
        // Several legs: every leg's units and floor, the first's included,
        // are judged by `check_legs` below and named as a leg's field
        // (`legs[0].minUnits`), as the legs form of the socket gives them.
        let one_leg = reserve.more_legs.is_empty();
        if one_leg && (reserve.units == 0 || reserve.units > shard_format::limits::UNITS_MAX) {
            return self.reply(
                call,
                GatewayResponse::Invalid {
                    code: ErrorCode::InvalidUnits,
                    field: "units".to_owned(),
                    message: format!(
                        "field `units`: must be between 1 and {}",
                        shard_format::limits::UNITS_MAX
                    ),
                },
            );
        }
        if one_leg
            && reserve
                .min_units
                .is_some_and(|min| min == 0 || min > reserve.units)
        {
            return self.reply(
                call,
                GatewayResponse::Invalid {
                    code: ErrorCode::InvalidUnits,
                    field: "minUnits".to_owned(),
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
                    field: "deadlineMs".to_owned(),
                    message: format!(
                        "field `deadlineMs`: must be between 1 and {}",
                        self.config.deadline_ms_max
                    ),
                },
            );
        }
        let legs = reserve.legs();
        let multi = legs.len() > 1;
        if multi && let Err((index, problem)) = ledger::check_legs(&legs) {
            return self.reply(call, invalid_leg(index, problem));
        }
        let digest = request_digest(
            &reserve.subject,
            &reserve.route,
            reserve.units,
            reserve.request.as_ref(),
        );
        let modes: Vec<RouteMode> = legs.iter().map(|leg| self.route_mode(&leg.route)).collect();
        if modes.iter().all(|mode| *mode == RouteMode::Off) {
            return self.reply(call, GatewayResponse::PassThrough);
        }
        for leg in &legs {
            self.pairs.add(leg.pair());
        }
        // The key names a reservation of this pair only: its ID derives
        // from the agent's identity, the pair and the key (§3.3).
        let id = ReservationId::derive(
            &self.config.identity,
            &reserve.subject,
            &reserve.route,
            &reserve.idempotency_key,
        );
        if let Some(record) = self.reservation(&id).cloned() {
            let same_legs = if multi {
                record.legs.len() == legs.len()
                    && record.legs.iter().zip(&legs).all(|(recorded, asked)| {
                        recorded.subject == asked.subject
                            && recorded.route == asked.route
                            && recorded.units == asked.units
                            && recorded.min_units.map(u64::from) == asked.min_units
                    })
            } else {
                record.legs.is_empty()
            };
            if record.request_digest != digest
                || record.min_units.map(u64::from) != reserve.min_units
                || !same_legs
            {
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
        let in_flight = self.tally.in_flight;
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
        // The record shares the pair map's copy of the pair's names (added
        // above): an agent holds every open reservation in memory, and a
        // copy of both names per record was about 64 bytes of each.
        let (subject, route) = match self.pairs.get_key_value(&PairKey::new(
            reserve.subject.clone(),
            reserve.route.clone(),
        )) {
            Some((pair, _)) => (pair.subject.clone(), pair.route.clone()),
            None => (reserve.subject, reserve.route),
        };
        let record = AgentReservation {
            reservation: id,
            idempotency_key: reserve.idempotency_key,
            subject,
            route,
            units: reserve.units,
            min_units: reserve.min_units.map(one_word),
            reserved_units: None,
            request_digest: digest,
            priority: reserve.priority.unwrap_or(0),
            // Validated above: zero is refused.
            deadline_ms: reserve.deadline_ms.and_then(NonZeroU64::new),
            path: ReservationPath::Central,
            state: AgentState::Requested,
            operation_id: None,
            actual_units: None,
            receipt: None,
            settlement: None,
            rejection: None,
            sync: None,
            cancel_requested: false,
            // Nothing is enforced: admitted whatever the shards hold.
            shadow: !modes.contains(&RouteMode::Enforce),
            boot_epoch: self.boot_epoch().unwrap_or(0),
            ended_at: None,
            legs: if multi {
                legs.into_iter().map(AgentLeg::from).collect()
            } else {
                ThinVec::new()
            },
            hold_state: None,
            hold_expires_at_ms: 0,
            hold_overdraft_units: 0,
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
            record.reserved_units = Some(one_word(record.units));
            for leg in &mut record.legs {
                leg.reserved_units = Some(one_word(leg.units));
            }
            record.sync = None;
            return self.put_and_reply(call, record, true);
        }
        if !record.legs.is_empty() {
            return self.reserve_legs_from_shards(call, record, now);
        }
        let floor = if self.canary_admit_below_floor_from_shards() {
            1
        } else {
            record.floor_units()
        };
        let Some(shard_id) = self.usable_shard(&pair, floor, record.units, now) else {
            // Nothing to admit from: the caller may retry once we are back.
            return self.refuse_without_shard(call, record, &pair);
        };
        let transition = self
            .shards
            .change_book(&shard_id, |book| {
                book.reserve_between(
                    record.hold(&shard_id),
                    record.reservation.clone(),
                    floor,
                    record.units,
                    self.config.local_hold_ms,
                    now.mono_ms,
                )
            })
            .expect("usable shard");
        record.keep_holds(&shard_id, &transition.changes);
        self.journal_shard(&shard_id, transition.changes);
        match transition.outcome {
            ShardReserveOutcome::Reserved(local) | ShardReserveOutcome::Duplicate(local) => {
                record.state = AgentState::Reserved;
                record.reserved_units = Some(one_word(local.units));
                record.path = ReservationPath::Shard(shard_id);
                record.sync = None;
                self.put_and_reply(call, record, true);
            }
            other => {
                debug_assert!(false, "a usable shard refused: {other:?}");
                record.state = AgentState::Rejected;
                self.put_reservation(record.clone());
                self.reply(call, unknown_response(&record));
            }
        }
    }

    /// Partitioned, nothing can admit `record` (no shard of `pair` covers
    /// it): 503, and the record rests as a refusal a retry asks again.
    fn refuse_without_shard(&mut self, call: CallId, mut record: AgentReservation, pair: &PairKey) {
        let partitioned_shard_paused = self
            .shards
            .of_pair(pair)
            .any(|slot| slot.book.is_paused() && !slot.book.is_closed());
        record.state = AgentState::Rejected;
        self.put_reservation(record);
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
        self.reply(
            call,
            GatewayResponse::Unavailable {
                code,
                message: message.to_owned(),
                retry_after_seconds: self.config.retry_interval_ms.div_ceil(1000).max(1),
            },
        );
    }

    /// Partitioned, a multi-leg reservation: every enforced leg from its own
    /// pair's shard, all legs or none (a leg on a route that is not
    /// enforced holds nothing). Each shard books it under the reservation's
    /// ID.
    fn reserve_legs_from_shards(&mut self, call: CallId, mut record: AgentReservation, now: Now) {
        let below_floor = self.canary_admit_below_floor_from_shards();
        let floor = |leg: &AgentLeg| if below_floor { 1 } else { leg.floor_units() };
        let mut picks = Vec::with_capacity(record.legs.len());
        for leg in &record.legs {
            if self.route_mode(&leg.route) != RouteMode::Enforce {
                picks.push(None);
                continue;
            }
            match self.usable_shard(&leg.pair(), floor(leg), leg.units, now) {
                Some(shard) => picks.push(Some(shard)),
                None if self.canary_admit_legs_without_shards() => picks.push(None),
                None => {
                    let pair = leg.pair();
                    return self.refuse_without_shard(call, record, &pair);
                }
            }
        }
        if !picks.iter().any(Option::is_some) {
            // Only the canary above leaves every leg without a shard.
            let pair = record.pair();
            return self.refuse_without_shard(call, record, &pair);
        }
        // Legs name distinct pairs, so distinct shards: each reserve below
        // finds its shard as usable as it was judged above.
        let id = record.reservation.clone();
        let mut legs = std::mem::take(&mut record.legs);
        for (leg, pick) in legs.iter_mut().zip(picks) {
            let Some(shard_id) = pick else {
                leg.reserved_units = Some(one_word(leg.units));
                continue;
            };
            let transition = self
                .shards
                .change_book(&shard_id, |book| {
                    book.reserve_between(
                        // Only this reserve sets the leg's shard: it holds
                        // nothing there yet.
                        None,
                        id.clone(),
                        floor(leg),
                        leg.units,
                        self.config.local_hold_ms,
                        now.mono_ms,
                    )
                })
                .expect("usable shard");
            self.journal_shard(&shard_id, transition.changes);
            match transition.outcome {
                ShardReserveOutcome::Reserved(local) | ShardReserveOutcome::Duplicate(local) => {
                    leg.keep_hold(&local);
                    leg.shard = Some(shard_id);
                }
                other => debug_assert!(false, "a usable shard refused: {other:?}"),
            }
        }
        record.legs = legs;
        record.reserved_units = record.legs[0].reserved_units;
        let first_shard = record.legs.iter().find_map(|leg| leg.shard.clone());
        record.path = first_shard.map_or(ReservationPath::Central, ReservationPath::Shard);
        record.state = AgentState::Reserved;
        record.sync = None;
        self.put_and_reply(call, record, true);
    }

    fn gateway_start(
        &mut self,
        call: CallId,
        id: &ReservationId,
        operation_id: OperationId,
        now: Now,
    ) {
        let Some(record) = self.reservation(id).cloned() else {
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
            .map_or(self.config.default_deadline_ms, NonZeroU64::get);
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
                record.sync = Some(SyncOp::Start);
                self.put_reservation(record);
                self.send_sync(&id, now);
            }
            ReservationPath::Shard(_) if !record.legs.is_empty() => {
                let response = self.start_legs_on_shards(&mut record, operation_id, deadline, now);
                self.put_reservation(record);
                self.answer_waiters(&id, Waiter::Start, response);
            }
            ReservationPath::Shard(shard_id) => {
                let Some(transition) = self.shards.change_book(&shard_id, |book| {
                    book.start(record.hold(&shard_id), operation_id, now.mono_ms)
                }) else {
                    return self.answer_waiters(&id, Waiter::Start, GatewayResponse::NotFound);
                };
                record.keep_holds(&shard_id, &transition.changes);
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

    /// Starts every leg of a shard-path reservation in its shard, or none:
    /// if any leg's hold ended (expired, or its shard closed), every leg
    /// still held is released and the reservation is expired.
    fn start_legs_on_shards(
        &mut self,
        record: &mut AgentReservation,
        operation_id: OperationId,
        deadline: u64,
        now: Now,
    ) -> GatewayResponse {
        let id = record.reservation.clone();
        let shards = record.shards();
        let startable = shards.iter().all(|shard| {
            self.shards.get(shard).is_some_and(|slot| {
                !slot.book.is_closed()
                    && record.hold(shard).is_some_and(|local| {
                        local.state == ReservationState::Reserved
                            && now.mono_ms < local.expires_at_ms
                    })
            })
        });
        for shard in &shards {
            let Some(transition) = self.shards.change_book(shard, |book| {
                if startable {
                    book.start(record.hold(shard), operation_id.clone(), now.mono_ms)
                        .changes
                } else {
                    book.release(record.hold(shard)).changes
                }
            }) else {
                continue;
            };
            record.keep_holds(shard, &transition);
            self.journal_shard(shard, transition);
        }
        if startable {
            record.state = AgentState::Started;
            self.usage_deadlines
                .insert(id, now.mono_ms.saturating_add(deadline));
            reservation_response(record, false)
        } else {
            record.state = AgentState::Expired;
            self.finish_slot(record, now);
            expired_response(record)
        }
    }

    fn gateway_settle(
        &mut self,
        call: CallId,
        id: &ReservationId,
        operation_id: OperationId,
        actuals: SettleActuals,
        now: Now,
    ) {
        let Some(mut record) = self.reservation(id).cloned() else {
            return self.reply(call, GatewayResponse::NotFound);
        };
        let per_leg = match actuals_per_leg(&record, &actuals) {
            Ok(per_leg) => per_leg,
            Err((index, problem)) => return self.reply(call, invalid_leg(index, problem)),
        };
        let actual_units = per_leg[0];
        if actual_units > shard_format::limits::UNITS_MAX {
            return self.reply(
                call,
                GatewayResponse::Invalid {
                    code: ErrorCode::InvalidBody,
                    field: "actualUnits".to_owned(),
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
        if let Some(settled) = record.actual_units.map(u64::from) {
            let same_legs = record
                .legs
                .iter()
                .zip(&per_leg)
                .all(|(leg, actual)| leg.actual_units.map(u64::from) == Some(*actual));
            if settled != actual_units || !same_legs {
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
        record.actual_units = Some(one_word(actual_units));
        for (leg, actual) in record.legs.iter_mut().zip(&per_leg) {
            leg.actual_units = Some(one_word(*actual));
        }
        self.usage_deadlines.remove(id);
        match record.path.clone() {
            ReservationPath::Central if record.shadow && record.receipt.is_none() => {
                record.state = AgentState::Settled;
                self.finish_slot(&record, now);
                self.put_and_reply(call, record, false);
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
            ReservationPath::Shard(_) if !record.legs.is_empty() => {
                // Each leg against its own shard; a closed shard's book is
                // final, its leg's usage recorded here.
                let mut debt = false;
                let held: Vec<(ShardId, u64)> = record
                    .legs
                    .iter()
                    .filter_map(|leg| Some((leg.shard.clone()?, leg.actual_units?.get())))
                    .collect();
                for (shard_id, actual) in held {
                    let Some(transition) = self.shards.change_book(&shard_id, |book| {
                        book.settle(record.hold(&shard_id), &operation_id, actual)
                    }) else {
                        continue;
                    };
                    if let ShardSettleOutcome::Settled(local)
                    | ShardSettleOutcome::Duplicate(local) = &transition.outcome
                    {
                        debt |= local.overdraft_units > 0;
                    }
                    record.keep_holds(&shard_id, &transition.changes);
                    self.journal_shard(&shard_id, transition.changes);
                }
                record.state = if debt {
                    AgentState::SettledWithDebt
                } else {
                    AgentState::Settled
                };
                self.finish_slot(&record, now);
                self.put_and_reply(call, record, false);
            }
            ReservationPath::Shard(shard_id) => {
                let Some(transition) = self.shards.change_book(&shard_id, |book| {
                    book.settle(record.hold(&shard_id), &operation_id, actual_units)
                }) else {
                    return self.reply(call, GatewayResponse::NotFound);
                };
                record.keep_holds(&shard_id, &transition.changes);
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
                self.put_and_reply(call, record, false);
            }
        }
    }

    fn gateway_release(&mut self, call: CallId, id: &ReservationId, now: Now) {
        let Some(mut record) = self.reservation(id).cloned() else {
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
                self.put_and_reply(call, record, false);
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
            ReservationPath::Shard(_) if !record.legs.is_empty() => {
                let mut closed = false;
                for shard_id in record.shards() {
                    let Some(transition) = self
                        .shards
                        .change_book(&shard_id, |book| book.release(record.hold(&shard_id)))
                    else {
                        continue;
                    };
                    closed |= transition.outcome == ShardReleaseOutcome::Closed;
                    record.keep_holds(&shard_id, &transition.changes);
                    self.journal_shard(&shard_id, transition.changes);
                }
                record.state = if closed {
                    AgentState::Expired
                } else {
                    AgentState::Released
                };
                self.put_and_reply(call, record, false);
            }
            ReservationPath::Shard(shard_id) => {
                let Some(transition) = self
                    .shards
                    .change_book(&shard_id, |book| book.release(record.hold(&shard_id)))
                else {
                    return self.reply(call, GatewayResponse::NotFound);
                };
                record.keep_holds(&shard_id, &transition.changes);
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
                self.put_and_reply(call, record, false);
            }
        }
    }

    /// Executions past their deadline without a receipt: usage unknown.
    pub(crate) fn expire_usage_deadlines(&mut self, now: Now) {
        for id in self.usage_deadlines.take_due(now.mono_ms) {
            let Some(mut record) = self.reservation(&id).cloned() else {
                continue;
            };
            if record.state != AgentState::Started {
                continue;
            }
            record.state = AgentState::UsageUnknown;
            for shard_id in record.shards() {
                if let Some(transition) = self.shards.change_book(&shard_id, |book| {
                    book.mark_usage_unknown(record.hold(&shard_id))
                }) {
                    record.keep_holds(&shard_id, &transition.changes);
                    self.journal_shard(&shard_id, transition.changes);
                }
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
            if let Some(next) = self.reservation(&id).cloned()
                && next.state == AgentState::Reserved
            {
                self.begin_start(next, now);
            }
        }
    }

    /// Records `record` (a box or not: the map holds boxes) and journals it;
    /// returns it as stored, with its rest time set.
    pub(crate) fn put_reservation(
        &mut self,
        record: impl Into<Box<AgentReservation>>,
    ) -> &AgentReservation {
        let mut record = record.into();
        // One search for what the record replaces: the map holds every
        // open reservation, and each search compares IDs all the way down.
        let old = self.reservations.get(&record.reservation);
        let old_ended_at = old.and_then(|old| old.ended_at);
        // Retention forgets a shard with the records that use it: each
        // shard either side uses is told, once.
        let used = old
            .into_iter()
            .flat_map(AgentReservation::shards_used)
            .chain(record.shards_used());
        for shard in each_once(used) {
            self.shards.note_record(shard, old, &record);
        }
        self.tally.change(old, Some(&record));
        // The retention window runs from the moment the record comes to
        // rest; anything that wakes it again (a retried rejection) stops it.
        if record.is_at_rest() {
            record.ended_at = record
                .ended_at
                .or(old_ended_at)
                .or(Some(one_word(self.clock.wall.unix_ms())));
        } else {
            record.ended_at = None;
        }
        self.append_reservation(record.reservation.clone());
        if let Some(ended_at) = old_ended_at {
            self.retained
                .remove(&(ended_at.get(), record.reservation.clone()));
        }
        if let Some(ended_at) = record.ended_at
            && self.joins_retention_queue(&record)
        {
            self.retained
                .insert((ended_at.get(), record.reservation.clone()));
        }
        if needs_retry(&record) {
            self.retry_work.insert(record.reservation.clone());
        } else {
            self.retry_work.remove(&record.reservation);
        }
        self.reservations.insert(record)
    }

    /// Records `record` ([`Self::put_reservation`]) and answers `call` with
    /// it as stored: the answer a retry of the call reads back.
    fn put_and_reply(&mut self, call: CallId, record: AgentReservation, created: bool) {
        let response = reservation_response(self.put_reservation(record), created);
        self.reply(call, response);
    }

    /// Records `record` ([`Self::put_reservation`]) and answers the calls
    /// waiting on it for `kind` with it as stored.
    pub(crate) fn put_and_answer_waiters(
        &mut self,
        record: AgentReservation,
        kind: Waiter,
        created: bool,
    ) {
        let id = record.reservation.clone();
        let response = reservation_response(self.put_reservation(record), created);
        self.answer_waiters(&id, kind, response);
    }
}

/// The actual units of every leg of `record` (just the one for one leg),
/// in leg order ([`SettleActuals::per_leg`]).
fn actuals_per_leg(
    record: &AgentReservation,
    actuals: &SettleActuals,
) -> Result<Vec<u64>, (usize, LegProblem)> {
    let legs: Vec<(PairKey, u64)> = if record.legs.is_empty() {
        vec![(
            record.pair(),
            record.reserved_units.map_or(record.units, u64::from),
        )]
    } else {
        record
            .legs
            .iter()
            .map(|leg| (leg.pair(), leg.reserved_units.map_or(leg.units, u64::from)))
            .collect()
    };
    let legs: Vec<(&PairKey, u64)> = legs.iter().map(|(pair, grant)| (pair, *grant)).collect();
    actuals.per_leg(&legs)
}

/// A record the retry timer has work for.
pub(crate) fn needs_retry(record: &AgentReservation) -> bool {
    record.sync.is_some()
        || record.state == AgentState::ReservationUnknown
        || (record.state == AgentState::UsageUnknown && record.path == ReservationPath::Central)
}
