use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use sandbolt_lifecycle::gateway_scope::SECURE_ACCESS_KEYS_ENV;
use sandbolt_lifecycle::{
    BackendConfig, ControllerConfig, DockerConfig, GatewayConfig, KeyRing, Lifecycle,
    LifecycleConfig, LifecycleMetrics,
};
use sandbolt_telemetry::prometheus_client::registry::Registry;

#[derive(Debug, clap::Args)]
pub(crate) struct LifecycleArgs {
    /// Address of the OpenSandbox Lifecycle REST API.
    #[arg(
        long,
        env = "SANDBOLT_LIFECYCLE_LISTEN",
        default_value = "127.0.0.1:8080"
    )]
    listen: SocketAddr,
    #[command(flatten)]
    access: ApiAccess,
    /// The controller's gRPC address (its FastPath port, which also serves
    /// the native control API the lifecycle uses), e.g.
    /// http://127.0.0.1:9090. Without it, sandboxes run on Docker
    /// (--docker-socket).
    #[arg(long, env = "SANDBOLT_CONTROLLER")]
    controller: Option<String>,
    /// Namespace the lifecycle creates and lists sandboxes in.
    #[arg(long, env = "SANDBOLT_CONTROLLER_NAMESPACE", default_value = "default")]
    controller_namespace: String,
    /// CA certificate (PEM) of a controller serving TLS (`sandbolt
    /// controller --tls-cert`); --controller is then https://...
    #[arg(long, env = "SANDBOLT_CONTROLLER_CA", requires = "controller")]
    controller_ca: Option<PathBuf>,
    /// Bearer token of the controller's port (`sandbolt controller
    /// --fastpath-token`). `--fastpath-token` is the older name; the env
    /// variable keeps it for deployments that set it.
    #[arg(
        long,
        alias = "fastpath-token",
        env = "SANDBOLT_FASTPATH_TOKEN",
        hide_env_values = true,
        requires = "controller"
    )]
    controller_token: Option<String>,
    #[arg(
        long,
        env = "SANDBOLT_DOCKER_SOCKET",
        default_value = "/var/run/docker.sock"
    )]
    docker_socket: PathBuf,
    /// The static execd copied into Docker sandboxes (default: `execd` next
    /// to this binary).
    #[arg(long, env = "SANDBOLT_EXECD_BIN")]
    execd_bin: Option<PathBuf>,
    #[arg(
        long,
        env = "SANDBOLT_DATA_DIR",
        default_value = "/var/lib/sandbolt/lifecycle"
    )]
    data_dir: PathBuf,
    /// Host directory that host volumes may lie under (repeatable).
    #[arg(
        long = "allow-host-path",
        env = "SANDBOLT_ALLOW_HOST_PATH",
        value_delimiter = ','
    )]
    allow_host_path: Vec<PathBuf>,
    /// Docker backend: host address sandbox ports are published on (e.g. the
    /// Docker bridge's gateway when sandbolt itself runs in a container).
    #[arg(long, env = "SANDBOLT_PUBLISH_HOST_IP", default_value = "127.0.0.1")]
    publish_host_ip: String,
    /// Docker backend: host written into endpoints, what clients dial
    /// (default: --publish-host-ip).
    #[arg(long, env = "SANDBOLT_ENDPOINT_HOST")]
    endpoint_host: Option<String>,
    #[command(flatten)]
    docker_network: DockerNetworkArgs,
    #[command(flatten)]
    gateway: GatewayArgs,
    #[command(flatten)]
    metrics: crate::agent_cmd::MetricsListenArgs,
    #[command(flatten)]
    listener: sandbolt_telemetry::listener::ListenerArgs,
}

