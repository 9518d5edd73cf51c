//! A create's resources and volumes against its pool's policy: defaults fill
//! what the request leaves unset, maxima refuse more, and every refusal
//! names the field. This runs for every API (native, FastPath v1/v2), so a
//! pool's promise holds whichever door a request came through.

use std::collections::HashSet;
use std::path::{Component, Path};

use sandbolt_proto::agent::v1 as pb;
use sandbolt_proto::quantity;

use crate::error::{Error, Result};
use crate::store::{HostVolume, PvcVolume, Resources};

/// OCI runtimes an agent may know.
pub const KNOWN_RUNTIMES: [&str; 3] = ["runc", "crun", "runsc"];

fn invalid(msg: String) -> Error {
    Error::InvalidArgument(msg)
}

fn cpu(field: &str, v: &str) -> Result<u64> {
    quantity::millicores(v).map_err(|e| invalid(format!("{field}: {e}")))
}

fn memory(field: &str, v: &str) -> Result<u64> {
    quantity::bytes(v).map_err(|e| invalid(format!("{field}: {e}")))
}

/// Applies `policy` to `requested`; the result is what the agent enforces.
pub fn resolve(
    requested: &Resources,
    pool: &str,
    policy: Option<&pb::PoolPolicy>,
) -> Result<Resources> {
    let defaults = policy
        .and_then(|p| p.default_limits.clone())
        .unwrap_or_default();
    let max = policy
        .and_then(|p| p.max_limits.clone())
        .unwrap_or_default();
    let mut r = requested.clone();
    r.cpu_limit = r.cpu_limit.trim().to_string();
    r.memory_limit = r.memory_limit.trim().to_string();
    r.cpu_request = r.cpu_request.trim().to_string();
    r.memory_request = r.memory_request.trim().to_string();
    if r.cpu_limit.is_empty() {
        r.cpu_limit = defaults.cpu.clone();
    }
    if r.memory_limit.is_empty() {
        r.memory_limit = defaults.memory.clone();
    }
    if r.pids_limit < 0 {
        return Err(invalid(format!(
            "resources.limits.pids {} must not be negative",
            r.pids_limit
        )));
    }
    if r.pids_limit == 0 {
        r.pids_limit = defaults.pids_limit;
    }

    if !r.cpu_limit.is_empty() {
        let asked = cpu("resources.limits.cpu", &r.cpu_limit)?;
        if !max.cpu.is_empty() && asked > cpu("pool max cpu", &max.cpu)? {
            return Err(invalid(format!(
                "resources.limits.cpu {} is above pool {pool:?}'s maximum {}",
                r.cpu_limit, max.cpu
            )));
        }
    } else if !max.cpu.is_empty() {
        // An unlimited sandbox in a pool with a maximum would be above it.
        r.cpu_limit = max.cpu.clone();
    }
    if !r.memory_limit.is_empty() {
        let asked = memory("resources.limits.memory", &r.memory_limit)?;
        if !max.memory.is_empty() && asked > memory("pool max memory", &max.memory)? {
            return Err(invalid(format!(
                "resources.limits.memory {} is above pool {pool:?}'s maximum {}",
                r.memory_limit, max.memory
            )));
        }
    } else if !max.memory.is_empty() {
        r.memory_limit = max.memory.clone();
    }
    if max.pids_limit > 0 {
        if r.pids_limit > max.pids_limit {
            return Err(invalid(format!(
                "resources.limits.pids {} is above pool {pool:?}'s maximum {}",
                r.pids_limit, max.pids_limit
            )));
        }
        if r.pids_limit == 0 {
            r.pids_limit = max.pids_limit;
        }
    }

    if !r.cpu_request.is_empty() {
        let req = cpu("resources.requests.cpu", &r.cpu_request)?;
        if !r.cpu_limit.is_empty() && req > cpu("resources.limits.cpu", &r.cpu_limit)? {
            return Err(invalid(format!(
                "resources.requests.cpu {} is above resources.limits.cpu {}",
                r.cpu_request, r.cpu_limit
            )));
        }
    }
    if !r.memory_request.is_empty() {
        let req = memory("resources.requests.memory", &r.memory_request)?;
        if !r.memory_limit.is_empty() && req > memory("resources.limits.memory", &r.memory_limit)? {
            return Err(invalid(format!(
                "resources.requests.memory {} is above resources.limits.memory {}",
                r.memory_request, r.memory_limit
            )));
        }
    }
    Ok(r)
}

/// The runtime a create runs under: the request's, else the pool's.
pub fn runtime(requested: &str, policy: Option<&pb::PoolPolicy>) -> Result<String> {
    let requested = requested.trim();
    if !requested.is_empty() && !KNOWN_RUNTIMES.contains(&requested) {
        return Err(invalid(format!(
            "runtime {requested:?} is unknown (known: {})",
            KNOWN_RUNTIMES.join(", ")
        )));
    }
    Ok(if requested.is_empty() {
        policy.map(|p| p.runtime.clone()).unwrap_or_default()
    } else {
        requested.to_string()
    })
}

