//! Prepared writable snapshots: the cold path's `snapshots.Prepare`, done
//! ahead of creates. For the images the agent expects — its warm images,
//! the images of its warm pool classes, and the images of its latest cold
//! creates — it keeps [`crate::AgentConfig::prepared_snapshots`] (K)
//! snapshots prepared on top of the unpacked image, keyed
//! `sandbolt-prepared-<uuid>` ([`labels::PREPARED_KEY_PREFIX`]). A cold
//! create of such an image takes one: its container is created with that
//! key as `snapshot_key`, and the task's rootfs mounts come from
//! `snapshots.Mounts` (no `Prepare` on the create's path). Everything that
//! removes a sandbox's snapshot uses the container's `snapshot_key`.
//!
//! Labels: [`labels::PREPARED`] (the agent id), [`labels::AGENT_INSTANCE`]
//! (this agent process) and `containerd.io/gc.root` (nothing references a
//! prepared snapshot until a container does; containerd's GC would take it
//! otherwise). Whoever removes one: the create's teardown once a container
//! took it; this agent at shutdown ([`Prepared::drain`]); a restarted agent
//! ([`Prepared::remove_stale`], every one of its agent id no container
//! references); the janitor for one whose agent process is gone.
//!
//! Refill: one loop ([`run`]), woken by a take and every interval; one
//! `Prepare` at a time with a short pause in between, yielding to creates in
//! flight (for at most [`MAX_DEFER`], as the warm sandbox refills do).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use containerd_client::types::Mount;
use parking_lot::Mutex;
use tokio::sync::{Notify, watch};

use crate::containerd::Containerd;
use crate::error::{AgentError, Result};
use crate::labels;
use crate::sandbox::Sandboxes;
use crate::warm_pool::WarmPool;

/// Images of the latest cold creates kept prepared for (besides warm images
/// and warm classes).
pub const RECENT_IMAGES: usize = 2;
/// The longest a due refill waits for creates in flight.
const MAX_DEFER: Duration = Duration::from_millis(500);
/// Between two refills (one `Prepare` each).
const PAUSE: Duration = Duration::from_millis(20);
/// How often a deferred refill looks again.
const DEFER_STEP: Duration = Duration::from_millis(50);

/// The prepared snapshots of one agent process.
pub struct Prepared {
    ctrd: Containerd,
    snapshotter: String,
    agent_id: String,
    instance_id: String,
    per_image: usize,
    state: Mutex<State>,
    wake: Notify,
    deferred_since: Mutex<Option<Instant>>,
}

#[derive(Default)]
struct State {
    /// Parent (the image's chain id) → keys ready to take, oldest first.
    ready: HashMap<String, Vec<String>>,
    /// Parents of the latest cold creates, newest first.
    recent: Vec<String>,
    /// Sandbox id → the prepared key its container uses (until deleted).
    taken: HashMap<String, String>,
}

/// What one refill pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Idle,
    Deferred,
    Prepared,
    Failed,
}

impl Prepared {
    pub fn new(
        ctrd: Containerd,
        snapshotter: &str,
        agent_id: &str,
        instance_id: &str,
        per_image: usize,
    ) -> Self {
        Self {
            ctrd,
            snapshotter: snapshotter.to_string(),
            agent_id: agent_id.to_string(),
            instance_id: instance_id.to_string(),
            per_image,
            state: Mutex::new(State::default()),
            wake: Notify::new(),
            deferred_since: Mutex::new(None),
        }
    }

    /// Whether prepared snapshots are kept at all (K > 0).
    pub fn enabled(&self) -> bool {
        self.per_image > 0
    }

    /// A prepared snapshot on top of `parent` for cold create `sandbox_id`,
    /// if one is ready; the refill loop is woken either way, and `parent`
    /// counts as a recent cold create's image.
    pub fn take(&self, sandbox_id: &str, parent: &str) -> Option<String> {
        if !self.enabled() {
            return None;
        }
        let key = {
            let mut s = self.state.lock();
            s.recent.retain(|p| p != parent);
            s.recent.insert(0, parent.to_string());
            s.recent.truncate(RECENT_IMAGES);
            let key = s
                .ready
                .get_mut(parent)
                .and_then(|keys| (!keys.is_empty()).then(|| keys.remove(0)));
            if let Some(k) = &key {
                s.taken.insert(sandbox_id.to_string(), k.clone());
            }
            key
        };
        self.wake.notify_one();
        key
    }

