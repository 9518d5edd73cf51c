//! `/command`: foreground (SSE), background (status + logs), interrupt.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::error::{ApiError, code};
use crate::extract::{ApiResult, JsonBody, Query};
use crate::process::{self, Identity, LineChunker, SpawnSpec, Spawned};
use crate::sse::{self, Event, EventTx};
use crate::state::AppState;
use crate::util::{UserDb, rfc3339, shell_quote};

/// Keep-alive interval of command streams.
pub const PING_INTERVAL: Duration = Duration::from_secs(3);
/// Output kept per background command (oldest bytes are dropped beyond it).
pub const BACKGROUND_LOG_CAP: usize = 16 * 1024 * 1024;
/// Finished commands are forgotten after this long...
const FINISHED_TTL: Duration = Duration::from_secs(3600);
/// ...or when more than this many are kept...
const MAX_FINISHED: usize = 256;
/// ...or when their logs add up to more than this.
const FINISHED_LOG_BUDGET: usize = 64 * 1024 * 1024;

#[derive(Deserialize, Debug, Default)]
#[serde(default)]
pub struct RunCommandRequest {
    pub command: Option<String>,
    pub argv: Option<Vec<String>>,
    pub cwd: Option<String>,
    pub background: Option<bool>,
    pub timeout: Option<i64>,
    pub uid: Option<i64>,
    pub gid: Option<i64>,
    pub envs: Option<HashMap<String, String>>,
}

/// Output of a background command with absolute byte offsets (the logs cursor).
#[derive(Default)]
pub struct LogBuf {
    base: u64,
    data: Vec<u8>,
}

impl LogBuf {
    pub fn push(&mut self, bytes: &[u8]) {
        self.data.extend_from_slice(bytes);
        if self.data.len() > BACKGROUND_LOG_CAP {
            // Drop a quarter at once to keep this amortized.
            let drop = self.data.len() - BACKGROUND_LOG_CAP + BACKGROUND_LOG_CAP / 4;
            self.data.drain(..drop);
            self.base += drop as u64;
        }
    }
    /// Bytes from `cursor` on (clamped to what is kept) and the next cursor.
    pub fn read(&self, cursor: u64) -> (&[u8], u64) {
        let end = self.base + self.data.len() as u64;
        let start = cursor.clamp(self.base, end);
        (&self.data[(start - self.base) as usize..], end)
    }
    pub fn len(&self) -> usize {
        self.data.len()
    }
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

#[derive(Default)]
pub struct RecState {
    pub pgid: i32,
    pub running: bool,
    pub exit_code: Option<i32>,
    pub error: Option<String>,
    pub finished_at: Option<SystemTime>,
    pub log: LogBuf,
}

/// What execd remembers about a command.
pub struct CommandRecord {
    pub id: String,
    pub content: String,
    pub background: bool,
    pub started_at: SystemTime,
    pub state: Mutex<RecState>,
    pub done: watch::Sender<bool>,
}

impl CommandRecord {
    /// A running command, with a fresh id.
    fn started(content: &str, background: bool) -> Self {
        let (done, _) = watch::channel(false);
        Self {
            id: new_id(),
            content: content.to_string(),
            background,
            started_at: SystemTime::now(),
            state: Mutex::new(RecState {
                running: true,
                ..Default::default()
            }),
            done,
        }
    }
    pub fn lock(&self) -> std::sync::MutexGuard<'_, RecState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub fn finish(&self, code: i32, error: Option<String>) {
        {
            let mut s = self.lock();
            s.running = false;
            s.exit_code = Some(code);
            s.error = error;
            s.finished_at = Some(SystemTime::now());
        }
        self.done.send_replace(true);
    }
}

#[derive(Serialize)]
struct StatusResponse<'a> {
    id: &'a str,
    content: &'a str,
    running: bool,
    exit_code: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<&'a str>,
    started_at: String,
    finished_at: Option<String>,
}

/// A validated, ready-to-spawn command.
pub struct Prepared {
    pub spec: SpawnSpec,
    pub content: String,
    pub timeout: Option<Duration>,
}

/// Checks a timeout in milliseconds (0 or absent = none).
pub fn parse_timeout(ms: Option<i64>) -> Result<Option<Duration>, ApiError> {
    match ms {
        None | Some(0) => Ok(None),
        Some(t) if t < 0 => Err(ApiError::bad_request("timeout must not be negative")),
        Some(t) => Ok(Some(Duration::from_millis(t as u64))),
    }
}

