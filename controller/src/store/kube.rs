//! The Kubernetes store: every record is a `Sandbox` custom resource
//! (`sandbox.fast.io/v1alpha2`), every known agent a `Lease`, every warm
//! pool a `SandboxWarmPool` and every sandbox snapshot a `SandboxSnapshot`
//! (both `sandbolt.io/v1alpha1`) in the controller's namespace.
//!
//! # Where the record lives in the object
//!
//! - What the user asked for is the spec (image, command, args, pool, expiry,
//!   env, …) and the user metadata are labels, in the shape the OpenSandbox
//!   server reads.
//! - What the controller decided (container id, agent, phase, token,
//!   request id, events, its own generation) is one JSON annotation,
//!   [`STATE_ANNOTATION`]. It lives on the main object, not in `status`, so a
//!   record is always written in *one* request: a create or a phase change is
//!   atomic, and the resourceVersion the controller holds is the object's.
//! - `status` (runtime/data-plane states, the Ready condition,
//!   observedGeneration, action bindings) is derived from the record for
//!   readers — kubectl and the OpenSandbox server (see [`status`]). It is
//!   written through the status subresource right after the main write,
//!   only when it changed; if that second write fails, the record is still
//!   whole and the leader's status publisher corrects the status.
//! - The object's own `metadata.uid` and `metadata.generation` come back in
//!   every record read or written (`api_uid`, `api_generation`): FastPath v2
//!   names the sandbox by them, as the OpenSandbox server reads them from
//!   the resource.
//!
//! # Reads
//!
//! Reads come from a watch-fed cache (kube's reflector) plus an overlay of
//! this store's own writes: the watch delivers a write some milliseconds
//! after the API server acknowledged it, and the controller reads its own
//! writes at once (read, modify, replace). An overlay entry is dropped when
//! the watch delivers the same object version (same uid and
//! resourceVersion, which are compared for equality only: resourceVersions
//! are opaque) or, as a safety net, after [`OVERLAY_TTL`]. The overlay only
//! saves round trips: correctness rests on the resourceVersion every write
//! carries, so a stale read costs a `Conflict` and a re-read, never a lost
//! update.
//!
//! # Deletes
//!
//! Every Sandbox carries the [`FINALIZER`]. `delete` asks the API server to
//! delete (the object turns terminating) and then removes the finalizer, after
//! the controller removed the container. A Sandbox deleted from outside
//! (`kubectl delete`) stays terminating until the controller has cleaned up:
//! [`Store::deletions_requested`] reports it. An expiry leaves a tombstone
//! instead ([`tombstone`]): the resource without the controller's state and
//! finalizer, status Stopped, for the OpenSandbox server to show as
//! Terminated until the retention ends.
//!
//! # Warm pools
//!
//! A warm pool is a `SandboxWarmPool` named after it, in the controller's
//! namespace: the whole pool is its spec (no annotation), so one applied
//! with `kubectl` is a pool like one made through `WarmPoolService`. The
//! revision is the resourceVersion, the generation the object's. Reads
//! come from a watch cache with an own-writes overlay, as for Sandboxes. No
//! finalizer: deleting a pool only drains its buffers, nothing waits on it.
//! `status` belongs to the leader's publisher (`warm_pool_status`).
//! A cluster without the CRD (Helm installs a chart's CRDs only on first
//! install, not on upgrade) runs without warm pools: none are listed and
//! every write says why.
//!
//! # Snapshots
//!
//! A snapshot record is a `SandboxSnapshot` named after its id, in the
//! controller's namespace, the whole record in its spec (the source
//! sandbox's namespace is `spec.sandboxNamespace`), kept exactly as warm
//! pools are: [`OwnRecord`] is what both have in common. Without its CRD the
//! store runs without snapshots the same way; no snapshot can be captured
//! then, since a capture starts only once its record is stored.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use parking_lot::Mutex;
use sandbolt_deploy::pool::{LimitValues, OciRuntime};
use sandbolt_deploy::sandbox::{
    ActionBinding, EGRESS_HANDLER, FINALIZER, FailurePolicy as CrFailurePolicy,
    SandboxNetworkPolicy, SandboxResources, SandboxVolume, labels_to_metadata, metadata_to_labels,
};
use sandbolt_deploy::snapshot::{SnapshotPhase as CrSnapshotPhase, SnapshotVolume};
use sandbolt_deploy::warm_pool::{WarmPoolCapacity, WarmPoolTemplate};
use sandbolt_deploy::{
    Sandbox, SandboxSnapshot, SandboxSnapshotSpec, SandboxSpec, SandboxWarmPool,
    SandboxWarmPoolSpec,
};
use sandbolt_proto::egress::NetworkPolicy;
use serde::{Deserialize, Serialize};

use crate::ids::{AgentId, SandboxId, SandboxKey};

use super::{
    AgentRecord, Consistency, Event, ExitObserver, FailurePolicy, HostVolume, ListRange, Phase,
    PvcVolume, Resources, SandboxRecord, SandboxSpec as RecordSpec, SnapshotPhase, SnapshotRecord,
    SnapshotVolumeRecord, Store, StoreError, StoreResult, WarmPoolRecord, metadata_matches,
};

mod index;
mod status;
mod tombstone;

pub(crate) use status::derive_status;
pub use tombstone::EXPIRED_ANNOTATION;

/// Annotation holding the controller's part of the record (JSON).
pub const STATE_ANNOTATION: &str = "sandbolt.io/state";
/// Annotation holding an agent record on its Lease (JSON).
pub const AGENT_ANNOTATION: &str = "sandbolt.io/agent";
/// Label on the Leases that are agent records (not leader-election locks).
pub const AGENT_RECORD_LABEL: &str = "sandbolt.io/agent-record";
/// Annotation on a SandboxWarmPool made by the controller: the pool's
/// creation time in milliseconds (`metadata.creationTimestamp` has seconds;
/// a pool without it, e.g. applied with kubectl, uses that).
pub const WARM_CREATED_ANNOTATION: &str = "sandbolt.io/created-at-unix-ms";
/// How long an own write shadows the watch cache at most.
pub const OVERLAY_TTL: Duration = Duration::from_secs(10);
/// How long an expired sandbox's tombstone stays by default.
pub const DEFAULT_EXPIRED_SANDBOX_RETENTION: Duration = Duration::from_secs(3600);

#[derive(Debug, Clone)]
pub struct KubeStoreConfig {
    /// Namespace of the agent-record Leases (the controller's own).
    pub agents_namespace: String,
    /// Deadline of one write (all of its API requests).
    pub write_timeout: Duration,
    /// How long `open` waits for the first full list of Sandboxes.
    pub sync_timeout: Duration,
    /// How often the leader's status publisher compares every Sandbox's
    /// status with its record and the observed exits.
    pub status_period: Duration,
    /// How long an expired sandbox's tombstone stays (then the leader's
    /// status publisher deletes it).
    pub expired_sandbox_retention: Duration,
}

impl KubeStoreConfig {
    pub fn new(agents_namespace: impl Into<String>) -> Self {
        Self {
            agents_namespace: agents_namespace.into(),
            write_timeout: Duration::from_secs(10),
            sync_timeout: Duration::from_secs(30),
            status_period: Duration::from_secs(1),
            expired_sandbox_retention: DEFAULT_EXPIRED_SANDBOX_RETENTION,
        }
    }
}

/// The controller's part of a record, as stored in [`STATE_ANNOTATION`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ControllerState {
    uid: String,
    sandbox_id: SandboxId,
    agent_id: AgentId,
    phase: Phase,
    #[serde(default)]
    message: String,
    #[serde(default)]
    request_id: String,
    /// Only in annotations written before tokens were derived.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    access_token: String,
    consistency: Consistency,
    created_at_unix_ms: i64,
    generation: i64,
    #[serde(default)]
    assignment_attempt: i64,
    #[serde(default)]
    recovery_deadline_unix_ms: i64,
    #[serde(default)]
    events: Vec<Event>,
    #[serde(default)]
    last_transition_unix_ms: i64,
    #[serde(default)]
    network_policy_pending: bool,
    #[serde(default)]
    network_policy_transition_unix_ms: i64,
    #[serde(default)]
    ip_address: String,
    /// Named volumes: the Sandbox resource's `spec.volumes` has host paths
    /// only (its schema is the chart's), so the controller keeps them here.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pvc_volumes: Vec<PvcVolume>,
    /// The warm pool the sandbox belongs to: a controller decision (the
    /// resource's `poolRef` stays the agent pool the OpenSandbox server
    /// reads), so it lives here rather than in the spec.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    warm_pool: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    snapshot_id: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    claimed_warm: bool,
    /// Secret env, sealed: kept out of the resource's `spec.env` (see
    /// `crate::secrets`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    sealed_envs: BTreeMap<String, String>,
}

/// An own write the watch has not delivered yet.
enum Pending<T> {
    Present(Arc<T>),
    Deleted { uid: String },
}

/// Own writes of one kind (Sandboxes by namespace and name, warm pools and
/// snapshots by name) that shadow its watch cache.
struct Overlay<K, T> {
    entries: HashMap<K, (Pending<T>, Instant)>,
}

impl<K: Eq + std::hash::Hash, T: Resource> Overlay<K, T> {
    fn new() -> Self {
        Self {
            entries: HashMap::new(),
        }
    }

    fn fresh(&self, key: &K) -> Option<&Pending<T>> {
        self.entries
            .get(key)
            .filter(|(_, at)| at.elapsed() < OVERLAY_TTL)
            .map(|(p, _)| p)
    }

    /// The watch delivered `obj`, stored at `key` (`deleted`: as a DELETED
    /// event). Returns the keys whose entries outlived [`OVERLAY_TTL`] and
    /// were dropped (the cache shows them again).
    fn observed(&mut self, key: K, obj: &T, deleted: bool) -> Vec<K>
    where
        K: Clone,
    {
        let uid = obj.meta().uid.as_deref().unwrap_or_default();
        let settled = match self.entries.get(&key) {
            Some((Pending::Present(mine), _)) => {
                mine.meta().uid.as_deref() == Some(uid)
                    && (deleted || mine.meta().resource_version == obj.meta().resource_version)
            }
            Some((Pending::Deleted { uid: gone }, _)) => deleted && gone == uid,
            None => false,
        };
        if settled {
            self.entries.remove(&key);
        }
        let mut expired = Vec::new();
        self.entries.retain(|k, (_, at)| {
            let keep = at.elapsed() < OVERLAY_TTL;
            if !keep {
                expired.push(k.clone());
            }
            keep
        });
        expired
    }

