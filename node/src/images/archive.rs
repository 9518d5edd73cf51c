//! Image archives as people have them, read straight from the file: an OCI
//! image layout in a tar (`tar -C layout -cf image.tar .`, `skopeo copy …
//! oci-archive:`, `buildah push … oci-archive:`, `docker save` of Docker ≥ 25)
//! or the older `docker save` format (`manifest.json` + `<id>/layer.tar`, as
//! Docker 20.10 and `skopeo copy … docker-archive:` write it), each plain or
//! gzip-compressed.
//!
//! Two passes over the file keep memory at the size of the JSON documents,
//! whatever the size of the layers: [`scan`] hashes every file and keeps the
//! small JSON ones; [`plan`] works out from them what to write under which
//! digest and name, so that a broken or ambiguous archive fails — naming
//! the entry or document — before anything reaches containerd; the caller
//! then streams the planned blobs out of a second pass ([`stream_blobs`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::Arc;

use containerd_client::types::Descriptor;
use oci_spec::image::{
    Descriptor as OciDescriptor, Digest as OciDigest, ImageManifestBuilder, MediaType,
    SCHEMA_VERSION,
};
use sandbolt_image_ref::ImageRef;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{GC_REF_CONTENT, MT_DOCKER_LIST, MT_OCI_INDEX, RawDescriptor, RawManifest, host_arch};

const MT_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// The full reference containerd (and Docker ≥ 25) puts on an index entry.
const ANN_CONTAINERD_NAME: &str = "io.containerd.image.name";
/// The OCI annotation: a tag (`v1`) or, from some tools, a full reference.
const ANN_REF_NAME: &str = "org.opencontainers.image.ref.name";
/// Files kept in memory by [`scan`]: JSON documents are far smaller; a
/// layer never is kept, however it starts.
const DOC_MAX: u64 = 4 << 20;
/// How deep indexes may nest (an index of indexes of manifests is 2).
const MAX_DEPTH: usize = 4;
const CHUNK: usize = 1 << 20;

/// What an import is doing, for a progress display. Called from the
/// importing threads; every method has a no-op default.
pub trait ImportProgress: Send + Sync {
    /// A stage begins. `total` is the archive file's size for the stages
    /// that read it, 0 for one that does not.
    fn stage(&self, _stage: ImportStage, _total: u64) {}
    /// Bytes of the archive file read so far in the current stage.
    fn position(&self, _bytes: u64) {}
}

/// The stages of an import, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImportStage {
    /// First pass: every file hashed, the archive's documents checked.
    Checking,
    /// Second pass: the image's blobs streamed into containerd.
    Writing,
    /// Layers unpacked into the snapshotter.
    Unpacking,
}

impl fmt::Display for ImportStage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ImportStage::Checking => "checking",
            ImportStage::Writing => "writing",
            ImportStage::Unpacking => "unpacking",
        })
    }
}

/// No progress display.
pub struct NoProgress;
impl ImportProgress for NoProgress {}

/// Why an archive cannot be imported. Every message fits on one line and
/// names the entry or document at fault.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("cannot read the archive: {0}")]
    Open(#[source] std::io::Error),
    #[error(
        "the archive is compressed with {format}, which sandbolt does not read: decompress it first ({hint})"
    )]
    Compression {
        format: &'static str,
        hint: &'static str,
    },
    #[error("not a tar archive: {0}")]
    NotTar(String),
    /// A problem with one archive entry (its path as the archive spells it).
    #[error("entry {entry}: {problem}")]
    Entry { entry: String, problem: String },
    /// A problem with what the archive's documents say.
    #[error("{0}")]
    Content(String),
}

type Result<T, E = ArchiveError> = std::result::Result<T, E>;

fn entry_err(entry: &str, problem: impl Into<String>) -> ArchiveError {
    ArchiveError::Entry {
        entry: entry.to_string(),
        problem: problem.into(),
    }
}

/// One regular file of the archive.
#[derive(Debug, Clone)]
pub(super) struct FileInfo {
    /// Position among all entries (the same in both passes).
    ordinal: usize,
    /// The path as the archive spells it (for messages).
    raw_path: String,
    /// `sha256:<hex>` of the content.
    digest: String,
    size: u64,
    /// The first bytes (to recognize a compressed layer).
    head: Vec<u8>,
}

/// What the first pass learned.
pub(super) struct Scan {
    /// Regular files by normalized path (no `./`, no directory entries).
    files: HashMap<String, FileInfo>,
    /// Symbolic and hard links: normalized path → normalized target.
    links: HashMap<String, String>,
    /// Small files that look like JSON, by normalized path.
    docs: HashMap<String, Vec<u8>>,
    /// Some paths, in archive order, to describe an archive that is not an
    /// image archive.
    first_paths: Vec<String>,
}

/// A blob to write.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PlannedBlob {
    pub digest: String,
    pub size: u64,
    /// containerd GC references from this blob to what it points at.
    pub labels: BTreeMap<String, String>,
}

/// One image to create.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PlannedImage {
    pub names: Vec<String>,
    pub target: Descriptor,
    /// `os/arch` of the manifest that runs here.
    pub platform: String,
}

/// What to write and create, decided before anything is written.
#[derive(Debug)]
pub(super) struct Plan {
    /// Blobs streamed from the archive: entry ordinal → blob.
    pub from_archive: BTreeMap<usize, PlannedBlob>,
    /// Documents sandbolt writes itself (the manifest of a legacy
    /// `docker save` image, which has none): blob and its bytes.
    pub synthesized: Vec<(PlannedBlob, Vec<u8>)>,
    pub images: Vec<PlannedImage>,
}

/// Counts the bytes read from the file, for progress.
struct Counting<R> {
    inner: R,
    read: u64,
    progress: Arc<dyn ImportProgress>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        self.progress.position(self.read);
        Ok(n)
    }
}

/// Opens the archive for one pass, decompressing it when it is gzip.
fn open(path: &Path, progress: Arc<dyn ImportProgress>) -> Result<Box<dyn Read>> {
    let mut file = File::open(path).map_err(ArchiveError::Open)?;
    let mut magic = [0u8; 6];
    let mut n = 0;
    while n < magic.len() {
        match file.read(&mut magic[n..]).map_err(ArchiveError::Open)? {
            0 => break,
            k => n += k,
        }
    }
    file.seek(SeekFrom::Start(0)).map_err(ArchiveError::Open)?;
    let counted = Counting {
        inner: file,
        read: 0,
        progress,
    };
    let magic = &magic[..n];
    if magic.starts_with(&[0x1f, 0x8b]) {
        // Multi-member: `pigz` and concatenated `gzip` output are valid gzip.
        return Ok(Box::new(flate2::read::MultiGzDecoder::new(
            BufReader::with_capacity(CHUNK, counted),
        )));
    }
    for (prefix, format, hint) in [
        (&[0x28, 0xb5, 0x2f, 0xfd][..], "zstd", "zstd -d"),
        (&[0xfd, b'7', b'z', b'X', b'Z', 0x00][..], "xz", "xz -d"),
        (&b"BZh"[..], "bzip2", "bzip2 -d"),
    ] {
        if magic.starts_with(prefix) {
            return Err(ArchiveError::Compression { format, hint });
        }
    }
    Ok(Box::new(BufReader::with_capacity(CHUNK, counted)))
}

