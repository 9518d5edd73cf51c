//! `sandbolt image import` of every kind of archive people have, made by the
//! real tools where this machine has them — GNU `tar` and `gzip` of an OCI
//! image layout, `docker save` of the test bed's dockerd (Debian's 20.10:
//! the legacy `manifest.json` format), Debian's `skopeo` (`oci-archive:`,
//! `docker-archive:`, a multi-platform index with `--all`) — into a real
//! containerd (the test bed's); each imported image then runs (`ctr run`).
//!
//! Two kinds are written by this file itself, and say so: the OCI layout
//! `docker save` of Docker ≥ 25 writes (no such Docker is installable here),
//! and multi-platform indexes beyond the one skopeo copies.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use sandbolt_testbed::{OciImage, Testbed, busybox_image, workspace_root};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// Debian's docker.io client: the same release as the test bed's dockerd
/// (another `docker` earlier on PATH may be a newer client).
const DOCKER: &str = "/usr/bin/docker";
const MT_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MT_INDEX: &str = "application/vnd.oci.image.index.v1+json";

fn host_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// A tool the test drives; missing is a failure that says how to get it.
fn require(bin: &str, package: &str) {
    assert!(
        Path::new(bin).exists(),
        "{bin} is missing: install the Debian package {package} (scripts/setup-host.sh does)"
    );
}

/// Runs a command that must succeed; returns its stdout.
fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?} did not start: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn sandbolt_import(bed: &Testbed, ns: &str, archive: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sandbolt"))
        .args(["image", "import"])
        .arg(archive)
        .arg("--containerd-socket")
        .arg(bed.containerd_socket())
        .args(["--containerd-namespace", ns])
        .args(extra)
        .env_remove("SANDBOLT_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// Imports `archive` into namespace `ns`; asserts it succeeds quietly (no
/// log, no progress bar on a pipe) and prints exactly `names`.
fn imports(bed: &Testbed, ns: &str, archive: &Path, extra: &[&str], names: &[&str]) {
    let out = sandbolt_import(bed, ns, archive, extra);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{ns}: import of {} failed: {stderr}",
        archive.display()
    );
    assert_eq!(
        stderr, "",
        "{ns}: a successful import prints nothing on stderr"
    );
    let mut printed: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    printed.sort();
    let mut want: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(printed, want, "{ns}: names printed");
    let listed = run(bed.ctr(ns).args(["images", "ls", "-q"]));
    for n in names {
        assert!(
            listed.lines().any(|l| l == *n),
            "{ns}: {n} not in ctr images ls:\n{listed}"
        );
    }
}

/// [`imports`] of an archive of one image, `name`, which then [`runs`].
fn imports_and_runs(bed: &Testbed, ns: &str, archive: &Path, extra: &[&str], name: &str) {
    imports(bed, ns, archive, extra, &[name]);
    runs(bed, ns, name);
}

/// The image runs: `ctr run` of it prints what it was asked to (so it is
/// unpacked on the snapshotter and its config is sound).
fn runs(bed: &Testbed, ns: &str, reference: &str) {
    static N: AtomicU32 = AtomicU32::new(0);
    let id = format!("import-run-{}", N.fetch_add(1, Ordering::Relaxed));
    let word = format!("ran-{id}");
    let out = run(bed
        .ctr(ns)
        .args(["run", "--rm", reference, &id, "echo", &word]));
    assert!(out.contains(&word), "{ns}: {reference} did not run: {out}");
}

/// Expects a failed import whose whole stderr is one line containing every
/// one of `want`, and nothing imported.
fn fails_in_one_line(bed: &Testbed, ns: &str, archive: &Path, extra: &[&str], want: &[&str]) {
    let out = sandbolt_import(bed, ns, archive, extra);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{ns}: import should fail: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "{ns}: one line: {stderr}");
    assert!(
        stderr.starts_with(&format!("sandbolt: cannot import {}: ", archive.display())),
        "{ns}: {stderr}"
    );
    for w in want {
        assert!(stderr.contains(w), "{ns}: {w:?} not in: {stderr}");
    }
    let listed = run(bed.ctr(ns).args(["images", "ls", "-q"]));
    assert_eq!(listed.trim(), "", "{ns}: nothing is imported");
}

