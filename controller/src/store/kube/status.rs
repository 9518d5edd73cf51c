//! The `status` of a Sandbox resource, for readers outside the controller:
//! kubectl and the OpenSandbox server (1.1.1 reads it in
//! `services/fast_sandbox/cr_mapping.py` and `status_mapping.py`). It is
//! derived from the record plus what the record does not hold: an exit its
//! agent reported ([`ContainerExit`]). A write's own status follows it at
//! once ([`super::KubeStore`]); the [`StatusPublisher`] catches exits, which
//! change no record, and statuses whose write failed.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, Client, ResourceExt};
use parking_lot::Mutex;
use sandbolt_deploy::Sandbox;
use sandbolt_deploy::SandboxStatus;
use sandbolt_deploy::sandbox::{
    ActionBindingStatus, ActionState, DataPlaneState, DataPlaneStatus, EGRESS_HANDLER,
    READY_CONDITION, RuntimeState, RuntimeStatus,
};

use super::{Overlay, from_object, key_of, object_ref, tombstone};
use crate::ids::SandboxKey;
use crate::store::{ContainerExit, ExitObserver, Phase, SandboxRecord};

/// Status for readers of the Sandbox: the record's phase, unless its agent
/// reported the container exited, in the states FastPath v2's GetSandbox
/// reports (`fastpath::v2::states`; a test holds them together).
/// `generation` is the object's `metadata.generation` as written.
pub(crate) fn derive_status(
    record: &SandboxRecord,
    exit: Option<&ContainerExit>,
    generation: i64,
) -> SandboxStatus {
    use DataPlaneState as D;
    use RuntimeState as R;
    // The reason is the OpenSandbox server's `status.reason`: one PascalCase
    // word, as Kubernetes condition reasons are.
    let (runtime, data_plane, reason) = match (exit, record.phase) {
        (Some(e), _) if e.failed => (R::Failed, D::Unavailable, "ContainerFailed"),
        (Some(_), _) => (R::Stopped, D::Unavailable, "ContainerExited"),
        (None, Phase::Pending) => (R::Creating, D::Pending, "Creating"),
        // Being recreated elsewhere: converging, not failed.
        (None, Phase::Recovering) => (R::Creating, D::Pending, "Recovering"),
        (None, Phase::Running) => (R::Ready, D::Ready, "Running"),
        (None, Phase::Paused) => (R::Paused, D::Unavailable, "Paused"),
        (None, Phase::Failed) => (R::Failed, D::Unavailable, "Failed"),
    };
    let ready = runtime == R::Ready && data_plane == D::Ready;
    let message = exit
        .map(|e| e.message.clone())
        .or_else(|| (!record.message.is_empty()).then(|| record.message.clone()));
    let changed = time_of(match record.last_transition_unix_ms {
        0 => record.created_at_unix_ms,
        t => t,
    });
    SandboxStatus {
        runtime: Some(RuntimeStatus {
            state: runtime,
            message: message.clone(),
            last_transition_time: Some(changed.clone()),
        }),
        data_plane: Some(DataPlaneStatus {
            state: data_plane,
            endpoint: None,
            message: None,
            last_transition_time: Some(changed.clone()),
        }),
        conditions: vec![Condition {
            type_: READY_CONDITION.into(),
            status: if ready { "True" } else { "False" }.into(),
            observed_generation: Some(generation),
            reason: reason.into(),
            message: message.unwrap_or_default(),
            last_transition_time: changed,
        }],
        observed_generation: Some(generation),
        agent_id: (!record.agent_id.is_empty()).then(|| record.agent_id.to_string()),
        node_name: None,
        action_bindings: action_bindings(record),
    }
}

/// The egress binding while a policy is set: Ready once the agent
/// confirmed it, Pending while it has not (as FastPath v2 reports it).
fn action_bindings(r: &SandboxRecord) -> Vec<ActionBindingStatus> {
    r.policy_delivery()
        .map(|d| ActionBindingStatus {
            handler: EGRESS_HANDLER.into(),
            state: if d.pending {
                ActionState::Pending
            } else {
                ActionState::Ready
            },
            message: (!d.message.is_empty()).then_some(d.message),
            last_transition_time: Some(time_of(d.since_unix_ms)),
        })
        .into_iter()
        .collect()
}

fn time_of(unix_ms: i64) -> Time {
    Time(Timestamp::from_millisecond(unix_ms).unwrap_or_default())
}

