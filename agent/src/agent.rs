//! Wiring: connect to containerd, recover state, start the event tracker,
//! the gRPC API, the data-plane proxy and the heartbeat.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use sandbolt_proto::agent::v1::agent_service_server::AgentServiceServer;
use sandbolt_proto::auth::RequireBearer;
use sandbolt_telemetry::{CappedListener, ListenerLimits};
use sandbolt_telemetry::{GrpcMetrics, Readiness};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::service::interceptor::InterceptedService;

use crate::config::AgentConfig;
use crate::containerd::Containerd;
use crate::error::{AgentError, Result};
use crate::heartbeat::{Heartbeat, Registration};
use crate::sandbox::Sandboxes;
use crate::server::{AgentApi, Identity};
use crate::volume_mounts::VolumeMounts;
use crate::warm_pool::WarmPool;
use crate::{events, proxy, runtime, warm};

/// How long `Agent::start` waits for containerd to answer.
const CONTAINERD_START_TIMEOUT: Duration = Duration::from_secs(30);

pub struct Agent;

/// A running agent. Dropping it without [`AgentHandle::shutdown`] leaves the
/// background tasks running until the runtime ends; sandboxes are never
/// touched by a shutdown (a restarted agent recovers them).
pub struct AgentHandle {
    grpc_addr: SocketAddr,
    proxy_addr: SocketAddr,
    instance_id: String,
    sandboxes: Arc<Sandboxes>,
    api: Arc<AgentApi>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<(&'static str, JoinHandle<()>)>,
    network: Option<crate::network::Network>,
    /// The controller's answer to the last heartbeat; None without one.
    registration: Option<Registration>,
    /// This agent's own credential; None without a controller.
    credentials: Option<crate::heartbeat::Credentials>,
}

/// How long [`AgentHandle::shutdown`] lets each background task finish
/// (open gRPC streams, proxied connections) before aborting it.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

impl Agent {
    /// Validates the configuration, recovers the sandboxes containerd still
    /// has, then serves: gRPC API, data-plane proxy, heartbeat, warm images.
    /// Its metrics count into a registry nobody serves; see
    /// [`Agent::start_with_metrics`].
    pub async fn start(config: AgentConfig) -> Result<AgentHandle> {
        Self::start_with_metrics(config, &mut Registry::default()).await
    }

    /// [`Agent::start`], with the agent's metrics (create stages and
    /// outcomes, live sandbox gauges, gRPC calls as component `agent`)
    /// registered into `registry`, e.g. the one `--metrics-listen` serves.
    pub async fn start_with_metrics(
        config: AgentConfig,
        registry: &mut Registry,
    ) -> Result<AgentHandle> {
        let grpc_metrics = GrpcMetrics::register(registry, "agent");
        Self::start_with_grpc_metrics(config, registry, grpc_metrics).await
    }

