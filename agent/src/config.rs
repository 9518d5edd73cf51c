//! Agent configuration: everything `sandbolt agent` (and `sandbolt up`) passes in.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub use crate::network::subnet::{Ipv4Net, SubnetChoice};

/// Configuration of one agent process.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Stable identity of this agent (survives restarts); stored as a label on
    /// every container so a restarted agent finds its own sandboxes.
    pub agent_id: String,
    pub node_name: String,
    /// UID of the agent's Kubernetes pod (downward API), `None` outside
    /// Kubernetes. Labels every container ([`crate::labels::AGENT_POD_UID`]);
    /// recovery moves adopted containers to it before serving.
    pub pod_uid: Option<String>,
    /// The agent's pod name and namespace, for logs only.
    pub pod_name: Option<String>,
    pub pod_namespace: Option<String>,
    pub pool: String,
    /// Namespace of the pool (FastPath namespaces, not containerd's): pools
    /// are namespaced, and `sandbolt up`'s pool is `default/default`.
    pub pool_namespace: String,
    /// containerd's gRPC socket.
    pub containerd_socket: PathBuf,
    /// containerd namespace; `k8s.io` shares the kubelet's image cache.
    pub containerd_namespace: String,
    pub snapshotter: String,
    /// OCI runtime used when a request names none: "runc", "crun", "runsc".
    pub default_runtime: String,
    /// Host path of the static execd binary, bind-mounted read-only into every
    /// sandbox at [`crate::spec::EXECD_PATH`].
    pub execd_binary: PathBuf,
    /// Per-sandbox logs live under `<state_dir>/logs/`.
    pub state_dir: PathBuf,
    /// Keep a sandbox's log file after it is deleted.
    pub keep_logs: bool,
    /// A sandbox's log file is rotated (copy-truncate, one `.1` kept) once
    /// over this many bytes; 0: never (see [`crate::log_rotation`]).
    pub log_max_bytes: u64,
    /// How often log sizes (and writable layers with an ephemeral-storage
    /// limit) are checked: the overshoot is what a sandbox writes in one.
    pub log_check_interval: Duration,
    /// Parent of every sandbox's cgroup (`<parent>/<id>`), e.g. a slice
    /// the kubelet accounts (see README "Limits on growth").
    pub cgroup_parent: String,
    /// AgentService listen address (port 0 picks one; see [`crate::AgentHandle`]).
    pub grpc_listen: SocketAddr,
    /// Data-plane proxy listen address.
    pub proxy_listen: SocketAddr,
    /// Connection cap, header-read and idle timeouts of the gRPC and proxy
    /// listeners (see `sandbolt_telemetry::listener`).
    pub listener_limits: sandbolt_telemetry::ListenerLimits,
    /// Host name or address advertised to the controller for both listeners;
    /// defaults to the bound IP (or `127.0.0.1` when bound to a wildcard).
    pub advertise_host: Option<String>,
    /// Bearer token every AgentService call must carry.
    pub api_token: String,
    /// Controller's RegistryService, e.g. `http://127.0.0.1:7400`; no heartbeats when unset.
    pub controller_endpoint: Option<String>,
    pub controller_token: Option<String>,
    /// CA certificate (PEM) the controller's TLS certificate must chain to;
    /// the endpoint is then `https://`. `None`: plaintext.
    pub controller_ca: Option<PathBuf>,
    /// Serve the AgentService over TLS with this agent's self-signed
    /// certificate (made at first start in `<state_dir>/identity/`) and
    /// advertise its SHA-256 in the API endpoint, which the controller pins
    /// (see `sandbolt_proto::tls::SelfSignedIdentity`). False: plaintext.
    pub api_tls: bool,
    pub heartbeat_interval: Duration,
    /// Roots that host-path volume bindings must lie under.
    pub allowed_host_paths: Vec<PathBuf>,
    pub max_sandboxes: u32,
    /// pids.max for sandboxes whose request says 0.
    pub default_pids_limit: i64,
    /// Between SIGTERM and SIGKILL when a delete request says 0.
    pub stop_grace_period: Duration,
    /// Upper bound for pulling a missing image (separate from create deadlines).
    pub pull_timeout: Duration,
    /// Images this agent keeps present on its node (its SandboxPool's
    /// `warmImages`), so the first sandbox of such an image pulls nothing.
    /// Ensured in the background after start (see [`crate::warm`]).
    pub warm_images: Vec<String>,
    /// Registry hosts (`host[:port]`, e.g. `registry.cache.svc:5000`) pulled
    /// from over plain HTTP: private in-cluster registries often have no TLS.
    pub plain_http_registries: Vec<String>,
    /// How often a warm image that is present is looked up again, and pulled
    /// again when something (the kubelet, an operator) removed it.
    pub warm_recheck_interval: Duration,
    /// Warm sandboxes (see [`crate::warm_pool`]): how often the buffer is
    /// checked against its targets without a wake-up.
    pub warm_pool_interval: Duration,
    /// Pause after each warm sandbox started: refills are paced so that
    /// they leave the node's CPU and containerd to creates.
    pub warm_refill_pause: Duration,
    /// Writable snapshots kept prepared per expected image (warm images,
    /// warm pool classes, the latest cold creates' images), so a cold
    /// create of such an image skips `snapshots.Prepare` (see
    /// [`crate::prepared`]); 0 turns them off.
    pub prepared_snapshots: usize,
    /// How long `wait_for_execd` creates wait for execd's `/ping`.
    pub execd_ready_timeout: Duration,
    /// TCP port execd listens on inside the sandbox.
    pub execd_port: u16,
    /// The pool's limits for sandboxes whose request leaves a field unset
    /// (reported to the controller, which applies them at create).
    pub pool_default_limits: PoolLimits,
    /// The most a sandbox of this pool may ask for (the controller refuses
    /// more, naming the field).
    pub pool_max_limits: PoolLimits,
    /// Sandbox networking (egress, isolation, policy); `None`: sandboxes
    /// get a namespace with loopback only, and creates with a policy other
    /// than allow-all are refused.
    pub network: Option<NetworkConfig>,
    /// The node's named volumes (see [`crate::volume_mounts`]); `None`: no
    /// volume root, and every volume call (and a create that mounts a named
    /// volume) answers UNAVAILABLE. Opened at start, before recovery.
    pub volumes: Option<crate::volume_store::VolumeStoreConfig>,
    /// The cluster's JuiceFS filesystem (see [`crate::juicefs_mount`]):
    /// mounted at start, its volumes shared with every agent mounting it;
    /// `None`: volumes with `backend: "juicefs"` are refused.
    pub juicefs: Option<crate::juicefs_mount::JuiceFsConfig>,
    /// Sandboxes' user namespaces (see [`crate::userns`]): `Off`, or `Node`
    /// (container ids 0..65535 mapped to host ids from `userns_base`).
    pub user_namespace: crate::userns::UserNamespaceMode,
    /// First host uid/gid of the node's mapped range (`Node` only).
    pub userns_base: u32,
    /// What the runtime version check does with an unmitigated known
    /// escape (see [`crate::runtime_check`]).
    pub runtime_check: crate::runtime_check::RuntimeCheckMode,
    /// OCI runtime binaries by name (`runc` → path) instead of a PATH lookup.
    pub runtime_binaries: Vec<(String, PathBuf)>,
    /// runsc's flags, written into its wrapper at start (see [`crate::gvisor`]).
    pub runsc: crate::gvisor::RunscConfig,
}

