//! Named volumes end to end (issue 16), through the lifecycle's REST API as
//! a client uses it: a real controller, a real agent whose volume pool is a
//! loop-backed btrfs image in the test bed's private directory (mounted by
//! the agent itself), real containerd and runc, and every byte written and
//! read by the sandbox's own busybox through execd. What the host sees is
//! asked of `btrfs` itself.
//!
//! What it proves: data outlives the sandbox that wrote it; snapshot →
//! mutate → restore gives the original bytes (restore refused while
//! mounted); ten forks of a 1 GiB volume take no space until written and
//! are independent; the RWO / ROX / RWX rules, with 409s; mounting into a
//! running sandbox and unmounting; a quota stops writes inside with EDQUOT
//! and the API says why; a volume survives a controller restart.

use crate::support::volumes;

use std::path::Path;
use std::time::Duration;

use reqwest::{Method, StatusCode};
use sandbolt_e2e::bed::*;
use sandbolt_e2e::controller_process::ControllerProcess;
use serde_json::{Value, json};
use volumes::*;

const MIB: u64 = 1 << 20;

/// `md5sum` of a file inside a sandbox (the hash only).
async fn md5_in(api: &Rest, id: &str, path: &str) -> String {
    let out = api.sh_ok(id, &format!("md5sum {path}")).await;
    out.split_whitespace()
        .next()
        .unwrap_or_else(|| panic!("md5sum {path}: {out:?}"))
        .to_string()
}

/// Test 1: write in sandbox A (the pvc creates the volume), delete A, mount
/// the volume in B, read the same bytes back. A volume made by a create
/// with `deleteOnSandboxTermination` goes with its sandbox; one that
/// existed before never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn data_written_in_one_sandbox_is_read_back_in_the_next() {
    let env = VolEnv::start().await;
    let api = &env.api;

    let a = api
        .create(json!([pvc(
            "work",
            "keep-me",
            "/mnt/work",
            false,
            json!({ "createIfNotExists": true, "storage": "256Mi", "accessModes": ["ReadWriteOnce"] })
        )]))
        .await;
    api.sh_ok(&a, "head -c 3000000 /dev/urandom > /mnt/work/blob && mkdir -p /mnt/work/d && echo hello > /mnt/work/d/f && sync")
        .await;
    let sum = md5_in(api, &a, "/mnt/work/blob").await;
    let (s, v) = api.volume("keep-me").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["accessMode"], "ReadWriteOnce", "{v}");
    assert_eq!(v["sizeBytes"], 256 * MIB, "{v}");
    assert_eq!(v["mounts"].as_array().map(Vec::len), Some(1), "{v}");
    // The host sees the very bytes in the volume's subvolume.
    let host_sum = host(std::process::Command::new("md5sum").arg(env.data("keep-me").join("blob")));
    assert!(host_sum.starts_with(&sum), "{host_sum} vs {sum}");

    api.delete(&a).await;
    let (_, v) = api.volume("keep-me").await;
    assert_eq!(v["mounts"], json!([]), "no mount after the delete: {v}");

    let b = api
        .create(json!([pvc(
            "again",
            "keep-me",
            "/data",
            false,
            json!({ "createIfNotExists": false })
        )]))
        .await;
    assert_eq!(md5_in(api, &b, "/data/blob").await, sum);
    assert_eq!(api.sh_ok(&b, "cat /data/d/f").await, "hello\n");

    // A claim that names no volume, without createIfNotExists: refused,
    // naming it.
    let (s, v) = api
        .try_create(json!([pvc(
            "none",
            "no-such-volume",
            "/none",
            false,
            json!({ "createIfNotExists": false })
        )]))
        .await;
    assert!(
        s == StatusCode::NOT_FOUND || s == StatusCode::BAD_REQUEST,
        "{s} {v}"
    );
    assert!(names(&v, &["no-such-volume"]), "{v}");

    // deleteOnSandboxTermination: the volume this create made goes with
    // the sandbox; keep-me (it existed before) stays.
    let c = api
        .create(json!([pvc(
            "scratch",
            "scratch-vol",
            "/scratch",
            false,
            json!({ "deleteOnSandboxTermination": true })
        ),]))
        .await;
    api.sh_ok(&c, "echo x > /scratch/x").await;
    api.delete(&b).await;
    let d = api
        .create(json!([pvc(
            "keep",
            "keep-me",
            "/keep",
            false,
            json!({ "deleteOnSandboxTermination": true })
        )]))
        .await;
    api.delete(&c).await;
    api.delete(&d).await;
    assert_eq!(api.volume("scratch-vol").await.0, StatusCode::NOT_FOUND);
    assert_eq!(api.volume("keep-me").await.0, StatusCode::OK);
    assert!(!env.root.join("volumes/scratch-vol").exists());
    env.stop().await;
}

