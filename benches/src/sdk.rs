//! The "sdk create" scenario: the official OpenSandbox Python SDK's
//! `Sandbox.create` (POST /sandboxes, the endpoint look-ups for 44772 and
//! 18080, execd's /ping answering) and `kill`, interleaved round by round
//! across
//!
//! - sandbolt's lifecycle adapter on the FastPath backend (the harness's
//!   fast-mode controller and its agent, on the test bed's containerd; the
//!   adapter creates through the controller's native API), three times over
//!   on the same server: with the SDK's default `resource` (it always sends
//!   one: `{"cpu": "1", "memory": "2Gi"}`), with no limits at all (an empty
//!   `resourceLimits`), and with `{"cpu": "500m", "memory": "256Mi"}` —
//!   the last two are issue 13's limits vs no limits,
//! - sandbolt's lifecycle adapter on the Docker backend (the test bed's
//!   dockerd, execd from [`execd_binary`]),
//! - the OpenSandbox server 1.1.1 (PyPI) with its Docker runtime on the same
//!   dockerd and its `runtime.execd_image` pointed at a locally built image
//!   holding sandbolt's execd and a bootstrap script of our own,
//! - the same server with its Kubernetes runtime on sandbolt (issue 19): its
//!   fast-sandbox (fsb) provider creates through a controller over the
//!   Kubernetes store (on the API server double, in process), whose agent
//!   runs on the bed's containerd, and its signed routes go to sandbolt's
//!   fsb gateway (a lifecycle with `gateway_listen`). fsb creates only from
//!   a template: one is made and waited for before the clock starts, and
//!   each create is `create_from_template`, which resolves one endpoint
//!   (44772) where an image create resolves two (44772, 18080).
//!
//! The timing loop is `benches/python/sdk_create.py`, run with the repo's
//! venv (`sandbolt_testbed::python()`); the OpenSandbox server runs from its
//! own venv (`benches/python/server-env.sh`: it needs grpcio/protobuf
//! versions the pinned test clients cannot share). A system that cannot run
//! is reported in `skipped` with the reason; the others go on.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use sandbolt_lifecycle::{
    BackendConfig, ControllerConfig, DockerConfig, Lifecycle, LifecycleConfig, LifecycleHandle,
};
use sandbolt_testbed::{OciImage, busybox_image, execd_binary, workspace_root};

use crate::systems::Bench;
use crate::{Sample, Skipped};

pub const SCENARIO_CREATE: &str = "sdk create";
pub const SCENARIO_KILL: &str = "sdk kill";
/// The SDK's default `resource` (cpu 1, memory 2Gi): what a user who names
/// no limits gets, and what the OpenSandbox server is sent too.
pub const LIFECYCLE_FASTPATH: &str = "sandbolt lifecycle, FastPath (fast)";
/// Same server, `resourceLimits: {}`: no CPU quota, no memory limit.
pub const LIFECYCLE_FASTPATH_NO_LIMITS: &str = "sandbolt lifecycle, FastPath (fast), no limits";
/// Same server, `resource={"cpu": "500m", "memory": "256Mi"}`.
pub const LIFECYCLE_FASTPATH_LIMITS: &str = "sandbolt lifecycle, FastPath (fast), limits";
pub const LIFECYCLE_DOCKER: &str = "sandbolt lifecycle, Docker";
pub const OPENSANDBOX: &str = "OpenSandbox server 1.1.1, Docker";
/// The server's Kubernetes runtime (fsb provider) on sandbolt, from a
/// template.
pub const OPENSANDBOX_SANDBOLT: &str = "OpenSandbox server 1.1.1, Kubernetes fsb on sandbolt";
/// Every system of the scenario, in the order the table shows them.
pub const SYSTEMS: [&str; 6] = [
    LIFECYCLE_FASTPATH,
    LIFECYCLE_FASTPATH_NO_LIMITS,
    LIFECYCLE_FASTPATH_LIMITS,
    LIFECYCLE_DOCKER,
    OPENSANDBOX,
    OPENSANDBOX_SANDBOLT,
];
/// What the limits target asks for (the native API's limits system adds
/// pids, which the SDK's `resource` has no key for).
const SDK_LIMITS: [(&str, &str); 2] = [("cpu", "500m"), ("memory", "256Mi")];

