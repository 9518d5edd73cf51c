//! The sandbox core: every FastPath RPC, v1 and v2, lands here as a plain
//! Rust call. The wire modules only translate.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use sandbolt_proto::agent::v1 as pb;

use crate::agent_client::AgentClients;
use crate::clock;
use crate::config::ControllerConfig;
use crate::error::{Error, Result};
use crate::limits;
use crate::placement::or_default;
use crate::registry::Registry;
use crate::store::{
    Consistency, FailurePolicy, HostVolume, Phase, Resources, SandboxRecord, Store, StoreError,
};

/// execd's port inside every sandbox.
pub const EXECD_PORT: u32 = 44772;
/// Header the agent's proxy checks.
pub const PROXY_TOKEN_HEADER: &str = "X-Sandbolt-Access-Token";
/// Header execd checks.
pub const EXECD_TOKEN_HEADER: &str = "X-EXECD-ACCESS-TOKEN";

/// A validated create request, from either API version.
#[derive(Debug, Clone, Default)]
pub struct CreateSpec {
    pub request_id: String,
    /// Empty: derived from the request id, or generated.
    pub name: String,
    pub namespace: String,
    pub pool: String,
    pub image: String,
    pub command: Vec<String>,
    pub args: Vec<String>,
    pub envs: BTreeMap<String, String>,
    pub working_dir: String,
    pub exposed_ports: Vec<u32>,
    pub metadata: BTreeMap<String, String>,
    /// Unix seconds, 0 = never expires.
    pub expires_at: i64,
    pub failure_policy: FailurePolicy,
    pub recovery_timeout_seconds: i32,
    /// `None`: the server default.
    pub consistency: Option<Consistency>,
    /// Answer only when execd inside answers (v2 completion READY).
    pub wait_for_execd: bool,
    /// As asked; [`Core::validate`] applies the pool's defaults and maxima.
    pub resources: Resources,
    pub volumes: Vec<HostVolume>,
    /// OCI runtime; empty = the pool's.
    pub runtime: String,
}

/// The one field an update changes besides metadata (v2's `oneof update`).
#[derive(Debug, Clone, PartialEq)]
pub enum UpdateOp {
    None,
    /// v2 semantics: a new absolute expiry; only for sandboxes that expire.
    Expiry(i64),
    /// v1 semantics: 0 removes the expiry, anything else sets it.
    ExpiryV1(i64),
    ResetRevision(String),
    FailurePolicy(FailurePolicy),
    RecoveryTimeout(i32),
}

#[derive(Debug, Clone, Default)]
pub struct UpdateSpec {
    pub expected_uid: String,
    pub expected_generation: i64,
    pub metadata_upsert: BTreeMap<String, String>,
    pub metadata_delete: Vec<String>,
}

pub struct ResolvedRoute {
    pub record: SandboxRecord,
    pub port: u32,
    pub component: String,
    pub proxy_endpoint: String,
    pub headers: BTreeMap<String, String>,
}

pub struct Diagnostics {
    pub record: SandboxRecord,
    pub observed: Option<pb::SandboxStatus>,
    pub reachable: bool,
    pub agent_error: String,
}

pub struct Core {
    pub(crate) config: ControllerConfig,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) registry: Arc<Registry>,
    pub(crate) agents: AgentClients,
    /// (expires_at, namespace, name) of sandboxes that expire.
    pub(crate) expiry: Mutex<BTreeSet<(i64, String, String)>>,
    /// Sandbox ids whose create (or recreate) is running in this process:
    /// never orphans, never re-driven.
    pub(crate) inflight: Mutex<HashSet<String>>,
    /// (namespace, name) of records to re-drive after a restart (Pending) or
    /// to recreate elsewhere (Recovering).
    pub(crate) recovering: Mutex<BTreeSet<(String, String)>>,
    pub(crate) ready: AtomicBool,
}

/// Removes a sandbox id from the in-flight set when dropped.
pub(crate) struct InflightGuard<'a>(&'a Core, String);

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.0.inflight.lock().remove(&self.1);
    }
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
        && s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
}

pub(crate) fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::new_v4().simple())
}

impl Core {
    pub fn new(config: ControllerConfig, store: Arc<dyn Store>) -> Self {
        Self {
            agents: AgentClients::new(&config.agent_token),
            registry: Arc::new(Registry::with_namespaced_pools(config.namespaced_pools)),
            config,
            store,
            expiry: Mutex::new(BTreeSet::new()),
            inflight: Mutex::new(HashSet::new()),
            recovering: Mutex::new(BTreeSet::new()),
            ready: AtomicBool::new(true),
        }
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    pub fn store(&self) -> &dyn Store {
        self.store.as_ref()
    }

    pub(crate) fn inflight(&self, sandbox_id: &str) -> InflightGuard<'_> {
        self.inflight.lock().insert(sandbox_id.to_string());
        InflightGuard(self, sandbox_id.to_string())
    }

