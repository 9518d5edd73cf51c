//! The OCI runtime version check: at start the agent asks every
//! runc-compatible runtime it found for its version (`<binary> --version`)
//! and compares it with [`KNOWN_ESCAPES`], a table of container escapes
//! with the releases (and distribution backports) that fixed them.
//!
//! The rule, per finding (an escape that applies to the runtime's version):
//! - no mitigation active → the runtime is refused: the agent does not
//!   start when it is the default runtime; another runtime is marked
//!   unavailable with the CVE as its reason (a request naming it is
//!   refused). `--runtime-check warn` turns both into a warning.
//! - partly mitigated (the precondition of the attack cannot be met by a
//!   sandbox, but a stronger mitigation — user namespaces — is off) →
//!   the agent starts and logs a warning naming the CVE and the flag that
//!   closes it.
//! - mitigated → logged at info.
//!
//! A version the check cannot read (the binary fails or prints something
//! else) is refused as an unknown runtime under `enforce`: an escape cannot
//! be ruled out. runsc (gVisor) is not checked: its escapes are a different
//! class (the Sentry), not runc's host-side mount/fd handling.

use std::cmp::Ordering;
use std::fmt;
use std::path::Path;

/// What the check does with a finding that nothing mitigates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RuntimeCheckMode {
    /// Refuse the runtime (the agent's start when it is the default one).
    #[default]
    Enforce,
    /// Log a warning and use the runtime anyway.
    Warn,
}

impl std::str::FromStr for RuntimeCheckMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "enforce" => Ok(Self::Enforce),
            "warn" => Ok(Self::Warn),
            other => Err(format!(
                "runtime check {other:?}: expected \"enforce\" or \"warn\""
            )),
        }
    }
}

/// How far the agent's configuration mitigates an escape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mitigation {
    /// Nothing the agent does stops it.
    None,
    /// The attack's precondition cannot be met by a sandbox as sandbolt
    /// builds them, but the stronger mitigation is off.
    Partial,
    /// Closed by the agent's configuration (user namespaces on).
    Full,
}

/// How an escape is mitigated, besides upgrading the runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MitigatedBy {
    /// Nothing short of a fixed runtime.
    Nothing,
    /// Sandboxes never share a path runc mounts onto (volumes are mounted
    /// by the agent after runc's create, see `crate::live_mount`; rootfs
    /// snapshots are per sandbox), which these races need; user
    /// namespaces (`--user-namespace node`) make the procfs files the
    /// attacks write to unwritable (they belong to the unmapped host root).
    RaceNeedsSharedMountsOrUserNamespace,
}

/// A distribution package that carries the fix in an older upstream
/// release: runc's `--version` prints the package version on its
/// `commit:` line (Debian: `commit: 1.1.5+ds1-1+deb12u1`).
#[derive(Debug, Clone, Copy)]
pub struct Backport {
    /// The package version up to the update counter.
    pub package_prefix: &'static str,
    /// The first update counter (the number after the prefix) with the fix.
    pub first_update: u32,
}

/// One known container escape.
#[derive(Debug, Clone, Copy)]
pub struct KnownEscape {
    pub cve: &'static str,
    pub runtime: &'static str,
    pub summary: &'static str,
    /// The first fixed release of each maintained branch, oldest first.
    pub fixed_in: &'static [&'static str],
    pub backports: &'static [Backport],
    pub mitigated_by: MitigatedBy,
}

