//! The records a store keeps, and [`Change`]: one record to upsert. A
//! transition returns every change it made; a shell commits them in one
//! transaction before it answers anyone.

use serde::{Deserialize, Serialize};
use shard_format::{
    AdmissionBudgetV1, BootNonce, Digest, EmergencyShardV1, GatewayIdentity, LimitReservationV1,
    ReservationId, Route, SettlementReceiptV1, ShardId, Subject, Timestamp,
};

use crate::terms::{AccountTerms, Overflow, add};

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
    /// The accounts of past epochs and generations folded away once they
    /// held nothing: their terms summed, so the pair's whole life stays
    /// auditable after its records are forgotten.
    #[serde(default, skip_serializing_if = "ClosedHistory::is_empty")]
    pub closed_history: ClosedHistory,
}

/// What an account remembers of the reservations and shards it no longer
/// stores (forgotten after the retention window), so that the audit's usage
/// and retired checks stay exact.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ForgottenHistory {
    /// Forgotten reservations.
    pub reservations: u64,
    /// Forgotten (reconciled) shards.
    pub shards: u64,
    /// `spent` the forgotten settlements and shard receipts accounted for.
    pub spent: u64,
    /// `overdraftIssued` the forgotten settlements and receipts accounted for.
    pub overdraft_issued: u64,
    /// `allocatedUnits` of the forgotten shards (part of `retiredForEmergency`).
    pub shard_units: u64,
    /// Forgotten shards that were lost and never reconciled (part of
    /// `shards`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lost_shards: u64,
    /// Their `allocatedUnits` (part of `shardUnits`): retired for good.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lost_units: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

impl ForgottenHistory {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Both tallies together (saturating: a count that large is already
    /// an audit finding).
    pub fn plus(&self, other: &Self) -> Self {
        Self {
            reservations: self.reservations.saturating_add(other.reservations),
            shards: self.shards.saturating_add(other.shards),
            spent: self.spent.saturating_add(other.spent),
            overdraft_issued: self.overdraft_issued.saturating_add(other.overdraft_issued),
            shard_units: self.shard_units.saturating_add(other.shard_units),
            lost_shards: self.lost_shards.saturating_add(other.lost_shards),
            lost_units: self.lost_units.saturating_add(other.lost_units),
        }
    }
}

/// A pair's folded accounts: the sums of their terms and of what their
/// records accounted for. Its own equation is the central one, with
/// `reserved = 0`, no debt, `spent = forgotten.spent`,
/// `overdraftIssued = forgotten.overdraftIssued` and
/// `retiredForEmergency = forgotten.shardUnits`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ClosedHistory {
    /// Accounts folded in.
    pub accounts: u64,
    pub terms: AccountTerms,
    pub forgotten: ForgottenHistory,
}

impl ClosedHistory {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// This history with one more account folded in.
    pub fn plus(&self, account: &crate::central::AccountState) -> Result<Self, Overflow> {
        let (a, b) = (&self.terms, &account.terms);
        Ok(Self {
            accounts: add(self.accounts, 1)?,
            terms: AccountTerms {
                opening: add(a.opening, b.opening)?,
                minted: add(a.minted, b.minted)?,
                overdraft_issued: add(a.overdraft_issued, b.overdraft_issued)?,
                available: add(a.available, b.available)?,
                reserved: add(a.reserved, b.reserved)?,
                spent: add(a.spent, b.spent)?,
                retired_for_emergency: add(a.retired_for_emergency, b.retired_for_emergency)?,
                overdraft_repaid: add(a.overdraft_repaid, b.overdraft_repaid)?,
            },
            forgotten: self.forgotten.plus(&account.forgotten),
        })
    }
}

/// One account's terms under its key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AccountRecord {
    pub key: AccountKey,
    pub terms: AccountTerms,
    /// Reservation and shard records of this account still stored: an
    /// account with none left, no debt and no longer current is folded
    /// into its pair's [`ClosedHistory`]. `None` in records written before
    /// the count existed: loading the whole ledger counts them; an account
    /// whose count is unknown is never folded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub records: Option<u64>,
    #[serde(default, skip_serializing_if = "ForgottenHistory::is_empty")]
    pub forgotten: ForgottenHistory,
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
    /// When it reached a terminal state: the retention window counts from
    /// here (`None` while live; see [`ReservationRecord::retained_since`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<Timestamp>,
    /// The identity that reserved it: only it acts on the reservation (the
    /// operator token may read and abandon it too). `None` only in records
    /// written before reservations had owners; they age out with the
    /// retention window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<GatewayIdentity>,
}

