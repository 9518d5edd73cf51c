//! Images on this node: resolve a reference to what a create needs (the
//! image's config and the snapshot chain id), unpack layers into the
//! snapshotter when needed, list the inventory, pull missing images (bounded)
//! and import image archives over the content + images API (`archive`
//! reads them).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use containerd_client::services::v1::snapshots::{
    CommitSnapshotRequest, PrepareSnapshotRequest, RemoveSnapshotRequest,
};
use containerd_client::services::v1::{
    ApplyRequest, CreateImageRequest, DeleteRequest as DeleteLeaseRequest, GetImageRequest, Image,
    InfoRequest, ListImagesRequest, ReadContentRequest, UpdateImageRequest, UpdateRequest,
    WriteAction, WriteContentRequest,
};
use containerd_client::types::Descriptor;
use futures::StreamExt;
use parking_lot::Mutex;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tonic::Code;

use crate::containerd::Containerd;
use crate::error::{NodeError, Result};
use sandbolt_image_ref::{ImageRef, normalize};

mod archive;
use archive::ArchiveError;
pub use archive::{ImportProgress, ImportStage, NoProgress};

const MT_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MT_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// containerd's GC follows these labels from a blob to what it references.
const GC_REF_CONTENT: &str = "containerd.io/gc.ref.content";
const GC_REF_SNAPSHOT: &str = "containerd.io/gc.ref.snapshot";

/// What a create needs from an image.
#[derive(Debug, Clone)]
pub struct ResolvedImage {
    /// The image store name it was found under.
    pub name: String,
    /// Digest of the image's target (manifest or index).
    pub digest: String,
    pub config: ImageConfig,
    /// Snapshot name of the top layer (the parent for a sandbox's snapshot).
    pub chain_id: String,
    /// Config + layer sizes (compressed), for the inventory.
    pub size_bytes: i64,
    config_digest: String,
    layers: Vec<Descriptor>,
    diff_ids: Vec<String>,
}

/// The runtime-relevant part of an OCI image config.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ImageConfig {
    #[serde(rename = "Entrypoint", default)]
    pub entrypoint: Option<Vec<String>>,
    #[serde(rename = "Cmd", default)]
    pub cmd: Option<Vec<String>>,
    #[serde(rename = "Env", default)]
    pub env: Option<Vec<String>>,
    #[serde(rename = "WorkingDir", default)]
    pub working_dir: Option<String>,
    #[serde(rename = "User", default)]
    pub user: Option<String>,
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    config: Option<ImageConfig>,
    rootfs: RawRootfs,
}

#[derive(Deserialize)]
struct RawRootfs {
    diff_ids: Vec<String>,
}

#[derive(Deserialize)]
struct RawManifest {
    #[serde(rename = "mediaType", default)]
    media_type: Option<String>,
    #[serde(default)]
    manifests: Option<Vec<RawDescriptor>>,
    #[serde(default)]
    config: Option<RawDescriptor>,
    #[serde(default)]
    layers: Option<Vec<RawDescriptor>>,
}

#[derive(Deserialize, Clone)]
struct RawDescriptor {
    #[serde(rename = "mediaType", default)]
    media_type: String,
    digest: String,
    size: i64,
    #[serde(default)]
    platform: Option<RawPlatform>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize, Clone)]
struct RawPlatform {
    os: String,
    architecture: String,
}

impl RawDescriptor {
    fn to_descriptor(&self) -> Descriptor {
        Descriptor {
            media_type: self.media_type.clone(),
            digest: self.digest.clone(),
            size: self.size,
            annotations: Default::default(),
        }
    }
}

/// One image as the inventory reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct InventoryImage {
    pub references: Vec<String>,
    pub digest: String,
    pub size_bytes: i64,
}

/// Image operations with a cache of resolved configs keyed by target digest
/// (a digest names immutable content, so the cache never goes stale; the
/// name → digest step is asked of containerd on every create).
pub struct Images {
    ctrd: Containerd,
    snapshotter: String,
    by_digest: Mutex<HashMap<String, Arc<ResolvedImage>>>,
    /// Chain ids known to be unpacked on the snapshotter.
    unpacked: Mutex<std::collections::HashSet<String>>,
    /// Serializes unpacks (two creates of a fresh image must not both extract).
    unpack_lock: tokio::sync::Mutex<()>,
    /// One pull per normalized name at a time (see [`Images::resolve_or_pull`]).
    pull_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// How [`Images::resolve_or_pull`] pulls a missing image.
#[derive(Debug, Clone, Copy)]
pub struct PullOptions<'a> {
    /// Bound on one `ctr images pull`.
    pub timeout: Duration,
    /// Registry hosts pulled from over plain HTTP (see [`pull`]).
    pub plain_http_registries: &'a [String],
}

