//! The official OpenSandbox Python SDK 1.1.1, end to end, against the
//! lifecycle server on the Docker backend (test bed's private dockerd).

mod common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_suite_on_docker() {
    let env = common::docker_env();
    let handle = env.start().await;
    let addr = handle.addr();
    let image = env.image.clone();
    tokio::task::spawn_blocking(move || {
        common::run_pytest("lifecycle_sdk_test.py", addr, &image, "docker", None)
    })
    .await
    .unwrap();
    handle.shutdown().await.unwrap();
}

/// The same limits test the containerd fast path passes (`cli/tests/up_e2e.rs`),
/// through the SDK: the cgroup shows them, a 200 MiB allocation is
/// OOM-killed inside the sandbox, a CPU burner gets about its quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_on_docker() {
    let env = common::docker_env();
    let handle = env.start().await;
    let addr = handle.addr();
    let image = env.image.clone();
    tokio::task::spawn_blocking(move || {
        common::run_pytest("limits_sdk_test.py", addr, &image, "docker", None)
    })
    .await
    .unwrap();
    handle.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_on_docker() {
    let env = common::docker_env();
    let handle = env.start().await;
    let addr = handle.addr();
    let image = env.image.clone();
    let root = env.host_root.path().to_path_buf();
    tokio::task::spawn_blocking(move || {
        common::run_pytest(
            "lifecycle_volumes_test.py",
            addr,
            &image,
            "docker",
            Some(&root),
        )
    })
    .await
    .unwrap();
    handle.shutdown().await.unwrap();
}
