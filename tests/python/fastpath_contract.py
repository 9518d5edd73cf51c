"""FastPath v1 and v2 driven by clients that are not sandbolt's Rust code.

Stubs are generated at test time with grpcio-tools from the *contract* files
(proto/contracts/fastpath, a verbatim copy of shared/contracts/fastpath, or
$FASTPATH_CONTRACTS), not from the
project's own protos: the point is that a client built from the contract
works against the controller. The channel is insecure with no token, as the
OpenSandbox server's FastPath client uses it.

Run by controller/tests/python_contract.rs, which starts the controller and
a real agent on the test bed (private containerd, busybox with execd as PID
1) and sets FASTPATH_ADDR. Data-plane checks use urllib against the
agent's proxy, from what ResolveEndpoint / v1 `endpoints` return.
"""

import importlib
import os
import sys
import time
import urllib.error
import urllib.request
import uuid

import grpc
import pytest

CONTRACTS = os.environ.get(
    "FASTPATH_CONTRACTS",
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto", "contracts", "fastpath"),
)


@pytest.fixture(scope="session")
def stubs(tmp_path_factory):
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("fastpath_stubs")
    for name in ("fastpath_v1.proto", "fastpath_v2.proto"):
        path = os.path.join(CONTRACTS, name)
        assert os.path.exists(path), f"contract file missing: {path}"
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{CONTRACTS}",
                f"--python_out={out}",
                f"--grpc_python_out={out}",
                path,
            ]
        )
        assert rc == 0, f"protoc failed for {name}"
    sys.path.insert(0, str(out))
    mods = {
        m: importlib.import_module(m)
        for m in ("fastpath_v1_pb2", "fastpath_v1_pb2_grpc", "fastpath_v2_pb2", "fastpath_v2_pb2_grpc")
    }
    return mods


@pytest.fixture(scope="session")
def channel():
    addr = os.environ.get("FASTPATH_ADDR")
    assert addr, "FASTPATH_ADDR must point at a running controller"
    ch = grpc.insecure_channel(addr)
    grpc.channel_ready_future(ch).result(timeout=10)
    yield ch
    ch.close()


@pytest.fixture()
def v2(stubs, channel):
    return stubs["fastpath_v2_pb2"], stubs["fastpath_v2_pb2_grpc"].FastPathServiceStub(channel)


@pytest.fixture()
def v1(stubs, channel):
    return stubs["fastpath_v1_pb2"], stubs["fastpath_v1_pb2_grpc"].FastPathServiceStub(channel)


def ref(pb, name, namespace="default", uid=""):
    return pb.SandboxReference(namespaced_name=pb.NamespacedName(namespace=namespace, name=name), expected_uid=uid)


def code_of(fn):
    with pytest.raises(grpc.RpcError) as err:
        fn()
    return err.value.code()


def http_get(endpoint, path, headers=None):
    """GET http://<endpoint><path> (FastPath endpoints carry no scheme);
    returns (status, body) without raising on 4xx/5xx."""
    assert "://" not in endpoint, endpoint
    req = urllib.request.Request(f"http://{endpoint}{path}", headers=headers or {}, method="GET")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def create_v2(pb, stub, expires=None, metadata=None):
    rid = f"py-{uuid.uuid4().hex[:12]}"
    req = pb.CreateSandboxRequest(
        request_id=rid,
        namespace="default",
        image="busybox",
        command=["sleep", "1000"],
        expires_at_unix_seconds=expires if expires is not None else int(time.time()) + 3600,
        completion=pb.CREATE_COMPLETION_READY,
        pool_ref="",
    )
    if metadata:
        req.metadata.update(metadata)
    return rid, stub.CreateSandbox(req, timeout=60)


