//! The agent-pod rule with real components: a controller, two agents and the
//! janitor on the test bed's containerd, and the agent pods in an in-process
//! Kubernetes API double (`sandbolt-kube-double`), read through a real
//! `kube::Client`.
//!
//! Both agents stay registered and heartbeating and every sandbox keeps its
//! record, so the controller alone would never reap anything here: whatever
//! the janitor removes, it removes by the agent-pod rule.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use sandbolt_agent::{Agent, AgentConfig, AgentHandle, labels};
use sandbolt_controller::{Consistency, Controller, ControllerConfig, ControllerHandle};
use sandbolt_janitor::{
    AgentPods, ControllerOwnership, Janitor, JanitorConfig, KeepReason, OwnershipSource,
    ReapReason, ScanReport,
};
use sandbolt_kube_double::ApiDouble;
use sandbolt_proto::fastpath::v2 as fp;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use sandbolt_testbed::Testbed;
use serde_json::json;

const NS: &str = "k8s.io";
const TOKEN: &str = "janitor-agent-pods-token";
const NODE: &str = "node-p";
const POD_NS: &str = "sandbolt";
const SELECTOR: &str = "app.kubernetes.io/component=agent";
const HB: Duration = Duration::from_millis(100);
/// Short, so the test does not wait long; the first scan still falls
/// inside it.
const GRACE: Duration = Duration::from_secs(2);

type V2 = FastPathServiceClient<tonic::transport::Channel>;

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("sandbolt_janitor=info")
        .with_test_writer()
        .try_init();
}

async fn start_bed() -> Testbed {
    tokio::task::spawn_blocking(|| {
        let bed = Testbed::start().expect("test bed (private containerd) must start");
        bed.import_image(
            &sandbolt_testbed::busybox_image().expect("busybox image"),
            NS,
        )
        .expect("import busybox");
        bed
    })
    .await
    .unwrap()
}

async fn start_controller(data: &std::path::Path) -> ControllerHandle {
    let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), data, TOKEN);
    cfg.default_consistency = Consistency::Strong;
    cfg.heartbeat_interval = HB;
    cfg.failpoint = None;
    Controller::start(cfg).await.expect("controller starts")
}

/// An agent in its own pool (placement is then deterministic) on [`NODE`],
/// running in the agent pod `pod_uid`.
async fn start_agent(
    bed: &Testbed,
    id: &str,
    pod_uid: &str,
    state: &std::path::Path,
    ctl: &ControllerHandle,
) -> AgentHandle {
    let execd = sandbolt_testbed::execd_binary().expect("static execd binary");
    let mut cfg = AgentConfig::new(id, bed.containerd_socket(), execd, state, TOKEN);
    cfg.node_name = NODE.into();
    cfg.pool = id.into();
    cfg.pod_uid = Some(pod_uid.into());
    cfg.controller_endpoint = Some(format!("http://{}", ctl.local_addr()));
    cfg.controller_token = Some(TOKEN.into());
    cfg.heartbeat_interval = HB;
    cfg.stop_grace_period = Duration::from_secs(1);
    Agent::start(cfg).await.expect("agent starts")
}

/// An agent pod on `node` as the DaemonSet makes it (the API double sets
/// the UID); returns the UID.
async fn create_agent_pod(pods: &Api<Pod>, name: &str, node: &str) -> String {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/component": "agent"},
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "agent", "image": "sandbolt:test"}],
        },
    }))
    .unwrap();
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create pod")
        .metadata
        .uid
        .expect("the API sets a uid")
}

/// What the kubelet reports once the agent's readiness probe passes.
async fn set_ready(pods: &Api<Pod>, name: &str) {
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
        }})),
    )
    .await
    .expect("patch pod status");
}

