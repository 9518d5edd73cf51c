"""Named volumes through the official OpenSandbox Python SDK (1.1.1) on the
controller backend: a `pvc` in `Sandbox.create` names a sandbolt named
volume, created on first use; what one sandbox writes, the next one reads;
`createIfNotExists: false` refuses a missing volume; a volume made with
`deleteOnSandboxTermination` goes with its sandbox. The volume routes are
checked over plain HTTP (the SDK has no client for them).

Environment: LIFECYCLE_DOMAIN, LIFECYCLE_API_KEY, SANDBOLT_IMAGE (see
tests/python/lifecycle_env.py, on PYTHONPATH)."""

import os
import uuid
from datetime import timedelta

import httpx
import pytest

from opensandbox import SandboxSync
from opensandbox.exceptions import SandboxException
from opensandbox.models.sandboxes import PVC, Volume
from lifecycle_env import API_KEY, DOMAIN, config

IMAGE = os.environ["SANDBOLT_IMAGE"]


def http() -> httpx.Client:
    return httpx.Client(base_url=f"http://{DOMAIN}/v1", headers={"OPEN-SANDBOX-API-KEY": API_KEY}, timeout=60)


def create(volumes) -> SandboxSync:
    return SandboxSync.create(
        IMAGE,
        entrypoint=["sleep", "infinity"],
        timeout=timedelta(minutes=5),
        ready_timeout=timedelta(seconds=60),
        connection_config=config(),
        volumes=volumes,
    )


def sh(sbx: SandboxSync, cmd: str) -> str:
    ex = sbx.commands.run(cmd)
    return "".join(m.text for m in ex.logs.stdout)


def claim() -> str:
    return "sdk-" + uuid.uuid4().hex[:10]


def test_a_pvc_carries_data_from_one_sandbox_to_the_next():
    name = claim()
    vol = [Volume(name="work", mount_path="/work", pvc=PVC(claim_name=name, storage="64Mi", access_modes=["ReadWriteOnce"]))]
    first = create(vol)
    try:
        assert sh(first, "echo from-first > /work/result.txt; echo rc=$?").strip() == "rc=0"
        with http() as c:
            v = c.get(f"/volumes/{name}").json()
        # Created on first use with the request's hints.
        assert v["accessMode"] == "ReadWriteOnce", v
        assert v["size"] == "64Mi", v
        assert [m["sandboxId"] for m in v["mounts"]] == [first.id], v
    finally:
        first.kill()
        first.close()
    second = create([Volume(name="work", mount_path="/work", pvc=PVC(claim_name=name, create_if_not_exists=False))])
    try:
        assert sh(second, "cat /work/result.txt") == "from-first\n"
    finally:
        second.kill()
        second.close()
    with http() as c:
        assert c.delete(f"/volumes/{name}").status_code == 204


def test_create_if_not_exists_false_refuses_a_missing_volume():
    name = claim()
    with pytest.raises(SandboxException) as e:
        create([Volume(name="work", mount_path="/work", pvc=PVC(claim_name=name, create_if_not_exists=False))])
    assert name in str(e.value), e.value
    with http() as c:
        assert c.get(f"/volumes/{name}").status_code == 404


def test_delete_on_sandbox_termination_removes_the_volume_it_made():
    name = claim()
    sbx = create([Volume(name="work", mount_path="/work", pvc=PVC(claim_name=name, delete_on_sandbox_termination=True))])
    try:
        assert sh(sbx, "echo x > /work/f; echo rc=$?").strip() == "rc=0"
        with http() as c:
            assert c.get(f"/volumes/{name}").status_code == 200
    finally:
        sbx.kill()
        sbx.close()
    with http() as c:
        r = c.get(f"/volumes/{name}")
    assert r.status_code == 404, r.text
    assert r.json()["code"] == "VOLUME_NOT_FOUND"


def test_storage_class_other_than_local_is_refused_by_name():
    with pytest.raises(SandboxException) as e:
        create([Volume(name="work", mount_path="/work", pvc=PVC(claim_name=claim(), storage_class="gp3"))])
    assert "storageClass" in str(e.value) and "gp3" in str(e.value), e.value
