//! Taking a test bed apart, and finding what a crashed one left behind:
//! daemons, containers, mounts, bridges, and the loop devices of agents'
//! loop-backed btrfs volume pools kept in the bed's directory.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Testbed;
use crate::daemon::delete_bridge;

/// Every test bed lives in `/tmp/<prefix>XXXXXX`.
pub const TESTBED_DIR_PREFIX: &str = "sandbolt-testbed-";

const CTR_TIMEOUT: Duration = Duration::from_secs(15);

/// SIGTERM, up to `grace` to exit, then SIGKILL.
pub(crate) fn stop_child(child: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    signal(child.id() as i32, libc::SIGTERM);
    let started = Instant::now();
    while started.elapsed() < grace {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Kills and deletes every task and container in every namespace, through
/// containerd itself, so that runc's state and the shims go away cleanly.
pub(crate) fn remove_all_tasks(bed: &Testbed) {
    let namespaces = ctr_lines(bed.ctr("default").args(["namespaces", "ls", "-q"]));
    for ns in namespaces {
        for task in ctr_lines(bed.ctr(&ns).args(["tasks", "ls", "-q"])) {
            ctr_lines(
                bed.ctr(&ns)
                    .args(["tasks", "kill", "-a", "-s", "SIGKILL", &task]),
            );
            ctr_lines(bed.ctr(&ns).args(["tasks", "delete", "-f", &task]));
        }
        for container in ctr_lines(bed.ctr(&ns).args(["containers", "ls", "-q"])) {
            ctr_lines(bed.ctr(&ns).args(["containers", "delete", &container]));
        }
        // runc keeps per-namespace state under a host-wide root; drop the
        // namespace's directory once it is empty (remove_dir refuses otherwise).
        let _ = fs::remove_dir(Path::new("/run/containerd/runc").join(&ns));
    }
}

/// Runs a ctr command with a deadline (a wedged containerd must not hang a
/// test run's teardown) and returns its non-empty output lines.
fn ctr_lines(cmd: &mut Command) -> Vec<String> {
    let Ok(mut child) = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    else {
        return Vec::new();
    };
    let started = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if started.elapsed() < CTR_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(10))
            }
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return Vec::new();
            }
        }
    }
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        use std::io::Read;
        let _ = stdout.read_to_string(&mut out);
    }
    out.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect()
}

/// Kills whatever still refers to `dir`, unmounts everything below it (and
/// every mount of a loop device whose image lies below it), detaches those
/// loop devices and removes it.
pub(crate) fn clean_dir(dir: &Path) {
    kill_processes_mentioning(dir);
    unmount_below(dir);
    unmount_loops_below(dir);
    detach_loops_below(dir);
    if let Ok(bridge) = fs::read_to_string(dir.join("bridge")) {
        delete_bridge(bridge.trim());
    }
    if let Err(e) = fs::remove_dir_all(dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(dir = %dir.display(), error = %e, "could not remove test bed directory");
    }
}

/// Tears down beds whose owning test process is gone.
pub(crate) fn sweep_stale() {
    for dir in testbed_dirs() {
        let owner = fs::read_to_string(dir.join("owner.pid"))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok());
        let alive = match owner {
            Some(pid) => Path::new(&format!("/proc/{pid}")).exists(),
            // A bed another process is creating right now has no owner file
            // yet: only one that stayed without it for a minute is stale.
            None => fs::metadata(&dir)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_none_or(|age| age < Duration::from_secs(60)),
        };
        if !alive {
            tracing::warn!(dir = %dir.display(), "removing a test bed left by a dead process");
            clean_dir(&dir);
        }
    }
}

fn testbed_dirs() -> Vec<std::path::PathBuf> {
    let Ok(entries) = fs::read_dir("/tmp") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(TESTBED_DIR_PREFIX)
        })
        .map(|e| e.path())
        .collect()
}

