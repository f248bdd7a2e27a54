//! The central service as real processes (`reservoir central serve`, through
//! `reservoir::cluster`), called directly as agents call it:
//!
//! - a `kill -9` in the middle of a burst of reservations loses no
//!   acknowledged reservation: after a restart every acknowledged ID is
//!   found and the audit is clean (durability: no reply before the commit);
//! - `kill -9` during retention sweeps, 20 times (issue #12): every restart
//!   loads the store and audits clean, and every acknowledged reservation
//!   reads as acknowledged until its window passes, then so or not found;
//! - two replicas over one PostgreSQL database, hammered concurrently on one
//!   account, never over-issue and leave a clean audit (per-pair row locks);
//! - the operator tools (`reservoir keygen --out`, `reservoir central
//!   enroll`, `reservoir audit`) against a running service.
//!
//! The PostgreSQL test needs a server: `RESERVOIR_TEST_POSTGRES_URL` (a URL
//! whose database may create others; `scripts/test` starts one and sets
//! it). Without it the test says so and passes, except in CI (`CI=true`),
//! where a missing server fails it.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use central_client::wire::{SettleBody, StartBody};
use central_client::{CallError, CentralClient, ReleaseReply, ReserveReply};
use ledger::ReserveRequest;
use ledger::protocol::ErrorCode;
use reservoir::cluster::{
    Central, Cluster, ClusterOptions, policy, signed_reserve_request, wait_until,
};
use shard_format::{
    AdmissionBudgetV1, DocumentSigner as _, Ed25519Signer, OperationId, Refill, ReservationState,
};
use tokio::process::Command;

const BINARY: &str = env!("CARGO_BIN_EXE_reservoir");
const SUBJECT: &str = "tenant-7";
const ROUTE: &str = "chat.generate";

/// The env var naming the PostgreSQL server the tests may use.
const POSTGRES_ENV: &str = "RESERVOIR_TEST_POSTGRES_URL";

/// The PostgreSQL server's URL, or `None` (with a note) when it is not set
/// outside CI. In CI (`CI=true`) a missing server fails the test.
fn postgres_url() -> Option<String> {
    match std::env::var(POSTGRES_ENV) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            let in_ci = std::env::var("CI").is_ok_and(|value| value == "true" || value == "1");
            assert!(
                !in_ci,
                "{POSTGRES_ENV} is not set: CI must test the PostgreSQL store (scripts/test starts a server)"
            );
            eprintln!(
                "note: {POSTGRES_ENV} is not set; skipping the PostgreSQL test (run scripts/test)"
            );
            None
        }
    }
}

/// A central service of its own, without agents.
async fn start_central() -> Cluster {
    Cluster::start(ClusterOptions::new(BINARY, 0))
        .await
        .expect("the central service starts")
}

/// An agent identity from a seed byte.
fn agent_signer(seed: u8) -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&[seed; 32])
}

/// A reservation request for `tenant-7/chat.generate` under idempotency
/// key `key`, as `agent` sends it (the ID derived from its identity).
fn reserve_request(agent: &CentralClient, key: &str, units: u64) -> ReserveRequest {
    signed_reserve_request(agent, SUBJECT, ROUTE, key, units).expect("a valid request")
}

