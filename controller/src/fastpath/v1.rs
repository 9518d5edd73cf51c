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

use crate::placement::or_default;
use crate::sandboxes::{Core, CreateSpec, UpdateOp, UpdateSpec};
use crate::store::{Consistency, FailurePolicy, Phase, SandboxRecord};

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
        let host = a
            .proxy_endpoint
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        r.exposed_ports
            .iter()
            .map(|p| format!("{host}/{}/{p}", r.sandbox_id))
            .collect()
    }

    fn info(&self, r: &SandboxRecord) -> pb::SandboxInfo {
        pb::SandboxInfo {
            sandbox_id: r.sandbox_id.clone(),
            sandbox_name: r.name.clone(),
            phase: phase(r.phase).into(),
            agent_pod: r.agent_id.clone(),
            endpoints: self.endpoints(r),
            created_at: r.created_at_unix_ms / 1000,
            image: r.image.clone(),
            pool_ref: r.pool.clone(),
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

fn name_of(s: &str) -> Result<&str, Status> {
    if s.is_empty() {
        Err(Status::invalid_argument("sandbox_name is required"))
    } else {
        Ok(s)
    }
}

#[tonic::async_trait]
impl FastPathService for FastPathV1 {
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
        let mut ports = Vec::with_capacity(q.exposed_ports.len());
        for p in q.exposed_ports {
            if !(1..=65535).contains(&p) {
                return Err(Status::invalid_argument(format!(
                    "exposed port {p} is out of range"
                )));
            }
            ports.push(p as u32);
        }
        let spec = CreateSpec {
            name: q.name,
            namespace: q.namespace,
            pool: q.pool_ref,
            image: q.image,
            command: q.command,
            args: q.args,
            envs: q.envs.into_iter().collect(),
            working_dir: q.working_dir,
            exposed_ports: ports,
            consistency,
            // v1 answers once the sandbox is usable, like v2's READY.
            wait_for_execd: true,
            ..Default::default()
        };
        let r = self.core.create(spec).await?;
        Ok(Response::new(pb::CreateResponse {
            sandbox_id: r.sandbox_id.clone(),
            sandbox_name: r.name.clone(),
            agent_pod: r.agent_id.clone(),
            endpoints: self.endpoints(&r),
        }))
    }

    async fn delete_sandbox(
        &self,
        req: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        let q = req.into_inner();
        self.core
            .delete(&q.namespace, name_of(&q.sandbox_name)?, "")
            .await?;
        Ok(Response::new(pb::DeleteResponse { success: true }))
    }

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
            Some(Update::FailurePolicy(p)) => {
                UpdateOp::FailurePolicy(match pb::FailurePolicy::try_from(p) {
                    Ok(pb::FailurePolicy::AutoRecreate) => FailurePolicy::AutoRecreate,
                    Ok(pb::FailurePolicy::Manual) => FailurePolicy::Manual,
                    Err(_) => {
                        return Err(Status::invalid_argument(format!(
                            "unknown failure policy {p}"
                        )));
                    }
                })
            }
            Some(Update::RecoveryTimeoutSeconds(t)) => UpdateOp::RecoveryTimeout(t),
        };
        let spec = UpdateSpec {
            metadata_upsert: q.labels.into_iter().collect(),
            ..Default::default()
        };
        let r = self
            .core
            .update(
                or_default(&q.namespace),
                name_of(&q.sandbox_name)?,
                op,
                spec,
            )
            .await?;
        Ok(Response::new(pb::UpdateResponse {
            success: true,
            message: format!("generation {}", r.generation),
            sandbox: Some(self.info(&r)),
        }))
    }

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

    async fn get_sandbox(
        &self,
        req: Request<pb::GetRequest>,
    ) -> Result<Response<pb::SandboxInfo>, Status> {
        let q = req.into_inner();
        let r = self.core.get(&q.namespace, name_of(&q.sandbox_name)?, "")?;
        Ok(Response::new(self.info(&r)))
    }
}
