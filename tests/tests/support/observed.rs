//! sandbolt as an operator runs it, one process per component, each serving
//! its ops endpoint (`--metrics-listen`: /metrics, /healthz, /readyz): a
//! controller (embedded store), an agent and a janitor on the test bed's
//! containerd, and a lifecycle API in front of the controller. The official
//! OpenSandbox Python SDK drives it (`tests/python/observability_sdk.py`)
//! and the official Prometheus client's OpenMetrics parser reads what each
//! serves (`tests/python/metrics_families.py`). For the observability tests
//! (`metrics_scrape`, `request_id_logs`).

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sandbolt_e2e::bed::{connect, containers, eventually, free_port, start_bed, wait_agents};
use sandbolt_e2e::controller_process::ControllerProcess;
use sandbolt_test_support::Proc;
use sandbolt_testbed::{Testbed, workspace_root};
use serde_json::Value;

use super::agent_proc::AgentProc;

pub const API_KEY: &str = "observed-api-key-0123456789";
const TOKEN: &str = "observed-agent-token";
const NODE: &str = "node-observed";
/// Every component's log filter: the request-id spans of the telemetry
/// layers, and each component's own debug lines.
pub const LOG_FILTER: &str = "info,sandbolt_telemetry=debug,sandbolt_controller=debug,\
    sandbolt_agent=debug,sandbolt_lifecycle=debug,sandbolt_janitor=debug";
const READY_WITHIN: Duration = Duration::from_secs(60);
const SDK_WITHIN: Duration = Duration::from_secs(300);
/// The content type of the ops endpoint's /metrics (OpenMetrics 1.0).
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The four components, by the name their `component` label has.
pub const COMPONENTS: [&str; 4] = ["controller", "agent", "janitor", "lifecycle"];

/// Every process started; dropping it SIGKILLs them (fields drop in
/// order: the processes before the bed they use).
pub struct Stack {
    pub controller: ControllerProcess,
    pub agent: AgentProc,
    pub janitor: Proc,
    pub lifecycle: Proc,
    pub lifecycle_addr: SocketAddr,
    ops: BTreeMap<&'static str, SocketAddr>,
    pub bed: Testbed,
    pub dir: tempfile::TempDir,
}

/// What the SDK script reports.
#[derive(Debug)]
pub struct SdkRun {
    pub sandbox_id: String,
    pub stdout: String,
}

/// One sample as the parser reads it.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// One metric family as the parser reads it.
#[derive(Debug, Clone)]
pub struct Family {
    pub name: String,
    /// counter | gauge | histogram | ... (OpenMetrics types)
    pub kind: String,
    pub samples: Vec<Sample>,
}

/// One component's parsed /metrics.
#[derive(Debug, Clone)]
pub struct Scrape(pub Vec<Family>);

impl Scrape {
    /// The sum of the samples called `sample` whose labels include every
    /// pair of `labels`.
    pub fn sum(&self, sample: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples(sample)
            .filter(|s| {
                labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
            .sum()
    }

    /// Every sample called `sample`.
    pub fn samples<'a>(&'a self, sample: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.0
            .iter()
            .flat_map(|f| &f.samples)
            .filter(move |s| s.name == sample)
    }

    pub fn family(&self, name: &str) -> Option<&Family> {
        self.0.iter().find(|f| f.name == name)
    }

    /// The names a PromQL query can read from this scrape: every sample's,
    /// and for a family without samples yet the names its type gives
    /// (`_total` of a counter, `_bucket`/`_sum`/`_count` of a histogram).
    pub fn queryable_names(&self) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for f in &self.0 {
            out.extend(f.samples.iter().map(|s| s.name.clone()));
            let suffixes: &[&str] = match f.kind.as_str() {
                "counter" => &["_total"],
                "histogram" => &["_bucket", "_sum", "_count"],
                _ => &[""],
            };
            out.extend(suffixes.iter().map(|s| format!("{}{s}", f.name)));
        }
        out
    }
}

impl Stack {
    /// Starts the bed and the four processes; returns once each one's
    /// /readyz answers 200 and the agent is registered.
    pub async fn start() -> Stack {
        let bed = start_bed().await;
        let dir = tempfile::tempdir().expect("stack dir");
        let ops: BTreeMap<&'static str, SocketAddr> =
            COMPONENTS.iter().map(|c| (*c, free_port())).collect();

        let controller_addr = free_port();
        let mut controller = spawn_controller(dir.path(), controller_addr, ops["controller"]);
        assert_eq!(
            controller.wait_serving(READY_WITHIN),
            Some(controller_addr),
            "the controller serves:\n{}",
            controller.output()
        );
        let mut agent = AgentProc::new("agent-observed", NODE, TOKEN, dir.path().join("agent"))
            .controller(controller_addr)
            .args(["--network", "none", "--volume-backend", "none"])
            .args(["--log", LOG_FILTER])
            .args(["--metrics-listen".to_string(), ops["agent"].to_string()]);
        agent.start(&bed);
        wait_agents(&connect(controller_addr).await, 1).await;
        let janitor = spawn_janitor(&bed, dir.path(), controller_addr, ops["janitor"]);
        let lifecycle_addr = free_port();
        let lifecycle = spawn_lifecycle(
            dir.path(),
            controller_addr,
            lifecycle_addr,
            ops["lifecycle"],
        );
        let stack = Stack {
            controller,
            agent,
            janitor,
            lifecycle,
            lifecycle_addr,
            ops,
            bed,
            dir,
        };
        for c in COMPONENTS {
            stack.wait_ready(c).await;
        }
        stack
    }

