//! The servers a benchmark measures, each a child process placed the same
//! way (the `reservoir` binary itself for the echo server, the central
//! service and the agent; `redis-server` for the peer), on loopback or a
//! Unix socket under one temporary directory, killed when dropped.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use central_client::{CentralClient, ClientConfig, RetryPolicy};
use shard_format::limits::UNITS_MAX;
use shard_format::{
    AdmissionBudgetV1, Digest, EmergencyMode, KeyId, Refill, Route, RouteMode, Subject,
};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

use super::load::{Endpoint, HttpConnection, RespConnection, RespValue};

/// How long a child may take to say it listens.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The route every benchmark account uses.
pub const ROUTE: &str = "bench.generate";

/// A scratch directory, removed when dropped.
#[derive(Debug)]
pub struct Scratch {
    pub path: PathBuf,
}

impl Scratch {
    pub fn new(run: &str, name: &str) -> anyhow::Result<Self> {
        let path = std::env::temp_dir().join(format!("reservoir-bench-{run}-{name}"));
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Self { path })
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A child process, killed when dropped; its stderr goes to `log`.
#[derive(Debug)]
pub struct Server {
    child: Child,
    pub log: PathBuf,
    /// What it printed after `listening on `.
    pub listening: String,
}

impl Server {
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Kills the process at once (a crash, not a shutdown) and reaps it.
    pub async fn kill(mut self) -> anyhow::Result<()> {
        self.child.kill().await.context("cannot kill a server")
    }

    /// The last lines of its log, for an error message.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log)
    }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Spawns `program args` and waits for `listening on …` on its stdout.
async fn spawn_listening(
    program: &Path,
    args: &[String],
    log: PathBuf,
    env: &[(&str, &str)],
) -> anyhow::Result<Server> {
    let log_file =
        std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
    let mut command = Command::new(program);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log_file))
        .kill_on_drop(true);
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot start {}", program.display()))?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let listening = tokio::time::timeout(START_TIMEOUT, async {
        while let Some(line) = lines.next_line().await? {
            if let Some(rest) = line.strip_prefix("listening on ") {
                return Ok::<_, std::io::Error>(Some(rest.trim().to_owned()));
            }
        }
        Ok(None)
    })
    .await;
    match listening {
        Ok(Ok(Some(listening))) => {
            // Keep draining stdout so the child never blocks on it.
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            Ok(Server {
                child,
                log,
                listening,
            })
        }
        _ => {
            let _ = child.kill().await;
            bail!(
                "{} did not start; its log ({}) ends:\n{}",
                program.display(),
                log.display(),
                log_tail(&log)
            )
        }
    }
}

fn reservoir_binary() -> anyhow::Result<PathBuf> {
    std::env::current_exe().context("cannot find the running reservoir binary")
}

/// The echo server (`reservoir bench --serve-echo PATH`).
pub async fn start_echo(dir: &Path) -> anyhow::Result<(Server, Endpoint)> {
    let socket = dir.join("echo.sock");
    let server = spawn_listening(
        &reservoir_binary()?,
        &[
            "bench".to_owned(),
            "--serve-echo".to_owned(),
            socket.display().to_string(),
        ],
        dir.join("echo.log"),
        &[],
    )
    .await?;
    Ok((server, Endpoint::Unix(socket)))
}

/// A central service as `reservoir central serve`, with its keys and an
/// operator client.
#[derive(Debug)]
pub struct Central {
    pub server: Server,
    pub address: SocketAddr,
    pub key_id: KeyId,
    pub operator: CentralClient,
    /// The arguments it was started with, for a restart.
    args: Vec<String>,
}