/// `tar -C dir <mode> archive`, ready for the member arguments.
fn tar_in(dir: &Path, mode: &str, archive: &Path) -> Command {
    let mut tar = Command::new("tar");
    tar.arg("-C").arg(dir).arg(mode).arg(archive);
    tar
}

/// A bed for archives this test writes itself with `tar`, and the bed's
/// directory to write them in.
fn bed_with_tar() -> (Testbed, PathBuf) {
    require("/usr/bin/tar", "tar");
    let bed = Testbed::start().expect("test bed");
    let root = bed.root().to_path_buf();
    (bed, root)
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// An OCI image layout directory written blob by blob.
struct Layout {
    dir: PathBuf,
}

impl Layout {
    fn new(dir: PathBuf) -> Self {
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        Layout { dir }
    }

    fn blob(&self, data: &[u8]) -> (String, usize) {
        let digest = sha256(data);
        std::fs::write(self.dir.join("blobs/sha256").join(&digest[7..]), data).unwrap();
        (digest, data.len())
    }

    /// Config + manifest of a one-layer image of `rootfs` for linux/`arch`;
    /// returns the manifest's descriptor (with its platform).
    fn image(&self, rootfs: &[u8], arch: &str) -> Value {
        let (layer, layer_size) = self.blob(rootfs);
        let config = serde_json::to_vec(&json!({
            "architecture": arch, "os": "linux",
            "config": {"Env": ["PATH=/bin"], "Cmd": ["sh"]},
            "rootfs": {"type": "layers", "diff_ids": [layer]},
        }))
        .unwrap();
        let (config, config_size) = self.blob(&config);
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2, "mediaType": MT_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                       "digest": config, "size": config_size},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": layer, "size": layer_size}],
        }))
        .unwrap();
        let (digest, size) = self.blob(&manifest);
        json!({"mediaType": MT_MANIFEST, "digest": digest, "size": size,
               "platform": {"os": "linux", "architecture": arch}})
    }

    fn index(&self, manifests: Value) {
        let index = json!({"schemaVersion": 2, "mediaType": MT_INDEX, "manifests": manifests});
        std::fs::write(
            self.dir.join("index.json"),
            serde_json::to_vec(&index).unwrap(),
        )
        .unwrap();
    }

    /// `tar -C <layout> -cf <out> .`: `./` prefixes and directory entries.
    fn tar_dot(&self, out: &Path) {
        run(tar_in(&self.dir, "-cf", out).arg("."));
    }
}

fn docker(bed: &Testbed) -> Command {
    let mut cmd = Command::new(DOCKER);
    cmd.arg("-H")
        .arg(format!("unix://{}", bed.docker_socket().unwrap().display()));
    cmd
}

/// Where [`docker_saved`] leaves busybox's rootfs, in the bed's root.
const ROOTFS_TAR: &str = "rootfs.tar";

/// A bed with dockerd holding busybox's rootfs as `tag` (`docker import`),
/// and that image as `docker save` writes it, at `file` in the bed's root.
fn docker_saved(tag: &str, file: &str) -> (Testbed, PathBuf) {
    require(DOCKER, "docker.io");
    let bed = Testbed::start_with_docker().expect("test bed with dockerd");
    let rootfs = bed.root().join(ROOTFS_TAR);
    std::fs::write(&rootfs, busybox_image().unwrap().rootfs_tar()).unwrap();
    run(docker(&bed).arg("import").arg(&rootfs).arg(tag));
    let saved = bed.root().join(file);
    run(docker(&bed).args(["save", "-o"]).arg(&saved).arg(tag));
    (bed, saved)
}