/// No refill, and holds that never expire while a test looks: every unit
/// moved is the test's doing.
fn still_policy(units: u64) -> AdmissionBudgetV1 {
    let mut policy = policy(SUBJECT, ROUTE, 1);
    policy.opening = units;
    policy.burst = units;
    policy.refill = Refill {
        units: 0,
        interval_ms: 1000,
    };
    // No hold expires within a test; with the hard limit, the policy fits
    // the default retention window (24 h).
    policy.hold_ttl_ms = 6 * 3_600_000;
    policy
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_burst_loses_no_acknowledged_reservation() {
    let mut cluster = start_central().await;
    let central = cluster.central();
    central
        .publish(&still_policy(10_000_000))
        .await
        .expect("publish");
    central
        .enroll(agent_signer(1).key_id())
        .await
        .expect("enrol");
    let agent = central.as_identity(agent_signer(1)).expect("client");
    let acknowledged = Arc::new(Mutex::new(Vec::new()));
    let unknown = Arc::new(Mutex::new(Vec::new()));
    let lanes: Vec<_> = (0..32)
        .map(|lane| {
            let agent = agent.clone();
            let acknowledged = acknowledged.clone();
            let unknown = unknown.clone();
            tokio::spawn(async move {
                // Bounded: a lane stops at its first failure or after 10 000.
                for index in 0..10_000 {
                    let request = reserve_request(&agent, &format!("rl-k9-{lane}-{index}"), 1);
                    match agent.reserve(&request).await {
                        Ok(ReserveReply::Reserved(_)) => {
                            acknowledged.lock().expect("lock").push(request)
                        }
                        Ok(other) => panic!("unexpected {other:?}"),
                        Err(CallError::NotSent(_)) => return,
                        Err(_) => {
                            unknown.lock().expect("lock").push(request);
                            return;
                        }
                    }
                }
            })
        })
        .collect();
    let started = std::time::Instant::now();
    wait_until(
        "300 acknowledged reservations",
        Duration::from_secs(30),
        || {
            let count = acknowledged.lock().expect("lock").len();
            async move { Ok((count >= 300).then_some(())) }
        },
    )
    .await
    .expect("the burst gets going");
    cluster.central_mut().kill().await.expect("kill -9");
    for lane in lanes {
        lane.await.expect("lane");
    }
    let acknowledged = std::mem::take(&mut *acknowledged.lock().expect("lock"));
    let unknown = std::mem::take(&mut *unknown.lock().expect("lock"));
    eprintln!(
        "killed after {:?} with {} acknowledged and {} unknown reservations",
        started.elapsed(),
        acknowledged.len(),
        unknown.len()
    );

    cluster.central_mut().start().await.expect("restart");
    let central = cluster.central();
    for request in &acknowledged {
        let receipt = agent
            .reservation(&request.reservation)
            .await
            .unwrap_or_else(|error| panic!("{} was acknowledged: {error}", request.reservation));
        assert_eq!(receipt.reserved_units, 1);
    }
    // The unknown ones resolve under their own IDs: once, never twice.
    for request in &unknown {
        let reply = agent.reserve_with_retry(request).await.expect("resolved");
        assert!(matches!(
            reply,
            ReserveReply::Reserved(_) | ReserveReply::Duplicate(_)
        ));
    }
    let report = central.audit().await.expect("audit");
    assert!(report.ok, "{:#?}", report.violations);
    let view = central.accounts(SUBJECT, ROUTE).await.expect("accounts");
    assert_eq!(
        view.accounts[0].terms.reserved, report.reservations as u64,
        "every stored reservation holds one unit"
    );
    assert!(report.reservations >= acknowledged.len() + unknown.len());
    let status = cluster.central_mut().stop().await.expect("stop");
    assert!(status.success(), "a graceful shutdown exits 0: {status}");
}

/// What one lane of the replica test did.
#[derive(Debug, Default)]
struct Tally {
    /// Units of reservations left `RESERVED`.
    held: u64,
    /// Actual units of settlements.
    spent: u64,
    admitted: u64,
    rejected: u64,
    duplicates: u64,
}

fn op(name: &str) -> OperationId {
    OperationId::new(name).expect("valid")
}

/// One lane: reserve (every fifth the same reserve to both replicas at
/// once), then finish it on the other replica: release, settle, or keep.
async fn replica_lane(lane: u64, here: CentralClient, there: CentralClient) -> Tally {
    let mut tally = Tally::default();
    for index in 0..30u64 {
        let units = 1 + (lane * 7 + index * 3) % 9;
        let request = reserve_request(&here, &format!("rl-pg-{lane}-{index}"), units);
        let reply = if index % 5 == 0 {
            let (first, second) = tokio::join!(here.reserve(&request), there.reserve(&request));
            match (first, second) {
                (Ok(ReserveReply::Reserved(r)), Ok(ReserveReply::Duplicate(_)))
                | (Ok(ReserveReply::Duplicate(_)), Ok(ReserveReply::Reserved(r))) => {
                    tally.duplicates += 1;
                    Ok(ReserveReply::Reserved(r))
                }
                (Err(one), Err(other)) => {
                    assert_eq!(one.rejection().map(|r| r.status), Some(429));
                    assert_eq!(other.rejection().map(|r| r.status), Some(429));
                    Err(one)
                }
                // One refused for capacity, then the other reserved after
                // a release freed units: the ledger linearized them.
                (Ok(ReserveReply::Reserved(r)), Err(refused))
                | (Err(refused), Ok(ReserveReply::Reserved(r))) => {
                    assert_eq!(refused.rejection().map(|r| r.status), Some(429));
                    Ok(ReserveReply::Reserved(r))
                }
                other => panic!("a reservation answered inconsistently: {other:?}"),
            }
        } else {
            here.reserve(&request).await
        };
        match reply {
            Ok(ReserveReply::Reserved(_)) => tally.admitted += 1,
            Ok(other) => panic!("unexpected {other:?}"),
            Err(error) => {
                assert_eq!(error.rejection().map(|r| r.status), Some(429), "{error}");
                tally.rejected += 1;
                continue;
            }
        }
        match index % 3 {
            0 => {
                there.release(&request.reservation).await.expect("release");
            }
            1 => {
                let operation = op(&format!("op-{lane}-{index}"));
                there
                    .start(
                        &request.reservation,
                        &StartBody {
                            operation_id: operation.clone(),
                            deadline_ms: None,
                        },
                    )
                    .await
                    .expect("start");
                let actual = units / 2;
                here.settle(&request.reservation, &SettleBody::one(operation, actual))
                    .await
                    .expect("settle");
                tally.spent += actual;
            }
            _ => tally.held += units,
        }
    }
    tally
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_over_one_postgres_never_over_issue() {
    let Some(server_url) = postgres_url() else {
        return;
    };
    let database = format!("reservoir_test_replicas_{}", std::process::id());
    let database_url = reservoir::postgres::create_database(&server_url, &database)
        .await
        .expect("a throwaway database");
    let dir = tempfile::tempdir().expect("a temporary directory");
    // Both start at once: they create the schema concurrently.
    let (a, b) = tokio::join!(
        Central::create(
            Path::new(BINARY),
            dir.path(),
            "replica-a",
            Some(&database_url)
        ),
        Central::create(
            Path::new(BINARY),
            dir.path(),
            "replica-b",
            Some(&database_url)
        ),
    );
    let (mut a, mut b) = (a.expect("replica a starts"), b.expect("replica b starts"));
    a.publish(&still_policy(1000)).await.expect("publish");
    a.enroll(agent_signer(1).key_id()).await.expect("enrol");
    let replicas = [
        a.as_identity(agent_signer(1)).expect("client"),
        b.as_identity(agent_signer(1)).expect("client"),
    ];
    let tallies: Vec<_> = (0..24u64)
        .map(|lane| {
            let here = replicas[(lane % 2) as usize].clone();
            let there = replicas[((lane + 1) % 2) as usize].clone();
            tokio::spawn(replica_lane(lane, here, there))
        })
        .collect();
    let started = std::time::Instant::now();
    let mut total = Tally::default();
    for lane in tallies {
        let tally = lane.await.expect("lane");
        total.held += tally.held;
        total.spent += tally.spent;
        total.admitted += tally.admitted;
        total.rejected += tally.rejected;
        total.duplicates += tally.duplicates;
    }
    eprintln!("two replicas: {total:?} in {:?}", started.elapsed());
    assert!(
        total.admitted > 0 && total.rejected > 0,
        "capacity ran out: {total:?}"
    );
    assert!(
        total.duplicates > 0,
        "some duplicates raced across replicas"
    );
    for replica in [&a, &b] {
        let report = replica.audit().await.expect("audit");
        assert!(report.ok, "{:#?}", report.violations);
        let view = replica.accounts(SUBJECT, ROUTE).await.expect("accounts");
        assert_eq!(view.accounts.len(), 1);
        let terms = view.accounts[0].terms;
        assert_eq!(terms.reserved, total.held, "every kept unit, once");
        assert_eq!(terms.spent, total.spent, "every settled unit, once");
        assert_eq!(terms.minted, 0);
        assert_eq!(
            terms.available + terms.reserved + terms.spent,
            1000,
            "no over-issue: {terms:?}"
        );
    }
    let (status_a, status_b) = tokio::join!(a.stop(), b.stop());
    assert!(status_a.expect("stop a").success() && status_b.expect("stop b").success());
    reservoir::postgres::drop_database(&server_url, &database)
        .await
        .expect("drop the throwaway database");
}

/// `reservoir keygen --out`, `reservoir central enroll --key-file` and
/// `reservoir audit` against a running service: the table, and exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_tools_enroll_and_audit() {
    let mut cluster = start_central().await;
    let central = cluster.central();
    central
        .publish(&policy(SUBJECT, ROUTE, 1))
        .await
        .expect("publish");
    let key = cluster.dir().join("agent.key");
    let output = Command::new(BINARY)
        .args(["keygen", "--out"])
        .arg(&key)
        .output()
        .await
        .expect("keygen");
    assert!(output.status.success());
    let identity = String::from_utf8(output.stdout).expect("utf-8");
    let output = Command::new(BINARY)
        .args(["central", "enroll", "--central", &central.url()])
        .arg("--central-ca-file")
        .arg(central.ca_file().expect("the center serves HTTPS"))
        .arg("--operator-token-file")
        .arg(central.token_path())
        .arg("--key-file")
        .arg(&key)
        .output()
        .await
        .expect("enroll");
    assert!(output.status.success(), "{output:?}");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("enrolled {}", identity.trim())
    );
    let agent = central
        .as_identity(central_client::key_file::load(&key).expect("the agent key"))
        .expect("client");
    agent
        .reserve(&reserve_request(&agent, "rl-tools", 10))
        .await
        .expect("the enrolled agent reserves");
    let output = Command::new(BINARY)
        .args(["audit", "--central", &central.url()])
        .arg("--central-ca-file")
        .arg(central.ca_file().expect("the center serves HTTPS"))
        .arg("--operator-token-file")
        .arg(central.token_path())
        .output()
        .await
        .expect("audit");
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{table}");
    assert!(table.contains("tenant-7/chat.generate"), "{table}");
    assert!(
        table.contains("audit: clean: 1 accounts, 1 reservations, 0 shards, debt 0"),
        "{table}"
    );
    let status = cluster.central_mut().stop().await.expect("stop");
    assert!(status.success(), "a graceful shutdown exits 0: {status}");
}

