//! Named volumes in the controller, through its real gRPC port
//! (`VolumeService`, `SandboxService`), with AgentService **stand-ins**
//! (see `support/standin.rs`) that keep a table of volumes with the agent's
//! mount rules. Stand-ins because: these tests are about the controller's
//! own decisions — the cluster-wide name index, which node a volume or a
//! sandbox goes to, what it forwards, the codes it answers, silent and
//! gone nodes, a restart — with several nodes, which one test bed with
//! real agents does not have. The data path (btrfs, mounts inside
//! containers) runs on real agents in `tests/tests/` and `agent/tests/`.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use sandbolt_controller::{Controller, ControllerHandle};
use sandbolt_proto::control::v1 as native;
use support::standin::{StandInAgent, node_of};
use support::{
    HB, assert_code, eventually, node_deleted_config, pvc, sandbox_request as sandbox, sref,
    standin_config, with_spec,
};
use tonic::Code;
use tonic::transport::Channel;

type Native = native::sandbox_service_client::SandboxServiceClient<Channel>;
type Vols = native::volume_service_client::VolumeServiceClient<Channel>;

async fn start(dir: &Path) -> ControllerHandle {
    Controller::start(standin_config(dir)).await.unwrap()
}

async fn clients(addr: SocketAddr) -> (Native, Vols) {
    let url = format!("http://{addr}");
    (
        Native::connect(url.clone()).await.unwrap(),
        Vols::connect(url).await.unwrap(),
    )
}

async fn agent(id: &str, cap: i32, images: &[&str], h: &ControllerHandle) -> StandInAgent {
    StandInAgent::start(id, "default", cap, images, h.local_addr(), HB).await
}

async fn rooted(id: &str, cap: i32, images: &[&str], h: &ControllerHandle) -> StandInAgent {
    agent(id, cap, images, h).await.with_volume_root().await
}

fn new_volume(name: &str) -> native::CreateVolumeRequest {
    native::CreateVolumeRequest {
        name: name.into(),
        ..Default::default()
    }
}

async fn create_volume(v: &mut Vols, name: &str, node: &str) -> native::NamedVolume {
    v.create_volume(native::CreateVolumeRequest {
        node_name: node.into(),
        ..new_volume(name)
    })
    .await
    .unwrap_or_else(|e| panic!("create volume {name}: {e}"))
    .into_inner()
}

fn vref(name: &str) -> native::VolumeRef {
    native::VolumeRef { name: name.into() }
}

async fn get_sandbox(c: &mut Native, name: &str) -> native::Sandbox {
    c.get_sandbox(native::GetSandboxRequest {
        sandbox: sref(name),
    })
    .await
    .unwrap()
    .into_inner()
}

fn pvcs(s: &native::Sandbox) -> Vec<native::PvcSource> {
    s.spec
        .as_ref()
        .unwrap()
        .volumes
        .iter()
        .filter_map(|v| match &v.source {
            Some(native::volume::Source::Pvc(p)) => Some(p.clone()),
            _ => None,
        })
        .collect()
}

