//! The static execd binary that tests inject into sandboxes.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use crate::daemon::run;
use crate::{TestbedError, file_named_by_env, made_once, workspace_root};

/// Target triple of the static build (the only one installed here).
pub const STATIC_TARGET: &str = "x86_64-unknown-linux-gnu";

/// Path of the static execd: `$SANDBOLT_EXECD_BIN` when set, otherwise
/// built once per process with glibc linked statically into
/// `target/static/`. That target dir is separate from the one the test run
/// uses, so building here never waits on the outer cargo's lock.
pub fn execd_binary() -> Result<PathBuf, TestbedError> {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    made_once(&BIN, locate_or_build)
}

fn locate_or_build() -> Result<PathBuf, TestbedError> {
    if let Some(path) = file_named_by_env("SANDBOLT_EXECD_BIN")? {
        return Ok(path);
    }
    let root = workspace_root();
    let target_dir = root.join("target/static");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(&root)
        .args([
            "build",
            "--quiet",
            "--profile",
            "release-small",
            "-p",
            "sandbolt-execd",
            "--bin",
            "execd",
            "--target",
            STATIC_TARGET,
        ])
        .env("CARGO_TARGET_DIR", &target_dir)
        .env("RUSTFLAGS", "-C target-feature=+crt-static");
    run(&mut cmd)?;
    let bin = target_dir.join(STATIC_TARGET).join("release-small/execd");
    if !bin.is_file() {
        return Err(TestbedError::Setup(format!(
            "static execd build succeeded but {} is missing",
            bin.display()
        )));
    }
    Ok(bin)
}