pub(crate) const API_KEY: &str = "sandbolt-bench-sdk-key-0123456789";
/// The image the OpenSandbox server copies execd and bootstrap.sh out of.
const EXECD_IMAGE: &str = "sandbolt/opensandbox-execd:bench";
const BOOTSTRAP: &str = include_str!("../python/opensandbox-bootstrap.sh");

/// What the scenario measured and what it could not.
#[derive(Debug, Default)]
pub struct SdkOutcome {
    pub samples: Vec<Sample>,
    pub skipped: Vec<Skipped>,
}

/// One lifecycle API the SDK is pointed at.
pub(crate) struct Target {
    pub(crate) name: &'static str,
    pub(crate) url: String,
    /// The SDK's `resource` argument: `None` leaves the SDK's default,
    /// an empty map sends no limits.
    pub(crate) resource: Option<serde_json::Map<String, serde_json::Value>>,
    /// The SDK's `extensions` argument (e.g. `{"poolRef": ...}`).
    pub(crate) extensions: Option<serde_json::Value>,
    /// A warm pool whose `GET /v1/pools/{name}` must report this many
    /// available sandboxes before each (timed) create; waited for untimed.
    pub(crate) wait_pool: Option<(String, i32)>,
    /// Create from a template made before the clock (the server's fsb
    /// provider creates only from one).
    pub(crate) template: bool,
}

impl SdkOutcome {
    /// `system` cannot run (or failed a round): reported, and the run goes on.
    fn skip(&mut self, system: &str, reason: String) {
        tracing::warn!(system, %reason, "sdk create: system cannot run; continuing without it");
        self.skipped.push(Skipped {
            system: format!("{system} ({SCENARIO_CREATE})"),
            reason,
        });
    }
}

/// The lifecycle servers of the scenario, and the targets they serve.
#[derive(Default)]
struct Lifecycles {
    targets: Vec<Target>,
    handles: Vec<LifecycleHandle>,
}

impl Lifecycles {
    /// One lifecycle on the FastPath backend (the bench's fast-mode
    /// controller), three targets on it: the limits are the only difference.
    async fn add_fastpath(&mut self, bench: &Bench, data: &Path, out: &mut SdkOutcome) {
        let names = [
            LIFECYCLE_FASTPATH,
            LIFECYCLE_FASTPATH_NO_LIMITS,
            LIFECYCLE_FASTPATH_LIMITS,
        ];
        let mut fp = ControllerConfig::new(format!("http://{}", bench.fast_controller_addr()));
        fp.namespace = "default".into();
        let handle = match start_lifecycle(BackendConfig::Controller(fp), data).await {
            Ok(h) => h,
            Err(e) => {
                for name in names {
                    out.skip(name, e.clone());
                }
                return;
            }
        };
        let url = format!("http://{}", handle.addr());
        let limits = SDK_LIMITS
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
            .collect();
        for (name, resource) in
            names
                .into_iter()
                .zip([None, Some(serde_json::Map::new()), Some(limits)])
        {
            self.targets.push(Target {
                name,
                url: url.clone(),
                resource,
                extensions: None,
                wait_pool: None,
                template: false,
            });
        }
        self.handles.push(handle);
    }

    /// One lifecycle on the Docker backend, on the bed's dockerd.
    async fn add_docker(&mut self, docker_socket: &Path, data: &Path, out: &mut SdkOutcome) {
        let execd = match tokio::task::spawn_blocking(execd_binary).await {
            Ok(Ok(execd)) => execd,
            Ok(Err(e)) => return out.skip(LIFECYCLE_DOCKER, format!("execd: {e}")),
            Err(e) => return out.skip(LIFECYCLE_DOCKER, format!("execd: {e}")),
        };
        let backend = BackendConfig::Docker(DockerConfig::new(docker_socket, &execd));
        match start_lifecycle(backend, data).await {
            Ok(h) => {
                self.targets.push(Target {
                    name: LIFECYCLE_DOCKER,
                    url: format!("http://{}", h.addr()),
                    resource: None,
                    extensions: None,
                    wait_pool: None,
                    template: false,
                });
                self.handles.push(h);
            }
            Err(e) => out.skip(LIFECYCLE_DOCKER, e),
        }
    }