/// Absolute and already normalized: no `.`/`..`, no `//`, no trailing `/`.
/// Rewriting a path silently would mean checking one thing and mounting
/// another, so a path that is not in normal form is refused.
fn normalized_absolute(p: &str) -> bool {
    let path = Path::new(p);
    path.is_absolute()
        && !p.contains("//")
        // `components()` drops inner `.`s: "/." would pass as "/".
        && !p.split('/').any(|c| c == ".")
        && (p == "/" || !p.ends_with('/'))
        && path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

/// Where no volume may be mounted: the kernel's views and execd's own path.
const RESERVED_MOUNTS: [&str; 5] = ["/proc", "/sys", "/dev", "/opt/sandbolt", "/run"];

/// Syntax of host volumes; the agent checks the path against its allowed
/// roots on the node (only it sees the node's filesystem).
pub fn check_volumes(volumes: &[HostVolume]) -> Result<()> {
    check_all_volumes(volumes, &[])
}

/// Syntax of host and named volumes together: mount paths are unique
/// across both, and a named volume is mounted at most once per sandbox.
/// Named volumes are named in messages by their entry name
/// (`volumes[data]`), host volumes by their index among host volumes.
pub fn check_all_volumes(host: &[HostVolume], named: &[PvcVolume]) -> Result<()> {
    let mut seen = HashSet::new();
    for (i, v) in host.iter().enumerate() {
        let field = format!("volumes[{i}]");
        if !normalized_absolute(&v.host_path) {
            return Err(invalid(format!(
                "{field}.host.path {:?} must be an absolute, normalized path",
                v.host_path
            )));
        }
        check_mount(&field, &v.name, &v.mount_path, &v.sub_path, &mut seen)?;
    }
    let mut claims = HashSet::new();
    for v in named {
        let field = format!("volumes[{}]", v.name);
        check_mount(&field, &v.name, &v.mount_path, &v.sub_path, &mut seen)?;
        crate::volume::check_name(&format!("{field}.pvc.claimName"), &v.claim_name)?;
        if !claims.insert(v.claim_name.as_str()) {
            return Err(invalid(format!(
                "{field}.pvc.claimName {:?} is mounted by another entry; a volume is mounted at most once per sandbox",
                v.claim_name
            )));
        }
    }
    Ok(())
}

/// One mount's name, target and sub path; `seen` holds the targets so far.
fn check_mount<'a>(
    field: &str,
    name: &str,
    mount_path: &'a str,
    sub_path: &str,
    seen: &mut HashSet<&'a str>,
) -> Result<()> {
    if name.trim().is_empty() {
        return Err(invalid(format!("{field}.name is required")));
    }
    if !normalized_absolute(mount_path) || mount_path == "/" {
        return Err(invalid(format!(
            "{field}.mountPath {mount_path:?} must be an absolute, normalized path other than /"
        )));
    }
    if let Some(r) = RESERVED_MOUNTS
        .iter()
        .find(|r| mount_path == **r || mount_path.starts_with(&format!("{r}/")))
    {
        return Err(invalid(format!(
            "{field}.mountPath {mount_path:?} lies under {r}, which sandbolt owns"
        )));
    }
    if !sub_path.is_empty() {
        let sub = Path::new(sub_path);
        if sub.is_absolute()
            || sub_path.split('/').any(|c| c == "." || c.is_empty())
            || !sub.components().all(|c| matches!(c, Component::Normal(_)))
        {
            return Err(invalid(format!(
                "{field}.subPath {sub_path:?} must be relative, without '.' or '..'"
            )));
        }
    }
    if !seen.insert(mount_path) {
        return Err(invalid(format!(
            "{field}.mountPath {mount_path:?} is used by another volume"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> pb::PoolPolicy {
        pb::PoolPolicy {
            runtime: "runc".into(),
            default_limits: Some(pb::Resources {
                cpu: "1".into(),
                memory: "512Mi".into(),
                pids_limit: 256,
                ..Default::default()
            }),
            max_limits: Some(pb::Resources {
                cpu: "2".into(),
                memory: "1Gi".into(),
                pids_limit: 1024,
                ..Default::default()
            }),
            warm_images: vec![],
        }
    }

    #[test]
    fn defaults_fill_unset_fields_only() {
        let asked = Resources {
            memory_limit: "64Mi".into(),
            ..Default::default()
        };
        let r = resolve(&asked, "p", Some(&policy())).unwrap();
        assert_eq!(
            (r.cpu_limit.as_str(), r.memory_limit.as_str(), r.pids_limit),
            ("1", "64Mi", 256)
        );
    }

    #[test]
    fn maxima_refuse_and_name_the_field() {
        for (asked, field) in [
            (
                Resources {
                    cpu_limit: "2001m".into(),
                    ..Default::default()
                },
                "resources.limits.cpu",
            ),
            (
                Resources {
                    memory_limit: "2Gi".into(),
                    ..Default::default()
                },
                "resources.limits.memory",
            ),
            (
                Resources {
                    pids_limit: 5000,
                    ..Default::default()
                },
                "resources.limits.pids",
            ),
            (
                Resources {
                    cpu_limit: "500m".into(),
                    cpu_request: "1".into(),
                    ..Default::default()
                },
                "resources.requests.cpu",
            ),
        ] {
            let e = resolve(&asked, "p", Some(&policy()))
                .unwrap_err()
                .to_string();
            assert!(e.contains(field), "{e} should name {field}");
        }
        assert!(
            resolve(
                &Resources {
                    cpu_limit: "2".into(),
                    ..Default::default()
                },
                "p",
                Some(&policy())
            )
            .is_ok(),
            "the maximum itself is allowed"
        );
    }

    #[test]
    fn a_pool_maximum_caps_an_unlimited_request() {
        let mut p = policy();
        p.default_limits = None;
        let r = resolve(&Resources::default(), "p", Some(&p)).unwrap();
        assert_eq!(
            (r.cpu_limit.as_str(), r.memory_limit.as_str()),
            ("2", "1Gi")
        );
    }

    #[test]
    fn no_policy_keeps_the_request() {
        let asked = Resources {
            cpu_limit: "250m".into(),
            ..Default::default()
        };
        assert_eq!(resolve(&asked, "p", None).unwrap(), asked);
        let bad = Resources {
            memory_limit: "lots".into(),
            ..Default::default()
        };
        assert!(
            resolve(&bad, "p", None)
                .unwrap_err()
                .to_string()
                .contains("resources.limits.memory")
        );
    }

    #[test]
    fn runtimes() {
        assert_eq!(runtime("", Some(&policy())).unwrap(), "runc");
        assert_eq!(runtime("runsc", Some(&policy())).unwrap(), "runsc");
        assert_eq!(runtime("", None).unwrap(), "");
        assert!(
            runtime("kata", None)
                .unwrap_err()
                .to_string()
                .contains("runtime")
        );
    }

    #[test]
    fn volume_syntax() {
        let ok = HostVolume {
            name: "data".into(),
            host_path: "/srv/data".into(),
            sub_path: "a/b".into(),
            mount_path: "/data".into(),
            read_only: false,
        };
        check_volumes(std::slice::from_ref(&ok)).unwrap();
        for (bad, field) in [
            (
                HostVolume {
                    host_path: "/srv/../etc".into(),
                    ..ok.clone()
                },
                "host.path",
            ),
            (
                HostVolume {
                    host_path: "srv".into(),
                    ..ok.clone()
                },
                "host.path",
            ),
            (
                HostVolume {
                    mount_path: "/proc/x".into(),
                    ..ok.clone()
                },
                "mountPath",
            ),
            (
                HostVolume {
                    mount_path: "/data/".into(),
                    ..ok.clone()
                },
                "mountPath",
            ),
            (
                HostVolume {
                    sub_path: "../x".into(),
                    ..ok.clone()
                },
                "subPath",
            ),
        ] {
            let e = check_volumes(&[bad]).unwrap_err().to_string();
            assert!(e.contains(field), "{e} should name {field}");
        }
        let e = check_volumes(&[ok.clone(), ok]).unwrap_err().to_string();
        assert!(e.contains("volumes[1].mountPath"), "{e}");
    }

    #[test]
    fn named_volumes_share_mount_paths_with_host_volumes_and_mount_once() {
        let host = HostVolume {
            name: "h".into(),
            host_path: "/srv/h".into(),
            mount_path: "/data".into(),
            ..Default::default()
        };
        let pvc = PvcVolume {
            name: "w".into(),
            claim_name: "work".into(),
            mount_path: "/work".into(),
            ..Default::default()
        };
        check_all_volumes(std::slice::from_ref(&host), std::slice::from_ref(&pvc)).unwrap();
        let cases = [
            (
                PvcVolume {
                    mount_path: "/data".into(),
                    ..pvc.clone()
                },
                "volumes[w].mountPath \"/data\" is used by another volume",
            ),
            (
                PvcVolume {
                    mount_path: "/proc/x".into(),
                    ..pvc.clone()
                },
                "volumes[w].mountPath",
            ),
            (
                PvcVolume {
                    sub_path: "../up".into(),
                    ..pvc.clone()
                },
                "volumes[w].subPath",
            ),
            (
                PvcVolume {
                    claim_name: "Work".into(),
                    ..pvc.clone()
                },
                "volumes[w].pvc.claimName",
            ),
            (
                PvcVolume {
                    name: String::new(),
                    ..pvc.clone()
                },
                "volumes[].name is required",
            ),
        ];
        for (bad, want) in cases {
            let e = check_all_volumes(std::slice::from_ref(&host), &[bad]).unwrap_err();
            assert!(e.to_string().contains(want), "{e} should say {want}");
        }
        let twice = PvcVolume {
            name: "w2".into(),
            mount_path: "/work2".into(),
            ..pvc.clone()
        };
        let e = check_all_volumes(&[], &[pvc, twice]).unwrap_err();
        assert!(e.to_string().contains("at most once per sandbox"), "{e}");
    }
}
