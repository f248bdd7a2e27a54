//! `reservoir bench --quick` runs its central, limits and agent groups and
//! reports their figures, with where the CPU went (a smoke check: nothing
//! here is judged by its speed).
//! The central group on redb only: with PostgreSQL it also runs pgbench
//! and takes about three times as long; the PostgreSQL store itself is
//! tested by `central/tests` and `central_processes.rs`.

use std::process::Stdio;
use std::time::{Duration, Instant};

const BINARY: &str = env!("CARGO_BIN_EXE_reservoir");

/// The value of the first line of `stdout` that starts with `prefix`
/// (`NAME=` included), if printed.
fn printed(stdout: &str, prefix: &str) -> Option<f64> {
    stdout
        .lines()
        .find_map(|line| line.strip_prefix(prefix)?.trim().parse().ok())
}

/// The value of `bench: CASE METRIC=VALUE` in `stdout`, if printed.
fn figure(stdout: &str, case: &str, metric: &str) -> Option<f64> {
    printed(stdout, &format!("bench: {case} {metric}="))
}

/// The value of `ratio: NAME=VALUE` in `stdout`, if printed.
fn ratio(stdout: &str, name: &str) -> Option<f64> {
    printed(stdout, &format!("ratio: {name}="))
}

/// A figure of `case` that the run must have printed.
fn get(stdout: &str, case: &str, metric: &str) -> f64 {
    figure(stdout, case, metric).unwrap_or_else(|| panic!("no {case} {metric}:\n{stdout}"))
}

/// Runs `reservoir bench --quick` on `groups` and returns its standard
/// output, once it has succeeded.
async fn quick_bench(groups: &[&str]) -> String {
    let started = Instant::now();
    let mut command = tokio::process::Command::new(BINARY);
    command.args(["bench", "--quick"]);
    for group in groups {
        command.args(["--only", group]);
    }
    command.stdin(Stdio::null()).kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .expect("the benchmark finishes within 120 s")
        .expect("the benchmark runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the benchmark failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    eprintln!("the benchmark of {groups:?} took {:?}", started.elapsed());
    stdout
}

/// The figures every load row has: some requests, none failed, and where
/// the CPU went over its window.
fn assert_load_row(stdout: &str, case: &str) {
    assert!(
        get(stdout, case, "requests_per_s") > 0.0,
        "{case}:\n{stdout}"
    );
    assert_eq!(get(stdout, case, "errors"), 0.0, "{case}:\n{stdout}");
    let p50 = get(stdout, case, "p50_ms");
    assert!(
        p50 > 0.0 && get(stdout, case, "p99_ms") >= p50,
        "{case}:\n{stdout}"
    );
    // The server's busiest thread, at most a core give or take a clock
    // tick, and the machine's idle share.
    let busiest = get(stdout, case, "busiest_thread_core_share");
    assert!(
        busiest > 0.0 && busiest < 1.1,
        "{case}: {busiest}\n{stdout}"
    );
    let idle = get(stdout, case, "machine_idle_share");
    assert!((0.0..=1.0).contains(&idle), "{case}: {idle}\n{stdout}");
    // And how long threads waited for a CPU, where the kernel keeps
    // scheduler statistics: the busiest one for at most the window, all
    // of them for at most the window times their number (a few dozen).
    if std::path::Path::new("/proc/self/schedstat").exists() {
        let waiting = get(stdout, case, "busiest_thread_cpu_wait_share");
        assert!(
            (0.0..=1.0).contains(&waiting),
            "{case}: {waiting}\n{stdout}"
        );
        let all = get(stdout, case, "threads_cpu_wait_s_per_s");
        assert!(all >= waiting && all < 64.0, "{case}: {all}\n{stdout}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_central_benchmark_runs_and_reports_its_group_commits() {
    let stdout = quick_bench(&["central"]).await;
    for shape in ["spread", "hot"] {
        for in_flight in [1, 128] {
            let case = format!("central_redb_{shape}_{in_flight}");
            assert_load_row(&stdout, &case);
            assert!(
                get(&stdout, &case, "operations_per_commit") >= 1.0,
                "{case}:\n{stdout}"
            );
            assert!(get(&stdout, &case, "commit_ms") > 0.0, "{case}:\n{stdout}");
        }
    }
    assert!(
        !stdout.contains("bench: central_pg_"),
        "no PostgreSQL cases without --postgres:\n{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limits_and_agent_benchmarks_run_and_report_their_ratios() {
    let stdout = quick_bench(&["limits", "agent"]).await;
    // The machine's limits: the baselines of the ratios.
    assert!(get(&stdout, "fdatasync", "syncs_per_s") > 0.0, "{stdout}");
    assert!(get(&stdout, "fdatasync", "p50_ms") > 0.0, "{stdout}");
    assert!(
        get(&stdout, "redb_commit", "commits_per_s") > 0.0,
        "{stdout}"
    );
    for in_flight in [1, 32, 128] {
        assert_load_row(&stdout, &format!("echo_{in_flight}"));
        for path in ["healthy", "emergency"] {
            let case = format!("agent_{path}_{in_flight}");
            assert_load_row(&stdout, &case);
            // Three requests a cycle: reserve, start, settle.
            let cycles = get(&stdout, &case, "cycles_per_s");
            let requests = get(&stdout, &case, "requests_per_s");
            assert!(
                cycles > 0.0 && cycles < requests,
                "{case}: {cycles} cycles, {requests} requests/s\n{stdout}"
            );
            assert!(
                get(&stdout, &case, "journal_records_per_commit") >= 1.0,
                "{case}:\n{stdout}"
            );
            for metric in ["journal_commit_ms", "agent_cpu_us_per_answer"] {
                assert!(get(&stdout, &case, metric) > 0.0, "{case}:\n{stdout}");
            }
            // Only the healthy path calls the central service.
            let central = figure(&stdout, &case, "central_calls_per_request");
            if path == "healthy" {
                assert!(
                    central.is_some_and(|calls| calls >= 1.0),
                    "{case}:\n{stdout}"
                );
            } else {
                assert_eq!(central, None, "{case}:\n{stdout}");
            }
        }
    }
    // The ratios these groups measure, each from this run's figures.
    let echo = |metric: &str| get(&stdout, "echo_128", metric);
    for (name, expected) in [
        (
            "agent_emergency_vs_echo",
            get(&stdout, "agent_emergency_128", "requests_per_s") / echo("requests_per_s"),
        ),
        (
            "agent_healthy_vs_echo",
            get(&stdout, "agent_healthy_128", "requests_per_s") / echo("requests_per_s"),
        ),
        (
            "agent_emergency_p99_vs_echo_p99",
            get(&stdout, "agent_emergency_128", "p99_ms") / echo("p99_ms"),
        ),
    ] {
        let printed = ratio(&stdout, name).unwrap_or_else(|| panic!("no {name}:\n{stdout}"));
        // Printed to three decimals, from figures printed to fewer.
        assert!(
            (printed - expected).abs() <= 0.002 + expected * 0.01,
            "{name}: printed {printed}, the figures give {expected}\n{stdout}"
        );
    }
    assert!(
        ratio(&stdout, "single_inflight_vs_fsync_rtt").is_some_and(|ratio| ratio > 0.0),
        "{stdout}"
    );
}
