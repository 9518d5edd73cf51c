//! Shared daemon state: the reaper, commands, sessions, environment.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};

use crate::commands::{self, CommandRecord};
use crate::metrics::CpuSampler;
use crate::process::Reaper;
use crate::session::Session;

/// Environment variables that configure execd itself and never reach user processes.
pub const PRIVATE_ENV: &[&str] = &["EXECD_ACCESS_TOKEN", "EXECD_LISTEN"];

/// What a router needs to know (see [`AppState::new`]).
#[derive(Clone, Debug, Default)]
pub struct StateConfig {
    /// Required `X-EXECD-ACCESS-TOKEN`; `None` leaves the API open.
    pub access_token: Option<String>,
    /// Environment handed to user processes (execd's own, minus [`PRIVATE_ENV`]).
    pub base_env: Vec<(OsString, OsString)>,
    /// `EXECD_ENVS`: a `KEY=VALUE` file re-read for every command and session.
    pub env_file: Option<PathBuf>,
}

impl StateConfig {
    /// From the current process environment.
    pub fn from_env(access_token: Option<String>) -> Self {
        Self::from_vars(access_token, std::env::vars_os())
    }

    /// From a whole environment (execd's own at start, or the one a warm claim brings):
    /// [`PRIVATE_ENV`] is dropped, `EXECD_ENVS` names the env file.
    pub fn from_vars(
        access_token: Option<String>,
        vars: impl IntoIterator<Item = (OsString, OsString)>,
    ) -> Self {
        let base_env = vars
            .into_iter()
            .filter(|(k, _)| !PRIVATE_ENV.iter().any(|p| k == p))
            .collect::<Vec<_>>();
        let env_file = base_env
            .iter()
            .rev()
            .find(|(k, v)| k == "EXECD_ENVS" && !v.is_empty())
            .map(|(_, v)| PathBuf::from(v));
        Self {
            access_token,
            base_env,
            env_file,
        }
    }

    /// Makes the env file visible to user processes (the SDK's `set_env` appends to the
    /// file `EXECD_ENVS` names).
    pub fn export_env_file(&mut self) {
        if let Some(f) = &self.env_file {
            self.base_env.retain(|(k, _)| k != "EXECD_ENVS");
            self.base_env
                .push(("EXECD_ENVS".into(), f.clone().into_os_string()));
        }
    }
}

/// The part of the configuration a warm claim replaces (see [`AppState::claim`]).
struct Live {
    access_token: Option<Arc<str>>,
    base_env: Arc<Vec<(OsString, OsString)>>,
    env_file: Option<PathBuf>,
}

impl From<StateConfig> for Live {
    fn from(cfg: StateConfig) -> Self {
        Self {
            access_token: cfg.access_token.map(Arc::from),
            base_env: Arc::new(cfg.base_env),
            env_file: cfg.env_file,
        }
    }
}

/// The entrypoint a claim hands to the main loop, and where the loop answers.
pub struct ClaimedEntrypoint {
    /// Program and arguments (the program is looked up in the claimed `PATH`).
    pub argv: Vec<OsString>,
    /// The entrypoint's environment: the new base environment.
    pub env: Vec<(OsString, OsString)>,
    /// The entrypoint's (and execd's) working directory.
    pub cwd: Option<PathBuf>,
    /// The entrypoint's pid, or why it could not be started.
    pub reply: tokio::sync::oneshot::Sender<Result<i32, String>>,
}

/// Warm mode: waiting for the one claim, or past it.
enum Warm {
    Waiting(tokio::sync::oneshot::Sender<ClaimedEntrypoint>),
    Claimed,
}

/// Why a claim changed nothing.
#[derive(Debug)]
pub enum ClaimError<E> {
    /// This daemon was not started with `--warm`.
    NotWarm,
    /// Another claim got there first.
    AlreadyClaimed,
    /// The request was refused by its own validation.
    Invalid(E),
}

