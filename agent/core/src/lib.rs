//! The agent's decision core: a fully deterministic implementation of
//! everything the sidecar decides. It contains no networking, storage or
//! timer code, does not read a clock and draws no random numbers: gateway
//! requests, central replies (or their absence), journal commits and time
//! come in as calls; journal batches, central calls and gateway answers come
//! out as values the shell carries out.
//!
//! # Method kinds and the order to call them in
//!
//! - `handle_*` feed one event in: [`AgentCore::handle_gateway`],
//!   [`AgentCore::handle_central`], [`AgentCore::handle_journal_committed`],
//!   [`AgentCore::handle_timeout`].
//! - `poll_*` take outputs: [`AgentCore::poll_journal`] (records to commit in
//!   one durable transaction), [`AgentCore::poll_central`] (calls to send,
//!   each with its deadline), [`AgentCore::poll_reply`] (answers to
//!   gateways), [`AgentCore::poll_timeout`] (when to call `handle_timeout`).
//! - Getters: [`AgentCore::status`], [`AgentCore::reservation`], …
//!
//! After every `handle_*`, a shell drains `poll_journal`, commits the batch,
//! reports it with `handle_journal_committed`, then drains `poll_central`
//! and `poll_reply`. **Journal first:** a central call or a gateway answer
//! is released only after every record made before it is committed, so a
//! crash between any effect and its commit loses nothing acknowledged and
//! sends nothing unjournaled.

mod messages;
pub mod scheduler;

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

pub use messages::{
    AcceptedShard, AgentReservation, AgentState, CallId, CentralCall, CentralReply, CentralResult,
    GatewayRequest, GatewayReserve, GatewayResponse, JournalBatch, JournalKey, JournalRecord, Now,
    RequestId, ReservationPath, SyncOp,
};

use ledger::{
    PairKey, ReserveRequest, ShardChange, ShardLedger, ShardReleaseOutcome, ShardReserveOutcome,
    ShardSettleOutcome, ShardStartOutcome, ShardTerms,
};
use shard_format::{
    BootNonce, DocumentSigner, DocumentVerifier, EmergencyShardV1, GatewayIdentity, IdempotencyKey,
    LimitReservationV1, OperationId, ReservationId, ReservationState, Route, RouteMode,
    ShardCloseReason, ShardId, ShardTerminalReceiptV1, Subject, request_digest, sign_document,
    verify_document,
};

use scheduler::{Admission, StartScheduler, SubjectShare};

/// The agent's settings that decisions depend on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    pub identity: GatewayIdentity,
    /// Per-route mode; routes not named are enforced.
    pub route_modes: BTreeMap<Route, RouteMode>,
    /// Per-route concurrency limits for starts; routes not named are unlimited.
    pub route_concurrency: BTreeMap<Route, usize>,
    /// Per-subject fairness weights for the start scheduler (default 1).
    pub subject_weights: BTreeMap<Subject, u32>,
    /// Deadline of every central call.
    pub central_call_timeout_ms: u64,
    /// Consecutive failed or timed-out central calls before a pair is
    /// treated as partitioned.
    pub partition_failures_max: u32,
    /// How often pending sync work is retried and, while partitioned, the
    /// central ledger probed.
    pub retry_interval_ms: u64,
    /// A new shard is requested this long before the current one's end.
    pub shard_refresh_margin_ms: u64,
    /// Taken off a shard's validity to allow for clock skew.
    pub shard_skew_margin_ms: u64,
    /// Hold of a reservation made from a shard.
    pub local_hold_ms: u64,
    /// Execution deadline when the gateway names none.
    pub default_deadline_ms: u64,
    /// Longest execution deadline a gateway may ask for.
    pub deadline_ms_max: u64,
    /// Most reservations held in flight at once.
    pub open_reservations_max: usize,
    /// Most records in one journal batch (one durable commit).
    pub journal_batch_max: usize,
    /// How long an unknown reserve waits for its gateway to retry before
    /// the agent abandons the ID at the center.
    pub unknown_abandon_grace_ms: u64,
    /// Known bugs the simulator plants (the `canaries` feature).
    #[cfg(feature = "canaries")]
    pub canaries: AgentCanaries,
}

/// Known bugs the simulator plants to prove its checks catch them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgentCanaries {
    /// A restarted process keeps admitting from the shards of its old boot.
    pub accept_shard_after_restart: bool,
}

impl AgentConfig {
    /// Sane defaults for `identity`.
    pub fn new(identity: GatewayIdentity) -> Self {
        Self {
            identity,
            route_modes: BTreeMap::new(),
            route_concurrency: BTreeMap::new(),
            subject_weights: BTreeMap::new(),
            central_call_timeout_ms: 2_000,
            partition_failures_max: 3,
            retry_interval_ms: 1_000,
            shard_refresh_margin_ms: 60_000,
            shard_skew_margin_ms: 5_000,
            local_hold_ms: 30_000,
            default_deadline_ms: 60_000,
            deadline_ms_max: 3_600_000,
            open_reservations_max: 1_000_000,
            journal_batch_max: 4096,
            unknown_abandon_grace_ms: 30_000,
            #[cfg(feature = "canaries")]
            canaries: AgentCanaries::default(),
        }
    }
}

/// This process's registration with the central ledger. The nonce lives in
/// memory only, so a restarted process can never present an old boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Boot {
    epoch: u64,
    nonce: BootNonce,
}

