//! `reservoir demo`: the seed's story, walked by real processes.

use std::process::ExitCode;

use clap::Args;

/// Start a real central service and three real agents on temporary
/// directories and walk the seed's story.
#[derive(Debug, Args)]
pub struct DemoArgs {}

pub fn run(_args: DemoArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("`reservoir demo` is not built yet")
}
