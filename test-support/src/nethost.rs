//! Test hosts: a network namespace the test creates, joined to the host's
//! root namespace by a veth pair, with a TCP server inside that answers one
//! fixed line naming the host (so a test can tell which host it reached).
//! Never an outside address: every host takes a /30 of the documentation
//! ranges (198.51.100.0/24, 203.0.113.0/24), and may carry one more
//! address of the test's choosing (169.254.169.254 as the cloud metadata
//! stand-in, a 10.x address as a private service) routed to it from the
//! host. Everything is removed on drop.
//!
//! Allocation is safe across parallel test processes: each /30 is claimed
//! with a `flock` on a file under [`LOCK_DIR`], held while the host lives.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};
use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;

/// Where test hosts keep their locks and namespace files.
pub const LOCK_DIR: &str = "/run/sandbolt-test/nethost";
/// The port every test host's server listens on.
pub const PORT: u16 = 7777;

/// Which documentation range a host's /30 comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocRange {
    /// 198.51.100.0/24 (TEST-NET-2).
    TestNet2,
    /// 203.0.113.0/24 (TEST-NET-3).
    TestNet3,
}

impl DocRange {
    fn base(self) -> Ipv4Addr {
        match self {
            DocRange::TestNet2 => Ipv4Addr::new(198, 51, 100, 0),
            DocRange::TestNet3 => Ipv4Addr::new(203, 0, 113, 0),
        }
    }
}

/// A host in its own network namespace, reachable from the root namespace.
pub struct TestHost {
    name: String,
    /// The host's own address in its /30.
    addr: Ipv4Addr,
    /// The root namespace's side of the /30.
    peer: Ipv4Addr,
    /// The extra address routed to the host, if any.
    extra: Option<Ipv4Addr>,
    netns: PathBuf,
    server: Option<LineServer>,
    lock_path: PathBuf,
    _lock: Flock<File>,
    /// Held while the host lives: the extra address is ours.
    _extra_lock: Option<Flock<File>>,
}

impl TestHost {
    /// A host with an address of `range`.
    pub fn start(range: DocRange) -> TestHost {
        Self::build(range, None)
    }

    /// A host that also answers on `extra` (e.g. 169.254.169.254): the
    /// address is on the host's interface and the root namespace routes it
    /// there. Two hosts with the same extra address must not live at once
    /// (the second waits for the first).
    pub fn with_address(extra: Ipv4Addr) -> TestHost {
        Self::build(DocRange::TestNet3, Some(extra))
    }

    fn build(range: DocRange, extra: Option<Ipv4Addr>) -> TestHost {
        std::fs::create_dir_all(LOCK_DIR).expect("test host lock dir");
        let extra_lock = extra.map(|x| {
            let path = Path::new(LOCK_DIR).join(format!("extra-{x}.lock"));
            lock(&path, FlockArg::LockExclusive).expect("lock for the extra address")
        });
        let (lock_path, lock, base) = claim_pair(range);
        let name = format!("th{:08x}", u32::from(base));
        let mut host = TestHost {
            addr: Ipv4Addr::from(u32::from(base) + 2),
            peer: Ipv4Addr::from(u32::from(base) + 1),
            extra,
            netns: Path::new(LOCK_DIR).join(&name),
            name,
            server: None,
            lock_path,
            _lock: lock,
            _extra_lock: extra_lock,
        };
        // Remnants of a crashed run with the same /30 go first.
        host.teardown();
        host.plumb();
        host.server = Some(host.serve());
        host
    }

