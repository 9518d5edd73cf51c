//! What the warm-pool end-to-end tests (issue 17) share: a test bed with
//! busybox and a second image that has its own `WORKDIR` and `ENV` (so
//! that what a claim applies can be told from what a warm sandbox had), a
//! real controller, a real agent, and a lifecycle on the controller
//! backend; the lifecycle's REST API (`/pools`, `/sandboxes`, execd through
//! the endpoint it resolves) as a client calls it; and the controller's
//! native API for what REST cannot say (`status.claimed_warm`, the
//! container id).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use sandbolt_e2e::bed::{NS, Native, eventually};
use sandbolt_lifecycle::{BackendConfig, Lifecycle, LifecycleConfig, LifecycleHandle};
use sandbolt_proto::control::v1 as native;
use sandbolt_testbed::{OciImage, Testbed};
use serde_json::{Value, json};

pub use super::execd;
pub use execd::Output;

pub const API_KEY: &str = "warm-e2e-api-key-0123456789";
/// The image with its own working directory and environment.
pub const APP_IMAGE: &str = "docker.io/sandbolt/warm-app:1";
pub const APP_WORKDIR: &str = "/srv/app";
pub const APP_ENV: &str = "IMAGE_ONLY=from-image";
/// How long a buffer may take to fill (one start at a time per agent,
/// paced; ~100 ms each here, far more on a loaded machine).
pub const FILLED_WITHIN: Duration = Duration::from_secs(90);
const RUNNING_WITHIN: Duration = Duration::from_secs(60);

/// [`APP_IMAGE`]: busybox (the host's static one, every applet linked)
/// with `WORKDIR` [`APP_WORKDIR`] and [`APP_ENV`].
pub fn app_image() -> OciImage {
    let list = std::process::Command::new("/bin/busybox")
        .arg("--list-full")
        .output()
        .expect("busybox --list-full (busybox-static is a test bed package)");
    let mut b = OciImage::builder(APP_IMAGE)
        .file("/bin/busybox", "/bin/busybox", 0o755)
        .bytes("/etc/passwd", "root:x:0:0:root:/root:/bin/sh\n", 0o644)
        .bytes("/etc/group", "root:x:0:\n", 0o644)
        .dir_mode("/tmp", 0o1777)
        .dir("/proc")
        .dir("/sys")
        .dir("/dev")
        .dir("/root")
        .dir(APP_WORKDIR)
        .env("PATH=/usr/sbin:/usr/bin:/sbin:/bin")
        .env(APP_ENV)
        .workdir(APP_WORKDIR)
        .cmd(["sh"]);
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let applet = applet.trim();
        if !applet.is_empty() && applet != "bin/busybox" {
            b = b.symlink(applet, "/bin/busybox");
        }
    }
    b.build().expect("the app image builds")
}

/// Imports [`app_image`] into the bed's [`NS`].
pub async fn import_app_image(bed: &Testbed) {
    tokio::task::block_in_place(|| bed.import_image(&app_image(), NS)).expect("import app image");
}

/// A lifecycle on the controller backend at `controller`.
pub async fn start_lifecycle(controller: SocketAddr, data: &Path) -> LifecycleHandle {
    let backend = sandbolt_lifecycle::ControllerConfig::new(format!("http://{controller}"));
    let mut c = LifecycleConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        BackendConfig::Controller(backend),
        data.join("lifecycle"),
    );
    c.api_key = Some(API_KEY.into());
    Lifecycle::start(c)
        .await
        .expect("lifecycle starts on the controller backend")
}

