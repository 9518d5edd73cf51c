//! Shell sessions: `POST /session`, `POST /session/{id}/run`, `DELETE /session/{id}`.
//!
//! Each run is a fresh shell started in the session's working directory with the
//! session's exported environment. An `EXIT` trap writes the final working directory
//! and `export -p` to a private pipe on fd 3, which becomes the session state for the
//! next run, so `cd` and `export` persist while stdout and stderr stay untouched.

use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::{Path as UrlPath, State};
use axum::http::StatusCode;
use axum::response::Response;
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

use crate::commands::{
    self, build_env, check_dir, expand_cwd, outcome_code, parse_timeout, stream_process,
};
use crate::error::ApiError;
use crate::extract::{ApiResult, JsonBody, JsonOrDefault};
use crate::process::{self, SpawnSpec};
use crate::sse::{self, Event, EventTx};
use crate::state::AppState;

pub const SESSION_NOT_FOUND: &str = "SESSION_NOT_FOUND";

/// Variables never carried from one run to the next.
const NOT_PERSISTED: &[&str] = &[
    "PWD",
    "SHLVL",
    "_",
    "PS1",
    "PS2",
    "PS3",
    "PS4",
    "PROMPT_COMMAND",
];

pub struct SessionState {
    cwd: PathBuf,
    env: BTreeMap<OsString, OsString>,
    closed: bool,
}

pub struct Session {
    pub id: String,
    state: Arc<tokio::sync::Mutex<SessionState>>,
    /// Process group of the running shell (0 when idle).
    pgid: AtomicI32,
}

