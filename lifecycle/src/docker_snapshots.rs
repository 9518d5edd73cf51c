//! Docker backend, sandbox snapshots: `docker commit` of the sandbox's
//! container (paused for the commit; a paused sandbox stays paused) into a
//! local image `sandbolt-snapshot:<id>` whose labels are the snapshot's
//! facts (id, name, source sandbox, source image, creation time). The engine
//! is the record, as for sandboxes: the snapshot list is the images with
//! those labels, nothing is kept on the side. A restore is a container of
//! that image (named by its image id, so the image checked is the image run).
//!
//! Deleting a snapshot that containers still run from would only untag the
//! image and leave it behind, unnamed and never removed. Such a snapshot is
//! tagged `sandbolt-snapshot-deleting:<id>` instead (it answers `Deleting`,
//! and no new sandbox can come from it); every sandbox delete, snapshot
//! delete and backend start removes the marked snapshots no container uses.
//!
//! What a commit captures: the container's filesystem changes. Volumes
//! (host paths, Docker volumes) are not part of an image and are not
//! captured; a restore mounts what its own request names. The image also
//! keeps the source's environment (the engine can add variables at
//! create, never drop one): a restored sandbox sees the source's request
//! env under its own.

use std::collections::{HashMap, HashSet};

use bollard::models::{ContainerConfig, ImageSummary};
use bollard::query_parameters::{
    CommitContainerOptions, ListContainersOptions, ListImagesOptions, RemoveImageOptions,
    TagImageOptions,
};
use chrono::{DateTime, Utc};

use crate::docker::{
    DockerBackend, LABEL_MANUAL_CLEANUP, container_name, map_engine_answer, write_json,
};
use crate::docker_volumes::LABEL_DELETE_VOLUMES;
use crate::error::{ApiError, ApiResult};
use crate::model::{State, rfc3339};
use crate::snapshots::{
    SandboxSnapshot, SnapshotFilter, SnapshotState, SnapshotStatus, snapshot_not_found,
};
use crate::validate::CreatePlan;

/// Repository of snapshot images; the tag is the snapshot id.
pub const SNAPSHOT_REPO: &str = "sandbolt-snapshot";
/// Repository of the mark of a snapshot whose deletion waits for the
/// containers created from it.
pub const DELETING_REPO: &str = "sandbolt-snapshot-deleting";

/// Snapshot image labels (reserved prefix: never user metadata).
pub const LABEL_SNAPSHOT_ID: &str = "opensandbox.io/sandbolt-snapshot-id";
pub const LABEL_SNAPSHOT_NAME: &str = "opensandbox.io/sandbolt-snapshot-name";
pub const LABEL_SNAPSHOT_SANDBOX: &str = "opensandbox.io/sandbolt-snapshot-sandbox";
pub const LABEL_SNAPSHOT_CREATED_AT: &str = "opensandbox.io/sandbolt-snapshot-created-at";
pub const LABEL_SNAPSHOT_IMAGE: &str = "opensandbox.io/sandbolt-snapshot-image";
/// Container label: the snapshot a sandbox was restored from.
pub const LABEL_RESTORED_FROM: &str = "opensandbox.io/sandbolt-restored-from";
/// Container label: the image the API shows for a restored sandbox (its
/// snapshot's source image; the engine's is the snapshot image's id).
pub const LABEL_IMAGE: &str = "opensandbox.io/sandbolt-image";

fn snapshot_ref(id: &str) -> String {
    format!("{SNAPSHOT_REPO}:{id}")
}

fn deleting_ref(id: &str) -> String {
    format!("{DELETING_REPO}:{id}")
}

/// Snapshot ids are image tags here; anything else names no snapshot.
fn check_snapshot_id(id: &str) -> ApiResult<()> {
    // A tag starts with a word character: "-x" would be an engine 400.
    let ok = id.len() <= 64
        && id.bytes().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && id.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-');
    if ok {
        Ok(())
    } else {
        Err(snapshot_not_found(id))
    }
}

/// Every snapshot label, all of them always written: a commit keeps the
/// container's labels, and a container restored from an earlier snapshot
/// carries that one's (each key set here replaces the inherited value).
fn snapshot_labels(snap: &SandboxSnapshot, source_image: Option<&str>) -> HashMap<String, String> {
    HashMap::from([
        (LABEL_SNAPSHOT_ID.to_string(), snap.id.clone()),
        (
            LABEL_SNAPSHOT_NAME.to_string(),
            snap.name.clone().unwrap_or_default(),
        ),
        (LABEL_SNAPSHOT_SANDBOX.to_string(), snap.sandbox_id.clone()),
        (
            LABEL_SNAPSHOT_CREATED_AT.to_string(),
            rfc3339(snap.created_at),
        ),
        (
            LABEL_SNAPSHOT_IMAGE.to_string(),
            source_image.unwrap_or_default().to_string(),
        ),
    ])
}

