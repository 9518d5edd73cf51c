"""The official OpenSandbox SDK (1.1.1) against the real OpenSandbox server
1.1.1 running `runtime.type = "kubernetes"` on sandbolt: the server's fsb
provider creates through sandbolt's FastPath v2, reads the Sandbox and
SandboxTemplate resources sandbolt writes to the (double) API server, and
hands out signed routes that sandbolt's fsb gateway serves.

Started by `tests/tests/opensandbox_server_rig.rs`, which sets:
  RIG_SERVER        host:port of the OpenSandbox server
  RIG_API_KEY       its API key
  RIG_IMAGE         an image the test bed's agent has (busybox)
  RIG_POOL_CPU      the agents' pool's sandbox cpu (GetPool), and
  RIG_POOL_MEMORY   memory: the limits a restore must ask for
  RIG_GATEWAY       host:port of sandbolt's fsb gateway (`lifecycle --gateway-listen`)
  RIG_KUBE_URL      the API server (double) the server and sandbolt share
  RIG_KUBE_TOKEN    its bearer token
  RIG_RESULTS       where to write the JSON result
Every step is recorded, in order, as
  {"step": name, "status": "works" | "differs" | "missing", "detail": text}
"works": the call answered as the SDK documents; "differs": it answered,
with something else (the detail says what); "missing": it failed outright
(an error, or not reached because an earlier step it needs failed). The
script itself always exits 0 once the result is written: the Rust test
decides which steps must work.
"""

import json
import os
import sys
import time
import traceback
import uuid
from datetime import datetime, timedelta, timezone

import httpx

from opensandbox import SandboxSync
from opensandbox.config.connection_sync import ConnectionConfigSync
from opensandbox.exceptions import SandboxApiException
from opensandbox.models.filesystem import WriteEntry
from opensandbox.models.sandboxes import (
    NetworkPolicy,
    NetworkRule,
    SandboxFilter,
    SnapshotFilter,
)
from opensandbox.models.templates import CreateTemplateRequest, TemplateFilter
from opensandbox.sync.manager import SandboxManagerSync

SERVER = os.environ["RIG_SERVER"]
API_KEY = os.environ["RIG_API_KEY"]
IMAGE = os.environ["RIG_IMAGE"]
GATEWAY = os.environ["RIG_GATEWAY"]
RESULTS = os.environ["RIG_RESULTS"]
KUBE_URL = os.environ["RIG_KUBE_URL"]
KUBE_TOKEN = os.environ["RIG_KUBE_TOKEN"]
POOL_LIMITS = {"cpu": os.environ["RIG_POOL_CPU"], "memory": os.environ["RIG_POOL_MEMORY"]}
NAMESPACE = "opensandbox"

EXECD_PORT = 44772
INGRESS_HEADER = "OpenSandbox-Ingress-To"
TEMPLATE_ENTRYPOINT = ["tail", "-f", "/dev/null"]
TEMPLATE_ENV = {"RIG_FROM_TEMPLATE": "template-env-value"}
# The policy the sandbox is created with (an fsb create sends it as the
# "egress" action binding).
CREATE_POLICY = NetworkPolicy(
    default_action="allow",
    egress=[NetworkRule(action="deny", target="denied-at-create.example.com")],
)
# What the snapshot steps write before the capture and read after the restore.
SNAPSHOT_FILE = "/tmp/rig-snapshot.txt"
# The server reads the Sandbox resource through an informer (invalidated on
# its own mutations); state changes made by sandbolt show up within a poll.
SETTLE = 30.0


class Differs(Exception):
    """The call answered, but not what the SDK documents."""


class NotReached(Exception):
    """A step this one needs did not work."""


def config(use_server_proxy: bool = False) -> ConnectionConfigSync:
    return ConnectionConfigSync(
        domain=SERVER,
        api_key=API_KEY,
        protocol="http",
        request_timeout=timedelta(seconds=60),
        use_server_proxy=use_server_proxy,
    )


def sandbox_resource(name: str) -> dict:
    """The Sandbox resource sandbolt keeps for `name`, read from the API
    server directly (what sandbolt recorded, not what the server echoes)."""
    r = httpx.get(
        f"{KUBE_URL}/apis/sandbox.fast.io/v1alpha2/namespaces/{NAMESPACE}/sandboxes/{name}",
        headers={"Authorization": f"Bearer {KUBE_TOKEN}"},
        timeout=30,
    )
    r.raise_for_status()
    return r.json()