/// The retention window of the sweep test: exactly the floor of its policy
/// (holdTtlMs 1000 + executionHardLimitMs 1000 + the 30 s margin).
const SWEEP_RETENTION: Duration = Duration::from_secs(32);
/// Terminal reservations made before the kills.
const SWEEP_RECORDS: usize = 20_000;
/// `kill -9` and restart, this many times.
const SWEEP_KILLS: usize = 20;

/// Holds of one second and a one-second execution limit, so a window of
/// 32 s fits the policy; capacity that never runs out.
fn sweep_policy() -> AdmissionBudgetV1 {
    let mut policy = still_policy(1_000_000_000);
    policy.hold_ttl_ms = 1000;
    policy.execution_hard_limit_ms = 1000;
    policy
}

/// What the service last acknowledged about one reservation.
#[derive(Debug, Clone, Copy)]
struct Acked {
    state: ReservationState,
    /// When its reservation was first sent: it ended no earlier, so its
    /// retention window cannot have passed before `reserved_from + window`.
    reserved_from: std::time::Instant,
}

/// Whether a reservation acknowledged in `acked` may later be seen in
/// `seen`: the same state, or one its state machine moves on to by itself
/// (a hold expires).
fn may_follow(acked: ReservationState, seen: ReservationState) -> bool {
    use ReservationState::{Expired, Expiring, Reserved};
    acked == seen || matches!((acked, seen), (Reserved | Expiring, Expiring | Expired))
}

