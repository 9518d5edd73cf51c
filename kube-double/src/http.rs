//! Request routing: URL layout, verbs, authentication, fault injection and
//! the JSON in and out of each verb.

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::patch;
use crate::selectors::{FieldSelector, LabelSelector};
use crate::server::Shared;
use crate::status::ApiError;
use crate::store::{DeleteOptions, KindId, ListOptions, Target, WatchFrom};
use crate::watch::{self, WatchOptions};

pub(crate) type Body = BoxBody<Bytes, Infallible>;

/// Where a URL points.
#[derive(Debug, PartialEq)]
enum Route {
    Version,
    CoreVersions,
    Groups,
    Resources {
        group: String,
        version: String,
    },
    Resource {
        kid: KindId,
        namespace: Option<String>,
        name: Option<String>,
        status: bool,
    },
    Unknown,
}

fn json_response(code: u16, body: &Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .expect("static response parts are valid")
}

fn error_response(err: &ApiError) -> Response<Body> {
    let mut resp = json_response(err.code, &err.to_status());
    if let Some(secs) = err.retry_after {
        resp.headers_mut().insert(
            header::RETRY_AFTER,
            secs.to_string().parse().expect("digits"),
        );
    }
    resp
}

fn route(shared: &Shared, path: &str) -> Route {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["version"] => return Route::Version,
        ["api"] => return Route::CoreVersions,
        ["apis"] => return Route::Groups,
        ["api", v, rest @ ..] => ("", *v, rest),
        ["apis", g, v, rest @ ..] => (*g, *v, rest),
        _ => return Route::Unknown,
    };
    let store = shared.store.lock();
    if rest.is_empty() {
        let known = store
            .kinds
            .iter()
            .any(|k| k.group == group && k.version == version);
        return if known {
            Route::Resources {
                group: group.into(),
                version: version.into(),
            }
        } else {
            Route::Unknown
        };
    }
    let (namespace, plural, name, sub) = match rest {
        [plural] => (None, *plural, None, None),
        ["namespaces", ns, plural] => (Some(*ns), *plural, None, None),
        ["namespaces", ns, plural, name] => (Some(*ns), *plural, Some(*name), None),
        ["namespaces", ns, plural, name, sub] => (Some(*ns), *plural, Some(*name), Some(*sub)),
        _ => return Route::Unknown,
    };
    let Some(kid) = store.find_kind(group, version, plural) else {
        return Route::Unknown;
    };
    let kind = &store.kinds[kid];
    let status = match sub {
        None => false,
        Some("status") if kind.status_subresource => true,
        Some(_) => return Route::Unknown,
    };
    Route::Resource {
        kid,
        namespace: namespace.map(str::to_string),
        name: name.map(str::to_string),
        status,
    }
}

fn discovery(shared: &Shared, route: &Route, addr: &str) -> Value {
    let store = shared.store.lock();
    match route {
        Route::Version => json!({
            "major": "1", "minor": "35", "gitVersion": "v1.35.0-sandbolt-double",
            "gitCommit": "", "gitTreeState": "clean", "buildDate": "1970-01-01T00:00:00Z",
            "goVersion": "", "compiler": "rustc", "platform": "linux/amd64"
        }),
        Route::CoreVersions => json!({
            "kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": addr}]
        }),
        Route::Groups => {
            // One entry per group with all its versions, whatever order the
            // kinds were registered in.
            let mut versions: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for k in store.kinds.iter().filter(|k| !k.group.is_empty()) {
                let group = versions.entry(k.group.as_str()).or_default();
                if !group.contains(&k.version.as_str()) {
                    group.push(k.version.as_str());
                }
            }
            let groups: Vec<Value> = versions
                .iter()
                .map(|(g, vs)| {
                    let gvs: Vec<Value> = vs
                        .iter()
                        .map(|v| json!({"groupVersion": format!("{g}/{v}"), "version": v}))
                        .collect();
                    json!({"name": g, "versions": gvs, "preferredVersion": gvs[0]})
                })
                .collect();
            json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
        }
        Route::Resources { group, version } => {
            let mut resources = Vec::new();
            for k in store
                .kinds
                .iter()
                .filter(|k| &k.group == group && &k.version == version)
            {
                resources.push(json!({
                    "name": k.plural, "singularName": k.kind.to_lowercase(), "namespaced": k.namespaced,
                    "kind": k.kind,
                    "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
                }));
                if k.status_subresource {
                    resources.push(json!({
                        "name": format!("{}/status", k.plural), "singularName": "", "namespaced": k.namespaced,
                        "kind": k.kind, "verbs": ["get", "patch", "update"]
                    }));
                }
            }
            let gv = if group.is_empty() {
                version.clone()
            } else {
                format!("{group}/{version}")
            };
            json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources})
        }
        _ => json!({}),
    }
}

