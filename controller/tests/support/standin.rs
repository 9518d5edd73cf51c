//! In-process AgentService **stand-in** for the controller's unit-level
//! tests of placement and consistency logic. It is not the agent: it creates
//! no containers, it only keeps a table of sandbox ids, enforces its
//! capacity (so an over-commit by the controller fails loudly) and pushes
//! heartbeats to the controller's real RegistryService over real gRPC.
//! End-to-end tests use the real agent on the test bed instead.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::agent_service_server::{AgentService, AgentServiceServer};
use sandbolt_proto::agent::v1::registry_service_client::RegistryServiceClient;
use sandbolt_proto::fastpath::v2;
use tonic::{Request, Response, Status};

pub const AGENT_TOKEN: &str = "test-agent-token";

/// A v2 create named by its request id. The stand-in runs nothing, so the
/// image only has to be one the agents may advertise.
pub fn create_request(request_id: &str, expires_at: i64) -> v2::CreateSandboxRequest {
    v2::CreateSandboxRequest {
        request_id: request_id.into(),
        image: "busybox".into(),
        expires_at_unix_seconds: expires_at,
        completion: v2::CreateCompletion::Ready as i32,
        ..Default::default()
    }
}

#[derive(Default)]
pub struct StandInState {
    pub sandboxes: Mutex<HashMap<String, pb::SandboxStatus>>,
    pub creates: AtomicUsize,
    pub overcommits: AtomicUsize,
    /// When set, creates fail with UNAVAILABLE.
    pub fail_creates: AtomicBool,
    /// Sandbox id → the egress policy JSON it enforces now: from its
    /// create's spec, then from every UpdateNetworkPolicy that succeeded.
    pub policies: Mutex<HashMap<String, String>>,
    /// Every UpdateNetworkPolicy call, failed or not: (sandbox id, policy).
    pub policy_calls: Mutex<Vec<(String, String)>>,
    /// When set, UpdateNetworkPolicy fails with UNAVAILABLE (an agent that
    /// cannot apply rules right now).
    pub fail_policy_updates: AtomicBool,
    /// When set, UpdateNetworkPolicy refuses with INVALID_ARGUMENT (an agent
    /// that cannot enforce the policy at all).
    pub refuse_policy_updates: AtomicBool,
    /// The stand-in has a volume root: volume calls work and heartbeats
    /// carry the volumes and capabilities.
    pub volume_root: AtomicBool,
    /// Named volumes by name.
    pub volumes: Mutex<std::collections::BTreeMap<String, pb::VolumeInfo>>,
    /// Volume names whose create fails as a full volume root would.
    pub refuse_volumes: Mutex<std::collections::HashSet<String>>,
    /// Every volume call: "<rpc> <volume>".
    pub volume_calls: Mutex<Vec<String>>,
    /// Sandbox id → the spec its create carried.
    pub specs: Mutex<HashMap<String, pb::SandboxSpec>>,
    /// Committed sandbox snapshots by id (no data: the record of a capture).
    pub snapshots: Mutex<std::collections::BTreeMap<String, pb::SnapshotInfo>>,
    /// Every snapshot call: "<rpc> <snapshot id>".
    pub snapshot_calls: Mutex<Vec<String>>,
    /// When set, CreateSnapshot fails with INTERNAL (a capture that broke).
    pub fail_captures: AtomicBool,
    /// When set, CreateSnapshot waits until it is cleared (a slow capture).
    pub hang_captures: AtomicBool,
    /// The credential the controller's Enroll gave this stand-in: the only
    /// token its AgentService accepts, as a real agent's.
    pub credential: Mutex<Option<String>>,
}

impl StandInState {
    /// The policy the stand-in enforces for `sandbox_id` (None: unknown id).
    pub fn policy(&self, sandbox_id: &str) -> Option<String> {
        self.policies.lock().get(sandbox_id).cloned()
    }
}

/// The address the stand-in gives its n-th sandbox.
fn ip_for(n: usize) -> String {
    format!("10.203.0.{}", 2 + n % 250)
}

pub struct StandInAgent {
    pub id: String,
    pub addr: SocketAddr,
    pub capacity: i32,
    pub pool: String,
    pub images: Vec<String>,
    pub state: Arc<StandInState>,
    heartbeats: Arc<AtomicBool>,
    controller: Arc<Mutex<String>>,
}

