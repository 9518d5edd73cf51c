"""The OpenSandbox diagnostics routes through the official Python SDK
(1.1.1), on either backend (SANDBOLT_BACKEND: docker or controller): a
sandbox that prints a line on start shows it in `get_diagnostic_logs`, its
create is in `get_diagnostic_events`, the deprecated inspect and summary
routes name its image and hold all three, an unsupported scope is a 400 and
an unknown sandbox a 404.

Environment: LIFECYCLE_DOMAIN, LIFECYCLE_API_KEY, SANDBOLT_IMAGE,
SANDBOLT_BACKEND (see tests/python/lifecycle_env.py, on PYTHONPATH)."""

import os
import time
import uuid
from datetime import timedelta

import httpx
import pytest

from opensandbox import SandboxSync
from opensandbox.exceptions import SandboxApiException
from opensandbox.sync.manager import SandboxManagerSync
from lifecycle_env import API_KEY, DOMAIN, config

IMAGE = os.environ["SANDBOLT_IMAGE"]
BACKEND = os.environ["SANDBOLT_BACKEND"]
MARK = f"diag-start-{uuid.uuid4().hex[:8]}"
# The entrypoint runs beside execd: its first line may land a moment after
# the create answers.
LOG_WITHIN_SECS = 30


@pytest.fixture(scope="module")
def mgr():
    m = SandboxManagerSync.create(config())
    yield m
    m.close()


@pytest.fixture(scope="module")
def sbx():
    s = SandboxSync.create(
        image=IMAGE,
        entrypoint=["sh", "-c", f"echo {MARK}; exec sleep infinity"],
        resource={"cpu": "250m", "memory": "64Mi"},
        timeout=timedelta(minutes=10),
        ready_timeout=timedelta(seconds=60),
        connection_config=config(),
    )
    yield s
    s.kill()
    s.close()


def rest(path: str, **params) -> httpx.Response:
    return httpx.get(
        f"http://{DOMAIN}{path}",
        params=params,
        headers={"OPEN-SANDBOX-API-KEY": API_KEY},
        timeout=60,
    )


def logs_with_mark(mgr, sandbox_id: str):
    deadline = time.monotonic() + LOG_WITHIN_SECS
    while True:
        logs = mgr.get_diagnostic_logs(sandbox_id, "container")
        if MARK in (logs.content or "") or time.monotonic() > deadline:
            return logs
        time.sleep(0.3)


def test_logs_show_what_the_sandbox_printed_on_start(mgr, sbx):
    logs = logs_with_mark(mgr, sbx.id)
    assert MARK in logs.content, logs
    assert logs.sandbox_id == sbx.id
    assert (logs.kind, logs.scope, logs.delivery) == ("logs", "container", "inline")
    assert logs.content_type.startswith("text/plain")
    assert logs.content_length == len(logs.content.encode())
    assert logs.truncated is False
    # "all" says what it holds; the content is the same log.
    both = mgr.get_diagnostic_logs(sbx.id, "ALL")
    assert both.scope == "all" and MARK in both.content and both.warnings, both


def test_events_show_the_create(mgr, sbx):
    events = mgr.get_diagnostic_events(sbx.id, "runtime")
    assert (events.kind, events.scope) == ("events", "runtime"), events
    assert "create" in events.content, events.content
    assert events.content_length == len(events.content.encode())


def test_an_unsupported_scope_is_a_400(mgr, sbx):
    for call in (mgr.get_diagnostic_logs, mgr.get_diagnostic_events):
        with pytest.raises(SandboxApiException) as e:
            call(sbx.id, "no-such-scope")
        assert e.value.status_code == 400, e.value


def test_inspect_names_the_image_and_summary_has_all_three(sbx):
    inspect = rest(f"/v1/sandboxes/{sbx.id}/diagnostics/inspect")
    assert inspect.status_code == 200, inspect.text
    assert inspect.headers["content-type"].startswith("text/plain")
    assert IMAGE in inspect.text and sbx.id in inspect.text, inspect.text
    summary = rest(f"/sandboxes/{sbx.id}/diagnostics/summary", tail=20, event_limit=10)
    assert summary.status_code == 200, summary.text
    for part in (IMAGE, "create", MARK, "Inspect", "Events", "Logs"):
        assert part in summary.text, (part, summary.text)


def test_the_deprecated_text_forms_are_bounded_and_marked(sbx):
    logs = rest(f"/sandboxes/{sbx.id}/diagnostics/logs", tail=50)
    assert logs.status_code == 200, logs.text
    assert logs.headers.get("deprecation") == "true"
    assert MARK in logs.text
    last = rest(f"/sandboxes/{sbx.id}/diagnostics/logs", tail=1)
    assert [l for l in last.text.splitlines() if not l.startswith("[")] == [
        logs.text.splitlines()[-1]
    ], (last.text, logs.text)
    assert rest(f"/sandboxes/{sbx.id}/diagnostics/logs", tail=10001).status_code == 400
    events = rest(f"/sandboxes/{sbx.id}/diagnostics/events", limit=1)
    assert events.status_code == 200 and events.headers.get("deprecation") == "true"
    # One event asked for: at most one line beyond the truncation marker.
    lines = [l for l in events.text.splitlines() if not l.startswith("[")]
    assert len(lines) == 1, events.text


def test_an_unknown_sandbox_is_a_404(mgr):
    for call in (mgr.get_diagnostic_logs, mgr.get_diagnostic_events):
        with pytest.raises(SandboxApiException) as e:
            call("no-such-sandbox-" + uuid.uuid4().hex[:8], "all")
        assert e.value.status_code == 404, e.value
    for kind in ("inspect", "summary"):
        r = rest(f"/sandboxes/no-such-sandbox/diagnostics/{kind}")
        assert r.status_code == 404, r.text
