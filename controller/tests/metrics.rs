//! The controller's metrics and ops endpoint (issue 20): a create, get and
//! delete round through the real gRPC ports shows in a scrape of
//! `/metrics` parsed by an OpenMetrics parser — RPC counts with their
//! status codes, the create stages, store writes, the sandboxes gauge going
//! up and back down, leader 1 — and `/readyz` follows the store and the
//! lease. Stand-in agents suffice: what is measured is the controller's own
//! work, and the stand-in answers creates over real gRPC.

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use openmetrics_parser::{MetricsExposition, OpenMetricsType, OpenMetricsValue};
use sandbolt_controller::ha::{ElectedExit, run_elected};
use sandbolt_controller::leader::{LeaderElector, LeaseConfig};
use sandbolt_controller::store::kube::{KubeStore, KubeStoreConfig};
use sandbolt_controller::{Controller, ControllerConfig, register_metrics};
use sandbolt_kube_double::ApiDouble;
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::fastpath::v2;
use sandbolt_telemetry::prometheus_client::registry::Registry;
use sandbolt_telemetry::{OpsServer, ops_router, serve_ops};
use sandbolt_test_support::{eventually_async, free_port, http};
use support::standin::StandInAgent;
use support::{HB, sandbox_request, sref, standin_config};
use tonic::Code;
use tonic::transport::Channel;

type Native = native::sandbox_service_client::SandboxServiceClient<Channel>;
type FastPath = v2::fast_path_service_client::FastPathServiceClient<Channel>;
type Health = tonic_health::pb::health_client::HealthClient<Channel>;

const NATIVE: &str = "sandbolt.control.v1.SandboxService";

/// One parsed scrape.
struct Scrape(MetricsExposition<OpenMetricsType, OpenMetricsValue>);

impl Scrape {
    async fn of(ops: SocketAddr) -> Scrape {
        let (status, text) = ops_get(ops, "metrics").await;
        assert_eq!(status, 200, "{text}");
        let parsed =
            openmetrics_parser::openmetrics::parse_openmetrics(&without_empty_families(&text))
                .unwrap_or_else(|e| panic!("not OpenMetrics text ({e:?}):\n{text}"));
        Scrape(parsed)
    }

    /// The sample of `family` whose labels include `labels`: a gauge's
    /// value, a counter's total, a histogram's count. `None`: no such
    /// series (or no such family).
    fn value(&self, family: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let f = self.0.families.get(family)?;
        f.iter_samples().find_map(|s| {
            let set = s.get_labelset().ok()?;
            labels
                .iter()
                .all(|(k, v)| set.get_label_value(k) == Some(*v))
                .then(|| match &s.value {
                    OpenMetricsValue::Gauge(n) => n.as_f64(),
                    OpenMetricsValue::Counter(c) => c.value.as_f64(),
                    OpenMetricsValue::Histogram(h) => h.count.unwrap_or(0) as f64,
                    other => panic!("{family}: unexpected sample {other:?}"),
                })
        })
    }

    /// [`Self::value`], 0 when the series does not exist (yet).
    fn count(&self, family: &str, labels: &[(&str, &str)]) -> f64 {
        self.value(family, labels).unwrap_or(0.0)
    }

    fn grpc_calls(&self, service: &str, method: &str, code: &str) -> f64 {
        self.count(
            "sandbolt_grpc_server_requests",
            &[
                ("component", "controller"),
                ("service", service),
                ("method", method),
                ("code", code),
            ],
        )
    }

    fn stage(&self, stage: &str) -> f64 {
        self.count(
            "sandbolt_controller_create_stage_duration_seconds",
            &[("stage", stage)],
        )
    }

    fn sandboxes(&self, phase: &str) -> Option<f64> {
        self.value("sandbolt_controller_sandboxes", &[("phase", phase)])
    }

    fn leader(&self) -> Option<f64> {
        self.value("sandbolt_controller_leader", &[])
    }
}

