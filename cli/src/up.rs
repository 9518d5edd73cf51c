//! `sandbolt up`: the whole system on one machine, in one process.
//!
//! The components still talk over their real interfaces (gRPC on loopback),
//! so this is the same code path as a cluster, only co-located.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use sandbolt_agent::{Agent, AgentConfig, AgentHandle};
use sandbolt_controller::{Controller, ControllerConfig, ControllerHandle};
use sandbolt_janitor::JanitorHandle;
use sandbolt_lifecycle::{
    BackendConfig, DockerConfig, Lifecycle, LifecycleHandle, LifecycleMetrics, Readiness,
};
use sandbolt_telemetry::OpsServer;
use sandbolt_telemetry::prometheus_client::registry::Registry;

use crate::containerd::{self, Supervised};
use crate::controller_cmd::ConsistencyArg;
use crate::lifecycle_cmd;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum RuntimeChoice {
    /// containerd if its socket answers (or it can be started), else Docker.
    Auto,
    Containerd,
    Docker,
}

#[derive(Debug, clap::Args)]
pub(crate) struct UpArgs {
    /// Where records, logs, state and the FastPath/native token live
    /// (restricted to its owner: 0700).
    #[arg(long, env = "SANDBOLT_DATA_DIR", default_value = "/var/lib/sandbolt")]
    data_dir: PathBuf,
    /// Engine that runs sandboxes.
    #[arg(long, env = "SANDBOLT_RUNTIME", value_enum, default_value = "auto")]
    runtime: RuntimeChoice,
    /// OCI runtime of sandboxes whose request names none (the pool's
    /// runtime, reported as its `runtime` by GetPool): runc (default), crun,
    /// or runsc (gVisor: a second kernel between the sandbox and this node;
    /// needs --network egress). containerd engine only: the Docker
    /// fallback runs runc and refuses anything else.
    #[arg(long, env = "SANDBOLT_OCI_RUNTIME", default_value = "runc", value_parser = ["runc", "crun", "runsc"])]
    oci_runtime: String,
    /// containerd (when nothing answers on its socket and containerd is
    /// installed, `up` starts and supervises one).
    #[command(flatten)]
    containerd: containerd::ContainerdArgs,
    /// Docker engine socket (the fallback runtime).
    #[arg(
        long,
        env = "SANDBOLT_DOCKER_SOCKET",
        default_value = "/var/run/docker.sock"
    )]
    docker_socket: PathBuf,
    #[command(flatten)]
    docker_network: lifecycle_cmd::DockerNetworkArgs,
    /// FastPath v1 + v2 and native API gRPC address (token required, see
    /// --fastpath-token).
    #[arg(
        long,
        env = "SANDBOLT_FASTPATH_LISTEN",
        default_value = "127.0.0.1:9090"
    )]
    fastpath_listen: SocketAddr,
    /// TLS on the --fastpath-listen port, with a CA and a certificate made
    /// once in <data-dir>/tls/ (clients trust <data-dir>/tls/ca.crt and call
    /// https://): `auto` turns it on when --fastpath-listen is not a loopback
    /// address (on loopback the traffic never leaves this host), `on` always,
    /// `off` never. The agent's API serves TLS with its own certificate,
    /// pinned by the controller, in every case.
    #[arg(long, env = "SANDBOLT_UP_TLS", value_enum, default_value = "auto")]
    tls: UpTls,
    /// OpenSandbox Lifecycle REST API address.
    #[arg(
        long,
        env = "SANDBOLT_LIFECYCLE_LISTEN",
        default_value = "127.0.0.1:8080"
    )]
    lifecycle_listen: SocketAddr,
    #[command(flatten)]
    access: lifecycle_cmd::ApiAccess,
    /// Host directory that host-path volumes may lie under (repeatable).
    #[arg(
        long = "allow-host-path",
        env = "SANDBOLT_ALLOW_HOST_PATH",
        value_delimiter = ','
    )]
    allow_host_path: Vec<PathBuf>,
    /// How often the janitor scans for orphaned containers.
    #[arg(long, env = "SANDBOLT_JANITOR_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    janitor_interval: Duration,
    /// The static execd injected into every sandbox (default: `execd` next
    /// to this binary).
    #[arg(long, env = "SANDBOLT_EXECD_BIN")]
    execd_bin: Option<PathBuf>,
    /// The agent's AgentService address (loopback: only the controller calls it).
    #[arg(long, env = "SANDBOLT_AGENT_LISTEN", default_value = "127.0.0.1:9091")]
    agent_listen: SocketAddr,
    /// The agent's data-plane proxy (the endpoints clients are given).
    #[arg(long, env = "SANDBOLT_PROXY_LISTEN", default_value = "127.0.0.1:9092")]
    proxy_listen: SocketAddr,
    /// Consistency of creates that do not ask for one.
    #[arg(long, env = "SANDBOLT_CONSISTENCY", value_enum, default_value = "fast")]
    consistency: ConsistencyArg,
    /// Token FastPath and native API clients send as `authorization: Bearer
    /// <token>`. Without one (or empty), `up` generates one once; either way
    /// it is kept in `<data-dir>/fastpath-token` (mode 0600) for clients.
    #[arg(long, env = "SANDBOLT_FASTPATH_TOKEN", hide_env_values = true)]
    fastpath_token: Option<String>,
    /// Most sandboxes this machine runs at once.
    #[arg(long, env = "SANDBOLT_MAX_SANDBOXES", default_value_t = 256)]
    max_sandboxes: u32,
    /// Sandbox networking of the containerd backend.
    #[command(flatten)]
    network: crate::agent_cmd::NetworkArgs,
    /// Named volumes of the containerd backend (on by default: a
    /// loop-backed btrfs image in <data-dir>/agent, mounted at
    /// <data-dir>/volumes, unless that is on btrfs already).
    #[command(flatten)]
    volumes: crate::agent_cmd::VolumeArgs,
    /// Sandbox log cap, storage checks and cgroup parent (containerd).
    #[command(flatten)]
    growth: crate::growth_args::GrowthArgs,
    /// User namespaces and the runtime version check (containerd).
    #[command(flatten)]
    security: crate::security_args::SecurityArgs,
    /// One ops endpoint for all four components: their metrics in one
    /// scrape, and /readyz ready when every one is.
    #[command(flatten)]
    metrics: crate::agent_cmd::MetricsListenArgs,
    /// Connection limits of the controller's, agent's and lifecycle's
    /// listeners.
    #[command(flatten)]
    listener: sandbolt_telemetry::listener::ListenerArgs,
}