impl Central {
    pub fn base_url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Kills the service (a crash) and starts it again over the same data
    /// on the same address, logging to `log`; returns it and the time from
    /// the start of the new process until `GET /healthz` answers 200.
    pub async fn restart(self, log: PathBuf) -> anyhow::Result<(Self, Duration)> {
        let Self {
            server,
            address,
            key_id,
            operator,
            mut args,
        } = self;
        server.kill().await?;
        if let Some(at) = args.iter().position(|arg| arg == "--listen") {
            args[at + 1] = address.to_string();
        }
        let started = Instant::now();
        let server =
            spawn_listening(&reservoir_binary()?, &args, log, &[("RUST_LOG", "info")]).await?;
        let endpoint = Endpoint::Tcp(address);
        loop {
            if let Ok(mut connection) = HttpConnection::open(&endpoint).await
                && let Ok(answer) = connection.request("GET", "/healthz", "", b"").await
                && answer.status == 200
            {
                break;
            }
            if started.elapsed() > START_TIMEOUT {
                bail!(
                    "the restarted central service never answered /healthz; its log ends:\n{}",
                    server.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let elapsed = started.elapsed();
        Ok((
            Self {
                server,
                address,
                key_id,
                operator,
                args,
            },
            elapsed,
        ))
    }

    /// The group commit histograms of `GET /metrics`.
    pub async fn commits(&self) -> anyhow::Result<CommitCounters> {
        let text = self
            .operator
            .metrics()
            .await
            .context("the central's /metrics")?;
        let value = |name: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
                .and_then(|value| value.trim().parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        let step = |step: &str, of: &str| {
            value(&format!(
                "reservoir_batch_step_seconds_{of}{{step=\"{step}\"}}"
            ))
        };
        Ok(CommitCounters {
            commits: value("reservoir_commit_batch_size_count"),
            operations: value("reservoir_commit_batch_size_sum"),
            seconds: value("reservoir_commit_seconds_sum"),
            batches: step("apply", "count"),
            step_seconds: ["scope", "begin", "apply"].map(|name| step(name, "sum")),
        })
    }
}

/// The central service's durable commits at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct CommitCounters {
    pub commits: f64,
    /// Operations (transitions) committed.
    pub operations: f64,
    /// Time spent committing.
    pub seconds: f64,
    /// Batches applied (a commit may carry several, a redb commit behind
    /// the writer).
    pub batches: f64,
    /// Time spent in the steps of a batch before its commit: scope, begin
    /// (locks and loads), apply.
    pub step_seconds: [f64; 3],
}

impl CommitCounters {
    /// Operations per commit (the group commit's batch) and mean commit
    /// time (ms) since `earlier`.
    pub fn since(&self, earlier: &Self) -> (f64, f64) {
        let commits = (self.commits - earlier.commits).max(1.0);
        (
            (self.operations - earlier.operations) / commits,
            (self.seconds - earlier.seconds) / commits * 1000.0,
        )
    }

    /// Mean time (ms) per batch of each step before the commit (scope,
    /// begin, apply) since `earlier`.
    pub fn steps_since(&self, earlier: &Self) -> [f64; 3] {
        let batches = (self.batches - earlier.batches).max(1.0);
        [0, 1, 2]
            .map(|step| (self.step_seconds[step] - earlier.step_seconds[step]) / batches * 1000.0)
    }
}

pub fn client_config(base_url: &str) -> ClientConfig {
    let mut config = ClientConfig::new(base_url);
    config.call_timeout = Duration::from_secs(60);
    config.retry = RetryPolicy {
        attempts_max: 3,
        backoff_initial: Duration::from_millis(50),
        backoff_max: Duration::from_millis(500),
        deadline: Duration::from_secs(30),
    };
    config
}

/// Starts a central service on a loopback port with its data in `dir`
/// (redb) or in PostgreSQL at `postgres`.
pub async fn start_central(dir: &Path, postgres: Option<&str>) -> anyhow::Result<Central> {
    start_central_with(dir, postgres, &[]).await
}

/// [`start_central`] with `extra` arguments to `reservoir central serve`.
pub async fn start_central_with(
    dir: &Path,
    postgres: Option<&str>,
    extra: &[&str],
) -> anyhow::Result<Central> {
    let data = dir.join("central");
    std::fs::create_dir_all(&data)?;
    let key_id = central_client::key_file::generate(&data.join(central::KEY_FILE))?;
    let token = format!("bench-{}", super::run_id());
    let token_file = dir.join("operator.token");
    central_client::key_file::write_secret_file(&token_file, token.as_bytes())?;
    let mut args = vec![
        "central".to_owned(),
        "serve".to_owned(),
        "--data".to_owned(),
        data.display().to_string(),
        "--listen".to_owned(),
        "127.0.0.1:0".to_owned(),
        "--operator-token-file".to_owned(),
        token_file.display().to_string(),
    ];
    if let Some(url) = postgres {
        args.push("--postgres".to_owned());
        args.push(url.to_owned());
    }
    args.extend(extra.iter().map(|arg| (*arg).to_owned()));
    let server = spawn_listening(
        &reservoir_binary()?,
        &args,
        dir.join("central.log"),
        &service_environment(CENTRAL_UNIT)?,
    )
    .await?;
    let address: SocketAddr = server
        .listening
        .parse()
        .with_context(|| format!("the central printed {:?}", server.listening))?;
    let operator =
        CentralClient::new(client_config(&format!("http://{address}")))?.with_operator_token(token);
    Ok(Central {
        server,
        address,
        key_id,
        operator,
        args,
    })
}

/// A policy that never runs out during a run; `shard_units` > 0 enables
/// emergency shards of that size.
pub fn policy(subject: &str, shard_units: u64) -> anyhow::Result<AdmissionBudgetV1> {
    let capacity = UNITS_MAX / 2;
    Ok(AdmissionBudgetV1 {
        schema: Default::default(),
        subject: Subject::new(subject)?,
        route: Route::new(ROUTE)?,
        region: "bench".into(),
        capacity_unit: "tokens".into(),
        policy_generation: 1,
        opening: capacity,
        refill: Refill {
            units: 0,
            interval_ms: 1000,
        },
        burst: capacity,
        accounting_epoch_ms: 24 * 3_600_000,
        estimator_digest: Digest([0; 32]),
        reservation_units_max: 1,
        // Long enough that no hold expires within a run; with the hard
        // limit it fits the default retention window (24 h).
        hold_ttl_ms: 6 * 3_600_000,
        priority: 0,
        fairness_weight: 1,
        overdraft_units_max: 0,
        execution_hard_limit_ms: 3_600_000,
        emergency_mode: if shard_units > 0 {
            EmergencyMode::Enabled
        } else {
            EmergencyMode::Disabled
        },
        mode: RouteMode::Enforce,
        emergency_shard_units: shard_units,
        emergency_shard_validity_ms: 6 * 3_600_000,
    })
}

/// Publishes the policies of `subjects`, 32 at a time.
pub async fn publish(
    operator: &CentralClient,
    subjects: &[String],
    shard_units: u64,
) -> anyhow::Result<()> {
    for group in subjects.chunks(32) {
        let mut calls = tokio::task::JoinSet::new();
        for subject in group {
            let operator = operator.clone();
            let policy = policy(subject, shard_units)?;
            calls.spawn(async move {
                operator
                    .publish_policy(&policy)
                    .await
                    .with_context(|| format!("cannot publish the policy of {}", policy.subject))
            });
        }
        while let Some(result) = calls.join_next().await {
            result.context("a publish task panicked")??;
        }
    }
    Ok(())
}

/// An agent as `reservoir agent run`, on its Unix socket.
#[derive(Debug)]
pub struct Agent {
    pub server: Server,
    pub socket: PathBuf,
}

impl Agent {
    pub fn endpoint(&self) -> Endpoint {
        Endpoint::Unix(self.socket.clone())
    }

    /// `GET /v1/status` as JSON.
    pub async fn status(&self) -> anyhow::Result<serde_json::Value> {
        let mut connection = HttpConnection::open(&self.endpoint()).await?;
        let answer = connection.request("GET", "/v1/status", "", b"").await?;
        if !answer.is_success() {
            bail!("the agent's status answered {}", answer.status);
        }
        answer.json()
    }

    /// The journal counters of `GET /metrics`.
    pub async fn journal(&self) -> anyhow::Result<JournalCounters> {
        let mut connection = HttpConnection::open(&self.endpoint()).await?;
        let answer = connection.request("GET", "/metrics", "", b"").await?;
        let text = String::from_utf8_lossy(&answer.body);
        let counter = |name: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
                .and_then(|value| value.trim().parse::<u64>().ok())
                .unwrap_or(0)
        };
        let pid = self.server.pid().context("the agent has exited")?;
        // Bytes the process caused to be sent to the storage layer.
        let write_bytes = std::fs::read_to_string(format!("/proc/{pid}/io"))
            .ok()
            .and_then(|io| {
                io.lines()
                    .find_map(|line| line.strip_prefix("write_bytes:"))
                    .and_then(|value| value.trim().parse().ok())
            })
            .unwrap_or(0);
        // Every gateway answer, whatever its status.
        let responses = text
            .lines()
            .filter(|line| line.starts_with("reservoir_agent_gateway_responses_total{"))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
            .sum();
        Ok(JournalCounters {
            write_bytes,
            cpu_ticks: cpu_ticks(pid).unwrap_or(0),
            responses,
            commits: counter("reservoir_agent_journal_commits_total"),
            records: counter("reservoir_agent_journal_records_total"),
            commit_micros: counter("reservoir_agent_journal_commit_microseconds_total"),
            central_calls: counter("reservoir_agent_central_calls_total"),
            central_requests: counter("reservoir_agent_central_requests_total"),
            central_request_micros: counter("reservoir_agent_central_request_microseconds_total"),
        })
    }

    /// The resident set size, from `/proc`.
    pub fn rss_bytes(&self) -> anyhow::Result<u64> {
        rss_bytes(self.server.pid().context("the agent has exited")?)
    }
}

/// The resident set size of process `pid`, from `/proc/PID/status`.
pub fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("cannot read /proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|value| value.split_whitespace().next())
        .and_then(|value| value.parse().ok())
        .context("no VmRSS in /proc")?;
    Ok(kib * 1024)
}

/// The agent's counters at one moment: its journal's, its CPU time,
/// its gateway answers and its requests to the central service.
#[derive(Debug, Clone, Copy, Default)]
pub struct JournalCounters {
    pub write_bytes: u64,
    /// User + system CPU time of the agent process, in clock ticks.
    pub cpu_ticks: u64,
    /// Gateway answers given.
    pub responses: u64,
    pub commits: u64,
    pub records: u64,
    pub commit_micros: u64,
    /// Calls to the central service, the HTTP requests that carried them,
    /// and those requests' time from sending to the answer (µs).
    pub central_calls: u64,
    pub central_requests: u64,
    pub central_request_micros: u64,
}

impl JournalCounters {
    /// Records per commit, mean commit time (ms) and KiB written per
    /// commit since `earlier`.
    pub fn since(&self, earlier: &Self) -> (f64, f64, f64) {
        let commits = self.commits.saturating_sub(earlier.commits).max(1) as f64;
        let records = self.records.saturating_sub(earlier.records) as f64;
        let micros = self.commit_micros.saturating_sub(earlier.commit_micros) as f64;
        let bytes = self.write_bytes.saturating_sub(earlier.write_bytes) as f64;
        (
            records / commits,
            micros / commits / 1000.0,
            bytes / commits / 1024.0,
        )
    }

    /// Calls per request to the central service and the mean request
    /// time (ms) since `earlier`; `None` if no request was sent.
    pub fn central_since(&self, earlier: &Self) -> Option<(f64, f64)> {
        let requests = self
            .central_requests
            .saturating_sub(earlier.central_requests);
        if requests == 0 {
            return None;
        }
        let calls = self.central_calls.saturating_sub(earlier.central_calls) as f64;
        let micros = self
            .central_request_micros
            .saturating_sub(earlier.central_request_micros) as f64;
        let requests = requests as f64;
        Some((calls / requests, micros / requests / 1000.0))
    }

    /// The agent's CPU time per gateway answer since `earlier`, in µs.
    pub fn cpu_micros_per_response(&self, earlier: &Self) -> f64 {
        let ticks = self.cpu_ticks.saturating_sub(earlier.cpu_ticks) as f64;
        let responses = self.responses.saturating_sub(earlier.responses).max(1) as f64;
        ticks * 1e6 / CLOCK_TICKS_PER_SECOND / responses
    }
}

/// Where CPU time went, read at one moment: each thread of one process
/// (a server bound by one busy thread shows it at about a whole core) and
/// the whole machine (what no process used).
#[derive(Debug, Clone)]
pub struct CpuReading {
    at: Instant,
    /// Each thread's times, by thread ID.
    threads: BTreeMap<u32, ThreadTimes>,
    machine: Option<MachineTicks>,
}

/// One thread's times in a [`CpuReading`].
#[derive(Debug, Clone, PartialEq, Eq)]
struct ThreadTimes {
    name: String,
    /// User + system CPU time, in clock ticks.
    ticks: u64,
    /// Time runnable but waiting for a CPU, in ns (`schedstat`'s second
    /// field; absent where the kernel keeps no scheduler statistics).
    cpu_wait_ns: Option<u64>,
}

impl ThreadTimes {
    /// The ns this thread waited for a CPU since `before`, its times in an
    /// earlier reading: a thread new since then waited all its time in the
    /// window. `None` where either reading has no scheduler statistics.
    fn cpu_wait_since(&self, before: Option<&Self>) -> Option<u64> {
        let waited_before = match before {
            Some(before) => before.cpu_wait_ns?,
            None => 0,
        };
        Some(self.cpu_wait_ns?.saturating_sub(waited_before))
    }
}

/// The busiest thread between two [`CpuReading`]s.
#[derive(Debug, Clone, PartialEq)]
pub struct BusiestThread {
    pub name: String,
    /// Its CPU time as a share of one core over the window.
    pub core_share: f64,
    /// Its time runnable but waiting for a CPU, as a share of the window:
    /// what it lost to other threads (or to waking up on a CPU), not to
    /// lack of work.
    pub cpu_wait_share: Option<f64>,
}

/// The machine's CPU time in clock ticks, from `/proc/stat`'s `cpu` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MachineTicks {
    /// Every state but the guest ones (already counted in user and nice).
    total: u64,
    /// Idle and waiting for I/O.
    idle: u64,
}

impl CpuReading {
    /// Reads the threads of process `pid` (none if it is gone) and the
    /// machine.
    pub fn of_process(pid: Option<u32>) -> Self {
        let mut threads = BTreeMap::new();
        let tasks = pid.and_then(|pid| std::fs::read_dir(format!("/proc/{pid}/task")).ok());
        for task in tasks.into_iter().flatten().flatten() {
            let Some(tid) = task.file_name().to_str().and_then(|tid| tid.parse().ok()) else {
                continue;
            };
            // A thread may end between the listing and the read.
            if let Some((name, ticks)) = std::fs::read_to_string(task.path().join("stat"))
                .ok()
                .and_then(|stat| stat_name_and_ticks(&stat))
            {
                // The main thread bears the binary's name; the agent's
                // runtime (connections and core) runs on it.
                let name = if Some(tid) == pid {
                    "main".to_owned()
                } else {
                    name
                };
                let cpu_wait_ns = std::fs::read_to_string(task.path().join("schedstat"))
                    .ok()
                    .and_then(|schedstat| schedstat_cpu_wait_ns(&schedstat));
                threads.insert(
                    tid,
                    ThreadTimes {
                        name,
                        ticks,
                        cpu_wait_ns,
                    },
                );
            }
        }
        let machine = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|stat| machine_ticks(&stat));
        Self {
            at: Instant::now(),
            threads,
            machine,
        }
    }

