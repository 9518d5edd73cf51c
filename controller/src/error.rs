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
    #[error("agent {agent}: {status}")]
    Agent { agent: String, status: Status },
    #[error("{0}")]
    Unimplemented(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    Internal(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::NotFound(_) | Error::UidMismatch(..) | Error::NotFoundOther(_) => Code::NotFound,
            Error::AlreadyExists(..) => Code::AlreadyExists,
            Error::Aborted(_) => Code::Aborted,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::Placement(PlacementError::AlreadyReserved(_)) => Code::Internal,
            // The request names a runtime the pool does not offer: the
            // caller's to change (the message names the field's value).
            Error::Placement(PlacementError::NoRuntime(..)) => Code::InvalidArgument,
            Error::Placement(_) => Code::ResourceExhausted,
            Error::Unavailable(_) => Code::Unavailable,
            // What the agent said about the request itself passes through;
            // anything about the agent's health is "try again".
            Error::Agent { status, .. } => match status.code() {
                Code::InvalidArgument => Code::InvalidArgument,
                Code::FailedPrecondition | Code::NotFound => Code::FailedPrecondition,
                Code::ResourceExhausted => Code::ResourceExhausted,
                _ => Code::Unavailable,
            },
            Error::Unimplemented(_) => Code::Unimplemented,
            Error::Store(StoreError::NotFound(..)) => Code::NotFound,
            Error::Store(StoreError::Invalid(_)) => Code::InvalidArgument,
            Error::Store(StoreError::AlreadyExists(_)) => Code::AlreadyExists,
            Error::Store(StoreError::Conflict(..)) => Code::Aborted,
            Error::Store(StoreError::Unavailable(_) | StoreError::Backend(_)) => Code::Unavailable,
            Error::Store(StoreError::Corrupt(_)) | Error::Internal(_) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}
