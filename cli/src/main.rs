//! `reservoir`: the one binary.

use clap::Parser;

/// Reservoir: reserve-then-settle admission control for gateways.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    Ok(())
}
