//! Processes under test: real binaries started by a test, their output kept
//! in a file the test can search and print when it fails.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::POLL_EVERY;

/// A child process whose stdout and stderr go to a log file. Dropping it
/// SIGKILLs it (never asks): a failed test must not leave it running, and
/// the tests that kill on purpose want exactly this.
pub struct Proc {
    child: Child,
    log: PathBuf,
    what: String,
}

impl Proc {
    /// Spawns `cmd` as `what` (named in every message), its stdout and
    /// stderr appended to a new file at `log`.
    pub fn spawn(what: &str, cmd: &mut Command, log: impl Into<PathBuf>) -> Proc {
        let log = log.into();
        let file = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
        let stdout = file.try_clone().expect("duplicating the log file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(file))
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {what}: {e}"));
        Proc {
            child,
            log,
            what: what.to_string(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Everything it printed so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether it has exited (and been reaped).
    pub fn has_exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL, and reap it. Harmless when it already exited.
    pub fn kill9(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = kill(self.nix_pid(), Signal::SIGKILL);
        }
        let _ = self.child.wait();
    }

    /// SIGTERM, then waits up to `limit` for it to exit; its exit status.
    /// Panics with its output (after a SIGKILL) when it ignores the signal.
    pub fn terminate(&mut self, limit: Duration) -> ExitStatus {
        let _ = kill(self.nix_pid(), Signal::SIGTERM);
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            if started.elapsed() > limit {
                self.kill9();
                panic!(
                    "{} ignored SIGTERM for {limit:?}:\n{}",
                    self.what,
                    self.output()
                );
            }
            std::thread::sleep(POLL_EVERY);
        }
    }

    /// Panics with its output when it has exited.
    pub fn assert_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("{} exited ({status}):\n{}", self.what, self.output());
        }
    }

    /// Waits until its output contains `needle`. Panics with the output when
    /// it exits first or `limit` passes.
    pub async fn wait_for_line(&mut self, needle: &str, limit: Duration) {
        let started = Instant::now();
        while !self.printed(needle, started, limit) {
            tokio::time::sleep(POLL_EVERY).await;
        }
    }

    /// [`Proc::wait_for_line`] for code outside a runtime.
    pub fn wait_for_line_blocking(&mut self, needle: &str, limit: Duration) {
        let started = Instant::now();
        while !self.printed(needle, started, limit) {
            std::thread::sleep(POLL_EVERY);
        }
    }

    /// Whether the output contains `needle`; panics with the output once it
    /// exited without printing it or `limit` passed since `started`.
    fn printed(&mut self, needle: &str, started: Instant, limit: Duration) -> bool {
        // Exit first, output second: once it has exited, the output read
        // after is all it will ever print.
        let exited = self.child.try_wait().ok().flatten();
        let text = self.output();
        if text.contains(needle) {
            return true;
        }
        if let Some(status) = exited {
            panic!(
                "{} exited ({status}) before printing {needle:?}:\n{text}",
                self.what
            );
        }
        assert!(
            started.elapsed() < limit,
            "{} did not print {needle:?} within {limit:?}:\n{text}",
            self.what
        );
        false
    }

    fn nix_pid(&self) -> Pid {
        Pid::from_raw(i32::try_from(self.child.id()).expect("pids fit in i32"))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}