/// The audit-style verb of a request on a resource, or None if the method
/// is not allowed there.
fn verb_of(
    method: &Method,
    has_name: bool,
    has_ns: bool,
    status: bool,
    watch: bool,
) -> Option<&'static str> {
    let verb = match (method.as_str(), has_name) {
        ("GET", true) => "get",
        ("GET", false) if watch => "watch",
        ("GET", false) => "list",
        ("POST", false) => "create",
        ("PUT", true) => "update",
        ("PATCH", true) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => return None,
    };
    // Cluster-wide URLs of namespaced kinds only list and watch; the status
    // subresource only reads and writes.
    if !has_ns && !matches!(verb, "list" | "watch") {
        return None;
    }
    if status && !matches!(verb, "get" | "update" | "patch") {
        return None;
    }
    Some(verb)
}

fn query_map(query: Option<&str>) -> HashMap<String, String> {
    form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .into_owned()
        .collect()
}

/// A boolean query parameter as the API server decodes it
/// (apimachinery's `Convert_Slice_string_To_bool`): absent, "0" or "false"
/// in any case is false; anything else is true, so every `strconv.ParseBool`
/// true form ("1", "t", "T", "TRUE", "true", "True") and even an empty
/// value are true. Note "f" / "F" are true there too, unlike ParseBool.
fn is_true(q: &HashMap<String, String>, key: &str) -> bool {
    q.get(key)
        .is_some_and(|v| v != "0" && !v.eq_ignore_ascii_case("false"))
}

fn parse_json_body(body: &[u8], content_type: &str) -> Result<Value, ApiError> {
    let media = content_type.split(';').next().unwrap_or_default().trim();
    if !media.is_empty() && media != "application/json" && media != "*/*" {
        return Err(ApiError::unsupported_media_type(media, "application/json"));
    }
    serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("the body of the request could not be decoded: {e}"))
    })
}

fn list_options(
    q: &HashMap<String, String>,
    kind: &crate::kinds::Kind,
) -> Result<ListOptions, ApiError> {
    let limit = match q.get("limit") {
        Some(l) => Some(
            l.parse::<usize>()
                .map_err(|_| ApiError::bad_request(format!("invalid limit: {l}")))?,
        ),
        None => None,
    };
    Ok(ListOptions {
        labels: LabelSelector::parse(q.get("labelSelector").map_or("", String::as_str))?,
        fields: FieldSelector::parse(q.get("fieldSelector").map_or("", String::as_str), kind)?,
        limit,
        continue_token: q.get("continue").cloned(),
        resource_version: q.get("resourceVersion").cloned(),
        exact: q.get("resourceVersionMatch").is_some_and(|m| m == "Exact"),
    })
}

fn delete_options(body: &[u8]) -> Result<DeleteOptions, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(DeleteOptions::default());
    }
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::bad_request(format!("the body of the request could not be decoded: {e}"))
    })?;
    let pre = v.get("preconditions");
    let field = |f: &str| {
        pre.and_then(|p| p.get(f))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    // propagationPolicy is accepted but there is no garbage collector here.
    Ok(DeleteOptions {
        uid: field("uid"),
        resource_version: field("resourceVersion"),
    })
}

/// What of a request every route needs, read from its head.
struct RequestHead {
    method: Method,
    query: HashMap<String, String>,
    /// It carries the double's bearer token.
    authorized: bool,
    host: String,
    content_type: String,
}

