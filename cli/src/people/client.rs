//! The lifecycle server's REST API as the people commands call it: every
//! answer that is not a success becomes a [`Failure`] that says what went
//! wrong and what to do, with the exit code of its kind.

use std::time::Duration;

use reqwest::{Method, StatusCode};
use serde_json::Value;

use super::config::Connection;
use super::output::{print_done, print_json};
use super::{Exit, Failure};

/// The header the OpenSandbox Lifecycle API reads its key from.
const API_KEY_HEADER: &str = "OPEN-SANDBOX-API-KEY";

/// What a call is about, for its messages: `sandbox 1a2b…`, and the
/// command that lists such things.
pub(crate) struct Target<'a> {
    pub what: String,
    pub list_with: &'a str,
}

impl<'a> Target<'a> {
    pub fn new(what: impl Into<String>, list_with: &'a str) -> Self {
        Self {
            what: what.into(),
            list_with,
        }
    }
}

/// A client of one lifecycle server.
pub(crate) struct Lifecycle {
    http: reqwest::Client,
    conn: Connection,
}

impl Lifecycle {
    pub fn new(conn: Connection) -> Result<Self, Failure> {
        let http = reqwest::Client::builder()
            // A server that does not answer the connect in this long is
            // not going to; waiting longer only hides the mistake.
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| Failure::new(Exit::Error, format!("cannot set up HTTP: {e}")))?;
        Ok(Self { http, conn })
    }

    /// The HTTP client, for calls to a sandbox's execd.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// `http` or `https`: execd endpoints are reached the way the server
    /// is, as the SDKs do.
    pub fn scheme(&self) -> &str {
        if self.conn.server.starts_with("https://") {
            "https"
        } else {
            "http"
        }
    }

    /// `method path` (under `/v1`) with an optional JSON body; the answer
    /// when it is a success.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        target: &Target<'_>,
    ) -> Result<reqwest::Response, Failure> {
        let mut req = self
            .http
            .request(method, format!("{}/v1{path}", self.conn.server));
        if let Some(key) = &self.conn.api_key {
            req = req.header(API_KEY_HEADER, key);
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req.send().await.map_err(|e| self.transport(&e))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        Err(self.refusal(status, &text, target))
    }

    /// [`Self::call`], its answer read as JSON (`null` for an empty one).
    pub async fn json(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
        target: &Target<'_>,
    ) -> Result<Value, Failure> {
        let resp = self.call(method, path, body, target).await?;
        let bytes = resp.bytes().await.map_err(|e| self.transport(&e))?;
        if bytes.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes).map_err(|e| {
            Failure::new(
                Exit::Error,
                format!(
                    "{}: {} answered something that is not JSON ({e}); is it a lifecycle server?",
                    target.what, self.conn.server
                ),
            )
        })
    }

    /// `GET path` as JSON.
    pub async fn get(&self, path: &str, target: &Target<'_>) -> Result<Value, Failure> {
        self.json(Method::GET, path, None, target).await
    }

    /// A request that got no answer.
    pub fn transport(&self, e: &reqwest::Error) -> Failure {
        let cause = innermost(e);
        if e.is_connect() || e.is_timeout() {
            return Failure::new(
                Exit::Unreachable,
                format!(
                    "cannot reach the lifecycle server at {}: {cause}. Start one (`sandbolt up`) \
                     or point at yours with --server, SANDBOLT_SERVER or `server` in {}",
                    self.conn.server,
                    self.config_file()
                ),
            );
        }
        Failure::new(
            Exit::Unreachable,
            format!(
                "the connection to {} broke: {cause}; try again",
                self.conn.server
            ),
        )
    }

    /// A non-success answer, as a message and an exit code.
    fn refusal(&self, status: StatusCode, text: &str, target: &Target<'_>) -> Failure {
        let (code, message) = error_body(text);
        let server = &self.conn.server;
        match status {
            StatusCode::UNAUTHORIZED => {
                let problem = if code == "MISSING_API_KEY" {
                    "needs an API key".to_string()
                } else {
                    format!("refused the API key ({code})")
                };
                Failure::new(
                    Exit::Unauthorized,
                    format!(
                        "{server} {problem}: give the key the server was started with \
                         (--api-key, SANDBOLT_API_KEY or `api_key` in {})",
                        self.config_file()
                    ),
                )
            }
            StatusCode::NOT_FOUND => Failure::new(
                Exit::NotFound,
                format!(
                    "{} not found: {message} [{code}]; `{}` lists what there is",
                    target.what, target.list_with
                ),
            ),
            StatusCode::NOT_IMPLEMENTED => Failure::new(
                Exit::Error,
                format!("{} is not served by {server}: {message}", target.what),
            ),
            _ => Failure::new(
                Exit::Error,
                format!(
                    "{}: {server} answered {status}: {message} [{code}]",
                    target.what
                ),
            ),
        }
    }

    fn config_file(&self) -> String {
        match &self.conn.config_file {
            Some(p) => p.display().to_string(),
            None => "the config file".to_string(),
        }
    }
}

/// `GET path`, printed as JSON or by `show`.
pub(crate) async fn show_one(
    lc: &Lifecycle,
    path: &str,
    target: &Target<'_>,
    json: bool,
    show: fn(&Value),
) -> Result<(), Failure> {
    let v = lc.get(path, target).await?;
    if json {
        print_json(&v);
    } else {
        show(&v);
    }
    Ok(())
}

/// `DELETE path`; prints `name` (or `{"removed": name}`).
pub(crate) async fn remove_one(
    lc: &Lifecycle,
    path: &str,
    name: &str,
    target: &Target<'_>,
    json: bool,
) -> Result<(), Failure> {
    lc.json(Method::DELETE, path, None, target).await?;
    print_done(json, name, &serde_json::json!({ "removed": name }));
    Ok(())
}

/// The `{code, message}` of an OpenSandbox error answer, or what the
/// answer said when it is not one.
pub(crate) fn error_body(text: &str) -> (String, String) {
    let v: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    let field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    let code = field("code").unwrap_or_else(|| "no code".to_string());
    let message = field("message").unwrap_or_else(|| {
        let t = text.trim();
        if t.is_empty() {
            "no message".to_string()
        } else {
            t.chars().take(300).collect()
        }
    });
    (code, message)
}

/// The deepest cause of an HTTP error (`Connection refused (os error
/// 111)`), which says more than reqwest's outer layers.
fn innermost(e: &reqwest::Error) -> String {
    let mut cur: &dyn std::error::Error = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}
