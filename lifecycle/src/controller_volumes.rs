//! Controller backend, named volumes: each route is one call of the
//! controller's `sandbolt.control.v1.VolumeService` (or `SandboxService`'s
//! AttachVolume / DetachVolume), and each refusal gets its REST meaning
//! here. A NOT_FOUND of a call that names two things (a volume and its
//! snapshot, a sandbox and a volume) is told apart by asking for the outer
//! one, not by reading the controller's words.

use axum::http::StatusCode;
use chrono::DateTime;
use sandbolt_proto::auth::BearerToken;
use sandbolt_proto::control::v1 as pb;
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::controller::{ControllerBackend, check_id, map_code, volume};
use crate::error::{ApiError, ApiResult};
use crate::model::rfc3339;
use crate::named_volumes::{
    AccessMode, BACKEND_LOCAL, Capabilities, HostOut, MountHolder, PvcOut, SandboxVolume, Snapshot,
    Volume, VolumeCreate, VolumeFork, bytes_quantity, snapshot_not_found, volume_not_found,
};
use crate::validate::CreatePlan;
use crate::volumes::{VolumeMount, VolumeSource};

pub(crate) type VolumeClient =
    pb::volume_service_client::VolumeServiceClient<InterceptedService<Channel, BearerToken>>;

/// `Retry-After` of a volume whose node is not reporting: a few
/// heartbeats, after which the controller knows whether it is back.
pub(crate) const RETRY_AFTER_SECS: u32 = 5;

/// Which volume call was refused: where FAILED_PRECONDITION and
/// ALREADY_EXISTS mean something particular.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum VolumeCall {
    /// Delete and restore: refused while any sandbox mounts the volume.
    WhileUnmounted,
    /// A snapshot's create (its name is what already exists).
    Snapshot,
    /// An unmount: NOT_FOUND of an existing sandbox is "not mounted there".
    Detach,
    /// Everything else: create, fork, get, attach, detach.
    Other,
}

/// What a NOT_FOUND can be about.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target<'a> {
    Volume(&'a str),
    /// A volume's snapshot: missing volume or missing snapshot.
    Snapshot(&'a str, &'a str),
    /// Sandbox `.0` and named volume `.1`.
    Sandbox(&'a str, &'a str),
}

pub(crate) fn to_pb_mode(m: Option<AccessMode>) -> i32 {
    (match m {
        None => pb::AccessMode::Unspecified,
        Some(AccessMode::ReadWriteOnce) => pb::AccessMode::ReadWriteOnce,
        Some(AccessMode::ReadOnlyMany) => pb::AccessMode::ReadOnlyMany,
        Some(AccessMode::ReadWriteMany) => pb::AccessMode::ReadWriteMany,
    }) as i32
}

/// The REST name of a mode; UNSPECIFIED is what the proto defines it to
/// mean, ReadWriteOnce.
fn mode_name(m: i32) -> &'static str {
    match pb::AccessMode::try_from(m).unwrap_or(pb::AccessMode::Unspecified) {
        pb::AccessMode::ReadOnlyMany => AccessMode::ReadOnlyMany.as_str(),
        pb::AccessMode::ReadWriteMany => AccessMode::ReadWriteMany.as_str(),
        pb::AccessMode::ReadWriteOnce | pb::AccessMode::Unspecified => {
            AccessMode::ReadWriteOnce.as_str()
        }
    }
}

fn time(ms: i64) -> String {
    rfc3339(DateTime::from_timestamp_millis(ms).unwrap_or_default())
}

pub(crate) fn to_snapshot(s: &pb::VolumeSnapshot) -> Snapshot {
    Snapshot {
        volume: s.volume.clone(),
        name: s.name.clone(),
        created_at: time(s.created_at_unix_ms),
    }
}

