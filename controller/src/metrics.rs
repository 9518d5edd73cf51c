//! The controller's Prometheus metrics (issue 20; names in the shared
//! observability design, which the dashboard and the scrape tests use).
//!
//! Histograms are observed where the work happens: the stages of a create
//! (`sandbox/create.rs`), the store's writes (`store/timed.rs`), and every
//! gRPC call of every port (`sandbolt_telemetry::grpc_layer`). Gauges are
//! never kept in sync with anything: [`LiveGauges`] reads the registry, the
//! store and the warm pool table of the serving controller at scrape time.
//!
//! One [`ControllerMetrics`] lives as long as the process and outlives a
//! controller: with the Kubernetes store a replica serves one term at a
//! time (see `ha.rs`), and a standby serves its metrics too (leader 0).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::RwLock;
use sandbolt_telemetry::prometheus_client::collector::Collector;
use sandbolt_telemetry::prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use sandbolt_telemetry::prometheus_client::metrics::MetricType;
use sandbolt_telemetry::prometheus_client::metrics::family::Family;
use sandbolt_telemetry::prometheus_client::metrics::gauge::ConstGauge;
use sandbolt_telemetry::prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use sandbolt_telemetry::prometheus_client::registry::Registry;
use sandbolt_telemetry::{GrpcLayer, GrpcMetrics, Readiness, grpc_layer};
use tokio::sync::watch;

use crate::leader::LeaderState;
use crate::sandbox::Core;
use crate::store::{ListRange, Phase};

/// The `component` label of the controller's gRPC metrics.
const COMPONENT: &str = "controller";

/// A step of a create, as `sandbolt_controller_create_stage_duration_seconds`
/// labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CreateStage {
    /// Choosing the agent (and taking a warm sandbox's slot, or creating the
    /// create's missing named volumes on it).
    Place,
    /// The agent's create of a container, answered (a cold create).
    AgentCreate,
    /// One record write of a create: strong mode's Pending commit and its
    /// Running mark, or one of fast mode's commit attempts.
    Record,
    /// The agent's claim of a warm sandbox, answered. Kept apart from
    /// `agent_create`: claims take milliseconds, cold creates seconds, and one
    /// histogram of both would describe neither.
    WarmClaim,
}

impl CreateStage {
    fn label(self) -> &'static str {
        match self {
            Self::Place => "place",
            Self::AgentCreate => "agent_create",
            Self::Record => "record",
            Self::WarmClaim => "warm_claim",
        }
    }
}

/// A store write, as `sandbolt_controller_store_write_duration_seconds`
/// labels it (`op` is the [`crate::Store`] method).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StoreWrite {
    /// [`crate::Store::backend`].
    pub(crate) store: &'static str,
    pub(crate) op: &'static str,
}

type StageLabels = [(&'static str, &'static str); 1];
type StoreLabels = [(&'static str, &'static str); 2];
type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// 0.5 ms to about a minute, doubling: a placement takes microseconds, a
/// redb commit a millisecond, an API server write tens of them, a cold
/// create with an image pull up to the create deadline.
fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

/// The controller's metrics: register them once per process
/// ([`register_metrics`]), hand a clone to every controller the process
/// starts ([`crate::ControllerConfig::metrics`]).
#[derive(Clone)]
pub struct ControllerMetrics {
    grpc: GrpcMetrics,
    create_stages: Histograms<StageLabels>,
    store_writes: Histograms<StoreLabels>,
    live: Arc<LiveState>,
}

impl fmt::Debug for ControllerMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ControllerMetrics")
            .field("live", &self.live)
            .finish_non_exhaustive()
    }
}

/// Registers the controller's metrics (gRPC counts and latencies, create
/// stages, store writes, and the live gauges) into `registry`; give the
/// result to the controller through [`crate::ControllerConfig::metrics`].
/// What `sandbolt controller --metrics-listen` and `sandbolt up` call.
pub fn register_metrics(registry: &mut Registry) -> ControllerMetrics {
    ControllerMetrics::register(registry)
}

