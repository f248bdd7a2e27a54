//! The JSON bodies of the central API's answers (besides the v1 documents
//! and error bodies), and the read-only views of a loaded ledger they show:
//! the accounts of a pair, the audit, the gauges.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use shard_format::{
    AdmissionBudgetV1, BootNonce, GatewayIdentity, LimitReservationV1, ReservationId, Route,
    ShardId, Subject, Timestamp,
};

use super::code::{ErrorCode, Outcome};
use crate::central::CentralLedger;
use crate::invariants::{Violation, audit, check_account};
use crate::records::{
    AccountKey, Change, ClosedHistory, ForgottenHistory, PairKey, PairRecord, Reconciliation,
    ShardRecord,
};
use crate::terms::AccountTerms;

/// Totals for the Prometheus gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gauges {
    pub debt_outstanding: u64,
    pub frozen_routes: u64,
    /// Units of open shards (neither reconciled nor lost).
    pub shard_units_out: u64,
    pub open_shards: u64,
    /// Shards marked lost and never reconciled, stored or forgotten.
    pub lost_shards: u64,
    /// Their units: retired for good unless a late receipt comes.
    pub lost_shard_units: u64,
    pub units_reserved: u64,
    /// Reservations not yet terminal.
    pub reservations_live: u64,
    /// Terminal reservations kept for the retention window.
    pub reservations_retained: u64,
    /// Reconciled shards kept for the retention window.
    pub shards_reconciled: u64,
    /// Tombstones kept for the retention window.
    pub tombstones: u64,
    /// Account records stored.
    pub accounts: u64,
    /// Accounts folded into their pair's closed history.
    pub accounts_folded: u64,
    /// Reservations forgotten after the window, over the stored accounts
    /// and the pairs' closed histories.
    pub reservations_forgotten: u64,
    /// Bytes the store takes on disk (0: unknown); set by the store, not
    /// by [`gauges`].
    pub store_bytes: u64,
}

/// `PUT /v1/policies` → 201.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct PublishResponse {
    pub subject: Subject,
    pub route: Route,
    pub policy_generation: u64,
}

/// `PUT /v1/gateways/{identity}` → 201 (new) or 200 (already enrolled).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct EnrollResponse {
    pub identity: GatewayIdentity,
    /// False when the identity was enrolled already.
    pub enrolled: bool,
}

/// `POST /v1/gateways/{identity}/boot` → 201.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct BootResponse {
    pub identity: GatewayIdentity,
    pub boot_epoch: u64,
    /// Hold it in memory only: shards are bound to it.
    pub boot_nonce: BootNonce,
}

/// `POST /v1/accounts/{subject}/{route}/admission` and `/freeze` → 200.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct RouteControlResponse {
    /// False when the pair was in the asked state already.
    pub changed: bool,
}

/// `POST /v1/reservations/{reservation}/abandon` → 200.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct AbandonResponse {
    pub reservation: ReservationId,
    /// `tombstoned` (the ID was unknown), `abandoned` (it was `RESERVED` and
    /// is released) or `duplicate`.
    pub outcome: Outcome,
    /// `abandoned`: the receipt of the released reservation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt: Option<Box<LimitReservationV1>>,
}

/// `POST /v1/shards/{shard}/receipt` → 200.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct ReconcileResponse {
    pub shard: ShardId,
    /// True when the shard had been reconciled before: nothing moved now.
    pub duplicate: bool,
    pub reconciliation: Reconciliation,
}

/// One account in `GET /v1/accounts/{subject}/{route}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct AccountView {
    pub accounting_epoch: Timestamp,
    pub policy_generation: u64,
    #[serde(flatten)]
    pub terms: AccountTerms,
    pub debt: u64,
    /// What the account's forgotten reservations and shards accounted for
    /// (retention, docs/design.md §3.10).
    #[serde(default, skip_serializing_if = "ForgottenHistory::is_empty")]
    pub forgotten: ForgottenHistory,
    /// Stored shards of the account marked lost and never reconciled
    /// (forgotten ones are in `forgotten.lostShards`).
    #[serde(default)]
    pub lost_shards: u64,
    /// Their units (part of `retiredForEmergency`).
    #[serde(default)]
    pub lost_units: u64,
}

