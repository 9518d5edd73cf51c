//! The janitor's snapshot rules on the test bed's containerd, judged on the
//! answers of a real controller (in process, over gRPC): committed sandbox
//! snapshots made by hand as an agent's capture makes them (a key prepared
//! on the busybox chain id, committed as `sandbolt-snapshot-<id>` with the
//! agent's labels) go when no snapshot record names them and stay while one
//! does or while a snapshot is built on them; capture snapshots
//! (`sandbolt-snapshotting-<id>`) stay while the agent process that made
//! them heartbeats and go otherwise. Snapshots are looked up through
//! containerd itself.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use containerd_client::services::v1::snapshots::{
    CommitSnapshotRequest, PrepareSnapshotRequest, RemoveSnapshotRequest, StatSnapshotRequest,
};
use sandbolt_controller::store::SnapshotRecord;
use sandbolt_controller::{Controller, ControllerConfig, ControllerHandle};
use sandbolt_janitor::rules::{ContainerFacts, OwnershipReport, SnapshotOwnershipReport};
use sandbolt_janitor::{
    ControllerOwnership, Janitor, JanitorConfig, OwnershipSource, ReapNotice, ScanReport,
    SnapshotKeepReason, SnapshotReapReason,
};
use sandbolt_node::containerd::Containerd;
use sandbolt_node::labels;
use sandbolt_proto::agent::v1::Inventory;
use sandbolt_test_support::{eventually_async, init_tracing};
use sandbolt_testbed::{Testbed, busybox_image};
use tonic::Code;

const NS: &str = "k8s.io";
const SNAPSHOTTER: &str = "overlayfs";
const TOKEN: &str = "janitor-snapshots-token";
const NODE: &str = "node-s";
const AGENT: &str = "agent-s";
const LIVE_INSTANCE: &str = "instance-live";

struct Env {
    // Field order: the controller stops before the bed goes.
    ctl: Option<ControllerHandle>,
    ctrd: Containerd,
    /// The busybox image's top layer: the parent of a capture.
    chain_id: String,
    dir: tempfile::TempDir,
    bed: Testbed,
}