/// The table (README "Runtime version check" mirrors it). Sources: the
/// runc security advisories; the Debian backport from the changelog of the
/// installed package (`/usr/share/doc/runc/changelog.Debian.gz`).
pub const KNOWN_ESCAPES: &[KnownEscape] = &[
    KnownEscape {
        cve: "CVE-2019-5736",
        runtime: "runc",
        summary: "a container process overwrites the host's runc binary through /proc/self/exe",
        fixed_in: &["1.0.0-rc6"],
        backports: &[],
        mitigated_by: MitigatedBy::Nothing,
    },
    KnownEscape {
        cve: "CVE-2021-30465",
        runtime: "runc",
        summary: "symlink-exchange race redirects a bind mount onto the host",
        fixed_in: &["1.0.0-rc95"],
        backports: &[],
        mitigated_by: MitigatedBy::Nothing,
    },
    KnownEscape {
        cve: "CVE-2024-21626",
        runtime: "runc",
        summary: "leaked host file descriptors (process.cwd /proc/self/fd/N) give the container the host's filesystem",
        fixed_in: &["1.1.12"],
        backports: &[Backport {
            package_prefix: "1.1.5+ds1-1+deb12u",
            first_update: 1,
        }],
        mitigated_by: MitigatedBy::Nothing,
    },
    KnownEscape {
        cve: "CVE-2025-31133",
        runtime: "runc",
        summary: "a raced /dev/null makes runc's masked-path bind mount expose a procfs file read-write",
        fixed_in: &["1.2.8", "1.3.3", "1.4.0-rc.3"],
        backports: &[],
        mitigated_by: MitigatedBy::RaceNeedsSharedMountsOrUserNamespace,
    },
    KnownEscape {
        cve: "CVE-2025-52565",
        runtime: "runc",
        summary: "a raced /dev/console bind mount exposes a procfs file read-write",
        fixed_in: &["1.2.8", "1.3.3", "1.4.0-rc.3"],
        backports: &[],
        mitigated_by: MitigatedBy::RaceNeedsSharedMountsOrUserNamespace,
    },
    KnownEscape {
        cve: "CVE-2025-52881",
        runtime: "runc",
        summary: "raced shared mounts redirect runc's writes to /proc (LSM labels, sysctls)",
        fixed_in: &["1.2.8", "1.3.3", "1.4.0-rc.3"],
        backports: &[],
        mitigated_by: MitigatedBy::RaceNeedsSharedMountsOrUserNamespace,
    },
];

/// A release version: `major.minor.patch` with an optional pre-release
/// (`-rc6`, `-rc.3`), which sorts before the release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
    /// The pre-release's number (`rc6` → 6); None for a release.
    pub pre: Option<u32>,
}

impl Version {
    /// Parses `1.1.5`, `1.1.5+ds1` (build metadata ignored), `1.0.0-rc6`,
    /// `1.4.0-rc.3`, `1.8.1`.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.split('+').next()?;
        let (core, pre) = match s.split_once('-') {
            Some((c, p)) => {
                let digits: String = p.chars().filter(char::is_ascii_digit).collect();
                (c, Some(digits.parse().ok()?))
            }
            None => (s, None),
        };
        let mut parts = core.split('.').map(|p| p.parse::<u32>().ok());
        let major = parts.next()??;
        let minor = parts.next()??;
        let patch = parts.next().unwrap_or(Some(0))?;
        Some(Self {
            major,
            minor,
            patch,
            pre,
        })
    }

    fn branch(&self) -> (u32, u32) {
        (self.major, self.minor)
    }
}

impl Ord for Version {
    fn cmp(&self, o: &Self) -> Ordering {
        (self.major, self.minor, self.patch)
            .cmp(&(o.major, o.minor, o.patch))
            .then(match (self.pre, o.pre) {
                (None, None) => Ordering::Equal,
                (None, Some(_)) => Ordering::Greater,
                (Some(_), None) => Ordering::Less,
                (Some(a), Some(b)) => a.cmp(&b),
            })
    }
}

impl PartialOrd for Version {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// What `<runtime> --version` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeVersion {
    /// The version as printed (`1.1.5+ds1`).
    pub raw: String,
    pub version: Version,
    /// The `commit:` line (a distribution's package version on Debian).
    pub commit: String,
}

