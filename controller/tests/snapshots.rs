//! Sandbox snapshots in the controller, through its real gRPC port
//! (`SnapshotService`, FastPath v2) with AgentService **stand-ins** (see
//! `support/standin.rs`) that keep a table of captures with the agent's
//! rules (source running or paused, idempotent by id, delete refused while
//! a sandbox of the node starts from it) and can be told to fail or hang a
//! capture. Stand-ins because these tests are about the controller's
//! records: phases, the capture task, idempotency, filters and pages,
//! deletion that waits for restored sandboxes, a restart. The capture
//! itself (containerd, overlay upper dirs) runs on the real agent in
//! `tests/tests/` and `agent/tests/`.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering::SeqCst;
use std::time::{Duration, Instant};

use sandbolt_controller::store::{Phase, SnapshotPhase, SnapshotRecord, Store};
use sandbolt_controller::{Controller, ControllerHandle, SandboxKey};
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::fastpath::v2;
use support::standin::{StandInAgent, node_of};
use support::{HB, assert_code, pvc, sandbox_request, sref, standin_config};
use tonic::Code;
use tonic::transport::Channel;

type Native = native::sandbox_service_client::SandboxServiceClient<Channel>;
type Snaps = native::snapshot_service_client::SnapshotServiceClient<Channel>;
type Vols = native::volume_service_client::VolumeServiceClient<Channel>;
type V2 = v2::fast_path_service_client::FastPathServiceClient<Channel>;

async fn start(dir: &Path) -> ControllerHandle {
    Controller::start(standin_config(dir)).await.unwrap()
}

async fn clients(addr: SocketAddr) -> (Native, Snaps) {
    let url = format!("http://{addr}");
    (
        Native::connect(url.clone()).await.unwrap(),
        Snaps::connect(url).await.unwrap(),
    )
}

async fn agent(id: &str, h: &ControllerHandle) -> StandInAgent {
    StandInAgent::start(id, "default", 8, &["busybox"], h.local_addr(), HB).await
}

/// A controller (its data directory goes when the first item is dropped)
/// with one stand-in agent `a1` (capacity 8, busybox), clients, and a
/// busybox sandbox (no volumes) for each of `sandboxes`.
async fn bed(
    sandboxes: &[&str],
) -> (
    tempfile::TempDir,
    ControllerHandle,
    StandInAgent,
    Native,
    Snaps,
) {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let a = agent("a1", &h).await;
    let (mut c, s) = clients(h.local_addr()).await;
    for name in sandboxes {
        sandbox(&mut c, name, vec![]).await;
    }
    (dir, h, a, c, s)
}

async fn sandbox(c: &mut Native, name: &str, volumes: Vec<native::Volume>) -> native::Sandbox {
    c.create_sandbox(sandbox_request(name, volumes))
        .await
        .unwrap_or_else(|e| panic!("create sandbox {name}: {e}"))
        .into_inner()
}

fn snapshot_of(source: &str, request_id: &str, wait: bool) -> native::CreateSnapshotRequest {
    native::CreateSnapshotRequest {
        request_id: request_id.into(),
        sandbox: sref(source),
        display_name: String::new(),
        metadata: Default::default(),
        wait,
    }
}

async fn create(s: &mut Snaps, req: native::CreateSnapshotRequest) -> native::Snapshot {
    s.create_snapshot(req)
        .await
        .unwrap_or_else(|e| panic!("create snapshot: {e}"))
        .into_inner()
}

fn snap_ref(id: &str) -> native::SnapshotRef {
    native::SnapshotRef {
        namespace: String::new(),
        id: id.into(),
        expected_uid: String::new(),
    }
}

async fn get(s: &mut Snaps, id: &str) -> Result<native::Snapshot, tonic::Status> {
    s.get_snapshot(snap_ref(id)).await.map(|r| r.into_inner())
}

