"""The official OpenSandbox Python SDK (1.1.1) against a sandbolt lifecycle
that itself runs inside a container with only the Docker socket mounted
(Station PRD). Started by lifecycle/tests/docker_in_container.rs, which sets:
  LIFECYCLE_DOMAIN   host:port the lifecycle container is published on
  LIFECYCLE_API_KEY  its API key
  SANDBOLT_IMAGE     the sandbox image present on the engine (busybox)
  SANDBOLT_ENDPOINT_HOST  the host every endpoint must name (the bridge gateway)
Every variable is required: a missing one fails, never skips.
"""

import os
from datetime import timedelta

import httpx
from opensandbox.exceptions import SandboxException

from opensandbox import SandboxSync
from lifecycle_env import API_KEY, DOMAIN, config
from opensandbox.models.filesystem import WriteEntry

IMAGE = os.environ["SANDBOLT_IMAGE"]
ENDPOINT_HOST = os.environ["SANDBOLT_ENDPOINT_HOST"]


def test_sdk_through_a_containerized_lifecycle():
    sbx = SandboxSync.create(
        IMAGE,
        entrypoint=["sleep", "infinity"],
        timeout=timedelta(minutes=5),
        metadata={"suite": "in-container"},
        connection_config=config(),
        ready_timeout=timedelta(seconds=60),
    )
    try:
        info = sbx.get_info()
        assert info.status.state == "Running"

        with httpx.Client(
            base_url=f"http://{DOMAIN}",
            headers={"OPEN-SANDBOX-API-KEY": API_KEY},
            timeout=60,
        ) as c:
            r = c.get(f"/v1/sandboxes/{sbx.id}/endpoints/44772")
            assert r.status_code == 200, r.text
            endpoint = r.json()["endpoint"]
            # Published on the Docker host, named so the client can dial it.
            assert endpoint.startswith(f"{ENDPOINT_HOST}:"), endpoint

            # The lifecycle's own reverse proxy reaches execd from inside
            # its container too.
            r = c.get(f"/v1/sandboxes/{sbx.id}/proxy/44772/ping")
            assert r.status_code == 200, r.text

        sbx.files.write_files(
            [WriteEntry(path="/tmp/station.txt", data="written-via-station", mode=644)]
        )
        assert sbx.files.read_file("/tmp/station.txt") == "written-via-station"

        ex = sbx.commands.run("cat /tmp/station.txt; echo; echo exit-ok")
        out = "".join(m.text for m in ex.logs.stdout)
        assert ex.error is None, ex.error
        assert out.split() == ["written-via-station", "exit-ok"], out
    finally:
        try:
            sbx.kill()
        except SandboxException as e:
            # Seen under parallel load: the DELETE is carried out (the server
            # logs "sandbox deleted") but the SDK's transport sends it again
            # and gets 404. What matters is the end state: the sandbox is gone.
            if "SANDBOX_NOT_FOUND" not in str(e):
                raise
        with httpx.Client(base_url=f"http://{DOMAIN}", headers={"OPEN-SANDBOX-API-KEY": API_KEY},
                          timeout=60) as c:
            r = c.get(f"/v1/sandboxes/{sbx.id}")
            assert r.status_code == 404, r.text
        sbx.close()
