//! Shared set-up for the agent's integration tests: a private containerd
//! (the test bed), the busybox image, the static execd, and a started agent.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use sandbolt_agent::volume_store::{BackendChoice, VolumeStoreConfig};
use sandbolt_agent::{Agent, AgentConfig, AgentHandle};
use sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient;
use sandbolt_proto::agent::v1::{
    CreateSandboxRequest, DeleteSandboxRequest, SandboxPhase, SandboxRef, SandboxSpec,
    SandboxStatus,
};
use sandbolt_proto::auth::BearerToken;
// Each test file uses some of these.
#[allow(unused_imports)]
pub use sandbolt_test_support::{eventually, eventually_async, eventually_blocking};
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

pub const NS: &str = "k8s.io";
pub const TOKEN: &str = "agent-test-token";

/// The token the agent's AgentService accepts: its enrolled credential when
/// it has a controller (only that one then), else [`TOKEN`].
pub async fn service_token(agent: &AgentHandle) -> String {
    agent
        .credential_within(Duration::from_secs(10))
        .await
        .unwrap_or_else(|| TOKEN.to_string())
}

pub type Client = AgentServiceClient<InterceptedService<Channel, BearerToken>>;

/// Bounds on broken runs only; nothing here asserts a speed.
pub const WAIT: Duration = Duration::from_secs(60);

/// The agent's logs, shown for failed tests (`RUST_LOG` overrides).
pub fn init_tracing() {
    sandbolt_test_support::init_tracing("sandbolt_agent=info");
}

/// A test bed with busybox imported into [`NS`].
pub fn bed() -> Testbed {
    init_tracing();
    let bed = Testbed::start().expect("test bed (private containerd) must start");
    bed.import_image(&busybox_image().expect("busybox image"), NS)
        .expect("import busybox");
    bed
}

pub fn config(bed: &Testbed, state: &Path, agent_id: &str) -> AgentConfig {
    let execd = execd_binary().expect("static execd binary");
    let mut cfg = AgentConfig::new(agent_id, bed.containerd_socket(), execd, state, TOKEN);
    cfg.stop_grace_period = Duration::from_secs(2);
    cfg.pull_timeout = Duration::from_secs(20);
    cfg
}

/// Size of a test bed's loop-backed btrfs volume pool (sparse: only what
/// is written takes space).
pub const VOLUME_POOL_BYTES: u64 = 1 << 30;

/// A volume root for the agent in the bed's directory: a loop-backed btrfs
/// image the store makes and mounts at start. [`Env::shutdown`] unmounts it
/// (which frees the loop device); a bed torn down after a panic does too
/// (it unmounts and detaches the loop devices of images below its dir).
pub fn volume_config(bed: &Testbed) -> VolumeStoreConfig {
    VolumeStoreConfig {
        root: bed.root().join("volume-root"),
        backend: BackendChoice::Btrfs,
        loop_image: bed.root().join("volumes.btrfs.img"),
        loop_size_bytes: VOLUME_POOL_BYTES,
    }
}

pub struct Env {
    // Field order: the agent stops before the bed goes away.
    pub agent: Option<AgentHandle>,
    pub client: Client,
    pub state: tempfile::TempDir,
    /// The agent's volume root, when it has one (unmounted at shutdown).
    pub volume_root: Option<PathBuf>,
    pub bed: Testbed,
}

impl Env {
    pub async fn start() -> Env {
        Self::start_with(|_| {}).await
    }

    pub async fn start_with(tweak: impl FnOnce(&mut AgentConfig)) -> Env {
        Self::start_on_bed(|_, cfg| tweak(cfg)).await
    }

    /// [`Env::start_with`] with a loop-backed btrfs volume root in the bed
    /// ([`volume_config`]).
    pub async fn start_with_volumes(tweak: impl FnOnce(&mut AgentConfig)) -> Env {
        Self::start_on_bed(|bed, cfg| {
            cfg.volumes = Some(volume_config(bed));
            tweak(cfg);
        })
        .await
    }

    async fn start_on_bed(tweak: impl FnOnce(&Testbed, &mut AgentConfig)) -> Env {
        let bed = tokio::task::spawn_blocking(bed).await.unwrap();
        let state = tempfile::tempdir().unwrap();
        let mut cfg = config(&bed, state.path(), "agent-test");
        tweak(&bed, &mut cfg);
        let volume_root = cfg.volumes.as_ref().map(|v| v.root.clone());
        let agent = Agent::start(cfg).await.expect("agent starts");
        let client = client(agent.grpc_addr(), &service_token(&agent).await).await;
        Env {
            agent: Some(agent),
            client,
            state,
            volume_root,
            bed,
        }
    }

    /// Stops the agent (sandboxes keep running) and starts a new one on
    /// the same containerd, state dir and volume root; the client is
    /// reconnected.
    pub async fn restart_agent(&mut self, tweak: impl FnOnce(&mut AgentConfig)) {
        if let Some(a) = self.agent.take() {
            a.shutdown().await;
        }
        let mut cfg = config(&self.bed, self.state.path(), "agent-test");
        if self.volume_root.is_some() {
            cfg.volumes = Some(volume_config(&self.bed));
        }
        tweak(&mut cfg);
        let agent = Agent::start(cfg).await.expect("restarted agent starts");
        self.client = client(agent.grpc_addr(), &service_token(&agent).await).await;
        self.agent = Some(agent);
    }

    pub fn agent(&self) -> &AgentHandle {
        self.agent.as_ref().unwrap()
    }

