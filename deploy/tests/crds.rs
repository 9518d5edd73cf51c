//! The CRDs generated from the types: their shape, and the checked-in copies.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::CustomResourceExt;
use sandbolt_deploy::crd;
use sandbolt_deploy::pool::{CapacityBounds, LimitValues, OciRuntime};
use sandbolt_deploy::sandbox::{
    self, DataPlaneState, DataPlaneStatus, RuntimeState, RuntimeStatus,
};
use sandbolt_deploy::snapshot::{SnapshotPhase, SnapshotVolume};
use sandbolt_deploy::template::{self, TemplatePhase};
use sandbolt_deploy::warm_pool::{WarmPoolCapacity, WarmPoolTemplate};
use sandbolt_deploy::{
    Sandbox, SandboxPool, SandboxPoolSpec, SandboxSnapshot, SandboxSnapshotSpec, SandboxSpec,
    SandboxStatus, SandboxTemplate, SandboxTemplateSpec, SandboxTemplateStatus, SandboxWarmPool,
    SandboxWarmPoolSpec,
};

#[test]
fn checked_in_crds_match_the_types() {
    let drift = crd::check_files(&crd::deploy_dir()).expect("reading the checked-in CRDs");
    assert!(
        drift.is_empty(),
        "checked-in CRDs drifted from the Rust types:\n  {}\nregenerate with: {}",
        drift.join("\n  "),
        crd::REGENERATE
    );
}

#[test]
fn drift_and_stray_files_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    crd::write_files(dir.path()).unwrap();
    assert!(crd::check_files(dir.path()).unwrap().is_empty());

    let edited = dir.path().join("crds/sandboxes.sandbox.fast.io.yaml");
    let text = std::fs::read_to_string(&edited).unwrap();
    std::fs::write(&edited, text.replace("poolRef", "pool")).unwrap();
    std::fs::remove_file(
        dir.path()
            .join("helm/sandbolt/crds/sandboxpools.sandbolt.io.yaml"),
    )
    .unwrap();
    std::fs::write(dir.path().join("crds/old.yaml"), "kind: Old\n").unwrap();
    let drift = crd::check_files(dir.path()).unwrap();
    assert_eq!(drift.len(), 3, "{drift:#?}");
    assert!(
        drift[0].contains("sandboxes.sandbox.fast.io.yaml differs"),
        "{drift:#?}"
    );
    assert!(drift[1].contains("old.yaml is not generated"), "{drift:#?}");
    assert!(
        drift[2].contains("sandboxpools.sandbolt.io.yaml cannot be read"),
        "{drift:#?}"
    );

    // Regenerating repairs everything, and removes the stray file.
    crd::write_files(dir.path()).unwrap();
    assert!(crd::check_files(dir.path()).unwrap().is_empty());
    assert!(!dir.path().join("crds/old.yaml").exists());
}

fn yaml(v: &impl serde::Serialize) -> serde_json::Value {
    serde_json::to_value(v).unwrap()
}