/// Creation spreads volumes (fewest first), honours `node_name`, keeps names
/// unique, and every other call is forwarded to the volume's agent with its
/// answer's code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_are_placed_named_once_and_forwarded_to_their_node() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let a = rooted("a", 4, &[], &h).await;
    let b = rooted("b", 4, &[], &h).await;
    let _c = agent("c", 4, &[], &h).await;
    let (_, mut v) = clients(h.local_addr()).await;

    let v1 = create_volume(&mut v, "v1", "").await;
    let v2 = create_volume(&mut v, "v2", "").await;
    assert_eq!(
        (v1.agent_id.as_str(), v1.node_name.as_str()),
        ("a", "node-a")
    );
    assert_eq!(v2.agent_id, "b", "the node with the fewest volumes");
    assert!(v1.available);
    assert_eq!(v1.access_mode, native::AccessMode::ReadWriteOnce as i32);
    let sized = v
        .create_volume(native::CreateVolumeRequest {
            size: "1Gi".into(),
            access_mode: native::AccessMode::ReadWriteMany as i32,
            node_name: node_of("b"),
            ..new_volume("sized")
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((sized.agent_id.as_str(), sized.size_bytes), ("b", 1 << 30));
    assert_eq!(sized.access_mode, native::AccessMode::ReadWriteMany as i32);
    assert_eq!(sized.backend, "local");

    // Refusals, each with its code and naming what is wrong.
    assert_code(
        v.create_volume(new_volume("v1")).await,
        Code::AlreadyExists,
        &["v1", "node-a"],
    );
    let on_c = native::CreateVolumeRequest {
        node_name: node_of("c"),
        ..new_volume("x")
    };
    assert_code(
        v.create_volume(on_c).await,
        Code::FailedPrecondition,
        &["node-c", "volume root"],
    );
    let nowhere = native::CreateVolumeRequest {
        node_name: "nowhere".into(),
        ..new_volume("x")
    };
    assert_code(
        v.create_volume(nowhere).await,
        Code::InvalidArgument,
        &["node_name"],
    );
    let gpu = native::CreateVolumeRequest {
        pool: "gpu".into(),
        ..new_volume("x")
    };
    assert_code(
        v.create_volume(gpu).await,
        Code::ResourceExhausted,
        &["gpu"],
    );
    for (req, field) in [
        (new_volume("Bad_Name"), "name"),
        (
            native::CreateVolumeRequest {
                size: "lots".into(),
                ..new_volume("x")
            },
            "size",
        ),
        (
            native::CreateVolumeRequest {
                backend: "ceph".into(),
                ..new_volume("x")
            },
            "backend",
        ),
    ] {
        assert_code(v.create_volume(req).await, Code::InvalidArgument, &[field]);
    }
    assert!(!a.state.volumes.lock().contains_key("x"));
    assert!(!b.state.volumes.lock().contains_key("x"));

    // Get is fresh from the agent; list is what the agents reported.
    a.state.volumes.lock().get_mut("v1").unwrap().used_bytes = 42;
    assert_eq!(
        v.get_volume(vref("v1"))
            .await
            .unwrap()
            .into_inner()
            .used_bytes,
        42
    );
    let names: Vec<String> = v
        .list_volumes(native::ListVolumesRequest {})
        .await
        .unwrap()
        .into_inner()
        .items
        .into_iter()
        .map(|x| x.name)
        .collect();
    assert_eq!(names, ["sized", "v1", "v2"]);
    assert_code(v.get_volume(vref("nope")).await, Code::NotFound, &["nope"]);

    // Snapshots, restore, fork: forwarded to a, the fork lands on a.
    let snap = native::CreateVolumeSnapshotRequest {
        volume: "v1".into(),
        name: "s1".into(),
    };
    v.create_volume_snapshot(snap.clone()).await.unwrap();
    assert_code(
        v.create_volume_snapshot(snap).await,
        Code::AlreadyExists,
        &[],
    );
    let snaps = v
        .list_volume_snapshots(vref("v1"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(snaps.items.len(), 1);
    assert_eq!(snaps.items[0].name, "s1");
    let restore = |s: &str| native::RestoreVolumeRequest {
        volume: "v1".into(),
        snapshot: s.into(),
    };
    v.restore_volume(restore("s1")).await.unwrap();
    assert_code(
        v.restore_volume(restore("s9")).await,
        Code::NotFound,
        &["node-a"],
    );
    let fork = native::ForkVolumeRequest {
        source: "v1".into(),
        snapshot: "s1".into(),
        name: "f1".into(),
        ..Default::default()
    };
    let f1 = v.fork_volume(fork.clone()).await.unwrap().into_inner();
    assert_eq!(
        (f1.node_name.as_str(), f1.forked_from.as_str()),
        ("node-a", "v1@s1")
    );
    assert!(a.state.volumes.lock().contains_key("f1"));
    assert_code(v.fork_volume(fork).await, Code::AlreadyExists, &["f1"]);
    let sref = native::VolumeSnapshotRef {
        volume: "v1".into(),
        name: "s1".into(),
    };
    v.delete_volume_snapshot(sref.clone()).await.unwrap();
    assert_code(
        v.delete_volume_snapshot(sref).await,
        Code::NotFound,
        &["s1"],
    );

    // Delete: gone from its node and from the index at once.
    v.delete_volume(vref("v2")).await.unwrap();
    assert!(!b.state.volumes.lock().contains_key("v2"));
    assert_code(v.get_volume(vref("v2")).await, Code::NotFound, &[]);
    assert_code(v.delete_volume(vref("v2")).await, Code::NotFound, &[]);
    h.shutdown().await;
}

/// Concurrent creates of one name on a cluster of several nodes: one wins,
/// the others are ALREADY_EXISTS, and only one node holds the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_creates_of_one_name_make_one_volume() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let agents = [
        rooted("a", 4, &[], &h).await,
        rooted("b", 4, &[], &h).await,
        rooted("c", 4, &[], &h).await,
    ];
    let (_, v) = clients(h.local_addr()).await;
    let tasks: Vec<_> = (0..24)
        .map(|i| {
            let mut v = v.clone();
            // Each asks for a node of its own: without the controller's
            // name lock, three nodes would each make one.
            let node = node_of(["a", "b", "c"][i % 3]);
            tokio::spawn(async move {
                v.create_volume(native::CreateVolumeRequest {
                    node_name: node,
                    ..new_volume("same")
                })
                .await
            })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => ok += 1,
            Err(e) => assert_eq!(e.code(), Code::AlreadyExists, "{}", e.message()),
        }
    }
    assert_eq!(ok, 1);
    let holders = agents
        .iter()
        .filter(|a| a.state.volumes.lock().contains_key("same"))
        .count();
    assert_eq!(holders, 1);
    h.shutdown().await;
}

/// A silent node's volumes stay listed (unavailable, last state); every
/// operation on them and every sandbox that needs them is UNAVAILABLE
/// naming the node — nothing is moved or recreated elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_nodes_volumes_stay_listed_and_calls_name_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let a = rooted("a", 4, &["busybox"], &h).await;
    let b = rooted("b", 4, &["busybox"], &h).await;
    let (mut c, mut v) = clients(h.local_addr()).await;
    create_volume(&mut v, "data", &node_of("a")).await;
    a.set_heartbeats(false);
    eventually("a silent", async || {
        let got = v.get_volume(vref("data")).await.unwrap().into_inner();
        !got.available
    })
    .await;
    let listed = v.list_volumes(native::ListVolumesRequest {}).await.unwrap();
    let listed = &listed.get_ref().items;
    assert_eq!(listed.len(), 1);
    assert!(!listed[0].available && listed[0].node_name == "node-a");
    let calls = a.state.volume_calls.lock().len();
    let snap = native::CreateVolumeSnapshotRequest {
        volume: "data".into(),
        name: "s".into(),
    };
    assert_code(
        v.create_volume_snapshot(snap).await,
        Code::Unavailable,
        &["node-a"],
    );
    assert_code(
        v.delete_volume(vref("data")).await,
        Code::Unavailable,
        &["node-a"],
    );
    let fork = native::ForkVolumeRequest {
        source: "data".into(),
        name: "copy".into(),
        ..Default::default()
    };
    assert_code(v.fork_volume(fork).await, Code::Unavailable, &["node-a"]);
    // The name stays taken while its node is silent.
    assert_code(
        v.create_volume(new_volume("data")).await,
        Code::AlreadyExists,
        &[],
    );
    let s = sandbox("needs-data", vec![pvc("data", "/data", |_| {})]);
    assert_code(c.create_sandbox(s).await, Code::Unavailable, &["node-a"]);
    assert_eq!(
        a.state.volume_calls.lock().len(),
        calls,
        "a silent agent is not called"
    );
    assert_eq!(b.held(), 0, "not placed elsewhere");
    a.set_heartbeats(true);
    eventually("a back", async || {
        v.get_volume(vref("data"))
            .await
            .unwrap()
            .get_ref()
            .available
    })
    .await;
    let s = sandbox("needs-data", vec![pvc("data", "/data", |_| {})]);
    let got = c.create_sandbox(s).await.unwrap().into_inner();
    assert_eq!(got.status.unwrap().agent_id, "a");
    h.shutdown().await;
}

