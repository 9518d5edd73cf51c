//! Prepared namespaces: made ahead of creates (a veth, an address, the
//! veth registered with nftables), released, and taken back after a
//! restart. Everything here blocks (processes, mounts): callers run it on
//! the blocking pool.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sandbolt_proto::egress::NetworkPolicy;
use tokio::sync::watch;

use super::cni::Cni;
use super::state::{Dirs, Member};
use super::{Live, NetworkError, Result, Shared, namespace, nft};

/// How long the pool waits after a take before preparing again.
const REFILL_DELAY: Duration = Duration::from_millis(250);
/// Pause after a failed preparation before the pool tries again.
const RETRY_AFTER: Duration = Duration::from_secs(5);

/// Makes one pool member: state file first (so a crash at any later step
/// leaves a record that recovery or purge finds), then the namespace, CNI,
/// and the veth in `sandbox_ifaces` (its traffic is dropped until attach).
pub(super) fn prepare(shared: &Shared) -> Result<Member> {
    let member_id = format!("m{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
    let mut member = Member {
        netns_path: shared.dirs.netns().join(&member_id),
        member_id,
        ip: None,
        gateway: shared.gateway,
        host_veth: None,
        sandbox_id: None,
        policy_json: String::new(),
    };
    shared.dirs.save(&member)?;
    let made = namespace::create(&member.netns_path)
        .and_then(|()| Ok(shared.cni.add(&member.member_id, &member.netns_path)?))
        .and_then(|ptp| {
            member.ip = Some(ptp.ip);
            member.host_veth = Some(ptp.host_veth);
            shared.dirs.save(&member)?;
            nft::apply(
                &shared
                    .table
                    .add_iface(member.host_veth.as_deref().unwrap_or_default()),
            )?;
            Ok(())
        });
    match made {
        Ok(()) => Ok(member),
        Err(e) => {
            release_member(shared, &member);
            Err(e)
        }
    }
}

/// Undoes [`prepare`] and an attachment: rules, CNI (veth and address),
/// namespace, state file. Best effort: every step runs, failures are
/// logged, and the state file stays when the namespace could not be
/// released (the next recovery or purge tries again).
pub(super) fn release_member(shared: &Shared, member: &Member) {
    let id = &member.member_id;
    let attached = member.sandbox_id.is_some();
    if member.host_veth.is_some() || attached {
        let script = shared
            .table
            .detach(id, member.host_veth.as_deref(), attached);
        if nft::apply(&script).is_err() {
            // Some of it is already gone: remove what is left, one by one.
            for line in script.lines() {
                let _ = nft::apply(line);
            }
        }
    }
    if remove_namespace(&shared.dirs, Some(&shared.cni), id)
        && let Err(e) = shared.dirs.remove(id)
    {
        tracing::warn!(member = %id, error = %e, "removing the member file");
    }
    tracing::debug!(member = %id, sandbox = member.sandbox_id.as_deref().unwrap_or(""), "network member released");
}

/// CNI DEL (when `cni` is given), then unmount and unlink the namespace
/// file of `member_id`. Returns whether it all succeeded.
fn remove_namespace(dirs: &Dirs, cni: Option<&Cni>, member_id: &str) -> bool {
    let path = dirs.netns().join(member_id);
    let mounted = namespace::is_mounted(&path);
    let mut ok = true;
    if let Some(cni) = cni
        && let Err(e) = cni.del(member_id, mounted.then_some(path.as_path()))
    {
        tracing::warn!(member = %member_id, error = %e, "CNI DEL");
        ok = false;
    }
    if let Err(e) = namespace::remove(&path) {
        tracing::warn!(member = %member_id, error = %e, "removing the namespace");
        ok = false;
    }
    ok
}

/// Every namespace and member file under `dirs` (purge).
pub(super) fn remove_namespaces(dirs: &Dirs, cni: Option<&Cni>) -> usize {
    let mut ids: HashSet<String> = dirs.load_all().into_iter().map(|m| m.member_id).collect();
    if let Ok(entries) = std::fs::read_dir(dirs.netns()) {
        ids.extend(
            entries
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok()),
        );
    }
    for id in &ids {
        remove_namespace(dirs, cni, id);
        let _ = dirs.remove(id);
    }
    ids.len()
}