    async fn shutdown(self) {
        for h in self.handles {
            if let Err(e) = h.shutdown().await {
                tracing::warn!(error = %e, "lifecycle shutdown");
            }
        }
    }
}

/// Runs `rounds` recorded rounds (after one warm-up round) on every system
/// that starts.
pub async fn run(bench: &Bench, rounds: u32) -> SdkOutcome {
    let mut out = SdkOutcome::default();
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => {
            for s in SYSTEMS {
                out.skip(s, format!("tempdir: {e}"));
            }
            return out;
        }
    };
    let mut lifecycles = Lifecycles::default();
    lifecycles
        .add_fastpath(bench, &dir.path().join("lc-fastpath"), &mut out)
        .await;
    let docker_socket = bench
        .testbed()
        .docker_socket()
        .map(Path::to_path_buf)
        .expect("the harness's test bed runs dockerd");
    lifecycles
        .add_docker(&docker_socket, &dir.path().join("lc-docker"), &mut out)
        .await;
    let docker_runtime = ServerRuntime::Docker {
        socket: docker_socket,
    };
    let server = match OpenSandboxServer::start(bench, &docker_runtime, dir.path()).await {
        Ok(s) => {
            lifecycles.targets.push(server_target(&s, false));
            Some(s)
        }
        Err(e) => {
            out.skip(OPENSANDBOX, e);
            None
        }
    };
    let on_sandbolt = match OnSandbolt::start(bench, &dir.path().join("on-sandbolt")).await {
        Ok(s) => {
            lifecycles.targets.push(server_target(&s.server, true));
            Some(s)
        }
        Err(e) => {
            out.skip(OPENSANDBOX_SANDBOLT, e);
            None
        }
    };
    if !lifecycles.targets.is_empty() {
        match run_python(&lifecycles.targets, rounds).await {
            Ok(report) => {
                let servers = server.iter().chain(on_sandbolt.as_ref().map(|s| &s.server));
                record(report, servers, &mut out)
            }
            Err(e) => {
                for t in &lifecycles.targets {
                    out.skip(t.name, e.clone());
                }
            }
        }
    }
    if let Some(s) = server {
        s.stop().await;
    }
    if let Some(s) = on_sandbolt {
        s.stop().await;
    }
    lifecycles.shutdown().await;
    out
}

/// The SDK's target for an OpenSandbox server.
fn server_target(server: &OpenSandboxServer, template: bool) -> Target {
    Target {
        name: server.system,
        url: format!("http://{}", server.addr),
        resource: None,
        extensions: None,
        wait_pool: None,
        template,
    }
}

/// The Python loop's report as samples (creates then kills, each in
/// [`SYSTEMS`] order) and its failures as skips (with an OpenSandbox
/// server's log for its own).
pub(crate) fn record<'a>(
    mut report: PyReport,
    servers: impl IntoIterator<Item = &'a OpenSandboxServer>,
    out: &mut SdkOutcome,
) {
    let servers: Vec<&OpenSandboxServer> = servers.into_iter().collect();
    report
        .samples
        .sort_by_key(|s| (SYSTEMS.iter().position(|n| *n == s.system), s.round));
    for s in &report.samples {
        // Stage ends in time order; "pings" is a count, not a time.
        let mut stages: Vec<(String, u64)> = s
            .stages
            .iter()
            .filter(|(k, _)| k.as_str() != "pings")
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        stages.sort_by_key(|(_, v)| *v);
        out.samples.push(Sample {
            scenario: SCENARIO_CREATE.into(),
            system: s.system.clone(),
            iteration: s.round,
            total_us: s.create_us,
            stages,
        });
    }
    for s in report.samples {
        out.samples.push(Sample {
            scenario: SCENARIO_KILL.into(),
            system: s.system,
            iteration: s.round,
            total_us: s.kill_us,
            stages: Vec::new(),
        });
    }
    for f in report.failures {
        let reason = format!("round {}: {}", f.round, f.reason);
        let reason = match servers.iter().find(|s| s.system == f.system) {
            Some(s) => format!("{reason}; server log: {}", s.log_tail()),
            None => reason,
        };
        out.skip(&f.system, reason);
    }
}