    /// [`Agent::start_with_metrics`] counting gRPC calls into
    /// `grpc_metrics`, which the caller registered (a process that serves
    /// more than one gRPC component registers those families once).
    pub async fn start_with_grpc_metrics(
        config: AgentConfig,
        registry: &mut Registry,
        grpc_metrics: GrpcMetrics,
    ) -> Result<AgentHandle> {
        validate(&config)?;
        let cfg = Arc::new(config);
        let instance_id = uuid::Uuid::new_v4().to_string();
        let sandboxes = recover_sandboxes(&cfg, &instance_id).await?;
        sandboxes.metrics().register(registry, &sandboxes);
        let listeners = Listeners::bind(&cfg).await?;
        let api_tls = api_tls_identity(&cfg)?;
        let network = start_network(&cfg, &sandboxes).await?;

        let (shutdown, shutdown_rx) = watch::channel(false);
        let mut tasks = vec![(
            "events",
            tokio::spawn(events::run(sandboxes.clone(), shutdown_rx.clone())),
        )];
        let warm_pool = Arc::new(WarmPool::new(
            sandboxes.clone(),
            cfg.warm_pool_interval,
            cfg.warm_refill_pause,
        ));
        tasks.push((
            "warm-pool",
            tokio::spawn(warm_pool.clone().run(shutdown_rx.clone())),
        ));
        tasks.push((
            "prepared-snapshots",
            tokio::spawn(crate::prepared::run(
                sandboxes.clone(),
                warm_pool.clone(),
                cfg.warm_images.clone(),
                cfg.warm_pool_interval,
                shutdown_rx.clone(),
            )),
        ));
        // With a controller, the AgentService takes only this agent's own
        // credential (see `heartbeat::Credentials`), never the shared token.
        let credentials = cfg
            .controller_endpoint
            .as_ref()
            .map(|_| crate::heartbeat::Credentials::load(&cfg));
        let api = Arc::new(AgentApi {
            sandboxes: sandboxes.clone(),
            identity: identity(&cfg, &instance_id, &listeners, api_tls.as_ref()),
            warm_pool,
        });
        let (grpc_addr, proxy_addr) = (listeners.grpc_addr, listeners.proxy_addr);
        tasks.push((
            "grpc",
            serve_grpc(
                agent_auth(&cfg, credentials.as_ref()),
                api.clone(),
                grpc_metrics,
                CappedListener::new(listeners.grpc, "agent-grpc", &cfg.listener_limits),
                api_tls.map(|t| t.server_config()),
                cfg.listener_limits,
                shutdown_rx.clone(),
            ),
        ));
        tasks.push((
            "proxy",
            serve_proxy(
                sandboxes.clone(),
                listeners.proxy,
                cfg.listener_limits,
                shutdown_rx.clone(),
            ),
        ));
        let heartbeat =
            start_heartbeat(&cfg, api.clone(), credentials.clone(), shutdown_rx.clone());
        let registration = match heartbeat {
            Ok(Some((heartbeat, registration))) => {
                tasks.push(("heartbeat", heartbeat));
                Some(registration)
            }
            Ok(None) => None,
            Err(e) => {
                let _ = shutdown.send(true);
                if let Some(network) = network {
                    network.shutdown().await;
                }
                return Err(e);
            }
        };
        let networked = network.is_some();
        tasks.extend(background_tasks(&cfg, &sandboxes, networked, &shutdown_rx));
        tracing::info!(%grpc_addr, %proxy_addr, warm_images = ?cfg.warm_images, "agent started");
        Ok(AgentHandle {
            grpc_addr,
            proxy_addr,
            instance_id,
            sandboxes,
            api,
            shutdown,
            tasks,
            network,
            registration,
            credentials,
        })
    }
}

/// The agent's housekeeping: orphaned networks and volumes released, warm
/// images kept present, logs and writable layers held to their limits.
fn background_tasks(
    cfg: &Arc<AgentConfig>,
    sandboxes: &Arc<Sandboxes>,
    networked: bool,
    shutdown_rx: &watch::Receiver<bool>,
) -> Vec<(&'static str, JoinHandle<()>)> {
    let mut tasks = Vec::new();
    if networked || sandboxes.volumes().enabled() {
        tasks.push((
            "orphan-gc",
            tokio::spawn(release_orphans(sandboxes.clone(), shutdown_rx.clone())),
        ));
    }
    // Warm images are ensured in the background: a slow or unreachable
    // registry must delay neither serving nor creates of other images.
    for reference in &cfg.warm_images {
        let keep = warm::keep_warm(
            sandboxes.clone(),
            cfg.warm_recheck_interval,
            reference.clone(),
            shutdown_rx.clone(),
        );
        tasks.push(("warm-image", tokio::spawn(keep)));
    }
    tasks.extend(crate::log_rotation::spawn(cfg, sandboxes, shutdown_rx));
    tasks
}

/// Starts sandbox networking (when configured) once the sandboxes are
/// known: their namespaces and rules are taken back, the rest released.
async fn start_network(
    cfg: &AgentConfig,
    sandboxes: &Arc<Sandboxes>,
) -> Result<Option<crate::network::Network>> {
    let Some(net_cfg) = &cfg.network else {
        tracing::info!("sandbox networking off: sandboxes get loopback only");
        return Ok(None);
    };
    let network = crate::network::Network::start(net_cfg, &cfg.state_dir, &sandboxes.ids()).await?;
    sandboxes.set_network(network.clone());
    Ok(Some(network))
}

/// Refuses a configuration the agent cannot serve with, and makes the log
/// directory.
fn validate(config: &AgentConfig) -> Result<()> {
    if config.api_token.is_empty() {
        return Err(AgentError::InvalidArgument(
            "api_token must not be empty: every AgentService call is authenticated".into(),
        ));
    }
    if !config.execd_binary.is_file() {
        return Err(AgentError::InvalidArgument(format!(
            "execd binary {} does not exist",
            config.execd_binary.display()
        )));
    }
    warm::validate(config)?;
    if config.user_namespace.enabled() {
        crate::userns::validate_base(config.userns_base).map_err(AgentError::InvalidArgument)?;
    }
    crate::config::check_cgroup_parent(&config.cgroup_parent)
        .map_err(AgentError::InvalidArgument)?;
    validate_volume_root(config)?;
    config
        .pool_default_limits
        .validate("pool default")
        .and_then(|()| config.pool_max_limits.validate("pool max"))
        .map_err(AgentError::InvalidArgument)?;
    let logs = config.logs_dir();
    std::fs::create_dir_all(&logs).map_err(AgentError::io(format!("creating {}", logs.display())))
}

/// Refuses a volume root that host-path bindings could reach (or that
/// holds an allowed host path): a binding would bypass the volumes' access
/// modes, or mount another sandbox's volume.
fn validate_volume_root(config: &AgentConfig) -> Result<()> {
    let Some(v) = &config.volumes else {
        return Ok(());
    };
    let clash = config
        .allowed_host_paths
        .iter()
        .find(|h| v.root.starts_with(h) || h.starts_with(&v.root));
    match clash {
        Some(h) => Err(AgentError::InvalidArgument(format!(
            "the volume root {} and the allowed host path {} overlap: host-path bindings could reach named volumes' data; choose a volume root outside every --allow-host-path",
            v.root.display(),
            h.display()
        ))),
        None => Ok(()),
    }
}

/// Connects to containerd, probes the OCI runtimes and rebuilds the sandbox
/// table from containerd's labels.
async fn recover_sandboxes(cfg: &Arc<AgentConfig>, instance_id: &str) -> Result<Arc<Sandboxes>> {
    // Before containerd: a runtime with an unmitigated known escape stops
    // the start whatever containerd's state (see `crate::runtime_check`).
    let runtimes = runtime::probe_for(cfg)?;
    let ctrd = Containerd::connect(
        &cfg.containerd_socket,
        &cfg.containerd_namespace,
        CONTAINERD_START_TIMEOUT,
    )
    .await?;
    for r in &runtimes {
        tracing::info!(runtime = %r.name, available = r.available, reason = %r.reason, "OCI runtime");
    }
    // Before recovery: recovered sandboxes hold their volumes again.
    let volumes = Arc::new(
        VolumeMounts::open(cfg.volumes.as_ref(), &cfg.agent_id, &cfg.node_name)
            .await?
            .with_juicefs(cfg.juicefs.as_ref())
            .await?,
    );
    let sandboxes = Arc::new(Sandboxes::new(
        cfg.clone(),
        ctrd,
        runtimes,
        volumes,
        instance_id,
    ));
    let recovered = sandboxes.recover().await?;
    // Recovery also re-labelled adopted containers with this pod's UID;
    // only now may the agent serve (and so turn its pod Ready).
    tracing::info!(
        recovered,
        agent_id = %cfg.agent_id,
        %instance_id,
        pod_uid = cfg.pod_uid().unwrap_or(""),
        pod = cfg.pod_name.as_deref().unwrap_or(""),
        pod_namespace = cfg.pod_namespace.as_deref().unwrap_or(""),
        "agent state recovered from containerd"
    );
    Ok(sandboxes)
}

/// The gRPC and proxy sockets, bound before anything is served so that the
/// addresses (port 0 resolved) can be advertised.
struct Listeners {
    grpc: TcpListener,
    grpc_addr: SocketAddr,
    proxy: TcpListener,
    proxy_addr: SocketAddr,
}

impl Listeners {
    async fn bind(cfg: &AgentConfig) -> Result<Self> {
        let grpc = TcpListener::bind(cfg.grpc_listen)
            .await
            .map_err(AgentError::io(format!("binding {}", cfg.grpc_listen)))?;
        let proxy = TcpListener::bind(cfg.proxy_listen)
            .await
            .map_err(AgentError::io(format!("binding {}", cfg.proxy_listen)))?;
        Ok(Self {
            grpc_addr: grpc.local_addr().map_err(AgentError::io("grpc addr"))?,
            proxy_addr: proxy.local_addr().map_err(AgentError::io("proxy addr"))?,
            grpc,
            proxy,
        })
    }
}

/// The AgentService's TLS identity when `api_tls` is on: made at the first
/// start, then the same (its fingerprint is what the controller pins).
fn api_tls_identity(cfg: &AgentConfig) -> Result<Option<sandbolt_proto::tls::SelfSignedIdentity>> {
    if !cfg.api_tls {
        return Ok(None);
    }
    let dir = cfg.state_dir.join("identity");
    let tls = sandbolt_proto::tls::SelfSignedIdentity::load_or_create(&dir)
        .map_err(|e| AgentError::InvalidArgument(format!("--api-tls: {e}")))?;
    // Checked here so a bad stored pair stops the start, not the server task.
    tonic::transport::Server::builder()
        .tls_config(tls.server_config())
        .map_err(|e| AgentError::InvalidArgument(format!("--api-tls: {}: {e}", dir.display())))?;
    tracing::info!(sha256 = ?tls, dir = %dir.display(), "AgentService serves TLS with this agent's self-signed certificate");
    Ok(Some(tls))
}

/// What the inventory says about this agent.
fn identity(
    cfg: &AgentConfig,
    instance_id: &str,
    listeners: &Listeners,
    api_tls: Option<&sandbolt_proto::tls::SelfSignedIdentity>,
) -> Identity {
    let advertise = |a: SocketAddr| {
        let host = cfg.advertise_host.clone().unwrap_or_else(|| {
            if a.ip().is_unspecified() {
                "127.0.0.1".to_string()
            } else {
                a.ip().to_string()
            }
        });
        format!("{host}:{}", a.port())
    };
    Identity {
        agent_id: cfg.agent_id.clone(),
        instance_id: instance_id.to_string(),
        node_name: cfg.node_name.clone(),
        pool: cfg.pool.clone(),
        namespace: cfg.pool_namespace.clone(),
        max_sandboxes: cfg.max_sandboxes as i32,
        // With TLS: `https://host:port#sha256=...`, the pin the controller
        // dials with (it arrives in the authenticated heartbeat).
        api_endpoint: match api_tls {
            Some(tls) => tls.advertise(&advertise(listeners.grpc_addr)),
            None => advertise(listeners.grpc_addr),
        },
        proxy_endpoint: advertise(listeners.proxy_addr),
        pod: crate::heartbeat::agent_pod(cfg),
    }
}

/// Serves AgentService (bearer token required) and `grpc.health.v1`
/// (open) until shutdown; every call is counted, timed and runs under its
/// request id (the caller's `x-request-id`, else a new one).
fn serve_grpc(
    auth: RequireBearer,
    api: Arc<AgentApi>,
    metrics: GrpcMetrics,
    listener: CappedListener,
    tls: Option<tonic::transport::ServerTlsConfig>,
    limits: ListenerLimits,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let svc = InterceptedService::new(AgentServiceServer::from_arc(api), auth);
    tokio::spawn(async move {
        // grpc.health.v1 without a token: probes (the kubelet's among them)
        // carry none, and the answer says only whether AgentService is served.
        let (health, health_service) = tonic_health::server::health_reporter();
        health.set_serving::<AgentServiceServer<AgentApi>>().await;
        // Connections under the cap, silent ones dropped, TCP_NODELAY on
        // each (a response written in two segments would otherwise wait for
        // the controller's delayed ACK, 40 ms).
        let incoming = sandbolt_telemetry::listener::capped_incoming(listener, &limits);
        let mut server = sandbolt_telemetry::listener::tonic_server(&limits);
        if let Some(tls) = tls {
            server = match server.tls_config(tls) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "agent gRPC server: TLS configuration refused");
                    return;
                }
            };
        }
        let res = server
            .layer(sandbolt_telemetry::grpc_layer(metrics))
            .add_service(health_service)
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = shutdown.wait_for(|s| *s).await;
            })
            .await;
        if let Err(e) = res {
            tracing::error!(error = %e, "agent gRPC server failed");
        }
    })
}

