//! Pushes the full inventory to the controller's `RegistryService.Heartbeat`
//! every interval (the controller may ask for another interval in its
//! answer). Failures are logged and retried at the next tick: a controller
//! outage must not disturb running sandboxes.

use std::sync::Arc;
use std::time::Duration;

use sandbolt_proto::agent::v1::registry_service_client::RegistryServiceClient;
use sandbolt_proto::agent::v1::{AgentPod, HeartbeatRequest};
use sandbolt_proto::auth::BearerToken;
use tokio::sync::watch;
use tonic::transport::Endpoint;

use crate::config::AgentConfig;
use crate::error::{AgentError, Result};
use crate::server::AgentApi;

pub struct Heartbeat {
    pub endpoint: String,
    pub token: String,
    pub interval: Duration,
    /// Updated with each heartbeat's outcome.
    pub registration: Registration,
}

/// Whether the controller knows this agent: it answered the last
/// heartbeat (the agent's readiness, see `AgentHandle::readiness`).
#[derive(Debug, Clone)]
pub struct Registration(Arc<parking_lot::Mutex<Result<(), String>>>);

impl Default for Registration {
    fn default() -> Self {
        Self(Arc::new(parking_lot::Mutex::new(Err(
            "no heartbeat answered by the controller yet".into(),
        ))))
    }
}

impl Registration {
    /// `Err` says why the controller may not know this agent.
    pub fn check(&self) -> Result<(), String> {
        self.0.lock().clone()
    }

    fn set(&self, outcome: Result<(), String>) {
        *self.0.lock() = outcome;
    }
}

impl Heartbeat {
    /// Validates the endpoint now (so a typo fails `Agent::start`), then
    /// returns the loop to spawn.
    pub fn into_task(
        self,
        api: Arc<AgentApi>,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<impl Future<Output = ()> + Send + 'static> {
        let endpoint = Endpoint::from_shared(self.endpoint.clone())
            .map_err(|e| {
                AgentError::InvalidArgument(format!("controller endpoint {:?}: {e}", self.endpoint))
            })?
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(10));
        let token = BearerToken::new(&self.token)
            .map_err(|e| AgentError::InvalidArgument(format!("controller token: {e}")))?;
        let channel = endpoint.connect_lazy();
        let mut client = RegistryServiceClient::with_interceptor(channel, token);
        let mut interval = self.interval;
        let registration = self.registration;
        Ok(async move {
            loop {
                match api.inventory().await {
                    Ok(inventory) => {
                        let sandboxes = inventory.sandboxes.len();
                        match client
                            .heartbeat(HeartbeatRequest {
                                inventory: Some(inventory),
                            })
                            .await
                        {
                            Ok(resp) => {
                                registration.set(Ok(()));
                                let resp = resp.into_inner();
                                if resp.warm_targets_set {
                                    api.warm_pool.set_targets(resp.warm_targets);
                                }
                                let ms = resp.interval_ms;
                                if ms > 0 {
                                    interval = Duration::from_millis(ms.into());
                                }
                                tracing::debug!(sandboxes, ?interval, "heartbeat sent");
                            }
                            Err(s) => {
                                tracing::warn!(code = ?s.code(), error = %s.message(), "heartbeat failed");
                                registration.set(Err(format!(
                                    "the last heartbeat failed: {:?}: {}",
                                    s.code(),
                                    s.message()
                                )));
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "inventory for heartbeat failed"),
                }
                tokio::select! {
                    _ = shutdown.wait_for(|s| *s) => return,
                    _ = tokio::time::sleep(interval) => {}
                }
            }
        })
    }
}

/// The pod the inventory names (`Inventory.pod`): the controller asks the
/// Kubernetes API whether it still exists before it gives up the sandboxes
/// of a silent agent. `None` outside Kubernetes, or when the downward API
/// did not provide the pod's name, namespace and UID (a partial identity
/// could not be checked, so none is sent).
pub fn agent_pod(cfg: &AgentConfig) -> Option<AgentPod> {
    let some = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
    Some(AgentPod {
        namespace: some(&cfg.pod_namespace)?,
        name: some(&cfg.pod_name)?,
        uid: some(&cfg.pod_uid)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pod_is_named_only_when_fully_known() {
        let mut cfg = AgentConfig::new("a", "/run/c.sock", "/bin/execd", "/tmp/s", "t");
        assert_eq!(agent_pod(&cfg), None);
        cfg.pod_namespace = Some("sandbolt".into());
        cfg.pod_name = Some("agent-x".into());
        assert_eq!(agent_pod(&cfg), None, "no uid: cannot tell a successor");
        cfg.pod_uid = Some(String::new());
        assert_eq!(agent_pod(&cfg), None);
        cfg.pod_uid = Some("u-1".into());
        assert_eq!(
            agent_pod(&cfg),
            Some(AgentPod {
                namespace: "sandbolt".into(),
                name: "agent-x".into(),
                uid: "u-1".into(),
            })
        );
    }
}