    /// Shadows the cache with an own write of `obj` unless the cache
    /// already holds that version (`cached`, read under this overlay's
    /// lock: see [`KubeStore::remember`]).
    fn wrote(&mut self, key: K, obj: Arc<T>, cached: Option<Arc<T>>) {
        let delivered = cached.is_some_and(|c| {
            c.meta().uid == obj.meta().uid
                && c.meta().resource_version == obj.meta().resource_version
        });
        if delivered {
            self.entries.remove(&key);
        } else {
            self.entries
                .insert(key, (Pending::Present(obj), Instant::now()));
        }
    }

    /// Shadows the cache with an own delete of `obj` until the watch
    /// delivers it (nothing to shadow when the cache does not hold it).
    fn deleted(&mut self, key: K, obj: &T, cached: Option<Arc<T>>) {
        if cached.is_some_and(|c| c.meta().uid == obj.meta().uid) {
            let uid = obj.meta().uid.clone().unwrap_or_default();
            self.entries
                .insert(key, (Pending::Deleted { uid }, Instant::now()));
        } else {
            self.entries.remove(&key);
        }
    }

    /// `cache` with the fresh own writes laid over it.
    fn overlay(&self, mut cache: BTreeMap<K, Arc<T>>) -> BTreeMap<K, Arc<T>>
    where
        K: Ord + Clone,
    {
        for (key, (pending, at)) in &self.entries {
            if at.elapsed() >= OVERLAY_TTL {
                continue;
            }
            match pending {
                Pending::Present(o) => {
                    cache.insert(key.clone(), o.clone());
                }
                Pending::Deleted { .. } => {
                    cache.remove(key);
                }
            }
        }
        cache
    }
}

pub struct KubeStore {
    /// Runs every API request and the watch: the store is called from sync
    /// code on any runtime (or none) and must never need the caller's.
    runtime: Option<tokio::runtime::Runtime>,
    sandboxes: Api<Sandbox>,
    agents: Api<Lease>,
    cache: reflector::Store<Sandbox>,
    overlay: Arc<Mutex<Overlay<SandboxKey, Sandbox>>>,
    /// Lookups besides the key, and key order (`index`); locked after
    /// `overlay` when both are.
    index: Arc<Mutex<index::SandboxIndex>>,
    warm: OwnRecords<WarmPoolRecord>,
    snapshots: OwnRecords<SnapshotRecord>,
    /// The SandboxTemplates of every namespace (`crate::template`).
    templates: crate::template::TemplateCatalog,
    /// Serializes request-id checks with creates of the same request id:
    /// the API server has no unique index on request ids, this store (one
    /// leader) provides it. Creates of other request ids (and without one)
    /// run side by side: one lock for all held each create's round trips.
    create_locks: RequestIdLocks,
    write_timeout: Duration,
    status_period: Duration,
    expired_sandbox_retention: Duration,
    /// Exits the records do not hold, once the controller's core said how
    /// to observe them (see [`Store::publish_observed_exits`]).
    exits: Mutex<Option<ExitObserver>>,
    /// The status publisher, once started.
    publisher: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// A kind of the controller's own records, each kept as one custom
/// resource in the controller's namespace, named after the record, the
/// whole record in the object: warm pools and snapshots. The revision is
/// the object's resourceVersion.
trait OwnRecord: Sized {
    type Object: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + std::fmt::Debug
        + Serialize
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static;
    /// What errors and logs call one ("warm pool"), and several.
    const WHAT: &'static str;
    const PLURAL: &'static str;
    fn name(&self) -> &str;
    fn revision(&self) -> &str;
    /// The object for the record, on top of `base` (the stored object:
    /// keeps its foreign labels and annotations; the replace carries the
    /// record's revision).
    fn to_object(&self, base: Option<&Self::Object>, namespace: &str) -> StoreResult<Self::Object>;
    /// Total: the API server checked the object against the CRD.
    fn from_object(obj: &Self::Object) -> Self;
    fn exists(name: &str) -> StoreError;
    fn not_found(name: &str) -> StoreError;
    fn conflict(name: &str) -> StoreError;
}

/// The store's side of one [`OwnRecord`] kind.
struct OwnRecords<R: OwnRecord> {
    /// The kind's objects in the controller's namespace.
    api: Api<R::Object>,
    namespace: String,
    /// `Err`: why this cluster has none of them (see the module docs).
    cache: Result<reflector::Store<R::Object>, String>,
    overlay: Arc<Mutex<Overlay<String, R::Object>>>,
}

/// Probes for `R`'s objects in `namespace`, starts their watch and waits for
/// its first full list; a cache of `Err(why)` when the cluster has none to
/// offer.
async fn watch_own_records<R: OwnRecord>(
    client: Client,
    namespace: &str,
    sync_timeout: Duration,
) -> StoreResult<OwnRecords<R>> {
    let api: Api<R::Object> = Api::namespaced(client, namespace);
    let overlay = Arc::new(Mutex::new(Overlay::new()));
    let records = |cache| OwnRecords {
        api: api.clone(),
        namespace: namespace.to_string(),
        cache,
        overlay: overlay.clone(),
    };
    let kind = R::Object::kind(&());
    match api.list(&ListParams::default().limit(1)).await {
        Ok(_) => {}
        // 404: the CRD is missing; 403: the Role predates the kind. Either
        // way an operator has to act, and the controller is still useful.
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 403 => {
            let plural = R::Object::plural(&());
            let why = format!(
                "{kind} resources are not available ({} {}): apply \
                 deploy/crds/{plural}.{}.yaml and let the controller's Role \
                 manage {plural}, then restart the controller",
                s.code,
                s.message,
                R::Object::group(&()),
            );
            tracing::warn!("{why}; running without {}", R::PLURAL);
            return Ok(records(Err(why)));
        }
        // Anything else is the watch's to retry, within the sync deadline.
        Err(e) => tracing::warn!(error = %e, "probing {kind}s failed"),
    }
    let cache = watch_cached(
        &api,
        overlay.clone(),
        |o: &R::Object| o.name_any(),
        R::PLURAL,
        sync_timeout,
        |_, _, _| {},
    )
    .await?;
    Ok(records(Ok(cache)))
}

/// What changed in a watched cache, for [`watch_cached`]'s `changed`.
enum Changed<'a, K> {
    /// The view of these keys (cache + overlay) may have changed.
    Keys(&'a [K]),
    /// The watch listed everything anew (deletions missed while it was
    /// away come without an event).
    Relisted,
}

/// Starts the watch of `api`'s objects (`plural` in logs and errors),
/// feeding a reflector cache and settling `overlay`'s own writes, and waits
/// for its first full list. `changed` is told, under the overlay's lock,
/// what each event changed.
async fn watch_cached<T, K>(
    api: &Api<T>,
    overlay: Arc<Mutex<Overlay<K, T>>>,
    key_of: fn(&T) -> K,
    plural: &'static str,
    sync_timeout: Duration,
    mut changed: impl FnMut(&Overlay<K, T>, &reflector::Store<T>, Changed<'_, K>) + Send + 'static,
) -> StoreResult<reflector::Store<T>>
where
    T: Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    K: Eq + std::hash::Hash + Clone + Send + 'static,
{
    let (cache, writer) = reflector::store();
    let events = reflector::reflector(
        writer,
        watcher(api.clone(), watcher::Config::default()).default_backoff(),
    );
    let reader = cache.clone();
    tokio::spawn(async move {
        let mut events = std::pin::pin!(events);
        while let Some(ev) = events.next().await {
            let (o, deleted) = match ev {
                Ok(watcher::Event::Apply(o) | watcher::Event::InitApply(o)) => (o, false),
                Ok(watcher::Event::Delete(o)) => (o, true),
                Ok(watcher::Event::InitDone) => {
                    changed(&overlay.lock(), &reader, Changed::Relisted);
                    continue;
                }
                Ok(watcher::Event::Init) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "{plural} watch failed; retrying");
                    continue;
                }
            };
            let key = key_of(&o);
            let mut overlay = overlay.lock();
            let mut keys = overlay.observed(key.clone(), &o, deleted);
            keys.push(key);
            changed(&overlay, &reader, Changed::Keys(&keys));
        }
    });
    tokio::time::timeout(sync_timeout, cache.wait_until_ready())
        .await
        .map_err(|_| {
            StoreError::Unavailable(format!(
                "no full list of {plural} from the API server within {sync_timeout:?}"
            ))
        })?
        .map_err(backend)?;
    Ok(cache)
}

/// One lock per request id a create is running with (see
/// `KubeStore::create_locks`), forgotten when nobody holds or waits.
#[derive(Default)]
struct RequestIdLocks {
    map: Mutex<HashMap<String, Arc<Mutex<()>>>>,
}

impl RequestIdLocks {
    /// Runs `f` holding `request_id`'s lock (no lock for an empty one).
    fn hold<T>(&self, request_id: &str, f: impl FnOnce() -> T) -> T {
        if request_id.is_empty() {
            return f();
        }
        let lock = self
            .map
            .lock()
            .entry(request_id.to_string())
            .or_default()
            .clone();
        let out = {
            let _held = lock.lock();
            f()
        };
        let mut map = self.map.lock();
        // Clones are taken under the map's lock: 2 = the map's and ours.
        if Arc::strong_count(&lock) == 2 {
            map.remove(request_id);
        }
        out
    }
}

/// How many keys a list takes from the index at a time.
const LIST_CHUNK: usize = 256;

/// What the store shows at `key`: an own write the watch has not
/// delivered, else the cache.
fn merged(
    overlay: &Overlay<SandboxKey, Sandbox>,
    cache: &reflector::Store<Sandbox>,
    key: &SandboxKey,
) -> Option<Arc<Sandbox>> {
    match overlay.fresh(key) {
        Some(Pending::Present(o)) => Some(o.clone()),
        Some(Pending::Deleted { .. }) => None,
        None => cache.get(&object_ref(key)),
    }
}

fn key_of(obj: &Sandbox) -> SandboxKey {
    SandboxKey {
        namespace: obj.namespace().unwrap_or_default(),
        name: obj.name_any(),
    }
}

/// The cache's reference to the object at `key`.
fn object_ref(key: &SandboxKey) -> ObjectRef<Sandbox> {
    ObjectRef::new(&key.name).within(&key.namespace)
}

fn backend(e: impl std::fmt::Display) -> StoreError {
    StoreError::Backend(e.to_string())
}

