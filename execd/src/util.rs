//! Small helpers: paths, time, users and groups, constant-time compare.
//!
//! The binary is statically linked against glibc, where NSS (getpwnam & co.) does not
//! work reliably; users and groups are read from `/etc/passwd` and `/etc/group` directly.

use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::ApiError;

/// Longest path the API accepts (Linux PATH_MAX).
pub const MAX_PATH_LEN: usize = 4096;

/// Validates and normalizes a path from a request: non-empty, no NUL, bounded length,
/// `~` expanded to the daemon's home, made absolute against the daemon's working
/// directory, `.` and `..` resolved lexically. Inside a sandbox the whole filesystem
/// belongs to the user, so any absolute path is allowed.
pub fn resolve_path(raw: &str) -> Result<PathBuf, ApiError> {
    if raw.is_empty() || raw.trim().is_empty() {
        return Err(ApiError::bad_request("path must not be empty"));
    }
    if raw.contains('\0') {
        return Err(ApiError::bad_request("path must not contain NUL bytes"));
    }
    if raw.len() > MAX_PATH_LEN {
        return Err(ApiError::bad_request(format!(
            "path longer than {MAX_PATH_LEN} bytes"
        )));
    }
    let expanded: PathBuf = if raw == "~" || raw.starts_with("~/") {
        let home = std::env::var_os("HOME").unwrap_or_else(|| "/".into());
        let mut p = PathBuf::from(home);
        if raw.len() > 2 {
            // As in a shell, `~//x` is `$HOME/x`: pushing "/x" would replace the home.
            p.push(raw[2..].trim_start_matches('/'));
        }
        p
    } else {
        PathBuf::from(raw)
    };
    let absolute = if expanded.is_absolute() {
        expanded
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| PathBuf::from("/"))
            .join(expanded)
    };
    Ok(normalize(&absolute))
}

/// Lexical normalization of an absolute path.
pub fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in path.components() {
        match c {
            Component::RootDir | Component::Prefix(_) | Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => out.push(n),
        }
    }
    out
}

/// Milliseconds since the Unix epoch.
pub fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// RFC 3339 UTC timestamp with microseconds, e.g. `2025-11-16T14:30:45.123456Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let t = if t < UNIX_EPOCH { UNIX_EPOCH } else { t };
    humantime::format_rfc3339_micros(t).to_string()
}

/// File mode as the API writes it: octal digits read as a decimal number (0o755 -> 755).
pub fn mode_to_api(mode: u32) -> u32 {
    let mut m = mode & 0o7777;
    let (mut out, mut mul) = (0u32, 1u32);
    while m > 0 {
        out += (m & 7) * mul;
        m >>= 3;
        mul *= 10;
    }
    out
}

/// Inverse of [`mode_to_api`]: 755 -> 0o755. Digits 8/9 or more than four digits are invalid.
pub fn mode_from_api(mode: i64) -> Result<u32, ApiError> {
    if !(0..=7777).contains(&mode) {
        return Err(ApiError::bad_request(format!(
            "invalid mode {mode}: want octal digits written as a decimal number, e.g. 755"
        )));
    }
    let (mut m, mut out, mut shift) = (mode as u32, 0u32, 0u32);
    while m > 0 {
        let d = m % 10;
        if d > 7 {
            return Err(ApiError::bad_request(format!(
                "invalid mode {mode}: digit {d} is not octal"
            )));
        }
        out |= d << shift;
        shift += 3;
        m /= 10;
    }
    Ok(out)
}

/// Constant-time byte comparison (length is not hidden). `subtle`, as
/// `sandbolt_proto::auth` uses, which execd does not link.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

/// One `/etc/passwd` entry.
#[derive(Debug, Clone)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// `/etc/passwd` + `/etc/group`, read once per use.
#[derive(Default)]
pub struct UserDb {
    users: Vec<User>,
    /// (name, gid, members)
    groups: Vec<(String, u32, Vec<String>)>,
    uid_names: HashMap<u32, String>,
    gid_names: HashMap<u32, String>,
}

impl UserDb {
    pub fn load() -> Self {
        Self::load_from(Path::new("/etc/passwd"), Path::new("/etc/group"))
    }

    pub fn load_from(passwd: &Path, group: &Path) -> Self {
        let mut db = UserDb::default();
        if let Ok(text) = std::fs::read_to_string(passwd) {
            for line in text.lines() {
                let f: Vec<&str> = line.split(':').collect();
                if f.len() < 7 || line.starts_with('#') {
                    continue;
                }
                let (Ok(uid), Ok(gid)) = (f[2].parse(), f[3].parse()) else {
                    continue;
                };
                db.uid_names.entry(uid).or_insert_with(|| f[0].to_string());
                db.users.push(User {
                    name: f[0].to_string(),
                    uid,
                    gid,
                    home: f[5].to_string(),
                });
            }
        }
        if let Ok(text) = std::fs::read_to_string(group) {
            for line in text.lines() {
                let f: Vec<&str> = line.split(':').collect();
                if f.len() < 4 || line.starts_with('#') {
                    continue;
                }
                let Ok(gid) = f[2].parse() else { continue };
                db.gid_names.entry(gid).or_insert_with(|| f[0].to_string());
                let members = f[3]
                    .split(',')
                    .filter(|m| !m.is_empty())
                    .map(str::to_string)
                    .collect();
                db.groups.push((f[0].to_string(), gid, members));
            }
        }
        db
    }

