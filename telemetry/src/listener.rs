//! Limits every sandbolt listener applies to the clients it accepts: a
//! connection cap, a header-read timeout, an idle timeout, HTTP/2 keepalive
//! and a request-body cap.
//!
//! Why: the lifecycle API and the agent's data-plane proxy are reachable by
//! anyone on the network before any credential is checked. Without these, a
//! client that opens connections and sends half a request line ("slowloris")
//! holds a task and a descriptor each, forever, until the process runs out
//! of descriptors and stops answering everyone.
//!
//! - [`CappedListener`] accepts at most `max_connections` connections at a
//!   time; one over the cap is accepted and closed at once (so the kernel's
//!   backlog does not fill with clients that would wait forever) and counted
//!   in `sandbolt_listener_connections_rejected_total`.
//! - [`serve_http`] / [`serve_router`] serve HTTP/1 and HTTP/2 on it with a
//!   per-connection watchdog: a new connection must deliver a complete request
//!   head within `header_read_timeout`; a connection with no request in
//!   progress is closed after `idle_timeout` (counted in
//!   `sandbolt_listener_timeouts_total`). A request in progress (a long create,
//!   a streaming response) and an upgraded connection (WebSocket) are never
//!   cut by the watchdog.
//! - [`capped_incoming`] feeds tonic servers: connections under the cap, each
//!   dropped unless its first bytes arrive within `header_read_timeout`.
//!
//! The metrics are process-wide (label `listener` names the port) and every
//! ops port's `/metrics` shows them.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use http::{Request, Response, StatusCode};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::time::Instant;

/// Default cap on open connections per listener.
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
/// Default time a new connection has to send a complete request head.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time a connection may sit with no request in progress.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// Default interval of HTTP/2 keepalive pings (a peer that stops answering
/// them is dropped after [`HTTP2_KEEPALIVE_TIMEOUT`]).
pub const DEFAULT_HTTP2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long an HTTP/2 keepalive ping may go unanswered.
pub const HTTP2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Default cap on a request body that a handler reads whole (JSON and the
/// like); routes that stream uploads set their own.
pub const DEFAULT_MAX_BODY_BYTES: usize = 2 * 1024 * 1024;
/// TCP keepalive probes start after this long without traffic, so peers that
/// vanished (no FIN, no RST) are noticed by the kernel.
const TCP_KEEPALIVE: Duration = Duration::from_secs(60);
/// Pause after an accept error (out of descriptors and the like) so the loop
/// does not spin on a full descriptor table.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Length of the HTTP/2 client connection preface (`PRI * HTTP/2.0...`),
/// which every gRPC client sends first.
const HTTP2_PREFACE_LEN: usize = 24;

/// Limits of one listener (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenerLimits {
    /// Connections open at once; more are accepted and closed.
    pub max_connections: usize,
    /// A new connection's first request head must be complete within this.
    pub header_read_timeout: Duration,
    /// A connection with no request in progress is closed after this.
    pub idle_timeout: Duration,
    /// HTTP/2 keepalive ping interval.
    pub http2_keepalive_interval: Duration,
    /// Largest request body a handler reads whole.
    pub max_body_bytes: usize,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            http2_keepalive_interval: DEFAULT_HTTP2_KEEPALIVE_INTERVAL,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }
}

/// A limit that cannot work (zero connections, a zero timeout), naming the
/// flag it came from.
#[derive(Debug, thiserror::Error)]
#[error("invalid listener limit {field}: {reason}")]
pub struct LimitsError {
    pub field: &'static str,
    pub reason: &'static str,
}

impl ListenerLimits {
    /// Refuses limits that would make the listener useless.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let err = |field, reason| Err(LimitsError { field, reason });
        if self.max_connections == 0 {
            return err("max-connections", "must be at least 1");
        }
        if self.max_connections > Semaphore::MAX_PERMITS {
            return err("max-connections", "too large");
        }
        if self.header_read_timeout.is_zero() {
            return err("header-read-timeout", "must be more than 0");
        }
        if self.idle_timeout.is_zero() {
            return err("idle-timeout", "must be more than 0");
        }
        if self.http2_keepalive_interval.is_zero() {
            return err("http2-keepalive-interval", "must be more than 0");
        }
        if self.max_body_bytes == 0 {
            return err("max-body-bytes", "must be more than 0");
        }
        Ok(())
    }
}