/// Repeats `call` (the same request) until the service answers, across
/// kills and restarts; a bounded wait. The pause is back-off between
/// attempts, not a wait for a state.
async fn until_answered<T, F, Fut>(what: &str, mut call: F) -> Result<T, CallError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, CallError>>,
{
    let started = std::time::Instant::now();
    loop {
        match call().await {
            Err(CallError::NotSent(_) | CallError::OutcomeUnknown(_))
                if started.elapsed() < Duration::from_secs(60) =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(CallError::NotSent(error) | CallError::OutcomeUnknown(error)) => {
                panic!("{what}: no answer within 60 s: {error}")
            }
            other => return other,
        }
    }
}

/// Reserves `id` (one unit) and releases it, resolving every unknown
/// outcome under the same IDs; returns the last acknowledged state. A hold
/// may expire before its release lands (its TTL is one second, a restart
/// takes longer): the refusal names the state.
async fn reserve_and_release(agent: &CentralClient, id: &str) -> Acked {
    let reserved_from = std::time::Instant::now();
    let request = reserve_request(agent, id, 1);
    let state = match until_answered(id, || agent.reserve(&request)).await {
        Ok(ReserveReply::Reserved(receipt) | ReserveReply::Duplicate(receipt)) => receipt.state,
        other => panic!("{id}: reserve answered {other:?}"),
    };
    if state != ReservationState::Reserved {
        return Acked {
            state,
            reserved_from,
        };
    }
    let state = match until_answered(id, || agent.release(&request.reservation)).await {
        Ok(ReleaseReply::Released(receipt) | ReleaseReply::Duplicate(receipt)) => receipt.state,
        Err(CallError::Rejected(refusal)) if refusal.error == ErrorCode::IllegalState => refusal
            .details
            .state
            .unwrap_or_else(|| panic!("{id}: an illegal-state refusal names no state")),
        other => panic!("{id}: release answered {other:?}"),
    };
    Acked {
        state,
        reserved_from,
    }
}

