//! Sandbox snapshots on a real containerd and runc: a capture commits a
//! sandbox's writable layer (new files, deleted image files, directories,
//! links, modes) as `sandbolt-snapshot-<id>`; sandboxes restored from it see
//! that state (not the source's later writes) and diverge independently;
//! the snapshot cannot be deleted while a restored sandbox exists; a paused
//! source stays paused and a running one runs again; captures are
//! idempotent by id; named volumes mounted read-write get a `sbs-<id>`
//! volume snapshot taken in the same freeze; a failed capture leaves
//! nothing; a restarted agent cleans up after a capture that died. Every
//! call goes through AgentService (tonic, bearer token).

use crate::common;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};

use common::*;
use containerd_client::services::v1::snapshots::{PrepareSnapshotRequest, StatSnapshotRequest};
use containerd_client::services::v1::{GetContainerRequest, PauseTaskRequest};
use sandbolt_agent::labels;
use sandbolt_proto::agent::v1::{
    AccessMode, CreateSnapshotRequest, CreateVolumeRequest, CreateVolumeSnapshotRequest,
    GetInventoryRequest, NamedVolumeMount, SandboxPhase, SandboxRef, SandboxSpec, SnapshotInfo,
    SnapshotRef, SnapshotVolume, VolumeRef, VolumeSpec,
};
use tonic::Code;

const SNAPSHOTTER: &str = "overlayfs";

/// Runs `script` inside sandbox `id` (`ctr tasks exec`); returns (success,
/// stdout+stderr).
fn exec(env: &Env, id: &str, script: &str) -> (bool, String) {
    static N: AtomicU32 = AtomicU32::new(0);
    let exec_id = format!("snap-{}", N.fetch_add(1, Ordering::Relaxed));
    let out = env
        .bed
        .ctr(NS)
        .args(["tasks", "exec", "--exec-id", &exec_id, id, "sh", "-c"])
        .arg(format!("({script}) 2>&1"))
        .output()
        .expect("run ctr tasks exec");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// [`exec`] that must succeed; returns its output.
fn exec_ok(env: &Env, id: &str, script: &str) -> String {
    let (ok, out) = exec(env, id, script);
    assert!(ok, "in {id}: {script}: {out}");
    out
}

/// A sandbox that only waits (commands come through `ctr tasks exec`).
fn idle(id: &str) -> SandboxSpec {
    sh_spec(id, "exec sleep 100000")
}

/// [`idle`], restored from `snapshot`.
fn restored(id: &str, snapshot: &str) -> SandboxSpec {
    SandboxSpec {
        snapshot_id: snapshot.into(),
        ..idle(id)
    }
}

async fn create_ok(env: &mut Env, spec: SandboxSpec) {
    let id = spec.sandbox_id.clone();
    env.create(spec)
        .await
        .unwrap_or_else(|e| panic!("create {id}: {e:?}"));
}

async fn capture(env: &Env, snapshot: &str, sandbox: &str) -> Result<SnapshotInfo, tonic::Status> {
    env.client
        .clone()
        .create_snapshot(CreateSnapshotRequest {
            snapshot_id: snapshot.into(),
            sandbox_id: sandbox.into(),
        })
        .await
        .map(tonic::Response::into_inner)
}

/// Deletes `snapshot`, which must be allowed; returns whether it existed.
async fn deleted(env: &Env, snapshot: &str) -> bool {
    delete_snapshot(env, snapshot)
        .await
        .unwrap_or_else(|e| panic!("delete snapshot {snapshot}: {e:?}"))
}

async fn delete_snapshot(env: &Env, snapshot: &str) -> Result<bool, tonic::Status> {
    env.client
        .clone()
        .delete_snapshot(SnapshotRef {
            snapshot_id: snapshot.into(),
        })
        .await
        .map(|r| r.into_inner().existed)
}

/// The snapshots the agent's inventory reports.
async fn inventory_snapshots(env: &Env) -> Vec<SnapshotInfo> {
    env.client
        .clone()
        .get_inventory(GetInventoryRequest {})
        .await
        .expect("inventory")
        .into_inner()
        .snapshots
}

/// Snapshot names in containerd starting with `prefix`.
fn snapshots_named(env: &Env, prefix: &str) -> BTreeSet<String> {
    env.ctr(&["snapshots", "--snapshotter", SNAPSHOTTER, "list"])
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|k| k.starts_with(prefix))
        .map(String::from)
        .collect()
}

