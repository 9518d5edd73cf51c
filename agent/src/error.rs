//! The agent's error type and its mapping onto gRPC status codes (callers read
//! codes, never message text). The one translation to a reply is
//! `From<AgentError> for Status`; errors of the node crate are wrapped
//! whole ([`AgentError::Node`]) and the teardown's become node errors, each
//! keeping the code it had when the agent had its own copies of them.

use sandbolt_node::NodeError;
use sandbolt_node::teardown::TeardownError;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A request the agent refuses as malformed (its own checks; the node
    /// crate's come as [`AgentError::Node`]).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("sandbox {0} not found")]
    SandboxNotFound(String),
    #[error("OCI runtime {runtime} cannot run here: {reason}")]
    RuntimeUnavailable { runtime: String, reason: String },
    /// A create named the id of a sandbox another request owns (another
    /// namespace/name or record uid): answering it would hand one sandbox
    /// to two requests.
    #[error("sandbox {id} already exists for {owner}; a create of {requested} cannot take it over")]
    AlreadyExists {
        id: String,
        owner: String,
        requested: String,
    },
    #[error("agent is at capacity ({max} sandboxes)")]
    Capacity { max: u32 },
    #[error("sandbox {id} is {phase}, cannot {action}")]
    WrongPhase {
        id: String,
        phase: &'static str,
        action: &'static str,
    },
    #[error("container {0} exists but is not managed by sandbolt; refusing to touch it")]
    NotManaged(String),
    #[error("volume: {0}")]
    Volume(String),
    #[error("execd in sandbox {id} did not become ready: {reason}")]
    ExecdNotReady { id: String, reason: String },
    /// The sandbox's process ended before execd answered: its entrypoint
    /// finished or could not run. The request's to change, not an outage.
    #[error(
        "sandbox {id} exited with status {code} before it was ready (its entrypoint ended or \
         could not run; 126: not executable, 127: not found)"
    )]
    ExitedAtStart { id: String, code: i32 },
    /// containerd, images and the host, as the node crate reports them.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// A network policy this agent cannot enforce: it runs without
    /// networking (`--network none`), or the sandbox has no network.
    #[error("{0}")]
    NetworkUnavailable(String),
    /// Setting up or changing a sandbox's network failed on the host.
    #[error("sandbox network: {0}")]
    Network(#[from] crate::network::NetworkError),
    /// The node's volume store refused or failed (its own code: NOT_FOUND,
    /// ALREADY_EXISTS, RESOURCE_EXHAUSTED for a full root, ...).
    #[error("{0}")]
    VolumeStore(#[source] crate::volume_store::VolumeStoreError),
    /// This agent runs without a volume root.
    #[error(
        "node {node} has no volume root (its agent runs with --volume-backend none): named volumes are unavailable there"
    )]
    VolumesUnavailable { node: String },
    /// A `backend: "juicefs"` volume asked of an agent without JuiceFS.
    #[error(
        "backend \"juicefs\": node {node} has no JuiceFS configured (its agent runs without --juicefs-meta-url); create the volume through an agent that mounts the cluster's JuiceFS"
    )]
    JuiceFsNotConfigured { node: String },
    /// The agent's JuiceFS mount is down or its metadata engine does not
    /// answer: juicefs volumes cannot be touched from this node now.
    #[error("JuiceFS on node {node} is unavailable: {reason}")]
    JuiceFsUnavailable { node: String, reason: String },
    /// The access mode (or "once per sandbox") forbids this mount now.
    #[error("volume {volume:?} cannot be mounted: {reason}")]
    VolumeAccess { volume: String, reason: String },
    /// Restore and delete wait until no sandbox mounts the volume.
    #[error(
        "cannot {action} volume {volume:?} while it is mounted (by {holders}); detach it or delete those sandboxes first"
    )]
    VolumeInUse {
        volume: String,
        action: &'static str,
        holders: String,
    },
    #[error("volume {volume:?} is not mounted in sandbox {sandbox}")]
    VolumeNotMounted { sandbox: String, volume: String },
    /// A capture named the id of a snapshot of another sandbox.
    #[error("snapshot {id} already exists, of sandbox {sandbox}")]
    SnapshotTaken { id: String, sandbox: String },
    /// containerd keeps a snapshot while a writable layer sits on it.
    #[error(
        "snapshot {0} is in use: sandboxes restored from it (or snapshots of those) still exist on this node; it can be deleted once they are gone"
    )]
    SnapshotInUse(String),
    /// A restore named a snapshot this agent does not have.
    #[error("snapshot {0} is not on this agent")]
    SnapshotNotHere(String),
    /// This node cannot capture sandbox snapshots (the reason says why).
    #[error("sandbox snapshots are unavailable here: {0}")]
    SnapshotUnsupported(String),
    /// Copying a sandbox's writable layer failed on the host.
    #[error("capturing the writable layer: {0}")]
    SnapshotCopy(String),
}

pub type Result<T, E = AgentError> = std::result::Result<T, E>;

