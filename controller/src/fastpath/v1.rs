//! `fastpath.v1.FastPathService` (fast-sandbox's API) on the same core.
//!
//! Two mapping choices worth knowing:
//! - `consistency_mode`: proto3 cannot tell FAST (0) from "not set", and the
//!   contract says an unset mode means the controller's configuration. So
//!   STRONG asks for strong, and FAST/unset gets the server default.
//! - `endpoints`: `<agent proxy>/<sandbox_id>/<port>` per exposed port — the
//!   same path-style route v2's ResolveEndpoint hands out (sandboxes have
//!   their own network namespace, there is no `IP:port` to give).

use std::sync::Arc;

use sandbolt_proto::fastpath::v1 as pb;
use sandbolt_proto::fastpath::v1::fast_path_service_server::FastPathService;
use tonic::{Request, Response, Status};

use crate::ids::SandboxKey;
use crate::sandbox::{Core, CreateRequest, Precondition, UpdateOp, UpdateSpec, proxy_host};
use crate::store::{Consistency, Phase, SandboxRecord};

pub struct FastPathV1 {
    core: Arc<Core>,
}

impl FastPathV1 {
    pub fn new(core: Arc<Core>) -> Self {
        Self { core }
    }

    fn endpoints(&self, r: &SandboxRecord) -> Vec<String> {
        let Some(a) = self.core.registry().agent(&r.agent_id) else {
            return vec![];
        };
        let host = proxy_host(&a.proxy_endpoint);
        r.spec
            .exposed_ports
            .iter()
            .map(|p| format!("{host}/{}/{p}", r.sandbox_id))
            .collect()
    }

    fn info(&self, r: &SandboxRecord) -> pb::SandboxInfo {
        pb::SandboxInfo {
            sandbox_id: r.sandbox_id.to_string(),
            sandbox_name: r.name.clone(),
            phase: phase(r.phase).into(),
            agent_pod: r.agent_id.to_string(),
            endpoints: self.endpoints(r),
            created_at: r.created_at_unix_ms / 1000,
            image: r.spec.image.clone(),
            pool_ref: r.spec.pool.clone(),
        }
    }
}

fn phase(p: Phase) -> &'static str {
    match p {
        Phase::Pending => "Pending",
        Phase::Running => "Running",
        Phase::Paused => "Paused",
        Phase::Recovering => "Recovering",
        Phase::Failed => "Failed",
    }
}

/// The sandbox a v1 request names (v1 has no uid or generation to expect).
fn key_of(namespace: &str, name: &str) -> Result<SandboxKey, Status> {
    Ok(SandboxKey::named(namespace, name, "sandbox_name")?)
}

#[tonic::async_trait]
impl FastPathService for FastPathV1 {
    #[tracing::instrument(name = "fastpath.v1.CreateSandbox", skip_all, fields(namespace = %req.get_ref().namespace, sandbox = %req.get_ref().name, pool = %req.get_ref().pool_ref))]
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateRequest>,
    ) -> Result<Response<pb::CreateResponse>, Status> {
        let q = req.into_inner();
        let consistency = match pb::ConsistencyMode::try_from(q.consistency_mode) {
            Ok(pb::ConsistencyMode::Strong) => Some(Consistency::Strong),
            Ok(pb::ConsistencyMode::Fast) => None,
            Err(_) => {
                return Err(Status::invalid_argument(format!(
                    "unknown consistency mode {}",
                    q.consistency_mode
                )));
            }
        };
        // Negative ports are refused here; the core checks the range.
        let ports = q
            .exposed_ports
            .iter()
            .map(|&p| {
                u32::try_from(p).map_err(|_| {
                    Status::invalid_argument(format!("exposed port {p} is out of range"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let spec = CreateRequest {
            name: q.name,
            namespace: q.namespace,
            consistency,
            // v1 answers once the sandbox is usable, like v2's READY.
            wait_for_execd: true,
            spec: fastpath_spec!(q {
                exposed_ports: ports,
            }),
            ..Default::default()
        };
        let r = self.core.create(spec).await?;
        Ok(Response::new(pb::CreateResponse {
            sandbox_id: r.sandbox_id.to_string(),
            sandbox_name: r.name.clone(),
            agent_pod: r.agent_id.to_string(),
            endpoints: self.endpoints(&r),
        }))
    }

    #[tracing::instrument(
        name = "fastpath.v1.DeleteSandbox",
        skip_all,
        fields(namespace, sandbox)
    )]
    async fn delete_sandbox(
        &self,
        req: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        let q = req.into_inner();
        let key = key_of(&q.namespace, &q.sandbox_name)?;
        self.core.delete(&key, &Precondition::default()).await?;
        Ok(Response::new(pb::DeleteResponse { success: true }))
    }

    #[tracing::instrument(
        name = "fastpath.v1.UpdateSandbox",
        skip_all,
        fields(namespace, sandbox)
    )]
    async fn update_sandbox(
        &self,
        req: Request<pb::UpdateRequest>,
    ) -> Result<Response<pb::UpdateResponse>, Status> {
        let q = req.into_inner();
        use pb::update_request::Update;
        let op = match q.update {
            None => UpdateOp::None,
            Some(Update::ExpireTimeSeconds(t)) => UpdateOp::ExpiryV1(t),
            Some(Update::ResetRevision(s)) => UpdateOp::ResetRevision(s),
            Some(Update::FailurePolicy(p)) => UpdateOp::FailurePolicy(super::failure_policy(p)?),
            Some(Update::RecoveryTimeoutSeconds(t)) => UpdateOp::RecoveryTimeout(t),
        };
        let spec = UpdateSpec {
            metadata_upsert: q.labels.into_iter().collect(),
            ..Default::default()
        };
        let key = key_of(&q.namespace, &q.sandbox_name)?;
        let r = self.core.update(&key, op, spec).await?;
        Ok(Response::new(pb::UpdateResponse {
            success: true,
            message: format!("generation {}", r.generation),
            sandbox: Some(self.info(&r)),
        }))
    }

    #[tracing::instrument(name = "fastpath.v1.ListSandboxes", skip_all, fields(namespace = %req.get_ref().namespace))]
    async fn list_sandboxes(
        &self,
        req: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        let ns = req.into_inner().namespace;
        let mut items = Vec::new();
        let mut token = String::new();
        loop {
            let (page, next) = self.core.list(&ns, &Default::default(), 1000, &token)?;
            items.extend(page.iter().map(|r| self.info(r)));
            if next.is_empty() {
                break;
            }
            token = next;
        }
        Ok(Response::new(pb::ListResponse { items }))
    }

    #[tracing::instrument(name = "fastpath.v1.GetSandbox", skip_all, fields(namespace, sandbox))]
    async fn get_sandbox(
        &self,
        req: Request<pb::GetRequest>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let q = req.into_inner();
        let key = key_of(&q.namespace, &q.sandbox_name)?;
        let r = self.core.get(&key, &Precondition::default())?;
        Ok(Response::new(self.info(&r)))
    }
}
