//! Controller backend, warm pools: each `/pools` route is one call of the
//! controller's `sandbolt.control.v1.WarmPoolService`, and each refusal
//! gets its REST meaning here.

use axum::http::StatusCode;
use chrono::DateTime;
use sandbolt_proto::auth::BearerToken;
use sandbolt_proto::control::v1 as pb;
use tonic::Code;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::controller::{ControllerBackend, map_code, resource_list};
use crate::error::{ApiError, ApiResult};
use crate::model::rfc3339;
use crate::pools::{Pool, PoolCapacity, PoolCreate, PoolStatus, pool_not_found};

pub(crate) type WarmPoolClient =
    pb::warm_pool_service_client::WarmPoolServiceClient<InterceptedService<Channel, BearerToken>>;

/// The controller's names of pool fields and the REST names of the same
/// fields, so a refusal the controller words still names what the client
/// sent (the REST request carries the template as a pod spec).
const FIELD_NAMES: [(&str, &str); 9] = [
    ("template.image", "template.spec.containers[0].image"),
    ("template.runtime", "template.spec.runtimeClassName"),
    (
        "template.limits",
        "template.spec.containers[0].resources.limits",
    ),
    ("template.env", "template.spec.containers[0].env"),
    ("capacity.", "capacitySpec."),
    ("buffer_min", "bufferMin"),
    ("buffer_max", "bufferMax"),
    ("pool_min", "poolMin"),
    ("pool_max", "poolMax"),
];

fn rest_field_names(msg: &str) -> String {
    FIELD_NAMES
        .iter()
        .fold(msg.to_string(), |m, (native, rest)| m.replace(native, rest))
}

/// A refused pool call in REST terms; `name` is the pool it named.
pub(crate) fn map_pool_status(name: &str, s: &tonic::Status) -> ApiError {
    let msg = s.message().to_string();
    match s.code() {
        Code::NotFound => pool_not_found(name),
        Code::AlreadyExists => ApiError::conflict(
            "POOL_ALREADY_EXISTS",
            format!("A pool named {name} already exists."),
        ),
        Code::InvalidArgument | Code::OutOfRange => {
            ApiError::invalid_code("INVALID_POOL", rest_field_names(&msg))
        }
        Code::Unimplemented => ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "NOT_SUPPORTED",
            format!(
                "Pool management is not supported by this controller (an older version?): {msg}"
            ),
        ),
        code => map_code(code, name, msg),
    }
}

fn to_pb_capacity(c: PoolCapacity) -> pb::WarmCapacity {
    pb::WarmCapacity {
        buffer_min: c.buffer_min,
        buffer_max: c.buffer_max,
        pool_min: c.pool_min,
        pool_max: c.pool_max,
    }
}

/// The native pool for a checked create. The agent pool comes from the
/// template's `sandbolt.io/agent-pool` annotation (empty = the default
/// one): a pod template's node selection has no meaning for sandbolt's
/// agents.
pub(crate) fn to_pb_pool(p: &PoolCreate) -> pb::WarmPool {
    let t = &p.template;
    pb::WarmPool {
        name: p.name.clone(),
        agent_pool: t.agent_pool.clone().unwrap_or_default(),
        template: Some(pb::WarmTemplate {
            image: t.image.clone(),
            runtime: t.runtime.clone().unwrap_or_default(),
            limits: (!t.limits.is_empty()).then(|| resource_list(&t.limits)),
            env: t.env.clone().into_iter().collect(),
        }),
        capacity: Some(to_pb_capacity(p.capacity)),
        status: None,
        created_at_unix_ms: 0,
    }
}

/// The native pool as the REST API shows it.
pub(crate) fn to_pool(p: &pb::WarmPool) -> Pool {
    let c = p.capacity.unwrap_or_default();
    Pool {
        name: p.name.clone(),
        capacity_spec: PoolCapacity {
            buffer_max: c.buffer_max,
            buffer_min: c.buffer_min,
            pool_max: c.pool_max,
            pool_min: c.pool_min,
        },
        status: p.status.as_ref().map(|s| PoolStatus {
            total: s.total,
            allocated: s.allocated,
            available: s.available,
            revision: s.revision.clone(),
        }),
        created_at: (p.created_at_unix_ms > 0)
            .then(|| DateTime::from_timestamp_millis(p.created_at_unix_ms))
            .flatten()
            .map(rfc3339),
    }
}