/// Parses `runc version 1.1.5+ds1\ncommit: ...` (crun prints the same
/// shape).
pub fn parse_version_output(runtime: &str, out: &str) -> Option<RuntimeVersion> {
    let prefix = format!("{runtime} version ");
    let raw = out
        .lines()
        .find_map(|l| l.trim().strip_prefix(&prefix))?
        .trim()
        .to_string();
    let commit = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("commit:"))
        .map(|c| c.trim().to_string())
        .unwrap_or_default();
    Some(RuntimeVersion {
        version: Version::parse(&raw)?,
        raw,
        commit,
    })
}

/// Runs `<binary> --version` (bounded: a hung binary must not hang the
/// agent's start).
pub fn read_version(runtime: &str, binary: &Path) -> Result<RuntimeVersion, String> {
    let mut child = std::process::Command::new(binary)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("running {} --version: {e}", binary.display()))?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("{} --version did not answer", binary.display()));
            }
            Err(e) => return Err(format!("waiting for {} --version: {e}", binary.display())),
        }
    }
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        use std::io::Read;
        stdout
            .read_to_string(&mut out)
            .map_err(|e| format!("reading {} --version: {e}", binary.display()))?;
    }
    parse_version_output(runtime, &out).ok_or_else(|| {
        format!(
            "{} --version printed no \"{runtime} version X.Y.Z\" line: {:?}",
            binary.display(),
            out.lines().next().unwrap_or("")
        )
    })
}

/// One escape that applies to a runtime's version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub cve: &'static str,
    pub mitigation: Mitigation,
    /// A sentence for logs and errors.
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

fn is_fixed(escape: &KnownEscape, v: &RuntimeVersion) -> bool {
    let fixed: Vec<Version> = escape
        .fixed_in
        .iter()
        .filter_map(|f| Version::parse(f))
        .collect();
    let same_branch_fixed = fixed
        .iter()
        .any(|f| f.branch() == v.version.branch() && v.version >= *f);
    let newer_than_every_branch = fixed.iter().all(|f| v.version.branch() > f.branch());
    let backported = escape.backports.iter().any(|b| {
        v.commit
            .strip_prefix(b.package_prefix)
            .and_then(|n| n.parse::<u32>().ok())
            .is_some_and(|n| n >= b.first_update)
    });
    same_branch_fixed || newer_than_every_branch || backported
}

/// The escapes of [`KNOWN_ESCAPES`] that apply to `runtime` at `v`, with
/// how far the configuration (`user_namespaces` on or not) mitigates each.
pub fn findings(runtime: &str, v: &RuntimeVersion, user_namespaces: bool) -> Vec<Finding> {
    KNOWN_ESCAPES
        .iter()
        .filter(|e| e.runtime == runtime && !is_fixed(e, v))
        .map(|e| {
            let mitigation = match (e.mitigated_by, user_namespaces) {
                (MitigatedBy::Nothing, _) => Mitigation::None,
                (MitigatedBy::RaceNeedsSharedMountsOrUserNamespace, false) => Mitigation::Partial,
                (MitigatedBy::RaceNeedsSharedMountsOrUserNamespace, true) => Mitigation::Full,
            };
            let fixed = e.fixed_in.join(", ");
            let how = match mitigation {
                Mitigation::None => "not mitigated: upgrade the runtime".to_string(),
                Mitigation::Partial => {
                    "partly mitigated (sandboxes share no path runc mounts onto); \
                     --user-namespace node closes it"
                        .to_string()
                }
                Mitigation::Full => "mitigated by the sandboxes' user namespaces".to_string(),
            };
            Finding {
                cve: e.cve,
                mitigation,
                message: format!(
                    "{runtime} {} (commit {}) has {}: {} (fixed in {fixed}); {how}",
                    v.raw,
                    if v.commit.is_empty() { "?" } else { &v.commit },
                    e.cve,
                    e.summary
                ),
            }
        })
        .collect()
}

