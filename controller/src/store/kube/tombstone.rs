//! Tombstones: what an expiry leaves of a Sandbox resource. fast-sandbox
//! keeps an expired sandbox's resource with runtime state Stopped, which the
//! OpenSandbox server (1.1.1, `status_mapping.py`) shows as `Terminated`
//! rather than 404, and deletes it the way it deletes any Terminated sandbox
//! (FastPath `DeleteSandbox`). The store does the same: the container is
//! gone, the resource stays without the controller's state annotation and
//! finalizer (so it is no record: no read returns it, and a delete from
//! anyone removes it at once), marked with [`EXPIRED_ANNOTATION`], its status
//! Stopped with a Ready condition False for reason `Expired`. The leader's
//! status publisher removes it after the retention
//! (`KubeStoreConfig::expired_sandbox_retention`); a create of the same name
//! replaces it.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::PostParams;
use kube::{Api, ResourceExt};
use sandbolt_deploy::sandbox::{
    DataPlaneState, DataPlaneStatus, FINALIZER, READY_CONDITION, RuntimeState, RuntimeStatus,
};
use sandbolt_deploy::{Sandbox, SandboxStatus};

use super::{STATE_ANNOTATION, delete_of_uid};

/// Marks a tombstone; its value is when the sandbox expired (RFC 3339).
pub const EXPIRED_ANNOTATION: &str = "sandbolt.io/expired-at";

/// The Ready condition's reason on a tombstone.
pub const EXPIRED_REASON: &str = "Expired";

/// What [`bury`] found.
pub(super) enum Burial {
    /// The tombstone as written (status included, unless that write failed:
    /// the status publisher then writes it).
    Tombstone(Box<Sandbox>),
    /// No object of that uid any more.
    Gone,
    /// Its deletion was asked for meanwhile: an ordinary delete finishes it.
    Terminating,
}

pub(super) fn is_tombstone(obj: &Sandbox) -> bool {
    let annotations = obj.annotations();
    annotations.contains_key(EXPIRED_ANNOTATION) && !annotations.contains_key(STATE_ANNOTATION)
}

fn expired_at(obj: &Sandbox) -> Option<Timestamp> {
    obj.annotations().get(EXPIRED_ANNOTATION)?.parse().ok()
}

/// True once a tombstone has been kept for `retention` (or its mark is
/// unreadable: nothing says it should stay).
pub(super) fn outlived(obj: &Sandbox, retention: Duration, now: Timestamp) -> bool {
    expired_at(obj).is_none_or(|t| {
        now.duration_since(t)
            .try_into()
            .is_ok_and(|kept: Duration| kept >= retention)
    })
}

/// The status a tombstone shows: runtime Stopped (the server's
/// `Terminated`, checked before any of its failure rules), data plane
/// Unavailable (no route is left), Ready False for reason Expired.
pub(super) fn tombstone_status(obj: &Sandbox) -> SandboxStatus {
    let at = expired_at(obj).unwrap_or_default();
    let when = Time(at);
    let message = format!("the sandbox expired at {at}; its container was removed");
    let generation = obj.metadata.generation.unwrap_or(1);
    SandboxStatus {
        runtime: Some(RuntimeStatus {
            state: RuntimeState::Stopped,
            message: Some(message.clone()),
            last_transition_time: Some(when.clone()),
        }),
        data_plane: Some(DataPlaneStatus {
            state: DataPlaneState::Unavailable,
            endpoint: None,
            message: None,
            last_transition_time: Some(when.clone()),
        }),
        conditions: vec![Condition {
            type_: READY_CONDITION.into(),
            status: "False".into(),
            observed_generation: Some(generation),
            reason: EXPIRED_REASON.into(),
            message,
            last_transition_time: when,
        }],
        observed_generation: Some(generation),
        agent_id: obj.status.as_ref().and_then(|s| s.agent_id.clone()),
        node_name: None,
        action_bindings: Vec::new(),
    }
}