/// `./blobs//sha256/x` → `blobs/sha256/x`; `..` climbs (never above the
/// archive's root). Directory entries come out with no trailing slash.
pub(super) fn normalize_path(p: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in p.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    parts.join("/")
}

/// Iterates the archive's entries, turning the tar reader's errors into
/// messages that say where in the archive they happened.
fn for_each_entry(
    reader: Box<dyn Read>,
    mut f: impl FnMut(usize, &str, &mut tar::Entry<'_, Box<dyn Read>>) -> Result<bool>,
) -> Result<()> {
    let mut archive = tar::Archive::new(reader);
    let not_tar = |e: std::io::Error| {
        // The tar reader's message quotes the header's raw bytes: of a file
        // that is no tar, that is noise (and may span lines).
        let text = e.to_string();
        ArchiveError::NotTar(
            if e.kind() == std::io::ErrorKind::UnexpectedEof || text.contains("entire block") {
                "it ends before its first header".into()
            } else if text.contains("cksum") || text.contains("checksum") {
                "its first block is no tar header".into()
            } else {
                one_line(&text)
            },
        )
    };
    let entries = archive.entries().map_err(not_tar)?;
    let mut last: Option<String> = None;
    for (ordinal, entry) in entries.enumerate() {
        let mut entry = entry.map_err(|e| match &last {
            None => not_tar(e),
            Some(prev) => ArchiveError::Content(format!(
                "the archive is corrupt or truncated after entry {prev}: {}",
                one_line(&e.to_string())
            )),
        })?;
        let raw = one_line(&String::from_utf8_lossy(&entry.path_bytes()));
        let go_on = f(ordinal, &raw, &mut entry)?;
        last = Some(raw);
        if !go_on {
            break;
        }
    }
    if last.is_none() {
        return Err(ArchiveError::NotTar("it has no entries".into()));
    }
    Ok(())
}

/// `s` with its control characters (newlines above all) escaped.
pub(super) fn escape_controls(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// `s` fit for a part of a one-line message: control characters escaped,
/// at most 200 characters.
fn one_line(s: &str) -> String {
    let mut out = escape_controls(s);
    if out.chars().count() > 200 {
        out = out.chars().take(200).collect::<String>() + "…";
    }
    out
}

/// Reads an entry's data to the end, handing it over in chunks; a short
/// entry (the archive ends inside it) is an error naming it.
fn read_entry(
    raw: &str,
    entry: &mut impl Read,
    size: u64,
    mut chunk: impl FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let mut buf = vec![0u8; 256 << 10];
    let mut got = 0u64;
    loop {
        let n = entry.read(&mut buf).map_err(|e| {
            entry_err(
                raw,
                format!(
                    "{}: the archive is truncated or corrupt here",
                    one_line(&e.to_string())
                ),
            )
        })?;
        if n == 0 {
            break;
        }
        got += n as u64;
        chunk(&buf[..n])?;
    }
    // The tar reader returns a short entry without complaint when the file
    // ends inside it.
    if got != size {
        return Err(entry_err(
            raw,
            format!("the archive ends inside it ({got} of {size} bytes): it is truncated"),
        ));
    }
    Ok(())
}

/// First pass: every regular file hashed (and a blob under
/// `blobs/sha256/` checked against its name), links recorded, small JSON
/// files kept.
pub(super) fn scan(path: &Path, progress: Arc<dyn ImportProgress>) -> Result<Scan> {
    let reader = open(path, progress)?;
    let mut scan = Scan {
        files: HashMap::new(),
        links: HashMap::new(),
        docs: HashMap::new(),
        first_paths: Vec::new(),
    };
    for_each_entry(reader, |ordinal, raw, entry| {
        // From the whole name: `raw` is cut and escaped for messages.
        let key = normalize_path(&String::from_utf8_lossy(&entry.path_bytes()));
        let kind = entry.header().entry_type();
        if scan.first_paths.len() < 5 && !kind.is_dir() {
            scan.first_paths.push(raw.to_string());
        }
        if kind.is_file() || kind.is_gnu_sparse() {
            let size = entry.size();
            let keep = size <= DOC_MAX;
            let mut hasher = Sha256::new();
            let mut head = Vec::new();
            let mut doc = Vec::new();
            read_entry(raw, entry, size, |data| {
                hasher.update(data);
                if head.len() < 8 {
                    let want = (8 - head.len()).min(data.len());
                    head.extend_from_slice(&data[..want]);
                }
                if keep {
                    doc.extend_from_slice(data);
                }
                Ok(())
            })?;
            let hex = hex::encode(hasher.finalize());
            if let Some(named) = key.strip_prefix("blobs/sha256/")
                && named != hex
            {
                return Err(entry_err(
                    raw,
                    format!(
                        "its content has digest sha256:{hex}, not the one its name says: the blob is corrupt"
                    ),
                ));
            }
            if keep && looks_like_json(&doc) {
                scan.docs.insert(key.clone(), doc);
            } else {
                scan.docs.remove(&key);
            }
            scan.links.remove(&key);
            scan.files.insert(
                key,
                FileInfo {
                    ordinal,
                    raw_path: raw.to_string(),
                    digest: format!("sha256:{hex}"),
                    size,
                    head,
                },
            );
        } else if kind.is_symlink() || kind.is_hard_link() {
            let target = entry
                .link_name_bytes()
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default();
            // A symbolic link is relative to its own directory (`docker
            // save` links `<id>/layer.tar` to `../<other>/layer.tar`); a
            // hard link names a path from the archive's root.
            let target = if kind.is_symlink() && !target.starts_with('/') {
                let dir = key.rsplit_once('/').map(|(d, _)| d).unwrap_or("");
                normalize_path(&format!("{dir}/{target}"))
            } else {
                normalize_path(&target)
            };
            scan.files.remove(&key);
            scan.docs.remove(&key);
            scan.links.insert(key, target);
        }
        // Directories (`./`, `blobs/`, `blobs/sha256/`) and anything else
        // carry nothing an image needs.
        Ok(true)
    })?;
    Ok(scan)
}

fn looks_like_json(data: &[u8]) -> bool {
    matches!(
        data.iter().find(|b| !b.is_ascii_whitespace()),
        Some(b'{') | Some(b'[')
    )
}

impl Scan {
    /// The normalized path of the file `path` names, following links.
    fn resolve(&self, path: &str) -> Option<String> {
        let mut p = normalize_path(path);
        for _ in 0..16 {
            if self.files.contains_key(&p) {
                return Some(p);
            }
            p = self.links.get(&p)?.clone();
        }
        None
    }

    fn file(&self, path: &str) -> Option<&FileInfo> {
        self.resolve(path).and_then(|p| self.files.get(&p))
    }

    fn doc(&self, path: &str) -> Option<&[u8]> {
        self.resolve(path)
            .and_then(|p| self.docs.get(&p))
            .map(Vec::as_slice)
    }

    fn has(&self, path: &str) -> bool {
        self.resolve(path).is_some()
    }
}

/// The parts of an image config the import reads.
#[derive(Deserialize)]
struct PlatformConfig {
    #[serde(default)]
    os: String,
    #[serde(default)]
    architecture: String,
    rootfs: Option<RootfsConfig>,
}

#[derive(Deserialize)]
struct RootfsConfig {
    #[serde(default)]
    diff_ids: Vec<String>,
}

/// One element of a `docker save` `manifest.json`.
#[derive(Deserialize)]
struct DockerSaveEntry {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "RepoTags", default)]
    repo_tags: Option<Vec<String>>,
    #[serde(rename = "Layers", default)]
    layers: Vec<String>,
}

