//! The systems a run measures, all on one test bed.
//!
//! Baselines: containerd's API called directly through the same Rust client
//! (the floor any containerd-based system pays), `ctr run -d` (what an
//! operator would script), and the Docker engine. sandbolt: the agent's gRPC
//! API (task started; execd ready), the controller's FastPath v2 in fast
//! and strong consistency (each with its own agent), READY = execd answers,
//! and the controller's native API (`sandbolt.control.v1`) on the fast-mode
//! controller, with and without resource limits (issue 13: what the limits
//! cost at create).

use std::path::Path;
use std::time::{Duration, Instant};

use sandbolt_agent::{Agent, AgentConfig, AgentHandle};
use sandbolt_controller::{Consistency, Controller, ControllerConfig, ControllerHandle};
use sandbolt_proto::agent::v1 as agentpb;
use sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient;
use sandbolt_proto::auth::BearerToken;
use sandbolt_proto::control::v1 as control;
use sandbolt_proto::control::v1::sandbox_service_client::SandboxServiceClient;
use sandbolt_proto::fastpath::v2;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use sandbolt_proto::wire::EXECD_PORT;
use sandbolt_testbed::{BUSYBOX_REF, BareContainerd, Testbed, busybox_image, execd_binary};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::{BenchError, Result};

/// The namespace sandbolt's agents default to, shared with the kubelet.
pub const NAMESPACE: &str = "k8s.io";
pub(crate) const TOKEN: &str = "bench-agent-token";
const SLEEP: [&str; 2] = ["sleep", "3600"];
/// What the native API's "limits" system asks for: a CFS quota of half a
/// CPU, 256 MiB of memory (swap held to it) and 512 processes.
pub const LIMIT_CPU: &str = "500m";
pub const LIMIT_MEMORY: &str = "256Mi";
pub const LIMIT_PIDS: i64 = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum System {
    ContainerdRaw,
    CtrRun,
    Docker,
    Agent,
    AgentExecd,
    FastPathFast,
    FastPathStrong,
    /// `sandbolt.control.v1` CreateSandbox on the fast-mode controller,
    /// `wait_ready`, no resource limits.
    NativeFast,
    /// The same with limits (cpu 500m, memory 256Mi, pids 512).
    NativeFastLimits,
}

impl System {
    pub const ALL: [System; 9] = [
        System::ContainerdRaw,
        System::CtrRun,
        System::Docker,
        System::Agent,
        System::AgentExecd,
        System::FastPathFast,
        System::FastPathStrong,
        System::NativeFast,
        System::NativeFastLimits,
    ];

    pub fn name(self) -> &'static str {
        match self {
            System::ContainerdRaw => "containerd API (raw floor)",
            System::CtrRun => "ctr run -d",
            System::Docker => "Docker engine",
            System::Agent => "sandbolt agent (task started)",
            System::AgentExecd => "sandbolt agent (execd ready)",
            System::FastPathFast => "sandbolt FastPath v2, fast",
            System::FastPathStrong => "sandbolt FastPath v2, strong",
            System::NativeFast => "sandbolt native API (fast)",
            System::NativeFastLimits => "sandbolt native API (fast), limits",
        }
    }

    /// Whether the system's "ready" includes execd answering inside.
    pub fn waits_for_execd(self) -> bool {
        matches!(
            self,
            System::AgentExecd
                | System::FastPathFast
                | System::FastPathStrong
                | System::NativeFast
                | System::NativeFastLimits
        )
    }
}

/// One create: client-side total and the stages the system reported.
#[derive(Debug, Clone)]
pub struct Measured {
    pub total_us: u64,
    pub stages: Vec<(String, u64)>,
}

impl Measured {
    /// Only the client-side total, since `started`.
    fn total(started: Instant) -> Measured {
        Measured {
            total_us: micros(started),
            stages: Vec::new(),
        }
    }
}

/// Stages of one create (name, µs since the create began), or why it failed.
type Stages = std::result::Result<Vec<(String, u64)>, String>;

