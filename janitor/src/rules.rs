//! The reap rules: a pure function of what containerd says about a
//! container, what the ownership source says about it, the time and the
//! grace period. No I/O here, so every case is unit-tested.
//!
//! # Why a live sandbox is never reaped
//!
//! A container is reaped only if, in an ownership answer obtained *after*
//! the container was listed (and again immediately before the delete):
//!
//! 1. it is older than the grace period (by its created-at label and by
//!    containerd's creation time, whichever is later), and
//! 2. no create for its sandbox id is in flight in the controller, and
//! 3. its record is absent, terminal, or belongs to another uid or sandbox
//!    id — or, for a live record, the agent-pod rule below holds.
//!
//! An agent's silence alone never reaps anything. A live record whose agent
//! stopped heartbeating is kept ([`KeepReason::AgentSilent`]): the agent is
//! usually only away (a rollout, a containerd restart, a slow heartbeat)
//! and its sandboxes are fine. The controller alone decides when they are
//! lost — their agent's pod or node is gone, or a live agent no longer has
//! them — and says so by failing the record (MANUAL) or moving it to a new
//! sandbox id (AUTO_RECREATE); rule 3 then reaps the old container as
//! terminal or as a uid mismatch.
//!
//! The controller registers a create as in flight before it calls the agent
//! and clears it only after the record is committed or the create was
//! given up, and it reads the in-flight set before the store (see
//! `sandbolt_controller`'s `ownership.rs`). A fast-mode container whose
//! record is still being written is therefore always answered "in flight",
//! whatever its age: the fence is the in-flight set, not a timing hope.
//! The grace period is a second, independent guard (for ownership sources
//! without an in-flight set, e.g. Kubernetes later); the default (90 s) is
//! above the controller's fast-mode commit deadline (create deadline 60 s
//! plus commit retries), which the controller reports in every answer.
//!
//! # Warm sandboxes
//!
//! A warm sandbox (started by an agent ahead of demand, not claimed yet)
//! has no record by design; its container carries the warm-pool label and
//! the instance id of the agent process that started it. Without a record
//! it is kept while that very agent process heartbeats
//! ([`KeepReason::WarmOwned`]): a restarted agent removes its predecessor's
//! warm sandboxes itself, so one of another instance (or of a silent or
//! unknown agent) is an orphan ([`ReapReason::WarmOrphan`]) once the
//! controller knows agent liveness (until then it is kept,
//! [`KeepReason::ControllerNotReady`]). Rules 1 and 2 still come first: a
//! claim in flight is fenced by the in-flight set like any create. A warm
//! container that has a record (a claim rewrote its labels, or is doing so)
//! is judged by the record rules.
//!
//! # Scratch snapshots
//!
//! An agent process keeps writable snapshots for itself ([`ScratchKind`]):
//! prepared ahead of cold creates (keys `sandbolt-prepared-<uuid>`) and the
//! snapshot a capture fills before committing it
//! (`sandbolt-snapshotting-<id>`), each labelled with its agent id and
//! agent process instance. One that no container references is not a
//! sandbox's remains: it is kept while the agent process that made it
//! heartbeats ([`SnapshotKeepReason::AgentProcessLive`]), and removed
//! otherwise, once the controller knows agent liveness and after the grace
//! period (a restarted agent removes its predecessor's itself; this covers
//! an agent that never comes back). It is never reported to the controller
//! (no sandbox, no record); one a container references is that sandbox's
//! snapshot and goes with it.
//!
//! # Sandbox snapshots
//!
//! A committed `sandbolt-snapshot-<id>` (a captured sandbox, labelled with
//! its id) goes once, in an answer obtained after it was listed and again
//! immediately before the removal, the controller has no snapshot record
//! with that id ([`SnapshotReapReason::NoRecord`]), it knows agent liveness
//! (`ready`, as for containers), and it is older than the grace period. The
//! controller writes the record before it asks an agent to capture, so a
//! snapshot without one is left by a deleted record whose agent was away,
//! or by a capture whose record is gone. containerd refuses to remove a
//! snapshot sandboxes are built on ([`SnapshotKeepReason::HasChildren`]):
//! it goes in a later scan, after the last sandbox restored from it.
//!
//! # Agent pods (Kubernetes)
//!
//! Where the janitor may read the agent pods of its node, a fourth signal
//! joins rule 3: a container whose agent-pod-uid label names no agent pod on
//! this node was left behind ([`ReapReason::AgentPodGone`]) — but only once
//! the controller has given its sandbox up and is recreating it elsewhere
//! (record phase `Recovering`: its agent is gone, or its container vanished
//! from a live agent). Until the recreate commits and rule 3 takes over,
//! the old container would otherwise linger. It never applies to a sandbox
//! the controller still counts on: an agent whose pod was force-deleted may
//! still run and report the container, and a silent agent is only away.
//! Rules 1 and 2 and the controller's readiness still apply.
//! A new agent pod adopts the containers of the pod it
//! replaced by rewriting that label during its recovery, which it finishes
//! before it serves and so before its pod turns Ready (the readiness probe is
//! the agent's gRPC port). The rule therefore only counts with
//! [`PodEvidence`]: one pod list read *before* the container's labels, in
//! which an agent pod was Ready (its re-labelling was done before the labels
//! were read, so a stale uid there is not one it is about to rewrite), and
//! one read *after* them, in which that pod is still Ready and the
//! container's pod is absent (a UID never comes back, so a pod absent after
//! the label was read is gone for good). Without both lists — the API could
//! not be asked — the rule does not apply.

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

