//! Container images built locally (no registry is reachable here).
//!
//! An image is a single uncompressed layer: a rootfs tar assembled from
//! host files, wrapped in an OCI image layout (`oci-layout`, `index.json`,
//! `blobs/sha256/...`) that `ctr images import` understands, or handed to
//! Docker's image import as the bare rootfs.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde_json::json;
use sha2::{Digest, Sha256};

use crate::TestbedError;

/// The reference the test busybox image is imported under.
pub const BUSYBOX_REF: &str = "docker.io/library/busybox:latest";

const BUSYBOX_BIN: &str = "/bin/busybox";

#[derive(Clone, Debug)]
enum Entry {
    Dir { mode: u32 },
    File { data: Vec<u8>, mode: u32 },
    Symlink { target: String },
}

/// Media type of an OCI image manifest.
pub const MT_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// Media type of an OCI image index.
pub const MT_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// The JSON documents of an [`OciImage`]: the index (what a tag names)
/// points at the one linux/amd64 manifest, which points at the config and
/// the single uncompressed layer ([`OciImage::rootfs_tar`]).
#[derive(Clone, Debug)]
pub struct OciDocuments {
    pub config: Vec<u8>,
    pub manifest: Vec<u8>,
    pub index: Vec<u8>,
}

/// A locally built single-layer image.
#[derive(Clone, Debug)]
pub struct OciImage {
    reference: String,
    rootfs: Vec<u8>,
    env: Vec<String>,
    cmd: Vec<String>,
    entrypoint: Vec<String>,
    workdir: String,
}

/// Builds an [`OciImage`] file by file.
#[derive(Clone, Debug)]
pub struct OciImageBuilder {
    reference: String,
    entries: BTreeMap<String, Entry>,
    env: Vec<String>,
    cmd: Vec<String>,
    entrypoint: Vec<String>,
    workdir: String,
    error: Option<String>,
}