/// Connectivity and shard supply of one `(subject, route)`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PairHealth {
    consecutive_failures: u32,
    partitioned: bool,
    /// No shard request before this monotonic time (backoff).
    next_shard_request_ms: u64,
    shard_request_in_flight: bool,
}

/// An open or closed shard this agent holds.
#[derive(Debug, Clone)]
struct ShardSlot {
    accepted: AcceptedShard,
    ledger: ShardLedger,
}

/// What a gateway call waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Waiter {
    Reserve,
    Start,
    Settle,
    Release,
}

/// A central call under way.
#[derive(Debug, Clone, PartialEq, Eq)]
enum InFlight {
    Register,
    Health,
    /// A reservation's sync operation, as sent.
    Sync(ReservationId, SyncOp),
    IssueShard(PairKey),
    UploadReceipt(ShardId),
}

/// A central call for the shell to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutgoingCall {
    pub request: RequestId,
    pub call: CentralCall,
    /// Monotonic ms after which the shell reports `OutcomeUnknown`.
    pub deadline_ms: u64,
}

/// A shard as `GET /v1/status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardStatus {
    pub shard: ShardId,
    pub subject: Subject,
    pub route: Route,
    pub fence: u64,
    pub boot_epoch: u64,
    pub terms: ShardTerms,
    pub overdraft_debt: u64,
    pub closed: bool,
    pub usable_until_ms: u64,
}

/// A pair's mode as `GET /v1/status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PairStatus {
    pub pair: PairKey,
    pub partitioned: bool,
    pub consecutive_failures: u32,
}

/// The pure view behind `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentStatus {
    /// `partitioned` if any pair is, else `healthy`.
    pub mode: &'static str,
    pub identity: GatewayIdentity,
    /// `None` until this boot is registered.
    pub boot_epoch: Option<u64>,
    pub pairs: Vec<PairStatus>,
    pub shards: Vec<ShardStatus>,
    /// Reservations with an operation the central ledger must still receive.
    pub pending_sync: usize,
    /// Terminal receipts not yet acknowledged.
    pub pending_receipts: usize,
    pub reservations_in_flight: usize,
    pub shares: Vec<SubjectShare>,
}

/// The agent decision core. See the module documentation.
pub struct AgentCore {
    config: AgentConfig,
    signer: Box<dyn DocumentSigner + Send>,
    verifier: Box<dyn DocumentVerifier + Send>,
    boot: Option<Boot>,
    reservations: BTreeMap<ReservationId, AgentReservation>,
    by_key: BTreeMap<IdempotencyKey, ReservationId>,
    shards: BTreeMap<ShardId, ShardSlot>,
    receipts: BTreeMap<ShardId, (ShardTerminalReceiptV1, bool)>,
    fences: BTreeMap<PairKey, u64>,
    pairs: BTreeMap<PairKey, PairHealth>,
    scheduler: StartScheduler,
    /// Monotonic deadline of each started reservation (this boot only).
    usage_deadlines: BTreeMap<ReservationId, u64>,
    /// Reservations the retry timer has work for: a pending sync, an
    /// unknown reserve, central usage in doubt (derived from the records).
    retry_work: BTreeSet<ReservationId>,
    /// Reservations in flight (derived), for `open_reservations_max`.
    in_flight_count: usize,
    /// When each unknown reserve was first seen by the retry timer (this
    /// boot only): abandoning waits out `unknown_abandon_grace_ms`.
    unknown_seen_at: BTreeMap<ReservationId, u64>,
    waiters: BTreeMap<ReservationId, Vec<(CallId, Waiter)>>,
    in_flight: BTreeMap<RequestId, InFlight>,
    syncing: BTreeMap<ReservationId, RequestId>,
    next_request: RequestId,
    next_retry_ms: u64,
    journal_pending: Vec<JournalRecord>,
    appended_seq: u64,
    committed_seq: u64,
    gated_calls: VecDeque<(u64, OutgoingCall)>,
    gated_replies: VecDeque<(u64, CallId, GatewayResponse)>,
}

impl fmt::Debug for AgentCore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentCore")
            .field("identity", &self.config.identity)
            .field("boot", &self.boot)
            .field("reservations", &self.reservations.len())
            .field("shards", &self.shards.len())
            .finish_non_exhaustive()
    }
}

