"""Sandbox snapshots (issue 18) through the official OpenSandbox Python SDK
(1.1.1) on sandbolt's lifecycle → controller → agent (containerd fast path).

Two steps, run one at a time by the Rust driver (tests/tests/snapshots_sdk.rs),
which checks the controller's record and containerd in between and after:

1. `test_snapshot_restore_fork_and_delete_while_in_use`: sandbox A gets files,
   a hard link, an owned file, a program "installed" into /usr/local/bin, a
   file of the image deleted and a directory of the image replaced; A is
   snapshotted (polled until Ready) and mutated further; B and C are created
   from the snapshot: both see the snapshot's state, none of A's later
   writes, and diverge from each other; A is deleted and B still runs; B is
   deleted; the snapshot is deleted while C uses it → Deleting, and no new
   sandbox can be created from it. C is left running.
2. `test_deleting_the_last_user_removes_the_snapshot`: C is deleted → the
   snapshot goes (GET → 404, gone from the list).

Environment: LIFECYCLE_DOMAIN, LIFECYCLE_API_KEY (see lifecycle_env.py),
SNAPSHOT_IMAGE (busybox on the bed), SNAPSHOT_STATE (JSON file the steps and
the driver share: ids of A, B, C and the snapshot)."""

import json
import os
import time
from datetime import timedelta

from opensandbox import SandboxManagerSync, SandboxSync
from opensandbox.exceptions import SandboxApiException
from opensandbox.models.sandboxes import SnapshotFilter
from lifecycle_env import config

IMAGE = os.environ["SNAPSHOT_IMAGE"]
STATE = os.environ["SNAPSHOT_STATE"]
READY_WITHIN = 180
GONE_WITHIN = 90
RESOURCE = {"cpu": "500m", "memory": "256Mi"}
BLOB_BYTES = 5 << 20

# What A holds when it is snapshotted.
SETUP = """
set -e
mkdir -p /root/work /usr/local/bin
echo v1 > /root/work/a.txt
ln /root/work/a.txt /root/work/a.link
head -c %d /dev/urandom > /root/work/blob
echo owned > /root/work/owned && chown 65534:65534 /root/work/owned && chmod 640 /root/work/owned
printf '#!/bin/sh\\necho "hello from $0"\\n' > /usr/local/bin/hello
chmod 755 /usr/local/bin/hello
rm /etc/group
rm -rf /home && mkdir /home && echo replaced > /home/new
""" % BLOB_BYTES

# A's writes after the snapshot: none may show in B or C.
LATER = """
set -e
echo v2 > /root/work/a.txt
echo later > /root/work/later.txt
rm /usr/local/bin/hello
echo 'root:x:0:' > /etc/group
echo later > /home/later
"""


def sh(sbx: SandboxSync, cmd: str) -> str:
    ex = sbx.commands.run(cmd)
    out = "".join(m.text for m in ex.logs.stdout)
    err = "".join(m.text for m in ex.logs.stderr)
    assert ex.exit_code == 0, f"{cmd!r} in {sbx.id}: exit {ex.exit_code}: {out} {err}"
    return out


def exists(sbx: SandboxSync, path: str) -> bool:
    return sh(sbx, f"if [ -e {path} ]; then echo yes; else echo no; fi").strip() == "yes"


def create(**kw) -> SandboxSync:
    kw.setdefault("connection_config", config())
    kw.setdefault("ready_timeout", timedelta(seconds=60))
    kw.setdefault("timeout", timedelta(minutes=15))
    kw.setdefault("resource", RESOURCE)
    return SandboxSync.create(**kw)


def save(state: dict) -> None:
    with open(STATE, "w") as f:
        json.dump(state, f)


def load() -> dict:
    with open(STATE) as f:
        return json.load(f)


def wait_ready(mgr: SandboxManagerSync, snapshot_id: str):
    deadline = time.monotonic() + READY_WITHIN
    while True:
        snap = mgr.get_snapshot(snapshot_id)
        state = snap.status.state
        assert state != "Failed", f"snapshot {snapshot_id} failed: {snap.status}"
        if state == "Ready":
            return snap
        assert state == "Creating", f"snapshot {snapshot_id}: {snap.status}"
        assert time.monotonic() < deadline, f"snapshot {snapshot_id} not Ready: {snap.status}"
        time.sleep(0.2)


def wait_sandbox_gone(mgr: SandboxManagerSync, sandbox_id: str) -> None:
    deadline = time.monotonic() + GONE_WITHIN
    while True:
        try:
            mgr.get_sandbox_info(sandbox_id)
        except SandboxApiException as e:
            assert e.status_code == 404, f"get {sandbox_id}: {e}"
            return
        assert time.monotonic() < deadline, f"sandbox {sandbox_id} still there"
        time.sleep(0.2)


