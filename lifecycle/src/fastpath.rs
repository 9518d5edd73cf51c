//! Fast-path backend: every route becomes a FastPath v2 call on the sandbolt
//! controller; endpoints come from `ResolveEndpoint`.
//!
//! FastPath v2's `SandboxInfo` carries identity and state but not the image,
//! entrypoint, creation time, expiry or metadata the REST API returns, so
//! those are kept in a small record per sandbox in the data dir (written at
//! create, updated on patch and renew). The controller stays authoritative
//! for existence, state, metadata filters and expiry enforcement.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use sandbolt_proto::fastpath::v2 as fp;
use serde::{Deserialize, Serialize};
use tonic::transport::Channel;

use crate::backend::{Backend, Route};
use crate::error::{ApiError, ApiResult, StartError};
use crate::model::{SandboxRecord, State};
use crate::validate::CreatePlan;
use crate::volumes::{VolumeMount, unsupported};

type Client = fp::fast_path_service_client::FastPathServiceClient<Channel>;

/// Fast-path backend settings.
#[derive(Debug, Clone)]
pub struct FastPathConfig {
    /// Controller gRPC address, e.g. `http://127.0.0.1:9090`.
    pub controller: String,
    /// FastPath namespace the sandboxes live in.
    pub namespace: String,
    /// Bearer token the controller requires on FastPath calls, if any.
    pub token: Option<String>,
}