/// Polls until the snapshot leaves `phase` (or 10 s).
async fn settled(s: &mut Snaps, id: &str, phase: native::SnapshotPhase) -> native::Snapshot {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = get(s, id).await.unwrap();
        if r.phase != phase as i32 || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Polls until `id` has no record any more (or `within`).
async fn gone(s: &mut Snaps, id: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if get(s, id).await.is_err_and(|e| e.code() == Code::NotFound) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Marks the sandbox record `name` as restored from `snapshot_id`, as a
/// restore would have recorded it.
fn restored_from(store: &dyn Store, name: &str, snapshot_id: &str) {
    let mut r = store
        .get(&SandboxKey::new("", name))
        .unwrap()
        .expect("record");
    r.spec.snapshot_id = snapshot_id.into();
    store.replace(&r).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_records_pending_then_captures_ready_with_the_volumes() {
    let (_dir, h, a, mut c, mut s) = bed(&[]).await;
    let a = a.with_volume_root().await;
    let mut vols = Vols::connect(format!("http://{}", h.local_addr()))
        .await
        .unwrap();
    vols.create_volume(native::CreateVolumeRequest {
        name: "data".into(),
        node_name: node_of("a1"),
        ..Default::default()
    })
    .await
    .unwrap();
    let src = sandbox(&mut c, "src", vec![pvc("data", "/data", |_| {})]).await;

    // No wait: PENDING at once, READY when the (held) capture finishes.
    a.state.hang_captures.store(true, SeqCst);
    let mut req = snapshot_of("src", "r1", false);
    req.display_name = "before tests".into();
    req.metadata.insert("team".into(), "red".into());
    let p = create(&mut s, req).await;
    assert_eq!(p.phase, native::SnapshotPhase::Pending as i32);
    assert_eq!(p.completed_at_unix_ms, 0);
    assert_eq!(
        get(&mut s, &p.id).await.unwrap().phase,
        native::SnapshotPhase::Pending as i32
    );
    a.state.hang_captures.store(false, SeqCst);
    let r = settled(&mut s, &p.id, native::SnapshotPhase::Pending).await;
    assert_eq!(r.phase, native::SnapshotPhase::Ready as i32, "{r:?}");
    assert_eq!((r.size_bytes, r.paused_us, r.took_us), (4096, 7, 11));
    assert_eq!(
        (r.agent_id.as_str(), r.node_name.clone()),
        ("a1", node_of("a1"))
    );
    assert_eq!(r.image, "docker.io/library/busybox:latest");
    assert_eq!(
        (r.source_sandbox.as_str(), r.source_uid.as_str()),
        ("src", src.uid.as_str())
    );
    assert_eq!(r.display_name, "before tests");
    assert_eq!(r.metadata["team"], "red");
    assert!(r.completed_at_unix_ms >= r.created_at_unix_ms && r.created_at_unix_ms > 0);
    assert_eq!(r.volumes.len(), 1);
    assert_eq!(r.volumes[0].volume, "data");
    assert_eq!(r.volumes[0].mount_path, "/data");
    assert_eq!(r.volumes[0].volume_snapshot, format!("sbs-{}", r.id));
    assert!(r.in_use_by.is_empty());
    assert!(a.state.snapshots.lock().contains_key(&r.id));
    // The id is a UUID: DNS-label-safe, as the agent's name needs.
    assert!(uuid::Uuid::parse_str(&r.id).is_ok() && r.id == r.id.to_lowercase());

    // Wait: answered once READY. A paused source stays paused (no freeze).
    c.pause_sandbox(sref("src").unwrap()).await.unwrap();
    let w = create(&mut s, snapshot_of("src", "r2", true)).await;
    assert_eq!(w.phase, native::SnapshotPhase::Ready as i32, "{w:?}");
    assert_eq!(w.paused_us, 0);
    assert_ne!(w.id, r.id);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_capture_is_failed_and_removed_from_the_node() {
    let (_dir, h, a, _, mut s) = bed(&["src"]).await;
    a.state.fail_captures.store(true, SeqCst);
    let f = create(&mut s, snapshot_of("src", "", true)).await;
    assert_eq!(f.phase, native::SnapshotPhase::Failed as i32, "{f:?}");
    assert!(f.message.contains("capture failed"), "{}", f.message);
    assert!(f.completed_at_unix_ms > 0);
    let calls = a.state.snapshot_calls.lock().clone();
    assert_eq!(
        calls,
        [format!("create {}", f.id), format!("delete {}", f.id)]
    );
    // A FAILED record is deleted like any other.
    s.delete_snapshot(snap_ref(&f.id)).await.unwrap();
    assert!(gone(&mut s, &f.id, Duration::from_secs(1)).await);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_running_or_paused_source_with_a_live_agent_is_captured() {
    let (_dir, h, a, _, mut s) = bed(&["src", "broken"]).await;

    assert_code(
        s.create_snapshot(snapshot_of("nope", "", true)).await,
        Code::NotFound,
        &["nope"],
    );
    let mut bad = snapshot_of("src", "", true);
    bad.metadata.insert("not a label".into(), "x".into());
    assert_code(
        s.create_snapshot(bad).await,
        Code::InvalidArgument,
        &["metadata"],
    );
    let mut bad = snapshot_of("src", "", true);
    bad.display_name = "n".repeat(254);
    assert_code(
        s.create_snapshot(bad).await,
        Code::InvalidArgument,
        &["display_name"],
    );
    let mut other = snapshot_of("src", "", true);
    other.sandbox.as_mut().unwrap().expected_uid = "another-uid".into();
    assert_code(s.create_snapshot(other).await, Code::NotFound, &["src"]);

    let store = h.core().store();
    let mut r = store.get(&SandboxKey::new("", "broken")).unwrap().unwrap();
    r.phase = Phase::Failed;
    store.replace(&r).unwrap();
    assert_code(
        s.create_snapshot(snapshot_of("broken", "", true)).await,
        Code::FailedPrecondition,
        &["running or paused"],
    );

    a.set_heartbeats(false);
    let deadline = Instant::now() + Duration::from_secs(5);
    while h.core().registry().is_live(&"a1".into()) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_code(
        s.create_snapshot(snapshot_of("src", "", true)).await,
        Code::FailedPrecondition,
        &["not heartbeating"],
    );
    // Nothing was recorded for any refusal, nothing asked of the agent.
    assert!(store.list_snapshots().unwrap().is_empty());
    assert!(a.state.snapshot_calls.lock().is_empty());
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_names_one_snapshot_of_one_source() {
    let (_dir, h, a, _, mut s) = bed(&["src", "other"]).await;
    let first = create(&mut s, snapshot_of("src", "same", true)).await;
    let again = create(&mut s, snapshot_of("src", "same", false)).await;
    assert_eq!(
        (again.id.as_str(), again.uid.as_str()),
        (first.id.as_str(), first.uid.as_str())
    );
    assert_eq!(again.phase, native::SnapshotPhase::Ready as i32);
    assert_code(
        s.create_snapshot(snapshot_of("other", "same", true)).await,
        Code::AlreadyExists,
        &["same"],
    );
    // Concurrent retries of one request: still one snapshot.
    a.state.hang_captures.store(true, SeqCst);
    let (mut s1, mut s2) = (s.clone(), s.clone());
    let (x, y) = tokio::join!(
        s1.create_snapshot(snapshot_of("src", "racy", false)),
        s2.create_snapshot(snapshot_of("src", "racy", false)),
    );
    assert_eq!(x.unwrap().into_inner().id, y.unwrap().into_inner().id);
    a.state.hang_captures.store(false, SeqCst);
    assert_eq!(h.core().store().list_snapshots().unwrap().len(), 2);
    h.shutdown().await;
}

fn ids(items: &[native::Snapshot]) -> Vec<String> {
    items.iter().map(|s| s.id.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_filters_and_pages_in_creation_order() {
    let (_dir, h, a, _, mut s) = bed(&["one", "two"]).await;
    let mut made = Vec::new();
    for (src, name) in [("one", "x"), ("two", "x"), ("one", "y"), ("two", "z")] {
        let mut req = snapshot_of(src, "", true);
        req.display_name = name.into();
        made.push(create(&mut s, req).await.id);
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    a.state.fail_captures.store(true, SeqCst);
    made.push(create(&mut s, snapshot_of("one", "", true)).await.id);
    let list = |q: native::ListSnapshotsRequest| {
        let mut s = s.clone();
        async move { s.list_snapshots(q).await.map(|r| r.into_inner()) }
    };
    let all = list(Default::default()).await.unwrap();
    assert_eq!(ids(&all.items), made);
    assert!(all.next_page_token.is_empty());
    let of_one = list(native::ListSnapshotsRequest {
        source_sandbox: "one".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(
        ids(&of_one.items),
        [made[0].clone(), made[2].clone(), made[4].clone()]
    );
    let named_x = list(native::ListSnapshotsRequest {
        display_name: "x".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(ids(&named_x.items), made[..2]);
    let failed = list(native::ListSnapshotsRequest {
        phases: vec![native::SnapshotPhase::Failed as i32],
        ..Default::default()
    })
    .await
    .unwrap();
    assert_eq!(ids(&failed.items), [made[4].clone()]);
    let elsewhere = list(native::ListSnapshotsRequest {
        namespace: "team-b".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    assert!(elsewhere.items.is_empty());
    assert_code(
        list(native::ListSnapshotsRequest {
            phases: vec![0],
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        &["phase"],
    );

    // Pages of two: every snapshot once, in order.
    let (mut seen, mut token) = (Vec::new(), String::new());
    loop {
        let p = list(native::ListSnapshotsRequest {
            page_size: 2,
            page_token: token.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
        assert!(p.items.len() <= 2);
        seen.extend(ids(&p.items));
        if p.next_page_token.is_empty() {
            break;
        }
        token = p.next_page_token;
    }
    assert_eq!(seen, made);
    // Another namespace does not see them one by one either.
    let mut elsewhere = snap_ref(&made[0]);
    elsewhere.namespace = "team-b".into();
    assert_code(
        s.get_snapshot(elsewhere).await,
        Code::NotFound,
        &[made[0].as_str()],
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unused_snapshot_is_deleted_on_its_node_and_a_pending_one_is_refused() {
    let (_dir, h, a, _, mut s) = bed(&["src"]).await;
    let r = create(&mut s, snapshot_of("src", "", true)).await;
    let mut wrong = snap_ref(&r.id);
    wrong.expected_uid = "not-its-uid".into();
    assert_code(
        s.delete_snapshot(wrong).await,
        Code::NotFound,
        &[r.id.as_str()],
    );
    let d = s
        .delete_snapshot(snap_ref(&r.id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.id, r.id);
    assert!(!a.state.snapshots.lock().contains_key(&r.id));
    assert_code(get(&mut s, &r.id).await, Code::NotFound, &[r.id.as_str()]);
    assert_code(
        s.delete_snapshot(snap_ref(&r.id)).await,
        Code::NotFound,
        &[r.id.as_str()],
    );

    a.state.hang_captures.store(true, SeqCst);
    let p = create(&mut s, snapshot_of("src", "", false)).await;
    assert_code(
        s.delete_snapshot(snap_ref(&p.id)).await,
        Code::FailedPrecondition,
        &["being captured"],
    );
    a.state.hang_captures.store(false, SeqCst);
    let ready = settled(&mut s, &p.id, native::SnapshotPhase::Pending).await;
    assert_eq!(ready.phase, native::SnapshotPhase::Ready as i32);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_used_snapshot_is_deleting_until_released_or_swept() {
    let (_dir, h, a, _, mut s) = bed(&["src", "b", "c"]).await;
    let first = create(&mut s, snapshot_of("src", "", true)).await;
    let second = create(&mut s, snapshot_of("src", "", true)).await;
    let store = h.core().store();
    restored_from(store, "b", &first.id);
    restored_from(store, "c", &second.id);
    assert_eq!(get(&mut s, &first.id).await.unwrap().in_use_by, ["b"]);

    let d = s
        .delete_snapshot(snap_ref(&first.id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.phase, native::SnapshotPhase::Deleting as i32);
    assert_eq!(d.in_use_by, ["b"]);
    assert!(d.message.contains("b"), "{}", d.message);
    assert!(a.state.snapshots.lock().contains_key(&first.id));
    // Released while another sandbox still uses it: stays.
    h.core().snapshot_released(&first.id).await;
    assert!(get(&mut s, &first.id).await.is_ok());

    // The restored sandbox's record goes; the release removes it at once.
    store.delete(&SandboxKey::new("", "b")).unwrap();
    h.core().snapshot_released(&first.id).await;
    assert_code(
        get(&mut s, &first.id).await,
        Code::NotFound,
        &[first.id.as_str()],
    );
    assert!(!a.state.snapshots.lock().contains_key(&first.id));

    // The node refuses while one of its sandboxes starts from it: stays
    // DELETING though no record uses it; the sweep removes it once the node
    // lets go (nobody announces that).
    let d = s
        .delete_snapshot(snap_ref(&second.id))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.phase, native::SnapshotPhase::Deleting as i32);
    let c_id = store
        .get(&SandboxKey::new("", "c"))
        .unwrap()
        .unwrap()
        .sandbox_id
        .to_string();
    a.state.specs.lock().get_mut(&c_id).unwrap().snapshot_id = second.id.clone();
    store.delete(&SandboxKey::new("", "c")).unwrap();
    h.core().snapshot_released(&second.id).await;
    let r = get(&mut s, &second.id).await.unwrap();
    assert_eq!(r.phase, native::SnapshotPhase::Deleting as i32);
    assert!(r.message.contains("in use"), "{}", r.message);
    a.state
        .specs
        .lock()
        .get_mut(&c_id)
        .unwrap()
        .snapshot_id
        .clear();
    assert!(
        gone(&mut s, &second.id, Duration::from_secs(25)).await,
        "swept"
    );
    assert!(!a.state.snapshots.lock().contains_key(&second.id));
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_controller_re_drives_a_pending_capture() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let a = agent("a1", &h).await;
    let (mut c, _) = clients(h.local_addr()).await;
    let src = sandbox(&mut c, "src", vec![]).await;
    let rec = h
        .core()
        .store()
        .get(&SandboxKey::new("", "src"))
        .unwrap()
        .unwrap();
    // As a leader that died right after recording: PENDING, agent not asked.
    let pending = h
        .core()
        .store()
        .put_snapshot(&SnapshotRecord {
            id: "0f4c1a52-0000-4000-8000-000000000001".into(),
            namespace: "default".into(),
            uid: "u-1".into(),
            source_sandbox: "src".into(),
            source_uid: src.uid.clone(),
            source_sandbox_id: rec.sandbox_id.to_string(),
            phase: SnapshotPhase::Pending,
            agent_id: "a1".into(),
            created_at_unix_ms: 1,
            ..Default::default()
        })
        .unwrap();
    h.shutdown().await;
    assert!(a.state.snapshot_calls.lock().is_empty());

    let h = start(dir.path()).await;
    a.retarget(h.local_addr());
    let (_, mut s) = clients(h.local_addr()).await;
    let r = settled(&mut s, &pending.id, native::SnapshotPhase::Pending).await;
    assert_eq!(r.phase, native::SnapshotPhase::Ready as i32, "{r:?}");
    assert_eq!(r.size_bytes, 4096);
    assert_eq!(
        a.state.snapshot_calls.lock().clone(),
        [format!("create {}", pending.id)]
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fastpath_v2_snapshots_map_the_phases() {
    let (_dir, h, a, mut c, mut s) = bed(&[]).await;
    let src = sandbox(&mut c, "src", vec![]).await;
    let mut v = V2::connect(format!("http://{}", h.local_addr()))
        .await
        .unwrap();
    let reference = |name: &str| {
        Some(v2::SandboxReference {
            namespaced_name: Some(v2::NamespacedName {
                namespace: "default".into(),
                name: name.into(),
            }),
            expected_uid: String::new(),
        })
    };
    a.state.hang_captures.store(true, SeqCst);
    let made = v
        .create_sandbox_snapshot(v2::CreateSandboxSnapshotRequest {
            request_id: "v2-snap".into(),
            sandbox: reference("src"),
            template_name: "tmpl".into(),
            metadata: [("k".to_string(), "v".to_string())].into(),
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(made.phase, v2::SnapshotPhase::Creating as i32);
    let id = made.identity.clone().unwrap().name;
    assert_eq!(
        (
            made.sandbox_name.as_str(),
            made.sandbox_uid.as_str(),
            made.template_name.as_str()
        ),
        ("src", src.uid.as_str(), "tmpl")
    );
    assert_eq!(made.fastlet_name, "a1");
    a.state.hang_captures.store(false, SeqCst);
    settled(&mut s, &id, native::SnapshotPhase::Pending).await;
    let get = |uid: &str| v2::GetSandboxSnapshotRequest {
        snapshot: Some(v2::NamespacedName {
            namespace: "default".into(),
            name: id.clone(),
        }),
        expected_uid: uid.into(),
    };
    let ready = v
        .get_sandbox_snapshot(get(""))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(ready.phase, v2::SnapshotPhase::Succeeded as i32);
    assert_eq!(ready.size_bytes, 4096);
    assert!(ready.completed_unix_seconds >= ready.created_unix_seconds);
    assert_eq!(ready.identity, made.identity);
    assert_eq!(
        v.get_sandbox_snapshot(get("wrong"))
            .await
            .unwrap_err()
            .code(),
        Code::NotFound
    );

    // In use: deletion pending, still SUCCEEDED (v2 has no deleting phase).
    sandbox(&mut c, "b", vec![]).await;
    restored_from(h.core().store(), "b", &id);
    v.delete_sandbox_snapshot(v2::DeleteSandboxSnapshotRequest {
        snapshot: reference(&id),
    })
    .await
    .unwrap();
    let deleting = v
        .get_sandbox_snapshot(get(""))
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(deleting.phase, v2::SnapshotPhase::Succeeded as i32);
    assert!(
        deleting.message.contains("deletion is pending"),
        "{}",
        deleting.message
    );
    h.core().store().delete(&SandboxKey::new("", "b")).unwrap();
    h.core().snapshot_released(&id).await;
    assert_eq!(
        v.get_sandbox_snapshot(get("")).await.unwrap_err().code(),
        Code::NotFound
    );

    a.state.fail_captures.store(true, SeqCst);
    let failed = v
        .create_sandbox_snapshot(v2::CreateSandboxSnapshotRequest {
            sandbox: reference("src"),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    let fid = failed.identity.unwrap().name;
    settled(&mut s, &fid, native::SnapshotPhase::Pending).await;
    let f = v
        .get_sandbox_snapshot(v2::GetSandboxSnapshotRequest {
            snapshot: Some(v2::NamespacedName {
                namespace: String::new(),
                name: fid,
            }),
            expected_uid: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(f.phase, v2::SnapshotPhase::Failed as i32);
    assert!(f.message.contains("capture failed"));
    h.shutdown().await;
}
