//! Egress policy on the Docker backend, enforced the way the containerd fast
//! path enforces it, with the same code (`sandbolt_node::network`):
//!
//! - every container gets an address the lifecycle chooses
//!   (`IPAMConfig.IPv4Address` on the sandbolt network), so that its
//!   nftables chain `sb_<m>`, reached through the `dispatch` map keyed by
//!   source address (declared by [`crate::docker_network::ruleset`]), is in
//!   place before the container starts;
//! - its `/etc/resolv.conf` is a read-only bind mount naming the bridge's
//!   gateway, where the shared DNS proxy answers: denied names NXDOMAIN,
//!   allowed names forwarded and their addresses opened in the container's
//!   set before the answer leaves (Docker writes no resolv.conf of its own
//!   when one is mounted);
//! - the address and policy of each sandbox live in
//!   `<data_dir>/egress/<id>.json`, beside its metadata, so a restarted
//!   lifecycle puts every chain back (keeping the addresses resolved so far)
//!   and releases the chains of containers removed while it was down.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bollard::Docker;
use bollard::models::{EndpointIpamConfig, EndpointSettings, Mount, MountType, NetworkingConfig};
use sandbolt_node::network::Ipv4Net;
use sandbolt_node::network::dns::{DnsProxy, SandboxDirectory, upstreams_from_resolv_conf};
use sandbolt_node::network::nft::{self, SandboxRules, Table};
use sandbolt_proto::egress::{Action, NetworkPolicy};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::docker_network::{NETWORK_NAME, SandboxNetwork};
use crate::error::{ApiError, ApiResult, StartError};

/// How often the addresses of denied names are resolved again (the agent's
/// period too).
const DENY_REFRESH: Duration = Duration::from_secs(60);
/// How long a restarted lifecycle waits for the previous one's DNS sockets
/// on the gateway to close.
const REBIND_PATIENCE: Duration = Duration::from_secs(5);

/// What is kept per sandbox in `<data_dir>/egress/<id>.json`.
#[derive(Debug, Serialize, Deserialize)]
struct EgressFile {
    ip: Ipv4Addr,
    /// The policy's JSON (`""` = allow-all).
    policy: String,
}

/// One sandbox under enforcement.
#[derive(Debug, Clone)]
struct Entry {
    ip: Ipv4Addr,
    policy: Arc<NetworkPolicy>,
}

/// The sandboxes under enforcement, by id and by address (what the DNS
/// proxy asks).
#[derive(Default)]
struct Entries {
    by_id: HashMap<String, Entry>,
    by_ip: HashMap<Ipv4Addr, String>,
}

/// What the DNS proxy and the lifecycle share.
struct Shared {
    table: Table,
    entries: Mutex<Entries>,
}

/// Egress enforcement of one Docker backend.
pub struct DockerEgress {
    shared: Arc<Shared>,
    subnet: Ipv4Net,
    gateway: Ipv4Addr,
    dir: PathBuf,
    resolv_conf: PathBuf,
    dns: Arc<DnsProxy>,
    /// Held from choosing an address until it is recorded, so two creates
    /// never pick the same one.
    alloc: tokio::sync::Mutex<()>,
    stop: watch::Sender<bool>,
}

