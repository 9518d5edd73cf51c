//! The [`Core`] and what every verb shares: record read-modify-write,
//! preconditions, the in-flight set, the expiry index, the live agent of a
//! record, and the one conversion of a record into the agent's spec.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use sandbolt_proto::agent::v1 as pb;

use crate::agent_client::AgentClients;
use crate::clock;
use crate::config::ControllerConfig;
use crate::error::{Error, Result};
use crate::ids::{SandboxId, SandboxKey};
use crate::keyed_lock::KeyedLocks;
use crate::metrics::ControllerMetrics;
use crate::registry::{AgentInfo, Registry};
use crate::sandbox::Observed;
use crate::secrets::Secrets;
use crate::store::timed::TimedStore;
use crate::store::{ContainerExit, ExitObserver, SandboxRecord, Store, StoreError};
use crate::volume_index::VolumeIndex;

pub struct Core {
    pub(crate) config: ControllerConfig,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) registry: Arc<Registry>,
    pub(crate) agents: AgentClients,
    /// Sandboxes that expire, by expiry (unix seconds).
    pub(crate) expiry: Mutex<BTreeSet<(i64, SandboxKey)>>,
    /// Containers whose create (or recreate) is running in this process:
    /// never orphans, never re-driven.
    pub(crate) inflight: Mutex<HashSet<SandboxId>>,
    /// Records to re-drive after a restart (Pending) or to recreate
    /// elsewhere (Recovering).
    pub(crate) recovering: Mutex<BTreeSet<SandboxKey>>,
    pub(crate) ready: AtomicBool,
    /// Records whose network policy the agent has not confirmed (see
    /// `policy.rs`), each with whether a re-send is running now.
    pub(crate) policy_pending: Mutex<HashMap<SandboxKey, bool>>,
    /// One policy push per sandbox at a time (see `policy.rs`).
    pub(crate) policy_locks: Mutex<HashMap<SandboxKey, Arc<tokio::sync::Mutex<()>>>>,
    /// Where every named volume is (see `volume_index.rs`).
    pub(crate) volumes: VolumeIndex,
    /// One create or delete per volume name at a time: the uniqueness
    /// check and the agent call that makes the name exist are one step.
    pub(crate) volume_names: KeyedLocks<String>,
    /// One attach or detach per sandbox at a time.
    pub(crate) volume_mounts: KeyedLocks<SandboxKey>,
    /// The warm pools (see `crate::warm`).
    pub(crate) warm_pools: crate::warm::WarmPools,
    /// One snapshot create per (namespace, request id) at a time, so that a
    /// retry racing the first call finds its record instead of making a
    /// second snapshot.
    pub(crate) snapshot_requests: KeyedLocks<(String, String)>,
    /// This process's metrics (see `crate::metrics`).
    pub(crate) metrics: ControllerMetrics,
    /// The key tokens are derived from and secret env sealed with.
    pub(crate) secrets: Arc<Secrets>,
}

/// What the caller believes about the record it names; a mismatch refuses
/// the call. Empty uid or generation 0: no expectation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Precondition {
    /// The record's uid or its API object's
    /// ([`SandboxRecord::object_uid`]): both name the same record.
    pub uid: String,
    pub generation: i64,
    /// `generation` counts as the API object's
    /// ([`SandboxRecord::object_generation`], what FastPath v2 reports),
    /// not the record's own (what the control API reports).
    pub object_generation: bool,
}

impl Precondition {
    pub fn uid(uid: impl Into<String>) -> Self {
        Self {
            uid: uid.into(),
            ..Self::default()
        }
    }

    pub(crate) fn check(&self, r: &SandboxRecord) -> Result<()> {
        if !self.uid.is_empty() && r.uid != self.uid && r.api_uid != self.uid {
            // The sandbox the caller means is gone; a namesake is not it.
            return Err(Error::UidMismatch(r.key(), self.uid.clone()));
        }
        let current = if self.object_generation {
            r.object_generation()
        } else {
            r.generation
        };
        if self.generation != 0 && self.generation != current {
            return Err(Error::Aborted(format!(
                "sandbox {}/{} is at generation {current}, not {}",
                r.namespace, r.name, self.generation
            )));
        }
        Ok(())
    }
}

/// Exits as every API reports them ([`Observed::of`]), for the store to
/// publish. A silent agent is not published: silence says nothing, and
/// every sandbox of a restarted controller would flap until its agent
/// heartbeats.
fn exit_observer(registry: Arc<Registry>) -> ExitObserver {
    Arc::new(move |r: &SandboxRecord| {
        match Observed::of(&registry.sandbox_view(&r.agent_id, &r.sandbox_id), r) {
            Observed::Exited { failed, message } => Some(ContainerExit { failed, message }),
            Observed::Recorded(_) | Observed::AgentSilent { .. } => None,
        }
    })
}