fn check_env_name(k: &str) -> Result<(), ApiError> {
    if k.is_empty() || k.contains('=') || k.contains('\0') {
        return Err(ApiError::bad_request(format!(
            "invalid environment variable name {k:?}"
        )));
    }
    Ok(())
}

/// Environment of a new user process: execd's environment (without its own secrets), then
/// the `EXECD_ENVS` file, then the request's variables.
pub fn build_env(
    state: &AppState,
    extra: Option<&HashMap<String, String>>,
) -> Result<BTreeMap<OsString, OsString>, ApiError> {
    let mut env: BTreeMap<OsString, OsString> = state.base_env().iter().cloned().collect();
    for (k, v) in state.env_file_entries() {
        env.insert(k.into(), v.into());
    }
    if let Some(extra) = extra {
        for (k, v) in extra {
            check_env_name(k)?;
            if v.contains('\0') {
                return Err(ApiError::bad_request(format!(
                    "environment variable {k} contains NUL"
                )));
            }
            env.insert(k.into(), v.into());
        }
    }
    Ok(env)
}

/// Expands `$NAME`, `${NAME}` (from `env`) and a leading `~` (daemon home) in a cwd.
pub fn expand_cwd(raw: &str, env: &BTreeMap<OsString, OsString>) -> Result<PathBuf, ApiError> {
    if raw.contains('\0') {
        return Err(ApiError::bad_request("cwd must not contain NUL bytes"));
    }
    let mut out: Vec<u8> = Vec::with_capacity(raw.len());
    let b = raw.as_bytes();
    let mut i = 0;
    if raw == "~" || raw.starts_with("~/") {
        let home = std::env::var_os("HOME").unwrap_or_else(|| "/".into());
        out.extend_from_slice(home.as_bytes());
        i = 1;
    }
    while i < b.len() {
        if b[i] == b'$' {
            let (name, next) = if b.get(i + 1) == Some(&b'{') {
                match raw[i + 2..].find('}') {
                    Some(end) => (&raw[i + 2..i + 2 + end], i + 3 + end),
                    None => {
                        return Err(ApiError::bad_request(format!(
                            "invalid cwd {raw:?}: unclosed ${{"
                        )));
                    }
                }
            } else {
                let len = raw[i + 1..]
                    .bytes()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == b'_')
                    .count();
                (&raw[i + 1..i + 1 + len], i + 1 + len)
            };
            if name.is_empty() {
                out.push(b'$');
                i += 1;
                continue;
            }
            match env.get(OsStr::new(name)) {
                Some(v) => out.extend_from_slice(v.as_bytes()),
                None => {
                    return Err(ApiError::bad_request(format!(
                        "invalid cwd {raw:?}: variable {name} is not defined"
                    )));
                }
            }
            i = next;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    let p = PathBuf::from(OsString::from_vec(out));
    let p = if p.is_absolute() {
        p
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| "/".into())
            .join(p)
    };
    Ok(crate::util::normalize(&p))
}

/// Checks that `dir` is an existing directory.
pub fn check_dir(dir: &Path) -> Result<(), ApiError> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(ApiError::bad_request(format!(
            "cwd {} is not a directory",
            dir.display()
        ))),
        Err(e) => Err(ApiError::bad_request(format!("cwd {}: {e}", dir.display()))),
    }
}