/// The nft identifier of sandbox `id` (ids may hold characters nft names
/// may not, and are long): a prefix of its SHA-256.
pub fn member_id(id: &str) -> String {
    let digest = Sha256::digest(id.as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

fn start_error(what: impl std::fmt::Display) -> StartError {
    StartError::Backend(format!("docker egress policy: {what}"))
}

fn nft_error(e: nft::NftError) -> ApiError {
    ApiError::internal(format!("installing the sandbox's egress rules: {e}"))
}

impl DockerEgress {
    /// Puts back the chains of the sandboxes recorded under `data_dir`
    /// whose containers still exist (dropping the others), and starts the
    /// DNS proxy on the network's gateway. `upstreams` empty: the host's
    /// resolvers (`/etc/resolv.conf`).
    pub async fn start(
        docker: &Docker,
        network: &SandboxNetwork,
        data_dir: &Path,
        upstreams: &[SocketAddr],
    ) -> Result<Self, StartError> {
        let subnet: Ipv4Net = network.subnet.parse().map_err(start_error)?;
        let gateway: Ipv4Addr = match &network.gateway {
            Some(g) => g
                .parse()
                .map_err(|_| start_error(format!("gateway {g:?}")))?,
            None => return Err(start_error("the sandbox network has no IPv4 gateway")),
        };
        let upstreams = if upstreams.is_empty() {
            let text = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
            upstreams_from_resolv_conf(&text)
        } else {
            upstreams.to_vec()
        };
        if upstreams.is_empty() {
            return Err(start_error(
                "no DNS upstream: /etc/resolv.conf names no nameserver; pass --docker-dns-upstream",
            ));
        }
        let dir = data_dir.join("egress");
        let resolv_conf = dir.join("resolv.conf");
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(&resolv_conf, format!("nameserver {gateway}\n")))
            .map_err(|e| start_error(format!("{}: {e}", dir.display())))?;
        let table_name = crate::docker_network::table_name(&network.bridge);
        let shared = Arc::new(Shared {
            table: Table::named(table_name, subnet, gateway, Vec::new()),
            entries: Mutex::new(Entries::default()),
        });
        let existing = sandbox_containers(docker).await?;
        restore(&shared, &dir, &existing)?;
        let dns = Arc::new(bind_proxy(gateway, upstreams, Arc::clone(&shared) as _).await?);
        let (stop, stopped) = watch::channel(false);
        let egress = Self {
            shared,
            subnet,
            gateway,
            dir,
            resolv_conf,
            dns,
            alloc: tokio::sync::Mutex::new(()),
            stop,
        };
        tokio::spawn(deny_refresher(
            Arc::clone(&egress.shared),
            Arc::clone(&egress.dns),
            stopped,
        ));
        let ids: Vec<String> = egress.shared.entries().by_id.keys().cloned().collect();
        for id in ids {
            egress.spawn_deny_resolution(&id);
        }
        tracing::info!(%gateway, %subnet, "docker egress policy enforcement ready");
        Ok(egress)
    }

    /// The read-only mount of the resolv.conf that names the DNS proxy.
    pub fn resolv_conf_mount(&self) -> Mount {
        Mount {
            target: Some("/etc/resolv.conf".into()),
            source: Some(self.resolv_conf.to_string_lossy().into_owned()),
            typ: Some(MountType::BIND),
            read_only: Some(true),
            ..Default::default()
        }
    }

    /// The container's endpoint on the sandbox network, at `ip`.
    pub fn networking_config(ip: Ipv4Addr) -> NetworkingConfig {
        let endpoint = EndpointSettings {
            ipam_config: Some(EndpointIpamConfig {
                ipv4_address: Some(ip.to_string()),
                ..Default::default()
            }),
            ..Default::default()
        };
        NetworkingConfig {
            endpoints_config: Some(HashMap::from([(NETWORK_NAME.to_string(), endpoint)])),
        }
    }

    /// Chooses sandbox `id`'s address, records it with `policy` and
    /// installs its chain: from here on, traffic from that address obeys
    /// the policy. Undone by [`Self::release`].
    pub async fn reserve(
        &self,
        docker: &Docker,
        id: &str,
        policy: &NetworkPolicy,
    ) -> ApiResult<Ipv4Addr> {
        let _held = self.alloc.lock().await;
        let mut used = engine_addresses(docker).await?;
        used.extend(self.shared.entries().by_ip.keys().copied());
        let ip = self.free_address(&used).ok_or_else(|| {
            ApiError::unavailable(format!(
                "the sandbox network {} has no free address",
                self.subnet
            ))
        })?;
        let entry = Entry {
            ip,
            policy: Arc::new(policy.clone()),
        };
        self.persist(id, &entry)?;
        let script = self.attach_script(id, &entry, true);
        let applied = tokio::task::spawn_blocking(move || nft::apply(&script))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?;
        if let Err(e) = applied {
            let _ = std::fs::remove_file(self.file(id));
            return Err(nft_error(e));
        }
        self.shared.insert(id, entry);
        self.spawn_deny_resolution(id);
        Ok(ip)
    }

    /// Removes sandbox `id`'s chain, sets, dispatch entry and record (a
    /// sandbox without one is fine). Synchronous: when a delete answers,
    /// nothing of the sandbox is left.
    pub fn release(&self, id: &str) {
        let entry = self.shared.remove(id);
        let ip = entry.map(|e| e.ip).or_else(|| self.read(id).map(|f| f.ip));
        if let Some(ip) = ip {
            let script = release_script(&self.shared.table, id, ip);
            if let Err(e) = nft::apply(&script) {
                tracing::warn!(sandbox_id = id, error = %e, "removing the egress rules");
            }
        }
        let file = self.file(id);
        if let Err(e) = std::fs::remove_file(&file)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %file.display(), error = %e, "cannot remove egress record");
        }
    }

    /// The policy of sandbox `id`, if it is under enforcement.
    pub fn policy(&self, id: &str) -> Option<NetworkPolicy> {
        let entries = self.shared.entries();
        entries.by_id.get(id).map(|e| (*e.policy).clone())
    }

    /// Replaces the policy of a sandbox under enforcement; the running
    /// container obeys it once this returns. `None`: not under enforcement.
    pub async fn replace(&self, id: &str, policy: NetworkPolicy) -> ApiResult<Option<()>> {
        let Some(current) = self.shared.entries().by_id.get(id).cloned() else {
            return Ok(None);
        };
        let entry = Entry {
            ip: current.ip,
            policy: Arc::new(policy),
        };
        self.persist(id, &entry)?;
        // The sets are emptied: an address a name opened under the old
        // policy must not outlive it.
        let script = self.attach_script(id, &entry, true);
        let applied = tokio::task::spawn_blocking(move || nft::apply(&script))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?;
        if let Err(e) = applied {
            // Keep the record in step with the rules in force.
            self.persist(id, &current)?;
            return Err(nft_error(e));
        }
        self.shared.insert(id, entry);
        self.spawn_deny_resolution(id);
        Ok(Some(()))
    }

    fn free_address(&self, used: &HashSet<Ipv4Addr>) -> Option<Ipv4Addr> {
        let last = u32::try_from(self.subnet.size().saturating_sub(1)).unwrap_or(u32::MAX);
        (2..last)
            .map(|n| self.subnet.nth(n))
            .find(|ip| *ip != self.gateway && !used.contains(ip))
    }

    fn attach_script(&self, id: &str, entry: &Entry, flush_sets: bool) -> String {
        attach_script(&self.shared.table, id, entry, flush_sets)
    }

    fn file(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    fn read(&self, id: &str) -> Option<EgressFile> {
        crate::docker::read_json(&self.file(id))
    }

    fn persist(&self, id: &str, entry: &Entry) -> ApiResult<()> {
        let file = EgressFile {
            ip: entry.ip,
            policy: entry.policy.to_json(),
        };
        crate::docker::write_json(&self.file(id), &file)
    }

    /// Resolves the denied names of the sandbox's policy (under
    /// `defaultAction: allow`) into its `d_` set, in the background.
    fn spawn_deny_resolution(&self, id: &str) {
        let shared = Arc::clone(&self.shared);
        let dns = Arc::clone(&self.dns);
        let id = id.to_string();
        tokio::spawn(async move { resolve_denied(&shared, &dns, &id).await });
    }
}