/// `GET /v1/accounts/{subject}/{route}` → 200.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct AccountsResponse {
    pub subject: Subject,
    pub route: Route,
    pub current_generation: u64,
    /// The current generation's policy, as published.
    pub policy: Box<AdmissionBudgetV1>,
    pub admission_stopped: bool,
    pub frozen: bool,
    /// Outstanding debt across the pair's accounts.
    pub debt: u64,
    /// Oldest first.
    pub accounts: Vec<AccountView>,
    /// The pair's folded accounts, summed (docs/design.md §3.10).
    #[serde(default, skip_serializing_if = "ClosedHistory::is_empty")]
    pub closed_history: ClosedHistory,
}

/// One broken rule in an audit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
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
    /// Units of open shards (neither reconciled nor lost).
    pub open_shard_units: u64,
    pub open_shards: usize,
    /// Stored shards marked lost and never reconciled.
    #[serde(default)]
    pub lost_shards: usize,
    /// Their units: still in `retiredForEmergency`.
    #[serde(default)]
    pub lost_shard_units: u64,
    /// Whether every account of the pair holds its equation.
    pub balanced: bool,
    /// The same, per policy generation (oldest first).
    pub generations: Vec<AuditGeneration>,
}

/// `GET /v1/audit` → 200 (`ok: true`) or 500 (`ok: false`, with the
/// offending accounts, and `error: "audit_drift"` and a `message` like
/// every other answer that is not a 2xx).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct AuditResponse {
    /// `audit_drift` when not `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorCode>,
    /// What drifted, as a sentence, when not `ok`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
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
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct NotEnforcedResponse {
    pub mode: String,
}

/// `GET /v1/accounts/{subject}/{route}`: every account of the pair.
pub fn accounts_view(ledger: &CentralLedger, pair: &PairKey) -> Option<AccountsResponse> {
    let record = ledger.pair(pair)?;
    let mut lost: BTreeMap<AccountKey, (u64, u64)> = BTreeMap::new();
    for shard in ledger.shards().filter(|shard| shard.is_lost()) {
        let key = shard.account_key();
        if &key.pair == pair {
            let entry = lost.entry(key).or_default();
            entry.0 += 1;
            entry.1 = entry.1.saturating_add(shard.shard.allocated_units);
        }
    }
    let accounts: Vec<AccountView> = ledger
        .account_states()
        .filter(|(key, _)| &key.pair == pair)
        .map(|(key, account)| {
            let (lost_shards, lost_units) = lost.get(&key).copied().unwrap_or_default();
            AccountView {
                accounting_epoch: key.accounting_epoch,
                policy_generation: key.policy_generation,
                terms: account.terms,
                debt: account.terms.debt(),
                forgotten: account.forgotten,
                lost_shards,
                lost_units,
            }
        })
        .collect();
    Some(AccountsResponse {
        subject: pair.subject.clone(),
        route: pair.route.clone(),
        current_generation: record.current_generation,
        policy: Box::new(ledger.policy(pair)?.clone()),
        admission_stopped: record.admission_stopped,
        frozen: record.frozen,
        debt: accounts
            .iter()
            .fold(0u64, |sum, account| sum.saturating_add(account.debt)),
        accounts,
        closed_history: record.closed_history,
    })
}