impl KubeStore {
    /// Connects with `config`, starts the watch and waits until the cache
    /// holds a full list of Sandboxes (all namespaces).
    pub fn open(config: kube::Config, store_config: KubeStoreConfig) -> StoreResult<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kube-store")
            .enable_all()
            .build()
            .map_err(backend)?;
        let overlay = Arc::new(Mutex::new(Overlay::new()));
        let ov = overlay.clone();
        let index = Arc::new(Mutex::new(index::SandboxIndex::default()));
        let ix = index.clone();
        let reindex = move |overlay: &Overlay<SandboxKey, Sandbox>,
                            cache: &reflector::Store<Sandbox>,
                            what: Changed<'_, SandboxKey>| {
            let mut ix = ix.lock();
            match what {
                Changed::Keys(keys) => {
                    for key in keys {
                        ix.set(key, merged(overlay, cache, key).as_deref());
                    }
                }
                Changed::Relisted => {
                    let all = cache.state().into_iter().map(|o| (key_of(&o), o)).collect();
                    let all = overlay.overlay(all);
                    ix.rebuild(all.iter().map(|(k, o)| (k.clone(), &**o)));
                }
            }
        };
        let sync_timeout = store_config.sync_timeout;
        let ns = store_config.agents_namespace.clone();
        let templates = crate::template::TemplateCatalog::start(config.clone(), sync_timeout);
        let templates = runtime.spawn(templates);
        let started = runtime.spawn(async move {
            let client = Client::try_from(config).map_err(backend)?;
            let sandboxes: Api<Sandbox> = Api::all(client.clone());
            let agents: Api<Lease> = Api::namespaced(client.clone(), &ns);
            let (cache, warm, snapshots) = futures::try_join!(
                watch_cached(&sandboxes, ov, key_of, "sandboxes", sync_timeout, reindex),
                watch_own_records(client.clone(), &ns, sync_timeout),
                watch_own_records(client, &ns, sync_timeout),
            )?;
            Ok::<_, StoreError>((sandboxes, agents, cache, warm, snapshots))
        });
        let (sandboxes, agents, cache, warm, snapshots) = wait(started)?;
        let templates = wait(templates)?;
        tracing::info!(
            sandboxes = cache.len(),
            warm_pools = warm.cache.as_ref().map(|c| c.len()).ok(),
            snapshots = snapshots.cache.as_ref().map(|c| c.len()).ok(),
            "kubernetes store synced"
        );
        Ok(Self {
            runtime: Some(runtime),
            sandboxes,
            agents,
            cache,
            overlay,
            index,
            warm,
            snapshots,
            templates,
            create_locks: RequestIdLocks::default(),
            write_timeout: store_config.write_timeout,
            status_period: store_config.status_period,
            expired_sandbox_retention: store_config.expired_sandbox_retention,
            exits: Mutex::new(None),
            publisher: Mutex::new(None),
        })
    }

    /// Runs `fut` on the store's runtime under the write deadline and waits.
    fn call<T: Send + 'static>(
        &self,
        what: impl std::fmt::Display + Send + 'static,
        fut: impl Future<Output = Result<T, kube::Error>> + Send + 'static,
    ) -> StoreResult<Result<T, kube::Error>> {
        let timeout = self.write_timeout;
        let rt = self
            .runtime
            .as_ref()
            .expect("runtime lives as long as the store");
        wait(rt.spawn(async move {
            tokio::time::timeout(timeout, fut).await.map_err(|_| {
                StoreError::Unavailable(format!("kubernetes API: {what} took over {timeout:?}"))
            })
        }))
    }

    fn lookup(&self, key: &SandboxKey) -> Option<Arc<Sandbox>> {
        match self.overlay.lock().fresh(key) {
            Some(Pending::Present(o)) => return Some(o.clone()),
            Some(Pending::Deleted { .. }) => return None,
            None => {}
        }
        self.cache.get(&object_ref(key))
    }

    /// The record at `key` if `check` accepts it: the index's candidates
    /// are confirmed on the record itself.
    fn confirmed(
        &self,
        key: Option<SandboxKey>,
        check: impl Fn(&SandboxRecord) -> bool,
    ) -> StoreResult<Option<SandboxRecord>> {
        let Some(obj) = key.and_then(|k| self.lookup(&k)) else {
            return Ok(None);
        };
        Ok(from_object(&obj)?.filter(|r| check(r)))
    }

    /// The records of `keys` in order (those gone meanwhile left out).
    fn records_of(
        &self,
        keys: impl IntoIterator<Item = SandboxKey>,
    ) -> impl Iterator<Item = StoreResult<SandboxRecord>> {
        keys.into_iter()
            .filter_map(|k| self.lookup(&k))
            .filter_map(|o| from_object(&o).transpose())
    }

    /// Re-indexes `key` after an own write, under the overlay's lock.
    fn reindex(&self, overlay: &Overlay<SandboxKey, Sandbox>, key: &SandboxKey) {
        let view = merged(overlay, &self.cache, key);
        self.index.lock().set(key, view.as_deref());
    }

    /// Every record of `range` (no limit) from one copy of the whole view:
    /// cheaper per record than a lookup per key when most are read anyway.
    fn list_everything(&self, range: &ListRange<'_>) -> StoreResult<Vec<SandboxRecord>> {
        let records = self
            .snapshot()
            .into_iter()
            .filter(|(key, _)| range.contains(key))
            .filter_map(|(key, obj)| match from_object(&obj) {
                Ok(Some(r)) => Some(Ok(r)),
                Ok(None) => {
                    tracing::debug!(sandbox = %key.name, namespace = %key.namespace, "skipping a Sandbox sandbolt did not write");
                    None
                }
                Err(e) => Some(Err(e)),
            });
        records.collect()
    }

    /// Every Sandbox as this store sees it, keyed by namespace and name.
    fn snapshot(&self) -> BTreeMap<SandboxKey, Arc<Sandbox>> {
        let all: BTreeMap<_, _> = self
            .cache
            .state()
            .into_iter()
            .map(|o| (key_of(&o), o))
            .collect();
        self.overlay.lock().overlay(all)
    }

    /// Shadows the cache with an own write until the watch delivers it.
    ///
    /// Under the overlay lock, which the watch task also takes *after* the
    /// reflector applied an event: either the cache already holds this
    /// version (the watch was faster than our caller) and no entry is made,
    /// or the watch task finds the entry when the event comes and drops it.
    fn remember(&self, obj: Sandbox) -> Arc<Sandbox> {
        let obj = Arc::new(obj);
        let key = key_of(&obj);
        let mut overlay = self.overlay.lock();
        let cached = self.cache.get(&object_ref(&key));
        overlay.wrote(key.clone(), obj.clone(), cached);
        self.reindex(&overlay, &key);
        obj
    }

    /// After a conflict: the server holds a newer object than the cache,
    /// whose watch may take a while to deliver it (an external writer, a
    /// loaded machine). Reading it now lets the caller's retry apply its
    /// change to the newest object instead of conflicting again on the stale
    /// one until its retries run out. Best effort: on failure the watch
    /// still catches up.
    fn catch_up(&self, key: &SandboxKey) {
        let api = self.sandboxes_in(&key.namespace);
        let name = key.name.clone();
        if let Ok(Ok(Some(fresh))) = self.call("get", async move { api.get_opt(&name).await }) {
            self.remember(fresh);
        }
    }

    /// Shadows the cache with an own delete until the watch delivers it.
    fn forget(&self, obj: &Sandbox) {
        let key = key_of(obj);
        let mut overlay = self.overlay.lock();
        let cached = self.cache.get(&object_ref(&key));
        overlay.deleted(key.clone(), obj, cached);
        self.reindex(&overlay, &key);
    }

    /// Writes the status derived from `record` if it differs from `written`'s
    /// at once (its observedGeneration is the generation `written` has, so
    /// readers see a spec change unobserved for one round trip only);
    /// returns the newest object.
    fn sync_status(&self, record: &SandboxRecord, written: Sandbox) -> Sandbox {
        let observer = self.exits.lock().clone();
        let exit = observer.and_then(|o| o(record));
        let status = derive_status(
            record,
            exit.as_ref(),
            written.metadata.generation.unwrap_or(1),
        );
        if written.status.as_ref() == Some(&status) {
            return written;
        }
        let mut desired = written.clone();
        desired.status = Some(status);
        let api = self.sandboxes_in(&record.namespace);
        let name = record.name.clone();
        let outcome = self
            .call("status write", async move {
                api.replace_status(&name, &PostParams::default(), &desired)
                    .await
            })
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        match outcome {
            Ok(o) => o,
            Err(error) => {
                tracing::warn!(sandbox = %record.name, namespace = %record.namespace, %error, "status not written; the next write retries");
                written
            }
        }
    }

    /// Creates `obj`; `Err(holder)`, the object holding the name (perhaps
    /// still terminating, or a tombstone), when it is taken.
    fn create_object(
        &self,
        key: &SandboxKey,
        obj: &Sandbox,
    ) -> StoreResult<Result<Sandbox, Sandbox>> {
        let api = self.sandboxes_in(&key.namespace);
        let o = obj.clone();
        match self.call("create", async move {
            api.create(&PostParams::default(), &o).await
        })? {
            Ok(o) => Ok(Ok(o)),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                let api = self.sandboxes_in(&key.namespace);
                let name = key.name.clone();
                let holder = self
                    .call("get", async move { api.get(&name).await })?
                    .map_err(|e| api_error(e, key))?;
                Ok(Err(holder))
            }
            Err(e) => Err(api_error(e, key)),
        }
    }

    /// [`Store::create`] under the request id's lock.
    fn create_unique(&self, record: &SandboxRecord) -> StoreResult<SandboxRecord> {
        if !record.request_id.is_empty()
            && let Some(holder) = self.get_by_request_id(&record.request_id)?
        {
            return Err(StoreError::AlreadyExists(Box::new(holder)));
        }
        let key = record.key();
        let obj = to_object(record, None)?;
        let created = match self.create_object(&key, &obj)? {
            Ok(o) => o,
            // An expired sandbox's remains: a new sandbox of the name
            // replaces them.
            Err(holder) if tombstone::is_tombstone(&holder) => {
                self.remove_tombstone(&holder)?;
                self.create_object(&key, &obj)?
                    .map_err(|holder| taken_by(&key, &holder))?
            }
            Err(holder) => return Err(taken_by(&key, &holder)),
        };
        let newest = self.sync_status(record, created);
        let obj = self.remember(newest);
        from_object(&obj)?.ok_or_else(|| StoreError::Corrupt("written without state".into()))
    }

    fn remove_tombstone(&self, obj: &Sandbox) -> StoreResult<()> {
        let key = key_of(obj);
        let api = self.sandboxes_in(&key.namespace);
        let o = obj.clone();
        self.call("delete tombstone", async move {
            tombstone::remove(api, &o).await
        })?
        .map_err(|e| api_error(e, &key))?;
        self.forget(obj);
        Ok(())
    }

    fn sandboxes_in(&self, namespace: &str) -> Api<Sandbox> {
        Api::namespaced(self.sandboxes.clone().into_client(), namespace)
    }

    /// Creates (`record`'s revision empty) or replaces (revision = the
    /// stored one) one of the controller's own records.
    fn put_own<R: OwnRecord>(&self, records: &OwnRecords<R>, record: &R) -> StoreResult<R> {
        records.cache()?;
        let name = record.name().to_string();
        let api = records.api.clone();
        let written = if record.revision().is_empty() {
            let obj = record.to_object(None, &records.namespace)?;
            self.call(format!("{} create", R::WHAT), async move {
                api.create(&PostParams::default(), &obj).await
            })?
            // Any 409 of a create is the name being taken.
            .map_err(|e| match e {
                kube::Error::Api(s) if s.code == 409 => R::exists(&name),
                e => own_api_error::<R>(e, &name),
            })?
        } else {
            // The base must be the version the caller read: built on an
            // older one (a lagging cache), the replace, which the server
            // checks against the caller's revision only, would drop what
            // others added to the metadata in between.
            let base = match records.lookup(&name) {
                Some(o) if o.meta().resource_version.as_deref() == Some(record.revision()) => o,
                _ => {
                    let (api, n) = (api.clone(), name.clone());
                    self.call(
                        format!("{} get", R::WHAT),
                        async move { api.get_opt(&n).await },
                    )?
                    .map_err(|e| own_api_error::<R>(e, &name))?
                    .map(Arc::new)
                    .ok_or_else(|| R::not_found(&name))?
                }
            };
            let obj = record.to_object(Some(&base), &records.namespace)?;
            let n = name.clone();
            self.call(format!("{} replace", R::WHAT), async move {
                api.replace(&n, &PostParams::default(), &obj).await
            })?
            .map_err(|e| own_api_error::<R>(e, &name))?
        };
        let written = records.remember(written)?;
        Ok(R::from_object(&written))
    }

    /// Removes one of the controller's own records; `None` if it did not
    /// exist.
    fn delete_own<R: OwnRecord>(
        &self,
        records: &OwnRecords<R>,
        name: &str,
    ) -> StoreResult<Option<R>> {
        if records.cache.is_err() {
            return Ok(None);
        }
        let api = records.api.clone();
        let n = name.to_string();
        let deleted = self
            .call(format!("{} delete", R::WHAT), async move {
                // Read, then delete that very object (uid precondition): the
                // record returned is the one removed, even when it was
                // deleted and made again in between (then: read again).
                loop {
                    let Some(current) = api.get_opt(&n).await? else {
                        return Ok(None);
                    };
                    match api
                        .delete(&n, &delete_of_uid(current.meta().uid.clone()))
                        .await
                    {
                        Ok(_) => return Ok(Some(current)),
                        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(None),
                        Err(kube::Error::Api(s)) if s.code == 409 => continue,
                        Err(e) => return Err(e),
                    }
                }
            })?
            .map_err(|e| own_api_error::<R>(e, name))?;
        match deleted {
            Some(obj) => {
                records.forget(&obj)?;
                Ok(Some(R::from_object(&obj)))
            }
            None => {
                // Gone already: make sure no own write still shows it.
                records.overlay.lock().entries.remove(name);
                Ok(None)
            }
        }
    }
}