/// p50 ratios of the scenario against the OpenSandbox server, creates and
/// kills (issue 6's goal: sandbolt's create ≤ 0.25× the server's p50), and
/// of the limits targets against the no-limits one on the same lifecycle
/// (issue 13's goal: ≤ 1.02×), for the report's ratio list.
pub fn ratios(samples: &[Sample]) -> Vec<(String, f64)> {
    let p50 = |scenario: &str, system: &str| {
        crate::stats::summarize(
            samples
                .iter()
                .filter(|s| s.scenario == scenario && s.system == system)
                .map(|s| s.total_us),
        )
        .map(|s| s.p50_us)
    };
    let mut out = Vec::new();
    for scenario in [SCENARIO_CREATE, SCENARIO_KILL] {
        for system in [LIFECYCLE_FASTPATH, LIFECYCLE_DOCKER, OPENSANDBOX_SANDBOLT] {
            if let (Some(x), Some(y)) = (p50(scenario, system), p50(scenario, OPENSANDBOX)) {
                out.push((
                    format!("{scenario}: {system} ÷ {OPENSANDBOX}"),
                    x as f64 / y as f64,
                ));
            }
        }
        for system in [LIFECYCLE_FASTPATH_LIMITS, LIFECYCLE_FASTPATH] {
            let base = LIFECYCLE_FASTPATH_NO_LIMITS;
            if let (Some(x), Some(y)) = (p50(scenario, system), p50(scenario, base)) {
                out.push((
                    format!("{scenario}: {system} ÷ {base}"),
                    x as f64 / y as f64,
                ));
            }
        }
    }
    out
}

pub(crate) async fn start_lifecycle(
    backend: BackendConfig,
    data: &Path,
) -> Result<LifecycleHandle, String> {
    let mut config = LifecycleConfig::new("127.0.0.1:0".parse().unwrap(), backend, data);
    config.api_key = Some(API_KEY.into());
    Lifecycle::start(config).await.map_err(|e| e.to_string())
}

#[derive(serde::Deserialize)]
pub(crate) struct PyReport {
    samples: Vec<PySample>,
    failures: Vec<PyFailure>,
}

#[derive(serde::Deserialize)]
struct PySample {
    system: String,
    round: u32,
    create_us: u64,
    kill_us: u64,
    #[serde(default)]
    stages: std::collections::BTreeMap<String, u64>,
}

#[derive(serde::Deserialize)]
struct PyFailure {
    system: String,
    round: u32,
    reason: String,
}