impl Drop for DockerEgress {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

impl Shared {
    fn entries(&self) -> MutexGuard<'_, Entries> {
        self.entries.lock().expect("egress entries lock")
    }

    fn insert(&self, id: &str, entry: Entry) {
        let mut entries = self.entries();
        entries.by_ip.insert(entry.ip, id.to_string());
        entries.by_id.insert(id.to_string(), entry);
    }

    fn remove(&self, id: &str) -> Option<Entry> {
        let mut entries = self.entries();
        let entry = entries.by_id.remove(id)?;
        entries.by_ip.remove(&entry.ip);
        Some(entry)
    }
}

fn attach_script(table: &Table, id: &str, entry: &Entry, flush_sets: bool) -> String {
    let m = member_id(id);
    let rules = SandboxRules {
        member_id: &m,
        ip: entry.ip,
        veth: "",
        policy: &entry.policy,
    };
    let mut s = table.sandbox_chain(&rules, flush_sets);
    // The dispatch entry last: the chain is complete when traffic reaches it.
    s.push_str(&format!(
        "add element inet {t} dispatch {{ {ip} : jump sb_{m} }}\n",
        t = table.name,
        ip = entry.ip
    ));
    s
}

fn release_script(table: &Table, id: &str, ip: Ipv4Addr) -> String {
    let t = &table.name;
    let m = member_id(id);
    // Everything is declared first, so that a sandbox whose rules were
    // never (or only partly) installed releases without nft failing on
    // what is missing: one transaction either way.
    let mut s = format!(
        "add set inet {t} a_{m} {{ type ipv4_addr; flags timeout; }}\n\
         add set inet {t} d_{m} {{ type ipv4_addr; flags timeout; }}\n\
         add chain inet {t} sb_{m}\n\
         add element inet {t} dispatch {{ {ip} : jump sb_{m} }}\n\
         delete element inet {t} dispatch {{ {ip} }}\n"
    );
    s.push_str(&table.remove_sandbox_chain(&m));
    s
}

