//! The OCI runtime spec of a sandbox, typed with `oci-spec`.
//!
//! The base mirrors containerd's default Unix spec (mounts, namespaces,
//! device cgroup deny-all); [`crate::hardening::apply`] adds seccomp, the
//! capability set, no-new-privileges, masked/read-only paths and rlimits.
//!
//! `oci-spec`'s builders fill unset fields from its own opinionated
//! defaults (youki's mounts, capabilities, rlimits, masked paths), so every
//! part here starts from an empty value and sets exactly what the sandbox
//! gets: what is not set below is not in the spec.

use std::path::Path;

use oci_spec::runtime::{
    LinuxDeviceCgroup, LinuxNamespace, LinuxNamespaceType, LinuxResources, Mount, Process, Root,
    Spec, User,
};

/// Where execd appears inside every sandbox.
pub const EXECD_PATH: &str = "/opt/sandbolt/execd";
/// Default PATH when the image sets none (containerd's default).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The OCI runtime spec version the agent writes.
const OCI_VERSION: &str = "1.0.2";

/// Everything that varies per sandbox.
#[derive(Debug, Clone)]
pub struct SpecInput<'a> {
    pub hostname: &'a str,
    /// The user's entrypoint + args (execd runs it as its child).
    pub user_command: &'a [String],
    /// A warm sandbox: execd starts without an entrypoint (`--warm`) and
    /// waits for the claim that brings one (`user_command` is ignored).
    pub warm: bool,
    /// `KEY=value` entries, image env first, request env overriding.
    pub env: &'a [String],
    pub cwd: &'a str,
    pub execd_host_path: &'a Path,
    pub cgroups_path: &'a str,
    /// The sandbox's prepared network; None: a fresh namespace with
    /// loopback only.
    pub network: Option<NetworkInput<'a>>,
}

/// Where the sandbox's network comes from (see [`crate::network`]).
#[derive(Debug, Clone, Copy)]
pub struct NetworkInput<'a> {
    /// The bind-mounted namespace the sandbox joins.
    pub netns_path: &'a Path,
    /// Bound read-only at `/etc/resolv.conf`.
    pub resolv_conf: &'a Path,
}

/// Builds the spec without hardening and limits (see the module docs).
pub fn build(input: &SpecInput<'_>) -> Spec {
    let mut spec = Spec::default();
    spec.set_version(OCI_VERSION.into())
        .set_process(Some(process(input)))
        .set_root(Some(root()))
        .set_hostname(Some(input.hostname.into()))
        .set_mounts(Some(mounts(input)))
        .set_annotations(None)
        .set_linux(Some(linux(input.cgroups_path, input.network)));
    spec
}

/// execd as PID 1, running the user's command as its child.
fn process(input: &SpecInput<'_>) -> Process {
    // --exit-with-entrypoint: the sandbox's task ends with the user's
    // entrypoint, so its exit code becomes the sandbox's (Stopped/Failed),
    // as in OpenSandbox's Docker mode where the entrypoint is the container.
    let mut args = [EXECD_PATH, "--init", "--exit-with-entrypoint"]
        .map(String::from)
        .to_vec();
    if input.warm {
        args.push("--warm".into());
    } else {
        args.push("--".into());
        args.extend(input.user_command.iter().cloned());
    }
    let mut process = Process::default();
    process
        .set_terminal(Some(false))
        .set_user(User::default())
        .set_args(Some(args))
        .set_env(Some(input.env.to_vec()))
        .set_cwd(input.cwd.into())
        // Hardening decides these (see the module docs).
        .set_capabilities(None)
        .set_rlimits(None)
        .set_no_new_privileges(None);
    process
}

fn root() -> Root {
    let mut root = Root::default();
    root.set_path("rootfs".into()).set_readonly(Some(false));
    root
}

fn mount(destination: &str, typ: &str, source: &str, options: &[&str]) -> Mount {
    let mut m = Mount::default();
    m.set_destination(destination.into())
        .set_typ(Some(typ.into()))
        .set_source(Some(source.into()))
        .set_options(Some(options.iter().map(|o| o.to_string()).collect()));
    m
}

fn mounts(input: &SpecInput<'_>) -> Vec<Mount> {
    let mut mounts = vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"]),
        mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        ),
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                "gid=5",
            ],
        ),
        mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        ),
        mount(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        ),
        mount(
            "/sys",
            "sysfs",
            "sysfs",
            &["nosuid", "noexec", "nodev", "ro"],
        ),
        // Read-only cgroup view so limits are visible from inside.
        mount(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", "ro"],
        ),
        mount(
            "/run",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        ),
        // execd: read-only, and nosuid/nodev like every bind.
        mount(
            EXECD_PATH,
            "bind",
            &input.execd_host_path.to_string_lossy(),
            &["rbind", "ro", "nosuid", "nodev"],
        ),
    ];
    // Volumes (host paths, named volumes) are not in the spec: runc would
    // look their sources up by path again. The agent mounts the directories
    // it checked and holds open into the task before it starts (see
    // `crate::live_mount`).
    if let Some(net) = input.network {
        // The agent's DNS proxy is the only resolver a sandbox can reach.
        mounts.push(mount(
            "/etc/resolv.conf",
            "bind",
            &net.resolv_conf.to_string_lossy(),
            &["rbind", "ro", "nosuid", "nodev", "noexec"],
        ));
    }
    mounts
}

