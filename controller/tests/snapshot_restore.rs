//! Creating sandboxes from a sandbox snapshot (`spec.snapshot_id`) in the
//! controller, through its real gRPC port, with AgentService **stand-ins**
//! (see `support/standin.rs`: snapshots, sandboxes and volumes are tables
//! with the agent's rules, no data). Stand-ins because these tests are
//! about the controller's decisions with several nodes — where a restore
//! goes, what the agent is asked, which volumes are forked and removed,
//! the codes it answers when the snapshot's node cannot take it. The data
//! path (containerd snapshots, overlay upper dirs) runs on real agents in
//! `tests/tests/snapshots_sdk.rs` and `agent/tests/`.

use crate::support;

use std::net::SocketAddr;
use std::sync::atomic::Ordering::SeqCst;

use sandbolt_controller::store::{SnapshotPhase, SnapshotRecord};
use sandbolt_controller::{Controller, ControllerHandle};
use sandbolt_proto::agent::v1 as agent_pb;
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
type Snaps = native::snapshot_service_client::SnapshotServiceClient<Channel>;
type Pools = native::warm_pool_service_client::WarmPoolServiceClient<Channel>;

const MOVE: &str = "snapshots do not move between nodes";

struct Clients {
    sandboxes: Native,
    volumes: Vols,
    snapshots: Snaps,
}

async fn clients(addr: SocketAddr) -> Clients {
    let url = format!("http://{addr}");
    Clients {
        sandboxes: Native::connect(url.clone()).await.unwrap(),
        volumes: Vols::connect(url.clone()).await.unwrap(),
        snapshots: Snaps::connect(url).await.unwrap(),
    }
}

async fn agent(id: &str, cap: i32, h: &ControllerHandle) -> StandInAgent {
    StandInAgent::start(id, "default", cap, &["busybox"], h.local_addr(), HB).await
}