struct Svc {
    id: String,
    capacity: usize,
    state: Arc<StandInState>,
}

impl Svc {
    /// As a real enrolled agent: only its own credential is accepted.
    fn check_token<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let presented = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok());
        match (presented, self.state.credential.lock().as_deref()) {
            (Some(v), Some(c)) if v == format!("Bearer {c}") => Ok(()),
            _ => Err(Status::unauthenticated("stand-in: bad token")),
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
            .ok_or_else(|| Status::invalid_argument("spec"))?;
        if self.state.fail_creates.load(Ordering::SeqCst) {
            return Err(Status::unavailable("stand-in: creates disabled"));
        }
        self.check_restore(&spec)?;
        let mut g = self.state.sandboxes.lock();
        if let Some(s) = g.get(&spec.sandbox_id) {
            return Ok(Response::new(pb::CreateSandboxResponse {
                status: Some(s.clone()),
                timings: None,
                claimed_warm: false,
            }));
        }
        if g.len() >= self.capacity {
            self.state.overcommits.fetch_add(1, Ordering::SeqCst);
            return Err(Status::resource_exhausted("stand-in: over capacity"));
        }
        for (i, m) in spec.volume_mounts.iter().enumerate() {
            if let Err(e) = self.mount(&spec.sandbox_id, m) {
                for done in &spec.volume_mounts[..i] {
                    let _ = self.with_volume(&done.volume, |v| {
                        v.mounts.retain(|h| h.sandbox_id != spec.sandbox_id);
                        Ok(())
                    });
                }
                return Err(e);
            }
        }
        self.state
            .specs
            .lock()
            .insert(spec.sandbox_id.clone(), spec.clone());
        let n = self.state.creates.load(Ordering::SeqCst);
        self.state
            .policies
            .lock()
            .insert(spec.sandbox_id.clone(), spec.network_policy_json.clone());
        let st = pb::SandboxStatus {
            ip_address: ip_for(n),
            sandbox_id: spec.sandbox_id.clone(),
            name: spec.name,
            namespace: spec.namespace,
            record_uid: spec.record_uid,
            phase: pb::SandboxPhase::Running as i32,
            image: spec.image,
            agent_id: self.id.clone(),
            pool: spec.pool,
            proxy_path: format!("/{}", spec.sandbox_id),
            volume_mounts: spec.volume_mounts.clone(),
            ..Default::default()
        };
        g.insert(spec.sandbox_id, st.clone());
        self.state.creates.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(pb::CreateSandboxResponse {
            status: Some(st),
            timings: Some(Default::default()),
            claimed_warm: false,
        }))
    }

    async fn delete_sandbox(
        &self,
        req: Request<pb::DeleteSandboxRequest>,
    ) -> Result<Response<pb::DeleteSandboxResponse>, Status> {
        self.check_token(&req)?;
        let existed = self
            .state
            .sandboxes
            .lock()
            .remove(&req.get_ref().sandbox_id)
            .is_some();
        self.unmount_all(&req.get_ref().sandbox_id);
        Ok(Response::new(pb::DeleteSandboxResponse { existed }))
    }

    async fn pause_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        self.check_token(&req)?;
        self.set_phase(&req.get_ref().sandbox_id, pb::SandboxPhase::Paused)
    }

    async fn resume_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        self.check_token(&req)?;
        self.set_phase(&req.get_ref().sandbox_id, pb::SandboxPhase::Running)
    }

    async fn update_network_policy(
        &self,
        req: Request<pb::UpdateNetworkPolicyRequest>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        self.check_token(&req)?;
        let q = req.into_inner();
        self.state
            .policy_calls
            .lock()
            .push((q.sandbox_id.clone(), q.network_policy_json.clone()));
        if self.state.fail_policy_updates.load(Ordering::SeqCst) {
            return Err(Status::unavailable("stand-in: policy updates disabled"));
        }
        if self.state.refuse_policy_updates.load(Ordering::SeqCst) {
            return Err(Status::invalid_argument(
                "stand-in: this agent cannot enforce network policies",
            ));
        }
        // Checked like the real agent: the one parser, never trusted blindly.
        sandbolt_proto::egress::NetworkPolicy::parse(&q.network_policy_json)
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let status = self.sandbox_status(&q.sandbox_id)?;
        self.state
            .policies
            .lock()
            .insert(q.sandbox_id, q.network_policy_json);
        Ok(Response::new(status))
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        self.check_token(&req)?;
        self.sandbox_status(&req.get_ref().sandbox_id)
            .map(Response::new)
    }

    async fn get_inventory(
        &self,
        _: Request<pb::GetInventoryRequest>,
    ) -> Result<Response<pb::Inventory>, Status> {
        Err(Status::unimplemented(
            "stand-in: heartbeats carry the inventory",
        ))
    }

    // Named volumes: a table in memory with the agent's rules (names,
    // access modes, refusals while mounted); no data. An agent without a
    // volume root (`volume_root` unset) answers UNAVAILABLE.
    async fn create_volume(
        &self,
        r: Request<pb::CreateVolumeRequest>,
    ) -> Result<Response<pb::VolumeInfo>, Status> {
        self.check_token(&r)?;
        self.volume_call("create", &r.get_ref().spec.clone().unwrap_or_default().name)?;
        let spec = r.into_inner().spec.unwrap_or_default();
        if self.state.refuse_volumes.lock().contains(&spec.name) {
            return Err(Status::resource_exhausted("stand-in: volume root full"));
        }
        let mut g = self.state.volumes.lock();
        if g.contains_key(&spec.name) {
            return Err(Status::already_exists(format!(
                "stand-in: volume {} exists",
                spec.name
            )));
        }
        let info = self.new_volume(spec, String::new());
        g.insert(volume_name(&info), info.clone());
        Ok(Response::new(info))
    }
    async fn get_volume(
        &self,
        r: Request<pb::VolumeRef>,
    ) -> Result<Response<pb::VolumeInfo>, Status> {
        self.check_token(&r)?;
        self.volume_call("get", &r.get_ref().name)?;
        self.with_volume(&r.get_ref().name, |v| Ok(v.clone()))
            .map(Response::new)
    }
    async fn list_volumes(
        &self,
        r: Request<pb::ListVolumesRequest>,
    ) -> Result<Response<pb::ListVolumesResponse>, Status> {
        self.check_token(&r)?;
        self.volume_call("list", "")?;
        let volumes = self.state.volumes.lock().values().cloned().collect();
        Ok(Response::new(pb::ListVolumesResponse { volumes }))
    }
    async fn delete_volume(
        &self,
        r: Request<pb::VolumeRef>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        self.check_token(&r)?;
        let name = &r.get_ref().name;
        self.volume_call("delete", name)?;
        let mut g = self.state.volumes.lock();
        if g.get(name).is_some_and(|v| !v.mounts.is_empty()) {
            return Err(Status::failed_precondition(format!(
                "stand-in: volume {name} is mounted"
            )));
        }
        let existed = g.remove(name).is_some();
        Ok(Response::new(pb::DeleteVolumeResponse { existed }))
    }
    async fn create_volume_snapshot(
        &self,
        r: Request<pb::CreateVolumeSnapshotRequest>,
    ) -> Result<Response<pb::VolumeSnapshot>, Status> {
        self.check_token(&r)?;
        let q = r.into_inner();
        self.volume_call("snapshot", &q.volume)?;
        self.with_volume(&q.volume, |v| {
            if v.snapshots.iter().any(|s| s.name == q.name) {
                return Err(Status::already_exists("stand-in: snapshot exists"));
            }
            let s = pb::VolumeSnapshot {
                volume: q.volume.clone(),
                name: q.name.clone(),
                created_at_unix_ms: 1,
            };
            v.snapshots.push(s.clone());
            Ok(s)
        })
        .map(Response::new)
    }
    async fn delete_volume_snapshot(
        &self,
        r: Request<pb::VolumeSnapshotRef>,
    ) -> Result<Response<pb::DeleteVolumeResponse>, Status> {
        self.check_token(&r)?;
        let q = r.into_inner();
        self.volume_call("delete_snapshot", &q.volume)?;
        self.with_volume(&q.volume, |v| {
            let before = v.snapshots.len();
            v.snapshots.retain(|s| s.name != q.name);
            Ok(pb::DeleteVolumeResponse {
                existed: v.snapshots.len() != before,
            })
        })
        .map(Response::new)
    }
    async fn restore_volume(
        &self,
        r: Request<pb::RestoreVolumeRequest>,
    ) -> Result<Response<pb::VolumeInfo>, Status> {
        self.check_token(&r)?;
        let q = r.into_inner();
        self.volume_call("restore", &q.volume)?;
        self.with_volume(&q.volume, |v| {
            if !v.mounts.is_empty() {
                return Err(Status::failed_precondition("stand-in: volume is mounted"));
            }
            if !v.snapshots.iter().any(|s| s.name == q.snapshot) {
                return Err(Status::not_found("stand-in: no such snapshot"));
            }
            Ok(v.clone())
        })
        .map(Response::new)
    }
    async fn fork_volume(
        &self,
        r: Request<pb::ForkVolumeRequest>,
    ) -> Result<Response<pb::VolumeInfo>, Status> {
        self.check_token(&r)?;
        let q = r.into_inner();
        self.volume_call("fork", &q.source)?;
        let mut spec = q.spec.unwrap_or_default();
        let mut g = self.state.volumes.lock();
        let src = g
            .get(&q.source)
            .ok_or_else(|| Status::not_found("stand-in: no such volume"))?;
        if !q.snapshot.is_empty() && !src.snapshots.iter().any(|s| s.name == q.snapshot) {
            return Err(Status::not_found("stand-in: no such snapshot"));
        }
        if g.contains_key(&spec.name) {
            return Err(Status::already_exists("stand-in: volume exists"));
        }
        let src_spec = src.spec.clone().unwrap_or_default();
        if spec.access_mode == 0 {
            spec.access_mode = src_spec.access_mode;
        }
        if spec.size_bytes == 0 {
            spec.size_bytes = src_spec.size_bytes;
        }
        let from = match q.snapshot.as_str() {
            "" => q.source.clone(),
            s => format!("{}@{s}", q.source),
        };
        let info = self.new_volume(spec, from);
        g.insert(volume_name(&info), info.clone());
        Ok(Response::new(info))
    }
    async fn attach_volume(
        &self,
        r: Request<pb::AttachVolumeRequest>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        self.check_token(&r)?;
        let q = r.into_inner();
        let m = q.mount.unwrap_or_default();
        self.volume_call("attach", &m.volume)?;
        let mut sandboxes = self.state.sandboxes.lock();
        let st = sandboxes
            .get_mut(&q.sandbox_id)
            .ok_or_else(no_such_sandbox)?;
        self.mount(&q.sandbox_id, &m)?;
        st.volume_mounts.push(m);
        Ok(Response::new(st.clone()))
    }
    async fn detach_volume(
        &self,
        r: Request<pb::DetachVolumeRequest>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        self.check_token(&r)?;
        let q = r.into_inner();
        self.volume_call("detach", &q.volume)?;
        let mut sandboxes = self.state.sandboxes.lock();
        let st = sandboxes
            .get_mut(&q.sandbox_id)
            .ok_or_else(no_such_sandbox)?;
        if !st.volume_mounts.iter().any(|m| m.volume == q.volume) {
            return Err(Status::not_found("stand-in: not mounted"));
        }
        st.volume_mounts.retain(|m| m.volume != q.volume);
        self.with_volume(&q.volume, |v| {
            v.mounts.retain(|h| h.sandbox_id != q.sandbox_id);
            Ok(())
        })?;
        Ok(Response::new(st.clone()))
    }

    // Sandbox snapshots: a table of SnapshotInfo with the agent's rules
    // (source running or paused; idempotent by id; delete refused while a
    // sandbox started from it exists); no data.
    async fn create_snapshot(
        &self,
        r: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::SnapshotInfo>, Status> {
        self.check_token(&r)?;
        let q = r.into_inner();
        self.snapshot_call("create", &q.snapshot_id);
        while self.state.hang_captures.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Some(info) = self.state.snapshots.lock().get(&q.snapshot_id) {
            return Ok(Response::new(info.clone()));
        }
        if self.state.fail_captures.load(Ordering::SeqCst) {
            return Err(Status::internal("stand-in: capture failed"));
        }
        let info = self.capture(&q)?;
        self.state
            .snapshots
            .lock()
            .insert(q.snapshot_id, info.clone());
        Ok(Response::new(info))
    }

    async fn delete_snapshot(
        &self,
        r: Request<pb::SnapshotRef>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        self.check_token(&r)?;
        let id = r.into_inner().snapshot_id;
        self.snapshot_call("delete", &id);
        // One lock at a time: create_sandbox takes them in the other order.
        let live: Vec<String> = self.state.sandboxes.lock().keys().cloned().collect();
        let specs = self.state.specs.lock();
        let used = live
            .iter()
            .any(|sid| specs.get(sid).is_some_and(|s| s.snapshot_id == id));
        drop(specs);
        if used {
            return Err(Status::failed_precondition(format!(
                "stand-in: snapshot {id} is in use"
            )));
        }
        let existed = self.state.snapshots.lock().remove(&id).is_some();
        Ok(Response::new(pb::DeleteSnapshotResponse { existed }))
    }

    /// No container writes here: one line naming the sandbox stands in for
    /// its log, so a caller can tell whose log it got.
    async fn read_sandbox_log(
        &self,
        req: Request<pb::ReadSandboxLogRequest>,
    ) -> Result<Response<pb::SandboxLog>, Status> {
        self.check_token(&req)?;
        let id = &req.get_ref().sandbox_id;
        self.sandbox_status(id)?;
        let content = format!("stand-in log of {id}\n");
        Ok(Response::new(pb::SandboxLog {
            size_bytes: content.len() as u64,
            content,
            truncated: false,
        }))
    }
}