type AgentClient = AgentServiceClient<InterceptedService<Channel, BearerToken>>;

struct ControllerPath {
    controller: ControllerHandle,
    agent: AgentHandle,
    client: FastPathServiceClient<Channel>,
    _dir: tempfile::TempDir,
}

/// A controller and its agent started by [`Bench::start_extra_controller`].
pub struct ExtraController {
    pub controller: ControllerHandle,
    pub agent: AgentHandle,
    _dir: tempfile::TempDir,
}

impl ExtraController {
    pub async fn shutdown(self) {
        self.agent.shutdown().await;
        self.controller.shutdown().await;
    }
}

/// Everything a run needs, started once.
pub struct Bench {
    agent: AgentHandle,
    agent_client: AgentClient,
    fast: ControllerPath,
    strong: ControllerPath,
    /// The native API on the fast-mode controller's port (its own
    /// connection, as the FastPath client has its own).
    native: SandboxServiceClient<Channel>,
    containerd: BareContainerd,
    docker: bollard::Docker,
    chain_id: String,
    http: reqwest::Client,
    /// FastPath sandboxes are named by the controller: bench id → name.
    names: std::collections::HashMap<String, String>,
    /// What [`Bench::start_extra_controller`] gives its agents.
    execd: std::path::PathBuf,
    runtime: String,
    _state: tempfile::TempDir,
    // Last: the daemons go after everything that talks to them.
    bed: Testbed,
}

impl Bench {
    /// Starts everything; sandbolt's agents create with the OCI `runtime`
    /// (`runc`, `crun`, `runsc`). A runtime that cannot run here makes the
    /// sandbolt systems fail their first create, which the run reports.
    pub async fn start(runtime: &str) -> Result<Bench> {
        let bed = start_bed().await?;
        let execd = tokio::task::spawn_blocking(execd_binary)
            .await
            .map_err(|e| BenchError::system("execd", e))??;
        let state = tempdir()?;
        let agents = AgentSetup {
            bed: &bed,
            execd: &execd,
            state: state.path(),
            runtime,
        };
        let agent = Agent::start(agents.config("bench-agent", None))
            .await
            .map_err(|e| BenchError::system("agent", e))?;
        let agent_client = connect_agent(agent.grpc_addr()).await?;
        let fast = start_controller_path(&agents, "fast", Consistency::Fast).await?;
        let strong = start_controller_path(&agents, "strong", Consistency::Strong).await?;
        let native =
            SandboxServiceClient::connect(format!("http://{}", fast.controller.local_addr()))
                .await
                .map_err(|e| BenchError::system(System::NativeFast.name(), e))?;
        let containerd = BareContainerd::connect(&bed, NAMESPACE).await?;
        let docker = connect_docker(&bed)?;
        // The test image has one layer, so its chain id is that layer's diff
        // id; a real client caches this per image the same way.
        let chain_id = busybox_image()?.diff_id();
        Ok(Bench {
            agent,
            agent_client,
            fast,
            strong,
            native,
            containerd,
            docker,
            chain_id,
            http: reqwest::Client::new(),
            names: Default::default(),
            execd,
            runtime: runtime.to_string(),
            _state: state,
            bed,
        })
    }

    /// Creates one sandbox/container named `id` on `system`, ready to use.
    pub async fn create(&mut self, system: System, id: &str) -> Result<Measured> {
        let started = Instant::now();
        let err = |e: String| BenchError::system(system.name(), e);
        let stages = match system {
            System::ContainerdRaw => self.raw_create(id).await,
            System::CtrRun => self
                .ctr(&[
                    "run",
                    "-d",
                    "--null-io",
                    BUSYBOX_REF,
                    id,
                    SLEEP[0],
                    SLEEP[1],
                ])
                .await
                .map(|()| Vec::new()),
            System::Docker => self.docker_create(id, started).await,
            System::Agent | System::AgentExecd => self.agent_create(system, id).await,
            System::FastPathFast | System::FastPathStrong => self.fastpath_create(system, id).await,
            System::NativeFast | System::NativeFastLimits => self.native_create(system, id).await,
        }
        .map_err(err)?;
        Ok(Measured {
            total_us: micros(started),
            stages,
        })
    }

