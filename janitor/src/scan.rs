//! One scan: list, ask, decide, fence, remove, report.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use containerd_client::services::v1::Container;
use containerd_client::services::v1::snapshots::{Info as SnapshotInfo, Kind};
use parking_lot::Mutex;
use sandbolt_node::labels;
use sandbolt_telemetry::Readiness;

use crate::agent_pods::AgentPods;
use crate::config::JanitorConfig;
use crate::error::{JanitorError, Result};
use crate::journal::{self, Journal};
use crate::metrics::Metrics;
use crate::node::{self, Node, SnapshotRemoval};
use crate::ownership::{ControllerOwnership, OwnershipSource, ReapNotice};
use crate::readiness::ContainerdReach;
use crate::rules::{
    self, AgentPodList, ContainerFacts, KeepReason, OwnershipReport, PodEvidence, ReapReason,
    SandboxSnapshotFacts, ScratchFacts, ScratchKind, SnapshotKeepReason, SnapshotReapReason,
    SnapshotVerdict, Verdict,
};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reaped {
    pub sandbox_id: String,
    pub agent_id: String,
    pub reason: ReapReason,
    /// Only remains were left (snapshot, log file): the container was
    /// already gone when this scan started.
    pub leftover: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    pub sandbox_id: String,
    pub reason: KeepReason,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanReport {
    /// Managed containers found.
    pub containers: usize,
    pub reaped: Vec<Reaped>,
    pub kept: Vec<Kept>,
    /// Cleanups that failed part-way (the next scan retries them) and
    /// fences that could not be checked.
    pub errors: Vec<String>,
    pub controller_ready: bool,
    /// Why the agent pods could not be listed (then no container was
    /// reaped because its agent pod is gone); `None` when they were, or
    /// when the janitor does not read them.
    pub agent_pods_error: Option<String>,
    /// Unreferenced prepared snapshots (keys) kept: their agent process
    /// heartbeats (see `rules`, "Scratch snapshots"). Not sandboxes: never
    /// in `kept` or `reaped`, never reported to the controller.
    pub prepared_kept: Vec<String>,
    /// Unreferenced prepared snapshots removed: their agent process is gone.
    pub prepared_reaped: Vec<String>,
    /// Sandbox snapshots and capture snapshots kept (see `rules`, "Sandbox
    /// snapshots" and "Scratch snapshots"). Not sandboxes either.
    pub snapshots_kept: Vec<KeptSnapshot>,
    /// Sandbox snapshots and capture snapshots removed.
    pub snapshots_reaped: Vec<ReapedSnapshot>,
}

/// A snapshot that is no sandbox's writable layer, kept this scan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptSnapshot {
    /// The containerd snapshot name (key).
    pub name: String,
    pub reason: SnapshotKeepReason,
}

/// A snapshot that is no sandbox's writable layer, removed this scan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReapedSnapshot {
    /// The containerd snapshot name (key).
    pub name: String,
    pub reason: SnapshotReapReason,
}

impl ScanReport {
    pub fn reaped_ids(&self) -> Vec<&str> {
        self.reaped.iter().map(|r| r.sandbox_id.as_str()).collect()
    }

    pub fn kept_reason(&self, sandbox_id: &str) -> Option<KeepReason> {
        self.kept
            .iter()
            .find(|k| k.sandbox_id == sandbox_id)
            .map(|k| k.reason)
    }

    /// Reports a kept scratch snapshot: prepared ones apart, as they always
    /// were.
    fn scratch_kept(&mut self, p: ScratchFacts, reason: SnapshotKeepReason) {
        match p.kind {
            ScratchKind::Prepared => self.prepared_kept.push(p.key),
            ScratchKind::Capture => self.snapshot_kept(p.key, reason),
        }
    }

    fn snapshot_kept(&mut self, name: String, reason: SnapshotKeepReason) {
        self.snapshots_kept.push(KeptSnapshot { name, reason });
    }

    /// Why the snapshot `name` (sandbox or capture snapshot) was kept.
    pub fn snapshot_kept_reason(&self, name: &str) -> Option<SnapshotKeepReason> {
        self.snapshots_kept
            .iter()
            .find(|k| k.name == name)
            .map(|k| k.reason)
    }

    /// Why the snapshot `name` (sandbox or capture snapshot) was removed.
    pub fn snapshot_reap_reason(&self, name: &str) -> Option<SnapshotReapReason> {
        self.snapshots_reaped
            .iter()
            .find(|r| r.name == name)
            .map(|r| r.reason)
    }
}

/// Remains of a sandbox whose container is gone.
#[derive(Debug, Default)]
struct Leftover {
    facts: ContainerFacts,
    snapshot: Option<(String, String)>,
    /// Youngest evidence (snapshot creation, log write); `Some(0)` when the
    /// journal proves a fenced decision was already taken.
    created_at_ms: Option<i64>,
    journal: Option<journal::Entry>,
}

