//! The README's quickstart, run as written: every fenced block whose info
//! string says `quickstart` (```` ```sh quickstart ````, ```` ```python
//! quickstart ````) runs, in order, against a real `sandbolt up` on the test
//! bed's containerd, with the real tools a user has (`docker save` of the
//! bed's dockerd, `sandbolt image import`, `pip`, the official `opensandbox`
//! SDK, `curl`, `jq`). The test changes no code: it only sets the variables
//! the README's ```` ```sh quickstart-settings ```` block tells a user to
//! set, and checks that block against `sandbolt up`'s real defaults.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use sandbolt_proto::fastpath::v2 as fastpath;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use sandbolt_test_support::{Proc, eventually_blocking, free_port};
use sandbolt_testbed::{Testbed, busybox_image, execd_binary, python, workspace_root};

const API_KEY: &str = "quickstart-test-key";

/// One fenced block of the README.
#[derive(Debug)]
struct Block {
    /// The first word of the info string (`sh`, `python`).
    lang: String,
    /// The word that marks it (`quickstart`, `quickstart-settings`).
    tag: String,
    /// Line of the opening fence (1-based), for messages.
    line: usize,
    code: String,
}

fn readme_blocks() -> Vec<Block> {
    let text = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    for (i, line) in text.lines().enumerate() {
        match open.as_mut() {
            None => {
                if let Some(info) = line.strip_prefix("```") {
                    let mut words = info.split_whitespace();
                    let lang = words.next().unwrap_or("").to_string();
                    let tag = words
                        .find(|w| w.starts_with("quickstart"))
                        .unwrap_or("")
                        .to_string();
                    open = Some(Block {
                        lang,
                        tag,
                        line: i + 1,
                        code: String::new(),
                    });
                }
            }
            Some(b) => {
                if line.trim_end() == "```" {
                    let b = open.take().unwrap();
                    if !b.tag.is_empty() {
                        out.push(b);
                    }
                } else {
                    b.code.push_str(line);
                    b.code.push('\n');
                }
            }
        }
    }
    assert!(open.is_none(), "README.md has an unclosed code fence");
    out
}

/// `export NAME=value` lines (a trailing `# comment` dropped).
fn exports(code: &str) -> BTreeMap<String, String> {
    code.lines()
        .filter_map(|l| l.trim().strip_prefix("export "))
        .map(|l| {
            let l = l.split(" #").next().unwrap().trim();
            let (k, v) = l.split_once('=').expect("export NAME=value");
            (k.to_string(), v.to_string())
        })
        .collect()
}

fn require(bin: &str, package: &str) {
    assert!(
        Path::new(bin).exists(),
        "{bin} is missing: install the Debian package {package}"
    );
}

struct Up {
    proc: Proc,
    lifecycle: u16,
    fastpath: u16,
}

/// `sandbolt up` on the bed's containerd; returns once it logs that it is up.
fn start_up(bed: &Testbed, data_dir: &Path, log: PathBuf) -> Up {
    let (lifecycle, fastpath) = (free_port(), free_port());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandbolt"));
    cmd.arg("up")
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--runtime", "containerd"])
        .arg("--containerd-socket")
        .arg(bed.containerd_socket())
        .arg("--execd-bin")
        .arg(execd_binary().unwrap())
        .args(["--fastpath-listen", &format!("127.0.0.1:{fastpath}")])
        .args(["--lifecycle-listen", &format!("127.0.0.1:{lifecycle}")])
        .args(["--agent-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--proxy-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--api-key", API_KEY])
        .env_remove("SANDBOLT_FASTPATH_TOKEN");
    let mut proc = Proc::spawn("sandbolt up", &mut cmd, log);
    proc.wait_for_line_blocking("sandbolt is up", Duration::from_secs(60));
    Up {
        proc,
        lifecycle,
        fastpath,
    }
}

impl Up {
    /// SIGTERM: a clean, zero exit.
    fn stop(mut self) {
        let status = self.proc.terminate(Duration::from_secs(30));
        assert!(status.success(), "exit {status}:\n{}", self.proc.output());
    }
}

/// `ListSandboxes` on FastPath v2 with `token` (or none): the status code.
fn fastpath_list(port: u16, token: Option<&str>) -> tonic::Code {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut client = FastPathServiceClient::connect(format!("http://127.0.0.1:{port}"))
            .await
            .expect("connect to FastPath");
        let mut req = tonic::Request::new(fastpath::ListSandboxesRequest::default());
        if let Some(t) = token {
            req.metadata_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        match client.list_sandboxes(req).await {
            Ok(_) => tonic::Code::Ok,
            Err(s) => s.code(),
        }
    })
}