/// The device rule that denies every device (runc adds its standard
/// allowed ones after the spec's rules).
pub fn deny_all_devices() -> LinuxDeviceCgroup {
    let mut rule = LinuxDeviceCgroup::default();
    rule.set_allow(false).set_access(Some("rwm".into()));
    rule
}

fn linux(cgroups_path: &str, network: Option<NetworkInput<'_>>) -> oci_spec::runtime::Linux {
    let mut resources = LinuxResources::default();
    resources.set_devices(Some(vec![deny_all_devices()]));
    // Without networking, a network namespace without a path: runc makes a
    // fresh one with only loopback, so the sandbox cannot reach the host's
    // ports. With it, the prepared namespace (veth, address, routes).
    let namespaces = [
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Network,
        // The sandbox sees its own cgroup as `/` (no host cgroup paths).
        LinuxNamespaceType::Cgroup,
    ]
    .map(|typ| {
        let mut ns = LinuxNamespace::default();
        ns.set_typ(typ);
        if let (LinuxNamespaceType::Network, Some(net)) = (typ, network) {
            ns.set_path(Some(net.netns_path.to_path_buf()));
        }
        ns
    })
    .to_vec();
    let mut linux = oci_spec::runtime::Linux::default();
    linux
        .set_cgroups_path(Some(cgroups_path.into()))
        .set_resources(Some(resources))
        .set_namespaces(Some(namespaces))
        // Hardening sets these (see the module docs).
        .set_masked_paths(None)
        .set_readonly_paths(None);
    linux
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
    use serde_json::{Value, json};
    use std::collections::HashMap;

    fn built(input: &SpecInput<'_>) -> Value {
        serde_json::to_value(build(input)).unwrap()
    }

    fn input(cmd: &[String]) -> SpecInput<'_> {
        SpecInput {
            hostname: "sb1",
            user_command: cmd,
            warm: false,
            env: &[],
            cwd: "/",
            execd_host_path: Path::new("/usr/lib/sandbolt/execd"),
            cgroups_path: "/sandbolt/sb1",
            network: None,
        }
    }

    #[test]
    fn a_prepared_network_is_joined_and_resolv_conf_bound_read_only() {
        let mut i = input(&[]);
        i.network = Some(NetworkInput {
            netns_path: Path::new("/state/network/netns/m1"),
            resolv_conf: Path::new("/state/network/resolv.conf"),
        });
        let s = built(&i);
        let ns = s["linux"]["namespaces"].as_array().unwrap();
        let net = ns.iter().find(|n| n["type"] == "network").unwrap();
        assert_eq!(net["path"], "/state/network/netns/m1");
        let m = s["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["destination"] == "/etc/resolv.conf")
            .unwrap();
        assert_eq!(m["source"], "/state/network/resolv.conf");
        assert!(m["options"].as_array().unwrap().contains(&json!("ro")));
    }

    #[test]
    fn execd_is_pid1_and_mounted_read_only() {
        let cmd = vec!["sleep".to_string(), "1".to_string()];
        let s = built(&input(&cmd));
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
        // A warm sandbox's execd waits for its claim: no entrypoint.
        let mut warm = input(&cmd);
        warm.warm = true;
        assert_eq!(
            built(&warm)["process"]["args"],
            json!([
                "/opt/sandbolt/execd",
                "--init",
                "--exit-with-entrypoint",
                "--warm"
            ])
        );
    }

    #[test]
    fn own_netns_and_cgroup_path() {
        let s = built(&input(&[]));
        assert_eq!(s["linux"]["cgroupsPath"], "/sandbolt/sb1");
        let ns = s["linux"]["namespaces"].as_array().unwrap();
        let net = ns.iter().find(|n| n["type"] == "network").unwrap();
        assert!(net.get("path").is_none(), "a path would share a namespace");
    }

    #[test]
    fn only_the_agents_own_binds_are_in_the_spec() {
        // Volumes are mounted by the agent from held descriptors, never by
        // runc from a path (see `crate::live_mount`).
        let s = built(&input(&[]));
        let binds: Vec<&str> = s["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["type"] == "bind")
            .map(|m| m["destination"].as_str().unwrap())
            .collect();
        assert_eq!(binds, [EXECD_PATH]);
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
