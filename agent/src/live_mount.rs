//! Mounting a held directory into a sandbox's mount namespace, and taking
//! it out again: at create (between `tasks.Create` and `tasks.Start`) and
//! into a running sandbox.
//!
//! # How
//!
//! 1. In the agent: `open_tree(fd, OPEN_TREE_CLONE | AT_RECURSIVE)` makes a
//!    detached copy of the mount tree *of the open directory* (never a path
//!    looked up again, see [`crate::volumes`]), then `mount_setattr` makes it
//!    nosuid, nodev, private and, when asked, read-only, all recursively
//!    (so a filesystem mounted below a read-only source is read-only too).
//! 2. On a fresh OS thread (namespaces are per thread; the thread ends
//!    afterwards, so no other work ever runs in the sandbox's namespace):
//!    `unshare(CLONE_FS)`, `setns` into `/proc/<task pid>/ns/mnt`, `chroot`
//!    into the task's root. The target is opened with
//!    `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`: symlinks the
//!    sandbox planted are followed *inside its root only* (`/` in a symlink
//!    means the sandbox's `/`). Missing components are created one at a
//!    time with `mkdirat` and opened with `RESOLVE_NO_SYMLINKS`, so a symlink
//!    swapped in meanwhile fails the walk rather than redirecting it.
//! 3. The path the target really has (read back from the kernel) must pass
//!    the same rules as the requested one ([`volumes::check_mount_path`]):
//!    a symlink cannot make the mount cover `/`, `/proc`, `/sys`, `/dev` or
//!    execd. Then `move_mount` puts the tree onto that very directory.
//!
//! Detach resolves the path the same way, requires a mount root there, and
//! unmounts exactly it (`fchdir` + `umount2(".", MNT_DETACH)`).
//!
//! A detached tree is private, so nothing mounted in the sandbox reaches the
//! host, and nothing the host mounts later under the source appears inside.
//!
//! Every function here blocks (it joins the thread); async callers use
//! `spawn_blocking` or [`attach_held`].

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use crate::volumes::{self, HeldMount, VolumeError};

// From <linux/mount.h>; not every libc build exports them.
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const MOVE_MOUNT_T_EMPTY_PATH: libc::c_uint = 0x40;
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
/// `struct mount_attr` (MOUNT_ATTR_SIZE_VER0).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// Why a mount into (or out of) a sandbox failed.
#[derive(Debug, thiserror::Error)]
pub enum LiveMountError {
    /// The requested mount path breaks the rules (see [`volumes`]).
    #[error(transparent)]
    MountPath(#[from] VolumeError),
    /// The path resolves, inside the sandbox, to a place a mount may not go
    /// (a symlink in the sandbox's filesystem led there).
    #[error("mount path {requested:?} resolves to {resolved:?} inside the sandbox: {reason}")]
    Redirected {
        requested: String,
        resolved: String,
        #[source]
        reason: VolumeError,
    },
    /// A symlink in the sandbox's filesystem stood where a directory was
    /// being made (planted or swapped in during the walk).
    #[error("mount path {path:?}: a symlink in the sandbox's filesystem is in the way")]
    SymlinkInTheWay { path: String },
    #[error("mount path {path:?} exists in the sandbox and is not a directory")]
    NotADirectory { path: String },
    #[error("nothing is mounted at {path:?} in the sandbox")]
    NotMounted { path: String },
    #[error("the sandbox's task (pid {pid}) is gone")]
    TaskGone { pid: u32 },
    /// The pid shares the agent's mount namespace: not a sandbox's task
    /// (a pid reused after the task ended, or a wrong pid). Mounting there
    /// would mount on the host.
    #[error(
        "pid {pid} is not the sandbox's task (not in its cgroup, or in the agent's mount namespace)"
    )]
    NotASandbox { pid: u32 },
    #[error("{what} for {path:?}: {source}")]
    Sys {
        what: &'static str,
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("the mount thread panicked")]
    ThreadPanicked,
}