/// Test 2: snapshot → mutate → restore → the original bytes. Snapshots are
/// taken while mounted; restore is refused (409) while mounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restore_brings_back_the_snapshot_bytes() {
    let env = VolEnv::start().await;
    let api = &env.api;
    api.create_volume(json!({ "name": "snap-me", "accessMode": "RWO" }))
        .await;
    let a = api
        .create(json!([pvc("v", "snap-me", "/v", false, json!({}))]))
        .await;
    api.sh_ok(
        &a,
        "head -c 1000000 /dev/urandom > /v/blob && echo one > /v/keep && sync",
    )
    .await;
    let original = md5_in(api, &a, "/v/blob").await;

    let (s, v) = api.snapshot("snap-me", "before").await;
    assert_eq!(s, StatusCode::CREATED, "a snapshot while mounted: {v}");
    assert_eq!(v["name"], "before", "{v}");
    let listed = api
        .expect(
            Method::GET,
            "/volumes/snap-me/snapshots",
            None,
            StatusCode::OK,
        )
        .await;
    assert_eq!(listed["items"][0]["name"], "before", "{listed}");

    api.sh_ok(
        &a,
        "head -c 1000000 /dev/urandom > /v/blob && rm /v/keep && echo new > /v/added && sync",
    )
    .await;
    assert_ne!(md5_in(api, &a, "/v/blob").await, original);

    let (s, v) = api.restore("snap-me", "before").await;
    assert_eq!(s, StatusCode::CONFLICT, "restore while mounted: {v}");
    assert!(names(&v, &["snap-me"]), "the refusal names the volume: {v}");
    let (s, v) = api.delete_volume("snap-me").await;
    assert_eq!(s, StatusCode::CONFLICT, "delete while mounted: {v}");

    api.delete(&a).await;
    let (s, v) = api.restore("snap-me", "before").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(v["name"], "snap-me", "{v}");
    let (s, v) = api.restore("snap-me", "no-such-snapshot").await;
    assert_eq!(s, StatusCode::NOT_FOUND, "{v}");

    let b = api
        .create(json!([pvc("v", "snap-me", "/v", false, json!({}))]))
        .await;
    assert_eq!(md5_in(api, &b, "/v/blob").await, original);
    assert_eq!(api.sh_ok(&b, "cat /v/keep").await, "one\n");
    assert_eq!(
        api.sh_ok(&b, "test -e /v/added && echo there || echo absent")
            .await,
        "absent\n"
    );
    // The snapshot itself is read-only and unchanged by the restore.
    assert!(env.root.join("volumes/snap-me/snapshots/before").exists());
    api.delete(&b).await;

    // Deleting the volume takes its snapshots.
    let (s, v) = api.delete_volume("snap-me").await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    assert_eq!(api.volume("snap-me").await.0, StatusCode::NOT_FOUND);
    assert!(!env.root.join("volumes/snap-me").exists());
    env.stop().await;
}

