//! Sandbox snapshots: a sandbox's writable layer (its filesystem changes
//! over the image) committed as the containerd snapshot
//! `sandbolt-snapshot-<id>` ([`labels::SNAPSHOT_NAME_PREFIX`]) on top of the
//! image's top layer, plus a volume snapshot `sbs-<id>` of every named
//! volume the sandbox mounts read-write, all taken in one freeze. A sandbox
//! restored from it (`SandboxSpec.snapshot_id`) gets a writable layer whose
//! parent is the committed snapshot: overlayfs shares it copy-on-write, so
//! any number of restores cost no copy and stay independent.
//!
//! A capture (under the sandbox's lock, see `Sandboxes::create_snapshot`):
//! 1. prepare the in-progress key `sandbolt-snapshotting-<id>`
//!    ([`labels::SNAPSHOTTING_KEY_PREFIX`]) on the source's parent;
//! 2. a running sandbox is labelled [`labels::FROZEN_FOR_SNAPSHOT`] and
//!    paused (a paused one is left as it is, and stays paused);
//! 3. the volume snapshots are taken, and the source's overlay upperdir is
//!    copied into the new key's by [`crate::tree_copy`] (owners, modes,
//!    xattrs with the overlay's own, whiteouts, hard links, times; file data
//!    cloned where the filesystem can);
//! 4. the sandbox is resumed at once and the label dropped;
//! 5. the key is committed as `sandbolt-snapshot-<id>` with labels saying
//!    what it is ([`labels::SNAPSHOT`], [`labels::AGENT_ID`],
//!    [`labels::IMAGE`], the source's identity, [`labels::SNAPSHOT_VOLUMES`],
//!    the timings, `containerd.io/gc.root`).
//!
//! Any failure thaws the sandbox and removes what the capture made: there
//! is never a half snapshot. A capture that dies with its agent process
//! leaves at most the in-progress key, a frozen container (labelled) and
//! volume snapshots without a committed snapshot: the next agent removes
//! and thaws them at start ([`Snapshots::recover`],
//! [`thaw_after_dead_capture`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::Retryable;
use containerd_client::services::v1::snapshots::{CommitSnapshotRequest, Info, Kind, UsageRequest};
use containerd_client::services::v1::{
    GetContainerRequest, GetRequest, PauseTaskRequest, ResumeTaskRequest,
};
use containerd_client::types::Mount;
use containerd_client::types::v1::Status as TaskStatus;
use parking_lot::RwLock;
use sandbolt_image_ref::normalize;
use sandbolt_proto::agent::v1::{NamedVolumeMount, SnapshotInfo, SnapshotVolume};
use serde::{Deserialize, Serialize};
use tonic::Code;

use crate::containerd::Containerd;
use crate::error::{AgentError, Result};
use crate::labels;
use crate::sandbox::now_ms;
use crate::volume_mounts::{LabelMount, MAX_LABEL_BYTES, VolumeMounts};

/// Name prefix of the volume snapshots a capture takes (`sbs-<id>`).
pub const VOLUME_SNAPSHOT_PREFIX: &str = "sbs-";

/// The committed snapshot's name for snapshot `id`.
pub fn committed_name(id: &str) -> String {
    format!("{}{id}", labels::SNAPSHOT_NAME_PREFIX)
}

/// The in-progress key of a capture of snapshot `id`.
fn in_progress_key(id: &str) -> String {
    format!("{}{id}", labels::SNAPSHOTTING_KEY_PREFIX)
}

/// The volume snapshot a capture of snapshot `id` takes of each volume.
pub fn volume_snapshot_name(id: &str) -> String {
    format!("{VOLUME_SNAPSHOT_PREFIX}{id}")
}