/// Label containerd's CRI plugin reads as "pinned": the kubelet's image
/// garbage collection never removes a pinned image (it is how containerd
/// keeps the pause image). Warm images get it so a node under disk pressure
/// does not evict the images its pool promised to keep warm.
pub const CRI_PINNED_LABEL: &str = "io.cri-containerd.pinned";
const CRI_PINNED_VALUE: &str = "pinned";

impl Images {
    pub fn new(ctrd: Containerd, snapshotter: String) -> Self {
        Self {
            ctrd,
            snapshotter,
            by_digest: Mutex::new(HashMap::new()),
            unpacked: Mutex::new(Default::default()),
            unpack_lock: tokio::sync::Mutex::new(()),
            pull_locks: Mutex::new(HashMap::new()),
        }
    }

    /// Resolves `reference`, pulling it first when it is missing. Pulls of
    /// one name are serialized and the image is looked up again under the
    /// lock: a create that needs an image a warm-up is already pulling waits
    /// for that pull instead of starting a second one.
    #[tracing::instrument(skip_all, fields(image = %reference))]
    pub async fn resolve_or_pull(
        &self,
        reference: &str,
        opts: PullOptions<'_>,
    ) -> Result<Arc<ResolvedImage>> {
        let key = ImageRef::parse(reference)
            .map_err(|e| NodeError::InvalidArgument(e.to_string()))?
            .to_string();
        let lock = self
            .pull_locks
            .lock()
            .entry(key.clone())
            .or_default()
            .clone();
        let result = async {
            let _guard = lock.lock().await;
            match self.resolve(reference).await {
                Err(NodeError::ImageNotFound { .. }) => {
                    pull(
                        &self.ctrd,
                        &self.snapshotter,
                        reference,
                        opts.timeout,
                        opts.plain_http_registries,
                    )
                    .await?;
                    self.resolve(reference).await
                }
                other => other,
            }
        }
        .await;
        // The map keeps a lock only while someone holds or waits for it.
        let mut locks = self.pull_locks.lock();
        if Arc::strong_count(&lock) == 2 {
            locks.remove(&key);
        }
        result
    }

    /// Labels the image record `name` as pinned for the CRI plugin
    /// ([`CRI_PINNED_LABEL`]); a no-op when it already is.
    #[tracing::instrument(skip_all, fields(image = %name))]
    pub async fn pin(&self, name: &str) -> Result<()> {
        let image = self
            .ctrd
            .images()
            .get(self.ctrd.req(GetImageRequest {
                name: name.to_string(),
            }))
            .await
            .map_err(NodeError::containerd("images.Get"))?
            .into_inner()
            .image
            .ok_or_else(|| NodeError::ImageNotFound {
                reference: name.to_string(),
            })?;
        if image.labels.get(CRI_PINNED_LABEL).map(String::as_str) == Some(CRI_PINNED_VALUE) {
            return Ok(());
        }
        let mut labels = image.labels.clone();
        labels.insert(CRI_PINNED_LABEL.into(), CRI_PINNED_VALUE.into());
        self.ctrd
            .images()
            .update(self.ctrd.req(UpdateImageRequest {
                image: Some(Image { labels, ..image }),
                // Only this label: the target and other labels stay as they
                // are even if someone updates the image meanwhile.
                update_mask: Some(prost_types::FieldMask {
                    paths: vec![format!("labels.{CRI_PINNED_LABEL}")],
                }),
                source_date_epoch: None,
            }))
            .await
            .map_err(NodeError::containerd("images.Update"))?;
        Ok(())
    }

    /// Finds the image in the store (no pull) and returns what a create needs.
    #[tracing::instrument(skip_all, fields(image = %reference))]
    pub async fn resolve(&self, reference: &str) -> Result<Arc<ResolvedImage>> {
        let parsed =
            ImageRef::parse(reference).map_err(|e| NodeError::InvalidArgument(e.to_string()))?;
        let image = self
            .find(&parsed)
            .await?
            .ok_or_else(|| NodeError::ImageNotFound {
                reference: parsed.to_string(),
            })?;
        self.resolve_image(image).await
    }

    /// Looks the reference up in the image store: by normalized name first,
    /// then (for a pinned digest) by target digest.
    async fn find(&self, r: &ImageRef) -> Result<Option<Image>> {
        if let ImageRef::Named { .. } = r {
            match self
                .ctrd
                .images()
                .get(self.ctrd.req(GetImageRequest {
                    name: r.to_string(),
                }))
                .await
            {
                Ok(resp) => return Ok(resp.into_inner().image),
                Err(s) if s.code() == Code::NotFound => {}
                Err(s) => return Err(NodeError::containerd("images.Get")(s)),
            }
        }
        let Some(digest) = r.digest() else {
            return Ok(None);
        };
        let list = self
            .ctrd
            .images()
            .list(self.ctrd.req(ListImagesRequest {
                filters: vec![format!("target.digest=={digest}")],
            }))
            .await
            .map_err(NodeError::containerd("images.List"))?
            .into_inner()
            .images;
        Ok(list.into_iter().next())
    }