/// A sandbox that mounts existing volumes goes to their node, whatever the
/// image affinity says; when it cannot, it is refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_go_where_their_volumes_are_or_nowhere() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let a = rooted("a", 4, &["busybox"], &h).await;
    let b = rooted("b", 2, &[], &h).await;
    let (mut c, mut v) = clients(h.local_addr()).await;
    create_volume(&mut v, "data", &node_of("b")).await;
    create_volume(&mut v, "other", &node_of("a")).await;
    let ro = native::CreateVolumeRequest {
        access_mode: native::AccessMode::ReadOnlyMany as i32,
        node_name: node_of("b"),
        ..new_volume("shared")
    };
    v.create_volume(ro).await.unwrap();

    let s = sandbox("s1", vec![pvc("data", "/data", |_| {})]);
    let s1 = c.create_sandbox(s).await.unwrap().into_inner();
    assert_eq!(s1.status.as_ref().unwrap().agent_id, "b", "volume affinity");
    let spec = b.state.specs.lock().values().next().cloned().unwrap();
    assert_eq!(spec.volume_mounts.len(), 1);
    assert_eq!(
        (
            spec.volume_mounts[0].volume.as_str(),
            spec.volume_mounts[0].mount_path.as_str()
        ),
        ("data", "/data")
    );
    assert!(spec.host_mounts.is_empty());
    assert_eq!(pvcs(&s1)[0].claim_name, "data");
    // The volume names its holder by namespace and name.
    let data = v.get_volume(vref("data")).await.unwrap().into_inner();
    assert_eq!(data.mounts.len(), 1);
    assert_eq!(
        (
            data.mounts[0].namespace.as_str(),
            data.mounts[0].sandbox_name.as_str()
        ),
        ("default", "s1")
    );
    // Delete and restore are refused while it is mounted.
    assert_code(
        v.delete_volume(vref("data")).await,
        Code::FailedPrecondition,
        &[],
    );

    // A second read-write mount of a ReadWriteOnce volume: the agent's
    // refusal, as FAILED_PRECONDITION; no slot stays held.
    let s = sandbox("s2", vec![pvc("data", "/data", |_| {})]);
    assert_code(c.create_sandbox(s).await, Code::FailedPrecondition, &[]);
    assert_eq!(h.core().registry().allocated(&"b".into()), Some(1));
    // ReadOnlyMany mounted read-write: refused naming the mode.
    let s = sandbox("s3", vec![pvc("shared", "/s", |_| {})]);
    assert_code(
        c.create_sandbox(s).await,
        Code::FailedPrecondition,
        &["ReadOnlyMany"],
    );
    // Volumes on two nodes.
    let two = vec![pvc("data", "/data", |_| {}), pvc("other", "/other", |_| {})];
    assert_code(
        c.create_sandbox(sandbox("s4", two)).await,
        Code::FailedPrecondition,
        &["node-a", "node-b", "data", "other"],
    );
    // Missing, without createIfMissing.
    let s = sandbox("s5", vec![pvc("ghost", "/g", |_| {})]);
    assert_code(c.create_sandbox(s).await, Code::NotFound, &["ghost"]);
    // b full: never a, although a has room and the image.
    let mut ro_mount = pvc("shared", "/s", |_| {});
    ro_mount.read_only = true;
    c.create_sandbox(sandbox("s6", vec![ro_mount.clone()]))
        .await
        .unwrap();
    assert_code(
        c.create_sandbox(sandbox("s7", vec![ro_mount])).await,
        Code::ResourceExhausted,
        &["agent b"],
    );
    assert_eq!(a.held(), 0);
    h.shutdown().await;
}