/// `reservoir_forgotten_records_total` of the running process (since its
/// start), over every kind of record.
async fn forgotten_since_start(operator: &CentralClient) -> u64 {
    let text = operator.metrics().await.expect("metrics");
    let series: Vec<u64> = text
        .lines()
        .filter(|line| line.starts_with("reservoir_forgotten_records_total{"))
        .filter_map(|line| line.rsplit_once(' ')?.1.trim().parse().ok())
        .collect();
    assert!(
        !series.is_empty(),
        "no reservoir_forgotten_records_total in:\n{text}"
    );
    series.iter().sum()
}

/// A pseudo-random pause of 100–600 ms (a fixed sequence: the same
/// pauses every run).
fn pause(round: usize) -> Duration {
    let mixed = (round as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
    Duration::from_millis(100 + mixed % 501)
}

/// Issue #12: `kill -9` during retention sweeps, 20 times. 20 000
/// reservations end quickly; once the oldest are due, the service forgets
/// them in back-to-back batches while it is killed and restarted over the
/// same data directory, with new reservations trickling in. Each restart
/// loads the store and audits clean; at the end every acknowledged
/// reservation still inside its window reads in its acknowledged state,
/// every one past it reads so or not found (never in another state), and
/// some were forgotten.
///
/// Over `postgres` (a database URL) or, without it, redb.
async fn kill_9_during_retention_sweeps(postgres: Option<&str>, records: usize, kills: usize) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let retention = format!("{}s", SWEEP_RETENTION.as_secs());
    let mut central = Central::create_with_args(
        Path::new(BINARY),
        dir.path(),
        "central",
        postgres,
        &["--retention".to_owned(), retention],
    )
    .await
    .expect("the central service starts");
    central.publish(&sweep_policy()).await.expect("publish");
    central
        .enroll(agent_signer(1).key_id())
        .await
        .expect("enrol");
    let agent = central.as_identity(agent_signer(1)).expect("client");
    let operator = central.operator().expect("operator client");

    // 20 000 reservations end (reserve, release) as fast as 16 lanes go,
    // through the kills below.
    let started = std::time::Instant::now();
    let lanes = 16;
    let bulk: Vec<_> = (0..lanes)
        .map(|lane| {
            let agent = agent.clone();
            tokio::spawn(async move {
                let mut acked = Vec::new();
                for index in (lane..records).step_by(lanes) {
                    let id = format!("rl-sweep-{index}");
                    // Mostly RELEASED; a hold that waited over its second
                    // for the release expired instead.
                    acked.push((id.clone(), reserve_and_release(&agent, &id).await));
                }
                acked
            })
        })
        .collect();
    // The kills start when the oldest are due (the bulk may still be
    // going), so they land among sweeps.
    let due = started + SWEEP_RETENTION;
    tokio::time::sleep_until(due.into()).await;

    let trickle = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let trickling: Vec<_> = (0..2)
        .map(|lane| {
            let agent = agent.clone();
            let trickle = trickle.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let mut index = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let id = format!("rl-trickle-{lane}-{index}");
                    let answer = reserve_and_release(&agent, &id).await;
                    trickle.lock().expect("lock").push((id, answer));
                    index += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
        })
        .collect();

    let mut swept_before_kill = Vec::new();
    let mut stored_after_restart = Vec::new();
    for round in 0..kills {
        tokio::time::sleep(pause(round)).await;
        swept_before_kill.push(forgotten_since_start(&operator).await);
        central.kill().await.expect("kill -9");
        central
            .start()
            .await
            .unwrap_or_else(|error| panic!("restart {round}: the store loads: {error}"));
        let report = central.audit().await.expect("audit");
        assert!(
            report.ok,
            "audit after restart {round}: {:#?}",
            report.violations
        );
        stored_after_restart.push(report.reservations);
    }
    let mut acknowledged = Vec::with_capacity(records);
    for lane in bulk {
        acknowledged.extend(lane.await.expect("lane"));
    }
    let released = acknowledged
        .iter()
        .filter(|(_, acked)| acked.state == ReservationState::Released)
        .count();
    eprintln!(
        "{} reservations ended ({released} released) by {:?}",
        acknowledged.len(),
        started.elapsed()
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for lane in trickling {
        lane.await.expect("trickle lane");
    }
    let trickle = std::mem::take(&mut *trickle.lock().expect("lock"));
    eprintln!(
        "{kills} kills over {:?} after the oldest were due; forgotten by each process \
         before its kill: {swept_before_kill:?}; reservations stored after each restart: \
         {stored_after_restart:?}; {} trickled in",
        due.elapsed(),
        trickle.len()
    );
    assert!(
        !trickle.is_empty(),
        "reservations trickled in during the kills"
    );
    assert!(
        swept_before_kill.iter().any(|&forgotten| forgotten > 0),
        "some kills hit a process that was sweeping: {swept_before_kill:?}"
    );

    // Every acknowledged reservation: in its window, as acknowledged (or
    // moved on by expiry); past it, so or not found.
    acknowledged.extend(trickle);
    let checks: Vec<_> = acknowledged
        .chunks(acknowledged.len().div_ceil(8))
        .map(<[_]>::to_vec)
        .map(|chunk| {
            let agent = agent.clone();
            tokio::spawn(async move {
                let mut not_found = 0usize;
                for (id, acked) in chunk {
                    let reservation = reserve_request(&agent, &id, 1).reservation;
                    let answer = agent.reservation(&reservation).await;
                    let read = std::time::Instant::now();
                    // A second's slack for the two clocks (the service's
                    // wall clock, this test's monotonic one).
                    let window_passed =
                        read > acked.reserved_from + SWEEP_RETENTION - Duration::from_secs(1);
                    match answer {
                        Ok(receipt) => assert!(
                            may_follow(acked.state, receipt.state),
                            "{id} was acknowledged {:?}, reads {:?}",
                            acked.state,
                            receipt.state
                        ),
                        Err(CallError::Rejected(refusal))
                            if refusal.error == ErrorCode::ReservationNotFound && window_passed =>
                        {
                            not_found += 1
                        }
                        Err(error) => panic!(
                            "{id} (acknowledged {:?}, window passed: {window_passed}): {error}",
                            acked.state
                        ),
                    }
                }
                not_found
            })
        })
        .collect();
    let mut forgotten = 0;
    for check in checks {
        forgotten += check.await.expect("check");
    }
    let report = central.audit().await.expect("audit");
    assert!(report.ok, "{:#?}", report.violations);
    eprintln!(
        "{forgotten} of {} acknowledged reservations forgotten, {} stored; {:?} in all",
        acknowledged.len(),
        report.reservations,
        started.elapsed()
    );
    assert!(forgotten > 0, "the sweeps forgot something");
    // The sweeps go on while the test reads: what it found may be gone by
    // the audit, never the other way round.
    assert!(
        report.reservations + forgotten <= acknowledged.len(),
        "nothing forgotten comes back: {} stored, {forgotten} forgotten",
        report.reservations
    );
    let status = central.stop().await.expect("stop");
    assert!(status.success(), "a graceful shutdown exits 0: {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_retention_sweeps_loses_nothing_acknowledged() {
    kill_9_during_retention_sweeps(None, SWEEP_RECORDS, SWEEP_KILLS).await;
}

/// The same over PostgreSQL (fewer records and kills: each restart loads
/// every row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_retention_sweeps_over_postgres_loses_nothing_acknowledged() {
    let Some(server_url) = postgres_url() else {
        return;
    };
    let database = format!("reservoir_test_sweep_kills_{}", std::process::id());
    let database_url = reservoir::postgres::create_database(&server_url, &database)
        .await
        .expect("a throwaway database");
    kill_9_during_retention_sweeps(Some(&database_url), 5_000, 8).await;
    reservoir::postgres::drop_database(&server_url, &database)
        .await
        .expect("drop the throwaway database");
}
