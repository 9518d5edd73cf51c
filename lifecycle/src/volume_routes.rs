//! The named-volume routes (see [`crate::named_volumes`]), mounted at `/`
//! and `/v1` with the rest of the API. Each handler first asks whether the
//! runtime has named volumes at all: where it has none, every route
//! answers 501 naming itself, whatever the body, so nobody fixes a request
//! only to learn that it could never have worked.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde::de::DeserializeOwned;

use crate::api::App;
use crate::backend::Backend;
use crate::error::{ApiError, ApiResult};
use crate::named_volumes::{
    CreateSnapshotBody, CreateVolumeBody, ForkBody, Items, RestoreBody, SandboxVolumes,
    check_attach, path_snapshot, path_volume, unsupported_route,
};
use crate::volumes::parse_volumes;

type AppState<B> = State<Arc<App<B>>>;

/// The routes, for [`crate::api::router`] to merge.
pub fn routes<B: Backend>() -> Router<Arc<App<B>>> {
    Router::new()
        .route("/volumes", post(create::<B>).get(list::<B>))
        .route("/volumes/{name}", get(get_one::<B>).delete(remove::<B>))
        .route(
            "/volumes/{name}/snapshots",
            post(snapshot::<B>).get(snapshots::<B>),
        )
        .route(
            "/volumes/{name}/snapshots/{snapshot}",
            delete(remove_snapshot::<B>),
        )
        .route("/volumes/{name}/restore", post(restore::<B>))
        .route("/volumes/{name}/fork", post(fork::<B>))
        .route("/sandboxes/{id}/volumes", post(attach::<B>))
        .route("/sandboxes/{id}/volumes/{volume}", delete(detach::<B>))
}

/// 501 naming `route` where the runtime has no named volumes.
fn supported<B: Backend>(app: &App<B>, route: &str) -> ApiResult<()> {
    if app.backend.named_volumes_unsupported() {
        return Err(unsupported_route(route, app.backend.runtime_name()));
    }
    Ok(())
}

/// A JSON body, read only once the route is known to be served (the
/// `{code, message}` 400 of [`crate::api::JsonBody`] otherwise).
fn body<T: DeserializeOwned>(bytes: &Bytes) -> ApiResult<T> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
}

fn json<T: serde::Serialize>(status: StatusCode, v: &T) -> Response {
    (status, axum::Json(v)).into_response()
}

#[tracing::instrument(skip_all)]
async fn create<B: Backend>(State(app): AppState<B>, raw: Bytes) -> ApiResult<Response> {
    supported(&app, "POST /volumes")?;
    let req = body::<CreateVolumeBody>(&raw)?.check()?;
    let v = app.backend.create_volume(req).await?;
    Ok(json(StatusCode::CREATED, &v))
}

#[tracing::instrument(skip_all)]
async fn list<B: Backend>(State(app): AppState<B>) -> ApiResult<Response> {
    supported(&app, "GET /volumes")?;
    let items = app.backend.list_volumes().await?;
    Ok(json(StatusCode::OK, &Items { items }))
}

#[tracing::instrument(skip_all, fields(volume = %name))]
async fn get_one<B: Backend>(
    State(app): AppState<B>,
    Path(name): Path<String>,
) -> ApiResult<Response> {
    supported(&app, "GET /volumes/{name}")?;
    path_volume(&name)?;
    Ok(json(StatusCode::OK, &app.backend.get_volume(&name).await?))
}

