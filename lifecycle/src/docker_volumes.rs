//! Docker backend, volumes: what a sandbox's `pvc` means on a Docker engine
//! (a Docker named volume, created when missing if asked, removed at
//! sandbox delete if asked and if this sandbox's create made it), the rule
//! that keeps one sandbox from redirecting another's host binding, the
//! check that the engine resolves allowed host paths where this lifecycle
//! does, and the 501 of the named-volume routes (no snapshots or forks on
//! Docker).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use axum::http::StatusCode;
use bollard::models::{ContainerCreateBody, HostConfig, Mount, MountType, VolumeCreateRequest};
use bollard::query_parameters::{
    CreateContainerOptions, CreateImageOptions, DownloadFromContainerOptions,
    ListContainersOptions, RemoveContainerOptions, RemoveImageOptions, RemoveVolumeOptions,
};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::docker::{DockerBackend, LABEL_ID, map_engine_answer, read_json, write_json};
use crate::error::{ApiError, ApiResult, StartError};
use crate::validate::CreatePlan;
use crate::volumes::{PvcClaim, VolumeSource};

/// On a sandbox's container: the Docker volumes its create made and was
/// asked to remove at its delete (JSON list of names).
pub const LABEL_DELETE_VOLUMES: &str = "opensandbox.io/sandbolt-delete-volumes";
/// On a Docker volume this lifecycle created for a sandbox: that sandbox.
/// The engine's `volume create` answers an existing volume as if created,
/// so this label, not the answer, says who made it.
pub const VOLUME_LABEL_CREATED_BY: &str = "opensandbox.io/sandbolt-created-by";
/// On a Docker volume a sandbox may mount: `true`. Set on every volume this
/// lifecycle creates; an operator sets it (`docker volume create --label
/// opensandbox.io/sandbolt-managed=true`) on a volume made for sandboxes.
/// Without it (or the created-by label of older versions) a `pvc` is
/// refused: the engine holds other applications' volumes too, and a
/// sandbox naming one would read and write their data.
pub const VOLUME_LABEL_MANAGED: &str = "opensandbox.io/sandbolt-managed";

/// True when sandboxes may mount a volume with these labels.
pub(crate) fn is_sandbolt_volume(labels: &HashMap<String, String>) -> bool {
    labels.get(VOLUME_LABEL_MANAGED).map(String::as_str) == Some("true")
        || labels.contains_key(VOLUME_LABEL_CREATED_BY)
}

/// The refusal of a volume sandbolt did not make.
fn not_managed(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        "VOLUME::NOT_MANAGED",
        format!(
            "Volume {name} exists on the Docker engine but sandbolt did not create it: only \
             volumes labelled {VOLUME_LABEL_MANAGED}=true (or created by a sandbox's \
             pvc.createIfNotExists) can be mounted."
        ),
    )
}

/// What a create did to Docker volumes, to undo or to finish at delete.
#[derive(Debug, Default)]
pub(crate) struct PreparedPvcs {
    /// Volumes this create made (removed again if the create fails).
    pub created: Vec<String>,
    /// Of those, the ones to remove at sandbox delete.
    pub delete_on_delete: Vec<String>,
}

/// A volume removal owed to a deleted sandbox, kept until it succeeds (the
/// volume may still be mounted by another sandbox, or the engine down).
#[derive(Debug, Serialize, Deserialize)]
struct PendingDelete {
    volume: String,
    created_by: String,
}

/// One host binding of an existing sandbox.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Binding {
    pub sandbox: String,
    pub source: PathBuf,
    pub read_write: bool,
}

