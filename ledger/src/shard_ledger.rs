//! An agent's local book of one emergency shard:
//!
//! ```text
//! allocated = localAvailable + localReserved + localSpent + localRetired
//! ```
//!
//! Overage beyond `localAvailable` has no column: it is kept as receipt debt,
//! pauses local admission for the pair, and travels in the terminal receipt.
//! Closing the shard retires everything not spent: available units as
//! *confirmed unused*, in-flight units as *unknown* (never counted as
//! unconsumed). A closed shard admits nothing and changes no more.
//!
//! Local time (`now_ms`) is the agent's monotonic clock in milliseconds.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use shard_format::{
    EmergencyShardV1, OperationId, ReservationId, ReservationState, ShardCloseReason,
    ShardTerminalReceiptSchema, ShardTerminalReceiptV1, Signature, Timestamp,
};

use crate::IdMap;
use crate::invariants::check_shard;
use crate::terms::{Overflow, ShardTerms, add, sub};

/// One reservation made against a shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LocalReservation {
    pub reservation: ReservationId,
    pub units: u64,
    pub state: ReservationState,
    pub operation_id: Option<OperationId>,
    /// Monotonic ms after which a still-`RESERVED` item expires.
    pub expires_at_ms: u64,
    pub actual_units: Option<u64>,
    /// Usage beyond the shard that this settlement turned into debt.
    pub overdraft_units: u64,
}

/// A reservation as [`ShardLedger`] keeps it: a [`LocalReservation`]
/// without its ID, which is the map's key, and with its actual usage in one
/// word (56 bytes of a hash table's slot where the public form takes 72).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hold {
    units: u64,
    expires_at_ms: u64,
    overdraft_units: u64,
    /// The usage settled, when `settled`.
    actual_units: u64,
    operation_id: Option<OperationId>,
    state: ReservationState,
    settled: bool,
}

impl Hold {
    fn of(reservation: LocalReservation) -> (ReservationId, Self) {
        let LocalReservation {
            reservation,
            units,
            state,
            operation_id,
            expires_at_ms,
            actual_units,
            overdraft_units,
        } = reservation;
        let hold = Self {
            units,
            expires_at_ms,
            overdraft_units,
            actual_units: actual_units.unwrap_or(0),
            operation_id,
            state,
            settled: actual_units.is_some(),
        };
        (reservation, hold)
    }

    fn local(&self, id: &ReservationId) -> LocalReservation {
        LocalReservation {
            reservation: id.clone(),
            units: self.units,
            state: self.state,
            operation_id: self.operation_id.clone(),
            expires_at_ms: self.expires_at_ms,
            actual_units: self.settled.then_some(self.actual_units),
            overdraft_units: self.overdraft_units,
        }
    }
}

