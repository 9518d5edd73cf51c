//! The plain-directory backend: works on any filesystem, but snapshots,
//! forks and restores copy every byte ([`crate::tree_copy`]: shared extents
//! where the filesystem can, a full copy where it cannot) and sizes
//! are not enforced. Its capabilities say so.

use std::path::Path;

use super::VolumeStoreError;
use super::error::io;

pub(super) fn create(path: &Path) -> Result<(), VolumeStoreError> {
    std::fs::create_dir(path).map_err(|e| io(format!("create {path:?}"), e))
}

/// Copies the directory `src` to `dst` (which must not exist), keeping
/// modes, owners, times, attributes, links and symlinks as they are (never
/// followed), in process ([`crate::tree_copy`]: file data cloned where the
/// filesystem can).
pub(super) fn copy(src: &Path, dst: &Path) -> Result<(), VolumeStoreError> {
    std::fs::create_dir(dst).map_err(|e| io(format!("create {dst:?}"), e))?;
    crate::tree_copy::copy_tree(src, dst)
        .map(drop)
        .map_err(|e| {
            io(
                format!("copy {src:?} to {dst:?}: {} {:?}", e.action, e.path),
                e.source,
            )
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
