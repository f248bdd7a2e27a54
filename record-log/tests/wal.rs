//! The write-ahead log's crash rules. A commit is one frame appended to the
//! newest log file and `fdatasync`ed; a crash mid-append leaves a torn last
//! frame, never acknowledged, which open cuts off — wherever the crash cut
//! it. A damaged frame that acknowledged frames follow, a torn end of an
//! older file, or a missing file is corruption: open fails with a named
//! error and drops nothing. A fold deletes the files it folded; a crash
//! before the deletion leaves a file the next open deletes. An aborted
//! commit leaves the files byte for byte as they were.
//!
//! Commits may be in flight two at a time (`RecordLog::append`, then
//! `Appended::sync`): a sync returns once its frame and every frame before
//! it are durable, so a crash may leave a bad frame followed by one valid
//! frame, neither acknowledged — a torn tail too. A frame dropped unsynced
//! breaks the store and is cut off with the frames after it.
//!
//! A store may write zeros ahead of its frames (`Layout::preallocate_bytes`):
//! its log file is then the same frames followed by zeros, which open reads
//! as the end of the frames, and every rule above holds with them there.
//! Such a store writes its next log file over the last one it folded: the
//! earlier frames stay behind an end mark and are never read.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use record_log::{FOLD_LAG_FILES, Layout, RecordLog, RecordLogError};

mod common;

use common::{LAYOUT, open};

const STORE: &str = "store.redb";

/// The tests' layout, writing zeros ahead of the frames: fewer bytes than
/// two frames, so that commits write zeros often, and not a page.
const PADDED: Layout = Layout {
    preallocate_bytes: 100,
    ..LAYOUT
};

/// Zeros past the end of a log file, as the writer leaves them ahead of
/// its frames (or a crash leaves a frame written over them only in part).
fn pad_with_zeros(path: &Path, zeros: u64) {
    let file = fs::OpenOptions::new().write(true).open(path).expect("open");
    let end = file.metadata().expect("metadata").len();
    file.set_len(end + zeros).expect("extend");
}

/// The store's log files in `dir`, oldest first.
fn log_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<(u64, PathBuf)> = fs::read_dir(dir)
        .expect("read dir")
        .map(|entry| entry.expect("entry").path())
        .filter_map(|path| {
            let name = path.file_name()?.to_str()?.to_owned();
            let generation = name.strip_prefix("store.redb.wal.")?.parse().ok()?;
            Some((generation, path))
        })
        .collect();
    files.sort();
    files.into_iter().map(|(_, path)| path).collect()
}

fn newest_log_file(dir: &Path) -> PathBuf {
    log_files(dir).pop().expect("a log file")
}

/// Copies every file of the store in `from` to `to`.
fn copy_store(from: &Path, to: &Path) {
    for entry in fs::read_dir(from).expect("read dir") {
        let path = entry.expect("entry").path();
        fs::copy(&path, to.join(path.file_name().expect("name"))).expect("copy");
    }
}

fn size(path: &Path) -> u64 {
    fs::metadata(path).expect("metadata").len()
}

/// Commit `i` of the tests' workload: "a" set to `i`, a new key `k<i>`,
/// and every third commit deletes the key of the commit before.
fn commit_number(store: &RecordLog, model: &mut BTreeMap<String, Vec<u8>>, i: u64) {
    let value = format!("value {i}");
    let key = format!("k{i:04}");
    let previous = format!("k{:04}", i.wrapping_sub(1));
    let mut writes = vec![
        ("a", Some(value.as_bytes())),
        (key.as_str(), Some(value.as_bytes())),
    ];
    if i % 3 == 2 {
        writes.push((previous.as_str(), None));
    }
    store.commit(writes.iter().copied()).expect("commit");
    model.insert("a".to_owned(), value.clone().into_bytes());
    model.insert(key, value.into_bytes());
    if i % 3 == 2 {
        model.remove(&previous);
    }
}

/// Three commits in a fresh store in `dir`: the models after the second
/// and the third, and where the second and third frames begin.
struct ThreeCommits {
    after_one: BTreeMap<String, Vec<u8>>,
    after_two: BTreeMap<String, Vec<u8>>,
    after_three: BTreeMap<String, Vec<u8>>,
    second_frame: u64,
    third_frame: u64,
}

