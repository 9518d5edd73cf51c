"""Volume requests (OSEP-0003) against a running sandbolt lifecycle server:
validation rules (accept and reject), read-only bindings, and data of a
read-write binding outliving the sandbox. Environment as in
lifecycle_sdk_test.py, plus SANDBOLT_HOST_ROOT (the allowed host-path root:
the lifecycle's allow_host_paths on Docker, the agent's allowlist on the
controller backend).

Where a rule is checked depends on who mounts: on Docker the lifecycle checks
host paths on its own filesystem (VOLUME::* codes); on the controller backend
the lifecycle checks syntax only and the agent of the node the sandbox lands
on checks the allowlist, existence and symlinks (a 400 with its reason).
"""

import os
import uuid
from datetime import timedelta

import httpx
import pytest

from opensandbox import SandboxSync
from lifecycle_env import API_KEY, DOMAIN, config

IMAGE = os.environ["SANDBOLT_IMAGE"]
BACKEND = os.environ["SANDBOLT_BACKEND"]
ROOT = os.environ["SANDBOLT_HOST_ROOT"]
assert BACKEND in ("docker", "controller"), BACKEND


def http() -> httpx.Client:
    return httpx.Client(
        base_url=f"http://{DOMAIN}/v1",
        headers={"OPEN-SANDBOX-API-KEY": API_KEY},
        timeout=60,
    )


def body(**extra) -> dict:
    b = {"image": {"uri": IMAGE}, "entrypoint": ["sleep", "infinity"], "timeout": 300, "resourceLimits": {}}
    b.update(extra)
    return b


def fresh_dir(*parts) -> str:
    d = os.path.join(ROOT, uuid.uuid4().hex[:8], *parts)
    os.makedirs(d)
    return d


def sh(sbx: SandboxSync, cmd: str) -> str:
    ex = sbx.commands.run(cmd)
    return "".join(m.text for m in ex.logs.stdout)


def rejected(payload: dict, code: str, *words: str) -> None:
    with http() as c:
        r = c.post("/sandboxes", json=payload)
    assert r.status_code == 400, r.text
    err = r.json()
    assert set(err) == {"code", "message"}, err
    assert err["code"] == code, err
    for w in words:
        assert w in err["message"], err


def node_rejected(payload: dict, docker: tuple, controller: tuple) -> None:
    """A rule only the machine that mounts can check: on Docker the
    lifecycle's code and words, on the controller backend the node's."""
    if BACKEND == "docker":
        rejected(payload, *docker)
    else:
        rejected(payload, "INVALID_REQUEST", *controller)


def create_raw(payload: dict) -> SandboxSync:
    with http() as c:
        r = c.post("/sandboxes", json=payload)
    assert r.status_code == 202, r.text
    return SandboxSync.connect(r.json()["id"], connection_config=config())


def test_read_only_host_volume_is_read_only_inside():
    d = fresh_dir()
    with open(os.path.join(d, "given.txt"), "w") as f:
        f.write("from-host")
    sbx = create_raw(body(volumes=[{"name": "ro", "host": {"path": d}, "mountPath": "/mnt/ro", "readOnly": True}]))
    try:
        assert sh(sbx, "cat /mnt/ro/given.txt") == "from-host"
        out = sh(sbx, "touch /mnt/ro/new 2>/dev/null; echo rc=$?")
        assert out.strip() == "rc=1", out
        assert not os.path.exists(os.path.join(d, "new"))
    finally:
        sbx.kill()
        sbx.close()


def test_read_write_seed_binding_with_subpath_keeps_data_after_delete():
    d = fresh_dir("task-001")
    base = os.path.dirname(d)
    sbx = create_raw(
        body(
            volumes=[{"name": "workdir", "backendType": "local", "backendRef": base}],
            volumeBindings=[{"volumeName": "workdir", "mountPath": "/mnt/work", "accessMode": "RW", "subPath": "task-001"}],
        )
    )
    try:
        assert sh(sbx, "echo artifact > /mnt/work/out.txt; echo rc=$?").strip() == "rc=0"
    finally:
        sbx.kill()
        sbx.close()
    with open(os.path.join(d, "out.txt")) as f:
        assert f.read() == "artifact\n"