/// `up --tls`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum UpTls {
    /// On unless --fastpath-listen is a loopback address.
    Auto,
    On,
    Off,
}

/// How `up`'s own parts reach its controller: the URL and the CA to trust
/// (with TLS on).
struct ControllerLink {
    url: String,
    ca: Option<PathBuf>,
}

/// The controller port's certificate when `--tls` says TLS (made or kept in
/// `<data-dir>/tls/`), for the names its clients dial.
fn controller_pki(args: &UpArgs) -> anyhow::Result<Option<sandbolt_proto::tls::LocalPki>> {
    let ip = args.fastpath_listen.ip();
    let on = match args.tls {
        UpTls::On => true,
        UpTls::Off => false,
        UpTls::Auto => !ip.is_loopback(),
    };
    if !on {
        return Ok(None);
    }
    let mut names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    if !ip.is_unspecified() && !ip.is_loopback() {
        names.push(ip.to_string());
    }
    let dir = args.data_dir.join("tls");
    sandbolt_proto::tls::LocalPki::load_or_create(&dir, &names)
        .map(Some)
        .with_context(|| {
            format!(
                "--tls: making the controller's certificate in {}",
                dir.display()
            )
        })
}

fn controller_link(
    fastpath: SocketAddr,
    pki: Option<&sandbolt_proto::tls::LocalPki>,
) -> ControllerLink {
    let Some(pki) = pki else {
        return ControllerLink {
            url: format!("http://{fastpath}"),
            ca: None,
        };
    };
    // A name the certificate carries: localhost for loopback and wildcard
    // binds, else the bound address itself.
    let ip = fastpath.ip();
    let host = if ip.is_unspecified() || ip.is_loopback() {
        "localhost".to_string()
    } else {
        SocketAddr::new(ip, 0)
            .to_string()
            .trim_end_matches(":0")
            .to_string()
    };
    ControllerLink {
        url: format!("https://{host}:{}", fastpath.port()),
        ca: Some(pki.ca.clone()),
    }
}

