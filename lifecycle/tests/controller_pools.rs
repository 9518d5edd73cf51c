//! Warm pools through the lifecycle's REST API on the controller backend:
//! a real controller (its `WarmPoolService`) and a real agent keeping the
//! pool's buffer on the test bed's containerd. Create, list, get, update,
//! delete and their refusals; a create naming the pool (without an image)
//! served by a claim and saying so (`allocation`, `extensions`); a pool at
//! its poolMax as a 429 with `Retry-After: 1`; and the official Python SDK
//! creating sandboxes from a pool.

use crate::common;

use std::time::{Duration, Instant};

use common::{call, call_as, sh};
use reqwest::{Method as M, StatusCode};
use serde_json::{Value, json};

/// Warm sandboxes start one at a time per agent, each a container start.
const FILL_WITHIN: Duration = Duration::from_secs(90);

async fn req(method: M, base: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
    call(method, format!("{base}/v1{path}"), body).await
}

fn expect(got: (StatusCode, Value), status: StatusCode, code: &str) -> Value {
    assert_eq!(got.0, status, "{}", got.1);
    assert_eq!(got.1["code"], code, "{}", got.1);
    got.1
}

fn capacity(buffer: (i32, i32), pool: (i32, i32)) -> Value {
    json!({"bufferMin": buffer.0, "bufferMax": buffer.1, "poolMin": pool.0, "poolMax": pool.1})
}

fn pool_body(name: &str, image: &str) -> Value {
    json!({
        "name": name,
        "template": {
            "metadata": {"labels": {"app": "warm"}},
            "spec": {"containers": [{
                "name": "sandbox",
                "image": image,
                "env": [{"name": "FROM_TEMPLATE", "value": "warm"}],
                "resources": {"limits": {"cpu": "500m", "memory": "128Mi"}},
            }]},
        },
        "capacitySpec": capacity((1, 2), (0, 4)),
    })
}

/// Polls the pool until `pred` holds for its `status`.
async fn wait_status(base: &str, pool: &str, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        let (s, v) = req(M::GET, base, &format!("/pools/{pool}"), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        if pred(&v["status"]) {
            return v;
        }
        assert!(
            start.elapsed() < FILL_WITHIN,
            "pool {pool} never {what}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn available(status: &Value) -> i64 {
    status["available"].as_i64().unwrap_or(0)
}

/// Create, list, update and the refusals, on both sides of the lifecycle.
async fn crud_and_refusals(base: &str, image: &str) {
    let (s, v) = req(M::POST, base, "/pools", Some(pool_body("warm-a", image))).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["name"], "warm-a");
    assert_eq!(v["capacitySpec"], capacity((1, 2), (0, 4)));
    expect(
        req(M::POST, base, "/pools", Some(pool_body("warm-a", image))).await,
        StatusCode::CONFLICT,
        "POOL_ALREADY_EXISTS",
    );
    // Refused here, naming the template field ...
    let mut bad = pool_body("warm-b", image);
    bad["template"]["spec"]["containers"][0]["command"] = json!(["sh"]);
    let v = expect(
        req(M::POST, base, "/pools", Some(bad)).await,
        StatusCode::BAD_REQUEST,
        "UNSUPPORTED_FIELD",
    );
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("template.spec.containers[0].command"),
        "{v}"
    );
    // ... and by the controller, in the request's terms.
    let (s, v) = req(
        M::POST,
        base,
        "/pools",
        Some(pool_body("warm-b", "Not/An:Image:Reference")),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["message"].as_str().unwrap().contains("image"), "{v}");
    expect(
        req(M::GET, base, "/pools/warm-b", None).await,
        StatusCode::NOT_FOUND,
        "POOL_NOT_FOUND",
    );
    let (s, v) = req(M::GET, base, "/pools", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let names: Vec<_> = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].clone())
        .collect();
    assert_eq!(names, [json!("warm-a")], "{v}");
    let bad_cap = json!({"capacitySpec": capacity((3, 2), (0, 4))});
    let v = expect(
        req(M::PUT, base, "/pools/warm-a", Some(bad_cap)).await,
        StatusCode::BAD_REQUEST,
        "INVALID_POOL",
    );
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("capacitySpec.bufferMin"),
        "{v}"
    );
    expect(
        req(
            M::PUT,
            base,
            "/pools/nope",
            Some(json!({"capacitySpec": capacity((0, 0), (0, 0))})),
        )
        .await,
        StatusCode::NOT_FOUND,
        "POOL_NOT_FOUND",
    );
}

