"""Warm pools through the official OpenSandbox Python SDK (1.1.1) on the
controller backend: a pool made over plain HTTP (`POST /v1/pools`; the SDK
has no client for it) fills its buffer, and `Sandbox.create(image,
extensions={"poolRef": pool})` is served by claiming one of its warm
sandboxes: the sandbox runs the request's entrypoint with the request's env
over the template's, and both the SDK's `get_info()` and the REST
`GET /v1/sandboxes/{id}` say it is allocated from the pool.

Environment: LIFECYCLE_DOMAIN, LIFECYCLE_API_KEY, SANDBOLT_IMAGE (see
tests/python/lifecycle_env.py, on PYTHONPATH)."""

import os
import time
import uuid
from datetime import timedelta

import httpx
import pytest

from opensandbox import SandboxSync
from lifecycle_env import API_KEY, DOMAIN, config

IMAGE = os.environ["SANDBOLT_IMAGE"]
POOL = "sdk-warm-" + uuid.uuid4().hex[:8]
# Warm sandboxes take a moment each (one start at a time per agent).
FILL_WITHIN_SECS = 90


def http() -> httpx.Client:
    return httpx.Client(base_url=f"http://{DOMAIN}/v1", headers={"OPEN-SANDBOX-API-KEY": API_KEY}, timeout=60)


def available(c: httpx.Client) -> int:
    r = c.get(f"/pools/{POOL}")
    assert r.status_code == 200, r.text
    return (r.json().get("status") or {}).get("available", 0)


@pytest.fixture(scope="module")
def pool():
    body = {
        "name": POOL,
        "template": {
            "metadata": {"labels": {"team": "sdk"}},
            "spec": {
                "containers": [
                    {
                        "name": "sandbox",
                        "image": IMAGE,
                        "env": [{"name": "FROM_TEMPLATE", "value": "warm"}, {"name": "BOTH", "value": "template"}],
                        "resources": {"limits": {"cpu": "500m", "memory": "128Mi"}},
                    }
                ]
            },
        },
        "capacitySpec": {"bufferMin": 1, "bufferMax": 2, "poolMin": 0, "poolMax": 4},
    }
    with http() as c:
        r = c.post("/pools", json=body)
        assert r.status_code == 201, r.text
        assert r.json()["name"] == POOL, r.text
        deadline = time.monotonic() + FILL_WITHIN_SECS
        while available(c) < 1:
            assert time.monotonic() < deadline, f"pool {POOL} never had a warm sandbox: {c.get(f'/pools/{POOL}').text}"
            time.sleep(0.5)
    yield POOL
    with http() as c:
        r = c.delete(f"/pools/{POOL}")
        assert r.status_code == 204, r.text


def sh(sbx: SandboxSync, cmd: str) -> str:
    ex = sbx.commands.run(cmd)
    return "".join(m.text for m in ex.logs.stdout)


def test_a_pool_ref_create_is_a_claim_that_works(pool):
    sbx = SandboxSync.create(
        IMAGE,
        entrypoint=["sh", "-c", "echo started-by-claim > /tmp/entry; exec sleep infinity"],
        env={"FROM_REQUEST": "asked", "BOTH": "request"},
        resource={"cpu": "250m", "memory": "64Mi"},
        timeout=timedelta(minutes=5),
        ready_timeout=timedelta(seconds=60),
        connection_config=config(),
        extensions={"poolRef": pool},
    )
    try:
        # The request's entrypoint ran; the request's env over the template's.
        assert sh(sbx, "cat /tmp/entry") == "started-by-claim\n"
        assert sh(sbx, 'echo "$FROM_REQUEST|$FROM_TEMPLATE|$BOTH"') == "asked|warm|request\n"
        info = sbx.get_info()
        assert info.allocation is not None and info.allocation.pool_ref == pool, info
        with http() as c:
            got = c.get(f"/sandboxes/{sbx.id}").json()
        assert got["allocation"] == {"mode": "pool", "poolRef": pool, "state": "allocated"}, got
        assert got["extensions"] == {"sandbolt.claimedWarm": "true"}, got
        assert got["status"]["state"] == "Running", got
    finally:
        sbx.kill()
        sbx.close()


def test_a_plain_create_of_the_pools_image_is_served_from_it(pool):
    with http() as c:
        deadline = time.monotonic() + FILL_WITHIN_SECS
        while available(c) < 1:
            assert time.monotonic() < deadline, c.get(f"/pools/{POOL}").text
            time.sleep(0.5)
    # No poolRef: the pool's image and runtime are the request's, so a
    # warm sandbox of it serves the create.
    sbx = SandboxSync.create(
        IMAGE,
        entrypoint=["sleep", "infinity"],
        env={"FROM_REQUEST": "plain"},
        resource={"cpu": "250m", "memory": "64Mi"},
        timeout=timedelta(minutes=5),
        ready_timeout=timedelta(seconds=60),
        connection_config=config(),
    )
    try:
        assert sh(sbx, "echo $FROM_REQUEST") == "plain\n"
        with http() as c:
            got = c.get(f"/sandboxes/{sbx.id}").json()
        assert got["allocation"] == {"mode": "pool", "poolRef": pool, "state": "allocated"}, got
        assert got["extensions"] == {"sandbolt.claimedWarm": "true"}, got
    finally:
        sbx.kill()
        sbx.close()


def test_the_pool_is_listed_with_its_capacity(pool):
    with http() as c:
        items = c.get("/pools").json()["items"]
        mine = [p for p in items if p["name"] == pool]
        assert len(mine) == 1, items
        assert mine[0]["capacitySpec"] == {"bufferMax": 2, "bufferMin": 1, "poolMax": 4, "poolMin": 0}, mine
        assert set(mine[0]["status"]) == {"total", "allocated", "available", "revision"}, mine