fn three_commits(dir: &Path) -> ThreeCommits {
    let store = open(&dir.join(STORE));
    let mut model = BTreeMap::new();
    commit_number(&store, &mut model, 0);
    let after_one = model.clone();
    let second_frame = size(&newest_log_file(dir));
    commit_number(&store, &mut model, 1);
    let after_two = model.clone();
    let third_frame = size(&newest_log_file(dir));
    commit_number(&store, &mut model, 2);
    assert_eq!(log_files(dir).len(), 1, "one log file so far");
    ThreeCommits {
        after_one,
        after_two,
        after_three: model,
        second_frame,
        third_frame,
    }
}

#[test]
fn a_torn_last_frame_is_cut_off_wherever_the_crash_cut_it() {
    let original = tempfile::tempdir().expect("temp dir");
    let commits = three_commits(original.path());
    let log = newest_log_file(original.path());
    let end = size(&log);
    let written = fs::read(&log).expect("read");
    assert!(
        end > commits.third_frame + 16,
        "the third frame has records"
    );
    // With zeros after the cut: the frame was written over zeros ahead.
    for (cut, zeros) in (commits.third_frame..=end).flat_map(|cut| [(cut, 0), (cut, 64)]) {
        let dir = tempfile::tempdir().expect("temp dir");
        copy_store(original.path(), dir.path());
        let copy = newest_log_file(dir.path());
        fs::OpenOptions::new()
            .write(true)
            .open(&copy)
            .expect("open copy")
            .set_len(cut)
            .expect("truncate");
        pad_with_zeros(&copy, zeros);
        // The open seals the file and its folder folds and deletes it at a
        // moment of its own: a second name for the inode keeps it readable.
        let inode = dir.path().join("inode-of-the-log-file");
        fs::hard_link(&copy, &inode).expect("link");
        let store = open(&dir.path().join(STORE));
        if cut == end {
            assert_eq!(store.load().expect("load"), commits.after_three);
            assert_eq!(size(&inode), end + zeros, "a whole log is not cut");
            continue;
        }
        assert_eq!(
            store.load().expect("load"),
            commits.after_two,
            "cut at byte {cut}, {zeros} zeros after: the earlier commits, whole"
        );
        // What the crash left of the frame, if anything but zeros, is cut
        // off with the zeros after it; zeros alone are left as they are.
        let torn = written[usize::try_from(commits.third_frame).expect("offset")
            ..usize::try_from(cut).expect("offset")]
            .iter()
            .any(|byte| *byte != 0);
        assert_eq!(
            size(&inode),
            if torn {
                commits.third_frame
            } else {
                cut + zeros
            },
            "cut at byte {cut}, {zeros} zeros after"
        );
        // The store goes on: a new commit survives a reopen.
        store
            .commit([("after", Some(b"crash".as_slice()))])
            .expect("commit");
        drop(store);
        let mut want = commits.after_two.clone();
        want.insert("after".to_owned(), b"crash".to_vec());
        assert_eq!(
            open(&dir.path().join(STORE)).load().expect("load"),
            want,
            "cut at byte {cut}, then a commit and a reopen"
        );
    }
}

#[test]
fn a_damaged_last_frame_is_a_torn_tail() {
    let original = tempfile::tempdir().expect("temp dir");
    let commits = three_commits(original.path());
    let end = size(&newest_log_file(original.path()));
    for (at, zeros) in (commits.third_frame..end).flat_map(|at| [(at, 0), (at, 64)]) {
        let dir = tempfile::tempdir().expect("temp dir");
        copy_store(original.path(), dir.path());
        let log = newest_log_file(dir.path());
        flip_byte(&log, at);
        pad_with_zeros(&log, zeros);
        let store = open(&dir.path().join(STORE));
        assert_eq!(
            store.load().expect("load"),
            commits.after_two,
            "byte {at} flipped, {zeros} zeros after: a last frame failing its checksum was never acknowledged"
        );
    }
}

fn flip_byte(path: &Path, at: u64) {
    let mut bytes = fs::read(path).expect("read");
    let index = usize::try_from(at).expect("offset");
    bytes[index] ^= 0xff;
    fs::write(path, bytes).expect("write");
}

