//! The parts of the `reservoir` binary that its process tests, the demo
//! and the benchmark share: [`cluster`] starts real central and agent
//! processes on temporary directories and talks to them; [`postgres`]
//! makes a throwaway database on a PostgreSQL server.

pub mod cluster;
pub mod postgres;