    /// The thread that used the most CPU time since `earlier`.
    pub fn busiest_thread(&self, earlier: &Self) -> Option<BusiestThread> {
        let seconds = self.window_seconds(earlier)?;
        let (times, before, ticks) = self
            .threads
            .iter()
            .map(|(tid, times)| {
                let before = earlier.threads.get(tid);
                let ticks_before = before.map_or(0, |before| before.ticks);
                (times, before, times.ticks.saturating_sub(ticks_before))
            })
            .max_by_key(|(_, _, ticks)| *ticks)?;
        Some(BusiestThread {
            name: times.name.clone(),
            core_share: ticks as f64 / CLOCK_TICKS_PER_SECOND / seconds,
            cpu_wait_share: times
                .cpu_wait_since(before)
                .map(|ns| ns as f64 / 1e9 / seconds),
        })
    }

    /// How long the process's threads were runnable but waiting for a CPU
    /// since `earlier`, summed over its threads, in seconds per second of
    /// the window (above zero where they outnumber the free CPUs, or wait
    /// to be woken on one). Threads that ended in between are left out.
    pub fn threads_cpu_wait(&self, earlier: &Self) -> Option<f64> {
        let seconds = self.window_seconds(earlier)?;
        let mut waited_ns = 0;
        for (tid, times) in &self.threads {
            waited_ns += times.cpu_wait_since(earlier.threads.get(tid))?;
        }
        Some(waited_ns as f64 / 1e9 / seconds)
    }