impl ControllerBackend {
    pub(crate) async fn pool_create(&self, req: PoolCreate) -> ApiResult<Pool> {
        let r = pb::CreateWarmPoolRequest {
            pool: Some(to_pb_pool(&req)),
        };
        match self.pool_client().create_warm_pool(r).await {
            Ok(p) => Ok(to_pool(&p.into_inner())),
            Err(s) => Err(map_pool_status(&req.name, &s)),
        }
    }

    pub(crate) async fn pool_get(&self, name: &str) -> ApiResult<Pool> {
        let r = pb::WarmPoolRef { name: name.into() };
        match self.pool_client().get_warm_pool(r).await {
            Ok(p) => Ok(to_pool(&p.into_inner())),
            Err(s) => Err(map_pool_status(name, &s)),
        }
    }

    pub(crate) async fn pool_list(&self) -> ApiResult<Vec<Pool>> {
        match self
            .pool_client()
            .list_warm_pools(pb::ListWarmPoolsRequest {})
            .await
        {
            Ok(r) => Ok(r.into_inner().items.iter().map(to_pool).collect()),
            Err(s) => Err(map_pool_status("", &s)),
        }
    }

    pub(crate) async fn pool_update(&self, name: &str, capacity: PoolCapacity) -> ApiResult<Pool> {
        let r = pb::UpdateWarmPoolRequest {
            name: name.into(),
            capacity: Some(to_pb_capacity(capacity)),
        };
        match self.pool_client().update_warm_pool(r).await {
            Ok(p) => Ok(to_pool(&p.into_inner())),
            Err(s) => Err(map_pool_status(name, &s)),
        }
    }

