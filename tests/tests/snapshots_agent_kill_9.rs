//! Sandbox snapshots (issue 18): `kill -9` of the agent in the middle of a
//! capture leaves no half snapshot and no leak. The agent is a real
//! `sandbolt agent` process on a test bed's containerd, heartbeating to a
//! real (in-process) controller. A busybox sandbox gets ~300 MiB of new
//! files (so that copying its writable layer takes a while); a snapshot is
//! asked for on the native API without waiting; as soon as containerd shows
//! the capture's `sandbolt-snapshotting-<id>` key, the agent is SIGKILLed
//! and started again on the same state. Then:
//! - the snapshot record ends FAILED, never READY;
//! - containerd holds neither `sandbolt-snapshotting-<id>` nor
//!   `sandbolt-snapshot-<id>`;
//! - the source sandbox runs, not frozen (its task is RUNNING, and a
//!   command through execd works);
//! - the failed record can be deleted;
//! - a new snapshot of the same sandbox succeeds, and a sandbox created
//!   from it holds the 300 MiB.
//!
//! Then everything is deleted, the agent and the controller stop, and the
//! bed is left clean.

use crate::support::warm;

use crate::support::snapshots;

use crate::support::agent_proc;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use agent_proc::AgentProc;

use sandbolt_e2e::bed::{Native, connect, eventually, native_ref, start_bed, tasks};
use sandbolt_proto::control::v1 as native;
use sandbolt_testbed::Testbed;
use snapshots::*;
use warm::{TOKEN, drop_bed_checked};

const AGENT: &str = "agent-snap-k9";
/// Files of 1 MiB written into the source sandbox.
const FILES: u32 = 300;
const SOURCE: &str = "snap-k9-source";
const RESTORED: &str = "snap-k9-restored";
/// How long the capture may take to show its key in containerd.
const CAPTURE_STARTS_WITHIN: Duration = Duration::from_secs(60);
const SETTLES_WITHIN: Duration = Duration::from_secs(120);

fn create_request(name: &str, snapshot_id: &str) -> native::CreateSandboxRequest {
    let mut req = sandbolt_e2e::bed::native_busybox_create(name, Default::default());
    req.name = name.into();
    if let Some(spec) = req.spec.as_mut() {
        spec.snapshot_id = snapshot_id.into();
        if !snapshot_id.is_empty() {
            // The snapshot's image.
            spec.image.clear();
        }
    }
    req
}

async fn create(c: &mut Native, name: &str, snapshot_id: &str) -> native::Sandbox {
    let s = c
        .create_sandbox(create_request(name, snapshot_id))
        .await
        .unwrap_or_else(|e| panic!("create {name} (snapshot {snapshot_id:?}): {e:?}"))
        .into_inner();
    let phase = s.status.as_ref().map(|s| s.phase());
    assert_eq!(phase, Some(native::Phase::Running), "{name}: {s:?}");
    s
}

async fn delete(c: &mut Native, name: &str) {
    c.delete_sandbox(native::DeleteSandboxRequest {
        sandbox: native_ref(name),
    })
    .await
    .unwrap_or_else(|e| panic!("delete {name}: {e:?}"));
}

fn snapshot_request(request_id: &str, wait: bool) -> native::CreateSnapshotRequest {
    native::CreateSnapshotRequest {
        request_id: request_id.into(),
        sandbox: native_ref(SOURCE),
        display_name: request_id.into(),
        wait,
        ..Default::default()
    }
}

