//! One test per rule of the seed (docs/design.md §3–§5), named after it, on
//! the central ledger. The numbers are the worked examples of docs/design.md
//! §4.7; equations are written as there:
//!
//! ```text
//! opening + minted + overdraftIssued
//!   = available + reserved + spent + retiredForEmergency + overdraftRepaid
//! ```
//!
//! Every operation runs through `support::Harness`, which audits the whole
//! ledger after it, asserts that rejections, conflicts and duplicates
//! changed nothing, and rebuilds the ledger from the committed changes.

mod support;

use ledger::{
    AbandonOutcome, CentralConfig, CentralLedger, Change, Dimension, GatewayRecord,
    IssueShardOutcome, LoadError, Overflow, PairKey, PublishOutcome, ReconcileOutcome,
    RegisterOutcome, Rejection, ReleaseOutcome, ReserveOutcome, RouteControlOutcome, SettleOutcome,
    ShardLedger, StartOutcome,
};
use shard_format::limits::UNITS_MAX;
use shard_format::{
    BootNonce, Ed25519Signer, EmergencyShardV1, ReservationState, RouteMode, ShardCloseReason,
    ShardTerminalReceiptV1, Signature, sign_document, verify_document,
};
use support::{
    EPOCH_MS, Harness, at, central_signer, edit_accounts, fresh_boot, gateway_signer, identity,
    nonce, op, other_gateway_signer, pair, policy, policy_for, rejected, request, request_on,
    reserved, rid, route, subject, verifier,
};

/// Rejections of the §4.7 policy, generation 31.
fn rejection(dimension: Dimension, retry_after_seconds: Option<u64>) -> Rejection {
    Rejection {
        dimension,
        policy_generation: 31,
        retry_after_seconds,
        rate_limit: None,
    }
}

/// docs/design.md §4.7 steps 1–4, each step asserted: the seed's story,
/// ending at `T0 + 500 ms` with `1000 = 800 + 0 + 200 + 0 + 0`.
fn seed_story() -> Harness {
    // 1. Open.
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");

    // 2. Three gateways reserve 600 at once; the ledger linearizes them.
    h.at(100);
    let first = h.reserved("rl-a", 600);
    assert_eq!(first.state, ReservationState::Reserved);
    assert_eq!(first.reserved_units, 600);
    assert_eq!(first.policy_generation, 31);
    assert_eq!(first.accounting_epoch, at(0));
    for other in ["rl-b", "rl-c"] {
        // 200 missing at 100 per second: Retry-After 2.
        assert_eq!(
            rejected(h.reserve(other, 600)),
            rejection(Dimension::Capacity, Some(2))
        );
        assert!(h.ledger.reservation(&rid(other)).is_none());
    }
    h.assert_account(&account, "1000 + 0 + 0 = 400 + 600 + 0 + 0 + 0");

    // 3. Start binds op-1; the client retries under the same ID.
    h.at(200);
    let started = h.started("rl-a", "op-1");
    assert_eq!(started.state, ReservationState::Started);
    assert_eq!(started.operation_id, Some(op("op-1")));
    h.at(300);
    assert_eq!(
        h.reserve("rl-a", 600),
        ReserveOutcome::Duplicate(started.clone()),
        "the retry gets the same receipt back"
    );
    h.assert_account(&account, "1000 + 0 + 0 = 400 + 600 + 0 + 0 + 0");

    // 4. Actual 200: the unused 400 are refunded once.
    h.at(400);
    let settlement = h.settled("rl-a", "op-1", 200);
    assert_eq!(settlement.reserved_units, 600);
    assert_eq!(settlement.actual_units, 200);
    assert_eq!(settlement.refunded_units, 400);
    assert_eq!(settlement.overdraft_units, 0);
    assert_eq!(settlement.state, ReservationState::Settled);
    assert!(!settlement.conservative);
    h.assert_account(&account, "1000 + 0 + 0 = 800 + 0 + 200 + 0 + 0");
    // The settle ACK is lost and resent: the same receipt, nothing moves.
    h.at(500);
    assert_eq!(
        h.settle("rl-a", "op-1", 200),
        SettleOutcome::Duplicate(settlement)
    );
    h.assert_account(&account, "1000 + 0 + 0 = 800 + 0 + 200 + 0 + 0");
    h
}

/// docs/design.md §4.7 step 5 after the seed's story: at `T0 + 600 ms`
/// reserve 500 (the account then reads `after_reserve`) and settle it at
/// `actual`.
fn overage(h: &mut Harness, after_reserve: &str, actual: u64) -> SettleOutcome {
    h.at(600);
    h.reserved("rl-d", 500);
    let account = h.account(31);
    h.assert_account(&account, after_reserve);
    h.started("rl-d", "op-2");
    h.settle("rl-d", "op-2", actual)
}

/// The account after step 5's reserve of 500 at available 800.
const STEP_5_RESERVED: &str = "1000 + 0 + 0 = 300 + 500 + 200 + 0 + 0";

#[test]
fn three_gateways_reserve_600_of_1000_one_admitted() {
    let h = seed_story();
    let record = h.reservation("rl-a");
    assert_eq!(record.receipt.state, ReservationState::Settled);
    assert_eq!(record.receipt.actual_units, Some(200));
    assert_eq!(h.ledger.reservations().count(), 1, "one reservation, ever");
    assert_eq!(h.ledger.pair_debt(&pair()), 0);
    assert!(h.ledger.admission_open(&pair()));
}

#[test]
fn same_key_other_digest_is_a_conflict() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    let first = reserved(h.reserve_request(request("rl-a", 600, "summarize the report")));
    for other in [
        // Same ID, same units, another request.
        request("rl-a", 600, "translate the report"),
        // Same ID and digest, other units.
        request("rl-a", 700, "summarize the report"),
    ] {
        assert_eq!(
            h.reserve_request(other),
            ReserveOutcome::IdempotencyConflict {
                existing: first.clone()
            }
        );
    }
    h.assert_account(&account, "1000 + 0 + 0 = 400 + 600 + 0 + 0 + 0");
    // The original request is still a plain duplicate.
    assert_eq!(
        h.reserve_request(request("rl-a", 600, "summarize the report")),
        ReserveOutcome::Duplicate(first)
    );
}

#[test]
fn started_vs_expired() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);

    // Start before the expiry sweep: the start wins, and expiry never takes
    // a STARTED item, however late the sweep runs.
    let receipt = h.reserved("rl-start-first", 100);
    assert_eq!(receipt.expires_at, at(30_000));
    h.at(29_999);
    h.started("rl-start-first", "op-1");
    h.at(30_000);
    assert_eq!(h.begin_expiry(), vec![]);
    assert_eq!(h.complete_expiry(), vec![]);
    h.at(90_000);
    assert_eq!(h.begin_expiry(), vec![]);
    assert_eq!(
        h.reservation("rl-start-first").receipt.state,
        ReservationState::Started
    );
    h.assert_account(&account, "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0");

    // Expiry before the start: RESERVED → EXPIRING → EXPIRED, then the start
    // finds it expired and changes nothing.
    h.at(100_000);
    h.reserved("rl-expire-first", 200);
    h.assert_account(&account, "1000 + 0 + 0 = 700 + 300 + 0 + 0 + 0");
    h.at(130_000);
    assert_eq!(h.begin_expiry(), vec![rid("rl-expire-first")]);
    assert_eq!(
        h.reservation("rl-expire-first").receipt.state,
        ReservationState::Expiring
    );
    // EXPIRING still holds its units until the refund is made.
    h.assert_account(&account, "1000 + 0 + 0 = 700 + 300 + 0 + 0 + 0");
    assert_eq!(h.complete_expiry(), vec![rid("rl-expire-first")]);
    h.assert_account(&account, "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0");
    let expired = h.reservation("rl-expire-first").receipt.clone();
    assert_eq!(expired.state, ReservationState::Expired);
    let before = h.snapshot();
    assert_eq!(
        h.start("rl-expire-first", "op-2"),
        StartOutcome::Expired(expired)
    );
    assert_eq!(
        h.snapshot(),
        before,
        "a start on an EXPIRED item moves nothing"
    );

    // A start that arrives while the item is EXPIRING loses, and completes
    // the expiry itself: the refund is made once.
    h.at(200_000);
    h.reserved("rl-expiring", 300);
    h.at(230_000);
    assert_eq!(h.begin_expiry(), vec![rid("rl-expiring")]);
    let StartOutcome::Expired(receipt) = h.start("rl-expiring", "op-3") else {
        panic!("a start on an EXPIRING item must lose");
    };
    assert_eq!(receipt.state, ReservationState::Expired);
    assert_eq!(receipt.operation_id, None);
    h.assert_account(&account, "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0");
    assert_eq!(h.complete_expiry(), vec![], "the refund was made once");
    h.assert_account(&account, "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0");

    // A start at or after `expiresAt` loses even before any sweep ran.
    h.at(300_000);
    h.reserved("rl-late-start", 400);
    h.at(330_000);
    let StartOutcome::Expired(receipt) = h.start("rl-late-start", "op-4") else {
        panic!("a start at expiresAt must lose");
    };
    assert_eq!(receipt.state, ReservationState::Expired);
    h.assert_account(&account, "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0");
    assert_eq!(h.begin_expiry(), vec![]);
}

