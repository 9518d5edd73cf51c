//! Warm pools as a REST resource (OpenSandbox's `/pools`): the wire types,
//! their validation, and the mapping of the request's Kubernetes
//! `PodTemplateSpec` onto what a sandbolt warm pool is made of (one image,
//! its OCI runtime, limits and environment). [`crate::pool_routes`] serves
//! them and a [`crate::Backend`] executes them (the controller over its
//! `WarmPoolService`; the Docker runtime has no pools and says so).
//!
//! The template is a whole pod spec, most of which means nothing for a
//! sandbox (probes, affinity, sidecars) or is decided per claim rather than
//! per pool (entrypoint, volumes). Every field outside the mapping is
//! refused by its path: a field accepted and ignored is a promise silently
//! broken. The exceptions are `metadata.labels`, `metadata.annotations` and
//! the container's `name`: they only name and tag Kubernetes objects, and a
//! warm sandbox is none — except the annotation [`AGENT_POOL_ANNOTATION`],
//! which picks the agent pool that keeps the buffer.

use std::collections::BTreeMap;

use axum::http::StatusCode;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::error::{ApiError, ApiResult};
use crate::validate::{Quantity, ResourceSet, parse_cpu, parse_memory};
use crate::volumes::is_dns1123_label;

/// OCI runtimes a template may name (`runtimeClassName`), and what each
/// means to an agent. `gvisor` is the RuntimeClass name gVisor documents
/// for its runtime, `runsc`.
const RUNTIMES: [(&str, &str); 4] = [
    ("runc", "runc"),
    ("crun", "crun"),
    ("runsc", "runsc"),
    ("gvisor", "runsc"),
];

/// Template fields with a reason of their own; every other unmapped field
/// gets [`UNMAPPED`].
const REASONS: [(&str, &str); 8] = [
    (
        "command",
        "a warm sandbox's entrypoint is the claim's (the create request's entrypoint)",
    ),
    (
        "args",
        "a warm sandbox's entrypoint is the claim's (the create request's entrypoint)",
    ),
    (
        "workingDir",
        "a warm sandbox has no entrypoint until it is claimed",
    ),
    (
        "volumeMounts",
        "volumes are the create request's, mounted when a sandbox is claimed",
    ),
    (
        "volumes",
        "volumes are the create request's, mounted when a sandbox is claimed",
    ),
    (
        "requests",
        "only limits apply to a sandbox (the create request's resourceRequests weigh it)",
    ),
    (
        "valueFrom",
        "a warm sandbox has no Kubernetes objects to read it from; give a value",
    ),
    (
        "initContainers",
        "a warm sandbox is one container with nothing before it",
    ),
];

const UNMAPPED: &str = "a sandbolt warm pool takes containers[0].image, \
     containers[0].resources.limits.{cpu,memory}, containers[0].env and runtimeClassName \
     from the template, and nothing else";

fn invalid(message: String) -> ApiError {
    ApiError::invalid_code("INVALID_POOL", message)
}

/// A field sandbolt does not map, refused by its path.
fn unmapped(field: &str, key: &str) -> ApiError {
    let reason = REASONS
        .iter()
        .find(|(k, _)| *k == key)
        .map_or(UNMAPPED, |(_, r)| r);
    ApiError::invalid_code(
        "UNSUPPORTED_FIELD",
        format!("{field}.{key} is not supported in a warm pool template: {reason}"),
    )
}

/// What a pool's sandboxes are made of, from the request's template.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolTemplate {
    pub image: String,
    /// OCI runtime; `None` = the agent pool's.
    pub runtime: Option<String>,
    /// Limits of the idle sandboxes, and the defaults of a claim.
    pub limits: ResourceSet,
    pub env: BTreeMap<String, String>,
    /// The agent pool that keeps the buffer (annotation
    /// [`AGENT_POOL_ANNOTATION`]); `None` = the default one.
    pub agent_pool: Option<String>,
}

/// The one annotation of a template that means something to sandbolt: the
/// agent pool whose agents keep the warm pool's buffer. A pod template has
/// no field for it (node selection means nothing to sandbolt's agents).
pub const AGENT_POOL_ANNOTATION: &str = "sandbolt.io/agent-pool";

/// `PoolCapacitySpec`: available (warm) sandboxes kept within
/// `buffer_min..=buffer_max`, the pool's total within `pool_min..=pool_max`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolCapacity {
    pub buffer_max: i32,
    pub buffer_min: i32,
    pub pool_max: i32,
    pub pool_min: i32,
}

