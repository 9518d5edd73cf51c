//! Create-request validation: turns a wire `CreateSandboxRequest` into a
//! [`CreatePlan`] a backend can execute, or a precise 400.

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use sandbolt_proto::egress::NetworkPolicy;
use sandbolt_proto::quantity;
use serde_json::Value;

use crate::error::{ApiError, ApiResult};
use crate::model::{CreateSandboxRequest, ImageSpec, PlatformSpec};
use crate::volumes::{HostPathCheck, VolumeMount, parse_volumes};

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
    /// Empty with `extensions.pool` set (the warm pool's image) or with
    /// `snapshot_id` (the snapshot's).
    pub image: String,
    pub entrypoint: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub created_at: DateTime<Utc>,
    /// `None` = manual cleanup.
    pub expires_at: Option<DateTime<Utc>>,
    /// `resourceLimits`: hard caps.
    pub limits: ResourceSet,
    /// `resourceRequests`: scheduling weights, never above the limits.
    pub requests: ResourceSet,
    pub volumes: Vec<VolumeMount>,
    pub extensions: Extensions,
    /// `networkPolicy`, checked and normalized; the default allows all.
    pub network_policy: NetworkPolicy,
    /// `snapshotId`: the snapshot whose filesystem the sandbox starts from.
    pub snapshot_id: Option<String>,
}

/// The entrypoint of a sandbox restored from a snapshot when the request
/// names none (the contract's default: keep the sandbox alive, idle).
pub const SNAPSHOT_DEFAULT_ENTRYPOINT: [&str; 3] = ["tail", "-f", "/dev/null"];

/// A quantity as the request spelled it (the controller parses the text
/// again, with the same parser, against its pool maxima) and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quantity {
    pub text: String,
    pub value: u64,
}

/// One of `resourceLimits` / `resourceRequests`, parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResourceSet {
    /// Millicores.
    pub cpu: Option<Quantity>,
    /// Bytes.
    pub memory: Option<Quantity>,
    /// Maximum number of processes (limits only).
    pub pids: Option<i64>,
    /// Bytes of the writable layer, `ephemeral-storage` (limits only): the
    /// agent stops a sandbox over it; the Docker backend refuses it.
    pub ephemeral_storage: Option<Quantity>,
}

impl ResourceSet {
    pub fn is_empty(&self) -> bool {
        self.cpu.is_none()
            && self.memory.is_none()
            && self.pids.is_none()
            && self.ephemeral_storage.is_none()
    }
}

/// Consistency of the create (`extensions.consistencyMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConsistencyMode {
    /// Container first, record after.
    Fast,
    /// Record committed before the container exists.
    Strong,
}

/// What happens when the sandbox's node is gone (`extensions.failurePolicy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    Manual,
    AutoRecreate,
}

/// The `extensions` sandbolt understands. Every other key is refused: a
/// parameter accepted and ignored is a promise silently broken.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Extensions {
    /// The pool (`SandboxPool`) to place the sandbox in.
    pub pool: Option<String>,
    pub consistency: Option<ConsistencyMode>,
    pub failure_policy: Option<FailurePolicy>,
    /// Names in `env` whose values are secret (`extensions.secretEnv`,
    /// comma-separated): the controller stores them sealed and never
    /// shows them (see the controller's `secrets.rs`).
    pub secret_env: Vec<String>,
}

impl Extensions {
    pub fn is_empty(&self) -> bool {
        self == &Extensions::default()
    }
}

/// Accepted `extensions` keys. The OpenSandbox spec documents
/// `extensions.poolRef`; the fast-sandbox integration design names the same
/// three options in snake case (`pool_ref`, `consistency_mode`,
/// `failure_policy`). Both spellings are taken, as the first is what the spec
/// promises and the second what existing fast-sandbox callers send.
pub const EXT_POOL: [&str; 2] = ["poolRef", "pool_ref"];
pub const EXT_CONSISTENCY: [&str; 2] = ["consistencyMode", "consistency_mode"];
pub const EXT_FAILURE_POLICY: [&str; 2] = ["failurePolicy", "failure_policy"];
/// sandbolt's own: env names whose values are secret.
pub const EXT_SECRET_ENV: [&str; 2] = ["secretEnv", "secret_env"];

