//! A fully deterministic implementation of the agent's decisions: everything
//! Reservoir's sidecar decides about its gateways' reservations, its calls to
//! the central ledger, the emergency shards it holds and its journal. It
//! contains no I/O — no networking, storage or timer code — and does not
//! read a clock or draw random numbers. Gateway requests, central results (a
//! reply or its absence), journal commits and time come in as calls; journal
//! batches, central calls, gateway answers and the next timeout come out as
//! values that a shell carries out. The daemon in the `agent` crate is one
//! such shell, the simulator in `reservoir-tests` another; both drive this
//! very code. This crate's `Cargo.toml` proves the claim: its only
//! dependencies are `ledger`, `shard-format`, `serde`, `serde_json` and
//! `thiserror` (`tests/no_io.rs` keeps it so).
//!
//! # Method kinds and the order to call them in
//!
//! [`AgentCore`] has four kinds of methods:
//!
//! - `handle_*` feed one input in: [`AgentCore::handle_gateway`] (a gateway
//!   request), [`AgentCore::handle_central`] (the result of a central call),
//!   [`AgentCore::handle_journal_committed`] (a journal batch is durable),
//!   [`AgentCore::handle_timeout`] (time passed).
//! - `poll_*` take outputs: [`AgentCore::poll_journal`] (records to commit in
//!   one durable transaction), [`AgentCore::poll_central`] (calls to send,
//!   each with its deadline), [`AgentCore::poll_reply`] (answers to
//!   gateways), [`AgentCore::poll_timeout`] (when to call `handle_timeout`).
//! - Getters: [`AgentCore::status`], [`AgentCore::reservation`],
//!   [`AgentCore::is_partitioned`], …
//! - [`AgentCore::recover`] starts a process from its journal;
//!   [`AgentCore::accept_shard`] takes a shard handed over directly.
//!
//! After every `handle_*`, a shell drains `poll_journal`, commits the batch,
//! reports it with `handle_journal_committed`, then drains `poll_central`
//! and `poll_reply`, and finally asks `poll_timeout` when to wake up.
//! **Journal first:** a central call or a gateway answer is released only
//! after every record made before it is committed, so a crash between any
//! effect and its commit loses nothing acknowledged and sends nothing
//! unjournaled.
//!
//! # Modules
//!
//! The state and the public front live here; each concern adds its own
//! `impl AgentCore` block:
//!
//! - `reservations`: gateway requests (reserve, get, start, settle, release,
//!   cancel), the records' bookkeeping and the start slots;
//! - `central_sync`: central results, each reservation's sync operation, the
//!   retry timer and the resolution of unknown outcomes;
//! - `shards`: shard requests, acceptance, fences, local admission, closing
//!   and terminal receipts;
//! - `partition`: per-pair partition state (healthy or partitioned);
//! - `recovery`: a new process from its journal;
//! - `responses`: the answers gateways get;
//! - [`scheduler`]: the fair start scheduler;
//! - `messages`: what goes in and out (re-exported here).

mod central_sync;
mod messages;
mod pair_table;
mod partition;
mod records;
mod recovery;
mod reservations;
mod responses;
mod retention;
pub mod scheduler;
mod shard_slots;
mod shards;
mod terminal_receipts;
mod usage_deadlines;

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

pub use messages::{
    AcceptedShard, AgentLeg, AgentReservation, AgentState, CallId, CentralCall, CentralReply,
    CentralResult, GatewayRequest, GatewayReserve, GatewayResponse, JournalBatch, JournalKey,
    JournalRecord, Now, RequestId, ReservationPath, ShardHold, SyncOp, one_word,
};
/// The type of a record's one-word optional numbers ([`one_word`]).
pub use nonmax::NonMaxU64;
pub use retention::RetentionTooShort;
pub use shards::{RefusedShard, ShardRefusal};

