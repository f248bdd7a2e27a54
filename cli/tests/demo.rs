//! `reservoir demo` walks the seed's story on real processes and exits 0
//! only if every step's check held.

use std::process::Stdio;
use std::time::{Duration, Instant};

const BINARY: &str = env!("CARGO_BIN_EXE_reservoir");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_walks_the_seeds_story_and_exits_0() {
    let started = Instant::now();
    let mut command = tokio::process::Command::new(BINARY);
    command.arg("demo").stdin(Stdio::null()).kill_on_drop(true);
    let output = tokio::time::timeout(Duration::from_secs(120), command.output())
        .await
        .expect("the demo finishes within 120 s")
        .expect("the demo runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the demo failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    assert!(
        stdout.contains("All 14 steps happened as the seed's story says"),
        "{stdout}"
    );
    for step in [
        "exactly one admitted (201); two refused with 429 and a Retry-After",
        "SETTLED with 400 refunded",
        "admission for the pair is 0 while debt is owed",
        "a restarted process never inherits an old shard",
        "every replay is a duplicate",
        "the second is refused on its slot leg and holds nothing on any leg",
        "`reservoir audit` is clean",
    ] {
        assert!(stdout.contains(&format!("ok: {step}")), "{step}:\n{stdout}");
    }
    // Children's logs go to files, not to the terminal.
    assert!(stderr.trim().is_empty(), "log noise on stderr:\n{stderr}");
    eprintln!("the demo took {:?}", started.elapsed());
}