/// How the agent networks its sandboxes (see [`crate::network`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkConfig {
    /// "auto" (a free /24 of 10.203.0.0/16) or an explicit CIDR.
    pub subnet: SubnetChoice,
    /// Where the CNI plugins (`loopback`, `ptp`, `host-local`) live.
    pub cni_bin_dir: PathBuf,
    /// Resolvers the DNS proxy forwards allowed names to.
    pub dns_upstreams: Vec<SocketAddr>,
    /// Namespaces kept prepared ahead of creates.
    pub pool_size: usize,
    /// Ranges of the otherwise blocked private/link-local space that this
    /// pool's sandboxes may reach (e.g. an in-cluster registry).
    pub allow_cidrs: Vec<Ipv4Net>,
}

/// Default `--cgroup-parent`: sandboxes' cgroups are `/sandbolt/<id>`.
pub const DEFAULT_CGROUP_PARENT: &str = "/sandbolt";

/// The cgroup of sandbox `id` under `parent` (runc's cgroupfs form:
/// absolute, relative to each controller's root).
pub fn cgroup_path(parent: &str, id: &str) -> String {
    format!("/{}/{id}", parent.trim_matches('/')).replace("//", "/")
}

/// Refuses a `--cgroup-parent` runc would misread or that could climb out
/// of the hierarchy: absolute, no `..`, no empty or dot segments.
pub fn check_cgroup_parent(parent: &str) -> Result<(), String> {
    let bad = || {
        format!(
            "--cgroup-parent {parent:?} must be an absolute cgroup path such as /sandbolt or /kubepods/burstable (no '..', '.' or empty segments)"
        )
    };
    let Some(rest) = parent.strip_prefix('/') else {
        return Err(bad());
    };
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    if rest.is_empty() {
        return Ok(());
    }
    if rest
        .split('/')
        .any(|seg| seg.is_empty() || seg == "." || seg == "..")
    {
        return Err(bad());
    }
    Ok(())
}