impl OciImage {
    pub fn builder(reference: impl Into<String>) -> OciImageBuilder {
        OciImageBuilder {
            reference: reference.into(),
            entries: BTreeMap::new(),
            env: vec!["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into()],
            cmd: Vec::new(),
            entrypoint: Vec::new(),
            workdir: String::new(),
            error: None,
        }
    }

    /// The full reference, e.g. `docker.io/library/busybox:latest`.
    pub fn reference(&self) -> &str {
        &self.reference
    }

    /// The uncompressed rootfs layer.
    pub fn rootfs_tar(&self) -> &[u8] {
        &self.rootfs
    }

    /// `sha256:<hex>` of the rootfs layer (its diff id).
    pub fn diff_id(&self) -> String {
        format!("sha256:{}", hex::encode(Sha256::digest(&self.rootfs)))
    }

    /// The image's JSON documents (config, manifest, index), exactly as
    /// [`OciImage::write_oci_archive`] writes them and
    /// [`crate::LocalRegistry`] serves them.
    pub fn documents(&self) -> OciDocuments {
        let diff_id = self.diff_id();
        let mut config_section = serde_json::Map::new();
        config_section.insert("Env".into(), json!(self.env));
        if !self.cmd.is_empty() {
            config_section.insert("Cmd".into(), json!(self.cmd));
        }
        if !self.entrypoint.is_empty() {
            config_section.insert("Entrypoint".into(), json!(self.entrypoint));
        }
        if !self.workdir.is_empty() {
            config_section.insert("WorkingDir".into(), json!(self.workdir));
        }
        let config = serde_json::to_vec(&json!({
            "architecture": "amd64",
            "os": "linux",
            "config": config_section,
            "rootfs": {"type": "layers", "diff_ids": [diff_id]},
            "history": [{"created_by": "sandbolt test bed"}],
        }))
        .expect("static JSON");
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": MT_OCI_MANIFEST,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": sha256_digest(&config),
                "size": config.len(),
            },
            "layers": [{
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": diff_id,
                "size": self.rootfs.len(),
            }],
        }))
        .expect("static JSON");
        let index = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": MT_OCI_INDEX,
            "manifests": [{
                "mediaType": MT_OCI_MANIFEST,
                "digest": sha256_digest(&manifest),
                "size": manifest.len(),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    // containerd reads the first, other tools the second.
                    "io.containerd.image.name": self.reference,
                    "org.opencontainers.image.ref.name": self.reference,
                },
            }],
        }))
        .expect("static JSON");
        OciDocuments {
            config,
            manifest,
            index,
        }
    }

    /// Writes the image as an OCI image layout tar.
    pub fn write_oci_archive(&self, path: &Path) -> Result<(), TestbedError> {
        let OciDocuments {
            config,
            manifest,
            index,
        } = self.documents();
        let file = fs::File::create(path).map_err(TestbedError::io(path))?;
        let mut tar = tar::Builder::new(file);
        let blob = |data: &[u8]| format!("blobs/sha256/{}", hex::encode(Sha256::digest(data)));
        let files: [(String, &[u8]); 5] = [
            ("oci-layout".into(), br#"{"imageLayoutVersion":"1.0.0"}"#),
            (blob(&self.rootfs), &self.rootfs),
            (blob(&config), &config),
            (blob(&manifest), &manifest),
            ("index.json".into(), &index),
        ];
        for (name, data) in files {
            let mut header = tar::Header::new_ustar();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_mtime(0);
            header.set_entry_type(tar::EntryType::Regular);
            tar.append_data(&mut header, name, data)
                .map_err(TestbedError::io(path))?;
        }
        tar.finish().map_err(TestbedError::io(path))
    }

    /// A file-name-safe form of the reference.
    pub(crate) fn file_stem(&self) -> String {
        self.reference
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect()
    }

    /// `docker.io/library/busybox:latest` → (`docker.io/library/busybox`, `latest`).
    pub(crate) fn repo_and_tag(&self) -> (String, String) {
        match self.reference.rsplit_once(':') {
            Some((repo, tag)) if !tag.contains('/') => (repo.to_string(), tag.to_string()),
            _ => (self.reference.clone(), "latest".to_string()),
        }
    }

    /// Dockerfile instructions that give a Docker import the same config.
    pub(crate) fn docker_changes(&self) -> Vec<String> {
        let mut out = Vec::new();
        for e in &self.env {
            out.push(format!("ENV {e}"));
        }
        if !self.cmd.is_empty() {
            out.push(format!(
                "CMD {}",
                serde_json::to_string(&self.cmd).expect("strings")
            ));
        }
        if !self.entrypoint.is_empty() {
            out.push(format!(
                "ENTRYPOINT {}",
                serde_json::to_string(&self.entrypoint).expect("strings")
            ));
        }
        if !self.workdir.is_empty() {
            out.push(format!("WORKDIR {}", self.workdir));
        }
        out
    }
}

impl OciImageBuilder {
    /// An empty directory (and its parents).
    pub fn dir(self, path: &str) -> Self {
        self.dir_mode(path, 0o755)
    }

    pub fn dir_mode(mut self, path: &str, mode: u32) -> Self {
        let path = self.clean(path);
        self.add_parents(&path);
        self.entries.insert(path, Entry::Dir { mode });
        self
    }

    /// A copy of a host file at `dest`.
    pub fn file(mut self, host: impl AsRef<Path>, dest: &str, mode: u32) -> Self {
        match fs::read(host.as_ref()) {
            Ok(data) => self.bytes(dest, data, mode),
            Err(e) => {
                self.error = Some(format!("reading {}: {e}", host.as_ref().display()));
                self
            }
        }
    }

    /// A file with the given contents at `dest`.
    pub fn bytes(mut self, dest: &str, data: impl Into<Vec<u8>>, mode: u32) -> Self {
        let path = self.clean(dest);
        self.add_parents(&path);
        self.entries.insert(
            path,
            Entry::File {
                data: data.into(),
                mode,
            },
        );
        self
    }

    pub fn symlink(mut self, dest: &str, target: &str) -> Self {
        let path = self.clean(dest);
        self.add_parents(&path);
        self.entries.insert(
            path,
            Entry::Symlink {
                target: target.to_string(),
            },
        );
        self
    }

    /// Adds `KEY=value` to the image's environment.
    pub fn env(mut self, pair: &str) -> Self {
        self.env.push(pair.to_string());
        self
    }

    pub fn cmd<S: Into<String>>(mut self, cmd: impl IntoIterator<Item = S>) -> Self {
        self.cmd = cmd.into_iter().map(Into::into).collect();
        self
    }

