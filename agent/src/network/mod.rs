//! Sandbox networking on the containerd backend: every sandbox gets its own
//! network namespace with a routed veth (CNI `ptp` + `host-local` from
//! Debian's containernetworking-plugins), an address from the agent's
//! subnet, masquerade to the node's uplink, the agent's DNS proxy as its
//! only resolver, and an nftables chain that enforces isolation and the
//! sandbox's egress policy.
//!
//! Namespaces are prepared ahead ([`pool`]): a create takes a ready one and
//! pays only for its nftables chain (one `nft` transaction, run while the
//! image resolves).
//!
//! Everything the agent makes on the host is recorded under
//! `<state_dir>/network/` ([`state`]) so that a restarted agent takes it
//! back ([`Network::start`] recovers) and [`purge`] removes it all.

pub mod cni;
/// Moved to `sandbolt-node`, shared with the lifecycle's Docker backend.
pub use sandbolt_node::network::dns;
pub mod forward;
pub mod namespace;
/// Moved to `sandbolt-node`, shared with the lifecycle's Docker backend.
pub use sandbolt_node::network::nft;
mod pool;
pub mod state;
pub mod subnet;

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use sandbolt_proto::egress::{Action, NetworkPolicy};
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;

use crate::config::NetworkConfig;
use cni::Cni;
use dns::{DnsProxy, SandboxDirectory};
use nft::{SandboxRules, Table};
use state::{Dirs, Member};
use subnet::Claim;

/// How often the addresses of denied names are resolved again.
const DENY_REFRESH: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("network subnet: {0}")]
    Subnet(String),
    #[error(transparent)]
    Cni(#[from] cni::CniError),
    #[error(transparent)]
    Nft(#[from] nft::NftError),
    /// The host lacks what `--network egress` needs.
    #[error(
        "sandbox networking needs {0}: apt-get install nftables containernetworking-plugins, or run with --network none"
    )]
    MissingTools(String),
    #[error("sandbox {0} has no network attachment")]
    NotAttached(String),
    #[error("DNS proxy on {listen}: {reason}")]
    Dns {
        listen: SocketAddrV4,
        reason: String,
    },
    #[error("{0}")]
    Other(String),
}

impl NetworkError {
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> NetworkError {
        let path = path.into();
        move |source| NetworkError::Io { path, source }
    }
}

pub type Result<T, E = NetworkError> = std::result::Result<T, E>;

/// What a sandbox's OCI spec needs from its network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub member_id: String,
    /// `linux.namespaces[network].path`.
    pub netns_path: PathBuf,
    pub ip: Ipv4Addr,
    /// Bound read-only at `/etc/resolv.conf` (names the DNS proxy).
    pub resolv_conf: PathBuf,
}

/// Checks that `nft` and the CNI plugins are installed; the error says
/// what to install.
pub fn preflight(cni_bin_dir: &Path) -> Result<()> {
    let mut missing = Vec::new();
    let nft_found = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain(["/usr/sbin".into(), "/sbin".into()])
        .any(|d| d.join("nft").is_file());
    if !nft_found {
        missing.push("the nft command (package nftables)".to_string());
    }
    let absent: Vec<&str> = cni::PLUGINS
        .into_iter()
        .filter(|p| !cni_bin_dir.join(p).is_file())
        .collect();
    if !absent.is_empty() {
        missing.push(format!(
            "the CNI plugins {} in {} (package containernetworking-plugins)",
            absent.join(", "),
            cni_bin_dir.display()
        ));
    }
    if missing.is_empty() {
        Ok(())
    } else {
        Err(NetworkError::MissingTools(missing.join(" and ")))
    }
}

/// A member as the agent holds it.
#[derive(Debug, Clone)]
struct Live {
    member: Member,
    policy: Arc<NetworkPolicy>,
}

impl Live {
    fn ip(&self) -> Ipv4Addr {
        self.member.ip.expect("live members have an address")
    }

    fn veth(&self) -> &str {
        self.member
            .host_veth
            .as_deref()
            .expect("live members have a veth")
    }

    fn rules(&self) -> SandboxRules<'_> {
        SandboxRules {
            member_id: &self.member.member_id,
            ip: self.ip(),
            veth: self.veth(),
            policy: &self.policy,
        }
    }
}

