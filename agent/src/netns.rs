//! Sandbox network namespaces held open by handle, and talking to a server
//! inside one (execd's `/ping` and claim) over a socket created in it by
//! [`crate::proxy::dial_in_sandbox`].
//!
//! A sandbox is dialled through a [`NetnsHandle`]: a file descriptor of its
//! network namespace, opened once when its task is created (or when a
//! restarted agent recovers it) and dropped when it exits or is deleted.
//! A PID is never used to find a namespace at dial time: once the task has
//! exited and been reaped, its PID can be handed to any other process on
//! the node, and `/proc/<pid>/ns/net` would then lead into *that* process's
//! namespace (another tenant's sandbox, or the host). An open namespace fd
//! keeps naming the namespace it was opened on, whatever happens to PIDs.
//!
//! Where the handle comes from:
//! - with sandbox networking, the namespace file the agent bind-mounted
//!   under `<state>/network/netns/` (no PID involved at all);
//! - without, `/proc/<pid>/ns/net` of the task's init process, opened
//!   together with a pidfd: the pidfd pins which process the PID named
//!   when it was opened, the cgroup check proves that process is the
//!   sandbox's, and the pidfd still showing the process alive after the
//!   opens proves the PID was not reused in between.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An open network namespace. Holding it keeps the namespace alive (not
/// the processes in it): drop it when the sandbox exits or goes.
pub struct NetnsHandle {
    fd: OwnedFd,
    /// The namespace's identity (`nsfs` device and inode), for logs and
    /// for refusing the agent's own namespace.
    dev: u64,
    ino: u64,
}

impl std::fmt::Debug for NetnsHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NetnsHandle(net:[{}])", self.ino)
    }
}

impl NetnsHandle {
    /// Opens the namespace a bind-mounted namespace file (or any
    /// `/proc/.../ns/net` path) names.
    pub fn open(path: &Path) -> io::Result<NetnsHandle> {
        let file = File::open(path).map_err(|e| annotate(e, &path.display().to_string()))?;
        NetnsHandle::from_file(file)
    }

    /// The sandbox's namespace: the bind-mounted file `netns_path` when it
    /// has networking, else that of its task's init process `pid`, which
    /// must be in the sandbox's cgroup (see [`Self::of_task`]).
    pub fn for_sandbox(
        sandbox_id: &str,
        pid: u32,
        netns_path: Option<&Path>,
    ) -> io::Result<NetnsHandle> {
        match netns_path {
            Some(path) => NetnsHandle::open(path),
            None => NetnsHandle::of_task(pid, sandbox_id),
        }
    }

    /// The namespace of process `pid`, which must belong to sandbox
    /// `sandbox_id`: its cgroup's last path component is the sandbox id
    /// (runc puts a sandbox's processes in `<parent>/<sandbox id>`). A
    /// PID that meanwhile names another process fails the check.
    pub fn of_task(pid: u32, sandbox_id: &str) -> io::Result<NetnsHandle> {
        NetnsHandle::of_process_checked(pid, |pid| check_task_cgroup(pid, sandbox_id))
    }

    /// The namespace of whatever process `pid` is now, made safe against
    /// the PID being reused *while* it is opened (not against having the
    /// wrong PID to begin with: [`Self::of_task`] checks that too).
    pub fn of_process(pid: u32) -> io::Result<NetnsHandle> {
        NetnsHandle::of_process_checked(pid, |_| Ok(()))
    }

    fn of_process_checked(
        pid: u32,
        check: impl FnOnce(u32) -> io::Result<()>,
    ) -> io::Result<NetnsHandle> {
        let file = open_of_process(pid, check, |pid| {
            let ns_path = format!("/proc/{pid}/ns/net");
            File::open(&ns_path).map_err(|e| annotate(e, &ns_path))
        })?;
        NetnsHandle::from_file(file)
    }