impl LiveMountError {
    /// Whether the request (its path, the sandbox's own symlinks) is at
    /// fault rather than the node.
    pub fn is_invalid_argument(&self) -> bool {
        matches!(
            self,
            Self::MountPath(_)
                | Self::Redirected { .. }
                | Self::NotADirectory { .. }
                | Self::SymlinkInTheWay { .. }
        )
    }
}

impl From<LiveMountError> for crate::AgentError {
    fn from(e: LiveMountError) -> Self {
        match e {
            // Both mean the task is no longer there to mount into.
            LiveMountError::TaskGone { pid } | LiveMountError::NotASandbox { pid } => {
                crate::AgentError::WrongPhase {
                    id: format!("task {pid}"),
                    phase: "gone",
                    action: "mount a volume",
                }
            }
            LiveMountError::NotMounted { .. } => crate::AgentError::Volume(e.to_string()),
            e if e.is_invalid_argument() => crate::AgentError::Volume(e.to_string()),
            e => crate::AgentError::io("volume mount")(io::Error::other(e.to_string())),
        }
    }
}

type Result<T, E = LiveMountError> = std::result::Result<T, E>;

/// Mounts the directory `source` at `mount_path` in the mount namespace of
/// the sandbox whose task is `task_pid` (read-only: recursively).
pub fn attach(
    task_pid: u32,
    sandbox_id: &str,
    source: &OwnedFd,
    mount_path: &str,
    read_only: bool,
) -> Result<()> {
    volumes::check_mount_path(mount_path)?;
    let tree = clone_tree(source, read_only, mount_path)?;
    in_sandbox(task_pid, sandbox_id, |ctx| ctx.move_onto(&tree, mount_path))
}

/// [`attach`] for every held mount, in order, entering the sandbox once
/// (at create, between `tasks.Create` and `tasks.Start`). If one fails, the
/// ones before it stay mounted: the caller tears the sandbox down.
pub fn attach_all(task_pid: u32, sandbox_id: &str, mounts: &[HeldMount]) -> Result<()> {
    if mounts.is_empty() {
        return Ok(());
    }
    // Clones are made in the agent's namespace: open_tree refuses a source
    // in another mount namespace than the caller's.
    let trees = mounts
        .iter()
        .map(|m| {
            volumes::check_mount_path(&m.destination)?;
            clone_tree(m.fd(), m.read_only, &m.destination)
        })
        .collect::<Result<Vec<_>>>()?;
    in_sandbox(task_pid, sandbox_id, |ctx| {
        for (tree, m) in trees.iter().zip(mounts) {
            ctx.move_onto(tree, &m.destination)?;
        }
        Ok(())
    })
}

/// [`attach_all`] off the async runtime; consumes (and so closes) the held
/// descriptors once the mounts are in.
pub async fn attach_held(task_pid: u32, sandbox_id: &str, mounts: Vec<HeldMount>) -> Result<()> {
    if mounts.is_empty() {
        return Ok(());
    }
    let sandbox_id = sandbox_id.to_string();
    tokio::task::spawn_blocking(move || attach_all(task_pid, &sandbox_id, &mounts))
        .await
        .map_err(|_| LiveMountError::ThreadPanicked)?
}

/// Unmounts (lazily, `MNT_DETACH`) what is mounted at `mount_path` in the
/// sandbox whose task is `task_pid`. Processes inside that still use files
/// there keep them until they close them.
pub fn detach(task_pid: u32, sandbox_id: &str, mount_path: &str) -> Result<()> {
    volumes::check_mount_path(mount_path)?;
    in_sandbox(task_pid, sandbox_id, |ctx| ctx.unmount(mount_path))
}