    /// Owner name for display: the passwd name, else the number.
    pub fn user_name(&self, uid: u32) -> String {
        self.uid_names
            .get(&uid)
            .cloned()
            .unwrap_or_else(|| uid.to_string())
    }
    pub fn group_name(&self, gid: u32) -> String {
        self.gid_names
            .get(&gid)
            .cloned()
            .unwrap_or_else(|| gid.to_string())
    }
    pub fn user_by_uid(&self, uid: u32) -> Option<&User> {
        self.users.iter().find(|u| u.uid == uid)
    }
    /// Resolves a user name or a numeric uid.
    pub fn resolve_uid(&self, name: &str) -> Option<u32> {
        self.users
            .iter()
            .find(|u| u.name == name)
            .map(|u| u.uid)
            .or_else(|| name.parse().ok())
    }
    /// Resolves a group name or a numeric gid.
    pub fn resolve_gid(&self, name: &str) -> Option<u32> {
        self.groups
            .iter()
            .find(|g| g.0 == name)
            .map(|g| g.1)
            .or_else(|| name.parse().ok())
    }
    /// Supplementary groups of a user (by membership lists), plus its primary group.
    pub fn groups_of(&self, user: &str, primary: u32) -> Vec<u32> {
        let mut out = vec![primary];
        for (_, gid, members) in &self.groups {
            if members.iter().any(|m| m == user) && !out.contains(gid) {
                out.push(*gid);
            }
        }
        out
    }
}

/// Resolves the `owner`/`group` pair of an upload, chmod or mkdir to numeric ids.
/// Empty strings and `None` mean "leave unchanged".
pub fn resolve_owner(
    db: &UserDb,
    owner: Option<&str>,
    group: Option<&str>,
) -> Result<(Option<u32>, Option<u32>), ApiError> {
    let uid = match owner.filter(|s| !s.is_empty()) {
        None => None,
        Some(o) => Some(
            db.resolve_uid(o)
                .ok_or_else(|| ApiError::bad_request(format!("unknown user {o:?}")))?,
        ),
    };
    let gid = match group.filter(|s| !s.is_empty()) {
        None => None,
        Some(g) => Some(
            db.resolve_gid(g)
                .ok_or_else(|| ApiError::bad_request(format!("unknown group {g:?}")))?,
        ),
    };
    Ok((uid, gid))
}

/// `chown` without following the last symlink; `None` keeps the id.
pub fn lchown(path: &Path, uid: Option<u32>, gid: Option<u32>) -> std::io::Result<()> {
    if uid.is_none() && gid.is_none() {
        return Ok(());
    }
    std::os::unix::fs::lchown(path, uid, gid)
}

/// Quotes a word for POSIX shells.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_round_trip() {
        assert_eq!(mode_to_api(0o755), 755);
        assert_eq!(mode_to_api(0o4755), 4755);
        assert_eq!(mode_to_api(0o100644), 644);
        assert_eq!(mode_to_api(0), 0);
        assert_eq!(mode_from_api(755).unwrap(), 0o755);
        assert_eq!(mode_from_api(644).unwrap(), 0o644);
        assert_eq!(mode_from_api(7).unwrap(), 0o7);
        assert!(mode_from_api(788).is_err());
        assert!(mode_from_api(-1).is_err());
        assert!(mode_from_api(17777).is_err());
    }

    #[test]
    fn paths() {
        assert_eq!(resolve_path("/a/./b/../c").unwrap(), PathBuf::from("/a/c"));
        assert_eq!(resolve_path("/../../x").unwrap(), PathBuf::from("/x"));
        assert_eq!(resolve_path("//a//b/").unwrap(), PathBuf::from("/a/b"));
        assert!(resolve_path("").is_err());
        assert!(resolve_path("/a\0b").is_err());
        assert!(resolve_path(&"a".repeat(5000)).is_err());
        assert!(resolve_path("rel").unwrap().is_absolute());
    }

    #[test]
    fn ct() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
    }

    #[test]
    fn quoting() {
        assert_eq!(shell_quote("abc"), "abc");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn user_db() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("passwd");
        let g = dir.path().join("group");
        std::fs::write(
            &p,
            "root:x:0:0:root:/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\nbad line\n",
        )
        .unwrap();
        std::fs::write(&g, "root:x:0:\nalice:x:1000:\nwheel:x:10:alice,bob\n").unwrap();
        let db = UserDb::load_from(&p, &g);
        assert_eq!(db.user_name(1000), "alice");
        assert_eq!(db.user_name(4242), "4242");
        assert_eq!(db.group_name(10), "wheel");
        assert_eq!(db.resolve_uid("alice"), Some(1000));
        assert_eq!(db.resolve_uid("77"), Some(77));
        assert_eq!(db.resolve_uid("nobody"), None);
        assert_eq!(db.groups_of("alice", 1000), vec![1000, 10]);
    }
}