/// The fsb gateway: where the OpenSandbox server's endpoints for its
/// fast-sandbox (`fsb-…`) sandboxes point (its `[ingress] mode = "gateway"`,
/// `[ingress.gateway] address`).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct GatewayArgs {
    /// Serve the fsb gateway on this address (controller backend only). It
    /// accepts the OpenSandbox server's signed route scopes (header
    /// OpenSandbox-Ingress-To, or the scope as the first path segment) and
    /// forwards HTTP, SSE and WebSocket to the sandbox port a scope names.
    /// It has no API key: the scope, signed with the server's key ring, is
    /// the credential. The key ring comes from OPENSANDBOX_SECURE_ACCESS_KEYS
    /// (the server's variable and format, `kid=base64[,kid=base64]`) or
    /// --gateway-keys-file.
    #[arg(long, env = "SANDBOLT_GATEWAY_LISTEN", requires = "controller")]
    gateway_listen: Option<SocketAddr>,
    /// File holding the gateway's key ring in the OPENSANDBOX_SECURE_ACCESS_KEYS
    /// format (e.g. a mounted Secret); used instead of that variable.
    #[arg(long, env = "SANDBOLT_GATEWAY_KEYS_FILE", requires = "gateway_listen")]
    gateway_keys_file: Option<PathBuf>,
}

impl GatewayArgs {
    /// The gateway's configuration, reading the key ring from the file or,
    /// without one, from OPENSANDBOX_SECURE_ACCESS_KEYS.
    fn config(&self) -> anyhow::Result<Option<GatewayConfig>> {
        let Some(listen) = self.gateway_listen else {
            return Ok(None);
        };
        let (ring, source) = match &self.gateway_keys_file {
            Some(path) => (
                std::fs::read_to_string(path)
                    .with_context(|| format!("reading --gateway-keys-file {}", path.display()))?,
                path.display().to_string(),
            ),
            None => (
                std::env::var(SECURE_ACCESS_KEYS_ENV).with_context(|| {
                    format!("--gateway-listen needs a key ring: set {SECURE_ACCESS_KEYS_ENV} or pass --gateway-keys-file")
                })?,
                SECURE_ACCESS_KEYS_ENV.to_string(),
            ),
        };
        let keys = KeyRing::parse(&ring).with_context(|| format!("gateway key ring ({source})"))?;
        Ok(Some(GatewayConfig { listen, keys }))
    }
}

/// On or off (a flag that reads as a setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Switch {
    On,
    Off,
}

/// Sandbox networking of the Docker backend: the same flags on `up` and
/// `lifecycle`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DockerNetworkArgs {
    /// Docker backend: isolate sandboxes from each other, this host and
    /// private/link-local ranges (a sandbolt bridge network plus nftables
    /// rules; needs root and `nft` in the engine's network namespace).
    /// `off` runs sandboxes on Docker's networking without isolation.
    #[arg(
        long,
        env = "SANDBOLT_DOCKER_ISOLATION",
        value_enum,
        default_value = "on"
    )]
    docker_isolation: Switch,
    /// Docker backend: IPv4 subnet (CIDR) of the sandbox network when it is
    /// created (default: Docker picks one).
    #[arg(long, env = "SANDBOLT_DOCKER_NETWORK_SUBNET")]
    docker_network_subnet: Option<String>,
    /// Docker backend: resolver (ip:port) the egress DNS proxy forwards
    /// allowed names to; repeatable (default: the host's /etc/resolv.conf).
    #[arg(long, env = "SANDBOLT_DOCKER_DNS_UPSTREAM", value_delimiter = ',')]
    docker_dns_upstream: Vec<SocketAddr>,
}

impl DockerNetworkArgs {
    /// Writes the networking settings into a Docker backend config.
    pub(crate) fn apply(&self, config: &mut DockerConfig) {
        config.isolation = self.docker_isolation == Switch::On;
        config.network_subnet = self.docker_network_subnet.clone();
        config.dns_upstreams = self.docker_dns_upstream.clone();
    }
}

/// How clients authenticate to the lifecycle API: the same flags on `up` and
/// `lifecycle`.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct ApiAccess {
    /// Key clients send in the OPEN-SANDBOX-API-KEY header.
    #[arg(long, env = "SANDBOLT_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Serve the lifecycle API without a key (only on a trusted address).
    #[arg(long, env = "SANDBOLT_INSECURE")]
    insecure: bool,
}

impl ApiAccess {
    /// The key, if one was given (blank counts as none).
    fn key(&self) -> Option<String> {
        self.api_key.clone().filter(|k| !k.trim().is_empty())
    }

    /// Refuses to run the lifecycle API open unless asked to.
    pub(crate) fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.key().is_some() || self.insecure,
            "refusing to serve the lifecycle API without a key: pass --api-key (or SANDBOLT_API_KEY), or --insecure to run it open"
        );
        Ok(())
    }
}

