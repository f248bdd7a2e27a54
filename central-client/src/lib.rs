//! The typed client of Reservoir's central ledger API (docs/design.md §6.3),
//! as the agent and the operator tools use it.
//!
//! - [`CentralClient`]: one async call per endpoint, each with a deadline
//!   ([`ClientConfig::call_timeout`]). Calls that are idempotent under their
//!   IDs are retried ([`RetryPolicy`]) with the very same body, so a
//!   reservation is only ever retried under its original ID.
//! - [`CallError`]: a definite refusal ([`CallError::Rejected`], nothing
//!   changed) is kept apart from [`CallError::OutcomeUnknown`] (the call may
//!   have taken effect), which is when an agent holds a reservation as
//!   `RESERVATION_UNKNOWN`.
//! - [`http_signature`]: how agent calls are signed with the identity key
//!   (a minimal RFC 9421 profile), shared with the service that verifies.
//! - [`wire`]: the API's JSON bodies; [`key_file`]: the ed25519 key files.

mod client;
mod error;
pub mod http_signature;
pub mod key_file;
pub mod wire;

pub use client::{
    AgentCall, BuildError, CentralClient, ClientConfig, ReleaseReply, ReserveReply, RetryPolicy,
    SettleReply, ShardReply, StartReply,
};
pub use error::{ApiError, CallError};