    pub(crate) fn track_expiry(&self, r: &SandboxRecord, old: Option<i64>) {
        let mut g = self.expiry.lock();
        if let Some(o) = old.filter(|o| *o != 0) {
            g.remove(&(o, r.namespace.clone(), r.name.clone()));
        }
        if r.expires_at != 0 {
            g.insert((r.expires_at, r.namespace.clone(), r.name.clone()));
        }
    }

    fn untrack_expiry(&self, r: &SandboxRecord) {
        if r.expires_at != 0 {
            self.expiry
                .lock()
                .remove(&(r.expires_at, r.namespace.clone(), r.name.clone()));
        }
    }

    /// Checks and completes a create request; the flows are in `consistency`.
    pub fn validate(&self, mut spec: CreateSpec) -> Result<CreateSpec> {
        spec.namespace = or_default(spec.namespace.trim()).to_string();
        spec.pool = or_default(spec.pool.trim()).to_string();
        if !valid_name(&spec.namespace) {
            return Err(Error::InvalidArgument(format!(
                "invalid namespace {:?}",
                spec.namespace
            )));
        }
        sandbolt_image_ref::ImageRef::parse(&spec.image)
            .map_err(|e| Error::InvalidArgument(format!("image: {e}")))?;
        if spec.name.is_empty() {
            spec.name = if spec.request_id.is_empty() {
                new_id("sbx-")
            } else {
                spec.request_id.clone()
            };
        }
        if !valid_name(&spec.name) {
            return Err(Error::InvalidArgument(format!(
                "invalid sandbox name {:?}: use letters, digits, '-', '.', '_' (at most 253)",
                spec.name
            )));
        }
        if spec.expires_at < 0 {
            return Err(Error::InvalidArgument(
                "expires_at_unix_seconds must not be negative".into(),
            ));
        }
        if spec.expires_at != 0 && spec.expires_at <= clock::now_unix_secs() {
            return Err(Error::InvalidArgument(format!(
                "expires_at_unix_seconds {} is not in the future",
                spec.expires_at
            )));
        }
        if spec.recovery_timeout_seconds < 0 {
            return Err(Error::InvalidArgument(
                "recovery_timeout_seconds must not be negative".into(),
            ));
        }
        if let Some(p) = spec.exposed_ports.iter().find(|p| **p == 0 || **p > 65535) {
            return Err(Error::InvalidArgument(format!(
                "exposed port {p} is out of range"
            )));
        }
        let policy = self
            .registry
            .pool_policy(&self.registry.pool_key(&spec.namespace, &spec.pool));
        spec.resources = limits::resolve(&spec.resources, &spec.pool, policy.as_ref())?;
        spec.runtime = limits::runtime(&spec.runtime, policy.as_ref())?;
        limits::check_volumes(&spec.volumes)?;
        Ok(spec)
    }

    pub fn get(&self, namespace: &str, name: &str, expected_uid: &str) -> Result<SandboxRecord> {
        let ns = or_default(namespace);
        let r = self
            .store
            .get(ns, name)?
            .ok_or_else(|| Error::NotFound(ns.into(), name.into()))?;
        if !expected_uid.is_empty() && r.uid != expected_uid {
            // The sandbox the caller means is gone; a namesake is not it.
            return Err(Error::NotFound(
                ns.into(),
                format!("{name} (uid {expected_uid})"),
            ));
        }
        Ok(r)
    }

    fn check_generation(r: &SandboxRecord, expected: i64) -> Result<()> {
        if expected != 0 && expected != r.generation {
            return Err(Error::Aborted(format!(
                "sandbox {}/{} is at generation {}, not {expected}",
                r.namespace, r.name, r.generation
            )));
        }
        Ok(())
    }

    pub fn get_checked(
        &self,
        namespace: &str,
        name: &str,
        expected_uid: &str,
        expected_generation: i64,
    ) -> Result<SandboxRecord> {
        let r = self.get(namespace, name, expected_uid)?;
        Self::check_generation(&r, expected_generation)?;
        Ok(r)
    }