pub(crate) async fn run_python(targets: &[Target], rounds: u32) -> Result<PyReport, String> {
    let python = tokio::task::spawn_blocking(sandbolt_testbed::python)
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("the SDK's venv: {e}"))?;
    let systems: Vec<serde_json::Value> = targets
        .iter()
        .map(|t| {
            let mut system = serde_json::json!({"name": t.name, "url": t.url, "api_key": API_KEY});
            if let Some(resource) = &t.resource {
                system["resource"] = serde_json::Value::Object(resource.clone());
            }
            if let Some(extensions) = &t.extensions {
                system["extensions"] = extensions.clone();
            }
            if let Some((pool, available)) = &t.wait_pool {
                system["wait_pool"] = serde_json::Value::from(pool.as_str());
                system["wait_available"] = serde_json::Value::from(*available);
            }
            if t.template {
                system["template"] = serde_json::Value::Bool(true);
            }
            system
        })
        .collect();
    let script = workspace_root().join("benches/python/sdk_create.py");
    let image = busybox_image().map_err(|e| e.to_string())?;
    let child = tokio::process::Command::new(&python)
        .arg(&script)
        .arg("--systems")
        .arg(serde_json::Value::Array(systems).to_string())
        .arg("--rounds")
        .arg(rounds.to_string())
        .arg("--image")
        .arg(image.reference())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("{}: {e}", python.display()))?;
    // Each create waits at most 60 s for readiness; a hung round ends the
    // scenario rather than the run.
    let limit = Duration::from_secs(120 + 90 * (rounds as u64 + 1) * targets.len() as u64);
    let output = tokio::time::timeout(limit, child.wait_with_output())
        .await
        .map_err(|_| format!("{} did not finish within {limit:?}", script.display()))?
        .map_err(|e| e.to_string())?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    for line in stderr.lines().filter(|l| l.starts_with("sdk_create:")) {
        tracing::debug!("{line}");
    }
    if !output.status.success() {
        return Err(format!(
            "{} failed ({}): {}",
            script.display(),
            output.status,
            tail(&stderr, 1500)
        ));
    }
    serde_json::from_slice(&output.stdout).map_err(|e| {
        format!(
            "{}: unreadable output ({e}): {}",
            script.display(),
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

/// The OpenSandbox server 1.1.1, a child process of the harness.
pub(crate) struct OpenSandboxServer {
    /// Its system name in the results.
    system: &'static str,
    child: tokio::process::Child,
    addr: std::net::SocketAddr,
    log: PathBuf,
}

/// What the OpenSandbox server runs sandboxes on.
pub(crate) enum ServerRuntime {
    /// Its Docker runtime on the bed's dockerd.
    Docker { socket: PathBuf },
    /// Its Kubernetes runtime: the fsb provider on sandbolt (API server at
    /// `kubeconfig`, FastPath at `fastpath`, routes signed for the gateway
    /// at `gateway`).
    Kubernetes {
        kubeconfig: PathBuf,
        fastpath: std::net::SocketAddr,
        gateway: std::net::SocketAddr,
    },
}

impl ServerRuntime {
    fn system(&self) -> &'static str {
        match self {
            ServerRuntime::Docker { .. } => OPENSANDBOX,
            ServerRuntime::Kubernetes { .. } => OPENSANDBOX_SANDBOLT,
        }
    }

    /// The server's configuration file: listening on loopback `port`,
    /// its sqlite store at `db`.
    fn config(&self, port: u16, db: &Path) -> Result<String, String> {
        match self {
            // Bridge networking with ports published on loopback, as the
            // server's own example config does (minus the public bind):
            // the endpoint of 44772 is then `127.0.0.1:<host port>/proxy/44772`.
            ServerRuntime::Docker { .. } => Ok(format!(
                r#"[server]
host = "127.0.0.1"
port = {port}
api_key = "{API_KEY}"
max_sandbox_timeout_seconds = 86400

[log]
level = "WARNING"

[store]
type = "sqlite"
path = "{db}"

[runtime]
type = "docker"
execd_image = "{EXECD_IMAGE}"

[docker]
network_mode = "bridge"
publish_host = "127.0.0.1"
port_range_min = 40000
port_range_max = 60000

[ingress]
mode = "direct"
"#,
                db = db.display(),
            )),
            ServerRuntime::Kubernetes {
                kubeconfig,
                fastpath,
                gateway,
            } => server_config_on_sandbolt(&[
                ("port", port.to_string()),
                ("api_key", API_KEY.into()),
                ("log_level", "WARNING".into()),
                ("db", db.display().to_string()),
                ("kubeconfig", kubeconfig.display().to_string()),
                ("namespace", FSB_NAMESPACE.into()),
                ("fastpath", fastpath.to_string()),
                ("gateway", gateway.to_string()),
                ("key_id", GATEWAY_KEY_ID.into()),
                ("key", GATEWAY_KEY_B64.into()),
            ]),
        }
    }
}

/// `benches/python/opensandbox-server-kubernetes.toml` (the server on
/// sandbolt, shared with the end-to-end rig) with every `{name}` replaced.
fn server_config_on_sandbolt(values: &[(&str, String)]) -> Result<String, String> {
    let path = workspace_root().join("benches/python/opensandbox-server-kubernetes.toml");
    let mut text =
        std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    for (name, value) in values {
        text = text.replace(&format!("{{{name}}}"), value);
    }
    match text.find('{') {
        Some(at) => Err(format!(
            "{}: unfilled placeholder near {:?}",
            path.display(),
            &text[at..(at + 30).min(text.len())]
        )),
        None => Ok(text),
    }
}

impl OpenSandboxServer {
    async fn start(
        bench: &Bench,
        runtime: &ServerRuntime,
        dir: &Path,
    ) -> Result<OpenSandboxServer, String> {
        // Its venv (made once, then reused).
        let exe = tokio::task::spawn_blocking(|| {
            sandbolt_testbed::opensandbox_server().map_err(|e| e.to_string())
        })
        .await
        .map_err(|e| e.to_string())??;
        if let ServerRuntime::Docker { .. } = runtime {
            let image = tokio::task::spawn_blocking(execd_image)
                .await
                .map_err(|e| e.to_string())??;
            bench
                .testbed()
                .docker_load(&image)
                .map_err(|e| format!("loading {EXECD_IMAGE} into dockerd: {e}"))?;
        }

        let home = dir.join("opensandbox-home");
        std::fs::create_dir_all(&home).map_err(|e| e.to_string())?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("picking a port: {e}"))?
            .port();
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let config = runtime.config(port, &home.join("opensandbox.db"))?;
        let config_path = dir.join("opensandbox-server.toml");
        std::fs::write(&config_path, config).map_err(|e| e.to_string())?;
        let log = dir.join("opensandbox-server.log");
        let log_file = std::fs::File::create(&log).map_err(|e| e.to_string())?;
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.arg("--config")
            .arg(&config_path)
            .current_dir(&home)
            .env("HOME", &home)
            .env_remove("KUBECONFIG")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().map_err(|e| e.to_string())?)
            .stderr(log_file)
            .kill_on_drop(true);
        if let ServerRuntime::Docker { socket } = runtime {
            cmd.env("DOCKER_HOST", format!("unix://{}", socket.display()));
        }
        let child = cmd.spawn().map_err(|e| format!("{}: {e}", exe.display()))?;
        let mut server = OpenSandboxServer {
            system: runtime.system(),
            child,
            addr,
            log,
        };
        server.wait_healthy().await?;
        Ok(server)
    }

    /// Until `/health` answers (60 s); stops it when it does not.
    async fn wait_healthy(&mut self) -> Result<(), String> {
        let addr = self.addr;
        let http = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "the server exited at startup ({status}): {}",
                    self.log_tail()
                ));
            }
            let ok = http
                .get(format!("http://{addr}/health"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
                .map(|r| r.status().is_success())
                .unwrap_or(false);
            if ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                // Dropping it (kill_on_drop) stops it.
                return Err(format!(
                    "/health did not answer within 60 s: {}",
                    self.log_tail()
                ));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        tail(&text, 1500)
    }

    async fn stop(mut self) {
        let _ = self.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
    }
}

