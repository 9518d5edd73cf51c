//! Calls into agents (`sandbolt.agent.v1.AgentService`), one lazily connected
//! HTTP/2 channel per agent endpoint, authenticated with that agent's own
//! credential (see [`crate::identity`]): the only token an enrolled agent
//! accepts, so a holder of the bootstrap token cannot call agents. An
//! agent that serves TLS is called over TLS trusting only the certificate
//! whose fingerprint it reported in its (authenticated) heartbeat.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient;
use sandbolt_proto::auth::BearerToken;
use sandbolt_proto::tls::AgentEndpoint;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Response, Status};

use crate::error::{Error, Result};
use crate::identity::AgentIdentity;
use crate::ids::{AgentId, SandboxId};

pub type Client = AgentServiceClient<InterceptedService<Channel, BearerToken>>;

pub struct AgentClients {
    identity: Arc<AgentIdentity>,
    /// By (agent id, endpoint): the credential is the agent's, the channel
    /// the endpoint's.
    clients: Mutex<HashMap<(String, String), Client>>,
}

impl AgentClients {
    pub fn new(identity: Arc<AgentIdentity>) -> Self {
        Self {
            identity,
            clients: Mutex::new(HashMap::new()),
        }
    }

    /// Mints and checks agents' credentials.
    pub fn identity(&self) -> &Arc<AgentIdentity> {
        &self.identity
    }

    /// A client for `agent` at `endpoint`, presenting `agent`'s credential.
    pub fn client(&self, agent: &AgentId, endpoint: &str) -> Result<Client> {
        if endpoint.is_empty() {
            return Err(Error::Unavailable("agent has no API endpoint".into()));
        }
        let key = (agent.to_string(), endpoint.to_string());
        let mut g = self.clients.lock();
        if let Some(c) = g.get(&key) {
            return Ok(c.clone());
        }
        // An agent serving TLS advertised its certificate's fingerprint in
        // the endpoint (see `sandbolt_proto::tls`): the channel accepts only
        // that certificate.
        let ch = AgentEndpoint::parse(endpoint)
            .and_then(|ep| ep.channel(Duration::from_secs(3)))
            .map_err(|e| Error::Unavailable(format!("bad agent endpoint {endpoint}: {e}")))?;
        let bearer = BearerToken::new(&self.identity.credential(&key.0))
            .map_err(|e| Error::Internal(format!("credential of agent {agent}: {e}")))?;
        let c = AgentServiceClient::with_interceptor(ch, bearer);
        g.insert(key, c.clone());
        Ok(c)
    }