/// The listener flags every server binary takes (`--max-connections`,
/// `--header-read-timeout`, `--idle-timeout`, `--http2-keepalive-interval`,
/// `--max-body-bytes`), applied to each of its listeners.
#[derive(Debug, Clone, Copy, clap::Args)]
pub struct ListenerArgs {
    /// Connections each listener holds open at once; one more is accepted
    /// and closed at once.
    #[arg(long, env = "SANDBOLT_MAX_CONNECTIONS", value_name = "N", default_value_t = DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Time a new connection has to send a complete request head (gRPC
    /// ports: its first bytes) before it is closed.
    #[arg(long, env = "SANDBOLT_HEADER_READ_TIMEOUT", value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    pub header_read_timeout: Duration,
    /// Time an HTTP connection may sit with no request in progress before
    /// it is closed (upgraded connections and requests in progress are
    /// never cut).
    #[arg(long, env = "SANDBOLT_IDLE_TIMEOUT", value_name = "DURATION", default_value = "120s", value_parser = humantime::parse_duration)]
    pub idle_timeout: Duration,
    /// Interval of HTTP/2 keepalive pings; a peer that leaves one
    /// unanswered for 20 s is dropped.
    #[arg(long, env = "SANDBOLT_HTTP2_KEEPALIVE_INTERVAL", value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub http2_keepalive_interval: Duration,
    /// Largest request body an HTTP handler reads whole (JSON); streamed
    /// bodies (proxied traffic, file uploads) are not capped by it.
    #[arg(long, env = "SANDBOLT_MAX_BODY_BYTES", value_name = "BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
}

impl ListenerArgs {
    /// The limits, refused (naming the flag) when they cannot work.
    pub fn limits(&self) -> Result<ListenerLimits, LimitsError> {
        let limits = ListenerLimits {
            max_connections: self.max_connections,
            header_read_timeout: self.header_read_timeout,
            idle_timeout: self.idle_timeout,
            http2_keepalive_interval: self.http2_keepalive_interval,
            max_body_bytes: self.max_body_bytes,
        };
        limits.validate()?;
        Ok(limits)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

/// The process-wide listener metrics.
#[derive(Debug, Default)]
struct ListenerMetrics {
    open: Family<ListenerLabels, Gauge>,
    rejected: Family<ListenerLabels, Counter>,
    timed_out: Family<ListenerLabels, Counter>,
    registry: Registry,
}

fn metrics() -> &'static ListenerMetrics {
    static METRICS: OnceLock<ListenerMetrics> = OnceLock::new();
    METRICS.get_or_init(|| {
        let mut m = ListenerMetrics::default();
        m.registry.register(
            "sandbolt_listener_connections_open",
            "Connections open on a listener",
            m.open.clone(),
        );
        m.registry.register(
            "sandbolt_listener_connections_rejected",
            "Connections accepted and closed at once because the listener was at its connection cap",
            m.rejected.clone(),
        );
        m.registry.register(
            "sandbolt_listener_timeouts",
            "Connections closed for sending no request head in time or for sitting idle",
            m.timed_out.clone(),
        );
        m
    })
}

/// The listener metrics as OpenMetrics text (ending in `# EOF`), for an ops
/// port to append to its own registry's.
///
/// Families with no samples yet are left out: some OpenMetrics parsers
/// (openmetrics-parser among them) reject a family without samples, and
/// a port that never refused a connection would otherwise always show one.
pub(crate) fn encode_listener_metrics(out: &mut String) -> std::fmt::Result {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &metrics().registry)?;
    let mut family = String::new();
    let mut has_samples = false;
    for line in text.lines() {
        if line.starts_with("# HELP ") || line == "# EOF" {
            if has_samples {
                out.push_str(&family);
            }
            family.clear();
            has_samples = false;
        }
        if line == "# EOF" {
            break;
        }
        has_samples |= !line.starts_with('#');
        family.push_str(line);
        family.push('\n');
    }
    out.push_str("# EOF\n");
    Ok(())
}

