//! Who owns a sandbox: the one seam of the janitor. Standalone, the
//! controller answers over gRPC ([`ControllerOwnership`]); on Kubernetes a
//! source backed by pods and Sandbox resources will implement the same trait.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::agent::v1::registry_service_client::RegistryServiceClient;
use sandbolt_proto::auth::{BearerToken, StoredCredential};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::error::{JanitorError, Result};
use crate::rules::{
    AgentFacts, ContainerFacts, OwnershipAnswer, OwnershipReport, ReapReason, RecordState,
    SnapshotOwnershipReport,
};

#[tonic::async_trait]
pub trait OwnershipSource: Send + Sync + 'static {
    /// Answers for every query, in order. An error means "do not know":
    /// the caller reaps nothing.
    async fn ownership(
        &self,
        node_name: &str,
        queries: &[ContainerFacts],
    ) -> Result<OwnershipReport>;

    /// Tells the owner a container was removed, so its slot is released.
    async fn report_reaped(&self, reaped: &ReapNotice<'_>) -> Result<()>;

    /// Whether a snapshot record names each sandbox snapshot id, in order.
    /// An error means "do not know": the caller removes no sandbox
    /// snapshot. The default is a source that keeps no snapshot records.
    async fn snapshot_ownership(
        &self,
        node_name: &str,
        snapshot_ids: &[String],
    ) -> Result<SnapshotOwnershipReport> {
        let _ = (node_name, snapshot_ids);
        Err(JanitorError::OwnershipUnavailable(
            "this ownership source does not answer for sandbox snapshots".into(),
        ))
    }
}

/// One container the janitor removed, as its owner is told of it.
#[derive(Debug, Clone, Copy)]
pub struct ReapNotice<'a> {
    pub node_name: &'a str,
    pub sandbox_id: &'a str,
    pub agent_id: &'a str,
    pub reason: ReapReason,
}

type Client = RegistryServiceClient<InterceptedService<Channel, BearerToken>>;

/// The controller's `RegistryService`. Ownership queries carry the
/// bootstrap (agent) token; a reap report speaks for the agent whose
/// container went and carries that agent's credential: the one the node's
/// agent stored in its state dir (`--agent-state-dir`), else one enrolled
/// for with the bootstrap token, which the controller grants only for an
/// agent that is not live (a dead agent's containers, the usual reap).
#[derive(Clone)]
pub struct ControllerOwnership {
    client: Client,
    timeout: Duration,
    bootstrap: BearerToken,
    agent_state_dir: Option<PathBuf>,
    /// Credentials enrolled for, by agent id.
    enrolled: Arc<parking_lot::Mutex<HashMap<String, String>>>,
}

impl ControllerOwnership {
    /// Builds a lazy channel: an unreachable controller shows up as an error
    /// of the call, never at start-up.
    pub fn new(endpoint: &str, token: &str, timeout: Duration) -> Result<Self> {
        Self::with_ca(endpoint, token, timeout, None)
    }

    /// [`ControllerOwnership::new`] to a controller serving TLS whose
    /// certificate chains to `ca` (PEM); the endpoint is then `https://`.
    pub fn with_ca(
        endpoint: &str,
        token: &str,
        timeout: Duration,
        ca: Option<&std::path::Path>,
    ) -> Result<Self> {
        let ep = sandbolt_proto::tls::controller_endpoint(endpoint, ca)
            .map_err(|e| JanitorError::Config(e.to_string()))?
            .connect_timeout(timeout)
            .timeout(timeout)
            .tcp_nodelay(true);
        let bootstrap = BearerToken::new(token).map_err(|e| JanitorError::Config(e.to_string()))?;
        Ok(Self {
            // Tokens are set per call: which one depends on the call.
            client: RegistryServiceClient::with_interceptor(ep.connect_lazy(), BearerToken::none()),
            timeout,
            bootstrap,
            agent_state_dir: None,
            enrolled: Arc::default(),
        })
    }

