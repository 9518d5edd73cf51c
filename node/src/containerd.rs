//! One long-lived gRPC channel to containerd, namespaced requests, and
//! reconnect-with-backoff.
//!
//! The channel is lazy: tonic re-dials the unix socket on the next call after
//! the connection breaks, so a containerd restart costs the calls that were in
//! flight, not the agent.

use std::path::{Path, PathBuf};
use std::time::Duration;

use backon::Retryable;
use containerd_client::services::v1::snapshots::{
    Info, Kind, ListSnapshotsRequest, MountsRequest, PrepareSnapshotRequest, RemoveSnapshotRequest,
    StatSnapshotRequest,
};
use containerd_client::services::v1::{
    Container, UpdateContainerRequest, containers_client::ContainersClient,
    content_client::ContentClient, diff_client::DiffClient, events_client::EventsClient,
    images_client::ImagesClient, leases_client::LeasesClient,
    snapshots::snapshots_client::SnapshotsClient, tasks_client::TasksClient,
    version_client::VersionClient,
};
use tonic::Request;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};

use crate::error::{NodeError, Result};
use crate::retry;

/// containerd's gRPC namespace header.
const NAMESPACE_HEADER: &str = "containerd-namespace";
/// Lease header: resources created by a call carrying it belong to the lease.
const LEASE_HEADER: &str = "containerd-lease";

#[derive(Clone)]
pub struct Containerd {
    channel: Channel,
    namespace: MetadataValue<tonic::metadata::Ascii>,
    namespace_str: String,
    socket: PathBuf,
}

