//! Per-sandbox execd access tokens on the Docker backend, derived instead of
//! stored (issue 21): `HMAC-SHA256(key, "sandbolt-docker-execd-token/v1\0" +
//! sandbox id)` under a key kept in `<data_dir>/docker-token.key` (0600,
//! made at the first start). No label or file holds a token; a restarted
//! lifecycle derives the same one. Containers made by an older sandbolt
//! still carry theirs in the `opensandbox.io/sandbolt-execd-token` label,
//! which is used as is.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use hmac::Mac;
use sha2::Sha256;

use crate::StartError;

/// The key file's name in the lifecycle's data dir.
pub const KEY_FILE: &str = "docker-token.key";

/// Keys below this many bytes are refused (a truncated file).
const MIN_KEY_BYTES: usize = 32;

/// Derives sandboxes' execd tokens.
#[derive(Clone)]
pub struct TokenKey(Vec<u8>);

impl std::fmt::Debug for TokenKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenKey(..)")
    }
}

impl TokenKey {
    /// Reads `<data_dir>/docker-token.key`, making it (64 random hex
    /// characters, mode 0600) when absent.
    pub fn load_or_create(data_dir: &Path) -> Result<Self, StartError> {
        let path = data_dir.join(KEY_FILE);
        let bad = |path: &PathBuf, e: &dyn std::fmt::Display| {
            StartError::Config(format!("docker token key {}: {e}", path.display()))
        };
        if !path.exists() {
            // Two v4 UUIDs: 244 random bits from the OS generator.
            let key = format!(
                "{}{}",
                uuid::Uuid::new_v4().simple(),
                uuid::Uuid::new_v4().simple()
            );
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
            {
                Ok(mut f) => f
                    .write_all(key.as_bytes())
                    .and_then(|()| f.sync_all())
                    .map_err(|e| bad(&path, &e))?,
                // Another start made it first: read that one.
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(bad(&path, &e)),
            }
        }
        let key = std::fs::read(&path).map_err(|e| bad(&path, &e))?;
        let key = key.trim_ascii().to_vec();
        if key.len() < MIN_KEY_BYTES {
            return Err(bad(
                &path,
                &format!(
                    "holds {} bytes, at least {MIN_KEY_BYTES} are needed; remove it to have a new one made (running sandboxes then get new tokens)",
                    key.len()
                ),
            ));
        }
        Ok(Self(key))
    }

    /// The execd token of sandbox `id`: 64 hex characters.
    pub fn token(&self, id: &str) -> String {
        let mut mac =
            hmac::Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        mac.update(b"sandbolt-docker-execd-token/v1\0");
        mac.update(id.as_bytes());
        mac.finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn tokens_are_bound_to_the_key_and_the_sandbox_and_the_key_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let a = TokenKey::load_or_create(dir.path()).unwrap();
        let again = TokenKey::load_or_create(dir.path()).unwrap();
        assert_eq!(a.token("sbx-1"), again.token("sbx-1"));
        assert_ne!(a.token("sbx-1"), a.token("sbx-2"));
        assert_eq!(a.token("sbx-1").len(), 64);
        let mode = std::fs::metadata(dir.path().join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let other = tempfile::tempdir().unwrap();
        let b = TokenKey::load_or_create(other.path()).unwrap();
        assert_ne!(a.token("sbx-1"), b.token("sbx-1"));
        std::fs::write(dir.path().join(KEY_FILE), "short").unwrap();
        assert!(TokenKey::load_or_create(dir.path()).is_err());
    }
}
