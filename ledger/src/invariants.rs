//! The conservation equations and the rules around them, as code. The state
//! machines assert them after every transition in debug and test builds; the
//! operator's audit runs [`audit`] in production.

use std::collections::BTreeMap;
use std::fmt;

use shard_format::{ReservationId, ShardId};

use crate::central::CentralLedger;
use crate::records::{AccountKey, Change, ClosedHistory, PairKey};
use crate::terms::{AccountTerms, ShardTerms};

/// One broken rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    /// `opening + minted + overdraftIssued ≠ available + reserved + spent +
    /// retiredForEmergency + overdraftRepaid`, or a term overflowed.
    AccountEquation {
        account: AccountKey,
        terms: AccountTerms,
    },
    /// More debt repaid than issued.
    RepaidAboveIssued {
        account: AccountKey,
        terms: AccountTerms,
    },
    /// `reserved` differs from the units its live reservations hold.
    ReservedMismatch {
        account: AccountKey,
        recorded: u64,
        held: u64,
    },
    /// `retiredForEmergency` differs from the units of its shards.
    RetiredMismatch {
        account: AccountKey,
        recorded: u64,
        allocated: u64,
    },
    /// `spent` or `overdraftIssued` differs from what the account's
    /// settlements and reconciled shard receipts recorded: usage or debt
    /// went missing (or appeared from nowhere).
    UsageMismatch {
        account: AccountKey,
        spent: u64,
        settled: u64,
        overdraft_issued: u64,
        debts: u64,
    },
    /// A reservation or shard names an account that does not exist.
    MissingAccount { account: AccountKey },
    /// The account's count of its stored reservation and shard records
    /// differs from the records there are (retention would fold it too
    /// early, or never).
    RecordCount {
        account: AccountKey,
        recorded: u64,
        stored: u64,
    },
    /// A pair's closed history breaks its equation: the central one, with
    /// nothing reserved, no debt, and `spent`, `overdraftIssued` and
    /// `retiredForEmergency` equal to what its forgotten records accounted
    /// for.
    ClosedHistory {
        pair: PairKey,
        history: ClosedHistory,
    },
    /// A settled reservation without exactly one matching settlement
    /// receipt, or a settlement on an unsettled one.
    Settlement { reservation: ReservationId },
    /// A reconciliation whose parts do not add up to the confirmed unused
    /// units.
    Reconciliation { shard: ShardId },
    /// A shard marked lost before its `notAfter`: the sweep took units
    /// from an agent that could still spend them.
    LostEarly { shard: ShardId },
    /// `allocated ≠ localAvailable + localReserved + localSpent + localRetired`.
    ShardEquation { shard: ShardId, terms: ShardTerms },
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AccountEquation { account, terms } => {
                write!(
                    f,
                    "account {account:?} breaks the central equation: {terms:?}"
                )
            }
            Self::RepaidAboveIssued { account, terms } => {
                write!(
                    f,
                    "account {account:?} repaid more than it issued: {terms:?}"
                )
            }
            Self::ReservedMismatch {
                account,
                recorded,
                held,
            } => write!(
                f,
                "account {account:?} records reserved {recorded} but its reservations hold {held}"
            ),
            Self::RetiredMismatch {
                account,
                recorded,
                allocated,
            } => write!(
                f,
                "account {account:?} records retiredForEmergency {recorded} but its shards hold {allocated}"
            ),
            Self::UsageMismatch {
                account,
                spent,
                settled,
                overdraft_issued,
                debts,
            } => write!(
                f,
                "account {account:?} records spent {spent} and overdraftIssued {overdraft_issued} but its settlements and receipts add up to {settled} and {debts}"
            ),
            Self::MissingAccount { account } => write!(f, "account {account:?} is missing"),
            Self::RecordCount {
                account,
                recorded,
                stored,
            } => write!(
                f,
                "account {account:?} counts {recorded} records but {stored} are stored"
            ),
            Self::ClosedHistory { pair, history } => {
                write!(
                    f,
                    "pair {pair:?} has an unbalanced closed history: {history:?}"
                )
            }
            Self::Settlement { reservation } => {
                write!(
                    f,
                    "reservation {reservation} has an inconsistent settlement"
                )
            }
            Self::Reconciliation { shard } => {
                write!(f, "shard {shard} has an inconsistent reconciliation")
            }
            Self::LostEarly { shard } => {
                write!(f, "shard {shard} was marked lost before its notAfter")
            }
            Self::ShardEquation { shard, terms } => {
                write!(f, "shard {shard} breaks the shard equation: {terms:?}")
            }
        }
    }
}

