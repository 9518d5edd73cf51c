//! `sandbolt.control.v1.SandboxService`: the native API, which carries the
//! whole sandbox (limits, host and named volumes, runtime, pool, times). Translation only;
//! the work is in [`crate::sandbox::Core`], which FastPath v1/v2 share.

use std::sync::Arc;

use sandbolt_proto::control::v1 as pb;
use sandbolt_proto::control::v1::sandbox_service_server::SandboxService;
use sandbolt_proto::egress::NetworkPolicy;
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::ids::SandboxKey;
use crate::placement::or_default;
use crate::registry::PoolSummary;
use crate::sandbox::{
    Core, CreateRequest, DiagnosticsBounds, EndpointTarget, Observed, Precondition,
    SandboxDiagnostics, UpdateOp, UpdateSpec, page_size,
};
use crate::store::{
    Consistency, FailurePolicy, HostVolume, Phase, PvcVolume, Resources, SandboxRecord, SandboxSpec,
};
use crate::volume::{access_mode_in, access_mode_out};

pub struct ControlService {
    core: Arc<Core>,
}

impl ControlService {
    pub fn new(core: Arc<Core>) -> Self {
        Self { core }
    }
}

fn invalid(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg.into())
}

/// The sandbox a reference names, and what the caller expects of it.
fn reference(r: Option<&pb::SandboxRef>) -> Result<(SandboxKey, Precondition), Status> {
    let r = r.ok_or_else(|| invalid("sandbox is required"))?;
    let key = SandboxKey::named(&r.namespace, &r.name, "sandbox.name")?;
    Ok((key, Precondition::uid(r.expected_uid.clone())))
}
fn resources_in(r: Option<&pb::Resources>) -> Result<Resources, Status> {
    let Some(r) = r else {
        return Ok(Resources::default());
    };
    let limits = r.limits.clone().unwrap_or_default();
    let requests = r.requests.clone().unwrap_or_default();
    // Never accept and ignore: what the agent cannot enforce is refused.
    let ephemeral = limits.ephemeral_storage.trim();
    if !ephemeral.is_empty() {
        // The agent measures the writable layer against it (see
        // agent/src/storage_limit.rs); a typo is refused here, by name.
        match sandbolt_proto::quantity::bytes(ephemeral) {
            Ok(b) if b > 0 => {}
            Ok(_) => {
                return Err(invalid(
                    "resources.limits.ephemeral_storage must be more than 0 (leave it unset for no limit)",
                ));
            }
            Err(e) => return Err(invalid(format!("resources.limits.ephemeral_storage: {e}"))),
        }
    }
    if !requests.ephemeral_storage.is_empty() {
        return Err(invalid(
            "resources.requests.ephemeral_storage has no effect (sandbolt does not schedule by disk; set resources.limits.ephemeral_storage); leave it unset",
        ));
    }
    if requests.pids != 0 {
        return Err(invalid(
            "resources.requests.pids has no meaning (pids are a limit only); leave it unset",
        ));
    }
    Ok(Resources {
        cpu_limit: limits.cpu,
        memory_limit: limits.memory,
        pids_limit: limits.pids,
        cpu_request: requests.cpu,
        memory_request: requests.memory,
        ephemeral_storage_limit: ephemeral.to_string(),
    })
}

/// The request's volumes: host paths, and named volumes (`pvc`).
fn volumes_in(vs: &[pb::Volume]) -> Result<(Vec<HostVolume>, Vec<PvcVolume>), Status> {
    let mut host = Vec::new();
    let mut named = Vec::new();
    for (i, v) in vs.iter().enumerate() {
        match &v.source {
            Some(pb::volume::Source::Host(h)) => host.push(HostVolume {
                name: v.name.clone(),
                host_path: h.path.clone(),
                sub_path: v.sub_path.clone(),
                mount_path: v.mount_path.clone(),
                read_only: v.read_only,
            }),
            Some(pb::volume::Source::Pvc(p)) => named.push(pvc_in(&format!("volumes[{i}]"), v, p)?),
            None => {
                return Err(invalid(format!(
                    "volumes[{i}] names no source (host or pvc)"
                )));
            }
        }
    }
    Ok((host, named))
}

