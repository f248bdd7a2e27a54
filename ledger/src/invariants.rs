//! The conservation equations and the rules around them, as code. The state
//! machines assert them after every transition in debug and test builds; the
//! operator's audit runs [`audit`] in production.

use std::collections::BTreeMap;
use std::fmt;

use shard_format::{ReservationId, ReservationState, Route, ShardId, Subject, Timestamp};

use crate::central::{AccountState, CentralLedger};
use crate::records::{AccountKey, Change, ClosedHistory, PairKey, ReservationRecord, ShardRecord};
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
    /// Legs of one reservation apart: a leg whose sibling (as far as it is
    /// stored) lists other legs, or is in another state, bound to another
    /// operation or held until another time. Legs move together.
    LegsApart {
        reservation: ReservationId,
        sibling: ReservationId,
    },
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
            Self::LegsApart {
                reservation,
                sibling,
            } => write!(
                f,
                "legs {reservation} and {sibling} of one reservation are apart (legs, state, operation or expiry differ)"
            ),
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

/// A stored sibling leg of `record` that is not where `record` is: other
/// legs listed, another state, operation or expiry. A sibling not stored
/// (forgotten, or not loaded by a scoped store) is not judged here.
/// `SETTLED` and `SETTLED_WITH_DEBT` are one state here: legs settle
/// together, and only a leg whose own overage became debt says so.
fn leg_apart(ledger: &CentralLedger, record: &ReservationRecord) -> Option<ReservationId> {
    fn phase(state: ReservationState) -> ReservationState {
        match state {
            ReservationState::SettledWithDebt => ReservationState::Settled,
            other => other,
        }
    }
    let legs = record.receipt.legs.as_ref()?;
    legs.iter().find_map(|leg| {
        let sibling = ledger.reservation(&leg.reservation)?;
        let apart = sibling.receipt.legs.as_ref() != Some(legs)
            || phase(sibling.receipt.state) != phase(record.receipt.state)
            || sibling.receipt.operation_id != record.receipt.operation_id
            || sibling.receipt.expires_at != record.receipt.expires_at
            || sibling.usage_deadline != record.usage_deadline;
        apart.then(|| leg.reservation.clone())
    })
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
    audit_scoped(ledger, ledger.holds_history(), None)
}

/// The audit of what `changes` (one or more committed transitions)
/// touched: every account a written account, reservation or shard record
/// belongs to, with all of its reservations and shards (the same checks
/// [`audit`] makes of it), and every pair a written pair or account
/// belongs to. What the changes did not name is not looked at: a caller
/// that checks only touched records must still run [`audit`] now and then
/// (the simulator does, every few steps and at the end of a run).
pub fn audit_touched(ledger: &CentralLedger, changes: &[Change]) -> AuditReport {
    let mut touched: Vec<KeyRef<'_>> = Vec::new();
    let mut pairs: Vec<&PairKey> = Vec::new();
    for change in changes {
        let key = match change {
            Change::Account(account) => {
                pairs.push(&account.key.pair);
                key_ref(&account.key)
            }
            Change::Reservation(record) => reservation_key(record),
            Change::Shard(record) => shard_key(record),
            Change::Pair(pair) => {
                pairs.push(&pair.pair);
                continue;
            }
            _ => continue,
        };
        if !touched.contains(&key) {
            touched.push(key);
        }
    }
    pairs.sort_unstable();
    pairs.dedup();
    let mut report = audit_scoped(ledger, ledger.holds_history(), Some(&touched));
    for pair in pairs {
        if let Some(record) = ledger.pair(pair)
            && let Some(violation) = check_closed_history(&record.pair, &record.closed_history)
        {
            report.violations.push(violation);
        }
    }
    report
}

/// An account key borrowed from the records that name it: the audit keys
/// its tallies by it, so that counting a record clones no identifier.
/// Ordered as [`AccountKey`] is.
type KeyRef<'a> = (&'a Subject, &'a Route, Timestamp, u64);

