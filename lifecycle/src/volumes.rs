//! Volume requests (OSEP-0003): both the seed's `volumes[]` + `volumeBindings[]`
//! (`backendType` local|pvc|nfs) and the 1.1.1 spec's `volumes[]` (`host`,
//! `pvc`, `ossfs`), parsed into one [`VolumeMount`] list and validated.
//!
//! Validation is strict because host paths are the one place a sandbox request
//! can name something on the host: a path must be absolute and already
//! normalized (we reject rather than silently rewrite, so what is checked is
//! what is mounted), lie under an allowlisted prefix, exist, and still lie
//! under that prefix once symlinks are resolved.
//!
//! Where the allowlist is checked depends on who mounts ([`HostPathCheck`]):
//! the Docker engine mounts what this process names, so the lifecycle checks
//! its own filesystem; on the controller backend the sandbox lands on some
//! node whose agent resolves the path under its own allowlist (with
//! `openat2(RESOLVE_BENEATH)`), and this machine's filesystem says nothing
//! about that node's, so only the syntax is checked here.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::error::{ApiError, ApiResult};

/// Who checks host paths against an allowlist and the filesystem.
#[derive(Debug, Clone, PartialEq)]
pub enum HostPathCheck {
    /// This process, on its own filesystem, against these prefixes (empty:
    /// host volumes refused). The path is resolved and `subPath` folded in.
    Local(Vec<PathBuf>),
    /// The agent of the node the sandbox lands on. Here only the syntax is
    /// checked; path and `subPath` travel as the request gave them.
    OnNode,
}

/// Where a volume's data lives.
#[derive(Debug, Clone, PartialEq)]
pub enum VolumeSource {
    /// A host directory (`host.path`, or seed `backendType: local`). With
    /// [`HostPathCheck::Local`] already joined with `subPath` and resolved
    /// through symlinks; with [`HostPathCheck::OnNode`] as requested.
    Host { path: PathBuf },
    /// A platform-named volume (sandbolt named volume on the controller
    /// backend; Docker named volume).
    Pvc(PvcClaim),
    /// NFS `server:/export`.
    Nfs { server: String, export: String },
    /// Alibaba OSS through ossfs.
    Ossfs { bucket: String, endpoint: String },
}

impl VolumeSource {
    /// The backend name as the request spelled the kind (for error messages).
    pub fn kind(&self) -> &'static str {
        match self {
            VolumeSource::Host { .. } => "host",
            VolumeSource::Pvc { .. } => "pvc",
            VolumeSource::Nfs { .. } => "nfs",
            VolumeSource::Ossfs { .. } => "ossfs",
        }
    }
}

/// A `pvc` source: the named volume and how to provision it when it does
/// not exist yet (OpenSandbox `PVC`). Each runtime decides what the
/// provisioning hints mean for it (see the backends).
#[derive(Debug, Clone, PartialEq)]
pub struct PvcClaim {
    pub claim_name: String,
    /// `createIfNotExists` (default true): create the volume when missing;
    /// false refuses a missing one.
    pub create_if_missing: bool,
    /// `deleteOnSandboxTermination`: remove the volume at sandbox delete,
    /// if this sandbox's create made it.
    pub delete_on_sandbox_delete: bool,
    /// `storage` as spelled (checked to be a byte quantity).
    pub storage: Option<String>,
    /// `storageClass` as given.
    pub storage_class: Option<String>,
    /// `accessModes` as given (Kubernetes names; each runtime maps them).
    pub access_modes: Vec<String>,
}

impl PvcClaim {
    /// A claim with the OpenSandbox defaults (created when missing, kept
    /// at sandbox delete, no hints).
    pub fn named(claim_name: impl Into<String>) -> Self {
        Self {
            claim_name: claim_name.into(),
            create_if_missing: true,
            delete_on_sandbox_delete: false,
            storage: None,
            storage_class: None,
            access_modes: Vec::new(),
        }
    }
}

/// One validated mount.
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeMount {
    pub name: String,
    pub source: VolumeSource,
    pub mount_path: String,
    pub read_only: bool,
    /// Relative path below the source. `None` for host sources checked
    /// locally (folded into the resolved path there).
    pub sub_path: Option<String>,
}