/// A managed container as the janitor found it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ContainerFacts {
    pub sandbox_id: String,
    pub name: String,
    pub namespace: String,
    /// From the record-uid label (empty if the agent was given none).
    pub record_uid: String,
    pub agent_id: String,
    /// From the agent-pod-uid label (empty outside Kubernetes).
    pub agent_pod_uid: String,
    /// Unix ms: the later of the created-at label and containerd's creation
    /// time; `None` when neither can be read.
    pub created_at_ms: Option<i64>,
    /// The warm-pool label: `Some` only on a warm (unclaimed) sandbox.
    pub warm_pool: Option<String>,
    /// The agent-instance label (warm sandboxes only): the agent process
    /// that started it.
    pub agent_instance: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RecordState {
    #[default]
    Absent,
    Live,
    Terminal,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AgentFacts {
    pub agent_id: String,
    pub registered: bool,
    pub heartbeating: bool,
    pub instance_id: String,
    pub node_name: String,
    pub last_heartbeat_age_ms: i64,
}

impl AgentFacts {
    pub fn alive(&self) -> bool {
        self.registered && self.heartbeating
    }
}

/// The agent pods on this node, as one list call returned them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AgentPodList {
    /// Every agent pod on the node that can still run an agent.
    pub uids: BTreeSet<String>,
    /// Those whose Ready condition is True.
    pub ready: BTreeSet<String>,
}

impl AgentPodList {
    /// Ready pods of `self` that are still Ready in `later`.
    fn still_ready_in(&self, later: &AgentPodList) -> bool {
        self.ready.intersection(&later.ready).next().is_some()
    }
}

/// Two agent pod lists bracketing the read of a container's labels (see
/// the module header).
#[derive(Debug, Clone, Copy)]
pub struct PodEvidence<'a> {
    /// Listed before the container's labels were read.
    pub before: &'a AgentPodList,
    /// Listed after the container's labels were read.
    pub after: &'a AgentPodList,
}

impl PodEvidence<'_> {
    /// The container's agent pod is gone from the node, and an agent pod that
    /// had finished its recovery before the label was read still runs.
    pub fn agent_pod_gone(&self, label_uid: &str) -> bool {
        !label_uid.is_empty()
            && !self.after.uids.contains(label_uid)
            && self.before.still_ready_in(self.after)
    }
}

/// What the ownership source says about one sandbox id.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OwnershipAnswer {
    pub sandbox_id: String,
    pub record: RecordState,
    pub record_uid: String,
    pub record_sandbox_id: String,
    pub record_phase: String,
    pub create_in_flight: bool,
    pub agent: AgentFacts,
}

/// The whole answer to one ownership query.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OwnershipReport {
    /// Agent liveness is complete (see [`crate::ownership`]).
    pub ready: bool,
    pub answers: Vec<OwnershipAnswer>,
    pub agents: Vec<AgentFacts>,
    pub fast_commit_deadline_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReapReason {
    /// The controller is recreating the sandbox elsewhere, the agent pod
    /// named by the container's label is no longer on this node, and a Ready
    /// agent pod that did not adopt the container is.
    AgentPodGone,
    /// No record owns the container (after the grace period).
    NoRecord,
    /// The record has another uid (deleted and recreated under the same
    /// name) or another sandbox id (recreated elsewhere).
    UidMismatch,
    /// The record is terminal (failed, expired).
    Terminal,
    /// A warm sandbox (no record) whose agent process is no longer the one
    /// heartbeating (restarted, silent, unknown).
    WarmOrphan,
}

impl ReapReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AgentPodGone => "agent-pod-gone",
            Self::NoRecord => "no-record",
            Self::UidMismatch => "uid-mismatch",
            Self::Terminal => "terminal",
            Self::WarmOrphan => "warm-orphan",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::AgentPodGone,
            Self::NoRecord,
            Self::UidMismatch,
            Self::Terminal,
            Self::WarmOrphan,
        ]
        .into_iter()
        .find(|r| r.as_str() == s)
    }
}

impl fmt::Display for ReapReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KeepReason {
    /// Younger than the grace period.
    Young,
    /// Neither a label nor containerd tells its age: never touched.
    UnknownAge,
    /// A create for it is running in the controller.
    InFlight,
    /// Its record and its agent are live.
    Owned,
    /// A warm sandbox of the agent process that is heartbeating now.
    WarmOwned,
    /// Its record is live and its agent silent (or unknown to the
    /// controller): the sandbox waits for its agent, and only the
    /// controller decides it is lost (by changing the record).
    AgentSilent,
    /// Only its agent pod speaks against it, and the controller does not
    /// know agent liveness yet (restarted, waiting for heartbeats).
    ControllerNotReady,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Keep(KeepReason),
    Reap(ReapReason),
}

