//! Opening `data/<sub_path>` of a volume without ever following a symlink
//! a sandbox may have planted there: the walk goes one component at a time
//! with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV)`
//! and creates missing directories with `mkdirat` on the descriptor it
//! holds, so no path is ever resolved twice.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use super::VolumeStoreError;
use super::names::Label;

/// How often a component may vanish between a failed open and our mkdir
/// (someone deleting it concurrently) before we give up.
const RACE_RETRIES: usize = 16;

/// The components of a sub path: relative, no empty, "." or ".."
/// components, no NUL. "" is the data root (no components).
pub(super) fn sub_path_components<'a>(
    volume: Label<'_>,
    sub_path: &'a str,
) -> Result<Vec<&'a str>, VolumeStoreError> {
    let bad = |reason: &str| VolumeStoreError::InvalidSubPath {
        volume: volume.as_str().into(),
        sub_path: sub_path.into(),
        reason: reason.into(),
    };
    if sub_path.is_empty() {
        return Ok(Vec::new());
    }
    if sub_path.starts_with('/') {
        return Err(bad("must be relative (no leading \"/\")"));
    }
    if sub_path.contains('\0') {
        return Err(bad("must not contain NUL"));
    }
    let parts: Vec<&str> = sub_path.split('/').collect();
    if parts.contains(&"..") {
        return Err(bad("must not contain \"..\""));
    }
    if parts.iter().any(|p| p.is_empty() || *p == ".") {
        return Err(bad("must be normalized (no empty or \".\" components)"));
    }
    Ok(parts)
}

/// `open(path, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)`.
pub(super) fn open_dir_nofollow(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a valid NUL-terminated path; the fd is owned below.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Walks `parts` below `root`, creating missing directories (with the
/// root's permission bits, as the kubelet does for subPath). Fails with
/// the component it stopped at.
pub(super) fn walk_creating<'a>(
    root: OwnedFd,
    parts: &[&'a str],
) -> Result<OwnedFd, (&'a str, io::Error)> {
    let mode = mode_of(&root).map_err(|e| ("", e))?;
    let mut dir = root;
    for part in parts {
        dir = open_or_create(&dir, part, mode).map_err(|e| (*part, e))?;
    }
    Ok(dir)
}

fn open_or_create(dir: &OwnedFd, name: &str, mode: libc::mode_t) -> io::Result<OwnedFd> {
    let c = CString::new(name)?;
    for _ in 0..RACE_RETRIES {
        match crate::openat2::open_dir(
            dir,
            Path::new(std::ffi::OsStr::from_bytes(c.as_bytes())),
            // Refusing symlinks (ELOOP), mount crossings (EXDEV) and
            // non-directories (ENOTDIR).
            libc::RESOLVE_BENEATH
                | libc::RESOLVE_NO_SYMLINKS
                | libc::RESOLVE_NO_MAGICLINKS
                | libc::RESOLVE_NO_XDEV,
        ) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            other => return other,
        }
        // SAFETY: a valid dirfd and NUL-terminated name.
        let rc = unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), mode) };
        if rc != 0 {
            let e = io::Error::last_os_error();
            // EEXIST: made concurrently (or a dangling symlink, which the
            // next open refuses).
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(e);
            }
        }
    }
    Err(io::Error::other("directory keeps disappearing"))
}

fn mode_of(fd: &OwnedFd) -> io::Result<libc::mode_t> {
    // SAFETY: stat is plain data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid fd (O_PATH works with fstat) and a stat buffer.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.st_mode & 0o7777)
}

/// The error for a walk that stopped at `part`.
pub(super) fn sub_path_error(
    volume: Label<'_>,
    sub_path: &str,
    part: &str,
    e: io::Error,
) -> VolumeStoreError {
    let reason = match e.raw_os_error() {
        Some(libc::ELOOP) => format!("{part:?} is a symlink (symlinks are never followed)"),
        Some(libc::ENOTDIR) => format!("{part:?} is not a directory"),
        Some(libc::EXDEV) => format!("{part:?} crosses a mount point"),
        _ => {
            return super::error::io(
                format!("open subPath {sub_path:?} of volume {:?}", volume.as_str()),
                e,
            );
        }
    };
    VolumeStoreError::InvalidSubPath {
        volume: volume.as_str().into(),
        sub_path: sub_path.into(),
        reason,
    }
}
