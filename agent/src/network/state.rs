//! What survives an agent restart: one JSON file per prepared namespace
//! ("member"), written atomically, under `<state_dir>/network/`.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::NetworkError;

/// One prepared network namespace, in the pool or attached to a sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub member_id: String,
    pub netns_path: PathBuf,
    /// None until CNI has given the namespace an address.
    pub ip: Option<Ipv4Addr>,
    pub gateway: Ipv4Addr,
    /// Host side of the veth pair (ptp's `interfaces[0].name`).
    pub host_veth: Option<String>,
    /// None while the member waits in the pool.
    pub sandbox_id: Option<String>,
    /// The attached sandbox's policy, normalized (`""` = allow-all).
    #[serde(default)]
    pub policy_json: String,
}

/// The directories of `<state_dir>/network`.
#[derive(Debug, Clone)]
pub struct Dirs {
    pub root: PathBuf,
}

impl Dirs {
    pub fn new(state_dir: &Path) -> Self {
        Self {
            root: state_dir.join("network"),
        }
    }

    pub fn netns(&self) -> PathBuf {
        self.root.join("netns")
    }

    pub fn members(&self) -> PathBuf {
        self.root.join("members")
    }

    pub fn ipam(&self) -> PathBuf {
        self.root.join("ipam")
    }

    pub fn resolv_conf(&self) -> PathBuf {
        self.root.join("resolv.conf")
    }

    /// The subnet this state dir's agent claimed last.
    pub fn subnet_file(&self) -> PathBuf {
        self.root.join("subnet")
    }

    pub fn member_file(&self, member_id: &str) -> PathBuf {
        self.members().join(format!("{member_id}.json"))
    }

    pub fn create(&self) -> Result<(), NetworkError> {
        for d in [self.netns(), self.members(), self.ipam()] {
            std::fs::create_dir_all(&d).map_err(NetworkError::io(&d))?;
        }
        Ok(())
    }

    pub fn save(&self, member: &Member) -> Result<(), NetworkError> {
        let json = serde_json::to_vec_pretty(member).expect("a member serializes");
        write_atomic(&self.member_file(&member.member_id), &json)
    }

    pub fn remove(&self, member_id: &str) -> Result<(), NetworkError> {
        let path = self.member_file(member_id);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(NetworkError::io(&path)(e)),
            _ => Ok(()),
        }
    }

    /// Every readable member file; unreadable ones are logged and skipped
    /// (their namespace is found by the netns directory scan instead).
    pub fn load_all(&self) -> Vec<Member> {
        let Ok(dir) = std::fs::read_dir(self.members()) else {
            return Vec::new();
        };
        let mut members = Vec::new();
        for entry in dir.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Member>(&b).map_err(|e| e.to_string()))
            {
                Ok(m) => members.push(m),
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "unreadable network member file; ignored")
                }
            }
        }
        members
    }
}

/// Writes `bytes` to a temporary file beside `path`, then renames it over
/// `path`: a crash leaves the old or the new content, never half.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), NetworkError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, bytes).map_err(NetworkError::io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(NetworkError::io(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_round_trip_through_their_files() {
        let dir = tempfile::tempdir().unwrap();
        let dirs = Dirs::new(dir.path());
        dirs.create().unwrap();
        let m = Member {
            member_id: "m1".into(),
            netns_path: dirs.netns().join("m1"),
            ip: Some(Ipv4Addr::new(10, 203, 0, 2)),
            gateway: Ipv4Addr::new(10, 203, 0, 1),
            host_veth: Some("veth1".into()),
            sandbox_id: Some("sb".into()),
            policy_json: r#"{"defaultAction":"deny"}"#.into(),
        };
        dirs.save(&m).unwrap();
        std::fs::write(dirs.members().join("junk.json"), "{").unwrap();
        assert_eq!(dirs.load_all(), vec![m]);
        dirs.remove("m1").unwrap();
        dirs.remove("m1").unwrap();
    }
}