/// Removes a container id from the in-flight set when dropped.
pub(crate) struct InflightGuard<'a>(&'a Core, SandboxId);

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.0.inflight.lock().remove(&self.1);
    }
}

impl Core {
    pub fn new(config: ControllerConfig, store: Arc<dyn Store>) -> Result<Self> {
        // An RPC answer outranks heartbeats taken before it arrived.
        let volume_hold = (config.heartbeat_interval * 3).max(std::time::Duration::from_secs(5));
        let registry = Arc::new(Registry::with_namespaced_pools(config.namespaced_pools));
        store.publish_observed_exits(exit_observer(registry.clone()));
        let metrics = config
            .metrics
            .clone()
            .unwrap_or_else(ControllerMetrics::unregistered);
        let store: Arc<dyn Store> = Arc::new(TimedStore::new(store, metrics.clone()));
        let secrets = Secrets::load(config.token_key_file.as_deref(), &config.data_dir)
            .map_err(|e| Error::Internal(e.to_string()))?;
        Ok(Self {
            secrets: Arc::new(secrets),
            agents: AgentClients::new(Arc::new(
                crate::identity::AgentIdentity::load(
                    config.identity_key_file.as_deref(),
                    &config.data_dir,
                    &config.agent_token,
                )
                .map_err(|e| Error::InvalidArgument(e.to_string()))?,
            )),
            registry,
            config,
            store,
            expiry: Mutex::new(BTreeSet::new()),
            inflight: Mutex::new(HashSet::new()),
            recovering: Mutex::new(BTreeSet::new()),
            ready: AtomicBool::new(true),
            policy_pending: Mutex::new(HashMap::new()),
            policy_locks: Mutex::new(HashMap::new()),
            volumes: VolumeIndex::new(volume_hold),
            volume_names: KeyedLocks::default(),
            volume_mounts: KeyedLocks::default(),
            warm_pools: crate::warm::WarmPools::default(),
            snapshot_requests: KeyedLocks::default(),
            metrics,
        })
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    pub fn store(&self) -> &dyn Store {
        self.store.as_ref()
    }

    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    pub(crate) fn require_ready(&self) -> Result<()> {
        if self.is_ready() {
            Ok(())
        } else {
            Err(Error::Unavailable(
                "controller is rebuilding its registry after a restart; retry shortly".into(),
            ))
        }
    }

    pub(crate) fn inflight(&self, sandbox_id: &SandboxId) -> InflightGuard<'_> {
        self.inflight.lock().insert(sandbox_id.clone());
        InflightGuard(self, sandbox_id.clone())
    }

    pub(crate) fn is_inflight(&self, sandbox_id: &str) -> bool {
        self.inflight.lock().contains(sandbox_id)
    }

    /// The stored record, or `NotFound`.
    pub(crate) fn load(&self, key: &SandboxKey) -> Result<SandboxRecord> {
        self.store
            .get(key)?
            .ok_or_else(|| Error::NotFound(key.clone()))
    }

    pub(crate) fn track_expiry(&self, r: &SandboxRecord, old: Option<i64>) {
        let mut g = self.expiry.lock();
        if let Some(o) = old.filter(|o| *o != 0) {
            g.remove(&(o, r.key()));
        }
        if r.spec.expires_at != 0 {
            g.insert((r.spec.expires_at, r.key()));
        }
    }

    pub(crate) fn untrack_expiry(&self, r: &SandboxRecord) {
        if r.spec.expires_at != 0 {
            self.expiry.lock().remove(&(r.spec.expires_at, r.key()));
        }
    }

    /// Read-modify-write with optimistic concurrency; `f` may refuse. Not a
    /// backoff: a conflict means a newer record to apply `f` to, at once.
    pub(crate) fn modify(
        &self,
        key: &SandboxKey,
        mut f: impl FnMut(&mut SandboxRecord) -> Result<()>,
    ) -> Result<SandboxRecord> {
        for _ in 0..16 {
            let mut r = self.load(key)?;
            let before = r.phase;
            f(&mut r)?;
            if r.phase != before {
                // One place stamps every transition, whoever changed it.
                r.last_transition_unix_ms = clock::now_unix_ms();
            }
            match self.store.replace(&r) {
                Ok(r) => return Ok(r),
                Err(StoreError::Conflict(..)) => continue,
                Err(StoreError::NotFound(..)) => return Err(Error::NotFound(key.clone())),
                Err(e) => return Err(e.into()),
            }
        }
        Err(Error::Aborted(format!(
            "sandbox {key} keeps changing; retry"
        )))
    }

