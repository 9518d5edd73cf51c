//! What sandbolt's tests share, so that each test file says only what it
//! checks. Used as a dev-dependency; never linked into a shipped binary.
//!
//! Waiting is always for a condition ([`eventually`], [`eventually_async`]),
//! never a fixed sleep: the limit only bounds a broken run, it asserts no
//! speed (speed lives in the benchmarks).
//!
//! Processes a test starts are [`Proc`]s (killed on drop, output kept);
//! [`http`] talks to the agent's data-plane proxy.

pub mod dns;
pub mod http;
pub mod nethost;
mod process;
pub mod sim_agent;

pub use process::Proc;

use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

/// How often the pollers look again.
const POLL_EVERY: Duration = Duration::from_millis(20);

/// Polls `f` until it returns `Some`, then returns the value. Panics naming
/// `what` when `limit` passes first.
pub async fn eventually<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    eventually_async(what, limit, || std::future::ready(f())).await
}

/// [`eventually`] for an asynchronous check.
pub async fn eventually_async<T, F>(what: &str, limit: Duration, mut f: impl FnMut() -> F) -> T
where
    F: Future<Output = Option<T>>,
{
    let deadline = Deadline::new(what, limit);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        deadline.check();
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// [`eventually`] for code outside a runtime (child processes, files).
pub fn eventually_blocking<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Deadline::new(what, limit);
    loop {
        if let Some(v) = f() {
            return v;
        }
        deadline.check();
        std::thread::sleep(POLL_EVERY);
    }
}

/// When a poll for `what` gives up.
struct Deadline<'a> {
    what: &'a str,
    start: Instant,
    limit: Duration,
}

impl<'a> Deadline<'a> {
    fn new(what: &'a str, limit: Duration) -> Self {
        Deadline {
            what,
            start: Instant::now(),
            limit,
        }
    }

    /// Panics, naming what was awaited, once the limit has passed.
    fn check(&self) {
        assert!(
            self.start.elapsed() < self.limit,
            "timed out after {:?} waiting for {}",
            self.limit,
            self.what
        );
    }
}

/// A TCP port on 127.0.0.1 that was free a moment ago (the kernel picked it).
/// For processes that must be told their port before they start.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0")
}

/// Waits until something accepts TCP connections on `addr`.
pub async fn wait_for_port(addr: SocketAddr, limit: Duration) {
    eventually_async(&format!("a listener on {addr}"), limit, || async move {
        tokio::net::TcpStream::connect(addr).await.ok().map(drop)
    })
    .await;
}

/// [`wait_for_port`] for code outside a runtime.
pub fn wait_for_port_blocking(addr: SocketAddr, limit: Duration) {
    eventually_blocking(&format!("a listener on {addr}"), limit, || {
        std::net::TcpStream::connect(addr).ok().map(drop)
    });
}

/// Now, in unix seconds (the unit of sandbox expiries).
pub fn now_unix_secs() -> i64 {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("the clock is after 1970");
    i64::try_from(since_epoch.as_secs()).expect("unix seconds fit in i64")
}

/// Logs of the code under test, shown by the test harness only for a failed
/// test. `default_filter` is used when `RUST_LOG` is unset
/// (e.g. `"sandbolt_agent=info"`). Safe to call from every test.
pub fn init_tracing(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_filter.into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// The name the test harness gives `test` declared in `module` (its
/// `module_path!()`): the path without the test binary's crate name. A test
/// that re-runs its own binary for itself passes this to `--exact`, which
/// would match nothing with the bare function name once the crate's test
/// files are modules of one binary.
pub fn test_name(module: &str, test: &str) -> String {
    match module.split_once("::") {
        Some((_, path)) => format!("{path}::{test}"),
        None => test.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn eventually_returns_the_first_value() {
        let mut n = 0;
        let v = eventually("n to reach 3", Duration::from_secs(5), || {
            n += 1;
            (n >= 3).then_some(n)
        })
        .await;
        assert_eq!(v, 3);
    }

    #[tokio::test]
    #[should_panic(expected = "waiting for never")]
    async fn eventually_names_what_it_waited_for() {
        eventually::<()>("never", Duration::from_millis(50), || None).await;
    }

    #[tokio::test]
    async fn a_port_is_awaited_until_it_listens() {
        let port = free_port();
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let late = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            tokio::net::TcpListener::bind(addr).await.unwrap()
        });
        wait_for_port(addr, Duration::from_secs(10)).await;
        drop(late.await.unwrap());
    }

    #[test]
    fn a_proc_is_waited_for_and_killed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", "echo ready; exec sleep 1000"]);
        let mut p = Proc::spawn("sh", &mut cmd, dir.path().join("sh.log"));
        p.wait_for_line_blocking("ready", Duration::from_secs(10));
        p.assert_running();
        let pid = p.pid();
        drop(p);
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "the process outlived its guard"
        );
    }

    #[test]
    fn a_proc_that_exits_fails_the_wait_with_its_output() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", "echo last words; exit 3"]);
        let mut p = Proc::spawn("sh", &mut cmd, dir.path().join("sh.log"));
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            p.wait_for_line_blocking("never", Duration::from_secs(10))
        }))
        .expect_err("the wait fails");
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            msg.contains("exited") && msg.contains("last words"),
            "{msg}"
        );
    }

    #[test]
    fn terminate_returns_the_exit_status() {
        let dir = tempfile::tempdir().unwrap();
        let mut cmd = std::process::Command::new("sh");
        cmd.args([
            "-c",
            "trap 'exit 0' TERM; echo up; while :; do sleep 0.05; done",
        ]);
        let mut p = Proc::spawn("sh", &mut cmd, dir.path().join("sh.log"));
        p.wait_for_line_blocking("up", Duration::from_secs(10));
        assert!(p.terminate(Duration::from_secs(10)).success());
    }

    #[test]
    fn free_ports_are_bindable() {
        let p = free_port();
        assert!(TcpListener::bind(("127.0.0.1", p)).is_ok());
    }
}
