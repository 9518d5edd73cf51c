//! The fsb gateway against the real OpenSandbox server's signed endpoints:
//! scopes made by the server's own `build_endpoint` (opensandbox-server
//! 1.1.1 from its venv, key ring given to it in `OPENSANDBOX_SECURE_ACCESS_KEYS`
//! exactly as the gateway gets it) reach a real sandbox's execd through a
//! real controller and agent, in header and uri mode, for plain HTTP, a
//! streamed (SSE) answer and an upgraded connection; altered, foreign and
//! unsigned scopes are refused before anything reaches the sandbox; the
//! scope never reaches it either.

use crate::common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use common::{API_KEY, call, sh};
use reqwest::{Method, StatusCode};
use sandbolt_lifecycle::{GatewayConfig, KeyRing, Lifecycle, LifecycleHandle};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The ring both the server and the gateway get ("secret-a", "secret-b";
/// padded and unpadded, as the server accepts both).
const RING: &str = "a=c2VjcmV0LWE=,b=c2VjcmV0LWI";
/// Same ids, a key the gateway does not hold under id `a`.
const FOREIGN_RING: &str = "a=b3RoZXItc2VjcmV0";
const INGRESS: &str = "OpenSandbox-Ingress-To";
/// The in-sandbox upgrade echo server's port.
const ECHO_PORT: u16 = 9000;
const EXECD_PORT: u16 = sandbolt_proto::wire::EXECD_PORT;

/// The sandbox's entrypoint: `nc` serving one upgrade per connection, which
/// logs each connection and the request head it got, answers 101 and then
/// echoes bytes back.
const ECHO_SERVER: &str = r#"cat > /tmp/up.sh <<'EOF'
#!/bin/sh
echo conn >> /tmp/conns
cr=$(printf '\r')
while IFS= read -r line; do
  line=${line%"$cr"}
  [ -z "$line" ] && break
  echo "$line" >> /tmp/req
done
printf 'HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: sandbolt-echo\r\n\r\n'
exec cat
EOF
chmod +x /tmp/up.sh
exec nc -ll -p 9000 -e /tmp/up.sh"#;

/// One endpoint to ask the server for.
struct Ask<'a> {
    ring: &'a str,
    key: &'a str,
    mode: &'a str,
    namespace: &'a str,
    sandbox_id: &'a str,
    port: u16,
}

/// The server's venv python (`benches/python/server-env.sh` makes it once).
fn server_python() -> PathBuf {
    sandbolt_testbed::opensandbox_server()
        .expect("the OpenSandbox server's venv (benches/python/server-env.sh)")
        .with_file_name("python")
}