/// The task's status as containerd reports it (`RUNNING`, `PAUSED`, ...).
fn task_status(env: &Env, id: &str) -> String {
    let tasks = env.bed.tasks(NS).unwrap();
    tasks
        .get(id)
        .unwrap_or_else(|| panic!("no task {id}: {tasks:?}"))
        .1
        .clone()
}

/// The container's labels, as containerd has them.
async fn container_labels(env: &Env, id: &str) -> HashMap<String, String> {
    let ctrd = env.agent().sandboxes().containerd();
    ctrd.containers()
        .get(ctrd.req(GetContainerRequest { id: id.into() }))
        .await
        .expect("container")
        .into_inner()
        .container
        .expect("container")
        .labels
}

/// The parent of sandbox `id`'s writable snapshot.
async fn layer_parent(env: &Env, id: &str) -> String {
    let ctrd = env.agent().sandboxes().containerd();
    ctrd.snapshots()
        .stat(ctrd.req(StatSnapshotRequest {
            snapshotter: SNAPSHOTTER.into(),
            key: id.into(),
        }))
        .await
        .expect("snapshot stat")
        .into_inner()
        .info
        .expect("info")
        .parent
}

async fn phase(env: &Env, id: &str) -> SandboxPhase {
    get(&mut env.client.clone(), id).await.unwrap().phase()
}

/// What a sandbox restored from the snapshot of [`MUTATE_A`] sees.
const CHECK_STATE: &str = "cat /work/deep/f; \
     test -e /etc/group || echo no-group; \
     test -e /home || echo no-home; \
     test -e /work/later || echo no-later; \
     readlink /work/link; stat -c 'mode=%a links=%h' /work/deep/f; \
     cd /work && md5sum -c big.md5; head -n1 /etc/passwd";

/// Changes of every kind in the source's writable layer: a new directory
/// tree, a hard link, a symlink, a mode, a deleted image file and image
/// directory (overlay whiteouts), a few MiB of data.
const MUTATE_A: &str = "mkdir -p /work/deep && echo one > /work/deep/f && chmod 600 /work/deep/f \
     && ln /work/deep/f /work/hard && ln -s deep/f /work/link \
     && rm /etc/group && rmdir /home \
     && head -c 8388608 /dev/urandom > /work/big && cd /work && md5sum big > big.md5";

fn assert_snapshot_state(id: &str, out: &str) {
    for want in [
        "one\n",
        "no-group",
        "no-home",
        "no-later",
        "deep/f\n",
        "mode=600 links=2",
        "big: OK",
        "root:x:0:0",
    ] {
        assert!(out.contains(want), "{id} lacks {want:?}: {out}");
    }
    assert!(!out.contains("two"), "{id} sees A's later write: {out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn restores_see_the_snapshot_diverge_and_hold_it_until_gone() {
    let mut env = Env::start().await;
    create_ok(&mut env, idle("snap-a")).await;
    exec_ok(&env, "snap-a", MUTATE_A);

    let info = capture(&env, "s1", "snap-a").await.expect("capture");
    let a = get(&mut env.client, "snap-a").await.unwrap();
    assert_eq!(
        (
            info.snapshot_id.as_str(),
            info.sandbox_id.as_str(),
            info.sandbox_name.as_str(),
            info.sandbox_namespace.as_str(),
            info.image.as_str(),
            info.agent_id.as_str(),
            info.node_name.as_str(),
        ),
        (
            "s1",
            "snap-a",
            "name-snap-a",
            "tests",
            a.image.as_str(),
            "agent-test",
            "agent-test"
        )
    );
    assert!(info.size_bytes >= 8 << 20, "{info:?}");
    assert!(
        info.paused_us > 0 && info.took_us >= info.paused_us,
        "{info:?}"
    );
    eprintln!(
        "capture of ~8 MiB of changes: paused {} us, took {} us",
        info.paused_us, info.took_us
    );
    assert_eq!(a.phase(), SandboxPhase::Running);
    assert_eq!(
        snapshots_named(&env, "sandbolt-snapshot"),
        BTreeSet::from(["sandbolt-snapshot-s1".to_string()]),
        "committed, and no in-progress key left"
    );

    // A keeps changing; the snapshot does not.
    exec_ok(
        &env,
        "snap-a",
        "echo two > /work/deep/f && echo later > /work/later && echo back > /etc/group",
    );
    for id in ["snap-b", "snap-c"] {
        create_ok(&mut env, restored(id, "s1")).await;
        assert_eq!(layer_parent(&env, id).await, "sandbolt-snapshot-s1");
        assert_snapshot_state(id, &exec_ok(&env, id, CHECK_STATE));
    }
    exec_ok(
        &env,
        "snap-b",
        "echo b > /work/deep/f && echo b > /work/only-b",
    );
    let c = exec_ok(
        &env,
        "snap-c",
        "cat /work/deep/f; test -e /work/only-b || echo no-b",
    );
    assert_eq!(c, "one\nno-b\n", "C sees B's writes");
    assert_eq!(exec_ok(&env, "snap-a", "cat /work/deep/f"), "two\n");

    idempotent_and_refused(&mut env, &info).await;
    deleted_only_once_unused(&mut env).await;
    assert!(env.delete_leaving_nothing("snap-a", 0).await);
    env.shutdown().await;
}

/// A second capture answers the first; restores that cannot be are
/// refused with the codes the controller relies on.
async fn idempotent_and_refused(env: &mut Env, first: &SnapshotInfo) {
    let again = capture(env, "s1", "snap-a").await.expect("second capture");
    assert_eq!(&again, first, "the same snapshot, not a new capture");
    let other = capture(env, "s1", "snap-b").await.unwrap_err();
    assert_eq!(other.code(), Code::AlreadyExists, "{other:?}");
    assert_eq!(inventory_snapshots(env).await, vec![first.clone()]);

    let wrong_image = SandboxSpec {
        image: "docker.io/library/alpine:3.19".into(),
        ..restored("snap-x", "s1")
    };
    let e = env.create(wrong_image).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("image"), "{e:?}");
    let e = env.create(restored("snap-y", "nope")).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    let e = env.create(restored("snap-z", "Bad_Id")).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    for id in ["snap-x", "snap-y", "snap-z"] {
        assert_eq!(leftovers(env, id), Vec::<String>::new());
    }
}