    /// One RPC to `agent` bounded by `deadline` (sent along as the gRPC
    /// timeout, and enforced here for an agent that does not answer at all).
    async fn call<Req, Resp, Fut>(
        &self,
        agent: &AgentId,
        endpoint: &str,
        rpc: &'static str,
        deadline: Duration,
        body: Req,
        send: impl FnOnce(Client, tonic::Request<Req>) -> Fut,
    ) -> Result<Resp>
    where
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let client = self.client(agent, endpoint)?;
        let mut req = tonic::Request::new(body);
        req.set_timeout(deadline);
        match tokio::time::timeout(deadline, send(client, req)).await {
            Ok(r) => r.map(Response::into_inner).map_err(|status| Error::Agent {
                agent: agent.to_string(),
                status,
            }),
            Err(_) => Err(Error::Unavailable(format!(
                "agent {agent}: {rpc} did not finish within {deadline:?}"
            ))),
        }
    }

    pub async fn create(
        &self,
        agent: &AgentId,
        endpoint: &str,
        spec: pb::SandboxSpec,
        deadline: Duration,
    ) -> Result<pb::CreateSandboxResponse> {
        let body = pb::CreateSandboxRequest { spec: Some(spec) };
        self.call(
            agent,
            endpoint,
            "create",
            deadline,
            body,
            |mut c, req| async move { c.create_sandbox(req).await },
        )
        .await
    }

    /// True if the container existed.
    pub async fn delete(
        &self,
        agent: &AgentId,
        endpoint: &str,
        sandbox_id: &SandboxId,
        deadline: Duration,
    ) -> Result<bool> {
        let body = pb::DeleteSandboxRequest {
            sandbox_id: sandbox_id.to_string(),
            grace_period_ms: 0,
        };
        let resp = self
            .call(
                agent,
                endpoint,
                "delete",
                deadline,
                body,
                |mut c, req| async move { c.delete_sandbox(req).await },
            )
            .await?;
        Ok(resp.existed)
    }

    /// Replaces the egress policy of `sandbox_id` (normalized JSON, "" =
    /// allow all); the agent answers once the rules are in place.
    pub async fn update_network_policy(
        &self,
        agent: &AgentId,
        endpoint: &str,
        sandbox_id: &SandboxId,
        network_policy_json: &str,
        deadline: Duration,
    ) -> Result<pb::SandboxStatus> {
        let body = pb::UpdateNetworkPolicyRequest {
            sandbox_id: sandbox_id.to_string(),
            network_policy_json: network_policy_json.to_string(),
        };
        self.call(
            agent,
            endpoint,
            "update_network_policy",
            deadline,
            body,
            |mut c, req| async move { c.update_network_policy(req).await },
        )
        .await
    }

    /// One of the calls that name a sandbox and answer with its status.
    pub async fn status_rpc(
        &self,
        agent: &AgentId,
        endpoint: &str,
        sandbox_id: &SandboxId,
        rpc: StatusRpc,
        deadline: Duration,
    ) -> Result<pb::SandboxStatus> {
        let body = pb::SandboxRef {
            sandbox_id: sandbox_id.to_string(),
        };
        self.call(
            agent,
            endpoint,
            rpc.name(),
            deadline,
            body,
            move |mut c, req| async move {
                match rpc {
                    StatusRpc::Get => c.get_sandbox(req).await,
                    StatusRpc::Pause => c.pause_sandbox(req).await,
                    StatusRpc::Resume => c.resume_sandbox(req).await,
                }
            },
        )
        .await
    }
}

/// Named-volume calls. Each returns the agent's answer; errors are
/// [`Error::Agent`] (turn them into the client's code with
/// [`Error::volume_agent`]).
impl AgentClients {
    pub async fn create_volume(
        &self,
        agent: &AgentId,
        endpoint: &str,
        spec: pb::VolumeSpec,
        deadline: Duration,
    ) -> Result<pb::VolumeInfo> {
        let body = pb::CreateVolumeRequest { spec: Some(spec) };
        self.call(
            agent,
            endpoint,
            "create_volume",
            deadline,
            body,
            |mut c, r| async move { c.create_volume(r).await },
        )
        .await
    }

    pub async fn get_volume(
        &self,
        agent: &AgentId,
        endpoint: &str,
        name: &str,
        deadline: Duration,
    ) -> Result<pb::VolumeInfo> {
        let body = pb::VolumeRef { name: name.into() };
        self.call(
            agent,
            endpoint,
            "get_volume",
            deadline,
            body,
            |mut c, r| async move { c.get_volume(r).await },
        )
        .await
    }

    /// True if the volume existed.
    pub async fn delete_volume(
        &self,
        agent: &AgentId,
        endpoint: &str,
        name: &str,
        deadline: Duration,
    ) -> Result<bool> {
        let body = pb::VolumeRef { name: name.into() };
        let resp = self
            .call(
                agent,
                endpoint,
                "delete_volume",
                deadline,
                body,
                |mut c, r| async move { c.delete_volume(r).await },
            )
            .await?;
        Ok(resp.existed)
    }

    pub async fn create_volume_snapshot(
        &self,
        agent: &AgentId,
        endpoint: &str,
        volume: &str,
        name: &str,
        deadline: Duration,
    ) -> Result<pb::VolumeSnapshot> {
        let body = pb::CreateVolumeSnapshotRequest {
            volume: volume.into(),
            name: name.into(),
        };
        self.call(
            agent,
            endpoint,
            "create_volume_snapshot",
            deadline,
            body,
            |mut c, r| async move { c.create_volume_snapshot(r).await },
        )
        .await
    }