/// Resolves `uid`/`gid` to an identity switch (`None` when it is execd's own).
pub fn resolve_identity(
    uid: Option<i64>,
    gid: Option<i64>,
    env: &mut BTreeMap<OsString, OsString>,
    user_env: &HashMap<String, String>,
) -> Result<Option<Identity>, ApiError> {
    let check = |v: i64, what: &str| -> Result<u32, ApiError> {
        if (0..=u32::MAX as i64 - 1).contains(&v) {
            Ok(v as u32)
        } else {
            Err(ApiError::bad_request(format!("{what} out of range: {v}")))
        }
    };
    let uid = uid.map(|u| check(u, "uid")).transpose()?;
    let gid = gid.map(|g| check(g, "gid")).transpose()?;
    let Some(uid) = uid else {
        if gid.is_some() {
            return Err(ApiError::bad_request("gid requires uid"));
        }
        return Ok(None);
    };
    // SAFETY: plain getters.
    let (me_u, me_g) = unsafe { (libc::geteuid(), libc::getegid()) };
    let db = UserDb::load();
    let user = db.user_by_uid(uid).cloned();
    let gid = gid.or(user.as_ref().map(|u| u.gid)).unwrap_or(uid);
    if uid == me_u && gid == me_g {
        return Ok(None);
    }
    let groups = match &user {
        Some(u) => db.groups_of(&u.name, gid),
        None => vec![gid],
    };
    if let Some(u) = &user {
        for (k, v) in [
            ("HOME", u.home.as_str()),
            ("USER", u.name.as_str()),
            ("LOGNAME", u.name.as_str()),
        ] {
            if !user_env.contains_key(k) && !v.is_empty() {
                env.insert(k.into(), v.into());
            }
        }
    }
    Ok(Some(Identity { uid, gid, groups }))
}

/// Validates a `RunCommandRequest` and builds the spawn description.
pub fn prepare(state: &AppState, req: &RunCommandRequest) -> Result<Prepared, ApiError> {
    let timeout = parse_timeout(req.timeout)?;
    let empty = HashMap::new();
    let user_env = req.envs.as_ref().unwrap_or(&empty);
    let mut env = build_env(state, Some(user_env))?;
    let identity = resolve_identity(req.uid, req.gid, &mut env, user_env)?;
    let cwd = match req.cwd.as_deref().filter(|c| !c.is_empty()) {
        Some(c) => {
            let p = expand_cwd(c, &env)?;
            check_dir(&p)?;
            Some(p)
        }
        None => None,
    };
    let path_var = env.get(OsStr::new("PATH")).cloned();
    let (program, args, content) = match (&req.command, &req.argv) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(
                "give either command or argv, not both",
            ));
        }
        (None, None) => return Err(ApiError::bad_request("missing command (or argv)")),
        (Some(cmd), None) => {
            if cmd.trim().is_empty() {
                return Err(ApiError::bad_request("command must not be empty"));
            }
            if cmd.contains('\0') {
                return Err(ApiError::bad_request("command must not contain NUL bytes"));
            }
            let shell = process::find_shell(path_var.as_deref()).ok_or_else(|| {
                ApiError::bad_request("no shell (bash or sh) in PATH to run `command`; use `argv` to run a program without a shell")
            })?;
            (
                shell.into_os_string(),
                vec![OsString::from("-c"), OsString::from(cmd)],
                cmd.clone(),
            )
        }
        (None, Some(argv)) => {
            let Some(first) = argv.first().filter(|a| !a.is_empty()) else {
                return Err(ApiError::bad_request("argv needs a non-empty executable"));
            };
            if argv.iter().any(|a| a.contains('\0')) {
                return Err(ApiError::bad_request("argv must not contain NUL bytes"));
            }
            let program = if first.contains('/') {
                let p = PathBuf::from(first);
                if p.is_absolute() {
                    p
                } else {
                    cwd.clone()
                        .unwrap_or_else(|| std::env::current_dir().unwrap_or_else(|_| "/".into()))
                        .join(p)
                }
            } else {
                // Unknown names fail at spawn (reported as exit 127, like a shell).
                process::find_in_path(first, path_var.as_deref())
                    .unwrap_or_else(|| PathBuf::from(first))
            };
            let content = argv
                .iter()
                .map(|a| shell_quote(a))
                .collect::<Vec<_>>()
                .join(" ");
            (
                program.into_os_string(),
                argv[1..].iter().map(OsString::from).collect(),
                content,
            )
        }
    };
    let mut spec = SpawnSpec::new(program);
    spec.args = args;
    spec.env = env.into_iter().collect();
    spec.cwd = cwd;
    spec.identity = identity;
    Ok(Prepared {
        spec,
        content,
        timeout,
    })
}

/// How a streamed process ended.
pub struct Outcome {
    pub status: Option<ExitStatus>,
    pub timed_out: bool,
    pub client_gone: bool,
}

/// Which output pipe of a child a chunk came from.
#[derive(Clone, Copy)]
enum Pipe {
    Stdout,
    Stderr,
}

/// Read buffers of a child's two output pipes.
struct PipeBufs {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
}