impl<R: OwnRecord> OwnRecords<R> {
    fn cache(&self) -> StoreResult<&reflector::Store<R::Object>> {
        self.cache
            .as_ref()
            .map_err(|why| StoreError::Backend(why.clone()))
    }

    fn object_ref(&self, name: &str) -> ObjectRef<R::Object> {
        ObjectRef::new(name).within(&self.namespace)
    }

    fn lookup(&self, name: &str) -> Option<Arc<R::Object>> {
        let cache = self.cache.as_ref().ok()?;
        let overlay = self.overlay.lock();
        match overlay.fresh(&name.to_string()) {
            Some(Pending::Present(o)) => Some(o.clone()),
            Some(Pending::Deleted { .. }) => None,
            None => cache.get(&self.object_ref(name)),
        }
    }

    fn get(&self, name: &str) -> Option<R> {
        self.lookup(name).map(|o| R::from_object(&o))
    }

    /// Every record, in name order; none without the CRD.
    fn list(&self) -> Vec<R> {
        let Ok(cache) = &self.cache else {
            return Vec::new();
        };
        let cached = cache
            .state()
            .into_iter()
            .map(|o| (o.name_any(), o))
            .collect();
        let all = self.overlay.lock().overlay(cached);
        all.values().map(|o| R::from_object(o)).collect()
    }

    /// [`KubeStore::remember`] for own records.
    fn remember(&self, obj: R::Object) -> StoreResult<Arc<R::Object>> {
        let cache = self.cache()?;
        let obj = Arc::new(obj);
        let name = obj.name_any();
        let mut overlay = self.overlay.lock();
        let cached = cache.get(&self.object_ref(&name));
        overlay.wrote(name, obj.clone(), cached);
        Ok(obj)
    }

    /// [`KubeStore::forget`] for own records.
    fn forget(&self, obj: &R::Object) -> StoreResult<()> {
        let cache = self.cache()?;
        let name = obj.name_any();
        let mut overlay = self.overlay.lock();
        let cached = cache.get(&self.object_ref(&name));
        overlay.deleted(name, obj, cached);
        Ok(())
    }
}

impl Drop for KubeStore {
    fn drop(&mut self) {
        // A runtime may not be dropped (blocking) inside another one.
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Waits for a task of the store's runtime from sync code on any thread.
fn wait<T: Send + 'static>(task: tokio::task::JoinHandle<StoreResult<T>>) -> StoreResult<T> {
    let join = move || futures::executor::block_on(task);
    let joined = match tokio::runtime::Handle::try_current() {
        // Lets the caller's runtime move its other tasks to other workers
        // while this one waits for the API server.
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(join)
        }
        _ => join(),
    };
    joined.map_err(|e| StoreError::Backend(format!("kube store task: {e}")))?
}

/// Maps an API error of a request about the record at `key`.
/// A delete of the object with that uid only (`None`: whatever holds the
/// name): one made again under the name in between is not touched.
fn delete_of_uid(uid: Option<String>) -> DeleteParams {
    DeleteParams {
        preconditions: uid.map(|uid| kube::api::Preconditions {
            uid: Some(uid),
            resource_version: None,
        }),
        ..DeleteParams::default()
    }
}

fn api_error(e: kube::Error, key: &SandboxKey) -> StoreError {
    match &e {
        kube::Error::Api(s) if s.code == 404 => StoreError::NotFound(key.clone()),
        kube::Error::Api(s) if s.code == 409 && s.reason == "Conflict" => {
            StoreError::Conflict(key.clone())
        }
        kube::Error::Api(s) if s.code == 422 || s.code == 400 => {
            StoreError::Invalid(s.message.clone())
        }
        _ => StoreError::Backend(format!("kubernetes API: {e}")),
    }
}

/// A host volume in the other shape: the record's [`HostVolume`] and the
/// resource's [`SandboxVolume`] have the same fields (only their JSON names
/// differ), so one list maps both ways.
macro_rules! volume {
    ($v:expr => $shape:ident) => {
        $shape {
            name: $v.name.clone(),
            host_path: $v.host_path.clone(),
            sub_path: $v.sub_path.clone(),
            mount_path: $v.mount_path.clone(),
            read_only: $v.read_only,
        }
    };
}

/// Why a create found `key` taken by `holder`.
fn taken_by(key: &SandboxKey, holder: &Sandbox) -> StoreError {
    match from_object(holder) {
        Ok(Some(record)) => StoreError::AlreadyExists(Box::new(record)),
        Ok(None) if tombstone::is_tombstone(holder) => StoreError::Unavailable(format!(
            "sandbox {key}: the tombstone of an expired sandbox of this name is still being removed"
        )),
        Ok(None) => {
            StoreError::Invalid(format!("sandbox {key} exists and was not made by sandbolt"))
        }
        Err(e) => e,
    }
}

fn to_time(unix_seconds: i64) -> Option<Time> {
    Timestamp::from_second(unix_seconds).ok().map(Time)
}

/// The object for `record`, on top of `base` (the stored object: keeps its
/// finalizers, foreign labels and annotations, and resourceVersion source).
fn to_object(record: &SandboxRecord, base: Option<&Sandbox>) -> StoreResult<Sandbox> {
    let mut obj = base.cloned().unwrap_or_else(|| {
        let mut o = Sandbox::new(&record.name, SandboxSpec::default());
        o.metadata.namespace = Some(record.namespace.clone());
        o.metadata.finalizers = Some(vec![FINALIZER.to_string()]);
        o
    });
    let spec = &record.spec;
    obj.spec = SandboxSpec {
        image: spec.image.clone(),
        command: spec.command.clone(),
        args: spec.args.clone(),
        pool_ref: spec.pool.clone(),
        expire_time: (spec.expires_at > 0)
            .then(|| to_time(spec.expires_at))
            .flatten(),
        env: spec.envs.clone(),
        working_dir: (!spec.working_dir.is_empty()).then(|| spec.working_dir.clone()),
        exposed_ports: spec.exposed_ports.clone(),
        failure_policy: Some(match spec.failure_policy {
            FailurePolicy::Manual => CrFailurePolicy::Manual,
            FailurePolicy::AutoRecreate => CrFailurePolicy::AutoRecreate,
        }),
        recovery_timeout_seconds: (spec.recovery_timeout_seconds > 0)
            .then_some(spec.recovery_timeout_seconds),
        reset_revision: (!record.reset_revision.is_empty()).then(|| record.reset_revision.clone()),
        resources: resources_to_spec(&spec.resources),
        volumes: spec
            .volumes
            .iter()
            .map(|v| volume!(v => SandboxVolume))
            .collect(),
        runtime: (!spec.runtime.is_empty()).then(|| spec.runtime.clone()),
        network_policy: policy_to_spec(&spec.network_policy_json)?,
        action_bindings: policy_to_bindings(&spec.network_policy_json),
    };
    let labels = obj.metadata.labels.get_or_insert_with(BTreeMap::new);
    labels.retain(|k, _| !k.starts_with(sandbolt_deploy::sandbox::METADATA_LABEL_PREFIX));
    labels.extend(metadata_to_labels(&record.spec.metadata));
    let state = ControllerState {
        uid: record.uid.clone(),
        sandbox_id: record.sandbox_id.clone(),
        agent_id: record.agent_id.clone(),
        phase: record.phase,
        message: record.message.clone(),
        request_id: record.request_id.clone(),
        access_token: record.access_token.clone(),
        consistency: record.consistency,
        created_at_unix_ms: record.created_at_unix_ms,
        generation: record.generation,
        assignment_attempt: record.assignment_attempt,
        recovery_deadline_unix_ms: record.recovery_deadline_unix_ms,
        events: record.events.clone(),
        last_transition_unix_ms: record.last_transition_unix_ms,
        network_policy_pending: record.network_policy_pending,
        network_policy_transition_unix_ms: record.network_policy_transition_unix_ms,
        ip_address: record.ip_address.clone(),
        pvc_volumes: record.spec.pvc_volumes.clone(),
        warm_pool: record.spec.warm_pool.clone(),
        snapshot_id: record.spec.snapshot_id.clone(),
        claimed_warm: record.claimed_warm,
        sealed_envs: record.spec.sealed_envs.clone(),
    };
    obj.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(
            STATE_ANNOTATION.into(),
            serde_json::to_string(&state).map_err(|e| StoreError::Corrupt(e.to_string()))?,
        );
    if base.is_some() {
        obj.metadata.resource_version = Some(record.revision.clone());
    }
    Ok(obj)
}

