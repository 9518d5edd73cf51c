//! One simulated agent's `sandbolt.agent.v1.AgentService`: the real wire
//! and the real credential check, no containers. Creates put a Running
//! status in a table (which heartbeats report, as a real agent reports its
//! containers); everything a real agent without a volume root or snapshots
//! refuses, this refuses the same way.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::agent_service_server::AgentService;
use tonic::{Request, Response, Status};

use super::{AgentState, Shared};

pub(crate) struct Svc {
    pub(crate) agent: Arc<AgentState>,
    pub(crate) shared: Arc<Shared>,
}

fn no_such_sandbox(id: &str) -> Status {
    Status::not_found(format!("sim-agent: no sandbox {id} on this agent"))
}

fn no_volume_root() -> Status {
    Status::unavailable("sim-agent: this agent has no volume root (volumes are not simulated)")
}

impl Svc {
    /// As a real enrolled agent: only its own credential is accepted.
    fn check_token<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let presented = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        let own = self.agent.credential.lock().clone();
        match (presented, own) {
            (Some(v), Some(c)) if v.strip_prefix("Bearer ") == Some(c.as_str()) => Ok(()),
            _ => Err(Status::unauthenticated(
                "sim-agent: authorization is not this agent's credential",
            )),
        }
    }

    /// The injected latency, then an injected failure (mutating calls
    /// only: reads answer, as a slow but healthy agent's would).
    async fn fault(&self, mutating: bool) -> Result<(), Status> {
        let d = self.shared.config.latency.sample(&self.shared.rng);
        if !d.is_zero() {
            tokio::time::sleep(d).await;
        }
        if mutating && self.shared.rng.chance(self.shared.config.failure_rate) {
            self.shared
                .counters
                .injected_failures
                .fetch_add(1, Ordering::Relaxed);
            return Err(Status::unavailable(
                "sim-agent: injected failure (--failure-rate)",
            ));
        }
        Ok(())
    }

    fn set_phase(&self, id: &str, phase: pb::SandboxPhase) -> Result<pb::SandboxStatus, Status> {
        let mut g = self.agent.sandboxes.lock();
        let s = g.get_mut(id).ok_or_else(|| no_such_sandbox(id))?;
        s.phase = phase as i32;
        Ok(s.clone())
    }

    fn status(&self, id: &str) -> Result<pb::SandboxStatus, Status> {
        self.agent
            .sandboxes
            .lock()
            .get(id)
            .cloned()
            .ok_or_else(|| no_such_sandbox(id))
    }

    fn new_status(&self, spec: pb::SandboxSpec) -> pb::SandboxStatus {
        let runtime = if spec.runtime.is_empty() {
            "runc".to_string()
        } else {
            spec.runtime
        };
        pb::SandboxStatus {
            proxy_path: format!("/{}", spec.sandbox_id),
            sandbox_id: spec.sandbox_id,
            name: spec.name,
            namespace: spec.namespace,
            record_uid: spec.record_uid,
            phase: pb::SandboxPhase::Running as i32,
            created_at_unix_ms: super::now_ms(),
            image: spec.image,
            runtime,
            agent_id: self.agent.id.clone(),
            pool: spec.pool,
            exposed_ports: spec.exposed_ports,
            volume_mounts: spec.volume_mounts,
            ..Default::default()
        }
    }
}

#[tonic::async_trait]
impl AgentService for Svc {
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::CreateSandboxResponse>, Status> {
        self.check_token(&req)?;
        let spec = req
            .into_inner()
            .spec
            .ok_or_else(|| Status::invalid_argument("spec is required"))?;
        if spec.sandbox_id.is_empty() {
            return Err(Status::invalid_argument("spec.sandbox_id is required"));
        }
        if !spec.volume_mounts.is_empty() {
            return Err(no_volume_root());
        }
        if !spec.snapshot_id.is_empty() {
            return Err(Status::failed_precondition(format!(
                "sim-agent: snapshot {} is not on this agent",
                spec.snapshot_id
            )));
        }
        self.fault(true).await?;
        let status = {
            let mut g = self.agent.sandboxes.lock();
            if let Some(s) = g.get(&spec.sandbox_id) {
                s.clone()
            } else {
                if g.len() >= self.shared.config.capacity as usize {
                    self.shared
                        .counters
                        .overcommits
                        .fetch_add(1, Ordering::Relaxed);
                    return Err(Status::resource_exhausted(format!(
                        "sim-agent: {} sandboxes already, at max_sandboxes",
                        g.len()
                    )));
                }
                let s = self.new_status(spec);
                g.insert(s.sandbox_id.clone(), s.clone());
                self.shared.counters.creates.fetch_add(1, Ordering::Relaxed);
                s
            }
        };
        Ok(Response::new(pb::CreateSandboxResponse {
            status: Some(status),
            timings: Some(pb::CreateTimings::default()),
            claimed_warm: false,
        }))
    }