fn key_ref(key: &AccountKey) -> KeyRef<'_> {
    (
        &key.pair.subject,
        &key.pair.route,
        key.accounting_epoch,
        key.policy_generation,
    )
}

fn reservation_key(record: &ReservationRecord) -> KeyRef<'_> {
    let receipt = &record.receipt;
    (
        &receipt.subject,
        &receipt.route,
        receipt.accounting_epoch,
        receipt.policy_generation,
    )
}

fn shard_key(record: &ShardRecord) -> KeyRef<'_> {
    let shard = &record.shard;
    (
        &shard.subject,
        &shard.route,
        shard.accounting_epoch,
        shard.policy_generation,
    )
}

fn owned_key(key: KeyRef<'_>) -> AccountKey {
    AccountKey {
        pair: PairKey::new(key.0.clone(), key.1.clone()),
        accounting_epoch: key.2,
        policy_generation: key.3,
    }
}

/// What an account's records add up to.
#[derive(Debug, Clone, Copy, Default)]
struct Tally {
    /// Units its live reservations hold.
    held: u64,
    /// Units allocated to its shards.
    allocated: u64,
    /// Reservation and shard records stored.
    stored: u64,
    /// Spent, as its settlements and reconciled receipts record.
    settled: u64,
    /// Overdraft issued, as the same records record.
    debts: u64,
}

