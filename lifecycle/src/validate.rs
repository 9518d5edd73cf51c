//! Create-request validation: turns a wire `CreateSandboxRequest` into a
//! [`CreatePlan`] a backend can execute, or a precise 400.

use std::collections::BTreeMap;
use std::path::PathBuf;

use chrono::{DateTime, Duration, Utc};
use serde_json::Value;

use crate::error::{ApiError, ApiResult};
use crate::model::CreateSandboxRequest;
use crate::volumes::{VolumeMount, parse_volumes};

/// Lower bound of `timeout` (OpenSandbox #442 keeps it when TTL is asked for).
pub const MIN_TIMEOUT_SECS: i64 = 60;
/// Default upper bound of `timeout`.
pub const DEFAULT_MAX_TIMEOUT_SECS: i64 = 86_400;
/// Label prefix OpenSandbox reserves for itself; users may not set it.
pub const RESERVED_PREFIX: &str = "opensandbox.io/";

/// Everything a backend needs to create one sandbox.
#[derive(Debug, Clone)]
pub struct CreatePlan {
    pub id: String,
    pub image: String,
    pub entrypoint: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub created_at: DateTime<Utc>,
    /// `None` = manual cleanup.
    pub expires_at: Option<DateTime<Utc>>,
    pub memory_bytes: Option<i64>,
    pub nano_cpus: Option<i64>,
    pub volumes: Vec<VolumeMount>,
}

/// Limits the validator enforces that come from configuration.
#[derive(Debug, Clone)]
pub struct Policy {
    pub max_timeout_secs: i64,
    pub allow_host_paths: Vec<PathBuf>,
}

pub fn parse_timeout(raw: Option<&Value>, max: i64) -> ApiResult<Option<i64>> {
    let v = match raw {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    let secs = v.as_i64().ok_or_else(|| {
        ApiError::invalid(format!(
            "timeout must be an integer number of seconds or null, got {v}"
        ))
    })?;
    if secs <= 0 {
        return Err(ApiError::invalid(format!(
            "timeout must be positive ({MIN_TIMEOUT_SECS}..{max} seconds); omit it or send null for manual cleanup, got {secs}"
        )));
    }
    if !(MIN_TIMEOUT_SECS..=max).contains(&secs) {
        return Err(ApiError::invalid(format!(
            "timeout must be between {MIN_TIMEOUT_SECS} and {max} seconds, got {secs}"
        )));
    }
    Ok(Some(secs))
}

/// A Kubernetes-style label name part: alphanumeric ends, `-_.` inside, ≤ 63.
fn is_label_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// Metadata keys and values become container labels (Docker) or
/// Kubernetes labels (controller store), so they follow label syntax.
pub fn check_metadata_entry(key: &str, value: &str) -> ApiResult<()> {
    if key.starts_with(RESERVED_PREFIX) {
        return Err(ApiError::invalid_code(
            "INVALID_METADATA_LABEL",
            format!("Metadata key '{key}' is reserved ({RESERVED_PREFIX} prefix)."),
        ));
    }
    let name = match key.rsplit_once('/') {
        Some((prefix, name)) => {
            let prefix_ok = !prefix.is_empty()
                && prefix.len() <= 253
                && prefix.split('.').all(crate::volumes::is_dns1123_label_any);
            if !prefix_ok {
                return Err(ApiError::invalid_code(
                    "INVALID_METADATA_LABEL",
                    format!("Metadata key '{key}' has an invalid prefix"),
                ));
            }
            name
        }
        None => key,
    };
    if !is_label_name(name) {
        return Err(ApiError::invalid_code(
            "INVALID_METADATA_LABEL",
            format!(
                "Metadata key '{key}' must be a label name (alphanumeric, '-', '_', '.'; max 63)"
            ),
        ));
    }
    if !value.is_empty() && !is_label_name(value) {
        return Err(ApiError::invalid_code(
            "INVALID_METADATA_LABEL",
            format!(
                "Metadata value for '{key}' must be a label value (alphanumeric, '-', '_', '.'; max 63)"
            ),
        ));
    }
    Ok(())
}

/// Parses a CPU quantity ("500m", "2", "1.5") into nano-CPUs.
pub fn parse_cpu(q: &str) -> Option<i64> {
    let (num, scale) = match q.strip_suffix('m') {
        Some(n) => (n, 1_000_000.0),
        None => (q, 1_000_000_000.0),
    };
    let v: f64 = num.parse().ok()?;
    (v.is_finite() && v > 0.0).then(|| (v * scale).round() as i64)
}

/// Parses a memory quantity ("512Mi", "1G", "1048576") into bytes.
pub fn parse_memory(q: &str) -> Option<i64> {
    const UNITS: &[(&str, f64)] = &[
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("k", 1e3),
        ("K", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
    ];
    let (num, mult) = UNITS
        .iter()
        .find_map(|(s, m)| q.strip_suffix(s).map(|n| (n, *m)))
        .unwrap_or((q, 1.0));
    let v: f64 = num.parse().ok()?;
    (v.is_finite() && v > 0.0).then(|| (v * mult).round() as i64)
}

fn reject_if_set(v: &Option<Value>, field: &str) -> ApiResult<()> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(_) => Err(ApiError::invalid_code(
            "UNSUPPORTED_FIELD",
            format!("{field} is not supported by sandbolt"),
        )),
    }
}

