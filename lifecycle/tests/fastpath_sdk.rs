//! The official OpenSandbox Python SDK 1.1.1, end to end, against the
//! lifecycle server on the fast-path backend: the real sandbolt controller
//! (FastPath v2) and a real agent on the test bed's private containerd.

mod common;

use std::time::Duration;

use sandbolt_agent::{Agent, AgentConfig};
use sandbolt_controller::{Controller, ControllerConfig};
use sandbolt_lifecycle::{BackendConfig, FastPathConfig, Lifecycle, LifecycleConfig};
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};

const AGENT_TOKEN: &str = "agent-token-for-tests";
const FASTPATH_TOKEN: &str = "fastpath-token-for-tests";
/// The FastPath namespace the test agent's pool serves (`default`, as in
/// `sandbolt up`), distinct from its containerd namespace (`k8s.io`).
const POOL_NAMESPACE: &str = "default";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_suite_on_fastpath() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,sandbolt_lifecycle=info".into()),
        )
        .with_test_writer()
        .try_init();
    let bed = Testbed::start().expect("test bed (private containerd) must start");
    let image = busybox_image().expect("busybox image builds");
    bed.import_image(&image, "k8s.io").expect("busybox imports");
    let dirs = tempfile::tempdir().unwrap();

    let mut ccfg = ControllerConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        dirs.path().join("controller"),
        AGENT_TOKEN,
    );
    ccfg.fastpath_token = Some(FASTPATH_TOKEN.into());
    ccfg.heartbeat_interval = Duration::from_millis(200);
    let controller = Controller::start(ccfg).await.expect("controller starts");
    let caddr = controller.local_addr();

    let mut acfg = AgentConfig::new(
        "agent-1",
        bed.containerd_socket(),
        execd_binary().expect("static execd"),
        dirs.path().join("agent"),
        AGENT_TOKEN,
    );
    acfg.controller_endpoint = Some(format!("http://{caddr}"));
    acfg.controller_token = Some(AGENT_TOKEN.into());
    acfg.heartbeat_interval = Duration::from_millis(200);
    acfg.stop_grace_period = Duration::from_secs(2);
    let agent = Agent::start(acfg).await.expect("agent starts");
    assert!(
        controller.wait_ready(Duration::from_secs(30)).await,
        "controller never became ready"
    );
    wait_for_agent(caddr).await;

    let mut fp = FastPathConfig::new(format!("http://{caddr}"));
    fp.token = Some(FASTPATH_TOKEN.into());
    fp.namespace = POOL_NAMESPACE.into();
    let mut lcfg = LifecycleConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        BackendConfig::FastPath(fp),
        dirs.path().join("lifecycle"),
    );
    lcfg.api_key = Some(common::API_KEY.into());
    let lifecycle = Lifecycle::start(lcfg)
        .await
        .expect("lifecycle starts on fast path");
    let addr = lifecycle.addr();
    let reference = image.reference().to_string();
    tokio::task::spawn_blocking(move || {
        common::run_pytest("lifecycle_sdk_test.py", addr, &reference, "fastpath", None)
    })
    .await
    .unwrap();

    lifecycle.shutdown().await.unwrap();
    agent.shutdown().await;
    controller.shutdown().await;
}

/// Waits until the agent's heartbeat has made it a live member of the
/// default pool (asked over FastPath v2's GetPool, as any client would).
async fn wait_for_agent(caddr: std::net::SocketAddr) {
    use sandbolt_proto::fastpath::v2 as fp;
    let mut client =
        fp::fast_path_service_client::FastPathServiceClient::connect(format!("http://{caddr}"))
            .await
            .expect("controller answers gRPC");
    let mut last = String::new();
    for _ in 0..150 {
        let mut req = tonic::Request::new(fp::GetPoolRequest {
            namespace: POOL_NAMESPACE.into(),
            pool_name: "default".into(),
        });
        req.metadata_mut().insert(
            "authorization",
            format!("Bearer {FASTPATH_TOKEN}").parse().unwrap(),
        );
        match client.get_pool(req).await {
            Ok(pool) if pool.get_ref().ready_fastlets > 0 => return,
            other => last = format!("{other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the agent never joined the default pool: {last}");
}