/// One scan's view of the node (see [`Janitor::list_node`] for the order).
struct Listing {
    pending: Vec<journal::Entry>,
    /// Log files: sandbox id → last modification (unix ms).
    logs: HashMap<String, i64>,
    /// Active (writable) snapshots.
    snapshots: Vec<SnapshotInfo>,
    /// Committed snapshots named like sandbox snapshots.
    sandbox_snapshots: Vec<SnapshotInfo>,
    containers: Vec<Container>,
    pods_before: Option<AgentPodList>,
    pods_after: Option<AgentPodList>,
}

impl Listing {
    fn pod_evidence(&self) -> Option<PodEvidence<'_>> {
        self.pods_before
            .as_ref()
            .zip(self.pods_after.as_ref())
            .map(|(before, after)| PodEvidence { before, after })
    }

    /// The containers carrying the managed label, with their facts.
    fn managed(&self) -> Vec<(&Container, ContainerFacts)> {
        self.containers
            .iter()
            .filter(|c| is_managed(c))
            .filter_map(|c| facts_of(c).map(|f| (c, f)))
            .collect()
    }

    /// Remains of sandboxes whose container is gone, by sandbox id: journal
    /// entries of interrupted cleanups, log files, and writable snapshots
    /// that are provably sandbolt's.
    fn leftovers(&self, snapshotter: &str) -> BTreeMap<String, Leftover> {
        let container_ids: HashSet<&str> = self.containers.iter().map(|c| c.id.as_str()).collect();
        let mut leftovers: BTreeMap<String, Leftover> = BTreeMap::new();
        for e in &self.pending {
            if container_ids.contains(e.sandbox_id.as_str()) {
                continue;
            }
            leftovers.insert(e.sandbox_id.clone(), Leftover::journaled(e.clone()));
        }
        for (id, mtime) in &self.logs {
            if container_ids.contains(id.as_str()) {
                continue;
            }
            leftovers.entry(id.clone()).or_default().seen(id, *mtime);
        }
        let referenced: HashSet<(&str, &str)> = self
            .containers
            .iter()
            .map(|c| (c.snapshotter.as_str(), c.snapshot_key.as_str()))
            .collect();
        for s in &self.snapshots {
            let key = s.name.as_str();
            if !journal::safe_id(key)
                || container_ids.contains(key)
                || referenced.contains(&(snapshotter, key))
            {
                continue;
            }
            // Provably sandbolt's: the key is a sandbox id the journal or the
            // agent's log dir names, or the snapshot says so in its labels.
            let labelled = s.labels.get(labels::SANDBOX_ID).is_some_and(|v| v == key);
            if !labelled && !leftovers.contains_key(key) {
                continue;
            }
            let l = leftovers.entry(key.to_string()).or_default();
            l.snapshot = Some((snapshotter.to_string(), key.to_string()));
            // Unknown creation time counts as "now": young, kept.
            l.seen(key, node::ts_ms(&s.created_at).unwrap_or(i64::MAX));
        }
        leftovers
    }
}

impl Listing {
    /// Scratch snapshots (an agent process's prepared snapshots and capture
    /// snapshots, see `rules`) that no container references.
    fn scratch(&self, snapshotter: &str) -> Vec<ScratchFacts> {
        let referenced: HashSet<(&str, &str)> = self
            .containers
            .iter()
            .map(|c| (c.snapshotter.as_str(), c.snapshot_key.as_str()))
            .collect();
        self.snapshots
            .iter()
            .filter(|s| !referenced.contains(&(snapshotter, s.name.as_str())))
            .filter_map(|s| {
                let (kind, agent_id) = scratch_kind(s)?;
                Some(ScratchFacts {
                    kind,
                    key: s.name.clone(),
                    agent_id: agent_id.clone(),
                    agent_instance: s
                        .labels
                        .get(labels::AGENT_INSTANCE)
                        .cloned()
                        .unwrap_or_default(),
                    created_at_ms: node::ts_ms(&s.created_at),
                })
            })
            .collect()
    }

    /// Committed sandbox snapshots that are provably sandbolt's: named
    /// `sandbolt-snapshot-<id>` and labelled with that id.
    fn sandbox_snapshots(&self) -> Vec<SandboxSnapshotFacts> {
        self.sandbox_snapshots
            .iter()
            .filter_map(|s| {
                let id = s.name.strip_prefix(labels::SNAPSHOT_NAME_PREFIX)?;
                let labelled = s.labels.get(labels::SNAPSHOT).is_some_and(|v| v == id);
                (journal::safe_id(id) && labelled).then(|| SandboxSnapshotFacts {
                    name: s.name.clone(),
                    snapshot_id: id.to_string(),
                    created_at_ms: later_created_at(
                        s.labels.get(labels::CREATED_AT),
                        &s.created_at,
                    ),
                })
            })
            .collect()
    }
}

