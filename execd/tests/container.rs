//! execd as PID 1 in real containers on the test bed (private containerd + runc):
//! the official Python SDK against it in busybox, and a shell-less image (execd plus
//! one static binary) that still runs `argv` commands and file operations.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use sandbolt_test_support::{eventually_blocking, free_port};
use sandbolt_testbed::{OciImage, Testbed, busybox_image, execd_binary};

const NS: &str = "default";

/// A task started with `ctr run -d`; killed and deleted on drop.
struct Task<'a> {
    bed: &'a Testbed,
    id: String,
}

impl Drop for Task<'_> {
    fn drop(&mut self) {
        let _ = self
            .bed
            .ctr(NS)
            .args(["tasks", "kill", "-a", "-s", "SIGKILL", &self.id])
            .output();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let out = self
                .bed
                .ctr(NS)
                .args(["tasks", "delete", "-f", &self.id])
                .output();
            if out.map(|o| o.status.success()).unwrap_or(false) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self
            .bed
            .ctr(NS)
            .args(["containers", "delete", &self.id])
            .output();
    }
}

fn check(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `image` with execd bind-mounted read-only as PID 1 on the host network, and
/// waits until its API answers.
fn start<'a>(bed: &'a Testbed, image: &str, id: &str, port: u16, entrypoint: &[&str]) -> Task<'a> {
    let execd = execd_binary().expect("static execd");
    let mount = format!(
        "type=bind,src={},dst=/opt/sandbolt/execd,options=rbind:ro",
        execd.display()
    );
    let listen = format!("127.0.0.1:{port}");
    let mut cmd = bed.ctr(NS);
    cmd.args([
        "run",
        "-d",
        "--net-host",
        "--mount",
        &mount,
        image,
        id,
        "/opt/sandbolt/execd",
        "--init",
        "--listen",
        &listen,
        "--access-token",
        "ctr-token",
        "--",
    ]);
    cmd.args(entrypoint);
    let task = Task {
        bed,
        id: id.to_string(),
    };
    check(cmd.output().expect("ctr run"), "ctr run");
    eventually_blocking(
        &format!("execd in {id} to listen on {listen}"),
        Duration::from_secs(20),
        || std::net::TcpStream::connect(&listen).ok(),
    );
    task
}

fn sdk(port: u16, root: &str, extra: &[&str]) {
    let python = sandbolt_testbed::python()
        .unwrap_or_else(|e| panic!("the Python venv with the opensandbox SDK is required: {e}"));
    let script = sandbolt_testbed::workspace_root().join("tests/python/execd_sdk.py");
    let out = Command::new(python)
        .arg(script)
        .arg(format!("127.0.0.1:{port}"))
        .arg(root)
        .args(["--token", "ctr-token"])
        .args(extra)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success() && stdout.contains(" passed, 0 failed"),
        "SDK checks failed in the container:\n{stdout}"
    );
}

fn pid1_cmdline(bed: &Testbed, id: &str) -> String {
    let out = bed.ctr(NS).args(["tasks", "ls"]).output().unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    let pid: u32 = listing
        .lines()
        .find(|l| l.starts_with(id))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|p| p.parse().ok())
        .expect("task pid");
    std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
        .unwrap()
        .replace('\0', " ")
}

#[test]
fn sdk_against_execd_as_pid1_in_busybox() {
    let bed = Testbed::start().expect("test bed");
    bed.import_image(&busybox_image().expect("busybox image"), NS)
        .expect("import busybox");
    let port = free_port();
    let id = format!("execd-bb-{port}");
    let task = start(
        &bed,
        sandbolt_testbed::BUSYBOX_REF,
        &id,
        port,
        &["sleep", "1000"],
    );
    assert!(
        pid1_cmdline(&bed, &id).starts_with("/opt/sandbolt/execd --init"),
        "execd is the task's PID 1"
    );
    sdk(port, "/tmp/sdk", &["--env-file"]);
    drop(task);
}

#[test]
fn shell_less_image_runs_argv_and_files() {
    let bed = Testbed::start().expect("test bed");
    // One static binary, no shell anywhere: busybox installed as `echo` only runs the
    // echo applet (it picks the applet from argv[0]).
    let image = OciImage::builder("docker.io/library/shellless:latest")
        .file("/bin/busybox", "/bin/echo", 0o755)
        .dir("/proc")
        .dir("/sys")
        .dir("/dev")
        .dir_mode("/tmp", 0o1777)
        .build()
        .expect("build shell-less image");
    bed.import_image(&image, NS)
        .expect("import shell-less image");
    let port = free_port();
    let id = format!("execd-noshell-{port}");
    let task = start(&bed, "docker.io/library/shellless:latest", &id, port, &[]);
    sdk(port, "/tmp/sdk", &["--no-shell"]);

    // `command` text needs a shell: a clear 400, not a hang or a crash.
    let out = Command::new("curl")
        .args([
            "-s",
            "-w",
            "\n%{http_code}",
            "-H",
            "X-EXECD-ACCESS-TOKEN: ctr-token",
            "-d",
            r#"{"command":"echo hi"}"#,
        ])
        .arg(format!("http://127.0.0.1:{port}/command"))
        .output();
    if let Ok(out) = out {
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.ends_with("\n400") && text.contains("no shell"),
            "{text}"
        );
    }
    drop(task);
}