/// The Prometheus gauges over the loaded ledger.
pub fn gauges(ledger: &CentralLedger) -> Gauges {
    let mut gauges = Gauges::default();
    for (_, terms) in ledger.accounts() {
        gauges.debt_outstanding = gauges.debt_outstanding.saturating_add(terms.debt());
        gauges.units_reserved = gauges.units_reserved.saturating_add(terms.reserved);
    }
    for (_, state) in ledger.account_states() {
        gauges.accounts += 1;
        gauges.reservations_forgotten = gauges
            .reservations_forgotten
            .saturating_add(state.forgotten.reservations);
        gauges.lost_shards = gauges
            .lost_shards
            .saturating_add(state.forgotten.lost_shards);
        gauges.lost_shard_units = gauges
            .lost_shard_units
            .saturating_add(state.forgotten.lost_units);
    }
    for pair in ledger.pairs() {
        gauges.frozen_routes += u64::from(pair.frozen);
        gauges.accounts_folded = gauges
            .accounts_folded
            .saturating_add(pair.closed_history.accounts);
        gauges.reservations_forgotten = gauges
            .reservations_forgotten
            .saturating_add(pair.closed_history.forgotten.reservations);
        gauges.lost_shards = gauges
            .lost_shards
            .saturating_add(pair.closed_history.forgotten.lost_shards);
        gauges.lost_shard_units = gauges
            .lost_shard_units
            .saturating_add(pair.closed_history.forgotten.lost_units);
    }
    // The records a day's retention keeps, counted as they changed: a
    // scrape passes over the pairs and their accounts only.
    let counts = ledger.record_counts();
    gauges.reservations_live = counts.reservations_live;
    gauges.reservations_retained = counts.reservations_retained;
    gauges.tombstones = ledger.tombstone_count();
    gauges.shards_reconciled = counts.shards_reconciled;
    gauges.open_shards = counts.open_shards;
    gauges.shard_units_out = counts.shard_units_out;
    gauges.lost_shards = gauges.lost_shards.saturating_add(counts.lost_shards);
    gauges.lost_shard_units = gauges
        .lost_shard_units
        .saturating_add(counts.lost_shard_units);
    gauges
}

/// The audit of a loaded ledger.
pub fn audit_view(ledger: &CentralLedger) -> AuditResponse {
    let report = audit(ledger);
    let pairs = pair_table(
        ledger.pairs(),
        ledger.accounts().map(|(key, terms)| (key, *terms)),
        ledger.shards(),
    );
    AuditResponse {
        error: None,
        message: None,
        ok: report.is_clean(),
        accounts: report.accounts,
        reservations: report.reservations,
        shards: report.shards,
        debt: report.debt,
        pairs,
        violations: report.violations.iter().map(violation_view).collect(),
    }
    .with_verdict()
}

/// The audit of records that could not even be loaded into a ledger (the
/// load itself found the violations).
pub fn audit_of_records(records: &[Change], violations: &[Violation]) -> AuditResponse {
    let pairs_records = records.iter().filter_map(|change| match change {
        Change::Pair(record) => Some(record),
        _ => None,
    });
    let accounts = records.iter().filter_map(|change| match change {
        Change::Account(account) => Some((account.key.clone(), account.terms)),
        _ => None,
    });
    let shards = records.iter().filter_map(|change| match change {
        Change::Shard(record) => Some(record.as_ref()),
        _ => None,
    });
    let pairs = pair_table(pairs_records, accounts, shards);
    let count = |kind: fn(&Change) -> bool| records.iter().filter(|change| kind(change)).count();
    AuditResponse {
        error: None,
        message: None,
        ok: violations.is_empty(),
        accounts: count(|change| matches!(change, Change::Account(_))),
        reservations: count(|change| matches!(change, Change::Reservation(_))),
        shards: count(|change| matches!(change, Change::Shard(_))),
        debt: pairs
            .iter()
            .fold(0u64, |sum, pair| sum.saturating_add(pair.debt)),
        pairs,
        violations: violations.iter().map(violation_view).collect(),
    }
    .with_verdict()
}

impl AuditResponse {
    /// An audit that found drift is an error answer too (500): it carries
    /// `error` and `message` (docs/design.md §6.1).
    fn with_verdict(mut self) -> Self {
        if !self.ok {
            self.error = Some(ErrorCode::AuditDrift);
            self.message = Some(format!(
                "the audit found {} violation(s) of the ledger's equations",
                self.violations.len()
            ));
        }
        self
    }
}