    /// The agent of `r`, if it is registered and heartbeating.
    pub(crate) fn live_agent(&self, r: &SandboxRecord) -> Result<AgentInfo> {
        match self.registry.agent(&r.agent_id) {
            Some(a) if !a.lost => Ok(a),
            Some(_) => Err(Error::Unavailable(format!(
                "agent {} of sandbox {} is lost",
                r.agent_id, r.name
            ))),
            None => Err(Error::Unavailable(format!(
                "agent {} of sandbox {} is not registered",
                r.agent_id, r.name
            ))),
        }
    }

    /// Removes `r`'s container on its (live) agent, within the create deadline.
    pub(crate) async fn delete_container(
        &self,
        r: &SandboxRecord,
        agent: &AgentInfo,
    ) -> Result<()> {
        self.agents
            .delete(
                &r.agent_id,
                &agent.api_endpoint,
                &r.sandbox_id,
                self.config.create_deadline,
            )
            .await?;
        Ok(())
    }

    /// Best effort: removes `r`'s container so that it does not outlive a
    /// create that failed or lost its record.
    pub(crate) async fn discard_container(&self, r: &SandboxRecord) {
        let Some(a) = self.registry.agent(&r.agent_id) else {
            return;
        };
        if let Err(e) = self
            .agents
            .delete(
                &r.agent_id,
                &a.api_endpoint,
                &r.sandbox_id,
                DISCARD_DEADLINE,
            )
            .await
        {
            tracing::warn!(sandbox = %r.name, agent = %r.agent_id, sandbox_id = %r.sandbox_id, error = %e, "could not remove a container without a record");
        }
    }
}

/// How long removing a container nobody waits for may take.
pub(crate) const DISCARD_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// How the agent mounts one named volume.
pub(crate) fn volume_mount(v: &crate::store::PvcVolume) -> pb::NamedVolumeMount {
    pb::NamedVolumeMount {
        volume: v.claim_name.clone(),
        sub_path: v.sub_path.clone(),
        mount_path: v.mount_path.clone(),
        read_only: v.read_only,
    }
}

/// The spec the agent gets for a record: the only place it is built, and
/// the only place its token and secret env exist in the clear.
pub(crate) fn agent_spec(
    r: &SandboxRecord,
    wait_for_execd: bool,
    secrets: &Secrets,
) -> Result<pb::SandboxSpec> {
    let s = &r.spec;
    let mut envs: HashMap<String, String> = s.envs.clone().into_iter().collect();
    for (k, sealed) in &s.sealed_envs {
        let value = secrets
            .open(
                &crate::secrets::env_context(&r.namespace, &r.name, k),
                sealed,
            )
            .map_err(|e| Error::Internal(e.to_string()))?;
        envs.insert(k.clone(), value);
    }
    Ok(pb::SandboxSpec {
        sandbox_id: r.sandbox_id.to_string(),
        name: r.name.clone(),
        namespace: r.namespace.clone(),
        record_uid: r.uid.clone(),
        image: s.image.clone(),
        command: s.command.clone(),
        args: s.args.clone(),
        envs,
        working_dir: s.working_dir.clone(),
        runtime: s.runtime.clone(),
        network_policy_json: s.network_policy_json.clone(),
        resources: Some(pb::Resources {
            cpu: s.resources.cpu_limit.clone(),
            memory: s.resources.memory_limit.clone(),
            pids_limit: s.resources.pids_limit,
            cpu_request: s.resources.cpu_request.clone(),
            memory_request: s.resources.memory_request.clone(),
            ephemeral_storage: s.resources.ephemeral_storage_limit.clone(),
        }),
        host_mounts: s
            .volumes
            .iter()
            .map(|v| pb::HostPathMount {
                host_path: v.host_path.clone(),
                sub_path: v.sub_path.clone(),
                mount_path: v.mount_path.clone(),
                read_only: v.read_only,
            })
            .collect(),
        exposed_ports: s.exposed_ports.clone(),
        volume_mounts: s.pvc_volumes.iter().map(volume_mount).collect(),
        labels: s.metadata.clone().into_iter().collect(),
        access_token: crate::sandbox::token::access_token(secrets, r),
        pool: s.pool.clone(),
        wait_for_execd,
        snapshot_id: s.snapshot_id.clone(),
    })
}
