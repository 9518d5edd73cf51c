//! Warm images: the agent keeps its pool's images present, pulling a
//! missing one in the background from a real registry (the test bed's
//! [`LocalRegistry`], over plain HTTP) with containerd's own `ctr`, without
//! delaying start-up or creates, and a sandbox of a warm image then starts
//! without another pull.

use crate::common;

use std::time::Duration;

use common::*;
use sandbolt_agent::images::CRI_PINNED_LABEL;
use sandbolt_agent::{Agent, AgentError};
use sandbolt_proto::agent::v1::SandboxPhase;
use sandbolt_testbed::{LocalRegistry, OciImage};

/// Longer than anything below may take when it works, far shorter than the
/// pull timeout: an `Agent::start` that waited for the held pull fails here.
const START_LIMIT: Duration = Duration::from_secs(120);
const WARM: &str = "warm/busybox:1";

/// An image the bed has not imported (its layer differs from busybox's):
/// containerd skips content it already has, so only such an image makes
/// the pull fetch blobs.
fn warm_image() -> OciImage {
    OciImage::builder("warm/busybox:1")
        .file("/bin/busybox", "/bin/busybox", 0o755)
        .symlink("/bin/sh", "/bin/busybox")
        .symlink("/bin/sleep", "/bin/busybox")
        .bytes("/etc/warm", "kept warm\n", 0o644)
        .dir("/proc")
        .dir("/sys")
        .dir("/dev")
        .dir("/tmp")
        .cmd(["sh"])
        .build()
        .expect("warm image")
}

async fn inventory_has(env: &Env, reference: &str) -> bool {
    env.agent()
        .inventory()
        .await
        .expect("inventory")
        .images
        .iter()
        .any(|i| i.references.iter().any(|r| r == reference))
}

/// The `ctr images list` line of `reference`, if it is in the store.
fn image_line(env: &Env, reference: &str) -> Option<String> {
    env.ctr(&["images", "list"])
        .lines()
        .find(|l| l.split_whitespace().next() == Some(reference))
        .map(str::to_string)
}

async fn create_running(env: &mut Env, id: &str, image: &str) {
    let mut s = spec(id, &["sleep", "1000"]);
    s.image = image.into();
    let status = env
        .client
        .create_sandbox(create_req(s))
        .await
        .unwrap_or_else(|e| panic!("create {id} from {image}: {e:?}"))
        .into_inner()
        .status
        .unwrap();
    assert_eq!(status.phase(), SandboxPhase::Running, "{status:?}");
}

