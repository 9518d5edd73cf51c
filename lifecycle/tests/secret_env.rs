//! `extensions.secretEnv` over REST: on the controller backend the marked
//! values reach the sandbox and nothing else (not the REST answers, not the
//! controller's record answer); the Docker backend, which has nowhere to
//! keep them sealed, refuses the key with a 400 naming it.

use crate::common;

use common::{call, sh};
use reqwest::{Method as M, StatusCode};
use serde_json::json;

fn body(image: &str, value: &str, secret: &str) -> serde_json::Value {
    json!({
        "image": {"uri": image},
        "entrypoint": ["sleep", "infinity"],
        "timeout": 600,
        "resourceLimits": {},
        "env": {"PLAIN": "visible", "SECRET": value},
        "extensions": {"secretEnv": secret},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secret_env_reaches_the_sandbox_only() {
    let env = common::controller_env(2).await;
    let data = tempfile::tempdir().unwrap();
    let h = env.lifecycle(data.path()).await;
    let base = format!("http://{}", h.addr());
    let value = format!("s3cret-{}", uuid::Uuid::new_v4().simple());

    // A name env does not set: 400 naming it.
    let (s, v) = call(
        M::POST,
        format!("{base}/v1/sandboxes"),
        Some(body(&env.image, &value, "SECRET,NOPE")),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(v["message"].as_str().unwrap().contains("NOPE"), "{v}");

    let (s, v) = call(
        M::POST,
        format!("{base}/v1/sandboxes"),
        Some(body(&env.image, &value, "SECRET")),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    assert!(!v.to_string().contains(&value), "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let out = sh(&base, &id, "echo \"$PLAIN/$SECRET\"").await;
    assert_eq!(out.stdout, format!("visible/{value}\n"), "{out:?}");
    let (s, got) = call(M::GET, format!("{base}/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::OK, "{got}");
    assert!(!got.to_string().contains(&value), "{got}");
    // The controller's answer names the secret and leaves its value out.
    let mut native = env.native().await;
    let rec = native.get(&id).await.unwrap();
    let spec = rec.spec.unwrap();
    assert_eq!(spec.secret_env_names, ["SECRET"]);
    assert_eq!(spec.env.get("PLAIN").map(String::as_str), Some("visible"));
    assert!(!spec.env.contains_key("SECRET"));

    let (s, v) = call(M::DELETE, format!("{base}/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    h.shutdown().await.unwrap();
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_refuses_secret_env() {
    let env = common::docker_env();
    let h = env.start().await;
    let base = format!("http://{}", h.addr());
    let (s, v) = call(
        M::POST,
        format!("{base}/v1/sandboxes"),
        Some(body(&env.image, "x", "SECRET")),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("extensions.secretEnv"),
        "{v}"
    );
    let (_, list) = call(M::GET, format!("{base}/v1/sandboxes"), None).await;
    assert_eq!(list["pagination"]["totalItems"], 0, "{list}");
    h.shutdown().await.unwrap();
}