/// The record in `obj`; `None` for a Sandbox the controller did not write
/// (no state annotation).
fn from_object(obj: &Sandbox) -> StoreResult<Option<SandboxRecord>> {
    let Some(raw) = obj.annotations().get(STATE_ANNOTATION) else {
        return Ok(None);
    };
    let state: ControllerState = serde_json::from_str(raw).map_err(|e| {
        StoreError::Corrupt(format!(
            "sandbox {}/{}: annotation {STATE_ANNOTATION}: {e}",
            obj.namespace().unwrap_or_default(),
            obj.name_any()
        ))
    })?;
    let spec = &obj.spec;
    Ok(Some(SandboxRecord {
        uid: state.uid,
        name: obj.name_any(),
        namespace: obj.namespace().unwrap_or_default(),
        sandbox_id: state.sandbox_id,
        agent_id: state.agent_id,
        spec: RecordSpec {
            pool: spec.pool_ref.clone(),
            image: spec.image.clone(),
            command: spec.command.clone(),
            args: spec.args.clone(),
            envs: spec.env.clone(),
            working_dir: spec.working_dir.clone().unwrap_or_default(),
            exposed_ports: spec.exposed_ports.clone(),
            metadata: labels_to_metadata(obj.labels()),
            expires_at: spec
                .expire_time
                .as_ref()
                .map(|t| t.0.as_second())
                .unwrap_or(0),
            failure_policy: match spec.failure_policy {
                Some(CrFailurePolicy::AutoRecreate) => FailurePolicy::AutoRecreate,
                Some(CrFailurePolicy::Manual) | None => FailurePolicy::Manual,
            },
            recovery_timeout_seconds: spec.recovery_timeout_seconds.unwrap_or(0),
            resources: resources_from_spec(spec.resources.as_ref())?,
            volumes: spec
                .volumes
                .iter()
                .map(|v| volume!(v => HostVolume))
                .collect(),
            runtime: spec.runtime.clone().unwrap_or_default(),
            network_policy_json: policy_from_spec(spec, obj)?,
            pvc_volumes: state.pvc_volumes,
            warm_pool: state.warm_pool,
            snapshot_id: state.snapshot_id,
            sealed_envs: state.sealed_envs,
        },
        reset_revision: spec.reset_revision.clone().unwrap_or_default(),
        generation: state.generation,
        phase: state.phase,
        message: state.message,
        request_id: state.request_id,
        access_token: state.access_token,
        consistency: state.consistency,
        created_at_unix_ms: state.created_at_unix_ms,
        assignment_attempt: state.assignment_attempt,
        recovery_deadline_unix_ms: state.recovery_deadline_unix_ms,
        events: state.events,
        revision: obj.resource_version().unwrap_or_default(),
        last_transition_unix_ms: state.last_transition_unix_ms,
        network_policy_pending: state.network_policy_pending,
        network_policy_transition_unix_ms: state.network_policy_transition_unix_ms,
        ip_address: state.ip_address,
        claimed_warm: state.claimed_warm,
        api_uid: obj.metadata.uid.clone().unwrap_or_default(),
        api_generation: obj.metadata.generation.unwrap_or(0),
    }))
}

/// The record's normalized policy JSON as the resource's structured
/// `spec.networkPolicy` (same JSON shape); `None` for allow-all.
fn policy_to_spec(json: &str) -> StoreResult<Option<SandboxNetworkPolicy>> {
    if json.is_empty() {
        return Ok(None);
    }
    serde_json::from_str(json)
        .map(Some)
        .map_err(|e| StoreError::Invalid(format!("spec.networkPolicy: {e}")))
}

/// The record's normalized policy JSON as the FastPath action bindings
/// the OpenSandbox server reads (`spec.actionBindings`); none for
/// allow-all. The controller's record holds one policy: FastPath bindings
/// are turned into it on the way in (`fastpath::v2`), and back here.
fn policy_to_bindings(json: &str) -> Vec<ActionBinding> {
    if json.is_empty() {
        return Vec::new();
    }
    vec![ActionBinding {
        handler: EGRESS_HANDLER.into(),
        input: json.to_string(),
    }]
}

/// The policy of `spec` as the record's normalized JSON, checked by the one
/// policy parser (the object may have been edited by hand): the structured
/// `networkPolicy`, else the `egress` action binding's input (an object
/// that has only the bindings, as fast-sandbox writes them).
fn policy_from_spec(spec: &SandboxSpec, obj: &Sandbox) -> StoreResult<String> {
    let (field, json) = match (&spec.network_policy, egress_binding(spec)) {
        (Some(p), _) => (
            "networkPolicy",
            serde_json::to_string(p).map_err(|e| corrupt_policy(obj, "networkPolicy", e))?,
        ),
        (None, Some(b)) => ("actionBindings", b.input.clone()),
        (None, None) => return Ok(String::new()),
    };
    NetworkPolicy::parse(&json)
        .map(|p| p.to_json())
        .map_err(|e| corrupt_policy(obj, field, e))
}

fn egress_binding(spec: &SandboxSpec) -> Option<&ActionBinding> {
    spec.action_bindings
        .iter()
        .find(|b| b.handler == EGRESS_HANDLER)
}

fn corrupt_policy(obj: &Sandbox, field: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!(
        "sandbox {}/{}: spec.{field}: {e}",
        obj.namespace().unwrap_or_default(),
        obj.name_any()
    ))
}

/// Limits and requests in the Kubernetes shape (`limits.cpu`, …); `None`
/// when nothing is set.
fn resources_to_spec(r: &Resources) -> Option<SandboxResources> {
    if r.is_empty() {
        return None;
    }
    let set = |pairs: &[(&str, &String)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| (k.to_string(), (*v).clone()))
            .collect()
    };
    let mut limits = set(&[
        ("cpu", &r.cpu_limit),
        ("memory", &r.memory_limit),
        ("ephemeral-storage", &r.ephemeral_storage_limit),
    ]);
    let requests = set(&[("cpu", &r.cpu_request), ("memory", &r.memory_request)]);
    if r.pids_limit > 0 {
        limits.insert("pids".into(), r.pids_limit.to_string());
    }
    Some(SandboxResources { limits, requests })
}

fn resources_from_spec(s: Option<&SandboxResources>) -> StoreResult<Resources> {
    let Some(s) = s else {
        return Ok(Resources::default());
    };
    let get = |m: &BTreeMap<String, String>, k: &str| m.get(k).cloned().unwrap_or_default();
    Ok(Resources {
        cpu_limit: get(&s.limits, "cpu"),
        memory_limit: get(&s.limits, "memory"),
        pids_limit: match s.limits.get("pids") {
            None => 0,
            Some(p) => p
                .parse()
                .map_err(|_| StoreError::Corrupt(format!("spec.resources.limits.pids {p:?}")))?,
        },
        cpu_request: get(&s.requests, "cpu"),
        memory_request: get(&s.requests, "memory"),
        ephemeral_storage_limit: get(&s.limits, "ephemeral-storage"),
    })
}

/// The SandboxWarmPool for `pool`, on top of `base` (the stored object: keeps
/// its foreign labels and annotations; the replace carries `pool.revision`).
fn warm_to_object(
    pool: &WarmPoolRecord,
    base: Option<&SandboxWarmPool>,
    namespace: &str,
) -> StoreResult<SandboxWarmPool> {
    let runtime = match pool.runtime.as_str() {
        "" => None,
        "runc" => Some(OciRuntime::Runc),
        "crun" => Some(OciRuntime::Crun),
        "runsc" => Some(OciRuntime::Runsc),
        other => {
            return Err(StoreError::Invalid(format!(
                "warm pool {}: runtime {other:?} is none of runc, crun, runsc",
                pool.name
            )));
        }
    };
    let quantity = |q: &String| (!q.is_empty()).then(|| IntOrString::String(q.clone()));
    let limits = LimitValues {
        cpu: quantity(&pool.limits.cpu_limit),
        memory: quantity(&pool.limits.memory_limit),
        pids: (pool.limits.pids_limit > 0).then_some(pool.limits.pids_limit),
    };
    let spec = SandboxWarmPoolSpec {
        agent_pool: (!pool.agent_pool.is_empty()).then(|| pool.agent_pool.clone()),
        template: WarmPoolTemplate {
            image: pool.image.clone(),
            runtime,
            limits: (limits != LimitValues::default()).then_some(limits),
            env: pool.env.clone(),
        },
        capacity: WarmPoolCapacity {
            buffer_min: pool.buffer_min,
            buffer_max: pool.buffer_max,
            pool_min: pool.pool_min,
            pool_max: pool.pool_max,
        },
    };
    let mut obj = match base {
        Some(base) => {
            let mut o = base.clone();
            o.spec = spec;
            o.metadata.resource_version = Some(pool.revision.clone());
            o
        }
        None => {
            let mut o = SandboxWarmPool::new(&pool.name, spec);
            o.metadata.namespace = Some(namespace.to_string());
            o
        }
    };
    if pool.created_at_unix_ms > 0 {
        obj.metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(
                WARM_CREATED_ANNOTATION.into(),
                pool.created_at_unix_ms.to_string(),
            );
    }
    Ok(obj)
}

