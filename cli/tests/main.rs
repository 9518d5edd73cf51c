//! All of this crate's integration tests, one module per file, built as one
//! test binary: one link instead of one per file keeps the test build's disk
//! and link time in bounds (nextest still runs every test in its own process).

mod common;

mod agent_outage;
mod execd_static;
mod image_import;
mod janitor_faults;
mod people_cli;
mod readme_quickstart;
mod up_e2e;
mod up_tls;