fn gzip(path: &Path) -> PathBuf {
    run(Command::new("gzip").arg("-kf").arg(path));
    PathBuf::from(format!("{}.gz", path.display()))
}

#[test]
fn oci_layouts_made_by_tar_and_gzip_import_and_run() {
    require("/usr/bin/gzip", "gzip");
    let (bed, root) = bed_with_tar();
    let busybox = busybox_image().unwrap();
    let name = "docker.io/library/busybox:latest";

    // The project's own writer.
    let ours = root.join("ours.tar");
    busybox.write_oci_archive(&ours).unwrap();
    imports_and_runs(&bed, "ours", &ours, &[], name);
    // Again: the blobs are there already; the image is the same.
    imports_and_runs(&bed, "ours", &ours, &[], name);

    // The layout unpacked by tar, then archived again by tar in each shape.
    let dir = root.join("layout");
    std::fs::create_dir_all(&dir).unwrap();
    run(&mut tar_in(&dir, "-xf", &ours));
    let layout = Layout { dir: dir.clone() };

    let dot = root.join("dot.tar");
    layout.tar_dot(&dot);
    let listing = run(Command::new("tar").arg("-tvf").arg(&dot));
    assert!(
        listing.contains(" ./blobs/\n") && listing.contains(" ./blobs/sha256/\n"),
        "the archive has directory entries with ./ prefixes:\n{listing}"
    );
    imports_and_runs(&bed, "tar-dot", &dot, &[], name);

    let plain = root.join("plain.tar");
    run(tar_in(&dir, "-cf", &plain).args(["oci-layout", "index.json", "blobs"]));
    imports_and_runs(&bed, "tar-plain", &plain, &[], name);

    // Files only, `./` prefixed, blobs after index.json.
    let files_only = root.join("files-only.tar");
    let mut files = vec!["./index.json".to_string(), "./oci-layout".to_string()];
    for e in std::fs::read_dir(dir.join("blobs/sha256")).unwrap() {
        files.push(format!(
            "./blobs/sha256/{}",
            e.unwrap().file_name().to_string_lossy()
        ));
    }
    run(tar_in(&dir, "-cf", &files_only)
        .arg("--no-recursion")
        .args(&files));
    imports_and_runs(&bed, "tar-files", &files_only, &[], name);

    // gzip of an archive, and tar's own -z.
    imports_and_runs(&bed, "gzip", &gzip(&dot), &[], name);
    let tgz = root.join("layout.tgz");
    run(tar_in(&dir, "-czf", &tgz).arg("."));
    imports_and_runs(&bed, "tar-z", &tgz, &[], name);

    // --name renames the one image of an archive.
    imports_and_runs(
        &bed,
        "renamed",
        &dot,
        &["--name", "example.com/team/tool:1.0"],
        "example.com/team/tool:1.0",
    );
}

