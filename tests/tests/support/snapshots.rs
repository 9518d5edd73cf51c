//! What the sandbox snapshot end-to-end tests (issue 18) share: the
//! snapshots containerd holds (read with `ctr`, never through the agent or
//! the controller), the controller's native `SnapshotService`, commands
//! through execd of a sandbox named on the native API, and a pytest run of
//! one test of a suite under `tests/python`.
//!
//! Included next to `support/warm.rs` (`mod warm;` in the test file), whose
//! lifecycle, REST client and teardown checks it builds on.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use sandbolt_e2e::bed::{NS, Native, eventually};
use sandbolt_proto::control::v1 as native;
use sandbolt_proto::wire::EXECD_PORT;
use sandbolt_testbed::Testbed;
use tonic::transport::Channel;

use super::warm::execd::{Output, run_command};

pub type Snapshots = native::snapshot_service_client::SnapshotServiceClient<Channel>;

/// The committed snapshot of sandbox snapshot `id` in containerd.
pub fn committed_key(id: &str) -> String {
    format!("{}{id}", sandbolt_node::labels::SNAPSHOT_NAME_PREFIX)
}

/// The active snapshot a capture of `id` fills before committing it.
pub fn capturing_key(id: &str) -> String {
    format!("{}{id}", sandbolt_node::labels::SNAPSHOTTING_KEY_PREFIX)
}

/// One row of `ctr snapshots ls` (the bed's default snapshotter, overlayfs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotRow {
    pub key: String,
    /// Empty for a base layer.
    pub parent: String,
    /// `Active`, `Committed` or `View`.
    pub kind: String,
}

/// Every snapshot of the bed's [`NS`], as containerd lists them.
pub async fn containerd_snapshots(bed: &Testbed) -> Vec<SnapshotRow> {
    let out = tokio::task::block_in_place(|| bed.ctr_output(NS, &["snapshots", "ls"]))
        .expect("ctr snapshots ls");
    parse_snapshot_rows(&out)
}

/// `ctr snapshots ls` output → rows (the header line skipped).
pub fn parse_snapshot_rows(out: &str) -> Vec<SnapshotRow> {
    out.lines()
        .skip(1)
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            match cols.as_slice() {
                [key, parent, kind] => Some(SnapshotRow {
                    key: key.to_string(),
                    parent: parent.to_string(),
                    kind: kind.to_string(),
                }),
                [key, kind] => Some(SnapshotRow {
                    key: key.to_string(),
                    parent: String::new(),
                    kind: kind.to_string(),
                }),
                _ => None,
            }
        })
        .collect()
}

/// Keys of the bed's snapshots that belong to sandbox snapshots (committed
/// or being captured), whatever their id.
pub async fn sandbox_snapshot_keys(bed: &Testbed) -> Vec<String> {
    containerd_snapshots(bed)
        .await
        .into_iter()
        .map(|r| r.key)
        .filter(|k| {
            k.starts_with(sandbolt_node::labels::SNAPSHOT_NAME_PREFIX)
                || k.starts_with(sandbolt_node::labels::SNAPSHOTTING_KEY_PREFIX)
        })
        .collect()
}

/// Panics unless containerd holds nothing of sandbox snapshot `id` (neither
/// its committed snapshot nor a capture's key), waiting up to `within` for
/// it to go.
pub async fn wait_nothing_of_snapshot(bed: &Testbed, id: &str, within: Duration) {
    let (committed, capturing) = (committed_key(id), capturing_key(id));
    eventually(
        &format!("containerd holds neither {committed} nor {capturing}"),
        within,
        || async {
            let keys = sandbox_snapshot_keys(bed).await;
            !keys.iter().any(|k| *k == committed || *k == capturing)
        },
    )
    .await;
}

pub fn snapshot_ref(id: &str) -> native::SnapshotRef {
    native::SnapshotRef {
        namespace: "default".into(),
        id: id.into(),
        expected_uid: String::new(),
    }
}

/// The native record of snapshot `id` in `default`.
pub async fn get_snapshot(c: &mut Snapshots, id: &str) -> native::Snapshot {
    c.get_snapshot(snapshot_ref(id))
        .await
        .unwrap_or_else(|e| panic!("GetSnapshot {id}: {e:?}"))
        .into_inner()
}

/// Waits until snapshot `id` leaves PENDING; the record then.
pub async fn wait_settled(c: &Snapshots, id: &str, within: Duration) -> native::Snapshot {
    sandbolt_test_support::eventually_async(&format!("snapshot {id} settled"), within, || {
        let mut c = c.clone();
        let id = id.to_string();
        async move {
            let s = c.get_snapshot(snapshot_ref(&id)).await.ok()?.into_inner();
            (s.phase() != native::SnapshotPhase::Pending).then_some(s)
        }
    })
    .await
}

/// Waits until GetSnapshot of `id` answers NOT_FOUND.
pub async fn wait_snapshot_gone(c: &Snapshots, id: &str, within: Duration) {
    eventually(&format!("snapshot {id} gone"), within, || {
        let mut c = c.clone();
        let id = id.to_string();
        async move {
            c.get_snapshot(snapshot_ref(&id))
                .await
                .is_err_and(|e| e.code() == tonic::Code::NotFound)
        }
    })
    .await;
}

/// Runs `command` with `sh -c` through execd of `default/<name>`, reached
/// at the endpoint the native API resolves (the agent's proxy).
pub async fn execd_sh(c: &mut Native, name: &str, command: &str) -> Output {
    let ep = c
        .resolve_endpoint(native::ResolveEndpointRequest {
            sandbox: sandbolt_e2e::bed::native_ref(name),
            port: u32::from(EXECD_PORT),
        })
        .await
        .unwrap_or_else(|e| panic!("ResolveEndpoint of {name}: {e:?}"))
        .into_inner();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    run_command(&http, &ep.endpoint, &ep.headers, name, command).await
}

/// stdout of a command through execd of `default/<name>` that must succeed.
pub async fn execd_ok(c: &mut Native, name: &str, command: &str) -> String {
    let out = execd_sh(c, name, command).await;
    assert!(out.error.is_none(), "{command:?} in {name} failed: {out:?}");
    out.stdout
}

/// Runs one test (`test`) of the pytest suite `py_test` in `tests/python`
/// against the lifecycle at `addr`, with `env` added, off the runtime's
/// worker threads (the controller, agent and lifecycle of the test run on
/// them); panics with its output when it fails.
pub async fn pytest_one(
    py_test: &'static str,
    test: &str,
    addr: SocketAddr,
    mut env: Vec<(&'static str, String)>,
) {
    // pytest adds PYTEST_ADDOPTS to its command line: one test selected.
    env.push(("PYTEST_ADDOPTS", format!("-k {test}")));
    let run =
        tokio::task::spawn_blocking(move || super::warm::run_pytest(py_test, addr, &env)).await;
    if let Err(panic) = run {
        std::panic::resume_unwind(panic.into_panic());
    }
}
