//! The object store: objects by (kind, namespace, name), one global
//! resourceVersion counter (like etcd's revision), the event history that
//! watches replay, and the open watches' event channels.
//!
//! Every method runs under the caller's lock on the whole store, which is
//! what makes a write, its history entry and its fan-out to watches one
//! atomic step, as a single etcd transaction is for the real server.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use crate::kinds::{self, Kind, KindError};
use crate::selectors::{FieldSelector, LabelSelector};
use crate::status::ApiError;
use crate::validation::{is_dns1123_subdomain, is_label_key, is_label_value};

pub(crate) type KindId = usize;

/// Past this many events the oldest history is dropped, as etcd compaction
/// would, so that a long test does not grow the double without bound.
const MAX_HISTORY: usize = 100_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One write, as kept in history and sent to watches.
#[derive(Debug)]
pub(crate) struct Event {
    pub rv: u64,
    pub kind: KindId,
    pub namespace: String,
    pub name: String,
    pub etype: EventType,
    pub object: Value,
    /// The object before this write (None for a creation): lets a paginated
    /// list be served from the snapshot its first page was taken at.
    pub prev: Option<Value>,
}

struct WatchSink {
    kind: KindId,
    namespace: Option<String>,
    tx: mpsc::UnboundedSender<Arc<Event>>,
}

/// Which part of an object a PUT or PATCH addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    Main,
    Status,
}

#[derive(Debug, Default)]
pub(crate) struct ListOptions {
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    pub limit: Option<usize>,
    pub continue_token: Option<String>,
    pub resource_version: Option<String>,
    pub exact: bool,
}

#[derive(Debug, Default)]
pub(crate) struct DeleteOptions {
    pub uid: Option<String>,
    pub resource_version: Option<String>,
}

/// Where a watch starts.
#[derive(Debug, Clone, Copy)]
pub(crate) enum WatchFrom {
    /// Synthetic ADDED events for what exists now, then live events.
    Current,
    /// Every event after this resourceVersion, then live events.
    Version(u64),
}

pub(crate) struct WatchSetup {
    pub initial: Vec<Arc<Event>>,
    pub rx: mpsc::UnboundedReceiver<Arc<Event>>,
    /// Set when the start version has been compacted away.
    pub expired: Option<ApiError>,
}

pub(crate) struct Store {
    pub kinds: Vec<Kind>,
    rv: u64,
    objects: BTreeMap<ObjectKey, Value>,
    history: VecDeque<Arc<Event>>,
    /// Events at or below this version are forgotten.
    compacted: u64,
    watches: Vec<WatchSink>,
}

/// Where a stored object is: its kind, namespace and name.
type ObjectKey = (KindId, String, String);

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

fn meta(obj: &Value) -> Option<&Map<String, Value>> {
    obj.get("metadata").and_then(Value::as_object)
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    meta(obj).and_then(|m| m.get(field)).and_then(Value::as_str)
}

fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    let map = obj.as_object_mut().expect("checked to be an object");
    let entry = map.entry("metadata").or_insert_with(|| json!({}));
    if !entry.is_object() {
        *entry = json!({});
    }
    entry.as_object_mut().expect("just made an object")
}

