//! The folder thread runs at the lowest priority: its fold bursts take the
//! CPU the service's request threads leave (docs/benchmarks-history.md). A test binary
//! of its own, so that no other test's store has a folder thread that has
//! not lowered its priority yet.

use std::fs;

mod common;

use common::open;

/// The nice value of this process's thread named `name`, from
/// `/proc/self/task/*/stat` (field 19).
fn nice_of_thread(name: &str) -> Option<i64> {
    for task in fs::read_dir("/proc/self/task").expect("tasks") {
        let task = task.expect("task").path();
        let Ok(comm) = fs::read_to_string(task.join("comm")) else {
            continue;
        };
        if comm.trim_end() != name {
            continue;
        }
        let stat = fs::read_to_string(task.join("stat")).expect("stat");
        // The fields after the parenthesised name: state is field 3, nice 19.
        let after_name = &stat[stat.rfind(')').expect("a name") + 2..];
        let nice = after_name.split(' ').nth(16).expect("nice");
        return Some(nice.parse().expect("a number"));
    }
    None
}

#[test]
fn the_folder_runs_at_the_lowest_priority() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open(&dir.path().join("store.redb"));
    // The folder lowers its priority first thing; a checkpoint waits for
    // it to fold, so it has by then.
    store
        .commit([("a", Some(b"1".as_slice()))])
        .expect("commit");
    store.checkpoint().expect("checkpoint");
    assert_eq!(nice_of_thread("record-log-fold"), Some(19));
    drop(store);
}
