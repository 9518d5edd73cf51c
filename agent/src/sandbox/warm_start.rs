//! Warm sandboxes in the table: starting one (execd in `--warm` mode under
//! its class's image, runtime and limits, the egress of a create without a
//! policy), the view the
//! warm pool and the inventory read, and removing one (trim, exit,
//! restart). The reconcile loop that decides when is `crate::warm_pool`.

use std::collections::HashMap;

use sandbolt_proto::agent::v1::WarmSandbox;

use super::*;

/// One warm sandbox as the warm pool sees it.
#[derive(Debug, Clone)]
pub struct WarmView {
    pub id: String,
    pub class: WarmClass,
    /// Claimable (execd answered); false while starting.
    pub ready: bool,
    /// Its task ended (or was never seen running): to remove and replace.
    pub exited: bool,
    pub created_at_ms: i64,
}

/// How full the agent is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Occupancy {
    /// Sandboxes of the API (every non-warm entry, creating ones included).
    pub users: usize,
    /// Warm sandboxes, ready or starting.
    pub warm: usize,
    /// User creates and claims in flight.
    pub creates_in_flight: usize,
}

/// A fresh id of the controller's shape (`sb-` + a v4 uuid): a warm
/// sandbox's id becomes the claimed sandbox's.
fn warm_id() -> String {
    format!("sb-{}", uuid::Uuid::new_v4().simple())
}

/// A warm token: 256 random bits, hex.
fn warm_token() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

impl Sandboxes {
    /// Wakes the warm pool (claims, warm exits, creates).
    pub fn warm_wake(&self) -> Arc<tokio::sync::Notify> {
        self.warm_wake.clone()
    }

    pub fn occupancy(&self) -> Occupancy {
        let table = self.table.read();
        let warm = table.values().filter(|e| e.warm.is_some()).count();
        Occupancy {
            users: table.len() - warm,
            warm,
            creates_in_flight: self.user_creates.load(Ordering::SeqCst),
        }
    }

    pub fn max_sandboxes(&self) -> usize {
        self.cfg.max_sandboxes as usize
    }

    /// Every warm sandbox, oldest first.
    pub fn warm_sandboxes(&self) -> Vec<WarmView> {
        let mut v: Vec<WarmView> = self
            .table
            .read()
            .values()
            .filter_map(|e| {
                let w = e.warm.as_ref()?;
                let exited = w.ready && e.phase != SandboxPhase::Running;
                Some(WarmView {
                    id: e.id.clone(),
                    class: w.class.clone(),
                    ready: w.ready,
                    exited,
                    created_at_ms: e.created_at_ms,
                })
            })
            .collect();
        v.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        v
    }

    /// The inventory's view: claimable warm sandboxes, and how many are
    /// starting per warm pool.
    pub fn warm_inventory(&self) -> (Vec<WarmSandbox>, HashMap<String, i32>) {
        let mut ready = Vec::new();
        let mut starting: HashMap<String, i32> = HashMap::new();
        for w in self.warm_sandboxes() {
            if !w.ready {
                *starting.entry(w.class.warm_pool.clone()).or_default() += 1;
            } else if !w.exited {
                ready.push(WarmSandbox {
                    sandbox_id: w.id,
                    class: Some(w.class),
                    created_at_unix_ms: w.created_at_ms,
                });
            }
        }
        (ready, starting)
    }

    /// The class as this agent runs it: image normalized, runtime defaulted
    /// (what [`Self::warm_sandboxes`] reports and targets are matched by).
    pub fn normalize_class(&self, class: &WarmClass) -> WarmClass {
        WarmClass {
            warm_pool: class.warm_pool.clone(),
            image: normalize(&class.image),
            runtime: or_default(&class.runtime, &self.cfg.default_runtime).to_string(),
            resources: Some(class.resources.clone().unwrap_or_default()),
        }
    }

    /// Starts one warm sandbox of `class` and returns its id once execd
    /// answers; a failure removes what was made.
    #[tracing::instrument(skip_all, fields(warm_pool = %class.warm_pool, image = %class.image))]
    pub async fn start_warm(&self, class: &WarmClass) -> Result<String> {
        let class = self.normalize_class(class);
        let token = warm_token();
        let spec = self.warm_spec(&class, &token);
        let id = spec.sandbox_id.clone();
        let lock = self.lock_for(&id);
        let _guard = lock.lock().await;
        let mut entry = self.new_entry(&spec);
        entry.warm = Some(WarmState {
            class,
            token: token.clone(),
            ready: false,
        });
        self.table.write().insert(id.clone(), entry);
        let clock = CreateClock::start();
        // Its stages are not a user's wait: they go unreported.
        let mut progress = CreateProgress::default();
        let started = async {
            let pid = self.create_and_start(&spec, &clock, &mut progress).await?;
            self.mark_running(&id, pid);
            self.wait_for_execd(&id, &token).await
        }
        .await;
        match started {
            Ok(()) => {
                if let Some(w) = self
                    .table
                    .write()
                    .get_mut(&id)
                    .and_then(|e| e.warm.as_mut())
                {
                    w.ready = true;
                }
                tracing::info!(sandbox = %id, total_us = clock.elapsed_us(), "warm sandbox ready");
                Ok(id)
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "warm sandbox did not start");
                self.undo_create(&id, progress.created).await;
                self.release_lock(&id, &lock);
                Err(e)
            }
        }
    }

    /// The create request a warm sandbox is made from: no identity, no
    /// command, the class's limits, and the policy a create without one
    /// gets (all egress the node's isolation allows): nothing runs in it
    /// but execd, which opens no connection, and the common claim (no
    /// policy) then needs no rule change — an `nft` run is the slowest
    /// step a claim could have.
    fn warm_spec(&self, class: &WarmClass, token: &str) -> SandboxSpec {
        SandboxSpec {
            sandbox_id: warm_id(),
            image: class.image.clone(),
            runtime: class.runtime.clone(),
            resources: class.resources.clone(),
            access_token: token.to_string(),
            pool: self.cfg.pool.clone(),
            ..Default::default()
        }
    }

    /// Removes warm sandbox `id` (trim, exit), unless a claim took it
    /// meanwhile. Returns whether it removed it.
    pub async fn discard_warm(&self, id: &str) -> bool {
        let lock = self.lock_for(id);
        let _guard = lock.lock().await;
        if !self.is_warm(id) {
            return false;
        }
        self.undo_create(id, true).await;
        self.release_lock(id, &lock);
        tracing::info!(sandbox = %id, "warm sandbox removed");
        true
    }

    /// Recovery: a warm container of an earlier agent process is removed,
    /// never adopted (a claim may have been half done in it; its warm token
    /// is gone with that process). Its network is released when the
    /// network starts (it is not in the table).
    pub(super) async fn remove_stale_warm(&self, id: &str) {
        match self.stop_and_remove(id, Duration::ZERO, true).await {
            Ok(_) => {
                tracing::info!(sandbox = %id, "removed a warm sandbox of an earlier agent process")
            }
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %e, "could not remove a warm sandbox of an earlier agent process");
            }
        }
    }
}
