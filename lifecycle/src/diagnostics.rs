//! The OpenSandbox diagnostics routes (`/sandboxes/{id}/diagnostics/logs`,
//! `events`, `inspect`, `summary`): the wire shapes, the query checks and
//! the text the deprecated plain-text forms answer. A [`Backend`] gathers
//! the facts ([`Backend::diagnostics`]): the controller from its record and
//! the sandbox's agent (see `diagnostics/controller.rs`), Docker from the
//! engine (see `diagnostics/docker.rs`).
//!
//! With `scope`, logs and events answer the stable JSON descriptor the SDK's
//! `get_diagnostic_logs` / `get_diagnostic_events` parse, inline, with
//! `truncated` saying whether older lines were left out. Without it they
//! answer the deprecated plain text (header `Deprecation: true`). Every
//! answer is bounded: at most [`MAX_TAIL_LINES`] log lines,
//! [`MAX_EVENT_LIMIT`] events and [`MAX_LOG_BYTES`] of log.

mod controller;
mod docker;
#[cfg(test)]
mod prop_tests;

pub(crate) use controller::gather as of_controller;
pub(crate) use docker::gather as of_docker;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;

use crate::api::{App, form_decode};
use crate::backend::Backend;
use crate::error::{ApiError, ApiResult};

/// Log lines of the stable JSON form (the OpenSandbox server's bound).
pub const STABLE_LOG_LINES: u32 = 100;
/// Events of the stable JSON form (the OpenSandbox server's bound).
pub const STABLE_EVENTS: u32 = 50;
/// The largest `tail` the API takes.
pub const MAX_TAIL_LINES: u32 = 10_000;
/// The largest event `limit` the API takes.
pub const MAX_EVENT_LIMIT: u32 = 500;
/// The most log bytes one answer carries (the newest ones).
pub const MAX_LOG_BYTES: usize = 1 << 20;

const TEXT: &str = "text/plain; charset=utf-8";
const LOG_SCOPES: &[&str] = &["container", "all"];
const EVENT_SCOPES: &[&str] = &["runtime", "all"];

/// How much of a sandbox's history a route wants. 0 = none of that kind
/// (the facts about its container always come).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiagnosticsQuery {
    /// The last this many log lines.
    pub log_tail: u32,
    /// Only log output newer than this.
    pub log_since: Option<Duration>,
    /// The newest this many events.
    pub event_limit: u32,
}

/// What a backend knows about one sandbox, within a [`DiagnosticsQuery`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Diagnostics {
    /// `(name, value)` facts about the sandbox and its container, in the
    /// order they are shown. Never secrets (tokens, environment).
    pub facts: Vec<(&'static str, String)>,
    /// One line per event, oldest first.
    pub events: Vec<String>,
    /// Older events exist that are not in `events`.
    pub events_truncated: bool,
    /// The end of the container log (stdout and stderr).
    pub log: String,
    /// Older log output exists that is not in `log`.
    pub log_truncated: bool,
    /// What could not be gathered, and why (e.g. the agent is lost).
    pub warnings: Vec<String>,
}

/// The routes, for [`crate::api::router`] to merge.
pub fn routes<B: Backend>() -> Router<Arc<App<B>>> {
    Router::new()
        .route("/sandboxes/{id}/diagnostics/logs", get(logs::<B>))
        .route("/sandboxes/{id}/diagnostics/events", get(events::<B>))
        .route("/sandboxes/{id}/diagnostics/inspect", get(inspect::<B>))
        .route("/sandboxes/{id}/diagnostics/summary", get(summary::<B>))
}

type AppState<B> = State<Arc<App<B>>>;

/// The stable Diagnostics API descriptor (inline delivery only).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Descriptor<'a> {
    sandbox_id: &'a str,
    kind: &'static str,
    scope: &'static str,
    delivery: &'static str,
    content_type: &'static str,
    content: &'a str,
    content_length: usize,
    truncated: bool,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    warnings: &'a [String],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Logs,
    Events,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Logs => "logs",
            Kind::Events => "events",
        }
    }

    fn scopes(self) -> &'static [&'static str] {
        match self {
            Kind::Logs => LOG_SCOPES,
            Kind::Events => EVENT_SCOPES,
        }
    }
}

