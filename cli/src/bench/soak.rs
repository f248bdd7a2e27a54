//! The soak case: a long run of reservations through an agent and a central
//! service (both on redb) started with a short retention window, the RSS
//! and data size of both processes sampled at 25, 50, 75 and 100 % of the
//! run, then a crash and restart of the central service over the same
//! data. With retention working, the growth between the 50 % and the 100 %
//! samples stays small: the state is bounded by the window, not by the
//! history.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use super::load::{Endpoint, HttpConnection};
use super::processes::{self, Agent, Central, ROUTE};
use super::report::{Report, Row};

/// The retention window both processes run with.
pub const RETENTION: &str = "60s";
/// The policy's hold and execution limit: with the 30 s margin they fit the
/// 60 s window (5 + 20 + 30 = 55 s). The agent runs with the same local
/// hold and deadlines, so its own floor is 55 s too.
const HOLD_TTL_MS: u64 = 5_000;
const EXECUTION_HARD_LIMIT_MS: u64 = 20_000;
/// The fractions of the run at which both processes are sampled, in %.
const SAMPLES_AT: [u64; 4] = [25, 50, 75, 100];
/// The subject every soak reservation uses.
const SUBJECT: &str = "tenant-soak";

/// RSS and data size of both processes after `done` reservations.
#[derive(Debug, Clone, Copy)]
struct Sample {
    done: u64,
    seconds: f64,
    central_rss: u64,
    central_data: u64,
    agent_rss: u64,
    agent_journal: u64,
}

impl Sample {
    fn central(&self) -> u64 {
        self.central_rss + self.central_data
    }

    fn agent(&self) -> u64 {
        self.agent_rss + self.agent_journal
    }
}

/// What the lanes share: the next reservation to make, how many are done,
/// and the pids and files to sample.
struct Shared {
    total: u64,
    next: AtomicU64,
    done: AtomicU64,
    errors: AtomicU64,
    started: Instant,
    central_pid: u32,
    agent_pid: u32,
    central_file: PathBuf,
    agent_file: PathBuf,
    samples: std::sync::Mutex<Vec<Sample>>,
}

impl Shared {
    /// The sample points, as counts of reservations done.
    fn thresholds(&self) -> impl Iterator<Item = u64> + '_ {
        SAMPLES_AT
            .iter()
            .map(|percent| (self.total * percent / 100).max(1))
    }

    fn take_sample(&self, done: u64) -> anyhow::Result<()> {
        // A store is its redb file and its write-ahead log files.
        let size = |path: &Path| record_log::store_bytes(path);
        let sample = Sample {
            done,
            seconds: self.started.elapsed().as_secs_f64(),
            central_rss: processes::rss_bytes(self.central_pid)?,
            central_data: size(&self.central_file),
            agent_rss: processes::rss_bytes(self.agent_pid)?,
            agent_journal: size(&self.agent_file),
        };
        self.samples
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .push(sample);
        Ok(())
    }
}

/// Starts the central service with `--retention`.
async fn start_central(dir: &Path) -> anyhow::Result<Central> {
    let dir = dir.join("central-run");
    std::fs::create_dir_all(&dir)?;
    processes::start_central_with(&dir, None, &["--retention", RETENTION]).await
}

/// Starts the agent with `retention` in its configuration, and a local hold
/// and deadlines that fit it.
async fn start_agent(dir: &Path, central: &Central) -> anyhow::Result<Agent> {
    let timeouts = format!(
        "local_hold_ms = {HOLD_TTL_MS}\ndefault_deadline_ms = {EXECUTION_HARD_LIMIT_MS}\ndeadline_ms_max = {EXECUTION_HARD_LIMIT_MS}\n"
    );
    let dir = dir.join("agent-run");
    std::fs::create_dir_all(&dir)?;
    processes::start_agent_with(
        &dir,
        central,
        &format!("retention = {RETENTION:?}\n"),
        &timeouts,
    )
    .await
}

