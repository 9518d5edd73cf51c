"""Egress policy through the official OpenSandbox Python SDK (1.1.1) and the
raw REST routes, against a running sandbolt lifecycle server.

The SDK reaches a sandbox's policy through the egress sidecar endpoint
(port 18080): sandbolt answers it with an endpoint on the lifecycle itself
and a token for that one sandbox. `networkpolicy` is the Lifecycle API's
own route to the same policy.

Started by lifecycle/tests/controller_sdk.rs (SANDBOLT_BACKEND=controller:
enforced by the agent) and lifecycle/tests/docker_sdk.rs
(SANDBOLT_BACKEND=docker: enforced by the lifecycle on the Docker bridge).
Both backends enforce the same policy the same way (DNS proxy + nftables),
so every test runs the same on both. On docker the suite also connects to
test hosts the Rust side started (SANDBOLT_TEST_HOSTS); on the controller
backend those connection checks are Rust's (tests/tests/egress_end_to_end.rs).
Environment as in lifecycle_sdk_test.py; a missing variable fails, never skips.
"""

import os
from datetime import timedelta

import httpx
import pytest

from lifecycle_env import API_KEY, DOMAIN, config
from opensandbox import SandboxSync
from opensandbox.exceptions import SandboxApiException, SandboxException
from opensandbox.models.sandboxes import NetworkPolicy, NetworkRule

IMAGE = os.environ["SANDBOLT_IMAGE"]
BACKEND = os.environ["SANDBOLT_BACKEND"]
assert BACKEND in ("controller", "docker"), BACKEND
ENTRY = ["sleep", "infinity"]
TOKEN_HEADER = "X-Sandbolt-Egress-Token"
ENFORCEMENT = "dns+nft"
# What the DNS upstream of the node's proxy answers (name=address,...), so
# the suite can see a policy change take effect inside the sandbox.
ZONE = dict(entry.split("=") for entry in os.environ["SANDBOLT_DNS_ZONE"].split(","))
# docker: test hosts (name=address) in network namespaces of the Rust test,
# each answering one line "test-host <id>" on TEST_PORT; their names are in
# ZONE too.
TEST_HOSTS = (
    dict(entry.split("=") for entry in os.environ["SANDBOLT_TEST_HOSTS"].split(","))
    if BACKEND == "docker"
    else {}
)
TEST_PORT = 7777

# No test is skipped on either backend: where the backends differ, one test
# checks each backend's answer.


def http() -> httpx.Client:
    return httpx.Client(
        base_url=f"http://{DOMAIN}",
        headers={"OPEN-SANDBOX-API-KEY": API_KEY},
        timeout=60,
    )


def create(**kw) -> SandboxSync:
    kw.setdefault("entrypoint", ENTRY)
    kw.setdefault("connection_config", config())
    kw.setdefault("ready_timeout", timedelta(seconds=60))
    kw.setdefault("timeout", timedelta(minutes=5))
    return SandboxSync.create(IMAGE, **kw)


def rules(policy: NetworkPolicy) -> list[tuple[str, str]]:
    return [(r.action, r.target) for r in policy.egress or []]


def resolves(sbx: SandboxSync, name: str) -> bool:
    """Does `name` resolve inside the sandbox to the zone's address?"""
    ex = sbx.commands.run(f"nslookup {name} 2>&1; true")
    out = "".join(m.text for m in ex.logs.stdout)
    return ZONE[name] in out


def connect(sbx: SandboxSync, target: str) -> str:
    """What a TCP connection from the sandbox to `target` reads ("" = none)."""
    ex = sbx.commands.run(f"nc -w 2 {target} {TEST_PORT} </dev/null 2>/dev/null; true")
    return "".join(m.text for m in ex.logs.stdout)


def raw_policy(sid: str) -> dict:
    with http() as c:
        r = c.get(f"/v1/sandboxes/{sid}/networkpolicy")
    assert r.status_code == 200, r.text
    return r.json()


def test_a_sandbox_without_policy_allows_all():
    sbx = create()
    try:
        p = sbx.get_egress_policy()
        assert p.default_action == "allow"
        assert rules(p) == []
        assert raw_policy(sbx.id) == {
            "status": "ok",
            "mode": "allow_all",
            "enforcementMode": ENFORCEMENT,
            "policy": {"defaultAction": "allow", "egress": []},
        }
    finally:
        sbx.kill()
        sbx.close()


