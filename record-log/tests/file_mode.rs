//! The store file holds a service's whole state and was created 0644 under
//! the usual umask 0022 (issue 13): anyone on the host could read every
//! reservation or account. It is now created 0600 before redb opens it,
//! and an existing file open to its group or others is tightened to 0600
//! at open, its records intact. The tests run under the process's own
//! umask (0022 in CI and on developer machines; setting it would need
//! `unsafe`), which is the case that used to leak. The write-ahead log
//! files (layout version 4) follow the same rule.

use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use record_log::{FILE_MODE, RecordLog};

mod common;

use common::{LAYOUT, open};

fn mode(path: &Path) -> u32 {
    fs::metadata(path).expect("metadata").permissions().mode() & 0o7777
}

/// A closed store in a new temporary directory holding "kept" = "value":
/// the directory (removed when dropped) and the store's path.
fn store_with_one_record() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    store
        .commit([("kept", Some(b"value".as_slice()))])
        .expect("commit");
    drop(store);
    (dir, path)
}

#[test]
fn a_new_store_file_is_created_0600() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("store.redb");
    let store = open(&path);
    assert_eq!(FILE_MODE, 0o600);
    assert_eq!(mode(&path), 0o600);
    store
        .commit([("a", Some(b"1".as_slice()))])
        .expect("commit");
    drop(store);
    // The write-ahead log file is as private as the redb file.
    let log = dir.path().join("store.redb.wal.1");
    assert_eq!(mode(&log), 0o600);
    // A reopen leaves a private file as it is.
    drop(RecordLog::open(&path, LAYOUT).expect("reopen"));
    assert_eq!(mode(&path), 0o600);
}

#[test]
fn a_log_file_open_to_group_or_others_is_tightened_with_its_records_intact() {
    let (dir, path) = store_with_one_record();
    let log = dir.path().join("store.redb.wal.1");
    fs::set_permissions(&log, fs::Permissions::from_mode(0o644)).expect("chmod");
    // The open folds the file and deletes it, on its folder's thread, at a
    // moment of its own: a second name for the same inode keeps its mode
    // readable whenever that happens.
    let link = dir.path().join("inode-of-the-log-file");
    fs::hard_link(&log, &link).expect("link");
    let store = RecordLog::open(&path, LAYOUT).expect("reopen");
    assert_eq!(mode(&link), 0o600);
    assert_eq!(
        store.load().expect("load").get("kept").map(Vec::as_slice),
        Some(b"value".as_slice())
    );
}

#[test]
fn an_existing_file_open_to_group_or_others_is_tightened_with_its_records_intact() {
    // Each group/other bit alone is enough to tighten; owner bits alone
    // (0600, 0700) are left as they are.
    let cases = [
        (0o644, 0o600),
        (0o640, 0o600),
        (0o604, 0o600),
        (0o610, 0o600),
        (0o601, 0o600),
        (0o600, 0o600),
        (0o700, 0o700),
    ];
    for (before, after) in cases {
        let (_dir, path) = store_with_one_record();
        fs::set_permissions(&path, fs::Permissions::from_mode(before)).expect("chmod");
        assert_eq!(mode(&path), before);

        let store = RecordLog::open(&path, LAYOUT).expect("reopen");
        assert_eq!(mode(&path), after, "{before:04o}");
        let records = store.load().expect("load");
        assert_eq!(
            records.get("kept").map(Vec::as_slice),
            Some(b"value".as_slice()),
            "{before:04o}"
        );
    }
}
