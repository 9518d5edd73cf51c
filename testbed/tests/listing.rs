//! What tests read back from a bed's containerd: its containers and tasks.

use sandbolt_testbed::{BUSYBOX_REF, Testbed};

const NS: &str = "k8s.io";

#[test]
fn a_busybox_bed_lists_the_containers_and_tasks_it_runs() {
    let bed = Testbed::start_with_busybox(NS).expect("test bed with busybox");
    assert_eq!(bed.containers(NS).unwrap(), Vec::<String>::new());
    let out = bed
        .ctr(NS)
        .args([
            "run",
            "-d",
            "--null-io",
            BUSYBOX_REF,
            "listed",
            "sleep",
            "1000",
        ])
        .output()
        .expect("ctr runs");
    assert!(
        out.status.success(),
        "ctr run: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(bed.containers(NS).unwrap(), vec!["listed".to_string()]);
    let tasks = bed.tasks(NS).unwrap();
    let (pid, status) = &tasks["listed"];
    assert!(*pid > 0, "{tasks:?}");
    assert_eq!(status, "RUNNING");
}
