//! The Helm chart, rendered and linted by real Helm (helm-python-sdk: Helm's
//! Go SDK v4 in-process) and every object validated with kubernetes-validate
//! (see chart_check.py). Needs the venv from `scripts/python-env.sh`, which
//! these tests create; a missing venv fails them, never skips them.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn python() -> PathBuf {
    let out = Command::new(repo().join("scripts/python-env.sh"))
        .output()
        .expect("running scripts/python-env.sh");
    assert!(
        out.status.success(),
        "scripts/python-env.sh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Lints, renders and validates; Ok(objects, notes) or Err(stderr).
pub(crate) fn check(values: Option<Value>, extra: &[&str]) -> Result<(Vec<Value>, String), String> {
    let dir = tempfile::tempdir().unwrap();
    let deploy = repo().join("deploy");
    let mut cmd = Command::new(python());
    cmd.arg(deploy.join("tests/chart_check.py"))
        .arg(deploy.join("helm/sandbolt"))
        .arg(deploy.join("helm/sandbolt/crds"));
    if let Some(v) = values {
        let p = dir.path().join("values.json");
        std::fs::write(&p, v.to_string()).unwrap();
        cmd.arg("--values").arg(p);
    }
    for (i, doc) in extra.iter().enumerate() {
        let p = dir.path().join(format!("extra{i}.yaml"));
        std::fs::write(&p, doc).unwrap();
        cmd.arg("--extra").arg(p);
    }
    let out = cmd.output().expect("running chart_check.py");
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let v: Value = serde_json::from_slice(&out.stdout).expect("chart_check.py output");
    Ok((
        v["objects"].as_array().unwrap().clone(),
        v["notes"].as_str().unwrap().to_string(),
    ))
}

pub(crate) fn find<'a>(objs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind}/{name} among {}", names(objs).join(", ")))
}

