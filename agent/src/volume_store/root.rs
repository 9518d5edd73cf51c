//! Setting up the volume root, and the backend that works on it.
//!
//! - The root is on btrfs (statfs magic 0x9123683E): use it.
//! - Else, with a loop image size: mount the image at the root, creating it
//!   first if it does not exist (a sparse file, `mkfs.btrfs`), the way
//!   LXD's storage pools do. `mount -o loop` sets LO_FLAGS_AUTOCLEAR, so
//!   unmounting the root also frees the loop device.
//! - Else (or with the directory backend): plain directories.
//!
//! A root that is not btrfs, is not empty and holds no directory-backend
//! volumes is refused rather than mounted over (the mount would hide what
//! is there).

use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Command;

use super::btrfs::Btrfs;
use super::error::io;
use super::juicefs::{JuiceFs, JuiceFsStoreConfig};
use super::{BackendChoice, Capabilities, VolumeStoreConfig, VolumeStoreError, directory};

/// How long open waits for the root's lock: a store killed mid-operation
/// holds it until its `btrfs` or `cp` has died too (milliseconds).
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// btrfs refuses smaller filesystems with its default profile (DUP
/// metadata).
const MIN_LOOP_BYTES: u64 = 256 << 20;

/// The backend on a ready root, holding the root's lock.
#[derive(Debug)]
pub(super) struct Backend {
    kind: Kind,
    /// flock on `<root>/.lock`, held while the backend lives: recovery
    /// deletes staging, so two stores on one root would destroy each
    /// other's work. Children the store runs (`btrfs` at set-up) inherit
    /// it, so a store killed mid-operation keeps the root locked until they
    /// are gone too (see [`tool`]).
    _lock: std::fs::File,
}

#[derive(Debug)]
enum Kind {
    Btrfs(Btrfs),
    Directory,
    JuiceFs(JuiceFs),
}

impl Backend {
    pub fn capabilities(&self) -> Capabilities {
        match &self.kind {
            Kind::Btrfs(b) => Capabilities {
                backend: "btrfs",
                instant_snapshots: true,
                instant_forks: true,
                quota: b.quota(),
                shared: false,
            },
            Kind::Directory => Capabilities {
                backend: "directory",
                instant_snapshots: false,
                instant_forks: false,
                quota: false,
                shared: false,
            },
            Kind::JuiceFs(_) => Capabilities {
                backend: "juicefs",
                instant_snapshots: true,
                instant_forks: true,
                quota: true,
                shared: true,
            },
        }
    }

    /// Whether snapshots are made in place by one atomic, committed ioctl
    /// (btrfs), rather than copied in staging and renamed into place.
    pub fn in_place_snapshots(&self) -> bool {
        matches!(self.kind, Kind::Btrfs(_))
    }

    /// Whether the clone that follows a metadata write commits the
    /// filesystem's transaction (btrfs snapshots do), so the write needs
    /// no fsync of its own, only to be written back.
    pub fn clone_commits(&self) -> bool {
        matches!(self.kind, Kind::Btrfs(_))
    }

    /// An empty data directory (btrfs: a subvolume) at `path`, limited to
    /// `limit` bytes (0: none; callers check [`Capabilities::quota`]).
    pub fn create_data(&self, path: &Path, limit: u64) -> Result<(), VolumeStoreError> {
        match &self.kind {
            Kind::Btrfs(b) => b
                .create(path, limit)
                .map_err(|e| io(format!("create subvolume {path:?}"), e)),
            Kind::Directory => directory::create(path),
            Kind::JuiceFs(j) => j.create(path, limit),
        }
    }

    /// `dst` as a copy of the data at `src` (btrfs: a snapshot, read-only
    /// when asked; directories: a copy, writable either way), limited to
    /// `limit` bytes. Errors keep the errno (EEXIST, ENOENT) for callers.
    pub fn clone_data(
        &self,
        src: &Path,
        dst: &Path,
        read_only: bool,
        limit: u64,
    ) -> Result<(), VolumeStoreError> {
        match &self.kind {
            Kind::Btrfs(b) => b
                .snapshot(src, dst, read_only, limit)
                .map_err(|e| io(format!("snapshot {src:?} at {dst:?}"), e)),
            Kind::Directory => directory::copy(src, dst),
            Kind::JuiceFs(j) => j.clone_tree(src, dst, limit),
        }
    }