impl From<TeardownError> for AgentError {
    fn from(e: TeardownError) -> Self {
        let node = match e {
            TeardownError::Containerd { op, status } => NodeError::Containerd { op, status },
            TeardownError::Io { what, path, source } => NodeError::Io {
                context: format!("{what} {}", path.display()),
                source,
            },
            // Reported as before the teardown was shared: a wait that ran out.
            TeardownError::StillRunning { after } => NodeError::containerd("tasks.Wait")(
                Status::deadline_exceeded(format!("task did not exit {after:?} after SIGKILL")),
            ),
            TeardownError::Unmount { mount, errno } => NodeError::Io {
                context: format!("umount {mount}"),
                source: std::io::Error::from_raw_os_error(errno as i32),
            },
        };
        AgentError::Node(node)
    }
}

impl AgentError {
    /// Wraps a containerd call's failure with the call's name.
    pub fn containerd(op: &'static str) -> impl FnOnce(Status) -> AgentError {
        move |status| AgentError::Node(NodeError::containerd(op)(status))
    }

    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> AgentError {
        move |source| AgentError::Node(NodeError::io(context)(source))
    }

    /// The gRPC code the failure travels with.
    pub fn code(&self) -> Code {
        match self {
            AgentError::InvalidArgument(_) | AgentError::Volume(_) => Code::InvalidArgument,
            AgentError::SandboxNotFound(_) => Code::NotFound,
            AgentError::AlreadyExists { .. } => Code::AlreadyExists,
            AgentError::RuntimeUnavailable { .. } => Code::FailedPrecondition,
            AgentError::Capacity { .. } => Code::ResourceExhausted,
            AgentError::WrongPhase { .. } | AgentError::NotManaged(_) => Code::FailedPrecondition,
            AgentError::ExecdNotReady { .. } => Code::DeadlineExceeded,
            AgentError::ExitedAtStart { .. } => Code::FailedPrecondition,
            AgentError::Node(e) => node_code(e),
            AgentError::NetworkUnavailable(_) => Code::FailedPrecondition,
            AgentError::Network(e) => network_code(e),
            AgentError::VolumeStore(e) => e.grpc_code(),
            AgentError::VolumesUnavailable { .. } => Code::Unavailable,
            AgentError::JuiceFsNotConfigured { .. } => Code::FailedPrecondition,
            AgentError::JuiceFsUnavailable { .. } => Code::Unavailable,
            AgentError::VolumeAccess { .. } | AgentError::VolumeInUse { .. } => {
                Code::FailedPrecondition
            }
            AgentError::VolumeNotMounted { .. } => Code::NotFound,
            AgentError::SnapshotTaken { .. } => Code::AlreadyExists,
            AgentError::SnapshotInUse(_)
            | AgentError::SnapshotNotHere(_)
            | AgentError::SnapshotUnsupported(_) => Code::FailedPrecondition,
            AgentError::SnapshotCopy(_) => Code::Internal,
        }
    }

    /// True when containerd said "not found" (used to make deletes idempotent).
    pub fn is_not_found(&self) -> bool {
        matches!(self, AgentError::Node(e) if e.is_containerd(Code::NotFound))
    }
}

/// The code of a node-crate failure: what containerd said about the request
/// passes through, the rest says whose side failed.
fn node_code(e: &NodeError) -> Code {
    match e {
        NodeError::InvalidArgument(_) => Code::InvalidArgument,
        NodeError::ImageNotFound { .. } | NodeError::BadImage { .. } => Code::FailedPrecondition,
        NodeError::PullFailed { .. } | NodeError::Connect { .. } => Code::Unavailable,
        NodeError::Containerd { status, .. } => match status.code() {
            Code::NotFound => Code::NotFound,
            Code::AlreadyExists => Code::AlreadyExists,
            Code::Unavailable => Code::Unavailable,
            Code::InvalidArgument => Code::InvalidArgument,
            Code::FailedPrecondition => Code::FailedPrecondition,
            _ => Code::Internal,
        },
        NodeError::Io { .. } => Code::Internal,
    }
}

/// A host that lacks the tools, or a sandbox without a network, is a
/// precondition; the rest failed on the node.
fn network_code(e: &crate::network::NetworkError) -> Code {
    use crate::network::NetworkError as N;
    match e {
        N::MissingTools(_) | N::NotAttached(_) => Code::FailedPrecondition,
        _ => Code::Internal,
    }
}

