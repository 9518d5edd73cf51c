//! The controller's errors and their gRPC status codes. Clients (the
//! OpenSandbox server among them) read the code only, never the text, so
//! every variant maps to exactly one code.

use tonic::{Code, Status};

use crate::ids::SandboxKey;
use crate::placement::PlacementError;
use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("sandbox {0} not found")]
    NotFound(SandboxKey),
    /// The name is taken by another sandbox than the one the caller means.
    #[error("sandbox {0} (uid {1}) not found")]
    UidMismatch(SandboxKey, String),
    #[error("{0}")]
    NotFoundOther(String),
    #[error("sandbox {0} already exists (created by another request)")]
    AlreadyExists(SandboxKey),
    /// Another name is taken (a named volume's, a snapshot's).
    #[error("{0}")]
    AlreadyExistsOther(String),
    /// Optimistic-concurrency conflict (stale `expected_generation`, a
    /// concurrent writer): retry after reading again.
    #[error("{0}")]
    Aborted(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error("{0}")]
    Unavailable(String),
    /// No room (no node with a volume root, a full volume root).
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("agent {agent}: {status}")]
    Agent { agent: String, status: Status },
    /// An agent's answer to a volume call (see [`Error::volume_agent`]).
    #[error("node {node} (agent {agent}): {message}")]
    VolumeAgent {
        agent: String,
        node: String,
        code: Code,
        message: String,
    },
    #[error("{0}")]
    Unimplemented(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Internal(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A volume call's failure as the client should see it. Unlike a
    /// sandbox call, what the agent says about the volume itself passes
    /// through (NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION for a
    /// mounted volume or a refused access mode, RESOURCE_EXHAUSTED for a
    /// full volume root, INVALID_ARGUMENT); anything about the agent's
    /// health is UNAVAILABLE. Other errors are kept as they are.
    pub fn volume_agent(self, node: &str) -> Self {
        match self {
            Error::Agent { agent, status } => {
                let code = match status.code() {
                    c @ (Code::NotFound
                    | Code::AlreadyExists
                    | Code::FailedPrecondition
                    | Code::ResourceExhausted
                    | Code::InvalidArgument) => c,
                    // An agent without volume support (older build).
                    Code::Unimplemented => Code::FailedPrecondition,
                    _ => Code::Unavailable,
                };
                Error::VolumeAgent {
                    agent,
                    node: node.to_string(),
                    code,
                    message: status.message().to_string(),
                }
            }
            e => e,
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::NotFound(_) | Error::UidMismatch(..) | Error::NotFoundOther(_) => Code::NotFound,
            Error::AlreadyExists(..) | Error::AlreadyExistsOther(_) => Code::AlreadyExists,
            Error::Aborted(_) => Code::Aborted,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::Placement(PlacementError::AlreadyReserved(_)) => Code::Internal,
            // The request names a runtime the pool does not offer: the
            // caller's to change (the message names the field's value).
            Error::Placement(PlacementError::NoRuntime(..)) => Code::InvalidArgument,
            // The sandbox's volumes pin it to a node that is silent: retry
            // when it is back (it is never moved without its data).
            Error::Placement(PlacementError::PinnedUnavailable(_)) => Code::Unavailable,
            Error::Placement(PlacementError::PinnedPool { .. }) => Code::FailedPrecondition,
            // No agent has the JuiceFS mount up now (mounts are remounted):
            // retry; a pinned node without one will never have it.
            Error::Placement(PlacementError::NoSharedVolumes(..)) => Code::Unavailable,
            Error::Placement(PlacementError::PinnedNoSharedVolumes(_)) => Code::FailedPrecondition,
            Error::Placement(_) => Code::ResourceExhausted,
            Error::Unavailable(_) => Code::Unavailable,
            Error::ResourceExhausted(_) => Code::ResourceExhausted,
            // What the agent said about the request itself passes through;
            // anything about the agent's health is "try again".
            Error::Agent { status, .. } => match status.code() {
                Code::InvalidArgument => Code::InvalidArgument,
                Code::FailedPrecondition | Code::NotFound => Code::FailedPrecondition,
                Code::ResourceExhausted => Code::ResourceExhausted,
                _ => Code::Unavailable,
            },
            Error::VolumeAgent { code, .. } => *code,
            Error::Unimplemented(_) => Code::Unimplemented,
            Error::Store(StoreError::NotFound(..)) => Code::NotFound,
            Error::Store(StoreError::Invalid(_)) => Code::InvalidArgument,
            Error::Store(
                StoreError::AlreadyExists(_)
                | StoreError::WarmPoolExists(_)
                | StoreError::SnapshotExists(_),
            ) => Code::AlreadyExists,
            Error::Store(StoreError::WarmPoolNotFound(_) | StoreError::SnapshotNotFound(_)) => {
                Code::NotFound
            }
            Error::Store(StoreError::WarmPoolConflict(_) | StoreError::SnapshotConflict(_)) => {
                Code::Aborted
            }
            Error::Store(StoreError::Conflict(..)) => Code::Aborted,
            Error::Store(StoreError::Unavailable(_) | StoreError::Backend(_)) => Code::Unavailable,
            Error::Store(StoreError::Corrupt(_)) | Error::Internal(_) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}
