//! The chart's JuiceFS values (shared volumes): the agents get the
//! metadata URL from a Secret file, a Bidirectional host mount point and
//! the juicefs binary; nothing of it without `agent.juicefs.enabled`.

use serde_json::{Value, json};

use crate::chart::{args, assert_real_flags, check, container, find, mounts};

fn volume<'a>(pod_owner: &'a Value, name: &str) -> &'a Value {
    pod_owner["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("no volume {name}"))
}

#[test]
fn juicefs_values_reach_the_agents_with_the_url_in_a_secret() {
    let values = json!({"agent": {"juicefs": {
        "enabled": true,
        "metaUrl": "postgres://jfs:secret@pg:5432/jfs",
        "mountPoint": "/srv/jfs",
        "binaryImage": "juicedata/mount:ce-v1.2.3",
    }}});
    let (objs, _) = check(Some(values), &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let secret = find(&objs, "Secret", "sb-sandbolt-juicefs");
    // The URL (with its password) is only in the Secret, never in a flag.
    assert_eq!(
        secret["stringData"]["meta-url"],
        "postgres://jfs:secret@pg:5432/jfs"
    );
    let ds = find(&objs, "DaemonSet", "sb-sandbolt-agent-default");
    let a = container(ds, "agent");
    assert_real_flags(a);
    for flag in [
        "--juicefs-meta-url-file=/etc/sandbolt/juicefs/meta-url",
        "--juicefs-mount-point=/srv/jfs",
        "--juicefs-binary=/opt/juicefs/juicefs",
    ] {
        assert!(args(a).contains(&flag.into()), "{flag}: {:?}", args(a));
    }
    assert!(!a.to_string().contains("jfs:secret"), "the URL leaked: {a}");
    let mount = a["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/srv/jfs")
        .expect("the mount point is mounted");
    assert_eq!(mount["mountPropagation"], "Bidirectional");
    assert_eq!(volume(ds, "juicefs")["hostPath"]["path"], "/srv/jfs");
    assert_eq!(
        volume(ds, "juicefs-meta-url")["secret"]["secretName"],
        "sb-sandbolt-juicefs"
    );
    let init = &ds["spec"]["template"]["spec"]["initContainers"][0];
    assert_eq!(init["image"], "juicedata/mount:ce-v1.2.3");
    assert!(mounts(a).contains(&"/opt/juicefs".into()));

    // An existing Secret, and the binary from the agent image.
    let values = json!({"agent": {"juicefs": {
        "enabled": true, "existingSecret": "my-jfs", "existingSecretKey": "url",
    }}});
    let (objs, _) = check(Some(values), &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    assert!(
        !objs
            .iter()
            .any(|o| o["kind"] == "Secret" && o["metadata"]["name"] == "sb-sandbolt-juicefs")
    );
    let ds = find(&objs, "DaemonSet", "sb-sandbolt-agent-default");
    let v = volume(ds, "juicefs-meta-url");
    assert_eq!(v["secret"]["secretName"], "my-jfs");
    assert_eq!(v["secret"]["items"][0]["key"], "url");
    let a = container(ds, "agent");
    assert!(args(a).contains(&"--juicefs-binary=/usr/local/bin/juicefs".into()));
    assert!(ds["spec"]["template"]["spec"]["initContainers"].is_null());
}

#[test]
fn juicefs_is_off_by_default_and_needs_a_url() {
    let (objs, _) = check(None, &[]).unwrap_or_else(|e| panic!("chart check failed:\n{e}"));
    let a = container(
        find(&objs, "DaemonSet", "sb-sandbolt-agent-default"),
        "agent",
    );
    assert!(
        !args(a).iter().any(|f| f.contains("juicefs")),
        "{:?}",
        args(a)
    );
    assert!(!mounts(a).contains(&"/var/lib/sandbolt/juicefs".into()));
    let err = check(Some(json!({"agent": {"juicefs": {"enabled": true}}})), &[])
        .expect_err("enabled without a URL");
    assert!(
        err.contains("agent.juicefs.enabled needs agent.juicefs.metaUrl"),
        "{err}"
    );
}
