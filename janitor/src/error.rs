//! The janitor's errors.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum JanitorError {
    #[error("invalid janitor configuration: {0}")]
    Config(String),
    /// containerd did not answer (or refused a call).
    #[error("containerd {op}: {status}")]
    Containerd {
        op: &'static str,
        status: Box<tonic::Status>,
    },
    #[error("cannot reach containerd: {0}")]
    Connect(String),
    /// The ownership source (the controller) could not be asked. The scan
    /// reaps nothing when this happens.
    #[error("ownership source unavailable: {0}")]
    OwnershipUnavailable(String),
    /// The agent pods of this node could not be listed: no container is
    /// reaped because its agent pod is gone (the other rules still apply).
    #[error("agent pods unavailable: {0}")]
    AgentPodsUnavailable(String),
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cleanup of {sandbox_id} failed: {reason}")]
    Cleanup { sandbox_id: String, reason: String },
}

impl JanitorError {
    pub(crate) fn containerd(op: &'static str) -> impl FnOnce(tonic::Status) -> Self {
        move |status| Self::Containerd {
            op,
            status: Box::new(status),
        }
    }

    pub(crate) fn io(
        what: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { what, path, source }
    }
}

pub type Result<T, E = JanitorError> = std::result::Result<T, E>;
