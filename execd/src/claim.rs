//! `POST /sandbolt/claim`: hands a warm execd (started with `--warm`) to its user.
//! The wire shape and answers are in the crate docs ("Warm mode").

use std::ffi::OsString;
use std::path::PathBuf;

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value};
use tokio::sync::oneshot;

use crate::error::ApiError;
use crate::state::{AppState, ClaimError, ClaimedEntrypoint, StateConfig};

/// Error codes of this route (besides the contract's `INVALID_REQUEST_BODY`).
pub mod code {
    pub const NOT_WARM: &str = "NOT_WARM";
    pub const ALREADY_CLAIMED: &str = "ALREADY_CLAIMED";
    pub const SPAWN_FAILED: &str = "SPAWN_FAILED";
}

/// A validated claim request.
#[derive(Debug, PartialEq)]
struct ClaimRequest {
    access_token: String,
    env: Vec<(OsString, OsString)>,
    command: Vec<OsString>,
    working_dir: Option<PathBuf>,
}

/// `POST /sandbolt/claim`
#[tracing::instrument(skip_all)]
pub async fn claim(State(state): State<AppState>, body: Bytes) -> Response {
    // Only a claim changes it, and a claim that loses the race below is refused anyway.
    let env_file = state.env_file();
    let claimed = state.claim(|| {
        let req = parse(&body)?;
        let mut cfg = StateConfig::from_vars(Some(req.access_token.clone()), req.env.clone());
        // Without its own EXECD_ENVS the claim keeps the file execd was started with
        // (under --init the default one), as a cold start with that env would.
        if cfg.env_file.is_none() {
            cfg.env_file = env_file;
        }
        cfg.export_env_file();
        let entry_env = cfg.base_env.clone();
        Ok::<_, ApiError>(((req, entry_env), cfg))
    });
    let ((req, env), entrypoint) = match claimed {
        Ok(x) => x,
        Err(ClaimError::NotWarm) => {
            return conflict(code::NOT_WARM, "execd was not started with --warm");
        }
        Err(ClaimError::AlreadyClaimed) => {
            return conflict(code::ALREADY_CLAIMED, "this sandbox was already claimed");
        }
        Err(ClaimError::Invalid(e)) => return e.into_response(),
    };
    let (reply, answer) = oneshot::channel();
    let sent = entrypoint.send(ClaimedEntrypoint {
        argv: req.command,
        env,
        cwd: req.working_dir,
        reply,
    });
    let result = match sent {
        Ok(()) => answer
            .await
            .unwrap_or_else(|_| Err("execd is shutting down".into())),
        Err(_) => Err("execd is shutting down".into()),
    };
    match result {
        Ok(pid) => Json(serde_json::json!({ "pid": pid })).into_response(),
        Err(message) => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            code::SPAWN_FAILED,
            message,
        )
        .into_response(),
    }
}

fn conflict(code: &'static str, message: &str) -> Response {
    ApiError::new(StatusCode::CONFLICT, code, message).into_response()
}

fn invalid(field: &str, what: impl std::fmt::Display) -> ApiError {
    ApiError::bad_request(format!("invalid claim: {field}: {what}"))
}

/// Parses and checks a claim body; every error names the field at fault.
fn parse(body: &[u8]) -> Result<ClaimRequest, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid claim: body is not JSON: {e}")))?;
    let Value::Object(mut obj) = value else {
        return Err(ApiError::bad_request(
            "invalid claim: body must be a JSON object",
        ));
    };
    let access_token = match obj.remove("accessToken") {
        Some(Value::String(t)) if !t.is_empty() => t,
        Some(Value::String(_)) => return Err(invalid("accessToken", "must not be empty")),
        Some(_) => return Err(invalid("accessToken", "must be a string")),
        None => return Err(invalid("accessToken", "is required")),
    };
    if access_token.bytes().any(|b| !(0x21..0x7f).contains(&b)) {
        // It must fit an HTTP header value compared byte for byte.
        return Err(invalid(
            "accessToken",
            "must be printable ASCII without spaces",
        ));
    }
    // Required even though it may be empty: a claim that forgot it would start the
    // entrypoint without PATH or HOME.
    let env = strings(&mut obj, "env", false)?
        .into_iter()
        .enumerate()
        .map(|(i, kv)| env_entry(i, kv))
        .collect::<Result<Vec<_>, _>>()?;
    let command = strings(&mut obj, "command", false)?;
    if command.is_empty() {
        return Err(invalid("command", "is required (program and arguments)"));
    }
    if command[0].is_empty() {
        return Err(invalid("command[0]", "must not be empty"));
    }
    let working_dir = match obj.remove("workingDir") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) if d.is_empty() => None,
        Some(Value::String(d)) => {
            if !d.starts_with('/') || d.contains('\0') {
                return Err(invalid("workingDir", "must be an absolute path"));
            }
            Some(PathBuf::from(d))
        }
        Some(_) => return Err(invalid("workingDir", "must be a string")),
    };
    // A field execd does not know would be silently dropped: refuse it instead.
    if let Some(field) = obj.keys().next() {
        return Err(invalid(field, "unknown field"));
    }
    Ok(ClaimRequest {
        access_token,
        env,
        command: command.into_iter().map(OsString::from).collect(),
        working_dir,
    })
}