impl ControllerMetrics {
    /// See [`register_metrics`].
    pub fn register(registry: &mut Registry) -> Self {
        let grpc = GrpcMetrics::register(registry, COMPONENT);
        let create_stages: Histograms<StageLabels> =
            Family::new_with_constructor(duration_histogram as fn() -> Histogram);
        registry.register(
            "sandbolt_controller_create_stage_duration_seconds",
            "Time spent in each stage of a sandbox create (place, agent_create, record, warm_claim)",
            create_stages.clone(),
        );
        let store_writes: Histograms<StoreLabels> =
            Family::new_with_constructor(duration_histogram as fn() -> Histogram);
        registry.register(
            "sandbolt_controller_store_write_duration_seconds",
            "Time a write to the record store took, by store backend and operation",
            store_writes.clone(),
        );
        let live = Arc::new(LiveState::default());
        registry.register_collector(Box::new(LiveGauges(live.clone())));
        Self {
            grpc,
            create_stages,
            store_writes,
            live,
        }
    }

    /// Metrics nobody scrapes: a controller started without any still
    /// times its work the same way (and its gRPC layer still carries the
    /// request ids into its logs).
    pub(crate) fn unregistered() -> Self {
        Self::register(&mut Registry::default())
    }

    /// The tower layer of each of the controller's gRPC servers.
    /// The gRPC families this controller counts into, for another component
    /// of the same process to count under its own label
    /// ([`GrpcMetrics::for_component`]).
    pub fn grpc(&self) -> &GrpcMetrics {
        &self.grpc
    }

    pub(crate) fn grpc_layer(&self) -> GrpcLayer {
        grpc_layer(self.grpc.clone())
    }

    pub(crate) fn observe_stage(&self, stage: CreateStage, took: Duration) {
        self.create_stages
            .get_or_create(&[("stage", stage.label())])
            .observe(took.as_secs_f64());
    }

    pub(crate) fn observe_store_write(&self, write: StoreWrite, took: Duration) {
        self.store_writes
            .get_or_create(&[("store", write.store), ("op", write.op)])
            .observe(took.as_secs_f64());
    }

    /// `core` serves from now on: the gauges read it.
    pub(crate) fn attach(&self, core: &Arc<Core>) {
        *self.live.core.write() = Arc::downgrade(core);
    }

    /// `core` stopped serving (a later controller may have attached since).
    pub(crate) fn detach(&self, core: &Arc<Core>) {
        let mut g = self.live.core.write();
        if std::ptr::eq(g.as_ptr(), Arc::as_ptr(core)) {
            *g = Weak::new();
        }
    }

    /// The process campaigns for the controller lease: `sandbolt_controller_leader`
    /// and readiness follow `state` instead of "serving or not".
    pub(crate) fn follow_leadership(&self, state: watch::Receiver<LeaderState>) {
        *self.live.leadership.write() = Some(state);
    }

    /// Why this process does not serve, if it does not: not leading (a
    /// standby, or the lease election stopped), or the store not open yet
    /// (with the Kubernetes store: its first full list, which fills the
    /// caches every read comes from, has not finished).
    pub fn unready_reason(&self) -> Option<String> {
        if let Some(state) = self.live.leadership.read().as_ref() {
            if state.has_changed().is_err() {
                return Some("the controller lease election stopped".into());
            }
            if let LeaderState::Follower { holder } = &*state.borrow() {
                return Some(match holder {
                    Some(h) => format!("standby: {h} holds the controller lease"),
                    None => "standby: campaigning for the controller lease".into(),
                });
            }
        }
        if self.live.core.read().strong_count() == 0 {
            return Some("the record store is not open yet".into());
        }
        None
    }

    /// `/readyz` of the ops router: ready while this process serves (see
    /// [`Self::unready_reason`]).
    pub fn readiness(&self) -> Readiness {
        let m = self.clone();
        Readiness::from_fn(move || {
            let reason = m.unready_reason();
            async move { reason.map_or(Ok(()), Err) }
        })
    }
}

/// What the gauges read: the serving controller, if any, and the lease
/// election when there is one.
#[derive(Default)]
struct LiveState {
    core: RwLock<Weak<Core>>,
    leadership: RwLock<Option<watch::Receiver<LeaderState>>>,
}

impl fmt::Debug for LiveState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LiveState")
            .field("serving", &(self.core.read().strong_count() > 0))
            .field("elected", &self.leadership.read().is_some())
            .finish()
    }
}

impl LiveState {
    /// 1 while this process leads: with an election, while it holds the
    /// lease; without one (the embedded store), while a controller serves.
    fn leader(&self) -> i64 {
        match self.leadership.read().as_ref() {
            Some(state) => i64::from(state.borrow().is_leader()),
            None => i64::from(self.core.read().strong_count() > 0),
        }
    }
}

