//! `otlp::layer` exporting to an in-process OTLP/gRPC collector, and a
//! trace crossing one gRPC hop through `BearerToken` and `grpc_layer`.

use std::sync::{Arc, Mutex};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prometheus_client::registry::Registry;
use sandbolt_telemetry::{GrpcMetrics, grpc_layer, otlp};
use tokio::net::TcpListener;
use tracing::Instrument;
use tracing::subscriber::set_default;
use tracing_subscriber::layer::SubscriberExt;

use crate::support::{PROBE_PATH, Probe, call, echo_client, start_echo};

/// Every export request the collector received.
#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<ExportTraceServiceRequest>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Collector {
    async fn start(&self) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let service = TraceServiceServer::new(self.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
                .unwrap();
        });
        endpoint
    }

    /// (service.name of the exporting process, span) for every span received.
    fn spans(&self) -> Vec<(String, Span)> {
        let requests = self.0.lock().unwrap();
        let mut spans = Vec::new();
        for resource_spans in requests.iter().flat_map(|r| &r.resource_spans) {
            let service_name = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.clone());
            let Some(AnyValue::StringValue(service_name)) = service_name else {
                panic!("no service.name in {resource_spans:?}");
            };
            for span in resource_spans.scope_spans.iter().flat_map(|s| &s.spans) {
                spans.push((service_name.clone(), span.clone()));
            }
        }
        spans
    }
}

fn named<'a>(spans: &'a [(String, Span)], name: &str) -> Vec<&'a Span> {
    spans
        .iter()
        .filter(|(_, s)| s.name == name)
        .map(|(_, s)| s)
        .collect()
}

// One thread: the OpenTelemetry layer is this thread's default subscriber,
// and the server's spans are opened on it too.
#[tokio::test(flavor = "current_thread")]
async fn exports_spans_and_carries_traceparent_across_a_grpc_hop() {
    let collector = Collector::default();
    let endpoint = collector.start().await;
    let (layer, guard) = otlp::layer(&endpoint, "sandbolt-test").unwrap();
    let _subscriber = set_default(tracing_subscriber::registry().with(layer));

    let mut registry = Registry::default();
    let (addr, server) =
        start_echo(grpc_layer(GrpcMetrics::register(&mut registry, "agent"))).await;
    let mut client = echo_client(addr).await;
    let (seen, _) = call(&mut client, PROBE_PATH, Probe::default(), &[])
        .instrument(tracing::info_span!("client_call"))
        .await
        .unwrap();

    // The batch exporter blocks while it exports over a channel this thread
    // drives, so it flushes from a blocking thread.
    let guard = tokio::task::spawn_blocking(move || {
        guard.force_flush().unwrap();
        guard
    })
    .await
    .unwrap();
    let spans = collector.spans();
    let client_span = *named(&spans, "client_call")
        .first()
        .expect("client span exported");
    let server_span = *named(&spans, "grpc").first().expect("server span exported");
    assert_eq!(
        server_span.trace_id, client_span.trace_id,
        "one trace across the hop"
    );
    assert_eq!(
        server_span.parent_span_id, client_span.span_id,
        "server span's parent"
    );
    assert_eq!(
        hex(&client_span.trace_id),
        seen.trace_id,
        "handler's span context"
    );
    assert!(
        spans.iter().all(|(service, _)| service == "sandbolt-test"),
        "{spans:?}"
    );
    let request_id_attribute = server_span
        .attributes
        .iter()
        .find(|kv| kv.key == "request_id")
        .and_then(|kv| kv.value.as_ref()?.value.clone());
    assert!(
        matches!(request_id_attribute, Some(AnyValue::StringValue(ref id)) if id.len() == 32),
        "{request_id_attribute:?}"
    );
    tokio::task::spawn_blocking(move || guard.shutdown().unwrap())
        .await
        .unwrap();
    server.abort();
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
