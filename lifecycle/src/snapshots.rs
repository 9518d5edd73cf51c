//! Sandbox snapshots as a REST resource (OpenSandbox 1.1.1:
//! `POST /sandboxes/{id}/snapshots`, `GET /snapshots`,
//! `GET`/`DELETE /snapshots/{id}`): the wire types, the request checks,
//! filtering and paging, and the routes. A [`crate::Backend`] captures,
//! reads and removes them (the controller over its `SnapshotService`, the
//! Docker runtime with `docker commit`); a create with `snapshotId`
//! restores one into a new sandbox (see [`crate::validate`]).

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize, Serializer};

use crate::api::{App, form_decode, page_number, page_size, paginate};
use crate::backend::Backend;
use crate::error::{ApiError, ApiResult};
use crate::model::{PaginationInfo, rfc3339};

/// Longest snapshot name (the controller's display-name bound).
pub const MAX_NAME_LEN: usize = 253;

/// A snapshot's lifecycle state as the API spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotState {
    /// The capture is running; nothing can be created from it yet.
    Creating,
    Ready,
    /// The capture failed; `message` says why. Delete it.
    Failed,
    /// Deletion was asked while sandboxes created from it live: it goes
    /// with the last of them, and no new sandbox can come from it.
    Deleting,
}

impl SnapshotState {
    pub fn as_str(self) -> &'static str {
        match self {
            SnapshotState::Creating => "Creating",
            SnapshotState::Ready => "Ready",
            SnapshotState::Failed => "Failed",
            SnapshotState::Deleting => "Deleting",
        }
    }

    /// The state a list filter names (any case); `None` for a word that
    /// is no state, which then matches nothing.
    pub fn parse(s: &str) -> Option<Self> {
        [
            SnapshotState::Creating,
            SnapshotState::Ready,
            SnapshotState::Failed,
            SnapshotState::Deleting,
        ]
        .into_iter()
        .find(|st| st.as_str().eq_ignore_ascii_case(s))
    }
}

impl Serialize for SnapshotState {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

fn time<S: Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&rfc3339(*t))
}

fn maybe_time<S: Serializer>(t: &Option<DateTime<Utc>>, s: S) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => time(t, s),
        None => s.serialize_none(),
    }
}

/// `SnapshotStatus`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotStatus {
    pub state: SnapshotState,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", serialize_with = "maybe_time")]
    pub last_transition_at: Option<DateTime<Utc>>,
}

impl SnapshotStatus {
    /// A state with nothing more to say.
    pub fn plain(state: SnapshotState) -> Self {
        Self {
            state,
            reason: None,
            message: None,
            last_transition_at: None,
        }
    }
}

/// `Snapshot`: what every backend answers and the wire shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxSnapshot {
    pub id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The source sandbox.
    pub sandbox_id: String,
    pub status: SnapshotStatus,
    #[serde(serialize_with = "time")]
    pub created_at: DateTime<Utc>,
}

/// `ListSnapshotsResponse`.
#[derive(Debug, Serialize)]
pub struct ListSnapshotsResponse {
    pub items: Vec<SandboxSnapshot>,
    pub pagination: PaginationInfo,
}

/// `CreateSnapshotRequest`; the body may also be empty or `null`.
#[derive(Debug, Default, Deserialize)]
struct CreateSnapshotRequest {
    name: Option<String>,
}

/// The snapshot name of a create body, checked: 1..=253 characters, no
/// control characters (it is stored as a label or a record field).
pub fn parse_create(raw: &[u8]) -> ApiResult<Option<String>> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let req: Option<CreateSnapshotRequest> = serde_json::from_slice(raw)
        .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))?;
    let Some(name) = req.unwrap_or_default().name else {
        return Ok(None);
    };
    if name.is_empty() || name.chars().count() > MAX_NAME_LEN {
        return Err(ApiError::invalid(format!(
            "name must be 1..{MAX_NAME_LEN} characters"
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            "name must not contain control characters",
        ));
    }
    Ok(Some(name))
}

pub fn snapshot_not_found(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "SNAPSHOT_NOT_FOUND",
        format!("Snapshot {id} not found."),
    )
}

