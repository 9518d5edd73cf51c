//! The `sandbolt.agent.v1.AgentService` gRPC server. Its bearer-token check
//! is `sandbolt_proto::auth::RequireBearer` (see `Agent::start`).

use std::sync::Arc;
use std::time::Duration;

use sandbolt_proto::agent::v1::agent_service_server::AgentService;
use sandbolt_proto::agent::v1::{
    CreateSandboxRequest, CreateSandboxResponse, DeleteSandboxRequest, DeleteSandboxResponse,
    GetInventoryRequest, ImageInfo, Inventory, RuntimeSupport, SandboxRef, SandboxStatus,
};
use tonic::{Request, Response, Status};

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
    pub pod: Option<sandbolt_proto::agent::v1::AgentPod>,
}

pub struct AgentApi {
    pub sandboxes: Arc<Sandboxes>,
    pub identity: Identity,
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
                })
                .collect(),
            generated_at_unix_ms: now_ms(),
            // Sandboxes listen inside their own network namespaces: they
            // consume no host ports.
            used_ports: vec![],
            namespace: id.namespace.clone(),
            pool_policy: Some(self.sandboxes.pool_policy()),
            pod: id.pod.clone(),
        })
    }
}

#[tonic::async_trait]
impl AgentService for AgentApi {
    #[tracing::instrument(skip_all, fields(
        sandbox_id = request.get_ref().spec.as_ref().map_or("", |s| s.sandbox_id.as_str()),
        name = request.get_ref().spec.as_ref().map_or("", |s| s.name.as_str()),
        namespace = request.get_ref().spec.as_ref().map_or("", |s| s.namespace.as_str()),
    ))]
    async fn create_sandbox(
        &self,
        request: Request<CreateSandboxRequest>,
    ) -> Result<Response<CreateSandboxResponse>, Status> {
        let spec = request
            .into_inner()
            .spec
            .ok_or_else(|| AgentError::InvalidArgument("spec is required".into()))?;
        let (status, timings) = self.sandboxes.create(spec).await?;
        Ok(Response::new(CreateSandboxResponse {
            status: Some(status),
            timings: Some(timings),
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
        request: Request<sandbolt_proto::agent::v1::UpdateNetworkPolicyRequest>,
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
}