impl Session {
    /// Kills the running command of the session, if any.
    pub fn interrupt(&self) {
        let pgid = self.pgid.load(Ordering::SeqCst);
        if pgid > 0 {
            process::kill_group(pgid, libc::SIGKILL);
        }
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct CreateRequest {
    cwd: Option<String>,
}

#[derive(Serialize)]
pub struct CreateResponse {
    session_id: String,
}

#[derive(Deserialize, Default)]
#[serde(default)]
pub struct RunRequest {
    command: Option<String>,
    cwd: Option<String>,
    timeout: Option<i64>,
}

/// `POST /session` (body optional)
#[tracing::instrument(skip_all, fields(session_id = tracing::field::Empty))]
pub async fn create(
    State(state): State<AppState>,
    JsonOrDefault(req): JsonOrDefault<CreateRequest>,
) -> ApiResult<Json<CreateResponse>> {
    let env = build_env(&state, None)?;
    if process::find_shell(env.get(OsStr::new("PATH")).map(|p| p.as_os_str())).is_none() {
        return Err(no_shell());
    }
    let cwd = match req.cwd.as_deref().filter(|c| !c.is_empty()) {
        Some(c) => {
            let p = expand_cwd(c, &env)?;
            std::fs::create_dir_all(&p).map_err(|e| {
                ApiError::bad_request(format!("cannot create cwd {}: {e}", p.display()))
            })?;
            p
        }
        None => std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/")),
    };
    let id = commands::new_id();
    tracing::Span::current().record("session_id", id.as_str());
    state.insert_session(Arc::new(Session {
        id: id.clone(),
        state: Arc::new(tokio::sync::Mutex::new(SessionState {
            cwd,
            env,
            closed: false,
        })),
        pgid: AtomicI32::new(0),
    }));
    Ok(Json(CreateResponse { session_id: id }))
}

fn no_shell() -> ApiError {
    ApiError::bad_request("sessions need a shell (bash or sh) in PATH")
}

fn session_not_found(id: &str, what: &str) -> ApiError {
    ApiError::not_found(SESSION_NOT_FOUND, format!("session {id} {what}"))
}

/// `DELETE /session/{id}`
#[tracing::instrument(skip_all, fields(session_id = %id))]
pub async fn delete(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> ApiResult<StatusCode> {
    let s = state
        .remove_session(&id)
        .ok_or_else(|| session_not_found(&id, "not found"))?;
    s.interrupt();
    if let Ok(mut st) = s.state.try_lock() {
        st.closed = true;
    }
    Ok(StatusCode::OK)
}

/// `POST /session/{id}/run`
#[tracing::instrument(skip_all, fields(session_id = %id))]
pub async fn run(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
    JsonBody(req): JsonBody<RunRequest>,
) -> ApiResult<Response> {
    let Some(command) = req.command.filter(|c| !c.trim().is_empty()) else {
        return Err(ApiError::bad_request("command must not be empty"));
    };
    if command.contains('\0') {
        return Err(ApiError::bad_request("command must not contain NUL bytes"));
    }
    let timeout = parse_timeout(req.timeout)?;
    let session = state
        .session(&id)
        .ok_or_else(|| session_not_found(&id, "not found"))?;
    // Runs of one session are serialized; the stream starts once it is this run's turn.
    let st = session.state.clone().lock_owned().await;
    if st.closed {
        return Err(session_not_found(&id, "was deleted"));
    }
    let cwd = match req.cwd.as_deref().filter(|c| !c.is_empty()) {
        Some(c) => expand_cwd(c, &st.env)?,
        None => st.cwd.clone(),
    };
    check_dir(&cwd)?;
    let (state_r, state_w) = make_pipe().map_err(|e| ApiError::internal(format!("pipe: {e}")))?;
    let spec = run_spec(&state, &st, &command, cwd, state_w)?;
    let shell = spec.program.clone();
    let started = Instant::now();
    let spawned = process::spawn(state.reaper(), spec);
    let (tx, resp) = sse::stream();
    tokio::spawn(async move {
        tx.send(Event::init(&session.id)).await;
        match spawned {
            Ok(sp) => run_in_session(&session, st, sp, state_r, &tx, timeout, started).await,
            Err(e) => {
                let (code, msg) = commands::spawn_failure(&shell, &e);
                tx.send(Event::error(code, msg)).await;
            }
        }
    });
    Ok(resp)
}

/// The shell of one run: the session's environment (plus `EXECD_ENVS` written since
/// it started) in `cwd`, the state trap writing to `state_w` as fd 3.
fn run_spec(
    state: &AppState,
    st: &SessionState,
    command: &str,
    cwd: PathBuf,
    state_w: OwnedFd,
) -> ApiResult<SpawnSpec> {
    let path_var = st.env.get(OsStr::new("PATH")).cloned();
    let shell = process::find_shell(path_var.as_deref()).ok_or_else(no_shell)?;
    let mut args: Vec<OsString> = Vec::new();
    if shell.file_name() == Some(OsStr::new("bash")) {
        args.push("--noprofile".into());
        args.push("--norc".into());
    }
    args.push("-c".into());
    args.push(wrap_script(command).into());
    let mut env = st.env.clone();
    // Files from EXECD_ENVS written since the session started apply too.
    for (k, v) in state.env_file_entries() {
        env.entry(k.into()).or_insert(v.into());
    }
    env.insert("PWD".into(), cwd.clone().into_os_string());
    let mut spec = SpawnSpec::new(shell.into_os_string());
    spec.args = args;
    spec.env = env.into_iter().collect();
    spec.cwd = Some(cwd);
    spec.fd3 = Some(state_w);
    Ok(spec)
}

/// Streams one run, then takes the state its trap reported as the session's next.
async fn run_in_session(
    session: &Session,
    mut st: tokio::sync::OwnedMutexGuard<SessionState>,
    mut sp: process::Spawned,
    state_r: OwnedFd,
    tx: &EventTx,
    timeout: Option<Duration>,
    started: Instant,
) {
    session.pgid.store(sp.pid, Ordering::SeqCst);
    let collect = tokio::spawn(read_state_pipe(state_r));
    let outcome = stream_process(&mut sp, tx, timeout).await;
    session.pgid.store(0, Ordering::SeqCst);
    // Descendants may keep fd 3 open; the trap has written by the time the shell exited.
    let data = match tokio::time::timeout(Duration::from_millis(100), collect).await {
        Ok(Ok(d)) => d,
        _ => Vec::new(),
    };
    if let Some((cwd, env)) = parse_state(&data) {
        st.cwd = cwd;
        st.env = env;
    }
    drop(st);
    let (code, msg) = outcome_code(&outcome, timeout);
    commands::send_last_event(tx, &outcome, code, msg, started).await;
}

/// Reads the state pipe to its end (bounded), concurrently with the run so a large
/// `export -p` cannot block the shell.
async fn read_state_pipe(state_r: OwnedFd) -> Vec<u8> {
    let mut data = Vec::new();
    let Ok(mut reader) = tokio::net::unix::pipe::Receiver::from_owned_fd(state_r) else {
        return data;
    };
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match reader.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                data.extend_from_slice(&buf[..n]);
                if data.len() > 16 * 1024 * 1024 {
                    break;
                }
            }
        }
    }
    data
}