/// What `GET /snapshots` selects (all given filters must hold; `states`
/// is an OR).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SnapshotFilter {
    pub sandbox_id: Option<String>,
    pub name: Option<String>,
    /// As the client spelled them; a word that is no state matches nothing.
    pub states: Vec<String>,
}

impl SnapshotFilter {
    pub fn matches(&self, s: &SandboxSnapshot) -> bool {
        self.sandbox_id
            .as_ref()
            .is_none_or(|id| *id == s.sandbox_id)
            && self
                .name
                .as_ref()
                .is_none_or(|n| s.name.as_ref() == Some(n))
            && (self.states.is_empty()
                || self
                    .states
                    .iter()
                    .any(|st| SnapshotState::parse(st) == Some(s.status.state)))
    }
}

/// The list query: the filter and the page.
#[derive(Debug, PartialEq)]
pub struct SnapshotQuery {
    pub filter: SnapshotFilter,
    pub page: u32,
    pub page_size: u32,
}

pub fn parse_query(q: &str) -> ApiResult<SnapshotQuery> {
    let mut out = SnapshotQuery {
        filter: SnapshotFilter::default(),
        page: 1,
        page_size: 20,
    };
    for (k, v) in form_decode(q) {
        match k.as_str() {
            "sandboxId" => out.filter.sandbox_id = Some(v),
            "name" => out.filter.name = Some(v),
            "state" => out.filter.states.push(v),
            "page" => out.page = page_number(&v)?,
            "pageSize" => out.page_size = page_size(&v)?,
            _ => {}
        }
    }
    Ok(out)
}

impl<S: Send + Sync> FromRequestParts<S> for SnapshotQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> ApiResult<Self> {
        parse_query(parts.uri.query().unwrap_or(""))
    }
}

/// Filters (again: a backend may have filtered already), orders newest
/// first then by id, so pages are stable, and pages.
pub fn page_snapshots(mut all: Vec<SandboxSnapshot>, q: &SnapshotQuery) -> ListSnapshotsResponse {
    all.retain(|s| q.filter.matches(s));
    all.sort_by(|a, b| b.created_at.cmp(&a.created_at).then(a.id.cmp(&b.id)));
    let (items, pagination) = paginate(all, q.page, q.page_size);
    ListSnapshotsResponse { items, pagination }
}

type AppState<B> = State<Arc<App<B>>>;

/// The routes, for [`crate::api::router`] to merge.
pub fn routes<B: Backend>() -> Router<Arc<App<B>>> {
    Router::new()
        .route("/sandboxes/{id}/snapshots", post(create::<B>))
        .route("/snapshots", get(list::<B>))
        .route("/snapshots/{id}", get(get_one::<B>).delete(remove::<B>))
}

fn json<T: Serialize>(status: StatusCode, v: &T) -> Response {
    (status, axum::Json(v)).into_response()
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id, snapshot_id = tracing::field::Empty))]
async fn create<B: Backend>(
    State(app): AppState<B>,
    Path(id): Path<String>,
    raw: Bytes,
) -> ApiResult<Response> {
    let name = parse_create(&raw)?;
    let snap = app.backend.create_snapshot(&id, name).await?;
    tracing::Span::current().record("snapshot_id", snap.id.as_str());
    Ok(json(StatusCode::ACCEPTED, &snap))
}

#[tracing::instrument(skip_all)]
async fn list<B: Backend>(State(app): AppState<B>, q: SnapshotQuery) -> ApiResult<Response> {
    let all = app.backend.list_snapshots(&q.filter).await?;
    Ok(json(StatusCode::OK, &page_snapshots(all, &q)))
}

#[tracing::instrument(skip_all, fields(snapshot_id = %id))]
async fn get_one<B: Backend>(
    State(app): AppState<B>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    Ok(json(StatusCode::OK, &app.backend.get_snapshot(&id).await?))
}

