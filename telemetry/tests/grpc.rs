//! `grpc_layer` around a real tonic server, called through `BearerToken`.

use prometheus_client::registry::Registry;
use sandbolt_telemetry::{GrpcMetrics, grpc_layer, request_id};
use tracing::subscriber::set_default;
use tracing_subscriber::layer::SubscriberExt;

use crate::support::{
    PROBE_PATH, Probe, SERVICE, SpanRecorder, call, echo_client, is_generated_id, sample, scrape,
    start_echo,
};

const REQUESTS: &str = "sandbolt_grpc_server_requests_total";
const DURATION_COUNT: &str = "sandbolt_grpc_server_request_duration_seconds_count";
const DURATION_SUM: &str = "sandbolt_grpc_server_request_duration_seconds_sum";

#[tokio::test]
async fn counts_and_times_each_call_by_service_method_and_code() {
    let mut registry = Registry::default();
    let metrics = GrpcMetrics::register(&mut registry, "agent");
    let (addr, server) = start_echo(grpc_layer(metrics)).await;
    let mut client = echo_client(addr).await;

    let slow = Probe {
        delay_ms: 50,
        fail_not_found: false,
    };
    for _ in 0..2 {
        call(&mut client, PROBE_PATH, slow.clone(), &[])
            .await
            .unwrap();
    }
    let failing = Probe {
        delay_ms: 0,
        fail_not_found: true,
    };
    let err = call(&mut client, PROBE_PATH, failing, &[])
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);
    let err = call(&mut client, "/sandbolt.test.Echo/NoSuchMethod", slow, &[])
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unimplemented);

    let text = scrape(&registry);
    let labels = |code| {
        [
            ("component", "agent"),
            ("service", SERVICE),
            ("method", "Probe"),
            ("code", code),
        ]
    };
    assert_eq!(sample(&text, REQUESTS, &labels("OK")), Some(2.0), "{text}");
    assert_eq!(
        sample(&text, REQUESTS, &labels("NOT_FOUND")),
        Some(1.0),
        "{text}"
    );
    // A method nobody serves is one "unknown" series, not one per path.
    let unknown = [
        ("service", "unknown"),
        ("method", "unknown"),
        ("code", "UNIMPLEMENTED"),
    ];
    assert_eq!(sample(&text, REQUESTS, &unknown), Some(1.0), "{text}");
    assert!(!text.contains("NoSuchMethod"), "{text}");

    let probe = [
        ("component", "agent"),
        ("service", SERVICE),
        ("method", "Probe"),
    ];
    assert_eq!(sample(&text, DURATION_COUNT, &probe), Some(3.0), "{text}");
    let seconds = sample(&text, DURATION_SUM, &probe).unwrap();
    // Two calls slept 50 ms each inside the handler.
    assert!((0.1..5.0).contains(&seconds), "{seconds} s in {text}");
    server.abort();
}

// One thread, so the span recorder (a thread's default subscriber) sees the
// server's spans too.
#[tokio::test(flavor = "current_thread")]
async fn request_id_in_scope_reaches_the_handler_and_its_span() {
    let spans = SpanRecorder::default();
    let _subscriber = set_default(tracing_subscriber::registry().with(spans.clone()));
    let mut registry = Registry::default();
    let (addr, server) =
        start_echo(grpc_layer(GrpcMetrics::register(&mut registry, "agent"))).await;
    let mut client = echo_client(addr).await;

    let id = "client-rid-42".to_owned();
    let (seen, reply_metadata) = request_id::scope(
        id.clone(),
        call(&mut client, PROBE_PATH, Probe::default(), &[]),
    )
    .await
    .unwrap();
    assert_eq!(seen.current_request_id, id);
    assert_eq!(reply_metadata.get(request_id::HEADER).unwrap(), id.as_str());
    let grpc_spans = spans.named("grpc");
    assert_eq!(grpc_spans.len(), 1, "{grpc_spans:?}");
    assert_eq!(grpc_spans[0].fields["request_id"], id);
    assert_eq!(grpc_spans[0].fields["rpc"], PROBE_PATH);
    server.abort();
}

#[tokio::test]
async fn an_absent_or_invalid_request_id_is_replaced() {
    let mut registry = Registry::default();
    let (addr, server) =
        start_echo(grpc_layer(GrpcMetrics::register(&mut registry, "agent"))).await;
    let mut client = echo_client(addr).await;

    let (absent, reply) = call(&mut client, PROBE_PATH, Probe::default(), &[])
        .await
        .unwrap();
    assert!(is_generated_id(&absent.current_request_id), "{absent:?}");
    assert_eq!(
        reply.get(request_id::HEADER).unwrap(),
        absent.current_request_id.as_str()
    );

    let too_long = "r".repeat(request_id::MAX_LEN + 1);
    for invalid in [too_long.as_str(), "has space", ""] {
        let (seen, _) = call(
            &mut client,
            PROBE_PATH,
            Probe::default(),
            &[(request_id::HEADER, invalid)],
        )
        .await
        .unwrap();
        assert!(
            is_generated_id(&seen.current_request_id),
            "{invalid:?}: {seen:?}"
        );
        assert_ne!(seen.current_request_id, absent.current_request_id);
    }
    let (kept, _) = call(
        &mut client,
        PROBE_PATH,
        Probe::default(),
        &[(request_id::HEADER, "from-metadata.1")],
    )
    .await
    .unwrap();
    assert_eq!(kept.current_request_id, "from-metadata.1");
    server.abort();
}
