//! `sandbolt.control.v1.SandboxService`: the native API, which carries the
//! whole sandbox (limits, volumes, runtime, pool, times). Translation only;
//! the work is in [`crate::sandboxes::Core`], which FastPath v1/v2 share.

use std::sync::Arc;

use sandbolt_proto::agent::v1::SandboxPhase as AgentPhase;
use sandbolt_proto::control::v1 as pb;
use sandbolt_proto::control::v1::sandbox_service_server::SandboxService;
use tonic::{Request, Response, Status};

use crate::error::Error;
use crate::placement::or_default;
use crate::registry::{PoolSummary, SandboxView};
use crate::sandboxes::{Core, CreateSpec, UpdateOp, UpdateSpec};
use crate::store::{Consistency, FailurePolicy, HostVolume, Phase, Resources, SandboxRecord};

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

/// `(namespace, name, expected uid)` of a reference.
fn reference(r: Option<&pb::SandboxRef>) -> Result<(String, String, String), Status> {
    let r = r.ok_or_else(|| invalid("sandbox is required"))?;
    if r.name.is_empty() {
        return Err(invalid("sandbox.name is required"));
    }
    Ok((
        or_default(&r.namespace).to_string(),
        r.name.clone(),
        r.expected_uid.clone(),
    ))
}

