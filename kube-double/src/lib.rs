//! An in-process Kubernetes API double for sandbolt's tests.
//!
//! [`ApiDouble::start`] serves plain HTTP on `127.0.0.1:<random port>` and
//! behaves as the Kubernetes API server documents, for the calls sandbolt's
//! kube store, leader election and janitor make. [`ApiDouble::client`] gives
//! a real `kube::Client` pointed at it, so the code under test runs its
//! production client path.
//!
//! # Served kinds
//! `v1` `pods` (status subresource), `coordination.k8s.io/v1` `leases`,
//! `sandbox.fast.io/v1alpha2` `sandboxes`, `sandbolt.io/v1alpha1`
//! `sandboxpools` and `sandboxwarmpools` (custom resources, status
//! subresource) and `sandboxsnapshots` (custom resource, no status
//! subresource) are built in. More custom kinds come from
//! CustomResourceDefinition files ([`ApiDouble::register_crds`],
//! [`ApiDouble::register_crd`]: group, plural, kind, the served storage
//! version, the status subresource) or are named directly
//! ([`ApiDouble::register_kind`], e.g. kinds a client lists that nobody
//! here writes). All namespaced; every namespace implicitly exists.
//!
//! # As a process
//! The `kube-double` binary serves the same on `--listen`, registers
//! `--crds DIR`, writes `--kubeconfig-out` ([`ApiDouble::write_kubeconfig`],
//! read by kube-rs and the Python `kubernetes` client) and prints its URL,
//! for clients in other processes (the OpenSandbox server, a controller
//! binary).
//!
//! # Implemented
//! - Paths `/api/v1/namespaces/{ns}/{plural}[/{name}[/status]]`, the same
//!   under `/apis/{group}/{version}`, and cluster-wide list/watch
//!   `/api/v1/{plural}`, `/apis/{g}/{v}/{plural}`; discovery (`/api`,
//!   `/apis`, `/api/v1`, `/apis/{g}/{v}`) and `/version`.
//! - One global resourceVersion counter bumped by every write; lists carry it.
//! - create: generateName, DNS-1123 subdomain names, label syntax, 409
//!   AlreadyExists (also while the old object is terminating), namespace
//!   must match the URL, server-set uid/creationTimestamp/generation, status
//!   dropped for kinds with a status subresource (pods start `Pending`).
//! - get, list with labelSelector (`=`, `==`, `!=`, `in`, `notin`, exists,
//!   `!`, `>`, `<`), fieldSelector (`metadata.name`, `metadata.namespace`,
//!   and the pod field labels such as `spec.nodeName`, `status.phase`),
//!   `limit`/`continue` served from the first page's snapshot (410 once
//!   compacted), `remainingItemCount`, `resourceVersionMatch=Exact`.
//! - update (PUT): resourceVersion precondition (409 Conflict); custom
//!   resources require a resourceVersion (422), built-ins allow
//!   unconditional updates; uid mismatch is a 409; server-owned metadata is
//!   kept; the status subresource split both ways; generation bumps only
//!   when something outside metadata/status changes; no-op writes do not
//!   bump the resourceVersion.
//! - patch: JSON Patch (a failed `test` is 422), JSON Merge Patch, strategic
//!   merge patch *as a merge patch* for built-in kinds (415 for custom
//!   resources, as the real server does), apply patch is 415.
//! - delete: preconditions (uid, resourceVersion), finalizers
//!   (deletionTimestamp, then removal once an update empties them), no new
//!   finalizers on a terminating object; deletecollection (answers with the
//!   deleted objects). An immediate delete answers with the object for pods
//!   and with a `Status` of `Success` for leases and custom resources (the
//!   registries' `ReturnDeletedObject`); a terminating one with the object.
//! - watch: synthetic ADDED for `resourceVersion` unset/"0", replay from a
//!   resourceVersion, 410 Expired as an ERROR event for compacted versions,
//!   `sendInitialEvents` with the `k8s.io/initial-events-end` bookmark,
//!   periodic bookmarks (every [`BOOKMARK_INTERVAL`]), `timeoutSeconds`,
//!   selectors.
//! - Boolean query parameters (`watch`, `allowWatchBookmarks`,
//!   `sendInitialEvents`) decoded as the API server does: only absent,
//!   "0" and "false" (any case) are false.
//! - `meta/v1 Status` error bodies; bearer-token authentication (401).
//! - Test controls: fault injection, closing watches, outage, request
//!   counters, compaction.
//!
//! # Not implemented
//! Server-side apply, dryRun, field managers/managedFields, strategic merge
//! directives (`$patch`, list merge keys: a strategic patch of
//! `metadata.finalizers` replaces the list), garbage collection (so
//! `propagationPolicy` is ignored and owner references cascade nothing),
//! graceful pod deletion (pods go at once, as unscheduled pods do), pod
//! spec validation, namespaces as objects, RBAC, admission, protobuf, TLS,
//! HTTP/2, objects that stop matching a watch's selector being sent as
//! DELETED, CRDs as API objects (`customresourcedefinitions` is not
//! served; register them through the API above), cluster-scoped custom
//! kinds, several served versions of one kind (conversion), and CRD schema
//! validation or pruning.