/// Multi-platform indexes, written by this test (skopeo's own is in
/// [`skopeo_archives_import_and_run`]): the host's manifest is chosen; the
/// other platform's blobs need not be in the archive.
#[test]
fn multi_platform_indexes_import_the_host_platform() {
    let (bed, root) = bed_with_tar();
    let rootfs = busybox_image().unwrap().rootfs_tar().to_vec();
    let other_arch = if host_arch() == "arm64" {
        "s390x"
    } else {
        "arm64"
    };

    // A flat index of two platforms, unnamed (as `skopeo copy` of a
    // platform list without a tag writes it): --name names it.
    let flat = Layout::new(root.join("flat"));
    let other = flat.image(b"a layer for another platform", other_arch);
    let ours = flat.image(&rootfs, host_arch());
    flat.index(json!([other, ours]));
    // The other platform's layer is not even in the archive.
    std::fs::remove_file(
        flat.dir
            .join("blobs/sha256")
            .join(&sha256(b"a layer for another platform")[7..]),
    )
    .unwrap();
    let flat_tar = root.join("flat.tar");
    flat.tar_dot(&flat_tar);
    fails_in_one_line(&bed, "flat", &flat_tar, &[], &["--name"]);
    imports_and_runs(
        &bed,
        "flat",
        &flat_tar,
        &["--name", "sandbolt/flat:1"],
        "docker.io/sandbolt/flat:1",
    );
    let listed = run(bed.ctr("flat").args(["images", "ls"]));
    assert!(
        listed.contains(ours["digest"].as_str().unwrap()),
        "the target is the host's manifest:\n{listed}"
    );

    // A nested index, as registries serve multi-platform images, named by
    // containerd's annotation and tagged by the OCI one.
    let nested = Layout::new(root.join("nested"));
    let other = nested.image(b"another platform again", other_arch);
    let ours = nested.image(&rootfs, host_arch());
    let inner = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": MT_INDEX, "manifests": [other, ours],
    }))
    .unwrap();
    let (inner_digest, inner_size) = nested.blob(&inner);
    nested.index(json!([{
        "mediaType": MT_INDEX, "digest": inner_digest, "size": inner_size,
        "annotations": {
            "io.containerd.image.name": "docker.io/sandbolt/nested:2",
            "org.opencontainers.image.ref.name": "2",
        },
    }]));
    let nested_tar = root.join("nested.tar");
    nested.tar_dot(&nested_tar);
    imports_and_runs(
        &bed,
        "nested",
        &nested_tar,
        &[],
        "docker.io/sandbolt/nested:2",
    );
    let listed = run(bed.ctr("nested").args(["images", "ls"]));
    assert!(
        listed.contains(&inner_digest) && listed.contains(MT_INDEX),
        "the image is the index, as a registry names it:\n{listed}"
    );

    // Two different images in one index: each keeps its name.
    let two = Layout::new(root.join("two"));
    let mut a = two.image(&rootfs, host_arch());
    a["annotations"] = json!({"org.opencontainers.image.ref.name": "docker.io/sandbolt/a:1"});
    let other_rootfs = OciImage::builder("docker.io/sandbolt/b:1")
        .file("/bin/busybox", "/bin/busybox", 0o755)
        .symlink("/bin/echo", "/bin/busybox")
        .bytes("/etc/b", "b\n", 0o644)
        .dir("/proc")
        .dir("/sys")
        .dir("/dev")
        .build()
        .unwrap();
    let mut b = two.image(other_rootfs.rootfs_tar(), host_arch());
    b["annotations"] = json!({"io.containerd.image.name": "docker.io/sandbolt/b:1"});
    two.index(json!([a, b]));
    let two_tar = root.join("two.tar");
    two.tar_dot(&two_tar);
    imports(
        &bed,
        "two",
        &two_tar,
        &[],
        &["docker.io/sandbolt/a:1", "docker.io/sandbolt/b:1"],
    );
    runs(&bed, "two", "docker.io/sandbolt/a:1");
    runs(&bed, "two", "docker.io/sandbolt/b:1");
}