/// Serves the data-plane proxy until shutdown.
fn serve_proxy(
    sandboxes: Arc<Sandboxes>,
    listener: TcpListener,
    limits: ListenerLimits,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let lookup: Arc<dyn proxy::SandboxLookup> = sandboxes;
    tokio::spawn(async move {
        let stop = async move {
            let _ = shutdown.wait_for(|s| *s).await;
        };
        if let Err(e) = proxy::serve_with_limits(listener, lookup, limits, stop).await {
            tracing::error!(error = %e, "data-plane proxy failed");
        }
    })
}

/// How often the agent looks for networks and volume holds whose
/// container went away without a delete (see
/// [`Sandboxes::release_orphaned_networks`] and
/// [`Sandboxes::release_orphaned_volumes`]).
const ORPHAN_GC_INTERVAL: Duration = Duration::from_secs(30);

async fn release_orphans(sandboxes: Arc<Sandboxes>, mut shutdown: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = shutdown.wait_for(|s| *s) => return,
            () = tokio::time::sleep(ORPHAN_GC_INTERVAL) => {}
        }
        sandboxes.release_orphaned_networks().await;
        sandboxes.release_orphaned_volumes().await;
    }
}

/// The heartbeat task and what the controller last answered it, when a
/// controller is configured.
fn start_heartbeat(
    cfg: &AgentConfig,
    api: Arc<AgentApi>,
    credentials: Option<crate::heartbeat::Credentials>,
    shutdown: watch::Receiver<bool>,
) -> Result<Option<(JoinHandle<()>, Registration)>> {
    let (Some(endpoint), Some(credentials)) = (cfg.controller_endpoint.clone(), credentials) else {
        return Ok(None);
    };
    let registration = Registration::default();
    let heartbeat = Heartbeat {
        endpoint,
        token: cfg.controller_token.clone().unwrap_or_default(),
        interval: cfg.heartbeat_interval,
        registration: registration.clone(),
        credentials,
        controller_ca: cfg.controller_ca.clone(),
    };
    let task = tokio::spawn(heartbeat.into_task(api, shutdown)?);
    Ok(Some((task, registration)))
}

