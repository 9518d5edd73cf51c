use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use sandbolt_controller::{Consistency, Controller, ControllerConfig};

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub(crate) enum ConsistencyArg {
    /// Container first, record after (lowest latency).
    Fast,
    /// Record first, container after.
    Strong,
}

impl From<ConsistencyArg> for Consistency {
    fn from(c: ConsistencyArg) -> Self {
        match c {
            ConsistencyArg::Fast => Consistency::Fast,
            ConsistencyArg::Strong => Consistency::Strong,
        }
    }
}

#[derive(Debug, clap::Args)]
pub(crate) struct ControllerArgs {
    /// gRPC address for FastPath v1 + v2 and the agents' RegistryService.
    #[arg(
        long,
        env = "SANDBOLT_FASTPATH_LISTEN",
        default_value = "127.0.0.1:9090"
    )]
    listen: SocketAddr,
    /// Directory of the embedded record store (controller.redb).
    #[arg(
        long,
        env = "SANDBOLT_DATA_DIR",
        default_value = "/var/lib/sandbolt/controller"
    )]
    data_dir: PathBuf,
    /// Token agents and janitors present (and the controller presents to agents).
    #[arg(long, env = "SANDBOLT_AGENT_TOKEN", hide_env_values = true)]
    agent_token: String,
    /// Require `authorization: Bearer <token>` on FastPath calls. Without it
    /// the FastPath port is open: bind it to a private address.
    #[arg(long, env = "SANDBOLT_FASTPATH_TOKEN", hide_env_values = true)]
    fastpath_token: Option<String>,
    /// Consistency of creates that do not ask for one.
    #[arg(
        long,
        env = "SANDBOLT_CONSISTENCY",
        value_enum,
        default_value = "strong"
    )]
    consistency: ConsistencyArg,
}

pub(crate) async fn run(args: ControllerArgs) -> anyhow::Result<()> {
    let mut config = ControllerConfig::new(args.listen, &args.data_dir, args.agent_token);
    config.fastpath_token = args.fastpath_token;
    config.default_consistency = args.consistency.into();
    let handle = Controller::start(config)
        .await
        .with_context(|| format!("starting the controller on {}", args.listen))?;
    tracing::info!(fastpath = %handle.local_addr(), data_dir = %args.data_dir.display(), "controller serving FastPath v1 + v2 and RegistryService");
    crate::shutdown_signal().await;
    handle.shutdown().await;
    Ok(())
}
