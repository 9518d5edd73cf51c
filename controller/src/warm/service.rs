//! `sandbolt.control.v1.WarmPoolService`: create, read, resize and delete
//! warm pools. The store is the record; the in-memory table follows each
//! write at once. Errors: INVALID_ARGUMENT naming the field, ALREADY_EXISTS,
//! NOT_FOUND, ABORTED (a concurrent resize: read again and retry).

use std::sync::Arc;

use sandbolt_proto::control::v1 as pb;
use sandbolt_proto::control::v1::warm_pool_service_server::WarmPoolService;
use tonic::{Request, Response, Status};

use super::model;
use crate::error::Error;
use crate::sandbox::Core;
use crate::store::{StoreError, WarmPoolRecord};

pub struct WarmPoolServer {
    core: Arc<Core>,
}

impl WarmPoolServer {
    pub fn new(core: Arc<Core>) -> Self {
        Self { core }
    }

    fn out(&self, p: &WarmPoolRecord) -> pb::WarmPool {
        model::pool_out(p, self.core.warm_status(p))
    }

    /// The stored pool, or NOT_FOUND.
    fn stored(&self, name: &str) -> Result<WarmPoolRecord, Status> {
        self.core
            .store()
            .get_warm_pool(name)
            .map_err(Error::from)?
            .ok_or_else(|| Error::from(StoreError::WarmPoolNotFound(name.to_string())).into())
    }
}

#[tonic::async_trait]
impl WarmPoolService for WarmPoolServer {
    #[tracing::instrument(name = "warm.CreateWarmPool", skip_all, fields(pool))]
    async fn create_warm_pool(
        &self,
        req: Request<pb::CreateWarmPoolRequest>,
    ) -> Result<Response<pb::WarmPool>, Status> {
        let p = req
            .into_inner()
            .pool
            .ok_or_else(|| Status::invalid_argument("pool is required"))?;
        tracing::Span::current().record("pool", p.name.as_str());
        let agent_pool = crate::placement::or_default(p.agent_pool.trim());
        let key = self.core.registry().pool_key("", agent_pool);
        let policy = self.core.registry().pool_policy(&key);
        let record = model::new_pool(&p, policy.as_ref())?;
        let stored = self
            .core
            .store()
            .put_warm_pool(&record)
            .map_err(Error::from)?;
        tracing::info!(pool = %stored.name, agent_pool = %stored.agent_pool, image = %stored.image, "warm pool created");
        self.core.warm_pools().put(stored.clone());
        Ok(Response::new(self.out(&stored)))
    }

    #[tracing::instrument(name = "warm.GetWarmPool", skip_all, fields(pool = %req.get_ref().name))]
    async fn get_warm_pool(
        &self,
        req: Request<pb::WarmPoolRef>,
    ) -> Result<Response<pb::WarmPool>, Status> {
        let p = self.stored(&req.get_ref().name)?;
        Ok(Response::new(self.out(&p)))
    }

    #[tracing::instrument(name = "warm.ListWarmPools", skip_all)]
    async fn list_warm_pools(
        &self,
        _: Request<pb::ListWarmPoolsRequest>,
    ) -> Result<Response<pb::ListWarmPoolsResponse>, Status> {
        let mut pools = self.core.store().list_warm_pools().map_err(Error::from)?;
        pools.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Response::new(pb::ListWarmPoolsResponse {
            items: pools.iter().map(|p| self.out(p)).collect(),
        }))
    }

    #[tracing::instrument(name = "warm.UpdateWarmPool", skip_all, fields(pool = %req.get_ref().name))]
    async fn update_warm_pool(
        &self,
        req: Request<pb::UpdateWarmPoolRequest>,
    ) -> Result<Response<pb::WarmPool>, Status> {
        let q = req.into_inner();
        let cap = q
            .capacity
            .ok_or_else(|| Status::invalid_argument("capacity is required"))?;
        model::check_capacity(&cap)?;
        let mut p = self.stored(&q.name)?;
        if model::capacity_of(&p) != cap {
            p.buffer_min = cap.buffer_min;
            p.buffer_max = cap.buffer_max;
            p.pool_min = cap.pool_min;
            p.pool_max = cap.pool_max;
            p.generation += 1;
            // The revision read above: a concurrent resize is ABORTED.
            p = self.core.store().put_warm_pool(&p).map_err(Error::from)?;
            tracing::info!(pool = %p.name, ?cap, "warm pool resized");
        }
        self.core.warm_pools().put(p.clone());
        Ok(Response::new(self.out(&p)))
    }

    #[tracing::instrument(name = "warm.DeleteWarmPool", skip_all, fields(pool = %req.get_ref().name))]
    async fn delete_warm_pool(
        &self,
        req: Request<pb::WarmPoolRef>,
    ) -> Result<Response<pb::WarmPool>, Status> {
        let name = &req.get_ref().name;
        let p = self
            .core
            .store()
            .delete_warm_pool(name)
            .map_err(Error::from)?
            .ok_or_else(|| Error::from(StoreError::WarmPoolNotFound(name.clone())))?;
        // The agents drain its buffers at their next heartbeat answer.
        self.core.warm_pools().remove(name);
        tracing::info!(pool = %p.name, "warm pool deleted");
        Ok(Response::new(self.out(&p)))
    }
}
