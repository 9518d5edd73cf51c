//! The warm-pool routes (`/pools`, see [`crate::pools`]), mounted at `/`
//! and `/v1` with the rest of the API. As with named volumes, a runtime
//! without warm pools answers every route 501 naming it before the body is
//! read, so nobody fixes a request only to learn it could never have worked.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::Value;

use crate::api::App;
use crate::backend::Backend;
use crate::error::{ApiError, ApiResult};
use crate::pools::{PoolList, parse_create, parse_update, path_pool, pools_unsupported};

type AppState<B> = State<Arc<App<B>>>;

/// The routes, for [`crate::api::router`] to merge.
pub fn routes<B: Backend>() -> Router<Arc<App<B>>> {
    Router::new()
        .route("/pools", get(list::<B>).post(create::<B>))
        .route(
            "/pools/{pool_name}",
            get(get_one::<B>).put(update::<B>).delete(remove::<B>),
        )
}

/// 501 naming `route` where the runtime has no warm pools.
fn supported<B: Backend>(app: &App<B>, route: &str) -> ApiResult<()> {
    if app.backend.pools_unsupported() {
        return Err(pools_unsupported(route, app.backend.runtime_name()));
    }
    Ok(())
}

fn body(bytes: &Bytes) -> ApiResult<Value> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
}

fn json<T: serde::Serialize>(status: StatusCode, v: &T) -> Response {
    (status, axum::Json(v)).into_response()
}

#[tracing::instrument(skip_all)]
async fn create<B: Backend>(State(app): AppState<B>, raw: Bytes) -> ApiResult<Response> {
    supported(&app, "POST /pools")?;
    let req = parse_create(&body(&raw)?)?;
    let pool = app.backend.create_pool(req).await?;
    Ok(json(StatusCode::CREATED, &pool))
}

#[tracing::instrument(skip_all)]
async fn list<B: Backend>(State(app): AppState<B>) -> ApiResult<Response> {
    supported(&app, "GET /pools")?;
    let items = app.backend.list_pools().await?;
    Ok(json(StatusCode::OK, &PoolList { items }))
}

#[tracing::instrument(skip_all, fields(pool = %name))]
async fn get_one<B: Backend>(
    State(app): AppState<B>,
    Path(name): Path<String>,
) -> ApiResult<Response> {
    supported(&app, "GET /pools/{pool_name}")?;
    path_pool(&name)?;
    Ok(json(StatusCode::OK, &app.backend.get_pool(&name).await?))
}

#[tracing::instrument(skip_all, fields(pool = %name))]
async fn update<B: Backend>(
    State(app): AppState<B>,
    Path(name): Path<String>,
    raw: Bytes,
) -> ApiResult<Response> {
    supported(&app, "PUT /pools/{pool_name}")?;
    path_pool(&name)?;
    let capacity = parse_update(&body(&raw)?)?;
    let pool = app.backend.update_pool(&name, capacity).await?;
    Ok(json(StatusCode::OK, &pool))
}

#[tracing::instrument(skip_all, fields(pool = %name))]
async fn remove<B: Backend>(
    State(app): AppState<B>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    supported(&app, "DELETE /pools/{pool_name}")?;
    path_pool(&name)?;
    app.backend.delete_pool(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
#[path = "pool_routes_tests.rs"]
mod tests;