/// The warm pool `obj` holds. Total: the API server checked the object
/// against the CRD, and the controller validates pools it uses.
fn warm_from_object(obj: &SandboxWarmPool) -> WarmPoolRecord {
    let spec = &obj.spec;
    let template = &spec.template;
    let limits = template.limits.clone().unwrap_or_default();
    let quantity = |q: Option<IntOrString>| match q {
        None => String::new(),
        Some(IntOrString::Int(i)) => i.to_string(),
        Some(IntOrString::String(s)) => s,
    };
    let created_at_unix_ms = obj
        .annotations()
        .get(WARM_CREATED_ANNOTATION)
        .and_then(|v| v.parse().ok())
        .or_else(|| {
            obj.metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.as_millisecond())
        })
        .unwrap_or(0);
    WarmPoolRecord {
        name: obj.name_any(),
        agent_pool: spec.agent_pool().to_string(),
        image: template.image.clone(),
        runtime: template
            .runtime
            .map(|r| r.as_str().to_string())
            .unwrap_or_default(),
        limits: Resources {
            cpu_limit: quantity(limits.cpu),
            memory_limit: quantity(limits.memory),
            pids_limit: limits.pids.unwrap_or(0),
            ..Resources::default()
        },
        env: template.env.clone(),
        buffer_min: spec.capacity.buffer_min,
        buffer_max: spec.capacity.buffer_max,
        pool_min: spec.capacity.pool_min,
        pool_max: spec.capacity.pool_max,
        created_at_unix_ms,
        generation: obj.metadata.generation.unwrap_or(0),
        revision: obj.resource_version().unwrap_or_default(),
    }
}

/// Maps an API error of a request about own record `name`.
fn own_api_error<R: OwnRecord>(e: kube::Error, name: &str) -> StoreError {
    match &e {
        kube::Error::Api(s) if s.code == 404 => R::not_found(name),
        kube::Error::Api(s) if s.code == 409 && s.reason == "AlreadyExists" => R::exists(name),
        kube::Error::Api(s) if s.code == 409 => R::conflict(name),
        kube::Error::Api(s) if s.code == 422 || s.code == 400 => {
            StoreError::Invalid(format!("{} {name}: {}", R::WHAT, s.message))
        }
        _ => StoreError::Backend(format!("kubernetes API: {} {name}: {e}", R::WHAT)),
    }
}

impl OwnRecord for WarmPoolRecord {
    type Object = SandboxWarmPool;
    const WHAT: &'static str = "warm pool";
    const PLURAL: &'static str = "warm pools";
    fn name(&self) -> &str {
        &self.name
    }
    fn revision(&self) -> &str {
        &self.revision
    }
    fn to_object(
        &self,
        base: Option<&SandboxWarmPool>,
        namespace: &str,
    ) -> StoreResult<SandboxWarmPool> {
        warm_to_object(self, base, namespace)
    }
    fn from_object(obj: &SandboxWarmPool) -> Self {
        warm_from_object(obj)
    }
    fn exists(name: &str) -> StoreError {
        StoreError::WarmPoolExists(name.into())
    }
    fn not_found(name: &str) -> StoreError {
        StoreError::WarmPoolNotFound(name.into())
    }
    fn conflict(name: &str) -> StoreError {
        StoreError::WarmPoolConflict(name.into())
    }
}

impl OwnRecord for SnapshotRecord {
    type Object = SandboxSnapshot;
    const WHAT: &'static str = "snapshot";
    const PLURAL: &'static str = "snapshots";
    fn name(&self) -> &str {
        &self.id
    }
    fn revision(&self) -> &str {
        &self.revision
    }
    fn to_object(
        &self,
        base: Option<&SandboxSnapshot>,
        namespace: &str,
    ) -> StoreResult<SandboxSnapshot> {
        Ok(snapshot_to_object(self, base, namespace))
    }
    fn from_object(obj: &SandboxSnapshot) -> Self {
        snapshot_from_object(obj)
    }
    fn exists(name: &str) -> StoreError {
        StoreError::SnapshotExists(name.into())
    }
    fn not_found(name: &str) -> StoreError {
        StoreError::SnapshotNotFound(name.into())
    }
    fn conflict(name: &str) -> StoreError {
        StoreError::SnapshotConflict(name.into())
    }
}

/// A snapshot record's fields that its resource's spec has under the same
/// name, copied from `$from` into a `$shape` literal completed by `$rest`
/// (one list for both directions).
macro_rules! snapshot_fields {
    ($from:expr => $shape:ident { $($rest:tt)* }) => {
        $shape {
            uid: $from.uid.clone(),
            display_name: $from.display_name.clone(),
            request_id: $from.request_id.clone(),
            source_sandbox: $from.source_sandbox.clone(),
            source_uid: $from.source_uid.clone(),
            source_sandbox_id: $from.source_sandbox_id.clone(),
            message: $from.message.clone(),
            agent_id: $from.agent_id.clone(),
            node_name: $from.node_name.clone(),
            image: $from.image.clone(),
            runtime: $from.runtime.clone(),
            size_bytes: $from.size_bytes,
            paused_us: $from.paused_us,
            took_us: $from.took_us,
            metadata: $from.metadata.clone(),
            created_at_unix_ms: $from.created_at_unix_ms,
            completed_at_unix_ms: $from.completed_at_unix_ms,
            last_transition_unix_ms: $from.last_transition_unix_ms,
            $($rest)*
        }
    };
}

/// A snapshot volume in the other shape (same fields both ways).
macro_rules! snapshot_volume {
    ($v:expr => $shape:ident) => {
        $shape {
            volume: $v.volume.clone(),
            mount_path: $v.mount_path.clone(),
            sub_path: $v.sub_path.clone(),
            read_only: $v.read_only,
            volume_snapshot: $v.volume_snapshot.clone(),
        }
    };
}

/// The SandboxSnapshot for `snapshot`, on top of `base` (the stored object:
/// keeps its foreign labels and annotations; the replace carries
/// `snapshot.revision`).
fn snapshot_to_object(
    snapshot: &SnapshotRecord,
    base: Option<&SandboxSnapshot>,
    namespace: &str,
) -> SandboxSnapshot {
    let spec = snapshot_fields!(snapshot => SandboxSnapshotSpec {
        sandbox_namespace: snapshot.namespace.clone(),
        phase: match snapshot.phase {
            SnapshotPhase::Pending => CrSnapshotPhase::Pending,
            SnapshotPhase::Ready => CrSnapshotPhase::Ready,
            SnapshotPhase::Failed => CrSnapshotPhase::Failed,
            SnapshotPhase::Deleting => CrSnapshotPhase::Deleting,
        },
        volumes: snapshot
            .volumes
            .iter()
            .map(|v| snapshot_volume!(v => SnapshotVolume))
            .collect(),
    });
    match base {
        Some(base) => {
            let mut o = base.clone();
            o.spec = spec;
            o.metadata.resource_version = Some(snapshot.revision.clone());
            o
        }
        None => {
            let mut o = SandboxSnapshot::new(&snapshot.id, spec);
            o.metadata.namespace = Some(namespace.to_string());
            o
        }
    }
}

/// The snapshot record `obj` holds.
fn snapshot_from_object(obj: &SandboxSnapshot) -> SnapshotRecord {
    let spec = &obj.spec;
    snapshot_fields!(spec => SnapshotRecord {
        id: obj.name_any(),
        namespace: spec.sandbox_namespace.clone(),
        phase: match spec.phase {
            CrSnapshotPhase::Pending => SnapshotPhase::Pending,
            CrSnapshotPhase::Ready => SnapshotPhase::Ready,
            CrSnapshotPhase::Failed => SnapshotPhase::Failed,
            CrSnapshotPhase::Deleting => SnapshotPhase::Deleting,
        },
        volumes: spec
            .volumes
            .iter()
            .map(|v| snapshot_volume!(v => SnapshotVolumeRecord))
            .collect(),
        revision: obj.resource_version().unwrap_or_default(),
    })
}

/// Lease name of an agent record: a DNS-1123 subdomain, unique per agent id.
fn agent_lease_name(agent_id: &str) -> String {
    let mut clean: String = agent_id
        .to_ascii_lowercase()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    if clean != agent_id || clean.len() > 200 {
        // Lossy: keep it unique with a digest of the real id.
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        agent_id.hash(&mut h);
        clean.truncate(200);
        clean = format!(
            "{}-{:016x}",
            clean.trim_matches(|c| c == '-' || c == '.'),
            h.finish()
        );
    }
    format!("sandbolt-agent-{clean}")
}