/// One image the archive offers, before a platform is chosen.
struct Candidate {
    /// Full references the archive gives it, normalized.
    names: Vec<String>,
    /// Bare tags (`v1`): a reference without its repository.
    tags: Vec<String>,
    /// `os/arch` when known without reading further (the descriptor's
    /// platform, or the config's); `None` for an index of platforms.
    platform: Option<String>,
    source: Source,
    /// How to name it in messages.
    label: String,
}

enum Source {
    Layout(RawDescriptor),
    DockerSave(usize),
}

fn host_platform() -> String {
    format!("linux/{}", host_arch())
}

/// Second step: decides, from the first pass alone, which images the
/// archive holds, which of them to import (the host's platform), under
/// which names, and which blobs that takes.
pub(super) fn plan(scan: &Scan, name: Option<&ImageRef>) -> Result<Plan> {
    let mut builder = Builder {
        scan,
        blobs: BTreeMap::new(),
        synthesized: Vec::new(),
    };
    // An OCI layout wins over a `manifest.json` beside it (Docker ≥ 25
    // writes both; the layout is the complete one).
    let (candidates, docker_save) = if let Some(index) = scan.doc("index.json") {
        (layout_candidates(scan, index)?, Vec::new())
    } else if scan.has("index.json") {
        return Err(entry_err("index.json", "not a JSON document"));
    } else if let Some(manifest) = scan.doc("manifest.json") {
        docker_save_candidates(scan, manifest)?
    } else if scan.has("manifest.json") {
        return Err(entry_err("manifest.json", "not a JSON document"));
    } else {
        return Err(ArchiveError::Content(format!(
            "not an image archive: it has neither index.json (OCI image layout) nor manifest.json (docker save); it starts with {}",
            scan.first_paths.join(", ")
        )));
    };
    let chosen = choose_platform(candidates)?;
    let names = assign_names(&chosen, name)?;
    let mut images = Vec::new();
    for (c, names) in chosen.into_iter().zip(names) {
        let (target, platform) = match &c.source {
            Source::Layout(d) => builder.walk(d, &c.label, 0)?,
            Source::DockerSave(i) => builder.docker_save_image(&docker_save[*i], &c.label)?,
        };
        images.push(PlannedImage {
            names,
            target,
            platform,
        });
    }
    // The same name for two different images would leave the last one
    // written under it: refuse rather than pick.
    let mut seen: HashMap<&str, &str> = HashMap::new();
    for img in &images {
        for n in &img.names {
            if let Some(other) = seen.insert(n, &img.target.digest)
                && other != img.target.digest
            {
                return Err(ArchiveError::Content(format!(
                    "the archive names two different images {n} ({other} and {})",
                    img.target.digest
                )));
            }
        }
    }
    let scan = builder.scan;
    let mut from_archive = BTreeMap::new();
    for blob in builder.blobs.into_values() {
        let info = scan
            .files
            .values()
            .find(|f| f.digest == blob.digest)
            .expect("planned blobs come from scanned files");
        from_archive.insert(info.ordinal, blob);
    }
    Ok(Plan {
        from_archive,
        synthesized: builder.synthesized,
        images,
    })
}

/// The names an index entry's annotations give.
fn annotated_names(d: &RawDescriptor) -> (Vec<String>, Vec<String>) {
    let ann = d.annotations.clone().unwrap_or_default();
    let mut names = Vec::new();
    let mut tags = Vec::new();
    if let Some(n) = ann.get(ANN_CONTAINERD_NAME)
        && let Ok(r) = ImageRef::parse(n)
    {
        names.push(r.to_string());
    }
    if let Some(n) = ann.get(ANN_REF_NAME) {
        // Per the OCI spec usually a tag; skopeo and containerd write a
        // full reference there when given one.
        if n.contains(['/', ':', '@']) {
            if let Ok(r) = ImageRef::parse(n)
                && !names.contains(&r.to_string())
            {
                names.push(r.to_string());
            }
        } else if names.is_empty() {
            tags.push(n.clone());
        }
    }
    (names, tags)
}

fn is_index(media_type: &str, doc: &RawManifest) -> bool {
    media_type == MT_OCI_INDEX
        || media_type == MT_DOCKER_LIST
        || matches!(
            doc.media_type.as_deref(),
            Some(MT_OCI_INDEX | MT_DOCKER_LIST)
        )
        || (doc.manifests.is_some() && doc.config.is_none())
}

fn blob_path(digest: &str) -> String {
    match digest.split_once(':') {
        Some((alg, hex)) => format!("blobs/{alg}/{hex}"),
        None => format!("blobs/{digest}"),
    }
}

fn layout_candidates(scan: &Scan, index: &[u8]) -> Result<Vec<Candidate>> {
    let index: RawManifest = serde_json::from_slice(index)
        .map_err(|e| entry_err("index.json", format!("not a valid image index: {e}")))?;
    let entries = index.manifests.unwrap_or_default();
    if entries.is_empty() {
        return Err(entry_err("index.json", "lists no image"));
    }
    let mut out = Vec::new();
    for (i, d) in entries.into_iter().enumerate() {
        let (names, tags) = annotated_names(&d);
        // The platform: the descriptor's, else (for a manifest in the
        // archive) its config's. An index has no one platform.
        let platform = match &d.platform {
            Some(p) => Some(format!("{}/{}", p.os, p.architecture)),
            None => scan
                .doc(&blob_path(&d.digest))
                .and_then(|m| serde_json::from_slice::<RawManifest>(m).ok())
                .filter(|m| !is_index(&d.media_type, m))
                .and_then(|m| m.config)
                .and_then(|c| scan.doc(&blob_path(&c.digest)))
                .and_then(|c| serde_json::from_slice::<PlatformConfig>(c).ok())
                .filter(|c| !c.os.is_empty())
                .map(|c| format!("{}/{}", c.os, c.architecture)),
        };
        let label = match (names.first(), tags.first()) {
            (Some(n), _) => format!("index.json manifests[{i}] ({n})"),
            (None, Some(t)) => format!("index.json manifests[{i}] (tag {t})"),
            _ => format!("index.json manifests[{i}]"),
        };
        out.push(Candidate {
            names,
            tags,
            platform,
            source: Source::Layout(d),
            label,
        });
    }
    Ok(out)
}

