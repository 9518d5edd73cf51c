//! Host-path volume bindings (OSEP-0003 `local`/`host` backends).
//!
//! A binding names a host directory (`host_path`, optionally narrowed by a
//! relative `sub_path`) and where it appears in the sandbox (`mount_path`).
//! [`resolve`] turns requested bindings into open source directories
//! ([`HeldMount`]), enforcing:
//!
//! - `host_path` is absolute and already normalized (no `.`/`..`, no empty
//!   components, no trailing `/`), and lies inside one of the configured
//!   allowlisted roots. An empty allowlist rejects every host path.
//! - `sub_path` is relative and normalized, without `..`.
//! - The directory is resolved **by the kernel**, not by string prefix: the
//!   allowlisted root is opened, and the remaining path is opened beneath it
//!   with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`, so no symlink
//!   (absolute, relative, `..`-laden, or `/proc` magic link) can lead outside
//!   the root. Symlinks that stay inside the root are fine.
//! - The target exists and is a directory; nothing is ever created.
//! - `mount_path` is absolute, normalized, not `/`, not on or under `/proc`,
//!   `/sys`, `/dev` or `/opt/sandbolt` (execd lives there), not an ancestor
//!   of `/opt/sandbolt` (which would hide execd), and not used twice.
//!
//! # Closing the check/use race
//!
//! [`resolve`] keeps the `O_PATH` descriptor it opened beneath the root and
//! returns it inside a [`HeldMount`]; the mount made into the sandbox is a
//! clone of *that open directory* (see [`crate::live_mount`]), never a
//! path looked up again later. A component swapped for a symlink after the
//! check (by another sandbox with a RW binding on the same root) cannot
//! redirect the mount: the descriptor already names the directory.
//!
//! runc 1.1.5 cannot take such a descriptor: handed `/proc/<agent pid>/fd/N`
//! (plain or an `open_tree` clone) as a bind source it fails with EINVAL,
//! because `mount(2)` in runc's new mount namespace refuses a source mount
//! that belongs to another namespace (verified on this host). So the agent
//! moves the clone into the sandbox's mount namespace itself, after
//! `tasks.Create` (runc has built the root) and before `tasks.Start` (none
//! of the sandbox's code has run): the same mechanism as mounting into a
//! running sandbox. The descriptors live until that is done, then close.

use std::collections::HashSet;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use sandbolt_proto::agent::v1::HostPathMount;

/// Where execd is bind-mounted in every sandbox.
pub const EXECD_DIR: &str = "/opt/sandbolt";

/// Sandbox paths a binding may not cover: kernel filesystems the runtime
/// sets up (and hardening masks parts of), and execd's directory.
const FORBIDDEN_MOUNT_ROOTS: &[&str] = &["/proc", "/sys", "/dev", EXECD_DIR];

/// A binding whose source directory is held open: whatever happens to the
/// path afterwards, the mount made from it is of this very directory.
/// The descriptor closes when the value is dropped (after the mount is made).
#[derive(Debug)]
pub struct HeldMount {
    fd: OwnedFd,
    /// The directory's host path when it was opened (logs and errors only;
    /// never looked up again).
    host_path: PathBuf,
    pub destination: String,
    pub read_only: bool,
}

impl HeldMount {
    /// The open source directory (`O_PATH`).
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// Where the directory was when it was opened.
    pub fn host_path(&self) -> &Path {
        &self.host_path
    }
}

/// A mount of an already opened directory (a named volume's data, opened
/// by the volume store beneath its root) at `destination`: the same
/// mount-path rules as host-path bindings. The descriptor must name a
/// directory; `O_PATH` is enough.
pub fn held_from_fd(
    fd: OwnedFd,
    destination: &str,
    read_only: bool,
) -> Result<HeldMount, VolumeError> {
    check_mount_path(destination)?;
    let host_path = fd_path(&fd).map_err(|source| VolumeError::Resolve {
        path: PathBuf::from(format!("<fd {}>", fd.as_raw_fd())),
        source,
    })?;
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(|e| VolumeError::Resolve {
        path: host_path.clone(),
        source: e.into(),
    })?;
    if st.st_mode & libc::S_IFMT != libc::S_IFDIR {
        return Err(VolumeError::NotADirectory { path: host_path });
    }
    Ok(HeldMount {
        fd,
        host_path,
        destination: destination.to_string(),
        read_only,
    })
}

