//! The REST surface: routes at `/` and `/v1`, auth, `X-Request-ID`, and the
//! handlers that turn requests into [`Backend`] calls.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, OriginalUri, Path, Request, State as AxState};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use chrono::{DateTime, Utc};
use sandbolt_proto::auth::constant_time_eq;
use serde::de::DeserializeOwned;

use crate::backend::Backend;
use crate::egress::{self, EGRESS_PORT, EGRESS_TOKEN_HEADER};
use crate::error::{ApiError, ApiResult};
use crate::model::{
    CreateSandboxRequest, Endpoint, ListSandboxesResponse, PaginationInfo,
    RenewSandboxExpirationRequest, RenewSandboxExpirationResponse, SandboxRecord, State, rfc3339,
};
use crate::validate::{Policy, check_metadata_entry, plan_create};

pub const API_KEY_HEADER: &str = "OPEN-SANDBOX-API-KEY";
pub const REQUEST_ID_HEADER: &str = "X-Request-ID";

/// Shared state of every handler.
pub struct App<B> {
    pub backend: B,
    pub policy: Policy,
    /// `None` only when the operator explicitly chose to run open.
    pub api_key: Option<String>,
    pub metrics: crate::metrics::LifecycleMetrics,
}

type AppState<B> = AxState<Arc<App<B>>>;

/// Builds the full router (both mounts, middleware, fallbacks).
pub fn router<B: Backend>(app: Arc<App<B>>) -> Router {
    let api = Router::new()
        .route("/sandboxes", post(create::<B>).get(list::<B>))
        .route("/sandboxes/{id}", get(get_one::<B>).delete(delete::<B>))
        .route(
            "/sandboxes/{id}/metadata",
            axum::routing::patch(patch_metadata::<B>),
        )
        .route("/sandboxes/{id}/pause", post(pause::<B>))
        .route("/sandboxes/{id}/resume", post(resume::<B>))
        .route("/sandboxes/{id}/renew-expiration", post(renew::<B>))
        .route("/sandboxes/{id}/endpoints/{port}", get(endpoint::<B>))
        .route(
            "/sandboxes/{id}/networkpolicy",
            get(egress::get_policy::<B>)
                .put(egress::put_policy::<B>)
                .patch(egress::patch_policy::<B>)
                .delete(egress::delete_policy::<B>),
        )
        // The egress sidecar's API, for the endpoint port 18080 resolves to.
        .route(
            "/sandboxes/{id}/egress/policy",
            get(egress::get_policy::<B>)
                .patch(egress::patch_policy::<B>)
                .delete(egress::delete_policy::<B>),
        )
        .route(
            "/sandboxes/{id}/proxy/{port}",
            any(crate::proxy::proxy_root::<B>),
        )
        .route(
            "/sandboxes/{id}/proxy/{port}/{*path}",
            any(crate::proxy::proxy_path::<B>),
        )
        .route(
            "/metrics/events",
            post(crate::metrics::report_event).with_state(app.metrics.sdk.clone()),
        )
        .route("/health", get(health))
        .route("/version", get(version))
        .route("/openapi.json", get(openapi))
        .merge(crate::volume_routes::routes())
        .merge(crate::pool_routes::routes())
        .merge(crate::snapshots::routes())
        .merge(crate::diagnostics::routes())
        .merge(not_implemented_routes())
        .with_state(app.clone());
    let http = sandbolt_telemetry::http_layer(app.metrics.http.clone());
    Router::new()
        .merge(api.clone())
        .nest("/v1", api)
        .merge(probe_routes(&app))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(app, auth::<B>))
        .layer(http)
}

/// Paths answered without a key: liveness and readiness probes carry no
/// secret and learn nothing from the answer.
const PROBE_PATHS: [&str; 4] = ["/health", "/v1/health", "/healthz", "/readyz"];

/// `/healthz` and `/readyz` of the ops port (`sandbolt_telemetry::ops_router`),
/// also on the API's port, where probes already reach; its `/metrics` stays
/// on the ops port.
fn probe_routes<B: Backend>(app: &Arc<App<B>>) -> Router {
    let probes = sandbolt_telemetry::ops_router(Arc::default(), readiness(app.clone()));
    Router::new()
        .route("/healthz", axum::routing::get_service(probes.clone()))
        .route("/readyz", axum::routing::get_service(probes))
}