impl AgentCore {
    /// Starts a process from its journal (empty on first start). Shards in
    /// the journal belong to earlier boots: they are closed at once
    /// (available → confirmed unused, in flight → unknown) and their signed
    /// terminal receipts queued. Registration for a new boot epoch is the
    /// first central call; until it succeeds there is no emergency capacity.
    pub fn recover(
        config: AgentConfig,
        signer: Box<dyn DocumentSigner + Send>,
        verifier: Box<dyn DocumentVerifier + Send>,
        records: impl IntoIterator<Item = JournalRecord>,
        now: Now,
    ) -> Self {
        let scheduler = StartScheduler::new(
            config.route_concurrency.clone(),
            config.subject_weights.clone(),
        );
        let mut core = Self {
            config,
            signer,
            verifier,
            boot: None,
            reservations: BTreeMap::new(),
            by_key: BTreeMap::new(),
            shards: BTreeMap::new(),
            receipts: BTreeMap::new(),
            fences: BTreeMap::new(),
            pairs: BTreeMap::new(),
            scheduler,
            usage_deadlines: BTreeMap::new(),
            retry_work: BTreeSet::new(),
            in_flight_count: 0,
            unknown_seen_at: BTreeMap::new(),
            waiters: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            syncing: BTreeMap::new(),
            next_request: 1,
            next_retry_ms: now.mono_ms,
            journal_pending: Vec::new(),
            appended_seq: 0,
            committed_seq: 0,
            gated_calls: VecDeque::new(),
            gated_replies: VecDeque::new(),
        };
        let mut shard_docs = BTreeMap::new();
        let mut shard_books: BTreeMap<ShardId, Vec<ShardChange>> = BTreeMap::new();
        for record in records {
            match record {
                JournalRecord::Reservation(record) => {
                    core.by_key
                        .insert(record.idempotency_key.clone(), record.reservation.clone());
                    core.reservations
                        .insert(record.reservation.clone(), *record);
                }
                JournalRecord::Shard(accepted) => {
                    shard_docs.insert(accepted.shard.shard.clone(), *accepted);
                }
                JournalRecord::ShardBook { shard, change } => {
                    shard_books.entry(shard).or_default().push(change);
                }
                JournalRecord::Fence { pair, fence } => {
                    let known = core.fences.entry(pair).or_default();
                    *known = (*known).max(fence);
                }
                JournalRecord::TerminalReceipt {
                    receipt,
                    acknowledged,
                } => {
                    core.receipts
                        .insert(receipt.shard.clone(), (*receipt, acknowledged));
                }
            }
        }
        core.in_flight_count = core
            .reservations
            .values()
            .filter(|record| record.state.is_in_flight())
            .count();
        core.retry_work = core
            .reservations
            .values()
            .filter(|record| needs_retry(record))
            .map(|record| record.reservation.clone())
            .collect();
        for (id, accepted) in shard_docs {
            let books = shard_books.remove(&id).unwrap_or_default();
            // A book that fails its own equation is not trusted: start from
            // the shard alone, which retires everything as unknown/unused
            // conservatively on close below.
            let ledger = ShardLedger::from_records(accepted.shard.clone(), books)
                .unwrap_or_else(|_| ShardLedger::open(accepted.shard.clone()).0);
            core.shards
                .insert(id.clone(), ShardSlot { accepted, ledger });
            if !core.canary_accept_shard_after_restart() {
                core.close_shard(&id, ShardCloseReason::Restart, now);
            }
        }
        // Reservations of the previous process: shard ones died with their
        // shard; central ones in doubt are resolved with the central ledger.
        let ids: Vec<ReservationId> = core.reservations.keys().cloned().collect();
        for id in ids {
            let mut record = core.reservations[&id].clone();
            let before = record.clone();
            match (&record.path, record.state) {
                (ReservationPath::Shard(_), AgentState::Reserved) => {
                    record.state = AgentState::Expired;
                }
                (ReservationPath::Shard(_), AgentState::Started) => {
                    record.state = AgentState::UsageUnknown;
                }
                (ReservationPath::Central, AgentState::Requested) => {
                    record.state = AgentState::ReservationUnknown;
                }
                // Whether its execution still runs is unknown to a new process.
                (ReservationPath::Central, AgentState::Started) => {
                    record.state = AgentState::UsageUnknown;
                }
                _ => {}
            }
            if record != before {
                core.put_reservation(record);
            }
        }
        core.send(InFlight::Register, CentralCall::Register, now);
        core
    }

    // ----- getters -----

    pub fn config(&self) -> &AgentConfig {
        &self.config
    }

    pub fn reservation(&self, id: &ReservationId) -> Option<&AgentReservation> {
        self.reservations.get(id)
    }

    pub fn reservations(&self) -> impl Iterator<Item = &AgentReservation> {
        self.reservations.values()
    }

    pub fn boot_epoch(&self) -> Option<u64> {
        self.boot.map(|boot| boot.epoch)
    }

    /// Whether any pair is treated as partitioned.
    pub fn any_partitioned(&self) -> bool {
        self.pairs.values().any(|health| health.partitioned)
    }

    pub fn is_partitioned(&self, pair: &PairKey) -> bool {
        self.pairs
            .get(pair)
            .is_some_and(|health| health.partitioned)
    }

    /// Every shard this process holds (open or closed) with its book.
    pub fn shard_ledgers(&self) -> impl Iterator<Item = &ShardLedger> {
        self.shards.values().map(|slot| &slot.ledger)
    }

    /// Terminal receipts and whether each was acknowledged.
    pub fn terminal_receipts(&self) -> impl Iterator<Item = (&ShardTerminalReceiptV1, bool)> {
        self.receipts
            .values()
            .map(|(receipt, acked)| (receipt, *acked))
    }

    pub fn shares(&self) -> Vec<SubjectShare> {
        self.scheduler.shares()
    }

    /// The start scheduler, for inspection.
    pub fn scheduler(&self) -> &StartScheduler {
        &self.scheduler
    }

