"""End-to-end suite of the official OpenSandbox Python SDK (1.1.1) against a
running sandbolt lifecycle server.

Started by the Rust integration tests in lifecycle/tests/, which set:
  LIFECYCLE_DOMAIN   host:port of the lifecycle API
  LIFECYCLE_API_KEY  its API key
  SANDBOLT_IMAGE     an image present on the backend (busybox)
  SANDBOLT_HOST_ROOT an allow_host_paths directory (volume tests), optional
  SANDBOLT_BACKEND   docker | controller
Every variable is required where used: a missing one fails, never skips.
"""

import os
import time
import uuid
from datetime import timedelta

import httpx
import pytest

from opensandbox import SandboxManagerSync, SandboxSync
from lifecycle_env import API_KEY, DOMAIN, config
from opensandbox.exceptions import SandboxException
from opensandbox.models.filesystem import WriteEntry
from opensandbox.models.sandboxes import SandboxFilter

IMAGE = os.environ["SANDBOLT_IMAGE"]
BACKEND = os.environ["SANDBOLT_BACKEND"]
ENTRY = ["sleep", "infinity"]


def http() -> httpx.Client:
    return httpx.Client(
        base_url=f"http://{DOMAIN}",
        headers={"OPEN-SANDBOX-API-KEY": API_KEY},
        timeout=60,
    )


@pytest.fixture
def tag() -> str:
    # Per-test metadata value so list assertions ignore other tests' sandboxes.
    return "t" + uuid.uuid4().hex[:12]


def create(**kw) -> SandboxSync:
    kw.setdefault("entrypoint", ENTRY)
    kw.setdefault("connection_config", config())
    kw.setdefault("ready_timeout", timedelta(seconds=60))
    return SandboxSync.create(IMAGE, **kw)


def run(sbx: SandboxSync, cmd: str) -> tuple[str, object]:
    ex = sbx.commands.run(cmd)
    out = "".join(m.text for m in ex.logs.stdout)
    return out, ex


def test_create_with_timeout_runs_commands_and_files():
    sbx = create(timeout=timedelta(minutes=5), metadata={"suite": "sdk"})
    try:
        info = sbx.get_info()
        assert info.id == sbx.id
        assert info.status.state == "Running"
        assert info.expires_at is not None
        assert info.entrypoint == ENTRY
        # expiry is ~5 minutes after creation
        delta = (info.expires_at - info.created_at).total_seconds()
        assert 290 <= delta <= 310, delta

        out, ex = run(sbx, "echo hello-from-sandbox")
        assert out.strip() == "hello-from-sandbox"
        assert ex.error is None

        sbx.files.write_files([WriteEntry(path="/tmp/sdk.txt", data="payload-123", mode=644)])
        assert sbx.files.read_file("/tmp/sdk.txt") == "payload-123"
        out, _ = run(sbx, "cat /tmp/sdk.txt")
        assert out == "payload-123"
    finally:
        sbx.kill()
        sbx.close()


def test_manual_cleanup_sandbox_has_no_expiry_and_renew_is_409():
    sbx = create(timeout=None)
    try:
        info = sbx.get_info()
        assert info.expires_at is None
        with http() as c:
            raw = c.get(f"/v1/sandboxes/{sbx.id}").json()
            assert "expiresAt" not in raw, raw  # omitted, not null
            r = c.post(
                f"/v1/sandboxes/{sbx.id}/renew-expiration",
                json={"expiresAt": "2099-01-01T00:00:00Z"},
            )
            assert r.status_code == 409, r.text
            assert r.json() == {
                "code": r.json()["code"],
                "message": f"Sandbox {sbx.id} does not have automatic expiration enabled.",
            }
        with pytest.raises(SandboxException):
            sbx.renew(timedelta(minutes=10))
    finally:
        sbx.kill()
        sbx.close()


def test_renew_moves_expiry():
    sbx = create(timeout=timedelta(minutes=2))
    try:
        before = sbx.get_info().expires_at
        resp = sbx.renew(timedelta(minutes=30))
        after = sbx.get_info().expires_at
        assert after > before
        assert abs((after - resp.expires_at).total_seconds()) < 1
    finally:
        sbx.kill()
        sbx.close()