/// Test 3: ten forks of a 1 GiB volume use no data space until written
/// (`btrfs filesystem usage` of the pool, `btrfs filesystem du` exclusive
/// bytes of each fork), and are independent: a write in one is seen in no
/// other and not in the source.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_forks_of_a_gigabyte_share_blocks_until_written() {
    let env = VolEnv::start().await;
    let api = &env.api;
    api.create_volume(json!({ "name": "big", "accessMode": "ReadWriteOnce", "size": "2Gi" }))
        .await;
    let w = api
        .create(json!([pvc("big", "big", "/big", false, json!({}))]))
        .await;
    api.sh_ok(
        &w,
        "dd if=/dev/urandom of=/big/blob bs=1M count=1024 iflag=fullblock 2>/dev/null && sync",
    )
    .await;
    let head = api
        .sh_ok(&w, "dd if=/big/blob bs=1M count=1 2>/dev/null | md5sum")
        .await;
    api.delete(&w).await;

    let before = btrfs_data_used(&env.root);
    assert!(before >= 1024 * MIB, "the source takes its GiB: {before}");
    let forks: Vec<String> = (0..10).map(|i| format!("big-fork-{i}")).collect();
    for f in &forks {
        let started = std::time::Instant::now();
        let (s, v) = api.fork("big", json!({ "name": f })).await;
        assert_eq!(s, StatusCode::CREATED, "fork {f}: {v}");
        assert_eq!(v["forkedFrom"], "big", "{v}");
        eprintln!("fork {f} of 1 GiB answered in {:?}", started.elapsed());
    }
    let after = btrfs_data_used(&env.root);
    eprintln!("pool data used: {before} before the forks, {after} after");
    assert!(
        after < before + 16 * MIB,
        "ten forks took {} bytes of data",
        after - before
    );
    for f in &forks {
        let (total, exclusive) = btrfs_du(&env.data(f));
        assert!(total >= 1024 * MIB, "{f} references the GiB: {total}");
        assert!(
            exclusive < MIB,
            "{f} owns {exclusive} bytes of its own before any write"
        );
    }

    // Independence: write in fork 3 (new file, and the first MiB of the
    // shared blob overwritten); the others and the source are unchanged.
    let mut mounts: Vec<Value> = forks
        .iter()
        .enumerate()
        .map(|(i, f)| pvc(&format!("f{i}"), f, &format!("/f{i}"), false, json!({})))
        .collect();
    mounts.push(pvc("src", "big", "/src", true, json!({})));
    let r = api.create(Value::Array(mounts)).await;
    api.sh_ok(&r, "echo mine > /f3/mine && dd if=/dev/urandom of=/f3/blob bs=1M count=8 iflag=fullblock conv=notrunc 2>/dev/null && sync")
        .await;
    for i in 0..10 {
        let h = api
            .sh_ok(
                &r,
                &format!("dd if=/f{i}/blob bs=1M count=1 2>/dev/null | md5sum"),
            )
            .await;
        let mine = api
            .sh_ok(&r, &format!("test -e /f{i}/mine && echo yes || echo no"))
            .await;
        if i == 3 {
            assert_ne!(h, head, "fork 3 was written");
            assert_eq!(mine, "yes\n");
        } else {
            assert_eq!(h, head, "fork {i} is unchanged by a write in fork 3");
            assert_eq!(mine, "no\n", "fork {i} does not see fork 3's file");
        }
    }
    let src = api
        .sh_ok(&r, "dd if=/src/blob bs=1M count=1 2>/dev/null | md5sum; test -e /src/mine && echo yes || echo no")
        .await;
    assert_eq!(src, format!("{head}no\n"), "the source is unchanged");
    api.delete(&r).await;
    let (_, exclusive) = btrfs_du(&env.data("big-fork-3"));
    assert!(
        exclusive >= 8 * MIB,
        "the written fork owns what it wrote: {exclusive}"
    );
    for f in forks.iter().filter(|f| *f != "big-fork-3") {
        let (_, exclusive) = btrfs_du(&env.data(f));
        assert!(exclusive < MIB, "{f} still owns nothing: {exclusive}");
    }

    // Deleting the source keeps its forks.
    assert_eq!(api.delete_volume("big").await.0, StatusCode::NO_CONTENT);
    let (s, v) = api.volume("big-fork-0").await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let r = api
        .create(json!([pvc("f", "big-fork-0", "/f", true, json!({}))]))
        .await;
    assert_eq!(
        api.sh_ok(&r, "dd if=/f/blob bs=1M count=1 2>/dev/null | md5sum")
            .await,
        head
    );
    api.delete(&r).await;
    env.stop().await;
}