impl FastPathConfig {
    pub fn new(controller: impl Into<String>) -> Self {
        Self {
            controller: controller.into(),
            namespace: "default".into(),
            token: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct LocalRecord {
    image: String,
    entrypoint: Vec<String>,
    created_at: DateTime<Utc>,
    expires_at: Option<DateTime<Utc>>,
    metadata: BTreeMap<String, String>,
}

pub struct FastPathBackend {
    client: Client,
    namespace: String,
    dir: PathBuf,
    auth: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

/// FastPath v2 errors are read by status code only (contracts README).
fn map_status(id: &str, s: tonic::Status) -> ApiError {
    use tonic::Code;
    let msg = s.message().to_string();
    match s.code() {
        Code::NotFound => ApiError::not_found(id),
        Code::InvalidArgument | Code::OutOfRange => ApiError::invalid(msg),
        Code::AlreadyExists | Code::Aborted | Code::FailedPrecondition => {
            ApiError::conflict("FASTPATH::CONFLICT", msg)
        }
        Code::ResourceExhausted => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "FASTPATH::RESOURCE_EXHAUSTED",
            msg,
        ),
        Code::Unavailable | Code::DeadlineExceeded => {
            ApiError::unavailable(format!("controller unavailable: {msg}"))
        }
        Code::Unimplemented => ApiError::not_implemented(&format!("This operation ({msg})")),
        _ => ApiError::internal(format!("controller error: {msg}")),
    }
}

fn state_of(info: &fp::SandboxInfo) -> State {
    use fp::RuntimeState as R;
    if info.state == fp::SandboxState::Paused as i32 {
        return State::Paused;
    }
    match R::try_from(info.runtime.as_ref().map_or(0, |r| r.state)).unwrap_or(R::Unknown) {
        R::Ready => State::Running,
        R::Pausing => State::Pausing,
        R::Paused => State::Paused,
        R::Resuming => State::Resuming,
        R::Stopping => State::Stopping,
        R::Stopped => State::Terminated,
        R::Failed | R::Unavailable => State::Failed,
        R::Unspecified | R::Unknown | R::Pending | R::Creating => {
            if info.ready {
                State::Running
            } else {
                State::Pending
            }
        }
    }
}

/// Splits `host:port/path` into authority and path prefix.
fn split_endpoint(ep: &str) -> (String, String) {
    let ep = ep
        .strip_prefix("http://")
        .or_else(|| ep.strip_prefix("https://"))
        .unwrap_or(ep);
    match ep.find('/') {
        Some(i) => (
            ep[..i].to_string(),
            ep[i..].trim_end_matches('/').to_string(),
        ),
        None => (ep.to_string(), String::new()),
    }
}

impl FastPathBackend {
    pub async fn connect(config: FastPathConfig, data_dir: &Path) -> Result<Self, StartError> {
        let client = Client::connect(config.controller.clone())
            .await
            .map_err(|e| StartError::Backend(format!("controller {}: {e}", config.controller)))?;
        let dir = data_dir.join("fastpath");
        std::fs::create_dir_all(&dir)
            .map_err(|e| StartError::Config(format!("data dir {}: {e}", dir.display())))?;
        let auth = config
            .token
            .filter(|t| !t.is_empty())
            .map(|t| {
                format!("Bearer {t}")
                    .parse()
                    .map_err(|_| StartError::Config("fastpath token is not valid ASCII".into()))
            })
            .transpose()?;
        Ok(Self {
            client,
            namespace: config.namespace,
            dir,
            auth,
        })
    }

    /// Wraps a message with the controller's bearer token.
    fn req<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Some(a) = &self.auth {
            r.metadata_mut().insert("authorization", a.clone());
        }
        r
    }

    fn reference(&self, id: &str) -> fp::SandboxReference {
        fp::SandboxReference {
            namespaced_name: Some(fp::NamespacedName {
                namespace: self.namespace.clone(),
                name: id.to_string(),
            }),
            expected_uid: String::new(),
        }
    }

    fn record_path(&self, id: &str) -> ApiResult<PathBuf> {
        // Ids become file names: refuse anything that is not a plain name.
        let ok = !id.is_empty()
            && id.len() <= 253
            && id
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
            && !id.starts_with('.');
        if !ok {
            return Err(ApiError::not_found(id));
        }
        Ok(self.dir.join(format!("{id}.json")))
    }

    fn load(&self, id: &str) -> Option<LocalRecord> {
        let bytes = std::fs::read(self.record_path(id).ok()?).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    fn store(&self, id: &str, rec: &LocalRecord) -> ApiResult<()> {
        let path = self.record_path(id)?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(rec).expect("record serializes"))
            .and_then(|_| std::fs::rename(&tmp, &path))
            .map_err(|e| ApiError::internal(format!("write {}: {e}", path.display())))
    }

    fn to_record(&self, id: &str, info: &fp::SandboxInfo) -> SandboxRecord {
        let local = self.load(id);
        SandboxRecord {
            id: id.to_string(),
            image: local.as_ref().map(|l| l.image.clone()),
            entrypoint: local
                .as_ref()
                .map(|l| l.entrypoint.clone())
                .unwrap_or_default(),
            metadata: local
                .as_ref()
                .map(|l| l.metadata.clone())
                .unwrap_or_default(),
            state: state_of(info),
            reason: None,
            message: None,
            created_at: local.as_ref().map_or_else(Utc::now, |l| l.created_at),
            expires_at: local.and_then(|l| l.expires_at),
        }
    }

    async fn info(&self, id: &str) -> ApiResult<fp::SandboxInfo> {
        self.record_path(id)?;
        let resp = self
            .client
            .clone()
            .get_sandbox(self.req(fp::GetSandboxRequest {
                sandbox: Some(self.reference(id)),
                expected_generation: 0,
            }))
            .await
            .map_err(|s| map_status(id, s))?
            .into_inner();
        resp.sandbox
            .ok_or_else(|| ApiError::internal("controller returned no sandbox"))
    }
}

impl Backend for FastPathBackend {
    fn runtime_name(&self) -> &'static str {
        "fastpath"
    }

    fn check_volume(&self, v: &VolumeMount) -> ApiResult<()> {
        // FastPath v2's CreateSandboxRequest has no volume fields.
        Err(unsupported(v.source.kind(), self.runtime_name()))
    }

    async fn create(&self, plan: CreatePlan) -> ApiResult<SandboxRecord> {
        let req = fp::CreateSandboxRequest {
            request_id: plan.id.clone(),
            namespace: self.namespace.clone(),
            image: plan.image.clone(),
            command: plan.entrypoint.clone(),
            envs: plan.env.clone().into_iter().collect(),
            expires_at_unix_seconds: plan.expires_at.map_or(0, |t| t.timestamp()),
            metadata: plan.metadata.clone().into_iter().collect(),
            completion: fp::CreateCompletion::Ready as i32,
            ..Default::default()
        };
        let resp = self
            .client
            .clone()
            .create_sandbox(self.req(req))
            .await
            .map_err(|s| map_status(&plan.id, s))?
            .into_inner();
        let info = resp.sandbox.unwrap_or_default();
        let id = info
            .identity
            .as_ref()
            .map(|i| i.name.clone())
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| plan.id.clone());
        self.store(
            &id,
            &LocalRecord {
                image: plan.image.clone(),
                entrypoint: plan.entrypoint.clone(),
                created_at: plan.created_at,
                expires_at: plan.expires_at,
                metadata: plan.metadata.clone(),
            },
        )?;
        let mut rec = self.to_record(&id, &info);
        // 202 means Running (contracts README); completion=READY asked for it.
        rec.state = State::Running;
        Ok(rec)
    }

    async fn get(&self, id: &str) -> ApiResult<SandboxRecord> {
        let info = self.info(id).await?;
        Ok(self.to_record(id, &info))
    }