    /// The time between `earlier` and this reading, if any.
    fn window_seconds(&self, earlier: &Self) -> Option<f64> {
        let seconds = self.at.saturating_duration_since(earlier.at).as_secs_f64();
        (seconds > 0.0).then_some(seconds)
    }

    /// The share of the machine's CPU time that was idle since `earlier`.
    pub fn machine_idle(&self, earlier: &Self) -> Option<f64> {
        let (now, before) = (self.machine?, earlier.machine?);
        let total = now
            .total
            .checked_sub(before.total)
            .filter(|total| *total > 0)?;
        let idle = now.idle.saturating_sub(before.idle);
        Some(idle as f64 / total as f64)
    }
}

/// A thread's name and its user + system CPU time in clock ticks, from its
/// `stat` file (fields 14 and 15, counted after the name, which may hold
/// spaces and parentheses).
fn stat_name_and_ticks(stat: &str) -> Option<(String, u64)> {
    let name = &stat[stat.find('(')? + 1..stat.rfind(')')?];
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace().skip(11);
    let user: u64 = fields.next()?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    Some((name.to_owned(), user + system))
}

/// A thread's time runnable but waiting for a CPU, in ns: the second of
/// `/proc/PID/task/TID/schedstat`'s three fields (time on a CPU, time
/// waiting on a run queue, timeslices).
fn schedstat_cpu_wait_ns(schedstat: &str) -> Option<u64> {
    schedstat.split_whitespace().nth(1)?.parse().ok()
}