fn young(created_at_ms: Option<i64>, now_ms: i64, grace: Duration) -> Option<KeepReason> {
    match created_at_ms {
        None => Some(KeepReason::UnknownAge),
        Some(t) if now_ms.saturating_sub(t) < grace.as_millis() as i64 => Some(KeepReason::Young),
        Some(_) => None,
    }
}

/// The record-based rules shared by containers and leftovers.
fn record_rule(sandbox_id: &str, label_uid: &str, o: &OwnershipAnswer) -> Option<ReapReason> {
    match o.record {
        RecordState::Absent => Some(ReapReason::NoRecord),
        _ if !label_uid.is_empty() && o.record_uid != label_uid => Some(ReapReason::UidMismatch),
        _ if o.record_sandbox_id != sandbox_id => Some(ReapReason::UidMismatch),
        RecordState::Terminal => Some(ReapReason::Terminal),
        RecordState::Live => None,
    }
}

/// Decides about one managed container. `pods`: agent pod evidence for
/// this container's labels, `None` when the janitor does not (or could not)
/// read agent pods.
pub fn evaluate(
    c: &ContainerFacts,
    o: &OwnershipAnswer,
    ready: bool,
    now_ms: i64,
    grace: Duration,
    pods: Option<PodEvidence<'_>>,
) -> Verdict {
    if let Some(k) = young(c.created_at_ms, now_ms, grace) {
        return Verdict::Keep(k);
    }
    if o.create_in_flight {
        return Verdict::Keep(KeepReason::InFlight);
    }
    if c.warm_pool.is_some() && o.record == RecordState::Absent {
        return warm_rule(c, o, ready);
    }
    if let Some(r) = record_rule(&c.sandbox_id, &c.record_uid, o) {
        return Verdict::Reap(r);
    }
    // A live record: the controller decides. It gives a sandbox up by
    // failing its record or moving it to a new sandbox id (rule 3), or, on
    // the way there, by marking it Recovering.
    if o.record_phase == RECOVERING && pods.is_some_and(|p| p.agent_pod_gone(&c.agent_pod_uid)) {
        return if ready {
            Verdict::Reap(ReapReason::AgentPodGone)
        } else {
            Verdict::Keep(KeepReason::ControllerNotReady)
        };
    }
    if o.agent.alive() {
        Verdict::Keep(KeepReason::Owned)
    } else {
        // Silence is no verdict (see the module header).
        Verdict::Keep(KeepReason::AgentSilent)
    }
}

/// A warm sandbox without a record: kept while the agent process that
/// started it heartbeats (see the module header).
fn warm_rule(c: &ContainerFacts, o: &OwnershipAnswer, ready: bool) -> Verdict {
    let same_process = !c.agent_instance.is_empty() && o.agent.instance_id == c.agent_instance;
    if o.agent.alive() && same_process {
        Verdict::Keep(KeepReason::WarmOwned)
    } else if !ready {
        Verdict::Keep(KeepReason::ControllerNotReady)
    } else {
        Verdict::Reap(ReapReason::WarmOrphan)
    }
}

/// A writable snapshot an agent process keeps for itself, never a
/// sandbox's: it lives exactly as long as that process (see the module
/// header, "Scratch snapshots").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScratchKind {
    /// `sandbolt-prepared-<uuid>`, made ahead of cold creates.
    #[default]
    Prepared,
    /// `sandbolt-snapshotting-<snapshot id>`, a capture's snapshot before
    /// its commit.
    Capture,
}

impl ScratchKind {
    /// Why such a snapshot goes once its agent process is gone.
    pub fn orphan_reason(self) -> SnapshotReapReason {
        match self {
            Self::Prepared => SnapshotReapReason::PreparedOrphan,
            Self::Capture => SnapshotReapReason::CaptureAbandoned,
        }
    }
}

/// An unreferenced scratch snapshot, from its labels.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ScratchFacts {
    pub kind: ScratchKind,
    pub key: String,
    pub agent_id: String,
    pub agent_instance: String,
    /// containerd's creation time (unix ms), `None` when unreadable.
    pub created_at_ms: Option<i64>,
}

/// A committed sandbox snapshot (`sandbolt-snapshot-<id>`, labelled with
/// its id) as the janitor found it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SandboxSnapshotFacts {
    /// The containerd snapshot name.
    pub name: String,
    pub snapshot_id: String,
    /// Unix ms: the later of the created-at label and containerd's creation
    /// time; `None` when neither can be read.
    pub created_at_ms: Option<i64>,
}

