//! `reservoir`: the one binary.

mod agent_command;
mod bench;
mod central_command;
mod demo_command;
mod operator_command;
mod sim_command;
mod status_command;
mod systemd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The simulator and the services allocate many small records; mimalloc
/// serves them markedly faster than the system allocator.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Reservoir: reserve-then-settle admission control for gateways.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    #[command(flatten)]
    Agent(agent_command::Command),
    #[command(flatten)]
    Central(central_command::Command),
    #[command(flatten)]
    Operator(operator_command::Command),
    /// Run the deterministic simulator (the release gate).
    Sim(sim_command::SimArgs),
    /// Ask a running agent over its socket how it is doing.
    Status(status_command::StatusArgs),
    /// Walk the seed's story with a real central service and three agents.
    Demo(demo_command::DemoArgs),
    /// Measure Reservoir against the machine's limits and a Redis limiter.
    Bench(bench::BenchArgs),
}

fn main() -> anyhow::Result<ExitCode> {
    match Cli::parse().command {
        Command::Agent(command) => {
            agent_runtime(command.worker_threads())?.block_on(agent_command::run(command))
        }
        Command::Central(command) => {
            tokio::runtime::Runtime::new()?.block_on(central_command::run(command))
        }
        Command::Operator(command) => {
            tokio::runtime::Runtime::new()?.block_on(operator_command::run(command))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Sim(args) => sim_command::run(args).map(|()| ExitCode::SUCCESS),
        Command::Status(args) => status_command::run(args),
        Command::Demo(args) => demo_command::run(args),
        Command::Bench(args) => bench::run(args),
    }
}

/// The agent's runtime: by default one thread. A sidecar shares its
/// machine with the gateway it serves, and its work is short tasks around
/// one daemon task (journal commits run on the blocking pool); on one
/// thread they hand each other work without cross-thread wake-ups or work
/// stealing, which measured 15–30 % more answers per second at 17–30 %
/// less CPU per answer than the multi-thread runtime on two cores
/// (docs/benchmarks-history.md). `--worker-threads` above 1 trades that for more cores.
pub(crate) fn agent_runtime(worker_threads: u16) -> std::io::Result<tokio::runtime::Runtime> {
    if worker_threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(usize::from(worker_threads))
            .enable_all()
            .build()
    }
}