impl PipeBufs {
    fn new() -> Self {
        Self {
            stdout: vec![0u8; 32 * 1024],
            stderr: vec![0u8; 32 * 1024],
        }
    }

    /// Waits for the next chunk of either pipe; a pipe at its end (or failing) is
    /// closed (set to `None`). `None` once both are closed. Cancel-safe.
    async fn next(&mut self, sp: &mut OutputPipes<'_>) -> Option<(Pipe, usize)> {
        while sp.stdout.is_some() || sp.stderr.is_some() {
            tokio::select! {
                r = process::read_opt(sp.stdout, &mut self.stdout) => match r {
                    Ok(n) if n > 0 => return Some((Pipe::Stdout, n)),
                    _ => *sp.stdout = None,
                },
                r = process::read_opt(sp.stderr, &mut self.stderr) => match r {
                    Ok(n) if n > 0 => return Some((Pipe::Stderr, n)),
                    _ => *sp.stderr = None,
                },
            }
        }
        None
    }

    /// What remains buffered in the pipes after the leader exited: chunks until both
    /// close, 25 ms pass without output or `until` passes. Descendants that keep the
    /// pipes open (e.g. `server &`) are not waited for.
    async fn next_leftover(
        &mut self,
        sp: &mut OutputPipes<'_>,
        until: tokio::time::Instant,
    ) -> Option<(Pipe, usize)> {
        if tokio::time::Instant::now() >= until {
            return None;
        }
        tokio::select! {
            r = self.next(sp) => r,
            _ = tokio::time::sleep(Duration::from_millis(25)) => None,
        }
    }

    fn chunk(&self, pipe: Pipe, n: usize) -> &[u8] {
        match pipe {
            Pipe::Stdout => &self.stdout[..n],
            Pipe::Stderr => &self.stderr[..n],
        }
    }
}

/// The output pipes of a [`Spawned`], borrowed apart from its exit status so both can
/// be waited for at once.
struct OutputPipes<'a> {
    stdout: &'a mut Option<tokio::net::unix::pipe::Receiver>,
    stderr: &'a mut Option<tokio::net::unix::pipe::Receiver>,
}

/// How long output still buffered after the leader's exit is collected.
const LEFTOVER_OUTPUT_WAIT: Duration = Duration::from_millis(250);

/// Sleeps until `deadline`; never returns without one.
async fn sleep_until_deadline(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Sends a process's output as events, line by line. A client that went away gets
/// nothing more and costs the process group its life.
struct EventForwarder<'a> {
    tx: &'a EventTx,
    pgid: i32,
    gone: bool,
    stdout: LineChunker,
    stderr: LineChunker,
}

impl EventForwarder<'_> {
    async fn emit(&mut self, ev: Event) {
        if !self.gone && !self.tx.send(ev).await {
            self.client_gone();
        }
    }

    fn client_gone(&mut self) {
        self.gone = true;
        process::kill_group(self.pgid, libc::SIGKILL);
    }

    async fn output(&mut self, pipe: Pipe, data: &[u8]) {
        let text = match pipe {
            Pipe::Stdout => self.stdout.push(data).map(Event::stdout),
            Pipe::Stderr => self.stderr.push(data).map(Event::stderr),
        };
        if let Some(ev) = text {
            self.emit(ev).await;
        }
    }

    /// Sends the last, unterminated lines.
    async fn flush(&mut self) {
        if let Some(t) = self.stdout.flush() {
            self.emit(Event::stdout(t)).await;
        }
        if let Some(t) = self.stderr.flush() {
            self.emit(Event::stderr(t)).await;
        }
    }
}