impl ReservationRecord {
    pub fn account_key(&self) -> AccountKey {
        AccountKey {
            pair: PairKey::new(self.receipt.subject.clone(), self.receipt.route.clone()),
            accounting_epoch: self.receipt.accounting_epoch,
            policy_generation: self.receipt.policy_generation,
        }
    }

    /// Whether the reservation is in account `key` (`account_key() ==
    /// *key`, without building the key).
    pub fn is_in_account(&self, key: &AccountKey) -> bool {
        self.receipt.accounting_epoch == key.accounting_epoch
            && self.receipt.policy_generation == key.policy_generation
            && self.receipt.subject == key.pair.subject
            && self.receipt.route == key.pair.route
    }

    /// When the retention window of a terminal reservation started; `None`
    /// while it is live. Records written before `endedAt` existed count
    /// from their settlement, or else from their hold's expiry.
    pub fn retained_since(&self) -> Option<Timestamp> {
        if !self.receipt.state.is_terminal() {
            return None;
        }
        Some(self.ended_at.unwrap_or_else(|| {
            self.settlement
                .as_ref()
                .map_or(self.receipt.expires_at, |settlement| settlement.settled_at)
        }))
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
    /// The identity that abandoned the ID (its owner: only an identity's own
    /// IDs can be abandoned before they exist). `None` in tombstones written
    /// before reservations had owners, or laid by the operator.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<GatewayIdentity>,
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
    /// The request that registered the current boot: a later registration
    /// must come with another nonce and a later `requestedAt` (a replayed
    /// boot request is refused). `None` before the first registration and
    /// in records written before requests carried one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_boot_request: Option<BootRequest>,
}

/// What a boot registration carries besides its signature: a nonce the
/// agent drew for this request and the agent's clock when it sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct BootRequest {
    pub request_nonce: BootNonce,
    pub requested_at: Timestamp,
}

/// What reconciling a shard's terminal receipt did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
    /// When the lost-shard sweep found it unreconciled past `notAfter` plus
    /// the grace ([`crate::CentralConfig::shard_lost_grace_ms`]): its units
    /// stay retired (only a receipt re-mints), it no longer counts toward
    /// the identity's cap of unreconciled shard units, and a late receipt
    /// is still reconciled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost_at: Option<Timestamp>,
}

impl ShardRecord {
    /// Issued, neither reconciled nor lost: counts toward the identity's
    /// cap and awaits the lost-shard sweep.
    pub fn is_open(&self) -> bool {
        self.reconciliation.is_none() && self.lost_at.is_none()
    }

    /// Lost and never reconciled: its units are retired for good unless a
    /// receipt still comes.
    pub fn is_lost(&self) -> bool {
        self.reconciliation.is_none() && self.lost_at.is_some()
    }

    /// When its retention window started: its reconciliation, or else when
    /// it was marked lost; `None` while open.
    pub fn retained_since(&self) -> Option<Timestamp> {
        self.reconciliation
            .as_ref()
            .map(|done| done.reconciled_at)
            .or(self.lost_at)
    }

    pub fn account_key(&self) -> AccountKey {
        AccountKey {
            pair: PairKey::new(self.shard.subject.clone(), self.shard.route.clone()),
            accounting_epoch: self.shard.accounting_epoch,
            policy_generation: self.shard.policy_generation,
        }
    }

    /// Whether the shard was cut from account `key` (`account_key() ==
    /// *key`, without building the key).
    pub fn is_in_account(&self, key: &AccountKey) -> bool {
        self.shard.accounting_epoch == key.accounting_epoch
            && self.shard.policy_generation == key.policy_generation
            && self.shard.subject == key.pair.subject
            && self.shard.route == key.pair.route
    }
}

/// One record to write (insert or replace, keyed by its natural key), or
/// one to forget.
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
    /// The record under this key leaves the store (retention): a store
    /// deletes it; loading never meets one.
    Forget(RecordKey),
}

/// The natural key of a [`Change`]: a later change with the same key
/// replaces the earlier record.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
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
            Self::Forget(key) => key.clone(),
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
