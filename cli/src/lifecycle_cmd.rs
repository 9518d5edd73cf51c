use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use sandbolt_lifecycle::{BackendConfig, DockerConfig, FastPathConfig, Lifecycle, LifecycleConfig};

#[derive(Debug, clap::Args)]
pub(crate) struct LifecycleArgs {
    /// Address of the OpenSandbox Lifecycle REST API.
    #[arg(
        long,
        env = "SANDBOLT_LIFECYCLE_LISTEN",
        default_value = "127.0.0.1:8080"
    )]
    listen: SocketAddr,
    /// Key clients send in the OPEN-SANDBOX-API-KEY header.
    #[arg(long, env = "SANDBOLT_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Serve the API without a key (only on a trusted address).
    #[arg(long, env = "SANDBOLT_INSECURE")]
    insecure: bool,
    /// Controller FastPath endpoint, e.g. http://127.0.0.1:9090. Without it,
    /// sandboxes run on Docker (--docker-socket).
    #[arg(long, env = "SANDBOLT_CONTROLLER")]
    controller: Option<String>,
    /// Bearer token for the controller's FastPath API, when it requires one
    /// (`sandbolt controller --fastpath-token`).
    #[arg(
        long,
        env = "SANDBOLT_FASTPATH_TOKEN",
        hide_env_values = true,
        requires = "controller"
    )]
    fastpath_token: Option<String>,
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
}

/// Refuses to run the lifecycle API open unless asked to.
pub(crate) fn check_auth(api_key: &Option<String>, insecure: bool) -> anyhow::Result<()> {
    let has_key = api_key.as_deref().is_some_and(|k| !k.trim().is_empty());
    anyhow::ensure!(
        has_key || insecure,
        "refusing to serve the lifecycle API without a key: pass --api-key (or SANDBOLT_API_KEY), or --insecure to run it open"
    );
    Ok(())
}

pub(crate) fn config(
    listen: SocketAddr,
    api_key: Option<String>,
    insecure: bool,
    backend: BackendConfig,
    data_dir: PathBuf,
    allow_host_path: Vec<PathBuf>,
) -> LifecycleConfig {
    let mut config = LifecycleConfig::new(listen, backend, data_dir);
    config.api_key = api_key.filter(|k| !k.trim().is_empty());
    config.insecure_no_auth = insecure;
    config.allow_host_paths = allow_host_path;
    config
}

pub(crate) async fn run(args: LifecycleArgs) -> anyhow::Result<()> {
    check_auth(&args.api_key, args.insecure)?;
    let backend = match args.controller {
        Some(c) => {
            let mut f = FastPathConfig::new(c);
            f.token = args.fastpath_token;
            BackendConfig::FastPath(f)
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
            BackendConfig::Docker(d)
        }
    };
    let config = config(
        args.listen,
        args.api_key,
        args.insecure,
        backend,
        args.data_dir,
        args.allow_host_path,
    );
    let handle = Lifecycle::start(config)
        .await
        .context("starting the lifecycle API")?;
    tracing::info!(addr = %handle.addr(), "lifecycle API serving");
    crate::shutdown_signal().await;
    handle.shutdown().await?;
    Ok(())
}
