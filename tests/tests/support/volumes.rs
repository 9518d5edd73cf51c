//! What the named-volume end-to-end tests share: a real controller, a real
//! agent whose volume pool is a loop-backed btrfs image in the test bed's
//! private directory, and a lifecycle on the controller backend, all
//! driven through the lifecycle's REST API as a client drives them; plus
//! commands run inside sandboxes through execd (the route a client takes)
//! and looks at the pool from the host (`btrfs` itself).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use sandbolt_agent::{Agent, AgentHandle};
use sandbolt_controller::{Controller, ControllerConfig, ControllerHandle};
use sandbolt_e2e::bed::*;
use sandbolt_lifecycle::{BackendConfig, Lifecycle, LifecycleConfig, LifecycleHandle};
use sandbolt_testbed::Testbed;
use serde_json::{Value, json};

pub use super::execd;
pub use execd::Output;

pub const TOKEN: &str = "volumes-e2e-token";
pub const API_KEY: &str = "volumes-e2e-api-key-0123456789";
/// The agents' loop-backed pool: sparse, so only what is written costs.
pub const POOL_SIZE: u64 = 8 << 30;
const RUNNING_WITHIN: Duration = Duration::from_secs(60);

/// A bed with one controller, one agent with a btrfs volume pool and a
/// lifecycle in front of the controller.
pub struct VolEnv {
    pub bed: Testbed,
    pub ctl: Option<ControllerHandle>,
    pub agent: Option<AgentHandle>,
    pub lifecycle: Option<LifecycleHandle>,
    pub api: Rest,
    /// The agent's volume root (the mounted btrfs pool).
    pub root: PathBuf,
    pub controller_dir: tempfile::TempDir,
}

impl VolEnv {
    /// Bed, in-process controller, agent `agent-vol` with a btrfs pool, and
    /// a lifecycle; waits until the agent is a ready member of the pool.
    pub async fn start() -> VolEnv {
        let bed = start_bed().await;
        let controller_dir = tempfile::tempdir().unwrap();
        let mut cfg =
            ControllerConfig::new("127.0.0.1:0".parse().unwrap(), controller_dir.path(), TOKEN);
        cfg.heartbeat_interval = Duration::from_millis(200);
        let ctl = Controller::start(cfg).await.expect("controller starts");
        let addr = ctl.local_addr();
        let (agent, root) = start_volume_agent(&bed, "agent-vol", addr).await;
        wait_agents(&connect(addr).await, 1).await;
        let lifecycle = start_lifecycle(&format!("http://{addr}"), controller_dir.path()).await;
        let api = Rest::new(lifecycle.addr());
        VolEnv {
            bed,
            ctl: Some(ctl),
            agent: Some(agent),
            lifecycle: Some(lifecycle),
            api,
            root,
            controller_dir,
        }
    }

    /// Stops lifecycle, agent and controller, then the bed (which
    /// unmounts the pool and detaches its loop device), and checks that
    /// nothing of the bed is left mounted or attached.
    pub async fn stop(mut self) {
        if let Some(l) = self.lifecycle.take() {
            l.shutdown().await.expect("lifecycle stops");
        }
        if let Some(a) = self.agent.take() {
            a.shutdown().await;
        }
        if let Some(c) = self.ctl.take() {
            c.shutdown().await;
        }
        drop_bed(self.bed).await;
    }

    /// The host path of a volume's data (design layout).
    pub fn data(&self, volume: &str) -> PathBuf {
        self.root.join("volumes").join(volume).join("data")
    }
}

/// Tears `bed` down and asserts that no loop device backed by a file in its
/// directory and no mount below it is left: the pool's image, its mount,
/// and every volume mount made from it are gone.
pub async fn drop_bed(bed: Testbed) {
    let dir = bed.root().display().to_string();
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
    let loops: Vec<String> = std::fs::read_dir("/sys/block")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("loop/backing_file")).ok())
        .filter(|f| f.starts_with(&format!("{dir}/")))
        .collect();
    assert!(loops.is_empty(), "loop devices of the bed left: {loops:?}");
    let mounts: Vec<String> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.split(' ').nth(4).is_some_and(|p| p.starts_with(&dir)))
        .map(String::from)
        .collect();
    assert!(mounts.is_empty(), "mounts of the bed left: {mounts:?}");
}

