//! schemathesis (PyPI, pinned in tests/python/requirements.txt) fuzzes the
//! lifecycle API from the OpenAPI document it serves (`/openapi.json`) with
//! an API key, and must find no 5xx: once on the real Docker backend, once
//! on the containerd fast path (a real controller and agent on the test
//! bed's containerd, the lifecycle in controller mode).
//!
//! Bounded by examples per operation and a time budget so it fits a busy
//! 2-core machine. `SCHEMATHESIS_SEED` replays a run (the seed is printed).

use crate::common;

use std::process::Command;

/// Test cases per operation and phase.
const MAX_EXAMPLES: &str = "15";
/// schemathesis's own budget for the whole run, in seconds.
const MAX_TIME_SECS: &str = "100";

/// Operations on `{sandbox_id}` that get the live sandbox's id, so that
/// they reach their handlers and the runtime instead of stopping at 404.
const LIVE_ID_OPERATIONS: [&str; 10] = [
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
];

/// The reverse proxy is a gateway: when nothing listens on the sandbox
/// port it answers 502 (RFC 9110 §15.6.3), and schemathesis does learn
/// the live id from responses. Exactly 502, and only there; any other
/// 5xx from the proxy (500, 503, 504) still fails the run.
const PROXY_502: &str = "[[operations]]\ninclude-path-regex = \"/proxy/\"\nchecks = { not_a_server_error = { expected-statuses = [\"2xx\", \"3xx\", \"4xx\", \"502\"] } }\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_errors() {
    let env = common::docker_env();
    let handle = env.start().await;
    let base = format!("http://{}", handle.addr());
    let live_id = create_live_sandbox(&base, &env.image).await;
    let mut extra = pin_by_name(&live_id);
    extra.push_str(PROXY_502);
    // Named volumes (`/volumes...`, `/sandboxes/{id}/volumes...`) are
    // documented for the controller backend; the Docker runtime has none
    // and answers every one of them 501 naming the route (docker_volumes.rs
    // checks the message). Exactly 501, and only there.
    extra.push_str(
        "\n[[operations]]\ninclude-path-regex = \"/volumes\"\nchecks = { not_a_server_error = { expected-statuses = [\"2xx\", \"3xx\", \"4xx\", \"501\"] } }\n",
    );
    // Warm pools (`/pools`) likewise: documented for the controller
    // backend, 501 naming the route on Docker (pool_routes' tests check
    // the message). Exactly 501, and only there.
    extra.push_str(
        "\n[[operations]]\ninclude-path-regex = \"/pools\"\nchecks = { not_a_server_error = { expected-statuses = [\"2xx\", \"3xx\", \"4xx\", \"501\"] } }\n",
    );
    let outcome = run_schemathesis(&base, &extra).await;
    delete_all(&base).await;
    handle.shutdown().await.unwrap();
    outcome.check();
}

/// The same run on the fast path: the lifecycle in controller mode over a
/// real controller (embedded store) and agent on the bed's containerd, with
/// a volume root so named volumes are served, not refused. Here volumes and
/// pools are real routes, so no 501 is expected anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_errors_on_the_fast_path() {
    let env = common::controller_env_with_volumes(16).await;
    let data = tempfile::tempdir().unwrap();
    let lifecycle = env.lifecycle(data.path()).await;
    let base = format!("http://{}", lifecycle.addr());
    let live_id = create_live_sandbox(&base, &env.image).await;
    let live_volume = "schemathesis-live";
    let created = reqwest::Client::new()
        .post(format!("{base}/v1/volumes"))
        .header("OPEN-SANDBOX-API-KEY", common::API_KEY)
        .json(&serde_json::json!({"name": live_volume}))
        .send()
        .await
        .expect("volume create reaches the server");
    assert!(created.status().is_success(), "volume create: {created:?}");
    // Every operation on the live sandbox but its delete, every one on the
    // live volume but its delete: the fuzzer reaches the handlers, the
    // controller and the agent (diagnostics, snapshots, attach and detach,
    // volume snapshots, forks and restores), not a 404.
    let mut extra = format!(
        r#"[[operations]]
include-path-regex = '\{{sandbox_id\}}'
exclude-name-regex = '^DELETE (/v1)?/sandboxes/\{{sandbox_id\}}$'
parameters = {{ "path.sandbox_id" = "{live_id}" }}

[[operations]]
include-path-regex = '\{{volume_name\}}'
exclude-name-regex = '^DELETE (/v1)?/volumes/\{{volume_name\}}$'
parameters = {{ "path.volume_name" = "{live_volume}" }}

"#
    );
    extra.push_str(PROXY_502);
    let outcome = run_schemathesis(&base, &extra).await;
    delete_all(&base).await;
    lifecycle.shutdown().await.unwrap();
    env.stop().await;
    outcome.check();
}

/// A sandbox that stays up for the whole run; its id.
async fn create_live_sandbox(base: &str, image: &str) -> String {
    let created: serde_json::Value = reqwest::Client::new()
        .post(format!("{base}/v1/sandboxes"))
        .header("OPEN-SANDBOX-API-KEY", common::API_KEY)
        .json(&serde_json::json!({
            "image": {"uri": image},
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
    created["id"]
        .as_str()
        .unwrap_or_else(|| panic!("create answered {created}"))
        .to_string()
}

/// What one schemathesis run printed and whether it passed; checked only
/// after the servers are stopped, so a failure still cleans up.
struct Outcome {
    seed: String,
    success: bool,
    text: String,
    junit: String,
}

impl Outcome {
    fn check(&self) {
        let Outcome {
            seed,
            success,
            text,
            junit,
        } = self;
        assert!(
            success,
            "schemathesis found failures (seed {seed}):\n{text}\n{junit}"
        );
        // A run that tested nothing proves nothing: the summary must show
        // operations and test cases actually exercised.
        assert!(
            text.contains("Test cases:") && text.contains("passed"),
            "schemathesis did not report any passed test cases:\n{text}"
        );
    }
}

/// The operations of [`LIVE_ID_OPERATIONS`] pinned to `live_id`.
/// DELETE keeps generated ids (schemathesis may still delete the live
/// sandbox late, with an id it learned from a response).
fn pin_by_name(live_id: &str) -> String {
    let mut toml = String::new();
    for prefix in ["", "/v1"] {
        for op in LIVE_ID_OPERATIONS {
            let (method, path) = op.split_once(' ').unwrap();
            toml.push_str(&format!(
                "[[operations]]\ninclude-name = \"{method} {prefix}{path}\"\nparameters = {{ \"path.sandbox_id\" = \"{live_id}\" }}\n\n"
            ));
        }
    }
    toml
}

/// Runs schemathesis against `base` with `config` (its operations
/// section: pinned parameters, expected statuses).
async fn run_schemathesis(base: &str, config_toml: &str) -> Outcome {
    let report = tempfile::tempdir().unwrap();
    let seed = std::env::var("SCHEMATHESIS_SEED").unwrap_or_else(|_| {
        // A fresh seed per run explores more; it is printed for replay.
        (uuid::Uuid::new_v4().as_u128() % 1_000_000_000).to_string()
    });
    println!("schemathesis seed: {seed} (SCHEMATHESIS_SEED={seed} replays it)");

    let config = report.path().join("schemathesis.toml");
    std::fs::write(&config, config_toml).unwrap();

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
        .args(["--url", base])
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
    Outcome {
        seed,
        success: out.status.success(),
        text,
        junit: std::fs::read_to_string(&junit).unwrap_or_default(),
    }
}

/// Deletes whatever the fuzzer managed to create.
async fn delete_all(base: &str) {
    let client = reqwest::Client::new();
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
}
