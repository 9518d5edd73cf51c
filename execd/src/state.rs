//! Shared daemon state: the reaper, commands, sessions, environment.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

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
        let base_env = std::env::vars_os()
            .filter(|(k, _)| !PRIVATE_ENV.iter().any(|p| k == p))
            .collect::<Vec<_>>();
        let env_file = std::env::var_os("EXECD_ENVS")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
        Self {
            access_token,
            base_env,
            env_file,
        }
    }
}

struct Inner {
    reaper: Arc<Reaper>,
    cfg: StateConfig,
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
            cfg,
            commands: Mutex::new(HashMap::new()),
            sessions: Mutex::new(HashMap::new()),
            cpu: Mutex::new(CpuSampler::default()),
        }))
    }

    pub fn reaper(&self) -> &Reaper {
        &self.0.reaper
    }
    pub fn access_token(&self) -> Option<&str> {
        self.0.cfg.access_token.as_deref()
    }
    pub fn base_env(&self) -> &[(OsString, OsString)] {
        &self.0.cfg.base_env
    }

    /// Entries of the `EXECD_ENVS` file (empty when unset or unreadable).
    pub fn env_file_entries(&self) -> Vec<(String, String)> {
        match &self.0.cfg.env_file {
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