/// The image the OpenSandbox server's Docker runtime takes execd from. The
/// server copies `/execd` and `/bootstrap.sh` out of a container of it
/// (started as `tail -f /dev/null`, hence busybox) into `/opt/opensandbox/`
/// of each sandbox, and starts the sandbox as `bootstrap.sh <entrypoint>`.
/// Its optional extras (bwrap, session gate, launcher) are absent: the
/// server logs that and goes on.
fn execd_image() -> Result<OciImage, String> {
    let execd = execd_binary().map_err(|e| format!("execd: {e}"))?;
    OciImage::builder(EXECD_IMAGE)
        .file(&execd, "/execd", 0o755)
        .bytes("/bootstrap.sh", BOOTSTRAP, 0o755)
        .file(PathBuf::from("/bin/busybox"), "/bin/busybox", 0o755)
        .symlink("/bin/sh", "/bin/busybox")
        .symlink("/bin/tail", "/bin/busybox")
        .dir_mode("/tmp", 0o1777)
        .dir("/proc")
        .dir("/sys")
        .dir("/dev")
        .cmd(["tail", "-f", "/dev/null"])
        .build()
        .map_err(|e| format!("building {EXECD_IMAGE}: {e}"))
}

fn tail(text: &str, max: usize) -> String {
    let text = text.trim();
    match text.char_indices().rev().nth(max) {
        Some((i, _)) => format!("…{}", &text[i..]),
        None => text.to_string(),
    }
}