    pub fn used_bytes(&self, path: &Path) -> Option<u64> {
        match &self.kind {
            Kind::Btrfs(b) => b.used_bytes(path),
            Kind::Directory | Kind::JuiceFs(_) => None,
        }
    }

    /// When the snapshot at `path` was taken.
    pub fn created_at_ms(&self, path: &Path) -> Option<i64> {
        match &self.kind {
            Kind::Btrfs(b) => b.created_at_ms(path),
            Kind::Directory | Kind::JuiceFs(_) => directory::created_at_ms(path),
        }
    }

    /// Deletes the in-place snapshot at `path` (one ioctl, atomic).
    /// `Ok(false)`: there was none.
    pub fn delete_in_place(&self, path: &Path) -> Result<bool, VolumeStoreError> {
        let Kind::Btrfs(b) = &self.kind else {
            return Err(VolumeStoreError::Setup("no in-place snapshots here".into()));
        };
        match b.destroy(path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io(format!("delete snapshot {path:?}"), e)),
        }
    }

    /// Removes `path` with everything below it, subvolumes included.
    pub fn remove(&self, path: &Path) -> Result<(), VolumeStoreError> {
        match &self.kind {
            Kind::Btrfs(b) => b.remove_tree(path),
            Kind::Directory => directory::remove_tree(path),
            Kind::JuiceFs(j) => j.remove_tree(path),
        }
    }
}

/// A command for one of the store's tools. It dies with the thread that
/// runs it (PR_SET_PDEATHSIG), so a killed agent leaves no `btrfs` or `cp`
/// working on its root, and it holds the root's lock (inherited) for as
/// long as it runs, so a new store cannot recover staging under a dying
/// one's feet.
pub(super) fn tool(program: &str, lock: RawFd) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(program);
    // SAFETY: prctl and fcntl are async-signal-safe and touch only the
    // child's own state (its descriptor table is a copy of ours).
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0
                || libc::fcntl(lock, libc::F_SETFD, 0) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Readies `cfg.root` and picks the backend (see the module docs).
pub(super) fn prepare(cfg: &VolumeStoreConfig) -> Result<Backend, VolumeStoreError> {
    let root = &cfg.root;
    if !root.is_absolute() {
        return Err(VolumeStoreError::Setup(format!(
            "volume root {root:?} must be an absolute path"
        )));
    }
    let btrfs = prepare_root(cfg)?;
    let lock = lock(root)?;
    let kind = if btrfs {
        Kind::Btrfs(Btrfs::on(root, lock.as_raw_fd()))
    } else {
        Kind::Directory
    };
    Ok(Backend { kind, _lock: lock })
}

/// The JuiceFS backend on a mounted filesystem (see
/// [`super::juicefs`]): its lock is this agent's own, on a local file.
pub(super) fn prepare_juicefs(cfg: &JuiceFsStoreConfig) -> Result<Backend, VolumeStoreError> {
    if let Some(dir) = cfg.lock_file.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io(format!("create {dir:?}"), e))?;
    }
    let lock = lock_file(&cfg.lock_file, &cfg.root())?;
    let kind = Kind::JuiceFs(JuiceFs::new(cfg.clone(), lock.as_raw_fd()));
    Ok(Backend { kind, _lock: lock })
}