/// Test 4: access modes at create and at attach, with 409s; mounting into
/// a running sandbox and unmounting it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn access_modes_and_mounting_into_running_sandboxes() {
    let env = VolEnv::start().await;
    let api = &env.api;
    api.create_volume(json!({ "name": "rwo", "accessMode": "ReadWriteOnce" }))
        .await;
    api.create_volume(json!({ "name": "rwx", "accessMode": "RWX" }))
        .await;

    // RWO: one writer; a second RW mount is refused naming the mode; RO
    // mounts are fine.
    let w = api
        .create(json!([pvc("d", "rwo", "/d", false, json!({}))]))
        .await;
    api.sh_ok(&w, "echo from-writer > /d/f && sync").await;
    let (s, v) = api
        .try_create(json!([pvc("d", "rwo", "/d", false, json!({}))]))
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "second RW mount of RWO: {v}");
    assert!(names(&v, &["rwo"]), "{v}");
    let r = api
        .create(json!([pvc("d", "rwo", "/d", true, json!({}))]))
        .await;
    assert_eq!(api.sh_ok(&r, "cat /d/f").await, "from-writer\n");
    let out = api.sh(&r, "echo x > /d/g").await;
    assert!(
        out.error.is_some(),
        "a read-only mount is read-only: {out:?}"
    );
    assert!(out.stderr.contains("Read-only file system"), "{out:?}");

    // ROX: a fork of rwo, read-only everywhere; a RW mount is refused
    // naming the mode (never silently flipped to read-only).
    let (s, v) = api
        .fork(
            "rwo",
            json!({ "name": "rox", "accessMode": "ReadOnlyMany" }),
        )
        .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    assert_eq!(v["accessMode"], "ReadOnlyMany", "{v}");
    let (s, v) = api
        .try_create(json!([pvc("d", "rox", "/d", false, json!({}))]))
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "RW mount of ROX: {v}");
    assert!(
        names(&v, &["rox"]) && (names(&v, &["ReadOnlyMany"]) || names(&v, &["ROX"])),
        "{v}"
    );
    let x1 = api
        .create(json!([pvc("d", "rox", "/d", true, json!({}))]))
        .await;
    let x2 = api
        .create(json!([pvc("d", "rox", "/d", true, json!({}))]))
        .await;
    for x in [&x1, &x2] {
        assert_eq!(api.sh_ok(x, "cat /d/f").await, "from-writer\n");
        assert!(api.sh(x, "echo x > /d/g").await.error.is_some());
    }

    // RWX: two writers see each other's writes.
    let m1 = api
        .create(json!([pvc("s", "rwx", "/s", false, json!({}))]))
        .await;
    let m2 = api
        .create(json!([pvc("s", "rwx", "/s", false, json!({}))]))
        .await;
    api.sh_ok(&m1, "echo one > /s/one && sync").await;
    api.sh_ok(&m2, "echo two > /s/two && sync").await;
    assert_eq!(api.sh_ok(&m1, "cat /s/two").await, "two\n");
    assert_eq!(api.sh_ok(&m2, "cat /s/one").await, "one\n");
    let (_, v) = api.volume("rwx").await;
    assert_eq!(v["mounts"].as_array().map(Vec::len), Some(2), "{v}");

    // Into a running sandbox: the RWO volume cannot be attached RW while
    // `w` writes it; after `w` is gone it can, and it is there at once.
    let plain = api.create(json!([])).await;
    // The mount is named apart from its claim: detach names the claim.
    let attach = pvc("late-mount", "rwo", "/late", false, json!({}));
    let (s, v) = api.attach(&plain, attach.clone()).await;
    assert_eq!(
        s,
        StatusCode::CONFLICT,
        "attach RW of a RWO volume in use: {v}"
    );
    api.delete(&w).await;
    let (s, v) = api.attach(&plain, attach.clone()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(api.sh_ok(&plain, "cat /late/f").await, "from-writer\n");
    api.sh_ok(&plain, "echo late > /late/late && sync").await;
    let (s, v) = api.attach(&plain, attach.clone()).await;
    assert!(
        s == StatusCode::CONFLICT || s == StatusCode::BAD_REQUEST,
        "mounted twice in one sandbox: {s} {v}"
    );
    let (_, v) = api.volume("rwo").await;
    assert!(
        v["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m["sandboxId"] == plain.as_str() && m["mountPath"] == "/late"),
        "{v}"
    );
    // Restore and delete are refused while attached.
    assert_eq!(api.snapshot("rwo", "s").await.0, StatusCode::CREATED);
    assert_eq!(api.restore("rwo", "s").await.0, StatusCode::CONFLICT);
    assert_eq!(api.delete_volume("rwo").await.0, StatusCode::CONFLICT);

    let (s, v) = api.detach(&plain, "rwo").await;
    assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    assert_eq!(
        api.sh_ok(&plain, "test -e /late/late && echo there || echo gone")
            .await,
        "gone\n"
    );
    let (_, v) = api.volume("rwo").await;
    assert!(
        v["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["sandboxId"] != plain.as_str()),
        "{v}"
    );
    assert_eq!(api.detach(&plain, "rwo").await.0, StatusCode::NOT_FOUND);
    // Detached, the data stays and a new writer may mount it.
    assert_eq!(
        api.restore("rwo", "s").await.0,
        StatusCode::CONFLICT,
        "r still mounts it read-only"
    );
    for id in [&r, &x1, &x2, &m1, &m2, &plain] {
        api.delete(id).await;
    }
    assert_eq!(api.restore("rwo", "s").await.0, StatusCode::OK);
    for name in ["rwo", "rox", "rwx"] {
        assert_eq!(
            api.delete_volume(name).await.0,
            StatusCode::NO_CONTENT,
            "{name}"
        );
    }
    env.stop().await;
}

/// Test 5: a 64 MiB quota. Writing 100 MiB inside fails with EDQUOT ("Disk
/// quota exceeded", what qgroups return); an upload through execd is
/// answered 507 naming the cause; the volume reports usedBytes near its
/// size.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_quota_stops_writes_and_says_why() {
    let env = VolEnv::start().await;
    let api = &env.api;
    let v = api
        .create_volume(json!({ "name": "small", "size": "64Mi" }))
        .await;
    assert_eq!(v["size"], "64Mi", "{v}");
    assert_eq!(v["sizeBytes"], 64 * MIB, "{v}");
    assert_eq!(v["capabilities"]["quota"], true, "{v}");
    let id = api
        .create(json!([pvc("q", "small", "/q", false, json!({}))]))
        .await;
    let out = api
        .sh(&id, "dd if=/dev/zero of=/q/fill bs=1M count=100 conv=fsync")
        .await;
    eprintln!("writing 100 MiB into a 64 MiB volume: {out:?}");
    assert!(out.error.is_some(), "the write must fail: {out:?}");
    let enospc = out.stderr.contains("No space left on device");
    let edquot = out.stderr.contains("Disk quota exceeded");
    assert!(edquot || enospc, "{out:?}");
    assert!(edquot, "qgroups answer EDQUOT, got ENOSPC: {out:?}");
    let written: u64 = api
        .sh_ok(&id, "sync; wc -c < /q/fill")
        .await
        .trim()
        .parse()
        .unwrap();
    assert!(
        written <= 64 * MIB,
        "at most the quota was written: {written}"
    );

    let api2 = api.clone();
    eventually("usedBytes near the quota", Duration::from_secs(30), || {
        let api = api2.clone();
        async move {
            let (_, v) = api.volume("small").await;
            let used = used_bytes(&v);
            used >= (48 * MIB) as i64 && used <= (72 * MIB) as i64
        }
    })
    .await;

    let (_, v) = api.volume("small").await;
    eprintln!("usedBytes of the full 64 MiB volume: {}", used_bytes(&v));

    // Through the API: an upload that does not fit is 507, naming why.
    api.sh_ok(&id, "rm -f /q/fill && sync").await;
    let (s, body) = api
        .upload(&id, "/q/upload.bin", vec![7u8; 100 * MIB as usize])
        .await;
    eprintln!("upload of 100 MiB into a 64 MiB volume: {s} {body}");
    assert_eq!(s, StatusCode::INSUFFICIENT_STORAGE, "{body}");
    assert!(
        body.contains("quota") || body.contains("No space"),
        "the answer names the cause: {body}"
    );
    // Nothing half-written is left under the target's name.
    assert_eq!(
        api.sh_ok(&id, "test -e /q/upload.bin && echo there || echo absent")
            .await,
        "absent\n"
    );
    api.delete(&id).await;
    env.stop().await;
}

/// Test 7: a volume (and its data) survives a controller kill -9: after the
/// restart it is listed again (the agent reports it) and mountable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_volume_survives_a_controller_restart() {
    let bed = start_bed().await;
    let data = tempfile::tempdir().unwrap();
    let listen = free_port();
    let binary = Path::new(env!("CARGO_BIN_EXE_e2e-sandbolt"));
    let ctl = ControllerProcess::start_embedded(binary, data.path(), listen, "strong", None, TOKEN);
    let (agent, root) = start_volume_agent(&bed, "agent-restart", listen).await;
    wait_agents(&connect(listen).await, 1).await;
    let lifecycle = start_lifecycle(&format!("http://{listen}"), data.path()).await;
    let api = Rest::new(lifecycle.addr());

    api.create_volume(json!({ "name": "durable", "size": "128Mi" }))
        .await;
    let a = api
        .create(json!([pvc("d", "durable", "/d", false, json!({}))]))
        .await;
    api.sh_ok(&a, "head -c 500000 /dev/urandom > /d/blob && sync")
        .await;
    let sum = md5_in(&api, &a, "/d/blob").await;
    api.delete(&a).await;
    assert_eq!(api.snapshot("durable", "s1").await.0, StatusCode::CREATED);

    let ctl = tokio::task::spawn_blocking(move || {
        let mut ctl = ctl;
        ctl.kill9();
        ctl
    })
    .await
    .unwrap();
    drop(ctl);
    let ctl = ControllerProcess::start_embedded(binary, data.path(), listen, "strong", None, TOKEN);
    let api2 = api.clone();
    eventually(
        "the restarted controller lists the volume",
        Duration::from_secs(30),
        || {
            let api = api2.clone();
            async move {
                let (s, v) = api.call(Method::GET, "/volumes", None).await;
                s == StatusCode::OK
                    && v["items"].as_array().is_some_and(|i| {
                        i.iter()
                            .any(|v| v["name"] == "durable" && v["available"] == true)
                    })
            }
        },
    )
    .await;
    let (_, v) = api.volume("durable").await;
    assert_eq!(v["sizeBytes"], 128 * MIB, "{v}");
    assert_eq!(v["snapshots"][0]["name"], "s1", "{v}");
    let b = api
        .create(json!([pvc(
            "d",
            "durable",
            "/d",
            false,
            json!({ "createIfNotExists": false })
        )]))
        .await;
    assert_eq!(md5_in(&api, &b, "/d/blob").await, sum);
    api.delete(&b).await;
    assert!(root.join("volumes/durable/data/blob").exists());

    lifecycle.shutdown().await.unwrap();
    agent.shutdown().await;
    let mut ctl = ctl;
    tokio::task::spawn_blocking(move || ctl.stop())
        .await
        .unwrap();
    drop(bed);
}
