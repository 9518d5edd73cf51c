//! `sandbolt janitor`: the node janitor (a DaemonSet in a cluster; inside
//! `sandbolt up` on one machine).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use sandbolt_janitor::{Janitor, JanitorConfig, ScanReport};

#[derive(Debug, clap::Args)]
pub(crate) struct JanitorArgs {
    /// This node's name, as its agent reports it (default: host name).
    #[arg(long, env = "SANDBOLT_NODE_NAME")]
    node_name: Option<String>,
    #[arg(
        long,
        env = "SANDBOLT_CONTAINERD_SOCKET",
        default_value = "/run/containerd/containerd.sock"
    )]
    containerd_socket: PathBuf,
    /// The agent's containerd namespace.
    #[arg(long, env = "SANDBOLT_CONTAINERD_NAMESPACE", default_value = "k8s.io")]
    containerd_namespace: String,
    /// The agent's snapshotter.
    #[arg(long, env = "SANDBOLT_SNAPSHOTTER", default_value = "overlayfs")]
    snapshotter: String,
    /// Controller endpoint, e.g. http://10.0.0.1:9090.
    #[arg(long, env = "SANDBOLT_CONTROLLER")]
    controller: String,
    /// The agent token (janitors authenticate to the controller with it).
    #[arg(long, env = "SANDBOLT_AGENT_TOKEN", hide_env_values = true)]
    token: String,
    /// Time between periodic scans.
    #[arg(long, env = "SANDBOLT_JANITOR_INTERVAL", default_value = "30s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Nothing younger than this is touched; keep it above the controller's
    /// fast-mode commit deadline (create deadline + commit retries).
    #[arg(long, env = "SANDBOLT_JANITOR_GRACE", default_value = "90s", value_parser = humantime::parse_duration)]
    grace_period: Duration,
    /// How often to check for lost or restarted agents between scans.
    #[arg(long, env = "SANDBOLT_JANITOR_AGENT_POLL", default_value = "2s", value_parser = humantime::parse_duration)]
    agent_poll_interval: Duration,
    /// The agent's state dir (its per-sandbox logs are in `<dir>/logs`).
    #[arg(
        long,
        env = "SANDBOLT_STATE_DIR",
        default_value = "/var/lib/sandbolt/agent"
    )]
    agent_state_dir: PathBuf,
    /// The agent keeps logs of deleted sandboxes: do not remove log files.
    #[arg(long, env = "SANDBOLT_KEEP_LOGS")]
    keep_logs: bool,
    /// The janitor's own journal of cleanups in progress.
    #[arg(
        long,
        env = "SANDBOLT_JANITOR_STATE_DIR",
        default_value = "/var/lib/sandbolt/janitor"
    )]
    state_dir: PathBuf,
    /// Run one scan, print what it did, and exit.
    #[arg(long)]
    once: bool,
}

pub(crate) fn config(args: &JanitorArgs) -> JanitorConfig {
    let mut cfg = JanitorConfig::new(
        args.node_name
            .clone()
            .unwrap_or_else(crate::secrets::hostname),
        &args.containerd_socket,
        &args.controller,
        &args.token,
        &args.state_dir,
    );
    cfg.containerd_namespace = args.containerd_namespace.clone();
    cfg.snapshotter = args.snapshotter.clone();
    cfg.interval = args.interval;
    cfg.grace_period = args.grace_period;
    cfg.agent_poll_interval = args.agent_poll_interval;
    cfg.agent_state_dir = Some(args.agent_state_dir.clone());
    cfg.keep_logs = args.keep_logs;
    cfg
}

/// One line per decision, for people and for tests.
pub(crate) fn print_report(r: &ScanReport) {
    for x in &r.reaped {
        println!(
            "reaped {} reason={} agent={} leftover={}",
            x.sandbox_id, x.reason, x.agent_id, x.leftover
        );
    }
    for k in &r.kept {
        println!("kept {} reason={:?}", k.sandbox_id, k.reason);
    }
    for e in &r.errors {
        println!("error {e}");
    }
    println!(
        "scan containers={} reaped={} kept={} errors={} controller_ready={}",
        r.containers,
        r.reaped.len(),
        r.kept.len(),
        r.errors.len(),
        r.controller_ready
    );
}

pub(crate) async fn run(args: JanitorArgs) -> anyhow::Result<()> {
    let cfg = config(&args);
    std::fs::create_dir_all(&cfg.state_dir)
        .with_context(|| format!("creating {}", cfg.state_dir.display()))?;
    if args.once {
        let janitor = Janitor::new(cfg).await.context("starting the janitor")?;
        let report = janitor
            .scan_once()
            .await
            .context("scan (nothing was reaped)")?;
        print_report(&report);
        anyhow::ensure!(
            report.errors.is_empty(),
            "{} cleanup(s) incomplete; the next scan finishes them",
            report.errors.len()
        );
        return Ok(());
    }
    let handle = Janitor::start(cfg).await.context("starting the janitor")?;
    crate::shutdown_signal().await;
    handle.shutdown().await;
    Ok(())
}
