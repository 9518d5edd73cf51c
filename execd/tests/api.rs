//! Route-by-route edge cases against a real `execd` process on loopback.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::{Execd, frames, gone_from_proc, zombies_of};
use reqwest::StatusCode;
use sandbolt_test_support::{eventually, eventually_async};
use serde_json::{Value, json};

const TOKEN: &str = "t0ken";

fn start() -> Execd {
    Execd::start(&["--access-token", TOKEN], &[])
}

fn client() -> reqwest::Client {
    let mut h = reqwest::header::HeaderMap::new();
    h.insert("x-execd-access-token", TOKEN.parse().unwrap());
    reqwest::Client::builder()
        .default_headers(h)
        .build()
        .unwrap()
}

async fn run(e: &Execd, body: Value) -> (StatusCode, Vec<Value>) {
    let r = client().post(e.url("/command")).json(&body).fetch().await;
    let status = r.status();
    let text = r.text().await.unwrap();
    if status != StatusCode::OK {
        return (status, vec![serde_json::from_str(&text).unwrap()]);
    }
    (status, frames(&text))
}

/// The text of all frames of one stream (`stdout` or `stderr`), in order.
fn stream_text(fr: &[Value], stream: &str) -> String {
    fr.iter()
        .filter(|f| f["type"] == stream)
        .map(|f| f["text"].as_str().unwrap())
        .collect()
}

fn stdout(fr: &[Value]) -> String {
    stream_text(fr, "stdout")
}

fn stderr(fr: &[Value]) -> String {
    stream_text(fr, "stderr")
}

/// One request sent and its answer read, each in one call, so a test line says only
/// which request it makes and what it expects.
trait Fetch {
    async fn fetch(self) -> reqwest::Response;
    async fn fetch_status(self) -> StatusCode;
    async fn fetch_json(self) -> Value;
    async fn fetch_text(self) -> String;
    /// An error answer, checked to be a contract error body.
    async fn fetch_error(self) -> (StatusCode, Value);
}

impl Fetch for reqwest::RequestBuilder {
    async fn fetch(self) -> reqwest::Response {
        self.send().await.unwrap()
    }
    async fn fetch_status(self) -> StatusCode {
        self.fetch().await.status()
    }
    async fn fetch_json(self) -> Value {
        self.fetch().await.json().await.unwrap()
    }
    async fn fetch_text(self) -> String {
        self.fetch().await.text().await.unwrap()
    }
    async fn fetch_error(self) -> (StatusCode, Value) {
        error_of(self.fetch().await).await
    }
}

