//! The CLI for people (`sandbolt sandbox | volume | pool`) through
//! `assert_cmd`, as a person or a script runs it, against a real `sandbolt
//! up` on the test bed's containerd: a whole sandbox round (create, ls,
//! get, exec, cp, logs, pause, resume, rm) with tables and `--json`,
//! volumes and pools, and what it says, and with which exit code, for a
//! wrong key, an unknown sandbox and an unreachable server.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use sandbolt_test_support::{Proc, free_port};
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};
use serde_json::Value;

const API_KEY: &str = "people-cli-key";

/// Starts `sandbolt up` on the bed's containerd with [`API_KEY`], serving
/// every component's metrics on `metrics`; its lifecycle URL.
fn start_up(bed: &Testbed, state: &Path, log: &Path, metrics: u16) -> (Proc, String) {
    let lifecycle = free_port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sandbolt"));
    cmd.arg("up")
        .arg("--data-dir")
        .arg(state)
        .args(["--runtime", "containerd"])
        .arg("--containerd-socket")
        .arg(bed.containerd_socket())
        .arg("--execd-bin")
        .arg(execd_binary().unwrap())
        .args(["--fastpath-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--lifecycle-listen", &format!("127.0.0.1:{lifecycle}")])
        .args(["--agent-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--proxy-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--api-key", API_KEY])
        .args(["--metrics-listen", &format!("127.0.0.1:{metrics}")])
        .env_remove("SANDBOLT_FASTPATH_TOKEN");
    let mut up = Proc::spawn("sandbolt up", &mut cmd, log);
    up.wait_for_line_blocking("sandbolt is up", Duration::from_secs(60));
    (up, format!("http://127.0.0.1:{lifecycle}"))
}

/// The CLI as a user on this machine runs it: server and key from the
/// environment, a config dir of its own (empty unless a test writes one).
struct Cli {
    server: String,
    config_home: tempfile::TempDir,
}

/// One finished command: exit code, stdout, stderr.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Cli {
    fn cmd(&self) -> assert_cmd::Command {
        let mut c = assert_cmd::Command::new(env!("CARGO_BIN_EXE_sandbolt"));
        c.env("SANDBOLT_SERVER", &self.server)
            .env("SANDBOLT_API_KEY", API_KEY)
            .env("XDG_CONFIG_HOME", self.config_home.path())
            .env_remove("SANDBOLT_CONFIG")
            .timeout(Duration::from_secs(300));
        c
    }

    fn run_cmd(mut c: assert_cmd::Command, args: &[&str]) -> Run {
        let out = c.args(args).output().unwrap();
        Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }

    fn run(&self, args: &[&str]) -> Run {
        Self::run_cmd(self.cmd(), args)
    }

    /// `args` must succeed: their stdout.
    fn ok(&self, args: &[&str]) -> String {
        let r = self.run(args);
        assert_eq!(r.code, 0, "sandbolt {args:?}: {}{}", r.stdout, r.stderr);
        r.stdout
    }

    /// `args` with `--json` must succeed: their stdout parsed.
    fn json(&self, args: &[&str]) -> Value {
        // --json is global: it may stand between the group and its command.
        let mut all = args.to_vec();
        all.insert(1, "--json");
        let out = self.ok(&all);
        serde_json::from_str(&out)
            .unwrap_or_else(|e| panic!("{all:?} printed no JSON ({e}):\n{out}"))
    }

    /// `args` must fail with exit `code` and say `says` on stderr.
    fn fails(&self, args: &[&str], code: i32, says: &[&str]) -> Run {
        let r = self.run(args);
        check_failure(&r, args, code, says);
        r
    }
}

fn check_failure(r: &Run, args: &[&str], code: i32, says: &[&str]) {
    assert_eq!(r.code, code, "sandbolt {args:?}: {}{}", r.stdout, r.stderr);
    for s in says {
        assert!(
            r.stderr.contains(s),
            "sandbolt {args:?}: stderr lacks {s:?}:\n{}",
            r.stderr
        );
    }
}