    /// The namespace, the veth pair, addresses and routes.
    fn plumb(&self) {
        File::create(&self.netns).expect("netns file");
        let target = self.netns.clone();
        std::thread::spawn(move || {
            nix::sched::unshare(CloneFlags::CLONE_NEWNET).expect("unshare");
            nix::mount::mount(
                Some("/proc/thread-self/ns/net"),
                &target,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .expect("bind-mount the test host's netns");
        })
        .join()
        .expect("netns thread");
        let (n, inner) = (&self.name, format!("{}i", self.name));
        let ns = self.netns.to_str().unwrap();
        ip(&["link", "add", n, "type", "veth", "peer", "name", &inner]);
        ip(&["link", "set", &inner, "netns", ns]);
        ip(&["addr", "add", &format!("{}/30", self.peer), "dev", n]);
        ip(&["link", "set", n, "up"]);
        in_ns(ns, &["link", "set", "lo", "up"]);
        in_ns(
            ns,
            &["addr", "add", &format!("{}/30", self.addr), "dev", &inner],
        );
        in_ns(ns, &["link", "set", &inner, "up"]);
        in_ns(
            ns,
            &["route", "add", "default", "via", &self.peer.to_string()],
        );
        if let Some(x) = self.extra {
            in_ns(ns, &["addr", "add", &format!("{x}/32"), "dev", &inner]);
            ip(&[
                "route",
                "replace",
                &format!("{x}/32"),
                "via",
                &self.addr.to_string(),
            ]);
        }
    }

    /// The server: one line per connection, from inside the namespace.
    fn serve(&self) -> LineServer {
        LineServer::start(&self.netns, PORT, self.line())
    }

    /// What the server answers: `test-host <name>\n`.
    pub fn line(&self) -> String {
        format!("test-host {}\n", self.name)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The host's own (documentation range) address.
    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    /// The extra address, if the host has one.
    pub fn extra(&self) -> Option<Ipv4Addr> {
        self.extra
    }

    /// The host's namespace file (to start more servers in it).
    pub fn netns(&self) -> &Path {
        &self.netns
    }

    /// The root namespace's address on the host's link.
    pub fn peer(&self) -> Ipv4Addr {
        self.peer
    }

    /// Connects from the calling process (root namespace) to `addr` and
    /// returns the line read, if any: the control that proves the host
    /// answers, so that "a sandbox cannot reach it" means something.
    pub fn fetch_from_root(addr: Ipv4Addr) -> Option<String> {
        let mut s =
            TcpStream::connect_timeout(&SocketAddr::from((addr, PORT)), Duration::from_secs(2))
                .ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    }

    /// Removes the veth (its peer goes along), the route, the namespace.
    fn teardown(&self) {
        if let Some(x) = self.extra {
            let _ = Command::new("ip")
                .args([
                    "route",
                    "del",
                    &format!("{x}/32"),
                    "via",
                    &self.addr.to_string(),
                ])
                .output();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.name])
            .output();
        let _ = nix::mount::umount2(&self.netns, MntFlags::MNT_DETACH);
        let _ = std::fs::remove_file(&self.netns);
    }
}

impl Drop for TestHost {
    fn drop(&mut self) {
        drop(self.server.take());
        self.teardown();
        let _ = std::fs::remove_file(&self.lock_path);
        if let Some(x) = self.extra {
            let _ = std::fs::remove_file(Path::new(LOCK_DIR).join(format!("extra-{x}.lock")));
        }
    }
}

/// A TCP server inside a network namespace that writes one fixed line to
/// every connection; stopped on drop.
pub struct LineServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl LineServer {
    /// Listens on `0.0.0.0:port` inside the namespace at `netns` (a
    /// bind-mounted file or `/proc/<pid>/ns/net`); returns once it listens.
    pub fn start(netns: &Path, port: u16, line: String) -> LineServer {
        let netns = File::open(netns).expect("open netns");
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            nix::sched::setns(netns.as_fd(), CloneFlags::CLONE_NEWNET).expect("setns");
            let listener = TcpListener::bind(("0.0.0.0", port)).expect("bind the line server");
            listener.set_nonblocking(true).unwrap();
            ready_tx.send(()).unwrap();
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut conn, _)) => {
                        let _ = conn.set_nonblocking(false);
                        let _ = conn.write_all(line.as_bytes());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        ready_rx.recv().expect("the line server starts");
        LineServer {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for LineServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long a connection attempt may take before it counts as blocked
/// (dropped packets never answer).
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(1500);

/// Connects to `addr` from inside the namespace at `netns` (e.g.
/// `/proc/<pid>/ns/net` of a sandbox) and returns what the server wrote
/// before closing; None when the connection fails (refused, dropped).
pub fn fetch_in_netns(netns: &Path, addr: SocketAddr) -> Option<String> {
    let netns = File::open(netns).expect("open netns");
    std::thread::spawn(move || {
        nix::sched::setns(netns.as_fd(), CloneFlags::CLONE_NEWNET).expect("setns");
        let mut s = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        Some(out)
    })
    .join()
    .expect("connect thread")
}

/// Whether a TCP connection to `addr` from inside `netns` is accepted.
pub fn connects_in_netns(netns: &Path, addr: SocketAddr) -> bool {
    let netns = File::open(netns).expect("open netns");
    std::thread::spawn(move || {
        nix::sched::setns(netns.as_fd(), CloneFlags::CLONE_NEWNET).expect("setns");
        TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).is_ok()
    })
    .join()
    .expect("connect thread")
}

/// The first free /30 of `range` (its base address) with its lock.
fn claim_pair(range: DocRange) -> (PathBuf, Flock<File>, Ipv4Addr) {
    for i in 0..64u32 {
        let base = Ipv4Addr::from(u32::from(range.base()) + 4 * i);
        let path = Path::new(LOCK_DIR).join(format!("{base}.lock"));
        if let Some(l) = lock(&path, FlockArg::LockExclusiveNonblock) {
            return (path, l, base);
        }
    }
    panic!("every /30 of {:?} is in use by other tests", range.base());
}

/// Locks `path`; None when held elsewhere. Re-checks that the locked file
/// is still the one at `path` (a dropped host unlinks its lock file).
fn lock(path: &Path, how: FlockArg) -> Option<Flock<File>> {
    use std::os::unix::fs::MetadataExt;
    loop {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .expect("open a test host lock file");
        let l = Flock::lock(file, how).ok()?;
        let same = match (l.metadata(), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.ino() == b.ino(),
            _ => false,
        };
        if same {
            return Some(l);
        }
    }
}

fn ip(args: &[&str]) {
    run("ip", args);
}

fn in_ns(netns: &str, args: &[&str]) {
    let mut all = vec!["--net=".to_string() + netns, "ip".into()];
    all.extend(args.iter().map(|a| a.to_string()));
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    run("nsenter", &refs);
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_answer_their_line_and_leave_nothing() {
        let a = TestHost::start(DocRange::TestNet2);
        let b = TestHost::with_address(Ipv4Addr::new(169, 254, 169, 254));
        assert_ne!(a.addr(), b.addr());
        assert_eq!(TestHost::fetch_from_root(a.addr()), Some(a.line()));
        assert_eq!(
            TestHost::fetch_from_root(Ipv4Addr::new(169, 254, 169, 254)),
            Some(b.line())
        );
        let (name, netns) = (a.name().to_string(), a.netns.clone());
        drop(a);
        drop(b);
        assert!(!netns.exists());
        let links = Command::new("ip").args(["-o", "link"]).output().unwrap();
        assert!(!String::from_utf8_lossy(&links.stdout).contains(&name));
    }
}
