//! The `sandbolt.agent.v1.AgentService` gRPC server and its bearer-token
//! check.

use std::sync::Arc;
use std::time::Duration;

use sandbolt_proto::agent::v1::agent_service_server::AgentService;
use sandbolt_proto::agent::v1::{
    CreateSandboxRequest, CreateSandboxResponse, DeleteSandboxRequest, DeleteSandboxResponse,
    GetInventoryRequest, ImageInfo, Inventory, RuntimeSupport, SandboxRef, SandboxStatus,
};
use sha2::{Digest, Sha256};
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
    async fn create_sandbox(
        &self,
        request: Request<CreateSandboxRequest>,
    ) -> Result<Response<CreateSandboxResponse>, Status> {
        let spec = request
            .into_inner()
            .spec
            .ok_or_else(|| Status::invalid_argument("spec is required"))?;
        let (status, timings) = self.sandboxes.create(spec).await?;
        Ok(Response::new(CreateSandboxResponse {
            status: Some(status),
            timings: Some(timings),
        }))
    }

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

    async fn pause_sandbox(
        &self,
        request: Request<SandboxRef>,
    ) -> Result<Response<SandboxStatus>, Status> {
        Ok(Response::new(
            self.sandboxes
                .pause(&request.into_inner().sandbox_id)
                .await?,
        ))
    }

    async fn resume_sandbox(
        &self,
        request: Request<SandboxRef>,
    ) -> Result<Response<SandboxStatus>, Status> {
        Ok(Response::new(
            self.sandboxes
                .resume(&request.into_inner().sandbox_id)
                .await?,
        ))
    }

    async fn get_sandbox(
        &self,
        request: Request<SandboxRef>,
    ) -> Result<Response<SandboxStatus>, Status> {
        Ok(Response::new(
            self.sandboxes.get(&request.into_inner().sandbox_id)?,
        ))
    }

    async fn get_inventory(
        &self,
        _request: Request<GetInventoryRequest>,
    ) -> Result<Response<Inventory>, Status> {
        Ok(Response::new(self.inventory().await?))
    }
}

/// Interceptor: `authorization: Bearer <token>` must match. Compared as
/// SHA-256 digests in constant time, so neither timing nor length leaks.
#[derive(Clone)]
pub struct BearerAuth {
    expected: [u8; 32],
}

impl BearerAuth {
    pub fn new(token: &str) -> Self {
        Self {
            expected: Sha256::digest(token.as_bytes()).into(),
        }
    }

    pub fn check<T>(&self, req: Request<T>) -> Result<Request<T>, Status> {
        let presented = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| Status::unauthenticated("missing bearer token"))?;
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let diff = digest
            .iter()
            .zip(&self.expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if std::hint::black_box(diff) == 0 {
            Ok(req)
        } else {
            Err(Status::unauthenticated("invalid bearer token"))
        }
    }
}

impl tonic::service::Interceptor for BearerAuth {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        self.check(req)
    }
}

/// Adds `authorization: Bearer <token>` to outgoing calls.
#[derive(Clone)]
pub struct BearerToken(pub tonic::metadata::MetadataValue<tonic::metadata::Ascii>);

impl BearerToken {
    pub fn new(token: &str) -> Result<Self, AgentError> {
        format!("Bearer {token}")
            .parse()
            .map(Self)
            .map_err(|_| AgentError::InvalidArgument("token is not valid header text".into()))
    }
}

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        req.metadata_mut().insert("authorization", self.0.clone());
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_auth(v: Option<&str>) -> Request<()> {
        let mut r = Request::new(());
        if let Some(v) = v {
            r.metadata_mut().insert("authorization", v.parse().unwrap());
        }
        r
    }

    #[test]
    fn bearer_auth_accepts_only_the_token() {
        let a = BearerAuth::new("s3cret");
        assert!(a.check(with_auth(Some("Bearer s3cret"))).is_ok());
        for bad in [
            None,
            Some("Bearer s3cre"),
            Some("s3cret"),
            Some("Bearer "),
            Some("Basic s3cret"),
        ] {
            let e = a.check(with_auth(bad)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unauthenticated, "{bad:?}");
        }
    }
}
