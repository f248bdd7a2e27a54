//! The one place the service reads wall time. Tests drive a [`ManualClock`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use shard_format::Timestamp;

/// Where `now` comes from: every ledger operation takes it as an argument.
pub trait Clock: Send + Sync + std::fmt::Debug + 'static {
    fn now(&self) -> Timestamp;
}

/// The system's wall clock, in milliseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| {
                u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
            });
        Timestamp::from_unix_ms(ms).unwrap_or(Timestamp::MAX)
    }
}

/// A clock that moves only when told to. Clones share the time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    ms: Arc<AtomicU64>,
}

impl ManualClock {
    pub fn new(start: Timestamp) -> Self {
        Self {
            ms: Arc::new(AtomicU64::new(start.unix_ms())),
        }
    }

    pub fn advance_ms(&self, ms: u64) {
        self.ms.fetch_add(ms, Ordering::SeqCst);
    }

    pub fn set(&self, at: Timestamp) {
        self.ms.store(at.unix_ms(), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_unix_ms(self.ms.load(Ordering::SeqCst)).unwrap_or(Timestamp::MAX)
    }
}
