//! The ops port: `/metrics`, `/healthz`, `/readyz`, served without auth
//! (nothing secret; who reaches it is the network policy's business).

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::TelemetryError;
use crate::listener::{CappedListener, Drain, ListenerLimits, serve_router};

/// The content type of OpenMetrics text, as scrapers negotiate it.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Latency buckets shared by the request histograms: 0.5 ms to ~16 s.
pub(crate) fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

type ReadinessCheck =
    dyn Fn() -> Pin<Box<dyn Future<Output = Result<(), String>> + Send>> + Send + Sync;

/// Whether a component can do its work now (`/readyz`): a check run on
/// each probe, so the answer is never stale.
#[derive(Clone)]
pub struct Readiness(Option<Arc<ReadinessCheck>>);

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Readiness(check)"
        } else {
            "Readiness(always)"
        })
    }
}

impl Readiness {
    /// Ready whenever the process serves.
    pub fn always() -> Self {
        Self(None)
    }

    /// Ready when `check` says `Ok(())`; `Err(reason)` is shown on `/readyz`.
    pub fn from_fn<F, Fut>(check: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), String>> + Send + 'static,
    {
        Self(Some(Arc::new(move || Box::pin(check()))))
    }

    /// Runs the check.
    pub async fn check(&self) -> Result<(), String> {
        match &self.0 {
            None => Ok(()),
            Some(check) => check().await,
        }
    }
}

#[derive(Clone)]
struct OpsState {
    registry: Arc<Registry>,
    ready: Readiness,
}

/// `GET /metrics` (OpenMetrics text of `registry`), `GET /healthz`,
/// `GET /readyz`.
pub fn ops_router(registry: Arc<Registry>, ready: Readiness) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(OpsState { registry, ready })
}

async fn metrics(State(state): State<OpsState>) -> Response {
    let mut text = String::new();
    let encoded =
        prometheus_client::encoding::text::encode(&mut text, &state.registry).and_then(|()| {
            // One exposition: the component's families, then the process's
            // listener families, under a single closing `# EOF`.
            if let Some(body) = text.strip_suffix("# EOF\n") {
                text.truncate(body.len());
            }
            crate::listener::encode_listener_metrics(&mut text)
        });
    match encoded {
        Ok(()) => ([(header::CONTENT_TYPE, OPENMETRICS_CONTENT_TYPE)], text).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {e}"),
        )
            .into_response(),
    }
}

async fn healthz() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn readyz(State(state): State<OpsState>) -> Response {
    match state.ready.check().await {
        Ok(()) => axum::Json(json!({"status": "ready"})).into_response(),
        Err(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "unready", "reason": reason})),
        )
            .into_response(),
    }
}

/// A running ops server; stopped by [`OpsServer::shutdown`] or on drop.
#[derive(Debug)]
pub struct OpsServer {
    local_addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl OpsServer {
    /// The address it listens on (the port, when `listen` asked for 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Stops accepting, lets requests in flight finish, and waits.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }

    /// Stops at once (requests in flight are cut).
    pub fn abort(&self) {
        self.task.abort();
    }
}

impl Drop for OpsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Binds `listen` and serves `router` on it in a background task, with the
/// default [`ListenerLimits`].
pub async fn serve_ops(listen: SocketAddr, router: Router) -> Result<OpsServer, TelemetryError> {
    serve_ops_with(listen, router, ListenerLimits::default()).await
}

/// [`serve_ops`] with the given connection limits.
pub async fn serve_ops_with(
    listen: SocketAddr,
    router: Router,
    limits: ListenerLimits,
) -> Result<OpsServer, TelemetryError> {
    let bind_error = |source| TelemetryError::Bind {
        addr: listen,
        source,
    };
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(bind_error)?;
    let local_addr = listener.local_addr().map_err(bind_error)?;
    let listener = CappedListener::new(listener, "ops", &limits);
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let stopped = async {
            let _ = stopped.await;
        };
        serve_router(listener, router, limits, Drain::Wait, stopped).await;
    });
    tracing::info!(%local_addr, "ops endpoint (/metrics, /healthz, /readyz) listening");
    Ok(OpsServer {
        local_addr,
        stop: Some(stop),
        task,
    })
}