    /// `ctr <args>` in [`NAMESPACE`] on the bed's containerd; its stderr
    /// when it fails.
    async fn ctr(&self, args: &[&str]) -> std::result::Result<(), String> {
        let out = tokio::process::Command::new("ctr")
            .arg("--address")
            .arg(self.bed.containerd_socket())
            .args(["-n", NAMESPACE])
            .args(args)
            .output()
            .await
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(())
    }

    /// Docker's create and start, the stage between them timed.
    async fn docker_create(&self, id: &str, started: Instant) -> Stages {
        use bollard::models::ContainerCreateBody;
        use bollard::query_parameters::{CreateContainerOptionsBuilder, StartContainerOptions};
        let body = ContainerCreateBody {
            image: Some("busybox:latest".into()),
            cmd: Some(sleep_command()),
            ..Default::default()
        };
        let options = CreateContainerOptionsBuilder::new().name(id).build();
        let created = self
            .docker
            .create_container(Some(options), body)
            .await
            .map_err(|e| e.to_string())?;
        let container_created = micros(started);
        self.docker
            .start_container(&created.id, None::<StartContainerOptions>)
            .await
            .map_err(|e| e.to_string())?;
        Ok(vec![("container_created".into(), container_created)])
    }

    /// The agent's CreateSandbox; its stages are the ones the agent timed.
    async fn agent_create(&mut self, system: System, id: &str) -> Stages {
        let resp = self
            .agent_client
            .create_sandbox(agentpb::CreateSandboxRequest {
                spec: Some(agent_spec(system, id)),
            })
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        let t = resp.timings.unwrap_or_default();
        let mut stages = vec![
            ("image_resolved".to_string(), t.image_resolved_us as u64),
            (
                "container_created".to_string(),
                t.container_created_us as u64,
            ),
            ("task_started".to_string(), t.task_started_us as u64),
        ];
        if t.execd_ready_us > 0 {
            stages.push(("execd_ready".into(), t.execd_ready_us as u64));
        }
        Ok(stages)
    }

    /// A READY create on FastPath v2; remembers the name the controller gave.
    async fn fastpath_create(&mut self, system: System, id: &str) -> Stages {
        let resp = self
            .path(system)
            .client
            .create_sandbox(v2_create(id))
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        let name = created_name(resp).ok_or("create answered without an identity")?;
        self.names.insert(id.to_string(), name);
        Ok(Vec::new())
    }

    /// A native create that waits for READY, checked to be what it claims.
    async fn native_create(&mut self, system: System, id: &str) -> Stages {
        let limits = system == System::NativeFastLimits;
        let sandbox = self
            .native
            .create_sandbox(native_create(id, limits))
            .await
            .map_err(|e| e.to_string())?
            .into_inner();
        check_native(&sandbox, limits)?;
        Ok(Vec::new())
    }

    /// Removes what [`Bench::create`] made (not timed).
    pub async fn remove(&mut self, system: System, id: &str) -> Result<()> {
        let err = |e: &dyn std::fmt::Display| BenchError::system(system.name(), e.to_string());
        match system {
            System::ContainerdRaw => self.raw_remove(id).await.map_err(|e| err(&e)),
            System::CtrRun => {
                self.ctr(&["tasks", "delete", "-f", id])
                    .await
                    .map_err(|e| err(&e))?;
                self.ctr(&["containers", "delete", id])
                    .await
                    .map_err(|e| err(&e))
            }
            System::Docker => {
                use bollard::query_parameters::RemoveContainerOptionsBuilder;
                self.docker
                    .remove_container(
                        id,
                        Some(RemoveContainerOptionsBuilder::new().force(true).build()),
                    )
                    .await
                    .map_err(|e| err(&e))
            }
            System::Agent | System::AgentExecd => self
                .agent_client
                .delete_sandbox(agentpb::DeleteSandboxRequest {
                    sandbox_id: id.into(),
                    grace_period_ms: 1000,
                })
                .await
                .map(|_| ())
                .map_err(|e| err(&e)),
            System::FastPathFast | System::FastPathStrong => {
                let name = self.names.remove(id).unwrap_or_else(|| id.to_string());
                self.path(system)
                    .client
                    .delete_sandbox(v2::DeleteRequest {
                        sandbox: Some(reference(&name)),
                    })
                    .await
                    .map(|_| ())
                    .map_err(|e| err(&e))
            }
            System::NativeFast | System::NativeFastLimits => self
                .native
                .delete_sandbox(control::DeleteSandboxRequest {
                    sandbox: Some(control::SandboxRef {
                        namespace: "default".into(),
                        name: id.into(),
                        expected_uid: String::new(),
                    }),
                })
                .await
                .map(|_| ())
                .map_err(|e| err(&e)),
        }
    }

