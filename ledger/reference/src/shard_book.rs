//! A reference of the agent's shard book (docs/design.md §5.4–§5.6): the
//! book's terms recomputed from the reservations' own transitions, as an
//! agent journals them, and compared with every book the agent journals.
//!
//! It follows the records rather than the operations: each reservation
//! record moves the reference's terms by the rule its transition names
//! (reserve, release or expiry, settlement with its overage), and each
//! book record must then equal the reference's. A settlement's overdraft
//! is recomputed, not read: overage takes `localAvailable` first, only the
//! rest is receipt debt — so a book whose equation balances but whose
//! arithmetic is wrong is caught too.

use std::collections::BTreeMap;

use ledger::{LocalReservation, ShardClosure, ShardTerms};
use shard_format::{ReservationId, ReservationState, ShardTerminalReceiptV1};

/// The reference book of one shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReferenceShardBook {
    terms: ShardTerms,
    overdraft_debt: u64,
    closure: Option<(u64, u64)>,
    reservations: BTreeMap<ReservationId, LocalReservation>,
}

/// What holds units in `localReserved`.
fn holds(state: ReservationState) -> bool {
    matches!(
        state,
        ReservationState::Reserved | ReservationState::Started | ReservationState::UsageUnknown
    )
}

impl ReferenceShardBook {
    /// A book as a journal holds it: its last book record, taken as given
    /// (a new shard's first record, or the state an agent recovers from).
    pub fn adopt(terms: ShardTerms, overdraft_debt: u64, closure: Option<ShardClosure>) -> Self {
        Self {
            terms,
            overdraft_debt,
            closure: closure.map(|c| (c.confirmed_unused_units, c.unknown_units)),
            reservations: BTreeMap::new(),
        }
    }

    /// A reservation record as recovered (no transition to check).
    pub fn adopt_reservation(&mut self, reservation: LocalReservation) {
        self.reservations
            .insert(reservation.reservation.clone(), reservation);
    }

    /// A reservation record forgotten by retention: the terms stay.
    pub fn forget_reservation(&mut self, id: &ReservationId) {
        self.reservations.remove(id);
    }

    /// Applies the transition a reservation record shows, from the
    /// reservation's previous record (none for a new reservation). Errors
    /// name what broke a rule.
    pub fn observe_reservation(&mut self, record: &LocalReservation) -> Result<(), String> {
        let previous = self.reservations.get(&record.reservation).cloned();
        let from = previous.as_ref().map(|r| r.state);
        let units = record.units;
        if previous.as_ref().is_some_and(|p| p.units != units) {
            return Err(format!(
                "{}: units changed from {:?} to {units}",
                record.reservation,
                previous.map(|p| p.units)
            ));
        }
        if self.closure.is_some() && previous.as_ref() != Some(record) {
            return Err(format!(
                "{}: changed to {:?} after the shard closed",
                record.reservation, record.state
            ));
        }
        let terms = &mut self.terms;
        match (from, record.state) {
            (None, ReservationState::Reserved) => {
                if self.overdraft_debt > 0 {
                    return Err(format!(
                        "{}: admitted while the shard owes {} units of receipt debt",
                        record.reservation, self.overdraft_debt
                    ));
                }
                if terms.local_available < units {
                    return Err(format!(
                        "{}: {units} units admitted with {} available",
                        record.reservation, terms.local_available
                    ));
                }
                terms.local_available -= units;
                terms.local_reserved += units;
            }
            (Some(ReservationState::Reserved), ReservationState::Started)
            | (Some(ReservationState::Started), ReservationState::UsageUnknown) => {}
            (
                Some(ReservationState::Reserved),
                ReservationState::Released | ReservationState::Expired,
            ) => {
                terms.local_reserved -= units;
                terms.local_available += units;
            }
            (
                Some(ReservationState::Started | ReservationState::UsageUnknown),
                ReservationState::Settled | ReservationState::SettledWithDebt,
            ) => {
                let Some(actual) = record.actual_units else {
                    return Err(format!(
                        "{}: settled without actual units",
                        record.reservation
                    ));
                };
                terms.local_reserved -= units;
                let overdraft = if actual <= units {
                    terms.local_spent += actual;
                    terms.local_available += units - actual;
                    0
                } else {
                    let overage = actual - units;
                    let from_available = overage.min(terms.local_available);
                    terms.local_available -= from_available;
                    terms.local_spent += units + from_available;
                    overage - from_available
                };
                self.overdraft_debt += overdraft;
                let state = if overdraft > 0 {
                    ReservationState::SettledWithDebt
                } else {
                    ReservationState::Settled
                };
                if record.overdraft_units != overdraft || record.state != state {
                    return Err(format!(
                        "{}: settled at {actual} of {units} as {:?} with {} units of debt; \
                         the rule gives {state:?} with {overdraft}",
                        record.reservation, record.state, record.overdraft_units
                    ));
                }
            }
            (Some(from), to) if from == to && previous.as_ref() == Some(record) => {}
            (from, to) => {
                return Err(format!(
                    "{}: no transition from {from:?} to {to:?}",
                    record.reservation
                ));
            }
        }
        self.reservations
            .insert(record.reservation.clone(), record.clone());
        Ok(())
    }

    /// A book record: it must equal the reference's terms and debt; a
    /// first closure retires what is available as confirmed unused and
    /// what is reserved as unknown.
    pub fn observe_book(
        &mut self,
        terms: &ShardTerms,
        overdraft_debt: u64,
        closure: Option<&ShardClosure>,
    ) -> Result<(), String> {
        if let Some(closure) = closure
            && self.closure.is_none()
        {
            let unused = self.terms.local_available;
            let unknown = self.terms.local_reserved;
            let held: u64 = self
                .reservations
                .values()
                .filter(|r| holds(r.state))
                .map(|r| r.units)
                .sum();
            if unknown != held {
                return Err(format!(
                    "closed with {unknown} units reserved while its reservations hold {held}"
                ));
            }
            self.terms.local_retired += unused + unknown;
            self.terms.local_available = 0;
            self.terms.local_reserved = 0;
            self.closure = Some((unused, unknown));
            if (closure.confirmed_unused_units, closure.unknown_units) != (unused, unknown) {
                return Err(format!(
                    "closed with {} confirmed unused and {} unknown; the rule gives {unused} and {unknown}",
                    closure.confirmed_unused_units, closure.unknown_units
                ));
            }
        }
        if closure.is_none() && self.closure.is_some() {
            return Err("a closed shard's book reopened".to_owned());
        }
        if *terms != self.terms || overdraft_debt != self.overdraft_debt {
            return Err(format!(
                "the book holds {terms:?} with {overdraft_debt} units of debt; \
                 the reference {:?} with {}",
                self.terms, self.overdraft_debt
            ));
        }
        Ok(())
    }

    /// A terminal receipt must report the closed book exactly.
    pub fn check_receipt(&self, receipt: &ShardTerminalReceiptV1) -> Result<(), String> {
        let Some((unused, unknown)) = self.closure else {
            return Err("a terminal receipt for a shard still open".to_owned());
        };
        let expected = (
            self.terms.allocated,
            self.terms.local_spent,
            unused,
            unknown,
            self.overdraft_debt,
        );
        let reported = (
            receipt.allocated_units,
            receipt.spent_units,
            receipt.confirmed_unused_units,
            receipt.unknown_units,
            receipt.overdraft_debt_units,
        );
        if reported != expected {
            return Err(format!(
                "the terminal receipt reports (allocated, spent, unused, unknown, debt) \
                 {reported:?}; the book gives {expected:?}"
            ));
        }
        Ok(())
    }
}