class Rig:
    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.run_tag = "r" + uuid.uuid4().hex[:10]
        self.manager = SandboxManagerSync.create(config())
        self.template_id: str | None = None
        self.sandbox: SandboxSync | None = None
        self.sandbox_id: str | None = None
        self.killed = False
        self.snapshot_id: str | None = None
        self.snapshot_name = "rig-snap-" + self.run_tag
        self.restored: SandboxSync | None = None
        # Sandboxes made on the way that a run cut short must kill.
        self.extra_ids: list[str] = []

    def step(self, name: str, fn) -> bool:
        """Runs `fn`, records its outcome; True when it works."""
        started = time.monotonic()
        try:
            detail = fn() or "ok"
            status = "works"
        except Differs as e:
            status, detail = "differs", str(e)
        except NotReached as e:
            status, detail = "missing", f"not reached: {e}"
        except Missing as e:
            status, detail = "missing", str(e)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            traceback.print_exc(file=sys.stderr)
            status, detail = "missing", describe(e)
        ms = int((time.monotonic() - started) * 1000)
        self.steps.append({"step": name, "status": status, "detail": detail, "ms": ms})
        print(f"rig: {name}: {status} ({ms} ms): {detail}", file=sys.stderr, flush=True)
        return status == "works"

    # -- the sandbox we drive ---------------------------------------------

    def need_template(self) -> str:
        if not self.template_id:
            raise NotReached("no template")
        return self.template_id

    def need_sandbox(self) -> SandboxSync:
        if self.sandbox is None:
            raise NotReached("no sandbox")
        return self.sandbox

    def need_snapshot(self) -> str:
        if not self.snapshot_id:
            raise NotReached("no snapshot")
        return self.snapshot_id

    def need_restored(self) -> SandboxSync:
        if self.restored is None:
            raise NotReached("no sandbox restored from the snapshot")
        return self.restored

    def info(self):
        return self.manager.get_sandbox_info(self.need_sandbox().id)

    def wait_state(self, want: str) -> object:
        """Polls GET /sandboxes/{id} until its state is `want`."""
        deadline = time.monotonic() + SETTLE
        info = self.info()
        while info.status.state != want:
            if time.monotonic() > deadline:
                raise Differs(
                    f"state {info.status.state!r} (reason {info.status.reason!r}, "
                    f"message {info.status.message!r}) after {SETTLE:.0f} s, want {want!r}"
                )
            time.sleep(0.2)
            info = self.info()
        return info

    # -- steps --------------------------------------------------------------

    def create_template(self) -> str:
        t = self.manager.create_template(
            CreateTemplateRequest(
                image=IMAGE,
                publish="s3://unused/sandbolt-rig",
                entrypoint=TEMPLATE_ENTRYPOINT,
                env=TEMPLATE_ENV,
                resource_limits={"cpu": "500m", "memory": "256Mi"},
                metadata={"suite": "rig", "run": self.run_tag},
            )
        )
        self.template_id = t.template_id
        if not t.template_id.startswith("tpl"):
            raise Differs(f"template id {t.template_id!r}")
        return f"{t.template_id}: phase {t.status.phase}"

    def template_succeeded(self) -> str:
        tid = self.need_template()
        deadline = time.monotonic() + 60
        while True:
            t = self.manager.get_template(tid)
            if t.status.phase == "Succeeded":
                return f"Succeeded, manifestRef {t.status.manifest_ref!r}"
            if t.status.phase == "Failed":
                self.template_id = None
                raise Differs(f"Failed: {t.status.message!r}")
            if time.monotonic() > deadline:
                self.template_id = None
                raise Differs(f"phase {t.status.phase!r} after 60 s")
            time.sleep(0.25)

    def create_from_template(self) -> str:
        tid = self.need_template()
        started = time.monotonic()
        self.sandbox = SandboxSync.create_from_template(
            tid,
            timeout=timedelta(minutes=30),
            ready_timeout=timedelta(seconds=60),
            metadata={"team": "rig", "run": self.run_tag},
            network_policy=CREATE_POLICY,
            connection_config=config(),
        )
        self.sandbox_id = self.sandbox.id
        took = time.monotonic() - started
        if not self.sandbox.id.startswith("fsb-"):
            raise Differs(f"id {self.sandbox.id!r} does not name an fsb sandbox")
        return f"{self.sandbox.id} ready in {took * 1000:.0f} ms (origin {self.sandbox.origin})"

    def commands_run(self) -> str:
        out = run(self.need_sandbox(), "echo hello-from-rig; id -u")
        if "hello-from-rig" not in out:
            raise Differs(f"stdout {out!r}")
        return f"stdout {out.strip()!r}"

    def template_env(self) -> str:
        out = run(self.need_sandbox(), "echo \"[$RIG_FROM_TEMPLATE]\"").strip()
        want = f"[{TEMPLATE_ENV['RIG_FROM_TEMPLATE']}]"
        if out != want:
            raise Differs(f"the template's env is not the sandbox's: echo printed {out!r}, want {want!r}")
        return out

    def template_shape(self) -> str:
        """The template resolved into the recorded spec: its image, and its
        machine as limits, which the sandbox's cgroup enforces."""
        spec = sandbox_resource(self.need_sandbox().id)["spec"]
        limits = (spec.get("resources") or {}).get("limits") or {}
        problems = []
        if spec.get("image") != IMAGE:
            problems.append(f"spec.image {spec.get('image')!r}, want the template's {IMAGE!r}")
        if limits.get("memory") != "256Mi" or limits.get("cpu") not in ("500m", "0.5"):
            problems.append(f"spec.resources.limits {limits!r}, want cpu 500m, memory 256Mi")
        out = run(
            self.sandbox,
            "cat /sys/fs/cgroup/memory.max 2>/dev/null || cat /sys/fs/cgroup/memory/memory.limit_in_bytes",
        ).strip()
        if out != str(256 << 20):
            problems.append(f"the sandbox's memory limit reads {out!r}, want {256 << 20}")
        if problems:
            raise Differs("; ".join(problems))
        return f"image {spec['image']}, limits {limits}, cgroup memory {out}"

    def files(self) -> str:
        sbx = self.need_sandbox()
        body = "rig-file-" + self.run_tag
        sbx.files.write_files([WriteEntry(path="/tmp/rig.txt", data=body, mode=644)])
        got = sbx.files.read_file("/tmp/rig.txt")
        if got != body:
            raise Differs(f"read back {got!r}, wrote {body!r}")
        return f"{len(body)} bytes written and read back"

    def get_info(self) -> str:
        info = self.wait_state("Running")
        problems = []
        if info.id != self.sandbox_id:
            problems.append(f"id {info.id!r}")
        md = info.metadata or {}
        if md.get("team") != "rig" or md.get("run") != self.run_tag:
            problems.append(f"metadata {md!r}")
        if list(info.entrypoint or []) != TEMPLATE_ENTRYPOINT:
            problems.append(f"entrypoint {info.entrypoint!r}")
        if info.expires_at is None:
            problems.append("no expiresAt")
        else:
            left = (info.expires_at - datetime.now(timezone.utc)).total_seconds()
            if not 25 * 60 < left <= 30 * 60 + 5:
                problems.append(f"expiresAt {info.expires_at} ({left:.0f} s left, want ~1800)")
        if problems:
            raise Differs("; ".join(problems))
        return f"Running, created {info.created_at}, expires {info.expires_at}"

    def list_by_metadata(self) -> str:
        page = self.manager.list_sandbox_infos(SandboxFilter(metadata={"run": self.run_tag}))
        ids = [i.id for i in page.sandbox_infos]
        if ids != [self.sandbox_id]:
            raise Differs(f"metadata run={self.run_tag} lists {ids}, want [{self.sandbox_id}]")
        other = self.manager.list_sandbox_infos(SandboxFilter(metadata={"run": "nobody"}))
        if other.sandbox_infos:
            raise Differs(f"run=nobody lists {[i.id for i in other.sandbox_infos]}")
        return f"{ids}; total_items {page.pagination.total_items}"

    def list_by_state(self) -> str:
        md = {"run": self.run_tag}
        running = self.manager.list_sandbox_infos(SandboxFilter(states=["Running"], metadata=md))
        paused = self.manager.list_sandbox_infos(SandboxFilter(states=["Paused"], metadata=md))
        r = [i.id for i in running.sandbox_infos]
        p = [i.id for i in paused.sandbox_infos]
        if r != [self.sandbox_id] or p:
            raise Differs(f"Running lists {r}, Paused lists {p}")
        return "Running lists it, Paused does not"

    def renew(self) -> str:
        sbx = self.need_sandbox()
        answer = sbx.renew(timedelta(hours=2))
        want = datetime.now(timezone.utc) + timedelta(hours=2)
        if abs((answer.expires_at - want).total_seconds()) > 60:
            raise Differs(f"renew answered expiresAt {answer.expires_at}, want ~{want}")
        info = self.info()
        problems = []
        if info.expires_at is None or abs((info.expires_at - answer.expires_at).total_seconds()) > 2:
            problems.append(f"GET says expiresAt {info.expires_at}, renew said {answer.expires_at}")
        if info.status.state != "Running":
            problems.append(
                f"right after the renew GET says {info.status.state!r} ({info.status.reason!r}: "
                f"{info.status.message!r}), not Running"
            )
        if problems:
            raise Differs("; ".join(problems))
        return f"expiresAt {answer.expires_at}, still Running"

    def patch_metadata_once(self) -> str:
        info = self.need_sandbox().patch_metadata({"stage": "one"})
        md = info.metadata or {}
        if md.get("stage") != "one" or md.get("team") != "rig":
            raise Differs(f"metadata after the patch {md!r}")
        return f"metadata {md}"

    def patch_metadata_twice(self) -> str:
        info = self.need_sandbox().patch_metadata({"stage": "two", "team": None})
        md = info.metadata or {}
        if md.get("stage") != "two" or "team" in md:
            raise Differs(f"metadata after the second patch {md!r}")
        again = self.info().metadata or {}
        if again != md:
            raise Differs(f"GET says {again!r}, the patch answered {md!r}")
        return f"metadata {md}"

    def pause(self) -> str:
        sbx = self.need_sandbox()
        scope = sbx.get_endpoint(EXECD_PORT).headers.get(INGRESS_HEADER, "")
        sbx.pause()
        info = self.wait_state("Paused")
        # A frozen sandbox is not served: the gateway says so at once.
        r = httpx.get(f"http://{GATEWAY}/ping", headers={INGRESS_HEADER: scope}, timeout=30)
        if r.status_code == 200:
            raise Differs("the gateway still reaches execd of the paused sandbox")
        return f"Paused ({info.status.reason}); the gateway answers {r.status_code} while paused"

    def list_paused(self) -> str:
        md = {"run": self.run_tag}
        paused = self.manager.list_sandbox_infos(SandboxFilter(states=["Paused"], metadata=md))
        p = [i.id for i in paused.sandbox_infos]
        if p != [self.sandbox_id]:
            raise Differs(f"Paused lists {p}")
        return "Paused lists it"

    def resume(self) -> str:
        sid = self.need_sandbox().id
        self.sandbox.close()
        self.sandbox = None
        self.sandbox = SandboxSync.resume(
            sid, connection_config=config(), resume_timeout=timedelta(seconds=60)
        )
        self.wait_state("Running")
        out = run(self.sandbox, "cat /tmp/rig.txt")
        if out != "rig-file-" + self.run_tag:
            raise Differs(f"after resume /tmp/rig.txt reads {out!r}")
        return f"Running, origin {self.sandbox.origin}, files kept"

    def endpoint_direct(self) -> str:
        ep = self.need_sandbox().get_endpoint(EXECD_PORT)
        scope = ep.headers.get(INGRESS_HEADER, "")
        problems = []
        if ep.endpoint.rstrip("/") != GATEWAY:
            problems.append(f"endpoint {ep.endpoint!r}, want the gateway {GATEWAY!r}")
        if not scope.startswith("f1."):
            problems.append(f"headers {ep.headers!r}")
        r = httpx.get(f"http://{GATEWAY}/ping", headers={INGRESS_HEADER: scope}, timeout=30)
        if r.status_code != 200:
            problems.append(f"GET /ping through the gateway: {r.status_code} {r.text[:200]!r}")
        if problems:
            raise Differs("; ".join(problems))
        return f"{ep.endpoint} + {INGRESS_HEADER}: {scope[:24]}…; /ping 200"

    def gateway_refuses_tampered(self) -> str:
        ep = self.need_sandbox().get_endpoint(EXECD_PORT)
        scope = ep.headers.get(INGRESS_HEADER, "")
        head, mac = scope.rsplit(".", 1)
        bad = head + "." + ("A" if mac[0] != "A" else "B") + mac[1:]
        r = httpx.get(f"http://{GATEWAY}/ping", headers={INGRESS_HEADER: bad}, timeout=30)
        if r.status_code not in (400, 403):
            raise Differs(f"a tampered scope got {r.status_code} {r.text[:200]!r}")
        return f"tampered MAC refused with {r.status_code}"

    def endpoint_server_proxy(self) -> str:
        sid = self.need_sandbox().id
        proxied = SandboxSync.connect(
            sid, connection_config=config(use_server_proxy=True), connect_timeout=timedelta(seconds=60)
        )
        try:
            ep = proxied.get_endpoint(EXECD_PORT)
            out = run(proxied, "echo via-server-proxy").strip()
            if out != "via-server-proxy":
                raise Differs(f"command through the server's proxy printed {out!r}")
            if f"/proxy/{EXECD_PORT}" not in ep.endpoint:
                raise Differs(f"endpoint {ep.endpoint!r} is not the server's proxy")
            return f"{ep.endpoint}: command ran"
        finally:
            proxied.close()

    def network_policy_get(self) -> str:
        policy = self.need_sandbox().get_egress_policy()
        rules = [(r.action, r.target) for r in policy.egress or []]
        want = [(r.action, r.target) for r in CREATE_POLICY.egress]
        if policy.default_action != CREATE_POLICY.default_action or rules != want:
            raise Differs(
                f"the create's policy reads back as defaultAction {policy.default_action}, egress {rules}"
            )
        return f"the create's policy: defaultAction {policy.default_action}, egress {rules}"

    def network_policy_patch(self) -> str:
        sbx = self.need_sandbox()
        sbx.patch_egress_rules([NetworkRule(action="deny", target="blocked.example.com")])
        policy = sbx.get_egress_policy()
        rules = [(r.action, r.target) for r in policy.egress or []]
        want = [("deny", "blocked.example.com"), ("deny", "denied-at-create.example.com")]
        if sorted(rules) != want or policy.default_action != "allow":
            raise Differs(f"after the patch the policy reads {policy!r}")
        # What sandbolt enforces: the record's policy, in the resource.
        spec = sandbox_resource(self.sandbox_id)["spec"]
        enforced = spec.get("networkPolicy") or {}
        targets = json.dumps(enforced)
        if not all(t in targets for _, t in want):
            raise Differs(f"the server reads the rules back, but sandbolt's spec.networkPolicy is {enforced!r}")
        return f"defaultAction {policy.default_action}, egress {rules}; sandbolt enforces {targets}"

    def diagnostics(self) -> str:
        d = self.need_sandbox().get_diagnostic_events("runtime")
        content = json.loads(d.content or "{}")
        problems = []
        if content.get("sandbox_id") != self.sandbox_id:
            problems.append(f"sandbox_id {content.get('sandbox_id')!r}")
        if content.get("runtime_state") not in ("RUNTIME_STATE_READY", "READY"):
            problems.append(f"runtime_state {content.get('runtime_state')!r}")
        if not content.get("events"):
            problems.append("no events")
        if problems:
            raise Differs("; ".join(problems) + f": {d.content!r}"[:600])
        return f"{len(content['events'])} events, runtime {content['runtime_state']}"

    def diagnostics_logs(self) -> str:
        """GET /sandboxes/{id}/diagnostics/logs, through the SDK (scoped
        JSON) and plain HTTP (the deprecated text form)."""
        sid = self.need_sandbox().id
        answers = []
        try:
            d = self.sandbox.get_diagnostic_logs("container")
            return f"SDK get_diagnostic_logs: {d.content[:200]!r}"
        except SandboxApiException as e:
            answers.append(f"SDK get_diagnostic_logs('container'): HTTP {e.status_code}")
        r = server_get(f"/v1/sandboxes/{sid}/diagnostics/logs")
        answers.append(f"GET …/diagnostics/logs: {r.status_code} {r.text[:160]!r}")
        if r.status_code == 200:
            raise Differs("; ".join(answers))
        if r.status_code == 501:
            raise Missing(
                "; ".join(answers)
                + " — the server's fsb provider answers 501 for logs by design "
                "(FastPath carries lifecycle events only; process output is execd's), "
                "so no sandbolt call is made"
            )
        raise Differs("; ".join(answers))

    def diagnostics_inspect(self) -> str:
        """GET /sandboxes/{id}/diagnostics/inspect (the SDK has no method
        for it): the server answers from GetSandboxDiagnostics."""
        sid = self.need_sandbox().id
        r = server_get(f"/v1/sandboxes/{sid}/diagnostics/inspect")
        if r.status_code != 200:
            raise Differs(f"GET …/diagnostics/inspect: {r.status_code} {r.text[:300]!r}")
        content = json.loads(r.text or "{}")
        if content.get("sandbox_id") != sid or not content.get("runtime_state"):
            raise Differs(f"inspect reads {r.text[:400]!r}")
        return (
            f"runtime {content['runtime_state']}, data plane {content.get('data_plane_state')}, "
            f"assignment {content.get('assignment_state')}, {len(content.get('events') or [])} events"
        )

    def list_templates(self) -> str:
        tid = self.need_template()
        page = self.manager.list_templates(TemplateFilter(metadata={"run": self.run_tag}))
        ids = [t.template_id for t in page.template_infos]
        if ids != [tid]:
            raise Differs(f"listing by the run's metadata gives {ids}, want [{tid!r}]")
        return f"by metadata: {ids}"

    def metrics(self) -> str:
        m = self.need_sandbox().get_metrics()
        # The template's 256Mi: execd reads the sandbox's own cgroup.
        if not (0 < m.memory_total_in_mib <= 256) or m.cpu_count <= 0:
            raise Differs(f"metrics {m!r}")
        return f"cpu_count {m.cpu_count}, memory_total {m.memory_total_in_mib:.0f} MiB"

    def healthy(self) -> str:
        if not self.need_sandbox().is_healthy():
            raise Differs("is_healthy() is False for a running sandbox")
        return "ping through the gateway"

    def signed_endpoint(self) -> str:
        """get_signed_endpoint (OSEP-0011, an expiring route): the server's
        fsb provider refuses `expires`, so no sandbolt call is made."""
        try:
            ep = self.need_sandbox().get_signed_endpoint(44772, int(time.time()) + 600)
        except SandboxApiException as e:
            if e.status_code == 400:
                raise Missing(
                    f"HTTP 400: {e} — the server's fsb endpoints have no expiring routes "
                    "(its build_endpoint refuses `expires`), so no sandbolt call is made"
                ) from e
            raise
        raise Differs(f"a signed endpoint was answered: {ep!r}")

    def network_policy_delete_rule(self) -> str:
        sbx = self.need_sandbox()
        sbx.delete_egress_rules(["blocked.example.com"])
        policy = sbx.get_egress_policy()
        rules = [(r.action, r.target) for r in policy.egress or []]
        if rules != [("deny", "denied-at-create.example.com")]:
            raise Differs(f"after deleting one rule the policy reads {rules}")
        enforced = json.dumps(sandbox_resource(self.sandbox_id)["spec"].get("networkPolicy") or {})
        if "blocked.example.com" in enforced or "denied-at-create.example.com" not in enforced:
            raise Differs(f"the server reads {rules}, sandbolt's spec.networkPolicy is {enforced}")
        return f"egress {rules}; sandbolt enforces {enforced}"

    def diagnostics_summary(self) -> str:
        sid = self.need_sandbox().id
        r = server_get(f"/v1/sandboxes/{sid}/diagnostics/summary")
        if r.status_code == 501 and "FSB::API_NOT_SUPPORTED" in r.text:
            raise Missing(
                f"GET …/diagnostics/summary: 501 {r.text[:160]!r} — the summary includes logs, "
                "which the server's fsb provider does not support, so it answers 501 "
                "without calling sandbolt (inspect and events work)"
            )
        if r.status_code != 200:
            raise Differs(f"GET …/diagnostics/summary: {r.status_code} {r.text[:300]!r}")
        if sid not in r.text:
            raise Differs(f"the summary does not name the sandbox: {r.text[:300]!r}")
        return f"{len(r.text)} characters of text (inspect + events; logs unsupported on fsb)"

    # -- snapshots (findings §2.7, §4.11) -------------------------------

    def snapshot_create(self) -> str:
        sbx = self.need_sandbox()
        body = "before-the-snapshot-" + self.run_tag
        sbx.files.write_files([WriteEntry(path=SNAPSHOT_FILE, data=body, mode=644)])
        snap = sbx.create_snapshot(name=self.snapshot_name)
        self.snapshot_id = snap.id
        problems = []
        if snap.sandbox_id != sbx.id:
            problems.append(f"sandboxId {snap.sandbox_id!r}")
        if snap.name != self.snapshot_name:
            problems.append(f"name {snap.name!r}")
        if snap.status.state not in ("Creating", "Ready"):
            problems.append(f"state {snap.status.state!r} ({snap.status.reason}: {snap.status.message})")
        if problems:
            raise Differs("; ".join(problems))
        return f"{snap.id}: {snap.status.state} ({snap.status.reason})"

    def snapshot_ready(self) -> str:
        sid = self.need_snapshot()
        started = time.monotonic()
        deadline = started + 120
        while True:
            snap = self.manager.get_snapshot(sid)
            state = snap.status.state
            if state == "Ready":
                return f"Ready in {(time.monotonic() - started) * 1000:.0f} ms ({snap.status.reason})"
            if state == "Failed" or time.monotonic() > deadline:
                self.snapshot_id = None
                raise Differs(f"{state}: {snap.status.reason}: {snap.status.message}")
            time.sleep(0.25)

    def snapshot_get(self) -> str:
        sid = self.need_snapshot()
        snap = self.manager.get_snapshot(sid)
        problems = []
        if snap.id != sid or snap.sandbox_id != self.sandbox_id:
            problems.append(f"id {snap.id!r}, sandboxId {snap.sandbox_id!r}")
        if snap.name != self.snapshot_name:
            problems.append(f"name {snap.name!r}")
        if snap.status.state != "Ready":
            problems.append(f"state {snap.status.state!r}")
        if snap.created_at is None:
            problems.append("no createdAt")
        if problems:
            raise Differs("; ".join(problems))
        return f"Ready, name {snap.name}, source {snap.sandbox_id}"

    def snapshot_list(self) -> str:
        sid = self.need_snapshot()
        ids = lambda f: [i.id for i in self.manager.list_snapshots(f).snapshot_infos]  # noqa: E731
        by_source = ids(SnapshotFilter(sandbox_id=self.sandbox_id))
        by_name = ids(SnapshotFilter(name=self.snapshot_name))
        ready = ids(SnapshotFilter(sandbox_id=self.sandbox_id, states=["Ready"]))
        failed = ids(SnapshotFilter(sandbox_id=self.sandbox_id, states=["Failed"]))
        if by_source != [sid] or by_name != [sid] or ready != [sid] or failed:
            raise Differs(
                f"by source {by_source}, by name {by_name}, Ready {ready}, Failed {failed}; want [{sid}] (none Failed)"
            )
        return "by source, by name and by state Ready: only it; Failed: none"

    def restore(self) -> str:
        sid = self.need_snapshot()
        started = time.monotonic()
        # The pool's limits: image mode (how the server restores on fsb)
        # accepts no others; SandboxSync.create always sends some.
        self.restored = SandboxSync.create(
            snapshot_id=sid,
            timeout=timedelta(minutes=10),
            ready_timeout=timedelta(seconds=60),
            resource=POOL_LIMITS,
            metadata={"run": self.run_tag + "-restored"},
            connection_config=config(),
        )
        self.extra_ids.append(self.restored.id)
        took = time.monotonic() - started
        rid = self.restored.id
        problems = []
        if not rid.startswith("fsb-"):
            problems.append(f"id {rid!r} is not an fsb sandbox")
        spec = sandbox_resource(rid)["spec"]
        if spec.get("image") != IMAGE:
            problems.append(f"spec.image {spec.get('image')!r}, want the source's {IMAGE!r}")
        info = self.manager.get_sandbox_info(rid)
        if info.status.state != "Running":
            problems.append(f"state {info.status.state!r}")
        if problems:
            raise Differs("; ".join(problems))
        return f"{rid} ready in {took * 1000:.0f} ms; spec.image {spec['image']}"

    def restored_has_the_file(self) -> str:
        rs = self.need_restored()
        want = "before-the-snapshot-" + self.run_tag
        got = run(rs, f"cat {SNAPSHOT_FILE}")
        if got != want:
            raise Differs(f"{SNAPSHOT_FILE} reads {got!r} in the restored sandbox, want {want!r}")
        # A sandbox of its own: what it writes is not the source's.
        run(rs, f"echo restored-only > {SNAPSHOT_FILE}")
        source = run(self.need_sandbox(), f"cat {SNAPSHOT_FILE}")
        if source != want:
            raise Differs(f"the source's {SNAPSHOT_FILE} changed to {source!r} with the restore's write")
        return f"{SNAPSHOT_FILE} = {got!r}; a write there leaves the source's copy alone"

    def kill_restored(self) -> str:
        rs = self.need_restored()
        rid = rs.id
        rs.kill()
        self.extra_ids.remove(rid)
        self.restored = None
        wait_gone(self.manager, rid)
        return f"{rid} killed; GET 404"

    def snapshot_delete(self) -> str:
        sid = self.need_snapshot()
        self.manager.delete_snapshot(sid)
        self.snapshot_id = None
        try:
            snap = self.manager.get_snapshot(sid)
        except SandboxApiException as e:
            if e.status_code == 404:
                return "deleted; GET 404"
            raise
        raise Differs(f"GET after the delete: {snap.status.state!r}")

    # -- the rest -------------------------------------------------------

    def kill(self) -> str:
        self.need_sandbox().kill()
        self.killed = True
        return "killed"

    def gone(self) -> str:
        sid = self.sandbox_id
        if not sid:
            raise NotReached("no sandbox")
        wait_gone(self.manager, sid)
        return "404"

    def expired(self) -> str:
        """What GET reads once a sandbox's expiry passed: a template sandbox
        (the server wants timeout >= 60 s) renewed to expire in 3 s. sandbolt
        removes the container and keeps the Sandbox resource as a tombstone
        (runtime Stopped), which the server reads as Terminated, as with
        fast-sandbox; the server's kill then deletes the tombstone."""
        tid = self.need_template()
        sbx = SandboxSync.create_from_template(
            tid,
            timeout=timedelta(seconds=60),
            ready_timeout=timedelta(seconds=60),
            metadata={"run": self.run_tag + "-expires"},
            connection_config=config(),
        )
        sid = sbx.id
        self.extra_ids.append(sid)
        sbx.renew(timedelta(seconds=3))
        sbx.close()
        deadline = time.monotonic() + SETTLE
        while True:
            try:
                info = self.manager.get_sandbox_info(sid)
            except SandboxApiException as e:
                if e.status_code != 404:
                    raise
                self.extra_ids.remove(sid)
                raise Differs(
                    "GET answers 404 once it expired: no tombstone of the Sandbox resource was kept"
                )
            state = info.status.state
            if state == "Terminated":
                self.manager.kill_sandbox(sid)
                wait_gone(self.manager, sid)
                self.extra_ids.remove(sid)
                return f"Terminated after its expiry (reason {info.status.reason}); kill removes it"
            if state == "Failed":
                raise Differs(f"reads Failed after its expiry: {info.status.message}")
            if time.monotonic() > deadline:
                raise Differs(f"still {state!r} {SETTLE:.0f} s after a 3 s expiry")
            time.sleep(0.2)

    def delete_template(self) -> str:
        tid = self.need_template()
        self.manager.delete_template(tid)
        return f"{tid} deleted"