/// Names of a CRD version's printer columns, in order.
fn printer_columns(version: &serde_json::Value) -> Vec<String> {
    version["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_string())
        .collect()
}

/// Whether the generated CRD files include `file`.
fn is_generated(file: &str) -> bool {
    crd::rendered()
        .unwrap()
        .iter()
        .any(|(name, _)| name == file)
}

#[test]
fn sandbox_crd_has_the_shape_the_opensandbox_server_reads() {
    let crd = yaml(&Sandbox::crd());
    assert_eq!(crd["metadata"]["name"], "sandboxes.sandbox.fast.io");
    assert_eq!(crd["spec"]["group"], "sandbox.fast.io");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(crd["spec"]["names"]["kind"], "Sandbox");
    assert_eq!(crd["spec"]["names"]["plural"], "sandboxes");
    let v = &crd["spec"]["versions"][0];
    assert_eq!(v["name"], "v1alpha2");
    assert_eq!(v["served"], true);
    assert_eq!(v["storage"], true);
    assert_eq!(v["subresources"]["status"], serde_json::json!({}));
    let schema = &v["schema"]["openAPIV3Schema"]["properties"];
    let spec = &schema["spec"];
    for field in ["image", "command", "args", "poolRef", "expireTime"] {
        assert!(
            spec["properties"][field].is_object(),
            "spec.{field} missing: {spec}"
        );
    }
    assert_eq!(spec["required"], serde_json::json!(["image", "poolRef"]));
    assert_eq!(spec["properties"]["expireTime"]["format"], "date-time");
    let status = &schema["status"]["properties"];
    for field in ["runtime", "dataPlane", "conditions", "observedGeneration"] {
        assert!(
            status[field].is_object(),
            "status.{field} missing: {status}"
        );
    }
    let states = &status["runtime"]["properties"]["state"]["enum"];
    assert!(
        states.as_array().unwrap().contains(&"Ready".into()),
        "{states}"
    );
    assert_eq!(status["conditions"]["x-kubernetes-list-type"], "map");
    let cond = &status["conditions"]["items"]["properties"];
    for field in ["type", "status", "observedGeneration", "reason", "message"] {
        assert!(cond[field].is_object(), "condition.{field} missing: {cond}");
    }
    let columns = printer_columns(v);
    assert_eq!(
        columns,
        [
            "Image",
            "Pool",
            "Runtime",
            "DataPlane",
            "Ready",
            "Node",
            "Expires",
            "Age"
        ]
    );
}

#[test]
fn sandbox_pool_crd_has_spec_and_status_counts() {
    let crd = yaml(&SandboxPool::crd());
    assert_eq!(crd["metadata"]["name"], "sandboxpools.sandbolt.io");
    let v = &crd["spec"]["versions"][0];
    assert_eq!(v["name"], "v1alpha1");
    assert_eq!(v["subresources"]["status"], serde_json::json!({}));
    let props = &v["schema"]["openAPIV3Schema"]["properties"];
    let spec = &props["spec"]["properties"];
    assert_eq!(
        spec["runtime"]["enum"],
        serde_json::json!(["runc", "crun", "runsc"])
    );
    assert_eq!(spec["maxSandboxesPerAgent"]["minimum"].as_f64(), Some(1.0));
    for field in ["nodeSelector", "warmImages", "capacity"] {
        assert!(spec[field].is_object(), "spec.{field} missing: {spec}");
    }
    let status = &props["status"]["properties"];
    for field in ["agents", "readyAgents", "sandboxes", "capacity"] {
        assert_eq!(status[field]["type"], "integer", "status.{field}: {status}");
    }
}

fn ready_sandbox(generation: i64, observed: i64, cond_observed: i64) -> Sandbox {
    let mut sb = Sandbox::new(
        "fsb-1",
        SandboxSpec {
            image: "busybox".into(),
            command: vec!["sleep".into()],
            args: vec!["60".into()],
            pool_ref: "default".into(),
            ..Default::default()
        },
    );
    sb.metadata.generation = Some(generation);
    sb.status = Some(SandboxStatus {
        runtime: Some(RuntimeStatus {
            state: RuntimeState::Ready,
            message: None,
            last_transition_time: None,
        }),
        data_plane: Some(DataPlaneStatus {
            state: DataPlaneState::Ready,
            endpoint: Some("10.0.0.1:9092/fsb-1".into()),
            message: None,
            last_transition_time: None,
        }),
        conditions: vec![Condition {
            type_: "Ready".into(),
            status: "True".into(),
            observed_generation: Some(cond_observed),
            reason: "Running".into(),
            message: String::new(),
            last_transition_time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
        }],
        observed_generation: Some(observed),
        agent_id: None,
        node_name: None,
        action_bindings: Vec::new(),
    });
    sb
}

#[test]
fn readiness_follows_the_opensandbox_server_rule() {
    assert!(ready_sandbox(2, 2, 2).is_ready());
    assert!(!ready_sandbox(2, 1, 2).is_ready(), "stale status");
    assert!(!ready_sandbox(2, 2, 1).is_ready(), "stale condition");
    let mut sb = ready_sandbox(1, 1, 1);
    sb.status
        .as_mut()
        .unwrap()
        .data_plane
        .as_mut()
        .unwrap()
        .state = DataPlaneState::Publishing;
    assert!(!sb.is_ready(), "data plane not ready");
    let mut sb = ready_sandbox(1, 1, 1);
    sb.status.as_mut().unwrap().conditions[0].status = "False".into();
    assert!(!sb.is_ready(), "condition false");
}

#[test]
fn sandbox_serializes_in_the_servers_field_names() {
    let v = yaml(&ready_sandbox(1, 1, 1));
    assert_eq!(v["apiVersion"], "sandbox.fast.io/v1alpha2");
    assert_eq!(v["kind"], "Sandbox");
    assert_eq!(v["spec"]["poolRef"], "default");
    assert!(
        v["spec"].get("expireTime").is_none(),
        "absent, never null: {v}"
    );
    assert_eq!(v["status"]["runtime"]["state"], "Ready");
    assert_eq!(v["status"]["dataPlane"]["state"], "Ready");
    assert_eq!(v["status"]["conditions"][0]["type"], "Ready");
    assert_eq!(v["status"]["observedGeneration"], 1);
    assert!(sandbox::NAME_PREFIX == "fsb-" && v["metadata"]["name"] == "fsb-1");
}

#[test]
fn metadata_round_trips_through_prefixed_labels() {
    let md = BTreeMap::from([("team".to_string(), "a".to_string())]);
    let mut labels = sandbox::metadata_to_labels(&md);
    assert_eq!(labels["metadata.sandbox.fast.io/team"], "a");
    labels.insert("app.kubernetes.io/name".into(), "x".into());
    assert_eq!(sandbox::labels_to_metadata(&labels), md);
}

#[test]
fn pool_capacity_is_bounded() {
    let mut spec = SandboxPoolSpec {
        node_selector: BTreeMap::new(),
        max_sandboxes_per_agent: 10,
        runtime: OciRuntime::Crun,
        warm_images: vec![],
        capacity: None,
        limits: None,
    };
    assert_eq!(spec.capacity_for(3), 30);
    spec.capacity = Some(CapacityBounds {
        min_agents: Some(1),
        max_sandboxes: Some(25),
    });
    assert_eq!(spec.capacity_for(3), 25);
    assert_eq!(yaml(&spec)["runtime"], "crun");
    assert_eq!(OciRuntime::default().as_str(), "runc");
}

#[test]
fn warm_pool_crd_has_template_capacity_and_status_counts() {
    let crd = yaml(&SandboxWarmPool::crd());
    assert_eq!(crd["metadata"]["name"], "sandboxwarmpools.sandbolt.io");
    assert_eq!(crd["spec"]["group"], "sandbolt.io");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    let names = &crd["spec"]["names"];
    assert_eq!(names["kind"], "SandboxWarmPool");
    assert_eq!(names["shortNames"], serde_json::json!(["sbwarm"]));
    assert_eq!(names["categories"], serde_json::json!(["sandbolt"]));
    let v = &crd["spec"]["versions"][0];
    assert_eq!(v["name"], "v1alpha1");
    assert_eq!(v["subresources"]["status"], serde_json::json!({}));
    let props = &v["schema"]["openAPIV3Schema"]["properties"];
    let spec = &props["spec"];
    assert_eq!(
        spec["required"],
        serde_json::json!(["capacity", "template"])
    );
    assert_eq!(spec["properties"]["agentPool"]["type"], "string");
    let template = &spec["properties"]["template"];
    assert_eq!(template["required"], serde_json::json!(["image"]));
    let t = &template["properties"];
    assert_eq!(t["image"]["minLength"].as_f64(), Some(1.0));
    assert_eq!(
        t["runtime"]["enum"],
        serde_json::json!(["runc", "crun", "runsc", null])
    );
    for field in ["cpu", "memory", "pids"] {
        assert!(
            t["limits"]["properties"][field].is_object(),
            "template.limits.{field} missing: {t}"
        );
    }
    assert_eq!(t["env"]["additionalProperties"]["type"], "string");
    let capacity = &spec["properties"]["capacity"];
    for field in ["bufferMin", "bufferMax", "poolMin", "poolMax"] {
        assert_eq!(
            capacity["properties"][field]["minimum"].as_f64(),
            Some(0.0),
            "capacity.{field}: {capacity}"
        );
    }
    // The API server refuses inconsistent bounds itself (CEL), so a
    // kubectl-made pool is as consistent as one made through the API.
    let rules: Vec<&str> = capacity["x-kubernetes-validations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["rule"].as_str().unwrap())
        .collect();
    assert_eq!(
        rules,
        [
            "self.bufferMin <= self.bufferMax",
            "self.poolMin <= self.poolMax",
            "self.bufferMax <= self.poolMax"
        ]
    );
    let status = &props["status"]["properties"];
    for field in ["total", "allocated", "available", "starting", "agents"] {
        assert_eq!(status[field]["type"], "integer", "status.{field}: {status}");
    }
    assert_eq!(status["observedGeneration"]["format"], "int64");
    let columns = printer_columns(v);
    assert_eq!(
        columns,
        [
            "AgentPool",
            "Image",
            "Available",
            "Allocated",
            "Total",
            "PoolMax",
            "Age"
        ]
    );
    // Every CRD file is generated, the warm pool's included.
    assert!(is_generated("sandboxwarmpools.sandbolt.io.yaml"));
}

#[test]
fn warm_pool_serializes_in_camel_case_without_unset_fields() {
    let pool = SandboxWarmPool::new(
        "py",
        SandboxWarmPoolSpec {
            agent_pool: None,
            template: WarmPoolTemplate {
                image: "python:3.12".into(),
                runtime: Some(OciRuntime::Runsc),
                limits: Some(LimitValues {
                    cpu: Some(IntOrString::String("500m".into())),
                    memory: None,
                    pids: Some(64),
                }),
                env: BTreeMap::from([("K".to_string(), "V".to_string())]),
            },
            capacity: WarmPoolCapacity {
                buffer_min: 1,
                buffer_max: 3,
                pool_min: 0,
                pool_max: 10,
            },
        },
    );
    let v = yaml(&pool);
    assert_eq!(v["apiVersion"], "sandbolt.io/v1alpha1");
    assert_eq!(v["kind"], "SandboxWarmPool");
    assert!(v["spec"].get("agentPool").is_none(), "{v}");
    assert_eq!(pool.spec.agent_pool(), "default");
    assert_eq!(v["spec"]["template"]["runtime"], "runsc");
    assert_eq!(v["spec"]["template"]["limits"]["cpu"], "500m");
    assert!(v["spec"]["template"]["limits"].get("memory").is_none());
    assert_eq!(v["spec"]["capacity"]["bufferMax"], 3);
    assert_eq!(v["spec"]["capacity"]["poolMax"], 10);
    // What kubectl would send: cpu as a number, no runtime, no env.
    let kubectl: SandboxWarmPoolSpec = serde_json::from_value(serde_json::json!({
        "agentPool": "gpu",
        "template": {"image": "busybox", "limits": {"cpu": 2}},
        "capacity": {"bufferMin": 0, "bufferMax": 2, "poolMin": 0, "poolMax": 4}
    }))
    .unwrap();
    assert_eq!(kubectl.agent_pool(), "gpu");
    assert_eq!(
        kubectl.template.limits.unwrap().cpu,
        Some(IntOrString::Int(2))
    );
    assert!(kubectl.template.runtime.is_none() && kubectl.template.env.is_empty());
}

#[test]
fn snapshot_crd_holds_the_whole_record_in_spec() {
    let crd = yaml(&SandboxSnapshot::crd());
    assert_eq!(crd["metadata"]["name"], "sandboxsnapshots.sandbolt.io");
    assert_eq!(crd["spec"]["group"], "sandbolt.io");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    let names = &crd["spec"]["names"];
    assert_eq!(names["kind"], "SandboxSnapshot");
    assert_eq!(names["shortNames"], serde_json::json!(["sbsnap"]));
    assert_eq!(names["categories"], serde_json::json!(["sandbolt"]));
    let v = &crd["spec"]["versions"][0];
    assert_eq!(v["name"], "v1alpha1");
    // The record is written in one request: no status subresource.
    assert!(v.get("subresources").is_none(), "{v}");
    let props = &v["schema"]["openAPIV3Schema"]["properties"];
    assert!(props.get("status").is_none(), "{props}");
    let spec = &props["spec"];
    assert_eq!(
        spec["required"],
        serde_json::json!(["sandboxNamespace", "sourceSandbox"])
    );
    let p = &spec["properties"];
    for field in [
        "uid",
        "displayName",
        "requestId",
        "sourceUid",
        "sourceSandboxId",
        "message",
        "agentId",
        "nodeName",
        "image",
        "runtime",
    ] {
        assert_eq!(p[field]["type"], "string", "spec.{field}: {p}");
    }
    for field in [
        "sizeBytes",
        "pausedUs",
        "tookUs",
        "createdAtUnixMs",
        "completedAtUnixMs",
        "lastTransitionUnixMs",
    ] {
        assert_eq!(p[field]["format"], "int64", "spec.{field}: {p}");
    }
    assert_eq!(p["displayName"]["maxLength"].as_f64(), Some(253.0));
    let mut phases: Vec<&str> = p["phase"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    phases.sort_unstable();
    assert_eq!(phases, ["Deleting", "Failed", "Pending", "Ready"]);
    assert_eq!(p["metadata"]["additionalProperties"]["type"], "string");
    let volume = &p["volumes"]["items"];
    assert_eq!(
        volume["required"],
        serde_json::json!(["mountPath", "volume"])
    );
    for field in ["subPath", "volumeSnapshot"] {
        assert_eq!(volume["properties"][field]["type"], "string");
    }
    assert_eq!(volume["properties"]["readOnly"]["type"], "boolean");
    let columns = printer_columns(v);
    assert_eq!(
        columns,
        [
            "SandboxNamespace",
            "Source",
            "Phase",
            "Node",
            "Size",
            "Image",
            "Age"
        ]
    );
    assert!(is_generated("sandboxsnapshots.sandbolt.io.yaml"));
}

#[test]
fn snapshot_serializes_in_camel_case_without_unset_fields() {
    let snap = SandboxSnapshot::new(
        "5e0c",
        SandboxSnapshotSpec {
            sandbox_namespace: "team-a".into(),
            source_sandbox: "fsb-1".into(),
            phase: SnapshotPhase::Ready,
            size_bytes: 42,
            volumes: vec![SnapshotVolume {
                volume: "work".into(),
                mount_path: "/work".into(),
                volume_snapshot: "sbs-5e0c".into(),
                ..SnapshotVolume::default()
            }],
            ..SandboxSnapshotSpec::default()
        },
    );
    let v = yaml(&snap);
    assert_eq!(v["apiVersion"], "sandbolt.io/v1alpha1");
    assert_eq!(v["kind"], "SandboxSnapshot");
    assert_eq!(
        v["spec"],
        serde_json::json!({
            "sandboxNamespace": "team-a",
            "sourceSandbox": "fsb-1",
            "phase": "Ready",
            "sizeBytes": 42,
            "volumes": [{"volume": "work", "mountPath": "/work", "volumeSnapshot": "sbs-5e0c"}],
        })
    );
    // Absent fields read as unset; an absent phase is Pending.
    let read: SandboxSnapshotSpec = serde_json::from_value(serde_json::json!({
        "sandboxNamespace": "team-a", "sourceSandbox": "fsb-1"
    }))
    .unwrap();
    assert_eq!(read.phase, SnapshotPhase::Pending);
    assert!(read.volumes.is_empty() && read.size_bytes == 0 && read.uid.is_empty());
}

/// A SandboxTemplate exactly as the OpenSandbox server 1.1.1 writes it
/// (`template_service.py::_build_crd`, every optional part present).
fn server_written_template() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "sandbox.fast.io/v1alpha2",
        "kind": "SandboxTemplate",
        "metadata": {
            "name": "tpl-0b4b7c1e-3c1f-4a57-9d7e-2f1d1b0b9c11",
            "namespace": "opensandbox",
            "labels": {"team": "a"}
        },
        "spec": {
            "image": "python:3.12",
            "indexKey": "tpl-0b4b7c1e-3c1f-4a57-9d7e-2f1d1b0b9c11",
            "entrypoint": ["tail", "-f", "/dev/null"],
            "execd": "opensandbox/execd:v1",
            "kernel": "vmlinux.bin",
            "machine": {"vcpu": "1", "memory": "512Mi"},
            "output": {
                "rootfsSize": "2Gi",
                "format": "overlaybd",
                "publish": "s3://bucket/prefix",
                "publishSecretRef": {"name": "sandbox-oss-credentials"}
            },
            "envs": [{"name": "A", "value": "1"}],
            "readiness": {"probe": "tcp://127.0.0.1:44772", "warmupSeconds": 5}
        }
    })
}

