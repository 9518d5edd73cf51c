//! What the Kubernetes store finds records by besides their key: the
//! container id, the request id, each metadata pair, and the key order a
//! namespace's pages are read in. Without it every one of those reads
//! copied and sorted the whole watch cache (a create with a request id, each
//! page of a list, a reap report).
//!
//! The index follows the store's merged view (watch cache + own-writes
//! overlay, see the module docs of `kube`): every change of that view for
//! a key re-indexes the key from it, under the overlay's lock — the watch
//! task after each event, the store after each own write. It only names
//! candidates: every read through it re-reads the record by key and checks
//! what it was looked up by, so an entry that lags behind can cost a miss
//! for as long as the lag, never a wrong answer. (The lag is the watch's:
//! between the reflector applying an event and the task indexing it, or an
//! own write whose watch event never comes within `OVERLAY_TTL`.)

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound;
use std::sync::Arc;

use kube::ResourceExt;
use sandbolt_deploy::Sandbox;
use sandbolt_deploy::sandbox::labels_to_metadata;
use serde::Deserialize;

use super::STATE_ANNOTATION;
use crate::ids::SandboxKey;
use crate::store::ListRange;

/// The fields of the state annotation the index needs (the rest is skipped
/// by the parser, not decoded), named as `ControllerState` writes them.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Ids {
    #[serde(default)]
    sandbox_id: String,
    #[serde(default)]
    request_id: String,
}

/// What one key is indexed under.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    sandbox_id: String,
    request_id: String,
    metadata: BTreeMap<String, String>,
    /// Deleted from outside and held by the finalizer
    /// ([`crate::store::Store::deletions_requested`]).
    terminating: bool,
}

impl Entry {
    /// `None` for an object that holds no record (no state annotation: a
    /// tombstone, or a Sandbox sandbolt did not write).
    fn of(obj: &Sandbox) -> Option<Self> {
        let raw = obj.annotations().get(STATE_ANNOTATION)?;
        // A corrupt annotation is indexed by key only: reading it reports
        // the corruption, as a scan did.
        let ids: Ids = serde_json::from_str(raw).unwrap_or_default();
        Some(Self {
            sandbox_id: ids.sandbox_id,
            request_id: ids.request_id,
            metadata: labels_to_metadata(obj.labels()),
            terminating: obj.metadata.deletion_timestamp.is_some()
                && obj
                    .finalizers()
                    .iter()
                    .any(|f| f == sandbolt_deploy::sandbox::FINALIZER),
        })
    }
}

type Pair = (String, String, String);

#[derive(Debug, Default)]
pub(super) struct SandboxIndex {
    /// Every key holding a record, in namespace and name order.
    keys: BTreeMap<Arc<SandboxKey>, Entry>,
    by_sandbox_id: HashMap<String, Arc<SandboxKey>>,
    by_request_id: HashMap<String, Arc<SandboxKey>>,
    /// (namespace, metadata key, value) → names, in order.
    by_metadata: HashMap<Pair, BTreeSet<String>>,
    terminating: BTreeSet<Arc<SandboxKey>>,
}

impl SandboxIndex {
    /// Re-indexes `key` from what the store shows there now (`None`:
    /// nothing).
    pub(super) fn set(&mut self, key: &SandboxKey, obj: Option<&Sandbox>) {
        let entry = obj.and_then(Entry::of);
        if self.keys.get(key) == entry.as_ref() {
            return;
        }
        self.remove(key);
        if let Some(entry) = entry {
            self.insert(Arc::new(key.clone()), entry);
        }
    }