    pub fn entrypoint<S: Into<String>>(mut self, ep: impl IntoIterator<Item = S>) -> Self {
        self.entrypoint = ep.into_iter().map(Into::into).collect();
        self
    }

    pub fn workdir(mut self, dir: &str) -> Self {
        self.workdir = dir.to_string();
        self
    }

    pub fn build(self) -> Result<OciImage, TestbedError> {
        if let Some(e) = self.error {
            return Err(TestbedError::Setup(e));
        }
        let mut tar = tar::Builder::new(Vec::new());
        let io = |e| TestbedError::Setup(format!("building rootfs tar: {e}"));
        // BTreeMap order puts every parent before its children.
        for (path, entry) in &self.entries {
            let mut header = tar::Header::new_gnu();
            header.set_mtime(0);
            header.set_uid(0);
            header.set_gid(0);
            match entry {
                Entry::Dir { mode } => {
                    header.set_entry_type(tar::EntryType::Directory);
                    header.set_mode(*mode);
                    header.set_size(0);
                    tar.append_data(&mut header, format!("{path}/"), std::io::empty())
                        .map_err(io)?;
                }
                Entry::File { data, mode } => {
                    header.set_entry_type(tar::EntryType::Regular);
                    header.set_mode(*mode);
                    header.set_size(data.len() as u64);
                    tar.append_data(&mut header, path, data.as_slice())
                        .map_err(io)?;
                }
                Entry::Symlink { target } => {
                    header.set_entry_type(tar::EntryType::Symlink);
                    header.set_mode(0o777);
                    header.set_size(0);
                    tar.append_link(&mut header, path, target).map_err(io)?;
                }
            }
        }
        let rootfs = tar.into_inner().map_err(io)?;
        Ok(OciImage {
            reference: self.reference,
            rootfs,
            env: self.env,
            cmd: self.cmd,
            entrypoint: self.entrypoint,
            workdir: self.workdir,
        })
    }

    /// Tar paths are relative and normalized: `/bin//sh` → `bin/sh`.
    fn clean(&mut self, path: &str) -> String {
        let parts: Vec<&str> = path
            .split('/')
            .filter(|p| !p.is_empty() && *p != ".")
            .collect();
        if parts.contains(&"..") || parts.is_empty() {
            self.error = Some(format!("invalid image path {path:?}"));
        }
        parts.join("/")
    }

    fn add_parents(&mut self, path: &str) {
        let mut prefix = String::new();
        let parts: Vec<&str> = path.split('/').collect();
        for part in &parts[..parts.len().saturating_sub(1)] {
            if !prefix.is_empty() {
                prefix.push('/');
            }
            prefix.push_str(part);
            self.entries
                .entry(prefix.clone())
                .or_insert(Entry::Dir { mode: 0o755 });
        }
    }
}

/// The test busybox image: busybox-static with every applet linked, the
/// usual empty mount points, and root/nobody users. Built once per process.
pub fn busybox_image() -> Result<OciImage, TestbedError> {
    static IMAGE: OnceLock<Result<OciImage, String>> = OnceLock::new();
    crate::made_once(&IMAGE, build_busybox)
}

fn build_busybox() -> Result<OciImage, TestbedError> {
    crate::ensure_packages(false)?;
    let list = Command::new(BUSYBOX_BIN)
        .arg("--list-full")
        .output()
        .map_err(|e| TestbedError::Spawn {
            what: format!("{BUSYBOX_BIN} --list-full"),
            source: e,
        })?;
    let mut builder = OciImage::builder(BUSYBOX_REF)
        .file(PathBuf::from(BUSYBOX_BIN), "/bin/busybox", 0o755)
        .bytes(
            "/etc/passwd",
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/false\n",
            0o644,
        )
        .bytes("/etc/group", "root:x:0:\nnobody:x:65534:\n", 0o644)
        .bytes("/etc/hosts", "127.0.0.1 localhost\n", 0o644)
        .dir_mode("/tmp", 0o1777)
        .dir("/proc")
        .dir("/sys")
        .dir("/dev")
        .dir("/root")
        .dir("/home")
        .dir("/var")
        .dir("/run")
        .cmd(["sh"]);
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let applet = applet.trim();
        if applet.is_empty() || applet == "bin/busybox" {
            continue;
        }
        builder = builder.symlink(applet, "/bin/busybox");
    }
    builder.build()
}

pub(crate) fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}