/// The gauges, read from the serving controller at each scrape.
#[derive(Debug)]
struct LiveGauges(Arc<LiveState>);

/// One gauge family: `(label value, value)` per series.
struct GaugeFamily<'a> {
    name: &'a str,
    help: &'a str,
    series: Vec<(Vec<(&'static str, String)>, i64)>,
}

impl GaugeFamily<'_> {
    fn encode(&self, encoder: &mut DescriptorEncoder<'_>) -> fmt::Result {
        let mut metric =
            encoder.encode_descriptor(self.name, self.help, None, MetricType::Gauge)?;
        for (labels, value) in &self.series {
            ConstGauge::new(*value).encode(metric.encode_family(labels)?)?;
        }
        Ok(())
    }
}

impl Collector for LiveGauges {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> fmt::Result {
        GaugeFamily {
            name: "sandbolt_controller_leader",
            help: "1 while this replica leads (serves), else 0",
            series: vec![(Vec::new(), self.0.leader())],
        }
        .encode(&mut encoder)?;
        // A standby (or a process between terms) has no state to show.
        let Some(core) = self.0.core.read().upgrade() else {
            return Ok(());
        };
        for family in core_gauges(&core) {
            family.encode(&mut encoder)?;
        }
        Ok(())
    }
}

/// Every phase a record can be in, so that a phase that empties shows 0
/// instead of vanishing.
const PHASES: [(Phase, &str); 5] = [
    (Phase::Pending, "pending"),
    (Phase::Running, "running"),
    (Phase::Paused, "paused"),
    (Phase::Recovering, "recovering"),
    (Phase::Failed, "failed"),
];

fn one_label(
    name: &'static str,
    counts: impl IntoIterator<Item = (String, i64)>,
) -> Vec<(Vec<(&'static str, String)>, i64)> {
    counts
        .into_iter()
        .map(|(value, n)| (vec![(name, value)], n))
        .collect()
}

/// The registry's, the store's and the warm pools' gauges of `core`.
fn core_gauges(core: &Core) -> Vec<GaugeFamily<'static>> {
    let registry = core.registry().gauges();
    let resource = |n: i64| one_label("resource", [("sandboxes".to_string(), n)]);
    let mut families = vec![
        GaugeFamily {
            name: "sandbolt_controller_agents",
            help: "Known agents by state (ready, unheard since this controller started, lost = silent, gone)",
            series: one_label(
                "state",
                registry.agents.into_iter().map(|(s, n)| (s.to_string(), n)),
            ),
        },
        GaugeFamily {
            name: "sandbolt_controller_capacity",
            help: "What the known agents can hold, by resource",
            series: resource(registry.capacity),
        },
        GaugeFamily {
            name: "sandbolt_controller_allocated",
            help: "What the known agents' sandboxes hold, by resource",
            series: resource(registry.allocated),
        },
    ];
    // A store that cannot list now leaves the family out of this scrape
    // rather than report zeros it does not know.
    match core.store().list(&ListRange::all()) {
        Ok(records) => {
            let mut by_phase: BTreeMap<&str, i64> = PHASES.iter().map(|(_, l)| (*l, 0)).collect();
            for r in &records {
                if let Some((_, label)) = PHASES.iter().find(|(p, _)| *p == r.phase) {
                    *by_phase.entry(label).or_default() += 1;
                }
            }
            families.push(GaugeFamily {
                name: "sandbolt_controller_sandboxes",
                help: "Sandbox records by phase",
                series: one_label(
                    "phase",
                    by_phase.into_iter().map(|(p, n)| (p.to_string(), n)),
                ),
            });
        }
        Err(e) => tracing::debug!(error = %e, "sandboxes gauge left out: the store did not list"),
    }
    families.push(warm_pool_gauge(core));
    families
}

fn warm_pool_gauge(core: &Core) -> GaugeFamily<'static> {
    let mut series = Vec::new();
    for p in core.warm_pools().all() {
        let c = core.registry().warm_counts(&p.name, &p.agent_pool);
        for (state, n) in [
            ("allocated", c.allocated),
            ("available", c.available),
            ("starting", c.starting),
        ] {
            series.push((
                vec![("pool", p.name.clone()), ("state", state.to_string())],
                n,
            ));
        }
    }
    GaugeFamily {
        name: "sandbolt_controller_warm_pool_sandboxes",
        help: "Warm sandboxes by warm pool and state (allocated = claimed members, available, starting)",
        series,
    }
}