/// Limits the validator enforces that come from configuration.
#[derive(Debug, Clone)]
pub struct Policy {
    pub max_timeout_secs: i64,
    /// Where host-path volumes are checked against an allowlist.
    pub host_paths: HostPathCheck,
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

/// Parses a CPU quantity ("500m", "2", "0.5") into millicores, with the
/// parser the controller and the agent use (`sandbolt_proto::quantity`), so
/// a value passes all three or none.
pub fn parse_cpu(q: &str) -> Result<u64, quantity::QuantityError> {
    quantity::millicores(q)
}

/// Parses a memory quantity ("512Mi", "1G", "1048576") into bytes (same
/// parser as [`parse_cpu`]).
pub fn parse_memory(q: &str) -> Result<u64, quantity::QuantityError> {
    quantity::bytes(q)
}

/// Parses `resourceLimits` or `resourceRequests` (`field` names which, for
/// the error messages). Unknown resource names are refused, not dropped.
fn parse_resources(
    raw: Option<&BTreeMap<String, String>>,
    field: &str,
    allow_pids: bool,
) -> ApiResult<ResourceSet> {
    let mut set = ResourceSet::default();
    for (k, v) in raw.into_iter().flatten() {
        let text = v.trim().to_string();
        match k.as_str() {
            "cpu" => {
                let value = parse_cpu(&text).map_err(|e| {
                    ApiError::invalid(format!("{field}.cpu '{v}' is not a CPU quantity: {e}"))
                })?;
                set.cpu = Some(Quantity { text, value });
            }
            "memory" => {
                let value = parse_memory(&text).map_err(|e| {
                    ApiError::invalid(format!(
                        "{field}.memory '{v}' is not a memory quantity: {e}"
                    ))
                })?;
                set.memory = Some(Quantity { text, value });
            }
            "pids" if allow_pids => {
                // pids.max takes a plain count; no quantity suffixes.
                let n = text
                    .parse::<i64>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| {
                        ApiError::invalid(format!(
                            "{field}.pids '{v}' must be a positive integer (maximum number of processes)"
                        ))
                    })?;
                set.pids = Some(n);
            }
            "ephemeral-storage" if allow_pids => {
                let value = parse_memory(&text).ok().filter(|b| *b > 0).ok_or_else(|| {
                    ApiError::invalid(format!(
                        "{field}.ephemeral-storage '{v}' must be a positive byte quantity such as 1Gi"
                    ))
                })?;
                set.ephemeral_storage = Some(Quantity { text, value });
            }
            other => {
                return Err(ApiError::invalid_code(
                    "UNSUPPORTED_FIELD",
                    format!("{field}.{other} is not supported by sandbolt"),
                ));
            }
        }
    }
    Ok(set)
}

/// A request above its limit would be a weight the cap can never honour;
/// the controller refuses it too, but here the message names REST fields.
fn check_requests_within_limits(limits: &ResourceSet, requests: &ResourceSet) -> ApiResult<()> {
    for (name, req, lim) in [
        ("cpu", &requests.cpu, &limits.cpu),
        ("memory", &requests.memory, &limits.memory),
    ] {
        if let (Some(r), Some(l)) = (req, lim)
            && r.value > l.value
        {
            return Err(ApiError::invalid(format!(
                "resourceRequests.{name} '{}' is above resourceLimits.{name} '{}'",
                r.text, l.text
            )));
        }
    }
    Ok(())
}

/// One extension given under either of its spellings, with the documented
/// (first) spelling for messages. Both spellings with different values is
/// ambiguous and refused.
fn extension<'a>(
    ext: &'a BTreeMap<String, String>,
    names: [&'static str; 2],
) -> ApiResult<Option<(&'static str, &'a str)>> {
    let found: Vec<(&str, &str)> = names
        .iter()
        .filter_map(|n| ext.get(*n).map(|v| (*n, v.trim())))
        .collect();
    match found.as_slice() {
        [] => Ok(None),
        [(a, va), (b, vb)] if va != vb => Err(ApiError::invalid(format!(
            "extensions.{a} '{va}' and extensions.{b} '{vb}' disagree; send one"
        ))),
        [(_, v), ..] => Ok(Some((names[0], v))),
    }
}

