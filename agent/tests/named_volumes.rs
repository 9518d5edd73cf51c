//! Named volumes on a real containerd with a loop-backed btrfs volume root
//! in the test bed: data outlives sandboxes, access modes (RWO, ROX, RWX)
//! are enforced at create and at attach, volumes mount into and out of
//! running sandboxes, restore and delete wait until nothing mounts the
//! volume, a restarted agent rebuilds its mount table from the containers'
//! labels, and a full quota fails writes inside the sandbox with EDQUOT.
//! Every call goes through AgentService (tonic, bearer token).

use crate::common;

use std::path::PathBuf;

use common::*;
use sandbolt_proto::agent::v1::{
    AccessMode, AttachVolumeRequest, CreateVolumeRequest, CreateVolumeSnapshotRequest,
    DetachVolumeRequest, ForkVolumeRequest, GetInventoryRequest, ListVolumesRequest,
    NamedVolumeMount, RestoreVolumeRequest, SandboxPhase, SandboxSpec, SandboxStatus, VolumeInfo,
    VolumeRef, VolumeSpec,
};
use tonic::Code;

const MIB: i64 = 1 << 20;

fn volume_spec(name: &str, mode: AccessMode, size_bytes: i64) -> VolumeSpec {
    VolumeSpec {
        name: name.into(),
        access_mode: mode as i32,
        size_bytes,
        backend: String::new(),
    }
}

async fn create_volume(env: &mut Env, name: &str, mode: AccessMode) -> VolumeInfo {
    create_sized(env, name, mode, 0).await
}

async fn create_sized(env: &mut Env, name: &str, mode: AccessMode, size: i64) -> VolumeInfo {
    env.client
        .create_volume(CreateVolumeRequest {
            spec: Some(volume_spec(name, mode, size)),
        })
        .await
        .unwrap_or_else(|e| panic!("create volume {name}: {e:?}"))
        .into_inner()
}

async fn get_volume(env: &mut Env, name: &str) -> Result<VolumeInfo, tonic::Status> {
    env.client
        .get_volume(VolumeRef { name: name.into() })
        .await
        .map(tonic::Response::into_inner)
}

/// (sandbox, mount path, read-only) of every holder of `name`.
async fn holders(env: &mut Env, name: &str) -> Vec<(String, String, bool)> {
    get_volume(env, name)
        .await
        .unwrap()
        .mounts
        .into_iter()
        .map(|h| (h.sandbox_id, h.mount_path, h.read_only))
        .collect()
}

fn named(volume: &str, mount_path: &str, read_only: bool) -> NamedVolumeMount {
    NamedVolumeMount {
        volume: volume.into(),
        sub_path: String::new(),
        mount_path: mount_path.into(),
        read_only,
    }
}

fn with_volumes(id: &str, script: &str, mounts: Vec<NamedVolumeMount>) -> SandboxSpec {
    SandboxSpec {
        volume_mounts: mounts,
        ..sh_spec(id, script)
    }
}

async fn create_ok(env: &mut Env, spec: SandboxSpec) -> SandboxStatus {
    let id = spec.sandbox_id.clone();
    env.create(spec)
        .await
        .unwrap_or_else(|e| panic!("create {id}: {e:?}"))
        .status
        .unwrap()
}

/// The error code of a create that must be refused, and its message.
async fn create_refused(env: &mut Env, spec: SandboxSpec) -> (Code, String) {
    let id = spec.sandbox_id.clone();
    match env.create(spec).await {
        Ok(_) => panic!("create {id} was accepted"),
        Err(s) => (s.code(), s.message().to_string()),
    }
}

/// What a sandbox printed, once it has exited.
async fn output_after_exit(env: &mut Env, id: &str) -> String {
    let client = env.client.clone();
    eventually_async(&format!("{id} to exit"), WAIT, || {
        let mut c = client.clone();
        async move {
            get(&mut c, id)
                .await
                .ok()
                .filter(|s| matches!(s.phase(), SandboxPhase::Stopped | SandboxPhase::Failed))
        }
    })
    .await;
    std::fs::read_to_string(env.log_path(id)).unwrap_or_default()
}