#[derive(Debug, Default)]
struct Members {
    all: HashMap<String, Live>,
    pool: VecDeque<String>,
    by_sandbox: HashMap<String, String>,
    by_ip: HashMap<Ipv4Addr, String>,
}

impl Members {
    fn insert(&mut self, live: Live) {
        let id = live.member.member_id.clone();
        match &live.member.sandbox_id {
            Some(sb) => {
                self.by_sandbox.insert(sb.clone(), id.clone());
            }
            None => self.pool.push_back(id.clone()),
        }
        self.by_ip.insert(live.ip(), id.clone());
        self.all.insert(id, live);
    }

    fn remove(&mut self, member_id: &str) -> Option<Live> {
        let live = self.all.remove(member_id)?;
        self.by_ip.remove(&live.ip());
        if let Some(sb) = &live.member.sandbox_id {
            self.by_sandbox.remove(sb);
        }
        self.pool.retain(|m| m != member_id);
        Some(live)
    }

    fn of_sandbox(&self, sandbox_id: &str) -> Option<&Live> {
        self.all.get(self.by_sandbox.get(sandbox_id)?)
    }
}

/// What the DNS proxy and the background tasks share with [`Network`].
struct Shared {
    dirs: Dirs,
    cni: Cni,
    table: Table,
    gateway: Ipv4Addr,
    pool_size: usize,
    members: Mutex<Members>,
    /// Pool members being prepared right now (counted against `pool_size`).
    preparing: Mutex<usize>,
    refill: Notify,
}

/// The agent's sandbox networking. Cheap to clone.
#[derive(Clone)]
pub struct Network {
    shared: Arc<Shared>,
    inner: Arc<Inner>,
}

struct Inner {
    claim: Mutex<Option<Claim>>,
    dns: Mutex<Option<Arc<DnsProxy>>>,
    stop: watch::Sender<bool>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// Runs blocking host work (processes, mounts) off the runtime's workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(NetworkError::Other(format!("network task failed: {e}"))))
}

impl Network {
    /// Claims the subnet, declares the nftables table, takes back what a
    /// previous agent on this state dir left (members of `live_sandboxes`
    /// keep their namespace and rules; the rest is released), starts the
    /// DNS proxy on the gateway and fills the pool in the background.
    #[tracing::instrument(skip_all, fields(state_dir = %state_dir.display()))]
    pub async fn start(
        cfg: &NetworkConfig,
        state_dir: &Path,
        live_sandboxes: &HashSet<String>,
    ) -> Result<Network> {
        preflight(&cfg.cni_bin_dir)?;
        let dirs = Dirs::new(state_dir);
        dirs.create()?;
        enable_forwarding()?;
        let previous = std::fs::read_to_string(dirs.subnet_file())
            .ok()
            .and_then(|s| s.trim().parse::<subnet::Ipv4Net>().ok());
        let (choice, subnet_file) = (cfg.subnet, dirs.subnet_file());
        let claim =
            blocking(move || subnet::claim(choice, &subnet_file, Path::new(subnet::CLAIMS_DIR)))
                .await?;
        let net = claim.net;
        let gateway = net.nth(1);
        let resolv = dirs.resolv_conf();
        state::write_atomic(&resolv, format!("nameserver {gateway}\n").as_bytes())?;
        let shared = Arc::new(Shared {
            cni: Cni {
                bin_dir: cfg.cni_bin_dir.clone(),
                subnet: net,
                gateway,
                ipam_dir: dirs.ipam(),
            },
            table: Table::new(net, gateway, cfg.allow_cidrs.clone()),
            dirs,
            gateway,
            pool_size: cfg.pool_size,
            members: Mutex::new(Members::default()),
            preparing: Mutex::new(0),
            refill: Notify::new(),
        });
        let (stop, _) = watch::channel(false);
        let network = Network {
            shared,
            inner: Arc::new(Inner {
                claim: Mutex::new(Some(claim)),
                dns: Mutex::new(None),
                stop,
                tasks: Mutex::new(Vec::new()),
            }),
        };
        if let Err(e) = network.bring_up(cfg, live_sandboxes).await {
            network.shutdown().await;
            return Err(e);
        }
        if let Some(old) = previous.filter(|p| *p != net) {
            // The subnet changed: the old one's members were released by
            // recovery (their addresses lie outside the new one).
            tracing::warn!(%old, new = %net, "the sandbox subnet changed; removing the old one's rules");
            let table = nft::table_name(old);
            let lock = Path::new(subnet::CLAIMS_DIR).join(format!("{}.lock", old.slug()));
            // Another agent may hold the old subnet by now: its table then.
            if !subnet::is_held(&lock).unwrap_or(true) {
                forward::remove(&table);
                if nft::table_exists(&table)
                    && let Err(e) = nft::apply(&format!("delete table inet {table}\n"))
                {
                    tracing::warn!(%table, error = %e, "removing the old subnet's table");
                }
            }
        }
        network.allow_forwarding(net);
        tracing::info!(subnet = %net, %gateway, table = %network.shared.table.name, "sandbox networking ready");
        Ok(network)
    }