    /// Runs `echo hi` through execd in a FastPath sandbox, via the endpoint
    /// the controller resolves (the agent's proxy), and returns when the
    /// command has completed.
    pub async fn run_command(&mut self, system: System, id: &str) -> Result<()> {
        let err = |e: &dyn std::fmt::Display| BenchError::system(system.name(), e.to_string());
        let name = self
            .names
            .get(id)
            .cloned()
            .unwrap_or_else(|| id.to_string());
        let resolved = self
            .path(system)
            .client
            .resolve_endpoint(v2::ResolveEndpointRequest {
                sandbox: Some(reference(&name)),
                target: Some(v2::EndpointTarget {
                    target: Some(v2::endpoint_target::Target::Port(EXECD_PORT.into())),
                }),
                ..Default::default()
            })
            .await
            .map_err(|e| err(&e))?
            .into_inner();
        let mut req = self
            .http
            .post(format!("http://{}/command", resolved.proxy_endpoint))
            .json(&serde_json::json!({"command": "echo hi"}));
        for (k, v) in &resolved.required_headers {
            req = req.header(k, v);
        }
        let body = req
            .send()
            .await
            .map_err(|e| err(&e))?
            .error_for_status()
            .map_err(|e| err(&e))?
            .text()
            .await
            .map_err(|e| err(&e))?;
        if !body.contains("execution_complete") || !body.contains("hi") {
            return Err(err(&format!("unexpected command stream: {body}")));
        }
        Ok(())
    }

    /// `n` creates at once on a sandbolt system; returns each create's
    /// latency and the wall time of the whole burst. Removes them after.
    pub async fn burst(
        &mut self,
        system: System,
        n: u32,
        tag: &str,
    ) -> Result<(Vec<Measured>, u64)> {
        let ids: Vec<String> = (0..n).map(|k| format!("burst-{tag}-{k}")).collect();
        let started = Instant::now();
        let results: Vec<std::result::Result<(String, Measured), String>> = match system {
            System::FastPathFast | System::FastPathStrong => {
                let client = self.path(system).client.clone();
                futures::future::join_all(ids.iter().map(|id| {
                    let mut client = client.clone();
                    async move {
                        let t = Instant::now();
                        let resp = client
                            .create_sandbox(v2_create(id))
                            .await
                            .map_err(|e| e.to_string())?;
                        let name = created_name(resp.into_inner()).unwrap_or_default();
                        Ok((name, Measured::total(t)))
                    }
                }))
                .await
            }
            System::Agent | System::AgentExecd => {
                let client = self.agent_client.clone();
                futures::future::join_all(ids.iter().map(|id| {
                    let mut client = client.clone();
                    let spec = agent_spec(system, id);
                    async move {
                        let t = Instant::now();
                        client
                            .create_sandbox(agentpb::CreateSandboxRequest {
                                spec: Some(spec.clone()),
                            })
                            .await
                            .map_err(|e| e.to_string())?;
                        Ok((spec.sandbox_id, Measured::total(t)))
                    }
                }))
                .await
            }
            other => {
                return Err(BenchError::system(
                    other.name(),
                    "no burst scenario for this system",
                ));
            }
        };
        let wall_us = micros(started);
        let mut measured = Vec::new();
        let mut failures = Vec::new();
        for (id, r) in ids.iter().zip(results) {
            match r {
                Ok((name, m)) => {
                    if system == System::FastPathFast || system == System::FastPathStrong {
                        self.names.insert(id.clone(), name);
                    }
                    measured.push(m);
                }
                Err(e) => failures.push(e),
            }
        }
        for id in &ids {
            if let Err(e) = self.remove(system, id).await {
                tracing::debug!(%id, error = %e, "burst cleanup");
            }
        }
        if let Some(e) = failures.first() {
            return Err(BenchError::system(
                system.name(),
                format!("{} of {n} burst creates failed, first: {e}", failures.len()),
            ));
        }
        Ok((measured, wall_us))
    }