enum Engine {
    Containerd { supervised: Option<Supervised> },
    Docker,
}

pub(crate) async fn run(args: UpArgs) -> anyhow::Result<()> {
    args.access.check()?;
    // Before anything is written: a wrong execd fails here, with the command
    // that builds the right one, not later as every sandbox dying at start.
    let execd = crate::agent_cmd::resolve_execd(args.execd_bin.clone())?;
    // Records, logs and the token beneath it are root's business only.
    crate::secrets::private_dir(&args.data_dir)?;

    match choose_engine(&args).await? {
        Engine::Containerd { supervised } => {
            // Checked before anything starts: a host without nftables or the
            // CNI plugins fails here, saying what to install.
            let network = match args.network.config() {
                Ok(n) => n,
                Err(e) => {
                    if let Some(s) = supervised {
                        s.shutdown().await;
                    }
                    return Err(e);
                }
            };
            let result = match check_oci_runtime(&args, network.is_some()) {
                Ok(()) => run_on_containerd(&args, execd, network).await,
                Err(e) => Err(e),
            };
            if let Some(s) = supervised {
                s.shutdown().await;
            }
            result
        }
        Engine::Docker => {
            anyhow::ensure!(
                args.oci_runtime == "runc",
                "--oci-runtime {}: the Docker fallback runs the engine's runc only; use --runtime containerd (containerd must be installed or answer on {})",
                args.oci_runtime,
                args.containerd.socket.display()
            );
            run_on_docker(&args, execd).await
        }
    }
}

/// Refuses an OCI runtime this configuration can never run, before
/// anything starts: under gVisor the sandbox's netstack runs on its own
/// veth, so runsc needs sandbox networking.
fn check_oci_runtime(args: &UpArgs, networking: bool) -> anyhow::Result<()> {
    if args.oci_runtime == "runsc" && !networking {
        bail!(
            "--oci-runtime runsc needs --network egress: gVisor runs its own network stack on the sandbox's veth, and the agent reaches execd at the sandbox's address (drop --network none)"
        );
    }
    Ok(())
}

/// Fails `up` when the agent cannot run its default runtime here (not
/// installed, refused by the version check, ...), with the agent's reason:
/// every create without a runtime would fail otherwise.
async fn check_default_runtime(agent: &AgentHandle, runtime: &str) -> anyhow::Result<()> {
    let inventory = agent
        .inventory()
        .await
        .context("reading the agent's runtimes")?;
    match inventory.runtimes.iter().find(|r| r.name == runtime) {
        Some(r) if r.available => {
            tracing::info!(runtime, "default OCI runtime of this node's sandboxes");
            Ok(())
        }
        Some(r) => bail!("--oci-runtime {runtime}: not available here: {}", r.reason),
        None => bail!("--oci-runtime {runtime}: the agent does not know this runtime"),
    }
}

async fn choose_engine(args: &UpArgs) -> anyhow::Result<Engine> {
    let socket = &args.containerd.socket;
    if args.runtime != RuntimeChoice::Docker {
        if containerd::answers(socket).await {
            tracing::info!(socket = %socket.display(), "using the running containerd");
            return Ok(Engine::Containerd { supervised: None });
        }
        if containerd::binary().is_some() {
            let supervised = Supervised::start(socket, &args.data_dir).await?;
            return Ok(Engine::Containerd {
                supervised: Some(supervised),
            });
        }
        if args.runtime == RuntimeChoice::Containerd {
            bail!(
                "--runtime containerd: nothing answers on {} and containerd is not installed (apt-get install -y containerd runc)",
                socket.display()
            );
        }
    }
    if docker_answers(&args.docker_socket).await {
        tracing::info!(socket = %args.docker_socket.display(), "no containerd: using the Docker engine");
        return Ok(Engine::Docker);
    }
    bail!(
        "no container runtime: containerd does not answer on {} (and is not installed), and Docker does not answer on {}",
        socket.display(),
        args.docker_socket.display()
    )
}

