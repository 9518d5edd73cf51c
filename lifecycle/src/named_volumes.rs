//! Named volumes as a REST resource: `/volumes` (create, list, get,
//! delete), their snapshots, restore, fork, and mounting one into a running
//! sandbox (`/sandboxes/{id}/volumes`). This module holds the wire types,
//! their validation and the answers; [`crate::volume_routes`] serves them
//! and a [`crate::Backend`] executes them (the controller over its native
//! `VolumeService`; the Docker runtime has no such volumes and says so).
//!
//! Requests refuse unknown fields: a field accepted and ignored (a size
//! that sets no quota, a node that places nothing) is a promise silently
//! broken.

use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use crate::error::{ApiError, ApiResult};
use crate::volumes::{PvcClaim, VolumeMount, VolumeSource, is_dns1123_label};

/// How many sandboxes may mount a volume, and how (Kubernetes names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AccessMode {
    /// At most one read-write mount at a time; read-only mounts are fine.
    ReadWriteOnce,
    /// Read-only mounts only.
    ReadOnlyMany,
    /// Any number of read-write mounts.
    ReadWriteMany,
}

impl AccessMode {
    /// Parses the long Kubernetes name or its short form (`RWO`, `ROX`,
    /// `RWX`); `field` names the request field in the 400.
    pub fn parse(field: &str, s: &str) -> ApiResult<Self> {
        match s {
            "ReadWriteOnce" | "RWO" => Ok(Self::ReadWriteOnce),
            "ReadOnlyMany" | "ROX" => Ok(Self::ReadOnlyMany),
            "ReadWriteMany" | "RWX" => Ok(Self::ReadWriteMany),
            other => Err(ApiError::invalid_code(
                "VOLUME::INVALID_ACCESS_MODE",
                format!(
                    "{field} '{other}' must be one of ReadWriteOnce, ReadOnlyMany, ReadWriteMany \
                     (or RWO, ROX, RWX)"
                ),
            )),
        }
    }

    /// The long name, as answers spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ReadWriteOnce => "ReadWriteOnce",
            Self::ReadOnlyMany => "ReadOnlyMany",
            Self::ReadWriteMany => "ReadWriteMany",
        }
    }
}

/// The only backend named volumes have: btrfs (or plain directories) on
/// the node's volume root.
pub const BACKEND_LOCAL: &str = "local";

/// The shared backend: the cluster's JuiceFS filesystem, reachable from
/// every node whose agent mounts it (controller runtime only).
pub const BACKEND_JUICEFS: &str = "juicefs";

fn invalid(code: &'static str, message: String) -> ApiError {
    ApiError::invalid_code(code, message)
}

/// A volume name in a body: a DNS-1123 label of at most 63 characters.
pub fn check_volume_name(field: &str, name: &str) -> ApiResult<()> {
    if is_dns1123_label(name, 63) {
        return Ok(());
    }
    Err(invalid(
        "VOLUME::INVALID_NAME",
        format!(
            "{field} '{name}' must be a DNS-1123 label (lowercase letters, digits and '-', \
             alphanumeric at both ends, at most 63 characters)"
        ),
    ))
}

/// A snapshot name in a body: same rule as volume names.
pub fn check_snapshot_name(field: &str, name: &str) -> ApiResult<()> {
    check_volume_name(field, name).map_err(|e| ApiError {
        code: "VOLUME::INVALID_SNAPSHOT_NAME",
        ..e
    })
}

/// A volume named in a path that cannot exist: 404 without a round trip.
pub fn volume_not_found(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "VOLUME_NOT_FOUND",
        format!("Volume {name} not found."),
    )
}

pub fn snapshot_not_found(volume: &str, snapshot: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "SNAPSHOT_NOT_FOUND",
        format!("Snapshot {snapshot} of volume {volume} not found."),
    )
}

/// A path's volume name, or the 404 it earns.
pub fn path_volume(name: &str) -> ApiResult<()> {
    if is_dns1123_label(name, 63) {
        Ok(())
    } else {
        Err(volume_not_found(name))
    }
}

/// A path's snapshot name, or the 404 it earns.
pub fn path_snapshot(volume: &str, snapshot: &str) -> ApiResult<()> {
    if is_dns1123_label(snapshot, 63) {
        Ok(())
    } else {
        Err(snapshot_not_found(volume, snapshot))
    }
}

/// A quota: a positive byte quantity, kept as spelled (the controller and
/// the agent parse it again with the same parser).
fn check_size(field: &str, size: &str) -> ApiResult<String> {
    let size = size.trim();
    sandbolt_proto::quantity::bytes(size).map_err(|_| {
        invalid(
            "VOLUME::INVALID_SIZE",
            format!(
                "{field} '{size}' must be a positive byte quantity such as 512Mi or 10Gi \
                 (omit it for no quota)"
            ),
        )
    })?;
    Ok(size.to_string())
}