    /// The pure view behind `GET /v1/status`.
    pub fn status(&self) -> AgentStatus {
        debug_assert_eq!(
            self.in_flight_count,
            self.reservations
                .values()
                .filter(|r| r.state.is_in_flight())
                .count(),
            "the in-flight count is derived from the records"
        );
        let pairs: Vec<PairStatus> = self
            .pairs
            .iter()
            .map(|(pair, health)| PairStatus {
                pair: pair.clone(),
                partitioned: health.partitioned,
                consecutive_failures: health.consecutive_failures,
            })
            .collect();
        AgentStatus {
            mode: if pairs.iter().any(|pair| pair.partitioned) {
                "partitioned"
            } else {
                "healthy"
            },
            identity: self.config.identity.clone(),
            boot_epoch: self.boot_epoch(),
            pairs,
            shards: self
                .shards
                .values()
                .map(|slot| ShardStatus {
                    shard: slot.accepted.shard.shard.clone(),
                    subject: slot.accepted.shard.subject.clone(),
                    route: slot.accepted.shard.route.clone(),
                    fence: slot.accepted.shard.fence,
                    boot_epoch: slot.accepted.shard.boot_epoch,
                    terms: *slot.ledger.terms(),
                    overdraft_debt: slot.ledger.overdraft_debt(),
                    closed: slot.ledger.is_closed(),
                    usable_until_ms: slot.accepted.usable_until_ms,
                })
                .collect(),
            pending_sync: self
                .reservations
                .values()
                .filter(|r| r.sync.is_some())
                .count(),
            pending_receipts: self.receipts.values().filter(|(_, acked)| !acked).count(),
            reservations_in_flight: self.in_flight_count,
            shares: self.scheduler.shares(),
        }
    }

    // ----- outputs -----

    /// The records to commit next, in one durable transaction; then call
    /// [`Self::handle_journal_committed`] with the batch's `seq`.
    /// Group commit: every record made since the last poll goes into one
    /// batch, up to `journal_batch_max` records.
    pub fn poll_journal(&mut self) -> Option<JournalBatch> {
        if self.journal_pending.is_empty() {
            return None;
        }
        let take = self
            .journal_pending
            .len()
            .min(self.config.journal_batch_max.max(1));
        let left = self.journal_pending.len() - take;
        let records: Vec<JournalRecord> = self.journal_pending.drain(..take).collect();
        Some(JournalBatch {
            seq: self.appended_seq - left as u64,
            records,
        })
    }

    /// Whether records wait for [`Self::poll_journal`].
    pub fn has_pending_journal(&self) -> bool {
        !self.journal_pending.is_empty()
    }

    /// The next central call whose journal records are committed.
    pub fn poll_central(&mut self) -> Option<OutgoingCall> {
        match self.gated_calls.front() {
            Some((needs, _)) if *needs <= self.committed_seq => {
                self.gated_calls.pop_front().map(|(_, call)| call)
            }
            _ => None,
        }
    }

    /// Up to `max` central calls whose journal records are committed, for
    /// a shell that sends them together.
    pub fn poll_central_batch(&mut self, max: usize) -> Vec<OutgoingCall> {
        std::iter::from_fn(|| self.poll_central())
            .take(max)
            .collect()
    }

    /// The next gateway answer whose journal records are committed.
    pub fn poll_reply(&mut self) -> Option<(CallId, GatewayResponse)> {
        match self.gated_replies.front() {
            Some((needs, _, _)) if *needs <= self.committed_seq => self
                .gated_replies
                .pop_front()
                .map(|(_, call, response)| (call, response)),
            _ => None,
        }
    }

    /// The monotonic time at which [`Self::handle_timeout`] must be called.
    pub fn poll_timeout(&self) -> Option<u64> {
        // The retry timer runs only while it has work; otherwise the next
        // shard refresh is the only periodic duty.
        let mut next = if self.has_retry_work() {
            self.next_retry_ms
        } else {
            self.next_shard_due()
                .unwrap_or(u64::MAX)
                .max(self.next_retry_ms)
        };
        if let Some(deadline) = self.usage_deadlines.values().min() {
            next = next.min(*deadline);
        }
        for slot in self.shards.values().filter(|slot| !slot.ledger.is_closed()) {
            next = next.min(slot.accepted.usable_until_ms);
            if let Some(expiry) = slot.ledger.next_expiry_ms() {
                next = next.min(expiry);
            }
        }
        (next != u64::MAX).then_some(next)
    }

    /// Whether the retry timer has anything to do besides shard supply.
    fn has_retry_work(&self) -> bool {
        self.boot.is_none()
            || self.any_partitioned()
            || !self.retry_work.is_empty()
            || self
                .receipts
                .values()
                .any(|(_, acknowledged)| !acknowledged)
            || self
                .shards
                .iter()
                .any(|(id, slot)| !slot.ledger.is_closed() && self.should_close_after_reconnect(id))
    }

