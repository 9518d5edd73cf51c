//! `--init`: entrypoint as a child, signal forwarding, exit status, zombie reaping.
//! (Here execd is a child subreaper rather than PID 1; the container test covers PID 1.)

mod common;

use std::time::Duration;

use common::Execd;

fn get(e: &Execd, path: &str) -> u16 {
    let out = std::process::Command::new("curl")
        .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", &e.url(path)])
        .output();
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout).parse().unwrap_or(0),
        Err(_) => {
            // No curl: a raw request.
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(&e.addr).unwrap();
            write!(
                s,
                "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut buf = String::new();
            s.read_to_string(&mut buf).unwrap();
            buf[9..12].parse().unwrap()
        }
    }
}

fn kill(pid: i32, sig: i32) {
    // SAFETY: plain syscall on our own child.
    unsafe { libc::kill(pid, sig) };
}

#[test]
fn exits_with_entrypoint_status() {
    let mut e = Execd::start(
        &[
            "--init",
            "--exit-with-entrypoint",
            "--",
            "sh",
            "-c",
            "sleep 0.3; exit 5",
        ],
        &[],
    );
    assert_eq!(get(&e, "/ping"), 200, "serves while the entrypoint runs");
    assert_eq!(e.wait_exit(Duration::from_secs(10)), Some(5));
}

#[test]
fn entrypoint_killed_by_signal_gives_128_plus_signal() {
    let mut e = Execd::start(
        &[
            "--init",
            "--exit-with-entrypoint",
            "--",
            "sh",
            "-c",
            "kill -9 $$",
        ],
        &[],
    );
    assert_eq!(e.wait_exit(Duration::from_secs(10)), Some(137));
}

#[test]
fn missing_entrypoint_exits_127() {
    let mut e = Execd::start(
        &["--init", "--exit-with-entrypoint", "--", "/no/such/program"],
        &[],
    );
    assert_eq!(e.wait_exit(Duration::from_secs(10)), Some(127));
}

#[test]
fn keeps_serving_after_entrypoint_exits() {
    let mut e = Execd::start(&["--init", "--", "true"], &[]);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(get(&e, "/ping"), 200);
    assert_eq!(e.wait_exit(Duration::from_millis(200)), None);
    kill(e.pid(), libc::SIGTERM);
    assert_eq!(
        e.wait_exit(Duration::from_secs(5)),
        Some(0),
        "SIGTERM without an entrypoint: clean exit"
    );
}

#[test]
fn sigterm_is_forwarded_and_execd_follows_the_entrypoint() {
    // The entrypoint turns SIGTERM into exit 9; USR1 is forwarded but keeps it running.
    let script = "trap 'echo usr1 > \"$F\"' USR1; trap 'exit 9' TERM; while :; do sleep 0.05; done";
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("usr1");
    let mut e = Execd::start(
        &["--init", "--", "sh", "-c", script],
        &[("F", f.to_str().unwrap())],
    );
    std::thread::sleep(Duration::from_millis(300));
    kill(e.pid(), libc::SIGUSR1);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !f.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(f.exists(), "SIGUSR1 reached the entrypoint");
    assert_eq!(e.wait_exit(Duration::from_millis(100)), None);
    kill(e.pid(), libc::SIGTERM);
    assert_eq!(e.wait_exit(Duration::from_secs(5)), Some(9));
}

#[test]
fn reaps_orphans_of_the_entrypoint() {
    // Each round leaves an orphan that is re-parented to execd and exits.
    let e = Execd::start(
        &[
            "--init",
            "--",
            "sh",
            "-c",
            "for i in 1 2 3 4 5; do (sleep 0.05 &); done; sleep 100",
        ],
        &[],
    );
    std::thread::sleep(Duration::from_millis(800));
    let zombies = zombies_of(e.pid());
    assert!(zombies.is_empty(), "zombies left: {zombies:?}");
    assert_eq!(get(&e, "/ping"), 200);
}

fn zombies_of(ppid: i32) -> Vec<i32> {
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

#[test]
fn bad_arguments_exit_2() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_execd"))
        .args(["--listen", "nonsense"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_execd"))
        .args(["--bogus"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_execd"))
        .args(["--help"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("--init"));
}
