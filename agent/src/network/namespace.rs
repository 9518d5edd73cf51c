//! Network namespaces kept alive by a bind mount on a file, made in
//! process: no `ip netns` (whose /run/netns would be shared by every agent
//! on the host).

use std::io;
use std::path::Path;

use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;

use super::NetworkError;

/// Creates a fresh network namespace (IPv6 off: sandboxes are IPv4-only,
/// and an IPv6 path would bypass the IPv4 rules) bind-mounted at `path`.
pub fn create(path: &Path) -> Result<(), NetworkError> {
    std::fs::File::create(path).map_err(NetworkError::io(path))?;
    let target = path.to_path_buf();
    // unshare(2) changes the calling thread for good: a thread of its own,
    // never a runtime worker.
    let made = std::thread::spawn(move || -> io::Result<()> {
        nix::sched::unshare(CloneFlags::CLONE_NEWNET)?;
        for conf in ["all", "default"] {
            // /proc/sys/net shows the namespace of the thread that opens it.
            std::fs::write(format!("/proc/sys/net/ipv6/conf/{conf}/disable_ipv6"), "1")?;
        }
        nix::mount::mount(
            Some("/proc/thread-self/ns/net"),
            &target,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )?;
        Ok(())
    })
    .join()
    .unwrap_or_else(|_| Err(io::Error::other("netns thread panicked")));
    made.map_err(|e| {
        let _ = std::fs::remove_file(path);
        NetworkError::io(path)(e)
    })
}

/// Whether `path` is a mounted network namespace (not a plain file left
/// behind).
pub fn is_mounted(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::NSFS_MAGIC)
}

/// Unmounts and unlinks `path`; a namespace no process uses goes away with
/// it (and the veth inside takes its host peer along). Missing is fine.
pub fn remove(path: &Path) -> Result<(), NetworkError> {
    if is_mounted(path) {
        // MNT_DETACH: a sandbox still starting cannot make this fail.
        nix::mount::umount2(path, MntFlags::MNT_DETACH)
            .map_err(|e| NetworkError::io(path)(e.into()))?;
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(NetworkError::io(path)(e)),
        _ => Ok(()),
    }
}
