//! Named volumes in the agent: the node's [`VolumeStore`] behind the agent
//! API, and the mount table that enforces access modes.
//!
//! # The mount table
//!
//! volume → holders (sandbox, mount path, read-only). Every mount of a
//! volume into a sandbox (at create and at attach) is admitted against it:
//! ReadWriteOnce allows at most one read-write holder (read-only ones
//! besides), ReadOnlyMany only read-only holders (a read-write request is
//! refused, never silently made read-only), ReadWriteMany anything; and a
//! sandbox mounts a volume at most once. Restore and delete are refused
//! while a volume has holders.
//!
//! Each volume has a gate (an async mutex). Reserving holders, restoring
//! and deleting take the gates of the volumes concerned and keep them
//! across the check *and* the operation, so a create cannot slip a mount
//! in between "nobody mounts it" and the restore. Reads (get, list, the
//! inventory) never wait on a gate: a slow copy (directory backend) does
//! not hold up heartbeats.
//!
//! The table has no storage of its own: every sandbox's container carries
//! its mounts in the [`labels::VOLUME_MOUNTS`] label (written at create,
//! rewritten on attach and detach), and a (re)started agent rebuilds the
//! table from those labels before it serves ([`VolumeMounts::adopt`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use sandbolt_proto::agent::v1 as pb;
use serde::{Deserialize, Serialize};
use tokio::sync::OwnedMutexGuard;

use crate::error::{AgentError, Result};
use crate::juicefs_mount::{JuiceFsConfig, JuiceFsMount};
use crate::labels;
use crate::volume_store::{
    AccessMode, Capabilities, NewVolume, Volume, VolumeStore, VolumeStoreConfig, VolumeStoreError,
};
use crate::volumes::{self, HeldMount};

/// containerd refuses a label whose key and value together are longer.
pub(crate) const MAX_LABEL_BYTES: usize = 4096;

/// One sandbox's mount of a volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    pub sandbox_id: String,
    pub mount_path: String,
    pub read_only: bool,
}

impl From<&Holder> for pb::VolumeMountHolder {
    fn from(h: &Holder) -> Self {
        Self {
            sandbox_id: h.sandbox_id.clone(),
            mount_path: h.mount_path.clone(),
            read_only: h.read_only,
        }
    }
}

/// volume → its holders, in the order they mounted it.
#[derive(Debug, Default)]
struct Table(BTreeMap<String, Vec<Holder>>);

impl Table {
    fn holders(&self, volume: &str) -> &[Holder] {
        self.0.get(volume).map_or(&[], Vec::as_slice)
    }

    fn add(&mut self, volume: &str, holder: Holder) {
        self.0.entry(volume.to_string()).or_default().push(holder);
    }

    /// Removes `sandbox_id`'s holds (of `volume` only, when given); returns
    /// how many there were.
    fn remove(&mut self, sandbox_id: &str, volume: Option<&str>) -> usize {
        let mut removed = 0;
        self.0.retain(|name, holders| {
            if volume.is_none_or(|v| v == name) {
                let before = holders.len();
                holders.retain(|h| h.sandbox_id != sandbox_id);
                removed += before - holders.len();
            }
            !holders.is_empty()
        });
        removed
    }

    fn sandboxes(&self) -> BTreeSet<String> {
        self.0
            .values()
            .flatten()
            .map(|h| h.sandbox_id.clone())
            .collect()
    }
}

/// Whether `sandbox_id` may mount `volume` (of `mode`, held by `holders`)
/// now; the refusal says which rule and, for ReadWriteOnce, who holds it.
fn admit(
    volume: &str,
    mode: AccessMode,
    holders: &[Holder],
    sandbox_id: &str,
    read_only: bool,
) -> Result<()> {
    let refuse = |reason: String| {
        Err(AgentError::VolumeAccess {
            volume: volume.to_string(),
            reason,
        })
    };
    if let Some(h) = holders.iter().find(|h| h.sandbox_id == sandbox_id) {
        return refuse(format!(
            "sandbox {sandbox_id} already mounts it (at {}); a volume is mounted at most once per sandbox",
            h.mount_path
        ));
    }
    match mode {
        AccessMode::ReadOnlyMany if !read_only => refuse(format!(
            "its access mode is {mode}: only read-only mounts are allowed (ask for read_only)"
        )),
        AccessMode::ReadWriteOnce if !read_only => match holders.iter().find(|h| !h.read_only) {
            Some(h) => refuse(format!(
                "its access mode is {mode} and sandbox {} mounts it read-write (at {}); \
                     a second read-write mount is not allowed (read-only mounts are)",
                h.sandbox_id, h.mount_path
            )),
            None => Ok(()),
        },
        _ => Ok(()),
    }
}

