use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use sandbolt_controller::ha::{ElectedExit, run_on_kubernetes};
use sandbolt_controller::leader::LeaseConfig;
use sandbolt_controller::registry::KubeAgentPresence;
use sandbolt_controller::{Consistency, Controller, ControllerConfig};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum StoreArg {
    /// One redb file under --data-dir; one replica only.
    Embedded,
    /// Sandbox custom resources and Leases through the Kubernetes API
    /// (in-cluster service account, or KUBECONFIG); replicas elect a leader
    /// through the Lease --lease-name, and only the leader serves.
    Kubernetes,
}

/// How the controller tells a silent agent from a gone one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum AgentPresenceArg {
    /// `kubernetes` with --store kubernetes or inside a pod
    /// (KUBERNETES_SERVICE_HOST is set), `none` otherwise.
    Auto,
    /// Ask the Kubernetes API whether the agent's pod still exists.
    Kubernetes,
    /// Never: a silent agent's sandboxes wait for it however long it is away.
    None,
}

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
    /// Where the records live.
    #[arg(long, env = "SANDBOLT_STORE", value_enum, default_value = "embedded")]
    store: StoreArg,
    /// Kubernetes store: namespace of the controller's Lease and of the agent
    /// records (the chart passes the pod's namespace).
    #[arg(
        long,
        env = "SANDBOLT_POD_NAMESPACE",
        required_if_eq("store", "kubernetes")
    )]
    namespace: Option<String>,
    /// Kubernetes store: this replica's identity in the Lease; must be unique
    /// per replica (the chart passes the pod name).
    #[arg(long, env = "SANDBOLT_POD_NAME", required_if_eq("store", "kubernetes"))]
    identity: Option<String>,
    /// Kubernetes store: name of the leader-election Lease.
    #[arg(
        long,
        env = "SANDBOLT_LEASE_NAME",
        default_value = "sandbolt-controller"
    )]
    lease_name: String,
    /// Kubernetes store: how long a leader's Lease is valid without renewal;
    /// a standby takes over at most this long after the leader died.
    #[arg(long, env = "SANDBOLT_LEASE_DURATION", default_value = "15s", value_parser = humantime::parse_duration)]
    lease_duration: Duration,
    /// Kubernetes store: a leader that could not renew for this long stops
    /// serving (must be below --lease-duration).
    #[arg(long, env = "SANDBOLT_RENEW_DEADLINE", default_value = "10s", value_parser = humantime::parse_duration)]
    renew_deadline: Duration,
    /// Kubernetes store: time between election rounds.
    #[arg(long, env = "SANDBOLT_LEASE_RETRY", default_value = "2s", value_parser = humantime::parse_duration)]
    lease_retry: Duration,
    /// An agent silent this long is shown as unknown (its sandboxes' state)
    /// and gets no new sandboxes. Nothing is failed or reaped for silence.
    #[arg(long, env = "SANDBOLT_AGENT_LOST_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    agent_lost_timeout: Duration,
    /// A silent agent whose pod is gone (see --agent-presence) is given up
    /// after this much silence: its AUTO_RECREATE sandboxes are recreated
    /// elsewhere, its MANUAL ones marked failed. Leave room for a rollout or
    /// an image pull: a successor pod adopts the sandboxes.
    #[arg(long, env = "SANDBOLT_AGENT_GONE_TIMEOUT", default_value = "5m", value_parser = humantime::parse_duration)]
    agent_gone_timeout: Duration,
    /// How a silent agent is told from a gone one.
    #[arg(
        long,
        env = "SANDBOLT_AGENT_PRESENCE",
        value_enum,
        default_value = "auto"
    )]
    agent_presence: AgentPresenceArg,
}

/// Where the timeouts contradict each other or the heartbeat.
fn check_timeouts(config: &ControllerConfig) -> anyhow::Result<()> {
    anyhow::ensure!(
        config.lost_agent_timeout > config.heartbeat_interval,
        "--agent-lost-timeout ({:?}) must be longer than the heartbeat interval ({:?})",
        config.lost_agent_timeout,
        config.heartbeat_interval
    );
    anyhow::ensure!(
        config.agent_gone_timeout > config.lost_agent_timeout,
        "--agent-gone-timeout ({:?}) must be longer than --agent-lost-timeout ({:?})",
        config.agent_gone_timeout,
        config.lost_agent_timeout
    );
    Ok(())
}

fn wants_kube_presence(args: &ControllerArgs, in_cluster: bool) -> bool {
    match args.agent_presence {
        AgentPresenceArg::Kubernetes => true,
        AgentPresenceArg::None => false,
        AgentPresenceArg::Auto => args.store == StoreArg::Kubernetes || in_cluster,
    }
}

/// Adds the Kubernetes presence source when `--agent-presence` asks for it.
async fn add_presence(config: &mut ControllerConfig, args: &ControllerArgs) -> anyhow::Result<()> {
    let in_cluster = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    if !wants_kube_presence(args, in_cluster) {
        tracing::info!(
            "no agent presence source: a silent agent's sandboxes wait for it, never recreated"
        );
        return Ok(());
    }
    let kube_config = kube::Config::infer()
        .await
        .context("--agent-presence kubernetes needs a Kubernetes API (in-cluster service account or KUBECONFIG)")?;
    let client = kube::Client::try_from(kube_config).context("Kubernetes client")?;
    config.agent_presence = Some(std::sync::Arc::new(KubeAgentPresence::new(client)));
    tracing::info!(gone_after = ?config.agent_gone_timeout, "silent agents are given up only when their pod is gone (Kubernetes API)");
    Ok(())
}

