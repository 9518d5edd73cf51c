//! The `sandbolt.agent.v1.AgentService` gRPC server. Its bearer-token check
//! is `sandbolt_proto::auth::RequireBearer` (see `Agent::start`).

use std::sync::Arc;
use std::time::Duration;

use sandbolt_proto::agent::v1;
use sandbolt_proto::agent::v1::agent_service_server::AgentService;
use sandbolt_proto::agent::v1::{
    CreateSandboxRequest, CreateSandboxResponse, DeleteSandboxRequest, DeleteSandboxResponse,
    GetInventoryRequest, ImageInfo, Inventory, RuntimeSupport, SandboxRef, SandboxStatus,
};
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::error::AgentError;
use crate::sandbox::{Sandboxes, now_ms};

/// What the inventory reports besides the sandbox table.
#[derive(Debug, Clone)]
pub struct Identity {
    pub agent_id: String,
    pub instance_id: String,
    pub node_name: String,
    pub pool: String,
    pub namespace: String,
    pub max_sandboxes: i32,
    pub api_endpoint: String,
    pub proxy_endpoint: String,
    /// This agent's Kubernetes pod (see `heartbeat::agent_pod`).
    pub pod: Option<v1::AgentPod>,
}

pub struct AgentApi {
    pub sandboxes: Arc<Sandboxes>,
    pub identity: Identity,
    /// The warm sandbox buffer (its targets come with heartbeat answers).
    pub warm_pool: Arc<crate::warm_pool::WarmPool>,
}

impl AgentApi {
    pub async fn inventory(&self) -> Result<Inventory, AgentError> {
        let images = self
            .sandboxes
            .images
            .inventory()
            .await?
            .into_iter()
            .map(|i| ImageInfo {
                references: i.references,
                digest: i.digest,
                size_bytes: i.size_bytes,
            })
            .collect();
        let id = &self.identity;
        let (warm, warm_starting) = self.sandboxes.warm_inventory();
        Ok(Inventory {
            agent_id: id.agent_id.clone(),
            instance_id: id.instance_id.clone(),
            node_name: id.node_name.clone(),
            pool: id.pool.clone(),
            max_sandboxes: id.max_sandboxes,
            images,
            sandboxes: self.sandboxes.list(),
            api_endpoint: id.api_endpoint.clone(),
            proxy_endpoint: id.proxy_endpoint.clone(),
            runtimes: self
                .sandboxes
                .runtimes()
                .iter()
                .map(|r| RuntimeSupport {
                    name: r.name.clone(),
                    available: r.available,
                    reason: r.reason.clone(),
                    version: r.version.clone(),
                })
                .collect(),
            generated_at_unix_ms: now_ms(),
            // Sandboxes listen inside their own network namespaces: they
            // consume no host ports.
            used_ports: vec![],
            namespace: id.namespace.clone(),
            pool_policy: Some(self.sandboxes.pool_policy()),
            pod: id.pod.clone(),
            volumes: self.volumes().inventory().await,
            volume_capabilities: self.volumes().capabilities(),
            warm,
            warm_starting,
            snapshots: self.sandboxes.snapshots().inventory(),
            juicefs: self.volumes().juicefs_status(),
        })
    }

    fn volumes(&self) -> &crate::volume_mounts::VolumeMounts {
        self.sandboxes.volumes()
    }
}

