//! Spans over OTLP/gRPC: a `tracing` layer that exports every span to an
//! OpenTelemetry collector, and the W3C TraceContext propagator installed
//! globally so `traceparent` crosses gRPC hops (see [`crate::request_id::inject`]).

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};
use tracing_subscriber::registry::LookupSpan;

use crate::TelemetryError;

/// The env var that names the collector (the OpenTelemetry convention).
pub const ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";

/// The tracing layer [`layer`] returns.
pub type OtlpLayer<S> = tracing_opentelemetry::OpenTelemetryLayer<S, SdkTracer>;

/// Keeps the exporter running; flushes and stops it when shut down or
/// dropped (so the last spans of a process reach the collector).
#[derive(Debug)]
pub struct OtlpGuard {
    provider: Option<SdkTracerProvider>,
}

impl OtlpGuard {
    /// Exports the spans buffered so far (blocks until the collector
    /// answered or the export timed out).
    pub fn force_flush(&self) -> Result<(), String> {
        match &self.provider {
            Some(p) => p.force_flush().map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }

    /// Flushes and stops the exporter.
    pub fn shutdown(mut self) -> Result<(), String> {
        match self.provider.take() {
            Some(p) => p.shutdown().map_err(|e| e.to_string()),
            None => Ok(()),
        }
    }
}

impl Drop for OtlpGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

/// A layer exporting spans to the OTLP/gRPC collector at `endpoint`
/// (`http://host:4317`) as `service_name`, and the W3C propagator set
/// globally. Must be called inside a tokio runtime (the gRPC channel's
/// worker runs on it), which must outlive the guard.
pub fn layer<S>(
    endpoint: &str,
    service_name: &str,
) -> Result<(OtlpLayer<S>, OtlpGuard), TelemetryError>
where
    S: tracing::Subscriber + for<'span> LookupSpan<'span>,
{
    check_endpoint(endpoint)?;
    let exporter = SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            Resource::builder()
                .with_attribute(KeyValue::new("service.name", service_name.to_owned()))
                .build(),
        )
        .build();
    let tracer = provider.tracer("sandbolt");
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    opentelemetry::global::set_tracer_provider(provider.clone());
    let layer = tracing_opentelemetry::layer().with_tracer(tracer);
    Ok((
        layer,
        OtlpGuard {
            provider: Some(provider),
        },
    ))
}

fn check_endpoint(endpoint: &str) -> Result<(), TelemetryError> {
    let uri: http::Uri =
        endpoint
            .parse()
            .map_err(|e: http::uri::InvalidUri| TelemetryError::OtlpEndpoint {
                endpoint: endpoint.to_owned(),
                reason: e.to_string(),
            })?;
    match uri.scheme_str() {
        Some("http") if uri.host().is_some() => Ok(()),
        _ => Err(TelemetryError::OtlpEndpoint {
            endpoint: endpoint.to_owned(),
            reason: "expected http://host:port (TLS to the collector is not built in)".to_owned(),
        }),
    }
}