#[test]
fn docker_save_archives_import_and_run() {
    require("/usr/bin/gzip", "gzip");
    // Docker 20.10's legacy format (manifest.json, <id>/layer.tar,
    // <config>.json).
    let (bed, one) = docker_saved("sandbolt/dsave:v1", "one.tar");
    let root = bed.root().to_path_buf();
    let rootfs = root.join(ROOTFS_TAR);
    let listing = run(Command::new("tar").arg("-tf").arg(&one));
    assert!(
        listing.contains("manifest.json") && listing.contains("/layer.tar"),
        "docker save wrote the legacy format:\n{listing}"
    );
    imports_and_runs(&bed, "dsave", &one, &[], "docker.io/sandbolt/dsave:v1");

    // Gzip-compressed, as `docker save … | gzip` makes it.
    imports_and_runs(
        &bed,
        "dsave-gz",
        &gzip(&one),
        &[],
        "docker.io/sandbolt/dsave:v1",
    );

    // Two images sharing a layer (docker save links the second layer.tar
    // to the first) and one image with two tags.
    run(docker(&bed)
        .arg("import")
        .args(["--change", "ENV PATH=/usr/sbin:/usr/bin:/sbin:/bin"])
        .arg(&rootfs)
        .arg("sandbolt/dsave2:v2"));
    run(docker(&bed).args(["tag", "sandbolt/dsave:v1", "sandbolt/dsave:alias"]));
    let several = root.join("several.tar");
    run(docker(&bed).args(["save", "-o"]).arg(&several).args([
        "sandbolt/dsave:v1",
        "sandbolt/dsave:alias",
        "sandbolt/dsave2:v2",
    ]));
    let listing = run(Command::new("tar").arg("-tvf").arg(&several));
    assert!(
        listing.contains("layer.tar -> ../"),
        "docker save links the shared layer:\n{listing}"
    );
    imports(
        &bed,
        "several",
        &several,
        &[],
        &[
            "docker.io/sandbolt/dsave:v1",
            "docker.io/sandbolt/dsave:alias",
            "docker.io/sandbolt/dsave2:v2",
        ],
    );
    for r in [
        "docker.io/sandbolt/dsave:v1",
        "docker.io/sandbolt/dsave:alias",
        "docker.io/sandbolt/dsave2:v2",
    ] {
        runs(&bed, "several", r);
    }

    // Saved by image id: no name in the archive, so --name is needed.
    let id = run(docker(&bed).args(["images", "-q", "--no-trunc", "sandbolt/dsave2:v2"]))
        .trim()
        .to_string();
    assert!(id.starts_with("sha256:"), "{id}");
    let by_id = root.join("by-id.tar");
    run(docker(&bed).args(["save", "-o"]).arg(&by_id).arg(&id));
    fails_in_one_line(&bed, "by-id", &by_id, &[], &["does not name", "--name"]);
    imports_and_runs(
        &bed,
        "by-id",
        &by_id,
        &["--name", "sandbolt/by-id:1"],
        "docker.io/sandbolt/by-id:1",
    );
}

/// The OCI layout `docker save` writes from Docker 25 on — written by this
/// test as that Docker writes it (no such Docker is installable here):
/// `blobs/sha256/…`, an `index.json` whose entry carries the full name in
/// `io.containerd.image.name` and only the tag in
/// `org.opencontainers.image.ref.name`, plus the legacy `manifest.json` and
/// `repositories` beside it, archived without `./` and with directory
/// entries.
#[test]
fn docker_25_oci_save_layout_imports_and_runs() {
    let (bed, root) = bed_with_tar();
    let layout = Layout::new(root.join("docker25"));
    let mut entry = layout.image(busybox_image().unwrap().rootfs_tar(), host_arch());
    entry.as_object_mut().unwrap().remove("platform");
    entry["annotations"] = json!({
        "io.containerd.image.name": "docker.io/sandbolt/docker25:v25",
        "org.opencontainers.image.ref.name": "v25",
    });
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(
            layout
                .dir
                .join("blobs/sha256")
                .join(&entry["digest"].as_str().unwrap()[7..]),
        )
        .unwrap(),
    )
    .unwrap();
    let hex = |d: &Value| d["digest"].as_str().unwrap()[7..].to_string();
    layout.index(json!([entry]));
    std::fs::write(
        layout.dir.join("manifest.json"),
        serde_json::to_vec(&json!([{
            "Config": format!("blobs/sha256/{}", hex(&manifest["config"])),
            "RepoTags": ["sandbolt/docker25:v25"],
            "Layers": [format!("blobs/sha256/{}", hex(&manifest["layers"][0]))],
        }]))
        .unwrap(),
    )
    .unwrap();
    std::fs::write(
        layout.dir.join("repositories"),
        format!(
            r#"{{"sandbolt/docker25":{{"v25":"{}"}}}}"#,
            hex(&manifest["layers"][0])
        ),
    )
    .unwrap();
    let archive = root.join("docker25.tar");
    run(tar_in(&layout.dir, "-cf", &archive).args([
        "blobs",
        "index.json",
        "manifest.json",
        "oci-layout",
        "repositories",
    ]));
    imports_and_runs(
        &bed,
        "docker25",
        &archive,
        &[],
        "docker.io/sandbolt/docker25:v25",
    );
}

