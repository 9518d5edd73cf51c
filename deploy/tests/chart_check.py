"""Renders, lints and validates the sandbolt Helm chart with real Helm.

Helm runs in-process: helm-python-sdk binds (ctypes) to libhelm_c, a C ABI
over Helm's own Go SDK (v4), shipped inside the wheel; no helm binary.

  python chart_check.py CHART CRD_DIR [--values FILE.json] [--extra FILE.yaml]...

1. `helm lint --strict` (warnings count as errors) for every Kubernetes
   version in KUBE_VERSIONS;
2. renders the templates (release "sb" in namespace "sandbolt");
3. validates every rendered object, every CRD in CRD_DIR and every --extra
   document with kubernetes-validate (strict: unknown fields are errors)
   for every version in KUBE_VERSIONS; an object of one of the project's
   own kinds is validated against its CRD's schema instead (also rejecting
   unknown fields), and a prometheus-operator ServiceMonitor against that
   CRD's schema (cloudcoil's models of prometheus-operator's CRDs, as JSON
   schema, closed the same way). A kind no schema is known for is an error.

On success prints {"objects": [...], "notes": "..."} as JSON and exits 0;
otherwise prints every problem to stderr and exits 1.
"""

import argparse
import copy
import json
import pathlib
import sys

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

# A current release and the newest kubernetes-validate knows.
KUBE_VERSIONS = ["1.35.0", "1.37.0"]
RELEASE, NAMESPACE = "sb", "sandbolt"


def closed(schema):
    """The schema with additionalProperties: false wherever properties are
    listed and nothing else is said (the API server would prune unknown
    fields silently; here they are errors)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node and not node.get(
                "x-kubernetes-preserve-unknown-fields"
            ):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


def load_crds(crd_dir):
    crds = {}
    for path in sorted(pathlib.Path(crd_dir).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                crds[str(path)] = doc
    return crds


def crd_schemas(crds):
    out = {}
    for crd in crds.values():
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for v in crd["spec"]["versions"]:
            schema = copy.deepcopy(v["schema"]["openAPIV3Schema"])
            # The API server adds these to every custom resource's schema.
            schema.setdefault("properties", {}).update(
                {
                    "apiVersion": {"type": "string", "enum": [f"{group}/{v['name']}"]},
                    "kind": {"type": "string", "enum": [kind]},
                    "metadata": {"type": "object"},
                }
            )
            out[(f"{group}/{v['name']}", kind)] = closed(schema)
    return out


SERVICE_MONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")


def service_monitor_schema():
    """prometheus-operator's ServiceMonitor schema. Imported only when a
    ServiceMonitor is to be checked: the models take seconds to load."""
    from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

    schema = ServiceMonitor.model_json_schema(by_alias=True)
    # A rendered object names its kind and version; the models default them.
    schema["properties"]["apiVersion"] = {"type": "string", "enum": [SERVICE_MONITOR[0]]}
    schema["properties"]["kind"] = {"type": "string", "enum": [SERVICE_MONITOR[1]]}
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata", "spec"})
    return closed(schema)


def validate(obj, where, schemas, problems):
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key == SERVICE_MONITOR and key not in schemas:
        schemas[key] = service_monitor_schema()
    name = f"{where}: {obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if key in schemas:
        errors = sorted(
            jsonschema.Draft7Validator(schemas[key]).iter_errors(obj), key=lambda e: list(e.path)
        )
        for e in errors:
            path = ".".join(str(p) for p in e.path)
            problems.append(f"{name} does not match its CRD: {path}: {e.message}")
        return
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            problems.append(f"{name} is invalid for Kubernetes {version}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{name}: no schema for Kubernetes {version}: {e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("chart")
    ap.add_argument("crd_dir")
    ap.add_argument("--values", help="JSON file of values")
    ap.add_argument("--extra", action="append", default=[], help="more YAML documents to validate")
    args = ap.parse_args()
    values = json.loads(pathlib.Path(args.values).read_text()) if args.values else None

    problems = []
    for version in KUBE_VERSIONS:
        report = helm.lint(args.chart, values, strict=True, namespace=NAMESPACE, kube_version=f"v{version}")
        for m in report.get("messages") or []:
            # 0 unknown, 1 info, 2 warning, 3 error; strict: warnings fail.
            if m.get("severity", 0) >= 2:
                problems.append(f"helm lint --strict (Kubernetes {version}): {m.get('path')}: {m.get('error')}")
        for e in report.get("errors") or []:
            problems.append(f"helm lint --strict (Kubernetes {version}): {e}")

    with helm.Chart.load(args.chart) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)

    crds = load_crds(args.crd_dir)
    if not crds:
        problems.append(f"no CRDs in {args.crd_dir}")
    schemas = crd_schemas(crds)
    for path, crd in crds.items():
        validate(crd, path, schemas, problems)

    objects, notes = [], ""
    for template, text in sorted(manifests.items()):
        if template.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc is None:
                continue
            objects.append(doc)
            validate(doc, template, schemas, problems)
    for extra in args.extra:
        for doc in yaml.safe_load_all(pathlib.Path(extra).read_text()):
            if doc is not None:
                validate(doc, extra, schemas, problems)

    if not objects:
        problems.append("the chart rendered no objects")
    if problems:
        for p in problems:
            print(p, file=sys.stderr)
        sys.exit(1)
    json.dump({"objects": objects, "notes": notes}, sys.stdout)


if __name__ == "__main__":
    main()