impl Containerd {
    /// Builds the (lazy) channel and waits, with exponential backoff, until
    /// containerd answers `Version` or `deadline` passes.
    pub async fn connect(socket: &Path, namespace: &str, deadline: Duration) -> Result<Self> {
        let namespace_value = namespace.parse().map_err(|_| {
            NodeError::InvalidArgument(format!("bad containerd namespace {namespace:?}"))
        })?;
        let path = socket.to_path_buf();
        let channel = Endpoint::from_static("http://containerd.sock")
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .connect_with_connector_lazy(tower::service_fn(move |_| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }));
        let c = Self {
            channel,
            namespace: namespace_value,
            namespace_str: namespace.to_string(),
            socket: socket.to_path_buf(),
        };
        c.wait_ready(deadline).await?;
        Ok(c)
    }

    /// Retries `Version` with backoff (20 ms doubling to 2 s) until it
    /// answers or the next wait would end past `deadline`.
    pub async fn wait_ready(&self, deadline: Duration) -> Result<String> {
        let give_up = tokio::time::Instant::now() + deadline;
        let version = || async { self.version().version(()).await };
        version
            .retry(retry::doubling(
                Duration::from_millis(20),
                Duration::from_secs(2),
            ))
            .adjust(retry::until(give_up))
            .notify(|status, backoff| {
                tracing::debug!(error = %status.message(), ?backoff, "containerd not ready, retrying");
            })
            .await
            .map(|v| v.into_inner().version)
            .map_err(|status| NodeError::Connect {
                socket: self.socket.display().to_string(),
                reason: status.message().to_string(),
            })
    }

    pub fn namespace(&self) -> &str {
        &self.namespace_str
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Wraps a message in a request scoped to the agent's namespace.
    pub fn req<T>(&self, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        r.metadata_mut()
            .insert(NAMESPACE_HEADER, self.namespace.clone());
        r
    }

    /// Like [`Self::req`], and the resources the call creates join `lease`.
    pub fn leased_req<T>(&self, msg: T, lease: &str) -> Result<Request<T>> {
        let mut r = self.req(msg);
        let v = lease
            .parse()
            .map_err(|_| NodeError::InvalidArgument(format!("bad lease id {lease:?}")))?;
        r.metadata_mut().insert(LEASE_HEADER, v);
        Ok(r)
    }

    pub fn version(&self) -> VersionClient<Channel> {
        VersionClient::new(self.channel.clone())
    }
    pub fn containers(&self) -> ContainersClient<Channel> {
        ContainersClient::new(self.channel.clone())
    }
    pub fn tasks(&self) -> TasksClient<Channel> {
        TasksClient::new(self.channel.clone())
    }
    pub fn images(&self) -> ImagesClient<Channel> {
        ImagesClient::new(self.channel.clone())
    }
    pub fn content(&self) -> ContentClient<Channel> {
        ContentClient::new(self.channel.clone())
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20)
    }
    /// Every snapshot of `snapshotter` matching `filters` (containerd's
    /// filter syntax, e.g. `name~="^sandbolt-snapshot-"`; empty = all), of
    /// every kind. The caller names the failure (`snapshots.List`) in its
    /// own error.
    pub async fn list_snapshots(
        &self,
        snapshotter: &str,
        filters: Vec<String>,
    ) -> std::result::Result<Vec<Info>, tonic::Status> {
        use futures::StreamExt;
        let mut stream = self
            .snapshots()
            .list(self.req(ListSnapshotsRequest {
                snapshotter: snapshotter.to_string(),
                filters,
            }))
            .await?
            .into_inner();
        let mut out = Vec::new();
        while let Some(chunk) = stream.next().await {
            out.extend(chunk?.info);
        }
        Ok(out)
    }

    /// Every active (writable) snapshot of `snapshotter`: the janitor's
    /// leftovers and the agent's prepared snapshots are among them. The
    /// caller names the failure (`snapshots.List`) in its own error.
    pub async fn active_snapshots(
        &self,
        snapshotter: &str,
    ) -> std::result::Result<Vec<Info>, tonic::Status> {
        let mut all = self.list_snapshots(snapshotter, vec![]).await?;
        all.retain(|i| i.kind == Kind::Active as i32);
        Ok(all)
    }

    /// The committed snapshots of `snapshotter` whose name starts with
    /// `prefix` (e.g. `labels::SNAPSHOT_NAME_PREFIX`), labels included.
    pub async fn committed_snapshots_named(
        &self,
        snapshotter: &str,
        prefix: &str,
    ) -> std::result::Result<Vec<Info>, tonic::Status> {
        let mut all = self.list_snapshots(snapshotter, vec![]).await?;
        all.retain(|i| i.kind == Kind::Committed as i32 && i.name.starts_with(prefix));
        Ok(all)
    }

    pub fn snapshots(&self) -> SnapshotsClient<Channel> {
        SnapshotsClient::new(self.channel.clone())
    }
    pub fn events(&self) -> EventsClient<Channel> {
        EventsClient::new(self.channel.clone())
    }
    pub fn diff(&self) -> DiffClient<Channel> {
        DiffClient::new(self.channel.clone())
    }
    pub fn leases(&self) -> LeasesClient<Channel> {
        LeasesClient::new(self.channel.clone())
    }

    /// The mounts of snapshot `key` (a writable one's: what a task's
    /// rootfs is made of). The caller names the failure
    /// (`snapshots.Mounts`) in its own error.
    pub async fn snapshot_mounts(
        &self,
        snapshotter: &str,
        key: &str,
    ) -> std::result::Result<Vec<containerd_client::types::Mount>, tonic::Status> {
        Ok(self
            .snapshots()
            .mounts(self.req(MountsRequest {
                snapshotter: snapshotter.to_string(),
                key: key.to_string(),
            }))
            .await?
            .into_inner()
            .mounts)
    }

    /// Prepares writable snapshot `key` on top of `parent` with `labels`;
    /// returns its mounts. The caller names the failure
    /// (`snapshots.Prepare`) in its own error.
    pub async fn prepare_snapshot(
        &self,
        snapshotter: &str,
        key: &str,
        parent: &str,
        labels: std::collections::HashMap<String, String>,
    ) -> std::result::Result<Vec<containerd_client::types::Mount>, tonic::Status> {
        Ok(self
            .snapshots()
            .prepare(self.req(PrepareSnapshotRequest {
                snapshotter: snapshotter.to_string(),
                key: key.to_string(),
                parent: parent.to_string(),
                labels,
            }))
            .await?
            .into_inner()
            .mounts)
    }

    /// containerd's facts about snapshot `key`; None when it does not exist
    /// (NOT_FOUND is no failure). The caller names other failures
    /// (`snapshots.Stat`) in its own error.
    pub async fn stat_snapshot(
        &self,
        snapshotter: &str,
        key: &str,
    ) -> std::result::Result<Option<Info>, tonic::Status> {
        let res = self
            .snapshots()
            .stat(self.req(StatSnapshotRequest {
                snapshotter: snapshotter.to_string(),
                key: key.to_string(),
            }))
            .await;
        match res {
            Ok(r) => Ok(r.into_inner().info),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(s),
        }
    }

    /// Removes snapshot `key`; false when it did not exist (NOT_FOUND is
    /// no failure). The caller names other failures (`snapshots.Remove`)
    /// in its own error.
    pub async fn remove_snapshot(
        &self,
        snapshotter: &str,
        key: &str,
    ) -> std::result::Result<bool, tonic::Status> {
        let res = self
            .snapshots()
            .remove(self.req(RemoveSnapshotRequest {
                snapshotter: snapshotter.to_string(),
                key: key.to_string(),
            }))
            .await;
        match res {
            Ok(_) => Ok(true),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(false),
            Err(s) => Err(s),
        }
    }

    /// Sets one label of container `id` (only it: the mask keeps every
    /// other field and label as containerd has it). An empty `value`
    /// removes the label (containerd stores no empty label).
    pub async fn set_container_label(
        &self,
        id: &str,
        key: &str,
        value: &str,
    ) -> std::result::Result<(), tonic::Status> {
        let update = Container {
            id: id.to_string(),
            labels: std::collections::HashMap::from([(key.to_string(), value.to_string())]),
            ..Default::default()
        };
        self.containers()
            .update(self.req(UpdateContainerRequest {
                container: Some(update),
                update_mask: Some(prost_types::FieldMask {
                    paths: vec![format!("labels.{key}")],
                }),
            }))
            .await?;
        Ok(())
    }
}