/// The snapshot stays while a sandbox restored from it exists, and goes
/// (from containerd and the inventory) once none does.
async fn deleted_only_once_unused(env: &mut Env) {
    for restored in ["snap-b", "snap-c"] {
        let e = delete_snapshot(env, "s1").await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("in use"), "{e:?}");
        assert_eq!(inventory_snapshots(env).await.len(), 1);
        assert!(env.delete_leaving_nothing(restored, 0).await);
    }
    assert!(deleted(env, "s1").await);
    assert_eq!(snapshots_named(env, "sandbolt-snapshot"), BTreeSet::new());
    assert_eq!(inventory_snapshots(env).await, vec![]);
    assert!(!deleted(env, "s1").await);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_source_stays_paused_and_a_running_one_runs() {
    let mut env = Env::start().await;
    create_ok(&mut env, idle("snap-p")).await;
    create_ok(&mut env, idle("snap-r")).await;
    exec_ok(&env, "snap-p", "echo p > /p");
    exec_ok(&env, "snap-r", "echo r > /r");
    env.client
        .pause_sandbox(SandboxRef {
            sandbox_id: "snap-p".into(),
        })
        .await
        .expect("pause");

    let p = capture(&env, "sp", "snap-p").await.expect("capture paused");
    assert_eq!(p.paused_us, 0, "{p:?}");
    assert_eq!(phase(&env, "snap-p").await, SandboxPhase::Paused);
    assert_eq!(task_status(&env, "snap-p"), "PAUSED");

    let r = capture(&env, "sr", "snap-r")
        .await
        .expect("capture running");
    assert!(r.paused_us > 0, "{r:?}");
    assert_eq!(phase(&env, "snap-r").await, SandboxPhase::Running);
    assert_eq!(task_status(&env, "snap-r"), "RUNNING");
    assert_eq!(
        exec_ok(&env, "snap-r", "cat /r && echo alive"),
        "r\nalive\n"
    );
    let labels = container_labels(&env, "snap-r").await;
    assert!(
        !labels.contains_key(labels::FROZEN_FOR_SNAPSHOT),
        "{labels:?}"
    );

    // Only a running or paused sandbox of the API can be captured.
    let e = capture(&env, "sx", "nobody").await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    create_ok(&mut env, sh_spec("snap-exited", "true")).await;
    wait_for_phase(&env.client, "snap-exited", SandboxPhase::Stopped).await;
    let e = capture(&env, "sd", "snap-exited").await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert_eq!(
        snapshots_named(&env, "sandbolt-snapshotting-"),
        BTreeSet::new()
    );

    for s in ["sp", "sr"] {
        assert!(deleted(&env, s).await);
    }
    for id in ["snap-p", "snap-r", "snap-exited"] {
        assert!(env.delete_leaving_nothing(id, 0).await);
    }
    env.shutdown().await;
}

