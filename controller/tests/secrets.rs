//! Secrets at rest: a sandbox's access token is derived from the
//! controller's key, never stored, and env values marked secret are stored
//! sealed, never in a resource, an API answer or a log line. Checked on the
//! raw redb file with a real agent on the test bed (execd still answers the
//! derived token after a controller restart, and sees the secret value), and
//! on the `Sandbox` resources of the Kubernetes API double.

use crate::support;

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sandbolt_agent::{Agent, AgentConfig};
use sandbolt_controller::{Controller, ControllerConfig, ControllerHandle};
use sandbolt_proto::control::v1 as native;
use sandbolt_test_support::eventually_async;
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};
use support::{sandbox_request, sref, with_spec};
use tonic::Code;
use tonic::transport::Channel;

type Native = native::sandbox_service_client::SandboxServiceClient<Channel>;

const TOKEN: &str = "secrets-test-agent-token";
const WAIT: Duration = Duration::from_secs(60);

/// Every log line of this process (the test's own subscriber, DEBUG for
/// sandbolt's crates), to look for secrets in.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn install() -> Captured {
        let c = Captured::default();
        let writer = c.clone();
        tracing_subscriber::fmt()
            .with_env_filter("sandbolt_controller=debug,sandbolt_agent=debug,sandbolt_node=debug")
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .try_init()
            .expect("the test's own subscriber");
        c
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// A secret unlike anything else in the process.
fn secret() -> String {
    format!("s3cret-{}", uuid::Uuid::new_v4().simple())
}

/// A busybox sandbox that writes its env to a file execd can serve, with
/// `PLAIN` in the clear and `SECRET` marked secret.
fn create_with_secret(name: &str, value: &str) -> native::CreateSandboxRequest {
    let mut q = with_spec(sandbox_request(name, Vec::new()), |s| {
        s.command = vec![
            "sh".into(),
            "-c".into(),
            "echo \"$PLAIN/$SECRET\" > /tmp/env; exec sleep 600".into(),
        ];
        s.env.insert("PLAIN".into(), "visible".into());
        s.env.insert("SECRET".into(), value.into());
        s.secret_env_names = vec!["SECRET".into()];
    });
    q.wait_ready = true;
    q
}

async fn resolve(c: &mut Native, name: &str) -> native::Endpoint {
    c.resolve_endpoint(native::ResolveEndpointRequest {
        sandbox: sref(name),
        port: u32::from(sandbolt_proto::wire::EXECD_PORT),
    })
    .await
    .unwrap()
    .into_inner()
}

