//! The OCI runtime spec of a sandbox, built directly as JSON (no spec crate:
//! the fields used are few and the wire names are the contract).
//!
//! The base mirrors containerd's default Unix spec (mounts, namespaces,
//! device cgroup deny-all); [`crate::hardening::apply`] adds seccomp, the
//! capability set, no-new-privileges, masked/read-only paths and rlimits.

use std::path::Path;

use serde_json::{Value, json};

/// Where execd appears inside every sandbox.
pub const EXECD_PATH: &str = "/opt/sandbolt/execd";
/// Default PATH when the image sets none (containerd's default).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A host path bound into the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindMount {
    pub source: String,
    pub destination: String,
    pub read_only: bool,
}

/// Everything that varies per sandbox.
#[derive(Debug, Clone)]
pub struct SpecInput<'a> {
    pub hostname: &'a str,
    /// The user's entrypoint + args (execd runs it as its child).
    pub user_command: &'a [String],
    /// `KEY=value` entries, image env first, request env overriding.
    pub env: &'a [String],
    pub cwd: &'a str,
    pub execd_host_path: &'a Path,
    pub binds: &'a [BindMount],
    pub cgroups_path: &'a str,
}

/// Builds the spec without hardening and limits (see the module docs).
pub fn build(input: &SpecInput<'_>) -> Value {
    // --exit-with-entrypoint: the sandbox's task ends with the user's
    // entrypoint, so its exit code becomes the sandbox's (Stopped/Failed),
    // as in OpenSandbox's Docker mode where the entrypoint is the container.
    let mut args = [EXECD_PATH, "--init", "--exit-with-entrypoint", "--"]
        .map(String::from)
        .to_vec();
    args.extend(input.user_command.iter().cloned());

    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc",
               "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts",
               "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
               "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
               "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs",
               "options": ["nosuid", "noexec", "nodev", "ro"]}),
        // Read-only cgroup view so limits are visible from inside.
        json!({"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
               "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]}),
        json!({"destination": "/run", "type": "tmpfs", "source": "tmpfs",
               "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        // execd: read-only, and nosuid/nodev like every bind.
        json!({"destination": EXECD_PATH, "type": "bind",
               "source": input.execd_host_path.to_string_lossy(),
               "options": ["rbind", "ro", "nosuid", "nodev"]}),
    ];
    for b in input.binds {
        let mut opts = vec!["rbind", "nosuid", "nodev"];
        if b.read_only {
            opts.push("ro");
        }
        mounts.push(json!({"destination": b.destination, "type": "bind",
                           "source": b.source, "options": opts}));
    }

    let resources = json!({"devices": [{"allow": false, "access": "rwm"}]});

    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": input.env,
            "cwd": input.cwd,
        },
        "root": {"path": "rootfs", "readonly": false},
        "hostname": input.hostname,
        "mounts": mounts,
        "linux": {
            "cgroupsPath": input.cgroups_path,
            "resources": resources,
            // A network namespace without a path: runc makes a fresh one with
            // only loopback, so the sandbox cannot reach the host's ports.
            "namespaces": [
                {"type": "pid"}, {"type": "ipc"}, {"type": "uts"},
                {"type": "mount"}, {"type": "network"},
            ],
        },
    })
}

/// Merges image env with request env (request wins), keeping image order,
/// and guarantees a PATH.
pub fn merge_env<'a>(
    image_env: &[String],
    request_env: impl IntoIterator<Item = (&'a String, &'a String)>,
    extra: &[(String, String)],
) -> Vec<String> {
    let mut out: Vec<(String, String)> = Vec::new();
    let mut set = |k: &str, v: &str| {
        if let Some(e) = out.iter_mut().find(|(ek, _)| ek == k) {
            e.1 = v.to_string();
        } else {
            out.push((k.to_string(), v.to_string()));
        }
    };
    for e in image_env {
        let (k, v) = e.split_once('=').unwrap_or((e.as_str(), ""));
        set(k, v);
    }
    let mut req: Vec<_> = request_env.into_iter().collect();
    req.sort();
    for (k, v) in req {
        set(k, v);
    }
    for (k, v) in extra {
        set(k, v);
    }
    if !out.iter().any(|(k, _)| k == "PATH") {
        out.insert(0, ("PATH".into(), DEFAULT_PATH.into()));
    }
    out.into_iter().map(|(k, v)| format!("{k}={v}")).collect()
}