fn volume_name(v: &pb::VolumeInfo) -> String {
    v.spec.as_ref().map(|s| s.name.clone()).unwrap_or_default()
}

impl Svc {
    /// Counts the call; refuses it without a volume root.
    fn volume_call(&self, rpc: &str, volume: &str) -> Result<(), Status> {
        self.state
            .volume_calls
            .lock()
            .push(format!("{rpc} {volume}").trim().to_string());
        if self.state.volume_root.load(Ordering::SeqCst) {
            Ok(())
        } else {
            Err(Status::unavailable("stand-in: no volume root"))
        }
    }

    fn new_volume(&self, mut spec: pb::VolumeSpec, forked_from: String) -> pb::VolumeInfo {
        if spec.access_mode == 0 {
            spec.access_mode = pb::AccessMode::ReadWriteOnce as i32;
        }
        pb::VolumeInfo {
            spec: Some(spec),
            agent_id: self.id.clone(),
            node_name: node_of(&self.id),
            created_at_unix_ms: 1,
            used_bytes: 0,
            capabilities: Some(stand_in_capabilities()),
            forked_from,
            ..Default::default()
        }
    }

    fn with_volume<T>(
        &self,
        name: &str,
        f: impl FnOnce(&mut pb::VolumeInfo) -> Result<T, Status>,
    ) -> Result<T, Status> {
        let mut g = self.state.volumes.lock();
        let v = g
            .get_mut(name)
            .ok_or_else(|| Status::not_found(format!("stand-in: no volume {name}")))?;
        f(v)
    }

