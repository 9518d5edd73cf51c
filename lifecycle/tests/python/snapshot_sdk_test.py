"""Sandbox snapshots through the official OpenSandbox Python SDK (1.1.1), on
either backend (SANDBOLT_BACKEND: docker or controller): write a file in A,
`create_snapshot`, change the file, `Sandbox.create(snapshot_id=...)` B and
see the snapshot's content (not A's later write); list with filters and
paging; delete the snapshot while B runs (it becomes Deleting and no
sandbox can be created from it), then delete B and see the snapshot go.

Environment: LIFECYCLE_DOMAIN, LIFECYCLE_API_KEY, SANDBOLT_IMAGE,
SANDBOLT_BACKEND (see tests/python/lifecycle_env.py, on PYTHONPATH)."""

import os
import time
import uuid
from datetime import timedelta

import pytest

from opensandbox import SandboxSync
from opensandbox.exceptions import SandboxApiException
from opensandbox.models.sandboxes import SnapshotFilter
from opensandbox.sync.manager import SandboxManagerSync
from lifecycle_env import config

IMAGE = os.environ["SANDBOLT_IMAGE"]
BACKEND = os.environ["SANDBOLT_BACKEND"]
# A capture on the controller runs on the node after the answer.
READY_WITHIN_SECS = 60
RUN = uuid.uuid4().hex[:8]


def sh(sbx: SandboxSync, cmd: str) -> str:
    ex = sbx.commands.run(cmd)
    return "".join(m.text for m in ex.logs.stdout)


def create(**kwargs) -> SandboxSync:
    return SandboxSync.create(
        resource={"cpu": "250m", "memory": "64Mi"},
        timeout=timedelta(minutes=10),
        ready_timeout=timedelta(seconds=60),
        connection_config=config(),
        **kwargs,
    )


def wait_state(mgr: SandboxManagerSync, snapshot_id: str, want: str):
    deadline = time.monotonic() + READY_WITHIN_SECS
    while True:
        info = mgr.get_snapshot(snapshot_id)
        if info.status.state == want:
            return info
        assert info.status.state in ("Creating", want), info
        assert time.monotonic() < deadline, f"snapshot never became {want}: {info}"
        time.sleep(0.3)


def wait_gone(mgr: SandboxManagerSync, snapshot_id: str):
    deadline = time.monotonic() + READY_WITHIN_SECS
    while True:
        try:
            info = mgr.get_snapshot(snapshot_id)
        except SandboxApiException as e:
            assert e.status_code == 404, e
            return
        assert time.monotonic() < deadline, f"snapshot never went: {info}"
        time.sleep(0.3)


@pytest.fixture(scope="module")
def mgr():
    m = SandboxManagerSync.create(config())
    yield m
    m.close()


def test_snapshot_restore_list_and_delete(mgr):
    a = create(image=IMAGE, entrypoint=["sleep", "infinity"], metadata={"team": "snap"})
    b = None
    try:
        sh(a, "mkdir -p /work && echo v1 > /work/f")
        name = f"sdk-{RUN}"
        snap = a.create_snapshot(name)
        assert snap.sandbox_id == a.id and snap.name == name, snap
        assert snap.status.state in ("Creating", "Ready"), snap
        ready = wait_state(mgr, snap.id, "Ready")
        assert ready.created_at is not None

        # A moves on; the snapshot does not.
        sh(a, "echo v2 > /work/f")
        b = create(snapshot_id=snap.id)
        assert sh(b, "cat /work/f") == "v1\n"
        assert sh(a, "cat /work/f") == "v2\n"
        # Independent from here: B's writes are B's.
        sh(b, "echo b > /work/f")
        assert sh(a, "cat /work/f") == "v2\n"
        info = b.get_info()
        assert info.entrypoint == ["tail", "-f", "/dev/null"], info
        # B's metadata is its own (none), not its source's.
        assert not info.metadata, info

        # A second snapshot of A, to list and page.
        second = a.create_snapshot(None)
        wait_state(mgr, second.id, "Ready")
        mine = mgr.list_snapshots(SnapshotFilter(sandbox_id=a.id))
        assert {s.id for s in mine.snapshot_infos} == {snap.id, second.id}, mine
        assert mine.pagination.total_items == 2
        # Newest first, one per page.
        page1 = mgr.list_snapshots(SnapshotFilter(sandbox_id=a.id, page_size=1, page=1))
        page2 = mgr.list_snapshots(SnapshotFilter(sandbox_id=a.id, page_size=1, page=2))
        assert [s.id for s in page1.snapshot_infos] == [second.id], page1
        assert [s.id for s in page2.snapshot_infos] == [snap.id], page2
        assert page1.pagination.has_next_page and not page2.pagination.has_next_page
        by_name = mgr.list_snapshots(SnapshotFilter(name=name))
        assert [s.id for s in by_name.snapshot_infos] == [snap.id], by_name
        ready_ones = mgr.list_snapshots(SnapshotFilter(sandbox_id=a.id, states=["Ready"]))
        assert ready_ones.pagination.total_items == 2, ready_ones
        none = mgr.list_snapshots(SnapshotFilter(sandbox_id=a.id, states=["Failed"]))
        assert none.snapshot_infos == [], none

        # Deleting a snapshot B was created from: Deleting until B goes.
        mgr.delete_snapshot(snap.id)
        assert mgr.get_snapshot(snap.id).status.state == "Deleting"
        deleting = mgr.list_snapshots(SnapshotFilter(sandbox_id=a.id, states=["Deleting"]))
        assert [s.id for s in deleting.snapshot_infos] == [snap.id], deleting
        with pytest.raises(SandboxApiException) as refused:
            create(snapshot_id=snap.id)
        assert refused.value.status_code == 409, refused.value
        assert sh(b, "cat /work/f") == "b\n"
        b.kill()
        b.close()
        b = None
        wait_gone(mgr, snap.id)

        # One nobody uses goes at once.
        mgr.delete_snapshot(second.id)
        wait_gone(mgr, second.id)
        assert mgr.list_snapshots(SnapshotFilter(sandbox_id=a.id)).snapshot_infos == []
    finally:
        for s in (b, a):
            if s is not None:
                s.kill()
                s.close()


def test_refusals(mgr):
    for call, status in [
        (lambda: mgr.get_snapshot("no-such-snapshot"), 404),
        (lambda: mgr.delete_snapshot("no-such-snapshot"), 404),
        (lambda: mgr.create_snapshot("no-such-sandbox", "x"), 404),
        # What a create names and does not exist is the request's to fix.
        (lambda: create(snapshot_id="no-such-snapshot"), 400),
    ]:
        with pytest.raises(SandboxApiException) as e:
            call()
        assert e.value.status_code == status, e.value
