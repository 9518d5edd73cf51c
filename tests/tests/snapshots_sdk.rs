//! Sandbox snapshots end to end (issue 18), as a client uses them: the
//! official Python SDK (`tests/python/snapshots_sdk_test.py`) on a
//! lifecycle in front of a real controller and a real agent on the test bed
//! (private containerd, runc, static execd): snapshot a sandbox A that has
//! files, an installed program and a deleted image file; keep changing A;
//! create B and C from the snapshot (both see the snapshot's state and
//! diverge); delete A (B runs on); delete B; delete the snapshot while C
//! uses it (Deleting). Here, between the suite's two steps, the controller's
//! native record and containerd itself are checked: the record is DELETING,
//! used by C alone, on the agent's node, with the capture's size and pause;
//! containerd holds the committed `sandbolt-snapshot-<id>` and C's writable
//! layer is its child. After the second step (C deleted, the snapshot gone
//! over REST) containerd holds nothing of the snapshot, no container and no
//! writable layer is left, and the bed is clean.

use crate::support::warm;

use crate::support::snapshots;

use std::collections::BTreeMap;
use std::time::Duration;

use sandbolt_proto::control::v1 as native;
use snapshots::*;
use warm::{WarmEnv, drop_bed_checked};

const SUITE: &str = "snapshots_sdk_test.py";
/// The blob the suite writes into A (5 MiB of random bytes).
const BLOB_BYTES: i64 = 5 << 20;
const GONE_WITHIN: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sdk_snapshot_restore_fork_and_delete_while_in_use() {
    let env = WarmEnv::start().await;
    let addr = env.lifecycle.as_ref().unwrap().addr();
    let state_file = env.dir.path().join("snapshot-state.json");
    let py_env = vec![
        ("SNAPSHOT_IMAGE", sandbolt_testbed::BUSYBOX_REF.to_string()),
        ("SNAPSHOT_STATE", state_file.display().to_string()),
    ];
    let ctl_addr = env.ctl.as_ref().unwrap().local_addr();
    let mut snaps = Snapshots::connect(format!("http://{ctl_addr}"))
        .await
        .expect("SnapshotService");

    pytest_one(
        SUITE,
        "test_snapshot_restore_fork_and_delete_while_in_use",
        addr,
        py_env.clone(),
    )
    .await;
    let state: BTreeMap<String, String> = serde_json::from_str(
        &std::fs::read_to_string(&state_file).expect("the suite wrote its ids"),
    )
    .unwrap();
    let (id, c) = (&state["snapshot"], &state["c"]);

    // The record, as the native API tells it.
    let record = get_snapshot(&mut snaps, id).await;
    assert_eq!(
        record.phase(),
        native::SnapshotPhase::Deleting,
        "{record:?}"
    );
    assert_eq!(record.in_use_by, vec![c.clone()], "{record:?}");
    assert_eq!(record.source_sandbox, state["a"], "{record:?}");
    assert_eq!(record.display_name, "sdk-snap", "{record:?}");
    assert_eq!(record.agent_id, "agent-warm", "{record:?}");
    assert_eq!(record.image, sandbolt_testbed::BUSYBOX_REF, "{record:?}");
    assert!(
        record.size_bytes >= BLOB_BYTES,
        "the capture holds the 5 MiB blob: {record:?}"
    );
    assert!(
        record.paused_us > 0 && record.took_us >= record.paused_us,
        "A ran: the capture froze it for a while, within the capture: {record:?}"
    );
    assert!(
        record.completed_at_unix_ms >= record.created_at_unix_ms && record.created_at_unix_ms > 0,
        "{record:?}"
    );

    // containerd: the committed snapshot, and C's writable layer on it.
    let rows = containerd_snapshots(&env.bed).await;
    let committed = committed_key(id);
    assert!(
        rows.iter()
            .any(|r| r.key == committed && r.kind == "Committed"),
        "{committed} is not a committed snapshot: {rows:#?}"
    );
    let children: Vec<&SnapshotRow> = rows.iter().filter(|r| r.parent == committed).collect();
    assert_eq!(
        children.len(),
        1,
        "only C's writable layer is left on the snapshot: {children:#?}"
    );
    assert_eq!(children[0].kind, "Active", "{children:#?}");
    assert!(
        !rows.iter().any(|r| r.key == capturing_key(id)),
        "the capture's key outlived it: {rows:#?}"
    );
    let c_container = warm::native_sandbox(&mut env.native.clone(), c)
        .await
        .status
        .unwrap_or_default()
        .container_id;
    assert_eq!(
        sandbolt_e2e::bed::containers(&env.bed).await,
        vec![c_container],
        "A and B are gone, C runs"
    );

    pytest_one(
        SUITE,
        "test_deleting_the_last_user_removes_the_snapshot",
        addr,
        py_env,
    )
    .await;
    wait_snapshot_gone(&snaps, id, GONE_WITHIN).await;
    wait_nothing_of_snapshot(&env.bed, id, GONE_WITHIN).await;
    let left = sandbox_snapshot_keys(&env.bed).await;
    assert!(left.is_empty(), "sandbox snapshots left: {left:?}");
    stop(env).await;
}

/// Stops the lifecycle, the agent and the controller once no sandbox is
/// left, and checks that the bed is clean.
async fn stop(mut env: WarmEnv) {
    let bed = &env.bed;
    sandbolt_e2e::bed::eventually("every sandbox removed", GONE_WITHIN, || async {
        sandbolt_e2e::bed::containers(bed).await.is_empty()
    })
    .await;
    if let Some(l) = env.lifecycle.take() {
        l.shutdown().await.expect("lifecycle stops");
    }
    if let Some(a) = env.agent.take() {
        a.shutdown().await;
    }
    if let Some(c) = env.ctl.take() {
        c.shutdown().await;
    }
    drop_bed_checked(env.bed).await;
}
