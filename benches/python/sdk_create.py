"""The harness's "sdk create" timing loop: the official OpenSandbox Python SDK
(`opensandbox==1.1.1`) against several lifecycle servers, interleaved.

Each round creates one sandbox on every system, timing `SandboxSync.create`
until it returns — POST /sandboxes, the endpoint look-ups for 44772 and 18080
and execd's /ping answering, exactly what a user waits for — and then `kill`.
Stages of a create (µs from its start, read off the SDK's HTTP exchanges):
post_answered, endpoints_resolved, execd_ready; "pings" counts /ping tries.

The order of the systems within a round follows a Williams design (see
`williams`): over one cycle of rounds every system takes every position
equally often and follows every other system equally often. A create pays for
the teardown its predecessor's kill leaves behind on a shared daemon (on this
2-core machine a FastPath create right after another FastPath kill measured
~40 ms slower than one after a Docker kill), so a plain rotation, where a
system always follows the same neighbour, biased comparisons between systems.
Run a multiple of the cycle (n rounds for n systems, 2n when n is odd) to
balance exactly.

Input (argv): --systems JSON list of {"name", "url", "api_key"} with an
optional "resource" object, the SDK's `resource` argument (e.g. {"cpu": "500m",
"memory": "256Mi"}): absent, the SDK sends its default ({"cpu": "1",
"memory": "2Gi"}); empty ({}), the request carries an empty resourceLimits, i.e.
no limits at all. Several entries may share one url and differ only in
"resource"; names must be unique. Optional "extensions": the SDK's `extensions`
argument (e.g. {"poolRef": "bench-warm"}); optional "wait_pool": a warm pool
name whose GET /v1/pools/{name} must report "wait_available" (default 1)
available sandboxes before each create (waited for before the clock starts,
so a warm create is timed as a claim, not as a race with the refill); optional
"template": true, for the OpenSandbox server's fsb provider (Kubernetes runtime),
which creates only from a template: a template of --image with the same
entrypoint is made and waited for (`Succeeded`) before round 0, untimed, and
each create is `SandboxSync.create_from_template` (POST /sandboxes with
templateId, one endpoint look-up — 44772 only: template sandboxes have no
egress sidecar — and execd's /ping). --rounds N (recorded rounds; one more
unrecorded warm-up round runs first); --image REF.
Output: one JSON document on stdout:
  {"samples": [{"system", "round", "create_us", "kill_us", "stages"}],
   "failures": [{"system", "round", "reason"}]}
A system that fails once is dropped from later rounds (its failure says why).
"""

import argparse
import json
import sys
import threading
import time
import traceback
from datetime import timedelta
from urllib.parse import urlparse

import httpx

from opensandbox import SandboxSync
from opensandbox.config.connection_sync import ConnectionConfigSync
from opensandbox.models.templates import CreateTemplateRequest
from opensandbox.sync.manager import SandboxManagerSync

ENTRY = ["sleep", "infinity"]

# Every HTTP exchange the SDK makes, as (finished at, method, path, status):
# the stages of one create are read from it. The SDK sends through its
# DeadlineSyncTransport (which, for requests with a deadline such as the
# readiness loop's, opens its own connection pool per request) around an
# httpx.HTTPTransport; wrapping both, and recording only the outermost call,
# sees every exchange once without changing any.
EXCHANGES: list[tuple[float, str, str, int]] = []
_depth = threading.local()


def _recording(original):
    def handle_request(self, request):
        outer = getattr(_depth, "n", 0) == 0
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            response = original(self, request)
        finally:
            _depth.n -= 1
        if outer:
            EXCHANGES.append(
                (time.perf_counter(), request.method, request.url.path, response.status_code)
            )
        return response

    return handle_request


httpx.HTTPTransport.handle_request = _recording(httpx.HTTPTransport.handle_request)
try:
    from opensandbox.transport._deadline_sync import DeadlineSyncTransport

    DeadlineSyncTransport.handle_request = _recording(DeadlineSyncTransport.handle_request)
except ImportError:  # another SDK layout: the inner transport still records
    pass


def stages(t0: float, t1: float) -> dict[str, int]:
    """Stage ends (µs from t0) of the create that ran between t0 and t1."""
    out: dict[str, int] = {}
    pings = 0
    for t, method, path, status in EXCHANGES:
        if not t0 <= t <= t1:
            continue
        us = int((t - t0) * 1e6)
        if method == "POST" and path.rstrip("/").endswith("/sandboxes"):
            out.setdefault("post_answered", us)
        elif "/endpoints/" in path:
            out["endpoints_resolved"] = us
        elif path.endswith("/ping"):
            pings += 1
            if status == 200:
                out.setdefault("execd_ready", us)
    out["pings"] = pings
    return out


def connection(url: str, api_key: str) -> ConnectionConfigSync:
    u = urlparse(url)
    return ConnectionConfigSync(
        domain=u.netloc,
        api_key=api_key,
        protocol=u.scheme or "http",
        request_timeout=timedelta(seconds=60),
    )


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    if len(text) > 600:
        text = text[:600] + "…"
    return text


class NoLimits(dict):
    """An empty `resource` the SDK does not replace with its default: it
    substitutes one for any falsy value (`resource or {"cpu": "1", ...}`), and
    an empty resourceLimits is how a REST client asks for no limits."""

    def __bool__(self) -> bool:
        return True