/// What test beds left on this machine: directories, mounts, processes and
/// bridges. Empty when every bed was torn down.
pub fn leftovers() -> Vec<String> {
    let mut found = Vec::new();
    for dir in testbed_dirs() {
        found.push(format!("directory {}", dir.display()));
    }
    let marker = format!("/tmp/{TESTBED_DIR_PREFIX}");
    for mount in mount_points() {
        if mount.starts_with(&marker) {
            found.push(format!("mount {mount}"));
        }
    }
    found.extend(loop_leftovers(&marker));
    let me = std::process::id() as i32;
    for (pid, (_, cmdline)) in processes() {
        if pid != me && cmdline.contains(&marker) {
            found.push(format!("process {pid}: {cmdline}"));
        }
    }
    if let Ok(entries) = fs::read_dir("/sys/class/net") {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // Test beds' dockerd bridges, and the Docker fallback's network.
            if name.starts_with("sbtb") || name.starts_with("sbd") {
                found.push(format!("bridge {name}"));
            }
        }
    }
    found.extend(network_leftovers());
    found
}

/// The bridges of the networks on the dockerd at `socket` other than the
/// bed's own `bed_bridge`, read while it still runs.
pub(crate) fn docker_network_bridges(socket: &Path, bed_bridge: &str) -> Vec<String> {
    let host = format!("unix://{}", socket.display());
    let ids = Command::new("docker")
        .args([
            "-H",
            &host,
            "network",
            "ls",
            "-q",
            "--filter",
            "driver=bridge",
        ])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    ids.split_whitespace()
        .filter_map(|id| {
            let out = Command::new("docker")
                .args(["-H", &host, "network", "inspect", "-f"])
                .arg(r#"{{index .Options "com.docker.network.bridge.name"}}"#)
                .arg(id)
                .output()
                .ok()?;
            let name = String::from_utf8_lossy(&out.stdout).trim().to_string();
            (!name.is_empty() && name != "<no value>" && name != bed_bridge).then_some(name)
        })
        .collect()
}

/// Deletes the Docker fallback's isolation tables for `bridge` (both
/// families), if they exist.
pub(crate) fn delete_isolation_tables(bridge: &str) {
    for family in ["inet", "bridge"] {
        let _ = Command::new("nft")
            .args([
                "delete",
                "table",
                family,
                &format!("sandbolt_docker_{bridge}"),
            ])
            .stderr(Stdio::null())
            .status();
    }
}

/// What sandbox networking leaves when something was not released: network
/// namespaces still mounted (agents' prepared namespaces, test hosts), veths
/// that belong to no bridge (sandbox and test-host pairs; Docker's own veths
/// hang off its bridge), and nftables tables of agents.
fn network_leftovers() -> Vec<String> {
    let mut found = Vec::new();
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for line in mountinfo.lines() {
        let fstype = line.split(" - ").nth(1).and_then(|r| r.split(' ').next());
        let point = line.split(' ').nth(4).map(unescape_mount);
        if let (Some("nsfs"), Some(point)) = (fstype, point)
            && !point.starts_with("/run/docker/")
        {
            found.push(format!("network namespace mount {point}"));
        }
    }
    if let Ok(out) = Command::new("ip")
        .args(["-o", "-d", "link", "show", "type", "veth"])
        .output()
    {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if !line.contains(" master ") {
                let name = line.split(':').nth(1).unwrap_or(line).trim();
                found.push(format!("veth {name}"));
            }
        }
    }
    if let Ok(out) = Command::new("nft").args(["list", "tables"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if line.contains("sandbolt") {
                found.push(format!("nftables {line}"));
            }
        }
    }
    found
}

