//! Reservoir's deterministic test bed: the real ledger and agent cores,
//! driven in-process.
//!
//! - [`central_node`]: the central ledger over an in-memory store, answering
//!   agent calls as the HTTP service does.
//! - [`agent_node`]: an agent core over an in-memory journal that can crash
//!   and restart from a current or stale copy.
//! - [`crypto`]: the cheap deterministic signature scheme.
//! - [`world`]: a synchronous world for scenario tests.
//! - [`sim`]: the deterministic simulator and the release gate.

pub mod agent_node;
pub mod central_node;
pub mod crypto;
pub mod sim;
pub mod world;
