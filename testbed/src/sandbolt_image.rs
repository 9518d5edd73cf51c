//! sandbolt itself as a container image, built from scratch: the static
//! `sandbolt` CLI and the static execd, nothing else (no shell, no libc
//! files). Used to run sandbolt inside a container with only the Docker
//! socket mounted (Station PRD), and to check the shipped binaries run.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use crate::daemon::run;
use crate::{OciImage, TestbedError, file_named_by_env, made_once, workspace_root};

/// The reference the image is imported under.
pub const SANDBOLT_IMAGE_REF: &str = "localhost/sandbolt:dev";
/// Where the CLI lands in the image (its entrypoint).
pub const SANDBOLT_IMAGE_BIN: &str = "/usr/local/bin/sandbolt";
/// Where execd lands: next to the CLI, where `--execd-bin` defaults to.
pub const SANDBOLT_IMAGE_EXECD: &str = "/usr/local/bin/execd";

/// Paths of the static `sandbolt` and execd binaries, built once per process
/// by `scripts/build-static.sh` (into `target/static/`, separate from the
/// test run's target dir). `$SANDBOLT_STATIC_BIN` (with `$SANDBOLT_EXECD_BIN`
/// for execd) skips the build.
pub fn static_binaries() -> Result<(PathBuf, PathBuf), TestbedError> {
    static BINS: OnceLock<Result<(PathBuf, PathBuf), String>> = OnceLock::new();
    made_once(&BINS, locate_or_build)
}

fn locate_or_build() -> Result<(PathBuf, PathBuf), TestbedError> {
    if let Some(bin) = file_named_by_env("SANDBOLT_STATIC_BIN")? {
        return Ok((bin, crate::execd_binary()?));
    }
    let script = workspace_root().join("scripts/build-static.sh");
    let text = run(Command::new("bash").arg(&script))?;
    let paths: Vec<PathBuf> = text.lines().map(|l| PathBuf::from(l.trim())).collect();
    match paths.as_slice() {
        [bin, execd] if bin.is_file() && execd.is_file() => Ok((bin.clone(), execd.clone())),
        _ => Err(TestbedError::Setup(format!(
            "{} printed {text:?}, not the paths of two built binaries",
            script.display()
        ))),
    }
}

/// The sandbolt image: entrypoint `sandbolt`, execd beside it, a writable
/// `/tmp` and state dir. Built once per process.
pub fn sandbolt_image() -> Result<OciImage, TestbedError> {
    static IMAGE: OnceLock<Result<OciImage, String>> = OnceLock::new();
    made_once(&IMAGE, build)
}

fn build() -> Result<OciImage, TestbedError> {
    let (bin, execd) = static_binaries()?;
    OciImage::builder(SANDBOLT_IMAGE_REF)
        .file(bin, SANDBOLT_IMAGE_BIN, 0o755)
        .file(execd, SANDBOLT_IMAGE_EXECD, 0o755)
        .bytes(
            "/etc/passwd",
            "root:x:0:0:root:/root:/sbin/nologin\n",
            0o644,
        )
        .bytes("/etc/group", "root:x:0:\n", 0o644)
        .dir_mode("/tmp", 0o1777)
        .dir_mode("/var/lib/sandbolt", 0o700)
        .dir("/proc")
        .dir("/sys")
        .dir("/dev")
        .dir("/etc")
        .entrypoint([SANDBOLT_IMAGE_BIN])
        .cmd(["--help"])
        .build()
}
