//! The controller's secret key and what it is used for: per-sandbox access
//! tokens derived from it (so no record, resource or redb file holds one)
//! and env values marked secret, stored sealed under it.
//!
//! The key is one file: `--token-key-file` (the chart mounts a Secret there,
//! so controllers in HA share it), else `<data dir>/token.key`, created with
//! 32 random bytes (hex, mode 0600) the first time. Two purpose keys are
//! derived from it (HMAC-SHA256 of a label), so a token never doubles as a
//! sealing key. Losing or changing the file changes every derived token:
//! running sandboxes keep the old one in execd, and are unreachable until
//! recreated.

use std::fmt;
use std::path::Path;

use ring::aead::{self, Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

use crate::key_file::{self, KeyFileError};

/// The key file's name in the data dir when no `--token-key-file` is given.
pub const DEFAULT_KEY_FILE: &str = "token.key";

const TOKEN_KEY_LABEL: &[u8] = b"sandbolt token key/v1";
const SEAL_KEY_LABEL: &[u8] = b"sandbolt env seal key/v1";
const TOKEN_CONTEXT: &[u8] = b"sandbolt-sandbox-token/v1\0";
/// Prefix of a sealed value, so a future format can be told apart.
const SEALED_PREFIX: &str = "v1:";

#[derive(Debug, thiserror::Error)]
pub enum SecretsError {
    #[error(transparent)]
    KeyFile(#[from] KeyFileError),
    #[error("the system random source failed")]
    Random,
    #[error("sealed value of {0}: not one this controller's key sealed")]
    Unseal(String),
}

/// The purpose keys. Debug never shows key material.
pub struct Secrets {
    token: hmac::Key,
    seal: LessSafeKey,
    rng: SystemRandom,
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secrets(..)")
    }
}

impl Secrets {
    /// Reads the key from `file`, or from `<data_dir>/token.key`, which is
    /// created when absent. A given file must exist: generating one would
    /// split HA controllers onto different keys.
    pub fn load(file: Option<&Path>, data_dir: &Path) -> Result<Self, SecretsError> {
        let material = key_file::load(
            "token key file (--token-key-file)",
            file,
            &data_dir.join(DEFAULT_KEY_FILE),
        )?;
        Ok(Self::from_material(&material))
    }

    /// The purpose keys of `material` (the key file's trimmed content).
    pub fn from_material(material: &[u8]) -> Self {
        let root = hmac::Key::new(hmac::HMAC_SHA256, material);
        let token = hmac::sign(&root, TOKEN_KEY_LABEL);
        let seal = hmac::sign(&root, SEAL_KEY_LABEL);
        let seal = UnboundKey::new(&CHACHA20_POLY1305, seal.as_ref())
            .expect("a SHA-256 output is a ChaCha20-Poly1305 key");
        Self {
            token: hmac::Key::new(hmac::HMAC_SHA256, token.as_ref()),
            seal: LessSafeKey::new(seal),
            rng: SystemRandom::new(),
        }
    }

    /// The access token of one sandbox record: 32 hex characters, the
    /// shape stored tokens had. Bound to the record's uid, so a namesake
    /// created later gets another.
    pub fn sandbox_token(&self, namespace: &str, name: &str, uid: &str) -> String {
        let mut ctx = hmac::Context::with_key(&self.token);
        ctx.update(TOKEN_CONTEXT);
        for part in [namespace, name, uid] {
            ctx.update(part.as_bytes());
            ctx.update(b"\0");
        }
        hex::encode(&ctx.sign().as_ref()[..16])
    }

    /// `value` sealed (ChaCha20-Poly1305, random nonce) for `context` (the
    /// sandbox and variable it belongs to: a sealed value copied into
    /// another record or variable does not open there).
    pub fn seal(&self, context: &str, value: &str) -> Result<String, SecretsError> {
        let mut nonce = [0u8; aead::NONCE_LEN];
        self.rng
            .fill(&mut nonce)
            .map_err(|_| SecretsError::Random)?;
        let mut buf = value.as_bytes().to_vec();
        self.seal
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(context.as_bytes()),
                &mut buf,
            )
            .map_err(|_| SecretsError::Random)?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&buf);
        Ok(format!("{SEALED_PREFIX}{}", hex::encode(out)))
    }

    /// The value [`Secrets::seal`] sealed for `context`.
    pub fn open(&self, context: &str, sealed: &str) -> Result<String, SecretsError> {
        let bad = || SecretsError::Unseal(context.to_string());
        let raw = sealed
            .strip_prefix(SEALED_PREFIX)
            .and_then(|h| hex::decode(h).ok())
            .filter(|r| r.len() >= aead::NONCE_LEN + CHACHA20_POLY1305.tag_len())
            .ok_or_else(bad)?;
        let (nonce, ct) = raw.split_at(aead::NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| bad())?;
        let mut buf = ct.to_vec();
        let plain = self
            .seal
            .open_in_place(nonce, Aad::from(context.as_bytes()), &mut buf)
            .map_err(|_| bad())?;
        String::from_utf8(plain.to_vec()).map_err(|_| bad())
    }
}