/// The snapshot an image is, if it is one: its id label and its tag agree.
fn from_image(labels: &HashMap<String, String>, repo_tags: &[String]) -> Option<SandboxSnapshot> {
    let id = labels.get(LABEL_SNAPSHOT_ID)?;
    if !repo_tags.contains(&snapshot_ref(id)) {
        return None;
    }
    let deleting = repo_tags.contains(&deleting_ref(id));
    let status = if deleting {
        SnapshotStatus {
            state: SnapshotState::Deleting,
            reason: Some("in_use".into()),
            message: Some(
                "deletion pending: sandboxes created from it still exist; it goes with the last of them"
                    .into(),
            ),
            last_transition_at: None,
        }
    } else {
        SnapshotStatus::plain(SnapshotState::Ready)
    };
    Some(SandboxSnapshot {
        id: id.clone(),
        name: labels
            .get(LABEL_SNAPSHOT_NAME)
            .filter(|n| !n.is_empty())
            .cloned(),
        sandbox_id: labels
            .get(LABEL_SNAPSHOT_SANDBOX)
            .cloned()
            .unwrap_or_default(),
        status,
        created_at: labels
            .get(LABEL_SNAPSHOT_CREATED_AT)
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.with_timezone(&Utc))
            .unwrap_or_default(),
    })
}

/// The snapshot a restore runs, as the container create needs it.
pub(crate) struct Restore {
    pub snapshot_id: String,
    /// The source's image, shown as the restored sandbox's.
    pub source_image: String,
}

impl Restore {
    /// Labels of the restored container that must not be inherited from
    /// the snapshot image (a commit keeps the source container's labels):
    /// expiry mode and owed volume deletes are always written.
    pub(crate) fn container_labels(&self, labels: &mut HashMap<String, String>) {
        labels.insert(LABEL_RESTORED_FROM.into(), self.snapshot_id.clone());
        labels.insert(LABEL_IMAGE.into(), self.source_image.clone());
        labels
            .entry(LABEL_MANUAL_CLEANUP.into())
            .or_insert_with(|| "false".into());
        labels
            .entry(LABEL_DELETE_VOLUMES.into())
            .or_insert_with(|| "[]".into());
    }
}

impl DockerBackend {
    /// The image of snapshot `id` and the snapshot it is; 404 when none.
    async fn snapshot_image(&self, id: &str) -> ApiResult<(String, SandboxSnapshot)> {
        check_snapshot_id(id)?;
        let img = match self.docker.inspect_image(&snapshot_ref(id)).await {
            Ok(img) => img,
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => return Err(snapshot_not_found(id)),
            Err(e) => return Err(map_engine_answer(id, e)),
        };
        let labels = img.config.and_then(|c| c.labels).unwrap_or_default();
        let snap = from_image(&labels, &img.repo_tags.unwrap_or_default())
            .filter(|s| s.id == id)
            .ok_or_else(|| snapshot_not_found(id))?;
        let image_id = img
            .id
            .ok_or_else(|| ApiError::internal("the engine gave no image id"))?;
        Ok((image_id, snap))
    }

    /// Commits sandbox `id` (running: paused for the commit; paused: left
    /// so) into a new snapshot image; answers it `Ready`.
    #[tracing::instrument(name = "docker", skip_all, fields(call = "create_snapshot", sandbox_id = %id, snapshot_id = tracing::field::Empty))]
    pub(crate) async fn snap_create(
        &self,
        id: &str,
        name: Option<String>,
    ) -> ApiResult<SandboxSnapshot> {
        let c = self.inspect(id).await?;
        let rec = self.record_from_inspect(id, &c);
        if !matches!(rec.state, State::Running | State::Paused) {
            return Err(ApiError::conflict(
                "SNAPSHOT_INVALID_STATE",
                format!(
                    "Sandbox {id} is {} and cannot be snapshotted (Running or Paused only).",
                    rec.state.as_str()
                ),
            ));
        }
        let snap = SandboxSnapshot {
            id: uuid::Uuid::new_v4().to_string(),
            name,
            sandbox_id: id.to_string(),
            status: SnapshotStatus::plain(SnapshotState::Ready),
            created_at: Utc::now(),
        };
        tracing::Span::current().record("snapshot_id", snap.id.as_str());
        let opts = CommitContainerOptions {
            container: Some(container_name(id)),
            repo: Some(SNAPSHOT_REPO.into()),
            tag: Some(snap.id.clone()),
            comment: Some(format!("sandbolt snapshot of sandbox {id}")),
            pause: true,
            ..Default::default()
        };
        let config = ContainerConfig {
            labels: Some(snapshot_labels(&snap, rec.image.as_deref())),
            ..Default::default()
        };
        self.docker
            .commit_container(opts, config)
            .await
            .map_err(|e| map_engine_answer(id, e))?;
        tracing::info!(snapshot_id = %snap.id, "snapshot committed");
        Ok(snap)
    }

