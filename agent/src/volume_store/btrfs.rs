//! The btrfs backend: a subvolume per volume, a read-only snapshot per
//! snapshot, a writable snapshot per fork or restore, a qgroup limit per
//! size.
//!
//! The operations on the request path (create, snapshot, delete a
//! subvolume, set its limit, read its creation time) are ioctls on
//! descriptors: through the `btrfs` CLI each would cost a process (3–4 ms
//! on a busy 2-core node), which alone would break the 20 ms goal for
//! snapshots and forks. Setup (quota enable, the filesystem's id) runs the
//! CLI once at open.
//!
//! A snapshot inherits its source's qgroup limit (the kernel copies it,
//! overriding any limit asked for at creation), so a writable snapshot
//! gets its own limit set (or cleared) right after, while it is still in
//! staging: nothing is published before its limit is right.

use std::ffi::{CString, OsStr};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::VolumeStoreError;
use super::error::io;

/// Inode number of every subvolume's root directory
/// (BTRFS_FIRST_FREE_OBJECTID).
const SUBVOLUME_ROOT_INO: u64 = 256;

// From linux/btrfs.h and btrfs_tree.h (checked against this host's headers).
const IOC_SNAP_DESTROY: libc::c_ulong = 0x5000_940f;
const IOC_SNAP_CREATE_V2: libc::c_ulong = 0x5000_9417;
const IOC_SUBVOL_CREATE_V2: libc::c_ulong = 0x5000_9418;
const IOC_TREE_SEARCH: libc::c_ulong = 0xd000_9411;
const IOC_QGROUP_LIMIT: libc::c_ulong = 0x8030_942b;
const SUBVOL_RDONLY: u64 = 1 << 1;
const QGROUP_LIMIT_MAX_RFER: u64 = 1;
/// A limit of this value clears the limit.
const QGROUP_LIMIT_CLEAR: u64 = u64::MAX;
/// `struct btrfs_ioctl_vol_args{,_v2}` and `btrfs_ioctl_search_args` are
/// 4096 bytes; the v2 name starts at 56, the v1 name at 8.
const ARGS_WORDS: usize = 512;
const V2_NAME_OFFSET: usize = 56;
/// The root tree, and the key type of a subvolume's root item in it.
const ROOT_TREE_OBJECTID: u64 = 1;
const ROOT_ITEM_KEY: u64 = 132;
/// Search results start after the 104-byte key; each has a 32-byte header
/// (its item's length at 28). A root item's otime (u64 seconds, u32
/// nanoseconds, packed) is at 339.
const SEARCH_BUF_OFFSET: usize = 104;
const SEARCH_HEADER_BYTES: usize = 32;
const ROOT_ITEM_OTIME: usize = 339;

#[derive(Debug)]
pub(super) struct Btrfs {
    /// `/sys/fs/btrfs/<fsid>/qgroups` when quotas are on.
    qgroups: Option<PathBuf>,
}

impl Btrfs {
    /// The backend on a btrfs `root`: quotas enabled (a no-op when they
    /// are). Quotas that cannot be enabled leave the backend without quota,
    /// and its capabilities say so.
    pub fn on(root: &Path, lock: RawFd) -> Self {
        let qgroups = match enable_quota(lock, root) {
            Ok(dir) => Some(dir),
            Err(e) => {
                tracing::warn!(root = %root.display(), error = %e, "btrfs quotas unavailable: volumes get no size limit");
                None
            }
        };
        Self { qgroups }
    }

    pub fn quota(&self) -> bool {
        self.qgroups.is_some()
    }

    /// A new empty subvolume at `path`, limited to `limit` bytes (0: none).
    pub fn create(&self, path: &Path, limit: u64) -> io::Result<()> {
        let (parent, name) = parent_and_name(path)?;
        let mut args = [0u64; ARGS_WORDS];
        put_name(&mut args, V2_NAME_OFFSET, &name)?;
        // SAFETY: a 4096-byte btrfs_ioctl_vol_args_v2 with a NUL-terminated name.
        ioctl(&parent, IOC_SUBVOL_CREATE_V2, args.as_mut_ptr().cast())?;
        if limit > 0 {
            self.set_limit(path, limit)?;
        }
        Ok(())
    }

    /// A snapshot of the subvolume `src` at `dst`. The kernel commits the
    /// transaction before returning: the snapshot, and everything written
    /// to the filesystem's metadata before it, is on disk. A writable one
    /// is limited to `limit` bytes (0: none) instead of its source's limit.
    pub fn snapshot(&self, src: &Path, dst: &Path, read_only: bool, limit: u64) -> io::Result<()> {
        let source = open_dir(src)?;
        let (parent, name) = parent_and_name(dst)?;
        let mut args = [0u64; ARGS_WORDS];
        args[0] = source.as_raw_fd() as u64;
        args[2] = if read_only { SUBVOL_RDONLY } else { 0 };
        put_name(&mut args, V2_NAME_OFFSET, &name)?;
        // SAFETY: a 4096-byte btrfs_ioctl_vol_args_v2 with a NUL-terminated name.
        ioctl(&parent, IOC_SNAP_CREATE_V2, args.as_mut_ptr().cast())?;
        if !read_only {
            self.set_limit(dst, limit)?;
        }
        Ok(())
    }