def test_v2_create_get_resolve_update_delete(v2):
    pb, stub = v2
    rid, created = create_v2(pb, stub, metadata={"suite": "python"})
    info = created.sandbox
    assert info.ready
    assert info.runtime.state == pb.RUNTIME_STATE_READY
    assert info.data_plane.state == pb.DATA_PLANE_STATE_READY
    assert info.identity.name == rid and info.identity.namespace == "default"
    assert created.completion == pb.CREATE_COMPLETION_READY
    uid = info.identity.uid

    # Idempotent by request_id.
    _, again = rid, stub.CreateSandbox(
        pb.CreateSandboxRequest(
            request_id=rid,
            namespace="default",
            image="busybox",
            command=["sleep", "1000"],
            expires_at_unix_seconds=int(time.time()) + 3600,
            completion=pb.CREATE_COMPLETION_READY,
        ),
        timeout=60,
    )
    assert again.sandbox.identity.uid == uid

    got = stub.GetSandbox(pb.GetSandboxRequest(sandbox=ref(pb, rid, uid=uid)))
    assert got.generation == 1 and got.sandbox.identity.uid == uid

    ep = stub.ResolveEndpoint(
        pb.ResolveEndpointRequest(sandbox=ref(pb, rid), target=pb.EndpointTarget(port=44772))
    )
    assert "://" not in ep.proxy_endpoint
    assert ep.proxy_endpoint.endswith("/44772")
    assert ep.sandbox_uid == uid
    headers = dict(ep.required_headers)
    assert headers["X-Sandbolt-Access-Token"] == headers["X-EXECD-ACCESS-TOKEN"] != ""
    by_component = stub.ResolveEndpoint(
        pb.ResolveEndpointRequest(sandbox=ref(pb, rid), target=pb.EndpointTarget(component_name="execd"))
    )
    assert by_component.proxy_endpoint == ep.proxy_endpoint

    # Renew with the current generation (as the OpenSandbox server does).
    new_exp = int(time.time()) + 7200
    upd = pb.UpdateSandboxRequest(sandbox=ref(pb, rid), expected_generation=got.generation)
    upd.expires_at_unix_seconds = new_exp
    res = stub.UpdateSandbox(upd)
    assert res.committed_generation == 2 and res.sandbox.uid == uid
    stale = pb.UpdateSandboxRequest(sandbox=ref(pb, rid), expected_generation=1)
    stale.expires_at_unix_seconds = new_exp + 1
    assert code_of(lambda: stub.UpdateSandbox(stale)) in (grpc.StatusCode.ABORTED, grpc.StatusCode.ALREADY_EXISTS)

    meta = pb.UpdateSandboxRequest(sandbox=ref(pb, rid), expected_generation=2)
    meta.metadata_upsert["stage"] = "two"
    meta.metadata_delete_keys.append("suite")
    assert stub.UpdateSandbox(meta).committed_generation == 3
    listed = stub.ListSandboxes(pb.ListSandboxesRequest(namespace="default", metadata={"stage": "two"}))
    assert [i.identity.name for i in listed.items] == [rid]

    diag = stub.GetSandboxDiagnostics(pb.SandboxDiagnosticsRequest(sandbox_name=rid, namespace="default", limit=50))
    assert diag.fastlet_reachable
    assert any("placed on agent" in e.message for e in diag.events)
    assert all(e.timestamp_unix_nano > 0 for e in diag.events)

    stub.DeleteSandbox(pb.DeleteRequest(sandbox=ref(pb, rid)))
    assert code_of(lambda: stub.GetSandbox(pb.GetSandboxRequest(sandbox=ref(pb, rid)))) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: stub.DeleteSandbox(pb.DeleteRequest(sandbox=ref(pb, rid)))) == grpc.StatusCode.NOT_FOUND


def test_v2_ready_resolve_ping_execd_through_proxy(v2):
    pb, stub = v2
    rid, created = create_v2(pb, stub)
    assert created.sandbox.ready and created.completion == pb.CREATE_COMPLETION_READY
    ep = stub.ResolveEndpoint(
        pb.ResolveEndpointRequest(sandbox=ref(pb, rid), target=pb.EndpointTarget(port=44772))
    )
    headers = dict(ep.required_headers)
    assert headers, "the proxy needs the per-sandbox token"
    status, body = http_get(ep.proxy_endpoint, "/ping", headers)
    assert status == 200, (status, body)
    # Without the required headers, or with another sandbox's token, the
    # proxy refuses.
    status, _ = http_get(ep.proxy_endpoint, "/ping")
    assert status in (401, 403), status
    wrong = {k: "0" * len(v) for k, v in headers.items()}
    status, _ = http_get(ep.proxy_endpoint, "/ping", wrong)
    assert status in (401, 403), status
    stub.DeleteSandbox(pb.DeleteRequest(sandbox=ref(pb, rid)))
    status, _ = http_get(ep.proxy_endpoint, "/ping", headers)
    assert status != 200, "deleted sandbox must not answer"