/// `createIfMissing` makes the volume on the node the sandbox lands on (one
/// with a volume root), before the sandbox; `deleteOnSandboxDelete` removes
/// only what the create made, after the container.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_volumes_are_made_where_the_sandbox_lands_and_go_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let a = agent("a", 4, &["busybox"], &h).await;
    let b = rooted("b", 4, &[], &h).await;
    let (mut c, mut v) = clients(h.local_addr()).await;
    let scratch = |delete: bool| {
        pvc("scratch", "/scratch", move |p| {
            p.create_if_missing = true;
            p.delete_on_sandbox_delete = delete;
            p.size = "2Gi".into();
            p.access_mode = native::AccessMode::ReadWriteMany as i32;
        })
    };
    let s = c
        .create_sandbox(sandbox("s1", vec![scratch(true)]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        s.status.as_ref().unwrap().agent_id,
        "b",
        "the node with a volume root"
    );
    assert!(pvcs(&s)[0].created_by_sandbox);
    let made = b.state.volumes.lock().get("scratch").cloned().unwrap();
    let spec = made.spec.unwrap();
    assert_eq!(
        (spec.size_bytes, spec.access_mode),
        (2 << 30, native::AccessMode::ReadWriteMany as i32)
    );
    // A second sandbox finds it and goes to b too (RWX: both read-write).
    let s2 = c
        .create_sandbox(sandbox("s2", vec![scratch(true)]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s2.status.as_ref().unwrap().agent_id, "b");
    assert!(!pvcs(&s2)[0].created_by_sandbox, "it existed");
    let del = |n: &str| native::DeleteSandboxRequest { sandbox: sref(n) };
    c.delete_sandbox(del("s2")).await.unwrap();
    assert!(
        b.state.volumes.lock().contains_key("scratch"),
        "s2 did not make it"
    );
    c.delete_sandbox(del("s1")).await.unwrap();
    assert!(
        !b.state.volumes.lock().contains_key("scratch"),
        "s1 made it and asked"
    );
    assert_code(v.get_volume(vref("scratch")).await, Code::NotFound, &[]);
    // Made but not asked to go: stays.
    c.create_sandbox(sandbox("s3", vec![scratch(false)]))
        .await
        .unwrap();
    c.delete_sandbox(del("s3")).await.unwrap();
    assert!(b.state.volumes.lock().contains_key("scratch"));
    // A create that fails after the volume was made takes it back.
    b.state.fail_creates.store(true, SeqCst);
    let fresh = pvc("fresh", "/f", |p| p.create_if_missing = true);
    assert_code(
        c.create_sandbox(sandbox("s4", vec![fresh])).await,
        Code::Unavailable,
        &[],
    );
    assert!(!b.state.volumes.lock().contains_key("fresh"));
    assert_code(v.get_volume(vref("fresh")).await, Code::NotFound, &[]);
    b.state.fail_creates.store(false, SeqCst);
    // The second of two volumes to make cannot be made: the first goes
    // again (the names stay locked meanwhile: nothing else may take them).
    b.state.refuse_volumes.lock().insert("two".into());
    let both = vec![
        pvc("one", "/one", |p| p.create_if_missing = true),
        pvc("two", "/two", |p| p.create_if_missing = true),
    ];
    let failed = tokio::time::timeout(
        Duration::from_secs(10),
        c.create_sandbox(sandbox("s6", both)),
    )
    .await
    .expect("a failed volume create must not hang the sandbox create");
    assert_code(failed, Code::ResourceExhausted, &["node-b", "full"]);
    assert!(!b.state.volumes.lock().contains_key("one"));
    assert_code(v.get_volume(vref("one")).await, Code::NotFound, &[]);
    // No node with a volume root in the pool: nowhere to make it.
    b.state.volume_root.store(false, SeqCst);
    b.heartbeat_once().await;
    let none = pvc("nowhere", "/n", |p| p.create_if_missing = true);
    assert_code(
        c.create_sandbox(sandbox("s5", vec![none])).await,
        Code::ResourceExhausted,
        &["volume root"],
    );
    assert_eq!(a.held(), 0);
    h.shutdown().await;
}

/// Attach and detach: only on the volume's node (FAILED_PRECONDITION naming
/// both nodes otherwise), forwarded to the agent, and the record's spec
/// follows with a new generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attach_and_detach_follow_the_node_and_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let a = rooted("a", 4, &["busybox"], &h).await;
    let _b = rooted("b", 4, &[], &h).await;
    let (mut c, mut v) = clients(h.local_addr()).await;
    create_volume(&mut v, "near", &node_of("a")).await;
    create_volume(&mut v, "far", &node_of("b")).await;
    let s = c
        .create_sandbox(sandbox("s", vec![]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.status.as_ref().unwrap().agent_id, "a");
    let attach = |vol: native::Volume| native::AttachVolumeRequest {
        sandbox: sref("s"),
        volume: Some(vol),
    };
    assert_code(
        c.attach_volume(attach(pvc("far", "/far", |_| {}))).await,
        Code::FailedPrecondition,
        &["node-a", "node-b", "far"],
    );
    let got = c
        .attach_volume(attach(pvc("near", "/near", |_| {})))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.generation, s.generation + 1);
    assert_eq!(pvcs(&got)[0].claim_name, "near");
    let sid = s.status.as_ref().unwrap().container_id.clone();
    let mounted = |vol: &str| {
        a.state.sandboxes.lock()[&sid]
            .volume_mounts
            .iter()
            .any(|m| m.volume == vol)
    };
    assert!(mounted("near"));
    assert_eq!(pvcs(&get_sandbox(&mut c, "s").await).len(), 1);
    assert_code(
        c.attach_volume(attach(pvc("near", "/again", |_| {}))).await,
        Code::InvalidArgument,
        &["at most once"],
    );
    let host = native::Volume {
        name: "h".into(),
        source: Some(native::volume::Source::Host(native::HostPathSource {
            path: "/srv".into(),
        })),
        mount_path: "/h".into(),
        ..Default::default()
    };
    assert_code(
        c.attach_volume(attach(host)).await,
        Code::InvalidArgument,
        &["volume.host"],
    );
    assert_code(
        c.attach_volume(attach(pvc("ghost", "/g", |_| {}))).await,
        Code::NotFound,
        &["ghost"],
    );
    // Missing and createIfMissing: made on the sandbox's node.
    let made = c
        .attach_volume(attach(pvc("made", "/made", |p| p.create_if_missing = true)))
        .await
        .unwrap()
        .into_inner();
    assert!(
        pvcs(&made)
            .iter()
            .any(|p| p.claim_name == "made" && p.created_by_sandbox)
    );
    assert!(a.state.volumes.lock().contains_key("made") && mounted("made"));
    assert_code(
        v.delete_volume(vref("made")).await,
        Code::FailedPrecondition,
        &[],
    );

    let detach = |vol: &str| native::DetachVolumeRequest {
        sandbox: sref("s"),
        volume: vol.into(),
    };
    let after = c.detach_volume(detach("near")).await.unwrap().into_inner();
    assert_eq!(after.generation, made.generation + 1);
    assert!(pvcs(&after).iter().all(|p| p.claim_name != "near"));
    assert!(!mounted("near"));
    assert_code(
        c.detach_volume(detach("near")).await,
        Code::NotFound,
        &["near"],
    );
    // Unmounted: it can go now; the volume itself outlived the detach.
    v.delete_volume(vref("near")).await.unwrap();
    h.shutdown().await;
}