struct Inner {
    reaper: Arc<Reaper>,
    live: RwLock<Live>,
    /// `None` outside warm mode.
    warm: Mutex<Option<Warm>>,
    commands: Mutex<HashMap<String, Arc<CommandRecord>>>,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    cpu: Mutex<CpuSampler>,
}

/// Cheaply clonable handle on the daemon state.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

impl AppState {
    /// New state; must be called inside a Tokio runtime (starts the reaper task).
    pub fn new(cfg: StateConfig) -> Self {
        // SAFETY: plain getter.
        let pid1 = unsafe { libc::getpid() } == 1;
        Self::with_reaper(cfg, Reaper::start(pid1))
    }

    pub fn with_reaper(cfg: StateConfig, reaper: Arc<Reaper>) -> Self {
        Self(Arc::new(Inner {
            reaper,
            live: RwLock::new(cfg.into()),
            warm: Mutex::new(None),
            commands: Mutex::new(HashMap::new()),
            sessions: Mutex::new(HashMap::new()),
            cpu: Mutex::new(CpuSampler::default()),
        }))
    }

    pub fn reaper(&self) -> &Reaper {
        &self.0.reaper
    }

    fn live(&self) -> std::sync::RwLockReadGuard<'_, Live> {
        self.0.live.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The token requests must carry now (a warm claim replaces it).
    pub fn access_token(&self) -> Option<Arc<str>> {
        self.live().access_token.clone()
    }
    /// The environment user processes start from (a warm claim replaces it).
    pub fn base_env(&self) -> Arc<Vec<(OsString, OsString)>> {
        self.live().base_env.clone()
    }

    /// Puts this daemon in warm mode: the one successful [`AppState::claim`] sends its
    /// entrypoint to `entrypoint`.
    pub fn enable_warm(&self, entrypoint: tokio::sync::oneshot::Sender<ClaimedEntrypoint>) {
        *self.0.warm.lock().unwrap_or_else(|e| e.into_inner()) = Some(Warm::Waiting(entrypoint));
    }

    /// Claims a warm daemon: checks that it is still waiting, then lets `prepare`
    /// validate the request and build the new configuration (its error leaves the daemon
    /// waiting), then replaces token and environment and hands back what `prepare` made
    /// with the sender for the entrypoint. All under one lock, so of concurrent claims
    /// exactly one gets past the check, and none sees a half-replaced configuration.
    pub fn claim<T, E>(
        &self,
        prepare: impl FnOnce() -> Result<(T, StateConfig), E>,
    ) -> Result<(T, tokio::sync::oneshot::Sender<ClaimedEntrypoint>), ClaimError<E>> {
        let mut warm = self.0.warm.lock().unwrap_or_else(|e| e.into_inner());
        match warm.as_ref() {
            None => return Err(ClaimError::NotWarm),
            Some(Warm::Claimed) => return Err(ClaimError::AlreadyClaimed),
            Some(Warm::Waiting(_)) => {}
        }
        let (value, cfg) = prepare().map_err(ClaimError::Invalid)?;
        let Some(Warm::Waiting(tx)) = warm.replace(Warm::Claimed) else {
            unreachable!("checked above under the same lock");
        };
        *self.0.live.write().unwrap_or_else(|e| e.into_inner()) = cfg.into();
        Ok((value, tx))
    }

    /// The env file user processes read (a warm claim may name another).
    pub fn env_file(&self) -> Option<PathBuf> {
        self.live().env_file.clone()
    }

    /// Entries of the `EXECD_ENVS` file (empty when unset or unreadable).
    pub fn env_file_entries(&self) -> Vec<(String, String)> {
        match &self.env_file() {
            Some(p) => std::fs::read_to_string(p)
                .map(|t| parse_env_file(&t))
                .unwrap_or_default(),
            None => Vec::new(),
        }
    }

