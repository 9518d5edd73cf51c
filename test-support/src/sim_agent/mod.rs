//! Simulated agents for scale tests: many light agents in one process that
//! speak the real protocol to a real controller — `Enroll` with the
//! bootstrap token for a per-agent credential, `Heartbeat` with the full
//! inventory (the sandboxes each holds) at the interval the controller
//! asks for, and the real `AgentService` gRPC on a port of their own — but
//! create no containers. Never shipped: not in the chart, not in the
//! `sandbolt` binary; the `sim-agents` binary and the scale harness
//! (`sandbolt-bench scale`) use it.
//!
//! Faults: an injected latency before every answer and a failure rate on
//! mutating calls ([`faults`]); agents can be stopped (listener closed,
//! heartbeats stopped) and restarted (a new instance id, the same
//! sandboxes and credential, as a restarted agent with its state dir),
//! one by one or by a churn loop ([`Fleet::spawn_churn`]).

pub mod faults;
mod service;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::agent_service_server::AgentServiceServer;
use sandbolt_proto::agent::v1::registry_service_client::RegistryServiceClient;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};

pub use faults::{ChurnSpec, Latency, Rng};

/// The image every simulated agent reports as cached (normalized).
pub const IMAGE: &str = "docker.io/library/busybox:latest";

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("{what} {value:?}: {reason}")]
    Parse {
        what: &'static str,
        value: String,
        reason: String,
    },
    #[error("controller endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("binding agent {agent}'s listener on {host}: {source}")]
    Bind {
        agent: String,
        host: String,
        #[source]
        source: std::io::Error,
    },
    #[error("agent {agent}: {rpc} refused: {status}")]
    Rpc {
        agent: String,
        rpc: &'static str,
        status: Box<tonic::Status>,
    },
}

/// A fleet's settings; every agent of it shares them.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// The controller's RegistryService, `http://host:port`.
    pub controller: String,
    /// The bootstrap token (`--agent-token` of the controller).
    pub bootstrap_token: String,
    pub agents: usize,
    /// Agent ids are `<prefix>-<n>` (n from 0, zero-padded to 5 digits).
    pub id_prefix: String,
    pub pool: String,
    /// `max_sandboxes` of each agent.
    pub capacity: i32,
    /// Address the agents' listeners bind (port 0: one free port each).
    pub listen_host: String,
    pub latency: Latency,
    /// Fraction of mutating calls answered UNAVAILABLE.
    pub failure_rate: f64,
    /// Heartbeat interval until the controller names one.
    pub initial_heartbeat: Duration,
    /// Enrolls and first heartbeats running at once while the fleet starts.
    pub start_concurrency: usize,
    pub seed: u64,
}

impl FleetConfig {
    pub fn new(controller: impl Into<String>, bootstrap_token: impl Into<String>) -> Self {
        Self {
            controller: controller.into(),
            bootstrap_token: bootstrap_token.into(),
            agents: 10,
            id_prefix: "sim".into(),
            pool: "default".into(),
            capacity: 1000,
            listen_host: "127.0.0.1".into(),
            latency: Latency::None,
            failure_rate: 0.0,
            initial_heartbeat: Duration::from_secs(2),
            start_concurrency: 64,
            seed: 0x5eed,
        }
    }
}

/// What the fleet did, summed over its agents.
#[derive(Debug, Default)]
pub struct Counters {
    pub creates: AtomicU64,
    pub deletes: AtomicU64,
    pub injected_failures: AtomicU64,
    pub overcommits: AtomicU64,
    pub heartbeats: AtomicU64,
    pub heartbeat_failures: AtomicU64,
    pub stops: AtomicU64,
    pub restarts: AtomicU64,
}

/// A copy of [`Counters`] at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct CounterSnapshot {
    pub creates: u64,
    pub deletes: u64,
    pub injected_failures: u64,
    pub overcommits: u64,
    pub heartbeats: u64,
    pub heartbeat_failures: u64,
    pub stops: u64,
    pub restarts: u64,
}

pub(crate) struct Shared {
    pub(crate) config: FleetConfig,
    pub(crate) rng: Rng,
    pub(crate) counters: Counters,
    /// One channel to the controller for all agents' heartbeats (each call
    /// still carries its own agent's credential).
    registry: Channel,
}

