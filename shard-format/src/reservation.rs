//! `limitReservation.v1` and the receipts that end a reservation:
//! `settlementReceipt.v1` (written by the ledger) and `operationReceipt.v1`
//! (reported by the executor).

use serde::{Deserialize, Serialize};

use crate::document::{Document, ParseError, check_at_most, check_positive_at_most, schema_tag};
use crate::limits::{COUNTER_MAX, LEGS_MAX, UNITS_MAX};
use crate::values::{Digest, OperationId, ReservationId, Route, Subject, Timestamp};

schema_tag!(
    /// The `schema` tag `limitReservation.v1`.
    LimitReservationSchema = "limitReservation.v1"
);
schema_tag!(
    /// The `schema` tag `settlementReceipt.v1`.
    SettlementReceiptSchema = "settlementReceipt.v1"
);
schema_tag!(
    /// The `schema` tag `operationReceipt.v1`.
    OperationReceiptSchema = "operationReceipt.v1"
);

/// A reservation's state (docs/design.md §3.1):
/// `REQUESTED → RESERVED → STARTED → SETTLED | SETTLED_WITH_DEBT`;
/// `RESERVED → RELEASED`; `RESERVED → EXPIRING → EXPIRED`;
/// `RESERVATION_UNKNOWN` while a reserve's reply is lost;
/// `USAGE_UNKNOWN` while a started execution's result is unknown;
/// `ABANDONED` for an ID tombstoned so that a late duplicate never reserves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum ReservationState {
    Requested,
    Reserved,
    Started,
    Settled,
    SettledWithDebt,
    Released,
    Expiring,
    Expired,
    ReservationUnknown,
    UsageUnknown,
    Abandoned,
}

impl ReservationState {
    /// No transition leaves a terminal state (a conservative settlement may
    /// still be corrected once; see the ledger).
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Settled
                | Self::SettledWithDebt
                | Self::Released
                | Self::Expired
                | Self::Abandoned
        )
    }

    /// Units of a reservation in this state are still held in `reserved`.
    pub fn holds_units(self) -> bool {
        matches!(
            self,
            Self::Reserved | Self::Started | Self::Expiring | Self::UsageUnknown
        )
    }

    /// An execution may be running: an operation ID is bound.
    pub fn is_started(self) -> bool {
        matches!(self, Self::Started | Self::UsageUnknown)
    }

    pub fn is_settled(self) -> bool {
        matches!(self, Self::Settled | Self::SettledWithDebt)
    }
}

/// `limitReservation.v1`: the receipt of one reservation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LimitReservationV1 {
    // Fields in the order of their JSON names, as RFC 8785 orders them:
    // serde then writes the canonical bytes itself (`canonical_json`).
    /// Start of the accounting epoch whose account holds the units.
    pub accounting_epoch: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actual_units: Option<u64>,
    pub expires_at: Timestamp,
    /// A multi-leg reservation: every leg, this one included, in the order
    /// the caller gave them. Each leg is a reservation of its own pair with
    /// its own receipt; all were admitted in one transition and move
    /// together. Absent on a reservation of one leg.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub legs: Option<Vec<ReservationLegV1>>,
    /// A flexible reservation's floor: less than this was not admitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_units: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation_id: Option<OperationId>,
    pub policy_generation: u64,
    pub request_digest: Digest,
    /// A flexible reservation's ask: the ledger granted the largest amount
    /// between `minUnits` and this that the account could cover. Present
    /// exactly when `minUnits` is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_units: Option<u64>,
    pub reservation: ReservationId,
    /// The units held: what was asked, or for a flexible reservation the
    /// grant, between `minUnits` and `requestedUnits`.
    pub reserved_units: u64,
    pub route: Route,
    pub schema: LimitReservationSchema,
    pub state: ReservationState,
    pub subject: Subject,
}

/// One leg of a multi-leg reservation, as every leg's receipt lists it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationLegV1 {
    // Fields in the order of their JSON names (see `LimitReservationV1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_units: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_units: Option<u64>,
    /// The leg's own reservation ID (derived from its own pair).
    pub reservation: ReservationId,
    /// The leg's grant (see [`LimitReservationV1::reserved_units`]).
    pub reserved_units: u64,
    pub route: Route,
    pub subject: Subject,
}

impl ReservationLegV1 {
    /// The units the leg asked for.
    pub fn asked_units(&self) -> u64 {
        self.requested_units.unwrap_or(self.reserved_units)
    }
}

