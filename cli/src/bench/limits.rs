//! The machine's own limits, measured in the same run: how often the disk
//! under the temporary directory completes an `fdatasync`, and how many
//! one-row redb transactions with immediate durability commit per second.

use std::io::{Seek as _, SeekFrom, Write as _};
use std::path::Path;
use std::time::Instant;

use redb::{Database, Durability, TableDefinition};

use super::load::{Window, percentile_ms};

/// Rate and median latency of one durable operation.
#[derive(Debug, Clone, Copy)]
pub struct DurableRate {
    pub per_second: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

fn measure(
    window: Window,
    mut operation: impl FnMut(u64) -> anyhow::Result<()>,
) -> anyhow::Result<DurableRate> {
    let started = Instant::now();
    let from = started + window.warmup;
    let until = from + window.measure;
    let mut latencies = Vec::new();
    let mut index = 0u64;
    loop {
        let sent = Instant::now();
        if sent >= until {
            break;
        }
        operation(index)?;
        index += 1;
        let now = Instant::now();
        if now >= from && now < until {
            latencies.push(u32::try_from(now.duration_since(sent).as_micros()).unwrap_or(u32::MAX));
        }
    }
    let count = latencies.len();
    latencies.sort_unstable();
    Ok(DurableRate {
        per_second: count as f64 / window.measure.as_secs_f64(),
        p50_ms: percentile_ms(&latencies, 500),
        p99_ms: percentile_ms(&latencies, 990),
    })
}

/// Overwrites one 4 KiB block of a preallocated file and `fdatasync`s it,
/// in a loop (alternating two blocks, as a journal's pages would).
pub fn fdatasync_rate(dir: &Path, window: Window) -> anyhow::Result<DurableRate> {
    let path = dir.join("fdatasync.bin");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)?;
    file.write_all(&[0u8; 8192])?;
    file.sync_all()?;
    let mut block = [0u8; 4096];
    let rate = measure(window, |index| {
        block[..8].copy_from_slice(&index.to_le_bytes());
        file.seek(SeekFrom::Start((index % 2) * 4096))?;
        file.write_all(&block)?;
        file.sync_data()?;
        Ok(())
    });
    let _ = std::fs::remove_file(&path);
    rate
}

const ROWS: TableDefinition<u64, &[u8]> = TableDefinition::new("rows");

/// One-row write transactions on redb with `Durability::Immediate` (as the
/// agent's journal and the central redb store commit), in a loop.
pub fn redb_commit_rate(dir: &Path, window: Window) -> anyhow::Result<DurableRate> {
    let path = dir.join("limit.redb");
    let database = Database::create(&path)?;
    let value = [7u8; 200];
    let rate = measure(window, |index| {
        let mut transaction = database.begin_write()?;
        transaction.set_durability(Durability::Immediate)?;
        {
            let mut table = transaction.open_table(ROWS)?;
            // A bounded key space: the file stays small however long the run.
            table.insert(index % 10_000, value.as_slice())?;
        }
        transaction.commit()?;
        Ok(())
    });
    drop(database);
    let _ = std::fs::remove_file(&path);
    rate
}