impl Env {
    async fn start() -> Env {
        init_tracing("info");
        let bed = Testbed::start_with_busybox(NS).expect("test bed with busybox");
        let ctrd = Containerd::connect(bed.containerd_socket(), NS, Duration::from_secs(30))
            .await
            .expect("containerd answers");
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = ControllerConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            dir.path().join("ctl"),
            TOKEN,
        );
        cfg.lost_agent_timeout = Duration::from_secs(600);
        cfg.failpoint = None;
        let ctl = Controller::start(cfg).await.expect("controller starts");
        // busybox has one layer: its chain id is that layer's diff id.
        let chain_id = busybox_image().unwrap().diff_id();
        Env {
            ctl: Some(ctl),
            ctrd,
            chain_id,
            dir,
            bed,
        }
    }

    fn ctl(&self) -> &ControllerHandle {
        self.ctl.as_ref().expect("the controller runs")
    }

    fn janitor_config(&self) -> JanitorConfig {
        let mut cfg = JanitorConfig::new(
            NODE,
            self.bed.containerd_socket(),
            format!("http://{}", self.ctl().local_addr()),
            TOKEN,
            self.dir.path().join("janitor"),
        );
        cfg.containerd_namespace = NS.into();
        // Every snapshot is past it at once (the age rules are unit-tested
        // in `rules`).
        cfg.grace_period = Duration::ZERO;
        cfg.interval = Duration::from_secs(3600);
        cfg
    }

    /// A janitor asking the real controller, once it knows agent liveness.
    async fn janitor(&self) -> Janitor {
        let owner = ControllerOwnership::new(
            &format!("http://{}", self.ctl().local_addr()),
            TOKEN,
            Duration::from_secs(5),
        )
        .unwrap();
        eventually_async("the controller ready", Duration::from_secs(30), || async {
            owner.ownership(NODE, &[]).await.ok().filter(|r| r.ready)
        })
        .await;
        Janitor::new(self.janitor_config()).await.expect("janitor")
    }

    /// The agent process `instance` of [`AGENT`] heartbeats now.
    fn heartbeat(&self, instance: &str) {
        self.ctl()
            .core()
            .on_heartbeat(&Inventory {
                agent_id: AGENT.into(),
                instance_id: instance.into(),
                node_name: NODE.into(),
                api_endpoint: "http://127.0.0.1:1".into(),
                ..Default::default()
            })
            .expect("heartbeat");
    }

    async fn prepare(&self, key: &str, parent: &str, labels: HashMap<String, String>) {
        self.ctrd
            .snapshots()
            .prepare(self.ctrd.req(PrepareSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: key.into(),
                parent: parent.into(),
                labels,
            }))
            .await
            .unwrap_or_else(|e| panic!("prepare {key}: {e}"));
    }

    /// A committed sandbox snapshot as an agent's capture leaves it.
    async fn sandbox_snapshot(&self, id: &str) -> String {
        let temp = format!("{}{id}", labels::SNAPSHOTTING_KEY_PREFIX);
        self.prepare(&temp, &self.chain_id, gc_root()).await;
        let name = format!("{}{id}", labels::SNAPSHOT_NAME_PREFIX);
        let labels = HashMap::from([
            (labels::SNAPSHOT.to_string(), id.to_string()),
            (labels::AGENT_ID.into(), AGENT.into()),
            (
                labels::IMAGE.into(),
                "docker.io/library/busybox:latest".into(),
            ),
            (labels::SANDBOX_ID.into(), format!("sb-{id}")),
            (labels::NAME.into(), "source".into()),
            (labels::NAMESPACE.into(), "default".into()),
            ("containerd.io/gc.root".into(), "1".into()),
        ]);
        self.ctrd
            .snapshots()
            .commit(self.ctrd.req(CommitSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                name: name.clone(),
                key: temp,
                labels,
            }))
            .await
            .unwrap_or_else(|e| panic!("commit {name}: {e}"));
        name
    }

    /// A capture's snapshot before its commit, made by agent process
    /// `instance` of `agent`.
    async fn capture_snapshot(&self, id: &str, agent: &str, instance: &str) -> String {
        let key = format!("{}{id}", labels::SNAPSHOTTING_KEY_PREFIX);
        let mut l = gc_root();
        l.insert(labels::SNAPSHOT.into(), id.into());
        l.insert(labels::AGENT_ID.into(), agent.into());
        l.insert(labels::AGENT_INSTANCE.into(), instance.into());
        self.prepare(&key, &self.chain_id, l).await;
        key
    }

    async fn exists(&self, name: &str) -> bool {
        match self
            .ctrd
            .snapshots()
            .stat(self.ctrd.req(StatSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: name.into(),
            }))
            .await
        {
            Ok(_) => true,
            Err(s) if s.code() == Code::NotFound => false,
            Err(s) => panic!("stat {name}: {s}"),
        }
    }

    async fn remove(&self, name: &str) {
        self.ctrd
            .snapshots()
            .remove(self.ctrd.req(RemoveSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: name.into(),
            }))
            .await
            .unwrap_or_else(|e| panic!("remove {name}: {e}"));
    }

    fn record(&self, id: &str) {
        self.ctl()
            .core()
            .store()
            .put_snapshot(&SnapshotRecord {
                id: id.into(),
                namespace: "default".into(),
                uid: format!("uid-{id}"),
                agent_id: AGENT.into(),
                node_name: NODE.into(),
                ..Default::default()
            })
            .expect("put a snapshot record");
    }

    async fn shutdown(mut self) {
        if let Some(ctl) = self.ctl.take() {
            ctl.shutdown().await;
        }
    }
}

fn gc_root() -> HashMap<String, String> {
    HashMap::from([("containerd.io/gc.root".to_string(), "1".to_string())])
}

