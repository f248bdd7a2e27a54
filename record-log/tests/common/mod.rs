//! What every test binary of this crate opens its stores with.

use std::path::Path;

use record_log::{Layout, RecordLog};

/// Small log files (16 commits), so that tests seal and fold them often.
pub const LAYOUT: Layout = Layout {
    records: "records",
    log: "records-log",
    log_commits: 16,
    cache_bytes: 1 << 20,
    preallocate_bytes: 0,
    groups: "records-groups",
    group: group_all_but_the_last_character,
};

/// The tests' [`Layout::group`]: a key of three characters or more is kept
/// in the group named by all its characters but the last; shorter keys
/// stay alone. So the tests' keys fill groups of every kind: of one key
/// and of many, next to keys alone, and a group whose name is a prefix of
/// another's, so that its keys do not lie together in key order (`old`
/// and `ole` in group `ol`, `old/1` in group `old/` between them).
fn group_all_but_the_last_character(key: &str) -> Option<&str> {
    let (last, _) = key.char_indices().last()?;
    (last >= 2).then(|| &key[..last])
}

pub fn open(path: &Path) -> RecordLog {
    RecordLog::open(path, LAYOUT).expect("open")
}