/// Refuses `action` on a volume that sandboxes mount.
fn refuse_if_mounted(table: &Table, volume: &str, action: &'static str) -> Result<()> {
    let holders = table.holders(volume);
    if holders.is_empty() {
        return Ok(());
    }
    let by: Vec<String> = holders
        .iter()
        .map(|h| format!("{} at {}", h.sandbox_id, h.mount_path))
        .collect();
    Err(AgentError::VolumeInUse {
        volume: volume.to_string(),
        action,
        holders: by.join(", "),
    })
}

/// One mount as the [`labels::VOLUME_MOUNTS`] label stores it (and, with
/// its volume snapshot, a sandbox snapshot's [`labels::SNAPSHOT_VOLUMES`]).
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct LabelMount {
    volume: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    sub_path: String,
    mount_path: String,
    #[serde(default)]
    read_only: bool,
}

impl From<&pb::NamedVolumeMount> for LabelMount {
    fn from(m: &pb::NamedVolumeMount) -> Self {
        Self {
            volume: m.volume.clone(),
            sub_path: m.sub_path.clone(),
            mount_path: m.mount_path.clone(),
            read_only: m.read_only,
        }
    }
}

impl From<LabelMount> for pb::NamedVolumeMount {
    fn from(m: LabelMount) -> Self {
        Self {
            volume: m.volume,
            sub_path: m.sub_path,
            mount_path: m.mount_path,
            read_only: m.read_only,
        }
    }
}

/// The label value for a sandbox's mounts; refused when containerd would
/// refuse the label (too long).
pub fn to_label(mounts: &[pb::NamedVolumeMount]) -> Result<String> {
    let list: Vec<LabelMount> = mounts.iter().map(LabelMount::from).collect();
    let value = serde_json::to_string(&list).expect("strings and bools serialize");
    if value.len() + labels::VOLUME_MOUNTS.len() > MAX_LABEL_BYTES {
        return Err(AgentError::InvalidArgument(format!(
            "volume_mounts: {} mounts with these paths take {} bytes, more than the {MAX_LABEL_BYTES} \
             a container label holds (the agent keeps them there); mount fewer volumes or use shorter paths",
            mounts.len(),
            value.len()
        )));
    }
    Ok(value)
}

/// The mounts a label value names ("" and "[]": none).
pub fn from_label(value: &str) -> Result<Vec<pb::NamedVolumeMount>, serde_json::Error> {
    if value.trim().is_empty() {
        return Ok(Vec::new());
    }
    let list: Vec<LabelMount> = serde_json::from_str(value)?;
    Ok(list.into_iter().map(Into::into).collect())
}

/// The checks of a sandbox's named volume mounts that need neither the
/// store nor the table; `field` names the list in errors.
pub fn validate(mounts: &[pb::NamedVolumeMount], field: &str) -> Result<()> {
    let mut volumes = BTreeSet::new();
    let mut paths = BTreeSet::new();
    for (i, m) in mounts.iter().enumerate() {
        let at = format!("{field}[{i}]");
        validate_one(m, &at)?;
        if !volumes.insert(m.volume.as_str()) {
            return Err(AgentError::InvalidArgument(format!(
                "{at}.volume: volume {:?} is listed twice; a volume is mounted at most once per sandbox",
                m.volume
            )));
        }
        if !paths.insert(m.mount_path.as_str()) {
            return Err(AgentError::InvalidArgument(format!(
                "{at}.mount_path: {:?} is used by more than one mount",
                m.mount_path
            )));
        }
    }
    if !mounts.is_empty() {
        to_label(mounts)?;
    }
    Ok(())
}

/// The checks of one mount (`field` names it in errors). The volume name
/// and the sub path are checked again, by the kernel's rules, when the
/// store opens them.
pub fn validate_one(m: &pb::NamedVolumeMount, field: &str) -> Result<()> {
    let bad = |what: &str, msg: String| {
        Err(AgentError::InvalidArgument(format!(
            "{field}.{what}: {msg}"
        )))
    };
    if m.volume.is_empty() {
        return bad("volume", "is required".into());
    }
    if let Err(e) = volumes::check_mount_path(&m.mount_path) {
        return bad("mount_path", e.to_string());
    }
    if m.sub_path.starts_with('/') || m.sub_path.split('/').any(|c| c == "..") {
        return bad(
            "sub_path",
            format!(
                "{:?} must be relative, without \"..\" (it is below the volume's root)",
                m.sub_path
            ),
        );
    }
    Ok(())
}

/// A store error about `field`: a bad name or sub path is the request's
/// fault and says which entry; the rest keep their own code.
fn about(field: String) -> impl FnOnce(AgentError) -> AgentError {
    move |e| match e {
        AgentError::VolumeStore(s) if s.grpc_code() == tonic::Code::InvalidArgument => {
            AgentError::InvalidArgument(format!("{field}: {s}"))
        }
        e => e,
    }
}

