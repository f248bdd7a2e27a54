//! Real Reservoir processes on temporary directories: a central service
//! and agents, spawned from the `reservoir` binary. The demo, the benchmark
//! and the process tests drive them.