/// The storage backend a request names: empty, `local` or `juicefs`.
pub fn check_backend(field: &str, backend: Option<&str>) -> ApiResult<()> {
    match backend {
        None | Some("") | Some(BACKEND_LOCAL) | Some(BACKEND_JUICEFS) => Ok(()),
        Some(other) => Err(invalid(
            "VOLUME::UNSUPPORTED_BACKEND",
            format!(
                "{field} '{other}' is not served: named volumes have the '{BACKEND_LOCAL}' backend \
                 (btrfs on the node) or '{BACKEND_JUICEFS}' (the cluster's JuiceFS); omit it or \
                 say one of them"
            ),
        )),
    }
}

/// `POST /volumes` body.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateVolumeBody {
    pub name: String,
    pub access_mode: Option<String>,
    pub size: Option<String>,
    pub backend: Option<String>,
    pub node_name: Option<String>,
}

/// A checked `POST /volumes`.
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeCreate {
    pub name: String,
    /// `None`: ReadWriteOnce.
    pub access_mode: Option<AccessMode>,
    /// `None`: no quota.
    pub size: Option<String>,
    /// `None`: the backend picks the node.
    pub node_name: Option<String>,
    /// `None`: `local`.
    pub backend: Option<String>,
}

impl CreateVolumeBody {
    pub fn check(self) -> ApiResult<VolumeCreate> {
        check_volume_name("name", &self.name)?;
        check_backend("backend", self.backend.as_deref())?;
        Ok(VolumeCreate {
            name: self.name,
            access_mode: self
                .access_mode
                .as_deref()
                .map(|m| AccessMode::parse("accessMode", m))
                .transpose()?,
            size: self
                .size
                .as_deref()
                .map(|s| check_size("size", s))
                .transpose()?,
            node_name: self.node_name.filter(|n| !n.is_empty()),
            backend: self.backend.filter(|b| !b.is_empty()),
        })
    }
}

/// `POST /volumes/{name}/snapshots` body.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateSnapshotBody {
    pub name: String,
}

impl CreateSnapshotBody {
    pub fn check(self) -> ApiResult<String> {
        check_snapshot_name("name", &self.name)?;
        Ok(self.name)
    }
}

/// `POST /volumes/{name}/restore` body.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RestoreBody {
    pub snapshot: String,
}

impl RestoreBody {
    pub fn check(self) -> ApiResult<String> {
        check_snapshot_name("snapshot", &self.snapshot)?;
        Ok(self.snapshot)
    }
}

/// `POST /volumes/{name}/fork` body.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ForkBody {
    pub name: String,
    pub snapshot: Option<String>,
    pub access_mode: Option<String>,
    pub size: Option<String>,
}

/// A checked fork: `name` made from `source` (at `snapshot`, or its
/// current data).
#[derive(Debug, Clone, PartialEq)]
pub struct VolumeFork {
    pub source: String,
    pub name: String,
    pub snapshot: Option<String>,
    /// `None`: the source's.
    pub access_mode: Option<AccessMode>,
    pub size: Option<String>,
}

impl ForkBody {
    pub fn check(self, source: &str) -> ApiResult<VolumeFork> {
        check_volume_name("name", &self.name)?;
        let snapshot = self.snapshot.filter(|s| !s.is_empty());
        if let Some(s) = &snapshot {
            check_snapshot_name("snapshot", s)?;
        }
        Ok(VolumeFork {
            source: source.to_string(),
            name: self.name,
            snapshot,
            access_mode: self
                .access_mode
                .as_deref()
                .map(|m| AccessMode::parse("accessMode", m))
                .transpose()?,
            size: self
                .size
                .as_deref()
                .map(|s| check_size("size", s))
                .transpose()?,
        })
    }
}

/// Checks the `pvc` of a volume mounted into a running sandbox; anything
/// but a `pvc` is refused (only named volumes are attached).
pub fn check_attach(mount: &VolumeMount) -> ApiResult<&PvcClaim> {
    match &mount.source {
        VolumeSource::Pvc(claim) => Ok(claim),
        other => Err(invalid(
            "VOLUME::UNSUPPORTED_BACKEND",
            format!(
                "volume '{}': only a pvc (named volume) can be mounted into a running sandbox, \
                 not {}",
                mount.name,
                other.kind()
            ),
        )),
    }
}

/// What a volume's backend can do (`capabilities`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Capabilities {
    /// "btrfs", or "directory" (copies on snapshot and fork; no quota).
    pub backend: String,
    pub instant_snapshots: bool,
    pub instant_forks: bool,
    pub quota: bool,
    /// Reachable from every node (juicefs): the volume pins no sandbox.
    pub shared: bool,
}

