//! The agent-pod rule with real components: a controller, two agents and the
//! janitor on the test bed's containerd, and the agent pods in an in-process
//! Kubernetes API double (`sandbolt-kube-double`), read through a real
//! `kube::Client` — by the janitor, and by the controller, which asks it
//! whether a silent agent's pod is gone.
//!
//! The rule follows the controller: a pod gone from the node reaps nothing
//! while its agent still runs (a force-deleted pod) or is merely silent;
//! once the controller has given the agent up and is recreating its
//! sandbox elsewhere, the container left behind goes by this rule, before
//! any recreate commits.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use sandbolt_agent::{Agent, AgentHandle};
use sandbolt_controller::registry::KubeAgentPresence;
use sandbolt_controller::{Consistency, Controller, ControllerConfig, ControllerHandle};
use sandbolt_e2e::bed::{
    NS, V2, agent_config, busybox_create_with_policy, create_agent_pod, diagnostics, eventually,
    start_bed,
};
use sandbolt_janitor::{
    AgentPods, ControllerOwnership, Janitor, JanitorConfig, KeepReason, OwnershipSource,
    ReapReason, ScanReport,
};
use sandbolt_kube_double::ApiDouble;
use sandbolt_node::labels;
use sandbolt_proto::fastpath::v2 as fp;
use sandbolt_testbed::Testbed;
use serde_json::json;

const TOKEN: &str = "janitor-agent-pods-token";
const NODE: &str = "node-p";
const POD_NS: &str = "sandbolt";
const SELECTOR: &str = "app.kubernetes.io/component=agent";
const HB: Duration = Duration::from_millis(100);
const LOST: Duration = Duration::from_millis(500);
/// Long enough for the janitor to scan a silent agent's sandboxes before the
/// controller gives the agent up.
const GONE: Duration = Duration::from_secs(4);
/// Short, so the test does not wait long; the first scan still falls
/// inside it.
const GRACE: Duration = Duration::from_secs(2);

async fn start_controller(data: &std::path::Path, api: &ApiDouble) -> ControllerHandle {
    let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), data, TOKEN);
    cfg.default_consistency = Consistency::Strong;
    cfg.heartbeat_interval = HB;
    cfg.lost_agent_timeout = LOST;
    cfg.agent_gone_timeout = GONE;
    cfg.agent_presence = Some(std::sync::Arc::new(KubeAgentPresence::new(api.client())));
    cfg.failpoint = None;
    Controller::start(cfg).await.expect("controller starts")
}