def test_seed_read_only_binding():
    d = fresh_dir()
    sbx = create_raw(
        body(
            volumes=[{"name": "w", "backendType": "local", "backendRef": d}],
            volumeBindings=[{"volumeName": "w", "mountPath": "/mnt/w", "accessMode": "RO"}],
        )
    )
    try:
        out = sh(sbx, "touch /mnt/w/x 2>/dev/null; echo rc=$?")
        assert out.strip() == "rc=1", out
    finally:
        sbx.kill()
        sbx.close()


def test_host_path_outside_allowlist_rejected():
    node_rejected(
        body(volumes=[{"name": "x", "host": {"path": "/etc"}, "mountPath": "/mnt/x"}]),
        ("VOLUME::HOST_PATH_NOT_ALLOWED", "/etc"),
        ("/etc", "allowlisted root"),
    )


def test_relative_and_unnormalized_host_paths_rejected():
    d = fresh_dir()
    rejected(body(volumes=[{"name": "x", "host": {"path": "relative/dir"}, "mountPath": "/mnt/x"}]), "VOLUME::INVALID_HOST_PATH")
    rejected(body(volumes=[{"name": "x", "host": {"path": d + "/../.."}, "mountPath": "/mnt/x"}]), "VOLUME::INVALID_HOST_PATH")
    rejected(
        body(
            volumes=[{"name": "w", "backendType": "local", "backendRef": "data/rel"}],
            volumeBindings=[{"volumeName": "w", "mountPath": "/m", "accessMode": "RW"}],
        ),
        "VOLUME::INVALID_HOST_PATH",
    )


def test_symlink_escape_rejected():
    d = fresh_dir()
    os.symlink("/etc", os.path.join(d, "escape"))
    node_rejected(
        body(volumes=[{"name": "x", "host": {"path": d + "/escape"}, "mountPath": "/mnt/x"}]),
        ("VOLUME::HOST_PATH_NOT_ALLOWED", "symlink"),
        ("symlink",),
    )
    node_rejected(
        body(volumes=[{"name": "x", "host": {"path": d}, "subPath": "escape", "mountPath": "/mnt/x"}]),
        ("VOLUME::HOST_PATH_NOT_ALLOWED",),
        ("symlink",),
    )


def test_missing_host_path_rejected():
    d = fresh_dir()
    node_rejected(
        body(volumes=[{"name": "x", "host": {"path": d + "/nope"}, "mountPath": "/mnt/x"}]),
        ("VOLUME::HOST_PATH_NOT_FOUND", "/nope"),
        ("/nope", "does not exist"),
    )


@pytest.mark.parametrize("sub", ["../up", "a/../../up", "/abs"])
def test_bad_subpath_rejected(sub):
    d = fresh_dir()
    rejected(body(volumes=[{"name": "x", "host": {"path": d}, "subPath": sub, "mountPath": "/mnt/x"}]), "VOLUME::INVALID_SUB_PATH")


@pytest.mark.parametrize("name", ["Bad_Name", "-lead", "trail-", "UPPER"])
def test_pvc_name_must_be_dns1123(name):
    rejected(body(volumes=[{"name": "x", "pvc": {"claimName": name}, "mountPath": "/mnt/x"}]), "VOLUME::INVALID_PVC_NAME")
    rejected(
        body(
            volumes=[{"name": "w", "backendType": "pvc", "backendRef": name}],
            volumeBindings=[{"volumeName": "w", "mountPath": "/m", "accessMode": "RW"}],
        ),
        "VOLUME::INVALID_PVC_NAME",
    )