/// What the ownership source says about sandbox snapshot ids.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SnapshotOwnershipReport {
    /// Agent liveness is complete (see [`crate::ownership`]).
    pub ready: bool,
    /// One per asked id, in order: a snapshot record with that id exists.
    pub recorded: Vec<bool>,
}

/// Why a snapshot that is not a sandbox's writable layer went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SnapshotReapReason {
    /// A committed sandbox snapshot no controller record names.
    NoRecord,
    /// A prepared snapshot whose agent process is gone.
    PreparedOrphan,
    /// A capture's snapshot whose agent process is gone: the capture died
    /// with it.
    CaptureAbandoned,
}

impl SnapshotReapReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoRecord => "no-record",
            Self::PreparedOrphan => "prepared-orphan",
            Self::CaptureAbandoned => "capture-abandoned",
        }
    }
}

impl fmt::Display for SnapshotReapReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a snapshot that is not a sandbox's writable layer stays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SnapshotKeepReason {
    /// Younger than the grace period.
    Young,
    /// Its age is unknown: never touched.
    UnknownAge,
    /// Agent liveness is not known yet (a restarted controller).
    ControllerNotReady,
    /// A scratch snapshot of the agent process heartbeating now.
    AgentProcessLive,
    /// A snapshot record names it (any phase: its owner removes it).
    Recorded,
    /// containerd refused to remove it: snapshots are built on it (a
    /// sandbox restored from it still exists).
    HasChildren,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotVerdict {
    Keep(SnapshotKeepReason),
    Reap(SnapshotReapReason),
}

fn snapshot_young(
    created_at_ms: Option<i64>,
    now_ms: i64,
    grace: Duration,
) -> Option<SnapshotKeepReason> {
    young(created_at_ms, now_ms, grace).map(|k| match k {
        KeepReason::UnknownAge => SnapshotKeepReason::UnknownAge,
        _ => SnapshotKeepReason::Young,
    })
}

/// Decides about an unreferenced scratch snapshot (see the module header);
/// `agents`: the agents as the controller sees them, `ready`: whether it
/// knows their liveness.
pub fn evaluate_scratch(
    p: &ScratchFacts,
    agents: &[AgentFacts],
    ready: bool,
    now_ms: i64,
    grace: Duration,
) -> SnapshotVerdict {
    if let Some(k) = snapshot_young(p.created_at_ms, now_ms, grace) {
        return SnapshotVerdict::Keep(k);
    }
    if !ready {
        return SnapshotVerdict::Keep(SnapshotKeepReason::ControllerNotReady);
    }
    let live = agents.iter().any(|a| {
        a.agent_id == p.agent_id
            && a.alive()
            && !p.agent_instance.is_empty()
            && a.instance_id == p.agent_instance
    });
    if live {
        SnapshotVerdict::Keep(SnapshotKeepReason::AgentProcessLive)
    } else {
        SnapshotVerdict::Reap(p.kind.orphan_reason())
    }
}

/// Decides about a committed sandbox snapshot (see the module header):
/// `recorded` and `ready` come from one ownership answer obtained after the
/// snapshot was listed.
pub fn evaluate_sandbox_snapshot(
    s: &SandboxSnapshotFacts,
    recorded: bool,
    ready: bool,
    now_ms: i64,
    grace: Duration,
) -> SnapshotVerdict {
    if let Some(k) = snapshot_young(s.created_at_ms, now_ms, grace) {
        SnapshotVerdict::Keep(k)
    } else if recorded {
        SnapshotVerdict::Keep(SnapshotKeepReason::Recorded)
    } else if !ready {
        SnapshotVerdict::Keep(SnapshotKeepReason::ControllerNotReady)
    } else {
        SnapshotVerdict::Reap(SnapshotReapReason::NoRecord)
    }
}

/// `record_phase` of a record whose sandbox the controller is recreating
/// because its container is lost.
pub const RECOVERING: &str = "Recovering";

