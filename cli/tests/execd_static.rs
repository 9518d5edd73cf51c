//! Every command that takes an execd refuses one that is not a static
//! executable, at start, with the command that builds the right one — the
//! dynamically linked execd of a plain `cargo build` would otherwise make
//! every sandbox die with "exited with status 1".

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sandbolt_testbed::execd_binary;

/// A binary of a normal (dynamic) build: what `cargo build` puts in
/// target/*/execd.
const DYNAMIC: &str = "/bin/ls";

fn sandbolt(args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandbolt"));
    cmd.args(args)
        .env_remove("SANDBOLT_EXECD_BIN")
        .env_remove("SANDBOLT_API_KEY")
        .env_remove("SANDBOLT_CONTROLLER");
    cmd
}

fn assert_refused_with_build_command(out: &Output, path: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "accepted:\n{err}");
    assert!(err.contains(path), "names the path:\n{err}");
    assert!(err.contains("dynamically linked"), "{err}");
    assert!(err.contains("scripts/build-execd.sh"), "{err}");
    assert!(
        err.contains("RUSTFLAGS='-C target-feature=+crt-static' cargo build"),
        "{err}"
    );
    err
}

#[test]
fn agent_up_and_the_docker_lifecycle_refuse_a_dynamic_execd() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");

    let out = sandbolt(&["agent", "--token", "t", "--execd-bin", DYNAMIC])
        .output()
        .unwrap();
    assert_refused_with_build_command(&out, DYNAMIC);

    let out = sandbolt(&["up", "--insecure", "--execd-bin", DYNAMIC, "--data-dir"])
        .arg(&data)
        .output()
        .unwrap();
    assert_refused_with_build_command(&out, DYNAMIC);
    assert!(!data.exists(), "refused before writing anything");

    let out = sandbolt(&["lifecycle", "--insecure", "--execd-bin", DYNAMIC])
        .arg("--data-dir")
        .arg(&data)
        .output()
        .unwrap();
    assert_refused_with_build_command(&out, DYNAMIC);
}

#[test]
fn the_default_execd_beside_the_binary_is_checked_too() {
    // The reported case: `cargo build --release` leaves a dynamic execd
    // beside sandbolt, and `up` picks it without --execd-bin. A hard link
    // (same file system as the target dir; a copy where that fails) gives
    // sandbolt a directory of its own to find an execd beside it.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let bin = dir.path().join("sandbolt");
    if std::fs::hard_link(env!("CARGO_BIN_EXE_sandbolt"), &bin).is_err() {
        std::fs::copy(env!("CARGO_BIN_EXE_sandbolt"), &bin).unwrap();
    }
    let execd = dir.path().join("execd");
    std::fs::copy(DYNAMIC, &execd).unwrap();
    std::fs::set_permissions(&execd, std::fs::Permissions::from_mode(0o755)).unwrap();

    let out = Command::new(&bin)
        .args(["up", "--insecure", "--data-dir"])
        .arg(dir.path().join("data"))
        .env_remove("SANDBOLT_EXECD_BIN")
        .output()
        .unwrap();
    let err = assert_refused_with_build_command(&out, &execd.display().to_string());
    assert!(err.contains("beside the sandbolt binary"), "{err}");
}

#[test]
fn a_script_is_refused_and_a_missing_file_named() {
    let tmp = tempfile::tempdir().unwrap();
    let script = tmp.path().join("execd");
    std::fs::write(&script, "#!/bin/sh\nexec /usr/local/bin/execd \"$@\"\n").unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = sandbolt(&["agent", "--token", "t", "--execd-bin"])
        .arg(&script)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("not an ELF executable"), "{err}");
    assert!(err.contains("scripts/build-execd.sh"), "{err}");

    let missing = tmp.path().join("nowhere/execd");
    let out = sandbolt(&["agent", "--token", "t", "--execd-bin"])
        .arg(&missing)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("not found"), "{err}");
    assert!(err.contains(&missing.display().to_string()), "{err}");
}

#[test]
fn up_accepts_the_static_execd_and_makes_its_data_dir_private() {
    // The static execd passes the check; with no runtime to be found, `up`
    // then stops at the engine choice, which proves it got past the check
    // (without starting a daemon in this test).
    let static_execd: PathBuf = execd_binary().expect("static execd");
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let out = sandbolt(&["up", "--insecure", "--runtime", "docker", "--execd-bin"])
        .arg(&static_execd)
        .arg("--docker-socket")
        .arg(tmp.path().join("no-docker.sock"))
        .arg("--data-dir")
        .arg(&data)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("no container runtime"), "{err}");
    assert!(!err.contains("build-execd"), "{err}");
    assert_eq!(mode(&data), 0o700);
}

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}
