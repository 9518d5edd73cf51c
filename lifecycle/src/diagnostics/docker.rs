//! Diagnostics on the Docker backend, from the engine: the container's
//! inspect facts, the engine's events of the container since its creation,
//! and `docker logs` (tail, bounded in bytes while it streams).

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use bollard::models::{ContainerInspectResponse, EventMessage};
use bollard::query_parameters::{EventsOptions, LogsOptions};
use chrono::{DateTime, Utc};
use futures::StreamExt;

use super::{Diagnostics, DiagnosticsQuery, MAX_LOG_BYTES, tail_of};
use crate::docker::{DockerBackend, container_name};
use crate::error::ApiResult;

/// How long the engine may take to stream events or logs: diagnostics
/// must answer while the engine is slow, that is when people call them.
const ENGINE_DEADLINE: Duration = Duration::from_secs(10);

/// Facts, events and logs of sandbox `id` within `q`. 404 unknown id;
/// events or logs the engine fails to give come as warnings.
#[tracing::instrument(name = "docker", skip_all, fields(call = "diagnostics", sandbox_id = %id))]
pub(crate) async fn gather(
    backend: &DockerBackend,
    id: &str,
    q: DiagnosticsQuery,
) -> ApiResult<Diagnostics> {
    let c = backend.inspect(id).await?;
    let mut d = Diagnostics {
        facts: facts(id, &c),
        ..Default::default()
    };
    if q.event_limit > 0 {
        match events(backend, &c, q.event_limit as usize).await {
            Ok((events, truncated)) => (d.events, d.events_truncated) = (events, truncated),
            Err(e) => d.warnings.push(format!("engine events unavailable: {e}")),
        }
    }
    if q.log_tail > 0 {
        match logs(backend, id, q).await {
            Ok((log, truncated)) => (d.log, d.log_truncated) = (log, truncated),
            Err(e) => d.warnings.push(format!("container log unavailable: {e}")),
        }
    }
    Ok(d)
}

fn yes_no(v: Option<bool>) -> String {
    v.unwrap_or(false).to_string()
}

/// What `docker inspect` says, without secrets: no environment (tokens
/// live there) and no labels (the execd token is one).
fn facts(id: &str, c: &ContainerInspectResponse) -> Vec<(&'static str, String)> {
    let cfg = c.config.clone().unwrap_or_default();
    let st = c.state.clone().unwrap_or_default();
    let host = c.host_config.clone().unwrap_or_default();
    let mut out = vec![
        ("Sandbox ID", id.to_string()),
        (
            "Container ID",
            c.id.as_deref().unwrap_or("").chars().take(12).collect(),
        ),
        (
            "Name",
            c.name
                .as_deref()
                .unwrap_or("")
                .trim_start_matches('/')
                .into(),
        ),
        ("Image", cfg.image.unwrap_or_default()),
        (
            "Status",
            st.status.map(|s| s.to_string()).unwrap_or_default(),
        ),
        ("Running", yes_no(st.running)),
        ("Paused", yes_no(st.paused)),
        ("OOM Killed", yes_no(st.oom_killed)),
        (
            "Exit Code",
            st.exit_code.map(|c| c.to_string()).unwrap_or_default(),
        ),
        ("Created At", c.created.clone().unwrap_or_default()),
        ("Started At", st.started_at.unwrap_or_default()),
        ("Finished At", st.finished_at.unwrap_or_default()),
    ];
    if let Some(e) = st.error.filter(|e| !e.is_empty()) {
        out.push(("Error", e));
    }
    if let Some(n) = host.nano_cpus.filter(|n| *n > 0) {
        out.push(("CPU", format!("{:.2} cores", n as f64 / 1e9)));
    }
    if let Some(m) = host.memory.filter(|m| *m > 0) {
        out.push(("Memory", format!("{} MiB", m >> 20)));
    }
    if let Some(p) = host.pids_limit.filter(|p| *p > 0) {
        out.push(("PIDs Limit", p.to_string()));
    }
    let mut networks: Vec<String> = c
        .network_settings
        .as_ref()
        .and_then(|n| n.networks.as_ref())
        .map(|nets| {
            nets.iter()
                .map(|(name, ep)| format!("{name}={}", ep.ip_address.as_deref().unwrap_or("")))
                .collect()
        })
        .unwrap_or_default();
    networks.sort();
    out.push(("Networks", networks.join(", ")));
    out
}