    pub(crate) async fn pool_delete(&self, name: &str) -> ApiResult<()> {
        let r = pb::WarmPoolRef { name: name.into() };
        match self.pool_client().delete_warm_pool(r).await {
            Ok(_) => Ok(()),
            Err(s) => Err(map_pool_status(name, &s)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_checked_create_reaches_the_controller_whole() {
        let req = crate::pools::parse_create(&json!({
            "name": "py",
            "template": {"spec": {"runtimeClassName": "runc", "containers": [{
                "image": "python:3.12",
                "resources": {"limits": {"cpu": "1", "memory": "512Mi"}},
                "env": [{"name": "A", "value": "1"}]}]}},
            "capacitySpec": {"bufferMax": 4, "bufferMin": 2, "poolMax": 20, "poolMin": 1}
        }))
        .unwrap();
        let p = to_pb_pool(&req);
        assert_eq!(p.name, "py");
        assert_eq!(p.agent_pool, "");
        let t = p.template.unwrap();
        assert_eq!(
            (t.image.as_str(), t.runtime.as_str()),
            ("python:3.12", "runc")
        );
        let limits = t.limits.unwrap();
        assert_eq!(
            (limits.cpu.as_str(), limits.memory.as_str()),
            ("1", "512Mi")
        );
        assert_eq!(t.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(
            p.capacity,
            Some(pb::WarmCapacity {
                buffer_min: 2,
                buffer_max: 4,
                pool_min: 1,
                pool_max: 20
            })
        );
        // No limits in the template: none sent (the agent pool's apply).
        let req = crate::pools::parse_create(&json!({
            "name": "b", "template": {"spec": {"containers": [{"image": "busybox"}]}},
            "capacitySpec": {"bufferMax": 0, "bufferMin": 0, "poolMax": 0, "poolMin": 0}
        }))
        .unwrap();
        assert_eq!(to_pb_pool(&req).template.unwrap().limits, None);
    }

    #[test]
    fn the_answer_carries_status_and_creation_time() {
        let p = pb::WarmPool {
            name: "py".into(),
            capacity: Some(pb::WarmCapacity {
                buffer_min: 1,
                buffer_max: 2,
                pool_min: 0,
                pool_max: 5,
            }),
            status: Some(pb::WarmPoolStatus {
                total: 4,
                allocated: 3,
                available: 1,
                starting: 1,
                revision: "r7".into(),
                agents: 2,
            }),
            created_at_unix_ms: 1_700_000_000_000,
            ..Default::default()
        };
        assert_eq!(
            serde_json::to_value(to_pool(&p)).unwrap(),
            json!({
                "name": "py",
                "capacitySpec": {"bufferMax": 2, "bufferMin": 1, "poolMax": 5, "poolMin": 0},
                "status": {"total": 4, "allocated": 3, "available": 1, "revision": "r7"},
                "createdAt": "2023-11-14T22:13:20.000000Z"
            })
        );
        let bare = to_pool(&pb::WarmPool {
            name: "x".into(),
            ..Default::default()
        });
        assert_eq!((bare.status, bare.created_at), (None, None));
    }

    #[test]
    fn a_sandbox_of_a_warm_pool_says_so() {
        let mut s = pb::Sandbox {
            name: "sb-1".into(),
            spec: Some(pb::SandboxSpec {
                image: "busybox".into(),
                warm_pool: "py".into(),
                ..Default::default()
            }),
            status: Some(pb::SandboxStatus {
                phase: pb::Phase::Running as i32,
                claimed_warm: true,
                created_at_unix_ms: 1_000,
                ..Default::default()
            }),
            ..Default::default()
        };
        let rec = crate::controller::to_record(&s);
        let v = serde_json::to_value(rec.to_sandbox()).unwrap();
        assert_eq!(
            v["allocation"],
            json!({"mode": "pool", "poolRef": "py", "state": "allocated"})
        );
        assert_eq!(v["extensions"], json!({"sandbolt.claimedWarm": "true"}));
        let v = serde_json::to_value(rec.to_create_response()).unwrap();
        assert_eq!(v["extensions"], json!({"sandbolt.claimedWarm": "true"}));
        // Created cold within the pool: still allocated from it.
        s.status.as_mut().unwrap().claimed_warm = false;
        let v = serde_json::to_value(crate::controller::to_record(&s).to_sandbox()).unwrap();
        assert_eq!(v["allocation"]["poolRef"], "py");
        assert_eq!(v["extensions"], json!({"sandbolt.claimedWarm": "false"}));
        // No warm pool: neither field.
        s.spec.as_mut().unwrap().warm_pool.clear();
        let v = serde_json::to_value(crate::controller::to_record(&s).to_sandbox()).unwrap();
        assert!(
            v.get("allocation").is_none() && v.get("extensions").is_none(),
            "{v}"
        );
    }

    #[test]
    fn refusals_map_to_http() {
        let e = map_pool_status("py", &tonic::Status::not_found("warm pool py"));
        assert_eq!(
            (e.status, e.code),
            (StatusCode::NOT_FOUND, "POOL_NOT_FOUND")
        );
        let e = map_pool_status("py", &tonic::Status::already_exists("py"));
        assert_eq!(
            (e.status, e.code),
            (StatusCode::CONFLICT, "POOL_ALREADY_EXISTS")
        );
        let e = map_pool_status(
            "py",
            &tonic::Status::invalid_argument(
                "capacity.buffer_min (3) is above capacity.buffer_max (2)",
            ),
        );
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            e.message,
            "capacitySpec.bufferMin (3) is above capacitySpec.bufferMax (2)"
        );
        let e = map_pool_status(
            "py",
            &tonic::Status::invalid_argument("template.limits.memory: 64Ti is above 8Gi"),
        );
        assert!(
            e.message
                .starts_with("template.spec.containers[0].resources.limits.memory"),
            "{}",
            e.message
        );
        let e = map_pool_status("py", &tonic::Status::unavailable("down"));
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        let e = map_pool_status("py", &tonic::Status::unimplemented("WarmPoolService"));
        assert_eq!(e.status, StatusCode::NOT_IMPLEMENTED);
    }
}