impl From<AgentError> for Status {
    fn from(e: AgentError) -> Status {
        Status::new(e.code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(e: impl Into<AgentError>) -> Code {
        Status::from(e.into()).code()
    }

    fn ctrd(c: Code) -> NodeError {
        NodeError::containerd("op")(Status::new(c, "x"))
    }

    fn io() -> std::io::Error {
        std::io::Error::other("x")
    }

    #[test]
    fn every_failure_keeps_its_grpc_code() {
        let s = String::new;
        let cases: Vec<(AgentError, Code)> = vec![
            (AgentError::InvalidArgument(s()), Code::InvalidArgument),
            (AgentError::Volume(s()), Code::InvalidArgument),
            (AgentError::SandboxNotFound(s()), Code::NotFound),
            (
                AgentError::AlreadyExists {
                    id: s(),
                    owner: s(),
                    requested: s(),
                },
                Code::AlreadyExists,
            ),
            (
                AgentError::RuntimeUnavailable {
                    runtime: s(),
                    reason: s(),
                },
                Code::FailedPrecondition,
            ),
            (AgentError::Capacity { max: 1 }, Code::ResourceExhausted),
            (
                AgentError::WrongPhase {
                    id: s(),
                    phase: "p",
                    action: "a",
                },
                Code::FailedPrecondition,
            ),
            (AgentError::NotManaged(s()), Code::FailedPrecondition),
            (
                AgentError::ExecdNotReady {
                    id: s(),
                    reason: s(),
                },
                Code::DeadlineExceeded,
            ),
            (
                AgentError::ExitedAtStart { id: s(), code: 127 },
                Code::FailedPrecondition,
            ),
            (
                NodeError::InvalidArgument(s()).into(),
                Code::InvalidArgument,
            ),
            (
                NodeError::ImageNotFound { reference: s() }.into(),
                Code::FailedPrecondition,
            ),
            (
                NodeError::BadImage {
                    reference: s(),
                    reason: s(),
                }
                .into(),
                Code::FailedPrecondition,
            ),
            (
                NodeError::PullFailed {
                    reference: s(),
                    reason: s(),
                }
                .into(),
                Code::Unavailable,
            ),
            (
                NodeError::Connect {
                    socket: s(),
                    reason: s(),
                }
                .into(),
                Code::Unavailable,
            ),
            (NodeError::io("c")(io()).into(), Code::Internal),
            (
                AgentError::NetworkUnavailable(s()),
                Code::FailedPrecondition,
            ),
            (
                crate::network::NetworkError::NotAttached(s()).into(),
                Code::FailedPrecondition,
            ),
            (
                crate::network::NetworkError::Other(s()).into(),
                Code::Internal,
            ),
            (AgentError::io("c")(io()), Code::Internal),
            (
                AgentError::VolumesUnavailable { node: s() },
                Code::Unavailable,
            ),
            (
                AgentError::VolumeAccess {
                    volume: s(),
                    reason: s(),
                },
                Code::FailedPrecondition,
            ),
            (
                AgentError::VolumeInUse {
                    volume: s(),
                    action: "delete",
                    holders: s(),
                },
                Code::FailedPrecondition,
            ),
            (
                AgentError::VolumeNotMounted {
                    sandbox: s(),
                    volume: s(),
                },
                Code::NotFound,
            ),
            (
                AgentError::SnapshotTaken {
                    id: s(),
                    sandbox: s(),
                },
                Code::AlreadyExists,
            ),
            (AgentError::SnapshotInUse(s()), Code::FailedPrecondition),
            (AgentError::SnapshotNotHere(s()), Code::FailedPrecondition),
            (
                AgentError::SnapshotUnsupported(s()),
                Code::FailedPrecondition,
            ),
            (AgentError::SnapshotCopy(s()), Code::Internal),
            (
                AgentError::VolumeStore(crate::volume_store::VolumeStoreError::NoSpace {
                    what: s(),
                }),
                Code::ResourceExhausted,
            ),
            (
                AgentError::VolumeStore(crate::volume_store::VolumeStoreError::NotFound {
                    volume: s(),
                    snapshot: None,
                }),
                Code::NotFound,
            ),
            (
                AgentError::VolumeStore(crate::volume_store::VolumeStoreError::AlreadyExists {
                    volume: s(),
                    snapshot: None,
                }),
                Code::AlreadyExists,
            ),
        ];
        for (e, want) in cases {
            let text = e.to_string();
            assert_eq!(code(e), want, "{text}");
        }
        for (said, want) in [
            (Code::NotFound, Code::NotFound),
            (Code::AlreadyExists, Code::AlreadyExists),
            (Code::Unavailable, Code::Unavailable),
            (Code::InvalidArgument, Code::InvalidArgument),
            (Code::FailedPrecondition, Code::FailedPrecondition),
            (Code::DeadlineExceeded, Code::Internal),
            (Code::Unknown, Code::Internal),
        ] {
            assert_eq!(code(ctrd(said)), want, "containerd said {said:?}");
            assert_eq!(
                code(AgentError::containerd("op")(Status::new(said, "x"))),
                want
            );
        }
        assert!(AgentError::from(ctrd(Code::NotFound)).is_not_found());
        assert!(!AgentError::from(ctrd(Code::Unknown)).is_not_found());
    }

    #[test]
    fn teardown_failures_keep_their_codes_and_text() {
        let still = TeardownError::StillRunning {
            after: std::time::Duration::from_secs(1),
        };
        let e = AgentError::from(still);
        assert_eq!(code(e), Code::Internal);
        let e = AgentError::from(TeardownError::Containerd {
            op: "tasks.Kill",
            status: Box::new(Status::not_found("gone")),
        });
        assert!(e.is_not_found());
        assert!(e.to_string().starts_with("containerd tasks.Kill: "), "{e}");
        let e = AgentError::from(TeardownError::Unmount {
            mount: "/m".into(),
            errno: nix::errno::Errno::EBUSY,
        });
        assert_eq!(code(e), Code::Internal);
    }
}