/// A TCP listener that holds at most `max_connections` connections.
#[derive(Debug)]
pub struct CappedListener {
    listener: TcpListener,
    permits: Arc<Semaphore>,
    name: &'static str,
}

/// An accepted connection; closing it (dropping) frees its place under the
/// cap.
#[derive(Debug)]
pub struct CappedConn {
    pub stream: TcpStream,
    pub peer: SocketAddr,
    permit: Permit,
}

/// A place under the cap, counted in the open-connections gauge.
#[derive(Debug)]
struct Permit {
    _permit: OwnedSemaphorePermit,
    name: &'static str,
}

impl Drop for Permit {
    fn drop(&mut self) {
        metrics()
            .open
            .get_or_create(&ListenerLabels {
                listener: self.name,
            })
            .dec();
    }
}

impl CappedConn {
    /// The connection as a stream that keeps its place under the cap until
    /// dropped.
    pub fn into_stream(self) -> CappedStream {
        CappedStream {
            stream: self.stream,
            permit: self.permit,
            prefix: Vec::new(),
            prefix_pos: 0,
        }
    }
}

impl CappedListener {
    /// `name` labels the listener's metrics (e.g. `lifecycle`, `agent-proxy`).
    pub fn new(listener: TcpListener, name: &'static str, limits: &ListenerLimits) -> Self {
        Self {
            listener,
            permits: Arc::new(Semaphore::new(limits.max_connections)),
            name,
        }
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The next connection under the cap, with TCP_NODELAY (responses go
    /// out in more than one write; with Nagle the second waits for the
    /// client's delayed ACK, ~40 ms) and TCP keepalive on. Connections over
    /// the cap are closed here; accept errors are logged and retried after a
    /// pause. Cancel-safe.
    pub async fn accept(&self) -> CappedConn {
        loop {
            let (stream, peer) = match self.listener.accept().await {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(listener = self.name, error = %e, "accept failed; retrying");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let labels = ListenerLabels {
                listener: self.name,
            };
            let Ok(permit) = self.permits.clone().try_acquire_owned() else {
                metrics().rejected.get_or_create(&labels).inc();
                tracing::debug!(listener = self.name, %peer, "connection cap reached; closing");
                drop(stream);
                continue;
            };
            metrics().open.get_or_create(&labels).inc();
            let _ = stream.set_nodelay(true);
            let keepalive = socket2::TcpKeepalive::new().with_time(TCP_KEEPALIVE);
            let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
            return CappedConn {
                stream,
                peer,
                permit: Permit {
                    _permit: permit,
                    name: self.name,
                },
            };
        }
    }
}

/// What [`serve_http`] does with open connections once asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drain {
    /// Ask each to finish its current request, and wait for all of them.
    Wait,
    /// Ask each to finish its current request, and return at once.
    NoWait,
}

/// Which HTTP versions a listener speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocols {
    /// HTTP/1.1, and HTTP/2 with prior knowledge.
    Auto,
    /// HTTP/1.1 only.
    Http1,
}

/// Serves `router` with [`serve_http`], under a body cap of
/// `limits.max_body_bytes` for handlers that read bodies whole (a route's
/// own `DefaultBodyLimit` still wins: it sits closer to the handler).
pub async fn serve_router(
    listener: CappedListener,
    router: axum::Router,
    limits: ListenerLimits,
    drain: Drain,
    shutdown: impl Future<Output = ()> + Send,
) {
    let router = router.layer(DefaultBodyLimit::max(limits.max_body_bytes));
    serve_http(
        listener,
        move |_peer| hyper_util::service::TowerToHyperService::new(router.clone()),
        limits,
        Protocols::Auto,
        drain,
        shutdown,
    )
    .await
}

/// Serves HTTP on `listener` until `shutdown` resolves: each connection gets
/// the service `make_service(peer)` and the watchdog of the module docs.
pub async fn serve_http<M, S, B>(
    listener: CappedListener,
    make_service: M,
    limits: ListenerLimits,
    protocols: Protocols,
    drain: Drain,
    shutdown: impl Future<Output = ()> + Send,
) where
    M: Fn(SocketAddr) -> S,
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>> + Send + Sync + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let builder = Arc::new(http_builder(&limits, protocols));
    let (stop_tx, stop_rx) = watch::channel(false);
    // Every connection task holds a sender; `recv` answers `None` once all
    // are gone.
    let (open_tx, mut open_rx) = mpsc::channel::<()>(1);
    tokio::pin!(shutdown);
    loop {
        let conn = tokio::select! {
            c = listener.accept() => c,
            () = &mut shutdown => break,
        };
        let service = make_service(conn.peer);
        let task = serve_connection(
            conn,
            service,
            builder.clone(),
            limits,
            listener.name,
            stop_rx.clone(),
        );
        let open = open_tx.clone();
        tokio::spawn(async move {
            let _open = open;
            task.await;
        });
    }
    let _ = stop_tx.send(true);
    drop(open_tx);
    if drain == Drain::Wait {
        let _ = open_rx.recv().await;
    }
}

