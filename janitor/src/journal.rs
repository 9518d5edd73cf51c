//! The janitor's journal: one file per cleanup in progress, written before
//! the first destructive step and removed after the controller was told.
//! A janitor killed mid-cleanup finds the entry on its next scan, finishes
//! the removal (snapshot, log file, mounts) and sends the report it owes.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{JanitorError, Result};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub sandbox_id: String,
    pub agent_id: String,
    pub name: String,
    pub namespace: String,
    pub reason: String,
    pub snapshotter: String,
    pub snapshot_key: String,
    pub started_at_unix_ms: i64,
}

pub struct Journal {
    dir: PathBuf,
}

/// Sandbox ids become file names here and in the agent's log dir.
pub fn safe_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 76
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

impl Journal {
    pub fn open(state_dir: &Path) -> Result<Self> {
        let dir = state_dir.join("reaping");
        std::fs::create_dir_all(&dir).map_err(JanitorError::io("creating", &dir))?;
        Ok(Self { dir })
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Durable before it returns: the file is written aside, synced, renamed.
    pub fn begin(&self, e: &Entry) -> Result<()> {
        use std::io::Write;
        let path = self.path(&e.sandbox_id);
        let tmp = self.dir.join(format!(".{}.tmp", e.sandbox_id));
        let body = serde_json::to_vec(e).expect("journal entries serialize");
        let mut f = std::fs::File::create(&tmp).map_err(JanitorError::io("writing", &tmp))?;
        f.write_all(&body)
            .and_then(|_| f.sync_all())
            .map_err(JanitorError::io("writing", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(JanitorError::io("renaming", &path))?;
        if let Ok(d) = std::fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    pub fn finish(&self, id: &str) -> Result<()> {
        let path = self.path(id);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(JanitorError::io("removing", path)(e)),
        }
    }

    /// Entries left by earlier scans; unreadable ones are logged and skipped.
    pub fn pending(&self) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        let rd = std::fs::read_dir(&self.dir).map_err(JanitorError::io("reading", &self.dir))?;
        for ent in rd.flatten() {
            let p = ent.path();
            if p.extension().is_none_or(|x| x != "json") {
                continue;
            }
            match std::fs::read(&p)
                .ok()
                .and_then(|b| serde_json::from_slice::<Entry>(&b).ok())
            {
                Some(e) if safe_id(&e.sandbox_id) => out.push(e),
                _ => {
                    tracing::warn!(path = %p.display(), "unreadable janitor journal entry; skipped")
                }
            }
        }
        out.sort_by(|a, b| a.sandbox_id.cmp(&b.sandbox_id));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_survive_until_finished() {
        let dir = tempfile::tempdir().unwrap();
        let j = Journal::open(dir.path()).unwrap();
        let e = Entry {
            sandbox_id: "sb-1".into(),
            agent_id: "a".into(),
            name: "n".into(),
            namespace: "default".into(),
            reason: "no-record".into(),
            snapshotter: "overlayfs".into(),
            snapshot_key: "sb-1".into(),
            started_at_unix_ms: 1,
        };
        j.begin(&e).unwrap();
        assert_eq!(
            Journal::open(dir.path()).unwrap().pending().unwrap(),
            vec![e]
        );
        j.finish("sb-1").unwrap();
        j.finish("sb-1").unwrap();
        assert!(j.pending().unwrap().is_empty());
    }

    #[test]
    fn ids_that_are_not_file_names_are_refused() {
        for bad in ["", "../x", "a/b", ".hidden", "a b"] {
            assert!(!safe_id(bad), "{bad}");
        }
        assert!(safe_id("sb-0123abc"));
    }
}