    /// The fast-mode controller's gRPC address (FastPath v2), for clients
    /// such as the lifecycle adapter in the SDK scenario.
    pub fn fast_controller_addr(&self) -> std::net::SocketAddr {
        self.fast.controller.local_addr()
    }

    /// A fast-mode controller with an agent of its own (`bench-agent-<name>`)
    /// on this bench's bed, once the agent is a live member of its pool:
    /// for scenarios that change a controller's state (warm pools), so that
    /// the other systems' controllers stay as they were.
    pub async fn start_extra_controller(&self, name: &str) -> Result<ExtraController> {
        let agents = AgentSetup {
            bed: &self.bed,
            execd: &self.execd,
            state: self._state.path(),
            runtime: &self.runtime,
        };
        let path = start_controller_path(&agents, name, Consistency::Fast).await?;
        Ok(ExtraController {
            controller: path.controller,
            agent: path.agent,
            _dir: path._dir,
        })
    }

    /// The configuration of an agent `id` of this bench (its bed, execd,
    /// OCI runtime and token) heartbeating to the controller at
    /// `controller`, for a scenario that runs a controller of its own.
    pub fn agent_config(&self, id: &str, controller: std::net::SocketAddr) -> AgentConfig {
        let agents = AgentSetup {
            bed: &self.bed,
            execd: &self.execd,
            state: self._state.path(),
            runtime: &self.runtime,
        };
        agents.config(id, Some(format!("http://{controller}")))
    }

    /// The test bed every system runs on.
    pub fn testbed(&self) -> &Testbed {
        &self.bed
    }

    fn path(&mut self, system: System) -> &mut ControllerPath {
        match system {
            System::FastPathStrong => &mut self.strong,
            _ => &mut self.fast,
        }
    }

    async fn raw_create(&mut self, id: &str) -> std::result::Result<Vec<(String, u64)>, String> {
        let started = Instant::now();
        let e = |e: tonic::Status| e.to_string();
        self.containerd.image_name(BUSYBOX_REF).await.map_err(e)?;
        let mounts = self
            .containerd
            .create_container(id, &minimal_spec(), &self.chain_id)
            .await
            .map_err(e)?;
        let container_created = micros(started);
        self.containerd
            .create_task(id, mounts, None)
            .await
            .map_err(e)?;
        self.containerd.start_task(id).await.map_err(e)?;
        Ok(vec![("container_created".into(), container_created)])
    }

    async fn raw_remove(&mut self, id: &str) -> std::result::Result<(), String> {
        let e = |e: tonic::Status| e.to_string();
        let waiter = self.containerd.wait_task(id);
        self.containerd.kill_task(id).await.map_err(e)?;
        let _ = tokio::time::timeout(Duration::from_secs(10), waiter).await;
        self.containerd.delete(id).await.map_err(e)
    }

    pub async fn shutdown(self) {
        self.agent.shutdown().await;
        for path in [self.fast, self.strong] {
            path.agent.shutdown().await;
            path.controller.shutdown().await;
        }
        drop(self.bed);
    }
}

