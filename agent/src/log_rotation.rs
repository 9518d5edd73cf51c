//! Caps each sandbox's log file: containerd's shim appends the task's
//! stdout and stderr to `<logs>/<id>.log` for as long as the task runs, so a
//! sandbox that prints forever would fill the node's disk.
//!
//! Every `--log-check-interval` the agent looks at the size of each
//! sandbox's log; one over `--log-max-bytes` is rotated copy-truncate: its
//! newest `max` bytes (from a line start) go to `<id>.log.1` (replacing the
//! older one), then the file is truncated to 0. The shim keeps its file
//! descriptor, opened with `O_APPEND`, so its next write lands at the new
//! end; no signal or reopen is needed and the shim is never touched.
//!
//! Bounds: on disk at most `2 × max` plus what the sandbox writes in one
//! interval (the overshoot before the next check). Copy-truncate loses what
//! the task writes between the last copy and the truncate (a few
//! microseconds); a log is a diagnostic, not a ledger.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::sandbox::Sandboxes;

/// Default `--log-max-bytes`: 10 MiB per file, one rotated file kept.
pub const DEFAULT_MAX_BYTES: u64 = 10 << 20;
/// Default `--log-check-interval`.
pub const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The rotated file of `log`: `<id>.log.1`.
pub fn rotated_path(log: &Path) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// The agent's limits-on-growth tasks: the log cap (unless
/// `--log-max-bytes 0`) and the ephemeral-storage check.
pub fn spawn(
    cfg: &crate::config::AgentConfig,
    sandboxes: &Arc<Sandboxes>,
    shutdown: &watch::Receiver<bool>,
) -> Vec<(&'static str, tokio::task::JoinHandle<()>)> {
    let mut tasks = Vec::new();
    if cfg.log_max_bytes > 0 {
        let logs = run(
            sandboxes.clone(),
            cfg.log_check_interval,
            cfg.log_max_bytes,
            shutdown.clone(),
        );
        tasks.push(("log-rotation", tokio::spawn(logs)));
    }
    let storage = crate::storage_limit::run(
        sandboxes.clone(),
        cfg.snapshotter.clone(),
        cfg.log_check_interval,
        shutdown.clone(),
    );
    tasks.push(("storage-limit", tokio::spawn(storage)));
    tasks
}

/// Runs `step` every `interval` until shutdown; a step that overruns the
/// interval delays the next one instead of bunching them. Both growth
/// checks (this log cap and the ephemeral-storage limit) tick through it.
pub(crate) async fn each_interval<F, Fut>(
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
    mut step: F,
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = ()>,
{
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.changed() => return,
        }
        step().await;
    }
}

/// Checks every sandbox's log every `interval` until shutdown.
pub async fn run(
    sandboxes: Arc<Sandboxes>,
    interval: Duration,
    max_bytes: u64,
    shutdown: watch::Receiver<bool>,
) {
    each_interval(interval, shutdown, || async {
        let logs: Vec<PathBuf> = sandboxes
            .ids()
            .iter()
            .map(|id| sandboxes.log_path(id))
            .collect();
        let rotated = tokio::task::spawn_blocking(move || rotate_all(&logs, max_bytes)).await;
        if let Err(e) = rotated {
            tracing::warn!(error = %e, "log rotation task failed");
        }
    })
    .await;
}

fn rotate_all(logs: &[PathBuf], max_bytes: u64) {
    for log in logs {
        match rotate_if_over(log, max_bytes) {
            Ok(true) => tracing::debug!(log = %log.display(), max_bytes, "sandbox log rotated"),
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(log = %log.display(), error = %e, "rotating a sandbox log failed")
            }
        }
    }
}

/// Rotates `log` when it holds more than `max_bytes`; returns whether it
/// did. A missing log is nothing to do.
pub fn rotate_if_over(log: &Path, max_bytes: u64) -> io::Result<bool> {
    let len = match fs::metadata(log) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if max_bytes == 0 || len <= max_bytes {
        return Ok(false);
    }
    let mut src = File::open(log)?;
    let newest = newest_lines(&mut src, len, max_bytes)?;
    // Written beside, then renamed: a reader never sees half a `.1`.
    let rotated = rotated_path(log);
    let mut tmp_name = rotated.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = PathBuf::from(tmp_name);
    let mut out = File::create(&tmp)?;
    out.write_all(&newest)?;
    // What the task appended while the copy ran, up to the truncate. Still
    // capped: the rotated file must stay within `max_bytes` plus this tail.
    let mut appended = Vec::new();
    src.seek(SeekFrom::Start(len))?;
    src.take(max_bytes).read_to_end(&mut appended)?;
    out.write_all(&appended)?;
    drop(out);
    // Renamed before the truncate: a reader in between sees lines twice,
    // never none.
    fs::rename(&tmp, &rotated)?;
    OpenOptions::new().write(true).open(log)?.set_len(0)?;
    Ok(true)
}

/// The last `max_bytes` of the first `len` bytes of `file`, starting after
/// the first newline when the cut falls inside a line (a reader then never
/// sees half a line at the top of the rotated file).
fn newest_lines(file: &mut File, len: u64, max_bytes: u64) -> io::Result<Vec<u8>> {
    let start = len.saturating_sub(max_bytes);
    file.seek(SeekFrom::Start(start))?;
    let mut buf = Vec::with_capacity((len - start) as usize);
    file.take(len - start).read_to_end(&mut buf)?;
    if start > 0
        && let Some(nl) = buf.iter().position(|&b| b == b'\n')
        && nl + 1 < buf.len()
    {
        buf.drain(..=nl);
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_over_the_cap_keeps_its_newest_lines_in_the_rotated_file() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("sb.log");
        let text: String = (0..100).map(|i| format!("line-{i:03}\n")).collect();
        fs::write(&log, &text).unwrap();
        assert!(rotate_if_over(&log, 100).unwrap());
        assert_eq!(fs::metadata(&log).unwrap().len(), 0);
        let rotated = fs::read_to_string(rotated_path(&log)).unwrap();
        assert!(rotated.len() <= 100, "{}", rotated.len());
        assert!(rotated.starts_with("line-"), "{rotated}");
        assert!(rotated.ends_with("line-099\n"), "{rotated}");
    }

    #[test]
    fn a_log_under_the_cap_or_missing_stays() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("sb.log");
        assert!(!rotate_if_over(&log, 10).unwrap());
        fs::write(&log, "short\n").unwrap();
        assert!(!rotate_if_over(&log, 10).unwrap());
        assert!(!rotate_if_over(&log, 0).unwrap(), "0 turns the cap off");
        assert!(!rotated_path(&log).exists());
    }

    #[test]
    fn the_shim_keeps_appending_after_the_truncate() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("sb.log");
        // As the shim opens it.
        let mut writer = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        writer.write_all(&[b'x'; 64]).unwrap();
        assert!(rotate_if_over(&log, 16).unwrap());
        writer.write_all(b"after\n").unwrap();
        assert_eq!(fs::read_to_string(&log).unwrap(), "after\n");
    }
}