use ledger::{LocalReservation, PairKey, ShardBook, ShardTerms};
use pair_table::PairTable;
use records::{RecordMap, RecordTally};
use shard_format::{
    BootNonce, DocumentSigner, DocumentVerifier, GatewayIdentity, ReservationId, Route, RouteMode,
    ShardId, ShardTerminalReceiptV1, Subject,
};
use shard_slots::ShardSlots;
use terminal_receipts::TerminalReceipts;

use scheduler::{StartScheduler, SubjectShare};

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
    /// How long (wall ms) a record at rest — a terminal or rejected
    /// reservation with nothing left to sync, a closed shard whose terminal
    /// receipt was acknowledged — is kept after it ended, for idempotent
    /// replay. Then it is forgotten, from memory and journal: the same
    /// idempotency key is a new request. At least
    /// [`Self::retention_floor_ms`]: shells refuse a shorter one at start
    /// ([`Self::check_retention`]).
    pub retention_ms: u64,
    /// Most records forgotten by one [`AgentCore::handle_timeout`] (a
    /// closed shard counts as one, whatever it held).
    pub forget_batch_max: usize,
    /// Known bugs the simulator plants (the `canaries` feature).
    #[cfg(feature = "canaries")]
    pub canaries: AgentCanaries,
}

/// Known bugs the simulator plants to prove its checks catch them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgentCanaries {
    /// A restarted process keeps admitting from the shards of its old boot.
    pub accept_shard_after_restart: bool,
    /// A reserve is admitted from any shard with a unit left, below its
    /// floor (`minUnits`, or `units` for a fixed one).
    pub admit_below_floor_from_shards: bool,
    /// A multi-leg reserve while partitioned is admitted from the shards of
    /// the legs that have a usable one; the other legs are skipped (granted
    /// their ask, held by no shard).
    pub admit_legs_without_shards: bool,
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
            retention_ms: ledger::RETENTION_DEFAULT_MS,
            forget_batch_max: 1024,
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
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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
    book: ShardBook,
}

/// A shard's book with its holds, as the core keeps them: the book in its
/// slot, each hold in its reservation's record.
#[derive(Debug, Clone, Copy)]
pub struct ShardLedgerView<'a> {
    book: &'a ShardBook,
    reservations: &'a RecordMap,
}

impl ShardLedgerView<'_> {
    /// The hold of reservation `id` in this book.
    pub fn reservation(&self, id: &ReservationId) -> Option<LocalReservation> {
        self.reservations.get(id)?.hold(&self.book.shard().shard)
    }

    /// Every hold in this book, in no particular order. A scan of every
    /// record: for tests and audits, not for a step.
    pub fn reservations(&self) -> impl Iterator<Item = LocalReservation> + '_ {
        let shard = &self.book.shard().shard;
        self.reservations
            .values()
            .filter_map(move |record| record.hold(shard))
    }
}

impl std::ops::Deref for ShardLedgerView<'_> {
    type Target = ShardBook;

    fn deref(&self) -> &ShardBook {
        self.book
    }
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

/// A shard as `GET /v1/status` (an open one) and `GET /v1/shards` show
/// it, and as their bodies write it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ShardStatus {
    pub shard: ShardId,
    pub subject: Subject,
    pub route: Route,
    pub fence: u64,
    pub boot_epoch: u64,
    pub terms: ShardTerms,
    pub overdraft_debt: u64,
    pub closed: bool,
    /// Monotonic ms of the agent's clock until which the shard admits.
    pub usable_until_ms: u64,
}

impl ShardStatus {
    fn of(slot: &ShardSlot) -> Self {
        let shard = &slot.accepted.shard;
        Self {
            shard: shard.shard.clone(),
            subject: shard.subject.clone(),
            route: shard.route.clone(),
            fence: shard.fence,
            boot_epoch: shard.boot_epoch,
            terms: *slot.book.terms(),
            overdraft_debt: slot.book.overdraft_debt(),
            closed: slot.book.is_closed(),
            usable_until_ms: slot.accepted.usable_until_ms,
        }
    }
}