/// SIGKILLs every process whose command line mentions `dir`, and all of
/// their descendants (container processes are children of their shim).
fn kill_processes_mentioning(dir: &Path) {
    let needle = dir.to_string_lossy().into_owned();
    let me = std::process::id() as i32;
    for _round in 0..3 {
        let table = processes();
        let mut targets: HashSet<i32> = table
            .iter()
            .filter(|(pid, (_, cmd))| **pid != me && cmd.contains(&needle))
            .map(|(pid, _)| *pid)
            .collect();
        if targets.is_empty() {
            return;
        }
        let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
        for (pid, (ppid, _)) in &table {
            children.entry(*ppid).or_default().push(*pid);
        }
        let mut stack: Vec<i32> = targets.iter().copied().collect();
        while let Some(pid) = stack.pop() {
            for child in children.get(&pid).into_iter().flatten() {
                if *child != me && targets.insert(*child) {
                    stack.push(*child);
                }
            }
        }
        for pid in &targets {
            signal(*pid, libc::SIGKILL);
        }
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(5)
            && targets
                .iter()
                .any(|p| Path::new(&format!("/proc/{p}")).exists() && !is_zombie(*p))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn is_zombie(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(true)
}

/// pid → (parent pid, command line with NULs as spaces)
fn processes() -> HashMap<i32, (i32, String)> {
    let mut table = HashMap::new();
    let Ok(entries) = fs::read_dir("/proc") else {
        return table;
    };
    for e in entries.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The command name may contain spaces and parentheses: parse after
        // the last ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let cmdline = fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default();
        table.insert(pid, (ppid, cmdline));
    }
    table
}

fn mount_points() -> Vec<String> {
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(unescape_mount)
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mount(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 4 <= bytes.len()
            && let Ok(v) = u8::from_str_radix(&s[i + 1..i + 4], 8)
        {
            out.push(v);
            i += 4;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn unmount_below(dir: &Path) {
    let prefix = dir.to_string_lossy().into_owned();
    // A few rounds: unmounting one level can reveal mounts propagated below.
    for _ in 0..3 {
        let mut mounts: Vec<String> = mount_points()
            .into_iter()
            .filter(|m| m == &prefix || m.starts_with(&format!("{prefix}/")))
            .collect();
        if mounts.is_empty() {
            return;
        }
        // Deepest first.
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        for m in mounts {
            detach_mount(&m);
        }
    }
}

/// A loop device: `/dev/loopN` and the file it is backed by (as the kernel
/// reports it: ` (deleted)` appended once the file was removed).
struct LoopDevice {
    device: String,
    backing_file: String,
}

/// Every attached loop device, from sysfs (no `losetup` needed).
fn loop_devices() -> Vec<LoopDevice> {
    let Ok(entries) = fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let backing = fs::read_to_string(e.path().join("loop/backing_file")).ok()?;
            name.starts_with("loop").then(|| LoopDevice {
                device: format!("/dev/{name}"),
                backing_file: backing.trim().to_string(),
            })
        })
        .collect()
}

/// Whether `path` is `dir` or lies below it.
fn is_below(path: &str, dir: &str) -> bool {
    path == dir || path.starts_with(&format!("{}/", dir.trim_end_matches('/')))
}

/// (mount point, source device) of every mount of this mount namespace.
fn mounts_with_source() -> Vec<(String, String)> {
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let point = unescape_mount(l.split(' ').nth(4)?);
            let source = unescape_mount(l.split(" - ").nth(1)?.split(' ').nth(1)?);
            Some((point, source))
        })
        .collect()
}

/// Loop devices of test beds (their volume pools are loop-backed btrfs
/// images inside the bed's directory) and their mounts anywhere: a bed
/// that was torn down has neither.
fn loop_leftovers(marker: &str) -> Vec<String> {
    let mut found = Vec::new();
    let loops: Vec<LoopDevice> = loop_devices()
        .into_iter()
        .filter(|l| l.backing_file.starts_with(marker))
        .collect();
    for l in &loops {
        found.push(format!(
            "loop device {} backed by {}",
            l.device, l.backing_file
        ));
    }
    for (point, source) in mounts_with_source() {
        if loops.iter().any(|l| l.device == source) && !point.starts_with(marker) {
            found.push(format!("mount {point} of {source}"));
        }
    }
    found
}

/// Unmounts every mount, wherever it is, of a loop device whose image lies
/// below `dir` (an agent may mount its volumes outside the bed directory).
fn unmount_loops_below(dir: &Path) {
    let dir = dir.to_string_lossy().into_owned();
    let devices: Vec<String> = loop_devices()
        .into_iter()
        .filter(|l| is_below(&l.backing_file, &dir))
        .map(|l| l.device)
        .collect();
    if devices.is_empty() {
        return;
    }
    let mut points: Vec<String> = mounts_with_source()
        .into_iter()
        .filter(|(_, source)| devices.contains(source))
        .map(|(point, _)| point)
        .collect();
    points.sort_by_key(|m| std::cmp::Reverse(m.len()));
    for point in points {
        detach_mount(&point);
    }
}