async fn scan(janitor: &Janitor) -> ScanReport {
    let r = janitor.scan_once().await.expect("scan");
    assert!(r.errors.is_empty(), "{r:?}");
    assert!(
        r.reaped.is_empty() && r.kept.is_empty(),
        "no sandboxes: {r:?}"
    );
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_snapshots_go_when_no_record_names_them_and_nothing_is_built_on_them() {
    let env = Env::start().await;
    let orphan = env
        .sandbox_snapshot("0c1d2e3f-0000-4000-8000-000000000001")
        .await;
    let recorded_id = "0c1d2e3f-0000-4000-8000-000000000002";
    let recorded = env.sandbox_snapshot(recorded_id).await;
    env.record(recorded_id);
    // A sandbox restored from it: a writable snapshot on top.
    let parent = env
        .sandbox_snapshot("0c1d2e3f-0000-4000-8000-000000000003")
        .await;
    let child = "sb-restored";
    env.prepare(child, &parent, gc_root()).await;
    // Not provably a sandbox snapshot: its label does not name its id.
    let unlabelled = format!(
        "{}0c1d2e3f-0000-4000-8000-000000000004",
        labels::SNAPSHOT_NAME_PREFIX
    );
    env.prepare("tmp-unlabelled", &env.chain_id, gc_root())
        .await;
    env.ctrd
        .snapshots()
        .commit(env.ctrd.req(CommitSnapshotRequest {
            snapshotter: SNAPSHOTTER.into(),
            name: unlabelled.clone(),
            key: "tmp-unlabelled".into(),
            labels: gc_root(),
        }))
        .await
        .expect("commit");

    let janitor = env.janitor().await;
    let r = scan(&janitor).await;
    assert_eq!(
        r.snapshot_reap_reason(&orphan),
        Some(SnapshotReapReason::NoRecord),
        "{r:?}"
    );
    assert!(!env.exists(&orphan).await, "{orphan} survived");
    assert_eq!(
        r.snapshot_kept_reason(&recorded),
        Some(SnapshotKeepReason::Recorded),
        "{r:?}"
    );
    assert_eq!(
        r.snapshot_kept_reason(&parent),
        Some(SnapshotKeepReason::HasChildren),
        "{r:?}"
    );
    assert_eq!(r.snapshots_reaped.len(), 1, "{r:?}");
    assert!(r.controller_ready);
    for name in [&recorded, &parent, &unlabelled] {
        assert!(env.exists(name).await, "{name} was removed");
    }
    assert!(env.exists(child).await);
    let metrics = janitor.metrics();
    assert_eq!(
        metrics.snapshots_reaped_count(SnapshotReapReason::NoRecord),
        1
    );
    assert!(
        metrics
            .encode()
            .contains("sandbolt_janitor_snapshots_reaped_total{reason=\"no-record\"} 1")
    );

    // The restored sandbox is gone: its snapshot goes with the next scan.
    env.remove(child).await;
    let r = scan(&janitor).await;
    assert_eq!(
        r.snapshot_reap_reason(&parent),
        Some(SnapshotReapReason::NoRecord),
        "{r:?}"
    );
    assert!(!env.exists(&parent).await);
    // A record keeps its snapshot scan after scan.
    assert_eq!(
        r.snapshot_kept_reason(&recorded),
        Some(SnapshotKeepReason::Recorded)
    );
    assert!(env.exists(&recorded).await);
    assert_eq!(
        metrics.snapshots_reaped_count(SnapshotReapReason::NoRecord),
        2
    );

    // Its record deleted (its agent away at the time): the janitor reaps it.
    env.ctl()
        .core()
        .store()
        .delete_snapshot(recorded_id)
        .unwrap();
    let r = scan(&janitor).await;
    assert_eq!(
        r.snapshot_reap_reason(&recorded),
        Some(SnapshotReapReason::NoRecord),
        "{r:?}"
    );
    assert!(!env.exists(&recorded).await);

    fenced_again_immediately_before_the_removal(&env).await;
    env.remove(&unlabelled).await;
    env.shutdown().await;
}

/// A record that appears between the decision and the removal keeps the
/// snapshot: the janitor asks again about each one right before removing
/// it.
async fn fenced_again_immediately_before_the_removal(env: &Env) {
    let id = "0c1d2e3f-0000-4000-8000-000000000005";
    let name = env.sandbox_snapshot(id).await;
    let owner = Arc::new(RecordedFromTheSecondQuestion::default());
    let janitor = Janitor::with_source(env.janitor_config(), owner.clone())
        .await
        .expect("janitor");
    let r = janitor.scan_once().await.expect("scan");
    assert_eq!(owner.asked.load(Ordering::SeqCst), 2, "decision and fence");
    assert_eq!(
        r.snapshot_kept_reason(&name),
        Some(SnapshotKeepReason::Recorded),
        "{r:?}"
    );
    assert!(r.snapshots_reaped.is_empty(), "{r:?}");
    assert!(env.exists(&name).await);
    env.remove(&name).await;
}

/// Answers "no record" for every sandbox snapshot the first time it is
/// asked, "recorded" afterwards: a snapshot's record written in between.
#[derive(Default)]
struct RecordedFromTheSecondQuestion {
    asked: AtomicUsize,
}

#[tonic::async_trait]
impl OwnershipSource for RecordedFromTheSecondQuestion {
    async fn ownership(
        &self,
        _node_name: &str,
        _queries: &[ContainerFacts],
    ) -> sandbolt_janitor::Result<OwnershipReport> {
        unreachable!("no sandbox and no scratch snapshot on the node")
    }

    async fn report_reaped(&self, _reaped: &ReapNotice<'_>) -> sandbolt_janitor::Result<()> {
        unreachable!("no sandbox is reaped")
    }

    async fn snapshot_ownership(
        &self,
        _node_name: &str,
        snapshot_ids: &[String],
    ) -> sandbolt_janitor::Result<SnapshotOwnershipReport> {
        let first = self.asked.fetch_add(1, Ordering::SeqCst) == 0;
        Ok(SnapshotOwnershipReport {
            ready: true,
            recorded: vec![!first; snapshot_ids.len()],
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capture_snapshots_live_as_long_as_the_agent_process_that_made_them() {
    let env = Env::start().await;
    env.heartbeat(LIVE_INSTANCE);
    let live = env
        .capture_snapshot("1c1d2e3f-0000-4000-8000-000000000001", AGENT, LIVE_INSTANCE)
        .await;
    // The same agent, an earlier process (killed mid-capture).
    let earlier = env
        .capture_snapshot(
            "1c1d2e3f-0000-4000-8000-000000000002",
            AGENT,
            "instance-killed",
        )
        .await;
    // An agent the controller does not know.
    let unknown = env
        .capture_snapshot("1c1d2e3f-0000-4000-8000-000000000003", "agent-unknown", "i")
        .await;

    let janitor = env.janitor().await;
    env.heartbeat(LIVE_INSTANCE);
    let r = scan(&janitor).await;
    for gone in [&earlier, &unknown] {
        assert_eq!(
            r.snapshot_reap_reason(gone),
            Some(SnapshotReapReason::CaptureAbandoned),
            "{gone}: {r:?}"
        );
        assert!(!env.exists(gone).await, "{gone} survived");
    }
    assert_eq!(
        r.snapshot_kept_reason(&live),
        Some(SnapshotKeepReason::AgentProcessLive),
        "{r:?}"
    );
    assert!(env.exists(&live).await);
    assert!(
        r.prepared_reaped.is_empty() && r.prepared_kept.is_empty(),
        "{r:?}"
    );
    assert_eq!(
        janitor
            .metrics()
            .snapshots_reaped_count(SnapshotReapReason::CaptureAbandoned),
        2
    );

    // The agent restarted (another process heartbeats): the capture died
    // with the process that made it.
    env.heartbeat("instance-restarted");
    let r = scan(&janitor).await;
    assert_eq!(
        r.snapshot_reap_reason(&live),
        Some(SnapshotReapReason::CaptureAbandoned),
        "{r:?}"
    );
    assert!(!env.exists(&live).await);
    env.shutdown().await;
}
