//! The plain-directory backend: works on any filesystem, but snapshots,
//! forks and restores copy every byte (`cp -a --reflink=auto`: shared
//! extents where the filesystem can, a full copy where it cannot) and sizes
//! are not enforced. Its capabilities say so.

use std::path::Path;

use super::VolumeStoreError;
use super::error::io;

pub(super) fn create(path: &Path) -> Result<(), VolumeStoreError> {
    std::fs::create_dir(path).map_err(|e| io(format!("create {path:?}"), e))
}

/// Copies the directory `src` to `dst` (which must not exist), keeping
/// modes, owners, times, links and symlinks as they are (never followed).
pub(super) fn copy(
    lock: std::os::fd::RawFd,
    src: &Path,
    dst: &Path,
) -> Result<(), VolumeStoreError> {
    let out = super::root::tool("cp", lock)
        .arg("-a")
        .arg("--reflink=auto")
        .arg("--no-target-directory")
        .arg(src)
        .arg(dst)
        .output()
        .map_err(|e| io("run cp".into(), e))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    let command = format!("cp -a --reflink=auto {} {}", src.display(), dst.display());
    if stderr.contains("No space left on device") {
        return Err(VolumeStoreError::NoSpace { what: command });
    }
    Err(VolumeStoreError::Command {
        command,
        status: out.status.to_string(),
        stderr,
    })
}

/// Removes `path` and everything below it (symlinks are removed, not
/// followed). A missing path is not an error.
pub(super) fn remove_tree(path: &Path) -> Result<(), VolumeStoreError> {
    let result = match std::fs::symlink_metadata(path) {
        Ok(md) if md.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) => Err(e),
    };
    match result {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(io(format!("remove {path:?}"), e))
        }
        _ => Ok(()),
    }
}

/// When the copy at `path` was made: its birth time (the top directory of
/// a copy is new; `cp -a` keeps only its mtime), or its ctime where the
/// filesystem keeps no birth time.
pub(super) fn created_at_ms(path: &Path) -> Option<i64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statx is plain data; all-zero is a valid value to overwrite.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and a statx buffer of the right type.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_BTIME | libc::STATX_CTIME,
            &mut stx,
        )
    };
    if rc != 0 {
        return None;
    }
    let t = if stx.stx_mask & libc::STATX_BTIME != 0 {
        stx.stx_btime
    } else {
        stx.stx_ctime
    };
    Some(t.tv_sec * 1000 + i64::from(t.tv_nsec) / 1_000_000)
}