/// `POST /pools` body: one container of `image` with `limits`, `env`
/// (name → value), and the capacity spec.
pub fn pool_body(
    name: &str,
    image: &str,
    env: &[(&str, &str)],
    buffer: (i64, i64),
    pool: (i64, i64),
) -> Value {
    let env: Vec<Value> = env
        .iter()
        .map(|(k, v)| json!({ "name": k, "value": v }))
        .collect();
    json!({
        "name": name,
        "template": {
            "spec": {
                "containers": [{
                    "name": "sandbox",
                    "image": image,
                    "env": env,
                    "resources": { "limits": { "cpu": "500m", "memory": "256Mi" } },
                }],
            },
        },
        "capacitySpec": {
            "bufferMin": buffer.0, "bufferMax": buffer.1,
            "poolMin": pool.0, "poolMax": pool.1,
        },
    })
}

/// The lifecycle's REST API under `/v1`.
#[derive(Clone)]
pub struct Rest {
    base: String,
    http: reqwest::Client,
}

impl Rest {
    pub fn new(addr: SocketAddr) -> Rest {
        Rest {
            base: format!("http://{addr}/v1"),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(120))
                .build()
                .unwrap(),
        }
    }

    /// One call: status and JSON body (`Null` when empty, a string when
    /// not JSON).
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut rb = self
            .http
            .request(method.clone(), format!("{}{path}", self.base))
            .header("OPEN-SANDBOX-API-KEY", API_KEY);
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        let r = rb
            .send()
            .await
            .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
        let status = r.status();
        let text = r.text().await.unwrap();
        let v = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        (status, v)
    }

    pub async fn expect(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
        want: StatusCode,
    ) -> Value {
        let (s, v) = self.call(method.clone(), path, body).await;
        assert_eq!(s, want, "{method} {path}: {v}");
        v
    }

    /// `POST /pools`; the 201 answer.
    pub async fn create_pool(&self, body: Value) -> Value {
        self.expect(Method::POST, "/pools", Some(body), StatusCode::CREATED)
            .await
    }

    /// `GET /pools/{name}`'s `status.available` (0 when absent).
    pub async fn available(&self, pool: &str) -> i64 {
        let v = self
            .expect(Method::GET, &format!("/pools/{pool}"), None, StatusCode::OK)
            .await;
        v["status"]["available"].as_i64().unwrap_or(0)
    }

    /// Waits until the pool reports at least `n` available warm sandboxes.
    pub async fn wait_available(&self, pool: &str, n: i64, within: Duration) {
        let api = self.clone();
        eventually(&format!("warm pool {pool}: {n} available"), within, || {
            let api = api.clone();
            async move { api.available(pool).await >= n }
        })
        .await;
    }

    pub async fn delete_pool(&self, pool: &str) {
        let (s, v) = self
            .call(Method::DELETE, &format!("/pools/{pool}"), None)
            .await;
        assert!(
            s == StatusCode::NO_CONTENT || s == StatusCode::OK,
            "delete pool {pool}: {s} {v}"
        );
    }

    /// `POST /sandboxes`: the answer (202 or the refusal).
    pub async fn try_create(&self, body: Value) -> (StatusCode, Value) {
        self.call(Method::POST, "/sandboxes", Some(body)).await
    }

    /// A sandbox of `body`, once Running; its id.
    pub async fn create(&self, body: Value) -> String {
        let (s, v) = self.try_create(body.clone()).await;
        assert_eq!(s, StatusCode::ACCEPTED, "create {body}: {v}");
        let id = v["id"].as_str().expect("id").to_string();
        self.wait_running(&id).await;
        id
    }

    pub async fn get(&self, id: &str) -> Value {
        self.expect(
            Method::GET,
            &format!("/sandboxes/{id}"),
            None,
            StatusCode::OK,
        )
        .await
    }

    pub async fn wait_running(&self, id: &str) {
        let api = self.clone();
        let id = id.to_string();
        eventually(&format!("sandbox {id} running"), RUNNING_WITHIN, || {
            let (api, id) = (api.clone(), id.clone());
            async move {
                let (_, v) = api
                    .call(Method::GET, &format!("/sandboxes/{id}"), None)
                    .await;
                let state = v["status"]["state"].as_str().unwrap_or_default();
                assert_ne!(state, "Failed", "sandbox {id} failed: {v}");
                state == "Running"
            }
        })
        .await;
    }

    /// Deletes the sandbox and waits until the lifecycle no longer knows it.
    pub async fn delete(&self, id: &str) {
        let (s, v) = self
            .call(Method::DELETE, &format!("/sandboxes/{id}"), None)
            .await;
        assert!(
            s == StatusCode::NO_CONTENT || s == StatusCode::OK,
            "delete {id}: {s} {v}"
        );
        let api = self.clone();
        let id = id.to_string();
        eventually(&format!("sandbox {id} gone"), RUNNING_WITHIN, || {
            let (api, id) = (api.clone(), id.clone());
            async move {
                let (s, _) = api
                    .call(Method::GET, &format!("/sandboxes/{id}"), None)
                    .await;
                s == StatusCode::NOT_FOUND
            }
        })
        .await;
    }

    /// execd's endpoint in sandbox `id`: (`host:port/route`, headers).
    async fn execd(&self, id: &str) -> (String, Vec<(String, String)>) {
        let ep = self
            .expect(
                Method::GET,
                &format!("/sandboxes/{id}/endpoints/44772"),
                None,
                StatusCode::OK,
            )
            .await;
        execd::rest_endpoint(&ep)
    }

    /// Runs `command` with `sh -c` in sandbox `id` through execd.
    pub async fn sh(&self, id: &str, command: &str) -> Output {
        let (endpoint, headers) = self.execd(id).await;
        execd::run_command(&self.http, &endpoint, headers, id, command).await
    }

    /// stdout of a command that must succeed.
    pub async fn sh_ok(&self, id: &str, command: &str) -> String {
        let out = self.sh(id, command).await;
        assert!(out.error.is_none(), "{command:?} in {id} failed: {out:?}");
        out.stdout
    }
}