def resource_arg(system: dict) -> dict:
    """The keyword arguments that carry the system's "resource", if any."""
    if "resource" not in system:
        return {}
    resource = system["resource"]
    return {"resource": dict(resource) if resource else NoLimits()}


def wait_pool(system: dict, pool: str, want: int) -> None:
    """Untimed: until the warm pool reports `want` available (60 s)."""
    deadline = time.monotonic() + 60
    with httpx.Client(
        base_url=system["url"], headers={"OPEN-SANDBOX-API-KEY": system["api_key"]}, timeout=10
    ) as c:
        while True:
            r = c.get(f"/v1/pools/{pool}")
            if r.status_code == 200 and (r.json().get("status") or {}).get("available", 0) >= want:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"warm pool {pool}: not {want} available within 60 s: {r.status_code} {r.text}")
            time.sleep(0.02)


def prepare_template(system: dict, image: str) -> None:
    """Untimed: a template of `image` whose entrypoint is ENTRY, waited for
    until `Succeeded` (60 s); its id kept as system["template_id"]."""
    manager = SandboxManagerSync.create(connection(system["url"], system["api_key"]))
    try:
        t = manager.create_template(
            CreateTemplateRequest(image=image, publish="s3://unused/bench", entrypoint=ENTRY)
        )
        deadline = time.monotonic() + 60
        while t.status.phase != "Succeeded":
            if t.status.phase == "Failed" or time.monotonic() > deadline:
                raise RuntimeError(f"template {t.template_id}: {t.status.phase} {t.status.message!r}")
            time.sleep(0.1)
            t = manager.get_template(t.template_id)
        system["template_id"] = t.template_id
    finally:
        manager.close()


def launch(system: dict, image: str, config: ConnectionConfigSync, extra: dict) -> SandboxSync:
    """The create the clock times: from the system's template, or of `image`."""
    if system.get("template_id"):
        return SandboxSync.create_from_template(
            system["template_id"],
            timeout=timedelta(minutes=10),
            connection_config=config,
            ready_timeout=timedelta(seconds=60),
            **extra,
        )
    return SandboxSync.create(
        image,
        entrypoint=ENTRY,
        timeout=timedelta(minutes=10),
        connection_config=config,
        ready_timeout=timedelta(seconds=60),
        **extra,
    )


def one(system: dict, image: str) -> tuple[int, int, dict[str, int]]:
    """Creates a sandbox (ready), kills it; returns (create_us, kill_us,
    stages of the create)."""
    if system.get("wait_pool"):
        wait_pool(system, system["wait_pool"], int(system.get("wait_available", 1)))
    EXCHANGES.clear()
    config = connection(system["url"], system["api_key"])
    extra = resource_arg(system)
    if system.get("extensions"):
        extra["extensions"] = dict(system["extensions"])
    t0 = time.perf_counter()
    sbx = launch(system, image, config, extra)
    t1 = time.perf_counter()
    try:
        sbx.kill()
        t2 = time.perf_counter()
    finally:
        sbx.close()
    return int((t1 - t0) * 1e6), int((t2 - t1) * 1e6), stages(t0, t1)


def williams(n: int) -> list[list[int]]:
    """Orders of range(n), one a round, in which each index is first and
    follows each other index equally often over the cycle (a Williams Latin
    square; for odd n, it and its mirror image)."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        if len(first) % 2 == 1:
            first.append(lo)
            lo += 1
        else:
            first.append(hi)
            hi -= 1
    rows = [[(x + i) % n for x in first] for i in range(n)]
    if n % 2 == 1:
        rows += [row[::-1] for row in rows]
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--systems", required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--image", required=True)
    args = ap.parse_args()
    systems = json.loads(args.systems)
    samples, failures = [], []
    alive = []
    for system in systems:
        try:
            if system.get("template"):
                prepare_template(system, args.image)
            alive.append(system)
        except Exception as exc:  # noqa: BLE001 - reported, the run goes on
            traceback.print_exc(file=sys.stderr)
            failures.append({"system": system["name"], "round": 0, "reason": "template: " + describe(exc)})
    # Round 0 is the warm-up: first image use, first connections, caches.
    for rnd in range(args.rounds + 1):
        if not alive:
            break
        rows = williams(len(alive))
        # Round 1, the first recorded one, starts the cycle.
        order = [alive[i] for i in rows[(rnd - 1) % len(rows)]]
        for system in order:
            try:
                create_us, kill_us, st = one(system, args.image)
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                traceback.print_exc(file=sys.stderr)
                failures.append(
                    {"system": system["name"], "round": rnd, "reason": describe(exc)}
                )
                alive = [s for s in alive if s["name"] != system["name"]]
                continue
            print(
                f"sdk_create: round {rnd} {system['name']}: create {create_us / 1000:.1f} ms,"
                f" kill {kill_us / 1000:.1f} ms; stages {st}",
                file=sys.stderr,
            )
            if rnd > 0:
                samples.append(
                    {
                        "system": system["name"],
                        "round": rnd,
                        "create_us": create_us,
                        "kill_us": kill_us,
                        "stages": st,
                    }
                )
    json.dump({"samples": samples, "failures": failures}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
