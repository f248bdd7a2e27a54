//! `emergencyShard.v1` (signed by the central ledger) and
//! `shardTerminalReceipt.v1` (signed by the gateway the shard is bound to).

use serde::{Deserialize, Serialize};

use crate::document::{
    Document, ParseError, SignedDocument, check_at_most, check_positive_at_most, schema_tag,
};
use crate::limits::{COUNTER_MAX, UNITS_MAX};
use crate::values::{
    BootNonce, GatewayIdentity, KeyId, Route, ShardId, Signature, Subject, Timestamp,
};

schema_tag!(
    /// The `schema` tag `emergencyShard.v1`.
    EmergencyShardSchema = "emergencyShard.v1"
);
schema_tag!(
    /// The `schema` tag `shardTerminalReceipt.v1`.
    ShardTerminalReceiptSchema = "shardTerminalReceipt.v1"
);

/// `emergencyShard.v1`: a slice of one account's capacity, moved centrally
/// from `available` to `retiredForEmergency`, that one agent process may
/// spend while partitioned.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EmergencyShardV1 {
    pub schema: EmergencyShardSchema,
    pub shard: ShardId,
    pub subject: Subject,
    pub route: Route,
    pub policy_generation: u64,
    /// Start of the accounting epoch of the account the shard was carved from.
    pub accounting_epoch: Timestamp,
    pub allocated_units: u64,
    pub gateway_identity: GatewayIdentity,
    pub boot_epoch: u64,
    pub boot_nonce: BootNonce,
    /// Strictly rising per `(subject, route)`.
    pub fence: u64,
    pub not_before: Timestamp,
    pub not_after: Timestamp,
    /// The central key that signed the shard.
    pub key_id: KeyId,
    pub signature: Signature,
}

impl Document for EmergencyShardV1 {
    const SCHEMA: &'static str = EmergencyShardSchema::SCHEMA;
    const SCHEMA_MEMBER: bool = true;

    fn validate(&self) -> Result<(), ParseError> {
        check_positive_at_most("policyGeneration", self.policy_generation, COUNTER_MAX)?;
        check_positive_at_most("allocatedUnits", self.allocated_units, UNITS_MAX)?;
        check_positive_at_most("bootEpoch", self.boot_epoch, COUNTER_MAX)?;
        check_positive_at_most("fence", self.fence, COUNTER_MAX)?;
        if self.not_before >= self.not_after {
            return Err(ParseError::new("notAfter", "must be after notBefore"));
        }
        Ok(())
    }
}

impl SignedDocument for EmergencyShardV1 {
    fn key_id(&self) -> &KeyId {
        &self.key_id
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn set_signature(&mut self, key_id: KeyId, signature: Signature) {
        self.key_id = key_id;
        self.signature = signature;
    }
}

/// Why a shard was closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub enum ShardCloseReason {
    /// `notAfter` (judged on the agent's monotonic clock) passed.
    ValidityEnded,
    /// The agent process restarted: a new boot epoch never inherits a shard.
    Restart,
    /// The agent reached the central ledger again and handed the shard back.
    Reconnect,
}

/// `shardTerminalReceipt.v1`: the closed shard's final book, signed by the
/// gateway it was bound to. The central ledger re-mints
/// `confirmedUnusedUnits` once; spent and unknown units stay retired.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ShardTerminalReceiptV1 {
    pub schema: ShardTerminalReceiptSchema,
    pub shard: ShardId,
    pub subject: Subject,
    pub route: Route,
    pub gateway_identity: GatewayIdentity,
    pub boot_epoch: u64,
    pub allocated_units: u64,
    pub spent_units: u64,
    pub confirmed_unused_units: u64,
    /// Units of reservations whose outcome is unknown: never counted as
    /// unconsumed.
    pub unknown_units: u64,
    /// Usage beyond the shard: becomes `overdraftIssued` centrally.
    pub overdraft_debt_units: u64,
    pub reason: ShardCloseReason,
    pub closed_at: Timestamp,
    /// The gateway's key: equal to `gatewayIdentity`.
    pub key_id: KeyId,
    pub signature: Signature,
}

impl Document for ShardTerminalReceiptV1 {
    const SCHEMA: &'static str = ShardTerminalReceiptSchema::SCHEMA;
    const SCHEMA_MEMBER: bool = true;

    fn validate(&self) -> Result<(), ParseError> {
        check_positive_at_most("bootEpoch", self.boot_epoch, COUNTER_MAX)?;
        check_positive_at_most("allocatedUnits", self.allocated_units, UNITS_MAX)?;
        check_at_most("spentUnits", self.spent_units, UNITS_MAX)?;
        check_at_most(
            "confirmedUnusedUnits",
            self.confirmed_unused_units,
            UNITS_MAX,
        )?;
        check_at_most("unknownUnits", self.unknown_units, UNITS_MAX)?;
        check_at_most("overdraftDebtUnits", self.overdraft_debt_units, UNITS_MAX)?;
        let accounted = self
            .spent_units
            .checked_add(self.confirmed_unused_units)
            .and_then(|sum| sum.checked_add(self.unknown_units));
        if accounted != Some(self.allocated_units) {
            return Err(ParseError::new(
                "allocatedUnits",
                "must equal spentUnits + confirmedUnusedUnits + unknownUnits",
            ));
        }
        if self.key_id != self.gateway_identity {
            return Err(ParseError::new(
                "keyId",
                "must equal gatewayIdentity: a terminal receipt is signed by its gateway",
            ));
        }
        Ok(())
    }
}

impl SignedDocument for ShardTerminalReceiptV1 {
    fn key_id(&self) -> &KeyId {
        &self.key_id
    }
    fn signature(&self) -> &Signature {
        &self.signature
    }
    fn set_signature(&mut self, key_id: KeyId, signature: Signature) {
        self.key_id = key_id;
        self.signature = signature;
    }
}
