//! Volumes on JuiceFS (`backend: "juicefs"`): a real PostgreSQL and a
//! formatted filesystem from the test bed, mounted over real FUSE by the
//! agent itself; sandboxes on a real containerd. Create, write in a
//! sandbox, snapshot, fork (metadata only), restore, quota, delete; two
//! agents with their own mounts see the same volume; a killed mount comes
//! back; a stopped metadata engine gives clear errors and leaves nothing
//! half made.

use crate::common;

use std::path::{Path, PathBuf};

use common::*;
use sandbolt_agent::AgentConfig;
use sandbolt_agent::juicefs_mount::JuiceFsConfig;
use sandbolt_proto::agent::v1::{
    AccessMode, CreateVolumeRequest, CreateVolumeSnapshotRequest, ForkVolumeRequest,
    GetInventoryRequest, JuiceFsStatus, NamedVolumeMount, RestoreVolumeRequest, SandboxPhase,
    SandboxSpec, VolumeInfo, VolumeRef, VolumeSpec,
};
use sandbolt_testbed::JuiceFs;
use tonic::Code;

const MIB: i64 = 1 << 20;

/// The bed's filesystem and one agent's mount of it.
fn juicefs_config(fs: &JuiceFs, label: &str) -> JuiceFsConfig {
    JuiceFsConfig {
        meta_url: fs.meta_url().into(),
        mount_point: fs.mount_point(label).unwrap(),
        binary: fs.binary().into(),
        cache_dir: fs.scratch(&format!("{label}-cache")).unwrap(),
    }
}

async fn start_fs() -> JuiceFs {
    tokio::task::spawn_blocking(|| JuiceFs::start().expect("JuiceFS test bed"))
        .await
        .unwrap()
}

fn spec(name: &str, backend: &str, size: i64) -> VolumeSpec {
    VolumeSpec {
        name: name.into(),
        access_mode: AccessMode::ReadWriteOnce as i32,
        size_bytes: size,
        backend: backend.into(),
    }
}

async fn create(env: &mut Env, s: VolumeSpec) -> Result<VolumeInfo, tonic::Status> {
    env.client
        .create_volume(CreateVolumeRequest { spec: Some(s) })
        .await
        .map(tonic::Response::into_inner)
}

async fn juicefs_status(client: &Client) -> JuiceFsStatus {
    let mut c = client.clone();
    c.get_inventory(GetInventoryRequest::default())
        .await
        .unwrap()
        .into_inner()
        .juicefs
        .expect("the inventory reports JuiceFS")
}

async fn wait_mounted(client: &Client, mounted: bool) -> JuiceFsStatus {
    eventually_async(&format!("JuiceFS mounted={mounted}"), WAIT, || {
        let c = client.clone();
        async move { Some(juicefs_status(&c).await).filter(|s| s.mounted == mounted) }
    })
    .await
}

/// Runs `script` in a sandbox mounting `volume` at /data; its output.
async fn run_with(env: &mut Env, id: &str, volume: &str, script: &str) -> String {
    let spec = SandboxSpec {
        volume_mounts: vec![NamedVolumeMount {
            volume: volume.into(),
            sub_path: String::new(),
            mount_path: "/data".into(),
            read_only: false,
        }],
        ..sh_spec(id, script)
    };
    env.create(spec)
        .await
        .unwrap_or_else(|e| panic!("create {id}: {e:?}"));
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
    let out = std::fs::read_to_string(env.log_path(id)).unwrap_or_default();
    delete(&mut env.client, id, 0).await;
    out
}

/// Bytes of the files below `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| match e.file_type() {
                    Ok(t) if t.is_dir() => dir_bytes(&e.path()),
                    _ => e.metadata().map_or(0, |m| m.len()),
                })
                .sum()
        })
        .unwrap_or(0)
}

/// A volume's live data as the agent's mount shows it.
fn data(mount_point: &Path, volume: &str) -> PathBuf {
    mount_point
        .join("sandbolt/volumes")
        .join(volume)
        .join("data")
}

fn juicefs_env(fs: &JuiceFs, label: &str) -> impl FnOnce(&mut AgentConfig) {
    let cfg = juicefs_config(fs, label);
    move |c: &mut AgentConfig| c.juicefs = Some(cfg)
}

