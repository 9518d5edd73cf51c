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

fn check_token<T>(req: &Request<T>) -> Result<(), Status> {
    match req
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
    {
        Some(v) if v == format!("Bearer {AGENT_TOKEN}") => Ok(()),
        _ => Err(Status::unauthenticated("stand-in: bad token")),
    }
}

#[tonic::async_trait]
impl AgentService for Svc {
    async fn create_sandbox(
        &self,
        req: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::CreateSandboxResponse>, Status> {
        check_token(&req)?;
        let spec = req
            .into_inner()
            .spec
            .ok_or_else(|| Status::invalid_argument("spec"))?;
        if self.state.fail_creates.load(Ordering::SeqCst) {
            return Err(Status::unavailable("stand-in: creates disabled"));
        }
        let mut g = self.state.sandboxes.lock();
        if let Some(s) = g.get(&spec.sandbox_id) {
            return Ok(Response::new(pb::CreateSandboxResponse {
                status: Some(s.clone()),
                timings: None,
            }));
        }
        if g.len() >= self.capacity {
            self.state.overcommits.fetch_add(1, Ordering::SeqCst);
            return Err(Status::resource_exhausted("stand-in: over capacity"));
        }
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
            ..Default::default()
        };
        g.insert(spec.sandbox_id, st.clone());
        self.state.creates.fetch_add(1, Ordering::SeqCst);
        Ok(Response::new(pb::CreateSandboxResponse {
            status: Some(st),
            timings: Some(Default::default()),
        }))
    }

    async fn delete_sandbox(
        &self,
        req: Request<pb::DeleteSandboxRequest>,
    ) -> Result<Response<pb::DeleteSandboxResponse>, Status> {
        check_token(&req)?;
        let existed = self
            .state
            .sandboxes
            .lock()
            .remove(&req.get_ref().sandbox_id)
            .is_some();
        Ok(Response::new(pb::DeleteSandboxResponse { existed }))
    }

    async fn pause_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        check_token(&req)?;
        self.set_phase(&req.get_ref().sandbox_id, pb::SandboxPhase::Paused)
    }

    async fn resume_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        check_token(&req)?;
        self.set_phase(&req.get_ref().sandbox_id, pb::SandboxPhase::Running)
    }

    async fn update_network_policy(
        &self,
        req: Request<pb::UpdateNetworkPolicyRequest>,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        check_token(&req)?;
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
        let status = self
            .state
            .sandboxes
            .lock()
            .get(&q.sandbox_id)
            .cloned()
            .ok_or_else(|| Status::not_found("stand-in: no such sandbox"))?;
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
        check_token(&req)?;
        self.state
            .sandboxes
            .lock()
            .get(&req.get_ref().sandbox_id)
            .cloned()
            .map(Response::new)
            .ok_or_else(|| Status::not_found("stand-in: no such sandbox"))
    }

    async fn get_inventory(
        &self,
        _: Request<pb::GetInventoryRequest>,
    ) -> Result<Response<pb::Inventory>, Status> {
        Err(Status::unimplemented(
            "stand-in: heartbeats carry the inventory",
        ))
    }
}

impl Svc {
    fn set_phase(
        &self,
        id: &str,
        phase: pb::SandboxPhase,
    ) -> Result<Response<pb::SandboxStatus>, Status> {
        let mut g = self.state.sandboxes.lock();
        let s = g
            .get_mut(id)
            .ok_or_else(|| Status::not_found("stand-in: no such sandbox"))?;
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
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                if on.load(Ordering::SeqCst) {
                    let target = ctl.lock().clone();
                    let _ = send(&target, inv_fn()).await;
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
            node_name: "stand-in-node".into(),
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
            ..Default::default()
        }
    }

    pub async fn heartbeat_once(&self) {
        let target = self.controller.lock().clone();
        send(&target, self.inventory_fn()())
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

async fn send(controller: &str, inv: pb::Inventory) -> Result<(), Status> {
    let mut c = RegistryServiceClient::connect(controller.to_string())
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut req = Request::new(pb::HeartbeatRequest {
        inventory: Some(inv),
    });
    req.metadata_mut().insert(
        "authorization",
        format!("Bearer {AGENT_TOKEN}").parse().unwrap(),
    );
    c.heartbeat(req).await.map(|_| ())
}