/// What an audit found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditReport {
    pub accounts: usize,
    pub reservations: usize,
    pub shards: usize,
    pub debt: u64,
    pub violations: Vec<Violation>,
}

impl AuditReport {
    pub fn is_clean(&self) -> bool {
        self.violations.is_empty()
    }
}

/// The equation of one account, alone.
pub fn check_account(account: &AccountKey, terms: &AccountTerms) -> Option<Violation> {
    if terms.sources().is_none() || terms.uses().is_none() || terms.sources() != terms.uses() {
        return Some(Violation::AccountEquation {
            account: account.clone(),
            terms: *terms,
        });
    }
    if terms.overdraft_repaid > terms.overdraft_issued {
        return Some(Violation::RepaidAboveIssued {
            account: account.clone(),
            terms: *terms,
        });
    }
    None
}

/// The equation of one shard, alone.
pub fn check_shard(shard: &ShardId, terms: &ShardTerms) -> Option<Violation> {
    (!terms.is_balanced()).then(|| Violation::ShardEquation {
        shard: shard.clone(),
        terms: *terms,
    })
}

/// The equation of a pair's closed history, alone.
pub fn check_closed_history(pair: &PairKey, history: &ClosedHistory) -> Option<Violation> {
    let terms = &history.terms;
    let balanced = terms.is_balanced()
        && terms.reserved == 0
        && terms.debt() == 0
        && terms.spent == history.forgotten.spent
        && terms.overdraft_issued == history.forgotten.overdraft_issued
        && terms.retired_for_emergency == history.forgotten.shard_units;
    (!balanced).then(|| Violation::ClosedHistory {
        pair: pair.clone(),
        history: *history,
    })
}

/// Checks every account, reservation and shard of the ledger. A ledger
/// loaded from live records only ([`CentralLedger::from_live_records`])
/// skips the usage check, which needs the settled history.
pub fn audit(ledger: &CentralLedger) -> AuditReport {
    audit_scoped(ledger, ledger.holds_history())
}

