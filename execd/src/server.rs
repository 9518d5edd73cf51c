//! The HTTP side: router, access token, JSON errors, and the HTTP/1.1 accept loop.

use std::future::Future;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::error::{ApiError, code, json_error};
use crate::state::AppState;
use crate::util::ct_eq;
use crate::{claim, commands, drain, files, metrics, proxy, session};

/// Header carrying the access token. execd links no sandbolt crate (it is a small
/// static binary), so this is its own copy of `sandbolt_proto::wire::EXECD_TOKEN_HEADER`;
/// `tests/tests/wire_constants.rs` holds the two equal.
pub const ACCESS_TOKEN_HEADER: &str = "x-execd-access-token";
/// Largest JSON request body.
pub const MAX_JSON_BODY: usize = 64 * 1024 * 1024;
/// Largest request head (request line + headers); beyond it hyper answers 431.
pub const MAX_HEAD: usize = 64 * 1024;

/// Marks responses relayed from a proxied application (left untouched).
#[derive(Clone, Copy)]
pub struct Proxied;

/// All routes, with auth and JSON errors, over `state`.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/ping", get(ping))
        .route(
            "/command",
            post(commands::run_command).delete(commands::interrupt),
        )
        .route("/command/status/{id}", get(commands::status))
        .route("/command/{id}/logs", get(commands::logs))
        .route("/session", post(session::create))
        .route("/session/{id}/run", post(session::run))
        .route("/session/{id}", delete(session::delete))
        .route("/files", delete(files::remove_files))
        .route("/files/info", get(files::info))
        .route("/files/mv", post(files::mv))
        .route("/files/permissions", post(files::chmod))
        .route("/files/search", get(files::search))
        .route("/files/replace", post(files::replace))
        .route(
            "/files/upload",
            post(files::upload).layer(DefaultBodyLimit::disable()),
        )
        .route("/files/download", get(files::download))
        .route("/directories/list", get(files::list_dir))
        .route(
            "/directories",
            post(files::make_dirs).delete(files::remove_dirs),
        )
        // sandbolt's own route (agent only; see the crate docs, "Warm mode").
        .route("/sandbolt/claim", post(claim::claim))
        .route("/metrics", get(metrics::get))
        .route("/metrics/watch", get(metrics::watch))
        .route("/code", any(code_not_supported))
        .route("/code/{*rest}", any(code_not_supported))
        .route("/pty", any(not_supported))
        .route("/pty/{*rest}", any(not_supported))
        .route("/v1/{*rest}", any(not_supported))
        .route(
            "/proxy/{port}",
            any(proxy::handle).layer(DefaultBodyLimit::disable()),
        )
        .route(
            "/proxy/{port}/{*rest}",
            any(proxy::handle).layer(DefaultBodyLimit::disable()),
        )
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_JSON_BODY))
        .layer(middleware::from_fn(json_errors))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        // Outermost, so that answers produced before any body is read (auth, unknown
        // routes) are covered too; see `drain` for why every route needs it.
        .layer(middleware::from_fn(drain::drain_request_body))
        .with_state(state)
}

#[tracing::instrument(skip_all)]
async fn ping() -> &'static str {
    "pong"
}

#[tracing::instrument(skip_all)]
async fn code_not_supported() -> Response {
    ApiError::not_supported("code interpreting (/code) is not supported by this execd; run programs with POST /command or a session (/session)").into_response()
}

#[tracing::instrument(skip_all)]
async fn not_supported(req: Request) -> Response {
    ApiError::not_supported(format!(
        "{} is not supported by this execd",
        req.uri().path()
    ))
    .into_response()
}

#[tracing::instrument(skip_all)]
async fn not_found(req: Request) -> Response {
    ApiError::not_found(
        code::NOT_FOUND,
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
    .into_response()
}

/// Requires the access token (when one is configured) on every route but `/ping`.
/// Read per request: a warm claim replaces it, and the old one must stop working at once.
async fn auth(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(token) = state.access_token()
        && req.uri().path() != "/ping"
    {
        let ok = req
            .headers()
            .get(ACCESS_TOKEN_HEADER)
            .is_some_and(|v| ct_eq(v.as_bytes(), token.as_bytes()));
        if !ok {
            return json_error(
                StatusCode::UNAUTHORIZED,
                code::UNAUTHORIZED,
                "invalid or missing X-EXECD-ACCESS-TOKEN header",
            );
        }
    }
    next.run(req).await
}

/// Turns the framework's plain-text error answers (body limits, bad paths, 405) into
/// contract error bodies.
async fn json_errors(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error())
        || resp.extensions().get::<Proxied>().is_some()
    {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return resp;
    }
    let allow = resp.headers().get(header::ALLOW).cloned();
    let body = axum::body::to_bytes(resp.into_body(), 64 * 1024)
        .await
        .unwrap_or_default();
    let err = ApiError::from_framework(status, &String::from_utf8_lossy(&body));
    let mut out = err.into_response();
    if let Some(a) = allow {
        out.headers_mut().insert(header::ALLOW, a);
    }
    out
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets every open
/// connection finish the request it is answering (idle ones close at once) and returns
/// when all are closed. Callers bound that wait; it is what lets an answer that decides
/// execd's exit (a failed warm claim) still reach its client.
///
/// At most `limits.max_connections` connections are open at once: one over the cap is
/// accepted and closed at once (rather than left in the kernel's backlog, where it would
/// wait for nothing).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: crate::ConnLimits,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let (closing_tx, closing) = tokio::sync::watch::channel(false);
    // Every connection task holds a sender; `recv` answers `None` once all are gone.
    let (open_tx, mut open) = tokio::sync::mpsc::channel::<()>(1);
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(_) => {
                    // Out of descriptors or similar: back off briefly instead of spinning.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let svc = hyper_util::service::TowerToHyperService::new(router.clone());
        let mut closing = closing.clone();
        let open = open_tx.clone();
        tokio::spawn(async move {
            let (_open, _permit) = (open, permit);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .max_buf_size(MAX_HEAD)
                .serve_connection(TokioIo::new(stream), svc)
                .with_upgrades();
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = closing.changed() => {}
            }
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        });
    }
    let _ = closing_tx.send(true);
    drop(open_tx);
    let _ = open.recv().await;
}

/// Adds the marker that keeps [`json_errors`] away from a proxied response.
pub fn mark_proxied(mut resp: Response) -> Response {
    resp.extensions_mut().insert(Proxied);
    resp
}