fn docker_save_candidates(
    scan: &Scan,
    manifest: &[u8],
) -> Result<(Vec<Candidate>, Vec<DockerSaveEntry>)> {
    let entries: Vec<DockerSaveEntry> = serde_json::from_slice(manifest)
        .map_err(|e| entry_err("manifest.json", format!("not a docker save manifest: {e}")))?;
    if entries.is_empty() {
        return Err(entry_err("manifest.json", "lists no image"));
    }
    let mut out = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        let mut names = Vec::new();
        for t in e.repo_tags.iter().flatten() {
            let r = ImageRef::parse(t)
                .map_err(|err| entry_err("manifest.json", format!("image {i}: RepoTags: {err}")))?;
            names.push(r.to_string());
        }
        let platform = scan
            .doc(&e.config)
            .and_then(|c| serde_json::from_slice::<PlatformConfig>(c).ok())
            .filter(|c| !c.os.is_empty())
            .map(|c| format!("{}/{}", c.os, c.architecture));
        let label = match names.first() {
            Some(n) => format!("manifest.json image {i} ({n})"),
            None => format!("manifest.json image {i} ({})", e.config),
        };
        out.push(Candidate {
            names,
            tags: Vec::new(),
            platform,
            source: Source::DockerSave(i),
            label,
        });
    }
    Ok((out, entries))
}

