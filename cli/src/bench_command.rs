//! `reservoir bench`: same-run ratios against the machine's limits.

use std::process::ExitCode;

use clap::Args;

/// Measure Reservoir and its baselines in one run and print ratios.
#[derive(Debug, Args)]
pub struct BenchArgs {}

pub fn run(_args: BenchArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`reservoir bench` is not built yet")
}
