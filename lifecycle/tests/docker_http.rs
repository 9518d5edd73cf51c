//! HTTP-level contract of the lifecycle server on the real Docker backend:
//! auth, error shapes, `X-Request-ID`, both mounts, 501s, validation,
//! manual cleanup, expiry persisted across a restart.

use crate::common;

use std::time::Duration;

use common::{call, call_as};
use reqwest::StatusCode;
use sandbolt_lifecycle::{Lifecycle, StartError};
use sandbolt_test_support::{eventually, eventually_async};
use serde_json::{Value, json};

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

fn assert_error_shape(v: &Value) {
    let obj = v
        .as_object()
        .unwrap_or_else(|| panic!("error body is an object: {v}"));
    assert_eq!(obj.len(), 2, "{v}");
    assert!(obj["code"].is_string() && obj["message"].is_string(), "{v}");
}

fn create_body(timeout: Value) -> Value {
    let mut b = json!({"image": {"uri": "docker.io/library/busybox:latest"}, "entrypoint": ["sleep", "infinity"], "resourceLimits": {}});
    if !timeout.is_null() {
        b["timeout"] = timeout;
    }
    b
}

/// Creates a busybox sandbox with `timeout` (none when `Null`): status and body.
async fn create(base: &str, timeout: Value) -> (StatusCode, Value) {
    call(
        reqwest::Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(create_body(timeout)),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_contract_on_docker() {
    let env = common::docker_env();
    let h = env.start().await;
    let base = format!("http://{}", h.addr());
    use reqwest::Method as M;

    // Auth: missing and wrong keys are 401 {code,message}, with a request id.
    let (s, hd, v) = call_as(M::GET, format!("{base}/v1/sandboxes"), None, None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(v["code"], "MISSING_API_KEY");
    assert_error_shape(&v);
    assert!(hd.get("x-request-id").is_some());
    let (s, _, v) = call_as(M::GET, format!("{base}/sandboxes"), Some("wrong"), None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    assert_eq!(v["code"], "INVALID_API_KEY");
    // ... also on the proxy and on unknown ids.
    let (s, _, _) = call_as(
        M::GET,
        format!("{base}/sandboxes/x/proxy/44772/ping"),
        None,
        None,
    )
    .await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    // Health is open.
    let (s, _, v) = call_as(M::GET, format!("{base}/health"), None, None).await;
    assert_eq!(s, StatusCode::OK, "{v}");

    // X-Request-ID: echoed when given, generated otherwise.
    let r = client()
        .get(format!("{base}/version"))
        .header("OPEN-SANDBOX-API-KEY", common::API_KEY)
        .header("X-Request-ID", "req-42")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-request-id"], "req-42");

    // Both mounts; list is empty; pagination shape.
    for prefix in ["", "/v1"] {
        let (s, v) = call(M::GET, format!("{base}{prefix}/sandboxes"), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["pagination"]["totalItems"], 0);
        assert_eq!(v["pagination"]["page"], 1);
    }

    // Errors are {code,message} everywhere.
    let (s, v) = call(M::GET, format!("{base}/v1/sandboxes/nope"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error_shape(&v);
    let (s, v) = call(M::GET, format!("{base}/no/such/route"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error_shape(&v);
    for path in ["/pools", "/templates/x"] {
        let (s, v) = call(M::GET, format!("{base}{path}"), None).await;
        assert_eq!(s, StatusCode::NOT_IMPLEMENTED, "{path}");
        assert_error_shape(&v);
    }
    // Diagnostics are served: an unknown sandbox's are a 404 like its record.
    let (s, v) = call(
        M::GET,
        format!("{base}/v1/sandboxes/x/diagnostics/logs?scope=container"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error_shape(&v);
    let r = client()
        .post(format!("{base}/v1/sandboxes"))
        .header("OPEN-SANDBOX-API-KEY", common::API_KEY)
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert_error_shape(&r.json().await.unwrap());
    for bad in [json!(0), json!(-5), json!(59), json!(86401)] {
        let (s, v) = create(&base, bad.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "timeout {bad}: {v}");
        assert_error_shape(&v);
    }
    let (s, v) = call(M::GET, format!("{base}/v1/sandboxes/x/endpoints/0"), None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_eq!(v["code"], "INVALID_PORT");

    // The served OpenAPI document parses and lists the routes.
    let (s, doc) = call(M::GET, format!("{base}/openapi.json"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(doc["paths"]["/v1/sandboxes"]["post"].is_object());
    assert!(doc["paths"]["/sandboxes/{sandbox_id}/renew-expiration"]["post"].is_object());

    // A manual-cleanup sandbox: 202 Running, no expiresAt, renew is 409.
    let (s, created) = create(&base, Value::Null).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{created}");
    assert_eq!(created["status"]["state"], "Running");
    assert!(created.get("expiresAt").is_none(), "{created}");
    let id = created["id"].as_str().unwrap().to_string();
    let (s, v) = call(
        M::POST,
        format!("{base}/sandboxes/{id}/renew-expiration"),
        Some(json!({"expiresAt": "2099-01-01T00:00:00Z"})),
    )
    .await;
    assert_eq!(s, StatusCode::CONFLICT);
    assert_eq!(
        v["message"],
        format!("Sandbox {id} does not have automatic expiration enabled.")
    );
    // No null fields anywhere in a sandbox.
    let (_, got) = call(M::GET, format!("{base}/v1/sandboxes/{id}"), None).await;
    fn no_nulls(v: &Value) -> bool {
        match v {
            Value::Null => false,
            Value::Object(m) => m.values().all(no_nulls),
            Value::Array(a) => a.iter().all(no_nulls),
            _ => true,
        }
    }
    assert!(no_nulls(&got), "{got}");
    assert_eq!(got["image"]["uri"], "docker.io/library/busybox:latest");
    // execd is published on 127.0.0.1 with a per-sandbox token header.
    let (s, ep) = call(
        M::GET,
        format!("{base}/v1/sandboxes/{id}/endpoints/44772"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let endpoint = ep["endpoint"].as_str().unwrap();
    assert!(endpoint.starts_with("127.0.0.1:"), "{ep}");
    let token = ep["headers"]["X-EXECD-ACCESS-TOKEN"]
        .as_str()
        .expect("token header")
        .to_string();
    let (_, other) = call(
        M::GET,
        format!("{base}/v1/sandboxes/{id}/endpoints/8080"),
        None,
    )
    .await;
    assert_eq!(other["endpoint"], format!("{endpoint}/proxy/8080"));
    // Without the token execd refuses; with it, it answers.
    let r = client()
        .get(format!("http://{endpoint}/files/info?path=/"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    // The proxy answers while running, refuses (409, no hang on a frozen
    // process) while paused, endpoints stay valid, and it answers again
    // after resume.
    let ping = format!("{base}/v1/sandboxes/{id}/proxy/44772/ping");
    let (s, _) = call(M::GET, ping.clone(), None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = call(M::POST, format!("{base}/v1/sandboxes/{id}/pause"), None).await;
    assert!(s.is_success(), "{s} {v}");
    let (s, v) = call(M::GET, ping.clone(), None).await;
    assert_eq!(s, StatusCode::CONFLICT, "{v}");
    assert_eq!(v["code"], "DOCKER::SANDBOX_PAUSED");
    assert_error_shape(&v);
    let (s, _) = call(
        M::GET,
        format!("{base}/v1/sandboxes/{id}/endpoints/44772"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, v) = call(M::POST, format!("{base}/v1/sandboxes/{id}/resume"), None).await;
    assert!(s.is_success(), "{s} {v}");
    let (s, v) = call(M::GET, ping, None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // execd itself came in through the archive API, not a bind mount: the
    // one mount is the read-only resolv.conf naming the egress DNS proxy.
    let inspect = env.inspect(&id);
    let mounts = inspect["Mounts"].as_array().expect("mounts");
    assert_eq!(mounts.len(), 1, "{mounts:?}");
    assert_eq!(
        (&mounts[0]["Destination"], &mounts[0]["RW"]),
        (&json!("/etc/resolv.conf"), &json!(false)),
        "{mounts:?}"
    );
    assert_eq!(
        inspect["HostConfig"]["SecurityOpt"],
        json!(["no-new-privileges:true"])
    );
    assert!(inspect["HostConfig"]["PidsLimit"].as_i64().unwrap() > 0);
    assert_eq!(
        inspect["Config"]["Labels"]["opensandbox.io/manual-cleanup"],
        "true"
    );
    assert_eq!(
        inspect["Config"]["Labels"]["opensandbox.io/id"],
        id.as_str()
    );
    drop(token);
    let (s, _) = call(M::DELETE, format!("{base}/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);

    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_to_start_without_key_unless_open() {
    let env = common::docker_env();
    let mut c = env.config();
    c.api_key = None;
    match Lifecycle::start(c.clone()).await {
        Err(StartError::NoApiKey) => {}
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("started without a key"),
    }
    c.insecure_no_auth = true;
    let h = Lifecycle::start(c)
        .await
        .expect("explicitly open server starts");
    let (s, _, _) = call_as(
        reqwest::Method::GET,
        format!("http://{}/v1/sandboxes", h.addr()),
        None,
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    h.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expiry_is_persisted_swept_and_survives_restart() {
    let env = common::docker_env();
    use reqwest::Method as M;

    let h = env.start().await;
    let base = format!("http://{}", h.addr());
    let (s, a) = create(&base, json!(60)).await;
    assert_eq!(s, StatusCode::ACCEPTED, "{a}");
    let (_, b) = create(&base, json!(3600)).await;
    let (_, manual) = create(&base, Value::Null).await;
    let (a, b, manual) = (
        a["id"].as_str().unwrap().to_string(),
        b["id"].as_str().unwrap().to_string(),
        manual["id"].as_str().unwrap().to_string(),
    );

    // Renew `a` to a moment just ahead, then stop the server before it comes.
    let soon = chrono::Utc::now() + chrono::Duration::seconds(4);
    let (s, v) = call(
        M::POST,
        format!("{base}/v1/sandboxes/{a}/renew-expiration"),
        Some(json!({"expiresAt": soon.to_rfc3339()})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    h.shutdown().await.unwrap();
    eventually(
        "the renewed expiry to pass while no server runs",
        Duration::from_secs(10),
        || (chrono::Utc::now() > soon + chrono::Duration::seconds(1)).then_some(()),
    )
    .await;

    // A new server over the same engine and data dir finds and sweeps it.
    let h = env.start().await;
    let base = format!("http://{}", h.addr());
    eventually_async(
        &format!("expired sandbox {a} to be swept after restart"),
        Duration::from_secs(10),
        || async {
            let (s, _) = call(M::GET, format!("{base}/v1/sandboxes/{a}"), None).await;
            (s == StatusCode::NOT_FOUND).then_some(())
        },
    )
    .await;
    for id in [&b, &manual] {
        let (s, v) = call(M::GET, format!("{base}/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::OK, "{v}");
        assert_eq!(v["status"]["state"], "Running");
    }
    // `b` still carries its label expiry (~1h), restored from Docker.
    let (_, v) = call(M::GET, format!("{base}/v1/sandboxes/{b}"), None).await;
    let exp = chrono::DateTime::parse_from_rfc3339(v["expiresAt"].as_str().unwrap()).unwrap();
    assert!(exp > chrono::Utc::now() + chrono::Duration::minutes(55));
    for id in [&b, &manual] {
        call(M::DELETE, format!("{base}/v1/sandboxes/{id}"), None).await;
    }
    h.shutdown().await.unwrap();
}
