//! schemathesis (PyPI, pinned in tests/python/requirements.txt) fuzzes the
//! lifecycle API from the OpenAPI document it serves (`/openapi.json`), on
//! the real Docker backend with an API key, and must find no 5xx.
//!
//! Bounded by examples per operation and a time budget so it fits a busy
//! 2-core machine. `SCHEMATHESIS_SEED` replays a run (the seed is printed).

use crate::common;

use std::process::Command;

/// Test cases per operation and phase.
const MAX_EXAMPLES: &str = "15";
/// schemathesis's own budget for the whole run, in seconds.
const MAX_TIME_SECS: &str = "100";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_errors() {
    let env = common::docker_env();
    let handle = env.start().await;
    let base = format!("http://{}", handle.addr());
    let report = tempfile::tempdir().unwrap();
    let seed = std::env::var("SCHEMATHESIS_SEED").unwrap_or_else(|_| {
        // A fresh seed per run explores more; it is printed for replay.
        (uuid::Uuid::new_v4().as_u128() % 1_000_000_000).to_string()
    });
    println!("schemathesis seed: {seed} (SCHEMATHESIS_SEED={seed} replays it)");

    // A live sandbox, so that operations on {sandbox_id} reach their
    // handlers and the engine instead of stopping at 404. DELETE keeps
    // generated ids (schemathesis may still delete it late, with an id it
    // learned from a response).
    let client = reqwest::Client::new();
    let created: serde_json::Value = client
        .post(format!("{base}/v1/sandboxes"))
        .header("OPEN-SANDBOX-API-KEY", common::API_KEY)
        .json(&serde_json::json!({
            "image": {"uri": env.image},
            "entrypoint": ["sleep", "infinity"],
            "timeout": 3600,
            "resourceLimits": {},
            "metadata": {"suite": "schemathesis"},
        }))
        .send()
        .await
        .expect("create reaches the server")
        .json()
        .await
        .unwrap();
    let live_id = created["id"]
        .as_str()
        .unwrap_or_else(|| panic!("create answered {created}"))
        .to_string();
    let config = report.path().join("schemathesis.toml");
    let mut toml = String::new();
    for prefix in ["", "/v1"] {
        for op in [
            "GET /sandboxes/{sandbox_id}",
            "GET /sandboxes/{sandbox_id}/endpoints/{port}",
            "PATCH /sandboxes/{sandbox_id}/metadata",
            "POST /sandboxes/{sandbox_id}/pause",
            "POST /sandboxes/{sandbox_id}/resume",
            "POST /sandboxes/{sandbox_id}/renew-expiration",
            "GET /sandboxes/{sandbox_id}/networkpolicy",
            "PUT /sandboxes/{sandbox_id}/networkpolicy",
            "PATCH /sandboxes/{sandbox_id}/networkpolicy",
            "DELETE /sandboxes/{sandbox_id}/networkpolicy",
        ] {
            let (method, path) = op.split_once(' ').unwrap();
            toml.push_str(&format!(
                "[[operations]]\ninclude-name = \"{method} {prefix}{path}\"\nparameters = {{ \"path.sandbox_id\" = \"{live_id}\" }}\n\n"
            ));
        }
    }
    // The reverse proxy is a gateway: when nothing listens on the sandbox
    // port it answers 502 (RFC 9110 §15.6.3), and schemathesis does learn
    // the live id from responses. Exactly 502, and only there; any other
    // 5xx from the proxy (500, 503, 504) still fails the run.
    toml.push_str(
        "[[operations]]\ninclude-path-regex = \"/proxy/\"\nchecks = { not_a_server_error = { expected-statuses = [\"2xx\", \"3xx\", \"4xx\", \"502\"] } }\n",
    );
    // Named volumes (`/volumes...`, `/sandboxes/{id}/volumes...`) are
    // documented for the controller backend; the Docker runtime has none
    // and answers every one of them 501 naming the route (docker_volumes.rs
    // checks the message). Exactly 501, and only there.
    toml.push_str(
        "\n[[operations]]\ninclude-path-regex = \"/volumes\"\nchecks = { not_a_server_error = { expected-statuses = [\"2xx\", \"3xx\", \"4xx\", \"501\"] } }\n",
    );
    // Warm pools (`/pools`) likewise: documented for the controller
    // backend, 501 naming the route on Docker (pool_routes' tests check
    // the message). Exactly 501, and only there.
    toml.push_str(
        "\n[[operations]]\ninclude-path-regex = \"/pools\"\nchecks = { not_a_server_error = { expected-statuses = [\"2xx\", \"3xx\", \"4xx\", \"501\"] } }\n",
    );
    std::fs::write(&config, toml).unwrap();

    let python =
        sandbolt_testbed::python().expect("the repo's venv python (scripts/python-env.sh)");
    let schemathesis = python.with_file_name("schemathesis");
    assert!(
        schemathesis.is_file(),
        "{} missing: is schemathesis in tests/python/requirements.txt?",
        schemathesis.display()
    );
    let junit = report.path().join("junit.xml");
    let mut cmd = Command::new(&schemathesis);
    cmd.arg("--config-file")
        .arg(&config)
        .arg("run")
        .arg(format!("{base}/openapi.json"))
        .args(["--url", &base])
        .args(["-H", &format!("OPEN-SANDBOX-API-KEY: {}", common::API_KEY)])
        // The check this test is about: no 5xx, no server crash.
        .args(["--checks", "not_a_server_error"])
        .args(["--phases", "examples,coverage,fuzzing,stateful"])
        .args(["--max-examples", MAX_EXAMPLES])
        .args(["--max-time", MAX_TIME_SECS])
        // One worker: hypothesis on Python 3.11 is not thread-safe when it
        // compiles lambda sources ("AST constructor recursion depth mismatch").
        .args(["--workers", "1"])
        .args(["--request-timeout", "60"])
        .args(["--seed", &seed])
        .arg("--no-color")
        .args(["--report", "junit"])
        .arg("--report-junit-path")
        .arg(&junit)
        .args(["--generation-database", "none"])
        .env("HOME", report.path())
        .current_dir(report.path());
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .expect("schemathesis runs");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    let junit = std::fs::read_to_string(&junit).unwrap_or_default();
    assert!(
        out.status.success(),
        "schemathesis found failures (seed {seed}):\n{text}\n{junit}"
    );
    // A run that tested nothing proves nothing: the summary must show
    // operations and test cases actually exercised.
    assert!(
        text.contains("Test cases:") && text.contains("passed"),
        "schemathesis did not report any passed test cases:\n{text}"
    );

    // Clean up whatever the fuzzer managed to create.
    let list: serde_json::Value = client
        .get(format!("{base}/v1/sandboxes?pageSize=200"))
        .header("OPEN-SANDBOX-API-KEY", common::API_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for item in list["items"].as_array().into_iter().flatten() {
        if let Some(id) = item["id"].as_str() {
            let _ = client
                .delete(format!("{base}/v1/sandboxes/{id}"))
                .header("OPEN-SANDBOX-API-KEY", common::API_KEY)
                .send()
                .await;
        }
    }
    handle.shutdown().await.unwrap();
}