    /// The agent's mount rules: access mode, once per sandbox.
    fn mount(&self, sandbox_id: &str, m: &pb::NamedVolumeMount) -> Result<(), Status> {
        self.with_volume(&m.volume, |v| {
            let mode = v.spec.as_ref().map(|s| s.access_mode()).unwrap_or_default();
            if v.mounts.iter().any(|h| h.sandbox_id == sandbox_id) {
                return Err(Status::failed_precondition("stand-in: mounted already"));
            }
            if mode == pb::AccessMode::ReadOnlyMany && !m.read_only {
                return Err(Status::failed_precondition("stand-in: ReadOnlyMany"));
            }
            if mode == pb::AccessMode::ReadWriteOnce
                && !m.read_only
                && v.mounts.iter().any(|h| !h.read_only)
            {
                return Err(Status::failed_precondition(
                    "stand-in: ReadWriteOnce volume has a read-write mount",
                ));
            }
            v.mounts.push(pb::VolumeMountHolder {
                sandbox_id: sandbox_id.to_string(),
                mount_path: m.mount_path.clone(),
                read_only: m.read_only,
            });
            Ok(())
        })
    }

    /// A deleted sandbox's mounts go with it.
    fn unmount_all(&self, sandbox_id: &str) {
        for v in self.state.volumes.lock().values_mut() {
            v.mounts.retain(|h| h.sandbox_id != sandbox_id);
        }
    }
}

