//! W3C trace context in and out of HTTP headers (gRPC metadata is HTTP/2
//! headers underneath), through the globally installed propagator: with
//! none installed (no `--otlp-endpoint`) both directions do nothing.

use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};
use opentelemetry::propagation::{Extractor, Injector};
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// Writes the current span's context (`traceparent`, `tracestate`) into
/// `headers` when the span is known to OpenTelemetry.
pub(crate) fn inject_current_span(headers: &mut HeaderMap) {
    let cx = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&cx, &mut HeaderInjector(headers));
    });
}

/// Makes the caller's span (from `traceparent`) the parent of `span`.
pub(crate) fn adopt_remote_parent(span: &tracing::Span, headers: &HeaderMap) {
    let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.extract(&HeaderExtractor(headers))
    });
    if opentelemetry::trace::TraceContextExt::has_active_span(&parent) {
        // Fails only when no OpenTelemetry layer is installed: nothing to link then.
        let _ = span.set_parent(parent);
    }
}
