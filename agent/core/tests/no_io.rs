//! The decision core's import rule, enforced: no module under
//! `agent/core/src/` may reach tokio, redb (or record-log), reqwest, axum,
//! hyper, the file system, the network, a clock or a random number
//! generator. The daemon shell and the simulator both drive this core, so
//! it must stay pure.

use std::fs;
use std::path::Path;

const FORBIDDEN: &[&str] = &[
    "tokio",
    "redb",
    "record_log",
    "reqwest",
    "axum",
    "hyper",
    "std::fs",
    "std::net",
    "std::time",
    "SystemTime",
    "Instant",
    "rand::",
    "thread_rng",
    "std::thread",
    "std::process",
];

fn check(dir: &Path, offences: &mut Vec<String>) {
    for entry in fs::read_dir(dir).expect("core directory is readable") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            check(&path, offences);
            continue;
        }
        if path.extension().is_none_or(|ext| ext != "rs") {
            continue;
        }
        let source = fs::read_to_string(&path).expect("source is readable");
        for (number, line) in source.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for word in FORBIDDEN {
                if code.contains(word) {
                    offences.push(format!("{}:{}: {word}: {line}", path.display(), number + 1));
                }
            }
        }
    }
}

#[test]
fn core_imports_no_io_clock_or_randomness() {
    let core = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut offences = Vec::new();
    check(&core, &mut offences);
    assert!(
        offences.is_empty(),
        "the agent core must stay pure:\n{}",
        offences.join("\n")
    );
}