#[test]
fn template_keeps_every_field_the_opensandbox_server_writes() {
    let written = server_written_template();
    let t: SandboxTemplate = serde_json::from_value(written.clone()).unwrap();
    assert_eq!(
        yaml(&t),
        written,
        "a field the server writes is lost or renamed"
    );
    assert!(t.is_named("tpl-0b4b7c1e-3c1f-4a57-9d7e-2f1d1b0b9c11"));
    assert!(!t.is_named("python:3.12"));
    // kubectl may write a bare image, and quantities as numbers.
    let minimal: SandboxTemplateSpec =
        serde_json::from_value(serde_json::json!({"image": "busybox", "machine": {"vcpu": 2}}))
            .unwrap();
    assert_eq!(minimal.machine.unwrap().vcpu, Some(IntOrString::Int(2)));
    assert!(minimal.envs.is_empty() && minimal.output.is_none());
    // The status in the names the server reads.
    let status = SandboxTemplateStatus {
        phase: Some(TemplatePhase::Failed),
        manifest_ref: Some("docker.io/library/python:3.12".into()),
        observed_generation: Some(1),
        conditions: vec![Condition {
            type_: template::FAILED_CONDITION.into(),
            status: "True".into(),
            observed_generation: Some(1),
            reason: "InvalidSpec".into(),
            message: "spec.image: bad".into(),
            last_transition_time: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
        }],
    };
    let v = yaml(&status);
    assert_eq!(v["phase"], "Failed");
    assert_eq!(v["manifestRef"], "docker.io/library/python:3.12");
    assert_eq!(v["conditions"][0]["type"], "Failed");
    assert_eq!(v["conditions"][0]["message"], "spec.image: bad");
}