    /// When the next pair needs a shard (requested or refreshed).
    fn next_shard_due(&self) -> Option<u64> {
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
                            && !slot.ledger.is_closed()
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

    // ----- inputs -----

    /// The journal committed every record up to `seq`.
    pub fn handle_journal_committed(&mut self, seq: u64) {
        debug_assert!(seq <= self.appended_seq);
        self.committed_seq = self.committed_seq.max(seq);
    }

    /// A gateway call.
    pub fn handle_gateway(&mut self, call: CallId, request: GatewayRequest, now: Now) {
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
                    field: "units",
                    message: format!("must be between 1 and {}", shard_format::limits::UNITS_MAX),
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
                    field: "deadlineMs",
                    message: format!("must be between 1 and {}", self.config.deadline_ms_max),
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
        if let Some(id) = self.by_key.get(&reserve.idempotency_key).cloned() {
            let record = self.reservations[&id].clone();
            if record.request_digest != digest {
                return self.reply(
                    call,
                    GatewayResponse::Conflict {
                        code: "idempotency_conflict",
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
                    code: "too_many_open_reservations",
                    message: format!(
                        "the agent holds {in_flight} open reservations, its maximum; settle or release some first"
                    ),
                    retry_after_seconds: 1,
                },
            );
        }
        let record = AgentReservation {
            reservation: reservation_id_for(
                &self.config.identity,
                &reserve.subject,
                &reserve.route,
                &reserve.idempotency_key,
            ),
            idempotency_key: reserve.idempotency_key,
            subject: reserve.subject,
            route: reserve.route,
            units: reserve.units,
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
        };
        self.by_key
            .insert(record.idempotency_key.clone(), record.reservation.clone());
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
            record.sync = None;
            self.put_reservation(record.clone());
            return self.reply(call, reservation_response(&record, true));
        }
        let Some(shard_id) = self.usable_shard(&pair, record.units, now) else {
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
                    "emergency_debt",
                    "the central ledger is unreachable and local overage left debt: admission is paused until reconciliation",
                )
            } else {
                (
                    "central_unreachable",
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
            .reserve(
                record.reservation.clone(),
                record.units,
                self.config.local_hold_ms,
                now.mono_ms,
            );
        self.journal_shard(&shard_id, transition.changes);
        match transition.outcome {
            ShardReserveOutcome::Reserved(_) | ShardReserveOutcome::Duplicate(_) => {
                record.state = AgentState::Reserved;
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

    /// An open, valid, unpaused shard of the pair with `units` available.
    fn usable_shard(&self, pair: &PairKey, units: u64, now: Now) -> Option<ShardId> {
        let boot = self.boot;
        self.shards
            .values()
            .filter(|slot| {
                let shard = &slot.accepted.shard;
                shard.subject == pair.subject
                    && shard.route == pair.route
                    && (boot.is_some_and(|boot| {
                        shard.boot_epoch == boot.epoch && shard.boot_nonce == boot.nonce
                    }) || self.canary_accept_shard_after_restart())
                    && !slot.ledger.is_closed()
                    && !slot.ledger.is_paused()
                    && now.mono_ms < slot.accepted.usable_until_ms
                    && slot.ledger.terms().local_available >= units
            })
            // The oldest fence first, so older shards drain before newer.
            .min_by_key(|slot| slot.accepted.shard.fence)
            .map(|slot| slot.accepted.shard.shard.clone())
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
                        code: "operation_conflict",
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
                    code: "central_unreachable",
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
                    field: "actualUnits",
                    message: format!("must be at most {}", shard_format::limits::UNITS_MAX),
                },
            );
        }
        if record.operation_id.as_ref() != Some(&operation_id) {
            return self.reply(
                call,
                match &record.operation_id {
                    Some(bound) => GatewayResponse::Conflict {
                        code: "operation_conflict",
                        message: format!("reservation {id} is bound to operation {bound}"),
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
                        code: "settlement_conflict",
                        message: format!(
                            "reservation {id} was settled with {settled} actual units"
                        ),
                    },
                );
            }
            if record.state == AgentState::Settling && !self.is_partitioned(&record.pair()) {
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

    /// The result of a central call.
    pub fn handle_central(&mut self, request: RequestId, result: CentralResult, now: Now) {
        let Some(what) = self.in_flight.remove(&request) else {
            return; // a late answer to a call we gave up on: harmless, resent later
        };
        let pair = match &what {
            InFlight::Sync(id, _) => {
                self.syncing.remove(id);
                self.reservations.get(id).map(AgentReservation::pair)
            }
            InFlight::IssueShard(pair) => {
                if let Some(health) = self.pairs.get_mut(pair) {
                    health.shard_request_in_flight = false;
                }
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
                                && !slot.ledger.is_closed()
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
                    CentralReply::ReceiptAccepted(_) | CentralReply::Refused { .. }
                );
                if definite && let Some((receipt, acknowledged)) = self.receipts.get_mut(&shard) {
                    // A refusal is final too (unknown shard, wrong identity):
                    // retrying would never succeed.
                    *acknowledged = true;
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
        let Some(mut record) = self.reservations.get(id).cloned() else {
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
                    code: "start_unknown",
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

    /// A definite central answer to a reservation's sync operation.
    /// A definite central answer to the sync operation `op` that was sent.
    /// The record's pending operation may have changed meanwhile (a
    /// gateway retried while an abandon was under way): the answer is
    /// applied for what was sent, and a different pending operation stays
    /// pending.
    fn sync_reply(&mut self, id: &ReservationId, op: SyncOp, reply: CentralReply, now: Now) {
        let Some(mut record) = self.reservations.get(id).cloned() else {
            return;
        };
        let pending = record.sync.clone();
        match (op.clone(), reply) {
            (SyncOp::Reserve, CentralReply::Reservation(receipt)) => {
                record.sync = still_pending(&pending, &op);
                record.state = agent_state_of(&receipt);
                let created = record.receipt.is_none();
                record.receipt = Some(*receipt);
                self.put_reservation(record.clone());
                self.answer_waiters(id, Waiter::Reserve, reservation_response(&record, created));
            }
            (SyncOp::Reserve, CentralReply::Rejected(rejection)) => {
                record.sync = still_pending(&pending, &op);
                record.state = AgentState::Rejected;
                record.rejection = Some(rejection);
                self.put_reservation(record.clone());
                let response = if record.shadow {
                    reservation_response(&record, true)
                } else {
                    GatewayResponse::Rejected {
                        reservation: id.clone(),
                        rejection,
                    }
                };
                self.answer_waiters(id, Waiter::Reserve, response);
            }
            (SyncOp::Reserve, CentralReply::Refused { code, message }) => {
                record.sync = still_pending(&pending, &op);
                record.state = if code == "abandoned" {
                    AgentState::Abandoned
                } else {
                    AgentState::Rejected
                };
                self.put_reservation(record);
                self.answer_waiters(id, Waiter::Reserve, refused_response(&code, message));
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
                record.receipt = Some(*receipt);
                self.put_reservation(record);
            }
            (SyncOp::Abandon, CentralReply::Refused { .. }) => {
                record.sync = still_pending(&pending, &op);
                record.state = AgentState::Abandoned;
                self.put_reservation(record);
            }
            (SyncOp::Start { .. }, CentralReply::Reservation(receipt)) => {
                record.sync = still_pending(&pending, &op);
                record.state = agent_state_of(&receipt);
                record.receipt = Some(*receipt);
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
                            .unwrap_or(self.config.default_deadline_ms);
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
            (SyncOp::Start { .. }, CentralReply::Refused { code, message }) => {
                record.sync = still_pending(&pending, &op);
                record.state = AgentState::Reserved;
                record.operation_id = None;
                self.finish_slot(&record, now);
                self.put_reservation(record);
                self.answer_waiters(id, Waiter::Start, refused_response(&code, message));
            }
            (SyncOp::Settle, CentralReply::Settled(settlement)) => {
                record.sync = still_pending(&pending, &op);
                record.state = if settlement.overdraft_units > 0 {
                    AgentState::SettledWithDebt
                } else {
                    AgentState::Settled
                };
                record.settlement = Some(*settlement);
                self.put_reservation(record.clone());
                self.answer_waiters(id, Waiter::Settle, reservation_response(&record, false));
            }
            (SyncOp::Settle, CentralReply::Refused { code, message }) => {
                // A definite refusal (e.g. a conflicting earlier settlement):
                // retrying would not change it.
                record.sync = still_pending(&pending, &op);
                self.put_reservation(record);
                self.answer_waiters(id, Waiter::Settle, refused_response(&code, message));
            }
            (SyncOp::Release, CentralReply::Reservation(receipt)) => {
                record.sync = still_pending(&pending, &op);
                record.state = agent_state_of(&receipt);
                record.receipt = Some(*receipt);
                self.put_reservation(record.clone());
                self.answer_waiters(id, Waiter::Release, reservation_response(&record, false));
            }
            (SyncOp::Release, CentralReply::Refused { code, message }) => {
                // The center's reservation moved on (expired, abandoned):
                // ask it how, so the record does not stay RELEASING.
                record.sync = still_pending(&pending, &op).or(Some(SyncOp::Refresh));
                self.put_reservation(record);
                self.answer_waiters(id, Waiter::Release, refused_response(&code, message));
            }
            (SyncOp::Refresh, CentralReply::Reservation(receipt)) => {
                record.sync = still_pending(&pending, &op);
                if record.state == AgentState::Releasing && receipt.state.is_terminal() {
                    record.state = agent_state_of(&receipt);
                    record.receipt = Some(*receipt);
                    self.put_reservation(record.clone());
                    self.answer_waiters(id, Waiter::Release, reservation_response(&record, false));
                    return;
                }
                if receipt.state.is_settled() {
                    // Settled at the center (perhaps conservatively, at the
                    // hard limit). `actual_units` stays unset here, so a
                    // genuine receipt from the gateway is still forwarded and
                    // corrects a conservative settlement once.
                    record.state = agent_state_of(&receipt);
                    record.receipt = Some(*receipt);
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

    /// A definite answer to a shard request.
    fn shard_reply(&mut self, pair: &PairKey, reply: CentralReply, now: Now) {
        let backoff = match reply {
            CentralReply::Shard(shard) => match self.accept_shard(*shard, now) {
                Ok(()) => 0,
                Err(_) => self.config.retry_interval_ms * 10,
            },
            CentralReply::Rejected(rejection) => rejection
                .retry_after_seconds
                .map_or(self.config.retry_interval_ms * 30, |seconds| seconds * 1000),
            // Another registration of this identity (a duplicated or retried
            // one) superseded our boot: register again.
            CentralReply::Refused { code, .. } if code == "superseded_boot" => {
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
        let (ledger, book) = ShardLedger::open(shard.clone());
        self.fences.insert(pair.clone(), shard.fence);
        self.append(JournalRecord::Fence {
            pair,
            fence: shard.fence,
        });
        self.append(JournalRecord::Shard(Box::new(accepted.clone())));
        self.journal_shard(&shard.shard, vec![book]);
        self.shards
            .insert(shard.shard.clone(), ShardSlot { accepted, ledger });
        Ok(())
    }

    /// Time passed: deadlines, holds, shard validity, retries, probes and
    /// shard supply.
    pub fn handle_timeout(&mut self, now: Now) {
        // Executions past their deadline without a receipt: usage unknown.
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
        // Local holds and shard ends.
        let shard_ids: Vec<ShardId> = self.shards.keys().cloned().collect();
        for shard_id in shard_ids {
            let slot = self.shards.get_mut(&shard_id).expect("listed");
            if slot.ledger.is_closed() {
                continue;
            }
            let transition = slot.ledger.expire_due(now.mono_ms);
            let ended = now.mono_ms >= slot.accepted.usable_until_ms;
            self.journal_shard(&shard_id, transition.changes);
            for id in transition.outcome {
                if let Some(mut record) = self.reservations.get(&id).cloned() {
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
        if now.mono_ms >= self.next_retry_ms {
            self.next_retry_ms = now.mono_ms.saturating_add(self.config.retry_interval_ms);
            self.retry(now);
        }
    }

    /// A shard used while partitioned is handed back once its pair is
    /// healthy again and nothing of it is in flight, so its receipt (and
    /// any debt) reaches the central ledger promptly.
    fn should_close_after_reconnect(&self, shard_id: &ShardId) -> bool {
        let slot = &self.shards[shard_id];
        let pair = PairKey::new(
            slot.accepted.shard.subject.clone(),
            slot.accepted.shard.route.clone(),
        );
        let terms = slot.ledger.terms();
        !self.is_partitioned(&pair)
            && self.pairs.contains_key(&pair)
            && terms.local_available < terms.allocated
            && terms.local_reserved == 0
    }

    /// Periodic work: registration, sync retries, probes, receipts, shards.
    fn retry(&mut self, now: Now) {
        if self.boot.is_none() && !self.in_flight.values().any(|w| *w == InFlight::Register) {
            self.send(InFlight::Register, CentralCall::Register, now);
        }
        let any_partitioned = self.pairs.values().any(|health| health.partitioned);
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
        if !any_partitioned || self.pairs.is_empty() {
            let uploads: Vec<ShardId> = self
                .receipts
                .iter()
                .filter(|(shard, (_, acknowledged))| {
                    !acknowledged
                        && !self
                            .in_flight
                            .values()
                            .any(|w| *w == InFlight::UploadReceipt((*shard).clone()))
                })
                .map(|(shard, _)| shard.clone())
                .collect();
            for shard in uploads {
                let receipt = self.receipts[&shard].0.clone();
                self.send(
                    InFlight::UploadReceipt(shard),
                    CentralCall::UploadReceipt(Box::new(receipt)),
                    now,
                );
            }
        }
        self.request_shards(now);
    }

    /// Asks for a shard for every healthy pair without a fresh one.
    fn request_shards(&mut self, now: Now) {
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
                    && !slot.ledger.is_closed()
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

    // ----- machinery -----

    #[cfg(feature = "canaries")]
    fn canary_accept_shard_after_restart(&self) -> bool {
        self.config.canaries.accept_shard_after_restart
    }

    #[cfg(not(feature = "canaries"))]
    fn canary_accept_shard_after_restart(&self) -> bool {
        false
    }

    fn route_mode(&self, route: &Route) -> RouteMode {
        self.config
            .route_modes
            .get(route)
            .copied()
            .unwrap_or(RouteMode::Enforce)
    }

    fn note_failure(&mut self, pair: Option<&PairKey>) {
        let max = self.config.partition_failures_max;
        let mark = |health: &mut PairHealth| {
            health.consecutive_failures = health.consecutive_failures.saturating_add(1);
            if health.consecutive_failures >= max {
                health.partitioned = true;
            }
        };
        match pair {
            Some(pair) => mark(self.pairs.entry(pair.clone()).or_default()),
            None => self.pairs.values_mut().for_each(mark),
        }
    }

    /// Only a definite answer from the central ledger ends a partition.
    fn note_success(&mut self, pair: Option<&PairKey>) {
        let clear = |health: &mut PairHealth| {
            health.consecutive_failures = 0;
            health.partitioned = false;
        };
        match pair {
            Some(pair) => clear(self.pairs.entry(pair.clone()).or_default()),
            None => self.pairs.values_mut().for_each(clear),
        }
    }

    /// Sends the reservation's pending sync operation, unless one is under way.
    fn send_sync(&mut self, id: &ReservationId, now: Now) {
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
                reservation: id.clone(),
                subject: record.subject.clone(),
                route: record.route.clone(),
                units: record.units,
                policy_generation: None,
                request_digest: record.request_digest,
                hold_ttl_ms: None,
            }),
            SyncOp::Start { deadline_ms } => CentralCall::Start {
                reservation: id.clone(),
                operation_id: record.operation_id.clone().expect("bound before start"),
                deadline_ms,
            },
            SyncOp::Settle => CentralCall::Settle {
                reservation: id.clone(),
                operation_id: record.operation_id.clone().expect("bound before settle"),
                actual_units: record.actual_units.expect("recorded before settle"),
            },
            SyncOp::Release => CentralCall::Release {
                reservation: id.clone(),
            },
            SyncOp::Abandon => CentralCall::Abandon {
                reservation: id.clone(),
            },
            SyncOp::Refresh => CentralCall::Get {
                reservation: id.clone(),
            },
        };
        let request = self.send(InFlight::Sync(id.clone(), op), call, now);
        self.syncing.insert(id.clone(), request);
    }

    fn send(&mut self, what: InFlight, call: CentralCall, now: Now) -> RequestId {
        let request = self.next_request;
        self.next_request += 1;
        self.in_flight.insert(request, what);
        let outgoing = OutgoingCall {
            request,
            call,
            deadline_ms: now
                .mono_ms
                .saturating_add(self.config.central_call_timeout_ms),
        };
        self.gated_calls.push_back((self.appended_seq, outgoing));
        request
    }

    fn reply(&mut self, call: CallId, response: GatewayResponse) {
        self.gated_replies
            .push_back((self.appended_seq, call, response));
    }

    fn wait(&mut self, call: CallId, id: &ReservationId, waiter: Waiter) {
        self.waiters
            .entry(id.clone())
            .or_default()
            .push((call, waiter));
    }

    fn answer_waiters(&mut self, id: &ReservationId, kind: Waiter, response: GatewayResponse) {
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
    fn finish_slot(&mut self, record: &AgentReservation, now: Now) {
        let granted = self.scheduler.finish(&record.route, &record.reservation);
        for id in granted {
            if let Some(next) = self.reservations.get(&id).cloned()
                && next.state == AgentState::Reserved
            {
                self.begin_start(next, now);
            }
        }
    }

    fn close_shard(&mut self, shard_id: &ShardId, reason: ShardCloseReason, now: Now) {
        let Some(slot) = self.shards.get_mut(shard_id) else {
            return;
        };
        if slot.ledger.is_closed() {
            return;
        }
        // Its reservations end with it: unstarted ones can never start,
        // started ones' usage is unknown to the shard from here on.
        let affected: Vec<ReservationId> = self
            .reservations
            .values()
            .filter(|r| r.path == ReservationPath::Shard(shard_id.clone()))
            .filter(|r| matches!(r.state, AgentState::Reserved | AgentState::Started))
            .map(|r| r.reservation.clone())
            .collect();
        for id in affected {
            let mut record = self.reservations[&id].clone();
            record.state = if record.state == AgentState::Reserved {
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
        let transition = slot.ledger.close(reason, now.wall);
        let receipt = slot.ledger.terminal_receipt();
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

    fn put_reservation(&mut self, record: AgentReservation) {
        self.append(JournalRecord::Reservation(Box::new(record.clone())));
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

    fn journal_shard(&mut self, shard: &ShardId, changes: Vec<ShardChange>) {
        for change in changes {
            self.append(JournalRecord::ShardBook {
                shard: shard.clone(),
                change,
            });
        }
    }

    fn append(&mut self, record: JournalRecord) {
        self.appended_seq += 1;
        self.journal_pending.push(record);
    }
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

/// The reservation ID for a gateway's idempotency key: chosen once, before
/// anything is sent, and derived so that the same key always maps to the
/// same ID — even after the journal was lost or restored from an older
/// copy. A retry can therefore never reserve twice at the center.
/// `rl-` and 32 hex digits of SHA-256 over identity, subject, route and key.
pub fn reservation_id_for(
    identity: &GatewayIdentity,
    subject: &Subject,
    route: &Route,
    key: &IdempotencyKey,
) -> ReservationId {
    let mut input = Vec::new();
    for part in [
        identity.as_str(),
        subject.as_str(),
        route.as_str(),
        key.as_str(),
    ] {
        input.extend_from_slice(&(part.len() as u64).to_be_bytes());
        input.extend_from_slice(part.as_bytes());
    }
    let digest = shard_format::Digest::sha256(&input).to_string();
    let hex = &digest["sha256:".len().."sha256:".len() + 32];
    ReservationId::new(format!("rl-{hex}")).expect("rl- and hex digits form a valid ID")
}

/// What stays pending after `sent` was answered: nothing, unless another
/// operation replaced it meanwhile.
fn still_pending(pending: &Option<SyncOp>, sent: &SyncOp) -> Option<SyncOp> {
    pending.clone().filter(|op| op != sent)
}

/// A record the retry timer has work for.
fn needs_retry(record: &AgentReservation) -> bool {
    record.sync.is_some()
        || record.state == AgentState::ReservationUnknown
        || (record.state == AgentState::UsageUnknown && record.path == ReservationPath::Central)
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

fn reservation_response(record: &AgentReservation, created: bool) -> GatewayResponse {
    GatewayResponse::Reservation {
        created,
        reservation: Box::new(record.clone()),
    }
}

fn unknown_response(record: &AgentReservation) -> GatewayResponse {
    GatewayResponse::Unavailable {
        code: "reservation_unknown",
        message: format!(
            "the outcome of reservation {} is unknown; retry with the same idempotency key",
            record.reservation
        ),
        retry_after_seconds: 1,
    }
}

fn expired_response(record: &AgentReservation) -> GatewayResponse {
    GatewayResponse::Conflict {
        code: "expired",
        message: format!(
            "reservation {} expired before it started; reserve again",
            record.reservation
        ),
    }
}

fn illegal_state(record: &AgentReservation, operation: &str) -> GatewayResponse {
    GatewayResponse::Conflict {
        code: "illegal_transition",
        message: format!(
            "reservation {} is {:?}; {operation} is not allowed from there",
            record.reservation, record.state
        ),
    }
}

fn refused_response(code: &str, message: String) -> GatewayResponse {
    if code == "not_found" {
        return GatewayResponse::NotFound;
    }
    GatewayResponse::Conflict {
        code: "central_refused",
        message: format!("{code}: {message}"),
    }
}
