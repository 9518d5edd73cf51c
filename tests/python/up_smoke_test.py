"""The main job, as a user meets it: `sandbolt up` on one machine, driven by
the official OpenSandbox SDK with nothing but a domain and an API key."""

import os
from datetime import timedelta

import httpx
from opensandbox import SandboxSync
from opensandbox.config.connection_sync import ConnectionConfigSync
from opensandbox.models.filesystem import WriteEntry

DOMAIN = os.environ["LIFECYCLE_DOMAIN"]
API_KEY = os.environ["LIFECYCLE_API_KEY"]


def test_sdk_round_trip_through_sandbolt_up():
    config = ConnectionConfigSync(domain=DOMAIN, api_key=API_KEY, protocol="http",
                                  request_timeout=timedelta(seconds=60))
    sbx = SandboxSync.create("busybox", entrypoint=["sleep", "3600"], connection_config=config,
                             timeout=timedelta(minutes=5), ready_timeout=timedelta(seconds=60))
    try:
        ex = sbx.commands.run("echo hello-from-up; id -u")
        out = "".join(m.text for m in ex.logs.stdout)
        assert "hello-from-up" in out, out
        sbx.files.write_files([WriteEntry(path="/tmp/up.txt", data="written through up")])
        assert sbx.files.read_file("/tmp/up.txt") == "written through up"
    finally:
        sbx.kill()
    # The lifecycle API refuses a request without the key.
    r = httpx.get(f"http://{DOMAIN}/v1/sandboxes", timeout=10)
    assert r.status_code == 401, r.text
