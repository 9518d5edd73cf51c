//! Named volumes through the lifecycle's REST API on the controller
//! backend: a real controller and a real agent whose volume root is a
//! loop-backed btrfs image on the test bed. Create, list, get, delete;
//! snapshot, restore, fork; `pvc` in a sandbox create; mounting into and
//! out of a running sandbox; the access-mode and in-use rules as 409s; and
//! the official Python SDK creating sandboxes with a `pvc`.

use crate::common;

use common::{call, sh};
use reqwest::{Method as M, StatusCode};
use serde_json::{Value, json};

async fn req(method: M, base: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
    call(method, format!("{base}/v1{path}"), body).await
}

/// A sandbox mounting `volumes` (none when empty): its id, or the refusal.
async fn sandbox(base: &str, image: &str, volumes: Value) -> Result<String, (StatusCode, Value)> {
    let (s, v) = req(
        M::POST,
        base,
        "/sandboxes",
        Some(json!({
            "image": {"uri": image},
            "entrypoint": ["sleep", "infinity"],
            "timeout": 600,
            "resourceLimits": {},
            "volumes": volumes,
        })),
    )
    .await;
    if s == StatusCode::ACCEPTED {
        Ok(v["id"].as_str().unwrap().to_string())
    } else {
        Err((s, v))
    }
}

fn pvc(claim: &str, read_only: bool) -> Value {
    json!([{"name": "data", "mountPath": "/data", "readOnly": read_only, "pvc": {"claimName": claim}}])
}