impl LimitReservationV1 {
    /// The units the reservation asked for: `requestedUnits` of a flexible
    /// reservation, `reservedUnits` otherwise.
    pub fn asked_units(&self) -> u64 {
        self.requested_units.unwrap_or(self.reserved_units)
    }

    /// This receipt as a leg of its reservation.
    pub fn as_leg(&self) -> ReservationLegV1 {
        ReservationLegV1 {
            reservation: self.reservation.clone(),
            subject: self.subject.clone(),
            route: self.route.clone(),
            reserved_units: self.reserved_units,
            requested_units: self.requested_units,
            min_units: self.min_units,
        }
    }

    /// The reservation IDs of every leg (just this one's for one leg).
    pub fn leg_ids(&self) -> Vec<ReservationId> {
        match &self.legs {
            Some(legs) => legs.iter().map(|leg| leg.reservation.clone()).collect(),
            None => vec![self.reservation.clone()],
        }
    }
}

/// Checks a grant against its flexible range: `minUnits` and
/// `requestedUnits` together, `1 ≤ minUnits ≤ reserved ≤ requested ≤
/// UNITS_MAX`. `prefix` names a leg's fields (`legs[1].`).
fn check_grant(
    prefix: &str,
    reserved: u64,
    min_units: Option<u64>,
    requested_units: Option<u64>,
) -> Result<(), ParseError> {
    let field = |name: &str| format!("{prefix}{name}");
    check_at_most(&field("reservedUnits"), reserved, UNITS_MAX)?;
    match (min_units, requested_units) {
        (None, None) => Ok(()),
        (Some(min), Some(requested)) => {
            check_positive_at_most(&field("minUnits"), min, reserved)?;
            check_at_most(&field("requestedUnits"), requested, UNITS_MAX)?;
            if requested < reserved {
                return Err(ParseError::new(
                    field("requestedUnits"),
                    format!("must be at least reservedUnits ({reserved}), got {requested}"),
                ));
            }
            Ok(())
        }
        (Some(_), None) => Err(ParseError::new(
            field("requestedUnits"),
            "is required with minUnits (a flexible reservation)",
        )),
        (None, Some(_)) => Err(ParseError::new(
            field("minUnits"),
            "is required with requestedUnits (a flexible reservation)",
        )),
    }
}

/// Checks a reservation's `legs`: 2 to [`LEGS_MAX`] legs of distinct pairs
/// and IDs, one of them `own` (the receipt's own leg, as it states it).
fn check_legs<L>(
    legs: &[L],
    own: &L,
    pair_and_id: impl Fn(&L) -> (&Subject, &Route, &ReservationId),
) -> Result<(), ParseError>
where
    L: PartialEq,
{
    if legs.len() < 2 || legs.len() > LEGS_MAX {
        return Err(ParseError::new(
            "legs",
            format!(
                "must hold 2 to {LEGS_MAX} legs (one leg is written without legs), got {}",
                legs.len()
            ),
        ));
    }
    for (index, leg) in legs.iter().enumerate() {
        let (subject, route, id) = pair_and_id(leg);
        if legs[..index].iter().any(|earlier| {
            let (s, r, i) = pair_and_id(earlier);
            (s == subject && r == route) || i == id
        }) {
            return Err(ParseError::new(
                format!("legs[{index}]"),
                format!("repeats the pair {subject}/{route} or its reservation ID"),
            ));
        }
    }
    if !legs.contains(own) {
        return Err(ParseError::new(
            "legs",
            "must list this receipt's own leg as the receipt states it",
        ));
    }
    Ok(())
}

impl Document for LimitReservationV1 {
    const SCHEMA: &'static str = LimitReservationSchema::SCHEMA;
    const SCHEMA_MEMBER: bool = true;