/// One page of the shards (`GET /v1/shards`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPage {
    /// In ID order.
    pub shards: Vec<ShardStatus>,
    /// The last ID of this page when more come after it: the next page's
    /// `after`.
    pub next: Option<ShardId>,
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
    /// The open shards, in ID order.
    pub shards: Vec<ShardStatus>,
    /// How many closed shards are kept for the retention window
    /// ([`AgentCore::shards`] lists them, a page at a time): listing them
    /// in the status took the daemon's thread for as long as a day's
    /// shards take to copy and write, at every call.
    pub shards_closed: usize,
    /// Reservations with an operation the central ledger must still receive.
    pub pending_sync: usize,
    /// Terminal receipts not yet acknowledged.
    pub pending_receipts: usize,
    pub reservations_in_flight: usize,
    /// Reservations held in memory (and in the journal), in flight or not.
    pub reservations_held: usize,
    /// Terminal reservations kept for the retention window.
    pub reservations_retained: usize,
    /// Reservations whose outcome is unknown (`RESERVATION_UNKNOWN`,
    /// `USAGE_UNKNOWN`): the shell times how long each stays so.
    pub unknown: Vec<(ReservationId, AgentState)>,
    pub shares: Vec<SubjectShare>,
}

/// What `/metrics` reads of the core, from counts kept as the records and
/// pairs change: a scrape costs the daemon's thread next to nothing,
/// where the full status lists every shard (a day's, by default).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentGauges {
    pub partitioned_pairs: usize,
    /// Terminal receipts not yet acknowledged.
    pub pending_receipts: usize,
    pub reservations_in_flight: usize,
    /// As [`AgentStatus::unknown`].
    pub unknown: Vec<(ReservationId, AgentState)>,
}

/// The agent decision core. See the module documentation.
pub struct AgentCore {
    config: AgentConfig,
    signer: Box<dyn DocumentSigner + Send>,
    verifier: Box<dyn DocumentVerifier + Send>,
    boot: Option<Boot>,
    // Boxed: a hash table keeps an eighth to over half of its slots
    // empty (it grows at seven eighths full), so a record inline (208
    // bytes) would leave that much of its size unused, and every growth
    // would move the records instead of pointers.
    reservations: RecordMap,
    shards: ShardSlots,
    receipts: TerminalReceipts,
    fences: BTreeMap<PairKey, u64>,
    pairs: PairTable,
    scheduler: StartScheduler,
    /// Monotonic deadline of each started reservation (this boot only).
    usage_deadlines: usage_deadlines::UsageDeadlines,
    /// Reservations the retry timer has work for: a pending sync, an
    /// unknown reserve, central usage in doubt (derived from the records).
    retry_work: BTreeSet<ReservationId>,
    /// Counts of the records (derived): those in flight, for
    /// `open_reservations_max`, and what the status reports.
    tally: RecordTally,
    /// When each unknown reserve was first seen by the retry timer (this
    /// boot only): abandoning waits out `unknown_abandon_grace_ms`.
    unknown_seen_at: BTreeMap<ReservationId, u64>,
    waiters: BTreeMap<ReservationId, Vec<(CallId, Waiter)>>,
    in_flight: BTreeMap<RequestId, InFlight>,
    syncing: BTreeMap<ReservationId, RequestId>,
    next_request: RequestId,
    next_retry_ms: u64,
    journal_pending: Vec<PendingRecord>,
    appended_seq: u64,
    committed_seq: u64,
    gated_calls: VecDeque<(u64, OutgoingCall)>,
    gated_replies: VecDeque<(u64, CallId, GatewayResponse)>,
    /// The latest time an input brought (records at rest are stamped with
    /// its wall time; the retention timer converts wall to monotonic).
    clock: Now,
    /// Records at rest by `(ended_at, id)` (derived from the records): the
    /// retention sweep's queue. Shard-path records join it only once their
    /// shard is gone; until then they leave with their shard.
    retained: BTreeSet<(u64, ReservationId)>,
    /// No retention sweep is due before this monotonic time (set when the
    /// sweep ran out of budget or met records it may not forget yet).
    forget_not_before_ms: u64,
    /// Shards refused and handed back since the shell last asked
    /// ([`AgentCore::poll_refused_shards`]).
    refused_shards: Vec<RefusedShard>,
    /// The last answer of [`AgentCore::next_shard_due`], a pass over every
    /// pair, with what it read; kept while that stays the same.
    shard_due_memo: Cell<Option<ShardDueMemo>>,
}