/// A real agent `id` on `bed` heartbeating to the controller at
/// `controller`, with a loop-backed btrfs volume pool in the bed's
/// directory; returns it and its volume root.
pub async fn start_volume_agent(
    bed: &Testbed,
    id: &str,
    controller: std::net::SocketAddr,
) -> (AgentHandle, PathBuf) {
    let state = bed.root().join(format!("{id}-state"));
    let mut cfg = agent_config(bed, id, &state, controller, TOKEN);
    cfg.heartbeat_interval = Duration::from_millis(200);
    cfg.max_sandboxes = 16;
    let volumes = loop_btrfs_volumes(bed, id, POOL_SIZE);
    let root = volumes.root.clone();
    cfg.volumes = Some(volumes);
    let agent = Agent::start(cfg)
        .await
        .expect("agent with a btrfs volume pool starts");
    (agent, root)
}

/// A lifecycle on the controller backend at `controller` (no token: the
/// test controllers run without one).
pub async fn start_lifecycle(controller: &str, data: &Path) -> LifecycleHandle {
    let backend = sandbolt_lifecycle::ControllerConfig::new(controller);
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

/// The lifecycle's REST API, as a client calls it (under `/v1`).
#[derive(Clone)]
pub struct Rest {
    base: String,
    http: reqwest::Client,
}

/// A `pvc` volume of a create or attach: `claim` mounted at `mount`.
pub fn pvc(name: &str, claim: &str, mount: &str, read_only: bool, extra: Value) -> Value {
    let mut p = json!({ "claimName": claim });
    if let (Some(p), Some(extra)) = (p.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            p.insert(k.clone(), v.clone());
        }
    }
    json!({ "name": name, "mountPath": mount, "readOnly": read_only, "pvc": p })
}

impl Rest {
    pub fn new(addr: std::net::SocketAddr) -> Rest {
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

    /// A call that must answer `want`; its body.
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

    /// `POST /volumes`.
    pub async fn create_volume(&self, body: Value) -> Value {
        self.expect(Method::POST, "/volumes", Some(body), StatusCode::CREATED)
            .await
    }

    pub async fn volume(&self, name: &str) -> (StatusCode, Value) {
        self.call(Method::GET, &format!("/volumes/{name}"), None)
            .await
    }

    /// `POST /volumes/{name}/fork`.
    pub async fn fork(&self, source: &str, body: Value) -> (StatusCode, Value) {
        self.call(Method::POST, &format!("/volumes/{source}/fork"), Some(body))
            .await
    }

    /// `POST /volumes/{name}/snapshots`.
    pub async fn snapshot(&self, volume: &str, name: &str) -> (StatusCode, Value) {
        self.call(
            Method::POST,
            &format!("/volumes/{volume}/snapshots"),
            Some(json!({ "name": name })),
        )
        .await
    }

    /// `POST /volumes/{name}/restore`.
    pub async fn restore(&self, volume: &str, snapshot: &str) -> (StatusCode, Value) {
        self.call(
            Method::POST,
            &format!("/volumes/{volume}/restore"),
            Some(json!({ "snapshot": snapshot })),
        )
        .await
    }

    pub async fn delete_volume(&self, name: &str) -> (StatusCode, Value) {
        self.call(Method::DELETE, &format!("/volumes/{name}"), None)
            .await
    }

    /// `POST /sandboxes` with `volumes`: the answer (202 or the refusal).
    pub async fn try_create(&self, volumes: Value) -> (StatusCode, Value) {
        let body = json!({
            "image": { "uri": sandbolt_testbed::BUSYBOX_REF },
            "entrypoint": ["sleep", "3600"],
            "timeout": 3600,
            "resourceLimits": {},
            "volumes": volumes,
        });
        self.call(Method::POST, "/sandboxes", Some(body)).await
    }

    /// A sandbox with `volumes`, once it is Running; its id.
    pub async fn create(&self, volumes: Value) -> String {
        let (s, v) = self.try_create(volumes.clone()).await;
        assert_eq!(s, StatusCode::ACCEPTED, "create with {volumes}: {v}");
        let id = v["id"].as_str().expect("id").to_string();
        self.wait_running(&id).await;
        id
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
                let state = v["status"]["state"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                assert_ne!(state, "Failed", "sandbox {id} failed: {v}");
                state == "Running"
            }
        })
        .await;
    }

    /// Deletes the sandbox and waits until the lifecycle no longer knows it
    /// (its mounts released).
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

    /// `POST /sandboxes/{id}/volumes`.
    pub async fn attach(&self, id: &str, volume: Value) -> (StatusCode, Value) {
        self.call(
            Method::POST,
            &format!("/sandboxes/{id}/volumes"),
            Some(volume),
        )
        .await
    }

    /// `DELETE /sandboxes/{id}/volumes/{name}`.
    pub async fn detach(&self, id: &str, name: &str) -> (StatusCode, Value) {
        self.call(
            Method::DELETE,
            &format!("/sandboxes/{id}/volumes/{name}"),
            None,
        )
        .await
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

    /// Uploads `data` to `path` in sandbox `id` through execd's
    /// `/files/upload`: (status, body).
    pub async fn upload(&self, id: &str, path: &str, data: Vec<u8>) -> (StatusCode, String) {
        let (endpoint, headers) = self.execd(id).await;
        let meta =
            reqwest::multipart::Part::bytes(serde_json::to_vec(&json!({ "path": path })).unwrap())
                .file_name("metadata")
                .mime_str("application/json")
                .unwrap();
        let file = reqwest::multipart::Part::bytes(data).file_name("file");
        let form = reqwest::multipart::Form::new()
            .part("metadata", meta)
            .part("file", file);
        let mut rb = self.http.post(format!("http://{endpoint}/files/upload"));
        for (k, v) in &headers {
            rb = rb.header(k, v);
        }
        let r = rb.multipart(form).send().await.expect("execd answers");
        (r.status(), r.text().await.unwrap_or_default())
    }
}