#[test]
fn actual_above_reserved_within_overdraft_max() {
    let mut h = seed_story();
    let account = h.account(31);

    // 5. Actual 900 on 500 reserved: the overage of 400 takes the 300
    //    available, the last 100 is overdraft.
    let SettleOutcome::Settled(settlement) = overage(&mut h, STEP_5_RESERVED, 900) else {
        panic!("the overage must settle");
    };
    assert_eq!(settlement.state, ReservationState::SettledWithDebt);
    assert_eq!(settlement.refunded_units, 0);
    assert_eq!(settlement.overdraft_units, 100);
    assert_eq!(
        h.reservation("rl-d").receipt.state,
        ReservationState::SettledWithDebt
    );
    h.assert_account(&account, "1000 + 0 + 100 = 0 + 0 + 1100 + 0 + 0");
    assert_eq!(h.ledger.pair_debt(&pair()), 100);
    assert!(
        !h.ledger.pair(&pair()).expect("pair").frozen,
        "within the max"
    );
    // Admission for the pair is 0 at once.
    assert!(!h.ledger.admission_open(&pair()));
    assert_eq!(rejected(h.reserve("rl-e", 1)).dimension, Dimension::Debt);
    assert!(h.ledger.reservation(&rid("rl-e")).is_none());

    // 6. A refill of 100 repays first.
    h.at(1000);
    h.refill();
    h.assert_account(&account, "1000 + 100 + 100 = 0 + 0 + 1100 + 0 + 100");
    assert_eq!(h.ledger.pair_debt(&pair()), 0);
    // Debt is zero, but available is still 0.
    assert_eq!(
        rejected(h.reserve("rl-e", 100)),
        rejection(Dimension::Capacity, Some(1))
    );

    // 7. The next refill of 100 reaches available; admission resumes.
    h.at(2000);
    h.refill();
    h.assert_account(&account, "1000 + 200 + 100 = 100 + 0 + 1100 + 0 + 100");
    assert!(h.ledger.admission_open(&pair()));
    h.reserved("rl-e", 100);
    h.assert_account(&account, "1000 + 200 + 100 = 0 + 100 + 1100 + 0 + 100");
}

#[test]
fn actual_above_reserved_beyond_overdraft_max_freezes() {
    let mut h = seed_story();
    let account = h.account(31);

    // Actual 1300 on 500 reserved with overdraftUnitsMax 200: the 500 of
    // debt are recorded in full and the route freezes.
    let SettleOutcome::Settled(settlement) = overage(&mut h, STEP_5_RESERVED, 1300) else {
        panic!("a breach still settles");
    };
    assert_eq!(settlement.overdraft_units, 500);
    assert_eq!(settlement.state, ReservationState::SettledWithDebt);
    h.assert_account(&account, "1000 + 0 + 500 = 0 + 0 + 1500 + 0 + 0");
    assert_eq!(h.ledger.pair_debt(&pair()), 500);
    assert!(h.ledger.pair(&pair()).expect("pair").frozen);
    assert_eq!(
        rejected(h.reserve("rl-e", 1)),
        rejection(Dimension::Frozen, None),
        "waiting alone does not unfreeze"
    );

    // Refills go on repaying while frozen.
    h.at(3000);
    h.refill();
    h.assert_account(&account, "1000 + 300 + 500 = 0 + 0 + 1500 + 0 + 300");
    assert_eq!(rejected(h.reserve("rl-e", 1)).dimension, Dimension::Frozen);

    // The operator unfreezes: admission still waits for the debt.
    assert_eq!(h.set_frozen(false), RouteControlOutcome::Done);
    assert_eq!(h.set_frozen(false), RouteControlOutcome::Unchanged);
    assert!(!h.ledger.admission_open(&pair()));
    assert_eq!(rejected(h.reserve("rl-e", 1)).dimension, Dimension::Debt);

    h.at(5000);
    h.refill();
    h.assert_account(&account, "1000 + 500 + 500 = 0 + 0 + 1500 + 0 + 500");
    assert_eq!(h.ledger.pair_debt(&pair()), 0);
    assert_eq!(
        rejected(h.reserve("rl-e", 100)).dimension,
        Dimension::Capacity
    );

    h.at(6000);
    h.refill();
    h.assert_account(&account, "1000 + 600 + 500 = 100 + 0 + 1500 + 0 + 500");
    h.reserved("rl-e", 100);
}

#[test]
fn debt_repaid_across_an_epoch_boundary() {
    // No refill at all: only the next epoch's opening can repay.
    let mut no_refill = policy(31);
    no_refill.refill.units = 0;
    let mut h = Harness::with_policy(no_refill);
    let epoch_e = h.account(31);
    h.at(100);
    h.reserved("rl-a", 600);
    h.started("rl-a", "op-1");
    h.settled("rl-a", "op-1", 200);
    h.assert_account(&epoch_e, "1000 + 0 + 0 = 800 + 0 + 200 + 0 + 0");
    let SettleOutcome::Settled(settlement) = overage(&mut h, STEP_5_RESERVED, 900) else {
        panic!("the overage must settle");
    };
    assert_eq!(settlement.overdraft_units, 100);
    h.assert_account(&epoch_e, "1000 + 0 + 100 = 0 + 0 + 1100 + 0 + 0");
    h.at(EPOCH_MS - 1);
    h.refill();
    assert_eq!(rejected(h.reserve("rl-b", 100)).dimension, Dimension::Debt);

    // The next epoch opens: its opening repays the old account first
    // (minted and overdraftRepaid rise together there), and the new account
    // opens with the rest.
    h.at(EPOCH_MS);
    h.refill();
    let epoch_e1 = h.account(31);
    assert_eq!(epoch_e1.accounting_epoch, at(EPOCH_MS));
    h.assert_account(&epoch_e, "1000 + 100 + 100 = 0 + 0 + 1100 + 0 + 100");
    h.assert_account(&epoch_e1, "900 + 0 + 0 = 900 + 0 + 0 + 0 + 0");
    assert_eq!(h.ledger.pair_debt(&pair()), 0);

    // Admission resumes in the new epoch's account.
    let receipt = h.reserved("rl-b", 600);
    assert_eq!(receipt.accounting_epoch, at(EPOCH_MS));
    h.assert_account(&epoch_e1, "900 + 0 + 0 = 300 + 600 + 0 + 0 + 0");
    h.assert_account(&epoch_e, "1000 + 100 + 100 = 0 + 0 + 1100 + 0 + 100");
}

#[test]
fn reservation_settles_in_its_own_epoch() {
    // Made in epoch E, finished in E+1: start, settle and expire touch E's
    // account; E+1's is not touched.
    let mut h = Harness::with_policy(policy(31));
    let epoch_e = h.account(31);
    h.at(EPOCH_MS - 10_000);
    h.reserved("rl-long", 600);
    h.reserved("rl-held", 100);
    h.assert_account(&epoch_e, "1000 + 0 + 0 = 300 + 700 + 0 + 0 + 0");
    h.at(EPOCH_MS - 5_000);
    h.started("rl-long", "op-1");

    h.at(EPOCH_MS);
    h.refill();
    let epoch_e1 = h.account(31);
    h.assert_account(&epoch_e1, "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");

    h.at(EPOCH_MS + 5_000);
    let settlement = h.settled("rl-long", "op-1", 200);
    assert_eq!(settlement.accounting_epoch, at(0));
    h.assert_account(&epoch_e, "1000 + 0 + 0 = 700 + 100 + 200 + 0 + 0");
    h.at(EPOCH_MS + 20_000);
    assert_eq!(h.begin_expiry(), vec![rid("rl-held")]);
    assert_eq!(h.complete_expiry(), vec![rid("rl-held")]);
    h.assert_account(&epoch_e, "1000 + 0 + 0 = 800 + 0 + 200 + 0 + 0");
    h.assert_account(&epoch_e1, "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");

    // What was left in E stays there (fixed window): E+1 admits from its own.
    h.reserved("rl-new", 800);
    h.assert_account(&epoch_e1, "1000 + 0 + 0 = 200 + 800 + 0 + 0 + 0");
    h.assert_account(&epoch_e, "1000 + 0 + 0 = 800 + 0 + 200 + 0 + 0");
}

