//! Makes sure the Debian packages the test bed drives are installed.

use std::path::Path;
use std::process::Command;
use std::sync::Mutex;

use crate::TestbedError;

/// (binary that must exist, Debian package that provides it)
const REQUIRED: &[(&str, &str)] = &[
    ("/usr/bin/containerd", "containerd"),
    ("/usr/bin/ctr", "containerd"),
    ("/usr/sbin/runc", "runc"),
    ("/bin/busybox", "busybox-static"),
    ("/usr/sbin/ip", "iproute2"),
];

const DOCKER: &[(&str, &str)] = &[("/usr/sbin/dockerd", "docker.io")];

static INSTALL: Mutex<()> = Mutex::new(());

pub(crate) fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Checks for containerd, runc, busybox-static (and dockerd when `docker`),
/// installing what is missing with apt when running as root.
pub fn ensure_packages(docker: bool) -> Result<(), TestbedError> {
    let mut wanted: Vec<(&str, &str)> = REQUIRED.to_vec();
    if docker {
        wanted.extend_from_slice(DOCKER);
    }
    // One installer at a time: apt holds a lock and parallel tests would race.
    let _guard = INSTALL.lock().unwrap_or_else(|p| p.into_inner());
    let missing: Vec<(&str, &str)> = wanted
        .into_iter()
        .filter(|(bin, _)| !Path::new(bin).exists())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let mut packages: Vec<&str> = missing.iter().map(|(_, p)| *p).collect();
    packages.dedup();
    let binaries = missing
        .iter()
        .map(|(b, _)| *b)
        .collect::<Vec<_>>()
        .join(", ");
    if !is_root() {
        return Err(TestbedError::MissingPackage {
            binary: binaries,
            packages: packages.join(" "),
        });
    }
    tracing::info!(?packages, "installing missing Debian packages");
    let status = Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&packages)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status();
    let ok = matches!(status, Ok(s) if s.success());
    if !ok {
        // A fresh machine may have no package lists yet.
        let _ = Command::new("apt-get").args(["update", "-q"]).status();
        let status = Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&packages)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map_err(|e| TestbedError::Spawn {
                what: "apt-get".into(),
                source: e,
            })?;
        if !status.success() {
            return Err(TestbedError::MissingPackage {
                binary: binaries,
                packages: packages.join(" "),
            });
        }
    }
    Ok(())
}