/// The proto's size (0 = none, negative refused).
fn size_of(spec: &pb::VolumeSpec, field: &str) -> Result<Option<u64>> {
    match u64::try_from(spec.size_bytes) {
        Ok(0) => Ok(None),
        Ok(n) => Ok(Some(n)),
        Err(_) => Err(AgentError::InvalidArgument(format!(
            "{field}.size_bytes must not be negative (0 = no quota), got {}",
            spec.size_bytes
        ))),
    }
}

/// Which store holds a volume: the node's volume root or the cluster's
/// JuiceFS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Local,
    JuiceFs,
}

impl Backend {
    /// From a spec's `backend` ("" and "local": the volume root).
    pub fn parse(value: &str, field: &str) -> Result<Self> {
        match value {
            "" | "local" => Ok(Self::Local),
            "juicefs" => Ok(Self::JuiceFs),
            other => Err(AgentError::InvalidArgument(format!(
                "{field}.backend: unknown backend {other:?} (expected \"local\" (the default) or \"juicefs\")"
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::JuiceFs => "juicefs",
        }
    }
}

/// Where a call goes: a new volume's backend, or wherever an existing
/// volume is (the volume root first, then JuiceFS).
enum Target {
    New(Backend, String),
    Existing(String),
}

/// The stores a call may use, taken out of [`VolumeMounts`] so that the
/// choice (which touches the filesystems) runs off the async runtime.
#[derive(Clone)]
struct Stores {
    local: Option<Arc<VolumeStore>>,
    juicefs: Option<Arc<JuiceFsMount>>,
    node_name: String,
}

impl Stores {
    fn of(&self, backend: Backend) -> Result<Arc<VolumeStore>> {
        match backend {
            Backend::Local => self
                .local
                .clone()
                .ok_or_else(|| AgentError::VolumesUnavailable {
                    node: self.node_name.clone(),
                }),
            Backend::JuiceFs => match &self.juicefs {
                None => Err(AgentError::JuiceFsNotConfigured {
                    node: self.node_name.clone(),
                }),
                Some(m) => m.store(),
            },
        }
    }

    /// The store for `target`. A new volume's name must be free in the
    /// other store too (a sandbox names the volumes it mounts by name
    /// only); JuiceFS is only asked when it is available.
    fn pick(&self, target: &Target) -> Result<(Backend, Arc<VolumeStore>)> {
        match target {
            Target::New(backend, name) => {
                let store = self.of(*backend)?;
                let other = match backend {
                    Backend::Local => Backend::JuiceFs,
                    Backend::JuiceFs => Backend::Local,
                };
                if let Ok(o) = self.of(other)
                    && o.contains(name)
                {
                    return Err(AgentError::VolumeStore(VolumeStoreError::AlreadyExists {
                        volume: name.clone(),
                        snapshot: None,
                    }));
                }
                Ok((*backend, store))
            }
            Target::Existing(name) => {
                if let Some(local) = &self.local
                    && (self.juicefs.is_none() || local.contains(name))
                {
                    return Ok((Backend::Local, local.clone()));
                }
                match &self.juicefs {
                    Some(m) => Ok((Backend::JuiceFs, m.store()?)),
                    None => self.of(Backend::Local).map(|s| (Backend::Local, s)),
                }
            }
        }
    }
}

fn new_volume(spec: &pb::VolumeSpec, field: &str) -> Result<NewVolume> {
    let access_mode = AccessMode::from_proto(spec.access_mode)
        .map_err(|e| AgentError::InvalidArgument(format!("{field}.access_mode: {e}")))?;
    Ok(NewVolume {
        name: spec.name.clone(),
        access_mode,
        size_bytes: size_of(spec, field)?,
    })
}

/// Held gates of some volumes (see the module docs). Dropping them opens
/// the gates and forgets those nobody else holds or waits for, so the map
/// only keeps volumes in use.
struct Gates<'a> {
    owner: &'a VolumeMounts,
    names: Vec<String>,
    guards: Vec<OwnedMutexGuard<()>>,
}

impl Drop for Gates<'_> {
    fn drop(&mut self) {
        self.guards.clear();
        let mut map = self.owner.gates.lock();
        for name in &self.names {
            // Only the map's reference left: nobody holds or awaits it.
            if map.get(name).is_some_and(|g| Arc::strong_count(g) == 1) {
                map.remove(name);
            }
        }
    }
}

/// Whether `root` is a mount of the loop device backed by `image` (what
/// the store makes when the root is not on btrfs).
fn mounted_from_image(root: &std::path::Path, image: &std::path::Path) -> bool {
    let Ok(image) = std::fs::canonicalize(image) else {
        return false;
    };
    // mountinfo octal-escapes space, tab, newline and backslash.
    let point = root
        .to_string_lossy()
        .replace('\\', "\\134")
        .replace(' ', "\\040")
        .replace('\t', "\\011")
        .replace('\n', "\\012");
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    table
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some(point.as_str()))
        .filter_map(|l| l.split(" - ").nth(1)?.split(' ').nth(1))
        .filter_map(|source| source.strip_prefix("/dev/"))
        .any(|dev| {
            std::fs::read_to_string(format!("/sys/block/{dev}/loop/backing_file"))
                .is_ok_and(|b| std::path::Path::new(b.trim()) == image)
        })
}

