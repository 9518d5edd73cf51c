//! Warm images: the images of this agent's pool (`SandboxPool.warmImages`)
//! are kept present on the node, so the first sandbox of such an image on
//! any agent of the pool pulls nothing.
//!
//! Each warm image has its own background task: it looks the image up and,
//! when it is missing, pulls it (bounded by `pull_timeout`, retried with
//! exponential backoff, every failure logged). Nothing waits for it: the
//! agent serves, and creates of other images (or of the same image, which
//! then waits for that one pull, see [`crate::images::Images::resolve_or_pull`])
//! proceed while a warm image is still on its way. A present image is looked
//! up again every `warm_recheck_interval` and pulled again if removed.
//!
//! Once pulled, a warm image is simply an image in the store, so the
//! inventory (and with it every heartbeat) reports it like any other and the
//! controller's image affinity sees it. Nothing in the agent or the janitor
//! removes images (they remove only a sandbox's own writable snapshot), and
//! containerd's garbage collector collects only content no image record,
//! lease or container references: the image record roots its index,
//! manifest, config and layers, and the config's `gc.ref.snapshot` label
//! roots the unpacked snapshots. What could remove it is the kubelet's
//! image garbage collection in the shared `k8s.io` namespace; the warm image
//! is pinned for the CRI plugin against that ([`crate::images::CRI_PINNED_LABEL`]).

use std::sync::Arc;
use std::time::Duration;

use backon::Retryable;
use sandbolt_node::retry;
use tokio::sync::watch;

use crate::config::AgentConfig;
use crate::error::{AgentError, Result};
use crate::sandbox::Sandboxes;
use sandbolt_image_ref::ImageRef;

/// First wait after a failed attempt; doubled per failure up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Checks the configured warm images: an unparsable reference is a
/// configuration mistake, reported when the agent starts rather than retried
/// forever in the background.
pub fn validate(cfg: &AgentConfig) -> Result<()> {
    for r in &cfg.warm_images {
        ImageRef::parse(r).map_err(|e| AgentError::InvalidArgument(format!("warm image: {e}")))?;
    }
    Ok(())
}

/// The background task keeping `reference` present; ends on shutdown.
pub async fn keep_warm(
    sandboxes: Arc<Sandboxes>,
    recheck: Duration,
    reference: String,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut present = false;
    loop {
        // A shutdown ends a pull under way too: dropping the future kills
        // the `ctr` child (kill_on_drop).
        let failures = tokio::select! {
            _ = shutdown.wait_for(|s| *s) => return,
            failures = ensure_with_retries(&sandboxes, &reference, &mut present) => failures,
        };
        tracing::debug!(image = %reference, failures, "warm image checked");
        tokio::select! {
            _ = shutdown.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(recheck) => {}
        }
    }
}

/// [`ensure`] until it succeeds, with exponential backoff, every failure
/// logged. Returns how many attempts failed first.
async fn ensure_with_retries(sandboxes: &Sandboxes, reference: &str, present: &mut bool) -> u32 {
    let backoff = retry::doubling(FIRST_BACKOFF, MAX_BACKOFF);
    let mut failures = 0u32;
    let ensured = (|| ensure(sandboxes, reference))
        .retry(backoff)
        .notify(|e, retry_in| {
            *present = false;
            failures += 1;
            tracing::warn!(
                image = %reference,
                attempt = failures,
                ?retry_in,
                error = %e,
                "warm image not available yet; will retry"
            );
        })
        .await;
    // Without a limit on attempts the retry only ends with a success.
    if let Ok(name) = ensured
        && !*present
    {
        tracing::info!(image = %reference, %name, after_failures = failures, "warm image present");
        *present = true;
    }
    failures
}

/// Present (pulled if missing), unpacked for the agent's snapshotter (so
/// the first create does not pay for it) and pinned; returns the image
/// record's name.
async fn ensure(sandboxes: &Sandboxes, reference: &str) -> Result<String> {
    let images = &sandboxes.images;
    let image = images
        .resolve_or_pull(reference, sandboxes.pull_options())
        .await?;
    images.ensure_unpacked(&image).await?;
    if let Err(e) = images.pin(&image.name).await {
        // The image is here and usable; only the kubelet's GC could take it,
        // and the next recheck pulls it again if so.
        tracing::warn!(image = %image.name, error = %e, "could not pin warm image");
    }
    Ok(image.name.clone())
}