/// A create from snapshot `id`, image left to the snapshot.
fn restore(name: &str, id: &str) -> native::CreateSandboxRequest {
    native::CreateSandboxRequest {
        request_id: name.into(),
        name: name.into(),
        spec: Some(native::SandboxSpec {
            snapshot_id: id.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Captures `source` through the SnapshotService and waits for READY.
async fn snapshot(c: &mut Clients, source: &str) -> native::Snapshot {
    let s = c
        .snapshots
        .create_snapshot(native::CreateSnapshotRequest {
            request_id: format!("snap-of-{source}"),
            sandbox: sref(source),
            wait: true,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("snapshot of {source}: {e}"))
        .into_inner();
    assert_eq!(
        s.phase,
        native::SnapshotPhase::Ready as i32,
        "snapshot of {source}: {}",
        s.message
    );
    s
}

async fn get_snapshot(c: &mut Clients, id: &str) -> Result<native::Snapshot, tonic::Status> {
    c.snapshots
        .get_snapshot(native::SnapshotRef {
            id: id.into(),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner())
}

async fn create(c: &mut Clients, q: native::CreateSandboxRequest) -> native::Sandbox {
    let name = q.name.clone();
    c.sandboxes
        .create_sandbox(q)
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"))
        .into_inner()
}

async fn get_sandbox(c: &mut Clients, name: &str) -> native::Sandbox {
    c.sandboxes
        .get_sandbox(native::GetSandboxRequest {
            sandbox: sref(name),
        })
        .await
        .unwrap_or_else(|e| panic!("get {name}: {e}"))
        .into_inner()
}

async fn delete(c: &mut Clients, name: &str) {
    c.sandboxes
        .delete_sandbox(native::DeleteSandboxRequest {
            sandbox: sref(name),
        })
        .await
        .unwrap_or_else(|e| panic!("delete {name}: {e}"));
}

fn status(s: &native::Sandbox) -> &native::SandboxStatus {
    s.status.as_ref().unwrap()
}

/// The spec the stand-in's create of `s` carried.
fn agent_spec(a: &StandInAgent, s: &native::Sandbox) -> agent_pb::SandboxSpec {
    a.state
        .specs
        .lock()
        .get(&status(s).container_id)
        .cloned()
        .unwrap_or_else(|| panic!("agent {} never created {}", a.id, s.name))
}

/// A restore goes to the snapshot's agent even when another one is
/// emptier, with the snapshot's id and image in the agent's spec; the
/// image may be left out or name the snapshot's, nothing else; unknown
/// snapshots (also of another namespace) are NOT_FOUND; a volume of another
/// node cannot come along; a restore is never a warm pool member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_runs_on_the_snapshots_node_from_its_snapshot_and_image() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(standin_config(dir.path())).await.unwrap();
    let a = agent("a", 4, &h).await;
    let b = agent("b", 4, &h).await.with_volume_root().await;
    let mut c = clients(h.local_addr()).await;
    let src = create(&mut c, sandbox("src", vec![])).await;
    assert_eq!(status(&src).agent_id, "a", "a tie goes to the first name");
    let snap = snapshot(&mut c, "src").await;
    assert_eq!(snap.agent_id, "a");

    let r1 = create(&mut c, restore("r1", &snap.id)).await;
    assert_eq!(
        status(&r1).agent_id,
        "a",
        "b is emptier, but the snapshot is on a"
    );
    let spec = r1.spec.as_ref().unwrap();
    assert_eq!(
        spec.snapshot_id, snap.id,
        "the record says what it was made from"
    );
    assert_eq!(spec.image, snap.image, "the snapshot's image");
    let sent = agent_spec(&a, &r1);
    assert_eq!(sent.snapshot_id, snap.id);
    assert_eq!(sent.image, snap.image);
    assert!(!status(&r1).claimed_warm);

    // The same image in another spelling is the snapshot's image.
    let r2 = create(
        &mut c,
        with_spec(restore("r2", &snap.id), |s| {
            s.image = "docker.io/library/busybox:latest".into();
        }),
    )
    .await;
    assert_eq!(status(&r2).agent_id, "a");
    // Without a snapshot the emptier agent wins: the pin made the difference.
    let plain = create(&mut c, sandbox("plain", vec![])).await;
    assert_eq!(status(&plain).agent_id, "b");

    let other_image = with_spec(restore("r3", &snap.id), |s| s.image = "alpine".into());
    assert_code(
        c.sandboxes.create_sandbox(other_image).await,
        Code::InvalidArgument,
        &["image", "alpine", &snap.id],
    );
    assert_code(
        c.sandboxes
            .create_sandbox(restore("r4", "no-such-snapshot"))
            .await,
        Code::NotFound,
        &["snapshot no-such-snapshot"],
    );
    let elsewhere = native::CreateSandboxRequest {
        namespace: "other".into(),
        ..restore("r5", &snap.id)
    };
    assert_code(
        c.sandboxes.create_sandbox(elsewhere).await,
        Code::NotFound,
        &[&snap.id],
    );
    // A volume of another node cannot be mounted with the snapshot.
    c.volumes
        .create_volume(native::CreateVolumeRequest {
            name: "far".into(),
            node_name: node_of("b"),
            ..Default::default()
        })
        .await
        .unwrap();
    let far = with_spec(restore("far", &snap.id), |s| {
        s.volumes = vec![pvc("far", "/far", |_| {})];
    });
    assert_code(
        c.sandboxes.create_sandbox(far).await,
        Code::FailedPrecondition,
        &["volume far", &node_of("b"), &snap.id, &node_of("a")],
    );
    let warm = with_spec(restore("r6", &snap.id), |s| s.warm_pool = "bb".into());
    assert_code(
        c.sandboxes.create_sandbox(warm).await,
        Code::InvalidArgument,
        &["warmPool", &snap.id],
    );
    assert_eq!((a.held(), b.held()), (3, 1), "refusals start nothing");
    h.shutdown().await;
}

/// Only READY snapshots are restored: PENDING, FAILED and DELETING ones
/// answer FAILED_PRECONDITION naming the phase, and nothing is started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_that_are_not_ready_are_refused_naming_their_phase() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(standin_config(dir.path())).await.unwrap();
    let a = agent("a", 4, &h).await;
    let mut c = clients(h.local_addr()).await;
    let phases = [
        (SnapshotPhase::Pending, "PENDING"),
        (SnapshotPhase::Failed, "FAILED"),
        (SnapshotPhase::Deleting, "DELETING"),
    ];
    for (phase, said) in phases {
        let id = format!("snap-{}", said.to_lowercase());
        h.core()
            .store()
            .put_snapshot(&SnapshotRecord {
                id: id.clone(),
                namespace: "default".into(),
                uid: format!("uid-{id}"),
                phase,
                agent_id: "a".into(),
                node_name: node_of("a"),
                image: "busybox".into(),
                ..Default::default()
            })
            .unwrap();
        assert_code(
            c.sandboxes
                .create_sandbox(restore(&format!("from-{id}"), &id))
                .await,
            Code::FailedPrecondition,
            &[&id, said],
        );
    }
    assert_eq!(a.held(), 0);
    h.shutdown().await;
}

/// The snapshot's agent silent or full: FAILED_PRECONDITION saying that
/// snapshots do not move between nodes, although another agent has room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_never_moves_when_its_snapshots_node_cannot_take_it() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(standin_config(dir.path())).await.unwrap();
    let a = agent("a", 2, &h).await;
    let b = agent("b", 4, &h).await;
    let mut c = clients(h.local_addr()).await;
    create(&mut c, sandbox("src", vec![])).await;
    let snap = snapshot(&mut c, "src").await;
    assert_eq!(snap.agent_id, "a");

    a.set_heartbeats(false);
    eventually("agent a silent", async || {
        h.core().agent_silent(&"a".into())
    })
    .await;
    assert_code(
        c.sandboxes.create_sandbox(restore("r1", &snap.id)).await,
        Code::FailedPrecondition,
        &[&snap.id, &node_of("a"), "not heartbeating", MOVE],
    );
    a.set_heartbeats(true);
    eventually("agent a back", async || !h.core().agent_silent(&"a".into())).await;

    create(&mut c, restore("r1", &snap.id)).await;
    assert_eq!(a.held(), 2, "a is full now");
    assert_code(
        c.sandboxes.create_sandbox(restore("r2", &snap.id)).await,
        Code::FailedPrecondition,
        &[&snap.id, &node_of("a"), "no free slot", MOVE],
    );
    assert_eq!(b.held(), 0, "b had room and got nothing");
    assert_eq!(a.state.overcommits.load(SeqCst), 0);
    h.shutdown().await;
}

/// A restore is never served by a warm claim, even where a warm sandbox
/// of its image waits; a create from the image takes that one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_does_not_claim_a_warm_sandbox_of_its_image() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(standin_config(dir.path())).await.unwrap();
    let a = agent("a", 8, &h).await;
    let mut c = clients(h.local_addr()).await;
    create(&mut c, sandbox("src", vec![])).await;
    let snap = snapshot(&mut c, "src").await;
    let mut pools = Pools::connect(format!("http://{}", h.local_addr()))
        .await
        .unwrap();
    pools
        .create_warm_pool(native::CreateWarmPoolRequest {
            pool: Some(native::WarmPool {
                name: "bb".into(),
                template: Some(native::WarmTemplate {
                    image: "busybox".into(),
                    ..Default::default()
                }),
                capacity: Some(native::WarmCapacity {
                    buffer_min: 1,
                    buffer_max: 1,
                    pool_min: 0,
                    pool_max: 4,
                }),
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    // The stand-in keeps no warm sandboxes: its heartbeats are replaced by
    // ones that report one of the pool's.
    a.set_heartbeats(false);
    let warm_inventory = || agent_pb::Inventory {
        agent_id: "a".into(),
        instance_id: "stand-in".into(),
        node_name: node_of("a"),
        pool: "default".into(),
        max_sandboxes: a.capacity,
        images: vec![agent_pb::ImageInfo {
            references: vec!["busybox".into()],
            ..Default::default()
        }],
        sandboxes: a.state.sandboxes.lock().values().cloned().collect(),
        api_endpoint: a.addr.to_string(),
        proxy_endpoint: format!("127.0.0.1:{}", a.addr.port() + 10000),
        warm: vec![agent_pb::WarmSandbox {
            sandbox_id: "warm-1".into(),
            class: Some(agent_pb::WarmClass {
                warm_pool: "bb".into(),
                image: "docker.io/library/busybox:latest".into(),
                ..Default::default()
            }),
            created_at_unix_ms: 1,
        }],
        ..Default::default()
    };
    h.core().on_heartbeat(&warm_inventory()).unwrap();

    let r1 = create(&mut c, restore("r1", &snap.id)).await;
    assert_ne!(status(&r1).container_id, "warm-1", "a restore claimed");
    assert!(!status(&r1).claimed_warm);
    assert!(r1.spec.as_ref().unwrap().warm_pool.is_empty());
    // The warm sandbox was claimable all along: a create of its image takes it.
    h.core().on_heartbeat(&warm_inventory()).unwrap();
    let plain = create(&mut c, sandbox("plain", vec![])).await;
    assert_eq!(status(&plain).container_id, "warm-1");
    h.shutdown().await;
}

/// The source's read-write volumes come back as forks of the volume
/// snapshots taken with it (one per restore, on the snapshot's node,
/// removed with the restored sandbox); read-only ones are mounted again
/// read-only; a request volume where the snapshot mounts one is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restores_fork_read_write_volumes_and_remove_the_forks_with_them() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(standin_config(dir.path())).await.unwrap();
    let a = agent("a", 8, &h).await.with_volume_root().await;
    let _b = agent("b", 8, &h).await.with_volume_root().await;
    let mut c = clients(h.local_addr()).await;
    for name in ["work", "ref"] {
        c.volumes
            .create_volume(native::CreateVolumeRequest {
                name: name.into(),
                node_name: node_of("a"),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let src = sandbox(
        "src",
        vec![
            pvc("work", "/work", |_| {}),
            native::Volume {
                read_only: true,
                ..pvc("ref", "/ref", |_| {})
            },
        ],
    );
    create(&mut c, src).await;
    let snap = snapshot(&mut c, "src").await;
    let sbs = format!("sbs-{}", snap.id);
    let mut rw: Vec<_> = snap
        .volumes
        .iter()
        .map(|v| (v.volume.as_str(), v.volume_snapshot.as_str()))
        .collect();
    rw.sort();
    assert_eq!(rw, [("ref", ""), ("work", sbs.as_str())]);
    // The volume snapshot the capture takes (the stand-in's capture records
    // only its name).
    match c
        .volumes
        .create_volume_snapshot(native::CreateVolumeSnapshotRequest {
            volume: "work".into(),
            name: sbs.clone(),
        })
        .await
    {
        Ok(_) => {}
        Err(e) if e.code() == Code::AlreadyExists => {}
        Err(e) => panic!("volume snapshot {sbs}: {e}"),
    }

    let clash = with_spec(restore("clash", &snap.id), |s| {
        s.volumes = vec![native::Volume {
            name: "mine".into(),
            source: Some(native::volume::Source::Host(native::HostPathSource {
                path: "/srv/mine".into(),
            })),
            mount_path: "/work".into(),
            ..Default::default()
        }];
    });
    assert_code(
        c.sandboxes.create_sandbox(clash).await,
        Code::InvalidArgument,
        &["volumes[mine]", "/work", "work"],
    );

    let r1 = create(&mut c, restore("r1", &snap.id)).await;
    let r2 = create(&mut c, restore("r2", &snap.id)).await;
    let forks: Vec<String> = [&r1, &r2].iter().map(|r| fork_of(r, "/work")).collect();
    assert_ne!(forks[0], forks[1], "each restore has its own fork");
    for (r, fork) in [&r1, &r2].iter().zip(&forks) {
        assert!(fork.starts_with("work-"), "{fork}");
        let info = a
            .state
            .volumes
            .lock()
            .get(fork)
            .cloned()
            .expect("the fork is on a");
        assert_eq!(info.forked_from, format!("work@{sbs}"));
        let mounts = agent_spec(&a, r).volume_mounts;
        let at = |p: &str| mounts.iter().find(|m| m.mount_path == p).cloned().unwrap();
        assert_eq!(
            (at("/work").volume.as_str(), at("/work").read_only),
            (fork.as_str(), false)
        );
        assert_eq!(
            (at("/ref").volume.as_str(), at("/ref").read_only),
            ("ref", true)
        );
    }
    let forked = a
        .state
        .volume_calls
        .lock()
        .iter()
        .filter(|c| *c == "fork work")
        .count();
    assert_eq!(forked, 2);

    delete(&mut c, "r1").await;
    let left: Vec<String> = a.state.volumes.lock().keys().cloned().collect();
    assert!(
        !left.contains(&forks[0]),
        "r1's fork went with it: {left:?}"
    );
    assert!(
        left.contains(&forks[1])
            && left.contains(&"work".to_string())
            && left.contains(&"ref".to_string()),
        "{left:?}"
    );
    h.shutdown().await;
}

/// The claim name of the volume `s` mounts at `path`, which its create made.
fn fork_of(s: &native::Sandbox, path: &str) -> String {
    let v = s
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .iter()
        .find(|v| v.mount_path == path)
        .unwrap_or_else(|| panic!("{} mounts nothing at {path}", s.name));
    match &v.source {
        Some(native::volume::Source::Pvc(p)) => {
            assert!(p.created_by_sandbox && p.delete_on_sandbox_delete, "{p:?}");
            assert!(!v.read_only);
            p.claim_name.clone()
        }
        other => panic!("pvc expected, got {other:?}"),
    }
}

/// A snapshot whose deletion waits for the sandboxes restored from it
/// (DELETING) restores no more, and goes once the last of them is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_last_restore_releases_a_deleting_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(standin_config(dir.path())).await.unwrap();
    let a = agent("a", 4, &h).await;
    let mut c = clients(h.local_addr()).await;
    create(&mut c, sandbox("src", vec![])).await;
    let snap = snapshot(&mut c, "src").await;
    create(&mut c, restore("r1", &snap.id)).await;
    let deleting = c
        .snapshots
        .delete_snapshot(native::SnapshotRef {
            id: snap.id.clone(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(deleting.phase, native::SnapshotPhase::Deleting as i32);
    assert_eq!(deleting.in_use_by, ["r1"]);
    assert_code(
        c.sandboxes.create_sandbox(restore("r2", &snap.id)).await,
        Code::FailedPrecondition,
        &["DELETING"],
    );
    assert!(a.state.snapshots.lock().contains_key(&snap.id));

    delete(&mut c, "r1").await;
    assert_code(get_snapshot(&mut c, &snap.id).await, Code::NotFound, &[]);
    assert!(
        !a.state.snapshots.lock().contains_key(&snap.id),
        "removed on its node"
    );
    h.shutdown().await;
}

/// AUTO_RECREATE cannot move a restored sandbox off a gone node: its
/// snapshot was there. It fails, saying so; a sandbox from an image moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_recreate_fails_a_restore_whose_node_is_gone() {
    let dir = tempfile::tempdir().unwrap();
    let h = Controller::start(node_deleted_config(dir.path()))
        .await
        .unwrap();
    let a = agent("a", 4, &h).await;
    let mut c = clients(h.local_addr()).await;
    create(&mut c, sandbox("src", vec![])).await;
    let snap = snapshot(&mut c, "src").await;
    let auto = |s: &mut native::SandboxSpec| {
        s.failure_policy = native::FailurePolicy::AutoRecreate as i32;
    };
    create(&mut c, with_spec(restore("restored", &snap.id), auto)).await;
    create(&mut c, with_spec(sandbox("free", vec![]), auto)).await;
    let b = agent("b", 4, &h).await;
    a.set_heartbeats(false);
    eventually("the free sandbox recreated on b", async || {
        status(&get_sandbox(&mut c, "free").await).agent_id == "b"
    })
    .await;
    eventually("the restored sandbox failed", async || {
        status(&get_sandbox(&mut c, "restored").await).phase == native::Phase::Failed as i32
    })
    .await;
    let s = get_sandbox(&mut c, "restored").await;
    assert_eq!(status(&s).agent_id, "a");
    let msg = &status(&s).message;
    assert!(
        msg.contains("snapshot lived on the lost node") && msg.contains(&snap.id),
        "{msg}"
    );
    assert_eq!(b.held(), 1, "only the free sandbox moved");
    h.shutdown().await;
}