/// Ready while the backend's engine answers.
pub fn readiness<B: Backend>(app: Arc<App<B>>) -> sandbolt_telemetry::Readiness {
    sandbolt_telemetry::Readiness::from_fn(move || {
        let app = app.clone();
        async move { app.backend.readiness().await }
    })
}

/// Routes of the OpenSandbox 1.1.1 document that sandbolt does not serve:
/// a clear 501 instead of a 404 that looks like a missing sandbox.
fn not_implemented_routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    let mut r = Router::new();
    for (path, what) in [
        ("/templates", "Templates"),
        ("/templates/{id}", "Templates"),
    ] {
        r = r.route(
            path,
            any(move || async move { ApiError::not_implemented(what) }),
        );
    }
    r
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, "NOT_FOUND", "No such route.")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "METHOD_NOT_ALLOWED",
        "Method not allowed on this route.",
    )
}

async fn auth<B: Backend>(AxState(app): AppState<B>, req: Request, next: Next) -> Response {
    let Some(key) = app.api_key.as_deref() else {
        return next.run(req).await;
    };
    let path = req.uri().path();
    if PROBE_PATHS.contains(&path) {
        return next.run(req).await;
    }
    // The egress endpoint's token opens that one sandbox's policy route and
    // nothing else; without it, the API key is asked for as everywhere.
    if let (Some(id), Some(token)) = (
        egress::egress_policy_target(path),
        req.headers().get(EGRESS_TOKEN_HEADER),
    ) {
        if egress::token_matches(key, id, token.as_bytes()) {
            return next.run(req).await;
        }
        return ApiError::new(
            StatusCode::UNAUTHORIZED,
            "INVALID_EGRESS_TOKEN",
            format!("The {EGRESS_TOKEN_HEADER} header is not valid for sandbox {id}."),
        )
        .into_response();
    }
    match req.headers().get(API_KEY_HEADER) {
        None => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "MISSING_API_KEY",
            format!("Authentication credentials are missing. Provide API key via {API_KEY_HEADER} header."),
        )
        .into_response(),
        Some(v) if constant_time_eq(v.as_bytes(), key.as_bytes()) => next.run(req).await,
        Some(_) => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "INVALID_API_KEY",
            "Authentication credentials are invalid. Check your API key and try again.",
        )
        .into_response(),
    }
}

/// A JSON request body whose rejections are `{code, message}` 400s (axum's
/// own `Json` rejects in plain text, with 415 and 422).
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> ApiResult<Self> {
        let body = Bytes::from_request(req, state)
            .await
            .map_err(|r| ApiError::new(r.status(), "INVALID_REQUEST", r.body_text()))?;
        serde_json::from_slice(&body)
            .map(JsonBody)
            .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
    }
}

impl<S: Send + Sync> FromRequestParts<S> for ListQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> ApiResult<Self> {
        parse_list_query(parts.uri.query().unwrap_or(""))
    }
}

/// The endpoint query: `use_server_proxy`. Signed endpoints (`expires`)
/// are refused rather than answered unsigned.
pub struct EndpointQuery {
    pub use_server_proxy: bool,
}

impl<S: Send + Sync> FromRequestParts<S> for EndpointQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> ApiResult<Self> {
        let params = form_decode(parts.uri.query().unwrap_or(""));
        let use_server_proxy = match params.iter().rev().find(|(k, _)| k == "use_server_proxy") {
            None => false,
            Some((_, v)) => match v.to_ascii_lowercase().as_str() {
                "true" | "1" => true,
                "false" | "0" => false,
                _ => return Err(ApiError::invalid("use_server_proxy must be true or false")),
            },
        };
        if params.iter().any(|(k, _)| k == "expires") {
            return Err(ApiError::invalid_code(
                "INVALID_PARAMETER",
                "signed endpoints (expires) are not supported by sandbolt",
            ));
        }
        Ok(Self { use_server_proxy })
    }
}

fn json<T: serde::Serialize>(status: StatusCode, v: &T) -> Response {
    (status, axum::Json(v)).into_response()
}