    async fn resolve_image(&self, image: Image) -> Result<Arc<ResolvedImage>> {
        let target = image.target.ok_or_else(|| NodeError::BadImage {
            reference: image.name.clone(),
            reason: "image has no target".into(),
        })?;
        if let Some(hit) = self.by_digest.lock().get(&target.digest) {
            return Ok(hit.clone());
        }
        let resolved = Arc::new(self.read_image(&image.name, &target).await?);
        self.by_digest
            .lock()
            .insert(target.digest.clone(), resolved.clone());
        Ok(resolved)
    }

    /// Reads index → platform manifest → config from the content store.
    async fn read_image(&self, name: &str, target: &Descriptor) -> Result<ResolvedImage> {
        let bad = |reason: String| NodeError::BadImage {
            reference: name.to_string(),
            reason,
        };
        let mut manifest_digest = target.digest.clone();
        let mut manifest: RawManifest =
            serde_json::from_slice(&self.read_blob(&manifest_digest).await?)
                .map_err(|e| bad(format!("manifest {manifest_digest}: {e}")))?;
        let is_index = |m: &RawManifest, mt: &str| {
            mt == MT_OCI_INDEX
                || mt == MT_DOCKER_LIST
                || m.media_type.as_deref() == Some(MT_OCI_INDEX)
                || m.media_type.as_deref() == Some(MT_DOCKER_LIST)
                || (m.manifests.is_some() && m.config.is_none())
        };
        if is_index(&manifest, &target.media_type) {
            let entries = manifest.manifests.clone().unwrap_or_default();
            let chosen = pick_platform(&entries)
                .ok_or_else(|| bad(format!("no manifest for linux/{}", host_arch())))?;
            manifest_digest = chosen.digest.clone();
            manifest = serde_json::from_slice(&self.read_blob(&manifest_digest).await?)
                .map_err(|e| bad(format!("manifest {manifest_digest}: {e}")))?;
        }
        let config_desc = manifest
            .config
            .ok_or_else(|| bad(format!("manifest {manifest_digest} has no config")))?;
        let layers = manifest.layers.unwrap_or_default();
        let raw: RawConfig = serde_json::from_slice(&self.read_blob(&config_desc.digest).await?)
            .map_err(|e| bad(format!("config {}: {e}", config_desc.digest)))?;
        if raw.rootfs.diff_ids.is_empty() {
            return Err(bad("image has no layers".into()));
        }
        if raw.rootfs.diff_ids.len() != layers.len() {
            return Err(bad(format!(
                "{} layers but {} diff ids",
                layers.len(),
                raw.rootfs.diff_ids.len()
            )));
        }
        let size_bytes = config_desc.size + layers.iter().map(|l| l.size).sum::<i64>();
        Ok(ResolvedImage {
            name: name.to_string(),
            digest: target.digest.clone(),
            config: raw.config.unwrap_or_default(),
            chain_id: chain_ids(&raw.rootfs.diff_ids).pop().unwrap_or_default(),
            size_bytes,
            config_digest: config_desc.digest,
            layers: layers.iter().map(RawDescriptor::to_descriptor).collect(),
            diff_ids: raw.rootfs.diff_ids,
        })
    }

    pub async fn read_blob(&self, digest: &str) -> Result<Vec<u8>> {
        let mut stream = self
            .ctrd
            .content()
            .read(self.ctrd.req(ReadContentRequest {
                digest: digest.to_string(),
                offset: 0,
                size: 0,
            }))
            .await
            .map_err(NodeError::containerd("content.Read"))?
            .into_inner();
        let mut out = Vec::new();
        while let Some(chunk) = stream.next().await {
            out.extend_from_slice(&chunk.map_err(NodeError::containerd("content.Read"))?.data);
        }
        Ok(out)
    }

    /// Makes sure the image's layers exist as committed snapshots on the
    /// snapshotter (an image imported or pulled without unpacking, or for a
    /// different snapshotter, has none).
    #[tracing::instrument(skip_all, fields(image = %image.name))]
    pub async fn ensure_unpacked(&self, image: &ResolvedImage) -> Result<()> {
        if self.unpacked.lock().contains(&image.chain_id) {
            return Ok(());
        }
        let _guard = self.unpack_lock.lock().await;
        if self.snapshot_exists(&image.chain_id).await? {
            self.unpacked.lock().insert(image.chain_id.clone());
            return Ok(());
        }
        tracing::info!(image = %image.name, chain_id = %image.chain_id, "unpacking image");
        let lease = Lease::create(&self.ctrd).await?;
        let result = self.unpack(image, &lease.id).await;
        lease.delete(&self.ctrd).await;
        result?;
        self.unpacked.lock().insert(image.chain_id.clone());
        Ok(())
    }