/// Forwards a process's output as events until it exits (keep-alive pings, timeout,
/// client disconnect: the last two kill its process group).
pub async fn stream_process(sp: &mut Spawned, tx: &EventTx, timeout: Option<Duration>) -> Outcome {
    let pgid = sp.pid;
    let mut fwd = EventForwarder {
        tx,
        pgid,
        gone: false,
        stdout: LineChunker::default(),
        stderr: LineChunker::default(),
    };
    let mut bufs = PipeBufs::new();
    let mut pipes = OutputPipes {
        stdout: &mut sp.stdout,
        stderr: &mut sp.stderr,
    };
    let mut ping =
        tokio::time::interval_at(tokio::time::Instant::now() + PING_INTERVAL, PING_INTERVAL);
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let mut timed_out = false;
    let status = loop {
        tokio::select! {
            Some((pipe, n)) = bufs.next(&mut pipes) => fwd.output(pipe, bufs.chunk(pipe, n)).await,
            s = &mut sp.exit => break s.ok(),
            _ = ping.tick() => fwd.emit(Event::ping()).await,
            _ = sleep_until_deadline(deadline), if !timed_out => {
                timed_out = true;
                process::kill_group(pgid, libc::SIGKILL);
            }
            _ = tx.closed(), if !fwd.gone => fwd.client_gone(),
        }
    };
    let until = tokio::time::Instant::now() + LEFTOVER_OUTPUT_WAIT;
    while let Some((pipe, n)) = bufs.next_leftover(&mut pipes, until).await {
        fwd.output(pipe, bufs.chunk(pipe, n)).await;
    }
    fwd.flush().await;
    Outcome {
        status,
        timed_out,
        client_gone: fwd.gone,
    }
}

/// The exit code and message of an outcome.
pub fn outcome_code(o: &Outcome, timeout: Option<Duration>) -> (i32, Option<String>) {
    let code = o.status.as_ref().map(process::exit_code).unwrap_or(255);
    if o.client_gone && o.status.as_ref().is_none_or(|s| !s.success()) {
        return (code, Some("client disconnected; command was killed".into()));
    }
    if o.timed_out {
        let ms = timeout.map(|t| t.as_millis()).unwrap_or(0);
        return (
            code,
            Some(format!("command timed out after {ms} ms and was killed")),
        );
    }
    match &o.status {
        Some(s) if s.success() => (0, None),
        Some(s) => {
            use std::os::unix::process::ExitStatusExt;
            let msg = match s.signal() {
                Some(sig) => format!("command was killed by signal {sig}"),
                None => format!("command exited with code {code}"),
            };
            (code, Some(msg))
        }
        None => (255, Some("lost track of the command's exit status".into())),
    }
}

/// Spawn errors reported like a shell would: 127 not found, 126 not executable.
pub fn spawn_failure(program: &OsStr, err: &std::io::Error) -> (i32, String) {
    let name = program.to_string_lossy();
    match err.kind() {
        std::io::ErrorKind::NotFound => (127, format!("execd: {name}: command not found")),
        std::io::ErrorKind::PermissionDenied => (126, format!("execd: {name}: permission denied")),
        _ => (126, format!("execd: cannot start {name}: {err}")),
    }
}

pub fn new_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// `POST /command`
#[tracing::instrument(skip_all, fields(command_id = tracing::field::Empty))]
pub async fn run_command(
    State(state): State<AppState>,
    JsonBody(req): JsonBody<RunCommandRequest>,
) -> ApiResult<Response> {
    let prepared = prepare(&state, &req)?;
    let background = req.background.unwrap_or(false);
    let record = Arc::new(CommandRecord::started(&prepared.content, background));
    tracing::Span::current().record("command_id", record.id.as_str());
    state.insert_command(record.clone());
    let program = prepared.spec.program.clone();
    let timeout = prepared.timeout;
    let started = Instant::now();
    let spawned = process::spawn(state.reaper(), prepared.spec);
    let (tx, resp) = sse::stream();
    match spawned {
        Err(e) => report_spawn_failure(record, &program, &e, tx),
        Ok(sp) => {
            record.lock().pgid = sp.pid;
            if background {
                tokio::spawn(async move {
                    tx.send(Event::init(&record.id)).await;
                    tx.send(Event::complete(started.elapsed().as_millis() as i64))
                        .await;
                    drop(tx);
                    run_background(record, sp, timeout).await;
                });
            } else {
                tokio::spawn(run_foreground(record, sp, tx, timeout, started));
            }
        }
    }
    Ok(resp)
}

/// A command that could not start: finished with the shell's code (127, 126) and,
/// in the foreground, the message on the stream.
fn report_spawn_failure(
    record: Arc<CommandRecord>,
    program: &OsStr,
    err: &std::io::Error,
    tx: EventTx,
) {
    let (code, msg) = spawn_failure(program, err);
    record.finish(code, Some(msg.clone()));
    if record.background {
        record.lock().log.push(format!("{msg}\n").as_bytes());
    }
    tokio::spawn(async move {
        tx.send(Event::init(&record.id)).await;
        if record.background {
            tx.send(Event::complete(0)).await;
        } else {
            tx.send(Event::stderr(format!("{msg}\n"))).await;
            tx.send(Event::error(code, msg)).await;
        }
    });
}