/// The verdict on one runtime: the reason to refuse it (None: usable) and
/// every finding (for logs).
pub fn verdict(
    runtime: &str,
    binary: &Path,
    user_namespaces: bool,
) -> (Option<String>, Vec<Finding>) {
    let v = match read_version(runtime, binary) {
        Ok(v) => v,
        Err(e) => {
            return (
                Some(format!(
                    "its version cannot be checked against known container escapes: {e}"
                )),
                Vec::new(),
            );
        }
    };
    let found = findings(runtime, &v, user_namespaces);
    let refused: Vec<&str> = found
        .iter()
        .filter(|f| f.mitigation == Mitigation::None)
        .map(|f| f.cve)
        .collect();
    let reason = (!refused.is_empty()).then(|| {
        format!(
            "{runtime} {} has known container escapes that nothing mitigates: {} (see the README's \
             runtime version check; --runtime-check warn runs it anyway)",
            v.raw,
            refused.join(", ")
        )
    });
    (reason, found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rv(raw: &str, commit: &str) -> RuntimeVersion {
        RuntimeVersion {
            raw: raw.into(),
            version: Version::parse(raw).unwrap(),
            commit: commit.into(),
        }
    }

    fn cves(v: &RuntimeVersion, userns: bool) -> Vec<(&'static str, Mitigation)> {
        findings("runc", v, userns)
            .into_iter()
            .map(|f| (f.cve, f.mitigation))
            .collect()
    }

    #[test]
    fn versions_order_pre_releases_first() {
        let p = |s| Version::parse(s).unwrap();
        assert!(p("1.0.0-rc5") < p("1.0.0-rc6"));
        assert!(p("1.0.0-rc95") < p("1.0.0"));
        assert!(p("1.4.0-rc.2") < p("1.4.0-rc.3"));
        assert!(p("1.1.5+ds1") < p("1.1.12"));
        assert_eq!(p("1.1.5+ds1"), p("1.1.5"));
        assert!(Version::parse("x.y").is_none());
    }

    #[test]
    fn parses_debians_runc_output() {
        let out = "runc version 1.1.5+ds1\ncommit: 1.1.5+ds1-1+deb12u1\nspec: 1.0.2-dev\n";
        let v = parse_version_output("runc", out).unwrap();
        assert_eq!(v.raw, "1.1.5+ds1");
        assert_eq!(v.commit, "1.1.5+ds1-1+deb12u1");
        assert!(parse_version_output("runc", "crun version 1.8.1").is_none());
    }

    #[test]
    fn debians_backport_fixes_21626_but_not_the_2025_races() {
        let deb = rv("1.1.5+ds1", "1.1.5+ds1-1+deb12u1");
        let partial = Mitigation::Partial;
        assert_eq!(
            cves(&deb, false),
            [
                ("CVE-2025-31133", partial),
                ("CVE-2025-52565", partial),
                ("CVE-2025-52881", partial)
            ]
        );
        assert!(cves(&deb, true).iter().all(|(_, m)| *m == Mitigation::Full));
        // The same upstream without the Debian update has 21626.
        let plain = rv("1.1.5+ds1", "1.1.5+ds1-1");
        assert!(cves(&plain, true).contains(&("CVE-2024-21626", Mitigation::None)));
    }

    #[test]
    fn fixed_branches_and_newer_releases_are_clean() {
        for v in ["1.2.8", "1.3.3", "1.4.0-rc.3", "1.4.0", "1.5.1"] {
            assert_eq!(cves(&rv(v, ""), false), [], "{v}");
        }
        let v = rv("1.3.2", "");
        assert_eq!(cves(&v, false).len(), 3);
        let old = rv("1.1.11", "");
        assert!(cves(&old, true).contains(&("CVE-2024-21626", Mitigation::None)));
        let ancient = rv("1.0.0-rc5", "");
        assert!(cves(&ancient, true).contains(&("CVE-2019-5736", Mitigation::None)));
    }

    #[test]
    fn crun_has_no_entries() {
        assert_eq!(findings("crun", &rv("1.8.1", ""), false), []);
    }
}