#[test]
fn refill_never_lifts_available_above_burst() {
    let mut h = seed_story();
    let account = h.account(31);
    // Ten seconds idle: 1000 due, only 200 fit below burst.
    h.at(10_000);
    h.refill();
    h.assert_account(&account, "1000 + 200 + 0 = 1000 + 0 + 200 + 0 + 0");
    h.reserved("rl-b", 800);
    h.at(20_000);
    h.refill();
    // Units held count against burst too.
    h.assert_account(&account, "1000 + 200 + 0 = 200 + 800 + 200 + 0 + 0");
}

#[test]
fn refill_tick_falls_due_at_its_interval_not_a_millisecond_before() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    // Room below burst for the tick: 500 spent.
    h.reserved("rl-a", 500);
    h.started("rl-a", "op-a");
    h.settled("rl-a", "op-a", 500);
    h.at(999);
    h.refill();
    h.assert_account(&account, "1000 + 0 + 0 = 500 + 0 + 500 + 0 + 0");
    assert_eq!(h.ledger.pair(&pair()).expect("pair").last_refill_at, at(0));
    h.at(1000);
    h.refill();
    h.assert_account(&account, "1000 + 100 + 0 = 600 + 0 + 500 + 0 + 0");
    assert_eq!(
        h.ledger.pair(&pair()).expect("pair").last_refill_at,
        at(1000)
    );
}

#[test]
fn refill_opens_the_new_epoch_account_before_its_next_tick() {
    // Published 100 ms into the epoch: the ticks fall 100 ms after each
    // second, so the next epoch opens 900 ms after the last tick.
    let mut h = Harness::new();
    h.at(100);
    assert_eq!(h.publish(policy(31)), PublishOutcome::Published);
    h.at(EPOCH_MS - 1);
    h.refill();
    assert_eq!(
        h.ledger.pair(&pair()).expect("pair").last_refill_at,
        at(EPOCH_MS - 900)
    );
    h.at(EPOCH_MS);
    let next = h.account(31);
    assert!(h.ledger.account(&next).is_none());
    h.refill();
    h.assert_account(&next, "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");
    assert_eq!(
        h.ledger.pair(&pair()).expect("pair").last_refill_at,
        at(EPOCH_MS)
    );
}

#[test]
fn debt_repaid_oldest_account_first() {
    // Debt in two accounts of the pair: generation 31's (older) and 32's.
    let mut h = Harness::with_policy(policy(31));
    let old = h.account(31);
    h.reserved("rl-31", 800);
    h.started("rl-31", "op-31");
    h.at(100);
    assert_eq!(h.publish(policy(32)), PublishOutcome::Published);
    let new = h.account(32);
    h.reserved("rl-32", 800);
    h.started("rl-32", "op-32");
    h.settled("rl-31", "op-31", 1100);
    h.settled("rl-32", "op-32", 1100);
    h.assert_account(&old, "1000 + 0 + 100 = 0 + 0 + 1100 + 0 + 0");
    h.assert_account(&new, "1000 + 0 + 100 = 0 + 0 + 1100 + 0 + 0");
    assert_eq!(h.ledger.pair_debt(&pair()), 200);

    // One refill of 100 repays the oldest account only.
    h.at(1000);
    h.refill();
    h.assert_account(&old, "1000 + 100 + 100 = 0 + 0 + 1100 + 0 + 100");
    h.assert_account(&new, "1000 + 0 + 100 = 0 + 0 + 1100 + 0 + 0");
    assert_eq!(
        rejected(h.reserve("rl-next", 10)).dimension,
        Dimension::Debt
    );

    // The next repays generation 32's; only the one after reaches available.
    h.at(2000);
    h.refill();
    h.assert_account(&new, "1000 + 100 + 100 = 0 + 0 + 1100 + 0 + 100");
    assert_eq!(h.ledger.pair_debt(&pair()), 0);
    h.at(3000);
    h.refill();
    h.assert_account(&new, "1000 + 200 + 100 = 100 + 0 + 1100 + 0 + 100");
    h.assert_account(&old, "1000 + 100 + 100 = 0 + 0 + 1100 + 0 + 100");
    h.reserved("rl-next", 10);
}

#[test]
fn debt_pauses_only_its_own_pair() {
    let mut h = seed_story();
    assert_eq!(
        h.publish(policy_for("tenant-8", 1)),
        PublishOutcome::Published
    );
    let SettleOutcome::Settled(_) = overage(&mut h, STEP_5_RESERVED, 900) else {
        panic!("the overage must settle");
    };
    assert_eq!(rejected(h.reserve("rl-e", 1)).dimension, Dimension::Debt);
    let other_pair = PairKey::new(subject("tenant-8"), route("chat.generate"));
    let other = request_on(&other_pair, "rl-other", 600, "another tenant");
    let receipt = reserved(h.reserve_request(other));
    assert_eq!(receipt.subject, other_pair.subject);
    assert!(h.ledger.admission_open(&other_pair));
    assert_eq!(h.ledger.pair_debt(&other_pair), 0);
    assert_eq!(h.ledger.pair_debt(&pair()), 100);
}

#[test]
fn overdraft_past_the_execution_hard_limit_freezes() {
    // Actual 900 on 500 reserved is within overdraftUnitsMax (100 of 200),
    // but the settlement comes after the execution hard limit: a breach.
    let mut h = seed_story();
    let account = h.account(31);
    h.at(600);
    h.reserved("rl-d", 500);
    h.started("rl-d", "op-2");
    assert_eq!(h.reservation("rl-d").hard_limit_at, Some(at(600_600)));
    h.at(600_601);
    let settlement = h.settled("rl-d", "op-2", 900);
    assert_eq!(settlement.overdraft_units, 100);
    h.assert_account(&account, "1000 + 0 + 100 = 0 + 0 + 1100 + 0 + 0");
    assert!(h.ledger.pair(&pair()).expect("pair").frozen);
    assert_eq!(
        rejected(h.reserve("rl-e", 1)),
        rejection(Dimension::Frozen, None)
    );

    // At the hard limit itself it is not yet a breach.
    let mut h = seed_story();
    h.at(600);
    h.reserved("rl-d", 500);
    h.started("rl-d", "op-2");
    h.at(600_600);
    h.settled("rl-d", "op-2", 900);
    assert!(!h.ledger.pair(&pair()).expect("pair").frozen);
    assert_eq!(rejected(h.reserve("rl-e", 1)).dimension, Dimension::Debt);
}

#[test]
fn debt_rejection_retry_after_is_conservative() {
    // §4.7 step 5: debt 100, available 0, refill 100 per second. After one
    // tick the debt is repaid but available is still 0 (step 6); only the
    // second tick admits a unit (step 7). A conservative Retry-After for a
    // debt rejection counts the debt *and* the units the request misses.
    let mut h = seed_story();
    let SettleOutcome::Settled(_) = overage(&mut h, STEP_5_RESERVED, 900) else {
        panic!("the overage must settle");
    };
    assert_eq!(
        rejected(h.reserve("rl-e", 1)),
        rejection(Dimension::Debt, Some(2)),
        "1 unit behind 100 of debt needs two ticks of 100"
    );
    assert_eq!(
        rejected(h.reserve("rl-f", 600)),
        rejection(Dimension::Debt, Some(7)),
        "600 units behind 100 of debt need seven ticks of 100"
    );

    // Without refill only the next epoch's opening repays: waiting helps,
    // so the rejection must say how long, not `None`.
    let mut no_refill = policy(31);
    no_refill.refill.units = 0;
    let mut h = Harness::with_policy(no_refill);
    h.at(EPOCH_MS - 20_000);
    h.reserved("rl-a", 500);
    h.started("rl-a", "op-1");
    h.at(EPOCH_MS - 10_000);
    h.settled("rl-a", "op-1", 1100);
    assert_eq!(h.ledger.pair_debt(&pair()), 100);
    assert_eq!(
        rejected(h.reserve("rl-b", 100)),
        rejection(Dimension::Debt, Some(10)),
        "the opening in 10 s repays the 100 and leaves 900"
    );
}