/// Every account's tally (a full audit) or only the named accounts' (an
/// audit of what a transition touched).
enum Tallies<'a> {
    All(BTreeMap<KeyRef<'a>, Tally>),
    Only(Vec<(KeyRef<'a>, Tally)>),
}

impl<'a> Tallies<'a> {
    /// The tally of `key`'s account, if this audit looks at it.
    fn slot(&mut self, key: KeyRef<'a>) -> Option<&mut Tally> {
        match self {
            Self::All(map) => Some(map.entry(key).or_default()),
            Self::Only(only) => only
                .iter_mut()
                .find(|(touched, _)| *touched == key)
                .map(|(_, tally)| tally),
        }
    }

    fn take(&mut self, key: &KeyRef<'a>) -> Tally {
        match self {
            Self::All(map) => map.remove(key),
            Self::Only(only) => only
                .iter_mut()
                .find(|(touched, _)| touched == key)
                .map(|(_, tally)| std::mem::take(tally)),
        }
        .unwrap_or_default()
    }

    /// The tallies left (accounts that do not exist), in key order.
    fn into_left(self) -> Vec<(KeyRef<'a>, Tally)> {
        match self {
            Self::All(map) => map.into_iter().collect(),
            Self::Only(mut only) => {
                only.sort_unstable_by(|a, b| a.0.cmp(&b.0));
                only
            }
        }
    }
}

/// The audit of every account, or of the `only` accounts with all their
/// records. Tallies are keyed by borrowed keys: an audit clones an
/// identifier only to name a violation.
fn audit_scoped(
    ledger: &CentralLedger,
    check_usage: bool,
    only: Option<&[KeyRef<'_>]>,
) -> AuditReport {
    let mut report = AuditReport::default();
    // The accounts to check, first: their keys outlive the tallies that
    // are looked up by them. In key order, as the ledger lists them; the
    // named ones are looked up, not picked out of every account (the
    // simulator audits what each step touched).
    let accounts: Vec<(AccountKey, &AccountState)> = match only {
        None => ledger.account_states().collect(),
        Some(only) => {
            let mut named: Vec<(AccountKey, &AccountState)> = only
                .iter()
                .filter_map(|key| {
                    let key = owned_key(*key);
                    let account = ledger.account_state(&key)?;
                    Some((key, account))
                })
                .collect();
            // `only` names each account once (`audit_touched`).
            named.sort_unstable_by(|a, b| a.0.cmp(&b.0));
            named
        }
    };
    let mut tallies = match only {
        None => Tallies::All(BTreeMap::new()),
        Some(only) => Tallies::Only(
            only.iter()
                .map(|key| ((key.0, key.1, key.2, key.3), Tally::default()))
                .collect(),
        ),
    };
    for record in ledger.reservations() {
        let Some(tally) = tallies.slot(reservation_key(record)) else {
            continue;
        };
        report.reservations += 1;
        tally.stored += 1;
        tally.held = tally.held.saturating_add(record.held_units());
        if let Some(settlement) = &record.settlement
            && !record.shadow
        {
            tally.settled = tally.settled.saturating_add(settlement.actual_units);
            tally.debts = tally.debts.saturating_add(settlement.overdraft_units);
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
        if let Some(sibling) = leg_apart(ledger, record) {
            report.violations.push(Violation::LegsApart {
                reservation: record.receipt.reservation.clone(),
                sibling,
            });
        }
    }
    for record in ledger.shards() {
        let Some(tally) = tallies.slot(shard_key(record)) else {
            continue;
        };
        report.shards += 1;
        tally.stored += 1;
        tally.allocated = tally.allocated.saturating_add(record.shard.allocated_units);
        if record
            .lost_at
            .is_some_and(|lost_at| lost_at < record.shard.not_after)
        {
            report.violations.push(Violation::LostEarly {
                shard: record.shard.shard.clone(),
            });
        }
        if let Some(done) = &record.reconciliation {
            tally.settled = tally.settled.saturating_add(done.overdraft_debt_units);
            tally.debts = tally.debts.saturating_add(done.overdraft_debt_units);
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
    for (key, account) in &accounts {
        let terms = &account.terms;
        let forgotten = &account.forgotten;
        report.accounts += 1;
        report.debt = report.debt.saturating_add(terms.debt());
        report.violations.extend(check_account(key, terms));
        let tally = tallies.take(&key_ref(key));
        if terms.reserved != tally.held {
            report.violations.push(Violation::ReservedMismatch {
                account: key.clone(),
                recorded: terms.reserved,
                held: tally.held,
            });
        }
        let settled = tally.settled.saturating_add(forgotten.spent);
        let debts = tally.debts.saturating_add(forgotten.overdraft_issued);
        if check_usage && (terms.spent != settled || terms.overdraft_issued != debts) {
            report.violations.push(Violation::UsageMismatch {
                account: key.clone(),
                spent: terms.spent,
                settled,
                overdraft_issued: terms.overdraft_issued,
                debts,
            });
        }
        if check_usage
            && let Some(recorded) = account.records
            && recorded != tally.stored
        {
            report.violations.push(Violation::RecordCount {
                account: key.clone(),
                recorded,
                stored: tally.stored,
            });
        }
        let shards_hold = tally.allocated.saturating_add(forgotten.shard_units);
        if terms.retired_for_emergency != shards_hold {
            report.violations.push(Violation::RetiredMismatch {
                account: key.clone(),
                recorded: terms.retired_for_emergency,
                allocated: shards_hold,
            });
        }
    }
    if only.is_none() {
        for pair in ledger.pairs() {
            if let Some(violation) = check_closed_history(&pair.pair, &pair.closed_history) {
                report.violations.push(violation);
            }
        }
    }
    // Whatever is left points at accounts that do not exist: held units
    // first, then allocated ones, each in key order.
    let left = tallies.into_left();
    for (key, tally) in &left {
        if tally.held > 0 {
            report.violations.push(Violation::MissingAccount {
                account: owned_key(*key),
            });
        }
    }
    for (key, tally) in &left {
        if tally.allocated > 0 {
            report.violations.push(Violation::MissingAccount {
                account: owned_key(*key),
            });
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
        assert_eq!(
            ledger.record_counts(),
            crate::RecordCounts::of(ledger.reservations(), ledger.shards()),
            "the record counts are the stored records'"
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