/// Parses `extensions`: known keys into [`Extensions`], any other key is a
/// 400 naming it.
pub fn parse_extensions(raw: Option<&BTreeMap<String, String>>) -> ApiResult<Extensions> {
    let Some(ext) = raw else {
        return Ok(Extensions::default());
    };
    let known: Vec<&str> = [
        EXT_POOL,
        EXT_CONSISTENCY,
        EXT_FAILURE_POLICY,
        EXT_SECRET_ENV,
    ]
    .iter()
    .flatten()
    .copied()
    .collect();
    if let Some(k) = ext.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(ApiError::invalid_code(
            "UNSUPPORTED_FIELD",
            format!(
                "extensions.{k} is not supported by sandbolt (known: poolRef, consistencyMode, failurePolicy, secretEnv)"
            ),
        ));
    }
    let mut out = Extensions::default();
    if let Some((name, v)) = extension(ext, EXT_POOL)? {
        if !crate::volumes::is_dns1123_label(v, 63) {
            return Err(ApiError::invalid(format!(
                "extensions.{name} '{v}' must be a pool name (DNS-1123 label)"
            )));
        }
        out.pool = Some(v.to_string());
    }
    if let Some((name, v)) = extension(ext, EXT_CONSISTENCY)? {
        out.consistency = Some(match v.to_ascii_lowercase().as_str() {
            "fast" => ConsistencyMode::Fast,
            "strong" => ConsistencyMode::Strong,
            _ => {
                return Err(ApiError::invalid(format!(
                    "extensions.{name} '{v}' must be fast or strong"
                )));
            }
        });
    }
    if let Some((name, v)) = extension(ext, EXT_FAILURE_POLICY)? {
        // The CRD spells them Manual / AutoRecreate; the design doc snake case.
        out.failure_policy = Some(match v.to_ascii_lowercase().as_str() {
            "manual" => FailurePolicy::Manual,
            "auto_recreate" | "autorecreate" => FailurePolicy::AutoRecreate,
            _ => {
                return Err(ApiError::invalid(format!(
                    "extensions.{name} '{v}' must be manual or auto_recreate"
                )));
            }
        });
    }
    if let Some((_, v)) = extension(ext, EXT_SECRET_ENV)? {
        out.secret_env = v
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned)
            .collect();
    }
    Ok(out)
}

/// Every name `extensions.secretEnv` marks must be a variable `env` sets:
/// a secret that silently marks nothing would be a promise broken.
fn check_secret_env(ext: &Extensions, env: &BTreeMap<String, String>) -> ApiResult<()> {
    match ext.secret_env.iter().find(|n| !env.contains_key(*n)) {
        Some(n) => Err(ApiError::invalid(format!(
            "extensions.secretEnv names '{n}', which env does not set"
        ))),
        None => Ok(()),
    }
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
    reject_other_sources(&req)?;
    let extensions = parse_extensions(req.extensions.as_ref())?;
    let snapshot_id = check_snapshot_source(&req, &extensions)?;
    let image = match snapshot_id {
        Some(_) => String::new(),
        None => check_image(req.image.as_ref(), extensions.pool.as_deref())?,
    };
    let entrypoint = match (&snapshot_id, req.entrypoint.as_deref()) {
        (Some(_), None) => SNAPSHOT_DEFAULT_ENTRYPOINT.map(str::to_owned).to_vec(),
        (_, entrypoint) => check_entrypoint(entrypoint)?,
    };
    let timeout = parse_timeout(req.timeout.as_ref(), policy.max_timeout_secs)?;
    let env = parse_env(req.env.as_ref())?;
    check_secret_env(&extensions, &env)?;
    let metadata = req.metadata.clone().unwrap_or_default();
    for (k, v) in &metadata {
        check_metadata_entry(k, v)?;
    }
    let limits = parse_resources(req.resource_limits.as_ref(), "resourceLimits", true)?;
    let requests = parse_resources(req.resource_requests.as_ref(), "resourceRequests", false)?;
    check_requests_within_limits(&limits, &requests)?;
    let network_policy = parse_network_policy(req.network_policy.as_ref())?;
    reject_unsupported_options(&req)?;
    if let Some(p) = &req.platform {
        check_platform(p)?;
    }
    let volumes = parse_volumes(
        req.volumes.as_deref(),
        req.volume_bindings.as_deref(),
        &policy.host_paths,
    )?;
    Ok(CreatePlan {
        id: uuid::Uuid::new_v4().to_string(),
        image,
        entrypoint,
        env,
        metadata,
        created_at: now,
        expires_at: timeout.map(|s| now + Duration::seconds(s)),
        limits,
        requests,
        volumes,
        extensions,
        network_policy,
        snapshot_id,
    })
}

