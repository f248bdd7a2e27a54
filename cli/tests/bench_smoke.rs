//! `reservoir bench --quick --only central` runs and reports the central
//! service's figures, with where its CPU went (a smoke check: nothing
//! here is judged by its speed).
//! On redb only: with PostgreSQL the group also runs pgbench and takes
//! about three times as long; the PostgreSQL store itself is tested by
//! `central/tests` and `central_processes.rs`.

use std::process::Stdio;
use std::time::{Duration, Instant};

const BINARY: &str = env!("CARGO_BIN_EXE_reservoir");

/// The value of `bench: CASE METRIC=VALUE` in `stdout`, if printed.
fn figure(stdout: &str, case: &str, metric: &str) -> Option<f64> {
    let prefix = format!("bench: {case} {metric}=");
    stdout
        .lines()
        .find_map(|line| line.strip_prefix(&prefix)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_central_benchmark_runs_and_reports_its_group_commits() {
    let started = Instant::now();
    let mut command = tokio::process::Command::new(BINARY);
    command
        .args(["bench", "--quick", "--only", "central"])
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .expect("the benchmark finishes within 120 s")
        .expect("the benchmark runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the benchmark failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    for shape in ["spread", "hot"] {
        for in_flight in [1, 128] {
            let case = format!("central_redb_{shape}_{in_flight}");
            let get = |metric: &str| {
                figure(&stdout, &case, metric)
                    .unwrap_or_else(|| panic!("no {case} {metric}:\n{stdout}"))
            };
            assert!(get("requests_per_s") > 0.0, "{case}:\n{stdout}");
            assert_eq!(get("errors"), 0.0, "{case}:\n{stdout}");
            assert!(get("operations_per_commit") >= 1.0, "{case}:\n{stdout}");
            assert!(get("commit_ms") > 0.0, "{case}:\n{stdout}");
            // Over the window: the central's busiest thread, at most a
            // core give or take a clock tick, and the machine's idle share.
            let busiest = get("busiest_thread_core_share");
            assert!(
                busiest > 0.0 && busiest < 1.1,
                "{case}: {busiest}\n{stdout}"
            );
            let idle = get("machine_idle_share");
            assert!((0.0..=1.0).contains(&idle), "{case}: {idle}\n{stdout}");
            // And how long threads waited for a CPU, where the kernel
            // keeps scheduler statistics: the busiest one for at most the
            // window, all of them for at most the window times their
            // number (a few dozen).
            if std::path::Path::new("/proc/self/schedstat").exists() {
                let waiting = get("busiest_thread_cpu_wait_share");
                assert!(
                    (0.0..=1.0).contains(&waiting),
                    "{case}: {waiting}\n{stdout}"
                );
                let all = get("threads_cpu_wait_s_per_s");
                assert!(all >= waiting && all < 64.0, "{case}: {all}\n{stdout}");
            }
        }
    }
    assert!(
        !stdout.contains("bench: central_pg_"),
        "no PostgreSQL cases without --postgres:\n{stdout}"
    );
    eprintln!("the benchmark took {:?}", started.elapsed());
}
