//! `fastpath.v2.FastPathService`, as the OpenSandbox server 1.1.x calls it.
//! Translation only; the work is in [`crate::sandboxes::Core`].

use std::sync::Arc;

use sandbolt_proto::agent::v1::SandboxPhase as AgentPhase;
use sandbolt_proto::fastpath::v2 as pb;
use sandbolt_proto::fastpath::v2::fast_path_service_server::FastPathService;
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::placement::or_default;
use crate::registry::PoolSummary;
use crate::sandboxes::{Core, CreateSpec, UpdateOp, UpdateSpec};
use crate::store::{FailurePolicy, Phase, SandboxRecord};

pub struct FastPathV2 {
    core: Arc<Core>,
}

impl FastPathV2 {
    pub fn new(core: Arc<Core>) -> Self {
        Self { core }
    }
}

fn reference(r: Option<&pb::SandboxReference>) -> Result<(String, String, String), Status> {
    let r = r.ok_or_else(|| Status::invalid_argument("sandbox reference is required"))?;
    let nn = r
        .namespaced_name
        .as_ref()
        .ok_or_else(|| Status::invalid_argument("sandbox.namespaced_name is required"))?;
    if nn.name.is_empty() {
        return Err(Status::invalid_argument("sandbox name is required"));
    }
    Ok((
        or_default(&nn.namespace).to_string(),
        nn.name.clone(),
        r.expected_uid.clone(),
    ))
}

fn policy(p: i32) -> Result<FailurePolicy, Status> {
    match pb::FailurePolicy::try_from(p) {
        Ok(pb::FailurePolicy::Manual) => Ok(FailurePolicy::Manual),
        Ok(pb::FailurePolicy::AutoRecreate) => Ok(FailurePolicy::AutoRecreate),
        Err(_) => Err(Status::invalid_argument(format!(
            "unknown failure policy {p}"
        ))),
    }
}

pub(crate) fn identity(r: &SandboxRecord) -> pb::SandboxIdentity {
    pb::SandboxIdentity {
        uid: r.uid.clone(),
        name: r.name.clone(),
        namespace: r.namespace.clone(),
    }
}

/// The record plus what its agent last reported, in v2's vocabulary.
pub(crate) fn info(core: &Core, r: &SandboxRecord) -> pb::SandboxInfo {
    use pb::{DataPlaneState as D, InfraComponentState as I, RuntimeState as R};
    let observed = core.registry().observed(&r.agent_id, &r.sandbox_id);
    let agent_live = core.registry().is_live(&r.agent_id);
    let (runtime, data_plane, execd) = match r.phase {
        Phase::Pending => (R::Creating, D::Pending, I::Starting),
        Phase::Recovering => (R::Creating, D::Pending, I::Starting),
        Phase::Failed => (R::Failed, D::Unavailable, I::Failed),
        // A silent agent says nothing about its sandboxes: Unknown, not
        // failed (they are Ready again when it reports them).
        Phase::Running | Phase::Paused if !agent_live => (R::Unknown, D::Unknown, I::Starting),
        Phase::Paused => (R::Paused, D::Unavailable, I::Ready),
        Phase::Running => match observed.as_ref().map(|s| s.phase()) {
            Some(AgentPhase::Failed) => (R::Failed, D::Unavailable, I::Failed),
            Some(AgentPhase::Stopped) => (R::Stopped, D::Unavailable, I::Failed),
            _ => (R::Ready, D::Ready, I::Ready),
        },
    };
    let ready = runtime == R::Ready && data_plane == D::Ready;
    pb::SandboxInfo {
        identity: Some(identity(r)),
        applied_generation: r.generation,
        runtime: Some(pb::RuntimeInfo {
            state: runtime as i32,
        }),
        data_plane: Some(pb::DataPlaneInfo {
            state: data_plane as i32,
        }),
        infra_components: vec![pb::InfraComponentInfo {
            name: "execd".into(),
            state: execd as i32,
            message: r.message.clone(),
        }],
        action_bindings: vec![],
        ready,
        state: if r.phase == Phase::Paused {
            pb::SandboxState::Paused
        } else {
            pb::SandboxState::Running
        } as i32,
        checkpoint: None,
    }
}