/// Detaches the loop devices whose image lies below `dir`. One still in use
/// (a lazily unmounted filesystem someone holds) is marked to detach itself
/// when its last user goes: the kernel does that for LOOP_CLR_FD on a busy
/// device.
fn detach_loops_below(dir: &Path) {
    const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
    let dir = dir.to_string_lossy().into_owned();
    for l in loop_devices() {
        // A removed image reads "<path> (deleted)": still below `dir`.
        if !is_below(&l.backing_file, &dir) {
            continue;
        }
        let Ok(dev) = fs::File::open(&l.device) else {
            continue;
        };
        use std::os::fd::AsRawFd;
        // SAFETY: LOOP_CLR_FD takes no argument and touches no memory of ours.
        let rc = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD, 0) };
        if rc != 0 {
            tracing::debug!(device = %l.device, error = %std::io::Error::last_os_error(), "LOOP_CLR_FD failed");
        }
    }
}

fn detach_mount(m: &str) {
    let Ok(c) = std::ffi::CString::new(m) else {
        return;
    };
    // SAFETY: a valid NUL-terminated path; MNT_DETACH cannot corrupt
    // memory, at worst it fails with an errno we ignore.
    let rc = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    if rc != 0 {
        tracing::debug!(mount = %m, error = %std::io::Error::last_os_error(), "umount failed");
    }
}

fn signal(pid: i32, sig: i32) {
    if pid > 1 {
        // SAFETY: kill(2) with a positive pid only sends a signal.
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(cmd: &mut Command) {
        let out = cmd.output().expect("spawn");
        assert!(
            out.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// What the leftover check says about the loop devices of `dir` and
    /// their mounts (other beds may be running beside this test).
    fn loop_leftovers_of(dir: &Path, devices: &[String]) -> Vec<String> {
        let dir = dir.to_string_lossy().into_owned();
        let marker = format!("/tmp/{TESTBED_DIR_PREFIX}");
        loop_leftovers(&marker)
            .into_iter()
            .filter(|f| {
                f.contains(&dir) || devices.iter().any(|d| f.ends_with(&format!(" of {d}")))
            })
            .collect()
    }

    fn loops_of(dir: &Path) -> Vec<String> {
        let dir = dir.to_string_lossy().into_owned();
        loop_devices()
            .into_iter()
            .filter(|l| is_below(&l.backing_file, &dir))
            .map(|l| l.device)
            .collect()
    }

    /// A loop-backed btrfs image in a bed directory, mounted below it and
    /// bind-mounted outside it (as an agent's volume pool may be), is
    /// found by the leftover check, and cleaning the directory leaves no
    /// loop device and no mount of it anywhere.
    #[test]
    fn cleaning_a_bed_directory_detaches_its_loop_devices() {
        let dir = tempfile::Builder::new()
            .prefix(TESTBED_DIR_PREFIX)
            .tempdir_in("/tmp")
            .unwrap()
            .keep();
        let outside = tempfile::tempdir().unwrap();
        let image = dir.join("pool.img");
        let point = dir.join("volumes");
        fs::create_dir(&point).unwrap();
        run(Command::new("truncate").arg("-s").arg("256M").arg(&image));
        run(Command::new("mkfs.btrfs").arg("-q").arg(&image));
        run(Command::new("mount")
            .arg("-o")
            .arg("loop")
            .arg(&image)
            .arg(&point));
        run(Command::new("mount")
            .arg("--bind")
            .arg(&point)
            .arg(outside.path()));

        let devices = loops_of(&dir);
        let found = loop_leftovers_of(&dir, &devices);
        // Clean before any verdict, so a failing run leaves nothing either.
        clean_dir(&dir);
        assert_eq!(devices.len(), 1, "one loop device backs the image");
        assert!(
            found.iter().any(|f| f.starts_with("loop device ")),
            "{found:?}"
        );
        assert!(
            found
                .iter()
                .any(|f| f.contains(&outside.path().display().to_string())),
            "the mount outside the bed is reported: {found:?}"
        );
        assert!(!dir.exists());
        assert_eq!(loop_leftovers_of(&dir, &devices), Vec::<String>::new());
        assert!(
            !mount_points().contains(&outside.path().display().to_string()),
            "the mount outside the bed is gone"
        );
    }
}