    /// Keeps a FORWARD policy of DROP (Docker's) from dropping what this
    /// agent's table accepts ([`forward`]).
    fn allow_forwarding(&self, net: subnet::Ipv4Net) {
        let table = &self.shared.table.name;
        match forward::allow(net, table) {
            Ok(forward::Forwarding::Open) => {}
            Ok(forward::Forwarding::Allowed) => tracing::info!(
                subnet = %net,
                "the node's iptables FORWARD policy is DROP: accept rules for the sandbox subnet are at the top of FORWARD (comment {table})"
            ),
            Err(e) => tracing::warn!(
                subnet = %net,
                error = %e,
                "the node's iptables FORWARD policy is DROP and the sandbox subnet could not be accepted: sandboxes will have no egress"
            ),
        }
    }

    async fn bring_up(&self, cfg: &NetworkConfig, live: &HashSet<String>) -> Result<()> {
        let shared = self.shared.clone();
        let live = live.clone();
        let recovered = blocking(move || {
            nft::apply(&shared.table.declare())?;
            Ok(pool::recover(&shared, &live))
        })
        .await?;
        tracing::info!(
            attached = recovered.attached,
            pooled = recovered.pooled,
            released = recovered.released,
            "network state recovered"
        );
        let listen = SocketAddrV4::new(self.shared.gateway, 53);
        let dir: Arc<dyn SandboxDirectory> = self.shared.clone();
        let proxy = DnsProxy::start(listen, cfg.dns_upstreams.clone(), dir).map_err(|e| {
            NetworkError::Dns {
                listen,
                reason: e.to_string(),
            }
        })?;
        *self.inner.dns.lock() = Some(Arc::new(proxy));
        let stop = self.inner.stop.subscribe();
        let mut tasks = self.inner.tasks.lock();
        tasks.push(tokio::spawn(pool::refill(
            self.shared.clone(),
            stop.clone(),
        )));
        tasks.push(tokio::spawn(deny_refresher(self.clone(), stop)));
        Ok(())
    }

    /// Gives sandbox `sandbox_id` a prepared namespace with `policy`
    /// enforced: [`Self::reserve`], then [`Self::apply`].
    pub async fn attach(&self, sandbox_id: &str, policy: NetworkPolicy) -> Result<Attachment> {
        let attachment = self.reserve(sandbox_id, policy).await?;
        self.apply(sandbox_id).await?;
        Ok(attachment)
    }

    /// Takes a prepared namespace for `sandbox_id` (prepares one inline
    /// when the pool is empty) and records `policy` for it. Its traffic
    /// stays dropped until [`Self::apply`] installs its rules; a create
    /// runs that while the container is made, and joins it before the task
    /// starts. On failure the caller calls [`Self::release`].
    #[tracing::instrument(skip_all, fields(sandbox_id))]
    pub async fn reserve(&self, sandbox_id: &str, policy: NetworkPolicy) -> Result<Attachment> {
        let taken = {
            let mut members = self.shared.members.lock();
            let id = members.pool.pop_front();
            id.and_then(|id| members.remove(&id))
        };
        self.shared.refill.notify_one();
        let member = match taken {
            Some(live) => live.member,
            None => {
                tracing::info!(
                    sandbox_id,
                    "network pool empty: preparing a namespace inline"
                );
                let shared = self.shared.clone();
                blocking(move || pool::prepare(&shared)).await?
            }
        };
        let live = Live {
            member: Member {
                sandbox_id: Some(sandbox_id.to_string()),
                policy_json: policy.to_json(),
                ..member
            },
            policy: Arc::new(policy),
        };
        let attachment = self.attachment_of(&live);
        self.shared.members.lock().insert(live.clone());
        let shared = self.shared.clone();
        blocking(move || shared.dirs.save(&live.member)).await?;
        Ok(attachment)
    }

