//! A one-line progress bar on stderr.

use std::io::Write;
use std::time::Instant;

pub struct Progress {
    total: u64,
    done: u64,
    enabled: bool,
    started: Instant,
}

impl Progress {
    pub fn new(total: u64, enabled: bool) -> Self {
        Progress {
            total: total.max(1),
            done: 0,
            enabled,
            started: Instant::now(),
        }
    }

    pub fn step(&mut self, what: &str) {
        self.done = (self.done + 1).min(self.total);
        if !self.enabled {
            return;
        }
        let width = 30;
        let filled = (self.done * width / self.total) as usize;
        let bar = format!(
            "{}{}",
            "#".repeat(filled),
            ".".repeat(width as usize - filled)
        );
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r[{bar}] {:>3}% {:>5.0}s  {what:<40.40}",
            self.done * 100 / self.total,
            self.started.elapsed().as_secs_f64()
        );
        let _ = err.flush();
    }

    pub fn finish(&self) {
        if self.enabled {
            eprintln!();
        }
    }
}