/// 204 also when the snapshot only became `Deleting` (sandboxes created
/// from it still live): the deletion is accepted and will complete.
#[tracing::instrument(skip_all, fields(snapshot_id = %id))]
async fn remove<B: Backend>(
    State(app): AppState<B>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    app.backend.delete_snapshot(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(
        id: &str,
        secs: i64,
        sandbox: &str,
        name: Option<&str>,
        st: SnapshotState,
    ) -> SandboxSnapshot {
        SandboxSnapshot {
            id: id.into(),
            name: name.map(str::to_owned),
            sandbox_id: sandbox.into(),
            status: SnapshotStatus::plain(st),
            created_at: DateTime::from_timestamp(secs, 0).unwrap(),
        }
    }

    #[test]
    fn create_bodies() {
        for empty in [&b""[..], b"  ", b"null", b"{}", b"{\"name\": null}"] {
            assert_eq!(parse_create(empty).unwrap(), None, "{empty:?}");
        }
        assert_eq!(
            parse_create(br#"{"name": "before upgrade"}"#)
                .unwrap()
                .as_deref(),
            Some("before upgrade")
        );
        let long = format!(r#"{{"name": "{}"}}"#, "x".repeat(MAX_NAME_LEN + 1));
        for bad in [
            &br#"{"name": ""}"#[..],
            br#"{"name": "a\nb"}"#,
            br#"{"name": 3}"#,
            b"{",
            long.as_bytes(),
        ] {
            let e = parse_create(bad).unwrap_err();
            assert_eq!(
                e.status,
                StatusCode::BAD_REQUEST,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn query_parsing() {
        let q = parse_query("sandboxId=sb-1&name=a+b&state=Ready&state=deleting&page=2&pageSize=5")
            .unwrap();
        assert_eq!(
            q.filter,
            SnapshotFilter {
                sandbox_id: Some("sb-1".into()),
                name: Some("a b".into()),
                states: vec!["Ready".into(), "deleting".into()],
            }
        );
        assert_eq!((q.page, q.page_size), (2, 5));
        for bad in ["page=0", "pageSize=201", "pageSize=x", "page=-1"] {
            assert_eq!(
                parse_query(bad).unwrap_err().status,
                StatusCode::BAD_REQUEST,
                "{bad}"
            );
        }
    }

    #[test]
    fn filters_order_and_pages() {
        use SnapshotState::*;
        let all = vec![
            snap("a", 1, "sb-1", Some("n1"), Ready),
            snap("b", 2, "sb-1", Some("n2"), Creating),
            snap("c", 3, "sb-2", Some("n1"), Deleting),
            snap("d", 4, "sb-1", None, Ready),
            snap("e", 4, "sb-2", None, Failed),
        ];
        let ids =
            |r: &ListSnapshotsResponse| r.items.iter().map(|s| s.id.clone()).collect::<Vec<_>>();
        let r = page_snapshots(all.clone(), &parse_query("pageSize=2").unwrap());
        assert_eq!(ids(&r), ["d", "e"]);
        let p = &r.pagination;
        assert_eq!(
            (p.total_items, p.total_pages, p.has_next_page),
            (5, 3, true)
        );
        let r = page_snapshots(all.clone(), &parse_query("pageSize=2&page=3").unwrap());
        assert_eq!(ids(&r), ["a"]);
        assert!(!r.pagination.has_next_page);
        let r = page_snapshots(
            all.clone(),
            &parse_query("sandboxId=sb-1&state=ready").unwrap(),
        );
        assert_eq!(ids(&r), ["d", "a"]);
        let r = page_snapshots(all.clone(), &parse_query("name=n1").unwrap());
        assert_eq!(ids(&r), ["c", "a"]);
        let r = page_snapshots(
            all.clone(),
            &parse_query("state=Creating&state=Failed").unwrap(),
        );
        assert_eq!(ids(&r), ["e", "b"]);
        let r = page_snapshots(all.clone(), &parse_query("state=Bogus").unwrap());
        assert!(r.items.is_empty());
        assert_eq!(r.pagination.total_pages, 0);
        assert!(
            page_snapshots(all, &parse_query("page=9").unwrap())
                .items
                .is_empty()
        );
    }

    #[test]
    fn wire_shape() {
        let mut s = snap("a", 1, "sb-1", None, SnapshotState::Deleting);
        s.status.reason = Some("in_use".into());
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "id": "a", "sandboxId": "sb-1",
                "status": {"state": "Deleting", "reason": "in_use"},
                "createdAt": "1970-01-01T00:00:01.000000Z"
            })
        );
    }
}
