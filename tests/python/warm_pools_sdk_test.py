"""Warm pools (issue 17) through the official OpenSandbox Python SDK (1.1.1) on
sandbolt's lifecycle → controller → agent: a `Sandbox.create` with
`extensions={"poolRef": ...}` and a plain create of the pool's image both come
back from the pool (REST `allocation.poolRef`), and what the request asked for
— env, entrypoint, the image's working dir, limits — is what the sandbox
sees, not what the idle warm sandbox had. REST says each was a claim
(`extensions["sandbolt.claimedWarm"]`).

The sandboxes are left running: the Rust driver
(tests/tests/warm_pools_sdk.rs) also asks the controller's native API
(`status.claimed_warm`, the container id), checks the two claims took distinct
warm sandboxes, and deletes them. Their ids go to the JSON file WARM_IDS ({test name: id}).

Environment: LIFECYCLE_DOMAIN, LIFECYCLE_API_KEY (see lifecycle_env.py),
WARM_POOL (the pool, made by the driver with POST /pools), WARM_IMAGE (its
template image: WORKDIR /srv/app, ENV IMAGE_ONLY=from-image), WARM_IDS."""

import json
import os
from datetime import timedelta

import httpx

from opensandbox import SandboxSync
from lifecycle_env import API_KEY, DOMAIN, config

POOL = os.environ["WARM_POOL"]
IMAGE = os.environ["WARM_IMAGE"]
IDS = os.environ["WARM_IDS"]
MIB = 1 << 20

# The template's env (set by the driver): TEMPLATE_ONLY=from-template,
# BOTH=template. The request's wins where both name a variable.
REQUEST_ENV = {"REQ_ONLY": "from-request", "BOTH": "request"}
ENTRYPOINT = [
    "sh",
    "-c",
    'echo "$REQ_ONLY $TEMPLATE_ONLY $BOTH $IMAGE_ONLY $(pwd)" > /tmp/entrypoint.txt; '
    "exec sleep 3600",
]


def http() -> httpx.Client:
    return httpx.Client(base_url=f"http://{DOMAIN}/v1", headers={"OPEN-SANDBOX-API-KEY": API_KEY}, timeout=60)


def sh(sbx: SandboxSync, cmd: str) -> str:
    ex = sbx.commands.run(cmd)
    assert ex.exit_code == 0, f"{cmd}: exit {ex.exit_code}"
    return "".join(m.text for m in ex.logs.stdout)


def cgroup_file(sbx, controller, name):
    """A file of the sandbox's own cgroup (v1 per controller, or v2)."""
    return sh(sbx, f"cat /sys/fs/cgroup/{controller}/{name} 2>/dev/null || cat /sys/fs/cgroup/{name}").strip()


def remember(key: str, sandbox_id: str) -> None:
    ids = {}
    if os.path.exists(IDS):
        with open(IDS) as f:
            ids = json.load(f)
    ids[key] = sandbox_id
    with open(IDS, "w") as f:
        json.dump(ids, f)


def allocation(sandbox_id: str) -> dict:
    """The sandbox's REST `allocation`, after checking that REST says it
    was claimed (`extensions["sandbolt.claimedWarm"]`)."""
    with http() as c:
        r = c.get(f"/sandboxes/{sandbox_id}")
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body.get("extensions") or {}).get("sandbolt.claimedWarm") == "true", body
    return body.get("allocation") or {}


def test_pool_ref_create_sees_the_requests_env_entrypoint_workdir_and_limits():
    sbx = SandboxSync.create(
        IMAGE,
        entrypoint=ENTRYPOINT,
        env=REQUEST_ENV,
        resource={"cpu": "250m", "memory": "96Mi"},
        extensions={"poolRef": POOL},
        timeout=timedelta(minutes=10),
        ready_timeout=timedelta(seconds=60),
        connection_config=config(),
    )
    try:
        remember("pool_ref", sbx.id)
        alloc = allocation(sbx.id)
        assert alloc.get("poolRef") == POOL, alloc
        assert alloc.get("mode", "pool") == "pool", alloc
        # The entrypoint ran once, with the merged env, in the image's WORKDIR
        # (execd writes the file only after the claim started it).
        assert sh(sbx, "cat /tmp/entrypoint.txt") == "from-request from-template request from-image /srv/app\n"
        # Later commands get the same env and working dir.
        assert sh(sbx, 'echo "$REQ_ONLY|$TEMPLATE_ONLY|$BOTH|$IMAGE_ONLY"') == "from-request|from-template|request|from-image\n"
        assert sh(sbx, "pwd") == "/srv/app\n"
        # The request's limits, not the template's (500m, 256Mi).
        assert int(cgroup_file(sbx, "memory", "memory.limit_in_bytes")) == 96 * MIB
        quota = int(cgroup_file(sbx, "cpu", "cpu.cfs_quota_us"))
        period = int(cgroup_file(sbx, "cpu", "cpu.cfs_period_us"))
        assert (quota, period) == (25_000, 100_000), (quota, period)
        # Nothing of the warm token: the SDK's execd calls work with the
        # claim's, and the env does not carry the warm one.
        env = sh(sbx, "env")
        tokens = [l for l in env.splitlines() if l.startswith("EXECD_ACCESS_TOKEN=")]
        assert len(tokens) <= 1, tokens
    finally:
        sbx.close()


def test_plain_create_of_the_warm_image_is_served_by_the_pool():
    sbx = SandboxSync.create(
        IMAGE,
        entrypoint=["sleep", "3600"],
        env={"REQ_ONLY": "plain"},
        timeout=timedelta(minutes=10),
        ready_timeout=timedelta(seconds=60),
        connection_config=config(),
    )
    try:
        remember("plain", sbx.id)
        alloc = allocation(sbx.id)
        assert alloc.get("poolRef") == POOL, alloc
        assert sh(sbx, 'echo "$REQ_ONLY $(pwd)"') == "plain /srv/app\n"
    finally:
        sbx.close()
