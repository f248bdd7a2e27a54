//! The test suite of `shard-format`, in one binary so that it builds and
//! links once:
//!
//! - [`vectors`]: golden test vectors under `tests/vectors/`, checked byte for
//!   byte (`UPDATE_VECTORS=1` rewrites them);
//! - [`properties`]: round trips, and canonical bytes independent of member
//!   order, whitespace and escapes;
//! - [`strictness`]: every kind of malformed input is refused, naming its
//!   field;
//! - [`signatures`]: signing and verifying the two signed documents;
//! - [`fuzz`]: random and mutated bytes never make a parser panic or accept
//!   what does not re-parse identically (`FUZZ_CASES=N` runs more).
//!
//! [`support`] holds the test keys, the document kinds and the proptest
//! strategies that generate valid documents.

mod fuzz;
mod properties;
mod signatures;
mod strictness;
mod support;
mod vectors;
