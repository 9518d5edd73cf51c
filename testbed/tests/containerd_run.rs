//! The test bed's containerd runs a locally built busybox image through
//! containerd's own gRPC API, and two beds run side by side.

use std::time::Duration;

use containerd_client::services::v1::container::Runtime;
use containerd_client::services::v1::snapshots::{PrepareSnapshotRequest, RemoveSnapshotRequest};
use containerd_client::services::v1::{
    Container, CreateContainerRequest, CreateTaskRequest, DeleteContainerRequest,
    DeleteTaskRequest, GetImageRequest, StartRequest, WaitRequest,
};
use containerd_client::tonic::Request;
use containerd_client::{Client, with_namespace};
use sandbolt_testbed::{BUSYBOX_REF, Testbed, busybox_image};

const NAMESPACE: &str = "sandbolt-testbed";

/// Creates, starts and waits for a one-shot busybox container, returning
/// its exit status and what it wrote to stdout.
async fn run_echo(bed: &Testbed, id: &str, text: &str) -> (u32, String) {
    let client = Client::from_path(bed.containerd_socket())
        .await
        .expect("connect to the bed's containerd");

    // The import must have registered the image under its full reference.
    let image = client
        .images()
        .get(with_namespace!(
            GetImageRequest {
                name: BUSYBOX_REF.to_string()
            },
            NAMESPACE
        ))
        .await
        .expect("image imported")
        .into_inner()
        .image
        .expect("image present");
    assert_eq!(image.name, BUSYBOX_REF);

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
    let container = Container {
        id: id.into(),
        image: BUSYBOX_REF.into(),
        runtime: Some(Runtime {
            name: "io.containerd.runc.v2".into(),
            options: None,
        }),
        spec: Some(prost_types::Any {
            type_url: "types.containerd.io/opencontainers/runtime-spec/1/Spec".into(),
            value: serde_json::to_vec(&spec).unwrap(),
        }),
        snapshotter: "overlayfs".into(),
        snapshot_key: id.into(),
        ..Default::default()
    };
    client
        .containers()
        .create(with_namespace!(
            CreateContainerRequest {
                container: Some(container)
            },
            NAMESPACE
        ))
        .await
        .expect("create container");

    // After the container exists: it references the snapshot key, which keeps
    // containerd's GC off the fresh active snapshot (unreferenced, it may be
    // collected before the task mounts it). One layer: its chain id is its
    // diff id. Prepare fails unless the import also unpacked the layer.
    let parent = busybox_image().unwrap().diff_id();
    let mounts = client
        .snapshots()
        .prepare(with_namespace!(
            PrepareSnapshotRequest {
                snapshotter: "overlayfs".into(),
                key: id.into(),
                parent,
                labels: Default::default(),
            },
            NAMESPACE
        ))
        .await
        .expect("prepare snapshot")
        .into_inner()
        .mounts;

    let out = bed.root().join(format!("{id}.out"));
    client
        .tasks()
        .create(with_namespace!(
            CreateTaskRequest {
                container_id: id.into(),
                rootfs: mounts,
                stdout: format!("file://{}", out.display()),
                stderr: format!("file://{}", out.display()),
                ..Default::default()
            },
            NAMESPACE
        ))
        .await
        .expect("create task");
    let waiter = {
        let mut tasks = client.tasks();
        let id = id.to_string();
        tokio::spawn(async move {
            tasks
                .wait(with_namespace!(
                    WaitRequest {
                        container_id: id,
                        exec_id: String::new()
                    },
                    NAMESPACE
                ))
                .await
        })
    };
    client
        .tasks()
        .start(with_namespace!(
            StartRequest {
                container_id: id.into(),
                exec_id: String::new()
            },
            NAMESPACE
        ))
        .await
        .expect("start task");
    let status = tokio::time::timeout(Duration::from_secs(30), waiter)
        .await
        .expect("task exits")
        .unwrap()
        .expect("wait")
        .into_inner()
        .exit_status;

    client
        .tasks()
        .delete(with_namespace!(
            DeleteTaskRequest {
                container_id: id.into()
            },
            NAMESPACE
        ))
        .await
        .expect("delete task");
    client
        .containers()
        .delete(with_namespace!(
            DeleteContainerRequest { id: id.into() },
            NAMESPACE
        ))
        .await
        .expect("delete container");
    // Deleting the container left the snapshot unreferenced: containerd's
    // garbage collector (which the delete triggers) may have removed it
    // already, and NotFound means just that.
    match client
        .snapshots()
        .remove(with_namespace!(
            RemoveSnapshotRequest {
                snapshotter: "overlayfs".into(),
                key: id.into()
            },
            NAMESPACE
        ))
        .await
    {
        Ok(_) => {}
        Err(e) if e.code() == containerd_client::tonic::Code::NotFound => {}
        Err(e) => panic!("remove snapshot: {e:?}"),
    }
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