    async fn snapshot_exists(&self, key: &str) -> Result<bool> {
        self.ctrd
            .stat_snapshot(&self.snapshotter, key)
            .await
            .map(|info| info.is_some())
            .map_err(NodeError::containerd("snapshots.Stat"))
    }

    async fn unpack(&self, image: &ResolvedImage, lease: &str) -> Result<()> {
        let chain = chain_ids(&image.diff_ids);
        let mut parent = String::new();
        for (i, layer) in image.layers.iter().enumerate() {
            let chain_id = &chain[i];
            if !self.snapshot_exists(chain_id).await? {
                let key = format!("extract-{}-{chain_id}", uuid::Uuid::new_v4().simple());
                let mounts = self
                    .ctrd
                    .snapshots()
                    .prepare(self.ctrd.leased_req(
                        PrepareSnapshotRequest {
                            snapshotter: self.snapshotter.clone(),
                            key: key.clone(),
                            parent: parent.clone(),
                            labels: Default::default(),
                        },
                        lease,
                    )?)
                    .await
                    .map_err(NodeError::containerd("snapshots.Prepare"))?
                    .into_inner()
                    .mounts;
                let applied = self
                    .ctrd
                    .diff()
                    .apply(self.ctrd.leased_req(
                        ApplyRequest {
                            diff: Some(layer.clone()),
                            mounts,
                            payloads: Default::default(),
                            sync_fs: false,
                        },
                        lease,
                    )?)
                    .await;
                let remove_key = || async {
                    let _ = self
                        .ctrd
                        .snapshots()
                        .remove(self.ctrd.req(RemoveSnapshotRequest {
                            snapshotter: self.snapshotter.clone(),
                            key: key.clone(),
                        }))
                        .await;
                };
                let applied = match applied {
                    Ok(a) => a.into_inner().applied,
                    Err(s) => {
                        remove_key().await;
                        return Err(NodeError::containerd("diff.Apply")(s));
                    }
                };
                if let Some(a) = applied
                    && a.digest != image.diff_ids[i]
                {
                    remove_key().await;
                    return Err(NodeError::BadImage {
                        reference: image.name.clone(),
                        reason: format!(
                            "layer {} unpacked to {}, config says {}",
                            layer.digest, a.digest, image.diff_ids[i]
                        ),
                    });
                }
                let commit = self
                    .ctrd
                    .snapshots()
                    .commit(self.ctrd.leased_req(
                        CommitSnapshotRequest {
                            snapshotter: self.snapshotter.clone(),
                            name: chain_id.clone(),
                            key: key.clone(),
                            labels: Default::default(),
                        },
                        lease,
                    )?)
                    .await;
                match commit {
                    Ok(_) => {}
                    // Someone else committed the same layer meanwhile: fine.
                    Err(s) if s.code() == Code::AlreadyExists => remove_key().await,
                    Err(s) => {
                        remove_key().await;
                        return Err(NodeError::containerd("snapshots.Commit")(s));
                    }
                }
            }
            parent = chain_id.clone();
        }
        // Root the unpacked snapshot from the image's config blob, as
        // containerd's own unpacker does, so GC keeps it once the lease goes.
        let label = format!("{GC_REF_SNAPSHOT}.{}", self.snapshotter);
        self.set_content_labels(
            &image.config_digest,
            BTreeMap::from([(label, image.chain_id.clone())]),
        )
        .await
    }

