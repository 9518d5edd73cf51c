//! The one way a sandbox is torn down through containerd, shared by the
//! agent (`Sandboxes::delete`, cleanup after a failed create) and the
//! janitor (reaping orphans, finishing interrupted cleanups).
//!
//! Order: stop the task (resume it first if frozen), delete the task,
//! delete the container, unmount what is left below the task's bundle,
//! remove the writable snapshot, remove the per-sandbox log file.
//!
//! Every step tolerates "already gone", so a teardown interrupted anywhere
//! is finished by running it again. Known containerd facts handled here,
//! once:
//! - a task may be gone (or stopped) before it is signalled: NotFound and
//!   FailedPrecondition on Kill mean "exited already";
//! - once the container is deleted its snapshot is unreferenced and the
//!   GC may remove it first: NotFound on snapshot removal means done;
//! - `tasks.Wait` on a task that was created but never started can hang,
//!   so "stopped" after SIGKILL is learned by polling `tasks.Get`;
//! - a shim that died before the task was deleted leaves the rootfs
//!   mounted below the bundle; only mounts below the task's own bundle
//!   are ever touched.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use backon::Retryable;
use containerd_client::services::v1::{
    DeleteContainerRequest, DeleteTaskRequest, GetRequest, KillRequest, ResumeTaskRequest,
    WaitRequest,
};
use containerd_client::types::v1::Status as TaskStatus;
use futures::future::BoxFuture;
use tonic::Code;

use crate::containerd::Containerd;
use crate::retry;

/// How long a SIGKILLed task may take to be reported stopped.
pub const KILL_WAIT: Duration = Duration::from_secs(10);

/// How a running task is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGTERM to the init process, up to the grace period for it to exit,
    /// then SIGKILL to every process of the task.
    Graceful(Duration),
    /// SIGKILL to every process of the task at once.
    Immediate,
}

/// A finished step of a teardown, as handed to the [`Hook`]. Reported
/// whether or not there was anything left to remove.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// The task is stopped (or was gone or stopped already).
    TaskStopped,
    TaskDeleted,
    ContainerDeleted,
    BundleUnmounted,
    SnapshotRemoved,
    LogRemoved,
}

impl Step {
    pub fn name(self) -> &'static str {
        match self {
            Step::TaskStopped => "task-stopped",
            Step::TaskDeleted => "task-deleted",
            Step::ContainerDeleted => "container-deleted",
            Step::BundleUnmounted => "bundle-unmounted",
            Step::SnapshotRemoved => "snapshot-removed",
            Step::LogRemoved => "log-removed",
        }
    }
}

/// Called (and awaited) after every step with the sandbox id: a caller's
/// place to journal, count, or — in fault tests — stop dead.
pub type Hook = Arc<dyn Fn(&str, Step) -> BoxFuture<'static, ()> + Send + Sync>;

/// Which writable snapshot belongs to the sandbox: the container's
/// `snapshot_key`, which is not always the sandbox id (a cold create that
/// took a prepared snapshot uses its `sandbolt-prepared-<uuid>` key, see
/// [`crate::labels::PREPARED_KEY_PREFIX`]). Callers read it from the
/// container (or from what they recorded of it), never derive it from the id.
#[derive(Debug, Clone, Copy)]
pub struct SnapshotRef<'a> {
    pub snapshotter: &'a str,
    pub key: &'a str,
}

/// What a teardown found and removed (false/0: already gone).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Removed {
    pub task: bool,
    pub container: bool,
    pub mounts: usize,
    pub snapshot: bool,
    pub log: bool,
}

