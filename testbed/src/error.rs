use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum TestbedError {
    #[error(
        "the test bed needs root (it starts containerd and dockerd and mounts filesystems); run the tests as root"
    )]
    NotRoot,
    #[error(
        "missing {binary}: install the Debian package(s) {packages} (apt-get install -y {packages})"
    )]
    MissingPackage { binary: String, packages: String },
    #[error("could not run {what}: {source}")]
    Spawn {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{daemon} did not answer within {waited:?}; its log ({log}) ends with:\n{tail}")]
    DaemonNotReady {
        daemon: &'static str,
        waited: Duration,
        log: PathBuf,
        tail: String,
    },
    #[error("{daemon} exited during start-up ({status}); its log ({log}) ends with:\n{tail}")]
    DaemonExited {
        daemon: &'static str,
        status: String,
        log: PathBuf,
        tail: String,
    },
    #[error("{command} failed ({status}): {stderr}")]
    Command {
        command: String,
        status: String,
        stderr: String,
    },
    #[error("test bed set-up: {0}")]
    Setup(String),
    #[error("I/O on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl TestbedError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| TestbedError::Io { path, source }
    }
}