fn pool_info(p: &PoolSummary) -> pb::PoolInfo {
    // What the pool's agents report, never a made-up default.
    let policy = p.policy.clone().unwrap_or_default();
    let defaults = policy.default_limits.unwrap_or_default();
    pb::PoolInfo {
        namespace: p.pool.namespace.clone(),
        name: p.pool.pool.clone(),
        runtime: policy.runtime,
        sandbox_cpu: defaults.cpu,
        sandbox_memory: defaults.memory,
        sandbox_pids: defaults.pids_limit,
        max_sandboxes_per_pod: p.max_sandboxes_per_agent,
        total_fastlets: p.total_agents,
        ready_fastlets: p.ready_agents,
        idle_fastlets: p.idle_agents,
        prepared_fastlets: p.ready_agents,
        components: vec![pb::ComponentCapability {
            name: "execd".into(),
            protocol: "http".into(),
            port: crate::sandboxes::EXECD_PORT,
            health_kind: "http".into(),
        }],
        warm_images: p
            .images
            .iter()
            .map(|(image, n)| pb::WarmImageInfo {
                image: image.clone(),
                cached_fastlets: *n,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn unimplemented(what: &str) -> Status {
    Error::Unimplemented(format!(
        "{what} is not implemented by sandbolt yet (snapshots are planned)"
    ))
    .into()
}

#[tonic::async_trait]
impl FastPathService for FastPathV2 {
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::CreateSandboxResponse>, Status> {
        let q = req.into_inner();
        if !q.action_bindings.is_empty() {
            return Err(Error::Unimplemented(
                "action bindings (e.g. egress policy) are not supported yet".into(),
            )
            .into());
        }
        let completion = match pb::CreateCompletion::try_from(q.completion) {
            Ok(pb::CreateCompletion::RuntimeReady) => pb::CreateCompletion::RuntimeReady,
            Ok(_) => pb::CreateCompletion::Ready,
            Err(_) => {
                return Err(Status::invalid_argument(format!(
                    "unknown completion {}",
                    q.completion
                )));
            }
        };
        let spec = CreateSpec {
            request_id: q.request_id,
            name: String::new(),
            namespace: q.namespace,
            pool: q.pool_ref,
            image: q.image,
            command: q.command,
            args: q.args,
            envs: q.envs.into_iter().collect(),
            working_dir: q.working_dir,
            exposed_ports: vec![],
            metadata: q.metadata.into_iter().collect(),
            expires_at: q.expires_at_unix_seconds,
            failure_policy: policy(q.failure_policy)?,
            recovery_timeout_seconds: q.recovery_timeout_seconds,
            consistency: None,
            wait_for_execd: completion == pb::CreateCompletion::Ready,
            // v2 cannot say limits, volumes or a runtime: the pool's
            // defaults and runtime apply (see `limits`).
            ..Default::default()
        };
        let r = self.core.create(spec).await?;
        Ok(Response::new(pb::CreateSandboxResponse {
            sandbox: Some(info(&self.core, &r)),
            generation: r.generation,
            completion: completion as i32,
        }))
    }

    async fn delete_sandbox(
        &self,
        req: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        let (ns, name, uid) = reference(req.get_ref().sandbox.as_ref())?;
        self.core.delete(&ns, &name, &uid).await?;
        Ok(Response::new(pb::DeleteResponse {}))
    }

    async fn update_sandbox(
        &self,
        req: Request<pb::UpdateSandboxRequest>,
    ) -> Result<Response<pb::UpdateSandboxResponse>, Status> {
        let q = req.into_inner();
        let (ns, name, uid) = reference(q.sandbox.as_ref())?;
        use pb::update_sandbox_request::Update;
        let op = match q.update {
            None => UpdateOp::None,
            Some(Update::ExpiresAtUnixSeconds(t)) => UpdateOp::Expiry(t),
            Some(Update::ResetRevision(s)) => UpdateOp::ResetRevision(s),
            Some(Update::FailurePolicy(p)) => UpdateOp::FailurePolicy(policy(p)?),
            Some(Update::RecoveryTimeoutSeconds(t)) => UpdateOp::RecoveryTimeout(t),
            Some(Update::ActionBindings(_)) => {
                return Err(
                    Error::Unimplemented("action bindings are not supported yet".into()).into(),
                );
            }
        };
        let spec = UpdateSpec {
            expected_uid: uid,
            expected_generation: q.expected_generation,
            metadata_upsert: q.metadata_upsert.into_iter().collect(),
            metadata_delete: q.metadata_delete_keys,
        };
        let r = self.core.update(&ns, &name, op, spec).await?;
        Ok(Response::new(pb::UpdateSandboxResponse {
            sandbox: Some(identity(&r)),
            committed_generation: r.generation,
        }))
    }

    async fn list_sandboxes(
        &self,
        req: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let q = req.into_inner();
        if q.page_size < 0 {
            return Err(Status::invalid_argument("page_size must not be negative"));
        }
        let filter = q.metadata.into_iter().collect();
        let (items, next) =
            self.core
                .list(&q.namespace, &filter, q.page_size as usize, &q.page_token)?;
        Ok(Response::new(pb::ListSandboxesResponse {
            items: items
                .iter()
                .map(|r| pb::SandboxSummary {
                    identity: Some(identity(r)),
                    generation: r.generation,
                })
                .collect(),
            next_page_token: next,
        }))
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::GetSandboxRequest>,
    ) -> Result<Response<pb::GetSandboxResponse>, Status> {
        let q = req.into_inner();
        let (ns, name, uid) = reference(q.sandbox.as_ref())?;
        let r = self
            .core
            .get_checked(&ns, &name, &uid, q.expected_generation)?;
        Ok(Response::new(pb::GetSandboxResponse {
            sandbox: Some(info(&self.core, &r)),
            generation: r.generation,
        }))
    }

    async fn get_sandbox_diagnostics(
        &self,
        req: Request<pb::SandboxDiagnosticsRequest>,
    ) -> Result<Response<pb::SandboxDiagnosticsResponse>, Status> {
        let q = req.into_inner();
        if q.sandbox_name.is_empty() {
            return Err(Status::invalid_argument("sandbox_name is required"));
        }
        let d = self.core.diagnostics(&q.namespace, &q.sandbox_name).await?;
        let r = &d.record;
        let limit = if q.limit <= 0 {
            usize::MAX
        } else {
            q.limit as usize
        };
        let skip = r.events.len().saturating_sub(limit);
        let mut agent_error = d.agent_error.clone();
        if let Some(o) = &d.observed
            && !o.message.is_empty()
            && agent_error.is_empty()
        {
            agent_error = o.message.clone();
        }
        Ok(Response::new(pb::SandboxDiagnosticsResponse {
            sandbox: Some(info(&self.core, r)),
            assignment_state: match r.phase {
                Phase::Pending => "Pending",
                Phase::Running | Phase::Paused => "Assigned",
                Phase::Recovering => "Reassigning",
                Phase::Failed => "Failed",
            }
            .into(),
            runtime_instance_id: r.sandbox_id.clone(),
            assignment_attempt: r.assignment_attempt,
            fastlet_reachable: d.reachable,
            fastlet_error: agent_error,
            events: r.events[skip..]
                .iter()
                .map(|e| pb::SandboxDiagnosticEvent {
                    timestamp_unix_nano: e.at_unix_nanos,
                    level: e.level.clone(),
                    source: e.source.clone(),
                    phase: e.phase.clone(),
                    message: e.message.clone(),
                })
                .collect(),
        }))
    }

    async fn resolve_endpoint(
        &self,
        req: Request<pb::ResolveEndpointRequest>,
    ) -> Result<Response<pb::ResolveEndpointResponse>, Status> {
        let q = req.into_inner();
        let (ns, name, uid) = reference(q.sandbox.as_ref())?;
        use pb::endpoint_target::Target;
        let (port, component) = match q.target.and_then(|t| t.target) {
            Some(Target::Port(p)) => (Some(p), String::new()),
            Some(Target::ComponentName(c)) => (None, c),
            None => (None, String::new()),
        };
        let route = self
            .core
            .resolve(&ns, &name, &uid, q.expected_generation, port, &component)?;
        Ok(Response::new(pb::ResolveEndpointResponse {
            sandbox_uid: route.record.uid.clone(),
            endpoint: Some(pb::ResolvedEndpoint {
                component_name: route.component,
                protocol: "http".into(),
                port: route.port,
            }),
            proxy_endpoint: route.proxy_endpoint,
            required_headers: route.headers.into_iter().collect(),
            route_generation: route.record.generation,
            expires_at_unix_seconds: route.record.expires_at,
        }))
    }

    async fn get_pool(
        &self,
        req: Request<pb::GetPoolRequest>,
    ) -> Result<Response<pb::PoolInfo>, Status> {
        let q = req.into_inner();
        let key = self.core.registry().pool_key(&q.namespace, &q.pool_name);
        self.core
            .registry()
            .pools()
            .iter()
            .find(|p| p.pool == key)
            .map(|p| Response::new(pool_info(p)))
            .ok_or_else(|| {
                Error::NotFoundOther(format!("pool {}/{} has no agents", key.namespace, key.pool))
                    .into()
            })
    }

    async fn list_pools(
        &self,
        req: Request<pb::ListPoolsRequest>,
    ) -> Result<Response<pb::ListPoolsResponse>, Status> {
        let ns = self
            .core
            .registry()
            .pool_key(&req.get_ref().namespace, "")
            .namespace;
        let items = self
            .core
            .registry()
            .pools()
            .iter()
            .filter(|p| p.pool.namespace == ns)
            .map(pool_info)
            .collect();
        Ok(Response::new(pb::ListPoolsResponse { items }))
    }

    async fn create_sandbox_snapshot(
        &self,
        _: Request<pb::CreateSandboxSnapshotRequest>,
    ) -> Result<Response<pb::CreateSandboxSnapshotResponse>, Status> {
        Err(unimplemented("CreateSandboxSnapshot"))
    }

    async fn get_sandbox_snapshot(
        &self,
        _: Request<pb::GetSandboxSnapshotRequest>,
    ) -> Result<Response<pb::GetSandboxSnapshotResponse>, Status> {
        Err(unimplemented("GetSandboxSnapshot"))
    }

    async fn delete_sandbox_snapshot(
        &self,
        _: Request<pb::DeleteSandboxSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSandboxSnapshotResponse>, Status> {
        Err(unimplemented("DeleteSandboxSnapshot"))
    }

    async fn pause_sandbox(
        &self,
        req: Request<pb::PauseSandboxRequest>,
    ) -> Result<Response<pb::PauseSandboxResponse>, Status> {
        let q = req.into_inner();
        let (ns, name, uid) = reference(q.sandbox.as_ref())?;
        let r = self
            .core
            .pause(&ns, &name, &uid, q.expected_generation, true)
            .await?;
        Ok(Response::new(pb::PauseSandboxResponse {
            sandbox: Some(info(&self.core, &r)),
            generation: r.generation,
        }))
    }

    async fn resume_sandbox(
        &self,
        req: Request<pb::ResumeSandboxRequest>,
    ) -> Result<Response<pb::ResumeSandboxResponse>, Status> {
        let q = req.into_inner();
        let (ns, name, uid) = reference(q.sandbox.as_ref())?;
        if !q.expected_checkpoint_id.is_empty() {
            return Err(Error::Unimplemented(
                "resume from a checkpoint is not supported yet (pause freezes in place)".into(),
            )
            .into());
        }
        let r = self
            .core
            .pause(&ns, &name, &uid, q.expected_generation, false)
            .await?;
        Ok(Response::new(pb::ResumeSandboxResponse {
            sandbox: Some(info(&self.core, &r)),
            generation: r.generation,
        }))
    }
}