impl Store for KubeStore {
    fn backend(&self) -> &'static str {
        "kubernetes"
    }

    fn template_catalog(&self) -> Option<&crate::template::TemplateCatalog> {
        Some(&self.templates)
    }

    fn put_warm_pool(&self, pool: &WarmPoolRecord) -> StoreResult<WarmPoolRecord> {
        self.put_own(&self.warm, pool)
    }

    fn list_warm_pools(&self) -> StoreResult<Vec<WarmPoolRecord>> {
        Ok(self.warm.list())
    }

    fn get_warm_pool(&self, name: &str) -> StoreResult<Option<WarmPoolRecord>> {
        Ok(self.warm.get(name))
    }

    fn delete_warm_pool(&self, name: &str) -> StoreResult<Option<WarmPoolRecord>> {
        self.delete_own(&self.warm, name)
    }

    fn put_snapshot(&self, snapshot: &SnapshotRecord) -> StoreResult<SnapshotRecord> {
        self.put_own(&self.snapshots, snapshot)
    }

    fn get_snapshot(&self, id: &str) -> StoreResult<Option<SnapshotRecord>> {
        Ok(self.snapshots.get(id))
    }

    fn list_snapshots(&self) -> StoreResult<Vec<SnapshotRecord>> {
        Ok(self.snapshots.list())
    }

    fn delete_snapshot(&self, id: &str) -> StoreResult<Option<SnapshotRecord>> {
        self.delete_own(&self.snapshots, id)
    }

    fn create(&self, record: &SandboxRecord) -> StoreResult<SandboxRecord> {
        self.create_locks
            .hold(&record.request_id, || self.create_unique(record))
    }

    fn get(&self, key: &SandboxKey) -> StoreResult<Option<SandboxRecord>> {
        match self.lookup(key) {
            Some(o) => from_object(&o),
            None => Ok(None),
        }
    }
    fn get_by_request_id(&self, request_id: &str) -> StoreResult<Option<SandboxRecord>> {
        // Request ids are arbitrary strings (no label value can hold them,
        // no field selector finds them): the index has them.
        let key = self.index.lock().by_request_id(request_id);
        self.confirmed(key, |r| r.request_id == request_id)
    }

    fn get_by_sandbox_id(&self, sandbox_id: &str) -> StoreResult<Option<SandboxRecord>> {
        let key = self.index.lock().by_sandbox_id(sandbox_id);
        self.confirmed(key, |r| r.sandbox_id == sandbox_id)
    }

    fn sandbox_owner(&self, sandbox_id: &str) -> StoreResult<Option<SandboxKey>> {
        Ok(self.index.lock().by_sandbox_id(sandbox_id))
    }

    fn list_filtered(
        &self,
        range: &ListRange<'_>,
        filter: &BTreeMap<String, String>,
    ) -> StoreResult<Vec<SandboxRecord>> {
        let (Some(ns), Some((k, v))) = (range.namespace, filter.iter().next()) else {
            let all = self.list(&range.limit(0))?;
            let matching = all.into_iter().filter(|r| metadata_matches(r, filter));
            return range.take(matching.map(Ok));
        };
        // Driven by the first pair's names; the other pairs are checked on
        // the records. Read in chunks: the lock is not held while records
        // decode.
        let want = if range.limit == 0 {
            usize::MAX
        } else {
            range.limit
        };
        let mut from = range.after.map(str::to_string);
        let mut out = Vec::new();
        while out.len() < want {
            let names = self
                .index
                .lock()
                .names_with(ns, (k, v), from.as_deref(), LIST_CHUNK);
            let Some(last) = names.last().cloned() else {
                break;
            };
            let keys = names.into_iter().map(|n| SandboxKey::new(ns, n));
            for r in self.records_of(keys) {
                let r = r?;
                if metadata_matches(&r, filter) && out.len() < want {
                    out.push(r);
                }
            }
            from = Some(last);
        }
        Ok(out)
    }

    fn replace(&self, record: &SandboxRecord) -> StoreResult<SandboxRecord> {
        let key = record.key();
        let Some(current) = self.lookup(&key) else {
            return Err(StoreError::NotFound(key));
        };
        if let Some(stored) = from_object(&current)?
            && stored.uid != record.uid
        {
            return Err(StoreError::Conflict(key));
        }
        let obj = to_object(record, Some(&current))?;
        let api = self.sandboxes_in(&record.namespace);
        let name = record.name.clone();
        let written = self
            .call("replace", async move {
                api.replace(&name, &PostParams::default(), &obj).await
            })?
            .map_err(|e| api_error(e, &key));
        let written = match written {
            Ok(w) => w,
            Err(StoreError::Conflict(key)) => {
                self.catch_up(&key);
                return Err(StoreError::Conflict(key));
            }
            Err(e) => return Err(e),
        };
        let newest = self.sync_status(record, written);
        let obj = self.remember(newest);
        from_object(&obj)?.ok_or_else(|| StoreError::Corrupt("written without state".into()))
    }

    fn delete(&self, key: &SandboxKey) -> StoreResult<Option<SandboxRecord>> {
        let api = self.sandboxes_in(&key.namespace);
        let n = key.name.clone();
        let current = match self.lookup(key) {
            Some(o) => o,
            None => match self.call("get", async move { api.get_opt(&n).await })? {
                Ok(Some(o)) => Arc::new(o),
                Ok(None) => return Ok(None),
                Err(e) => return Err(api_error(e, key)),
            },
        };
        let record = from_object(&current)?;
        let api = self.sandboxes_in(&key.namespace);
        let n = key.name.clone();
        let terminating = current.metadata.deletion_timestamp.is_some();
        let has_finalizer = current.finalizers().iter().any(|f| f == FINALIZER);
        let uid = current.metadata.uid.clone();
        let outcome = self.call("delete", async move {
            if !terminating {
                match api.delete(&n, &delete_of_uid(uid)).await {
                    Ok(_) => {}
                    Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
                    Err(e) => return Err(e),
                }
            }
            if has_finalizer {
                // The finalizer list as the server holds it now, minus ours;
                // guarded by resourceVersion so a concurrent change is not lost.
                loop {
                    let Some(o) = api.get_opt(&n).await? else {
                        return Ok(());
                    };
                    let rest: Vec<String> = o
                        .finalizers()
                        .iter()
                        .filter(|f| *f != FINALIZER)
                        .cloned()
                        .collect();
                    let patch = serde_json::json!({
                        "metadata": {
                            "finalizers": rest,
                            "resourceVersion": o.resource_version(),
                        }
                    });
                    match api
                        .patch(&n, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                    {
                        Ok(_) => return Ok(()),
                        Err(kube::Error::Api(s)) if s.code == 404 => return Ok(()),
                        Err(kube::Error::Api(s)) if s.code == 409 => continue,
                        Err(e) => return Err(e),
                    }
                }
            }
            Ok(())
        })?;
        outcome.map_err(|e| api_error(e, key))?;
        self.forget(&current);
        Ok(record)
    }

    fn delete_expired(&self, key: &SandboxKey) -> StoreResult<Option<SandboxRecord>> {
        let Some(current) = self.lookup(key) else {
            return self.delete(key);
        };
        let Some(record) = from_object(&current)? else {
            return self.delete(key);
        };
        let api = self.sandboxes_in(&key.namespace);
        let burial = tombstone::bury(
            api,
            key.name.clone(),
            current.metadata.uid.clone(),
            Timestamp::now(),
        );
        match self
            .call("tombstone", burial)?
            .map_err(|e| api_error(e, key))?
        {
            tombstone::Burial::Tombstone(obj) => {
                self.remember(*obj);
                Ok(Some(record))
            }
            tombstone::Burial::Gone => {
                self.forget(&current);
                Ok(Some(record))
            }
            tombstone::Burial::Terminating => self.delete(key),
        }
    }

    fn delete_tombstone(&self, key: &SandboxKey) -> StoreResult<bool> {
        // Live: called once a delete found no record, the cache may lag
        // behind the tombstone the caller read.
        let api = self.sandboxes_in(&key.namespace);
        let name = key.name.clone();
        let found = self
            .call("get", async move { api.get_opt(&name).await })?
            .map_err(|e| api_error(e, key))?;
        match found {
            Some(obj) if tombstone::is_tombstone(&obj) => {
                self.remove_tombstone(&obj)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn list(&self, range: &ListRange<'_>) -> StoreResult<Vec<SandboxRecord>> {
        if range.limit == 0 {
            return self.list_everything(range);
        }
        // A page: keys from the index (only objects holding a record:
        // tombstones and Sandboxes sandbolt did not write are not in it),
        // records by key. Read in chunks, so a page decodes only its own
        // records and the index's lock is not held while they decode.
        let want = range.limit;
        let mut from: Option<SandboxKey> = None;
        let mut out = Vec::new();
        while out.len() < want {
            let chunk = (want - out.len()).min(LIST_CHUNK);
            let keys = self.index.lock().keys(range, from.as_ref(), chunk);
            let Some(last) = keys.last().cloned() else {
                break;
            };
            for r in self.records_of(keys) {
                out.push(r?);
            }
            from = Some(last);
        }
        Ok(out)
    }

    fn put_agent(&self, agent: &AgentRecord) -> StoreResult<()> {
        let name = agent_lease_name(&agent.agent_id);
        let now = MicroTime(Timestamp::now());
        let lease = Lease {
            metadata: kube::api::ObjectMeta {
                name: Some(name.clone()),
                labels: Some(BTreeMap::from([(
                    AGENT_RECORD_LABEL.to_string(),
                    "true".to_string(),
                )])),
                annotations: Some(BTreeMap::from([(
                    AGENT_ANNOTATION.to_string(),
                    serde_json::to_string(agent).map_err(|e| StoreError::Corrupt(e.to_string()))?,
                )])),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(agent.agent_id.to_string()),
                renew_time: Some(now),
                ..Default::default()
            }),
        };
        let api = self.agents.clone();
        let id = agent.agent_id.clone();
        self.call("agent record", async move {
            // Last writer wins: an agent record is replaced, never merged
            // (no resourceVersion on the replace).
            match api.get_opt(&name).await? {
                None => match api.create(&PostParams::default(), &lease).await {
                    Ok(_) => Ok(()),
                    // Created meanwhile (a previous attempt that timed out).
                    Err(kube::Error::Api(s)) if s.code == 409 => api
                        .replace(&name, &PostParams::default(), &lease)
                        .await
                        .map(|_| ()),
                    Err(e) => Err(e),
                },
                Some(_) => api
                    .replace(&name, &PostParams::default(), &lease)
                    .await
                    .map(|_| ()),
            }
        })?
        .map_err(|e| StoreError::Backend(format!("agent record {id}: {e}")))
    }

    fn list_agents(&self) -> StoreResult<Vec<AgentRecord>> {
        let api = self.agents.clone();
        let leases = self
            .call("list agent records", async move {
                api.list(&ListParams::default().labels(&format!("{AGENT_RECORD_LABEL}=true")))
                    .await
            })?
            .map_err(|e| StoreError::Backend(format!("agent records: {e}")))?;
        leases
            .items
            .iter()
            .filter_map(|l| l.annotations().get(AGENT_ANNOTATION))
            .map(|raw| {
                serde_json::from_str(raw)
                    .map_err(|e| StoreError::Corrupt(format!("agent record: {e}")))
            })
            .collect()
    }

    fn publish_observed_exits(&self, observer: ExitObserver) {
        *self.exits.lock() = Some(observer.clone());
        let publisher = status::StatusPublisher {
            client: self.sandboxes.clone().into_client(),
            cache: self.cache.clone(),
            overlay: self.overlay.clone(),
            observer,
            write_timeout: self.write_timeout,
            tombstone_retention: self.expired_sandbox_retention,
        };
        let rt = self
            .runtime
            .as_ref()
            .expect("runtime lives as long as the store");
        let task = rt.spawn(publisher.run(self.status_period));
        if let Some(previous) = self.publisher.lock().replace(task) {
            previous.abort();
        }
    }

    fn deletions_requested(&self) -> Vec<SandboxKey> {
        // Candidates from the index, confirmed on the objects.
        let candidates = self.index.lock().terminating();
        candidates
            .into_iter()
            .filter(|k| {
                self.lookup(k).is_some_and(|o| {
                    o.metadata.deletion_timestamp.is_some()
                        && o.finalizers().iter().any(|f| f == FINALIZER)
                        && o.annotations().contains_key(STATE_ANNOTATION)
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_lease_names_are_valid_and_distinct() {
        assert_eq!(agent_lease_name("node-1"), "sandbolt-agent-node-1");
        let a = agent_lease_name("Node_1");
        let b = agent_lease_name("node_1");
        assert_ne!(a, b);
        for n in [&a, &b] {
            assert!(
                n.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.'),
                "{n}"
            );
        }
    }

    #[test]
    fn warm_pool_survives_the_object_round_trip() {
        let pool = WarmPoolRecord {
            name: "py".into(),
            agent_pool: "gpu".into(),
            image: "docker.io/library/python:3.12".into(),
            runtime: "runsc".into(),
            limits: Resources {
                cpu_limit: "1500m".into(),
                memory_limit: "1Gi".into(),
                pids_limit: 32,
                ..Resources::default()
            },
            env: BTreeMap::from([("K".to_string(), "V".to_string())]),
            buffer_min: 1,
            buffer_max: 2,
            pool_min: 3,
            pool_max: 4,
            created_at_unix_ms: 1_700_000_000_001,
            generation: 5,
            revision: String::new(),
        };
        let mut obj = warm_to_object(&pool, None, "ctl").unwrap();
        assert_eq!(obj.metadata.namespace.as_deref(), Some("ctl"));
        assert!(obj.metadata.resource_version.is_none(), "a create");
        obj.metadata.resource_version = Some("7".into());
        obj.metadata.generation = Some(5);
        let back = warm_from_object(&obj);
        assert_eq!(back.revision, "7");
        assert_eq!(
            back,
            WarmPoolRecord {
                revision: "7".into(),
                ..pool.clone()
            }
        );

        // A replace carries the caller's revision on the stored object.
        let mut base = obj.clone();
        base.metadata.labels = Some(BTreeMap::from([("team".into(), "ml".into())]));
        let mut next = back.clone();
        next.revision = "9".into();
        let replaced = warm_to_object(&next, Some(&base), "ctl").unwrap();
        assert_eq!(replaced.metadata.resource_version.as_deref(), Some("9"));
        assert_eq!(replaced.labels()["team"], "ml");

        // Unset fields stay unset; an unset agent pool reads as "default".
        let bare = WarmPoolRecord {
            name: "bare".into(),
            image: "busybox".into(),
            ..WarmPoolRecord::default()
        };
        let obj = warm_to_object(&bare, None, "ctl").unwrap();
        assert!(obj.spec.agent_pool.is_none() && obj.spec.template.limits.is_none());
        assert!(obj.annotations().get(WARM_CREATED_ANNOTATION).is_none());
        let back = warm_from_object(&obj);
        assert_eq!(
            (back.agent_pool.as_str(), back.runtime.as_str()),
            ("default", "")
        );
        assert!(back.limits.is_empty());
    }

    #[test]
    fn snapshot_survives_the_object_round_trip() {
        let full = SnapshotRecord {
            id: "5e0c".into(),
            namespace: "team-a".into(),
            uid: "u".into(),
            display_name: "d".into(),
            request_id: "r".into(),
            source_sandbox: "fsb-1".into(),
            source_uid: "su".into(),
            source_sandbox_id: "sid".into(),
            phase: SnapshotPhase::Deleting,
            message: "m".into(),
            agent_id: "a".into(),
            node_name: "n".into(),
            image: "i".into(),
            runtime: "crun".into(),
            size_bytes: 1,
            paused_us: 2,
            took_us: 3,
            volumes: vec![SnapshotVolumeRecord {
                volume: "v".into(),
                mount_path: "/v".into(),
                sub_path: "s".into(),
                read_only: true,
                volume_snapshot: "sbs-5e0c".into(),
            }],
            metadata: BTreeMap::from([("k".to_string(), "v".to_string())]),
            created_at_unix_ms: 4,
            completed_at_unix_ms: 5,
            last_transition_unix_ms: 6,
            revision: String::new(),
        };
        let mut obj = snapshot_to_object(&full, None, "ctl");
        assert_eq!(obj.metadata.namespace.as_deref(), Some("ctl"));
        assert_eq!(obj.name_any(), "5e0c");
        assert!(obj.metadata.resource_version.is_none(), "a create");
        obj.metadata.resource_version = Some("7".into());
        assert_eq!(
            snapshot_from_object(&obj),
            SnapshotRecord {
                revision: "7".into(),
                ..full.clone()
            }
        );
        // Through JSON, as the API server stores it.
        let json: SandboxSnapshot =
            serde_json::from_value(serde_json::to_value(&obj).unwrap()).unwrap();
        assert_eq!(snapshot_from_object(&json), snapshot_from_object(&obj));

        // A replace carries the caller's revision on the stored object.
        let mut base = obj.clone();
        base.metadata.labels = Some(BTreeMap::from([("team".into(), "ml".into())]));
        let next = SnapshotRecord {
            phase: SnapshotPhase::Ready,
            revision: "9".into(),
            ..full.clone()
        };
        let replaced = snapshot_to_object(&next, Some(&base), "ctl");
        assert_eq!(replaced.metadata.resource_version.as_deref(), Some("9"));
        assert_eq!(replaced.labels()["team"], "ml");
        assert_eq!(replaced.spec.phase, CrSnapshotPhase::Ready);

        // Unset fields stay unset.
        let bare = SnapshotRecord {
            id: "b".into(),
            namespace: "ns".into(),
            source_sandbox: "fsb-2".into(),
            ..SnapshotRecord::default()
        };
        let v = serde_json::to_value(snapshot_to_object(&bare, None, "ctl")).unwrap();
        assert_eq!(
            v["spec"],
            serde_json::json!({"sandboxNamespace": "ns", "sourceSandbox": "fsb-2", "phase": "Pending"})
        );
    }

    #[test]
    fn record_survives_the_object_round_trip() {
        let mut r = crate::store::tests_support::record("default", "fsb-2", "");
        r.spec.metadata.insert("team".into(), "a".into());
        r.spec.envs.insert("K".into(), "V".into());
        r.spec.expires_at = 1_900_000_000;
        r.spec.failure_policy = FailurePolicy::AutoRecreate;
        r.spec.recovery_timeout_seconds = 30;
        r.spec.exposed_ports = vec![8080];
        r.request_id = "req-1".into();
        r.spec.network_policy_json = NetworkPolicy::parse(
            r#"{"defaultAction":"DENY","egress":[{"action":"allow","target":"*.Example.com."},{"action":"deny","target":"203.0.113.0/24"}]}"#,
        )
        .unwrap()
        .to_json();
        r.network_policy_pending = true;
        r.network_policy_transition_unix_ms = 1_700_000_000_000;
        r.ip_address = "10.203.0.7".into();
        r.spec.warm_pool = "py".into();
        r.claimed_warm = true;
        r.spec.pvc_volumes = vec![PvcVolume {
            name: "data".into(),
            claim_name: "work".into(),
            mount_path: "/data".into(),
            create_if_missing: true,
            access_mode: crate::store::AccessMode::ReadOnlyMany,
            size: "1Gi".into(),
            delete_on_sandbox_delete: true,
            created_by_sandbox: true,
            ..Default::default()
        }];
        let mut obj = to_object(&r, None).unwrap();
        let policy = obj.spec.network_policy.clone().expect("structured policy");
        assert_eq!(policy.egress[0].target, "*.example.com");
        assert_eq!(policy.egress.len(), 2);
        // The same policy as the OpenSandbox server reads it.
        assert_eq!(
            obj.spec.action_bindings,
            [ActionBinding {
                handler: "egress".into(),
                input: r.spec.network_policy_json.clone(),
            }]
        );
        obj.metadata.resource_version = Some("7".into());
        obj.metadata.uid = Some("api-uid".into());
        obj.metadata.generation = Some(3);
        let mut back = from_object(&obj).unwrap().unwrap();
        assert_eq!(back.revision, "7");
        // The object's identity comes with it; the record's own stays.
        assert_eq!((back.api_uid.as_str(), back.api_generation), ("api-uid", 3));
        assert_eq!(
            (back.object_uid(), back.object_generation()),
            ("api-uid", 3)
        );
        assert_eq!((back.uid.as_str(), back.generation), ("uid-fsb-2", 1));
        back.revision = r.revision.clone();
        back.api_uid.clear();
        back.api_generation = 0;
        assert_eq!(back, r);
        assert_eq!(obj.labels()["metadata.sandbox.fast.io/team"], "a");
        assert_eq!(obj.finalizers(), [FINALIZER.to_string()]);
        // Never written into the object: the API server owns them.
        let mut r2 = r.clone();
        r2.api_uid = "stale".into();
        r2.api_generation = 9;
        let obj2 = to_object(&r2, None).unwrap();
        let raw = &obj2.annotations()[STATE_ANNOTATION];
        let state: serde_json::Map<String, serde_json::Value> = serde_json::from_str(raw).unwrap();
        assert!(
            !raw.contains("stale") && state.keys().all(|k| !k.starts_with("api")),
            "{raw}"
        );
    }

    #[test]
    fn the_policy_reads_back_from_either_field() {
        let r = crate::store::tests_support::record("default", "fsb-3", "");
        let json = NetworkPolicy::parse(
            r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"PyPI.org"}]}"#,
        )
        .unwrap()
        .to_json();
        let mut obj = to_object(&r, None).unwrap();
        let read = |obj: &Sandbox| from_object(obj).map(|r| r.unwrap().spec.network_policy_json);
        // Only the bindings, as the OpenSandbox server (or fast-sandbox)
        // writes them; the input is checked by the one parser.
        obj.spec.action_bindings = vec![ActionBinding {
            handler: "egress".into(),
            input: r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"PyPI.org"}]}"#
                .into(),
        }];
        assert_eq!(read(&obj).unwrap(), json);
        obj.spec.action_bindings[0].input = "{".into();
        let e = read(&obj).unwrap_err().to_string();
        assert!(e.contains("spec.actionBindings"), "{e}");
        // Neither: allow-all.
        obj.spec.action_bindings.clear();
        assert_eq!(read(&obj).unwrap(), "");
    }
}