/// Publishes the soak pair's policy: capacity no run exhausts, and a hold
/// and execution limit that fit the retention window.
async fn publish(central: &Central) -> anyhow::Result<()> {
    let mut policy = processes::policy(SUBJECT, 0)?;
    policy.hold_ttl_ms = HOLD_TTL_MS;
    policy.execution_hard_limit_ms = EXECUTION_HARD_LIMIT_MS;
    central
        .operator
        .publish_policy(&policy)
        .await
        .context("cannot publish the soak policy")?;
    Ok(())
}

/// The soak case: `total` reserve → start → settle cycles through the
/// agent's socket (healthy path) with `in_flight` lanes.
pub async fn run(
    run: &str,
    total: u64,
    in_flight: usize,
    report: &mut Report,
) -> anyhow::Result<()> {
    if total < 4 {
        bail!("--soak-reservations must be at least 4 (one per sample)");
    }
    let scratch = processes::Scratch::new(run, "soak")?;
    super::progress(&format!(
        "soak: {total} reserve → start → settle cycles through an agent and a central service (redb), retention {RETENTION}"
    ));
    let central = start_central(&scratch.path).await?;
    publish(&central).await?;
    let agent = start_agent(&scratch.path, &central).await?;
    let central_dir = scratch.path.join("central-run");
    let agent_dir = scratch.path.join("agent-run");
    let shared = Arc::new(Shared {
        total,
        next: AtomicU64::new(0),
        done: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        started: Instant::now(),
        central_pid: central.server.pid().context("the central service exited")?,
        agent_pid: agent.server.pid().context("the agent exited")?,
        central_file: central_dir.join("central").join(central::LEDGER_FILE),
        agent_file: agent_dir.join("agent").join("journal.redb"),
        samples: std::sync::Mutex::default(),
    });
    let mut lanes = tokio::task::JoinSet::new();
    for _ in 0..in_flight {
        lanes.spawn(lane(agent.endpoint(), shared.clone(), run.to_owned()));
    }
    let mut failure = None;
    while let Some(result) = lanes.join_next().await {
        let result = result
            .context("a soak lane panicked")
            .and_then(|result| result);
        if let Err(error) = result {
            failure.get_or_insert(error);
            // Stop the other lanes: no more reservations to take.
            shared.next.store(u64::MAX / 2, Ordering::Relaxed);
        }
    }
    if let Some(error) = failure {
        return Err(error.context(format!(
            "the soak run failed; the agent's log ends:\n{}\nthe central's log ends:\n{}",
            agent.server.log_tail(),
            central.server.log_tail()
        )));
    }
    let seconds = shared.started.elapsed().as_secs_f64();
    let mut samples = shared
        .samples
        .lock()
        .unwrap_or_else(|poison| poison.into_inner())
        .clone();
    samples.sort_by_key(|sample| sample.done);
    let (Some(half), Some(last)) = (
        samples
            .iter()
            .find(|sample| sample.done == total * 50 / 100),
        samples.last(),
    ) else {
        bail!("the soak run took {} samples, not 4", samples.len());
    };
    let between = last.done.saturating_sub(half.done).max(1) as f64;
    let growth = |after: u64, before: u64| ((after as f64 - before as f64) / between).round();
    let central_growth = growth(last.central(), half.central());
    let agent_growth = growth(last.agent(), half.agent());
    super::progress("soak: restarting the central service over the same data");
    let (central, restart) = central
        .restart(scratch.path.join("central-restarted.log"))
        .await?;
    let restart_seconds = restart.as_secs_f64();
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    let mut notes = format!(
        "{:.0} cycles/s; retention {RETENTION} on both; ",
        total as f64 / seconds
    );
    for sample in &samples {
        notes.push_str(&format!(
            "at {} ({:.0} s): central {:.0} MiB RSS + {:.0} MiB redb, agent {:.0} MiB RSS + {:.0} MiB journal; ",
            sample.done,
            sample.seconds,
            mib(sample.central_rss),
            mib(sample.central_data),
            mib(sample.agent_rss),
            mib(sample.agent_journal)
        ));
    }
    notes.push_str(&format!(
        "growth 50→100 %: central {central_growth:.0}, agent {agent_growth:.0} bytes per reservation; central restart {restart_seconds:.2} s"
    ));
    let errors = shared.errors.load(Ordering::Relaxed);
    if errors > 0 {
        notes.push_str(&format!("; {errors} refused reserves retried"));
    }
    let row = Row {
        case: "soak".to_owned(),
        what: format!(
            "{total} reservations (reserve → start → settle) through agent and central (redb), retention {RETENTION}"
        ),
        in_flight: Some(in_flight),
        rate: total as f64 / seconds,
        unit: "cycles/s",
        p50_ms: None,
        p99_ms: None,
        notes,
        metrics: vec![
            ("reservations", total as f64),
            ("cycles_per_s", total as f64 / seconds),
            ("central_growth_bytes_per_reservation", central_growth),
            ("agent_growth_bytes_per_reservation", agent_growth),
            (
                "central_restart_s",
                (restart_seconds * 1000.0).round() / 1000.0,
            ),
            ("central_rss_mib", mib(last.central_rss)),
            ("central_data_mib", mib(last.central_data)),
            ("agent_rss_mib", mib(last.agent_rss)),
            ("agent_journal_mib", mib(last.agent_journal)),
            ("refused_reserves", errors as f64),
        ],
    };
    super::push(report, row);
    agent.server.kill().await?;
    central.server.kill().await?;
    Ok(())
}

