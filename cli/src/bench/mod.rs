//! `reservoir bench`: Reservoir and its baselines measured in the same run,
//! reported as ratios, because absolute times drift by up to 50 % on shared
//! machines.
//!
//! Every server runs as its own child process (`reservoir` itself for the
//! echo server, the central service and the agent; `redis-server`; an
//! existing PostgreSQL), on loopback or a Unix socket under a temporary
//! directory, and one load generator — this process, [`load`] — drives
//! every HTTP case with keep-alive connections, one request outstanding per
//! connection. Each case runs a warm-up, then a bounded window; only what
//! completes inside the window counts. Throughput counts requests (reserve,
//! start and settle are one request each, every one durable before its
//! answer).
//!
//! Output: a table, then `bench: <case> <metric>=<value>` for every figure
//! and `ratio: <name>=<value>` for every ratio; `--write FILE` rewrites the
//! generated section of that file (BENCHMARKS.md). `./scripts/bench` installs
//! what is missing, starts a throwaway PostgreSQL and runs it.

mod echo;
mod limits;
mod load;
mod postgres;
mod processes;
mod redis;
mod report;
mod reservoir;
mod soak;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::{Args, ValueEnum};

use load::Window;
use processes::Scratch;
use report::{GoalKind, Ratio, Report, Row, Target};
use reservoir::{Accounts, AgentPath};

/// Measure Reservoir and its baselines in one run and print ratios.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Short warm-ups and windows: a smoke check, not figures to keep.
    #[arg(long)]
    quick: bool,
    /// Rewrite the generated section of this file (BENCHMARKS.md) with the
    /// run's tables; the rest of the file is left alone.
    #[arg(long, value_name = "PATH")]
    write: Option<PathBuf>,
    /// A PostgreSQL server (`postgres://user@host:port/database`) for the
    /// central service's PostgreSQL cases, pgbench and the row-lock
    /// baseline; each run creates its own databases there and drops them.
    /// Without it those cases are skipped.
    #[arg(long, value_name = "URL")]
    postgres: Option<String>,
    /// Reservations of the soak case (default 1,000,000; 20,000 with
    /// `--quick`).
    #[arg(long, value_name = "N")]
    soak_reservations: Option<u64>,
    /// Run only this group of cases (repeatable).
    #[arg(long, value_enum, value_name = "CASE")]
    only: Vec<Case>,
    /// The redis-server binary (Debian's `redis-server` package).
    #[arg(long, value_name = "PATH", default_value = "redis-server")]
    redis_server: PathBuf,
    /// The pgbench binary (Debian's `postgresql` package).
    #[arg(long, value_name = "PATH", default_value = "pgbench")]
    pgbench: PathBuf,
    /// Serve the echo baseline on this Unix socket (the benchmark starts
    /// this itself).
    #[arg(long, value_name = "PATH", hide = true)]
    serve_echo: Option<PathBuf>,
}

/// Groups of cases, for `--only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Case {
    /// The machine's limits: HTTP echo, redb commits, fdatasync.
    Limits,
    /// The agent: healthy and emergency paths.
    Agent,
    /// The central service on redb and PostgreSQL, pgbench, the row-lock
    /// baseline.
    Central,
    /// The Redis + Lua token bucket, without and with fsync.
    Redis,
    /// The simulator's speed.
    Sim,
    /// Agent RSS with 100,000 open reservations.
    Memory,
    /// A million reservations through agent and central with a 60 s
    /// retention window: growth of RSS and data, central restart time.
    Soak,
}

/// Warm-up and window of every load case.
fn window(quick: bool) -> Window {
    if quick {
        Window {
            warmup: Duration::from_millis(300),
            measure: Duration::from_secs(1),
        }
    } else {
        Window {
            warmup: Duration::from_secs(1),
            measure: Duration::from_secs(5),
        }
    }
}

/// Concurrency levels of the load cases.
const IN_FLIGHT: [usize; 3] = [1, 32, 128];
/// Lanes of the soak case: enough to reach the agent's throughput.
const SOAK_IN_FLIGHT: usize = 128;
/// Accounts a central "spread" case uses.
const SPREAD_ACCOUNTS: usize = 1_000;
/// Units of one emergency shard: more than any run spends.
const SHARD_UNITS: u64 = 10_000_000;