#[test]
fn lost_refund_ack_replayed() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    h.reserved("rl-a", 600);
    h.started("rl-a", "op-1");

    // The refund is committed, the ACK is lost, the central restarts, and
    // the caller replays the same settle.
    let settlement = h.settled("rl-a", "op-1", 200);
    h.assert_account(&account, "1000 + 0 + 0 = 800 + 0 + 200 + 0 + 0");
    h.reload();
    assert_eq!(
        h.settle("rl-a", "op-1", 200),
        SettleOutcome::Duplicate(settlement.clone())
    );
    h.assert_account(&account, "1000 + 0 + 0 = 800 + 0 + 200 + 0 + 0");
    // Another amount on the replay is a conflict, never a second refund.
    assert_eq!(
        h.settle("rl-a", "op-1", 100),
        SettleOutcome::SettlementConflict(settlement)
    );

    // The refund's commit itself fails: the caller hears nothing, replays,
    // and the refund is made exactly once.
    h.reserved("rl-b", 300);
    h.started("rl-b", "op-2");
    h.assert_account(&account, "1000 + 0 + 0 = 500 + 300 + 200 + 0 + 0");
    let SettleOutcome::Settled(lost) =
        h.run_with_failed_commit(|ledger, now| ledger.settle(&rid("rl-b"), &op("op-2"), 100, now))
    else {
        panic!("the settle ran");
    };
    h.assert_account(&account, "1000 + 0 + 0 = 500 + 300 + 200 + 0 + 0");
    assert_eq!(
        h.reservation("rl-b").receipt.state,
        ReservationState::Started
    );
    let settlement = h.settled("rl-b", "op-2", 100);
    assert_eq!(settlement, lost, "the replay does what the lost call did");
    h.assert_account(&account, "1000 + 0 + 0 = 700 + 0 + 300 + 0 + 0");
    h.reload();
    assert_eq!(
        h.settle("rl-b", "op-2", 100),
        SettleOutcome::Duplicate(settlement)
    );
    h.assert_account(&account, "1000 + 0 + 0 = 700 + 0 + 300 + 0 + 0");

    // A release's refund, replayed after a lost ACK, is not made twice.
    h.reserved("rl-c", 100);
    let ReleaseOutcome::Released(released) = h.release("rl-c") else {
        panic!("a RESERVED item releases");
    };
    h.reload();
    assert_eq!(h.release("rl-c"), ReleaseOutcome::Duplicate(released));
    h.assert_account(&account, "1000 + 0 + 0 = 700 + 0 + 300 + 0 + 0");
}

#[test]
fn lost_repayment_ack_replayed() {
    let mut h = seed_story();
    let account = h.account(31);
    let SettleOutcome::Settled(_) = overage(&mut h, STEP_5_RESERVED, 900) else {
        panic!("the overage must settle");
    };
    h.assert_account(&account, "1000 + 0 + 100 = 0 + 0 + 1100 + 0 + 0");

    // The repayment's commit fails: the refill is run again after the
    // restart and repays once.
    h.at(1000);
    h.run_with_failed_commit(|ledger, now| ledger.handle_refill(now));
    h.assert_account(&account, "1000 + 0 + 100 = 0 + 0 + 1100 + 0 + 0");
    h.refill();
    h.assert_account(&account, "1000 + 100 + 100 = 0 + 0 + 1100 + 0 + 100");

    // The repayment is committed, its ACK lost; the restarted worker runs
    // the same tick again: nothing moves.
    h.reload();
    let before = h.snapshot();
    h.refill();
    assert_eq!(h.snapshot(), before);
    h.assert_account(&account, "1000 + 100 + 100 = 0 + 0 + 1100 + 0 + 100");

    // Repayment by a shard's re-mint: the receipt's ACK is lost and the
    // agent sends it again; the debt is repaid once.
    let mut h = seed_story();
    let gateway = gateway_signer();
    h.enroll(&gateway);
    let boot = h.register(&gateway, nonce(1));
    let shard = h.issued("s1", &gateway, boot, nonce(1));
    h.assert_account(&account, "1000 + 0 + 0 = 600 + 0 + 200 + 200 + 0");
    let SettleOutcome::Settled(settlement) =
        overage(&mut h, "1000 + 0 + 0 = 100 + 500 + 200 + 200 + 0", 700)
    else {
        panic!("the overage must settle");
    };
    assert_eq!(settlement.overdraft_units, 100);
    h.assert_account(&account, "1000 + 0 + 100 = 0 + 0 + 900 + 200 + 0");
    let receipt = closed_receipt(shard, |_| {}, ShardCloseReason::Reconnect);
    let trusted = verifier(&[&gateway]);
    let ReconcileOutcome::Reconciled(done) = h.reconcile(&receipt, &trusted) else {
        panic!("the receipt reconciles");
    };
    assert_eq!(done.confirmed_unused_units, 200);
    assert_eq!(done.repaid_units, 100);
    assert_eq!(done.reminted_units, 100);
    assert_eq!(done.cut_units, 0);
    h.assert_account(&account, "1000 + 200 + 100 = 100 + 0 + 900 + 200 + 100");
    h.reload();
    assert_eq!(
        h.reconcile(&receipt, &trusted),
        ReconcileOutcome::Duplicate(done)
    );
    h.assert_account(&account, "1000 + 200 + 100 = 100 + 0 + 900 + 200 + 100");
}

#[test]
fn generation_crossover() {
    let mut h = Harness::with_policy(policy(31));
    let old = h.account(31);
    h.at(100);
    h.reserved("rl-reserved", 300);
    h.reserved("rl-started", 200);
    h.started("rl-started", "op-s");
    h.assert_account(&old, "1000 + 0 + 0 = 500 + 500 + 0 + 0 + 0");

    // Generation 32 is published: it opens its own account at once.
    h.at(1000);
    assert_eq!(h.publish(policy(32)), PublishOutcome::Published);
    let new = h.account(32);
    h.assert_account(&new, "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");
    h.assert_account(&old, "1000 + 0 + 0 = 500 + 500 + 0 + 0 + 0");
    assert_eq!(
        h.publish(policy(32)),
        PublishOutcome::GenerationNotRising { current: 32 }
    );
    assert_eq!(
        h.publish(policy(31)),
        PublishOutcome::GenerationNotRising { current: 32 }
    );

    // Generation 31 admits nothing, even with 500 available.
    let mut old_request = request("rl-old", 100, "old");
    old_request.policy_generation = Some(31);
    assert_eq!(
        rejected(h.reserve_request(old_request)),
        Rejection {
            dimension: Dimension::PolicyGeneration,
            policy_generation: 32,
            retry_after_seconds: None,
            rate_limit: None,
        }
    );
    // New reservations land in generation 32's account.
    let mut new_request = request("rl-new", 100, "new");
    new_request.policy_generation = Some(32);
    let receipt = reserved(h.reserve_request(new_request));
    assert_eq!(receipt.policy_generation, 32);
    let receipt = h.reserved("rl-unnamed", 50);
    assert_eq!(receipt.policy_generation, 32);
    h.assert_account(&new, "1000 + 0 + 0 = 850 + 150 + 0 + 0 + 0");

    // The old reservations start and settle in their own account.
    let started = h.started("rl-reserved", "op-r");
    assert_eq!(started.policy_generation, 31);
    let settlement = h.settled("rl-reserved", "op-r", 100);
    assert_eq!(settlement.policy_generation, 31);
    h.assert_account(&old, "1000 + 0 + 0 = 700 + 200 + 100 + 0 + 0");
    h.settled("rl-started", "op-s", 200);
    h.assert_account(&old, "1000 + 0 + 0 = 700 + 0 + 300 + 0 + 0");
    h.assert_account(&new, "1000 + 0 + 0 = 850 + 150 + 0 + 0 + 0");

    // Rolling generation 32 back stops its admission; settlement goes on.
    assert_eq!(
        h.set_admission_stopped(31, true),
        RouteControlOutcome::NotCurrentGeneration { current: 32 }
    );
    assert_eq!(h.set_admission_stopped(32, true), RouteControlOutcome::Done);
    assert_eq!(
        rejected(h.reserve("rl-after-rollback", 10)).dimension,
        Dimension::PolicyGeneration
    );
    h.started("rl-new", "op-n");
    h.settled("rl-new", "op-n", 40);
    h.assert_account(&new, "1000 + 0 + 0 = 910 + 50 + 40 + 0 + 0");
    h.assert_account(&old, "1000 + 0 + 0 = 700 + 0 + 300 + 0 + 0");
}