/// The native volume as the REST API shows it.
pub(crate) fn to_volume(v: &pb::NamedVolume) -> Volume {
    let caps = v.capabilities.clone().unwrap_or_default();
    Volume {
        name: v.name.clone(),
        backend: if v.backend.is_empty() {
            BACKEND_LOCAL.into()
        } else {
            v.backend.clone()
        },
        access_mode: mode_name(v.access_mode),
        size: (v.size_bytes > 0).then(|| bytes_quantity(v.size_bytes)),
        size_bytes: v.size_bytes.max(0),
        node_name: v.node_name.clone(),
        created_at: time(v.created_at_unix_ms),
        used_bytes: (v.used_bytes >= 0).then_some(v.used_bytes),
        capabilities: Capabilities {
            backend: caps.backend,
            instant_snapshots: caps.instant_snapshots,
            instant_forks: caps.instant_forks,
            quota: caps.quota,
            shared: caps.shared,
        },
        snapshots: v.snapshots.iter().map(to_snapshot).collect(),
        mounts: v
            .mounts
            .iter()
            .map(|m| MountHolder {
                sandbox_id: m.sandbox_name.clone(),
                namespace: m.namespace.clone(),
                mount_path: m.mount_path.clone(),
                read_only: m.read_only,
                node_name: m.node_name.clone(),
            })
            .collect(),
        forked_from: (!v.forked_from.is_empty()).then(|| v.forked_from.clone()),
        available: v.available,
    }
}

/// Every volume a sandbox record mounts, in the create request's shape.
pub(crate) fn sandbox_volumes(s: &pb::Sandbox) -> Vec<SandboxVolume> {
    let spec = s.spec.clone().unwrap_or_default();
    spec.volumes
        .into_iter()
        .map(|v| SandboxVolume {
            name: v.name,
            mount_path: v.mount_path,
            read_only: v.read_only,
            sub_path: (!v.sub_path.is_empty()).then_some(v.sub_path),
            host: match &v.source {
                Some(pb::volume::Source::Host(h)) => Some(HostOut {
                    path: h.path.clone(),
                }),
                _ => None,
            },
            pvc: match v.source {
                Some(pb::volume::Source::Pvc(p)) => Some(PvcOut {
                    claim_name: p.claim_name,
                }),
                _ => None,
            },
        })
        .collect()
}

/// The claim a detach names: `volume` when a mounted pvc has that claim
/// name, else the claim of the sandbox's volume entry named `volume`, else
/// `volume` as given (and the controller's NOT_FOUND says it is not there).
fn claim_for(s: &pb::Sandbox, volume: &str) -> String {
    let spec = s.spec.clone().unwrap_or_default();
    let pvcs: Vec<(String, String)> = spec
        .volumes
        .into_iter()
        .filter_map(|v| match v.source {
            Some(pb::volume::Source::Pvc(p)) => Some((v.name, p.claim_name)),
            _ => None,
        })
        .collect();
    if pvcs.iter().any(|(_, claim)| claim == volume) {
        return volume.to_string();
    }
    pvcs.into_iter()
        .find(|(name, _)| name == volume)
        .map_or_else(|| volume.to_string(), |(_, claim)| claim)
}

/// A refusal that is not NOT_FOUND, in REST terms.
pub(crate) fn map_volume_status(call: VolumeCall, subject: &str, s: &tonic::Status) -> ApiError {
    let msg = s.message().to_string();
    match s.code() {
        Code::AlreadyExists if call == VolumeCall::Snapshot => {
            ApiError::conflict("SNAPSHOT_ALREADY_EXISTS", msg)
        }
        Code::AlreadyExists => ApiError::conflict("VOLUME_ALREADY_EXISTS", msg),
        Code::FailedPrecondition if call == VolumeCall::WhileUnmounted => {
            ApiError::conflict("VOLUME_IN_USE", msg)
        }
        // An access mode that forbids the mount, a paused sandbox, a volume
        // on another node: the message says which.
        Code::FailedPrecondition => ApiError::conflict("VOLUME_CONFLICT", msg),
        Code::Unavailable => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "VOLUME_UNAVAILABLE",
            format!("{subject} cannot be reached now: {msg}"),
        )
        .with_retry_after(RETRY_AFTER_SECS),
        // No node with a volume root, or its volume root is full: storage,
        // not a rate.
        Code::ResourceExhausted => ApiError::new(
            StatusCode::INSUFFICIENT_STORAGE,
            "VOLUME_STORAGE_EXHAUSTED",
            msg,
        ),
        Code::Unimplemented => ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "VOLUME::NAMED_VOLUMES_UNSUPPORTED",
            format!("the controller does not serve named volumes: {msg}"),
        ),
        code => map_code(code, subject, msg),
    }
}