    /// Installs the rules of a reserved sandbox (its chain, sets and
    /// dispatch entry) in one transaction.
    #[tracing::instrument(skip_all, fields(sandbox_id))]
    pub async fn apply(&self, sandbox_id: &str) -> Result<()> {
        let live = self
            .shared
            .members
            .lock()
            .of_sandbox(sandbox_id)
            .cloned()
            .ok_or_else(|| NetworkError::NotAttached(sandbox_id.to_string()))?;
        let denies = needs_deny_resolution(&live.policy);
        let shared = self.shared.clone();
        blocking(move || Ok(nft::apply(&shared.table.attach(&live.rules(), true))?)).await?;
        if denies {
            self.spawn_deny_resolution(sandbox_id);
        }
        Ok(())
    }

    fn attachment_of(&self, live: &Live) -> Attachment {
        Attachment {
            member_id: live.member.member_id.clone(),
            netns_path: live.member.netns_path.clone(),
            ip: live.ip(),
            resolv_conf: self.shared.dirs.resolv_conf(),
        }
    }

    /// The attachment of a sandbox, if it has one.
    pub fn attachment(&self, sandbox_id: &str) -> Option<Attachment> {
        let members = self.shared.members.lock();
        members
            .of_sandbox(sandbox_id)
            .map(|l| self.attachment_of(l))
    }

    /// The sandbox's address, if it has a network.
    pub fn ip_of(&self, sandbox_id: &str) -> Option<Ipv4Addr> {
        self.shared
            .members
            .lock()
            .of_sandbox(sandbox_id)
            .map(Live::ip)
    }

    /// The policy a sandbox runs under.
    pub fn policy_of(&self, sandbox_id: &str) -> Option<Arc<NetworkPolicy>> {
        let members = self.shared.members.lock();
        members.of_sandbox(sandbox_id).map(|l| l.policy.clone())
    }

    /// Replaces the policy of a running sandbox in one transaction: its
    /// chain is rewritten and the addresses resolved under the old policy
    /// are forgotten. Established connections survive.
    #[tracing::instrument(skip_all, fields(sandbox_id))]
    pub async fn update_policy(&self, sandbox_id: &str, policy: NetworkPolicy) -> Result<()> {
        let mut live = self
            .shared
            .members
            .lock()
            .of_sandbox(sandbox_id)
            .cloned()
            .ok_or_else(|| NetworkError::NotAttached(sandbox_id.to_string()))?;
        live.member.policy_json = policy.to_json();
        live.policy = Arc::new(policy);
        let shared = self.shared.clone();
        let applied = live.clone();
        blocking(move || {
            nft::apply(&shared.table.attach(&applied.rules(), true))?;
            shared.dirs.save(&applied.member)
        })
        .await?;
        let denies = needs_deny_resolution(&live.policy);
        let member_id = live.member.member_id.clone();
        if let Some(cur) = self.shared.members.lock().all.get_mut(&member_id) {
            *cur = live;
        }
        if denies {
            self.spawn_deny_resolution(sandbox_id);
        }
        Ok(())
    }

    /// Removes the sandbox's network: rules, veth, address, namespace,
    /// state file. Returns whether it had one. Failures are logged: the
    /// sandbox is gone either way, and a member file that stays behind is
    /// released again by the next recovery or [`purge`].
    #[tracing::instrument(skip_all, fields(sandbox_id))]
    pub async fn release(&self, sandbox_id: &str) -> bool {
        let live = {
            let mut members = self.shared.members.lock();
            let Some(id) = members.by_sandbox.get(sandbox_id).cloned() else {
                return false;
            };
            members.remove(&id)
        };
        let Some(live) = live else { return false };
        let shared = self.shared.clone();
        let _ = blocking(move || {
            pool::release_member(&shared, &live.member);
            Ok(())
        })
        .await;
        true
    }