#[tracing::instrument(skip_all, fields(volume = %name))]
async fn remove<B: Backend>(
    State(app): AppState<B>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    supported(&app, "DELETE /volumes/{name}")?;
    path_volume(&name)?;
    app.backend.delete_volume(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[tracing::instrument(skip_all, fields(volume = %name))]
async fn snapshot<B: Backend>(
    State(app): AppState<B>,
    Path(name): Path<String>,
    raw: Bytes,
) -> ApiResult<Response> {
    supported(&app, "POST /volumes/{name}/snapshots")?;
    path_volume(&name)?;
    let snap = body::<CreateSnapshotBody>(&raw)?.check()?;
    let s = app.backend.create_volume_snapshot(&name, &snap).await?;
    Ok(json(StatusCode::CREATED, &s))
}

#[tracing::instrument(skip_all, fields(volume = %name))]
async fn snapshots<B: Backend>(
    State(app): AppState<B>,
    Path(name): Path<String>,
) -> ApiResult<Response> {
    supported(&app, "GET /volumes/{name}/snapshots")?;
    path_volume(&name)?;
    let items = app.backend.list_volume_snapshots(&name).await?;
    Ok(json(StatusCode::OK, &Items { items }))
}

#[tracing::instrument(skip_all, fields(volume = %name, snapshot = %snapshot))]
async fn remove_snapshot<B: Backend>(
    State(app): AppState<B>,
    Path((name, snapshot)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    supported(&app, "DELETE /volumes/{name}/snapshots/{snapshot}")?;
    path_volume(&name)?;
    path_snapshot(&name, &snapshot)?;
    app.backend.delete_volume_snapshot(&name, &snapshot).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[tracing::instrument(skip_all, fields(volume = %name))]
async fn restore<B: Backend>(
    State(app): AppState<B>,
    Path(name): Path<String>,
    raw: Bytes,
) -> ApiResult<Response> {
    supported(&app, "POST /volumes/{name}/restore")?;
    path_volume(&name)?;
    let snap = body::<RestoreBody>(&raw)?.check()?;
    let v = app.backend.restore_volume(&name, &snap).await?;
    Ok(json(StatusCode::OK, &v))
}

#[tracing::instrument(skip_all, fields(volume = %name))]
async fn fork<B: Backend>(
    State(app): AppState<B>,
    Path(name): Path<String>,
    raw: Bytes,
) -> ApiResult<Response> {
    supported(&app, "POST /volumes/{name}/fork")?;
    path_volume(&name)?;
    let fork = body::<ForkBody>(&raw)?.check(&name)?;
    let v = app.backend.fork_volume(fork).await?;
    Ok(json(StatusCode::CREATED, &v))
}

/// The body is one OpenSandbox `Volume` with a `pvc`, checked by the same
/// rules as a create's `volumes` entry.
#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
async fn attach<B: Backend>(
    State(app): AppState<B>,
    Path(id): Path<String>,
    raw: Bytes,
) -> ApiResult<Response> {
    supported(&app, "POST /sandboxes/{id}/volumes")?;
    let entry = body::<serde_json::Value>(&raw)?;
    if entry.get("backendType").is_some() || entry.get("backendRef").is_some() {
        return Err(ApiError::invalid_code(
            "VOLUME::INVALID_BACKEND",
            "the body is one volume in the 1.1.1 shape ({name, mountPath, readOnly, subPath, pvc}), \
             not a seed volume (backendType/backendRef)",
        ));
    }
    let mut mounts = parse_volumes(Some(&[entry]), None, &app.policy.host_paths)?;
    let mount = mounts.pop().expect("one entry parsed into one mount");
    check_attach(&mount)?;
    let volumes = app.backend.attach_volume(&id, mount).await?;
    Ok(json(StatusCode::OK, &SandboxVolumes { volumes }))
}

#[tracing::instrument(skip_all, fields(sandbox_id = %id, volume = %volume))]
async fn detach<B: Backend>(
    State(app): AppState<B>,
    Path((id, volume)): Path<(String, String)>,
) -> ApiResult<StatusCode> {
    supported(&app, "DELETE /sandboxes/{id}/volumes/{volumeName}")?;
    path_volume(&volume)?;
    app.backend.detach_volume(&id, &volume).await?;
    Ok(StatusCode::NO_CONTENT)
}
