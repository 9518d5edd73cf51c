//! Shared set-up of the lifecycle integration tests: a private dockerd from
//! the test bed, the local busybox image, the static execd, and a lifecycle
//! server on the Docker backend. Anything missing fails the test loudly.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use sandbolt_lifecycle::{
    BackendConfig, DockerConfig, Lifecycle, LifecycleConfig, LifecycleHandle,
};
use sandbolt_testbed::Testbed;

pub const API_KEY: &str = "sandbolt-test-key-0123456789";

pub struct DockerEnv {
    pub bed: Testbed,
    pub image: String,
    pub execd: PathBuf,
    pub data: tempfile::TempDir,
    /// The only prefix host volumes may use.
    pub host_root: tempfile::TempDir,
}

pub fn docker_env() -> DockerEnv {
    let bed = Testbed::start_with_docker().expect("test bed with dockerd must start");
    let image = sandbolt_testbed::busybox_image().expect("busybox image builds");
    bed.docker_load(&image).expect("busybox loads into dockerd");
    let execd = sandbolt_testbed::execd_binary().expect("static execd builds");
    DockerEnv {
        image: image.reference().to_string(),
        bed,
        execd,
        data: tempfile::tempdir().unwrap(),
        host_root: tempfile::tempdir().unwrap(),
    }
}

impl DockerEnv {
    pub fn socket(&self) -> &Path {
        self.bed.docker_socket().expect("bed started with docker")
    }

    pub fn config(&self) -> LifecycleConfig {
        let docker = DockerConfig::new(self.socket(), &self.execd);
        let mut c = LifecycleConfig::new(
            "127.0.0.1:0".parse().unwrap(),
            BackendConfig::Docker(docker),
            self.data.path(),
        );
        c.api_key = Some(API_KEY.into());
        c.allow_host_paths = vec![self.host_root.path().to_path_buf()];
        c.sweep_interval = Duration::from_millis(500);
        c
    }

    pub async fn start(&self) -> LifecycleHandle {
        Lifecycle::start(self.config())
            .await
            .expect("lifecycle starts on the docker backend")
    }
}

/// Runs one pytest file of tests/python against a lifecycle server and
/// panics with pytest's output unless every test passed.
pub fn run_pytest(
    file: &str,
    addr: SocketAddr,
    image: &str,
    backend: &str,
    host_root: Option<&Path>,
) {
    run_pytest_env(file, addr, image, backend, host_root, &[]);
}

/// [`run_pytest`] with extra environment variables for the test file.
pub fn run_pytest_env(
    file: &str,
    addr: SocketAddr,
    image: &str,
    backend: &str,
    host_root: Option<&Path>,
    extra_env: &[(&str, &str)],
) {
    let python =
        sandbolt_testbed::python().expect("the repo's venv python (scripts/python-env.sh)");
    let path = sandbolt_testbed::workspace_root()
        .join("tests/python")
        .join(file);
    assert!(path.is_file(), "missing {}", path.display());
    let mut cmd = Command::new(python);
    cmd.args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "-x"])
        .arg(&path)
        .env("LIFECYCLE_DOMAIN", addr.to_string())
        .env("LIFECYCLE_API_KEY", API_KEY)
        .env("SANDBOLT_IMAGE", image)
        .env("SANDBOLT_BACKEND", backend);
    if let Some(h) = host_root {
        cmd.env("SANDBOLT_HOST_ROOT", h);
    }
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("pytest runs");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{text}");
    assert!(out.status.success(), "pytest {file} failed:\n{text}");
}