/// Streams a foreground command until it exits and records how it ended.
async fn run_foreground(
    record: Arc<CommandRecord>,
    mut sp: Spawned,
    tx: EventTx,
    timeout: Option<Duration>,
    started: Instant,
) {
    tx.send(Event::init(&record.id)).await;
    let outcome = stream_process(&mut sp, &tx, timeout).await;
    let (code, msg) = outcome_code(&outcome, timeout);
    record.finish(code, msg.clone());
    send_last_event(&tx, &outcome, code, msg, started).await;
}

/// The stream's last event: `complete` for a clean exit, else `error`.
pub async fn send_last_event(
    tx: &EventTx,
    outcome: &Outcome,
    code: i32,
    msg: Option<String>,
    started: Instant,
) {
    if code == 0 && !outcome.timed_out {
        tx.send(Event::complete(started.elapsed().as_millis() as i64))
            .await;
    } else {
        tx.send(Event::error(code, msg.unwrap_or_default())).await;
    }
}

/// Collects a background command's combined output until it exits.
async fn run_background(record: Arc<CommandRecord>, mut sp: Spawned, timeout: Option<Duration>) {
    let pgid = sp.pid;
    let mut bufs = PipeBufs::new();
    let mut pipes = OutputPipes {
        stdout: &mut sp.stdout,
        stderr: &mut sp.stderr,
    };
    let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
    let mut timed_out = false;
    let status = loop {
        tokio::select! {
            Some((pipe, n)) = bufs.next(&mut pipes) => record.lock().log.push(bufs.chunk(pipe, n)),
            s = &mut sp.exit => break s.ok(),
            _ = sleep_until_deadline(deadline), if !timed_out => {
                timed_out = true;
                process::kill_group(pgid, libc::SIGKILL);
            }
        }
    };
    let until = tokio::time::Instant::now() + LEFTOVER_OUTPUT_WAIT;
    while let Some((pipe, n)) = bufs.next_leftover(&mut pipes, until).await {
        record.lock().log.push(bufs.chunk(pipe, n));
    }
    let outcome = Outcome {
        status,
        timed_out,
        client_gone: false,
    };
    let (code, msg) = outcome_code(&outcome, timeout);
    record.finish(code, msg);
}

/// `DELETE /command?id=`
#[tracing::instrument(skip_all, fields(command_id = q.get("id").unwrap_or_default()))]
pub async fn interrupt(State(state): State<AppState>, q: Query) -> ApiResult<StatusCode> {
    let Some(id) = q.get("id").filter(|s| !s.is_empty()) else {
        return Err(ApiError::missing_query("id"));
    };
    if let Some(rec) = state.command(id) {
        interrupt_record(&rec).await;
        return Ok(StatusCode::OK);
    }
    if let Some(session) = state.session(id) {
        session.interrupt();
        return Ok(StatusCode::OK);
    }
    Err(ApiError::not_found(
        code::CONTEXT_NOT_FOUND,
        format!("no command or session {id}"),
    ))
}

/// SIGTERM to the command's process group, SIGKILL if it is still there after 2 s.
pub async fn interrupt_record(rec: &CommandRecord) {
    let pgid = {
        let s = rec.lock();
        if !s.running {
            return;
        }
        s.pgid
    };
    let mut done = rec.done.subscribe();
    process::kill_group(pgid, libc::SIGTERM);
    let finished = matches!(
        tokio::time::timeout(Duration::from_secs(2), done.wait_for(|d| *d)).await,
        Ok(Ok(_))
    );
    if !finished {
        process::kill_group(pgid, libc::SIGKILL);
        let _ = tokio::time::timeout(Duration::from_secs(2), done.wait_for(|d| *d)).await;
    } else {
        // The leader is gone; make sure nothing else of the group survives.
        process::kill_group(pgid, libc::SIGKILL);
    }
}