    /// The ops endpoint of `component`.
    pub fn ops(&self, component: &str) -> SocketAddr {
        self.ops[component]
    }

    async fn wait_ready(&self, component: &str) {
        let url = format!("http://{}/readyz", self.ops(component));
        let http = reqwest::Client::new();
        let started = std::time::Instant::now();
        loop {
            let answer = match http.get(&url).timeout(Duration::from_secs(2)).send().await {
                Ok(r) if r.status() == 200 => return,
                Ok(r) => format!("{}: {}", r.status(), r.text().await.unwrap_or_default()),
                Err(e) => e.to_string(),
            };
            assert!(
                started.elapsed() < READY_WITHIN,
                "{component} not ready at {url} within {READY_WITHIN:?} ({answer})\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Runs `tests/python/observability_sdk.py <mode>` against the
    /// lifecycle, every request carrying `request_id` when given.
    pub async fn sdk(&self, mode: &str, request_id: Option<&str>) -> SdkRun {
        let python = tokio::task::spawn_blocking(sandbolt_testbed::python)
            .await
            .unwrap()
            .expect("the SDK's venv (scripts/python-env.sh)");
        let mut cmd = tokio::process::Command::new(python);
        cmd.arg(workspace_root().join("tests/python/observability_sdk.py"))
            .arg(mode)
            .env("LIFECYCLE_DOMAIN", self.lifecycle_addr.to_string())
            .env("LIFECYCLE_API_KEY", API_KEY)
            .env("SANDBOLT_IMAGE", sandbolt_testbed::BUSYBOX_REF)
            .env_remove("OBS_REQUEST_ID")
            .kill_on_drop(true);
        if let Some(id) = request_id {
            cmd.env("OBS_REQUEST_ID", id);
        }
        let out = tokio::time::timeout(SDK_WITHIN, cmd.output())
            .await
            .unwrap_or_else(|_| panic!("the SDK script ran over {SDK_WITHIN:?}\n{}", self.logs()))
            .expect("running the SDK script");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "the SDK script failed ({}):\n{stdout}\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            self.logs()
        );
        let doc: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
            .unwrap_or_else(|e| panic!("the SDK script's last line is no JSON ({e}):\n{stdout}"));
        SdkRun {
            sandbox_id: doc["sandbox_id"].as_str().expect("sandbox_id").to_string(),
            stdout: doc["stdout"].as_str().unwrap_or_default().to_string(),
        }
    }

    /// `DELETE /v1/sandboxes/{id}` on the lifecycle.
    pub async fn delete(&self, sandbox_id: &str) {
        let resp = reqwest::Client::new()
            .delete(format!(
                "http://{}/v1/sandboxes/{sandbox_id}",
                self.lifecycle_addr
            ))
            .header("OPEN-SANDBOX-API-KEY", API_KEY)
            .send()
            .await
            .expect("DELETE reaches the lifecycle");
        assert!(
            resp.status().is_success(),
            "DELETE {sandbox_id}: {}",
            resp.status()
        );
    }

    /// Every component's /metrics, checked to be OpenMetrics by its content
    /// type and parsed by the official parser.
    pub async fn scrape_all(&self) -> BTreeMap<&'static str, Scrape> {
        let http = reqwest::Client::new();
        let mut files = Vec::new();
        for c in COMPONENTS {
            let url = format!("http://{}/metrics", self.ops(c));
            let resp = http
                .get(&url)
                .send()
                .await
                .unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(resp.status(), 200, "{url}");
            let kind = resp.headers()[reqwest::header::CONTENT_TYPE]
                .to_str()
                .unwrap()
                .to_string();
            assert_eq!(kind, OPENMETRICS, "{url}");
            let path = self.dir.path().join(format!("{c}.metrics"));
            std::fs::write(&path, resp.text().await.unwrap()).unwrap();
            files.push((c, path));
        }
        parse_openmetrics(&files).await
    }

    /// Waits until containerd holds no container.
    pub async fn wait_no_containers(&self) {
        let bed = &self.bed;
        eventually(
            "every container removed",
            Duration::from_secs(60),
            || async { containers(bed).await.is_empty() },
        )
        .await;
    }

    /// What `component` (controller, agent, janitor, lifecycle) printed so
    /// far. Its output goes to a file, not a terminal: it must hold no colour
    /// codes (they break grep and log shippers).
    pub fn output(&self, component: &str) -> String {
        let log = match component {
            "controller" => self.controller.output(),
            "agent" => self.agent.output(),
            "janitor" => self.janitor.output(),
            "lifecycle" => self.lifecycle.output(),
            other => panic!("no component {other}"),
        };
        assert!(
            !log.contains('\u{1b}'),
            "{component} coloured its log output written to a file"
        );
        log
    }

    /// The end of each process's output, for a failure message.
    pub fn logs(&self) -> String {
        let tail = |s: String| {
            let start = s.len().saturating_sub(4000);
            let start = (start..s.len())
                .find(|i| s.is_char_boundary(*i))
                .unwrap_or(start);
            s[start..].to_string()
        };
        COMPONENTS
            .iter()
            .map(|c| format!("--- {c} ---\n{}\n", tail(self.output(c))))
            .collect()
    }

    /// Graceful stops, the lifecycle first and the controller last, once
    /// no sandbox is left.
    pub async fn stop(mut self) {
        self.wait_no_containers().await;
        eprintln!(
            "lifecycle: {}",
            self.lifecycle.terminate(Duration::from_secs(30))
        );
        eprintln!(
            "janitor: {}",
            self.janitor.terminate(Duration::from_secs(30))
        );
        self.agent.stop();
        eprintln!("controller: {}", self.controller.stop());
    }
}

fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_e2e-sandbolt"))
}