    pub fn log_path(&self, id: &str) -> PathBuf {
        self.state.path().join("logs").join(format!("{id}.log"))
    }

    /// Deletes `id` and checks that nothing of it is left; returns whether
    /// it existed.
    pub async fn delete_leaving_nothing(&mut self, id: &str, grace_period_ms: u32) -> bool {
        let existed = delete(&mut self.client, id, grace_period_ms).await;
        assert_eq!(leftovers(self, id), Vec::<String>::new());
        existed
    }

    /// Creates `spec` on this env's agent.
    pub async fn create(
        &mut self,
        spec: SandboxSpec,
    ) -> Result<sandbolt_proto::agent::v1::CreateSandboxResponse, tonic::Status> {
        let resp = self.client.create_sandbox(create_req(spec)).await?;
        Ok(resp.into_inner())
    }

    pub fn ctr(&self, args: &[&str]) -> String {
        self.bed.ctr_output(NS, args).unwrap()
    }

    pub async fn shutdown(mut self) {
        if let Some(a) = self.agent.take() {
            a.shutdown().await;
        }
        if let Some(root) = self.volume_root.take() {
            tokio::task::spawn_blocking(move || {
                sandbolt_agent::volume_store::unmount_root(&root)
                    .unwrap_or_else(|e| panic!("unmounting the volume root {root:?}: {e}"))
            })
            .await
            .unwrap();
        }
        tokio::task::spawn_blocking(move || drop(self))
            .await
            .unwrap();
    }
}

pub async fn client(addr: std::net::SocketAddr, token: &str) -> Client {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect to agent");
    AgentServiceClient::with_interceptor(channel, BearerToken::new(token).unwrap())
}

pub fn spec(id: &str, command: &[&str]) -> SandboxSpec {
    SandboxSpec {
        sandbox_id: id.to_string(),
        name: format!("name-{id}"),
        namespace: "tests".into(),
        image: "busybox".into(),
        command: command.iter().map(|s| s.to_string()).collect(),
        access_token: format!("token-{id}"),
        ..Default::default()
    }
}

/// [`spec`] running `script` under `sh -c`.
pub fn sh_spec(id: &str, script: &str) -> SandboxSpec {
    spec(id, &["sh", "-c", script])
}

pub fn create_req(spec: SandboxSpec) -> CreateSandboxRequest {
    CreateSandboxRequest { spec: Some(spec) }
}

/// Deletes sandbox `id` through the API; returns whether it existed.
pub async fn delete(client: &mut Client, id: &str, grace_period_ms: u32) -> bool {
    client
        .delete_sandbox(DeleteSandboxRequest {
            sandbox_id: id.into(),
            grace_period_ms,
        })
        .await
        .unwrap_or_else(|e| panic!("delete {id}: {e:?}"))
        .into_inner()
        .existed
}

/// The agent's status of sandbox `id`.
pub async fn get(client: &mut Client, id: &str) -> Result<SandboxStatus, tonic::Status> {
    client
        .get_sandbox(SandboxRef {
            sandbox_id: id.into(),
        })
        .await
        .map(tonic::Response::into_inner)
}

/// Polls the agent until sandbox `id` is in `phase`; returns that status.
pub async fn wait_for_phase(client: &Client, id: &str, phase: SandboxPhase) -> SandboxStatus {
    eventually_async(&format!("{id} to reach {phase:?}"), WAIT, || {
        let mut c = client.clone();
        async move { get(&mut c, id).await.ok().filter(|s| s.phase() == phase) }
    })
    .await
}

/// Whether process `pid` is gone (exited and reaped).
pub fn process_gone(pid: u32) -> bool {
    !Path::new(&format!("/proc/{pid}")).exists()
}

/// What of sandbox `id` still exists: containers, tasks, snapshots, mounts,
/// log file, cgroup directories. Empty means nothing is left.
pub fn leftovers(env: &Env, id: &str) -> Vec<String> {
    leftovers_in(&env.bed, env.state.path(), id)
}

/// [`leftovers`] for a bed and an agent state dir.
pub fn leftovers_in(bed: &Testbed, state: &Path, id: &str) -> Vec<String> {
    let ctr = |args: &[&str]| bed.ctr_output(NS, args).unwrap();
    let log_path = state.join("logs").join(format!("{id}.log"));
    let mut left = Vec::new();
    let containers = ctr(&["containers", "list", "-q"]);
    if containers.lines().any(|l| l.trim() == id) {
        left.push(format!("container {id}"));
    }
    let tasks = ctr(&["tasks", "list", "-q"]);
    if tasks.lines().any(|l| l.trim() == id) {
        left.push(format!("task {id}"));
    }
    let snaps = ctr(&["snapshots", "--snapshotter", "overlayfs", "list"]);
    if snaps
        .lines()
        .any(|l| l.split_whitespace().next() == Some(id))
    {
        left.push(format!("snapshot {id}"));
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for l in mounts.lines().filter(|l| l.contains(id)) {
        left.push(format!("mount: {l}"));
    }
    if log_path.exists() {
        left.push(format!("log file {}", log_path.display()));
    }
    for ctl in ["memory", "pids", "cpu", "freezer"] {
        let p = Path::new("/sys/fs/cgroup")
            .join(ctl)
            .join("sandbolt")
            .join(id);
        if p.exists() {
            left.push(format!("cgroup {}", p.display()));
        }
    }
    let bundle = bed
        .root()
        .join("containerd/state/io.containerd.runtime.v2.task")
        .join(NS)
        .join(id);
    if bundle.exists() {
        left.push(format!("bundle {}", bundle.display()));
    }
    left
}