async fn docker_answers(socket: &Path) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probe = async {
        let mut s = tokio::net::UnixStream::connect(socket).await.ok()?;
        s.write_all(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            .await
            .ok()?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await.ok()?;
        String::from_utf8_lossy(&buf)
            .starts_with("HTTP/1.0 200")
            .then_some(())
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(3), probe).await,
        Ok(Some(()))
    )
}

/// What `up` has started on containerd so far; [`Started::stop`] stops it
/// in reverse order, after a failed start as after a signal.
#[derive(Default)]
struct Started {
    controller: Option<ControllerHandle>,
    agent: Option<AgentHandle>,
    lifecycle: Option<LifecycleHandle>,
    janitor: Option<JanitorHandle>,
    ops: Option<OpsServer>,
    fastpath_token: Option<crate::secrets::FastPathToken>,
    /// The CA FastPath clients trust, with `--tls` on.
    controller_ca: Option<PathBuf>,
}

impl Started {
    async fn stop(self) {
        drop(self.ops);
        if let Some(janitor) = self.janitor {
            janitor.shutdown().await;
        }
        if let Some(lifecycle) = self.lifecycle
            && let Err(e) = lifecycle.shutdown().await
        {
            tracing::warn!(error = %e, "lifecycle API shutdown");
        }
        if let Some(agent) = self.agent {
            agent.shutdown().await;
        }
        if let Some(controller) = self.controller {
            controller.shutdown().await;
        }
    }
}

async fn run_on_containerd(
    args: &UpArgs,
    execd: PathBuf,
    network: Option<sandbolt_agent::config::NetworkConfig>,
) -> anyhow::Result<()> {
    let mut started = Started::default();
    let result = start_on_containerd(args, execd, network, &mut started).await;
    if result.is_ok() {
        announce_containerd(&started);
        crate::shutdown_signal().await;
    }
    started.stop().await;
    result
}

/// Starts controller, agent, lifecycle, janitor and the ops endpoint into
/// `started`, every one counting into one registry.
async fn start_on_containerd(
    args: &UpArgs,
    execd: PathBuf,
    network: Option<sandbolt_agent::config::NetworkConfig>,
    started: &mut Started,
) -> anyhow::Result<()> {
    // Components in one process still authenticate to each other.
    let agent_token = crate::secrets::random_token()?;
    // FastPath and the native API are never open, even on loopback: any
    // local user could otherwise list every sandbox and resolve its endpoint.
    let fastpath_token =
        crate::secrets::fastpath_token(&args.data_dir, args.fastpath_token.as_deref())?;
    let mut registry = Registry::default();

    let mut controller_config = ControllerConfig::new(
        args.fastpath_listen,
        args.data_dir.join("controller"),
        agent_token.clone(),
    );
    controller_config.fastpath_token = Some(fastpath_token.value.clone());
    controller_config.default_consistency = args.consistency.into();
    controller_config.listener_limits = args.listener.limits()?;
    let pki = controller_pki(args)?;
    controller_config.tls = pki
        .as_ref()
        .map(|p| sandbolt_controller::config::ServerTlsFiles {
            cert: p.cert.clone(),
            key: p.key.clone(),
            client_ca: None,
        });
    let controller_metrics = sandbolt_controller::register_metrics(&mut registry);
    let controller_ready = controller_metrics.readiness();
    // One set of gRPC families for the whole process: the agent counts into
    // the controller's under its own component label.
    let agent_grpc = controller_metrics.grpc().for_component("agent");
    controller_config.metrics = Some(controller_metrics);
    let controller = Controller::start(controller_config)
        .await
        .with_context(|| format!("starting the controller on {}", args.fastpath_listen))?;
    let fastpath = controller.local_addr();
    started.controller = Some(controller);
    let link = controller_link(fastpath, pki.as_ref());
    started.controller_ca = link.ca.clone();

    let agent_config = agent_config(args, execd, network, &agent_token, &link);
    let context = crate::agent_cmd::agent_start_context(agent_config.volumes.as_ref());
    let agent = Agent::start_with_grpc_metrics(agent_config, &mut registry, agent_grpc)
        .await
        .context(context)?;
    let agent_ready = agent.readiness();
    started.agent = Some(agent);
    if let Some(agent) = &started.agent {
        check_default_runtime(agent, &args.oci_runtime).await?;
    }

    // The lifecycle speaks the controller's native API, behind the same token.
    let mut backend = sandbolt_lifecycle::ControllerConfig::new(link.url.clone());
    backend.token = Some(fastpath_token.value.clone());
    backend.ca = link.ca.clone();
    let mut lifecycle_config = lifecycle_cmd::config(
        args.lifecycle_listen,
        &args.access,
        BackendConfig::Controller(backend),
        args.data_dir.join("lifecycle"),
        args.allow_host_path.clone(),
    );
    lifecycle_config.metrics = Some(LifecycleMetrics::register(&mut registry));
    lifecycle_config.listener = args.listener.limits()?;
    let lifecycle = Lifecycle::start(lifecycle_config)
        .await
        .context("starting the lifecycle API")?;
    let lifecycle_ready = lifecycle.readiness();
    started.lifecycle = Some(lifecycle);
    started.fastpath_token = Some(fastpath_token);

    let janitor = sandbolt_janitor::Janitor::start(janitor_config(args, &link, agent_token))
        .await
        .context("starting the janitor")?;
    janitor.metrics().register(&mut registry);
    let janitor_ready = janitor.readiness();
    started.janitor = Some(janitor);

    let ready = all_ready(vec![
        ("controller", controller_ready),
        ("agent", agent_ready),
        ("lifecycle", lifecycle_ready),
        ("janitor", janitor_ready),
    ]);
    started.ops = args.metrics.serve(registry, ready).await?;
    Ok(())
}