/// A detached, recursive copy of the mount tree at `source`, nosuid, nodev
/// and private (read-only too when asked).
fn clone_tree(source: &OwnedFd, read_only: bool, mount_path: &str) -> Result<OwnedFd> {
    let sys = |what| {
        move |source| LiveMountError::Sys {
            what,
            path: mount_path.to_string(),
            source,
        }
    };
    let flags = OPEN_TREE_CLONE
        | libc::O_CLOEXEC as libc::c_uint
        | libc::AT_EMPTY_PATH as libc::c_uint
        | libc::AT_RECURSIVE as libc::c_uint;
    // SAFETY: valid fd, NUL-terminated empty path, plain flags.
    let ret =
        unsafe { libc::syscall(libc::SYS_open_tree, source.as_raw_fd(), c"".as_ptr(), flags) };
    let tree = owned(ret).map_err(sys("open_tree"))?;
    let mut attr = MountAttr {
        attr_set: MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: libc::MS_PRIVATE,
        userns_fd: 0,
    };
    if read_only {
        attr.attr_set |= MOUNT_ATTR_RDONLY;
    }
    // SAFETY: valid fd, empty path with AT_EMPTY_PATH, attr of the size passed.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            (libc::AT_EMPTY_PATH | libc::AT_RECURSIVE) as libc::c_uint,
            &attr as *const MountAttr,
            size_of::<MountAttr>(),
        )
    };
    if ret < 0 {
        return Err(sys("mount_setattr")(io::Error::last_os_error()));
    }
    Ok(tree)
}

/// A syscall's returned descriptor, owned.
fn owned(ret: libc::c_long) -> io::Result<OwnedFd> {
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(ret as RawFd) })
}

/// What a function running inside the sandbox's mount namespace gets.
struct Inside {
    /// The sandbox's root directory (also this thread's root).
    root: OwnedFd,
    /// The host's /proc, opened before entering: reading
    /// `thread-self/fd/N` through it gives paths relative to our (the
    /// sandbox's) root; the sandbox's own /proc belongs to its PID
    /// namespace, in which this thread does not exist.
    host_proc: OwnedFd,
}

/// Runs `f` on a fresh thread that has entered the mount namespace and
/// root of task `pid` of sandbox `sandbox_id`.
fn in_sandbox<T: Send>(
    pid: u32,
    sandbox_id: &str,
    f: impl FnOnce(&Inside) -> Result<T> + Send,
) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(move || {
            let inside = enter(pid, sandbox_id)?;
            f(&inside)
        })
        .join()
        .map_err(|_| LiveMountError::ThreadPanicked)?
    })
}

/// unshare(CLONE_FS), setns(mnt), chroot: this thread, and only it, now
/// sees the sandbox's mounts and resolves `/` as the sandbox's root.
/// The task is found by pid but pinned by a pidfd and checked to be in the
/// sandbox's cgroup ([`crate::netns::open_of_process`]), so a pid reused by
/// another process is refused instead of receiving the sandbox's volume.
fn enter(pid: u32, sandbox_id: &str) -> Result<Inside> {
    use nix::sched::{CloneFlags, setns, unshare};
    let gone = |e: io::Error| match e.raw_os_error() {
        Some(libc::ENOENT) | Some(libc::ESRCH) => LiveMountError::TaskGone { pid },
        _ => LiveMountError::Sys {
            what: "open the task's namespace",
            path: format!("/proc/{pid}"),
            source: e,
        },
    };
    let sys = |what| {
        move |e: nix::Error| LiveMountError::Sys {
            what,
            path: format!("/proc/{pid}"),
            source: e.into(),
        }
    };
    let (ns, root) = crate::netns::open_of_process(
        pid,
        |pid| crate::netns::check_task_cgroup(pid, sandbox_id),
        |pid| {
            let ns = open_path(&format!("/proc/{pid}/ns/mnt"), libc::O_RDONLY)?;
            let root = open_path(
                &format!("/proc/{pid}/root"),
                libc::O_PATH | libc::O_DIRECTORY,
            )?;
            Ok((ns, root))
        },
    )
    .map_err(|e| match e.kind() {
        io::ErrorKind::PermissionDenied => LiveMountError::NotASandbox { pid },
        io::ErrorKind::NotFound => LiveMountError::TaskGone { pid },
        _ => gone(e),
    })?;
    let own = open_path("/proc/thread-self/ns/mnt", libc::O_RDONLY).map_err(gone)?;
    if same_file(&ns, &own).map_err(gone)? {
        return Err(LiveMountError::NotASandbox { pid });
    }
    let host_proc = open_path("/proc", libc::O_PATH | libc::O_DIRECTORY).map_err(gone)?;
    unshare(CloneFlags::CLONE_FS).map_err(sys("unshare(CLONE_FS)"))?;
    setns(&ns, CloneFlags::CLONE_NEWNS).map_err(sys("setns(mnt)"))?;
    nix::unistd::fchdir(root.as_raw_fd()).map_err(sys("fchdir(root)"))?;
    nix::unistd::chroot(".").map_err(sys("chroot"))?;
    Ok(Inside { root, host_proc })
}

