//! Snapshot records and their wire form: the request checks, the
//! conversions to `sandbolt.control.v1`, the list filter and its pages.

use std::collections::{BTreeMap, HashMap};

use sandbolt_proto::agent::v1 as apb;
use sandbolt_proto::control::v1 as pb;

use crate::error::{Error, Result};
use crate::store::{SandboxRecord, SnapshotPhase, SnapshotRecord, SnapshotVolumeRecord};

/// The longest display name (as a Kubernetes object name).
const DISPLAY_NAME_MAX: usize = 253;

/// Which snapshots a list answers (empty strings and no phases: all).
#[derive(Debug, Clone, Default)]
pub struct SnapshotFilter {
    pub namespace: String,
    pub source_sandbox: String,
    pub display_name: String,
    pub phases: Vec<SnapshotPhase>,
}

impl SnapshotFilter {
    fn matches(&self, r: &SnapshotRecord) -> bool {
        r.namespace == self.namespace
            && (self.source_sandbox.is_empty() || r.source_sandbox == self.source_sandbox)
            && (self.display_name.is_empty() || r.display_name == self.display_name)
            && (self.phases.is_empty() || self.phases.contains(&r.phase))
    }
}

/// Checks what a create carries besides its source: the display name and
/// label-safe metadata (keys `[prefix/]name`, values empty or a name).
pub fn check_create(display_name: &str, metadata: &BTreeMap<String, String>) -> Result<()> {
    if display_name.chars().count() > DISPLAY_NAME_MAX {
        return Err(Error::InvalidArgument(format!(
            "display_name is longer than {DISPLAY_NAME_MAX} characters"
        )));
    }
    for (k, v) in metadata {
        if !label_key_ok(k) {
            return Err(Error::InvalidArgument(format!(
                "metadata key {k:?} is not label-safe: [prefix/]name, name of at most 63 letters, digits, '-', '_', '.' starting and ending with a letter or digit"
            )));
        }
        if !(v.is_empty() || label_name_ok(v)) {
            return Err(Error::InvalidArgument(format!(
                "metadata[{k}] value {v:?} is not label-safe: at most 63 letters, digits, '-', '_', '.' starting and ending with a letter or digit"
            )));
        }
    }
    Ok(())
}