/// [`AgentCore::next_shard_due`]'s answer, with what it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ShardDueMemo {
    inputs: ShardDueInputs,
    due: Option<u64>,
}

/// What [`AgentCore::next_shard_due`] reads: the pairs and the shards of
/// these generations, under this boot epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ShardDueInputs {
    pairs: u64,
    shards: u64,
    epoch: u64,
}

/// A record waiting for [`AgentCore::poll_journal`].
#[derive(Debug)]
enum PendingRecord {
    Record(JournalRecord),
    /// A reservation's record with its holds, built when the batch is
    /// made, as the reservation then stands.
    Reservation(ReservationId),
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
    // ----- getters -----

    pub fn config(&self) -> &AgentConfig {
        &self.config
    }

    /// A route's mode: enforced unless the configuration names it.
    fn route_mode(&self, route: &Route) -> RouteMode {
        self.config
            .route_modes
            .get(route)
            .copied()
            .unwrap_or(RouteMode::Enforce)
    }

    pub fn reservation(&self, id: &ReservationId) -> Option<&AgentReservation> {
        self.reservations.get(id)
    }

    /// Every record held, in no particular order.
    pub fn reservations(&self) -> impl Iterator<Item = &AgentReservation> {
        self.reservations.values()
    }

    /// The IDs of the records `keep` selects, in ID order: for loops whose
    /// effects (journal order, slots freed, waiters answered) must not
    /// follow the hash map's order.
    pub(crate) fn sorted_ids(
        &self,
        keep: impl Fn(&AgentReservation) -> bool,
    ) -> Vec<ReservationId> {
        let mut ids: Vec<ReservationId> = self
            .reservations
            .values()
            .filter(|record| keep(record))
            .map(|record| record.reservation.clone())
            .collect();
        ids.sort_unstable();
        ids
    }

    pub fn boot_epoch(&self) -> Option<u64> {
        self.boot.map(|boot| boot.epoch)
    }

