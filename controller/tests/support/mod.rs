//! Pieces the controller's test targets share: the controller configuration
//! for stand-in agents, the request builders every target writes the same
//! way, and the assertions on refusals. Each target uses a part of them.

#![allow(dead_code)]

pub mod kube_bed;
pub mod standin;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbolt_controller::ControllerConfig;
use sandbolt_controller::registry::{AgentPresence, AgentWhereabouts, Presence};
use sandbolt_proto::control::v1 as native;
use tonic::Code;

/// The stand-in agents' heartbeat interval (and the controller's).
pub const HB: Duration = Duration::from_millis(100);

/// A controller on a free port keeping its records in `dir`, for stand-in
/// agents: short heartbeats so a silent agent is lost within 600 ms.
pub fn standin_config(dir: &Path) -> ControllerConfig {
    let mut c = ControllerConfig::new("127.0.0.1:0".parse().unwrap(), dir, standin::AGENT_TOKEN);
    c.heartbeat_interval = HB;
    c.lost_agent_timeout = Duration::from_millis(600);
    c.startup_grace = Duration::from_secs(3);
    c.create_deadline = Duration::from_secs(10);
    c.failpoint = None;
    c
}

/// [`standin_config`] where every silent agent's node is deleted
/// ([`NodeDeleted`]) after 800 ms, so AUTO_RECREATE sandboxes move.
pub fn node_deleted_config(dir: &Path) -> ControllerConfig {
    let mut cfg = standin_config(dir);
    cfg.agent_presence = Some(Arc::new(NodeDeleted));
    cfg.agent_gone_timeout = Duration::from_millis(800);
    cfg.default_recovery_timeout = Duration::from_secs(30);
    cfg
}

/// Says every silent agent is gone (its node was deleted).
#[derive(Debug)]
pub struct NodeDeleted;

#[async_trait::async_trait]
impl AgentPresence for NodeDeleted {
    async fn check(&self, _: &AgentWhereabouts) -> sandbolt_controller::Result<Presence> {
        Ok(Presence::Gone("test: node deleted".into()))
    }
}

/// The sandbox `name` in the default namespace, any uid.
pub fn sref(name: &str) -> Option<native::SandboxRef> {
    Some(native::SandboxRef {
        namespace: String::new(),
        name: name.into(),
        expected_uid: String::new(),
    })
}

/// A create of `name` from busybox mounting `volumes`, `name` also being
/// its request id.
pub fn sandbox_request(name: &str, volumes: Vec<native::Volume>) -> native::CreateSandboxRequest {
    native::CreateSandboxRequest {
        request_id: name.into(),
        name: name.into(),
        spec: Some(native::SandboxSpec {
            image: "busybox".into(),
            volumes,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// `q` with its spec changed by `f`.
pub fn with_spec(
    mut q: native::CreateSandboxRequest,
    f: impl FnOnce(&mut native::SandboxSpec),
) -> native::CreateSandboxRequest {
    f(q.spec.as_mut().unwrap());
    q
}

/// A volume entry `<claim>-entry` mounting the named volume `claim` at
/// `mount`, its claim changed by `f`.
pub fn pvc(claim: &str, mount: &str, f: impl FnOnce(&mut native::PvcSource)) -> native::Volume {
    let mut p = native::PvcSource {
        claim_name: claim.into(),
        ..Default::default()
    };
    f(&mut p);
    native::Volume {
        name: format!("{claim}-entry"),
        source: Some(native::volume::Source::Pvc(p)),
        mount_path: mount.into(),
        ..Default::default()
    }
}

/// `r` failed with `code`, its message naming each of `says`.
pub fn assert_code<T: std::fmt::Debug>(r: Result<T, tonic::Status>, code: Code, says: &[&str]) {
    let e = r.expect_err("the call must fail");
    assert_eq!(e.code(), code, "{}", e.message());
    for s in says {
        assert!(
            e.message().contains(s),
            "{:?} should say {s:?}",
            e.message()
        );
    }
}

/// Polls `f` every 50 ms until it holds; fails the test after 15 s.
pub async fn eventually(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The code and message of the refusal `r` must be.
pub fn code<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) -> (Code, String) {
    let e = r.expect_err("the call must fail");
    (e.code(), e.message().to_string())
}