fn audit_scoped(ledger: &CentralLedger, check_usage: bool) -> AuditReport {
    let mut report = AuditReport::default();
    let mut held: BTreeMap<AccountKey, u64> = BTreeMap::new();
    let mut allocated: BTreeMap<AccountKey, u64> = BTreeMap::new();
    // Reservation and shard records stored per account.
    let mut stored: BTreeMap<AccountKey, u64> = BTreeMap::new();
    // (spent, overdraft issued) each account's records account for.
    let mut usage: BTreeMap<AccountKey, (u64, u64)> = BTreeMap::new();
    for record in ledger.reservations() {
        report.reservations += 1;
        let units = record.held_units();
        let key = record.account_key();
        *stored.entry(key.clone()).or_default() += 1;
        let entry = held.entry(key).or_default();
        *entry = entry.saturating_add(units);
        if let Some(settlement) = &record.settlement
            && !record.shadow
        {
            let entry = usage.entry(record.account_key()).or_default();
            entry.0 = entry.0.saturating_add(settlement.actual_units);
            entry.1 = entry.1.saturating_add(settlement.overdraft_units);
        }
        let settled = record.receipt.state.is_settled();
        let consistent = match &record.settlement {
            Some(settlement) => {
                settled
                    && settlement.state == record.receipt.state
                    && Some(settlement.actual_units) == record.receipt.actual_units
                    && settlement.reservation == record.receipt.reservation
            }
            None => !settled,
        };
        if !consistent {
            report.violations.push(Violation::Settlement {
                reservation: record.receipt.reservation.clone(),
            });
        }
    }
    for record in ledger.shards() {
        report.shards += 1;
        let key = record.account_key();
        *stored.entry(key.clone()).or_default() += 1;
        let entry = allocated.entry(key).or_default();
        *entry = entry.saturating_add(record.shard.allocated_units);
        if record
            .lost_at
            .is_some_and(|lost_at| lost_at < record.shard.not_after)
        {
            report.violations.push(Violation::LostEarly {
                shard: record.shard.shard.clone(),
            });
        }
        if let Some(done) = &record.reconciliation {
            let entry = usage.entry(record.account_key()).or_default();
            entry.0 = entry.0.saturating_add(done.overdraft_debt_units);
            entry.1 = entry.1.saturating_add(done.overdraft_debt_units);
            let parts = done
                .repaid_units
                .checked_add(done.reminted_units)
                .and_then(|sum| sum.checked_add(done.cut_units));
            if parts != Some(done.confirmed_unused_units) {
                report.violations.push(Violation::Reconciliation {
                    shard: record.shard.shard.clone(),
                });
            }
        }
    }
    for (key, account) in ledger.account_states() {
        let terms = &account.terms;
        let forgotten = &account.forgotten;
        report.accounts += 1;
        report.debt = report.debt.saturating_add(terms.debt());
        report.violations.extend(check_account(&key, terms));
        let reservations_hold = held.remove(&key).unwrap_or(0);
        if terms.reserved != reservations_hold {
            report.violations.push(Violation::ReservedMismatch {
                account: key.clone(),
                recorded: terms.reserved,
                held: reservations_hold,
            });
        }
        let (settled, debts) = usage.remove(&key).unwrap_or((0, 0));
        let settled = settled.saturating_add(forgotten.spent);
        let debts = debts.saturating_add(forgotten.overdraft_issued);
        if check_usage && (terms.spent != settled || terms.overdraft_issued != debts) {
            report.violations.push(Violation::UsageMismatch {
                account: key.clone(),
                spent: terms.spent,
                settled,
                overdraft_issued: terms.overdraft_issued,
                debts,
            });
        }
        let records_stored = stored.remove(&key).unwrap_or(0);
        if check_usage
            && let Some(recorded) = account.records
            && recorded != records_stored
        {
            report.violations.push(Violation::RecordCount {
                account: key.clone(),
                recorded,
                stored: records_stored,
            });
        }
        let shards_hold = allocated
            .remove(&key)
            .unwrap_or(0)
            .saturating_add(forgotten.shard_units);
        if terms.retired_for_emergency != shards_hold {
            report.violations.push(Violation::RetiredMismatch {
                account: key,
                recorded: terms.retired_for_emergency,
                allocated: shards_hold,
            });
        }
    }
    for pair in ledger.pairs() {
        if let Some(violation) = check_closed_history(&pair.pair, &pair.closed_history) {
            report.violations.push(violation);
        }
    }
    // Whatever is left points at accounts that do not exist.
    for (account, units) in held.into_iter().chain(allocated) {
        if units > 0 {
            report
                .violations
                .push(Violation::MissingAccount { account });
        }
    }
    report
}

/// Above this many reservations, debug builds check only the accounts a
/// transition touched: a full audit per transition would make large debug
/// runs quadratic.
#[cfg(debug_assertions)]
const DEBUG_FULL_AUDIT_RESERVATIONS_MAX: usize = 2048;

