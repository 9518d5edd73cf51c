//! A sandbox's access token (execd and the agent's proxy route): derived
//! from the controller's key and the record's identity (see
//! `crate::secrets`), never stored, so neither the redb file nor a
//! `Sandbox` resource holds one.

use crate::error::{Error, Result};
use crate::sandbox::{Core, CreateRequest};
use crate::secrets::{Secrets, env_context};
use crate::store::SandboxRecord;

/// The token execd and the proxy expect for `r`. Records written before
/// tokens were derived carry their own, which their running execd still
/// holds: that one is kept.
pub(crate) fn access_token(secrets: &Secrets, r: &SandboxRecord) -> String {
    if !r.access_token.is_empty() {
        return r.access_token.clone();
    }
    secrets.sandbox_token(&r.namespace, &r.name, &r.uid)
}

impl Core {
    /// The token of `r` (see [`access_token`]).
    pub fn access_token(&self, r: &SandboxRecord) -> String {
        access_token(&self.secrets, r)
    }
}

impl Core {
    /// Moves the request's secret env values out of `spec.envs` into
    /// `spec.sealed_envs`, sealed for this sandbox (its name is final
    /// here). A name that is not in the env is refused, never ignored.
    pub(crate) fn seal_secret_env(&self, req: &mut CreateRequest) -> Result<()> {
        for var in std::mem::take(&mut req.secret_env_names) {
            let Some(value) = req.spec.envs.remove(&var) else {
                if req.spec.sealed_envs.contains_key(&var) {
                    continue;
                }
                return Err(Error::InvalidArgument(format!(
                    "secret env {var:?} is not set in env (secret_env_names name env variables)"
                )));
            };
            let ctx = env_context(&req.namespace, &req.name, &var);
            let sealed = self
                .secrets
                .seal(&ctx, &value)
                .map_err(|e| Error::Internal(e.to_string()))?;
            req.spec.sealed_envs.insert(var, sealed);
        }
        Ok(())
    }
}

/// Shows everything but the values of secret env variables, which a log
/// line or an error must never carry.
impl std::fmt::Debug for CreateRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut spec = self.spec.clone();
        for var in &self.secret_env_names {
            if let Some(v) = spec.envs.get_mut(var) {
                *v = "<secret>".into();
            }
        }
        f.debug_struct("CreateRequest")
            .field("request_id", &self.request_id)
            .field("name", &self.name)
            .field("namespace", &self.namespace)
            .field("consistency", &self.consistency)
            .field("wait_for_execd", &self.wait_for_execd)
            .field("spec", &spec)
            .field("secret_env_names", &self.secret_env_names)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_create_request_never_shows_a_secret_value() {
        let mut req = CreateRequest {
            secret_env_names: vec!["S".into()],
            ..Default::default()
        };
        req.spec.envs.insert("S".into(), "hunter2".into());
        req.spec.envs.insert("P".into(), "plain".into());
        let shown = format!("{req:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(
            shown.contains("plain") && shown.contains("<secret>"),
            "{shown}"
        );
    }
}