/// The node's named volumes and who mounts them.
pub struct VolumeMounts {
    /// None: this agent has no volume root (or it was shut down).
    store: RwLock<Option<Arc<VolumeStore>>>,
    /// Fixed once the store is open (reported even after a shutdown).
    capabilities: Option<Capabilities>,
    /// How the store was opened (its root and loop image).
    config: Option<VolumeStoreConfig>,
    agent_id: String,
    node_name: String,
    table: Mutex<Table>,
    /// Per-volume gates, see the module docs.
    gates: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The cluster's JuiceFS, when configured (see [`Self::with_juicefs`]).
    juicefs: Option<Arc<JuiceFsMount>>,
}

impl VolumeMounts {
    /// Opens the volume store (when configured): sets the root up (a loop
    /// image is made or mounted) and recovers interrupted operations.
    pub async fn open(
        config: Option<&VolumeStoreConfig>,
        agent_id: &str,
        node_name: &str,
    ) -> Result<Self> {
        let store = match config {
            None => None,
            Some(cfg) => {
                let cfg = cfg.clone();
                let store = tokio::task::spawn_blocking(move || VolumeStore::open(&cfg))
                    .await
                    .map_err(|e| AgentError::io("opening the volume store")(e.into()))?
                    .map_err(AgentError::VolumeStore)?;
                Some(store)
            }
        };
        let mut this = Self::new(store, agent_id, node_name);
        this.config = config.cloned();
        Ok(this)
    }

    pub fn new(store: Option<VolumeStore>, agent_id: &str, node_name: &str) -> Self {
        Self {
            capabilities: store.as_ref().map(VolumeStore::capabilities),
            config: None,
            store: RwLock::new(store.map(Arc::new)),
            agent_id: agent_id.to_string(),
            node_name: node_name.to_string(),
            table: Mutex::new(Table::default()),
            gates: Mutex::new(HashMap::new()),
            juicefs: None,
        }
    }

    /// Mounts the cluster's JuiceFS (when configured) and serves its
    /// volumes beside the node's. A metadata engine that is down does not
    /// fail this: the mount is reported down until it answers.
    pub async fn with_juicefs(mut self, cfg: Option<&JuiceFsConfig>) -> Result<Self> {
        if let Some(cfg) = cfg {
            let mount = JuiceFsMount::start(cfg.clone(), &self.agent_id, &self.node_name).await?;
            self.juicefs = Some(mount);
        }
        Ok(self)
    }

    /// The JuiceFS mount, when configured.
    pub fn juicefs(&self) -> Option<&Arc<JuiceFsMount>> {
        self.juicefs.as_ref()
    }

    /// The JuiceFS mount's state for the inventory (None: not configured).
    pub fn juicefs_status(&self) -> Option<pb::JuiceFsStatus> {
        self.juicefs.as_ref().map(|m| m.status())
    }

    /// Unmounts JuiceFS (at agent stop; sandboxes' mounts of its volumes
    /// stop working with it).
    pub async fn stop_juicefs(&self) {
        if let Some(m) = self.juicefs.clone() {
            let _ = tokio::task::spawn_blocking(move || m.stop()).await;
        }
    }

    /// Lets go of the store (and its lock on the volume root), so that
    /// another agent (a restart in the same process) can open it. Calls in
    /// flight finish; later ones answer UNAVAILABLE.
    pub fn close(&self) {
        self.store.write().take();
    }

    /// After [`Self::close`]: unmounts the volume root when it is this
    /// agent's loop image and no sandbox mounts a volume, so that a stopped
    /// agent (`sandbolt up` above all) leaves no mount and no loop device
    /// behind. While sandboxes mount volumes it stays: they keep using it,
    /// and the next agent finds it in place.
    pub async fn unmount_unused_root(&self) {
        let Some(cfg) = self.config.clone() else {
            return;
        };
        let holding = self.table.lock().sandboxes();
        if !holding.is_empty() {
            tracing::info!(root = %cfg.root.display(), sandboxes = holding.len(), "volume root stays mounted: sandboxes mount its volumes");
            return;
        }
        let unmounted = tokio::task::spawn_blocking(move || {
            if !mounted_from_image(&cfg.root, &cfg.loop_image) {
                return Ok(false);
            }
            crate::volume_store::unmount_root(&cfg.root)
        })
        .await;
        match unmounted {
            Ok(Ok(true)) => tracing::info!("volume root unmounted (no sandbox mounts a volume)"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "unmounting the volume root failed"),
            Err(e) => tracing::warn!(error = %e, "unmounting the volume root failed"),
        }
    }

    pub fn capabilities(&self) -> Option<pb::VolumeCapabilities> {
        self.capabilities.map(Into::into)
    }

