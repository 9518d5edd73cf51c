//! sandbolt controller: the central scheduler.
//!
//! It serves sandbolt's native control API (the whole sandbox, named
//! volumes, warm pools, see [`warm`], and sandbox snapshots, see
//! [`snapshot`]), FastPath v2 (what the OpenSandbox server speaks), FastPath v1
//! (fast-sandbox's API) and sandbolt's RegistryService on one gRPC port,
//! places sandboxes on agents in memory (image-affinity score, sub-linear
//! index) and keeps a durable record per sandbox behind the [`Store`] trait.
//!
//! ```no_run
//! # async fn f() -> Result<(), sandbolt_controller::Error> {
//! use sandbolt_controller::{Controller, ControllerConfig};
//! let cfg = ControllerConfig::new("127.0.0.1:9090".parse().unwrap(), "/var/lib/sandbolt", "agent-secret");
//! let handle = Controller::start(cfg).await?;
//! println!("listening on {}", handle.local_addr());
//! handle.shutdown().await;
//! # Ok(()) }
//! ```

pub mod agent_client;
pub mod cli;
pub mod clock;
pub mod config;
pub mod control;
pub mod error;
pub mod fastpath;
pub mod ha;
pub mod identity;
pub mod ids;
pub mod key_file;
pub mod keyed_lock;
pub mod leader;
pub mod limits;
pub mod listeners;
pub mod metrics;
pub mod placement;
pub mod pool_status;
pub mod registry;
pub mod registry_server;
pub mod sandbox;
pub mod secrets;
pub mod snapshot;
pub mod store;
pub mod template;
pub mod volume;
pub mod volume_index;
pub mod warm;
pub mod warm_pool_status;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sandbolt_proto::agent::v1::registry_service_server::RegistryServiceServer;
use sandbolt_proto::control::v1::sandbox_service_server::SandboxServiceServer;
use sandbolt_proto::control::v1::snapshot_service_server::SnapshotServiceServer;
use sandbolt_proto::control::v1::volume_service_server::VolumeServiceServer;
use sandbolt_proto::control::v1::warm_pool_service_server::WarmPoolServiceServer;
use sandbolt_proto::fastpath::v1::fast_path_service_server::FastPathServiceServer as V1Server;
use sandbolt_proto::fastpath::v2::fast_path_service_server::FastPathServiceServer as V2Server;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::server::Router;
use tower::layer::util::{Identity, Stack};

pub use config::{ControllerConfig, FAILPOINT_ENV, Failpoint, FailpointSpec};
pub use error::{Error, Result};
pub use ids::{AgentId, SandboxId, SandboxKey};
pub use metrics::{ControllerMetrics, register_metrics};
pub use sandbox::Core;
pub use store::{Consistency, Store};

pub struct Controller;