fn manifest_requests(registry: &LocalRegistry) -> usize {
    registry
        .request_log()
        .iter()
        .filter(|l| l.contains("/manifests/"))
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_warm_image_is_pulled_in_the_background_and_then_needs_no_pull() {
    let image = warm_image();
    let registry = LocalRegistry::serve(&[(WARM, &image)]).unwrap();
    let warm = registry.reference(WARM);
    // Every registry request waits until released: the warm pull cannot
    // finish before the test says so.
    registry.hold();
    let (w, host) = (warm.clone(), registry.host());
    let mut env = tokio::time::timeout(
        START_LIMIT,
        Env::start_with(move |cfg| {
            cfg.warm_images = vec![w];
            cfg.plain_http_registries = vec![host];
            cfg.pull_timeout = Duration::from_secs(600);
            cfg.warm_recheck_interval = Duration::from_millis(500);
        }),
    )
    .await
    .expect("the agent starts while its warm image's pull is held");

    // The pull is under way (its first request waits in the registry) ...
    eventually("the warm pull's first request", WAIT, || {
        (registry.requests() > 0).then_some(())
    })
    .await;
    assert!(!inventory_has(&env, &warm).await);
    // ... and a create of another image does not wait for it.
    create_running(&mut env, "sb-other", "busybox").await;
    assert!(
        image_line(&env, &warm).is_none(),
        "the warm pull was still held, yet the image is here"
    );

    registry.release();
    eventually_async("the warm image in the inventory", WAIT, || async {
        inventory_has(&env, &warm).await.then_some(())
    })
    .await;
    let log = registry.request_log();
    assert!(
        log.contains(&format!("GET /v2/warm/busybox/blobs/{}", image.diff_id())),
        "the layer came from the registry: {log:?}"
    );
    // Pinned against the kubelet's image GC.
    let line = eventually("the warm image pinned", WAIT, || {
        image_line(&env, &warm).filter(|l| l.contains(&format!("{CRI_PINNED_LABEL}=pinned")))
    })
    .await;
    assert!(line.contains(&warm), "{line}");

    // A sandbox of the warm image: no request reaches the registry.
    let before = registry.requests();
    create_running(&mut env, "sb-warm", &warm).await;
    assert_eq!(
        registry.requests(),
        before,
        "a create of a warm image pulled again: {:?}",
        registry.request_log()
    );

    // Kept warm: removed behind the agent's back, it comes back.
    env.ctr(&["images", "rm", &warm]);
    eventually("the removed warm image pulled again", WAIT, || {
        (registry.requests() > before)
            .then(|| image_line(&env, &warm))
            .flatten()
    })
    .await;

    env.delete_leaving_nothing("sb-other", 500).await;
    env.delete_leaving_nothing("sb-warm", 500).await;
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_warm_pull_that_times_out_is_retried() {
    let image = warm_image();
    let registry = LocalRegistry::serve(&[(WARM, &image)]).unwrap();
    let warm = registry.reference(WARM);
    registry.hold();
    let (w, host) = (warm.clone(), registry.host());
    let env = Env::start_with(move |cfg| {
        cfg.warm_images = vec![w];
        cfg.plain_http_registries = vec![host];
        cfg.pull_timeout = Duration::from_secs(2);
    })
    .await;
    // Pulls of one image never overlap, so a second resolve request means
    // the first `ctr` was stopped at the timeout and the pull retried.
    eventually("a retried warm pull", WAIT, || {
        (manifest_requests(&registry) >= 2).then_some(())
    })
    .await;
    assert!(!inventory_has(&env, &warm).await);
    registry.release();
    eventually_async("the warm image after the retry", WAIT, || async {
        inventory_has(&env, &warm).await.then_some(())
    })
    .await;
    env.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unreachable_warm_registry_stops_neither_start_nor_other_creates() {
    // A port nothing listens on: every pull is refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let host = format!("127.0.0.1:{port}");
    let unreachable = format!("{host}/nothing/here:1");
    let u = unreachable.clone();
    let mut env = Env::start_with(move |cfg| {
        // busybox is here already: kept (and pinned) without a pull.
        cfg.warm_images = vec![u, "busybox".into()];
        cfg.plain_http_registries = vec![host];
        cfg.pull_timeout = Duration::from_secs(5);
    })
    .await;

    create_running(&mut env, "sb-despite-a", "busybox").await;
    assert!(!inventory_has(&env, &unreachable).await);
    eventually("the present warm image pinned", WAIT, || {
        image_line(&env, "docker.io/library/busybox:latest")
            .filter(|l| l.contains(&format!("{CRI_PINNED_LABEL}=pinned")))
    })
    .await;
    // Still serving, still not there.
    create_running(&mut env, "sb-despite-b", "busybox").await;
    assert!(image_line(&env, &unreachable).is_none());

    // An unparsable warm image is a configuration mistake, refused at start.
    let state = tempfile::tempdir().unwrap();
    let mut cfg = config(&env.bed, state.path(), "agent-bad-warm");
    cfg.warm_images = vec!["sha256:not-a-digest".into()];
    match Agent::start(cfg).await {
        Err(AgentError::InvalidArgument(msg)) => assert!(msg.contains("warm image"), "{msg}"),
        Err(e) => panic!("expected InvalidArgument, got {e}"),
        Ok(_) => panic!("an agent with an unparsable warm image started"),
    }

    env.delete_leaving_nothing("sb-despite-a", 500).await;
    env.delete_leaving_nothing("sb-despite-b", 500).await;
    env.shutdown().await;
}
