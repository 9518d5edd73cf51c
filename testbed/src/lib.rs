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

mod daemon;
mod error;
mod execd;
mod image;
mod packages;
mod registry;
mod sandbolt_image;
mod teardown;

pub use daemon::{DOCKER_NAMESPACE, Testbed};
pub use error::TestbedError;
pub use execd::{STATIC_TARGET, execd_binary};
pub use image::{
    BUSYBOX_REF, MT_OCI_INDEX, MT_OCI_MANIFEST, OciDocuments, OciImage, OciImageBuilder,
    busybox_image,
};
pub use packages::ensure_packages;
pub use registry::LocalRegistry;
pub use sandbolt_image::{
    SANDBOLT_IMAGE_BIN, SANDBOLT_IMAGE_EXECD, SANDBOLT_IMAGE_REF, sandbolt_image, static_binaries,
};
pub use teardown::{TESTBED_DIR_PREFIX, leftovers};

use std::path::{Path, PathBuf};
use std::process::Command;

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
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .map_err(|e| TestbedError::Spawn {
            what: script.display().to_string(),
            source: e,
        })?;
    if !out.status.success() {
        return Err(TestbedError::Setup(format!(
            "{} failed ({}): {}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Ok(PathBuf::from(path))
}
