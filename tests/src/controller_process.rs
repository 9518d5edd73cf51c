//! The controller as a child process (`sandbolt controller`), so a test can
//! `kill -9` it for real, or run several replicas of it.
//!
//! The binary is this crate's `e2e-sandbolt`, which is `sandbolt`'s own
//! `main`: Cargo builds a package's binaries for its own tests only, so the
//! tests here cannot name the CLI crate's `sandbolt` binary.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sandbolt_controller::cli::LISTENING_LINE;
use sandbolt_test_support::Proc;

/// What the controller prints on stderr when it reaches a failpoint.
const FAILPOINT_REACHED: &str = "SANDBOLT_FAILPOINT_REACHED";

/// How long a controller may take to print its listening line.
const SERVING_WITHIN: Duration = Duration::from_secs(30);

/// A `sandbolt controller` child process; SIGKILLed on drop.
pub struct ControllerProcess {
    proc: Proc,
}

impl ControllerProcess {
    /// `sandbolt controller` with the test's environment (`SANDBOLT_…`
    /// names, see `sandbolt_controller::cli`) and nothing inherited that
    /// would change it.
    pub fn command(binary: &Path, env: &[(&str, String)]) -> Command {
        let mut cmd = Command::new(binary);
        cmd.arg("controller")
            .env_remove("SANDBOLT_CONTROLLER_FAILPOINT")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("SANDBOLT_LOG", "sandbolt_controller=debug");
        for (name, value) in env {
            cmd.env(name, value);
        }
        cmd
    }

    /// Starts `cmd` as `what`, its output kept in `log`, without waiting.
    pub fn spawn(what: &str, cmd: &mut Command, log: PathBuf) -> ControllerProcess {
        ControllerProcess {
            proc: Proc::spawn(what, cmd, log),
        }
    }

    /// The embedded-store controller on `listen` (a fixed address, so that
    /// agents heartbeat to a restarted process too) over the store in
    /// `data`, stopped at `failpoint` when given. Returns once it serves.
    pub fn start_embedded(
        binary: &Path,
        data: &Path,
        listen: SocketAddr,
        mode: &str,
        failpoint: Option<&str>,
        agent_token: &str,
    ) -> ControllerProcess {
        let mut env = vec![
            ("SANDBOLT_DATA_DIR", data.display().to_string()),
            ("SANDBOLT_FASTPATH_LISTEN", listen.to_string()),
            ("SANDBOLT_AGENT_TOKEN", agent_token.to_string()),
            ("SANDBOLT_CONSISTENCY", mode.to_string()),
            ("SANDBOLT_HEARTBEAT_INTERVAL", "100ms".to_string()),
            ("SANDBOLT_AGENT_LOST_TIMEOUT", "3s".to_string()),
            ("SANDBOLT_STARTUP_GRACE", "3s".to_string()),
            ("SANDBOLT_EXPIRY_SWEEP_INTERVAL", "100ms".to_string()),
            ("SANDBOLT_STORE", "embedded".to_string()),
            ("SANDBOLT_AGENT_PRESENCE", "none".to_string()),
        ];
        if let Some(fp) = failpoint {
            env.push(("SANDBOLT_CONTROLLER_FAILPOINT", fp.to_string()));
        }
        // One log per start: a restarted controller must not find the
        // listening line of the one before it.
        static STARTS: AtomicUsize = AtomicUsize::new(0);
        let log = data.join(format!(
            "controller-{}.log",
            STARTS.fetch_add(1, Ordering::Relaxed)
        ));
        let mut ctl = Self::spawn("controller", &mut Self::command(binary, &env), log);
        let addr = ctl.wait_serving(SERVING_WITHIN);
        assert_eq!(addr, Some(listen), "the controller serves on {listen}");
        ctl
    }

    /// Waits up to `limit` for it to say it serves; the address it serves
    /// on, or `None` when it did not (within `limit`, or it exited first).
    pub fn wait_serving(&mut self, limit: Duration) -> Option<SocketAddr> {
        let line = self.wait_for_line(LISTENING_LINE, limit)?;
        let addr = line[LISTENING_LINE.len()..].trim();
        Some(
            addr.parse()
                .unwrap_or_else(|e| panic!("listening address {addr:?}: {e}")),
        )
    }

    /// Blocks until it printed the failpoint marker; returns that line.
    pub fn wait_failpoint(&mut self, limit: Duration) -> String {
        self.wait_for_line(FAILPOINT_REACHED, limit)
            .unwrap_or_else(|| {
                panic!(
                    "failpoint not reached within {limit:?}:\n{}",
                    self.proc.output()
                )
            })
    }

    /// The first output line starting with `prefix`, once printed; `None`
    /// when `limit` passes or it exits first.
    fn wait_for_line(&mut self, prefix: &str, limit: Duration) -> Option<String> {
        let started = Instant::now();
        sandbolt_test_support::eventually_blocking(
            &format!("{prefix} or an exit"),
            limit + Duration::from_secs(1),
            || {
                let found = self
                    .proc
                    .output()
                    .lines()
                    .find(|l| l.starts_with(prefix))
                    .map(|l| Some(l.to_string()));
                found.or_else(|| {
                    (self.proc.has_exited() || started.elapsed() >= limit).then_some(None)
                })
            },
        )
    }

    /// SIGKILL, no goodbye.
    pub fn kill9(&mut self) {
        self.proc.kill9();
    }

    /// SIGTERM (the graceful stop), then its exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        self.proc.terminate(SERVING_WITHIN)
    }

    /// Everything it printed so far.
    pub fn output(&self) -> String {
        self.proc.output()
    }
}