/// Keeps, of the images that share a name (or of the unnamed ones), those
/// that run here: another platform's manifest is dropped when the host's
/// is there, and an image that exists only for other platforms is an
/// error (it could not run here).
fn choose_platform(candidates: Vec<Candidate>) -> Result<Vec<Candidate>> {
    let host = host_platform();
    let mut groups: Vec<(String, Vec<Candidate>)> = Vec::new();
    for c in candidates {
        let key = c
            .names
            .first()
            .or(c.tags.first())
            .cloned()
            .unwrap_or_default();
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(c),
            None => groups.push((key, vec![c])),
        }
    }
    let mut out = Vec::new();
    for (key, group) in groups {
        let foreign: BTreeSet<String> = group
            .iter()
            .filter_map(|c| c.platform.clone())
            .filter(|p| *p != host)
            .collect();
        let runnable: Vec<Candidate> = group
            .into_iter()
            .filter(|c| c.platform.as_deref().is_none_or(|p| p == host))
            .collect();
        if runnable.is_empty() {
            let what = if key.is_empty() {
                "the archive's image".to_string()
            } else {
                format!("image {key}")
            };
            return Err(ArchiveError::Content(format!(
                "{what} is for {} only; this machine runs {host}",
                foreign.into_iter().collect::<Vec<_>>().join(", ")
            )));
        }
        if runnable.len() > 1 && !key.is_empty() {
            return Err(ArchiveError::Content(format!(
                "the archive has {} {host} images named {key}: {}",
                runnable.len(),
                runnable
                    .iter()
                    .map(|c| c.label.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        out.extend(runnable);
    }
    Ok(out)
}

/// The names each chosen image is created under. `--name` names the image
/// of a one-image archive (instead of the archive's names); in an archive
/// of several it names the one image the archive leaves unnamed, and gives
/// its repository to images the archive tags without one.
fn assign_names(images: &[Candidate], name: Option<&ImageRef>) -> Result<Vec<Vec<String>>> {
    if let (Some(n), [_]) = (name, images) {
        return Ok(vec![vec![n.to_string()]]);
    }
    let mut out = Vec::new();
    let mut unnamed: Vec<&str> = Vec::new();
    for c in images {
        if !c.names.is_empty() {
            out.push(c.names.clone());
        } else if !c.tags.is_empty() {
            let Some(repo) = name.and_then(ImageRef::repository) else {
                return Err(ArchiveError::Content(format!(
                    "{} has only the tag {:?}, no repository: give one with --name (e.g. --name example/image)",
                    c.label, c.tags[0]
                )));
            };
            let mut names = Vec::new();
            for t in &c.tags {
                let r = ImageRef::parse(&format!("{repo}:{t}"))
                    .map_err(|e| ArchiveError::Content(format!("{}: tag {t:?}: {e}", c.label)))?;
                names.push(r.to_string());
            }
            out.push(names);
        } else {
            unnamed.push(&c.label);
            out.push(name.map(|n| vec![n.to_string()]).unwrap_or_default());
        }
    }
    match (unnamed.len(), name) {
        (0, _) | (1, Some(_)) => Ok(out),
        (_, None) => Err(ArchiveError::Content(format!(
            "the archive does not name {}: name it with --name",
            unnamed.join(", ")
        ))),
        (_, Some(_)) => Err(ArchiveError::Content(format!(
            "the archive leaves {} images unnamed ({}); --name can name only one",
            unnamed.len(),
            unnamed.join(", ")
        ))),
    }
}

/// Collects the blobs the chosen images need, with their GC labels.
struct Builder<'a> {
    scan: &'a Scan,
    /// By digest: a blob several images share is written once.
    blobs: BTreeMap<String, PlannedBlob>,
    synthesized: Vec<(PlannedBlob, Vec<u8>)>,
}

impl Builder<'_> {
    /// The archive's file for `digest`, checked against the size a
    /// descriptor declares; `trail` says who refers to it.
    fn need(&mut self, digest: &str, size: i64, trail: &str) -> Result<&FileInfo> {
        if !digest.starts_with("sha256:") {
            return Err(ArchiveError::Content(format!(
                "{trail}: digest {digest}: only sha256 blobs are supported"
            )));
        }
        let path = blob_path(digest);
        let info = self.scan.file(&path).ok_or_else(|| {
            ArchiveError::Content(format!(
                "{trail}: blob {digest} is missing from the archive (no {path})"
            ))
        })?;
        if size >= 0 && info.size != size as u64 {
            return Err(entry_err(
                &info.raw_path,
                format!(
                    "{} bytes, but {trail} says {size}: the archive is inconsistent",
                    info.size
                ),
            ));
        }
        Ok(info)
    }

    fn add(&mut self, digest: &str, size: u64, labels: BTreeMap<String, String>) {
        let blob = self
            .blobs
            .entry(digest.to_string())
            .or_insert_with(|| PlannedBlob {
                digest: digest.to_string(),
                size,
                labels: BTreeMap::new(),
            });
        blob.labels.extend(labels);
    }

    fn json<T: for<'de> Deserialize<'de>>(&self, digest: &str, trail: &str) -> Result<T> {
        let path = blob_path(digest);
        let raw = self.scan.file(&path).map(|f| f.raw_path.clone());
        let doc = self.scan.doc(&path).ok_or_else(|| {
            entry_err(
                raw.as_deref().unwrap_or(&path),
                format!("{trail} refers to it as a JSON document, but it is not one"),
            )
        })?;
        serde_json::from_slice(doc).map_err(|e| {
            entry_err(
                raw.as_deref().unwrap_or(&path),
                format!("not a valid document for {trail}: {e}"),
            )
        })
    }

    /// Follows an index entry down to the host's manifest; returns the
    /// image's target and platform.
    fn walk(
        &mut self,
        d: &RawDescriptor,
        trail: &str,
        depth: usize,
    ) -> Result<(Descriptor, String)> {
        if depth > MAX_DEPTH {
            return Err(ArchiveError::Content(format!(
                "{trail}: indexes nest deeper than {MAX_DEPTH}"
            )));
        }
        self.need(&d.digest, d.size, trail)?;
        let doc: RawManifest = self.json(&d.digest, trail)?;
        let index = is_index(&d.media_type, &doc);
        let media_type = if !d.media_type.is_empty() {
            d.media_type.clone()
        } else if let Some(mt) = &doc.media_type {
            mt.clone()
        } else if index {
            MT_OCI_INDEX.to_string()
        } else {
            MT_OCI_MANIFEST.to_string()
        };
        let target = Descriptor {
            media_type,
            digest: d.digest.clone(),
            size: d.size,
            annotations: Default::default(),
        };
        if index {
            let children = doc.manifests.unwrap_or_default();
            let host = host_platform();
            let (i, child) = self.pick_child(&children).ok_or_else(|| {
                let have: BTreeSet<String> = children
                    .iter()
                    .filter_map(|c| c.platform.as_ref())
                    .map(|p| format!("{}/{}", p.os, p.architecture))
                    .collect();
                ArchiveError::Content(format!(
                    "{trail}: the index {} has no manifest for {host} (it has {})",
                    d.digest,
                    if have.is_empty() {
                        "none that says its platform".to_string()
                    } else {
                        have.into_iter().collect::<Vec<_>>().join(", ")
                    }
                ))
            })?;
            let child = child.clone();
            let (_, platform) =
                self.walk(&child, &format!("{trail} → {}", child.digest), depth + 1)?;
            // Only the host's manifest is imported: the other platforms'
            // content is not needed here (and often not in the archive).
            let labels =
                BTreeMap::from([(format!("{GC_REF_CONTENT}.m.{i}"), child.digest.clone())]);
            self.add(&d.digest, d.size as u64, labels);
            return Ok((target, platform));
        }
        let config = doc.config.ok_or_else(|| {
            ArchiveError::Content(format!("{trail}: manifest {} has no config", d.digest))
        })?;
        let config_trail = format!("{trail} → config");
        self.need(&config.digest, config.size, &config_trail)?;
        let cfg: PlatformConfig = self.json(&config.digest, &config_trail)?;
        let layers = doc.layers.unwrap_or_default();
        let diff_ids = cfg.rootfs.map(|r| r.diff_ids).unwrap_or_default();
        if layers.is_empty() || diff_ids.len() != layers.len() {
            return Err(ArchiveError::Content(format!(
                "{trail}: manifest {} lists {} layers but its config {} diff ids",
                d.digest,
                layers.len(),
                diff_ids.len()
            )));
        }
        let mut labels =
            BTreeMap::from([(format!("{GC_REF_CONTENT}.config"), config.digest.clone())]);
        self.add(&config.digest, config.size as u64, BTreeMap::new());
        for (i, l) in layers.iter().enumerate() {
            self.need(&l.digest, l.size, &format!("{trail} → layer {i}"))?;
            self.add(&l.digest, l.size as u64, BTreeMap::new());
            labels.insert(format!("{GC_REF_CONTENT}.l.{i}"), l.digest.clone());
        }
        self.add(&d.digest, d.size as u64, labels);
        let platform = if cfg.os.is_empty() {
            d.platform
                .as_ref()
                .map(|p| format!("{}/{}", p.os, p.architecture))
                .unwrap_or_else(host_platform)
        } else {
            format!("{}/{}", cfg.os, cfg.architecture)
        };
        if platform != host_platform() {
            return Err(ArchiveError::Content(format!(
                "{trail}: manifest {} is for {platform}; this machine runs {}",
                d.digest,
                host_platform()
            )));
        }
        Ok((target, platform))
    }

    /// The host's manifest in an index: by the entries' platforms, else
    /// (when no entry says) by each manifest's config.
    fn pick_child<'c>(&self, children: &'c [RawDescriptor]) -> Option<(usize, &'c RawDescriptor)> {
        let host = host_platform();
        let said = children.iter().enumerate().find(|(_, c)| {
            c.platform
                .as_ref()
                .is_some_and(|p| format!("{}/{}", p.os, p.architecture) == host)
        });
        if said.is_some() || children.iter().any(|c| c.platform.is_some()) {
            return said;
        }
        children.iter().enumerate().find(|(_, c)| {
            self.scan
                .doc(&blob_path(&c.digest))
                .and_then(|m| serde_json::from_slice::<RawManifest>(m).ok())
                .and_then(|m| m.config)
                .and_then(|cfg| self.scan.doc(&blob_path(&cfg.digest)))
                .and_then(|cfg| serde_json::from_slice::<PlatformConfig>(cfg).ok())
                .is_some_and(|cfg| format!("{}/{}", cfg.os, cfg.architecture) == host)
        })
    }

    /// A legacy `docker save` image has a config and layer files but no
    /// manifest: write one (OCI), whose digest then names the image.
    fn docker_save_image(
        &mut self,
        e: &DockerSaveEntry,
        trail: &str,
    ) -> Result<(Descriptor, String)> {
        let config = self.scan.file(&e.config).cloned().ok_or_else(|| {
            ArchiveError::Content(format!(
                "{trail}: its config {} is missing from the archive",
                e.config
            ))
        })?;
        let doc = self.scan.doc(&e.config).ok_or_else(|| {
            entry_err(
                &config.raw_path,
                format!("{trail} refers to it as its config, but it is not JSON"),
            )
        })?;
        let cfg: PlatformConfig = serde_json::from_slice(doc).map_err(|err| {
            entry_err(&config.raw_path, format!("not a valid image config: {err}"))
        })?;
        let diff_ids = cfg.rootfs.map(|r| r.diff_ids).unwrap_or_default();
        if e.layers.is_empty() || diff_ids.len() != e.layers.len() {
            return Err(ArchiveError::Content(format!(
                "{trail}: manifest.json lists {} layers but its config {} diff ids",
                e.layers.len(),
                diff_ids.len()
            )));
        }
        // A config that does not say is taken to be for this machine (as
        // `docker load` does).
        let platform = if cfg.os.is_empty() {
            host_platform()
        } else {
            format!("{}/{}", cfg.os, cfg.architecture)
        };
        if platform != host_platform() {
            return Err(ArchiveError::Content(format!(
                "{trail} is for {platform}; this machine runs {}",
                host_platform()
            )));
        }
        let mut layers = Vec::new();
        for (i, path) in e.layers.iter().enumerate() {
            let layer = self.scan.file(path).cloned().ok_or_else(|| {
                ArchiveError::Content(format!(
                    "{trail}: layer {i} ({path}) is missing from the archive"
                ))
            })?;
            let media_type = if layer.head.starts_with(&[0x1f, 0x8b]) {
                MediaType::ImageLayerGzip
            } else if layer.head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
                MediaType::ImageLayerZstd
            } else {
                MediaType::ImageLayer
            };
            self.add(&layer.digest, layer.size, BTreeMap::new());
            layers.push(oci_descriptor(media_type, &layer, trail)?);
        }
        self.add(&config.digest, config.size, BTreeMap::new());
        let config = oci_descriptor(MediaType::ImageConfig, &config, trail)?;
        let (manifest, labels) = synthesize_manifest(config, layers, trail)?;
        let digest = format!("sha256:{}", hex::encode(Sha256::digest(&manifest)));
        if !self.synthesized.iter().any(|(b, _)| b.digest == digest) {
            self.synthesized.push((
                PlannedBlob {
                    digest: digest.clone(),
                    size: manifest.len() as u64,
                    labels,
                },
                manifest.clone(),
            ));
        }
        Ok((
            Descriptor {
                media_type: MT_OCI_MANIFEST.to_string(),
                digest,
                size: manifest.len() as i64,
                annotations: Default::default(),
            },
            platform,
        ))
    }
}