/// Snapshot ids are chosen by the controller: a DNS label (lowercase
/// alphanumerics and '-', at most 63, alphanumeric at both ends), safe in
/// snapshot keys, labels and volume snapshot names.
pub fn validate_id(id: &str) -> Result<()> {
    let b = id.as_bytes();
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let ok = !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| alnum(c) || *c == b'-')
        && alnum(&b[0])
        && alnum(&b[b.len() - 1]);
    if ok {
        Ok(())
    } else {
        Err(AgentError::InvalidArgument(format!(
            "snapshot_id {id:?} must be 1-63 lowercase letters, digits and '-', starting and ending with a letter or digit"
        )))
    }
}

/// What a capture needs of its source sandbox (read from the table under
/// the sandbox's lock).
#[derive(Debug, Clone)]
pub struct Source {
    pub sandbox_id: String,
    pub name: String,
    pub namespace: String,
    /// Normalized.
    pub image: String,
    /// Running (frozen for the capture) or paused (left paused).
    pub running: bool,
    pub volume_mounts: Vec<NamedVolumeMount>,
}

/// One entry of the [`labels::SNAPSHOT_VOLUMES`] label.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LabelVolume {
    #[serde(flatten)]
    mount: LabelMount,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    volume_snapshot: String,
}

fn volumes_to_label(volumes: &[SnapshotVolume]) -> Result<String> {
    let list: Vec<LabelVolume> = volumes
        .iter()
        .map(|v| LabelVolume {
            mount: v.mount.as_ref().map(LabelMount::from).expect("set by plan"),
            volume_snapshot: v.volume_snapshot.clone(),
        })
        .collect();
    let value = serde_json::to_string(&list).expect("strings and bools serialize");
    if value.len() + labels::SNAPSHOT_VOLUMES.len() > MAX_LABEL_BYTES {
        return Err(AgentError::SnapshotUnsupported(format!(
            "the sandbox's {} named volume mounts take {} bytes, more than a containerd label holds; detach some volumes first",
            volumes.len(),
            value.len()
        )));
    }
    Ok(value)
}

/// The volumes a snapshot's label names (unreadable: none, logged).
fn volumes_from_label(info: &Info) -> Vec<SnapshotVolume> {
    let value = info
        .labels
        .get(labels::SNAPSHOT_VOLUMES)
        .map_or("", String::as_str);
    if value.is_empty() {
        return Vec::new();
    }
    match serde_json::from_str::<Vec<LabelVolume>>(value) {
        Ok(list) => list
            .into_iter()
            .map(|v| SnapshotVolume {
                mount: Some(v.mount.into()),
                volume_snapshot: v.volume_snapshot,
            })
            .collect(),
        Err(e) => {
            tracing::warn!(snapshot = %info.name, error = %e, "unreadable snapshot volumes label");
            Vec::new()
        }
    }
}

/// The volumes of a capture of `source`: a volume snapshot for each
/// read-write mount, none for a read-only one (it cannot have changed).
fn planned_volumes(id: &str, source: &Source) -> Vec<SnapshotVolume> {
    source
        .volume_mounts
        .iter()
        .map(|m| SnapshotVolume {
            mount: Some(m.clone()),
            volume_snapshot: if m.read_only {
                String::new()
            } else {
                volume_snapshot_name(id)
            },
        })
        .collect()
}

