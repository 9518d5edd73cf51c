//! An ephemeral-storage limit through the whole fast path: a native create
//! with `resources.limits.ephemeral_storage` on a real controller and a real
//! agent on the test bed's containerd. The record keeps the limit, the
//! agent measures the writable layer, and a sandbox that writes past it is
//! stopped: the controller reports it Failed with the agent's reason.

use std::time::Duration;

use sandbolt_agent::Agent;
use sandbolt_controller::{Controller, ControllerConfig};
use sandbolt_e2e::bed::{
    V2, agent_config, eventually, free_port, native_busybox_create, native_ref, start_bed,
    wait_agents,
};
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::control::v1::sandbox_service_client::SandboxServiceClient;

const TOKEN: &str = "ephemeral-storage-token";

fn limited(name: &str, script: &str) -> native::CreateSandboxRequest {
    let mut req = native_busybox_create(
        name,
        native::SandboxSpec {
            resources: Some(native::Resources {
                limits: Some(native::ResourceList {
                    ephemeral_storage: "20Mi".into(),
                    ..Default::default()
                }),
                requests: None,
            }),
            ..Default::default()
        },
    );
    // The helper's command is a plain sleep; this one fills the disk.
    if let Some(spec) = req.spec.as_mut() {
        spec.command = vec!["sh".into(), "-c".into(), script.into()];
    }
    req
}

type Client = SandboxServiceClient<tonic::transport::Channel>;

/// The controller's status of the test's sandbox.
async fn status(mut n: Client) -> native::SandboxStatus {
    n.get_sandbox(native::GetSandboxRequest {
        sandbox: native_ref("fills-its-disk"),
    })
    .await
    .unwrap()
    .into_inner()
    .status
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_over_its_ephemeral_storage_limit_is_failed_with_the_reason() {
    let bed = start_bed().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ControllerConfig::new(free_port(), dir.path().join("controller"), TOKEN);
    cfg.heartbeat_interval = Duration::from_millis(100);
    let controller = Controller::start(cfg).await.unwrap();
    let addr = controller.local_addr();
    let mut agent_cfg = agent_config(&bed, "agent-es", &dir.path().join("agent"), addr, TOKEN);
    agent_cfg.heartbeat_interval = Duration::from_millis(100);
    agent_cfg.log_check_interval = Duration::from_millis(200);
    let agent = Agent::start(agent_cfg).await.unwrap();
    let v2c = V2::connect(format!("http://{addr}")).await.unwrap();
    wait_agents(&v2c, 1).await;
    let mut n = SandboxServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();

    let created = n
        .create_sandbox(limited(
            "fills-its-disk",
            "sleep 1; dd if=/dev/zero of=/tmp/fill bs=1048576 count=50; sync; exec sleep 3600",
        ))
        .await
        .expect("a limit the agent enforces is accepted")
        .into_inner();
    let limits = created.spec.unwrap().resources.unwrap().limits.unwrap();
    assert_eq!(
        limits.ephemeral_storage, "20Mi",
        "the record keeps the limit"
    );

    eventually(
        "the sandbox over its limit Failed",
        Duration::from_secs(60),
        || {
            let n = n.clone();
            async move { status(n).await.phase() == native::Phase::Failed }
        },
    )
    .await;
    let s = status(n.clone()).await;
    assert!(
        s.message.starts_with("ephemeral storage ") && s.message.contains("over its 20Mi limit"),
        "{:?}",
        s.message
    );

    n.delete_sandbox(native::DeleteSandboxRequest {
        sandbox: native_ref("fills-its-disk"),
    })
    .await
    .unwrap();
    agent.shutdown().await;
    controller.shutdown().await;
}
