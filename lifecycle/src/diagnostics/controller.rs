//! Diagnostics on the controller backend: one `GetSandboxDiagnostics` call
//! brings the record, its events and the end of the container log (which
//! the controller reads from the sandbox's agent).

use chrono::{DateTime, SecondsFormat};
use sandbolt_proto::control::v1 as pb;

use super::{Diagnostics, DiagnosticsQuery, MAX_LOG_BYTES};
use crate::controller::{ControllerBackend, check_id, map_code, to_record};
use crate::error::{ApiError, ApiResult};
use crate::model::rfc3339;

/// Facts, events and logs of sandbox `id` within `q`. 404 unknown id; a
/// log the agent cannot give comes as a warning.
#[tracing::instrument(name = "controller", skip_all, fields(call = "diagnostics", sandbox_id = %id, namespace = %backend.namespace()))]
pub(crate) async fn gather(
    backend: &ControllerBackend,
    id: &str,
    q: DiagnosticsQuery,
) -> ApiResult<Diagnostics> {
    check_id(id)?;
    if q.log_since.is_some() {
        return Err(ApiError::invalid(
            "since: the controller backend's container log carries no timestamps; omit since",
        ));
    }
    let req = pb::GetSandboxDiagnosticsRequest {
        sandbox: Some(backend.reference(id)),
        log_tail_lines: q.log_tail,
        log_max_bytes: MAX_LOG_BYTES as u64,
        // 0 would mean every event; none are wanted then, one is cheap.
        event_limit: q.event_limit.max(1),
    };
    let answer = backend
        .client()
        .get_sandbox_diagnostics(req)
        .await
        .map_err(|s| map_code(s.code(), id, s.message().to_string()))?
        .into_inner();
    let sandbox = answer.sandbox.clone().unwrap_or_default();
    let mut d = Diagnostics {
        facts: facts(&sandbox),
        log: answer.log,
        log_truncated: answer.log_truncated,
        ..Default::default()
    };
    if q.event_limit > 0 {
        d.events = answer.events.iter().map(event_line).collect();
        d.events_truncated = answer.events_truncated;
    }
    if !answer.log_error.is_empty() {
        d.warnings
            .push(format!("container log unavailable: {}", answer.log_error));
    }
    Ok(d)
}

/// One record event: when, how bad, who said it in which phase, what.
fn event_line(e: &pb::SandboxEvent) -> String {
    let at =
        DateTime::from_timestamp_nanos(e.at_unix_nanos).to_rfc3339_opts(SecondsFormat::Nanos, true);
    format!("{at} {} {}/{}: {}", e.level, e.source, e.phase, e.message)
}

/// What the record says about the sandbox and where it runs.
fn facts(s: &pb::Sandbox) -> Vec<(&'static str, String)> {
    let rec = to_record(s);
    let spec = s.spec.clone().unwrap_or_default();
    let status = s.status.clone().unwrap_or_default();
    let limits = spec
        .resources
        .as_ref()
        .and_then(|r| r.limits.clone())
        .unwrap_or_default();
    let mut out = vec![
        ("Sandbox ID", s.name.clone()),
        ("Namespace", s.namespace.clone()),
        ("UID", s.uid.clone()),
        ("Image", spec.image.clone()),
        ("Entrypoint", rec.entrypoint.join(" ")),
        ("State", rec.state.as_str().to_string()),
    ];
    let optional = [
        ("Reason", rec.reason.unwrap_or_default()),
        ("Message", rec.message.unwrap_or_default()),
        ("Created At", rfc3339(rec.created_at)),
        (
            "Last Transition",
            rec.last_transition_at.map(rfc3339).unwrap_or_default(),
        ),
        (
            "Expires At",
            rec.expires_at.map(rfc3339).unwrap_or_default(),
        ),
        ("Agent", status.agent_id),
        ("Node", status.node_name),
        ("Runtime", status.runtime),
        ("Container ID", status.container_id),
        ("IP Address", status.ip_address),
        ("CPU Limit", limits.cpu),
        ("Memory Limit", limits.memory),
        (
            "PIDs Limit",
            if limits.pids > 0 {
                limits.pids.to_string()
            } else {
                String::new()
            },
        ),
        ("Warm Pool", spec.warm_pool),
        ("Snapshot", spec.snapshot_id),
    ];
    out.extend(optional.into_iter().filter(|(_, v)| !v.is_empty()));
    if status.claimed_warm {
        out.push(("Claimed Warm", "true".into()));
    }
    out
}