/// The machine's CPU time from `/proc/stat`: the `cpu` line's user, nice,
/// system, idle, iowait, irq, softirq and steal.
fn machine_ticks(stat: &str) -> Option<MachineTicks> {
    let line = stat.lines().find(|line| line.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|field| field.parse().ok())
        .collect::<Option<_>>()?;
    if ticks.len() < 8 {
        return None;
    }
    Some(MachineTicks {
        total: ticks.iter().sum(),
        idle: ticks[3] + ticks[4],
    })
}

/// `USER_HZ`, the unit of `/proc/PID/stat`'s CPU times: 100 on every Linux
/// architecture this runs on.
const CLOCK_TICKS_PER_SECOND: f64 = 100.0;

/// User + system CPU time of process `pid` in clock ticks, from
/// `/proc/PID/stat`.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat_name_and_ticks(&stat).map(|(_, ticks)| ticks)
}

/// Starts an agent of `central` (enrolled first), its files in `dir`, and
/// waits until it has registered its boot.
pub async fn start_agent(dir: &Path, central: &Central) -> anyhow::Result<Agent> {
    // Reservations made from a shard are held an hour: the memory case
    // keeps 100,000 open for longer than the default 30 s.
    start_agent_with(dir, central, "", "local_hold_ms = 3600000\n").await
}