const METHOD: &str = "\
Method: each server is its own child process on this machine (the `reservoir` \
binary for the echo server, the central service and the agent; `redis-server`; \
PostgreSQL); one load generator (`reservoir bench` itself) drives every case \
with keep-alive connections, one request outstanding per connection (\"in \
flight\"); on a Unix socket it asks to be woken when there is something to \
read, not for write space, as a gateway's asyncio client does. Each case has a warm-up, then a measurement window; only what \
completes inside it counts. Over the window the notes also give the \
busiest thread of the server measured, as a share of one core (at about a \
whole core, that thread is the limit), how long that thread was runnable \
but waiting for a CPU, the same summed over all the server's threads (in \
seconds per second: time lost to other threads on the CPUs, or to being \
woken up; from the kernel's `schedstat`), and the machine's idle time. \
Agents and central services run with the \
environment of their shipped units (`systemd/*.service`: \
`MIMALLOC_PURGE_DELAY=10`; the central's JSON logs). \
Throughput counts requests: reserve, start and \
settle are one request each, every one durable before its answer (agent: \
redb journal; central: redb or PostgreSQL commit; Redis with fsync: \
`appendfsync always`). Agent and central cases run reserve → start → \
settle cycles of 1 unit; the table's cycles are admissions. Latency columns \
are per request; \"reserve p50\" is the reserve alone. Ratios divide figures \
of this same run, so machine drift cancels out. The soak case runs a fixed \
number of cycles through agent and central with a 60 s retention window and \
samples RSS + data file size of both at 25, 50, 75 and 100 %; its growth \
figures are (100 % − 50 %) / reservations in between. The sim case runs \
100,000 simulator runs on every CPU and extrapolates the million-run gate's \
time from them (`sim_million_s`); the memory case opens 100,000 \
reservations from a shard and reads the agent's RSS \
(`agent_memory_100k_mib`). Those two are figures with a target, not \
ratios.";

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    if let Some(socket) = &args.serve_echo {
        echo::serve(socket)?;
        return Ok(ExitCode::SUCCESS);
    }
    let started = Instant::now();
    let runtime = tokio::runtime::Runtime::new()?;
    let mut report = Report::default();
    let header = header(&args);
    runtime.block_on(run_cases(&args, &mut report))?;
    drop(runtime);
    ratios(&mut report);
    let elapsed = started.elapsed();
    report.header = header;
    report.header.push(format!(
        "Run: {} in {} min {} s{}.",
        if args.quick {
            "`--quick` (short windows: a smoke check)"
        } else {
            "full"
        },
        elapsed.as_secs() / 60,
        elapsed.as_secs() % 60,
        if args.only.is_empty() {
            String::new()
        } else {
            format!(", only {:?}", args.only)
        }
    ));
    println!();
    println!("{}", report.tables());
    for line in report.missed() {
        println!("missed: {line}");
    }
    print!("{}", report.machine_lines());
    if let Some(path) = &args.write {
        report::write_section(path, &report.section(METHOD))?;
        eprintln!("wrote the generated section of {}", path.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// A short ID for this run's files, tokens and databases.
pub(crate) fn run_id() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    format!("{:x}{:x}", nanos % 0xffff_ffff, std::process::id())
}

fn wanted(args: &BenchArgs, case: Case) -> bool {
    args.only.is_empty() || args.only.contains(&case)
}

fn progress(message: &str) {
    eprintln!("== {message}");
}

fn print_row(row: &Row) {
    eprintln!(
        "   {:<28} {:>12.1} {:<14} p50 {:>8} ms  p99 {:>8} ms  {}",
        row.case,
        row.rate,
        row.unit,
        row.p50_ms
            .map_or_else(|| "–".to_owned(), |ms| format!("{ms:.2}")),
        row.p99_ms
            .map_or_else(|| "–".to_owned(), |ms| format!("{ms:.2}")),
        row.notes
    );
}

/// Adds the agent's group commit figures over the case to its row.
async fn note_journal(
    row: &mut Row,
    agent: &processes::Agent,
    before: &processes::JournalCounters,
) -> anyhow::Result<processes::JournalCounters> {
    let now = agent.journal().await?;
    let (records_per_commit, commit_ms, commit_kib) = now.since(before);
    let cpu_micros = now.cpu_micros_per_response(before);
    row.notes.push_str(&format!(
        "; journal: {records_per_commit:.1} records, {commit_ms:.2} ms, {commit_kib:.0} KiB written per commit; agent CPU {cpu_micros:.0} µs per answer"
    ));
    row.metrics
        .push(("journal_records_per_commit", records_per_commit));
    row.metrics.push(("journal_commit_ms", commit_ms));
    row.metrics.push(("journal_kib_per_commit", commit_kib));
    row.metrics.push(("agent_cpu_us_per_answer", cpu_micros));
    Ok(now)
}

/// Runs `load`, a load whose measurement window starts `window.warmup`
/// from now, and reads the CPU of process `pid` when the window opens and
/// when it closes (the load's lanes count from the same moment, give or
/// take the spawning of their tasks).
async fn with_cpu<T>(
    pid: Option<u32>,
    window: Window,
    load: impl Future<Output = T>,
) -> (T, [processes::CpuReading; 2]) {
    let readings = async {
        tokio::time::sleep(window.warmup).await;
        let from = processes::CpuReading::of_process(pid);
        tokio::time::sleep(window.measure).await;
        [from, processes::CpuReading::of_process(pid)]
    };
    tokio::join!(load, readings)
}

/// Adds where the CPU went over the measurement window to its row: the
/// busiest thread of the service measured, `who` (one at about a whole
/// core is the limit), how long it and all the service's threads waited
/// for a CPU (time lost to the other threads on the machine's CPUs, or to
/// being woken), and the machine's idle time.
fn note_cpu(row: &mut Row, who: &str, [before, now]: &[processes::CpuReading; 2]) {
    let mut notes = Vec::new();
    if let Some(busiest) = now.busiest_thread(before) {
        let mut note = format!(
            "busiest {who} thread {thread} at {percent:.0} % of a core",
            thread = busiest.name,
            percent = busiest.core_share * 100.0
        );
        row.metrics
            .push(("busiest_thread_core_share", busiest.core_share));
        if let Some(waiting) = busiest.cpu_wait_share {
            note.push_str(&format!(
                ", waiting for one {percent:.0} % of the time",
                percent = waiting * 100.0
            ));
            row.metrics.push(("busiest_thread_cpu_wait_share", waiting));
        }
        notes.push(note);
    }
    if let Some(waiting) = now.threads_cpu_wait(before) {
        notes.push(format!(
            "{who} threads waiting for a CPU {waiting:.2} s per s"
        ));
        row.metrics.push(("threads_cpu_wait_s_per_s", waiting));
    }
    if let Some(idle) = now.machine_idle(before) {
        notes.push(format!(
            "machine {percent:.0} % idle",
            percent = idle * 100.0
        ));
        row.metrics.push(("machine_idle_share", idle));
    }
    for note in notes {
        if !row.notes.is_empty() {
            row.notes.push_str("; ");
        }
        row.notes.push_str(&note);
    }
}

/// Adds the agent's requests to the central service between two readings
/// to its row: the healthy path's round trips, one stage of its answers'
/// latency.
fn note_central(
    row: &mut Row,
    now: &processes::JournalCounters,
    before: &processes::JournalCounters,
) {
    if let Some((calls_per_request, request_ms)) = now.central_since(before) {
        row.notes.push_str(&format!(
            "; central: {calls_per_request:.1} calls, {request_ms:.2} ms per request"
        ));
        row.metrics
            .push(("central_calls_per_request", calls_per_request));
        row.metrics.push(("central_request_ms", request_ms));
    }
}

/// Adds the central service's group commit figures over the case to its row.
async fn note_commits(
    row: &mut Row,
    central: &processes::Central,
    before: &processes::CommitCounters,
) -> anyhow::Result<()> {
    let now = central.commits().await?;
    let (operations_per_commit, commit_ms) = now.since(before);
    let [scope_ms, begin_ms, apply_ms] = now.steps_since(before);
    row.notes.push_str(&format!(
        "; commits: {operations_per_commit:.1} operations, {commit_ms:.2} ms per commit; \
         before it, per batch: scope {scope_ms:.2}, begin {begin_ms:.2}, apply {apply_ms:.2} ms"
    ));
    row.metrics
        .push(("operations_per_commit", operations_per_commit));
    row.metrics.push(("commit_ms", commit_ms));
    row.metrics.push(("batch_scope_ms", scope_ms));
    row.metrics.push(("batch_begin_ms", begin_ms));
    row.metrics.push(("batch_apply_ms", apply_ms));
    Ok(())
}

fn push(report: &mut Report, row: Row) {
    print_row(&row);
    report.rows.push(row);
}

async fn run_cases(args: &BenchArgs, report: &mut Report) -> anyhow::Result<()> {
    let run = run_id();
    let window = window(args.quick);
    if wanted(args, Case::Limits) {
        limits_cases(&run, window, report).await?;
    }
    if wanted(args, Case::Agent) {
        agent_cases(&run, window, report).await?;
    }
    if wanted(args, Case::Central) {
        central_cases(args, &run, window, report).await?;
    }
    if wanted(args, Case::Redis) {
        redis_cases(args, &run, window, report).await?;
    }
    if wanted(args, Case::Sim) {
        sim_case(args.quick, window, report)?;
    }
    if wanted(args, Case::Memory) {
        let count = if args.quick { 10_000 } else { 100_000 };
        memory_case(&run, count, report).await?;
    }
    if wanted(args, Case::Soak) {
        let count = args
            .soak_reservations
            .unwrap_or(if args.quick { 20_000 } else { 1_000_000 });
        soak::run(&run, count, SOAK_IN_FLIGHT, report).await?;
    }
    Ok(())
}

async fn limits_cases(run: &str, window: Window, report: &mut Report) -> anyhow::Result<()> {
    let scratch = Scratch::new(run, "limits")?;
    progress("limits: fdatasync, redb commits, HTTP echo over a Unix socket");
    let dir = scratch.path.clone();
    let sync = tokio::task::spawn_blocking(move || limits::fdatasync_rate(&dir, window)).await??;
    push(
        report,
        Row {
            case: "fdatasync".to_owned(),
            what: "fdatasync of a 4 KiB overwrite, temp dir".to_owned(),
            in_flight: Some(1),
            rate: sync.per_second,
            unit: "syncs/s",
            p50_ms: Some(sync.p50_ms),
            p99_ms: Some(sync.p99_ms),
            notes: String::new(),
            metrics: vec![
                ("syncs_per_s", sync.per_second),
                ("p50_ms", sync.p50_ms),
                ("p99_ms", sync.p99_ms),
            ],
        },
    );
    let dir = scratch.path.clone();
    let commit =
        tokio::task::spawn_blocking(move || limits::redb_commit_rate(&dir, window)).await??;
    push(
        report,
        Row {
            case: "redb_commit".to_owned(),
            what: "redb one-row commit, immediate durability".to_owned(),
            in_flight: Some(1),
            rate: commit.per_second,
            unit: "commits/s",
            p50_ms: Some(commit.p50_ms),
            p99_ms: Some(commit.p99_ms),
            notes: String::new(),
            metrics: vec![
                ("commits_per_s", commit.per_second),
                ("p50_ms", commit.p50_ms),
                ("p99_ms", commit.p99_ms),
            ],
        },
    );
    let (server, endpoint) = processes::start_echo(&scratch.path).await?;
    for in_flight in IN_FLIGHT {
        let (result, cpu) = with_cpu(
            server.pid(),
            window,
            load::run_lanes(in_flight, window, |_, lane| {
                echo_lane(endpoint.clone(), lane)
            }),
        )
        .await;
        let result =
            result.with_context(|| format!("echo failed; its log ends:\n{}", server.log_tail()))?;
        let mut row = Row::load(
            format!("echo_{in_flight}"),
            "HTTP/1.1 echo, axum on a Unix socket",
            &result,
            None,
        );
        // The baseline's own figures, to compare with the agent's.
        note_cpu(&mut row, "echo", &cpu);
        push(report, row);
    }
    server.kill().await?;
    Ok(())
}

/// The body the echo server sends back: the size of an agent reserve.
const ECHO_BODY: &[u8] = br#"{"idempotencyKey":"0123456789abcdef-0-0","subject":"tenant-bench","route":"bench.generate","units":1}"#;

async fn echo_lane(endpoint: load::Endpoint, mut lane: load::Lane) -> anyhow::Result<load::Lane> {
    let mut connection = load::HttpConnection::open(&endpoint).await?;
    while !lane.done() {
        let sent = Instant::now();
        let answer = connection.request("POST", "/echo", "", ECHO_BODY).await?;
        lane.record(load::Kind::Other, sent);
        if answer.status == 200 && answer.body == ECHO_BODY {
            lane.cycle_done();
        } else {
            lane.error();
        }
    }
    Ok(lane)
}

async fn agent_cases(run: &str, window: Window, report: &mut Report) -> anyhow::Result<()> {
    let scratch = Scratch::new(run, "agent")?;
    progress("agent: healthy path (agent → central on redb), then emergency path (shards)");
    let central = processes::start_central(&scratch.path, None).await?;
    let agent = processes::start_agent(&scratch.path, &central).await?;
    let subject = "tenant-bench";
    reservoir::prepare_agent(&central, &agent, subject, SHARD_UNITS).await?;
    for in_flight in IN_FLIGHT {
        let journal = agent.journal().await?;
        let (result, cpu) = with_cpu(
            agent.server.pid(),
            window,
            reservoir::agent_cycles(
                &agent,
                subject,
                AgentPath::Healthy,
                in_flight,
                window,
                &format!("{run}-h{in_flight}"),
            ),
        )
        .await;
        let result = result
            .with_context(|| format!("the agent's log ends:\n{}", agent.server.log_tail()))?;
        let mut row = Row::load(
            format!("agent_healthy_{in_flight}"),
            "agent healthy path: socket → agent → central (redb), both durable",
            &result,
            Some("cycles"),
        );
        let now = note_journal(&mut row, &agent, &journal).await?;
        note_central(&mut row, &now, &journal);
        note_cpu(&mut row, "agent", &cpu);
        push(report, row);
    }
    // The central service crashes: the agent detects the partition and
    // admits from its shard.
    central.server.kill().await?;
    reservoir::partition(&agent, subject).await?;
    for in_flight in IN_FLIGHT {
        let journal = agent.journal().await?;
        let (result, cpu) = with_cpu(
            agent.server.pid(),
            window,
            reservoir::agent_cycles(
                &agent,
                subject,
                AgentPath::Emergency,
                in_flight,
                window,
                &format!("{run}-e{in_flight}"),
            ),
        )
        .await;
        let result = result
            .with_context(|| format!("the agent's log ends:\n{}", agent.server.log_tail()))?;
        let mut row = Row::load(
            format!("agent_emergency_{in_flight}"),
            "agent emergency path: shard admission, redb journal",
            &result,
            Some("cycles"),
        );
        note_journal(&mut row, &agent, &journal).await?;
        note_cpu(&mut row, "agent", &cpu);
        push(report, row);
    }
    agent.server.kill().await?;
    Ok(())
}

async fn central_cases(
    args: &BenchArgs,
    run: &str,
    window: Window,
    report: &mut Report,
) -> anyhow::Result<()> {
    let spread = Accounts {
        subjects: std::sync::Arc::new(
            (0..SPREAD_ACCOUNTS)
                .map(|index| format!("account-{index:04}"))
                .collect(),
        ),
    };
    let hot = Accounts {
        subjects: std::sync::Arc::new(vec!["hot-account".to_owned()]),
    };
    let mut stores = vec![("redb", None)];
    let central_database = format!("reservoir_bench_{run}");
    if let Some(url) = &args.postgres {
        let database_url = postgres::create_database(url, &central_database).await?;
        stores.push(("pg", Some(database_url)));
    } else {
        progress("central: no --postgres URL, so no PostgreSQL cases");
    }
    for (store, url) in &stores {
        let scratch = Scratch::new(run, &format!("central-{store}"))?;
        progress(&format!(
            "central on {store}: publishing {SPREAD_ACCOUNTS} + 1 policies"
        ));
        let central = processes::start_central(&scratch.path, url.as_deref()).await?;
        let mut subjects = spread.subjects.as_ref().clone();
        subjects.extend(hot.subjects.iter().cloned());
        processes::publish(&central.operator, &subjects, 0).await?;
        let signer = reservoir::direct_identity(&central, &scratch.path).await?;
        for in_flight in [1, 128] {
            for (shape, accounts) in [("spread", &spread), ("hot", &hot)] {
                let commits = central.commits().await?;
                let (result, cpu) = with_cpu(
                    central.server.pid(),
                    window,
                    reservoir::central_cycles(
                        &central,
                        signer.clone(),
                        accounts,
                        in_flight,
                        window,
                        &format!("{run}-{store}-{shape}-{in_flight}"),
                    ),
                )
                .await;
                let result = result.with_context(|| {
                    format!("the central's log ends:\n{}", central.server.log_tail())
                })?;
                let what = format!(
                    "central on {} over loopback HTTP, signed calls, {}",
                    if *store == "pg" { "PostgreSQL" } else { "redb" },
                    if shape == "spread" {
                        "1,000 accounts"
                    } else {
                        "one hot account"
                    }
                );
                let mut row = Row::load(
                    format!("central_{store}_{shape}_{in_flight}"),
                    &what,
                    &result,
                    Some("reservations"),
                );
                note_commits(&mut row, &central, &commits).await?;
                note_cpu(&mut row, "central", &cpu);
                push(report, row);
            }
        }
        if *store == "redb" {
            // The same cycles as central_redb_spread_128, 16 reservations
            // to a batch request.
            let in_flight = 128;
            let commits = central.commits().await?;
            let (result, cpu) = with_cpu(
                central.server.pid(),
                window,
                reservoir::central_batch_cycles(
                    &central,
                    signer.clone(),
                    &spread,
                    in_flight,
                    window,
                    &format!("{run}-{store}-batch-{in_flight}"),
                ),
            )
            .await;
            let result = result.with_context(|| {
                format!("the central's log ends:\n{}", central.server.log_tail())
            })?;
            let mut row = Row::load(
                format!("central_{store}_batch_{in_flight}"),
                &format!(
                    "central on redb over loopback HTTP, 1,000 accounts, POST /v1/batch of {} signed once",
                    reservoir::BATCH_CYCLES
                ),
                &result,
                Some("reservations"),
            );
            row.metrics.push((
                "operations_per_s",
                result.requests_per_second() * reservoir::BATCH_CYCLES as f64,
            ));
            note_commits(&mut row, &central, &commits).await?;
            note_cpu(&mut row, "central", &cpu);
            push(report, row);
        }
        central.server.kill().await?;
    }
    if let Some(url) = &args.postgres {
        postgres::drop_database(url, &central_database).await?;
        let pgbench_database = format!("reservoir_bench_pgbench_{run}");
        let database_url = postgres::create_database(url, &pgbench_database).await?;
        progress("pgbench: default run (scale 1, one client)");
        let tps = postgres::pgbench(&args.pgbench, &database_url, window).await?;
        push(
            report,
            Row {
                case: "pgbench".to_owned(),
                what: "pgbench default (TPC-B-like, scale 1, 1 client)".to_owned(),
                in_flight: Some(1),
                rate: tps,
                unit: "tps",
                p50_ms: None,
                p99_ms: None,
                notes: String::new(),
                metrics: vec![("tps", tps)],
            },
        );
        progress("PostgreSQL row-lock baseline: one row, 128 connections");
        let result = postgres::row_lock(&database_url, 128, window).await?;
        push(
            report,
            Row::load(
                "pg_row_lock_128".to_owned(),
                "PostgreSQL single-statement row-lock UPDATE on one row, autocommit",
                &result,
                None,
            ),
        );
        postgres::drop_database(url, &pgbench_database).await?;
    }
    Ok(())
}

async fn redis_cases(
    args: &BenchArgs,
    run: &str,
    window: Window,
    report: &mut Report,
) -> anyhow::Result<()> {
    let scratch = Scratch::new(run, "redis")?;
    for durable in [false, true] {
        progress(&format!(
            "redis + Lua token bucket, {}",
            if durable {
                "appendfsync always"
            } else {
                "no persistence"
            }
        ));
        let (mut child, endpoint) =
            processes::start_redis(&args.redis_server, &scratch.path, durable).await?;
        let sha = redis::load_script(&endpoint).await?;
        for in_flight in IN_FLIGHT {
            let result =
                redis::token_bucket(&endpoint, &sha, SPREAD_ACCOUNTS, in_flight, window).await?;
            let (case, what) = if durable {
                (
                    format!("redis_lua_fsync_{in_flight}"),
                    "Redis + Lua token bucket (EVALSHA), appendfsync always",
                )
            } else {
                (
                    format!("redis_lua_{in_flight}"),
                    "Redis + Lua token bucket (EVALSHA), no persistence",
                )
            };
            push(report, Row::load(case, what, &result, None));
        }
        child.kill().await?;
    }
    Ok(())
}

/// Runs of the simulator case in a full run: the issue's floor for
/// extrapolating the million-run gate's time.
const SIM_RUNS: u64 = 100_000;

/// The simulator's speed, and the million-run gate's time extrapolated from
/// it: `runs` whole runs from seed 0 (a full run: [`SIM_RUNS`]), or with
/// `--quick` as many batches as fit in the window.
fn sim_case(quick: bool, window: Window, report: &mut Report) -> anyhow::Result<()> {
    use reservoir_tests::sim::{self, GateReport, SimOptions};
    progress("simulator: runs (interleavings) per second");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Warm-up, then the measured runs.
    let _ = sim::run_many(10_000_000, 20, threads, SimOptions::default());
    let started = Instant::now();
    let total = if quick {
        let mut total = GateReport::default();
        let mut seed = 0;
        while started.elapsed() < window.measure {
            let batch = sim::run_many(seed, 50, threads, SimOptions::default());
            total.runs += batch.runs;
            total.steps += batch.steps;
            total.violations =
                std::array::from_fn(|index| total.violations[index] + batch.violations[index]);
            seed += 50;
        }
        total
    } else {
        sim::run_many(0, SIM_RUNS, threads, SimOptions::default())
    };
    let seconds = started.elapsed().as_secs_f64();
    let violations: u64 = total.violations.iter().sum();
    let runs_per_second = total.runs as f64 / seconds;
    let million_seconds = 1_000_000.0 / runs_per_second;
    push(
        report,
        Row {
            case: "sim".to_owned(),
            what: format!("`reservoir sim`, {threads} threads"),
            in_flight: None,
            rate: runs_per_second,
            unit: "runs/s",
            p50_ms: None,
            p99_ms: None,
            notes: format!(
                "{} runs in {seconds:.0} s, {:.0} steps/s, {violations} violations; the million extrapolated: {million_seconds:.0} s",
                total.runs,
                total.steps as f64 / seconds
            ),
            metrics: vec![
                ("runs", total.runs as f64),
                ("runs_per_s", runs_per_second),
                ("steps_per_s", total.steps as f64 / seconds),
                ("violations", violations as f64),
                ("million_s", million_seconds),
            ],
        },
    );
    Ok(())
}

async fn memory_case(run: &str, count: usize, report: &mut Report) -> anyhow::Result<()> {
    let scratch = Scratch::new(run, "memory")?;
    progress(&format!(
        "memory: agent RSS with {count} open reservations (emergency path)"
    ));
    let central = processes::start_central(&scratch.path, None).await?;
    let agent = processes::start_agent(&scratch.path, &central).await?;
    let subject = "tenant-memory";
    reservoir::prepare_agent(&central, &agent, subject, SHARD_UNITS).await?;
    central.server.kill().await?;
    reservoir::partition(&agent, subject).await?;
    let before = agent.rss_bytes()?;
    let started = Instant::now();
    reservoir::agent_open_reservations(&agent, subject, count, 128, &format!("{run}-m"))
        .await
        .with_context(|| format!("the agent's log ends:\n{}", agent.server.log_tail()))?;
    let seconds = started.elapsed().as_secs_f64();
    let status = agent.status().await?;
    let after = agent.rss_bytes()?;
    let per_reservation = after.saturating_sub(before) as f64 / count as f64;
    let mib = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    // The journal's size on disk (its redb file and log files): redb caches
    // the pages it wrote, so part of the RSS is this file.
    let journal = record_log::store_bytes(&scratch.path.join("agent").join("journal.redb"));
    push(
        report,
        Row {
            case: "agent_memory".to_owned(),
            what: format!("agent RSS with {count} open reservations"),
            in_flight: Some(128),
            rate: mib(after),
            unit: "MiB",
            p50_ms: None,
            p99_ms: None,
            notes: format!(
                "{:.1} MiB before; {per_reservation:.0} bytes per open reservation; journal file {:.0} MiB; {} in flight per status; reserved at {:.0}/s",
                mib(before),
                mib(journal),
                status["reservationsInFlight"],
                count as f64 / seconds
            ),
            metrics: vec![
                ("rss_mib", mib(after)),
                ("rss_before_mib", mib(before)),
                ("bytes_per_reservation", per_reservation),
                ("journal_file_mib", mib(journal)),
                ("open_reservations", count as f64),
            ],
        },
    );
    agent.server.kill().await?;
    Ok(())
}

/// A figure of a row, if that case ran.
fn figure(report: &Report, case: &str, metric: &str) -> Option<f64> {
    report
        .row(case)?
        .metrics
        .iter()
        .find(|(name, _)| *name == metric)
        .map(|(_, value)| *value)
        .filter(|value| *value > 0.0)
}

fn ratios(report: &mut Report) {
    let requests = |case: &str| figure(report, case, "requests_per_s");
    let single_inflight = || {
        let reserve = figure(report, "agent_emergency_1", "reserve_p50_ms")?;
        let sync = figure(report, "fdatasync", "p50_ms")?;
        let round_trip = figure(report, "echo_1", "p50_ms")?;
        Some(reserve / (sync + 2.0 * round_trip))
    };
    let p99 = |case: &str| figure(report, case, "p99_ms");
    // The agent's RSS with 100,000 open reservations (the memory case's
    // own count in a full run; scaled from its per-reservation growth with
    // `--quick`).
    let memory_100k = || {
        let before = figure(report, "agent_memory", "rss_before_mib")?;
        let per_reservation = figure(report, "agent_memory", "bytes_per_reservation")?;
        Some(before + per_reservation * 100_000.0 / (1024.0 * 1024.0))
    };
    let wanted: [(&'static str, Option<f64>, Target, &str); 11] = [
        (
            "agent_emergency_vs_echo",
            requests("agent_emergency_128")
                .zip(requests("echo_128"))
                .map(|(a, b)| a / b),
            Target::AtLeast(0.6),
            "agent_emergency_128 / echo_128, requests/s",
        ),
        (
            "agent_emergency_p99_vs_echo_p99",
            p99("agent_emergency_128")
                .zip(p99("echo_128"))
                .map(|(a, b)| a / b),
            Target::AtMost(3.0),
            "agent_emergency_128 p99 / echo_128 p99, ms",
        ),
        (
            "agent_healthy_vs_echo",
            requests("agent_healthy_128")
                .zip(requests("echo_128"))
                .map(|(a, b)| a / b),
            Target::AtLeast(0.3),
            "agent_healthy_128 / echo_128, requests/s",
        ),
        (
            "central_redb_vs_echo",
            requests("central_redb_spread_128")
                .zip(requests("echo_128"))
                .map(|(a, b)| a / b),
            Target::AtLeast(0.35),
            "central_redb_spread_128 / echo_128, requests/s",
        ),
        (
            "central_pg_vs_pgbench",
            requests("central_pg_spread_128")
                .zip(figure(report, "pgbench", "tps"))
                .map(|(a, b)| a / b),
            Target::AtLeast(3.0),
            "central_pg_spread_128 requests/s / pgbench tps",
        ),
        (
            "central_pg_hot_vs_row_lock",
            requests("central_pg_hot_128")
                .zip(requests("pg_row_lock_128"))
                .map(|(a, b)| a / b),
            Target::AtLeast(2.0),
            "central_pg_hot_128 requests/s / pg_row_lock_128 statements/s",
        ),
        (
            "agent_vs_redis_lua",
            requests("agent_emergency_128")
                .zip(requests("redis_lua_128"))
                .map(|(a, b)| a / b),
            Target::AtLeast(1.0),
            "agent_emergency_128 / redis_lua_128, requests/s",
        ),
        (
            "agent_vs_redis_lua_fsync",
            requests("agent_emergency_128")
                .zip(requests("redis_lua_fsync_128"))
                .map(|(a, b)| a / b),
            Target::AtLeast(1.5),
            "agent_emergency_128 / redis_lua_fsync_128, requests/s",
        ),
        (
            "single_inflight_vs_fsync_rtt",
            single_inflight(),
            Target::AtMost(2.0),
            "agent_emergency_1 reserve p50 / (fdatasync p50 + 2 × echo_1 p50)",
        ),
        (
            "agent_memory_100k_mib",
            memory_100k(),
            Target::AtMost(64.0),
            "agent RSS in MiB with 100,000 open reservations (agent_memory)",
        ),
        (
            "sim_million_s",
            figure(report, "sim", "million_s"),
            Target::AtMost(120.0),
            "seconds for `reservoir sim --runs 1000000`, extrapolated from the sim case's runs",
        ),
    ];
    for (name, value, target, definition) in wanted {
        // A figure with a target prints as `bench: <name>=…`, a ratio of
        // two figures as `ratio: <name>=…`.
        let kind = if matches!(name, "agent_memory_100k_mib" | "sim_million_s") {
            GoalKind::Figure
        } else {
            GoalKind::Ratio
        };
        match value {
            Some(value) => report.ratios.push(Ratio {
                name,
                kind,
                value,
                target,
                definition: definition.to_owned(),
            }),
            None => report.skipped.push(name.to_owned()),
        }
    }
}

/// Date, commit and machine, for the report's head.
fn header(args: &BenchArgs) -> Vec<String> {
    let format = time::macros::format_description!("[year]-[month]-[day] [hour]:[minute] UTC");
    let date = time::OffsetDateTime::now_utc()
        .format(&format)
        .unwrap_or_else(|_| "unknown date".to_owned());
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
        .unwrap_or_else(|| "unknown".to_owned());
    let mut lines = vec![
        format!("Date: {date}; commit {commit}."),
        format!("Machine: {}.", machine()),
    ];
    if args.postgres.is_some() {
        lines.push(format!(
            "PostgreSQL: {}; Redis: {}.",
            version(&args.pgbench),
            version(&args.redis_server)
        ));
    } else {
        lines.push(format!("Redis: {}.", version(&args.redis_server)));
    }
    lines
}

fn version(program: &Path) -> String {
    std::process::Command::new(program)
        .arg("--version")
        .output()
        .ok()
        .filter(|output| output.status.success())
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
        .unwrap_or_else(|| format!("{} not found", program.display()))
}

/// CPU model and count, memory, kernel, load at the start.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name"))
        .and_then(|rest| rest.split_once(':'))
        .map_or("unknown CPU", |(_, model)| model.trim())
        .to_owned();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory_gib = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / (1024.0 * 1024.0));
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_owned();
    let load = std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ");
    format!(
        "{model}, {cpus} CPUs, {memory_gib:.1} GiB, Linux {kernel}; load average at the start {load} (shared machine)"
    )
}

