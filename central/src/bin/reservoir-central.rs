//! `reservoir-central`: the central commands of `reservoir` (`central
//! serve`, `central enroll`, `keygen`, `audit`) as a binary of their own.
//! It compiles the `cli` crate's `central_command.rs` itself, so that this
//! crate's process tests (kill -9, two replicas over one database) run the
//! very code `reservoir central serve` runs.

#[path = "../../../cli/src/central_command.rs"]
mod central_command;

use std::process::ExitCode;

use clap::Parser;

/// Reservoir's central ledger service and its operator tools.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: central_command::Command,
}

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    central_command::run(Cli::parse().command).await
}
