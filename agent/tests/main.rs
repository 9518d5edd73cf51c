//! All of this crate's integration tests, one module per file, built as one
//! test binary: one link instead of one per file keeps the test build's disk
//! and link time in bounds (nextest still runs every test in its own process).

mod common;

mod dns_proxy;
mod edge_e2e;
mod edge_proxy;
mod growth;
mod gvisor;
mod images_execd;
mod juicefs_volumes;
mod live_mount;
mod metrics;
mod named_volumes;
mod network;
mod pid_reuse;
mod pod_uid;
mod prepared_snapshots;
mod prop_host_volumes;
mod reconnect_heartbeat;
mod runtime_check;
mod sandbox_lifecycle;
mod snapshots;
mod userns;
mod volume_race;
mod volume_store;
mod warm_images;
mod warm_pool;