/// The fsb provider's namespace on sandbolt (`[kubernetes] namespace`).
const FSB_NAMESPACE: &str = "opensandbox";
/// The route signing key the server and sandbolt's gateway share, in the
/// server's `kid=base64` format.
const GATEWAY_KEY_ID: &str = "k";
const GATEWAY_KEY_B64: &str = "c2FuZGJvbHQtYmVuY2gtZ2F0ZXdheS1zZWNyZXQtMDE=";
/// The controller's own namespace (its Lease) on the double.
const CONTROLLER_NAMESPACE: &str = "sandbolt-system";
/// The controller's main port token (the gateway presents it); the server
/// dials the open FastPath listener, which has none.
const CONTROLLER_TOKEN: &str = "bench-controller-token";

/// Where the bench's Kubernetes-store controller listens: `main` (agents,
/// FastPath with [`CONTROLLER_TOKEN`]) and `open` (FastPath only, no token:
/// the OpenSandbox server has no option for credentials).
#[derive(Clone, Copy)]
struct ControllerPorts {
    main: std::net::SocketAddr,
    open: std::net::SocketAddr,
}

/// The OpenSandbox server on sandbolt: the API server double (in process,
/// sandbolt's CRDs installed), a controller over the Kubernetes store (in
/// process, elected through its Lease like every `--store kubernetes`
/// replica), an agent of the bench on the bed's containerd, a lifecycle
/// serving only as the fsb gateway, and the server with its Kubernetes
/// runtime.
struct OnSandbolt {
    server: OpenSandboxServer,
    gateway: LifecycleHandle,
    agent: sandbolt_agent::AgentHandle,
    controller_stop: tokio::sync::oneshot::Sender<()>,
    controller: tokio::task::JoinHandle<()>,
    api: sandbolt_kube_double::ApiDouble,
    _dir: tempfile::TempDir,
}

impl OnSandbolt {
    async fn start(bench: &Bench, data: &Path) -> Result<OnSandbolt, String> {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let kubeconfig = dir.path().join("kubeconfig");
        let api = start_api_double(&kubeconfig).await?;
        let ports = ControllerPorts {
            main: free_loopback()?,
            open: free_loopback()?,
        };
        let agent_config = bench.agent_config("bench-agent-on-sandbolt", ports.main);
        let (controller_stop, controller) =
            start_kube_controller(&api, ports, dir.path(), &agent_config.api_token).await?;
        let agent = sandbolt_agent::Agent::start(agent_config)
            .await
            .map_err(|e| format!("agent: {e}"))?;
        wait_pool_ready(ports.open).await?;
        let mut gateway = ControllerConfig::new(format!("http://{}", ports.main));
        gateway.namespace = FSB_NAMESPACE.into();
        gateway.token = Some(CONTROLLER_TOKEN.into());
        let mut config = LifecycleConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            BackendConfig::Controller(gateway),
            data,
        );
        config.api_key = Some(API_KEY.into());
        config.gateway = Some(sandbolt_lifecycle::GatewayConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            keys: sandbolt_lifecycle::KeyRing::parse(&format!(
                "{GATEWAY_KEY_ID}={GATEWAY_KEY_B64}"
            ))
            .map_err(|e| format!("gateway keys: {e}"))?,
        });
        let gateway = Lifecycle::start(config)
            .await
            .map_err(|e| format!("lifecycle (gateway): {e}"))?;
        let runtime = ServerRuntime::Kubernetes {
            kubeconfig,
            fastpath: ports.open,
            gateway: gateway.gateway_addr().expect("the gateway serves"),
        };
        let server = OpenSandboxServer::start(bench, &runtime, dir.path()).await?;
        Ok(OnSandbolt {
            server,
            gateway,
            agent,
            controller_stop,
            controller,
            api,
            _dir: dir,
        })
    }

    async fn stop(self) {
        self.server.stop().await;
        if let Err(e) = self.gateway.shutdown().await {
            tracing::warn!(error = %e, "gateway shutdown");
        }
        self.agent.shutdown().await;
        let _ = self.controller_stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(30), self.controller).await;
        self.api.shutdown().await;
    }
}