/// One named volume entry; `created_by_sandbox` is the controller's to set.
fn pvc_in(field: &str, v: &pb::Volume, p: &pb::PvcSource) -> Result<PvcVolume, Status> {
    crate::volume::check_name(&format!("{field}.pvc.claim_name"), &p.claim_name)?;
    crate::volume::check_backend(&format!("{field}.pvc.backend"), &p.backend)?;
    crate::volume::parse_size(&format!("{field}.pvc.size"), &p.size)?;
    Ok(PvcVolume {
        name: v.name.clone(),
        claim_name: p.claim_name.clone(),
        sub_path: v.sub_path.clone(),
        mount_path: v.mount_path.clone(),
        read_only: v.read_only,
        create_if_missing: p.create_if_missing,
        access_mode: access_mode_in(&format!("{field}.pvc.access_mode"), p.access_mode)?,
        size: p.size.clone(),
        backend: p.backend.clone(),
        delete_on_sandbox_delete: p.delete_on_sandbox_delete,
        created_by_sandbox: false,
        fork_from: String::new(),
    })
}

fn failure_policy_in(p: i32) -> Result<FailurePolicy, Status> {
    match pb::FailurePolicy::try_from(p) {
        Ok(pb::FailurePolicy::Unspecified | pb::FailurePolicy::Manual) => Ok(FailurePolicy::Manual),
        Ok(pb::FailurePolicy::AutoRecreate) => Ok(FailurePolicy::AutoRecreate),
        Err(_) => Err(invalid(format!("spec.failure_policy {p} is unknown"))),
    }
}

fn create_request(q: pb::CreateSandboxRequest) -> Result<CreateRequest, Status> {
    let spec = q.spec.ok_or_else(|| invalid("spec is required"))?;
    // A warm pool's template or a snapshot gives the image (the core
    // resolves both).
    if spec.image.trim().is_empty()
        && spec.pool.trim().is_empty()
        && spec.warm_pool.trim().is_empty()
        && spec.snapshot_id.trim().is_empty()
    {
        return Err(invalid("spec.image is required"));
    }
    let consistency = match pb::Consistency::try_from(q.consistency) {
        Ok(pb::Consistency::Unspecified) => None,
        Ok(pb::Consistency::Fast) => Some(Consistency::Fast),
        Ok(pb::Consistency::Strong) => Some(Consistency::Strong),
        Err(_) => return Err(invalid(format!("consistency {} is unknown", q.consistency))),
    };
    let (volumes, pvc_volumes) = volumes_in(&spec.volumes)?;
    Ok(CreateRequest {
        request_id: q.request_id,
        name: q.name,
        namespace: q.namespace,
        consistency,
        wait_for_execd: q.wait_ready,
        spec: SandboxSpec {
            failure_policy: failure_policy_in(spec.failure_policy)?,
            resources: resources_in(spec.resources.as_ref())?,
            volumes,
            pvc_volumes,
            pool: spec.pool,
            image: spec.image,
            command: spec.command,
            args: spec.args,
            envs: spec.env.into_iter().collect(),
            working_dir: spec.working_dir,
            exposed_ports: spec.exposed_ports,
            metadata: spec.metadata.into_iter().collect(),
            expires_at: spec.expires_at_unix_seconds,
            recovery_timeout_seconds: spec.recovery_timeout_seconds,
            runtime: spec.runtime,
            network_policy_json: policy_in(&spec.network_policy_json, "spec.network_policy_json")?
                .to_json(),
            warm_pool: spec.warm_pool,
            snapshot_id: spec.snapshot_id,
            sealed_envs: Default::default(),
        },
        secret_env_names: spec.secret_env_names,
    })
}

/// Policy JSON as the agent will enforce it; errors name `field` and the
/// parser's field inside it.
fn policy_in(json: &str, field: &str) -> Result<NetworkPolicy, Status> {
    NetworkPolicy::parse(json).map_err(|e| invalid(format!("{field}: {e}")))
}