    #[tracing::instrument(name = "docker", skip_all, fields(call = "get_snapshot", snapshot_id = %id))]
    pub(crate) async fn snap_get(&self, id: &str) -> ApiResult<SandboxSnapshot> {
        Ok(self.snapshot_image(id).await?.1)
    }

    /// Every image labelled as a snapshot (`from_image` tells which are).
    async fn snapshot_images(&self) -> ApiResult<Vec<ImageSummary>> {
        let opts = ListImagesOptions {
            filters: Some(HashMap::from([(
                "label".to_string(),
                vec![LABEL_SNAPSHOT_ID.to_string()],
            )])),
            ..Default::default()
        };
        self.docker
            .list_images(Some(opts))
            .await
            .map_err(|e| map_engine_answer("*", e))
    }

    #[tracing::instrument(name = "docker", skip_all, fields(call = "list_snapshots"))]
    pub(crate) async fn snap_list(
        &self,
        filter: &SnapshotFilter,
    ) -> ApiResult<Vec<SandboxSnapshot>> {
        Ok(self
            .snapshot_images()
            .await?
            .iter()
            .filter_map(|img| from_image(&img.labels, &img.repo_tags))
            .filter(|s| filter.matches(s))
            .collect())
    }

    /// Image ids any container (sandbox or not, running or not) runs from.
    async fn images_in_use(&self) -> ApiResult<HashSet<String>> {
        let opts = ListContainersOptions {
            all: true,
            ..Default::default()
        };
        let all = self
            .docker
            .list_containers(Some(opts))
            .await
            .map_err(|e| map_engine_answer("*", e))?;
        Ok(all.into_iter().filter_map(|c| c.image_id).collect())
    }

    /// Removes both tags of snapshot `id`: the last one removed deletes
    /// the image (one a later snapshot was committed on stays as that
    /// one's parent and goes with it).
    async fn remove_snapshot_image(&self, id: &str) -> ApiResult<()> {
        for reference in [deleting_ref(id), snapshot_ref(id)] {
            match self
                .docker
                .remove_image(&reference, None::<RemoveImageOptions>, None)
                .await
            {
                Ok(_)
                | Err(bollard::errors::Error::DockerResponseServerError {
                    status_code: 404, ..
                }) => {}
                Err(e) => return Err(map_engine_answer(id, e)),
            }
        }
        tracing::info!(snapshot_id = %id, "snapshot removed");
        Ok(())
    }

    /// Removes the snapshot, or marks it `Deleting` while containers run
    /// from it (see the module doc).
    #[tracing::instrument(name = "docker", skip_all, fields(call = "delete_snapshot", snapshot_id = %id))]
    pub(crate) async fn snap_delete(&self, id: &str) -> ApiResult<()> {
        let _held = self.snapshot_lock.lock().await;
        let (image_id, _) = self.snapshot_image(id).await?;
        if !self.images_in_use().await?.contains(&image_id) {
            return self.remove_snapshot_image(id).await;
        }
        let opts = TagImageOptions {
            repo: Some(DELETING_REPO.into()),
            tag: Some(id.to_string()),
        };
        self.docker
            .tag_image(&image_id, Some(opts))
            .await
            .map_err(|e| map_engine_answer(id, e))?;
        tracing::info!(snapshot_id = %id, "snapshot in use: deletion pending");
        Ok(())
    }