    /// Stops the DNS proxy and the pool, and releases the pool's members.
    /// Attached sandboxes keep their namespace and rules (a restarted agent
    /// takes them back); when none is attached, the table and the subnet
    /// claim go too, leaving nothing on the host.
    pub async fn shutdown(&self) {
        let _ = self.inner.stop.send(true);
        self.shared.refill.notify_waiters();
        let tasks: Vec<_> = std::mem::take(&mut *self.inner.tasks.lock());
        for t in tasks {
            let _ = t.await;
        }
        let dns = self.inner.dns.lock().take();
        if let Some(dns) = dns {
            match Arc::try_unwrap(dns) {
                Ok(proxy) => proxy.shutdown().await,
                Err(shared) => drop(shared),
            }
        }
        let shared = self.shared.clone();
        let claim = self.inner.claim.lock().take();
        let _ = blocking(move || {
            let pooled: Vec<Live> = {
                let mut members = shared.members.lock();
                let ids: Vec<String> = members.pool.drain(..).collect();
                ids.iter().filter_map(|id| members.remove(id)).collect()
            };
            for live in &pooled {
                pool::release_member(&shared, &live.member);
            }
            if shared.members.lock().all.is_empty() {
                if let Err(e) = nft::apply(&shared.table.delete()) {
                    tracing::warn!(error = %e, "removing the nftables table");
                }
                if let Some(claim) = claim {
                    claim.release();
                }
            }
            Ok(())
        })
        .await;
        tracing::info!("sandbox networking stopped");
    }

    pub fn subnet(&self) -> subnet::Ipv4Net {
        self.shared.cni.subnet
    }

    pub fn gateway(&self) -> Ipv4Addr {
        self.shared.gateway
    }

    /// The agent's nftables table (`inet <name>`).
    pub fn table_name(&self) -> &str {
        &self.shared.table.name
    }

    /// Ids of the pool's prepared members.
    /// The sandboxes that have a namespace of this agent.
    pub fn attached_sandboxes(&self) -> Vec<String> {
        self.shared
            .members
            .lock()
            .by_sandbox
            .keys()
            .cloned()
            .collect()
    }

    pub fn pool_members(&self) -> Vec<String> {
        self.shared.members.lock().pool.iter().cloned().collect()
    }

    /// Resolves the denied names of the sandbox's policy (under
    /// `defaultAction: allow`) into its `d_` set, in the background.
    fn spawn_deny_resolution(&self, sandbox_id: &str) {
        let network = self.clone();
        let sandbox_id = sandbox_id.to_string();
        tokio::spawn(async move { network.resolve_denied(&sandbox_id).await });
    }

    async fn resolve_denied(&self, sandbox_id: &str) {
        let Some(dns) = self.inner.dns.lock().clone() else {
            return;
        };
        let Some(live) = self.shared.members.lock().of_sandbox(sandbox_id).cloned() else {
            return;
        };
        let mut addrs = Vec::new();
        for name in live.policy.denied_names() {
            match dns.resolve_a(name).await {
                Ok(found) => addrs.extend(found.into_iter().map(|(a, _)| a)),
                Err(e) => tracing::warn!(sandbox_id, name, error = %e, "resolving a denied name"),
            }
        }
        addrs.sort();
        addrs.dedup();
        let shared = self.shared.clone();
        let member_id = live.member.member_id.clone();
        let result = blocking(move || {
            // The policy may have changed or the sandbox gone meanwhile.
            let current = shared
                .members
                .lock()
                .all
                .get(&member_id)
                .map(|l| l.policy.clone());
            if current.is_some_and(|p| Arc::ptr_eq(&p, &live.policy)) {
                nft::apply(&shared.table.set_denied(&member_id, &addrs))?;
            }
            Ok(())
        })
        .await;
        if let Err(e) = result {
            tracing::warn!(sandbox_id, error = %e, "updating the denied addresses");
        }
    }
}

/// Exact-name denies matter for direct connections only under a default
/// of allow (under deny, an unresolved address is closed anyway).
fn needs_deny_resolution(policy: &NetworkPolicy) -> bool {
    policy.effective_default() == Action::Allow && policy.denied_names().next().is_some()
}