impl Inside {
    /// Opens (creating what is missing) `mount_path`, checks where it really
    /// is, and moves `tree` onto it.
    fn move_onto(&self, tree: &OwnedFd, mount_path: &str) -> Result<()> {
        let target = self.open_or_create(mount_path)?;
        self.check_resolved(&target, mount_path)?;
        // SAFETY: valid fds, empty paths with the EMPTY_PATH flags.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                tree.as_raw_fd(),
                c"".as_ptr(),
                target.as_raw_fd(),
                c"".as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH,
            )
        };
        if ret < 0 {
            return Err(sys("move_mount", mount_path)(io::Error::last_os_error()));
        }
        tracing::debug!(mount_path, "mounted into the sandbox");
        Ok(())
    }

    /// Unmounts the mount whose root is at `mount_path`.
    fn unmount(&self, mount_path: &str) -> Result<()> {
        let target = match self.resolve(mount_path) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                return Err(LiveMountError::NotMounted {
                    path: mount_path.into(),
                });
            }
            r => r.map_err(|e| self.walk_error(mount_path, e))?,
        };
        self.check_resolved(&target, mount_path)?;
        if !is_mount_root(&target).map_err(sys("statx", mount_path))? {
            return Err(LiveMountError::NotMounted {
                path: mount_path.into(),
            });
        }
        // "." is then exactly the mount found above, whatever the sandbox
        // does to the path meanwhile.
        nix::unistd::fchdir(target.as_raw_fd()).map_err(|e| sys("fchdir", mount_path)(e.into()))?;
        nix::mount::umount2(".", nix::mount::MntFlags::MNT_DETACH)
            .map_err(|e| sys("umount2", mount_path)(e.into()))?;
        tracing::debug!(mount_path, "unmounted from the sandbox");
        Ok(())
    }

    /// `mount_path` opened in the sandbox's root (symlinks clamped to it).
    fn resolve(&self, mount_path: &str) -> io::Result<OwnedFd> {
        openat2(
            &self.root,
            rel(mount_path),
            libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS,
        )
    }

    /// Opens `mount_path`, creating missing directories: the longest
    /// existing prefix is resolved in the root, the rest is made one
    /// component at a time without following any symlink.
    fn open_or_create(&self, mount_path: &str) -> Result<OwnedFd> {
        match self.resolve(mount_path) {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            r => return r.map_err(|e| self.walk_error(mount_path, e)),
        }
        let comps: Vec<&str> = rel(mount_path).split('/').collect();
        // Longest existing prefix (at least the root).
        let mut dir = openat2(&self.root, ".", libc::RESOLVE_BENEATH)
            .map_err(|e| self.walk_error(mount_path, e))?;
        let mut made = 0;
        for i in 0..comps.len() {
            match self.resolve(&comps[..=i].join("/")) {
                Ok(fd) => {
                    dir = fd;
                    made = i + 1;
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
                Err(e) => return Err(self.walk_error(mount_path, e)),
            }
        }
        if made < comps.len() {
            // Where the new directories would end up must be allowed before
            // any is made (a symlink to /proc must not get us to mkdir there).
            let parent = self.resolved_path(&dir, mount_path)?;
            let base = parent.trim_end_matches('/');
            let wanted = format!("{base}/{}", comps[made..].join("/"));
            check_path(mount_path, wanted)?;
        }
        for comp in &comps[made..] {
            mkdirat(&dir, comp).map_err(sys("mkdir", mount_path))?;
            dir = openat2(
                &dir,
                comp,
                libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS,
            )
            .map_err(|e| self.walk_error(mount_path, e))?;
        }
        Ok(dir)
    }

    fn walk_error(&self, mount_path: &str, e: io::Error) -> LiveMountError {
        match e.raw_os_error() {
            Some(libc::ENOTDIR) => LiveMountError::NotADirectory {
                path: mount_path.into(),
            },
            Some(libc::ELOOP) | Some(libc::EXDEV) => LiveMountError::SymlinkInTheWay {
                path: mount_path.into(),
            },
            _ => sys("open in the sandbox", mount_path)(e),
        }
    }

    /// The target's real path in the sandbox must obey the mount-path
    /// rules as well: a symlink must not carry the mount onto `/`, `/proc`,
    /// `/dev`, `/sys` or execd.
    fn check_resolved(&self, target: &OwnedFd, mount_path: &str) -> Result<()> {
        check_path(mount_path, self.resolved_path(target, mount_path)?)
    }

    /// The path of an open directory as seen from the sandbox's root.
    fn resolved_path(&self, fd: &OwnedFd, mount_path: &str) -> Result<String> {
        let link = format!("thread-self/fd/{}", fd.as_raw_fd());
        let resolved = nix::fcntl::readlinkat(Some(self.host_proc.as_raw_fd()), link.as_str())
            .map_err(|e| sys("read back the target's path", mount_path)(e.into()))?;
        Ok(resolved.to_string_lossy().into_owned())
    }
}

