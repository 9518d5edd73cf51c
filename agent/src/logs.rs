//! Bounded reads of a sandbox's container log: the file its task's stdout
//! and stderr append to (see `Sandboxes::log_path`) and its rotated
//! predecessor (see [`crate::log_rotation`]). Only the end is read, so a
//! sandbox that printed gigabytes costs one bounded read.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use sandbolt_proto::agent::v1::{ReadSandboxLogRequest, SandboxLog};

use crate::error::AgentError;
use crate::sandbox::Sandboxes;

/// Lines answered when the request names no bound.
pub const DEFAULT_TAIL_LINES: u32 = 100;
/// The most lines one read answers (the OpenSandbox API's `tail` maximum).
pub const MAX_TAIL_LINES: u32 = 10_000;
/// The most bytes one read answers, and the default.
pub const MAX_BYTES: u64 = 1 << 20;

/// The end of one log, as [`SandboxLog`] carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogTail {
    pub content: String,
    /// Older output exists that is not in `content`.
    pub truncated: bool,
    pub size_bytes: u64,
}

/// Answers `ReadSandboxLog`: NOT_FOUND for a sandbox this agent does not
/// run (checked first: the id names a file only once it is known).
pub async fn read_sandbox_log(
    sandboxes: &Sandboxes,
    req: ReadSandboxLogRequest,
) -> Result<SandboxLog, AgentError> {
    sandboxes.get(&req.sandbox_id)?;
    let tail_lines = match req.tail_lines {
        0 => DEFAULT_TAIL_LINES,
        n => n.min(MAX_TAIL_LINES),
    };
    let max_bytes = match req.max_bytes {
        0 => MAX_BYTES,
        n => n.min(MAX_BYTES),
    };
    let path = sandboxes.log_path(&req.sandbox_id);
    let tail = read_tail_blocking(path, tail_lines as usize, max_bytes).await?;
    Ok(SandboxLog {
        content: tail.content,
        truncated: tail.truncated,
        size_bytes: tail.size_bytes,
    })
}

async fn read_tail_blocking(
    path: PathBuf,
    tail_lines: usize,
    max_bytes: u64,
) -> Result<LogTail, AgentError> {
    let context = format!("reading the sandbox log {}", path.display());
    tokio::task::spawn_blocking(move || read_tail(&path, tail_lines, max_bytes))
        .await
        .unwrap_or_else(|joined| Err(io::Error::other(joined)))
        .map_err(AgentError::io(context))
}

/// The last `tail_lines` lines of `path` within its last `max_bytes`
/// bytes, reading on into its rotated file (`<path>.1`, see
/// [`crate::log_rotation`]) when the current one holds fewer. A missing
/// file is an empty log (the sandbox wrote nothing, or the agent keeps no
/// logs). A line the byte bound cuts is dropped, unless it is the only one:
/// then its end comes. `size_bytes` counts both files.
pub fn read_tail(path: &Path, tail_lines: usize, max_bytes: u64) -> io::Result<LogTail> {
    // The current file's size first: a rotation after this read can only
    // shorten it, so the rotated file read next is never older than it.
    let current = open_sized(path)?;
    let rotated = open_sized(&crate::log_rotation::rotated_path(path))?;
    let rotated_len = rotated.1;
    let size_bytes = current.1 + rotated_len;
    let start = size_bytes.saturating_sub(max_bytes);
    let mut buf = Vec::with_capacity((size_bytes - start) as usize);
    // Oldest first: the rotated file's end, then the current file.
    read_range(rotated, start, &mut buf)?;
    read_range(current, start.saturating_sub(rotated_len), &mut buf)?;
    let mut window: &[u8] = &buf;
    if start > 0
        && let Some(nl) = window.iter().position(|&b| b == b'\n')
        && nl + 1 < window.len()
    {
        window = &window[nl + 1..];
    }
    let (kept, dropped_lines) = last_lines(window, tail_lines);
    Ok(LogTail {
        content: String::from_utf8_lossy(kept).into_owned(),
        truncated: start > 0 || dropped_lines,
        size_bytes,
    })
}

