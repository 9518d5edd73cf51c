//! Why a volume store call failed. Every message names the volume (and
//! snapshot) concerned and the rule that was broken.

use super::names::Label;

#[derive(Debug, thiserror::Error)]
pub enum VolumeStoreError {
    /// `kind` is "volume" or "snapshot".
    #[error("invalid {kind} name {name:?}: {reason}")]
    InvalidName {
        kind: &'static str,
        name: String,
        reason: &'static str,
    },
    #[error(
        "invalid access mode {value:?} (expected ReadWriteOnce, ReadOnlyMany or ReadWriteMany)"
    )]
    InvalidAccessMode { value: String },
    #[error("{}", not_found_message(volume, snapshot.as_deref()))]
    NotFound {
        volume: String,
        /// Set when the volume exists and the snapshot does not.
        snapshot: Option<String>,
    },
    #[error("{}", exists_message(volume, snapshot.as_deref()))]
    AlreadyExists {
        volume: String,
        snapshot: Option<String>,
    },
    #[error(
        "volume {volume:?} asks for a size, but the {backend} backend of this node enforces no quota"
    )]
    QuotaUnsupported {
        volume: String,
        backend: &'static str,
    },
    #[error("no space left on the volume root for {what}")]
    NoSpace { what: String },
    #[error("subPath {sub_path:?} of volume {volume:?} is invalid: {reason}")]
    InvalidSubPath {
        volume: String,
        sub_path: String,
        reason: String,
    },
    #[error("volume root setup failed: {0}")]
    Setup(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("volume {volume:?} has unreadable metadata: {reason}")]
    Corrupt { volume: String, reason: String },
}

fn not_found_message(volume: &str, snapshot: Option<&str>) -> String {
    match snapshot {
        Some(s) => format!("snapshot {s:?} of volume {volume:?} not found"),
        None => format!("volume {volume:?} not found"),
    }
}

fn exists_message(volume: &str, snapshot: Option<&str>) -> String {
    match snapshot {
        Some(s) => format!("snapshot {s:?} of volume {volume:?} already exists"),
        None => format!("volume {volume:?} already exists"),
    }
}

impl VolumeStoreError {
    pub(super) fn volume_not_found(v: Label<'_>) -> Self {
        Self::NotFound {
            volume: v.as_str().into(),
            snapshot: None,
        }
    }

    pub(super) fn snapshot_not_found(v: Label<'_>, s: Label<'_>) -> Self {
        Self::NotFound {
            volume: v.as_str().into(),
            snapshot: Some(s.as_str().into()),
        }
    }

    pub(super) fn volume_exists(v: Label<'_>) -> Self {
        Self::AlreadyExists {
            volume: v.as_str().into(),
            snapshot: None,
        }
    }

    pub(super) fn snapshot_exists(v: Label<'_>, s: Label<'_>) -> Self {
        Self::AlreadyExists {
            volume: v.as_str().into(),
            snapshot: Some(s.as_str().into()),
        }
    }

    /// The errno of an I/O error (EEXIST, ENOENT: what a clone ran into).
    pub(super) fn os_error(&self) -> Option<i32> {
        match self {
            Self::Io { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }

    /// The gRPC code this error maps to (the agent's RPCs and, through
    /// them, the REST status).
    pub fn grpc_code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            Self::InvalidName { .. }
            | Self::InvalidAccessMode { .. }
            | Self::InvalidSubPath { .. } => Code::InvalidArgument,
            Self::NotFound { .. } => Code::NotFound,
            Self::AlreadyExists { .. } => Code::AlreadyExists,
            Self::QuotaUnsupported { .. } => Code::FailedPrecondition,
            Self::NoSpace { .. } => Code::ResourceExhausted,
            Self::Setup(_) => Code::Unavailable,
            Self::Io { .. } | Self::Command { .. } | Self::Corrupt { .. } => Code::Internal,
        }
    }
}

impl From<VolumeStoreError> for tonic::Status {
    fn from(e: VolumeStoreError) -> Self {
        tonic::Status::new(e.grpc_code(), e.to_string())
    }
}

/// An I/O error with what we were doing; ENOSPC becomes NoSpace.
pub(super) fn io(context: String, source: std::io::Error) -> VolumeStoreError {
    if source.raw_os_error() == Some(libc::ENOSPC) {
        return VolumeStoreError::NoSpace { what: context };
    }
    VolumeStoreError::Io { context, source }
}
