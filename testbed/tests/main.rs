//! All of this crate's integration tests, one module per file, built as one
//! test binary: one link instead of one per file keeps the test build's disk
//! and link time in bounds (nextest still runs every test in its own process).

mod containerd_run;
mod docker_run;
mod juicefs_bed;
mod listing;
mod local_registry;
