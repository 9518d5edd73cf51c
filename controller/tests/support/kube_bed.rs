//! A controller over the Kubernetes store on the API double, one stand-in
//! agent and a FastPath v2 client: the bed of the tests that drive FastPath
//! the way the OpenSandbox server does and read the Sandbox resource back.

use std::sync::Arc;
use std::time::Duration;

use kube::api::Api;
use sandbolt_controller::store::kube::{KubeStore, KubeStoreConfig};
use sandbolt_controller::{Controller, ControllerConfig, ControllerHandle};
use sandbolt_deploy::Sandbox;
use sandbolt_kube_double::ApiDouble;
use sandbolt_proto::fastpath::v2;
use tonic::transport::Channel;

use super::standin::StandInAgent;
use super::{HB, standin_config};

pub type V2 = v2::fast_path_service_client::FastPathServiceClient<Channel>;

pub struct KubeBed {
    pub api: ApiDouble,
    pub controller: ControllerHandle,
    pub agent: StandInAgent,
    pub v2: V2,
    /// The Sandbox resources of the namespace the tests create in.
    pub sandboxes: Api<Sandbox>,
    /// The controller's data directory, removed with the bed.
    _dir: tempfile::TempDir,
}

/// Starts the bed: the store's status is published every 100 ms, and
/// `adjust` changes the store's and the controller's configuration before
/// either starts. `namespace` is where [`KubeBed::sandboxes`] looks.
pub async fn start(
    namespace: &str,
    adjust: impl FnOnce(&mut KubeStoreConfig, &mut ControllerConfig),
) -> KubeBed {
    let api = ApiDouble::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = KubeStoreConfig::new("sandbolt-system");
    cfg.write_timeout = Duration::from_secs(5);
    cfg.status_period = Duration::from_millis(100);
    let mut config = standin_config(dir.path());
    adjust(&mut cfg, &mut config);
    let store = open_store(&api, cfg).await;
    let controller = Controller::start_with_store(config, Arc::new(store))
        .await
        .unwrap();
    let agent = StandInAgent::start(
        "a1",
        "default",
        8,
        &["busybox"],
        controller.local_addr(),
        HB,
    )
    .await;
    let v2 = V2::connect(format!("http://{}", controller.local_addr()))
        .await
        .unwrap();
    let sandboxes = Api::namespaced(api.client(), namespace);
    KubeBed {
        api,
        controller,
        agent,
        v2,
        sandboxes,
        _dir: dir,
    }
}

async fn open_store(api: &ApiDouble, cfg: KubeStoreConfig) -> KubeStore {
    let kube_config = api.config();
    tokio::task::spawn_blocking(move || KubeStore::open(kube_config, cfg))
        .await
        .unwrap()
        .expect("kube store opens on the double")
}
