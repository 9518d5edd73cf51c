//! The leader's SandboxTemplate reconciler: publishes each template's
//! [`assess`]ment as its status, for the generation it assessed.
//!
//! Watch-driven (a template is assessed as soon as it is created or
//! edited), with a resync every [`RESYNC_PERIOD`] over the watch's cache
//! that retries status writes which failed. A template whose status already
//! says what the assessment says is not written again (the reconciler's own
//! writes come back through the watch as no-ops).

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::reflector;
use kube::runtime::{WatchStreamExt, watcher};
use sandbolt_deploy::template::{
    FAILED_CONDITION, READY_CONDITION, SandboxTemplate, SandboxTemplateStatus, TemplatePhase,
};

use super::{IGNORED_WHY, assess};

/// How often every known template is checked again.
pub const RESYNC_PERIOD: Duration = Duration::from_secs(30);

/// The status `t` should show; `now` stamps conditions whose status changes.
pub fn desired_status(t: &SandboxTemplate, now: &Time) -> SandboxTemplateStatus {
    let generation = t.metadata.generation;
    let current = t.status.as_ref();
    let condition = |type_: &str, status: bool, reason: &str, message: String| {
        let status = if status { "True" } else { "False" };
        // lastTransitionTime moves only when the condition's status does.
        let since = current
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
            .filter(|c| c.status == status)
            .map_or_else(|| now.clone(), |c| c.last_transition_time.clone());
        Condition {
            type_: type_.into(),
            status: status.into(),
            observed_generation: generation,
            reason: reason.into(),
            message,
            last_transition_time: since,
        }
    };
    match assess(&t.spec) {
        Ok(d) => {
            let mut message = format!("sandboxes run {}", d.manifest_ref);
            if !d.ignored.is_empty() {
                message.push_str(&format!(
                    "; ignored: {} ({IGNORED_WHY})",
                    d.ignored.join(", ")
                ));
            }
            SandboxTemplateStatus {
                phase: Some(TemplatePhase::Succeeded),
                manifest_ref: Some(d.manifest_ref),
                observed_generation: generation,
                conditions: vec![condition(READY_CONDITION, true, "ImageResolved", message)],
            }
        }
        Err(why) => SandboxTemplateStatus {
            phase: Some(TemplatePhase::Failed),
            manifest_ref: None,
            observed_generation: generation,
            // Failed first: the OpenSandbox server shows the message of the
            // first condition it finds once the phase is Failed.
            conditions: vec![
                condition(FAILED_CONDITION, true, "InvalidSpec", why.clone()),
                condition(READY_CONDITION, false, "InvalidSpec", why),
            ],
        },
    }
}

/// Writes `t`'s status when it differs from [`desired_status`]; true when
/// written. `client` reaches the template's namespace.
#[tracing::instrument(skip_all, fields(namespace = %t.namespace().unwrap_or_default(), template = %t.name_any()))]
pub async fn reconcile(client: &kube::Client, t: &SandboxTemplate) -> Result<bool, kube::Error> {
    let desired = desired_status(t, &Time(Timestamp::now()));
    if t.status.as_ref() == Some(&desired) {
        return Ok(false);
    }
    let mut body = serde_json::to_value(&desired).expect("a status serializes");
    // A merge patch keeps what it does not mention: a template that failed
    // has no manifest, say so.
    body["manifestRef"] = serde_json::json!(desired.manifest_ref);
    let api: Api<SandboxTemplate> =
        Api::namespaced(client.clone(), &t.namespace().unwrap_or_default());
    match api
        .patch_status(
            &t.name_any(),
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({ "status": body })),
        )
        .await
    {
        Ok(_) => {
            tracing::info!(phase = ?desired.phase, "template status written");
            Ok(true)
        }
        // Deleted since the watch saw it: nothing to show it on.
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Reconciles the templates of `templates` (all namespaces) until aborted.
pub fn spawn(templates: Api<SandboxTemplate>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        if let Some(why) = super::catalog::unavailable(&templates).await {
            tracing::warn!("{why}; no template status is written");
            return;
        }
        let client = templates.clone().into_client();
        let (cache, writer) = reflector::store();
        let changed = reflector(
            writer,
            watcher(templates, watcher::Config::default()).default_backoff(),
        )
        .applied_objects();
        let mut changed = std::pin::pin!(changed);
        let mut resync =
            tokio::time::interval_at(tokio::time::Instant::now() + RESYNC_PERIOD, RESYNC_PERIOD);
        resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let batch = tokio::select! {
                ev = changed.next() => match ev {
                    Some(Ok(t)) => vec![std::sync::Arc::new(t)],
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "sandboxtemplates watch failed; retrying");
                        continue;
                    }
                    None => return,
                },
                _ = resync.tick() => cache.state(),
            };
            for t in batch {
                if let Err(e) = reconcile(&client, &t).await {
                    tracing::warn!(template = %t.name_any(), error = %e, "template status not written; will retry");
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbolt_deploy::SandboxTemplateSpec;

    fn template(image: &str, generation: i64) -> SandboxTemplate {
        let mut t = SandboxTemplate::new(
            "tpl-1",
            SandboxTemplateSpec {
                image: image.into(),
                kernel: Some("vmlinux.bin".into()),
                ..Default::default()
            },
        );
        t.metadata.namespace = Some("team".into());
        t.metadata.generation = Some(generation);
        t
    }

    fn at(seconds: i64) -> Time {
        Time(Timestamp::from_second(seconds).unwrap())
    }

    #[test]
    fn a_valid_image_succeeds_and_says_what_is_ignored() {
        let s = desired_status(&template("busybox", 3), &at(10));
        assert_eq!(s.phase, Some(TemplatePhase::Succeeded));
        assert_eq!(
            s.manifest_ref.as_deref(),
            Some("docker.io/library/busybox:latest")
        );
        assert_eq!(s.observed_generation, Some(3));
        let ready = &s.conditions[0];
        assert_eq!(
            (ready.type_.as_str(), ready.status.as_str()),
            ("Ready", "True")
        );
        assert!(
            ready.message.contains("ignored: kernel"),
            "{}",
            ready.message
        );
        assert_eq!(ready.observed_generation, Some(3));
    }

    #[test]
    fn an_invalid_image_fails_with_a_failed_condition_first() {
        let s = desired_status(&template("UPPER/case!", 1), &at(10));
        assert_eq!(s.phase, Some(TemplatePhase::Failed));
        assert_eq!(s.manifest_ref, None);
        assert_eq!(s.conditions[0].type_, "Failed");
        assert!(s.conditions[0].message.starts_with("spec.image"));
        assert_eq!(s.conditions[1].status, "False");
    }

    #[test]
    fn transition_times_move_only_with_the_condition_status() {
        let mut t = template("busybox", 1);
        t.status = Some(desired_status(&t, &at(10)));
        // Same verdict for a new generation: same time, new generation.
        t.metadata.generation = Some(2);
        let s = desired_status(&t, &at(20));
        assert_eq!(s.conditions[0].last_transition_time, at(10));
        assert_eq!(s.observed_generation, Some(2));
        // Unchanged template: the desired status is the current one.
        t.status = Some(s.clone());
        assert_eq!(desired_status(&t, &at(30)), s);
        // The verdict flips: the Ready condition's time moves.
        t.spec.image = "Bad Image".into();
        let s = desired_status(&t, &at(40));
        assert_eq!(s.conditions[1].last_transition_time, at(40));
    }
}