/// The array of strings `obj[field]` (required unless `allow_missing`), without NUL bytes.
fn strings(
    obj: &mut Map<String, Value>,
    field: &str,
    allow_missing: bool,
) -> Result<Vec<String>, ApiError> {
    let items = match obj.remove(field) {
        Some(Value::Array(items)) => items,
        None | Some(Value::Null) if allow_missing => return Ok(Vec::new()),
        None => return Err(invalid(field, "is required")),
        Some(_) => return Err(invalid(field, "must be an array of strings")),
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) if s.contains('\0') => {
                Err(invalid(&format!("{field}[{i}]"), "contains a NUL byte"))
            }
            Value::String(s) => Ok(s),
            _ => Err(invalid(&format!("{field}[{i}]"), "must be a string")),
        })
        .collect()
}

fn env_entry(i: usize, kv: String) -> Result<(OsString, OsString), ApiError> {
    match kv.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.into(), v.into())),
        _ => Err(invalid(&format!("env[{i}]"), "must be KEY=VALUE")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(body: &str) -> String {
        parse(body.as_bytes()).unwrap_err().message
    }

    #[test]
    fn parses_a_full_claim() {
        let req = parse(
            br#"{"accessToken":"t2","env":["A=1","B==x","C="],"command":["sh","-c","x"],"workingDir":"/w"}"#,
        )
        .unwrap();
        assert_eq!(req.access_token, "t2");
        assert_eq!(
            req.env,
            vec![
                ("A".into(), "1".into()),
                ("B".into(), "=x".into()),
                ("C".into(), "".into())
            ]
        );
        assert_eq!(req.command, vec!["sh", "-c", "x"]);
        assert_eq!(req.working_dir, Some(PathBuf::from("/w")));
    }

    #[test]
    fn every_error_names_its_field() {
        let cases = [
            (r#"[]"#, "body must be a JSON object"),
            (r#"{"env":[],"command":["x"]}"#, "accessToken: is required"),
            (
                r#"{"accessToken":"","command":["x"]}"#,
                "accessToken: must not",
            ),
            (
                r#"{"accessToken":"a b","command":["x"]}"#,
                "accessToken: must be",
            ),
            (
                r#"{"accessToken":"t","env":["A=1","nope"],"command":["x"]}"#,
                "env[1]:",
            ),
            (
                r#"{"accessToken":"t","env":["=v"],"command":["x"]}"#,
                "env[0]:",
            ),
            (
                r#"{"accessToken":"t","env":"A=1","command":["x"]}"#,
                "env: must be",
            ),
            (r#"{"accessToken":"t","command":["x"]}"#, "env: is required"),
            (r#"{"accessToken":"t","env":[]}"#, "command: is required"),
            (
                r#"{"accessToken":"t","env":[],"command":[]}"#,
                "command: is required",
            ),
            (
                r#"{"accessToken":"t","env":[],"command":["", "a"]}"#,
                "command[0]:",
            ),
            (
                r#"{"accessToken":"t","env":[],"command":["x", 3]}"#,
                "command[1]: must be",
            ),
            (
                r#"{"accessToken":"t","env":[],"command":["x"],"workingDir":"rel"}"#,
                "workingDir:",
            ),
            (
                r#"{"accessToken":"t","env":[],"command":["x"],"workingDir":5}"#,
                "workingDir:",
            ),
            (
                r#"{"accessToken":"t","env":[],"command":["x"],"cwd":"/"}"#,
                "cwd: unknown field",
            ),
        ];
        for (body, want) in cases {
            let got = err(body);
            assert!(got.contains(want), "{body}: {got:?} lacks {want:?}");
        }
    }

    #[test]
    fn working_dir_is_optional_and_env_may_be_empty() {
        let req = parse(br#"{"accessToken":"t","env":[],"command":["x"]}"#).unwrap();
        assert!(req.env.is_empty());
        assert_eq!(req.working_dir, None);
    }
}