/// The controller's record of `default/<name>` (the REST id is the name).
pub async fn native_sandbox(c: &mut Native, name: &str) -> native::Sandbox {
    c.get_sandbox(native::GetSandboxRequest {
        sandbox: sandbolt_e2e::bed::native_ref(name),
    })
    .await
    .unwrap_or_else(|e| panic!("GetSandbox {name}: {e:?}"))
    .into_inner()
}

/// (claimed_warm, container id, warm pool) of `default/<name>`.
pub async fn claim_of(c: &mut Native, name: &str) -> (bool, String, String) {
    let s = native_sandbox(c, name).await;
    let status = s.status.unwrap_or_default();
    (
        status.claimed_warm,
        status.container_id,
        s.spec.map(|s| s.warm_pool).unwrap_or_default(),
    )
}

/// A bed with busybox and [`APP_IMAGE`], an in-process controller, one
/// in-process agent (`agent-warm`, no sandbox networking) and a lifecycle
/// in front of the controller.
pub struct WarmEnv {
    pub bed: Testbed,
    pub ctl: Option<sandbolt_controller::ControllerHandle>,
    pub agent: Option<sandbolt_agent::AgentHandle>,
    pub lifecycle: Option<LifecycleHandle>,
    pub api: Rest,
    pub native: Native,
    pub dir: tempfile::TempDir,
}

pub const TOKEN: &str = "warm-e2e-token";