/// The endpoints the server answers for `asks`: its `load_config` (key ring
/// from the environment, ingress gateway in the given route mode) and its
/// `build_endpoint`, one process per ask.
fn server_endpoints(gateway: &str, asks: &[Ask<'_>]) -> Vec<Value> {
    let python = server_python();
    let dir = tempfile::tempdir().unwrap();
    asks.iter()
        .map(|ask| {
            let config = dir.path().join(format!("{}.toml", ask.mode));
            std::fs::write(
                &config,
                format!(
                    "[server]\napi_key = \"unused\"\n[runtime]\ntype = \"kubernetes\"\nexecd_image = \"unused\"\n\
                     [ingress]\nmode = \"gateway\"\n[ingress.gateway]\naddress = \"{gateway}\"\n\
                     [ingress.gateway.route]\nmode = \"{}\"\n",
                    ask.mode
                ),
            )
            .unwrap();
            let out = Command::new(&python)
                .arg("-c")
                .arg(
                    "import json, sys\n\
                     from opensandbox_server.config import load_config\n\
                     from opensandbox_server.services.fast_sandbox.endpoint import build_endpoint\n\
                     c = load_config(sys.argv[1])\n\
                     e = build_endpoint(c.ingress, sys.argv[2], sys.argv[3], int(sys.argv[4]))\n\
                     print(json.dumps(e.model_dump()))\n",
                )
                .arg(&config)
                .args([ask.namespace, ask.sandbox_id, &ask.port.to_string()])
                .env("OPENSANDBOX_SECURE_ACCESS_KEYS", ask.ring)
                .env("OPENSANDBOX_SECURE_ACCESS_ACTIVE_KEY", ask.key)
                .output()
                .expect("the server's python runs");
            assert!(
                out.status.success(),
                "build_endpoint failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            serde_json::from_slice(&out.stdout).unwrap()
        })
        .collect()
}

/// The scope of a header-mode endpoint.
fn header_scope(endpoint: &Value) -> String {
    endpoint["headers"][INGRESS]
        .as_str()
        .unwrap_or_else(|| panic!("no {INGRESS} header in {endpoint}"))
        .to_string()
}

/// `scope` with field `i` (0-based, dot-separated) replaced.
fn with_field(scope: &str, i: usize, value: &str) -> String {
    let mut fields: Vec<&str> = scope.split('.').collect();
    fields[i] = value;
    fields.join(".")
}

/// `scope` whose signature differs in its first byte (still well-formed).
fn tampered(scope: &str) -> String {
    let mac = scope.rsplit('.').next().unwrap();
    let mut bytes = URL_SAFE_NO_PAD.decode(mac).unwrap();
    bytes[0] ^= 1;
    with_field(scope, 5, &URL_SAFE_NO_PAD.encode(bytes))
}

/// A request through the gateway, scope in the header.
async fn via_header(gateway: &str, scope: &str, path: &str) -> (StatusCode, Value) {
    let r = reqwest::Client::new()
        .get(format!("http://{gateway}/{path}"))
        .header(INGRESS, scope)
        .send()
        .await
        .expect("gateway answers");
    let status = r.status();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Starts the sandbox (the upgrade echo server as its entrypoint) through
/// the plain lifecycle; answers its id.
async fn create_echo_sandbox(base: &str, image: &str) -> String {
    let (s, created) = call(
        Method::POST,
        format!("{base}/v1/sandboxes"),
        Some(json!({
            "image": {"uri": image},
            "entrypoint": ["sh", "-c", ECHO_SERVER],
            "timeout": 600,
        })),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{created}");
    created["id"].as_str().unwrap().to_string()
}

/// A lifecycle whose own namespace is not the sandbox's, with the gateway:
/// whatever it reaches, it found through the scope's namespace.
async fn gateway_lifecycle(env: &common::ControllerEnv, data: &std::path::Path) -> LifecycleHandle {
    let mut config = env.lifecycle_config(data);
    if let sandbolt_lifecycle::BackendConfig::Controller(c) = &mut config.backend {
        c.namespace = "not-the-sandboxes-namespace".into();
    }
    config.gateway = Some(GatewayConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        keys: KeyRing::parse(RING).unwrap(),
    });
    Lifecycle::start(config)
        .await
        .expect("lifecycle with gateway starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_signed_scopes_reach_the_sandbox_and_nothing_else_does() {
    let env = common::controller_env(4).await;
    let (data, gw_data) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let api = env.lifecycle(data.path()).await;
    let gw = gateway_lifecycle(&env, gw_data.path()).await;
    let base = format!("http://{}", api.addr());
    let gateway = gw.gateway_addr().expect("gateway bound").to_string();
    let id = create_echo_sandbox(&base, &env.image).await;
    let ns = common::POOL_NAMESPACE;

    let ask = |ring, key, mode, namespace, port| Ask {
        ring,
        key,
        mode,
        namespace,
        sandbox_id: &id,
        port,
    };
    let endpoints = tokio::task::block_in_place(|| {
        server_endpoints(
            &gateway,
            &[
                ask(RING, "a", "header", ns, EXECD_PORT),
                ask(RING, "b", "uri", ns, EXECD_PORT),
                ask(RING, "b", "header", ns, ECHO_PORT),
                ask(RING, "a", "header", "other-namespace", ECHO_PORT),
                ask(FOREIGN_RING, "a", "header", ns, ECHO_PORT),
            ],
        )
    });
    let execd_header = header_scope(&endpoints[0]);
    let echo = header_scope(&endpoints[2]);
    assert_eq!(endpoints[0]["endpoint"], gateway.as_str());

    http_and_sse_in_header_mode(&gateway, &execd_header).await;
    uri_mode(&endpoints[1], &execd_header).await;
    upgrade_without_the_scope(&base, &id, &gateway, &echo).await;
    refusals(&gateway, &echo, &endpoints).await;
    // Nothing refused above reached the echo server: one connection, the
    // upgrade's.
    assert_eq!(sh(&base, &id, "cat /tmp/conns").await.stdout, "conn\n");
    paused_sandbox_is_refused(&base, &id, &gateway, &execd_header).await;

    gw.shutdown().await.unwrap();
    api.shutdown().await.unwrap();
    env.stop().await;
}

/// Plain HTTP and a streamed answer: the first frame of a command arrives
/// while the command still runs.
async fn http_and_sse_in_header_mode(gateway: &str, scope: &str) {
    let (s, v) = via_header(gateway, scope, "ping").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let started = Instant::now();
    let mut r = reqwest::Client::new()
        .post(format!("http://{gateway}/command"))
        .header(INGRESS, scope)
        .json(&json!({"command": "echo first-frame; sleep 3; echo second-frame"}))
        .send()
        .await
        .expect("gateway answers");
    assert_eq!(r.status(), StatusCode::OK);
    assert_eq!(
        r.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let mut seen = String::new();
    while !seen.contains("first-frame") {
        let chunk = r.chunk().await.unwrap().expect("stream ended early");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        started.elapsed() < Duration::from_secs(2) && !seen.contains("second-frame"),
        "the stream was buffered: {seen:?} after {:?}",
        started.elapsed()
    );
    while let Some(chunk) = r.chunk().await.unwrap() {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(seen.contains("second-frame"), "{seen}");
}

/// Uri mode: the server's endpoint is `gateway/scope`; the path after it is
/// the sandbox's. The header wins over a path that looks like a scope.
async fn uri_mode(endpoint: &Value, header: &str) {
    let base = endpoint["endpoint"].as_str().unwrap();
    assert!(endpoint["headers"].is_null(), "{endpoint}");
    let r = reqwest::get(format!("http://{base}/ping")).await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let (gateway, scope) = base.split_once('/').unwrap();
    let r = reqwest::get(format!("http://{gateway}/{}/ping", tampered(scope)))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    // With the header, the uri-mode scope is just a path of the sandbox
    // (execd does not serve it).
    let (s, _) = via_header(gateway, header, &format!("{scope}/ping")).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
}

/// An upgraded connection spliced end to end; the sandbox saw the request
/// without the scope or an API key, with every other header.
async fn upgrade_without_the_scope(base: &str, id: &str, gateway: &str, scope: &str) {
    let head = format!(
        "GET /up HTTP/1.1\r\nHost: {gateway}\r\nConnection: Upgrade\r\nUpgrade: sandbolt-echo\r\n\
         {INGRESS}: {scope}\r\nOPEN-SANDBOX-API-KEY: {API_KEY}\r\nX-Probe: kept\r\n\r\n"
    );
    // The entrypoint may still be starting nc: execd answers 502 until then.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut conn = loop {
        let mut conn = tokio::net::TcpStream::connect(gateway).await.unwrap();
        conn.write_all(head.as_bytes()).await.unwrap();
        let answer = read_head(&mut conn).await;
        if answer.starts_with("HTTP/1.1 101") {
            break conn;
        }
        assert!(Instant::now() < deadline, "no upgrade: {answer}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    conn.write_all(b"through the gateway\n").await.unwrap();
    let mut echoed = vec![0; 20];
    tokio::time::timeout(Duration::from_secs(10), conn.read_exact(&mut echoed))
        .await
        .expect("echo in time")
        .unwrap();
    assert_eq!(echoed, b"through the gateway\n");
    drop(conn);

    let seen = sh(base, id, "cat /tmp/req").await.stdout;
    assert!(seen.starts_with("GET /up HTTP/1.1\n"), "{seen}");
    assert!(
        seen.to_ascii_lowercase().contains("x-probe: kept"),
        "{seen}"
    );
    for secret in [INGRESS, scope, "open-sandbox-api-key", API_KEY] {
        assert!(
            !seen
                .to_ascii_lowercase()
                .contains(&secret.to_ascii_lowercase()),
            "{secret} reached the sandbox: {seen}"
        );
    }
}

/// The response head of a raw HTTP/1.1 exchange.
async fn read_head(conn: &mut tokio::net::TcpStream) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut byte))
            .await
            .expect("an answer in time")
            .unwrap();
        if n == 0 {
            break;
        }
        head.push(byte[0]);
    }
    String::from_utf8_lossy(&head).into_owned()
}

/// Scopes altered in every field, signed by a foreign key, naming another
/// namespace, or missing: refused with a JSON error.
async fn refusals(gateway: &str, echo: &str, endpoints: &[Value]) {
    let forbidden = "ROUTE_SCOPE_REJECTED";
    let cases = [
        (tampered(echo), StatusCode::FORBIDDEN, forbidden),
        (with_field(echo, 4, "z"), StatusCode::FORBIDDEN, forbidden),
        (
            with_field(echo, 1, &URL_SAFE_NO_PAD.encode("other-namespace")),
            StatusCode::FORBIDDEN,
            forbidden,
        ),
        (
            with_field(echo, 2, &URL_SAFE_NO_PAD.encode("fsb-someone-else")),
            StatusCode::FORBIDDEN,
            forbidden,
        ),
        (
            with_field(echo, 3, &EXECD_PORT.to_string()),
            StatusCode::FORBIDDEN,
            forbidden,
        ),
        (
            header_scope(&endpoints[4]),
            StatusCode::FORBIDDEN,
            forbidden,
        ),
        // Signed, but the sandbox is not in that namespace.
        (
            header_scope(&endpoints[3]),
            StatusCode::NOT_FOUND,
            "SANDBOX_NOT_FOUND",
        ),
        (
            "f1.garbage".into(),
            StatusCode::BAD_REQUEST,
            "INVALID_ROUTE_SCOPE",
        ),
        (
            with_field(echo, 3, "09000"),
            StatusCode::BAD_REQUEST,
            "INVALID_ROUTE_SCOPE",
        ),
    ];
    for (scope, status, code) in cases {
        let (s, v) = via_header(gateway, &scope, "up").await;
        assert_eq!(
            (s, v["code"].as_str()),
            (status, Some(code)),
            "{scope}: {v}"
        );
        assert!(v["message"].is_string(), "{v}");
    }
    let (s, v) = call(Method::GET, format!("http://{gateway}/up"), None).await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("MISSING_ROUTE_SCOPE")),
        "{v}"
    );
}

/// A paused sandbox is refused (409), not left hanging; resumed, it answers.
async fn paused_sandbox_is_refused(base: &str, id: &str, gateway: &str, scope: &str) {
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes/{id}/pause"),
        None,
    )
    .await;
    assert!(s.is_success(), "{v}");
    let (s, v) = via_header(gateway, scope, "ping").await;
    assert_eq!(
        (s, v["code"].as_str()),
        (StatusCode::CONFLICT, Some("SANDBOX_PAUSED")),
        "{v}"
    );
    let (s, v) = call(
        Method::POST,
        format!("{base}/v1/sandboxes/{id}/resume"),
        None,
    )
    .await;
    assert!(s.is_success(), "{v}");
    let (s, v) = via_header(gateway, scope, "ping").await;
    assert_eq!(s, StatusCode::OK, "{v}");
}

/// The Docker backend cannot route by namespace: asking for a gateway there
/// is refused at start, naming why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_is_refused_on_the_docker_backend() {
    let data = tempfile::tempdir().unwrap();
    let backend = sandbolt_lifecycle::BackendConfig::Docker(sandbolt_lifecycle::DockerConfig::new(
        data.path().join("no-docker.sock"),
        data.path().join("execd"),
    ));
    let mut config = sandbolt_lifecycle::LifecycleConfig::new(
        "127.0.0.1:0".parse().unwrap(),
        backend,
        data.path(),
    );
    config.api_key = Some(API_KEY.into());
    config.gateway = Some(GatewayConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        keys: KeyRing::parse(RING).unwrap(),
    });
    let err = Lifecycle::start(config).await.err().expect("refused");
    assert!(err.to_string().contains("controller backend"), "{err}");
}
