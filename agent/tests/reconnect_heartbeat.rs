//! containerd restarts under a running agent (reconnect with backoff, missed
//! exits reconciled), and heartbeats pushed to a controller's
//! RegistryService.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use parking_lot::Mutex;
use sandbolt_proto::agent::v1::registry_service_server::{RegistryService, RegistryServiceServer};
use sandbolt_proto::agent::v1::{
    DeleteSandboxRequest, EnrollRequest, EnrollResponse, GetOwnershipRequest, GetOwnershipResponse,
    HeartbeatRequest, HeartbeatResponse, Inventory, ReportReapedRequest, ReportReapedResponse,
    SandboxPhase,
};
use tonic::{Request, Response, Status};

/// pid of the containerd serving `config` (the test bed's), from /proc.
fn containerd_pid(config: &std::path::Path) -> Option<i32> {
    let needle = config.to_string_lossy().to_string();
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        (cmd.starts_with("containerd ") && cmd.contains(&needle)).then_some(pid)
    })
}

/// Kills the replacement containerd this test started.
struct Daemon(Child);
impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn agent_survives_a_containerd_restart() {
    let mut env = Env::start().await;
    env.client
        .create_sandbox(create_req(spec("sb-steady", &["sleep", "1000"])))
        .await
        .unwrap();
    let dies_pid = env
        .client
        .create_sandbox(create_req(spec(
            "sb-dies",
            &["sh", "-c", "sleep 2; exit 7"],
        )))
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap()
        .pid;

    // Stop the bed's containerd (the shims keep the sandboxes running) ...
    let config = env.bed.root().join("containerd/config.toml");
    let pid = containerd_pid(&config).expect("the test bed's containerd");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGTERM).unwrap();
    eventually("containerd to stop", WAIT, || {
        containerd_pid(&config).is_none().then_some(())
    })
    .await;
    // ... until sb-dies has exited while nobody could report it.
    eventually("sb-dies to exit", WAIT, || {
        process_gone(dies_pid).then_some(())
    })
    .await;
    let err = env
        .client
        .delete_sandbox(DeleteSandboxRequest {
            sandbox_id: "sb-nothing".into(),
            grace_period_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");

    // Same config, same root and state: a restarted containerd.
    let restarted = Daemon(
        Command::new("containerd")
            .arg("--config")
            .arg(&config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

    // The agent reconnects by itself and re-reads the tasks.
    let mut c = env.client.clone();
    let dies = wait_for_phase(&c, "sb-dies", SandboxPhase::Failed).await;
    assert_eq!(dies.exit_code, 7);
    let steady = wait_for_phase(&c, "sb-steady", SandboxPhase::Running).await;
    assert!(steady.pid > 0);
    for id in ["sb-steady", "sb-dies"] {
        let existed = delete(&mut c, id, 200).await;
        assert!(existed);
        assert_eq!(leftovers(&env, id), Vec::<String>::new());
    }
    // New sandboxes work too.
    env.client
        .create_sandbox(create_req(spec("sb-after", &["sleep", "1000"])))
        .await
        .expect("create after reconnect");
    env.delete_leaving_nothing("sb-after", 0).await;
    // The agent and the replacement daemon stop before the bed is torn down.
    if let Some(a) = env.agent.take() {
        a.shutdown().await;
    }
    drop(restarted);
    env.shutdown().await;
}

/// A controller stand-in: the real RegistryService wire API, recording what
/// arrives.
/// (authorization header, inventory) of every heartbeat received.
type Received = Arc<Mutex<Vec<(Option<String>, Inventory)>>>;

#[derive(Default, Clone)]
struct Registry {
    got: Received,
}

#[tonic::async_trait]
impl RegistryService for Registry {
    async fn heartbeat(
        &self,
        request: Request<HeartbeatRequest>,
    ) -> Result<Response<HeartbeatResponse>, Status> {
        let auth = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(String::from);
        let inv = request.into_inner().inventory.unwrap_or_default();
        self.got.lock().push((auth, inv));
        Ok(Response::new(HeartbeatResponse {
            interval_ms: 100,
            ..Default::default()
        }))
    }

    async fn report_reaped(
        &self,
        _request: Request<ReportReapedRequest>,
    ) -> Result<Response<ReportReapedResponse>, Status> {
        Ok(Response::new(ReportReapedResponse {}))
    }

    async fn get_ownership(
        &self,
        _request: Request<GetOwnershipRequest>,
    ) -> Result<Response<GetOwnershipResponse>, Status> {
        Err(Status::unimplemented("not part of this test"))
    }

    /// Grants a credential only for the bootstrap token.
    async fn enroll(
        &self,
        request: Request<EnrollRequest>,
    ) -> Result<Response<EnrollResponse>, Status> {
        let auth = request.metadata().get("authorization").cloned();
        if auth.as_ref().and_then(|v| v.to_str().ok()) != Some("Bearer ctrl-token") {
            return Err(Status::unauthenticated("enroll takes the bootstrap token"));
        }
        Ok(Response::new(EnrollResponse {
            credential: format!("cred-{}", request.into_inner().agent_id),
        }))
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn heartbeats_push_the_inventory_with_the_enrolled_credential() {
    let registry = Registry::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistryServiceServer::new(registry.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let mut env = Env::start_with(|cfg| {
        cfg.controller_endpoint = Some(format!("http://{addr}"));
        cfg.controller_token = Some("ctrl-token".into());
        // Long on purpose: the controller's answer (100 ms) must win.
        cfg.heartbeat_interval = Duration::from_secs(3600);
        cfg.pool = "pool-a".into();
    })
    .await;
    env.client
        .create_sandbox(create_req(spec("sb-hb", &["sleep", "1000"])))
        .await
        .unwrap();
    let got = registry.got.clone();
    let (auth, inv) = eventually("a heartbeat listing sb-hb running", WAIT, || {
        got.lock()
            .iter()
            .find(|(_, inv)| {
                inv.sandboxes
                    .iter()
                    .any(|s| s.sandbox_id == "sb-hb" && s.phase() == SandboxPhase::Running)
            })
            .cloned()
    })
    .await;
    // Heartbeats carry the enrolled credential, never the bootstrap token.
    assert_eq!(auth.as_deref(), Some("Bearer cred-agent-test"));
    assert_eq!(inv.agent_id, "agent-test");
    assert_eq!(inv.pool, "pool-a");
    assert_eq!(inv.api_endpoint, env.agent().grpc_addr().to_string());
    assert_eq!(inv.proxy_endpoint, env.agent().proxy_addr().to_string());
    assert_eq!(inv.instance_id, env.agent().instance_id());
    let sb = inv
        .sandboxes
        .iter()
        .find(|s| s.sandbox_id == "sb-hb")
        .unwrap();
    assert!(sb.pid > 0 && sb.agent_id == "agent-test", "{sb:?}");
    assert!(inv.images.iter().any(|i| {
        i.references
            .contains(&"docker.io/library/busybox:latest".to_string())
    }));
    assert!(
        got.lock().len() >= 2,
        "the 100 ms interval from the answer is used"
    );
    delete(&mut env.client, "sb-hb", 0).await;
    env.shutdown().await;
    server.abort();
}