fn http_builder(limits: &ListenerLimits, protocols: Protocols) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // hyper's own HTTP/1 head timer restarts whenever a connection goes
    // idle, which would make it the keep-alive timeout as well; the
    // watchdog below times heads and idleness separately, so hyper's timer
    // only backs it up with the longer of the two.
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout.max(limits.header_read_timeout));
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.http2_keepalive_interval)
        .keep_alive_timeout(HTTP2_KEEPALIVE_TIMEOUT);
    match protocols {
        Protocols::Auto => builder,
        Protocols::Http1 => builder.http1_only(),
    }
}

async fn serve_connection<S, B>(
    conn: CappedConn,
    service: S,
    builder: Arc<auto::Builder<TokioExecutor>>,
    limits: ListenerLimits,
    name: &'static str,
    mut stop: watch::Receiver<bool>,
) where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>> + Send + Sync + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let CappedConn {
        stream,
        peer,
        permit,
    } = conn;
    let activity = Arc::new(Activity::new());
    let service = Tracked {
        inner: service,
        activity: activity.clone(),
    };
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = activity.expired(&limits) => {
            metrics().timed_out.get_or_create(&ListenerLabels { listener: name }).inc();
            tracing::debug!(listener = name, %peer, "no request in time; closing");
            conn.as_mut().graceful_shutdown();
            // A head that arrived just now still gets its answer; a client
            // that keeps trickling does not get another timeout's worth.
            tokio::time::timeout(limits.header_read_timeout, conn.as_mut())
                .await
                .unwrap_or(Ok(()))
        }
        () = async { let _ = stop.wait_for(|s| *s).await; } => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(listener = name, %peer, error = %e, "connection ended with an error");
    }
    drop(permit);
}

/// What the watchdog knows about one connection.
#[derive(Debug)]
struct Activity {
    /// Requests whose response has not been sent in full yet.
    in_flight: AtomicUsize,
    /// A request has arrived on this connection (later heads get the idle
    /// timeout: the client has shown it speaks HTTP).
    served: AtomicBool,
    /// Switched protocols (WebSocket): no longer HTTP, never idle-timed.
    upgraded: AtomicBool,
    /// When the connection last went without a request in progress.
    idle_since: Mutex<Instant>,
    changed: Notify,
}

impl Activity {
    fn new() -> Self {
        Self {
            in_flight: AtomicUsize::new(0),
            served: AtomicBool::new(false),
            upgraded: AtomicBool::new(false),
            idle_since: Mutex::new(Instant::now()),
            changed: Notify::new(),
        }
    }