    fn validate(&self) -> Result<(), ParseError> {
        check_positive_at_most("policyGeneration", self.policy_generation, COUNTER_MAX)?;
        check_grant(
            "",
            self.reserved_units,
            self.min_units,
            self.requested_units,
        )?;
        if let Some(legs) = &self.legs {
            for (index, leg) in legs.iter().enumerate() {
                check_grant(
                    &format!("legs[{index}]."),
                    leg.reserved_units,
                    leg.min_units,
                    leg.requested_units,
                )?;
            }
            check_legs(legs, &self.as_leg(), |leg| {
                (&leg.subject, &leg.route, &leg.reservation)
            })?;
        }
        if let Some(actual) = self.actual_units {
            check_at_most("actualUnits", actual, UNITS_MAX)?;
        }
        let settled = self.state.is_settled();
        if settled != self.actual_units.is_some() {
            return Err(ParseError::new(
                "actualUnits",
                format!(
                    "must be present exactly when the state is SETTLED or SETTLED_WITH_DEBT (state is {:?})",
                    self.state
                ),
            ));
        }
        if (settled || self.state.is_started()) && self.operation_id.is_none() {
            return Err(ParseError::new(
                "operationId",
                format!("is required in state {:?}", self.state),
            ));
        }
        Ok(())
    }
}

/// `settlementReceipt.v1`: what one settlement did to the ledger. A repeat of
/// the same settle returns the same receipt.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SettlementReceiptV1 {
    // Fields in the order of their JSON names (see `LimitReservationV1`).
    pub accounting_epoch: Timestamp,
    pub actual_units: u64,
    /// Settled at the full reservation because no operation receipt came
    /// before the execution hard limit; a late genuine receipt corrects it
    /// once.
    pub conservative: bool,
    /// A multi-leg reservation: what the settlement did to every leg, this
    /// one included, in the reservation's order. Absent for one leg.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub legs: Option<Vec<SettledLegV1>>,
    pub operation_id: OperationId,
    /// Part of the overage that `available` could not cover: new debt.
    pub overdraft_units: u64,
    pub policy_generation: u64,
    /// `reserved − actual` when actual is below reserved, else 0.
    pub refunded_units: u64,
    pub reservation: ReservationId,
    pub reserved_units: u64,
    pub route: Route,
    pub schema: SettlementReceiptSchema,
    pub settled_at: Timestamp,
    /// `SETTLED` or `SETTLED_WITH_DEBT`.
    pub state: ReservationState,
    pub subject: Subject,
}

/// One leg's settlement, as every leg's settlement receipt lists it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SettledLegV1 {
    // Fields in the order of their JSON names (see `LimitReservationV1`).
    pub actual_units: u64,
    pub overdraft_units: u64,
    pub reservation: ReservationId,
    pub reserved_units: u64,
    pub route: Route,
    pub subject: Subject,
}

impl SettlementReceiptV1 {
    /// This receipt as a leg of its reservation's settlement.
    pub fn as_leg(&self) -> SettledLegV1 {
        SettledLegV1 {
            reservation: self.reservation.clone(),
            subject: self.subject.clone(),
            route: self.route.clone(),
            reserved_units: self.reserved_units,
            actual_units: self.actual_units,
            overdraft_units: self.overdraft_units,
        }
    }

    /// Whether any leg (or the one) ended with new debt.
    pub fn any_overdraft(&self) -> bool {
        match &self.legs {
            Some(legs) => legs.iter().any(|leg| leg.overdraft_units > 0),
            None => self.overdraft_units > 0,
        }
    }
}

impl Document for SettlementReceiptV1 {
    const SCHEMA: &'static str = SettlementReceiptSchema::SCHEMA;
    const SCHEMA_MEMBER: bool = true;

    fn validate(&self) -> Result<(), ParseError> {
        check_positive_at_most("policyGeneration", self.policy_generation, COUNTER_MAX)?;
        check_at_most("reservedUnits", self.reserved_units, UNITS_MAX)?;
        check_at_most("actualUnits", self.actual_units, UNITS_MAX)?;
        let refund = self.reserved_units.saturating_sub(self.actual_units);
        if self.refunded_units != refund {
            return Err(ParseError::new(
                "refundedUnits",
                format!("must be reservedUnits − actualUnits when positive, i.e. {refund}"),
            ));
        }
        let overage = self.actual_units.saturating_sub(self.reserved_units);
        check_at_most("overdraftUnits", self.overdraft_units, overage)?;
        if let Some(legs) = &self.legs {
            for (index, leg) in legs.iter().enumerate() {
                let field = |name: &str| format!("legs[{index}].{name}");
                check_at_most(&field("reservedUnits"), leg.reserved_units, UNITS_MAX)?;
                check_at_most(&field("actualUnits"), leg.actual_units, UNITS_MAX)?;
                let overage = leg.actual_units.saturating_sub(leg.reserved_units);
                check_at_most(&field("overdraftUnits"), leg.overdraft_units, overage)?;
            }
            check_legs(legs, &self.as_leg(), |leg| {
                (&leg.subject, &leg.route, &leg.reservation)
            })?;
        }
        let expected_state = if self.overdraft_units > 0 {
            ReservationState::SettledWithDebt
        } else {
            ReservationState::Settled
        };
        if self.state != expected_state {
            return Err(ParseError::new(
                "state",
                format!(
                    "must be {expected_state:?} for overdraftUnits {}",
                    self.overdraft_units
                ),
            ));
        }
        Ok(())
    }
}

