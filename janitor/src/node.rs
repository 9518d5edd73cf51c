//! What lives on this node, and how it is removed: containerd containers,
//! tasks and snapshots, the agent's per-sandbox log files, and mounts left
//! below a task's bundle. Every removal tolerates "already gone", so a
//! cleanup interrupted anywhere is finished by running it again.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_client::services::v1::snapshots::Info as SnapshotInfo;
use containerd_client::services::v1::{Container, GetContainerRequest, ListContainersRequest};
use futures::FutureExt;
use sandbolt_node::containerd::Containerd;
use sandbolt_node::teardown::{Hook, SnapshotRef, Step, Stop, Teardown, TeardownError};
use tonic::Code;

use crate::config::{Failpoint, JanitorConfig};
use crate::error::{JanitorError, Result};
use crate::journal::safe_id;

/// What [`Node::remove_snapshot`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotRemoval {
    Removed,
    /// Already gone (another remover, containerd's GC).
    Gone,
    /// containerd refused: snapshots are built on it (sandboxes restored
    /// from a sandbox snapshot).
    HasChildren,
}

pub struct Node {
    ctrd: Containerd,
    snapshotter: String,
    logs_dir: Option<PathBuf>,
    keep_logs: bool,
    /// Task, container, mount, snapshot and log removal, shared with the
    /// agent; stops tasks with SIGKILL at once.
    teardown: Teardown,
}

pub fn ts_ms(t: &Option<prost_types::Timestamp>) -> Option<i64> {
    t.as_ref()
        .filter(|t| t.seconds > 0)
        .map(|t| t.seconds * 1000 + i64::from(t.nanos) / 1_000_000)
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

impl Node {
    pub async fn connect(cfg: &JanitorConfig) -> Result<Self> {
        let ctrd = Containerd::connect(
            &cfg.containerd_socket,
            &cfg.containerd_namespace,
            Duration::from_secs(30),
        )
        .await
        .map_err(|e| JanitorError::Connect(e.to_string()))?;
        let logs_dir = cfg.logs_dir();
        let mut teardown = Teardown::new(ctrd.clone(), logs_dir.clone().filter(|_| !cfg.keep_logs));
        if let Some(hook) = failpoint_hook(cfg.failpoint) {
            teardown = teardown.with_hook(hook);
        }
        Ok(Self {
            ctrd,
            snapshotter: cfg.snapshotter.clone(),
            logs_dir,
            keep_logs: cfg.keep_logs,
            teardown,
        })
    }

    pub fn snapshotter(&self) -> &str {
        &self.snapshotter
    }

    /// Every container of the namespace (managed or not: a snapshot another
    /// container references is never a leftover).
    pub async fn containers(&self) -> Result<Vec<Container>> {
        Ok(self
            .ctrd
            .containers()
            .list(self.ctrd.req(ListContainersRequest { filters: vec![] }))
            .await
            .map_err(JanitorError::containerd("containers.List"))?
            .into_inner()
            .containers)
    }

    /// One container, `None` when it is gone.
    pub async fn container(&self, id: &str) -> Result<Option<Container>> {
        match self
            .ctrd
            .containers()
            .get(self.ctrd.req(GetContainerRequest { id: id.into() }))
            .await
        {
            Ok(r) => Ok(r.into_inner().container),
            Err(s) if s.code() == Code::NotFound => Ok(None),
            Err(s) => Err(JanitorError::containerd("containers.Get")(s)),
        }
    }

    /// Every snapshot of the agent's snapshotter, active and committed (one
    /// listing serves the leftover, scratch and sandbox-snapshot rules).
    pub async fn snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        self.ctrd
            .list_snapshots(&self.snapshotter, vec![])
            .await
            .map_err(JanitorError::containerd("snapshots.List"))
    }

    /// Removes one snapshot of the agent's snapshotter by name.
    pub async fn remove_snapshot(&self, name: &str) -> Result<SnapshotRemoval> {
        match self.ctrd.remove_snapshot(&self.snapshotter, name).await {
            Ok(true) => Ok(SnapshotRemoval::Removed),
            Ok(false) => Ok(SnapshotRemoval::Gone),
            Err(s) if s.code() == Code::FailedPrecondition => Ok(SnapshotRemoval::HasChildren),
            Err(s) => Err(JanitorError::containerd("snapshots.Remove")(s)),
        }
    }

    /// `<id>.log` files in the agent's log dir → last modification (unix ms).
    /// Empty when log cleanup is off.
    pub fn log_files(&self) -> Result<HashMap<String, i64>> {
        let mut out = HashMap::new();
        let Some(dir) = self.logs_dir.as_ref().filter(|_| !self.keep_logs) else {
            return Ok(out);
        };
        let rd = match std::fs::read_dir(dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(JanitorError::io("reading", dir)(e)),
        };
        for ent in rd.flatten() {
            let name = ent.file_name();
            let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".log")) else {
                continue;
            };
            if !safe_id(id) || !ent.file_type().is_ok_and(|t| t.is_file()) {
                continue;
            }
            let mtime = ent
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map(|d| d.as_millis() as i64)
                .unwrap_or(i64::MAX);
            out.insert(id.to_string(), mtime);
        }
        Ok(out)
    }

    /// SIGKILL the task, delete task and container. Tolerates every part
    /// being gone already.
    pub async fn remove_container(&self, id: &str) -> Result<()> {
        self.teardown
            .container(id, Stop::Immediate)
            .await
            .map_err(|e| cleanup_error(id, e))?;
        Ok(())
    }

    /// The sandbox's writable snapshot, its log file and any mount left
    /// below its task bundle. Never a bind source: named volumes and host
    /// paths are only ever mounted inside the sandbox's own mount namespace.
    pub async fn remove_remains(
        &self,
        id: &str,
        snapshotter: &str,
        snapshot_key: &str,
    ) -> Result<()> {
        self.teardown
            .remains(
                id,
                SnapshotRef {
                    snapshotter,
                    key: snapshot_key,
                },
            )
            .await
            .map_err(|e| cleanup_error(id, e))?;
        Ok(())
    }
}

/// The janitor's errors for a failed teardown step, as they were before
/// the teardown was shared with the agent.
fn cleanup_error(id: &str, e: TeardownError) -> JanitorError {
    match e {
        TeardownError::Containerd { op, status } => JanitorError::Containerd { op, status },
        TeardownError::Io { what, path, source } => JanitorError::Io { what, path, source },
        e @ (TeardownError::StillRunning { .. } | TeardownError::Unmount { .. }) => {
            JanitorError::Cleanup {
                sandbox_id: id.into(),
                reason: e.to_string(),
            }
        }
    }
}

/// The teardown's per-step hook: the failpoint a fault test `kill -9`s the
/// janitor at.
fn failpoint_hook(failpoint: Option<Failpoint>) -> Option<Hook> {
    let fp = failpoint?;
    Some(Arc::new(move |_id: &str, step: Step| {
        let reached = match fp {
            Failpoint::AfterContainerDelete => step == Step::ContainerDeleted,
        };
        async move {
            if reached {
                eprintln!("SANDBOLT_JANITOR_FAILPOINT_REACHED {}", fp.name());
                std::future::pending::<()>().await;
            }
        }
        .boxed()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_before_the_epoch_are_no_age() {
        assert_eq!(ts_ms(&None), None);
        assert_eq!(
            ts_ms(&Some(prost_types::Timestamp {
                seconds: 0,
                nanos: 0
            })),
            None
        );
        assert_eq!(
            ts_ms(&Some(prost_types::Timestamp {
                seconds: 2,
                nanos: 5_000_000
            })),
            Some(2005)
        );
    }
}