    /// The prepared key sandbox `sandbox_id`'s container uses, if any.
    pub fn key_of(&self, sandbox_id: &str) -> Option<String> {
        self.state.lock().taken.get(sandbox_id).cloned()
    }

    /// Sandbox `sandbox_id` is gone (its snapshot with it).
    pub fn forget(&self, sandbox_id: &str) {
        self.state.lock().taken.remove(sandbox_id);
    }

    /// Recovery: sandbox `sandbox_id`'s container uses prepared key `key`.
    pub fn adopt(&self, sandbox_id: &str, key: &str) {
        self.state
            .lock()
            .taken
            .insert(sandbox_id.to_string(), key.to_string());
    }

    /// A create that took a snapshot failed before its container existed:
    /// the snapshot goes (nothing references it).
    pub async fn discard_taken(&self, sandbox_id: &str) {
        let key = self.state.lock().taken.remove(sandbox_id);
        if let Some(key) = key {
            self.remove(&key).await;
        }
    }

    /// The ready keys (all parents), for tests and diagnostics.
    pub fn ready_keys(&self) -> Vec<String> {
        let s = self.state.lock();
        let mut v: Vec<String> = s.ready.values().flatten().cloned().collect();
        v.sort();
        v
    }

    /// Ready snapshots on top of `parent`.
    pub fn ready_for(&self, parent: &str) -> usize {
        self.state.lock().ready.get(parent).map_or(0, Vec::len)
    }

    /// The rootfs mounts of prepared snapshot `key`.
    pub async fn mounts(&self, key: &str) -> Result<Vec<Mount>> {
        self.ctrd
            .snapshot_mounts(&self.snapshotter, key)
            .await
            .map_err(AgentError::containerd("snapshots.Mounts"))
    }

    /// Prepares one snapshot on top of `parent` and makes it ready.
    async fn prepare_one(&self, parent: &str) -> Result<String> {
        let key = format!(
            "{}{}",
            labels::PREPARED_KEY_PREFIX,
            uuid::Uuid::new_v4().simple()
        );
        let labels = HashMap::from([
            (labels::PREPARED.to_string(), self.agent_id.clone()),
            (labels::AGENT_INSTANCE.to_string(), self.instance_id.clone()),
            (
                labels::GC_ROOT.to_string(),
                crate::sandbox::now_ms().to_string(),
            ),
        ]);
        self.ctrd
            .prepare_snapshot(&self.snapshotter, &key, parent, labels)
            .await
            .map_err(AgentError::containerd("snapshots.Prepare"))?;
        self.state
            .lock()
            .ready
            .entry(parent.to_string())
            .or_default()
            .push(key.clone());
        Ok(key)
    }

    /// Removes snapshot `key` ("already gone" is fine).
    async fn remove(&self, key: &str) -> bool {
        match self.ctrd.remove_snapshot(&self.snapshotter, key).await {
            Ok(_) => true,
            Err(s) => {
                tracing::warn!(key, error = %s, "could not remove a prepared snapshot");
                false
            }
        }
    }

    /// At start, before anything is prepared: removes every prepared
    /// snapshot of this agent id that no container references (an earlier
    /// process's; `referenced` = the snapshot keys of this agent's
    /// containers). Returns how many it removed.
    pub async fn remove_stale(&self, referenced: &HashSet<String>) -> Result<usize> {
        let stale: Vec<String> = self
            .ctrd
            .active_snapshots(&self.snapshotter)
            .await
            .map_err(AgentError::containerd("snapshots.List"))?
            .into_iter()
            .filter(|i| {
                i.name.starts_with(labels::PREPARED_KEY_PREFIX)
                    && i.labels.get(labels::PREPARED) == Some(&self.agent_id)
                    && !referenced.contains(&i.name)
            })
            .map(|i| i.name)
            .collect();
        let mut n = 0;
        for key in stale {
            if self.remove(&key).await {
                tracing::info!(%key, "removed a prepared snapshot of an earlier agent process");
                n += 1;
            }
        }
        Ok(n)
    }