fn finalizers(obj: &Value) -> Vec<String> {
    meta(obj)
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

fn terminating(obj: &Value) -> bool {
    meta(obj).is_some_and(|m| m.get("deletionTimestamp").is_some_and(|t| !t.is_null()))
}

/// Strips what does not count as a change of desired state, so that
/// generation moves on spec changes only (like the registries' strategies).
fn desired_state(obj: &Value) -> Value {
    let mut copy = obj.clone();
    if let Some(map) = copy.as_object_mut() {
        for k in ["metadata", "status", "apiVersion", "kind"] {
            map.remove(k);
        }
    }
    copy
}

/// Rejects bodies the server could not decode into the kind's type.
fn check_shape(kind: &Kind, body: &Value) -> Result<(), ApiError> {
    let Some(map) = body.as_object() else {
        return Err(ApiError::bad_request(
            "the body of the request could not be decoded: expected a JSON object",
        ));
    };
    if let Some(v) = map.get("apiVersion").and_then(Value::as_str)
        && !v.is_empty()
        && v != kind.api_version()
    {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({v}) does not match the expected API version ({})",
            kind.api_version()
        )));
    }
    if let Some(k) = map.get("kind").and_then(Value::as_str)
        && !k.is_empty()
        && k != kind.kind
    {
        return Err(ApiError::bad_request(format!(
            "the kind in the data ({k}) does not match the expected kind ({})",
            kind.kind
        )));
    }
    let Some(m) = map.get("metadata") else {
        return Ok(());
    };
    let decode = |what: &str| {
        ApiError::bad_request(format!(
            "the body of the request could not be decoded: {what}"
        ))
    };
    let m = m
        .as_object()
        .ok_or_else(|| decode("metadata must be an object"))?;
    for field in ["labels", "annotations"] {
        if let Some(v) = m.get(field).filter(|v| !v.is_null()) {
            let ok = v
                .as_object()
                .is_some_and(|o| o.values().all(Value::is_string));
            if !ok {
                return Err(decode(&format!(
                    "metadata.{field} must map strings to strings"
                )));
            }
        }
    }
    if let Some(v) = m.get("finalizers").filter(|v| !v.is_null()) {
        let ok = v.as_array().is_some_and(|a| a.iter().all(Value::is_string));
        if !ok {
            return Err(decode("metadata.finalizers must be a list of strings"));
        }
    }
    Ok(())
}

fn check_labels(kind: &Kind, name: &str, obj: &Value) -> Result<(), ApiError> {
    let Some(m) = meta(obj) else { return Ok(()) };
    if let Some(labels) = m.get("labels").and_then(Value::as_object) {
        for (k, v) in labels {
            if !is_label_key(k) {
                return Err(ApiError::invalid(
                    kind,
                    name,
                    "metadata.labels",
                    &format!(
                        "Invalid value: \"{k}\": name part must consist of alphanumeric characters, '-', '_' or '.'"
                    ),
                ));
            }
            let v = v.as_str().unwrap_or_default();
            if !is_label_value(v) {
                return Err(ApiError::invalid(
                    kind,
                    name,
                    "metadata.labels",
                    &format!(
                        "Invalid value: \"{v}\": a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.'"
                    ),
                ));
            }
        }
    }
    if let Some(annotations) = m.get("annotations").and_then(Value::as_object)
        && let Some(k) = annotations.keys().find(|k| !is_label_key(k))
    {
        return Err(ApiError::invalid(
            kind,
            name,
            "metadata.annotations",
            &format!(
                "Invalid value: \"{k}\": name part must consist of alphanumeric characters, '-', '_' or '.'"
            ),
        ));
    }
    Ok(())
}

