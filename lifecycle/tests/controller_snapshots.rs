//! Sandbox snapshots on the controller backend: a real controller and
//! agent on the test bed's containerd. The REST routes map onto the
//! controller's `SnapshotService` (a capture answers `Creating` and becomes
//! `Ready`), a create with `snapshotId` restores on the snapshot's node, a
//! delete while a restored sandbox lives answers 204 and leaves the
//! snapshot `Deleting` until that sandbox goes. Then the same through the
//! Python SDK.

use crate::common;

use std::time::Duration;

use common::{call, sh};
use reqwest::{Method as M, StatusCode};
use sandbolt_test_support::eventually_async;
use serde_json::{Value, json};

async fn get_snapshot(base: &str, id: &str) -> (StatusCode, Value) {
    call(M::GET, format!("{base}/v1/snapshots/{id}"), None).await
}

/// Polls the snapshot until its state is `want`.
async fn wait_state(base: &str, id: &str, want: &'static str) -> Value {
    eventually_async(
        &format!("snapshot {id} to be {want}"),
        Duration::from_secs(60),
        || async move {
            let (s, v) = get_snapshot(base, id).await;
            assert_eq!(s, StatusCode::OK, "{v}");
            assert_ne!(v["status"]["state"], "Failed", "{v}");
            (v["status"]["state"] == want).then_some(v)
        },
    )
    .await
}

async fn create(base: &str, body: Value) -> String {
    let (s, v) = call(M::POST, format!("{base}/v1/sandboxes"), Some(body)).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    v["id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_through_rest_on_the_controller() {
    let env = common::controller_env(8).await;
    let data = tempfile::tempdir().unwrap();
    let lifecycle = env.lifecycle(data.path()).await;
    let base = format!("http://{}", lifecycle.addr());
    let limits = json!({"cpu": "250m", "memory": "64Mi"});

    let a = create(
        &base,
        json!({"image": {"uri": env.image}, "entrypoint": ["sleep", "infinity"], "resourceLimits": limits, "metadata": {"team": "a"}}),
    )
    .await;
    sh(&base, &a, "mkdir -p /work && echo v1 > /work/f").await;
    let (s, snap) = call(
        M::POST,
        format!("{base}/v1/sandboxes/{a}/snapshots"),
        Some(json!({"name": "first"})),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{snap}");
    assert_eq!(
        (&snap["sandboxId"], &snap["name"]),
        (&json!(a), &json!("first")),
        "{snap}"
    );
    assert!(
        ["Creating", "Ready"].contains(&snap["status"]["state"].as_str().unwrap()),
        "{snap}"
    );
    let id = snap["id"].as_str().unwrap().to_string();
    let ready = wait_state(&base, &id, "Ready").await;
    assert_eq!(ready["createdAt"], snap["createdAt"], "{ready}");
    sh(&base, &a, "echo v2 > /work/f").await;

    // Restore: the snapshot's image and files, the contract's entrypoint.
    let b = create(&base, json!({"snapshotId": id, "resourceLimits": limits})).await;
    assert_eq!(sh(&base, &b, "cat /work/f").await.stdout, "v1\n");
    assert_eq!(sh(&base, &a, "cat /work/f").await.stdout, "v2\n");
    let (_, info) = call(M::GET, format!("{base}/v1/sandboxes/{b}"), None).await;
    assert_eq!(info["snapshotId"], id.as_str(), "{info}");
    assert_eq!(
        info["entrypoint"],
        json!(["tail", "-f", "/dev/null"]),
        "{info}"
    );
    assert!(info["image"]["uri"].is_string(), "{info}");

    let (s, v) = call(
        M::GET,
        format!("{base}/v1/snapshots?sandboxId={a}&state=Ready"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["pagination"]["totalItems"], 1, "{v}");
    assert_eq!(v["items"][0]["id"], id.as_str(), "{v}");

    common::assert_refusals(
        &base,
        vec![
            (
                M::GET,
                "/v1/snapshots/nope".to_string(),
                None,
                StatusCode::NOT_FOUND,
                "SNAPSHOT_NOT_FOUND",
            ),
            (
                M::POST,
                "/v1/sandboxes/nope/snapshots".to_string(),
                None,
                StatusCode::NOT_FOUND,
                "SANDBOX_NOT_FOUND",
            ),
            (
                M::POST,
                "/v1/sandboxes".to_string(),
                Some(json!({"snapshotId": "nope"})),
                StatusCode::BAD_REQUEST,
                "INVALID_REQUEST",
            ),
        ],
    )
    .await;

    // In use by B: 204, Deleting, no more restores; gone with B.
    let (s, v) = call(M::DELETE, format!("{base}/v1/snapshots/{id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    let (_, got) = get_snapshot(&base, &id).await;
    assert_eq!(got["status"]["state"], "Deleting", "{got}");
    let (s, v) = call(
        M::POST,
        format!("{base}/v1/sandboxes"),
        Some(json!({"snapshotId": id})),
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    let (s, _) = call(M::DELETE, format!("{base}/v1/sandboxes/{b}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    eventually_async(
        "the snapshot to go with the last sandbox restored from it",
        Duration::from_secs(30),
        || async { (get_snapshot(&base, &id).await.0 == StatusCode::NOT_FOUND).then_some(()) },
    )
    .await;
    let (s, _) = call(M::DELETE, format!("{base}/v1/sandboxes/{a}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    lifecycle.shutdown().await.unwrap();
    env.stop().await;
}

/// The SDK suite on the controller (see
/// `lifecycle/tests/python/snapshot_sdk_test.py`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_through_the_python_sdk_on_the_controller() {
    common::controller_env(8)
        .await
        .run_sdk_suite("snapshot_sdk_test.py")
        .await;
}