    /// Removes every snapshot marked for deletion that no container runs
    /// from any more. Best effort: what fails now is tried again at the
    /// next sandbox or snapshot delete.
    pub(crate) async fn settle_snapshot_deletes(&self) {
        let _held = self.snapshot_lock.lock().await;
        let marked: Vec<(String, SandboxSnapshot)> = match self.snapshot_images().await {
            Ok(all) => all
                .iter()
                .filter_map(|img| Some((img.id.clone(), from_image(&img.labels, &img.repo_tags)?)))
                .filter(|(_, s)| s.status.state == SnapshotState::Deleting)
                .collect(),
            Err(e) => {
                tracing::warn!(error = %e, "cannot list snapshots pending deletion");
                return;
            }
        };
        if marked.is_empty() {
            return;
        }
        let used = match self.images_in_use().await {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list containers");
                return;
            }
        };
        for (_, snap) in marked.iter().filter(|(image, _)| !used.contains(image)) {
            if let Err(e) = self.remove_snapshot_image(&snap.id).await {
                tracing::warn!(snapshot_id = %snap.id, error = %e, "cannot remove a snapshot pending deletion");
            }
        }
    }

    /// For a create with `snapshotId`: points the plan at the snapshot's
    /// image (by id) and answers what the container needs to know; `None`
    /// for a create from an image. The caller holds `snapshot_lock` until
    /// the container exists, so a delete cannot remove the image between.
    pub(crate) async fn prepare_restore(
        &self,
        plan: &mut CreatePlan,
    ) -> ApiResult<Option<Restore>> {
        let Some(id) = plan.snapshot_id.clone() else {
            return Ok(None);
        };
        let (image_id, snap) = match self.snapshot_image(&id).await {
            Ok(found) => found,
            Err(e) if e.code == "SNAPSHOT_NOT_FOUND" => {
                return Err(ApiError::invalid_code(
                    "SNAPSHOT_NOT_FOUND",
                    format!("snapshotId {id} names no snapshot"),
                ));
            }
            Err(e) => return Err(e),
        };
        if snap.status.state != SnapshotState::Ready {
            return Err(ApiError::conflict(
                "SNAPSHOT_INVALID_STATE",
                format!(
                    "Snapshot {id} is {}: no sandbox can be created from it.",
                    snap.status.state.as_str()
                ),
            ));
        }
        let img = self
            .docker
            .inspect_image(&image_id)
            .await
            .map_err(|e| map_engine_answer(&id, e))?;
        let source_image = img
            .config
            .and_then(|c| c.labels)
            .and_then(|l| l.get(LABEL_SNAPSHOT_IMAGE).cloned())
            .unwrap_or_default();
        plan.image = image_id;
        // The commit kept the source's labels, user metadata among them:
        // the metadata file (which overrides labels) says the restore's own.
        write_json(&self.metadata_path(&plan.id), &plan.metadata)?;
        Ok(Some(Restore {
            snapshot_id: id,
            source_image,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(name: Option<&str>) -> SandboxSnapshot {
        SandboxSnapshot {
            id: "6f1c".into(),
            name: name.map(str::to_owned),
            sandbox_id: "sb-1".into(),
            status: SnapshotStatus::plain(SnapshotState::Ready),
            created_at: DateTime::from_timestamp(1_700_000_000, 5_000).unwrap(),
        }
    }

    #[test]
    fn labels_round_trip_and_the_tag_decides() {
        for name in [None, Some("before upgrade")] {
            let s = snap(name);
            let labels = snapshot_labels(&s, Some("busybox:1"));
            assert_eq!(labels[LABEL_SNAPSHOT_IMAGE], "busybox:1");
            let tags = vec![snapshot_ref("6f1c")];
            assert_eq!(from_image(&labels, &tags), Some(s.clone()));
            // Marked for deletion.
            let tags = vec![snapshot_ref("6f1c"), deleting_ref("6f1c")];
            let d = from_image(&labels, &tags).unwrap();
            assert_eq!(d.status.state, SnapshotState::Deleting);
            assert_eq!(d.status.reason.as_deref(), Some("in_use"));
            // An image that only inherited the labels (committed from a
            // restored container by someone else) is no snapshot.
            assert_eq!(from_image(&labels, &["mine:latest".to_string()]), None);
        }
    }

    #[test]
    fn restored_containers_never_inherit_expiry_or_volume_debts() {
        let r = Restore {
            snapshot_id: "6f1c".into(),
            source_image: "busybox:1".into(),
        };
        let mut manual = HashMap::from([(LABEL_MANUAL_CLEANUP.to_string(), "true".to_string())]);
        r.container_labels(&mut manual);
        assert_eq!(manual[LABEL_MANUAL_CLEANUP], "true");
        assert_eq!(manual[LABEL_DELETE_VOLUMES], "[]");
        assert_eq!(manual[LABEL_RESTORED_FROM], "6f1c");
        assert_eq!(manual[LABEL_IMAGE], "busybox:1");
        let mut timed = HashMap::from([(LABEL_DELETE_VOLUMES.to_string(), "[\"v\"]".to_string())]);
        r.container_labels(&mut timed);
        assert_eq!(timed[LABEL_MANUAL_CLEANUP], "false");
        assert_eq!(timed[LABEL_DELETE_VOLUMES], "[\"v\"]");
    }

    #[test]
    fn ids_that_cannot_be_tags_are_404() {
        assert!(check_snapshot_id("4f1c2d9e-aaaa-bbbb-cccc-0123456789ab").is_ok());
        for bad in ["", "-x", "a:b", "a/b", "x y", "A.b", &"a".repeat(65)] {
            assert_eq!(
                check_snapshot_id(bad).unwrap_err().code,
                "SNAPSHOT_NOT_FOUND",
                "{bad:?}"
            );
        }
    }
}