fn names(objs: &[Value]) -> Vec<String> {
    objs.iter()
        .map(|o| {
            format!(
                "{}/{}",
                o["kind"].as_str().unwrap(),
                o["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect()
}

pub(crate) fn container<'a>(obj: &'a Value, name: &str) -> &'a Value {
    obj["spec"]["template"]["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

pub(crate) fn args(c: &Value) -> Vec<String> {
    c["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect()
}

fn env<'a>(c: &'a Value, name: &str) -> &'a Value {
    c["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == name)
        .unwrap_or_else(|| panic!("no env {name} in {}", c["name"]))
}

/// The downward-API field that environment variable `name` of `c` comes from.
fn field_ref<'a>(c: &'a Value, name: &str) -> &'a Value {
    &env(c, name)["valueFrom"]["fieldRef"]["fieldPath"]
}

pub(crate) fn mounts(c: &Value) -> Vec<String> {
    c["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap().to_string())
        .collect()
}

/// Every `--flag=` the chart passes exists on that `sandbolt` subcommand
/// (clap derives `--some-flag` from a `some_flag` field, or `long = "..."`).
/// A subcommand's flags are in `cli/src/<sub>_cmd.rs`, in the argument
/// groups it flattens from `cli/src/containerd.rs` or from another command
/// (`#[command(flatten)] x: crate::<module>::<Group>`: that struct only),
/// or, for a component with its own entry point, in `<sub>/src/cli.rs`.
pub(crate) fn assert_real_flags(c: &Value) {
    let a = args(c);
    let sub = &a[1];
    let sources = [
        format!("cli/src/{sub}_cmd.rs"),
        "cli/src/containerd.rs".to_string(),
        format!("{sub}/src/cli.rs"),
    ];
    let mut src: String = sources
        .iter()
        .filter_map(|p| std::fs::read_to_string(repo().join(p)).ok())
        .collect();
    src += &flattened_groups(&src);
    assert!(!src.is_empty(), "no source for `sandbolt {sub}`");
    for flag in &a[2..] {
        let name = flag.trim_start_matches("--").split('=').next().unwrap();
        let field = format!(" {}: ", name.replace('-', "_"));
        let long = format!("long = \"{name}\"");
        assert!(
            src.contains(&field) || src.contains(&long),
            "`sandbolt {sub}` has no flag --{name} (looked in {sources:?})"
        );
    }
}

/// The source of the argument structs `src` flattens by path
/// (`crate::<module>::<Group>`), each struct alone.
fn flattened_groups(src: &str) -> String {
    let mut out = String::new();
    let mut lines = src.lines();
    while let Some(line) = lines.next() {
        if !line.contains("#[command(flatten)]") {
            continue;
        }
        let Some(path) = lines
            .next()
            .and_then(|field| field.split("crate::").nth(1))
            .map(|p| p.trim_end_matches(',').trim())
        else {
            continue;
        };
        let Some((module, group)) = path.split_once("::") else {
            continue;
        };
        let file = std::fs::read_to_string(repo().join(format!("cli/src/{module}.rs")))
            .unwrap_or_default();
        if let Some(start) = file.find(&format!("struct {group} {{")) {
            let body = &file[start..];
            out += &body[..body.find("\n}").map_or(body.len(), |end| end + 2)];
        }
    }
    out
}

/// Nothing secret is written into a pod spec: token-like variables come
/// from a Secret.
fn assert_tokens_from_secret(objs: &[Value], secret: &str) {
    for o in objs.iter().filter(|o| o["spec"]["template"].is_object()) {
        for c in o["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap()
        {
            for e in c["env"].as_array().unwrap() {
                let n = e["name"].as_str().unwrap();
                if n.contains("TOKEN") || n.contains("API_KEY") {
                    assert!(
                        e.get("value").is_none(),
                        "{n} is a literal in {}",
                        c["name"]
                    );
                    assert_eq!(e["valueFrom"]["secretKeyRef"]["name"], secret, "{n}");
                }
            }
        }
    }
}

/// Whether one rule of `role` grants all of `verbs` on exactly `resource`.
fn grants(role: &Value, resource: &str, verbs: &[&str]) -> bool {
    role["rules"].as_array().unwrap().iter().any(|r| {
        r["resources"] == json!([resource])
            && verbs
                .iter()
                .all(|v| r["verbs"].as_array().unwrap().contains(&json!(v)))
    })
}

/// No RBAC rule grants `*`, and nothing may touch Secrets.
fn assert_least_privilege(objs: &[Value]) {
    for o in objs
        .iter()
        .filter(|o| o["kind"] == "Role" || o["kind"] == "ClusterRole")
    {
        for r in o["rules"].as_array().unwrap() {
            for key in ["apiGroups", "resources", "verbs"] {
                assert!(
                    !r[key].as_array().unwrap().contains(&json!("*")),
                    "wildcard in {}",
                    o["metadata"]["name"]
                );
            }
            assert!(
                !r["resources"]
                    .as_array()
                    .unwrap()
                    .contains(&json!("secrets"))
            );
        }
    }
}

#[test]
fn default_values_lint_render_and_validate() {
    let (objs, notes) = check(None, &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));

    let ctl = find(&objs, "Deployment", "sb-sandbolt-controller");
    let c = container(ctl, "controller");
    assert_real_flags(c);
    assert!(
        args(c).contains(&"--consistency=strong".into()),
        "{:?}",
        args(c)
    );
    assert!(args(c).contains(&"--listen=0.0.0.0:9090".into()));
    // Kubernetes store by default: two replicas, a Lease, identity and
    // namespace from the downward API, no liveness probe on a port only the
    // leader opens, and no redb volume claim.
    assert!(
        args(c).contains(&"--store=kubernetes".into()),
        "{:?}",
        args(c)
    );
    assert!(args(c).contains(&"--lease-name=sb-sandbolt-controller".into()));
    assert!(!args(c).iter().any(|a| a.starts_with("--data-dir")));
    assert_eq!(ctl["spec"]["replicas"], 2);
    assert_eq!(ctl["spec"]["strategy"]["type"], "RollingUpdate");
    assert_eq!(field_ref(c, "SANDBOLT_POD_NAME"), "metadata.name");
    assert_eq!(field_ref(c, "SANDBOLT_POD_NAMESPACE"), "metadata.namespace");
    // Every replica derives sandbox tokens from the one key in the Secret.
    assert!(args(c).contains(&"--token-key-file=/etc/sandbolt/token-key/token.key".into()));
    assert!(mounts(c).contains(&"/etc/sandbolt/token-key".into()));
    assert!(c.get("livenessProbe").is_none());
    // Readiness asks /readyz of the ops port (503 on a standby), not merely
    // whether the port is open; TLS on the main port (the default) rules out
    // the kubelet's gRPC probe there.
    assert_http_probe(&c["readinessProbe"], "/readyz", "metrics");
    assert!(!objs.iter().any(|o| o["kind"] == "PersistentVolumeClaim"));
    // The store's API calls are granted: Sandboxes cluster-wide (they live
    // in the requests' namespaces), Leases in the release namespace.
    let cluster = find(
        &objs,
        "ClusterRole",
        "sandbolt-sb-sandbolt-controller-nodes",
    );
    assert!(
        grants(
            cluster,
            "sandboxes",
            &["watch", "create", "update", "delete"]
        ),
        "{cluster}"
    );
    let role = find(&objs, "Role", "sb-sandbolt-controller");
    assert!(
        grants(role, "leases", &["get", "list", "create", "update"]),
        "{role}"
    );
    let l = container(ctl, "lifecycle");
    assert_real_flags(l);
    // Over loopback, TLS on by default (the certificate names localhost).
    assert!(args(l).contains(&"--controller=https://localhost:9090".into()));
    // FastPath requires a token by default, and the bundled lifecycle API
    // sends it: both from the same Secret key.
    for c in [c, l] {
        assert_eq!(
            env(c, "SANDBOLT_FASTPATH_TOKEN")["valueFrom"]["secretKeyRef"]["key"],
            "fastpath-token",
            "{}",
            c["name"]
        );
    }
    assert_tokens_from_secret(&objs, "sb-sandbolt-tokens");
    assert_eq!(
        ctl["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"],
        true
    );
    assert_eq!(
        find(&objs, "Service", "sb-sandbolt-fastpath")["spec"]["ports"][0]["port"],
        9090
    );
    assert_eq!(
        find(&objs, "Service", "sb-sandbolt-lifecycle")["spec"]["ports"][0]["port"],
        8080
    );

    let agent = find(&objs, "DaemonSet", "sb-sandbolt-agent-default");
    let pod = &agent["spec"]["template"]["spec"];
    assert_eq!(pod["hostPID"], true);
    assert_eq!(pod["automountServiceAccountToken"], false);
    let a = container(agent, "agent");
    assert_real_flags(a);
    // The image has no nftables or CNI plugins (see values.yaml).
    assert!(args(a).contains(&"--network=none".into()), "{:?}", args(a));
    // TLS on its API by default: probed on its ops port (see
    // `tls_is_on_by_default_...` for the gRPC probe with TLS off).
    assert_http_probe(&a["readinessProbe"], "/healthz", "metrics");
    assert_eq!(a["securityContext"]["privileged"], true);
    assert!(
        args(a).contains(&"--controller=https://sb-sandbolt-fastpath.sandbolt.svc:9090".into())
    );
    assert!(args(a).contains(&"--pool=default".into()));
    assert_eq!(field_ref(a, "SANDBOLT_NODE_NAME"), "spec.nodeName");
    assert_eq!(field_ref(a, "SANDBOLT_POD_UID"), "metadata.uid");
    assert_eq!(field_ref(a, "SANDBOLT_ADVERTISE_HOST"), "status.podIP");
    let ports: Vec<i64> = a["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["containerPort"].as_i64().unwrap())
        .collect();
    assert_eq!(ports, [9091, 9092, 9095]);
    let vols = pod["volumes"].as_array().unwrap();
    let sock = vols
        .iter()
        .find(|v| v["hostPath"]["path"] == "/run/containerd/containerd.sock")
        .expect("socket hostPath");
    assert_eq!(sock["hostPath"]["type"], "Socket");
    assert!(
        vols.iter()
            .any(|v| v["hostPath"]["path"] == "/var/lib/sandbolt/volumes"),
        "volume root hostPath"
    );
    // The image has no btrfs-progs: no named volumes by default, and no
    // mount for them.
    assert!(
        args(a).contains(&"--volume-backend=none".into()),
        "{:?}",
        args(a)
    );
    assert!(!args(a).iter().any(|f| f.starts_with("--volume-root")));
    assert!(!mounts(a).contains(&"/var/lib/sandbolt/named-volumes".into()));
    // Host paths keep their host path inside the pod (containerd resolves
    // them); the controller's CA is the one Secret mount.
    for m in mounts(a)
        .into_iter()
        .filter(|m| m != "/etc/sandbolt/tls-ca")
    {
        assert!(
            vols.iter().any(|v| v["hostPath"]["path"] == m.as_str()),
            "{m} mounted elsewhere than on the host"
        );
    }

    let jan = find(&objs, "DaemonSet", "sb-sandbolt-janitor-default");
    let j = container(jan, "janitor");
    assert_real_flags(j);
    assert_eq!(
        mounts(j),
        [
            "/run/containerd",
            "/var/lib/sandbolt/agent",
            "/var/lib/sandbolt/janitor",
            "/etc/sandbolt/tls-ca"
        ]
    );
    // The agent-pod rule: this node's agent pods, read in the release's
    // namespace with a selector that matches the agent pods' own labels.
    assert_eq!(env(j, "SANDBOLT_KUBE")["value"], "true");
    assert_eq!(field_ref(j, "SANDBOLT_POD_NAMESPACE"), "metadata.namespace");
    assert_eq!(field_ref(j, "SANDBOLT_NODE_NAME"), "spec.nodeName");
    let selector = args(j)
        .iter()
        .find_map(|a| a.strip_prefix("--agent-pod-selector=").map(str::to_string))
        .expect("--agent-pod-selector");
    let agent_labels = &agent["spec"]["template"]["metadata"]["labels"];
    for term in selector.split(',') {
        let (k, v) = term.split_once('=').unwrap();
        assert_eq!(agent_labels[k], v, "agent pods carry {term}");
    }
    assert!(jan["spec"]["template"]["spec"].get("hostPID").is_none());
    assert!(jan["spec"]["template"]["spec"].get("hostNetwork").is_none());

    let secret = find(&objs, "Secret", "sb-sandbolt-tokens");
    let mut keys: Vec<&String> = secret["data"].as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "agent-token",
            "api-key",
            "fastpath-token",
            "identity-key",
            "token-key"
        ]
    );
    assert_tokens_from_secret(&objs, "sb-sandbolt-tokens");
    assert_least_privilege(&objs);
    for sa in ["controller", "agent", "janitor"] {
        find(&objs, "ServiceAccount", &format!("sb-sandbolt-{sa}"));
    }
    assert!(
        !objs
            .iter()
            .any(|o| o["kind"] == "Role" && o["metadata"]["name"] == "sb-sandbolt-agent")
    );
    find(&objs, "NetworkPolicy", "sb-sandbolt-controller");

    let pool = find(&objs, "SandboxPool", "default");
    assert_eq!(pool["spec"]["runtime"], "runc");
    assert_eq!(pool["spec"]["maxSandboxesPerAgent"], 256);

    assert!(
        notes.contains("kubectl -n sandbolt port-forward svc/sb-sandbolt-lifecycle 8080:8080"),
        "{notes}"
    );
    assert!(
        notes.contains("sb-sandbolt-fastpath.sandbolt.svc:9090"),
        "{notes}"
    );
    assert!(
        notes.contains("get lease sb-sandbolt-controller"),
        "{notes}"
    );
}

#[test]
fn non_default_values_lint_render_and_validate() {
    let values = json!({
        "image": {"repository": "registry.example/sandbolt", "tag": "1.2.3"},
        "auth": {"existingSecret": "my-tokens"},
        "controller": {
            "store": "embedded",
            "replicas": 1,
            "consistency": "fast",
            "fastpath": {"requireToken": true},
            "persistence": {"enabled": true, "size": "5Gi", "storageClassName": "fast-ssd"}
        },
        "lifecycle": {"enabled": false},
        "agent": {"hostNetwork": true, "proxyPort": 19092, "network": "egress",
                  "namedVolumes": {"backend": "auto", "root": "/srv/named", "poolSize": "50Gi"}},
        "networkPolicy": {"enabled": false},
        "pools": [
            {"name": "gpu", "nodeSelector": {"sandbolt.io/pool": "gpu"}, "maxSandboxesPerAgent": 8,
             "runtime": "crun", "warmImages": ["docker.io/library/python:3.12"],
             "capacity": {"minAgents": 2, "maxSandboxes": 12},
             "limits": {"defaults": {"cpu": "500m", "memory": "256Mi"},
                        "max": {"cpu": 2, "pids": 2048}}},
            {"name": "secure", "maxSandboxesPerAgent": 32, "runtime": "runsc"}
        ]
    });
    let (objs, notes) =
        check(Some(values), &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));

    assert!(
        !objs
            .iter()
            .any(|o| o["kind"] == "Secret" && o["metadata"]["name"] != "sb-sandbolt-tls"),
        "existingSecret: no Secret rendered but the TLS one (values \"tls\")"
    );
    assert_tokens_from_secret(&objs, "my-tokens");
    assert_least_privilege(&objs);
    assert!(!objs.iter().any(|o| o["kind"] == "NetworkPolicy"));
    assert!(
        !objs
            .iter()
            .any(|o| o["metadata"]["name"] == "sb-sandbolt-lifecycle")
    );

    let ctl = find(&objs, "Deployment", "sb-sandbolt-controller");
    let c = container(ctl, "controller");
    assert_eq!(c["image"], "registry.example/sandbolt:1.2.3");
    assert!(args(c).contains(&"--consistency=fast".into()));
    assert_eq!(
        env(c, "SANDBOLT_FASTPATH_TOKEN")["valueFrom"]["secretKeyRef"]["key"],
        "fastpath-token"
    );
    assert_eq!(
        ctl["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert!(args(c).contains(&"--store=embedded".into()));
    assert!(args(c).contains(&"--data-dir=/var/lib/sandbolt/controller".into()));
    assert_eq!(ctl["spec"]["strategy"]["type"], "Recreate");
    assert_http_probe(&c["livenessProbe"], "/healthz", "metrics");
    let pvc = find(&objs, "PersistentVolumeClaim", "sb-sandbolt-controller");
    assert_eq!(pvc["spec"]["storageClassName"], "fast-ssd");

    let gpu = find(&objs, "DaemonSet", "sb-sandbolt-agent-gpu");
    assert_eq!(
        gpu["spec"]["template"]["spec"]["nodeSelector"]["sandbolt.io/pool"],
        "gpu"
    );
    assert_eq!(gpu["spec"]["template"]["spec"]["hostNetwork"], true);
    let a = container(gpu, "agent");
    assert!(
        args(a).contains(&"--max-sandboxes=8".into()),
        "{:?}",
        args(a)
    );
    assert!(args(a).contains(&"--proxy-listen=0.0.0.0:19092".into()));
    assert!(args(a).contains(&"--network=egress".into()));
    // Named volumes: the flags, and the root on the node, mounted with
    // Bidirectional propagation (the loop-backed btrfs the agent mounts
    // there outlives the agent pod).
    for flag in [
        "--volume-backend=auto",
        "--volume-root=/srv/named",
        "--volume-pool-size=50Gi",
    ] {
        assert!(args(a).contains(&flag.into()), "{flag}: {:?}", args(a));
    }
    let named = a["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/srv/named")
        .expect("named volume root mounted");
    assert_eq!(named["mountPropagation"], "Bidirectional");
    assert!(
        gpu["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v["hostPath"]["path"] == "/srv/named"),
        "named volume root hostPath"
    );
    assert!(args(a).contains(&"--runtime=crun".into()), "{:?}", args(a));
    assert!(
        args(a).contains(&"--warm-image=docker.io/library/python:3.12".into()),
        "{:?}",
        args(a)
    );
    // The pool's resource policy reaches its agents (which report it to the
    // controller) and its SandboxPool; unset values pass no flag.
    for flag in [
        "--pool-default-cpu=500m",
        "--pool-default-memory=256Mi",
        "--pool-max-cpu=2",
        "--pool-max-pids=2048",
    ] {
        assert!(args(a).contains(&flag.into()), "{flag}: {:?}", args(a));
    }
    assert!(
        !args(a).iter().any(|f| f.starts_with("--pool-max-memory")),
        "{:?}",
        args(a)
    );
    let gpu_pool = find(&objs, "SandboxPool", "gpu");
    assert_eq!(gpu_pool["spec"]["limits"]["defaults"]["memory"], "256Mi");
    assert_eq!(gpu_pool["spec"]["limits"]["max"]["pids"], 2048);
    assert_eq!(field_ref(a, "SANDBOLT_ADVERTISE_HOST"), "status.hostIP");
    find(&objs, "DaemonSet", "sb-sandbolt-janitor-gpu");
    find(&objs, "DaemonSet", "sb-sandbolt-agent-secure");
    find(&objs, "DaemonSet", "sb-sandbolt-janitor-secure");

    let pool = find(&objs, "SandboxPool", "gpu");
    assert_eq!(pool["spec"]["runtime"], "crun");
    assert_eq!(pool["spec"]["capacity"]["maxSandboxes"], 12);
    assert_eq!(
        pool["spec"]["warmImages"][0],
        "docker.io/library/python:3.12"
    );
    assert_eq!(
        find(&objs, "SandboxPool", "secure")["spec"]["runtime"],
        "runsc"
    );

    assert!(notes.contains("gpu (crun), secure (runsc)"), "{notes}");
    assert!(!notes.contains("lifecycle"), "{notes}");
    assert!(!notes.contains("Lease"), "{notes}");
}

#[test]
fn invalid_values_are_refused() {
    for (values, why) in [
        (
            json!({"controller": {"consistency": "eventual"}}),
            "controller.consistency must be strong or fast",
        ),
        (
            json!({"pools": [{"name": "p", "runtime": "kata"}]}),
            "runtime must be runc, crun or runsc",
        ),
        (
            json!({"pools": [{"name": "p"}, {"name": "p"}]}),
            "pool \"p\" is listed twice",
        ),
        (
            json!({"controller": {"store": "embedded", "replicas": 2}}),
            "needs controller.store=kubernetes",
        ),
        (
            json!({"controller": {"store": "etcd"}}),
            "controller.store must be kubernetes or embedded",
        ),
        (
            json!({"agent": {"network": "bridge"}}),
            "agent.network must be egress or none",
        ),
        (
            json!({"agent": {"network": "egress"}}),
            "agent.network=egress needs agent.hostNetwork=true",
        ),
        (
            json!({"agent": {"namedVolumes": {"backend": "zfs"}}}),
            "agent.namedVolumes.backend must be auto, btrfs, directory or none",
        ),
        (
            json!({"agent": {"namedVolumes": {"backend": "auto",
                                               "root": "/var/lib/sandbolt/volumes/named"}}}),
            "agent.namedVolumes.root must lie outside agent.volumeRoot",
        ),
    ] {
        let err = check(Some(values.clone()), &[]).expect_err(&format!("{values} was accepted"));
        assert!(err.contains(why), "{values}: expected {why:?} in:\n{err}");
    }
}

#[test]
fn validation_rejects_invalid_objects() {
    let deployment = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: bad}\nspec:\n  replicas: three\n  selector: {matchLabels: {a: b}}\n  template:\n    metadata: {labels: {a: b}}\n    spec: {containers: [{name: c, image: i}]}\n";
    let err = check(None, &[deployment]).expect_err("a Deployment with replicas: three passed");
    assert!(
        err.contains("Deployment/bad is invalid for Kubernetes 1.35.0: spec.replicas"),
        "{err}"
    );

    let unknown =
        "apiVersion: v1\nkind: Service\nmetadata: {name: typo}\nspec: {prots: [{port: 1}]}\n";
    let err = check(None, &[unknown]).expect_err("an unknown field passed");
    assert!(err.contains("Service/typo is invalid"), "{err}");

    let pool = "apiVersion: sandbolt.io/v1alpha1\nkind: SandboxPool\nmetadata: {name: p}\nspec: {maxSandboxesPerAgent: 0, runtime: kata, extra: 1}\n";
    let err = check(None, &[pool]).expect_err("a bad SandboxPool passed");
    for part in [
        "spec.maxSandboxesPerAgent",
        "spec.runtime",
        "'extra' was unexpected",
    ] {
        assert!(
            err.contains("SandboxPool/p does not match its CRD") && err.contains(part),
            "{part}: {err}"
        );
    }

    let unknown_kind = "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w}\n";
    let err = check(None, &[unknown_kind]).expect_err("a kind without a schema passed");
    assert!(err.contains("Widget/w: no schema"), "{err}");
}

/// Agent outages: the controller gets both timeouts and asks the Kubernetes
/// API about silent agents' pods, its Role lets it, and the agent pods carry
/// what it looks for (`KubeAgentPresence`: their own pod by name and UID,
/// a successor by `app.kubernetes.io/component=agent` and `sandbolt.io/pool`).
#[test]
fn agent_outage_timeouts_and_pod_checks_reach_the_controller() {
    let (objs, _) = check(None, &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let c = container(
        find(&objs, "Deployment", "sb-sandbolt-controller"),
        "controller",
    );
    assert_real_flags(c);
    for flag in [
        "--agent-lost-timeout=10s",
        "--agent-gone-timeout=5m",
        "--agent-presence=kubernetes",
    ] {
        assert!(args(c).contains(&flag.into()), "{flag}: {:?}", args(c));
    }
    let role = find(&objs, "Role", "sb-sandbolt-controller");
    assert!(grants(role, "pods", &["get", "list"]), "{role}");
    assert_least_privilege(&objs);
    let agent = find(&objs, "DaemonSet", "sb-sandbolt-agent-default");
    let labels = &agent["spec"]["template"]["metadata"]["labels"];
    assert_eq!(labels["app.kubernetes.io/component"], "agent");
    assert_eq!(labels["sandbolt.io/pool"], "default");
    let a = container(agent, "agent");
    for (var, field) in [
        ("SANDBOLT_POD_NAME", "metadata.name"),
        ("SANDBOLT_POD_NAMESPACE", "metadata.namespace"),
        ("SANDBOLT_POD_UID", "metadata.uid"),
        ("SANDBOLT_NODE_NAME", "spec.nodeName"),
    ] {
        assert_eq!(field_ref(a, var), field);
    }

    let values = json!({"controller": {
        "store": "embedded",
        "replicas": 1,
        "agentLostTimeout": "30s",
        "agentGoneTimeout": "15m",
    }});
    let (objs, _) = check(Some(values), &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let c = container(
        find(&objs, "Deployment", "sb-sandbolt-controller"),
        "controller",
    );
    for flag in [
        "--agent-lost-timeout=30s",
        "--agent-gone-timeout=15m",
        "--agent-presence=kubernetes",
    ] {
        assert!(args(c).contains(&flag.into()), "{flag}: {:?}", args(c));
    }
}

/// Warm pools: their CRD ships with the chart, the controller's Role lets
/// its store keep them (create, replace, delete, watch) and the leader write
/// their status, and a kubectl-made SandboxWarmPool is checked against the
/// CRD like any other object.
#[test]
fn warm_pools_ship_with_the_chart_and_the_controller_may_keep_them() {
    let pool = "apiVersion: sandbolt.io/v1alpha1\nkind: SandboxWarmPool\nmetadata: {name: py}\nspec:\n  agentPool: default\n  template: {image: 'python:3.12', runtime: runc, limits: {cpu: 1, memory: 256Mi, pids: 64}, env: {A: '1'}}\n  capacity: {bufferMin: 1, bufferMax: 3, poolMin: 0, poolMax: 10}\n";
    let (objs, _) = check(None, &[pool]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let crds = std::fs::read_dir(repo().join("deploy/helm/sandbolt/crds"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect::<Vec<_>>();
    assert!(
        crds.contains(&"sandboxwarmpools.sandbolt.io.yaml".to_string()),
        "{crds:?}"
    );
    let role = find(&objs, "Role", "sb-sandbolt-controller");
    assert!(
        grants(
            role,
            "sandboxwarmpools",
            &[
                "get", "list", "watch", "create", "update", "patch", "delete"
            ]
        ),
        "{role}"
    );
    assert!(
        grants(role, "sandboxwarmpools/status", &["get", "update", "patch"]),
        "{role}"
    );
    assert_least_privilege(&objs);

    let bad = "apiVersion: sandbolt.io/v1alpha1\nkind: SandboxWarmPool\nmetadata: {name: w}\nspec:\n  template: {runtime: kata, extra: 1}\n  capacity: {bufferMin: -1, bufferMax: 1, poolMin: 0, poolMax: 1}\n";
    let err = check(None, &[bad]).expect_err("a bad SandboxWarmPool passed");
    for part in [
        "spec.template: 'image' is a required property",
        "spec.template.runtime",
        "'extra' was unexpected",
        "spec.capacity.bufferMin",
    ] {
        assert!(
            err.contains("SandboxWarmPool/w does not match its CRD") && err.contains(part),
            "{part}: {err}"
        );
    }
}

/// Snapshots: their CRD ships with the chart, the controller's Role lets its
/// store keep them (create, replace, delete, watch), and a SandboxSnapshot is
/// checked against the CRD like any other object.
#[test]
fn snapshots_ship_with_the_chart_and_the_controller_may_keep_them() {
    let snap = "apiVersion: sandbolt.io/v1alpha1\nkind: SandboxSnapshot\nmetadata: {name: 7f1c2a9e-0b4d-4c6e-9a57-3d2e1f0a8b6c}\nspec:\n  sandboxNamespace: team-a\n  sourceSandbox: fsb-1\n  phase: Ready\n  sizeBytes: 1048576\n  volumes: [{volume: work, mountPath: /work, volumeSnapshot: sbs-7f1c}]\n  metadata: {team: ml}\n  createdAtUnixMs: 1700000000123\n";
    let (objs, _) = check(None, &[snap]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let crds = std::fs::read_dir(repo().join("deploy/helm/sandbolt/crds"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect::<Vec<_>>();
    assert!(
        crds.contains(&"sandboxsnapshots.sandbolt.io.yaml".to_string()),
        "{crds:?}"
    );
    let role = find(&objs, "Role", "sb-sandbolt-controller");
    assert!(
        grants(
            role,
            "sandboxsnapshots",
            &[
                "get", "list", "watch", "create", "update", "patch", "delete"
            ]
        ),
        "{role}"
    );
    assert_least_privilege(&objs);

    let bad = "apiVersion: sandbolt.io/v1alpha1\nkind: SandboxSnapshot\nmetadata: {name: s}\nspec:\n  sandboxNamespace: team-a\n  phase: Done\n  sizeBytes: -1\n  extra: 1\n";
    let err = check(None, &[bad]).expect_err("a bad SandboxSnapshot passed");
    for part in [
        "spec: 'sourceSandbox' is a required property",
        "spec.phase",
        "spec.sizeBytes",
        "'extra' was unexpected",
    ] {
        assert!(
            err.contains("SandboxSnapshot/s does not match its CRD") && err.contains(part),
            "{part}: {err}"
        );
    }
}

/// Values for an OpenSandbox server in namespace `opensandbox`: the open
/// FastPath port for it, mutual TLS for other clients, and the gateway.
fn opensandbox_values() -> Value {
    json!({
        "controller": {"fastpath": {
            "open": {
                "enabled": true,
                "port": 9093,
                "clientPodSelector": {"matchLabels": {"app.kubernetes.io/name": "opensandbox-server"}},
                "clientNamespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "opensandbox"}}
            },
            "tls": {"enabled": true, "secretName": "fastpath-tls"}
        }},
        "lifecycle": {"gateway": {"enabled": true, "port": 8081}}
    })
}

/// The ingress rules of the controller's NetworkPolicy that name `port`.
fn rules_for_port(policy: &Value, port: u64) -> Vec<Value> {
    policy["spec"]["ingress"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| {
            r["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["port"] == port)
        })
        .cloned()
        .collect()
}

fn port_named<'a>(service: &'a Value, name: &str) -> &'a Value {
    service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no port {name} in {service}"))
}

#[test]
fn open_fastpath_port_reaches_only_the_opensandbox_server() {
    let (objs, notes) = check(Some(opensandbox_values()), &[])
        .unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let ctl = find(&objs, "Deployment", "sb-sandbolt-controller");
    let c = container(ctl, "controller");
    assert_real_flags(c);
    assert!(
        args(c).contains(&"--open-fastpath-listen=0.0.0.0:9093".into()),
        "{:?}",
        args(c)
    );
    assert!(c["ports"].as_array().unwrap().contains(&json!(
        {"name": "fastpath-open", "containerPort": 9093, "protocol": "TCP"}
    )));
    // Still the token on the main port; the probe on the ops port (TLS).
    assert_eq!(
        env(c, "SANDBOLT_FASTPATH_TOKEN")["valueFrom"]["secretKeyRef"]["key"],
        "fastpath-token"
    );
    assert_http_probe(&c["readinessProbe"], "/readyz", "metrics");
    let svc = find(&objs, "Service", "sb-sandbolt-fastpath");
    assert_eq!(port_named(svc, "fastpath-open")["port"], 9093);
    assert_eq!(port_named(svc, "fastpath")["port"], 9090);

    // The open port admits exactly the server's pods in its namespace; the
    // main port's rule (agents, janitors, labelled clients) does not cover it.
    let policy = find(&objs, "NetworkPolicy", "sb-sandbolt-controller");
    let open = rules_for_port(policy, 9093);
    assert_eq!(open.len(), 1, "{policy}");
    assert_eq!(
        open[0]["from"],
        json!([{
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "opensandbox-server"}},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "opensandbox"}}
        }])
    );
    let main = rules_for_port(policy, 9090);
    assert_eq!(main.len(), 1);
    assert!(main[0]["ports"].as_array().unwrap().len() == 1, "{main:?}");
    assert!(
        notes.contains(r#"fastpath_endpoint = "sb-sandbolt-fastpath.sandbolt.svc:9093""#),
        "{notes}"
    );

    // Without a namespace selector: the release's namespace only.
    let mut same_ns = opensandbox_values();
    same_ns["controller"]["fastpath"]["open"]["clientNamespaceSelector"] = json!({});
    let (objs, _) = check(Some(same_ns), &[]).unwrap_or_else(|e| panic!("{e}"));
    let policy = find(&objs, "NetworkPolicy", "sb-sandbolt-controller");
    assert_eq!(
        rules_for_port(policy, 9093)[0]["from"],
        json!([{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "opensandbox-server"}}}])
    );
}

#[test]
fn fastpath_mutual_tls_mounts_the_secret_and_passes_its_files() {
    let (objs, notes) = check(Some(opensandbox_values()), &[]).unwrap_or_else(|e| panic!("{e}"));
    let ctl = find(&objs, "Deployment", "sb-sandbolt-controller");
    let c = container(ctl, "controller");
    // TLS is on by default: one TLS setup on the main port, the chart's
    // certificate and the FastPath client CA beside it.
    for flag in [
        "--tls-cert=/etc/sandbolt/tls/tls.crt",
        "--tls-key=/etc/sandbolt/tls/tls.key",
        "--tls-client-ca=/etc/sandbolt/fastpath-tls/ca.crt",
    ] {
        assert!(args(c).contains(&flag.into()), "{flag} in {:?}", args(c));
    }
    assert!(!args(c).iter().any(|a| a.starts_with("--fastpath-tls")));
    assert!(mounts(c).contains(&"/etc/sandbolt/fastpath-tls".into()));
    // With TLS off, mutual TLS beside plaintext, the Secret's own pair.
    let mut plain = opensandbox_values();
    plain["tls"] = json!({"enabled": false});
    let (objs_off, _) = check(Some(plain), &[]).unwrap_or_else(|e| panic!("{e}"));
    let c_off = container(
        find(&objs_off, "Deployment", "sb-sandbolt-controller"),
        "controller",
    );
    for flag in [
        "--fastpath-tls-cert=/etc/sandbolt/fastpath-tls/tls.crt",
        "--fastpath-tls-key=/etc/sandbolt/fastpath-tls/tls.key",
        "--fastpath-client-ca=/etc/sandbolt/fastpath-tls/ca.crt",
    ] {
        assert!(
            args(c_off).contains(&flag.into()),
            "{flag} in {:?}",
            args(c_off)
        );
    }
    assert!(!args(c_off).iter().any(|a| a.starts_with("--tls-")));
    let volume = ctl["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "fastpath-tls")
        .expect("fastpath-tls volume");
    assert_eq!(volume["secret"]["secretName"], "fastpath-tls");
    assert!(
        notes.contains("client certificate signed by the CA in Secret fastpath-tls"),
        "{notes}"
    );
}

#[test]
fn gateway_runs_in_the_lifecycle_container_with_the_shared_keys() {
    let (objs, notes) = check(Some(opensandbox_values()), &[]).unwrap_or_else(|e| panic!("{e}"));
    let ctl = find(&objs, "Deployment", "sb-sandbolt-controller");
    let l = container(ctl, "lifecycle");
    assert_real_flags(l);
    assert!(
        args(l).contains(&"--gateway-listen=0.0.0.0:8081".into()),
        "{:?}",
        args(l)
    );
    let keys = &env(l, "OPENSANDBOX_SECURE_ACCESS_KEYS")["valueFrom"]["secretKeyRef"];
    assert_eq!(keys["name"], "sb-sandbolt-gateway-keys");
    assert_eq!(keys["key"], "OPENSANDBOX_SECURE_ACCESS_KEYS");
    assert_eq!(
        port_named(find(&objs, "Service", "sb-sandbolt-lifecycle"), "gateway")["port"],
        8081
    );
    let policy = find(&objs, "NetworkPolicy", "sb-sandbolt-controller");
    assert_eq!(rules_for_port(policy, 8081).len(), 1, "{policy}");

    // The generated key ring is in the server's format: "<kid>=<base64>"
    // with a one-character key id, and that id active.
    let secret: k8s_openapi::api::core::v1::Secret =
        serde_json::from_value(find(&objs, "Secret", "sb-sandbolt-gateway-keys").clone()).unwrap();
    let data = secret.data.expect("data");
    let ring = String::from_utf8(data["OPENSANDBOX_SECURE_ACCESS_KEYS"].0.clone()).unwrap();
    let (kid, key) = ring.split_once('=').expect("kid=base64");
    assert_eq!(kid, "k");
    assert!(
        key.len() >= 44
            && key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+/=".contains(c)),
        "{ring}"
    );
    assert_eq!(data["OPENSANDBOX_SECURE_ACCESS_ACTIVE_KEY"].0, b"k");
    assert!(notes.contains("Secret sb-sandbolt-gateway-keys"), "{notes}");

    // An operator's Secret instead: nothing generated, the env points at it.
    let mut own = opensandbox_values();
    own["lifecycle"]["gateway"]["keysSecret"] = json!("opensandbox-keys");
    let (objs, _) = check(Some(own), &[]).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !names(&objs).iter().any(|n| n.contains("gateway-keys")),
        "{:?}",
        names(&objs)
    );
    let l = container(
        find(&objs, "Deployment", "sb-sandbolt-controller"),
        "lifecycle",
    );
    assert_eq!(
        env(l, "OPENSANDBOX_SECURE_ACCESS_KEYS")["valueFrom"]["secretKeyRef"]["name"],
        "opensandbox-keys"
    );
}

#[test]
fn by_default_there_is_no_open_port_no_tls_and_no_gateway() {
    let (objs, _) = check(None, &[]).unwrap_or_else(|e| panic!("{e}"));
    let ctl = find(&objs, "Deployment", "sb-sandbolt-controller");
    let c = container(ctl, "controller");
    assert!(
        !args(c)
            .iter()
            .any(|a| a.starts_with("--open-fastpath") || a.starts_with("--fastpath-tls")),
        "{:?}",
        args(c)
    );
    assert!(
        !args(container(ctl, "lifecycle"))
            .iter()
            .any(|a| a.starts_with("--gateway"))
    );
    assert_eq!(
        find(&objs, "Service", "sb-sandbolt-fastpath")["spec"]["ports"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    assert!(!names(&objs).iter().any(|n| n.contains("gateway-keys")));
}

#[test]
fn unsafe_fastpath_and_gateway_values_are_refused() {
    let mut no_selector = opensandbox_values();
    no_selector["controller"]["fastpath"]["open"]["clientPodSelector"] = json!({});
    let mut no_policy = opensandbox_values();
    no_policy["networkPolicy"] = json!({"enabled": false});
    let mut same_port = opensandbox_values();
    same_port["controller"]["fastpath"]["open"]["port"] = json!(9090);
    let mut tls_no_secret = opensandbox_values();
    tls_no_secret["controller"]["fastpath"]["tls"]["secretName"] = json!("");
    let mut tls_no_token = opensandbox_values();
    tls_no_token["controller"]["fastpath"]["requireToken"] = json!(false);
    let mut gateway_alone = opensandbox_values();
    gateway_alone["lifecycle"]["enabled"] = json!(false);
    for (values, why) in [
        (
            no_selector,
            "needs controller.fastpath.open.clientPodSelector",
        ),
        (no_policy, "needs networkPolicy.enabled"),
        (same_port, "open.port must differ"),
        (tls_no_secret, "needs controller.fastpath.tls.secretName"),
        (tls_no_token, "needs controller.fastpath.requireToken"),
        (
            gateway_alone,
            "lifecycle.gateway.enabled needs lifecycle.enabled",
        ),
    ] {
        let err = check(Some(values.clone()), &[]).expect_err(&format!("{values} was accepted"));
        assert!(err.contains(why), "{values}: expected {why:?} in:\n{err}");
    }
}

/// The container port named `name` of `c`.
fn container_port(c: &Value, name: &str) -> i64 {
    c["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no port {name} in {}", c["name"]))["containerPort"]
        .as_i64()
        .unwrap()
}

fn pod_annotations(workload: &Value) -> &Value {
    &workload["spec"]["template"]["metadata"]["annotations"]
}

/// `c` serves its ops endpoint on all interfaces at its port named
/// `port_name`, and that port is `port`.
fn assert_ops_listener(c: &Value, port_name: &str, port: i64) {
    assert_real_flags(c);
    assert_eq!(container_port(c, port_name), port, "{}", c["name"]);
    let flag = format!("--metrics-listen=0.0.0.0:{port}");
    assert!(args(c).contains(&flag), "{flag} in {:?}", args(c));
}

fn assert_http_probe(probe: &Value, path: &str, port: &str) {
    assert_eq!(probe["httpGet"]["path"], path, "{probe}");
    assert_eq!(probe["httpGet"]["port"], port, "{probe}");
}

/// The scrape config a Prometheus finds by default: every component serves
/// /metrics on a named port, its pods carry the prometheus.io annotations
/// naming that port, the lifecycle's and the janitor's probes ask
/// /healthz and /readyz, and the NetworkPolicy admits the controller pod's
/// ops ports. No ServiceMonitor or dashboard unless asked for.
#[test]
fn every_component_serves_metrics_and_pods_say_where() {
    let (objs, _) = check(None, &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let ctl = find(&objs, "Deployment", "sb-sandbolt-controller");
    let agent = find(&objs, "DaemonSet", "sb-sandbolt-agent-default");
    let jan = find(&objs, "DaemonSet", "sb-sandbolt-janitor-default");
    let c = container(ctl, "controller");
    let l = container(ctl, "lifecycle");
    let a = container(agent, "agent");
    let j = container(jan, "janitor");
    assert_ops_listener(c, "metrics", 9094);
    assert_ops_listener(l, "rest-metrics", 9097);
    assert_ops_listener(a, "metrics", 9095);
    assert_ops_listener(j, "metrics", 9096);
    for (workload, c) in [(ctl, c), (agent, a), (jan, j)] {
        let ann = pod_annotations(workload);
        assert_eq!(ann["prometheus.io/scrape"], "true", "{ann}");
        assert_eq!(ann["prometheus.io/path"], "/metrics", "{ann}");
        assert_eq!(
            ann["prometheus.io/port"],
            container_port(c, "metrics").to_string(),
            "{ann}"
        );
    }
    // The lifecycle answers them on its API port without a key.
    assert_http_probe(&l["livenessProbe"], "/healthz", "lifecycle");
    assert_http_probe(&l["readinessProbe"], "/readyz", "lifecycle");
    assert_http_probe(&j["livenessProbe"], "/healthz", "metrics");
    assert_http_probe(&j["readinessProbe"], "/readyz", "metrics");
    // The controller: /readyz of its ops port (only the leader is ready).
    assert_http_probe(&c["readinessProbe"], "/readyz", "metrics");

    let policy = find(&objs, "NetworkPolicy", "sb-sandbolt-controller");
    let ops = rules_for_port(policy, 9094);
    assert_eq!(ops.len(), 1, "{policy}");
    assert_eq!(
        ops[0]["ports"],
        json!([{"port": 9094, "protocol": "TCP"}, {"port": 9097, "protocol": "TCP"}])
    );
    assert!(ops[0].get("from").is_none(), "any pod may scrape: {policy}");
    assert!(
        !objs
            .iter()
            .any(|o| o["kind"] == "ServiceMonitor" || o["kind"] == "ConfigMap"),
        "{:?}",
        names(&objs)
    );
}

/// With `metrics.serviceMonitor.enabled`, a prometheus-operator
/// ServiceMonitor (validated against the operator's ServiceMonitor schema)
/// reaches every ops port: its selector picks the headless metrics
/// Services, each Service port it names targets a named container port of
/// the pods the Service selects. With `metrics.dashboard.enabled`, the
/// dashboard ships as a ConfigMap Grafana's sidecar loads.
#[test]
fn service_monitor_reaches_every_ops_port_and_the_dashboard_ships() {
    let values = json!({"metrics": {
        "serviceMonitor": {"enabled": true, "interval": "15s", "labels": {"release": "kps"}},
        "dashboard": {"enabled": true},
        "scrapeFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
    }});
    let (objs, _) = check(Some(values), &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let monitor = find(&objs, "ServiceMonitor", "sb-sandbolt");
    assert_eq!(monitor["metadata"]["labels"]["release"], "kps");
    let selector = monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .unwrap();
    let services: Vec<&Value> = objs
        .iter()
        .filter(|o| {
            o["kind"] == "Service"
                && selector
                    .iter()
                    .all(|(k, v)| &o["metadata"]["labels"][k] == v)
        })
        .collect();
    let endpoints = monitor["spec"]["endpoints"].as_array().unwrap();
    for e in endpoints {
        assert_eq!(e["path"], "/metrics", "{e}");
        assert_eq!(e["interval"], "15s", "{e}");
    }
    // Every ops container port, found through the monitor.
    let mut reached = Vec::new();
    for svc in &services {
        assert_eq!(svc["spec"]["clusterIP"], "None", "{svc}");
        for port in svc["spec"]["ports"].as_array().unwrap() {
            assert!(
                endpoints.iter().any(|e| e["port"] == port["name"]),
                "no endpoint scrapes {port}"
            );
            for o in objs.iter().filter(|o| selects(svc, o)) {
                for c in o["spec"]["template"]["spec"]["containers"]
                    .as_array()
                    .unwrap()
                {
                    if let Some(p) = c["ports"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .find(|p| p["name"] == port["targetPort"])
                    {
                        assert_eq!(p["containerPort"], port["port"], "{svc}");
                        reached.push(c["name"].as_str().unwrap().to_string());
                    }
                }
            }
        }
    }
    reached.sort();
    assert_eq!(reached, ["agent", "controller", "janitor", "lifecycle"]);

    let policy = find(&objs, "NetworkPolicy", "sb-sandbolt-controller");
    assert_eq!(
        rules_for_port(policy, 9097)[0]["from"],
        json!([{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}])
    );

    let dashboard = find(&objs, "ConfigMap", "sb-sandbolt-dashboard");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let shipped: Value =
        serde_json::from_str(dashboard["data"]["sandbolt.json"].as_str().unwrap()).unwrap();
    assert_eq!(shipped, sandbolt_deploy::dashboard::load().unwrap());

    // The monitor's schema check is live: a misspelt endpoint field fails.
    let bad = "apiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\nmetadata: {name: m}\nspec:\n  selector: {}\n  endpoints: [{prot: metrics, interval: often}]\n";
    let err = check(None, &[bad]).expect_err("a bad ServiceMonitor passed");
    assert!(
        err.contains("ServiceMonitor/m does not match its CRD")
            && err.contains("'prot' was unexpected"),
        "{err}"
    );
}

/// Whether Service `svc` selects the pods of workload `o`.
fn selects(svc: &Value, o: &Value) -> bool {
    let labels = &o["spec"]["template"]["metadata"]["labels"];
    labels.is_object()
        && svc["spec"]["selector"]
            .as_object()
            .unwrap()
            .iter()
            .all(|(k, v)| &labels[k] == v)
}

/// Without the lifecycle the controller pod has one ops port, and
/// `metrics.annotations: false` leaves the pods unannotated.
#[test]
fn ops_ports_follow_the_components_that_run() {
    let values = json!({
        "lifecycle": {"enabled": false},
        "metrics": {"annotations": false, "serviceMonitor": {"enabled": true}}
    });
    let (objs, _) = check(Some(values), &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let ctl = find(&objs, "Deployment", "sb-sandbolt-controller");
    assert!(
        pod_annotations(ctl).get("prometheus.io/scrape").is_none(),
        "{}",
        pod_annotations(ctl)
    );
    let agent = find(&objs, "DaemonSet", "sb-sandbolt-agent-default");
    assert!(
        pod_annotations(agent).is_null(),
        "{}",
        pod_annotations(agent)
    );
    let svc = find(&objs, "Service", "sb-sandbolt-controller-metrics");
    assert_eq!(
        svc["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["name"].as_str().unwrap())
            .collect::<Vec<_>>(),
        ["metrics"]
    );
    let policy = find(&objs, "NetworkPolicy", "sb-sandbolt-controller");
    assert_eq!(
        rules_for_port(policy, 9094)[0]["ports"],
        json!([{"port": 9094, "protocol": "TCP"}])
    );
}

/// The dashboard Grafana loads: a uid, a title, a Prometheus data source
/// variable, panels on the grid, each with queries that read sandbolt's
/// metrics; and panels for what operators watch (create stages, RPCs,
/// agents, capacity, sandboxes by phase, warm pools, janitor reaps, store
/// writes, the leader).
#[test]
fn the_grafana_dashboard_is_a_valid_dashboard() {
    let d = sandbolt_deploy::dashboard::load().unwrap();
    let problems = sandbolt_deploy::dashboard::problems(&d);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let read = sandbolt_deploy::dashboard::metric_names(&d);
    for name in [
        "sandbolt_controller_create_stage_duration_seconds_bucket",
        "sandbolt_agent_create_stage_duration_seconds_bucket",
        "sandbolt_grpc_server_requests_total",
        "sandbolt_grpc_server_request_duration_seconds_bucket",
        "sandbolt_http_requests_total",
        "sandbolt_controller_agents",
        "sandbolt_controller_capacity",
        "sandbolt_controller_allocated",
        "sandbolt_controller_sandboxes",
        "sandbolt_controller_warm_pool_sandboxes",
        "sandbolt_janitor_reaped_total",
        "sandbolt_controller_store_write_duration_seconds_bucket",
        "sandbolt_controller_leader",
    ] {
        assert!(read.contains(name), "no panel reads {name}: {read:?}");
    }
}

/// The listener limits reach the controller, the lifecycle and every agent
/// as the environment their listener flags read (each name is one the
/// binaries declare), with the binaries' defaults unless set, and numbers
/// rendered as plain integers.
#[test]
fn listener_limits_reach_every_server_as_their_flags_environment() {
    let source = std::fs::read_to_string(repo().join("telemetry/src/listener.rs")).unwrap();
    let names = [
        "SANDBOLT_MAX_CONNECTIONS",
        "SANDBOLT_HEADER_READ_TIMEOUT",
        "SANDBOLT_IDLE_TIMEOUT",
        "SANDBOLT_HTTP2_KEEPALIVE_INTERVAL",
        "SANDBOLT_MAX_BODY_BYTES",
    ];
    for name in names {
        assert!(
            source.contains(&format!("env = \"{name}\"")),
            "{name} is not a listener flag's environment"
        );
    }
    let servers = |objs: &[Value]| -> Vec<Value> {
        let ctl = find(objs, "Deployment", "sb-sandbolt-controller");
        let agent = find(objs, "DaemonSet", "sb-sandbolt-agent-default");
        vec![
            container(ctl, "controller").clone(),
            container(ctl, "lifecycle").clone(),
            container(agent, "agent").clone(),
        ]
    };
    let (objs, _) = check(None, &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let defaults = ["10000", "10s", "120s", "30s", "2097152"];
    for c in servers(&objs) {
        for (name, want) in names.iter().zip(defaults) {
            assert_eq!(env(&c, name)["value"], want, "{name} of {}", c["name"]);
        }
    }
    let values = json!({"listenerLimits": {
        "maxConnections": 50000,
        "headerReadTimeout": "5s",
        "idleTimeout": "1m",
        "http2KeepaliveInterval": "15s",
        "maxBodyBytes": 16777216,
    }});
    let (objs, _) = check(Some(values), &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let set = ["50000", "5s", "1m", "15s", "16777216"];
    for c in servers(&objs) {
        for (name, want) in names.iter().zip(set) {
            assert_eq!(env(&c, name)["value"], want, "{name} of {}", c["name"]);
        }
    }
}

/// A pool whose runtime is runsc (issue 24): its agents get the node's
/// runsc, mounted read-only at its host path and named by
/// `--runtime-binary`, which the runc shim (a host process) can run; a runc
/// pool of the same release gets neither. Without sandbox networking such a
/// pool is refused, naming the value to change.
#[test]
fn runsc_pool_gets_the_nodes_runsc_and_needs_egress() {
    let values = |network: &str| {
        json!({
            "agent": {"hostNetwork": true, "network": network, "runscHostPath": "/opt/gvisor/runsc"},
            "pools": [
                {"name": "plain", "runtime": "runc"},
                {"name": "secure", "runtime": "runsc", "runsc": {"overlay": "memory"}}
            ]
        })
    };
    let (objs, _) =
        check(Some(values("egress")), &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let secure = find(&objs, "DaemonSet", "sb-sandbolt-agent-secure");
    let a = container(secure, "agent");
    for flag in [
        "--runtime=runsc",
        "--runtime-binary=runsc=/opt/gvisor/runsc",
        "--runsc-platform=ptrace",
        "--runsc-overlay=memory",
    ] {
        assert!(args(a).contains(&flag.into()), "{flag}: {:?}", args(a));
    }
    let mount = a["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/opt/gvisor/runsc")
        .expect("runsc mounted into the agent");
    assert_eq!(mount["readOnly"], true);
    let volume = secure["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("runsc volume");
    assert_eq!(volume["hostPath"]["path"], "/opt/gvisor/runsc");
    assert_eq!(volume["hostPath"]["type"], "File");
    assert_eq!(
        find(&objs, "SandboxPool", "secure")["spec"]["runtime"],
        "runsc"
    );

    let plain = container(find(&objs, "DaemonSet", "sb-sandbolt-agent-plain"), "agent");
    assert!(args(plain).contains(&"--runtime=runc".into()));
    assert!(
        !args(plain).iter().any(|f| f.contains("runsc")),
        "{:?}",
        args(plain)
    );
    assert!(
        !plain["volumeMounts"]
            .to_string()
            .contains("/opt/gvisor/runsc"),
        "a runc pool mounts no runsc"
    );

    let err = check(Some(values("none")), &[]).expect_err("runsc without networking");
    assert!(
        err.contains("pool \"secure\": runtime runsc needs agent.network=egress"),
        "{err}"
    );
    // User namespaces are on by default; a runsc pool's agents run without
    // them (gVisor is the boundary there), every other pool's with them.
    assert!(
        args(a).contains(&"--user-namespace=off".into()),
        "{:?}",
        args(a)
    );
    assert!(
        args(plain).contains(&"--user-namespace=node".into()),
        "{:?}",
        args(plain)
    );
    let mut userns_off = values("egress");
    userns_off["agent"]["userNamespace"] = json!("off");
    let (objs, _) = check(Some(userns_off), &[]).unwrap_or_else(|e| panic!("{e}"));
    let plain = container(find(&objs, "DaemonSet", "sb-sandbolt-agent-plain"), "agent");
    assert!(
        args(plain).contains(&"--user-namespace=off".into()),
        "{:?}",
        args(plain)
    );
    let mut platform = values("egress");
    platform["pools"][1]["runsc"] = json!({"platform": "systrap"});
    let err = check(Some(platform), &[]).expect_err("an unknown runsc platform");
    assert!(
        err.contains("pools[].runsc.platform must be ptrace or kvm"),
        "{err}"
    );
}

fn volume<'a>(workload: &'a Value, name: &str) -> &'a Value {
    workload["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("volume {name} in {}", workload["metadata"]["name"]))
}

/// PEM → DER of the first block.
fn der(pem: &[u8]) -> Vec<u8> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem).unwrap().to_vec()
}

/// TLS on by default (issue 21): the chart makes a CA and a certificate
/// into a Secret, the controller's main port serves it (TLS only), agents,
/// janitors and the lifecycle get the CA alone and https:// URLs, agents
/// serve their API with their own pinned certificate, and the probes move
/// off the TLS ports. The generated certificate is checked the way the
/// agents' client (rustls/webpki) checks it, for the names they dial.
/// Before, the chart passed no TLS flag at all and made no certificate.
#[test]
fn tls_is_on_by_default_with_a_generated_ca_only_the_ca_reaching_the_nodes() {
    use base64::Engine;
    let (objs, _) = check(None, &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let secret = find(&objs, "Secret", "sb-sandbolt-tls");
    assert_eq!(secret["type"], "kubernetes.io/tls");
    let field = |k: &str| {
        base64::engine::general_purpose::STANDARD
            .decode(secret["data"][k].as_str().unwrap())
            .unwrap()
    };
    let (ca, cert) = (der(&field("ca.crt")), der(&field("tls.crt")));
    assert!(
        String::from_utf8(field("tls.key"))
            .unwrap()
            .contains("PRIVATE KEY")
    );
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.into()).unwrap();
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
        std::sync::Arc::new(roots),
        std::sync::Arc::new(rustls::crypto::ring::default_provider()),
    )
    .build()
    .unwrap();
    for name in ["sb-sandbolt-fastpath.sandbolt.svc", "localhost"] {
        use rustls::client::danger::ServerCertVerifier;
        verifier
            .verify_server_cert(
                &cert.clone().into(),
                &[],
                &rustls::pki_types::ServerName::try_from(name).unwrap(),
                &[],
                rustls::pki_types::UnixTime::now(),
            )
            .unwrap_or_else(|e| panic!("the chart's certificate for {name}: {e}"));
    }

    let ctl = find(&objs, "Deployment", "sb-sandbolt-controller");
    let c = container(ctl, "controller");
    assert!(args(c).contains(&"--tls-cert=/etc/sandbolt/tls/tls.crt".into()));
    assert!(args(c).contains(&"--tls-key=/etc/sandbolt/tls/tls.key".into()));
    assert_eq!(
        volume(ctl, "tls")["secret"]["secretName"],
        "sb-sandbolt-tls"
    );
    let l = container(ctl, "lifecycle");
    assert!(args(l).contains(&"--controller=https://localhost:9090".into()));
    assert!(args(l).contains(&"--controller-ca=/etc/sandbolt/tls-ca/ca.crt".into()));
    assert!(mounts(l).contains(&"/etc/sandbolt/tls-ca".into()));
    assert!(!mounts(l).contains(&"/etc/sandbolt/tls".into()));

    let agent = find(&objs, "DaemonSet", "sb-sandbolt-agent-default");
    let jan = find(&objs, "DaemonSet", "sb-sandbolt-janitor-default");
    let a = container(agent, "agent");
    let j = container(jan, "janitor");
    for (workload, c) in [(agent, a), (jan, j)] {
        assert_real_flags(c);
        assert!(
            args(c).contains(&"--controller=https://sb-sandbolt-fastpath.sandbolt.svc:9090".into()),
            "{:?}",
            args(c)
        );
        assert!(args(c).contains(&"--controller-ca=/etc/sandbolt/tls-ca/ca.crt".into()));
        // The CA alone: a node never holds the controller's key.
        assert_eq!(
            volume(workload, "tls-ca")["secret"]["items"],
            json!([{"key": "ca.crt", "path": "ca.crt"}])
        );
    }
    assert!(args(a).contains(&"--api-tls=self-signed".into()));
    assert_http_probe(&a["readinessProbe"], "/healthz", "metrics");

    // Turned off: plaintext URLs, no Secret, the gRPC probes back.
    let (objs, _) = check(Some(json!({"tls": {"enabled": false}})), &[])
        .unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    assert!(!names(&objs).contains(&"Secret/sb-sandbolt-tls".to_string()));
    let agent = find(&objs, "DaemonSet", "sb-sandbolt-agent-default");
    let a = container(agent, "agent");
    assert!(args(a).contains(&"--controller=http://sb-sandbolt-fastpath.sandbolt.svc:9090".into()));
    assert!(
        !args(a)
            .iter()
            .any(|x| x.starts_with("--api-tls") || x.starts_with("--controller-ca"))
    );
    assert_eq!(a["readinessProbe"]["grpc"]["port"], 9091);
    let c = container(
        find(&objs, "Deployment", "sb-sandbolt-controller"),
        "controller",
    );
    assert!(!args(c).iter().any(|x| x.starts_with("--tls-")));
    assert_eq!(c["readinessProbe"]["grpc"]["port"], 9090);

    // A Secret of the operator's: used, none made.
    let (objs, _) = check(Some(json!({"tls": {"secretName": "my-tls"}})), &[])
        .unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    assert!(!names(&objs).contains(&"Secret/sb-sandbolt-tls".to_string()));
    let ctl = find(&objs, "Deployment", "sb-sandbolt-controller");
    assert_eq!(volume(ctl, "tls")["secret"]["secretName"], "my-tls");
}