fn label_name_ok(s: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    (1..=63).contains(&s.len())
        && edge(s.chars().next())
        && edge(s.chars().last())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn label_key_ok(k: &str) -> bool {
    match k.split_once('/') {
        None => label_name_ok(k),
        Some((prefix, name)) => {
            (1..=253).contains(&prefix.len())
                && prefix.split('.').all(|part| {
                    !part.is_empty()
                        && !part.starts_with('-')
                        && !part.ends_with('-')
                        && part
                            .chars()
                            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                })
                && label_name_ok(name)
        }
    }
}

pub fn phase_out(p: SnapshotPhase) -> pb::SnapshotPhase {
    match p {
        SnapshotPhase::Pending => pb::SnapshotPhase::Pending,
        SnapshotPhase::Ready => pb::SnapshotPhase::Ready,
        SnapshotPhase::Failed => pb::SnapshotPhase::Failed,
        SnapshotPhase::Deleting => pb::SnapshotPhase::Deleting,
    }
}

/// A list filter's phase; UNSPECIFIED and unknown numbers are refused.
pub fn phase_in(p: i32) -> Result<SnapshotPhase> {
    match pb::SnapshotPhase::try_from(p) {
        Ok(pb::SnapshotPhase::Pending) => Ok(SnapshotPhase::Pending),
        Ok(pb::SnapshotPhase::Ready) => Ok(SnapshotPhase::Ready),
        Ok(pb::SnapshotPhase::Failed) => Ok(SnapshotPhase::Failed),
        Ok(pb::SnapshotPhase::Deleting) => Ok(SnapshotPhase::Deleting),
        _ => Err(Error::InvalidArgument(format!("phases: unknown phase {p}"))),
    }
}

/// The record as `sandbolt.control.v1.Snapshot`; `in_use_by` is computed
/// from the sandbox records by the caller.
pub fn snapshot_out(r: &SnapshotRecord, in_use_by: Vec<String>) -> pb::Snapshot {
    pb::Snapshot {
        namespace: r.namespace.clone(),
        id: r.id.clone(),
        uid: r.uid.clone(),
        display_name: r.display_name.clone(),
        request_id: r.request_id.clone(),
        source_sandbox: r.source_sandbox.clone(),
        source_uid: r.source_uid.clone(),
        phase: phase_out(r.phase) as i32,
        message: r.message.clone(),
        agent_id: r.agent_id.clone(),
        node_name: r.node_name.clone(),
        image: r.image.clone(),
        runtime: r.runtime.clone(),
        size_bytes: r.size_bytes,
        paused_us: r.paused_us,
        took_us: r.took_us,
        volumes: r
            .volumes
            .iter()
            .map(|v| pb::SnapshotVolume {
                volume: v.volume.clone(),
                mount_path: v.mount_path.clone(),
                sub_path: v.sub_path.clone(),
                read_only: v.read_only,
                volume_snapshot: v.volume_snapshot.clone(),
            })
            .collect(),
        metadata: r.metadata.clone().into_iter().collect(),
        created_at_unix_ms: r.created_at_unix_ms,
        completed_at_unix_ms: r.completed_at_unix_ms,
        last_transition_unix_ms: r.last_transition_unix_ms,
        in_use_by,
    }
}

/// The volumes an agent's capture reports, as recorded.
pub fn volumes_in(info: &apb::SnapshotInfo) -> Vec<SnapshotVolumeRecord> {
    info.volumes
        .iter()
        .map(|v| {
            let m = v.mount.clone().unwrap_or_default();
            SnapshotVolumeRecord {
                volume: m.volume,
                mount_path: m.mount_path,
                sub_path: m.sub_path,
                read_only: m.read_only,
                volume_snapshot: v.volume_snapshot.clone(),
            }
        })
        .collect()
}

/// Snapshot id → names of the sandbox records restored from it, in name
/// order (what holds a snapshot on its node).
pub fn users_by_snapshot(sandboxes: &[SandboxRecord]) -> HashMap<String, Vec<String>> {
    let mut users: HashMap<String, Vec<String>> = HashMap::new();
    for s in sandboxes.iter().filter(|s| !s.spec.snapshot_id.is_empty()) {
        users
            .entry(s.spec.snapshot_id.clone())
            .or_default()
            .push(s.name.clone());
    }
    for names in users.values_mut() {
        names.sort();
    }
    users
}

/// The matches of `filter` in (created_at, id) order: one page of
/// `page_size` (0 = all) after `page_token`, and the next page's token
/// (empty on the last page).
pub fn page(
    mut all: Vec<SnapshotRecord>,
    filter: &SnapshotFilter,
    page_size: usize,
    page_token: &str,
) -> Result<(Vec<SnapshotRecord>, String)> {
    let after = parse_token(page_token)?;
    all.retain(|r| filter.matches(r));
    all.sort_by(|a, b| order_key(a).cmp(&order_key(b)));
    if let Some((at, id)) = &after {
        all.retain(|r| order_key(r) > (*at, id.as_str()));
    }
    if page_size == 0 || all.len() <= page_size {
        return Ok((all, String::new()));
    }
    all.truncate(page_size);
    let next = all
        .last()
        .map(|r| format!("{}.{}", r.created_at_unix_ms, r.id))
        .unwrap_or_default();
    Ok((all, next))
}

fn order_key(r: &SnapshotRecord) -> (i64, &str) {
    (r.created_at_unix_ms, r.id.as_str())
}

/// `<created_at_unix_ms>.<id>` of the last snapshot of the previous page.
fn parse_token(token: &str) -> Result<Option<(i64, String)>> {
    if token.is_empty() {
        return Ok(None);
    }
    token
        .split_once('.')
        .and_then(|(at, id)| Some((at.parse().ok()?, id.to_string())))
        .map(Some)
        .ok_or_else(|| Error::InvalidArgument(format!("page_token {token:?} is not one of ours")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_must_be_label_safe() {
        let ok: BTreeMap<_, _> = [
            ("team".to_string(), "a-b".to_string()),
            ("example.com/x_y".into(), String::new()),
        ]
        .into();
        check_create("any name at all", &ok).unwrap();
        for (k, v) in [
            ("-x", "1"),
            ("a b", "1"),
            ("k", "v!"),
            ("Bad_Prefix/x", "1"),
        ] {
            let m: BTreeMap<_, _> = [(k.to_string(), v.to_string())].into();
            assert!(check_create("", &m).is_err(), "{k}={v} must be refused");
        }
        assert!(check_create(&"n".repeat(254), &BTreeMap::new()).is_err());
    }

    #[test]
    fn pages_follow_creation_order_then_id() {
        let rec = |id: &str, at: i64| SnapshotRecord {
            id: id.into(),
            namespace: "default".into(),
            created_at_unix_ms: at,
            ..Default::default()
        };
        let all = vec![rec("c", 2), rec("a", 3), rec("b", 2), rec("d", 1)];
        let f = SnapshotFilter {
            namespace: "default".into(),
            ..Default::default()
        };
        let (p1, t1) = page(all.clone(), &f, 2, "").unwrap();
        let ids = |p: &[SnapshotRecord]| p.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&p1), ["d", "b"]);
        let (p2, t2) = page(all.clone(), &f, 2, &t1).unwrap();
        assert_eq!(ids(&p2), ["c", "a"]);
        assert!(t2.is_empty());
        assert!(page(all, &f, 2, "nonsense").is_err());
    }
}