/// A frame is acknowledged once every frame before it is durable, and at
/// most `COMMITS_IN_FLIGHT_MAX` (2) are in flight: a bad frame with two
/// valid frames after it lies before acknowledged data.
#[test]
fn a_damaged_frame_before_acknowledged_frames_is_refused() {
    assert_eq!(record_log::COMMITS_IN_FLIGHT_MAX, 2);
    let original = tempfile::tempdir().expect("temp dir");
    let commits = three_commits(original.path());
    for at in 0..commits.second_frame {
        let dir = tempfile::tempdir().expect("temp dir");
        copy_store(original.path(), dir.path());
        let log = newest_log_file(dir.path());
        flip_byte(&log, at);
        let damaged = fs::read(&log).expect("read");
        let error = RecordLog::open(&dir.path().join(STORE), LAYOUT).expect_err("corrupt");
        match &error {
            RecordLogError::Corrupt { path, offset, .. } => {
                assert_eq!(path, &log, "byte {at}");
                assert_eq!(*offset, 0, "byte {at}: {error}");
            }
            other => panic!("byte {at}: {other}"),
        }
        assert_eq!(fs::read(&log).expect("read"), damaged, "nothing is cut off");
    }
}

/// Two commits in flight: the crash left the later frame on disk and not
/// the earlier one (damaged, or never written: zeros). Neither was
/// acknowledged; both are cut off.
#[test]
fn a_bad_frame_followed_by_one_frame_in_flight_is_a_torn_tail() {
    let original = tempfile::tempdir().expect("temp dir");
    let commits = three_commits(original.path());
    let second = usize::try_from(commits.second_frame).expect("offset");
    let third = usize::try_from(commits.third_frame).expect("offset");
    let flipped = (second..third).map(|at| (at, false));
    for (at, zeroed) in flipped.chain([(second, true)]) {
        let dir = tempfile::tempdir().expect("temp dir");
        copy_store(original.path(), dir.path());
        let log = newest_log_file(dir.path());
        let mut bytes = fs::read(&log).expect("read");
        if zeroed {
            bytes[second..third].fill(0);
        } else {
            bytes[at] ^= 0xff;
        }
        fs::write(&log, bytes).expect("write");
        let inode = dir.path().join("inode-of-the-log-file");
        fs::hard_link(&log, &inode).expect("link");
        let store = open(&dir.path().join(STORE));
        assert_eq!(
            store.load().expect("load"),
            commits.after_one,
            "byte {at} (zeroed: {zeroed}): the frames in flight are cut off"
        );
        assert_eq!(size(&inode), commits.second_frame, "byte {at}");
    }
}

/// Commits, folds held, until the newest log file was sealed and a
/// second one started: two log files.
fn two_log_files(dir: &Path) -> (RecordLog, BTreeMap<String, Vec<u8>>, u64) {
    let store = open(&dir.join(STORE));
    store.hold_folds(true);
    let mut model = BTreeMap::new();
    let mut i = 0;
    while log_files(dir).len() < 2 {
        commit_number(&store, &mut model, i);
        i += 1;
    }
    assert_eq!(i, LAYOUT.log_commits + 1, "a file is sealed when full");
    (store, model, i)
}

#[test]
fn a_torn_end_of_an_older_log_file_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (store, _, _) = two_log_files(dir.path());
    drop(store);
    let older = log_files(dir.path()).remove(0);
    let cut = size(&older) - 1;
    fs::OpenOptions::new()
        .write(true)
        .open(&older)
        .expect("open")
        .set_len(cut)
        .expect("truncate");
    let error = RecordLog::open(&dir.path().join(STORE), LAYOUT).expect_err("corrupt");
    assert!(
        matches!(&error, RecordLogError::Corrupt { path, .. } if *path == older),
        "{error}"
    );
}

#[test]
fn a_missing_log_file_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (store, _, _) = two_log_files(dir.path());
    drop(store);
    fs::remove_file(log_files(dir.path()).remove(0)).expect("remove");
    let error = RecordLog::open(&dir.path().join(STORE), LAYOUT).expect_err("corrupt");
    assert!(
        matches!(
            error,
            RecordLogError::Corrupt {
                offset: 0,
                reason: "a frame is out of sequence",
                ..
            }
        ),
        "{error}"
    );
}

#[test]
fn a_fold_deletes_the_log_files_it_folded_and_a_file_left_behind_is_deleted_at_open() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (store, mut model, mut i) = two_log_files(dir.path());
    let first = log_files(dir.path()).remove(0);
    let kept = fs::read(&first).expect("read");
    store.hold_folds(false);
    store.checkpoint().expect("checkpoint");
    assert!(log_files(dir.path()).is_empty(), "both files folded");
    assert_eq!(store.log_len(), 0);
    for _ in 0..3 {
        commit_number(&store, &mut model, i);
        i += 1;
    }
    drop(store);
    // A crash between a fold's commit and the deletion: the folded file is
    // still there. The table records it as folded; open deletes it.
    fs::write(&first, kept).expect("restore");
    let store = open(&dir.path().join(STORE));
    assert!(!first.exists(), "a folded log file is deleted at open");
    assert_eq!(store.load().expect("load"), model);
}

