//! `--warm` and `POST /sandbolt/claim` against the real `execd` binary: the claim swaps
//! token, environment and working directory, starts the entrypoint as a cold start would,
//! and succeeds exactly once.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Execd, frames};
use reqwest::StatusCode;
use sandbolt_test_support::eventually;
use serde_json::{Value, json};

const WARM: &str = "warm-t0ken";
const HEADER: &str = "x-execd-access-token";

/// `execd --init --exit-with-entrypoint --warm` with the warm token in its environment (as
/// the agent starts it) and a variable only the warm environment has.
fn start_warm() -> Execd {
    Execd::start(
        &["--init", "--exit-with-entrypoint", "--warm"],
        &[
            ("EXECD_ACCESS_TOKEN", WARM),
            ("WARM_ONLY", "from-warm-start"),
        ],
    )
}

fn path_var() -> String {
    std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into())
}

/// A claim body: `sh -c SCRIPT` as the entrypoint, `env` plus PATH and the new token.
fn claim_body(token: &str, env: &[(&str, &str)], script: &str, dir: Option<&Path>) -> Value {
    let mut vars = vec![
        format!("PATH={}", path_var()),
        format!("EXECD_ACCESS_TOKEN={token}"),
    ];
    vars.extend(env.iter().map(|(k, v)| format!("{k}={v}")));
    let mut body = json!({
        "accessToken": token,
        "env": vars,
        "command": ["sh", "-c", script],
    });
    if let Some(d) = dir {
        body["workingDir"] = json!(d);
    }
    body
}

async fn claim(e: &Execd, token: &str, body: &Value) -> (StatusCode, Value) {
    let r = reqwest::Client::new()
        .post(e.url("/sandbolt/claim"))
        .header(HEADER, token)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status();
    (status, r.json().await.unwrap())
}

/// Status of an authenticated request that succeeds with any valid token.
async fn probe(e: &Execd, token: &str) -> StatusCode {
    reqwest::Client::new()
        .get(e.url("/files/info?path=/"))
        .header(HEADER, token)
        .send()
        .await
        .unwrap()
        .status()
}