/// Which scratch snapshot an active snapshot is, and the agent that made
/// it, from its key and labels; `None` for any other snapshot.
fn scratch_kind(s: &SnapshotInfo) -> Option<(ScratchKind, &String)> {
    if s.name.starts_with(labels::PREPARED_KEY_PREFIX) {
        return s
            .labels
            .get(labels::PREPARED)
            .map(|a| (ScratchKind::Prepared, a));
    }
    let id = s.name.strip_prefix(labels::SNAPSHOTTING_KEY_PREFIX)?;
    if s.labels.get(labels::SNAPSHOT).is_some_and(|v| v == id) {
        return s
            .labels
            .get(labels::AGENT_ID)
            .map(|a| (ScratchKind::Capture, a));
    }
    None
}

/// The later of a created-at label (unix ms) and containerd's creation
/// time: a thing never looks older than it is.
fn later_created_at(label: Option<&String>, ctrd: &Option<prost_types::Timestamp>) -> Option<i64> {
    let label_ms = label.and_then(|v| v.parse::<i64>().ok()).filter(|t| *t > 0);
    match (label_ms, node::ts_ms(ctrd)) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    }
}

impl Leftover {
    /// Remains a journal entry names: a fenced decision was already taken.
    fn journaled(e: journal::Entry) -> Self {
        Self {
            facts: ContainerFacts {
                sandbox_id: e.sandbox_id.clone(),
                name: e.name.clone(),
                namespace: e.namespace.clone(),
                agent_id: e.agent_id.clone(),
                ..Default::default()
            },
            snapshot: Some((e.snapshotter.clone(), e.snapshot_key.clone())),
            created_at_ms: Some(0),
            journal: Some(e),
        }
    }

    /// Evidence of sandbox `id` last touched at `at_ms`: the youngest
    /// evidence counts (unless a journal entry settles the age).
    fn seen(&mut self, id: &str, at_ms: i64) {
        self.facts.sandbox_id = id.to_string();
        if self.journal.is_none() {
            self.created_at_ms = Some(self.created_at_ms.unwrap_or(0).max(at_ms));
        }
    }
}

/// A container read again for the agent-pod rule.
enum Reread {
    /// Still there and managed.
    Fresh(Box<Fresh>),
    /// Gone, or no longer one to judge: nothing to reap.
    Gone,
    /// Could not be read: stop reaping this scan (fail safe).
    Unknown,
}

/// A container as read again, and the agent pods listed after it.
struct Fresh {
    container: Container,
    facts: ContainerFacts,
    pods: Option<AgentPodList>,
}

fn is_managed(c: &Container) -> bool {
    c.labels.get(labels::MANAGED).is_some_and(|v| v == "true")
}

pub struct Janitor {
    cfg: JanitorConfig,
    node: Node,
    owner: Arc<dyn OwnershipSource>,
    /// The agent pods of this node (Kubernetes only).
    agent_pods: Option<AgentPods>,
    journal: Journal,
    metrics: Arc<Metrics>,
    /// Whether the last scan reached containerd (readiness).
    containerd_reach: ContainerdReach,
    /// Scans never overlap (periodic, triggered and `scan_once` callers).
    scan_lock: tokio::sync::Mutex<()>,
    /// Agents whose containers the last scan saw (trigger filter).
    pub(crate) seen_agents: Mutex<HashSet<String>>,
    warned_grace: AtomicBool,
}

fn facts_of(c: &Container) -> Option<ContainerFacts> {
    let l = &c.labels;
    let get = |k: &str| l.get(k).cloned().unwrap_or_default();
    let label_sid = get(labels::SANDBOX_ID);
    if !label_sid.is_empty() && label_sid != c.id {
        // The agent always names the container after the sandbox; anything
        // else was not made by it and is not provably ours.
        tracing::warn!(container = %c.id, sandbox_label = %label_sid, "managed container whose id is not its sandbox id; left alone");
        return None;
    }
    let created_at_ms = later_created_at(l.get(labels::CREATED_AT), &c.created_at);
    Some(ContainerFacts {
        sandbox_id: c.id.clone(),
        name: get(labels::NAME),
        namespace: get(labels::NAMESPACE),
        record_uid: get(labels::RECORD_UID),
        agent_id: get(labels::AGENT_ID),
        agent_pod_uid: get(labels::AGENT_POD_UID),
        created_at_ms,
        warm_pool: l.get(labels::WARM_POOL).cloned(),
        agent_instance: get(labels::AGENT_INSTANCE),
    })
}

impl Janitor {
    /// Connects to containerd; the controller is asked lazily, per scan.
    pub async fn new(cfg: JanitorConfig) -> Result<Self> {
        let owner = ControllerOwnership::with_ca(
            &cfg.controller_endpoint,
            &cfg.token,
            cfg.rpc_timeout,
            cfg.controller_ca.as_deref(),
        )?
        .with_agent_state_dir(cfg.agent_state_dir.clone());
        Self::with_source(cfg, Arc::new(owner)).await
    }