    /// The namespace an open namespace file names (checked to be a
    /// network namespace other than the caller's).
    pub fn from_file(file: File) -> io::Result<NetnsHandle> {
        let fd = OwnedFd::from(file);
        // SAFETY: NS_GET_NSTYPE takes no argument; `fd` is open.
        let kind = unsafe { libc::ioctl(fd.as_raw_fd(), libc::NS_GET_NSTYPE) };
        if kind < 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("not a namespace file: {}", io::Error::last_os_error()),
            ));
        }
        if kind != libc::CLONE_NEWNET {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a network namespace",
            ));
        }
        let meta = File::from(fd.try_clone()?).metadata()?;
        let handle = NetnsHandle {
            fd,
            dev: meta.dev(),
            ino: meta.ino(),
        };
        handle.refuse_if_current()?;
        Ok(handle)
    }

    /// The namespace's inode number (as in `net:[<ino>]`).
    pub fn inode(&self) -> u64 {
        self.ino
    }

    /// Moves the calling thread into the namespace, for good: call it only
    /// on a thread of its own that exits afterwards, never on a runtime
    /// worker. Refuses the namespace the thread is already in (the
    /// agent's own): dialling there would reach the node's loopback.
    pub fn enter(&self) -> io::Result<()> {
        self.refuse_if_current()?;
        nix::sched::setns(&self.fd, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| io::Error::from_raw_os_error(e as i32))
    }

    fn refuse_if_current(&self) -> io::Result<()> {
        let ours = std::fs::metadata("/proc/thread-self/ns/net")?;
        if (ours.dev(), ours.ino()) == (self.dev, self.ino) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "the namespace is the agent's own network namespace; refusing to dial",
            ));
        }
        Ok(())
    }
}

impl AsFd for NetnsHandle {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Opens what `open` opens under `/proc/<pid>` (namespace files, the root)
/// safely against PID reuse: `pid` is pinned by a pidfd first, `check` runs
/// on it, and if that process has not exited after `open`, `pid` named it
/// all along, so what `check` read and `open` opened were its. The live
/// volume mounts enter a sandbox's mount namespace this way too.
pub fn open_of_process<T>(
    pid: u32,
    check: impl FnOnce(u32) -> io::Result<()>,
    open: impl FnOnce(u32) -> io::Result<T>,
) -> io::Result<T> {
    let pidfd = pidfd_open(pid)?;
    check(pid)?;
    let opened = open(pid)?;
    if exited(pidfd.as_fd())? {
        return Err(gone(pid));
    }
    Ok(opened)
}

/// Refuses `pid` unless it is in the cgroup of sandbox `sandbox_id` (runc
/// puts a sandbox's processes in `<parent>/<sandbox id>`): a PID that has
/// meanwhile been given to another process fails here.
pub fn check_task_cgroup(pid: u32, sandbox_id: &str) -> io::Result<()> {
    let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map_err(|e| annotate(e, &format!("/proc/{pid}/cgroup")))?;
    if in_cgroup_of(&cgroups, sandbox_id) {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "process {pid} is not in the cgroup of sandbox {sandbox_id} ({}); refusing its namespace",
                cgroups.trim()
            ),
        ))
    }
}

/// Whether one of the `/proc/<pid>/cgroup` lines puts the process in a
/// cgroup whose last path component is `sandbox_id`.
fn in_cgroup_of(cgroups: &str, sandbox_id: &str) -> bool {
    cgroups.lines().any(|line| {
        // `<hierarchy>:<controllers>:<path>`; the path may hold colons.
        let path = line.splitn(3, ':').nth(2).unwrap_or("");
        path.rsplit('/').next() == Some(sandbox_id)
    })
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let raw = libc::pid_t::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| gone(pid))?;
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new fd.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, 0) };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return Err(if e.raw_os_error() == Some(libc::ESRCH) {
            gone(pid)
        } else {
            io::Error::new(e.kind(), format!("pidfd_open({pid}): {e}"))
        });
    }
    // SAFETY: the kernel just returned this fd; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Whether the process behind `pidfd` has exited (a pidfd polls readable
/// from then on, zombie or reaped).
fn exited(pidfd: BorrowedFd<'_>) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n > 0)
}

fn gone(pid: u32) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("sandbox process {pid} no longer exists"),
    )
}

fn annotate(e: io::Error, path: &str) -> io::Error {
    io::Error::new(e.kind(), format!("opening {path}: {e}"))
}