/// The 404 of a NOT_FOUND for a sandbox that exists: the volume is not
/// mounted there (detach) or does not exist (attach without create).
fn not_in_sandbox(id: &str, volume: &str, detach: bool) -> ApiError {
    if detach {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "VOLUME_NOT_FOUND",
            format!("Volume {volume} is not mounted in sandbox {id}."),
        )
    } else {
        volume_not_found(volume)
    }
}

impl ControllerBackend {
    /// The REST error of a refused volume call; NOT_FOUND is resolved to
    /// what is missing (one more read, on the error path only).
    async fn refused(&self, call: VolumeCall, target: Target<'_>, s: tonic::Status) -> ApiError {
        if s.code() != Code::NotFound {
            let subject = match target {
                Target::Volume(v) | Target::Snapshot(v, _) | Target::Sandbox(_, v) => {
                    format!("volume {v}")
                }
            };
            return map_volume_status(call, &subject, &s);
        }
        tracing::debug!(?target, error = %s.message(), "volume call: not found");
        match target {
            Target::Volume(v) => volume_not_found(v),
            Target::Snapshot(v, snap) => {
                let r = self
                    .volume_client()
                    .get_volume(pb::VolumeRef { name: v.into() })
                    .await;
                match r {
                    Ok(_) => snapshot_not_found(v, snap),
                    Err(e) if e.code() == Code::NotFound => volume_not_found(v),
                    Err(e) => map_volume_status(call, &format!("volume {v}"), &e),
                }
            }
            Target::Sandbox(id, v) => match self.read(id).await {
                Ok(_) => not_in_sandbox(id, v, call == VolumeCall::Detach),
                Err(e) if e.code() == Code::NotFound => ApiError::not_found(id),
                Err(e) => map_code(e.code(), id, e.message().to_string()),
            },
        }
    }

    pub(crate) async fn vol_create(&self, req: VolumeCreate) -> ApiResult<Volume> {
        let r = pb::CreateVolumeRequest {
            name: req.name.clone(),
            access_mode: to_pb_mode(req.access_mode),
            size: req.size.unwrap_or_default(),
            backend: req.backend.unwrap_or_else(|| BACKEND_LOCAL.into()),
            node_name: req.node_name.unwrap_or_default(),
            pool: String::new(),
        };
        match self.volume_client().create_volume(r).await {
            Ok(v) => Ok(to_volume(&v.into_inner())),
            Err(s) => Err(self
                .refused(VolumeCall::Other, Target::Volume(&req.name), s)
                .await),
        }
    }

    pub(crate) async fn vol_get(&self, name: &str) -> ApiResult<Volume> {
        let r = pb::VolumeRef { name: name.into() };
        match self.volume_client().get_volume(r).await {
            Ok(v) => Ok(to_volume(&v.into_inner())),
            Err(s) => Err(self
                .refused(VolumeCall::Other, Target::Volume(name), s)
                .await),
        }
    }

    pub(crate) async fn vol_list(&self) -> ApiResult<Vec<Volume>> {
        match self
            .volume_client()
            .list_volumes(pb::ListVolumesRequest {})
            .await
        {
            Ok(r) => Ok(r.into_inner().items.iter().map(to_volume).collect()),
            Err(s) => Err(map_volume_status(VolumeCall::Other, "volumes", &s)),
        }
    }