/// A command on the host that must succeed; its stdout.
pub fn host(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `btrfs filesystem du -s --raw`: (total, exclusive) bytes of `path`.
pub fn btrfs_du(path: &Path) -> (u64, u64) {
    let out = host(
        Command::new("btrfs")
            .args(["filesystem", "du", "-s", "--raw"])
            .arg(path),
    );
    // "     Total   Exclusive  Set shared  Filename" then one line.
    let line = out
        .lines()
        .nth(1)
        .unwrap_or_else(|| panic!("btrfs filesystem du: {out}"));
    let cols: Vec<u64> = line
        .split_whitespace()
        .take(2)
        .map(|c| {
            c.parse()
                .unwrap_or_else(|_| panic!("btrfs du column {c:?}: {out}"))
        })
        .collect();
    (cols[0], cols[1])
}

/// Bytes allocated to data on the btrfs filesystem at `path` (after a
/// sync, so delayed allocation is counted): `btrfs filesystem usage -b`.
pub fn btrfs_data_used(path: &Path) -> u64 {
    host(Command::new("btrfs").args(["filesystem", "sync"]).arg(path));
    let out = host(
        Command::new("btrfs")
            .args(["filesystem", "usage", "-b"])
            .arg(path),
    );
    // "Data,single: Size:1234, Used:5678 (..%)"
    out.lines()
        .find(|l| l.trim_start().starts_with("Data,"))
        .and_then(|l| l.split("Used:").nth(1))
        .and_then(|u| u.split([',', ' ', '\t']).find(|s| !s.is_empty()))
        .and_then(|u| u.parse().ok())
        .unwrap_or_else(|| panic!("no data usage in: {out}"))
}

/// The subvolume paths of the btrfs filesystem at `path`, relative to its
/// top level (`btrfs subvolume list`).
pub fn subvolumes(path: &Path) -> Vec<String> {
    let out = host(Command::new("btrfs").args(["subvolume", "list"]).arg(path));
    out.lines()
        .filter_map(|l| l.split(" path ").nth(1))
        .map(|p| p.trim().to_string())
        .collect()
}

/// A volume's `usedBytes` from its REST answer.
pub fn used_bytes(v: &Value) -> i64 {
    v["usedBytes"]
        .as_i64()
        .unwrap_or_else(|| panic!("no usedBytes in {v}"))
}

/// Whether an error body names `words` (the lifecycle's error body is
/// `{code, message}`).
pub fn names(v: &Value, words: &[&str]) -> bool {
    let text = v.to_string();
    words.iter().all(|w| text.contains(w))
}