/// `GET <path>` over a fresh connection to the sandbox (in its namespace,
/// or at its address: see [`crate::proxy::Upstream`]); returns the status
/// code.
pub async fn http_get_status(
    upstream: &crate::proxy::Upstream,
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> io::Result<u16> {
    let fut = async {
        let mut s = crate::proxy::dial(upstream, port).await?;
        let host = upstream.host(port);
        let mut req = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).await?;
        let mut buf = Vec::with_capacity(256);
        let mut chunk = [0u8; 256];
        // The status line is all that is needed.
        while !buf.contains(&b'\n') {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let line = String::from_utf8_lossy(&buf);
        line.split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad HTTP response {line:?}"),
                )
            })
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "HTTP GET timed out"))?
}

/// `POST <path>` with a JSON body over a fresh connection to the sandbox;
/// returns the status code and the response body (execd's
/// `/sandbolt/claim`). The connection is closed by the server after one
/// answer, so the body is everything after the headers.
pub async fn http_post_json(
    upstream: &crate::proxy::Upstream,
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> io::Result<(u16, Vec<u8>)> {
    let fut = async {
        let mut s = crate::proxy::dial(upstream, port).await?;
        let mut req = format!(
            "POST {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            upstream.host(port),
            body.len()
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).await?;
        s.write_all(body).await?;
        let mut buf = Vec::with_capacity(512);
        s.read_to_end(&mut buf).await?;
        parse_response(&buf)
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "HTTP POST timed out"))?
}

/// Status code and body of a whole HTTP/1.1 response (plain or chunked).
fn parse_response(buf: &[u8]) -> io::Result<(u16, Vec<u8>)> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("HTTP response without the end of its headers"))?;
    let head = String::from_utf8_lossy(&buf[..end]);
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad(&format!("bad HTTP status line in {head:?}")))?;
    let body = &buf[end + 4..];
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    Ok((
        code,
        if chunked {
            dechunk(body)
        } else {
            body.to_vec()
        },
    ))
}

/// The payload of a chunked body (best effort: a malformed one ends early).
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = body.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&body[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok());
        let Some(size) = size.filter(|n| *n > 0) else {
            break;
        };
        let start = eol + 2;
        let Some(chunk) = body.get(start..start + size) else {
            break;
        };
        out.extend_from_slice(chunk);
        body = body.get(start + size + 2..).unwrap_or_default();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_parsed_plain_and_chunked() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{\"pid\":7}";
        assert_eq!(
            parse_response(plain).unwrap(),
            (200, b"{\"pid\":7}".to_vec())
        );
        let chunked = b"HTTP/1.1 409 Conflict\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n2\r\nef\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked).unwrap(), (409, b"abcdef".to_vec()));
        assert!(parse_response(b"garbage").is_err());
    }

    #[test]
    fn cgroup_lines_name_the_sandbox() {
        assert!(in_cgroup_of("0::/sandbolt/sb-1\n", "sb-1"));
        // An agent in a pod's own cgroup namespace sees a relative path.
        assert!(in_cgroup_of("0::/../../sandbolt/sb-1\n", "sb-1"));
        assert!(in_cgroup_of("12:pids:/sandbolt/sb-1\n0::/x\n", "sb-1"));
        assert!(!in_cgroup_of("0::/sandbolt/sb-10\n", "sb-1"));
        assert!(!in_cgroup_of("0::/sandbolt/sb-1/child\n", "sb-1"));
        assert!(!in_cgroup_of("0::/user.slice\n", "sb-1"));
        assert!(!in_cgroup_of("", "sb-1"));
    }

    #[test]
    fn handles_refuse_the_agents_own_namespace_and_dead_pids() {
        let err = NetnsHandle::of_process(std::process::id()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
        let err = NetnsHandle::open(Path::new("/proc/self/ns/net")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
        for pid in [0, u32::MAX - 1] {
            let err = NetnsHandle::of_process(pid).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::NotFound, "{pid}: {err}");
        }
        // A reaped child's pid.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let err = NetnsHandle::of_process(pid).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound, "{err}");
        // A process outside the sandbox's cgroup is not the sandbox's.
        let err = NetnsHandle::of_task(1, "sb-not-there").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
        // Another kind of namespace file.
        let err = NetnsHandle::open(Path::new("/proc/self/ns/uts")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
    }
}
