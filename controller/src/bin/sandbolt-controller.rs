//! Standalone controller process (the `sandbolt` CLI embeds the library the
//! same way). Configured by environment, so tests can run it as a child and
//! `kill -9` it:
//!
//! - `SANDBOLT_CONTROLLER_LISTEN` (default `127.0.0.1:0`)
//! - `SANDBOLT_CONTROLLER_DATA_DIR` (required)
//! - `SANDBOLT_AGENT_TOKEN` (required), `SANDBOLT_FASTPATH_TOKEN` (optional)
//! - `SANDBOLT_CONSISTENCY` = `strong` | `fast`
//! - `SANDBOLT_HEARTBEAT_MS`, `SANDBOLT_LOST_AGENT_MS`, `SANDBOLT_EXPIRY_SWEEP_MS`
//! - `SANDBOLT_CONTROLLER_FAILPOINT` (see `Failpoint`)
//! - `SANDBOLT_STORE` = `embedded` (default) | `kubernetes`: records as
//!   Sandbox resources, served only while holding the Lease
//!   `SANDBOLT_LEASE_NAME` (default `sandbolt-controller`) in
//!   `SANDBOLT_NAMESPACE`, as `SANDBOLT_IDENTITY`; `SANDBOLT_LEASE_MS` sets the
//!   lease duration (renew deadline 2/3 of it, retry 1/5). The API server
//!   comes from `KUBECONFIG` or the in-cluster service account.
//!
//! Prints `SANDBOLT_CONTROLLER_LISTENING <addr>` on stdout once serving
//! (for a standby: once it leads).

use std::time::Duration;

use sandbolt_controller::{Consistency, Controller, ControllerConfig};

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn ms(name: &str) -> Option<Duration> {
    env(name)
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber_init();
    let listen = env("SANDBOLT_CONTROLLER_LISTEN")
        .unwrap_or_else(|| "127.0.0.1:0".into())
        .parse()?;
    let data_dir =
        env("SANDBOLT_CONTROLLER_DATA_DIR").ok_or("SANDBOLT_CONTROLLER_DATA_DIR is required")?;
    let token = env("SANDBOLT_AGENT_TOKEN").ok_or("SANDBOLT_AGENT_TOKEN is required")?;
    let mut cfg = ControllerConfig::new(listen, data_dir, token);
    cfg.fastpath_token = env("SANDBOLT_FASTPATH_TOKEN");
    if let Some(m) = env("SANDBOLT_CONSISTENCY") {
        cfg.default_consistency = match m.as_str() {
            "fast" => Consistency::Fast,
            "strong" => Consistency::Strong,
            other => return Err(format!("SANDBOLT_CONSISTENCY: unknown mode {other:?}").into()),
        };
    }
    if let Some(d) = ms("SANDBOLT_HEARTBEAT_MS") {
        cfg.heartbeat_interval = d;
    }
    if let Some(d) = ms("SANDBOLT_LOST_AGENT_MS") {
        cfg.lost_agent_timeout = d;
        cfg.startup_grace = d;
    }
    if let Some(d) = ms("SANDBOLT_EXPIRY_SWEEP_MS") {
        cfg.expiry_sweep_interval = d;
    }
    if env("SANDBOLT_STORE").as_deref() == Some("kubernetes") {
        return run_kubernetes(cfg).await;
    }
    let handle = Controller::start(cfg).await?;
    println!("SANDBOLT_CONTROLLER_LISTENING {}", handle.local_addr());
    tokio::signal::ctrl_c().await?;
    handle.shutdown().await;
    Ok(())
}

async fn run_kubernetes(cfg: ControllerConfig) -> Result<(), Box<dyn std::error::Error>> {
    use sandbolt_controller::ha::{ElectedExit, run_on_kubernetes};
    use sandbolt_controller::leader::LeaseConfig;

    let namespace = env("SANDBOLT_NAMESPACE").ok_or("SANDBOLT_NAMESPACE is required")?;
    let identity = env("SANDBOLT_IDENTITY").ok_or("SANDBOLT_IDENTITY is required")?;
    let lease_name = env("SANDBOLT_LEASE_NAME").unwrap_or_else(|| "sandbolt-controller".into());
    let mut lease = LeaseConfig::new(namespace, lease_name, identity);
    if let Some(d) = ms("SANDBOLT_LEASE_MS") {
        lease = lease.with_timings(d, d * 2 / 3, d / 5);
    }
    let exit = run_on_kubernetes(
        cfg,
        kube::Config::infer().await?,
        lease,
        |h| {
            use std::io::Write;
            println!("SANDBOLT_CONTROLLER_LISTENING {}", h.local_addr());
            let _ = std::io::stdout().flush();
        },
        async {
            let _ = tokio::signal::ctrl_c().await;
        },
    )
    .await?;
    match exit {
        ElectedExit::Shutdown => Ok(()),
        ElectedExit::LostLeadership => Err("lost the controller lease".into()),
    }
}

fn tracing_subscriber_init() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}