#[test]
fn at_most_two_log_files_exist_while_folds_run() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open(&dir.path().join(STORE));
    let mut model = BTreeMap::new();
    for i in 0..LAYOUT.log_commits * 20 {
        commit_number(&store, &mut model, i);
        let files = log_files(dir.path()).len();
        assert!(files <= 2, "{files} log files after commit {i}");
    }
    assert_eq!(store.load().expect("load"), model);
}

#[test]
fn a_commit_waits_while_the_fold_lags_by_the_bound_and_goes_on_when_it_ends() {
    let dir = tempfile::tempdir().expect("temp dir");
    // A held fold stands for one too slow to keep up.
    let (store, mut model, mut i) = two_log_files(dir.path());
    let lag_max = LAYOUT.log_commits * FOLD_LAG_FILES;
    // The newest file holds one frame; it takes commits up to the bound.
    while i < LAYOUT.log_commits + lag_max {
        commit_number(&store, &mut model, i);
        i += 1;
    }
    assert_eq!(store.commits_waiting(), 0, "up to the bound nobody waits");
    assert_eq!(store.log_len(), LAYOUT.log_commits + lag_max);
    std::thread::scope(|scope| {
        let waiting = scope.spawn(|| {
            store
                .commit([("past the bound", Some(b"1".as_slice()))])
                .expect("commit after the fold")
        });
        // No time involved: the commit registers as waiting, or finishes
        // (a bug), before this loop ends.
        while store.commits_waiting() == 0 && !waiting.is_finished() {
            std::thread::yield_now();
        }
        assert_eq!(
            store.commits_waiting(),
            1,
            "the commit past the bound waits"
        );
        assert_eq!(
            store.log_len(),
            LAYOUT.log_commits + lag_max,
            "and has appended nothing"
        );
        store.hold_folds(false);
        waiting.join().expect("commit thread");
    });
    model.insert("past the bound".to_owned(), b"1".to_vec());
    assert_eq!(store.commits_waiting(), 0);
    assert_eq!(store.load().expect("load"), model);
    store.checkpoint().expect("checkpoint");
    assert_eq!(store.log_len(), 0);
    drop(store);
    assert_eq!(open(&dir.path().join(STORE)).load().expect("load"), model);
}

/// Each log file of the store in `dir`, oldest first, with its bytes.
fn log_file_contents(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    log_files(dir)
        .into_iter()
        .map(|path| {
            let bytes = fs::read(&path).expect("read");
            (path, bytes)
        })
        .collect()
}

/// `bytes` without the zeros at its end: a log file's frames, whatever
/// was written ahead of them (no frame of these tests ends in a zero byte).
fn frames(bytes: &[u8]) -> &[u8] {
    let end = bytes
        .iter()
        .rposition(|byte| *byte != 0)
        .map_or(0, |at| at + 1);
    &bytes[..end]
}

#[test]
fn an_aborted_commit_leaves_the_log_files_as_they_were() {
    for layout in [LAYOUT, PADDED] {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = RecordLog::open(&dir.path().join(STORE), layout).expect("open");
        // No fold deletes a file between the snapshots.
        store.hold_folds(true);
        let mut model = BTreeMap::new();
        for i in 0..LAYOUT.log_commits * 2 + 5 {
            let before = log_file_contents(dir.path());
            let error = store
                .commit_then_abort([("a", Some(b"aborted".as_slice())), ("b", None)])
                .expect_err("aborted");
            assert!(matches!(error, RecordLogError::Aborted), "{error}");
            let after = log_file_contents(dir.path());
            // A first frame's new file may stay behind, empty; the zeros
            // written ahead go with the aborted frame.
            let after: Vec<_> = after
                .into_iter()
                .filter(|(path, bytes)| !bytes.is_empty() || before.iter().any(|(p, _)| p == path))
                .collect();
            let frames_of = |files: &[(PathBuf, Vec<u8>)]| -> Vec<(PathBuf, Vec<u8>)> {
                files
                    .iter()
                    .map(|(path, bytes)| (path.clone(), frames(bytes).to_vec()))
                    .collect()
            };
            if layout.preallocate_bytes == 0 {
                assert_eq!(before, after, "before commit {i}");
            } else {
                assert_eq!(frames_of(&before), frames_of(&after), "before commit {i}");
            }
            assert_eq!(store.load().expect("load"), model, "before commit {i}");
            commit_number(&store, &mut model, i);
        }
        drop(store);
        assert_eq!(open(&dir.path().join(STORE)).load().expect("load"), model);
    }
}