    /// At shutdown: removes the snapshots not taken (a create's is its
    /// sandbox's).
    pub async fn drain(&self) {
        let keys: Vec<String> = {
            let mut s = self.state.lock();
            s.ready.drain().flat_map(|(_, k)| k).collect()
        };
        for key in keys {
            self.remove(&key).await;
        }
    }

    /// The first parent below K, when a refill may run now.
    fn next_parent(&self, wanted: &[String], in_flight: usize) -> Option<Result<String, ()>> {
        let parent = {
            let s = self.state.lock();
            wanted
                .iter()
                .find(|p| s.ready.get(*p).map_or(0, Vec::len) < self.per_image)
                .cloned()
        };
        let mut deferred = self.deferred_since.lock();
        let Some(parent) = parent else {
            *deferred = None;
            return None;
        };
        if in_flight > 0 {
            let since = *deferred.get_or_insert_with(Instant::now);
            if since.elapsed() < MAX_DEFER {
                return Some(Err(()));
            }
        }
        *deferred = None;
        Some(Ok(parent))
    }

    /// One refill pass: prepares at most one snapshot.
    async fn refill(&self, sandboxes: &Sandboxes, images: &[String]) -> Pass {
        let mut wanted = Vec::new();
        for reference in images {
            if let Some(parent) = resolved_parent(sandboxes, reference).await
                && !wanted.contains(&parent)
            {
                wanted.push(parent);
            }
        }
        for parent in self.state.lock().recent.clone() {
            if !wanted.contains(&parent) {
                wanted.push(parent);
            }
        }
        let parent = match self.next_parent(&wanted, sandboxes.occupancy().creates_in_flight) {
            None => return Pass::Idle,
            Some(Err(())) => return Pass::Deferred,
            Some(Ok(p)) => p,
        };
        match self.prepare_one(&parent).await {
            Ok(key) => {
                tracing::debug!(%key, %parent, "prepared a snapshot");
                Pass::Prepared
            }
            Err(e) => {
                // A recent create's image may be gone: not wanted any more.
                self.state.lock().recent.retain(|p| *p != parent);
                tracing::warn!(%parent, error = %e, "could not prepare a snapshot; retrying later");
                Pass::Failed
            }
        }
    }
}

/// The snapshot parent of `reference` (its chain id, or shifted snapshot)
/// when the image is here and unpacked; never
/// pulls (warm images are pulled by [`crate::warm`]).
async fn resolved_parent(sandboxes: &Sandboxes, reference: &str) -> Option<String> {
    let image = sandboxes.images.resolve(reference).await.ok()?;
    sandboxes.images.ensure_unpacked(&image).await.ok()?;
    // With user namespaces on, the shifted snapshot (shifting the image
    // here, ahead of its creates).
    sandboxes.rootfs_parent(&image.chain_id).await.ok()
}

/// The refill loop (see the module docs), until `shutdown`.
pub async fn run(
    sandboxes: Arc<Sandboxes>,
    warm_pool: Arc<WarmPool>,
    warm_images: Vec<String>,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let prepared = sandboxes.prepared().clone();
    if !prepared.enabled() {
        return;
    }
    loop {
        if *shutdown.borrow() {
            return;
        }
        let mut images = warm_images.clone();
        for t in warm_pool.targets().unwrap_or_default() {
            if let Some(class) = t.class
                && t.count > 0
                && !images.contains(&class.image)
            {
                images.push(class.image);
            }
        }
        let wait = match prepared.refill(&sandboxes, &images).await {
            Pass::Prepared => PAUSE,
            Pass::Deferred => DEFER_STEP,
            Pass::Idle | Pass::Failed => interval,
        };
        tokio::select! {
            _ = shutdown.wait_for(|s| *s) => return,
            () = prepared.wake.notified(), if wait == interval => {}
            () = tokio::time::sleep(wait) => {}
        }
    }
}
