//! Running the controller as one of several replicas: only the holder of
//! the coordination Lease serves.
//!
//! A standby does not open the gRPC port at all (its pod stays unready, so
//! the Services send nothing to it). When it wins the Lease it opens the
//! store — for the Kubernetes store: a full list of Sandboxes into its cache
//! — and starts the controller, which rebuilds its registry from the store
//! *before* the port opens. Writes then wait, as after any restart, until
//! the known agents have heartbeated (or `startup_grace` passed).
//!
//! A leader that loses the Lease (it could not renew within the renew
//! deadline, e.g. cut off from the API server) stops serving at once and
//! [`run_elected`] returns [`ElectedExit::LostLeadership`]: the process
//! should exit and come back as a standby with fresh state, rather than try
//! to reconcile what it believed with what the new leader did.

use std::future::Future;
use std::sync::Arc;

use kube::Api;
use sandbolt_deploy::{SandboxPool, SandboxTemplate, SandboxWarmPool};

use crate::leader::{LeaderElector, LeaseConfig};
use crate::store::kube::{KubeStore, KubeStoreConfig};
use crate::{Controller, ControllerConfig, ControllerHandle, Error, Result, Store};

/// How often the leader refreshes the SandboxPool and SandboxWarmPool
/// status counts.
pub const POOL_STATUS_PERIOD: std::time::Duration = std::time::Duration::from_secs(5);

/// The resources whose status the leader keeps: the SandboxPools and
/// SandboxWarmPools of the controller's namespace, and the SandboxTemplates
/// of every namespace (the OpenSandbox server makes them in its tenants'
/// namespaces).
#[derive(Clone)]
pub struct StatusApis {
    pub pools: Api<SandboxPool>,
    pub warm_pools: Api<SandboxWarmPool>,
    pub templates: Api<SandboxTemplate>,
}

impl StatusApis {
    pub fn namespaced(client: kube::Client, namespace: &str) -> Self {
        Self {
            pools: Api::namespaced(client.clone(), namespace),
            warm_pools: Api::namespaced(client.clone(), namespace),
            templates: Api::all(client),
        }
    }
}

/// Why [`run_elected`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElectedExit {
    /// The shutdown future completed; the Lease was released.
    Shutdown,
    /// This replica led and lost the Lease; it stopped serving.
    LostLeadership,
}

/// Campaigns with `elector`; while leading, runs a controller over the store
/// `open_store` returns (called once per term, on a blocking thread: opening
/// may wait for the API server) and keeps the status of the `status`
/// resources. `on_serving` is told when a term starts serving.
pub async fn run_elected<S, F>(
    config: ControllerConfig,
    elector: LeaderElector,
    open_store: S,
    status: Option<StatusApis>,
    mut on_serving: impl FnMut(&ControllerHandle),
    shutdown: F,
) -> Result<ElectedExit>
where
    S: FnOnce() -> Result<Arc<dyn Store>> + Send + 'static,
    F: Future<Output = ()>,
{
    let mut shutdown = std::pin::pin!(shutdown);
    let mut state = elector.subscribe();
    if let Some(metrics) = &config.metrics {
        metrics.follow_leadership(elector.subscribe());
    }
    let identity = elector.identity().to_string();
    tracing::info!(%identity, lease = %elector.config().name, "standing by for the controller lease");
    tokio::select! {
        _ = &mut shutdown => {
            elector.release().await;
            return Ok(ElectedExit::Shutdown);
        }
        r = wait_for(&mut state, true) => {
            r.map_err(|_| Error::Internal("leader elector stopped".into()))?;
        }
    }
    tracing::info!(%identity, "leading: opening the store and rebuilding the registry");
    let store = tokio::task::spawn_blocking(open_store)
        .await
        .map_err(|e| Error::Internal(format!("opening the store: {e}")))??;
    if !elector.is_leader() {
        tracing::warn!(%identity, "lost the lease while opening the store; not serving");
        return Ok(ElectedExit::LostLeadership);
    }
    let handle = Controller::start_with_store(config, store).await?;
    let publishers = status.map(|apis| {
        let core = handle.core();
        [
            crate::pool_status::spawn(core.clone(), apis.pools, POOL_STATUS_PERIOD),
            crate::warm_pool_status::spawn(core.clone(), apis.warm_pools, POOL_STATUS_PERIOD),
            crate::template::reconcile::spawn(apis.templates),
        ]
    });
    on_serving(&handle);
    tracing::info!(%identity, addr = %handle.local_addr(), "leader serving");
    let exit = tokio::select! {
        _ = &mut shutdown => ElectedExit::Shutdown,
        _ = wait_for(&mut state, false) => ElectedExit::LostLeadership,
    };
    for task in publishers.into_iter().flatten() {
        task.abort();
    }
    handle.shutdown().await;
    match exit {
        ElectedExit::Shutdown => {
            elector.release().await;
            tracing::info!(%identity, "stopped and released the lease");
        }
        ElectedExit::LostLeadership => {
            tracing::error!(%identity, "lost the controller lease; stopped serving");
        }
    }
    Ok(exit)
}

/// Waits until leadership is `leading`; the guard `wait_for` returns is not
/// `Send` and must not live across the caller's awaits.
async fn wait_for(
    state: &mut tokio::sync::watch::Receiver<crate::leader::LeaderState>,
    leading: bool,
) -> std::result::Result<(), tokio::sync::watch::error::RecvError> {
    state
        .wait_for(|s| s.is_leader() == leading)
        .await
        .map(|_| ())
}

/// [`run_elected`] over the Kubernetes store: campaigns for `lease`, and
/// keeps records (Sandboxes), agent records, warm pools and the SandboxPool
/// and SandboxWarmPool status in `lease.namespace` (the controller's own),
/// and the SandboxTemplates' status in every namespace — the wiring of every
/// `--store kubernetes` controller process.
pub async fn run_on_kubernetes<F>(
    config: ControllerConfig,
    kube_config: kube::Config,
    lease: LeaseConfig,
    on_serving: impl FnMut(&ControllerHandle),
    shutdown: F,
) -> Result<ElectedExit>
where
    F: Future<Output = ()>,
{
    let client = kube::Client::try_from(kube_config.clone())
        .map_err(|e| Error::Unavailable(format!("Kubernetes client: {e}")))?;
    let namespace = lease.namespace.clone();
    let store_config = KubeStoreConfig {
        expired_sandbox_retention: config.expired_sandbox_retention,
        ..KubeStoreConfig::new(namespace.clone())
    };
    let status = StatusApis::namespaced(client.clone(), &namespace);
    let elector = LeaderElector::spawn(client, lease)
        .map_err(|e| Error::InvalidArgument(format!("leader election: {e}")))?;
    run_elected(
        config,
        elector,
        move || {
            let store = KubeStore::open(kube_config, store_config)?;
            Ok(Arc::new(store) as _)
        },
        Some(status),
        on_serving,
        shutdown,
    )
    .await
}
