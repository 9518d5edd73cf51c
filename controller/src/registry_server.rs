//! `sandbolt.agent.v1.RegistryService`: agents push heartbeats, janitors
//! report what they reaped.

use std::sync::Arc;

use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::registry_service_server::RegistryService;
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::sandbox::Core;
use crate::store::{ListRange, Phase};

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
    #[tracing::instrument(name = "registry.Heartbeat", skip_all, fields(agent))]
    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let inv = req
            .into_inner()
            .inventory
            .ok_or_else(|| Status::invalid_argument("inventory is required"))?;
        tracing::Span::current().record("agent", inv.agent_id.as_str());
        self.core.on_heartbeat(&inv)?;
        // The controller is the authority on warm buffers: always set (no
        // pool = drain every class).
        Ok(Response::new(pb::HeartbeatResponse {
            interval_ms: self.core.config.heartbeat_interval.as_millis() as u32,
            warm_targets: self.core.warm_targets(&inv),
            warm_targets_set: true,
        }))
    }

    #[tracing::instrument(name = "registry.ReportReaped", skip_all, fields(agent = %req.get_ref().agent_id, sandbox_id = %req.get_ref().sandbox_id))]
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
            self.core
                .registry()
                .release(&q.agent_id.as_str().into(), &q.sandbox_id.as_str().into());
        }
        // Reaps are rare: a scan is fine, and it finds the record whichever
        // agent the janitor thinks it belonged to.
        let records = self
            .core
            .store()
            .list(&ListRange::all())
            .map_err(Error::from)?;
        if let Some(r) = records.into_iter().find(|r| r.sandbox_id == q.sandbox_id) {
            let msg = format!(
                "container reaped by the janitor on {} ({})",
                q.node_name, q.reason
            );
            let res = self.core.modify(&r.key(), |x| {
                if x.sandbox_id != q.sandbox_id {
                    return Err(Error::Aborted("reassigned".into()));
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

    #[tracing::instrument(name = "registry.GetOwnership", skip_all, fields(queries = req.get_ref().queries.len()))]
    async fn get_ownership(
        &self,
        req: Request<pb::GetOwnershipRequest>,
    ) -> Result<Response<pb::GetOwnershipResponse>, Status> {
        // Answered in `ownership.rs`; it documents why janitors may trust it.
        Ok(Response::new(self.core.ownership(req.get_ref())?))
    }
}