fn spawn_controller(dir: &Path, listen: SocketAddr, ops: SocketAddr) -> ControllerProcess {
    let env = [
        ("SANDBOLT_STORE", "embedded".to_string()),
        (
            "SANDBOLT_DATA_DIR",
            dir.join("controller").display().to_string(),
        ),
        ("SANDBOLT_FASTPATH_LISTEN", listen.to_string()),
        ("SANDBOLT_AGENT_TOKEN", TOKEN.to_string()),
        ("SANDBOLT_HEARTBEAT_INTERVAL", "200ms".to_string()),
        ("SANDBOLT_AGENT_PRESENCE", "none".to_string()),
        ("SANDBOLT_METRICS_LISTEN", ops.to_string()),
        ("SANDBOLT_LOG", LOG_FILTER.to_string()),
    ];
    let mut cmd = ControllerProcess::command(binary(), &env);
    ControllerProcess::spawn("controller", &mut cmd, dir.join("controller.log"))
}

fn spawn_janitor(bed: &Testbed, dir: &Path, controller: SocketAddr, ops: SocketAddr) -> Proc {
    let mut cmd = Command::new(binary());
    cmd.arg("janitor")
        .arg("--controller")
        .arg(format!("http://{controller}"))
        .args(["--token", TOKEN, "--node-name", NODE])
        .arg("--containerd-socket")
        .arg(bed.containerd_socket())
        .arg("--agent-state-dir")
        .arg(dir.join("agent"))
        .arg("--state-dir")
        .arg(dir.join("janitor"))
        .args(["--interval", "1s", "--log", LOG_FILTER])
        .arg("--metrics-listen")
        .arg(ops.to_string())
        .env_remove("SANDBOLT_KUBE");
    Proc::spawn("janitor", &mut cmd, dir.join("janitor.log"))
}

fn spawn_lifecycle(
    dir: &Path,
    controller: SocketAddr,
    listen: SocketAddr,
    ops: SocketAddr,
) -> Proc {
    let mut cmd = Command::new(binary());
    cmd.arg("lifecycle")
        .arg("--listen")
        .arg(listen.to_string())
        .args(["--api-key", API_KEY])
        .arg("--controller")
        .arg(format!("http://{controller}"))
        .arg("--data-dir")
        .arg(dir.join("lifecycle"))
        .arg("--metrics-listen")
        .arg(ops.to_string())
        .args(["--log", LOG_FILTER]);
    Proc::spawn("lifecycle", &mut cmd, dir.join("lifecycle.log"))
}

/// `tests/python/metrics_families.py` over the scraped bodies.
async fn parse_openmetrics(files: &[(&'static str, PathBuf)]) -> BTreeMap<&'static str, Scrape> {
    let python = tokio::task::spawn_blocking(sandbolt_testbed::python)
        .await
        .unwrap()
        .expect("the venv (scripts/python-env.sh)");
    let out = tokio::process::Command::new(python)
        .arg(workspace_root().join("tests/python/metrics_families.py"))
        .args(files.iter().map(|(c, p)| format!("{c}={}", p.display())))
        .output()
        .await
        .expect("running metrics_families.py");
    assert!(
        out.status.success(),
        "the OpenMetrics parser refused a scrape: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_slice(&out.stdout).expect("the parser's JSON");
    files
        .iter()
        .map(|(c, _)| (*c, scrape_of(&doc[*c])))
        .collect()
}

fn scrape_of(families: &Value) -> Scrape {
    Scrape(
        families
            .as_array()
            .expect("families")
            .iter()
            .map(|f| Family {
                name: f["name"].as_str().unwrap().to_string(),
                kind: f["type"].as_str().unwrap().to_string(),
                samples: f["samples"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| Sample {
                        name: s["name"].as_str().unwrap().to_string(),
                        labels: s["labels"]
                            .as_object()
                            .unwrap()
                            .iter()
                            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                            .collect(),
                        value: s["value"].as_f64().unwrap(),
                    })
                    .collect(),
            })
            .collect(),
    )
}