    fn idle_since(&self) -> Instant {
        *self.idle_since.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The deadline by which the next request must arrive; `None` while a
    /// request is in progress or after an upgrade.
    fn deadline(&self, limits: &ListenerLimits) -> Option<Instant> {
        if self.upgraded.load(Ordering::Acquire) || self.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let allowed = if self.served.load(Ordering::Acquire) {
            limits.idle_timeout
        } else {
            limits.header_read_timeout
        };
        Some(self.idle_since() + allowed)
    }

    /// Resolves once the connection has gone too long without a request.
    async fn expired(&self, limits: &ListenerLimits) {
        loop {
            // `notify_one` keeps a permit when nobody waits, so a change
            // between reading the state and waiting is not lost.
            match self.deadline(limits) {
                None => self.changed.notified().await,
                Some(deadline) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(deadline) => {
                            if self.deadline(limits).is_some_and(|d| d <= Instant::now()) {
                                return;
                            }
                        }
                        () = self.changed.notified() => {}
                    }
                }
            }
        }
    }

    fn start(&self) {
        self.served.store(true, Ordering::Release);
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_one();
    }

    fn finish(&self) {
        *self.idle_since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.changed.notify_one();
    }
}

/// One request in progress; ends when dropped.
#[derive(Debug)]
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// The connection's service, counting requests in progress.
struct Tracked<S> {
    inner: S,
    activity: Arc<Activity>,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, B> hyper::service::Service<Request<Incoming>> for Tracked<S>
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<B>>,
    S::Future: Send + 'static,
    B: Body + Send + 'static,
{
    type Response = Response<GuardedBody<B>>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        self.activity.start();
        let guard = InFlight(self.activity.clone());
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
                guard.0.upgraded.store(true, Ordering::Release);
            }
            // The request stays in progress until its body is sent.
            Ok(resp.map(|inner| GuardedBody {
                inner,
                guard: Some(guard),
            }))
        })
    }
}

pin_project_lite::pin_project! {
    /// A response body that ends its request's [`InFlight`] when it ends
    /// (or is dropped unsent).
    pub struct GuardedBody<B> {
        #[pin]
        inner: B,
        guard: Option<InFlight>,
    }
}