#[test]
fn a_store_writing_zeros_ahead_has_the_same_frames_and_reopens_whole() {
    let plain = tempfile::tempdir().expect("temp dir");
    let padded = tempfile::tempdir().expect("temp dir");
    let plain_store = open(&plain.path().join(STORE));
    let padded_store = RecordLog::open(&padded.path().join(STORE), PADDED).expect("open");
    let mut model = BTreeMap::new();
    let mut padded_model = BTreeMap::new();
    // Two log files each: the older one sealed with its zeros.
    for store in [&plain_store, &padded_store] {
        store.hold_folds(true);
    }
    for i in 0..LAYOUT.log_commits + 5 {
        commit_number(&plain_store, &mut model, i);
        commit_number(&padded_store, &mut padded_model, i);
    }
    let plain_files = log_file_contents(plain.path());
    let padded_files = log_file_contents(padded.path());
    assert_eq!(padded_files.len(), 2, "two log files");
    assert_eq!(plain_files.len(), 2, "two log files");
    for ((_, plain_bytes), (path, padded_bytes)) in plain_files.iter().zip(&padded_files) {
        let (head, zeros) = padded_bytes.split_at(plain_bytes.len());
        assert_eq!(
            head,
            plain_bytes.as_slice(),
            "{}: the same frames",
            path.display()
        );
        assert!(
            !zeros.is_empty() && zeros.len() as u64 <= PADDED.preallocate_bytes,
            "{}: {} zeros after the frames",
            path.display(),
            zeros.len()
        );
        assert!(zeros.iter().all(|byte| *byte == 0), "{}", path.display());
    }
    drop((plain_store, padded_store));
    // Second names keep the files readable after the fold deletes them.
    let links: Vec<_> = padded_files
        .iter()
        .enumerate()
        .map(|(at, (path, bytes))| {
            let link = padded.path().join(format!("inode-{at}"));
            fs::hard_link(path, &link).expect("link");
            (link, bytes)
        })
        .collect();
    let store = open(&padded.path().join(STORE));
    assert_eq!(
        store.load().expect("load"),
        model,
        "every commit, read past the zeros"
    );
    store.checkpoint().expect("checkpoint");
    for (link, bytes) in links {
        assert_eq!(&fs::read(&link).expect("read"), bytes, "nothing is cut off");
    }
}

/// Commits kept two in flight, as the agent's daemon keeps them: each
/// frame appended before the last one is synced.
fn commits_in_flight(store: &RecordLog, keys: std::ops::Range<u64>) -> BTreeMap<String, Vec<u8>> {
    let mut model = BTreeMap::new();
    let mut in_flight = None;
    for i in keys {
        let key = format!("k{i:04}");
        let value = format!("value {i}");
        let appended = store
            .append([(key.as_str(), Some(value.as_bytes()))])
            .expect("append");
        if let Some(earlier) = in_flight.replace(appended) {
            earlier.sync().expect("sync");
        }
        model.insert(key, value.into_bytes());
    }
    if let Some(last) = in_flight {
        last.sync().expect("sync");
    }
    model
}

#[test]
fn commits_in_flight_fill_seal_and_fold_log_files_and_reopen_whole() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(STORE);
    let store = open(&path);
    let commits = 5 * LAYOUT.log_commits + 3;
    let model = commits_in_flight(&store, 0..commits);
    assert_eq!(store.load().expect("load"), model);
    store.checkpoint().expect("checkpoint");
    assert_eq!(store.log_len(), 0, "every log file folded");
    let more = commits_in_flight(&store, commits..commits + 3);
    drop(store);
    let mut want = model;
    want.extend(more);
    assert_eq!(open(&path).load().expect("load"), want);
}

