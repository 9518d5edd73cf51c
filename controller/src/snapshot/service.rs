//! `sandbolt.control.v1.SnapshotService`: translation only; the work is in
//! the [`Core`] (see the module's other files).

use std::sync::Arc;

use sandbolt_proto::control::v1 as pb;
use sandbolt_proto::control::v1::snapshot_service_server::SnapshotService;
use tonic::{Request, Response, Status};

use super::{SnapshotCreate, SnapshotFilter, model};
use crate::ids::SandboxKey;
use crate::sandbox::{Core, page_size};
use crate::store::SnapshotRecord;

pub struct SnapshotServer {
    core: Arc<Core>,
}

impl SnapshotServer {
    pub fn new(core: Arc<Core>) -> Self {
        Self { core }
    }
}

impl SnapshotServer {
    /// The snapshot as the API shows it, with the sandboxes that use it.
    fn answer(&self, r: &SnapshotRecord) -> Result<Response<pb::Snapshot>, Status> {
        let users = self.core.snapshot_users(&r.id)?;
        Ok(Response::new(model::snapshot_out(r, users)))
    }
}

/// The id a snapshot reference names (required).
fn snapshot_id(r: &pb::SnapshotRef) -> Result<&str, Status> {
    match r.id.as_str() {
        "" => Err(Status::invalid_argument("id is required")),
        id => Ok(id),
    }
}

#[tonic::async_trait]
impl SnapshotService for SnapshotServer {
    #[tracing::instrument(name = "snapshot.CreateSnapshot", skip_all, fields(namespace, sandbox))]
    async fn create_snapshot(
        &self,
        req: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        let q = req.into_inner();
        let source = q
            .sandbox
            .ok_or_else(|| Status::invalid_argument("sandbox is required"))?;
        let create = SnapshotCreate {
            request_id: q.request_id,
            source: SandboxKey::named(&source.namespace, &source.name, "sandbox.name")?,
            expected_uid: source.expected_uid,
            display_name: q.display_name,
            metadata: q.metadata.into_iter().collect(),
            wait: q.wait,
        };
        let r = self.core.create_snapshot(create).await?;
        self.answer(&r)
    }

    #[tracing::instrument(name = "snapshot.GetSnapshot", skip_all, fields(namespace = %req.get_ref().namespace, snapshot = %req.get_ref().id))]
    async fn get_snapshot(
        &self,
        req: Request<pb::SnapshotRef>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        let q = req.get_ref();
        let r = self
            .core
            .get_snapshot(&q.namespace, snapshot_id(q)?, &q.expected_uid)?;
        self.answer(&r)
    }

    #[tracing::instrument(name = "snapshot.ListSnapshots", skip_all, fields(namespace = %req.get_ref().namespace))]
    async fn list_snapshots(
        &self,
        req: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let q = req.into_inner();
        let filter = SnapshotFilter {
            namespace: q.namespace,
            source_sandbox: q.source_sandbox,
            display_name: q.display_name,
            phases: q
                .phases
                .into_iter()
                .map(model::phase_in)
                .collect::<Result<_, _>>()?,
        };
        let (items, next_page_token) =
            self.core
                .list_snapshots(&filter, page_size(q.page_size)?, &q.page_token)?;
        Ok(Response::new(pb::ListSnapshotsResponse {
            items: items
                .into_iter()
                .map(|(r, users)| model::snapshot_out(&r, users))
                .collect(),
            next_page_token,
        }))
    }

    #[tracing::instrument(name = "snapshot.DeleteSnapshot", skip_all, fields(namespace = %req.get_ref().namespace, snapshot = %req.get_ref().id))]
    async fn delete_snapshot(
        &self,
        req: Request<pb::SnapshotRef>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        let q = req.get_ref();
        let r = self
            .core
            .delete_snapshot(&q.namespace, snapshot_id(q)?, &q.expected_uid)
            .await?;
        self.answer(&r)
    }
}
