//! Sandbox hardening and resource limits for the OCI runtime spec.
//!
//! [`apply`] takes the runtime spec the agent built ([`crate::spec::build`])
//! and adds the defences every sandbox gets:
//! no-new-privileges, Docker's default capability set, a default seccomp
//! profile (allowlist, errno by default), containerd's default masked and
//! read-only `/proc` and `/sys` paths, a device cgroup that denies by
//! default, a pids limit, rlimits, and the CPU/memory limits parsed from the
//! OpenSandbox strings by [`parse_cpu`] and [`parse_memory`].
//!
//! The policy is data, not code: the capability list and the path lists
//! below are well-known facts of Docker's and containerd's defaults; the
//! seccomp profile lives in `seccomp_default.json` next to this file.

use std::sync::LazyLock;

use oci_spec::runtime::{
    Capabilities, Capability, LinuxCapabilities, LinuxCpu, LinuxMemory, LinuxPids, LinuxResources,
    LinuxSeccomp, PosixRlimitBuilder, PosixRlimitType, Process, Spec,
};
use sandbolt_proto::quantity::{self, QuantityError};

use crate::spec::deny_all_devices;

/// The default seccomp profile: `SCMP_ACT_ERRNO` (EPERM) by default, an
/// allowlist of the syscalls an ordinary unprivileged workload needs, and the
/// argument-filtered rules that keep the allowlist from being a hole:
/// - `personality` only with the harmless personas (Linux, 32-bit-Linux,
///   `UNAME26`, and the query value `0xffffffff`);
/// - `clone` only without namespace-creating flags (mask `0x7e020000`), so a
///   sandbox cannot build itself new namespaces to attack the kernel from;
/// - `clone3` returns ENOSYS: its flags live in a struct seccomp cannot
///   inspect, and libc falls back to `clone` on ENOSYS;
/// - `socket` for every family except `AF_VSOCK` (40), which reaches the
///   hypervisor's host side.
///
/// Deliberately absent, as in Docker's default without extra capabilities:
/// mount/umount, unshare/setns, bpf, perf_event_open, keyctl family,
/// kexec/module loading, reboot, swapon, acct, clock setting, `io_uring_*`
/// (a recurring kernel attack surface; Docker dropped it from its default),
/// `userfaultfd`, `open_by_handle_at` (the "shocker" escape), `kcmp`,
/// `pidfd_getfd`. `chroot` is allowed because `CAP_SYS_CHROOT` is in the
/// default capability set; `ptrace` and `process_vm_*` are allowed because on
/// kernels ≥ 4.8 seccomp is re-checked after a tracer changes syscalls, which
/// is the condition under which Docker allows them too.
pub const DEFAULT_SECCOMP_JSON: &str = include_str!("seccomp_default.json");

/// Docker's default capability set. Everything else — notably `SYS_ADMIN`,
/// `NET_ADMIN`, `SYS_PTRACE`, `SYS_MODULE`, `DAC_READ_SEARCH` — is dropped.
pub const DEFAULT_CAPABILITIES: &[Capability] = &[
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fsetid,
    Capability::Fowner,
    Capability::Mknod,
    Capability::NetRaw,
    Capability::Setgid,
    Capability::Setuid,
    Capability::Setfcap,
    Capability::Setpcap,
    Capability::NetBindService,
    Capability::SysChroot,
    Capability::Kill,
    Capability::AuditWrite,
];

/// containerd's default masked paths: kernel state that leaks host
/// information or offers an attack surface (`/proc/kcore`, keyrings, timer
/// lists that disclose other processes' activity, firmware tables). The
/// powercap entry hides the RAPL energy counters (the "Platypus" side channel),
/// as newer containerd releases do.
pub const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// containerd's default read-only paths: writable kernel knobs that are not
/// namespaced (`/proc/sys`, `/proc/sysrq-trigger`, IRQ affinity, …).
pub const READONLY_PATHS: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// CFS period used for every CPU limit (the kernel's and Kubernetes' default).
pub const CFS_PERIOD_US: u64 = 100_000;

/// The smallest quota the kernel accepts (1 ms per period).
const CFS_MIN_QUOTA_US: i64 = 1_000;