impl<B: Body> Body for GuardedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<B::Data>, B::Error>>> {
        let this = self.project();
        let polled = this.inner.poll_frame(cx);
        if let Poll::Ready(None) = polled {
            this.guard.take();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project_lite::pin_project! {
    /// A gRPC connection under the cap (see [`capped_incoming`]).
    #[derive(Debug)]
    pub struct CappedStream {
        #[pin]
        stream: TcpStream,
        permit: Permit,
        // Bytes read ahead of the server (the HTTP/2 preface), served first.
        prefix: Vec<u8>,
        prefix_pos: usize,
    }
}

impl CappedStream {
    /// The TCP stream (to peek at, or to read its addresses).
    pub fn get_ref(&self) -> &TcpStream {
        &self.stream
    }
}

impl AsyncRead for CappedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.project();
        if *this.prefix_pos < this.prefix.len() {
            let rest = &this.prefix[*this.prefix_pos..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            *this.prefix_pos += n;
            return Poll::Ready(Ok(()));
        }
        this.stream.poll_read(cx, buf)
    }
}

impl AsyncWrite for CappedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.project().stream.poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.project().stream.poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().stream.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().stream.poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for CappedStream {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

/// The incoming connections of a tonic server on `listener`: under the cap,
/// and each handed over only once its whole HTTP/2 preface (24 bytes) has
/// arrived within `header_read_timeout`, so sockets that never speak, or
/// speak half a preface, do not pile up.
/// After that, HTTP/2 keepalive (see [`tonic_server`]) finds dead peers.
///
/// The listener lives in the stream itself, not in a task of its own: when
/// the server stops and drops the stream, the port is closed at once (a
/// controller that lost leadership must not be reachable a moment longer).
pub fn capped_incoming(
    listener: CappedListener,
    limits: &ListenerLimits,
) -> impl futures::Stream<Item = Result<CappedStream, Infallible>> + Send + use<> {
    let first_bytes = limits.header_read_timeout;
    futures::stream::unfold(
        (listener, tokio::task::JoinSet::new()),
        move |(listener, mut pending)| async move {
            loop {
                tokio::select! {
                    conn = listener.accept() => {
                        // Per connection, so a silent client never holds up
                        // the others.
                        pending.spawn(with_preface(conn, listener.name, first_bytes));
                    }
                    Some(done) = pending.join_next(), if !pending.is_empty() => {
                        if let Ok(Some(stream)) = done {
                            return Some((Ok(stream), (listener, pending)));
                        }
                    }
                }
            }
        },
    )
}

/// `conn` as a stream once its whole HTTP/2 preface arrived in time: a
/// preface, not a first byte, because hyper's HTTP/2 server has no timeout of
/// its own for it, so a client sending half of it would otherwise hold the
/// connection for good. None when it did not (the connection is closed).
async fn with_preface(
    mut conn: CappedConn,
    name: &'static str,
    first_bytes: Duration,
) -> Option<CappedStream> {
    let mut preface = vec![0u8; HTTP2_PREFACE_LEN];
    let read = conn.stream.read_exact(&mut preface);
    match tokio::time::timeout(first_bytes, read).await {
        Ok(Ok(_)) => {
            let mut stream = conn.into_stream();
            stream.prefix = preface;
            Some(stream)
        }
        Ok(Err(_)) => None,
        Err(_) => {
            metrics()
                .timed_out
                .get_or_create(&ListenerLabels { listener: name })
                .inc();
            tracing::debug!(listener = name, peer = %conn.peer, "no first bytes in time; closing");
            None
        }
    }
}

/// A tonic server builder with the limits that apply per connection:
/// HTTP/2 keepalive pings (a peer that stops answering is dropped) and
/// TCP keepalive. Message sizes stay at tonic's 4 MiB decode cap.
pub fn tonic_server(limits: &ListenerLimits) -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(limits.http2_keepalive_interval))
        .http2_keepalive_timeout(Some(HTTP2_KEEPALIVE_TIMEOUT))
        .tcp_keepalive(Some(TCP_KEEPALIVE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_limits_are_valid() {
        ListenerLimits::default().validate().unwrap();
    }

    #[derive(clap::Parser)]
    struct Cmd {
        #[command(flatten)]
        args: ListenerArgs,
    }

    #[test]
    fn flag_defaults_are_the_default_limits() {
        use clap::Parser;
        let args = Cmd::try_parse_from(["x"]).unwrap().args;
        assert_eq!(args.limits().unwrap(), ListenerLimits::default());
        let args =
            Cmd::try_parse_from(["x", "--header-read-timeout", "2s", "--max-connections", "5"])
                .unwrap()
                .args;
        let limits = args.limits().unwrap();
        assert_eq!(limits.header_read_timeout, Duration::from_secs(2));
        assert_eq!(limits.max_connections, 5);
        let args = Cmd::try_parse_from(["x", "--max-connections", "0"])
            .unwrap()
            .args;
        assert!(
            args.limits()
                .unwrap_err()
                .to_string()
                .contains("max-connections")
        );
    }

    #[test]
    fn zero_limits_are_refused_naming_the_flag() {
        let limits = ListenerLimits {
            max_connections: 0,
            ..ListenerLimits::default()
        };
        let e = limits.validate().unwrap_err();
        assert!(e.to_string().contains("max-connections"), "{e}");
        let limits = ListenerLimits {
            header_read_timeout: Duration::ZERO,
            ..ListenerLimits::default()
        };
        let e = limits.validate().unwrap_err();
        assert!(e.to_string().contains("header-read-timeout"), "{e}");
    }
}