/// Keeps every Sandbox's status what its record and the observed exits
/// say: the leader's store runs one (it is started by the controller's
/// core, which knows the exits). Objects with an own write the watch has
/// not delivered yet are left to that write's status.
pub(super) struct StatusPublisher {
    pub(super) client: Client,
    pub(super) cache: kube::runtime::reflector::Store<Sandbox>,
    pub(super) overlay: Arc<Mutex<Overlay<SandboxKey, Sandbox>>>,
    pub(super) observer: ExitObserver,
    pub(super) write_timeout: Duration,
    /// How long an expired sandbox's tombstone stays.
    pub(super) tombstone_retention: Duration,
}

impl StatusPublisher {
    pub(super) async fn run(self, period: Duration) {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.publish_once().await;
        }
    }

    async fn publish_once(&self) {
        let now = Timestamp::now();
        for obj in self.cache.state() {
            let key = key_of(&obj);
            if self.overlay.lock().fresh(&key).is_some() {
                continue;
            }
            let status = if tombstone::is_tombstone(&obj) {
                if tombstone::outlived(&obj, self.tombstone_retention, now) {
                    self.remove_tombstone(&key, &obj).await;
                    continue;
                }
                tombstone::tombstone_status(&obj)
            } else {
                let Ok(Some(record)) = from_object(&obj) else {
                    continue;
                };
                let exit = (self.observer)(&record);
                derive_status(&record, exit.as_ref(), obj.metadata.generation.unwrap_or(1))
            };
            if obj.status.as_ref() == Some(&status) {
                continue;
            }
            let mut desired = (*obj).clone();
            desired.status = Some(status);
            let api: Api<Sandbox> = Api::namespaced(self.client.clone(), &key.namespace);
            let params = PostParams::default();
            let write = api.replace_status(&key.name, &params, &desired);
            match tokio::time::timeout(self.write_timeout, write).await {
                Ok(Ok(written)) => self.remember_over(&obj, written),
                // A newer version (a 409) is the next round's to check.
                Ok(Err(error)) => {
                    tracing::debug!(sandbox = %key.name, namespace = %key.namespace, %error, "status not published")
                }
                Err(_) => {
                    tracing::debug!(sandbox = %key.name, namespace = %key.namespace, "status write timed out")
                }
            }
        }
    }

    /// Deletes a tombstone kept for its retention (a failure is the next
    /// round's to retry).
    async fn remove_tombstone(&self, key: &SandboxKey, obj: &Sandbox) {
        let api: Api<Sandbox> = Api::namespaced(self.client.clone(), &key.namespace);
        match tokio::time::timeout(self.write_timeout, tombstone::remove(api, obj)).await {
            Ok(Ok(())) => {
                tracing::info!(sandbox = %key.name, namespace = %key.namespace, "expired sandbox's tombstone removed after its retention");
                let mut overlay = self.overlay.lock();
                let cached = self.cache.get(&object_ref(key));
                overlay.deleted(key.clone(), obj, cached);
            }
            Ok(Err(error)) => {
                tracing::debug!(sandbox = %key.name, namespace = %key.namespace, %error, "tombstone not removed yet")
            }
            Err(_) => {
                tracing::debug!(sandbox = %key.name, namespace = %key.namespace, "tombstone removal timed out")
            }
        }
    }

    /// Shadows the cache with `written` (a status write over `base`) while
    /// the store still shows `base`: had anything newer been seen meanwhile
    /// (the watch, an own write), `written` would hide it.
    fn remember_over(&self, base: &Sandbox, written: Sandbox) {
        let key = key_of(&written);
        let mut overlay = self.overlay.lock();
        let cached = self.cache.get(&object_ref(&key));
        let still_base = cached
            .as_ref()
            .is_some_and(|c| c.resource_version() == base.resource_version());
        if overlay.fresh(&key).is_none() && still_base {
            overlay.wrote(key, Arc::new(written), cached);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests_support::record;

    fn exit(failed: bool) -> ContainerExit {
        ContainerExit {
            failed,
            message: "entrypoint exited with status 3".into(),
        }
    }

    /// The state the OpenSandbox server 1.1.1 shows for a Sandbox with
    /// `status` at `generation`, by the rules of its `status_mapping.py`
    /// (bindings and components aside): stopped first, then the paused
    /// family, then failure, then draining, then ready, else pending.
    fn server_state(status: &SandboxStatus, generation: i64) -> &'static str {
        let runtime = status.runtime.as_ref().map(|r| r.state);
        let data_plane = status.data_plane.as_ref().map(|d| d.state);
        let cond = status
            .conditions
            .iter()
            .find(|c| c.type_ == READY_CONDITION)
            .unwrap();
        let ready = cond.status == "True"
            && cond.observed_generation.unwrap_or(0) >= generation
            && status.observed_generation.unwrap_or(0) >= generation
            && runtime == Some(RuntimeState::Ready)
            && data_plane == Some(DataPlaneState::Ready);
        match (runtime, data_plane) {
            (Some(RuntimeState::Stopped), _) => "Terminated",
            (Some(RuntimeState::Paused), _) => "Paused",
            (Some(RuntimeState::Failed | RuntimeState::Unavailable), _)
            | (_, Some(DataPlaneState::Failed | DataPlaneState::Unavailable)) => "Failed",
            (Some(RuntimeState::Stopping), _) | (_, Some(DataPlaneState::Draining)) => "Stopping",
            _ if ready => "Running",
            _ => "Pending",
        }
    }

    #[test]
    fn every_phase_and_exit_reads_as_the_server_should_show_it() {
        let cases = [
            (Phase::Pending, None, "Pending", "Creating"),
            // Recreated elsewhere: converging, not failed.
            (Phase::Recovering, None, "Pending", "Recovering"),
            (Phase::Running, None, "Running", "Running"),
            (Phase::Paused, None, "Paused", "Paused"),
            (Phase::Failed, None, "Failed", "Failed"),
            (
                Phase::Running,
                Some(exit(true)),
                "Failed",
                "ContainerFailed",
            ),
            (
                Phase::Running,
                Some(exit(false)),
                "Terminated",
                "ContainerExited",
            ),
        ];
        for (phase, exit, shown, reason) in cases {
            let mut r = record("default", "fsb-1", "");
            r.phase = phase;
            r.message = "recorded message".into();
            r.last_transition_unix_ms = 1_700_000_123_456;
            let s = derive_status(&r, exit.as_ref(), 4);
            let what = format!("{phase:?} {exit:?}");
            assert_eq!(server_state(&s, 4), shown, "{what}");
            let cond = &s.conditions[0];
            assert_eq!(cond.reason, reason, "{what}");
            assert!(
                cond.reason.starts_with(|c: char| c.is_ascii_uppercase())
                    && cond.reason.chars().all(|c| c.is_ascii_alphanumeric()),
                "{what}: a PascalCase word"
            );
            assert_eq!(
                cond.last_transition_time.0.as_millisecond(),
                1_700_000_123_456,
                "{what}"
            );
            assert_eq!(
                (cond.observed_generation, s.observed_generation),
                (Some(4), Some(4)),
                "{what}"
            );
            // An exit's message outranks the record's.
            let message = if exit.is_some() {
                "entrypoint exited with status 3"
            } else {
                "recorded message"
            };
            assert_eq!(cond.message, message, "{what}");
            // A status of an older generation is not ready, whatever it says.
            if shown == "Running" {
                assert_eq!(server_state(&s, 5), "Pending");
            }
        }
    }

    #[test]
    fn a_record_without_transitions_dates_its_status_from_its_creation() {
        let mut r = record("default", "fsb-1", "");
        r.created_at_unix_ms = 1_600_000_000_000;
        r.last_transition_unix_ms = 0;
        let s = derive_status(&r, None, 1);
        assert_eq!(
            s.conditions[0].last_transition_time.0.as_millisecond(),
            1_600_000_000_000
        );
    }

    #[test]
    fn the_egress_binding_is_pending_until_the_agent_confirms_it() {
        let mut r = record("default", "fsb-1", "");
        r.phase = Phase::Running;
        assert!(derive_status(&r, None, 1).action_bindings.is_empty());
        r.spec.network_policy_json = r#"{"defaultAction":"deny"}"#.into();
        r.network_policy_pending = true;
        r.network_policy_transition_unix_ms = 1_700_000_000_500;
        let pending = derive_status(&r, None, 1).action_bindings;
        assert_eq!(pending.len(), 1);
        assert_eq!(
            (pending[0].handler.as_str(), pending[0].state),
            ("egress", ActionState::Pending)
        );
        assert!(pending[0].message.as_deref().unwrap().contains("agent-1"));
        assert_eq!(
            pending[0]
                .last_transition_time
                .as_ref()
                .unwrap()
                .0
                .as_millisecond(),
            1_700_000_000_500
        );
        r.network_policy_pending = false;
        let ready = derive_status(&r, None, 1).action_bindings;
        assert_eq!(
            (ready[0].state, ready[0].message.as_deref()),
            (ActionState::Ready, None)
        );
        // The JSON the server reads: `state` spelled as FastPath names it.
        let v = serde_json::to_value(&ready[0]).unwrap();
        assert_eq!(v["state"], "Ready");
        assert_eq!(v["handler"], "egress");
    }
}