/// `Snapshot`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    pub volume: String,
    pub name: String,
    pub created_at: String,
}

/// A sandbox that mounts a volume.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct MountHolder {
    pub sandbox_id: String,
    pub namespace: String,
    pub mount_path: String,
    pub read_only: bool,
    /// The node the holder runs on (a shared volume has holders on several).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub node_name: String,
}

/// `Volume`. `size`, `usedBytes` and `forkedFrom` are `null` when there is
/// none (no quota, usage unknown, not a fork), so the shape never changes.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Volume {
    pub name: String,
    pub backend: String,
    pub access_mode: &'static str,
    /// The quota as a quantity (`10Gi`).
    pub size: Option<String>,
    /// The quota in bytes; 0 = none.
    pub size_bytes: i64,
    pub node_name: String,
    pub created_at: String,
    pub used_bytes: Option<i64>,
    pub capabilities: Capabilities,
    pub snapshots: Vec<Snapshot>,
    pub mounts: Vec<MountHolder>,
    /// `<volume>` or `<volume>@<snapshot>`.
    pub forked_from: Option<String>,
    /// False when the volume's node is not reporting: what is shown is its
    /// last report, and nothing can be done with the volume now.
    pub available: bool,
}

/// `{items: [...]}` of the list routes.
#[derive(Debug, Clone, Serialize)]
pub struct Items<T> {
    pub items: Vec<T>,
}