/// `resolved` (where `requested` really leads) must obey the mount-path
/// rules too.
fn check_path(requested: &str, resolved: String) -> Result<()> {
    volumes::check_mount_path(&resolved).map_err(|reason| LiveMountError::Redirected {
        requested: requested.into(),
        resolved,
        reason,
    })
}

fn sys(what: &'static str, path: &str) -> impl FnOnce(io::Error) -> LiveMountError {
    let path = path.to_string();
    move |source| LiveMountError::Sys { what, path, source }
}

/// Whether two descriptors are the same file (namespaces: the same one).
fn same_file(a: &OwnedFd, b: &OwnedFd) -> io::Result<bool> {
    let sa = nix::sys::stat::fstat(a.as_raw_fd()).map_err(io::Error::from)?;
    let sb = nix::sys::stat::fstat(b.as_raw_fd()).map_err(io::Error::from)?;
    Ok(sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino)
}

/// A checked mount path without its leading `/`.
fn rel(mount_path: &str) -> &str {
    mount_path.trim_start_matches('/')
}

fn open_path(path: &str, flags: libc::c_int) -> io::Result<OwnedFd> {
    let c = CString::new(path).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: NUL-terminated path; the fd is owned below.
    let fd = unsafe { libc::open(c.as_ptr(), flags | libc::O_CLOEXEC) };
    owned(fd as libc::c_long)
}

/// mkdir that accepts an existing entry (the open after it decides whether
/// that entry is a usable directory).
fn mkdirat(dir: &OwnedFd, name: &str) -> io::Result<()> {
    match nix::sys::stat::mkdirat(
        Some(dir.as_raw_fd()),
        name,
        nix::sys::stat::Mode::from_bits_truncate(0o755),
    ) {
        Ok(()) | Err(nix::Error::EEXIST) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Whether `fd` is the root of a mount (statx STATX_ATTR_MOUNT_ROOT).
fn is_mount_root(fd: &OwnedFd) -> io::Result<bool> {
    // SAFETY: statx is plain data; zeroed is a valid initial value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd, empty path with AT_EMPTY_PATH, a statx buffer.
    let ret = unsafe {
        libc::statx(
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_BASIC_STATS,
            &mut stx,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    if stx.stx_attributes_mask & libc::STATX_ATTR_MOUNT_ROOT as u64 == 0 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the kernel does not report STATX_ATTR_MOUNT_ROOT",
        ));
    }
    Ok(stx.stx_attributes & libc::STATX_ATTR_MOUNT_ROOT as u64 != 0)
}

fn openat2(dir: &OwnedFd, path: &str, resolve: u64) -> io::Result<OwnedFd> {
    crate::openat2::open_dir(dir, std::path::Path::new(path), resolve)
}