/// Validates a create request. `now` is passed in so tests can pin it.
pub fn plan_create(
    req: CreateSandboxRequest,
    policy: &Policy,
    now: DateTime<Utc>,
) -> ApiResult<CreatePlan> {
    // A request sandbolt cannot serve is the client's to change: 400, like
    // every other unsupported field (and like OSEP-0003's unsupported
    // volume backends), not a 5xx that reads as a server fault.
    if req.snapshot_id.is_some() {
        return Err(ApiError::invalid_code(
            "UNSUPPORTED_FIELD",
            "snapshotId is not supported by sandbolt: create from an image",
        ));
    }
    if req.template_id.is_some() {
        return Err(ApiError::invalid_code(
            "UNSUPPORTED_FIELD",
            "templateId is not supported by sandbolt: create from an image",
        ));
    }
    let image = req
        .image
        .ok_or_else(|| ApiError::invalid("image is required"))?;
    if image.uri.trim().is_empty() || image.uri.chars().any(char::is_whitespace) {
        return Err(ApiError::invalid(
            "image.uri must be a non-empty image reference",
        ));
    }
    if image.auth.is_some() {
        return Err(ApiError::invalid_code(
            "UNSUPPORTED_FIELD",
            "image.auth is not supported: sandbolt uses images present on the node",
        ));
    }
    let entrypoint = req
        .entrypoint
        .ok_or_else(|| ApiError::invalid("entrypoint is required when image is provided"))?;
    if entrypoint.is_empty() || entrypoint[0].is_empty() {
        return Err(ApiError::invalid("entrypoint must name a program"));
    }
    if entrypoint.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::invalid("entrypoint must not contain NUL bytes"));
    }
    let timeout = parse_timeout(req.timeout.as_ref(), policy.max_timeout_secs)?;

    let mut env = BTreeMap::new();
    for (k, v) in req.env.unwrap_or_default() {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(ApiError::invalid(format!(
                "invalid environment variable name '{k}'"
            )));
        }
        if let Some(v) = v {
            if v.contains('\0') {
                return Err(ApiError::invalid(format!(
                    "environment variable '{k}' contains NUL"
                )));
            }
            env.insert(k, v);
        }
    }
    let metadata = req.metadata.unwrap_or_default();
    for (k, v) in &metadata {
        check_metadata_entry(k, v)?;
    }

    let mut memory_bytes = None;
    let mut nano_cpus = None;
    for (k, v) in req.resource_limits.unwrap_or_default() {
        match k.as_str() {
            "cpu" => {
                nano_cpus = Some(parse_cpu(&v).ok_or_else(|| {
                    ApiError::invalid(format!("resourceLimits.cpu '{v}' is not a CPU quantity"))
                })?)
            }
            "memory" => {
                memory_bytes = Some(parse_memory(&v).ok_or_else(|| {
                    ApiError::invalid(format!(
                        "resourceLimits.memory '{v}' is not a memory quantity"
                    ))
                })?)
            }
            other => {
                return Err(ApiError::invalid_code(
                    "UNSUPPORTED_FIELD",
                    format!("resourceLimits.{other} is not supported by sandbolt"),
                ));
            }
        }
    }
    reject_if_set(&req.network_policy, "networkPolicy")?;
    reject_if_set(&req.lifecycle, "lifecycle")?;
    if let Some(cp) = &req.credential_proxy
        && cp.get("enabled").and_then(Value::as_bool) == Some(true)
    {
        return Err(ApiError::invalid_code(
            "UNSUPPORTED_FIELD",
            "credentialProxy is not supported by sandbolt",
        ));
    }
    if req.secure_access {
        return Err(ApiError::invalid_code(
            "UNSUPPORTED_FIELD",
            "secureAccess is not supported by sandbolt (endpoints already carry a per-sandbox token)",
        ));
    }
    if let Some(p) = &req.platform {
        let host_arch = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        if p.os != "linux" || p.arch != host_arch {
            return Err(ApiError::invalid(format!(
                "platform {}/{} cannot be served here (linux/{host_arch})",
                p.os, p.arch
            )));
        }
    }
    let volumes = parse_volumes(
        req.volumes.as_deref(),
        req.volume_bindings.as_deref(),
        &policy.allow_host_paths,
    )?;

    Ok(CreatePlan {
        id: uuid::Uuid::new_v4().to_string(),
        image: image.uri,
        entrypoint,
        env,
        metadata,
        created_at: now,
        expires_at: timeout.map(|s| now + Duration::seconds(s)),
        memory_bytes,
        nano_cpus,
        volumes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy() -> Policy {
        Policy {
            max_timeout_secs: DEFAULT_MAX_TIMEOUT_SECS,
            allow_host_paths: vec![],
        }
    }
    fn req(v: Value) -> CreateSandboxRequest {
        serde_json::from_value(v).unwrap()
    }
    fn base() -> Value {
        json!({"image":{"uri":"busybox"},"entrypoint":["sleep","infinity"],"resourceLimits":{}})
    }

    #[test]
    fn manual_cleanup_when_timeout_absent_or_null() {
        let now = Utc::now();
        let p = plan_create(req(base()), &policy(), now).unwrap();
        assert_eq!(p.expires_at, None);
        let mut b = base();
        b["timeout"] = Value::Null;
        assert_eq!(
            plan_create(req(b), &policy(), now).unwrap().expires_at,
            None
        );
    }

    #[test]
    fn timeout_bounds() {
        let now = Utc::now();
        for ok in [60, 3600, 86_400] {
            let mut b = base();
            b["timeout"] = json!(ok);
            let p = plan_create(req(b), &policy(), now).unwrap();
            assert_eq!(p.expires_at, Some(now + Duration::seconds(ok)));
        }
        for bad in [
            json!(0),
            json!(-1),
            json!(59),
            json!(86_401),
            json!(1.5),
            json!("60"),
        ] {
            let mut b = base();
            b["timeout"] = bad.clone();
            let e = plan_create(req(b), &policy(), now).unwrap_err();
            assert_eq!(e.status, 400, "{bad}");
        }
    }

    #[test]
    fn snapshot_and_template_are_client_errors() {
        let now = Utc::now();
        for field in ["snapshotId", "templateId"] {
            let mut b = base();
            b[field] = json!("0");
            let e = plan_create(req(b), &policy(), now).unwrap_err();
            assert_eq!(e.status, 400, "{field}");
            assert_eq!(e.code, "UNSUPPORTED_FIELD", "{field}");
            assert!(e.message.contains(field), "{}", e.message);
            // null means absent.
            let mut b = base();
            b[field] = Value::Null;
            plan_create(req(b), &policy(), now).unwrap();
        }
    }

    #[test]
    fn required_fields() {
        let now = Utc::now();
        let e = plan_create(req(json!({"entrypoint":["x"]})), &policy(), now).unwrap_err();
        assert!(e.message.contains("image"));
        let e = plan_create(req(json!({"image":{"uri":"b"}})), &policy(), now).unwrap_err();
        assert!(e.message.contains("entrypoint"));
        let e = plan_create(
            req(json!({"image":{"uri":"b"},"entrypoint":[]})),
            &policy(),
            now,
        )
        .unwrap_err();
        assert_eq!(e.status, 400);
    }

    #[test]
    fn metadata_rules() {
        assert!(check_metadata_entry("team", "a-b.c_d").is_ok());
        assert!(check_metadata_entry("example.com/team", "x").is_ok());
        assert!(check_metadata_entry("team", "").is_ok());
        assert_eq!(
            check_metadata_entry("opensandbox.io/id", "x")
                .unwrap_err()
                .code,
            "INVALID_METADATA_LABEL"
        );
        for (k, v) in [
            ("", "x"),
            ("a b", "x"),
            ("k", "has space"),
            ("k", "-x"),
            ("/k", "x"),
        ] {
            assert!(check_metadata_entry(k, v).is_err(), "{k:?}={v:?}");
        }
    }

    #[test]
    fn quantities() {
        assert_eq!(parse_cpu("500m"), Some(500_000_000));
        assert_eq!(parse_cpu("2"), Some(2_000_000_000));
        assert_eq!(parse_memory("512Mi"), Some(512 * 1024 * 1024));
        assert_eq!(parse_memory("1G"), Some(1_000_000_000));
        assert_eq!(parse_cpu("x"), None);
        assert_eq!(parse_memory("-1Gi"), None);
        let mut b = base();
        b["resourceLimits"] = json!({"cpu":"250m","memory":"64Mi"});
        let p = plan_create(req(b), &policy(), Utc::now()).unwrap();
        assert_eq!(
            (p.nano_cpus, p.memory_bytes),
            (Some(250_000_000), Some(64 << 20))
        );
        let mut b = base();
        b["resourceLimits"] = json!({"gpu":"1"});
        assert_eq!(
            plan_create(req(b), &policy(), Utc::now()).unwrap_err().code,
            "UNSUPPORTED_FIELD"
        );
    }
}
