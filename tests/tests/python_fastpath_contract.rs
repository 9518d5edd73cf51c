//! Wire compatibility: Python clients generated with grpcio-tools from the
//! contract protos (`tests/python/fastpath_contract.py`) drive FastPath v1
//! and v2 against the controller, which places on a real agent on the test
//! bed (private containerd, busybox, static execd as PID 1). The Python side
//! also reaches execd's `/ping` through the agent's data-plane proxy with
//! `urllib`, from what ResolveEndpoint returned.

use std::process::Command;
use std::time::Duration;

use sandbolt_controller::{Consistency, Controller, ControllerConfig};
use sandbolt_e2e::bed::{V2, start_agent, start_bed, wait_agents};

const TOKEN: &str = "python-contract-agent-token";
/// Number of `test_*` functions in fastpath_contract.py; all must pass.
const PY_TESTS: usize = 6;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_grpcio_clients_from_contract_protos() {
    let py = tokio::task::spawn_blocking(sandbolt_testbed::python)
        .await
        .unwrap()
        .expect("the repo's venv python (scripts/python-env.sh: grpcio-tools, pytest)");
    let root = sandbolt_testbed::workspace_root();
    let bed = start_bed().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir.path(), TOKEN);
    cfg.default_consistency = Consistency::Fast;
    cfg.heartbeat_interval = Duration::from_millis(200);
    cfg.failpoint = None;
    let h = Controller::start(cfg).await.unwrap();
    let state = tempfile::tempdir().unwrap();
    let agent = start_agent(
        &bed,
        "agent-py",
        state.path(),
        h.local_addr(),
        TOKEN,
        16,
        Duration::from_millis(200),
    )
    .await;
    wait_agents(
        &V2::connect(format!("http://{}", h.local_addr()))
            .await
            .unwrap(),
        1,
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
        stdout.contains(&format!("{PY_TESTS} passed")),
        "expected {PY_TESTS} contract tests to pass:\n{stdout}"
    );
    h.shutdown().await;
    agent.shutdown().await;
}
