//! Pushes the full inventory to the controller's `RegistryService.Heartbeat`
//! every interval (the controller may ask for another interval in its
//! answer), with this agent's own credential (enrolled for first, see
//! [`Credentials`]). Failures are logged and retried at the next tick: a
//! controller outage must not disturb running sandboxes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sandbolt_proto::agent::v1::registry_service_client::RegistryServiceClient;
use sandbolt_proto::agent::v1::{AgentPod, EnrollRequest, HeartbeatRequest};
use sandbolt_proto::auth::{BearerToken, StoredCredential, TokenCell};
use tokio::sync::watch;
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::config::AgentConfig;
use crate::error::{AgentError, Result};
use crate::server::AgentApi;

pub struct Heartbeat {
    pub endpoint: String,
    /// The bootstrap token: only good for `Enroll`.
    pub token: String,
    pub interval: Duration,
    /// Updated with each heartbeat's outcome.
    pub registration: Registration,
    /// This agent's own credential, which every heartbeat carries.
    pub credentials: Credentials,
    /// CA of the controller's TLS certificate (`https://` endpoint).
    pub controller_ca: Option<PathBuf>,
}

type Client = RegistryServiceClient<InterceptedService<Channel, BearerToken>>;

/// This agent's own credential (see the controller's `identity` module):
/// read back from `<state_dir>/identity/credential` at start, else asked
/// for with the bootstrap token (`RegistryService.Enroll`) and stored there
/// (0600), so a restarted agent keeps its id without enrolling again. The
/// AgentService accepts only this token once an agent has a controller.
#[derive(Clone)]
pub struct Credentials(Arc<CredentialsInner>);

struct CredentialsInner {
    agent_id: String,
    node_name: String,
    state_dir: PathBuf,
    cell: TokenCell,
    current: parking_lot::Mutex<Option<String>>,
}

impl Credentials {
    /// The stored credential of `cfg.agent_id`, if any (one stored for
    /// another id is ignored).
    pub fn load(cfg: &AgentConfig) -> Self {
        let this = Self(Arc::new(CredentialsInner {
            agent_id: cfg.agent_id.clone(),
            node_name: cfg.node_name.clone(),
            state_dir: cfg.state_dir.clone(),
            cell: TokenCell::default(),
            current: parking_lot::Mutex::new(None),
        }));
        if let Some(stored) =
            StoredCredential::read(&cfg.state_dir).filter(|s| s.agent_id == cfg.agent_id)
        {
            this.0.cell.set(&stored.credential);
            *this.0.current.lock() = Some(stored.credential);
        }
        this
    }

    /// What the AgentService checks calls against.
    pub fn cell(&self) -> TokenCell {
        self.0.cell.clone()
    }

    /// The credential in use; `None` before enrollment.
    pub fn current(&self) -> Option<String> {
        self.0.current.lock().clone()
    }

    fn adopt(&self, credential: String) {
        let stored = StoredCredential {
            agent_id: self.0.agent_id.clone(),
            credential: credential.clone(),
        };
        if let Err(e) = stored.write(&self.0.state_dir) {
            // Still usable from memory; a restart enrolls again.
            tracing::warn!(error = %e, "could not store the agent credential");
        }
        self.0.cell.set(&credential);
        *self.0.current.lock() = Some(credential);
    }

