//! Child processes: spawning (own process group, uid/gid, env), one central reaper, and
//! the line chunker that turns pipe output into stream events.
//!
//! Exit statuses are collected by one [`Reaper`] instead of per-child `wait`s. As PID 1
//! (or a child subreaper) it reaps *every* child with `waitpid(-1)`, including orphans
//! re-parented to execd, and hands the statuses of the processes it started to their
//! waiters. As a plain process (tests, or execd inside a bigger program) it waits only
//! for the pids it started, so it never steals another component's children.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::sync::oneshot;

/// Collects exit statuses of child processes.
pub struct Reaper {
    reap_all: bool,
    waiters: Mutex<HashMap<i32, oneshot::Sender<ExitStatus>>>,
}

impl Reaper {
    /// Starts the reaper task on the current runtime. `reap_all` makes it reap every
    /// child (PID 1 / subreaper mode).
    pub fn start(reap_all: bool) -> Arc<Reaper> {
        let reaper = Arc::new(Reaper {
            reap_all,
            waiters: Mutex::new(HashMap::new()),
        });
        let weak = Arc::downgrade(&reaper);
        // Register for SIGCHLD before the first child can exist.
        let sigchld = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child());
        tokio::spawn(async move {
            let mut sigchld = sigchld.ok();
            // A slow fallback tick covers a signal stream that could not be set up.
            let mut tick = tokio::time::interval(Duration::from_secs(2));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                match sigchld.as_mut() {
                    Some(s) => {
                        tokio::select! {
                            r = s.recv() => if r.is_none() { sigchld = None; },
                            _ = tick.tick() => {}
                        }
                    }
                    None => {
                        tick.tick().await;
                    }
                }
                let Some(reaper) = weak.upgrade() else { return };
                reaper.reap();
            }
        });
        reaper
    }

    pub fn reaps_all(&self) -> bool {
        self.reap_all
    }

    /// Reaps what has exited and wakes the waiters.
    pub fn reap(&self) {
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        if self.reap_all {
            loop {
                let mut status = 0;
                // SAFETY: plain syscall with a valid out-pointer.
                let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
                if pid <= 0 {
                    break;
                }
                if let Some(tx) = waiters.remove(&pid) {
                    let _ = tx.send(ExitStatus::from_raw(status));
                }
            }
        } else {
            let pids: Vec<i32> = waiters.keys().copied().collect();
            for pid in pids {
                let mut status = 0;
                // SAFETY: as above; only pids this reaper started.
                let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                if r == pid {
                    if let Some(tx) = waiters.remove(&pid) {
                        let _ = tx.send(ExitStatus::from_raw(status));
                    }
                } else if r < 0 {
                    // ECHILD: someone else reaped it; report a generic failure.
                    if let Some(tx) = waiters.remove(&pid) {
                        let _ = tx.send(ExitStatus::from_raw(255 << 8));
                    }
                }
            }
        }
    }

    /// Spawns `cmd` and registers its pid before the reaper can see it exit.
    pub fn spawn(&self, cmd: &mut Command) -> io::Result<(Child, oneshot::Receiver<ExitStatus>)> {
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        let child = cmd.spawn()?;
        let (tx, rx) = oneshot::channel();
        waiters.insert(child.id() as i32, tx);
        Ok((child, rx))
    }
}

/// Sends `sig` to the process group `pgid` (no-op for nonsensical ids).
pub fn kill_group(pgid: i32, sig: i32) -> bool {
    if pgid <= 1 {
        return false;
    }
    // SAFETY: plain syscall.
    unsafe { libc::kill(-pgid, sig) == 0 }
}

/// Sends `sig` to one process.
pub fn kill_pid(pid: i32, sig: i32) -> bool {
    if pid <= 1 {
        return false;
    }
    // SAFETY: plain syscall.
    unsafe { libc::kill(pid, sig) == 0 }
}

/// Exit code as shells report it: the code, or 128 + signal.
pub fn exit_code(status: &ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        _ => 255,
    }
}