/// Seed shape, one `volumes[]` entry.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SeedVolume {
    name: String,
    backend_type: String,
    backend_ref: String,
    #[serde(default)]
    #[allow(dead_code)] // accepted per OSEP-0003; no runtime parameter is used yet
    parameters: Option<serde_json::Map<String, Value>>,
}

/// Seed shape, one `volumeBindings[]` entry.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SeedBinding {
    volume_name: String,
    mount_path: String,
    access_mode: String,
    sub_path: Option<String>,
}

/// 1.1.1 shape, one `volumes[]` entry.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SpecVolume {
    name: String,
    mount_path: String,
    #[serde(default)]
    read_only: bool,
    sub_path: Option<String>,
    host: Option<SpecHost>,
    pvc: Option<SpecPvc>,
    ossfs: Option<SpecOssfs>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecHost {
    path: String,
}

/// OpenSandbox `PVC`. Unknown fields are refused: a provisioning hint
/// accepted and ignored would be a promise silently broken.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SpecPvc {
    claim_name: String,
    #[serde(default = "default_true")]
    create_if_not_exists: bool,
    #[serde(default)]
    delete_on_sandbox_termination: bool,
    storage: Option<String>,
    storage_class: Option<String>,
    access_modes: Option<Vec<String>>,
}

fn default_true() -> bool {
    true
}

