//! Per-agent credentials, minted from the bootstrap secret.
//!
//! The shared agent token (`--agent-token`) is only a *bootstrap* secret:
//! it buys an agent id's own credential through `RegistryService.Enroll`,
//! and nothing else an agent does. The credential is
//! `hex(HMAC-SHA256(identity key, "sandbolt-agent-credential/v1\0" + id))`,
//! so the controller stores nothing per agent: it recomputes the credential
//! of the id a call speaks for and compares in constant time. Heartbeats
//! and reap reports must carry the credential of the id they name, and the
//! controller calls each agent with that agent's credential, which is the
//! only token the agent accepts.
//!
//! The identity key is one file: `--identity-key-file` (the chart mounts a
//! Secret there, so HA controllers share it), else
//! `<data dir>/identity.key`, created with 32 random bytes (hex, mode 0600)
//! on first start. Changing it invalidates every credential: agents see
//! their heartbeats refused and enroll again (once their id is no longer
//! live).
//!
//! Limit: a holder of the bootstrap token can still enroll an id that is
//! not live (a new one, or one whose agent is dead). Binding an id to a
//! node would need a per-node proof such as Kubernetes TokenReview.

use std::path::Path;

use ring::hmac;
use sandbolt_proto::auth::{constant_time_eq, digest_matches, presented_bearer, token_digest};
use tonic::Status;
use tonic::metadata::MetadataMap;

use crate::key_file::{self, KeyFileError};

/// The key file's name in the data dir when no `--identity-key-file` is given.
pub const DEFAULT_KEY_FILE: &str = "identity.key";
const CREDENTIAL_CONTEXT: &[u8] = b"sandbolt-agent-credential/v1\0";

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error(transparent)]
    KeyFile(#[from] KeyFileError),
}

/// The identity key and the bootstrap token's digest. Debug shows neither.
pub struct AgentIdentity {
    key: hmac::Key,
    bootstrap: [u8; 32],
}

impl std::fmt::Debug for AgentIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AgentIdentity(..)")
    }
}

impl AgentIdentity {
    /// Reads the key from `file`, or from `<data_dir>/identity.key`, which
    /// is created when absent. A given file must exist: generating one would
    /// split HA controllers onto different keys.
    pub fn load(
        file: Option<&Path>,
        data_dir: &Path,
        bootstrap: &str,
    ) -> Result<Self, IdentityError> {
        let material = key_file::load(
            "identity key file (--identity-key-file)",
            file,
            &data_dir.join(DEFAULT_KEY_FILE),
        )?;
        Ok(Self::from_material(&material, bootstrap))
    }

