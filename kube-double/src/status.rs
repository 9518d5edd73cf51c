//! `meta/v1 Status` error bodies, shaped exactly like the API server's so
//! that clients (kube's `Error::Api`) classify them the same way.

use serde_json::{Map, Value, json};

use crate::kinds::Kind;

/// A failed API call: everything needed to render a `Status` body.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub code: u16,
    pub reason: &'static str,
    pub message: String,
    pub details: Option<Value>,
    /// Seconds for the `Retry-After` header (the server sends it with 429s).
    pub retry_after: Option<u64>,
}

/// The reason the API server pairs with an HTTP code when it has no more
/// specific one (see `StatusReason` in apimachinery).
pub(crate) fn reason_for_code(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        406 => "NotAcceptable",
        409 => "Conflict",
        410 => "Gone",
        413 => "RequestEntityTooLarge",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "",
    }
}

impl ApiError {
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            code,
            reason,
            message: message.into(),
            details: None,
            retry_after: None,
        }
    }

    /// An error for an arbitrary code, as injected by `fail_next`.
    pub fn from_code(code: u16) -> Self {
        let reason = reason_for_code(code);
        let message = match code {
            429 => "Too many requests, please try again later.".to_string(),
            500 => "Internal error occurred: injected failure".to_string(),
            503 => "the server is currently unable to handle the request".to_string(),
            409 => "Operation cannot be fulfilled: injected conflict".to_string(),
            _ => format!("injected failure ({code})"),
        };
        let mut err = ApiError::new(code, reason, message);
        if code == 429 {
            // The server's max-in-flight filter asks clients to wait a second.
            err.retry_after = Some(1);
            err.details = Some(json!({"retryAfterSeconds": 1}));
        }
        err
    }

    fn with_details(mut self, details: Value) -> Self {
        self.details = Some(details);
        self
    }

    pub fn not_found(kind: &Kind, name: &str) -> Self {
        ApiError::new(
            404,
            "NotFound",
            format!("{} \"{name}\" not found", kind.qualified()),
        )
        .with_details(kind.details(name))
    }

    pub fn no_resource() -> Self {
        ApiError::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
        .with_details(json!({}))
    }

    pub fn already_exists(kind: &Kind, name: &str) -> Self {
        ApiError::new(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", kind.qualified()),
        )
        .with_details(kind.details(name))
    }

    pub fn conflict(kind: &Kind, name: &str, why: &str) -> Self {
        ApiError::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                kind.qualified()
            ),
        )
        .with_details(kind.details(name))
    }

    pub fn modified(kind: &Kind, name: &str) -> Self {
        Self::conflict(
            kind,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// 422 with one field cause, worded like `field.ErrorList` renders.
    pub fn invalid(kind: &Kind, name: &str, field: &str, cause: &str) -> Self {
        let message = format!("{} \"{name}\" is invalid: {field}: {cause}", kind.kind);
        let mut details = kind.details(name);
        details["kind"] = json!(kind.kind);
        details["causes"] =
            json!([{"reason": "FieldValueInvalid", "message": cause, "field": field}]);
        ApiError::new(422, "Invalid", message).with_details(details)
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        ApiError::new(400, "BadRequest", message)
    }

    pub fn unauthorized() -> Self {
        ApiError::new(401, "Unauthorized", "Unauthorized")
    }

    pub fn unavailable() -> Self {
        ApiError::from_code(503)
    }

    pub fn method_not_allowed() -> Self {
        ApiError::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
        .with_details(json!({}))
    }

    pub fn unsupported_media_type(content_type: &str, accepted: &str) -> Self {
        ApiError::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format ({content_type}) - accepted media types include: {accepted}"
            ),
        )
    }

    /// What a watch from a compacted resourceVersion gets.
    pub fn expired(message: impl Into<String>) -> Self {
        ApiError::new(410, "Expired", message)
    }

    pub fn to_status(&self) -> Value {
        let mut status = Map::new();
        status.insert("kind".into(), json!("Status"));
        status.insert("apiVersion".into(), json!("v1"));
        status.insert("metadata".into(), json!({}));
        status.insert("status".into(), json!("Failure"));
        status.insert("message".into(), json!(self.message));
        status.insert("reason".into(), json!(self.reason));
        if let Some(details) = &self.details {
            status.insert("details".into(), details.clone());
        }
        status.insert("code".into(), json!(self.code));
        Value::Object(status)
    }
}