impl Svc {
    fn snapshot_call(&self, rpc: &str, id: &str) {
        self.state.snapshot_calls.lock().push(format!("{rpc} {id}"));
    }

    /// The snapshot of a running or paused sandbox of this stand-in: the
    /// source's identity, a size, and one entry per volume mount
    /// (`sbs-<id>` for read-write ones).
    fn capture(&self, q: &pb::CreateSnapshotRequest) -> Result<pb::SnapshotInfo, Status> {
        let src = self.sandbox_status(&q.sandbox_id)?;
        let phase = src.phase();
        if phase != pb::SandboxPhase::Running && phase != pb::SandboxPhase::Paused {
            return Err(Status::failed_precondition(
                "stand-in: sandbox is not running or paused",
            ));
        }
        let volumes = src
            .volume_mounts
            .iter()
            .map(|m| pb::SnapshotVolume {
                mount: Some(m.clone()),
                volume_snapshot: if m.read_only {
                    String::new()
                } else {
                    format!("sbs-{}", q.snapshot_id)
                },
            })
            .collect();
        Ok(pb::SnapshotInfo {
            snapshot_id: q.snapshot_id.clone(),
            sandbox_id: src.sandbox_id,
            sandbox_name: src.name,
            sandbox_namespace: src.namespace,
            image: src.image,
            size_bytes: 4096,
            created_at_unix_ms: 1,
            paused_us: if phase == pb::SandboxPhase::Paused {
                0
            } else {
                7
            },
            took_us: 11,
            volumes,
            agent_id: self.id.clone(),
            node_name: node_of(&self.id),
        })
    }

