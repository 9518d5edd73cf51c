//! The SandboxTemplates of every namespace, as a watch-fed cache that
//! creates look templates up in (the Kubernetes store holds one).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kube::api::ListParams;
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use sandbolt_deploy::SandboxTemplate;

use crate::store::{StoreError, StoreResult};

/// Every SandboxTemplate the API server has, by namespace and name.
pub struct TemplateCatalog {
    /// `Err`: why this cluster offers none (no CRD, or no RBAC for it).
    cache: Result<reflector::Store<SandboxTemplate>, String>,
}

impl TemplateCatalog {
    /// Connects with `config`, starts the watch of SandboxTemplates in all
    /// namespaces and waits (up to `sync_timeout`) for its first full list.
    /// A cluster without the CRD or the permission gives a catalog that
    /// says so on every lookup, rather than no store at all.
    pub async fn start(config: kube::Config, sync_timeout: Duration) -> StoreResult<Self> {
        let client = Client::try_from(config).map_err(|e| StoreError::Backend(e.to_string()))?;
        let api: Api<SandboxTemplate> = Api::all(client);
        if let Some(why) = unavailable(&api).await {
            tracing::warn!("{why}; creates cannot name templates");
            return Ok(Self { cache: Err(why) });
        }
        let (cache, writer) = reflector::store();
        let events = reflector::reflector(
            writer,
            watcher(api, watcher::Config::default()).default_backoff(),
        );
        tokio::spawn(async move {
            let mut events = std::pin::pin!(events);
            while let Some(ev) = events.next().await {
                if let Err(e) = ev {
                    tracing::warn!(error = %e, "sandboxtemplates watch failed; retrying");
                }
            }
        });
        tokio::time::timeout(sync_timeout, cache.wait_until_ready())
            .await
            .map_err(|_| {
                StoreError::Unavailable(format!(
                    "no full list of sandboxtemplates from the API server within {sync_timeout:?}"
                ))
            })?
            .map_err(|e| StoreError::Backend(e.to_string()))?;
        tracing::info!(templates = cache.len(), "sandboxtemplates synced");
        Ok(Self { cache: Ok(cache) })
    }

    /// The template of `namespace` that `image` names: by name, else by
    /// `spec.indexKey`. `Err`: the cluster has no templates, and why.
    pub fn find(
        &self,
        namespace: &str,
        image: &str,
    ) -> Result<Option<Arc<SandboxTemplate>>, String> {
        let cache = self.cache.as_ref().map_err(Clone::clone)?;
        if let Some(t) = cache.get(&ObjectRef::new(image).within(namespace)) {
            return Ok(Some(t));
        }
        Ok(cache
            .state()
            .into_iter()
            .find(|t| t.namespace().as_deref() == Some(namespace) && t.is_named(image)))
    }
}

/// Why SandboxTemplates cannot be listed at all, if they cannot: the CRD
/// is missing (404) or the controller may not read them (403). An operator
/// has to act on either; anything else is the watch's to retry.
pub(crate) async fn unavailable(api: &Api<SandboxTemplate>) -> Option<String> {
    match api.list(&ListParams::default().limit(1)).await {
        Err(kube::Error::Api(s)) if s.code == 404 || s.code == 403 => Some(format!(
            "SandboxTemplate resources are not available ({} {}): apply \
             deploy/crds/sandboxtemplates.sandbox.fast.io.yaml and let the controller \
             read them, then restart the controller",
            s.code, s.message
        )),
        Err(e) => {
            tracing::warn!(error = %e, "probing sandboxtemplates failed");
            None
        }
        Ok(_) => None,
    }
}