/// The overlay upperdir of a snapshot's mounts (the agent runs on the
/// host: the path is valid here).
fn upperdir(mounts: &[Mount], snapshotter: &str) -> Result<PathBuf> {
    mounts
        .iter()
        .filter(|m| m.r#type == "overlay")
        .flat_map(|m| &m.options)
        .find_map(|o| o.strip_prefix("upperdir="))
        .map(PathBuf::from)
        .ok_or_else(|| {
            let kinds: Vec<&str> = mounts.iter().map(|m| m.r#type.as_str()).collect();
            AgentError::SnapshotUnsupported(format!(
                "snapshotter {snapshotter:?} gives {kinds:?} mounts, not an overlay with an upperdir; sandbox snapshots need the overlayfs snapshotter"
            ))
        })
}

/// Copies the tree at `from` into the (existing, empty) directory `to`
/// ([`crate::tree_copy`], on a blocking thread).
async fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    let (from, to) = (from.to_path_buf(), to.to_path_buf());
    let stats = tokio::task::spawn_blocking(move || crate::tree_copy::copy_tree(&from, &to))
        .await
        .map_err(|e| AgentError::SnapshotCopy(format!("the copy thread failed: {e}")))?
        .map_err(|e| AgentError::SnapshotCopy(e.to_string()))?;
    tracing::debug!(
        entries = stats.entries,
        bytes = stats.bytes,
        cloned = stats.cloned,
        "writable layer copied"
    );
    Ok(())
}

/// A label as an integer (absent or unreadable: 0).
fn label_i64(info: &Info, key: &str) -> i64 {
    info.labels
        .get(key)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// What a capture worked out (and prepared) before freezing anything.
struct Plan {
    source_upper: PathBuf,
    parent: String,
    /// The in-progress key's upperdir (empty).
    dest_upper: PathBuf,
    volumes: Vec<SnapshotVolume>,
    volumes_label: String,
}

/// The committed snapshots of this agent and what captures and deletes do
/// to them (see the module docs).
pub struct Snapshots {
    ctrd: Containerd,
    snapshotter: String,
    agent_id: String,
    node_name: String,
    instance_id: String,
    volumes: Arc<VolumeMounts>,
    /// Snapshot id → what the inventory reports: loaded at start, kept by
    /// captures and deletes (no containerd List per heartbeat).
    known: RwLock<BTreeMap<String, SnapshotInfo>>,
}

impl Snapshots {
    pub fn new(
        ctrd: Containerd,
        snapshotter: &str,
        agent_id: &str,
        node_name: &str,
        instance_id: &str,
        volumes: Arc<VolumeMounts>,
    ) -> Self {
        Self {
            ctrd,
            snapshotter: snapshotter.to_string(),
            agent_id: agent_id.to_string(),
            node_name: node_name.to_string(),
            instance_id: instance_id.to_string(),
            volumes,
            known: RwLock::new(BTreeMap::new()),
        }
    }

    /// Every committed snapshot of this agent, by id.
    pub fn inventory(&self) -> Vec<SnapshotInfo> {
        self.known.read().values().cloned().collect()
    }

    /// containerd's facts about snapshot `key`; None when it does not exist.
    async fn stat(&self, key: &str) -> Result<Option<Info>> {
        self.ctrd
            .stat_snapshot(&self.snapshotter, key)
            .await
            .map_err(AgentError::containerd("snapshots.Stat"))
    }

    /// Removes snapshot `key`; false when it did not exist.
    async fn remove(&self, key: &str) -> Result<bool> {
        self.ctrd
            .remove_snapshot(&self.snapshotter, key)
            .await
            .map_err(AgentError::containerd("snapshots.Remove"))
    }

    async fn mounts(&self, key: &str) -> Result<Vec<Mount>> {
        self.ctrd
            .snapshot_mounts(&self.snapshotter, key)
            .await
            .map_err(AgentError::containerd("snapshots.Mounts"))
    }

    /// Bytes of committed snapshot `name` (-1 when containerd cannot say:
    /// the snapshot is there all the same).
    async fn size_of(&self, name: &str) -> i64 {
        let res = self
            .ctrd
            .snapshots()
            .usage(self.ctrd.req(UsageRequest {
                snapshotter: self.snapshotter.clone(),
                key: name.to_string(),
            }))
            .await;
        match res {
            Ok(u) => u.into_inner().size,
            Err(s) => {
                tracing::warn!(snapshot = %name, error = %s, "snapshots.Usage failed");
                -1
            }
        }
    }

    /// The wire form of a committed snapshot, from its labels.
    fn info_from(&self, info: &Info, size_bytes: i64) -> SnapshotInfo {
        let get = |k: &str| info.labels.get(k).cloned().unwrap_or_default();
        SnapshotInfo {
            snapshot_id: get(labels::SNAPSHOT),
            sandbox_id: get(labels::SANDBOX_ID),
            sandbox_name: get(labels::NAME),
            sandbox_namespace: get(labels::NAMESPACE),
            image: get(labels::IMAGE),
            size_bytes,
            created_at_unix_ms: label_i64(info, labels::CREATED_AT),
            paused_us: label_i64(info, labels::SNAPSHOT_PAUSED_US),
            took_us: label_i64(info, labels::SNAPSHOT_TOOK_US),
            volumes: volumes_from_label(info),
            agent_id: get(labels::AGENT_ID),
            node_name: self.node_name.clone(),
        }
    }

    /// The idempotent answer: snapshot `id` when it is committed already
    /// (of `sandbox_id`: another sandbox's is ALREADY_EXISTS).
    pub async fn existing(&self, id: &str, sandbox_id: &str) -> Result<Option<SnapshotInfo>> {
        let name = committed_name(id);
        let Some(stat) = self.stat(&name).await? else {
            return Ok(None);
        };
        let known = self.known.read().get(id).cloned();
        let info = match known {
            Some(info) => info,
            None => self.info_from(&stat, self.size_of(&name).await),
        };
        if info.sandbox_id != sandbox_id {
            return Err(AgentError::SnapshotTaken {
                id: id.to_string(),
                sandbox: info.sandbox_id,
            });
        }
        Ok(Some(info))
    }

    /// Captures `source` as snapshot `id` (see the module docs); on any
    /// failure the sandbox is thawed and nothing of the capture is left.
    /// The caller holds the sandbox's lock and checked [`Self::existing`].
    pub async fn capture(&self, id: &str, source: &Source) -> Result<SnapshotInfo> {
        let started = Instant::now();
        let mut taken = Vec::new();
        let outcome = async {
            let plan = self.plan(id, source).await?;
            let frozen = self.freeze(id, source).await?;
            let copied = self.copy_frozen(&plan, &mut taken).await;
            let thawed = self.thaw(&source.sandbox_id, frozen).await;
            copied?;
            let paused = thawed?;
            self.commit(id, source, &plan, paused, started).await
        }
        .await;
        match outcome {
            Ok(info) => {
                tracing::info!(snapshot = %id, sandbox = %source.sandbox_id, size_bytes = info.size_bytes, paused_us = info.paused_us, took_us = info.took_us, "sandbox snapshot committed");
                self.known.write().insert(id.to_string(), info.clone());
                Ok(info)
            }
            Err(e) => {
                tracing::warn!(snapshot = %id, sandbox = %source.sandbox_id, error = %e, "capture failed; undoing it");
                self.undo_capture(id, &taken).await;
                Err(e)
            }
        }
    }

    /// Everything that needs no freeze: the source's upperdir and parent,
    /// the volumes, and the in-progress key prepared on that parent.
    #[tracing::instrument(skip_all)]
    async fn plan(&self, id: &str, source: &Source) -> Result<Plan> {
        let container = self
            .ctrd
            .containers()
            .get(self.ctrd.req(GetContainerRequest {
                id: source.sandbox_id.clone(),
            }))
            .await
            .map_err(AgentError::containerd("containers.Get"))?
            .into_inner()
            .container
            .ok_or_else(|| AgentError::SandboxNotFound(source.sandbox_id.clone()))?;
        let source_key = if container.snapshot_key.is_empty() {
            source.sandbox_id.clone()
        } else {
            container.snapshot_key
        };
        let parent = self
            .stat(&source_key)
            .await?
            .map(|i| i.parent)
            .ok_or_else(|| {
                AgentError::SnapshotUnsupported(format!(
                    "sandbox {}'s writable snapshot {source_key} is gone",
                    source.sandbox_id
                ))
            })?;
        let source_upper = upperdir(&self.mounts(&source_key).await?, &self.snapshotter)?;
        let volumes = planned_volumes(id, source);
        let volumes_label = volumes_to_label(&volumes)?;
        let dest_upper = self.prepare_in_progress(id, &parent).await?;
        Ok(Plan {
            source_upper,
            parent,
            dest_upper,
            volumes,
            volumes_label,
        })
    }

    /// Prepares the in-progress key (an earlier attempt's goes first);
    /// returns its upperdir.
    async fn prepare_in_progress(&self, id: &str, parent: &str) -> Result<PathBuf> {
        let key = in_progress_key(id);
        self.remove(&key).await?;
        let labels = HashMap::from([
            (labels::SNAPSHOT.to_string(), id.to_string()),
            (labels::AGENT_ID.to_string(), self.agent_id.clone()),
            (labels::AGENT_INSTANCE.to_string(), self.instance_id.clone()),
            (labels::GC_ROOT.to_string(), now_ms().to_string()),
        ]);
        let mounts = self
            .ctrd
            .prepare_snapshot(&self.snapshotter, &key, parent, labels)
            .await
            .map_err(AgentError::containerd("snapshots.Prepare"))?;
        upperdir(&mounts, &self.snapshotter)
    }

    /// Pauses a running source, labelled first so that a restarted agent
    /// thaws it if this capture dies frozen. Returns when the pause began
    /// (None: the source was paused already and is not touched).
    async fn freeze(&self, id: &str, source: &Source) -> Result<Option<Instant>> {
        if !source.running {
            return Ok(None);
        }
        let sandbox = &source.sandbox_id;
        self.ctrd
            .set_container_label(sandbox, labels::FROZEN_FOR_SNAPSHOT, id)
            .await
            .map_err(AgentError::containerd("containers.Update"))?;
        let since = Instant::now();
        let paused = self
            .ctrd
            .tasks()
            .pause(self.ctrd.req(PauseTaskRequest {
                container_id: sandbox.clone(),
            }))
            .await;
        if let Err(s) = paused {
            self.drop_frozen_label(sandbox).await;
            return Err(AgentError::containerd("tasks.Pause")(s));
        }
        Ok(Some(since))
    }

    /// Resumes a source [`Self::freeze`] paused (a few tries: a sandbox
    /// left frozen is the worst outcome) and drops the label. Returns the
    /// pause window in microseconds (0: nothing was paused). When resume
    /// keeps failing the label stays, for a restarted agent to act on.
    async fn thaw(&self, sandbox: &str, frozen: Option<Instant>) -> Result<i64> {
        let Some(since) = frozen else {
            return Ok(0);
        };
        let resume = || async {
            self.ctrd
                .tasks()
                .resume(self.ctrd.req(ResumeTaskRequest {
                    container_id: sandbox.to_string(),
                }))
                .await
        };
        resume
            .retry(
                backon::ExponentialBuilder::default()
                    .with_min_delay(Duration::from_millis(20))
                    .with_max_times(4),
            )
            .notify(|s, _| tracing::warn!(sandbox, error = %s, "tasks.Resume after a capture failed; retrying"))
            .await
            .map_err(AgentError::containerd("tasks.Resume"))?;
        let paused_us = since.elapsed().as_micros() as i64;
        self.drop_frozen_label(sandbox).await;
        Ok(paused_us)
    }

    /// Drops [`labels::FROZEN_FOR_SNAPSHOT`]; a failure only costs a
    /// restarted agent a look at a running task.
    async fn drop_frozen_label(&self, sandbox: &str) {
        if let Err(s) = self
            .ctrd
            .set_container_label(sandbox, labels::FROZEN_FOR_SNAPSHOT, "")
            .await
        {
            tracing::warn!(sandbox, error = %s, "could not drop the frozen-for-snapshot label");
        }
    }

    /// The frozen part: volume snapshots (an earlier attempt's of the same
    /// name goes first), then the upperdir copy. `taken` lists the volumes
    /// whose snapshot this capture made, for the undo.
    #[tracing::instrument(skip_all)]
    async fn copy_frozen(&self, plan: &Plan, taken: &mut Vec<String>) -> Result<()> {
        for v in plan
            .volumes
            .iter()
            .filter(|v| !v.volume_snapshot.is_empty())
        {
            let volume = &v.mount.as_ref().expect("set by plan").volume;
            self.volumes
                .delete_snapshot(volume, &v.volume_snapshot)
                .await?;
            self.volumes.snapshot(volume, &v.volume_snapshot).await?;
            taken.push(volume.clone());
        }
        copy_tree(&plan.source_upper, &plan.dest_upper).await
    }

    /// Commits the in-progress key as the snapshot, with its labels.
    #[tracing::instrument(skip_all)]
    async fn commit(
        &self,
        id: &str,
        source: &Source,
        plan: &Plan,
        paused_us: i64,
        started: Instant,
    ) -> Result<SnapshotInfo> {
        let name = committed_name(id);
        let created_at = now_ms();
        let labels = HashMap::from([
            (labels::SNAPSHOT.to_string(), id.to_string()),
            (labels::AGENT_ID.to_string(), self.agent_id.clone()),
            (labels::IMAGE.to_string(), source.image.clone()),
            (labels::SANDBOX_ID.to_string(), source.sandbox_id.clone()),
            (labels::NAME.to_string(), source.name.clone()),
            (labels::NAMESPACE.to_string(), source.namespace.clone()),
            (labels::CREATED_AT.to_string(), created_at.to_string()),
            (
                labels::SNAPSHOT_VOLUMES.to_string(),
                plan.volumes_label.clone(),
            ),
            (
                labels::SNAPSHOT_PAUSED_US.to_string(),
                paused_us.to_string(),
            ),
            (
                labels::SNAPSHOT_TOOK_US.to_string(),
                started.elapsed().as_micros().to_string(),
            ),
            (labels::GC_ROOT.to_string(), created_at.to_string()),
        ]);
        self.ctrd
            .snapshots()
            .commit(self.ctrd.req(CommitSnapshotRequest {
                snapshotter: self.snapshotter.clone(),
                name: name.clone(),
                key: in_progress_key(id),
                labels,
            }))
            .await
            .map_err(AgentError::containerd("snapshots.Commit"))?;
        tracing::debug!(snapshot = %id, parent = %plan.parent, "committed");
        Ok(SnapshotInfo {
            snapshot_id: id.to_string(),
            sandbox_id: source.sandbox_id.clone(),
            sandbox_name: source.name.clone(),
            sandbox_namespace: source.namespace.clone(),
            image: source.image.clone(),
            size_bytes: self.size_of(&name).await,
            created_at_unix_ms: created_at,
            paused_us,
            took_us: started.elapsed().as_micros() as i64,
            volumes: plan.volumes.clone(),
            agent_id: self.agent_id.clone(),
            node_name: self.node_name.clone(),
        })
    }

    /// Removes what a failed capture made: the in-progress key and the
    /// volume snapshots of `taken` (best effort: a restarted agent removes
    /// what is left).
    #[tracing::instrument(skip_all)]
    async fn undo_capture(&self, id: &str, taken: &[String]) {
        if let Err(e) = self.remove(&in_progress_key(id)).await {
            tracing::warn!(snapshot = %id, error = %e, "could not remove the in-progress snapshot");
        }
        let name = volume_snapshot_name(id);
        for volume in taken {
            if let Err(e) = self.volumes.delete_snapshot(volume, &name).await {
                tracing::warn!(snapshot = %id, volume, error = %e, "could not remove a volume snapshot of a failed capture");
            }
        }
    }

    /// Removes snapshot `id` and the volume snapshots it took. Refused
    /// (FAILED_PRECONDITION) while a sandbox restored from it exists.
    /// Returns whether it existed.
    pub async fn delete(&self, id: &str) -> Result<bool> {
        // A capture that could not clean up after itself.
        self.remove(&in_progress_key(id)).await?;
        let name = committed_name(id);
        let Some(stat) = self.stat(&name).await? else {
            self.known.write().remove(id);
            return Ok(false);
        };
        let existed = match self.remove(&name).await {
            Err(e) if e.code() == Code::FailedPrecondition => {
                return Err(AgentError::SnapshotInUse(id.to_string()));
            }
            r => r?,
        };
        self.known.write().remove(id);
        for v in volumes_from_label(&stat) {
            let Some(m) = v.mount.filter(|_| !v.volume_snapshot.is_empty()) else {
                continue;
            };
            match self
                .volumes
                .delete_snapshot(&m.volume, &v.volume_snapshot)
                .await
            {
                Ok(_) => {}
                Err(e) if e.code() == Code::NotFound => {}
                Err(e) => {
                    tracing::warn!(snapshot = %id, volume = %m.volume, error = %e, "could not delete a volume snapshot of a deleted snapshot; the next agent start removes it");
                }
            }
        }
        tracing::info!(snapshot = %id, existed, "sandbox snapshot deleted");
        Ok(existed)
    }

    /// The parent of a restore from snapshot `id` (its committed name),
    /// once checked: it is here, and `image` is its image.
    pub async fn restore_parent(&self, id: &str, image: &str) -> Result<String> {
        let name = committed_name(id);
        let stat = self
            .stat(&name)
            .await?
            .filter(|i| i.kind == Kind::Committed as i32)
            .ok_or_else(|| AgentError::SnapshotNotHere(id.to_string()))?;
        let want = stat.labels.get(labels::IMAGE).cloned().unwrap_or_default();
        let asked = normalize(image);
        if asked != want {
            return Err(AgentError::InvalidArgument(format!(
                "image: {asked} is not the image of snapshot {id} ({want}); a restore runs the snapshot's image"
            )));
        }
        Ok(name)
    }

    /// At agent start: removes this agent's in-progress keys (their
    /// captures died with an earlier process), loads the committed
    /// snapshots, and deletes the `sbs-<id>` volume snapshots whose
    /// snapshot does not exist.
    pub async fn recover(&self) -> Result<()> {
        let all = self
            .ctrd
            .list_snapshots(&self.snapshotter, vec![])
            .await
            .map_err(AgentError::containerd("snapshots.List"))?;
        let ours = |i: &Info| i.labels.get(labels::AGENT_ID) == Some(&self.agent_id);
        for i in all
            .iter()
            .filter(|i| i.name.starts_with(labels::SNAPSHOTTING_KEY_PREFIX) && ours(i))
        {
            if self.remove(&i.name).await? {
                tracing::info!(key = %i.name, "removed the in-progress snapshot of a capture that died");
            }
        }
        let committed: Vec<&Info> = all
            .iter()
            .filter(|i| {
                i.kind == Kind::Committed as i32 && i.name.starts_with(labels::SNAPSHOT_NAME_PREFIX)
            })
            .collect();
        for i in committed.iter().filter(|i| ours(i)) {
            let info = self.info_from(i, self.size_of(&i.name).await);
            self.known.write().insert(info.snapshot_id.clone(), info);
        }
        let ids: HashSet<&str> = committed
            .iter()
            .filter_map(|i| i.name.strip_prefix(labels::SNAPSHOT_NAME_PREFIX))
            .collect();
        self.remove_orphan_volume_snapshots(&ids).await;
        tracing::info!(
            snapshots = self.known.read().len(),
            "sandbox snapshots loaded"
        );
        Ok(())
    }

    /// Deletes every `sbs-<id>` volume snapshot whose `id` is not among
    /// the committed snapshots `ids` (a capture died after taking it).
    async fn remove_orphan_volume_snapshots(&self, ids: &HashSet<&str>) {
        if !self.volumes.enabled() {
            return;
        }
        // The node's own volumes only: JuiceFS volumes are every agent's,
        // and another agent's snapshots are not in `ids`.
        let volumes = match self.volumes.list_local().await {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "could not list volumes to remove orphan snapshot volume snapshots");
                return;
            }
        };
        for s in volumes.iter().flat_map(|v| &v.snapshots) {
            let Some(id) = s.name.strip_prefix(VOLUME_SNAPSHOT_PREFIX) else {
                continue;
            };
            if ids.contains(id) {
                continue;
            }
            match self.volumes.delete_snapshot(&s.volume, &s.name).await {
                Ok(_) => {
                    tracing::info!(volume = %s.volume, snapshot = %s.name, "removed the volume snapshot of a capture that died");
                }
                Err(e) => {
                    tracing::warn!(volume = %s.volume, snapshot = %s.name, error = %e, "could not remove an orphan volume snapshot");
                }
            }
        }
    }
}