/// One mount of a sandbox, in the shape of the create request's `volumes`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxVolume {
    pub name: String,
    pub mount_path: String,
    pub read_only: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sub_path: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<HostOut>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pvc: Option<PvcOut>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HostOut {
    pub path: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PvcOut {
    pub claim_name: String,
}

/// `POST /sandboxes/{id}/volumes` answer: every volume the sandbox mounts.
#[derive(Debug, Clone, Serialize)]
pub struct SandboxVolumes {
    pub volumes: Vec<SandboxVolume>,
}

/// Bytes as the shortest exact binary quantity (`1073741824` → `1Gi`;
/// `1000` stays `1000`).
pub fn bytes_quantity(bytes: i64) -> String {
    const SUFFIXES: [(&str, u32); 6] = [
        ("Ei", 60),
        ("Pi", 50),
        ("Ti", 40),
        ("Gi", 30),
        ("Mi", 20),
        ("Ki", 10),
    ];
    for (suffix, shift) in SUFFIXES {
        let unit = 1i64 << shift;
        if bytes >= unit && bytes % unit == 0 {
            return format!("{}{suffix}", bytes / unit);
        }
    }
    bytes.to_string()
}

/// The 501 every named-volume route answers on a runtime without named
/// volumes: names the route, the runtime, and what to run instead.
pub fn unsupported_route(route: &str, runtime: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_IMPLEMENTED,
        "VOLUME::NAMED_VOLUMES_UNSUPPORTED",
        format!(
            "{route}: named volumes with snapshots and forks need the containerd runtime; \
             the {runtime} runtime has none. Run the lifecycle on the controller backend \
             (`sandbolt up`, or `sandbolt lifecycle --controller ADDR`). On {runtime}, a \
             sandbox's `pvc` volume is a Docker named volume."
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, String> {
        serde_json::from_value(v).map_err(|e| e.to_string())
    }

    #[test]
    fn access_modes_take_long_and_short_names_and_answer_long() {
        for (s, m) in [
            ("ReadWriteOnce", AccessMode::ReadWriteOnce),
            ("RWO", AccessMode::ReadWriteOnce),
            ("ReadOnlyMany", AccessMode::ReadOnlyMany),
            ("ROX", AccessMode::ReadOnlyMany),
            ("ReadWriteMany", AccessMode::ReadWriteMany),
            ("RWX", AccessMode::ReadWriteMany),
        ] {
            assert_eq!(AccessMode::parse("accessMode", s).unwrap(), m);
        }
        assert_eq!(AccessMode::ReadOnlyMany.as_str(), "ReadOnlyMany");
        for bad in ["rwo", "ReadWriteOncePod", "", "RW"] {
            let e = AccessMode::parse("accessMode", bad).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains("accessMode"), "{}", e.message);
        }
    }

    #[test]
    fn create_body_is_checked_and_names_the_field() {
        let c = body::<CreateVolumeBody>(json!({
            "name": "data-1", "accessMode": "RWX", "size": "1Gi", "backend": "local", "nodeName": "n1"
        }))
        .unwrap()
        .check()
        .unwrap();
        assert_eq!(
            c,
            VolumeCreate {
                name: "data-1".into(),
                access_mode: Some(AccessMode::ReadWriteMany),
                size: Some("1Gi".into()),
                node_name: Some("n1".into()),
                backend: Some("local".into()),
            }
        );
        let minimal = body::<CreateVolumeBody>(json!({"name": "a"}))
            .unwrap()
            .check()
            .unwrap();
        assert_eq!((minimal.access_mode, minimal.size), (None, None));
        for (v, field, code) in [
            (
                json!({"name": "Data"}),
                "name 'Data'",
                "VOLUME::INVALID_NAME",
            ),
            (
                json!({"name": "a".repeat(64)}),
                "name 'aaa",
                "VOLUME::INVALID_NAME",
            ),
            (
                json!({"name": "a", "size": "0"}),
                "size '0'",
                "VOLUME::INVALID_SIZE",
            ),
            (
                json!({"name": "a", "size": "lots"}),
                "size 'lots'",
                "VOLUME::INVALID_SIZE",
            ),
            (
                json!({"name": "a", "backend": "ebs"}),
                "backend 'ebs'",
                "VOLUME::UNSUPPORTED_BACKEND",
            ),
            (
                json!({"name": "a", "accessMode": "rw"}),
                "accessMode 'rw'",
                "VOLUME::INVALID_ACCESS_MODE",
            ),
        ] {
            let e = body::<CreateVolumeBody>(v.clone())
                .unwrap()
                .check()
                .unwrap_err();
            assert_eq!((e.status.as_u16(), e.code), (400, code), "{v}");
            assert!(e.message.contains(field), "{v}: {}", e.message);
        }
        // Unknown fields are refused, not dropped.
        let e = body::<CreateVolumeBody>(json!({"name": "a", "sizeGi": 1})).unwrap_err();
        assert!(e.contains("sizeGi"), "{e}");
    }

    #[test]
    fn fork_snapshot_and_restore_bodies() {
        let f = body::<ForkBody>(json!({"name": "b", "snapshot": "s1", "size": "2Gi"}))
            .unwrap()
            .check("a")
            .unwrap();
        assert_eq!(
            f,
            VolumeFork {
                source: "a".into(),
                name: "b".into(),
                snapshot: Some("s1".into()),
                access_mode: None,
                size: Some("2Gi".into()),
            }
        );
        let e = body::<ForkBody>(json!({"name": "b", "snapshot": "S 1"}))
            .unwrap()
            .check("a")
            .unwrap_err();
        assert_eq!(e.code, "VOLUME::INVALID_SNAPSHOT_NAME");
        assert!(e.message.contains("snapshot 'S 1'"), "{}", e.message);
        assert_eq!(
            body::<CreateSnapshotBody>(json!({"name": "-x"}))
                .unwrap()
                .check()
                .unwrap_err()
                .code,
            "VOLUME::INVALID_SNAPSHOT_NAME"
        );
        assert_eq!(
            body::<RestoreBody>(json!({"snapshot": "s1"}))
                .unwrap()
                .check()
                .unwrap(),
            "s1"
        );
        assert!(body::<RestoreBody>(json!({"snapshot": "s1", "force": true})).is_err());
    }

    #[test]
    fn quantities_are_exact() {
        assert_eq!(bytes_quantity(1 << 30), "1Gi");
        assert_eq!(bytes_quantity(3 << 20), "3Mi");
        assert_eq!(bytes_quantity(1536 << 20), "1536Mi");
        assert_eq!(bytes_quantity(1000), "1000");
        assert_eq!(bytes_quantity(1024), "1Ki");
    }

    #[test]
    fn the_volume_answer_keeps_its_shape() {
        let v = Volume {
            name: "a".into(),
            backend: "local".into(),
            access_mode: "ReadWriteOnce",
            size: None,
            size_bytes: 0,
            node_name: "n1".into(),
            created_at: "2026-01-01T00:00:00.000000Z".into(),
            used_bytes: None,
            capabilities: Capabilities::default(),
            snapshots: vec![],
            mounts: vec![],
            forked_from: None,
            available: true,
        };
        let j = serde_json::to_value(&v).unwrap();
        for k in ["size", "usedBytes", "forkedFrom"] {
            assert!(j[k].is_null(), "{k}: {j}");
        }
        assert_eq!(j["accessMode"], "ReadWriteOnce");
        assert_eq!(j["capabilities"]["instantSnapshots"], false);
    }

    #[test]
    fn the_unsupported_answer_names_route_and_runtime() {
        let e = unsupported_route("POST /volumes/{name}/fork", "docker");
        assert_eq!(e.status, 501);
        assert!(e.message.starts_with("POST /volumes/{name}/fork:"));
        assert!(e.message.contains("docker runtime"), "{}", e.message);
        assert!(e.message.contains("containerd"), "{}", e.message);
    }
}
