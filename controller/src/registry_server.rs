//! `sandbolt.agent.v1.RegistryService`: agents enroll and push heartbeats,
//! janitors report what they reaped.
//!
//! Who may call what (see [`crate::identity`]): `Enroll` and
//! `GetOwnership` take the bootstrap token; `Heartbeat` and `ReportReaped`
//! speak for one agent id and take only that id's credential, so one
//! agent (or anyone holding the bootstrap token) cannot heartbeat, move
//! endpoints or report reaps for another.

use std::sync::Arc;

use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::registry_service_server::RegistryService;
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::sandbox::Core;
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
    #[tracing::instrument(name = "registry.Heartbeat", skip_all, fields(agent))]
    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let (metadata, _, body) = req.into_parts();
        let inv = body
            .inventory
            .ok_or_else(|| Status::invalid_argument("inventory is required"))?;
        tracing::Span::current().record("agent", inv.agent_id.as_str());
        self.identity()
            .authorize_agent(&metadata, &inv.agent_id, "Heartbeat")?;
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
        let (metadata, _, q) = req.into_parts();
        if q.sandbox_id.is_empty() {
            return Err(Status::invalid_argument("sandbox_id is required"));
        }
        // A report names the agent whose container went: it needs that
        // agent's credential. One naming no agent (a leftover without
        // labels) takes the bootstrap token but may touch only records of
        // agents that are not live.
        if q.agent_id.is_empty() {
            self.identity()
                .authorize_bootstrap(&metadata, "ReportReaped")?;
        } else {
            self.identity()
                .authorize_agent(&metadata, &q.agent_id, "ReportReaped")?;
        }
        tracing::info!(agent = %q.agent_id, node = %q.node_name, sandbox_id = %q.sandbox_id, reason = %q.reason, "janitor reaped a container");
        if !q.agent_id.is_empty() {
            self.core
                .registry()
                .release(&q.agent_id.as_str().into(), &q.sandbox_id.as_str().into());
        }
        // By container id, whichever agent the janitor thinks it belonged
        // to (the store's index: a reap costs one lookup at any size).
        let record = self
            .core
            .store()
            .get_by_sandbox_id(&q.sandbox_id)
            .map_err(Error::from)?;
        let may_touch = |agent: &crate::ids::AgentId| {
            if q.agent_id.is_empty() {
                !self.core.registry().is_live(agent)
            } else {
                agent.as_str() == q.agent_id
            }
        };
        if let Some(r) = record.filter(|r| {
                let ok = may_touch(&r.agent_id);
                if !ok {
                    tracing::warn!(record_agent = %r.agent_id, "reap report for a sandbox of another agent: record left alone");
                }
                ok
            })
        {
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
        self.identity()
            .authorize_bootstrap(req.metadata(), "GetOwnership")?;
        // Answered in `ownership.rs`; it documents why janitors may trust it.
        Ok(Response::new(self.core.ownership(req.get_ref())?))
    }

    #[tracing::instrument(name = "registry.Enroll", skip_all, fields(agent = %req.get_ref().agent_id, node = %req.get_ref().node_name))]
    async fn enroll(
        &self,
        req: Request<pb::EnrollRequest>,
    ) -> Result<Response<pb::EnrollResponse>, Status> {
        let (metadata, _, q) = req.into_parts();
        check_agent_id(&q.agent_id)?;
        let identity = self.identity();
        // The id's own credential may always enroll again (an agent that
        // lost its state dir file but not its memory, or a janitor).
        if !identity.is_credential_of(&metadata, &q.agent_id) {
            identity.authorize_bootstrap(&metadata, "Enroll")?;
            if self.core.registry().is_live(&q.agent_id.as_str().into()) {
                tracing::warn!("enroll refused: the id is live");
                return Err(Status::permission_denied(format!(
                    "Enroll: agent {} is live (heartbeating with its credential); the bootstrap \
                     token cannot enroll it again: present its credential, or wait until it \
                     is lost",
                    q.agent_id
                )));
            }
        }
        tracing::info!("agent enrolled");
        Ok(Response::new(pb::EnrollResponse {
            credential: identity.credential(&q.agent_id),
        }))
    }
}

impl RegistryServer {
    fn identity(&self) -> &crate::identity::AgentIdentity {
        self.core.agents.identity()
    }
}

/// Agent ids travel in headers, labels and resource names: keep them short
/// and printable.
fn check_agent_id(id: &str) -> Result<(), Status> {
    if id.is_empty() {
        return Err(Status::invalid_argument("Enroll: agent_id is required"));
    }
    if id.len() > 253 || id.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(Status::invalid_argument(format!(
            "Enroll: agent_id {id:?} must be at most 253 printable characters without spaces"
        )));
    }
    Ok(())
}