    pub fn from_material(material: &[u8], bootstrap: &str) -> Self {
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, material),
            bootstrap: token_digest(bootstrap.as_bytes()),
        }
    }

    /// The credential of `agent_id`: 64 hex characters.
    pub fn credential(&self, agent_id: &str) -> String {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(CREDENTIAL_CONTEXT);
        ctx.update(agent_id.as_bytes());
        hex::encode(ctx.sign().as_ref())
    }

    /// Does the call carry the bootstrap token?
    pub fn is_bootstrap(&self, metadata: &MetadataMap) -> bool {
        presented_bearer(metadata).is_some_and(|t| digest_matches(t.as_bytes(), &self.bootstrap))
    }

    /// Does the call carry `agent_id`'s credential?
    pub fn is_credential_of(&self, metadata: &MetadataMap, agent_id: &str) -> bool {
        !agent_id.is_empty()
            && presented_bearer(metadata).is_some_and(|t| {
                constant_time_eq(t.as_bytes(), self.credential(agent_id).as_bytes())
            })
    }

    /// The call speaks for `agent_id` (`rpc` names it in errors): it must
    /// carry that id's credential. UNAUTHENTICATED without a token or with
    /// an unknown one; PERMISSION_DENIED with the bootstrap token alone or
    /// with another agent's credential (indistinguishable from an unknown
    /// token, so that is what the message says).
    pub fn authorize_agent(
        &self,
        metadata: &MetadataMap,
        agent_id: &str,
        rpc: &str,
    ) -> Result<(), Status> {
        if agent_id.is_empty() {
            return Err(Status::invalid_argument(format!(
                "{rpc}: agent_id is required"
            )));
        }
        if self.is_credential_of(metadata, agent_id) {
            return Ok(());
        }
        if presented_bearer(metadata).is_none() {
            return Err(Status::unauthenticated(format!(
                "{rpc}: authorization: Bearer <credential of agent {agent_id}> required"
            )));
        }
        if self.is_bootstrap(metadata) {
            return Err(Status::permission_denied(format!(
                "{rpc} for agent {agent_id}: the bootstrap token is not enough; enroll \
                 (RegistryService.Enroll) and present agent {agent_id}'s credential"
            )));
        }
        Err(Status::permission_denied(format!(
            "{rpc} for agent {agent_id}: the token presented is not agent {agent_id}'s credential"
        )))
    }

    /// The bootstrap token: Enroll, and calls that do not speak for one
    /// agent (the janitors' read-only ownership queries).
    pub fn authorize_bootstrap(&self, metadata: &MetadataMap, rpc: &str) -> Result<(), Status> {
        if self.is_bootstrap(metadata) {
            return Ok(());
        }
        Err(Status::unauthenticated(match presented_bearer(metadata) {
            None => format!("{rpc}: authorization: Bearer <token> required"),
            Some(_) => format!("{rpc}: wrong token"),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(token: Option<&str>) -> MetadataMap {
        let mut m = MetadataMap::new();
        if let Some(t) = token {
            m.insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        m
    }

    #[test]
    fn credentials_are_bound_to_the_key_and_the_id() {
        let a = AgentIdentity::from_material(&[1; 32], "boot");
        let b = AgentIdentity::from_material(&[2; 32], "boot");
        let c = a.credential("agent-a");
        assert_eq!(c.len(), 64);
        assert_eq!(c, a.credential("agent-a"));
        assert_ne!(c, a.credential("agent-b"));
        assert_ne!(c, b.credential("agent-a"));
        assert_ne!(c, "boot");
    }

    #[test]
    fn only_the_ids_own_credential_speaks_for_it() {
        let id = AgentIdentity::from_material(&[7; 32], "boot");
        let own = id.credential("a");
        let other = id.credential("b");
        assert!(
            id.authorize_agent(&md(Some(&own)), "a", "Heartbeat")
                .is_ok()
        );
        let e = id
            .authorize_agent(&md(Some(&other)), "a", "Heartbeat")
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        let e = id
            .authorize_agent(&md(Some("boot")), "a", "Heartbeat")
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("agent a"), "{}", e.message());
        let e = id.authorize_agent(&md(None), "a", "Heartbeat").unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(id.authorize_bootstrap(&md(Some("boot")), "x").is_ok());
        assert!(id.authorize_bootstrap(&md(Some(&own)), "x").is_err());
    }

    #[test]
    fn the_key_file_is_created_0600_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let a = AgentIdentity::load(None, dir.path(), "boot").unwrap();
        let path = dir.path().join(DEFAULT_KEY_FILE);
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&path).unwrap().permissions(),
        ) & 0o777;
        assert_eq!(mode, 0o600);
        let b = AgentIdentity::load(None, dir.path(), "boot").unwrap();
        assert_eq!(a.credential("x"), b.credential("x"));
        let given = dir.path().join("given.key");
        assert!(matches!(
            AgentIdentity::load(Some(&given), dir.path(), "boot"),
            Err(IdentityError::KeyFile(KeyFileError::Io { .. }))
        ));
        std::fs::write(&given, "short").unwrap();
        assert!(matches!(
            AgentIdentity::load(Some(&given), dir.path(), "boot"),
            Err(IdentityError::KeyFile(KeyFileError::TooShort {
                len: 5,
                ..
            }))
        ));
    }
}