fn resource_list(cpu: &str, memory: &str, pids: i64) -> Option<pb::ResourceList> {
    (!cpu.is_empty() || !memory.is_empty() || pids != 0).then(|| pb::ResourceList {
        cpu: cpu.to_string(),
        memory: memory.to_string(),
        pids,
        ephemeral_storage: String::new(),
    })
}

/// The phase a client sees, in this API's vocabulary.
fn phase_out(observed: Observed, r: &SandboxRecord) -> (pb::Phase, String) {
    match observed {
        Observed::Recorded(p) => (
            match p {
                Phase::Pending => pb::Phase::Pending,
                Phase::Running => pb::Phase::Running,
                Phase::Paused => pb::Phase::Paused,
                Phase::Recovering => pb::Phase::Recovering,
                Phase::Failed => pb::Phase::Failed,
            },
            r.message.clone(),
        ),
        Observed::AgentSilent { agent } => (
            pb::Phase::Unknown,
            format!("agent {agent} is not heartbeating"),
        ),
        Observed::Exited { message, .. } => (pb::Phase::Failed, message),
    }
}

fn spec_out(s: &SandboxSpec) -> pb::SandboxSpec {
    let res = &s.resources;
    let resources = (!res.is_empty()).then(|| {
        let mut limits = resource_list(&res.cpu_limit, &res.memory_limit, res.pids_limit);
        if !res.ephemeral_storage_limit.is_empty() {
            limits
                .get_or_insert_with(Default::default)
                .ephemeral_storage = res.ephemeral_storage_limit.clone();
        }
        pb::Resources {
            limits,
            requests: resource_list(&res.cpu_request, &res.memory_request, 0),
        }
    });
    pb::SandboxSpec {
        image: s.image.clone(),
        command: s.command.clone(),
        args: s.args.clone(),
        env: s.envs.clone().into_iter().collect(),
        working_dir: s.working_dir.clone(),
        resources,
        volumes: s
            .volumes
            .iter()
            .map(volume_out)
            .chain(s.pvc_volumes.iter().map(pvc_out))
            .collect(),
        runtime: s.runtime.clone(),
        pool: s.pool.clone(),
        failure_policy: match s.failure_policy {
            FailurePolicy::Manual => pb::FailurePolicy::Manual,
            FailurePolicy::AutoRecreate => pb::FailurePolicy::AutoRecreate,
        } as i32,
        recovery_timeout_seconds: s.recovery_timeout_seconds,
        expires_at_unix_seconds: s.expires_at,
        metadata: s.metadata.clone().into_iter().collect(),
        exposed_ports: s.exposed_ports.clone(),
        network_policy_json: s.network_policy_json.clone(),
        snapshot_id: s.snapshot_id.clone(),
        warm_pool: s.warm_pool.clone(),
        secret_env_names: s.sealed_envs.keys().cloned().collect(),
    }
}

fn volume_out(v: &HostVolume) -> pb::Volume {
    pb::Volume {
        name: v.name.clone(),
        source: Some(pb::volume::Source::Host(pb::HostPathSource {
            path: v.host_path.clone(),
        })),
        mount_path: v.mount_path.clone(),
        read_only: v.read_only,
        sub_path: v.sub_path.clone(),
    }
}

fn pvc_out(v: &PvcVolume) -> pb::Volume {
    pb::Volume {
        name: v.name.clone(),
        source: Some(pb::volume::Source::Pvc(pb::PvcSource {
            claim_name: v.claim_name.clone(),
            create_if_missing: v.create_if_missing,
            access_mode: access_mode_out(v.access_mode) as i32,
            size: v.size.clone(),
            backend: v.backend.clone(),
            delete_on_sandbox_delete: v.delete_on_sandbox_delete,
            created_by_sandbox: v.created_by_sandbox,
        })),
        mount_path: v.mount_path.clone(),
        read_only: v.read_only,
        sub_path: v.sub_path.clone(),
    }
}