#[cfg(test)]
mod tests {
    use super::{Row, note_cpu, processes::CpuReading};

    fn row(notes: &str) -> Row {
        Row {
            case: "case".to_owned(),
            what: String::new(),
            in_flight: None,
            rate: 0.0,
            unit: "requests/s",
            p50_ms: None,
            p99_ms: None,
            notes: notes.to_owned(),
            metrics: Vec::new(),
        }
    }

    #[test]
    fn cpu_notes_follow_a_rows_notes_or_start_them() {
        let pid = Some(std::process::id());
        let before = CpuReading::of_process(pid);
        // Some CPU time between the readings, so that the machine has
        // clock ticks to share out (100 a second per CPU).
        let started = std::time::Instant::now();
        while started.elapsed() < std::time::Duration::from_millis(50) {
            std::hint::black_box(started.elapsed());
        }
        let readings = [before, CpuReading::of_process(pid)];
        let mut empty = row("");
        note_cpu(&mut empty, "test", &readings);
        assert!(
            empty.notes.starts_with("busiest test thread "),
            "{}",
            empty.notes
        );
        assert!(empty.notes.contains("; machine "), "{}", empty.notes);
        let mut noted = row("10 cycles/s");
        note_cpu(&mut noted, "test", &readings);
        assert!(
            noted.notes.starts_with("10 cycles/s; busiest test thread "),
            "{}",
            noted.notes
        );
        let names: Vec<_> = noted.metrics.iter().map(|(name, _)| *name).collect();
        assert_eq!(
            names,
            [
                "busiest_thread_core_share",
                "busiest_thread_cpu_wait_share",
                "threads_cpu_wait_s_per_s",
                "machine_idle_share"
            ]
        );
    }
}