/// What a secret env value of one sandbox is sealed for: a sealed value
/// copied into another sandbox or variable does not open there.
pub fn env_context(namespace: &str, name: &str, var: &str) -> String {
    format!("sandbolt-env/v1\0{namespace}\0{name}\0{var}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_bound_to_key_and_identity() {
        let a = Secrets::from_material(&[1; 32]);
        let b = Secrets::from_material(&[2; 32]);
        let t = a.sandbox_token("default", "s", "u1");
        assert_eq!(t.len(), 32);
        assert_eq!(t, a.sandbox_token("default", "s", "u1"));
        assert_ne!(t, b.sandbox_token("default", "s", "u1"));
        assert_ne!(t, a.sandbox_token("default", "s", "u2"));
        // The separator keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(
            a.sandbox_token("ab", "c", "u"),
            a.sandbox_token("a", "bc", "u")
        );
    }

    #[test]
    fn sealed_values_open_only_in_their_context() {
        let k = Secrets::from_material(&[7; 32]);
        let s = k.seal("ns/a/u/KEY", "hunter2").unwrap();
        assert!(!s.contains("hunter2"));
        assert_ne!(s, k.seal("ns/a/u/KEY", "hunter2").unwrap(), "random nonce");
        assert_eq!(k.open("ns/a/u/KEY", &s).unwrap(), "hunter2");
        assert!(k.open("ns/a/u/OTHER", &s).is_err());
        assert!(
            Secrets::from_material(&[8; 32])
                .open("ns/a/u/KEY", &s)
                .is_err()
        );
        assert!(k.open("ns/a/u/KEY", "v1:00").is_err());
        assert!(format!("{k:?}") == "Secrets(..)");
    }

    #[test]
    fn the_default_key_file_is_made_once_and_private() {
        let dir = tempfile::tempdir().unwrap();
        let a = Secrets::load(None, dir.path()).unwrap();
        let path = dir.path().join(DEFAULT_KEY_FILE);
        let mode = std::fs::metadata(&path).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
        let b = Secrets::load(None, dir.path()).unwrap();
        assert_eq!(
            a.sandbox_token("n", "s", "u"),
            b.sandbox_token("n", "s", "u")
        );
        // A named file must exist and be long enough.
        let missing = dir.path().join("nope");
        assert!(matches!(
            Secrets::load(Some(&missing), dir.path()),
            Err(SecretsError::KeyFile(KeyFileError::Io { .. }))
        ));
        std::fs::write(&missing, "short\n").unwrap();
        assert!(matches!(
            Secrets::load(Some(&missing), dir.path()),
            Err(SecretsError::KeyFile(KeyFileError::TooShort { len: 5, .. }))
        ));
    }
}