/// Debian's containernetworking-plugins install here.
pub const DEFAULT_CNI_BIN_DIR: &str = "/usr/lib/cni";

impl NetworkConfig {
    /// Auto subnet, Debian's plugins, a pool of 4, no exceptions.
    pub fn new(dns_upstreams: Vec<SocketAddr>) -> Self {
        Self {
            subnet: SubnetChoice::Auto,
            cni_bin_dir: DEFAULT_CNI_BIN_DIR.into(),
            dns_upstreams,
            pool_size: 4,
            allow_cidrs: Vec::new(),
        }
    }
}

/// One set of pool limits; empty/0 = unset. Quantities are checked at agent
/// start ([`PoolLimits::validate`]), so a typo in a chart value stops the
/// agent instead of reaching every create.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolLimits {
    pub cpu: String,
    pub memory: String,
    pub pids: i64,
}

impl PoolLimits {
    pub fn validate(&self, what: &str) -> Result<(), String> {
        use sandbolt_proto::quantity;
        if !self.cpu.is_empty() {
            quantity::millicores(&self.cpu).map_err(|e| format!("{what} cpu: {e}"))?;
        }
        if !self.memory.is_empty() {
            quantity::bytes(&self.memory).map_err(|e| format!("{what} memory: {e}"))?;
        }
        if self.pids < 0 {
            return Err(format!("{what} pids must not be negative"));
        }
        Ok(())
    }

    pub fn to_wire(&self) -> sandbolt_proto::agent::v1::Resources {
        sandbolt_proto::agent::v1::Resources {
            cpu: self.cpu.clone(),
            memory: self.memory.clone(),
            pids_limit: self.pids,
            ..Default::default()
        }
    }
}

impl AgentConfig {
    /// Defaults for everything but identity, paths and the token.
    pub fn new(
        agent_id: impl Into<String>,
        containerd_socket: impl Into<PathBuf>,
        execd_binary: impl Into<PathBuf>,
        state_dir: impl Into<PathBuf>,
        api_token: impl Into<String>,
    ) -> Self {
        let agent_id = agent_id.into();
        Self {
            node_name: agent_id.clone(),
            agent_id,
            pod_uid: None,
            pod_name: None,
            pod_namespace: None,
            pool: "default".into(),
            pool_namespace: "default".into(),
            containerd_socket: containerd_socket.into(),
            containerd_namespace: "k8s.io".into(),
            snapshotter: "overlayfs".into(),
            default_runtime: "runc".into(),
            execd_binary: execd_binary.into(),
            state_dir: state_dir.into(),
            keep_logs: false,
            log_max_bytes: crate::log_rotation::DEFAULT_MAX_BYTES,
            log_check_interval: crate::log_rotation::DEFAULT_CHECK_INTERVAL,
            cgroup_parent: DEFAULT_CGROUP_PARENT.into(),
            grpc_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            proxy_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            listener_limits: sandbolt_telemetry::ListenerLimits::default(),
            advertise_host: None,
            api_token: api_token.into(),
            controller_endpoint: None,
            controller_token: None,
            controller_ca: None,
            api_tls: false,
            heartbeat_interval: Duration::from_secs(5),
            allowed_host_paths: Vec::new(),
            max_sandboxes: 256,
            default_pids_limit: 1024,
            stop_grace_period: Duration::from_secs(10),
            pull_timeout: Duration::from_secs(60),
            warm_images: Vec::new(),
            plain_http_registries: Vec::new(),
            warm_recheck_interval: Duration::from_secs(60),
            warm_pool_interval: Duration::from_secs(2),
            warm_refill_pause: Duration::from_millis(100),
            prepared_snapshots: 2,
            execd_ready_timeout: Duration::from_secs(15),
            execd_port: sandbolt_proto::wire::EXECD_PORT,
            pool_default_limits: PoolLimits::default(),
            pool_max_limits: PoolLimits::default(),
            network: None,
            volumes: None,
            juicefs: None,
            user_namespace: crate::userns::UserNamespaceMode::Off,
            userns_base: crate::userns::DEFAULT_BASE,
            runtime_check: crate::runtime_check::RuntimeCheckMode::Enforce,
            runtime_binaries: Vec::new(),
            runsc: crate::gvisor::RunscConfig::default(),
        }
    }

    /// The pod UID, if one was given and is not empty.
    pub fn pod_uid(&self) -> Option<&str> {
        self.pod_uid.as_deref().filter(|u| !u.is_empty())
    }

    pub fn logs_dir(&self) -> PathBuf {
        self.state_dir.join("logs")
    }

    pub fn log_path(&self, sandbox_id: &str) -> PathBuf {
        self.logs_dir().join(format!("{sandbox_id}.log"))
    }
}