/// Debian's skopeo, installed by `scripts/setup-host.sh` when missing.
fn ensure_skopeo() {
    if !Path::new("/usr/bin/skopeo").exists() {
        let out = Command::new(workspace_root().join("scripts/setup-host.sh"))
            .output()
            .expect("scripts/setup-host.sh runs");
        assert!(
            out.status.success(),
            "scripts/setup-host.sh failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    require("/usr/bin/skopeo", "skopeo");
}

fn skopeo() -> Command {
    let mut cmd = Command::new("/usr/bin/skopeo");
    // No signature policy matters for local files; this keeps the test
    // independent of /etc/containers/policy.json.
    cmd.args(["--insecure-policy", "copy", "--quiet"]);
    cmd
}

#[test]
fn skopeo_archives_import_and_run() {
    ensure_skopeo();
    let (bed, saved) = docker_saved("sandbolt/source:1", "saved.tar");
    let root = bed.root().to_path_buf();
    let source = format!("docker-archive:{}", saved.display());

    // oci-archive: gzip-compressed layers, the full name in ref.name.
    let oci = root.join("skopeo-oci.tar");
    run(skopeo()
        .arg(&source)
        .arg(format!("oci-archive:{}:sandbolt/skopeo:v1", oci.display())));
    imports_and_runs(&bed, "sk-oci", &oci, &[], "docker.io/sandbolt/skopeo:v1");

    // oci-archive with uncompressed layers and only a tag: --name names it.
    let plain = root.join("skopeo-plain.tar");
    run(skopeo()
        .arg("--dest-oci-accept-uncompressed-layers")
        .arg(&source)
        .arg(format!("oci-archive:{}:v2", plain.display())));
    fails_in_one_line(&bed, "sk-plain", &plain, &[], &["\"v2\"", "--name"]);
    imports_and_runs(
        &bed,
        "sk-plain",
        &plain,
        &["--name", "sandbolt/skopeo-plain:v2"],
        "docker.io/sandbolt/skopeo-plain:v2",
    );

    // docker-archive: as containers/image writes it (`<digest>.tar` layers,
    // legacy `<id>/layer.tar` links to them).
    let dockerish = root.join("skopeo-docker.tar");
    run(skopeo().arg(&source).arg(format!(
        "docker-archive:{}:sandbolt/skd:v3",
        dockerish.display()
    )));
    imports_and_runs(
        &bed,
        "sk-docker",
        &dockerish,
        &[],
        "docker.io/sandbolt/skd:v3",
    );

    // A multi-platform image copied whole (--all): skopeo writes a nested
    // index; the host's manifest is imported, the image is the index.
    let other_arch = if host_arch() == "arm64" {
        "s390x"
    } else {
        "arm64"
    };
    let multi = Layout::new(root.join("multi"));
    let entries = json!([
        multi.image(busybox_image().unwrap().rootfs_tar(), other_arch),
        multi.image(busybox_image().unwrap().rootfs_tar(), host_arch()),
    ]);
    let inner = serde_json::to_vec(&json!({
        "schemaVersion": 2, "mediaType": MT_INDEX, "manifests": entries,
    }))
    .unwrap();
    let (inner_digest, inner_size) = multi.blob(&inner);
    multi.index(json!([{
        "mediaType": MT_INDEX, "digest": inner_digest, "size": inner_size,
        "annotations": {"org.opencontainers.image.ref.name": "latest"},
    }]));
    let multi_tar = root.join("skopeo-multi.tar");
    run(skopeo()
        .arg("--all")
        .arg(format!("oci:{}:latest", multi.dir.display()))
        .arg(format!(
            "oci-archive:{}:sandbolt/multi:v1",
            multi_tar.display()
        )));
    imports_and_runs(
        &bed,
        "sk-multi",
        &multi_tar,
        &[],
        "docker.io/sandbolt/multi:v1",
    );
    let listed = run(bed.ctr("sk-multi").args(["images", "ls"]));
    assert!(listed.contains(MT_INDEX), "{listed}");
}

#[test]
fn broken_archives_fail_in_one_line_naming_the_problem() {
    require("/usr/bin/tar", "tar");
    require("/usr/bin/gzip", "gzip");
    let bed = Testbed::start().expect("test bed");
    let root = bed.root().to_path_buf();
    let busybox = busybox_image().unwrap();
    let layer_hex = busybox.diff_id()[7..].to_string();
    let good = root.join("good.tar");
    busybox.write_oci_archive(&good).unwrap();
    let bytes = std::fs::read(&good).unwrap();
    // Where the layer's data lies in the tar (its content is unique).
    let layer = busybox.rootfs_tar();
    let at = bytes
        .windows(64)
        .position(|w| w == &layer[..64])
        .expect("the layer is in the archive");

    // Cut in the middle of the layer.
    let truncated = root.join("truncated.tar");
    std::fs::write(&truncated, &bytes[..at + layer.len() / 2]).unwrap();
    fails_in_one_line(
        &bed,
        "truncated",
        &truncated,
        &[],
        &[&format!("entry blobs/sha256/{layer_hex}"), "truncated"],
    );

    // The same, gzip-compressed.
    let gz = gzip(&good);
    let gz_bytes = std::fs::read(&gz).unwrap();
    let truncated_gz = root.join("truncated.tar.gz");
    std::fs::write(&truncated_gz, &gz_bytes[..gz_bytes.len() / 2]).unwrap();
    fails_in_one_line(
        &bed,
        "truncated-gz",
        &truncated_gz,
        &[],
        &[&format!("entry blobs/sha256/{layer_hex}"), "truncated"],
    );

    // One byte of the layer changed: its content no longer matches its name.
    let mut corrupt_bytes = bytes.clone();
    corrupt_bytes[at + layer.len() / 2] ^= 0xff;
    let corrupt = root.join("corrupt.tar");
    std::fs::write(&corrupt, &corrupt_bytes).unwrap();
    fails_in_one_line(
        &bed,
        "corrupt",
        &corrupt,
        &[],
        &[&format!("entry blobs/sha256/{layer_hex}"), "corrupt"],
    );

    // The layer left out.
    let dir = root.join("layout");
    std::fs::create_dir_all(&dir).unwrap();
    run(&mut tar_in(&dir, "-xf", &good));
    std::fs::remove_file(dir.join("blobs/sha256").join(&layer_hex)).unwrap();
    let missing = root.join("missing.tar");
    Layout { dir: dir.clone() }.tar_dot(&missing);
    fails_in_one_line(
        &bed,
        "missing",
        &missing,
        &[],
        &["layer 0", &layer_hex, "missing from the archive"],
    );

    // Not an archive; a tar that is no image; a compression not read.
    let text = root.join("notes.tar");
    std::fs::write(&text, "these are notes, not an archive\n".repeat(40)).unwrap();
    fails_in_one_line(&bed, "text", &text, &[], &["not a tar archive"]);
    let rootfs = root.join("rootfs.tar");
    std::fs::write(&rootfs, busybox.rootfs_tar()).unwrap();
    fails_in_one_line(
        &bed,
        "rootfs",
        &rootfs,
        &[],
        &["not an image archive", "index.json", "manifest.json"],
    );
    let zst = root.join("image.tar.zst");
    let mut zstd_bytes = vec![0x28, 0xb5, 0x2f, 0xfd];
    zstd_bytes.extend_from_slice(&bytes[..1024]);
    std::fs::write(&zst, zstd_bytes).unwrap();
    fails_in_one_line(&bed, "zstd", &zst, &[], &["zstd", "decompress it first"]);

    // An image for another platform only.
    let foreign = Layout::new(root.join("foreign"));
    let other_arch = if host_arch() == "arm64" {
        "s390x"
    } else {
        "arm64"
    };
    let mut entry = foreign.image(layer, other_arch);
    entry["annotations"] = json!({"io.containerd.image.name": "docker.io/sandbolt/foreign:1"});
    foreign.index(json!([entry]));
    let foreign_tar = root.join("foreign.tar");
    foreign.tar_dot(&foreign_tar);
    fails_in_one_line(
        &bed,
        "foreign",
        &foreign_tar,
        &[],
        &[
            &format!("linux/{other_arch} only"),
            "docker.io/sandbolt/foreign:1",
        ],
    );

    // A name that is not one.
    fails_in_one_line(
        &bed,
        "bad-name",
        &good,
        &["--name", "Not A Name"],
        &["--name"],
    );
    // No such file.
    let out = sandbolt_import(&bed, "absent", Path::new("/nonexistent/image.tar"), &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("/nonexistent/image.tar") && stderr.contains("No such file"),
        "{stderr}"
    );
}

/// A deterministic, incompressible filler (xorshift), so the archive is
/// large without reading /dev/urandom.
fn filler(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

#[test]
fn a_progress_bar_only_on_a_terminal_and_only_for_large_archives() {
    require("/usr/bin/script", "bsdutils");
    let bed = Testbed::start().expect("test bed");
    let root = bed.root().to_path_buf();
    let big = OciImage::builder("docker.io/sandbolt/big:1")
        .file("/bin/busybox", "/bin/busybox", 0o755)
        .symlink("/bin/echo", "/bin/busybox")
        .bytes("/var/filler", filler(24 << 20), 0o644)
        .dir("/proc")
        .dir("/sys")
        .dir("/dev")
        .build()
        .unwrap();
    let big_tar = root.join("big.tar");
    big.write_oci_archive(&big_tar).unwrap();
    let small_tar = root.join("small.tar");
    busybox_image()
        .unwrap()
        .write_oci_archive(&small_tar)
        .unwrap();

    // On a terminal (script(1) gives the command a pty).
    let on_terminal = |ns: &str, archive: &Path| -> String {
        let cmd = format!(
            "{} image import {} --containerd-socket {} --containerd-namespace {ns}",
            env!("CARGO_BIN_EXE_sandbolt"),
            archive.display(),
            bed.containerd_socket().display()
        );
        run(Command::new("/usr/bin/script")
            .args(["-qec", &cmd, "/dev/null"])
            .env_remove("SANDBOLT_LOG")
            .stdin(Stdio::null()))
    };
    let shown = on_terminal("big-tty", &big_tar);
    for want in ["checking", "writing", "MiB", "docker.io/sandbolt/big:1"] {
        assert!(
            shown.contains(want),
            "{want:?} not on the terminal:\n{shown}"
        );
    }
    runs(&bed, "big-tty", "docker.io/sandbolt/big:1");
    let shown = on_terminal("small-tty", &small_tar);
    assert_eq!(
        shown.trim(),
        "docker.io/library/busybox:latest",
        "no bar for a small archive"
    );
    // Not a terminal: no bar (`imports` asserts an empty stderr).
    imports(
        &bed,
        "big-pipe",
        &big_tar,
        &[],
        &["docker.io/sandbolt/big:1"],
    );
}
