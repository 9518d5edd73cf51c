use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use sandbolt_agent::{Agent, AgentConfig};

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
    #[arg(
        long,
        env = "SANDBOLT_CONTAINERD_SOCKET",
        default_value = "/run/containerd/containerd.sock"
    )]
    containerd_socket: PathBuf,
    #[arg(long, env = "SANDBOLT_CONTAINERD_NAMESPACE", default_value = "k8s.io")]
    containerd_namespace: String,
    /// The static execd injected into every sandbox (default: `execd` next
    /// to this binary).
    #[arg(long, env = "SANDBOLT_EXECD_BIN")]
    execd_bin: Option<PathBuf>,
    /// Per-sandbox logs and agent state.
    #[arg(
        long,
        env = "SANDBOLT_STATE_DIR",
        default_value = "/var/lib/sandbolt/agent"
    )]
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
    /// Token the controller presents to this agent, and this agent to the controller.
    #[arg(long, env = "SANDBOLT_AGENT_TOKEN", hide_env_values = true)]
    token: String,
    /// Controller RegistryService endpoint for heartbeats, e.g. http://10.0.0.1:9090.
    #[arg(long, env = "SANDBOLT_CONTROLLER")]
    controller: Option<String>,
    #[arg(long, env = "SANDBOLT_MAX_SANDBOXES", default_value_t = 256)]
    max_sandboxes: u32,
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
}

/// `--execd-bin`, else `execd` beside the running binary.
pub(crate) fn resolve_execd(explicit: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let candidate = match explicit {
        Some(p) => p,
        None => std::env::current_exe()
            .context("locating the sandbolt binary")?
            .with_file_name("execd"),
    };
    anyhow::ensure!(
        candidate.is_file(),
        "execd binary not found at {}: build it with scripts/build-execd.sh and pass --execd-bin",
        candidate.display()
    );
    Ok(candidate)
}

pub(crate) async fn run(args: AgentArgs) -> anyhow::Result<()> {
    let host = crate::secrets::hostname();
    let execd = resolve_execd(args.execd_bin)?;
    let mut config = AgentConfig::new(
        args.agent_id.unwrap_or_else(|| host.clone()),
        args.containerd_socket,
        execd,
        args.state_dir,
        args.token.clone(),
    );
    config.node_name = args.node_name.unwrap_or(host);
    config.pod_uid = args.pod_uid.filter(|u| !u.is_empty());
    config.pod_name = args.pod_name.filter(|u| !u.is_empty());
    config.pod_namespace = args.pod_namespace.filter(|u| !u.is_empty());
    config.pool = args.pool;
    config.containerd_namespace = args.containerd_namespace;
    config.grpc_listen = args.listen;
    config.proxy_listen = args.proxy_listen;
    config.advertise_host = args.advertise_host;
    config.controller_endpoint = args.controller;
    config.controller_token = Some(args.token);
    config.max_sandboxes = args.max_sandboxes;
    config.default_runtime = args.runtime;
    config.allowed_host_paths = args.allow_host_path;
    let handle = Agent::start(config).await.context("starting the agent")?;
    tracing::info!(grpc = %handle.grpc_addr(), proxy = %handle.proxy_addr(), "agent serving");
    crate::shutdown_signal().await;
    handle.shutdown().await;
    Ok(())
}