fn make_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0i32; 2];
    // SAFETY: valid out-array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh descriptors owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The script of one run: an EXIT trap that reports the state, then the user's text.
pub fn wrap_script(command: &str) -> String {
    let mut s = String::with_capacity(command.len() + 160);
    s.push_str("trap '__sb_ec=$?; { printf \"%s\\0\" \"$(pwd)\"; export -p; } >&3 2>/dev/null; exit $__sb_ec' EXIT\n");
    s.push_str(command);
    if !command.ends_with('\n') {
        s.push('\n');
    }
    s
}

/// Parses `cwd NUL export -p` into the next session state.
pub fn parse_state(data: &[u8]) -> Option<(PathBuf, BTreeMap<OsString, OsString>)> {
    let nul = data.iter().position(|&b| b == 0)?;
    let cwd = PathBuf::from(OsString::from_vec(data[..nul].to_vec()));
    if !cwd.is_absolute() {
        return None;
    }
    let mut env = BTreeMap::new();
    for (k, v) in parse_export_p(&data[nul + 1..]) {
        if NOT_PERSISTED.iter().any(|n| n.as_bytes() == k.as_slice()) {
            continue;
        }
        env.insert(OsString::from_vec(k), OsString::from_vec(v));
    }
    Some((cwd, env))
}