    /// Every shard this process holds (open or closed) with its book.
    pub fn shard_ledgers(&self) -> impl Iterator<Item = ShardLedgerView<'_>> {
        self.shards.values().map(|slot| ShardLedgerView {
            book: &slot.book,
            reservations: &self.reservations,
        })
    }

    /// Terminal receipts and whether each was acknowledged.
    pub fn terminal_receipts(&self) -> impl Iterator<Item = (&ShardTerminalReceiptV1, bool)> {
        self.receipts.iter()
    }

    pub fn shares(&self) -> Vec<SubjectShare> {
        self.scheduler.shares()
    }

    /// The start scheduler, for inspection.
    pub fn scheduler(&self) -> &StartScheduler {
        &self.scheduler
    }

    /// The pure view behind `/metrics`.
    pub fn gauges(&self) -> AgentGauges {
        debug_assert_eq!(
            self.tally,
            RecordTally::of(self.reservations.values()),
            "the records' tally is derived from the records"
        );
        AgentGauges {
            partitioned_pairs: self.pairs.partitioned_count(),
            pending_receipts: self.receipts.unacknowledged_count(),
            reservations_in_flight: self.tally.in_flight,
            unknown: self
                .tally
                .unknown
                .iter()
                .map(|(id, state)| (id.clone(), *state))
                .collect(),
        }
    }

    /// The pure view behind `GET /v1/status`.
    pub fn status(&self) -> AgentStatus {
        let AgentGauges {
            pending_receipts,
            reservations_in_flight,
            unknown,
            ..
        } = self.gauges();
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
                .open()
                .map(|(_, slot)| ShardStatus::of(slot))
                .collect(),
            shards_closed: self.shards.closed_count(),
            pending_sync: self.tally.pending_sync,
            pending_receipts,
            reservations_in_flight,
            reservations_held: self.reservations.len(),
            reservations_retained: self.tally.ended,
            unknown,
            shares: self.scheduler.shares(),
        }
    }

    /// One page of every shard the core holds, open or closed, in ID
    /// order: at most `limit` (at least 1) whose IDs come after `after`.
    /// The view behind `GET /v1/shards`, a page at a time because the
    /// closed shards stay for the retention window (a day's by default),
    /// and a call is the daemon's thread's time.
    pub fn shards(&self, after: Option<&ShardId>, limit: usize) -> ShardPage {
        let shards: Vec<ShardStatus> = self
            .shards
            .after(after)
            .take(limit.max(1))
            .map(|(_, slot)| ShardStatus::of(slot))
            .collect();
        let next = shards
            .last()
            .map(|last| &last.shard)
            .filter(|last| self.shards.after(Some(last)).next().is_some())
            .cloned();
        ShardPage { shards, next }
    }

    // ----- outputs -----

    /// The records to commit next, in one durable transaction; then call
    /// [`Self::handle_journal_committed`] with the batch's `seq`.
    /// Group commit: every record made since the last poll goes into one
    /// batch, up to `journal_batch_max` records.
    /// A reservation's record is written as it stands now, at the place
    /// of its change (its holds before the books they change); a step
    /// that changes it several times writes it once.
    pub fn poll_journal(&mut self) -> Option<JournalBatch> {
        if self.journal_pending.is_empty() {
            return None;
        }
        let take = self
            .journal_pending
            .len()
            .min(self.config.journal_batch_max.max(1));
        let left = self.journal_pending.len() - take;
        let mut pending = std::mem::take(&mut self.journal_pending);
        let rest = pending.split_off(take);
        let records = pending
            .drain(..)
            .filter_map(|entry| match entry {
                PendingRecord::Record(record) => Some(record),
                PendingRecord::Reservation(id) => self.reservation_with_holds(&id),
            })
            .collect();
        // The emptied buffer is kept for the next records.
        self.journal_pending = if rest.is_empty() { pending } else { rest };
        Some(JournalBatch {
            seq: self.appended_seq - left as u64,
            records,
        })
    }

    /// The journal record of reservation `id` as it stands, with its holds
    /// in the books of the shards still here; `None` once it is forgotten.
    fn reservation_with_holds(&self, id: &ReservationId) -> Option<JournalRecord> {
        let record = self.reservations.get(id)?;
        let holds = record
            .shard_ids()
            .filter(|shard| self.shards.contains_key(shard))
            .filter_map(|shard| {
                let local = record.hold(shard)?;
                Some(ShardHold {
                    shard: shard.clone(),
                    local,
                })
            })
            .collect();
        Some(JournalRecord::ReservationWithHolds {
            record: Box::new(record.clone()),
            holds,
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
        if let Some(deadline) = self.usage_deadlines.next() {
            next = next.min(deadline);
        }
        if let Some(due) = self.next_forget_due() {
            next = next.min(due);
        }
        if let Some(due) = self.shards.next_work_due() {
            next = next.min(due);
        }
        (next != u64::MAX).then_some(next)
    }

    // ----- inputs -----
    // (`handle_gateway` lives in `reservations.rs`, `handle_central` in
    // `central_sync.rs`.)

    /// The journal committed every record up to `seq`.
    pub fn handle_journal_committed(&mut self, seq: u64) {
        debug_assert!(seq <= self.appended_seq);
        self.committed_seq = self.committed_seq.max(seq);
    }

    /// Time passed: deadlines, holds, shard validity, retries, probes and
    /// shard supply.
    pub fn handle_timeout(&mut self, now: Now) {
        self.observe(now);
        self.expire_usage_deadlines(now);
        self.expire_shard_holds(now);
        if now.mono_ms >= self.next_retry_ms {
            self.next_retry_ms = now.mono_ms.saturating_add(self.config.retry_interval_ms);
            self.retry(now);
        }
        self.forget_expired(now);
    }

    /// Notes the time an input brought.
    fn observe(&mut self, now: Now) {
        self.clock = now;
    }

    // ----- machinery: every output goes through here, gated on the journal
    // records made before it -----

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

    fn append(&mut self, record: JournalRecord) {
        self.push_pending(PendingRecord::Record(record));
    }

    /// Journals reservation `id` and its holds, as they stand when the
    /// batch is made: once, if the last reservation pending is `id` and no
    /// forget of a reservation came since (a step journals a hold, its
    /// book, then the reservation; the search stops at the first of them).
    fn append_reservation(&mut self, id: ReservationId) {
        let pending_already = self
            .journal_pending
            .iter()
            .rev()
            .find_map(|entry| match entry {
                PendingRecord::Reservation(pending) => Some(*pending == id),
                PendingRecord::Record(JournalRecord::Forget(JournalKey::Reservation(_))) => {
                    Some(false)
                }
                PendingRecord::Record(_) => None,
            });
        if pending_already != Some(true) {
            self.push_pending(PendingRecord::Reservation(id));
        }
    }

    fn push_pending(&mut self, entry: PendingRecord) {
        self.appended_seq += 1;
        self.journal_pending.push(entry);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! A core driven by hand, for the unit tests of every module: inputs in,
    //! the journal committed as a shell would, outputs out.

    use super::*;
    use shard_format::{Digest, IdempotencyKey, Subject, Timestamp};
    use thin_vec::ThinVec;

    pub(crate) fn at(mono_ms: u64) -> Now {
        Now {
            mono_ms,
            wall: Timestamp::from_unix_ms(1_784_469_600_000 + mono_ms).expect("valid"),
        }
    }

    /// A RESERVED record on shard `sh-1`'s path with `legs`.
    pub(crate) fn shard_record(legs: ThinVec<AgentLeg>) -> AgentReservation {
        AgentReservation {
            reservation: ReservationId::new("rl-1").expect("valid"),
            idempotency_key: IdempotencyKey::new("key-1").expect("valid"),
            subject: Subject::new("tenant-a").expect("valid"),
            route: Route::new("chat.generate").expect("valid"),
            units: 10,
            min_units: None,
            reserved_units: None,
            request_digest: Digest::sha256(b"request"),
            priority: 0,
            deadline_ms: None,
            path: ReservationPath::Shard(ShardId::new("sh-1").expect("valid")),
            state: AgentState::Reserved,
            operation_id: None,
            actual_units: None,
            receipt: None,
            settlement: None,
            rejection: None,
            sync: None,
            cancel_requested: false,
            shadow: false,
            boot_epoch: 1,
            ended_at: None,
            legs,
            hold_state: None,
            hold_expires_at_ms: 0,
            hold_overdraft_units: 0,
        }
    }

    /// A terminal receipt of shard `shard`, closed at `closed_at_ms` (Unix
    /// ms), unsigned.
    pub(crate) fn terminal_receipt(shard: &str, closed_at_ms: u64) -> ShardTerminalReceiptV1 {
        let gateway = shard_format::KeyId::new("test:gateway").expect("valid");
        ShardTerminalReceiptV1 {
            schema: Default::default(),
            shard: ShardId::new(shard).expect("valid"),
            subject: Subject::new("tenant-7").expect("valid"),
            route: Route::new("chat.generate").expect("valid"),
            gateway_identity: gateway.clone(),
            boot_epoch: 1,
            allocated_units: 10,
            spent_units: 4,
            confirmed_unused_units: 6,
            unknown_units: 0,
            overdraft_debt_units: 0,
            reason: shard_format::ShardCloseReason::Restart,
            closed_at: Timestamp::from_unix_ms(closed_at_ms).expect("valid"),
            key_id: gateway,
            signature: shard_format::Signature::UNSIGNED,
        }
    }

    /// A new process with an empty journal at `mono_ms`.
    pub(crate) fn new_core(mono_ms: u64, configure: impl FnOnce(&mut AgentConfig)) -> AgentCore {
        recovered(mono_ms, configure, Vec::new())
    }

    /// A process started at `mono_ms` from `journal`.
    pub(crate) fn recovered(
        mono_ms: u64,
        configure: impl FnOnce(&mut AgentConfig),
        journal: impl IntoIterator<Item = JournalRecord>,
    ) -> AgentCore {
        let signer = shard_format::Ed25519Signer::from_secret_bytes(&[1; 32]);
        let mut config = AgentConfig::new(DocumentSigner::key_id(&signer).clone());
        configure(&mut config);
        AgentCore::recover(
            config,
            Box::new(signer),
            Box::new(shard_format::Ed25519Verifier::new([])),
            journal,
            at(mono_ms),
        )
    }

    /// Commits every pending batch, as a shell does after each input.
    pub(crate) fn commit(core: &mut AgentCore) {
        while let Some(batch) = core.poll_journal() {
            core.handle_journal_committed(batch.seq);
        }
    }

    /// The central calls released once the journal is committed.
    pub(crate) fn calls(core: &mut AgentCore) -> Vec<OutgoingCall> {
        commit(core);
        core.poll_central_batch(usize::MAX)
    }

    /// The gateway answers released once the journal is committed.
    pub(crate) fn replies(core: &mut AgentCore) -> Vec<(CallId, GatewayResponse)> {
        commit(core);
        std::iter::from_fn(|| core.poll_reply()).collect()
    }

    /// A new process whose registration the center answered at `mono_ms`.
    pub(crate) fn registered(mono_ms: u64, configure: impl FnOnce(&mut AgentConfig)) -> AgentCore {
        let mut core = new_core(mono_ms, configure);
        register(&mut core, mono_ms);
        core
    }

    /// Answers a new process's registration, its only call, at `mono_ms`.
    pub(crate) fn register(core: &mut AgentCore, mono_ms: u64) {
        let sent = calls(core);
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].call, CentralCall::Register);
        core.handle_central(
            sent[0].request,
            CentralResult::Reply(CentralReply::Registered {
                boot_epoch: 1,
                boot_nonce: BootNonce([7; 16]),
            }),
            at(mono_ms),
        );
    }

    pub(crate) fn reserve(key: &str, units: u64) -> GatewayRequest {
        GatewayRequest::Reserve(GatewayReserve {
            idempotency_key: IdempotencyKey::new(key).expect("valid"),
            subject: Subject::new("tenant-7").expect("valid"),
            route: Route::new("chat.generate").expect("valid"),
            units,
            min_units: None,
            deadline_ms: None,
            priority: None,
            request: None,
            more_legs: Vec::new(),
        })
    }

    /// The one call of `sent` matching `kind`.
    pub(crate) fn the_call(
        sent: &[OutgoingCall],
        kind: impl Fn(&CentralCall) -> bool,
    ) -> RequestId {
        let matching: Vec<_> = sent.iter().filter(|call| kind(&call.call)).collect();
        assert_eq!(matching.len(), 1, "{sent:?}");
        matching[0].request
    }

    #[test]
    fn a_new_process_wakes_at_once_to_register() {
        let core = new_core(5_000, |_| {});
        assert_eq!(core.poll_timeout(), Some(5_000));
    }

    #[test]
    fn a_registered_process_with_nothing_to_do_sets_no_timer() {
        let mut core = registered(5_000, |_| {});
        assert!(calls(&mut core).is_empty());
        assert_eq!(core.poll_timeout(), None);
    }

    /// The timer keeps its answer for the shard requests only while no
    /// pair comes or changes: a new pair's request is due at once.
    #[test]
    fn a_new_pair_wakes_the_timer_for_its_shard_request() {
        let mut core = registered(5_000, |_| {});
        assert_eq!(core.poll_timeout(), None, "no pair yet");
        assert_eq!(core.kept_shard_due(1), Some(None), "the answer is kept");
        core.handle_gateway(1, reserve("k-1", 10), at(5_000));
        assert_eq!(core.kept_shard_due(1), None, "a pair came: not kept");
        let sent = calls(&mut core);
        let request = the_call(&sent, |call| matches!(call, CentralCall::Reserve(_)));
        let rejection = ledger::Rejection {
            dimension: ledger::Dimension::Capacity,
            policy_generation: 1,
            retry_after_seconds: None,
            rate_limit: None,
        };
        let reply = CentralReply::Rejected(rejection);
        core.handle_central(request, CentralResult::Reply(reply), at(5_000));
        assert!(!core.has_retry_work(), "the reserve was answered");
        // Due now, but the retry timer asks at most once an interval.
        assert_eq!(core.poll_timeout(), Some(core.next_retry_ms));
        core.handle_timeout(at(core.next_retry_ms));
        let sent = calls(&mut core);
        the_call(&sent, |call| matches!(call, CentralCall::IssueShard { .. }));
    }

    #[test]
    fn batches_are_numbered_by_their_last_record_and_gate_the_calls_made_after_them() {
        let mut core = registered(0, |config| config.journal_batch_max = 1);
        assert!(!core.has_pending_journal(), "registration journals nothing");
        core.handle_gateway(1, reserve("k-1", 10), at(0));
        core.handle_gateway(2, reserve("k-2", 10), at(0));
        assert!(core.has_pending_journal());
        assert_eq!(
            core.poll_central(),
            None,
            "nothing sent before its record is durable"
        );
        let first = core.poll_journal().expect("a batch");
        assert_eq!((first.seq, first.records.len()), (1, 1));
        assert!(core.has_pending_journal(), "one record left");
        core.handle_journal_committed(first.seq);
        assert!(core.poll_central().is_some(), "the first reserve goes");
        assert_eq!(core.poll_central(), None, "the second waits for its record");
        let second = core.poll_journal().expect("a batch");
        assert_eq!((second.seq, second.records.len()), (2, 1));
        assert!(!core.has_pending_journal());
        core.handle_journal_committed(second.seq);
        assert!(core.poll_central().is_some());
    }

    #[test]
    fn an_answer_waits_until_the_record_made_before_it_is_committed() {
        let mut core = registered(0, |_| {});
        core.handle_gateway(1, reserve("k-1", 10), at(0));
        let sent = calls(&mut core);
        core.handle_central(sent[0].request, CentralResult::OutcomeUnknown, at(0));
        // The unknown outcome is journaled; the answer waits for it.
        assert_eq!(core.poll_reply(), None);
        let batch = core.poll_journal().expect("the unknown record");
        assert_eq!(core.poll_reply(), None, "polled is not committed");
        core.handle_journal_committed(batch.seq);
        let (call, response) = core.poll_reply().expect("released");
        assert_eq!(call, 1);
        assert!(
            matches!(
                response,
                GatewayResponse::Unavailable {
                    code: ledger::protocol::ErrorCode::ReservationUnknown,
                    ..
                }
            ),
            "{response:?}"
        );
    }
}
