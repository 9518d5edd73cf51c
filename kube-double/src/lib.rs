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
//! subresource). All namespaced;
//! every namespace implicitly exists.
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
//! HTTP/2, and objects that stop matching a watch's selector being sent as
//! DELETED.

mod http;
mod kinds;
mod patch;
mod selectors;
mod server;
mod status;
mod store;
mod validation;
mod watch;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

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
    /// Binds 127.0.0.1:0 (plain HTTP), registers the built-in kinds and
    /// serves until shutdown.
    pub async fn start() -> ApiDouble {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0 for the kube API double");
        let addr = listener.local_addr().expect("bound socket has an address");
        let token = format!("double-{}", uuid::Uuid::new_v4().simple());
        let shared = Arc::new(Shared::new(token));
        let (stop, stopped) = oneshot::channel();
        let server = tokio::spawn(server::serve(listener, shared.clone(), stopped));
        ApiDouble {
            shared,
            addr,
            stop: Some(stop),
            server: Some(server),
        }
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

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
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

impl Drop for ApiDouble {
    fn drop(&mut self) {
        // Aborting the server task drops its JoinSet, which aborts every
        // connection task with it.
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}