class Missing(Exception):
    """The route exists but does nothing for this sandbox (the detail says whose)."""


def server_get(path: str) -> httpx.Response:
    """A plain GET on the server (routes the SDK has no method for)."""
    return httpx.get(
        f"http://{SERVER}{path}", headers={"OPEN-SANDBOX-API-KEY": API_KEY}, timeout=60
    )


def wait_gone(manager: SandboxManagerSync, sid: str) -> None:
    """Polls GET /sandboxes/{sid} until 404 (Differs after SETTLE)."""
    deadline = time.monotonic() + SETTLE
    while True:
        try:
            info = manager.get_sandbox_info(sid)
        except SandboxApiException as e:
            if e.status_code == 404:
                return
            raise
        if time.monotonic() > deadline:
            raise Differs(f"still {info.status.state!r} {SETTLE:.0f} s after the kill")
        time.sleep(0.2)


def run(sbx: SandboxSync, cmd: str) -> str:
    ex = sbx.commands.run(cmd)
    if ex.error is not None:
        raise Differs(f"{cmd!r} failed: {ex.error}")
    return "".join(m.text for m in ex.logs.stdout)


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    status = getattr(exc, "status_code", None)
    if status is not None:
        text = f"HTTP {status}: {text}"
    return text[:800]


def main() -> int:
    rig = Rig()
    steps = [
        ("create_template", rig.create_template),
        ("template_succeeded", rig.template_succeeded),
        ("list_templates", rig.list_templates),
        ("create_from_template", rig.create_from_template),
        ("commands.run", rig.commands_run),
        ("commands.run sees the template env", rig.template_env),
        ("template image and limits apply", rig.template_shape),
        ("files write/read", rig.files),
        ("get_metrics", rig.metrics),
        ("is_healthy", rig.healthy),
        ("get_info", rig.get_info),
        ("list by metadata", rig.list_by_metadata),
        ("list by state", rig.list_by_state),
        ("renew", rig.renew),
        ("patch_metadata", rig.patch_metadata_once),
        ("patch_metadata again", rig.patch_metadata_twice),
        ("pause", rig.pause),
        ("list paused", rig.list_paused),
        ("resume", rig.resume),
        ("get_endpoint (direct, gateway)", rig.endpoint_direct),
        ("gateway refuses a tampered scope", rig.gateway_refuses_tampered),
        ("get_endpoint (use_server_proxy)", rig.endpoint_server_proxy),
        ("get_signed_endpoint", rig.signed_endpoint),
        ("network policy get", rig.network_policy_get),
        ("network policy patch", rig.network_policy_patch),
        ("network policy delete rule", rig.network_policy_delete_rule),
        ("diagnostics events", rig.diagnostics),
        ("diagnostics logs", rig.diagnostics_logs),
        ("diagnostics inspect", rig.diagnostics_inspect),
        ("diagnostics summary", rig.diagnostics_summary),
        ("snapshot create", rig.snapshot_create),
        ("snapshot ready", rig.snapshot_ready),
        ("snapshot get", rig.snapshot_get),
        ("snapshot list", rig.snapshot_list),
        ("create from snapshot", rig.restore),
        ("the restore has the snapshot's file", rig.restored_has_the_file),
        ("kill the restore", rig.kill_restored),
        ("snapshot delete", rig.snapshot_delete),
        ("kill", rig.kill),
        ("404 after kill", rig.gone),
        ("expired sandbox reads", rig.expired),
        ("delete_template", rig.delete_template),
    ]
    try:
        for name, fn in steps:
            rig.step(name, fn)
    finally:
        # A run cut short leaves nothing behind for the bed's checks.
        left = list(rig.extra_ids)
        if rig.sandbox_id and not rig.killed:
            left.append(rig.sandbox_id)
        for sid in left:
            try:
                rig.manager.kill_sandbox(sid)
            except Exception:  # noqa: BLE001 - best effort after a failure
                traceback.print_exc(file=sys.stderr)
        if rig.snapshot_id:
            try:
                rig.manager.delete_snapshot(rig.snapshot_id)
            except Exception:  # noqa: BLE001 - best effort after a failure
                traceback.print_exc(file=sys.stderr)
        with open(RESULTS, "w") as f:
            json.dump({"run": rig.run_tag, "sandbox": rig.sandbox_id, "steps": rig.steps}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