fn named(volume: &str, mount_path: &str, read_only: bool) -> NamedVolumeMount {
    NamedVolumeMount {
        volume: volume.into(),
        sub_path: String::new(),
        mount_path: mount_path.into(),
        read_only,
    }
}

async fn create_volume(env: &mut Env, name: &str, mode: AccessMode) {
    env.client
        .create_volume(CreateVolumeRequest {
            spec: Some(VolumeSpec {
                name: name.into(),
                access_mode: mode as i32,
                size_bytes: 0,
                backend: String::new(),
            }),
        })
        .await
        .unwrap_or_else(|e| panic!("create volume {name}: {e:?}"));
}

/// The names of a volume's snapshots.
async fn volume_snapshots(env: &Env, volume: &str) -> Vec<String> {
    env.client
        .clone()
        .get_volume(VolumeRef {
            name: volume.into(),
        })
        .await
        .expect("volume")
        .into_inner()
        .snapshots
        .into_iter()
        .map(|s| s.name)
        .collect()
}

/// The host path of a volume's snapshot (or, with `""`, live data).
fn volume_path(env: &Env, volume: &str, snapshot: &str) -> std::path::PathBuf {
    let dir = env
        .volume_root
        .as_ref()
        .unwrap()
        .join("volumes")
        .join(volume);
    if snapshot.is_empty() {
        dir.join("data")
    } else {
        dir.join("snapshots").join(snapshot)
    }
}