/// The janitor of `up`: it talks to the controller over gRPC like a node's
/// janitor does, with the agent token.
fn janitor_config(
    args: &UpArgs,
    link: &ControllerLink,
    agent_token: String,
) -> sandbolt_janitor::JanitorConfig {
    let mut janitor_config = sandbolt_janitor::JanitorConfig::new(
        crate::secrets::hostname(),
        &args.containerd.socket,
        link.url.clone(),
        agent_token,
        args.data_dir.join("janitor"),
    );
    janitor_config.controller_ca = link.ca.clone();
    janitor_config.containerd_namespace = args.containerd.namespace.clone();
    janitor_config.interval = args.janitor_interval;
    janitor_config.agent_state_dir = Some(args.data_dir.join("agent"));
    janitor_config
}

/// Ready when every part is, else the first part's reason, named.
fn all_ready(parts: Vec<(&'static str, Readiness)>) -> Readiness {
    let parts = std::sync::Arc::new(parts);
    Readiness::from_fn(move || {
        let parts = parts.clone();
        async move {
            for (name, ready) in parts.iter() {
                ready
                    .check()
                    .await
                    .map_err(|reason| format!("{name}: {reason}"))?;
            }
            Ok(())
        }
    })
}

/// Says where everything of a started `up` on containerd serves.
fn announce_containerd(started: &Started) {
    let (Some(lifecycle), Some(agent), Some(controller), Some(token)) = (
        &started.lifecycle,
        &started.agent,
        &started.controller,
        &started.fastpath_token,
    ) else {
        return;
    };
    // The path, never the token: logs travel further than the data dir.
    tracing::info!(
        file = %token.file.display(),
        token = token.origin.as_str(),
        "FastPath and the native API require `authorization: Bearer <token>`; clients on this machine read the token from this file (root only)"
    );
    tracing::info!(
        lifecycle = %format!("http://{}", lifecycle.addr()),
        fastpath = %controller.local_addr(),
        agent = %agent.grpc_addr(),
        proxy = %agent.proxy_addr(),
        metrics = ?started.ops.as_ref().map(OpsServer::local_addr),
        fastpath_tls_ca = ?started.controller_ca,
        runtime = "containerd",
        fastpath_token_file = %token.file.display(),
        "sandbolt is up"
    );
}

/// The agent of `up`: this host, the controller beside it, named volumes
/// under the data dir unless told otherwise.
fn agent_config(
    args: &UpArgs,
    execd: PathBuf,
    network: Option<sandbolt_agent::config::NetworkConfig>,
    agent_token: &str,
    link: &ControllerLink,
) -> AgentConfig {
    let host = crate::secrets::hostname();
    let mut agent_config = AgentConfig::new(
        host.clone(),
        &args.containerd.socket,
        execd,
        args.data_dir.join("agent"),
        agent_token,
    );
    agent_config.node_name = host;
    agent_config.containerd_namespace = args.containerd.namespace.clone();
    agent_config.grpc_listen = args.agent_listen;
    agent_config.proxy_listen = args.proxy_listen;
    // Checked before the controller started (it refuses the same values).
    agent_config.listener_limits = args.listener.limits().unwrap_or_default();
    agent_config.controller_endpoint = Some(link.url.clone());
    agent_config.controller_ca = link.ca.clone();
    // Only the controller calls the agent: TLS with the agent's own
    // certificate, which the controller pins, costs no client anything.
    agent_config.api_tls = true;
    agent_config.controller_token = Some(agent_token.to_string());
    agent_config.max_sandboxes = args.max_sandboxes;
    agent_config.allowed_host_paths = args.allow_host_path.clone();
    args.growth.apply(&mut agent_config);
    args.security.apply(&mut agent_config);
    agent_config.default_runtime = args.oci_runtime.clone();
    agent_config.network = network;
    agent_config.volumes = args
        .volumes
        .config(&args.data_dir.join("volumes"), &args.data_dir.join("agent"));
    agent_config
}

async fn run_on_docker(args: &UpArgs, execd: PathBuf) -> anyhow::Result<()> {
    let mut docker = DockerConfig::new(&args.docker_socket, execd);
    args.docker_network.apply(&mut docker);
    let mut config = lifecycle_cmd::config(
        args.lifecycle_listen,
        &args.access,
        BackendConfig::Docker(docker),
        args.data_dir.join("lifecycle"),
        args.allow_host_path.clone(),
    );
    let mut registry = Registry::default();
    config.metrics = Some(LifecycleMetrics::register(&mut registry));
    config.listener = args.listener.limits()?;
    let lifecycle = Lifecycle::start(config)
        .await
        .context("starting the lifecycle API on Docker")?;
    let ready = lifecycle.readiness();
    let ops = match args.metrics.serve(registry, ready).await {
        Ok(ops) => ops,
        Err(e) => {
            let _ = lifecycle.shutdown().await;
            return Err(e);
        }
    };
    tracing::info!(
        lifecycle = %format!("http://{}", lifecycle.addr()),
        metrics = ?ops.as_ref().map(OpsServer::local_addr),
        runtime = "docker",
        "sandbolt is up (Docker fallback: no controller or agent)"
    );
    crate::shutdown_signal().await;
    drop(ops);
    lifecycle.shutdown().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        up: UpArgs,
    }

    fn parse(args: &[&str]) -> Result<UpArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("up").chain(args.iter().copied())).map(|c| c.up)
    }

    #[test]
    fn oci_runtime_defaults_to_runc_and_reaches_the_agent() {
        let args = parse(&[]).unwrap();
        assert_eq!(args.oci_runtime, "runc");
        let args = parse(&["--oci-runtime", "runsc"]).unwrap();
        let link = ControllerLink {
            url: "http://127.0.0.1:1".into(),
            ca: None,
        };
        let cfg = agent_config(&args, "/x/execd".into(), None, "t", &link);
        assert_eq!(cfg.default_runtime, "runsc");
        assert!(parse(&["--oci-runtime", "kata"]).is_err());
    }

    #[test]
    fn runsc_without_sandbox_networking_is_refused_naming_both_flags() {
        let args = parse(&["--oci-runtime", "runsc", "--network", "none"]).unwrap();
        let err = check_oci_runtime(&args, false).unwrap_err().to_string();
        assert!(
            err.contains("--oci-runtime runsc") && err.contains("--network egress"),
            "{err}"
        );
        assert!(check_oci_runtime(&args, true).is_ok());
        let runc = parse(&["--network", "none"]).unwrap();
        assert!(check_oci_runtime(&runc, false).is_ok());
    }
}