/// At agent start, for a container labelled
/// [`labels::FROZEN_FOR_SNAPSHOT`]: its capture died with the previous
/// agent process, so its task is resumed (when paused) and the label
/// dropped. A capture never labels a sandbox paused on purpose.
pub async fn thaw_after_dead_capture(ctrd: &Containerd, container_id: &str) -> Result<()> {
    let task = ctrd
        .tasks()
        .get(ctrd.req(GetRequest {
            container_id: container_id.to_string(),
            exec_id: String::new(),
        }))
        .await;
    let status = match task {
        Ok(t) => t.into_inner().process.map(|p| p.status),
        Err(s) if s.code() == Code::NotFound => None,
        Err(s) => return Err(AgentError::containerd("tasks.Get")(s)),
    };
    let paused = [TaskStatus::Paused as i32, TaskStatus::Pausing as i32];
    if status.is_some_and(|s| paused.contains(&s)) {
        ctrd.tasks()
            .resume(ctrd.req(ResumeTaskRequest {
                container_id: container_id.to_string(),
            }))
            .await
            .map_err(AgentError::containerd("tasks.Resume"))?;
        tracing::info!(sandbox = %container_id, "thawed a sandbox a dead capture left frozen");
    }
    ctrd.set_container_label(container_id, labels::FROZEN_FOR_SNAPSHOT, "")
        .await
        .map_err(AgentError::containerd("containers.Update"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_ids_are_dns_labels() {
        for ok in [
            "a",
            "0",
            "3f2c1e9a-8b7d-4c6e-9f00-123456789abc",
            &"x".repeat(63),
        ] {
            assert!(validate_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", "a/b", &"x".repeat(64)] {
            assert!(validate_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_upperdir_comes_from_the_overlay_mount() {
        let overlay = Mount {
            r#type: "overlay".into(),
            source: "overlay".into(),
            options: vec![
                "index=off".into(),
                "workdir=/s/2/work".into(),
                "upperdir=/s/2/fs".into(),
                "lowerdir=/s/1/fs".into(),
            ],
            ..Default::default()
        };
        assert_eq!(
            upperdir(&[overlay], "overlayfs").unwrap(),
            PathBuf::from("/s/2/fs")
        );
        let bind = Mount {
            r#type: "bind".into(),
            source: "/x".into(),
            ..Default::default()
        };
        let e = upperdir(&[bind], "native").unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(e.to_string().contains("native"), "{e}");
    }

    #[test]
    fn the_volumes_label_round_trips() {
        let source = Source {
            sandbox_id: "sb".into(),
            name: "n".into(),
            namespace: "ns".into(),
            image: "docker.io/library/busybox:latest".into(),
            running: true,
            volume_mounts: vec![
                NamedVolumeMount {
                    volume: "work".into(),
                    sub_path: "a/b".into(),
                    mount_path: "/work".into(),
                    read_only: false,
                },
                NamedVolumeMount {
                    volume: "ref".into(),
                    sub_path: String::new(),
                    mount_path: "/ref".into(),
                    read_only: true,
                },
            ],
        };
        let volumes = planned_volumes("s1", &source);
        assert_eq!(volumes[0].volume_snapshot, "sbs-s1");
        assert_eq!(volumes[1].volume_snapshot, "", "read-only: no snapshot");
        let info = Info {
            name: committed_name("s1"),
            labels: HashMap::from([(
                labels::SNAPSHOT_VOLUMES.to_string(),
                volumes_to_label(&volumes).unwrap(),
            )]),
            ..Default::default()
        };
        assert_eq!(volumes_from_label(&info), volumes);
    }
}
