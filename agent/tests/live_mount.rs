//! Mounting into and out of a running sandbox (`sandbolt_agent::live_mount`)
//! on the test bed's real containerd and runc: what the sandbox sees (through
//! `ctr tasks exec`, i.e. a process inside it), what the host sees, and that
//! symlinks planted inside the sandbox cannot carry a mount out of its root.

use crate::common;

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

use common::*;
use sandbolt_agent::live_mount::{self, LiveMountError};
use sandbolt_proto::agent::v1::SandboxPhase;

/// Runs `script` inside sandbox `id`; returns (success, stdout+stderr).
fn exec(env: &Env, id: &str, script: &str) -> (bool, String) {
    static N: AtomicU32 = AtomicU32::new(0);
    let exec_id = format!("live-{}", N.fetch_add(1, Ordering::Relaxed));
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

fn dir_fd(p: &Path) -> OwnedFd {
    std::fs::File::open(p).unwrap().into()
}

/// The sandbox's mountinfo line for `point`, if something is mounted there.
fn mount_line(pid: u32, point: &str) -> Option<String> {
    let table = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap();
    table
        .lines()
        .rfind(|l| l.split(' ').nth(4) == Some(point))
        .map(str::to_string)
}

/// A tmpfs mounted for the test; unmounted on drop (also on failure).
struct TmpfsMount(std::path::PathBuf);

impl TmpfsMount {
    fn new(at: &Path) -> TmpfsMount {
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "sandbolt-live-mount"])
            .arg(at)
            .status()
            .expect("run mount");
        assert!(st.success(), "mount tmpfs at {}", at.display());
        TmpfsMount(at.to_path_buf())
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn live_attach_and_detach_in_a_running_sandbox() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().canonicalize().unwrap();
    let (rw, ro) = (base.join("rw"), base.join("ro"));
    std::fs::create_dir_all(&rw).unwrap();
    std::fs::create_dir_all(ro.join("sub")).unwrap();
    std::fs::write(rw.join("seed.txt"), "rw-seed\n").unwrap();
    std::fs::write(ro.join("seed.txt"), "ro-seed\n").unwrap();
    // A filesystem below the read-only source: read-only inside too.
    let _sub = TmpfsMount::new(&ro.join("sub"));

    let mut env = Env::start().await;
    let resp = env
        .create(spec("sb-live", &["sleep", "100000"]))
        .await
        .expect("create");
    let status = resp.status.unwrap();
    assert_eq!(status.phase(), SandboxPhase::Running);
    let pid = status.pid;

    // Read-write: the sandbox reads the host's data and writes through.
    live_mount::attach(pid, "sb-live", &dir_fd(&rw), "/mnt/rw", false).expect("attach rw");
    let (ok, out) = exec(
        &env,
        "sb-live",
        "cat /mnt/rw/seed.txt && echo from-inside > /mnt/rw/new.txt && echo WROTE",
    );
    assert!(
        ok && out.contains("rw-seed") && out.contains("WROTE"),
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(rw.join("new.txt")).unwrap(),
        "from-inside\n"
    );
    let line = mount_line(pid, "/mnt/rw").expect("mounted in the sandbox");
    assert!(line.contains("nosuid") && line.contains("nodev"), "{line}");
    // Private: no propagation to or from the host.
    assert!(
        !line.contains("shared:") && !line.contains("master:"),
        "{line}"
    );
    let host_table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !host_table.lines().any(|l| l.contains("/mnt/rw")),
        "the mount must not appear on the host"
    );

    // Read-only, recursively: the submount below it is read-only too.
    live_mount::attach(pid, "sb-live", &dir_fd(&ro), "/data/ro", true).expect("attach ro");
    let (_, out) = exec(
        &env,
        "sb-live",
        "cat /data/ro/seed.txt; echo x > /data/ro/f; echo x > /data/ro/sub/f; echo DONE",
    );
    assert!(out.contains("ro-seed"), "{out}");
    assert_eq!(
        out.matches("Read-only file system").count(),
        2,
        "both writes must fail with EROFS:\n{out}"
    );
    assert!(!ro.join("f").exists() && !ro.join("sub/f").exists());

    // Detach: the path no longer shows the data; the host keeps it.
    live_mount::detach(pid, "sb-live", "/mnt/rw").expect("detach");
    let (ok, out) = exec(&env, "sb-live", "ls -A /mnt/rw; echo LISTED");
    assert!(
        ok && out.trim() == "LISTED",
        "still visible after detach: {out}"
    );
    assert!(mount_line(pid, "/mnt/rw").is_none());
    assert!(rw.join("new.txt").exists() && rw.join("seed.txt").exists());
    // Nothing (left) mounted there, or not a path a mount may be at.
    for (path, want) in [
        ("/mnt/rw", "nothing is mounted"),
        ("/mnt", "nothing is mounted"),
    ] {
        let e = live_mount::detach(pid, "sb-live", path).unwrap_err();
        assert!(
            matches!(e, LiveMountError::NotMounted { .. }),
            "{path}: {e}"
        );
        assert!(e.to_string().contains(want), "{e}");
    }
    let e = live_mount::detach(pid, "sb-live", "/proc").unwrap_err();
    assert!(e.is_invalid_argument(), "{e}");

    symlinks_planted_inside_stay_inside(&env, pid, &rw);

    // Requests that break the mount-path rules, and a task that is gone.
    for bad in ["/", "/proc/x", "/opt/sandbolt", "relative", "/a/../b"] {
        let e = live_mount::attach(pid, "sb-live", &dir_fd(&rw), bad, false).unwrap_err();
        assert!(matches!(e, LiveMountError::MountPath(_)), "{bad}: {e}");
    }
    let gone = std::process::Command::new("true").spawn().unwrap();
    let gone_pid = gone.id();
    let _ = { gone }.wait();
    let e = live_mount::attach(gone_pid, "sb-live", &dir_fd(&rw), "/x", false).unwrap_err();
    assert!(matches!(e, LiveMountError::TaskGone { .. }), "{e}");
    // A pid in the agent's own mount namespace (say, reused by a host
    // process after the task ended) is refused: that would mount on the host.
    let own = std::process::id();
    let e = live_mount::attach(own, "sb-live", &dir_fd(&rw), "/mnt/host-x", false).unwrap_err();
    assert!(matches!(e, LiveMountError::NotASandbox { .. }), "{e}");
    assert!(!Path::new("/mnt/host-x").exists());
    let e = live_mount::detach(own, "sb-live", "/tmp").unwrap_err();
    assert!(matches!(e, LiveMountError::NotASandbox { .. }), "{e}");
    // A pid that names a process in a mount namespace of its own but not
    // in this sandbox's cgroup (what a pid reused by another container's
    // process looks like) is refused too: the volume must not land there.
    let mut other = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sleep", "100000"])
        .spawn()
        .expect("spawn unshare");
    let other_pid = other.id();
    let in_own_ns = || {
        let ns = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
        ns(other_pid) != ns(std::process::id())
    };
    while !in_own_ns() {
        std::thread::yield_now();
    }
    let e =
        live_mount::attach(other_pid, "sb-live", &dir_fd(&rw), "/mnt/other", false).unwrap_err();
    assert!(matches!(e, LiveMountError::NotASandbox { .. }), "{e}");
    assert!(mount_line(other_pid, "/mnt/other").is_none());
    let _ = other.kill();
    let _ = other.wait();

    env.delete_leaving_nothing("sb-live", 0).await;
    assert!(rw.join("seed.txt").exists() && ro.join("seed.txt").exists());
    env.shutdown().await;
}

