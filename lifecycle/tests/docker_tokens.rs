//! Docker backend execd tokens derived, not stored (issue 21): a sandbox's
//! token is `HMAC(<data_dir>/docker-token.key, id)`; no container label
//! holds it, the endpoint hands out exactly the derived value, execd takes
//! it, and a restarted lifecycle (same data dir, empty cache) derives the
//! same token and reaches the sandbox again. Before, the token was random and
//! kept in the container label `opensandbox.io/sandbolt-execd-token`, which
//! anyone allowed to `docker inspect` could read (the label assertion below
//! failed on that code).

use crate::common;

use std::os::unix::fs::PermissionsExt;

use common::{call, sh};
use reqwest::{Method as M, StatusCode};
use sandbolt_lifecycle::docker_token::{KEY_FILE, TokenKey};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_execd_tokens_are_derived_never_stored_and_survive_a_restart() {
    let env = common::docker_env();
    let h = env.start().await;
    let base = format!("http://{}", h.addr());
    let (s, v) = call(
        M::POST,
        format!("{base}/v1/sandboxes"),
        Some(json!({
            "image": {"uri": env.image},
            "entrypoint": ["sleep", "infinity"],
            "timeout": 600,
            "resourceLimits": {},
        })),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    assert_eq!(
        sh(&base, &id, "echo derived").await.stdout.trim(),
        "derived"
    );

    // The key: made in the data dir, private; the token: derived from it.
    let key_file = env.data.path().join(KEY_FILE);
    let mode = std::fs::metadata(&key_file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    let derived = TokenKey::load_or_create(env.data.path())
        .unwrap()
        .token(&id);
    let (s, ep) = call(
        M::GET,
        format!("{base}/v1/sandboxes/{id}/endpoints/44772"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{ep}");
    let handed: Vec<&str> = ep["headers"]
        .as_object()
        .map(|h| h.values().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    assert!(handed.contains(&derived.as_str()), "{ep}");

    // Nothing on the container holds it.
    let inspected = env.inspect(&id);
    let labels = &inspected["Config"]["Labels"];
    assert!(labels.is_object(), "{inspected}");
    assert!(
        labels.get("opensandbox.io/sandbolt-execd-token").is_none(),
        "{labels}"
    );
    assert!(!labels.to_string().contains(&derived), "{labels}");

    // A restarted lifecycle derives the same token.
    h.shutdown().await.unwrap();
    let h = env.start().await;
    let base = format!("http://{}", h.addr());
    assert_eq!(sh(&base, &id, "echo again").await.stdout.trim(), "again");
    let (s, _) = call(M::DELETE, format!("{base}/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    h.shutdown().await.unwrap();
}
