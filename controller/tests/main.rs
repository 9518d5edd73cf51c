//! All of this crate's integration tests, one module per file, built as one
//! test binary: one link instead of one per file keeps the test build's disk
//! and link time in bounds (nextest still runs every test in its own process).

mod support;

mod agent_tls;
mod fastpath_listeners;
mod fastpath_v2_restore;
mod identity;
mod kube_expiry_tombstones;
mod kube_fastpath_identity;
mod kube_snapshots;
mod kube_store;
mod kube_templates;
mod kube_warm_pools;
mod leader_election;
mod metrics;
mod prop_volume_spec;
mod secrets;
mod snapshot_restore;
mod snapshots;
mod standin_logic;
mod store_indexes;
mod tls;
mod unreachable_agents;
mod volumes;
mod volumes_real_agents;
mod warm_pools;