    pub fn insert_command(&self, rec: Arc<CommandRecord>) {
        let mut map = self.0.commands.lock().unwrap_or_else(|e| e.into_inner());
        commands::prune(&mut map);
        map.insert(rec.id.clone(), rec);
    }
    pub fn command(&self, id: &str) -> Option<Arc<CommandRecord>> {
        let map = self.0.commands.lock().unwrap_or_else(|e| e.into_inner());
        map.get(id).cloned()
    }

    pub fn insert_session(&self, s: Arc<Session>) {
        let mut map = self.0.sessions.lock().unwrap_or_else(|e| e.into_inner());
        map.insert(s.id.clone(), s);
    }
    pub fn session(&self, id: &str) -> Option<Arc<Session>> {
        let map = self.0.sessions.lock().unwrap_or_else(|e| e.into_inner());
        map.get(id).cloned()
    }
    pub fn remove_session(&self, id: &str) -> Option<Arc<Session>> {
        let mut map = self.0.sessions.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(id)
    }

    pub fn cpu(&self) -> std::sync::MutexGuard<'_, CpuSampler> {
        self.0.cpu.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Parses an `EXECD_ENVS` file: `KEY=value` (trimmed), `KEY='literal, may span lines'`,
/// `KEY="with \n \t \\ \" escapes"`; blank lines and `#` comments are skipped, malformed
/// lines ignored.
pub fn parse_env_file(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let (line, after) = match rest.find('\n') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        let trimmed = line.trim();
        if trimmed.is_empty() || trimmed.starts_with('#') {
            rest = after;
            continue;
        }
        let Some(eq) = line.find('=') else {
            rest = after;
            continue;
        };
        let key = line[..eq].trim().trim_start_matches("export ").trim();
        let valid_key = !key.is_empty()
            && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !key.as_bytes()[0].is_ascii_digit();
        let value_part = &rest[eq + 1..];
        let v = value_part.trim_start_matches([' ', '\t']);
        let skipped = value_part.len() - v.len();
        match v.as_bytes().first() {
            Some(&q @ (b'\'' | b'"')) => {
                let body = &v[1..];
                let mut value = String::new();
                let mut end = None;
                let mut chars = body.char_indices();
                while let Some((i, c)) = chars.next() {
                    if c as u32 == q as u32 {
                        end = Some(i);
                        break;
                    }
                    if q == b'"' && c == '\\' {
                        match chars.next() {
                            Some((_, 'n')) => value.push('\n'),
                            Some((_, 'r')) => value.push('\r'),
                            Some((_, 't')) => value.push('\t'),
                            Some((_, e @ ('\\' | '"'))) => value.push(e),
                            Some((_, e)) => {
                                value.push('\\');
                                value.push(e);
                            }
                            None => break,
                        }
                        continue;
                    }
                    value.push(c);
                }
                match end {
                    Some(i) => {
                        let consumed = eq + 1 + skipped + 1 + i + 1;
                        let tail = &rest[consumed..];
                        let next = tail.find('\n').map(|n| &tail[n + 1..]).unwrap_or("");
                        if valid_key {
                            out.push((key.to_string(), value));
                        }
                        rest = next;
                    }
                    None => rest = after, // unterminated: skip the line
                }
            }
            _ => {
                if valid_key {
                    out.push((key.to_string(), line[eq + 1..].trim().to_string()));
                }
                rest = after;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_file() {
        let text = "# c\nA=1\n B = two words \nC='multi\nline'\nD=\"x\\ny\\\"z\"\nbad\n9X=no\nE='it'\nF='open\n";
        let got = parse_env_file(text);
        assert_eq!(
            got,
            vec![
                ("A".into(), "1".into()),
                ("B".into(), "two words".into()),
                ("C".into(), "multi\nline".into()),
                ("D".into(), "x\ny\"z".into()),
                ("E".into(), "it".into()),
            ]
        );
    }
}