    async fn set_content_labels(
        &self,
        digest: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<()> {
        if labels.is_empty() {
            return Ok(());
        }
        let mut info = self
            .ctrd
            .content()
            .info(self.ctrd.req(InfoRequest {
                digest: digest.to_string(),
            }))
            .await
            .map_err(NodeError::containerd("content.Info"))?
            .into_inner()
            .info
            .unwrap_or_default();
        let paths = labels.keys().map(|k| format!("labels.{k}")).collect();
        info.labels.extend(labels);
        self.ctrd
            .content()
            .update(self.ctrd.req(UpdateRequest {
                info: Some(info),
                update_mask: Some(prost_types::FieldMask { paths }),
            }))
            .await
            .map_err(NodeError::containerd("content.Update"))?;
        Ok(())
    }

    /// Every image in the namespace, grouped by target digest, references
    /// normalized.
    pub async fn inventory(&self) -> Result<Vec<InventoryImage>> {
        let list = self
            .ctrd
            .images()
            .list(self.ctrd.req(ListImagesRequest { filters: vec![] }))
            .await
            .map_err(NodeError::containerd("images.List"))?
            .into_inner()
            .images;
        let mut by_digest: BTreeMap<String, (Vec<String>, Image)> = BTreeMap::new();
        for image in list {
            let Some(target) = &image.target else {
                continue;
            };
            let entry = by_digest
                .entry(target.digest.clone())
                .or_insert_with(|| (Vec::new(), image.clone()));
            // Names that are themselves digests carry no reference.
            if !image.name.starts_with("sha256:") {
                let n = normalize(&image.name);
                if !entry.0.contains(&n) {
                    entry.0.push(n);
                }
            }
        }
        let mut out = Vec::with_capacity(by_digest.len());
        for (digest, (mut references, image)) in by_digest {
            references.sort();
            // An image that is not runnable here (foreign platform, broken)
            // still shows up, with size 0.
            let size_bytes = match self.resolve_image(image).await {
                Ok(r) => r.size_bytes,
                Err(e) => {
                    tracing::debug!(%digest, error = %e, "image not resolvable for inventory");
                    0
                }
            };
            out.push(InventoryImage {
                references,
                digest,
                size_bytes,
            });
        }
        Ok(out)
    }

    /// Imports an image archive — an OCI image layout tar with or without
    /// `./` prefixes and directory entries, `docker save` output of either
    /// format, `skopeo`/`buildah` `oci-archive:`, each plain or gzip — through
    /// the content and images API, then unpacks it. Of an index of platforms
    /// only the host's manifest is imported. `name` names a one-image
    /// archive's image; in an archive of several, the one image it leaves
    /// unnamed, and it lends its repository to images the archive tags
    /// without one. Nothing is written unless the whole archive checks out.
    /// Returns the normalized names created.
    pub async fn import_oci_tar(&self, tar_path: &Path, name: Option<&str>) -> Result<Vec<String>> {
        self.import_archive(tar_path, name, Arc::new(NoProgress))
            .await
    }

    /// [`Images::import_oci_tar`], reporting its progress.
    #[tracing::instrument(skip_all, fields(archive = %tar_path.display()))]
    pub async fn import_archive(
        &self,
        tar_path: &Path,
        name: Option<&str>,
        progress: Arc<dyn ImportProgress>,
    ) -> Result<Vec<String>> {
        let name = match name {
            None => None,
            Some(n) => match ImageRef::parse(n) {
                Ok(r @ ImageRef::Named { .. }) => Some(r),
                Ok(ImageRef::Digest(_)) => {
                    return Err(NodeError::InvalidArgument(format!(
                        "--name {n}: a digest names content, not an image: give a name such as example/image:tag"
                    )));
                }
                Err(e) => return Err(NodeError::InvalidArgument(format!("--name: {e}"))),
            },
        };
        // One line, whatever names an archive carries.
        let bad = |e: ArchiveError| NodeError::BadImage {
            reference: tar_path.display().to_string(),
            reason: archive::escape_controls(&e.to_string()),
        };
        let size = std::fs::metadata(tar_path)
            .map_err(|e| bad(ArchiveError::Open(e)))?
            .len();

        // Pass 1 (blocking): hash and check everything, decide the plan.
        progress.stage(ImportStage::Checking, size);
        let (path, p) = (tar_path.to_path_buf(), progress.clone());
        let plan = tokio::task::spawn_blocking(move || {
            let scan = archive::scan(&path, p)?;
            archive::plan(&scan, name.as_ref())
        })
        .await
        .map_err(NodeError::join("import"))?
        .map_err(bad)?;

        let lease = Lease::create(&self.ctrd).await?;
        let result = self
            .import_planned(tar_path, size, plan, &progress, &lease.id)
            .await;
        lease.delete(&self.ctrd).await;
        result.map_err(|e| match e {
            ImportError::Archive(e) => bad(e),
            ImportError::Node(e) => e,
        })
    }

    async fn import_planned(
        &self,
        tar_path: &Path,
        size: u64,
        plan: archive::Plan,
        progress: &Arc<dyn ImportProgress>,
        lease: &str,
    ) -> Result<Vec<String>, ImportError> {
        // Blobs containerd has already (an earlier import, a shared layer)
        // only get their labels: a re-import reads the archive once.
        let mut wanted = BTreeMap::new();
        for (ordinal, blob) in plan.from_archive {
            if self.content_exists(&blob.digest).await? {
                self.set_content_labels(&blob.digest, blob.labels).await?;
            } else {
                wanted.insert(ordinal, blob);
            }
        }
        for (blob, data) in plan.synthesized {
            self.write_blob(&blob.digest, data, blob.labels, lease)
                .await?;
        }
        if !wanted.is_empty() {
            progress.stage(ImportStage::Writing, size);
            self.stream_archive_blobs(tar_path, wanted, progress.clone(), lease)
                .await?;
        }

        progress.stage(ImportStage::Unpacking, 0);
        let mut names = Vec::new();
        for image in plan.images {
            for name in &image.names {
                self.put_image(name, &image.target, lease).await?;
            }
            let Some(first) = image.names.first() else {
                continue;
            };
            tracing::info!(image = %first, platform = %image.platform, digest = %image.target.digest, "imported");
            let resolved = self.resolve(first).await?;
            self.ensure_unpacked(&resolved).await?;
            names.extend(image.names);
        }
        Ok(names)
    }

    async fn content_exists(&self, digest: &str) -> Result<bool> {
        match self
            .ctrd
            .content()
            .info(self.ctrd.req(InfoRequest {
                digest: digest.to_string(),
            }))
            .await
        {
            Ok(_) => Ok(true),
            Err(s) if s.code() == Code::NotFound => Ok(false),
            Err(s) => Err(NodeError::containerd("content.Info")(s)),
        }
    }

    /// Creates the image record `name` → `target`, or points an existing
    /// one at it.
    async fn put_image(&self, name: &str, target: &Descriptor, lease: &str) -> Result<()> {
        let image = Image {
            name: name.to_string(),
            labels: Default::default(),
            target: Some(target.clone()),
            created_at: None,
            updated_at: None,
        };
        let created = self
            .ctrd
            .images()
            .create(self.ctrd.leased_req(
                CreateImageRequest {
                    image: Some(image.clone()),
                    source_date_epoch: None,
                },
                lease,
            )?)
            .await;
        match created {
            Ok(_) => Ok(()),
            Err(s) if s.code() == Code::AlreadyExists => {
                self.ctrd
                    .images()
                    .update(self.ctrd.req(UpdateImageRequest {
                        image: Some(image),
                        update_mask: Some(prost_types::FieldMask {
                            paths: vec!["target".into()],
                        }),
                        source_date_epoch: None,
                    }))
                    .await
                    .map_err(NodeError::containerd("images.Update"))?;
                Ok(())
            }
            Err(s) => Err(NodeError::containerd("images.Create")(s)),
        }
    }

    /// Pass 2: a blocking reader hands the wanted blobs over in 1 MiB
    /// chunks; each blob is one `content.Write` stream, so memory stays at
    /// a few chunks whatever the layer's size.
    async fn stream_archive_blobs(
        &self,
        tar_path: &Path,
        wanted: BTreeMap<usize, archive::PlannedBlob>,
        progress: Arc<dyn ImportProgress>,
        lease: &str,
    ) -> Result<(), ImportError> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<archive::Piece>(4);
        let path = tar_path.to_path_buf();
        let expected: Vec<String> = wanted.values().map(|b| b.digest.clone()).collect();
        let reader = tokio::task::spawn_blocking(move || {
            archive::stream_blobs(&path, &wanted, progress, |piece| {
                tx.blocking_send(piece).is_ok()
            })
        });
        let mut written = Vec::new();
        let mut current: Option<BlobWriter> = None;
        let mut failure: Option<ImportError> = None;
        while let Some(piece) = rx.recv().await {
            let step = match piece {
                archive::Piece::Start(blob) => self.open_writer(blob, lease).map(|w| {
                    current = Some(w);
                }),
                archive::Piece::Data(data) => match current.as_mut() {
                    Some(w) => w.write(data).await,
                    None => Ok(()),
                },
                archive::Piece::End => match current.take() {
                    Some(w) => {
                        let digest = w.blob.digest.clone();
                        let labels = w.blob.labels.clone();
                        match w.commit().await {
                            Ok(()) => Ok(()),
                            // Someone wrote the same blob meanwhile.
                            Err(e) if e.is_containerd(Code::AlreadyExists) => {
                                self.set_content_labels(&digest, labels).await
                            }
                            Err(e) => Err(e),
                        }
                        .map(|()| written.push(digest))
                    }
                    None => Ok(()),
                },
            };
            if let Err(e) = step {
                failure = Some(ImportError::Node(e));
                break;
            }
        }
        // Dropping the receiver stops the reader at its next send.
        drop(rx);
        let read = reader.await.map_err(NodeError::join("import"))?;
        if let Some(f) = failure {
            return Err(f);
        }
        read.map_err(ImportError::Archive)?;
        if let Some(missing) = expected.iter().find(|d| !written.contains(d)) {
            return Err(ImportError::Archive(ArchiveError::Content(format!(
                "blob {missing} was not found again in the second pass: the archive changed during the import"
            ))));
        }
        Ok(())
    }