impl RequestHead {
    fn read(shared: &Shared, parts: &http::request::Parts) -> RequestHead {
        let header_str = |name: header::HeaderName| {
            parts
                .headers
                .get(name)
                .and_then(|h| h.to_str().ok())
                .unwrap_or_default()
                .to_string()
        };
        RequestHead {
            method: parts.method.clone(),
            query: query_map(parts.uri.query()),
            authorized: header_str(header::AUTHORIZATION)
                .strip_prefix("Bearer ")
                .is_some_and(|t| t == shared.token),
            host: header_str(header::HOST),
            content_type: header_str(header::CONTENT_TYPE),
        }
    }
}

/// Where a resource request points (the parts of [`Route::Resource`]).
struct ResourceRef {
    kid: KindId,
    namespace: Option<String>,
    name: Option<String>,
    status: bool,
}

/// One request to the double, in a span naming it (the logs of a test that
/// drives the controller or janitor show which API call they made).
#[tracing::instrument(skip_all, fields(method = %req.method(), path = req.uri().path()))]
pub(crate) async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let (parts, body) = req.into_parts();
    let head = RequestHead::read(&shared, &parts);
    Ok(match route(&shared, parts.uri.path()) {
        Route::Resource {
            kid,
            namespace,
            name,
            status,
        } => {
            let target = ResourceRef {
                kid,
                namespace,
                name,
                status,
            };
            serve_resource(&shared, &head, &target, body).await
        }
        other => serve_discovery(&shared, &head, &other),
    })
}

/// The version and discovery documents (and 404 for unknown paths).
fn serve_discovery(shared: &Shared, head: &RequestHead, route: &Route) -> Response<Body> {
    if shared.is_unavailable() {
        return error_response(&ApiError::unavailable());
    }
    if !head.authorized {
        return error_response(&ApiError::unauthorized());
    }
    if *route == Route::Unknown {
        return error_response(&ApiError::no_resource());
    }
    if head.method != Method::GET {
        return error_response(&ApiError::method_not_allowed());
    }
    json_response(200, &discovery(shared, route, &head.host))
}

/// One verb on a resource: counted, then refused as the API server would
/// (unavailable, unauthorized, an injected fault), else run on the store.
async fn serve_resource(
    shared: &Arc<Shared>,
    head: &RequestHead,
    at: &ResourceRef,
    body: Incoming,
) -> Response<Body> {
    let plural = shared.store.lock().kinds[at.kid].plural.to_string();
    let resource = if at.status {
        format!("{plural}/status")
    } else {
        plural
    };
    let watch = is_true(&head.query, "watch");
    let has_name = at.name.is_some();
    let Some(verb) = verb_of(
        &head.method,
        has_name,
        at.namespace.is_some(),
        at.status,
        watch,
    ) else {
        shared.count(head.method.as_str(), &resource);
        return error_response(&ApiError::method_not_allowed());
    };
    shared.count(verb, &resource);
    if shared.is_unavailable() {
        return error_response(&ApiError::unavailable());
    }
    if !head.authorized {
        return error_response(&ApiError::unauthorized());
    }
    if let Some(code) = shared.take_fault(verb, &resource) {
        return error_response(&ApiError::from_code(code));
    }
    if verb == "watch" {
        return start_watch(shared, at.kid, at.namespace.as_deref(), &head.query);
    }
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return error_response(&ApiError::bad_request(format!("reading body: {e}"))),
    };
    match run_verb(shared, head, at, verb, &body) {
        Ok((code, v)) => json_response(code, &v),
        Err(err) => error_response(&err),
    }
}