/// Makes the root ready; `true` when it is btrfs.
fn prepare_root(cfg: &VolumeStoreConfig) -> Result<bool, VolumeStoreError> {
    let root = &cfg.root;
    let mkdir = || std::fs::create_dir_all(root).map_err(|e| io(format!("create {root:?}"), e));
    if cfg.backend == BackendChoice::Directory {
        mkdir()?;
        return Ok(false);
    }
    if on_btrfs(root)? {
        mkdir()?;
        return Ok(true);
    }
    let auto = cfg.backend == BackendChoice::Auto;
    if root.join("volumes").is_dir() {
        if auto {
            tracing::info!(root = %root.display(), "volume root holds directory-backend volumes: keeping the directory backend");
            return Ok(false);
        }
        return Err(VolumeStoreError::Setup(format!(
            "volume root {root:?} is not on btrfs and holds directory-backend volumes; \
             use the directory backend or move them away"
        )));
    }
    if cfg.loop_size_bytes == 0 {
        if auto {
            mkdir()?;
            return Ok(false);
        }
        return Err(VolumeStoreError::Setup(format!(
            "volume root {root:?} is not on btrfs ({}) and no loop image size is configured",
            fs_name(root)
        )));
    }
    refuse_non_empty(root)?;
    let fresh = !cfg.loop_image.exists();
    if let Err(e) = mount_loop_image(cfg) {
        // `auto` on a host that cannot make the image (no btrfs-progs, no
        // free loop device): plain directories work everywhere, so the
        // first `sandbolt up` runs, and says what it gave up. An image that
        // existed before holds volumes: never fall back from it.
        if !(auto && fresh) {
            return Err(e);
        }
        let _ = std::fs::remove_file(&cfg.loop_image);
        tracing::warn!(root = %root.display(), error = %e,
            "no loop-backed btrfs image could be made for named volumes: using plain directories \
             (snapshots and forks copy every byte, no size quotas). Install btrfs-progs for \
             instant snapshots; --volume-backend btrfs makes this an error");
        mkdir()?;
        return Ok(false);
    }
    if !on_btrfs(root)? {
        return Err(VolumeStoreError::Setup(format!(
            "mounted {:?} at {root:?}, but the root is still not btrfs",
            cfg.loop_image
        )));
    }
    Ok(true)
}

/// Whether `path` (or, while it does not exist, its nearest existing
/// ancestor: that is where it would be made) is on btrfs.
fn on_btrfs(path: &Path) -> Result<bool, VolumeStoreError> {
    let existing = path
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    let st = nix::sys::statfs::statfs(existing)
        .map_err(|e| io(format!("statfs {existing:?}"), e.into()))?;
    Ok(st.filesystem_type() == nix::sys::statfs::BTRFS_SUPER_MAGIC)
}

fn fs_name(path: &Path) -> String {
    let existing = path
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or(Path::new("/"));
    match nix::sys::statfs::statfs(existing) {
        Ok(st) => format!("filesystem magic {:#x}", st.filesystem_type().0),
        Err(e) => format!("statfs failed: {e}"),
    }
}

fn refuse_non_empty(root: &Path) -> Result<(), VolumeStoreError> {
    let mut entries = match std::fs::read_dir(root) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            return Err(VolumeStoreError::Setup(format!(
                "volume root {root:?} exists and is not a directory"
            )));
        }
        Err(e) => return Err(io(format!("list {root:?}"), e)),
    };
    if let Some(first) = entries.next() {
        let first = first.map(|e| e.file_name()).unwrap_or_default();
        return Err(VolumeStoreError::Setup(format!(
            "volume root {root:?} exists, is not btrfs and is not empty (it holds {first:?}); \
             refusing to mount a loop image over it"
        )));
    }
    Ok(())
}