/// Microseconds since `started`.
fn micros(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// The command every system runs: a sandbox that idles.
fn sleep_command() -> Vec<String> {
    SLEEP.iter().map(|s| s.to_string()).collect()
}

fn tempdir() -> Result<tempfile::TempDir> {
    tempfile::tempdir().map_err(|e| BenchError::Io {
        path: "tempdir".into(),
        source: e,
    })
}

/// The bed every system runs on: containerd and dockerd, busybox in both.
async fn start_bed() -> Result<Testbed> {
    tokio::task::spawn_blocking(|| -> Result<Testbed> {
        let bed = Testbed::start_with_docker()?;
        let image = busybox_image()?;
        bed.import_image(&image, NAMESPACE)?;
        bed.docker_load(&image)?;
        Ok(bed)
    })
    .await
    .map_err(|e| BenchError::system("test bed", e))?
}

/// What every agent of a run shares.
struct AgentSetup<'a> {
    bed: &'a Testbed,
    execd: &'a Path,
    state: &'a Path,
    runtime: &'a str,
}

impl AgentSetup<'_> {
    /// Agent `id`, heartbeating to `controller` when it has one.
    fn config(&self, id: &str, controller: Option<String>) -> AgentConfig {
        let mut c = AgentConfig::new(
            id,
            self.bed.containerd_socket(),
            self.execd,
            self.state.join(id),
            TOKEN,
        );
        c.controller_endpoint = controller;
        c.controller_token = Some(TOKEN.into());
        c.heartbeat_interval = Duration::from_millis(500);
        c.stop_grace_period = Duration::from_secs(1);
        c.default_runtime = self.runtime.to_string();
        c
    }
}

async fn connect_agent(addr: std::net::SocketAddr) -> Result<AgentClient> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .expect("valid uri")
        .connect()
        .await
        .map_err(|e| BenchError::system("agent", e))?;
    Ok(AgentServiceClient::with_interceptor(
        channel,
        BearerToken::new(TOKEN).expect("ascii token"),
    ))
}

/// A controller in `consistency` with an agent of its own, once the agent
/// is a live member of its pool.
async fn start_controller_path(
    agents: &AgentSetup<'_>,
    name: &str,
    consistency: Consistency,
) -> Result<ControllerPath> {
    let dir = tempdir()?;
    let mut config = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path(), TOKEN);
    config.default_consistency = consistency;
    config.heartbeat_interval = Duration::from_millis(500);
    let controller = Controller::start(config)
        .await
        .map_err(|e| BenchError::system("controller", e))?;
    let endpoint = format!("http://{}", controller.local_addr());
    let agent = Agent::start(agents.config(&format!("bench-agent-{name}"), Some(endpoint.clone())))
        .await
        .map_err(|e| BenchError::system("agent", e))?;
    if !controller.wait_ready(Duration::from_secs(30)).await {
        return Err(BenchError::system(
            "controller",
            "no agent registered within 30 s",
        ));
    }
    let mut client = FastPathServiceClient::connect(endpoint)
        .await
        .map_err(|e| BenchError::system("controller", e))?;
    wait_for_ready_agent(&mut client).await?;
    Ok(ControllerPath {
        controller,
        agent,
        client,
        _dir: dir,
    })
}

