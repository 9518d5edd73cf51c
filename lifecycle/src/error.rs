//! The one error type every route answers with: an HTTP status plus the
//! OpenSandbox `{"code", "message"}` body.

use axum::Json;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An API error. Backends and validators produce these directly so that the
/// status code is decided where the cause is known, not guessed from text.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status} {code}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// `Retry-After` in seconds, for answers that say "not now" (503, 429)
    /// where waiting is what fixes it.
    pub retry_after_secs: Option<u32>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: &'a str,
    message: &'a str,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
            retry_after_secs: None,
        }
    }
    /// The same error, telling the client when to try again.
    pub fn with_retry_after(mut self, secs: u32) -> Self {
        self.retry_after_secs = Some(secs);
        self
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "INVALID_REQUEST", message)
    }
    pub fn invalid_code(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }
    pub fn not_found(id: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "SANDBOX_NOT_FOUND",
            format!("Sandbox {id} not found."),
        )
    }
    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL_ERROR", message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "BACKEND_UNAVAILABLE",
            message,
        )
    }
    pub fn not_implemented(what: &str) -> Self {
        Self::new(
            StatusCode::NOT_IMPLEMENTED,
            "API_NOT_SUPPORTED",
            format!("{what} is not implemented by sandbolt."),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(code = self.code, message = %self.message, "request failed");
        }
        let body = ErrorBody {
            code: self.code,
            message: &self.message,
        };
        let mut resp = (self.status, Json(body)).into_response();
        if let Some(secs) = self.retry_after_secs {
            resp.headers_mut().insert(header::RETRY_AFTER, secs.into());
        }
        resp
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// Errors of starting the lifecycle server (configuration, bind, backend).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("no API key configured: set one, or run open explicitly (insecure)")]
    NoApiKey,
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("backend unavailable: {0}")]
    Backend(String),
}