/// Checks a `pvc` entry of volume `volume` and makes the claim.
fn pvc_claim(volume: &str, p: SpecPvc) -> ApiResult<PvcClaim> {
    check_pvc(&p.claim_name)?;
    if let Some(storage) = &p.storage {
        sandbolt_proto::quantity::bytes(storage).map_err(|e| {
            bad(
                "VOLUME::INVALID_STORAGE",
                format!("volume '{volume}': pvc.storage '{storage}' is not a byte quantity: {e}"),
            )
        })?;
    }
    Ok(PvcClaim {
        claim_name: p.claim_name,
        create_if_missing: p.create_if_not_exists,
        delete_on_sandbox_delete: p.delete_on_sandbox_termination,
        storage: p.storage,
        storage_class: p.storage_class,
        access_modes: p.access_modes.unwrap_or_default(),
    })
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecOssfs {
    bucket: String,
    endpoint: String,
}

fn bad(code: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::invalid_code(code, message)
}

/// DNS-1123 label: lowercase alphanumerics and '-', alphanumeric at both ends.
pub fn is_dns1123_label(s: &str, max: usize) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= max
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// DNS-1123 label of any length up to 63 (for label-key prefixes).
pub fn is_dns1123_label_any(s: &str) -> bool {
    is_dns1123_label(s, 63)
}

/// True when `p` is absolute and has no `.`/`..`/empty components, i.e. it
/// is already in the form it would be normalized to.
fn is_normalized_absolute(p: &str) -> bool {
    if !p.starts_with('/') || p.contains("//") || p.contains('\0') {
        return false;
    }
    // `components()` drops inner `.`s, so "/." would pass as "/".
    if p.split('/').any(|c| c == ".") {
        return false;
    }
    if p.len() > 1 && p.ends_with('/') {
        return false;
    }
    Path::new(p)
        .components()
        .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

fn check_sub_path(sub: &str) -> ApiResult<String> {
    const CODE: &str = "VOLUME::INVALID_SUB_PATH";
    if sub.is_empty() {
        return Err(bad(CODE, "subPath must not be empty when given"));
    }
    if sub.starts_with('/') {
        return Err(bad(CODE, format!("subPath '{sub}' must be relative")));
    }
    if sub.contains('\0') {
        return Err(bad(CODE, "subPath contains a NUL byte"));
    }
    let mut parts = Vec::new();
    for c in Path::new(sub).components() {
        match c {
            Component::Normal(p) => parts.push(p.to_string_lossy().into_owned()),
            Component::CurDir => {}
            _ => return Err(bad(CODE, format!("subPath '{sub}' must not contain '..'"))),
        }
    }
    if parts.is_empty() {
        return Err(bad(CODE, format!("subPath '{sub}' names no directory")));
    }
    Ok(parts.join("/"))
}

fn check_mount_path(p: &str) -> ApiResult<()> {
    const CODE: &str = "VOLUME::INVALID_MOUNT_PATH";
    if !is_normalized_absolute(p) {
        return Err(bad(
            CODE,
            format!("mountPath '{p}' must be an absolute, normalized path"),
        ));
    }
    // Mounting over these would hide execd (PID 1 of every sandbox) or the
    // kernel filesystems the runtime sets up.
    for reserved in ["/opt/sandbolt", "/proc", "/sys", "/dev"] {
        if p == reserved || p.starts_with(&format!("{reserved}/")) {
            return Err(bad(CODE, format!("mountPath '{p}' is reserved")));
        }
    }
    if p == "/" {
        return Err(bad(CODE, "mountPath must not be '/'"));
    }
    Ok(())
}

/// Checks a host path as [`HostPathCheck`] says; answers the source and the
/// `subPath` still to apply below it.
fn host_source(
    path: &str,
    sub: Option<String>,
    check: &HostPathCheck,
) -> ApiResult<(VolumeSource, Option<String>)> {
    if !is_normalized_absolute(path) {
        return Err(bad(
            "VOLUME::INVALID_HOST_PATH",
            format!("host path '{path}' must be an absolute, normalized path"),
        ));
    }
    match check {
        HostPathCheck::Local(allow) => Ok((
            VolumeSource::Host {
                path: check_host_path(path, sub.as_deref(), allow)?,
            },
            None,
        )),
        HostPathCheck::OnNode => Ok((
            VolumeSource::Host {
                path: PathBuf::from(path),
            },
            sub,
        )),
    }
}

/// Resolves and checks a normalized host path against the allowlist (see
/// module docs).
fn check_host_path(path: &str, sub: Option<&str>, allow: &[PathBuf]) -> ApiResult<PathBuf> {
    if allow.is_empty() {
        return Err(bad(
            "VOLUME::HOST_PATH_NOT_ALLOWED",
            "host path volumes are disabled: no allow_host_paths configured",
        ));
    }
    let requested = match sub {
        Some(s) => Path::new(path).join(s),
        None => PathBuf::from(path),
    };
    let Some(prefix) = allow.iter().find(|a| requested.starts_with(a)) else {
        return Err(bad(
            "VOLUME::HOST_PATH_NOT_ALLOWED",
            format!(
                "host path '{}' is not under an allowed prefix",
                requested.display()
            ),
        ));
    };
    let resolved = std::fs::canonicalize(&requested).map_err(|e| {
        bad(
            "VOLUME::HOST_PATH_NOT_FOUND",
            format!("host path '{}' is not usable: {e}", requested.display()),
        )
    })?;
    let prefix_resolved = std::fs::canonicalize(prefix).unwrap_or_else(|_| prefix.clone());
    if !resolved.starts_with(&prefix_resolved) {
        return Err(bad(
            "VOLUME::HOST_PATH_NOT_ALLOWED",
            format!(
                "host path '{}' resolves through a symlink to '{}', outside the allowed prefix",
                requested.display(),
                resolved.display()
            ),
        ));
    }
    if !resolved.is_dir() {
        return Err(bad(
            "VOLUME::INVALID_HOST_PATH",
            format!("host path '{}' is not a directory", requested.display()),
        ));
    }
    Ok(resolved)
}

fn check_name(name: &str) -> ApiResult<()> {
    if !is_dns1123_label(name, 63) {
        return Err(bad(
            "VOLUME::INVALID_NAME",
            format!("volume name '{name}' must be a DNS-1123 label (max 63 characters)"),
        ));
    }
    Ok(())
}

fn check_pvc(claim: &str) -> ApiResult<()> {
    if !is_dns1123_label(claim, 253) {
        return Err(bad(
            "VOLUME::INVALID_PVC_NAME",
            format!("PVC name '{claim}' must be a valid DNS-1123 name"),
        ));
    }
    Ok(())
}

fn parse_nfs(backend_ref: &str) -> ApiResult<VolumeSource> {
    let invalid = || {
        bad(
            "VOLUME::INVALID_BACKEND",
            format!("nfs backendRef '{backend_ref}' must be 'server:/export/path'"),
        )
    };
    let (server, export) = backend_ref.split_once(':').ok_or_else(invalid)?;
    let server_ok = !server.is_empty()
        && server
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b'[' | b']'));
    if !server_ok || !is_normalized_absolute(export) {
        return Err(invalid());
    }
    Ok(VolumeSource::Nfs {
        server: server.to_string(),
        export: export.to_string(),
    })
}