    /// Whether this agent serves named volumes at all (a volume root or
    /// JuiceFS).
    pub fn enabled(&self) -> bool {
        self.store.read().is_some() || self.juicefs.is_some()
    }

    fn stores(&self) -> Stores {
        Stores {
            local: self.store.read().clone(),
            juicefs: self.juicefs.clone(),
            node_name: self.node_name.clone(),
        }
    }

    fn store(&self) -> Result<Arc<VolumeStore>> {
        self.store
            .read()
            .clone()
            .ok_or_else(|| AgentError::VolumesUnavailable {
                node: self.node_name.clone(),
            })
    }

    /// Runs a (blocking) store call off the async runtime.
    async fn call<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&VolumeStore) -> Result<T, VolumeStoreError> + Send + 'static,
    {
        let store = self.store()?;
        tokio::task::spawn_blocking(move || f(&store))
            .await
            .map_err(|e| AgentError::io("volume store call")(e.into()))?
            .map_err(AgentError::VolumeStore)
    }

    /// Runs a (blocking) store call on the store `target` picks, off the
    /// async runtime; says which backend it was.
    async fn call_on<T, F>(&self, target: Target, f: F) -> Result<(Backend, T)>
    where
        T: Send + 'static,
        F: FnOnce(&VolumeStore) -> Result<T, VolumeStoreError> + Send + 'static,
    {
        let stores = self.stores();
        tokio::task::spawn_blocking(move || {
            let (backend, store) = stores.pick(&target)?;
            f(&store)
                .map(|t| (backend, t))
                .map_err(AgentError::VolumeStore)
        })
        .await
        .map_err(|e| AgentError::io("volume store call")(e.into()))?
    }

    /// Takes the gates of `volumes` (sorted, so two callers never wait on
    /// each other in a circle); they open again when the result is dropped.
    async fn gates<'a>(&'a self, volumes: impl IntoIterator<Item = &'a str>) -> Gates<'a> {
        let names: BTreeSet<&str> = volumes.into_iter().collect();
        let gates: Vec<_> = {
            let mut map = self.gates.lock();
            names
                .iter()
                .map(|n| map.entry(n.to_string()).or_default().clone())
                .collect()
        };
        // Built first: when this future is dropped while it waits, the
        // gates it took (and the map entries it made) are given back.
        let mut held = Gates {
            owner: self,
            names: names.into_iter().map(str::to_string).collect(),
            guards: Vec::with_capacity(gates.len()),
        };
        for g in gates {
            held.guards.push(g.lock_owned().await);
        }
        held
    }

    fn info(&self, (backend, v): (Backend, Volume)) -> pb::VolumeInfo {
        let mounts = self
            .table
            .lock()
            .holders(&v.name)
            .iter()
            .map(Into::into)
            .collect();
        let capabilities = match backend {
            Backend::Local => self.capabilities(),
            Backend::JuiceFs => Some(JuiceFsMount::capabilities().into()),
        };
        pb::VolumeInfo {
            spec: Some(pb::VolumeSpec {
                backend: backend.as_str().into(),
                ..v.spec()
            }),
            agent_id: self.agent_id.clone(),
            node_name: self.node_name.clone(),
            created_at_unix_ms: v.created_at_ms,
            used_bytes: v
                .used_bytes
                .map_or(-1, |b| i64::try_from(b).unwrap_or(i64::MAX)),
            capabilities,
            snapshots: v.snapshots.iter().map(Into::into).collect(),
            mounts,
            forked_from: v.forked_from.unwrap_or_default(),
        }
    }

    pub async fn create(&self, spec: Option<pb::VolumeSpec>) -> Result<pb::VolumeInfo> {
        let spec = spec.ok_or_else(|| AgentError::InvalidArgument("spec is required".into()))?;
        let new = new_volume(&spec, "spec")?;
        let backend = Backend::parse(&spec.backend, "spec")?;
        let target = Target::New(backend, new.name.clone());
        let v = self.call_on(target, move |s| s.create(&new)).await?;
        tracing::info!(volume = %v.1.name, backend = backend.as_str(), access_mode = %v.1.access_mode, size_bytes = v.1.size_bytes, "volume created");
        Ok(self.info(v))
    }

    pub async fn get(&self, name: &str) -> Result<pb::VolumeInfo> {
        let name = name.to_string();
        let v = self
            .call_on(Target::Existing(name.clone()), move |s| s.get(&name))
            .await?;
        Ok(self.info(v))
    }

    /// Every volume of the volume root, then every volume on JuiceFS.
    pub async fn list(&self) -> Result<Vec<pb::VolumeInfo>> {
        let mut out = self.list_local().await?;
        if self.juicefs.is_some() {
            let target = Target::New(Backend::JuiceFs, String::new());
            let (b, vols) = self.call_on(target, VolumeStore::list).await?;
            out.extend(vols.into_iter().map(|v| self.info((b, v))));
        }
        Ok(out)
    }

    /// Every volume of the node's volume root (none without one): what is
    /// this agent's alone (JuiceFS volumes are every agent's).
    pub async fn list_local(&self) -> Result<Vec<pb::VolumeInfo>> {
        if self.store.read().is_none() {
            return Ok(Vec::new());
        }
        let vols = self.call(VolumeStore::list).await?;
        Ok(vols
            .into_iter()
            .map(|v| self.info((Backend::Local, v)))
            .collect())
    }

    /// Every volume for the inventory; a failure is logged (it must not
    /// stop the heartbeat), and JuiceFS failing leaves the node's own.
    pub async fn inventory(&self) -> Vec<pb::VolumeInfo> {
        let mut out = self.list_local().await.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "listing volumes for the inventory failed");
            Vec::new()
        });
        if self.juicefs.as_ref().is_some_and(|m| m.mounted()) {
            let target = Target::New(Backend::JuiceFs, String::new());
            match self.call_on(target, VolumeStore::list).await {
                Ok((b, vols)) => out.extend(vols.into_iter().map(|v| self.info((b, v)))),
                Err(e) => {
                    tracing::warn!(error = %e, "listing JuiceFS volumes for the inventory failed")
                }
            }
        }
        out
    }

    /// Deletes a volume and its snapshots; refused while mounted.
    pub async fn delete(&self, name: &str) -> Result<bool> {
        let _gate = self.gates([name]).await;
        refuse_if_mounted(&self.table.lock(), name, "delete")?;
        let owned = name.to_string();
        let (_, existed) = self
            .call_on(Target::Existing(owned.clone()), move |s| s.delete(&owned))
            .await?;
        if existed {
            tracing::info!(volume = %name, "volume deleted");
        }
        Ok(existed)
    }

    pub async fn snapshot(&self, volume: &str, name: &str) -> Result<pb::VolumeSnapshot> {
        let (volume, name) = (volume.to_string(), name.to_string());
        let (_, snap) = self
            .call_on(Target::Existing(volume.clone()), move |s| {
                s.snapshot(&volume, &name)
            })
            .await?;
        tracing::info!(volume = %snap.volume, snapshot = %snap.name, "volume snapshot created");
        Ok((&snap).into())
    }

    pub async fn delete_snapshot(&self, volume: &str, name: &str) -> Result<bool> {
        let (volume, name) = (volume.to_string(), name.to_string());
        let target = Target::Existing(volume.clone());
        let (_, existed) = self
            .call_on(target, move |s| s.delete_snapshot(&volume, &name))
            .await?;
        Ok(existed)
    }

    /// Replaces the volume's data with a snapshot's; refused while mounted.
    pub async fn restore(&self, volume: &str, snapshot: &str) -> Result<pb::VolumeInfo> {
        let _gate = self.gates([volume]).await;
        refuse_if_mounted(&self.table.lock(), volume, "restore")?;
        let (v, s) = (volume.to_string(), snapshot.to_string());
        let restored = self
            .call_on(Target::Existing(v.clone()), move |st| st.restore(&v, &s))
            .await?;
        tracing::info!(volume, snapshot, "volume restored");
        Ok(self.info(restored))
    }

    /// A new volume from `source` (or its snapshot); the new volume's
    /// access mode and size default to the source's.
    pub async fn fork(
        &self,
        source: &str,
        snapshot: &str,
        spec: Option<pb::VolumeSpec>,
    ) -> Result<pb::VolumeInfo> {
        let spec = spec.ok_or_else(|| {
            AgentError::InvalidArgument("spec is required (at least the new volume's name)".into())
        })?;
        let new = new_volume(&spec, "spec")?;
        let asked = (!spec.backend.is_empty())
            .then(|| Backend::parse(&spec.backend, "spec"))
            .transpose()?;
        let source = source.to_string();
        let snapshot = (!snapshot.is_empty()).then(|| snapshot.to_string());
        let stores = self.stores();
        let v = tokio::task::spawn_blocking(move || {
            let (backend, _) = stores.pick(&Target::Existing(source.clone()))?;
            if asked.is_some_and(|a| a != backend) {
                return Err(AgentError::InvalidArgument(format!(
                    "spec.backend: a fork stays on its source's backend ({}); omit backend or ask for {0:?}",
                    backend.as_str()
                )));
            }
            let (backend, store) = stores.pick(&Target::New(backend, new.name.clone()))?;
            store
                .fork(&source, snapshot.as_deref(), &new)
                .map(|v| (backend, v))
                .map_err(AgentError::VolumeStore)
        })
        .await
        .map_err(|e| AgentError::io("volume store call")(e.into()))??;
        tracing::info!(volume = %v.1.name, backend = v.0.as_str(), forked_from = v.1.forked_from.as_deref().unwrap_or(""), "volume forked");
        Ok(self.info(v))
    }

    /// Makes `sandbox_id` a holder of every volume of `mounts`, all or none,
    /// after checking each access mode against the holders there are.
    /// `field` names the list in errors.
    pub async fn reserve(
        &self,
        sandbox_id: &str,
        mounts: &[pb::NamedVolumeMount],
        field: &str,
    ) -> Result<()> {
        if mounts.is_empty() {
            return Ok(());
        }
        let _gates = self.gates(mounts.iter().map(|m| m.volume.as_str())).await;
        let names: Vec<String> = mounts.iter().map(|m| m.volume.clone()).collect();
        let stores = self.stores();
        let modes = tokio::task::spawn_blocking(move || {
            names
                .iter()
                .map(|n| {
                    let (_, store) = stores.pick(&Target::Existing(n.clone()))?;
                    Ok(store.get(n).map(|v| v.access_mode))
                })
                .collect::<Result<Vec<_>>>()
        })
        .await
        .map_err(|e| AgentError::io("volume store call")(e.into()))??;
        let mut table = self.table.lock();
        for (i, (m, mode)) in mounts.iter().zip(modes).enumerate() {
            let field = format!("{field}[{i}]");
            let mode = mode.map_err(|e| about(field)(AgentError::VolumeStore(e)))?;
            admit(
                &m.volume,
                mode,
                table.holders(&m.volume),
                sandbox_id,
                m.read_only,
            )?;
        }
        for m in mounts {
            table.add(
                &m.volume,
                Holder {
                    sandbox_id: sandbox_id.to_string(),
                    mount_path: m.mount_path.clone(),
                    read_only: m.read_only,
                },
            );
        }
        Ok(())
    }

    /// Records mounts that exist already (a recovered sandbox's label),
    /// without checks: they were admitted when they were made.
    pub fn adopt(&self, sandbox_id: &str, mounts: &[pb::NamedVolumeMount]) {
        let mut table = self.table.lock();
        table.remove(sandbox_id, None);
        for m in mounts {
            table.add(
                &m.volume,
                Holder {
                    sandbox_id: sandbox_id.to_string(),
                    mount_path: m.mount_path.clone(),
                    read_only: m.read_only,
                },
            );
        }
    }

    /// Drops `sandbox_id`'s holds (of one volume, or all); returns how many
    /// there were.
    pub fn release(&self, sandbox_id: &str, volume: Option<&str>) -> usize {
        let n = self.table.lock().remove(sandbox_id, volume);
        if n > 0 {
            tracing::debug!(sandbox = %sandbox_id, volume = volume.unwrap_or("*"), n, "volume holds released");
        }
        n
    }

    /// Sandboxes holding any volume.
    pub fn holding_sandboxes(&self) -> BTreeSet<String> {
        self.table.lock().sandboxes()
    }

    /// Holders of `volume` now.
    pub fn holders(&self, volume: &str) -> Vec<Holder> {
        self.table.lock().holders(volume).to_vec()
    }

    /// Opens the mount's directory beneath the volume's data (sub path
    /// created when missing) and holds it for mounting.
    pub async fn open_mount(&self, m: &pb::NamedVolumeMount, field: &str) -> Result<HeldMount> {
        let (volume, sub_path) = (m.volume.clone(), m.sub_path.clone());
        let (_, fd) = self
            .call_on(Target::Existing(volume.clone()), move |s| {
                s.open_data(&volume, &sub_path)
            })
            .await
            .map_err(about(field.to_string()))?;
        volumes::held_from_fd(fd, &m.mount_path, m.read_only)
            .map_err(|e| AgentError::Volume(format!("{field}: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(id: &str, ro: bool) -> Holder {
        Holder {
            sandbox_id: id.into(),
            mount_path: format!("/mnt/{id}"),
            read_only: ro,
        }
    }

    fn mount(volume: &str, path: &str, ro: bool) -> pb::NamedVolumeMount {
        pb::NamedVolumeMount {
            volume: volume.into(),
            sub_path: String::new(),
            mount_path: path.into(),
            read_only: ro,
        }
    }

    fn refused(r: Result<()>) -> String {
        let e = r.expect_err("refused");
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
        e.to_string()
    }

    #[test]
    fn read_write_once_admits_one_writer_and_any_readers() {
        use AccessMode::ReadWriteOnce as Rwo;
        assert!(admit("v", Rwo, &[], "a", false).is_ok());
        let writer = [holder("a", false)];
        let text = refused(admit("v", Rwo, &writer, "b", false));
        assert!(
            text.contains("ReadWriteOnce") && text.contains("sandbox a"),
            "{text}"
        );
        assert!(admit("v", Rwo, &writer, "b", true).is_ok());
        // Readers do not stop a writer.
        let readers = [holder("a", true), holder("b", true)];
        assert!(admit("v", Rwo, &readers, "c", false).is_ok());
    }

    #[test]
    fn read_only_many_refuses_writers_and_read_write_many_admits_all() {
        let text = refused(admit("v", AccessMode::ReadOnlyMany, &[], "a", false));
        assert!(text.contains("ReadOnlyMany"), "{text}");
        assert!(
            admit(
                "v",
                AccessMode::ReadOnlyMany,
                &[holder("x", true)],
                "a",
                true
            )
            .is_ok()
        );
        let writers = [holder("a", false), holder("b", false)];
        assert!(admit("v", AccessMode::ReadWriteMany, &writers, "c", false).is_ok());
    }

    #[test]
    fn a_sandbox_mounts_a_volume_once() {
        let text = refused(admit(
            "v",
            AccessMode::ReadWriteMany,
            &[holder("a", true)],
            "a",
            true,
        ));
        assert!(text.contains("at most once"), "{text}");
    }

    #[test]
    fn the_table_releases_by_sandbox_and_volume() {
        let mut t = Table::default();
        t.add("v", holder("a", false));
        t.add("w", holder("a", true));
        t.add("v", holder("b", true));
        assert!(refuse_if_mounted(&t, "v", "delete").is_err());
        assert_eq!(t.remove("a", Some("v")), 1);
        assert_eq!(t.holders("w").len(), 1);
        assert_eq!(t.remove("a", None), 1);
        assert!(refuse_if_mounted(&t, "w", "delete").is_ok());
        assert_eq!(t.sandboxes(), BTreeSet::from(["b".to_string()]));
        let text = refuse_if_mounted(&t, "v", "restore")
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("restore") && text.contains("b at /mnt/b"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn gates_exclude_and_are_forgotten_once_free() {
        let vm = VolumeMounts::new(None, "agent", "node");
        let held = vm.gates(["v", "w"]).await;
        assert_eq!(vm.gates.lock().len(), 2);
        // Another caller on "w" waits until the first lets go.
        let waiting =
            tokio::time::timeout(std::time::Duration::from_millis(50), vm.gates(["w", "x"])).await;
        assert!(waiting.is_err(), "the gate of w is held");
        drop(held);
        let again = vm.gates(["w"]).await;
        assert_eq!(vm.gates.lock().len(), 1, "v and x are forgotten");
        drop(again);
        assert!(vm.gates.lock().is_empty());
        // Without a store every call says why.
        let e = vm.get("v").await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        assert!(vm.inventory().await.is_empty());
    }

    #[tokio::test]
    async fn backends_are_named_and_juicefs_needs_configuring() {
        let vm = VolumeMounts::new(None, "agent", "node-1");
        let create = |backend: &str| pb::VolumeSpec {
            name: "v".into(),
            backend: backend.into(),
            ..Default::default()
        };
        let e = vm.create(Some(create("nfs"))).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
        assert!(
            e.to_string().contains("spec.backend") && e.to_string().contains("nfs"),
            "{e}"
        );
        let e = vm.create(Some(create("juicefs"))).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
        assert!(
            e.to_string().contains("node-1") && e.to_string().contains("--juicefs-meta-url"),
            "{e}"
        );
        // "" and "local" are the volume root (there is none here).
        for local in ["", "local"] {
            let e = vm.create(Some(create(local))).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        }
        assert!(vm.juicefs_status().is_none());
    }

    #[test]
    fn labels_round_trip_and_stay_within_containerds_limit() {
        let mounts = vec![
            mount("data", "/data", false),
            pb::NamedVolumeMount {
                sub_path: "a/b".into(),
                ..mount("cache", "/cache", true)
            },
        ];
        let value = to_label(&mounts).unwrap();
        assert_eq!(from_label(&value).unwrap(), mounts);
        assert_eq!(from_label("").unwrap(), vec![]);
        assert_eq!(from_label("[]").unwrap(), vec![]);
        assert!(from_label("{").is_err());
        let long: Vec<_> = (0..40)
            .map(|i| {
                mount(
                    &format!("v{i}"),
                    &format!("/{}/{i}", "x".repeat(100)),
                    false,
                )
            })
            .collect();
        let e = to_label(&long).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn validation_names_the_field() {
        let bad = |m: Vec<pb::NamedVolumeMount>| {
            let e = validate(&m, "volume_mounts").unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            e.to_string()
        };
        assert!(validate(&[mount("v", "/data", false)], "volume_mounts").is_ok());
        assert!(bad(vec![mount("", "/data", false)]).contains("volume_mounts[0].volume"));
        assert!(bad(vec![mount("v", "data", false)]).contains("volume_mounts[0].mount_path"));
        assert!(bad(vec![mount("v", "/proc/x", false)]).contains("mount_path"));
        let twice = bad(vec![mount("v", "/a", false), mount("v", "/b", true)]);
        assert!(twice.contains("volume_mounts[1].volume"), "{twice}");
        let same_path = bad(vec![mount("v", "/a", false), mount("w", "/a", true)]);
        assert!(
            same_path.contains("volume_mounts[1].mount_path"),
            "{same_path}"
        );
        let up = bad(vec![pb::NamedVolumeMount {
            sub_path: "../x".into(),
            ..mount("v", "/a", false)
        }]);
        assert!(up.contains("sub_path"), "{up}");
    }
}