/// Refuses two mounts at one sandbox path (host-path bindings and named
/// volumes together: each list is checked alone by its resolver).
pub fn check_distinct(mounts: &[HeldMount]) -> Result<(), VolumeError> {
    let mut seen = HashSet::new();
    for m in mounts {
        if !seen.insert(m.destination.as_str()) {
            return Err(VolumeError::DuplicateMountPath {
                path: m.destination.clone(),
            });
        }
    }
    Ok(())
}

/// Why a binding was refused. Every variant names the offending path and,
/// through its message, the rule it broke.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    #[error("host path {path:?} must be absolute")]
    HostPathNotAbsolute { path: String },
    #[error("host path {path:?} is not normalized: {reason}")]
    HostPathNotNormalized { path: String, reason: &'static str },
    #[error("host path {path:?} is not inside any allowlisted root (allowed: {allowed})")]
    NotAllowlisted { path: String, allowed: String },
    #[error("allowlisted root {root:?} is invalid: {reason}")]
    BadAllowlistRoot { root: PathBuf, reason: String },
    #[error("subPath {sub_path:?} (of host path {host_path:?}) must be relative")]
    SubPathAbsolute { host_path: String, sub_path: String },
    #[error("subPath {sub_path:?} (of host path {host_path:?}) must not contain \"..\"")]
    SubPathTraversal { host_path: String, sub_path: String },
    #[error("subPath {sub_path:?} (of host path {host_path:?}) is not normalized: {reason}")]
    SubPathNotNormalized {
        host_path: String,
        sub_path: String,
        reason: &'static str,
    },
    #[error("{path:?} resolves outside its allowlisted root {root:?} (through a symlink)")]
    Escapes { path: PathBuf, root: PathBuf },
    #[error("{path:?} does not exist (host directories are never created)")]
    Missing { path: PathBuf },
    #[error("{path:?} is not a directory")]
    NotADirectory { path: PathBuf },
    #[error("{path:?} could not be resolved: {source}")]
    Resolve { path: PathBuf, source: io::Error },
    #[error("mount path {path:?} must be absolute")]
    MountPathNotAbsolute { path: String },
    #[error("mount path {path:?} is not normalized: {reason}")]
    MountPathNotNormalized { path: String, reason: &'static str },
    #[error("mount path {path:?} is not allowed: {reason}")]
    MountPathForbidden { path: String, reason: String },
    #[error("mount path {path:?} is used by more than one binding")]
    DuplicateMountPath { path: String },
}

/// Resolves and validates every binding; the first failing one fails all.
pub fn resolve(
    mounts: &[HostPathMount],
    allowlist: &[PathBuf],
) -> Result<Vec<HeldMount>, VolumeError> {
    let mut seen = HashSet::new();
    let mut out = Vec::with_capacity(mounts.len());
    for m in mounts {
        check_mount_path(&m.mount_path)?;
        if !seen.insert(m.mount_path.as_str()) {
            return Err(VolumeError::DuplicateMountPath {
                path: m.mount_path.clone(),
            });
        }
        let (fd, source) = resolve_source(m, allowlist)?;
        tracing::debug!(host_path = %m.host_path, sub_path = %m.sub_path, source = %source.display(),
            destination = %m.mount_path, read_only = m.read_only, "host-path binding resolved");
        out.push(HeldMount {
            fd,
            host_path: source,
            destination: m.mount_path.clone(),
            read_only: m.read_only,
        });
    }
    Ok(out)
}

/// Checks that an absolute path is in normal form; returns the reason if not.
fn absolute_normalized(path: &str) -> Result<(), &'static str> {
    if path.contains('\0') {
        return Err("contains a NUL byte");
    }
    if path == "/" {
        return Ok(());
    }
    relative_normalized(&path[1..])
}

/// Checks a relative path: non-empty components, none of them `.` or `..`.
/// (`..` is reported separately by callers that have a dedicated error.)
fn relative_normalized(path: &str) -> Result<(), &'static str> {
    if path.contains('\0') {
        return Err("contains a NUL byte");
    }
    for part in path.split('/') {
        match part {
            "" => {
                return Err("contains an empty component (\"//\", or a leading or trailing \"/\")");
            }
            "." => return Err("contains a \".\" component"),
            ".." => return Err("contains a \"..\" component"),
            _ => {}
        }
    }
    Ok(())
}