    async fn delete_sandbox(
        &self,
        req: Request<pb::DeleteSandboxRequest>,
    ) -> Result<Response<pb::DeleteSandboxResponse>, Status> {
        self.check_token(&req)?;
        self.fault(true).await?;
        let existed = self
            .agent
            .sandboxes
            .lock()
            .remove(&req.get_ref().sandbox_id)
            .is_some();
        if existed {
            self.shared.counters.deletes.fetch_add(1, Ordering::Relaxed);
        }
        Ok(Response::new(pb::DeleteSandboxResponse { existed }))
    }

    async fn pause_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        self.check_token(&req)?;
        self.fault(true).await?;
        self.set_phase(&req.get_ref().sandbox_id, pb::SandboxPhase::Paused)
            .map(Response::new)
    }

    async fn resume_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        self.check_token(&req)?;
        self.fault(true).await?;
        self.set_phase(&req.get_ref().sandbox_id, pb::SandboxPhase::Running)
            .map(Response::new)
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        self.check_token(&req)?;
        self.fault(false).await?;
        self.status(&req.get_ref().sandbox_id).map(Response::new)
    }

    async fn update_network_policy(
        &self,
        req: Request<pb::UpdateNetworkPolicyRequest>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        self.check_token(&req)?;
        self.fault(true).await?;
        self.status(&req.get_ref().sandbox_id).map(Response::new)
    }

    async fn get_inventory(
        &self,
        req: Request<pb::GetInventoryRequest>,
    ) -> Result<Response<pb::Inventory>, Status> {
        self.check_token(&req)?;
        self.fault(false).await?;
        Ok(Response::new(super::inventory(&self.agent, &self.shared)))
    }

    async fn create_volume(
        &self,
        r: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::VolumeInfo>, Status> {
        self.check_token(&r)?;
        Err(no_volume_root())
    }

    async fn get_volume(
        &self,
        r: Request<pb::VolumeRef>,
    ) -> Result<Response<pb::VolumeInfo>, Status> {
        self.check_token(&r)?;
        Err(no_volume_root())
    }

    async fn list_volumes(
        &self,
        r: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        self.check_token(&r)?;
        Err(no_volume_root())
    }

    async fn delete_volume(
        &self,
        r: Request<pb::VolumeRef>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        self.check_token(&r)?;
        Err(no_volume_root())
    }

    async fn create_volume_snapshot(
        &self,
        r: Request<pb::CreateVolumeSnapshotRequest>,
    ) -> Result<Response<pb::VolumeSnapshot>, Status> {
        self.check_token(&r)?;
        Err(no_volume_root())
    }

    async fn delete_volume_snapshot(
        &self,
        r: Request<pb::VolumeSnapshotRef>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        self.check_token(&r)?;
        Err(no_volume_root())
    }

    async fn restore_volume(
        &self,
        r: Request<pb::RestoreVolumeRequest>,
    ) -> Result<Response<pb::VolumeInfo>, Status> {
        self.check_token(&r)?;
        Err(no_volume_root())
    }

    async fn fork_volume(
        &self,
        r: Request<pb::ForkVolumeRequest>,
    ) -> Result<Response<pb::VolumeInfo>, Status> {
        self.check_token(&r)?;
        Err(no_volume_root())
    }

    async fn attach_volume(
        &self,
        r: Request<pb::AttachVolumeRequest>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        self.check_token(&r)?;
        Err(no_volume_root())
    }

    async fn detach_volume(
        &self,
        r: Request<pb::DetachVolumeRequest>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        self.check_token(&r)?;
        Err(no_volume_root())
    }

    async fn create_snapshot(
        &self,
        r: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::SnapshotInfo>, Status> {
        self.check_token(&r)?;
        // Known sandbox or not, there is no filesystem to capture.
        self.status(&r.get_ref().sandbox_id)?;
        Err(Status::failed_precondition(
            "sim-agent: sandbox snapshots are not simulated (no filesystem to capture)",
        ))
    }

    async fn delete_snapshot(
        &self,
        r: Request<pb::SnapshotRef>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        self.check_token(&r)?;
        Ok(Response::new(pb::DeleteSnapshotResponse { existed: false }))
    }

    async fn read_sandbox_log(
        &self,
        req: Request<pb::ReadSandboxLogRequest>,
    ) -> Result<Response<pb::SandboxLog>, Status> {
        self.check_token(&req)?;
        self.status(&req.get_ref().sandbox_id)?;
        Ok(Response::new(pb::SandboxLog::default()))
    }
}