    async fn list(&self) -> ApiResult<Vec<SandboxRecord>> {
        let mut names = Vec::new();
        let mut token = String::new();
        loop {
            let resp = self
                .client
                .clone()
                .list_sandboxes(self.req(fp::ListSandboxesRequest {
                    namespace: self.namespace.clone(),
                    metadata: Default::default(),
                    page_size: 500,
                    page_token: token,
                }))
                .await
                .map_err(|s| map_status("*", s))?
                .into_inner();
            names.extend(
                resp.items
                    .into_iter()
                    .filter_map(|s| s.identity.map(|i| i.name)),
            );
            if resp.next_page_token.is_empty() {
                break;
            }
            token = resp.next_page_token;
        }
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            match self.get(&name).await {
                Ok(r) => out.push(r),
                // Deleted between list and get.
                Err(e) if e.status == StatusCode::NOT_FOUND => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    async fn delete(&self, id: &str) -> ApiResult<()> {
        let path = self.record_path(id)?;
        self.client
            .clone()
            .delete_sandbox(self.req(fp::DeleteRequest {
                sandbox: Some(self.reference(id)),
            }))
            .await
            .map_err(|s| map_status(id, s))?;
        let _ = std::fs::remove_file(path);
        Ok(())
    }

    async fn patch_metadata(
        &self,
        id: &str,
        patch: BTreeMap<String, Option<String>>,
    ) -> ApiResult<SandboxRecord> {
        let upsert = patch
            .iter()
            .filter_map(|(k, v)| v.clone().map(|v| (k.clone(), v)))
            .collect();
        let delete = patch
            .iter()
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| k.clone())
            .collect();
        self.client
            .clone()
            .update_sandbox(self.req(fp::UpdateSandboxRequest {
                sandbox: Some(self.reference(id)),
                expected_generation: 0,
                update: None,
                metadata_upsert: upsert,
                metadata_delete_keys: delete,
            }))
            .await
            .map_err(|s| map_status(id, s))?;
        if let Some(mut local) = self.load(id) {
            for (k, v) in patch {
                match v {
                    Some(v) => local.metadata.insert(k, v),
                    None => local.metadata.remove(&k),
                };
            }
            self.store(id, &local)?;
        }
        self.get(id).await
    }

    async fn pause(&self, id: &str) -> ApiResult<()> {
        self.record_path(id)?;
        self.client
            .clone()
            .pause_sandbox(self.req(fp::PauseSandboxRequest {
                request_id: uuid::Uuid::new_v4().to_string(),
                sandbox: Some(self.reference(id)),
                expected_generation: 0,
            }))
            .await
            .map_err(|s| map_status(id, s))?;
        Ok(())
    }

    async fn resume(&self, id: &str) -> ApiResult<()> {
        self.record_path(id)?;
        self.client
            .clone()
            .resume_sandbox(self.req(fp::ResumeSandboxRequest {
                request_id: uuid::Uuid::new_v4().to_string(),
                sandbox: Some(self.reference(id)),
                expected_generation: 0,
                expected_checkpoint_id: String::new(),
            }))
            .await
            .map_err(|s| map_status(id, s))?;
        Ok(())
    }

    async fn set_expiry(&self, id: &str, at: DateTime<Utc>) -> ApiResult<()> {
        self.client
            .clone()
            .update_sandbox(self.req(fp::UpdateSandboxRequest {
                sandbox: Some(self.reference(id)),
                expected_generation: 0,
                update: Some(fp::update_sandbox_request::Update::ExpiresAtUnixSeconds(
                    at.timestamp(),
                )),
                metadata_upsert: Default::default(),
                metadata_delete_keys: Vec::new(),
            }))
            .await
            .map_err(|s| map_status(id, s))?;
        if let Some(mut local) = self.load(id) {
            local.expires_at = Some(at);
            self.store(id, &local)?;
        }
        Ok(())
    }

    async fn route(&self, id: &str, port: u16) -> ApiResult<Route> {
        self.record_path(id)?;
        let resp = self
            .client
            .clone()
            .resolve_endpoint(self.req(fp::ResolveEndpointRequest {
                sandbox: Some(self.reference(id)),
                target: Some(fp::EndpointTarget {
                    target: Some(fp::endpoint_target::Target::Port(port as u32)),
                }),
                access_mode: fp::EndpointAccessMode::CentralProxy as i32,
                expected_generation: 0,
            }))
            .await
            .map_err(|s| map_status(id, s))?
            .into_inner();
        if resp.proxy_endpoint.is_empty() {
            return Err(ApiError::internal("controller resolved no proxy endpoint"));
        }
        let (authority, path_prefix) = split_endpoint(&resp.proxy_endpoint);
        Ok(Route {
            authority,
            path_prefix,
            headers: resp.required_headers.into_iter().collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_split() {
        assert_eq!(
            split_endpoint("127.0.0.1:8081/sandboxes/x/44772"),
            ("127.0.0.1:8081".into(), "/sandboxes/x/44772".into())
        );
        assert_eq!(split_endpoint("http://h:1"), ("h:1".into(), String::new()));
    }

    #[test]
    fn states() {
        let mut info = fp::SandboxInfo {
            runtime: Some(fp::RuntimeInfo {
                state: fp::RuntimeState::Ready as i32,
            }),
            ..Default::default()
        };
        assert_eq!(state_of(&info), State::Running);
        info.state = fp::SandboxState::Paused as i32;
        assert_eq!(state_of(&info), State::Paused);
    }
}