/// The rules for a sandbox mount path (see the module docs); also applied
/// to mounts into running sandboxes, to the requested and to the resolved
/// path.
pub fn check_mount_path(path: &str) -> Result<(), VolumeError> {
    if !path.starts_with('/') {
        return Err(VolumeError::MountPathNotAbsolute {
            path: path.to_string(),
        });
    }
    absolute_normalized(path).map_err(|reason| VolumeError::MountPathNotNormalized {
        path: path.to_string(),
        reason,
    })?;
    if path == "/" {
        return Err(VolumeError::MountPathForbidden {
            path: path.into(),
            reason: "it would replace the sandbox's root filesystem".into(),
        });
    }
    let p = Path::new(path);
    for root in FORBIDDEN_MOUNT_ROOTS {
        if p.starts_with(root) {
            return Err(VolumeError::MountPathForbidden {
                path: path.into(),
                reason: format!("it is on or under {root}"),
            });
        }
    }
    if Path::new(EXECD_DIR).starts_with(p) {
        return Err(VolumeError::MountPathForbidden {
            path: path.into(),
            reason: format!("it would hide {EXECD_DIR} (execd)"),
        });
    }
    Ok(())
}

/// The binding's directory, opened by the kernel beneath its allowlisted
/// root, and its canonical host path at that moment.
fn resolve_source(
    m: &HostPathMount,
    allowlist: &[PathBuf],
) -> Result<(OwnedFd, PathBuf), VolumeError> {
    let host = m.host_path.as_str();
    let sub = m.sub_path.as_str();
    check_host_path(host)?;
    check_sub_path(host, sub)?;
    let host_p = Path::new(host);
    let root = allowlisted_root(host_p, allowlist)?;

    // Path below the root, as the kernel will walk it.
    let mut rel = host_p
        .strip_prefix(root)
        .expect("starts_with checked")
        .to_path_buf();
    if !sub.is_empty() {
        rel.push(sub);
    }
    let wanted = root.join(&rel);
    let (root_fd, dir_fd) = open_beneath(root, &rel, &wanted)?;

    let real_root = fd_path(&root_fd).map_err(|source| VolumeError::Resolve {
        path: root.clone(),
        source,
    })?;
    let real = fd_path(&dir_fd).map_err(|source| VolumeError::Resolve {
        path: wanted.clone(),
        source,
    })?;
    // Defence in depth: RESOLVE_BENEATH already guarantees this, but a
    // bind mount over part of the root after opening it would not be seen
    // by a string check on `wanted`; this checks what the fd really is.
    if !real.starts_with(&real_root) {
        return Err(VolumeError::Escapes {
            path: wanted,
            root: root.clone(),
        });
    }
    Ok((dir_fd, real))
}

fn check_host_path(host: &str) -> Result<(), VolumeError> {
    if !host.starts_with('/') {
        return Err(VolumeError::HostPathNotAbsolute {
            path: host.to_string(),
        });
    }
    absolute_normalized(host).map_err(|reason| VolumeError::HostPathNotNormalized {
        path: host.to_string(),
        reason,
    })
}

fn check_sub_path(host: &str, sub: &str) -> Result<(), VolumeError> {
    if sub.starts_with('/') {
        return Err(VolumeError::SubPathAbsolute {
            host_path: host.into(),
            sub_path: sub.into(),
        });
    }
    if sub.split('/').any(|c| c == "..") {
        return Err(VolumeError::SubPathTraversal {
            host_path: host.into(),
            sub_path: sub.into(),
        });
    }
    if !sub.is_empty() {
        relative_normalized(sub).map_err(|reason| VolumeError::SubPathNotNormalized {
            host_path: host.into(),
            sub_path: sub.into(),
            reason,
        })?;
    }
    Ok(())
}