/// A CPU limit as CFS bandwidth control: `quota_us` of CPU time per
/// `period_us` of wall time (quota/period = number of CPUs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuLimit {
    /// The parsed quantity in millicores (rounded up, as Kubernetes does).
    pub millicores: u64,
    pub quota_us: i64,
    pub period_us: u64,
}

/// What [`apply`] sets besides the fixed policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// `pids.max` of the sandbox's cgroup: bounds fork bombs. Must be > 0.
    pub pids_limit: i64,
    /// `RLIMIT_NOFILE` (soft and hard).
    pub nofile: u64,
    /// CFS limit, from [`parse_cpu`]. `None` leaves CPU unlimited.
    pub cpu: Option<CpuLimit>,
    /// Memory limit in bytes, from [`parse_memory`]. `None` leaves it unlimited.
    pub memory_bytes: Option<u64>,
    /// Hold memory+swap to the memory limit, so a sandbox cannot page its
    /// way past it. Only where the kernel accounts swap per cgroup (see
    /// [`swap_accounting`]); elsewhere runc would refuse the spec.
    pub limit_swap: bool,
    /// `cpu.shares` (1024 per requested CPU): the sandbox's weight when the
    /// node's CPUs are contended. `None` leaves the kernel default (1024).
    pub cpu_shares: Option<u64>,
    /// Soft memory limit (reclaimed first under node pressure).
    pub memory_reservation: Option<u64>,
}

/// Whether this host's memory cgroup accounts swap per cgroup: cgroup v1
/// needs `memory.memsw.*` (swapaccount), cgroup v2 always has `memory.swap.max`.
pub fn swap_accounting() -> bool {
    let v1 = std::path::Path::new("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes");
    let v2 = std::path::Path::new("/sys/fs/cgroup/cgroup.controllers");
    v1.exists() || (v2.exists() && !std::path::Path::new("/sys/fs/cgroup/memory").exists())
}

/// `cpu.shares` for a CPU request: 1024 per CPU, at least 2 (the kernel's
/// minimum), as the kubelet computes it.
pub fn cpu_shares(millicores: u64) -> u64 {
    (millicores.saturating_mul(1024) / 1000).max(2)
}

impl Default for Options {
    fn default() -> Self {
        Options {
            // Generous for agent workloads (compilers, test runners), still
            // far below the host's pid_max.
            pids_limit: 4096,
            // High enough for servers and language tooling; well below the
            // kernel's default nr_open (1 048 576) so runc can always set it.
            nofile: 65_536,
            cpu: None,
            memory_bytes: None,
            limit_swap: false,
            cpu_shares: None,
            memory_reservation: None,
        }
    }
}

/// Adds the hardening and limits to an OCI runtime spec. Fields the policy
/// owns (capabilities, seccomp, masked/readonly paths, noNewPrivileges, the
/// limits) are replaced; everything else in the spec is left as it is.
pub fn apply(spec: &mut Spec, opts: &Options) {
    let mut process = spec.process().clone().unwrap_or_default();
    harden_process(&mut process, opts.nofile);
    spec.set_process(Some(process));

    let mut linux = spec.linux().clone().unwrap_or_default();
    let owned = |paths: &[&str]| paths.iter().map(|p| p.to_string()).collect();
    linux
        .set_seccomp(Some(default_seccomp()))
        .set_masked_paths(Some(owned(MASKED_PATHS)))
        .set_readonly_paths(Some(owned(READONLY_PATHS)));
    let resources = linux
        .resources_mut()
        .get_or_insert_with(LinuxResources::default);
    set_limits(resources, opts);
    deny_devices_by_default(resources);
    spec.set_linux(Some(linux));
}

/// no-new-privileges, Docker's capability set, and `RLIMIT_NOFILE`.
fn harden_process(process: &mut Process, nofile: u64) {
    let caps: Capabilities = DEFAULT_CAPABILITIES.iter().copied().collect();
    let mut capabilities = LinuxCapabilities::default();
    capabilities
        .set_bounding(Some(caps.clone()))
        .set_effective(Some(caps.clone()))
        .set_permitted(Some(caps))
        .set_inheritable(Some(Capabilities::new()))
        .set_ambient(Some(Capabilities::new()));
    // Replace any RLIMIT_NOFILE the base spec had; keep other rlimits.
    let mut rlimits = process.rlimits().clone().unwrap_or_default();
    rlimits.retain(|r| r.typ() != PosixRlimitType::RlimitNofile);
    // `PosixRlimit` has no setters; its builder cannot fail (every field
    // has a default).
    let nofile_limit = PosixRlimitBuilder::default()
        .typ(PosixRlimitType::RlimitNofile)
        .hard(nofile)
        .soft(nofile)
        .build()
        .expect("a PosixRlimit builder with every field set builds");
    rlimits.push(nofile_limit);
    process
        .set_no_new_privileges(Some(true))
        .set_capabilities(Some(capabilities))
        .set_rlimits(Some(rlimits));
}