#[test]
fn usage_unknown_never_refunded_then_conservative_settle_then_corrected_once() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    h.reserved("rl-u", 600);
    let StartOutcome::Started(_) = h.start_with_deadline("rl-u", "op-u", Some(5_000)) else {
        panic!("the reservation starts");
    };
    let record = h.reservation("rl-u");
    assert_eq!(record.usage_deadline, Some(at(5_000)));
    assert_eq!(record.hard_limit_at, Some(at(600_000)));

    // The deadline passes without a receipt: USAGE_UNKNOWN, units held.
    h.at(4_999);
    assert_eq!(h.usage_deadlines(), vec![]);
    h.at(5_000);
    assert_eq!(h.usage_deadlines(), vec![rid("rl-u")]);
    assert_eq!(
        h.reservation("rl-u").receipt.state,
        ReservationState::UsageUnknown
    );
    h.assert_account(&account, "1000 + 0 + 0 = 400 + 600 + 0 + 0 + 0");
    // Neither expiry, nor release, nor abandon refunds it.
    h.at(60_000);
    assert_eq!(h.begin_expiry(), vec![]);
    assert_eq!(
        h.release("rl-u"),
        ReleaseOutcome::IllegalState(ReservationState::UsageUnknown)
    );
    assert!(matches!(h.abandon("rl-u"), AbandonOutcome::IllegalState(_)));
    h.at(599_999);
    assert_eq!(h.usage_deadlines(), vec![]);
    h.assert_account(&account, "1000 + 0 + 0 = 400 + 600 + 0 + 0 + 0");

    // After the execution hard limit: settled conservatively at the full
    // reservation.
    h.at(600_000);
    assert_eq!(h.usage_deadlines(), vec![rid("rl-u")]);
    let record = h.reservation("rl-u").clone();
    let conservative = record.settlement.expect("settled");
    assert!(conservative.conservative);
    assert_eq!(conservative.actual_units, 600);
    assert_eq!(conservative.refunded_units, 0);
    assert_eq!(conservative.state, ReservationState::Settled);
    assert_eq!(record.receipt.state, ReservationState::Settled);
    h.assert_account(&account, "1000 + 0 + 0 = 400 + 0 + 600 + 0 + 0");
    h.at(700_000);
    assert_eq!(h.usage_deadlines(), vec![]);

    // A late genuine receipt corrects it, exactly once.
    let SettleOutcome::Corrected(corrected) = h.settle("rl-u", "op-u", 200) else {
        panic!("a late genuine receipt corrects a conservative settlement");
    };
    assert!(!corrected.conservative);
    assert_eq!(corrected.actual_units, 200);
    assert_eq!(corrected.refunded_units, 400);
    assert_eq!(corrected.state, ReservationState::Settled);
    h.assert_account(&account, "1000 + 0 + 0 = 800 + 0 + 200 + 0 + 0");
    assert!(h.reservation("rl-u").corrected);
    assert_eq!(
        h.settle("rl-u", "op-u", 200),
        SettleOutcome::Duplicate(corrected.clone())
    );
    assert_eq!(
        h.settle("rl-u", "op-u", 300),
        SettleOutcome::SettlementConflict(corrected.clone())
    );
    assert_eq!(
        h.settle("rl-u", "op-other", 200),
        SettleOutcome::OperationConflict { bound: op("op-u") }
    );
    h.assert_account(&account, "1000 + 0 + 0 = 800 + 0 + 200 + 0 + 0");
}

#[test]
fn late_receipt_above_the_reservation_after_the_hard_limit_is_a_breach() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    h.reserved("rl-u", 600);
    let StartOutcome::Started(_) = h.start_with_deadline("rl-u", "op-u", Some(5_000)) else {
        panic!("the reservation starts");
    };
    h.at(5_000);
    assert_eq!(h.usage_deadlines(), vec![rid("rl-u")]);
    h.at(600_000);
    assert_eq!(h.usage_deadlines(), vec![rid("rl-u")]);
    h.assert_account(&account, "1000 + 0 + 0 = 400 + 0 + 600 + 0 + 0");

    // The genuine receipt says 1100: the 500 beyond the conservative charge
    // take the 400 available, the last 100 are debt, recorded in full, and
    // an execution past its hard limit freezes the route.
    h.at(650_000);
    let SettleOutcome::Corrected(corrected) = h.settle("rl-u", "op-u", 1100) else {
        panic!("a late genuine receipt corrects a conservative settlement");
    };
    assert_eq!(corrected.actual_units, 1100);
    assert_eq!(corrected.overdraft_units, 100);
    assert_eq!(corrected.state, ReservationState::SettledWithDebt);
    h.assert_account(&account, "1000 + 0 + 100 = 0 + 0 + 1100 + 0 + 0");
    assert!(h.ledger.pair(&pair()).expect("pair").frozen);
    assert_eq!(
        rejected(h.reserve("rl-next", 1)),
        rejection(Dimension::Frozen, None)
    );
}

#[test]
fn usage_worker_running_late_settles_conservatively_once() {
    // The worker did not run between the usage deadline and the hard
    // limit: one sweep moves the item through USAGE_UNKNOWN to the
    // conservative settlement, and names it once.
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    h.reserved("rl-u", 600);
    let StartOutcome::Started(_) = h.start_with_deadline("rl-u", "op-u", Some(5_000)) else {
        panic!("the reservation starts");
    };
    h.at(700_000);
    assert_eq!(h.usage_deadlines(), vec![rid("rl-u")]);
    let record = h.reservation("rl-u");
    assert_eq!(record.receipt.state, ReservationState::Settled);
    assert!(record.settlement.as_ref().expect("settled").conservative);
    h.assert_account(&account, "1000 + 0 + 0 = 400 + 0 + 600 + 0 + 0");
    assert_eq!(h.usage_deadlines(), vec![]);
}

#[test]
fn release_only_from_reserved() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);

    // RESERVED → RELEASED: every unit back.
    h.reserved("rl-r", 100);
    let ReleaseOutcome::Released(released) = h.release("rl-r") else {
        panic!("a RESERVED item releases");
    };
    assert_eq!(released.state, ReservationState::Released);
    h.assert_account(&account, "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");
    assert_eq!(h.release("rl-r"), ReleaseOutcome::Duplicate(released));
    assert_eq!(
        h.start("rl-r", "op-r"),
        StartOutcome::IllegalState(ReservationState::Released)
    );
    assert_eq!(
        h.settle("rl-r", "op-r", 10),
        SettleOutcome::IllegalState(ReservationState::Released)
    );

    // A started item must settle; a settled one is final.
    h.reserved("rl-s", 100);
    assert_eq!(
        h.settle("rl-s", "op-s", 10),
        SettleOutcome::NotStarted(ReservationState::Reserved)
    );
    h.started("rl-s", "op-s");
    assert_eq!(
        h.release("rl-s"),
        ReleaseOutcome::IllegalState(ReservationState::Started)
    );
    h.settled("rl-s", "op-s", 10);
    assert_eq!(
        h.release("rl-s"),
        ReleaseOutcome::IllegalState(ReservationState::Settled)
    );

    // An expiring or expired item is expiry's.
    let mut short = request("rl-x", 100, "short hold");
    short.hold_ttl_ms = Some(1_000);
    reserved(h.reserve_request(short));
    h.at(1_000);
    assert_eq!(h.begin_expiry(), vec![rid("rl-x")]);
    assert_eq!(
        h.release("rl-x"),
        ReleaseOutcome::IllegalState(ReservationState::Expiring)
    );
    assert_eq!(h.complete_expiry(), vec![rid("rl-x")]);
    assert_eq!(
        h.release("rl-x"),
        ReleaseOutcome::IllegalState(ReservationState::Expired)
    );
    assert_eq!(h.release("rl-unknown"), ReleaseOutcome::NotFound);
    h.assert_account(&account, "1000 + 0 + 0 = 990 + 0 + 10 + 0 + 0");
}