fn parse_entry<T: serde::de::DeserializeOwned>(v: &Value, what: &str) -> ApiResult<T> {
    serde_json::from_value(v.clone())
        .map_err(|e| bad("VOLUME::INVALID_BACKEND", format!("invalid {what}: {e}")))
}

/// Parses and validates the request's volume fields; `host_paths` says
/// where host paths are checked.
pub fn parse_volumes(
    volumes: Option<&[Value]>,
    bindings: Option<&[Value]>,
    host_paths: &HostPathCheck,
) -> ApiResult<Vec<VolumeMount>> {
    let volumes = volumes.unwrap_or(&[]);
    let bindings = bindings.unwrap_or(&[]);
    let seed_shape = !bindings.is_empty()
        || volumes
            .iter()
            .any(|v| v.get("backendType").is_some() || v.get("backendRef").is_some());
    let mounts = if seed_shape {
        parse_seed_volumes(volumes, bindings, host_paths)?
    } else {
        let specs = volumes
            .iter()
            .map(|v| parse_entry::<SpecVolume>(v, "volume"))
            .collect::<ApiResult<Vec<_>>>()?;
        check_unique_names(specs.iter().map(|v| v.name.as_str()))?;
        specs
            .into_iter()
            .map(|sv| spec_mount(sv, host_paths))
            .collect::<ApiResult<_>>()?
    };
    let mut paths = BTreeSet::new();
    for m in &mounts {
        if !paths.insert(m.mount_path.clone()) {
            return Err(bad(
                "VOLUME::INVALID_MOUNT_PATH",
                format!("mountPath '{}' is used twice", m.mount_path),
            ));
        }
    }
    Ok(mounts)
}

/// Each name a valid DNS-1123 label, none twice.
fn check_unique_names<'a>(names: impl Iterator<Item = &'a str>) -> ApiResult<()> {
    let mut seen = BTreeSet::new();
    for name in names {
        check_name(name)?;
        if !seen.insert(name) {
            return Err(bad(
                "VOLUME::DUPLICATE_NAME",
                format!("volume name '{name}' is declared twice"),
            ));
        }
    }
    Ok(())
}

/// The seed shape: declared `volumes[]`, mounted by `volumeBindings[]`.
fn parse_seed_volumes(
    volumes: &[Value],
    bindings: &[Value],
    host_paths: &HostPathCheck,
) -> ApiResult<Vec<VolumeMount>> {
    let declared = volumes
        .iter()
        .map(|v| parse_entry::<SeedVolume>(v, "volume"))
        .collect::<ApiResult<Vec<_>>>()?;
    check_unique_names(declared.iter().map(|v| v.name.as_str()))?;
    bindings
        .iter()
        .map(|b| {
            let sb: SeedBinding = parse_entry(b, "volume binding")?;
            let Some(vol) = declared.iter().find(|v| v.name == sb.volume_name) else {
                return Err(bad(
                    "VOLUME::INVALID_NAME",
                    format!(
                        "volume binding names undeclared volume '{}'",
                        sb.volume_name
                    ),
                ));
            };
            seed_mount(vol, sb, host_paths)
        })
        .collect()
}