/// `path` opened with its size; a missing file is empty.
fn open_sized(path: &Path) -> io::Result<(Option<File>, u64)> {
    match File::open(path) {
        Ok(f) => {
            let len = f.metadata()?.len();
            Ok((Some(f), len))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok((None, 0)),
        Err(e) => Err(e),
    }
}

/// Appends bytes `from..size` of `file` to `buf`. The task may still be
/// writing: what the size said is read, no more.
fn read_range(file: (Option<File>, u64), from: u64, buf: &mut Vec<u8>) -> io::Result<()> {
    let (Some(mut f), len) = file else {
        return Ok(());
    };
    if from >= len {
        return Ok(());
    }
    f.seek(SeekFrom::Start(from))?;
    f.take(len - from).read_to_end(buf)?;
    Ok(())
}

/// The suffix of `text` holding its last `n` lines (a final newline ends
/// the last line, it does not start another), and whether lines were left
/// out.
fn last_lines(text: &[u8], n: usize) -> (&[u8], bool) {
    let body = text.strip_suffix(b"\n").unwrap_or(text);
    if n == 0 {
        return (&text[text.len()..], !text.is_empty());
    }
    let mut seen = 0;
    for (i, &b) in body.iter().enumerate().rev() {
        if b == b'\n' {
            seen += 1;
            if seen == n {
                return (&text[i + 1..], true);
            }
        }
    }
    (text, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(content: &[u8]) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        io::Write::write_all(&mut f, content).unwrap();
        f
    }

    #[test]
    fn the_last_lines_come_and_truncation_is_said() {
        let f = log(b"one\ntwo\nthree\n");
        let t = read_tail(f.path(), 2, MAX_BYTES).unwrap();
        assert_eq!(t.content, "two\nthree\n");
        assert!(t.truncated);
        assert_eq!(t.size_bytes, 14);
        let all = read_tail(f.path(), 3, MAX_BYTES).unwrap();
        assert_eq!(all.content, "one\ntwo\nthree\n");
        assert!(!all.truncated);
    }

    #[test]
    fn an_unterminated_last_line_counts_as_a_line() {
        let f = log(b"one\ntwo\nthree");
        let t = read_tail(f.path(), 2, MAX_BYTES).unwrap();
        assert_eq!(t.content, "two\nthree");
        assert!(t.truncated);
    }

    #[test]
    fn the_byte_bound_drops_the_line_it_cuts() {
        let f = log(b"aaaaaaaaaa\nbb\ncc\n");
        // The last 8 bytes are "a\nbb\ncc\n": the cut "a" goes.
        let t = read_tail(f.path(), 100, 8).unwrap();
        assert_eq!(t.content, "bb\ncc\n");
        assert!(t.truncated);
    }

    #[test]
    fn one_line_longer_than_the_byte_bound_comes_cut() {
        let f = log(b"0123456789");
        let t = read_tail(f.path(), 100, 4).unwrap();
        assert_eq!(t.content, "6789");
        assert!(t.truncated);
    }

    #[test]
    fn a_missing_log_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let t = read_tail(&dir.path().join("none.log"), 10, MAX_BYTES).unwrap();
        assert_eq!(t.content, "");
        assert!(!t.truncated);
        assert_eq!(t.size_bytes, 0);
    }

    #[test]
    fn the_rotated_file_is_read_on_into() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sb.log");
        std::fs::write(crate::log_rotation::rotated_path(&path), "one\ntwo\n").unwrap();
        std::fs::write(&path, "three\n").unwrap();
        let t = read_tail(&path, 2, MAX_BYTES).unwrap();
        assert_eq!(t.content, "two\nthree\n");
        assert_eq!(t.size_bytes, 14);
        let all = read_tail(&path, 10, MAX_BYTES).unwrap();
        assert_eq!(all.content, "one\ntwo\nthree\n");
        assert!(!all.truncated);
        // The byte bound reaches back into the rotated file too.
        let cut = read_tail(&path, 10, 12).unwrap();
        assert_eq!(cut.content, "two\nthree\n");
        assert!(cut.truncated);
    }

    #[test]
    fn invalid_utf8_is_replaced_not_refused() {
        let f = log(b"ok\n\xff\xfe\n");
        let t = read_tail(f.path(), 10, MAX_BYTES).unwrap();
        assert_eq!(t.content, "ok\n\u{fffd}\u{fffd}\n");
    }
}