/// Refuses a host binding of a new sandbox that would share a directory
/// tree with a read-write binding: a sandbox that can write a directory
/// containing another binding's source can swap a component of that path
/// for a symlink between the check and the engine resolving it (the engine
/// follows symlinks in bind sources), and mount whatever it likes into the
/// other sandbox, or into its own next one. Equal paths are fine (the
/// mount root itself cannot be replaced from inside the mount); bindings
/// of one request are mounted together before anything runs, so they are
/// not checked against each other.
pub(crate) fn check_bindings(new: &[(&str, &Path, bool)], existing: &[Binding]) -> ApiResult<()> {
    for (name, path, rw) in new {
        for b in existing {
            if b.source == *path {
                continue;
            }
            if *rw && b.source.starts_with(path) {
                return Err(ApiError::invalid_code(
                    "VOLUME::HOST_PATH_CONTAINS_BINDING",
                    format!(
                        "volume '{name}': read-write host path '{}' contains '{}', which sandbox {} \
                         binds; a writer could redirect that binding. Mount it read-only or \
                         choose a directory that holds no other sandbox's binding",
                        path.display(),
                        b.source.display(),
                        b.sandbox
                    ),
                ));
            }
            if b.read_write && path.starts_with(&b.source) {
                return Err(ApiError::invalid_code(
                    "VOLUME::HOST_PATH_CONTAINS_BINDING",
                    format!(
                        "volume '{name}': host path '{}' lies inside '{}', which sandbox {} binds \
                         read-write; that sandbox could redirect this binding. Choose a \
                         directory outside it",
                        path.display(),
                        b.source.display(),
                        b.sandbox
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The host bindings a plan asks for: (volume name, resolved path, rw).
pub(crate) fn host_bindings(plan: &CreatePlan) -> Vec<(&str, &Path, bool)> {
    plan.volumes
        .iter()
        .filter_map(|v| match &v.source {
            VolumeSource::Host { path } => Some((v.name.as_str(), path.as_path(), !v.read_only)),
            _ => None,
        })
        .collect()
}

/// The single file of the probe image: enough for the engine to create a
/// container (never started) whose bind mounts can be read back.
fn probe_image_tar() -> Result<bytes::Bytes, StartError> {
    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_gnu();
    h.set_mode(0o755);
    h.set_size(0);
    h.set_cksum();
    b.append_data(&mut h, "probe", std::io::empty())
        .and_then(|_| b.into_inner())
        .map(bytes::Bytes::from)
        .map_err(|e| StartError::Config(format!("building the host-path probe image: {e}")))
}

const PROBE_IMAGE: &str = "sandbolt-host-path-probe";
const PROBE_TAG: &str = "1";
/// Where the probe container sees the allowed root.
const PROBE_TARGET: &str = "/sandbolt-probe";

/// The contents of the one file in a tar archive from the archive API.
fn single_file(tar_bytes: &[u8]) -> Option<Vec<u8>> {
    let mut a = tar::Archive::new(tar_bytes);
    let mut entry = a.entries().ok()?.next()?.ok()?;
    let mut out = Vec::new();
    std::io::Read::read_to_end(&mut entry, &mut out).ok()?;
    Some(out)
}

impl DockerBackend {
    /// Checks that the engine resolves every allowed host-path root to the
    /// directory this lifecycle sees there: a file with a random secret is
    /// written into the root here and read back through the engine (a
    /// container, never started, binding the root). The engine resolves
    /// bind sources on its own filesystem; when this lifecycle runs in a
    /// container or another mount namespace, the same path can name
    /// another directory there, and every check made here would be about
    /// the wrong one. Refusing to start is the only honest answer.
    pub async fn check_host_roots(&self, roots: &[PathBuf]) -> Result<(), StartError> {
        let roots: Vec<&PathBuf> = roots.iter().filter(|r| r.is_absolute()).collect();
        if roots.is_empty() {
            return Ok(());
        }
        let image = format!("{PROBE_IMAGE}:{PROBE_TAG}");
        let opts = CreateImageOptions {
            from_src: Some("-".into()),
            repo: Some(PROBE_IMAGE.into()),
            tag: Some(PROBE_TAG.into()),
            ..Default::default()
        };
        self.docker
            .create_image(
                Some(opts),
                Some(bollard::body_full(probe_image_tar()?)),
                None,
            )
            .try_collect::<Vec<_>>()
            .await
            .map_err(|e| {
                StartError::Backend(format!("importing the host-path probe image: {e}"))
            })?;
        let mut result = Ok(());
        for root in roots {
            result = self.probe_root(&image, root).await;
            if result.is_err() {
                break;
            }
        }
        let _ = self
            .docker
            .remove_image(
                &image,
                Some(RemoveImageOptions {
                    force: true,
                    ..Default::default()
                }),
                None,
            )
            .await;
        result
    }

    async fn probe_root(&self, image: &str, root: &Path) -> Result<(), StartError> {
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let file = format!(".sandbolt-probe-{nonce}");
        let local = root.join(&file);
        std::fs::write(&local, &nonce).map_err(|e| {
            StartError::Config(format!(
                "allow_host_paths entry {}: cannot write the probe file that checks the docker \
                 engine sees this directory: {e}",
                root.display()
            ))
        })?;
        let name = format!("sandbolt-probe-{nonce}");
        let seen = self.read_through_engine(image, &name, root, &file).await;
        let _ = std::fs::remove_file(&local);
        let _ = self
            .docker
            .remove_container(
                &name,
                Some(RemoveContainerOptions {
                    force: true,
                    ..Default::default()
                }),
            )
            .await;
        match seen {
            Ok(Some(bytes)) if bytes == nonce.as_bytes() => Ok(()),
            Ok(_) => Err(StartError::Config(format!(
                "allow_host_paths entry {}: the docker engine resolves this path to another \
                 directory than this lifecycle does (a probe file written here is not in what \
                 the engine mounts from {0}); the engine resolves host paths on its own \
                 filesystem, so allow only directories the engine and the lifecycle share at \
                 the same path",
                root.display()
            ))),
            Err(e) => Err(StartError::Backend(format!(
                "allow_host_paths entry {}: checking what the docker engine sees there: {e}",
                root.display()
            ))),
        }
    }

    /// `file` under `root` as the engine reads it; `None` if the engine
    /// has no such file there.
    async fn read_through_engine(
        &self,
        image: &str,
        name: &str,
        root: &Path,
        file: &str,
    ) -> Result<Option<Vec<u8>>, bollard::errors::Error> {
        let body = ContainerCreateBody {
            image: Some(image.into()),
            cmd: Some(vec!["/probe".into()]),
            network_disabled: Some(true),
            host_config: Some(HostConfig {
                mounts: Some(vec![Mount {
                    target: Some(PROBE_TARGET.into()),
                    source: Some(root.to_string_lossy().into_owned()),
                    typ: Some(MountType::BIND),
                    read_only: Some(true),
                    ..Default::default()
                }]),
                network_mode: Some("none".into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let opts = CreateContainerOptions {
            name: Some(name.into()),
            ..Default::default()
        };
        match self.docker.create_container(Some(opts), body).await {
            Ok(_) => {}
            // The engine has no such directory to bind.
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 400 | 404,
                ..
            }) => return Ok(None),
            Err(e) => return Err(e),
        }
        let download = DownloadFromContainerOptions {
            path: format!("{PROBE_TARGET}/{file}"),
        };
        match self
            .docker
            .download_from_container(name, Some(download))
            .try_fold(Vec::new(), |mut acc, chunk| async move {
                acc.extend_from_slice(&chunk);
                Ok(acc)
            })
            .await
        {
            Ok(tar) => Ok(single_file(&tar)),
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every host binding of this engine's sandboxes (any state: a stopped
    /// container keeps its binding and may start again).
    pub(crate) async fn existing_bindings(&self) -> ApiResult<Vec<Binding>> {
        let opts = ListContainersOptions {
            all: true,
            filters: Some(HashMap::from([(
                "label".to_string(),
                vec![LABEL_ID.to_string()],
            )])),
            ..Default::default()
        };
        let all = self
            .docker
            .list_containers(Some(opts))
            .await
            .map_err(|e| map_engine_answer("*", e))?;
        let mut out = Vec::new();
        for c in all {
            let sandbox = c
                .labels
                .as_ref()
                .and_then(|l| l.get(LABEL_ID))
                .cloned()
                .unwrap_or_default();
            for m in c.mounts.into_iter().flatten() {
                if m.typ.as_deref() != Some("bind") {
                    continue;
                }
                if let Some(source) = m.source {
                    out.push(Binding {
                        sandbox: sandbox.clone(),
                        source: PathBuf::from(source),
                        read_write: m.rw.unwrap_or(true),
                    });
                }
            }
        }
        Ok(out)
    }

    /// Makes sure each `pvc` of the plan can be mounted: an existing Docker
    /// volume is used as it is if sandbolt made it (labelled), refused (403)
    /// if not; a missing one is created (labelled with the sandbox) when
    /// `createIfNotExists`, refused (404) when not.
    /// `accessModes`, `storage` and `storageClass` are ignored here, as the
    /// OpenSandbox contract says for Docker volumes ("Ignored for Docker
    /// volumes"): the local driver has no access modes, sizes or classes.
    pub(crate) async fn prepare_pvcs(&self, plan: &CreatePlan) -> ApiResult<PreparedPvcs> {
        let mut prepared = PreparedPvcs::default();
        for v in &plan.volumes {
            let VolumeSource::Pvc(claim) = &v.source else {
                continue;
            };
            match self.prepare_pvc(&plan.id, claim).await {
                Ok(true) => {
                    prepared.created.push(claim.claim_name.clone());
                    if claim.delete_on_sandbox_delete {
                        prepared.delete_on_delete.push(claim.claim_name.clone());
                    }
                }
                Ok(false) => {}
                Err(e) => {
                    self.remove_volumes(&prepared.created).await;
                    return Err(e);
                }
            }
        }
        Ok(prepared)
    }

    /// True when this call created the volume.
    async fn prepare_pvc(&self, id: &str, claim: &PvcClaim) -> ApiResult<bool> {
        let name = &claim.claim_name;
        match self.docker.inspect_volume(name).await {
            Ok(v) if is_sandbolt_volume(&v.labels) => return Ok(false),
            Ok(_) => return Err(not_managed(name)),
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => {}
            Err(e) => return Err(map_engine_answer(id, e)),
        }
        if !claim.create_if_missing {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "VOLUME_NOT_FOUND",
                format!(
                    "Volume {name} not found: no Docker volume of that name exists and \
                     pvc.createIfNotExists is false."
                ),
            ));
        }
        let req = VolumeCreateRequest {
            name: Some(name.clone()),
            labels: Some(HashMap::from([
                (VOLUME_LABEL_CREATED_BY.to_string(), id.to_string()),
                (VOLUME_LABEL_MANAGED.to_string(), "true".to_string()),
            ])),
            ..Default::default()
        };
        let v = self
            .docker
            .create_volume(req)
            .await
            .map_err(|e| map_engine_answer(id, e))?;
        // Someone else's create may have won the race: then it is theirs,
        // and mountable only if sandbolt made it too (the engine answers
        // an existing volume with its own labels).
        if !is_sandbolt_volume(&v.labels) {
            return Err(not_managed(name));
        }
        Ok(v.labels.get(VOLUME_LABEL_CREATED_BY).map(String::as_str) == Some(id))
    }

    /// Removes volumes a failed create made (nothing else can use them yet
    /// but a racing create, whose mount then keeps them).
    pub(crate) async fn remove_volumes(&self, names: &[String]) {
        for n in names {
            if let Err(e) = self
                .docker
                .remove_volume(n, None::<RemoveVolumeOptions>)
                .await
            {
                tracing::warn!(volume = %n, error = %e, "cannot remove a volume of a failed create");
            }
        }
    }

    fn pending_dir(&self) -> PathBuf {
        self.data_dir.join("volume-deletes")
    }

    /// Records, before the container goes, the volumes sandbox `id` owes a
    /// removal: a crash between the container's removal and the volumes'
    /// leaves the debt on disk for the next delete.
    pub(crate) fn owe_volume_deletes(&self, id: &str, labels: &HashMap<String, String>) {
        let names: Vec<String> = labels
            .get(LABEL_DELETE_VOLUMES)
            .and_then(|s| serde_json::from_str(s).ok())
            .unwrap_or_default();
        for volume in names {
            let path = self.pending_dir().join(format!("{volume}.json"));
            let debt = PendingDelete {
                volume: volume.clone(),
                created_by: id.to_string(),
            };
            if let Err(e) = write_json(&path, &debt) {
                tracing::warn!(%volume, error = %e, "cannot record a volume removal");
            }
        }
    }

    /// Removes every volume owed a removal whose creator is gone. A volume
    /// still mounted (another sandbox uses it) stays owed, and goes with a
    /// later delete; one recreated by somebody else is not ours to remove.
    pub(crate) async fn settle_volume_deletes(&self) {
        let entries = match std::fs::read_dir(self.pending_dir()) {
            Ok(e) => e,
            Err(_) => return,
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(debt) = read_json::<PendingDelete>(&path) else {
                continue;
            };
            if self.settle(&debt).await {
                let _ = std::fs::remove_file(&path);
            }
        }
    }

    /// True when nothing more is owed for `debt`.
    async fn settle(&self, debt: &PendingDelete) -> bool {
        let v = match self.docker.inspect_volume(&debt.volume).await {
            Ok(v) => v,
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => return true,
            Err(e) => {
                tracing::warn!(volume = %debt.volume, error = %e, "cannot inspect an owed volume");
                return false;
            }
        };
        if v.labels.get(VOLUME_LABEL_CREATED_BY) != Some(&debt.created_by) {
            return true;
        }
        match self
            .docker
            .remove_volume(&debt.volume, None::<RemoveVolumeOptions>)
            .await
        {
            Ok(()) => {
                tracing::info!(volume = %debt.volume, sandbox = %debt.created_by, "volume removed with its sandbox");
                true
            }
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => true,
            Err(e) => {
                tracing::info!(volume = %debt.volume, error = %e, "volume still in use; removed with a later delete");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(sandbox: &str, source: &str, rw: bool) -> Binding {
        Binding {
            sandbox: sandbox.into(),
            source: source.into(),
            read_write: rw,
        }
    }

    #[test]
    fn a_read_write_binding_never_contains_another() {
        let existing = [b("s1", "/srv/a/b", false), b("s2", "/srv/w", true)];
        // RW parent of s1's binding: refused, naming both and the sandbox.
        let e = check_bindings(&[("x", Path::new("/srv/a"), true)], &existing).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(
            e.message.contains("'/srv/a'")
                && e.message.contains("/srv/a/b")
                && e.message.contains("s1"),
            "{}",
            e.message
        );
        // Read-only parent: it cannot redirect anything.
        check_bindings(&[("x", Path::new("/srv/a"), false)], &existing).unwrap();
        // Anything inside s2's read-write binding: refused either way.
        for rw in [true, false] {
            let e = check_bindings(&[("x", Path::new("/srv/w/task"), rw)], &existing).unwrap_err();
            assert!(e.message.contains("s2"), "{}", e.message);
        }
        // The same directory, siblings, and a string prefix that is not a
        // path prefix are fine.
        for p in ["/srv/w", "/srv/a/c", "/srv/ab", "/srv/a/b"] {
            check_bindings(&[("x", Path::new(p), true)], &existing).unwrap();
        }
        // Nothing to check against.
        check_bindings(&[("x", Path::new("/"), true)], &[]).unwrap();
        let e = check_bindings(&[("x", Path::new("/"), true)], &existing).unwrap_err();
        assert_eq!(e.code, "VOLUME::HOST_PATH_CONTAINS_BINDING");
    }

    #[test]
    fn the_probe_image_is_one_file() {
        let tar = probe_image_tar().unwrap();
        assert_eq!(single_file(&tar).unwrap(), b"");
    }
}
