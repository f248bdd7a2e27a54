//! The JSON bodies of the central API (docs/design.md §6.3) besides the v1
//! documents themselves. The service parses request bodies with
//! [`shard_format::parse`] (each body implements [`Document`] for that
//! reason), so they are as strict as the documents: unknown members, `null`
//! for an absent member, out-of-range numbers and malformed identifiers are
//! refused with the field named.

use ledger::{AccountTerms, Dimension, Reconciliation, ReserveRequest};
use serde::{Deserialize, Serialize};
use shard_format::limits::{COUNTER_MAX, DURATION_MS_MAX, HOLD_TTL_MS_MAX, UNITS_MAX};
use shard_format::{
    BootNonce, Digest, Document, GatewayIdentity, OperationId, ParseError, ReservationId, Route,
    ShardId, Subject, Timestamp,
};

/// Response header naming which outcome a 2xx answer carries
/// (`reserved`, `duplicate`, `shadow`, `not_enforced`, `started`, `settled`,
/// `corrected`, `released`, `tombstoned`, `abandoned`, `reconciled`, …).
pub const OUTCOME_HEADER: &str = "reservoir-outcome";
/// Response header on a shadow-mode admission: the dimension enforcement
/// would have rejected on, if any.
pub const WOULD_REJECT_HEADER: &str = "reservoir-would-reject";

fn check_at_most(field: &str, value: u64, max: u64) -> Result<(), ParseError> {
    if value > max {
        return Err(ParseError::new(
            field,
            format!("{value} is above the maximum {max}"),
        ));
    }
    Ok(())
}

fn check_positive_at_most(field: &str, value: u64, max: u64) -> Result<(), ParseError> {
    if value == 0 {
        return Err(ParseError::new(field, "must be at least 1"));
    }
    check_at_most(field, value, max)
}

/// `POST /v1/reservations`: `{reservation, subject, route, units,
/// policyGeneration?, requestDigest, holdTtlMs?}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReserveBody {
    pub reservation: ReservationId,
    pub subject: Subject,
    pub route: Route,
    pub units: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_generation: Option<u64>,
    pub request_digest: Digest,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_ttl_ms: Option<u64>,
}

impl Document for ReserveBody {
    const SCHEMA: &'static str = "reserveRequest";

    fn validate(&self) -> Result<(), ParseError> {
        check_positive_at_most("units", self.units, UNITS_MAX)?;
        if let Some(generation) = self.policy_generation {
            check_positive_at_most("policyGeneration", generation, COUNTER_MAX)?;
        }
        if let Some(hold_ttl_ms) = self.hold_ttl_ms {
            check_positive_at_most("holdTtlMs", hold_ttl_ms, HOLD_TTL_MS_MAX)?;
        }
        Ok(())
    }
}

impl From<ReserveBody> for ReserveRequest {
    fn from(body: ReserveBody) -> Self {
        Self {
            reservation: body.reservation,
            subject: body.subject,
            route: body.route,
            units: body.units,
            policy_generation: body.policy_generation,
            request_digest: body.request_digest,
            hold_ttl_ms: body.hold_ttl_ms,
        }
    }
}

impl From<ReserveRequest> for ReserveBody {
    fn from(request: ReserveRequest) -> Self {
        Self {
            reservation: request.reservation,
            subject: request.subject,
            route: request.route,
            units: request.units,
            policy_generation: request.policy_generation,
            request_digest: request.request_digest,
            hold_ttl_ms: request.hold_ttl_ms,
        }
    }
}

/// `POST /v1/reservations/{reservation}/start`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct StartBody {
    pub operation_id: OperationId,
    /// The caller's execution deadline; past it without a receipt the
    /// reservation becomes `USAGE_UNKNOWN`. Defaults to the policy's hold TTL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
}

impl Document for StartBody {
    const SCHEMA: &'static str = "startRequest";

    fn validate(&self) -> Result<(), ParseError> {
        if let Some(deadline_ms) = self.deadline_ms {
            check_positive_at_most("deadlineMs", deadline_ms, DURATION_MS_MAX)?;
        }
        Ok(())
    }
}

/// `POST /v1/reservations/{reservation}/settle`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SettleBody {
    pub operation_id: OperationId,
    pub actual_units: u64,
}

impl Document for SettleBody {
    const SCHEMA: &'static str = "settleRequest";

    fn validate(&self) -> Result<(), ParseError> {
        check_at_most("actualUnits", self.actual_units, UNITS_MAX)
    }
}

/// The body of calls that take none (`release`, `abandon`, `boot`): empty,
/// or `{}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmptyBody {}

impl Document for EmptyBody {
    const SCHEMA: &'static str = "empty";

    fn validate(&self) -> Result<(), ParseError> {
        Ok(())
    }
}

/// `POST /v1/accounts/{subject}/{route}/admission` (operator): stop (roll
/// back) or resume admission under the pair's current generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AdmissionBody {
    pub policy_generation: u64,
    pub stopped: bool,
}

impl Document for AdmissionBody {
    const SCHEMA: &'static str = "admissionControl";

    fn validate(&self) -> Result<(), ParseError> {
        check_positive_at_most("policyGeneration", self.policy_generation, COUNTER_MAX)
    }
}

