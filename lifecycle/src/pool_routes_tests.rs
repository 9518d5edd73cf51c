//! The pool routes through the real router and auth middleware, over an
//! in-memory backend that keeps pools (and one that has none, as Docker):
//! both mounts, statuses, bodies, and the 501 of a runtime without pools.

use std::collections::BTreeMap;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use reqwest::{Method, StatusCode};
use sandbolt_proto::egress::NetworkPolicy;
use serde_json::{Value, json};

use crate::api::API_KEY_HEADER;
use crate::backend::{Backend, Route};
use crate::egress::{PolicyChange, PolicyStatus};
use crate::error::{ApiError, ApiResult};
use crate::model::SandboxRecord;
use crate::pools::{Pool, PoolCapacity, PoolCreate, PoolStatus, pool_not_found};
use crate::validate::{CreatePlan, Extensions};
use crate::volumes::VolumeMount;
use crate::{BackendConfig, ControllerConfig, Lifecycle, LifecycleConfig, LifecycleHandle};

const KEY: &str = "pool-route-test-key";

/// Pools in a map; `without_pools` answers like the Docker runtime.
#[derive(Default)]
struct Memory {
    pools: Mutex<BTreeMap<String, (PoolCreate, PoolCapacity)>>,
    without_pools: bool,
}

fn unused() -> ApiError {
    ApiError::internal("not used by these tests")
}

fn answer(p: &PoolCreate, capacity: PoolCapacity) -> Pool {
    Pool {
        name: p.name.clone(),
        capacity_spec: capacity,
        status: Some(PoolStatus {
            total: 0,
            allocated: 0,
            available: 0,
            revision: format!("{}-{}", p.template.image, capacity.pool_max),
        }),
        created_at: None,
    }
}

impl Backend for Memory {
    fn runtime_name(&self) -> &'static str {
        "memory"
    }
    fn check_volume(&self, _: &VolumeMount) -> ApiResult<()> {
        Ok(())
    }
    fn check_extensions(&self, _: &Extensions) -> ApiResult<()> {
        Ok(())
    }
    fn check_network_policy(&self, _: &NetworkPolicy) -> ApiResult<()> {
        Ok(())
    }
    fn expires_sandboxes_itself(&self) -> bool {
        true
    }
    async fn create(&self, _: CreatePlan) -> ApiResult<SandboxRecord> {
        Err(unused())
    }
    async fn get(&self, id: &str) -> ApiResult<SandboxRecord> {
        Err(ApiError::not_found(id))
    }
    async fn list(&self) -> ApiResult<Vec<SandboxRecord>> {
        Ok(Vec::new())
    }
    async fn delete(&self, _: &str) -> ApiResult<()> {
        Err(unused())
    }
    async fn patch_metadata(
        &self,
        _: &str,
        _: BTreeMap<String, Option<String>>,
    ) -> ApiResult<SandboxRecord> {
        Err(unused())
    }
    async fn pause(&self, _: &str) -> ApiResult<()> {
        Err(unused())
    }
    async fn resume(&self, _: &str) -> ApiResult<()> {
        Err(unused())
    }
    async fn set_expiry(&self, _: &str, _: DateTime<Utc>) -> ApiResult<DateTime<Utc>> {
        Err(unused())
    }
    async fn network_policy(&self, _: &str) -> ApiResult<PolicyStatus> {
        Err(unused())
    }
    async fn change_network_policy(&self, _: &str, _: PolicyChange) -> ApiResult<PolicyStatus> {
        Err(unused())
    }
    async fn route(&self, _: &str, _: u16) -> ApiResult<Route> {
        Err(unused())
    }
    fn pools_unsupported(&self) -> bool {
        self.without_pools
    }
    async fn create_pool(&self, p: PoolCreate) -> ApiResult<Pool> {
        let mut pools = self.pools.lock().unwrap();
        if pools.contains_key(&p.name) {
            return Err(ApiError::conflict("POOL_ALREADY_EXISTS", "taken"));
        }
        let a = answer(&p, p.capacity);
        pools.insert(p.name.clone(), (p.clone(), p.capacity));
        Ok(a)
    }
    async fn get_pool(&self, name: &str) -> ApiResult<Pool> {
        let pools = self.pools.lock().unwrap();
        let (p, c) = pools.get(name).ok_or_else(|| pool_not_found(name))?;
        Ok(answer(p, *c))
    }
    async fn list_pools(&self) -> ApiResult<Vec<Pool>> {
        let pools = self.pools.lock().unwrap();
        Ok(pools.values().map(|(p, c)| answer(p, *c)).collect())
    }
    async fn update_pool(&self, name: &str, capacity: PoolCapacity) -> ApiResult<Pool> {
        let mut pools = self.pools.lock().unwrap();
        let (p, c) = pools.get_mut(name).ok_or_else(|| pool_not_found(name))?;
        *c = capacity;
        Ok(answer(p, capacity))
    }
    async fn delete_pool(&self, name: &str) -> ApiResult<()> {
        let mut pools = self.pools.lock().unwrap();
        pools
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| pool_not_found(name))
    }
}

async fn serve(data: &std::path::Path, backend: Memory) -> LifecycleHandle {
    let config = BackendConfig::Controller(ControllerConfig::new("http://unused.invalid"));
    let mut config = LifecycleConfig::new("127.0.0.1:0".parse().unwrap(), config, data);
    config.api_key = Some(KEY.into());
    Lifecycle::start_with(config, backend)
        .await
        .expect("lifecycle starts")
}