    fn open_writer(&self, blob: archive::PlannedBlob, lease: &str) -> Result<BlobWriter> {
        let (tx, rx) = tokio::sync::mpsc::channel::<WriteContentRequest>(2);
        let request = self
            .ctrd
            .leased_req(tokio_stream::wrappers::ReceiverStream::new(rx), lease)?;
        let mut client = self.ctrd.content();
        // Responses are drained as they come: containerd answers every
        // write, and an unread answer stream would stall the request stream
        // once HTTP/2's window is full.
        let task = tokio::spawn(async move {
            let mut responses = client
                .write(request)
                .await
                .map_err(NodeError::containerd("content.Write"))?
                .into_inner();
            while let Some(r) = responses.next().await {
                r.map_err(NodeError::containerd("content.Write"))?;
            }
            Ok(())
        });
        Ok(BlobWriter {
            r#ref: format!("sandbolt-import-{}", blob.digest),
            blob,
            offset: 0,
            tx,
            task,
        })
    }

    /// Writes one blob (1 MiB chunks) and commits it with `labels`; a blob
    /// that exists already only gets the labels.
    async fn write_blob(
        &self,
        digest: &str,
        data: Vec<u8>,
        labels: BTreeMap<String, String>,
        lease: &str,
    ) -> Result<()> {
        const CHUNK: usize = 1 << 20;
        let total = data.len() as i64;
        let r#ref = format!("sandbolt-import-{digest}");
        let mut reqs = Vec::new();
        let mut offset = 0usize;
        while offset < data.len() {
            let end = (offset + CHUNK).min(data.len());
            reqs.push(WriteContentRequest {
                action: WriteAction::Write as i32,
                r#ref: r#ref.clone(),
                total,
                expected: digest.to_string(),
                offset: offset as i64,
                data: data[offset..end].to_vec(),
                labels: Default::default(),
            });
            offset = end;
        }
        reqs.push(WriteContentRequest {
            action: WriteAction::Commit as i32,
            r#ref: r#ref.clone(),
            total,
            expected: digest.to_string(),
            offset: total,
            data: vec![],
            labels: labels.clone().into_iter().collect(),
        });
        let result = async {
            let mut responses = self
                .ctrd
                .content()
                .write(self.ctrd.leased_req(futures::stream::iter(reqs), lease)?)
                .await
                .map_err(NodeError::containerd("content.Write"))?
                .into_inner();
            while let Some(r) = responses.next().await {
                r.map_err(NodeError::containerd("content.Write"))?;
            }
            Ok::<_, NodeError>(())
        }
        .await;
        match result {
            Ok(()) => Ok(()),
            Err(e) if e.is_containerd(Code::AlreadyExists) => {
                self.set_content_labels(digest, labels).await
            }
            Err(e) => Err(e),
        }
    }
}