/// Runs `script` with `POST /command`; its stdout.
async fn run(e: &Execd, token: &str, script: &str) -> String {
    let r = reqwest::Client::new()
        .post(e.url("/command"))
        .header(HEADER, token)
        .json(&json!({ "command": script }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let text = r.text().await.unwrap();
    frames(&text)
        .iter()
        .filter(|f| f["type"] == "stdout")
        .map(|f| f["text"].as_str().unwrap().to_string())
        .collect()
}

/// Waits for the file the entrypoint writes when done (written then renamed: whole).
async fn read_when_written(path: &Path) -> String {
    eventually("the entrypoint's file", Duration::from_secs(10), || {
        std::fs::read_to_string(path).ok()
    })
    .await
}

/// A script writing its working directory and environment to `$OUT`, then sleeping.
const REPORT_AND_WAIT: &str =
    "{ pwd; env; } > \"$OUT.tmp\" && mv \"$OUT.tmp\" \"$OUT\"; exec sleep 100";

#[tokio::test]
async fn claim_swaps_token_env_and_working_directory() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("entrypoint.out");
    // Missing: created, as runc creates a missing working directory.
    let work = dir.path().join("app/work");
    let e = start_warm();

    // Warm: the warm token works, nothing else does.
    assert_eq!(probe(&e, WARM).await, StatusCode::OK);
    assert_eq!(probe(&e, "user-t0ken").await, StatusCode::UNAUTHORIZED);
    let warm_out = run(&e, WARM, "echo $WARM_ONLY").await;
    assert_eq!(warm_out, "from-warm-start\n");

    let body = claim_body(
        "user-t0ken",
        &[("OUT", out.to_str().unwrap()), ("CLAIMED", "yes")],
        REPORT_AND_WAIT,
        Some(&work),
    );
    let (status, answer) = claim(&e, WARM, &body).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let pid = answer["pid"].as_i64().expect("pid") as i32;
    assert_eq!(answer.as_object().unwrap().len(), 1, "{answer}");

    // The entrypoint runs as execd's child in the claimed env and working directory.
    let report = read_when_written(&out).await;
    let mut lines = report.lines();
    assert_eq!(lines.next(), Some(work.to_str().unwrap()), "{report}");
    let env: Vec<&str> = lines.collect();
    assert!(env.contains(&"CLAIMED=yes"), "{report}");
    assert!(env.contains(&"EXECD_ENVS=/opt/sandbolt/.env"), "{report}");
    assert!(!report.contains("WARM_ONLY"), "warm env leaked: {report}");
    assert!(
        !report.contains("EXECD_ACCESS_TOKEN"),
        "token leaked: {report}"
    );
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let ppid: i32 = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(ppid, e.pid(), "the entrypoint is execd's child");

    // The warm token stopped working; the new one works.
    assert_eq!(probe(&e, WARM).await, StatusCode::UNAUTHORIZED);
    assert_eq!(probe(&e, "user-t0ken").await, StatusCode::OK);
    let (status, _) = claim(&e, WARM, &body).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "a replayed warm claim");

    // Later commands and sessions start from the claimed env, in the working directory.
    let got = run(
        &e,
        "user-t0ken",
        "pwd; echo $CLAIMED/$WARM_ONLY/$EXECD_ACCESS_TOKEN",
    )
    .await;
    assert_eq!(got, format!("{}\nyes//\n", work.display()));
    let c = reqwest::Client::new();
    let sid = c
        .post(e.url("/session"))
        .header(HEADER, "user-t0ken")
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap()["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    let text = c
        .post(e.url(&format!("/session/{sid}/run")))
        .header(HEADER, "user-t0ken")
        .json(&json!({ "command": "pwd; echo $CLAIMED" }))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let session_out: String = frames(&text)
        .iter()
        .filter(|f| f["type"] == "stdout")
        .map(|f| f["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(session_out, format!("{}\nyes\n", work.display()));

    // Claimed once: the new token cannot claim again.
    let again = claim_body("third", &[], "exit 0", None);
    let (status, answer) = claim(&e, "user-t0ken", &again).await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    assert_eq!(answer["code"], "ALREADY_CLAIMED");
    assert_eq!(
        probe(&e, "user-t0ken").await,
        StatusCode::OK,
        "a refused claim changes nothing"
    );
}

/// Sends a claim's head now and returns a function that sends its body and reads the
/// answer: every claimant is past authentication (which reads only the head) before any
/// body arrives, so the claims really race inside the handler.
async fn claim_in_two_steps(e: &Execd, body: &Value) -> impl AsyncFnOnce() -> (u16, Value) + use<> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = serde_json::to_vec(body).unwrap();
    let mut s = tokio::net::TcpStream::connect(&e.addr).await.unwrap();
    let head = format!(
        "POST /sandbolt/claim HTTP/1.1\r\nHost: x\r\n{HEADER}: {WARM}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    async move || {
        s.write_all(&body).await.unwrap();
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).await.unwrap();
        let text = String::from_utf8_lossy(&answer);
        let status = text[9..12].parse().unwrap();
        let json = text.split_once("\r\n\r\n").unwrap().1;
        (status, serde_json::from_str(json).unwrap_or(Value::Null))
    }
}

#[tokio::test]
async fn concurrent_claims_exactly_one_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let e = start_warm();
    let n = 24;
    let mut pending = Vec::new();
    for i in 0..n {
        let out = dir.path().join(format!("claimant-{i}"));
        let body = claim_body(
            &format!("token-{i}"),
            &[("OUT", out.to_str().unwrap())],
            REPORT_AND_WAIT,
            None,
        );
        pending.push(claim_in_two_steps(&e, &body).await);
    }
    // Every head read and authenticated with the warm token.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let answers = futures::future::join_all(pending.into_iter().map(|f| f())).await;
    let winners: Vec<usize> = (0..n).filter(|&i| answers[i].0 == 200).collect();
    assert_eq!(winners.len(), 1, "{answers:?}");
    for (status, answer) in &answers {
        assert!(
            *status == 200 || (*status == 409 && answer["code"] == "ALREADY_CLAIMED"),
            "{status}: {answer}"
        );
    }
    let winner = winners[0];
    read_when_written(&dir.path().join(format!("claimant-{winner}"))).await;
    // Only the winner's entrypoint ran, only the winner's token works.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let written: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|d| d.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(written, vec![format!("claimant-{winner}")]);
    for i in 0..n {
        let want = if i == winner {
            StatusCode::OK
        } else {
            StatusCode::UNAUTHORIZED
        };
        assert_eq!(probe(&e, &format!("token-{i}")).await, want, "token-{i}");
    }
    assert_eq!(probe(&e, WARM).await, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn execd_exits_with_the_claimed_entrypoint() {
    let mut e = start_warm();
    let (status, answer) = claim(&e, WARM, &claim_body("t2", &[], "sleep 0.3; exit 7", None)).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(e.wait_exit(Duration::from_secs(10)), Some(7));

    // Killed by a signal: 128 + signal, as on a cold start.
    let mut e = start_warm();
    let (status, _) = claim(&e, WARM, &claim_body("t2", &[], "kill -9 $$", None)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(e.wait_exit(Duration::from_secs(10)), Some(137));
}

#[tokio::test]
async fn signals_reach_the_claimed_entrypoint() {
    let dir = tempfile::tempdir().unwrap();
    let ready = dir.path().join("traps-set");
    let mut e = start_warm();
    let script = "trap 'exit 9' TERM; touch \"$R\"; while :; do sleep 0.05; done";
    let body = claim_body("t2", &[("R", ready.to_str().unwrap())], script, None);
    let (status, _) = claim(&e, WARM, &body).await;
    assert_eq!(status, StatusCode::OK);
    eventually("the entrypoint's trap", Duration::from_secs(5), || {
        ready.exists().then_some(())
    })
    .await;
    // SAFETY: plain syscall on our own child.
    unsafe { libc::kill(e.pid(), libc::SIGTERM) };
    assert_eq!(e.wait_exit(Duration::from_secs(5)), Some(9));
}

#[tokio::test]
async fn sigterm_before_any_claim_exits_0() {
    let mut e = start_warm();
    assert_eq!(probe(&e, WARM).await, StatusCode::OK);
    // SAFETY: plain syscall on our own child.
    unsafe { libc::kill(e.pid(), libc::SIGTERM) };
    assert_eq!(e.wait_exit(Duration::from_secs(5)), Some(0));
}

#[tokio::test]
async fn malformed_claim_is_400_naming_the_field_and_stays_warm() {
    let dir = tempfile::tempdir().unwrap();
    let e = start_warm();
    let cases = [
        (json!({"env": [], "command": ["true"]}), "accessToken"),
        (
            json!({"accessToken": "t2", "env": ["PATH=/bin", "NOEQUALS"], "command": ["true"]}),
            "env[1]",
        ),
        (
            json!({"accessToken": "t2", "env": [], "command": []}),
            "command",
        ),
        (
            json!({"accessToken": "t2", "env": [], "command": ["true"], "workingDir": "rel/dir"}),
            "workingDir",
        ),
        (
            json!({"accessToken": "t2", "env": [], "command": ["true"], "entrypoint": ["x"]}),
            "entrypoint",
        ),
    ];
    for (body, field) in cases {
        let (status, answer) = claim(&e, WARM, &body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        assert_eq!(answer["code"], "INVALID_REQUEST_BODY", "{answer}");
        let message = answer["message"].as_str().unwrap();
        assert!(message.contains(&format!("{field}:")), "{body}: {message}");
    }
    let r = reqwest::Client::new()
        .post(e.url("/sandbolt/claim"))
        .header(HEADER, WARM)
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);

    // Nothing changed: the warm token still works and a good claim still succeeds.
    assert_eq!(probe(&e, WARM).await, StatusCode::OK);
    let out = dir.path().join("out");
    let body = claim_body(
        "t2",
        &[("OUT", out.to_str().unwrap())],
        REPORT_AND_WAIT,
        None,
    );
    let (status, answer) = claim(&e, WARM, &body).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    read_when_written(&out).await;
}

#[tokio::test]
async fn spawn_failure_is_500_and_execd_exits_as_a_cold_start_would() {
    let mut e = start_warm();
    let body = json!({
        "accessToken": "t2",
        "env": [format!("PATH={}", path_var())],
        "command": ["/no/such/program"],
    });
    let (status, answer) = claim(&e, WARM, &body).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{answer}");
    assert_eq!(answer["code"], "SPAWN_FAILED");
    assert!(
        answer["message"]
            .as_str()
            .unwrap()
            .contains("/no/such/program"),
        "{answer}"
    );
    assert_eq!(e.wait_exit(Duration::from_secs(10)), Some(127));

    // A working directory that cannot be made: 126.
    let mut e = start_warm();
    let file = tempfile::NamedTempFile::new().unwrap();
    let under_a_file: PathBuf = file.path().join("sub");
    let (status, answer) = claim(
        &e,
        WARM,
        &claim_body("t2", &[], "true", Some(&under_a_file)),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{answer}");
    assert_eq!(answer["code"], "SPAWN_FAILED");
    assert_eq!(e.wait_exit(Duration::from_secs(10)), Some(126));
}

#[tokio::test]
async fn claim_without_warm_mode_is_409() {
    let e = Execd::start(&["--access-token", "t"], &[]);
    let (status, answer) = claim(&e, "t", &claim_body("t2", &[], "true", None)).await;
    assert_eq!(status, StatusCode::CONFLICT, "{answer}");
    assert_eq!(answer["code"], "NOT_WARM");
    let (status, _) = claim(&e, "wrong", &claim_body("t2", &[], "true", None)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(probe(&e, "t").await, StatusCode::OK, "token unchanged");
}

#[test]
fn warm_with_an_entrypoint_is_a_usage_error() {
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_execd"))
            .args(args)
            .output()
            .unwrap()
    };
    let out = run(&["--listen", "127.0.0.1:0", "--warm", "--", "sleep", "1"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--warm takes no ENTRYPOINT"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let help = run(&["--help"]);
    assert_eq!(help.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&help.stdout).contains("--warm"));
}
