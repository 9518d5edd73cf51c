//! All of this crate's integration tests, one module per file, built as one
//! test binary: one link instead of one per file keeps the test build's disk
//! and link time in bounds (nextest still runs every test in its own process).

mod support;

mod architecture_doc;
mod controller_ha_failover;
mod controller_kill_9_restart;
mod egress_end_to_end;
mod ephemeral_storage;
mod fastpath_end_to_end;
mod gone_agent_pod_recreate;
mod grpc_health;
mod gvisor_sdk;
mod janitor_reaps_gone_agent_pods;
mod juicefs_shared_volumes;
mod lost_agent_failure_policy;
mod metrics_scrape;
mod opensandbox_server_rig;
mod pool_limits_on_every_api;
mod python_fastpath_contract;
mod request_id_logs;
mod slowloris;
mod snapshots_agent_kill_9;
mod snapshots_sdk;
mod volumes_agent_kill_9;
mod volumes_end_to_end;
mod warm_pools_agent_kill_9;
mod warm_pools_isolation;
mod warm_pools_sdk;
mod wire_constants;
