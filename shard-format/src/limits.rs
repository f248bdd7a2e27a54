//! Named limits of the v1 documents. Every parser enforces them, so a value
//! that passed parsing is inside them.

/// Largest value of any unit count (`opening`, `reservedUnits`, …): 2^53 − 1,
/// the largest integer an IEEE-754 double holds exactly. Keeping units inside
/// it makes the canonical bytes identical to RFC 8785 in every language.
pub const UNITS_MAX: u64 = (1 << 53) - 1;

/// Largest millisecond duration (`holdTtlMs`, `intervalMs`, …): 366 days.
pub const DURATION_MS_MAX: u64 = 366 * 24 * 60 * 60 * 1000;

/// Longest hold a reservation may ask for (`holdTtlMs`): one day.
pub const HOLD_TTL_MS_MAX: u64 = 24 * 60 * 60 * 1000;

/// Longest identifier (subject, route, reservation, operation, shard, key,
/// idempotency key), in bytes.
pub const IDENTIFIER_LENGTH_MAX: usize = 128;

/// Longest free-text field (`region`, `capacityUnit`), in bytes.
pub const LABEL_LENGTH_MAX: usize = 64;

/// Largest policy generation, fence or boot epoch: kept inside the exact
/// double range for the same reason as [`UNITS_MAX`].
pub const COUNTER_MAX: u64 = UNITS_MAX;

/// Most legs one reservation may carry (`legs`): each is a (subject,
/// route) pair of its own, all admitted in one transition or none.
pub const LEGS_MAX: usize = 8;

/// Largest `fairnessWeight`.
pub const FAIRNESS_WEIGHT_MAX: u32 = 1_000_000;

/// Largest document any parser accepts, in bytes.
pub const DOCUMENT_SIZE_MAX: usize = 64 * 1024;
