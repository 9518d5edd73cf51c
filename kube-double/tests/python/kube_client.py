"""Drives the kube double with the Python `kubernetes` client the OpenSandbox
server uses (CustomObjectsApi, watch.Watch), the way its informer and
client do. Run by tests/python_client.rs; prints one JSON object of what
it observed, which the Rust test asserts on.

argv: kubeconfig path, group, version, plural, a compacted resourceVersion.
"""

import json
import sys

import kubernetes
from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException


def status_of(call):
    """The HTTP status of an API call that must fail."""
    try:
        call()
    except ApiException as exc:
        return exc.status
    return None


def main():
    kubeconfig, group, version, plural, stale_rv = sys.argv[1:6]
    config.load_kube_config(config_file=kubeconfig)
    api = client.CustomObjectsApi()
    ns = "default"
    out = {"client_version": kubernetes.__version__}

    # The informer's LIST: no selector, then the list's resourceVersion.
    listed = api.list_namespaced_custom_object(group, version, ns, plural)
    out["list_kind"] = listed["kind"]
    out["list_names"] = sorted(i["metadata"]["name"] for i in listed["items"])
    list_rv = listed["metadata"]["resourceVersion"]

    body = {
        "apiVersion": f"{group}/{version}",
        "kind": listed["kind"][: -len("List")],
        "metadata": {"name": "from-python", "labels": {"app": "a"}},
        "spec": {"size": 1},
        "status": {"phase": "dropped-by-the-status-subresource"},
    }
    created = api.create_namespaced_custom_object(group, version, ns, plural, body)
    out["created_meta"] = {
        k: created["metadata"].get(k)
        for k in ("uid", "creationTimestamp", "generation", "resourceVersion", "namespace")
    }
    out["created_status"] = created.get("status")
    got = api.get_namespaced_custom_object(group, version, ns, plural, "from-python")
    out["get_uid_matches"] = got["metadata"]["uid"] == created["metadata"]["uid"]

    # The server's direct list passes label_selector even when empty.
    out["selected"] = [
        i["metadata"]["name"]
        for i in api.list_namespaced_custom_object(
            group, version, ns, plural, label_selector="app=a"
        )["items"]
    ]
    out["selected_empty"] = sorted(
        i["metadata"]["name"]
        for i in api.list_namespaced_custom_object(
            group, version, ns, plural, label_selector=""
        )["items"]
    )

    api.delete_namespaced_custom_object(
        group, version, ns, plural, "from-python", grace_period_seconds=0
    )
    out["get_after_delete"] = status_of(
        lambda: api.get_namespaced_custom_object(group, version, ns, plural, "from-python")
    )

    # The informer's WATCH from the list's version: replays the create and
    # the delete, then ends at timeoutSeconds.
    events = []
    for event in watch.Watch().stream(
        api.list_namespaced_custom_object,
        group,
        version,
        ns,
        plural,
        resource_version=list_rv,
        timeout_seconds=2,
        _request_timeout=(5, 12),
    ):
        events.append([event["type"], event["object"]["metadata"]["name"]])
    out["watch_events"] = events

    # A compacted version: an ERROR 410 event, raised by the client.
    out["stale_watch"] = status_of(
        lambda: list(
            watch.Watch().stream(
                api.list_namespaced_custom_object,
                group,
                version,
                ns,
                plural,
                resource_version=stale_rv,
                timeout_seconds=2,
            )
        )
    )
    out["unknown_plural"] = status_of(
        lambda: api.list_namespaced_custom_object(group, version, ns, "nothings")
    )
    resources = api.get_api_resources(group, version)
    out["discovery"] = sorted(r.name for r in resources.resources)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
