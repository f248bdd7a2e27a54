//! `admissionBudget.v1`: the policy for one `(subject, route)` at one
//! policy generation.

use serde::{Deserialize, Serialize};

use crate::document::{
    Document, ParseError, check_at_most, check_label, check_positive_at_most, schema_tag,
};
use crate::limits::{
    COUNTER_MAX, DURATION_MS_MAX, FAIRNESS_WEIGHT_MAX, HOLD_TTL_MS_MAX, LABEL_LENGTH_MAX, UNITS_MAX,
};
use crate::values::{Digest, Route, Subject};

schema_tag!(
    /// The `schema` tag `admissionBudget.v1`.
    AdmissionBudgetSchema = "admissionBudget.v1"
);

/// How a route's decisions take effect (docs/design.md §3.8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum RouteMode {
    /// Admit everything; decide nothing, record nothing.
    Off,
    /// Decide and record as if enforcing, but always admit and spend nothing.
    Shadow,
    /// Decisions are binding.
    Enforce,
}

/// Whether agents may admit from emergency shards while partitioned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum EmergencyMode {
    Disabled,
    Enabled,
}

/// `refill`: `units` are minted every `intervalMs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Refill {
    #[cfg_attr(feature = "schema", schemars(range(max = UNITS_MAX)))]
    pub units: u64,
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = DURATION_MS_MAX)))]
    pub interval_ms: u64,
}

/// `admissionBudget.v1`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AdmissionBudgetV1 {
    pub schema: AdmissionBudgetSchema,
    pub subject: Subject,
    pub route: Route,
    #[cfg_attr(feature = "schema", schemars(length(min = 1, max = LABEL_LENGTH_MAX), regex(pattern = r"^[ -~]+$")))]
    pub region: String,
    #[cfg_attr(feature = "schema", schemars(length(min = 1, max = LABEL_LENGTH_MAX), regex(pattern = r"^[ -~]+$")))]
    pub capacity_unit: String,
    /// Rises with every publish for the `(subject, route)`; starts at 1.
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = COUNTER_MAX)))]
    pub policy_generation: u64,
    /// Units each accounting epoch's account opens with.
    #[cfg_attr(feature = "schema", schemars(range(max = UNITS_MAX)))]
    pub opening: u64,
    pub refill: Refill,
    /// `available` never exceeds it.
    #[cfg_attr(feature = "schema", schemars(range(max = UNITS_MAX)))]
    pub burst: u64,
    /// Length of one accounting epoch (fixed window).
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = DURATION_MS_MAX)))]
    pub accounting_epoch_ms: u64,
    pub estimator_digest: Digest,
    /// Largest single reservation.
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = UNITS_MAX)))]
    pub reservation_units_max: u64,
    /// How long a `RESERVED` item is held before expiry may take it.
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = HOLD_TTL_MS_MAX)))]
    pub hold_ttl_ms: u64,
    pub priority: u8,
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = FAIRNESS_WEIGHT_MAX)))]
    pub fairness_weight: u32,
    /// Largest overdraft one settlement may create before the route freezes.
    #[cfg_attr(feature = "schema", schemars(range(max = UNITS_MAX)))]
    pub overdraft_units_max: u64,
    /// After this long `STARTED`, an execution is a breach: unknown usage may
    /// be settled conservatively and an overdraft freezes the route.
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = DURATION_MS_MAX)))]
    pub execution_hard_limit_ms: u64,
    pub emergency_mode: EmergencyMode,
    pub mode: RouteMode,
    /// Size of one emergency shard (0 with `emergencyMode: disabled`).
    #[serde(default)]
    #[cfg_attr(feature = "schema", schemars(range(max = UNITS_MAX)))]
    pub emergency_shard_units: u64,
    /// How long an emergency shard stays valid after issuance.
    #[serde(default = "default_emergency_shard_validity_ms")]
    #[cfg_attr(feature = "schema", schemars(range(min = 1, max = DURATION_MS_MAX)))]
    pub emergency_shard_validity_ms: u64,
}

fn default_emergency_shard_validity_ms() -> u64 {
    10 * 60 * 1000
}

impl Document for AdmissionBudgetV1 {
    const SCHEMA: &'static str = AdmissionBudgetSchema::SCHEMA;
    const SCHEMA_MEMBER: bool = true;

    fn validate(&self) -> Result<(), ParseError> {
        check_label("region", &self.region, LABEL_LENGTH_MAX)?;
        check_label("capacityUnit", &self.capacity_unit, LABEL_LENGTH_MAX)?;
        check_positive_at_most("policyGeneration", self.policy_generation, COUNTER_MAX)?;
        check_at_most("burst", self.burst, UNITS_MAX)?;
        check_at_most("opening", self.opening, self.burst)
            .map_err(|error| ParseError::new("opening", format!("{} (`burst`)", error.message)))?;
        check_at_most("refill.units", self.refill.units, UNITS_MAX)?;
        check_positive_at_most(
            "refill.intervalMs",
            self.refill.interval_ms,
            DURATION_MS_MAX,
        )?;
        check_positive_at_most(
            "accountingEpochMs",
            self.accounting_epoch_ms,
            DURATION_MS_MAX,
        )?;
        check_positive_at_most(
            "reservationUnitsMax",
            self.reservation_units_max,
            self.burst,
        )
        .map_err(|error| {
            ParseError::new(
                "reservationUnitsMax",
                format!("{} (`burst`)", error.message),
            )
        })?;
        check_positive_at_most("holdTtlMs", self.hold_ttl_ms, HOLD_TTL_MS_MAX)?;
        check_positive_at_most(
            "fairnessWeight",
            u64::from(self.fairness_weight),
            u64::from(FAIRNESS_WEIGHT_MAX),
        )?;
        check_at_most("overdraftUnitsMax", self.overdraft_units_max, UNITS_MAX)?;
        check_positive_at_most(
            "executionHardLimitMs",
            self.execution_hard_limit_ms,
            DURATION_MS_MAX,
        )?;
        check_positive_at_most(
            "emergencyShardValidityMs",
            self.emergency_shard_validity_ms,
            DURATION_MS_MAX,
        )?;
        match self.emergency_mode {
            EmergencyMode::Enabled => check_positive_at_most(
                "emergencyShardUnits",
                self.emergency_shard_units,
                self.burst,
            )
            .map_err(|error| {
                ParseError::new(
                    "emergencyShardUnits",
                    format!(
                        "{} (`burst`; required with emergencyMode enabled)",
                        error.message
                    ),
                )
            }),
            EmergencyMode::Disabled => check_at_most(
                "emergencyShardUnits",
                self.emergency_shard_units,
                self.burst,
            ),
        }
    }
}
