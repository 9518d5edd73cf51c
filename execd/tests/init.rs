//! `--init`: entrypoint as a child, signal forwarding, exit status, zombie reaping.
//! (Here execd is a child subreaper rather than PID 1; the container test covers PID 1.)

use crate::common;

use std::time::Duration;

use common::{Execd, gone_from_proc, zombies_of};
use sandbolt_test_support::eventually_blocking;

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

/// execd in init mode with `sh -c SCRIPT` as its entrypoint; it keeps serving after
/// the entrypoint exits.
fn start_with_sh(script: &str, envs: &[(&str, &str)]) -> Execd {
    Execd::start(&["--init", "--", "sh", "-c", script], envs)
}

/// execd in init mode that exits with its entrypoint, `sh -c SCRIPT`.
fn start_following_sh(script: &str) -> Execd {
    Execd::start(
        &["--init", "--exit-with-entrypoint", "--", "sh", "-c", script],
        &[],
    )
}

#[test]
fn exits_with_entrypoint_status() {
    let mut e = start_following_sh("sleep 0.3; exit 5");
    assert_eq!(get(&e, "/ping"), 200, "serves while the entrypoint runs");
    assert_eq!(e.wait_exit(Duration::from_secs(10)), Some(5));
}

#[test]
fn entrypoint_killed_by_signal_gives_128_plus_signal() {
    let mut e = start_following_sh("kill -9 $$");
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
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("entrypoint.pid");
    let mut e = start_with_sh("echo $$ > \"$P\"", &[("P", pidfile.to_str().unwrap())]);
    let entrypoint = eventually_blocking("the entrypoint to start", Duration::from_secs(5), || {
        std::fs::read_to_string(&pidfile)
            .ok()?
            .trim()
            .parse::<i32>()
            .ok()
    });
    eventually_blocking("the entrypoint to exit", Duration::from_secs(5), || {
        gone_from_proc(entrypoint).then_some(())
    });
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
    let script = "trap 'echo usr1 > \"$F\"' USR1; trap 'exit 9' TERM; touch \"$R\"; while :; do sleep 0.05; done";
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("usr1");
    let ready = dir.path().join("traps-set");
    let mut e = start_with_sh(
        script,
        &[("F", f.to_str().unwrap()), ("R", ready.to_str().unwrap())],
    );
    eventually_blocking("the entrypoint's traps", Duration::from_secs(5), || {
        ready.exists().then_some(())
    });
    kill(e.pid(), libc::SIGUSR1);
    eventually_blocking(
        "SIGUSR1 to reach the entrypoint",
        Duration::from_secs(5),
        || f.exists().then_some(()),
    );
    assert_eq!(e.wait_exit(Duration::from_millis(100)), None);
    kill(e.pid(), libc::SIGTERM);
    assert_eq!(e.wait_exit(Duration::from_secs(5)), Some(9));
}

#[test]
fn reaps_orphans_of_the_entrypoint() {
    // Each round leaves an orphan that is re-parented to execd and exits.
    let dir = tempfile::tempdir().unwrap();
    let pids = dir.path().join("orphans");
    let e = start_with_sh(
        "for i in 1 2 3 4 5; do (sleep 0.05 & echo $! >> \"$P\"); done; touch \"$P.done\"; sleep 100",
        &[("P", pids.to_str().unwrap())],
    );
    let done = dir.path().join("orphans.done");
    let orphans: Vec<i32> =
        eventually_blocking("the orphans to start", Duration::from_secs(5), || {
            done.exists().then_some(())?;
            let text = std::fs::read_to_string(&pids).ok()?;
            Some(text.lines().filter_map(|l| l.trim().parse().ok()).collect())
        });
    assert_eq!(orphans.len(), 5, "{orphans:?}");
    // Gone from /proc: exited and reaped (a zombie keeps its entry).
    eventually_blocking("the orphans to be reaped", Duration::from_secs(5), || {
        orphans.iter().all(|p| gone_from_proc(*p)).then_some(())
    });
    let zombies = zombies_of(e.pid());
    assert!(zombies.is_empty(), "zombies left: {zombies:?}");
    assert_eq!(get(&e, "/ping"), 200);
}

#[test]
fn bad_arguments_exit_2() {
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_execd"))
            .args(args)
            .output()
            .unwrap()
    };
    assert_eq!(run(&["--listen", "nonsense"]).status.code(), Some(2));
    assert_eq!(run(&["--bogus"]).status.code(), Some(2));
    let help = run(&["--help"]);
    assert_eq!(help.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&help.stdout).contains("--init"));
}
