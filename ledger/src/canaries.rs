//! Known bugs the simulator plants to prove its checks catch them. The
//! switches exist only with the `canaries` feature and are all off unless a
//! simulator calls `CentralLedger::plant_canaries`.

/// Each switch plants one bug of the seed's fault list.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Canaries {
    /// `reserve` ignores an existing reservation ID and reserves again.
    pub skip_idempotency_check: bool,
    /// A `STARTED` item past its deadline is refunded instead of becoming
    /// `USAGE_UNKNOWN`.
    pub refund_on_timeout: bool,
    /// A replayed settle (its first ACK was lost) erases the debt it made.
    pub skip_debt_on_replayed_settle: bool,
    /// Expiry also takes `STARTED` items.
    pub expire_started: bool,
    /// Any identity acts on any reservation ID: no ownership, no namespace.
    pub skip_owner_check: bool,
    /// `reserve` checks capacity for one unit instead of the request's
    /// floor: a reserve is admitted with whatever the account has left,
    /// below its `minUnits` (or below `units` for a fixed one).
    pub admit_below_floor: bool,
    /// A `reserve` of several legs refused by one leg still writes, and
    /// holds the units of, every enforced leg before the first refused one:
    /// some legs held without the others.
    pub admit_legs_before_refusal: bool,
}
