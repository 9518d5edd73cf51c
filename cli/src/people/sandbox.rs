//! `sandbolt sandbox …`: create, list, inspect, pause, resume and remove
//! sandboxes; read their logs; run commands and copy files (see
//! [`super::execd`]).

use std::time::{Duration, Instant};

use anyhow::Context;
use reqwest::Method;
use serde_json::{Map, Value, json};

use super::client::{Lifecycle, Target, show_one};
use super::config::ClientArgs;
use super::output::{
    Table, age, field, pairs, print_done, print_fields, print_json, spinner, until,
};
use super::{CLIENT_HELP, Exit, Failure, execd};

const LIST: &str = "sandbolt sandbox ls";

/// The program a sandbox runs when the create names none: it keeps the
/// sandbox up for `exec` and `cp` (the contract's default too).
const DEFAULT_ENTRYPOINT: [&str; 3] = ["tail", "-f", "/dev/null"];

#[derive(Debug, clap::Args)]
#[command(after_long_help = CLIENT_HELP)]
pub(crate) struct SandboxArgs {
    #[command(flatten)]
    client: ClientArgs,
    #[command(subcommand)]
    command: SandboxCommand,
}

#[derive(Debug, clap::Subcommand)]
enum SandboxCommand {
    /// Create a sandbox, wait until it runs, and print its id.
    #[command(after_long_help = CLIENT_HELP)]
    Create(CreateArgs),
    /// List sandboxes (every page).
    #[command(alias = "list", after_long_help = CLIENT_HELP)]
    Ls(ListArgs),
    /// Show one sandbox.
    #[command(after_long_help = CLIENT_HELP)]
    Get { id: String },
    /// Run a program in a sandbox, streaming its output; exits with its
    /// exit code.
    #[command(after_long_help = CLIENT_HELP)]
    Exec(execd::ExecArgs),
    /// Copy one file into or out of a sandbox: `SRC DST`, the sandbox side
    /// written `ID:/path` (`-` for stdin or stdout on the local side).
    #[command(after_long_help = CLIENT_HELP)]
    Cp(execd::CpArgs),
    /// Print a sandbox's log: what its main program wrote to stdout and
    /// stderr (the server bounds it and says when it cut it).
    #[command(after_long_help = CLIENT_HELP)]
    Logs(LogsArgs),
    /// Freeze a running sandbox.
    #[command(after_long_help = CLIENT_HELP)]
    Pause { id: String },
    /// Thaw a paused sandbox.
    #[command(after_long_help = CLIENT_HELP)]
    Resume { id: String },
    /// Remove sandboxes (all that are named, even when one fails).
    #[command(alias = "delete", after_long_help = CLIENT_HELP)]
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
}

#[derive(Debug, clap::Args)]
struct CreateArgs {
    /// Image to run (`busybox:1.36`); may be left out with --pool, whose
    /// template names one.
    #[arg(required_unless_present = "pool")]
    image: Option<String>,
    /// The program the sandbox runs, after `--` [default: tail -f
    /// /dev/null, which keeps it up for exec]
    #[arg(last = true)]
    entrypoint: Vec<String>,
    /// Warm pool to take the sandbox from (see `sandbolt pool`).
    #[arg(long)]
    pool: Option<String>,
    /// Environment variable of the sandbox (repeatable).
    #[arg(long = "env", short = 'e', value_name = "NAME=VALUE", value_parser = key_value)]
    env: Vec<(String, String)>,
    /// Metadata to tag the sandbox with (repeatable; `ls -m` filters).
    #[arg(long = "metadata", short = 'm', value_name = "KEY=VALUE", value_parser = key_value)]
    metadata: Vec<(String, String)>,
    /// CPU limit (`500m`, `2`).
    #[arg(long)]
    cpu: Option<String>,
    /// Memory limit (`512Mi`, `2Gi`).
    #[arg(long)]
    memory: Option<String>,
    /// Remove the sandbox this long after it is created (`10m`, `2h`)
    /// [default: never: it stays until `sandbolt sandbox rm`]
    #[arg(long, value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
    /// Mount named volume NAME at PATH (repeatable; see `sandbolt volume`).
    #[arg(long = "volume", short = 'v', value_name = "NAME:PATH[:ro]", value_parser = volume_mount)]
    volumes: Vec<Value>,
    /// Print the id once the server accepted the create, without waiting
    /// for the sandbox to run.
    #[arg(long)]
    no_wait: bool,
    /// Longest wait for the sandbox to run (the node may pull its image
    /// first).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    wait_timeout: Duration,
}