/// Decides about the remains of a sandbox whose container is gone (a
/// snapshot, a log file): they go unless a create is in flight for the id or
/// a live record still names it (the same id comes back only under its
/// record, e.g. a reset restart between its delete and its create).
pub fn evaluate_leftover(
    sandbox_id: &str,
    o: &OwnershipAnswer,
    created_at_ms: Option<i64>,
    now_ms: i64,
    grace: Duration,
) -> Verdict {
    if let Some(k) = young(created_at_ms, now_ms, grace) {
        return Verdict::Keep(k);
    }
    if o.create_in_flight {
        return Verdict::Keep(KeepReason::InFlight);
    }
    match record_rule(sandbox_id, "", o) {
        Some(r) => Verdict::Reap(r),
        None => Verdict::Keep(KeepReason::Owned),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GRACE: Duration = Duration::from_secs(10);
    const NOW: i64 = 1_000_000;

    fn container() -> ContainerFacts {
        ContainerFacts {
            sandbox_id: "sb-1".into(),
            name: "n".into(),
            namespace: "default".into(),
            record_uid: "uid-1".into(),
            agent_id: "a1".into(),
            agent_pod_uid: "pod-old".into(),
            created_at_ms: Some(NOW - 60_000),
            warm_pool: None,
            agent_instance: String::new(),
        }
    }

    fn live_agent() -> AgentFacts {
        AgentFacts {
            agent_id: "a1".into(),
            registered: true,
            heartbeating: true,
            ..Default::default()
        }
    }

    fn owned() -> OwnershipAnswer {
        OwnershipAnswer {
            sandbox_id: "sb-1".into(),
            record: RecordState::Live,
            record_uid: "uid-1".into(),
            record_sandbox_id: "sb-1".into(),
            record_phase: "Running".into(),
            create_in_flight: false,
            agent: live_agent(),
        }
    }

    fn eval(c: &ContainerFacts, o: &OwnershipAnswer) -> Verdict {
        evaluate(c, o, true, NOW, GRACE, None)
    }

    #[test]
    fn a_live_recorded_sandbox_is_kept() {
        assert_eq!(
            eval(&container(), &owned()),
            Verdict::Keep(KeepReason::Owned)
        );
    }

    #[test]
    fn each_rule_reaps_with_its_reason() {
        let c = container();
        let no_record = OwnershipAnswer {
            record: RecordState::Absent,
            record_uid: String::new(),
            record_sandbox_id: String::new(),
            ..owned()
        };
        assert_eq!(eval(&c, &no_record), Verdict::Reap(ReapReason::NoRecord));
        let other_uid = OwnershipAnswer {
            record_uid: "uid-2".into(),
            ..owned()
        };
        assert_eq!(eval(&c, &other_uid), Verdict::Reap(ReapReason::UidMismatch));
        let recreated_elsewhere = OwnershipAnswer {
            record_sandbox_id: "sb-2".into(),
            ..owned()
        };
        assert_eq!(
            eval(&c, &recreated_elsewhere),
            Verdict::Reap(ReapReason::UidMismatch)
        );
        let failed = OwnershipAnswer {
            record: RecordState::Terminal,
            ..owned()
        };
        assert_eq!(eval(&c, &failed), Verdict::Reap(ReapReason::Terminal));
    }

    #[test]
    fn a_silent_agent_never_gets_its_live_sandboxes_reaped() {
        let c = ContainerFacts {
            created_at_ms: Some(NOW - 3_600_000),
            ..container()
        };
        let silent = OwnershipAnswer {
            agent: AgentFacts {
                heartbeating: false,
                last_heartbeat_age_ms: 3_600_000,
                ..live_agent()
            },
            ..owned()
        };
        let unregistered = OwnershipAnswer {
            agent: AgentFacts::default(),
            ..owned()
        };
        // Whatever else the janitor sees: its pod gone with a Ready
        // successor on the node, the controller ready or not.
        let successor = pods(&["pod-new"], &["pod-new"]);
        for o in [&silent, &unregistered] {
            for ready in [true, false] {
                assert_eq!(
                    evaluate(&c, o, ready, NOW, GRACE, None),
                    Verdict::Keep(KeepReason::AgentSilent)
                );
                assert_eq!(
                    eval_pods(&c, o, ready, &successor, &successor),
                    Verdict::Keep(KeepReason::AgentSilent)
                );
            }
        }
        // Once the controller gives the sandbox up, the record says so.
        let failed = OwnershipAnswer {
            record: RecordState::Terminal,
            ..silent.clone()
        };
        assert_eq!(eval(&c, &failed), Verdict::Reap(ReapReason::Terminal));
        let recreated = OwnershipAnswer {
            record_sandbox_id: "sb-2".into(),
            ..silent
        };
        assert_eq!(eval(&c, &recreated), Verdict::Reap(ReapReason::UidMismatch));
    }

    #[test]
    fn nothing_inside_the_grace_period_is_touched() {
        let no_record = OwnershipAnswer {
            record: RecordState::Absent,
            agent: AgentFacts::default(),
            ..owned()
        };
        let young = ContainerFacts {
            created_at_ms: Some(NOW - 9_999),
            ..container()
        };
        assert_eq!(eval(&young, &no_record), Verdict::Keep(KeepReason::Young));
        // A clock that went backwards makes a container look younger, never older.
        let future = ContainerFacts {
            created_at_ms: Some(NOW + 5_000),
            ..container()
        };
        assert_eq!(eval(&future, &no_record), Verdict::Keep(KeepReason::Young));
        let unknown = ContainerFacts {
            created_at_ms: None,
            ..container()
        };
        assert_eq!(
            eval(&unknown, &no_record),
            Verdict::Keep(KeepReason::UnknownAge)
        );
        let exactly = ContainerFacts {
            created_at_ms: Some(NOW - 10_000),
            ..container()
        };
        assert_eq!(
            eval(&exactly, &no_record),
            Verdict::Reap(ReapReason::NoRecord)
        );
    }

    #[test]
    fn an_in_flight_create_is_never_reaped_whatever_its_age() {
        let old = ContainerFacts {
            created_at_ms: Some(NOW - 3_600_000),
            ..container()
        };
        let pending = OwnershipAnswer {
            record: RecordState::Absent,
            create_in_flight: true,
            agent: AgentFacts::default(),
            ..owned()
        };
        assert_eq!(eval(&old, &pending), Verdict::Keep(KeepReason::InFlight));
        assert_eq!(
            evaluate_leftover("sb-1", &pending, Some(0), NOW, GRACE),
            Verdict::Keep(KeepReason::InFlight)
        );
    }

    #[test]
    fn record_rules_apply_before_the_controller_is_ready() {
        // Records are complete after a restart: those rules apply.
        let no_record = OwnershipAnswer {
            record: RecordState::Absent,
            agent: AgentFacts::default(),
            ..owned()
        };
        assert_eq!(
            evaluate(&container(), &no_record, false, NOW, GRACE, None),
            Verdict::Reap(ReapReason::NoRecord)
        );
    }

    #[test]
    fn a_container_without_a_uid_label_is_matched_by_sandbox_id() {
        let c = ContainerFacts {
            record_uid: String::new(),
            ..container()
        };
        assert_eq!(eval(&c, &owned()), Verdict::Keep(KeepReason::Owned));
    }

    #[test]
    fn leftovers_go_unless_a_live_record_still_names_them() {
        let old = Some(NOW - 60_000);
        let absent = OwnershipAnswer {
            record: RecordState::Absent,
            ..Default::default()
        };
        assert_eq!(
            evaluate_leftover("sb-1", &absent, old, NOW, GRACE),
            Verdict::Reap(ReapReason::NoRecord)
        );
        assert_eq!(
            evaluate_leftover("sb-1", &owned(), old, NOW, GRACE),
            Verdict::Keep(KeepReason::Owned)
        );
        let moved = OwnershipAnswer {
            record_sandbox_id: "sb-9".into(),
            ..owned()
        };
        assert_eq!(
            evaluate_leftover("sb-1", &moved, old, NOW, GRACE),
            Verdict::Reap(ReapReason::UidMismatch)
        );
        let failed = OwnershipAnswer {
            record: RecordState::Terminal,
            ..owned()
        };
        assert_eq!(
            evaluate_leftover("sb-1", &failed, old, NOW, GRACE),
            Verdict::Reap(ReapReason::Terminal)
        );
        assert_eq!(
            evaluate_leftover("sb-1", &absent, Some(NOW - 1), NOW, GRACE),
            Verdict::Keep(KeepReason::Young)
        );
    }

    fn pods(all: &[&str], ready: &[&str]) -> AgentPodList {
        AgentPodList {
            uids: all.iter().map(|s| s.to_string()).collect(),
            ready: ready.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn eval_pods(
        c: &ContainerFacts,
        o: &OwnershipAnswer,
        ready: bool,
        before: &AgentPodList,
        after: &AgentPodList,
    ) -> Verdict {
        evaluate(c, o, ready, NOW, GRACE, Some(PodEvidence { before, after }))
    }

    /// The controller gave the sandbox up and is recreating it elsewhere.
    fn recovering() -> OwnershipAnswer {
        OwnershipAnswer {
            record_phase: RECOVERING.into(),
            ..owned()
        }
    }

    #[test]
    fn a_container_whose_agent_pod_is_gone_is_reaped_when_another_agent_pod_is_ready() {
        let new = pods(&["pod-new"], &["pod-new"]);
        assert_eq!(
            eval_pods(&container(), &recovering(), true, &new, &new),
            Verdict::Reap(ReapReason::AgentPodGone)
        );
        // Whether its agent heartbeats or not: the record says it is lost.
        let silent = OwnershipAnswer {
            agent: AgentFacts::default(),
            ..recovering()
        };
        assert_eq!(
            eval_pods(&container(), &silent, true, &new, &new),
            Verdict::Reap(ReapReason::AgentPodGone)
        );
        // The record rules come first.
        let no_record = OwnershipAnswer {
            record: RecordState::Absent,
            ..recovering()
        };
        assert_eq!(
            eval_pods(&container(), &no_record, true, &new, &new),
            Verdict::Reap(ReapReason::NoRecord)
        );
    }

    #[test]
    fn a_sandbox_the_controller_counts_on_is_kept_whatever_the_pods_say() {
        let new = pods(&["pod-new"], &["pod-new"]);
        // A live agent may run on in a force-deleted pod and still report
        // it; a silent one is only away (see also the silence test).
        for phase in ["Running", "Paused", "Pending"] {
            let o = OwnershipAnswer {
                record_phase: phase.into(),
                ..owned()
            };
            assert_eq!(
                eval_pods(&container(), &o, true, &new, &new),
                Verdict::Keep(KeepReason::Owned),
                "{phase}"
            );
        }
    }

    #[test]
    fn a_container_whose_agent_pod_is_on_the_node_is_kept() {
        // Still there, Ready or not (a replaced pod still terminating).
        for after in [
            pods(&["pod-old", "pod-new"], &["pod-new"]),
            pods(&["pod-old", "pod-new"], &["pod-old", "pod-new"]),
            pods(&["pod-old"], &["pod-old"]),
        ] {
            assert_eq!(
                eval_pods(&container(), &recovering(), true, &after, &after),
                Verdict::Keep(KeepReason::Owned),
                "{after:?}"
            );
        }
    }

    #[test]
    fn the_agent_pod_rule_waits_for_a_ready_agent_pod_that_was_ready_before_the_labels_were_read() {
        let c = container();
        // No agent pod at all, or none Ready: a new pod may be re-labelling.
        let none = pods(&[], &[]);
        let starting = pods(&["pod-new"], &[]);
        let ready = pods(&["pod-new"], &["pod-new"]);
        for (before, after) in [
            (&none, &none),
            (&starting, &starting),
            // Ready only after the labels were read: its re-labelling may
            // have finished between the read and the list.
            (&starting, &ready),
            (&none, &ready),
            // Ready before, but gone or not Ready after.
            (&ready, &none),
            (&ready, &starting),
        ] {
            assert_eq!(
                eval_pods(&c, &recovering(), true, before, after),
                Verdict::Keep(KeepReason::Owned),
                "{before:?} / {after:?}"
            );
        }
        // A different Ready pod before and after is no proof either: the
        // one Ready after may have re-labelled in between.
        let other = pods(&["pod-other"], &["pod-other"]);
        assert_eq!(
            eval_pods(&c, &recovering(), true, &other, &ready),
            Verdict::Keep(KeepReason::Owned)
        );
    }

    #[test]
    fn the_agent_pod_rule_is_fenced_like_agent_liveness() {
        let ready = pods(&["pod-new"], &["pod-new"]);
        assert_eq!(
            eval_pods(&container(), &recovering(), false, &ready, &ready),
            Verdict::Keep(KeepReason::ControllerNotReady)
        );
        let young = ContainerFacts {
            created_at_ms: Some(NOW - 1),
            ..container()
        };
        assert_eq!(
            eval_pods(&young, &recovering(), true, &ready, &ready),
            Verdict::Keep(KeepReason::Young)
        );
        let pending = OwnershipAnswer {
            create_in_flight: true,
            ..recovering()
        };
        assert_eq!(
            eval_pods(&container(), &pending, true, &ready, &ready),
            Verdict::Keep(KeepReason::InFlight)
        );
    }

    #[test]
    fn containers_without_a_pod_label_or_without_pod_evidence_are_not_judged_by_pods() {
        let ready = pods(&["pod-new"], &["pod-new"]);
        let unlabelled = ContainerFacts {
            agent_pod_uid: String::new(),
            ..container()
        };
        assert_eq!(
            eval_pods(&unlabelled, &recovering(), true, &ready, &ready),
            Verdict::Keep(KeepReason::Owned)
        );
        // The pod list could not be read: fail safe.
        assert_eq!(
            evaluate(&container(), &recovering(), true, NOW, GRACE, None),
            Verdict::Keep(KeepReason::Owned)
        );
    }

    fn warm() -> ContainerFacts {
        ContainerFacts {
            name: String::new(),
            namespace: String::new(),
            record_uid: String::new(),
            warm_pool: Some("py".into()),
            agent_instance: "inst-1".into(),
            ..container()
        }
    }

    fn no_record(agent: AgentFacts) -> OwnershipAnswer {
        OwnershipAnswer {
            record: RecordState::Absent,
            record_uid: String::new(),
            record_sandbox_id: String::new(),
            record_phase: String::new(),
            agent,
            ..owned()
        }
    }

    #[test]
    fn a_warm_sandbox_lives_as_long_as_the_agent_process_that_started_it() {
        let same = AgentFacts {
            instance_id: "inst-1".into(),
            ..live_agent()
        };
        assert_eq!(
            eval(&warm(), &no_record(same.clone())),
            Verdict::Keep(KeepReason::WarmOwned)
        );
        // Restarted (another instance), silent, unknown: orphans.
        let restarted = AgentFacts {
            instance_id: "inst-2".into(),
            ..live_agent()
        };
        let silent = AgentFacts {
            heartbeating: false,
            ..same.clone()
        };
        for agent in [restarted.clone(), silent, AgentFacts::default()] {
            assert_eq!(
                eval(&warm(), &no_record(agent.clone())),
                Verdict::Reap(ReapReason::WarmOrphan),
                "{agent:?}"
            );
        }
        // A label without an instance proves nothing for it.
        let unlabelled = ContainerFacts {
            agent_instance: String::new(),
            ..warm()
        };
        assert_eq!(
            eval(&unlabelled, &no_record(same.clone())),
            Verdict::Reap(ReapReason::WarmOrphan)
        );
        // Liveness unknown yet: kept.
        assert_eq!(
            evaluate(
                &warm(),
                &no_record(restarted.clone()),
                false,
                NOW,
                GRACE,
                None
            ),
            Verdict::Keep(KeepReason::ControllerNotReady)
        );
    }

    #[test]
    fn a_warm_sandbox_keeps_the_usual_fences() {
        let orphan = no_record(AgentFacts::default());
        let young = ContainerFacts {
            created_at_ms: Some(NOW - 1),
            ..warm()
        };
        assert_eq!(eval(&young, &orphan), Verdict::Keep(KeepReason::Young));
        let claiming = OwnershipAnswer {
            create_in_flight: true,
            ..orphan
        };
        assert_eq!(
            eval(&warm(), &claiming),
            Verdict::Keep(KeepReason::InFlight)
        );
        // Claimed (the record exists, the label not yet rewritten): the
        // record rules judge it.
        let claimed = OwnershipAnswer {
            record_uid: String::new(),
            ..owned()
        };
        assert_eq!(eval(&warm(), &claimed), Verdict::Keep(KeepReason::Owned));
        let terminal = OwnershipAnswer {
            record: RecordState::Terminal,
            ..claimed
        };
        assert_eq!(
            eval(&warm(), &terminal),
            Verdict::Reap(ReapReason::Terminal)
        );
    }

    #[test]
    fn a_scratch_snapshot_lives_as_long_as_the_agent_process_that_made_it() {
        for kind in [ScratchKind::Prepared, ScratchKind::Capture] {
            let p = ScratchFacts {
                kind,
                key: "sandbolt-prepared-1".into(),
                agent_id: "agent-1".into(),
                agent_instance: "i1".into(),
                created_at_ms: Some(0),
            };
            let agent = |instance: &str, heartbeating: bool| AgentFacts {
                agent_id: "agent-1".into(),
                registered: true,
                heartbeating,
                instance_id: instance.into(),
                ..Default::default()
            };
            let eval =
                |agents: &[AgentFacts], ready| evaluate_scratch(&p, agents, ready, NOW, GRACE);
            let orphan = SnapshotVerdict::Reap(kind.orphan_reason());
            assert_eq!(
                eval(&[agent("i1", true)], true),
                SnapshotVerdict::Keep(SnapshotKeepReason::AgentProcessLive)
            );
            assert_eq!(eval(&[agent("i2", true)], true), orphan);
            assert_eq!(eval(&[agent("i1", false)], true), orphan);
            assert_eq!(eval(&[], true), orphan);
            assert_eq!(
                eval(&[], false),
                SnapshotVerdict::Keep(SnapshotKeepReason::ControllerNotReady),
                "liveness unknown"
            );
            let young = ScratchFacts {
                created_at_ms: Some(NOW - 1),
                ..p.clone()
            };
            assert_eq!(
                evaluate_scratch(&young, &[], true, NOW, GRACE),
                SnapshotVerdict::Keep(SnapshotKeepReason::Young)
            );
        }
        assert_eq!(
            ScratchKind::Capture.orphan_reason(),
            SnapshotReapReason::CaptureAbandoned
        );
    }

    #[test]
    fn a_sandbox_snapshot_goes_only_when_no_record_names_it_and_the_controller_is_ready() {
        let s = SandboxSnapshotFacts {
            name: "sandbolt-snapshot-1".into(),
            snapshot_id: "1".into(),
            created_at_ms: Some(NOW - 60_000),
        };
        let eval = |s: &SandboxSnapshotFacts, recorded, ready| {
            evaluate_sandbox_snapshot(s, recorded, ready, NOW, GRACE)
        };
        assert_eq!(
            eval(&s, false, true),
            SnapshotVerdict::Reap(SnapshotReapReason::NoRecord)
        );
        assert_eq!(
            eval(&s, true, true),
            SnapshotVerdict::Keep(SnapshotKeepReason::Recorded)
        );
        assert_eq!(
            eval(&s, true, false),
            SnapshotVerdict::Keep(SnapshotKeepReason::Recorded)
        );
        assert_eq!(
            eval(&s, false, false),
            SnapshotVerdict::Keep(SnapshotKeepReason::ControllerNotReady)
        );
        let young = SandboxSnapshotFacts {
            created_at_ms: Some(NOW - 1),
            ..s.clone()
        };
        assert_eq!(
            eval(&young, false, true),
            SnapshotVerdict::Keep(SnapshotKeepReason::Young)
        );
        let unknown = SandboxSnapshotFacts {
            created_at_ms: None,
            ..s
        };
        assert_eq!(
            eval(&unknown, false, true),
            SnapshotVerdict::Keep(SnapshotKeepReason::UnknownAge)
        );
    }

    #[test]
    fn reasons_round_trip_through_their_names() {
        for r in [
            ReapReason::AgentPodGone,
            ReapReason::NoRecord,
            ReapReason::UidMismatch,
            ReapReason::Terminal,
            ReapReason::WarmOrphan,
        ] {
            assert_eq!(ReapReason::parse(r.as_str()), Some(r));
        }
        assert_eq!(ReapReason::parse("bogus"), None);
    }
}
