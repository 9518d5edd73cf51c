//! sandbolt node agent: turns placements into running sandboxes directly over
//! the containerd socket, and owns everything else on its node (images,
//! host-path volumes, the data-plane proxy).
//!
//! Entry point: [`Agent::start`] with an [`AgentConfig`]; it serves
//! `sandbolt.agent.v1.AgentService` (bearer token) and the data-plane proxy,
//! and pushes heartbeats to the controller when one is configured.

pub mod agent;
pub mod config;
pub mod error;
pub mod events;
pub mod gvisor;
pub mod hardening;
pub mod heartbeat;
pub mod juicefs_mount;
pub mod live_mount;
pub mod log_rotation;
pub mod logs;
pub mod metrics;
pub mod netns;
pub mod network;
mod openat2;
pub mod prepared;
pub mod proxy;
pub mod runtime;
pub mod runtime_check;
pub mod sandbox;
pub mod server;
pub mod snapshot;
pub mod spec;
pub mod storage_limit;
pub mod tree_copy;
pub mod userns;
pub mod volume_mounts;
pub mod volume_store;
pub mod volumes;
pub mod warm;
pub mod warm_pool;

// Node-level pieces live in `sandbolt-node` (the janitor and the CLI use
// them without the agent); re-exported under their old paths.
pub use sandbolt_node::{containerd, images, labels, teardown};

pub use agent::{Agent, AgentHandle};
pub use config::AgentConfig;
pub use error::{AgentError, Result};
