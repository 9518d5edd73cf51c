//! sandbolt's latency harness.
//!
//! One run starts a private containerd + dockerd (the test bed), sandbolt's
//! agent and controllers on top of it, and then measures sandbolt and the
//! systems a user would otherwise pick — containerd's API called directly,
//! `ctr run -d`, the Docker engine — interleaved, iteration by iteration,
//! so that every system sees the same machine at the same moment. Results
//! are raw samples (CSV, JSON), a markdown table and a PNG chart.

pub mod chart;
pub mod machine;
pub mod progress;
pub mod report;
pub mod runtimes;
pub mod scale;
pub mod scenarios;
pub mod sdk;
pub mod snapshot;
pub mod stats;
pub mod systems;
pub mod telemetry;
pub mod warm;

use std::path::PathBuf;

/// One measured operation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    pub scenario: String,
    pub system: String,
    pub iteration: u32,
    /// Client-side latency of the whole operation, microseconds.
    pub total_us: u64,
    /// Named stage durations from the start of the operation, microseconds
    /// (e.g. `task_started`, `execd_ready`), where a system reports them.
    pub stages: Vec<(String, u64)>,
}

/// What a system could not do, and why; the run goes on without it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Skipped {
    pub system: String,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("test bed: {0}")]
    Testbed(#[from] sandbolt_testbed::TestbedError),
    #[error("{system}: {message}")]
    System { system: String, message: String },
    #[error("writing {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("chart: {0}")]
    Chart(String),
}

impl BenchError {
    pub fn system(system: &str, message: impl std::fmt::Display) -> Self {
        BenchError::System {
            system: system.to_string(),
            message: message.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, BenchError>;

/// The scenarios a run can be limited to (`--scenario`).
pub const SCENARIOS: [&str; 8] = [
    "sequential",
    "burst",
    "churn",
    "sdk",
    "warm",
    "snapshots",
    "telemetry",
    "runtimes",
];

/// How much to measure.
#[derive(Debug, Clone)]
pub struct Options {
    /// Sequential creates per system.
    pub iterations: u32,
    /// Concurrency of the burst scenario.
    pub burst: u32,
    /// Create → command → delete rounds.
    pub churn: u32,
    /// Rounds of the SDK scenario (`Sandbox.create` + `kill` on every
    /// lifecycle server); 0 leaves the scenario out.
    pub sdk_rounds: u32,
    /// Sequential rounds of the warm pools scenario (warm claim vs cold
    /// create per API); 0 leaves the whole warm scenario out.
    pub warm_rounds: u32,
    /// Creates at once in the warm pools burst, with a buffer of as many
    /// (and the same burst cold); 0 leaves the burst out.
    pub warm_burst: u32,
    /// Captures per size in the snapshots scenario (issue 18), and its
    /// rounds of create-from-snapshot vs cold create; 0 leaves the whole
    /// snapshots scenario out.
    pub snapshot_rounds: u32,
    /// MiB of filesystem changes in the snapshotted sandboxes, one source
    /// sandbox (and its captures) per size.
    pub snapshot_sizes_mib: Vec<u64>,
    /// Rounds of the telemetry scenario (issue 20: creates with OTLP export
    /// and scraping on vs off, interleaved); 0 leaves it out.
    pub telemetry_rounds: u32,
    /// Rounds of the runtimes scenario (issue 24: runc vs runsc, each on a
    /// pool of its own: create, exec, 1 MiB file, idle memory); 0 leaves
    /// it out.
    pub runtime_rounds: u32,
    /// The scenarios to run (names as [`Options::runs`] knows them); empty:
    /// all of them.
    pub scenarios: Vec<String>,
    /// OCI runtime of sandbolt's agents (`runc`, `crun`, `runsc`).
    pub runtime: String,
    pub out_dir: PathBuf,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

impl Options {
    /// Small enough for CI: proves the harness works, says nothing of speed.
    pub fn quick(out_dir: PathBuf) -> Self {
        Options {
            iterations: 5,
            burst: 4,
            churn: 3,
            sdk_rounds: 2,
            warm_rounds: 3,
            warm_burst: 4,
            snapshot_rounds: 3,
            snapshot_sizes_mib: vec![1],
            telemetry_rounds: 3,
            // Off in the quick run: it needs runsc and sandbox networking.
            runtime_rounds: 0,
            scenarios: Vec::new(),
            runtime: "runc".into(),
            out_dir,
            progress: false,
        }
    }

    pub fn full(out_dir: PathBuf) -> Self {
        Options {
            iterations: 50,
            burst: 16,
            churn: 20,
            sdk_rounds: 20,
            warm_rounds: 50,
            warm_burst: 100,
            snapshot_rounds: 10,
            snapshot_sizes_mib: vec![1, 100, 1024],
            telemetry_rounds: 50,
            runtime_rounds: 20,
            scenarios: Vec::new(),
            runtime: "runc".into(),
            out_dir,
            progress: true,
        }
    }

    /// Whether the run includes `scenario` (one of [`SCENARIOS`]).
    pub fn runs(&self, scenario: &str) -> bool {
        self.scenarios.is_empty() || self.scenarios.iter().any(|s| s == scenario)
    }
}