/// pids, CPU (CFS quota and shares) and memory (limit, swap, reservation).
fn set_limits(resources: &mut LinuxResources, opts: &Options) {
    let mut pids = LinuxPids::default();
    pids.set_limit(opts.pids_limit);
    resources.set_pids(Some(pids));
    if opts.cpu.is_some() || opts.cpu_shares.is_some() {
        let cpu = resources.cpu_mut().get_or_insert_with(LinuxCpu::default);
        if let Some(limit) = opts.cpu {
            cpu.set_quota(Some(limit.quota_us))
                .set_period(Some(limit.period_us));
        }
        if let Some(shares) = opts.cpu_shares {
            cpu.set_shares(Some(shares));
        }
    }
    if opts.memory_bytes.is_some() || opts.memory_reservation.is_some() {
        let memory = resources
            .memory_mut()
            .get_or_insert_with(LinuxMemory::default);
        if let Some(bytes) = opts.memory_bytes {
            memory.set_limit(Some(oci_bytes(bytes)));
            if opts.limit_swap {
                // OCI `swap` is memory+swap: equal to the limit means no swap.
                memory.set_swap(Some(oci_bytes(bytes)));
            }
        }
        if let Some(bytes) = opts.memory_reservation {
            memory.set_reservation(Some(oci_bytes(bytes)));
        }
    }
}

/// The limits of `opts` as a live update of a running task (containerd
/// `tasks.Update`, i.e. `runc update`): unlike a spec, an update leaves every
/// field it omits as it is, so a limit `opts` leaves unset is written as
/// "unlimited" (-1) or the kernel default, never skipped. A warm sandbox
/// started under its pool template's limits ends up under exactly the
/// claim's.
pub fn update_resources(opts: &Options) -> LinuxResources {
    const UNLIMITED: i64 = -1;
    let mut resources = LinuxResources::default();
    let mut pids = LinuxPids::default();
    pids.set_limit(opts.pids_limit);
    resources.set_pids(Some(pids));
    let mut cpu = LinuxCpu::default();
    match opts.cpu {
        Some(limit) => cpu
            .set_quota(Some(limit.quota_us))
            .set_period(Some(limit.period_us)),
        None => cpu
            .set_quota(Some(UNLIMITED))
            .set_period(Some(CFS_PERIOD_US)),
    };
    // 1024 is the kernel's default weight (no request).
    cpu.set_shares(Some(opts.cpu_shares.unwrap_or(1024)));
    resources.set_cpu(Some(cpu));
    let mut memory = LinuxMemory::default();
    let limit = opts.memory_bytes.map_or(UNLIMITED, oci_bytes);
    memory.set_limit(Some(limit));
    if opts.limit_swap || (opts.memory_bytes.is_none() && swap_accounting()) {
        // Memory+swap follows the limit (no swap), or is lifted with it.
        memory.set_swap(Some(limit));
    }
    memory.set_reservation(Some(opts.memory_reservation.map_or(UNLIMITED, oci_bytes)));
    resources.set_memory(Some(memory));
    resources
}