fn headers(ep: &native::Endpoint) -> Vec<(String, String)> {
    ep.headers
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

fn token_of(ep: &native::Endpoint) -> String {
    let t = ep.headers["X-Sandbolt-Access-Token"].clone();
    assert_eq!(t.len(), 32, "{ep:?}");
    t
}

fn controller_config(dir: &Path, port: u16) -> ControllerConfig {
    let mut c = ControllerConfig::new(([127, 0, 0, 1], port).into(), dir, TOKEN);
    c.heartbeat_interval = Duration::from_millis(200);
    c.startup_grace = Duration::from_secs(5);
    c
}

fn agent_config(bed: &Testbed, state: &Path, port: u16) -> AgentConfig {
    let execd = execd_binary().expect("static execd binary");
    let mut cfg = AgentConfig::new("a1", bed.containerd_socket(), execd, state, TOKEN);
    cfg.node_name = "node-a1".into();
    cfg.controller_endpoint = Some(format!("http://127.0.0.1:{port}"));
    cfg.controller_token = Some(TOKEN.into());
    cfg.heartbeat_interval = Duration::from_millis(200);
    cfg.stop_grace_period = Duration::from_secs(1);
    cfg
}

async fn started(dir: &Path, port: u16) -> (ControllerHandle, Native) {
    let ctl = Controller::start(controller_config(dir, port))
        .await
        .unwrap();
    let c = Native::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap();
    (ctl, c)
}

/// What execd serves of `path` through the agent's proxy with `ep`'s headers.
async fn download(ep: &native::Endpoint, path: &str) -> (u16, String) {
    sandbolt_test_support::http::get(
        &ep.endpoint,
        &format!("/files/download?path={path}"),
        &headers(ep),
    )
    .await
}

/// redb and a real agent: the record file holds neither the token nor the
/// secret; execd got both; a restarted controller derives the same token,
/// which execd still takes; no log line carries the secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redb_holds_no_token_or_secret_and_the_derived_token_survives_a_restart() {
    let logs = Captured::install();
    let bed = tokio::task::spawn_blocking(|| {
        let bed = Testbed::start().expect("test bed (private containerd) must start");
        bed.import_image(&busybox_image().expect("busybox image"), "k8s.io")
            .expect("import busybox");
        bed
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let port = sandbolt_test_support::free_port();
    let (ctl, mut c) = started(dir.path(), port).await;
    let state = tempfile::tempdir().unwrap();
    let agent = Agent::start(agent_config(&bed, state.path(), port))
        .await
        .expect("agent starts");
    let value = secret();

    // A secret name that is not in env is refused, naming it.
    let mut bad = create_with_secret("bad", &value);
    bad.spec.as_mut().unwrap().secret_env_names = vec!["MISSING".into()];
    let e = c.create_sandbox(bad).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("MISSING"), "{e:?}");

    eventually_async("the agent registered", WAIT, || {
        let mut c = c.clone();
        let value = value.clone();
        async move {
            c.create_sandbox(create_with_secret("s1", &value))
                .await
                .ok()
        }
    })
    .await;
    let ep = resolve(&mut c, "s1").await;
    let token = token_of(&ep);
    let (status, body) = download(&ep, "/tmp/env").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body.trim(), format!("visible/{value}"), "execd's env");

    // Answers leave the value out and name the secret.
    let got = c
        .get_sandbox(native::GetSandboxRequest {
            sandbox: sref("s1"),
        })
        .await
        .unwrap()
        .into_inner();
    let spec = got.spec.clone().unwrap();
    assert_eq!(spec.env.get("PLAIN").map(String::as_str), Some("visible"));
    assert!(!spec.env.contains_key("SECRET"), "{spec:?}");
    assert_eq!(spec.secret_env_names, ["SECRET"]);
    assert!(!format!("{got:?}").contains(&value));

    // The record file, read raw with the controller stopped.
    ctl.shutdown().await;
    let raw = std::fs::read(dir.path().join("controller.redb")).unwrap();
    let raw = String::from_utf8_lossy(&raw);
    assert!(raw.contains("visible"), "the record is in this file");
    assert!(!raw.contains(&token), "the access token is stored");
    assert!(!raw.contains(&value), "the secret env value is stored");

    // Restarted on the same data dir (and key): same token, and execd,
    // which never restarted, takes it.
    let (ctl, mut c) = started(dir.path(), port).await;
    let ep = eventually_async("the restarted controller routes s1", WAIT, || {
        let mut c = c.clone();
        async move {
            c.resolve_endpoint(native::ResolveEndpointRequest {
                sandbox: sref("s1"),
                port: u32::from(sandbolt_proto::wire::EXECD_PORT),
            })
            .await
            .ok()
            .map(|r| r.into_inner())
        }
    })
    .await;
    assert_eq!(token_of(&ep), token, "the derived token changed");
    let (status, body) = download(&ep, "/tmp/env").await;
    assert_eq!(status, 200, "{body}");
    // A wrong token is still refused (the route checks it).
    let mut wrong = headers(&ep);
    for (_, v) in &mut wrong {
        *v = "0".repeat(32);
    }
    let (status, _) =
        sandbolt_test_support::http::get(&ep.endpoint, "/files/download?path=/tmp/env", &wrong)
            .await;
    assert_ne!(status, 200);

    c.delete_sandbox(native::DeleteSandboxRequest {
        sandbox: sref("s1"),
    })
    .await
    .unwrap();
    agent.shutdown().await;
    ctl.shutdown().await;
    let text = logs.text();
    assert!(text.contains("s1"), "logs were captured");
    assert!(
        !text.contains(&value),
        "a log line carries the secret env value"
    );
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}

/// Kubernetes store (API double, stand-in agent): neither the token nor the
/// secret value is in the `Sandbox` resource, annotations included; the
/// agent's create call carries both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_resources_hold_no_token_or_secret() {
    let bed = support::kube_bed::start("default", |_, _| {}).await;
    let mut c = Native::connect(format!("http://{}", bed.controller.local_addr()))
        .await
        .unwrap();
    let value = secret();
    eventually_async("the stand-in agent registered", WAIT, || {
        let mut c = c.clone();
        let value = value.clone();
        async move {
            c.create_sandbox(create_with_secret("k1", &value))
                .await
                .ok()
        }
    })
    .await;
    let ep = resolve(&mut c, "k1").await;
    let token = token_of(&ep);
    let sent = {
        let specs = bed.agent.state.specs.lock();
        specs.values().find(|s| s.name == "k1").cloned().unwrap()
    };
    assert_eq!(sent.access_token, token, "the agent got the routed token");
    assert_eq!(sent.envs["SECRET"], value, "the agent got the secret");
    let obj = bed.sandboxes.get("k1").await.unwrap();
    let json = serde_json::to_string(&obj).unwrap();
    assert!(json.contains("visible"), "{json}");
    assert!(
        !json.contains(&token),
        "the token is in the resource: {json}"
    );
    assert!(
        !json.contains(&value),
        "the secret is in the resource: {json}"
    );
}