/// Mounts the loop image at the root, making the image first when there is
/// none.
fn mount_loop_image(cfg: &VolumeStoreConfig) -> Result<(), VolumeStoreError> {
    let image = &cfg.loop_image;
    if image.exists() {
        if let Some(dev) = loop_device_of(image) {
            // A second loop device over the same image would mount one
            // btrfs twice: refuse.
            return Err(VolumeStoreError::Setup(format!(
                "loop image {image:?} is already attached to {dev} (mounted somewhere else?); \
                 unmount it first"
            )));
        }
        tracing::info!(image = %image.display(), root = %cfg.root.display(), "mounting the existing volume image");
    } else {
        make_image(image, cfg.loop_size_bytes)?;
    }
    std::fs::create_dir_all(&cfg.root).map_err(|e| io(format!("create {:?}", cfg.root), e))?;
    let out = Command::new("mount")
        .args(["-t", "btrfs", "-o", "loop"])
        .arg(image)
        .arg(&cfg.root)
        .output()
        .map_err(|e| io("run mount".into(), e))?;
    if !out.status.success() {
        return Err(VolumeStoreError::Setup(format!(
            "mount -o loop {image:?} {:?}: {}",
            cfg.root,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// A sparse file of `size` bytes with a fresh btrfs, made beside the image
/// and renamed into place: an image that exists is always formatted.
fn make_image(image: &Path, size: u64) -> Result<(), VolumeStoreError> {
    if size < MIN_LOOP_BYTES {
        return Err(VolumeStoreError::Setup(format!(
            "loop image size {size} bytes is too small: btrfs needs at least {MIN_LOOP_BYTES}"
        )));
    }
    if let Some(dir) = image.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io(format!("create {dir:?}"), e))?;
    }
    let mut tmp = image.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    std::fs::File::create_new(&tmp)
        .and_then(|f| f.set_len(size))
        .map_err(|e| io(format!("create {tmp:?}"), e))?;
    let out = Command::new("mkfs.btrfs")
        .args(["-q", "-L", "sandbolt-volumes"])
        .arg(&tmp)
        .output()
        .map_err(|e| io("run mkfs.btrfs (btrfs-progs installed?)".into(), e))?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp);
        return Err(VolumeStoreError::Setup(format!(
            "mkfs.btrfs {tmp:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    std::fs::rename(&tmp, image).map_err(|e| io(format!("rename {tmp:?} to {image:?}"), e))?;
    tracing::info!(image = %image.display(), size, "created the volume image");
    Ok(())
}

/// The loop device backed by `image`, from sysfs.
fn loop_device_of(image: &Path) -> Option<String> {
    let image = std::fs::canonicalize(image).ok()?;
    std::fs::read_dir("/sys/block")
        .ok()?
        .flatten()
        .find_map(|e| {
            let backing = std::fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            (Path::new(backing.trim()) == image)
                .then(|| format!("/dev/{}", e.file_name().to_string_lossy()))
        })
}

/// Takes `<root>/.lock` (flock, exclusive) for the store's lifetime,
/// waiting up to [`LOCK_WAIT`] for the tools of a killed store to die.
fn lock(root: &Path) -> Result<std::fs::File, VolumeStoreError> {
    lock_file(&root.join(".lock"), root)
}

/// Takes the flock on `path` (the lock of the store at `root`).
fn lock_file(path: &Path, root: &Path) -> Result<std::fs::File, VolumeStoreError> {
    let path = path.to_path_buf();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| io(format!("open {path:?}"), e))?;
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(file);
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) || std::time::Instant::now() > deadline {
            return Err(VolumeStoreError::Setup(format!(
                "volume root {root:?} is in use by another volume store ({path:?} is locked: {err})"
            )));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Unmounts the filesystem mounted at `root` (a loop image frees its loop
/// device with it). Drop every [`super::VolumeStore`] on it first: their
/// lock files keep it busy, and a busy root is only detached lazily.
/// `Ok(false)`: nothing was mounted there.
pub fn unmount_root(root: &Path) -> Result<bool, VolumeStoreError> {
    use nix::mount::{MntFlags, umount2};
    // mountinfo octal-escapes space, tab, newline and backslash.
    let escaped = root
        .to_string_lossy()
        .replace('\\', "\\134")
        .replace(' ', "\\040")
        .replace('\t', "\\011")
        .replace('\n', "\\012");
    let mounted = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| io("read /proc/self/mountinfo".into(), e))?
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(escaped.as_str()));
    if !mounted {
        return Ok(false);
    }
    match umount2(root, MntFlags::empty()) {
        Ok(()) => Ok(true),
        Err(nix::errno::Errno::EBUSY) => umount2(root, MntFlags::MNT_DETACH)
            .map(|()| true)
            .map_err(|e| io(format!("unmount {root:?}"), e.into())),
        Err(e) => Err(io(format!("unmount {root:?}"), e.into())),
    }
}
