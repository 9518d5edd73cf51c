//! The machine a run happened on, for the report's header.

use std::process::Command;

#[derive(Debug, Clone, serde::Serialize)]
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub memory_gib: f64,
    pub kernel: String,
    pub containerd: String,
    pub runc: String,
    pub docker: String,
}

pub fn describe() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kib: f64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    Machine {
        cpu,
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        memory_gib: mem_kib / 1024.0 / 1024.0,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        containerd: first_line("containerd", &["--version"]),
        runc: first_line("runc", &["--version"]),
        docker: first_line("dockerd", &["--version"]),
    }
}

fn first_line(bin: &str, args: &[&str]) -> String {
    Command::new(bin)
        .args(args)
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_else(|| format!("{bin}: not found"))
}
