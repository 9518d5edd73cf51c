//! The controller as a child process (`sandbolt-controller` binary), so a
//! test can `kill -9` it for real.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub struct ChildController {
    pub child: Child,
    pub addr: SocketAddr,
    stderr: mpsc::Receiver<String>,
}

impl ChildController {
    /// Starts the controller on `listen` (a fixed address, so that agents
    /// heartbeat to the restarted process too) over the store in `dir`.
    pub fn spawn(
        dir: &Path,
        listen: SocketAddr,
        mode: &str,
        failpoint: Option<&str>,
        agent_token: &str,
    ) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandbolt-controller"));
        cmd.env("SANDBOLT_CONTROLLER_DATA_DIR", dir)
            .env("SANDBOLT_CONTROLLER_LISTEN", listen.to_string())
            .env("SANDBOLT_AGENT_TOKEN", agent_token)
            .env("SANDBOLT_CONSISTENCY", mode)
            .env("SANDBOLT_HEARTBEAT_MS", "100")
            .env("SANDBOLT_LOST_AGENT_MS", "3000")
            .env("SANDBOLT_EXPIRY_SWEEP_MS", "100")
            .env("RUST_LOG", "sandbolt_controller=debug")
            .env_remove("SANDBOLT_CONTROLLER_FAILPOINT")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(fp) = failpoint {
            cmd.env("SANDBOLT_CONTROLLER_FAILPOINT", fp);
        }
        let mut child = cmd.spawn().expect("spawn sandbolt-controller");
        let stdout = child.stdout.take().unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[controller] {line}");
                let _ = tx.send(line);
            }
        });
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read controller stdout");
        let addr = line
            .trim()
            .strip_prefix("SANDBOLT_CONTROLLER_LISTENING ")
            .unwrap_or_else(|| panic!("controller did not start: {line:?}"))
            .parse()
            .unwrap();
        Self {
            child,
            addr,
            stderr: rx,
        }
    }

    /// Blocks until the controller printed the failpoint marker.
    pub fn wait_failpoint(&self, timeout: Duration) -> String {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.stderr.recv_timeout(left) {
                Ok(l) if l.starts_with("SANDBOLT_FAILPOINT_REACHED") => return l,
                Ok(_) => continue,
                Err(e) => panic!("failpoint not reached: {e}"),
            }
        }
    }

    /// SIGKILL, no goodbye.
    pub fn kill9(mut self) {
        let pid = self.child.id() as i32;
        // SAFETY: signalling our own child by pid.
        let rc = unsafe { libc::kill(pid, libc::SIGKILL) };
        assert_eq!(rc, 0, "kill -9 {pid}");
        let status = self.child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }
}

impl Drop for ChildController {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
