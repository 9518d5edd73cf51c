//! The official OpenSandbox Python SDK 1.1.1, end to end, against the
//! lifecycle server on the controller backend: the real sandbolt controller
//! (its native control API) and a real agent on the test bed's private
//! containerd.

use crate::common;

/// Runs one pytest file against a lifecycle over a fresh controller and
/// agent; `host_root` passes the agent's allowed host-path root to the suite
/// and gives the agent a volume root (loop-backed btrfs) for `pvc` volumes.
async fn suite_on_controller(file: &'static str, host_root: bool) {
    let env = if host_root {
        common::controller_env_with_volumes(16).await
    } else {
        common::controller_env(16).await
    };
    let data = tempfile::tempdir().unwrap();
    let lifecycle = env.lifecycle(data.path()).await;
    let root = host_root.then(|| env.host_root.path().to_path_buf());
    common::pytest(file, lifecycle.addr(), &env.image, "controller", root).await;
    lifecycle.shutdown().await.unwrap();
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_suite_on_controller() {
    suite_on_controller("lifecycle_sdk_test.py", false).await;
}

/// The volume suite: host volumes reach the agent, which checks them
/// against its own allowlist on the node (`SANDBOLT_HOST_ROOT` is that
/// allowlist's root); a `pvc` is a named volume on the agent's volume root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_on_controller() {
    suite_on_controller("lifecycle_volumes_test.py", true).await;
}

/// Egress policy through the SDK (its egress-sidecar endpoint, served by
/// the lifecycle) and the `networkpolicy` routes, on an agent that
/// networks its sandboxes, so every policy is enforced on the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_policy_on_controller() {
    let env = common::controller_env_with(16, true).await;
    let data = tempfile::tempdir().unwrap();
    let lifecycle = env.lifecycle(data.path()).await;
    let (addr, image) = (lifecycle.addr(), env.image.clone());
    let suite = tokio::task::spawn_blocking(move || {
        let zone = common::dns_zone_env();
        common::run_pytest_env(
            "egress_sdk_test.py",
            addr,
            &image,
            "controller",
            None,
            &[("SANDBOLT_DNS_ZONE", &zone)],
        )
    })
    .await;
    let dns = env.dns.as_ref().expect("a networked agent has an upstream");
    let (allowed, denied, seen) = (
        dns.queries_for("pkgs.test"),
        dns.queries_for("other.test"),
        dns.seen(),
    );
    // A networked agent leaves veths, namespaces and nftables rules behind
    // unless it is shut down: stop everything before any verdict.
    lifecycle.shutdown().await.unwrap();
    env.stop().await;
    if let Err(panic) = suite {
        std::panic::resume_unwind(panic.into_panic());
    }
    assert!(
        allowed > 0,
        "the allowed name never reached the upstream: {seen:?}"
    );
    // A name the policy denies is answered on the node, never forwarded.
    assert_eq!(denied, 0, "{seen:?}");
}
