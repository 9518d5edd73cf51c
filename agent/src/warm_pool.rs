//! The warm sandbox buffer (warm pools): keeps as many started, unclaimed
//! sandboxes of each class as the controller's targets say (the whole set
//! arrives with every heartbeat answer; none are kept before the first).
//! Not to be confused with [`crate::warm`] (warm images).
//!
//! One reconcile loop per agent, woken by a target change, a claim, a warm
//! sandbox's exit, a create, and every [`WarmPool`] interval. Each pass:
//! removes warm sandboxes that exited; trims classes above their target or
//! no longer targeted (a drained pool), and warm sandboxes beyond the
//! agent's capacity (users + warm > max_sandboxes); then starts at most one
//! warm sandbox for the first class below target, and only while users +
//! warm < max_sandboxes. Starts are one at a time with a pause in between.
//! A start yields to user creates: while one is in flight the start waits,
//! but for at most [`MAX_DEFER`]; under sustained load the buffer would
//! otherwise never refill and every create would pay a cold start, and one
//! background start at a time takes one runc's worth of CPU, not the node's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sandbolt_proto::agent::v1::{WarmClass, WarmTarget};
use tokio::sync::{Notify, watch};

use crate::sandbox::{Sandboxes, WarmView};

pub struct WarmPool {
    sandboxes: Arc<Sandboxes>,
    /// The controller's last targets; `None` until it sent any.
    targets: Mutex<Option<Vec<WarmTarget>>>,
    wake: Arc<Notify>,
    /// Between two passes without a wake-up.
    interval: Duration,
    /// After each start (paces refills).
    pause: Duration,
    /// Since when a start has been waiting for user creates to finish.
    deferred_since: Mutex<Option<Instant>>,
}

/// The longest a due refill waits for user creates in flight.
const MAX_DEFER: Duration = Duration::from_millis(500);

/// What one pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// Nothing to start.
    Idle,
    /// A start is due but yields to user creates in flight.
    Deferred,
    /// Started one warm sandbox: look again after the pause.
    Started,
    /// A start failed: retry after the interval, not at once.
    Failed,
}

impl WarmPool {
    pub fn new(sandboxes: Arc<Sandboxes>, interval: Duration, pause: Duration) -> Self {
        Self {
            wake: sandboxes.warm_wake(),
            sandboxes,
            targets: Mutex::new(None),
            interval,
            pause,
            deferred_since: Mutex::new(None),
        }
    }

    /// Replaces the targets (the whole desired set; a class missing here is
    /// drained) and wakes the loop.
    pub fn set_targets(&self, targets: Vec<WarmTarget>) {
        *self.targets.lock() = Some(targets);
        self.wake.notify_one();
    }

    /// The last targets, `None` before the first.
    pub fn targets(&self) -> Option<Vec<WarmTarget>> {
        self.targets.lock().clone()
    }

    /// Runs until `shutdown`. A start in progress is finished first (it is
    /// bounded by execd's ready timeout): an abandoned one would leave a
    /// container behind.
    pub async fn run(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        loop {
            if *shutdown.borrow() {
                return;
            }
            let wait = match self.reconcile().await {
                Pass::Started => self.pause,
                // Look again once the deferral ends, woken or not.
                Pass::Deferred => MAX_DEFER,
                Pass::Idle | Pass::Failed => self.interval,
            };
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                () = self.wake.notified(), if wait != self.pause => {}
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// One pass (see the module docs).
    async fn reconcile(&self) -> Pass {
        let warm = self.sandboxes.warm_sandboxes();
        for w in warm.iter().filter(|w| w.exited) {
            tracing::info!(sandbox = %w.id, warm_pool = %w.class.warm_pool, "warm sandbox exited: replacing it");
            self.sandboxes.discard_warm(&w.id).await;
        }
        let warm: Vec<WarmView> = warm.into_iter().filter(|w| !w.exited).collect();
        let targets = self.normalized_targets();
        for id in self.surplus(&warm, targets.as_deref()) {
            self.sandboxes.discard_warm(&id).await;
        }
        let Some(targets) = targets else {
            return Pass::Idle;
        };
        let class = match self.next_to_start(&targets) {
            Ok(Some(class)) => class,
            Ok(None) => return Pass::Idle,
            Err(Deferred) => return Pass::Deferred,
        };
        match self.sandboxes.start_warm(&class).await {
            Ok(_) => Pass::Started,
            Err(e) => {
                tracing::warn!(warm_pool = %class.warm_pool, image = %class.image, error = %e, "could not start a warm sandbox; retrying later");
                Pass::Failed
            }
        }
    }

    /// The targets with their classes as the sandbox table reports them.
    fn normalized_targets(&self) -> Option<Vec<(WarmClass, usize)>> {
        let targets = self.targets.lock().clone()?;
        Some(
            targets
                .iter()
                .map(|t| {
                    let class = self
                        .sandboxes
                        .normalize_class(&t.class.clone().unwrap_or_default());
                    (class, usize::try_from(t.count).unwrap_or(0))
                })
                .collect(),
        )
    }

    /// Warm sandboxes to remove: those of classes above target or not
    /// targeted (newest first, so the longest-ready stay), then as many as
    /// the agent is over capacity. Before the first targets only capacity
    /// trims.
    fn surplus(&self, warm: &[WarmView], targets: Option<&[(WarmClass, usize)]>) -> Vec<String> {
        let mut keep: Vec<&WarmView> = Vec::new();
        let mut out = Vec::new();
        match targets {
            None => keep.extend(warm),
            Some(targets) => {
                for w in warm.iter().rev() {
                    let allowed = targets
                        .iter()
                        .find(|(c, _)| *c == w.class)
                        .map_or(0, |(_, n)| *n);
                    let held = keep.iter().filter(|k| k.class == w.class).count();
                    if held < allowed {
                        keep.push(w);
                    } else {
                        out.push(w.id.clone());
                    }
                }
            }
        }
        let occupancy = self.sandboxes.occupancy();
        let room = self
            .sandboxes
            .max_sandboxes()
            .saturating_sub(occupancy.users);
        // Ready ones only (a starting one is this loop's own, and done).
        let over = keep.len().saturating_sub(room);
        out.extend(
            keep.iter()
                .filter(|w| w.ready)
                .take(over)
                .map(|w| w.id.clone()),
        );
        out
    }

    /// The first class below its target, when a start is allowed now;
    /// `Err(Deferred)` while it yields to user creates.
    fn next_to_start(&self, targets: &[(WarmClass, usize)]) -> Result<Option<WarmClass>, Deferred> {
        let occupancy = self.sandboxes.occupancy();
        if occupancy.users + occupancy.warm >= self.sandboxes.max_sandboxes() {
            return Ok(None);
        }
        let warm = self.sandboxes.warm_sandboxes();
        let Some(class) = targets
            .iter()
            .find(|(class, n)| warm.iter().filter(|w| w.class == *class).count() < *n)
            .map(|(class, _)| class.clone())
        else {
            *self.deferred_since.lock() = None;
            return Ok(None);
        };
        let mut deferred = self.deferred_since.lock();
        if occupancy.creates_in_flight > 0 {
            let since = *deferred.get_or_insert_with(Instant::now);
            if since.elapsed() < MAX_DEFER {
                return Err(Deferred);
            }
        }
        *deferred = None;
        Ok(Some(class))
    }
}

/// A due start waiting for user creates (see [`MAX_DEFER`]).
struct Deferred;
