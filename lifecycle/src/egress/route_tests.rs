//! The policy routes through the real router and auth middleware, over an
//! in-memory backend: routing on both mounts, bodies, merging, and which
//! credential opens which route.

use std::collections::BTreeMap;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use reqwest::{Method, StatusCode};
use sandbolt_proto::egress::NetworkPolicy;
use serde_json::{Value, json};

use super::{EGRESS_TOKEN_HEADER, ENFORCEMENT_DNS_NFT, PolicyChange, PolicyStatus, egress_token};
use crate::api::API_KEY_HEADER;
use crate::backend::{Backend, Route};
use crate::error::{ApiError, ApiResult};
use crate::model::{SandboxRecord, State};
use crate::validate::{CreatePlan, Extensions};
use crate::volumes::VolumeMount;
use crate::{BackendConfig, ControllerConfig, Lifecycle, LifecycleConfig, LifecycleHandle};

const KEY: &str = "route-test-key";
const ID: &str = "sbx-1";

/// One sandbox, `sbx-1`, and its policy; every other id is unknown.
#[derive(Default)]
struct Memory {
    policy: Mutex<NetworkPolicy>,
}

fn unused() -> ApiError {
    ApiError::internal("not used by these tests")
}

impl Memory {
    fn known(&self, id: &str) -> ApiResult<()> {
        if id == ID {
            Ok(())
        } else {
            Err(ApiError::not_found(id))
        }
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
        self.known(id)?;
        Ok(SandboxRecord {
            id: id.into(),
            image: Some("busybox".into()),
            entrypoint: vec!["sleep".into()],
            metadata: BTreeMap::new(),
            state: State::Running,
            reason: None,
            message: None,
            created_at: DateTime::from_timestamp(1, 0).unwrap(),
            expires_at: None,
            last_transition_at: None,
            allocation: None,
            snapshot_id: None,
        })
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
    async fn network_policy(&self, id: &str) -> ApiResult<PolicyStatus> {
        self.known(id)?;
        Ok(PolicyStatus {
            policy: self.policy.lock().unwrap().clone(),
            enforcement_mode: ENFORCEMENT_DNS_NFT,
        })
    }
    async fn change_network_policy(
        &self,
        id: &str,
        change: PolicyChange,
    ) -> ApiResult<PolicyStatus> {
        self.known(id)?;
        let mut policy = self.policy.lock().unwrap();
        *policy = change.apply(&policy)?;
        Ok(PolicyStatus {
            policy: policy.clone(),
            enforcement_mode: ENFORCEMENT_DNS_NFT,
        })
    }
    async fn route(&self, id: &str, port: u16) -> ApiResult<Route> {
        self.known(id)?;
        Ok(Route {
            authority: "192.0.2.1:1".into(),
            path_prefix: format!("/{id}/{port}"),
            headers: BTreeMap::new(),
        })
    }
}

async fn serve(data: &std::path::Path) -> LifecycleHandle {
    let backend = BackendConfig::Controller(ControllerConfig::new("http://unused.invalid"));
    let mut config = LifecycleConfig::new("127.0.0.1:0".parse().unwrap(), backend, data);
    config.api_key = Some(KEY.into());
    Lifecycle::start_with(config, Memory::default())
        .await
        .expect("lifecycle starts")
}

/// One call with the given headers: status and JSON body.
async fn call(
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut rb = reqwest::Client::new().request(method, url);
    for (k, v) in headers {
        rb = rb.header(*k, *v);
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

#[tokio::test]
async fn networkpolicy_routes_get_put_patch_delete_on_both_mounts() {
    let data = tempfile::tempdir().unwrap();
    let server = serve(data.path()).await;
    let key = [(API_KEY_HEADER, KEY)];
    for mount in ["", "/v1"] {
        let url = format!(
            "http://{}{mount}/sandboxes/{ID}/networkpolicy",
            server.addr()
        );
        let (s, b) = call(Method::PUT, &url, &key, Some(json!({}))).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        let (s, b) = call(Method::GET, &url, &key, None).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        assert_eq!(
            b,
            json!({"status": "ok", "mode": "allow_all", "enforcementMode": "dns+nft",
                   "policy": {"defaultAction": "allow", "egress": []}})
        );
        let put = json!({"defaultAction": "deny", "egress": [
            {"action": "allow", "target": "a.test"}, {"action": "allow", "target": "203.0.113.0/24"}]});
        let (s, b) = call(Method::PUT, &url, &key, Some(put)).await;
        assert_eq!(
            (s, b["mode"].as_str()),
            (StatusCode::OK, Some("rules")),
            "{b}"
        );
        let patch = json!([{"action": "deny", "target": "A.test"}, {"action": "allow", "target": "*.b.test"}]);
        let (s, b) = call(Method::PATCH, &url, &key, Some(patch)).await;
        assert_eq!(s, StatusCode::OK, "{b}");
        assert_eq!(
            b["policy"],
            json!({"defaultAction": "deny", "egress": [
                {"action": "deny", "target": "a.test"},
                {"action": "allow", "target": "203.0.113.0/24"},
                {"action": "allow", "target": "*.b.test"}]})
        );
        let (s, b) = call(
            Method::DELETE,
            &url,
            &key,
            Some(json!(["a.test", "gone.test"])),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{b}");
        assert_eq!(b["policy"]["egress"].as_array().unwrap().len(), 2, "{b}");
        // What a GET reads is what the mutation answered.
        let (_, again) = call(Method::GET, &url, &key, None).await;
        assert_eq!(again, b);
    }
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn networkpolicy_routes_refuse_bad_bodies_and_unknown_sandboxes() {
    let data = tempfile::tempdir().unwrap();
    let server = serve(data.path()).await;
    let key = [(API_KEY_HEADER, KEY)];
    let url = format!("http://{}/v1/sandboxes/{ID}/networkpolicy", server.addr());
    for (method, body, want) in [
        (
            Method::PUT,
            json!({"defaultAction": "sometimes"}),
            "networkPolicy.defaultAction",
        ),
        (Method::PUT, json!([]), "NetworkPolicy object"),
        (
            Method::PATCH,
            json!([{"action": "allow", "target": "x y"}]),
            "rules[0].target",
        ),
        (Method::PATCH, json!({"action": "allow"}), "list of rules"),
        (Method::DELETE, json!(["ok.test", 7]), "list of targets"),
    ] {
        let (s, b) = call(method.clone(), &url, &key, Some(body.clone())).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{method} {body}: {b}");
        assert!(
            b["message"].as_str().unwrap().contains(want),
            "{method} {body}: {b}"
        );
    }
    let (s, b) = call(Method::DELETE, &url, &key, None).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "{b}");
    let (s, _) = call(Method::POST, &url, &key, Some(json!({}))).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    let missing = format!("http://{}/v1/sandboxes/nope/networkpolicy", server.addr());
    let (s, b) = call(Method::GET, &missing, &key, None).await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{b}");
    let (s, _) = call(Method::PATCH, &missing, &key, Some(json!([]))).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, b) = call(Method::GET, &url, &[], None).await;
    assert_eq!(
        (s, b["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("MISSING_API_KEY"))
    );
    server.shutdown().await.unwrap();
}

#[tokio::test]
async fn the_egress_endpoint_serves_the_sidecar_api_on_its_own_token_only() {
    let data = tempfile::tempdir().unwrap();
    let server = serve(data.path()).await;
    let base = format!("http://{}", server.addr());
    let key = [(API_KEY_HEADER, KEY)];
    // What the SDK asks, in direct mode and in server-proxy mode alike.
    for query in ["", "?use_server_proxy=true"] {
        let (s, ep) = call(
            Method::GET,
            &format!("{base}/v1/sandboxes/{ID}/endpoints/18080{query}"),
            &key,
            None,
        )
        .await;
        assert_eq!(s, StatusCode::OK, "{ep}");
        assert_eq!(
            ep["endpoint"],
            json!(format!("{}/v1/sandboxes/{ID}/egress", server.addr()))
        );
        assert_eq!(
            ep["headers"],
            json!({EGRESS_TOKEN_HEADER: egress_token(KEY, ID)}),
            "{ep}"
        );
        assert!(!ep.to_string().contains(KEY), "the API key leaks: {ep}");
    }
    let (s, _) = call(
        Method::GET,
        &format!("{base}/sandboxes/nope/endpoints/18080"),
        &key,
        None,
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    let token = egress_token(KEY, ID);
    let with_token = [(EGRESS_TOKEN_HEADER, token.as_str())];
    let policy = format!("{base}/v1/sandboxes/{ID}/egress/policy");
    let (s, b) = call(Method::GET, &policy, &with_token, None).await;
    assert_eq!(
        (s, b["mode"].as_str()),
        (StatusCode::OK, Some("allow_all")),
        "{b}"
    );
    let (s, b) = call(
        Method::PATCH,
        &policy,
        &with_token,
        Some(json!([{"action": "deny", "target": "bad.test"}])),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{b}");
    assert_eq!(
        b["policy"],
        json!({"defaultAction": "allow", "egress": [{"action": "deny", "target": "bad.test"}]})
    );
    let (s, b) = call(
        Method::DELETE,
        &policy,
        &with_token,
        Some(json!(["bad.test"])),
    )
    .await;
    assert_eq!(
        (s, b["mode"].as_str()),
        (StatusCode::OK, Some("allow_all")),
        "{b}"
    );
    // The API key opens the route too (server-proxy mode sends it).
    let (s, _) = call(Method::GET, &policy, &key, None).await;
    assert_eq!(s, StatusCode::OK);
    // The sidecar API has no PUT.
    let (s, _) = call(Method::PUT, &policy, &with_token, Some(json!({}))).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);

    // The token opens that one route of that one sandbox, nothing else.
    for url in [
        format!("{base}/sandboxes/sbx-2/egress/policy"),
        format!("{base}/sandboxes/{ID}/networkpolicy"),
        format!("{base}/sandboxes/{ID}"),
        format!("{base}/sandboxes/{ID}/endpoints/44772"),
        format!("{base}/sandboxes/{ID}/proxy/44772/ping"),
        format!("{base}/sandboxes"),
    ] {
        let (s, b) = call(Method::GET, &url, &with_token, None).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{url}: {b}");
    }
    let (s, b) = call(
        Method::GET,
        &policy,
        &[(EGRESS_TOKEN_HEADER, "0".repeat(64).as_str())],
        None,
    )
    .await;
    assert_eq!(
        (s, b["code"].as_str()),
        (StatusCode::UNAUTHORIZED, Some("INVALID_EGRESS_TOKEN"))
    );
    let (s, _) = call(Method::GET, &policy, &[], None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    server.shutdown().await.unwrap();
}
