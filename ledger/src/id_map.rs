//! Hash maps keyed by identifiers, for the cores' hot lookups.

use std::collections::HashMap;

/// A hash map for lookups by identifier (reservation IDs above all) on the
/// cores' hot paths. An ordered map compares the 35-character IDs about
/// twenty times per search of 100,000 entries — `memcmp` was 8 % of the
/// agent's runtime thread in the emergency benchmark; one hash and one
/// comparison replace them.
///
/// The hasher's seed is fixed, so the same inputs give the same iteration
/// order on every run and a simulator seed replays exactly; code whose
/// result depends on the order sorts first. A fixed seed does not open a
/// collision attack to strangers: the keys are IDs the cores derive with
/// SHA-256, and only allow-listed peers reach an agent's socket.
pub type IdMap<K, V> = HashMap<K, V, foldhash::fast::FixedState>;
