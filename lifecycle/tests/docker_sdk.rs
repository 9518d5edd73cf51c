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

/// Egress policy on Docker, enforced: the same suite as on the controller
/// backend (names through the lifecycle's DNS proxy, whose upstream is a
/// test DNS server), plus connections to two test hosts in network
/// namespaces this test creates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_policy_on_docker() {
    use sandbolt_test_support::nethost::{DocRange, TestHost};
    let env = common::docker_env();
    let (near, far) = (
        TestHost::start(DocRange::TestNet2),
        TestHost::start(DocRange::TestNet3),
    );
    let mut zone = sandbolt_test_support::dns::StaticDns::builder()
        .a("near.test", [near.addr()])
        .a("far.test", [far.addr()]);
    for (name, a) in common::DNS_ZONE {
        zone = zone.a(name, [std::net::Ipv4Addr::from(*a)]);
    }
    let dns = zone.start();
    let mut config = env.config();
    if let sandbolt_lifecycle::BackendConfig::Docker(d) = &mut config.backend {
        d.dns_upstreams = vec![dns.addr()];
    }
    let handle = sandbolt_lifecycle::Lifecycle::start(config).await.unwrap();
    let (addr, image) = (handle.addr(), env.image.clone());
    let hosts = format!("near.test={},far.test={}", near.addr(), far.addr());
    let suite = tokio::task::spawn_blocking(move || {
        common::run_pytest_env(
            "egress_sdk_test.py",
            addr,
            &image,
            "docker",
            None,
            &[
                ("SANDBOLT_DNS_ZONE", &common::dns_zone_env()),
                ("SANDBOLT_TEST_HOSTS", &hosts),
            ],
        );
    })
    .await;
    handle.shutdown().await.unwrap();
    common::rethrow(suite);
}