/// `networkPolicy` through the one policy model every component shares
/// (`sandbolt_proto::egress`); its errors name the field
/// (`networkPolicy.egress[2].target`). Absent or `null` allows all.
pub fn parse_network_policy(raw: Option<&Value>) -> ApiResult<NetworkPolicy> {
    match raw {
        None | Some(Value::Null) => Ok(NetworkPolicy::default()),
        Some(v) => NetworkPolicy::parse(&v.to_string())
            .map_err(|e| ApiError::invalid_code("INVALID_NETWORK_POLICY", e.to_string())),
    }
}

fn unsupported_field(message: impl Into<String>) -> ApiError {
    ApiError::invalid_code("UNSUPPORTED_FIELD", message)
}

/// A request sandbolt cannot serve is the client's to change: 400, like
/// every other unsupported field (and like OSEP-0003's unsupported volume
/// backends), not a 5xx that reads as a server fault.
fn reject_other_sources(req: &CreateSandboxRequest) -> ApiResult<()> {
    if req.template_id.is_some() {
        return Err(unsupported_field(
            "templateId is not supported by sandbolt: create from an image",
        ));
    }
    Ok(())
}

/// `snapshotId`, when the sandbox is restored from a snapshot: then the
/// snapshot gives the filesystem and the image, so `image` must be absent,
/// and a warm pool (whose sandboxes are started from their template's
/// image) cannot serve it.
fn check_snapshot_source(
    req: &CreateSandboxRequest,
    extensions: &Extensions,
) -> ApiResult<Option<String>> {
    let Some(id) = &req.snapshot_id else {
        return Ok(None);
    };
    if id.trim().is_empty() || id.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(ApiError::invalid("snapshotId must be a snapshot id"));
    }
    if req.image.is_some() {
        return Err(ApiError::invalid(
            "give either image or snapshotId, not both: a sandbox restored from a snapshot runs the snapshot's image",
        ));
    }
    if let Some(pool) = &extensions.pool {
        return Err(ApiError::invalid(format!(
            "snapshotId cannot be served by a warm pool (extensions.poolRef '{pool}'): a restored sandbox is always created from its snapshot"
        )));
    }
    Ok(Some(id.clone()))
}

/// The image reference to run; empty when the request names a pool
/// (`extensions.poolRef`) and no image: a warm pool's template has one,
/// and the controller fills it in (an agent pool has none, and the
/// controller says so).
fn check_image(image: Option<&ImageSpec>, pool: Option<&str>) -> ApiResult<String> {
    let image = match (image, pool) {
        (Some(image), _) => image,
        (None, Some(_)) => return Ok(String::new()),
        (None, None) => {
            return Err(ApiError::invalid(
                "image is required (unless extensions.poolRef names a warm pool, whose template gives it)",
            ));
        }
    };
    if image.uri.trim().is_empty() || image.uri.chars().any(char::is_whitespace) {
        return Err(ApiError::invalid(
            "image.uri must be a non-empty image reference",
        ));
    }
    if image.auth.is_some() {
        return Err(unsupported_field(
            "image.auth is not supported: sandbolt uses images present on the node",
        ));
    }
    Ok(image.uri.clone())
}

fn check_entrypoint(entrypoint: Option<&[String]>) -> ApiResult<Vec<String>> {
    let entrypoint = entrypoint
        .ok_or_else(|| ApiError::invalid("entrypoint is required when image is provided"))?;
    if entrypoint.is_empty() || entrypoint[0].is_empty() {
        return Err(ApiError::invalid("entrypoint must name a program"));
    }
    if entrypoint.iter().any(|a| a.contains('\0')) {
        return Err(ApiError::invalid("entrypoint must not contain NUL bytes"));
    }
    Ok(entrypoint.to_vec())
}