/// The scope as the answer names it (trimmed, lower case), or the 400 the
/// contract gives an unsupported one.
fn scope_of(kind: Kind, requested: &str) -> ApiResult<&'static str> {
    let normalized = requested.trim().to_ascii_lowercase();
    kind.scopes()
        .iter()
        .find(|s| **s == normalized)
        .copied()
        .ok_or_else(|| {
            ApiError::invalid_code(
                "DIAGNOSTICS_SCOPE_UNSUPPORTED",
                format!(
                    "Unsupported {} diagnostics scope {requested:?}. Supported scopes: {}.",
                    kind.as_str(),
                    kind.scopes().join(", ")
                ),
            )
        })
}

/// An integer query parameter within `1..=max`.
fn bounded(name: &str, v: &str, max: u32) -> ApiResult<u32> {
    v.parse()
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| ApiError::invalid(format!("{name} must be an integer in 1..{max}")))
}

/// `since` as the deprecated logs form takes it: a count and a unit
/// (`30s`, `10m`, `1h`, `2d`).
fn parse_since(v: &str) -> ApiResult<Duration> {
    let v = v.trim();
    let bad = || ApiError::invalid(format!("since {v:?} is not a duration such as 10m or 1h"));
    let unit_at = v.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let count: u64 = v[..unit_at].parse().map_err(|_| bad())?;
    let unit = match v[unit_at..].trim() {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    // Within i64 seconds: the Docker backend subtracts it from the clock.
    count
        .checked_mul(unit)
        .filter(|s| i64::try_from(*s).is_ok())
        .map(Duration::from_secs)
        .ok_or_else(bad)
}

/// The query of the logs route.
#[derive(Debug, Default, PartialEq)]
struct LogsQuery {
    scope: Option<String>,
    tail: Option<u32>,
    since: Option<Duration>,
}

impl LogsQuery {
    /// What to read: `tail` and `since` bound both forms (the JSON
    /// descriptor and the deprecated text) — accepted, so they take effect.
    fn wanted(&self) -> DiagnosticsQuery {
        DiagnosticsQuery {
            log_tail: self.tail.unwrap_or(STABLE_LOG_LINES),
            log_since: self.since,
            event_limit: 0,
        }
    }
}

fn parse_logs_query(q: &str) -> ApiResult<LogsQuery> {
    let mut out = LogsQuery::default();
    for (k, v) in form_decode(q) {
        match k.as_str() {
            "scope" => out.scope = Some(v),
            "tail" => out.tail = Some(bounded("tail", &v, MAX_TAIL_LINES)?),
            "since" => out.since = Some(parse_since(&v)?),
            // Every sandbox is one container: the default is the only one.
            "container" if !v.is_empty() && v != "sandbox" => {
                return Err(ApiError::invalid(format!(
                    "container {v:?}: a sandbolt sandbox has one container, \"sandbox\""
                )));
            }
            _ => {}
        }
    }
    Ok(out)
}

/// The query of the events route: its scope and deprecated `limit`.
fn parse_events_query(q: &str) -> ApiResult<(Option<String>, Option<u32>)> {
    let (mut scope, mut limit) = (None, None);
    for (k, v) in form_decode(q) {
        match k.as_str() {
            "scope" => scope = Some(v),
            "limit" => limit = Some(bounded("limit", &v, MAX_EVENT_LIMIT)?),
            _ => {}
        }
    }
    Ok((scope, limit))
}

/// The query of the summary route: `tail` and `event_limit`.
fn parse_summary_query(q: &str) -> ApiResult<(u32, u32)> {
    let (mut tail, mut events) = (50, 20);
    for (k, v) in form_decode(q) {
        match k.as_str() {
            "tail" => tail = bounded("tail", &v, MAX_TAIL_LINES)?,
            "event_limit" => events = bounded("event_limit", &v, MAX_EVENT_LIMIT)?,
            _ => {}
        }
    }
    Ok((tail, events))
}

fn descriptor(id: &str, kind: Kind, scope: &'static str, d: &Diagnostics) -> Response {
    let events_text;
    let (content, truncated) = match kind {
        Kind::Logs => (d.log.as_str(), d.log_truncated),
        Kind::Events => {
            events_text = lines_text(&d.events);
            (events_text.as_str(), d.events_truncated)
        }
    };
    let mut warnings = d.warnings.clone();
    if scope == "all" {
        warnings.push(match kind {
            Kind::Logs => {
                "This backend contributes only the sandbox's container log to the all scope.".into()
            }
            Kind::Events => {
                "This backend contributes only the sandbox's runtime events to the all scope."
                    .into()
            }
        });
    }
    let body = Descriptor {
        sandbox_id: id,
        kind: kind.as_str(),
        scope,
        delivery: "inline",
        content_type: TEXT,
        content,
        content_length: content.len(),
        truncated,
        warnings: &warnings,
    };
    (StatusCode::OK, axum::Json(body)).into_response()
}

/// `lines`, each ending with a newline.
fn lines_text(lines: &[String]) -> String {
    lines.iter().map(|l| format!("{l}\n")).collect()
}

/// The facts, one `Name:  value` per line.
fn facts_text(facts: &[(&'static str, String)]) -> String {
    facts
        .iter()
        .map(|(name, value)| format!("{:<18}{value}\n", format!("{name}:")))
        .collect()
}

/// A section of plain text: the content, or a placeholder for none, then
/// the warnings.
fn section_text(content: &str, none: &str, truncated: bool, warnings: &[String]) -> String {
    let mut out = if content.is_empty() {
        format!("({none})\n")
    } else if content.ends_with('\n') {
        content.to_string()
    } else {
        format!("{content}\n")
    };
    if truncated {
        out.insert_str(0, "[older entries left out]\n");
    }
    for w in warnings {
        out.push_str(&format!("[warning] {w}\n"));
    }
    out
}

/// A deprecated plain-text answer (logs and events without `scope`).
fn deprecated_text(body: String) -> Response {
    let mut resp = plain_text(body);
    resp.headers_mut()
        .insert("deprecation", HeaderValue::from_static("true"));
    resp
}

fn plain_text(body: String) -> Response {
    ([(header::CONTENT_TYPE, TEXT)], body).into_response()
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id, scope = tracing::field::Empty))]
async fn logs<B: Backend>(
    State(app): AppState<B>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let q = parse_logs_query(q.as_deref().unwrap_or(""))?;
    let want = q.wanted();
    if let Some(requested) = &q.scope {
        let scope = scope_of(Kind::Logs, requested)?;
        tracing::Span::current().record("scope", scope);
        let d = app.backend.diagnostics(&id, want).await?;
        return Ok(descriptor(&id, Kind::Logs, scope, &d));
    }
    let d = app.backend.diagnostics(&id, want).await?;
    Ok(deprecated_text(section_text(
        &d.log,
        "no logs",
        d.log_truncated,
        &d.warnings,
    )))
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id, scope = tracing::field::Empty))]
async fn events<B: Backend>(
    State(app): AppState<B>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let (scope, limit) = parse_events_query(q.as_deref().unwrap_or(""))?;
    // `limit` bounds both forms: accepted, so it takes effect.
    let want = DiagnosticsQuery {
        event_limit: limit.unwrap_or(STABLE_EVENTS),
        ..Default::default()
    };
    if let Some(requested) = &scope {
        let scope = scope_of(Kind::Events, requested)?;
        tracing::Span::current().record("scope", scope);
        let d = app.backend.diagnostics(&id, want).await?;
        return Ok(descriptor(&id, Kind::Events, scope, &d));
    }
    let d = app.backend.diagnostics(&id, want).await?;
    Ok(deprecated_text(section_text(
        &lines_text(&d.events),
        "no events",
        d.events_truncated,
        &d.warnings,
    )))
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
async fn inspect<B: Backend>(
    State(app): AppState<B>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let d = app
        .backend
        .diagnostics(&id, DiagnosticsQuery::default())
        .await?;
    Ok(plain_text(facts_text(&d.facts)))
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
async fn summary<B: Backend>(
    State(app): AppState<B>,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> ApiResult<Response> {
    let (tail, event_limit) = parse_summary_query(q.as_deref().unwrap_or(""))?;
    let want = DiagnosticsQuery {
        log_tail: tail,
        log_since: None,
        event_limit,
    };
    let d = app.backend.diagnostics(&id, want).await?;
    Ok(plain_text(summary_text(
        &id,
        app.backend.runtime_name(),
        tail,
        event_limit,
        &d,
    )))
}

/// Inspect, events and logs of one sandbox as one text.
fn summary_text(id: &str, runtime: &str, tail: u32, event_limit: u32, d: &Diagnostics) -> String {
    let rule = "=".repeat(72);
    let mut out = format!("{rule}\nDiagnostics of sandbox {id} ({runtime} backend)\n{rule}\n");
    out.push_str("\n--- Inspect ---\n");
    out.push_str(&facts_text(&d.facts));
    out.push_str(&format!("\n--- Events (newest {event_limit}) ---\n"));
    out.push_str(&section_text(
        &lines_text(&d.events),
        "no events",
        d.events_truncated,
        &[],
    ));
    out.push_str(&format!("\n--- Logs (last {tail} lines) ---\n"));
    out.push_str(&section_text(&d.log, "no logs", d.log_truncated, &[]));
    if !d.warnings.is_empty() {
        out.push_str("\n--- Warnings ---\n");
        out.push_str(&lines_text(&d.warnings));
    }
    out
}

/// The end of `text`: its last `lines` lines within its last `max_bytes`
/// bytes (a line the byte bound cuts is dropped, unless it is the only
/// one), and whether anything was left out. A final newline ends the last
/// line; it does not start another.
pub(crate) fn tail_of(text: &str, lines: usize, max_bytes: usize) -> (String, bool) {
    let mut start = text.len().saturating_sub(max_bytes);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    let mut window = &text[start..];
    if start > 0
        && let Some(nl) = window.find('\n')
        && nl + 1 < window.len()
    {
        window = &window[nl + 1..];
    }
    let body = window.strip_suffix('\n').unwrap_or(window);
    if lines == 0 {
        return (String::new(), !window.is_empty());
    }
    match body.rmatch_indices('\n').nth(lines - 1) {
        Some((i, _)) => (window[i + 1..].to_string(), true),
        None => (window.to_string(), start > 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_are_normalized_and_unknown_ones_refused() {
        assert_eq!(scope_of(Kind::Logs, " Container ").unwrap(), "container");
        assert_eq!(scope_of(Kind::Events, "ALL").unwrap(), "all");
        let e = scope_of(Kind::Logs, "lifecycle").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.code, "DIAGNOSTICS_SCOPE_UNSUPPORTED");
        assert!(e.message.contains("container, all"), "{}", e.message);
        assert!(scope_of(Kind::Events, "").is_err());
    }

    #[test]
    fn query_bounds_are_the_contracts() {
        assert_eq!(parse_logs_query("tail=10000").unwrap().tail, Some(10_000));
        assert!(parse_logs_query("tail=10001").is_err());
        assert!(parse_logs_query("tail=0").is_err());
        assert!(parse_events_query("limit=501").is_err());
        assert_eq!(parse_summary_query("").unwrap(), (50, 20));
        assert!(parse_summary_query("event_limit=x").is_err());
        assert!(parse_logs_query("container=sidecar").is_err());
        assert!(parse_logs_query("container=sandbox").is_ok());
    }

    #[test]
    fn tail_and_since_bound_the_scoped_form_too() {
        let q = parse_logs_query("scope=container&tail=5&since=10m").unwrap();
        let want = q.wanted();
        assert_eq!(want.log_tail, 5);
        assert_eq!(want.log_since, Some(Duration::from_secs(600)));
        assert_eq!(
            parse_logs_query("scope=all").unwrap().wanted().log_tail,
            STABLE_LOG_LINES
        );
    }

    #[test]
    fn since_takes_a_count_and_a_unit() {
        assert_eq!(parse_since("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(parse_since("2d").unwrap(), Duration::from_secs(172_800));
        for bad in ["", "m", "10", "10y", "-1h", "99999999999999999999d"] {
            assert!(parse_since(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_tail_keeps_whole_newest_lines_and_says_what_it_cut() {
        assert_eq!(tail_of("a\nb\nc\n", 2, 100), ("b\nc\n".into(), true));
        assert_eq!(tail_of("a\nb\nc\n", 3, 100), ("a\nb\nc\n".into(), false));
        assert_eq!(tail_of("a\nb\nc", 1, 100), ("c".into(), true));
        // The last 5 bytes are "\nbb\nc": no line is cut, the first is out.
        assert_eq!(tail_of("aaaa\nbb\nc", 10, 5), ("bb\nc".into(), true));
        assert_eq!(tail_of("0123456789", 10, 4), ("6789".into(), true));
        assert_eq!(tail_of("", 10, 4), (String::new(), false));
    }

    #[tokio::test]
    async fn the_descriptor_has_the_sdks_fields() {
        let d = Diagnostics {
            log: "hello\n".into(),
            log_truncated: true,
            ..Default::default()
        };
        let resp = descriptor("sbx", Kind::Logs, "all", &d);
        assert_eq!(resp.status(), StatusCode::OK);
        let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["sandboxId"], "sbx");
        assert_eq!(v["kind"], "logs");
        assert_eq!(v["scope"], "all");
        assert_eq!(v["delivery"], "inline");
        assert_eq!(v["contentType"], TEXT);
        assert_eq!(v["content"], "hello\n");
        assert_eq!(v["contentLength"], 6);
        assert_eq!(v["truncated"], true);
        // "all" says what it holds.
        assert_eq!(v["warnings"].as_array().map(Vec::len), Some(1));
    }
}
