//! The JuiceFS test bed: a real PostgreSQL, a formatted filesystem that a
//! real `juicefs mount` serves, and a metadata engine that can be stopped.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sandbolt_testbed::JuiceFs;

fn is_fuse_mount(p: &std::path::Path) -> bool {
    nix_statfs_type(p) == Some(0x6573_5546)
}

fn nix_statfs_type(p: &std::path::Path) -> Option<i64> {
    let out = Command::new("stat")
        .args(["-f", "-c", "%t"])
        .arg(p)
        .output()
        .ok()?;
    i64::from_str_radix(String::from_utf8_lossy(&out.stdout).trim(), 16).ok()
}

#[test]
fn a_formatted_filesystem_mounts_and_its_metadata_engine_stops_and_restarts() {
    let mut fs = JuiceFs::start().expect("juicefs test bed");
    assert!(
        fs.meta_url().starts_with("postgres://"),
        "{}",
        fs.meta_url()
    );
    let status = Command::new(fs.binary())
        .arg("status")
        .arg(fs.meta_url())
        .output()
        .unwrap();
    assert!(status.status.success(), "{status:?}");
    assert!(String::from_utf8_lossy(&status.stdout).contains(fs.name()));

    let mp = fs.mount_point("a").unwrap();
    let cache = fs.scratch("a-cache").unwrap();
    let mut mount = Command::new(fs.binary())
        .args([
            "mount",
            "--no-usage-report",
            "--backup-meta",
            "0",
            "--cache-dir",
        ])
        .arg(&cache)
        .arg(fs.meta_url())
        .arg(&mp)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while !is_fuse_mount(&mp) {
        assert!(started.elapsed() < Duration::from_secs(30), "never mounted");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::write(mp.join("hello"), b"world").unwrap();
    assert_eq!(std::fs::read(mp.join("hello")).unwrap(), b"world");

    fs.stop_meta();
    let refused = Command::new(fs.binary())
        .arg("status")
        .arg(fs.meta_url())
        .output()
        .unwrap();
    assert!(
        !refused.status.success(),
        "status answered without PostgreSQL"
    );
    fs.start_meta().unwrap();
    assert_eq!(std::fs::read(mp.join("hello")).unwrap(), b"world");

    let dir = fs.dir().to_path_buf();
    let _ = mount.kill();
    let _ = mount.wait();
    drop(fs);
    assert!(!dir.exists(), "the bed directory is removed");
    assert!(
        !std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap()
            .contains(&*dir.to_string_lossy()),
        "no mount is left below the bed"
    );
}
