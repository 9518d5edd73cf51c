//! The symlink-swap attack on host-path bindings, on the test bed's real
//! containerd and runc: while a racer (standing in for a second sandbox with
//! a read-write binding on the same root) flips a directory of the
//! allowlisted root between the real directory and a symlink to `/`, the
//! agent creates sandboxes binding that directory (and a sub-path below it)
//! over and over. Every sandbox must see the real directory's marker files,
//! or its create must fail cleanly — never the host's `/`.

use crate::common;

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::*;
use sandbolt_proto::agent::v1::{HostPathMount, SandboxPhase};

const ROUNDS: usize = 200;
/// A bound on a broken run, not a speed requirement.
const MAX_TIME: Duration = Duration::from_secs(600);

/// `renameat2(a, b, RENAME_EXCHANGE)`: both names always exist; which one
/// is the directory flips atomically.
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    let a = CString::new(a.as_os_str().as_bytes()).unwrap();
    let b = CString::new(b.as_os_str().as_bytes()).unwrap();
    // SAFETY: NUL-terminated paths.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// What the sandbox with task `pid` sees at `path` (through its root).
fn inside(pid: u32, path: &str) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/root{path}"))
}

fn listing(p: &Path) -> String {
    match std::fs::read_dir(p) {
        Ok(rd) => {
            let mut v: Vec<String> = rd
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            let more = v.len().saturating_sub(8);
            v.truncate(8);
            if more > 0 {
                v.push(format!("... {more} more"));
            }
            v.join(" ")
        }
        Err(e) => format!("<{e}>"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn symlink_swap_never_mounts_outside_the_root() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().canonicalize().unwrap();
    let d = root.join("d");
    std::fs::create_dir_all(d.join("etc")).unwrap();
    std::fs::write(d.join("MARKER-INSIDE"), "inside\n").unwrap();
    std::fs::write(d.join("etc/MARKER-INSIDE-ETC"), "inside-etc\n").unwrap();
    let swap = root.join("swap");
    std::os::unix::fs::symlink("/", &swap).unwrap();

    let allow = root.clone();
    let mut env = Env::start_with(move |cfg| cfg.allowed_host_paths = vec![allow]).await;
    let mounts = vec![
        HostPathMount {
            host_path: d.display().to_string(),
            sub_path: String::new(),
            mount_path: "/mnt/d".into(),
            read_only: true,
        },
        HostPathMount {
            host_path: d.display().to_string(),
            sub_path: "etc".into(),
            mount_path: "/mnt/e".into(),
            read_only: false,
        },
    ];
    let mk = |id: &str| {
        let mut s = spec(id, &["sleep", "100000"]);
        s.host_mounts = mounts.clone();
        s
    };

    // Warm-up (connections, image): the descriptor count after it is the
    // baseline a leak would grow.
    env.create(mk("sb-race-warm"))
        .await
        .expect("warm-up create");
    env.delete_leaving_nothing("sb-race-warm", 0).await;
    let fds_before = open_fds();

    let stop = Arc::new(AtomicBool::new(false));
    let flips = Arc::new(AtomicU64::new(0));
    let racer = {
        let (stop, flips, d, swap) = (stop.clone(), flips.clone(), d.clone(), swap.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                exchange(&d, &swap).expect("renameat2(RENAME_EXCHANGE)");
                flips.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    let started = Instant::now();
    let (mut ok, mut refused) = (0usize, 0usize);
    let mut escapes = Vec::new();
    for round in 0..ROUNDS {
        if started.elapsed() > MAX_TIME {
            break;
        }
        let id = format!("sb-race-{round}");
        match env.create(mk(&id)).await {
            Ok(resp) => {
                let status = resp.status.expect("a status");
                assert_eq!(status.phase(), SandboxPhase::Running, "{status:?}");
                let pid = status.pid;
                let d_ok = inside(pid, "/mnt/d/MARKER-INSIDE").exists();
                let e_ok = inside(pid, "/mnt/e/MARKER-INSIDE-ETC").exists();
                if d_ok && e_ok {
                    ok += 1;
                } else {
                    escapes.push(format!(
                        "{id}: /mnt/d = [{}], /mnt/e = [{}]",
                        listing(&inside(pid, "/mnt/d")),
                        listing(&inside(pid, "/mnt/e"))
                    ));
                }
                env.delete_leaving_nothing(&id, 0).await;
            }
            Err(e) => {
                // The clean refusal: the check saw the symlink.
                assert_eq!(e.code(), tonic::Code::InvalidArgument, "{id}: {e:?}");
                assert!(
                    e.message().contains("outside its allowlisted root"),
                    "{id}: {}",
                    e.message()
                );
                assert_eq!(leftovers(&env, &id), Vec::<String>::new(), "{id}");
                refused += 1;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    racer.join().unwrap();
    let flips = flips.load(Ordering::Relaxed);
    eprintln!(
        "{} rounds in {:?}: {ok} created with the right directory, {refused} refused, \
         {} escaped; {flips} flips",
        ok + refused + escapes.len(),
        started.elapsed(),
        escapes.len()
    );
    assert!(
        escapes.is_empty(),
        "sandboxes saw something other than the checked directory:\n{}",
        escapes.join("\n")
    );
    // The race really ran both ways.
    assert!(ok >= 10, "too few creates succeeded to mean anything: {ok}");
    assert!(
        refused >= 10,
        "the racer was never seen: {refused} refusals"
    );
    assert!(flips > 1000, "racer too slow: {flips} flips");

    // Every held descriptor was closed after its create.
    let fds_after = open_fds();
    assert!(
        fds_after <= fds_before + 8,
        "descriptors leaked: {fds_before} before, {fds_after} after {ok} creates"
    );
    // Nothing of the root is mounted anywhere on the host.
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !table.contains(root.to_str().unwrap()),
        "a mount of the root is left on the host"
    );
    env.shutdown().await;
}