    /// Sets (or, for 0, clears) the referenced-bytes limit of the
    /// subvolume at `path`. Nothing to do without quotas.
    fn set_limit(&self, path: &Path, limit: u64) -> io::Result<()> {
        if !self.quota() {
            return Ok(());
        }
        let fd = open_dir(path)?;
        // struct btrfs_ioctl_qgroup_limit_args: qgroupid (0: the fd's
        // subvolume), then lim {flags, max_rfer, max_excl, rsv_rfer, rsv_excl}.
        let max = if limit == 0 {
            QGROUP_LIMIT_CLEAR
        } else {
            limit
        };
        let mut args: [u64; 6] = [0, QGROUP_LIMIT_MAX_RFER, max, 0, 0, 0];
        // SAFETY: a 48-byte btrfs_ioctl_qgroup_limit_args.
        ioctl(&fd, IOC_QGROUP_LIMIT, args.as_mut_ptr().cast())
    }

    /// Deletes the subvolume at `path` (the kernel's cleaner frees its
    /// blocks in the background). ENOENT when there is none.
    pub fn destroy(&self, path: &Path) -> io::Result<()> {
        let (parent, name) = parent_and_name(path)?;
        let mut args = [0u64; ARGS_WORDS];
        put_name(&mut args, 8, &name)?;
        // SAFETY: a 4096-byte btrfs_ioctl_vol_args with a NUL-terminated name.
        ioctl(&parent, IOC_SNAP_DESTROY, args.as_mut_ptr().cast())
    }

    /// When the subvolume at `path` was made: its root item's otime (a
    /// snapshot's root directory keeps its source's times), found with a
    /// tree search of the root tree (GET_SUBVOL_INFO answered ENOENT for a
    /// fresh snapshot now and then on this kernel).
    pub fn created_at_ms(&self, path: &Path) -> Option<i64> {
        let id = subvolume_id(path)?;
        let dir = open_dir(path).ok()?;
        let mut args = [0u64; ARGS_WORDS];
        // struct btrfs_ioctl_search_key: tree_id, min/max objectid,
        // min/max offset, min/max transid, min/max type (u32 each),
        // nr_items (u32).
        args[..9].copy_from_slice(&[
            ROOT_TREE_OBJECTID,
            id,
            id,
            0,
            u64::MAX,
            0,
            u64::MAX,
            ROOT_ITEM_KEY | ROOT_ITEM_KEY << 32,
            1,
        ]);
        // SAFETY: a 4096-byte btrfs_ioctl_search_args.
        ioctl(&dir, IOC_TREE_SEARCH, args.as_mut_ptr().cast()).ok()?;
        // SAFETY: [u64; 512] is 4096 initialized bytes.
        let buf: &[u8; 4096] = unsafe { &*args.as_ptr().cast() };
        let u32_at = |o: usize| u32::from_le_bytes(buf[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(buf[o..o + 8].try_into().unwrap());
        let item = SEARCH_BUF_OFFSET + SEARCH_HEADER_BYTES;
        let len = u32_at(SEARCH_BUF_OFFSET + 28) as usize;
        if u32_at(64) == 0 || len < ROOT_ITEM_OTIME + 12 {
            return None;
        }
        let sec = u64_at(item + ROOT_ITEM_OTIME) as i64;
        let nsec = i64::from(u32_at(item + ROOT_ITEM_OTIME + 8));
        Some(sec * 1000 + nsec / 1_000_000)
    }

    /// Bytes the subvolume at `path` references, from its qgroup.
    pub fn used_bytes(&self, path: &Path) -> Option<u64> {
        let qgroups = self.qgroups.as_ref()?;
        let id = subvolume_id(path)?;
        let text = std::fs::read_to_string(qgroups.join(format!("0_{id}/referenced"))).ok()?;
        text.trim().parse().ok()
    }

    /// Removes `path`: subvolumes by deleting them, plain directories by
    /// walking them. A missing path is not an error.
    pub fn remove_tree(&self, path: &Path) -> Result<(), VolumeStoreError> {
        let md = match std::fs::symlink_metadata(path) {
            Ok(md) => md,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io(format!("stat {path:?}"), e)),
        };
        if !md.is_dir() {
            return std::fs::remove_file(path).map_err(|e| io(format!("remove {path:?}"), e));
        }
        if md.ino() == SUBVOLUME_ROOT_INO {
            return self.delete_subvolume(path);
        }
        for name in super::meta::dir_names(path)? {
            self.remove_tree(&path.join(name))?;
        }
        std::fs::remove_dir(path).map_err(|e| io(format!("remove {path:?}"), e))
    }

    /// Deletes a subvolume. One that holds subvolumes (a sandbox may make
    /// them: creating one needs no privilege) cannot be deleted before
    /// them (ENOTEMPTY), so those are found and deleted first.
    fn delete_subvolume(&self, path: &Path) -> Result<(), VolumeStoreError> {
        let context = || format!("delete subvolume {path:?}");
        match self.destroy(path) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() != Some(libc::ENOTEMPTY) => return Err(io(context(), e)),
            Err(_) => {}
        }
        for sub in nested_subvolumes(path)? {
            self.delete_subvolume(&sub)?;
        }
        self.destroy(path).map_err(|e| io(context(), e))
    }
}

