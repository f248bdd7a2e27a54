//! `reservoir status`: what a running agent says about itself, over its socket.

use std::process::ExitCode;

use clap::Args;

/// Ask a running agent over its Unix socket for its status.
#[derive(Debug, Args)]
pub struct StatusArgs {}

pub fn run(_args: StatusArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`reservoir status` is not built yet")
}