/// An archive file as an OCI descriptor (its digest is one [`scan`]
/// computed, so it always parses).
fn oci_descriptor(media_type: MediaType, file: &FileInfo, trail: &str) -> Result<OciDescriptor> {
    let digest: OciDigest = file
        .digest
        .parse()
        .map_err(|e| ArchiveError::Content(format!("{trail}: digest {}: {e}", file.digest)))?;
    Ok(OciDescriptor::new(media_type, file.size, digest))
}

/// The OCI manifest of a legacy `docker save` image, and the GC labels from
/// it to its config and layers. Its digest names the image, so its bytes
/// must stay what sandbolt has always written: it goes through
/// `serde_json::Value`, whose keys are sorted (a test pins the bytes).
fn synthesize_manifest(
    config: OciDescriptor,
    layers: Vec<OciDescriptor>,
    trail: &str,
) -> Result<(Vec<u8>, BTreeMap<String, String>)> {
    let mut labels = BTreeMap::from([(
        format!("{GC_REF_CONTENT}.config"),
        config.digest().to_string(),
    )]);
    for (i, l) in layers.iter().enumerate() {
        labels.insert(format!("{GC_REF_CONTENT}.l.{i}"), l.digest().to_string());
    }
    let manifest = ImageManifestBuilder::default()
        .schema_version(SCHEMA_VERSION)
        .media_type(MediaType::ImageManifest)
        .config(config)
        .layers(layers)
        .build()
        .map_err(|e| ArchiveError::Content(format!("{trail}: manifest: {e}")))?;
    let bytes = serde_json::to_value(&manifest)
        .and_then(|v| serde_json::to_vec(&v))
        .map_err(|e| ArchiveError::Content(format!("{trail}: manifest: {e}")))?;
    Ok((bytes, labels))
}

/// One step of the second pass.
pub(super) enum Piece {
    /// A planned blob's data starts (`PlannedBlob` from the plan).
    Start(PlannedBlob),
    Data(Vec<u8>),
    End,
}

/// Second pass: hands the planned blobs' data over in chunks, in archive
/// order. `send` returning false stops the pass (the receiver gave up).
pub(super) fn stream_blobs(
    path: &Path,
    wanted: &BTreeMap<usize, PlannedBlob>,
    progress: Arc<dyn ImportProgress>,
    mut send: impl FnMut(Piece) -> bool,
) -> Result<()> {
    let reader = open(path, progress)?;
    let Some(&last) = wanted.keys().next_back() else {
        return Ok(());
    };
    let mut stopped = false;
    for_each_entry(reader, |ordinal, raw, entry| {
        let Some(blob) = wanted.get(&ordinal) else {
            return Ok(ordinal < last);
        };
        let size = entry.size();
        if size != blob.size {
            return Err(entry_err(
                raw,
                "changed while it was being imported: run the import again",
            ));
        }
        if !send(Piece::Start(blob.clone())) {
            stopped = true;
            return Ok(false);
        }
        let mut data = Vec::with_capacity(CHUNK);
        read_entry(raw, entry, size, |mut bytes| {
            while !bytes.is_empty() {
                let take = (CHUNK - data.len()).min(bytes.len());
                data.extend_from_slice(&bytes[..take]);
                bytes = &bytes[take..];
                if data.len() == CHUNK {
                    let full = std::mem::replace(&mut data, Vec::with_capacity(CHUNK));
                    if !send(Piece::Data(full)) {
                        stopped = true;
                        return Err(ArchiveError::Content("stopped".into()));
                    }
                }
            }
            Ok(())
        })
        .or_else(|e| if stopped { Ok(()) } else { Err(e) })?;
        if stopped {
            return Ok(false);
        }
        if (!data.is_empty() && !send(Piece::Data(data))) || !send(Piece::End) {
            stopped = true;
            return Ok(false);
        }
        // Nothing after the last wanted entry needs reading.
        Ok(ordinal < last)
    })
}

#[cfg(test)]
mod props;

#[cfg(test)]
mod tests {
    use super::*;

    const MT_OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
    const MT_OCI_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";
    const MT_OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";