/// A checked `CreatePoolRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolCreate {
    pub name: String,
    pub template: PoolTemplate,
    pub capacity: PoolCapacity,
}

/// `PoolStatus`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolStatus {
    pub total: i32,
    pub allocated: i32,
    pub available: i32,
    pub revision: String,
}

/// `PoolResponse`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Pool {
    pub name: String,
    pub capacity_spec: PoolCapacity,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<PoolStatus>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
}

/// `ListPoolsResponse`.
#[derive(Debug, Clone, Serialize)]
pub struct PoolList {
    pub items: Vec<Pool>,
}

/// A pool named in a path that cannot exist (or does not).
pub fn pool_not_found(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "POOL_NOT_FOUND",
        format!("Pool {name} not found."),
    )
}

/// A path's pool name, or the 404 it earns without a round trip.
pub fn path_pool(name: &str) -> ApiResult<()> {
    if is_dns1123_label(name, 63) {
        Ok(())
    } else {
        Err(pool_not_found(name))
    }
}

/// The answer of a pool route on a runtime without warm pools.
pub fn pools_unsupported(route: &str, runtime: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_IMPLEMENTED,
        "NOT_SUPPORTED",
        format!(
            "{route}: Pool management is not supported in this runtime ({runtime}). Warm pools \
             need the containerd runtime: run the lifecycle on the controller backend \
             (`sandbolt up`, or `sandbolt lifecycle --controller ADDR`)."
        ),
    )
}

/// `v` as an object whose keys are all in `allowed` (a `null` value counts
/// as absent, as Kubernetes serializers write unset fields that way).
fn object<'a>(v: &'a Value, field: &str, allowed: &[&str]) -> ApiResult<&'a Map<String, Value>> {
    let map = v
        .as_object()
        .ok_or_else(|| invalid(format!("{field} must be an object")))?;
    if let Some((k, _)) = map
        .iter()
        .find(|(k, v)| !v.is_null() && !allowed.contains(&k.as_str()))
    {
        return Err(unmapped(field, k));
    }
    Ok(map)
}

/// Member `key` of `map`, `None` when absent or `null`.
fn member<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|v| !v.is_null())
}

fn string<'a>(v: &'a Value, field: &str) -> ApiResult<&'a str> {
    v.as_str()
        .ok_or_else(|| invalid(format!("{field} must be a string")))
}

/// `CreatePoolRequest`, checked.
pub fn parse_create(body: &Value) -> ApiResult<PoolCreate> {
    let map = body
        .as_object()
        .ok_or_else(|| invalid("the body must be a CreatePoolRequest object".into()))?;
    if let Some(k) = map
        .keys()
        .find(|k| !["name", "template", "capacitySpec"].contains(&k.as_str()))
    {
        return Err(ApiError::invalid_code(
            "UNSUPPORTED_FIELD",
            format!("{k} is not a field of CreatePoolRequest (name, template, capacitySpec)"),
        ));
    }
    let name = string(required(map, "name", "")?, "name")?;
    if !is_dns1123_label(name, 63) {
        return Err(invalid(format!(
            "name '{name}' must be a DNS-1123 label (lowercase letters, digits and '-', \
             alphanumeric at both ends, at most 63 characters)"
        )));
    }
    Ok(PoolCreate {
        name: name.to_string(),
        template: parse_template(required(map, "template", "")?)?,
        capacity: parse_capacity(required(map, "capacitySpec", "")?, "capacitySpec")?,
    })
}

/// `UpdatePoolRequest`, checked: its capacity.
pub fn parse_update(body: &Value) -> ApiResult<PoolCapacity> {
    let map = body
        .as_object()
        .ok_or_else(|| invalid("the body must be an UpdatePoolRequest object".into()))?;
    if let Some(k) = map.keys().find(|k| k.as_str() != "capacitySpec") {
        return Err(ApiError::invalid_code(
            "UNSUPPORTED_FIELD",
            format!(
                "{k} is not a field of UpdatePoolRequest: only capacitySpec can change (delete \
                 and recreate the pool to change its template)"
            ),
        ));
    }
    parse_capacity(required(map, "capacitySpec", "")?, "capacitySpec")
}

/// Member `key` of `map`, or a 400 naming `{prefix}{key}`.
fn required<'a>(map: &'a Map<String, Value>, key: &str, prefix: &str) -> ApiResult<&'a Value> {
    member(map, key).ok_or_else(|| invalid(format!("{prefix}{key} is required")))
}