#[derive(Debug, clap::Args)]
struct ListArgs {
    /// Only sandboxes in this state (repeatable: any of them), e.g.
    /// Running, Paused.
    #[arg(long)]
    state: Vec<String>,
    /// Only sandboxes with this metadata (repeatable: all of them).
    #[arg(long = "metadata", short = 'm', value_name = "KEY=VALUE", value_parser = key_value)]
    metadata: Vec<(String, String)>,
}

#[derive(Debug, clap::Args)]
struct LogsArgs {
    id: String,
    /// The last this many lines, at most 10000 (--json gives the API's
    /// descriptor of the last 100 instead) [default: 100]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    tail: Option<u32>,
    /// Only what was written this recently (`10m`, `1h`); servers whose
    /// log has no timestamps (sandbolt's containerd runtime) refuse it.
    #[arg(long, value_parser = humantime::parse_duration)]
    since: Option<Duration>,
}

/// `NAME=VALUE`.
pub(crate) fn key_value(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not NAME=VALUE")),
    }
}

/// `NAME:PATH[:ro]` as the create request's `volumes` entry of a named
/// volume.
fn volume_mount(s: &str) -> Result<Value, String> {
    let (name, rest) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not NAME:PATH[:ro]"))?;
    let (path, read_only) = match rest.strip_suffix(":ro") {
        Some(p) => (p, true),
        None => (rest.strip_suffix(":rw").unwrap_or(rest), false),
    };
    if name.is_empty() || !path.starts_with('/') {
        return Err(format!("{s:?}: want NAME:PATH[:ro] with an absolute PATH"));
    }
    Ok(json!({
        "name": name,
        "mountPath": path,
        "readOnly": read_only,
        "pvc": {"claimName": name},
    }))
}

pub(crate) async fn run(args: SandboxArgs) -> anyhow::Result<()> {
    let lc = Lifecycle::new(args.client.connection()?)?;
    let json = args.client.json;
    match args.command {
        SandboxCommand::Create(a) => create(&lc, a, json).await,
        SandboxCommand::Ls(a) => list(&lc, &a, json).await,
        SandboxCommand::Get { id } => {
            Ok(show_one(&lc, &format!("/sandboxes/{id}"), &target(&id), json, show).await?)
        }
        SandboxCommand::Exec(a) => execd::exec(&lc, a, json).await,
        SandboxCommand::Cp(a) => execd::copy(&lc, a, json).await,
        SandboxCommand::Logs(a) => logs(&lc, &a, json).await,
        SandboxCommand::Pause { id } => change(&lc, &id, "pause", json).await,
        SandboxCommand::Resume { id } => change(&lc, &id, "resume", json).await,
        SandboxCommand::Rm { ids } => remove(&lc, &ids, json).await,
    }
}

pub(crate) fn target(id: &str) -> Target<'static> {
    Target::new(format!("sandbox {id}"), LIST)
}

/// The create request the flags describe.
fn create_body(a: &CreateArgs) -> Value {
    let strings = |pairs: &[(String, String)]| -> Map<String, Value> {
        pairs
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect()
    };
    let mut body = Map::new();
    if let Some(image) = &a.image {
        body.insert("image".into(), json!({"uri": image}));
        let entrypoint: Vec<String> = if a.entrypoint.is_empty() {
            DEFAULT_ENTRYPOINT.iter().map(|s| s.to_string()).collect()
        } else {
            a.entrypoint.clone()
        };
        body.insert("entrypoint".into(), json!(entrypoint));
    } else if !a.entrypoint.is_empty() {
        body.insert("entrypoint".into(), json!(a.entrypoint));
    }
    let mut limits = Map::new();
    if let Some(cpu) = &a.cpu {
        limits.insert("cpu".into(), json!(cpu));
    }
    if let Some(memory) = &a.memory {
        limits.insert("memory".into(), json!(memory));
    }
    body.insert("resourceLimits".into(), Value::Object(limits));
    for (key, v) in [("env", &a.env), ("metadata", &a.metadata)] {
        if !v.is_empty() {
            body.insert(key.into(), Value::Object(strings(v)));
        }
    }
    if let Some(t) = a.timeout {
        body.insert("timeout".into(), json!(t.as_secs().max(1)));
    }
    if !a.volumes.is_empty() {
        body.insert("volumes".into(), json!(a.volumes));
    }
    if let Some(pool) = &a.pool {
        body.insert("extensions".into(), json!({"poolRef": pool}));
    }
    Value::Object(body)
}