/// Re-resolves the denied names of every sandbox that has some.
async fn deny_refresher(network: Network, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            () = tokio::time::sleep(DENY_REFRESH) => {}
        }
        let sandboxes: Vec<String> = {
            let members = network.shared.members.lock();
            members
                .all
                .values()
                .filter(|l| needs_deny_resolution(&l.policy))
                .filter_map(|l| l.member.sandbox_id.clone())
                .collect()
        };
        for sb in sandboxes {
            network.resolve_denied(&sb).await;
        }
    }
}

/// Sandboxes reach the uplink through the host's routing.
fn enable_forwarding() -> Result<()> {
    let path = Path::new("/proc/sys/net/ipv4/ip_forward");
    if std::fs::read_to_string(path).is_ok_and(|v| v.trim() == "1") {
        return Ok(());
    }
    std::fs::write(path, "1").map_err(NetworkError::io(path))?;
    tracing::info!("enabled net.ipv4.ip_forward (sandboxes' egress is routed by this host)");
    Ok(())
}

impl SandboxDirectory for Shared {
    fn policy_for(&self, source: Ipv4Addr) -> Option<Arc<NetworkPolicy>> {
        let members = self.members.lock();
        let live = members.all.get(members.by_ip.get(&source)?)?;
        live.member.sandbox_id.as_ref()?;
        Some(live.policy.clone())
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
            let member_id = {
                let members = self.members.lock();
                members
                    .by_ip
                    .get(&source)
                    .filter(|m| {
                        members
                            .all
                            .get(*m)
                            .is_some_and(|l| l.member.sandbox_id.is_some())
                    })
                    .cloned()
                    .ok_or_else(|| format!("{source} is not an attached sandbox"))?
            };
            let script = self.table.allow_resolved(&member_id, &addrs, ttl);
            tokio::task::spawn_blocking(move || nft::apply(&script))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())
        })
    }
}

/// The subnet whose claim has the members' gateway (when the subnet file
/// is gone, e.g. a test's temporary directory was half removed).
fn subnet_of_members(dirs: &Dirs) -> Option<subnet::Ipv4Net> {
    let gateway = dirs.load_all().first()?.gateway;
    subnet::claimed(Path::new(subnet::CLAIMS_DIR))
        .into_iter()
        .find(|n| n.nth(1) == gateway)
}

/// What [`purge`] removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Purged {
    pub namespaces: usize,
    pub table: Option<String>,
    pub subnet: Option<subnet::Ipv4Net>,
}

/// Removes everything an agent with this state dir made on the host: its
/// namespaces (CNI DEL first, so veths and addresses go too), its nftables
/// table, its subnet claim and `<state_dir>/network`. For test beds and
/// uninstall; refused while an agent still holds the subnet.
pub fn purge(state_dir: &Path, cni_bin_dir: &Path) -> Result<Purged> {
    let dirs = Dirs::new(state_dir);
    let mut purged = Purged::default();
    let net = std::fs::read_to_string(dirs.subnet_file())
        .ok()
        .and_then(|s| s.trim().parse::<subnet::Ipv4Net>().ok())
        .or_else(|| subnet_of_members(&dirs));
    if let Some(net) = net {
        let lock = Path::new(subnet::CLAIMS_DIR).join(format!("{}.lock", net.slug()));
        let held = subnet::lock_file(&lock, nix::fcntl::FlockArg::LockExclusiveNonblock)?;
        let Some(held) = held else {
            return Err(NetworkError::Subnet(format!(
                "subnet {net} is held by a running agent: stop it before purging {}",
                state_dir.display()
            )));
        };
        let cni = Cni {
            bin_dir: cni_bin_dir.to_path_buf(),
            subnet: net,
            gateway: net.nth(1),
            ipam_dir: dirs.ipam(),
        };
        purged.namespaces = pool::remove_namespaces(&dirs, Some(&cni));
        let table = nft::table_name(net);
        forward::remove(&table);
        if nft::table_exists(&table) {
            nft::apply(&format!("delete table inet {table}\n"))?;
            purged.table = Some(table);
        }
        let _ = std::fs::remove_file(&lock);
        drop(held);
        purged.subnet = Some(net);
    } else {
        purged.namespaces = pool::remove_namespaces(&dirs, None);
    }
    match std::fs::remove_dir_all(&dirs.root) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(NetworkError::io(&dirs.root)(e));
        }
        _ => {}
    }
    Ok(purged)
}
