//! Reservoir's agent: the sidecar next to each gateway.
//!
//! [`core`] is the agent's decision core: every decision, no I/O. The rest
//! is the thin daemon shell around it: [`journal`] (the redb journal),
//! [`daemon`] (the task that owns the core and carries out its effects) and
//! [`socket`] (the gateways' HTTP API on a Unix socket).

pub mod core;
pub mod daemon;
pub mod journal;
pub mod socket;
