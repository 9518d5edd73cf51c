//! `sandbolt up` end to end: the real binary on the test bed's containerd,
//! driven by the official OpenSandbox SDK through its lifecycle API, then
//! stopped with SIGTERM.

use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sandbolt_testbed::{Testbed, busybox_image, execd_binary, python, workspace_root};

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn sandbolt_up_serves_the_sdk_and_stops_cleanly() {
    let bed = Testbed::start().expect("test bed");
    bed.import_image(&busybox_image().unwrap(), "k8s.io")
        .unwrap();
    let data = tempfile::tempdir().unwrap();
    let [fastpath, lifecycle, agent, proxy] = [free_port(), free_port(), free_port(), free_port()];
    let log_path = data.path().join("up.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut up = Command::new(env!("CARGO_BIN_EXE_sandbolt"))
        .arg("up")
        .arg("--data-dir")
        .arg(data.path().join("state"))
        .arg("--runtime")
        .arg("containerd")
        .arg("--containerd-socket")
        .arg(bed.containerd_socket())
        .arg("--execd-bin")
        .arg(execd_binary().unwrap())
        .args(["--fastpath-listen", &format!("127.0.0.1:{fastpath}")])
        .args(["--lifecycle-listen", &format!("127.0.0.1:{lifecycle}")])
        .args(["--agent-listen", &format!("127.0.0.1:{agent}")])
        .args(["--proxy-listen", &format!("127.0.0.1:{proxy}")])
        .args(["--api-key", "up-test-key", "--janitor-interval", "2s"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();

    // Up once the log says so (it logs where every API listens).
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        if text.contains("sandbolt is up") {
            break;
        }
        if let Some(status) = up.try_wait().unwrap() {
            panic!("sandbolt up exited ({status}) during start-up:\n{text}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "not up after 60 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let py = python().expect("python venv");
    let out = Command::new(py)
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(workspace_root().join("tests/python/up_smoke_test.py"))
        .env("LIFECYCLE_DOMAIN", format!("127.0.0.1:{lifecycle}"))
        .env("LIFECYCLE_API_KEY", "up-test-key")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let log_text = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        out.status.success(),
        "SDK test failed:\n{stdout}\n{}\n--- sandbolt up log ---\n{log_text}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("1 passed"), "{stdout}");

    // SIGTERM: a clean, zero exit.
    // SAFETY: kill(2) on our own child's pid only sends a signal.
    unsafe {
        libc::kill(up.id() as i32, libc::SIGTERM);
    }
    let started = Instant::now();
    let status = loop {
        if let Some(s) = up.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = up.kill();
            panic!("sandbolt up did not stop within 30 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        status.success(),
        "exit {status}:\n{}",
        std::fs::read_to_string(&log_path).unwrap_or_default()
    );
}

#[test]
fn sandbolt_up_refuses_to_run_open_without_being_told() {
    let data = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sandbolt"))
        .arg("up")
        .arg("--data-dir")
        .arg(data.path())
        .env_remove("SANDBOLT_API_KEY")
        .env_remove("SANDBOLT_INSECURE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--api-key") && err.contains("--insecure"),
        "{err}"
    );
}
