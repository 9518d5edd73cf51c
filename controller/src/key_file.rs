//! The controller's key files (the agent identity key, the token key): one
//! way to read them and to make one on first start.
//!
//! A file given by flag must exist: generating one would split HA
//! controllers onto different keys. Without a flag the key lives in the data
//! dir and is created with 32 random bytes (hex, mode 0600) the first time;
//! create-new makes two processes racing on one data dir end up with the
//! same key.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ring::rand::{SecureRandom, SystemRandom};

/// Shortest key file content accepted (bytes, after trimming whitespace).
pub const MIN_KEY_BYTES: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    /// `what` names the key and its flag, e.g. "identity key file (--identity-key-file)".
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{what} {path} holds {len} bytes; at least {MIN_KEY_BYTES} are needed \
         (e.g. `openssl rand -hex 32`)"
    )]
    TooShort {
        what: &'static str,
        path: PathBuf,
        len: usize,
    },
    #[error("the system random source failed")]
    Random,
}

/// The key material: the trimmed content of `given`, or of `default`
/// (created when absent) when no file is given.
pub fn load(
    what: &'static str,
    given: Option<&Path>,
    default: &Path,
) -> Result<Vec<u8>, KeyFileError> {
    match given {
        Some(path) => read(what, path),
        None => read_or_create(what, default),
    }
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, KeyFileError> {
    let raw = std::fs::read(path).map_err(|source| KeyFileError::Io {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    if let Ok(meta) = std::fs::metadata(path)
        && meta.permissions().mode() & 0o077 != 0
    {
        // Kubernetes Secret volumes are 0644 unless told otherwise: worth a
        // warning, not a refusal.
        tracing::warn!(path = %path.display(), mode = format!("{:o}", meta.permissions().mode() & 0o777), "{what} is readable by others");
    }
    let material = raw.trim_ascii();
    if material.len() < MIN_KEY_BYTES {
        return Err(KeyFileError::TooShort {
            what,
            path: path.to_path_buf(),
            len: material.len(),
        });
    }
    Ok(material.to_vec())
}

fn read_or_create(what: &'static str, path: &Path) -> Result<Vec<u8>, KeyFileError> {
    let io = |source| KeyFileError::Io {
        what,
        path: path.to_path_buf(),
        source,
    };
    if !path.exists() {
        let mut key = [0u8; 32];
        SystemRandom::new()
            .fill(&mut key)
            .map_err(|_| KeyFileError::Random)?;
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
        {
            Ok(mut f) => {
                f.write_all(hex::encode(key).as_bytes()).map_err(io)?;
                f.sync_all().map_err(io)?;
            }
            // Another replica sharing the directory won the race: use its key.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(e)),
        }
    }
    read(what, path)
}
