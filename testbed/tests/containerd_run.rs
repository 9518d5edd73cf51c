//! The test bed's containerd runs a locally built busybox image through
//! containerd's own gRPC API, and two beds run side by side.

use std::time::Duration;

use sandbolt_testbed::{BUSYBOX_REF, BareContainerd, Testbed, busybox_image};

const NAMESPACE: &str = "sandbolt-testbed";

/// Creates, starts and waits for a one-shot busybox container, returning
/// its exit status and what it wrote to stdout.
async fn run_echo(bed: &Testbed, id: &str, text: &str) -> (u32, String) {
    let containerd = BareContainerd::connect(bed, NAMESPACE)
        .await
        .expect("connect to the bed's containerd");

    // The import must have registered the image under its full reference.
    let image = containerd
        .image_name(BUSYBOX_REF)
        .await
        .expect("image imported");
    assert_eq!(image, BUSYBOX_REF);

    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "args": ["/bin/sh", "-c", format!("echo {text}")],
            "env": ["PATH=/bin:/usr/bin:/sbin:/usr/sbin"],
            "cwd": "/",
            "user": {"uid": 0, "gid": 0},
        },
        "root": {"path": "rootfs"},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"}, {"type": "ipc"}, {"type": "uts"},
                {"type": "mount"}, {"type": "network"}
            ],
        },
    });
    // One layer: its chain id is its diff id. Preparing the snapshot fails
    // unless the import also unpacked the layer.
    let parent = busybox_image().unwrap().diff_id();
    let mounts = containerd
        .create_container(id, &spec, &parent)
        .await
        .expect("create container and snapshot");

    let out = bed.root().join(format!("{id}.out"));
    containerd
        .create_task(id, mounts, Some(&out))
        .await
        .expect("create task");
    let waiter = containerd.wait_task(id);
    containerd.start_task(id).await.expect("start task");
    let status = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("task exits")
        .unwrap()
        .expect("wait");
    containerd
        .delete(id)
        .await
        .expect("delete task, container, snapshot");
    let output = std::fs::read_to_string(&out).expect("task output file");
    (status, output)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_busybox_through_containerd_grpc() {
    let bed = Testbed::start().expect("start test bed");
    bed.import_image(&busybox_image().unwrap(), NAMESPACE)
        .expect("import busybox");
    let (status, output) = run_echo(&bed, "tb-echo", "hello-from-busybox").await;
    assert_eq!(status, 0);
    assert_eq!(output.trim(), "hello-from-busybox");
    let root = bed.root().to_path_buf();
    drop(bed);
    assert!(!root.exists(), "bed directory removed on drop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_beds_run_side_by_side() {
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(Testbed::start);
        let b = s.spawn(Testbed::start);
        (a.join().unwrap().unwrap(), b.join().unwrap().unwrap())
    });
    assert_ne!(a.containerd_socket(), b.containerd_socket());
    let image = busybox_image().unwrap();
    a.import_image(&image, NAMESPACE).unwrap();
    b.import_image(&image, NAMESPACE).unwrap();
    // Same container id in both: the beds must not see each other.
    let (ra, rb) = tokio::join!(
        run_echo(&a, "tb-same-id", "from-a"),
        run_echo(&b, "tb-same-id-b", "from-b")
    );
    assert_eq!((ra.0, ra.1.trim()), (0, "from-a"));
    assert_eq!((rb.0, rb.1.trim()), (0, "from-b"));
    // Tearing one down leaves the other working.
    drop(a);
    let (status, output) = run_echo(&b, "tb-after", "still-here").await;
    assert_eq!((status, output.trim()), (0, "still-here"));
}

#[test]
fn panicking_test_still_tears_down() {
    let root = std::sync::Mutex::new(None);
    let result = std::panic::catch_unwind(|| {
        let bed = Testbed::start().expect("start test bed");
        *root.lock().unwrap() = Some(bed.root().to_path_buf());
        panic!("boom");
    });
    assert!(result.is_err());
    let root = root.lock().unwrap().clone().unwrap();
    assert!(
        !root.exists(),
        "{} still exists after a panic",
        root.display()
    );
}
