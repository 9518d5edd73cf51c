//! sandbolt lifecycle: the OpenSandbox Lifecycle REST API (1.1.1 shape) in
//! front of one of two backends — the sandbolt controller over its native
//! control API, or a Docker engine. The `sandbolt` CLI calls
//! [`Lifecycle::start`].

pub mod api;
pub mod backend;
pub mod controller;
mod controller_pools;
mod controller_snapshots;
mod controller_volumes;
pub mod diagnostics;
pub mod docker;
pub mod docker_egress;
pub mod docker_network;
mod docker_snapshots;
pub mod docker_token;
mod docker_volumes;
pub mod egress;
pub mod error;
pub mod expiry;
pub mod gateway;
pub mod gateway_scope;
pub mod metrics;
pub mod model;
pub mod named_volumes;
pub mod openapi;
pub mod pool_routes;
pub mod pools;
pub mod proxy;
pub mod snapshots;
pub mod validate;
pub mod volume_routes;
pub mod volumes;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sandbolt_telemetry::prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use backend::{Backend, Route};
pub use controller::{ControllerBackend, ControllerConfig};
pub use docker::{DockerBackend, DockerConfig};
pub use error::{ApiError, StartError};
pub use gateway::GatewayConfig;
pub use gateway_scope::KeyRing;
pub use metrics::LifecycleMetrics;
pub use sandbolt_telemetry::{ListenerLimits, Readiness};

/// Which engine runs the sandboxes.
#[derive(Debug, Clone)]
pub enum BackendConfig {
    /// The sandbolt controller's native control API
    /// (`sandbolt.control.v1.SandboxService`).
    Controller(ControllerConfig),
    /// A Docker engine reached through its socket.
    Docker(DockerConfig),
}

/// Everything [`Lifecycle::start`] needs.
#[derive(Debug, Clone)]
pub struct LifecycleConfig {
    /// Address to serve on (port 0 picks one; see [`LifecycleHandle::addr`]).
    pub listen: SocketAddr,
    /// Required unless `insecure_no_auth` is set.
    pub api_key: Option<String>,
    /// Serve without authentication. Must be asked for explicitly.
    pub insecure_no_auth: bool,
    pub backend: BackendConfig,
    /// Host path prefixes volumes may mount (empty: host volumes refused).
    /// Docker backend only: on the controller backend each node's agent
    /// enforces its own allowlist.
    pub allow_host_paths: Vec<PathBuf>,
    /// Persisted state of the Docker backend (metadata patches, renewed
    /// expiries). The controller backend keeps nothing.
    pub data_dir: PathBuf,
    /// Upper bound of `timeout` on create.
    pub max_timeout_secs: i64,
    /// How often expired sandboxes are looked for (Docker backend; the
    /// controller expires its sandboxes itself).
    pub sweep_interval: Duration,
    /// The fsb gateway for the OpenSandbox server's signed endpoints
    /// (controller backend only).
    pub gateway: Option<GatewayConfig>,
    /// Where the lifecycle's metrics go (see [`LifecycleMetrics::register`]);
    /// `None` counts into a registry nobody serves.
    pub metrics: Option<LifecycleMetrics>,
    /// Connection cap, header-read and idle timeouts and body cap of the
    /// API's (and the gateway's) listener.
    pub listener: ListenerLimits,
}

impl LifecycleConfig {
    /// Defaults: `max_timeout_secs` 86400, sweep every 5 s, no host paths.
    pub fn new(listen: SocketAddr, backend: BackendConfig, data_dir: impl Into<PathBuf>) -> Self {
        Self {
            listen,
            api_key: None,
            insecure_no_auth: false,
            backend,
            allow_host_paths: Vec::new(),
            data_dir: data_dir.into(),
            max_timeout_secs: validate::DEFAULT_MAX_TIMEOUT_SECS,
            sweep_interval: Duration::from_secs(5),
            gateway: None,
            metrics: None,
            listener: ListenerLimits::default(),
        }
    }
}

/// A running lifecycle server.
pub struct LifecycleHandle {
    addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    server: JoinHandle<std::io::Result<()>>,
    /// `None` when the backend expires sandboxes itself.
    sweeper: Option<JoinHandle<()>>,
    /// The fsb gateway's address and server, when one runs.
    gateway: Option<(SocketAddr, JoinHandle<std::io::Result<()>>)>,
    readiness: Readiness,
    /// The API's listener limits, which the gateway's listener shares.
    listener: ListenerLimits,
}

impl LifecycleHandle {
    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The fsb gateway's bound address, when one runs.
    pub fn gateway_addr(&self) -> Option<SocketAddr> {
        self.gateway.as_ref().map(|(addr, _)| *addr)
    }

    /// The lifecycle's readiness (its backend's engine answers), for an ops
    /// port's `/readyz`; the API's own port answers it too.
    pub fn readiness(&self) -> Readiness {
        self.readiness.clone()
    }

    /// Stops accepting, finishes in-flight requests, stops the sweeper.
    pub async fn shutdown(self) -> std::io::Result<()> {
        let _ = self.shutdown.send(true);
        if let Some(s) = self.sweeper {
            s.abort();
        }
        let gateway = match self.gateway {
            Some((_, server)) => server_result(server.await),
            None => Ok(()),
        };
        server_result(self.server.await).and(gateway)
    }

    /// Waits until the API server (or the gateway) stops on its own (an I/O
    /// error) or is shut down.
    pub async fn wait(&mut self) -> std::io::Result<()> {
        match &mut self.gateway {
            Some((_, gateway)) => tokio::select! {
                r = &mut self.server => server_result(r),
                r = gateway => server_result(r),
            },
            None => server_result((&mut self.server).await),
        }
    }
}