/// An allowlisted root containing `host` (component-wise, so `/data-evil`
/// is not inside `/data`). With nested roots the widest one is used:
/// everything under it is allowed anyway, and symlinks are then judged
/// against the boundary the operator actually configured.
fn allowlisted_root<'a>(host: &Path, allowlist: &'a [PathBuf]) -> Result<&'a PathBuf, VolumeError> {
    let root = allowlist
        .iter()
        .filter(|r| host.starts_with(r))
        .min_by_key(|r| r.components().count())
        .ok_or_else(|| VolumeError::NotAllowlisted {
            path: host.display().to_string(),
            allowed: if allowlist.is_empty() {
                "none configured".to_string()
            } else {
                allowlist
                    .iter()
                    .map(|r| r.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        })?;
    let bad_root = |reason: String| VolumeError::BadAllowlistRoot {
        root: root.clone(),
        reason,
    };
    let root_str = root
        .to_str()
        .ok_or_else(|| bad_root("not valid UTF-8".into()))?;
    if !root_str.starts_with('/') {
        return Err(bad_root("not absolute".into()));
    }
    absolute_normalized(root_str).map_err(|r| bad_root(r.into()))?;
    Ok(root)
}

/// Opens the root, then `rel` beneath it with `openat2(RESOLVE_BENEATH)`.
/// The root itself is operator configuration and trusted: it is opened
/// normally (symlinks in it are followed). Everything below it is not.
fn open_beneath(root: &Path, rel: &Path, wanted: &Path) -> Result<(OwnedFd, OwnedFd), VolumeError> {
    let root_fd = open_dir(root).map_err(|e| VolumeError::BadAllowlistRoot {
        root: root.to_path_buf(),
        reason: match e.raw_os_error() {
            Some(libc::ENOENT) => "does not exist".into(),
            Some(libc::ENOTDIR) => "not a directory".into(),
            _ => e.to_string(),
        },
    })?;
    if rel.as_os_str().is_empty() {
        // host_path is the root itself.
        let dir_fd = open_dir(root).map_err(|source| VolumeError::Resolve {
            path: wanted.to_path_buf(),
            source,
        })?;
        return Ok((root_fd, dir_fd));
    }
    let dir_fd = crate::openat2::open_dir(
        &root_fd,
        rel,
        libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS,
    )
    .map_err(|e| match e.raw_os_error() {
        // EXDEV: the walk tried to leave the root; ELOOP with
        // RESOLVE_NO_MAGICLINKS: a /proc magic link was on the way.
        Some(libc::EXDEV) | Some(libc::ELOOP) => VolumeError::Escapes {
            path: wanted.to_path_buf(),
            root: root.to_path_buf(),
        },
        Some(libc::ENOENT) => VolumeError::Missing {
            path: wanted.to_path_buf(),
        },
        Some(libc::ENOTDIR) => VolumeError::NotADirectory {
            path: wanted.to_path_buf(),
        },
        _ => VolumeError::Resolve {
            path: wanted.to_path_buf(),
            source: e,
        },
    })?;
    Ok((root_fd, dir_fd))
}

/// `open(path, O_PATH | O_DIRECTORY | O_CLOEXEC)`.
fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: c is a valid NUL-terminated string; the fd is owned below.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a freshly opened descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The path the kernel has for an open fd.
fn fd_path(fd: &OwnedFd) -> io::Result<PathBuf> {
    let p = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))?;
    if p.as_os_str().as_bytes().ends_with(b" (deleted)") {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "directory was deleted while resolving",
        ));
    }
    if !p.is_absolute() {
        // Not reachable from our mount namespace's root (e.g. a detached mount).
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("fd resolves to {p:?}"),
        ));
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn m(host: &str, sub: &str, mount: &str, ro: bool) -> HostPathMount {
        HostPathMount {
            host_path: host.into(),
            sub_path: sub.into(),
            mount_path: mount.into(),
            read_only: ro,
        }
    }

    struct Fixture {
        _tmp: tempfile::TempDir,
        root: PathBuf,
        outside: PathBuf,
    }

    /// root/ (allowlisted): data/, data/task-1/, file.txt, link-in -> data,
    /// link-etc -> /etc, link-up -> .., link-abs-out -> <outside>,
    /// link-proc -> /proc/self/root; and <outside>/ next to root.
    fn fixture() -> Fixture {
        let tmp = tempfile::tempdir().unwrap();
        // Canonicalize: /tmp may itself be a symlink on some hosts.
        let base = tmp.path().canonicalize().unwrap();
        let root = base.join("root");
        let outside = base.join("outside");
        std::fs::create_dir_all(root.join("data/task-1")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(root.join("file.txt"), b"x").unwrap();
        symlink("data", root.join("link-in")).unwrap();
        symlink("/etc", root.join("link-etc")).unwrap();
        symlink("..", root.join("link-up")).unwrap();
        symlink(&outside, root.join("link-abs-out")).unwrap();
        symlink("/proc/self/root", root.join("link-proc")).unwrap();
        symlink("../link-up/outside", root.join("data/link-deep")).unwrap();
        Fixture {
            _tmp: tmp,
            root,
            outside,
        }
    }

    fn one(f: &Fixture, mount: HostPathMount) -> Result<HeldMount, VolumeError> {
        resolve(&[mount], std::slice::from_ref(&f.root)).map(|mut v| v.remove(0))
    }

    fn host(f: &Fixture, rel: &str) -> String {
        if rel.is_empty() {
            f.root.display().to_string()
        } else {
            format!("{}/{rel}", f.root.display())
        }
    }

    #[test]
    fn accepts_valid_bindings() {
        let f = fixture();
        let r = one(&f, m(&host(&f, "data"), "task-1", "/workspace", false)).unwrap();
        assert_eq!(r.host_path(), f.root.join("data/task-1"));
        assert_eq!(r.destination, "/workspace");
        assert!(!r.read_only);
        // The held descriptor is the directory itself.
        assert_eq!(fd_path(r.fd()).unwrap(), f.root.join("data/task-1"));
        let r = one(&f, m(&host(&f, ""), "", "/mnt/all", true)).unwrap();
        assert_eq!(r.host_path(), f.root);
        assert!(r.read_only);
        let r = one(&f, m(&host(&f, "data"), "", "/data", true)).unwrap();
        assert_eq!(r.host_path(), f.root.join("data"));
        // A symlink that stays inside the root is followed to its real path.
        let r = one(&f, m(&host(&f, "link-in"), "task-1", "/w", false)).unwrap();
        assert_eq!(r.host_path(), f.root.join("data/task-1"));
        let r = one(&f, m(&host(&f, ""), "link-in", "/w", false)).unwrap();
        assert_eq!(r.host_path(), f.root.join("data"));
        // Several bindings at once, in order.
        let all = resolve(
            &[
                m(&host(&f, "data"), "", "/a", true),
                m(&host(&f, "data"), "task-1", "/b", false),
            ],
            std::slice::from_ref(&f.root),
        )
        .unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(all[1].destination, "/b");
    }

    fn err(f: &Fixture, mount: HostPathMount) -> VolumeError {
        match one(f, mount) {
            Ok(r) => panic!("expected rejection, got {r:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn rejects_bad_host_paths() {
        let f = fixture();
        assert!(matches!(
            err(&f, m("data", "", "/w", false)),
            VolumeError::HostPathNotAbsolute { .. }
        ));
        assert!(matches!(
            err(&f, m("", "", "/w", false)),
            VolumeError::HostPathNotAbsolute { .. }
        ));
        for bad in [
            "data/../data",
            "data/./task-1",
            "data//task-1",
            "data/",
            "data/..",
        ] {
            let e = err(&f, m(&host(&f, bad), "", "/w", false));
            assert!(
                matches!(e, VolumeError::HostPathNotNormalized { .. }),
                "{bad}: {e}"
            );
        }
        let e = err(&f, m(&host(&f, "data/.."), "", "/w", false));
        assert!(e.to_string().contains("\"..\""), "{e}");
        // Outside the allowlist, including a sibling sharing the prefix string.
        let e = err(&f, m(&f.outside.display().to_string(), "", "/w", false));
        assert!(matches!(e, VolumeError::NotAllowlisted { .. }), "{e}");
        let sibling = format!("{}-evil", f.root.display());
        std::fs::create_dir_all(&sibling).unwrap();
        assert!(matches!(
            err(&f, m(&sibling, "", "/w", false)),
            VolumeError::NotAllowlisted { .. }
        ));
        assert!(matches!(
            err(&f, m("/etc", "", "/w", false)),
            VolumeError::NotAllowlisted { .. }
        ));
        // Empty allowlist rejects everything.
        let e = resolve(&[m(&host(&f, "data"), "", "/w", false)], &[]).unwrap_err();
        assert!(e.to_string().contains("none configured"), "{e}");
    }

    #[test]
    fn rejects_bad_sub_paths() {
        let f = fixture();
        let h = host(&f, "data");
        assert!(matches!(
            err(&f, m(&h, "/task-1", "/w", false)),
            VolumeError::SubPathAbsolute { .. }
        ));
        assert!(matches!(
            err(&f, m(&h, "/etc", "/w", false)),
            VolumeError::SubPathAbsolute { .. }
        ));
        for bad in ["..", "../outside", "task-1/../..", "task-1/.."] {
            let e = err(&f, m(&h, bad, "/w", false));
            assert!(
                matches!(e, VolumeError::SubPathTraversal { .. }),
                "{bad}: {e}"
            );
            assert!(e.to_string().contains("must not contain \"..\""));
        }
        for bad in ["task-1/", "./task-1", "a//b"] {
            assert!(
                matches!(
                    err(&f, m(&h, bad, "/w", false)),
                    VolumeError::SubPathNotNormalized { .. }
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn rejects_missing_and_non_directories() {
        let f = fixture();
        let e = err(&f, m(&host(&f, "nope"), "", "/w", false));
        assert!(matches!(e, VolumeError::Missing { .. }), "{e}");
        assert!(e.to_string().contains("never created"));
        assert!(!f.root.join("nope").exists());
        assert!(matches!(
            err(&f, m(&host(&f, "data"), "task-2", "/w", false)),
            VolumeError::Missing { .. }
        ));
        assert!(matches!(
            err(&f, m(&host(&f, "file.txt"), "", "/w", false)),
            VolumeError::NotADirectory { .. }
        ));
        assert!(matches!(
            err(&f, m(&host(&f, ""), "file.txt", "/w", false)),
            VolumeError::NotADirectory { .. }
        ));
        assert!(matches!(
            err(&f, m(&host(&f, "file.txt"), "x", "/w", false)),
            VolumeError::NotADirectory { .. }
        ));
        // A missing allowlisted root is a configuration error, named as such.
        let e = resolve(
            &[m("/nonexistent-sandbolt-root/x", "", "/w", false)],
            &[PathBuf::from("/nonexistent-sandbolt-root")],
        )
        .unwrap_err();
        assert!(matches!(e, VolumeError::BadAllowlistRoot { .. }), "{e}");
    }

    #[test]
    fn rejects_symlink_escapes() {
        let f = fixture();
        for (h, sub) in [
            ("link-etc", ""),
            ("", "link-etc"),
            ("link-up", ""),
            ("", "link-up"),
            ("link-up", "outside"),
            ("link-abs-out", ""),
            ("", "link-abs-out"),
            ("data", "link-deep"),
            ("data/link-deep", ""),
        ] {
            let e = err(&f, m(&host(&f, h), sub, "/w", false));
            assert!(matches!(e, VolumeError::Escapes { .. }), "{h}/{sub}: {e}");
            assert!(
                e.to_string().contains("outside its allowlisted root"),
                "{e}"
            );
        }
        // A magic link to / is refused too.
        let e = err(&f, m(&host(&f, "link-proc"), "", "/w", false));
        assert!(matches!(e, VolumeError::Escapes { .. }), "{e}");
    }

    #[test]
    fn rejects_bad_mount_paths() {
        let f = fixture();
        let h = host(&f, "data");
        assert!(matches!(
            err(&f, m(&h, "", "workspace", false)),
            VolumeError::MountPathNotAbsolute { .. }
        ));
        assert!(matches!(
            err(&f, m(&h, "", "", false)),
            VolumeError::MountPathNotAbsolute { .. }
        ));
        for bad in ["/a/../b", "/a/./b", "/a//b", "/a/"] {
            assert!(
                matches!(
                    err(&f, m(&h, "", bad, false)),
                    VolumeError::MountPathNotNormalized { .. }
                ),
                "{bad}"
            );
        }
        for bad in [
            "/",
            "/proc",
            "/proc/sys",
            "/sys",
            "/sys/fs/cgroup",
            "/dev",
            "/dev/shm",
            "/opt/sandbolt",
            "/opt/sandbolt/x",
            "/opt",
        ] {
            let e = err(&f, m(&h, "", bad, false));
            assert!(
                matches!(e, VolumeError::MountPathForbidden { .. }),
                "{bad}: {e}"
            );
        }
        // Prefix strings that are different directories are fine.
        for ok in ["/procfs", "/device", "/opt/sandbolt2", "/opt/other"] {
            one(&f, m(&h, "", ok, false)).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        let e = resolve(
            &[m(&h, "", "/w", false), m(&h, "task-1", "/w", true)],
            std::slice::from_ref(&f.root),
        )
        .unwrap_err();
        assert!(matches!(e, VolumeError::DuplicateMountPath { .. }), "{e}");
    }

    #[test]
    fn the_held_directory_stays_the_checked_one() {
        let f = fixture();
        std::fs::write(f.root.join("data/task-1/inside.txt"), b"in").unwrap();
        let r = one(&f, m(&host(&f, "data"), "task-1", "/w", false)).unwrap();
        // The path is swapped for a symlink out of the root after the check.
        std::fs::rename(f.root.join("data"), f.root.join("moved")).unwrap();
        symlink("/", f.root.join("data")).unwrap();
        let through_fd = format!("/proc/self/fd/{}/inside.txt", r.fd().as_raw_fd());
        assert_eq!(std::fs::read(through_fd).unwrap(), b"in");
        assert_eq!(fd_path(r.fd()).unwrap(), f.root.join("moved/task-1"));
        // Resolving again now refuses the symlink.
        let e = err(&f, m(&host(&f, "data"), "task-1", "/w", false));
        assert!(matches!(e, VolumeError::Escapes { .. }), "{e}");
    }

    #[test]
    fn held_from_fd_checks_mount_path_and_type() {
        let f = fixture();
        let dir = open_dir(&f.root.join("data")).unwrap();
        let h = held_from_fd(dir, "/vol", true).unwrap();
        assert_eq!(h.host_path(), f.root.join("data"));
        assert_eq!(h.destination, "/vol");
        assert!(h.read_only);
        for bad in ["/", "/proc/x", "relative", "/opt", "/a//b"] {
            let dir = open_dir(&f.root.join("data")).unwrap();
            assert!(held_from_fd(dir, bad, false).is_err(), "{bad}");
        }
        let file = std::fs::File::open(f.root.join("file.txt")).unwrap();
        let e = held_from_fd(file.into(), "/vol", false).unwrap_err();
        assert!(matches!(e, VolumeError::NotADirectory { .. }), "{e}");
    }

    #[test]
    fn check_distinct_refuses_one_path_twice() {
        let f = fixture();
        let a = held_from_fd(open_dir(&f.root).unwrap(), "/a", false).unwrap();
        let b = held_from_fd(open_dir(&f.root).unwrap(), "/b", false).unwrap();
        let a2 = held_from_fd(open_dir(&f.root).unwrap(), "/a", true).unwrap();
        check_distinct(&[a, b]).unwrap();
        let b = held_from_fd(open_dir(&f.root).unwrap(), "/b", false).unwrap();
        let e = check_distinct(&[
            a2,
            b,
            held_from_fd(open_dir(&f.root).unwrap(), "/a", false).unwrap(),
        ])
        .unwrap_err();
        assert!(matches!(e, VolumeError::DuplicateMountPath { .. }), "{e}");
    }

    #[test]
    fn nested_roots_use_the_widest() {
        let f = fixture();
        let inner = f.root.join("data");
        std::fs::create_dir_all(f.root.join("other")).unwrap();
        symlink("../other", inner.join("to-other")).unwrap();
        // Only the inner root allowlisted: leaving it is an escape.
        let e = resolve(
            &[m(&inner.display().to_string(), "to-other", "/w", false)],
            std::slice::from_ref(&inner),
        )
        .unwrap_err();
        assert!(matches!(e, VolumeError::Escapes { .. }), "{e}");
        // Both allowlisted: the target is inside the outer root, so allowed.
        let allow = [inner.clone(), f.root.clone()];
        let r = resolve(
            &[m(&inner.display().to_string(), "to-other", "/w", false)],
            &allow,
        )
        .unwrap();
        assert_eq!(r[0].host_path(), f.root.join("other"));
    }
}