    /// The controller refused it (its identity key changed): enroll again
    /// at the next tick. The AgentService keeps accepting it until then.
    fn forget(&self) {
        *self.0.current.lock() = None;
    }
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
        let endpoint =
            sandbolt_proto::tls::controller_endpoint(&self.endpoint, self.controller_ca.as_deref())
                .map_err(|e| AgentError::InvalidArgument(e.to_string()))?
                .connect_timeout(Duration::from_secs(2))
                .timeout(Duration::from_secs(10));
        let bootstrap = BearerToken::new(&self.token)
            .map_err(|e| AgentError::InvalidArgument(format!("controller token: {e}")))?;
        let channel = endpoint.connect_lazy();
        // Tokens are set per call: the bootstrap one for Enroll, the
        // credential for heartbeats.
        let mut client = RegistryServiceClient::with_interceptor(channel, BearerToken::none());
        let mut interval = self.interval;
        let (registration, credentials) = (self.registration, self.credentials);
        Ok(async move {
            loop {
                let credential = match credentials.current() {
                    Some(c) => Some(c),
                    None => enroll(&mut client, &bootstrap, &credentials, &registration).await,
                };
                if let Some(credential) = credential {
                    let beat = Beat {
                        api: &api,
                        credential: &credential,
                        credentials: &credentials,
                        registration: &registration,
                    };
                    if let Some(ms) = beat.send(&mut client).await {
                        interval = ms;
                    }
                }
                tokio::select! {
                    _ = shutdown.wait_for(|s| *s) => return,
                    _ = tokio::time::sleep(interval) => {}
                }
            }
        })
    }
}

/// Trades the bootstrap token for this agent's credential; `None` (and the
/// reason in `registration`) when the controller refuses or is away.
async fn enroll(
    client: &mut Client,
    bootstrap: &BearerToken,
    credentials: &Credentials,
    registration: &Registration,
) -> Option<String> {
    let mut req = tonic::Request::new(EnrollRequest {
        agent_id: credentials.0.agent_id.clone(),
        node_name: credentials.0.node_name.clone(),
    });
    bootstrap.apply(&mut req);
    match client.enroll(req).await {
        Ok(resp) => {
            let credential = resp.into_inner().credential;
            if credential.is_empty() {
                registration.set(Err(
                    "the controller answered Enroll without a credential".into()
                ));
                return None;
            }
            tracing::info!("enrolled with the controller");
            credentials.adopt(credential.clone());
            Some(credential)
        }
        Err(s) => {
            tracing::warn!(code = ?s.code(), error = %s.message(), "enroll failed");
            registration.set(Err(format!(
                // Readiness reads this: no credential, no heartbeat.
                "the last heartbeat failed: enrolling with the controller failed: {:?}: {}",
                s.code(),
                s.message()
            )));
            None
        }
    }
}

/// One heartbeat.
struct Beat<'a> {
    api: &'a Arc<AgentApi>,
    credential: &'a str,
    credentials: &'a Credentials,
    registration: &'a Registration,
}

impl Beat<'_> {
    /// Sends the inventory; the interval the controller asks for, if any.
    async fn send(&self, client: &mut Client) -> Option<Duration> {
        let inventory = match self.api.inventory().await {
            Ok(inventory) => inventory,
            Err(e) => {
                tracing::warn!(error = %e, "inventory for heartbeat failed");
                return None;
            }
        };
        let sandboxes = inventory.sandboxes.len();
        let mut req = tonic::Request::new(HeartbeatRequest {
            inventory: Some(inventory),
        });
        match BearerToken::new(self.credential) {
            Ok(t) => t.apply(&mut req),
            Err(_) => {
                self.credentials.forget();
                return None;
            }
        }
        match client.heartbeat(req).await {
            Ok(resp) => {
                self.registration.set(Ok(()));
                let resp = resp.into_inner();
                if resp.warm_targets_set {
                    self.api.warm_pool.set_targets(resp.warm_targets);
                }
                let interval =
                    (resp.interval_ms > 0).then(|| Duration::from_millis(resp.interval_ms.into()));
                tracing::debug!(sandboxes, ?interval, "heartbeat sent");
                interval
            }
            Err(s) => {
                tracing::warn!(code = ?s.code(), error = %s.message(), "heartbeat failed");
                if matches!(s.code(), Code::Unauthenticated | Code::PermissionDenied) {
                    // Minted with another identity key: enroll again.
                    self.credentials.forget();
                }
                self.registration.set(Err(format!(
                    "the last heartbeat failed: {:?}: {}",
                    s.code(),
                    s.message()
                )));
                None
            }
        }
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
