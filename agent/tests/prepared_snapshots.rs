//! Prepared writable snapshots on a real containerd: a cold create of an
//! expected image takes one (its container's snapshot key is the prepared
//! key) and works; the pool refills; delete removes the snapshot; a
//! restarted agent keeps the one a sandbox uses, removes the rest of an
//! earlier process and prepares again; the janitor keeps a live agent
//! process's and removes those of one that is gone; `prepared_snapshots = 0`
//! turns it off; nothing is left.

use crate::common;

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use containerd_client::services::v1::GetContainerRequest;
use containerd_client::services::v1::snapshots::{PrepareSnapshotRequest, StatSnapshotRequest};
use parking_lot::Mutex;
use sandbolt_agent::labels;
use sandbolt_janitor::rules::{
    AgentFacts, ContainerFacts, OwnershipAnswer, OwnershipReport, RecordState,
};
use sandbolt_janitor::{Janitor, JanitorConfig, OwnershipSource, ReapNotice};
use sandbolt_proto::agent::v1::{SandboxPhase, SandboxSpec};

const K: usize = 2;

fn prepared(cfg: &mut sandbolt_agent::AgentConfig) {
    cfg.warm_images = vec!["busybox".into()];
    cfg.prepared_snapshots = K;
    cfg.warm_pool_interval = Duration::from_millis(200);
}

/// The prepared keys the agent holds ready, once there are `n`.
async fn wait_ready(env: &Env, n: usize) -> BTreeSet<String> {
    eventually_async(&format!("{n} prepared snapshots"), WAIT, || async {
        let keys = env.agent().sandboxes().prepared().ready_keys();
        (keys.len() == n).then(|| keys.into_iter().collect::<BTreeSet<_>>())
    })
    .await
}

/// Active snapshots with the prepared prefix in containerd.
fn prepared_in_containerd(env: &Env) -> BTreeSet<String> {
    env.ctr(&["snapshots", "--snapshotter", "overlayfs", "list"])
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|k| k.starts_with(labels::PREPARED_KEY_PREFIX))
        .map(String::from)
        .collect()
}

async fn snapshot_key(env: &Env, id: &str) -> String {
    let ctrd = env.agent().sandboxes().containerd();
    ctrd.containers()
        .get(ctrd.req(GetContainerRequest { id: id.into() }))
        .await
        .expect("container")
        .into_inner()
        .container
        .expect("container")
        .snapshot_key
}

async fn snapshot_labels(env: &Env, key: &str) -> HashMap<String, String> {
    let ctrd = env.agent().sandboxes().containerd();
    ctrd.snapshots()
        .stat(ctrd.req(StatSnapshotRequest {
            snapshotter: "overlayfs".into(),
            key: key.into(),
        }))
        .await
        .expect("snapshot stat")
        .into_inner()
        .info
        .expect("info")
        .labels
}

/// A prepared snapshot as an agent process that is gone left it.
async fn stale_prepared(env: &Env, key: &str, instance: &str) {
    let sandboxes = env.agent().sandboxes();
    let parent = sandboxes.images.resolve("busybox").await.unwrap();
    let ctrd = sandboxes.containerd();
    ctrd.snapshots()
        .prepare(ctrd.req(PrepareSnapshotRequest {
            snapshotter: "overlayfs".into(),
            key: key.into(),
            parent: parent.chain_id.clone(),
            labels: HashMap::from([
                (labels::PREPARED.into(), "agent-test".into()),
                (labels::AGENT_INSTANCE.into(), instance.into()),
                ("containerd.io/gc.root".into(), "1".into()),
            ]),
        }))
        .await
        .expect("prepare a stale snapshot");
}

/// A sandbox that writes into its rootfs, waited for execd.
fn writer(id: &str) -> SandboxSpec {
    SandboxSpec {
        wait_for_execd: true,
        ..sh_spec(id, "echo written > /written && exec sleep 100000")
    }
}

/// Creates `id`; checks it runs on a prepared snapshot (one that was ready)
/// and that its rootfs is writable. Returns the key.
async fn create_prepared(env: &mut Env, id: &str, ready: &BTreeSet<String>) -> String {
    let resp = env.create(writer(id)).await.expect("create");
    assert!(!resp.claimed_warm);
    let timings = resp.timings.expect("timings");
    assert!(
        timings.container_created_us > timings.image_resolved_us
            && timings.task_started_us >= timings.container_created_us,
        "{timings:?}"
    );
    let key = snapshot_key(env, id).await;
    assert!(
        ready.contains(&key),
        "{id} took {key}, ready were {ready:?}"
    );
    let status = wait_for_phase(&env.client, id, SandboxPhase::Running).await;
    let written = format!("/proc/{}/root/written", status.pid);
    eventually_async(&format!("{id} wrote its rootfs"), WAIT, || async {
        std::fs::read_to_string(&written)
            .ok()
            .filter(|s| s.trim() == "written")
    })
    .await;
    key
}