/// One lane: takes the next reservation number until `total` are taken,
/// runs its cycle, and samples both processes when its cycle is the one
/// that reaches a sample point.
async fn lane(endpoint: Endpoint, shared: Arc<Shared>, prefix: String) -> anyhow::Result<()> {
    let mut connection = HttpConnection::open(&endpoint).await?;
    let refusals_max = shared.total / 10 + 1_000;
    loop {
        let number = shared.next.fetch_add(1, Ordering::Relaxed);
        if number >= shared.total {
            return Ok(());
        }
        let key = format!("soak-{prefix}-{number}");
        loop {
            let body = format!(
                r#"{{"idempotencyKey":"{key}","subject":"{SUBJECT}","route":"{ROUTE}","units":1}}"#
            );
            let answer = connection
                .request("POST", "/v1/reservations", "", body.as_bytes())
                .await?;
            if answer.status == 201 {
                let record = answer.json()?;
                let reservation = record["reservation"]
                    .as_str()
                    .context("no reservation ID in the answer")?
                    .to_owned();
                cycle_rest(&mut connection, &reservation, &key).await?;
                break;
            }
            if shared.errors.fetch_add(1, Ordering::Relaxed) > refusals_max {
                bail!(
                    "the agent keeps refusing reserves: {} {}",
                    answer.status,
                    String::from_utf8_lossy(&answer.body)
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let done = shared.done.fetch_add(1, Ordering::Relaxed) + 1;
        if shared.thresholds().any(|at| at == done) {
            shared.take_sample(done)?;
        }
    }
}

/// Start and settle of one reservation.
async fn cycle_rest(
    connection: &mut HttpConnection,
    reservation: &str,
    key: &str,
) -> anyhow::Result<()> {
    let operation = format!(r#"{{"operationId":"op-{key}"}}"#);
    let answer = connection
        .request(
            "POST",
            &format!("/v1/reservations/{reservation}/start"),
            "",
            operation.as_bytes(),
        )
        .await?;
    if !answer.is_success() {
        bail!(
            "the agent refused a start: {} {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
    }
    let settle = format!(r#"{{"operationId":"op-{key}","actualUnits":1}}"#);
    let answer = connection
        .request(
            "POST",
            &format!("/v1/reservations/{reservation}/settle"),
            "",
            settle.as_bytes(),
        )
        .await?;
    if !answer.is_success() {
        bail!(
            "the agent refused a settle: {} {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
    }
    Ok(())
}