/// Agent `id` (and node `id`) with its own mount `label`.
fn juicefs_agent(fs: &JuiceFs, label: &str, id: &str) -> impl FnOnce(&mut AgentConfig) {
    let cfg = juicefs_config(fs, label);
    let id = id.to_string();
    move |c: &mut AgentConfig| {
        c.juicefs = Some(cfg);
        c.agent_id.clone_from(&id);
        c.node_name = id;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn juicefs_volumes_create_snapshot_fork_restore_quota_and_delete() {
    let fs = start_fs().await;
    let mp = fs.mount_point("a").unwrap();
    let mut env = Env::start_with_volumes(juicefs_env(&fs, "a")).await;
    let status = juicefs_status(&env.client).await;
    assert!(status.mounted, "{status:?}");
    assert_eq!(status.filesystem, fs.name());
    let caps = status.capabilities.unwrap();
    assert!(caps.shared && caps.instant_forks && caps.instant_snapshots && caps.quota);

    let v = create(&mut env, spec("work", "juicefs", 0)).await.unwrap();
    assert_eq!(v.spec.unwrap().backend, "juicefs");
    assert!(v.capabilities.unwrap().shared);
    // Names are one namespace per agent, whichever the backend.
    let twice = create(&mut env, spec("work", "local", 0))
        .await
        .unwrap_err();
    assert_eq!(twice.code(), Code::AlreadyExists, "{twice:?}");
    let bad = create(&mut env, spec("x", "nfs", 0)).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("backend"), "{bad:?}");
    let local = create(&mut env, spec("mine", "", 0)).await.unwrap();
    assert_eq!(local.spec.unwrap().backend, "local");
    assert!(!local.capabilities.unwrap().shared);

    // A sandbox writes through its mount of the FUSE filesystem.
    let out = run_with(
        &mut env,
        "w1",
        "work",
        "echo original > /data/f && cat /data/f",
    )
    .await;
    assert!(out.contains("original"), "{out}");
    assert_eq!(
        std::fs::read_to_string(data(&mp, "work").join("f")).unwrap(),
        "original\n"
    );

    env.client
        .create_volume_snapshot(CreateVolumeSnapshotRequest {
            volume: "work".into(),
            name: "s1".into(),
        })
        .await
        .unwrap();
    std::fs::write(data(&mp, "work").join("f"), "mutated\n").unwrap();
    let fork = env
        .client
        .fork_volume(ForkVolumeRequest {
            source: "work".into(),
            snapshot: String::new(),
            spec: Some(spec("copy", "", 0)),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fork.forked_from, "work");
    assert_eq!(fork.spec.unwrap().backend, "juicefs");
    let cross = env
        .client
        .fork_volume(ForkVolumeRequest {
            source: "work".into(),
            snapshot: String::new(),
            spec: Some(spec("elsewhere", "local", 0)),
        })
        .await
        .unwrap_err();
    assert_eq!(cross.code(), Code::InvalidArgument, "{cross:?}");

    env.client
        .restore_volume(RestoreVolumeRequest {
            volume: "work".into(),
            snapshot: "s1".into(),
        })
        .await
        .unwrap();
    let out = run_with(&mut env, "r1", "work", "cat /data/f").await;
    assert!(
        out.contains("original"),
        "restore gives the snapshot's bytes: {out}"
    );
    // The fork is independent: it kept what the source held when forked.
    assert_eq!(
        std::fs::read_to_string(data(&mp, "copy").join("f")).unwrap(),
        "mutated\n"
    );
    std::fs::write(data(&mp, "copy").join("f"), "fork only\n").unwrap();
    assert_eq!(
        std::fs::read_to_string(data(&mp, "work").join("f")).unwrap(),
        "original\n"
    );

    // Ten forks of a 32 MiB volume take no space in the object store
    // (juicefs clone copies metadata only), and each is its own.
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let noise: Vec<u8> = (0..32 << 20)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect();
    let mut f = std::fs::File::create(data(&mp, "work").join("big")).unwrap();
    std::io::Write::write_all(&mut f, &noise).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let before = dir_bytes(&fs.bucket_dir());
    assert!(
        before >= 32 << 20,
        "the data is in the object store: {before}"
    );
    for i in 0..10 {
        env.client
            .fork_volume(ForkVolumeRequest {
                source: "work".into(),
                snapshot: String::new(),
                spec: Some(spec(&format!("f{i}"), "", 0)),
            })
            .await
            .unwrap();
    }
    // Copies would add 320 MiB; what may appear meanwhile is the earlier
    // small files' blocks, uploaded in the background (about a KiB).
    let after = dir_bytes(&fs.bucket_dir());
    assert!(
        after < before + (64 << 10),
        "forks store no object: {before} bytes before, {after} after"
    );
    std::fs::write(data(&mp, "f3").join("big"), "rewritten").unwrap();
    assert_eq!(std::fs::read(data(&mp, "f4").join("big")).unwrap(), noise);
    assert_eq!(std::fs::read(data(&mp, "work").join("big")).unwrap(), noise);

    // A 4 MiB volume: writes past it fail with EDQUOT once the mount has
    // loaded the new quota.
    create(&mut env, spec("small", "juicefs", 4 * MIB))
        .await
        .unwrap();
    let small = data(&mp, "small");
    let chunk = vec![7u8; 1 << 20];
    // Files are only added, never removed between tries: a file written
    // before the mount loaded the quota and removed after would count
    // against the usage negatively, and a write-then-remove loop could
    // then stay under the limit for good (our reading of a failure seen
    // under load, where the old loop never got EDQUOT in 60 s). One MiB every
    // quarter second at most bounds what this writes before the mount
    // learns the quota (about every 12 s).
    let written = std::sync::Mutex::new((0usize, std::time::Instant::now()));
    eventually("a write past the quota to fail with EDQUOT", WAIT, || {
        let mut w = written.lock().unwrap();
        if w.0 > 0 && w.1.elapsed() < std::time::Duration::from_millis(250) {
            return None;
        }
        let n = w.0;
        *w = (n + 1, std::time::Instant::now());
        // JuiceFS may refuse at write or at flush: both are checked (a
        // dropped File ignores close's error).
        let result = std::fs::File::create(small.join(format!("c{n}"))).and_then(|mut f| {
            std::io::Write::write_all(&mut f, &chunk)?;
            f.sync_all()
        });
        match result {
            Ok(()) => None,
            Err(e) if e.raw_os_error() == Some(libc::EDQUOT) => Some(()),
            Err(e) => panic!("unexpected write error: {e}"),
        }
    })
    .await;

    let forks: Vec<String> = (0..10).map(|i| format!("f{i}")).collect();
    for name in ["work", "copy", "small"]
        .into_iter()
        .chain(forks.iter().map(String::as_str))
    {
        env.client
            .delete_volume(VolumeRef { name: name.into() })
            .await
            .unwrap();
        assert!(
            !data(&mp, name).exists(),
            "{name} is gone from the filesystem"
        );
    }
    let listed = env
        .client
        .list_volumes(sandbolt_proto::agent::v1::ListVolumesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .volumes;
    let names: Vec<_> = listed
        .iter()
        .map(|v| v.spec.as_ref().unwrap().name.as_str())
        .collect();
    assert_eq!(names, ["mine"]);
    env.shutdown().await;
    assert!(
        !std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .contains(&*mp.to_string_lossy()),
        "a stopped agent leaves no JuiceFS mount"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_agents_with_their_own_mounts_share_a_volume() {
    let fs = start_fs().await;
    let mut a = Env::start_with(juicefs_agent(&fs, "a", "agent-a")).await;
    let mut b = Env::start_with(juicefs_agent(&fs, "b", "agent-b")).await;
    create(&mut a, spec("shared", "juicefs", 0)).await.unwrap();
    let out = run_with(&mut a, "wa", "shared", "echo from-a > /data/f").await;
    assert!(!out.contains("can't"), "{out}");
    // Agent b sees it at once (no copy, no sync), with its own holders.
    let seen = b
        .client
        .get_volume(VolumeRef {
            name: "shared".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(seen.spec.unwrap().backend, "juicefs");
    let out = run_with(&mut b, "rb", "shared", "cat /data/f").await;
    assert!(out.contains("from-a"), "{out}");
    let inv = b
        .client
        .get_inventory(GetInventoryRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(
        inv.volumes
            .iter()
            .any(|v| v.spec.as_ref().unwrap().name == "shared")
    );

    // Each agent stages in its own directory: a restarting agent recovers
    // its own leftovers and never the other's work in progress.
    let mp_a = fs.mount_point("a").unwrap();
    let staging = mp_a.join("sandbolt/staging");
    std::fs::create_dir_all(staging.join("agent-a/left-by-a")).unwrap();
    std::fs::create_dir_all(staging.join("agent-b/in-progress")).unwrap();
    a.restart_agent(juicefs_agent(&fs, "a", "agent-a")).await;
    wait_mounted(&a.client, true).await;
    assert!(!staging.join("agent-a/left-by-a").exists());
    assert!(staging.join("agent-b/in-progress").exists());
    b.shutdown().await;
    a.shutdown().await;
}

/// The pid of the `juicefs mount` serving `mount_point` (its watchdog:
/// the process whose parent is not a juicefs mount of it too).
fn juicefs_watchdog(mount_point: &Path) -> Option<i32> {
    let needle = mount_point.to_string_lossy().into_owned();
    let procs: Vec<(i32, i32, String)> = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let ppid = stat
                .rsplit(')')
                .next()?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((pid, ppid, cmd))
        })
        .filter(|(_, _, cmd)| {
            cmd.contains("juicefs") && cmd.contains(" mount ") && cmd.contains(&needle)
        })
        .collect();
    procs
        .iter()
        .find(|(_, ppid, _)| !procs.iter().any(|(p, _, _)| p == ppid))
        .map(|(pid, _, _)| *pid)
}

/// Every juicefs process mounting `mount_point`.
fn juicefs_pids(mount_point: &Path) -> Vec<i32> {
    let needle = mount_point.to_string_lossy().into_owned();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            (cmd.contains("juicefs") && cmd.contains(" mount ") && cmd.contains(&needle))
                .then_some(pid)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_mount_is_remounted_and_a_stopped_metadata_engine_is_refused_clearly() {
    let mut fs = start_fs().await;
    let mp = fs.mount_point("a").unwrap();
    let mut env = Env::start_with_volumes(juicefs_env(&fs, "a")).await;
    create(&mut env, spec("keep", "juicefs", 0)).await.unwrap();
    std::fs::write(data(&mp, "keep").join("f"), "kept\n").unwrap();

    let pid = juicefs_watchdog(&mp).expect("the agent runs juicefs mount");
    let before = juicefs_pids(&mp);
    // SAFETY: kill has no memory preconditions.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    // The agent ends the old mount's processes and starts a new one.
    eventually("a new juicefs mount", WAIT, || {
        let now = juicefs_pids(&mp);
        (!now.is_empty() && now.iter().all(|p| !before.contains(p))).then_some(())
    })
    .await;
    wait_mounted(&env.client, true).await;
    assert_eq!(
        std::fs::read_to_string(data(&mp, "keep").join("f")).unwrap(),
        "kept\n"
    );

    // The metadata engine goes away: the mount is reported down, juicefs
    // volume calls are refused at once and clearly, the node's own
    // volumes and sandboxes without volumes keep working.
    tokio::task::block_in_place(|| fs.stop_meta());
    let client = env.client.clone();
    eventually_async(
        "JuiceFS reported down for its metadata engine",
        WAIT,
        || {
            let c = client.clone();
            async move {
                let s = juicefs_status(&c).await;
                (!s.mounted && s.error.contains("metadata engine")).then_some(())
            }
        },
    )
    .await;
    let refused = create(&mut env, spec("during", "juicefs", 0))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("metadata engine"), "{refused:?}");
    let refused = env
        .client
        .fork_volume(ForkVolumeRequest {
            source: "keep".into(),
            snapshot: String::new(),
            spec: Some(spec("fork-during", "", 0)),
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    create(&mut env, spec("local-during", "local", 0))
        .await
        .unwrap();
    let out = {
        env.create(sh_spec("plain", "echo still-serving"))
            .await
            .unwrap();
        wait_for_phase(&env.client, "plain", SandboxPhase::Stopped).await;
        std::fs::read_to_string(env.log_path("plain")).unwrap_or_default()
    };
    assert!(out.contains("still-serving"), "{out}");

    tokio::task::block_in_place(|| fs.start_meta()).unwrap();
    wait_mounted(&env.client, true).await;
    // Nothing half made: neither refused volume exists, staging is empty.
    for name in ["during", "fork-during"] {
        let e = env
            .client
            .get_volume(VolumeRef { name: name.into() })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{name}: {e:?}");
    }
    let staging = mp.join("sandbolt/staging/agent-test");
    assert_eq!(std::fs::read_dir(&staging).unwrap().count(), 0);
    create(&mut env, spec("after", "juicefs", 0)).await.unwrap();
    env.shutdown().await;
}
