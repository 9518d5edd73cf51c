//! The commands for people: sandboxes, named volumes and warm pools on a
//! lifecycle server (the OpenSandbox Lifecycle REST API), from a terminal
//! or a script. Nothing here reaches past that API: exec and cp go to the
//! sandbox's execd through the endpoint the server hands out, as the SDKs
//! do, so the CLI works against any server that speaks the API.

mod client;
mod config;
mod execd;
mod output;
pub(crate) mod pool;
pub(crate) mod sandbox;
pub(crate) mod volume;

use std::fmt;

pub(crate) use output::spinner;

/// What `--help` says about the connection and the exit codes, once for
/// every command group.
pub(crate) const CLIENT_HELP: &str = "\
Server and key: --server / --api-key, else SANDBOLT_SERVER / SANDBOLT_API_KEY,
else `server` / `api_key` in the config file (--config, SANDBOLT_CONFIG, or
$XDG_CONFIG_HOME/sandbolt/config.toml, ~/.config/sandbolt/config.toml when
XDG_CONFIG_HOME is unset), else http://127.0.0.1:8080 (what `sandbolt up`
serves) and no key.

Exit codes: 0 ok, 1 error, 2 usage (bad flags or config file), 3 not found,
4 unauthorized (missing or wrong API key), 5 server unreachable.
`sandbolt sandbox exec` exits with the command's own exit code.";

/// Exit codes a script can tell apart (see [`CLIENT_HELP`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    Error = 1,
    Usage = 2,
    NotFound = 3,
    Unauthorized = 4,
    Unreachable = 5,
}

/// A failure of a people command: what went wrong and what to do, and the
/// exit code that says which kind it was.
#[derive(Debug)]
pub(crate) struct Failure {
    pub exit: Exit,
    pub message: String,
}

impl Failure {
    pub fn new(exit: Exit, message: impl Into<String>) -> Self {
        Self {
            exit,
            message: message.into(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Failure {}

/// `sandbolt sandbox exec`'s command ended with this non-zero code: the
/// process exits with it and prints nothing more (the command said its
/// piece on stderr).
#[derive(Debug)]
pub(crate) struct CommandExit(pub u8);

impl fmt::Display for CommandExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the command exited with {}", self.0)
    }
}

impl std::error::Error for CommandExit {}

/// How the process ends on `e`: its exit code, and whether `e` is to be
/// printed.
pub(crate) fn exit_of(e: &anyhow::Error) -> (u8, bool) {
    if let Some(CommandExit(code)) = e.downcast_ref() {
        return (*code, false);
    }
    match e.downcast_ref::<Failure>() {
        Some(f) => (f.exit as u8, true),
        None => (Exit::Error as u8, true),
    }
}
