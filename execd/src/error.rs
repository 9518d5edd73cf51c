//! Errors: [`ExecdError`] for the daemon itself, [`ApiError`] for HTTP answers.
//!
//! Every error answer of the API is `{"code": "...", "message": "..."}` (the contract's
//! `ErrorResponse`), with the codes the original execd uses.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// Failure of the daemon as a whole (bind, runtime, entrypoint).
#[derive(Debug, thiserror::Error)]
pub enum ExecdError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("invalid listen address {0:?} (want IP:PORT)")]
    ListenAddr(String),
    #[error("runtime: {0}")]
    Runtime(std::io::Error),
    #[error("{0}")]
    Usage(String),
}

/// Error codes of the contract (and of the original execd).
pub mod code {
    pub const INVALID_REQUEST: &str = "INVALID_REQUEST_BODY";
    pub const MISSING_QUERY: &str = "MISSING_QUERY";
    pub const RUNTIME_ERROR: &str = "RUNTIME_ERROR";
    pub const INVALID_FILE: &str = "INVALID_FILE";
    pub const INVALID_FILE_METADATA: &str = "INVALID_FILE_METADATA";
    pub const FILE_NOT_FOUND: &str = "FILE_NOT_FOUND";
    pub const CONTEXT_NOT_FOUND: &str = "CONTEXT_NOT_FOUND";
    pub const NOT_SUPPORTED: &str = "NOT_SUPPORTED";
    pub const UNAUTHORIZED: &str = "UNAUTHORIZED";
    pub const NOT_FOUND: &str = "NOT_FOUND";
    pub const METHOD_NOT_ALLOWED: &str = "METHOD_NOT_ALLOWED";
    pub const RANGE_NOT_SATISFIABLE: &str = "RANGE_NOT_SATISFIABLE";
    pub const BAD_GATEWAY: &str = "BAD_GATEWAY";
}

#[derive(Serialize)]
struct Body<'a> {
    code: &'a str,
    message: &'a str,
}

/// An error answer: status + contract error body.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code::INVALID_REQUEST, message)
    }
    pub fn missing_query(name: &str) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            code::MISSING_QUERY,
            format!("missing query parameter '{name}'"),
        )
    }
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            code::RUNTIME_ERROR,
            message,
        )
    }
    pub fn not_supported(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_IMPLEMENTED, code::NOT_SUPPORTED, message)
    }

    /// The contract error for an answer the framework produced as plain text (a body
    /// over the limit, a bad path parameter, 405): the status stays, the text becomes
    /// the message.
    pub fn from_framework(status: StatusCode, text: &str) -> Self {
        let text = text.trim();
        let message = if text.is_empty() {
            status.canonical_reason().unwrap_or("error")
        } else {
            text
        };
        let code = match status {
            StatusCode::METHOD_NOT_ALLOWED => code::METHOD_NOT_ALLOWED,
            StatusCode::NOT_FOUND => code::NOT_FOUND,
            s if s.is_client_error() => code::INVALID_REQUEST,
            _ => code::RUNTIME_ERROR,
        };
        Self::new(status, code, message)
    }

    /// Maps a filesystem error on `path` to 404 / 400 / 403 / 507 / 500.
    pub fn fs(path: &std::path::Path, what: &str, err: &std::io::Error) -> Self {
        use std::io::ErrorKind::*;
        // A full volume (ENOSPC) or one over its quota (EDQUOT: what btrfs
        // qgroups answer) is the caller's storage running out, not a fault
        // of execd: 507 with the cause spelled out.
        let full = match err.raw_os_error() {
            Some(libc::EDQUOT) => Some("disk quota exceeded"),
            Some(libc::ENOSPC) => Some("no space left on device"),
            _ => None,
        };
        if let Some(cause) = full {
            return Self::new(
                StatusCode::INSUFFICIENT_STORAGE,
                code::RUNTIME_ERROR,
                format!("{what} {}: {cause}", path.display()),
            );
        }
        let message = format!("{what} {}: {err}", path.display());
        match err.kind() {
            NotFound => Self::not_found(code::FILE_NOT_FOUND, message),
            PermissionDenied => Self::new(StatusCode::FORBIDDEN, code::RUNTIME_ERROR, message),
            AlreadyExists | NotADirectory | IsADirectory | DirectoryNotEmpty | InvalidInput
            | InvalidFilename | ReadOnlyFilesystem | CrossesDevices => {
                Self::new(StatusCode::BAD_REQUEST, code::INVALID_REQUEST, message)
            }
            _ => Self::internal(message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_error(self.status, self.code, &self.message)
    }
}

/// Builds a contract error answer.
pub fn json_error(status: StatusCode, code: &str, message: &str) -> Response {
    let body = serde_json::to_vec(&Body { code, message }).unwrap_or_default();
    (
        status,
        [(http::header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;
    use std::path::Path;

    #[test]
    fn a_full_volume_is_507_naming_path_and_cause() {
        let p = Path::new("/data/out.bin");
        let e = ApiError::fs(p, "write", &io::Error::from_raw_os_error(libc::EDQUOT));
        assert_eq!(e.status, StatusCode::INSUFFICIENT_STORAGE);
        assert_eq!(e.message, "write /data/out.bin: disk quota exceeded");
        let e = ApiError::fs(p, "write", &io::Error::from_raw_os_error(libc::ENOSPC));
        assert_eq!(e.status, StatusCode::INSUFFICIENT_STORAGE);
        assert_eq!(e.message, "write /data/out.bin: no space left on device");
        // Other failures keep their mapping.
        let e = ApiError::fs(p, "write", &io::Error::from_raw_os_error(libc::EIO));
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        let e = ApiError::fs(p, "write", &io::Error::from_raw_os_error(libc::EROFS));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = ApiError::fs(p, "open", &io::Error::from_raw_os_error(libc::ENOENT));
        assert_eq!(e.status, StatusCode::NOT_FOUND);
    }
}