/// The double with `deploy/crds/` installed, its kubeconfig at `kubeconfig`.
async fn start_api_double(kubeconfig: &Path) -> Result<sandbolt_kube_double::ApiDouble, String> {
    let api = sandbolt_kube_double::ApiDouble::start().await;
    let crds = workspace_root().join("deploy/crds");
    api.register_crds(&crds)
        .map_err(|e| format!("registering {}: {e}", crds.display()))?;
    api.write_kubeconfig(kubeconfig)
        .map_err(|e| format!("kubeconfig: {e}"))?;
    Ok(api)
}

/// A loopback address whose port was free a moment ago: the controller
/// must be told it (agents dial it) before it is elected and binds it.
fn free_loopback() -> Result<std::net::SocketAddr, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("picking a port: {e}"))
}

/// The controller over the Kubernetes store on `api`, on `ports`, agents
/// presenting `agent_token`; returns once it leads and serves.
async fn start_kube_controller(
    api: &sandbolt_kube_double::ApiDouble,
    ports: ControllerPorts,
    dir: &Path,
    agent_token: &str,
) -> Result<
    (
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ),
    String,
> {
    use sandbolt_controller::ha::run_on_kubernetes;
    use sandbolt_controller::leader::LeaseConfig;

    let mut config = sandbolt_controller::ControllerConfig::new(ports.main, dir, agent_token);
    config.heartbeat_interval = Duration::from_millis(500);
    config.fastpath_token = Some(CONTROLLER_TOKEN.into());
    config.open_fastpath_listen = Some(ports.open);
    let lease = LeaseConfig::new(CONTROLLER_NAMESPACE, "sandbolt-controller", "bench");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (serving_tx, serving) = tokio::sync::oneshot::channel::<()>();
    let mut serving_tx = Some(serving_tx);
    let kube = api.config();
    let task = tokio::spawn(async move {
        let on_serving = move |_: &sandbolt_controller::ControllerHandle| {
            if let Some(tx) = serving_tx.take() {
                let _ = tx.send(());
            }
        };
        let shutdown = async move {
            let _ = stopped.await;
        };
        if let Err(e) = run_on_kubernetes(config, kube, lease, on_serving, shutdown).await {
            tracing::warn!(error = %e, "the bench's Kubernetes-store controller stopped");
        }
    });
    match tokio::time::timeout(Duration::from_secs(30), serving).await {
        Ok(Ok(())) => Ok((stop, task)),
        _ => {
            task.abort();
            Err("the Kubernetes-store controller did not serve within 30 s".into())
        }
    }
}

/// Until the controller at `addr` counts a ready agent in its pool.
async fn wait_pool_ready(addr: std::net::SocketAddr) -> Result<(), String> {
    use sandbolt_proto::fastpath::v2;
    let mut client =
        v2::fast_path_service_client::FastPathServiceClient::connect(format!("http://{addr}"))
            .await
            .map_err(|e| format!("controller: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ready = client
            .get_pool(v2::GetPoolRequest {
                namespace: FSB_NAMESPACE.into(),
                pool_name: "default".into(),
            })
            .await
            .is_ok_and(|r| r.into_inner().ready_fastlets > 0);
        if ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("no agent of pool default was ready within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