/// What a PUT must agree on with the stored object `old`: the name and
/// namespace of the URL, the version it replaces (which a custom resource
/// must name unless patched), its uid, and that only a delete terminates.
fn check_update_of(
    kind: &Kind,
    ns: &str,
    name: &str,
    body: &Value,
    old: &Value,
    from_patch: bool,
) -> Result<(), ApiError> {
    let body_name = meta_str(body, "name").unwrap_or_default();
    if body_name != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    if let Some(body_ns) = meta_str(body, "namespace")
        && !body_ns.is_empty()
        && body_ns != ns
    {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let old_rv = meta_str(old, "resourceVersion").unwrap_or_default();
    match meta_str(body, "resourceVersion").filter(|v| !v.is_empty()) {
        Some(rv) if rv != old_rv => return Err(ApiError::modified(kind, name)),
        None if kind.custom && !from_patch => {
            return Err(ApiError::invalid(
                kind,
                name,
                "metadata.resourceVersion",
                "Invalid value: 0x0: must be specified for an update",
            ));
        }
        Some(_) | None => {}
    }
    check_uid(
        kind,
        name,
        meta_str(body, "uid").filter(|u| !u.is_empty()),
        old,
    )?;
    if !terminating(old) && terminating(body) {
        return Err(ApiError::invalid(
            kind,
            name,
            "metadata.deletionTimestamp",
            "Invalid value: field is immutable; may only be set by a delete",
        ));
    }
    Ok(())
}

/// A uid precondition (`want`) against the stored object's uid.
fn check_uid(kind: &Kind, name: &str, want: Option<&str>, old: &Value) -> Result<(), ApiError> {
    let old_uid = meta_str(old, "uid").unwrap_or_default();
    match want {
        Some(uid) if uid != old_uid => Err(ApiError::conflict(
            kind,
            name,
            &format!(
                "Precondition failed: UID in precondition: {uid}, UID in object meta: {old_uid}"
            ),
        )),
        _ => Ok(()),
    }
}

/// The object a PUT leaves: the body, with the stored status kept when the
/// kind has a status subresource; for `/status`, the stored object with
/// the body's status.
fn replaced_part(kind: &Kind, body: Value, old: &Value, target: Target) -> Value {
    let (mut new, status_from) = match target {
        Target::Main if !kind.status_subresource => return body,
        Target::Main => (body, old.get("status").cloned()),
        Target::Status => (old.clone(), body.get("status").cloned()),
    };
    let map = new
        .as_object_mut()
        .expect("checked or stored objects are objects");
    match status_from {
        Some(status) => map.insert("status".into(), status),
        None => map.remove("status"),
    };
    new
}

/// Overrides what the client may not change: server-owned metadata, the
/// identity, the version (bumped on commit), apiVersion and kind.
fn keep_server_fields(kind: &Kind, ns: &str, name: &str, new: &mut Value, old: &Value) {
    let old_meta = meta(old).cloned().unwrap_or_default();
    let m = meta_mut(new);
    for field in [
        "uid",
        "creationTimestamp",
        "generation",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
    ] {
        match old_meta.get(field) {
            Some(v) => m.insert(field.into(), v.clone()),
            None => m.remove(field),
        };
    }
    m.remove("selfLink");
    m.insert("name".into(), json!(name));
    m.insert("namespace".into(), json!(ns));
    let old_rv = old_meta
        .get("resourceVersion")
        .cloned()
        .unwrap_or(json!(""));
    m.insert("resourceVersion".into(), old_rv);
    let map = new.as_object_mut().expect("checked");
    map.insert("apiVersion".into(), json!(kind.api_version()));
    map.insert("kind".into(), json!(kind.kind));
}

/// An object being deleted may lose finalizers, never gain one.
fn check_no_new_finalizers(
    kind: &Kind,
    name: &str,
    old: &Value,
    new: &Value,
) -> Result<(), ApiError> {
    if !terminating(old) {
        return Ok(());
    }
    let before = finalizers(old);
    let added: Vec<String> = finalizers(new)
        .into_iter()
        .filter(|f| !before.contains(f))
        .collect();
    if added.is_empty() {
        return Ok(());
    }
    Err(ApiError::invalid(
        kind,
        name,
        "metadata.finalizers",
        &format!(
            "Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers {added:?}"
        ),
    ))
}

/// Five characters from the alphabet apimachinery's `rand.String` uses
/// (no vowels, so generated names spell no words).
fn name_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    uuid::Uuid::new_v4().as_bytes()[..5]
        .iter()
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect()
}

