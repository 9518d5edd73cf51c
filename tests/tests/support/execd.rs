//! Commands through execd's `/command`, as the end-to-end tests run them:
//! one request, its streamed answer read whole into an [`Output`].
//!
//! Included by `support/warm.rs` and `support/volumes.rs` (as their
//! `execd` module).

#![allow(dead_code)]

use serde_json::{Value, json};

/// What one command run through execd answered.
#[derive(Debug, Default)]
pub struct Output {
    pub stdout: String,
    pub stderr: String,
    /// The error frame when the command did not exit 0.
    pub error: Option<String>,
}

/// The lifecycle's answer to `GET /sandboxes/<id>/endpoints/44772` →
/// (`host:port/route`, headers to send).
pub fn rest_endpoint(ep: &Value) -> (String, Vec<(String, String)>) {
    let headers = ep["headers"]
        .as_object()
        .map(|h| {
            h.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                .collect()
        })
        .unwrap_or_default();
    (
        ep["endpoint"].as_str().expect("endpoint").to_string(),
        headers,
    )
}

/// Runs `command` with `sh -c` through execd at `endpoint` (with
/// `headers`); `what` names the sandbox in panics. Panics unless execd
/// accepts the command.
pub async fn run_command<K: AsRef<str>, V: AsRef<str>>(
    http: &reqwest::Client,
    endpoint: &str,
    headers: impl IntoIterator<Item = (K, V)>,
    what: &str,
    command: &str,
) -> Output {
    let mut rb = http.post(format!("http://{endpoint}/command"));
    for (k, v) in headers {
        rb = rb.header(k.as_ref(), v.as_ref());
    }
    let r = rb
        .json(&json!({ "command": command }))
        .send()
        .await
        .unwrap_or_else(|e| panic!("execd of {what}: {e}"));
    assert!(
        r.status().is_success(),
        "execd of {what} refused {command:?}: {}",
        r.status()
    );
    parse_command_stream(&r.text().await.unwrap())
}

/// execd's `/command` answer (bare JSON frames separated by blank lines)
/// → what the command printed, and its error frame when it did not exit 0.
pub fn parse_command_stream(body: &str) -> Output {
    let mut out = Output::default();
    for frame in body.split("\n\n").filter(|f| !f.trim().is_empty()) {
        let v: Value = serde_json::from_str(frame)
            .unwrap_or_else(|e| panic!("bad execd frame {frame:?}: {e}"));
        match v["type"].as_str() {
            Some("stdout") => out.stdout.push_str(v["text"].as_str().unwrap_or("")),
            Some("stderr") => out.stderr.push_str(v["text"].as_str().unwrap_or("")),
            Some("error") => out.error = Some(v.to_string()),
            _ => {}
        }
    }
    out
}