    /// Reads the node agent's stored credential from `dir` (its state dir).
    pub fn with_agent_state_dir(mut self, dir: Option<PathBuf>) -> Self {
        self.agent_state_dir = dir;
        self
    }

    /// `req` with the bootstrap token.
    fn bootstrap<T>(&self, body: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(body);
        self.bootstrap.apply(&mut req);
        req
    }

    /// `agent_id`'s credential: stored by the node's agent, enrolled for
    /// before, or enrolled for now.
    async fn credential_of(&self, agent_id: &str, node_name: &str) -> Result<String> {
        if let Some(c) = self
            .agent_state_dir
            .as_deref()
            .and_then(StoredCredential::read)
            .filter(|c| c.agent_id == agent_id)
        {
            return Ok(c.credential);
        }
        if let Some(c) = self.enrolled.lock().get(agent_id) {
            return Ok(c.clone());
        }
        let req = self.bootstrap(pb::EnrollRequest {
            agent_id: agent_id.to_string(),
            node_name: node_name.to_string(),
        });
        let credential = self.call(self.client.clone().enroll(req)).await?.credential;
        self.enrolled
            .lock()
            .insert(agent_id.to_string(), credential.clone());
        Ok(credential)
    }
}

impl ControllerOwnership {
    /// One RPC, bounded by the timeout; every failure means "do not know".
    async fn call<T>(
        &self,
        rpc: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T> {
        tokio::time::timeout(self.timeout, rpc)
            .await
            .map_err(|_| {
                JanitorError::OwnershipUnavailable(format!("no answer within {:?}", self.timeout))
            })?
            .map(tonic::Response::into_inner)
            .map_err(|s| {
                JanitorError::OwnershipUnavailable(format!("{}: {}", s.code(), s.message()))
            })
    }
}

fn agent_facts(a: pb::AgentLiveness) -> AgentFacts {
    AgentFacts {
        agent_id: a.agent_id,
        registered: a.registered,
        heartbeating: a.heartbeating,
        instance_id: a.instance_id,
        node_name: a.node_name,
        last_heartbeat_age_ms: a.last_heartbeat_age_ms,
    }
}

pub(crate) fn from_proto(
    resp: pb::GetOwnershipResponse,
    n_queries: usize,
) -> Result<OwnershipReport> {
    if resp.answers.len() != n_queries {
        return Err(JanitorError::OwnershipUnavailable(format!(
            "asked about {n_queries} sandboxes, got {} answers",
            resp.answers.len()
        )));
    }
    let answers = resp
        .answers
        .into_iter()
        .map(|a| {
            let record = match pb::RecordState::try_from(a.record_state) {
                Ok(pb::RecordState::Absent) => Ok(RecordState::Absent),
                Ok(pb::RecordState::Live) => Ok(RecordState::Live),
                Ok(pb::RecordState::Terminal) => Ok(RecordState::Terminal),
                // An answer the janitor does not understand proves nothing.
                _ => Err(JanitorError::OwnershipUnavailable(format!(
                    "unknown record state {} for {}",
                    a.record_state, a.sandbox_id
                ))),
            }?;
            Ok(OwnershipAnswer {
                sandbox_id: a.sandbox_id,
                record,
                record_uid: a.record_uid,
                record_sandbox_id: a.record_sandbox_id,
                record_phase: a.record_phase,
                create_in_flight: a.create_in_flight,
                agent: a.agent.map(agent_facts).unwrap_or_default(),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(OwnershipReport {
        ready: resp.ready,
        answers,
        agents: resp.agents.into_iter().map(agent_facts).collect(),
        fast_commit_deadline_ms: resp.fast_commit_deadline_ms,
    })
}

/// The answer for `asked` sandbox snapshot ids; one that does not match
/// them, in order, proves nothing.
pub(crate) fn snapshots_from_proto(
    resp: pb::GetOwnershipResponse,
    asked: &[String],
) -> Result<SnapshotOwnershipReport> {
    let matches = resp.snapshots.len() == asked.len()
        && resp
            .snapshots
            .iter()
            .zip(asked)
            .all(|(a, id)| &a.snapshot_id == id);
    if !matches {
        return Err(JanitorError::OwnershipUnavailable(format!(
            "asked about {} sandbox snapshots, got {} answers that do not match them",
            asked.len(),
            resp.snapshots.len()
        )));
    }
    Ok(SnapshotOwnershipReport {
        ready: resp.ready,
        recorded: resp.snapshots.iter().map(|a| a.recorded).collect(),
    })
}

#[tonic::async_trait]
impl OwnershipSource for ControllerOwnership {
    async fn ownership(
        &self,
        node_name: &str,
        queries: &[ContainerFacts],
    ) -> Result<OwnershipReport> {
        let req = pb::GetOwnershipRequest {
            node_name: node_name.to_string(),
            queries: queries
                .iter()
                .map(|c| pb::OwnershipQuery {
                    sandbox_id: c.sandbox_id.clone(),
                    name: c.name.clone(),
                    namespace: c.namespace.clone(),
                    record_uid: c.record_uid.clone(),
                    agent_id: c.agent_id.clone(),
                })
                .collect(),
            snapshot_ids: Vec::new(),
        };
        let resp = self
            .call(self.client.clone().get_ownership(self.bootstrap(req)))
            .await?;
        from_proto(resp, queries.len())
    }

    async fn report_reaped(&self, reaped: &ReapNotice<'_>) -> Result<()> {
        let body = pb::ReportReapedRequest {
            node_name: reaped.node_name.to_string(),
            sandbox_id: reaped.sandbox_id.to_string(),
            agent_id: reaped.agent_id.to_string(),
            reason: reaped.reason.as_str().to_string(),
        };
        // A report naming no agent goes with the bootstrap token (the
        // controller then touches only records of agents that are not live).
        let mut req = tonic::Request::new(body);
        if reaped.agent_id.is_empty() {
            self.bootstrap.apply(&mut req);
        } else {
            let credential = self
                .credential_of(reaped.agent_id, reaped.node_name)
                .await?;
            BearerToken::new(&credential)
                .map_err(|e| JanitorError::OwnershipUnavailable(e.to_string()))?
                .apply(&mut req);
        }
        let res = self.call(self.client.clone().report_reaped(req)).await;
        if res.is_err() {
            // Perhaps minted with a key the controller no longer has.
            self.enrolled.lock().remove(reaped.agent_id);
        }
        res.map(drop)
    }

    async fn snapshot_ownership(
        &self,
        node_name: &str,
        snapshot_ids: &[String],
    ) -> Result<SnapshotOwnershipReport> {
        let req = pb::GetOwnershipRequest {
            node_name: node_name.to_string(),
            queries: Vec::new(),
            snapshot_ids: snapshot_ids.to_vec(),
        };
        let resp = self
            .call(self.client.clone().get_ownership(self.bootstrap(req)))
            .await?;
        snapshots_from_proto(resp, snapshot_ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(ids: &[(&str, bool)]) -> pb::GetOwnershipResponse {
        pb::GetOwnershipResponse {
            ready: true,
            snapshots: ids
                .iter()
                .map(|(id, recorded)| pb::SnapshotOwnership {
                    snapshot_id: id.to_string(),
                    recorded: *recorded,
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_snapshot_answer_counts_only_when_it_matches_the_ids_asked() {
        let asked = vec!["a".to_string(), "b".to_string()];
        let r = snapshots_from_proto(answer(&[("a", true), ("b", false)]), &asked).unwrap();
        assert_eq!((r.ready, r.recorded), (true, vec![true, false]));
        // A controller that does not know the field answers nothing: unknown.
        assert!(snapshots_from_proto(answer(&[]), &asked).is_err());
        assert!(snapshots_from_proto(answer(&[("b", false), ("a", true)]), &asked).is_err());
    }
}