pub(crate) fn sandbox(core: &Core, r: &SandboxRecord) -> pb::Sandbox {
    let (observed, view) = core.observe(r);
    let (phase, message) = phase_out(observed, r);
    pb::Sandbox {
        namespace: r.namespace.clone(),
        name: r.name.clone(),
        uid: r.uid.clone(),
        generation: r.generation,
        request_id: r.request_id.clone(),
        spec: Some(spec_out(&r.spec)),
        status: Some(pb::SandboxStatus {
            phase: phase as i32,
            message,
            agent_id: r.agent_id.to_string(),
            node_name: view.node_name,
            runtime: r.spec.runtime.clone(),
            container_id: r.sandbox_id.to_string(),
            created_at_unix_ms: r.created_at_unix_ms,
            last_transition_unix_ms: if r.last_transition_unix_ms > 0 {
                r.last_transition_unix_ms
            } else {
                r.created_at_unix_ms
            },
            // What the agent reports now; else what it answered the create.
            ip_address: view
                .observed
                .map(|o| o.ip_address)
                .filter(|ip| !ip.is_empty())
                .unwrap_or_else(|| r.ip_address.clone()),
            claimed_warm: r.claimed_warm,
        }),
    }
}

pub(crate) fn pool(p: &PoolSummary) -> pb::Pool {
    let policy = p.policy.clone().unwrap_or_default();
    let list = |r: Option<&sandbolt_proto::agent::v1::Resources>| {
        r.and_then(|r| resource_list(&r.cpu, &r.memory, r.pids_limit))
    };
    pb::Pool {
        name: p.pool.pool.clone(),
        runtime: policy.runtime.clone(),
        runtimes: p.runtimes.iter().cloned().collect(),
        default_limits: list(policy.default_limits.as_ref()),
        max_limits: list(policy.max_limits.as_ref()),
        warm_images: policy.warm_images.clone(),
        agents: p.total_agents,
        ready_agents: p.ready_agents,
        sandboxes: p.allocated.try_into().unwrap_or(i32::MAX),
        capacity: p.capacity.try_into().unwrap_or(i32::MAX),
    }
}