/// The host directory of a volume's live data.
fn data_dir(env: &Env, volume: &str) -> PathBuf {
    env.volume_root
        .as_ref()
        .unwrap()
        .join("volumes")
        .join(volume)
        .join("data")
}

/// The container's volume-mounts label, as containerd has it.
fn volume_label(env: &Env, id: &str) -> Vec<NamedVolumeMount> {
    let info: serde_json::Value =
        serde_json::from_str(&env.ctr(&["containers", "info", id])).unwrap();
    let value = info["Labels"][sandbolt_agent::labels::VOLUME_MOUNTS]
        .as_str()
        .unwrap_or("");
    sandbolt_agent::volume_mounts::from_label(value).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn data_written_in_one_sandbox_is_read_in_the_next() {
    let mut env = Env::start_with_volumes(|_| {}).await;
    let info = create_volume(&mut env, "work", AccessMode::Unspecified).await;
    let spec = info.spec.clone().unwrap();
    assert_eq!(spec.access_mode(), AccessMode::ReadWriteOnce, "the default");
    assert_eq!(info.capabilities.as_ref().unwrap().backend, "btrfs");
    assert_eq!(info.node_name, "agent-test");

    let a = create_ok(
        &mut env,
        with_volumes(
            "vol-a",
            "echo from-a > /data/hello && echo written",
            vec![named("work", "/data", false)],
        ),
    )
    .await;
    assert_eq!(a.volume_mounts, vec![named("work", "/data", false)]);
    assert_eq!(
        holders(&mut env, "work").await,
        [("vol-a".into(), "/data".into(), false)]
    );
    assert!(
        output_after_exit(&mut env, "vol-a")
            .await
            .contains("written")
    );
    assert!(env.delete_leaving_nothing("vol-a", 0).await);
    assert_eq!(holders(&mut env, "work").await, []);

    // A sub path of the volume (made when missing) in a second sandbox,
    // then the whole volume read-only in a third.
    let sub = NamedVolumeMount {
        sub_path: "nested/dir".into(),
        ..named("work", "/sub", false)
    };
    create_ok(
        &mut env,
        with_volumes("vol-b", "echo from-b > /sub/f", vec![sub]),
    )
    .await;
    output_after_exit(&mut env, "vol-b").await;
    assert!(env.delete_leaving_nothing("vol-b", 0).await);
    let c = create_ok(
        &mut env,
        with_volumes(
            "vol-c",
            "cat /data/hello /data/nested/dir/f",
            vec![named("work", "/data", true)],
        ),
    )
    .await;
    assert_eq!(c.volume_mounts, vec![named("work", "/data", true)]);
    let out = output_after_exit(&mut env, "vol-c").await;
    assert!(out.contains("from-a") && out.contains("from-b"), "{out}");
    assert!(data_dir(&env, "work").join("nested/dir/f").is_file());
    assert!(env.delete_leaving_nothing("vol-c", 0).await);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn access_modes_are_enforced_at_create() {
    let mut env = Env::start_with_volumes(|_| {}).await;
    create_volume(&mut env, "rwo", AccessMode::ReadWriteOnce).await;
    create_volume(&mut env, "rox", AccessMode::ReadOnlyMany).await;
    create_volume(&mut env, "rwx", AccessMode::ReadWriteMany).await;
    let sleep = "sleep 1000";

    // RWO: one writer; a second writer is refused, a reader is not.
    create_ok(
        &mut env,
        with_volumes("rwo-1", sleep, vec![named("rwo", "/v", false)]),
    )
    .await;
    let (code, msg) = create_refused(
        &mut env,
        with_volumes("rwo-2", sleep, vec![named("rwo", "/v", false)]),
    )
    .await;
    assert_eq!(code, Code::FailedPrecondition, "{msg}");
    assert!(
        msg.contains("ReadWriteOnce") && msg.contains("rwo-1"),
        "{msg}"
    );
    assert!(
        get(&mut env.client, "rwo-2").await.is_err(),
        "nothing of rwo-2 is left"
    );
    create_ok(
        &mut env,
        with_volumes("rwo-3", sleep, vec![named("rwo", "/v", true)]),
    )
    .await;

    // ROX: read-write refused (never silently made read-only); read-only
    // works and is read-only inside.
    let (code, msg) = create_refused(
        &mut env,
        with_volumes("rox-1", sleep, vec![named("rox", "/v", false)]),
    )
    .await;
    assert_eq!(code, Code::FailedPrecondition, "{msg}");
    assert!(msg.contains("ReadOnlyMany"), "{msg}");
    let script = "ls /v && touch /v/x 2>&1; echo rc=$?";
    create_ok(
        &mut env,
        with_volumes("rox-2", script, vec![named("rox", "/v", true)]),
    )
    .await;
    let out = output_after_exit(&mut env, "rox-2").await;
    assert!(
        out.contains("Read-only file system") && out.contains("rc=1"),
        "{out}"
    );

    // RWX: two writers at once.
    for id in ["rwx-1", "rwx-2"] {
        let script = format!("echo {id} > /v/{id} && sleep 1000");
        create_ok(
            &mut env,
            with_volumes(id, &script, vec![named("rwx", "/v", false)]),
        )
        .await;
    }
    let dir = data_dir(&env, "rwx");
    eventually("both writers wrote", WAIT, || {
        (dir.join("rwx-1").exists() && dir.join("rwx-2").exists()).then_some(())
    })
    .await;
    assert_eq!(holders(&mut env, "rwx").await.len(), 2);

    // A create that fails after its volumes were reserved gives them back.
    let mut bad = with_volumes("rwo-bad", sleep, vec![named("rwx", "/v", false)]);
    bad.resources = Some(sandbolt_proto::agent::v1::Resources {
        cpu: "lots".into(),
        ..Default::default()
    });
    assert_eq!(create_refused(&mut env, bad).await.0, Code::InvalidArgument);
    assert_eq!(holders(&mut env, "rwx").await.len(), 2);

    // A volume that does not exist, and one named twice.
    let (code, msg) = create_refused(
        &mut env,
        with_volumes("nope", sleep, vec![named("nope", "/v", false)]),
    )
    .await;
    assert_eq!(code, Code::NotFound, "{msg}");
    let twice = vec![named("rwx", "/a", false), named("rwx", "/b", true)];
    let (code, msg) = create_refused(&mut env, with_volumes("twice", sleep, twice)).await;
    assert_eq!(code, Code::InvalidArgument, "{msg}");
    assert!(msg.contains("volume_mounts[1].volume"), "{msg}");

    for id in ["rwo-1", "rwo-3", "rox-2", "rwx-1", "rwx-2"] {
        assert!(env.delete_leaving_nothing(id, 0).await, "{id}");
    }
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn volumes_attach_to_and_detach_from_a_running_sandbox() {
    let mut env = Env::start_with_volumes(|_| {}).await;
    create_volume(&mut env, "live", AccessMode::ReadWriteOnce).await;
    // Copies ping to pong inside the sandbox whenever ping appears.
    let script = "while true; do [ -f /mnt/v/ping ] && cp /mnt/v/ping /mnt/v/pong; sleep 0.1; done";
    let s = create_ok(&mut env, sh_spec("att-1", script)).await;
    assert!(s.volume_mounts.is_empty());

    let status = env
        .client
        .attach_volume(AttachVolumeRequest {
            sandbox_id: "att-1".into(),
            mount: Some(named("live", "/mnt/v", false)),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.volume_mounts, vec![named("live", "/mnt/v", false)]);
    assert_eq!(
        holders(&mut env, "live").await,
        [("att-1".into(), "/mnt/v".into(), false)]
    );
    assert_eq!(
        volume_label(&env, "att-1"),
        vec![named("live", "/mnt/v", false)]
    );
    let data = data_dir(&env, "live");
    std::fs::write(data.join("ping"), "hello").unwrap();
    let pong = data.join("pong");
    eventually("the sandbox writes into the attached volume", WAIT, || {
        std::fs::read_to_string(&pong).ok().filter(|s| s == "hello")
    })
    .await;

    // The access mode holds for attach too; a second mount of the same
    // volume into one sandbox is refused as well.
    let other = create_ok(&mut env, sh_spec("att-2", "sleep 1000")).await;
    for (id, path) in [("att-2", "/w"), ("att-1", "/other")] {
        let err = env
            .client
            .attach_volume(AttachVolumeRequest {
                sandbox_id: id.into(),
                mount: Some(named("live", path, false)),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{id}: {err:?}");
    }
    assert!(volume_label(&env, "att-2").is_empty());

    let status = env
        .client
        .detach_volume(DetachVolumeRequest {
            sandbox_id: "att-1".into(),
            volume: "live".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(status.volume_mounts.is_empty());
    assert_eq!(holders(&mut env, "live").await, []);
    assert!(volume_label(&env, "att-1").is_empty());
    let inside = PathBuf::from(format!("/proc/{}/root/mnt/v/ping", s.pid));
    assert!(!inside.exists(), "the volume is no longer mounted in att-1");
    let err = env
        .client
        .detach_volume(DetachVolumeRequest {
            sandbox_id: "att-1".into(),
            volume: "live".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);

    // Now the other sandbox may write to it.
    env.client
        .attach_volume(AttachVolumeRequest {
            sandbox_id: "att-2".into(),
            mount: Some(named("live", "/w", false)),
        })
        .await
        .unwrap();
    let seen = PathBuf::from(format!("/proc/{}/root/w/pong", other.pid));
    assert_eq!(std::fs::read_to_string(seen).unwrap(), "hello");
    assert!(env.delete_leaving_nothing("att-1", 0).await);
    assert!(env.delete_leaving_nothing("att-2", 0).await);
    assert_eq!(holders(&mut env, "live").await, []);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn restore_and_delete_wait_until_nothing_mounts_the_volume() {
    let mut env = Env::start_with_volumes(|_| {}).await;
    create_volume(&mut env, "keep", AccessMode::ReadWriteOnce).await;
    let data = data_dir(&env, "keep");
    std::fs::write(data.join("f"), "original").unwrap();
    env.client
        .create_volume_snapshot(CreateVolumeSnapshotRequest {
            volume: "keep".into(),
            name: "s1".into(),
        })
        .await
        .unwrap();
    create_ok(
        &mut env,
        with_volumes(
            "holder",
            "echo changed > /v/f && sleep 1000",
            vec![named("keep", "/v", false)],
        ),
    )
    .await;
    eventually("the sandbox changed the file", WAIT, || {
        std::fs::read_to_string(data.join("f"))
            .ok()
            .filter(|s| s.trim() == "changed")
    })
    .await;

    let restore = RestoreVolumeRequest {
        volume: "keep".into(),
        snapshot: "s1".into(),
    };
    let err = env
        .client
        .restore_volume(restore.clone())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("holder"), "{err:?}");
    let err = env
        .client
        .delete_volume(VolumeRef {
            name: "keep".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    // Snapshots and forks are allowed while mounted.
    env.client
        .create_volume_snapshot(CreateVolumeSnapshotRequest {
            volume: "keep".into(),
            name: "s2".into(),
        })
        .await
        .unwrap();
    let fork = env
        .client
        .fork_volume(ForkVolumeRequest {
            source: "keep".into(),
            snapshot: "s1".into(),
            spec: Some(volume_spec("keep-fork", AccessMode::Unspecified, 0)),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fork.forked_from, "keep@s1");
    assert_eq!(fork.spec.unwrap().access_mode(), AccessMode::ReadWriteOnce);

    assert!(env.delete_leaving_nothing("holder", 0).await);
    let restored = env
        .client
        .restore_volume(restore)
        .await
        .unwrap()
        .into_inner();
    assert_eq!(restored.snapshots.len(), 2);
    assert_eq!(std::fs::read_to_string(data.join("f")).unwrap(), "original");
    let gone = env
        .client
        .delete_volume(VolumeRef {
            name: "keep".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(gone.existed);
    assert_eq!(
        get_volume(&mut env, "keep").await.unwrap_err().code(),
        Code::NotFound
    );
    // The fork is an independent volume and stays.
    let fork_data = data_dir(&env, "keep-fork");
    assert_eq!(
        std::fs::read_to_string(fork_data.join("f")).unwrap(),
        "original"
    );
    let names: Vec<String> = env
        .client
        .list_volumes(ListVolumesRequest {})
        .await
        .unwrap()
        .into_inner()
        .volumes
        .into_iter()
        .map(|v| v.spec.unwrap().name)
        .collect();
    assert_eq!(names, ["keep-fork"]);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restarted_agent_keeps_volumes_and_rebuilds_the_mount_table() {
    let mut env = Env::start_with_volumes(|_| {}).await;
    create_volume(&mut env, "durable", AccessMode::ReadWriteOnce).await;
    create_volume(&mut env, "later", AccessMode::ReadWriteOnce).await;
    let s = create_ok(
        &mut env,
        with_volumes(
            "rs-1",
            "echo kept > /v/f && sleep 1000",
            vec![named("durable", "/v", false)],
        ),
    )
    .await;
    env.client
        .attach_volume(AttachVolumeRequest {
            sandbox_id: "rs-1".into(),
            mount: Some(named("later", "/later", true)),
        })
        .await
        .unwrap();

    env.restart_agent(|_| {}).await;

    let after = get(&mut env.client, "rs-1").await.unwrap();
    assert_eq!(after.pid, s.pid);
    assert_eq!(
        after.volume_mounts,
        vec![
            named("durable", "/v", false),
            named("later", "/later", true)
        ]
    );
    assert_eq!(
        holders(&mut env, "durable").await,
        [("rs-1".into(), "/v".into(), false)]
    );
    assert_eq!(
        holders(&mut env, "later").await,
        [("rs-1".into(), "/later".into(), true)]
    );
    // RWO still enforced after the restart.
    let spec = with_volumes("rs-2", "sleep 1000", vec![named("durable", "/v", false)]);
    let (code, msg) = create_refused(&mut env, spec.clone()).await;
    assert_eq!(code, Code::FailedPrecondition, "{msg}");
    let inventory = env
        .client
        .get_inventory(GetInventoryRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(inventory.volumes.len(), 2);
    assert_eq!(
        inventory
            .volume_capabilities
            .as_ref()
            .map(|c| c.backend.as_str()),
        Some("btrfs")
    );
    // Detach works on a recovered sandbox, and the data is still there.
    env.client
        .detach_volume(DetachVolumeRequest {
            sandbox_id: "rs-1".into(),
            volume: "later".into(),
        })
        .await
        .unwrap();
    assert_eq!(
        volume_label(&env, "rs-1"),
        vec![named("durable", "/v", false)]
    );
    assert_eq!(
        std::fs::read_to_string(data_dir(&env, "durable").join("f")).unwrap(),
        "kept\n"
    );

    assert!(env.delete_leaving_nothing("rs-1", 0).await);
    create_ok(&mut env, spec).await;
    assert!(env.delete_leaving_nothing("rs-2", 0).await);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_removed_behind_the_agents_back_gives_its_volumes_back() {
    let mut env = Env::start_with_volumes(|_| {}).await;
    create_volume(&mut env, "orphan", AccessMode::ReadWriteOnce).await;
    create_ok(
        &mut env,
        with_volumes("gone-1", "sleep 1000", vec![named("orphan", "/v", false)]),
    )
    .await;
    // An operator removes the container directly.
    env.ctr(&["tasks", "kill", "-s", "SIGKILL", "gone-1"]);
    eventually("the task stops", WAIT, || {
        let tasks = env.ctr(&["tasks", "list"]);
        (!tasks
            .lines()
            .any(|l| l.starts_with("gone-1") && l.contains("RUNNING")))
        .then_some(())
    })
    .await;
    env.ctr(&["tasks", "delete", "gone-1"]);
    env.ctr(&["containers", "delete", "gone-1"]);
    // The next writer finds the hold released.
    create_ok(
        &mut env,
        with_volumes("gone-2", "sleep 1000", vec![named("orphan", "/v", false)]),
    )
    .await;
    assert_eq!(
        holders(&mut env, "orphan").await,
        [("gone-2".into(), "/v".into(), false)]
    );
    env.delete_leaving_nothing("gone-1", 0).await;
    assert!(env.delete_leaving_nothing("gone-2", 0).await);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_full_quota_fails_writes_inside_with_edquot() {
    let mut env = Env::start_with_volumes(|_| {}).await;
    let info = create_sized(&mut env, "small", AccessMode::ReadWriteOnce, 16 * MIB).await;
    assert_eq!(info.spec.unwrap().size_bytes, 16 * MIB);
    assert!(info.capabilities.unwrap().quota);
    let script = "dd if=/dev/zero of=/v/big bs=1M count=64 conv=fsync 2>&1; echo rc=$?";
    create_ok(
        &mut env,
        with_volumes("quota", script, vec![named("small", "/v", false)]),
    )
    .await;
    let out = output_after_exit(&mut env, "quota").await;
    assert!(out.contains("Disk quota exceeded"), "{out}");
    assert!(!out.contains("rc=0"), "{out}");
    assert!(env.delete_leaving_nothing("quota", 0).await);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn volume_errors_have_their_codes() {
    let mut env = Env::start_with_volumes(|_| {}).await;
    create_volume(&mut env, "dup", AccessMode::ReadWriteMany).await;
    let err = env
        .client
        .create_volume(CreateVolumeRequest {
            spec: Some(volume_spec("dup", AccessMode::ReadWriteMany, 0)),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    let err = env
        .client
        .create_volume(CreateVolumeRequest {
            spec: Some(volume_spec("Not_A_Label", AccessMode::Unspecified, 0)),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("Not_A_Label"), "{err:?}");
    let err = env
        .client
        .create_volume(CreateVolumeRequest {
            spec: Some(volume_spec("neg", AccessMode::Unspecified, -1)),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("size_bytes"), "{err:?}");
    assert_eq!(
        get_volume(&mut env, "missing").await.unwrap_err().code(),
        Code::NotFound
    );
    let deleted = env
        .client
        .delete_volume(VolumeRef {
            name: "missing".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!deleted.existed);
    // Without the token, nothing.
    let mut anonymous = client(env.agent().grpc_addr(), "wrong-token").await;
    let err = anonymous
        .list_volumes(ListVolumesRequest {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_without_a_volume_root_says_so() {
    let mut env = Env::start().await;
    let err = env
        .client
        .create_volume(CreateVolumeRequest {
            spec: Some(volume_spec("v", AccessMode::Unspecified, 0)),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    let (code, msg) = create_refused(
        &mut env,
        with_volumes("novol", "true", vec![named("v", "/v", false)]),
    )
    .await;
    assert_eq!(code, Code::Unavailable, "{msg}");
    assert!(get(&mut env.client, "novol").await.is_err());
    let inventory = env
        .client
        .get_inventory(GetInventoryRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(inventory.volumes.is_empty() && inventory.volume_capabilities.is_none());
    env.shutdown().await;
}