pub(crate) fn config(
    listen: SocketAddr,
    access: &ApiAccess,
    backend: BackendConfig,
    data_dir: PathBuf,
    allow_host_path: Vec<PathBuf>,
) -> LifecycleConfig {
    let mut config = LifecycleConfig::new(listen, backend, data_dir);
    config.api_key = access.key();
    config.insecure_no_auth = access.insecure;
    config.allow_host_paths = allow_host_path;
    config
}

pub(crate) async fn run(args: LifecycleArgs) -> anyhow::Result<()> {
    args.access.check()?;
    let gateway = args.gateway.config()?;
    let backend = match args.controller {
        Some(c) => {
            let mut f = ControllerConfig::new(c);
            f.token = args.controller_token;
            f.namespace = args.controller_namespace;
            f.ca = args.controller_ca;
            BackendConfig::Controller(f)
        }
        None => {
            let mut d = DockerConfig::new(
                args.docker_socket,
                crate::agent_cmd::resolve_execd(args.execd_bin)?,
            );
            d.endpoint_host = args
                .endpoint_host
                .unwrap_or_else(|| args.publish_host_ip.clone());
            d.publish_host_ip = args.publish_host_ip;
            args.docker_network.apply(&mut d);
            BackendConfig::Docker(d)
        }
    };
    let mut config = config(
        args.listen,
        &args.access,
        backend,
        args.data_dir,
        args.allow_host_path,
    );
    config.gateway = gateway;
    config.listener = args.listener.limits()?;
    let mut registry = Registry::default();
    config.metrics = Some(LifecycleMetrics::register(&mut registry));
    let handle = Lifecycle::start(config)
        .await
        .context("starting the lifecycle API")?;
    let ops = match args.metrics.serve(registry, handle.readiness()).await {
        Ok(ops) => ops,
        Err(e) => {
            let _ = handle.shutdown().await;
            return Err(e);
        }
    };
    tracing::info!(addr = %handle.addr(), gateway = ?handle.gateway_addr(), "lifecycle API serving");
    crate::shutdown_signal().await;
    drop(ops);
    handle.shutdown().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(argv: &[&str]) -> Result<LifecycleArgs, clap::Error> {
        crate::try_parse_flags(&[&["lifecycle"], argv].concat())
    }

    #[test]
    fn controller_token_under_both_names() {
        // Env would override what is tested here; the tests never set it.
        for flag in ["--controller-token", "--fastpath-token"] {
            let a = parse(&["--controller", "http://c:9090", flag, "t0k"]).expect("parses");
            assert_eq!(a.controller_token.as_deref(), Some("t0k"), "{flag}");
            assert_eq!(a.controller_namespace, "default");
        }
        // A token without a controller would be silently unused.
        assert!(parse(&["--controller-token", "t0k"]).is_err());
    }

    #[test]
    fn metrics_listen_is_off_unless_asked_for() {
        assert_eq!(parse(&[]).expect("parses").metrics.metrics_listen, None);
        let a = parse(&["--metrics-listen", "127.0.0.1:9464"]).expect("parses");
        assert_eq!(
            a.metrics.metrics_listen,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        assert!(parse(&["--metrics-listen", "nowhere"]).is_err());
    }

    #[test]
    fn gateway_needs_the_controller_and_a_key_ring() {
        // No gateway on the Docker backend, no keys file without a gateway.
        assert!(parse(&["--gateway-listen", "127.0.0.1:0"]).is_err());
        assert!(parse(&["--controller", "http://c:9090", "--gateway-keys-file", "/k"]).is_err());
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("keys");
        std::fs::write(&file, "a=c2VjcmV0LWE=,b=c2VjcmV0LWI=\n").unwrap();
        let a = parse(&[
            "--controller",
            "http://c:9090",
            "--gateway-listen",
            "127.0.0.1:0",
            "--gateway-keys-file",
            file.to_str().unwrap(),
        ])
        .expect("parses");
        let config = a.gateway.config().unwrap().expect("a gateway");
        assert_eq!(config.keys.key_ids().collect::<String>(), "ab");
        std::fs::write(&file, "a=c2VjcmV0LWE=,A=c2VjcmV0LWI=").unwrap();
        let err = a.gateway.config().unwrap_err();
        assert!(format!("{err:#}").contains("\"A\""), "{err:#}");
    }
}
