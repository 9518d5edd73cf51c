//! Ephemeral-storage limits: the writable layer of a sandbox (its overlay
//! snapshot's upper directory) is measured every `--log-check-interval`
//! through containerd's `snapshots.Usage` (for an active overlayfs snapshot
//! containerd sums the upper directory's allocated blocks), and a sandbox
//! over its `resources.ephemeral_storage` is stopped (SIGKILL to all its
//! processes) with the reason in its status message, e.g. "ephemeral
//! storage 50Mi over its 20Mi limit", as the kubelet evicts a pod.
//!
//! The overlay has no quota of its own on this node's filesystems, so the
//! limit is enforced after the fact: a sandbox can overshoot by what it
//! writes in one interval before it is stopped. The reason is also kept in
//! a container label, so a restarted agent still reports it.

use std::sync::Arc;
use std::time::Duration;

use containerd_client::services::v1::snapshots::UsageRequest;
use containerd_client::services::v1::{GetContainerRequest, KillRequest};
use sandbolt_proto::agent::v1::SandboxSpec;
use tokio::sync::watch;

use crate::error::{AgentError, Result};
use crate::sandbox::Sandboxes;

/// Container label holding the limit in bytes (recovery reads it back).
pub const LIMIT_LABEL: &str = "io.sandbolt.ephemeral-storage-limit";
/// Container label holding why the agent stopped the sandbox.
pub const STOP_REASON_LABEL: &str = "io.sandbolt.stop-reason";

/// The request's ephemeral-storage limit in bytes; 0 when it sets none.
pub fn limit_of(spec: &SandboxSpec) -> Result<u64> {
    let q = spec
        .resources
        .as_ref()
        .map_or("", |r| r.ephemeral_storage.trim());
    if q.is_empty() {
        return Ok(0);
    }
    let bytes = sandbolt_proto::quantity::bytes(q)
        .map_err(|e| AgentError::InvalidArgument(format!("resources.ephemeral_storage: {e}")))?;
    if bytes == 0 {
        return Err(AgentError::InvalidArgument(
            "resources.ephemeral_storage must be more than 0 bytes (leave it unset for no limit)"
                .into(),
        ));
    }
    Ok(bytes)
}

/// Measures every limited sandbox's writable layer each `interval` until
/// shutdown.
pub async fn run(
    sandboxes: Arc<Sandboxes>,
    snapshotter: String,
    interval: Duration,
    shutdown: watch::Receiver<bool>,
) {
    crate::log_rotation::each_interval(interval, shutdown, || async {
        for (id, limit) in sandboxes.storage_limited() {
            if let Err(e) = check(&sandboxes, &snapshotter, &id, limit).await {
                tracing::warn!(sandbox = %id, error = %e, "measuring the writable layer failed");
            }
        }
    })
    .await;
}

/// Measures one sandbox; stops it when over `limit`.
async fn check(sandboxes: &Sandboxes, snapshotter: &str, id: &str, limit: u64) -> Result<()> {
    let ctrd = sandboxes.containerd();
    // A prepared snapshot's key is not the sandbox id: the container says.
    let container = ctrd
        .containers()
        .get(ctrd.req(GetContainerRequest { id: id.to_string() }))
        .await
        .map_err(AgentError::containerd("containers.Get"))?
        .into_inner()
        .container
        .ok_or_else(|| AgentError::SandboxNotFound(id.to_string()))?;
    let used = ctrd
        .snapshots()
        .usage(ctrd.req(UsageRequest {
            snapshotter: snapshotter.to_string(),
            key: container.snapshot_key,
        }))
        .await
        .map_err(AgentError::containerd("snapshots.Usage"))?
        .into_inner()
        .size;
    let used = u64::try_from(used).unwrap_or(0);
    if used <= limit {
        return Ok(());
    }
    let reason = format!(
        "ephemeral storage {} over its {} limit: the sandbox was stopped",
        human_bytes(used),
        human_bytes(limit)
    );
    tracing::warn!(sandbox = %id, used, limit, "{reason}");
    // The reason first: the exit event that follows keeps the message.
    sandboxes.set_message(id, &reason);
    if let Err(e) = ctrd
        .set_container_label(id, STOP_REASON_LABEL, &reason)
        .await
    {
        tracing::warn!(sandbox = %id, error = %e, "could not keep the stop reason in a label");
    }
    ctrd.tasks()
        .kill(ctrd.req(KillRequest {
            container_id: id.to_string(),
            exec_id: String::new(),
            signal: 9,
            all: true,
        }))
        .await
        .map_err(AgentError::containerd("tasks.Kill"))?;
    Ok(())
}

/// `bytes` in binary units as Kubernetes quantities write them ("20Mi",
/// "1.2Gi"); whole numbers without a fraction.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("Ti", 1 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ];
    for (unit, size) in UNITS {
        if bytes >= size {
            if bytes.is_multiple_of(size) {
                return format!("{}{unit}", bytes / size);
            }
            return format!("{:.1}{unit}", bytes as f64 / size as f64);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sandbolt_proto::agent::v1::Resources;

    #[test]
    fn sizes_read_as_quantities() {
        assert_eq!(human_bytes(20 << 20), "20Mi");
        assert_eq!(human_bytes((1 << 30) + (1 << 30) / 5), "1.2Gi");
        assert_eq!(human_bytes(512), "512");
        assert_eq!(human_bytes(1536), "1.5Ki");
    }

    #[test]
    fn the_limit_is_parsed_and_named_when_wrong() {
        let spec = |q: &str| SandboxSpec {
            resources: Some(Resources {
                ephemeral_storage: q.into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(limit_of(&SandboxSpec::default()).unwrap(), 0);
        assert_eq!(limit_of(&spec("20Mi")).unwrap(), 20 << 20);
        let e = limit_of(&spec("lots")).unwrap_err().to_string();
        assert!(e.contains("resources.ephemeral_storage"), "{e}");
        let e = limit_of(&spec("0")).unwrap_err().to_string();
        assert!(e.contains("resources.ephemeral_storage"), "{e}");
    }
}