fn pair_table<'a>(
    pairs: impl Iterator<Item = &'a PairRecord>,
    accounts: impl Iterator<Item = (AccountKey, AccountTerms)>,
    shards: impl Iterator<Item = &'a ShardRecord>,
) -> Vec<AuditPair> {
    let mut table: BTreeMap<PairKey, AuditPair> = pairs
        .map(|record| {
            (
                record.pair.clone(),
                AuditPair {
                    subject: record.pair.subject.clone(),
                    route: record.pair.route.clone(),
                    current_generation: record.current_generation,
                    admission_stopped: record.admission_stopped,
                    frozen: record.frozen,
                    accounts: 0,
                    reserved: 0,
                    debt: 0,
                    open_shard_units: 0,
                    open_shards: 0,
                    lost_shards: 0,
                    lost_shard_units: 0,
                    balanced: true,
                    generations: Vec::new(),
                },
            )
        })
        .collect();
    fn generation(line: &mut AuditPair, policy_generation: u64) -> &mut AuditGeneration {
        let index = match line
            .generations
            .binary_search_by_key(&policy_generation, |entry| entry.policy_generation)
        {
            Ok(index) => index,
            Err(index) => {
                line.generations.insert(
                    index,
                    AuditGeneration {
                        policy_generation,
                        reserved: 0,
                        debt: 0,
                        open_shard_units: 0,
                    },
                );
                index
            }
        };
        &mut line.generations[index]
    }
    for (key, terms) in accounts {
        if let Some(line) = table.get_mut(&key.pair) {
            line.accounts += 1;
            line.reserved = line.reserved.saturating_add(terms.reserved);
            line.debt = line.debt.saturating_add(terms.debt());
            line.balanced &= check_account(&key, &terms).is_none();
            let entry = generation(line, key.policy_generation);
            entry.reserved = entry.reserved.saturating_add(terms.reserved);
            entry.debt = entry.debt.saturating_add(terms.debt());
        }
    }
    for record in shards.filter(|record| record.reconciliation.is_none()) {
        let key = record.account_key();
        if record.is_lost() {
            if let Some(line) = table.get_mut(&key.pair) {
                line.lost_shards += 1;
                line.lost_shard_units = line
                    .lost_shard_units
                    .saturating_add(record.shard.allocated_units);
            }
            continue;
        }
        if let Some(line) = table.get_mut(&key.pair) {
            line.open_shards += 1;
            line.open_shard_units = line
                .open_shard_units
                .saturating_add(record.shard.allocated_units);
            let entry = generation(line, key.policy_generation);
            entry.open_shard_units = entry
                .open_shard_units
                .saturating_add(record.shard.allocated_units);
        }
    }
    table.into_values().collect()
}

fn violation_view(violation: &Violation) -> AuditViolation {
    let mut view = AuditViolation {
        subject: None,
        route: None,
        accounting_epoch: None,
        policy_generation: None,
        reservation: None,
        shard: None,
        message: violation.to_string(),
    };
    let account = match violation {
        Violation::AccountEquation { account, .. }
        | Violation::RepaidAboveIssued { account, .. }
        | Violation::ReservedMismatch { account, .. }
        | Violation::RetiredMismatch { account, .. }
        | Violation::UsageMismatch { account, .. }
        | Violation::RecordCount { account, .. }
        | Violation::MissingAccount { account } => Some(account),
        Violation::ClosedHistory { pair, .. } => {
            view.subject = Some(pair.subject.clone());
            view.route = Some(pair.route.clone());
            None
        }
        Violation::Settlement { reservation } | Violation::LegsApart { reservation, .. } => {
            view.reservation = Some(reservation.clone());
            None
        }
        Violation::Reconciliation { shard }
        | Violation::LostEarly { shard }
        | Violation::ShardEquation { shard, .. } => {
            view.shard = Some(shard.clone());
            None
        }
    };
    if let Some(account) = account {
        view.subject = Some(account.pair.subject.clone());
        view.route = Some(account.pair.route.clone());
        view.accounting_epoch = Some(account.accounting_epoch);
        view.policy_generation = Some(account.policy_generation);
    }
    view
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/design.md §6.1: the audit's 500 is an error answer like any
    /// other (`error`, `message`); a clean audit carries neither.
    #[test]
    fn an_audit_with_drift_names_its_code() {
        let clean = audit_of_records(&[], &[]);
        assert!(clean.ok);
        assert_eq!((clean.error, clean.message.as_deref()), (None, None));
        let json = serde_json::to_value(&clean).expect("serializes");
        assert!(json.get("error").is_none() && json.get("message").is_none());

        let reservation = ReservationId::new("rl-drift").expect("valid");
        let drift = audit_of_records(&[], &[Violation::Settlement { reservation }]);
        assert!(!drift.ok);
        assert_eq!(drift.error, Some(ErrorCode::AuditDrift));
        let json = serde_json::to_value(&drift).expect("serializes");
        assert_eq!(json["error"], "audit_drift");
        assert!(
            json["message"]
                .as_str()
                .is_some_and(|message| message.contains("1 violation")),
            "{json}"
        );
    }
}
