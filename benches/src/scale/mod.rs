//! The scale harness (`sandbolt-bench scale`, issue 25): the real
//! controller binary, its real store (redb, or the Kubernetes store on the
//! in-process API double) and the real wire, against a fleet of simulated
//! agents ([`sandbolt_test_support::sim_agent`]) that speak the real agent
//! protocol but create no containers — the only honest way to put 1,000
//! nodes and 100,000 sandboxes on a 2-core machine.
//!
//! Per store it ramps creates through FastPath v2 and the native API (fast
//! and strong) at rising concurrency until the target number of live
//! sandboxes, with a part of the agents stopped and restarted during the
//! load (churn); samples the controller's RSS and its own histograms
//! (`/metrics`) between steps; restarts the controller and times the
//! registry rebuild; and, with the Kubernetes store, kills the leader under
//! a standby and times the failover. Every phase checks that the records
//! the controller lists are the sandboxes it answered for.
//!
//! The harness process (sim agents, API double, load) shares the 2 cores
//! with the controller: its numbers are a floor for the controller alone.

pub mod cli;
pub mod controller;
pub mod load;
pub mod prom;
pub mod report;
mod run;

use std::path::PathBuf;
use std::time::Duration;

pub use load::Api;
pub use run::{run, scrape};
use sandbolt_test_support::sim_agent::{CounterSnapshot, Latency};

/// Which record store the controller runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum StoreKind {
    /// redb in the controller's data dir (one replica).
    Embedded,
    /// `Sandbox` resources on the Kubernetes API double (leader election).
    Kubernetes,
}

impl StoreKind {
    pub fn name(self) -> &'static str {
        match self {
            StoreKind::Embedded => "redb",
            StoreKind::Kubernetes => "kube",
        }
    }
}

/// Lease timings of the Kubernetes store (`--lease-duration`,
/// `--renew-deadline`, `--lease-retry`).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct LeaseTimings {
    pub duration: Duration,
    pub renew_deadline: Duration,
    pub retry: Duration,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct ScaleOptions {
    /// `sandbolt` binary whose `controller` subcommand is measured.
    pub sandbolt_bin: PathBuf,
    pub agents: usize,
    /// Live sandboxes at the end of the ramp (per store).
    pub sandboxes: usize,
    /// Concurrency of each ramp step; every API runs at each.
    pub concurrency: Vec<usize>,
    pub apis: Vec<Api>,
    pub stores: Vec<StoreKind>,
    /// Fraction of agents stopped per churn round (0: no churn).
    pub churn: f64,
    pub churn_every: Duration,
    pub churn_down: Duration,
    /// The controller's heartbeat interval, lost-agent timeout and
    /// startup grace.
    pub heartbeat: Duration,
    pub lost_timeout: Duration,
    pub startup_grace: Duration,
    pub lease: LeaseTimings,
    /// The controller's default consistency (what FastPath v2 gets).
    pub default_consistency: String,
    pub latency: Latency,
    pub failure_rate: f64,
    /// A create that takes longer is counted as unanswered.
    pub create_deadline: Duration,
    /// With the Kubernetes store: kill the leader under a standby.
    pub failover: bool,
    pub out_dir: PathBuf,
}

impl ScaleOptions {
    /// Small enough for the test suite (20 agents, 2,000 sandboxes per
    /// store, short timers): proves correctness, says nothing of speed.
    pub fn quick(sandbolt_bin: PathBuf, out_dir: PathBuf) -> Self {
        ScaleOptions {
            sandbolt_bin,
            agents: 20,
            sandboxes: 2_000,
            concurrency: vec![4, 16],
            apis: Api::ALL.to_vec(),
            stores: vec![StoreKind::Embedded, StoreKind::Kubernetes],
            churn: 0.1,
            churn_every: Duration::from_secs(2),
            churn_down: Duration::from_millis(1500),
            heartbeat: Duration::from_millis(200),
            lost_timeout: Duration::from_secs(1),
            startup_grace: Duration::from_secs(3),
            lease: LeaseTimings {
                duration: Duration::from_secs(3),
                renew_deadline: Duration::from_secs(2),
                retry: Duration::from_millis(600),
            },
            default_consistency: "strong".into(),
            latency: Latency::None,
            failure_rate: 0.0,
            create_deadline: Duration::from_secs(60),
            failover: true,
            out_dir,
        }
    }

    /// Issue 25's scale: 1,000 agents, 100,000 live sandboxes per store,
    /// 10 % of the agents lost and back every 30 s, the controller's and
    /// the chart's default timers.
    pub fn full(sandbolt_bin: PathBuf, out_dir: PathBuf) -> Self {
        ScaleOptions {
            agents: 1_000,
            sandboxes: 100_000,
            concurrency: vec![8, 32, 128],
            churn: 0.1,
            churn_every: Duration::from_secs(30),
            churn_down: Duration::from_secs(15),
            heartbeat: Duration::from_secs(2),
            lost_timeout: Duration::from_secs(10),
            startup_grace: Duration::from_secs(10),
            lease: LeaseTimings {
                duration: Duration::from_secs(15),
                renew_deadline: Duration::from_secs(10),
                retry: Duration::from_secs(2),
            },
            ..Self::quick(sandbolt_bin, out_dir)
        }
    }

    /// Each agent's max_sandboxes: twice its share of the target, so the
    /// ramp fits while churn keeps a tenth of the fleet out of placement.
    pub fn capacity(&self) -> i32 {
        let share = self.sandboxes.div_ceil(self.agents.max(1));
        (share * 2).max(10) as i32
    }
}

/// One controller restart or failover: how long until it served, until a
/// create went through again, and what it then listed.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Takeover {
    /// Records in the store when it happened.
    pub records: usize,
    /// From the new process's start (rebuild) or the leader's SIGKILL
    /// (failover) to the serving line.
    pub serving_s: f64,
    /// Until the first create after it succeeded (writes wait for the known
    /// agents' heartbeats, or the startup grace).
    pub first_create_s: f64,
    /// Records the new controller listed.
    pub listed: usize,
    /// Of the sandboxes created before, how many it did not list.
    pub missing: usize,
}

/// (records, controller RSS bytes) after a step.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct RssSample {
    pub records: usize,
    pub rss_bytes: u64,
}

/// Everything one store's run measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StoreReport {
    pub store: StoreKind,
    pub agents: usize,
    pub steps: Vec<report::StepReport>,
    pub rss: Vec<RssSample>,
    /// Records the controller listed after the ramp, and those it did not
    /// list although their create was answered OK.
    pub listed_after_load: usize,
    pub missing_after_load: usize,
    pub rebuild: Option<Takeover>,
    pub failover: Option<Takeover>,
    /// Sandboxes the simulated agents hold at the end.
    pub held: usize,
    pub fleet: CounterSnapshot,
    /// Why the store's run stopped early, when it did.
    pub error: Option<String>,
}

/// The whole run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ScaleReport {
    pub command: String,
    pub binary: String,
    pub agents: usize,
    pub sandboxes: usize,
    pub churn: f64,
    pub stores: Vec<StoreReport>,
}
