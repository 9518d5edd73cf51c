//! All of this crate's integration tests, one module per file, built as one
//! test binary: one link instead of one per file keeps the test build's disk
//! and link time in bounds (nextest still runs every test in its own process).

mod controller_tls;
mod identity_reports;
mod metrics;
mod sandbox_snapshots;