/// [`start_agent`] with `top` lines added to the top level of its
/// configuration file and `timeouts` to its `[timeouts]` table.
pub async fn start_agent_with(
    dir: &Path,
    central: &Central,
    top: &str,
    timeouts: &str,
) -> anyhow::Result<Agent> {
    let data = dir.join("agent");
    std::fs::create_dir_all(&data)?;
    let key_file = dir.join("agent.key");
    let key_id = central_client::key_file::generate(&key_file)?;
    central.operator.enroll_gateway(&key_id).await?;
    let socket = dir.join("agent.sock");
    let config = dir.join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "socket = {socket:?}\ndata = {data:?}\ncentral = {central:?}\nidentity_key = {key:?}\ntrusted_central_keys = [{trusted:?}]\n{top}\n[timeouts]\n{timeouts}",
            socket = socket.display().to_string(),
            data = data.display().to_string(),
            central = central.base_url(),
            key = key_file.display().to_string(),
            trusted = central.key_id.to_string(),
        ),
    )?;
    let server = spawn_listening(
        &reservoir_binary()?,
        &[
            "agent".to_owned(),
            "run".to_owned(),
            "--config".to_owned(),
            config.display().to_string(),
        ],
        dir.join("agent.log"),
        &service_environment(AGENT_UNIT)?,
    )
    .await?;
    let agent = Agent { server, socket };
    wait_until(
        Duration::from_secs(30),
        "the agent registers its boot",
        || async { Ok(!agent.status().await?["bootEpoch"].is_null()) },
    )
    .await?;
    Ok(agent)
}

/// The services' units as shipped: the bench's agents and central
/// services run with their environment, so that the figures are those of
/// the services as deployed. (The central's `RESERVOIR_CENTRAL_*` data
/// directory and address are overridden by the bench's flags.)
const AGENT_UNIT: &str = include_str!("../../../systemd/reservoir-agent.service");
const CENTRAL_UNIT: &str = include_str!("../../../systemd/reservoir-central.service");

/// The variables `unit` sets, and `RUST_LOG=info`.
fn service_environment(unit: &'static str) -> anyhow::Result<Vec<(&'static str, &'static str)>> {
    let mut environment = unit_environment(unit)?;
    environment.push(("RUST_LOG", "info"));
    Ok(environment)
}

/// The `NAME=value` pairs of a unit's `Environment=` lines. Only one
/// unquoted assignment a line is read; anything else is refused rather
/// than passed on half-read.
fn unit_environment(unit: &str) -> anyhow::Result<Vec<(&str, &str)>> {
    unit.lines()
        .filter_map(|line| line.strip_prefix("Environment="))
        .map(|assignment| match assignment.split_once('=') {
            Some((name, value))
                if !name.is_empty()
                    && !assignment.contains(['"', '\'', ' ', '\t', '\\', '%', '$']) =>
            {
                Ok((name, value))
            }
            _ => bail!(
                "a unit has Environment={assignment}; the bench reads only one unquoted NAME=value a line"
            ),
        })
        .collect()
}