#[test]
fn abandon_tombstones_unknown_id() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);

    // The agent lost the reply to a reserve that never arrived: it abandons
    // the ID, and the late duplicate reserves nothing.
    h.at(100);
    assert_eq!(h.abandon("rl-lost"), AbandonOutcome::Tombstoned);
    let tombstone = h.ledger.tombstone(&rid("rl-lost")).expect("tombstoned");
    assert_eq!(tombstone.abandoned_at, at(100));
    h.at(200);
    assert_eq!(h.reserve("rl-lost", 600), ReserveOutcome::Abandoned);
    assert!(h.ledger.reservation(&rid("rl-lost")).is_none());
    assert_eq!(h.abandon("rl-lost"), AbandonOutcome::Duplicate);
    h.reload();
    assert_eq!(h.reserve("rl-lost", 600), ReserveOutcome::Abandoned);
    h.assert_account(&account, "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");

    // The reserve did arrive: abandoning releases it and marks it ABANDONED;
    // a late duplicate of it reserves nothing either.
    h.reserved("rl-arrived", 600);
    h.assert_account(&account, "1000 + 0 + 0 = 400 + 600 + 0 + 0 + 0");
    let AbandonOutcome::Abandoned(receipt) = h.abandon("rl-arrived") else {
        panic!("a RESERVED item is abandoned");
    };
    assert_eq!(receipt.state, ReservationState::Abandoned);
    h.assert_account(&account, "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");
    assert_eq!(h.reserve("rl-arrived", 600), ReserveOutcome::Abandoned);
    assert_eq!(h.abandon("rl-arrived"), AbandonOutcome::Duplicate);
    assert_eq!(
        h.start("rl-arrived", "op-1"),
        StartOutcome::IllegalState(ReservationState::Abandoned)
    );

    // A started item's outcome is known: nothing to abandon.
    h.reserved("rl-running", 100);
    let started = h.started("rl-running", "op-2");
    assert_eq!(
        h.abandon("rl-running"),
        AbandonOutcome::IllegalState(started)
    );
    h.assert_account(&account, "1000 + 0 + 0 = 900 + 100 + 0 + 0 + 0");
}

/// Runs a shard's book as in docs/design.md §4.7 step 9 via `partition`,
/// closes it for `reason` and returns its terminal receipt, signed by gateway
/// `g-a`.
fn closed_receipt(
    shard: EmergencyShardV1,
    partition: impl FnOnce(&mut ShardLedger),
    reason: ShardCloseReason,
) -> ShardTerminalReceiptV1 {
    let (mut book, _) = ShardLedger::open(shard);
    partition(&mut book);
    let _ = book.close(reason, at(150));
    let mut receipt = book.terminal_receipt().expect("the shard is closed");
    sign_document(&mut receipt, &gateway_signer());
    receipt
}

/// §4.7 step 9 on a shard's book: reserve 120, settle 50, reserve 40 and
/// start it; the executor's outcome is unknown.
fn step_9(book: &mut ShardLedger) {
    let _ = book.reserve(rid("rl-1"), 120, 30_000, 0);
    let _ = book.start(&rid("rl-1"), op("op-1"), 1);
    let _ = book.settle(&rid("rl-1"), &op("op-1"), 50);
    let _ = book.reserve(rid("rl-2"), 40, 30_000, 2);
    let _ = book.start(&rid("rl-2"), op("op-2"), 3);
}

#[test]
fn shard_issue_and_reconcile_once() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    let central = central_signer();
    let gateway = gateway_signer();
    assert_eq!(h.enroll(&gateway), ledger::EnrollOutcome::Enrolled);
    assert_eq!(h.enroll(&gateway), ledger::EnrollOutcome::AlreadyEnrolled);
    // g-a has booted four times.
    for boot in 1..=4 {
        assert_eq!(h.register(&gateway, nonce(boot)), u64::from(boot));
    }

    // 8. Shard S1 of 200 for g-a, boot epoch 4.
    h.at(100);
    let shard = h.issued("s1", &gateway, 4, nonce(4));
    assert_eq!(shard.allocated_units, 200);
    assert_eq!(shard.gateway_identity, identity(&gateway));
    assert_eq!(shard.boot_epoch, 4);
    assert_eq!(shard.boot_nonce, nonce(4));
    assert_eq!(shard.fence, 1);
    assert_eq!(shard.policy_generation, 31);
    assert_eq!(shard.accounting_epoch, at(0));
    assert_eq!((shard.not_before, shard.not_after), (at(100), at(600_100)));
    verify_document(&shard, &verifier(&[&central])).expect("signed by the central key");
    h.assert_account(&account, "1000 + 0 + 0 = 800 + 0 + 0 + 200 + 0");

    // 9–10. Partitioned, then g-a restarts (epoch 5): S1 is closed.
    assert_eq!(h.register(&gateway, nonce(5)), 5);
    let receipt = closed_receipt(shard, step_9, ShardCloseReason::Restart);
    assert_eq!(receipt.spent_units, 50);
    assert_eq!(receipt.confirmed_unused_units, 110);
    assert_eq!(receipt.unknown_units, 40);
    assert_eq!(receipt.overdraft_debt_units, 0);
    assert_eq!(receipt.boot_epoch, 4);

    // 11. Reconnected, the receipt re-mints 110.
    h.at(200);
    let trusted = verifier(&[&gateway]);
    let ReconcileOutcome::Reconciled(done) = h.reconcile(&receipt, &trusted) else {
        panic!("the terminal receipt of a superseded boot still reconciles");
    };
    assert_eq!(done.spent_units, 50);
    assert_eq!(done.confirmed_unused_units, 110);
    assert_eq!(done.unknown_units, 40);
    assert_eq!(done.reminted_units, 110);
    assert_eq!((done.repaid_units, done.cut_units), (0, 0));
    h.assert_account(&account, "1000 + 110 + 0 = 910 + 0 + 0 + 200 + 0");

    // The same receipt again re-mints nothing.
    h.at(300);
    assert_eq!(
        h.reconcile(&receipt, &trusted),
        ReconcileOutcome::Duplicate(done.clone())
    );
    h.assert_account(&account, "1000 + 110 + 0 = 910 + 0 + 0 + 200 + 0");
    // Nor does a differently worded receipt for the same shard.
    let mut inflated = receipt;
    inflated.confirmed_unused_units = 150;
    inflated.unknown_units = 0;
    sign_document(&mut inflated, &gateway);
    assert_eq!(
        h.reconcile(&inflated, &trusted),
        ReconcileOutcome::Duplicate(done)
    );
    h.assert_account(&account, "1000 + 110 + 0 = 910 + 0 + 0 + 200 + 0");
}

#[test]
fn shard_reminted_units_enter_the_current_generation_capped_by_burst() {
    let mut h = Harness::with_policy(policy(31));
    let old = h.account(31);
    let gateway = gateway_signer();
    h.enroll(&gateway);
    let boot = h.register(&gateway, nonce(1));
    let shard = h.issued("s1", &gateway, boot, nonce(1));
    h.assert_account(&old, "1000 + 0 + 0 = 800 + 0 + 0 + 200 + 0");
    let receipt = closed_receipt(shard, step_9, ShardCloseReason::Reconnect);

    // Generation 32 opens full; 130 of it are spent, so there is room for
    // 130 below burst.
    h.at(100);
    assert_eq!(h.publish(policy(32)), PublishOutcome::Published);
    let new = h.account(32);
    h.reserved("rl-a", 130);
    h.started("rl-a", "op-a");
    h.settled("rl-a", "op-a", 130);
    h.assert_account(&new, "1000 + 0 + 0 = 870 + 0 + 130 + 0 + 0");

    // The 110 confirmed unused are re-minted into generation 32's account,
    // not back into 31's; the shard's 200 stay retired where they were cut.
    let ReconcileOutcome::Reconciled(done) = h.reconcile(&receipt, &verifier(&[&gateway])) else {
        panic!("the receipt reconciles");
    };
    assert_eq!((done.reminted_units, done.cut_units), (110, 0));
    h.assert_account(&new, "1000 + 110 + 0 = 980 + 0 + 130 + 0 + 0");
    h.assert_account(&old, "1000 + 0 + 0 = 800 + 0 + 0 + 200 + 0");

    // A second shard's re-mint meets the burst: what is cut is reported.
    let shard = h.issued("s2", &gateway, boot, nonce(1));
    assert_eq!(shard.policy_generation, 32);
    h.assert_account(&new, "1000 + 110 + 0 = 780 + 0 + 130 + 200 + 0");
    h.at(1000);
    h.refill();
    h.assert_account(&new, "1000 + 210 + 0 = 880 + 0 + 130 + 200 + 0");
    let receipt = closed_receipt(shard, |_| {}, ShardCloseReason::Reconnect);
    let ReconcileOutcome::Reconciled(done) = h.reconcile(&receipt, &verifier(&[&gateway])) else {
        panic!("the receipt reconciles");
    };
    assert_eq!(done.confirmed_unused_units, 200);
    assert_eq!((done.reminted_units, done.cut_units), (120, 80));
    h.assert_account(&new, "1000 + 330 + 0 = 1000 + 0 + 130 + 200 + 0");
}