    /// Starts over from every object (the watch listed anew: objects deleted
    /// while it was away come with no event).
    pub(super) fn rebuild<'a>(&mut self, objects: impl Iterator<Item = (SandboxKey, &'a Sandbox)>) {
        *self = Self::default();
        for (key, obj) in objects {
            if let Some(entry) = Entry::of(obj) {
                self.insert(Arc::new(key), entry);
            }
        }
    }

    fn insert(&mut self, key: Arc<SandboxKey>, entry: Entry) {
        if !entry.sandbox_id.is_empty() {
            self.by_sandbox_id
                .insert(entry.sandbox_id.clone(), key.clone());
        }
        if !entry.request_id.is_empty() {
            self.by_request_id
                .insert(entry.request_id.clone(), key.clone());
        }
        for (k, v) in &entry.metadata {
            self.by_metadata
                .entry((key.namespace.clone(), k.clone(), v.clone()))
                .or_default()
                .insert(key.name.clone());
        }
        if entry.terminating {
            self.terminating.insert(key.clone());
        }
        self.keys.insert(key, entry);
    }

    fn remove(&mut self, key: &SandboxKey) {
        let Some((key, old)) = self.keys.remove_entry(key) else {
            return;
        };
        // A container or request id another key holds now stays its.
        if self.by_sandbox_id.get(&old.sandbox_id) == Some(&key) {
            self.by_sandbox_id.remove(&old.sandbox_id);
        }
        if self.by_request_id.get(&old.request_id) == Some(&key) {
            self.by_request_id.remove(&old.request_id);
        }
        for (k, v) in old.metadata {
            let pair = (key.namespace.clone(), k, v);
            if let Some(names) = self.by_metadata.get_mut(&pair) {
                names.remove(&key.name);
                if names.is_empty() {
                    self.by_metadata.remove(&pair);
                }
            }
        }
        self.terminating.remove(&key);
    }

    pub(super) fn by_sandbox_id(&self, sandbox_id: &str) -> Option<SandboxKey> {
        self.by_sandbox_id.get(sandbox_id).map(|k| (**k).clone())
    }

    pub(super) fn by_request_id(&self, request_id: &str) -> Option<SandboxKey> {
        self.by_request_id.get(request_id).map(|k| (**k).clone())
    }

    /// Up to `max` keys of `range` after `from` (exclusive; `None`: from the
    /// range's start), in order.
    pub(super) fn keys(
        &self,
        range: &ListRange<'_>,
        from: Option<&SandboxKey>,
        max: usize,
    ) -> Vec<SandboxKey> {
        let start = match (from, range.namespace) {
            (Some(k), _) => Bound::Excluded(k.clone()),
            (None, Some(ns)) => match range.after {
                Some(a) => Bound::Excluded(SandboxKey::new(ns, a)),
                None => Bound::Included(SandboxKey::new(ns, "")),
            },
            (None, None) => Bound::Unbounded,
        };
        let start = start.map(Arc::new);
        self.keys
            .range((start, Bound::Unbounded))
            .map(|(k, _)| k)
            .take_while(|k| range.namespace.is_none_or(|ns| k.namespace == ns))
            .take(max)
            .map(|k| (**k).clone())
            .collect()
    }

    /// Up to `max` names of `namespace` holding metadata `key`=`value`,
    /// after `from` (exclusive), in order.
    pub(super) fn names_with(
        &self,
        namespace: &str,
        (key, value): (&str, &str),
        from: Option<&str>,
        max: usize,
    ) -> Vec<String> {
        let pair = (namespace.to_string(), key.to_string(), value.to_string());
        let Some(names) = self.by_metadata.get(&pair) else {
            return Vec::new();
        };
        let start = from.map_or(Bound::Unbounded, |f| Bound::Excluded(f.to_string()));
        names
            .range((start, Bound::Unbounded))
            .take(max)
            .cloned()
            .collect()
    }

    /// Keys deleted from outside, held by the finalizer.
    pub(super) fn terminating(&self) -> Vec<SandboxKey> {
        self.terminating.iter().map(|k| (**k).clone()).collect()
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.keys.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// The object the store writes for such a record.
    fn obj(ns: &str, name: &str, sid: &str, rid: &str, team: &str) -> Sandbox {
        let mut r = crate::store::tests_support::record(ns, name, rid);
        r.sandbox_id = sid.into();
        r.spec.metadata = BTreeMap::from([("team".to_string(), team.to_string())]);
        super::super::to_object(&r, None).unwrap()
    }

    #[test]
    fn reindexing_a_key_moves_every_lookup_with_it() {
        let mut ix = SandboxIndex::default();
        let a = SandboxKey::new("ns", "a");
        ix.set(&a, Some(&obj("ns", "a", "sb-1", "r-1", "red")));
        ix.set(
            &SandboxKey::new("ns", "b"),
            Some(&obj("ns", "b", "sb-2", "", "red")),
        );
        assert_eq!(ix.by_sandbox_id("sb-1"), Some(a.clone()));
        assert_eq!(ix.by_request_id("r-1"), Some(a.clone()));
        assert_eq!(ix.names_with("ns", ("team", "red"), None, 10), ["a", "b"]);
        // Recreated elsewhere and relabelled: the old container id and pair
        // lead nowhere, the new ones to the key.
        ix.set(&a, Some(&obj("ns", "a", "sb-9", "r-1", "blue")));
        assert_eq!(ix.by_sandbox_id("sb-1"), None);
        assert_eq!(ix.by_sandbox_id("sb-9"), Some(a.clone()));
        assert_eq!(ix.names_with("ns", ("team", "red"), None, 10), ["b"]);
        assert_eq!(ix.names_with("ns", ("team", "blue"), None, 10), ["a"]);
        // Gone: nothing leads to it; a page skips it.
        ix.set(&a, None);
        assert_eq!(ix.by_request_id("r-1"), None);
        assert_eq!(ix.len(), 1);
        assert!(ix.names_with("ns", ("team", "blue"), None, 10).is_empty());
        let all = ListRange::namespace("ns");
        assert_eq!(ix.keys(&all, None, 10), [SandboxKey::new("ns", "b")]);
    }

    #[test]
    fn pages_stay_inside_their_namespace_and_start_after_the_token() {
        let mut ix = SandboxIndex::default();
        for (ns, name) in [("a", "x"), ("b", "1"), ("b", "2"), ("b", "3"), ("c", "0")] {
            ix.set(
                &SandboxKey::new(ns, name),
                Some(&obj(ns, name, &format!("sb-{ns}{name}"), "", "t")),
            );
        }
        let names = |v: Vec<SandboxKey>| v.into_iter().map(|k| k.name).collect::<Vec<_>>();
        let b = ListRange::namespace("b");
        assert_eq!(names(ix.keys(&b, None, 10)), ["1", "2", "3"]);
        assert_eq!(names(ix.keys(&b.after(Some("1")), None, 10)), ["2", "3"]);
        assert_eq!(names(ix.keys(&b, None, 2)), ["1", "2"]);
        let from = SandboxKey::new("b", "2");
        assert_eq!(names(ix.keys(&b, Some(&from), 10)), ["3"]);
        assert_eq!(ix.keys(&ListRange::all(), None, 100).len(), 5);
        // A tombstone (no state annotation) is no record.
        let mut tomb = obj("b", "4", "", "", "t");
        tomb.metadata.annotations = None;
        ix.set(&SandboxKey::new("b", "4"), Some(&tomb));
        assert_eq!(names(ix.keys(&b, None, 10)), ["1", "2", "3"]);
    }
}