    /// Read-modify-write with optimistic concurrency; `f` may refuse.
    pub(crate) fn modify(
        &self,
        namespace: &str,
        name: &str,
        mut f: impl FnMut(&mut SandboxRecord) -> Result<()>,
    ) -> Result<SandboxRecord> {
        for _ in 0..16 {
            let mut r = self
                .store
                .get(namespace, name)?
                .ok_or_else(|| Error::NotFound(namespace.into(), name.into()))?;
            let before = r.phase;
            f(&mut r)?;
            if r.phase != before {
                // One place stamps every transition, whoever changed it.
                r.last_transition_unix_ms = clock::now_unix_ms();
            }
            match self.store.replace(&r) {
                Ok(r) => return Ok(r),
                Err(StoreError::Conflict(..)) => continue,
                Err(StoreError::NotFound(ns, n)) => return Err(Error::NotFound(ns, n)),
                Err(e) => return Err(e.into()),
            }
        }
        Err(Error::Aborted(format!(
            "sandbox {namespace}/{name} keeps changing; retry"
        )))
    }

    pub fn list(
        &self,
        namespace: &str,
        filter: &BTreeMap<String, String>,
        page_size: usize,
        page_token: &str,
    ) -> Result<(Vec<SandboxRecord>, String)> {
        let ns = or_default(namespace);
        let page_size = match page_size {
            0 => 500,
            n => n.min(1000),
        };
        let mut after = (!page_token.is_empty()).then(|| page_token.to_string());
        let mut out = Vec::new();
        loop {
            let chunk = self
                .store
                .list(Some(ns), after.as_deref(), page_size.max(64))?;
            let exhausted = chunk.len() < page_size.max(64);
            for r in chunk {
                after = Some(r.name.clone());
                if filter.iter().all(|(k, v)| r.metadata.get(k) == Some(v)) {
                    out.push(r);
                    if out.len() == page_size {
                        // Another page only if something is left to read.
                        let more = !self.store.list(Some(ns), after.as_deref(), 1)?.is_empty();
                        return Ok((
                            out,
                            if more {
                                after.unwrap_or_default()
                            } else {
                                String::new()
                            },
                        ));
                    }
                }
            }
            if exhausted {
                return Ok((out, String::new()));
            }
        }
    }

    /// Every record of a namespace matching `filter`, in name order, in one
    /// answer (the native API's `page_size` 0).
    pub fn list_all(
        &self,
        namespace: &str,
        filter: &BTreeMap<String, String>,
    ) -> Result<Vec<SandboxRecord>> {
        let mut all = self.store.list(Some(or_default(namespace)), None, 0)?;
        all.retain(|r| filter.iter().all(|(k, v)| r.metadata.get(k) == Some(v)));
        Ok(all)
    }

    /// Deletes the container, then the record, then frees the slot.
    pub async fn delete(
        &self,
        namespace: &str,
        name: &str,
        expected_uid: &str,
    ) -> Result<SandboxRecord> {
        let r = self.get(namespace, name, expected_uid)?;
        self.remove_container(&r).await?;
        self.store.delete(&r.namespace, &r.name)?;
        self.untrack_expiry(&r);
        if !r.agent_id.is_empty() {
            self.registry.release(&r.agent_id, &r.sandbox_id);
        }
        self.recovering
            .lock()
            .remove(&(r.namespace.clone(), r.name.clone()));
        tracing::info!(sandbox = %r.name, namespace = %r.namespace, agent = %r.agent_id, "deleted");
        Ok(r)
    }