/// Symlinks the sandbox plants at (or above) a mount path are resolved in
/// its own root: they can redirect a mount only to another allowed place
/// inside the sandbox, never outside it nor onto `/` or `/proc`.
fn symlinks_planted_inside_stay_inside(env: &Env, pid: u32, rw: &Path) {
    let (ok, out) = exec(
        env,
        "sb-live",
        "ln -s / /mnt/evil && ln -s /proc /mnt/evilproc && ln -s ../../../../.. /mnt/up \
         && ln -s /nonexistent-live /mnt/dangling && echo PLANTED",
    );
    assert!(ok && out.contains("PLANTED"), "{out}");
    let seed_before = std::fs::read_to_string(rw.join("seed.txt")).unwrap();

    // A symlink to / would make the mount cover the sandbox's root.
    let e = live_mount::attach(pid, "sb-live", &dir_fd(rw), "/mnt/evil", false).unwrap_err();
    match &e {
        LiveMountError::Redirected { resolved, .. } => assert_eq!(resolved, "/"),
        other => panic!("expected Redirected, got {other}"),
    }
    // Through /proc: refused before anything is made there.
    let e = live_mount::attach(pid, "sb-live", &dir_fd(rw), "/mnt/evilproc/x", false).unwrap_err();
    match &e {
        LiveMountError::Redirected { resolved, .. } => assert_eq!(resolved, "/proc/x"),
        other => panic!("expected Redirected, got {other}"),
    }
    // A dangling symlink where a directory is to be made.
    let e = live_mount::attach(pid, "sb-live", &dir_fd(rw), "/mnt/dangling", false).unwrap_err();
    assert!(matches!(e, LiveMountError::SymlinkInTheWay { .. }), "{e}");
    assert!(e.is_invalid_argument());
    // `..` climbs no higher than the sandbox's root: the mount lands at the
    // sandbox's /vol-live, not the host's.
    assert!(!Path::new("/vol-live").exists());
    live_mount::attach(pid, "sb-live", &dir_fd(rw), "/mnt/up/vol-live", false)
        .expect("attach via ..");
    let (ok, out) = exec(env, "sb-live", "cat /vol-live/seed.txt");
    assert!(ok && out.contains("rw-seed"), "{out}");
    assert!(mount_line(pid, "/vol-live").is_some());
    assert!(
        !Path::new("/vol-live").exists(),
        "a directory was made on the host"
    );
    assert!(!Path::new("/nonexistent-live").exists());

    // The sandbox's root is untouched and the host directory unchanged.
    let (ok, out) = exec(
        env,
        "sb-live",
        "ls /bin/sh /etc/passwd && ls /mnt/evil/bin/sh",
    );
    assert!(ok, "{out}");
    assert!(mount_line(pid, "/").is_some_and(|l| !l.contains(&rw.display().to_string())));
    assert_eq!(
        std::fs::read_to_string(rw.join("seed.txt")).unwrap(),
        seed_before
    );
    live_mount::detach(pid, "sb-live", "/mnt/up/vol-live").expect("detach via the same symlink");
    assert!(mount_line(pid, "/vol-live").is_none());
}