#[tonic::async_trait]
impl AgentService for AgentApi {
    #[tracing::instrument(skip_all, fields(
        sandbox_id = request.get_ref().spec.as_ref().map_or("", |s| s.sandbox_id.as_str()),
        name = request.get_ref().spec.as_ref().map_or("", |s| s.name.as_str()),
        namespace = request.get_ref().spec.as_ref().map_or("", |s| s.namespace.as_str()),
        snapshot_id = request.get_ref().spec.as_ref().map_or("", |s| s.snapshot_id.as_str()),
    ))]
    async fn create_sandbox(
        &self,
        request: Request<CreateSandboxRequest>,
    ) -> Result<Response<CreateSandboxResponse>, Status> {
        let spec = request
            .into_inner()
            .spec
            .ok_or_else(|| AgentError::InvalidArgument("spec is required".into()))?;
        let created = self.sandboxes.create(spec).await?;
        Ok(Response::new(CreateSandboxResponse {
            status: Some(created.status),
            timings: Some(created.timings),
            claimed_warm: created.claimed_warm,
        }))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn delete_sandbox(
        &self,
        request: Request<DeleteSandboxRequest>,
    ) -> Result<Response<DeleteSandboxResponse>, Status> {
        let r = request.into_inner();
        let grace =
            (r.grace_period_ms > 0).then(|| Duration::from_millis(r.grace_period_ms.into()));
        let existed = self.sandboxes.delete(&r.sandbox_id, grace).await?;
        Ok(Response::new(DeleteSandboxResponse { existed }))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn pause_sandbox(
        &self,
        request: Request<SandboxRef>,
    ) -> Result<Response<SandboxStatus>, Status> {
        let status = self.sandboxes.pause(&request.get_ref().sandbox_id).await?;
        Ok(Response::new(status))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn resume_sandbox(
        &self,
        request: Request<SandboxRef>,
    ) -> Result<Response<SandboxStatus>, Status> {
        let status = self.sandboxes.resume(&request.get_ref().sandbox_id).await?;
        Ok(Response::new(status))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn get_sandbox(
        &self,
        request: Request<SandboxRef>,
    ) -> Result<Response<SandboxStatus>, Status> {
        Ok(Response::new(
            self.sandboxes.get(&request.get_ref().sandbox_id)?,
        ))
    }

    /// Replaces a running sandbox's network policy; answers once the rules
    /// are in place. INVALID_ARGUMENT names the bad field, NOT_FOUND an
    /// unknown sandbox, FAILED_PRECONDITION a policy this agent cannot
    /// enforce (it runs without networking).
    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn update_network_policy(
        &self,
        request: Request<v1::UpdateNetworkPolicyRequest>,
    ) -> Result<Response<SandboxStatus>, Status> {
        let r = request.into_inner();
        let status = self
            .sandboxes
            .update_network_policy(&r.sandbox_id, &r.network_policy_json)
            .await?;
        Ok(Response::new(status))
    }

    #[tracing::instrument(skip_all)]
    async fn get_inventory(
        &self,
        _request: Request<GetInventoryRequest>,
    ) -> Result<Response<Inventory>, Status> {
        Ok(Response::new(self.inventory().await?))
    }
    // Named volumes (see `crate::volume_mounts`). Errors: INVALID_ARGUMENT
    // naming the field, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION
    // (mounted, or the access mode forbids the mount), RESOURCE_EXHAUSTED
    // (the volume root is full), UNAVAILABLE (no volume root here).
    #[tracing::instrument(skip_all, fields(volume = request.get_ref().spec.as_ref().map_or("", |s| s.name.as_str())))]
    async fn create_volume(
        &self,
        request: Request<v1::CreateVolumeRequest>,
    ) -> Result<Response<v1::VolumeInfo>, Status> {
        let info = self.volumes().create(request.into_inner().spec).await?;
        Ok(Response::new(info))
    }

    async fn get_volume(
        &self,
        request: Request<v1::VolumeRef>,
    ) -> Result<Response<v1::VolumeInfo>, Status> {
        Ok(Response::new(
            self.volumes().get(&request.get_ref().name).await?,
        ))
    }

    async fn list_volumes(
        &self,
        _request: Request<v1::ListVolumesRequest>,
    ) -> Result<Response<v1::ListVolumesResponse>, Status> {
        let volumes = self.volumes().list().await?;
        Ok(Response::new(v1::ListVolumesResponse { volumes }))
    }

    #[tracing::instrument(skip_all, fields(volume = %request.get_ref().name))]
    async fn delete_volume(
        &self,
        request: Request<v1::VolumeRef>,
    ) -> Result<Response<v1::DeleteVolumeResponse>, Status> {
        let existed = self.volumes().delete(&request.get_ref().name).await?;
        Ok(Response::new(v1::DeleteVolumeResponse { existed }))
    }

    #[tracing::instrument(skip_all, fields(volume = %request.get_ref().volume, snapshot = %request.get_ref().name))]
    async fn create_volume_snapshot(
        &self,
        request: Request<v1::CreateVolumeSnapshotRequest>,
    ) -> Result<Response<v1::VolumeSnapshot>, Status> {
        let r = request.into_inner();
        reserved_volume_snapshot(&r.name)?;
        Ok(Response::new(
            self.volumes().snapshot(&r.volume, &r.name).await?,
        ))
    }

    #[tracing::instrument(skip_all, fields(volume = %request.get_ref().volume, snapshot = %request.get_ref().name))]
    async fn delete_volume_snapshot(
        &self,
        request: Request<v1::VolumeSnapshotRef>,
    ) -> Result<Response<v1::DeleteVolumeResponse>, Status> {
        let r = request.into_inner();
        reserved_volume_snapshot(&r.name)?;
        let existed = self.volumes().delete_snapshot(&r.volume, &r.name).await?;
        Ok(Response::new(v1::DeleteVolumeResponse { existed }))
    }

    #[tracing::instrument(skip_all, fields(volume = %request.get_ref().volume, snapshot = %request.get_ref().snapshot))]
    async fn restore_volume(
        &self,
        request: Request<v1::RestoreVolumeRequest>,
    ) -> Result<Response<v1::VolumeInfo>, Status> {
        let r = request.into_inner();
        Ok(Response::new(
            self.volumes().restore(&r.volume, &r.snapshot).await?,
        ))
    }

    #[tracing::instrument(skip_all, fields(source = %request.get_ref().source, snapshot = %request.get_ref().snapshot))]
    async fn fork_volume(
        &self,
        request: Request<v1::ForkVolumeRequest>,
    ) -> Result<Response<v1::VolumeInfo>, Status> {
        let r = request.into_inner();
        Ok(Response::new(
            self.volumes().fork(&r.source, &r.snapshot, r.spec).await?,
        ))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn attach_volume(
        &self,
        request: Request<v1::AttachVolumeRequest>,
    ) -> Result<Response<SandboxStatus>, Status> {
        let r = request.into_inner();
        let status = self.sandboxes.attach_volume(&r.sandbox_id, r.mount).await?;
        Ok(Response::new(status))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id, volume = %request.get_ref().volume))]
    async fn detach_volume(
        &self,
        request: Request<v1::DetachVolumeRequest>,
    ) -> Result<Response<SandboxStatus>, Status> {
        let r = request.into_inner();
        let status = self
            .sandboxes
            .detach_volume(&r.sandbox_id, &r.volume)
            .await?;
        Ok(Response::new(status))
    }

    // Sandbox snapshots (see `crate::snapshot`). Errors: INVALID_ARGUMENT
    // (a malformed id), NOT_FOUND (no such sandbox), FAILED_PRECONDITION
    // (the sandbox is not running or paused; the node cannot capture;
    // delete: sandboxes restored from it exist), ALREADY_EXISTS (the id is
    // another sandbox's snapshot).
    #[tracing::instrument(skip_all, fields(snapshot_id = %request.get_ref().snapshot_id, sandbox_id = %request.get_ref().sandbox_id))]
    async fn create_snapshot(
        &self,
        request: Request<v1::CreateSnapshotRequest>,
    ) -> Result<Response<v1::SnapshotInfo>, Status> {
        let r = request.into_inner();
        let sandboxes = self.sandboxes.clone();
        // Its own task: a caller that gives up (deadline, disconnect) must
        // not drop a capture half way, with the sandbox frozen.
        let capture = async move {
            sandboxes
                .create_snapshot(&r.snapshot_id, &r.sandbox_id)
                .await
        };
        let info = tokio::spawn(capture.in_current_span())
            .await
            .map_err(|e| Status::internal(format!("the capture task failed: {e}")))??;
        Ok(Response::new(info))
    }

    #[tracing::instrument(skip_all, fields(snapshot_id = %request.get_ref().snapshot_id))]
    async fn delete_snapshot(
        &self,
        request: Request<v1::SnapshotRef>,
    ) -> Result<Response<v1::DeleteSnapshotResponse>, Status> {
        let existed = self
            .sandboxes
            .delete_snapshot(&request.get_ref().snapshot_id)
            .await?;
        Ok(Response::new(v1::DeleteSnapshotResponse { existed }))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id, tail_lines = request.get_ref().tail_lines))]
    async fn read_sandbox_log(
        &self,
        request: Request<v1::ReadSandboxLogRequest>,
    ) -> Result<Response<v1::SandboxLog>, Status> {
        let log = crate::logs::read_sandbox_log(&self.sandboxes, request.into_inner()).await?;
        Ok(Response::new(log))
    }
}

/// Volume snapshots named `sbs-<id>` belong to sandbox snapshot `<id>` (its
/// capture makes them, its deletion removes them, an agent start removes
/// those without their sandbox snapshot): the volume API may not make or
/// remove one.
fn reserved_volume_snapshot(name: &str) -> Result<(), Status> {
    match name.strip_prefix(crate::snapshot::VOLUME_SNAPSHOT_PREFIX) {
        Some(id) => Err(Status::invalid_argument(format!(
            "name: volume snapshots named {}* belong to sandbox snapshots ({name} is sandbox snapshot {id}'s); choose another name",
            crate::snapshot::VOLUME_SNAPSHOT_PREFIX
        ))),
        None => Ok(()),
    }
}