/// How long [`ControllerHandle::shutdown`] waits for open connections.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A running controller. Dropping it does not stop it; call `shutdown`.
pub struct ControllerHandle {
    addr: SocketAddr,
    open_addr: Option<SocketAddr>,
    core: Arc<Core>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Controller {
    /// Opens the embedded store under `config.data_dir` and starts serving.
    pub async fn start(config: ControllerConfig) -> Result<ControllerHandle> {
        let store = store::embedded::RedbStore::open(&config.data_dir)?;
        Self::start_with_store(config, Arc::new(store)).await
    }

    /// Starts with any [`Store`] implementation.
    pub async fn start_with_store(
        config: ControllerConfig,
        store: Arc<dyn Store>,
    ) -> Result<ControllerHandle> {
        config
            .listener_limits
            .validate()
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        if config.agent_token.is_empty() {
            return Err(Error::InvalidArgument(
                "agent_token must be set: agents authenticate with it".into(),
            ));
        }
        let core = Arc::new(Core::new(config.clone(), store)?);
        // Records and known agents first: the port opens on a registry that
        // already holds every slot the store knows about.
        core.rebuild()?;
        core.metrics.attach(&core);
        // Captures a previous leader did not see finish, listed before any
        // request can add new ones (those have their own capture task).
        let pending_snapshots = core.pending_snapshots()?;
        // TLS files first: a bad certificate fails the start, not a client.
        let tls = listeners::main_port_tls(&config)?;
        let (listener, addr) = bind(config.listen).await?;
        let open = match config.open_fastpath_listen {
            Some(open) => Some(bind(open).await?),
            None => None,
        };
        let (stop, stop_rx) = watch::channel(false);
        let router = main_router(&core, &config).await?;
        let mut tasks = vec![match tls {
            Some(tls) => serve(
                router,
                listeners::plaintext_or_tls(
                    sandbolt_telemetry::CappedListener::new(
                        listener,
                        "controller-main",
                        &config.listener_limits,
                    ),
                    tls,
                ),
                stop_rx.clone(),
                "main",
            ),
            None => serve(
                router,
                capped(listener, "controller-main", &config),
                stop_rx.clone(),
                "main",
            ),
        }];
        let mut open_addr = None;
        if let Some((listener, addr)) = open {
            let router = open_fastpath_router(&core, &config).await;
            tasks.push(serve(
                router,
                capped(listener, "controller-open-fastpath", &config),
                stop_rx.clone(),
                "open FastPath",
            ));
            open_addr = Some(addr);
        }

        let started = Instant::now();
        let c = core.clone();
        let mut rx = stop_rx.clone();
        let tick = (config.heartbeat_interval / 2).max(Duration::from_millis(20));
        let recovery = tokio::spawn(async move {
            loop {
                if stopped(&mut rx, tick).await {
                    break;
                }
                c.recovery_tick(started).await;
            }
        });
        // Only a serving controller (the leader, see `ha`) gets here: the
        // re-drives and the sweep run on one replica.
        let snapshots = tokio::spawn(core.clone().snapshot_upkeep(
            pending_snapshots,
            tick,
            stop_rx.clone(),
        ));
        let c = core.clone();
        let mut rx = stop_rx;
        let sweep = config.expiry_sweep_interval.max(Duration::from_millis(10));
        let expiry = tokio::spawn(async move {
            loop {
                if stopped(&mut rx, sweep).await {
                    break;
                }
                c.sweep_expired().await;
                c.sweep_deletion_requests().await;
            }
        });
        tracing::info!(%addr, consistency = ?config.default_consistency, fastpath_auth = config.fastpath_token.is_some(), fastpath_mtls = config.fastpath_tls.is_some(), "controller serving sandbolt.control.v1 (sandboxes, volumes, warm pools, snapshots), fastpath.v2, fastpath.v1, sandbolt.agent.v1.RegistryService");
        if let Some(open_addr) = open_addr {
            tracing::info!(%open_addr, "open FastPath port serving fastpath.v2 and fastpath.v1 without credentials (protect it by network policy)");
        }
        tasks.extend([recovery, expiry, snapshots]);
        Ok(ControllerHandle {
            addr,
            open_addr,
            core,
            stop,
            tasks,
        })
    }
}

async fn bind(addr: SocketAddr) -> Result<(tokio::net::TcpListener, SocketAddr)> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Unavailable(format!("bind {addr}: {e}")))?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::Internal(e.to_string()))?;
    Ok((listener, local))
}

/// Accepted connections under the configured cap, silent ones dropped, and
/// TCP_NODELAY on each (`Server::tcp_nodelay` applies only to listeners
/// tonic binds itself; without it, a response written in two segments waits
/// for the client's delayed ACK, 40 ms).
fn capped(
    listener: tokio::net::TcpListener,
    name: &'static str,
    config: &ControllerConfig,
) -> impl futures::Stream<
    Item = std::result::Result<
        sandbolt_telemetry::listener::CappedStream,
        std::convert::Infallible,
    >,
> + use<> {
    let limits = &config.listener_limits;
    let listener = sandbolt_telemetry::CappedListener::new(listener, name, limits);
    sandbolt_telemetry::listener::capped_incoming(listener, limits)
}

/// A gRPC server of the controller: every call counted, timed and run
/// inside its request id (`sandbolt_telemetry::grpc_layer`).
type Layered = Router<Stack<sandbolt_telemetry::GrpcLayer, Identity>>;

/// Serves `router` on `incoming` until the stop signal.
fn serve<IO, IE>(
    router: Layered,
    incoming: impl futures::Stream<Item = std::result::Result<IO, IE>> + Send + 'static,
    mut stop: watch::Receiver<bool>,
    port: &'static str,
) -> JoinHandle<()>
where
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = router
            .serve_with_incoming_shutdown(incoming, shutdown)
            .await
        {
            tracing::error!(error = %e, port, "controller gRPC server failed");
        }
    })
}