/// Polls containerd (not the agent, not the controller) until the capture
/// of `id` has prepared its key; how long that took.
async fn wait_capture_running(bed: &Testbed, id: &str, agent: &AgentProc) -> Duration {
    let key = capturing_key(id);
    let started = Instant::now();
    loop {
        let keys = sandbox_snapshot_keys(bed).await;
        if keys.contains(&key) {
            return started.elapsed();
        }
        assert!(
            !keys.contains(&committed_key(id)),
            "the capture committed before its key was seen: make the sandbox's changes larger"
        );
        assert!(
            started.elapsed() < CAPTURE_STARTS_WITHIN,
            "no {key} within {CAPTURE_STARTS_WITHIN:?}\nagent log:\n{}",
            agent.output()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits until the controller resolves execd of `name` to `proxy` (the
/// restarted agent's: its heartbeats reached the controller).
async fn wait_reached_through(c: &Native, name: &str, proxy: SocketAddr) {
    let want = proxy.to_string();
    eventually(
        &format!("{name}'s execd resolved to {want}"),
        SETTLES_WITHIN,
        || {
            let mut c = c.clone();
            let want = want.clone();
            async move {
                c.resolve_endpoint(native::ResolveEndpointRequest {
                    sandbox: native_ref(name),
                    port: u32::from(sandbolt_proto::wire::EXECD_PORT),
                })
                .await
                .is_ok_and(|e| e.into_inner().endpoint.starts_with(&want))
            }
        },
    )
    .await;
}

/// What the source's files add up to (names and a checksum of them all).
const FINGERPRINT: &str = "cd /root/fill && ls | wc -l && \
    i=0; while [ -e f$i ]; do cat f$i; i=$((i+1)); done | sha256sum";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_kill_9_during_a_capture_leaves_no_half_snapshot() {
    let bed = start_bed().await;
    let dir = tempfile::tempdir().unwrap();
    let ctl = agent_proc::start_controller(dir.path(), TOKEN).await;
    let addr = ctl.local_addr();
    let mut agent = AgentProc::new(
        AGENT,
        "node-snap-k9",
        TOKEN,
        bed.root().join("agent-snap-k9-state"),
    )
    .controller(addr)
    .args(["--network", "none", "--max-sandboxes", "8"])
    .args(["--volume-backend", "none"]);
    agent.start(&bed);
    let v2 = connect(addr).await;
    sandbolt_e2e::bed::wait_agents(&v2, 1).await;
    let mut c = Native::connect(format!("http://{addr}")).await.unwrap();
    let mut snaps = Snapshots::connect(format!("http://{addr}")).await.unwrap();

    let source = create(&mut c, SOURCE, "").await;
    let container = source.status.unwrap_or_default().container_id;
    execd_ok(
        &mut c,
        SOURCE,
        &format!(
            "set -e; mkdir -p /root/fill; i=0; while [ $i -lt {FILES} ]; do \
             head -c 1048576 /dev/urandom > /root/fill/f$i; i=$((i+1)); done"
        ),
    )
    .await;
    let fingerprint = execd_ok(&mut c, SOURCE, FINGERPRINT).await;
    assert!(
        fingerprint.starts_with(&format!("{FILES}\n")),
        "{fingerprint}"
    );

    // The capture, killed in its middle.
    let pending = snaps
        .create_snapshot(snapshot_request("k9-first", false))
        .await
        .expect("CreateSnapshot (no wait)")
        .into_inner();
    assert_eq!(
        pending.phase(),
        native::SnapshotPhase::Pending,
        "{pending:?}"
    );
    let id = pending.id.clone();
    let seen_after = wait_capture_running(&bed, &id, &agent).await;
    agent.kill9();
    let at_kill = sandbox_snapshot_keys(&bed).await;
    let frozen = tasks(&bed).await.get(&container).cloned();
    eprintln!(
        "killed the agent {seen_after:?} after the snapshot's create; keys then: {at_kill:?}; \
         the source's task: {frozen:?}"
    );
    // The capture copies the writable layer with the source frozen: the
    // kill left it frozen (or freezing), for the restarted agent to thaw.
    assert!(
        matches!(&frozen, Some((_, s)) if s == "PAUSED" || s == "PAUSING"),
        "the kill did not land while the source was frozen: {frozen:?}"
    );
    agent.start(&bed);
    wait_reached_through(&c, SOURCE, agent.proxy).await;

    let settled = wait_settled(&snaps, &id, SETTLES_WITHIN).await;
    assert_eq!(
        settled.phase(),
        native::SnapshotPhase::Failed,
        "a capture its agent died in must not end READY: {settled:?}"
    );
    assert!(!settled.message.is_empty(), "FAILED says why: {settled:?}");
    wait_nothing_of_snapshot(&bed, &id, SETTLES_WITHIN).await;

    // The source thawed and runs on.
    let status = tasks(&bed).await.get(&container).cloned();
    assert!(
        matches!(&status, Some((_, s)) if s == "RUNNING"),
        "the source's task after the restart: {status:?}\nagent log:\n{}",
        agent.output()
    );
    assert_eq!(execd_ok(&mut c, SOURCE, "echo thawed").await, "thawed\n");

    // The failed record goes on request.
    snaps
        .delete_snapshot(snapshot_ref(&id))
        .await
        .expect("DeleteSnapshot of the FAILED one");
    wait_snapshot_gone(&snaps, &id, SETTLES_WITHIN).await;

    // A new capture of the same sandbox works and restores.
    let ready = snaps
        .create_snapshot(snapshot_request("k9-second", true))
        .await
        .expect("CreateSnapshot (wait)")
        .into_inner();
    assert_eq!(ready.phase(), native::SnapshotPhase::Ready, "{ready:?}");
    assert!(
        ready.size_bytes >= i64::from(FILES) << 20,
        "the capture holds the {FILES} MiB: {ready:?}"
    );
    let keys = sandbox_snapshot_keys(&bed).await;
    assert_eq!(keys, vec![committed_key(&ready.id)], "{keys:?}");
    create(&mut c, RESTORED, &ready.id).await;
    assert_eq!(execd_ok(&mut c, RESTORED, FINGERPRINT).await, fingerprint);
    assert_eq!(execd_ok(&mut c, SOURCE, "echo running").await, "running\n");

    // Teardown: the restored sandbox, the snapshot, the source.
    delete(&mut c, RESTORED).await;
    eventually("the snapshot unused", SETTLES_WITHIN, || {
        let mut snaps = snaps.clone();
        let id = ready.id.clone();
        async move {
            snaps
                .get_snapshot(snapshot_ref(&id))
                .await
                .is_ok_and(|s| s.into_inner().in_use_by.is_empty())
        }
    })
    .await;
    snaps
        .delete_snapshot(snapshot_ref(&ready.id))
        .await
        .expect("DeleteSnapshot of the unused READY one");
    wait_snapshot_gone(&snaps, &ready.id, SETTLES_WITHIN).await;
    wait_nothing_of_snapshot(&bed, &ready.id, SETTLES_WITHIN).await;
    delete(&mut c, SOURCE).await;
    eventually("every sandbox removed", SETTLES_WITHIN, || async {
        sandbolt_e2e::bed::containers(&bed).await.is_empty()
    })
    .await;
    agent.stop();
    ctl.shutdown().await;
    let left = sandbox_snapshot_keys(&bed).await;
    assert!(left.is_empty(), "sandbox snapshots left: {left:?}");
    drop_bed_checked(bed).await;
}
