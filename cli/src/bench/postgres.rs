//! PostgreSQL's own figures on the same machine: pgbench's default run
//! (TPC-B-like, one client) and a single-statement row-lock baseline (an
//! autocommit `UPDATE … WHERE id = 1` from many connections, each durable
//! before its answer) that the central service's hot account is held to.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, bail};
use tokio::process::Command;

use super::load::{Kind, Lane, LoadResult, Window, run_lanes};

/// A client of `url`.
async fn connect(url: &str) -> anyhow::Result<tokio_postgres::Client> {
    ::reservoir::postgres::connect(url)
        .await
        .with_context(|| format!("cannot connect to PostgreSQL at {url}"))
}

/// Creates `database` (dropping an old one of that name) and returns its URL.
pub async fn create_database(url: &str, database: &str) -> anyhow::Result<String> {
    ::reservoir::postgres::create_database(url, database)
        .await
        .with_context(|| format!("cannot create the database {database} at {url}"))
}

pub async fn drop_database(url: &str, database: &str) -> anyhow::Result<()> {
    ::reservoir::postgres::drop_database(url, database)
        .await
        .with_context(|| format!("cannot drop the database {database} at {url}"))
}

/// pgbench's default run (scale 1, one client, TPC-B-like) on `url`: a
/// second of warm-up, then the window (whole seconds). Transactions/s.
pub async fn pgbench(program: &Path, url: &str, window: Window) -> anyhow::Result<f64> {
    let run = |args: Vec<String>| async move {
        let output = Command::new(program)
            .args(&args)
            .stdin(Stdio::null())
            .output()
            .await
            .with_context(|| {
                format!(
                    "cannot run {} (scripts/bench installs Debian's postgresql)",
                    program.display()
                )
            })?;
        if !output.status.success() {
            bail!(
                "pgbench {args:?} failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    };
    run(vec!["-i".into(), "-q".into(), url.into()]).await?;
    let warmup = window.warmup.as_secs().max(1);
    run(vec!["-T".into(), warmup.to_string(), url.into()]).await?;
    let seconds = window.measure.as_secs().max(1);
    let output = run(vec!["-T".into(), seconds.to_string(), url.into()]).await?;
    output
        .lines()
        .find_map(|line| {
            line.strip_prefix("tps = ")
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|value| value.parse().ok())
        })
        .with_context(|| format!("no `tps = ` line in pgbench's output:\n{output}"))
}

/// `in_flight` connections each running `UPDATE bench_row_lock SET
/// available = available - 1 WHERE id = 1 AND available >= 1` in
/// autocommit: every statement takes the one row's lock and commits
/// durably. Statements/s.
pub async fn row_lock(url: &str, in_flight: usize, window: Window) -> anyhow::Result<LoadResult> {
    let setup = connect(url).await?;
    setup
        .batch_execute(
            "DROP TABLE IF EXISTS bench_row_lock;
             CREATE TABLE bench_row_lock (id integer PRIMARY KEY, available bigint NOT NULL);
             INSERT INTO bench_row_lock VALUES (1, 4000000000000000);",
        )
        .await?;
    let mut clients = Vec::with_capacity(in_flight);
    for _ in 0..in_flight {
        clients.push(Arc::new(connect(url).await?));
    }
    run_lanes(in_flight, window, |index, lane| {
        row_lock_lane(clients[index].clone(), lane)
    })
    .await
}

async fn row_lock_lane(
    client: Arc<tokio_postgres::Client>,
    mut lane: Lane,
) -> anyhow::Result<Lane> {
    let statement = client
        .prepare(
            "UPDATE bench_row_lock SET available = available - 1 WHERE id = 1 AND available >= 1",
        )
        .await?;
    while !lane.done() {
        let sent = Instant::now();
        let updated = client.execute(&statement, &[]).await?;
        lane.record(Kind::Reserve, sent);
        if updated == 1 {
            lane.cycle_done();
        } else {
            lane.error();
        }
    }
    Ok(lane)
}