fn seed_mount(
    vol: &SeedVolume,
    sb: SeedBinding,
    host_paths: &HostPathCheck,
) -> ApiResult<VolumeMount> {
    check_mount_path(&sb.mount_path)?;
    let read_only = match sb.access_mode.as_str() {
        "RW" => false,
        "RO" => true,
        other => {
            return Err(bad(
                "VOLUME::INVALID_ACCESS_MODE",
                format!("accessMode '{other}' must be RW or RO"),
            ));
        }
    };
    let sub = sb.sub_path.as_deref().map(check_sub_path).transpose()?;
    let (source, sub_path) = match vol.backend_type.as_str() {
        "local" => host_source(&vol.backend_ref, sub, host_paths)?,
        "pvc" => {
            check_pvc(&vol.backend_ref)?;
            (VolumeSource::Pvc(PvcClaim::named(&vol.backend_ref)), sub)
        }
        "nfs" => (parse_nfs(&vol.backend_ref)?, sub),
        other => {
            return Err(bad(
                "VOLUME::INVALID_BACKEND",
                format!("backendType '{other}' must be one of local, pvc, nfs"),
            ));
        }
    };
    Ok(VolumeMount {
        name: vol.name.clone(),
        source,
        mount_path: sb.mount_path,
        read_only,
        sub_path,
    })
}

/// The 1.1.1 shape: one entry per mount, exactly one backend each.
fn spec_mount(sv: SpecVolume, host_paths: &HostPathCheck) -> ApiResult<VolumeMount> {
    check_mount_path(&sv.mount_path)?;
    let sub = sv.sub_path.as_deref().map(check_sub_path).transpose()?;
    let (source, sub_path) = match (sv.host, sv.pvc, sv.ossfs) {
        (Some(h), None, None) => host_source(&h.path, sub, host_paths)?,
        (None, Some(p), None) => (VolumeSource::Pvc(pvc_claim(&sv.name, p)?), sub),
        (None, None, Some(o)) => {
            if !(3..=63).contains(&o.bucket.len()) || o.endpoint.is_empty() {
                return Err(bad(
                    "VOLUME::INVALID_OSSFS_BUCKET",
                    "ossfs needs a bucket of 3..63 characters and an endpoint",
                ));
            }
            (
                VolumeSource::Ossfs {
                    bucket: o.bucket,
                    endpoint: o.endpoint,
                },
                sub,
            )
        }
        _ => {
            return Err(bad(
                "VOLUME::INVALID_BACKEND",
                format!(
                    "volume '{}' must specify exactly one backend (host, pvc or ossfs)",
                    sv.name
                ),
            ));
        }
    };
    Ok(VolumeMount {
        name: sv.name,
        source,
        mount_path: sv.mount_path,
        read_only: sv.read_only,
        sub_path,
    })
}