/// A create naming the pool and no image: a claim of the template's image.
async fn claim(base: &str, image: &str) -> String {
    let (s, v) = req(
        M::POST,
        base,
        "/sandboxes",
        Some(json!({
            "entrypoint": ["sleep", "infinity"],
            "timeout": 600,
            "resourceLimits": {"cpu": "250m", "memory": "64Mi"},
            "env": {"FROM_REQUEST": "asked"},
            "extensions": {"poolRef": "warm-a"},
        })),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert_eq!(
        v["extensions"],
        json!({"sandbolt.claimedWarm": "true"}),
        "{v}"
    );
    let id = v["id"].as_str().unwrap().to_string();
    let (s, got) = req(M::GET, base, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::OK, "{got}");
    assert_eq!(
        got["allocation"],
        json!({"mode": "pool", "poolRef": "warm-a", "state": "allocated"}),
        "{got}"
    );
    assert_eq!(got["status"]["state"], "Running", "{got}");
    let short = image.rsplit('/').next().unwrap();
    assert!(
        got["image"]["uri"].as_str().unwrap().ends_with(short),
        "the template's image {image}: {got}"
    );
    let out = sh(base, &id, "echo \"$FROM_REQUEST|$FROM_TEMPLATE\"").await;
    assert_eq!(out.stdout, "asked|warm\n", "{out:?}");
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_pools_through_rest() {
    let env = common::controller_env(8).await;
    let data = tempfile::tempdir().unwrap();
    let lifecycle = env.lifecycle(data.path()).await;
    let base = format!("http://{}", lifecycle.addr());
    let image = env.image.clone();

    crud_and_refusals(&base, &image).await;
    wait_status(&base, "warm-a", "filled", |s| available(s) >= 1).await;
    let id = claim(&base, &image).await;
    wait_status(&base, "warm-a", "counted the claim", |s| {
        s["allocated"] == 1
    })
    .await;

    // No buffer and a total at poolMax: nothing to claim, no room to
    // create cold.
    let (s, v) = req(
        M::PUT,
        &base,
        "/pools/warm-a",
        Some(json!({"capacitySpec": capacity((0, 0), (0, 1))})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["capacitySpec"]["poolMax"], 1, "{v}");
    wait_status(&base, "warm-a", "drained", |s| available(s) == 0).await;
    let (s, headers, v) = call_as(
        M::POST,
        format!("{base}/v1/sandboxes"),
        Some(common::API_KEY),
        Some(json!({"entrypoint": ["sleep", "infinity"], "extensions": {"poolRef": "warm-a"}})),
    )
    .await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert_eq!(v["code"], "CONTROLLER::RESOURCE_EXHAUSTED", "{v}");
    assert!(v["message"].as_str().unwrap().contains("warm-a"), "{v}");
    assert_eq!(headers.get("retry-after").unwrap(), "1");

    // Deleting the pool leaves the sandboxes claimed from it.
    let (s, v) = req(M::DELETE, &base, "/pools/warm-a", None).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    for method in [M::GET, M::DELETE] {
        expect(
            req(method, &base, "/pools/warm-a", None).await,
            StatusCode::NOT_FOUND,
            "POOL_NOT_FOUND",
        );
    }
    let out = sh(&base, &id, "echo still-here").await;
    assert_eq!(out.stdout, "still-here\n", "{out:?}");
    let (s, v) = req(M::DELETE, &base, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");

    // The document this lifecycle serves lists the routes.
    let (_, doc) = call(M::GET, format!("{base}/openapi.json"), None).await;
    for p in ["/pools", "/pools/{pool_name}"] {
        for prefix in ["", "/v1"] {
            assert!(
                doc["paths"][format!("{prefix}{p}")].is_object(),
                "{prefix}{p}"
            );
        }
    }
    assert!(doc["components"]["schemas"]["CreatePoolRequest"].is_object());
    lifecycle.shutdown().await.unwrap();
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_pools_through_the_python_sdk() {
    common::controller_env(8)
        .await
        .run_sdk_suite("pool_sdk_test.py")
        .await;
}