/// Who may call the AgentService: with a controller, only the holder of
/// this agent's credential (the controller); without one, `api_token`.
fn agent_auth(
    cfg: &AgentConfig,
    credentials: Option<&crate::heartbeat::Credentials>,
) -> RequireBearer {
    match credentials {
        Some(c) => RequireBearer::cell(c.cell(), "agent"),
        None => RequireBearer::new(Some(&cfg.api_token), "agent"),
    }
}

/// How long a readiness check waits for containerd's `Version`.
const READINESS_CONTAINERD_TIMEOUT: Duration = Duration::from_secs(2);

impl AgentHandle {
    pub fn grpc_addr(&self) -> SocketAddr {
        self.grpc_addr
    }

    pub fn proxy_addr(&self) -> SocketAddr {
        self.proxy_addr
    }

    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// The credential the AgentService accepts (and heartbeats carry)
    /// once this agent has enrolled with its controller; `None` before, or
    /// without a controller (then `api_token` is the AgentService's token).
    pub fn credential(&self) -> Option<String> {
        self.credentials.as_ref()?.current()
    }

    /// [`AgentHandle::credential`], waiting up to `timeout` for the
    /// enrollment (tests that call the AgentService directly need it).
    pub async fn credential_within(&self, timeout: Duration) -> Option<String> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let c = self.credential();
            if c.is_some() || self.credentials.is_none() || std::time::Instant::now() > deadline {
                return c;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Direct (in-process) access to the sandbox table, e.g. for `sandbolt up`.
    pub fn sandboxes(&self) -> &Arc<Sandboxes> {
        &self.sandboxes
    }

    /// Replaces the warm sandbox targets, as a heartbeat answer with
    /// `warm_targets_set` does (see [`crate::warm_pool`]).
    pub fn set_warm_targets(&self, targets: Vec<sandbolt_proto::agent::v1::WarmTarget>) {
        self.api.warm_pool.set_targets(targets);
    }

    /// The warm sandbox buffer.
    pub fn warm_pool(&self) -> &Arc<WarmPool> {
        &self.api.warm_pool
    }

    /// Ready while containerd answers and (with a controller) the
    /// controller answered the last heartbeat: `/readyz` of
    /// `--metrics-listen`.
    pub fn readiness(&self) -> Readiness {
        let containerd = self.sandboxes.containerd().clone();
        let registration = self.registration.clone();
        Readiness::from_fn(move || {
            let containerd = containerd.clone();
            let registration = registration.clone();
            async move {
                let mut client = containerd.version();
                match tokio::time::timeout(READINESS_CONTAINERD_TIMEOUT, client.version(())).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(status)) => {
                        return Err(format!("containerd: {}", status.message()));
                    }
                    Err(_) => {
                        return Err(format!(
                            "containerd did not answer within {READINESS_CONTAINERD_TIMEOUT:?}"
                        ));
                    }
                }
                registration.map_or(Ok(()), |r| r.check())
            }
        })
    }

    /// The inventory the heartbeat would send now.
    pub async fn inventory(&self) -> Result<sandbolt_proto::agent::v1::Inventory> {
        self.api.inventory().await
    }

    /// Stops serving (gRPC, proxy, heartbeats, event tracking, DNS) and
    /// waits for the tasks to end. Sandboxes keep running, with their
    /// network; the pool's prepared namespaces are released.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for (name, mut t) in self.tasks {
            if tokio::time::timeout(SHUTDOWN_GRACE, &mut t).await.is_err() {
                tracing::warn!(task = name, "did not stop within the grace period; aborted");
                t.abort();
            }
        }
        // Prepared snapshots no create took go; sandboxes keep theirs.
        self.sandboxes.prepared().drain().await;
        // The pool's namespaces go; attached sandboxes keep theirs.
        if let Some(network) = self.network {
            network.shutdown().await;
        }
        // The store's lock on the volume root goes, so a new agent can open
        // it; the root itself stays mounted while sandboxes mount volumes.
        self.sandboxes.volumes().close();
        self.sandboxes.volumes().unmount_unused_root().await;
        self.sandboxes.volumes().stop_juicefs().await;
        tracing::info!("agent stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_volume_root_host_paths_can_reach_is_refused() {
        let mut cfg = AgentConfig::new("a", "/run/c.sock", "/bin/true", "/st", "t");
        let volumes = |root: &str| crate::volume_store::VolumeStoreConfig {
            root: root.into(),
            backend: Default::default(),
            loop_image: "/st/volumes.btrfs.img".into(),
            loop_size_bytes: 0,
        };
        cfg.allowed_host_paths = vec!["/data".into()];
        assert!(validate_volume_root(&cfg).is_ok(), "no volume root");
        for (root, ok) in [
            ("/srv/volumes", true),
            ("/data-other", true),
            ("/data", false),
            ("/data/volumes", false),
            ("/", false),
        ] {
            cfg.volumes = Some(volumes(root));
            let r = validate_volume_root(&cfg);
            assert_eq!(r.is_ok(), ok, "{root}: {r:?}");
        }
    }
}
