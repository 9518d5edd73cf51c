//! The node crate's errors: what went wrong talking to containerd or with an
//! image. The agent maps them onto its own error (and so onto gRPC codes)
//! variant by variant; the teardown has its own [`TeardownError`], whose
//! callers tell its cases apart.
//!
//! [`TeardownError`]: crate::teardown::TeardownError

use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("image {reference} is not present on this node")]
    ImageNotFound { reference: String },
    #[error("pull of {reference} failed: {reason}")]
    PullFailed { reference: String, reason: String },
    #[error("image {reference}: {reason}")]
    BadImage { reference: String, reason: String },
    #[error("containerd {op}: {status}")]
    Containerd {
        op: &'static str,
        #[source]
        status: Box<Status>,
    },
    #[error("cannot connect to containerd at {socket}: {reason}")]
    Connect { socket: String, reason: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = NodeError> = std::result::Result<T, E>;

impl NodeError {
    /// Wraps a containerd call's failure with the call's name.
    pub fn containerd(op: &'static str) -> impl FnOnce(Status) -> NodeError {
        move |status| NodeError::Containerd {
            op,
            status: Box::new(status),
        }
    }

    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> NodeError {
        move |source| NodeError::Io {
            context: context.into(),
            source,
        }
    }

    /// A task that panicked or was cancelled, as an I/O failure of `context`.
    pub(crate) fn join(context: &'static str) -> impl FnOnce(tokio::task::JoinError) -> NodeError {
        move |e| NodeError::io(context)(std::io::Error::other(e))
    }

    /// containerd answered with `code`.
    pub fn is_containerd(&self, code: Code) -> bool {
        matches!(self, NodeError::Containerd { status, .. } if status.code() == code)
    }
}