async fn call(method: Method, url: &str, key: bool, body: Option<Value>) -> (StatusCode, Value) {
    let mut rb = reqwest::Client::new().request(method, url);
    if key {
        rb = rb.header(API_KEY_HEADER, KEY);
    }
    if let Some(b) = body {
        rb = rb.json(&b);
    }
    let r = rb.send().await.expect("the server answers");
    let status = r.status();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn capacity(pool_max: i32) -> Value {
    json!({"bufferMax": 2, "bufferMin": 1, "poolMax": pool_max, "poolMin": 0})
}

fn create_body(name: &str) -> Value {
    json!({
        "name": name,
        "template": {"spec": {"containers": [{"name": "c", "image": "busybox"}]}},
        "capacitySpec": capacity(5),
    })
}

#[tokio::test]
async fn pool_crud_on_both_mounts() {
    let data = tempfile::tempdir().unwrap();
    let server = serve(data.path(), Memory::default()).await;
    for mount in ["", "/v1"] {
        let base = format!("http://{}{mount}/pools", server.addr());
        let (s, b) = call(Method::POST, &base, true, Some(create_body("py"))).await;
        assert_eq!(s, StatusCode::CREATED, "{b}");
        assert_eq!(b["name"], "py");
        assert_eq!(b["capacitySpec"], capacity(5));
        assert_eq!(b["status"]["revision"], "busybox-5");
        let (s, b) = call(Method::POST, &base, true, Some(create_body("py"))).await;
        assert_eq!(
            (s, &b["code"]),
            (StatusCode::CONFLICT, &json!("POOL_ALREADY_EXISTS"))
        );
        let (s, b) = call(Method::GET, &base, true, None).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        assert_eq!(b["items"].as_array().unwrap().len(), 1, "{b}");
        let one = format!("{base}/py");
        let (s, b) = call(
            Method::PUT,
            &one,
            true,
            Some(json!({"capacitySpec": capacity(9)})),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{b}");
        assert_eq!(b["capacitySpec"]["poolMax"], 9);
        let (s, b) = call(Method::GET, &one, true, None).await;
        assert_eq!(
            (s, &b["capacitySpec"]["poolMax"]),
            (StatusCode::OK, &json!(9))
        );
        let (s, _) = call(Method::DELETE, &one, true, None).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
        for method in [Method::GET, Method::DELETE] {
            let (s, b) = call(method, &one, true, None).await;
            assert_eq!(
                (s, &b["code"]),
                (StatusCode::NOT_FOUND, &json!("POOL_NOT_FOUND"))
            );
        }
        let (s, b) = call(
            Method::PUT,
            &one,
            true,
            Some(json!({"capacitySpec": capacity(9)})),
        )
        .await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{b}");
        // A name that cannot be a pool's: 404 without asking the backend.
        let (s, _) = call(Method::GET, &format!("{base}/Not_A_Pool"), true, None).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
    }
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn pool_requests_are_checked_and_authenticated() {
    let data = tempfile::tempdir().unwrap();
    let server = serve(data.path(), Memory::default()).await;
    let base = format!("http://{}/v1/pools", server.addr());
    let (s, b) = call(Method::GET, &base, false, None).await;
    assert_eq!(
        (s, &b["code"]),
        (StatusCode::UNAUTHORIZED, &json!("MISSING_API_KEY"))
    );
    let mut bad = create_body("py");
    bad["template"]["spec"]["containers"][0]["command"] = json!(["sh"]);
    let (s, b) = call(Method::POST, &base, true, Some(bad)).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    assert!(
        b["message"]
            .as_str()
            .unwrap()
            .contains("template.spec.containers[0].command"),
        "{b}"
    );
    let (s, b) = call(Method::POST, &base, true, Some(json!("not an object"))).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    let (s, b) = call(
        Method::PUT,
        &format!("{base}/py"),
        true,
        Some(json!({"capacitySpec": {"bufferMax": 5, "bufferMin": 0, "poolMax": 4, "poolMin": 0}})),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    assert!(
        b["message"]
            .as_str()
            .unwrap()
            .contains("capacitySpec.bufferMax"),
        "{b}"
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_runtime_without_pools_answers_501_on_every_route() {
    let data = tempfile::tempdir().unwrap();
    let backend = Memory {
        without_pools: true,
        ..Memory::default()
    };
    let server = serve(data.path(), backend).await;
    for mount in ["", "/v1"] {
        let base = format!("http://{}{mount}", server.addr());
        for (method, path, route) in [
            (Method::GET, "/pools", "GET /pools"),
            (Method::POST, "/pools", "POST /pools"),
            (Method::GET, "/pools/py", "GET /pools/{pool_name}"),
            (Method::PUT, "/pools/py", "PUT /pools/{pool_name}"),
            (Method::DELETE, "/pools/py", "DELETE /pools/{pool_name}"),
        ] {
            // Whatever the body: the route itself is what cannot be served.
            let (s, b) = call(method, &format!("{base}{path}"), true, Some(json!(42))).await;
            assert_eq!(s, StatusCode::NOT_IMPLEMENTED, "{route}: {b}");
            assert_eq!(b["code"], "NOT_SUPPORTED", "{route}");
            let msg = b["message"].as_str().unwrap();
            assert!(msg.starts_with(&format!("{route}:")), "{msg}");
            assert!(
                msg.contains("Pool management is not supported in this runtime (memory)"),
                "{msg}"
            );
        }
    }
    server.shutdown().await.unwrap();
}
