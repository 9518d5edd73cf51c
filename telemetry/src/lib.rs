//! Observability shared by every sandbolt component (issue 20).
//!
//! One crate so the controller, agent, lifecycle and janitor label their
//! metrics, carry request ids and export spans the same way:
//! - [`request_id`]: the id of the request a task serves, carried across
//!   gRPC hops by `sandbolt_proto::auth::BearerToken`;
//! - [`grpc_layer`] / [`http_layer`]: tower layers that count and time every
//!   call and run it inside its request id and span;
//! - [`ops_router`] / [`serve_ops`]: `/metrics`, `/healthz`, `/readyz`;
//! - [`otlp`]: spans over OTLP/gRPC with W3C trace context;
//! - [`listener`]: connection caps, header-read and idle timeouts and body
//!   caps for every server's listener (issue 21).

mod grpc;
mod http_metrics;
pub mod listener;
mod ops;
pub mod otlp;
mod propagation;
pub mod request_id;

pub use grpc::{GrpcBody, GrpcLayer, GrpcMetrics, GrpcService, grpc_layer};
pub use http_metrics::{HttpLayer, HttpMetrics, HttpService, UNMATCHED_ROUTE, http_layer};
pub use listener::{CappedListener, ListenerLimits};
pub use ops::{
    OPENMETRICS_CONTENT_TYPE, OpsServer, Readiness, ops_router, serve_ops, serve_ops_with,
};
pub use prometheus_client;

/// What can go wrong setting up telemetry.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("invalid OTLP endpoint {endpoint:?}: {reason}")]
    OtlpEndpoint { endpoint: String, reason: String },
    #[error("cannot build the OTLP span exporter: {0}")]
    OtlpExporter(#[from] opentelemetry_otlp::ExporterBuildError),
}