pub(crate) struct AgentState {
    pub(crate) id: String,
    pub(crate) credential: Mutex<Option<String>>,
    instance: Mutex<String>,
    pub(crate) sandboxes: Mutex<HashMap<String, pb::SandboxStatus>>,
    up: AtomicBool,
    addr: Mutex<Option<SocketAddr>>,
    stop_server: Mutex<Option<oneshot::Sender<()>>>,
    heartbeat: Mutex<Option<JoinHandle<()>>>,
    interval_ms: AtomicU64,
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

/// What `agent` reports: every sandbox it holds, its capacity, the cached
/// image and runc, as a real agent without volumes or warm pools would.
pub(crate) fn inventory(agent: &AgentState, shared: &Shared) -> pb::Inventory {
    let addr = agent.addr.lock().map(|a| a.to_string()).unwrap_or_default();
    pb::Inventory {
        agent_id: agent.id.clone(),
        instance_id: agent.instance.lock().clone(),
        node_name: format!("node-{}", agent.id),
        pool: shared.config.pool.clone(),
        max_sandboxes: shared.config.capacity,
        images: vec![pb::ImageInfo {
            references: vec![IMAGE.to_string()],
            digest: format!("sha256:{}", "0".repeat(64)),
            size_bytes: 1 << 20,
        }],
        sandboxes: agent.sandboxes.lock().values().cloned().collect(),
        // Nothing proxies data here: the proxy address is the API's, so a
        // client that tries it gets a gRPC port, never someone else's.
        proxy_endpoint: addr.clone(),
        api_endpoint: addr,
        runtimes: vec![pb::RuntimeSupport {
            name: "runc".into(),
            available: true,
            reason: String::new(),
            version: String::new(),
        }],
        generated_at_unix_ms: now_ms(),
        pool_policy: Some(pb::PoolPolicy {
            runtime: "runc".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Many simulated agents sharing one process.
pub struct Fleet {
    shared: Arc<Shared>,
    agents: Vec<Arc<AgentState>>,
}

impl Fleet {
    /// Enrolls every agent, binds its listener and sends its first
    /// heartbeat; returns once the controller has registered all of them.
    pub async fn start(config: FleetConfig) -> Result<Arc<Fleet>, SimError> {
        let registry = Endpoint::from_shared(config.controller.clone())
            .map_err(|e| SimError::Endpoint {
                endpoint: config.controller.clone(),
                reason: e.to_string(),
            })?
            .connect_timeout(Duration::from_secs(3))
            .tcp_nodelay(true)
            .connect_lazy();
        let agents = (0..config.agents)
            .map(|n| {
                Arc::new(AgentState {
                    id: format!("{}-{n:05}", config.id_prefix),
                    credential: Mutex::new(None),
                    instance: Mutex::new(String::new()),
                    sandboxes: Mutex::new(HashMap::new()),
                    up: AtomicBool::new(false),
                    addr: Mutex::new(None),
                    stop_server: Mutex::new(None),
                    heartbeat: Mutex::new(None),
                    interval_ms: AtomicU64::new(config.initial_heartbeat.as_millis() as u64),
                })
            })
            .collect();
        let fleet = Arc::new(Fleet {
            shared: Arc::new(Shared {
                rng: Rng::new(config.seed),
                config,
                counters: Counters::default(),
                registry,
            }),
            agents,
        });
        let all: Vec<usize> = (0..fleet.agents.len()).collect();
        fleet.bring_up(&all, true).await?;
        Ok(fleet)
    }

    pub fn len(&self) -> usize {
        self.agents.len()
    }

    pub fn is_empty(&self) -> bool {
        self.agents.is_empty()
    }

    pub fn id(&self, n: usize) -> &str {
        &self.agents[n].id
    }

    /// Agents up now.
    pub fn up(&self) -> usize {
        self.agents
            .iter()
            .filter(|a| a.up.load(Ordering::Acquire))
            .count()
    }

    /// Sandboxes held by all agents (up or not).
    pub fn held(&self) -> usize {
        self.agents.iter().map(|a| a.sandboxes.lock().len()).sum()
    }

    /// Every sandbox id held, with its agent.
    pub fn sandbox_ids(&self) -> Vec<(String, String)> {
        self.agents
            .iter()
            .flat_map(|a| {
                let ids: Vec<String> = a.sandboxes.lock().keys().cloned().collect();
                ids.into_iter().map(|s| (a.id.clone(), s))
            })
            .collect()
    }

    pub fn counters(&self) -> CounterSnapshot {
        let c = &self.shared.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CounterSnapshot {
            creates: l(&c.creates),
            deletes: l(&c.deletes),
            injected_failures: l(&c.injected_failures),
            overcommits: l(&c.overcommits),
            heartbeats: l(&c.heartbeats),
            heartbeat_failures: l(&c.heartbeat_failures),
            stops: l(&c.stops),
            restarts: l(&c.restarts),
        }
    }

    /// Stops agents `which`: heartbeats end, the listener closes (calls to
    /// it are refused), the sandboxes stay (a dead agent's containers run on).
    pub async fn stop(&self, which: &[usize]) {
        for &n in which {
            let a = &self.agents[n];
            if !a.up.swap(false, Ordering::AcqRel) {
                continue;
            }
            if let Some(h) = a.heartbeat.lock().take() {
                h.abort();
            }
            if let Some(tx) = a.stop_server.lock().take() {
                let _ = tx.send(());
            }
            self.shared.counters.stops.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Starts agents `which` again (new instance id, same port when it is
    /// free, same sandboxes and credential); returns once each has
    /// heartbeated.
    pub async fn restart(&self, which: &[usize]) -> Result<(), SimError> {
        let down: Vec<usize> = which
            .iter()
            .copied()
            .filter(|&n| !self.agents[n].up.load(Ordering::Acquire))
            .collect();
        self.bring_up(&down, false).await?;
        self.shared
            .counters
            .restarts
            .fetch_add(down.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Stops every agent.
    pub async fn shutdown(&self) {
        let all: Vec<usize> = (0..self.agents.len()).collect();
        self.stop(&all).await;
    }

    /// Brings `which` up, `start_concurrency` at a time; with `register`,
    /// each one's first heartbeat must be taken (else it is only tried: a
    /// restart while the controller is away keeps beating until it is back).
    async fn bring_up(&self, which: &[usize], register: bool) -> Result<(), SimError> {
        let width = self.shared.config.start_concurrency.max(1);
        for chunk in which.chunks(width) {
            let starts = chunk.iter().map(|&n| {
                let (a, s) = (self.agents[n].clone(), self.shared.clone());
                async move { start_agent(a, s, register).await }
            });
            for r in futures::future::join_all(starts).await {
                r?;
            }
        }
        Ok(())
    }

    /// Every `spec.every`, stops `spec.fraction` of the agents that are up
    /// (chosen at random, at least one), and restarts them `spec.down_for`
    /// later. Runs until the handle is aborted; [`Fleet::restart`] of every
    /// agent afterwards brings back any left down.
    pub fn spawn_churn(self: &Arc<Self>, spec: ChurnSpec) -> JoinHandle<()> {
        let fleet = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(spec.every).await;
                let victims = fleet.pick(spec.fraction);
                tracing::info!(agents = victims.len(), "churn: stopping agents");
                fleet.stop(&victims).await;
                let f = fleet.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(spec.down_for).await;
                    if let Err(e) = f.restart(&victims).await {
                        tracing::warn!(error = %e, "churn: restart failed");
                    }
                });
            }
        })
    }

    /// A random `fraction` of the agents that are up (at least one when
    /// the fraction is above zero and any is up).
    pub fn pick(&self, fraction: f64) -> Vec<usize> {
        let mut up: Vec<usize> = (0..self.agents.len())
            .filter(|&n| self.agents[n].up.load(Ordering::Acquire))
            .collect();
        if fraction <= 0.0 || up.is_empty() {
            return Vec::new();
        }
        let want = ((self.agents.len() as f64 * fraction).round() as usize).clamp(1, up.len());
        // Partial Fisher–Yates: the first `want` are a uniform sample.
        for i in 0..want {
            let j = i + (self.shared.rng.next_u64() as usize) % (up.len() - i);
            up.swap(i, j);
        }
        up.truncate(want);
        up
    }

    /// Brings every stopped agent back.
    pub async fn restart_all(&self) -> Result<(), SimError> {
        let all: Vec<usize> = (0..self.agents.len()).collect();
        self.restart(&all).await
    }
}

/// Binds, serves, enrolls when it has no credential, heartbeats once (so
/// it is registered on return when `register`) and starts its heartbeat
/// loop.
async fn start_agent(a: Arc<AgentState>, s: Arc<Shared>, register: bool) -> Result<(), SimError> {
    let host = s.config.listen_host.clone();
    let previous = *a.addr.lock();
    let listener = match previous {
        Some(addr) => match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(_) => bind(&a.id, &host).await?,
        },
        None => bind(&a.id, &host).await?,
    };
    let local = listener.local_addr().map_err(|source| SimError::Bind {
        agent: a.id.clone(),
        host: host.clone(),
        source,
    })?;
    *a.addr.lock() = Some(local);
    *a.instance.lock() = format!("{:016x}", s.rng.next_u64());
    let (tx, rx) = oneshot::channel();
    *a.stop_server.lock() = Some(tx);
    let svc = service::Svc {
        agent: a.clone(),
        shared: s.clone(),
    };
    tokio::spawn(async move {
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let served = tonic::transport::Server::builder()
            .tcp_nodelay(true)
            .add_service(AgentServiceServer::new(svc))
            .serve_with_incoming_shutdown(incoming, async {
                let _ = rx.await;
            })
            .await;
        if let Err(e) = served {
            tracing::warn!(error = %e, "sim-agent listener stopped");
        }
    });
    a.up.store(true, Ordering::Release);
    match heartbeat(&a, &s).await {
        Err(e) if register => return Err(e),
        Err(e) => tracing::debug!(error = %e, "sim-agent: first heartbeat after restart failed"),
        Ok(()) => {}
    }
    let (agent, shared) = (a.clone(), s.clone());
    *a.heartbeat.lock() = Some(tokio::spawn(heartbeat_loop(agent, shared)));
    Ok(())
}

async fn bind(agent: &str, host: &str) -> Result<tokio::net::TcpListener, SimError> {
    tokio::net::TcpListener::bind((host, 0))
        .await
        .map_err(|source| SimError::Bind {
            agent: agent.to_string(),
            host: host.to_string(),
            source,
        })
}

fn with_bearer<T>(body: T, token: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(body);
    if let Ok(v) = format!("Bearer {token}").parse() {
        req.metadata_mut().insert("authorization", v);
    }
    req.set_timeout(Duration::from_secs(10));
    req
}

async fn enroll(a: &AgentState, s: &Shared) -> Result<String, SimError> {
    let mut c = RegistryServiceClient::new(s.registry.clone());
    let req = with_bearer(
        pb::EnrollRequest {
            agent_id: a.id.clone(),
            node_name: format!("node-{}", a.id),
        },
        &s.config.bootstrap_token,
    );
    let cred = c
        .enroll(req)
        .await
        .map_err(|status| SimError::Rpc {
            agent: a.id.clone(),
            rpc: "Enroll",
            status: Box::new(status),
        })?
        .into_inner()
        .credential;
    *a.credential.lock() = Some(cred.clone());
    Ok(cred)
}

/// One heartbeat; enrolls first when the agent has no credential, and
/// again once when the controller no longer takes it (another identity
/// key: a controller on a fresh data dir).
async fn heartbeat(a: &AgentState, s: &Shared) -> Result<(), SimError> {
    let known = a.credential.lock().clone();
    let cred = match known.clone() {
        Some(c) => c,
        None => enroll(a, s).await?,
    };
    let mut c = RegistryServiceClient::new(s.registry.clone());
    let body = pb::HeartbeatRequest {
        inventory: Some(inventory(a, s)),
    };
    let answer = match c.heartbeat(with_bearer(body.clone(), &cred)).await {
        Err(st)
            if known.is_some()
                && matches!(
                    st.code(),
                    tonic::Code::PermissionDenied | tonic::Code::Unauthenticated
                ) =>
        {
            let cred = enroll(a, s).await?;
            c.heartbeat(with_bearer(body, &cred)).await
        }
        r => r,
    };
    match answer {
        Ok(r) => {
            s.counters.heartbeats.fetch_add(1, Ordering::Relaxed);
            let ms = r.into_inner().interval_ms;
            if ms > 0 {
                a.interval_ms.store(u64::from(ms), Ordering::Relaxed);
            }
            Ok(())
        }
        Err(status) => {
            s.counters
                .heartbeat_failures
                .fetch_add(1, Ordering::Relaxed);
            Err(SimError::Rpc {
                agent: a.id.clone(),
                rpc: "Heartbeat",
                status: Box::new(status),
            })
        }
    }
}

/// Heartbeats at the controller's interval; the first wait is a random
/// part of it, so a fleet started at once does not beat in step.
async fn heartbeat_loop(a: Arc<AgentState>, s: Arc<Shared>) {
    let first = a.interval_ms.load(Ordering::Relaxed) as f64 * s.rng.unit();
    tokio::time::sleep(Duration::from_millis(first as u64)).await;
    loop {
        if let Err(e) = heartbeat(&a, &s).await {
            tracing::debug!(error = %e, "sim-agent heartbeat failed");
        }
        tokio::time::sleep(Duration::from_millis(a.interval_ms.load(Ordering::Relaxed))).await;
    }
}