#[test]
fn template_crd_admits_what_the_opensandbox_server_writes() {
    let crd = yaml(&SandboxTemplate::crd());
    assert_eq!(crd["metadata"]["name"], "sandboxtemplates.sandbox.fast.io");
    assert_eq!(crd["spec"]["group"], "sandbox.fast.io");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    assert_eq!(crd["spec"]["names"]["kind"], "SandboxTemplate");
    assert_eq!(crd["spec"]["names"]["plural"], "sandboxtemplates");
    let v = &crd["spec"]["versions"][0];
    assert_eq!(v["name"], "v1alpha2");
    assert_eq!((&v["served"], &v["storage"]), (&true.into(), &true.into()));
    assert_eq!(v["subresources"]["status"], serde_json::json!({}));
    let schema = &v["schema"]["openAPIV3Schema"]["properties"];
    let spec = &schema["spec"];
    assert_eq!(spec["required"], serde_json::json!(["image"]));
    // Every path of the server's object is in the schema (a structural
    // schema prunes what it does not declare).
    fn check_paths(value: &serde_json::Value, schema: &serde_json::Value, path: &str) {
        match value {
            serde_json::Value::Object(fields) => {
                for (k, v) in fields {
                    let sub = &schema["properties"][k];
                    assert!(sub.is_object(), "{path}.{k} is not in the CRD schema");
                    check_paths(v, sub, &format!("{path}.{k}"));
                }
            }
            serde_json::Value::Array(items) => {
                for v in items {
                    check_paths(v, &schema["items"], &format!("{path}[]"));
                }
            }
            _ => {}
        }
    }
    check_paths(&server_written_template()["spec"], spec, "spec");
    let status = &schema["status"]["properties"];
    for field in ["phase", "manifestRef", "conditions", "observedGeneration"] {
        assert!(
            status[field].is_object(),
            "status.{field} missing: {status}"
        );
    }
    let mut phases: Vec<&str> = status["phase"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s.as_str())
        .collect();
    phases.sort_unstable();
    assert_eq!(phases, ["Building", "Failed", "Pending", "Succeeded"]);
    assert_eq!(status["conditions"]["x-kubernetes-list-type"], "map");
    assert_eq!(printer_columns(v), ["Image", "Phase", "Manifest", "Age"]);
    assert!(is_generated("sandboxtemplates.sandbox.fast.io.yaml"));
}