#[test]
fn a_later_frame_synced_first_is_acknowledged_once_the_earlier_one_is_durable() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(STORE);
    let store = open(&path);
    let first = store
        .append([("a", Some(b"1".as_slice()))])
        .expect("append");
    let second = store
        .append([("b", Some(b"2".as_slice()))])
        .expect("append");
    std::thread::scope(|scope| {
        let later = scope.spawn(|| second.sync());
        first.sync().expect("first");
        later.join().expect("thread").expect("second");
    });
    assert_eq!(store.log_len(), 2);
    drop(store);
    let want: BTreeMap<String, Vec<u8>> = [("a", b"1"), ("b", b"2")]
        .into_iter()
        .map(|(key, value)| (key.to_owned(), value.to_vec()))
        .collect();
    assert_eq!(open(&path).load().expect("load"), want);
}

#[test]
fn a_checkpoint_waits_for_the_frames_in_flight_and_folds_them() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = open(&dir.path().join(STORE));
    let appended = store
        .append([("a", Some(b"1".as_slice()))])
        .expect("append");
    std::thread::scope(|scope| {
        let checkpoint = scope.spawn(|| store.checkpoint());
        appended.sync().expect("sync");
        checkpoint.join().expect("thread").expect("checkpoint");
    });
    assert_eq!(store.log_len(), 0, "the synced frame folded");
    assert_eq!(store.load().expect("load").len(), 1);
}

#[test]
fn a_frame_dropped_unsynced_breaks_the_store_and_is_cut_off_with_the_frames_after_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(STORE);
    let store = open(&path);
    store
        .commit([("kept", Some(b"1".as_slice()))])
        .expect("commit");
    let log = newest_log_file(dir.path());
    let kept_end = fs::read(&log).expect("read").len();
    let first = store
        .append([("lost", Some(b"2".as_slice()))])
        .expect("append");
    let second = store
        .append([("also lost", Some(b"3".as_slice()))])
        .expect("append");
    drop(first);
    assert!(
        matches!(second.sync(), Err(RecordLogError::Broken { .. })),
        "a frame after a dropped one is never acknowledged"
    );
    assert!(matches!(
        store.commit([("after", Some(b"4".as_slice()))]),
        Err(RecordLogError::Broken { .. })
    ));
    assert!(matches!(store.load(), Err(RecordLogError::Broken { .. })));
    assert_eq!(
        fs::read(&log).expect("read").len(),
        kept_end,
        "cut off where the dropped frame began"
    );
    drop(store);
    let reopened = open(&path);
    assert_eq!(
        reopened.load().expect("load"),
        BTreeMap::from([("kept".to_owned(), b"1".to_vec())])
    );
    reopened
        .commit([("after", Some(b"4".as_slice()))])
        .expect("a reopened store takes commits");
}

/// A zeroed frame is the end of the frames only if no acknowledged frame
/// follows it: here two do (a frame's blocks lost, not a torn tail).
#[test]
fn a_zeroed_frame_before_acknowledged_frames_is_refused() {
    let original = tempfile::tempdir().expect("temp dir");
    let commits = three_commits(original.path());
    let dir = tempfile::tempdir().expect("temp dir");
    copy_store(original.path(), dir.path());
    let log = newest_log_file(dir.path());
    let mut bytes = fs::read(&log).expect("read");
    let second = usize::try_from(commits.second_frame).expect("offset");
    bytes[..second].fill(0);
    fs::write(&log, &bytes).expect("write");
    match RecordLog::open(&dir.path().join(STORE), LAYOUT).expect_err("corrupt") {
        RecordLogError::Corrupt { offset, .. } => assert_eq!(offset, 0),
        other => panic!("{other}"),
    }
    assert_eq!(fs::read(&log).expect("read"), bytes, "nothing is cut off");
}