def test_v2_manual_cleanup_and_error_codes(v2):
    pb, stub = v2
    rid, _ = create_v2(pb, stub, expires=0)
    renew = pb.UpdateSandboxRequest(sandbox=ref(pb, rid))
    renew.expires_at_unix_seconds = int(time.time()) + 60
    assert code_of(lambda: stub.UpdateSandbox(renew)) == grpc.StatusCode.FAILED_PRECONDITION
    bad = pb.CreateSandboxRequest(request_id=f"py-{uuid.uuid4().hex[:8]}", image="")
    assert code_of(lambda: stub.CreateSandbox(bad)) == grpc.StatusCode.INVALID_ARGUMENT
    nowhere = pb.CreateSandboxRequest(request_id=f"py-{uuid.uuid4().hex[:8]}", image="busybox", pool_ref="no-such-pool")
    assert code_of(lambda: stub.CreateSandbox(nowhere)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    missing = pb.GetSandboxRequest(sandbox=ref(pb, "does-not-exist"))
    assert code_of(lambda: stub.GetSandbox(missing)) == grpc.StatusCode.NOT_FOUND
    v2_snapshot_round_trip(pb, stub, rid)
    stub.DeleteSandbox(pb.DeleteRequest(sandbox=ref(pb, rid)))


def v2_snapshot_round_trip(pb, stub, rid):
    """CreateSandboxSnapshot → CREATING/SUCCEEDED, idempotent by request
    id; GetSandboxSnapshot until SUCCEEDED; DeleteSandboxSnapshot → gone."""
    snap = pb.CreateSandboxSnapshotRequest(request_id=f"snap-{rid}", sandbox=ref(pb, rid), template_name="contract")
    created = stub.CreateSandboxSnapshot(snap).snapshot
    assert created.sandbox_name == rid, created
    assert created.template_name == "contract", created
    assert created.phase in (pb.SNAPSHOT_PHASE_CREATING, pb.SNAPSHOT_PHASE_SUCCEEDED), created
    sid = created.identity.name
    assert sid and created.identity.namespace == "default", created
    get = pb.GetSandboxSnapshotRequest(snapshot=pb.NamespacedName(namespace="default", name=sid))
    deadline = time.time() + 30
    while True:
        got = stub.GetSandboxSnapshot(get).snapshot
        if got.phase == pb.SNAPSHOT_PHASE_SUCCEEDED:
            break
        assert got.phase == pb.SNAPSHOT_PHASE_CREATING, got
        assert time.time() < deadline, got
        time.sleep(0.1)
    assert got.fastlet_name and got.completed_unix_seconds >= got.created_unix_seconds > 0, got
    assert stub.CreateSandboxSnapshot(snap).snapshot.identity.name == sid, "same request id, same snapshot"
    elsewhere = pb.GetSandboxSnapshotRequest(snapshot=pb.NamespacedName(namespace="default", name="no-such-snapshot"))
    assert code_of(lambda: stub.GetSandboxSnapshot(elsewhere)) == grpc.StatusCode.NOT_FOUND
    stub.DeleteSandboxSnapshot(pb.DeleteSandboxSnapshotRequest(snapshot=ref(pb, sid)))
    assert code_of(lambda: stub.GetSandboxSnapshot(get)) == grpc.StatusCode.NOT_FOUND


def test_v2_egress_action_bindings(v2):
    """The OpenSandbox server's egress policy: `action_bindings` with handler
    "egress" at create, reported by GetSandbox, replaced by UpdateSandbox;
    anything else is INVALID_ARGUMENT. Names and addresses are from reserved
    ranges (.test, 198.51.100.0/24, 203.0.113.0/24): nothing is resolved."""
    pb, stub = v2
    deny_but_one = '{"defaultAction": "deny", "egress": [{"action": "allow", "target": "Allowed.TEST"}]}'
    rid = f"py-{uuid.uuid4().hex[:12]}"
    created = stub.CreateSandbox(
        pb.CreateSandboxRequest(
            request_id=rid,
            namespace="default",
            image="busybox",
            command=["sleep", "1000"],
            expires_at_unix_seconds=int(time.time()) + 3600,
            completion=pb.CREATE_COMPLETION_READY,
            action_bindings=[pb.ActionBinding(handler="egress", input=deny_but_one)],
        ),
        timeout=60,
    )
    assert created.sandbox.ready

    def binding():
        got = stub.GetSandbox(pb.GetSandboxRequest(sandbox=ref(pb, rid)))
        items = list(got.sandbox.action_bindings)
        assert len(items) <= 1, items
        return got.generation, (items[0] if items else None)

    generation, b = binding()
    assert b is not None and b.handler == "egress", b
    assert b.state == pb.ACTION_STATE_READY, b
    assert b.last_transition_unix_seconds > 0

    # Replace the whole list: a new egress policy (applied on the node
    # before the call returns), then none at all (= allow all).
    allow_but_net = '{"defaultAction": "allow", "egress": [{"action": "deny", "target": "198.51.100.0/24"}]}'
    upd = pb.UpdateSandboxRequest(sandbox=ref(pb, rid), expected_generation=generation)
    upd.action_bindings.items.append(pb.ActionBinding(handler="egress", input=allow_but_net))
    res = stub.UpdateSandbox(upd, timeout=30)
    assert res.committed_generation == generation + 1
    generation, b = binding()
    assert generation == res.committed_generation
    assert b is not None and b.handler == "egress" and b.state == pb.ACTION_STATE_READY, b
    stale = pb.UpdateSandboxRequest(sandbox=ref(pb, rid), expected_generation=generation - 1)
    stale.action_bindings.items.append(pb.ActionBinding(handler="egress", input=deny_but_one))
    assert code_of(lambda: stub.UpdateSandbox(stale)) == grpc.StatusCode.ABORTED
    clear = pb.UpdateSandboxRequest(sandbox=ref(pb, rid), expected_generation=generation)
    clear.action_bindings.SetInParent()
    assert stub.UpdateSandbox(clear, timeout=30).committed_generation == generation + 1
    assert binding()[1] is None

    # Bad handler, bad JSON, bad target: INVALID_ARGUMENT, nothing created.
    def refused_create(bindings):
        req = pb.CreateSandboxRequest(
            request_id=f"py-{uuid.uuid4().hex[:12]}",
            namespace="default",
            image="busybox",
            action_bindings=bindings,
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.CreateSandbox(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
        missing = pb.GetSandboxRequest(sandbox=ref(pb, req.request_id))
        assert code_of(lambda: stub.GetSandbox(missing)) == grpc.StatusCode.NOT_FOUND
        return err.value.details()

    assert "ingress" in refused_create([pb.ActionBinding(handler="ingress", input="{}")])
    assert "action_bindings[0].input" in refused_create([pb.ActionBinding(handler="egress", input="{not json")])
    bad_target = '{"egress": [{"action": "allow", "target": "no spaces.test"}]}'
    assert "egress[0].target" in refused_create([pb.ActionBinding(handler="egress", input=bad_target)])
    bad_update = pb.UpdateSandboxRequest(sandbox=ref(pb, rid))
    bad_update.action_bindings.items.append(pb.ActionBinding(handler="egress", input='{"defaultAction": "maybe"}'))
    assert code_of(lambda: stub.UpdateSandbox(bad_update)) == grpc.StatusCode.INVALID_ARGUMENT
    assert binding()[1] is None, "a refused update changes nothing"

    stub.DeleteSandbox(pb.DeleteRequest(sandbox=ref(pb, rid)))


def test_v2_list_pagination_and_pools(v2):
    pb, stub = v2
    names = [create_v2(pb, stub, metadata={"page": "yes"})[0] for _ in range(3)]
    seen, token = [], ""
    while True:
        page = stub.ListSandboxes(
            pb.ListSandboxesRequest(namespace="", metadata={"page": "yes"}, page_size=2, page_token=token)
        )
        assert len(page.items) <= 2
        seen += [i.identity.name for i in page.items]
        token = page.next_page_token
        if not token:
            break
    assert sorted(seen) == sorted(names)
    pool = stub.GetPool(pb.GetPoolRequest(namespace="", pool_name=""))
    assert pool.name == "default" and pool.ready_fastlets >= 1 and pool.max_sandboxes_per_pod >= 1
    assert any(p.name == "default" for p in stub.ListPools(pb.ListPoolsRequest(namespace="default")).items)
    for n in names:
        stub.DeleteSandbox(pb.DeleteRequest(sandbox=ref(pb, n)))


def test_v2_pause_resume(v2):
    pb, stub = v2
    rid, _ = create_v2(pb, stub)
    paused = stub.PauseSandbox(pb.PauseSandboxRequest(sandbox=ref(pb, rid), request_id="p1"))
    assert paused.sandbox.state == pb.SANDBOX_STATE_PAUSED
    assert paused.sandbox.runtime.state == pb.RUNTIME_STATE_PAUSED
    resumed = stub.ResumeSandbox(pb.ResumeSandboxRequest(sandbox=ref(pb, rid), request_id="r1"))
    assert resumed.sandbox.state == pb.SANDBOX_STATE_RUNNING and resumed.sandbox.ready
    stub.DeleteSandbox(pb.DeleteRequest(sandbox=ref(pb, rid)))


def test_v1_all_five_rpcs(v1):
    pb, stub = v1
    name = f"py1-{uuid.uuid4().hex[:10]}"
    created = stub.CreateSandbox(
        pb.CreateRequest(image="busybox", command=["sleep", "1000"], name=name, exposed_ports=[8080]),
        timeout=60,
    )
    assert created.sandbox_name == name and created.sandbox_id and created.agent_pod
    assert len(created.endpoints) == 1 and created.endpoints[0].endswith("/8080")
    assert "://" not in created.endpoints[0]
    # v1 carries no token, so a v1 client gets an endpoint it cannot use
    # (the proxy refuses without the per-sandbox token): see the issue notes.
    status, _ = http_get(created.endpoints[0], "/")
    assert status in (401, 403), status
    info = stub.GetSandbox(pb.GetRequest(sandbox_name=name))  # empty namespace = default
    assert info.phase == "Running" and info.sandbox_id == created.sandbox_id
    assert info.pool_ref == "default" and info.created_at > 0
    dup = pb.CreateRequest(image="busybox", name=name)
    assert code_of(lambda: stub.CreateSandbox(dup)) == grpc.StatusCode.ALREADY_EXISTS
    upd = stub.UpdateSandbox(pb.UpdateRequest(sandbox_name=name, namespace="default", labels={"k": "v"}))
    assert upd.success and upd.sandbox.sandbox_name == name
    assert name in [i.sandbox_name for i in stub.ListSandboxes(pb.ListRequest(namespace="")).items]
    assert stub.DeleteSandbox(pb.DeleteRequest(sandbox_name=name)).success
    missing = pb.GetRequest(sandbox_name=name, namespace="default")
    assert code_of(lambda: stub.GetSandbox(missing)) == grpc.StatusCode.NOT_FOUND
    strong = stub.CreateSandbox(
        pb.CreateRequest(image="busybox", command=["sleep", "1000"], name=name + "-s", consistency_mode=pb.STRONG),
        timeout=60,
    )
    assert strong.sandbox_name == name + "-s"
    assert stub.DeleteSandbox(pb.DeleteRequest(sandbox_name=name + "-s", namespace="default")).success
