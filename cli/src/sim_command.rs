//! `reservoir sim`: the deterministic simulator and the release gate.

use std::time::Instant;

use anyhow::bail;
use clap::Args;
use reservoir_tests::sim::{self, SimOptions};

/// Run the deterministic simulator: the real ledger and agent cores through
/// faults, every invariant checked after every step. Prints a table and, as
/// its last line, `release-gate: … verdict=PASS|FAIL`; exits non-zero on FAIL.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// Number of runs (seeds) to simulate.
    #[arg(long, default_value_t = 10_000)]
    runs: u64,
    /// First seed; with `--runs 1` (the default when a seed is given) this
    /// replays that one run exactly.
    #[arg(long)]
    seed: Option<u64>,
    /// Worker threads to split the runs across (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Print a readable trace of every step (for replaying one seed).
    #[arg(long)]
    trace: bool,
    /// Each scenario must be hit at least this often for the gate to pass
    /// (default: 1,000 per million runs, at least 1).
    #[arg(long)]
    min_hits: Option<u64>,
    /// Largest allowed gap between a weight's share of contended starts and
    /// its fair share.
    #[arg(long, default_value_t = 0.05)]
    fairness_budget: f64,
}

pub fn run(args: SimArgs) -> anyhow::Result<()> {
    #[allow(
        clippy::needless_update,
        reason = "the options have more fields (the canaries) when a workspace-wide build turns on the simulator tests' feature"
    )]
    let options = SimOptions {
        trace: args.trace,
        ..SimOptions::default()
    };
    if let (Some(seed), true) = (args.seed, args.trace) {
        let outcome = sim::run_one(seed, options);
        for line in &outcome.trace {
            println!("{line}");
        }
        println!(
            "seed {seed}: {} steps, trace hash {:016x}",
            outcome.steps, outcome.trace_hash
        );
        for (class, detail) in &outcome.violations {
            println!("violation {}: {detail}", class.name());
        }
        if !outcome.violations.is_empty() {
            bail!("seed {seed} violated {} rule(s)", outcome.violations.len());
        }
        return Ok(());
    }
    let runs = if args.seed.is_some() && args.runs == 10_000 {
        1
    } else {
        args.runs
    };
    let first = args.seed.unwrap_or(0);
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let min_hits = args.min_hits.unwrap_or_else(|| (runs / 1000).max(1));
    let started = Instant::now();
    let report = sim::run_many(first, runs, threads, options);
    let seconds = started.elapsed().as_secs_f64();
    println!("{}", report.render(min_hits, args.fairness_budget, seconds));
    if !report.passes(min_hits, args.fairness_budget) {
        bail!("the release gate failed");
    }
    Ok(())
}
