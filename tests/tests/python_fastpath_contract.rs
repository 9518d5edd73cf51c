//! Wire compatibility: Python clients generated with grpcio-tools from the
//! contract protos (`tests/python/fastpath_contract.py`) drive FastPath v1
//! and v2 against the controller, which places on a real agent on the test
//! bed (private containerd, busybox, static execd as PID 1). The Python side
//! also reaches execd's `/ping` through the agent's data-plane proxy with
//! `urllib`, from what ResolveEndpoint returned.

use std::process::Command;
use std::time::Duration;

use sandbolt_agent::Agent;
use sandbolt_controller::{Consistency, Controller, ControllerConfig};
use sandbolt_e2e::bed::{
    V2, agent_config, start_bed, test_network, wait_agents, with_network_state,
};

const TOKEN: &str = "python-contract-agent-token";
/// Number of `test_*` functions in fastpath_contract.py; all must pass.
const PY_TESTS: usize = 7;

#[test]
fn python_grpcio_clients_from_contract_protos() {
    with_network_state(python_grpcio_clients_from_contract_protos_in);
}

/// The agent runs with networking: the egress action binding is enforced
/// (an agent without it refuses a policy, as it must).
async fn python_grpcio_clients_from_contract_protos_in(state: std::path::PathBuf) {
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
    let mut agent_cfg = agent_config(&bed, "agent-py", &state, h.local_addr(), TOKEN);
    agent_cfg.max_sandboxes = 16;
    agent_cfg.heartbeat_interval = Duration::from_millis(200);
    // No names are resolved by these tests.
    agent_cfg.network = Some(test_network("127.0.0.1:9".parse().unwrap()));
    let agent = Agent::start(agent_cfg).await.expect("agent starts");
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