async fn delete_sandbox(base: &str, id: &str) {
    let (s, v) = req(M::DELETE, base, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
}

fn expect(got: (StatusCode, Value), status: StatusCode, code: &str) -> Value {
    assert_eq!(got.0, status, "{}", got.1);
    assert_eq!(got.1["code"], code, "{}", got.1);
    got.1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_snapshots_restore_and_fork_through_rest() {
    let env = common::controller_env_with_volumes(8).await;
    let data = tempfile::tempdir().unwrap();
    let lifecycle = env.lifecycle(data.path()).await;
    let base = format!("http://{}", lifecycle.addr());
    let image = env.image.clone();

    // Create: 201 with the documented shape, long access-mode names.
    let (s, v) = req(
        M::POST,
        &base,
        "/volumes",
        Some(json!({"name": "vol-a", "accessMode": "RWO", "size": "256Mi"})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["name"], "vol-a");
    assert_eq!(v["accessMode"], "ReadWriteOnce");
    assert_eq!(
        (v["size"].clone(), v["sizeBytes"].clone()),
        (json!("256Mi"), json!(256u64 << 20))
    );
    assert_eq!(v["backend"], "local");
    assert_eq!(v["capabilities"]["backend"], "btrfs", "{v}");
    assert_eq!(v["capabilities"]["instantSnapshots"], true);
    assert!(!v["nodeName"].as_str().unwrap().is_empty(), "{v}");
    assert!(v["forkedFrom"].is_null() && v["available"] == true, "{v}");
    expect(
        req(M::POST, &base, "/volumes", Some(json!({"name": "vol-a"}))).await,
        StatusCode::CONFLICT,
        "VOLUME_ALREADY_EXISTS",
    );
    let bad = expect(
        req(M::POST, &base, "/volumes", Some(json!({"name": "Vol_A"}))).await,
        StatusCode::BAD_REQUEST,
        "VOLUME::INVALID_NAME",
    );
    assert!(
        bad["message"].as_str().unwrap().contains("name 'Vol_A'"),
        "{bad}"
    );
    expect(
        req(M::GET, &base, "/volumes/nope", None).await,
        StatusCode::NOT_FOUND,
        "VOLUME_NOT_FOUND",
    );
    // Both mounts serve the routes.
    let (s, list) = call(M::GET, format!("{base}/volumes"), None).await;
    assert_eq!(s, StatusCode::OK, "{list}");
    assert!(
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["name"] == "vol-a"),
        "{list}"
    );

    // Write v1 in sandbox A, delete A; snapshot s1.
    let a = sandbox(&base, &image, pvc("vol-a", false)).await.unwrap();
    assert_eq!(
        sh(&base, &a, "echo v1 > /data/f && cat /data/f")
            .await
            .stdout,
        "v1\n"
    );
    delete_sandbox(&base, &a).await;
    let (s, snap) = req(
        M::POST,
        &base,
        "/volumes/vol-a/snapshots",
        Some(json!({"name": "s1"})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{snap}");
    assert_eq!(
        (snap["volume"].clone(), snap["name"].clone()),
        (json!("vol-a"), json!("s1"))
    );
    expect(
        req(
            M::POST,
            &base,
            "/volumes/vol-a/snapshots",
            Some(json!({"name": "s1"})),
        )
        .await,
        StatusCode::CONFLICT,
        "SNAPSHOT_ALREADY_EXISTS",
    );
    expect(
        req(
            M::POST,
            &base,
            "/volumes/nope/snapshots",
            Some(json!({"name": "s1"})),
        )
        .await,
        StatusCode::NOT_FOUND,
        "VOLUME_NOT_FOUND",
    );
    let (s, snaps) = req(M::GET, &base, "/volumes/vol-a/snapshots", None).await;
    assert_eq!(s, StatusCode::OK, "{snaps}");
    assert_eq!(snaps["items"][0]["name"], "s1", "{snaps}");

    // B reads v1 back and writes v2. While B mounts the volume: delete and
    // restore are 409 VOLUME_IN_USE, a second writer (RWO) is 409, a fork
    // is fine.
    let b = sandbox(&base, &image, pvc("vol-a", false)).await.unwrap();
    assert_eq!(sh(&base, &b, "cat /data/f").await.stdout, "v1\n");
    sh(&base, &b, "echo v2 > /data/f").await;
    let (_, got) = req(M::GET, &base, "/volumes/vol-a", None).await;
    assert_eq!(got["mounts"][0]["sandboxId"], b.as_str(), "{got}");
    assert_eq!(got["mounts"][0]["readOnly"], false, "{got}");
    expect(
        req(M::DELETE, &base, "/volumes/vol-a", None).await,
        StatusCode::CONFLICT,
        "VOLUME_IN_USE",
    );
    expect(
        req(
            M::POST,
            &base,
            "/volumes/vol-a/restore",
            Some(json!({"snapshot": "s1"})),
        )
        .await,
        StatusCode::CONFLICT,
        "VOLUME_IN_USE",
    );
    let second = sandbox(&base, &image, pvc("vol-a", false))
        .await
        .unwrap_err();
    expect(second, StatusCode::CONFLICT, "VOLUME_CONFLICT");
    let (s, fork) = req(
        M::POST,
        &base,
        "/volumes/vol-a/fork",
        Some(json!({"name": "vol-b", "snapshot": "s1", "accessMode": "ReadWriteMany", "size": "320Mi"})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{fork}");
    assert_eq!(fork["forkedFrom"], "vol-a@s1", "{fork}");
    assert_eq!(fork["accessMode"], "ReadWriteMany", "{fork}");
    // The fork's own size, not its source's.
    assert_eq!(fork["sizeBytes"], json!(320u64 << 20), "{fork}");
    assert_eq!(
        fork["nodeName"], got["nodeName"],
        "a fork stays on its source's node"
    );
    delete_sandbox(&base, &b).await;

    // Restore: the original bytes are back.
    expect(
        req(
            M::POST,
            &base,
            "/volumes/vol-a/restore",
            Some(json!({"snapshot": "nope"})),
        )
        .await,
        StatusCode::NOT_FOUND,
        "SNAPSHOT_NOT_FOUND",
    );
    let (s, restored) = req(
        M::POST,
        &base,
        "/volumes/vol-a/restore",
        Some(json!({"snapshot": "s1"})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{restored}");
    assert_eq!(restored["name"], "vol-a");
    // The fork has s1's data and is independent of its source: two
    // writers at once (RWX fork, RWO source mounted by one).
    let c = sandbox(&base, &image, pvc("vol-a", false)).await.unwrap();
    let d = sandbox(&base, &image, pvc("vol-b", false)).await.unwrap();
    assert_eq!(sh(&base, &c, "cat /data/f").await.stdout, "v1\n");
    assert_eq!(sh(&base, &d, "cat /data/f").await.stdout, "v1\n");
    sh(&base, &d, "echo fork-only > /data/f").await;
    assert_eq!(sh(&base, &c, "cat /data/f").await.stdout, "v1\n");
    delete_sandbox(&base, &c).await;
    delete_sandbox(&base, &d).await;

    // Snapshots go; deleting the source keeps its fork.
    let (s, _) = req(M::DELETE, &base, "/volumes/vol-a/snapshots/s1", None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    expect(
        req(M::DELETE, &base, "/volumes/vol-a/snapshots/s1", None).await,
        StatusCode::NOT_FOUND,
        "SNAPSHOT_NOT_FOUND",
    );
    let (s, v) = req(M::DELETE, &base, "/volumes/vol-a", None).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    expect(
        req(M::GET, &base, "/volumes/vol-a", None).await,
        StatusCode::NOT_FOUND,
        "VOLUME_NOT_FOUND",
    );
    let (s, v) = req(M::GET, &base, "/volumes/vol-b", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v) = req(M::DELETE, &base, "/volumes/vol-b", None).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");

    // The document this lifecycle serves lists the routes.
    let (_, doc) = call(M::GET, format!("{base}/openapi.json"), None).await;
    for p in [
        "/volumes",
        "/volumes/{volume_name}",
        "/volumes/{volume_name}/snapshots",
        "/volumes/{volume_name}/snapshots/{snapshot_name}",
        "/volumes/{volume_name}/restore",
        "/volumes/{volume_name}/fork",
        "/sandboxes/{sandbox_id}/volumes",
        "/sandboxes/{sandbox_id}/volumes/{volume_name}",
    ] {
        for prefix in ["", "/v1"] {
            assert!(
                doc["paths"][format!("{prefix}{p}")].is_object(),
                "{prefix}{p}"
            );
        }
    }
    lifecycle.shutdown().await.unwrap();
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mount_into_and_out_of_a_running_sandbox() {
    let env = common::controller_env_with_volumes(8).await;
    let data = tempfile::tempdir().unwrap();
    let lifecycle = env.lifecycle(data.path()).await;
    let base = format!("http://{}", lifecycle.addr());
    let image = env.image.clone();
    let (s, v) = req(M::POST, &base, "/volumes", Some(json!({"name": "live"}))).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let s1 = sandbox(&base, &image, json!([])).await.unwrap();
    let s2 = sandbox(&base, &image, json!([])).await.unwrap();
    let attach = |id: &str, read_only: bool| {
        let url = format!("/sandboxes/{id}/volumes");
        let body = json!({"name": "data", "mountPath": "/mnt/data", "readOnly": read_only, "pvc": {"claimName": "live"}});
        let base = base.clone();
        async move { req(M::POST, &base, &url, Some(body)).await }
    };

    // Into s1, read-write: the answer lists the sandbox's volumes.
    let (s, v) = attach(&s1, false).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        v["volumes"],
        json!([{"name": "data", "mountPath": "/mnt/data", "readOnly": false, "pvc": {"claimName": "live"}}])
    );
    let out = sh(&base, &s1, "echo hello > /mnt/data/f && cat /mnt/data/f").await;
    assert_eq!(out.stdout, "hello\n", "{out:?}");
    // A second writer of a ReadWriteOnce volume: 409. A reader: fine, and
    // read-only inside.
    expect(
        attach(&s2, false).await,
        StatusCode::CONFLICT,
        "VOLUME_CONFLICT",
    );
    let (s, v) = attach(&s2, true).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(sh(&base, &s2, "cat /mnt/data/f").await.stdout, "hello\n");
    let out = sh(&base, &s2, "touch /mnt/data/x 2>/dev/null; echo rc=$?").await;
    assert_eq!(out.stdout.trim(), "rc=1", "{out:?}");

    // Out of s1 by the entry's name, out of s2 by the volume's: gone inside.
    let (s, v) = req(
        M::DELETE,
        &base,
        &format!("/sandboxes/{s1}/volumes/data"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    let out = sh(&base, &s1, "cat /mnt/data/f 2>/dev/null; echo rc=$?").await;
    assert_eq!(out.stdout.trim(), "rc=1", "{out:?}");
    expect(
        req(
            M::DELETE,
            &base,
            &format!("/sandboxes/{s1}/volumes/data"),
            None,
        )
        .await,
        StatusCode::NOT_FOUND,
        "VOLUME_NOT_FOUND",
    );
    let (s, v) = req(
        M::DELETE,
        &base,
        &format!("/sandboxes/{s2}/volumes/live"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    let (_, got) = req(M::GET, &base, "/volumes/live", None).await;
    assert_eq!(got["mounts"], json!([]), "{got}");
    // Now s2 may write.
    let (s, v) = attach(&s2, false).await;
    assert_eq!(s, StatusCode::OK, "{v}");

    // What cannot be attached, and to what.
    let (s, v) = req(
        M::POST,
        &base,
        &format!("/sandboxes/{s1}/volumes"),
        Some(json!({"name": "h", "mountPath": "/h", "host": {"path": env.host_root.path()}})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["message"].as_str().unwrap().contains("only a pvc"), "{v}");
    expect(
        req(
            M::POST,
            &base,
            "/sandboxes/no-such-sandbox/volumes",
            Some(json!({"name": "data", "mountPath": "/d", "pvc": {"claimName": "live"}})),
        )
        .await,
        StatusCode::NOT_FOUND,
        "SANDBOX_NOT_FOUND",
    );
    expect(
        req(
            M::POST,
            &base,
            &format!("/sandboxes/{s1}/volumes"),
            Some(json!({"name": "m", "mountPath": "/m", "pvc": {"claimName": "missing-vol", "createIfNotExists": false}})),
        )
        .await,
        StatusCode::NOT_FOUND,
        "VOLUME_NOT_FOUND",
    );
    for id in [&s1, &s2] {
        delete_sandbox(&base, id).await;
    }
    let (s, v) = req(M::DELETE, &base, "/volumes/live", None).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    lifecycle.shutdown().await.unwrap();
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pvc_through_the_python_sdk() {
    common::controller_env_with_volumes(8)
        .await
        .run_sdk_suite("pvc_sdk_test.py")
        .await;
}

/// No agent has a volume root: the volume cannot be placed, which is a
/// storage answer (507), not a rate (429).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_volume_root_anywhere_is_507() {
    let env = common::controller_env(2).await;
    let data = tempfile::tempdir().unwrap();
    let lifecycle = env.lifecycle(data.path()).await;
    let base = format!("http://{}", lifecycle.addr());
    let v = expect(
        req(M::POST, &base, "/volumes", Some(json!({"name": "nowhere"}))).await,
        StatusCode::INSUFFICIENT_STORAGE,
        "VOLUME_STORAGE_EXHAUSTED",
    );
    assert!(
        v["message"].as_str().unwrap().contains("volume root"),
        "{v}"
    );
    lifecycle.shutdown().await.unwrap();
    env.stop().await;
}

/// The volume's node stops reporting: the volume is shown as unavailable
/// and what needs its node is a 503 naming the node, with Retry-After.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_whose_node_is_silent_is_503_with_retry_after() {
    let mut env = common::controller_env_with_volumes(4).await;
    let data = tempfile::tempdir().unwrap();
    let lifecycle = env.lifecycle(data.path()).await;
    let base = format!("http://{}", lifecycle.addr());
    let (s, v) = req(M::POST, &base, "/volumes", Some(json!({"name": "far"}))).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let node = v["nodeName"].as_str().unwrap().to_string();
    env.agent.take().unwrap().shutdown().await;
    sandbolt_test_support::eventually_async(
        "the controller to see the volume's node silent",
        std::time::Duration::from_secs(60),
        || {
            let base = base.clone();
            async move {
                let (_, v) = req(M::GET, &base, "/volumes/far", None).await;
                (v["available"] == false).then_some(())
            }
        },
    )
    .await;
    let (s, headers, v) = common::call_as(
        M::POST,
        format!("{base}/v1/volumes/far/snapshots"),
        Some(common::API_KEY),
        Some(json!({"name": "s1"})),
    )
    .await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["code"], "VOLUME_UNAVAILABLE", "{v}");
    assert!(v["message"].as_str().unwrap().contains(&node), "{v}");
    assert_eq!(headers["retry-after"], "5");
    lifecycle.shutdown().await.unwrap();
    env.stop().await;
}