/// A store writing zeros ahead keeps the log file its fold folded as the
/// spare and writes the next generation over it: the earlier frames stay
/// behind the new ones, past an end mark, and neither a load nor an open
/// reads them.
#[test]
fn a_folded_log_file_is_written_over_and_its_earlier_frames_are_never_read() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(STORE);
    let spare = dir.path().join("store.redb.wal.spare");
    let store = RecordLog::open(&path, PADDED).expect("open");
    let mut model = BTreeMap::new();
    // Frames larger than the next generation's: its frames end inside them.
    let large = [7; 300];
    for i in 0..LAYOUT.log_commits {
        let key = format!("large{i}");
        store
            .commit([(key.as_str(), Some(&large[..]))])
            .expect("commit");
        model.insert(key, large.to_vec());
    }
    store.checkpoint().expect("checkpoint");
    assert!(log_files(dir.path()).is_empty(), "folded");
    let earlier = fs::read(&spare).expect("the folded file is kept as the spare");
    assert_eq!(&earlier[..16], &[0; 16], "an end mark first");
    for i in LAYOUT.log_commits..LAYOUT.log_commits + 2 {
        commit_number(&store, &mut model, i);
    }
    assert!(!spare.exists(), "the next log file is the spare");
    let written = fs::read(newest_log_file(dir.path())).expect("read");
    assert_eq!(written.len(), earlier.len(), "written over, not grown");
    let new_end = (0..written.len())
        .rev()
        .find(|at| written[*at] != earlier[*at])
        .expect("new frames")
        + 1;
    assert!(
        new_end < written.len() / 2 && earlier[new_end..].iter().any(|byte| *byte != 0),
        "the earlier frames lie after the new ones"
    );
    assert_eq!(store.load().expect("load"), model);
    // Sealed and not folded: at the next open the file is not the newest,
    // whose tail an open cuts off; its frames end at the end mark.
    store.hold_folds(true);
    let mut i = LAYOUT.log_commits + 2;
    while log_files(dir.path()).len() < 2 {
        commit_number(&store, &mut model, i);
        i += 1;
    }
    drop(store);
    let store = RecordLog::open(&path, PADDED).expect("reopen");
    assert_eq!(store.load().expect("load"), model, "after a reopen too");
}

/// A crash after the spare became the next log file and before its first
/// frame was written leaves a log file of earlier frames behind an end
/// mark: it holds no frame, and nothing is lost.
#[test]
fn a_spare_renamed_before_its_first_frame_holds_no_frame() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(STORE);
    let store = RecordLog::open(&path, PADDED).expect("open");
    let mut model = BTreeMap::new();
    for i in 0..LAYOUT.log_commits {
        commit_number(&store, &mut model, i);
    }
    store.checkpoint().expect("checkpoint");
    drop(store);
    let next = dir.path().join("store.redb.wal.2");
    fs::rename(dir.path().join("store.redb.wal.spare"), &next).expect("rename");
    let store = RecordLog::open(&path, PADDED).expect("open");
    assert_eq!(store.load().expect("load"), model);
    store.checkpoint().expect("checkpoint");
    for i in LAYOUT.log_commits..LAYOUT.log_commits + 3 {
        commit_number(&store, &mut model, i);
    }
    drop(store);
    let store = RecordLog::open(&path, PADDED).expect("reopen");
    assert_eq!(store.load().expect("load"), model);
}

/// A crash may leave a recycled file's last frame without its end mark
/// (the mark's page never written): the earlier generation's frame found
/// there ends the frames too, and the file is cut there.
#[test]
fn an_earlier_frame_where_an_end_mark_was_lost_ends_the_frames() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join(STORE);
    let store = RecordLog::open(&path, PADDED).expect("open");
    let mut model = BTreeMap::new();
    // Frames of one size in both generations: the new ones end where an
    // earlier one begins.
    let mut commit = |store: &RecordLog, key: String| {
        let value = [1; 50];
        store
            .commit([(key.as_str(), Some(&value[..]))])
            .expect("commit");
        model.insert(key, value.to_vec());
    };
    for i in 0..LAYOUT.log_commits {
        commit(&store, format!("p{i:04}"));
    }
    store.checkpoint().expect("checkpoint");
    let earlier = fs::read(dir.path().join("store.redb.wal.spare")).expect("spare");
    commit(&store, "q0000".to_owned());
    commit(&store, "q0001".to_owned());
    drop(store);
    let log = newest_log_file(dir.path());
    let mut bytes = fs::read(&log).expect("read");
    let frame = 16
        + usize::try_from(u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")))
            .expect("length");
    let end = 2 * frame;
    assert_eq!(&bytes[end..end + 16], &[0; 16], "the end mark");
    bytes[end..end + 16].copy_from_slice(&earlier[end..end + 16]);
    assert_ne!(
        &bytes[end + 8..end + 16],
        &[0; 8],
        "an earlier frame's header"
    );
    fs::write(&log, &bytes).expect("write");
    let store = RecordLog::open(&path, PADDED).expect("open");
    assert_eq!(store.load().expect("load"), model);
    drop(store);
    assert!(
        !log.exists() || size(&log) == end as u64,
        "cut after the frames"
    );
}