    pub(crate) async fn vol_delete(&self, name: &str) -> ApiResult<()> {
        let r = pb::VolumeRef { name: name.into() };
        match self.volume_client().delete_volume(r).await {
            Ok(_) => Ok(()),
            Err(s) => Err(self
                .refused(VolumeCall::WhileUnmounted, Target::Volume(name), s)
                .await),
        }
    }

    pub(crate) async fn vol_snapshot(&self, volume: &str, snapshot: &str) -> ApiResult<Snapshot> {
        let r = pb::CreateVolumeSnapshotRequest {
            volume: volume.into(),
            name: snapshot.into(),
        };
        match self.volume_client().create_volume_snapshot(r).await {
            Ok(s) => Ok(to_snapshot(&s.into_inner())),
            Err(s) => Err(self
                .refused(VolumeCall::Snapshot, Target::Volume(volume), s)
                .await),
        }
    }

    pub(crate) async fn vol_snapshots(&self, volume: &str) -> ApiResult<Vec<Snapshot>> {
        let r = pb::VolumeRef {
            name: volume.into(),
        };
        match self.volume_client().list_volume_snapshots(r).await {
            Ok(r) => Ok(r.into_inner().items.iter().map(to_snapshot).collect()),
            Err(s) => Err(self
                .refused(VolumeCall::Other, Target::Volume(volume), s)
                .await),
        }
    }

    pub(crate) async fn vol_delete_snapshot(&self, volume: &str, snapshot: &str) -> ApiResult<()> {
        let r = pb::VolumeSnapshotRef {
            volume: volume.into(),
            name: snapshot.into(),
        };
        match self.volume_client().delete_volume_snapshot(r).await {
            Ok(_) => Ok(()),
            Err(s) => Err(self
                .refused(VolumeCall::Other, Target::Snapshot(volume, snapshot), s)
                .await),
        }
    }

    pub(crate) async fn vol_restore(&self, volume: &str, snapshot: &str) -> ApiResult<Volume> {
        let r = pb::RestoreVolumeRequest {
            volume: volume.into(),
            snapshot: snapshot.into(),
        };
        match self.volume_client().restore_volume(r).await {
            Ok(v) => Ok(to_volume(&v.into_inner())),
            Err(s) => Err(self
                .refused(
                    VolumeCall::WhileUnmounted,
                    Target::Snapshot(volume, snapshot),
                    s,
                )
                .await),
        }
    }

    pub(crate) async fn vol_fork(&self, fork: VolumeFork) -> ApiResult<Volume> {
        let r = pb::ForkVolumeRequest {
            source: fork.source.clone(),
            snapshot: fork.snapshot.clone().unwrap_or_default(),
            name: fork.name.clone(),
            access_mode: to_pb_mode(fork.access_mode),
            size: fork.size.clone().unwrap_or_default(),
        };
        match self.volume_client().fork_volume(r).await {
            Ok(v) => Ok(to_volume(&v.into_inner())),
            Err(s) => {
                let target = match &fork.snapshot {
                    Some(snap) => Target::Snapshot(&fork.source, snap),
                    None => Target::Volume(&fork.source),
                };
                Err(self.refused(VolumeCall::Other, target, s).await)
            }
        }
    }

    pub(crate) async fn vol_attach(
        &self,
        id: &str,
        mount: VolumeMount,
    ) -> ApiResult<Vec<SandboxVolume>> {
        check_id(id)?;
        let claim = match &mount.source {
            VolumeSource::Pvc(c) => c.claim_name.clone(),
            other => return Err(crate::volumes::unsupported(other.kind(), "attach")),
        };
        let r = pb::AttachVolumeRequest {
            sandbox: Some(self.reference(id)),
            volume: Some(volume(&mount)?),
        };
        match self.client().attach_volume(r).await {
            Ok(s) => Ok(sandbox_volumes(&s.into_inner())),
            Err(s) => Err(self
                .refused(VolumeCall::Other, Target::Sandbox(id, &claim), s)
                .await),
        }
    }

