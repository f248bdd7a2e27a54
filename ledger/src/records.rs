//! The records a store keeps, and [`Change`]: one record to upsert. A
//! transition returns every change it made; a shell commits them in one
//! transaction before it answers anyone.

use serde::{Deserialize, Serialize};
use shard_format::{
    AdmissionBudgetV1, BootNonce, Digest, EmergencyShardV1, GatewayIdentity, LimitReservationV1,
    ReservationId, Route, SettlementReceiptV1, ShardId, Subject, Timestamp,
};

use crate::terms::AccountTerms;

/// `(subject, route)`: the unit of partitioning, debt and freezing.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PairKey {
    pub subject: Subject,
    pub route: Route,
}

impl PairKey {
    pub fn new(subject: Subject, route: Route) -> Self {
        Self { subject, route }
    }
}

/// `(subject, route, accountingEpoch, policyGeneration)`. Ordered so that
/// within a pair the oldest account (earliest epoch, then lowest
/// generation) comes first: debt is repaid in this order.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AccountKey {
    pub pair: PairKey,
    pub accounting_epoch: Timestamp,
    pub policy_generation: u64,
}

/// What a pair remembers besides its policies and accounts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PairRecord {
    pub pair: PairKey,
    /// The newest published generation; only it may admit.
    pub current_generation: u64,
    /// The operator rolled the current generation back: it admits nothing
    /// until a newer one is published; settlement goes on.
    pub admission_stopped: bool,
    /// A breach (overdraft above `overdraftUnitsMax`, or past the execution
    /// hard limit) froze the pair until an operator unfreezes it.
    pub frozen: bool,
    /// Refill ticks are counted from here.
    pub last_refill_at: Timestamp,
    /// The fence the next shard of this pair gets.
    pub next_fence: u64,
}

/// One account's terms under its key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AccountRecord {
    pub key: AccountKey,
    pub terms: AccountTerms,
}

/// A reservation: its `limitReservation.v1` receipt and the ledger's
/// bookkeeping around it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReservationRecord {
    pub receipt: LimitReservationV1,
    /// Made under `mode: shadow`: recorded, but holds and spends nothing.
    pub shadow: bool,
    pub started_at: Option<Timestamp>,
    /// When a `STARTED` reservation without a receipt becomes `USAGE_UNKNOWN`.
    pub usage_deadline: Option<Timestamp>,
    /// `startedAt + executionHardLimitMs`: past it, unknown usage is settled
    /// conservatively and any overdraft is a breach.
    pub hard_limit_at: Option<Timestamp>,
    pub settlement: Option<SettlementReceiptV1>,
    /// A conservative settlement was corrected by a late genuine receipt;
    /// it can happen once.
    pub corrected: bool,
}

impl ReservationRecord {
    pub fn account_key(&self) -> AccountKey {
        AccountKey {
            pair: PairKey::new(self.receipt.subject.clone(), self.receipt.route.clone()),
            accounting_epoch: self.receipt.accounting_epoch,
            policy_generation: self.receipt.policy_generation,
        }
    }

    /// Units this reservation holds in its account's `reserved` term.
    pub fn held_units(&self) -> u64 {
        if !self.shadow && self.receipt.state.holds_units() {
            self.receipt.reserved_units
        } else {
            0
        }
    }
}

/// An ID abandoned while its reserve's outcome was unknown: a late duplicate
/// of that reserve must never reserve.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TombstoneRecord {
    pub reservation: ReservationId,
    pub abandoned_at: Timestamp,
}

/// An enrolled gateway (agent identity) and its current boot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GatewayRecord {
    pub identity: GatewayIdentity,
    pub enrolled_at: Timestamp,
    /// 0 until the first registration; strictly rising afterwards.
    pub boot_epoch: u64,
    pub boot_nonce: Option<BootNonce>,
}

/// What reconciling a shard's terminal receipt did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Reconciliation {
    pub receipt_digest: Digest,
    pub spent_units: u64,
    pub confirmed_unused_units: u64,
    pub unknown_units: u64,
    pub overdraft_debt_units: u64,
    /// Confirmed unused units that went to repay debt.
    pub repaid_units: u64,
    /// Confirmed unused units that reached `available`.
    pub reminted_units: u64,
    /// Confirmed unused units the `burst` cap cut off (reported, not minted).
    pub cut_units: u64,
    pub reconciled_at: Timestamp,
}

/// An issued shard and, once its terminal receipt came, the reconciliation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ShardRecord {
    pub shard: EmergencyShardV1,
    pub reconciliation: Option<Reconciliation>,
}

impl ShardRecord {
    pub fn account_key(&self) -> AccountKey {
        AccountKey {
            pair: PairKey::new(self.shard.subject.clone(), self.shard.route.clone()),
            accounting_epoch: self.shard.accounting_epoch,
            policy_generation: self.shard.policy_generation,
        }
    }
}

/// One record to write (insert or replace, keyed by its natural key).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "kind", content = "record")]
pub enum Change {
    Policy(Box<AdmissionBudgetV1>),
    Pair(PairRecord),
    Account(AccountRecord),
    Reservation(Box<ReservationRecord>),
    Tombstone(TombstoneRecord),
    Gateway(GatewayRecord),
    Shard(Box<ShardRecord>),
}

/// The natural key of a [`Change`]: a later change with the same key
/// replaces the earlier record.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RecordKey {
    Policy(PairKey, u64),
    Pair(PairKey),
    Account(AccountKey),
    Reservation(ReservationId),
    Tombstone(ReservationId),
    Gateway(GatewayIdentity),
    Shard(ShardId),
}

impl Change {
    pub fn key(&self) -> RecordKey {
        match self {
            Self::Policy(policy) => RecordKey::Policy(
                PairKey::new(policy.subject.clone(), policy.route.clone()),
                policy.policy_generation,
            ),
            Self::Pair(pair) => RecordKey::Pair(pair.pair.clone()),
            Self::Account(account) => RecordKey::Account(account.key.clone()),
            Self::Reservation(record) => RecordKey::Reservation(record.receipt.reservation.clone()),
            Self::Tombstone(tombstone) => RecordKey::Tombstone(tombstone.reservation.clone()),
            Self::Gateway(gateway) => RecordKey::Gateway(gateway.identity.clone()),
            Self::Shard(record) => RecordKey::Shard(record.shard.shard.clone()),
        }
    }
}

/// Subject and route of an account, for reading.
impl AccountKey {
    pub fn subject(&self) -> &Subject {
        &self.pair.subject
    }
    pub fn route(&self) -> &Route {
        &self.pair.route
    }
}
