//! The OCI runtime version check (`crate::runtime_check`): a runc with an
//! unmitigated known container escape stops the agent's start, naming the
//! CVE; `--runtime-check warn` starts anyway and records the finding; this
//! host's runc (Debian's 1.1.5+ds1-1+deb12u1) passes.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::*;
use sandbolt_agent::runtime::{ProbeOptions, probe_with};
use sandbolt_agent::runtime_check::{Mitigation, RuntimeCheckMode};
use sandbolt_agent::{Agent, AgentConfig};

/// A `runc` that only answers `--version` with `output`.
fn fake_runc(dir: &Path, output: &str) -> PathBuf {
    let path = dir.join("runc");
    std::fs::write(&path, format!("#!/bin/sh\ncat <<'END'\n{output}\nEND\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

const OLD_RUNC: &str = "runc version 1.1.11\ncommit: v1.1.11-0-g4bccb38c\nspec: 1.0.2-dev";

/// An agent configuration whose containerd does not exist: the check runs
/// before the agent connects, so a refusal needs no containerd.
fn config_without_containerd(state: &Path, runc: PathBuf) -> AgentConfig {
    let execd = sandbolt_testbed::execd_binary().expect("static execd binary");
    let mut cfg = AgentConfig::new(
        "agent-check",
        state.join("no-containerd.sock"),
        execd,
        state,
        TOKEN,
    );
    cfg.runtime_binaries = vec![("runc".into(), runc)];
    cfg
}

#[tokio::test(flavor = "multi_thread")]
async fn an_old_runc_stops_the_start_naming_the_cve() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let runc = fake_runc(dir.path(), OLD_RUNC);
    let err = match Agent::start(config_without_containerd(dir.path(), runc)).await {
        Ok(_) => panic!("an agent whose default runtime is runc 1.1.11 must not start"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("CVE-2024-21626"), "{err}");
    assert!(err.contains("1.1.11"), "{err}");
    assert!(err.contains("--runtime-check warn"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runtime_whose_version_cannot_be_read_is_refused() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let runc = fake_runc(dir.path(), "something else entirely");
    let err = match Agent::start(config_without_containerd(dir.path(), runc)).await {
        Ok(_) => panic!("an unreadable runc version must stop the start"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("cannot be checked"), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn with_warn_an_old_runc_starts_and_the_finding_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let runc = fake_runc(dir.path(), OLD_RUNC);
    let env = Env::start_with(move |cfg| {
        cfg.runtime_binaries = vec![("runc".into(), runc)];
        cfg.runtime_check = RuntimeCheckMode::Warn;
    })
    .await;
    let runtimes = env.agent().sandboxes().runtimes();
    let runc = runtimes.iter().find(|r| r.name == "runc").unwrap();
    assert!(runc.available, "{runc:?}");
    assert!(
        runc.findings
            .iter()
            .any(|f| f.cve == "CVE-2024-21626" && f.mitigation == Mitigation::None),
        "{runc:?}"
    );
    env.shutdown().await;
}

#[test]
fn this_hosts_runc_passes_and_user_namespaces_close_the_2025_races() {
    init_tracing();
    let probe = |user_namespaces| {
        probe_with(&ProbeOptions {
            user_namespaces,
            ..Default::default()
        })
        .into_iter()
        .find(|r| r.name == "runc")
        .unwrap()
    };
    let off = probe(false);
    assert!(off.available, "{off:?}");
    assert!(
        off.findings
            .iter()
            .all(|f| f.mitigation != Mitigation::None),
        "{off:?}"
    );
    let on = probe(true);
    assert!(on.available, "{on:?}");
    assert!(
        on.findings.iter().all(|f| f.mitigation == Mitigation::Full),
        "{on:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_old_runc_that_is_not_the_default_is_unavailable_naming_the_cve() {
    let dir = tempfile::tempdir().unwrap();
    let runc = fake_runc(dir.path(), OLD_RUNC);
    // The default runtime is another one (crun, whatever its state here):
    // the agent starts, and runc is refused per request.
    let mut env = Env::start_with(move |cfg| {
        cfg.runtime_binaries = vec![("runc".into(), runc)];
        cfg.default_runtime = "crun".into();
    })
    .await;
    let runtimes = env.agent().sandboxes().runtimes();
    let runc = runtimes.iter().find(|r| r.name == "runc").unwrap();
    assert!(!runc.available, "{runc:?}");
    assert!(runc.reason.contains("CVE-2024-21626"), "{runc:?}");
    let mut s = spec("sb-old-runc", &["sleep", "100"]);
    s.runtime = "runc".into();
    let err = env.create(s).await.expect_err("runc 1.1.11 is refused");
    assert!(err.message().contains("CVE-2024-21626"), "{err:?}");
    env.shutdown().await;
}