/// Polls `condition` every 50 ms until it holds or `timeout` passes.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, condition: F) -> anyhow::Result<()>
where
    F: Fn() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let started = Instant::now();
    loop {
        if condition().await? {
            return Ok(());
        }
        if started.elapsed() > timeout {
            bail!("timed out waiting until {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A free loopback port (bound, then released for the child to take).
pub fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// A `redis-server` on loopback with its files in `dir`: no persistence
/// (as usually deployed) or `appendfsync always` (durable).
pub async fn start_redis(
    program: &Path,
    dir: &Path,
    durable: bool,
) -> anyhow::Result<(Child, Endpoint)> {
    let port = free_port()?;
    let name = if durable { "redis-fsync" } else { "redis" };
    let data = dir.join(name);
    std::fs::create_dir_all(&data)?;
    let mut command = Command::new(program);
    command
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--dir", &data.display().to_string()])
        .args(["--save", ""])
        .args(["--daemonize", "no", "--protected-mode", "no"])
        .args([
            "--logfile",
            &dir.join(format!("{name}.log")).display().to_string(),
        ]);
    if durable {
        command.args(["--appendonly", "yes", "--appendfsync", "always"]);
    } else {
        command.args(["--appendonly", "no"]);
    }
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| {
            format!(
                "cannot start {} (scripts/bench installs Debian's redis-server)",
                program.display()
            )
        })?;
    let endpoint = Endpoint::Tcp(SocketAddr::from(([127, 0, 0, 1], port)));
    let started = Instant::now();
    loop {
        if let Ok(mut connection) = RespConnection::open(&endpoint).await
            && connection.command(&[b"PING"]).await? == RespValue::Simple("PONG".to_owned())
        {
            return Ok((child, endpoint));
        }
        if started.elapsed() > START_TIMEOUT {
            let _ = child.kill().await;
            bail!("redis-server did not answer PING on port {port}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{
        CpuReading, JournalCounters, MachineTicks, ThreadTimes, cpu_ticks, machine_ticks,
        schedstat_cpu_wait_ns, stat_name_and_ticks, unit_environment,
    };

    #[test]
    fn the_bench_reads_a_units_environment_lines_and_refuses_what_it_cannot() {
        let unit = "[Service]\nEnvironment=MIMALLOC_PURGE_DELAY=10\nEnvironmentFile=-/etc/x.env\nEnvironment=A=b=c\n";
        assert_eq!(
            unit_environment(unit).unwrap(),
            vec![("MIMALLOC_PURGE_DELAY", "10"), ("A", "b=c")]
        );
        for refused in [
            "Environment=\"A=1 B=2\"",
            "Environment=A=1 B=2",
            "Environment=A=%h",
            "Environment==1",
            "Environment=A",
        ] {
            assert!(unit_environment(refused).is_err(), "{refused}");
        }
    }

    #[test]
    fn the_shipped_units_set_the_allocators_purge_delay() {
        for unit in [super::AGENT_UNIT, super::CENTRAL_UNIT] {
            let environment = unit_environment(unit).unwrap();
            assert!(
                environment.contains(&("MIMALLOC_PURGE_DELAY", "10")),
                "{environment:?}"
            );
        }
    }

    #[test]
    fn central_figures_are_per_request_and_absent_without_one() {
        let before = JournalCounters {
            central_calls: 10,
            central_requests: 2,
            central_request_micros: 3_000,
            ..JournalCounters::default()
        };
        assert_eq!(before.central_since(&before), None);
        // One request more is enough to report; the figures are the
        // differences: 21 calls in 1 request of 1.5 ms.
        let one_more = JournalCounters {
            central_calls: 31,
            central_requests: 3,
            central_request_micros: 4_500,
            ..before
        };
        assert_eq!(one_more.central_since(&before), Some((21.0, 1.5)));
        let later = JournalCounters {
            central_calls: 10 + 84,
            central_requests: 2 + 4,
            central_request_micros: 3_000 + 6_000,
            ..before
        };
        assert_eq!(later.central_since(&before), Some((21.0, 1.5)));
    }

    #[test]
    fn a_threads_name_and_cpu_time_are_read_around_parentheses_in_its_name() {
        // Fields 14 and 15 (user 1200, system 34), counted after the name.
        let stat = "4242 (journal (1) x) S 1 2 3 4 5 6 7 8 9 10 1200 34 0 0 20 0 1 0";
        assert_eq!(
            stat_name_and_ticks(stat),
            Some(("journal (1) x".to_owned(), 1234))
        );
        assert_eq!(stat_name_and_ticks("4242 (cut) S 1 2"), None);
    }

    #[test]
    fn the_machines_idle_time_counts_iowait_and_leaves_out_guests() {
        let stat = "cpu  100 5 50 800 40 3 2 0 70 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n";
        assert_eq!(
            machine_ticks(stat),
            Some(MachineTicks {
                total: 1000,
                idle: 840
            })
        );
        assert_eq!(machine_ticks("cpu  1 2 3\n"), None);
        assert_eq!(machine_ticks("intr 5\n"), None);
    }

    /// A reading `seconds` after `at` of threads (ID, name, clock ticks,
    /// ns waiting for a CPU) and a machine of two CPUs `idle` ticks idle.
    fn reading(
        at: Instant,
        seconds: u64,
        threads: &[(u32, &str, u64, Option<u64>)],
        idle: u64,
    ) -> CpuReading {
        CpuReading {
            at: at + Duration::from_secs(seconds),
            threads: threads
                .iter()
                .map(|&(tid, name, ticks, cpu_wait_ns)| {
                    let name = name.to_owned();
                    (
                        tid,
                        ThreadTimes {
                            name,
                            ticks,
                            cpu_wait_ns,
                        },
                    )
                })
                .collect(),
            machine: Some(MachineTicks {
                total: seconds * 200,
                idle,
            }),
        }
    }

    #[test]
    fn the_busiest_thread_is_the_one_that_used_most_since_the_earlier_reading() {
        let at = Instant::now();
        // Over 2 s: the daemon thread 190 ticks (95 % of a core) and
        // 0.2 s waiting for a CPU, a committer that had used more before
        // the first reading 60, and a thread new since then 100.
        let before = reading(
            at,
            0,
            &[(1, "daemon", 10, Some(50)), (2, "commit", 500, Some(7))],
            0,
        );
        let after = reading(
            at,
            2,
            &[
                (1, "daemon", 200, Some(200_000_050)),
                (2, "commit", 560, Some(7)),
                (3, "fold", 100, Some(0)),
            ],
            60,
        );
        let busiest = after.busiest_thread(&before).expect("a thread");
        assert_eq!(busiest.name, "daemon");
        assert!((busiest.core_share - 0.95).abs() < 1e-9, "{busiest:?}");
        assert_eq!(busiest.cpu_wait_share, Some(0.1));
        assert_eq!(after.machine_idle(&before), Some(0.15));
        // No time between the readings: no share to give.
        assert_eq!(before.busiest_thread(&before), None);
        assert_eq!(before.machine_idle(&before), None);
        assert_eq!(before.threads_cpu_wait(&before), None);
    }

    #[test]
    fn cpu_waits_add_up_over_threads_old_and_new() {
        let at = Instant::now();
        // Over 2 s: the daemon waited 0.4 s, a committer 0.6 s, and a
        // thread new since the first reading 1 s: 1 s per s in all. A
        // thread gone by the second reading counts for nothing.
        let before = reading(
            at,
            0,
            &[
                (1, "daemon", 10, Some(1_000)),
                (2, "commit", 5, Some(5_000)),
                (4, "gone", 5, Some(9_000_000_000)),
            ],
            0,
        );
        let after = reading(
            at,
            2,
            &[
                (1, "daemon", 150, Some(400_001_000)),
                (2, "commit", 50, Some(600_005_000)),
                (3, "new", 40, Some(1_000_000_000)),
            ],
            0,
        );
        let waited = after.threads_cpu_wait(&before).expect("a wait");
        assert!((waited - 1.0).abs() < 1e-9, "{waited}");
        let busiest = after.busiest_thread(&before).expect("a thread");
        assert_eq!(busiest.cpu_wait_share, Some(0.2));
        // A new thread waited all its time in the window.
        let new_busiest = reading(at, 2, &[(3, "new", 40, Some(500_000_000))], 0);
        let busiest = new_busiest.busiest_thread(&before).expect("a thread");
        assert_eq!(
            (busiest.name.as_str(), busiest.cpu_wait_share),
            ("new", Some(0.25))
        );
        // Without the kernel's scheduler statistics there is no wait to
        // report, for the busiest thread or in all, but its CPU share is
        // still read.
        let unknown = reading(at, 2, &[(1, "daemon", 150, None)], 0);
        assert_eq!(unknown.threads_cpu_wait(&before), None);
        let busiest = unknown.busiest_thread(&before).expect("a thread");
        assert_eq!(busiest.cpu_wait_share, None);
        assert!((busiest.core_share - 0.7).abs() < 1e-9, "{busiest:?}");
        // Nor when the earlier reading had none.
        let unknown_before = reading(at, 0, &[(1, "daemon", 10, None)], 0);
        assert_eq!(after.threads_cpu_wait(&unknown_before), None);
        let busiest = after.busiest_thread(&unknown_before).expect("a thread");
        assert_eq!(
            (busiest.name.as_str(), busiest.cpu_wait_share),
            ("daemon", None)
        );
    }

    #[test]
    fn a_threads_cpu_wait_is_schedstats_second_field() {
        assert_eq!(
            schedstat_cpu_wait_ns("13743046063 5867140580 157039\n"),
            Some(5_867_140_580)
        );
        assert_eq!(schedstat_cpu_wait_ns("13743046063\n"), None);
        assert_eq!(schedstat_cpu_wait_ns("1 x 3\n"), None);
    }

    #[test]
    fn a_process_reads_with_its_main_thread_named_main() {
        let pid = std::process::id();
        // A thread of this process's own, named (its name is set as it
        // starts), alive while it is read.
        let (started, has_started) = std::sync::mpsc::channel::<()>();
        let (reading_done, wait) = std::sync::mpsc::channel::<()>();
        let probe = std::thread::Builder::new()
            .name("cpu-probe".to_owned())
            .spawn(move || {
                let _ = started.send(());
                let _ = wait.recv();
            })
            .expect("a thread");
        has_started.recv().expect("the probe starts");
        let reading = CpuReading::of_process(Some(pid));
        drop(reading_done);
        probe.join().expect("the probe ends");
        assert_eq!(
            reading.threads.get(&pid).map(|times| times.name.as_str()),
            Some("main")
        );
        // The other threads keep their own names.
        assert!(
            reading
                .threads
                .iter()
                .any(|(tid, times)| *tid != pid && times.name == "cpu-probe"),
            "{:?}",
            reading.threads
        );
        assert!(CpuReading::of_process(None).threads.is_empty());
    }

    #[test]
    fn a_process_cpu_time_grows_as_it_works() {
        let pid = std::process::id();
        let before = cpu_ticks(pid).expect("this process's CPU time");
        // Work until two more clock ticks are counted (20 ms of CPU), or
        // give up after 5 s.
        let started = Instant::now();
        let mut now = before;
        while now < before + 2 && started.elapsed() < Duration::from_secs(5) {
            std::hint::black_box(started.elapsed());
            now = cpu_ticks(pid).expect("this process's CPU time");
        }
        assert!(now >= before + 2, "{before} → {now}");
        assert_eq!(cpu_ticks(u32::MAX), None);
    }
}