    pub(crate) async fn vol_detach(&self, id: &str, volume: &str) -> ApiResult<()> {
        check_id(id)?;
        let sandbox = self
            .read(id)
            .await
            .map_err(|s| map_code(s.code(), id, s.message().to_string()))?;
        let claim = claim_for(&sandbox, volume);
        let r = pb::DetachVolumeRequest {
            sandbox: Some(self.reference(id)),
            volume: claim.clone(),
        };
        match self.client().detach_volume(r).await {
            Ok(_) => Ok(()),
            Err(s) => Err(self
                .refused(VolumeCall::Detach, Target::Sandbox(id, &claim), s)
                .await),
        }
    }

    /// The REST error of a refused sandbox create that mounts named
    /// volumes: a missing volume the request would not create is a 404
    /// naming it, an access-mode or placement conflict a 409, a volume node
    /// that is down a 503 to retry; the rest as any create.
    pub(crate) async fn create_refused(&self, plan: &CreatePlan, s: tonic::Status) -> ApiError {
        let claims: Vec<_> = plan
            .volumes
            .iter()
            .filter_map(|v| match &v.source {
                VolumeSource::Pvc(c) => Some(c),
                _ => None,
            })
            .collect();
        if claims.is_empty() {
            return crate::controller::map_create_status(&plan.id, s);
        }
        match s.code() {
            Code::NotFound => {
                for c in claims.iter().filter(|c| !c.create_if_missing) {
                    let r = pb::VolumeRef {
                        name: c.claim_name.clone(),
                    };
                    if let Err(e) = self.volume_client().get_volume(r).await
                        && e.code() == Code::NotFound
                    {
                        let mut err = volume_not_found(&c.claim_name);
                        err.message = format!(
                            "Volume {} not found (pvc.createIfNotExists is false).",
                            c.claim_name
                        );
                        return err;
                    }
                }
                crate::controller::map_create_status(&plan.id, s)
            }
            Code::FailedPrecondition => ApiError::conflict("VOLUME_CONFLICT", s.message()),
            // Most likely the volume's node is silent (the controller's
            // words say); "controller unavailable" would send the reader
            // to the wrong machine.
            Code::Unavailable => ApiError::unavailable(format!(
                "sandbox {} cannot be placed now: {}",
                plan.id,
                s.message()
            ))
            .with_retry_after(RETRY_AFTER_SECS),
            _ => crate::controller::map_create_status(&plan.id, s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named() -> pb::NamedVolume {
        pb::NamedVolume {
            name: "data".into(),
            backend: "local".into(),
            access_mode: pb::AccessMode::ReadOnlyMany as i32,
            size_bytes: 2 << 30,
            node_name: "node-1".into(),
            agent_id: "agent-1".into(),
            created_at_unix_ms: 1_800_000_000_123,
            used_bytes: -1,
            capabilities: Some(pb::VolumeCapabilities {
                backend: "btrfs".into(),
                instant_snapshots: true,
                instant_forks: true,
                quota: true,
                shared: false,
            }),
            snapshots: vec![pb::VolumeSnapshot {
                volume: "data".into(),
                name: "s1".into(),
                created_at_unix_ms: 1_800_000_000_000,
            }],
            mounts: vec![pb::VolumeMountHolder {
                namespace: "default".into(),
                sandbox_name: "sbx-1".into(),
                mount_path: "/data".into(),
                read_only: true,
                node_name: String::new(),
            }],
            forked_from: "base@s0".into(),
            available: true,
        }
    }

    #[test]
    fn the_native_volume_renders_as_documented() {
        let j = serde_json::to_value(to_volume(&named())).unwrap();
        assert_eq!(
            j,
            serde_json::json!({
                "name": "data",
                "backend": "local",
                "accessMode": "ReadOnlyMany",
                "size": "2Gi",
                "sizeBytes": 2u64 << 30,
                "nodeName": "node-1",
                "createdAt": "2027-01-15T08:00:00.123000Z",
                "usedBytes": null,
                "capabilities": {"backend": "btrfs", "instantSnapshots": true, "instantForks": true, "quota": true, "shared": false},
                "snapshots": [{"volume": "data", "name": "s1", "createdAt": "2027-01-15T08:00:00.000000Z"}],
                "mounts": [{"sandboxId": "sbx-1", "namespace": "default", "mountPath": "/data", "readOnly": true}],
                "forkedFrom": "base@s0",
                "available": true,
            })
        );
        let mut bare = named();
        bare.size_bytes = 0;
        bare.used_bytes = 4096;
        bare.forked_from.clear();
        bare.access_mode = 0;
        let v = to_volume(&bare);
        assert_eq!(
            (v.size, v.used_bytes, v.forked_from, v.access_mode),
            (None, Some(4096), None, "ReadWriteOnce")
        );
    }

    #[test]
    fn refusals_keep_their_meaning() {
        use tonic::Status;
        for (call, status, want, code) in [
            (
                VolumeCall::Other,
                Status::already_exists("taken"),
                409,
                "VOLUME_ALREADY_EXISTS",
            ),
            (
                VolumeCall::Snapshot,
                Status::already_exists("taken"),
                409,
                "SNAPSHOT_ALREADY_EXISTS",
            ),
            (
                VolumeCall::WhileUnmounted,
                Status::failed_precondition("mounted by sbx-1"),
                409,
                "VOLUME_IN_USE",
            ),
            (
                VolumeCall::Other,
                Status::failed_precondition("ReadWriteOnce: sbx-1 writes"),
                409,
                "VOLUME_CONFLICT",
            ),
            (
                VolumeCall::Other,
                Status::resource_exhausted("volume root full"),
                507,
                "VOLUME_STORAGE_EXHAUSTED",
            ),
            (
                VolumeCall::Other,
                Status::invalid_argument("size: not a quantity"),
                400,
                "INVALID_REQUEST",
            ),
            (
                VolumeCall::Other,
                Status::unimplemented("volumes"),
                501,
                "VOLUME::NAMED_VOLUMES_UNSUPPORTED",
            ),
            (
                VolumeCall::Other,
                Status::internal("boom"),
                500,
                "INTERNAL_ERROR",
            ),
        ] {
            let e = map_volume_status(call, "volume data", &status);
            assert_eq!((e.status.as_u16(), e.code), (want, code), "{status:?}");
            assert!(e.message.contains(status.message()), "{}", e.message);
        }
        let e = map_volume_status(
            VolumeCall::Other,
            "volume data",
            &Status::unavailable("node node-1 silent for 12s"),
        );
        assert_eq!(e.status, 503);
        assert_eq!(e.retry_after_secs, Some(RETRY_AFTER_SECS));
        assert!(e.message.contains("node-1"), "{}", e.message);
    }

    #[test]
    fn detach_finds_the_claim_by_claim_or_entry_name() {
        let pvc = |name: &str, claim: &str| pb::Volume {
            name: name.into(),
            source: Some(pb::volume::Source::Pvc(pb::PvcSource {
                claim_name: claim.into(),
                ..Default::default()
            })),
            mount_path: format!("/{name}"),
            ..Default::default()
        };
        let s = pb::Sandbox {
            spec: Some(pb::SandboxSpec {
                volumes: vec![pvc("data", "vol-a"), pvc("vol-a2", "b")],
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(claim_for(&s, "vol-a"), "vol-a");
        assert_eq!(claim_for(&s, "data"), "vol-a");
        assert_eq!(claim_for(&s, "b"), "b");
        assert_eq!(claim_for(&s, "vol-a2"), "b");
        assert_eq!(claim_for(&s, "other"), "other");
        let vols = sandbox_volumes(&s);
        assert_eq!(vols[0].pvc.as_ref().unwrap().claim_name, "vol-a");
        assert_eq!(vols[0].mount_path, "/data");
    }
}
