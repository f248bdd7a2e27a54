//! Reservoir's agent: the sidecar next to each gateway.
//!
//! [`core`] is the agent's decision core: every decision, no I/O.
//! [`journal`] is its durable journal on redb.

pub mod core;
pub mod journal;