#[tracing::instrument(skip_all, fields(sandbox_id = tracing::field::Empty))]
async fn create<B: Backend>(
    AxState(app): AppState<B>,
    JsonBody(req): JsonBody<CreateSandboxRequest>,
) -> ApiResult<Response> {
    let plan = plan_create(req, &app.policy, Utc::now())?;
    tracing::Span::current().record("sandbox_id", plan.id.as_str());
    for v in &plan.volumes {
        app.backend.check_volume(v)?;
    }
    app.backend.check_extensions(&plan.extensions)?;
    app.backend.check_network_policy(&plan.network_policy)?;
    let rec = app.backend.create(plan).await?;
    Ok(json(StatusCode::ACCEPTED, &rec.to_create_response()))
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
async fn get_one<B: Backend>(
    AxState(app): AppState<B>,
    Path(id): Path<String>,
) -> ApiResult<Response> {
    let rec = app.backend.get(&id).await?;
    Ok(json(StatusCode::OK, &rec.to_sandbox()))
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
async fn delete<B: Backend>(
    AxState(app): AppState<B>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    app.backend.delete(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Pause and resume answer 409 from the wrong state on every backend (some
/// engines treat a repeated resume as a no-op; the API does not).
async fn require_state<B: Backend>(
    app: &App<B>,
    id: &str,
    want: State,
    verb: &str,
) -> ApiResult<()> {
    let rec = app.backend.get(id).await?;
    if rec.state != want {
        return Err(ApiError::conflict(
            "SANDBOX_INVALID_STATE",
            format!(
                "Sandbox {id} is {} and cannot be {verb}.",
                rec.state.as_str()
            ),
        ));
    }
    Ok(())
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
async fn pause<B: Backend>(
    AxState(app): AppState<B>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    require_state(&app, &id, State::Running, "paused").await?;
    app.backend.pause(&id).await?;
    Ok(StatusCode::ACCEPTED)
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
async fn resume<B: Backend>(
    AxState(app): AppState<B>,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    require_state(&app, &id, State::Paused, "resumed").await?;
    app.backend.resume(&id).await?;
    Ok(StatusCode::ACCEPTED)
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
async fn patch_metadata<B: Backend>(
    AxState(app): AppState<B>,
    Path(id): Path<String>,
    JsonBody(patch): JsonBody<BTreeMap<String, Option<String>>>,
) -> ApiResult<Response> {
    for (k, v) in &patch {
        check_metadata_entry(k, v.as_deref().unwrap_or(""))?;
    }
    let rec = app.backend.patch_metadata(&id, patch).await?;
    Ok(json(StatusCode::OK, &rec.to_sandbox()))
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
async fn renew<B: Backend>(
    AxState(app): AppState<B>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<RenewSandboxExpirationRequest>,
) -> ApiResult<Response> {
    let at = DateTime::parse_from_rfc3339(&req.expires_at)
        .map_err(|e| {
            ApiError::invalid(format!(
                "expiresAt '{}' is not an RFC 3339 time: {e}",
                req.expires_at
            ))
        })?
        .with_timezone(&Utc);
    let rec = app.backend.get(&id).await?;
    if rec.expires_at.is_none() {
        return Err(ApiError::conflict(
            "SANDBOX_MANUAL_CLEANUP",
            format!("Sandbox {id} does not have automatic expiration enabled."),
        ));
    }
    if at <= Utc::now() {
        return Err(ApiError::invalid_code(
            "INVALID_EXPIRATION",
            "expiresAt must be in the future",
        ));
    }
    let committed = app.backend.set_expiry(&id, at).await?;
    Ok(json(
        StatusCode::OK,
        &RenewSandboxExpirationResponse {
            expires_at: rfc3339(committed),
        },
    ))
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id, port = %port))]
async fn endpoint<B: Backend>(
    AxState(app): AppState<B>,
    Path((id, port)): Path<(String, String)>,
    query: EndpointQuery,
    headers: HeaderMap,
    OriginalUri(req_uri): OriginalUri,
) -> ApiResult<Response> {
    let port = parse_port(&port)?;
    let here = || -> ApiResult<String> {
        // Reflect how the client reached us (host and /v1 mount), as the
        // OpenSandbox server does.
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .ok_or_else(|| ApiError::invalid("this endpoint needs a Host header"))?;
        let mount = req_uri.path().split("/sandboxes/").next().unwrap_or("");
        Ok(format!("{host}{mount}/sandboxes/{id}"))
    };
    let ep = if port == EGRESS_PORT {
        // No sidecar runs in the sandbox: its policy API is served here
        // (see crate::egress), in both modes.
        app.backend.get(&id).await?;
        Endpoint {
            endpoint: format!("{}/egress", here()?),
            headers: app.api_key.as_deref().map(|key| {
                BTreeMap::from([(
                    EGRESS_TOKEN_HEADER.to_string(),
                    egress::egress_token(key, &id),
                )])
            }),
        }
    } else if query.use_server_proxy {
        // Our proxy adds the sandbox headers itself.
        app.backend.route(&id, port).await?;
        Endpoint {
            endpoint: format!("{}/proxy/{port}", here()?),
            headers: None,
        }
    } else {
        let route = app.backend.route(&id, port).await?;
        Endpoint {
            endpoint: route.endpoint(),
            headers: (!route.headers.is_empty()).then_some(route.headers),
        }
    };
    Ok(json(StatusCode::OK, &ep))
}

pub fn parse_port(s: &str) -> ApiResult<u16> {
    match s.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(ApiError::invalid_code(
            "INVALID_PORT",
            format!("port '{s}' must be an integer in 1..65535"),
        )),
    }
}

/// Decodes `application/x-www-form-urlencoded` pairs (`+` is a space).
pub fn form_decode(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            // Two hex digits, not what from_str_radix also takes ("+1").
            b'%' if i + 2 < b.len() && b[i + 1..i + 3].iter().all(u8::is_ascii_hexdigit) => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The list query: `state` (repeatable, OR), `metadata` (a URL-encoded
/// `k=v&k2=v2` string, AND), `page`, `pageSize`.
#[derive(Debug, PartialEq)]
pub struct ListQuery {
    pub states: Vec<String>,
    pub metadata: BTreeMap<String, String>,
    pub page: u32,
    pub page_size: u32,
}

pub fn parse_list_query(q: &str) -> ApiResult<ListQuery> {
    let mut lq = ListQuery {
        states: Vec::new(),
        metadata: BTreeMap::new(),
        page: 1,
        page_size: 20,
    };
    for (k, v) in form_decode(q) {
        match k.as_str() {
            "state" => lq.states.push(v),
            "metadata" => {
                for seg in v.split('&').filter(|s| !s.is_empty()) {
                    let Some((mk, mv)) = seg.split_once('=') else {
                        return Err(ApiError::invalid_code(
                            "INVALID_METADATA_FORMAT",
                            format!("Invalid metadata format: bad query field: '{seg}'"),
                        ));
                    };
                    lq.metadata.insert(percent_decode(mk), percent_decode(mv));
                }
            }
            "page" => lq.page = page_number(&v)?,
            "pageSize" => lq.page_size = page_size(&v)?,
            _ => {}
        }
    }
    Ok(lq)
}

/// A list's `page` query parameter (1-based).
pub fn page_number(v: &str) -> ApiResult<u32> {
    v.parse()
        .ok()
        .filter(|p| *p >= 1)
        .ok_or_else(|| ApiError::invalid("page must be an integer >= 1"))
}

/// A list's `pageSize` query parameter.
pub fn page_size(v: &str) -> ApiResult<u32> {
    v.parse()
        .ok()
        .filter(|p| (1..=200).contains(p))
        .ok_or_else(|| ApiError::invalid("pageSize must be an integer in 1..200"))
}

/// Page `page` (1-based) of `page_size` items of `all`, and what the
/// answer says about the pages.
pub fn paginate<T>(all: Vec<T>, page: u32, page_size: u32) -> (Vec<T>, PaginationInfo) {
    let total = all.len() as u64;
    let size = u64::from(page_size);
    let total_pages = total.div_ceil(size);
    let start = (u64::from(page) - 1).saturating_mul(size).min(total) as usize;
    let items = all.into_iter().skip(start).take(size as usize).collect();
    let info = PaginationInfo {
        page,
        page_size,
        total_items: total,
        total_pages,
        has_next_page: u64::from(page) < total_pages,
    };
    (items, info)
}

/// Filters, orders (newest first, then id, so pages are stable) and pages.
pub fn page_records(mut all: Vec<SandboxRecord>, q: &ListQuery) -> ListSandboxesResponse {
    all.retain(|r| {
        (q.states.is_empty()
            || q.states
                .iter()
                .any(|s| s.eq_ignore_ascii_case(r.state.as_str())))
            && q.metadata.iter().all(|(k, v)| r.metadata.get(k) == Some(v))
    });
    all.sort_by(|a, b| b.created_at.cmp(&a.created_at).then(a.id.cmp(&b.id)));
    let (page, pagination) = paginate(all, q.page, q.page_size);
    ListSandboxesResponse {
        items: page.iter().map(SandboxRecord::to_sandbox).collect(),
        pagination,
    }
}

#[tracing::instrument(skip_all)]
async fn list<B: Backend>(AxState(app): AppState<B>, q: ListQuery) -> ApiResult<Response> {
    let all = app.backend.list().await?;
    Ok(json(StatusCode::OK, &page_records(all, &q)))
}

#[tracing::instrument(skip_all)]
async fn health() -> Response {
    json(StatusCode::OK, &serde_json::json!({"status": "healthy"}))
}

#[tracing::instrument(skip_all)]
async fn version() -> Response {
    json(
        StatusCode::OK,
        &serde_json::json!({"version": env!("CARGO_PKG_VERSION"), "server": "sandbolt-lifecycle"}),
    )
}

#[tracing::instrument(skip_all)]
async fn openapi() -> Response {
    let mut r = Response::new(Body::from(crate::openapi::DOCUMENT));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::State as S;

    #[test]
    fn list_query_parsing() {
        // What the SDK sends for metadata {"team": "a&b", "k": "v"}.
        let q = parse_list_query(
            "state=Running&state=Paused&metadata=team%3Da%2526b%26k%3Dv&page=2&pageSize=5",
        )
        .unwrap();
        assert_eq!(q.states, vec!["Running", "Paused"]);
        assert_eq!(
            q.metadata,
            BTreeMap::from([("team".into(), "a&b".into()), ("k".into(), "v".into())])
        );
        assert_eq!((q.page, q.page_size), (2, 5));
        assert!(parse_list_query("page=0").is_err());
        assert!(parse_list_query("pageSize=201").is_err());
        assert_eq!(
            parse_list_query("metadata=a%3D1%26broken")
                .unwrap_err()
                .code,
            "INVALID_METADATA_FORMAT"
        );
    }

    fn rec(id: &str, secs: i64, state: S, team: &str) -> SandboxRecord {
        SandboxRecord {
            id: id.into(),
            image: Some("busybox".into()),
            entrypoint: vec!["sleep".into()],
            metadata: BTreeMap::from([("team".into(), team.into())]),
            state,
            reason: None,
            message: None,
            created_at: DateTime::from_timestamp(secs, 0).unwrap(),
            expires_at: None,
            last_transition_at: None,
            allocation: None,
            snapshot_id: None,
        }
    }

    #[test]
    fn paging_and_filters() {
        let all: Vec<_> = (0..5)
            .map(|i| {
                rec(
                    &format!("s{i}"),
                    i,
                    if i % 2 == 0 { S::Running } else { S::Paused },
                    if i < 3 { "a" } else { "b" },
                )
            })
            .collect();
        let q = parse_list_query("pageSize=2").unwrap();
        let p = page_records(all.clone(), &q);
        assert_eq!(
            p.items.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["s4", "s3"]
        );
        assert_eq!(
            (
                p.pagination.total_items,
                p.pagination.total_pages,
                p.pagination.has_next_page
            ),
            (5, 3, true)
        );
        let q = parse_list_query("pageSize=2&page=3").unwrap();
        let p = page_records(all.clone(), &q);
        assert_eq!(p.items.len(), 1);
        assert!(!p.pagination.has_next_page);
        let q = parse_list_query("state=running&metadata=team%3Da").unwrap();
        let p = page_records(all.clone(), &q);
        assert_eq!(
            p.items.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(),
            ["s2", "s0"]
        );
        let q = parse_list_query("page=9").unwrap();
        assert!(page_records(all, &q).items.is_empty());
    }

    #[test]
    fn ports() {
        assert_eq!(parse_port("44772").unwrap(), 44772);
        for bad in ["0", "65536", "-1", "x"] {
            assert_eq!(parse_port(bad).unwrap_err().code, "INVALID_PORT");
        }
    }
}