/// Parses the output of `export -p` as bash (`declare -x K="v"`, `$'...'`), bash in POSIX
/// mode, dash and BusyBox ash (`export K='v'`) print it. Variables without a value
/// (exported but unset) are skipped.
pub fn parse_export_p(data: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut out = Vec::new();
    let mut i = 0;
    let n = data.len();
    let skip_blank = |i: &mut usize| {
        while *i < n && (data[*i] == b' ' || data[*i] == b'\t') {
            *i += 1;
        }
    };
    while i < n {
        // One statement per iteration: skip to its first word.
        while i < n && data[i].is_ascii_whitespace() {
            i += 1;
        }
        if i >= n {
            break;
        }
        let word_start = i;
        while i < n && !data[i].is_ascii_whitespace() {
            i += 1;
        }
        let word = &data[word_start..i];
        if word != b"declare" && word != b"export" && word != b"typeset" {
            // Not a statement we know: skip the line.
            while i < n && data[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        skip_blank(&mut i);
        // Options such as -x, -rx.
        while i < n && data[i] == b'-' {
            while i < n && !data[i].is_ascii_whitespace() {
                i += 1;
            }
            skip_blank(&mut i);
        }
        let name_start = i;
        while i < n && (data[i].is_ascii_alphanumeric() || data[i] == b'_') {
            i += 1;
        }
        let name = data[name_start..i].to_vec();
        if i < n && data[i] == b'=' {
            i += 1;
            let (value, next) = parse_word(data, i);
            i = next;
            if !name.is_empty() {
                out.push((name, value));
            }
        }
        // Rest of the line (normally nothing).
        while i < n && data[i] != b'\n' {
            i += 1;
        }
    }
    out
}

/// One shell word starting at `i`: quoted segments, `$'...'` and backslash escapes, up to
/// unquoted whitespace. Returns the value and the index after it.
fn parse_word(d: &[u8], mut i: usize) -> (Vec<u8>, usize) {
    let n = d.len();
    let mut v = Vec::new();
    while i < n && !d[i].is_ascii_whitespace() {
        match d[i] {
            b'\'' => {
                i += 1;
                while i < n && d[i] != b'\'' {
                    v.push(d[i]);
                    i += 1;
                }
                i += 1;
            }
            b'"' => {
                i += 1;
                while i < n && d[i] != b'"' {
                    if d[i] == b'\\'
                        && i + 1 < n
                        && matches!(d[i + 1], b'"' | b'\\' | b'$' | b'`' | b'\n')
                    {
                        if d[i + 1] != b'\n' {
                            v.push(d[i + 1]);
                        }
                        i += 2;
                        continue;
                    }
                    v.push(d[i]);
                    i += 1;
                }
                i += 1;
            }
            b'$' if d.get(i + 1) == Some(&b'\'') => {
                i += 2;
                while i < n && d[i] != b'\'' {
                    if d[i] == b'\\' && i + 1 < n {
                        i += 1;
                        let c = d[i];
                        i += 1;
                        match c {
                            b'n' => v.push(b'\n'),
                            b't' => v.push(b'\t'),
                            b'r' => v.push(b'\r'),
                            b'a' => v.push(7),
                            b'b' => v.push(8),
                            b'e' | b'E' => v.push(27),
                            b'f' => v.push(12),
                            b'v' => v.push(11),
                            b'x' => {
                                let mut val = 0u32;
                                let mut k = 0;
                                while k < 2 && i < n && (d[i] as char).is_ascii_hexdigit() {
                                    val = val * 16 + (d[i] as char).to_digit(16).unwrap_or(0);
                                    i += 1;
                                    k += 1;
                                }
                                v.push(val as u8);
                            }
                            b'0'..=b'7' => {
                                let mut val = (c - b'0') as u32;
                                let mut k = 1;
                                while k < 3 && i < n && (b'0'..=b'7').contains(&d[i]) {
                                    val = val * 8 + (d[i] - b'0') as u32;
                                    i += 1;
                                    k += 1;
                                }
                                v.push(val as u8);
                            }
                            other => v.push(other),
                        }
                        continue;
                    }
                    v.push(d[i]);
                    i += 1;
                }
                i += 1;
            }
            b'\\' if i + 1 < n => {
                v.push(d[i + 1]);
                i += 2;
            }
            c => {
                v.push(c);
                i += 1;
            }
        }
    }
    (v, i.min(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(data: &str) -> Vec<(String, String)> {
        parse_export_p(data.as_bytes())
            .into_iter()
            .map(|(k, v)| (String::from_utf8(k).unwrap(), String::from_utf8(v).unwrap()))
            .collect()
    }

    #[test]
    fn bash_format() {
        let got = kv(
            "declare -x A=\"1\"\ndeclare -x B=\"a \\\"q\\\" \\$x \\\\ `\"\ndeclare -x UNSET\ndeclare -x M=\"l1\nl2\"\ndeclare -x C=$'tab\\there\\n'\n",
        );
        assert_eq!(
            got,
            vec![
                ("A".into(), "1".into()),
                ("B".into(), "a \"q\" $x \\ `".into()),
                ("M".into(), "l1\nl2".into()),
                ("C".into(), "tab\there\n".into()),
            ]
        );
    }

    #[test]
    fn dash_and_busybox_format() {
        let got = kv(
            "export A='1'\nexport B='it'\"'\"'s'\nexport C='it'\\''s'\nexport M='l1\nl2'\nexport E=''\n",
        );
        assert_eq!(
            got,
            vec![
                ("A".into(), "1".into()),
                ("B".into(), "it's".into()),
                ("C".into(), "it's".into()),
                ("M".into(), "l1\nl2".into()),
                ("E".into(), "".into()),
            ]
        );
    }

    #[test]
    fn state_parsing() {
        let (cwd, env) = parse_state(b"/tmp\0export A='1'\nexport SHLVL='3'\n").unwrap();
        assert_eq!(cwd, PathBuf::from("/tmp"));
        assert_eq!(env.len(), 1);
        assert!(parse_state(b"no nul").is_none());
        assert!(parse_state(b"rel\0").is_none());
    }
}