/// A sandbox mounting `work` read-write at /data and `ref` read-only.
async fn volume_source(env: &mut Env, id: &str) {
    create_volume(env, "work", AccessMode::ReadWriteOnce).await;
    create_volume(env, "ref", AccessMode::ReadWriteMany).await;
    let spec = SandboxSpec {
        volume_mounts: vec![named("work", "/data", false), named("ref", "/ref", true)],
        ..idle(id)
    };
    create_ok(env, spec).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn read_write_volumes_are_snapshotted_in_the_same_freeze() {
    let mut env = Env::start_with_volumes(|_| {}).await;
    volume_source(&mut env, "snap-v").await;
    exec_ok(&env, "snap-v", "echo v1 > /data/f && echo rootfs > /r");

    let info = capture(&env, "sv", "snap-v").await.expect("capture");
    assert_eq!(
        info.volumes,
        vec![
            SnapshotVolume {
                mount: Some(named("work", "/data", false)),
                volume_snapshot: "sbs-sv".into(),
            },
            SnapshotVolume {
                mount: Some(named("ref", "/ref", true)),
                volume_snapshot: String::new(),
            },
        ]
    );
    exec_ok(&env, "snap-v", "echo v2 > /data/f");
    let at_capture = volume_path(&env, "work", "sbs-sv").join("f");
    assert_eq!(std::fs::read_to_string(&at_capture).unwrap(), "v1\n");
    assert_eq!(
        std::fs::read_to_string(volume_path(&env, "work", "").join("f")).unwrap(),
        "v2\n"
    );
    assert_eq!(volume_snapshots(&env, "work").await, ["sbs-sv"]);
    assert_eq!(volume_snapshots(&env, "ref").await, Vec::<String>::new());

    // A capture that fails in the freeze (its volume snapshot name is
    // refused) leaves nothing, and the sandbox runs on.
    let long = format!("x{}", "0".repeat(59));
    let e = capture(&env, &long, "snap-v").await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert_eq!(
        snapshots_named(&env, "sandbolt-snapshot"),
        BTreeSet::from(["sandbolt-snapshot-sv".to_string()])
    );
    assert_eq!(task_status(&env, "snap-v"), "RUNNING");
    assert_eq!(phase(&env, "snap-v").await, SandboxPhase::Running);
    let labels = container_labels(&env, "snap-v").await;
    assert!(
        !labels.contains_key(labels::FROZEN_FOR_SNAPSHOT),
        "{labels:?}"
    );
    assert_eq!(exec_ok(&env, "snap-v", "cat /data/f"), "v2\n");
    assert_eq!(volume_snapshots(&env, "work").await, ["sbs-sv"]);

    assert!(deleted(&env, "sv").await);
    assert_eq!(volume_snapshots(&env, "work").await, Vec::<String>::new());
    assert!(env.delete_leaving_nothing("snap-v", 0).await);
    env.shutdown().await;
}

/// What a capture that died with its agent process leaves: an in-progress
/// key of this agent (and one of another agent, which stays), a volume
/// snapshot without its snapshot, and the source frozen with the label.
async fn leave_a_dead_capture(env: &mut Env, source: &str) {
    let sandboxes = env.agent().sandboxes();
    let parent = sandboxes
        .images
        .resolve("busybox")
        .await
        .unwrap()
        .chain_id
        .clone();
    let ctrd = sandboxes.containerd().clone();
    for (key, agent) in [("dead", "agent-test"), ("elsewhere", "another-agent")] {
        ctrd.snapshots()
            .prepare(ctrd.req(PrepareSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: format!("{}{key}", labels::SNAPSHOTTING_KEY_PREFIX),
                parent: parent.clone(),
                labels: HashMap::from([
                    (labels::SNAPSHOT.into(), key.into()),
                    (labels::AGENT_ID.into(), agent.into()),
                    (labels::AGENT_INSTANCE.into(), "gone".into()),
                    (labels::GC_ROOT.into(), "1".into()),
                ]),
            }))
            .await
            .expect("an in-progress key");
    }
    // What a capture that died leaves: its volume snapshot (the API refuses
    // the `sbs-` prefix, so it is made the way a capture makes it).
    sandboxes
        .volumes()
        .snapshot("work", "sbs-dead")
        .await
        .expect("volume snapshot");
    let refused = env
        .client
        .create_volume_snapshot(CreateVolumeSnapshotRequest {
            volume: "work".into(),
            name: "sbs-mine".into(),
        })
        .await
        .expect_err("the sbs- prefix belongs to sandbox snapshots");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused}");
    ctrd.set_container_label(source, labels::FROZEN_FOR_SNAPSHOT, "dead")
        .await
        .expect("label");
    ctrd.tasks()
        .pause(ctrd.req(PauseTaskRequest {
            container_id: source.into(),
        }))
        .await
        .expect("pause");
    assert_eq!(task_status(env, source), "PAUSED");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_agent_cleans_up_after_a_capture_that_died() {
    let mut env = Env::start_with_volumes(|_| {}).await;
    volume_source(&mut env, "snap-frozen").await;
    exec_ok(
        &env,
        "snap-frozen",
        "echo kept > /data/f && echo kept > /kept",
    );
    let kept = capture(&env, "kept", "snap-frozen").await.expect("capture");
    leave_a_dead_capture(&mut env, "snap-frozen").await;

    env.restart_agent(|_| {}).await;
    assert_eq!(
        snapshots_named(&env, "sandbolt-snapshot"),
        BTreeSet::from([
            "sandbolt-snapshot-kept".to_string(),
            "sandbolt-snapshotting-elsewhere".to_string(),
        ]),
        "this agent's in-progress key is gone, another agent's stays"
    );
    assert_eq!(task_status(&env, "snap-frozen"), "RUNNING");
    assert_eq!(phase(&env, "snap-frozen").await, SandboxPhase::Running);
    let labels = container_labels(&env, "snap-frozen").await;
    assert!(
        !labels.contains_key(labels::FROZEN_FOR_SNAPSHOT),
        "{labels:?}"
    );
    assert_eq!(exec_ok(&env, "snap-frozen", "cat /kept"), "kept\n");
    assert_eq!(volume_snapshots(&env, "work").await, ["sbs-kept"]);

    // The committed snapshot is loaded from its labels.
    let listed = inventory_snapshots(&env).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    let loaded = &listed[0];
    assert_eq!(
        (&loaded.snapshot_id, &loaded.sandbox_id, &loaded.volumes),
        (&kept.snapshot_id, &kept.sandbox_id, &kept.volumes)
    );
    assert_eq!(loaded.created_at_unix_ms, kept.created_at_unix_ms);
    assert_eq!(loaded.paused_us, kept.paused_us);
    assert!(
        loaded.took_us > 0 && loaded.took_us <= kept.took_us,
        "{loaded:?}"
    );
    assert_eq!(&capture(&env, "kept", "snap-frozen").await.unwrap(), loaded);

    let ctrd = env.agent().sandboxes().containerd().clone();
    ctrd.snapshots()
        .remove(ctrd.req(
            containerd_client::services::v1::snapshots::RemoveSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: format!("{}elsewhere", labels::SNAPSHOTTING_KEY_PREFIX),
            },
        ))
        .await
        .expect("remove the other agent's key");
    assert!(deleted(&env, "kept").await);
    assert!(env.delete_leaving_nothing("snap-frozen", 0).await);
    env.shutdown().await;
}
