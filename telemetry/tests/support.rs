//! What the telemetry tests share: a small real gRPC service (hand-written
//! prost messages, tonic's own server machinery), its client through
//! `sandbolt_proto::auth::BearerToken`, and a tracing layer that keeps the
//! fields of every span opened.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use opentelemetry::trace::TraceContextExt;
use sandbolt_proto::auth::BearerToken;
use sandbolt_telemetry::{GrpcLayer, request_id};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::codegen::http;
use tonic::metadata::MetadataMap;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::Context as LayerContext;

pub const SERVICE: &str = "sandbolt.test.Echo";
pub const PROBE_PATH: &str = "/sandbolt.test.Echo/Probe";

/// What the client asks: how long the handler takes, and whether it fails.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Probe {
    #[prost(uint64, tag = "1")]
    pub delay_ms: u64,
    #[prost(bool, tag = "2")]
    pub fail_not_found: bool,
}

/// What the handler saw while serving the call.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Seen {
    /// `request_id::current()` inside the handler.
    #[prost(string, tag = "1")]
    pub current_request_id: String,
    /// The trace id of the handler's span (hex; zeros without OpenTelemetry).
    #[prost(string, tag = "2")]
    pub trace_id: String,
}

#[derive(Clone)]
struct EchoServer;

impl tonic::server::NamedService for EchoServer {
    const NAME: &'static str = SERVICE;
}

async fn probe_handler(req: Request<Probe>) -> Result<Response<Seen>, Status> {
    let probe = req.into_inner();
    tokio::time::sleep(Duration::from_millis(probe.delay_ms)).await;
    if probe.fail_not_found {
        return Err(Status::not_found("asked to fail"));
    }
    let trace_id = tracing::Span::current()
        .context()
        .span()
        .span_context()
        .trace_id()
        .to_string();
    Ok(Response::new(Seen {
        current_request_id: request_id::current().unwrap_or_default(),
        trace_id,
    }))
}

impl tower::Service<http::Request<tonic::body::Body>> for EchoServer {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(async move {
            if req.uri().path() != PROBE_PATH {
                return Ok(Status::unimplemented(req.uri().path().to_owned()).into_http());
            }
            let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::default());
            Ok(grpc.unary(tower::service_fn(probe_handler), req).await)
        })
    }
}

/// Serves the echo service on a loopback port, behind `layer`.
pub async fn start_echo(layer: GrpcLayer) -> (SocketAddr, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .layer(layer)
            .add_service(EchoServer)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    (addr, task)
}

pub type EchoClient = tonic::client::Grpc<InterceptedService<Channel, BearerToken>>;

/// A client of the echo service going through `BearerToken`, as every
/// sandbolt gRPC client does.
pub async fn echo_client(addr: SocketAddr) -> EchoClient {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    tonic::client::Grpc::new(InterceptedService::new(channel, BearerToken::none()))
}

/// Calls `path` with `probe` and `metadata`; the reply and its metadata.
pub async fn call(
    client: &mut EchoClient,
    path: &'static str,
    probe: Probe,
    metadata: &[(&'static str, &str)],
) -> Result<(Seen, MetadataMap), Status> {
    let mut req = Request::new(probe);
    for (key, value) in metadata {
        req.metadata_mut().insert(*key, value.parse().unwrap());
    }
    client
        .ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let codec = tonic_prost::ProstCodec::<Probe, Seen>::default();
    let reply = client
        .unary(req, http::uri::PathAndQuery::from_static(path), codec)
        .await?;
    let metadata = reply.metadata().clone();
    Ok((reply.into_inner(), metadata))
}

/// One span as opened: its name and its fields' values (Debug-formatted
/// values as `{:?}` shows them, strings as they are).
#[derive(Clone, Debug)]
pub struct OpenedSpan {
    pub name: &'static str,
    pub fields: HashMap<String, String>,
}

/// A tracing layer that keeps every span opened while it is installed.
#[derive(Clone, Default)]
pub struct SpanRecorder(Arc<Mutex<Vec<OpenedSpan>>>);

impl SpanRecorder {
    pub fn spans(&self) -> Vec<OpenedSpan> {
        self.0.lock().unwrap().clone()
    }

    pub fn named(&self, name: &str) -> Vec<OpenedSpan> {
        self.spans()
            .into_iter()
            .filter(|s| s.name == name)
            .collect()
    }
}

struct FieldsVisitor<'a>(&'a mut HashMap<String, String>);

impl Visit for FieldsVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for SpanRecorder {
    fn on_new_span(&self, attrs: &Attributes<'_>, _id: &Id, _ctx: LayerContext<'_, S>) {
        let mut fields = HashMap::new();
        attrs.record(&mut FieldsVisitor(&mut fields));
        self.0.lock().unwrap().push(OpenedSpan {
            name: attrs.metadata().name(),
            fields,
        });
    }
}

/// Is `id` one [`request_id::accept_or_new`] made (uuid v4, simple form)?
pub fn is_generated_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()) && uuid_version_is_4(id)
}

fn uuid_version_is_4(id: &str) -> bool {
    id.as_bytes()[12] == b'4'
}

/// The registry's OpenMetrics text, as `/metrics` serves it.
pub fn scrape(registry: &prometheus_client::registry::Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text
}

/// The value of the sample `name{labels}` in OpenMetrics `text` (labels
/// in any order; every given label must match).
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (series_name, rest) = series.split_once('{').unwrap_or((series, "}"));
            if series_name != name {
                return None;
            }
            let label_text = rest.strip_suffix('}')?;
            let all_match = labels
                .iter()
                .all(|(k, v)| label_text.split(',').any(|kv| kv == format!("{k}=\"{v}\"")));
            all_match.then(|| value.parse().ok()).flatten()
        })
}
