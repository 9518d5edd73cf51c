//! Test support for sandbolt: real daemons in private directories.
//!
//! Every sandbolt component that touches a container runtime is tested
//! against the real thing. [`Testbed`] starts a private `containerd` (with
//! runc) — and, on request, a private `dockerd` on top of it — each with
//! its own root, state and unix sockets under one temporary directory, so
//! that any number of test beds can run side by side in one process. Drop
//! tears everything down: tasks and shims, daemons, mounts, the directory.
//!
//! No registry is reachable from the machines sandbolt is tested on, so
//! images are built locally ([`OciImage`], [`busybox_image`]) and imported,
//! or served by a [`LocalRegistry`] on loopback for tests of the pull path.

mod bare_containerd;
mod daemon;
mod error;
mod execd;
mod image;
mod juicefs;
mod packages;
mod registry;
mod sandbolt_image;
mod teardown;

pub use bare_containerd::BareContainerd;
pub use daemon::{DOCKER_NAMESPACE, Testbed};
pub use error::TestbedError;
pub use execd::{STATIC_TARGET, execd_binary};
pub use image::{
    BUSYBOX_REF, MT_OCI_INDEX, MT_OCI_MANIFEST, OciDocuments, OciImage, OciImageBuilder,
    busybox_image,
};
pub use juicefs::{JuiceFs, juicefs_binary};
pub use packages::ensure_packages;
pub use registry::LocalRegistry;
pub use sandbolt_image::{
    SANDBOLT_IMAGE_BIN, SANDBOLT_IMAGE_EXECD, SANDBOLT_IMAGE_REF, sandbolt_image, static_binaries,
};
pub use teardown::{TESTBED_DIR_PREFIX, leftovers};

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use daemon::run;

/// Root of the sandbolt workspace (this crate lives one level below it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testbed crate lives inside the workspace")
        .to_path_buf()
}

/// The Python interpreter of the repository's venv (`.venv/`), with the real
/// clients the contract tests drive (the `opensandbox` SDK, grpcio-tools).
///
/// Runs `scripts/python-env.sh`, which creates or refreshes the venv.
pub fn python() -> Result<PathBuf, TestbedError> {
    let script = workspace_root().join("scripts/python-env.sh");
    let stdout = run(Command::new("bash").arg(&script))?;
    Ok(PathBuf::from(stdout.trim()))
}

/// The `opensandbox-server` 1.1.1 executable, in its own venv
/// (`target/opensandbox-server-venv`; its `python` sits beside it with the
/// server's `kubernetes` client). Runs `benches/python/server-env.sh` once
/// per process, which creates or refreshes the venv from PyPI: a separate
/// venv because the server needs grpcio/protobuf versions the pinned
/// contract clients of `.venv/` cannot share.
pub fn opensandbox_server() -> Result<PathBuf, TestbedError> {
    static SERVER: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    made_once(&SERVER, || {
        let script = workspace_root().join("benches/python/server-env.sh");
        let stdout = run(Command::new("bash").arg(&script))?;
        Ok(PathBuf::from(stdout.trim()))
    })
}

/// What `make` returns, made once per process and kept in `cell`: the test
/// binaries and images are expensive to build and every test asks for them.
/// A failure is kept too (as its message), so it is not retried per test.
pub(crate) fn made_once<T: Clone>(
    cell: &'static OnceLock<Result<T, String>>,
    make: impl FnOnce() -> Result<T, TestbedError>,
) -> Result<T, TestbedError> {
    cell.get_or_init(|| make().map_err(|e| e.to_string()))
        .clone()
        .map_err(TestbedError::Setup)
}

/// The file environment variable `var` names, when it is set: a prebuilt
/// binary that spares the build. Set to a missing file is an error, not a
/// silent rebuild.
pub(crate) fn file_named_by_env(var: &str) -> Result<Option<PathBuf>, TestbedError> {
    let Some(path) = std::env::var_os(var).map(PathBuf::from) else {
        return Ok(None);
    };
    if !path.is_file() {
        return Err(TestbedError::Setup(format!(
            "{var}={} does not exist",
            path.display()
        )));
    }
    Ok(Some(path))
}