/// The agent's first heartbeat registers it; until then the pool has no
/// live agent to place on.
pub(crate) async fn wait_for_ready_agent(
    client: &mut FastPathServiceClient<Channel>,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ready = client
            .get_pool(v2::GetPoolRequest {
                namespace: "default".into(),
                pool_name: "default".into(),
            })
            .await
            .map(|r| r.into_inner().ready_fastlets)
            .unwrap_or(0);
        if ready > 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(BenchError::system(
                "controller",
                "the agent did not register within 30 s",
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn connect_docker(bed: &Testbed) -> Result<bollard::Docker> {
    let socket = bed.docker_socket().expect("bed has docker");
    bollard::Docker::connect_with_unix(
        socket.to_str().expect("utf-8 path"),
        120,
        bollard::API_DEFAULT_VERSION,
    )
    .map_err(|e| BenchError::system("docker", e))
}

/// The agent-API spec of sandbox `id` for `system` (which says whether the
/// create waits for execd).
fn agent_spec(system: System, id: &str) -> agentpb::SandboxSpec {
    agentpb::SandboxSpec {
        sandbox_id: id.into(),
        name: id.into(),
        namespace: "bench".into(),
        image: BUSYBOX_REF.into(),
        command: sleep_command(),
        access_token: format!("token-{id}"),
        wait_for_execd: system == System::AgentExecd,
        ..Default::default()
    }
}

/// The name the controller gave a FastPath create.
fn created_name(resp: v2::CreateSandboxResponse) -> Option<String> {
    resp.sandbox.and_then(|s| s.identity).map(|i| i.name)
}

fn reference(name: &str) -> v2::SandboxReference {
    v2::SandboxReference {
        namespaced_name: Some(v2::NamespacedName {
            namespace: "default".into(),
            name: name.into(),
        }),
        expected_uid: String::new(),
    }
}

/// A READY create; `id` only makes the request id unique.
pub(crate) fn v2_create(id: &str) -> v2::CreateSandboxRequest {
    v2::CreateSandboxRequest {
        request_id: format!("bench-{id}"),
        // Pools are namespaced; `sandbolt up`'s agents serve `default`.
        namespace: "default".into(),
        // Short form on purpose: the controller normalizes references.
        image: "busybox".into(),
        command: sleep_command(),
        completion: v2::CreateCompletion::Ready as i32,
        ..Default::default()
    }
}

/// A native create that answers once execd answers, in fast consistency (as
/// the FastPath v2 systems on this controller), named `id`; with `limits`,
/// the limits of [`System::NativeFastLimits`]. Everything else is the same
/// in both, so their ratio is the cost of the limits alone.
pub(crate) fn native_create(id: &str, limits: bool) -> control::CreateSandboxRequest {
    let resources = limits.then(|| control::Resources {
        limits: Some(control::ResourceList {
            cpu: LIMIT_CPU.into(),
            memory: LIMIT_MEMORY.into(),
            pids: LIMIT_PIDS,
            ephemeral_storage: String::new(),
        }),
        requests: None,
    });
    control::CreateSandboxRequest {
        request_id: format!("bench-{id}"),
        namespace: "default".into(),
        name: id.into(),
        spec: Some(control::SandboxSpec {
            image: "busybox".into(),
            command: sleep_command(),
            resources,
            ..Default::default()
        }),
        consistency: control::Consistency::Fast as i32,
        wait_ready: true,
    }
}

/// What the controller committed must be what the system claims to
/// measure: Running, and limits exactly as asked — or none at all, so that
/// a pool default (the bench's agents set none) cannot turn the baseline
/// into a second limited system without anyone noticing.
fn check_native(sandbox: &control::Sandbox, limits: bool) -> std::result::Result<(), String> {
    let phase = sandbox.status.as_ref().map(|s| s.phase());
    if phase != Some(control::Phase::Running) {
        return Err(format!("create answered in phase {phase:?}, not Running"));
    }
    let committed = sandbox
        .spec
        .as_ref()
        .and_then(|s| s.resources.as_ref())
        .and_then(|r| r.limits.as_ref());
    let (cpu, memory, pids) = committed
        .map(|l| (l.cpu.as_str(), l.memory.as_str(), l.pids))
        .unwrap_or_default();
    let want = if limits {
        (LIMIT_CPU, LIMIT_MEMORY, LIMIT_PIDS)
    } else {
        ("", "", 0)
    };
    if (cpu, memory, pids) != want {
        return Err(format!(
            "committed limits (cpu {cpu:?}, memory {memory:?}, pids {pids}), expected {want:?}"
        ));
    }
    Ok(())
}

/// A spec close to what `ctr run` generates by default: the floor.
fn minimal_spec() -> serde_json::Value {
    serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "args": SLEEP,
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
            "user": {"uid": 0, "gid": 0},
            "noNewPrivileges": true,
        },
        "root": {"path": "rootfs"},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "ipc"}, {"type": "uts"},
                {"type": "mount"}, {"type": "network"}
            ],
        },
    })
}
