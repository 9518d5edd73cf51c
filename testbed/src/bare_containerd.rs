//! A container run the way a bare containerd client does it — container,
//! snapshot, task, through containerd's own gRPC API with no sandbolt code in
//! between. The test bed's own test proves the bed runs images this way, and
//! the latency bench uses it as the floor sandbolt is measured against.

use std::path::Path;

use containerd_client::services::v1::container::Runtime;
use containerd_client::services::v1::snapshots::{PrepareSnapshotRequest, RemoveSnapshotRequest};
use containerd_client::services::v1::{
    Container, CreateContainerRequest, CreateTaskRequest, DeleteContainerRequest,
    DeleteTaskRequest, GetImageRequest, KillRequest, StartRequest, WaitRequest,
};
use containerd_client::tonic::{Code, Request, Status};
use containerd_client::types::Mount;
use containerd_client::{Client, with_namespace};

use crate::{BUSYBOX_REF, Testbed, TestbedError};

const SNAPSHOTTER: &str = "overlayfs";

/// A containerd client bound to one namespace of one test bed.
pub struct BareContainerd {
    client: Client,
    namespace: String,
}

impl BareContainerd {
    pub async fn connect(bed: &Testbed, namespace: &str) -> Result<Self, TestbedError> {
        let client = Client::from_path(bed.containerd_socket())
            .await
            .map_err(|e| TestbedError::Setup(format!("connect to the bed's containerd: {e}")))?;
        Ok(Self {
            client,
            namespace: namespace.to_string(),
        })
    }

    fn req<T>(&self, msg: T) -> Request<T> {
        with_namespace!(msg, self.namespace.as_str())
    }

    /// The name an image is registered under (a bare client looks its image
    /// up before it creates from it).
    pub async fn image_name(&self, reference: &str) -> Result<String, Status> {
        let req = self.req(GetImageRequest {
            name: reference.to_string(),
        });
        let image = self.client.images().get(req).await?.into_inner().image;
        Ok(image.map(|i| i.name).unwrap_or_default())
    }

    /// Creates container `id` of [`BUSYBOX_REF`] with the OCI runtime
    /// `spec`, then its active snapshot on `parent` (the image's chain id);
    /// answers the snapshot's mounts.
    pub async fn create_container(
        &self,
        id: &str,
        spec: &serde_json::Value,
        parent: &str,
    ) -> Result<Vec<Mount>, Status> {
        let container = Container {
            id: id.into(),
            image: BUSYBOX_REF.into(),
            runtime: Some(Runtime {
                name: "io.containerd.runc.v2".into(),
                options: None,
            }),
            spec: Some(prost_types::Any {
                type_url: "types.containerd.io/opencontainers/runtime-spec/1/Spec".into(),
                value: serde_json::to_vec(spec).expect("a JSON value serializes"),
            }),
            snapshotter: SNAPSHOTTER.into(),
            snapshot_key: id.into(),
            ..Default::default()
        };
        let create = self.req(CreateContainerRequest {
            container: Some(container),
        });
        self.client.containers().create(create).await?;
        // After the container exists: it references the snapshot key, which
        // keeps containerd's GC off the fresh active snapshot (unreferenced,
        // it may be collected before the task mounts it).
        let prepare = self.req(PrepareSnapshotRequest {
            snapshotter: SNAPSHOTTER.into(),
            key: id.into(),
            parent: parent.to_string(),
            labels: Default::default(),
        });
        Ok(self
            .client
            .snapshots()
            .prepare(prepare)
            .await?
            .into_inner()
            .mounts)
    }

    /// Creates the task of container `id` on `rootfs`; its stdout and
    /// stderr go to `output` when given.
    pub async fn create_task(
        &self,
        id: &str,
        rootfs: Vec<Mount>,
        output: Option<&Path>,
    ) -> Result<(), Status> {
        let uri = output.map(|p| format!("file://{}", p.display()));
        let create = self.req(CreateTaskRequest {
            container_id: id.into(),
            rootfs,
            stdout: uri.clone().unwrap_or_default(),
            stderr: uri.unwrap_or_default(),
            ..Default::default()
        });
        self.client.tasks().create(create).await?;
        Ok(())
    }

    pub async fn start_task(&self, id: &str) -> Result<(), Status> {
        let start = self.req(StartRequest {
            container_id: id.into(),
            exec_id: String::new(),
        });
        self.client.tasks().start(start).await?;
        Ok(())
    }

    /// Subscribes to the exit of the created task `id` (call it before the
    /// task can exit); the handle answers its exit status.
    pub fn wait_task(&self, id: &str) -> tokio::task::JoinHandle<Result<u32, Status>> {
        let req = self.req(WaitRequest {
            container_id: id.into(),
            exec_id: String::new(),
        });
        let mut tasks = self.client.tasks();
        tokio::spawn(async move { Ok(tasks.wait(req).await?.into_inner().exit_status) })
    }

    /// SIGKILLs every process of task `id`.
    pub async fn kill_task(&self, id: &str) -> Result<(), Status> {
        let req = self.req(KillRequest {
            container_id: id.into(),
            exec_id: String::new(),
            signal: 9,
            all: true,
        });
        self.client.tasks().kill(req).await?;
        Ok(())
    }

    /// Deletes the exited task, the container and its snapshot.
    pub async fn delete(&self, id: &str) -> Result<(), Status> {
        let task = self.req(DeleteTaskRequest {
            container_id: id.into(),
        });
        self.client.tasks().delete(task).await?;
        let container = self.req(DeleteContainerRequest { id: id.into() });
        self.client.containers().delete(container).await?;
        // Deleting the container left the snapshot unreferenced: containerd's
        // garbage collector (which the delete triggers) may have removed it
        // already, and NotFound means just that.
        let snapshot = self.req(RemoveSnapshotRequest {
            snapshotter: SNAPSHOTTER.into(),
            key: id.into(),
        });
        match self.client.snapshots().remove(snapshot).await {
            Err(e) if e.code() != Code::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}