/// A restarted controller makes no new volume name before the agents it
/// knows from its store have reported their volumes: one of them may hold
/// the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_controller_waits_for_its_agents_before_new_names() {
    let dir = tempfile::tempdir().unwrap();
    let h = start(dir.path()).await;
    let a = rooted("a", 4, &[], &h).await;
    let (_, mut v) = clients(h.local_addr()).await;
    create_volume(&mut v, "kept", "").await;
    a.set_heartbeats(false);
    h.shutdown().await;

    let mut cfg = standin_config(dir.path());
    cfg.startup_grace = Duration::from_secs(60);
    let h = Controller::start(cfg).await.unwrap();
    a.retarget(h.local_addr());
    let (_, mut v) = clients(h.local_addr()).await;
    assert_code(
        v.create_volume(new_volume("kept")).await,
        Code::Unavailable,
        &["restarted"],
    );
    let fork = native::ForkVolumeRequest {
        source: "kept".into(),
        name: "other".into(),
        ..Default::default()
    };
    assert_code(v.fork_volume(fork).await, Code::Unavailable, &[]);
    a.set_heartbeats(true);
    assert!(h.wait_ready(Duration::from_secs(10)).await);
    assert_code(
        v.create_volume(new_volume("kept")).await,
        Code::AlreadyExists,
        &["node-a"],
    );
    create_volume(&mut v, "new", "").await;
    h.shutdown().await;
}

