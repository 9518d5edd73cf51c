//! `sim-agents`: N simulated agents against a real controller, for scale
//! tests by hand (the scale harness, `sandbolt-bench scale`, runs the same
//! library in its own process). Test support only: never shipped in the
//! chart or the `sandbolt` binary.
//!
//! Control on stdin, one command a line: `stop N` (stop N random agents),
//! `restart` (bring every stopped agent back), `stats`, `quit`.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use sandbolt_test_support::sim_agent::faults::parse_fraction;
use sandbolt_test_support::sim_agent::{ChurnSpec, Fleet, FleetConfig, Latency};
use tokio::io::AsyncBufReadExt;

/// Simulated sandbolt agents: they enroll, heartbeat their inventory and
/// answer the agent API like real agents, but create no containers.
#[derive(Debug, Parser)]
#[command(name = "sim-agents")]
struct Args {
    /// The controller's gRPC address (RegistryService), e.g.
    /// http://127.0.0.1:9090.
    #[arg(long, env = "SANDBOLT_CONTROLLER")]
    controller: String,
    /// The controller's bootstrap token (its --agent-token).
    #[arg(long, env = "SANDBOLT_AGENT_TOKEN", hide_env_values = true)]
    agent_token: String,
    /// How many agents to run.
    #[arg(long, default_value_t = 100)]
    agents: usize,
    /// Agent ids are <prefix>-<n> (n zero-padded to 5 digits).
    #[arg(long, default_value = "sim")]
    id_prefix: String,
    /// The agent pool every agent reports.
    #[arg(long, default_value = "default")]
    pool: String,
    /// max_sandboxes of each agent.
    #[arg(long, default_value_t = 1000)]
    capacity: i32,
    /// Address each agent's AgentService listener binds (one free port each).
    #[arg(long, default_value = "127.0.0.1")]
    listen_host: String,
    /// Delay before every answer: 0 (default), <duration> (fixed, e.g. 5ms),
    /// uniform:<min>-<max>, or exp:<mean> (exponential).
    #[arg(long, default_value = "0")]
    latency: String,
    /// Fraction of mutating calls (create, delete, pause, resume, policy)
    /// answered UNAVAILABLE on purpose, e.g. 1% or 0.01. Default 0.
    #[arg(long, default_value = "0")]
    failure_rate: String,
    /// Agents lost and back: this fraction of the fleet (10% or 0.1) is
    /// stopped every --churn-every and restarted --churn-down later.
    /// Default 0: no churn.
    #[arg(long, default_value = "0")]
    churn: String,
    /// How often a churn round starts (default 30s).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    churn_every: Duration,
    /// How long churned agents stay down (default 15s).
    #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
    churn_down: Duration,
    /// Seed of the latency, failure and churn draws (default fixed, so
    /// runs repeat).
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SANDBOLT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let mut config = FleetConfig::new(&args.controller, &args.agent_token);
    config.agents = args.agents;
    config.id_prefix = args.id_prefix;
    config.pool = args.pool;
    config.capacity = args.capacity;
    config.listen_host = args.listen_host;
    config.latency = args.latency.parse::<Latency>()?;
    config.failure_rate = parse_fraction("--failure-rate", &args.failure_rate)?;
    config.seed = args.seed;
    let churn = parse_fraction("--churn", &args.churn)?;
    let fleet = Fleet::start(config).await.context("starting the fleet")?;
    println!("SIM_AGENTS_READY {}", fleet.len());
    let churner = (churn > 0.0).then(|| {
        fleet.spawn_churn(ChurnSpec {
            fraction: churn,
            every: args.churn_every,
            down_for: args.churn_down,
        })
    });
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    loop {
        tokio::select! {
            line = lines.next_line() => match line? {
                Some(l) => if !command(&fleet, l.trim()).await? { break },
                None => std::future::pending::<()>().await,
            },
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    if let Some(c) = churner {
        c.abort();
    }
    fleet.shutdown().await;
    Ok(())
}

/// One stdin command; false to quit.
async fn command(fleet: &Fleet, line: &str) -> anyhow::Result<bool> {
    let mut words = line.split_whitespace();
    match (words.next(), words.next()) {
        (Some("stop"), Some(n)) => {
            let n: usize = n.parse().context("stop N: N must be a number of agents")?;
            let victims = fleet.pick(n as f64 / fleet.len().max(1) as f64);
            fleet.stop(&victims).await;
            println!("stopped {}", victims.len());
        }
        (Some("restart"), None) => {
            fleet.restart_all().await?;
            println!("up {}", fleet.up());
        }
        (Some("stats"), None) => {
            println!(
                "up {} held {} {:?}",
                fleet.up(),
                fleet.held(),
                fleet.counters()
            );
        }
        (Some("quit"), None) => return Ok(false),
        (None, _) => {}
        _ => eprintln!("unknown command {line:?}: stop N | restart | stats | quit"),
    }
    Ok(true)
}