fn ioctl(fd: &OwnedFd, request: libc::c_ulong, arg: *mut libc::c_void) -> io::Result<()> {
    loop {
        // SAFETY: callers pass a buffer laid out and sized for `request`.
        // Some btrfs ioctls return a positive value on success.
        if unsafe { libc::ioctl(fd.as_raw_fd(), request, arg) } >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
}

/// Copies `name` (with its NUL) into the byte buffer `args` at `offset`.
fn put_name(args: &mut [u64; ARGS_WORDS], offset: usize, name: &CString) -> io::Result<()> {
    let bytes = name.as_bytes_with_nul();
    // Names are validated labels (<= 63) or op ids; never near the limit.
    if offset + bytes.len() > 4000 {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: a [u64; 512] is 4096 initialized bytes; viewing them as
    // bytes is sound and the range was checked above.
    let buf: &mut [u8; 4096] = unsafe { &mut *args.as_mut_ptr().cast() };
    buf[offset..offset + bytes.len()].copy_from_slice(bytes);
    Ok(())
}

/// The parent directory of `path` (opened) and its last component.
fn parent_and_name(path: &Path) -> io::Result<(OwnedFd, CString)> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    };
    Ok((open_dir(parent)?, CString::new(name.as_bytes())?))
}

/// `open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)`: btrfs
/// ioctls need a real (not O_PATH) descriptor.
fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: a valid NUL-terminated path; the fd is owned below.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Subvolume roots below `path` (not below those): a walk of the whole
/// tree, done only when a plain delete failed.
fn nested_subvolumes(path: &Path) -> Result<Vec<PathBuf>, VolumeStoreError> {
    let mut found = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|e| io(format!("list {dir:?}"), e))?;
        for entry in entries.flatten() {
            let Ok(md) = entry.metadata() else { continue };
            if !md.is_dir() {
                continue;
            }
            if md.ino() == SUBVOLUME_ROOT_INO {
                found.push(entry.path());
            } else {
                stack.push(entry.path());
            }
        }
    }
    Ok(found)
}

/// `btrfs quota enable` unless on; returns the filesystem's qgroups
/// directory in sysfs.
fn enable_quota(lock: RawFd, root: &Path) -> Result<PathBuf, VolumeStoreError> {
    let fsid = filesystem_uuid(lock, root)?;
    let qgroups = PathBuf::from(format!("/sys/fs/btrfs/{fsid}/qgroups"));
    let enabled =
        || std::fs::read_to_string(qgroups.join("enabled")).is_ok_and(|s| s.trim() == "1");
    if !enabled() {
        run(
            lock,
            &["quota".as_ref(), "enable".as_ref(), root.as_os_str()],
        )?;
    }
    if !enabled() {
        return Err(VolumeStoreError::Setup(format!(
            "quotas enabled on {root:?}, but {qgroups:?} does not say so"
        )));
    }
    Ok(qgroups)
}

/// The filesystem UUID (`btrfs filesystem show`'s "uuid: ..."), which
/// names its directory in /sys/fs/btrfs.
fn filesystem_uuid(lock: RawFd, root: &Path) -> Result<String, VolumeStoreError> {
    let out = run(
        lock,
        &["filesystem".as_ref(), "show".as_ref(), root.as_os_str()],
    )?;
    out.split_whitespace()
        .skip_while(|w| *w != "uuid:")
        .nth(1)
        .map(str::to_string)
        .ok_or_else(|| {
            VolumeStoreError::Setup(format!(
                "no uuid in `btrfs filesystem show {}`: {out}",
                root.display()
            ))
        })
}

/// The id of the subvolume `path` lies in (statx STATX_SUBVOL, Linux 6.10+).
fn subvolume_id(path: &Path) -> Option<u64> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statx is plain data; all-zero is a valid value to overwrite.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and a statx buffer of the right type.
    let rc = unsafe {
        libc::statx(
            libc::AT_FDCWD,
            c.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            libc::STATX_SUBVOL,
            &mut stx,
        )
    };
    (rc == 0 && stx.stx_mask & libc::STATX_SUBVOL != 0).then_some(stx.stx_subvol)
}

/// Runs `btrfs <args>`; stdout on success.
fn run(lock: RawFd, args: &[&OsStr]) -> Result<String, VolumeStoreError> {
    let out = super::root::tool("btrfs", lock)
        .args(args)
        .output()
        .map_err(|e| io("run btrfs (btrfs-progs installed?)".into(), e))?;
    if !out.status.success() {
        return Err(VolumeStoreError::Command {
            command: std::iter::once("btrfs".into())
                .chain(args.iter().map(|a| a.to_string_lossy()))
                .collect::<Vec<_>>()
                .join(" "),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
