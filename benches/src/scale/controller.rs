//! The controller under test as a child process (`sandbolt controller`,
//! the real binary), its output in a log file the harness reads for the
//! lines it prints once serving and once its metrics port is up.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sandbolt_controller::cli::{LISTENING_LINE, METRICS_LINE};

use crate::{BenchError, Result};

/// What every controller of one store shares: binary, address, keys.
#[derive(Debug, Clone)]
pub struct ControllerSetup {
    pub binary: PathBuf,
    /// The main port; fixed, so restarts and the standby take it over and
    /// agents keep heartbeating to the same address.
    pub listen: SocketAddr,
    pub dir: PathBuf,
    pub agent_token: String,
    /// Extra `SANDBOLT_…` settings (store, lease, heartbeat…).
    pub env: Vec<(String, String)>,
}

/// One `sandbolt controller` process; SIGKILLed on drop.
pub struct ControllerChild {
    child: Child,
    log: PathBuf,
    pub started: Instant,
    pub metrics: Option<SocketAddr>,
}

impl ControllerSetup {
    /// Starts replica `name` without waiting for it to serve.
    pub fn spawn(&self, name: &str) -> Result<ControllerChild> {
        let log = self.dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).map_err(|source| BenchError::Io {
            path: log.clone(),
            source,
        })?;
        let err = out.try_clone().map_err(|source| BenchError::Io {
            path: log.clone(),
            source,
        })?;
        let mut cmd = Command::new(&self.binary);
        cmd.arg("controller")
            .env_remove("SANDBOLT_CONTROLLER_FAILPOINT")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("SANDBOLT_FASTPATH_LISTEN", self.listen.to_string())
            .env("SANDBOLT_AGENT_TOKEN", &self.agent_token)
            .env("SANDBOLT_TOKEN_KEY_FILE", self.dir.join("token.key"))
            .env("SANDBOLT_IDENTITY_KEY_FILE", self.dir.join("identity.key"))
            .env("SANDBOLT_METRICS_LISTEN", "127.0.0.1:0")
            .env("SANDBOLT_AGENT_PRESENCE", "none")
            .env(
                "SANDBOLT_LOG",
                "warn,sandbolt_controller::sandbox::recover=info",
            )
            .env("SANDBOLT_POD_NAME", name)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        // A harness that dies (Ctrl-C, a kill) takes its controllers along.
        // SAFETY: prctl is async-signal-safe; nothing else runs between
        // fork and exec.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                    .map_err(std::io::Error::from)
            });
        }
        let child = cmd.spawn().map_err(|e| {
            BenchError::system(
                "controller",
                format!("starting {}: {e}", self.binary.display()),
            )
        })?;
        Ok(ControllerChild {
            child,
            log,
            started: Instant::now(),
            metrics: None,
        })
    }

    /// Writes the token and identity keys every replica shares.
    pub fn write_keys(&self) -> Result<()> {
        for (file, key) in [
            ("token.key", "0123456789abcdef0123456789abcdef"),
            ("identity.key", "fedcba9876543210fedcba9876543210"),
        ] {
            let path = self.dir.join(file);
            std::fs::write(&path, key).map_err(|source| BenchError::Io { path, source })?;
        }
        Ok(())
    }
}

impl ControllerChild {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The first output line starting with `prefix`, its rest trimmed.
    fn line(&self, prefix: &str) -> Option<String> {
        self.output()
            .lines()
            .find_map(|l| l.strip_prefix(prefix).map(|r| r.trim().to_string()))
    }

    /// Waits until it says it serves (with the Kubernetes store: leads);
    /// returns the time since it was started. Fails when it exits or
    /// `limit` passes first.
    pub async fn wait_serving(&mut self, limit: Duration) -> Result<Duration> {
        let deadline = Instant::now() + limit;
        loop {
            if self.metrics.is_none() {
                self.metrics = self.line(METRICS_LINE).and_then(|a| a.parse().ok());
            }
            if self.line(LISTENING_LINE).is_some() {
                return Ok(self.started.elapsed());
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(self.failed(&format!("exited ({status}) before serving")));
            }
            if Instant::now() >= deadline {
                return Err(self.failed(&format!("not serving within {limit:?}")));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits for the metrics line (printed before it serves, standbys too).
    pub async fn wait_metrics(&mut self, limit: Duration) -> Result<SocketAddr> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(a) = self.line(METRICS_LINE).and_then(|a| a.parse().ok()) {
                self.metrics = Some(a);
                return Ok(a);
            }
            if Instant::now() >= deadline {
                return Err(self.failed("no metrics line"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn failed(&self, what: &str) -> BenchError {
        let out = self.output();
        let tail: Vec<&str> = out.lines().rev().take(20).collect();
        BenchError::system(
            "controller",
            format!(
                "{what} (log {}):\n{}",
                self.log.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            ),
        )
    }

    /// Resident set size now, bytes (from /proc).
    pub fn rss_bytes(&self) -> Option<u64> {
        rss_of(self.child.id())
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub async fn terminate(&mut self, grace: Duration) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.kill9();
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }
}

impl Drop for ControllerChild {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// VmRSS of `pid`, bytes.
pub fn rss_of(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kb * 1024)
}
