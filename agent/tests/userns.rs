//! User namespaces (`--user-namespace node`) and the cgroup namespace, on
//! the test bed's real containerd and runc: root in a sandbox is uid `base`
//! on the host, the image is shifted once, the cgroup view is the
//! sandbox's own.

use crate::common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use common::*;
use sandbolt_agent::userns::{SHIFTED_PREFIX, UserNamespaceMode};
use sandbolt_proto::agent::v1::{HostPathMount, SandboxPhase, SandboxSpec};

const BASE: u32 = 200_000;

/// Waits until the sandbox's log contains `marker`, then returns the log.
async fn log_until(env: &Env, id: &str, marker: &str) -> String {
    let path = env.log_path(id);
    eventually(&format!("{marker:?} in the log of {id}"), WAIT, || {
        std::fs::read_to_string(&path)
            .ok()
            .filter(|t| t.contains(marker))
    })
    .await
}

async fn create_running(env: &mut Env, spec: SandboxSpec) {
    let status = env
        .create(spec)
        .await
        .expect("create")
        .status
        .expect("a status");
    assert_eq!(status.phase(), SandboxPhase::Running, "{status:?}");
}

fn writable_dir(root: &Path) -> std::path::PathBuf {
    let dir = root.join("data");
    std::fs::create_dir_all(&dir).unwrap();
    // The operator's part: a host path a sandbox writes must be writable
    // by the node's range (here: by everyone).
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    dir
}