mod crd;
mod http;
mod kinds;
mod kubeconfig;
mod patch;
mod selectors;
mod server;
mod status;
mod store;
mod validation;
mod watch;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use crd::CrdError;
pub use kinds::{CustomKind, KindError};
pub use watch::BOOKMARK_INTERVAL;

use server::Shared;

/// A running API double. Dropping it stops the server.
pub struct ApiDouble {
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
}

impl ApiDouble {
    /// Binds 127.0.0.1:0 (plain HTTP) with a random token, registers the
    /// built-in kinds and serves until shutdown.
    pub async fn start() -> ApiDouble {
        ApiDouble::start_with(StartOptions::default())
            .await
            .expect("bind 127.0.0.1:0 for the kube API double")
    }

    /// As [`ApiDouble::start`], on `options.listen` and with
    /// `options.token` when given.
    pub async fn start_with(options: StartOptions) -> std::io::Result<ApiDouble> {
        let listener = TcpListener::bind(options.listen).await?;
        let addr = listener.local_addr()?;
        let token = options
            .token
            .unwrap_or_else(|| format!("double-{}", uuid::Uuid::new_v4().simple()));
        let shared = Arc::new(Shared::new(token));
        let (stop, stopped) = oneshot::channel();
        let server = tokio::spawn(server::serve(listener, shared.clone(), stopped));
        Ok(ApiDouble {
            shared,
            addr,
            stop: Some(stop),
            server: Some(server),
        })
    }

    /// Serves `kind` from now on (e.g. a kind the code under test lists
    /// but nobody writes, such as `sandbox.opensandbox.io/v1alpha1`
    /// `batchsandboxes`). Registering the group and plural of a custom kind
    /// again replaces its definition and keeps its objects, as updating a
    /// CRD does.
    pub fn register_kind(&self, kind: &CustomKind) -> Result<(), KindError> {
        let served = kinds::Kind::from_custom(kind)?;
        self.shared.store.lock().register(served)?;
        Ok(())
    }

    /// Serves the kinds of the `apiextensions.k8s.io/v1`
    /// CustomResourceDefinitions in `yaml` (one or more documents): group,
    /// plural, kind, the storage version and its status subresource.
    /// Namespaced CRDs with one served version only. Returns the kinds.
    pub fn register_crd(&self, yaml: &str) -> Result<Vec<CustomKind>, CrdError> {
        self.register_crd_from(yaml, "CRD text")
    }

    /// [`ApiDouble::register_crd`] for every `.yaml` / `.yml` file of `dir`
    /// (e.g. `deploy/crds`), in name order; at least one CRD must be there.
    pub fn register_crds(&self, dir: &Path) -> Result<Vec<CustomKind>, CrdError> {
        let mut kinds = Vec::new();
        for path in crd::files(dir)? {
            let yaml = std::fs::read_to_string(&path).map_err(|source| CrdError::Read {
                path: path.clone(),
                source,
            })?;
            kinds.extend(self.register_crd_from(&yaml, &path.display().to_string())?);
        }
        if kinds.is_empty() {
            return Err(CrdError::NoCrds {
                dir: dir.to_path_buf(),
            });
        }
        Ok(kinds)
    }

    /// Parses every document before registering any, so a bad file
    /// registers nothing.
    fn register_crd_from(&self, yaml: &str, origin: &str) -> Result<Vec<CustomKind>, CrdError> {
        let kinds = crd::parse(yaml, origin)?;
        for kind in &kinds {
            self.register_kind(kind).map_err(|source| CrdError::Kind {
                name: format!("{}.{}", kind.plural, kind.group),
                source,
            })?;
        }
        Ok(kinds)
    }