/// `PoolCapacitySpec`: four non-negative counts, each within the next.
pub fn parse_capacity(v: &Value, field: &str) -> ApiResult<PoolCapacity> {
    const KEYS: [&str; 4] = ["bufferMax", "bufferMin", "poolMax", "poolMin"];
    let map = v
        .as_object()
        .ok_or_else(|| invalid(format!("{field} must be an object")))?;
    if let Some(k) = map.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(ApiError::invalid_code(
            "UNSUPPORTED_FIELD",
            format!("{field}.{k} is not a capacity field (bufferMax, bufferMin, poolMax, poolMin)"),
        ));
    }
    let count = |key: &str| -> ApiResult<i32> {
        let v = required(map, key, &format!("{field}."))?;
        v.as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .filter(|n| *n >= 0)
            .ok_or_else(|| {
                invalid(format!(
                    "{field}.{key} must be a non-negative integer (at most {}), got {v}",
                    i32::MAX
                ))
            })
    };
    let c = PoolCapacity {
        buffer_max: count("bufferMax")?,
        buffer_min: count("bufferMin")?,
        pool_max: count("poolMax")?,
        pool_min: count("poolMin")?,
    };
    for (low, lv, high, hv) in [
        ("bufferMin", c.buffer_min, "bufferMax", c.buffer_max),
        ("poolMin", c.pool_min, "poolMax", c.pool_max),
        ("bufferMax", c.buffer_max, "poolMax", c.pool_max),
    ] {
        if lv > hv {
            return Err(invalid(format!(
                "{field}.{low} ({lv}) must not be above {field}.{high} ({hv})"
            )));
        }
    }
    Ok(c)
}

/// The template (a Kubernetes `PodTemplateSpec`) as a warm pool's template.
pub fn parse_template(v: &Value) -> ApiResult<PoolTemplate> {
    let t = object(v, "template", &["metadata", "spec"])?;
    let mut agent_pool = None;
    if let Some(meta) = member(t, "metadata") {
        // Names and tags of Kubernetes objects: a warm sandbox is none,
        // except for the agent pool annotation.
        let meta = object(meta, "template.metadata", &["labels", "annotations"])?;
        agent_pool = agent_pool_annotation(meta)?;
    }
    let spec = object(
        required(t, "spec", "template.")?,
        "template.spec",
        &["containers", "runtimeClassName"],
    )?;
    let runtime = member(spec, "runtimeClassName")
        .map(|r| runtime(string(r, "template.spec.runtimeClassName")?))
        .transpose()?
        .flatten();
    let container = only_container(required(spec, "containers", "template.spec.")?)?;
    let mut template = parse_container(container)?;
    template.runtime = runtime;
    template.agent_pool = agent_pool;
    Ok(template)
}

fn agent_pool_annotation(meta: &Map<String, Value>) -> ApiResult<Option<String>> {
    let field = format!("template.metadata.annotations[\"{AGENT_POOL_ANNOTATION}\"]");
    let Some(annotations) = member(meta, "annotations") else {
        return Ok(None);
    };
    let annotations = annotations
        .as_object()
        .ok_or_else(|| invalid("template.metadata.annotations must be an object".into()))?;
    let Some(v) = member(annotations, AGENT_POOL_ANNOTATION) else {
        return Ok(None);
    };
    let name = string(v, &field)?;
    if !is_dns1123_label(name, 63) {
        return Err(invalid(format!(
            "{field} '{name}' is not a valid agent pool name (a DNS-1123 label)"
        )));
    }
    Ok(Some(name.to_string()))
}

fn runtime(name: &str) -> ApiResult<Option<String>> {
    if name.is_empty() {
        return Ok(None);
    }
    RUNTIMES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, r)| Some((*r).to_string()))
        .ok_or_else(|| {
            invalid(format!(
                "template.spec.runtimeClassName '{name}' is not a runtime sandbolt knows \
                 (runc, crun, runsc, gvisor)"
            ))
        })
}

fn only_container(v: &Value) -> ApiResult<&Value> {
    let list = v
        .as_array()
        .ok_or_else(|| invalid("template.spec.containers must be a list".into()))?;
    match list.as_slice() {
        [one] => Ok(one),
        [] => Err(invalid(
            "template.spec.containers must list one container (the sandbox's image)".into(),
        )),
        many => Err(ApiError::invalid_code(
            "UNSUPPORTED_FIELD",
            format!(
                "template.spec.containers lists {} containers; a warm sandbox is one container",
                many.len()
            ),
        )),
    }
}