fn unix_seconds(t: DateTime<Utc>) -> String {
    format!("{}.{:09}", t.timestamp(), t.timestamp_subsec_nanos())
}

/// The engine's events of container `c` from its creation until now, the
/// newest `limit` of them as lines, and whether older ones were left out.
/// The engine keeps a bounded event history: when it no longer holds the
/// create, the container's creation time stands in for it.
async fn events(
    backend: &DockerBackend,
    c: &ContainerInspectResponse,
    limit: usize,
) -> Result<(Vec<String>, bool), String> {
    let created = c
        .created
        .as_deref()
        .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
        .map(|t| t.with_timezone(&Utc));
    let opts = EventsOptions {
        since: Some(created.map_or_else(|| "0".into(), unix_seconds)),
        until: Some(unix_seconds(Utc::now())),
        filters: Some(HashMap::from([
            ("type".to_string(), vec!["container".to_string()]),
            (
                "container".to_string(),
                vec![c.id.clone().unwrap_or_default()],
            ),
        ])),
    };
    let mut stream = backend.docker.events(Some(opts));
    let mut newest: VecDeque<String> = VecDeque::new();
    let (mut truncated, mut saw_create) = (false, false);
    let deadline = tokio::time::Instant::now() + ENGINE_DEADLINE;
    while let Some(next) = tokio::time::timeout_at(deadline, stream.next())
        .await
        .map_err(|_| format!("the engine streamed events for longer than {ENGINE_DEADLINE:?}"))?
    {
        let event = next.map_err(|e| e.to_string())?;
        saw_create |= event.action.as_deref() == Some("create");
        newest.push_back(event_line(&event));
        if newest.len() > limit {
            newest.pop_front();
            truncated = true;
        }
    }
    if !saw_create
        && !truncated
        && let Some(t) = created
    {
        newest.push_front(format!(
            "{} container create (the engine's event history no longer holds it)",
            t.to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
        ));
        if newest.len() > limit {
            newest.pop_back();
            truncated = true;
        }
    }
    Ok((newest.into(), truncated))
}

/// One engine event: when, what, and the attributes that say why (image,
/// exit code, signal).
fn event_line(e: &EventMessage) -> String {
    let at = e
        .time_nano
        .map(DateTime::from_timestamp_nanos)
        .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Nanos, true))
        .unwrap_or_default();
    let mut line = format!("{at} container {}", e.action.as_deref().unwrap_or("?"));
    let attrs = e.actor.as_ref().and_then(|a| a.attributes.as_ref());
    for key in ["image", "exitCode", "signal"] {
        if let Some(v) = attrs.and_then(|a| a.get(key)) {
            line.push_str(&format!(" {key}={v}"));
        }
    }
    line
}

/// `docker logs` of sandbox `id`: the last `q.log_tail` lines (one more is
/// asked for, to learn whether older ones exist), at most [`MAX_LOG_BYTES`]
/// of them kept while they stream.
async fn logs(
    backend: &DockerBackend,
    id: &str,
    q: DiagnosticsQuery,
) -> Result<(String, bool), String> {
    let since = q
        .log_since
        .map(|d| (Utc::now().timestamp() - d.as_secs() as i64).max(0) as i32)
        .unwrap_or(0);
    let opts = LogsOptions {
        stdout: true,
        stderr: true,
        since,
        tail: (q.log_tail + 1).to_string(),
        ..Default::default()
    };
    let mut stream = backend.docker.logs(&container_name(id), Some(opts));
    let mut buf: Vec<u8> = Vec::new();
    let deadline = tokio::time::Instant::now() + ENGINE_DEADLINE;
    while let Some(next) = tokio::time::timeout_at(deadline, stream.next())
        .await
        .map_err(|_| format!("the engine streamed logs for longer than {ENGINE_DEADLINE:?}"))?
    {
        buf.extend_from_slice(next.map_err(|e| e.to_string())?.as_ref());
        // Kept above the cap, so the final cut still sees bytes before it
        // and drops the line it splits.
        if buf.len() > 2 * MAX_LOG_BYTES {
            buf.drain(..buf.len() - MAX_LOG_BYTES - 1);
        }
    }
    Ok(tail_of(
        &String::from_utf8_lossy(&buf),
        q.log_tail as usize,
        MAX_LOG_BYTES,
    ))
}