    /// A create from a snapshot needs that snapshot on this stand-in.
    fn check_restore(&self, spec: &pb::SandboxSpec) -> Result<(), Status> {
        if spec.snapshot_id.is_empty()
            || self.state.snapshots.lock().contains_key(&spec.snapshot_id)
        {
            return Ok(());
        }
        Err(Status::failed_precondition(format!(
            "stand-in: snapshot {} is not on this agent",
            spec.snapshot_id
        )))
    }
}

fn stand_in_capabilities() -> pb::VolumeCapabilities {
    pb::VolumeCapabilities {
        backend: "stand-in".into(),
        instant_snapshots: true,
        instant_forks: true,
        quota: false,
        shared: false,
    }
}

/// The node a stand-in says it runs on.
pub fn node_of(agent_id: &str) -> String {
    format!("node-{agent_id}")
}

fn no_such_sandbox() -> Status {
    Status::not_found("stand-in: no such sandbox")
}

impl Svc {
    /// The status of sandbox `id` as the table holds it, NOT_FOUND as the
    /// agent answers for one it does not hold.
    fn sandbox_status(&self, id: &str) -> Result<pb::SandboxStatus, Status> {
        self.state
            .sandboxes
            .lock()
            .get(id)
            .cloned()
            .ok_or_else(no_such_sandbox)
    }

    fn set_phase(
        &self,
        id: &str,
        phase: pb::SandboxPhase,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        let mut g = self.state.sandboxes.lock();
        let s = g.get_mut(id).ok_or_else(no_such_sandbox)?;
        s.phase = phase as i32;
        Ok(Response::new(s.clone()))
    }
}