fn parse_container(v: &Value) -> ApiResult<PoolTemplate> {
    const FIELD: &str = "template.spec.containers[0]";
    let c = object(v, FIELD, &["name", "image", "resources", "env"])?;
    let image = string(
        required(c, "image", &format!("{FIELD}."))?,
        &format!("{FIELD}.image"),
    )?;
    if image.trim().is_empty() || image.chars().any(char::is_whitespace) {
        return Err(invalid(format!(
            "{FIELD}.image must be a non-empty image reference, got '{image}'"
        )));
    }
    let limits = match member(c, "resources") {
        None => ResourceSet::default(),
        Some(r) => parse_limits(r)?,
    };
    let env = match member(c, "env") {
        None => BTreeMap::new(),
        Some(e) => parse_env(e)?,
    };
    Ok(PoolTemplate {
        image: image.to_string(),
        runtime: None,
        limits,
        env,
        agent_pool: None,
    })
}

fn parse_limits(v: &Value) -> ApiResult<ResourceSet> {
    const FIELD: &str = "template.spec.containers[0].resources";
    let r = object(v, FIELD, &["limits"])?;
    let Some(limits) = member(r, "limits") else {
        return Ok(ResourceSet::default());
    };
    let field = format!("{FIELD}.limits");
    let l = object(limits, &field, &["cpu", "memory"])?;
    let mut set = ResourceSet::default();
    if let Some(cpu) = member(l, "cpu") {
        set.cpu = Some(quantity(cpu, &format!("{field}.cpu"), parse_cpu)?);
    }
    if let Some(memory) = member(l, "memory") {
        set.memory = Some(quantity(memory, &format!("{field}.memory"), parse_memory)?);
    }
    Ok(set)
}

/// A Kubernetes quantity: a string, or a bare JSON number (`cpu: 2`).
fn quantity<E: std::fmt::Display>(
    v: &Value,
    field: &str,
    parse: impl Fn(&str) -> Result<u64, E>,
) -> ApiResult<Quantity> {
    let text = match v {
        Value::String(s) => s.trim().to_string(),
        Value::Number(n) => n.to_string(),
        other => return Err(invalid(format!("{field} must be a quantity, got {other}"))),
    };
    let value = parse(&text)
        .map_err(|e| invalid(format!("{field} '{text}' is not a valid quantity: {e}")))?;
    Ok(Quantity { text, value })
}