fn shifted_snapshots(env: &Env) -> usize {
    env.ctr(&["snapshots", "--snapshotter", "overlayfs", "list"])
        .lines()
        .filter(|l| l.starts_with(SHIFTED_PREFIX))
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn root_in_a_sandbox_is_an_unprivileged_uid_on_the_host() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    let data = writable_dir(&root);
    let allow = root.clone();
    let mut env = Env::start_with(move |cfg| {
        cfg.allowed_host_paths = vec![allow];
        cfg.user_namespace = UserNamespaceMode::Node;
        cfg.userns_base = BASE;
    })
    .await;
    let script = r#"
        echo "UID=$(id -u) GID=$(id -g)"
        echo "MAP=$(cat /proc/self/uid_map | tr -s ' ' | sed 's/^ //')"
        echo root-wrote-this > /data/from-root
        touch /in-rootfs && echo ROOTFS=ok
        echo USERNS-DONE
        exec sleep 100000
    "#;
    let mut s = sh_spec("sb-uid-range", script);
    s.host_mounts = vec![HostPathMount {
        host_path: data.display().to_string(),
        mount_path: "/data".into(),
        ..Default::default()
    }];
    create_running(&mut env, s).await;
    let log = log_until(&env, "sb-uid-range", "USERNS-DONE").await;
    assert!(log.contains("UID=0 GID=0"), "root inside:\n{log}");
    assert!(log.contains(&format!("MAP=0 {BASE} 65536")), "{log}");
    assert!(
        log.contains("ROOTFS=ok"),
        "the shifted rootfs is root's:\n{log}"
    );
    let written = std::fs::metadata(data.join("from-root")).unwrap();
    assert_eq!(
        (written.uid(), written.gid()),
        (BASE, BASE),
        "a file root wrote in the sandbox belongs to the range's first id on the host"
    );
    // The sandbox's processes run as BASE on the host.
    let pid = get(&mut env.client, "sb-uid-range").await.unwrap().pid;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert!(uid_line.contains(&BASE.to_string()), "{uid_line}");
    env.delete_leaving_nothing("sb-uid-range", 200).await;
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_sandboxes_of_one_image_shift_it_once() {
    let mut env = Env::start_with(|cfg| {
        cfg.user_namespace = UserNamespaceMode::Node;
        cfg.userns_base = BASE;
        // Prepared snapshots on: they must sit on the shifted snapshot too.
        cfg.prepared_snapshots = 1;
    })
    .await;
    for id in ["sb-shift-1", "sb-shift-2", "sb-shift-3"] {
        create_running(
            &mut env,
            sh_spec(id, "echo UID=$(id -u); echo SHIFT-OK; exec sleep 100000"),
        )
        .await;
        let log = log_until(&env, id, "SHIFT-OK").await;
        assert!(log.contains("UID=0\n"), "{id}: {log}");
    }
    let shifter = env
        .agent()
        .sandboxes()
        .userns()
        .expect("user namespaces on");
    assert_eq!(shifter.shifts(), 1, "busybox is shifted once");
    assert_eq!(shifted_snapshots(&env), 1);
    // The shifted image's files belong to the range on the host.
    for id in ["sb-shift-1", "sb-shift-2", "sb-shift-3"] {
        env.delete_leaving_nothing(id, 200).await;
    }
    // Deleting sandboxes keeps the shifted snapshot for the next create.
    assert_eq!(shifted_snapshots(&env), 1);
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_sees_its_own_cgroup_as_the_root() {
    let mut env = Env::start().await;
    create_running(
        &mut env,
        sh_spec(
            "sb-cgns",
            "cat /proc/self/cgroup; echo CGROUP-DONE; exec sleep 100000",
        ),
    )
    .await;
    let log = log_until(&env, "sb-cgns", "CGROUP-DONE").await;
    // `N:controllers:path` lines (execd's own lines interleave).
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.split(':')
                .next()
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .collect();
    assert!(!lines.is_empty(), "{log}");
    for l in &lines {
        assert!(
            l.ends_with(":/"),
            "every hierarchy's path is / in a cgroup namespace, not the host's /sandbolt/...: {l}\n{log}"
        );
    }
    env.delete_leaving_nothing("sb-cgns", 200).await;
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn root_in_a_sandbox_writes_a_named_volume_as_the_range() {
    use sandbolt_proto::agent::v1::{CreateVolumeRequest, NamedVolumeMount, VolumeSpec};
    let mut env = Env::start_with_volumes(|cfg| {
        cfg.user_namespace = UserNamespaceMode::Node;
        cfg.userns_base = BASE;
    })
    .await;
    env.client
        .create_volume(CreateVolumeRequest {
            spec: Some(VolumeSpec {
                name: "work".into(),
                ..Default::default()
            }),
        })
        .await
        .expect("create volume");
    let data = env
        .volume_root
        .clone()
        .unwrap()
        .join("volumes")
        .join("work")
        .join("data");
    // Data written before user namespaces were on (here: by the host, as
    // root): moved into the range at the first mount.
    std::fs::create_dir_all(data.join("old")).unwrap();
    std::fs::write(data.join("old/seed"), "seed\n").unwrap();
    let mut s = sh_spec(
        "sb-vol-range",
        "echo hello > /work/f && echo more >> /work/old/seed && echo VOL=ok; echo VOL-DONE; exec sleep 100000",
    );
    s.volume_mounts = vec![NamedVolumeMount {
        volume: "work".into(),
        mount_path: "/work".into(),
        ..Default::default()
    }];
    create_running(&mut env, s).await;
    let log = log_until(&env, "sb-vol-range", "VOL-DONE").await;
    assert!(
        log.contains("VOL=ok"),
        "root in the sandbox writes its volume:\n{log}"
    );
    for f in ["f", "old", "old/seed"] {
        let m = std::fs::metadata(data.join(f)).unwrap();
        assert_eq!((m.uid(), m.gid()), (BASE, BASE), "{f}");
    }
    assert_eq!(
        std::fs::read_to_string(data.join("old/seed")).unwrap(),
        "seed\nmore\n"
    );
    env.delete_leaving_nothing("sb-vol-range", 200).await;
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn user_namespaces_work_with_sandbox_networking() {
    use sandbolt_agent::config::NetworkConfig;
    // The prepared network namespace belongs to the host's user namespace:
    // runc must still set up the sandbox (its /sys included) inside it.
    let mut env = Env::start_with(|cfg| {
        let mut net = NetworkConfig::new(vec!["127.0.0.1:9".parse().unwrap()]);
        net.pool_size = 1;
        cfg.network = Some(net);
        cfg.user_namespace = UserNamespaceMode::Node;
        cfg.userns_base = BASE;
    })
    .await;
    create_running(
        &mut env,
        sh_spec(
            "sb-net-range",
            "echo UID=$(id -u); ls /sys/class/net; cat /etc/resolv.conf; echo NET-DONE; exec sleep 100000",
        ),
    )
    .await;
    let log = log_until(&env, "sb-net-range", "NET-DONE").await;
    assert!(log.contains("UID=0\n"), "{log}");
    assert!(log.contains("nameserver"), "{log}");
    env.delete_leaving_nothing("sb-net-range", 200).await;
    env.shutdown().await;
}