/// AUTO_RECREATE moves a sandbox off a gone node, except one that mounts
/// its local volumes: that one fails, saying why; it is never recreated
/// elsewhere without its data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_recreate_never_moves_a_sandbox_away_from_its_volumes() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(node_deleted_config(dir.path()))
        .await
        .unwrap();
    let a = rooted("a", 4, &["busybox"], &h).await;
    let (mut c, mut v) = clients(h.local_addr()).await;
    create_volume(&mut v, "work", &node_of("a")).await;
    let recreate = |name: &str, volumes| {
        with_spec(sandbox(name, volumes), |s| {
            s.failure_policy = native::FailurePolicy::AutoRecreate as i32;
        })
    };
    c.create_sandbox(recreate("pinned", vec![pvc("work", "/w", |_| {})]))
        .await
        .unwrap();
    c.create_sandbox(recreate("free", vec![])).await.unwrap();
    let b = agent("b", 4, &["busybox"], &h).await;
    a.set_heartbeats(false);
    eventually("the free sandbox recreated on b", async || {
        let s = get_sandbox(&mut c, "free").await;
        s.status.unwrap().agent_id == "b"
    })
    .await;
    eventually("the pinned sandbox failed", async || {
        let s = get_sandbox(&mut c, "pinned").await;
        s.status.unwrap().phase == native::Phase::Failed as i32
    })
    .await;
    let s = get_sandbox(&mut c, "pinned").await;
    let status = s.status.unwrap();
    assert_eq!(status.agent_id, "a");
    assert!(
        status.message.contains("cannot move") && status.message.contains("work"),
        "{}",
        status.message
    );
    assert_eq!(b.held(), 1, "only the free sandbox moved");
    h.shutdown().await;
}
