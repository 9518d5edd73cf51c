//! The janitor's loop: a periodic scan, plus an immediate one when an agent
//! the janitor cares about falls silent or restarts (a new instance id):
//! either way its process may have died mid-create, leaving containers no
//! record will own. A silent agent's recorded sandboxes are kept (see
//! `rules`); the scan only looks for such orphans.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::config::JanitorConfig;
use crate::error::Result;
use crate::metrics::Metrics;
use crate::scan::Janitor;

pub struct JanitorHandle {
    janitor: Arc<Janitor>,
    stop: watch::Sender<bool>,
    kick: Arc<Notify>,
    task: JoinHandle<()>,
}

impl Janitor {
    /// Connects and starts the loop; the first scan runs at once.
    pub async fn start(cfg: JanitorConfig) -> Result<JanitorHandle> {
        let janitor = Arc::new(Janitor::new(cfg).await?);
        Ok(Self::spawn(janitor))
    }

    /// Runs the loop for an already built janitor (any ownership source).
    pub fn spawn(janitor: Arc<Janitor>) -> JanitorHandle {
        let (stop, rx) = watch::channel(false);
        let kick = Arc::new(Notify::new());
        let task = tokio::spawn(run(janitor.clone(), rx, kick.clone()));
        JanitorHandle {
            janitor,
            stop,
            kick,
            task,
        }
    }
}

impl JanitorHandle {
    pub fn janitor(&self) -> &Arc<Janitor> {
        &self.janitor
    }

    pub fn metrics(&self) -> Arc<Metrics> {
        self.janitor.metrics().clone()
    }

    /// Ready unless the last scan could not reach containerd.
    pub fn readiness(&self) -> sandbolt_telemetry::Readiness {
        self.janitor.readiness()
    }

    /// Asks the loop for a scan now.
    pub fn scan_now(&self) {
        self.kick.notify_one();
    }

    /// Stops the loop (a scan in progress finishes its current removal
    /// first only if it gets there; the journal covers the rest).
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        let _ = self.task.await;
        tracing::info!("janitor stopped");
    }
}

/// Agents whose loss or restart warrants an immediate scan: those on this
/// node, and those whose containers the last scan saw.
fn triggered(
    seen: &HashSet<String>,
    before: &HashMap<String, (String, bool)>,
    now: &HashMap<String, (String, bool)>,
) -> Option<String> {
    for (id, (instance, alive)) in before {
        if !*alive || !seen.contains(id) {
            continue;
        }
        match now.get(id) {
            None => return Some(format!("agent {id} unregistered")),
            Some((_, false)) => return Some(format!("agent {id} lost")),
            Some((i, true)) if !instance.is_empty() && !i.is_empty() && i != instance => {
                return Some(format!("agent {id} restarted (instance {instance} → {i})"));
            }
            _ => {}
        }
    }
    None
}

async fn run(janitor: Arc<Janitor>, mut stop: watch::Receiver<bool>, kick: Arc<Notify>) {
    let cfg: JanitorConfig = janitor.config().clone();
    let poll = cfg
        .agent_poll_interval
        .max(Duration::from_millis(50))
        .min(cfg.interval);
    let mut next_scan = Instant::now();
    let mut next_poll = Instant::now() + poll;
    let mut agents: HashMap<String, (String, bool)> = HashMap::new();
    let agent_pods = janitor
        .agent_pods()
        .map(|p| format!("{} ({})", p.namespace(), p.selector()))
        .unwrap_or_else(|| "not read".into());
    tracing::info!(node = %cfg.node_name, interval = ?cfg.interval, grace = ?cfg.grace_period, controller = %cfg.controller_endpoint, %agent_pods, "janitor running");
    loop {
        let mut scan = false;
        tokio::select! {
            r = stop.wait_for(|s| *s) => { drop(r); break; }
            _ = kick.notified() => scan = true,
            _ = tokio::time::sleep_until(next_scan.min(next_poll)) => {}
        }
        let now = Instant::now();
        if now >= next_poll {
            next_poll = now + poll;
            match janitor.agents().await {
                Ok(current) => {
                    if let Some(why) =
                        triggered(&janitor.seen_agents.lock().clone(), &agents, &current)
                    {
                        tracing::info!(%why, "scanning now");
                        scan = true;
                    }
                    agents = current;
                }
                Err(e) => tracing::debug!(error = %e, "agent poll failed"),
            }
        }
        if scan || now >= next_scan {
            next_scan = Instant::now() + cfg.interval;
            match janitor.scan_once().await {
                Ok(r) if !r.reaped.is_empty() || !r.errors.is_empty() => {
                    tracing::info!(containers = r.containers, reaped = r.reaped.len(), kept = r.kept.len(), errors = ?r.errors, "janitor scan");
                }
                Ok(r) => tracing::debug!(
                    containers = r.containers,
                    kept = r.kept.len(),
                    "janitor scan: nothing to reap"
                ),
                Err(e) => tracing::warn!(error = %e, "janitor scan reaped nothing"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agents(v: &[(&str, &str, bool)]) -> HashMap<String, (String, bool)> {
        v.iter()
            .map(|(id, inst, alive)| (id.to_string(), (inst.to_string(), *alive)))
            .collect()
    }

    #[test]
    fn a_lost_unregistered_or_restarted_agent_triggers_a_scan() {
        let seen: HashSet<String> = ["a".to_string()].into();
        let before = agents(&[("a", "i1", true), ("other", "o1", true)]);
        assert_eq!(triggered(&seen, &before, &before), None);
        assert!(
            triggered(&seen, &before, &agents(&[("a", "i1", false)]))
                .unwrap()
                .contains("lost")
        );
        assert!(
            triggered(&seen, &before, &agents(&[]))
                .unwrap()
                .contains("unregistered")
        );
        assert!(
            triggered(&seen, &before, &agents(&[("a", "i2", true)]))
                .unwrap()
                .contains("restarted")
        );
        // Agents without containers here, and agents already lost, do not.
        assert_eq!(
            triggered(
                &seen,
                &before,
                &agents(&[("a", "i1", true), ("other", "o1", false)])
            ),
            None
        );
        let was_lost = agents(&[("a", "i1", false)]);
        assert_eq!(triggered(&seen, &was_lost, &agents(&[])), None);
    }
}
