//! `fastpath.v2.FastPathService`, as the OpenSandbox server 1.1.x calls it.
//! Translation only; the work is in [`crate::sandbox::Core`].

use std::sync::Arc;

use sandbolt_proto::egress::NetworkPolicy;
use sandbolt_proto::fastpath::v2 as pb;
use sandbolt_proto::fastpath::v2::fast_path_service_server::FastPathService;
use tonic::{Request, Response, Status};

use super::failure_policy;
use crate::error::Error;
use crate::ids::SandboxKey;
use crate::registry::PoolSummary;
use crate::sandbox::{
    Core, CreateRequest, EndpointTarget, Observed, Precondition, UpdateOp, UpdateSpec, page_size,
};
use crate::snapshot::SnapshotCreate;
use crate::store::{Phase, SandboxRecord, SnapshotPhase, SnapshotRecord, WarmPoolRecord};

pub struct FastPathV2 {
    core: Arc<Core>,
}

impl FastPathV2 {
    pub fn new(core: Arc<Core>) -> Self {
        Self { core }
    }
}

/// The sandbox a reference names, and what the caller expects of it
/// (`generation`: the request's `expected_generation`, 0 = any). v2 speaks
/// of the API object's uid and generation where the store has an object
/// (see [`identity`]).
fn reference(
    r: Option<&pb::SandboxReference>,
    generation: i64,
) -> Result<(SandboxKey, Precondition), Status> {
    let r = r.ok_or_else(|| Status::invalid_argument("sandbox reference is required"))?;
    let nn = r
        .namespaced_name
        .as_ref()
        .ok_or_else(|| Status::invalid_argument("sandbox.namespaced_name is required"))?;
    let key = SandboxKey::named(&nn.namespace, &nn.name, "sandbox name")?;
    let expect = Precondition {
        uid: r.expected_uid.clone(),
        generation,
        object_generation: true,
    };
    Ok((key, expect))
}

/// The sandbox as v2 names it. With the Kubernetes store the uid is the
/// Sandbox resource's (and generations are its `metadata.generation`): the
/// OpenSandbox server reads both from the resource and sends them back as
/// preconditions, as it does with fast-sandbox, whose FastPath identity is
/// the resource's.
pub(crate) fn identity(r: &SandboxRecord) -> pb::SandboxIdentity {
    pb::SandboxIdentity {
        uid: r.object_uid().to_string(),
        name: r.name.clone(),
        namespace: r.namespace.clone(),
    }
}

/// Runtime, data plane and execd states of a sandbox as observed. The
/// Kubernetes store's status says the same (`store::kube::derive_status`;
/// a test holds them together), except for a silent agent's sandboxes.
fn states(
    observed: &Observed,
) -> (
    pb::RuntimeState,
    pb::DataPlaneState,
    pb::InfraComponentState,
) {
    use pb::{DataPlaneState as D, InfraComponentState as I, RuntimeState as R};
    match observed {
        Observed::Recorded(Phase::Pending | Phase::Recovering) => {
            (R::Creating, D::Pending, I::Starting)
        }
        Observed::Recorded(Phase::Failed) => (R::Failed, D::Unavailable, I::Failed),
        // A silent agent says nothing about its sandboxes: Unknown, not
        // failed (they are Ready again when it reports them).
        Observed::AgentSilent { .. } => (R::Unknown, D::Unknown, I::Starting),
        Observed::Recorded(Phase::Paused) => (R::Paused, D::Unavailable, I::Ready),
        Observed::Recorded(Phase::Running) => (R::Ready, D::Ready, I::Ready),
        Observed::Exited { failed: true, .. } => (R::Failed, D::Unavailable, I::Failed),
        Observed::Exited { failed: false, .. } => (R::Stopped, D::Unavailable, I::Failed),
    }
}

/// The record plus what its agent last reported, in v2's vocabulary.
pub(crate) fn info(core: &Core, r: &SandboxRecord) -> pb::SandboxInfo {
    use pb::{DataPlaneState as D, RuntimeState as R};
    let (runtime, data_plane, execd) = states(&core.observe(r).0);
    let ready = runtime == R::Ready && data_plane == D::Ready;
    pb::SandboxInfo {
        identity: Some(identity(r)),
        applied_generation: r.object_generation(),
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
        action_bindings: action_bindings(r),
        ready,
        state: if r.phase == Phase::Paused {
            pb::SandboxState::Paused
        } else {
            pb::SandboxState::Running
        } as i32,
        checkpoint: None,
    }
}