/// Identity switch for a child: uid, gid and supplementary groups.
#[derive(Debug, Clone)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

/// What to start and how.
pub struct SpawnSpec {
    pub program: OsString,
    pub args: Vec<OsString>,
    pub env: Vec<(OsString, OsString)>,
    pub cwd: Option<PathBuf>,
    pub identity: Option<Identity>,
    /// Put the child in its own process group (pgid = pid).
    pub own_group: bool,
    /// Pipe stdout/stderr (else inherit).
    pub pipe_output: bool,
    /// stdin from /dev/null (else inherit).
    pub null_stdin: bool,
    /// An extra descriptor installed as fd 3 in the child.
    pub fd3: Option<OwnedFd>,
    /// Hand the terminal on stdin to the child's group (init entrypoint).
    pub take_tty: bool,
}

impl SpawnSpec {
    pub fn new(program: impl Into<OsString>) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            env: Vec::new(),
            cwd: None,
            identity: None,
            own_group: true,
            pipe_output: true,
            null_stdin: true,
            fd3: None,
            take_tty: false,
        }
    }
}

/// A started child with async pipes.
pub struct Spawned {
    pub pid: i32,
    pub stdout: Option<pipe::Receiver>,
    pub stderr: Option<pipe::Receiver>,
    pub exit: oneshot::Receiver<ExitStatus>,
}