    pub async fn with_source(cfg: JanitorConfig, owner: Arc<dyn OwnershipSource>) -> Result<Self> {
        if cfg.token.is_empty() {
            return Err(JanitorError::Config(
                "the agent token is required: the controller authenticates janitors with it".into(),
            ));
        }
        if cfg.interval.is_zero() {
            return Err(JanitorError::Config(
                "the scan interval must be positive".into(),
            ));
        }
        let journal = Journal::open(&cfg.state_dir)?;
        let node = Node::connect(&cfg).await?;
        Ok(Self {
            cfg,
            node,
            owner,
            agent_pods: None,
            journal,
            metrics: Arc::new(Metrics::new()),
            containerd_reach: ContainerdReach::default(),
            scan_lock: tokio::sync::Mutex::new(()),
            seen_agents: Mutex::new(HashSet::new()),
            warned_grace: AtomicBool::new(false),
        })
    }

    /// Adds the agent-pod rule: containers whose agent pod left this node
    /// are reaped like those of a dead agent (see [`crate::rules`]).
    pub fn with_agent_pods(mut self, pods: AgentPods) -> Self {
        self.agent_pods = Some(pods);
        self
    }

    pub fn agent_pods(&self) -> Option<&AgentPods> {
        self.agent_pods.as_ref()
    }