/// Loads the records; those of containers that are gone are released, the
/// others' chains are declared again keeping their resolved addresses.
fn restore(shared: &Shared, dir: &Path, existing: &HashSet<String>) -> Result<(), StartError> {
    let listing =
        std::fs::read_dir(dir).map_err(|e| start_error(format!("{}: {e}", dir.display())))?;
    let mut script = String::new();
    for item in listing.flatten() {
        let path = item.path();
        let Some(id) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".json"))
        else {
            continue;
        };
        let Some(file) = crate::docker::read_json::<EgressFile>(&path) else {
            tracing::warn!(path = %path.display(), "unreadable egress record ignored");
            continue;
        };
        if !existing.contains(id) {
            script.push_str(&release_script(&shared.table, id, file.ip));
            let _ = std::fs::remove_file(&path);
            tracing::info!(
                sandbox_id = id,
                "egress rules of a removed container released"
            );
            continue;
        }
        let policy = NetworkPolicy::parse(&file.policy)
            .map_err(|e| start_error(format!("{}: {e}", path.display())))?;
        let entry = Entry {
            ip: file.ip,
            policy: Arc::new(policy),
        };
        script.push_str(&attach_script(&shared.table, id, &entry, false));
        shared.insert(id, entry);
    }
    if !script.is_empty() {
        nft::apply(&script).map_err(start_error)?;
    }
    Ok(())
}

/// Ids of every sandbox container on the engine (running or not).
async fn sandbox_containers(docker: &Docker) -> Result<HashSet<String>, StartError> {
    let opts = bollard::query_parameters::ListContainersOptions {
        all: true,
        filters: Some(HashMap::from([(
            "label".to_string(),
            vec![crate::docker::LABEL_ID.to_string()],
        )])),
        ..Default::default()
    };
    let all = docker
        .list_containers(Some(opts))
        .await
        .map_err(|e| start_error(format!("listing containers: {e}")))?;
    Ok(all
        .into_iter()
        .filter_map(|c| c.labels?.remove(crate::docker::LABEL_ID))
        .collect())
}

/// Addresses the engine has given out on the sandbox network.
async fn engine_addresses(docker: &Docker) -> ApiResult<HashSet<Ipv4Addr>> {
    let n = docker
        .inspect_network(NETWORK_NAME, None)
        .await
        .map_err(|e| ApiError::internal(format!("inspecting network {NETWORK_NAME}: {e}")))?;
    Ok(n.containers
        .unwrap_or_default()
        .values()
        .filter_map(|c| c.ipv4_address.as_deref()?.split('/').next()?.parse().ok())
        .collect())
}

/// The proxy on the gateway's port 53; a lifecycle restarted in the same
/// process may find the previous one's sockets still closing.
async fn bind_proxy(
    gateway: Ipv4Addr,
    upstreams: Vec<SocketAddr>,
    dir: Arc<dyn SandboxDirectory>,
) -> Result<DnsProxy, StartError> {
    let listen = SocketAddrV4::new(gateway, 53);
    let deadline = tokio::time::Instant::now() + REBIND_PATIENCE;
    loop {
        match DnsProxy::start(listen, upstreams.clone(), Arc::clone(&dir)) {
            Ok(p) => return Ok(p),
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && tokio::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(start_error(format!("DNS proxy on {listen}: {e}"))),
        }
    }
}

/// Exact-name denies matter for direct connections only under a default
/// of allow (under deny, an unresolved address is closed anyway).
fn needs_deny_resolution(policy: &NetworkPolicy) -> bool {
    policy.effective_default() == Action::Allow && policy.denied_names().next().is_some()
}