/// An agent in its own pool (placement is then deterministic) on [`NODE`],
/// running in the agent pod `pod` (name, uid).
async fn start_agent(
    bed: &Testbed,
    id: &str,
    pod: (&str, &str),
    state: &std::path::Path,
    ctl: &ControllerHandle,
) -> AgentHandle {
    let mut cfg = agent_config(bed, id, state, ctl.local_addr(), TOKEN);
    cfg.node_name = NODE.into();
    cfg.pool = id.into();
    cfg.pod_name = Some(pod.0.into());
    cfg.pod_uid = Some(pod.1.into());
    cfg.pod_namespace = Some(POD_NS.into());
    cfg.heartbeat_interval = HB;
    Agent::start(cfg).await.expect("agent starts")
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

async fn create_sandbox(v2: &mut V2, name: &str, pool: &str, policy: fp::FailurePolicy) -> String {
    v2.create_sandbox(fp::CreateSandboxRequest {
        pool_ref: pool.into(),
        // Its pool has no other agent: a recreate cannot succeed, so the
        // record stays Recovering for the whole test.
        ..busybox_create_with_policy(name, policy, 3600)
    })
    .await
    .unwrap_or_else(|e| panic!("create {name}: {e:?}"));
    diagnostics(v2, name).await.runtime_instance_id
}

/// Waits until the controller answers `ready` (every agent it knows has
/// heartbeated), so agent liveness rules apply from the first scan.
async fn wait_controller_ready(janitor: &Janitor) {
    eventually("the controller ready", Duration::from_secs(30), || async {
        janitor.scan_once().await.expect("scan").controller_ready
    })
    .await;
}

fn pod_label(bed: &Testbed, id: &str) -> String {
    let info: serde_json::Value =
        serde_json::from_str(&bed.ctr_output(NS, &["containers", "info", id]).unwrap()).unwrap();
    info["Labels"][labels::AGENT_POD_UID]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn running(bed: &Testbed, id: &str) -> bool {
    let tasks = bed.tasks(NS).expect("ctr tasks ls");
    tasks.get(id).is_some_and(|(_, status)| status == "RUNNING")
}

fn exists(bed: &Testbed, id: &str) -> bool {
    bed.containers(NS)
        .expect("ctr containers ls")
        .iter()
        .any(|c| c == id)
}

fn kept(r: &ScanReport, id: &str) -> Option<KeepReason> {
    r.kept_reason(id)
}

/// The record phase the controller answers for `name`.
async fn phase(v2: &mut V2, name: &str) -> String {
    diagnostics(v2, name).await.assignment_state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_left_behind_by_its_agent_pod_is_reaped_once_the_controller_gave_it_up() {
    sandbolt_test_support::init_tracing("sandbolt_janitor=info");
    let bed = start_bed().await;
    let dir = tempfile::tempdir().unwrap();
    let api = ApiDouble::start().await;
    let pods: Api<Pod> = Api::namespaced(api.client(), POD_NS);

    // Pods "agent-x" and "agent-y" run the two agents; "agent-new" is an
    // agent pod of another pool that turns Ready on the node later (it does
    // not adopt agent-x's containers). None is Ready yet, and an agent pod
    // of another node is Ready (it must not count).
    let uid_x = create_agent_pod(&pods, "agent-x", NODE, "ax").await;
    let uid_y = create_agent_pod(&pods, "agent-y", NODE, "ay").await;
    create_agent_pod(&pods, "agent-new", NODE, "az").await;
    create_agent_pod(&pods, "agent-elsewhere", "node-other", "ax").await;
    set_ready(&pods, "agent-elsewhere").await;

    let ctl = start_controller(&dir.path().join("controller"), &api).await;
    let ax = start_agent(
        &bed,
        "ax",
        ("agent-x", &uid_x),
        &dir.path().join("ax"),
        &ctl,
    )
    .await;
    let ay = start_agent(
        &bed,
        "ay",
        ("agent-y", &uid_y),
        &dir.path().join("ay"),
        &ctl,
    )
    .await;
    let mut v2 = V2::connect(format!("http://{}", ctl.local_addr()))
        .await
        .unwrap();
    let owner = ControllerOwnership::new(
        &format!("http://{}", ctl.local_addr()),
        TOKEN,
        Duration::from_secs(5),
    )
    .unwrap();
    eventually(
        "both agents heartbeated",
        Duration::from_secs(30),
        || async {
            owner.ownership(NODE, &[]).await.is_ok_and(|r| {
                ["ax", "ay"]
                    .iter()
                    .all(|id| r.agents.iter().any(|a| a.agent_id == *id && a.alive()))
            })
        },
    )
    .await;
    let gone = create_sandbox(&mut v2, "on-x", "ax", fp::FailurePolicy::AutoRecreate).await;
    let failed = create_sandbox(&mut v2, "manual-x", "ax", fp::FailurePolicy::Manual).await;
    let stays = create_sandbox(&mut v2, "on-y", "ay", fp::FailurePolicy::Manual).await;
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

    // Pod "agent-x" is force-deleted while its agent runs on (and keeps
    // reporting its sandboxes), and "agent-new" turns Ready.
    pods.delete("agent-x", &DeleteParams::default())
        .await
        .expect("delete pod");
    set_ready(&pods, "agent-new").await;

    // Inside the grace period nothing is touched.
    wait_controller_ready(&janitor).await;
    let r = janitor.scan_once().await.expect("scan");
    assert!(r.reaped.is_empty(), "{r:?}");
    assert_eq!(kept(&r, &gone), Some(KeepReason::Young), "{r:?}");

    // The grace period is a time span, not a condition: it must pass.
    tokio::time::sleep(GRACE + Duration::from_millis(200)).await;

    // A live agent still has them: the pods prove nothing against that.
    for j in [&janitor, &blind] {
        let r = j.scan_once().await.expect("scan");
        assert!(r.reaped.is_empty(), "{r:?}");
        for id in [&gone, &failed, &stays] {
            assert_eq!(kept(&r, id), Some(KeepReason::Owned), "{id}: {r:?}");
        }
    }

    // Its agent goes silent: still nothing, pods or not.
    ax.shutdown().await;
    eventually("ax silent", GONE, || async {
        let r = owner
            .ownership(NODE, &[])
            .await
            .expect("controller answers");
        r.agents.iter().any(|a| a.agent_id == "ax" && !a.alive())
    })
    .await;
    let r = janitor.scan_once().await.expect("scan");
    assert!(r.reaped.is_empty(), "{r:?}");
    assert_eq!(kept(&r, &gone), Some(KeepReason::AgentSilent), "{r:?}");
    assert_eq!(kept(&r, &failed), Some(KeepReason::AgentSilent), "{r:?}");
    assert_eq!(kept(&r, &stays), Some(KeepReason::Owned), "{r:?}");
    assert_eq!(
        phase(&mut v2, "on-x").await,
        "Assigned",
        "silence changed on-x"
    );

    // After GONE the controller finds agent-x's pod gone, with no other agent
    // pod of pool ax on the node: it gives ax up. on-x is Recovering (its
    // recreate cannot find room), manual-x Failed.
    eventually("the controller gave ax up", GONE * 5, || {
        let mut v2 = v2.clone();
        async move { phase(&mut v2, "manual-x").await == "Failed" }
    })
    .await;
    // The control reaps the failed one by its record, and keeps on-x: its
    // record is live and nothing but pods could say more.
    let r = blind.scan_once().await.expect("scan");
    assert_eq!(r.reaped_ids(), [failed.as_str()], "{r:?}");
    assert_eq!(r.reaped[0].reason, ReapReason::Terminal);
    assert_eq!(kept(&r, &gone), Some(KeepReason::AgentSilent), "{r:?}");

    // The pod list fails: nothing is reaped on that ground, and the report
    // says why.
    api.fail_next("list", "pods", 500, 1);
    let r = janitor.scan_once().await.expect("scan");
    assert!(r.reaped.is_empty(), "{r:?}");
    assert_eq!(kept(&r, &gone), Some(KeepReason::AgentSilent), "{r:?}");
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
    // "agent-new" is Ready, and the controller is recreating it elsewhere;
    // "on-y" names a pod still there (not even Ready).
    let r = janitor.scan_once().await.expect("scan");
    assert_eq!(r.agent_pods_error, None, "{r:?}");
    assert_eq!(r.reaped_ids(), [gone.as_str()], "{r:?}");
    assert_eq!(r.reaped[0].reason, ReapReason::AgentPodGone);
    assert_eq!(r.reaped[0].agent_id, "ax");
    assert_eq!(kept(&r, &stays), Some(KeepReason::Owned), "{r:?}");
    assert_eq!(janitor.metrics().reaped_count(ReapReason::AgentPodGone), 1);
    assert!(!exists(&bed, &gone), "the reaped container is gone");
    assert!(running(&bed, &stays), "the other sandbox runs on");
    // The reap did not overrule the controller: on-x is still to be
    // recreated, not failed.
    assert_eq!(phase(&mut v2, "on-x").await, "Reassigning");

    // Later scans leave the survivor alone.
    let r = janitor.scan_once().await.expect("scan");
    assert!(r.reaped.is_empty(), "{r:?}");
    assert_eq!(kept(&r, &stays), Some(KeepReason::Owned), "{r:?}");

    ay.shutdown().await;
    ctl.shutdown().await;
    tokio::task::spawn_blocking(move || drop(bed))
        .await
        .unwrap();
}
