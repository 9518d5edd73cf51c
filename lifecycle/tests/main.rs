//! All of this crate's integration tests, one module per file, built as one
//! test binary: one link instead of one per file keeps the test build's disk
//! and link time in bounds (nextest still runs every test in its own process).

mod common;

mod controller_pools;
mod controller_sdk;
mod controller_snapshots;
mod controller_stateless;
mod controller_tls;
mod controller_volumes;
mod diagnostics;
mod docker_egress;
mod docker_http;
mod docker_in_container;
mod docker_isolation;
mod docker_limits;
mod docker_pvc_labels;
mod docker_sdk;
mod docker_snapshots;
mod docker_tokens;
mod docker_volumes;
mod gateway;
mod observability;
mod prop_query;
mod prop_volumes;
mod schemathesis;
mod secret_env;
