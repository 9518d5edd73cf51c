//! The HTTP layer for axum routers: counts and times every request per
//! matched route, method and status, and carries `X-Request-ID`.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::extract::MatchedPath;
use http::{Method, Request, Response};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tracing::Instrument;

use crate::request_id;

/// The route label of a request no route matched (one value, however many
/// paths clients try).
pub const UNMATCHED_ROUTE: &str = "unmatched";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    component: &'static str,
    route: String,
    method: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DurationLabels {
    component: &'static str,
    route: String,
    method: &'static str,
}

/// `sandbolt_http_requests_total` and `sandbolt_http_request_duration_seconds`
/// of one component.
#[derive(Clone, Debug)]
pub struct HttpMetrics {
    component: &'static str,
    requests: Family<RequestLabels, Counter>,
    duration: Family<DurationLabels, Histogram>,
}

impl HttpMetrics {
    pub fn register(reg: &mut Registry, component: &'static str) -> Self {
        let requests = Family::<RequestLabels, Counter>::default();
        let duration = Family::<DurationLabels, Histogram>::new_with_constructor(
            crate::ops::latency_histogram,
        );
        reg.register(
            "sandbolt_http_requests",
            "HTTP requests served, by matched route, method and status",
            requests.clone(),
        );
        reg.register(
            "sandbolt_http_request_duration_seconds",
            "Time from an HTTP request's arrival to its response head",
            duration.clone(),
        );
        Self {
            component,
            requests,
            duration,
        }
    }

    fn record(&self, route: String, method: &'static str, status: u16, started: Instant) {
        self.duration
            .get_or_create(&DurationLabels {
                component: self.component,
                route: route.clone(),
                method,
            })
            .observe(started.elapsed().as_secs_f64());
        self.requests
            .get_or_create(&RequestLabels {
                component: self.component,
                route,
                method,
                status,
            })
            .inc();
    }
}

/// The layer for `axum::Router::layer(..)` (there, unlike around the whole
/// router, the matched route is known).
pub fn http_layer(m: HttpMetrics) -> HttpLayer {
    HttpLayer { metrics: m }
}

/// See [`http_layer`].
#[derive(Clone, Debug)]
pub struct HttpLayer {
    metrics: HttpMetrics,
}

impl<S> tower::Layer<S> for HttpLayer {
    type Service = HttpService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        HttpService {
            inner,
            metrics: self.metrics.clone(),
        }
    }
}

/// The service [`HttpLayer`] wraps around each route.
#[derive(Clone, Debug)]
pub struct HttpService<S> {
    inner: S,
    metrics: HttpMetrics,
}

impl<S, ReqBody, ResBody> tower::Service<Request<ReqBody>> for HttpService<S>
where
    S: tower::Service<Request<ReqBody>, Response = Response<ResBody>> + Send,
    S::Future: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ResBody>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqBody>) -> Self::Future {
        let started = Instant::now();
        let route = req
            .extensions()
            .get::<MatchedPath>()
            .map_or_else(|| UNMATCHED_ROUTE.to_owned(), |p| p.as_str().to_owned());
        let method = method_label(req.method());
        let id = request_id::accept_in(req.headers_mut());
        let span = tracing::info_span!("http", request_id = %id, method, route = %route);
        crate::propagation::adopt_remote_parent(&span, req.headers());
        let call = {
            let _entered = span.enter();
            self.inner.call(req)
        };
        let metrics = self.metrics.clone();
        Box::pin(
            request_id::scope(id.clone(), async move {
                let mut response = call.await?;
                metrics.record(route, method, response.status().as_u16(), started);
                request_id::set_header(response.headers_mut(), &id);
                Ok(response)
            })
            .instrument(span),
        )
    }
}

/// The standard methods by name; anything else is one `OTHER` value.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        _ => "OTHER",
    }
}
