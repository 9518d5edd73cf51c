//! What lives on this node, and how it is removed: containerd containers,
//! tasks and snapshots, the agent's per-sandbox log files, and mounts left
//! below a task's bundle. Every removal tolerates "already gone", so a
//! cleanup interrupted anywhere is finished by running it again.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_client::services::v1::snapshots::{
    Info as SnapshotInfo, Kind, ListSnapshotsRequest, RemoveSnapshotRequest,
};
use containerd_client::services::v1::{
    Container, DeleteContainerRequest, DeleteTaskRequest, GetContainerRequest, GetRequest,
    KillRequest, ListContainersRequest, ResumeTaskRequest,
};
use containerd_client::types::v1::Status as TaskStatus;
use futures::StreamExt;
use sandbolt_agent::containerd::Containerd;
use tonic::Code;

use crate::config::{Failpoint, JanitorConfig};
use crate::error::{JanitorError, Result};
use crate::journal::safe_id;

/// How long a SIGKILLed task may take to be reported stopped.
const KILL_WAIT: Duration = Duration::from_secs(10);

pub struct Node {
    ctrd: Containerd,
    snapshotter: String,
    logs_dir: Option<PathBuf>,
    keep_logs: bool,
    failpoint: Option<Failpoint>,
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
        Ok(Self {
            ctrd,
            snapshotter: cfg.snapshotter.clone(),
            logs_dir: cfg.logs_dir(),
            keep_logs: cfg.keep_logs,
            failpoint: cfg.failpoint,
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

    /// Active (writable) snapshots of the agent's snapshotter.
    pub async fn active_snapshots(&self) -> Result<Vec<SnapshotInfo>> {
        let mut stream = self
            .ctrd
            .snapshots()
            .list(self.ctrd.req(ListSnapshotsRequest {
                snapshotter: self.snapshotter.clone(),
                filters: vec![],
            }))
            .await
            .map_err(JanitorError::containerd("snapshots.List"))?
            .into_inner();
        let mut out = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(JanitorError::containerd("snapshots.List"))?;
            out.extend(
                chunk
                    .info
                    .into_iter()
                    .filter(|i| i.kind == Kind::Active as i32),
            );
        }
        Ok(out)
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
        let task = match self
            .ctrd
            .tasks()
            .get(self.ctrd.req(GetRequest {
                container_id: id.into(),
                exec_id: String::new(),
            }))
            .await
        {
            Ok(r) => r.into_inner().process,
            Err(s) if s.code() == Code::NotFound => None,
            Err(s) => return Err(JanitorError::containerd("tasks.Get")(s)),
        };
        if let Some(task) = task {
            let status = TaskStatus::try_from(task.status).unwrap_or(TaskStatus::Unknown);
            if matches!(status, TaskStatus::Paused | TaskStatus::Pausing) {
                // A frozen process does not die of SIGKILL until thawed.
                let _ = self
                    .ctrd
                    .tasks()
                    .resume(self.ctrd.req(ResumeTaskRequest {
                        container_id: id.into(),
                    }))
                    .await;
            }
            if status != TaskStatus::Stopped {
                self.kill_and_wait(id).await?;
            }
            match self
                .ctrd
                .tasks()
                .delete(self.ctrd.req(DeleteTaskRequest {
                    container_id: id.into(),
                }))
                .await
            {
                Ok(_) => {}
                Err(s) if s.code() == Code::NotFound => {}
                Err(s) => return Err(JanitorError::containerd("tasks.Delete")(s)),
            }
        }
        match self
            .ctrd
            .containers()
            .delete(self.ctrd.req(DeleteContainerRequest { id: id.into() }))
            .await
        {
            Ok(_) => {}
            Err(s) if s.code() == Code::NotFound => {}
            Err(s) => return Err(JanitorError::containerd("containers.Delete")(s)),
        }
        if self.failpoint == Some(Failpoint::AfterContainerDelete) {
            eprintln!(
                "SANDBOLT_JANITOR_FAILPOINT_REACHED {}",
                Failpoint::AfterContainerDelete.name()
            );
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    async fn kill_and_wait(&self, id: &str) -> Result<()> {
        match self
            .ctrd
            .tasks()
            .kill(self.ctrd.req(KillRequest {
                container_id: id.into(),
                exec_id: String::new(),
                signal: libc::SIGKILL as u32,
                all: true,
            }))
            .await
        {
            Ok(_) => {}
            Err(s) if matches!(s.code(), Code::NotFound | Code::FailedPrecondition) => {}
            Err(s) => return Err(JanitorError::containerd("tasks.Kill")(s)),
        }
        // Polling Get rather than Wait: Wait on a task that never started
        // (an agent killed between tasks.Create and tasks.Start) can hang.
        let deadline = tokio::time::Instant::now() + KILL_WAIT;
        let mut delay = Duration::from_millis(5);
        loop {
            match self
                .ctrd
                .tasks()
                .get(self.ctrd.req(GetRequest {
                    container_id: id.into(),
                    exec_id: String::new(),
                }))
                .await
            {
                Ok(r) => {
                    let st = r
                        .into_inner()
                        .process
                        .map(|p| p.status)
                        .unwrap_or(TaskStatus::Stopped as i32);
                    if st == TaskStatus::Stopped as i32 {
                        return Ok(());
                    }
                }
                Err(s) if s.code() == Code::NotFound => return Ok(()),
                Err(s) => return Err(JanitorError::containerd("tasks.Get")(s)),
            }
            if tokio::time::Instant::now() + delay > deadline {
                return Err(JanitorError::Cleanup {
                    sandbox_id: id.into(),
                    reason: format!("task still running {KILL_WAIT:?} after SIGKILL"),
                });
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(100));
        }
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
        unmount_bundle(self.ctrd.namespace(), id)?;
        match self
            .ctrd
            .snapshots()
            .remove(self.ctrd.req(RemoveSnapshotRequest {
                snapshotter: snapshotter.into(),
                key: snapshot_key.into(),
            }))
            .await
        {
            Ok(_) => {}
            Err(s) if s.code() == Code::NotFound => {}
            Err(s) => return Err(JanitorError::containerd("snapshots.Remove")(s)),
        }
        if let Some(dir) = self.logs_dir.as_ref().filter(|_| !self.keep_logs) {
            remove_file(&dir.join(format!("{id}.log")))?;
        }
        Ok(())
    }
}

fn remove_file(p: &Path) -> Result<()> {
    match std::fs::remove_file(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(JanitorError::io("removing", p)(e)),
    }
}

/// Mount points below `<containerd state>/io.containerd.runtime.v2.task/<ns>/<id>/`
/// (the rootfs the shim mounts), deepest first.
pub fn bundle_mounts(mountinfo: &str, namespace: &str, id: &str) -> Vec<String> {
    let marker = format!("/io.containerd.runtime.v2.task/{namespace}/{id}/");
    let mut out: Vec<String> = mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mountinfo)
        .filter(|p| p.contains(&marker))
        .collect();
    out.sort_by_key(|p| std::cmp::Reverse(p.len()));
    out.dedup();
    out
}

fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The shim unmounts the rootfs when the task is deleted; a shim that died
/// first leaves it mounted. Only mounts below the task's bundle are touched.
fn unmount_bundle(namespace: &str, id: &str) -> Result<()> {
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(JanitorError::io("reading", "/proc/self/mountinfo"))?;
    for m in bundle_mounts(&info, namespace, id) {
        match nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH) {
            Ok(()) => tracing::info!(sandbox = %id, mount = %m, "unmounted a leftover mount"),
            Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => {}
            Err(e) => {
                return Err(JanitorError::Cleanup {
                    sandbox_id: id.into(),
                    reason: format!("umount {m}: {e}"),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_mounts_below_the_sandboxes_bundle_are_found() {
        let info = "\
36 35 0:31 / /run/c/state/io.containerd.runtime.v2.task/k8s.io/sb-1/rootfs rw - overlay overlay rw
37 35 0:32 / /run/c/state/io.containerd.runtime.v2.task/k8s.io/sb-10/rootfs rw - overlay overlay rw
38 35 0:33 / /run/c/state/io.containerd.runtime.v2.task/other/sb-1/rootfs rw - overlay overlay rw
39 35 0:34 / /var/lib/sandbolt/volumes/sb-1 rw - ext4 /dev/sda rw
40 36 0:35 / /run/c/state/io.containerd.runtime.v2.task/k8s.io/sb-1/rootfs/with\\040space rw - tmpfs t rw
";
        assert_eq!(
            bundle_mounts(info, "k8s.io", "sb-1"),
            vec![
                "/run/c/state/io.containerd.runtime.v2.task/k8s.io/sb-1/rootfs/with space"
                    .to_string(),
                "/run/c/state/io.containerd.runtime.v2.task/k8s.io/sb-1/rootfs".to_string(),
            ]
        );
    }

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