/// How and when the shard was closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ShardClosure {
    pub reason: ShardCloseReason,
    pub closed_at: Timestamp,
    pub confirmed_unused_units: u64,
    pub unknown_units: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardReserveOutcome {
    Reserved(LocalReservation),
    Duplicate(LocalReservation),
    /// Not enough `localAvailable`.
    Capacity {
        local_available: u64,
    },
    /// Local overage left debt: admission is paused until reconciliation.
    Paused,
    Closed,
    InvalidUnits,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardStartOutcome {
    Started(LocalReservation),
    Duplicate(LocalReservation),
    NotFound,
    OperationConflict {
        bound: OperationId,
    },
    /// The hold ran out before the start; the units are back.
    Expired(LocalReservation),
    IllegalState(ReservationState),
    Closed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardSettleOutcome {
    Settled(LocalReservation),
    Duplicate(LocalReservation),
    NotFound,
    OperationConflict {
        bound: OperationId,
    },
    SettlementConflict(LocalReservation),
    NotStarted(ReservationState),
    IllegalState(ReservationState),
    /// The shard was closed: its book is final; the usage stays unknown to
    /// the shard (its units were retired as unknown).
    Closed,
    Overflow(Overflow),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardReleaseOutcome {
    Released(LocalReservation),
    Duplicate(LocalReservation),
    NotFound,
    IllegalState(ReservationState),
    Closed,
}

/// One record to journal for a shard book.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind", content = "record")]
pub enum ShardChange {
    /// The book's terms, debt and closure.
    Book {
        terms: ShardTerms,
        overdraft_debt: u64,
        closure: Option<ShardClosure>,
    },
    Reservation(LocalReservation),
}

/// A shard operation's outcome and the records to journal together.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "the changes must be journaled before the outcome is acted on"]
pub struct ShardTransition<O> {
    pub outcome: O,
    pub changes: Vec<ShardChange>,
}

/// The local book of one shard, without its holds: the terms, the debt,
/// the closure and the rules. The caller keeps each reservation's hold
/// (an agent keeps it in the reservation's own record, so an open
/// reservation is one record, not a record and a hold), passes it in as
/// it stands, and keeps every [`ShardChange::Reservation`] a transition
/// returns as the hold's new value. [`ShardLedger`] is a book that keeps
/// its holds itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardBook {
    shard: EmergencyShardV1,
    terms: ShardTerms,
    overdraft_debt: u64,
    closure: Option<ShardClosure>,
    /// `(expires_at_ms, id)` of every RESERVED hold, so that finding and
    /// expiring due holds does not scan the settled ones too.
    reserved_expiries: BTreeSet<(u64, ReservationId)>,
    /// Every STARTED hold: with the RESERVED ones, the holds that a close
    /// ends ([`ShardBook::open_holds`]), found without the holder's records.
    started: BTreeSet<ReservationId>,
    pending: Vec<ShardChange>,
}

impl ShardBook {
    /// A fresh book for an accepted shard: everything available. The caller
    /// journals the returned change with the shard.
    pub fn open(shard: EmergencyShardV1) -> (Self, ShardChange) {
        let terms = ShardTerms::allocate(shard.allocated_units);
        let book = Self {
            shard,
            terms,
            overdraft_debt: 0,
            closure: None,
            reserved_expiries: BTreeSet::new(),
            started: BTreeSet::new(),
            pending: Vec::new(),
        };
        let change = book.book_change();
        (book, change)
    }

    /// Rebuilds a book from its journaled records (later replace earlier),
    /// with the holds they name, for the caller to keep.
    pub fn from_records(
        shard: EmergencyShardV1,
        records: impl IntoIterator<Item = ShardChange>,
    ) -> Result<(Self, IdMap<ReservationId, LocalReservation>), Box<crate::invariants::Violation>>
    {
        let (mut book, _) = Self::open(shard);
        let mut holds = IdMap::default();
        for change in records {
            match change {
                ShardChange::Book {
                    terms,
                    overdraft_debt,
                    closure,
                } => {
                    book.terms = terms;
                    book.overdraft_debt = overdraft_debt;
                    book.closure = closure;
                }
                ShardChange::Reservation(reservation) => {
                    holds.insert(reservation.reservation.clone(), reservation);
                }
            }
        }
        book.reserved_expiries = holds
            .values()
            .filter(|hold| hold.state == ReservationState::Reserved)
            .map(|hold| (hold.expires_at_ms, hold.reservation.clone()))
            .collect();
        book.started = holds
            .values()
            .filter(|hold| hold.state == ReservationState::Started)
            .map(|hold| hold.reservation.clone())
            .collect();
        match check_shard(&book.shard.shard, &book.terms) {
            Some(violation) => Err(Box::new(violation)),
            None => Ok((book, holds)),
        }
    }

    // ----- views -----

    pub fn shard(&self) -> &EmergencyShardV1 {
        &self.shard
    }

    pub fn terms(&self) -> &ShardTerms {
        &self.terms
    }

    pub fn overdraft_debt(&self) -> u64 {
        self.overdraft_debt
    }

    /// Local overage left debt: no local admission until reconciled.
    pub fn is_paused(&self) -> bool {
        self.overdraft_debt > 0
    }

    pub fn closure(&self) -> Option<&ShardClosure> {
        self.closure.as_ref()
    }

    pub fn is_closed(&self) -> bool {
        self.closure.is_some()
    }

    /// When the earliest RESERVED hold expires.
    pub fn next_expiry_ms(&self) -> Option<u64> {
        self.reserved_expiries.first().map(|(at, _)| *at)
    }

    /// How many holds are RESERVED, for a caller's check of its holds.
    pub fn reserved_holds(&self) -> usize {
        self.reserved_expiries.len()
    }

    /// How many holds are STARTED, for a caller's check of its holds.
    pub fn started_holds(&self) -> usize {
        self.started.len()
    }

    /// The IDs of the RESERVED and STARTED holds, in no particular order:
    /// the reservations a close of the shard ends.
    pub fn open_holds(&self) -> impl Iterator<Item = &ReservationId> {
        self.reserved_expiries
            .iter()
            .map(|(_, id)| id)
            .chain(&self.started)
    }

    // ----- operations -----

    /// A flexible reserve: grants the largest amount from `min_units` to
    /// `units` that `localAvailable` covers (`min_units == units` is an
    /// exact reserve). `existing` is the hold already under `id`, if any.
    pub fn reserve_between(
        &mut self,
        existing: Option<LocalReservation>,
        id: ReservationId,
        min_units: u64,
        units: u64,
        hold_ms: u64,
        now_ms: u64,
    ) -> ShardTransition<ShardReserveOutcome> {
        if let Some(existing) = existing {
            return self.finish(ShardReserveOutcome::Duplicate(existing));
        }
        if self.is_closed() {
            return self.finish(ShardReserveOutcome::Closed);
        }
        if units == 0
            || units > shard_format::limits::UNITS_MAX
            || min_units == 0
            || min_units > units
        {
            return self.finish(ShardReserveOutcome::InvalidUnits);
        }
        if self.is_paused() {
            return self.finish(ShardReserveOutcome::Paused);
        }
        if self.terms.local_available < min_units {
            let local_available = self.terms.local_available;
            return self.finish(ShardReserveOutcome::Capacity { local_available });
        }
        // After this point, the reservation must succeed.
        let granted = units.min(self.terms.local_available);
        self.terms.local_available -= granted;
        self.terms.local_reserved += granted;
        let reservation = LocalReservation {
            reservation: id,
            units: granted,
            state: ReservationState::Reserved,
            operation_id: None,
            expires_at_ms: now_ms.saturating_add(hold_ms),
            actual_units: None,
            overdraft_units: 0,
        };
        self.put_reservation(reservation.clone());
        self.put_book();
        self.finish(ShardReserveOutcome::Reserved(reservation))
    }

    /// Starts the hold `current` (`None`: there is none).
    pub fn start(
        &mut self,
        current: Option<LocalReservation>,
        operation_id: OperationId,
        now_ms: u64,
    ) -> ShardTransition<ShardStartOutcome> {
        let Some(mut reservation) = current else {
            return self.finish(ShardStartOutcome::NotFound);
        };
        if let Some(bound) = &reservation.operation_id {
            let outcome = if *bound == operation_id {
                ShardStartOutcome::Duplicate(reservation)
            } else {
                ShardStartOutcome::OperationConflict {
                    bound: bound.clone(),
                }
            };
            return self.finish(outcome);
        }
        if self.is_closed() {
            return self.finish(ShardStartOutcome::Closed);
        }
        match reservation.state {
            ReservationState::Reserved if now_ms < reservation.expires_at_ms => {}
            ReservationState::Reserved => {
                let expired = self.refund(reservation, ReservationState::Expired);
                return self.finish(ShardStartOutcome::Expired(expired));
            }
            ReservationState::Expired => {
                return self.finish(ShardStartOutcome::Expired(reservation));
            }
            other => return self.finish(ShardStartOutcome::IllegalState(other)),
        }
        reservation.state = ReservationState::Started;
        reservation.operation_id = Some(operation_id);
        self.put_reservation(reservation.clone());
        self.finish(ShardStartOutcome::Started(reservation))
    }

    /// Settles the started hold `current`. Overage takes `localAvailable`
    /// first; the rest is receipt debt and pauses the shard.
    pub fn settle(
        &mut self,
        current: Option<LocalReservation>,
        operation_id: &OperationId,
        actual_units: u64,
    ) -> ShardTransition<ShardSettleOutcome> {
        let Some(mut reservation) = current else {
            return self.finish(ShardSettleOutcome::NotFound);
        };
        if let Some(bound) = &reservation.operation_id
            && bound != operation_id
        {
            return self.finish(ShardSettleOutcome::OperationConflict {
                bound: bound.clone(),
            });
        }
        if actual_units > shard_format::limits::UNITS_MAX {
            return self.finish(ShardSettleOutcome::Overflow(Overflow));
        }
        if let Some(settled) = reservation.actual_units {
            let outcome = if settled == actual_units {
                ShardSettleOutcome::Duplicate(reservation)
            } else {
                ShardSettleOutcome::SettlementConflict(reservation)
            };
            return self.finish(outcome);
        }
        if self.is_closed() {
            return self.finish(ShardSettleOutcome::Closed);
        }
        match reservation.state {
            ReservationState::Started | ReservationState::UsageUnknown => {}
            ReservationState::Reserved => {
                return self.finish(ShardSettleOutcome::NotStarted(ReservationState::Reserved));
            }
            other => return self.finish(ShardSettleOutcome::IllegalState(other)),
        }
        let mut terms = self.terms;
        let mut debt = self.overdraft_debt;
        let reserved = reservation.units;
        let result = (|| {
            terms.local_reserved = sub(terms.local_reserved, reserved)?;
            if actual_units <= reserved {
                terms.local_spent = add(terms.local_spent, actual_units)?;
                terms.local_available = add(terms.local_available, reserved - actual_units)?;
                Ok(0)
            } else {
                let overage = actual_units - reserved;
                let from_available = overage.min(terms.local_available);
                terms.local_available -= from_available;
                terms.local_spent = add(terms.local_spent, add(reserved, from_available)?)?;
                let overdraft = overage - from_available;
                debt = add(debt, overdraft)?;
                if debt > shard_format::limits::UNITS_MAX {
                    return Err(Overflow);
                }
                Ok(overdraft)
            }
        })();
        let overdraft = match result {
            Ok(overdraft) => overdraft,
            Err(overflow) => return self.finish(ShardSettleOutcome::Overflow(overflow)),
        };
        // After this point, the settlement must succeed.
        self.terms = terms;
        self.overdraft_debt = debt;
        reservation.state = if overdraft > 0 {
            ReservationState::SettledWithDebt
        } else {
            ReservationState::Settled
        };
        reservation.actual_units = Some(actual_units);
        reservation.overdraft_units = overdraft;
        self.put_reservation(reservation.clone());
        self.put_book();
        self.finish(ShardSettleOutcome::Settled(reservation))
    }

    /// Releases the unstarted hold `current`.
    pub fn release(
        &mut self,
        current: Option<LocalReservation>,
    ) -> ShardTransition<ShardReleaseOutcome> {
        let Some(reservation) = current else {
            return self.finish(ShardReleaseOutcome::NotFound);
        };
        match reservation.state {
            ReservationState::Released => {
                return self.finish(ShardReleaseOutcome::Duplicate(reservation));
            }
            _ if self.is_closed() => return self.finish(ShardReleaseOutcome::Closed),
            ReservationState::Reserved => {}
            other => return self.finish(ShardReleaseOutcome::IllegalState(other)),
        }
        let released = self.refund(reservation, ReservationState::Released);
        self.finish(ShardReleaseOutcome::Released(released))
    }

    /// Expires every `RESERVED` hold whose time ran out; returns their IDs.
    /// `hold` gives the hold under an ID, as it stands.
    pub fn expire_due(
        &mut self,
        now_ms: u64,
        hold: impl Fn(&ReservationId) -> Option<LocalReservation>,
    ) -> ShardTransition<Vec<ReservationId>> {
        if self.is_closed() {
            return self.finish(Vec::new());
        }
        let due: Vec<(u64, ReservationId)> = self
            .reserved_expiries
            .iter()
            .take_while(|(at, _)| *at <= now_ms)
            .cloned()
            .collect();
        let mut ids = Vec::with_capacity(due.len());
        for (at, id) in due {
            match hold(&id) {
                Some(reservation) => {
                    self.refund(reservation, ReservationState::Expired);
                    ids.push(id);
                }
                // A hold the caller no longer keeps cannot be refunded: its
                // units stay reserved, to retire as unknown when the shard
                // closes. Only its index entry goes, or it is due forever.
                None => {
                    debug_assert!(false, "the caller lost RESERVED hold {id}");
                    self.reserved_expiries.remove(&(at, id));
                }
            }
        }
        self.finish(ids)
    }

    /// A started hold's executor outcome is unknown (its deadline passed):
    /// `STARTED → USAGE_UNKNOWN`; its units stay reserved.
    pub fn mark_usage_unknown(
        &mut self,
        current: Option<LocalReservation>,
    ) -> ShardTransition<bool> {
        match current {
            Some(mut reservation)
                if reservation.state == ReservationState::Started && !self.is_closed() =>
            {
                reservation.state = ReservationState::UsageUnknown;
                self.put_reservation(reservation);
                self.finish(true)
            }
            _ => self.finish(false),
        }
    }

    /// Closes the shard: available → retired as confirmed unused, reserved
    /// (in flight, whatever its state) → retired as unknown. Idempotent: a
    /// closed shard keeps its first closure.
    pub fn close(
        &mut self,
        reason: ShardCloseReason,
        closed_at: Timestamp,
    ) -> ShardTransition<ShardClosure> {
        if let Some(closure) = self.closure {
            return self.finish(closure);
        }
        let closure = ShardClosure {
            reason,
            closed_at,
            confirmed_unused_units: self.terms.local_available,
            unknown_units: self.terms.local_reserved,
        };
        // Retired never exceeds allocated, so this cannot overflow.
        self.terms.local_retired += self.terms.local_available + self.terms.local_reserved;
        self.terms.local_available = 0;
        self.terms.local_reserved = 0;
        self.closure = Some(closure);
        self.put_book();
        self.finish(closure)
    }

    /// The terminal receipt of a closed shard, unsigned: the agent signs it
    /// with its identity key. `None` while the shard is open.
    pub fn terminal_receipt(&self) -> Option<ShardTerminalReceiptV1> {
        let closure = self.closure?;
        Some(ShardTerminalReceiptV1 {
            schema: ShardTerminalReceiptSchema,
            shard: self.shard.shard.clone(),
            subject: self.shard.subject.clone(),
            route: self.shard.route.clone(),
            gateway_identity: self.shard.gateway_identity.clone(),
            boot_epoch: self.shard.boot_epoch,
            allocated_units: self.terms.allocated,
            spent_units: self.terms.local_spent,
            confirmed_unused_units: closure.confirmed_unused_units,
            unknown_units: closure.unknown_units,
            overdraft_debt_units: self.overdraft_debt,
            reason: closure.reason,
            closed_at: closure.closed_at,
            key_id: self.shard.gateway_identity.clone(),
            signature: Signature::UNSIGNED,
        })
    }

    // ----- machinery -----

    /// Puts an unstarted reservation's units back and moves it to `state`.
    fn refund(
        &mut self,
        mut reservation: LocalReservation,
        state: ReservationState,
    ) -> LocalReservation {
        debug_assert_eq!(reservation.state, ReservationState::Reserved);
        self.terms.local_reserved -= reservation.units;
        self.terms.local_available += reservation.units;
        reservation.state = state;
        self.put_reservation(reservation.clone());
        self.put_book();
        reservation
    }

    fn book_change(&self) -> ShardChange {
        ShardChange::Book {
            terms: self.terms,
            overdraft_debt: self.overdraft_debt,
            closure: self.closure,
        }
    }

    fn put_book(&mut self) {
        let change = self.book_change();
        self.pending
            .retain(|c| !matches!(c, ShardChange::Book { .. }));
        self.pending.push(change);
    }

    /// Records a hold's new value for the caller and keeps the indexes: a
    /// hold's expiry never changes, so it is indexed while the hold is
    /// RESERVED and not after; a STARTED hold is listed while it is.
    fn put_reservation(&mut self, reservation: LocalReservation) {
        let entry = (reservation.expires_at_ms, reservation.reservation.clone());
        if reservation.state == ReservationState::Reserved {
            self.reserved_expiries.insert(entry);
        } else {
            self.reserved_expiries.remove(&entry);
        }
        if reservation.state == ReservationState::Started {
            self.started.insert(reservation.reservation.clone());
        } else {
            self.started.remove(&reservation.reservation);
        }
        self.pending.push(ShardChange::Reservation(reservation));
    }

    fn finish<O>(&mut self, outcome: O) -> ShardTransition<O> {
        // Release builds too: four additions, and an agent must never admit
        // from a book whose equation broke (a crash, then recovery, closes it).
        if let Some(violation) = check_shard(&self.shard.shard, &self.terms) {
            panic!("shard invariant broken by a transition: {violation}");
        }
        ShardTransition {
            outcome,
            changes: std::mem::take(&mut self.pending),
        }
    }
}

/// A shard's book with its holds: [`ShardBook`] keeping every hold made
/// against the shard in a map of its own, for callers that keep no
/// records of their own (the ledger's tests, tools).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLedger {
    book: ShardBook,
    holds: IdMap<ReservationId, Hold>,
}

impl ShardLedger {
    /// A fresh book for an accepted shard: everything available. The caller
    /// journals the returned change with the shard.
    pub fn open(shard: EmergencyShardV1) -> (Self, ShardChange) {
        let (book, change) = ShardBook::open(shard);
        let ledger = Self {
            book,
            holds: IdMap::default(),
        };
        (ledger, change)
    }

    /// Rebuilds a book from its journaled records (later replace earlier).
    pub fn from_records(
        shard: EmergencyShardV1,
        records: impl IntoIterator<Item = ShardChange>,
    ) -> Result<Self, Box<crate::invariants::Violation>> {
        let (book, holds) = ShardBook::from_records(shard, records)?;
        let holds = holds.into_values().map(Hold::of).collect();
        Ok(Self { book, holds })
    }

    // ----- views -----

    /// The book without its holds.
    pub fn book(&self) -> &ShardBook {
        &self.book
    }

    pub fn shard(&self) -> &EmergencyShardV1 {
        self.book.shard()
    }

    pub fn terms(&self) -> &ShardTerms {
        self.book.terms()
    }

    pub fn overdraft_debt(&self) -> u64 {
        self.book.overdraft_debt()
    }

    /// Local overage left debt: no local admission until reconciled.
    pub fn is_paused(&self) -> bool {
        self.book.is_paused()
    }

    pub fn closure(&self) -> Option<&ShardClosure> {
        self.book.closure()
    }

    pub fn is_closed(&self) -> bool {
        self.book.is_closed()
    }

    pub fn reservation(&self, id: &ReservationId) -> Option<LocalReservation> {
        self.holds.get(id).map(|hold| hold.local(id))
    }

    /// Every reservation made against the shard, in no particular order.
    pub fn reservations(&self) -> impl Iterator<Item = LocalReservation> + '_ {
        self.holds.iter().map(|(id, hold)| hold.local(id))
    }

    /// When the earliest RESERVED hold expires.
    pub fn next_expiry_ms(&self) -> Option<u64> {
        self.book.next_expiry_ms()
    }

    /// The terminal receipt of a closed shard, unsigned (see
    /// [`ShardBook::terminal_receipt`]).
    pub fn terminal_receipt(&self) -> Option<ShardTerminalReceiptV1> {
        self.book.terminal_receipt()
    }

    // ----- operations: the book's, with the holds looked up and kept -----

    /// Reserves exactly `units`.
    pub fn reserve(
        &mut self,
        id: ReservationId,
        units: u64,
        hold_ms: u64,
        now_ms: u64,
    ) -> ShardTransition<ShardReserveOutcome> {
        self.reserve_between(id, units, units, hold_ms, now_ms)
    }

    /// See [`ShardBook::reserve_between`].
    pub fn reserve_between(
        &mut self,
        id: ReservationId,
        min_units: u64,
        units: u64,
        hold_ms: u64,
        now_ms: u64,
    ) -> ShardTransition<ShardReserveOutcome> {
        let existing = self.reservation(&id);
        let transition = self
            .book
            .reserve_between(existing, id, min_units, units, hold_ms, now_ms);
        self.keep(transition)
    }

    pub fn start(
        &mut self,
        id: &ReservationId,
        operation_id: OperationId,
        now_ms: u64,
    ) -> ShardTransition<ShardStartOutcome> {
        let current = self.reservation(id);
        let transition = self.book.start(current, operation_id, now_ms);
        self.keep(transition)
    }

    /// See [`ShardBook::settle`].
    pub fn settle(
        &mut self,
        id: &ReservationId,
        operation_id: &OperationId,
        actual_units: u64,
    ) -> ShardTransition<ShardSettleOutcome> {
        let current = self.reservation(id);
        let transition = self.book.settle(current, operation_id, actual_units);
        self.keep(transition)
    }

    pub fn release(&mut self, id: &ReservationId) -> ShardTransition<ShardReleaseOutcome> {
        let current = self.reservation(id);
        let transition = self.book.release(current);
        self.keep(transition)
    }

    /// Expires every `RESERVED` item whose hold ran out; returns their IDs.
    pub fn expire_due(&mut self, now_ms: u64) -> ShardTransition<Vec<ReservationId>> {
        let holds = &self.holds;
        let transition = self
            .book
            .expire_due(now_ms, |id| holds.get(id).map(|hold| hold.local(id)));
        self.keep(transition)
    }

    /// See [`ShardBook::mark_usage_unknown`].
    pub fn mark_usage_unknown(&mut self, id: &ReservationId) -> ShardTransition<bool> {
        let current = self.reservation(id);
        let transition = self.book.mark_usage_unknown(current);
        self.keep(transition)
    }

    /// See [`ShardBook::close`].
    pub fn close(
        &mut self,
        reason: ShardCloseReason,
        closed_at: Timestamp,
    ) -> ShardTransition<ShardClosure> {
        let transition = self.book.close(reason, closed_at);
        self.keep(transition)
    }

    /// Keeps the holds a transition changed.
    fn keep<O>(&mut self, transition: ShardTransition<O>) -> ShardTransition<O> {
        for change in &transition.changes {
            if let ShardChange::Reservation(reservation) = change {
                let (id, hold) = Hold::of(reservation.clone());
                self.holds.insert(id, hold);
            }
        }
        debug_assert_eq!(
            self.book.reserved_holds(),
            self.holds
                .values()
                .filter(|hold| hold.state == ReservationState::Reserved)
                .count(),
            "the expiry index lists exactly the RESERVED holds"
        );
        transition
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hash table's slot is the key and the value side by side; a book
    /// has one per reservation made against its shard.
    #[test]
    fn a_hold_and_its_id_take_56_bytes_of_a_slot() {
        assert!(
            size_of::<(ReservationId, Hold)>() <= 56,
            "{} bytes",
            size_of::<(ReservationId, Hold)>()
        );
    }

    #[test]
    fn a_hold_gives_back_the_reservation_it_was_made_of() {
        let id = ReservationId::new("rl-7").expect("valid");
        let operation = OperationId::new("op-7").expect("valid");
        for (state, operation_id, actual_units) in [
            (ReservationState::Reserved, None, None),
            (ReservationState::Started, Some(operation.clone()), None),
            // Zero used is a settlement, not an absent one.
            (ReservationState::Settled, Some(operation.clone()), Some(0)),
            (ReservationState::SettledWithDebt, Some(operation), Some(12)),
        ] {
            let reservation = LocalReservation {
                reservation: id.clone(),
                units: 10,
                state,
                operation_id,
                expires_at_ms: 5_000,
                actual_units,
                overdraft_units: actual_units.map_or(0, |actual| actual.saturating_sub(10)),
            };
            let (key, hold) = Hold::of(reservation.clone());
            assert_eq!(key, id);
            assert_eq!(hold.local(&key), reservation);
        }
    }
}