@pytest.mark.parametrize("ref", ["nfs.local", "srv:relative", ":/export", "srv:/a/../b"])
def test_nfs_ref_format_rejected(ref):
    rejected(
        body(
            volumes=[{"name": "w", "backendType": "nfs", "backendRef": ref}],
            volumeBindings=[{"volumeName": "w", "mountPath": "/m", "accessMode": "RW"}],
        ),
        "VOLUME::INVALID_BACKEND",
    )


def test_backends_the_runtime_cannot_serve_name_backend_and_runtime():
    rejected(
        body(
            volumes=[{"name": "w", "backendType": "nfs", "backendRef": "10.0.0.1:/exports/a"}],
            volumeBindings=[{"volumeName": "w", "mountPath": "/m", "accessMode": "RW"}],
        ),
        "VOLUME::UNSUPPORTED_BACKEND",
        "nfs",
        BACKEND,
    )
    rejected(
        body(volumes=[{"name": "o", "ossfs": {"bucket": "bucket-a", "endpoint": "oss.example"}, "mountPath": "/m"}]),
        "VOLUME::UNSUPPORTED_BACKEND",
        "ossfs",
        BACKEND,
    )


def test_mount_path_rules():
    rejected(body(volumes=[{"name": "x", "pvc": {"claimName": "c"}, "mountPath": "relative"}]), "VOLUME::INVALID_MOUNT_PATH")
    rejected(body(volumes=[{"name": "x", "pvc": {"claimName": "c"}, "mountPath": "/opt/sandbolt"}]), "VOLUME::INVALID_MOUNT_PATH")


def test_access_mode_must_be_rw_or_ro():
    d = fresh_dir()
    rejected(
        body(
            volumes=[{"name": "w", "backendType": "local", "backendRef": d}],
            volumeBindings=[{"volumeName": "w", "mountPath": "/m", "accessMode": "rw"}],
        ),
        "VOLUME::INVALID_ACCESS_MODE",
    )


def test_pvc_is_a_named_volume_that_outlives_the_sandbox():
    # Docker: a Docker named volume. Controller: a sandbolt named volume on
    # the agent's volume root (controller_sdk.rs gives the agent one).
    claim = "sbx-" + uuid.uuid4().hex[:10]
    vol = [{"name": "data", "pvc": {"claimName": claim}, "mountPath": "/data"}]
    first = create_raw(body(volumes=vol))
    try:
        assert sh(first, "echo kept > /data/f; echo rc=$?").strip() == "rc=0"
    finally:
        first.kill()
        first.close()
    second = create_raw(body(volumes=vol))
    try:
        assert sh(second, "cat /data/f") == "kept\n"
    finally:
        second.kill()
        second.close()


def test_pvc_fields_nobody_serves_are_refused_not_ignored():
    with http() as c:
        r = c.post("/sandboxes", json=body(volumes=[{"name": "data", "pvc": {"claimName": "claim-a", "sizeLimit": "1Gi"}, "mountPath": "/data"}]))
    assert r.status_code == 400, r.text
    assert "sizeLimit" in r.json()["message"], r.text


def test_pvc_create_if_not_exists_false_refuses_a_missing_volume():
    claim = "missing-" + uuid.uuid4().hex[:10]
    with http() as c:
        r = c.post("/sandboxes", json=body(volumes=[{"name": "data", "pvc": {"claimName": claim, "createIfNotExists": False}, "mountPath": "/data"}]))
    assert r.status_code == 404, r.text
    assert r.json()["code"] == "VOLUME_NOT_FOUND", r.text
    assert claim in r.json()["message"], r.text


def test_refused_volumes_leave_no_sandbox_behind():
    with http() as c:
        before = c.get("/sandboxes", params={"pageSize": 200}).json()["pagination"]["totalItems"]
        r = c.post("/sandboxes", json=body(volumes=[{"name": "x", "host": {"path": "/etc"}, "mountPath": "/mnt/x"}]))
        assert r.status_code == 400, r.text
        after = c.get("/sandboxes", params={"pageSize": 200}).json()["pagination"]["totalItems"]
    assert after == before