/// Panics if the transition left the ledger inconsistent. Every build
/// checks the equation of each account the transition touched (a few
/// additions per account: the ledger must never run on a broken account,
/// and a crash makes the shell reload from the store); debug builds also
/// audit the whole ledger while it is small. The full audit runs in
/// production periodically and on demand (`GET /v1/audit`).
pub(crate) fn assert_after_transition(ledger: &CentralLedger, changes: &[Change]) {
    for change in changes {
        let violation = match change {
            Change::Account(account) => check_account(&account.key, &account.terms),
            Change::Pair(pair) => check_closed_history(&pair.pair, &pair.closed_history),
            _ => None,
        };
        if let Some(violation) = violation {
            panic!("ledger invariant broken by a transition: {violation}");
        }
    }
    #[cfg(debug_assertions)]
    if !changes.is_empty() && ledger.reservations().count() <= DEBUG_FULL_AUDIT_RESERVATIONS_MAX {
        let report = audit(ledger);
        assert!(
            report.is_clean(),
            "ledger invariants broken by a transition: {:?}",
            report.violations
        );
    }
    #[cfg(not(debug_assertions))]
    let _ = ledger;
}

#[cfg(test)]
pub(crate) mod tests {
    use shard_format::{Route, Subject, Timestamp};

    use super::*;
    use crate::central::CentralConfig;
    use crate::records::{AccountRecord, PairKey};

    /// The seed pair's first account with `terms`, as a record to load.
    pub(crate) fn account(terms: AccountTerms) -> Change {
        Change::Account(AccountRecord {
            key: AccountKey {
                pair: PairKey::new(
                    Subject::new("tenant-7").expect("valid"),
                    Route::new("chat.generate").expect("valid"),
                ),
                accounting_epoch: Timestamp::from_unix_ms(0).expect("valid"),
                policy_generation: 1,
            },
            terms,
            records: Some(0),
            forgotten: Default::default(),
        })
    }

    /// The check every build runs after a transition: one unit off in a
    /// touched account is a crash, not a log line.
    #[test]
    #[should_panic(expected = "ledger invariant broken by a transition")]
    fn a_touched_account_one_unit_off_panics() {
        let ledger = CentralLedger::new(CentralConfig::default());
        let mut terms = AccountTerms::open(1000);
        terms.available -= 1;
        assert_after_transition(&ledger, &[account(terms)]);
    }

    /// A report is clean exactly when it lists no violation: what the
    /// audit view answers (`ok`) and the debug audit asserts.
    #[test]
    fn a_report_with_one_violation_is_not_clean() {
        assert!(AuditReport::default().is_clean());
        let mut terms = AccountTerms::open(1000);
        terms.available -= 1;
        let Change::Account(record) = account(terms) else {
            unreachable!("an account change");
        };
        let violation = check_account(&record.key, &record.terms).expect("one unit off");
        let report = AuditReport {
            violations: vec![violation],
            ..AuditReport::default()
        };
        assert!(!report.is_clean());
    }

    /// The same holds for a touched pair's closed history.
    #[test]
    #[should_panic(expected = "ledger invariant broken by a transition")]
    fn a_touched_closed_history_one_unit_off_panics() {
        let ledger = CentralLedger::new(CentralConfig::default());
        let Change::Account(account) = account(AccountTerms::open(1000)) else {
            unreachable!("an account change");
        };
        let mut terms = AccountTerms::open(1000);
        terms.available -= 1;
        let pair = crate::records::PairRecord {
            pair: account.key.pair,
            current_generation: 1,
            admission_stopped: false,
            frozen: false,
            last_refill_at: account.key.accounting_epoch,
            next_fence: 1,
            closed_history: ClosedHistory {
                accounts: 1,
                terms,
                forgotten: Default::default(),
            },
        };
        assert_after_transition(&ledger, &[Change::Pair(pair)]);
    }

    #[test]
    fn a_balanced_touched_account_passes() {
        let ledger = CentralLedger::new(CentralConfig::default());
        let mut terms = AccountTerms::open(1000);
        terms.available -= 1;
        terms.reserved += 1;
        assert_after_transition(&ledger, &[account(terms)]);
    }
}
