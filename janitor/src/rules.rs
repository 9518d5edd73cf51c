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
//!    id — or its agent is not registered or no longer heartbeating, and
//!    only then if the controller is `ready` (a restarted controller does
//!    not know its agents' liveness until they heartbeat).
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
    /// Unix ms: the later of the created-at label and containerd's creation
    /// time; `None` when neither can be read.
    pub created_at_ms: Option<i64>,
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
    /// The container's agent is not registered or not heartbeating.
    AgentGone,
    /// No record owns the container (after the grace period).
    NoRecord,
    /// The record has another uid (deleted and recreated under the same
    /// name) or another sandbox id (recreated elsewhere).
    UidMismatch,
    /// The record is terminal (failed, expired).
    Terminal,
}

impl ReapReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AgentGone => "agent-gone",
            Self::NoRecord => "no-record",
            Self::UidMismatch => "uid-mismatch",
            Self::Terminal => "terminal",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::AgentGone,
            Self::NoRecord,
            Self::UidMismatch,
            Self::Terminal,
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
    /// Only its agent's liveness speaks against it, and the controller
    /// does not know that yet (restarted, waiting for heartbeats).
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

/// Decides about one managed container.
pub fn evaluate(
    c: &ContainerFacts,
    o: &OwnershipAnswer,
    ready: bool,
    now_ms: i64,
    grace: Duration,
) -> Verdict {
    if let Some(k) = young(c.created_at_ms, now_ms, grace) {
        return Verdict::Keep(k);
    }
    if o.create_in_flight {
        return Verdict::Keep(KeepReason::InFlight);
    }
    if let Some(r) = record_rule(&c.sandbox_id, &c.record_uid, o) {
        return Verdict::Reap(r);
    }
    if !o.agent.alive() {
        return if ready {
            Verdict::Reap(ReapReason::AgentGone)
        } else {
            Verdict::Keep(KeepReason::ControllerNotReady)
        };
    }
    Verdict::Keep(KeepReason::Owned)
}

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
            created_at_ms: Some(NOW - 60_000),
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
        evaluate(c, o, true, NOW, GRACE)
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
        let lost = OwnershipAnswer {
            agent: AgentFacts {
                heartbeating: false,
                ..live_agent()
            },
            ..owned()
        };
        assert_eq!(eval(&c, &lost), Verdict::Reap(ReapReason::AgentGone));
        let unregistered = OwnershipAnswer {
            agent: AgentFacts::default(),
            ..owned()
        };
        assert_eq!(
            eval(&c, &unregistered),
            Verdict::Reap(ReapReason::AgentGone)
        );
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
    fn agent_liveness_is_ignored_until_the_controller_is_ready() {
        let lost = OwnershipAnswer {
            agent: AgentFacts::default(),
            ..owned()
        };
        assert_eq!(
            evaluate(&container(), &lost, false, NOW, GRACE),
            Verdict::Keep(KeepReason::ControllerNotReady)
        );
        // Records are complete after a restart: those rules still apply.
        let no_record = OwnershipAnswer {
            record: RecordState::Absent,
            agent: AgentFacts::default(),
            ..owned()
        };
        assert_eq!(
            evaluate(&container(), &no_record, false, NOW, GRACE),
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

    #[test]
    fn reasons_round_trip_through_their_names() {
        for r in [
            ReapReason::AgentGone,
            ReapReason::NoRecord,
            ReapReason::UidMismatch,
            ReapReason::Terminal,
        ] {
            assert_eq!(ReapReason::parse(r.as_str()), Some(r));
        }
        assert_eq!(ReapReason::parse("bogus"), None);
    }
}