fn parse_env(v: &Value) -> ApiResult<BTreeMap<String, String>> {
    const FIELD: &str = "template.spec.containers[0].env";
    let list = v
        .as_array()
        .ok_or_else(|| invalid(format!("{FIELD} must be a list of {{name, value}}")))?;
    let mut env = BTreeMap::new();
    for (i, e) in list.iter().enumerate() {
        let field = format!("{FIELD}[{i}]");
        let e = object(e, &field, &["name", "value"])?;
        let name = string(
            required(e, "name", &format!("{field}."))?,
            &format!("{field}.name"),
        )?;
        if name.is_empty() || name.contains('=') || name.contains('\0') {
            return Err(invalid(format!(
                "{field}.name '{name}' is not an environment variable name"
            )));
        }
        // Kubernetes: an absent value is the empty string.
        let value = match member(e, "value") {
            None => "",
            Some(v) => string(v, &format!("{field}.value"))?,
        };
        if value.contains('\0') {
            return Err(invalid(format!("{field}.value contains NUL")));
        }
        if env.insert(name.to_string(), value.to_string()).is_some() {
            return Err(invalid(format!(
                "{field}.name '{name}' is listed twice in {FIELD}"
            )));
        }
    }
    Ok(env)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(container: Value) -> Value {
        json!({"metadata": {"labels": {"app": "x"}, "annotations": {"a": "b"}, "creationTimestamp": null},
               "spec": {"containers": [container]}})
    }

    fn create(template: Value) -> ApiResult<PoolCreate> {
        parse_create(&json!({
            "name": "py",
            "template": template,
            "capacitySpec": {"bufferMax": 3, "bufferMin": 1, "poolMax": 10, "poolMin": 0}
        }))
    }

    #[test]
    fn the_agent_pool_annotation_picks_the_agent_pool() {
        let plain = create(pod(json!({"image": "busybox"}))).unwrap();
        assert_eq!(plain.template.agent_pool, None);
        let mut t = pod(json!({"image": "busybox"}));
        t["metadata"]["annotations"][AGENT_POOL_ANNOTATION] = json!("gpu");
        assert_eq!(
            create(t.clone()).unwrap().template.agent_pool.as_deref(),
            Some("gpu")
        );
        t["metadata"]["annotations"][AGENT_POOL_ANNOTATION] = json!("Not_A_Pool");
        let err = create(t).unwrap_err().to_string();
        assert!(err.contains("sandbolt.io/agent-pool"), "{err}");
    }

    #[test]
    fn the_mapped_fields_become_the_template() {
        let mut t = pod(json!({
            "name": "sandbox",
            "image": "python:3.12",
            "resources": {"limits": {"cpu": "500m", "memory": "256Mi"}},
            "env": [{"name": "A", "value": "1"}, {"name": "EMPTY"}]
        }));
        t["spec"]["runtimeClassName"] = json!("gvisor");
        let p = create(t).unwrap();
        assert_eq!(p.name, "py");
        assert_eq!(
            p.capacity,
            PoolCapacity {
                buffer_max: 3,
                buffer_min: 1,
                pool_max: 10,
                pool_min: 0
            }
        );
        assert_eq!(p.template.image, "python:3.12");
        assert_eq!(p.template.runtime.as_deref(), Some("runsc"));
        assert_eq!(p.template.limits.cpu.as_ref().unwrap().value, 500);
        assert_eq!(p.template.limits.memory.as_ref().unwrap().text, "256Mi");
        assert_eq!(
            p.template.env,
            BTreeMap::from([("A".into(), "1".into()), ("EMPTY".into(), String::new())])
        );
        // Only the image is required; a bare number is a quantity too.
        let p = create(pod(
            json!({"image": "busybox", "resources": {"limits": {"cpu": 2}}}),
        ))
        .unwrap();
        assert_eq!(p.template.runtime, None);
        assert_eq!(p.template.limits.cpu.unwrap().value, 2000);
        assert!(p.template.env.is_empty());
    }

    /// Each refusal, and the words its message must carry.
    #[test]
    fn everything_else_is_refused_by_its_path() {
        let c = |extra: Value| {
            let mut c = json!({"image": "busybox"});
            c.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            pod(c)
        };
        let cases: Vec<(Value, &str)> = vec![
            (
                c(json!({"command": ["sh"]})),
                "template.spec.containers[0].command is not supported in a warm pool template: a warm sandbox's entrypoint is the claim's",
            ),
            (c(json!({"args": ["x"]})), "containers[0].args"),
            (c(json!({"ports": []})), "template.spec.containers[0].ports"),
            (
                c(json!({"resources": {"requests": {"cpu": "1"}}})),
                "template.spec.containers[0].resources.requests",
            ),
            (
                c(json!({"resources": {"limits": {"nvidia.com/gpu": "1"}}})),
                "template.spec.containers[0].resources.limits.nvidia.com/gpu",
            ),
            (
                c(json!({"resources": {"limits": {"cpu": "lots"}}})),
                "template.spec.containers[0].resources.limits.cpu 'lots'",
            ),
            (
                c(json!({"env": [{"name": "A", "valueFrom": {}}]})),
                "template.spec.containers[0].env[0].valueFrom",
            ),
            (
                c(json!({"env": [{"name": "A"}, {"name": "A", "value": "2"}]})),
                "env[1].name 'A' is listed twice",
            ),
            (
                c(json!({"env": [{"name": "A=B"}]})),
                "template.spec.containers[0].env[0].name",
            ),
            (
                pod(json!({"name": "x"})),
                "template.spec.containers[0].image is required",
            ),
            (
                pod(json!({"image": " "})),
                "template.spec.containers[0].image",
            ),
            (
                json!({"spec": {"containers": [{"image": "a"}, {"image": "b"}]}}),
                "template.spec.containers lists 2 containers",
            ),
            (
                json!({"spec": {"containers": []}}),
                "template.spec.containers must list one",
            ),
            (json!({"metadata": {}}), "template.spec is required"),
            (
                json!({"spec": {"containers": [{"image": "a"}], "nodeSelector": {}}}),
                "template.spec.nodeSelector",
            ),
            (
                json!({"spec": {"containers": [{"image": "a"}], "runtimeClassName": "kata"}}),
                "template.spec.runtimeClassName 'kata'",
            ),
            (
                json!({"metadata": {"name": "p"}, "spec": {"containers": [{"image": "a"}]}}),
                "template.metadata.name",
            ),
            (
                json!({"spec": {"containers": [{"image": "a"}], "initContainers": [{}]}}),
                "template.spec.initContainers",
            ),
        ];
        for (template, words) in cases {
            let e = create(template.clone()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{template}");
            assert!(e.message.contains(words), "{template}: {}", e.message);
        }
    }

    #[test]
    fn capacity_is_checked_field_by_field() {
        let cap = |v: Value| parse_capacity(&v, "capacitySpec");
        assert_eq!(
            cap(json!({"bufferMax": 0, "bufferMin": 0, "poolMax": 0, "poolMin": 0})).unwrap(),
            PoolCapacity::default()
        );
        for (v, words) in [
            (
                json!({"bufferMax": 3, "bufferMin": 4, "poolMax": 9, "poolMin": 0}),
                "capacitySpec.bufferMin (4) must not be above capacitySpec.bufferMax (3)",
            ),
            (
                json!({"bufferMax": 3, "bufferMin": 0, "poolMax": 9, "poolMin": 10}),
                "capacitySpec.poolMin (10)",
            ),
            (
                json!({"bufferMax": 10, "bufferMin": 0, "poolMax": 9, "poolMin": 0}),
                "capacitySpec.bufferMax (10) must not be above capacitySpec.poolMax (9)",
            ),
            (
                json!({"bufferMax": -1, "bufferMin": 0, "poolMax": 9, "poolMin": 0}),
                "capacitySpec.bufferMax must be a non-negative integer",
            ),
            (
                json!({"bufferMax": 1.5, "bufferMin": 0, "poolMax": 9, "poolMin": 0}),
                "capacitySpec.bufferMax",
            ),
            (
                json!({"bufferMax": 1, "bufferMin": 0, "poolMax": 9}),
                "capacitySpec.poolMin is required",
            ),
            (
                json!({"bufferMax": 1, "bufferMin": 0, "poolMax": 9, "poolMin": 0, "x": 1}),
                "capacitySpec.x",
            ),
        ] {
            let e = cap(v.clone()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{v}");
            assert!(e.message.contains(words), "{v}: {}", e.message);
        }
    }

    #[test]
    fn request_bodies() {
        let ok = json!({"name": "py", "template": pod(json!({"image": "a"})),
                        "capacitySpec": {"bufferMax": 1, "bufferMin": 0, "poolMax": 1, "poolMin": 0}});
        parse_create(&ok).unwrap();
        for (key, value, words) in [
            ("name", json!("Py"), "name 'Py' must be a DNS-1123 label"),
            ("name", json!(null), "name is required"),
            ("template", json!(null), "template is required"),
            ("capacitySpec", json!(null), "capacitySpec is required"),
            (
                "agentPool",
                json!("x"),
                "agentPool is not a field of CreatePoolRequest",
            ),
        ] {
            let mut b = ok.clone();
            b[key] = value;
            let e = parse_create(&b).unwrap_err();
            assert!(e.message.contains(words), "{key}: {}", e.message);
        }
        let cap = json!({"bufferMax": 2, "bufferMin": 1, "poolMax": 5, "poolMin": 0});
        assert_eq!(
            parse_update(&json!({"capacitySpec": cap}))
                .unwrap()
                .pool_max,
            5
        );
        let e = parse_update(&json!({"capacitySpec": cap, "template": {}})).unwrap_err();
        assert!(
            e.message.contains("template is not a field"),
            "{}",
            e.message
        );
        assert!(parse_update(&json!([])).is_err());
    }

    #[test]
    fn answers_omit_what_is_unknown() {
        let p = Pool {
            name: "py".into(),
            capacity_spec: PoolCapacity::default(),
            status: None,
            created_at: None,
        };
        assert_eq!(
            serde_json::to_value(&p).unwrap(),
            json!({"name": "py", "capacitySpec": {"bufferMax": 0, "bufferMin": 0, "poolMax": 0, "poolMin": 0}})
        );
        assert_eq!(path_pool("Bad_Name").unwrap_err().status, 404);
        let e = pools_unsupported("GET /pools", "docker");
        assert_eq!((e.status.as_u16(), e.code), (501, "NOT_SUPPORTED"));
        assert!(
            e.message
                .contains("Pool management is not supported in this runtime"),
            "{}",
            e.message
        );
    }
}