    /// Writes a kubeconfig for the double to `path` (mode 0600, replaced
    /// atomically): one cluster with [`ApiDouble::url`] as its server, one
    /// user with the bearer token, one context (namespace "default")
    /// selected as current-context. kube-rs (`KUBECONFIG`) and the Python
    /// `kubernetes` client (`config.load_kube_config`) both read it.
    pub fn write_kubeconfig(&self, path: &Path) -> std::io::Result<()> {
        kubeconfig::write(path, &self.url(), self.token())
    }

    /// A `kube::Client` for the double, authenticating with its token and
    /// with kube's default configuration otherwise (retries of 429/503/504
    /// included), default namespace "default".
    pub fn client(&self) -> kube::Client {
        kube::Client::try_from(self.config()).expect("a kube client for the double")
    }

    /// The `kube::Config` behind [`ApiDouble::client`], for tests that need
    /// to adjust it (e.g. `default_retry = false` to see raw 503s).
    pub fn config(&self) -> kube::Config {
        let url = self.url().parse().expect("the double's URL is a valid URI");
        let mut config = kube::Config::new(url);
        // AuthInfo wants a secrecy::SecretString; going through its serde
        // form spares a direct dependency on that crate.
        config.auth_info = serde_json::from_value(serde_json::json!({"token": self.token()}))
            .expect("an AuthInfo with a token");
        config
    }

    /// `http://127.0.0.1:PORT`: the bound address, or loopback when the
    /// double listens on all addresses (0.0.0.0 / ::), which is no address
    /// to connect to.
    pub fn url(&self) -> String {
        let mut addr = self.addr;
        match addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => addr.set_ip(Ipv4Addr::LOCALHOST.into()),
            IpAddr::V6(ip) if ip.is_unspecified() => addr.set_ip(Ipv6Addr::LOCALHOST.into()),
            _ => {}
        }
        format!("http://{addr}")
    }

    /// The address the double is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The bearer token every request must carry.
    pub fn token(&self) -> &str {
        &self.shared.token
    }

    /// The next `count` requests whose verb ("get", "list", "watch",
    /// "create", "update", "patch", "delete", "deletecollection"; "*" = any)
    /// and resource (e.g. "leases"; "sandboxes" also covers
    /// "sandboxes/status"; "*" = any) match fail with `code` and a Status
    /// body whose reason follows the code. Rules are consumed oldest first.
    pub fn fail_next(&self, verb: &str, plural: &str, code: u16, count: usize) {
        self.shared.add_fault(verb, plural, code, count);
    }

    /// Ends every open watch stream now; clients must watch again.
    pub fn close_watches(&self) {
        self.shared.store.lock().close_watches();
    }

    /// While unavailable every request gets 503 ServiceUnavailable, and
    /// open watches are closed when the outage starts.
    pub fn set_unavailable(&self, unavailable: bool) {
        self.shared.set_unavailable(unavailable);
    }

    /// Requests received per verb and resource, whatever their outcome
    /// (injected faults and outage 503s included). Matching as for
    /// [`ApiDouble::fail_next`], so `requests("update", "sandboxes")`
    /// counts status updates too.
    pub fn requests(&self, verb: &str, plural: &str) -> usize {
        self.shared.requests(verb, plural)
    }

    /// Forgets the watch history up to the current resourceVersion, as etcd
    /// compaction does: a watch from an older version then gets 410 Gone.
    pub fn compact(&self) {
        self.shared.store.lock().compact();
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.store.lock().resource_version()
    }

    /// Stops serving and waits for the server task; open connections and
    /// watches are cut.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
    }
}

/// Where and how [`ApiDouble::start_with`] serves.
#[derive(Debug, Clone)]
pub struct StartOptions {
    /// Default `127.0.0.1:0` (a free port).
    pub listen: SocketAddr,
    /// The bearer token clients must send; default a random one.
    pub token: Option<String>,
}

impl Default for StartOptions {
    fn default() -> Self {
        StartOptions {
            listen: SocketAddr::from((Ipv4Addr::LOCALHOST, 0)),
            token: None,
        }
    }
}

impl Drop for ApiDouble {
    fn drop(&mut self) {
        // Aborting the server task drops its JoinSet, which aborts every
        // connection task with it.
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}
