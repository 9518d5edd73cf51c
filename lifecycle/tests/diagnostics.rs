//! The OpenSandbox diagnostics routes through the official Python SDK on
//! both backends: the Docker engine of the test bed, and the real
//! controller with a real agent on the test bed's containerd (the log is
//! the file the agent's task writes, read over `ReadSandboxLog`).

use crate::common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diagnostics_on_docker() {
    let env = common::docker_env();
    let handle = env.start().await;
    let suite = common::lifecycle_pytest(
        "diagnostics_sdk_test.py",
        handle.addr(),
        &env.image,
        "docker",
    )
    .await;
    handle.shutdown().await.unwrap();
    common::rethrow(suite);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diagnostics_on_controller() {
    common::controller_env(4)
        .await
        .run_sdk_suite("diagnostics_sdk_test.py")
        .await;
}