impl Removed {
    /// Whether any containerd object of the sandbox existed.
    pub fn anything(&self) -> bool {
        self.task || self.container || self.snapshot
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TeardownError {
    #[error("containerd {op}: {status}")]
    Containerd {
        op: &'static str,
        status: Box<tonic::Status>,
    },
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// The task did not stop in time after SIGKILL.
    #[error("task still running {after:?} after SIGKILL")]
    StillRunning { after: Duration },
    #[error("umount {mount}: {errno}")]
    Unmount {
        mount: String,
        errno: nix::errno::Errno,
    },
}

fn ctrd_err(op: &'static str) -> impl FnOnce(tonic::Status) -> TeardownError {
    move |status| TeardownError::Containerd {
        op,
        status: Box::new(status),
    }
}

/// The teardown routine, bound to one containerd connection (and so one
/// namespace) and the directory of the per-sandbox log files.
#[derive(Clone)]
pub struct Teardown {
    ctrd: Containerd,
    /// `<id>.log` files here are removed; `None` keeps them.
    logs_dir: Option<PathBuf>,
    hook: Option<Hook>,
}

impl Teardown {
    pub fn new(ctrd: Containerd, logs_dir: Option<PathBuf>) -> Self {
        Self {
            ctrd,
            logs_dir,
            hook: None,
        }
    }

    pub fn with_hook(mut self, hook: Hook) -> Self {
        self.hook = Some(hook);
        self
    }

    async fn done(&self, id: &str, step: Step) {
        if let Some(h) = &self.hook {
            h(id, step).await;
        }
    }

    /// Everything: [`Self::container`], then [`Self::remains`].
    pub async fn all(
        &self,
        id: &str,
        stop: Stop,
        snapshot: SnapshotRef<'_>,
    ) -> Result<Removed, TeardownError> {
        let mut removed = self.container(id, stop).await?;
        let rest = self.remains(id, snapshot).await?;
        removed.mounts = rest.mounts;
        removed.snapshot = rest.snapshot;
        removed.log = rest.log;
        Ok(removed)
    }

    /// Stops the task, deletes task and container.
    #[tracing::instrument(skip_all, fields(sandbox_id = %id))]
    pub async fn container(&self, id: &str, stop: Stop) -> Result<Removed, TeardownError> {
        let mut removed = Removed::default();
        let task = match self.ctrd.tasks().get(self.ctrd.req(get_req(id))).await {
            Ok(r) => r.into_inner().process,
            Err(s) if s.code() == Code::NotFound => None,
            Err(s) => return Err(ctrd_err("tasks.Get")(s)),
        };
        if let Some(task) = task {
            removed.task = true;
            let status = TaskStatus::try_from(task.status).unwrap_or(TaskStatus::Unknown);
            if matches!(status, TaskStatus::Paused | TaskStatus::Pausing) {
                // A frozen process acts on neither SIGTERM nor SIGKILL
                // until thawed.
                let _ = self
                    .ctrd
                    .tasks()
                    .resume(self.ctrd.req(ResumeTaskRequest {
                        container_id: id.to_string(),
                    }))
                    .await;
            }
            if status != TaskStatus::Stopped {
                self.stop(id, stop).await?;
            }
            self.done(id, Step::TaskStopped).await;
            match self
                .ctrd
                .tasks()
                .delete(self.ctrd.req(DeleteTaskRequest {
                    container_id: id.to_string(),
                }))
                .await
            {
                Ok(_) => {}
                Err(s) if s.code() == Code::NotFound => {}
                Err(s) => return Err(ctrd_err("tasks.Delete")(s)),
            }
        } else {
            self.done(id, Step::TaskStopped).await;
        }
        self.done(id, Step::TaskDeleted).await;
        match self
            .ctrd
            .containers()
            .delete(self.ctrd.req(DeleteContainerRequest { id: id.to_string() }))
            .await
        {
            Ok(_) => removed.container = true,
            Err(s) if s.code() == Code::NotFound => {}
            Err(s) => return Err(ctrd_err("containers.Delete")(s)),
        }
        self.done(id, Step::ContainerDeleted).await;
        Ok(removed)
    }

    /// What outlives the container: mounts below the task's bundle, the
    /// writable snapshot, the log file. Never a bind source: named volumes
    /// and host paths are only ever mounted inside the sandbox's own mount
    /// namespace.
    #[tracing::instrument(skip_all, fields(sandbox_id = %id))]
    pub async fn remains(
        &self,
        id: &str,
        snapshot: SnapshotRef<'_>,
    ) -> Result<Removed, TeardownError> {
        let mut removed = Removed {
            mounts: unmount_bundle(self.ctrd.namespace(), id)?,
            ..Removed::default()
        };
        self.done(id, Step::BundleUnmounted).await;
        // false: gone already (an earlier run, or containerd's GC collected
        // it once no container referenced it).
        removed.snapshot = self
            .ctrd
            .remove_snapshot(snapshot.snapshotter, snapshot.key)
            .await
            .map_err(ctrd_err("snapshots.Remove"))?;
        self.done(id, Step::SnapshotRemoved).await;
        if let Some(dir) = &self.logs_dir {
            // The agent's rotated file (`<id>.log.1`) first, the log last:
            // a rerun after a failure here still finds the log to remove.
            let rotated = dir.join(format!("{id}.log.1"));
            if let Err(e) = std::fs::remove_file(&rotated)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %rotated.display(), error = %e, "removing a rotated log failed");
            }
            let log = dir.join(format!("{id}.log"));
            match std::fs::remove_file(&log) {
                Ok(()) => removed.log = true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(TeardownError::Io {
                        what: "removing",
                        path: log,
                        source,
                    });
                }
            }
        }
        self.done(id, Step::LogRemoved).await;
        Ok(removed)
    }

    async fn kill(&self, id: &str, signal: i32, all: bool) -> Result<(), TeardownError> {
        match self
            .ctrd
            .tasks()
            .kill(self.ctrd.req(KillRequest {
                container_id: id.to_string(),
                exec_id: String::new(),
                signal: signal as u32,
                all,
            }))
            .await
        {
            Ok(_) => Ok(()),
            // Already exited between Get and Kill.
            Err(s) if matches!(s.code(), Code::NotFound | Code::FailedPrecondition) => Ok(()),
            Err(s) => Err(ctrd_err("tasks.Kill")(s)),
        }
    }

    async fn stop(&self, id: &str, stop: Stop) -> Result<(), TeardownError> {
        if let Stop::Graceful(grace) = stop {
            // Register the wait before signalling, so a fast exit is not
            // missed.
            let waiter = {
                let mut tasks = self.ctrd.tasks();
                let req = self.ctrd.req(WaitRequest {
                    container_id: id.to_string(),
                    exec_id: String::new(),
                });
                tokio::spawn(async move { tasks.wait(req).await })
            };
            self.kill(id, libc::SIGTERM, false).await?;
            match tokio::time::timeout(grace, waiter).await {
                Ok(_) => return Ok(()),
                Err(_) => {
                    tracing::info!(sandbox = %id, ?grace, "grace period over; SIGKILL");
                }
            }
        }
        self.kill(id, libc::SIGKILL, true).await?;
        self.wait_stopped(id).await
    }

    /// Polls `tasks.Get` (5 ms doubling to 100 ms) until the task is
    /// stopped or gone.
    async fn wait_stopped(&self, id: &str) -> Result<(), TeardownError> {
        let give_up = tokio::time::Instant::now() + KILL_WAIT;
        let poll = || async {
            match self.ctrd.tasks().get(self.ctrd.req(get_req(id))).await {
                Ok(r) => {
                    let status = r
                        .into_inner()
                        .process
                        .map(|p| p.status)
                        .unwrap_or(TaskStatus::Stopped as i32);
                    if status == TaskStatus::Stopped as i32 {
                        Ok(())
                    } else {
                        Err(NotStopped::Running)
                    }
                }
                Err(s) if s.code() == Code::NotFound => Ok(()),
                Err(s) => Err(NotStopped::Failed(ctrd_err("tasks.Get")(s))),
            }
        };
        poll.retry(retry::doubling(
            Duration::from_millis(5),
            Duration::from_millis(100),
        ))
        .when(|e| matches!(e, NotStopped::Running))
        .adjust(retry::until(give_up))
        .await
        .map_err(|e| match e {
            NotStopped::Running => TeardownError::StillRunning { after: KILL_WAIT },
            NotStopped::Failed(e) => e,
        })
    }
}

