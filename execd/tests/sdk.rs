//! The official `opensandbox` Python SDK (1.1.1, from the repository's venv) against a
//! local execd process: commands, background + logs + interrupt, sessions, files
//! (1 B, 20 KiB, 8 MiB byte-exact), directories, metrics.

use crate::common;

use std::process::Command;

use common::Execd;

fn script() -> std::path::PathBuf {
    sandbolt_testbed::workspace_root().join("tests/python/execd_sdk.py")
}

fn python() -> std::path::PathBuf {
    sandbolt_testbed::python().unwrap_or_else(|e| {
        panic!("the Python venv with the opensandbox SDK is required (scripts/python-env.sh): {e}")
    })
}

#[test]
fn official_python_sdk_against_local_execd() {
    let python = python();
    let root = tempfile::tempdir().unwrap();
    let env_file = root.path().join("envs/.env");
    let e = Execd::start(
        &["--access-token", "sdk-token"],
        &[("EXECD_ENVS", env_file.to_str().unwrap())],
    );
    let data = root.path().join("data");
    let out = Command::new(&python)
        .arg(script())
        .arg(&e.addr)
        .arg(&data)
        .args(["--token", "sdk-token", "--env-file"])
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "SDK checks failed:\n{stdout}");
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}