pub use sandbolt_deploy::sandbox::EGRESS_HANDLER;

/// The egress policy a list of action bindings asks for (`field` names the
/// list in errors); no binding = allow all.
fn egress_policy(bindings: &[pb::ActionBinding], field: &str) -> Result<NetworkPolicy, Status> {
    let mut found: Option<(usize, NetworkPolicy)> = None;
    for (i, b) in bindings.iter().enumerate() {
        if b.handler != EGRESS_HANDLER {
            return Err(Status::invalid_argument(format!(
                "{field}[{i}].handler {:?} is not supported: sandbolt understands only {EGRESS_HANDLER:?}",
                b.handler
            )));
        }
        if let Some((first, _)) = found {
            return Err(Status::invalid_argument(format!(
                "{field}[{i}]: a second {EGRESS_HANDLER:?} binding (the first is {field}[{first}]); send one policy"
            )));
        }
        let policy = NetworkPolicy::parse(&b.input)
            .map_err(|e| Status::invalid_argument(format!("{field}[{i}].input: {e}")))?;
        found = Some((i, policy));
    }
    Ok(found.map(|(_, p)| p).unwrap_or_default())
}

/// The egress binding while a policy is set: Ready once the agent confirmed
/// it, Pending while the record holds a policy the agent has not confirmed.
fn action_bindings(r: &SandboxRecord) -> Vec<pb::ActionBindingInfo> {
    r.policy_delivery()
        .map(|d| pb::ActionBindingInfo {
            handler: EGRESS_HANDLER.into(),
            state: if d.pending {
                pb::ActionState::Pending
            } else {
                pb::ActionState::Ready
            } as i32,
            last_transition_unix_seconds: d.since_unix_ms / 1000,
            message: d.message,
        })
        .into_iter()
        .collect()
}