def test_the_egress_endpoint_is_the_lifecycle_with_a_per_sandbox_token():
    a, b = create(), create()
    try:
        with http() as c:
            ep = c.get(f"/v1/sandboxes/{a.id}/endpoints/18080").json()
            other = c.get(f"/v1/sandboxes/{b.id}/endpoints/18080").json()
            missing = c.get("/v1/sandboxes/no-such-sandbox/endpoints/18080")
        assert missing.status_code == 404, missing.text
        assert ep["endpoint"] == f"{DOMAIN}/v1/sandboxes/{a.id}/egress", ep
        token = ep["headers"][TOKEN_HEADER]
        assert API_KEY not in str(ep), ep  # direct mode never carries the key
        assert token != other["headers"][TOKEN_HEADER]
        url = f"http://{ep['endpoint']}/policy"
        ok = httpx.get(url, headers={TOKEN_HEADER: token})
        assert ok.status_code == 200, ok.text
        assert ok.json()["enforcementMode"] == ENFORCEMENT
        # No token, or another sandbox's token: 401.
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={TOKEN_HEADER: other["headers"][TOKEN_HEADER]}).status_code == 401
        # The token opens nothing but that sandbox's policy.
        for path in [f"/v1/sandboxes/{a.id}", f"/v1/sandboxes/{a.id}/networkpolicy", "/v1/sandboxes"]:
            r = httpx.get(f"http://{DOMAIN}{path}", headers={TOKEN_HEADER: token})
            assert r.status_code == 401, (path, r.text)
    finally:
        for s in (a, b):
            s.kill()
            s.close()


def test_rest_bodies_are_checked_and_errors_name_the_field():
    sbx = create()
    try:
        base = f"/v1/sandboxes/{sbx.id}/networkpolicy"
        with http() as c:
            for method, body, field in [
                ("PUT", {"defaultAction": "sometimes"}, "networkPolicy.defaultAction"),
                ("PUT", {"egress": [{"action": "allow", "target": "not a name"}]}, "networkPolicy.egress[0].target"),
                ("PUT", [], "NetworkPolicy object"),
                ("PATCH", [{"action": "allow", "target": "ok.test"}, {"action": "drop", "target": "x.test"}], "rules[1].action"),
                ("PATCH", {"action": "allow", "target": "a.test"}, "list of rules"),
                ("DELETE", ["ok.test", "bad name"], "targets[1]"),
                ("DELETE", "a.test", "list of targets"),
            ]:
                r = c.request(method, base, json=body)
                assert r.status_code == 400, (method, body, r.text)
                assert field in r.json()["message"], (method, body, r.text)
            r = c.get("/v1/sandboxes/no-such-sandbox/networkpolicy")
            assert r.status_code == 404, r.text
            assert httpx.get(f"http://{DOMAIN}{base}").status_code == 401
        # Nothing changed.
        assert raw_policy(sbx.id)["mode"] == "allow_all"
    finally:
        sbx.kill()
        sbx.close()


def test_create_with_a_bad_policy_is_400_naming_the_field():
    with http() as c:
        r = c.post(
            "/v1/sandboxes",
            json={
                "image": {"uri": IMAGE},
                "entrypoint": ENTRY,
                "timeout": 120,
                "networkPolicy": {"defaultAction": "deny", "egress": [{"action": "allow", "target": "2001:db8::1"}]},
            },
        )
    assert r.status_code == 400, r.text
    assert "networkPolicy.egress[0].target" in r.json()["message"], r.text


def test_sdk_create_with_policy_get_patch_delete():
    policy = NetworkPolicy(
        default_action="deny",
        egress=[
            NetworkRule(action="allow", target="pkgs.test"),
            NetworkRule(action="allow", target="*.docs.test"),
        ],
    )
    sbx = create(network_policy=policy)
    try:
        p = sbx.get_egress_policy()
        assert p.default_action == "deny"
        assert rules(p) == [("allow", "pkgs.test"), ("allow", "*.docs.test")]
        raw = raw_policy(sbx.id)
        assert (raw["mode"], raw["enforcementMode"]) == ("rules", "dns+nft"), raw
        # Enforced on the node: allowed names resolve, others do not.
        assert resolves(sbx, "pkgs.test")
        assert resolves(sbx, "www.docs.test")
        # No rule matches: the deny default answers on the node (the Rust
        # side checks the name never reached the upstream).
        assert not resolves(sbx, "other.test")

        # PATCH: same target replaced in place, new target appended,
        # first rule per target in the payload wins, default kept.
        sbx.patch_egress_rules(
            [
                NetworkRule(action="deny", target="PKGS.test"),
                NetworkRule(action="deny", target="blocked.docs.test"),
                NetworkRule(action="allow", target="203.0.113.0/24"),
                NetworkRule(action="allow", target="pkgs.test"),
            ]
        )
        p = sbx.get_egress_policy()
        assert p.default_action == "deny"
        assert rules(p) == [
            ("deny", "pkgs.test"),
            ("allow", "*.docs.test"),
            ("deny", "blocked.docs.test"),
            ("allow", "203.0.113.0/24"),
        ]
        # The change applies to the running sandbox.
        assert not resolves(sbx, "pkgs.test")
        assert resolves(sbx, "www.docs.test")
        # First match wins: the wildcard allow precedes the appended deny.
        assert resolves(sbx, "blocked.docs.test")

        # DELETE by target, idempotent; default kept.
        sbx.delete_egress_rules(["pkgs.test", "never-there.test"])
        sbx.delete_egress_rules(["pkgs.test"])
        p = sbx.get_egress_policy()
        assert rules(p) == [("allow", "*.docs.test"), ("deny", "blocked.docs.test"), ("allow", "203.0.113.0/24")]
        assert p.default_action == "deny"
        # pkgs.test has no rule now: the deny default holds.
        assert not resolves(sbx, "pkgs.test")

        # Deleting the last rules leaves the sandbox denying, not open.
        sbx.delete_egress_rules(["*.docs.test", "blocked.docs.test", "203.0.113.0/24"])
        raw = raw_policy(sbx.id)
        assert raw["mode"] == "deny_all", raw
        assert raw["policy"] == {"defaultAction": "deny", "egress": []}, raw
        assert not resolves(sbx, "www.docs.test")

        # A bad rule through the SDK is the server's 400, surfaced.
        with pytest.raises(SandboxApiException) as e:
            sbx.patch_egress_rules([NetworkRule(action="allow", target="bad name")])
        assert e.value.status_code == 400
    finally:
        sbx.kill()
        sbx.close()