/// The 400 for a backend a runtime cannot serve: names both, as OSEP-0003 asks.
pub fn unsupported(kind: &str, runtime: &str) -> ApiError {
    bad(
        "VOLUME::UNSUPPORTED_BACKEND",
        format!("volume backend '{kind}' is not supported by the {runtime} runtime"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(v: Value, allow: &[PathBuf]) -> ApiResult<Vec<VolumeMount>> {
        parse_volumes(Some(&[v]), None, &HostPathCheck::Local(allow.to_vec()))
    }
    fn seed(v: Value, b: Value, allow: &[PathBuf]) -> ApiResult<Vec<VolumeMount>> {
        parse_volumes(
            Some(&[v]),
            Some(&[b]),
            &HostPathCheck::Local(allow.to_vec()),
        )
    }
    fn code(r: ApiResult<Vec<VolumeMount>>) -> &'static str {
        r.expect_err("must be rejected").code
    }

    #[test]
    fn host_path_accepted_under_allowlist_and_resolved() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("task")).unwrap();
        let allow = vec![dir.path().to_path_buf()];
        let m = spec(
            json!({"name":"w","mountPath":"/mnt/w","host":{"path":dir.path()},"subPath":"task","readOnly":true}),
            &allow,
        )
        .unwrap();
        assert_eq!(
            m[0].source,
            VolumeSource::Host {
                path: std::fs::canonicalize(dir.path().join("task")).unwrap()
            }
        );
        assert!(m[0].read_only);
    }

    #[test]
    fn host_path_rules_reject() {
        let dir = tempfile::tempdir().unwrap();
        let allow = vec![dir.path().join("allowed")];
        std::fs::create_dir(dir.path().join("allowed")).unwrap();
        std::fs::create_dir(dir.path().join("secret")).unwrap();
        let d = dir.path().display();
        // relative
        assert_eq!(
            code(spec(
                json!({"name":"w","mountPath":"/m","host":{"path":"rel/x"}}),
                &allow
            )),
            "VOLUME::INVALID_HOST_PATH"
        );
        // not normalized
        assert_eq!(
            code(spec(
                json!({"name":"w","mountPath":"/m","host":{"path":format!("{d}/allowed/../secret")}}),
                &allow
            )),
            "VOLUME::INVALID_HOST_PATH"
        );
        // outside allowlist
        assert_eq!(
            code(spec(
                json!({"name":"w","mountPath":"/m","host":{"path":format!("{d}/secret")}}),
                &allow
            )),
            "VOLUME::HOST_PATH_NOT_ALLOWED"
        );
        // prefix match is per component, not per string
        std::fs::create_dir(dir.path().join("allowed-not")).unwrap();
        assert_eq!(
            code(spec(
                json!({"name":"w","mountPath":"/m","host":{"path":format!("{d}/allowed-not")}}),
                &allow
            )),
            "VOLUME::HOST_PATH_NOT_ALLOWED"
        );
        // symlink escape
        std::os::unix::fs::symlink(dir.path().join("secret"), dir.path().join("allowed/link"))
            .unwrap();
        assert_eq!(
            code(spec(
                json!({"name":"w","mountPath":"/m","host":{"path":format!("{d}/allowed/link")}}),
                &allow
            )),
            "VOLUME::HOST_PATH_NOT_ALLOWED"
        );
        // missing
        assert_eq!(
            code(spec(
                json!({"name":"w","mountPath":"/m","host":{"path":format!("{d}/allowed/nope")}}),
                &allow
            )),
            "VOLUME::HOST_PATH_NOT_FOUND"
        );
        // no allowlist at all
        assert_eq!(
            code(spec(
                json!({"name":"w","mountPath":"/m","host":{"path":format!("{d}/allowed")}}),
                &[]
            )),
            "VOLUME::HOST_PATH_NOT_ALLOWED"
        );
    }

    #[test]
    fn sub_path_rules() {
        let dir = tempfile::tempdir().unwrap();
        let allow = vec![dir.path().to_path_buf()];
        for sub in ["../x", "a/../../x", "/abs", ""] {
            assert_eq!(
                code(spec(
                    json!({"name":"w","mountPath":"/m","host":{"path":dir.path()},"subPath":sub}),
                    &allow
                )),
                "VOLUME::INVALID_SUB_PATH",
                "subPath {sub:?}"
            );
        }
        let m = spec(
            json!({"name":"w","mountPath":"/m","pvc":{"claimName":"data"},"subPath":"./a/b"}),
            &allow,
        )
        .unwrap();
        assert_eq!(m[0].sub_path.as_deref(), Some("a/b"));
    }

    #[test]
    fn pvc_names_are_dns1123() {
        assert!(
            spec(
                json!({"name":"w","mountPath":"/m","pvc":{"claimName":"user-a-pvc"}}),
                &[]
            )
            .is_ok()
        );
        for bad in ["User", "-a", "a-", "a_b", "a.b", ""] {
            assert_eq!(
                code(spec(
                    json!({"name":"w","mountPath":"/m","pvc":{"claimName":bad}}),
                    &[]
                )),
                "VOLUME::INVALID_PVC_NAME",
                "{bad:?}"
            );
        }
        assert_eq!(
            code(seed(
                json!({"name":"w","backendType":"pvc","backendRef":"Bad_Name"}),
                json!({"volumeName":"w","mountPath":"/m","accessMode":"RW"}),
                &[]
            )),
            "VOLUME::INVALID_PVC_NAME"
        );
    }

    #[test]
    fn pvc_fields_are_read_with_opensandbox_defaults() {
        let m = spec(
            json!({"name":"w","mountPath":"/m","pvc":{"claimName":"data"}}),
            &[],
        )
        .unwrap();
        assert_eq!(m[0].source, VolumeSource::Pvc(PvcClaim::named("data")));
        // What the Python SDK sends: every field, unset ones as null.
        let m = spec(
            json!({"name":"w","mountPath":"/m","pvc":{
                "claimName":"data","createIfNotExists":false,"deleteOnSandboxTermination":true,
                "storageClass":null,"storage":null,"accessModes":null}}),
            &[],
        )
        .unwrap();
        let VolumeSource::Pvc(c) = &m[0].source else {
            panic!("{m:?}")
        };
        assert!(!c.create_if_missing && c.delete_on_sandbox_delete);
        assert_eq!((&c.storage, &c.storage_class), (&None, &None));
        assert!(c.access_modes.is_empty());
        let m = spec(
            json!({"name":"w","mountPath":"/m","pvc":{
                "claimName":"data","storage":"2Gi","storageClass":"local","accessModes":["ReadOnlyMany"]}}),
            &[],
        )
        .unwrap();
        assert_eq!(
            m[0].source,
            VolumeSource::Pvc(PvcClaim {
                storage: Some("2Gi".into()),
                storage_class: Some("local".into()),
                access_modes: vec!["ReadOnlyMany".into()],
                ..PvcClaim::named("data")
            })
        );
    }

    #[test]
    fn pvc_refuses_unknown_fields_and_bad_storage() {
        // Never accepted and ignored.
        let e = spec(
            json!({"name":"w","mountPath":"/m","pvc":{"claimName":"data","sizeLimit":"1Gi"}}),
            &[],
        )
        .unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("sizeLimit"), "{}", e.message);
        let e = spec(
            json!({"name":"w","mountPath":"/m","pvc":{"claimName":"data","storage":"lots"}}),
            &[],
        )
        .unwrap_err();
        assert_eq!(e.code, "VOLUME::INVALID_STORAGE");
        assert!(
            e.message.contains("pvc.storage 'lots'") && e.message.contains("volume 'w'"),
            "{}",
            e.message
        );
        let e = spec(
            json!({"name":"w","mountPath":"/m","pvc":{"claimName":"data","createIfNotExists":"yes"}}),
            &[],
        )
        .unwrap_err();
        assert!(e.message.contains("invalid type"), "{}", e.message);
        let e = spec(
            json!({"name":"w","mountPath":"/m","host":{"path":"/x","readOnly":true}}),
            &[],
        )
        .unwrap_err();
        assert!(e.message.contains("readOnly"), "{}", e.message);
    }

    #[test]
    fn nfs_needs_server_and_absolute_export() {
        let m = seed(
            json!({"name":"w","backendType":"nfs","backendRef":"10.0.0.1:/exports/a"}),
            json!({"volumeName":"w","mountPath":"/m","accessMode":"RO"}),
            &[],
        )
        .unwrap();
        assert_eq!(
            m[0].source,
            VolumeSource::Nfs {
                server: "10.0.0.1".into(),
                export: "/exports/a".into()
            }
        );
        assert!(m[0].read_only);
        for r in ["nfs.local", ":/x", "srv:rel", "srv:/a/../b", "s rv:/x"] {
            assert_eq!(
                code(seed(
                    json!({"name":"w","backendType":"nfs","backendRef":r}),
                    json!({"volumeName":"w","mountPath":"/m","accessMode":"RO"}),
                    &[]
                )),
                "VOLUME::INVALID_BACKEND",
                "{r:?}"
            );
        }
    }

    #[test]
    fn seed_shape_rules() {
        let dir = tempfile::tempdir().unwrap();
        let allow = vec![dir.path().to_path_buf()];
        let v = json!({"name":"w","backendType":"local","backendRef":dir.path()});
        let ok = seed(
            v.clone(),
            json!({"volumeName":"w","mountPath":"/mnt/work","accessMode":"RW"}),
            &allow,
        )
        .unwrap();
        assert!(!ok[0].read_only);
        assert_eq!(
            code(seed(
                v.clone(),
                json!({"volumeName":"w","mountPath":"/m","accessMode":"rw"}),
                &allow
            )),
            "VOLUME::INVALID_ACCESS_MODE"
        );
        assert_eq!(
            code(seed(
                v.clone(),
                json!({"volumeName":"other","mountPath":"/m","accessMode":"RW"}),
                &allow
            )),
            "VOLUME::INVALID_NAME"
        );
        assert_eq!(
            code(seed(
                json!({"name":"w","backendType":"s3","backendRef":"x"}),
                json!({"volumeName":"w","mountPath":"/m","accessMode":"RW"}),
                &allow
            )),
            "VOLUME::INVALID_BACKEND"
        );
    }

    #[test]
    fn mount_path_and_names() {
        for p in [
            "rel",
            "/a/../b",
            "/",
            "/opt/sandbolt",
            "/opt/sandbolt/x",
            "/proc",
        ] {
            assert_eq!(
                code(spec(
                    json!({"name":"w","mountPath":p,"pvc":{"claimName":"c"}}),
                    &[]
                )),
                "VOLUME::INVALID_MOUNT_PATH",
                "{p:?}"
            );
        }
        assert_eq!(
            code(spec(
                json!({"name":"Bad","mountPath":"/m","pvc":{"claimName":"c"}}),
                &[]
            )),
            "VOLUME::INVALID_NAME"
        );
        assert_eq!(
            code(parse_volumes(
                Some(&[
                    json!({"name":"a","mountPath":"/m","pvc":{"claimName":"c"}}),
                    json!({"name":"a","mountPath":"/n","pvc":{"claimName":"c"}})
                ]),
                None,
                &HostPathCheck::Local(vec![])
            )),
            "VOLUME::DUPLICATE_NAME"
        );
        assert_eq!(
            code(parse_volumes(
                Some(&[
                    json!({"name":"a","mountPath":"/m","pvc":{"claimName":"c"}}),
                    json!({"name":"b","mountPath":"/m","pvc":{"claimName":"c"}})
                ]),
                None,
                &HostPathCheck::Local(vec![])
            )),
            "VOLUME::INVALID_MOUNT_PATH"
        );
        assert_eq!(
            code(spec(
                json!({"name":"a","mountPath":"/m","pvc":{"claimName":"c"},"host":{"path":"/x"}}),
                &[]
            )),
            "VOLUME::INVALID_BACKEND"
        );
        assert_eq!(
            code(spec(json!({"name":"a","mountPath":"/m"}), &[])),
            "VOLUME::INVALID_BACKEND"
        );
    }

    #[test]
    fn on_node_checks_syntax_only_and_keeps_path_and_sub_path() {
        // Neither path exists here and there is no allowlist: the agent of
        // the node decides. The request's path and subPath travel unchanged.
        let m = parse_volumes(
            Some(&[
                json!({"name":"w","mountPath":"/mnt/w","host":{"path":"/srv/nowhere-here"},"subPath":"./task","readOnly":true}),
            ]),
            None,
            &HostPathCheck::OnNode,
        )
        .unwrap();
        assert_eq!(
            m[0],
            VolumeMount {
                name: "w".into(),
                source: VolumeSource::Host {
                    path: "/srv/nowhere-here".into()
                },
                mount_path: "/mnt/w".into(),
                read_only: true,
                sub_path: Some("task".into()),
            }
        );
        let m = parse_volumes(
            Some(&[json!({"name":"w","backendType":"local","backendRef":"/data/x"})]),
            Some(&[json!({"volumeName":"w","mountPath":"/m","accessMode":"RW","subPath":"a"})]),
            &HostPathCheck::OnNode,
        )
        .unwrap();
        assert_eq!(m[0].sub_path.as_deref(), Some("a"));
        // Syntax is still checked here.
        let on_node = |v: Value| parse_volumes(Some(&[v]), None, &HostPathCheck::OnNode);
        for (v, c) in [
            (
                json!({"name":"w","mountPath":"/m","host":{"path":"rel"}}),
                "VOLUME::INVALID_HOST_PATH",
            ),
            (
                json!({"name":"w","mountPath":"/m","host":{"path":"/a/../b"}}),
                "VOLUME::INVALID_HOST_PATH",
            ),
            (
                json!({"name":"w","mountPath":"/m","host":{"path":"/a"},"subPath":"../b"}),
                "VOLUME::INVALID_SUB_PATH",
            ),
            (
                json!({"name":"w","mountPath":"/proc/x","host":{"path":"/a"}}),
                "VOLUME::INVALID_MOUNT_PATH",
            ),
        ] {
            assert_eq!(code(on_node(v.clone())), c, "{v}");
        }
    }
}