async fn create(lc: &Lifecycle, a: CreateArgs, json: bool) -> anyhow::Result<()> {
    let what = match (&a.image, &a.pool) {
        (Some(image), _) => format!("a sandbox of {image}"),
        (None, Some(pool)) => format!("a sandbox of pool {pool}"),
        (None, None) => "a sandbox".to_string(),
    };
    let created = lc
        .json(
            Method::POST,
            "/sandboxes",
            Some(&create_body(&a)),
            &Target::new(format!("creating {what}"), LIST),
        )
        .await?;
    let id = created
        .get("id")
        .and_then(Value::as_str)
        .context("the server's create answer has no id")?
        .to_string();
    let shown = if a.no_wait {
        created
    } else {
        wait_running(lc, &id, a.wait_timeout).await?
    };
    if json {
        print_json(&shown);
    } else {
        println!("{id}");
    }
    Ok(())
}

/// Polls the sandbox until it runs; a sandbox that failed or vanished, or
/// one still not running after `limit`, is an error that says what to
/// look at. (A wait for a state, not a retry: nothing failed yet.)
async fn wait_running(lc: &Lifecycle, id: &str, limit: Duration) -> anyhow::Result<Value> {
    let bar = spinner(format!("waiting for sandbox {id} to run"));
    let started = Instant::now();
    let result = loop {
        let sandbox = match lc.get(&format!("/sandboxes/{id}"), &target(id)).await {
            Ok(s) => s,
            Err(e) => break Err(e),
        };
        let state = field(&sandbox, "/status/state");
        match state.as_str() {
            "Running" => break Ok(sandbox),
            "Failed" | "Terminated" | "Stopping" => {
                break Err(Failure::new(
                    Exit::Error,
                    format!(
                        "sandbox {id} is {state} ({}: {}); `sandbolt sandbox logs {id}` shows \
                         its output",
                        field(&sandbox, "/status/reason"),
                        field(&sandbox, "/status/message")
                    ),
                ));
            }
            _ if started.elapsed() >= limit => {
                break Err(Failure::new(
                    Exit::Error,
                    format!(
                        "sandbox {id} is still {state} after {}; `sandbolt sandbox get {id}` \
                         shows why, or wait longer with --wait-timeout",
                        humantime::format_duration(limit)
                    ),
                ));
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    };
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(result?)
}

/// `k=v` percent-encoded for a query string.
fn query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Every page of `GET /sandboxes` with the filters of `a`.
async fn all_sandboxes(lc: &Lifecycle, a: &ListArgs) -> Result<Vec<Value>, Failure> {
    let mut filters: Vec<String> = a
        .state
        .iter()
        .map(|s| format!("state={}", query_escape(s)))
        .collect();
    if !a.metadata.is_empty() {
        let m: Vec<String> = a.metadata.iter().map(|(k, v)| format!("{k}={v}")).collect();
        filters.push(format!("metadata={}", query_escape(&m.join("&"))));
    }
    let mut items = Vec::new();
    for page in 1.. {
        let mut query = filters.clone();
        query.push(format!("page={page}&pageSize=200"));
        let answer = lc
            .get(
                &format!("/sandboxes?{}", query.join("&")),
                &Target::new("the sandbox list", LIST),
            )
            .await?;
        if let Some(page_items) = answer.get("items").and_then(Value::as_array) {
            items.extend(page_items.iter().cloned());
        }
        if answer.pointer("/pagination/hasNextPage") != Some(&Value::Bool(true)) {
            break;
        }
    }
    Ok(items)
}

async fn list(lc: &Lifecycle, a: &ListArgs, json: bool) -> anyhow::Result<()> {
    let items = all_sandboxes(lc, a).await?;
    if json {
        print_json(&Value::Array(items));
        return Ok(());
    }
    let mut t = Table::new(&["ID", "IMAGE", "STATE", "AGE", "EXPIRES", "METADATA"]);
    for s in &items {
        t.row(vec![
            field(s, "/id"),
            field(s, "/image/uri"),
            field(s, "/status/state"),
            age(s, "/createdAt"),
            until(s, "/expiresAt"),
            pairs(s, "/metadata"),
        ]);
    }
    t.print();
    Ok(())
}

/// One sandbox as `key: value` lines.
fn show(s: &Value) {
    let entrypoint = s
        .get("entrypoint")
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|v| v.as_str().unwrap_or_default())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    print_fields(&[
        ("id", field(s, "/id")),
        ("image", field(s, "/image/uri")),
        ("state", field(s, "/status/state")),
        ("reason", field(s, "/status/reason")),
        ("message", field(s, "/status/message")),
        (
            "created",
            format!("{} ({} ago)", field(s, "/createdAt"), age(s, "/createdAt")),
        ),
        ("expires", until(s, "/expiresAt")),
        ("entrypoint", entrypoint),
        ("metadata", pairs(s, "/metadata")),
        ("pool", field(s, "/allocation/poolRef")),
        ("snapshot", field(s, "/snapshotId")),
    ]);
}

/// `POST /sandboxes/{id}/{verb}` (pause, resume).
async fn change(lc: &Lifecycle, id: &str, verb: &str, json: bool) -> anyhow::Result<()> {
    lc.json(
        Method::POST,
        &format!("/sandboxes/{id}/{verb}"),
        None,
        &Target::new(format!("{verb} sandbox {id}"), LIST),
    )
    .await?;
    print_done(json, id, &json!({"id": id, "accepted": verb}));
    Ok(())
}

async fn remove(lc: &Lifecycle, ids: &[String], json: bool) -> anyhow::Result<()> {
    let mut first_failure: Option<Exit> = None;
    let mut removed = Vec::new();
    for id in ids {
        let path = format!("/sandboxes/{id}");
        match lc.json(Method::DELETE, &path, None, &target(id)).await {
            Ok(_) => {
                if !json {
                    println!("{id}");
                }
                removed.push(id.clone());
            }
            Err(e) => {
                eprintln!("sandbolt: {e}");
                first_failure.get_or_insert(e.exit);
            }
        }
    }
    if json {
        print_json(&json!({ "removed": removed }));
    }
    match first_failure {
        None => Ok(()),
        Some(exit) => Err(Failure::new(
            exit,
            format!(
                "{} of {} sandboxes not removed",
                ids.len() - removed.len(),
                ids.len()
            ),
        )
        .into()),
    }
}

/// The sandbox's container log, as the diagnostics API describes it;
/// with --tail or --since, its plain-text form, the one that takes them.
async fn logs(lc: &Lifecycle, a: &LogsArgs, json: bool) -> anyhow::Result<()> {
    let id = a.id.as_str();
    if !json && (a.tail.is_some() || a.since.is_some()) {
        let mut query = vec![format!("tail={}", a.tail.unwrap_or(100))];
        if let Some(since) = a.since {
            query.push(format!("since={}s", since.as_secs().max(1)));
        }
        let path = format!("/sandboxes/{id}/diagnostics/logs?{}", query.join("&"));
        let resp = lc.call(Method::GET, &path, None, &target(id)).await?;
        let text = resp.text().await.map_err(|e| lc.transport(&e))?;
        print!("{text}");
        return Ok(());
    }
    let d = lc
        .get(
            &format!("/sandboxes/{id}/diagnostics/logs?scope=container"),
            &target(id),
        )
        .await?;
    if json {
        print_json(&d);
        return Ok(());
    }
    for w in d
        .get("warnings")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        eprintln!("sandbolt: {}", w.as_str().unwrap_or(&w.to_string()));
    }
    match d.get("content").and_then(Value::as_str) {
        Some(text) => print!("{text}"),
        None => {
            return Err(Failure::new(
                Exit::Error,
                format!(
                    "the server gave sandbox {id}'s log as {} (delivery {}), not inline; \
                     --json shows the whole answer",
                    field(&d, "/content_url"),
                    field(&d, "/delivery")
                ),
            )
            .into());
        }
    }
    if d.get("truncated") == Some(&Value::Bool(true)) {
        eprintln!("sandbolt: the server cut the log to its newest part");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_make_the_create_request() {
        let a = CreateArgs {
            image: Some("busybox".into()),
            entrypoint: vec![],
            pool: None,
            env: vec![("A".into(), "1".into())],
            metadata: vec![],
            cpu: Some("500m".into()),
            memory: None,
            timeout: Some(Duration::from_secs(600)),
            volumes: vec![volume_mount("data:/data:ro").unwrap()],
            no_wait: false,
            wait_timeout: Duration::from_secs(1),
        };
        assert_eq!(
            create_body(&a),
            json!({
                "image": {"uri": "busybox"},
                "entrypoint": ["tail", "-f", "/dev/null"],
                "resourceLimits": {"cpu": "500m"},
                "env": {"A": "1"},
                "timeout": 600,
                "volumes": [{"name": "data", "mountPath": "/data", "readOnly": true,
                             "pvc": {"claimName": "data"}}],
            })
        );
        assert!(volume_mount("data:relative").is_err());
        assert!(key_value("=x").is_err());
        assert_eq!(query_escape("a=b&c"), "a%3Db%26c");
    }
}
