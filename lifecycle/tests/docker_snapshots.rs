//! Sandbox snapshots on the Docker backend, through the test bed's real
//! dockerd: `docker commit` of a running and of a paused sandbox, restore
//! (`snapshotId`) into sandboxes that see the snapshot's files and nothing
//! of the source's later writes or labels, list filters and paging, and a
//! delete while a restored sandbox lives (`Deleting`, then gone with it,
//! leaving no image behind). Then the same through the Python SDK.

use crate::common;

use std::process::Command;

use common::{DockerEnv, call, sh};
use reqwest::{Method as M, StatusCode};
use serde_json::{Value, json};

/// `docker images` of the bed's engine with `args`: the ids, one a line.
fn images(env: &DockerEnv, args: &[&str]) -> Vec<String> {
    let out = Command::new("docker")
        .args([
            "-H",
            &format!("unix://{}", env.socket().display()),
            "images",
            "-q",
        ])
        .args(args)
        .output()
        .expect("docker CLI runs");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

async fn create(base: &str, body: Value) -> Value {
    let (s, v) = call(M::POST, format!("{base}/v1/sandboxes"), Some(body)).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    v
}

async fn snapshot(base: &str, id: &str, body: Option<Value>) -> Value {
    let (s, v) = call(M::POST, format!("{base}/v1/sandboxes/{id}/snapshots"), body).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!(v["sandboxId"], id, "{v}");
    assert_eq!(v["status"]["state"], "Ready", "{v}");
    v
}

async fn list(base: &str, query: &str) -> Value {
    let (s, v) = call(M::GET, format!("{base}/v1/snapshots?{query}"), None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v
}

fn ids(v: &Value) -> Vec<&str> {
    v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_through_rest_on_docker() {
    common::init_tracing();
    let env = common::docker_env();
    let h = env.start().await;
    let base = format!("http://{}", h.addr());
    let images_before = images(&env, &[]);

    // A: manual cleanup, metadata of its own.
    let a = create(
        &base,
        json!({"image": {"uri": env.image}, "entrypoint": ["sleep", "infinity"], "metadata": {"team": "a"}}),
    )
    .await;
    let a = a["id"].as_str().unwrap().to_string();
    sh(&base, &a, "mkdir -p /work && echo v1 > /work/f").await;
    let first = snapshot(&base, &a, Some(json!({"name": "first"}))).await;
    assert_eq!(first["name"], "first");
    let first_id = first["id"].as_str().unwrap().to_string();
    let (s, got) = call(M::GET, format!("{base}/snapshots/{first_id}"), None).await;
    assert_eq!((s, &got), (StatusCode::OK, &first));
    // The commit paused A only for its duration.
    let (_, a_now) = call(M::GET, format!("{base}/v1/sandboxes/{a}"), None).await;
    assert_eq!(a_now["status"]["state"], "Running", "{a_now}");
    sh(&base, &a, "echo v2 > /work/f").await;

    // B from the snapshot: no image, no entrypoint; a timeout although A
    // had none; metadata of its own, none of A's.
    let b = create(&base, json!({"snapshotId": first_id, "timeout": 600})).await;
    let b = b["id"].as_str().unwrap().to_string();
    assert_eq!(sh(&base, &b, "cat /work/f").await.stdout, "v1\n");
    assert_eq!(sh(&base, &a, "cat /work/f").await.stdout, "v2\n");
    let (_, info) = call(M::GET, format!("{base}/v1/sandboxes/{b}"), None).await;
    assert_eq!(info["snapshotId"], first_id.as_str(), "{info}");
    assert_eq!(info["image"]["uri"], env.image.as_str(), "{info}");
    assert_eq!(
        info["entrypoint"],
        json!(["tail", "-f", "/dev/null"]),
        "{info}"
    );
    assert!(info["expiresAt"].is_string(), "{info}");
    assert!(info.get("metadata").is_none(), "{info}");
    let (_, a_info) = call(M::GET, format!("{base}/v1/sandboxes/{a}"), None).await;
    assert!(a_info.get("snapshotId").is_none(), "{a_info}");

    // A paused source is captured and stays paused; an empty body is fine.
    let (s, _) = call(M::POST, format!("{base}/v1/sandboxes/{a}/pause"), None).await;
    assert_eq!(s, StatusCode::ACCEPTED);
    let second = snapshot(&base, &a, None).await;
    assert!(second.get("name").is_none(), "{second}");
    let second_id = second["id"].as_str().unwrap().to_string();
    let (_, a_now) = call(M::GET, format!("{base}/v1/sandboxes/{a}"), None).await;
    assert_eq!(a_now["status"]["state"], "Paused", "{a_now}");
    let (s, _) = call(M::POST, format!("{base}/v1/sandboxes/{a}/resume"), None).await;
    assert_eq!(s, StatusCode::ACCEPTED);

    // Listing: filters, newest first, pages.
    let all = list(&base, &format!("sandboxId={a}")).await;
    assert_eq!(ids(&all), [second_id.as_str(), first_id.as_str()], "{all}");
    let page = list(&base, &format!("sandboxId={a}&pageSize=1&page=2")).await;
    assert_eq!(ids(&page), [first_id.as_str()], "{page}");
    assert_eq!(page["pagination"]["totalItems"], 2);
    assert_eq!(page["pagination"]["hasNextPage"], false);
    assert_eq!(ids(&list(&base, "name=first").await), [first_id.as_str()]);
    assert!(ids(&list(&base, "state=Deleting").await).is_empty());
    assert_eq!(
        list(&base, "state=ready").await["pagination"]["totalItems"],
        2
    );

    refusals(&base, &a, &first_id, &env.image).await;

    // Deleting the snapshot B runs from: Deleting, no more restores, and
    // it goes with B, leaving no image behind.
    let (s, v) = call(M::DELETE, format!("{base}/v1/snapshots/{first_id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    let (_, got) = call(M::GET, format!("{base}/v1/snapshots/{first_id}"), None).await;
    assert_eq!(got["status"]["state"], "Deleting", "{got}");
    assert_eq!(
        ids(&list(&base, "state=Deleting").await),
        [first_id.as_str()]
    );
    let (s, v) = call(
        M::POST,
        format!("{base}/v1/sandboxes"),
        Some(json!({"snapshotId": first_id})),
    )
    .await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::CONFLICT, Some("SNAPSHOT_INVALID_STATE")),
        "{v}"
    );
    assert_eq!(sh(&base, &b, "cat /work/f").await.stdout, "v1\n");
    let (s, _) = call(M::DELETE, format!("{base}/v1/sandboxes/{b}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, v) = call(M::GET, format!("{base}/v1/snapshots/{first_id}"), None).await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("SNAPSHOT_NOT_FOUND")),
        "{v}"
    );

    // Unused: goes at once.
    let (s, _) = call(M::DELETE, format!("{base}/snapshots/{second_id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _) = call(M::GET, format!("{base}/snapshots/{second_id}"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(ids(&list(&base, "").await).is_empty());
    let (s, _) = call(M::DELETE, format!("{base}/v1/sandboxes/{a}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    // Nothing left: no snapshot image, tagged or dangling.
    let mut after = images(&env, &[]);
    let mut before = images_before.clone();
    after.sort();
    before.sort();
    assert_eq!(after, before);
    assert!(images(&env, &["--filter", "dangling=true"]).is_empty());
    h.shutdown().await.unwrap();
}

/// What the snapshot routes and a restore refuse, and how.
async fn refusals(base: &str, source: &str, snapshot_id: &str, image: &str) {
    common::assert_refusals(
        base,
        vec![
            (
                M::POST,
                "/v1/sandboxes/nope/snapshots".to_string(),
                None,
                StatusCode::NOT_FOUND,
                "SANDBOX_NOT_FOUND",
            ),
            (
                M::POST,
                format!("/v1/sandboxes/{source}/snapshots"),
                Some(json!({"name": ""})),
                StatusCode::BAD_REQUEST,
                "INVALID_REQUEST",
            ),
            (
                M::GET,
                "/v1/snapshots/nope".to_string(),
                None,
                StatusCode::NOT_FOUND,
                "SNAPSHOT_NOT_FOUND",
            ),
            (
                M::GET,
                "/v1/snapshots/a:b".to_string(),
                None,
                StatusCode::NOT_FOUND,
                "SNAPSHOT_NOT_FOUND",
            ),
            (
                M::DELETE,
                "/v1/snapshots/nope".to_string(),
                None,
                StatusCode::NOT_FOUND,
                "SNAPSHOT_NOT_FOUND",
            ),
            (
                M::GET,
                "/v1/snapshots?pageSize=0".to_string(),
                None,
                StatusCode::BAD_REQUEST,
                "INVALID_REQUEST",
            ),
            (
                M::POST,
                "/v1/sandboxes".to_string(),
                Some(json!({"snapshotId": snapshot_id, "image": {"uri": image}, "entrypoint": ["sh"]})),
                StatusCode::BAD_REQUEST,
                "INVALID_REQUEST",
            ),
            (
                M::POST,
                "/v1/sandboxes".to_string(),
                Some(json!({"snapshotId": "nope"})),
                StatusCode::BAD_REQUEST,
                "SNAPSHOT_NOT_FOUND",
            ),
        ],
    )
    .await;
}

/// The SDK suite on Docker (see `lifecycle/tests/python/snapshot_sdk_test.py`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_through_the_python_sdk_on_docker() {
    let env = common::docker_env();
    let h = env.start().await;
    let suite =
        common::lifecycle_pytest("snapshot_sdk_test.py", h.addr(), &env.image, "docker").await;
    h.shutdown().await.unwrap();
    common::rethrow(suite);
}