def test_rest_put_patch_delete():
    sbx = create()
    try:
        base = f"/v1/sandboxes/{sbx.id}/networkpolicy"
        with http() as c:
            r = c.put(base, json={"defaultAction": "allow", "egress": [{"action": "deny", "target": "bad.test"}]})
            assert r.status_code == 200, r.text
            assert r.json() == {
                "status": "ok",
                "mode": "rules",
                "enforcementMode": "dns+nft",
                "policy": {"defaultAction": "allow", "egress": [{"action": "deny", "target": "bad.test"}]},
            }
            r = c.patch(base, json=[{"action": "deny", "target": "*.worse.test"}])
            assert r.status_code == 200, r.text
            assert r.json()["policy"]["egress"] == [
                {"action": "deny", "target": "bad.test"},
                {"action": "deny", "target": "*.worse.test"},
            ]
            r = c.request("DELETE", base, json=["bad.test"])
            assert r.status_code == 200, r.text
            assert r.json()["policy"] == {"defaultAction": "allow", "egress": [{"action": "deny", "target": "*.worse.test"}]}
            # What the record holds is what the SDK reads, the other way round too.
            assert rules(sbx.get_egress_policy()) == [("deny", "*.worse.test")]
            # PUT {} is allow-all again.
            r = c.put(base, json={})
            assert r.status_code == 200, r.text
            assert r.json()["mode"] == "allow_all", r.text
            # The sidecar route under the plain mount works as well.
            r = c.get(f"/sandboxes/{sbx.id}/networkpolicy")
            assert r.status_code == 200 and r.json()["mode"] == "allow_all", r.text
    finally:
        sbx.kill()
        sbx.close()


def connections_follow_the_policy_on_docker():
    """The rules hold for connections, not only for names: an allowed test
    host answers by name, an unlisted address and a name without a rule do
    not, and a PATCH through the SDK turns that round on the running sandbox."""
    near, far = TEST_HOSTS["near.test"], TEST_HOSTS["far.test"]
    sbx = create(
        network_policy=NetworkPolicy(default_action="deny", egress=[NetworkRule(action="allow", target="near.test")])
    )
    try:
        assert connect(sbx, "near.test").startswith("test-host "), "allowed by name"
        assert connect(sbx, far) == "", "an unlisted address is closed"
        assert connect(sbx, "far.test") == "", "a name without a rule is denied"
        sbx.patch_egress_rules(
            [NetworkRule(action="deny", target="near.test"), NetworkRule(action="allow", target="far.test")]
        )
        p = sbx.get_egress_policy()
        assert rules(p) == [("deny", "near.test"), ("allow", "far.test")]
        assert connect(sbx, "far.test").startswith("test-host "), "allowed after the patch"
        assert connect(sbx, "near.test") == "", "denied after the patch"
        assert connect(sbx, near) == "", "its address closed again"
    finally:
        sbx.kill()
        sbx.close()


# Defined only where it runs, so the controller backend's run does not count
# a test that checked nothing: there the same connection checks run in Rust
# (tests/tests/egress_end_to_end.rs) against that test's own hosts.
if BACKEND == "docker":
    test_connections_follow_the_policy_on_docker = connections_follow_the_policy_on_docker