/// An agent pool; `prepared` = warm sandboxes ready on its agents.
fn pool_info(p: &PoolSummary, prepared: i64) -> pb::PoolInfo {
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
        prepared_fastlets: i32::try_from(prepared).unwrap_or(i32::MAX),
        components: vec![pb::ComponentCapability {
            name: "execd".into(),
            protocol: "http".into(),
            port: sandbolt_proto::wire::EXECD_PORT.into(),
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

/// A warm pool as a pool: its template's image, runtime and limits, its
/// available warm sandboxes as prepared, its agent pool's agents (`agents`,
/// when they reported) as fastlets.
fn warm_pool_info(core: &Core, w: &WarmPoolRecord, agents: Option<&PoolSummary>) -> pb::PoolInfo {
    let status = core.warm_status(w);
    let mut info = agents.map(|a| pool_info(a, 0)).unwrap_or_default();
    info.namespace = core.registry().pool_key("", &w.agent_pool).namespace;
    info.name.clone_from(&w.name);
    if !w.runtime.is_empty() {
        info.runtime.clone_from(&w.runtime);
    }
    if !w.limits.cpu_limit.is_empty() {
        info.sandbox_cpu.clone_from(&w.limits.cpu_limit);
    }
    if !w.limits.memory_limit.is_empty() {
        info.sandbox_memory.clone_from(&w.limits.memory_limit);
    }
    if w.limits.pids_limit != 0 {
        info.sandbox_pids = w.limits.pids_limit;
    }
    info.prepared_fastlets = status.available;
    let cached = agents
        .and_then(|a| a.images.get(&w.image).copied())
        .unwrap_or(0);
    info.warm_images = vec![pb::WarmImageInfo {
        image: w.image.clone(),
        desired_fastlets: i32::try_from(core.warm_desired(w)).unwrap_or(i32::MAX),
        cached_fastlets: cached,
        observed_generation: w.generation,
        ..Default::default()
    }];
    info
}

/// Every pool of namespace `ns` (agent pools, then warm pools).
fn all_pools(core: &Core, ns: &str) -> Vec<pb::PoolInfo> {
    let summaries = core.registry().pools();
    let mut items: Vec<pb::PoolInfo> = summaries
        .iter()
        .filter(|p| p.pool.namespace == ns)
        .map(|p| pool_info(p, core.registry().warm_available_in(&p.pool)))
        .collect();
    for w in core.warm_pools().all() {
        let key = core.registry().pool_key("", &w.agent_pool);
        if key.namespace == ns {
            let agents = summaries.iter().find(|s| s.pool == key);
            items.push(warm_pool_info(core, &w, agents));
        }
    }
    items
}

/// A snapshot's `{namespace, name}` (name: its id or request id, see
/// [`Core::snapshot_named`]), recorded on the current span.
fn snapshot_name(nn: Option<&pb::NamespacedName>) -> Result<&pb::NamespacedName, Status> {
    let nn = nn.ok_or_else(|| Status::invalid_argument("snapshot is required"))?;
    if nn.name.is_empty() {
        return Err(Status::invalid_argument("snapshot.name is required"));
    }
    tracing::Span::current()
        .record("namespace", nn.namespace.as_str())
        .record("snapshot", nn.name.as_str());
    Ok(nn)
}

/// A snapshot record in v2's vocabulary: its id is the name; the capture
/// is CREATING until it SUCCEEDED or FAILED. v2 has no deleting phase: a
/// deletion waiting for restored sandboxes is SUCCEEDED with a message.
pub(crate) fn snapshot_info(r: &SnapshotRecord) -> pb::SandboxSnapshotInfo {
    let (phase, message) = match r.phase {
        SnapshotPhase::Pending => (pb::SnapshotPhase::Creating, r.message.clone()),
        SnapshotPhase::Ready => (pb::SnapshotPhase::Succeeded, r.message.clone()),
        SnapshotPhase::Failed => (pb::SnapshotPhase::Failed, r.message.clone()),
        SnapshotPhase::Deleting => (
            pb::SnapshotPhase::Succeeded,
            format!("deletion is pending: {}", r.message),
        ),
    };
    pb::SandboxSnapshotInfo {
        identity: Some(pb::SandboxIdentity {
            uid: r.uid.clone(),
            name: r.id.clone(),
            namespace: r.namespace.clone(),
        }),
        sandbox_name: r.source_sandbox.clone(),
        sandbox_uid: r.source_uid.clone(),
        template_name: r.display_name.clone(),
        phase: phase as i32,
        message,
        fastlet_name: r.agent_id.clone(),
        manifest_ref: String::new(),
        artifact_digest: String::new(),
        size_bytes: r.size_bytes,
        created_unix_seconds: r.created_at_unix_ms / 1000,
        completed_unix_seconds: r.completed_at_unix_ms / 1000,
    }
}

#[tonic::async_trait]
impl FastPathService for FastPathV2 {
    #[tracing::instrument(name = "fastpath.v2.CreateSandbox", skip_all, fields(namespace = %req.get_ref().namespace, request_id = %req.get_ref().request_id, pool = %req.get_ref().pool_ref))]
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::CreateSandboxResponse>, Status> {
        let q = req.into_inner();
        let policy = egress_policy(&q.action_bindings, "action_bindings")?;
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
        let mut spec = CreateRequest {
            request_id: q.request_id,
            namespace: q.namespace,
            wait_for_execd: completion == pb::CreateCompletion::Ready,
            // v2 cannot say a name (the request id is), a consistency,
            // limits, volumes or a runtime: the server's and the pool's
            // defaults apply (see `limits`).
            spec: fastpath_spec!(q {
                metadata: q.metadata.into_iter().collect(),
                expires_at: q.expires_at_unix_seconds,
                failure_policy: failure_policy(q.failure_policy)?,
                recovery_timeout_seconds: q.recovery_timeout_seconds,
                network_policy_json: policy.to_json(),
            }),
            ..Default::default()
        };
        // v2 has no snapshot_id: an image naming a snapshot restores it.
        self.core.restore_snapshot_named_by_image(&mut spec)?;
        let r = self.core.create(spec).await?;
        Ok(Response::new(pb::CreateSandboxResponse {
            sandbox: Some(info(&self.core, &r)),
            generation: r.object_generation(),
            completion: completion as i32,
        }))
    }

    #[tracing::instrument(
        name = "fastpath.v2.DeleteSandbox",
        skip_all,
        fields(namespace, sandbox)
    )]
    async fn delete_sandbox(
        &self,
        req: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        let (key, expect) = reference(req.get_ref().sandbox.as_ref(), 0)?;
        self.core.delete_or_tombstone(&key, &expect).await?;
        Ok(Response::new(pb::DeleteResponse {}))
    }

    #[tracing::instrument(
        name = "fastpath.v2.UpdateSandbox",
        skip_all,
        fields(namespace, sandbox)
    )]
    async fn update_sandbox(
        &self,
        req: Request<pb::UpdateSandboxRequest>,
    ) -> Result<Response<pb::UpdateSandboxResponse>, Status> {
        let q = req.into_inner();
        let (key, expect) = reference(q.sandbox.as_ref(), q.expected_generation)?;
        use pb::update_sandbox_request::Update;
        let mut network_policy = None;
        let op = match q.update {
            None => UpdateOp::None,
            Some(Update::ExpiresAtUnixSeconds(t)) => UpdateOp::Expiry(t),
            Some(Update::ResetRevision(s)) => UpdateOp::ResetRevision(s),
            Some(Update::FailurePolicy(p)) => UpdateOp::FailurePolicy(failure_policy(p)?),
            Some(Update::RecoveryTimeoutSeconds(t)) => UpdateOp::RecoveryTimeout(t),
            // The whole list is replaced: no egress binding = allow all.
            Some(Update::ActionBindings(b)) => {
                network_policy = Some(egress_policy(&b.items, "action_bindings.items")?);
                UpdateOp::None
            }
        };
        let spec = UpdateSpec {
            expect,
            metadata_upsert: q.metadata_upsert.into_iter().collect(),
            metadata_delete: q.metadata_delete_keys,
            network_policy,
        };
        let r = self.core.update(&key, op, spec).await?;
        Ok(Response::new(pb::UpdateSandboxResponse {
            sandbox: Some(identity(&r)),
            committed_generation: r.object_generation(),
        }))
    }

    #[tracing::instrument(name = "fastpath.v2.ListSandboxes", skip_all, fields(namespace = %req.get_ref().namespace))]
    async fn list_sandboxes(
        &self,
        req: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let q = req.into_inner();
        let filter = q.metadata.into_iter().collect();
        let page_size = page_size(q.page_size)?;
        let (items, next) = self
            .core
            .list(&q.namespace, &filter, page_size, &q.page_token)?;
        Ok(Response::new(pb::ListSandboxesResponse {
            items: items
                .iter()
                .map(|r| pb::SandboxSummary {
                    identity: Some(identity(r)),
                    generation: r.object_generation(),
                })
                .collect(),
            next_page_token: next,
        }))
    }

    #[tracing::instrument(name = "fastpath.v2.GetSandbox", skip_all, fields(namespace, sandbox))]
    async fn get_sandbox(
        &self,
        req: Request<pb::GetSandboxRequest>,
    ) -> Result<Response<pb::GetSandboxResponse>, Status> {
        let q = req.into_inner();
        let (key, expect) = reference(q.sandbox.as_ref(), q.expected_generation)?;
        let r = self.core.get(&key, &expect)?;
        Ok(Response::new(pb::GetSandboxResponse {
            sandbox: Some(info(&self.core, &r)),
            generation: r.object_generation(),
        }))
    }

    #[tracing::instrument(
        name = "fastpath.v2.GetSandboxDiagnostics",
        skip_all,
        fields(namespace, sandbox)
    )]
    async fn get_sandbox_diagnostics(
        &self,
        req: Request<pb::SandboxDiagnosticsRequest>,
    ) -> Result<Response<pb::SandboxDiagnosticsResponse>, Status> {
        let q = req.into_inner();
        let key = SandboxKey::named(&q.namespace, &q.sandbox_name, "sandbox_name")?;
        let d = self.core.diagnostics(&key).await?;
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
            runtime_instance_id: r.sandbox_id.to_string(),
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

    #[tracing::instrument(
        name = "fastpath.v2.ResolveEndpoint",
        skip_all,
        fields(namespace, sandbox)
    )]
    async fn resolve_endpoint(
        &self,
        req: Request<pb::ResolveEndpointRequest>,
    ) -> Result<Response<pb::ResolveEndpointResponse>, Status> {
        let q = req.into_inner();
        let (key, expect) = reference(q.sandbox.as_ref(), q.expected_generation)?;
        use pb::endpoint_target::Target;
        let target = match q.target.and_then(|t| t.target) {
            Some(Target::Port(p)) => Some(EndpointTarget::Port(p)),
            Some(Target::ComponentName(c)) => Some(EndpointTarget::Component(c)),
            None => None,
        };
        let route = self.core.resolve(&key, &expect, target)?;
        Ok(Response::new(pb::ResolveEndpointResponse {
            sandbox_uid: route.record.object_uid().to_string(),
            endpoint: Some(pb::ResolvedEndpoint {
                component_name: route.component,
                protocol: "http".into(),
                port: route.port,
            }),
            proxy_endpoint: route.proxy_endpoint,
            required_headers: route.headers.into_iter().collect(),
            route_generation: route.record.object_generation(),
            expires_at_unix_seconds: route.record.spec.expires_at,
        }))
    }

    #[tracing::instrument(name = "fastpath.v2.GetPool", skip_all, fields(namespace = %req.get_ref().namespace, pool = %req.get_ref().pool_name))]
    async fn get_pool(
        &self,
        req: Request<pb::GetPoolRequest>,
    ) -> Result<Response<pb::PoolInfo>, Status> {
        let q = req.into_inner();
        let key = self.core.registry().pool_key(&q.namespace, &q.pool_name);
        all_pools(&self.core, &key.namespace)
            .into_iter()
            .find(|p| p.name == key.pool)
            .map(Response::new)
            .ok_or_else(|| {
                Error::NotFoundOther(format!(
                    "pool {}/{} has no agents and is no warm pool",
                    key.namespace, key.pool
                ))
                .into()
            })
    }

    #[tracing::instrument(name = "fastpath.v2.ListPools", skip_all, fields(namespace = %req.get_ref().namespace))]
    async fn list_pools(
        &self,
        req: Request<pb::ListPoolsRequest>,
    ) -> Result<Response<pb::ListPoolsResponse>, Status> {
        let ns = self
            .core
            .registry()
            .pool_key(&req.get_ref().namespace, "")
            .namespace;
        Ok(Response::new(pb::ListPoolsResponse {
            items: all_pools(&self.core, &ns),
        }))
    }

    #[tracing::instrument(
        name = "fastpath.v2.CreateSandboxSnapshot",
        skip_all,
        fields(namespace, sandbox, request_id = %req.get_ref().request_id)
    )]
    async fn create_sandbox_snapshot(
        &self,
        req: Request<pb::CreateSandboxSnapshotRequest>,
    ) -> Result<Response<pb::CreateSandboxSnapshotResponse>, Status> {
        let q = req.into_inner();
        let (source, expect) = reference(q.sandbox.as_ref(), 0)?;
        let create = SnapshotCreate {
            request_id: q.request_id,
            source,
            expected_uid: expect.uid,
            display_name: q.template_name,
            metadata: q.metadata.into_iter().collect(),
            wait: false,
        };
        let r = self.core.create_snapshot(create).await?;
        Ok(Response::new(pb::CreateSandboxSnapshotResponse {
            snapshot: Some(snapshot_info(&r)),
        }))
    }

    #[tracing::instrument(
        name = "fastpath.v2.GetSandboxSnapshot",
        skip_all,
        fields(namespace, snapshot)
    )]
    async fn get_sandbox_snapshot(
        &self,
        req: Request<pb::GetSandboxSnapshotRequest>,
    ) -> Result<Response<pb::GetSandboxSnapshotResponse>, Status> {
        let q = req.get_ref();
        let nn = snapshot_name(q.snapshot.as_ref())?;
        let r = self
            .core
            .get_snapshot_named(&nn.namespace, &nn.name, &q.expected_uid)?;
        Ok(Response::new(pb::GetSandboxSnapshotResponse {
            snapshot: Some(snapshot_info(&r)),
        }))
    }

    #[tracing::instrument(
        name = "fastpath.v2.DeleteSandboxSnapshot",
        skip_all,
        fields(namespace, snapshot)
    )]
    async fn delete_sandbox_snapshot(
        &self,
        req: Request<pb::DeleteSandboxSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSandboxSnapshotResponse>, Status> {
        let r = req
            .get_ref()
            .snapshot
            .as_ref()
            .ok_or_else(|| Status::invalid_argument("snapshot is required"))?;
        let nn = snapshot_name(r.namespaced_name.as_ref())?;
        let snapshot = self
            .core
            .get_snapshot_named(&nn.namespace, &nn.name, &r.expected_uid)?;
        self.core
            .delete_snapshot(&nn.namespace, &snapshot.id, &r.expected_uid)
            .await?;
        Ok(Response::new(pb::DeleteSandboxSnapshotResponse {}))
    }

    #[tracing::instrument(
        name = "fastpath.v2.PauseSandbox",
        skip_all,
        fields(namespace, sandbox)
    )]
    async fn pause_sandbox(
        &self,
        req: Request<pb::PauseSandboxRequest>,
    ) -> Result<Response<pb::PauseSandboxResponse>, Status> {
        let q = req.into_inner();
        let (key, expect) = reference(q.sandbox.as_ref(), q.expected_generation)?;
        let r = self.core.pause(&key, &expect).await?;
        Ok(Response::new(pb::PauseSandboxResponse {
            sandbox: Some(info(&self.core, &r)),
            generation: r.object_generation(),
        }))
    }

    #[tracing::instrument(
        name = "fastpath.v2.ResumeSandbox",
        skip_all,
        fields(namespace, sandbox)
    )]
    async fn resume_sandbox(
        &self,
        req: Request<pb::ResumeSandboxRequest>,
    ) -> Result<Response<pb::ResumeSandboxResponse>, Status> {
        let q = req.into_inner();
        let (key, expect) = reference(q.sandbox.as_ref(), q.expected_generation)?;
        if !q.expected_checkpoint_id.is_empty() {
            return Err(Error::Unimplemented(
                "resume from a checkpoint is not supported yet (pause freezes in place)".into(),
            )
            .into());
        }
        let r = self.core.resume(&key, &expect).await?;
        Ok(Response::new(pb::ResumeSandboxResponse {
            sandbox: Some(info(&self.core, &r)),
            generation: r.object_generation(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding(handler: &str, input: &str) -> pb::ActionBinding {
        pb::ActionBinding {
            handler: handler.into(),
            input: input.into(),
        }
    }

    #[test]
    fn egress_binding_is_the_policy_and_nothing_else_is_understood() {
        let p = egress_policy(
            &[binding(
                "egress",
                r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"Pypi.org"}]}"#,
            )],
            "action_bindings",
        )
        .unwrap();
        assert_eq!(
            p.to_json(),
            r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"pypi.org"}]}"#
        );
        assert!(
            egress_policy(&[], "action_bindings")
                .unwrap()
                .is_allow_all()
        );
        let refused = [
            (
                vec![binding("Egress", "{}")],
                "action_bindings[0].handler \"Egress\"",
            ),
            (
                vec![binding("egress", "{")],
                "action_bindings[0].input: networkPolicy",
            ),
            (
                vec![binding("egress", "{}"), binding("egress", "{}")],
                "action_bindings[1]: a second",
            ),
        ];
        for (items, want) in refused {
            let e = egress_policy(&items, "action_bindings").unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(
                e.message().starts_with(want),
                "{} should start with {want}",
                e.message()
            );
        }
    }

    /// GetSandbox and the Sandbox resource's status (what the OpenSandbox
    /// server reads for GET and list) say the same of every phase and exit,
    /// compared as the server turns a resource's state names into FastPath
    /// values.
    #[test]
    fn getsandbox_and_the_resource_status_agree() {
        use crate::store::ContainerExit;
        let fastpath_name = |prefix: &str, v: serde_json::Value| {
            format!("{prefix}{}", v.as_str().unwrap().to_uppercase())
        };
        let mut cases: Vec<(Observed, Option<ContainerExit>, Phase)> = [
            Phase::Pending,
            Phase::Running,
            Phase::Paused,
            Phase::Recovering,
            Phase::Failed,
        ]
        .into_iter()
        .map(|p| (Observed::Recorded(p), None, p))
        .collect();
        for failed in [true, false] {
            let message = "exited".to_string();
            cases.push((
                Observed::Exited {
                    failed,
                    message: message.clone(),
                },
                Some(ContainerExit { failed, message }),
                Phase::Running,
            ));
        }
        for (observed, exit, phase) in cases {
            let r = SandboxRecord {
                phase,
                ..Default::default()
            };
            let (runtime, data_plane, _) = states(&observed);
            let status = crate::store::kube::derive_status(&r, exit.as_ref(), 1);
            let cr_runtime = serde_json::to_value(status.runtime.unwrap().state).unwrap();
            let cr_data_plane = serde_json::to_value(status.data_plane.unwrap().state).unwrap();
            assert_eq!(
                fastpath_name("RUNTIME_STATE_", cr_runtime),
                runtime.as_str_name(),
                "{observed:?}"
            );
            assert_eq!(
                fastpath_name("DATA_PLANE_STATE_", cr_data_plane),
                data_plane.as_str_name(),
                "{observed:?}"
            );
        }
    }

    /// v2 names a sandbox by its API object's uid and generation when the
    /// store has an object, and accepts either uid as the expected one.
    #[test]
    fn identity_and_preconditions_use_the_api_objects_uid_and_generation() {
        let mut r = SandboxRecord {
            uid: "controller-uid".into(),
            name: "fsb-1".into(),
            namespace: "ns".into(),
            generation: 7,
            ..Default::default()
        };
        assert_eq!(identity(&r).uid, "controller-uid", "no API object");
        r.api_uid = "cr-uid".into();
        r.api_generation = 2;
        assert_eq!(identity(&r).uid, "cr-uid");
        let nn = pb::NamespacedName {
            namespace: "ns".into(),
            name: "fsb-1".into(),
        };
        let reference_to = |uid: &str| pb::SandboxReference {
            namespaced_name: Some(nn.clone()),
            expected_uid: uid.into(),
        };
        for uid in ["cr-uid", "controller-uid", ""] {
            let (_, expect) = reference(Some(&reference_to(uid)), 2).unwrap();
            expect.check(&r).unwrap_or_else(|e| panic!("{uid:?}: {e}"));
        }
        let (_, other) = reference(Some(&reference_to("someone-else")), 0).unwrap();
        assert!(matches!(other.check(&r), Err(Error::UidMismatch(..))));
        // The record's own generation (7) is not the one v2 speaks of.
        let (_, stale) = reference(Some(&reference_to("cr-uid")), 7).unwrap();
        assert!(matches!(stale.check(&r), Err(Error::Aborted(_))));
        // The control API keeps the record's generation.
        let control = Precondition {
            generation: 7,
            ..Precondition::uid("cr-uid")
        };
        control.check(&r).unwrap();
    }

    #[test]
    fn the_binding_is_reported_ready_or_pending_while_a_policy_is_set() {
        let mut r = SandboxRecord {
            created_at_unix_ms: 5_000,
            ..Default::default()
        };
        assert!(action_bindings(&r).is_empty(), "allow-all: no binding");
        r.spec.network_policy_json = r#"{"defaultAction":"deny"}"#.into();
        let b = action_bindings(&r);
        assert_eq!(b[0].handler, "egress");
        assert_eq!(b[0].state, pb::ActionState::Ready as i32);
        assert_eq!(b[0].last_transition_unix_seconds, 5);
        r.network_policy_pending = true;
        r.network_policy_transition_unix_ms = 9_000;
        let b = action_bindings(&r);
        assert_eq!(b[0].state, pb::ActionState::Pending as i32);
        assert_eq!(b[0].last_transition_unix_seconds, 9);
        assert!(b[0].message.contains("not confirmed"), "{}", b[0].message);
    }
}
