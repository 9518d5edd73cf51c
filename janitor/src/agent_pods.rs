//! The agent pods on this node, from the Kubernetes API: the evidence of the
//! agent-pod rule (see [`crate::rules`]). Optional — without it the janitor
//! decides on the controller's answers alone.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};

use crate::error::{JanitorError, Result};
use crate::rules::AgentPodList;

/// Label selector of the chart's agent pods.
pub const DEFAULT_SELECTOR: &str = "app.kubernetes.io/component=agent";

/// Lists the agent pods of one namespace scheduled on a node.
#[derive(Clone)]
pub struct AgentPods {
    api: Api<Pod>,
    namespace: String,
    selector: String,
    timeout: Duration,
}

impl AgentPods {
    /// `client`: any client (tests pass an API double's); `selector`: a
    /// label selector matching the agent pods.
    pub fn new(
        client: kube::Client,
        namespace: impl Into<String>,
        selector: impl Into<String>,
        timeout: Duration,
    ) -> Self {
        let namespace = namespace.into();
        Self {
            api: Api::namespaced(client, &namespace),
            namespace,
            selector: selector.into(),
            timeout,
        }
    }

    /// With the in-cluster configuration (service account token) or the
    /// local kubeconfig, as `kube::Client::try_default` finds them.
    pub async fn from_environment(
        namespace: impl Into<String>,
        selector: impl Into<String>,
        timeout: Duration,
    ) -> Result<Self> {
        let client = kube::Client::try_default()
            .await
            .map_err(|e| JanitorError::Config(format!("Kubernetes client: {e}")))?;
        Ok(Self::new(client, namespace, selector, timeout))
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    pub fn selector(&self) -> &str {
        &self.selector
    }

    /// One list call (field selector `spec.nodeName`, the label selector).
    /// Every failure is an error: the caller then reaps nothing on this
    /// ground.
    pub async fn list(&self, node_name: &str) -> Result<AgentPodList> {
        let lp = ListParams::default()
            .labels(&self.selector)
            .fields(&format!("spec.nodeName={node_name}"));
        let pods = tokio::time::timeout(self.timeout, self.api.list(&lp))
            .await
            .map_err(|_| {
                JanitorError::AgentPodsUnavailable(format!("no answer within {:?}", self.timeout))
            })?
            .map_err(|e| JanitorError::AgentPodsUnavailable(e.to_string()))?;
        Ok(pod_list(node_name, pods.items))
    }
}

/// The evidence in a list answer.
pub(crate) fn pod_list(node_name: &str, pods: Vec<Pod>) -> AgentPodList {
    let mut out = AgentPodList::default();
    for p in pods {
        // The field selector already says so; a server that ignored it must
        // not make another node's pod count here.
        let node = p.spec.as_ref().and_then(|s| s.node_name.as_deref());
        if node != Some(node_name) {
            continue;
        }
        let Some(uid) = p.metadata.uid.clone().filter(|u| !u.is_empty()) else {
            continue;
        };
        let status = p.status.as_ref();
        // A pod that has terminated for good runs no agent (its containers
        // do not restart): its sandboxes lost their agent. A terminating pod
        // still counts — its agent may still serve.
        if matches!(
            status.and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        ) {
            continue;
        }
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        if ready {
            out.ready.insert(uid.clone());
        }
        out.uids.insert(uid);
    }
    out
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{PodCondition, PodSpec, PodStatus};
    use kube::api::ObjectMeta;

    use super::*;

    fn pod(uid: &str, node: &str, phase: &str, ready: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                uid: Some(uid.into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some(phase.into()),
                conditions: ready.map(|r| {
                    vec![
                        PodCondition {
                            type_: "PodScheduled".into(),
                            status: "True".into(),
                            ..Default::default()
                        },
                        PodCondition {
                            type_: "Ready".into(),
                            status: r.into(),
                            ..Default::default()
                        },
                    ]
                }),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn uids_and_readiness_of_this_nodes_live_agent_pods() {
        let l = pod_list(
            "n1",
            vec![
                pod("ready", "n1", "Running", Some("True")),
                pod("starting", "n1", "Running", Some("False")),
                pod("pending", "n1", "Pending", None),
                pod("failed", "n1", "Failed", Some("False")),
                pod("done", "n1", "Succeeded", None),
                pod("elsewhere", "n2", "Running", Some("True")),
            ],
        );
        assert_eq!(
            l.uids.iter().map(String::as_str).collect::<Vec<_>>(),
            ["pending", "ready", "starting"]
        );
        assert_eq!(
            l.ready.iter().map(String::as_str).collect::<Vec<_>>(),
            ["ready"]
        );
    }
}