/// Turns the Sandbox `name` of `uid` into a tombstone expired at `now`:
/// one main write (annotations, finalizer; guarded by resourceVersion,
/// retried on a conflict), then its status.
pub(super) async fn bury(
    api: Api<Sandbox>,
    name: String,
    uid: Option<String>,
    now: Timestamp,
) -> Result<Burial, kube::Error> {
    let marked = loop {
        let Some(mut obj) = api.get_opt(&name).await? else {
            return Ok(Burial::Gone);
        };
        if obj.metadata.uid != uid {
            return Ok(Burial::Gone);
        }
        if obj.metadata.deletion_timestamp.is_some() {
            return Ok(Burial::Terminating);
        }
        let annotations = obj.annotations_mut();
        annotations.remove(STATE_ANNOTATION);
        annotations.insert(EXPIRED_ANNOTATION.into(), now.to_string());
        obj.finalizers_mut().retain(|f| f != FINALIZER);
        match api.replace(&name, &PostParams::default(), &obj).await {
            Ok(o) => break o,
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Burial::Gone),
            Err(e) => return Err(e),
        }
    };
    let mut desired = marked.clone();
    desired.status = Some(tombstone_status(&marked));
    match api
        .replace_status(&name, &PostParams::default(), &desired)
        .await
    {
        Ok(written) => Ok(Burial::Tombstone(Box::new(written))),
        Err(error) => {
            tracing::warn!(sandbox = %name, %error, "tombstone status not written; the status publisher retries");
            Ok(Burial::Tombstone(Box::new(marked)))
        }
    }
}

/// Deletes the tombstone `obj` (that uid only: a sandbox created under the
/// name meanwhile stays). Already gone counts as removed.
pub(super) async fn remove(api: Api<Sandbox>, obj: &Sandbox) -> Result<(), kube::Error> {
    match api
        .delete(&obj.name_any(), &delete_of_uid(obj.metadata.uid.clone()))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tombstone(expired: &str) -> Sandbox {
        let mut o = Sandbox::new("fsb-1", Default::default());
        o.metadata.generation = Some(3);
        o.annotations_mut()
            .insert(EXPIRED_ANNOTATION.into(), expired.into());
        o
    }

    #[test]
    fn a_tombstone_reads_stopped_and_not_ready_for_reason_expired() {
        let o = tombstone("2026-01-02T03:04:05Z");
        assert!(is_tombstone(&o));
        let s = tombstone_status(&o);
        assert_eq!(s.runtime.as_ref().unwrap().state, RuntimeState::Stopped);
        let ready = &s.conditions[0];
        assert_eq!(
            (
                ready.type_.as_str(),
                ready.status.as_str(),
                ready.reason.as_str()
            ),
            (READY_CONDITION, "False", EXPIRED_REASON)
        );
        assert_eq!(ready.last_transition_time.0.as_second(), 1_767_323_045);
        assert_eq!(s.observed_generation, Some(3));
        // JSON as the server reads it: "RUNTIME_STATE_" + upper("Stopped").
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["runtime"]["state"], "Stopped");
    }

    #[test]
    fn a_record_is_no_tombstone_even_with_the_mark() {
        let mut o = tombstone("2026-01-02T03:04:05Z");
        o.annotations_mut()
            .insert(STATE_ANNOTATION.into(), "{}".into());
        assert!(!is_tombstone(&o));
    }

    #[test]
    fn a_tombstone_outlives_its_retention_only_after_it() {
        let o = tombstone("2026-01-02T03:04:05Z");
        let at: Timestamp = "2026-01-02T03:04:05Z".parse().unwrap();
        let hour = Duration::from_secs(3600);
        assert!(!outlived(&o, hour, at));
        assert!(!outlived(&o, hour, at + Duration::from_secs(3599)));
        assert!(outlived(&o, hour, at + Duration::from_secs(3600)));
        assert!(outlived(&tombstone("garbage"), hour, at));
    }
}
