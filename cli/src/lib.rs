//! The parts of the `reservoir` binary that its process tests share.

pub mod cluster;
