//! sandbolt janitor: reaps every orphaned sandbox on its node, never a live
//! one.
//!
//! It runs beside the agent, independent of it (a dead agent still gets
//! cleaned up after), lists the containers carrying sandbolt's managed
//! label, asks the ownership source (the controller) who owns them, applies
//! the [`rules`], re-asks immediately before each delete (fencing), and
//! removes task, container, snapshot, log file and leftover mounts. It also
//! finishes sandboxes that were removed half-way (a snapshot or log file
//! whose container is gone), and its own interrupted cleanups ([`journal`]).
//! When the ownership source cannot be asked, it reaps nothing. A silent
//! agent is no reason to reap: the controller decides when its sandboxes
//! are lost and says so in their records. On Kubernetes the janitor can
//! also read the agent pods of its node ([`AgentPods`]): a container left
//! behind by an agent pod that is gone goes as soon as the controller is
//! recreating its sandbox elsewhere (see [`rules`]). Snapshots that are no
//! sandbox's writable layer go too: committed sandbox snapshots no snapshot
//! record names, and the scratch snapshots (prepared, mid-capture) of agent
//! processes that are gone.
//!
//! ```no_run
//! # async fn f() -> Result<(), sandbolt_janitor::JanitorError> {
//! use sandbolt_janitor::{Janitor, JanitorConfig};
//! let cfg = JanitorConfig::new("node-1", "/run/containerd/containerd.sock", "http://127.0.0.1:9090", "agent-token", "/var/lib/sandbolt/janitor");
//! let handle = Janitor::start(cfg).await?;
//! let report = handle.janitor().scan_once().await?;
//! println!("{} reaped", report.reaped.len());
//! handle.shutdown().await;
//! # Ok(()) }
//! ```

pub mod agent_pods;
pub mod config;
pub mod error;
pub mod journal;
pub mod metrics;
pub mod node;
pub mod ownership;
mod readiness;
pub mod rules;
mod run;
mod scan;

pub use agent_pods::AgentPods;
pub use config::{FAILPOINT_ENV, Failpoint, JanitorConfig};
pub use error::{JanitorError, Result};
pub use metrics::Metrics;
pub use ownership::{ControllerOwnership, OwnershipSource, ReapNotice};
pub use rules::{KeepReason, ReapReason, SnapshotKeepReason, SnapshotReapReason, Verdict};
pub use run::JanitorHandle;
pub use scan::{Janitor, Kept, KeptSnapshot, Reaped, ReapedSnapshot, ScanReport};
