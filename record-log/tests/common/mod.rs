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
};

pub fn open(path: &Path) -> RecordLog {
    RecordLog::open(path, LAYOUT).expect("open")
}
