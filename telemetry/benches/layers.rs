//! What the always-on counting layers cost one request (issue 20).
//!
//! Same process, loopback, one connection kept open per client:
//! - gRPC: one unary `grpc.health.v1.Health/Check` to a tonic server with
//!   `grpc_layer` against the same server without it;
//! - HTTP: one `GET /ping` to an axum router with `http_layer` against the
//!   same router without it.
//!
//! The process runs the `sandbolt` binary's default subscriber (log lines
//! at `info`, written to a sink here), so the layers' spans are recorded as
//! they are in a running component; no OTLP export.
//!
//! `cargo bench -p sandbolt-telemetry --bench layers`; under
//! `cargo test --benches` criterion runs each case once (the quick form).

use std::hint::black_box;
use std::net::SocketAddr;

use axum::Router;
use axum::routing::get;
use criterion::{Criterion, criterion_group, criterion_main};
use prometheus_client::registry::Registry;
use sandbolt_telemetry::{GrpcMetrics, HttpMetrics, grpc_layer, http_layer};
use tokio::net::TcpListener;
use tokio::runtime::Runtime;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

async fn loopback() -> (TcpListener, SocketAddr) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    (listener, addr)
}

/// A health server on loopback, behind `grpc_layer` when `counted`.
async fn start_grpc(counted: bool) -> SocketAddr {
    let (_reporter, health) = tonic_health::server::health_reporter();
    let (listener, addr) = loopback().await;
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    tokio::spawn(async move {
        let served = if counted {
            let metrics = GrpcMetrics::register(&mut Registry::default(), "agent");
            tonic::transport::Server::builder()
                .layer(grpc_layer(metrics))
                .add_service(health)
                .serve_with_incoming(incoming)
                .await
        } else {
            tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming(incoming)
                .await
        };
        served.expect("gRPC server");
    });
    addr
}

async fn grpc_client(addr: SocketAddr) -> HealthClient<Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("uri")
        .connect()
        .await
        .expect("connect");
    HealthClient::new(channel)
}

/// A router with one route on loopback, behind `http_layer` when `counted`.
async fn start_http(counted: bool) -> SocketAddr {
    let mut router = Router::new().route("/ping", get(|| async { "ok" }));
    if counted {
        let metrics = HttpMetrics::register(&mut Registry::default(), "lifecycle");
        router = router.layer(http_layer(metrics));
    }
    let (listener, addr) = loopback().await;
    tokio::spawn(async move { axum::serve(listener, router).await.expect("HTTP server") });
    addr
}

fn grpc(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("grpc unary Health/Check");
    for (name, counted) in [("without grpc_layer", false), ("with grpc_layer", true)] {
        let mut client = rt.block_on(async { grpc_client(start_grpc(counted).await).await });
        group.bench_function(name, |b| {
            b.iter(|| {
                rt.block_on(client.check(HealthCheckRequest {
                    service: String::new(),
                }))
                .map(|r| black_box(r.into_inner().status))
                .expect("check answered")
            })
        });
    }
    group.finish();
}

fn http(c: &mut Criterion) {
    let rt = runtime();
    let client = reqwest::Client::new();
    let mut group = c.benchmark_group("http GET /ping");
    for (name, counted) in [("without http_layer", false), ("with http_layer", true)] {
        let url = format!("http://{}/ping", rt.block_on(start_http(counted)));
        group.bench_function(name, |b| {
            b.iter(|| {
                rt.block_on(async {
                    let response = client.get(&url).send().await.expect("GET answered");
                    assert!(response.status().is_success(), "{}", response.status());
                    black_box(response.bytes().await.expect("body"))
                })
            })
        });
    }
    group.finish();
}

fn subscriber() {
    // The default of `sandbolt <component>` (`--log info`), to a sink.
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(std::io::sink)
        .init();
}

fn benches(c: &mut Criterion) {
    subscriber();
    grpc(c);
    http(c);
}

criterion_group!(layers, benches);
criterion_main!(layers);