/// The OCI spec carries byte counts as `i64`; [`parse_memory`] never returns
/// more than `i64::MAX` (it rejects `8Ei` and up).
fn oci_bytes(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// The device cgroup must deny by default; runc then adds its standard
/// allowed character devices (null, zero, full, tty, random, urandom,
/// ptmx/pts) after the spec's rules. A deny-all first rule is always
/// correct because later rules override earlier ones.
fn deny_devices_by_default(resources: &mut LinuxResources) {
    let rules = resources.devices_mut().get_or_insert_with(Vec::new);
    let deny_all = deny_all_devices();
    if rules.first() != Some(&deny_all) {
        rules.insert(0, deny_all);
    }
}

/// The default seccomp profile (parsed once from the embedded file).
pub fn default_seccomp() -> LinuxSeccomp {
    static PROFILE: LazyLock<LinuxSeccomp> = LazyLock::new(|| {
        serde_json::from_str(DEFAULT_SECCOMP_JSON)
            .expect("seccomp_default.json is a valid OCI seccomp profile (unit-tested)")
    });
    PROFILE.clone()
}

/// Parses a CPU quantity as OpenSandbox sends it (`"500m"`, `"2"`, `"0.5"`)
/// into a CFS limit with a 100 ms period. Sub-millicore precision is rounded
/// up to the next millicore, like Kubernetes does; the quota never goes below
/// the kernel's 1 ms minimum.
pub fn parse_cpu(s: &str) -> Result<CpuLimit, QuantityError> {
    let millicores = quantity::millicores(s)?;
    let quota = u128::from(millicores)
        .checked_mul(u128::from(CFS_PERIOD_US))
        .map(|q| q / 1000)
        .and_then(|q| i64::try_from(q).ok())
        .ok_or_else(|| QuantityError::Overflow {
            what: "cpu",
            input: s.to_string(),
        })?;
    Ok(CpuLimit {
        millicores,
        quota_us: quota.max(CFS_MIN_QUOTA_US),
        period_us: CFS_PERIOD_US,
    })
}

/// Parses a memory quantity (`"512Mi"`, `"2Gi"`, `"1G"`, `"100M"`, `"1024"`,
/// `"1e9"`) into bytes, rounding a fractional byte count up.
pub fn parse_memory(s: &str) -> Result<u64, QuantityError> {
    quantity::bytes(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// A spec from JSON: the fixtures name fields as runc reads them.
    fn spec_from(v: Value) -> Spec {
        serde_json::from_value(v).expect("fixture is a valid OCI spec")
    }

    fn as_json(spec: &Spec) -> Value {
        serde_json::to_value(spec).unwrap()
    }

    fn cpu(s: &str) -> (u64, i64) {
        let c = parse_cpu(s).unwrap_or_else(|e| panic!("{s}: {e}"));
        assert_eq!(c.period_us, 100_000);
        (c.millicores, c.quota_us)
    }

    #[test]
    fn cpu_quantities() {
        for (input, millis, quota) in [
            ("500m", 500, 50_000),
            ("2", 2000, 200_000),
            ("0.5", 500, 50_000),
            (".5", 500, 50_000),
            ("1.", 1000, 100_000),
            ("+1", 1000, 100_000),
            ("250m", 250, 25_000),
            ("1500m", 1500, 150_000),
            ("1.25", 1250, 125_000),
            ("0.0001", 1, 1_000), // rounded up to one millicore
            ("1m", 1, 1_000),     // the kernel's minimum quota
            ("100u", 1, 1_000),
            ("5e-1", 500, 50_000),
            ("2E0", 2000, 200_000),
            ("1k", 1_000_000, 100_000_000),
            ("64", 64_000, 6_400_000),
        ] {
            assert_eq!(cpu(input), (millis, quota), "{input}");
        }
    }

    #[test]
    fn cpu_rejects() {
        for input in [
            "",
            "-1",
            "-500m",
            "0",
            "0m",
            "0.0",
            "abc",
            "1.2.3",
            ".",
            "m",
            "1 ",
            " 1",
            "1x",
            "1Ki5",
            "1e",
            "1e+",
            "1ee3",
            "5e99999999999",
            "1E19",
            "1e30",
        ] {
            assert!(
                parse_cpu(input).is_err(),
                "{input:?} must be rejected, got {:?}",
                parse_cpu(input)
            );
        }
        assert_eq!(
            parse_cpu("-1"),
            Err(QuantityError::Negative {
                what: "cpu",
                input: "-1".into()
            })
        );
        assert_eq!(
            parse_cpu("0"),
            Err(QuantityError::Zero {
                what: "cpu",
                input: "0".into()
            })
        );
        assert_eq!(parse_cpu(""), Err(QuantityError::Empty { what: "cpu" }));
        let msg = parse_cpu("2cores").unwrap_err().to_string();
        assert!(
            msg.contains("\"2cores\"") && msg.contains("unknown suffix"),
            "{msg}"
        );
    }

    #[test]
    fn memory_quantities() {
        for (input, bytes) in [
            ("512Mi", 512u64 << 20),
            ("2Gi", 2 << 30),
            ("1G", 1_000_000_000),
            ("100M", 100_000_000),
            ("1024", 1024),
            ("1e9", 1_000_000_000),
            ("1E9", 1_000_000_000),
            ("1.5Gi", 3 << 29),
            ("0.5Ki", 512),
            ("128974848", 128_974_848),
            ("129e6", 129_000_000),
            ("123Mi", 123 << 20),
            ("1k", 1000),
            ("1Ki", 1024),
            ("1Ti", 1 << 40),
            ("7Ei", 7 << 60),
            ("0.1", 1), // fractional bytes round up
            ("1500m", 2),
            ("+64Mi", 64 << 20),
            ("00064Mi", 64 << 20),
        ] {
            assert_eq!(parse_memory(input), Ok(bytes), "{input}");
        }
    }

    #[test]
    fn memory_rejects() {
        for input in [
            "",
            "-1",
            "-512Mi",
            "0",
            "0Mi",
            "Mi",
            "512 Mi",
            "512mi",
            "512MB",
            "1.2.3Gi",
            "8Ei",
            "16Ei",
            "99999999999999999999999999999999999999999",
            "1e19",
            "1e-",
            "0x10",
            "NaN",
            "inf",
        ] {
            assert!(
                parse_memory(input).is_err(),
                "{input:?} must be rejected, got {:?}",
                parse_memory(input)
            );
        }
        assert!(matches!(
            parse_memory("8Ei"),
            Err(QuantityError::Overflow { .. })
        ));
        assert!(matches!(
            parse_memory("-512Mi"),
            Err(QuantityError::Negative { .. })
        ));
        let msg = parse_memory("512MB").unwrap_err().to_string();
        assert!(msg.starts_with("memory quantity \"512MB\""), "{msg}");
    }

    #[test]
    fn apply_sets_the_policy() {
        let mut spec = spec_from(json!({
            "ociVersion": "1.0.2",
            "process": {
                "user": {"uid": 0, "gid": 0},
                "cwd": "/",
                "args": ["/opt/sandbolt/execd", "--init"],
                "capabilities": {"bounding": ["CAP_SYS_ADMIN"]},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024},
                            {"type": "RLIMIT_CORE", "hard": 0, "soft": 0}]
            },
            "linux": {"namespaces": [{"type": "pid"}], "resources": {"devices": [{"allow": true, "access": "rwm"}]}}
        }));
        let opts = Options {
            pids_limit: 512,
            nofile: 4096,
            cpu: Some(parse_cpu("500m").unwrap()),
            memory_bytes: Some(parse_memory("256Mi").unwrap()),
            limit_swap: true,
            cpu_shares: Some(cpu_shares(250)),
            memory_reservation: Some(parse_memory("128Mi").unwrap()),
        };
        apply(&mut spec, &opts);
        let applied = spec.clone();
        let spec = as_json(&spec);

        // Untouched fields survive.
        assert_eq!(spec["process"]["args"][0], "/opt/sandbolt/execd");
        assert_eq!(spec["linux"]["namespaces"][0]["type"], "pid");

        let p = &spec["process"];
        assert_eq!(p["noNewPrivileges"], true);
        for set in ["bounding", "effective", "permitted"] {
            let caps: Vec<&str> = p["capabilities"][set]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap())
                .collect();
            assert_eq!(caps.len(), 14, "{set}");
            assert!(caps.contains(&"CAP_NET_BIND_SERVICE") && caps.contains(&"CAP_AUDIT_WRITE"));
            assert!(
                !caps.contains(&"CAP_SYS_ADMIN"),
                "{set} must not keep SYS_ADMIN"
            );
        }
        assert_eq!(p["capabilities"]["inheritable"], json!([]));
        assert_eq!(p["capabilities"]["ambient"], json!([]));
        let rl = p["rlimits"].as_array().unwrap();
        assert_eq!(rl.len(), 2);
        assert!(rl.contains(&json!({"type": "RLIMIT_NOFILE", "hard": 4096, "soft": 4096})));
        assert!(rl.contains(&json!({"type": "RLIMIT_CORE", "hard": 0, "soft": 0})));

        let l = &spec["linux"];
        assert!(
            l["maskedPaths"]
                .as_array()
                .unwrap()
                .contains(&json!("/proc/kcore"))
        );
        assert!(
            l["readonlyPaths"]
                .as_array()
                .unwrap()
                .contains(&json!("/proc/sys"))
        );
        let r = &l["resources"];
        assert_eq!(r["pids"]["limit"], 512);
        assert_eq!(
            r["cpu"],
            json!({"quota": 50_000, "period": 100_000, "shares": 256})
        );
        assert_eq!(
            r["memory"],
            json!({"limit": 256u64 << 20, "swap": 256u64 << 20, "reservation": 128u64 << 20})
        );
        assert_eq!(r["devices"][0], json!({"allow": false, "access": "rwm"}));
        assert_eq!(r["devices"][1], json!({"allow": true, "access": "rwm"}));

        let s = &l["seccomp"];
        assert_eq!(s["defaultAction"], "SCMP_ACT_ERRNO");
        assert_eq!(
            s["architectures"],
            json!(["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"])
        );

        // Idempotent: applying twice gives the same spec.
        let mut twice = applied.clone();
        apply(&mut twice, &opts);
        assert_eq!(twice, applied);
    }

    #[test]
    fn apply_on_empty_spec_and_without_limits() {
        let mut spec = spec_from(json!({"ociVersion": "1.0.2"}));
        apply(&mut spec, &Options::default());
        let spec = as_json(&spec);
        assert_eq!(spec["linux"]["resources"]["pids"]["limit"], 4096);
        assert!(spec["linux"]["resources"].get("cpu").is_none());
        assert!(spec["linux"]["resources"].get("memory").is_none());
        assert_eq!(
            spec["linux"]["resources"]["devices"],
            json!([{"allow": false, "access": "rwm"}])
        );
    }

    #[test]
    fn seccomp_profile_shape() {
        // The typed profile says exactly what the file says (nothing lost
        // or added on the way through oci-spec).
        let file: Value = serde_json::from_str(DEFAULT_SECCOMP_JSON).unwrap();
        let s = serde_json::to_value(default_seccomp()).unwrap();
        assert_eq!(s, file);
        let rules = s["syscalls"].as_array().unwrap();
        let allowed = |name: &str| {
            rules.iter().any(|r| {
                r["action"] == "SCMP_ACT_ALLOW"
                    && r.get("args").is_none()
                    && r["names"].as_array().unwrap().iter().any(|n| n == name)
            })
        };
        let mentioned = |name: &str| {
            rules
                .iter()
                .any(|r| r["names"].as_array().unwrap().iter().any(|n| n == name))
        };
        for ok in [
            "read",
            "write",
            "execve",
            "openat",
            "mmap",
            "futex",
            "epoll_wait",
            "wait4",
            "exit_group",
            "rt_sigreturn",
            "chroot",
            "arch_prctl",
        ] {
            assert!(allowed(ok), "{ok} must be allowed");
        }
        for denied in [
            "mount",
            "umount2",
            "unshare",
            "setns",
            "bpf",
            "keyctl",
            "add_key",
            "kexec_load",
            "init_module",
            "finit_module",
            "reboot",
            "open_by_handle_at",
            "io_uring_setup",
            "userfaultfd",
            "perf_event_open",
            "swapon",
            "settimeofday",
            "pivot_root",
        ] {
            assert!(!mentioned(denied), "{denied} must not be in the profile");
        }
        // Argument-filtered, never unconditional.
        for filtered in ["clone", "personality", "socket"] {
            assert!(!allowed(filtered), "{filtered} must be argument-filtered");
            assert!(
                mentioned(filtered),
                "{filtered} must have a conditional rule"
            );
        }
        let clone = rules
            .iter()
            .find(|r| r["names"] == json!(["clone"]))
            .unwrap();
        assert_eq!(clone["args"][0]["op"], "SCMP_CMP_MASKED_EQ");
        assert_eq!(clone["args"][0]["value"], 0x7e02_0000u64);
        let clone3 = rules
            .iter()
            .find(|r| r["names"] == json!(["clone3"]))
            .unwrap();
        assert_eq!(clone3["action"], "SCMP_ACT_ERRNO");
        assert_eq!(clone3["errnoRet"], 38);
        // No duplicate names in the allowlist.
        let names = rules[0]["names"].as_array().unwrap();
        let mut sorted: Vec<_> = names.iter().map(|n| n.as_str().unwrap()).collect();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), names.len());
    }
}