/// Pulls `reference` with containerd's own client (`ctr images pull`),
/// bounded by `timeout`: the agent needs no registry client of its own for
/// the rare miss, and a dead registry turns into a clear error, not a hang.
///
/// A reference whose registry host (`host[:port]`, compared without case)
/// is in `plain_http_registries` is pulled over plain HTTP: private
/// in-cluster registries (a pull-through cache, a registry Service) often
/// serve no TLS, and `ctr` would otherwise insist on HTTPS. Only the hosts
/// named get this; every other registry still needs TLS.
#[tracing::instrument(skip_all, fields(image = %reference))]
pub async fn pull(
    ctrd: &Containerd,
    snapshotter: &str,
    reference: &str,
    timeout: Duration,
    plain_http_registries: &[String],
) -> Result<()> {
    let name = ImageRef::parse(reference).map_err(|e| NodeError::InvalidArgument(e.to_string()))?;
    let ImageRef::Named { domain, .. } = &name else {
        return Err(NodeError::PullFailed {
            reference: reference.to_string(),
            reason: "a bare digest names no registry to pull from".into(),
        });
    };
    let plain_http = plain_http_registries
        .iter()
        .any(|h| h.trim().eq_ignore_ascii_case(domain));
    let name = name.to_string();
    tracing::info!(image = %name, ?timeout, plain_http, "pulling missing image");
    let mut cmd = tokio::process::Command::new("ctr");
    cmd.arg("--address")
        .arg(ctrd.socket())
        .arg("--namespace")
        .arg(ctrd.namespace())
        .args(["images", "pull", "--snapshotter", snapshotter]);
    if plain_http {
        cmd.arg("--plain-http");
    }
    cmd.arg(&name)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().map_err(|e| NodeError::PullFailed {
        reference: name.clone(),
        reason: format!("cannot run ctr: {e}"),
    })?;
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Err(_) => Err(NodeError::PullFailed {
            reference: name,
            reason: format!("timed out after {timeout:?}"),
        }),
        Ok(Err(e)) => Err(NodeError::PullFailed {
            reference: name,
            reason: e.to_string(),
        }),
        Ok(Ok(out)) if out.status.success() => Ok(()),
        Ok(Ok(out)) => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let reason = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("ctr exited without a message")
                .trim()
                .to_string();
            Err(NodeError::PullFailed {
                reference: name,
                reason,
            })
        }
    }
}

/// A containerd lease that protects what an operation writes until the
/// image (which roots it) exists.
struct Lease {
    id: String,
}