fn resources_in(r: Option<&pb::Resources>) -> Result<Resources, Status> {
    let Some(r) = r else {
        return Ok(Resources::default());
    };
    let limits = r.limits.clone().unwrap_or_default();
    let requests = r.requests.clone().unwrap_or_default();
    // Never accept and ignore: what the agent cannot enforce is refused.
    if !limits.ephemeral_storage.is_empty() {
        return Err(invalid(
            "resources.limits.ephemeral_storage is not enforced by sandbolt yet; leave it unset",
        ));
    }
    if !requests.ephemeral_storage.is_empty() {
        return Err(invalid(
            "resources.requests.ephemeral_storage is not enforced by sandbolt yet; leave it unset",
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
    })
}

fn volumes_in(vs: &[pb::Volume]) -> Result<Vec<HostVolume>, Status> {
    vs.iter()
        .enumerate()
        .map(|(i, v)| match &v.source {
            Some(pb::volume::Source::Host(h)) => Ok(HostVolume {
                name: v.name.clone(),
                host_path: h.path.clone(),
                sub_path: v.sub_path.clone(),
                mount_path: v.mount_path.clone(),
                read_only: v.read_only,
            }),
            Some(pb::volume::Source::Pvc(_)) => Err(invalid(format!(
                "volumes[{i}].pvc is not supported on the containerd fast path yet; use a host volume"
            ))),
            None => Err(invalid(format!("volumes[{i}] names no source (host or pvc)"))),
        })
        .collect()
}

fn create_spec(q: pb::CreateSandboxRequest) -> Result<CreateSpec, Status> {
    let spec = q.spec.ok_or_else(|| invalid("spec is required"))?;
    if spec.image.trim().is_empty() {
        return Err(invalid("spec.image is required"));
    }
    if !spec.network_policy_json.trim().is_empty() {
        return Err(invalid(
            "spec.network_policy_json: egress policy is not enforced by sandbolt yet; leave it unset",
        ));
    }
    if !spec.snapshot_id.is_empty() {
        return Err(invalid(
            "spec.snapshot_id: snapshots are not supported by sandbolt yet; create from an image",
        ));
    }
    let failure_policy = match pb::FailurePolicy::try_from(spec.failure_policy) {
        Ok(pb::FailurePolicy::Unspecified | pb::FailurePolicy::Manual) => FailurePolicy::Manual,
        Ok(pb::FailurePolicy::AutoRecreate) => FailurePolicy::AutoRecreate,
        Err(_) => {
            return Err(invalid(format!(
                "spec.failure_policy {} is unknown",
                spec.failure_policy
            )));
        }
    };
    let consistency = match pb::Consistency::try_from(q.consistency) {
        Ok(pb::Consistency::Unspecified) => None,
        Ok(pb::Consistency::Fast) => Some(Consistency::Fast),
        Ok(pb::Consistency::Strong) => Some(Consistency::Strong),
        Err(_) => return Err(invalid(format!("consistency {} is unknown", q.consistency))),
    };
    Ok(CreateSpec {
        request_id: q.request_id,
        name: q.name,
        namespace: q.namespace,
        pool: spec.pool,
        image: spec.image,
        command: spec.command,
        args: spec.args,
        envs: spec.env.into_iter().collect(),
        working_dir: spec.working_dir,
        exposed_ports: spec.exposed_ports,
        metadata: spec.metadata.into_iter().collect(),
        expires_at: spec.expires_at_unix_seconds,
        failure_policy,
        recovery_timeout_seconds: spec.recovery_timeout_seconds,
        consistency,
        wait_for_execd: q.wait_ready,
        resources: resources_in(spec.resources.as_ref())?,
        volumes: volumes_in(&spec.volumes)?,
        runtime: spec.runtime,
    })
}

fn resource_list(cpu: &str, memory: &str, pids: i64) -> Option<pb::ResourceList> {
    (!cpu.is_empty() || !memory.is_empty() || pids != 0).then(|| pb::ResourceList {
        cpu: cpu.to_string(),
        memory: memory.to_string(),
        pids,
        ephemeral_storage: String::new(),
    })
}

/// The phase a client sees: the record's, unless what the agent reports (or
/// its silence) says more.
fn observed_phase(view: &SandboxView, r: &SandboxRecord) -> (pb::Phase, String) {
    let phase = match r.phase {
        Phase::Pending => pb::Phase::Pending,
        Phase::Running => pb::Phase::Running,
        Phase::Paused => pb::Phase::Paused,
        Phase::Recovering => pb::Phase::Recovering,
        Phase::Failed => return (pb::Phase::Failed, r.message.clone()),
    };
    if !matches!(r.phase, Phase::Running | Phase::Paused) || r.agent_id.is_empty() {
        return (phase, r.message.clone());
    }
    if !view.agent_live {
        // Silence is not death: nothing is known, nothing is done; the
        // sandbox is Running again when its agent reports it.
        return (
            pb::Phase::Unknown,
            format!("agent {} is not heartbeating", r.agent_id),
        );
    }
    match &view.observed {
        Some(s) if matches!(s.phase(), AgentPhase::Failed | AgentPhase::Stopped) => (
            pb::Phase::Failed,
            if s.message.is_empty() {
                format!("entrypoint exited with status {}", s.exit_code)
            } else {
                s.message.clone()
            },
        ),
        _ => (phase, r.message.clone()),
    }
}

pub(crate) fn sandbox(core: &Core, r: &SandboxRecord) -> pb::Sandbox {
    let view = core.registry().sandbox_view(&r.agent_id, &r.sandbox_id);
    let (phase, message) = observed_phase(&view, r);
    let res = &r.resources;
    let resources = (!res.is_empty()).then(|| pb::Resources {
        limits: resource_list(&res.cpu_limit, &res.memory_limit, res.pids_limit),
        requests: resource_list(&res.cpu_request, &res.memory_request, 0),
    });
    pb::Sandbox {
        namespace: r.namespace.clone(),
        name: r.name.clone(),
        uid: r.uid.clone(),
        generation: r.generation,
        request_id: r.request_id.clone(),
        spec: Some(pb::SandboxSpec {
            image: r.image.clone(),
            command: r.command.clone(),
            args: r.args.clone(),
            env: r.envs.clone().into_iter().collect(),
            working_dir: r.working_dir.clone(),
            resources,
            volumes: r
                .volumes
                .iter()
                .map(|v| pb::Volume {
                    name: v.name.clone(),
                    source: Some(pb::volume::Source::Host(pb::HostPathSource {
                        path: v.host_path.clone(),
                    })),
                    mount_path: v.mount_path.clone(),
                    read_only: v.read_only,
                    sub_path: v.sub_path.clone(),
                })
                .collect(),
            runtime: r.runtime.clone(),
            pool: r.pool.clone(),
            failure_policy: match r.failure_policy {
                FailurePolicy::Manual => pb::FailurePolicy::Manual,
                FailurePolicy::AutoRecreate => pb::FailurePolicy::AutoRecreate,
            } as i32,
            recovery_timeout_seconds: r.recovery_timeout_seconds,
            expires_at_unix_seconds: r.expires_at,
            metadata: r.metadata.clone().into_iter().collect(),
            exposed_ports: r.exposed_ports.clone(),
            network_policy_json: String::new(),
            snapshot_id: String::new(),
        }),
        status: Some(pb::SandboxStatus {
            phase: phase as i32,
            message,
            agent_id: r.agent_id.clone(),
            node_name: view.node_name,
            runtime: r.runtime.clone(),
            container_id: r.sandbox_id.clone(),
            created_at_unix_ms: r.created_at_unix_ms,
            last_transition_unix_ms: if r.last_transition_unix_ms > 0 {
                r.last_transition_unix_ms
            } else {
                r.created_at_unix_ms
            },
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
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let spec = create_spec(req.into_inner())?;
        let r = self.core.create(spec).await?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::GetSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (ns, name, uid) = reference(req.get_ref().sandbox.as_ref())?;
        let r = self.core.get(&ns, &name, &uid)?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    async fn list_sandboxes(
        &self,
        req: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let q = req.into_inner();
        if q.page_size < 0 {
            return Err(invalid("page_size must not be negative"));
        }
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
        let (records, next) = if q.page_size == 0 {
            (self.core.list_all(&q.namespace, &filter)?, String::new())
        } else {
            self.core
                .list(&q.namespace, &filter, q.page_size as usize, &q.page_token)?
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

    async fn delete_sandbox(
        &self,
        req: Request<pb::DeleteSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (ns, name, uid) = reference(req.get_ref().sandbox.as_ref())?;
        let r = self.core.delete(&ns, &name, &uid).await?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    async fn update_sandbox(
        &self,
        req: Request<pb::UpdateSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let q = req.into_inner();
        let (ns, name, uid) = reference(q.sandbox.as_ref())?;
        let op = match q.expires_at_unix_seconds {
            Some(t) => UpdateOp::Expiry(t),
            None => UpdateOp::None,
        };
        let spec = UpdateSpec {
            expected_uid: uid,
            expected_generation: q.expected_generation,
            metadata_upsert: q.metadata_upsert.into_iter().collect(),
            metadata_delete: q.metadata_delete_keys,
        };
        let r = self.core.update(&ns, &name, op, spec).await?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    async fn pause_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (ns, name, uid) = reference(Some(req.get_ref()))?;
        let r = self.core.pause(&ns, &name, &uid, 0, true).await?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    async fn resume_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (ns, name, uid) = reference(Some(req.get_ref()))?;
        let r = self.core.pause(&ns, &name, &uid, 0, false).await?;
        Ok(Response::new(sandbox(&self.core, &r)))
    }

    async fn resolve_endpoint(
        &self,
        req: Request<pb::ResolveEndpointRequest>,
    ) -> Result<Response<pb::Endpoint>, Status> {
        let q = req.into_inner();
        let (ns, name, uid) = reference(q.sandbox.as_ref())?;
        if q.port == 0 {
            return Err(invalid("port is required"));
        }
        let route = self.core.resolve(&ns, &name, &uid, 0, Some(q.port), "")?;
        Ok(Response::new(pb::Endpoint {
            endpoint: route.proxy_endpoint,
            headers: route.headers.into_iter().collect(),
        }))
    }

    async fn list_pools(
        &self,
        _req: Request<pb::ListPoolsRequest>,
    ) -> Result<Response<pb::ListPoolsResponse>, Status> {
        let items = self.core.registry().pools().iter().map(pool).collect();
        Ok(Response::new(pb::ListPoolsResponse { items }))
    }

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

    #[test]
    fn what_is_not_enforced_is_refused_by_name() {
        let cases = [
            (
                pb::SandboxSpec {
                    network_policy_json: r#"{"defaultAction":"deny"}"#.into(),
                    ..base()
                },
                "network_policy_json",
            ),
            (
                pb::SandboxSpec {
                    snapshot_id: "snap-1".into(),
                    ..base()
                },
                "snapshot_id",
            ),
            (
                pb::SandboxSpec {
                    resources: Some(pb::Resources {
                        limits: Some(pb::ResourceList {
                            ephemeral_storage: "1Gi".into(),
                            ..Default::default()
                        }),
                        requests: None,
                    }),
                    ..base()
                },
                "ephemeral_storage",
            ),
            (
                pb::SandboxSpec {
                    volumes: vec![pb::Volume {
                        name: "v".into(),
                        source: Some(pb::volume::Source::Pvc(pb::PvcSource {
                            claim_name: "c".into(),
                        })),
                        mount_path: "/data".into(),
                        ..Default::default()
                    }],
                    ..base()
                },
                "volumes[0].pvc",
            ),
        ];
        for (spec, field) in cases {
            let e = create_spec(request(spec)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(
                e.message().contains(field),
                "{} should name {field}",
                e.message()
            );
        }
    }

    #[test]
    fn everything_asked_reaches_the_core() {
        let s = create_spec(pb::CreateSandboxRequest {
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
        assert_eq!(s.resources.cpu_limit, "500m");
        assert_eq!(s.resources.memory_limit, "64Mi");
        assert_eq!(s.resources.pids_limit, 99);
        assert_eq!(s.resources.cpu_request, "250m");
        assert_eq!(s.volumes[0].host_path, "/srv/x");
        assert!(s.volumes[0].read_only);
        assert_eq!((s.runtime.as_str(), s.pool.as_str()), ("runc", "gpu"));
        assert_eq!(s.failure_policy, FailurePolicy::AutoRecreate);
        assert_eq!(s.consistency, Some(Consistency::Fast));
        assert!(s.wait_for_execd);
    }
}