impl StandInAgent {
    /// Serves AgentService on a free port and heartbeats to `controller`
    /// every `interval`.
    pub async fn start(
        id: &str,
        pool: &str,
        capacity: i32,
        images: &[&str],
        controller: SocketAddr,
        interval: Duration,
    ) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(StandInState::default());
        let svc = Svc {
            id: id.into(),
            capacity: capacity as usize,
            state: state.clone(),
        };
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(AgentServiceServer::new(svc))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        let a = Self {
            id: id.into(),
            addr,
            capacity,
            pool: pool.into(),
            images: images.iter().map(|s| s.to_string()).collect(),
            state,
            heartbeats: Arc::new(AtomicBool::new(true)),
            controller: Arc::new(Mutex::new(format!("http://{controller}"))),
        };
        a.heartbeat_once().await;
        let (inv_fn, on, ctl) = (a.inventory_fn(), a.heartbeats.clone(), a.controller.clone());
        let st = a.state.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                if on.load(Ordering::SeqCst) {
                    let target = ctl.lock().clone();
                    let _ = send(&target, inv_fn(), &st).await;
                }
            }
        });
        a
    }

    fn inventory_fn(&self) -> impl Fn() -> pb::Inventory + Send + 'static {
        let (id, pool, cap, images, state, addr) = (
            self.id.clone(),
            self.pool.clone(),
            self.capacity,
            self.images.clone(),
            self.state.clone(),
            self.addr,
        );
        move || pb::Inventory {
            agent_id: id.clone(),
            instance_id: "stand-in".into(),
            node_name: node_of(&id),
            pool: pool.clone(),
            max_sandboxes: cap,
            images: images
                .iter()
                .map(|r| pb::ImageInfo {
                    references: vec![r.clone()],
                    ..Default::default()
                })
                .collect(),
            sandboxes: state.sandboxes.lock().values().cloned().collect(),
            api_endpoint: addr.to_string(),
            proxy_endpoint: format!("127.0.0.1:{}", addr.port() + 10000),
            volumes: state.volumes.lock().values().cloned().collect(),
            volume_capabilities: state
                .volume_root
                .load(Ordering::SeqCst)
                .then(stand_in_capabilities),
            snapshots: state.snapshots.lock().values().cloned().collect(),
            ..Default::default()
        }
    }

    /// Sends later heartbeats to another controller (a restarted one).
    pub fn retarget(&self, controller: SocketAddr) {
        *self.controller.lock() = format!("http://{controller}");
    }

    /// Gives the stand-in a volume root (and says so at once).
    pub async fn with_volume_root(self) -> Self {
        self.state.volume_root.store(true, Ordering::SeqCst);
        self.heartbeat_once().await;
        self
    }

    pub async fn heartbeat_once(&self) {
        let target = self.controller.lock().clone();
        send(&target, self.inventory_fn()(), &self.state)
            .await
            .expect("stand-in heartbeat");
    }

    /// Stops (false) or resumes (true) the periodic heartbeats: a silent
    /// agent, as the controller sees it.
    pub fn set_heartbeats(&self, on: bool) {
        self.heartbeats.store(on, Ordering::SeqCst);
    }

    pub fn held(&self) -> usize {
        self.state.sandboxes.lock().len()
    }
}

/// One heartbeat with the stand-in's credential, enrolling (bootstrap
/// token) first when it has none or the controller refused it.
async fn send(controller: &str, inv: pb::Inventory, state: &StandInState) -> Result<(), Status> {
    let mut c = RegistryServiceClient::connect(controller.to_string())
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let known = state.credential.lock().clone();
    let credential = match known.clone() {
        Some(cred) => cred,
        None => {
            let cred = enroll(&mut c, &inv.agent_id).await?;
            *state.credential.lock() = Some(cred.clone());
            cred
        }
    };
    let mut req = Request::new(pb::HeartbeatRequest {
        inventory: Some(inv.clone()),
    });
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {credential}").parse().unwrap(),
    );
    match c.heartbeat(req).await {
        Err(s) if s.code() == tonic::Code::PermissionDenied && known.is_some() => {
            // Another controller key (a controller on a fresh data dir).
            *state.credential.lock() = None;
            Box::pin(send(controller, inv, state)).await
        }
        r => r.map(|_| ()),
    }
}

/// `RegistryService.Enroll` for `agent_id` with the bootstrap token.
pub async fn enroll(
    c: &mut RegistryServiceClient<tonic::transport::Channel>,
    agent_id: &str,
) -> Result<String, Status> {
    let mut req = Request::new(pb::EnrollRequest {
        agent_id: agent_id.into(),
        node_name: node_of(agent_id),
    });
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {AGENT_TOKEN}").parse().unwrap(),
    );
    Ok(c.enroll(req).await?.into_inner().credential)
}