#[test]
fn shard_receipt_from_wrong_identity_refused() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    let (gateway, other) = (gateway_signer(), other_gateway_signer());
    h.enroll(&gateway);
    h.enroll(&other);
    let boot = h.register(&gateway, nonce(1));
    h.register(&other, nonce(2));
    let shard = h.issued("s1", &gateway, boot, nonce(1));
    let genuine = closed_receipt(shard, step_9, ShardCloseReason::Reconnect);
    // Both keys are trusted: the refusals are about the binding.
    let trusted = verifier(&[&gateway, &other]);

    // Another gateway claims the shard in its own name.
    let mut claimed = genuine.clone();
    claimed.gateway_identity = identity(&other);
    sign_document(&mut claimed, &other);
    assert_eq!(
        h.reconcile(&claimed, &trusted),
        ReconcileOutcome::WrongIdentity
    );
    // Another gateway signs a receipt in the bound gateway's name.
    let mut impersonated = genuine.clone();
    sign_document(&mut impersonated, &other);
    assert_eq!(impersonated.gateway_identity, identity(&gateway));
    assert_eq!(
        h.reconcile(&impersonated, &trusted),
        ReconcileOutcome::WrongIdentity
    );
    // The bound gateway's key, but the numbers were changed after signing.
    let mut tampered = genuine.clone();
    tampered.confirmed_unused_units += 40;
    tampered.unknown_units -= 40;
    assert!(matches!(
        h.reconcile(&tampered, &trusted),
        ReconcileOutcome::BadSignature(_)
    ));
    // Unsigned.
    let mut unsigned = genuine.clone();
    unsigned.signature = Signature::UNSIGNED;
    assert!(matches!(
        h.reconcile(&unsigned, &trusted),
        ReconcileOutcome::BadSignature(_)
    ));
    // The bound gateway's own signature over other shard facts.
    let mut other_boot = genuine.clone();
    other_boot.boot_epoch += 1;
    sign_document(&mut other_boot, &gateway);
    assert_eq!(
        h.reconcile(&other_boot, &trusted),
        ReconcileOutcome::Mismatch("bootEpoch")
    );
    let mut other_size = genuine.clone();
    other_size.allocated_units += 10;
    other_size.confirmed_unused_units += 10;
    sign_document(&mut other_size, &gateway);
    assert_eq!(
        h.reconcile(&other_size, &trusted),
        ReconcileOutcome::Mismatch("allocatedUnits")
    );
    h.assert_account(&account, "1000 + 0 + 0 = 800 + 0 + 0 + 200 + 0");
    assert!(
        h.ledger
            .shard(&genuine.shard)
            .expect("issued")
            .reconciliation
            .is_none()
    );

    // The genuine receipt still reconciles, once.
    let ReconcileOutcome::Reconciled(done) = h.reconcile(&genuine, &trusted) else {
        panic!("the bound gateway's receipt reconciles");
    };
    assert_eq!(done.reminted_units, 110);
    h.assert_account(&account, "1000 + 110 + 0 = 910 + 0 + 0 + 200 + 0");
    assert_eq!(
        h.reconcile(&claimed, &trusted),
        ReconcileOutcome::WrongIdentity
    );
}

#[test]
fn shard_issue_for_superseded_boot_refused() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    let (gateway, stranger) = (gateway_signer(), other_gateway_signer());
    assert_eq!(
        h.issue("s0", &stranger, 1, nonce(1)),
        IssueShardOutcome::UnknownGateway
    );
    assert_eq!(
        h.register_request(&stranger, nonce(1), fresh_boot(nonce(1), h.now)),
        RegisterOutcome::UnknownGateway
    );
    h.enroll(&gateway);
    // Enrolled, never registered: no boot holds shards.
    assert_eq!(
        h.issue("s0", &gateway, 0, nonce(0)),
        IssueShardOutcome::SupersededBoot { current_epoch: 0 }
    );

    assert_eq!(h.register(&gateway, nonce(1)), 1);
    assert_eq!(h.register(&gateway, nonce(2)), 2);
    // The old boot, by epoch and nonce, by nonce alone, or by epoch alone.
    for (epoch, boot_nonce) in [(1, nonce(1)), (2, nonce(1)), (1, nonce(2)), (3, nonce(2))] {
        assert_eq!(
            h.issue("s1", &gateway, epoch, boot_nonce),
            IssueShardOutcome::SupersededBoot { current_epoch: 2 }
        );
    }
    h.assert_account(&account, "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");
    let shard = h.issued("s1", &gateway, 2, nonce(2));
    assert_eq!((shard.boot_epoch, shard.boot_nonce), (2, nonce(2)));
    h.assert_account(&account, "1000 + 0 + 0 = 800 + 0 + 0 + 200 + 0");
}

/// The fence of a shard issued for `subject_name`'s pair.
#[track_caller]
fn fence(
    h: &mut Harness,
    subject_name: &str,
    shard: &str,
    signer: &Ed25519Signer,
    boot_epoch: u64,
    boot_nonce: BootNonce,
) -> u64 {
    match h.issue_for(subject_name, shard, signer, boot_epoch, boot_nonce) {
        IssueShardOutcome::Issued(shard) => shard.fence,
        other => panic!("expected a shard, got {other:?}"),
    }
}

#[test]
fn fence_rises_per_pair() {
    let mut h = Harness::with_policy(policy(31));
    assert_eq!(
        h.publish(policy_for("tenant-8", 1)),
        PublishOutcome::Published
    );
    let (gateway, other) = (gateway_signer(), other_gateway_signer());
    h.enroll(&gateway);
    h.enroll(&other);
    let boot = h.register(&gateway, nonce(1));
    let other_boot = h.register(&other, nonce(2));

    assert_eq!(fence(&mut h, "tenant-7", "s1", &gateway, boot, nonce(1)), 1);
    assert_eq!(
        fence(&mut h, "tenant-7", "s2", &other, other_boot, nonce(2)),
        2
    );
    // Another pair has its own fences.
    assert_eq!(fence(&mut h, "tenant-8", "s3", &gateway, boot, nonce(1)), 1);
    assert_eq!(fence(&mut h, "tenant-7", "s4", &gateway, boot, nonce(1)), 3);
    // Two open shards per gateway boot and pair at most; an ID only once.
    assert_eq!(
        h.issue("s5", &gateway, boot, nonce(1)),
        IssueShardOutcome::TooManyOpenShards
    );
    assert_eq!(
        h.issue("s1", &other, other_boot, nonce(2)),
        IssueShardOutcome::ShardIdTaken
    );
    // A new boot gets the next fence, never an old one.
    let other_boot = h.register(&other, nonce(3));
    assert_eq!(
        fence(&mut h, "tenant-7", "s6", &other, other_boot, nonce(3)),
        4
    );
    let account = h.account(31);
    h.assert_account(&account, "1000 + 0 + 0 = 200 + 0 + 0 + 800 + 0");
    assert_eq!(h.ledger.pair(&pair()).expect("pair").next_fence, 5);
    // The gateway's new boot finds its old boot's two open shards still
    // counted (the cap of 2 × 200 spans boots), and g-b holds 400 over its
    // two boots: both are refused until receipts come or the oldest shard
    // is lost (600 s validity + 600 s grace). A refused issuance takes no
    // fence.
    let boot = h.register(&gateway, nonce(4));
    assert!(matches!(
        h.issue("s7", &gateway, boot, nonce(4)),
        IssueShardOutcome::UnreconciledCap { .. }
    ));
    assert_eq!(
        h.issue("s7", &other, other_boot, nonce(3)),
        IssueShardOutcome::UnreconciledCap {
            retry_after_seconds: 1200
        }
    );
    assert_eq!(h.ledger.pair(&pair()).expect("pair").next_fence, 5);
}