/// The user command: the request's command (+args) replaces the image
/// entrypoint; request args alone replace the image cmd (Docker semantics).
pub fn user_command(
    image_entrypoint: Option<&[String]>,
    image_cmd: Option<&[String]>,
    command: &[String],
    args: &[String],
) -> Vec<String> {
    if !command.is_empty() {
        return command.iter().chain(args).cloned().collect();
    }
    let ep = image_entrypoint.unwrap_or_default();
    if !args.is_empty() {
        return ep.iter().chain(args).cloned().collect();
    }
    ep.iter()
        .chain(image_cmd.unwrap_or_default())
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn input<'a>(cmd: &'a [String], binds: &'a [BindMount]) -> SpecInput<'a> {
        SpecInput {
            hostname: "sb1",
            user_command: cmd,
            env: &[],
            cwd: "/",
            execd_host_path: Path::new("/usr/lib/sandbolt/execd"),
            binds,
            cgroups_path: "/sandbolt/sb1",
        }
    }

    #[test]
    fn execd_is_pid1_and_mounted_read_only() {
        let cmd = vec!["sleep".to_string(), "1".to_string()];
        let s = build(&input(&cmd, &[]));
        assert_eq!(
            s["process"]["args"],
            json!([
                "/opt/sandbolt/execd",
                "--init",
                "--exit-with-entrypoint",
                "--",
                "sleep",
                "1"
            ])
        );
        let m = s["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["destination"] == EXECD_PATH)
            .unwrap();
        assert_eq!(m["source"], "/usr/lib/sandbolt/execd");
        assert!(m["options"].as_array().unwrap().contains(&json!("ro")));
    }

    #[test]
    fn own_netns_and_cgroup_path() {
        let s = build(&input(&[], &[]));
        assert_eq!(s["linux"]["cgroupsPath"], "/sandbolt/sb1");
        let ns = s["linux"]["namespaces"].as_array().unwrap();
        let net = ns.iter().find(|n| n["type"] == "network").unwrap();
        assert!(net.get("path").is_none(), "a path would share a namespace");
    }

    #[test]
    fn binds_carry_ro() {
        let binds = vec![
            BindMount {
                source: "/data/a".into(),
                destination: "/a".into(),
                read_only: true,
            },
            BindMount {
                source: "/data/b".into(),
                destination: "/b".into(),
                read_only: false,
            },
        ];
        let s = build(&input(&[], &binds));
        let find = |d: &str| {
            s["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .find(|m| m["destination"] == d)
                .unwrap()
                .clone()
        };
        assert!(
            find("/a")["options"]
                .as_array()
                .unwrap()
                .contains(&json!("ro"))
        );
        assert!(
            !find("/b")["options"]
                .as_array()
                .unwrap()
                .contains(&json!("ro"))
        );
        assert!(
            find("/b")["options"]
                .as_array()
                .unwrap()
                .contains(&json!("rbind"))
        );
    }

    #[test]
    fn env_merge_request_wins_and_path_defaults() {
        let image = vec!["A=1".to_string(), "B=2".to_string()];
        let req = HashMap::from([("B".to_string(), "x".to_string())]);
        let env = merge_env(&image, &req, &[("T".into(), "tok".into())]);
        assert_eq!(
            env,
            vec![
                format!("PATH={DEFAULT_PATH}"),
                "A=1".into(),
                "B=x".into(),
                "T=tok".into()
            ]
        );
        let env = merge_env(&["PATH=/x".to_string()], &HashMap::new(), &[]);
        assert_eq!(env, vec!["PATH=/x".to_string()]);
    }

    #[test]
    fn command_semantics_follow_docker() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let ep = s(&["/ep"]);
        let cmd = s(&["c1"]);
        assert_eq!(
            user_command(Some(&ep), Some(&cmd), &[], &[]),
            s(&["/ep", "c1"])
        );
        assert_eq!(
            user_command(Some(&ep), Some(&cmd), &[], &s(&["a"])),
            s(&["/ep", "a"])
        );
        assert_eq!(
            user_command(Some(&ep), Some(&cmd), &s(&["/bin/x"]), &s(&["a"])),
            s(&["/bin/x", "a"])
        );
        assert_eq!(user_command(None, Some(&cmd), &[], &[]), s(&["c1"]));
    }
}
