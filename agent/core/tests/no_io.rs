//! The decision core's import rule, enforced twice. Its `Cargo.toml` may
//! name only the pure crates below as normal dependencies, so tokio, redb
//! (or record-log), reqwest, axum, hyper, central-client and getrandom
//! cannot even be linked; and no source file under `src/` may reach the
//! standard library's file system, network, clocks, threads or processes.
//! The daemon shell and the simulator both drive this core, so it must stay
//! pure.

use std::fs;
use std::path::{Path, PathBuf};

/// The only crates the core may depend on at run time.
const ALLOWED_DEPENDENCIES: &[&str] = &[
    "foldhash",
    "hashbrown",
    "ledger",
    "nonmax",
    "shard-format",
    "serde",
    "serde_json",
    "thin-vec",
    "thiserror",
];

/// Pure crates the core may name only as optional dependencies, behind a
/// feature the daemon turns on: schemars derives the JSON Schemas of the
/// socket API's bodies for the agent's OpenAPI document.
const OPTIONAL_DEPENDENCIES: &[&str] = &["schemars"];

/// What no line of the core's source may mention (outside comments).
const FORBIDDEN_IN_SOURCE: &[&str] = &[
    "tokio",
    "redb",
    "record_log",
    "reqwest",
    "axum",
    "hyper",
    "central_client",
    "getrandom",
    "std::fs",
    "std::net",
    "std::io",
    "std::env",
    "std::time",
    "SystemTime",
    "Instant",
    "rand::",
    "thread_rng",
    "std::thread",
    "std::process",
];

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every normal dependency a manifest names outside the allowlist: plain
/// `[dependencies]` and per-target ones, by key and by `package` rename.
fn disallowed_dependencies(manifest: &str) -> Vec<String> {
    let manifest: toml::Table = manifest.parse().expect("Cargo.toml is valid TOML");
    let mut tables = Vec::new();
    if let Some(dependencies) = manifest.get("dependencies") {
        tables.push(("dependencies".to_owned(), dependencies));
    }
    if let Some(targets) = manifest.get("target").and_then(toml::Value::as_table) {
        for (target, sections) in targets {
            if let Some(dependencies) = sections.get("dependencies") {
                tables.push((format!("target.{target}.dependencies"), dependencies));
            }
        }
    }
    let mut offences = Vec::new();
    for (section, dependencies) in tables {
        let dependencies = dependencies
            .as_table()
            .expect("a dependency section is a table");
        for (key, spec) in dependencies {
            let package = spec
                .get("package")
                .and_then(toml::Value::as_str)
                .unwrap_or(key);
            let optional = spec
                .get("optional")
                .and_then(toml::Value::as_bool)
                .unwrap_or(false);
            for name in [key.as_str(), package] {
                let allowed = ALLOWED_DEPENDENCIES.contains(&name)
                    || (optional && OPTIONAL_DEPENDENCIES.contains(&name));
                if !allowed {
                    offences.push(format!("[{section}] {name}"));
                }
            }
        }
    }
    offences.sort();
    offences.dedup();
    offences
}

#[test]
fn manifest_names_only_pure_dependencies() {
    let path = manifest_dir().join("Cargo.toml");
    let manifest = fs::read_to_string(&path).expect("Cargo.toml is readable");
    let offences = disallowed_dependencies(&manifest);
    assert!(
        offences.is_empty(),
        "{} may depend only on {ALLOWED_DEPENDENCIES:?} (and optionally on {OPTIONAL_DEPENDENCIES:?}), not:\n{}",
        path.display(),
        offences.join("\n")
    );
}

#[test]
fn manifest_check_catches_io_dependencies() {
    let manifest = r#"
        [dependencies]
        ledger.workspace = true
        tokio.workspace = true
        clock = { package = "getrandom", version = "0.3" }
        schemars = { workspace = true, optional = true }
        serde_jcs = { version = "0.2", optional = true }

        [target.'cfg(unix)'.dependencies]
        redb = "4"
        schemars = "1"

        [dev-dependencies]
        toml = "1"
    "#;
    assert_eq!(
        disallowed_dependencies(manifest),
        [
            "[dependencies] clock",
            "[dependencies] getrandom",
            "[dependencies] serde_jcs",
            "[dependencies] tokio",
            "[target.cfg(unix).dependencies] redb",
            "[target.cfg(unix).dependencies] schemars",
        ]
    );
}

fn rust_files(dir: &Path, files: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("source directory is readable") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, files);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            files.push(path);
        }
    }
}

#[test]
fn source_imports_no_io_clock_or_randomness() {
    let mut files = Vec::new();
    rust_files(&manifest_dir().join("src"), &mut files);
    assert!(
        files.iter().any(|path| path.ends_with("lib.rs")),
        "the scan found the core's sources"
    );
    let mut offences = Vec::new();
    for path in files {
        let source = fs::read_to_string(&path).expect("source is readable");
        for (number, line) in source.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for word in FORBIDDEN_IN_SOURCE {
                if code.contains(word) {
                    offences.push(format!("{}:{}: {word}: {line}", path.display(), number + 1));
                }
            }
        }
    }
    assert!(
        offences.is_empty(),
        "the agent core must stay pure:\n{}",
        offences.join("\n")
    );
}