/// `POST /v1/accounts/{subject}/{route}/freeze` (operator).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FreezeBody {
    pub frozen: bool,
}

impl Document for FreezeBody {
    const SCHEMA: &'static str = "freezeControl";

    fn validate(&self) -> Result<(), ParseError> {
        Ok(())
    }
}

/// `POST /v1/shards` (agent): an emergency shard for the caller's current
/// boot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct IssueShardBody {
    pub subject: Subject,
    pub route: Route,
    pub boot_epoch: u64,
    pub boot_nonce: BootNonce,
    /// An ID the agent chose, which makes the call idempotent: a repeat
    /// returns the same shard. Without it the service draws one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardId>,
}

impl Document for IssueShardBody {
    const SCHEMA: &'static str = "shardRequest";

    fn validate(&self) -> Result<(), ParseError> {
        check_positive_at_most("bootEpoch", self.boot_epoch, COUNTER_MAX)
    }
}

/// Every error body: `{"error": "<stable_code>", "message": "<sentence>",
/// …}`; 429s add `policyGeneration`, `dimension` and `retryAfterSeconds`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ErrorBody {
    pub error: String,
    pub message: String,
    #[serde(flatten)]
    pub details: serde_json::Map<String, serde_json::Value>,
}

/// The extra members of a 429 body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RejectionDetails {
    pub policy_generation: u64,
    pub dimension: Dimension,
    /// `null` when waiting alone will not help (frozen, rolled back, too big).
    pub retry_after_seconds: Option<u64>,
}

/// `PUT /v1/policies` → 201.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PublishResponse {
    pub subject: Subject,
    pub route: Route,
    pub policy_generation: u64,
}

/// `PUT /v1/gateways/{identity}` → 201 (new) or 200 (already enrolled).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EnrollResponse {
    pub identity: GatewayIdentity,
    /// False when the identity was enrolled already.
    pub enrolled: bool,
}

/// `POST /v1/gateways/{identity}/boot` → 201.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BootResponse {
    pub identity: GatewayIdentity,
    pub boot_epoch: u64,
    /// Hold it in memory only: shards are bound to it.
    pub boot_nonce: BootNonce,
}

/// `POST /v1/accounts/{subject}/{route}/admission` and `/freeze` → 200.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RouteControlResponse {
    /// False when the pair was in the asked state already.
    pub changed: bool,
}

/// `POST /v1/reservations/{reservation}/abandon` → 200.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AbandonResponse {
    pub reservation: ReservationId,
    /// `tombstoned` (the ID was unknown), `abandoned` (it was `RESERVED` and
    /// is released) or `duplicate`.
    pub outcome: String,
}

/// `POST /v1/shards/{shard}/receipt` → 200.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReconcileResponse {
    pub shard: ShardId,
    /// True when the shard had been reconciled before: nothing moved now.
    pub duplicate: bool,
    pub reconciliation: Reconciliation,
}

/// One account in `GET /v1/accounts/{subject}/{route}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AccountView {
    pub accounting_epoch: Timestamp,
    pub policy_generation: u64,
    #[serde(flatten)]
    pub terms: AccountTerms,
    pub debt: u64,
}

/// `GET /v1/accounts/{subject}/{route}` → 200.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AccountsResponse {
    pub subject: Subject,
    pub route: Route,
    pub current_generation: u64,
    pub admission_stopped: bool,
    pub frozen: bool,
    /// Outstanding debt across the pair's accounts.
    pub debt: u64,
    /// Oldest first.
    pub accounts: Vec<AccountView>,
}

/// One broken rule in an audit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditViolation {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<Subject>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<Route>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accounting_epoch: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_generation: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<ReservationId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<ShardId>,
    pub message: String,
}

/// One policy generation of a pair in the audit: what still has to drain
/// after a rollback.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditGeneration {
    pub policy_generation: u64,
    /// Units of open reservations made under it.
    pub reserved: u64,
    pub debt: u64,
    /// Units of its shards not yet reconciled.
    pub open_shard_units: u64,
}

/// One pair's line in the audit table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditPair {
    pub subject: Subject,
    pub route: Route,
    pub current_generation: u64,
    pub admission_stopped: bool,
    pub frozen: bool,
    pub accounts: usize,
    /// Sum of the pair's `reserved`: units of open reservations.
    pub reserved: u64,
    pub debt: u64,
    /// Units of shards not yet reconciled.
    pub open_shard_units: u64,
    pub open_shards: usize,
    /// Whether every account of the pair holds its equation.
    pub balanced: bool,
    /// The same, per policy generation (oldest first).
    pub generations: Vec<AuditGeneration>,
}

/// `GET /v1/audit` → 200 (`ok: true`) or 500 (`ok: false`, with the
/// offending accounts).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditResponse {
    pub ok: bool,
    pub accounts: usize,
    pub reservations: usize,
    pub shards: usize,
    pub debt: u64,
    pub pairs: Vec<AuditPair>,
    pub violations: Vec<AuditViolation>,
}

/// `{"mode": "off"}`: the answer to a reservation on a route in mode `off`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NotEnforcedResponse {
    pub mode: String,
}