def test_list_filters_and_paging(tag):
    mgr = SandboxManagerSync.create(connection_config=config())
    boxes = [create(timeout=timedelta(minutes=5), metadata={"run": tag, "idx": str(i)}) for i in range(3)]
    try:
        page1 = mgr.list_sandbox_infos(SandboxFilter(metadata={"run": tag}, page_size=2, page=1))
        assert page1.pagination.total_items == 3
        assert page1.pagination.total_pages == 2
        assert page1.pagination.has_next_page
        assert len(page1.sandbox_infos) == 2
        page2 = mgr.list_sandbox_infos(SandboxFilter(metadata={"run": tag}, page_size=2, page=2))
        assert len(page2.sandbox_infos) == 1
        assert not page2.pagination.has_next_page
        ids = {s.id for s in page1.sandbox_infos + page2.sandbox_infos}
        assert ids == {b.id for b in boxes}

        one = mgr.list_sandbox_infos(SandboxFilter(metadata={"run": tag, "idx": "1"}))
        assert [s.id for s in one.sandbox_infos] == [boxes[1].id]

        boxes[0].pause()
        paused = mgr.list_sandbox_infos(SandboxFilter(states=["Paused"], metadata={"run": tag}))
        assert [s.id for s in paused.sandbox_infos] == [boxes[0].id]
        running = mgr.list_sandbox_infos(SandboxFilter(states=["Running"], metadata={"run": tag}))
        assert {s.id for s in running.sandbox_infos} == {boxes[1].id, boxes[2].id}
        both = mgr.list_sandbox_infos(SandboxFilter(states=["Running", "Paused"], metadata={"run": tag}))
        assert both.pagination.total_items == 3
    finally:
        for b in boxes:
            mgr.kill_sandbox(b.id)
            b.close()
        mgr.close()


def test_pause_resume_keeps_state():
    sbx = create(timeout=timedelta(minutes=5))
    try:
        sbx.files.write_files([WriteEntry(path="/tmp/keep.txt", data="kept")])
        sbx.pause()
        assert sbx.get_info().status.state == "Paused"
        resumed = SandboxSync.resume(sbx.id, connection_config=config())
        try:
            assert resumed.get_info().status.state == "Running"
            assert resumed.files.read_file("/tmp/keep.txt") == "kept"
        finally:
            resumed.close()
        # pausing a paused / resuming a running sandbox conflicts
        with http() as c:
            r = c.post(f"/sandboxes/{sbx.id}/resume")
            assert r.status_code == 409, r.text
            assert set(r.json()) == {"code", "message"}
    finally:
        sbx.kill()
        sbx.close()


def test_kill_removes_and_get_is_404():
    sbx = create(timeout=timedelta(minutes=5))
    sid = sbx.id
    sbx.kill()
    sbx.close()
    with http() as c:
        r = c.get(f"/v1/sandboxes/{sid}")
        assert r.status_code == 404
        assert set(r.json()) == {"code", "message"}
        assert r.headers.get("X-Request-ID")
        r = c.delete(f"/v1/sandboxes/{sid}")
        assert r.status_code == 404


def test_metadata_merge_patch():
    sbx = create(timeout=timedelta(minutes=5), metadata={"a": "1", "b": "2"})
    try:
        info = sbx.patch_metadata({"a": None, "c": "3"})
        with http() as c:
            raw = c.get(f"/sandboxes/{sbx.id}").json()
        assert raw["metadata"] == {"b": "2", "c": "3"}
    finally:
        sbx.kill()
        sbx.close()


def test_endpoints_and_server_proxy():
    sbx = create(timeout=timedelta(minutes=5))
    try:
        with http() as c:
            ep = c.get(f"/v1/sandboxes/{sbx.id}/endpoints/44772").json()
            assert "://" not in ep["endpoint"]
            eg = c.get(f"/v1/sandboxes/{sbx.id}/endpoints/18080")
            assert eg.status_code == 200, eg.text
            # execd answers through the lifecycle's reverse proxy too
            r = c.get(f"/sandboxes/{sbx.id}/proxy/44772/ping")
            assert r.status_code == 200, r.text
            # the proxy needs the API key like every other route
            r = httpx.get(f"http://{DOMAIN}/sandboxes/{sbx.id}/proxy/44772/ping")
            assert r.status_code == 401
        # and the SDK works in server-proxy mode
        cfg = config()
        cfg.use_server_proxy = True
        via = SandboxSync.connect(sbx.id, connection_config=cfg)
        try:
            out, _ = run(via, "echo proxied")
            assert out.strip() == "proxied"
        finally:
            via.close()
    finally:
        sbx.kill()
        sbx.close()


def test_unsupported_volume_backend_names_backend_and_runtime():
    # NFS cannot be mounted by either runtime sandbolt's lifecycle drives.
    with http() as c:
        r = c.post(
            "/v1/sandboxes",
            json={
                "image": {"uri": IMAGE},
                "entrypoint": ENTRY,
                "timeout": 120,
                "volumes": [{"name": "w", "backendType": "nfs", "backendRef": "10.0.0.1:/exports/a"}],
                "volumeBindings": [{"volumeName": "w", "mountPath": "/mnt/w", "accessMode": "RW"}],
            },
        )
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["code"] == "VOLUME::UNSUPPORTED_BACKEND", err
    assert "nfs" in err["message"] and BACKEND in err["message"], err