/// What [`recover`] found.
#[derive(Debug, Default)]
pub(super) struct Recovered {
    pub attached: usize,
    pub pooled: usize,
    pub released: usize,
}

/// Takes back the members a previous agent left: those whose namespace and
/// veth still exist and whose sandbox is in `live` (or that were in the
/// pool) get their rules re-declared (resolved addresses kept); the rest is
/// released, as is any namespace file without a member.
pub(super) fn recover(shared: &Arc<Shared>, live: &HashSet<String>) -> Recovered {
    let mut found = Recovered::default();
    let mut known = HashSet::new();
    for member in shared.dirs.load_all() {
        known.insert(member.member_id.clone());
        match take_back(shared, &member, live) {
            Ok(Some(l)) => {
                if l.member.sandbox_id.is_some() {
                    found.attached += 1;
                } else {
                    found.pooled += 1;
                }
                shared.members.lock().insert(l);
            }
            Ok(None) => {
                release_member(shared, &member);
                found.released += 1;
            }
            Err(e) => {
                tracing::warn!(member = %member.member_id, error = %e, "could not take a network member back; releasing it");
                release_member(shared, &member);
                found.released += 1;
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir(shared.dirs.netns()) {
        for name in entries
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
        {
            if !known.contains(&name) {
                remove_namespace(&shared.dirs, Some(&shared.cni), &name);
                found.released += 1;
            }
        }
    }
    found
}

/// The member as a [`Live`] with its rules re-applied, or None when it is
/// stale (sandbox gone, namespace or veth missing).
fn take_back(shared: &Shared, member: &Member, live: &HashSet<String>) -> Result<Option<Live>> {
    let (Some(ip), Some(veth)) = (member.ip, member.host_veth.as_deref()) else {
        return Ok(None);
    };
    if !shared.cni.subnet.contains(ip) {
        return Ok(None);
    }
    let usable = namespace::is_mounted(&member.netns_path)
        && Path::new("/sys/class/net").join(veth).exists()
        && member.sandbox_id.as_ref().is_none_or(|s| live.contains(s));
    if !usable {
        return Ok(None);
    }
    let policy = NetworkPolicy::parse(&member.policy_json)
        .map_err(|e| NetworkError::Other(format!("stored policy: {e}")))?;
    let l = Live {
        member: member.clone(),
        policy: Arc::new(policy),
    };
    let script = match member.sandbox_id {
        Some(_) => shared.table.attach(&l.rules(), false),
        None => shared.table.add_iface(veth),
    };
    nft::apply(&script)?;
    Ok(Some(l))
}

/// Keeps `pool_size` members prepared: wakes on every take, prepares until
/// full, backs off after a failure.
pub(super) async fn refill(shared: Arc<Shared>, mut stop: watch::Receiver<bool>) {
    loop {
        if *stop.borrow() {
            return;
        }
        let wanted = {
            let members = shared.members.lock();
            let preparing = *shared.preparing.lock();
            shared
                .pool_size
                .saturating_sub(members.pool.len() + preparing)
        };
        if wanted == 0 {
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = shared.refill.notified() => {}
            }
            // A take happens inside a create: preparing right away would
            // compete with it for the CPU (CNI and nft are processes).
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                () = tokio::time::sleep(REFILL_DELAY) => continue,
            }
        }
        *shared.preparing.lock() += 1;
        let s = shared.clone();
        let made = tokio::task::spawn_blocking(move || prepare(&s)).await;
        *shared.preparing.lock() -= 1;
        match made {
            Ok(Ok(member)) => {
                let live = Live {
                    member,
                    policy: Arc::new(NetworkPolicy::default()),
                };
                shared.members.lock().insert(live);
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "preparing a network namespace for the pool failed");
                tokio::select! {
                    _ = stop.wait_for(|s| *s) => return,
                    () = tokio::time::sleep(RETRY_AFTER) => {}
                }
            }
            Err(e) => tracing::warn!(error = %e, "pool preparation task failed"),
        }
    }
}
