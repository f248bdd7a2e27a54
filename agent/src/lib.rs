//! Reservoir's agent: the sidecar next to each gateway.
//!
//! [`core`] is the agent's decision core: every decision, no I/O. The
//! daemon shell around it comes with its own issue.

pub mod core;