    /// True if the snapshot existed.
    pub async fn delete_volume_snapshot(
        &self,
        agent: &AgentId,
        endpoint: &str,
        volume: &str,
        name: &str,
        deadline: Duration,
    ) -> Result<bool> {
        let body = pb::VolumeSnapshotRef {
            volume: volume.into(),
            name: name.into(),
        };
        let resp = self
            .call(
                agent,
                endpoint,
                "delete_volume_snapshot",
                deadline,
                body,
                |mut c, r| async move { c.delete_volume_snapshot(r).await },
            )
            .await?;
        Ok(resp.existed)
    }

    pub async fn restore_volume(
        &self,
        agent: &AgentId,
        endpoint: &str,
        volume: &str,
        snapshot: &str,
        deadline: Duration,
    ) -> Result<pb::VolumeInfo> {
        let body = pb::RestoreVolumeRequest {
            volume: volume.into(),
            snapshot: snapshot.into(),
        };
        self.call(
            agent,
            endpoint,
            "restore_volume",
            deadline,
            body,
            |mut c, r| async move { c.restore_volume(r).await },
        )
        .await
    }

    pub async fn fork_volume(
        &self,
        agent: &AgentId,
        endpoint: &str,
        body: pb::ForkVolumeRequest,
        deadline: Duration,
    ) -> Result<pb::VolumeInfo> {
        self.call(
            agent,
            endpoint,
            "fork_volume",
            deadline,
            body,
            |mut c, r| async move { c.fork_volume(r).await },
        )
        .await
    }

    pub async fn attach_volume(
        &self,
        agent: &AgentId,
        endpoint: &str,
        sandbox_id: &SandboxId,
        mount: pb::NamedVolumeMount,
        deadline: Duration,
    ) -> Result<pb::SandboxStatus> {
        let body = pb::AttachVolumeRequest {
            sandbox_id: sandbox_id.to_string(),
            mount: Some(mount),
        };
        self.call(
            agent,
            endpoint,
            "attach_volume",
            deadline,
            body,
            |mut c, r| async move { c.attach_volume(r).await },
        )
        .await
    }

    pub async fn detach_volume(
        &self,
        agent: &AgentId,
        endpoint: &str,
        sandbox_id: &SandboxId,
        volume: &str,
        deadline: Duration,
    ) -> Result<pb::SandboxStatus> {
        let body = pb::DetachVolumeRequest {
            sandbox_id: sandbox_id.to_string(),
            volume: volume.into(),
        };
        self.call(
            agent,
            endpoint,
            "detach_volume",
            deadline,
            body,
            |mut c, r| async move { c.detach_volume(r).await },
        )
        .await
    }
}

/// Sandbox snapshot calls (see `crate::snapshot`). Errors are
/// [`Error::Agent`] carrying the agent's status.
impl AgentClients {
    /// Captures `sandbox_id` as snapshot `snapshot_id`; idempotent by id.
    pub async fn create_snapshot(
        &self,
        agent: &AgentId,
        endpoint: &str,
        snapshot_id: &str,
        sandbox_id: &SandboxId,
        deadline: Duration,
    ) -> Result<pb::SnapshotInfo> {
        let body = pb::CreateSnapshotRequest {
            snapshot_id: snapshot_id.into(),
            sandbox_id: sandbox_id.to_string(),
        };
        self.call(
            agent,
            endpoint,
            "create_snapshot",
            deadline,
            body,
            |mut c, r| async move { c.create_snapshot(r).await },
        )
        .await
    }

    /// True if the snapshot existed.
    pub async fn delete_snapshot(
        &self,
        agent: &AgentId,
        endpoint: &str,
        snapshot_id: &str,
        deadline: Duration,
    ) -> Result<bool> {
        let body = pb::SnapshotRef {
            snapshot_id: snapshot_id.into(),
        };
        let resp = self
            .call(
                agent,
                endpoint,
                "delete_snapshot",
                deadline,
                body,
                |mut c, r| async move { c.delete_snapshot(r).await },
            )
            .await?;
        Ok(resp.existed)
    }
}

/// The agent calls that take a sandbox id and return its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusRpc {
    Get,
    /// Freeze the container in place.
    Pause,
    /// Thaw it.
    Resume,
}

impl StatusRpc {
    fn name(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::Pause => "pause",
            Self::Resume => "resume",
        }
    }
}