async fn resolve_denied(shared: &Shared, dns: &DnsProxy, id: &str) {
    let Some(entry) = shared.entries().by_id.get(id).cloned() else {
        return;
    };
    if !needs_deny_resolution(&entry.policy) {
        return;
    }
    let mut addrs = Vec::new();
    for name in entry.policy.denied_names() {
        match dns.resolve_a(name).await {
            Ok(found) => addrs.extend(found.into_iter().map(|(a, _)| a)),
            Err(e) => tracing::warn!(sandbox_id = id, name, error = %e, "resolving a denied name"),
        }
    }
    addrs.sort();
    addrs.dedup();
    // The policy may have changed or the sandbox gone meanwhile.
    let current = shared.entries().by_id.get(id).map(|e| e.policy.clone());
    if !current.is_some_and(|p| Arc::ptr_eq(&p, &entry.policy)) {
        return;
    }
    let script = shared.table.set_denied(&member_id(id), &addrs);
    match tokio::task::spawn_blocking(move || nft::apply(&script)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(sandbox_id = id, error = %e, "updating the denied addresses"),
        Err(e) => tracing::warn!(sandbox_id = id, error = %e, "updating the denied addresses"),
    }
}

async fn deny_refresher(shared: Arc<Shared>, dns: Arc<DnsProxy>, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            () = tokio::time::sleep(DENY_REFRESH) => {}
        }
        let ids: Vec<String> = shared
            .entries()
            .by_id
            .iter()
            .filter(|(_, e)| needs_deny_resolution(&e.policy))
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            resolve_denied(&shared, &dns, &id).await;
        }
    }
}

impl SandboxDirectory for Shared {
    fn policy_for(&self, source: Ipv4Addr) -> Option<Arc<NetworkPolicy>> {
        let entries = self.entries();
        let id = entries.by_ip.get(&source)?;
        entries.by_id.get(id).map(|e| e.policy.clone())
    }

    fn allow_resolved(
        &self,
        source: Ipv4Addr,
        addrs: Vec<Ipv4Addr>,
        ttl: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + '_>> {
        Box::pin(async move {
            if addrs.is_empty() {
                return Ok(());
            }
            let id = self
                .entries()
                .by_ip
                .get(&source)
                .cloned()
                .ok_or_else(|| format!("{source} is not a sandbox under enforcement"))?;
            let script = self.table.allow_resolved(&member_id(&id), &addrs, ttl);
            tokio::task::spawn_blocking(move || nft::apply(&script))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Table {
        Table::named(
            "sandbolt_docker_sbd01234567".into(),
            "10.214.3.0/24".parse().unwrap(),
            Ipv4Addr::new(10, 214, 3, 1),
            Vec::new(),
        )
    }

    #[test]
    fn member_ids_are_short_hex_and_differ_per_sandbox() {
        let m = member_id("0f3c-sandbox");
        assert_eq!(m.len(), 16);
        assert!(m.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(m, member_id("0f3c-sandboy"));
    }

    #[test]
    fn attach_dispatches_by_source_address_after_the_chain() {
        let policy = NetworkPolicy::parse(
            r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"a.test"}]}"#,
        )
        .unwrap();
        let entry = Entry {
            ip: Ipv4Addr::new(10, 214, 3, 7),
            policy: Arc::new(policy),
        };
        let m = member_id("s1");
        let s = attach_script(&table(), "s1", &entry, true);
        let dispatch = format!("dispatch {{ 10.214.3.7 : jump sb_{m} }}");
        assert!(s.contains(&dispatch), "{s}");
        assert!(
            s.find(&format!(
                "add rule inet sandbolt_docker_sbd01234567 sb_{m} drop"
            ))
            .unwrap()
                < s.find(&dispatch).unwrap()
        );
        assert!(s.contains(&format!("flush set inet sandbolt_docker_sbd01234567 a_{m}")));
        assert!(!attach_script(&table(), "s1", &entry, false).contains("flush set"));
        let r = release_script(&table(), "s1", entry.ip);
        assert!(
            r.contains("delete element inet sandbolt_docker_sbd01234567 dispatch { 10.214.3.7 }")
        );
        assert!(r.contains(&format!(
            "delete chain inet sandbolt_docker_sbd01234567 sb_{m}"
        )));
        assert!(r.contains(&format!(
            "delete set inet sandbolt_docker_sbd01234567 d_{m}"
        )));
    }
}
