//! The agent's Prometheus metrics: how long each stage of a user create
//! took, how creates ended, and (read from the sandbox table at scrape time,
//! so they can never drift from it) how many sandboxes and warm sandboxes
//! this agent holds. The families live with the sandbox table and count
//! whether or not anyone serves them; [`AgentMetrics::register`] puts them
//! into the registry of whoever serves `/metrics`.

use std::collections::BTreeMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::sandbox::Sandboxes;

/// One timed step of a create.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum CreateStage {
    /// The image resolved (pulled when missing).
    Image,
    /// The container made and its writable snapshot ready.
    Container,
    /// tasks.Create through tasks.Start (host bindings mounted between).
    Task,
    /// execd answering `/ping` inside the started sandbox.
    ExecdReady,
    /// A warm sandbox taken over for the request, as a whole.
    WarmClaim,
}

impl CreateStage {
    pub const ALL: [CreateStage; 5] = [
        Self::Image,
        Self::Container,
        Self::Task,
        Self::ExecdReady,
        Self::WarmClaim,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Image => "image",
            Self::Container => "container",
            Self::Task => "task",
            Self::ExecdReady => "execd_ready",
            Self::WarmClaim => "warm_claim",
        }
    }
}

impl EncodeLabelValue for CreateStage {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

/// Whether a create started a container or claimed a warm sandbox.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub enum CreateSource {
    Cold,
    Warm,
}

impl EncodeLabelValue for CreateSource {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        let source = match self {
            Self::Cold => "cold",
            Self::Warm => "warm",
        };
        EncodeLabelValue::encode(&source, encoder)
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabel {
    stage: CreateStage,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CreateLabels {
    outcome: &'static str,
    source: CreateSource,
}

/// 1 ms to about 33 s: a prepared snapshot is a few milliseconds, an image
/// pull can take most of a minute (the top bucket is +Inf).
fn stage_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

type StageFamily = Family<StageLabel, Histogram, fn() -> Histogram>;

/// The agent's create metrics (cheap clones share the same counts).
#[derive(Debug, Clone)]
pub struct AgentMetrics {
    create_stages: StageFamily,
    creates: Family<CreateLabels, Counter>,
}

impl Default for AgentMetrics {
    /// Every series exists from the start (at zero): a dashboard's rate of
    /// errors or warm claims reads 0, not "no data", before the first one.
    fn default() -> Self {
        let m = Self {
            create_stages: Family::new_with_constructor(stage_histogram),
            creates: Family::default(),
        };
        for stage in CreateStage::ALL {
            drop(m.create_stages.get_or_create(&StageLabel { stage }));
        }
        for source in [CreateSource::Cold, CreateSource::Warm] {
            for outcome in ["ok", "error"] {
                drop(m.creates.get_or_create(&CreateLabels { outcome, source }));
            }
        }
        m
    }
}

impl AgentMetrics {
    /// Registers the create metrics and the live sandbox gauges of
    /// `sandboxes` into `registry`. The gauges hold the table weakly: a
    /// registry that outlives the agent reports none.
    pub fn register(&self, registry: &mut Registry, sandboxes: &Arc<Sandboxes>) {
        registry.register(
            "sandbolt_agent_create_stage_duration_seconds",
            "Time of each stage of a user create on this agent (image, container, task, execd_ready; warm_claim for a claimed warm sandbox)",
            self.create_stages.clone(),
        );
        registry.register(
            "sandbolt_agent_creates",
            "User creates on this agent by outcome (ok|error) and source (cold: a container was started; warm: a warm sandbox was claimed)",
            self.creates.clone(),
        );
        registry.register_collector(Box::new(SandboxGauges {
            sandboxes: Arc::downgrade(sandboxes),
        }));
    }

    pub(crate) fn observe_stage(&self, stage: CreateStage, took: Duration) {
        self.create_stages
            .get_or_create(&StageLabel { stage })
            .observe(took.as_secs_f64());
    }

    pub(crate) fn count_create(&self, source: CreateSource, ok: bool) {
        let outcome = if ok { "ok" } else { "error" };
        self.creates
            .get_or_create(&CreateLabels { outcome, source })
            .inc();
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabel {
    pool: String,
}

/// `sandbolt_agent_sandboxes` and `sandbolt_agent_warm_sandboxes{pool}`,
/// counted from the table on each scrape.
#[derive(Debug)]
struct SandboxGauges {
    sandboxes: Weak<Sandboxes>,
}

impl Collector for SandboxGauges {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(sandboxes) = self.sandboxes.upgrade() else {
            return Ok(());
        };
        let users = ConstGauge::new(sandboxes.occupancy().users as i64);
        users.encode(encoder.encode_descriptor(
            "sandbolt_agent_sandboxes",
            "Sandboxes of the API on this agent (creating, running, paused or exited; warm ones not included)",
            None,
            users.metric_type(),
        )?)?;
        let mut per_pool: BTreeMap<String, i64> = BTreeMap::new();
        for w in sandboxes.warm_sandboxes() {
            *per_pool.entry(w.class.warm_pool).or_default() += 1;
        }
        // A family without samples is valid OpenMetrics, yet some parsers
        // refuse it: without warm sandboxes the family is left out.
        if per_pool.is_empty() {
            return Ok(());
        }
        let mut family = encoder.encode_descriptor(
            "sandbolt_agent_warm_sandboxes",
            "Warm sandboxes on this agent (starting or claimable), by warm pool",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (pool, count) in per_pool {
            ConstGauge::new(count).encode(family.encode_family(&PoolLabel { pool })?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_and_outcomes_encode_with_the_dashboards_label_values() {
        let m = AgentMetrics::default();
        m.observe_stage(CreateStage::ExecdReady, Duration::from_millis(3));
        m.count_create(CreateSource::Warm, false);
        let mut registry = Registry::default();
        registry.register("s", "", m.create_stages.clone());
        registry.register("c", "", m.creates.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains(r#"s_count{stage="execd_ready"} 1"#), "{text}");
        assert!(
            text.contains(r#"c_total{outcome="error",source="warm"} 1"#),
            "{text}"
        );
    }
}
