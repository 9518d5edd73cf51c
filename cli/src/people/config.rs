//! Where the lifecycle server is and which key opens it: flags, then the
//! environment (clap reads both), then the config file, then `sandbolt
//! up`'s default address.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{Exit, Failure};

/// What `sandbolt up` serves when told nothing.
pub(crate) const DEFAULT_SERVER: &str = "http://127.0.0.1:8080";

/// The connection flags every people command takes (global: they may come
/// before or after the subcommand).
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct ClientArgs {
    /// Lifecycle server URL (`http://host:port`, `https://…`, or
    /// `host:port`) [default: from the config file, else
    /// http://127.0.0.1:8080]
    #[arg(long, global = true, env = "SANDBOLT_SERVER")]
    pub server: Option<String>,
    /// API key the server asks for (sent as OPEN-SANDBOX-API-KEY)
    /// [default: from the config file, else none]
    #[arg(long, global = true, env = "SANDBOLT_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Config file (TOML: `server = "…"`, `api_key = "…"`) [default:
    /// $XDG_CONFIG_HOME/sandbolt/config.toml, or
    /// ~/.config/sandbolt/config.toml]
    #[arg(long, global = true, env = "SANDBOLT_CONFIG")]
    pub config: Option<PathBuf>,
    /// Print the API's JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
}

/// The config file's contents.
#[derive(Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    server: Option<String>,
    api_key: Option<String>,
}

/// Where to connect, settled.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Connection {
    /// `scheme://host[:port][/prefix]`, no trailing slash.
    pub server: String,
    pub api_key: Option<String>,
    /// The config file consulted, whether or not it exists (named in
    /// messages about the key or the server, so a person knows where a
    /// value came from or could go).
    pub config_file: Option<PathBuf>,
}

impl ClientArgs {
    /// Flags and environment first, then the config file, then defaults.
    pub fn connection(&self) -> Result<Connection, Failure> {
        let (file, path) = match self.config_path() {
            Some((path, explicit)) => (read_config(&path, explicit)?, Some(path)),
            None => (None, None),
        };
        let file = file.unwrap_or_default();
        let server = self
            .server
            .clone()
            .or(file.server)
            .unwrap_or_else(|| DEFAULT_SERVER.to_string());
        let api_key = self
            .api_key
            .clone()
            .or(file.api_key)
            .filter(|k| !k.is_empty());
        Ok(Connection {
            server: normalize_server(&server)?,
            api_key,
            config_file: path,
        })
    }

    /// The config file to read and whether it was named explicitly (a
    /// named file must exist; the default one may not).
    fn config_path(&self) -> Option<(PathBuf, bool)> {
        if let Some(p) = &self.config {
            return Some((p.clone(), true));
        }
        let dir = std::env::var_os("XDG_CONFIG_HOME")
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME")
                    .filter(|h| !h.is_empty())
                    .map(|h| PathBuf::from(h).join(".config"))
            })?;
        Some((dir.join("sandbolt").join("config.toml"), false))
    }
}

/// The config file at `path`; `None` when it does not exist and was not
/// named explicitly.
fn read_config(path: &Path, explicit: bool) -> Result<Option<ConfigFile>, Failure> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !explicit => return Ok(None),
        Err(e) => {
            return Err(Failure::new(
                Exit::Usage,
                format!("cannot read the config file {}: {e}", path.display()),
            ));
        }
    };
    toml::from_str(&text).map(Some).map_err(|e| {
        Failure::new(
            Exit::Usage,
            format!(
                "the config file {} is not valid (it takes `server = \"http://host:port\"` and \
                 `api_key = \"…\"`): {}",
                path.display(),
                e.message()
            ),
        )
    })
}

/// `server` with a scheme and without a trailing slash.
fn normalize_server(server: &str) -> Result<String, Failure> {
    let s = server.trim().trim_end_matches('/');
    if s.is_empty() {
        return Err(Failure::new(
            Exit::Usage,
            "the server is empty: give --server http://host:port (or SANDBOLT_SERVER)",
        ));
    }
    if s.starts_with("http://") || s.starts_with("https://") {
        return Ok(s.to_string());
    }
    if s.contains("://") {
        return Err(Failure::new(
            Exit::Usage,
            format!("the server {s:?} must be an http:// or https:// URL"),
        ));
    }
    Ok(format!("http://{s}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(server: Option<&str>, key: Option<&str>, config: &Path) -> ClientArgs {
        ClientArgs {
            server: server.map(str::to_string),
            api_key: key.map(str::to_string),
            config: Some(config.to_path_buf()),
            json: false,
        }
    }

    #[test]
    fn flags_win_over_the_config_file_which_wins_over_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.toml");
        std::fs::write(
            &file,
            "server = \"10.0.0.1:8080\"\napi_key = \"from-file\"\n",
        )
        .unwrap();

        let c = args(None, None, &file).connection().unwrap();
        assert_eq!(c.server, "http://10.0.0.1:8080");
        assert_eq!(c.api_key.as_deref(), Some("from-file"));
        assert_eq!(c.config_file.as_deref(), Some(file.as_path()));

        let c = args(Some("https://lc.example/"), Some("flag"), &file)
            .connection()
            .unwrap();
        assert_eq!(c.server, "https://lc.example");
        assert_eq!(c.api_key.as_deref(), Some("flag"));

        std::fs::write(&file, "").unwrap();
        let c = args(None, None, &file).connection().unwrap();
        assert_eq!(c.server, DEFAULT_SERVER);
        assert_eq!(c.api_key, None);
    }

    #[test]
    fn a_bad_or_missing_named_config_file_is_a_usage_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.toml");
        let e = args(None, None, &file).connection().unwrap_err();
        assert_eq!(e.exit, Exit::Usage);
        assert!(e.message.contains("cannot read the config file"), "{e}");

        std::fs::write(&file, "sever = \"typo\"\n").unwrap();
        let e = args(None, None, &file).connection().unwrap_err();
        assert_eq!(e.exit, Exit::Usage);
        assert!(e.message.contains("sever"), "{e}");

        std::fs::write(&file, "").unwrap();
        let e = args(Some("ftp://x"), None, &file).connection().unwrap_err();
        assert_eq!(e.exit, Exit::Usage);
    }
}
