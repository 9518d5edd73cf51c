//! The agent's one openat2(2) call. Every mount source (host path, named
//! volume) and every mount target inside a running sandbox is opened
//! through it, as an O_PATH directory below a directory descriptor, so the
//! kernel — not a string check — decides where a path leads. Callers pick
//! the RESOLVE_* flags for their case.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `openat2(dir, path, O_PATH|O_DIRECTORY|O_CLOEXEC, resolve)`. A
/// non-directory target fails with ENOTDIR; retried on EAGAIN (a concurrent
/// rename raced the lookup, the kernel asks for a retry) and EINTR.
pub(crate) fn open_dir(dir: &OwnedFd, path: &Path, resolve: u64) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: open_how is plain integers; all-zero is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    // No O_NOFOLLOW: with O_PATH it would open a trailing symlink itself;
    // RESOLVE_NO_SYMLINKS refuses one (ELOOP) where the caller asks.
    how.flags = (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64;
    how.resolve = resolve;
    loop {
        // SAFETY: valid dirfd, NUL-terminated path, open_how of the size passed.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                dir.as_raw_fd(),
                c.as_ptr(),
                &how as *const libc::open_how,
                size_of::<libc::open_how>(),
            )
        };
        if ret >= 0 {
            // SAFETY: the kernel returned a new descriptor that we now own.
            return Ok(unsafe { OwnedFd::from_raw_fd(ret as i32) });
        }
        let err = io::Error::last_os_error();
        if !matches!(err.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EINTR)) {
            return Err(err);
        }
    }
}
