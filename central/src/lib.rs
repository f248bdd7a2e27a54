//! Reservoir's central ledger service: the one place that spends capacity,
//! as an HTTP service (docs/design.md §6.3) over [`ledger::CentralLedger`].
//!
//! The service is a thin shell. Every decision is the ledger's; the shell
//! only
//!
//! 1. parses and authenticates input ([`http`](crate::http): strict bodies,
//!    operator bearer tokens, RFC 9421 signatures of agent calls),
//! 2. feeds each [`Operation`] with `now` from the [`Clock`] to the single
//!    [`writer`], which group-commits the transitions' changes through a
//!    store **before** any reply is released,
//! 3. maps the outcome enums to statuses, headers and JSON bodies,
//! 4. runs the workers (expiry, usage deadlines, refill) as operations too.
//!
//! Stores ([`store`]): redb (embedded, default) and PostgreSQL (many
//! replicas over one database, per-pair row locks). Start a service with
//! [`Service::start`]; `reservoir bench` measures it.

mod clock;
mod http;
mod keys;
mod metrics;
pub mod openapi;
mod service;
pub mod store;
mod writer;

pub use clock::{Clock, ManualClock, SystemClock};
pub use http::BODY_SIZE_MAX;
pub use ledger::protocol::{Gauges, Operation, Reply};
pub use metrics::Metrics;
pub use service::{
    DataDir, DataDirError, KEY_FILE, LEDGER_FILE, OPERATOR_TOKEN_FILE, Service, ServiceConfig,
    StartError, StoreConfig, WorkerIntervals,
};
pub use store::SharedMemoryStore;
pub use writer::{BATCH_SIZE_MAX, LedgerHandle, QUEUE_DEPTH_MAX, Unavailable};
