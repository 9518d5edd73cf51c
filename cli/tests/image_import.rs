//! `sandbolt image import` loads an OCI archive into a real containerd (the
//! test bed's) under its reference, unpacked and runnable.

use std::process::Command;

use sandbolt_testbed::{Testbed, busybox_image};

#[test]
fn imports_an_oci_archive_into_containerd() {
    let bed = Testbed::start().expect("test bed");
    let archive = bed.root().join("busybox.tar");
    busybox_image()
        .unwrap()
        .write_oci_archive(&archive)
        .unwrap();

    let out = Command::new(env!("CARGO_BIN_EXE_sandbolt"))
        .args(["image", "import"])
        .arg(&archive)
        .arg("--containerd-socket")
        .arg(bed.containerd_socket())
        .args(["--containerd-namespace", "import-test"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("docker.io/library/busybox:latest"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );

    let images = bed
        .ctr("import-test")
        .args(["images", "ls", "-q"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&images.stdout).contains("docker.io/library/busybox:latest"));
    // Unpacked: a container runs from it without any further step.
    let run = bed
        .ctr("import-test")
        .args([
            "run",
            "--rm",
            "docker.io/library/busybox:latest",
            "import-check",
            "echo",
            "imported-ok",
        ])
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&run.stdout).contains("imported-ok"),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );

    // A missing archive is a clear error, not a panic.
    let out = Command::new(env!("CARGO_BIN_EXE_sandbolt"))
        .args(["image", "import", "/nonexistent.tar", "--containerd-socket"])
        .arg(bed.containerd_socket())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.tar"));
}
