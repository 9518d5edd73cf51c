//! The official OpenSandbox Python SDK 1.1.1, end to end, against the
//! lifecycle server on the Docker backend (test bed's private dockerd).

use crate::common;

/// Runs one pytest file against a fresh lifecycle on the test bed's dockerd;
/// `host_root` passes the allowed host-path root to the suite.
async fn suite_on_docker(file: &'static str, host_root: bool) {
    let env = common::docker_env();
    let handle = env.start().await;
    let root = host_root.then(|| env.host_root.path().to_path_buf());
    common::pytest(file, handle.addr(), &env.image, "docker", root).await;
    handle.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_suite_on_docker() {
    suite_on_docker("lifecycle_sdk_test.py", false).await;
}

/// The same limits test the containerd fast path passes (`cli/tests/up_e2e.rs`),
/// through the SDK: the cgroup shows them, a 200 MiB allocation is
/// OOM-killed inside the sandbox, a CPU burner gets about its quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_on_docker() {
    suite_on_docker("limits_sdk_test.py", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_on_docker() {
    suite_on_docker("lifecycle_volumes_test.py", true).await;
}

/// Egress policy on Docker: GET answers allow-all (nothing is enforced), a
/// restricting change or create is a 400 the SDK raises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_policy_on_docker() {
    suite_on_docker("egress_sdk_test.py", false).await;
}