#[tonic::async_trait]
impl SandboxService for ControlService {
    #[tracing::instrument(name = "control.CreateSandbox", skip_all, fields(namespace = %req.get_ref().namespace, sandbox = %req.get_ref().name, request_id = %req.get_ref().request_id))]
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let spec = create_request(req.into_inner())?;
        let r = self.core.create(spec).await?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    #[tracing::instrument(name = "control.GetSandbox", skip_all, fields(namespace, sandbox))]
    async fn get_sandbox(
        &self,
        req: Request<pb::GetSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (key, expect) = reference(req.get_ref().sandbox.as_ref())?;
        let r = self.core.get(&key, &expect)?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    #[tracing::instrument(name = "control.ListSandboxes", skip_all, fields(namespace = %req.get_ref().namespace))]
    async fn list_sandboxes(
        &self,
        req: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let q = req.into_inner();
        let page_size = page_size(q.page_size)?;
        let phases = q
            .phases
            .iter()
            .map(|p| {
                pb::Phase::try_from(*p)
                    .ok()
                    .filter(|p| *p != pb::Phase::Unspecified)
                    .ok_or_else(|| invalid(format!("phases: {p} is not a phase")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let filter = q.metadata.into_iter().collect();
        let (records, next) = match page_size {
            0 => (self.core.list_all(&q.namespace, &filter)?, String::new()),
            n => self.core.list(&q.namespace, &filter, n, &q.page_token)?,
        };
        // Phases are filtered after paging: a page may hold fewer items.
        let items = records
            .iter()
            .map(|r| sandbox(&self.core, r))
            .filter(|s| {
                phases.is_empty()
                    || s.status
                        .as_ref()
                        .is_some_and(|st| phases.iter().any(|p| *p as i32 == st.phase))
            })
            .collect();
        Ok(Response::new(pb::ListSandboxesResponse {
            items,
            next_page_token: next,
        }))
    }

    #[tracing::instrument(name = "control.DeleteSandbox", skip_all, fields(namespace, sandbox))]
    async fn delete_sandbox(
        &self,
        req: Request<pb::DeleteSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (key, expect) = reference(req.get_ref().sandbox.as_ref())?;
        let r = self.core.delete(&key, &expect).await?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    #[tracing::instrument(name = "control.UpdateSandbox", skip_all, fields(namespace, sandbox))]
    async fn update_sandbox(
        &self,
        req: Request<pb::UpdateSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let q = req.into_inner();
        let (key, mut expect) = reference(q.sandbox.as_ref())?;
        expect.generation = q.expected_generation;
        let op = match q.expires_at_unix_seconds {
            Some(t) => UpdateOp::Expiry(t),
            None => UpdateOp::None,
        };
        let network_policy = q
            .network_policy_json
            .as_deref()
            .map(|j| policy_in(j, "network_policy_json"))
            .transpose()?;
        let spec = UpdateSpec {
            expect,
            metadata_upsert: q.metadata_upsert.into_iter().collect(),
            metadata_delete: q.metadata_delete_keys,
            network_policy,
        };
        let r = self.core.update(&key, op, spec).await?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    #[tracing::instrument(name = "control.PauseSandbox", skip_all, fields(namespace, sandbox))]
    async fn pause_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (key, expect) = reference(Some(req.get_ref()))?;
        let r = self.core.pause(&key, &expect).await?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    #[tracing::instrument(name = "control.ResumeSandbox", skip_all, fields(namespace, sandbox))]
    async fn resume_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (key, expect) = reference(Some(req.get_ref()))?;
        let r = self.core.resume(&key, &expect).await?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    #[tracing::instrument(name = "control.ResolveEndpoint", skip_all, fields(namespace, sandbox, port = req.get_ref().port))]
    async fn resolve_endpoint(
        &self,
        req: Request<pb::ResolveEndpointRequest>,
    ) -> Result<Response<pb::Endpoint>, Status> {
        let q = req.into_inner();
        let (key, expect) = reference(q.sandbox.as_ref())?;
        if q.port == 0 {
            return Err(invalid("port is required"));
        }
        let route = self
            .core
            .resolve(&key, &expect, Some(EndpointTarget::Port(q.port)))?;
        Ok(Response::new(pb::Endpoint {
            endpoint: route.proxy_endpoint,
            headers: route.headers.into_iter().collect(),
        }))
    }

    #[tracing::instrument(name = "control.ListPools", skip_all)]
    async fn list_pools(
        &self,
        _req: Request<pb::ListPoolsRequest>,
    ) -> Result<Response<pb::ListPoolsResponse>, Status> {
        let items = self.core.registry().pools().iter().map(pool).collect();
        Ok(Response::new(pb::ListPoolsResponse { items }))
    }

    #[tracing::instrument(name = "control.GetPool", skip_all, fields(pool = %req.get_ref().name))]
    async fn get_pool(
        &self,
        req: Request<pb::GetPoolRequest>,
    ) -> Result<Response<pb::Pool>, Status> {
        let name = or_default(&req.get_ref().name).to_string();
        self.core
            .registry()
            .pools()
            .iter()
            .find(|p| p.pool.pool == name)
            .map(|p| Response::new(pool(p)))
            .ok_or_else(|| Error::NotFoundOther(format!("pool {name:?} has no agents")).into())
    }

    #[tracing::instrument(name = "control.AttachVolume", skip_all, fields(namespace, sandbox))]
    async fn attach_volume(
        &self,
        req: Request<pb::AttachVolumeRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let q = req.into_inner();
        let (key, expect) = reference(q.sandbox.as_ref())?;
        let v = q.volume.ok_or_else(|| invalid("volume is required"))?;
        let p = match &v.source {
            Some(pb::volume::Source::Pvc(p)) => p,
            Some(pb::volume::Source::Host(_)) => {
                return Err(invalid(
                    "volume.host: only named volumes (pvc) can be attached to a running sandbox",
                ));
            }
            None => return Err(invalid("volume.pvc is required")),
        };
        let pvc = pvc_in("volume", &v, p)?;
        let r = self.core.attach_volume(&key, &expect, pvc).await?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    #[tracing::instrument(name = "control.DetachVolume", skip_all, fields(namespace, sandbox, volume = %req.get_ref().volume))]
    async fn detach_volume(
        &self,
        req: Request<pb::DetachVolumeRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let q = req.get_ref();
        let (key, expect) = reference(q.sandbox.as_ref())?;
        let r = self.core.detach_volume(&key, &expect, &q.volume).await?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    #[tracing::instrument(name = "control.GetSandboxDiagnostics", skip_all, fields(namespace, sandbox, log_tail_lines = req.get_ref().log_tail_lines))]
    async fn get_sandbox_diagnostics(
        &self,
        req: Request<pb::GetSandboxDiagnosticsRequest>,
    ) -> Result<Response<pb::SandboxDiagnostics>, Status> {
        let q = req.get_ref();
        let (key, expect) = reference(q.sandbox.as_ref())?;
        let span = tracing::Span::current();
        span.record("namespace", key.namespace.as_str());
        span.record("sandbox", key.name.as_str());
        let bounds = DiagnosticsBounds {
            log_tail_lines: q.log_tail_lines,
            log_max_bytes: q.log_max_bytes,
            event_limit: q.event_limit,
        };
        let d = self.core.sandbox_diagnostics(&key, &expect, bounds).await?;
        Ok(Response::new(diagnostics_out(&self.core, d)))
    }
}

fn diagnostics_out(core: &Core, d: SandboxDiagnostics) -> pb::SandboxDiagnostics {
    let (log, log_truncated, log_error) = match d.log {
        Ok(Some(tail)) => (tail.content, tail.truncated, String::new()),
        Ok(None) => Default::default(),
        Err(why) => (String::new(), false, why),
    };
    pb::SandboxDiagnostics {
        sandbox: Some(sandbox(core, &d.record)),
        events: d
            .events
            .into_iter()
            .map(|e| pb::SandboxEvent {
                at_unix_nanos: e.at_unix_nanos,
                level: e.level,
                source: e.source,
                phase: e.phase,
                message: e.message,
            })
            .collect(),
        events_truncated: d.events_truncated,
        log,
        log_truncated,
        log_error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(spec: pb::SandboxSpec) -> pb::CreateSandboxRequest {
        pb::CreateSandboxRequest {
            spec: Some(spec),
            ..Default::default()
        }
    }

    fn base() -> pb::SandboxSpec {
        pb::SandboxSpec {
            image: "busybox".into(),
            ..Default::default()
        }
    }

    fn pvc_spec(p: pb::PvcSource) -> pb::SandboxSpec {
        pb::SandboxSpec {
            volumes: vec![pb::Volume {
                name: "v".into(),
                source: Some(pb::volume::Source::Pvc(p)),
                mount_path: "/data".into(),
                ..Default::default()
            }],
            ..base()
        }
    }

    #[test]
    fn named_volumes_reach_the_core_with_every_field_and_come_back_out() {
        let mut spec = pvc_spec(pb::PvcSource {
            claim_name: "work".into(),
            create_if_missing: true,
            access_mode: pb::AccessMode::ReadOnlyMany as i32,
            size: "1Gi".into(),
            backend: "local".into(),
            delete_on_sandbox_delete: true,
            // The controller's mark: a request cannot set it.
            created_by_sandbox: true,
        });
        spec.volumes[0].read_only = true;
        spec.volumes[0].sub_path = "a".into();
        spec.volumes.push(pb::Volume {
            name: "h".into(),
            source: Some(pb::volume::Source::Host(pb::HostPathSource {
                path: "/srv/h".into(),
            })),
            mount_path: "/h".into(),
            ..Default::default()
        });
        let s = create_request(request(spec)).unwrap();
        assert_eq!(s.spec.volumes.len(), 1, "host volumes stay host volumes");
        let v = &s.spec.pvc_volumes[0];
        assert_eq!(v.claim_name, "work");
        assert_eq!(v.access_mode, crate::store::AccessMode::ReadOnlyMany);
        assert_eq!((v.size.as_str(), v.backend.as_str()), ("1Gi", "local"));
        assert!(v.create_if_missing && v.delete_on_sandbox_delete && v.read_only);
        assert!(!v.created_by_sandbox);
        assert_eq!((v.mount_path.as_str(), v.sub_path.as_str()), ("/data", "a"));
        let out = spec_out(&s.spec);
        assert_eq!(out.volumes.len(), 2);
        match &out.volumes[1].source {
            Some(pb::volume::Source::Pvc(p)) => {
                assert_eq!(p.claim_name, "work");
                assert_eq!(p.access_mode, pb::AccessMode::ReadOnlyMany as i32);
                assert!(p.create_if_missing && p.delete_on_sandbox_delete);
            }
            other => panic!("pvc expected, got {other:?}"),
        }
    }

    #[test]
    fn what_is_not_enforced_is_refused_by_name() {
        let cases = [
            (
                pb::SandboxSpec {
                    resources: Some(pb::Resources {
                        limits: None,
                        requests: Some(pb::ResourceList {
                            ephemeral_storage: "1Gi".into(),
                            ..Default::default()
                        }),
                    }),
                    ..base()
                },
                "requests.ephemeral_storage",
            ),
            (
                pvc_spec(pb::PvcSource::default()),
                "volumes[0].pvc.claim_name",
            ),
            (
                pvc_spec(pb::PvcSource {
                    claim_name: "Not_A_Label".into(),
                    ..Default::default()
                }),
                "volumes[0].pvc.claim_name",
            ),
            (
                pvc_spec(pb::PvcSource {
                    claim_name: "work".into(),
                    backend: "ceph".into(),
                    ..Default::default()
                }),
                "volumes[0].pvc.backend",
            ),
            (
                pvc_spec(pb::PvcSource {
                    claim_name: "work".into(),
                    size: "lots".into(),
                    ..Default::default()
                }),
                "volumes[0].pvc.size",
            ),
            (
                pvc_spec(pb::PvcSource {
                    claim_name: "work".into(),
                    access_mode: 9,
                    ..Default::default()
                }),
                "volumes[0].pvc.access_mode",
            ),
        ];
        for (spec, field) in cases {
            let e = create_request(request(spec)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(
                e.message().contains(field),
                "{} should name {field}",
                e.message()
            );
        }
    }

    #[test]
    fn an_ephemeral_storage_limit_reaches_the_spec_and_comes_back_out() {
        let limited = |q: &str| pb::SandboxSpec {
            resources: Some(pb::Resources {
                limits: Some(pb::ResourceList {
                    ephemeral_storage: q.into(),
                    ..Default::default()
                }),
                requests: None,
            }),
            ..base()
        };
        let s = create_request(request(limited("20Mi"))).unwrap();
        assert_eq!(s.spec.resources.ephemeral_storage_limit, "20Mi");
        let out = spec_out(&s.spec).resources.unwrap().limits.unwrap();
        assert_eq!(out.ephemeral_storage, "20Mi");
        for bad in ["lots", "0"] {
            let e = create_request(request(limited(bad))).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(
                e.message().contains("resources.limits.ephemeral_storage"),
                "{}",
                e.message()
            );
        }
    }

    #[test]
    fn a_restore_reaches_the_core_without_an_image_and_comes_back_out() {
        let s = create_request(request(pb::SandboxSpec {
            snapshot_id: "5f0c6f1e-1d2b-4c3a-9e8f-0a1b2c3d4e5f".into(),
            ..Default::default()
        }))
        .unwrap();
        assert_eq!(s.spec.snapshot_id, "5f0c6f1e-1d2b-4c3a-9e8f-0a1b2c3d4e5f");
        assert!(s.spec.image.is_empty(), "the core takes the snapshot's");
        assert_eq!(spec_out(&s.spec).snapshot_id, s.spec.snapshot_id);
        // Without a snapshot (nor a pool) the image is still required.
        let e = create_request(request(pb::SandboxSpec::default())).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("spec.image"), "{}", e.message());
    }

    #[test]
    fn network_policy_is_accepted_and_stored_normalized() {
        let with = |json: &str| {
            create_request(request(pb::SandboxSpec {
                network_policy_json: json.into(),
                ..base()
            }))
        };
        let s = with(
            r#" {"defaultAction":"DENY","egress":[{"action":"Allow","target":"*.PyPI.org."},{"action":"deny","target":"203.0.113.7"}]} "#,
        )
        .unwrap();
        assert_eq!(
            s.spec.network_policy_json,
            r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"*.pypi.org"},{"action":"deny","target":"203.0.113.7"}]}"#
        );
        // Every spelling of allow-all is stored as "".
        for allow_all in ["", "  ", "null", "{}", r#"{"egress":[]}"#] {
            assert_eq!(
                with(allow_all).unwrap().spec.network_policy_json,
                "",
                "{allow_all:?}"
            );
        }
        // What goes back out is what the record holds.
        let mut record = SandboxRecord::default();
        record.spec.network_policy_json = s.spec.network_policy_json.clone();
        assert_eq!(
            spec_out(&record.spec).network_policy_json,
            s.spec.network_policy_json
        );
    }

    #[test]
    fn bad_network_policy_names_the_field_and_the_parsers_field() {
        let cases = [
            (
                r#"{"defaultAction":"maybe"}"#,
                "networkPolicy.defaultAction",
            ),
            (
                r#"{"egress":[{"action":"allow","target":"ok.example"},{"action":"allow","target":"-bad-.com"}]}"#,
                "networkPolicy.egress[1].target",
            ),
            (
                r#"{"egress":[{"action":"block","target":"a.example"}]}"#,
                "networkPolicy.egress[0].action",
            ),
            (r#"{"ingress":[]}"#, "networkPolicy"),
            ("[1,2]", "networkPolicy"),
        ];
        for (json, inner) in cases {
            let e = create_request(request(pb::SandboxSpec {
                network_policy_json: json.into(),
                ..base()
            }))
            .unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{json}");
            let want = format!("spec.network_policy_json: {inner}");
            assert!(
                e.message().starts_with(&want),
                "{} should start with {want}",
                e.message()
            );
        }
    }

    #[test]
    fn everything_asked_reaches_the_core() {
        let s = create_request(pb::CreateSandboxRequest {
            request_id: "r1".into(),
            consistency: pb::Consistency::Fast as i32,
            wait_ready: true,
            spec: Some(pb::SandboxSpec {
                resources: Some(pb::Resources {
                    limits: Some(pb::ResourceList {
                        cpu: "500m".into(),
                        memory: "64Mi".into(),
                        pids: 99,
                        ..Default::default()
                    }),
                    requests: Some(pb::ResourceList {
                        cpu: "250m".into(),
                        ..Default::default()
                    }),
                }),
                volumes: vec![pb::Volume {
                    name: "v".into(),
                    source: Some(pb::volume::Source::Host(pb::HostPathSource {
                        path: "/srv/x".into(),
                    })),
                    mount_path: "/x".into(),
                    read_only: true,
                    sub_path: "a".into(),
                }],
                runtime: "runc".into(),
                pool: "gpu".into(),
                failure_policy: pb::FailurePolicy::AutoRecreate as i32,
                ..base()
            }),
            ..Default::default()
        })
        .unwrap();
        assert_eq!(s.spec.resources.cpu_limit, "500m");
        assert_eq!(s.spec.resources.memory_limit, "64Mi");
        assert_eq!(s.spec.resources.pids_limit, 99);
        assert_eq!(s.spec.resources.cpu_request, "250m");
        assert_eq!(s.spec.volumes[0].host_path, "/srv/x");
        assert!(s.spec.volumes[0].read_only);
        assert_eq!(
            (s.spec.runtime.as_str(), s.spec.pool.as_str()),
            ("runc", "gpu")
        );
        assert_eq!(s.spec.failure_policy, FailurePolicy::AutoRecreate);
        assert_eq!(s.consistency, Some(Consistency::Fast));
        assert!(s.wait_for_execd);
    }
}