/// Runs `verb` (not `watch`) on the store: the status code and object.
fn run_verb(
    shared: &Shared,
    head: &RequestHead,
    at: &ResourceRef,
    verb: &str,
    body: &[u8],
) -> Result<(u16, Value), ApiError> {
    let kid = at.kid;
    let kind = shared.store.lock().kinds[kid].clone();
    let ns = at.namespace.as_deref().unwrap_or_default();
    let name = at.name.as_deref().unwrap_or_default();
    let target = if at.status {
        Target::Status
    } else {
        Target::Main
    };
    let content_type = head.content_type.as_str();
    match verb {
        "get" => shared.store.lock().get(kid, ns, name).map(|v| (200, v)),
        "list" => list_options(&head.query, &kind)
            .and_then(|opts| {
                shared
                    .store
                    .lock()
                    .list(kid, at.namespace.as_deref(), &opts)
            })
            .map(|v| (200, v)),
        "create" => parse_json_body(body, content_type)
            .and_then(|v| shared.store.lock().create(kid, ns, v))
            .map(|v| (201, v)),
        "update" => parse_json_body(body, content_type)
            .and_then(|v| shared.store.lock().update(kid, ns, name, v, target, false))
            .map(|v| (200, v)),
        "patch" => {
            let mut store = shared.store.lock();
            store
                .get(kid, ns, name)
                .and_then(|current| patch::apply(&kind, name, content_type, body, &current))
                .and_then(|patched| store.update(kid, ns, name, patched, target, true))
                .map(|v| (200, v))
        }
        "delete" => delete_options(body)
            .and_then(|opts| shared.store.lock().delete(kid, ns, name, &opts))
            .map(|v| (200, v)),
        "deletecollection" => list_options(&head.query, &kind)
            .and_then(|opts| shared.store.lock().delete_collection(kid, ns, &opts))
            .map(|v| (200, v)),
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn start_watch(
    shared: &Arc<Shared>,
    kid: KindId,
    ns: Option<&str>,
    q: &HashMap<String, String>,
) -> Response<Body> {
    let setup = || -> Result<Response<Body>, ApiError> {
        let kind = shared.store.lock().kinds[kid].clone();
        let labels = LabelSelector::parse(q.get("labelSelector").map_or("", String::as_str))?;
        let fields =
            FieldSelector::parse(q.get("fieldSelector").map_or("", String::as_str), &kind)?;
        let timeout = match q.get("timeoutSeconds") {
            Some(t) => Some(Duration::from_secs(t.parse().map_err(|_| {
                ApiError::bad_request(format!("invalid timeoutSeconds: {t}"))
            })?)),
            None => None,
        };
        let bookmarks = is_true(q, "allowWatchBookmarks");
        let send_initial = is_true(q, "sendInitialEvents");
        let rv_match = q.get("resourceVersionMatch").map(String::as_str);
        // The same rules as apimachinery's ValidateListOptions for watches.
        if send_initial && rv_match != Some("NotOlderThan") {
            return Err(ApiError::invalid(
                &kind,
                "",
                "resourceVersionMatch",
                "Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
            ));
        }
        if send_initial && !bookmarks {
            return Err(ApiError::invalid(
                &kind,
                "",
                "allowWatchBookmarks",
                "Forbidden: sendInitialEvents requires setting allowWatchBookmarks to true",
            ));
        }
        if !send_initial && rv_match.is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::invalid(
                &kind,
                "",
                "resourceVersionMatch",
                "Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
            ));
        }
        let from = match q.get("resourceVersion").map(String::as_str) {
            None | Some("") | Some("0") => WatchFrom::Current,
            // With sendInitialEvents the initial state is sent whatever
            // version is named (at least that new).
            Some(_) if send_initial => WatchFrom::Current,
            Some(v) => WatchFrom::Version(
                v.parse()
                    .map_err(|_| ApiError::bad_request(format!("invalid resource version: {v}")))?,
            ),
        };
        let (setup, rv) = {
            let mut store = shared.store.lock();
            (store.watch(kid, ns, from), store.resource_version())
        };
        let opts = WatchOptions {
            labels,
            fields,
            timeout,
            bookmarks,
            initial_events_end: send_initial.then_some(rv),
        };
        let frames = watch::stream(shared.clone(), kind, setup, opts);
        Ok(Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/json")
            .body(BodyExt::boxed(StreamBody::new(frames)))
            .expect("static response parts are valid"))
    };
    setup().unwrap_or_else(|err| error_response(&err))
}