/// `operationReceipt.v1`: the executor's report of what one operation used.
/// Only this ends `USAGE_UNKNOWN`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct OperationReceiptV1 {
    pub schema: OperationReceiptSchema,
    pub reservation: ReservationId,
    pub operation_id: OperationId,
    pub actual_units: u64,
    pub completed_at: Timestamp,
}

impl Document for OperationReceiptV1 {
    const SCHEMA: &'static str = OperationReceiptSchema::SCHEMA;
    const SCHEMA_MEMBER: bool = true;

    fn validate(&self) -> Result<(), ParseError> {
        check_at_most("actualUnits", self.actual_units, UNITS_MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::ReservationState::{self, *};

    /// docs/design.md §3.1, row by row: (state, terminal, holds units,
    /// started, settled).
    const TABLE: [(ReservationState, bool, bool, bool, bool); 11] = [
        (Requested, false, false, false, false),
        (Reserved, false, true, false, false),
        (Started, false, true, true, false),
        (Settled, true, false, false, true),
        (SettledWithDebt, true, false, false, true),
        (Released, true, false, false, false),
        (Expiring, false, true, false, false),
        (Expired, true, false, false, false),
        (ReservationUnknown, false, false, false, false),
        (UsageUnknown, false, true, true, false),
        (Abandoned, true, false, false, false),
    ];

    #[test]
    fn each_state_is_terminal_holds_units_started_or_settled_as_the_design_table_says() {
        for (state, terminal, holds_units, started, settled) in TABLE {
            assert_eq!(state.is_terminal(), terminal, "{state:?} terminal");
            assert_eq!(state.holds_units(), holds_units, "{state:?} holds units");
            assert_eq!(state.is_started(), started, "{state:?} started");
            assert_eq!(state.is_settled(), settled, "{state:?} settled");
        }
    }

    #[test]
    fn the_units_asked_are_the_requested_units_of_a_flexible_reservation_else_the_reserved() {
        let vector = include_str!("../tests/vectors/limitReservation.v1-flexible.input.json");
        let mut flexible: super::LimitReservationV1 =
            serde_json::from_str(vector).expect("the golden vector");
        assert_eq!(
            (flexible.reserved_units, flexible.asked_units()),
            (1500, 4000)
        );
        flexible.requested_units = None;
        flexible.min_units = None;
        assert_eq!(flexible.asked_units(), 1500);
    }

    #[test]
    fn a_legs_units_asked_are_its_requested_units_if_flexible_else_its_reserved() {
        let legs = legs_vector().legs.expect("the vector's legs");
        // legs[1] is flexible (1500 of 4000), legs[0] fixed at 1.
        assert_eq!(
            (legs[1].reserved_units, legs[1].asked_units()),
            (1500, 4000)
        );
        let mut fixed = legs[1].clone();
        fixed.requested_units = None;
        fixed.min_units = None;
        assert_eq!(fixed.asked_units(), 1500);
        assert_eq!(legs[0].asked_units(), 1);
    }

    #[test]
    fn the_leg_ids_are_every_legs_id_in_order_or_the_own_id_alone() {
        let mut receipt = legs_vector();
        let ids: Vec<String> = receipt.leg_ids().iter().map(|id| id.to_string()).collect();
        assert_eq!(
            ids,
            [
                "rl-01J2Z3Y4X5W6V7T8S9R0Q1P2N6",
                "rl-01J2Z3Y4X5W6V7T8S9R0Q1P2N5",
                "rl-01J2Z3Y4X5W6V7T8S9R0Q1P2N7",
            ]
        );
        receipt.legs = None;
        assert_eq!(receipt.leg_ids(), vec![receipt.reservation.clone()]);
    }

    fn legs_vector() -> super::LimitReservationV1 {
        let vector = include_str!("../tests/vectors/limitReservation.v1-legs.input.json");
        serde_json::from_str(vector).expect("the golden vector")
    }
}