async fn create_sandbox(v2: &mut V2, name: &str, pool: &str) -> String {
    v2.create_sandbox(fp::CreateSandboxRequest {
        request_id: name.into(),
        image: "busybox".into(),
        pool_ref: pool.into(),
        command: vec!["sleep".into(), "100000".into()],
        completion: fp::CreateCompletion::Ready as i32,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("create {name}: {e:?}"));
    v2.get_sandbox_diagnostics(fp::SandboxDiagnosticsRequest {
        sandbox_name: name.into(),
        namespace: "default".into(),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("diagnostics of {name}: {e:?}"))
    .into_inner()
    .runtime_instance_id
}

/// Waits until the controller answers `ready` (every agent it knows has
/// heartbeated), so agent liveness rules apply from the first scan.
async fn wait_controller_ready(janitor: &Janitor) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = janitor.scan_once().await.expect("scan");
        if r.controller_ready {
            return;
        }
        assert!(Instant::now() < deadline, "controller never ready: {r:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn ctr(bed: &Testbed, args: &[&str]) -> String {
    let out = bed.ctr(NS).args(args).output().expect("ctr runs");
    assert!(
        out.status.success(),
        "ctr {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn pod_label(bed: &Testbed, id: &str) -> String {
    let info: serde_json::Value =
        serde_json::from_str(&ctr(bed, &["containers", "info", id])).unwrap();
    info["Labels"][labels::AGENT_POD_UID]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn running(bed: &Testbed, id: &str) -> bool {
    ctr(bed, &["tasks", "list"])
        .lines()
        .any(|l| l.starts_with(id) && l.contains("RUNNING"))
}

fn exists(bed: &Testbed, id: &str) -> bool {
    ctr(bed, &["containers", "list", "-q"])
        .lines()
        .any(|l| l.trim() == id)
}

fn kept(r: &ScanReport, id: &str) -> Option<KeepReason> {
    r.kept_reason(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_whose_agent_pod_left_the_node_is_reaped_and_only_then() {
    init_tracing();
    let bed = start_bed().await;
    let dir = tempfile::tempdir().unwrap();
    let api = ApiDouble::start().await;
    let pods: Api<Pod> = Api::namespaced(api.client(), POD_NS);

    // Pods "agent-x" and "agent-y" run the two agents; "agent-new" is the
    // pod that replaces "agent-x" later. None is Ready yet, and an agent
    // pod of another node is Ready (it must not count).
    let uid_x = create_agent_pod(&pods, "agent-x", NODE).await;
    let uid_y = create_agent_pod(&pods, "agent-y", NODE).await;
    create_agent_pod(&pods, "agent-new", NODE).await;
    create_agent_pod(&pods, "agent-elsewhere", "node-other").await;
    set_ready(&pods, "agent-elsewhere").await;

    let ctl = start_controller(&dir.path().join("controller")).await;
    let ax = start_agent(&bed, "ax", &uid_x, &dir.path().join("ax"), &ctl).await;
    let ay = start_agent(&bed, "ay", &uid_y, &dir.path().join("ay"), &ctl).await;
    let mut v2 = V2::connect(format!("http://{}", ctl.local_addr()))
        .await
        .unwrap();
    let owner = ControllerOwnership::new(
        &format!("http://{}", ctl.local_addr()),
        TOKEN,
        Duration::from_secs(5),
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = owner.ownership(NODE, &[]).await
            && ["ax", "ay"]
                .iter()
                .all(|id| r.agents.iter().any(|a| a.agent_id == *id && a.alive()))
        {
            break;
        }
        assert!(Instant::now() < deadline, "agents never heartbeated");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let gone = create_sandbox(&mut v2, "on-x", "ax").await;
    let stays = create_sandbox(&mut v2, "on-y", "ay").await;
    assert_eq!(pod_label(&bed, &gone), uid_x);
    assert_eq!(pod_label(&bed, &stays), uid_y);

    let mut cfg = JanitorConfig::new(
        NODE,
        bed.containerd_socket(),
        format!("http://{}", ctl.local_addr()),
        TOKEN,
        dir.path().join("janitor"),
    );
    cfg.containerd_namespace = NS.into();
    cfg.grace_period = GRACE;
    cfg.interval = Duration::from_secs(3600);
    cfg.failpoint = None;
    let agent_pods = AgentPods::new(api.client(), POD_NS, SELECTOR, Duration::from_secs(2));
    let janitor = Janitor::new(cfg.clone())
        .await
        .expect("janitor starts")
        .with_agent_pods(agent_pods);
    // The same janitor without the Kubernetes API: the control.
    let blind = Janitor::new(cfg).await.expect("janitor starts");

    // Pod "agent-x" is deleted (its agent, in this test, runs on: the
    // controller keeps seeing it alive) and "agent-new" turns Ready.
    pods.delete("agent-x", &DeleteParams::default())
        .await
        .expect("delete pod");
    set_ready(&pods, "agent-new").await;

    // Inside the grace period nothing is touched.
    wait_controller_ready(&janitor).await;
    let r = janitor.scan_once().await.expect("scan");
    assert!(r.reaped.is_empty(), "{r:?}");
    assert_eq!(kept(&r, &gone), Some(KeepReason::Young), "{r:?}");

    tokio::time::sleep(GRACE + Duration::from_millis(200)).await;

    // Without the pod list, both sandboxes are owned: record live, agent
    // heartbeating.
    let r = blind.scan_once().await.expect("scan");
    assert!(r.reaped.is_empty(), "{r:?}");
    assert_eq!(kept(&r, &gone), Some(KeepReason::Owned), "{r:?}");
    assert_eq!(kept(&r, &stays), Some(KeepReason::Owned), "{r:?}");

    // The pod list fails: nothing is reaped on that ground, and the report
    // says why.
    api.fail_next("list", "pods", 500, 1);
    let r = janitor.scan_once().await.expect("scan");
    assert!(r.reaped.is_empty(), "{r:?}");
    assert_eq!(kept(&r, &gone), Some(KeepReason::Owned), "{r:?}");
    assert!(r.agent_pods_error.is_some(), "{r:?}");
    // An API outage (503s, which the client retries, then gives up on).
    api.set_unavailable(true);
    let r = janitor.scan_once().await.expect("scan");
    api.set_unavailable(false);
    assert!(r.reaped.is_empty(), "{r:?}");
    assert!(r.agent_pods_error.is_some(), "{r:?}");
    assert_eq!(janitor.metrics().agent_pods_unavailable_count(), 2);
    assert!(running(&bed, &gone) && running(&bed, &stays));

    // The pods are readable: "on-x" names a pod that left the node while
    // "agent-new" is Ready; "on-y" names a pod still there (not even Ready).
    let r = janitor.scan_once().await.expect("scan");
    assert_eq!(r.agent_pods_error, None, "{r:?}");
    assert_eq!(r.reaped_ids(), [gone.as_str()], "{r:?}");
    assert_eq!(r.reaped[0].reason, ReapReason::AgentPodGone);
    assert_eq!(r.reaped[0].agent_id, "ax");
    assert_eq!(kept(&r, &stays), Some(KeepReason::Owned), "{r:?}");
    assert_eq!(janitor.metrics().reaped_count(ReapReason::AgentPodGone), 1);
    assert!(!exists(&bed, &gone), "the reaped container is gone");
    assert!(running(&bed, &stays), "the other sandbox runs on");

    // Later scans leave the survivor alone.
    let r = janitor.scan_once().await.expect("scan");
    assert!(r.reaped.is_empty(), "{r:?}");
    assert_eq!(kept(&r, &stays), Some(KeepReason::Owned), "{r:?}");

    ax.shutdown().await;
    ay.shutdown().await;
    ctl.shutdown().await;
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}
