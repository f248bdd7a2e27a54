//! `reservoir`: the one binary.

mod sim_command;

use clap::{Parser, Subcommand};

/// Reservoir: reserve-then-settle admission control for gateways.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the deterministic simulator (the release gate).
    Sim(sim_command::SimArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Sim(args) => sim_command::run(args),
    }
}