/// Everything, on the main port: FastPath and the native API behind the
/// FastPath token (or a client certificate), RegistryService behind the
/// bootstrap token and per-agent credentials, health open.
async fn main_router(core: &Arc<Core>, config: &ControllerConfig) -> Result<Layered> {
    let fp_auth = listeners::FastPathAuth::new(config);
    // TLS, when on, is done by the accept loop (`listeners::main_port_tls`).
    let server = sandbolt_telemetry::listener::tonic_server(&config.listener_limits);
    Ok(server
        .layer(core.metrics.grpc_layer())
        .add_service(serving_health().await)
        .add_service(V2Server::with_interceptor(
            fastpath::v2::FastPathV2::new(core.clone()),
            fp_auth.clone(),
        ))
        .add_service(V1Server::with_interceptor(
            fastpath::v1::FastPathV1::new(core.clone()),
            fp_auth.clone(),
        ))
        // The native API sits behind the same token as FastPath: both
        // hand out sandboxes' access tokens (ResolveEndpoint).
        .add_service(SandboxServiceServer::with_interceptor(
            control::ControlService::new(core.clone()),
            fp_auth.clone(),
        ))
        // Named volumes: the same clients, the same token.
        .add_service(VolumeServiceServer::with_interceptor(
            volume::service::VolumeServer::new(core.clone()),
            fp_auth.clone(),
        ))
        // Warm pools: the same clients (the lifecycle's /pools), the
        // same token.
        .add_service(WarmPoolServiceServer::with_interceptor(
            warm::service::WarmPoolServer::new(core.clone()),
            fp_auth.clone(),
        ))
        // Sandbox snapshots: the same clients, the same token.
        .add_service(SnapshotServiceServer::with_interceptor(
            snapshot::service::SnapshotServer::new(core.clone()),
            fp_auth,
        ))
        // No interceptor: which token a registry call needs depends on the
        // agent id in its body (see `registry_server`).
        .add_service(RegistryServiceServer::new(
            registry_server::RegistryServer::new(core.clone()),
        )))
}

/// FastPath v1 + v2 and health only, with no credentials (see
/// [`ControllerConfig::open_fastpath_listen`]): no native API (its
/// snapshots, volumes and warm pools are not the OpenSandbox server's
/// business) and no RegistryService (nothing here may pose as an agent).
async fn open_fastpath_router(core: &Arc<Core>, config: &ControllerConfig) -> Layered {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<V2Server<fastpath::v2::FastPathV2>>()
        .await;
    reporter
        .set_serving::<V1Server<fastpath::v1::FastPathV1>>()
        .await;
    sandbolt_telemetry::listener::tonic_server(&config.listener_limits)
        .layer(core.metrics.grpc_layer())
        .add_service(health)
        .add_service(V2Server::new(fastpath::v2::FastPathV2::new(core.clone())))
        .add_service(V1Server::new(fastpath::v1::FastPathV1::new(core.clone())))
}

/// Sleeps `period`; true if the stop signal came first.
async fn stopped(rx: &mut watch::Receiver<bool>, period: Duration) -> bool {
    tokio::select! {
        r = rx.wait_for(|s| *s) => { drop(r); true }
        _ = tokio::time::sleep(period) => false,
    }
}

impl ControllerHandle {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The tokenless FastPath port, when configured
    /// ([`ControllerConfig::open_fastpath_listen`]).
    pub fn open_fastpath_addr(&self) -> Option<SocketAddr> {
        self.open_addr
    }

    pub fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// Waits until writes are served (after a restart: until the known agents
    /// have heartbeated, or `startup_grace`).
    pub async fn wait_ready(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.core.is_ready() {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    /// Stops serving and the background loops; waits for them.
    ///
    /// Graceful shutdown waits for open gRPC connections to close; a client
    /// that ignores GOAWAY (or went silent) must not hold the process, so
    /// after [`SHUTDOWN_GRACE`] the remaining tasks are aborted.
    pub async fn shutdown(self) {
        self.core.metrics.detach(&self.core);
        let _ = self.stop.send(true);
        for mut t in self.tasks {
            if tokio::time::timeout(SHUTDOWN_GRACE, &mut t).await.is_err() {
                tracing::warn!(grace = ?SHUTDOWN_GRACE, "controller task did not stop in time; aborting it");
                t.abort();
                let _ = t.await;
            }
        }
    }
}

/// `grpc.health.v1` for this port: every service SERVING (and `""`, the
/// server as a whole). It takes no token: probes, the kubelet's among them,
/// carry none, and the answer says nothing but whether a service is served.
/// A standby replica does not listen at all, so it is simply not ready.
async fn serving_health()
-> tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health> {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<V2Server<fastpath::v2::FastPathV2>>()
        .await;
    reporter
        .set_serving::<V1Server<fastpath::v1::FastPathV1>>()
        .await;
    reporter
        .set_serving::<SandboxServiceServer<control::ControlService>>()
        .await;
    reporter
        .set_serving::<VolumeServiceServer<volume::service::VolumeServer>>()
        .await;
    reporter
        .set_serving::<WarmPoolServiceServer<warm::service::WarmPoolServer>>()
        .await;
    reporter
        .set_serving::<SnapshotServiceServer<snapshot::service::SnapshotServer>>()
        .await;
    reporter
        .set_serving::<RegistryServiceServer<registry_server::RegistryServer>>()
        .await;
    service
}
