//! `sandbolt.control.v1.VolumeService`: translation only; the work is in
//! [`crate::volume`].

use std::sync::Arc;

use sandbolt_proto::agent::v1 as apb;
use sandbolt_proto::control::v1 as pb;
use sandbolt_proto::control::v1::volume_service_server::VolumeService;
use tonic::{Request, Response, Status};

use crate::ids::SandboxKey;
use crate::sandbox::Core;
use crate::volume::{
    BACKEND_JUICEFS, ForkVolume, NewVolume, VolumeView, access_mode_in, check_backend, parse_size,
};

pub struct VolumeServer {
    core: Arc<Core>,
}

impl VolumeServer {
    pub fn new(core: Arc<Core>) -> Self {
        Self { core }
    }
}

fn snapshot_out(s: &apb::VolumeSnapshot) -> pb::VolumeSnapshot {
    pb::VolumeSnapshot {
        volume: s.volume.clone(),
        name: s.name.clone(),
        created_at_unix_ms: s.created_at_unix_ms,
    }
}

/// A volume in the control API's shape; mount holders are named by their
/// sandbox's namespace and name (an id no record has keeps its id as name).
pub(crate) fn named_volume(core: &Core, v: &VolumeView) -> pb::NamedVolume {
    let info = &v.info;
    let spec = info.spec.clone().unwrap_or_default();
    let mut records = None;
    let mounts = v
        .holders
        .iter()
        .map(|(agent, m)| {
            let key = core.mount_holder(agent, &m.sandbox_id, &mut records);
            let (namespace, sandbox_name) = match key {
                Some(SandboxKey { namespace, name }) => (namespace, name),
                None => (String::new(), m.sandbox_id.clone()),
            };
            pb::VolumeMountHolder {
                namespace,
                sandbox_name,
                mount_path: m.mount_path.clone(),
                read_only: m.read_only,
                node_name: core.node_name_of(agent),
            }
        })
        .collect();
    let shared = v.shared();
    pb::NamedVolume {
        name: spec.name,
        backend: if shared { BACKEND_JUICEFS } else { "local" }.into(),
        access_mode: spec.access_mode,
        size_bytes: spec.size_bytes,
        node_name: v.node_name.clone(),
        // A shared volume is held by no agent (any mounted one serves it).
        agent_id: if shared {
            String::new()
        } else {
            v.agent.to_string()
        },
        created_at_unix_ms: info.created_at_unix_ms,
        used_bytes: info.used_bytes,
        capabilities: info.capabilities.as_ref().map(|c| pb::VolumeCapabilities {
            backend: c.backend.clone(),
            instant_snapshots: c.instant_snapshots,
            instant_forks: c.instant_forks,
            quota: c.quota,
            shared: c.shared,
        }),
        snapshots: info.snapshots.iter().map(snapshot_out).collect(),
        mounts,
        forked_from: info.forked_from.clone(),
        available: v.available,
    }
}

#[tonic::async_trait]
impl VolumeService for VolumeServer {
    #[tracing::instrument(name = "volume.CreateVolume", skip_all, fields(volume = %req.get_ref().name))]
    async fn create_volume(
        &self,
        req: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::NamedVolume>, Status> {
        let q = req.into_inner();
        check_backend("backend", &q.backend)?;
        let v = self
            .core
            .create_volume(NewVolume {
                access_mode: access_mode_in("access_mode", q.access_mode)?,
                size_bytes: parse_size("size", &q.size)?,
                name: q.name,
                node_name: q.node_name,
                pool: q.pool,
                backend: q.backend,
            })
            .await?;
        Ok(Response::new(named_volume(&self.core, &v)))
    }

    #[tracing::instrument(name = "volume.GetVolume", skip_all, fields(volume = %req.get_ref().name))]
    async fn get_volume(
        &self,
        req: Request<pb::VolumeRef>,
    ) -> Result<Response<pb::NamedVolume>, Status> {
        let v = self.core.get_volume(&req.get_ref().name).await?;
        Ok(Response::new(named_volume(&self.core, &v)))
    }

    #[tracing::instrument(name = "volume.ListVolumes", skip_all)]
    async fn list_volumes(
        &self,
        _req: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        let items = self
            .core
            .list_volumes()
            .iter()
            .map(|v| named_volume(&self.core, v))
            .collect();
        Ok(Response::new(pb::ListVolumesResponse { items }))
    }

    #[tracing::instrument(name = "volume.DeleteVolume", skip_all, fields(volume = %req.get_ref().name))]
    async fn delete_volume(
        &self,
        req: Request<pb::VolumeRef>,
    ) -> Result<Response<pb::NamedVolume>, Status> {
        let v = self.core.delete_volume(&req.get_ref().name).await?;
        Ok(Response::new(named_volume(&self.core, &v)))
    }

    #[tracing::instrument(name = "volume.CreateVolumeSnapshot", skip_all, fields(volume = %req.get_ref().volume, snapshot = %req.get_ref().name))]
    async fn create_volume_snapshot(
        &self,
        req: Request<pb::CreateVolumeSnapshotRequest>,
    ) -> Result<Response<pb::VolumeSnapshot>, Status> {
        let q = req.get_ref();
        let s = self.core.create_volume_snapshot(&q.volume, &q.name).await?;
        Ok(Response::new(snapshot_out(&s)))
    }

    #[tracing::instrument(name = "volume.ListVolumeSnapshots", skip_all, fields(volume = %req.get_ref().name))]
    async fn list_volume_snapshots(
        &self,
        req: Request<pb::VolumeRef>,
    ) -> Result<Response<pb::ListVolumeSnapshotsResponse>, Status> {
        let items = self
            .core
            .list_volume_snapshots(&req.get_ref().name)
            .await?
            .iter()
            .map(snapshot_out)
            .collect();
        Ok(Response::new(pb::ListVolumeSnapshotsResponse { items }))
    }

    #[tracing::instrument(name = "volume.DeleteVolumeSnapshot", skip_all, fields(volume = %req.get_ref().volume, snapshot = %req.get_ref().name))]
    async fn delete_volume_snapshot(
        &self,
        req: Request<pb::VolumeSnapshotRef>,
    ) -> Result<Response<pb::VolumeSnapshot>, Status> {
        let q = req.get_ref();
        let s = self.core.delete_volume_snapshot(&q.volume, &q.name).await?;
        Ok(Response::new(snapshot_out(&s)))
    }

    #[tracing::instrument(name = "volume.RestoreVolume", skip_all, fields(volume = %req.get_ref().volume, snapshot = %req.get_ref().snapshot))]
    async fn restore_volume(
        &self,
        req: Request<pb::RestoreVolumeRequest>,
    ) -> Result<Response<pb::NamedVolume>, Status> {
        let q = req.get_ref();
        let v = self.core.restore_volume(&q.volume, &q.snapshot).await?;
        Ok(Response::new(named_volume(&self.core, &v)))
    }

    #[tracing::instrument(name = "volume.ForkVolume", skip_all, fields(source = %req.get_ref().source, volume = %req.get_ref().name))]
    async fn fork_volume(
        &self,
        req: Request<pb::ForkVolumeRequest>,
    ) -> Result<Response<pb::NamedVolume>, Status> {
        let q = req.into_inner();
        let v = self
            .core
            .fork_volume(ForkVolume {
                access_mode: access_mode_in("access_mode", q.access_mode)?,
                size_bytes: parse_size("size", &q.size)?,
                source: q.source,
                snapshot: q.snapshot,
                name: q.name,
            })
            .await?;
        Ok(Response::new(named_volume(&self.core, &v)))
    }
}