/// `text` without the families that have no sample yet (a histogram
/// nothing observed: its `# HELP` and `# TYPE` lines only). Valid
/// OpenMetrics, but openmetrics-parser 0.5 reads the next family's
/// descriptors as the empty one's and refuses the text.
fn without_empty_families(text: &str) -> String {
    let mut out = String::new();
    let mut descriptors = String::new();
    for line in text.lines() {
        if line.starts_with("# HELP ") || line.starts_with("# TYPE ") || line.starts_with("# UNIT ")
        {
            let name = line.split_whitespace().nth(2).unwrap_or_default();
            let pending = descriptors
                .lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(2));
            if pending.is_some_and(|p| p != name) {
                descriptors.clear();
            }
            descriptors.push_str(line);
            descriptors.push('\n');
            continue;
        }
        if line != "# EOF" {
            out.push_str(&descriptors);
        }
        descriptors.clear();
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// `GET /<path>` of the ops endpoint: status and body.
async fn ops_get(ops: SocketAddr, path: &str) -> (u16, String) {
    http::get(&format!("{ops}/{path}"), "", &[]).await
}

/// `/readyz`: its status and body.
async fn readyz(ops: SocketAddr) -> (u16, String) {
    ops_get(ops, "readyz").await
}

/// A registry with the controller's metrics in it, served on a free port.
async fn ops_endpoint() -> (sandbolt_controller::ControllerMetrics, OpsServer) {
    let mut registry = Registry::default();
    let metrics = register_metrics(&mut registry);
    let ops = serve_ops(
        "127.0.0.1:0".parse().unwrap(),
        ops_router(Arc::new(registry), metrics.readiness()),
    )
    .await
    .expect("ops endpoint");
    (metrics, ops)
}

async fn native_client(addr: SocketAddr) -> Native {
    Native::connect(format!("http://{addr}")).await.unwrap()
}

fn get_request(name: &str) -> native::GetSandboxRequest {
    native::GetSandboxRequest {
        sandbox: sref(name),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_get_delete_round_shows_in_the_scrape() {
    let dir = tempfile::tempdir().unwrap();
    let (metrics, ops) = ops_endpoint().await;
    let ops = ops.local_addr();
    // Nothing serves yet: unready, and not the leader.
    let (status, body) = readyz(ops).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("store is not open"), "{body}");
    assert_eq!(Scrape::of(ops).await.leader(), Some(0.0));

    let mut cfg = standin_config(dir.path());
    cfg.metrics = Some(metrics);
    let h = Controller::start(cfg).await.unwrap();
    let _agent =
        StandInAgent::start("agent-m", "default", 4, &["busybox"], h.local_addr(), HB).await;
    assert_eq!(readyz(ops).await.0, 200);
    let before = Scrape::of(ops).await;
    assert_eq!(before.leader(), Some(1.0));
    assert_eq!(before.sandboxes("running"), Some(0.0));
    assert_eq!(
        before.value("sandbolt_controller_agents", &[("state", "ready")]),
        Some(1.0)
    );
    assert_eq!(
        before.value("sandbolt_controller_capacity", &[("resource", "sandboxes")]),
        Some(4.0)
    );

    let mut c = native_client(h.local_addr()).await;
    c.create_sandbox(sandbox_request("m1", vec![]))
        .await
        .unwrap();
    c.get_sandbox(get_request("m1")).await.unwrap();
    let missing = c.get_sandbox(get_request("nope")).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);

    let up = Scrape::of(ops).await;
    assert_eq!(up.grpc_calls(NATIVE, "CreateSandbox", "OK"), 1.0);
    assert_eq!(up.grpc_calls(NATIVE, "GetSandbox", "OK"), 1.0);
    assert_eq!(up.grpc_calls(NATIVE, "GetSandbox", "NOT_FOUND"), 1.0);
    assert_eq!(
        up.count(
            "sandbolt_grpc_server_request_duration_seconds",
            &[("service", NATIVE), ("method", "GetSandbox")]
        ),
        2.0,
        "both gets timed"
    );
    // The agents' heartbeats arrive on the same port.
    assert!(
        up.grpc_calls("sandbolt.agent.v1.RegistryService", "Heartbeat", "OK") >= 1.0,
        "heartbeats counted"
    );
    assert_eq!(up.stage("place"), 1.0);
    assert_eq!(up.stage("agent_create"), 1.0);
    assert_eq!(up.stage("warm_claim"), 0.0, "a cold create claims nothing");
    assert_eq!(
        up.stage("record"),
        2.0,
        "strong mode: the Pending commit and the Running mark"
    );
    let writes = |s: &Scrape, op: &str| {
        s.count(
            "sandbolt_controller_store_write_duration_seconds",
            &[("store", "embedded"), ("op", op)],
        )
    };
    assert_eq!(writes(&up, "create"), 1.0);
    assert!(writes(&up, "replace") >= 1.0, "the Running mark");
    assert_eq!(up.sandboxes("running"), Some(1.0));
    assert_eq!(
        up.value(
            "sandbolt_controller_allocated",
            &[("resource", "sandboxes")]
        ),
        Some(1.0)
    );

    c.delete_sandbox(native::DeleteSandboxRequest {
        sandbox: sref("m1"),
    })
    .await
    .unwrap();
    let down = Scrape::of(ops).await;
    assert_eq!(down.grpc_calls(NATIVE, "DeleteSandbox", "OK"), 1.0);
    assert_eq!(down.sandboxes("running"), Some(0.0), "back down");
    // A heartbeat taken before the delete may hold the slot one beat longer.
    eventually_async(
        "the slot is given back",
        Duration::from_secs(10),
        || async {
            let s = Scrape::of(ops).await;
            (s.value(
                "sandbolt_controller_allocated",
                &[("resource", "sandboxes")],
            ) == Some(0.0))
            .then_some(())
        },
    )
    .await;
    assert_eq!(writes(&down, "delete"), 1.0);
    assert_eq!(down.leader(), Some(1.0));

    h.shutdown().await;
    let after = Scrape::of(ops).await;
    assert_eq!(
        after.leader(),
        Some(0.0),
        "a stopped controller leads nothing"
    );
    assert_eq!(after.sandboxes("running"), None, "nothing to show");
    assert_eq!(readyz(ops).await.0, 503);
}

/// `sandbolt controller --metrics-listen`: the flag serves the ops router,
/// and both gRPC ports (the main one and the open FastPath one) count
/// their calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_flag_serves_the_ops_router_and_every_port_counts() {
    #[derive(clap::Parser)]
    struct Cmd {
        #[command(flatten)]
        args: sandbolt_controller::cli::ControllerArgs,
    }
    let dir = tempfile::tempdir().unwrap();
    let addr = |port: u16| SocketAddr::from(([127, 0, 0, 1], port));
    let (main, open, ops) = (addr(free_port()), addr(free_port()), addr(free_port()));
    let data_dir = dir.path().display().to_string();
    let argv = [
        "controller",
        "--agent-token",
        "t",
        "--data-dir",
        &data_dir,
        "--listen",
        &main.to_string(),
        "--open-fastpath-listen",
        &open.to_string(),
        "--metrics-listen",
        &ops.to_string(),
    ];
    let args = <Cmd as clap::Parser>::try_parse_from(argv).unwrap().args;
    assert_eq!(args.metrics_listen, Some(ops));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(sandbolt_controller::cli::run(args, async move {
        let _ = stop_rx.await;
    }));
    sandbolt_test_support::wait_for_port(main, Duration::from_secs(20)).await;
    assert_eq!(readyz(ops).await.0, 200);
    let (status, body) = ops_get(ops, "healthz").await;
    assert_eq!(status, 200, "{body}");

    let channel = Channel::from_shared(format!("http://{main}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = Health::new(channel);
    health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .unwrap();
    let mut fastpath = FastPath::connect(format!("http://{open}")).await.unwrap();
    fastpath
        .list_sandboxes(v2::ListSandboxesRequest::default())
        .await
        .unwrap();
    let s = Scrape::of(ops).await;
    assert_eq!(s.grpc_calls("grpc.health.v1.Health", "Check", "OK"), 1.0);
    assert_eq!(
        s.grpc_calls("fastpath.v2.FastPathService", "ListSandboxes", "OK"),
        1.0
    );
    assert_eq!(s.leader(), Some(1.0));

    stop_tx.send(()).unwrap();
    run.await.unwrap().expect("a clean stop");
    assert!(
        tokio::net::TcpStream::connect(ops).await.is_err(),
        "the ops endpoint stops with the controller"
    );
}

/// One replica over the Kubernetes store, its ops endpoint and its run.
struct Replica {
    /// Its gRPC port (open while it leads).
    listen: SocketAddr,
    ops: SocketAddr,
    _ops_server: OpsServer,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    run: tokio::task::JoinHandle<sandbolt_controller::Result<ElectedExit>>,
    _dir: tempfile::TempDir,
}

async fn replica(api: &ApiDouble, identity: &str) -> Replica {
    let (metrics, ops_server) = ops_endpoint().await;
    let lease = LeaseConfig::new("sandbolt-system", "metrics-lease", identity).with_timings(
        Duration::from_millis(1500),
        Duration::from_millis(1000),
        Duration::from_millis(200),
    );
    let elector = LeaderElector::spawn(api.client(), lease).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg: ControllerConfig = standin_config(dir.path());
    cfg.listen = SocketAddr::from(([127, 0, 0, 1], free_port()));
    cfg.metrics = Some(metrics);
    let listen = cfg.listen;
    let kube_config = api.config();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(run_elected(
        cfg,
        elector,
        move || {
            let store = KubeStore::open(kube_config, KubeStoreConfig::new("sandbolt-system"))?;
            Ok(Arc::new(store) as _)
        },
        None,
        |_| {},
        async move {
            let _ = stopped.await;
        },
    ));
    Replica {
        listen,
        ops: ops_server.local_addr(),
        _ops_server: ops_server,
        stop: Some(stop),
        run,
        _dir: dir,
    }
}

async fn leader_value(ops: SocketAddr) -> f64 {
    Scrape::of(ops).await.leader().expect("a leader gauge")
}

/// Two replicas over one API server: the leader shows leader 1 and is
/// ready, the standby leader 0 and unready (saying who holds the lease),
/// and after the leader stops they swap. The leader's store writes are
/// labelled `kubernetes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_gauge_and_readiness_follow_the_lease() {
    sandbolt_test_support::init_tracing("sandbolt_controller=info");
    let api = ApiDouble::start().await;
    let mut a = replica(&api, "ctrl-a").await;
    let wait = Duration::from_secs(20);
    eventually_async("ctrl-a leads, its store open", wait, || async {
        (leader_value(a.ops).await == 1.0 && readyz(a.ops).await.0 == 200).then_some(())
    })
    .await;
    let b = replica(&api, "ctrl-b").await;
    eventually_async("ctrl-b stands by, unready", wait, || async {
        let (status, body) = readyz(b.ops).await;
        (status == 503 && body.contains("ctrl-a holds the controller lease")).then_some(())
    })
    .await;
    assert_eq!(leader_value(b.ops).await, 0.0);
    assert_eq!(readyz(a.ops).await.0, 200);

    // An agent's first heartbeat is written to the store: a kubernetes write.
    sandbolt_test_support::wait_for_port(a.listen, wait).await;
    let _agent = StandInAgent::start("agent-k", "default", 2, &["busybox"], a.listen, HB).await;
    let s = Scrape::of(a.ops).await;
    assert!(
        s.count(
            "sandbolt_controller_store_write_duration_seconds",
            &[("store", "kubernetes"), ("op", "put_agent")]
        ) >= 1.0,
        "the agent record write is timed as a kubernetes write"
    );

    a.stop.take().unwrap().send(()).unwrap();
    let exit = a.run.await.unwrap().unwrap();
    assert_eq!(exit, ElectedExit::Shutdown);
    eventually_async("ctrl-b takes over and is ready", wait, || async {
        (leader_value(b.ops).await == 1.0 && readyz(b.ops).await.0 == 200).then_some(())
    })
    .await;
    assert_eq!(
        leader_value(a.ops).await,
        0.0,
        "a stopped replica leads nothing"
    );
    b.stop.unwrap().send(()).unwrap();
    b.run.await.unwrap().unwrap();
    api.shutdown().await;
}
