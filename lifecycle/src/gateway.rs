//! The fsb gateway: where the OpenSandbox server's endpoints for its
//! fast-sandbox (`fsb-…`) sandboxes lead. The server resolves no endpoint
//! itself; it signs a route scope (`crate::gateway_scope`) naming namespace,
//! sandbox and port, and hands clients the gateway's address with the scope
//! in the `OpenSandbox-Ingress-To` header (header mode) or as the first path
//! segment (uri mode). The gateway checks the signature against the shared
//! key ring, asks the controller where that sandbox port is (in the
//! scope's namespace) and forwards HTTP, SSE and upgraded connections there
//! with the proxy's forwarding ([`crate::proxy::forward_to`]).
//!
//! The scope is the only credential: there is no API key on this listener,
//! and a request without a valid scope never reaches the controller or a
//! sandbox. The scope itself is not forwarded.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use sandbolt_telemetry::HttpMetrics;
use tokio::net::TcpListener;

use crate::controller::ControllerBackend;
use crate::error::{ApiError, ApiResult, StartError};
use crate::gateway_scope::{INGRESS_HEADER, KeyRing, RouteScope, ScopeError};
use crate::proxy::{Upstream, check_path, forward_to};

/// Where the gateway listens and the keys it accepts scopes from.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// Address to serve on (port 0 picks one; see
    /// [`crate::LifecycleHandle::gateway_addr`]).
    pub listen: SocketAddr,
    /// The OpenSandbox server's key ring (`OPENSANDBOX_SECURE_ACCESS_KEYS`).
    pub keys: KeyRing,
}

struct Gateway {
    backend: ControllerBackend,
    keys: KeyRing,
}

/// A gateway whose listener is bound, not yet serving.
pub(crate) struct BoundGateway {
    pub(crate) listener: TcpListener,
    pub(crate) addr: SocketAddr,
    pub(crate) router: Router,
}

/// Binds the gateway's listener; [`crate::Lifecycle::start`] serves it
/// beside the API and stops both together.
pub(crate) async fn bind(
    config: &GatewayConfig,
    backend: ControllerBackend,
    metrics: HttpMetrics,
) -> Result<BoundGateway, StartError> {
    let bind_error = |source| StartError::Bind {
        addr: config.listen,
        source,
    };
    let listener = TcpListener::bind(config.listen).await.map_err(bind_error)?;
    let addr = listener.local_addr().map_err(bind_error)?;
    let gateway = Arc::new(Gateway {
        backend,
        keys: config.keys.clone(),
    });
    tracing::info!(%addr, key_ids = ?config.keys.key_ids().collect::<String>(), "fsb gateway listening");
    Ok(BoundGateway {
        listener,
        addr,
        // Routes, not a fallback, so requests are counted under a route of
        // their own ("/{*path}") rather than as unmatched.
        router: Router::new()
            .route("/", any(route_scoped))
            .route("/{*path}", any(route_scoped))
            .with_state(gateway)
            .layer(sandbolt_telemetry::http_layer(metrics)),
    })
}

/// Every request, whatever its method and path.
#[tracing::instrument(
    name = "gateway",
    skip_all,
    fields(
        namespace = tracing::field::Empty,
        sandbox_id = tracing::field::Empty,
        port = tracing::field::Empty,
        key_id = tracing::field::Empty,
    )
)]
async fn route_scoped(State(gateway): State<Arc<Gateway>>, req: Request) -> Response {
    forward_scoped(&gateway, req)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn forward_scoped(gateway: &Gateway, req: Request) -> ApiResult<Response> {
    let (scope, path) = scope_and_path(&req)?;
    let grant = gateway.keys.verify(&scope).map_err(refusal)?;
    record_grant(&grant);
    check_path(&path)?;
    let route = gateway
        .backend
        .proxy_route_in(&grant.namespace, &grant.sandbox_id, grant.port)
        .await?;
    let upstream = Upstream {
        id: &grant.sandbox_id,
        port: grant.port,
    };
    forward_to(&route, &upstream, &path, req).await
}

/// The scope and the path to forward (relative): header mode forwards the
/// whole path; uri mode takes the scope off its front. The header wins when
/// both could apply, so a header-mode request may have any path.
fn scope_and_path(req: &Request) -> ApiResult<(String, String)> {
    let path = req.uri().path();
    let path = path.strip_prefix('/').unwrap_or(path);
    let mut headers = req.headers().get_all(INGRESS_HEADER).iter();
    match (headers.next(), headers.next()) {
        (Some(_), Some(_)) => Err(invalid_scope(format!(
            "more than one {INGRESS_HEADER} header"
        ))),
        (Some(value), None) => {
            let scope = value
                .to_str()
                .map_err(|_| invalid_scope(format!("{INGRESS_HEADER} is not ASCII")))?;
            Ok((scope.to_string(), path.to_string()))
        }
        (None, _) => {
            let (scope, rest) = path.split_once('/').unwrap_or((path, ""));
            if !scope.starts_with("f1.") {
                return Err(ApiError::invalid_code(
                    "MISSING_ROUTE_SCOPE",
                    format!(
                        "no route scope: send the endpoint's {INGRESS_HEADER} header, or the scope as the first path segment"
                    ),
                ));
            }
            Ok((scope.to_string(), rest.to_string()))
        }
    }
}

fn invalid_scope(message: String) -> ApiError {
    ApiError::invalid_code("INVALID_ROUTE_SCOPE", message)
}

/// A scope that does not parse is a bad request; one that parses but is not
/// signed by a key of the ring is forbidden.
fn refusal(e: ScopeError) -> ApiError {
    tracing::info!(reason = %e, "route scope refused");
    match e {
        ScopeError::Malformed(_) => invalid_scope(e.to_string()),
        ScopeError::UnknownKey(_) | ScopeError::BadSignature => {
            ApiError::new(StatusCode::FORBIDDEN, "ROUTE_SCOPE_REJECTED", e.to_string())
        }
    }
}

fn record_grant(grant: &RouteScope) {
    let span = tracing::Span::current();
    span.record("namespace", grant.namespace.as_str());
    span.record("sandbox_id", grant.sandbox_id.as_str());
    span.record("port", grant.port);
    span.record("key_id", tracing::field::display(grant.key_id));
}