fn encode_continue(rv: u64, ns: &str, name: &str) -> String {
    let raw = json!({"rv": rv, "start": [ns, name]}).to_string();
    raw.bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode_continue(token: &str) -> Option<(u64, String, String)> {
    if !token.len().is_multiple_of(2) {
        return None;
    }
    let bytes: Option<Vec<u8>> = (0..token.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(token.get(i..i + 2)?, 16).ok())
        .collect();
    let v: Value = serde_json::from_slice(&bytes?).ok()?;
    let rv = v.get("rv")?.as_u64()?;
    let start = v.get("start")?.as_array()?;
    Some((
        rv,
        start.first()?.as_str()?.to_string(),
        start.get(1)?.as_str()?.to_string(),
    ))
}

impl Store {
    pub fn new() -> Self {
        Store {
            kinds: kinds::builtin(),
            // etcd revisions start above zero; "0" means "any" to clients.
            rv: 1,
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            compacted: 1,
            watches: Vec::new(),
        }
    }

    pub fn find_kind(&self, group: &str, version: &str, plural: &str) -> Option<KindId> {
        self.kinds
            .iter()
            .position(|k| k.group == group && k.version == version && k.plural == plural)
    }

    /// Serves `kind`: a new kind, or the new definition of the custom kind
    /// with the same group and plural, as updating its CRD would (its
    /// objects stay and read as the new version).
    pub fn register(&mut self, kind: Kind) -> Result<KindId, KindError> {
        if self
            .kinds
            .iter()
            .any(|k| !k.custom && k.group == kind.group)
        {
            return Err(KindError::BuiltinGroup { group: kind.group });
        }
        let existing = self
            .kinds
            .iter()
            .position(|k| k.custom && k.group == kind.group && k.plural == kind.plural);
        let Some(kid) = existing else {
            self.kinds.push(kind);
            return Ok(self.kinds.len() - 1);
        };
        let (api_version, kind_name) = (kind.api_version(), kind.kind.clone());
        for ((_, _, _), obj) in self.objects.iter_mut().filter(|((k, _, _), _)| *k == kid) {
            obj["apiVersion"] = json!(api_version);
            obj["kind"] = json!(kind_name);
        }
        self.kinds[kid] = kind;
        Ok(kid)
    }

    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    /// Appends to history and hands the event to every interested watch.
    fn record(&mut self, kid: KindId, etype: EventType, object: Value, prev: Option<Value>) {
        let event = Arc::new(Event {
            rv: self.rv,
            kind: kid,
            namespace: meta_str(&object, "namespace")
                .unwrap_or_default()
                .to_string(),
            name: meta_str(&object, "name").unwrap_or_default().to_string(),
            etype,
            object,
            prev,
        });
        self.history.push_back(event.clone());
        while self.history.len() > MAX_HISTORY {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.rv;
            }
        }
        // A failed send means the watch's stream is gone: drop its sink.
        self.watches.retain(|w| {
            if w.kind != kid
                || w.namespace
                    .as_ref()
                    .is_some_and(|ns| *ns != event.namespace)
            {
                return !w.tx.is_closed();
            }
            w.tx.send(event.clone()).is_ok()
        });
    }

    pub fn create(&mut self, kid: KindId, ns: &str, mut body: Value) -> Result<Value, ApiError> {
        let kind = self.kinds[kid].clone();
        check_shape(&kind, &body)?;
        let m = meta_mut(&mut body);
        if let Some(body_ns) = m.get("namespace").and_then(Value::as_str)
            && !body_ns.is_empty()
            && body_ns != ns
        {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        let mut name = m
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if name.is_empty() {
            match m.get("generateName").and_then(Value::as_str) {
                Some(prefix) if !prefix.is_empty() => name = format!("{prefix}{}", name_suffix()),
                _ => {
                    return Err(ApiError::invalid(
                        &kind,
                        "",
                        "metadata.name",
                        "Required value: name or generateName is required",
                    ));
                }
            }
        }
        if !is_dns1123_subdomain(&name) {
            return Err(ApiError::invalid(
                &kind,
                &name,
                "metadata.name",
                &format!(
                    "Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"
                ),
            ));
        }
        check_labels(&kind, &name, &body)?;
        let key = (kid, ns.to_string(), name.clone());
        // A terminating object still holds its name: creating again is a
        // conflict until its finalizers are gone.
        if self.objects.contains_key(&key) {
            return Err(ApiError::already_exists(&kind, &name));
        }
        self.rv += 1;
        let m = meta_mut(&mut body);
        m.insert("name".into(), json!(name));
        m.insert("namespace".into(), json!(ns));
        m.insert("uid".into(), json!(uuid::Uuid::new_v4().to_string()));
        m.insert("creationTimestamp".into(), json!(now()));
        m.insert("resourceVersion".into(), json!(self.rv.to_string()));
        m.insert("generation".into(), json!(1));
        for server_owned in [
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "selfLink",
        ] {
            m.remove(server_owned);
        }
        let map = body.as_object_mut().expect("checked");
        map.insert("apiVersion".into(), json!(kind.api_version()));
        map.insert("kind".into(), json!(kind.kind));
        if kind.status_subresource {
            // Status is written through /status only; the pod registry
            // starts every pod Pending.
            map.remove("status");
            if kind.plural == "pods" {
                map.insert("status".into(), json!({"phase": "Pending"}));
            }
        }
        self.objects.insert(key, body.clone());
        self.record(kid, EventType::Added, body.clone(), None);
        Ok(body)
    }

    pub fn get(&self, kid: KindId, ns: &str, name: &str) -> Result<Value, ApiError> {
        self.objects
            .get(&(kid, ns.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| ApiError::not_found(&self.kinds[kid], name))
    }

    /// The kind's objects as they were at `at` (history must reach back).
    fn snapshot(&self, kid: KindId, at: u64) -> BTreeMap<(String, String), Value> {
        let mut map: BTreeMap<(String, String), Value> = self
            .objects
            .range((kid, String::new(), String::new())..)
            .take_while(|((k, _, _), _)| *k == kid)
            .map(|((_, ns, n), v)| ((ns.clone(), n.clone()), v.clone()))
            .collect();
        for ev in self.history.iter().rev() {
            if ev.rv <= at {
                break;
            }
            if ev.kind != kid {
                continue;
            }
            let key = (ev.namespace.clone(), ev.name.clone());
            match &ev.prev {
                None => map.remove(&key),
                Some(prev) => map.insert(key, prev.clone()),
            };
        }
        map
    }

    pub fn list(
        &self,
        kid: KindId,
        ns: Option<&str>,
        opts: &ListOptions,
    ) -> Result<Value, ApiError> {
        let kind = &self.kinds[kid];
        let mut at = self.rv;
        let mut start_after = None;
        if let Some(token) = opts.continue_token.as_deref().filter(|t| !t.is_empty()) {
            let (rv, tns, tname) = decode_continue(token)
                .ok_or_else(|| ApiError::bad_request("continue key is not valid"))?;
            if rv < self.compacted {
                return Err(ApiError::expired(
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.",
                ));
            }
            at = rv;
            start_after = Some((tns, tname));
        } else if let Some(rv) = opts
            .resource_version
            .as_deref()
            .filter(|v| !v.is_empty() && *v != "0")
        {
            let rv: u64 = rv
                .parse()
                .map_err(|_| ApiError::bad_request(format!("invalid resource version: {rv}")))?;
            if rv > self.rv {
                let mut err = ApiError::new(
                    504,
                    "Timeout",
                    format!("Too large resource version: {rv}, current: {}", self.rv),
                );
                err.details = Some(
                    json!({"retryAfterSeconds": 1, "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}]}),
                );
                return Err(err);
            }
            if opts.exact {
                if rv < self.compacted {
                    return Err(ApiError::expired(
                        "The resourceVersion for the provided list is too old.",
                    ));
                }
                at = rv;
            }
        }
        let snapshot = self.snapshot(kid, at);
        let selected: Vec<&Value> = snapshot
            .iter()
            .filter(|((ons, oname), _)| {
                ns.is_none_or(|ns| ns == ons)
                    && start_after
                        .as_ref()
                        .is_none_or(|(sns, sname)| (ons, oname) > (sns, sname))
            })
            .map(|(_, v)| v)
            .filter(|v| opts.labels.matches(v) && opts.fields.matches(v))
            .collect();
        let total = selected.len();
        let take = opts.limit.filter(|l| *l > 0).unwrap_or(total).min(total);
        let mut items: Vec<Value> = selected[..take].iter().map(|v| (*v).clone()).collect();
        if !kind.custom {
            // Typed lists from the built-in registries carry no per-item
            // apiVersion/kind; only custom resources (unstructured) do.
            for item in &mut items {
                if let Some(map) = item.as_object_mut() {
                    map.remove("apiVersion");
                    map.remove("kind");
                }
            }
        }
        let mut list_meta = json!({"resourceVersion": at.to_string()});
        if take < total {
            let last = &selected[take - 1];
            list_meta["continue"] = json!(encode_continue(
                at,
                meta_str(last, "namespace").unwrap_or_default(),
                meta_str(last, "name").unwrap_or_default()
            ));
            if opts.labels == LabelSelector::default() && opts.fields == FieldSelector::default() {
                list_meta["remainingItemCount"] = json!(total - take);
            }
        }
        Ok(json!({
            "kind": kind.list_kind(),
            "apiVersion": kind.api_version(),
            "metadata": list_meta,
            "items": items,
        }))
    }

    /// PUT (and the final step of PATCH). `from_patch` relaxes the
    /// custom-resource rule that a PUT must name the version it replaces:
    /// a patch is applied to the current object, so it always does.
    pub fn update(
        &mut self,
        kid: KindId,
        ns: &str,
        name: &str,
        body: Value,
        target: Target,
        from_patch: bool,
    ) -> Result<Value, ApiError> {
        let (kind, key, old) = self.stored(kid, ns, name)?;
        check_shape(&kind, &body)?;
        check_update_of(&kind, ns, name, &body, &old, from_patch)?;
        let mut new = replaced_part(&kind, body, &old, target);
        keep_server_fields(&kind, ns, name, &mut new, &old);
        check_labels(&kind, name, &new)?;
        check_no_new_finalizers(&kind, name, &old, &new)?;
        if target == Target::Main && desired_state(&new) != desired_state(&old) {
            let generation = meta(&old)
                .and_then(|m| m.get("generation"))
                .and_then(Value::as_i64)
                .unwrap_or(0);
            meta_mut(&mut new).insert("generation".into(), json!(generation + 1));
        }
        // Like etcd's guaranteed update: writing identical bytes is a no-op
        // that neither bumps the version nor wakes watches.
        if new == old {
            return Ok(old);
        }
        self.rv += 1;
        meta_mut(&mut new).insert("resourceVersion".into(), json!(self.rv.to_string()));
        if terminating(&new) && finalizers(&new).is_empty() {
            self.objects.remove(&key);
            self.record(kid, EventType::Deleted, new.clone(), Some(old));
        } else {
            self.objects.insert(key, new.clone());
            self.record(kid, EventType::Modified, new.clone(), Some(old));
        }
        Ok(new)
    }

    /// The stored object `ns/name` of `kid` (with its kind and key), or the
    /// API server's 404.
    fn stored(
        &self,
        kid: KindId,
        ns: &str,
        name: &str,
    ) -> Result<(Kind, ObjectKey, Value), ApiError> {
        let kind = self.kinds[kid].clone();
        let key = (kid, ns.to_string(), name.to_string());
        let old = self
            .objects
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiError::not_found(&kind, name))?;
        Ok((kind, key, old))
    }

    /// DELETE of one object: the response body.
    pub fn delete(
        &mut self,
        kid: KindId,
        ns: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<Value, ApiError> {
        let (obj, removed) = self.delete_object(kid, ns, name, opts)?;
        let kind = &self.kinds[kid];
        if !removed || kind.returns_deleted_object {
            return Ok(obj);
        }
        Ok(json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {
                "name": name,
                "group": kind.group,
                "kind": kind.plural,
                "uid": meta_str(&obj, "uid").unwrap_or_default(),
            },
        }))
    }

    /// Deletes or marks terminating; returns the object's last state and
    /// whether it is gone.
    fn delete_object(
        &mut self,
        kid: KindId,
        ns: &str,
        name: &str,
        opts: &DeleteOptions,
    ) -> Result<(Value, bool), ApiError> {
        let (kind, key, old) = self.stored(kid, ns, name)?;
        check_uid(&kind, name, opts.uid.as_deref(), &old)?;
        let old_rv = meta_str(&old, "resourceVersion").unwrap_or_default();
        if let Some(rv) = opts.resource_version.as_deref()
            && rv != old_rv
        {
            return Err(ApiError::conflict(
                &kind,
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {old_rv}"
                ),
            ));
        }
        if terminating(&old) {
            // Already being deleted: nothing more to do until finalizers go.
            return Ok((old, false));
        }
        self.rv += 1;
        let mut new = old.clone();
        let m = meta_mut(&mut new);
        m.insert("resourceVersion".into(), json!(self.rv.to_string()));
        if !finalizers(&old).is_empty() {
            let m = meta_mut(&mut new);
            m.insert("deletionTimestamp".into(), json!(now()));
            m.insert("deletionGracePeriodSeconds".into(), json!(0));
            self.objects.insert(key, new.clone());
            self.record(kid, EventType::Modified, new.clone(), Some(old));
            return Ok((new, false));
        }
        self.objects.remove(&key);
        self.record(kid, EventType::Deleted, new.clone(), Some(old));
        Ok((new, true))
    }

    /// DELETE on a collection: deletes every selected object, answering with
    /// the list of what was deleted (or marked terminating).
    pub fn delete_collection(
        &mut self,
        kid: KindId,
        ns: &str,
        opts: &ListOptions,
    ) -> Result<Value, ApiError> {
        let list = self.list(kid, Some(ns), opts)?;
        let mut deleted = Vec::new();
        for item in list["items"].as_array().into_iter().flatten() {
            let name = meta_str(item, "name").unwrap_or_default().to_string();
            let (mut obj, _) = self.delete_object(kid, ns, &name, &DeleteOptions::default())?;
            if !self.kinds[kid].custom
                && let Some(map) = obj.as_object_mut()
            {
                map.remove("apiVersion");
                map.remove("kind");
            }
            deleted.push(obj);
        }
        let kind = &self.kinds[kid];
        Ok(json!({
            "kind": kind.list_kind(),
            "apiVersion": kind.api_version(),
            "metadata": {"resourceVersion": self.rv.to_string()},
            "items": deleted,
        }))
    }

    pub fn watch(&mut self, kid: KindId, ns: Option<&str>, from: WatchFrom) -> WatchSetup {
        let (tx, rx) = mpsc::unbounded_channel();
        let in_ns = |n: &str| ns.is_none_or(|ns| ns == n);
        let initial: Vec<Arc<Event>> = match from {
            WatchFrom::Version(v) if v < self.compacted => {
                let oldest = self.history.front().map_or(self.rv, |e| e.rv);
                return WatchSetup {
                    initial: Vec::new(),
                    rx,
                    expired: Some(ApiError::expired(format!(
                        "too old resource version: {v} ({oldest})"
                    ))),
                };
            }
            WatchFrom::Version(v) => self
                .history
                .iter()
                .filter(|e| e.rv > v && e.kind == kid && in_ns(&e.namespace))
                .cloned()
                .collect(),
            WatchFrom::Current => self
                .objects
                .iter()
                .filter(|((k, n, _), _)| *k == kid && in_ns(n))
                .map(|((_, n, name), obj)| {
                    Arc::new(Event {
                        rv: meta_str(obj, "resourceVersion")
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(0),
                        kind: kid,
                        namespace: n.clone(),
                        name: name.clone(),
                        etype: EventType::Added,
                        object: obj.clone(),
                        prev: None,
                    })
                })
                .collect(),
        };
        self.watches.push(WatchSink {
            kind: kid,
            namespace: ns.map(str::to_string),
            tx,
        });
        WatchSetup {
            initial,
            rx,
            expired: None,
        }
    }

    /// Dropping the senders ends every watch stream once it has drained.
    pub fn close_watches(&mut self) {
        self.watches.clear();
    }

    pub fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continue_token_round_trip() {
        let t = encode_continue(42, "ns", "a-b");
        assert_eq!(decode_continue(&t), Some((42, "ns".into(), "a-b".into())));
        assert_eq!(decode_continue("zz"), None);
        assert_eq!(decode_continue("abc"), None);
    }

    #[test]
    fn snapshot_undoes_later_writes() {
        let mut s = Store::new();
        let lease = s.find_kind("coordination.k8s.io", "v1", "leases").unwrap();
        s.create(
            lease,
            "ns",
            json!({"metadata": {"name": "a"}, "spec": {"x": 1}}),
        )
        .unwrap();
        let at = s.resource_version();
        s.create(lease, "ns", json!({"metadata": {"name": "b"}}))
            .unwrap();
        s.update(
            lease,
            "ns",
            "a",
            json!({"metadata": {"name": "a"}, "spec": {"x": 2}}),
            Target::Main,
            false,
        )
        .unwrap();
        let snap = s.snapshot(lease, at);
        assert_eq!(snap.len(), 1);
        assert_eq!(snap[&("ns".into(), "a".into())]["spec"]["x"], 1);
    }
}