/// A server task's outcome; cancelled counts as stopped.
fn server_result(
    joined: Result<std::io::Result<()>, tokio::task::JoinError>,
) -> std::io::Result<()> {
    match joined {
        Ok(r) => r,
        Err(e) if e.is_cancelled() => Ok(()),
        Err(e) => Err(std::io::Error::other(e)),
    }
}

/// Serves `router` on `listener` until `stop` says so, under `limits`
/// (connection cap, header-read and idle timeouts, body cap: see
/// [`sandbolt_telemetry::listener`]). `name` labels its metrics.
fn serve(
    listener: tokio::net::TcpListener,
    name: &'static str,
    router: axum::Router,
    limits: ListenerLimits,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<std::io::Result<()>> {
    let listener = sandbolt_telemetry::CappedListener::new(listener, name, &limits);
    tokio::spawn(async move {
        let stop = async move {
            let _ = stop.wait_for(|stop| *stop).await;
        };
        sandbolt_telemetry::listener::serve_router(
            listener,
            router,
            limits,
            sandbolt_telemetry::listener::Drain::Wait,
            stop,
        )
        .await;
        Ok(())
    })
}

/// Metrics for a lifecycle started without a registry: counted (the
/// layers that count also carry request ids) into one nobody scrapes.
fn unserved_metrics() -> LifecycleMetrics {
    LifecycleMetrics::register(&mut Registry::default())
}

pub struct Lifecycle;

impl Lifecycle {
    /// Connects the configured backend and serves the API.
    pub async fn start(mut config: LifecycleConfig) -> Result<LifecycleHandle, StartError> {
        let metrics = config.metrics.get_or_insert_with(unserved_metrics).clone();
        match config.backend.clone() {
            BackendConfig::Docker(_) if config.gateway.is_some() => Err(StartError::Config(
                "the fsb gateway needs the controller backend: it routes to sandboxes by namespace and id, which only the controller resolves".into(),
            )),
            BackendConfig::Docker(d) => {
                let backend = DockerBackend::connect(d, &config.data_dir).await?;
                backend.check_host_roots(&config.allow_host_paths).await?;
                Self::start_with(config, backend).await
            }
            BackendConfig::Controller(c) => {
                let backend = ControllerBackend::connect(c).await?;
                let gateway = match config.gateway.take() {
                    Some(g) => Some(gateway::bind(&g, backend.clone(), metrics.http).await?),
                    None => None,
                };
                let mut handle = Self::start_with(config, backend).await?;
                if let Some(g) = gateway {
                    let server = serve(
                        g.listener,
                        "lifecycle-gateway",
                        g.router,
                        handle.listener,
                        handle.shutdown.subscribe(),
                    );
                    handle.gateway = Some((g.addr, server));
                }
                Ok(handle)
            }
        }
    }

    /// Serves the API over an already-built backend (no gateway: that is
    /// [`Lifecycle::start`]'s, on the controller backend).
    pub async fn start_with<B: Backend>(
        config: LifecycleConfig,
        backend: B,
    ) -> Result<LifecycleHandle, StartError> {
        if config.gateway.is_some() {
            return Err(StartError::Config(
                "the fsb gateway is started by Lifecycle::start on the controller backend".into(),
            ));
        }
        let api_key = match (&config.api_key, config.insecure_no_auth) {
            (Some(k), _) if !k.trim().is_empty() => Some(k.clone()),
            (_, true) => {
                tracing::warn!("lifecycle API runs WITHOUT authentication (explicitly configured)");
                None
            }
            _ => return Err(StartError::NoApiKey),
        };
        config
            .listener
            .validate()
            .map_err(|e| StartError::Config(e.to_string()))?;
        if config.max_timeout_secs < validate::MIN_TIMEOUT_SECS {
            return Err(StartError::Config(format!(
                "max_timeout_secs must be at least {}",
                validate::MIN_TIMEOUT_SECS
            )));
        }
        for p in &config.allow_host_paths {
            if !p.is_absolute() {
                return Err(StartError::Config(format!(
                    "allow_host_paths entry {} is not absolute",
                    p.display()
                )));
            }
        }
        let host_paths = if backend.host_paths_checked_on_node() {
            if !config.allow_host_paths.is_empty() {
                tracing::info!(
                    "allow_host_paths is not used by the {} backend: each node's agent checks host paths against its own allowlist",
                    backend.runtime_name()
                );
            }
            volumes::HostPathCheck::OnNode
        } else {
            volumes::HostPathCheck::Local(config.allow_host_paths.clone())
        };
        let sweeps = !backend.expires_sandboxes_itself();
        let app = Arc::new(api::App {
            backend,
            policy: validate::Policy {
                max_timeout_secs: config.max_timeout_secs,
                host_paths,
            },
            api_key,
            metrics: config.metrics.unwrap_or_else(unserved_metrics),
        });
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| StartError::Bind {
                addr: config.listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| StartError::Bind {
            addr: config.listen,
            source,
        })?;
        let (tx, rx) = watch::channel(false);
        // One sweeper per sandbox: where the engine expires sandboxes, a
        // sweep here would be a second one per replica, racing renewals.
        let sweeper = sweeps.then(|| {
            tokio::spawn(expiry::sweep_forever(
                app.clone(),
                config.sweep_interval,
                tx.subscribe(),
            ))
        });
        let readiness = api::readiness(app.clone());
        let server = serve(listener, "lifecycle", api::router(app), config.listener, rx);
        tracing::info!(%addr, "lifecycle API serving");
        Ok(LifecycleHandle {
            addr,
            shutdown: tx,
            server,
            sweeper,
            gateway: None,
            readiness,
            listener: config.listener,
        })
    }
}
