//! Property tests of the agent's host-path bindings, the last check before a
//! host directory is mounted into a sandbox: whatever path, `subPath` and
//! symlinks a request brings, an accepted binding's directory (as the
//! kernel opened it) lies inside its allowlisted root, and its mount path is
//! in normal form and off the paths sandbolt owns.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use sandbolt_agent::volumes::{check_mount_path, resolve};
use sandbolt_proto::agent::v1::HostPathMount;

/// Components that walk a tree with escaping and staying symlinks.
fn rel_path() -> impl Strategy<Value = String> {
    let part = prop_oneof![
        Just("".to_string()),
        Just(".".to_string()),
        Just("..".to_string()),
        Just("a".to_string()),
        Just("b".to_string()),
        Just("up".to_string()),
        Just("abs".to_string()),
        Just("inside".to_string()),
        Just("proc".to_string()),
        "[a-z]{1,3}",
    ];
    proptest::collection::vec(part, 0..5).prop_map(|p| p.join("/"))
}

fn mount_path() -> impl Strategy<Value = String> {
    (rel_path(), any::<bool>(), any::<bool>()).prop_map(|(p, abs, trailing)| {
        let mut s = if abs { format!("/{p}") } else { p };
        if trailing {
            s.push('/');
        }
        s
    })
}

/// `.`/`..` resolved and `//` folded, as the kernel reads the path.
fn lexical(p: &str) -> String {
    let mut out: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            c => out.push(c),
        }
    }
    format!("/{}", out.join("/"))
}

/// root/allowed/{a/b, inside -> a, up -> ../outside, abs -> /},
/// root/outside.
fn tree() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let allowed = dir.path().join("allowed");
    std::fs::create_dir_all(allowed.join("a/b")).unwrap();
    std::fs::create_dir_all(dir.path().join("outside")).unwrap();
    std::os::unix::fs::symlink("a", allowed.join("inside")).unwrap();
    std::os::unix::fs::symlink("../outside", allowed.join("up")).unwrap();
    std::os::unix::fs::symlink("/", allowed.join("abs")).unwrap();
    std::os::unix::fs::symlink("../../outside", allowed.join("a/b/up2")).unwrap();
    (dir, allowed)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn accepted_mount_paths_are_normal_and_off_reserved_paths(p in mount_path()) {
        if check_mount_path(&p).is_ok() {
            prop_assert_eq!(lexical(&p), p.clone());
            prop_assert!(p != "/");
            for r in ["/proc", "/sys", "/dev", "/opt/sandbolt"] {
                prop_assert!(!Path::new(&p).starts_with(r), "{} under {}", p, r);
            }
            prop_assert!(!Path::new("/opt/sandbolt").starts_with(&p), "{} hides execd", p);
        }
    }

    #[test]
    fn accepted_sources_stay_inside_their_root(host in rel_path(), sub in rel_path(), mount in mount_path()) {
        let (_dir, allowed) = tree();
        let m = HostPathMount {
            host_path: format!("{}/{host}", allowed.display()).trim_end_matches('/').to_string(),
            sub_path: sub,
            mount_path: mount,
            read_only: false,
        };
        if let Ok(held) = resolve(std::slice::from_ref(&m), std::slice::from_ref(&allowed)) {
            let root = std::fs::canonicalize(&allowed).unwrap();
            let fd = held[0].fd().as_raw_fd();
            let real = std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap();
            prop_assert!(real.starts_with(&root), "{:?} opened {} outside {}", m, real.display(), root.display());
            prop_assert!(real.is_dir());
            prop_assert_eq!(lexical(&m.mount_path), m.mount_path.clone());
        }
    }
}