/// The environment; a `null` value leaves the variable out.
fn parse_env(
    raw: Option<&BTreeMap<String, Option<String>>>,
) -> ApiResult<BTreeMap<String, String>> {
    let mut env = BTreeMap::new();
    for (k, v) in raw.into_iter().flatten() {
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
            env.insert(k.clone(), v.clone());
        }
    }
    Ok(env)
}

/// Options sandbolt does not offer: refused, never accepted and ignored.
fn reject_unsupported_options(req: &CreateSandboxRequest) -> ApiResult<()> {
    reject_if_set(&req.lifecycle, "lifecycle")?;
    if let Some(cp) = &req.credential_proxy
        && cp.get("enabled").and_then(Value::as_bool) == Some(true)
    {
        return Err(unsupported_field(
            "credentialProxy is not supported by sandbolt",
        ));
    }
    if req.secure_access {
        return Err(unsupported_field(
            "secureAccess is not supported by sandbolt (endpoints already carry a per-sandbox token)",
        ));
    }
    Ok(())
}

/// Sandboxes run on this machine's platform (the nodes' for the controller).
fn check_platform(p: &PlatformSpec) -> ApiResult<()> {
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy() -> Policy {
        Policy {
            max_timeout_secs: DEFAULT_MAX_TIMEOUT_SECS,
            host_paths: HostPathCheck::Local(vec![]),
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
    fn snapshot_sources() {
        let now = Utc::now();
        // No image, no entrypoint: the contract's default entrypoint.
        let p = plan_create(req(json!({"snapshotId": "snap-1"})), &policy(), now).unwrap();
        assert_eq!(p.snapshot_id.as_deref(), Some("snap-1"));
        assert_eq!(p.image, "");
        assert_eq!(p.entrypoint, ["tail", "-f", "/dev/null"]);
        let p = plan_create(
            req(json!({"snapshotId": "snap-1", "entrypoint": ["sleep", "9"]})),
            &policy(),
            now,
        )
        .unwrap();
        assert_eq!(p.entrypoint, ["sleep", "9"]);
        assert_eq!(
            plan_create(req(base()), &policy(), now)
                .unwrap()
                .snapshot_id,
            None
        );
        for (body, words) in [
            (
                json!({"snapshotId": "snap-1", "image": {"uri": "busybox"}}),
                "either image or snapshotId",
            ),
            (
                json!({"snapshotId": "snap-1", "extensions": {"poolRef": "py"}}),
                "extensions.poolRef",
            ),
            (json!({"snapshotId": ""}), "snapshotId"),
            (json!({"snapshotId": "a b"}), "snapshotId"),
            (
                json!({"snapshotId": "snap-1", "entrypoint": []}),
                "entrypoint",
            ),
        ] {
            let e = plan_create(req(body.clone()), &policy(), now).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert!(e.message.contains(words), "{body}: {}", e.message);
        }
    }

    #[test]
    fn template_is_a_client_error() {
        let now = Utc::now();
        let mut b = base();
        b["templateId"] = json!("0");
        let e = plan_create(req(b), &policy(), now).unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.code, "UNSUPPORTED_FIELD");
        assert!(e.message.contains("templateId"), "{}", e.message);
        // null means absent, for both sources.
        for field in ["templateId", "snapshotId"] {
            let mut b = base();
            b[field] = Value::Null;
            let p = plan_create(req(b), &policy(), now).unwrap();
            assert_eq!(p.snapshot_id, None);
        }
    }

    #[test]
    fn required_fields() {
        let now = Utc::now();
        let e = plan_create(req(json!({"entrypoint":["x"]})), &policy(), now).unwrap_err();
        assert!(e.message.contains("image"));
        // A pool may give the image (a warm pool's template); an empty one
        // is still no image.
        let p = plan_create(
            req(json!({"entrypoint":["x"], "extensions": {"poolRef": "py"}})),
            &policy(),
            now,
        )
        .unwrap();
        assert_eq!(
            (p.image.as_str(), p.extensions.pool.as_deref()),
            ("", Some("py"))
        );
        let e = plan_create(
            req(json!({"image": {"uri": ""}, "entrypoint":["x"], "extensions": {"poolRef": "py"}})),
            &policy(),
            now,
        )
        .unwrap_err();
        assert!(e.message.contains("image.uri"), "{}", e.message);
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
        assert_eq!(parse_cpu("500m").unwrap(), 500);
        assert_eq!(parse_cpu("2").unwrap(), 2000);
        assert_eq!(parse_memory("512Mi").unwrap(), 512 * 1024 * 1024);
        assert_eq!(parse_memory("1G").unwrap(), 1_000_000_000);
        assert!(parse_cpu("x").is_err());
        assert!(parse_memory("-1Gi").is_err());
        assert!(parse_cpu("0").is_err());
        let mut b = base();
        b["resourceLimits"] = json!({"cpu":"250m","memory":"64Mi","pids":"128"});
        let p = plan_create(req(b), &policy(), Utc::now()).unwrap();
        assert_eq!(
            p.limits,
            ResourceSet {
                cpu: Some(Quantity {
                    text: "250m".into(),
                    value: 250
                }),
                memory: Some(Quantity {
                    text: "64Mi".into(),
                    value: 64 << 20
                }),
                pids: Some(128),
                ephemeral_storage: None,
            }
        );
        assert!(p.requests.is_empty());
        for (limits, field) in [
            (json!({"gpu":"1"}), "resourceLimits.gpu"),
            (json!({"pids":"0"}), "resourceLimits.pids"),
            (json!({"pids":"1k"}), "resourceLimits.pids"),
            (json!({"memory":"0"}), "resourceLimits.memory"),
            (
                json!({"ephemeral-storage":"0"}),
                "resourceLimits.ephemeral-storage",
            ),
            (
                json!({"ephemeral-storage":"lots"}),
                "resourceLimits.ephemeral-storage",
            ),
        ] {
            let mut b = base();
            b["resourceLimits"] = limits;
            let e = plan_create(req(b), &policy(), Utc::now()).unwrap_err();
            assert_eq!(e.status, 400, "{field}");
            assert!(e.message.contains(field), "{field}: {}", e.message);
        }
    }

    #[test]
    fn an_ephemeral_storage_limit_is_read_and_a_request_refused() {
        let mut b = base();
        b["resourceLimits"] = json!({"ephemeral-storage":"20Mi"});
        let p = plan_create(req(b), &policy(), Utc::now()).unwrap();
        assert_eq!(
            p.limits.ephemeral_storage,
            Some(Quantity {
                text: "20Mi".into(),
                value: 20 << 20
            })
        );
        let mut b = base();
        b["resourceRequests"] = json!({"ephemeral-storage":"20Mi"});
        let e = plan_create(req(b), &policy(), Utc::now()).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(
            e.message.contains("resourceRequests.ephemeral-storage"),
            "{}",
            e.message
        );
    }

    #[test]
    fn requests_are_read_and_held_below_limits() {
        let mut b = base();
        b["resourceLimits"] = json!({"cpu":"1","memory":"128Mi"});
        b["resourceRequests"] = json!({"cpu":"250m","memory":"64Mi"});
        let p = plan_create(req(b), &policy(), Utc::now()).unwrap();
        assert_eq!(p.requests.cpu.unwrap().value, 250);
        assert_eq!(p.requests.memory.unwrap().value, 64 << 20);
        for (requests, field) in [
            (json!({"cpu":"2"}), "resourceRequests.cpu"),
            (json!({"memory":"1Gi"}), "resourceRequests.memory"),
            // A process count is a cap, not a weight.
            (json!({"pids":"10"}), "resourceRequests.pids"),
        ] {
            let mut b = base();
            b["resourceLimits"] = json!({"cpu":"1","memory":"128Mi"});
            b["resourceRequests"] = requests;
            let e = plan_create(req(b), &policy(), Utc::now()).unwrap_err();
            assert_eq!(e.status, 400, "{field}");
            assert!(e.message.contains(field), "{field}: {}", e.message);
        }
    }

    #[test]
    fn secret_env_marks_only_variables_env_sets() {
        let mut b = base();
        b["env"] = json!({"A": "1", "TOKEN": "x"});
        b["extensions"] = json!({"secretEnv": " TOKEN , "});
        let p = plan_create(req(b.clone()), &policy(), Utc::now()).unwrap();
        assert_eq!(p.extensions.secret_env, ["TOKEN"]);
        b["extensions"] = json!({"secret_env": "TOKEN,NOPE"});
        let e = plan_create(req(b), &policy(), Utc::now()).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("'NOPE'"), "{}", e.message);
    }

    #[test]
    fn extensions_are_read_and_unknown_keys_refused() {
        let mut b = base();
        b["extensions"] = json!({"poolRef":"gpu-pool","consistency_mode":"Strong","failurePolicy":"auto_recreate"});
        let p = plan_create(req(b), &policy(), Utc::now()).unwrap();
        assert_eq!(
            p.extensions,
            Extensions {
                pool: Some("gpu-pool".into()),
                consistency: Some(ConsistencyMode::Strong),
                failure_policy: Some(FailurePolicy::AutoRecreate),
                secret_env: Vec::new(),
            }
        );
        // Either spelling; the same value twice is fine.
        let ext = parse_extensions(Some(&BTreeMap::from([
            ("pool_ref".to_string(), "a".to_string()),
            ("poolRef".to_string(), "a".to_string()),
            ("failure_policy".to_string(), "Manual".to_string()),
            ("consistencyMode".to_string(), "fast".to_string()),
        ])))
        .unwrap();
        assert_eq!(ext.pool.as_deref(), Some("a"));
        assert_eq!(ext.failure_policy, Some(FailurePolicy::Manual));
        assert_eq!(ext.consistency, Some(ConsistencyMode::Fast));
        assert!(parse_extensions(None).unwrap().is_empty());
        for (ext, words) in [
            (json!({"storage.id":"x"}), "extensions.storage.id"),
            (
                json!({"access.renew.extend.seconds":"600"}),
                "extensions.access.renew.extend.seconds",
            ),
            (json!({"poolRef":"a","pool_ref":"b"}), "disagree"),
            (json!({"poolRef":"Bad_Pool"}), "extensions.poolRef"),
            (
                json!({"consistency_mode":"eventual"}),
                "extensions.consistencyMode",
            ),
            (json!({"failurePolicy":"retry"}), "extensions.failurePolicy"),
        ] {
            let mut b = base();
            b["extensions"] = ext.clone();
            let e = plan_create(req(b), &policy(), Utc::now()).unwrap_err();
            assert_eq!(e.status, 400, "{ext}");
            assert!(e.message.contains(words), "{ext}: {}", e.message);
        }
    }

    #[test]
    fn network_policy_is_parsed_and_bad_input_named() {
        let mut b = base();
        b["networkPolicy"] = json!({"defaultAction": "deny", "egress": [
            {"action": "allow", "target": "*.PyPI.org"}, {"action": "allow", "target": "203.0.113.9/24"}]});
        let p = plan_create(req(b), &policy(), Utc::now()).unwrap();
        assert_eq!(p.network_policy.egress[0].target, "*.pypi.org");
        assert_eq!(p.network_policy.egress[1].target, "203.0.113.0/24");
        for absent in [Value::Null, json!({})] {
            let mut b = base();
            b["networkPolicy"] = absent;
            assert!(
                plan_create(req(b), &policy(), Utc::now())
                    .unwrap()
                    .network_policy
                    .is_allow_all()
            );
        }
        assert!(
            plan_create(req(base()), &policy(), Utc::now())
                .unwrap()
                .network_policy
                .is_allow_all()
        );
        for (bad, field) in [
            (
                json!({"defaultAction": "block"}),
                "networkPolicy.defaultAction",
            ),
            (
                json!({"egress": [{"action": "allow", "target": "a b"}]}),
                "networkPolicy.egress[0].target",
            ),
            (
                json!({"egress": [{"action": "allow", "target": "2001:db8::1"}]}),
                "IPv6",
            ),
            (json!({"egress": [{"action": "allow"}]}), "networkPolicy"),
            (json!("deny"), "networkPolicy"),
        ] {
            let mut b = base();
            b["networkPolicy"] = bad.clone();
            let e = plan_create(req(b), &policy(), Utc::now()).unwrap_err();
            assert_eq!(e.status, 400, "{bad}");
            assert!(e.message.contains(field), "{bad}: {}", e.message);
        }
    }
}