pub(crate) async fn run(args: ControllerArgs) -> anyhow::Result<()> {
    let mut config = ControllerConfig::new(args.listen, &args.data_dir, args.agent_token.clone());
    config.fastpath_token = args.fastpath_token.clone();
    config.default_consistency = args.consistency.into();
    config.lost_agent_timeout = args.agent_lost_timeout;
    config.agent_gone_timeout = args.agent_gone_timeout;
    check_timeouts(&config)?;
    add_presence(&mut config, &args).await?;
    if args.store == StoreArg::Kubernetes {
        return run_kubernetes(config, args).await;
    }
    let handle = Controller::start(config)
        .await
        .with_context(|| format!("starting the controller on {}", args.listen))?;
    tracing::info!(fastpath = %handle.local_addr(), data_dir = %args.data_dir.display(), "controller serving FastPath v1 + v2 and RegistryService");
    crate::shutdown_signal().await;
    handle.shutdown().await;
    Ok(())
}

async fn run_kubernetes(config: ControllerConfig, args: ControllerArgs) -> anyhow::Result<()> {
    // clap enforces both with --store kubernetes.
    let namespace = args.namespace.context("--namespace is required")?;
    let identity = args.identity.context("--identity is required")?;
    let kube_config = kube::Config::infer()
        .await
        .context("no Kubernetes API configuration (in-cluster service account or KUBECONFIG)")?;
    let lease = LeaseConfig::new(namespace, &args.lease_name, identity).with_timings(
        args.lease_duration,
        args.renew_deadline,
        args.lease_retry,
    );
    let listen = args.listen;
    let exit = run_on_kubernetes(
        config,
        kube_config,
        lease,
        |h| tracing::info!(fastpath = %h.local_addr(), "leader: serving FastPath v1 + v2 and RegistryService"),
        crate::shutdown_signal(),
    )
    .await
    .with_context(|| format!("controller on {listen}"))?;
    match exit {
        ElectedExit::Shutdown => Ok(()),
        // Exit non-zero: the pod restarts and comes back as a standby.
        ElectedExit::LostLeadership => {
            anyhow::bail!("lost the controller lease to another replica")
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(clap::Parser)]
    struct Cmd {
        #[command(flatten)]
        args: ControllerArgs,
    }

    fn parse(extra: &[&str]) -> ControllerArgs {
        let mut argv = vec!["controller", "--agent-token", "t"];
        argv.extend_from_slice(extra);
        Cmd::try_parse_from(argv).expect("parses").args
    }

    fn config(args: &ControllerArgs) -> ControllerConfig {
        let mut c = ControllerConfig::new(args.listen, &args.data_dir, "t");
        c.lost_agent_timeout = args.agent_lost_timeout;
        c.agent_gone_timeout = args.agent_gone_timeout;
        c
    }

    #[test]
    fn silence_and_gone_timeouts_have_flags_and_sane_defaults() {
        let d = parse(&[]);
        assert_eq!(d.agent_lost_timeout, Duration::from_secs(10));
        assert_eq!(d.agent_gone_timeout, Duration::from_secs(300));
        assert_eq!(
            d.agent_gone_timeout,
            sandbolt_controller::config::DEFAULT_AGENT_GONE_TIMEOUT
        );
        check_timeouts(&config(&d)).expect("defaults are consistent");
        let set = parse(&["--agent-lost-timeout", "3s", "--agent-gone-timeout", "2m"]);
        assert_eq!(set.agent_lost_timeout, Duration::from_secs(3));
        assert_eq!(set.agent_gone_timeout, Duration::from_secs(120));
        check_timeouts(&config(&set)).unwrap();
        let inverted = parse(&["--agent-lost-timeout", "30s", "--agent-gone-timeout", "20s"]);
        let e = check_timeouts(&config(&inverted)).unwrap_err().to_string();
        assert!(e.contains("--agent-gone-timeout"), "{e}");
        let too_short = parse(&["--agent-lost-timeout", "1s"]);
        assert!(check_timeouts(&config(&too_short)).is_err());
    }

    #[test]
    fn presence_is_kubernetes_where_the_controller_runs_on_kubernetes() {
        let auto = parse(&[]);
        assert!(!wants_kube_presence(&auto, false), "one machine: never");
        assert!(wants_kube_presence(&auto, true), "inside a pod");
        let kube_store = parse(&[
            "--store",
            "kubernetes",
            "--namespace",
            "n",
            "--identity",
            "i",
        ]);
        assert!(wants_kube_presence(&kube_store, false));
        let off = parse(&["--agent-presence", "none"]);
        assert!(!wants_kube_presence(&off, true));
        let on = parse(&["--agent-presence", "kubernetes"]);
        assert!(wants_kube_presence(&on, false));
    }
}