#[test]
fn shard_receipt_debt_becomes_overdraft_issued() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    let gateway = gateway_signer();
    h.enroll(&gateway);
    let boot = h.register(&gateway, nonce(1));
    let shard = h.issued("s1", &gateway, boot, nonce(1));
    h.assert_account(&account, "1000 + 0 + 0 = 800 + 0 + 0 + 200 + 0");

    // 12. Locally: reserve 120, settle 50, then reserve 100 at local
    //     available 150 and settle it at 180: the shard gives its last 50,
    //     the 30 beyond travel as debt.
    let receipt = closed_receipt(
        shard,
        |book| {
            let _ = book.reserve(rid("rl-1"), 120, 30_000, 0);
            let _ = book.start(&rid("rl-1"), op("op-1"), 1);
            let _ = book.settle(&rid("rl-1"), &op("op-1"), 50);
            let _ = book.reserve(rid("rl-2"), 100, 30_000, 2);
            let _ = book.start(&rid("rl-2"), op("op-2"), 3);
            let _ = book.settle(&rid("rl-2"), &op("op-2"), 180);
        },
        ShardCloseReason::Reconnect,
    );
    assert_eq!(receipt.spent_units, 200);
    assert_eq!(receipt.confirmed_unused_units, 0);
    assert_eq!(receipt.unknown_units, 0);
    assert_eq!(receipt.overdraft_debt_units, 30);

    // Centrally: overdraftIssued 30 and spent 30; the pair pauses.
    h.at(200);
    let ReconcileOutcome::Reconciled(done) = h.reconcile(&receipt, &verifier(&[&gateway])) else {
        panic!("the receipt reconciles");
    };
    assert_eq!(done.overdraft_debt_units, 30);
    assert_eq!(done.reminted_units, 0);
    h.assert_account(&account, "1000 + 0 + 30 = 800 + 0 + 30 + 200 + 0");
    assert_eq!(h.ledger.pair_debt(&pair()), 30);
    assert_eq!(rejected(h.reserve("rl-c", 1)).dimension, Dimension::Debt);
    let IssueShardOutcome::Rejected(refused) = h.issue("s2", &gateway, boot, nonce(1)) else {
        panic!("no shard while the pair owes debt");
    };
    assert_eq!(refused.dimension, Dimension::Debt);

    // A refill of 100 repays the 30 first; the other 70 reach available.
    h.at(1000);
    h.refill();
    h.assert_account(&account, "1000 + 100 + 30 = 870 + 0 + 30 + 200 + 30");
    assert_eq!(h.ledger.pair_debt(&pair()), 0);
    h.reserved("rl-c", 100);
}

#[test]
fn shadow_mode_records_but_spends_nothing() {
    let mut shadow = policy(31);
    shadow.mode = RouteMode::Shadow;
    shadow.opening = 500;
    let mut h = Harness::with_policy(shadow);
    let account = h.account(31);
    h.assert_account(&account, "500 + 0 + 0 = 500 + 0 + 0 + 0 + 0");

    // Enforcement would refuse 600 of 500 (100 missing: 1 s).
    let ReserveOutcome::Shadow {
        receipt,
        would_reject,
    } = h.reserve("rl-s1", 600)
    else {
        panic!("shadow mode admits");
    };
    assert_eq!(would_reject, Some(rejection(Dimension::Capacity, Some(1))));
    assert_eq!(receipt.state, ReservationState::Reserved);
    assert!(h.reservation("rl-s1").shadow);
    assert_eq!(h.reserve("rl-s1", 600), ReserveOutcome::Duplicate(receipt));
    let ReserveOutcome::Shadow { would_reject, .. } = h.reserve("rl-s2", 400) else {
        panic!("shadow mode admits");
    };
    assert_eq!(would_reject, None);
    let ReserveOutcome::Shadow { would_reject, .. } = h.reserve("rl-s3", 900) else {
        panic!("shadow mode admits");
    };
    assert_eq!(
        would_reject,
        Some(rejection(Dimension::ReservationUnitsMax, None))
    );
    h.assert_account(&account, "500 + 0 + 0 = 500 + 0 + 0 + 0 + 0");

    // It settles, even far above the reservation, without spending.
    h.started("rl-s1", "op-1");
    let settlement = h.settled("rl-s1", "op-1", 5000);
    assert_eq!(settlement.actual_units, 5000);
    h.assert_account(&account, "500 + 0 + 0 = 500 + 0 + 0 + 0 + 0");
    assert_eq!(h.ledger.pair_debt(&pair()), 0);
    assert!(!h.ledger.pair(&pair()).expect("pair").frozen);

    // It expires without refunding anything.
    h.at(30_000);
    assert_eq!(h.begin_expiry(), vec![rid("rl-s2"), rid("rl-s3")]);
    assert_eq!(h.complete_expiry(), vec![rid("rl-s2"), rid("rl-s3")]);
    h.assert_account(&account, "500 + 0 + 0 = 500 + 0 + 0 + 0 + 0");

    // No emergency shards outside enforcement.
    let gateway = gateway_signer();
    h.enroll(&gateway);
    let boot = h.register(&gateway, nonce(1));
    assert_eq!(
        h.issue("s1", &gateway, boot, nonce(1)),
        IssueShardOutcome::EmergencyDisabled
    );
}

#[test]
fn off_mode_not_enforced() {
    let mut off = policy(31);
    off.mode = RouteMode::Off;
    let mut h = Harness::with_policy(off);
    let account = h.account(31);
    assert_eq!(h.reserve("rl-o", 600), ReserveOutcome::NotEnforced);
    assert_eq!(h.reserve("rl-o", 600), ReserveOutcome::NotEnforced);
    assert!(h.ledger.reservation(&rid("rl-o")).is_none(), "no record");
    assert_eq!(h.start("rl-o", "op-1"), StartOutcome::NotFound);
    assert_eq!(h.settle("rl-o", "op-1", 600), SettleOutcome::NotFound);
    h.assert_account(&account, "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");
    let gateway = gateway_signer();
    h.enroll(&gateway);
    let boot = h.register(&gateway, nonce(1));
    assert_eq!(
        h.issue("s1", &gateway, boot, nonce(1)),
        IssueShardOutcome::EmergencyDisabled
    );

    // Enforcement starts with the next generation; the ID was never used.
    h.at(1000);
    assert_eq!(h.publish(policy(32)), PublishOutcome::Published);
    let receipt = h.reserved("rl-o", 600);
    assert_eq!(receipt.policy_generation, 32);
}

#[test]
fn overflow_is_a_named_rejection() {
    let mut h = Harness::with_policy(policy(31));
    let account = h.account(31);
    for units in [0, UNITS_MAX + 1, u64::MAX] {
        assert_eq!(h.reserve("rl-bad", units), ReserveOutcome::InvalidUnits);
    }
    assert_eq!(
        rejected(h.reserve("rl-big", 801)),
        rejection(Dimension::ReservationUnitsMax, None)
    );
    h.reserved("rl-a", 600);
    h.started("rl-a", "op-1");
    for actual in [UNITS_MAX + 1, u64::MAX] {
        assert_eq!(
            h.settle("rl-a", "op-1", actual),
            SettleOutcome::Overflow(Overflow)
        );
    }
    h.assert_account(&account, "1000 + 0 + 0 = 400 + 600 + 0 + 0 + 0");

    // A boot epoch counter at its end.
    let gateway = gateway_signer();
    let records = vec![Change::Gateway(GatewayRecord {
        identity: identity(&gateway),
        enrolled_at: at(0),
        boot_epoch: u64::MAX,
        boot_nonce: Some(nonce(1)),
        last_boot_request: None,
    })];
    let mut h = Harness::from_records(records);
    assert_eq!(
        h.register_request(&gateway, nonce(2), fresh_boot(nonce(2), h.now)),
        RegisterOutcome::Overflow(Overflow)
    );
}

#[test]
fn corrupt_records_refuse_to_load() {
    let mut h = seed_story();
    // One unit appears from nowhere.
    let records = edit_accounts(h.records(), |account| {
        account.terms.available += 1;
    });
    assert!(matches!(
        CentralLedger::from_records(CentralConfig::default(), records),
        Err(LoadError::Invariants(_))
    ));
    // `reserved` no longer matches the reservations that hold it.
    h.reserved("rl-x", 100);
    let records = edit_accounts(h.records(), |account| {
        account.terms.reserved -= 100;
        account.terms.available += 100;
    });
    assert!(matches!(
        CentralLedger::from_records(CentralConfig::default(), records),
        Err(LoadError::Invariants(_))
    ));
}
