//! Controller backend, sandbox snapshots: each snapshot route is one call
//! of the controller's `sandbolt.control.v1.SandboxService`'s sibling
//! `SnapshotService`, and each refusal gets its REST meaning here. The
//! controller's record is the whole snapshot; nothing is kept here.

use chrono::DateTime;
use sandbolt_proto::auth::BearerToken;
use sandbolt_proto::control::v1 as pb;
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::controller::{ControllerBackend, check_id, map_code};
use crate::error::{ApiError, ApiResult};
use crate::snapshots::{
    SandboxSnapshot, SnapshotFilter, SnapshotState, SnapshotStatus, snapshot_not_found,
};

pub(crate) type SnapshotClient =
    pb::snapshot_service_client::SnapshotServiceClient<InterceptedService<Channel, BearerToken>>;

/// What a snapshot call named, for the 404 of a NOT_FOUND.
#[derive(Debug, Clone, Copy)]
enum Target<'a> {
    /// The source sandbox of a create.
    Sandbox(&'a str),
    Snapshot(&'a str),
}

/// A refused snapshot call in REST terms: NOT_FOUND 404 (naming what is
/// missing), FAILED_PRECONDITION and ALREADY_EXISTS 409, INVALID_ARGUMENT
/// 400, UNAVAILABLE 503; the rest as every controller answer.
fn map_snapshot_status(target: Target<'_>, s: &tonic::Status) -> ApiError {
    let msg = s.message().to_string();
    match (s.code(), target) {
        (Code::NotFound, Target::Snapshot(id)) => snapshot_not_found(id),
        (Code::NotFound, Target::Sandbox(id)) => ApiError::not_found(id),
        (Code::FailedPrecondition, _) => ApiError::conflict("SNAPSHOT_INVALID_STATE", msg),
        (Code::AlreadyExists, _) => ApiError::conflict("SNAPSHOT_ALREADY_EXISTS", msg),
        (Code::Unimplemented, _) => ApiError::not_implemented(&format!(
            "Snapshots (this controller has no SnapshotService: {msg})"
        )),
        (code, Target::Sandbox(id) | Target::Snapshot(id)) => map_code(code, id, msg),
    }
}

/// The REST state of a native phase, with the reason a client can act on.
fn state_of(phase: i32) -> (SnapshotState, Option<&'static str>) {
    use pb::SnapshotPhase as P;
    match P::try_from(phase).unwrap_or(P::Unspecified) {
        P::Pending | P::Unspecified => (SnapshotState::Creating, None),
        P::Ready => (SnapshotState::Ready, None),
        P::Failed => (SnapshotState::Failed, Some("capture_failed")),
        P::Deleting => (SnapshotState::Deleting, Some("in_use")),
    }
}

fn phase_of(state: SnapshotState) -> pb::SnapshotPhase {
    match state {
        SnapshotState::Creating => pb::SnapshotPhase::Pending,
        SnapshotState::Ready => pb::SnapshotPhase::Ready,
        SnapshotState::Failed => pb::SnapshotPhase::Failed,
        SnapshotState::Deleting => pb::SnapshotPhase::Deleting,
    }
}

fn from_millis(ms: i64) -> Option<DateTime<chrono::Utc>> {
    (ms > 0)
        .then(|| DateTime::from_timestamp_millis(ms))
        .flatten()
}

/// The native record as the REST API shows it.
pub(crate) fn to_snapshot(s: &pb::Snapshot) -> SandboxSnapshot {
    let (state, reason) = state_of(s.phase);
    let message = match state {
        SnapshotState::Deleting if s.message.is_empty() && !s.in_use_by.is_empty() => {
            Some(format!(
                "deletion pending: sandboxes created from it still live ({})",
                s.in_use_by.join(", ")
            ))
        }
        _ => (!s.message.is_empty()).then(|| s.message.clone()),
    };
    SandboxSnapshot {
        id: s.id.clone(),
        name: (!s.display_name.is_empty()).then(|| s.display_name.clone()),
        sandbox_id: s.source_sandbox.clone(),
        status: SnapshotStatus {
            state,
            reason: reason.map(str::to_owned),
            message,
            last_transition_at: from_millis(s.last_transition_unix_ms),
        },
        // Epoch rather than "now" if a controller ever leaves it out, so
        // the answer does not change between reads.
        created_at: from_millis(s.created_at_unix_ms).unwrap_or_default(),
    }
}

/// The native list request for a REST filter: every match in one answer
/// (the API layer pages). `None` when the filter names only words that are
/// no state: nothing can match.
fn list_request(namespace: &str, filter: &SnapshotFilter) -> Option<pb::ListSnapshotsRequest> {
    let phases: Vec<i32> = filter
        .states
        .iter()
        .filter_map(|s| SnapshotState::parse(s))
        .map(|s| phase_of(s) as i32)
        .collect();
    if !filter.states.is_empty() && phases.is_empty() {
        return None;
    }
    Some(pb::ListSnapshotsRequest {
        namespace: namespace.to_string(),
        source_sandbox: filter.sandbox_id.clone().unwrap_or_default(),
        display_name: filter.name.clone().unwrap_or_default(),
        phases,
        page_size: 0,
        page_token: String::new(),
    })
}

impl ControllerBackend {
    fn snapshot_ref(&self, id: &str) -> pb::SnapshotRef {
        pb::SnapshotRef {
            namespace: self.namespace().to_string(),
            id: id.to_string(),
            expected_uid: String::new(),
        }
    }

    /// Answers at once (`Creating`): the capture runs on the source's node.
    #[tracing::instrument(name = "controller", skip_all, fields(call = "create_snapshot", sandbox_id = %id, namespace = %self.namespace()))]
    pub(crate) async fn snap_create(
        &self,
        id: &str,
        name: Option<String>,
    ) -> ApiResult<SandboxSnapshot> {
        check_id(id)?;
        let req = pb::CreateSnapshotRequest {
            // Every POST is a new snapshot.
            request_id: uuid::Uuid::new_v4().to_string(),
            sandbox: Some(self.reference(id)),
            display_name: name.unwrap_or_default(),
            metadata: Default::default(),
            wait: false,
        };
        let snap = self
            .snapshot_client()
            .create_snapshot(req)
            .await
            .map_err(|s| map_snapshot_status(Target::Sandbox(id), &s))?
            .into_inner();
        tracing::info!(snapshot_id = %snap.id, "snapshot accepted");
        Ok(to_snapshot(&snap))
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "get_snapshot", snapshot_id = %id, namespace = %self.namespace()))]
    pub(crate) async fn snap_get(&self, id: &str) -> ApiResult<SandboxSnapshot> {
        check_id(id).map_err(|_| snapshot_not_found(id))?;
        let snap = self
            .snapshot_client()
            .get_snapshot(self.snapshot_ref(id))
            .await
            .map_err(|s| map_snapshot_status(Target::Snapshot(id), &s))?
            .into_inner();
        Ok(to_snapshot(&snap))
    }

    #[tracing::instrument(name = "controller", skip_all, fields(call = "list_snapshots", namespace = %self.namespace()))]
    pub(crate) async fn snap_list(
        &self,
        filter: &SnapshotFilter,
    ) -> ApiResult<Vec<SandboxSnapshot>> {
        let Some(mut req) = list_request(self.namespace(), filter) else {
            return Ok(Vec::new());
        };
        // page_size 0 answers every match; the token loop is only for a
        // controller that pages anyway.
        let mut out = Vec::new();
        loop {
            let resp = self
                .snapshot_client()
                .list_snapshots(req.clone())
                .await
                .map_err(|s| map_snapshot_status(Target::Snapshot("*"), &s))?
                .into_inner();
            out.extend(resp.items.iter().map(to_snapshot));
            if resp.next_page_token.is_empty() {
                return Ok(out);
            }
            req.page_token = resp.next_page_token;
        }
    }

    /// Done, or `Deleting` until the sandboxes created from it are gone:
    /// either way the deletion is accepted.
    #[tracing::instrument(name = "controller", skip_all, fields(call = "delete_snapshot", snapshot_id = %id, namespace = %self.namespace()))]
    pub(crate) async fn snap_delete(&self, id: &str) -> ApiResult<()> {
        check_id(id).map_err(|_| snapshot_not_found(id))?;
        let snap = self
            .snapshot_client()
            .delete_snapshot(self.snapshot_ref(id))
            .await
            .map_err(|s| map_snapshot_status(Target::Snapshot(id), &s))?
            .into_inner();
        tracing::info!(phase = ?pb::SnapshotPhase::try_from(snap.phase).ok(), "snapshot delete accepted");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    #[test]
    fn refusals_map_to_http() {
        for (status, target, want, code) in [
            (
                tonic::Status::not_found("x"),
                Target::Snapshot("s"),
                StatusCode::NOT_FOUND,
                "SNAPSHOT_NOT_FOUND",
            ),
            (
                tonic::Status::not_found("x"),
                Target::Sandbox("b"),
                StatusCode::NOT_FOUND,
                "SANDBOX_NOT_FOUND",
            ),
            (
                tonic::Status::failed_precondition("capture running"),
                Target::Snapshot("s"),
                StatusCode::CONFLICT,
                "SNAPSHOT_INVALID_STATE",
            ),
            (
                tonic::Status::already_exists("request id reused"),
                Target::Sandbox("b"),
                StatusCode::CONFLICT,
                "SNAPSHOT_ALREADY_EXISTS",
            ),
            (
                tonic::Status::invalid_argument("display_name: too long"),
                Target::Sandbox("b"),
                StatusCode::BAD_REQUEST,
                "INVALID_REQUEST",
            ),
            (
                tonic::Status::unavailable("down"),
                Target::Snapshot("s"),
                StatusCode::SERVICE_UNAVAILABLE,
                "BACKEND_UNAVAILABLE",
            ),
            (
                tonic::Status::unimplemented("SnapshotService"),
                Target::Snapshot("s"),
                StatusCode::NOT_IMPLEMENTED,
                "API_NOT_SUPPORTED",
            ),
        ] {
            let e = map_snapshot_status(target, &status);
            assert_eq!((e.status, e.code), (want, code), "{status:?}");
        }
        let e = map_snapshot_status(
            Target::Snapshot("s"),
            &tonic::Status::failed_precondition("snapshot s is being captured"),
        );
        assert!(e.message.contains("being captured"), "{}", e.message);
    }

    #[test]
    fn records_render_as_rest_snapshots() {
        let mut s = pb::Snapshot {
            id: "0b6c".into(),
            display_name: "before".into(),
            source_sandbox: "sb-1".into(),
            phase: pb::SnapshotPhase::Pending as i32,
            created_at_unix_ms: 1_700_000_000_123,
            ..Default::default()
        };
        let r = to_snapshot(&s);
        assert_eq!(
            (
                r.id.as_str(),
                r.name.as_deref(),
                r.sandbox_id.as_str(),
                r.status.state
            ),
            ("0b6c", Some("before"), "sb-1", SnapshotState::Creating)
        );
        assert_eq!(r.created_at.timestamp_millis(), 1_700_000_000_123);
        assert_eq!(r.status.last_transition_at, None);
        s.phase = pb::SnapshotPhase::Deleting as i32;
        s.in_use_by = vec!["sb-2".into(), "sb-3".into()];
        s.display_name.clear();
        let r = to_snapshot(&s);
        assert_eq!(r.name, None);
        assert_eq!(r.status.state, SnapshotState::Deleting);
        assert!(r.status.message.unwrap().contains("sb-2, sb-3"));
        s.phase = pb::SnapshotPhase::Failed as i32;
        s.message = "agent said no".into();
        let r = to_snapshot(&s);
        assert_eq!(r.status.state, SnapshotState::Failed);
        assert_eq!(r.status.message.as_deref(), Some("agent said no"));
        s.phase = pb::SnapshotPhase::Ready as i32;
        assert_eq!(to_snapshot(&s).status.state, SnapshotState::Ready);
    }

    #[test]
    fn list_filters_reach_the_controller() {
        let f = SnapshotFilter {
            sandbox_id: Some("sb-1".into()),
            name: Some("n".into()),
            states: vec!["ready".into(), "Deleting".into(), "bogus".into()],
        };
        let r = list_request("team", &f).unwrap();
        assert_eq!(
            (
                r.namespace.as_str(),
                r.source_sandbox.as_str(),
                r.display_name.as_str()
            ),
            ("team", "sb-1", "n")
        );
        assert_eq!(
            r.phases,
            [
                pb::SnapshotPhase::Ready as i32,
                pb::SnapshotPhase::Deleting as i32
            ]
        );
        assert_eq!(r.page_size, 0);
        let only_bogus = SnapshotFilter {
            states: vec!["bogus".into()],
            ..Default::default()
        };
        assert!(list_request("team", &only_bogus).is_none());
        assert!(
            list_request("team", &SnapshotFilter::default())
                .unwrap()
                .phases
                .is_empty()
        );
    }
}
