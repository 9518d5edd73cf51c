//! Calls into agents (`sandbolt.agent.v1.AgentService`), one lazily connected
//! HTTP/2 channel per agent endpoint, authenticated with the agent token.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;
use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::agent_service_client::AgentServiceClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::error::{Error, Result};

/// Adds `authorization: Bearer <token>` to every call.
#[derive(Clone)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Bearer {
    pub fn new(token: &str) -> Self {
        Self(if token.is_empty() {
            None
        } else {
            format!("Bearer {token}").parse().ok()
        })
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

pub type Client = AgentServiceClient<InterceptedService<Channel, Bearer>>;

pub struct AgentClients {
    bearer: Bearer,
    clients: Mutex<HashMap<String, Client>>,
}

impl AgentClients {
    pub fn new(token: &str) -> Self {
        Self {
            bearer: Bearer::new(token),
            clients: Mutex::new(HashMap::new()),
        }
    }

    pub fn client(&self, endpoint: &str) -> Result<Client> {
        if endpoint.is_empty() {
            return Err(Error::Unavailable("agent has no API endpoint".into()));
        }
        let mut g = self.clients.lock();
        if let Some(c) = g.get(endpoint) {
            return Ok(c.clone());
        }
        let uri = if endpoint.contains("://") {
            endpoint.to_string()
        } else {
            format!("http://{endpoint}")
        };
        let ch = Endpoint::from_shared(uri)
            .map_err(|e| Error::Unavailable(format!("bad agent endpoint {endpoint}: {e}")))?
            .connect_timeout(Duration::from_secs(3))
            .tcp_nodelay(true)
            .connect_lazy();
        let c = AgentServiceClient::with_interceptor(ch, self.bearer.clone());
        g.insert(endpoint.to_string(), c.clone());
        Ok(c)
    }

    pub async fn create(
        &self,
        agent: &str,
        endpoint: &str,
        spec: pb::SandboxSpec,
        deadline: Duration,
    ) -> Result<pb::CreateSandboxResponse> {
        let mut c = self.client(endpoint)?;
        let mut req = tonic::Request::new(pb::CreateSandboxRequest { spec: Some(spec) });
        req.set_timeout(deadline);
        match tokio::time::timeout(deadline, c.create_sandbox(req)).await {
            Ok(r) => r.map(|r| r.into_inner()).map_err(|status| Error::Agent {
                agent: agent.into(),
                status,
            }),
            Err(_) => Err(Error::Unavailable(format!(
                "agent {agent}: create did not finish within {deadline:?}"
            ))),
        }
    }

    pub async fn delete(
        &self,
        agent: &str,
        endpoint: &str,
        sandbox_id: &str,
        deadline: Duration,
    ) -> Result<bool> {
        let mut c = self.client(endpoint)?;
        let mut req = tonic::Request::new(pb::DeleteSandboxRequest {
            sandbox_id: sandbox_id.into(),
            grace_period_ms: 0,
        });
        req.set_timeout(deadline);
        match tokio::time::timeout(deadline, c.delete_sandbox(req)).await {
            Ok(r) => r
                .map(|r| r.into_inner().existed)
                .map_err(|status| Error::Agent {
                    agent: agent.into(),
                    status,
                }),
            Err(_) => Err(Error::Unavailable(format!(
                "agent {agent}: delete did not finish within {deadline:?}"
            ))),
        }
    }

    pub async fn get(
        &self,
        agent: &str,
        endpoint: &str,
        sandbox_id: &str,
        deadline: Duration,
    ) -> Result<pb::SandboxStatus> {
        let mut c = self.client(endpoint)?;
        let mut req = tonic::Request::new(pb::SandboxRef {
            sandbox_id: sandbox_id.into(),
        });
        req.set_timeout(deadline);
        match tokio::time::timeout(deadline, c.get_sandbox(req)).await {
            Ok(r) => r.map(|r| r.into_inner()).map_err(|status| Error::Agent {
                agent: agent.into(),
                status,
            }),
            Err(_) => Err(Error::Unavailable(format!(
                "agent {agent}: no answer within {deadline:?}"
            ))),
        }
    }

    pub async fn pause(
        &self,
        agent: &str,
        endpoint: &str,
        sandbox_id: &str,
        pause: bool,
        deadline: Duration,
    ) -> Result<pb::SandboxStatus> {
        let mut c = self.client(endpoint)?;
        let mut req = tonic::Request::new(pb::SandboxRef {
            sandbox_id: sandbox_id.into(),
        });
        req.set_timeout(deadline);
        let call = async {
            if pause {
                c.pause_sandbox(req).await
            } else {
                c.resume_sandbox(req).await
            }
        };
        match tokio::time::timeout(deadline, call).await {
            Ok(r) => r.map(|r| r.into_inner()).map_err(|status| Error::Agent {
                agent: agent.into(),
                status,
            }),
            Err(_) => Err(Error::Unavailable(format!(
                "agent {agent}: no answer within {deadline:?}"
            ))),
        }
    }
}