impl Lease {
    async fn create(ctrd: &Containerd) -> Result<Self> {
        let id = format!("sandbolt-{}", uuid::Uuid::new_v4().simple());
        ctrd.leases()
            .create(ctrd.req(containerd_client::services::v1::CreateRequest {
                id: id.clone(),
                labels: Default::default(),
            }))
            .await
            .map_err(NodeError::containerd("leases.Create"))?;
        Ok(Self { id })
    }

    async fn delete(self, ctrd: &Containerd) {
        if let Err(e) = ctrd
            .leases()
            .delete(ctrd.req(DeleteLeaseRequest {
                id: self.id.clone(),
                sync: false,
            }))
            .await
        {
            tracing::warn!(lease = %self.id, error = %e, "lease delete failed");
        }
    }
}

/// An import's failure: the archive's (named after the archive by the
/// caller) or containerd's.
enum ImportError {
    Archive(ArchiveError),
    Node(NodeError),
}

impl From<NodeError> for ImportError {
    fn from(e: NodeError) -> Self {
        ImportError::Node(e)
    }
}

/// One blob's `content.Write` stream in flight.
struct BlobWriter {
    blob: archive::PlannedBlob,
    r#ref: String,
    offset: u64,
    tx: tokio::sync::mpsc::Sender<WriteContentRequest>,
    task: tokio::task::JoinHandle<Result<()>>,
}

impl BlobWriter {
    fn request(&self, action: WriteAction, data: Vec<u8>) -> WriteContentRequest {
        WriteContentRequest {
            action: action as i32,
            r#ref: self.r#ref.clone(),
            total: self.blob.size as i64,
            expected: self.blob.digest.clone(),
            offset: self.offset as i64,
            data,
            labels: Default::default(),
        }
    }

    async fn write(&mut self, data: Vec<u8>) -> Result<()> {
        let len = data.len() as u64;
        let req = self.request(WriteAction::Write, data);
        if self.tx.send(req).await.is_err() {
            // The stream ended early: its task holds the reason.
            return Err(self.fail().await);
        }
        self.offset += len;
        Ok(())
    }

    /// Commits with the blob's labels; containerd checks the digest.
    async fn commit(mut self) -> Result<()> {
        let mut req = self.request(WriteAction::Commit, Vec::new());
        req.labels = self.blob.labels.clone().into_iter().collect();
        if self.tx.send(req).await.is_err() {
            return Err(self.fail().await);
        }
        drop(self.tx);
        self.task.await.map_err(NodeError::join("content.Write"))?
    }

    async fn fail(&mut self) -> NodeError {
        match (&mut self.task).await {
            Ok(Err(e)) => e,
            Ok(Ok(())) => NodeError::containerd("content.Write")(tonic::Status::internal(
                "the write stream ended early",
            )),
            Err(e) => NodeError::join("content.Write")(e),
        }
    }
}

/// Chain ids of a layer stack (OCI image spec): the first is the first diff
/// id, each next is sha256 of "<previous chain id> <diff id>".
pub fn chain_ids(diff_ids: &[String]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(diff_ids.len());
    for d in diff_ids {
        let next = match out.last() {
            None => d.clone(),
            Some(prev) => format!(
                "sha256:{}",
                hex::encode(Sha256::digest(format!("{prev} {d}").as_bytes()))
            ),
        };
        out.push(next);
    }
    out
}

fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

fn pick_platform(entries: &[RawDescriptor]) -> Option<&RawDescriptor> {
    entries
        .iter()
        .find(|d| {
            d.platform
                .as_ref()
                .is_some_and(|p| p.os == "linux" && p.architecture == host_arch())
        })
        .or_else(|| entries.iter().find(|d| d.platform.is_none()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_id_of_one_layer_is_its_diff_id() {
        let d = "sha256:aaaa".to_string();
        assert_eq!(chain_ids(std::slice::from_ref(&d)), vec![d]);
    }

    #[test]
    fn chain_id_follows_the_oci_formula() {
        let a = "sha256:a".to_string();
        let b = "sha256:b".to_string();
        let ids = chain_ids(&[a.clone(), b]);
        let expect = format!(
            "sha256:{}",
            hex::encode(Sha256::digest(b"sha256:a sha256:b"))
        );
        assert_eq!(ids, vec![a, expect]);
    }

    #[test]
    fn picks_the_host_platform() {
        let mk = |arch: &str, digest: &str| RawDescriptor {
            media_type: String::new(),
            digest: digest.into(),
            size: 1,
            platform: Some(RawPlatform {
                os: "linux".into(),
                architecture: arch.into(),
            }),
            annotations: None,
        };
        let entries = vec![mk("s390x", "x"), mk(host_arch(), "ours")];
        assert_eq!(pick_platform(&entries).unwrap().digest, "ours");
        assert!(pick_platform(&entries[..1]).is_none());
    }
}