    /// What one test archive entry is.
    enum E<'a> {
        Dir,
        File(&'a [u8]),
        Link(&'a str),
    }
    use E::{Dir, File as F, Link};

    /// A tar in memory.
    fn tar_of(entries: &[(&str, E<'_>)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, what) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o644);
            h.set_mtime(0);
            match what {
                Dir => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    b.append_data(&mut h, path, std::io::empty()).unwrap();
                }
                F(data) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(data.len() as u64);
                    b.append_data(&mut h, path, *data).unwrap();
                }
                Link(target) => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_size(0);
                    b.append_link(&mut h, path, target).unwrap();
                }
            }
        }
        b.into_inner().unwrap()
    }

    fn digest(data: &[u8]) -> String {
        format!("sha256:{}", hex::encode(Sha256::digest(data)))
    }

    fn blob(data: &[u8]) -> String {
        format!("./blobs/sha256/{}", &digest(data)[7..])
    }

    struct Layout {
        layer: Vec<u8>,
        config: Vec<u8>,
        manifest: Vec<u8>,
    }

    fn layout(arch: &str) -> Layout {
        let layer = format!("not really a tar, {arch}").into_bytes();
        let config = serde_json::to_vec(&serde_json::json!({
            "os": "linux", "architecture": arch,
            "rootfs": {"type": "layers", "diff_ids": [digest(&layer)]},
        }))
        .unwrap();
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2, "mediaType": MT_OCI_MANIFEST,
            "config": {"mediaType": MT_OCI_CONFIG, "digest": digest(&config), "size": config.len()},
            "layers": [{"mediaType": MT_OCI_LAYER, "digest": digest(&layer), "size": layer.len()}],
        }))
        .unwrap();
        Layout {
            layer,
            config,
            manifest,
        }
    }

    fn plan_of(tar: &[u8], name: Option<&str>) -> Result<Plan> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.tar");
        std::fs::write(&path, tar).unwrap();
        let scan = scan(&path, Arc::new(NoProgress))?;
        let name = name.map(|n| ImageRef::parse(n).unwrap());
        plan(&scan, name.as_ref())
    }

    fn index_of(entries: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({"schemaVersion": 2, "manifests": entries})).unwrap()
    }

    #[test]
    fn paths_are_normalized() {
        assert_eq!(normalize_path("./blobs//sha256/ab"), "blobs/sha256/ab");
        assert_eq!(normalize_path("blobs/sha256/"), "blobs/sha256");
        assert_eq!(normalize_path("a/../b/./c"), "b/c");
        assert_eq!(normalize_path("../../x"), "x");
    }

    #[test]
    fn directory_entries_and_dot_prefixes_are_no_blobs() {
        let l = layout(host_arch());
        let index = index_of(serde_json::json!([{
            "mediaType": MT_OCI_MANIFEST, "digest": digest(&l.manifest), "size": l.manifest.len(),
            "annotations": {ANN_REF_NAME: "example.com/x:1"},
        }]));
        let tar = tar_of(&[
            ("./", Dir),
            ("./blobs/", Dir),
            ("./blobs/sha256/", Dir),
            (&blob(&l.layer), F(&l.layer)),
            (&blob(&l.config), F(&l.config)),
            (&blob(&l.manifest), F(&l.manifest)),
            ("./index.json", F(&index)),
            ("./oci-layout", F(br#"{"imageLayoutVersion":"1.0.0"}"#)),
        ]);
        let plan = plan_of(&tar, None).unwrap();
        assert_eq!(plan.images.len(), 1);
        assert_eq!(plan.images[0].names, vec!["example.com/x:1".to_string()]);
        assert_eq!(plan.images[0].target.digest, digest(&l.manifest));
        let planned: BTreeSet<_> = plan
            .from_archive
            .values()
            .map(|b| b.digest.clone())
            .collect();
        assert_eq!(
            planned,
            BTreeSet::from([digest(&l.layer), digest(&l.config), digest(&l.manifest)])
        );
        let m = plan
            .from_archive
            .values()
            .find(|b| b.digest == digest(&l.manifest))
            .unwrap();
        assert_eq!(m.labels[&format!("{GC_REF_CONTENT}.l.0")], digest(&l.layer));
    }

    #[test]
    fn a_blob_whose_content_does_not_match_its_name_is_named() {
        let tar = tar_of(&[(
            "blobs/sha256/0000000000000000000000000000000000000000000000000000000000000000",
            F(b"x"),
        )]);
        let err = plan_of(&tar, None).unwrap_err().to_string();
        assert!(err.starts_with("entry blobs/sha256/0000"), "{err}");
        assert!(err.contains("corrupt"), "{err}");
    }

    #[test]
    fn the_host_platform_is_chosen_from_a_flat_index_and_named_by_flag() {
        let ours = layout(host_arch());
        let other = layout("s390x");
        let index = index_of(serde_json::json!([
            {"mediaType": MT_OCI_MANIFEST, "digest": digest(&other.manifest), "size": other.manifest.len(),
             "platform": {"os": "linux", "architecture": "s390x"}},
            {"mediaType": MT_OCI_MANIFEST, "digest": digest(&ours.manifest), "size": ours.manifest.len(),
             "platform": {"os": "linux", "architecture": host_arch()}},
        ]));
        // The other platform's blobs are not even in the archive.
        let tar = tar_of(&[
            (&blob(&ours.layer), F(&ours.layer)),
            (&blob(&ours.config), F(&ours.config)),
            (&blob(&ours.manifest), F(&ours.manifest)),
            ("index.json", F(&index)),
        ]);
        let err = plan_of(&tar, None).unwrap_err().to_string();
        assert!(err.contains("--name"), "{err}");
        let plan = plan_of(&tar, Some("multi")).unwrap();
        assert_eq!(plan.images.len(), 1);
        assert_eq!(
            plan.images[0].names,
            vec!["docker.io/library/multi:latest".to_string()]
        );
        assert_eq!(plan.images[0].target.digest, digest(&ours.manifest));
    }

    #[test]
    fn a_nested_index_keeps_its_digest_and_imports_only_the_host_manifest() {
        let ours = layout(host_arch());
        let other = layout("arm64");
        let inner = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2, "mediaType": MT_OCI_INDEX,
            "manifests": [
                {"mediaType": MT_OCI_MANIFEST, "digest": digest(&other.manifest), "size": other.manifest.len(),
                 "platform": {"os": "linux", "architecture": "arm64"}},
                {"mediaType": MT_OCI_MANIFEST, "digest": digest(&ours.manifest), "size": ours.manifest.len(),
                 "platform": {"os": "linux", "architecture": host_arch()}},
            ],
        }))
        .unwrap();
        let index = index_of(serde_json::json!([{
            "mediaType": MT_OCI_INDEX, "digest": digest(&inner), "size": inner.len(),
            "annotations": {ANN_REF_NAME: "v2"},
        }]));
        let tar = tar_of(&[
            (&blob(&other.layer), F(&other.layer)),
            (&blob(&other.config), F(&other.config)),
            (&blob(&other.manifest), F(&other.manifest)),
            (&blob(&ours.layer), F(&ours.layer)),
            (&blob(&ours.config), F(&ours.config)),
            (&blob(&ours.manifest), F(&ours.manifest)),
            (&blob(&inner), F(&inner)),
            ("index.json", F(&index)),
        ]);
        // A bare tag needs a repository.
        let err = plan_of(&tar, None).unwrap_err().to_string();
        assert!(
            err.contains("tag \"v2\"") && err.contains("--name"),
            "{err}"
        );
        // One image: --name names it.
        let plan = plan_of(&tar, Some("example.com/multi")).unwrap();
        assert_eq!(
            plan.images[0].names,
            vec!["example.com/multi:latest".to_string()]
        );
        assert_eq!(plan.images[0].target.digest, digest(&inner));
        assert_eq!(plan.images[0].target.media_type, MT_OCI_INDEX);
        let planned: BTreeSet<_> = plan
            .from_archive
            .values()
            .map(|b| b.digest.clone())
            .collect();
        assert!(!planned.contains(&digest(&other.manifest)), "{planned:?}");
        assert!(planned.contains(&digest(&ours.layer)), "{planned:?}");
    }

    #[test]
    fn an_image_for_another_platform_only_is_refused() {
        let other = layout("s390x");
        let index = index_of(serde_json::json!([{
            "mediaType": MT_OCI_MANIFEST, "digest": digest(&other.manifest), "size": other.manifest.len(),
            "annotations": {ANN_CONTAINERD_NAME: "docker.io/library/foreign:1"},
        }]));
        let tar = tar_of(&[
            (&blob(&other.layer), F(&other.layer)),
            (&blob(&other.config), F(&other.config)),
            (&blob(&other.manifest), F(&other.manifest)),
            ("index.json", F(&index)),
        ]);
        let err = plan_of(&tar, None).unwrap_err().to_string();
        assert!(err.contains("linux/s390x only"), "{err}");
    }

    #[test]
    fn a_missing_blob_names_what_refers_to_it() {
        let l = layout(host_arch());
        let index = index_of(serde_json::json!([{
            "mediaType": MT_OCI_MANIFEST, "digest": digest(&l.manifest), "size": l.manifest.len(),
            "annotations": {ANN_REF_NAME: "example.com/x:1"},
        }]));
        let tar = tar_of(&[
            (&blob(&l.config), F(&l.config)),
            (&blob(&l.manifest), F(&l.manifest)),
            ("index.json", F(&index)),
        ]);
        let err = plan_of(&tar, None).unwrap_err().to_string();
        assert!(
            err.contains("layer 0") && err.contains(&digest(&l.layer)) && err.contains("missing"),
            "{err}"
        );
    }

    #[test]
    fn docker_save_layers_behind_symlinks_are_found() {
        let l = layout(host_arch());
        let manifest = serde_json::to_vec(&serde_json::json!([
            {"Config": "cfg.json", "RepoTags": ["sandbolt/a:1"], "Layers": ["aaa/layer.tar"]},
            {"Config": "cfg.json", "RepoTags": ["sandbolt/b:2"], "Layers": ["bbb/layer.tar"]},
        ]))
        .unwrap();
        let tar = tar_of(&[
            ("aaa/", Dir),
            ("aaa/layer.tar", Link("../bbb/layer.tar")),
            ("bbb/", Dir),
            ("bbb/layer.tar", F(&l.layer)),
            ("cfg.json", F(&l.config)),
            ("manifest.json", F(&manifest)),
        ]);
        let plan = plan_of(&tar, None).unwrap();
        let names: Vec<_> = plan.images.iter().flat_map(|i| i.names.clone()).collect();
        assert_eq!(
            names,
            vec!["docker.io/sandbolt/a:1", "docker.io/sandbolt/b:2"]
        );
        // One manifest written by sandbolt, shared by both names.
        assert_eq!(plan.synthesized.len(), 1);
        assert_eq!(plan.images[0].target, plan.images[1].target);
        assert_eq!(plan.from_archive.len(), 2);
    }

    /// The manifest written for a legacy `docker save` image names the
    /// image by its digest: its bytes must not change between versions
    /// (a re-import would otherwise retarget the image).
    #[test]
    fn a_synthesized_manifest_keeps_its_bytes() {
        let l = layout(host_arch());
        let gz_layer = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0];
        let config = serde_json::to_vec(&serde_json::json!({
            "os": "linux", "architecture": host_arch(),
            "rootfs": {"type": "layers", "diff_ids": [digest(&l.layer), digest(&gz_layer)]},
        }))
        .unwrap();
        let manifest = serde_json::to_vec(&serde_json::json!([
            {"Config": "cfg.json", "RepoTags": ["sandbolt/a:1"], "Layers": ["a/layer.tar", "b/layer.tar"]},
        ]))
        .unwrap();
        let tar = tar_of(&[
            ("a/layer.tar", F(&l.layer)),
            ("b/layer.tar", F(&gz_layer)),
            ("cfg.json", F(&config)),
            ("manifest.json", F(&manifest)),
        ]);
        let plan = plan_of(&tar, None).unwrap();
        let (blob, bytes) = &plan.synthesized[0];
        let expected = format!(
            concat!(
                r#"{{"config":{{"digest":"{}","mediaType":"{}","size":{}}},"#,
                r#""layers":[{{"digest":"{}","mediaType":"{}","size":{}}},"#,
                r#"{{"digest":"{}","mediaType":"{}","size":{}}}],"#,
                r#""mediaType":"{}","schemaVersion":2}}"#
            ),
            digest(&config),
            MT_OCI_CONFIG,
            config.len(),
            digest(&l.layer),
            MT_OCI_LAYER,
            l.layer.len(),
            digest(&gz_layer),
            MT_OCI_LAYER_GZIP,
            gz_layer.len(),
            MT_OCI_MANIFEST,
        );
        assert_eq!(String::from_utf8_lossy(bytes), expected);
        assert_eq!(blob.digest, digest(expected.as_bytes()));
        assert_eq!(plan.images[0].target.digest, blob.digest);
        assert_eq!(
            blob.labels[&format!("{GC_REF_CONTENT}.l.1")],
            digest(&gz_layer)
        );
    }

    #[test]
    fn not_an_archive_and_truncation_are_clear() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x");
        std::fs::write(&p, b"hello, this is text and not a tar archive at all").unwrap();
        let err = scan(&p, Arc::new(NoProgress)).err().unwrap().to_string();
        assert!(err.starts_with("not a tar archive"), "{err}");

        let l = layout(host_arch());
        let mut tar = tar_of(&[("big", F(&vec![7u8; 5000]))]);
        let _ = &l;
        tar.truncate(512 + 1000);
        std::fs::write(&p, &tar).unwrap();
        let err = scan(&p, Arc::new(NoProgress)).err().unwrap().to_string();
        assert!(
            err.starts_with("entry big:") && err.contains("truncated"),
            "{err}"
        );

        std::fs::write(&p, [0x28, 0xb5, 0x2f, 0xfd, 0, 0]).unwrap();
        let err = scan(&p, Arc::new(NoProgress)).err().unwrap().to_string();
        assert!(err.contains("zstd -d"), "{err}");
    }
}