/// Why a poll of a SIGKILLed task did not end the wait.
enum NotStopped {
    /// Not stopped yet: poll again.
    Running,
    Failed(TeardownError),
}

fn get_req(id: &str) -> GetRequest {
    GetRequest {
        container_id: id.to_string(),
        exec_id: String::new(),
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
/// first leaves it mounted. Only mounts below the task's bundle are
/// touched. Returns how many were unmounted.
fn unmount_bundle(namespace: &str, id: &str) -> Result<usize, TeardownError> {
    const MOUNTINFO: &str = "/proc/self/mountinfo";
    let info = std::fs::read_to_string(MOUNTINFO).map_err(|source| TeardownError::Io {
        what: "reading",
        path: MOUNTINFO.into(),
        source,
    })?;
    let mut n = 0;
    for m in bundle_mounts(&info, namespace, id) {
        match nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH) {
            Ok(()) => {
                tracing::info!(sandbox = %id, mount = %m, "unmounted a leftover mount");
                n += 1;
            }
            Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => {}
            Err(errno) => return Err(TeardownError::Unmount { mount: m, errno }),
        }
    }
    Ok(n)
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
    fn only_containerd_objects_count_as_existing() {
        assert!(!Removed::default().anything());
        let log_only = Removed {
            log: true,
            mounts: 1,
            ..Removed::default()
        };
        assert!(!log_only.anything());
        for r in [
            Removed {
                task: true,
                ..Removed::default()
            },
            Removed {
                container: true,
                ..Removed::default()
            },
            Removed {
                snapshot: true,
                ..Removed::default()
            },
        ] {
            assert!(r.anything(), "{r:?}");
        }
    }
}
