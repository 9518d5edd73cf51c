//! Prometheus counters. They count from the janitor's start;
//! [`Metrics::register`] puts them into the registry of whoever serves
//! `/metrics` (`sandbolt janitor --metrics-listen`, `sandbolt up`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::rules::{ReapReason, SnapshotReapReason};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

/// The janitor's counters (cheap clones share the same counts).
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    reaped: Family<ReasonLabel, Counter>,
    /// Snapshots that are no sandbox's writable layer (sandbox snapshots,
    /// scratch snapshots), removed by reason.
    snapshots_reaped: Family<ReasonLabel, Counter>,
    scans: Counter,
    /// Scans that reaped nothing because ownership could not be established.
    fail_safe: Counter,
    cleanup_errors: Counter,
    /// Agent pod lists that failed (the agent-pod rule was skipped).
    agent_pods_unavailable: Counter,
}

impl Metrics {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers every counter into `registry` (they keep counting whether
    /// or not any registry holds them).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "sandbolt_janitor_reaped",
            "Sandboxes removed by the janitor, by reason",
            self.reaped.clone(),
        );
        registry.register(
            "sandbolt_janitor_snapshots_reaped",
            "Snapshots that were no sandbox's writable layer removed by the janitor (sandbox snapshots no record names, scratch snapshots of gone agent processes), by reason",
            self.snapshots_reaped.clone(),
        );
        registry.register(
            "sandbolt_janitor_scans",
            "Janitor scans run",
            self.scans.clone(),
        );
        registry.register(
            "sandbolt_janitor_fail_safe_scans",
            "Scans that reaped nothing because the controller could not be asked",
            self.fail_safe.clone(),
        );
        registry.register(
            "sandbolt_janitor_cleanup_errors",
            "Cleanups that failed and are retried by the next scan",
            self.cleanup_errors.clone(),
        );
        registry.register(
            "sandbolt_janitor_agent_pods_unavailable",
            "Agent pod lists that failed: no sandbox was reaped because its agent pod is gone",
            self.agent_pods_unavailable.clone(),
        );
    }

    pub(crate) fn reaped(&self, reason: ReapReason) {
        self.reaped
            .get_or_create(&ReasonLabel {
                reason: reason.as_str().into(),
            })
            .inc();
    }

    pub(crate) fn snapshot_reaped(&self, reason: SnapshotReapReason) {
        self.snapshots_reaped
            .get_or_create(&ReasonLabel {
                reason: reason.as_str().into(),
            })
            .inc();
    }

    pub(crate) fn scan(&self) {
        self.scans.inc();
    }

    pub(crate) fn fail_safe(&self) {
        self.fail_safe.inc();
    }

    pub(crate) fn cleanup_error(&self) {
        self.cleanup_errors.inc();
    }

    pub(crate) fn agent_pods_unavailable(&self) {
        self.agent_pods_unavailable.inc();
    }

    pub fn agent_pods_unavailable_count(&self) -> u64 {
        self.agent_pods_unavailable.get()
    }

    pub fn reaped_count(&self, reason: ReapReason) -> u64 {
        self.reaped
            .get_or_create(&ReasonLabel {
                reason: reason.as_str().into(),
            })
            .get()
    }

    pub fn snapshots_reaped_count(&self, reason: SnapshotReapReason) -> u64 {
        self.snapshots_reaped
            .get_or_create(&ReasonLabel {
                reason: reason.as_str().into(),
            })
            .get()
    }

    /// The OpenMetrics text exposition of these counters alone.
    pub fn encode(&self) -> String {
        let mut registry = Registry::default();
        self.register(&mut registry);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry)
            .expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reaps_are_counted_by_reason() {
        let m = Metrics::new();
        m.reaped(ReapReason::NoRecord);
        m.reaped(ReapReason::NoRecord);
        m.reaped(ReapReason::AgentPodGone);
        let text = m.encode();
        assert!(
            text.contains("sandbolt_janitor_reaped_total{reason=\"no-record\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("sandbolt_janitor_reaped_total{reason=\"agent-pod-gone\"} 1"),
            "{text}"
        );
        assert_eq!(m.reaped_count(ReapReason::NoRecord), 2);
        m.snapshot_reaped(SnapshotReapReason::CaptureAbandoned);
        let text = m.encode();
        assert!(
            text.contains(
                "sandbolt_janitor_snapshots_reaped_total{reason=\"capture-abandoned\"} 1"
            ),
            "{text}"
        );
        assert_eq!(m.reaped_count(ReapReason::NoRecord), 2, "sandboxes apart");
    }
}