/// `GET /command/status/{id}`
#[tracing::instrument(skip_all, fields(command_id = %id))]
pub async fn status(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
) -> ApiResult<Response> {
    let rec = command_record(&state, &id)?;
    let s = rec.lock();
    let body = StatusResponse {
        id: &rec.id,
        content: &rec.content,
        running: s.running,
        exit_code: s.exit_code,
        error: s.error.as_deref(),
        started_at: rfc3339(rec.started_at),
        finished_at: s.finished_at.map(rfc3339),
    };
    Ok(axum::Json(body).into_response())
}

fn command_record(state: &AppState, id: &str) -> Result<Arc<CommandRecord>, ApiError> {
    state.command(id).ok_or_else(|| {
        ApiError::not_found(code::CONTEXT_NOT_FOUND, format!("command not found: {id}"))
    })
}

/// `GET /command/{id}/logs?cursor=`: the cursor is a byte offset into the command's
/// combined output; the answer's `EXECD-COMMANDS-TAIL-CURSOR` is the next one.
#[tracing::instrument(skip_all, fields(command_id = %id))]
pub async fn logs(
    State(state): State<AppState>,
    UrlPath(id): UrlPath<String>,
    q: Query,
) -> ApiResult<Response> {
    let cursor = q.int::<i64>("cursor")?.unwrap_or(0);
    if cursor < 0 {
        return Err(ApiError::bad_request("cursor must not be negative"));
    }
    let rec = command_record(&state, &id)?;
    if !rec.background {
        return Err(ApiError::bad_request(format!(
            "command {id} is not a background command; its output was streamed"
        )));
    }
    let (data, next) = {
        let s = rec.lock();
        let (d, n) = s.log.read(cursor as u64);
        (d.to_vec(), n)
    };
    let mut resp = Response::new(Body::from(data));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    h.insert("EXECD-COMMANDS-TAIL-CURSOR", HeaderValue::from(next));
    Ok(resp)
}

/// Forgets old finished commands (see the limits above).
pub fn prune(map: &mut HashMap<String, Arc<CommandRecord>>) {
    let now = SystemTime::now();
    let mut finished: Vec<(SystemTime, String, usize)> = Vec::new();
    map.retain(|_, rec| {
        let s = rec.lock();
        match s.finished_at {
            Some(t) if now.duration_since(t).unwrap_or_default() > FINISHED_TTL => false,
            Some(t) => {
                finished.push((t, rec.id.clone(), s.log.len()));
                true
            }
            None => true,
        }
    });
    finished.sort();
    let mut total: usize = finished.iter().map(|f| f.2).sum();
    let mut count = finished.len();
    for (_, id, len) in finished {
        if count <= MAX_FINISHED && total <= FINISHED_LOG_BUDGET {
            break;
        }
        map.remove(&id);
        count -= 1;
        total -= len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_cursor() {
        let mut l = LogBuf::default();
        l.push(b"hello\n");
        assert_eq!(l.read(0), (&b"hello\n"[..], 6));
        assert_eq!(l.read(3), (&b"lo\n"[..], 6));
        assert_eq!(l.read(99), (&b""[..], 6));
        l.push(&vec![b'x'; BACKGROUND_LOG_CAP]);
        let (d, n) = l.read(0);
        assert_eq!(n, 6 + BACKGROUND_LOG_CAP as u64);
        assert!(d.len() <= BACKGROUND_LOG_CAP);
        assert_eq!(n - d.len() as u64, l.base);
    }

    #[test]
    fn cwd_expansion() {
        let mut env = BTreeMap::new();
        env.insert(OsString::from("W"), OsString::from("/work"));
        assert_eq!(expand_cwd("$W/a", &env).unwrap(), PathBuf::from("/work/a"));
        assert_eq!(expand_cwd("${W}x/..", &env).unwrap(), PathBuf::from("/"));
        assert!(expand_cwd("$NOPE", &env).is_err());
        assert!(expand_cwd("${W", &env).is_err());
        assert_eq!(expand_cwd("/a$", &env).unwrap(), PathBuf::from("/a$"));
    }

    #[test]
    fn timeouts() {
        assert_eq!(parse_timeout(None).unwrap(), None);
        assert_eq!(parse_timeout(Some(0)).unwrap(), None);
        assert_eq!(
            parse_timeout(Some(1500)).unwrap(),
            Some(Duration::from_millis(1500))
        );
        assert!(parse_timeout(Some(-1)).is_err());
    }
}