impl WarmEnv {
    pub async fn start() -> WarmEnv {
        use sandbolt_e2e::bed::{agent_config, connect, start_bed, wait_agents};
        let bed = start_bed().await;
        import_app_image(&bed).await;
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = sandbolt_controller::ControllerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            dir.path(),
            TOKEN,
        );
        cfg.heartbeat_interval = Duration::from_millis(200);
        let ctl = sandbolt_controller::Controller::start(cfg)
            .await
            .expect("controller starts");
        let addr = ctl.local_addr();
        let state = bed.root().join("agent-warm-state");
        let mut acfg = agent_config(&bed, "agent-warm", &state, addr, TOKEN);
        acfg.heartbeat_interval = Duration::from_millis(200);
        acfg.max_sandboxes = 16;
        let agent = sandbolt_agent::Agent::start(acfg)
            .await
            .expect("agent starts");
        wait_agents(&connect(addr).await, 1).await;
        let lifecycle = start_lifecycle(addr, dir.path()).await;
        let api = Rest::new(lifecycle.addr());
        let native = Native::connect(format!("http://{addr}"))
            .await
            .expect("native API");
        WarmEnv {
            bed,
            ctl: Some(ctl),
            agent: Some(agent),
            lifecycle: Some(lifecycle),
            api,
            native,
            dir,
        }
    }

    /// Container ids in the bed's [`NS`].
    pub async fn containers(&self) -> Vec<String> {
        sandbolt_e2e::bed::containers(&self.bed).await
    }

    /// Deletes `pool`, waits until its warm sandboxes are drained (no
    /// container left), stops everything, and checks that the bed left
    /// nothing behind (its teardown's own check, limited to this bed).
    pub async fn stop(mut self, pool: &str) {
        self.api.delete_pool(pool).await;
        let bed = &self.bed;
        eventually(
            "every warm sandbox drained after the pool's delete",
            FILLED_WITHIN,
            || async { sandbolt_e2e::bed::containers(bed).await.is_empty() },
        )
        .await;
        if let Some(l) = self.lifecycle.take() {
            l.shutdown().await.expect("lifecycle stops");
        }
        if let Some(a) = self.agent.take() {
            a.shutdown().await;
        }
        if let Some(c) = self.ctl.take() {
            c.shutdown().await;
        }
        drop_bed_checked(self.bed).await;
    }
}

/// Active (writable) snapshots in the bed's [`NS`]: a container's rootfs
/// that outlived it.
pub async fn active_snapshots(bed: &Testbed) -> Vec<String> {
    let out = tokio::task::block_in_place(|| bed.ctr_output(NS, &["snapshots", "ls"]))
        .expect("ctr snapshots ls");
    out.lines()
        .skip(1)
        .filter(|l| l.split_whitespace().last() == Some("Active"))
        .map(String::from)
        .collect()
}

/// Checks that no container and no active snapshot is left in the bed,
/// tears it down, and checks that nothing of it (directory, mount, loop
/// device, process) survives.
pub async fn drop_bed_checked(bed: Testbed) {
    let left = sandbolt_e2e::bed::containers(&bed).await;
    assert!(left.is_empty(), "containers left: {left:?}");
    let snaps = active_snapshots(&bed).await;
    assert!(snaps.is_empty(), "active snapshots left: {snaps:?}");
    let dir = bed.root().display().to_string();
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
    let left: Vec<String> = sandbolt_testbed::leftovers()
        .into_iter()
        .filter(|l| l.contains(&dir))
        .collect();
    assert!(left.is_empty(), "the bed left: {left:?}");
}

/// Runs `py_test` (a file of `tests/python`) with pytest against the
/// lifecycle at `addr`, with `env` added; panics with its output when it
/// fails.
pub fn run_pytest(py_test: &str, addr: SocketAddr, env: &[(&str, String)]) {
    let python =
        sandbolt_testbed::python().expect("the repo's venv python (scripts/python-env.sh)");
    let root = sandbolt_testbed::workspace_root();
    let path = root.join("tests/python").join(py_test);
    assert!(path.is_file(), "missing {}", path.display());
    let mut cmd = std::process::Command::new(python);
    cmd.args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "-x"])
        .arg(&path)
        .env("PYTHONPATH", root.join("tests/python"))
        .env("LIFECYCLE_DOMAIN", addr.to_string())
        .env("LIFECYCLE_API_KEY", API_KEY);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("pytest runs");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "pytest {py_test} failed:\n{text}");
}
