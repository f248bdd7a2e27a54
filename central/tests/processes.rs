//! The service as real processes (the `reservoir-central` binary, which
//! runs `reservoir central serve`'s code):
//!
//! - a `kill -9` in the middle of a burst of reservations loses no
//!   acknowledged reservation: after a restart every acknowledged ID is
//!   found and the audit is clean (durability: no reply before the commit);
//! - two replicas over one PostgreSQL database, hammered concurrently on one
//!   account, never over-issue and leave a clean audit (per-pair row locks).

mod common;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use central_client::wire::{SettleBody, StartBody};
use central_client::{CallError, CentralClient, ReserveReply};
use common::*;
use shard_format::{AdmissionBudgetV1, DocumentSigner as _, OperationId, Refill};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

const BINARY: &str = env!("CARGO_BIN_EXE_reservoir-central");

/// A running `reservoir-central central serve`.
struct ServerProcess {
    child: Child,
    base_url: String,
}

impl ServerProcess {
    /// Starts the service and waits (bounded) for its `listening on` line.
    async fn spawn(data: &Path, token_file: &Path, postgres: Option<&str>) -> Self {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(data.join("service.log"))
            .expect("log file");
        let mut command = Command::new(BINARY);
        command
            .args(["central", "serve", "--listen", "127.0.0.1:0", "--data"])
            .arg(data)
            .arg("--operator-token-file")
            .arg(token_file)
            .args(["--log-format", "json"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        if let Some(url) = postgres {
            command.args(["--postgres", url]);
        }
        let mut child = command.spawn().expect("the service binary starts");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("the service says where it listens within 30 s")
            .expect("stdout readable")
            .unwrap_or_else(|| {
                panic!(
                    "the service exited before listening; see {}",
                    data.join("service.log").display()
                )
            });
        let address = line
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
        Self {
            child,
            base_url: format!("http://{address}"),
        }
    }

    fn operator(&self) -> CentralClient {
        CentralClient::new(client_config(&self.base_url))
            .expect("client")
            .with_operator_token(OPERATOR_TOKEN)
    }

    fn agent(&self, seed: u8) -> CentralClient {
        CentralClient::new(client_config(&self.base_url))
            .expect("client")
            .with_identity(agent_signer(seed))
    }

    /// `kill -9`.
    async fn kill(mut self) {
        self.child.start_kill().expect("SIGKILL");
        self.child.wait().await.expect("reaped");
    }

    /// SIGTERM, and the exit status of the graceful shutdown.
    async fn terminate(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().expect("running");
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("kill -TERM");
        assert!(status.success());
        tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("a graceful shutdown within 30 s")
            .expect("reaped")
    }
}

/// A data directory with a signing key (made by the binary's `keygen`) and
/// the shared operator token file.
fn prepare_data_dir(name: &str) -> (PathBuf, PathBuf) {
    let dir = temp_dir(name);
    let data = dir.join("data");
    let status = std::process::Command::new(BINARY)
        .args(["keygen", "--data"])
        .arg(&data)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("keygen runs");
    assert!(status.success(), "keygen succeeds");
    let token = dir.join("operator.token");
    central_client::key_file::write_secret_file(&token, OPERATOR_TOKEN.as_bytes())
        .expect("token file");
    (data, token)
}

fn big_policy() -> AdmissionBudgetV1 {
    let mut policy = policy(1);
    policy.opening = 10_000_000;
    policy.burst = 10_000_000;
    policy.refill = Refill {
        units: 0,
        interval_ms: 1000,
    };
    // Nothing expires while the test looks.
    policy.hold_ttl_ms = shard_format::limits::HOLD_TTL_MS_MAX;
    policy
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_during_a_burst_loses_no_acknowledged_reservation() {
    let (data, token) = prepare_data_dir("kill-9");
    let server = ServerProcess::spawn(&data, &token, None).await;
    server
        .operator()
        .publish_policy(&big_policy())
        .await
        .expect("publish");
    server
        .operator()
        .enroll_gateway(agent_signer(1).key_id())
        .await
        .expect("enrol");
    let acknowledged = Arc::new(Mutex::new(Vec::new()));
    let unknown = Arc::new(Mutex::new(Vec::new()));
    let lanes: Vec<_> = (0..32)
        .map(|lane| {
            let agent = server.agent(1);
            let acknowledged = acknowledged.clone();
            let unknown = unknown.clone();
            tokio::spawn(async move {
                // Bounded: a lane stops at its first failure or after 10 000.
                for index in 0..10_000 {
                    let request = reserve_request(&format!("rl-k9-{lane}-{index}"), 1);
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
        600,
        Duration::from_millis(50),
        || {
            let acknowledged = acknowledged.clone();
            async move { acknowledged.lock().expect("lock").len() >= 300 }
        },
    )
    .await;
    server.kill().await;
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

    let server = ServerProcess::spawn(&data, &token, None).await;
    let agent = server.agent(1);
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
    let operator = server.operator();
    let report = operator.audit().await.expect("audit");
    assert!(report.ok, "{:#?}", report.violations);
    let view = operator
        .accounts(&subject(), &route())
        .await
        .expect("accounts");
    assert_eq!(
        view.accounts[0].terms.reserved, report.reservations as u64,
        "every stored reservation holds one unit"
    );
    assert!(report.reservations >= acknowledged.len() + unknown.len());
    let status = server.terminate().await;
    assert!(status.success(), "a graceful shutdown exits 0: {status}");
    std::fs::remove_dir_all(data.parent().expect("parent")).ok();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_over_one_postgres_never_over_issue() {
    let Some(admin_url) = postgres_url() else {
        return;
    };
    let database = ThrowawayDatabase::create(&admin_url).await;
    let (data_a, token) = prepare_data_dir("replica-a");
    let (data_b, _) = prepare_data_dir("replica-b");
    let (a, b) = tokio::join!(
        ServerProcess::spawn(&data_a, &token, Some(&database.url)),
        ServerProcess::spawn(&data_b, &token, Some(&database.url)),
    );
    let mut policy = policy(1);
    policy.refill = Refill {
        units: 0,
        interval_ms: 1000,
    };
    policy.hold_ttl_ms = shard_format::limits::HOLD_TTL_MS_MAX;
    a.operator().publish_policy(&policy).await.expect("publish");
    a.operator()
        .enroll_gateway(agent_signer(1).key_id())
        .await
        .expect("enrol");
    let replicas = [a.agent(1), b.agent(1)];
    let tallies: Vec<_> = (0..24u64)
        .map(|lane| {
            let here = replicas[(lane % 2) as usize].clone();
            let there = replicas[((lane + 1) % 2) as usize].clone();
            tokio::spawn(async move {
                let mut tally = Tally::default();
                for index in 0..30u64 {
                    let units = 1 + (lane * 7 + index * 3) % 9;
                    let request = reserve_request(&format!("rl-pg-{lane}-{index}"), units);
                    // Every fifth: the same reserve to both replicas at once.
                    let reply = if index % 5 == 0 {
                        let (first, second) =
                            tokio::join!(here.reserve(&request), there.reserve(&request));
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
                            // One refused for capacity, then the other
                            // reserved after a release freed units: the
                            // ledger linearized them.
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
                    // Finish it on the other replica: release, settle, or keep.
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
                            here.settle(
                                &request.reservation,
                                &SettleBody {
                                    operation_id: operation,
                                    actual_units: actual,
                                },
                            )
                            .await
                            .expect("settle");
                            tally.spent += actual;
                        }
                        _ => tally.held += units,
                    }
                }
                tally
            })
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
        let operator = replica.operator();
        let report = operator.audit().await.expect("audit");
        assert!(report.ok, "{:#?}", report.violations);
        let view = operator
            .accounts(&subject(), &route())
            .await
            .expect("accounts");
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
    let (status_a, status_b) = tokio::join!(a.terminate(), b.terminate());
    assert!(status_a.success() && status_b.success());
    database.drop_database().await;
    for data in [data_a, data_b] {
        std::fs::remove_dir_all(data.parent().expect("parent")).ok();
    }
}

/// `reservoir keygen --out`, `reservoir central enroll --key-file` and
/// `reservoir audit` against a running service: the table, and exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_tools_enroll_and_audit() {
    let (data, token) = prepare_data_dir("tools");
    let server = ServerProcess::spawn(&data, &token, None).await;
    server
        .operator()
        .publish_policy(&policy(1))
        .await
        .expect("publish");
    let key = data.join("agent.key");
    let output = Command::new(BINARY)
        .args(["keygen", "--out"])
        .arg(&key)
        .output()
        .await
        .expect("keygen");
    assert!(output.status.success());
    let identity = String::from_utf8(output.stdout).expect("utf-8");
    let output = Command::new(BINARY)
        .args(["central", "enroll", "--central", &server.base_url])
        .arg("--operator-token-file")
        .arg(&token)
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
    let agent = CentralClient::new(client_config(&server.base_url))
        .expect("client")
        .with_identity(central_client::key_file::load(&key).expect("the agent key"));
    agent
        .reserve(&reserve_request("rl-tools", 10))
        .await
        .expect("the enrolled agent reserves");
    let output = Command::new(BINARY)
        .args(["audit", "--central", &server.base_url])
        .arg("--operator-token-file")
        .arg(&token)
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
    assert!(server.terminate().await.success());
    std::fs::remove_dir_all(data.parent().expect("parent")).ok();
}