/// The pid a command wrote to `pidfile`.
fn read_pid(pidfile: &std::path::Path) -> i32 {
    std::fs::read_to_string(pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

async fn error_of(r: reqwest::Response) -> (StatusCode, Value) {
    let s = r.status();
    let ct = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = r.text().await.unwrap();
    assert!(
        ct.starts_with("application/json"),
        "error answer is JSON, got {ct:?}: {body}"
    );
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(v["code"].is_string() && v["message"].is_string(), "{v}");
    (s, v)
}

/// The status of an error answer (checked to be a contract error body).
async fn error_status(req: reqwest::RequestBuilder) -> StatusCode {
    req.fetch_error().await.0
}

fn pid_alive(pid: i32) -> bool {
    // A zombie still "exists" for kill(0); look at the state instead.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

/// Waits until `pid` is gone (or a zombie); `what` says whose process it is.
async fn wait_dead(pid: i32, within: Duration, what: &str) {
    eventually(what, within, || (!pid_alive(pid)).then_some(())).await
}

#[tokio::test]
async fn auth_token_required_except_ping() {
    let e = start();
    let plain = reqwest::Client::new();
    assert_eq!(plain.get(e.url("/ping")).fetch_status().await, 200);
    let (s, v) = plain.get(e.url("/metrics")).fetch_error().await;
    assert_eq!(s, 401);
    assert_eq!(v["code"], "UNAUTHORIZED");
    let wrong = plain
        .get(e.url("/metrics"))
        .header("X-EXECD-ACCESS-TOKEN", "t0kem")
        .fetch()
        .await;
    assert_eq!(wrong.status(), 401);
    assert_eq!(
        error_status(
            plain
                .post(e.url("/command"))
                .json(&json!({"command": "true"}))
        )
        .await,
        401
    );
    assert_eq!(client().get(e.url("/metrics")).fetch_status().await, 200);
}

#[tokio::test]
async fn open_when_no_token() {
    let e = Execd::start(&[], &[]);
    assert_eq!(
        reqwest::Client::new()
            .get(e.url("/metrics"))
            .fetch_status()
            .await,
        200
    );
}

#[tokio::test]
async fn foreground_frames_and_exit_codes() {
    let e = start();
    let (s, fr) = run(
        &e,
        json!({"command": "echo out; echo err >&2; printf 'no newline'"}),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(fr[0]["type"], "init");
    let id = fr[0]["text"].as_str().unwrap().to_string();
    assert_eq!(id.len(), 32);
    assert_eq!(stdout(&fr), "out\nno newline");
    assert_eq!(stderr(&fr), "err\n");
    let last = fr.last().unwrap();
    assert_eq!(last["type"], "execution_complete");
    assert!(last["execution_time"].as_i64().unwrap() >= 0);
    assert!(
        fr.iter()
            .all(|f| f["timestamp"].as_i64().unwrap() > 1_600_000_000_000)
    );

    let (_, fr) = run(&e, json!({"command": "exit 42"})).await;
    let last = fr.last().unwrap();
    assert_eq!(last["type"], "error");
    assert_eq!(last["error"]["evalue"], "42");
    assert_eq!(last["error"]["ename"], "CommandExecError");

    // Status of a finished foreground command.
    let st: Value = client()
        .get(e.url(&format!("/command/status/{id}")))
        .fetch_json()
        .await;
    assert_eq!(st["running"], false);
    assert_eq!(st["exit_code"], 0);
    assert!(st["finished_at"].is_string() && st["started_at"].is_string());
    // Its output was streamed, there are no logs.
    assert_eq!(
        error_status(client().get(e.url(&format!("/command/{id}/logs")))).await,
        400
    );
}

#[tokio::test]
async fn argv_runs_without_shell() {
    let e = start();
    let (_, fr) = run(&e, json!({"argv": ["printf", "%s|", "a b", "$HOME", "*"]})).await;
    assert_eq!(stdout(&fr), "a b|$HOME|*|");
    let (_, fr) = run(&e, json!({"argv": ["no-such-program-xyz"]})).await;
    assert_eq!(fr.last().unwrap()["error"]["evalue"], "127");
    assert!(stderr(&fr).contains("not found"));
    let (_, fr) = run(&e, json!({"argv": ["/etc/hostname"]})).await;
    assert_eq!(fr.last().unwrap()["error"]["evalue"], "126");
}

#[tokio::test]
async fn bad_command_requests_are_400() {
    let e = start();
    for body in [
        json!({}),
        json!({"command": ""}),
        json!({"command": "   "}),
        json!({"command": "true", "argv": ["true"]}),
        json!({"argv": []}),
        json!({"argv": [""]}),
        json!({"argv": ["a\u{0}b"]}),
        json!({"command": "true", "timeout": -1}),
        json!({"command": "true", "gid": 5}),
        json!({"command": "true", "uid": -1}),
        json!({"command": "true", "cwd": "/definitely/missing"}),
        json!({"command": "true", "cwd": "$UNDEFINED_VAR_X/a"}),
        json!({"command": "true", "envs": {"A=B": "x"}}),
        json!({"command": 5}),
    ] {
        let (s, v) = run(&e, body.clone()).await;
        assert_eq!(s, 400, "{body} -> {v:?}");
        assert_eq!(v[0]["code"], "INVALID_REQUEST_BODY", "{body}");
    }
    for raw in ["", "{", "[]", "null", "\"x\""] {
        assert_eq!(
            error_status(client().post(e.url("/command")).body(raw)).await,
            400,
            "{raw:?}"
        );
    }
}

#[tokio::test]
async fn cwd_envs_and_expansion() {
    let e = start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let (_, fr) = run(
        &e,
        json!({"command": "pwd; echo $FOO", "cwd": d, "envs": {"FOO": "bar", "D": d}}),
    )
    .await;
    assert_eq!(stdout(&fr), format!("{d}\nbar\n"));
    let (_, fr) = run(
        &e,
        json!({"argv": ["pwd"], "cwd": "${D}/.", "envs": {"D": d}}),
    )
    .await;
    assert_eq!(stdout(&fr), format!("{d}\n"));
    // execd's own token never reaches user processes.
    let e2 = Execd::start(&[], &[("EXECD_ACCESS_TOKEN", "secret-from-env")]);
    let r = reqwest::Client::new().get(e2.url("/metrics")).fetch().await;
    assert_eq!(r.status(), 401, "token from the environment is enforced");
    let r = reqwest::Client::new()
        .post(e2.url("/command"))
        .header("x-execd-access-token", "secret-from-env")
        .json(&json!({"command": "env"}))
        .fetch()
        .await;
    let out = stdout(&frames(&r.text().await.unwrap()));
    assert!(!out.contains("secret-from-env"), "{out}");
    assert!(out.contains("PATH="));
}

#[tokio::test]
async fn timeout_kills_process_group() {
    let e = start();
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let t = Instant::now();
    let (_, fr) = run(&e, json!({"command": format!("sleep 30 & echo $! > {}; wait", pidfile.display()), "timeout": 300})).await;
    assert!(t.elapsed() < Duration::from_secs(5));
    let last = fr.last().unwrap();
    assert_eq!(last["type"], "error");
    assert_eq!(last["error"]["evalue"], "137");
    assert!(
        last["error"]["traceback"][0]
            .as_str()
            .unwrap()
            .contains("timed out")
    );
    let pid = read_pid(&pidfile);
    wait_dead(
        pid,
        Duration::from_secs(3),
        "the background child of the group to be killed too",
    )
    .await;
}

#[tokio::test]
async fn ping_keepalives_on_long_commands() {
    let e = start();
    let (_, fr) = run(&e, json!({"command": "sleep 3.5; echo done"})).await;
    assert!(
        fr.iter()
            .any(|f| f["type"] == "ping" && f["text"] == "pong"),
        "{fr:?}"
    );
    assert_eq!(stdout(&fr), "done\n");
    assert_eq!(fr.last().unwrap()["type"], "execution_complete");
}

#[tokio::test]
async fn client_disconnect_kills_foreground_command() {
    let e = start();
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let mut resp = client()
        .post(e.url("/command"))
        .json(
            &json!({"command": format!("echo $$ > {}; echo started; sleep 30", pidfile.display())}),
        )
        .fetch()
        .await;
    // Read until the command has started, then hang up.
    let mut seen = String::new();
    while !seen.contains("started") {
        seen.push_str(&String::from_utf8_lossy(
            &resp.chunk().await.unwrap().unwrap(),
        ));
    }
    drop(resp);
    let pid = read_pid(&pidfile);
    wait_dead(pid, Duration::from_secs(5), "the command to be killed").await;
}

#[tokio::test]
async fn background_status_logs_interrupt() {
    let e = start();
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("pid");
    let (_, fr) = run(
        &e,
        json!({"command": format!("sleep 60 & echo $! > {}; echo one; echo two >&2; trap '' TERM; sleep 60", pidfile.display()), "background": true}),
    )
    .await;
    assert_eq!(fr.len(), 2, "{fr:?}");
    assert_eq!(fr[0]["type"], "init");
    assert_eq!(fr[1]["type"], "execution_complete");
    let id = fr[0]["text"].as_str().unwrap().to_string();
    let c = client();
    let deadline = Instant::now() + Duration::from_secs(5);
    let (mut text, mut cursor) = (String::new(), 0u64);
    while !(text.contains("one") && text.contains("two")) && Instant::now() < deadline {
        let r = c
            .get(e.url(&format!("/command/{id}/logs?cursor={cursor}")))
            .fetch()
            .await;
        assert_eq!(r.status(), 200);
        assert!(
            r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/plain")
        );
        cursor = r.headers()["EXECD-COMMANDS-TAIL-CURSOR"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        text.push_str(&r.text().await.unwrap());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(text.contains("one\n") && text.contains("two\n"), "{text:?}");
    // Polling at the tail returns nothing new and the same cursor.
    let r = c
        .get(e.url(&format!("/command/{id}/logs?cursor={cursor}")))
        .fetch()
        .await;
    assert_eq!(
        r.headers()["EXECD-COMMANDS-TAIL-CURSOR"].to_str().unwrap(),
        cursor.to_string()
    );
    assert_eq!(r.text().await.unwrap(), "");
    // Without a cursor: everything.
    let all = c
        .get(e.url(&format!("/command/{id}/logs")))
        .fetch_text()
        .await;
    assert_eq!(all.len() as u64, cursor);
    let st: Value = c
        .get(e.url(&format!("/command/status/{id}")))
        .fetch_json()
        .await;
    assert_eq!(st["running"], true);
    assert_eq!(st["exit_code"], Value::Null);
    assert_eq!(st["finished_at"], Value::Null);
    assert!(st["content"].as_str().unwrap().contains("sleep 60"));

    // The shell ignores SIGTERM: interrupt escalates to SIGKILL and takes the group.
    let t = Instant::now();
    assert_eq!(
        c.delete(e.url(&format!("/command?id={id}")))
            .fetch_status()
            .await,
        200
    );
    assert!(t.elapsed() < Duration::from_secs(6));
    let st: Value = c
        .get(e.url(&format!("/command/status/{id}")))
        .fetch_json()
        .await;
    assert_eq!(st["running"], false);
    assert_ne!(st["exit_code"], 0);
    let pid = read_pid(&pidfile);
    wait_dead(
        pid,
        Duration::from_secs(3),
        "the interrupted command to be killed",
    )
    .await;
    // Interrupting again is harmless.
    assert_eq!(
        c.delete(e.url(&format!("/command?id={id}")))
            .fetch_status()
            .await,
        200
    );

    assert_eq!(
        error_status(c.get(e.url(&format!("/command/{id}/logs?cursor=-1")))).await,
        400
    );
    assert_eq!(
        error_status(c.get(e.url(&format!("/command/{id}/logs?cursor=abc")))).await,
        400
    );
    assert_eq!(error_status(c.get(e.url("/command/nope/logs"))).await, 404);
    assert_eq!(
        error_status(c.get(e.url("/command/status/nope"))).await,
        404
    );
    let (s, v) = c.delete(e.url("/command")).fetch_error().await;
    assert_eq!(
        (s, v["code"].as_str().unwrap()),
        (StatusCode::BAD_REQUEST, "MISSING_QUERY")
    );
    assert_eq!(error_status(c.delete(e.url("/command?id=nope"))).await, 404);
}

#[tokio::test]
async fn background_timeout_and_exit_code() {
    let e = start();
    let c = client();
    let (_, fr) = run(&e, json!({"command": "echo x; exit 3", "background": true})).await;
    let id = fr[0]["text"].as_str().unwrap().to_string();
    let (_, fr) = run(
        &e,
        json!({"command": "sleep 30", "background": true, "timeout": 200}),
    )
    .await;
    let id2 = fr[0]["text"].as_str().unwrap().to_string();
    let finished = |id: String| {
        let (c, url) = (c.clone(), e.url(&format!("/command/status/{id}")));
        eventually_async(
            "the command to finish",
            Duration::from_secs(10),
            move || {
                let (c, url) = (c.clone(), url.clone());
                async move {
                    let st: Value = c.get(url).send().await.ok()?.json().await.ok()?;
                    (st["running"] == json!(false)).then_some(st)
                }
            },
        )
    };
    let st = finished(id).await;
    assert_eq!(
        (st["running"].clone(), st["exit_code"].clone()),
        (json!(false), json!(3))
    );
    let st = finished(id2).await;
    assert_eq!(
        (st["running"].clone(), st["exit_code"].clone()),
        (json!(false), json!(137))
    );
    assert!(st["error"].as_str().unwrap().contains("timed out"));
}

#[tokio::test]
async fn orphans_of_commands_are_reaped_in_init_mode() {
    let e = Execd::start(&["--init"], &[]);
    let c = reqwest::Client::new();
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("orphan.pid");
    let r = c
        .post(e.url("/command"))
        .json(
            &json!({"command": format!("(sleep 0.2 & echo $! > {}) ; echo ok", pidfile.display())}),
        )
        .fetch()
        .await;
    assert_eq!(stdout(&frames(&r.text().await.unwrap())), "ok\n");
    let orphan = read_pid(&pidfile);
    // Gone from /proc entirely: exited and reaped (a zombie keeps its entry).
    eventually("the orphan to be reaped", Duration::from_secs(5), || {
        gone_from_proc(orphan).then_some(())
    })
    .await;
    assert!(
        zombies_of(e.pid()).is_empty(),
        "zombies: {:?}",
        zombies_of(e.pid())
    );
}

#[tokio::test]
async fn sessions_persist_state() {
    let e = start();
    let c = client();
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("sess");
    let r = c
        .post(e.url("/session"))
        .json(&json!({"cwd": base}))
        .fetch()
        .await;
    assert_eq!(r.status(), 200);
    let sid = r.json::<Value>().await.unwrap()["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(base.is_dir(), "session cwd is created");
    let runs = |cmd: &str| {
        let c = c.clone();
        let url = e.url(&format!("/session/{sid}/run"));
        let body = json!({"command": cmd});
        async move { frames(&c.post(url).json(&body).fetch_text().await) }
    };
    let fr = runs("mkdir sub && cd sub && export A='it'\"'\"'s \"q\" $x' && export M=$(printf 'l1\\nl2') && B=unexported").await;
    assert_eq!(fr[0]["text"], sid);
    assert_eq!(fr.last().unwrap()["type"], "execution_complete", "{fr:?}");
    let fr = runs("pwd; echo \"$A\"; echo \"$M\"; echo \"[$B]\"; echo err >&2").await;
    assert_eq!(
        stdout(&fr),
        format!("{}/sub\nit's \"q\" $x\nl1\nl2\n[]\n", base.display())
    );
    assert_eq!(stderr(&fr), "err\n");
    let fr = runs("unset A; cd ..; exit 5").await;
    assert_eq!(fr.last().unwrap()["error"]["evalue"], "5");
    let fr = runs("pwd; echo \"[${A-unset}]\"").await;
    assert_eq!(stdout(&fr), format!("{}\n[unset]\n", base.display()));
    // Per-run cwd override.
    let r = c
        .post(e.url(&format!("/session/{sid}/run")))
        .json(&json!({"command": "pwd", "cwd": "/"}))
        .fetch()
        .await;
    assert_eq!(stdout(&frames(&r.text().await.unwrap())), "/\n");
    // Timeout.
    let r = c
        .post(e.url(&format!("/session/{sid}/run")))
        .json(&json!({"command": "sleep 20", "timeout": 200}))
        .fetch()
        .await;
    let fr = frames(&r.text().await.unwrap());
    assert_eq!(fr.last().unwrap()["type"], "error");
    // Delete; afterwards it is gone.
    assert_eq!(
        c.delete(e.url(&format!("/session/{sid}")))
            .fetch_status()
            .await,
        200
    );
    assert_eq!(
        error_status(
            c.post(e.url(&format!("/session/{sid}/run")))
                .json(&json!({"command": "true"}))
        )
        .await,
        404
    );
    assert_eq!(
        error_status(c.delete(e.url(&format!("/session/{sid}")))).await,
        404
    );
    // Empty body creates a session too; bad bodies are 400.
    let r = c.post(e.url("/session")).fetch().await;
    assert_eq!(r.status(), 200);
    let sid2 = r.json::<Value>().await.unwrap()["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        error_status(
            c.post(e.url(&format!("/session/{sid2}/run")))
                .json(&json!({"command": ""}))
        )
        .await,
        400
    );
    assert_eq!(
        error_status(c.post(e.url("/session")).body("{nope")).await,
        400
    );
}

#[tokio::test]
async fn session_delete_kills_running_command() {
    let e = start();
    let c = client();
    let sid = c.post(e.url("/session")).fetch_json().await["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let url = e.url(&format!("/session/{sid}/run"));
    let c2 = c.clone();
    let dir = tempfile::tempdir().unwrap();
    let started = dir.path().join("started");
    let command = format!("touch {}; sleep 30", started.display());
    let run = tokio::spawn(async move {
        c2.post(url)
            .json(&json!({"command": command}))
            .fetch_text()
            .await
    });
    eventually("the run to start", Duration::from_secs(5), || {
        started.exists().then_some(())
    })
    .await;
    let t = Instant::now();
    assert_eq!(
        c.delete(e.url(&format!("/session/{sid}")))
            .fetch_status()
            .await,
        200
    );
    let body = tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .unwrap()
        .unwrap();
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(frames(&body).last().unwrap()["type"], "error");
}

fn meta_part(path: &str, mode: Option<u32>) -> reqwest::multipart::Part {
    let mut m = json!({"path": path, "owner": null, "group": null});
    if let Some(mode) = mode {
        m["mode"] = json!(mode);
    }
    reqwest::multipart::Part::bytes(m.to_string().into_bytes())
        .file_name("metadata")
        .mime_str("application/json")
        .unwrap()
}

fn file_part(data: Vec<u8>) -> reqwest::multipart::Part {
    reqwest::multipart::Part::bytes(data)
        .file_name("f")
        .mime_str("application/octet-stream")
        .unwrap()
}

#[tokio::test]
async fn upload_download_info() {
    use std::os::unix::fs::PermissionsExt;
    let e = start();
    let c = client();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    let form = reqwest::multipart::Form::new()
        .part(
            "metadata",
            meta_part(&format!("{d}/a/b/big.bin"), Some(640)),
        )
        .part("file", file_part(big.clone()))
        .part("metadata", meta_part(&format!("{d}/small.txt"), None))
        .part("file", file_part(b"l1\nl2\nl3\nl4".to_vec()));
    let r = c.post(e.url("/files/upload")).multipart(form).fetch().await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let md = std::fs::metadata(format!("{d}/a/b/big.bin")).unwrap();
    assert_eq!(md.permissions().mode() & 0o7777, 0o640);
    assert_eq!(std::fs::read(format!("{d}/a/b/big.bin")).unwrap(), big);
    // No temporary files are left behind.
    assert_eq!(std::fs::read_dir(format!("{d}/a/b")).unwrap().count(), 1);

    let get = |q: String| c.get(e.url(&format!("/files/download?{q}")));
    let r = get(format!("path={d}/a/b/big.bin")).fetch().await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["content-length"],
        big.len().to_string().as_str()
    );
    assert!(
        r.headers()["content-disposition"]
            .to_str()
            .unwrap()
            .contains("big.bin")
    );
    assert_eq!(r.bytes().await.unwrap().as_ref(), &big[..]);
    let r = get(format!("path={d}/a/b/big.bin"))
        .header("Range", "bytes=100-199")
        .fetch()
        .await;
    assert_eq!(r.status(), 206);
    assert_eq!(
        r.headers()["content-range"],
        format!("bytes 100-199/{}", big.len()).as_str()
    );
    assert_eq!(r.bytes().await.unwrap().as_ref(), &big[100..200]);
    let r = get(format!("path={d}/a/b/big.bin"))
        .header("Range", "bytes=-10")
        .fetch()
        .await;
    assert_eq!(r.status(), 206);
    assert_eq!(r.bytes().await.unwrap().as_ref(), &big[big.len() - 10..]);
    let r = get(format!("path={d}/a/b/big.bin"))
        .header("Range", format!("bytes={}-", big.len()))
        .fetch()
        .await;
    assert_eq!(
        r.headers()["content-range"],
        format!("bytes */{}", big.len()).as_str()
    );
    let (s, v) = error_of(r).await;
    assert_eq!(s, 416, "{v}");
    let r = get(format!("path={d}/small.txt&offset=2&limit=2"))
        .fetch()
        .await;
    assert_eq!(r.text().await.unwrap(), "l2\nl3\n");
    let r = get(format!("path={d}/small.txt&offset=4")).fetch().await;
    assert_eq!(r.text().await.unwrap(), "l4");
    let r = get(format!("path={d}/small.txt&limit=1")).fetch().await;
    assert_eq!(r.text().await.unwrap(), "l1\n");
    for (q, want) in [
        (format!("path={d}/small.txt&offset=0&limit=1"), 400),
        (format!("path={d}/small.txt&limit=-3"), 400),
        (format!("path={d}/small.txt&offset=x"), 400),
        (format!("path={d}/nope"), 404),
        (format!("path={d}"), 400),
        ("path=".to_string(), 400),
        ("".to_string(), 400),
        ("path=%2Ftmp%00x".to_string(), 400),
        ("path=%E0%80".to_string(), 400),
    ] {
        let (s, v) = get(q.clone()).fetch_error().await;
        assert_eq!(s.as_u16(), want, "{q}: {v}");
    }
    assert_eq!(
        error_status(
            get(format!("path={d}/small.txt&offset=1&limit=1")).header("Range", "bytes=0-1")
        )
        .await,
        400
    );

    let info: Value = c
        .get(e.url(&format!("/files/info?path={d}/small.txt&path={d}/a")))
        .fetch_json()
        .await;
    let small = &info[format!("{d}/small.txt")];
    assert_eq!(small["size"], 11);
    assert_eq!(small["type"], "file");
    assert_eq!(small["mode"], 644);
    assert_eq!(small["owner"], "root");
    assert!(small["modified_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(info[format!("{d}/a")]["type"], "directory");
    let (s, v) = c
        .get(e.url(&format!("/files/info?path={d}/missing")))
        .fetch_error()
        .await;
    assert_eq!(
        (s.as_u16(), v["code"].as_str().unwrap()),
        (404, "FILE_NOT_FOUND")
    );
}

#[tokio::test]
async fn upload_rejects_bad_multipart() {
    let e = start();
    let c = client();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    // file without metadata
    let form = reqwest::multipart::Form::new().part("file", file_part(b"x".to_vec()));
    assert_eq!(
        error_status(c.post(e.url("/files/upload")).multipart(form)).await,
        400
    );
    // metadata without file
    let form = reqwest::multipart::Form::new().part("metadata", meta_part(&format!("{d}/x"), None));
    assert_eq!(
        error_status(c.post(e.url("/files/upload")).multipart(form)).await,
        400
    );
    // bad metadata JSON, bad mode, NUL in path, a directory as target, unknown owner
    for meta in [
        "{not json".to_string(),
        json!({"path": format!("{d}/x"), "mode": 999}).to_string(),
        json!({"path": format!("{d}/x\u{0}y")}).to_string(),
        json!({"path": d}).to_string(),
        json!({"path": format!("{d}/x"), "owner": "no-such-user-xyz"}).to_string(),
        json!({"mode": 644}).to_string(),
    ] {
        let form = reqwest::multipart::Form::new()
            .part(
                "metadata",
                reqwest::multipart::Part::bytes(meta.clone().into_bytes()).file_name("metadata"),
            )
            .part("file", file_part(b"x".to_vec()));
        let (s, v) = c
            .post(e.url("/files/upload"))
            .multipart(form)
            .fetch_error()
            .await;
        assert_eq!(s, 400, "{meta}: {v}");
    }
    // unknown part name, no parts, not multipart at all
    let form = reqwest::multipart::Form::new().part("other", file_part(b"x".to_vec()));
    assert_eq!(
        error_status(c.post(e.url("/files/upload")).multipart(form)).await,
        400
    );
    assert_eq!(
        error_status(
            c.post(e.url("/files/upload"))
                .header("content-type", "multipart/form-data; boundary=XX")
                .body("--XX--\r\n")
        )
        .await,
        400
    );
    assert_eq!(
        error_status(c.post(e.url("/files/upload")).json(&json!({"a": 1}))).await,
        400
    );
    // A body cut off in the middle of a file part: 400 and no file, no temp file.
    let body = format!(
        "--XX\r\nContent-Disposition: form-data; name=\"metadata\"; filename=\"metadata\"\r\n\r\n{}\r\n--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\r\npartial data",
        json!({"path": format!("{d}/cut.bin")})
    );
    assert_eq!(
        error_status(
            c.post(e.url("/files/upload"))
                .header("content-type", "multipart/form-data; boundary=XX")
                .body(body)
        )
        .await,
        400
    );
    // The temporary file is removed as the failed upload unwinds, which may
    // finish just after the response is written: allow it a moment.
    eventually("nothing left behind", Duration::from_secs(5), || {
        (std::fs::read_dir(&d).unwrap().count() == 0).then_some(())
    })
    .await;
}

#[tokio::test]
async fn file_management() {
    let e = start();
    let c = client();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    std::fs::create_dir_all(format!("{d}/src/deep")).unwrap();
    std::fs::write(format!("{d}/src/a.py"), "x = 'localhost'\nlocalhost\n").unwrap();
    std::fs::write(format!("{d}/src/deep/b.py"), "b").unwrap();
    std::fs::write(format!("{d}/src/c.txt"), "c").unwrap();

    let found: Value = c
        .get(e.url(&format!("/files/search?path={d}&pattern=*.py")))
        .fetch_json()
        .await;
    let paths: Vec<&str> = found
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        vec![format!("{d}/src/a.py"), format!("{d}/src/deep/b.py")]
    );
    let all: Value = c
        .get(e.url(&format!("/files/search?path={d}")))
        .fetch_json()
        .await;
    assert_eq!(all.as_array().unwrap().len(), 3);
    let rel: Value = c
        .get(e.url(&format!("/files/search?path={d}&pattern=src/*.py")))
        .fetch_json()
        .await;
    assert_eq!(rel.as_array().unwrap().len(), 1);
    assert_eq!(
        error_status(c.get(e.url(&format!("/files/search?path={d}&pattern=[a")))).await,
        400
    );
    assert_eq!(
        error_status(c.get(e.url(&format!("/files/search?path={d}/nope")))).await,
        404
    );
    assert_eq!(error_status(c.get(e.url("/files/search"))).await, 400);

    let r = c
        .post(e.url("/files/replace?verbose=true"))
        .json(&json!({format!("{d}/src/a.py"): {"old": "localhost", "new": "0.0.0.0"}}))
        .fetch()
        .await;
    let v: Value = r.json().await.unwrap();
    assert_eq!(v[format!("{d}/src/a.py")]["replacedCount"], 2);
    assert_eq!(
        std::fs::read_to_string(format!("{d}/src/a.py")).unwrap(),
        "x = '0.0.0.0'\n0.0.0.0\n"
    );
    let r = c
        .post(e.url("/files/replace"))
        .json(&json!({format!("{d}/src/c.txt"): {"old": "c", "new": "C"}}))
        .fetch()
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "");
    assert_eq!(
        error_status(
            c.post(e.url("/files/replace"))
                .json(&json!({format!("{d}/src/c.txt"): {"old": "", "new": "C"}}))
        )
        .await,
        400
    );
    assert_eq!(
        error_status(
            c.post(e.url("/files/replace"))
                .json(&json!({format!("{d}/none"): {"old": "a", "new": "C"}}))
        )
        .await,
        404
    );
    assert_eq!(
        error_status(c.post(e.url("/files/replace")).json(&json!(["not a map"]))).await,
        400
    );

    assert_eq!(
        c.post(e.url("/files/mv"))
            .json(&json!([{"src": format!("{d}/src/c.txt"), "dest": format!("{d}/c2.txt")}]))
            .fetch_status()
            .await,
        200
    );
    assert!(std::path::Path::new(&format!("{d}/c2.txt")).exists());
    assert_eq!(
        error_status(
            c.post(e.url("/files/mv"))
                .json(&json!([{"src": format!("{d}/gone"), "dest": format!("{d}/x")}]))
        )
        .await,
        404
    );
    assert_eq!(
        error_status(
            c.post(e.url("/files/mv"))
                .json(&json!([{"src": format!("{d}/c2.txt")}]))
        )
        .await,
        400
    );

    assert_eq!(
        c.post(e.url("/files/permissions"))
            .json(&json!({format!("{d}/c2.txt"): {"mode": 600, "owner": "root", "group": "0"}}))
            .fetch_status()
            .await,
        200
    );
    let info: Value = c
        .get(e.url(&format!("/files/info?path={d}/c2.txt")))
        .fetch_json()
        .await;
    assert_eq!(info[format!("{d}/c2.txt")]["mode"], 600);
    assert_eq!(
        error_status(
            c.post(e.url("/files/permissions"))
                .json(&json!({format!("{d}/c2.txt"): {"mode": 800}}))
        )
        .await,
        400
    );
    assert_eq!(
        error_status(
            c.post(e.url("/files/permissions"))
                .json(&json!({format!("{d}/zz"): {"mode": 600}}))
        )
        .await,
        404
    );

    assert_eq!(
        c.delete(e.url(&format!("/files?path={d}/c2.txt&path={d}/never-there")))
            .fetch_status()
            .await,
        200
    );
    assert!(!std::path::Path::new(&format!("{d}/c2.txt")).exists());
    assert_eq!(
        error_status(c.delete(e.url(&format!("/files?path={d}/src")))).await,
        400
    );
    assert_eq!(error_status(c.delete(e.url("/files"))).await, 400);
}

#[tokio::test]
async fn directories() {
    let e = start();
    let c = client();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    let r = c
        .post(e.url("/directories"))
        .json(&json!({format!("{d}/p/q/r"): {"mode": 700}, format!("{d}/b"): {"mode": 755}}))
        .fetch()
        .await;
    assert_eq!(r.status(), 200);
    std::fs::write(format!("{d}/p/f"), "x").unwrap();
    std::os::unix::fs::symlink(format!("{d}/p"), format!("{d}/link")).unwrap();
    let list = |q: String| c.get(e.url(&format!("/directories/list?{q}")));
    let listed_names = |v: &Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|f| f["path"].as_str().unwrap().replace(&d, ""))
            .collect()
    };
    let v: Value = list(format!("path={d}")).fetch_json().await;
    let names = listed_names(&v);
    assert_eq!(names, vec!["/b", "/link", "/p"]);
    assert_eq!(v[1]["type"], "symlink");
    let v: Value = list(format!("path={d}&depth=3")).fetch_json().await;
    let names = listed_names(&v);
    assert_eq!(names, vec!["/b", "/link", "/p", "/p/f", "/p/q", "/p/q/r"]);
    assert_eq!(v[5]["mode"], 700);
    let v: Value = list(format!("path={d}&depth=0")).fetch_json().await;
    assert_eq!(v, json!([]));
    assert_eq!(error_status(list(format!("path={d}/link"))).await, 400);
    assert_eq!(error_status(list(format!("path={d}/p/f"))).await, 400);
    assert_eq!(error_status(list(format!("path={d}/none"))).await, 404);
    assert_eq!(error_status(list(format!("path={d}&depth=-1"))).await, 400);
    assert_eq!(error_status(list(String::new())).await, 400);
    assert_eq!(
        error_status(
            c.post(e.url("/directories"))
                .json(&json!({format!("{d}/p/f/sub"): {"mode": 755}}))
        )
        .await,
        400
    );

    assert_eq!(
        c.delete(e.url(&format!("/directories?path={d}/p&path={d}/missing")))
            .fetch_status()
            .await,
        200
    );
    assert!(!std::path::Path::new(&format!("{d}/p")).exists());
    assert_eq!(
        error_status(c.delete(e.url("/directories?path=/"))).await,
        400
    );
    assert_eq!(
        error_status(c.delete(e.url(&format!("/directories?path={d}/link")))).await,
        400
    );
}

#[tokio::test]
async fn routes_errors_and_limits() {
    let e = start();
    let c = client();
    let (s, v) = c
        .post(e.url("/code"))
        .json(&json!({"code": "print(1)"}))
        .fetch_error()
        .await;
    assert_eq!(
        (s.as_u16(), v["code"].as_str().unwrap()),
        (501, "NOT_SUPPORTED")
    );
    let (s, v) = c
        .get(e.url("/code/contexts?language=python"))
        .fetch_error()
        .await;
    assert_eq!(
        (s.as_u16(), v["code"].as_str().unwrap()),
        (501, "NOT_SUPPORTED")
    );
    assert_eq!(
        error_status(c.get(e.url("/v1/isolated/capabilities"))).await,
        501
    );
    assert_eq!(error_status(c.get(e.url("/does/not/exist"))).await, 404);
    assert_eq!(error_status(c.put(e.url("/command"))).await, 405);
    assert_eq!(
        error_status(c.get(e.url("/files/info?path=%zz"))).await,
        400
    );
    // Oversized JSON body.
    let big = format!("{{\"command\": \"{}\"}}", "x".repeat(65 * 1024 * 1024));
    let r = c.post(e.url("/command")).body(big).send().await;
    if let Ok(r) = r {
        assert_eq!(error_of(r).await.0, 413);
    }
    // A request head beyond the limit is refused with 431, and execd keeps serving.
    // (hyper closes with the rest of the head unread, so the kernel may reset the
    // connection before the answer is read: try a few times.)
    let mut answers = Vec::new();
    for _ in 0..10 {
        let mut s = TcpStream::connect(&e.addr).unwrap();
        let huge = "a".repeat(70 * 1024);
        let _ = write!(s, "GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: {huge}\r\n\r\n");
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
        let text = String::from_utf8_lossy(&buf).to_string();
        if text.starts_with("HTTP/1.1 431") {
            answers.clear();
            break;
        }
        answers.push(text.chars().take(100).collect::<String>());
    }
    assert!(answers.is_empty(), "never got a 431: {answers:?}");
    // Garbage instead of HTTP.
    let mut s = TcpStream::connect(&e.addr).unwrap();
    let _ = s.write_all(b"\x16\x03\x01\x02\x00garbage\r\n\r\n");
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    assert_eq!(
        reqwest::Client::new()
            .get(e.url("/ping"))
            .fetch_status()
            .await,
        200
    );
}

#[tokio::test]
async fn metrics_and_watch() {
    let e = start();
    let c = client();
    let m: Value = c.get(e.url("/metrics")).fetch_json().await;
    for k in [
        "cpu_count",
        "cpu_used_pct",
        "mem_total_mib",
        "mem_used_mib",
        "timestamp",
    ] {
        assert!(m[k].is_number(), "{k}: {m}");
    }
    assert!(m["cpu_count"].as_f64().unwrap() > 0.0);
    assert!(m["mem_total_mib"].as_f64().unwrap() > 0.0);
    let mut r = c.get(e.url("/metrics/watch")).fetch().await;
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let mut text = String::new();
    let t = Instant::now();
    while frames_complete(&text) < 2 {
        let chunk = tokio::time::timeout(Duration::from_secs(5), r.chunk())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(t.elapsed() < Duration::from_secs(4));
    let fr = frames(&text);
    assert!(fr[0]["mem_total_mib"].as_f64().unwrap() > 0.0);
}

fn frames_complete(s: &str) -> usize {
    s.matches("\n\n").count()
}

/// A tiny upstream: answers HTTP with the request line and headers it got, and turns
/// `Upgrade` requests into a byte echo.
async fn upstream() -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if s.read(&mut b).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(b[0]);
                }
                let head = String::from_utf8_lossy(&head).to_string();
                if head.to_ascii_lowercase().contains("upgrade: websocket") {
                    s.write_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
                        .await
                        .unwrap();
                    let mut buf = [0u8; 1024];
                    loop {
                        let n = s.read(&mut buf).await.unwrap_or(0);
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                }
                let body = head.replace("\r\n", "\n");
                let resp = format!(
                    "HTTP/1.1 418 I'm a teapot\r\nContent-Type: text/plain\r\nX-Up: 1\r\nContent-Length: {}\r\n\r\n{}",
                    body.len(),
                    body
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_http_and_upgrade() {
    let e = start();
    let c = client();
    let port = upstream().await;
    let r = c
        .get(e.url(&format!("/proxy/{port}/some/path?q=1&r=a%20b")))
        .header("X-Custom", "v")
        .fetch()
        .await;
    assert_eq!(r.status(), 418, "upstream status passes through untouched");
    assert_eq!(r.headers()["x-up"], "1");
    let seen = r.text().await.unwrap();
    assert!(
        seen.starts_with("GET /some/path?q=1&r=a%20b HTTP/1.1\n"),
        "{seen}"
    );
    assert!(seen.to_ascii_lowercase().contains("x-custom: v"), "{seen}");
    assert!(
        !seen.to_ascii_lowercase().contains("x-execd-access-token"),
        "token is not forwarded: {seen}"
    );
    let r = c.get(e.url(&format!("/proxy/{port}"))).fetch().await;
    assert!(r.text().await.unwrap().starts_with("GET / HTTP/1.1"));
    // Unreachable and invalid ports.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    assert_eq!(
        error_status(c.get(e.url(&format!("/proxy/{closed}/x")))).await,
        502
    );
    assert_eq!(error_status(c.get(e.url("/proxy/0/x"))).await, 400);
    assert_eq!(error_status(c.get(e.url("/proxy/70000/x"))).await, 400);
    // Without the token the proxy is closed too.
    assert_eq!(
        reqwest::Client::new()
            .get(e.url(&format!("/proxy/{port}/x")))
            .fetch_status()
            .await,
        401
    );

    // WebSocket-style upgrade: bytes flow both ways after the 101.
    let mut s = TcpStream::connect(&e.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET /proxy/{port}/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\nX-EXECD-ACCESS-TOKEN: {TOKEN}\r\n\r\n"
    )
    .unwrap();
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut b).unwrap();
        head.push(b[0]);
    }
    assert!(
        String::from_utf8_lossy(&head).starts_with("HTTP/1.1 101"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    s.write_all(b"hello through the tunnel").unwrap();
    let mut got = [0u8; 24];
    s.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"hello through the tunnel");
}
