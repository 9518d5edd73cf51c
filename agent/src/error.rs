//! The agent's error type and its mapping onto gRPC status codes (callers read
//! codes, never message text).

use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("sandbox {0} not found")]
    SandboxNotFound(String),
    #[error("image {reference} is not present on this node")]
    ImageNotFound { reference: String },
    #[error("pull of {reference} failed: {reason}")]
    PullFailed { reference: String, reason: String },
    #[error("OCI runtime {runtime} cannot run here: {reason}")]
    RuntimeUnavailable { runtime: String, reason: String },
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
    #[error("image {reference}: {reason}")]
    BadImage { reference: String, reason: String },
    #[error("containerd {op}: {status}")]
    Containerd {
        op: &'static str,
        #[source]
        status: Status,
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

pub type Result<T, E = AgentError> = std::result::Result<T, E>;

impl From<crate::teardown::TeardownError> for AgentError {
    fn from(e: crate::teardown::TeardownError) -> Self {
        use crate::teardown::TeardownError as T;
        match e {
            T::Containerd { op, status } => AgentError::Containerd {
                op,
                status: *status,
            },
            T::Io { what, path, source } => AgentError::Io {
                context: format!("{what} {}", path.display()),
                source,
            },
            // Reported as before the teardown was shared: a wait that ran out.
            T::StillRunning { after } => AgentError::Containerd {
                op: "tasks.Wait",
                status: Status::deadline_exceeded(format!(
                    "task did not exit {after:?} after SIGKILL"
                )),
            },
            T::Unmount { mount, errno } => AgentError::Io {
                context: format!("umount {mount}"),
                source: std::io::Error::from_raw_os_error(errno as i32),
            },
        }
    }
}

impl AgentError {
    /// Wraps a containerd call's failure with the call's name.
    pub fn containerd(op: &'static str) -> impl FnOnce(Status) -> AgentError {
        move |status| AgentError::Containerd { op, status }
    }

    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> AgentError {
        move |source| AgentError::Io {
            context: context.into(),
            source,
        }
    }

    /// The gRPC code the failure travels with.
    pub fn code(&self) -> Code {
        match self {
            AgentError::InvalidArgument(_) | AgentError::Volume(_) => Code::InvalidArgument,
            AgentError::SandboxNotFound(_) => Code::NotFound,
            AgentError::ImageNotFound { .. } | AgentError::BadImage { .. } => {
                Code::FailedPrecondition
            }
            AgentError::PullFailed { .. } => Code::Unavailable,
            AgentError::RuntimeUnavailable { .. } => Code::FailedPrecondition,
            AgentError::Capacity { .. } => Code::ResourceExhausted,
            AgentError::WrongPhase { .. } | AgentError::NotManaged(_) => Code::FailedPrecondition,
            AgentError::ExecdNotReady { .. } => Code::DeadlineExceeded,
            AgentError::Containerd { status, .. } => match status.code() {
                Code::NotFound => Code::NotFound,
                Code::AlreadyExists => Code::AlreadyExists,
                Code::Unavailable => Code::Unavailable,
                Code::InvalidArgument => Code::InvalidArgument,
                Code::FailedPrecondition => Code::FailedPrecondition,
                _ => Code::Internal,
            },
            AgentError::Connect { .. } => Code::Unavailable,
            AgentError::Io { .. } => Code::Internal,
        }
    }

    /// True when containerd said "not found" (used to make deletes idempotent).
    pub fn is_not_found(&self) -> bool {
        matches!(self, AgentError::Containerd { status, .. } if status.code() == Code::NotFound)
    }
}

impl From<AgentError> for Status {
    fn from(e: AgentError) -> Status {
        Status::new(e.code(), e.to_string())
    }
}
