//! The gRPC server layer: counts and times every call per service, method
//! and gRPC status code, and runs it inside its request id and span.

use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Instant;

use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tonic::Code;
use tracing::Instrument;

use crate::request_id;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    component: &'static str,
    service: String,
    method: String,
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DurationLabels {
    component: &'static str,
    service: String,
    method: String,
}

/// `sandbolt_grpc_server_requests_total` and
/// `sandbolt_grpc_server_request_duration_seconds` of one component.
#[derive(Clone, Debug)]
pub struct GrpcMetrics {
    component: &'static str,
    requests: Family<CallLabels, Counter>,
    duration: Family<DurationLabels, Histogram>,
}

impl GrpcMetrics {
    pub fn register(reg: &mut Registry, component: &'static str) -> Self {
        let requests = Family::<CallLabels, Counter>::default();
        let duration = Family::<DurationLabels, Histogram>::new_with_constructor(
            crate::ops::latency_histogram,
        );
        reg.register(
            "sandbolt_grpc_server_requests",
            "gRPC calls served, by service, method and status code",
            requests.clone(),
        );
        reg.register(
            "sandbolt_grpc_server_request_duration_seconds",
            "Time from a gRPC call's arrival to its status (end of its response stream)",
            duration.clone(),
        );
        Self {
            component,
            requests,
            duration,
        }
    }

    /// The same metric families, counted under another `component`: for a
    /// process that runs several components against one registry (`sandbolt
    /// up`), where registering the families twice would write each family
    /// twice in one scrape, which parsers reject.
    pub fn for_component(&self, component: &'static str) -> Self {
        Self {
            component,
            requests: self.requests.clone(),
            duration: self.duration.clone(),
        }
    }

    fn record(&self, rpc: &Rpc, code: Code, started: Instant) {
        // An unknown method (Unimplemented) must not add a label value per
        // path a client makes up.
        let (service, method) = if code == Code::Unimplemented {
            ("unknown".to_owned(), "unknown".to_owned())
        } else {
            (rpc.service.clone(), rpc.method.clone())
        };
        self.duration
            .get_or_create(&DurationLabels {
                component: self.component,
                service: service.clone(),
                method: method.clone(),
            })
            .observe(started.elapsed().as_secs_f64());
        self.requests
            .get_or_create(&CallLabels {
                component: self.component,
                service,
                method,
                code: code_name(code),
            })
            .inc();
    }
}

/// The layer for `tonic::transport::Server::builder().layer(..)`.
pub fn grpc_layer(m: GrpcMetrics) -> GrpcLayer {
    GrpcLayer { metrics: m }
}

/// See [`grpc_layer`].
#[derive(Clone, Debug)]
pub struct GrpcLayer {
    metrics: GrpcMetrics,
}

impl<S> tower::Layer<S> for GrpcLayer {
    type Service = GrpcService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcService {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

/// The service [`GrpcLayer`] wraps around a gRPC server's routes.
#[derive(Clone, Debug)]
pub struct GrpcService<S> {
    inner: S,
    metrics: GrpcMetrics,
}

/// `/package.Service/Method` split into its two labels.
#[derive(Clone, Debug)]
struct Rpc {
    service: String,
    method: String,
}

impl Rpc {
    fn from_path(path: &str) -> Self {
        match path.trim_start_matches('/').split_once('/') {
            Some((service, method)) if !service.is_empty() && !method.is_empty() => Self {
                service: service.to_owned(),
                method: method.to_owned(),
            },
            _ => Self {
                service: "unknown".to_owned(),
                method: "unknown".to_owned(),
            },
        }
    }
}

impl<S, ReqBody, ResBody> tower::Service<Request<ReqBody>> for GrpcService<S>
where
    S: tower::Service<Request<ReqBody>, Response = Response<ResBody>> + Send,
    S::Future: Send + 'static,
    ResBody: Body,
{
    type Response = Response<GrpcBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let started = Instant::now();
        let rpc = Rpc::from_path(req.uri().path());
        let id = request_id::accept_in(req.headers_mut());
        let span = tracing::info_span!(
            "grpc",
            request_id = %id,
            rpc = %req.uri().path(),
        );
        crate::propagation::adopt_remote_parent(&span, req.headers());
        let call = {
            let _entered = span.enter();
            self.inner.call(req)
        };
        let metrics = self.metrics.clone();
        let body_span = span.clone();
        Box::pin(
            request_id::scope(id.clone(), async move {
                let mut response = call.await?;
                request_id::set_header(response.headers_mut(), &id);
                let head_code = status_in(response.headers());
                Ok(response.map(|inner| GrpcBody {
                    inner,
                    call: Some(CallInFlight {
                        metrics,
                        rpc,
                        started,
                        code: head_code,
                    }),
                    span: body_span,
                }))
            })
            .instrument(span),
        )
    }
}

fn status_in(headers: &HeaderMap) -> Option<Code> {
    headers
        .get("grpc-status")
        .map(|v| Code::from_bytes(v.as_bytes()))
}

/// A call whose status is not known yet: recorded once, when the status
/// arrives (trailers, or the trailers-only head) or the stream ends.
struct CallInFlight {
    metrics: GrpcMetrics,
    rpc: Rpc,
    started: Instant,
    code: Option<Code>,
}

impl CallInFlight {
    fn finish(self, code: Option<Code>) {
        // No status at all: the stream ended without one (client went away
        // or the body failed), which gRPC clients see as Unknown/Cancelled.
        let code = code.or(self.code).unwrap_or(Code::Unknown);
        self.metrics.record(&self.rpc, code, self.started);
    }
}

pin_project_lite::pin_project! {
    /// A gRPC response body that records its call when the status passes.
    pub struct GrpcBody<B> {
        #[pin]
        inner: B,
        call: Option<CallInFlight>,
        span: tracing::Span,
    }

    impl<B> PinnedDrop for GrpcBody<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(call) = this.call.take() {
                let code = call.code.or(Some(Code::Cancelled));
                call.finish(code);
            }
        }
    }
}

impl<B: Body> Body for GrpcBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let _entered = this.span.enter();
        let frame = ready!(this.inner.poll_frame(cx));
        match &frame {
            Some(Ok(f)) => {
                if let Some(code) = f.trailers_ref().and_then(status_in)
                    && let Some(call) = this.call.take()
                {
                    call.finish(Some(code));
                }
            }
            Some(Err(_)) => {
                if let Some(call) = this.call.take() {
                    call.finish(Some(Code::Internal));
                }
            }
            None => {
                if let Some(call) = this.call.take() {
                    call.finish(None);
                }
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The status code's name as the gRPC spec writes it.
fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpc_labels_come_from_the_path() {
        let rpc = Rpc::from_path("/sandbolt.agent.v1.AgentService/CreateSandbox");
        assert_eq!(rpc.service, "sandbolt.agent.v1.AgentService");
        assert_eq!(rpc.method, "CreateSandbox");
        for odd in ["/", "", "/only", "//x", "/x/"] {
            assert_eq!(Rpc::from_path(odd).service, "unknown", "{odd}");
        }
    }
}