#[tokio::test(flavor = "multi_thread")]
async fn cold_creates_take_prepared_snapshots_and_nothing_leaks() {
    let mut env = Env::start_with(prepared).await;
    let ready = wait_ready(&env, K).await;
    assert_eq!(prepared_in_containerd(&env), ready);
    let instance = env.agent().instance_id().to_string();
    for key in &ready {
        let l = snapshot_labels(&env, key).await;
        assert_eq!(
            l.get(labels::PREPARED).map(String::as_str),
            Some("agent-test")
        );
        assert_eq!(l.get(labels::AGENT_INSTANCE), Some(&instance));
    }

    // A create takes one; the pool refills; delete removes it.
    let k1 = create_prepared(&mut env, "sb-p1", &ready).await;
    let refilled = wait_ready(&env, K).await;
    assert!(!refilled.contains(&k1), "{k1} is taken: {refilled:?}");
    assert!(env.delete_leaving_nothing("sb-p1", 0).await);
    assert!(
        !prepared_in_containerd(&env).contains(&k1),
        "{k1} survived its delete"
    );

    // A restart keeps a sandbox's, removes an earlier process's others
    // (here one a killed process left), and prepares again.
    let k2 = create_prepared(&mut env, "sb-p2", &refilled).await;
    let before = wait_ready(&env, K).await;
    let stale = "sandbolt-prepared-stale0";
    stale_prepared(&env, stale, "killed-instance").await;
    env.restart_agent(prepared).await;
    let now = prepared_in_containerd(&env);
    assert!(now.contains(&k2), "the running sandbox's snapshot: {now:?}");
    assert!(!now.contains(stale), "{now:?}");
    assert!(now.is_disjoint(&before), "{now:?} vs {before:?}");
    let after = wait_ready(&env, K).await;
    let new_instance = env.agent().instance_id().to_string();
    for key in &after {
        let l = snapshot_labels(&env, key).await;
        assert_eq!(l.get(labels::AGENT_INSTANCE), Some(&new_instance));
    }
    // The recovered sandbox's delete removes its prepared snapshot.
    assert!(env.delete_leaving_nothing("sb-p2", 0).await);
    assert!(!prepared_in_containerd(&env).contains(&k2));

    janitor_keeps_the_live_process_and_reaps_the_others(&env, &after).await;

    // Off: a cold create prepares its own snapshot under its id; nothing
    // prepared is left behind by the earlier process.
    env.restart_agent(|cfg| {
        prepared(cfg);
        cfg.prepared_snapshots = 0;
    })
    .await;
    assert_eq!(prepared_in_containerd(&env), BTreeSet::new());
    env.create(writer("sb-off")).await.expect("create");
    assert_eq!(snapshot_key(&env, "sb-off").await, "sb-off");
    assert!(env.delete_leaving_nothing("sb-off", 0).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(prepared_in_containerd(&env), BTreeSet::new());
    env.shutdown().await;
}

async fn janitor_keeps_the_live_process_and_reaps_the_others(env: &Env, live: &BTreeSet<String>) {
    let stale = "sandbolt-prepared-stale1";
    stale_prepared(env, stale, "gone-instance").await;
    let owner = Arc::new(Owner {
        instance: Mutex::new(env.agent().instance_id().to_string()),
    });
    let mut jcfg = JanitorConfig::new(
        "node-test",
        env.bed.containerd_socket(),
        "http://127.0.0.1:1",
        TOKEN,
        env.state.path().join("janitor"),
    );
    jcfg.grace_period = Duration::ZERO;
    jcfg.agent_state_dir = Some(env.state.path().to_path_buf());
    let janitor = Janitor::with_source(jcfg, owner.clone())
        .await
        .expect("janitor");
    let r = janitor.scan_once().await.expect("scan");
    assert!(r.reaped.is_empty() && r.kept.is_empty(), "{r:?}");
    assert_eq!(r.prepared_reaped, vec![stale.to_string()], "{r:?}");
    let kept: BTreeSet<String> = r.prepared_kept.iter().cloned().collect();
    assert_eq!(&kept, live, "{r:?}");
    assert!(!prepared_in_containerd(env).contains(stale));

    // Once that process is not the heartbeating one, its are orphans too.
    *owner.instance.lock() = "another-instance".into();
    let r = janitor.scan_once().await.expect("scan");
    let reaped: BTreeSet<String> = r.prepared_reaped.iter().cloned().collect();
    assert!(live.is_subset(&reaped), "{r:?}");
    assert!(r.reaped.is_empty(), "never reported as sandboxes: {r:?}");
}

/// The janitor's view: no records; the agent heartbeats with the instance
/// id the test sets.
struct Owner {
    instance: Mutex<String>,
}

#[tonic::async_trait]
impl OwnershipSource for Owner {
    async fn ownership(
        &self,
        _node_name: &str,
        queries: &[ContainerFacts],
    ) -> sandbolt_janitor::Result<OwnershipReport> {
        let agent = AgentFacts {
            agent_id: "agent-test".into(),
            registered: true,
            heartbeating: true,
            instance_id: self.instance.lock().clone(),
            ..Default::default()
        };
        Ok(OwnershipReport {
            ready: true,
            answers: queries
                .iter()
                .map(|q| OwnershipAnswer {
                    sandbox_id: q.sandbox_id.clone(),
                    record: RecordState::Absent,
                    agent: agent.clone(),
                    ..Default::default()
                })
                .collect(),
            agents: vec![agent],
            fast_commit_deadline_ms: 0,
        })
    }

    async fn report_reaped(&self, _reaped: &ReapNotice<'_>) -> sandbolt_janitor::Result<()> {
        Ok(())
    }
}
