//! Reservoir's agent: the sidecar next to each gateway.
//!
//! Every decision lives in the `agent-core` crate ([`agent_core::AgentCore`],
//! no I/O). This crate is the thin daemon shell around it: [`journal`] (the
//! redb journal), [`daemon`] (the task that owns the core and carries out its
//! effects) and [`socket`] (the gateways' HTTP API on a Unix socket).

pub mod daemon;
pub mod journal;
pub mod openapi;
pub mod socket;