    /// Removes a record's container. A lost or unknown agent cannot be asked:
    /// the record goes anyway and the janitor (or the controller's orphan
    /// check, when the agent comes back) removes the container later.
    async fn remove_container(&self, r: &SandboxRecord) -> Result<()> {
        if r.agent_id.is_empty() || r.sandbox_id.is_empty() {
            return Ok(());
        }
        let Some(agent) = self.registry.agent(&r.agent_id) else {
            return Ok(());
        };
        if agent.lost {
            tracing::warn!(sandbox = %r.name, agent = %r.agent_id, "agent lost; container left to the janitor");
            return Ok(());
        }
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

    pub async fn update(
        &self,
        namespace: &str,
        name: &str,
        op: UpdateOp,
        spec: UpdateSpec,
    ) -> Result<SandboxRecord> {
        if let Some(k) = spec
            .metadata_upsert
            .keys()
            .chain(spec.metadata_delete.iter())
            .find(|k| k.is_empty())
        {
            return Err(Error::InvalidArgument(format!("empty metadata key {k:?}")));
        }
        let now = clock::now_unix_secs();
        let ns = or_default(namespace);
        let mut old_expiry = None;
        let r = self.modify(ns, name, |r| {
            if !spec.expected_uid.is_empty() && r.uid != spec.expected_uid {
                return Err(Error::NotFound(
                    ns.into(),
                    format!("{name} (uid {})", spec.expected_uid),
                ));
            }
            Self::check_generation(r, spec.expected_generation)?;
            old_expiry = Some(r.expires_at);
            let mut changed = false;
            match &op {
                UpdateOp::None => {}
                UpdateOp::Expiry(t) | UpdateOp::ExpiryV1(t) => {
                    let v1_remove = matches!(op, UpdateOp::ExpiryV1(0));
                    if v1_remove {
                        r.expires_at = 0;
                        r.push_event("info", "controller", "expiry removed: manual cleanup");
                    } else {
                        if *t <= 0 {
                            return Err(Error::InvalidArgument(
                                "expires_at_unix_seconds must be a positive unix time".into(),
                            ));
                        }
                        if r.expires_at == 0 {
                            // OpenSandbox #442: renew is not a mode switch.
                            return Err(Error::FailedPrecondition(format!(
                                "Sandbox {} does not have automatic expiration enabled.",
                                r.name
                            )));
                        }
                        if *t <= now {
                            return Err(Error::InvalidArgument(format!(
                                "expiry {t} is not in the future"
                            )));
                        }
                        r.expires_at = *t;
                        r.push_event("info", "controller", format!("expiry set to {t}"));
                    }
                    changed = true;
                }
                UpdateOp::ResetRevision(s) => {
                    if s.is_empty() {
                        return Err(Error::InvalidArgument(
                            "reset_revision must not be empty".into(),
                        ));
                    }
                    r.reset_revision = s.clone();
                    r.push_event(
                        "info",
                        "controller",
                        format!("reset revision {s} requested"),
                    );
                    changed = true;
                }
                UpdateOp::FailurePolicy(p) => {
                    r.failure_policy = *p;
                    r.push_event("info", "controller", format!("failure policy set to {p:?}"));
                    changed = true;
                }
                UpdateOp::RecoveryTimeout(t) => {
                    if *t < 0 {
                        return Err(Error::InvalidArgument(
                            "recovery_timeout_seconds must not be negative".into(),
                        ));
                    }
                    r.recovery_timeout_seconds = *t;
                    changed = true;
                }
            }
            for (k, v) in &spec.metadata_upsert {
                changed |= r.metadata.insert(k.clone(), v.clone()).as_ref() != Some(v);
            }
            for k in &spec.metadata_delete {
                changed |= r.metadata.remove(k).is_some();
            }
            if changed {
                r.generation += 1;
            }
            Ok(())
        })?;
        self.track_expiry(&r, old_expiry);
        if let UpdateOp::ResetRevision(rev) = &op {
            return self.restart(r, rev).await;
        }
        Ok(r)
    }

    /// Reset revision: the same sandbox (id, token, spec) starts afresh.
    async fn restart(&self, r: SandboxRecord, revision: &str) -> Result<SandboxRecord> {
        let agent = self.live_agent(&r)?;
        self.agents
            .delete(
                &r.agent_id,
                &agent.api_endpoint,
                &r.sandbox_id,
                self.config.create_deadline,
            )
            .await?;
        let _g = self.inflight(&r.sandbox_id);
        self.agents
            .create(
                &r.agent_id,
                &agent.api_endpoint,
                self.agent_spec(&r, true),
                self.config.create_deadline,
            )
            .await?;
        self.modify(&r.namespace, &r.name, |x| {
            x.phase = Phase::Running;
            x.push_event(
                "info",
                "agent",
                format!("restarted for reset revision {revision}"),
            );
            Ok(())
        })
    }

    fn live_agent(&self, r: &SandboxRecord) -> Result<crate::registry::AgentInfo> {
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

    pub async fn pause(
        &self,
        namespace: &str,
        name: &str,
        expected_uid: &str,
        expected_generation: i64,
        pause: bool,
    ) -> Result<SandboxRecord> {
        let r = self.get_checked(namespace, name, expected_uid, expected_generation)?;
        let (from, to) = if pause {
            (Phase::Running, Phase::Paused)
        } else {
            (Phase::Paused, Phase::Running)
        };
        if r.phase == to {
            return Ok(r);
        }
        if r.phase != from {
            return Err(Error::FailedPrecondition(format!(
                "sandbox {}/{} is {:?}; {} needs {:?}",
                r.namespace,
                r.name,
                r.phase,
                if pause { "pause" } else { "resume" },
                from
            )));
        }
        let agent = self.live_agent(&r)?;
        self.agents
            .pause(
                &r.agent_id,
                &agent.api_endpoint,
                &r.sandbox_id,
                pause,
                self.config.create_deadline,
            )
            .await?;
        self.modify(&r.namespace, &r.name, |x| {
            x.phase = to;
            x.generation += 1;
            x.push_event(
                "info",
                "agent",
                if pause {
                    "paused (frozen)"
                } else {
                    "resumed (thawed)"
                },
            );
            Ok(())
        })
    }

    pub fn resolve(
        &self,
        namespace: &str,
        name: &str,
        expected_uid: &str,
        expected_generation: i64,
        port: Option<u32>,
        component: &str,
    ) -> Result<ResolvedRoute> {
        let r = self.get_checked(namespace, name, expected_uid, expected_generation)?;
        let (port, component) = match (port, component) {
            (Some(p), _) if (1..=65535).contains(&p) => (p, String::new()),
            (Some(p), _) => {
                return Err(Error::InvalidArgument(format!("port {p} is out of range")));
            }
            (None, "execd") => (EXECD_PORT, "execd".to_string()),
            (None, "") => {
                return Err(Error::InvalidArgument(
                    "endpoint target is required (port or component)".into(),
                ));
            }
            (None, c) => {
                return Err(Error::NotFoundOther(format!(
                    "sandbox {name} has no component {c:?} (known: execd)"
                )));
            }
        };
        if r.phase != Phase::Running {
            return Err(Error::FailedPrecondition(format!(
                "sandbox {}/{} is {:?}, not Running",
                r.namespace, r.name, r.phase
            )));
        }
        let agent = self.live_agent(&r)?;
        if agent.proxy_endpoint.is_empty() {
            return Err(Error::Unavailable(format!(
                "agent {} has no proxy endpoint",
                agent.agent_id
            )));
        }
        let host = agent
            .proxy_endpoint
            .trim_start_matches("http://")
            .trim_start_matches("https://")
            .trim_end_matches('/');
        let headers = BTreeMap::from([
            (PROXY_TOKEN_HEADER.to_string(), r.access_token.clone()),
            (EXECD_TOKEN_HEADER.to_string(), r.access_token.clone()),
        ]);
        Ok(ResolvedRoute {
            proxy_endpoint: format!("{host}/{}/{port}", r.sandbox_id),
            port,
            component,
            headers,
            record: r,
        })
    }

    pub async fn diagnostics(&self, namespace: &str, name: &str) -> Result<Diagnostics> {
        let r = self.get(namespace, name, "")?;
        let observed = self.registry.observed(&r.agent_id, &r.sandbox_id);
        let (reachable, agent_error) = match self.registry.agent(&r.agent_id) {
            None => (false, format!("agent {:?} is not registered", r.agent_id)),
            Some(a) if a.lost => (
                false,
                format!("agent {} is lost (no heartbeat)", a.agent_id),
            ),
            Some(a) => match self
                .agents
                .get(
                    &r.agent_id,
                    &a.api_endpoint,
                    &r.sandbox_id,
                    Duration::from_secs(3),
                )
                .await
            {
                Ok(_) => (true, String::new()),
                Err(e) => (false, e.to_string()),
            },
        };
        Ok(Diagnostics {
            record: r,
            observed,
            reachable,
            agent_error,
        })
    }

    /// The spec the agent gets for a record.
    pub(crate) fn agent_spec(&self, r: &SandboxRecord, wait_for_execd: bool) -> pb::SandboxSpec {
        pb::SandboxSpec {
            sandbox_id: r.sandbox_id.clone(),
            name: r.name.clone(),
            namespace: r.namespace.clone(),
            record_uid: r.uid.clone(),
            image: r.image.clone(),
            command: r.command.clone(),
            args: r.args.clone(),
            envs: r.envs.clone().into_iter().collect(),
            working_dir: r.working_dir.clone(),
            runtime: r.runtime.clone(),
            resources: Some(pb::Resources {
                cpu: r.resources.cpu_limit.clone(),
                memory: r.resources.memory_limit.clone(),
                pids_limit: r.resources.pids_limit,
                cpu_request: r.resources.cpu_request.clone(),
                memory_request: r.resources.memory_request.clone(),
            }),
            host_mounts: r
                .volumes
                .iter()
                .map(|v| pb::HostPathMount {
                    host_path: v.host_path.clone(),
                    sub_path: v.sub_path.clone(),
                    mount_path: v.mount_path.clone(),
                    read_only: v.read_only,
                })
                .collect(),
            exposed_ports: r.exposed_ports.clone(),
            labels: r.metadata.clone().into_iter().collect(),
            access_token: r.access_token.clone(),
            pool: r.pool.clone(),
            wait_for_execd,
        }
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
}
