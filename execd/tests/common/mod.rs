//! Shared helpers: an `execd` process on a free loopback port.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `execd` (the binary under test); killed on drop.
pub struct Execd {
    pub child: Child,
    pub addr: String,
    pub token: Option<String>,
}

impl Execd {
    /// Starts `execd --listen 127.0.0.1:0 ARGS...` and waits for its address.
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Execd {
        Self::start_in(args, envs, None)
    }

    pub fn start_in(args: &[&str], envs: &[(&str, &str)], cwd: Option<&std::path::Path>) -> Execd {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_execd"));
        cmd.arg("--listen").arg("127.0.0.1:0");
        // Flags go before `--`; an entrypoint after it.
        cmd.args(args);
        cmd.env_remove("EXECD_ACCESS_TOKEN")
            .env_remove("EXECD_LISTEN")
            .env_remove("EXECD_ENVS");
        for (k, v) in envs {
            cmd.env(k, v);
        }
        if let Some(d) = cwd {
            cmd.current_dir(d);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::inherit())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("start execd");
        let stderr = child.stderr.take().expect("stderr");
        let mut lines = BufReader::new(stderr).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("execd exited before listening")
                .expect("read stderr");
            if let Some(a) = line.strip_prefix("execd: listening on ") {
                break a.trim().to_string();
            }
        };
        // Keep draining stderr so execd never blocks on it.
        std::thread::spawn(move || for _ in lines {});
        let token = args
            .iter()
            .position(|a| *a == "--access-token")
            .map(|i| args[i + 1].to_string());
        Execd { child, addr, token }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Waits up to `timeout` for execd to exit; its exit code (or 128+signal).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        use std::os::unix::process::ExitStatusExt;
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            if let Some(st) = self.child.try_wait().expect("try_wait") {
                return Some(st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0)));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Execd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Parses an SSE body of bare JSON frames.
pub fn frames(body: &str) -> Vec<serde_json::Value> {
    body.split("\n\n")
        .filter(|f| !f.trim().is_empty())
        .map(|f| serde_json::from_str(f).unwrap_or_else(|e| panic!("bad frame {f:?}: {e}")))
        .collect()
}

/// Zombie children of `ppid`.
pub fn zombies_of(ppid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let rest: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        if rest.len() > 2 && rest[0] == "Z" && rest[1].parse::<i32>().ok() == Some(ppid) {
            out.push(pid);
        }
    }
    out
}

/// True once `pid` has exited and been reaped: a zombie keeps its `/proc` entry.
pub fn gone_from_proc(pid: i32) -> bool {
    !std::path::Path::new(&format!("/proc/{pid}")).exists()
}
