//! `sandbolt.agent.v1.RegistryService`: agents push heartbeats, janitors
//! report what they reaped.

use std::sync::Arc;

use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::registry_service_server::RegistryService;
use tonic::{Request, Response, Status};

use crate::sandboxes::Core;
use crate::store::Phase;

pub struct RegistryServer {
    core: Arc<Core>,
}

impl RegistryServer {
    pub fn new(core: Arc<Core>) -> Self {
        Self { core }
    }
}

#[tonic::async_trait]
impl RegistryService for RegistryServer {
    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let inv = req
            .into_inner()
            .inventory
            .ok_or_else(|| Status::invalid_argument("inventory is required"))?;
        self.core.on_heartbeat(&inv)?;
        Ok(Response::new(pb::HeartbeatResponse {
            interval_ms: self.core.config.heartbeat_interval.as_millis() as u32,
        }))
    }

    async fn report_reaped(
        &self,
        req: Request<pb::ReportReapedRequest>,
    ) -> Result<Response<pb::ReportReapedResponse>, Status> {
        let q = req.into_inner();
        if q.sandbox_id.is_empty() {
            return Err(Status::invalid_argument("sandbox_id is required"));
        }
        tracing::info!(agent = %q.agent_id, node = %q.node_name, sandbox_id = %q.sandbox_id, reason = %q.reason, "janitor reaped a container");
        if !q.agent_id.is_empty() {
            self.core.registry().release(&q.agent_id, &q.sandbox_id);
        }
        // Reaps are rare: a scan is fine, and it finds the record whichever
        // agent the janitor thinks it belonged to.
        let records = self
            .core
            .store()
            .list(None, None, 0)
            .map_err(crate::error::Error::from)?;
        if let Some(r) = records.into_iter().find(|r| r.sandbox_id == q.sandbox_id) {
            let sid = q.sandbox_id.clone();
            let msg = format!(
                "container reaped by the janitor on {} ({})",
                q.node_name, q.reason
            );
            let res = self.core.modify(&r.namespace, &r.name, |x| {
                if x.sandbox_id != sid {
                    return Err(crate::error::Error::Aborted("reassigned".into()));
                }
                if matches!(x.phase, Phase::Running | Phase::Paused | Phase::Pending) {
                    x.phase = Phase::Failed;
                    x.message = msg.clone();
                }
                x.push_event("warning", "janitor", msg.clone());
                Ok(())
            });
            if let Err(e) = res {
                tracing::debug!(error = %e, "reap not recorded");
            }
            self.core.registry().release(&r.agent_id, &r.sandbox_id);
        }
        Ok(Response::new(pb::ReportReapedResponse {}))
    }

    async fn get_ownership(
        &self,
        req: Request<pb::GetOwnershipRequest>,
    ) -> Result<Response<pb::GetOwnershipResponse>, Status> {
        // Answered in `ownership.rs`; it documents why janitors may trust it.
        Ok(Response::new(self.core.ownership(req.get_ref())?))
    }
}