    pub fn config(&self) -> &JanitorConfig {
        &self.cfg
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Ready unless the last scan could not reach containerd.
    pub fn readiness(&self) -> Readiness {
        self.containerd_reach.readiness()
    }

    /// One full scan. `Err` only when nothing could be decided (containerd
    /// or the ownership source unavailable): then nothing was reaped.
    #[tracing::instrument(skip_all, fields(node = %self.cfg.node_name))]
    pub async fn scan_once(&self) -> Result<ScanReport> {
        let _g = self.scan_lock.lock().await;
        self.metrics.scan();
        let mut report = ScanReport::default();
        let listing = self.list_node(&mut report).await;
        self.containerd_reach.record(&listing);
        let listing = listing?;
        if self
            .decide_sandboxes_and_scratch(&listing, &mut report)
            .await?
        {
            self.decide_sandbox_snapshots(listing.sandbox_snapshots(), &mut report)
                .await;
        }
        Ok(report)
    }

    /// The container, leftover and scratch snapshot rules, on one ownership
    /// answer. Returns false when the scan must stop reaping (a fence could
    /// not be checked).
    async fn decide_sandboxes_and_scratch(
        &self,
        listing: &Listing,
        report: &mut ScanReport,
    ) -> Result<bool> {
        let managed = listing.managed();
        report.containers = managed.len();
        *self.seen_agents.lock() = managed.iter().map(|(_, f)| f.agent_id.clone()).collect();
        let leftovers = listing.leftovers(self.node.snapshotter());
        let scratch = listing.scratch(self.node.snapshotter());

        let mut queries: Vec<ContainerFacts> = managed.iter().map(|(_, f)| f.clone()).collect();
        queries.extend(leftovers.values().map(|l| l.facts.clone()));
        if queries.is_empty() && scratch.is_empty() {
            report.controller_ready = true;
            return Ok(true);
        }
        let answer = match self.owner.ownership(&self.cfg.node_name, &queries).await {
            Ok(a) => a,
            Err(e) => {
                self.metrics.fail_safe();
                tracing::warn!(error = %e, containers = managed.len(), leftovers = leftovers.len(), "ownership unknown: reaping NOTHING this scan (fail safe)");
                return Err(e);
            }
        };
        report.controller_ready = answer.ready;
        self.check_grace(&answer);
        let (container_answers, leftover_answers) = answer.answers.split_at(managed.len());
        let go_on = self
            .decide_containers(&managed, container_answers, answer.ready, listing, report)
            .await;
        if go_on {
            self.decide_leftovers(leftovers, leftover_answers, report)
                .await?;
            self.decide_scratch(scratch, &answer, report).await;
        }
        Ok(go_on)
    }

    /// What is on the node, in the order that makes remains safe to judge.
    /// The agent creates the container before its snapshot and its log file,
    /// so remains listed first whose container is missing afterwards cannot
    /// belong to a create that started in between. The agent pods are listed
    /// on both sides of the container listing: the rule needs a Ready pod
    /// from before the labels were read and the pods still there after (see
    /// `rules`).
    async fn list_node(&self, report: &mut ScanReport) -> Result<Listing> {
        let pending = self.journal.pending()?;
        let logs = self.node.log_files()?;
        let (snapshots, committed): (Vec<_>, Vec<_>) = self
            .node
            .snapshots()
            .await?
            .into_iter()
            .filter(|s| s.kind == Kind::Active as i32 || s.kind == Kind::Committed as i32)
            .partition(|s| s.kind == Kind::Active as i32);
        let sandbox_snapshots = committed
            .into_iter()
            .filter(|s| s.name.starts_with(labels::SNAPSHOT_NAME_PREFIX))
            .collect();
        let pods_before = self.list_agent_pods(report).await;
        let containers = self.node.containers().await?;
        let pods_after = match pods_before {
            Some(_) => self.list_agent_pods(report).await,
            None => None,
        };
        Ok(Listing {
            pending,
            logs,
            snapshots,
            sandbox_snapshots,
            containers,
            pods_before,
            pods_after,
        })
    }

    /// Applies the rules to every managed container and reaps the orphans.
    /// Returns false when the scan must stop reaping (fence unavailable).
    async fn decide_containers(
        &self,
        managed: &[(&Container, ContainerFacts)],
        answers: &[rules::OwnershipAnswer],
        ready: bool,
        listing: &Listing,
        report: &mut ScanReport,
    ) -> bool {
        let now = node::now_ms();
        let evidence = listing.pod_evidence();
        for ((c, facts), o) in managed.iter().zip(answers) {
            match rules::evaluate(facts, o, ready, now, self.cfg.grace_period, evidence) {
                Verdict::Keep(k) => report.kept.push(Kept {
                    sandbox_id: facts.sandbox_id.clone(),
                    reason: k,
                }),
                Verdict::Reap(reason) => {
                    let pods = listing.pods_after.as_ref();
                    if !self.reap_container(c, facts, reason, pods, report).await {
                        return false;
                    }
                }
            }
        }
        true
    }

    /// Applies the rules to the remains of sandboxes whose container is
    /// gone, and removes the orphaned ones.
    async fn decide_leftovers(
        &self,
        leftovers: BTreeMap<String, Leftover>,
        answers: &[rules::OwnershipAnswer],
        report: &mut ScanReport,
    ) -> Result<()> {
        let now = node::now_ms();
        let grace = self.cfg.grace_period;
        for (l, o) in leftovers.into_values().zip(answers) {
            match rules::evaluate_leftover(&l.facts.sandbox_id, o, l.created_at_ms, now, grace) {
                Verdict::Keep(k) => {
                    if k == KeepReason::Owned
                        && let Some(e) = &l.journal
                    {
                        // The id lives again under its record (a reset
                        // restart): the remains are the new sandbox's.
                        tracing::info!(sandbox = %e.sandbox_id, "journal entry of a sandbox that is owned again; dropped");
                        self.journal.finish(&e.sandbox_id)?;
                    }
                    report.kept.push(Kept {
                        sandbox_id: l.facts.sandbox_id.clone(),
                        reason: k,
                    });
                }
                Verdict::Reap(reason) => {
                    if !self.reap_leftover(l, reason, report).await {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }

    /// Keeps the unreferenced scratch snapshots of live agent processes
    /// and removes the others (see `rules`). Before removing, agent
    /// liveness is asked again (the fence): an agent that came back in
    /// between keeps them.
    async fn decide_scratch(
        &self,
        scratch: Vec<ScratchFacts>,
        answer: &OwnershipReport,
        report: &mut ScanReport,
    ) {
        let now = node::now_ms();
        let grace = self.cfg.grace_period;
        let verdict = |p: &ScratchFacts, agents: &[rules::AgentFacts], ready| {
            rules::evaluate_scratch(p, agents, ready, now, grace)
        };
        let mut doomed = Vec::new();
        for p in scratch {
            match verdict(&p, &answer.agents, answer.ready) {
                SnapshotVerdict::Keep(k) => report.scratch_kept(p, k),
                SnapshotVerdict::Reap(_) => doomed.push(p),
            }
        }
        if doomed.is_empty() {
            return;
        }
        let fresh = match self.owner.ownership(&self.cfg.node_name, &[]).await {
            Ok(a) => a,
            Err(e) => {
                report.errors.push(format!("scratch snapshots: fence: {e}"));
                return;
            }
        };
        for p in doomed {
            let reason = match verdict(&p, &fresh.agents, fresh.ready) {
                SnapshotVerdict::Keep(k) => {
                    report.scratch_kept(p, k);
                    continue;
                }
                SnapshotVerdict::Reap(r) => r,
            };
            let removed = self
                .node
                .remove_remains(&p.key, self.node.snapshotter(), &p.key)
                .await;
            match removed {
                Ok(()) => {
                    tracing::info!(key = %p.key, agent = %p.agent_id, instance = %p.agent_instance, %reason, "removed a scratch snapshot of an agent process that is gone");
                    self.snapshot_reaped(p.key, reason, report);
                }
                Err(e) => report.errors.push(format!("{}: {e}", p.key)),
            }
        }
    }

    /// Counts a removed snapshot that was no sandbox's writable layer, and
    /// reports it (prepared ones apart, as they always were).
    fn snapshot_reaped(&self, name: String, reason: SnapshotReapReason, report: &mut ScanReport) {
        self.metrics.snapshot_reaped(reason);
        if reason == SnapshotReapReason::PreparedOrphan {
            report.prepared_reaped.push(name);
        } else {
            report
                .snapshots_reaped
                .push(ReapedSnapshot { name, reason });
        }
    }

    /// Removes the committed sandbox snapshots no snapshot record names
    /// (see `rules`, "Sandbox snapshots"), asking again about each
    /// immediately before removing it. Reaps nothing when the ownership
    /// source cannot answer.
    #[tracing::instrument(skip_all, fields(node = %self.cfg.node_name, snapshots = found.len()))]
    async fn decide_sandbox_snapshots(
        &self,
        found: Vec<SandboxSnapshotFacts>,
        report: &mut ScanReport,
    ) {
        if found.is_empty() {
            return;
        }
        let ids: Vec<String> = found.iter().map(|s| s.snapshot_id.clone()).collect();
        let answer = match self
            .owner
            .snapshot_ownership(&self.cfg.node_name, &ids)
            .await
        {
            Ok(a) => a,
            Err(e) => {
                self.metrics.fail_safe();
                tracing::warn!(error = %e, "sandbox snapshot ownership unknown: removing NO sandbox snapshot this scan (fail safe)");
                report.errors.push(format!("sandbox snapshots: {e}"));
                return;
            }
        };
        report.controller_ready = answer.ready;
        let now = node::now_ms();
        for (s, recorded) in found.into_iter().zip(answer.recorded) {
            match rules::evaluate_sandbox_snapshot(
                &s,
                recorded,
                answer.ready,
                now,
                self.cfg.grace_period,
            ) {
                SnapshotVerdict::Keep(reason) => report.snapshots_kept.push(KeptSnapshot {
                    name: s.name,
                    reason,
                }),
                SnapshotVerdict::Reap(_) => {
                    if !self.reap_sandbox_snapshot(s, report).await {
                        return;
                    }
                }
            }
        }
    }

    /// Fences and removes one sandbox snapshot. Returns false when the scan
    /// must stop (the fence could not be checked).
    #[tracing::instrument(skip_all, fields(snapshot_id = %s.snapshot_id))]
    async fn reap_sandbox_snapshot(
        &self,
        s: SandboxSnapshotFacts,
        report: &mut ScanReport,
    ) -> bool {
        let fresh = match self
            .owner
            .snapshot_ownership(&self.cfg.node_name, std::slice::from_ref(&s.snapshot_id))
            .await
        {
            Ok(a) if a.recorded.len() == 1 => a,
            Ok(_) => return false,
            Err(e) => {
                self.metrics.fail_safe();
                tracing::warn!(error = %e, "fence check failed: removing NO sandbox snapshot more this scan (fail safe)");
                report.errors.push(format!("{}: fence: {e}", s.name));
                return false;
            }
        };
        let verdict = rules::evaluate_sandbox_snapshot(
            &s,
            fresh.recorded[0],
            fresh.ready,
            node::now_ms(),
            self.cfg.grace_period,
        );
        let reason = match verdict {
            SnapshotVerdict::Keep(k) => {
                tracing::info!(now = ?k, "fence: the sandbox snapshot is owned again; kept");
                report.snapshot_kept(s.name, k);
                return true;
            }
            SnapshotVerdict::Reap(r) => r,
        };
        match self.node.remove_snapshot(&s.name).await {
            Ok(SnapshotRemoval::Removed) => {
                tracing::info!(name = %s.name, %reason, "removed a sandbox snapshot no record names");
                self.snapshot_reaped(s.name, reason, report);
            }
            Ok(SnapshotRemoval::Gone) => tracing::debug!("already gone"),
            Ok(SnapshotRemoval::HasChildren) => {
                // A sandbox restored from it still exists: it goes in a
                // later scan, after that sandbox.
                tracing::debug!(name = %s.name, "sandbox snapshot without a record still has children; kept");
                report.snapshot_kept(s.name, SnapshotKeepReason::HasChildren);
            }
            Err(e) => {
                self.metrics.cleanup_error();
                report.errors.push(format!("{}: {e}", s.name));
            }
        }
        true
    }

    /// `None` when the janitor does not read agent pods or could not (then
    /// the agent-pod rule does not apply: fail safe).
    async fn list_agent_pods(&self, report: &mut ScanReport) -> Option<AgentPodList> {
        let pods = self.agent_pods.as_ref()?;
        match pods.list(&self.cfg.node_name).await {
            Ok(l) => Some(l),
            Err(e) => {
                self.metrics.agent_pods_unavailable();
                tracing::warn!(
                    error = %e,
                    namespace = pods.namespace(),
                    selector = pods.selector(),
                    node = %self.cfg.node_name,
                    "cannot list this node's agent pods: no sandbox is reaped because its agent pod is gone this scan (fail safe)"
                );
                report.agent_pods_error.get_or_insert(e.to_string());
                None
            }
        }
    }

    fn check_grace(&self, a: &OwnershipReport) {
        let grace = self.cfg.grace_period.as_millis() as i64;
        if a.fast_commit_deadline_ms > 0
            && grace <= a.fast_commit_deadline_ms
            && !self.warned_grace.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                grace_ms = grace,
                fast_commit_deadline_ms = a.fast_commit_deadline_ms,
                "grace period is not above the controller's fast-mode commit deadline: only the in-flight fence protects slow fast-mode creates"
            );
        }
    }

    /// Re-asks about one sandbox immediately before touching it. `None`
    /// means the fence could not be checked: stop reaping.
    async fn fence(
        &self,
        facts: &ContainerFacts,
        report: &mut ScanReport,
    ) -> Option<(rules::OwnershipAnswer, bool)> {
        match self
            .owner
            .ownership(&self.cfg.node_name, std::slice::from_ref(facts))
            .await
        {
            Ok(mut a) if a.answers.len() == 1 => Some((a.answers.remove(0), a.ready)),
            Ok(_) => None,
            Err(e) => {
                self.metrics.fail_safe();
                tracing::warn!(error = %e, "fence check failed: reaping NOTHING more this scan (fail safe)");
                report
                    .errors
                    .push(format!("{}: fence: {e}", facts.sandbox_id));
                None
            }
        }
    }

    /// Returns false when the scan must stop reaping (fence unavailable).
    /// `pods_before`: the scan's agent pod list taken after the containers
    /// were listed, and so before the fence re-reads the labels.
    #[tracing::instrument(skip_all, fields(sandbox_id = %facts.sandbox_id, agent_id = %facts.agent_id, name = %facts.name, namespace = %facts.namespace))]
    async fn reap_container(
        &self,
        c: &Container,
        facts: &ContainerFacts,
        first: ReapReason,
        pods_before: Option<&AgentPodList>,
        report: &mut ScanReport,
    ) -> bool {
        let (c, facts, pods_after) = if self.agent_pods.is_some() {
            match self.reread_for_pod_rule(&facts.sandbox_id, report).await {
                Reread::Fresh(f) => (f.container, f.facts, f.pods),
                Reread::Gone => return true,
                Reread::Unknown => return false,
            }
        } else {
            (c.clone(), facts.clone(), None)
        };
        let (c, facts) = (&c, &facts);
        let evidence = pods_before
            .zip(pods_after.as_ref())
            .map(|(before, after)| PodEvidence { before, after });
        let Some((o, ready)) = self.fence(facts, report).await else {
            return false;
        };
        let now = node::now_ms();
        let reason = match rules::evaluate(facts, &o, ready, now, self.cfg.grace_period, evidence) {
            Verdict::Reap(r) => r,
            Verdict::Keep(k) => {
                tracing::info!(first = %first, now = ?k, "fence: no longer an orphan; kept");
                report.kept.push(Kept {
                    sandbox_id: facts.sandbox_id.clone(),
                    reason: k,
                });
                return true;
            }
        };
        let entry = self.journal_entry(c, facts, reason);
        if !journal::safe_id(&entry.sandbox_id) {
            report.errors.push(format!(
                "{}: not a sandbox id sandbolt makes; left alone",
                entry.sandbox_id
            ));
            return true;
        }
        tracing::warn!(%reason, record = ?o.record, record_phase = %o.record_phase, "reaping orphaned sandbox");
        if let Err(e) = self.journal.begin(&entry) {
            report.errors.push(format!("{}: {e}", entry.sandbox_id));
            return true;
        }
        let removed = async {
            self.node.remove_container(&entry.sandbox_id).await?;
            self.node
                .remove_remains(&entry.sandbox_id, &entry.snapshotter, &entry.snapshot_key)
                .await
        }
        .await;
        self.finish(entry, reason, false, removed, report).await;
        true
    }

    /// The agent-pod rule judges a label a new agent pod may have rewritten
    /// since the listing: reads the container again, then the pods.
    async fn reread_for_pod_rule(&self, sandbox_id: &str, report: &mut ScanReport) -> Reread {
        match self.node.container(sandbox_id).await {
            Ok(Some(fresh)) => match facts_of(&fresh) {
                Some(facts) if is_managed(&fresh) => {
                    let pods = self.list_agent_pods(report).await;
                    Reread::Fresh(Box::new(Fresh {
                        container: fresh,
                        facts,
                        pods,
                    }))
                }
                _ => Reread::Gone,
            },
            Ok(None) => {
                tracing::info!("gone before the fence; nothing to reap");
                Reread::Gone
            }
            Err(e) => {
                tracing::warn!(error = %e, "fence: cannot re-read the container: reaping NOTHING more this scan (fail safe)");
                report.errors.push(format!("{sandbox_id}: fence: {e}"));
                Reread::Unknown
            }
        }
    }

    /// The journal entry a container's removal starts with: what to finish
    /// if the janitor dies part-way.
    fn journal_entry(
        &self,
        c: &Container,
        facts: &ContainerFacts,
        reason: ReapReason,
    ) -> journal::Entry {
        let (snapshotter, snapshot_key) = if c.snapshot_key.is_empty() {
            (
                self.node.snapshotter().to_string(),
                facts.sandbox_id.clone(),
            )
        } else {
            (c.snapshotter.clone(), c.snapshot_key.clone())
        };
        journal::Entry {
            sandbox_id: facts.sandbox_id.clone(),
            agent_id: facts.agent_id.clone(),
            name: facts.name.clone(),
            namespace: facts.namespace.clone(),
            reason: reason.as_str().into(),
            snapshotter,
            snapshot_key,
            started_at_unix_ms: node::now_ms(),
        }
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %l.facts.sandbox_id))]
    async fn reap_leftover(&self, l: Leftover, first: ReapReason, report: &mut ScanReport) -> bool {
        let Some((o, _)) = self.fence(&l.facts, report).await else {
            return false;
        };
        let id = l.facts.sandbox_id.clone();
        let verdict = rules::evaluate_leftover(
            &id,
            &o,
            l.created_at_ms,
            node::now_ms(),
            self.cfg.grace_period,
        );
        let Verdict::Reap(now_reason) = verdict else {
            let Verdict::Keep(k) = verdict else {
                unreachable!()
            };
            report.kept.push(Kept {
                sandbox_id: id,
                reason: k,
            });
            return true;
        };
        // An interrupted cleanup reports the reason it was started for.
        let reason = l
            .journal
            .as_ref()
            .and_then(|e| ReapReason::parse(&e.reason))
            .unwrap_or(now_reason);
        let entry = match l.journal {
            Some(e) => e,
            None => {
                let e = journal::Entry {
                    sandbox_id: id.clone(),
                    agent_id: o.agent.agent_id.clone(),
                    name: String::new(),
                    namespace: String::new(),
                    reason: reason.as_str().into(),
                    snapshotter: self.node.snapshotter().to_string(),
                    snapshot_key: l
                        .snapshot
                        .as_ref()
                        .map(|s| s.1.clone())
                        .unwrap_or_else(|| id.clone()),
                    started_at_unix_ms: node::now_ms(),
                };
                if let Err(err) = self.journal.begin(&e) {
                    report.errors.push(format!("{id}: {err}"));
                    return true;
                }
                e
            }
        };
        tracing::warn!(%reason, first = %first, "removing the remains of a partially removed sandbox");
        // The container is gone (a container that still exists is decided
        // by the container rules, even with a journal entry).
        let removed = self
            .node
            .remove_remains(&id, &entry.snapshotter, &entry.snapshot_key)
            .await;
        self.finish(entry, reason, true, removed, report).await;
        true
    }

    async fn finish(
        &self,
        entry: journal::Entry,
        reason: ReapReason,
        leftover: bool,
        removed: Result<()>,
        report: &mut ScanReport,
    ) {
        let id = entry.sandbox_id.clone();
        if let Err(e) = removed {
            self.metrics.cleanup_error();
            tracing::warn!(error = %e, "cleanup incomplete; the next scan finishes it");
            report.errors.push(format!("{id}: {e}"));
            return;
        }
        if let Err(e) = self
            .owner
            .report_reaped(&ReapNotice {
                node_name: &self.cfg.node_name,
                sandbox_id: &id,
                agent_id: &entry.agent_id,
                reason,
            })
            .await
        {
            // Removed but unreported: the journal entry stays, the next scan
            // re-sends the report (the controller handles it idempotently).
            tracing::warn!(error = %e, "could not report the reap; the next scan retries");
            report.errors.push(format!("{id}: report: {e}"));
            return;
        }
        if let Err(e) = self.journal.finish(&id) {
            report.errors.push(format!("{id}: {e}"));
        }
        self.metrics.reaped(reason);
        tracing::info!(agent = %entry.agent_id, %reason, leftover, "reaped");
        report.reaped.push(Reaped {
            sandbox_id: id,
            agent_id: entry.agent_id,
            reason,
            leftover,
        });
    }

    /// Agents (id → instance, alive) as the controller sees them now.
    pub(crate) async fn agents(&self) -> Result<HashMap<String, (String, bool)>> {
        let a = self.owner.ownership(&self.cfg.node_name, &[]).await?;
        Ok(a.agents
            .into_iter()
            .map(|a| (a.agent_id.clone(), (a.instance_id.clone(), a.alive())))
            .collect())
    }
}
