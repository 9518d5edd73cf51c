//! Wire compatibility: Python clients generated with grpcio-tools from the
//! contract protos drive FastPath v1 and v2 against a running controller.
//!
//! Agents here are in-process AgentService **stand-ins** (see
//! `support/standin.rs`): this test is about the controller's wire contract.
//! The same flows against the real agent on containerd are in
//! `e2e_testbed.rs`.

mod support;

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use sandbolt_controller::{Consistency, Controller, ControllerConfig};
use support::standin::{AGENT_TOKEN, StandInAgent};

fn venv_python() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let py = root.join(".venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing: run scripts/python-env.sh to create the venv (grpcio-tools, pytest)",
        py.display()
    );
    py
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_clients_from_contract_protos() {
    let py = venv_python();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path(), AGENT_TOKEN);
    cfg.default_consistency = Consistency::Fast;
    cfg.heartbeat_interval = Duration::from_millis(200);
    cfg.failpoint = None;
    let h = Controller::start(cfg).await.unwrap();
    let _a = StandInAgent::start(
        "agent-py",
        "default",
        32,
        &["busybox"],
        h.local_addr(),
        Duration::from_millis(200),
    )
    .await;
    let addr = h.local_addr().to_string();
    let test = root.join("tests/python/fastpath_contract.py");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(py)
            .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
            .arg(&test)
            .env("FASTPATH_ADDR", addr)
            .current_dir(&root)
            .output()
            .expect("run pytest")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}\n{stderr}");
    assert!(out.status.success(), "pytest failed:\n{stdout}\n{stderr}");
    assert!(
        stdout.contains("5 passed"),
        "expected 5 contract tests to pass:\n{stdout}"
    );
    h.shutdown().await;
}