#[test]
fn the_readme_quickstart_runs_as_written() {
    for (bin, package) in [
        ("/usr/bin/curl", "curl"),
        ("/usr/bin/jq", "jq"),
        ("/usr/bin/docker", "docker.io"),
    ] {
        require(bin, package);
    }
    let blocks = readme_blocks();
    let settings: Vec<&Block> = blocks
        .iter()
        .filter(|b| b.tag == "quickstart-settings")
        .collect();
    assert_eq!(
        settings.len(),
        1,
        "one quickstart-settings block: {blocks:?}"
    );
    let runnable: Vec<&Block> = blocks.iter().filter(|b| b.tag == "quickstart").collect();
    assert!(
        runnable.iter().any(|b| b.lang == "python") && runnable.iter().any(|b| b.lang == "sh"),
        "the quickstart has Python and shell blocks: {blocks:?}"
    );

    // The settings block names exactly what the test sets, and its values
    // are what `sandbolt up` really uses when not told otherwise.
    let told = exports(&settings[0].code);
    assert_eq!(
        told.keys().collect::<Vec<_>>(),
        [
            "OPEN_SANDBOX_API_KEY",
            "OPEN_SANDBOX_DOMAIN",
            "SANDBOLT_DATA_DIR"
        ],
        "README line {}",
        settings[0].line
    );
    let help = Command::new(env!("CARGO_BIN_EXE_sandbolt"))
        .args(["up", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for var in ["OPEN_SANDBOX_DOMAIN", "SANDBOLT_DATA_DIR"] {
        assert!(
            help.contains(&format!("[default: {}]", told[var])),
            "README says {var}={}, `sandbolt up --help` says otherwise:\n{help}",
            told[var]
        );
    }
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    assert!(
        readme.contains(&format!(
            "./scripts/sandbolt-up.sh --api-key {}",
            told["OPEN_SANDBOX_API_KEY"]
        )),
        "OPEN_SANDBOX_API_KEY is the set-up command's key"
    );

    let venv_python = python().expect("python venv with the opensandbox SDK");
    let bed = Testbed::start_with_docker().expect("test bed with dockerd");
    // What `docker pull busybox` would have given: busybox in Docker.
    bed.docker_load(&busybox_image().unwrap()).unwrap();
    let work = tempfile::tempdir().unwrap();
    let data_dir = work.path().join("data");
    let up = start_up(&bed, &data_dir, work.path().join("up.log"));
    let cwd = work.path().join("user");
    std::fs::create_dir(&cwd).unwrap();

    let sandbolt_dir = Path::new(env!("CARGO_BIN_EXE_sandbolt")).parent().unwrap();
    let path = format!(
        "{}:{}:{}",
        venv_python.parent().unwrap().display(),
        sandbolt_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut all_stdout = String::new();
    for (i, block) in runnable.iter().enumerate() {
        let mut cmd = match block.lang.as_str() {
            "python" => {
                let file = cwd.join(format!("quickstart-{i}.py"));
                std::fs::write(&file, &block.code).unwrap();
                let mut c = Command::new(&venv_python);
                c.arg(file);
                c
            }
            "sh" => {
                let file = cwd.join(format!("quickstart-{i}.sh"));
                std::fs::write(&file, &block.code).unwrap();
                // As strict as a careful user: any failing step fails.
                let mut c = Command::new("bash");
                c.args(["-euo", "pipefail"]).arg(file);
                c
            }
            other => panic!("README line {}: no way to run a {other} block", block.line),
        };
        let out = cmd
            .current_dir(&cwd)
            .env("PATH", &path)
            .env("OPEN_SANDBOX_DOMAIN", format!("127.0.0.1:{}", up.lifecycle))
            .env("OPEN_SANDBOX_API_KEY", API_KEY)
            .env("SANDBOLT_DATA_DIR", &data_dir)
            // Where this machine's containerd and Docker are for the bed
            // (a user's are at the defaults).
            .env("SANDBOLT_CONTAINERD_SOCKET", bed.containerd_socket())
            .env(
                "DOCKER_HOST",
                format!("unix://{}", bed.docker_socket().unwrap().display()),
            )
            .env_remove("SANDBOLT_LOG")
            .env_remove("SANDBOLT_API_KEY")
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "README block at line {} ({}) failed ({}):\n{}\n--- stdout ---\n{stdout}\n--- stderr ---\n{}\n--- sandbolt up log ---\n{}",
            block.line,
            block.lang,
            out.status,
            block.code,
            String::from_utf8_lossy(&out.stderr),
            up.proc.output()
        );
        all_stdout.push_str(&stdout);
    }

    // What the blocks say they print, they printed.
    let count = |s: &str| all_stdout.matches(s).count();
    assert!(
        all_stdout.contains("docker.io/library/busybox:latest"),
        "{all_stdout}"
    );
    assert!(
        count("hello from sb-") >= 2,
        "Python and curl ran a command:\n{all_stdout}"
    );
    assert!(
        count("hello, sandbolt") >= 4,
        "Python and curl read the file back and fetched it from httpd:\n{all_stdout}"
    );
    assert!(all_stdout.contains("200 hello, sandbolt"), "{all_stdout}");
    assert!(all_stdout.contains("\nRunning\n"), "{all_stdout}");
    // The token the README shows how to read opens FastPath (and only it does).
    let token = std::fs::read_to_string(data_dir.join("fastpath-token")).unwrap();
    assert!(
        all_stdout.lines().any(|l| l == token.trim()),
        "the token block printed the token:\n{all_stdout}"
    );
    assert_eq!(
        fastpath_list(up.fastpath, Some(token.trim())),
        tonic::Code::Ok
    );
    assert_eq!(
        fastpath_list(up.fastpath, None),
        tonic::Code::Unauthenticated
    );

    // Both examples killed their sandboxes: no container is left.
    eventually_blocking(
        "no container left after the quickstart killed its sandboxes",
        Duration::from_secs(30),
        || {
            let out = bed
                .ctr("k8s.io")
                .args(["containers", "list", "-q"])
                .output()
                .unwrap();
            (out.status.success() && String::from_utf8_lossy(&out.stdout).trim().is_empty())
                .then_some(())
        },
    );
    up.stop();
}