def snapshot_state(sbx: SandboxSync) -> dict:
    """What a sandbox holds of the paths the snapshot is about."""
    return {
        "a": sh(sbx, "cat /root/work/a.txt"),
        "blob": sh(sbx, "sha256sum /root/work/blob | cut -d' ' -f1"),
        "owned": sh(sbx, "stat -c '%u:%g %a' /root/work/owned; cat /root/work/owned"),
        "hello": exists(sbx, "/usr/local/bin/hello") and sh(sbx, "hello"),
        "group": exists(sbx, "/etc/group"),
        "passwd": sh(sbx, "head -1 /etc/passwd"),
        "home": sh(sbx, "ls /home; cat /home/new"),
        "later": exists(sbx, "/root/work/later.txt"),
    }


def assert_restored(sbx: SandboxSync, expected: dict) -> None:
    got = snapshot_state(sbx)
    assert got == expected, f"{sbx.id} does not hold the snapshot's state:\n{got}\n!=\n{expected}"
    # A hard link made in A is still one file (two names), not two copies.
    inodes = sh(sbx, "stat -c %i /root/work/a.txt /root/work/a.link").split()
    assert inodes[0] == inodes[1], f"{sbx.id}: hard link lost: {inodes}"


def test_snapshot_restore_fork_and_delete_while_in_use():
    mgr = SandboxManagerSync.create(connection_config=config())
    a = create(image=IMAGE, entrypoint=["sleep", "3600"])
    state = {"a": a.id}
    save(state)
    sh(a, SETUP)
    assert sh(a, "hello") == "hello from /usr/local/bin/hello\n"
    assert not exists(a, "/etc/group")
    expected = snapshot_state(a)
    assert expected["hello"] and not expected["group"] and not expected["later"], expected
    assert expected["owned"] == "65534:65534 640\nowned\n", expected

    snap = mgr.create_snapshot(a.id, name="sdk-snap")
    state["snapshot"] = snap.id
    save(state)
    assert snap.sandbox_id == a.id and snap.name == "sdk-snap", snap
    assert snap.status.state in ("Creating", "Ready"), snap.status
    snap = wait_ready(mgr, snap.id)
    listed = mgr.list_snapshots(SnapshotFilter(sandbox_id=a.id, states=["Ready"]))
    assert [s.id for s in listed.snapshot_infos] == [snap.id], listed
    # The capture thawed A: it runs and keeps changing.
    sh(a, LATER)
    assert sh(a, "cat /root/work/a.txt") == "v2\n"

    # B without an entrypoint (the contract's default), C with one.
    b = create(snapshot_id=snap.id)
    state["b"] = b.id
    save(state)
    c = create(snapshot_id=snap.id, entrypoint=["sleep", "3600"])
    state["c"] = c.id
    save(state)
    for restored in (b, c):
        assert_restored(restored, expected)

    # Each diverges on its own; A is untouched by either.
    sh(b, "echo b > /root/work/a.txt; touch /root/work/only-b")
    sh(c, "echo c > /root/work/only-c; rm /root/work/blob")
    assert sh(b, "cat /root/work/a.txt") == "b\n"
    assert (exists(b, "/root/work/only-c"), exists(b, "/root/work/blob")) == (False, True)
    assert sh(c, "cat /root/work/a.txt") == "v1\n"
    assert (exists(c, "/root/work/only-b"), exists(c, "/root/work/blob")) == (False, False)
    assert sh(a, "cat /root/work/a.txt") == "v2\n"
    assert not exists(a, "/root/work/only-b") and not exists(a, "/root/work/only-c")

    # A goes; B, created from its snapshot, still runs.
    a.kill()
    wait_sandbox_gone(mgr, a.id)
    assert sh(b, "echo alive; cat /root/work/a.txt") == "alive\nb\n"
    b.kill()
    wait_sandbox_gone(mgr, b.id)

    # Deleting it while C uses it: accepted, and it stays (Deleting).
    mgr.delete_snapshot(snap.id)
    snap = mgr.get_snapshot(snap.id)
    assert snap.status.state == "Deleting", snap.status
    try:
        extra = create(snapshot_id=snap.id)
    except SandboxApiException as e:
        assert e.status_code == 409, f"create from a Deleting snapshot: {e}"
    else:
        extra.kill()
        raise AssertionError(f"created {extra.id} from a Deleting snapshot")
    assert sh(c, "cat /root/work/a.txt /root/work/only-c") == "v1\nc\n"
    for sbx in (a, b, c):
        sbx.close()
    mgr.close()


def test_deleting_the_last_user_removes_the_snapshot():
    state = load()
    mgr = SandboxManagerSync.create(connection_config=config())
    snapshot_id = state["snapshot"]
    assert mgr.get_snapshot(snapshot_id).status.state == "Deleting"
    mgr.kill_sandbox(state["c"])
    wait_sandbox_gone(mgr, state["c"])
    deadline = time.monotonic() + GONE_WITHIN
    while True:
        try:
            snap = mgr.get_snapshot(snapshot_id)
        except SandboxApiException as e:
            assert e.status_code == 404, f"get snapshot {snapshot_id}: {e}"
            break
        assert snap.status.state == "Deleting", snap.status
        assert time.monotonic() < deadline, f"snapshot {snapshot_id} still there: {snap.status}"
        time.sleep(0.2)
    listed = mgr.list_snapshots(SnapshotFilter(sandbox_id=state["a"]))
    assert listed.snapshot_infos == [], listed
    mgr.close()
