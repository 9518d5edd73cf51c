//! The official OpenSandbox Python SDK 1.1.1, end to end, against the
//! lifecycle server on the controller backend: the real sandbolt controller
//! (its native control API) and a real agent on the test bed's private
//! containerd.

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_suite_on_controller() {
    let env = common::controller_env(16).await;
    let data = tempfile::tempdir().unwrap();
    let lifecycle = env.lifecycle(data.path()).await;
    let addr = lifecycle.addr();
    let image = env.image.clone();
    tokio::task::spawn_blocking(move || {
        common::run_pytest("lifecycle_sdk_test.py", addr, &image, "controller", None)
    })
    .await
    .unwrap();
    lifecycle.shutdown().await.unwrap();
    env.stop().await;
}

/// The volume suite: host volumes reach the agent, which checks them
/// against its own allowlist on the node (`SANDBOLT_HOST_ROOT` is that
/// allowlist's root).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_on_controller() {
    let env = common::controller_env(16).await;
    let data = tempfile::tempdir().unwrap();
    let lifecycle = env.lifecycle(data.path()).await;
    let addr = lifecycle.addr();
    let image = env.image.clone();
    let root = env.host_root.path().to_path_buf();
    tokio::task::spawn_blocking(move || {
        common::run_pytest(
            "lifecycle_volumes_test.py",
            addr,
            &image,
            "controller",
            Some(&root),
        )
    })
    .await
    .unwrap();
    lifecycle.shutdown().await.unwrap();
    env.stop().await;
}