fn state_of(cli: &Cli, id: &str) -> String {
    cli.json(&["sandbox", "get", id])["status"]["state"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn the_cli_drives_sandboxes_volumes_and_pools_on_sandbolt_up() {
    let bed = Testbed::start().expect("test bed");
    bed.import_image(&busybox_image().unwrap(), "k8s.io")
        .unwrap();
    let data = tempfile::tempdir().unwrap();
    let log = data.path().join("up.log");
    let metrics = free_port();
    let (up, server) = start_up(&bed, &data.path().join("state"), &log, metrics);
    let cli = Cli {
        server,
        config_home: tempfile::tempdir().unwrap(),
    };

    let id = create_list_and_get(&cli);
    exec_streams_output_and_exits_with_the_commands_code(&cli, &id);
    cp_copies_files_both_ways(&cli, &id, data.path());
    let logs = cli.ok(&["sandbox", "logs", &id]);
    assert!(logs.contains("started-hi"), "sandbox logs:\n{logs}");
    let tail = cli.ok(&["sandbox", "logs", &id, "--tail", "5"]);
    assert!(tail.contains("started-hi"), "sandbox logs --tail:\n{tail}");
    let described = cli.json(&["sandbox", "logs", &id]);
    assert_eq!(described["kind"], "logs", "{described}");
    pause_and_resume(&cli, &id);
    wrong_keys_and_unknown_sandboxes_say_so(&cli);
    volumes_round(&cli);
    pools_round(&cli);

    a_failed_pull_names_the_image(&cli, &bed);

    assert_eq!(cli.ok(&["sandbox", "rm", &id]).trim(), id);
    cli.fails(&["sandbox", "get", &id], 3, &["not found"]);
    one_scrape_serves_every_component(metrics, data.path());

    let status = { up }.terminate(Duration::from_secs(30));
    assert!(status.success(), "sandbolt up exit {status}");
}

/// Creates the round's sandbox (it prints a line at start); its id.
fn create_list_and_get(cli: &Cli) -> String {
    let out = cli.ok(&[
        "sandbox",
        "create",
        "busybox",
        "-e",
        "GREETING=hi",
        "-m",
        "owner=cli-test",
        "--",
        "sh",
        "-c",
        "echo started-$GREETING; exec tail -f /dev/null",
    ]);
    let id = out.trim().to_string();
    assert!(
        !id.is_empty() && !id.contains('\n'),
        "create printed {out:?}"
    );

    let table = cli.ok(&["sandbox", "ls"]);
    let header = table.lines().next().unwrap();
    assert!(
        header.starts_with("ID") && header.contains("STATE"),
        "{table}"
    );
    let row = table
        .lines()
        .find(|l| l.starts_with(&id))
        .unwrap_or_else(|| panic!("{table}"));
    assert!(
        row.contains("Running") && row.contains("owner=cli-test"),
        "{row}"
    );

    let listed = cli.json(&["sandbox", "ls", "-m", "owner=cli-test"]);
    let items = listed.as_array().expect("ls --json is an array");
    assert_eq!(items.len(), 1, "{listed}");
    assert_eq!(items[0]["id"], id.as_str());
    assert_eq!(items[0]["status"]["state"], "Running");
    let none = cli.json(&["sandbox", "ls", "-m", "owner=nobody"]);
    assert_eq!(none, Value::Array(vec![]));

    let got = cli.json(&["sandbox", "get", &id]);
    assert_eq!(got["image"]["uri"], "busybox", "{got}");
    assert_eq!(got["metadata"]["owner"], "cli-test", "{got}");
    let shown = cli.ok(&["sandbox", "get", &id]);
    assert!(
        shown
            .lines()
            .any(|l| l.starts_with("state:") && l.ends_with("Running")),
        "{shown}"
    );
    id
}

fn exec_streams_output_and_exits_with_the_commands_code(cli: &Cli, id: &str) {
    let r = cli.run(&[
        "sandbox",
        "exec",
        id,
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2; exit 7",
    ]);
    assert_eq!(r.code, 7, "{}{}", r.stdout, r.stderr);
    assert_eq!((r.stdout.as_str(), r.stderr.as_str()), ("out\n", "err\n"));

    let r = cli.json(&[
        "sandbox",
        "exec",
        id,
        "-w",
        "/tmp",
        "-e",
        "X=1",
        "sh",
        "-c",
        "echo $X $PWD",
    ]);
    assert_eq!(r["exitCode"], 0, "{r}");
    assert_eq!(r["stdout"], "1 /tmp\n", "{r}");

    let r = cli.run(&["sandbox", "exec", id, "no-such-program"]);
    assert_eq!(r.code, 127, "{}{}", r.stdout, r.stderr);
}

fn cp_copies_files_both_ways(cli: &Cli, id: &str, dir: &Path) {
    let local = dir.join("blob.bin");
    let data: Vec<u8> = (0..256_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&local, &data).unwrap();
    let into = format!("{id}:/tmp/");
    cli.ok(&["sandbox", "cp", local.to_str().unwrap(), &into]);
    let size = cli.ok(&["sandbox", "exec", id, "wc", "-c", "/tmp/blob.bin"]);
    assert!(size.trim().starts_with("256000"), "{size}");

    let back = dir.join("back");
    std::fs::create_dir(&back).unwrap();
    let from = format!("{id}:/tmp/blob.bin");
    let copied = cli.json(&["sandbox", "cp", &from, back.to_str().unwrap()]);
    assert_eq!(copied["bytes"], 256_000, "{copied}");
    assert_eq!(std::fs::read(back.join("blob.bin")).unwrap(), data);

    cli.ok(&["sandbox", "exec", id, "sh", "-c", "printf hello > /tmp/h"]);
    let to_stdout = cli.ok(&["sandbox", "cp", &format!("{id}:/tmp/h"), "-"]);
    assert_eq!(to_stdout, "hello");

    let missing = format!("{id}:/tmp/none");
    cli.fails(&["sandbox", "cp", &missing, "-"], 3, &["/tmp/none"]);
    cli.fails(
        &["sandbox", "cp", "a", "b"],
        2,
        &["exactly one of SRC and DST"],
    );
}

fn pause_and_resume(cli: &Cli, id: &str) {
    assert_eq!(cli.ok(&["sandbox", "pause", id]).trim(), id);
    sandbolt_test_support::eventually_blocking("paused", Duration::from_secs(30), || {
        (state_of(cli, id) == "Paused").then_some(())
    });
    cli.fails(
        &["sandbox", "pause", id],
        1,
        &["409", "SANDBOX_INVALID_STATE"],
    );
    assert_eq!(cli.ok(&["sandbox", "resume", id]).trim(), id);
    sandbolt_test_support::eventually_blocking("running", Duration::from_secs(30), || {
        (state_of(cli, id) == "Running").then_some(())
    });
    let r = cli.ok(&["sandbox", "exec", id, "echo", "awake"]);
    assert_eq!(r, "awake\n");
}

fn wrong_keys_and_unknown_sandboxes_say_so(cli: &Cli) {
    let mut wrong = cli.cmd();
    wrong.env("SANDBOLT_API_KEY", "not-the-key");
    let args = ["sandbox", "ls"];
    let r = Cli::run_cmd(wrong, &args);
    check_failure(
        &r,
        &args,
        4,
        &["refused the API key", "INVALID_API_KEY", "--api-key"],
    );

    let mut none = cli.cmd();
    none.env_remove("SANDBOLT_API_KEY");
    let r = Cli::run_cmd(none, &args);
    check_failure(&r, &args, 4, &["needs an API key", "SANDBOLT_API_KEY"]);

    cli.fails(
        &["sandbox", "get", "no-such-sandbox"],
        3,
        &["sandbox no-such-sandbox not found", "sandbolt sandbox ls"],
    );
    cli.fails(
        &["sandbox", "exec", "no-such-sandbox", "true"],
        3,
        &["not found"],
    );
    cli.fails(&["sandbox", "logs", "no-such-sandbox"], 3, &["not found"]);
    cli.fails(
        &["sandbox", "rm", "no-such-sandbox"],
        3,
        &["not found", "1 of 1"],
    );

    // The config file gives server and key when the environment does not;
    // a flag still wins over it.
    let dir = cli.config_home.path().join("sandbolt");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("config.toml"),
        format!("server = \"{}\"\napi_key = \"{API_KEY}\"\n", cli.server),
    )
    .unwrap();
    let mut from_file = cli.cmd();
    from_file
        .env_remove("SANDBOLT_SERVER")
        .env_remove("SANDBOLT_API_KEY");
    let r = Cli::run_cmd(from_file, &args);
    assert_eq!(r.code, 0, "{}", r.stderr);
    let mut flag = cli.cmd();
    flag.env_remove("SANDBOLT_API_KEY");
    let r = Cli::run_cmd(flag, &["sandbox", "ls", "--api-key", "flag-key"]);
    check_failure(&r, &args, 4, &["refused the API key"]);
    std::fs::remove_file(dir.join("config.toml")).unwrap();
}

fn volumes_round(cli: &Cli) {
    assert_eq!(
        cli.ok(&["volume", "create", "cli-vol", "--size", "64Mi"])
            .trim(),
        "cli-vol"
    );
    let table = cli.ok(&["volume", "ls"]);
    assert!(table.lines().any(|l| l.starts_with("cli-vol ")), "{table}");
    cli.ok(&["volume", "snapshot", "cli-vol", "snap-1"]);
    let snaps = cli.json(&["volume", "snapshots", "cli-vol"]);
    assert_eq!(snaps[0]["name"], "snap-1", "{snaps}");
    let got = cli.json(&["volume", "get", "cli-vol"]);
    assert_eq!(got["size"], "64Mi", "{got}");
    cli.ok(&["volume", "rm-snapshot", "cli-vol", "snap-1"]);
    cli.ok(&["volume", "rm", "cli-vol"]);
    cli.fails(
        &["volume", "get", "cli-vol"],
        3,
        &["volume cli-vol not found", "sandbolt volume ls"],
    );
}

fn pools_round(cli: &Cli) {
    let created = cli.ok(&[
        "pool",
        "create",
        "cli-pool",
        "--image",
        "busybox",
        "--buffer-min",
        "0",
        "--buffer-max",
        "0",
        "--pool-max",
        "2",
    ]);
    assert_eq!(created.trim(), "cli-pool");
    let table = cli.ok(&["pool", "ls"]);
    assert!(table.lines().any(|l| l.starts_with("cli-pool ")), "{table}");
    cli.ok(&["pool", "resize", "cli-pool", "--pool-max", "3"]);
    let got = cli.json(&["pool", "get", "cli-pool"]);
    assert_eq!(got["capacitySpec"]["poolMax"], 3, "{got}");
    assert_eq!(got["capacitySpec"]["bufferMax"], 0, "{got}");
    cli.ok(&["pool", "rm", "cli-pool"]);
    cli.fails(
        &["pool", "get", "cli-pool"],
        3,
        &["pool cli-pool not found"],
    );
}

#[test]
fn an_unreachable_server_says_so_and_exits_5() {
    let server = format!("127.0.0.1:{}", free_port());
    let cli = Cli {
        server: server.clone(),
        config_home: tempfile::tempdir().unwrap(),
    };
    let r = cli.fails(
        &["sandbox", "ls"],
        5,
        &[
            &format!("cannot reach the lifecycle server at http://{server}"),
            "sandbolt up",
            "--server",
        ],
    );
    assert!(r.stdout.is_empty(), "{}", r.stdout);
}

#[test]
fn help_says_the_exit_codes_and_completions_generate() {
    let cli = Cli {
        server: "127.0.0.1:1".into(),
        config_home: tempfile::tempdir().unwrap(),
    };
    let help = cli.ok(&["sandbox", "--help"]);
    assert!(
        help.contains("Exit codes: 0 ok, 1 error, 2 usage"),
        "{help}"
    );
    assert!(help.contains("config.toml"), "{help}");
    let bash = cli.ok(&["completions", "bash"]);
    assert!(
        bash.contains("sandbolt") && bash.contains("sandbox"),
        "{bash}"
    );
    cli.fails(&["sandbox", "frobnicate"], 2, &["frobnicate"]);
    cli.fails(
        &["sandbox", "ls", "--config", "/nonexistent/config.toml"],
        2,
        &["cannot read the config file"],
    );
}

/// `sandbolt image pull` from a registry that is not there fails in
/// bounded time, naming the image.
fn a_failed_pull_names_the_image(cli: &Cli, bed: &Testbed) {
    let registry = format!("127.0.0.1:{}", free_port());
    let image = format!("{registry}/nothing:1");
    let socket = bed.containerd_socket().display().to_string();
    let args = [
        "image",
        "pull",
        &image,
        "--containerd-socket",
        &socket,
        "--plain-http",
        &registry,
        "--timeout",
        "30s",
    ];
    let r = cli.run(&args);
    check_failure(&r, &args, 1, &[&format!("cannot pull {image}")]);
}

/// `sandbolt up --metrics-listen`: one scrape holds the four components'
/// metrics, each gRPC family once (the controller and the agent count into
/// the same families under their own `component`), valid OpenMetrics by the
/// official Python parser; `/readyz` says ready.
fn one_scrape_serves_every_component(port: u16, dir: &Path) {
    let get = |path: &str| {
        reqwest::blocking::get(format!("http://127.0.0.1:{port}{path}"))
            .unwrap_or_else(|e| panic!("GET {path}: {e}"))
    };
    assert_eq!(get("/readyz").status(), 200);
    let body = get("/metrics").text().unwrap();
    let file = dir.join("up.metrics");
    std::fs::write(&file, &body).unwrap();
    let script = sandbolt_testbed::workspace_root().join("tests/python/metrics_families.py");
    let out = Command::new(sandbolt_testbed::python().expect("project venv"))
        .arg(script)
        .arg(format!("up={}", file.display()))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the official parser refused the scrape: {}\n{body}",
        String::from_utf8_lossy(&out.stderr)
    );
    let parsed: Value = serde_json::from_slice(&out.stdout).unwrap();
    let families = parsed["up"].as_array().unwrap();
    let calls = families
        .iter()
        .find(|f| f["name"] == "sandbolt_grpc_server_requests")
        .expect("gRPC call counts");
    for component in ["controller", "agent"] {
        assert!(
            calls["samples"]
                .as_array()
                .unwrap()
                .iter()
                .any(|s| s["labels"]["component"] == component && s["value"].as_f64() > Some(0.0)),
            "no {component} gRPC calls counted: {calls}"
        );
    }
    for prefix in [
        "sandbolt_controller_",
        "sandbolt_agent_",
        "sandbolt_janitor_",
        "sandbolt_lifecycle_",
        "sandbolt_http_",
    ] {
        assert!(
            families
                .iter()
                .any(|f| f["name"].as_str().unwrap().starts_with(prefix)),
            "no {prefix}* family in the scrape"
        );
    }
}