/// Starts a child described by `spec`.
pub fn spawn(reaper: &Reaper, spec: SpawnSpec) -> io::Result<Spawned> {
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args);
    cmd.env_clear();
    cmd.envs(spec.env.iter().map(|(k, v)| (k, v)));
    if let Some(cwd) = &spec.cwd {
        cmd.current_dir(cwd);
    }
    if spec.own_group && !spec.take_tty {
        cmd.process_group(0);
    }
    if spec.null_stdin {
        cmd.stdin(Stdio::null());
    }
    if spec.pipe_output {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    }
    let fd3 = spec.fd3.as_ref().map(|f| f.as_raw_fd());
    let identity = spec.identity.clone();
    let take_tty = spec.take_tty;
    if fd3.is_some() || identity.is_some() || take_tty {
        // SAFETY: the closure only makes async-signal-safe syscalls and touches no
        // allocator (everything it reads was prepared before the fork).
        unsafe {
            cmd.pre_exec(move || {
                if take_tty {
                    if libc::setpgid(0, 0) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    if libc::isatty(0) == 1 {
                        let old = libc::signal(libc::SIGTTOU, libc::SIG_IGN);
                        libc::tcsetpgrp(0, libc::getpid());
                        libc::signal(libc::SIGTTOU, old);
                    }
                }
                if let Some(fd) = fd3 {
                    if fd == 3 {
                        let flags = libc::fcntl(3, libc::F_GETFD);
                        libc::fcntl(3, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
                    } else if libc::dup2(fd, 3) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                if let Some(id) = &identity {
                    if libc::setgroups(id.groups.len(), id.groups.as_ptr()) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    if libc::setgid(id.gid) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                    if libc::setuid(id.uid) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
    }
    let (mut child, exit) = reaper.spawn(&mut cmd)?;
    drop(spec.fd3);
    let stdout = match child.stdout.take() {
        Some(s) => Some(pipe::Receiver::from_owned_fd(OwnedFd::from(s))?),
        None => None,
    };
    let stderr = match child.stderr.take() {
        Some(s) => Some(pipe::Receiver::from_owned_fd(OwnedFd::from(s))?),
        None => None,
    };
    Ok(Spawned {
        pid: child.id() as i32,
        stdout,
        stderr,
        exit,
    })
}

/// Finds `name` in a `PATH` value (absolute entries only). Names with a slash are
/// returned as they are.
pub fn find_in_path(name: &str, path: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if name.contains('/') {
        return Some(PathBuf::from(name));
    }
    let default =
        std::ffi::OsStr::new("/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
    for dir in std::env::split_paths(path.unwrap_or(default)) {
        if !dir.is_absolute() {
            continue;
        }
        let candidate = dir.join(name);
        if let Ok(md) = std::fs::metadata(&candidate)
            && md.is_file()
            && md.permissions().mode() & 0o111 != 0
        {
            return Some(candidate);
        }
    }
    None
}

/// The shell for `command` text: bash if present, else sh.
pub fn find_shell(path: Option<&std::ffi::OsStr>) -> Option<PathBuf> {
    find_in_path("bash", path).or_else(|| find_in_path("sh", path))
}

/// Splits pipe output into text events that end on line boundaries (`\n` or `\r`), so
/// that clients joining events never see a line broken in two. A partial line is held
/// back until its end arrives, the stream ends, or it grows past [`MAX_PENDING`].
#[derive(Default)]
pub struct LineChunker {
    pending: Vec<u8>,
}

/// Longest partial line held back before it is sent anyway.
pub const MAX_PENDING: usize = 64 * 1024;

impl LineChunker {
    pub fn push(&mut self, data: &[u8]) -> Option<String> {
        self.pending.extend_from_slice(data);
        let cut = match self.pending.iter().rposition(|&b| b == b'\n' || b == b'\r') {
            Some(i) => i + 1,
            None if self.pending.len() >= MAX_PENDING => utf8_boundary(&self.pending),
            None => return None,
        };
        if cut == 0 {
            return None;
        }
        let rest = self.pending.split_off(cut);
        let out = std::mem::replace(&mut self.pending, rest);
        Some(String::from_utf8_lossy(&out).into_owned())
    }

    pub fn flush(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let out = std::mem::take(&mut self.pending);
        Some(String::from_utf8_lossy(&out).into_owned())
    }
}

/// Largest prefix length of `b` that does not end inside a UTF-8 sequence.
fn utf8_boundary(b: &[u8]) -> usize {
    let n = b.len();
    // Look back at most 3 bytes for the start of an incomplete sequence.
    for back in 1..=3.min(n) {
        let byte = b[n - back];
        if byte & 0xC0 == 0x80 {
            continue; // continuation byte
        }
        let need = if byte & 0xE0 == 0xC0 {
            2
        } else if byte & 0xF0 == 0xE0 {
            3
        } else if byte & 0xF8 == 0xF0 {
            4
        } else {
            1
        };
        return if need > back { n - back } else { n };
    }
    n
}

/// Reads one chunk from an optional pipe; `None` pipes never become ready.
pub async fn read_opt(pipe: &mut Option<pipe::Receiver>, buf: &mut [u8]) -> io::Result<usize> {
    match pipe {
        Some(p) => p.read(buf).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunker_keeps_lines_whole() {
        let mut c = LineChunker::default();
        assert_eq!(c.push(b"hel"), None);
        assert_eq!(c.push(b"lo\nwor").as_deref(), Some("hello\n"));
        assert_eq!(c.push(b"ld\r").as_deref(), Some("world\r"));
        assert_eq!(c.push(b"\n").as_deref(), Some("\n"));
        assert_eq!(c.push(b"tail"), None);
        assert_eq!(c.flush().as_deref(), Some("tail"));
        assert_eq!(c.flush(), None);
    }

    #[test]
    fn chunker_bounds_long_lines_on_char_boundaries() {
        let mut c = LineChunker::default();
        let mut data = vec![b'a'; MAX_PENDING - 1];
        data.push(0xC3); // first byte of "é": straddles the limit
        let out = c.push(&data).unwrap();
        assert_eq!(out.len(), MAX_PENDING - 1);
        assert_eq!(c.push(&[0xA9]), None);
        assert_eq!(c.flush().unwrap(), "é");
    }

    #[test]
    fn exit_codes() {
        assert_eq!(exit_code(&ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(&ExitStatus::from_raw(9)), 137);
    }
}
