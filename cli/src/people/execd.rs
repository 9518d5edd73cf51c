//! `sandbolt sandbox exec` and `cp`: through the sandbox's execd (the
//! OpenSandbox execd API), at the endpoint the lifecycle server gives for
//! its port, with the headers it says to send, as the SDKs do.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use reqwest::multipart::{Form, Part};
use reqwest::{Method, RequestBuilder, StatusCode};
use sandbolt_proto::wire::EXECD_PORT;
use serde_json::{Map, Value, json};
use tokio::io::AsyncWriteExt;

use super::client::{Lifecycle, error_body};
use super::output::print_json;
use super::sandbox::{key_value, target};
use super::{CommandExit, Exit, Failure};

#[derive(Debug, clap::Args)]
pub(crate) struct ExecArgs {
    /// The sandbox.
    id: String,
    /// The program and its arguments, run without a shell (`-- sh -c
    /// '…'` for one); everything after the program is its own.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    argv: Vec<String>,
    /// Working directory in the sandbox.
    #[arg(long, short = 'w')]
    cwd: Option<String>,
    /// Environment variable of the program (repeatable).
    #[arg(long = "env", short = 'e', value_name = "NAME=VALUE", value_parser = key_value)]
    env: Vec<(String, String)>,
    /// Stop the program after this long (`30s`, `5m`) [default: no limit]
    #[arg(long, value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
}

#[derive(Debug, clap::Args)]
pub(crate) struct CpArgs {
    /// `ID:/path` in a sandbox, or a local path (`-`: stdin).
    src: String,
    /// `ID:/path` in a sandbox (ending in `/`: a directory, the file keeps
    /// its name), or a local path (a directory, or `-`: stdout).
    dst: String,
}

/// One sandbox's execd.
struct Execd<'a> {
    lc: &'a Lifecycle,
    id: &'a str,
    /// `scheme://host:port[/prefix]`.
    base: String,
    headers: Map<String, Value>,
}

impl<'a> Execd<'a> {
    async fn resolve(lc: &'a Lifecycle, id: &'a str) -> Result<Self, Failure> {
        let ep = lc
            .get(
                &format!("/sandboxes/{id}/endpoints/{EXECD_PORT}"),
                &target(id),
            )
            .await?;
        let endpoint = ep.get("endpoint").and_then(Value::as_str).ok_or_else(|| {
            Failure::new(
                Exit::Error,
                format!("the server gave sandbox {id} no execd endpoint: {ep}"),
            )
        })?;
        Ok(Self {
            lc,
            id,
            base: format!("{}://{endpoint}", lc.scheme()),
            headers: ep
                .get("headers")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default(),
        })
    }

    fn request(&self, method: Method, path: &str) -> RequestBuilder {
        let mut req = self
            .lc
            .http()
            .request(method, format!("{}{path}", self.base));
        for (k, v) in &self.headers {
            if let Some(v) = v.as_str() {
                req = req.header(k, v);
            }
        }
        req
    }

    /// Sends `req`; a refusal or no answer as a [`Failure`] about `what`.
    async fn send(&self, req: RequestBuilder, what: &str) -> Result<reqwest::Response, Failure> {
        let resp = req.send().await.map_err(|e| {
            Failure::new(
                Exit::Unreachable,
                format!(
                    "cannot reach sandbox {}'s execd at {}: {e}; is the sandbox running \
                     (`sandbolt sandbox get {}`)?",
                    self.id, self.base, self.id
                ),
            )
        })?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let (code, message) = error_body(&resp.text().await.unwrap_or_default());
        let exit = if status == StatusCode::NOT_FOUND {
            Exit::NotFound
        } else {
            Exit::Error
        };
        Err(Failure::new(
            exit,
            format!(
                "{what} in sandbox {}: {message} [{code}, {status}]",
                self.id
            ),
        ))
    }
}

/// What a command printed, for `--json`.
#[derive(Default)]
struct Output {
    stdout: String,
    stderr: String,
}

pub(crate) async fn exec(lc: &Lifecycle, a: ExecArgs, json: bool) -> anyhow::Result<()> {
    let execd = Execd::resolve(lc, &a.id).await?;
    let mut body = json!({ "argv": a.argv });
    if let Some(cwd) = &a.cwd {
        body["cwd"] = json!(cwd);
    }
    if !a.env.is_empty() {
        body["envs"] = Value::Object(a.env.iter().map(|(k, v)| (k.clone(), json!(v))).collect());
    }
    if let Some(t) = a.timeout {
        body["timeout"] = json!(t.as_millis().max(1) as u64);
    }
    let req = execd.request(Method::POST, "/command").json(&body);
    let resp = execd.send(req, &format!("running {:?}", a.argv[0])).await?;
    let mut collected = json.then(Output::default);
    let code = stream_events(resp, &mut collected).await.map_err(|e| {
        Failure::new(
            Exit::Unreachable,
            format!("the output stream of sandbox {}'s command broke: {e}", a.id),
        )
    })?;
    let code = code.ok_or_else(|| {
        Failure::new(
            Exit::Error,
            format!(
                "the output stream of sandbox {} ended before the command did; \
                 `sandbolt sandbox get {}` shows whether the sandbox still runs",
                a.id, a.id
            ),
        )
    })?;
    if let Some(out) = collected {
        print_json(&json!({"exitCode": code, "stdout": out.stdout, "stderr": out.stderr}));
    }
    match code {
        0 => Ok(()),
        c => Err(CommandExit(u8::try_from(c).ok().filter(|c| *c != 0).unwrap_or(1)).into()),
    }
}

/// Relays execd's event stream (`{json}\n\n` frames) to stdout and stderr,
/// or into `collected`; the command's exit code, `None` when the stream
/// ended without one.
async fn stream_events(
    resp: reqwest::Response,
    collected: &mut Option<Output>,
) -> Result<Option<i32>, reqwest::Error> {
    let mut body = resp.bytes_stream();
    let mut pending: Vec<u8> = Vec::new();
    while let Some(chunk) = body.next().await {
        pending.extend_from_slice(&chunk?);
        while let Some(end) = pending.windows(2).position(|w| w == b"\n\n") {
            let frame: Vec<u8> = pending.drain(..end + 2).collect();
            if let Some(code) = relay_event(&frame, collected) {
                return Ok(Some(code));
            }
        }
    }
    Ok(relay_event(&pending, collected))
}

/// Relays one event; the exit code when it is the last one.
fn relay_event(frame: &[u8], collected: &mut Option<Output>) -> Option<i32> {
    let text = String::from_utf8_lossy(frame);
    // Bare JSON, as execd writes it; `data:` framing from other servers too.
    let text = text.trim();
    let text = text.strip_prefix("data:").unwrap_or(text).trim();
    let event: Value = serde_json::from_str(text).ok()?;
    let out = event.get("text").and_then(Value::as_str).unwrap_or("");
    match event.get("type").and_then(Value::as_str)? {
        "stdout" => match collected {
            Some(c) => c.stdout.push_str(out),
            None => {
                let mut o = std::io::stdout().lock();
                let _ = o.write_all(out.as_bytes()).and_then(|()| o.flush());
            }
        },
        "stderr" => match collected {
            Some(c) => c.stderr.push_str(out),
            None => eprint!("{out}"),
        },
        "execution_complete" => return Some(0),
        "error" => {
            // execd gives the exit code as `evalue`; anything else failed
            // without one.
            let evalue = event.pointer("/error/evalue").and_then(Value::as_str);
            return Some(evalue.and_then(|v| v.parse().ok()).unwrap_or(1));
        }
        _ => {}
    }
    None
}

/// One side of a copy.
#[derive(Debug, PartialEq)]
enum Side {
    Sandbox { id: String, path: String },
    Local(String),
}

impl Side {
    /// `ID:/path` (an id has no `/`, the path is absolute), else a local
    /// path.
    fn parse(s: &str) -> Self {
        match s.split_once(':') {
            Some((id, path)) if !id.is_empty() && !id.contains('/') && path.starts_with('/') => {
                Side::Sandbox {
                    id: id.to_string(),
                    path: path.to_string(),
                }
            }
            _ => Side::Local(s.to_string()),
        }
    }
}

pub(crate) async fn copy(lc: &Lifecycle, a: CpArgs, json: bool) -> anyhow::Result<()> {
    let (bytes, from, to) = match (Side::parse(&a.src), Side::parse(&a.dst)) {
        (Side::Local(local), Side::Sandbox { id, path }) => {
            let execd = Execd::resolve(lc, &id).await?;
            let (n, path) = upload(&execd, &local, &path).await?;
            (n, local, format!("{id}:{path}"))
        }
        (Side::Sandbox { id, path }, Side::Local(local)) => {
            let execd = Execd::resolve(lc, &id).await?;
            let (n, local) = download(&execd, &path, &local).await?;
            (n, format!("{id}:{path}"), local)
        }
        _ => {
            return Err(Failure::new(
                Exit::Usage,
                "cp copies between this machine and a sandbox: exactly one of SRC and DST is \
                 ID:/absolute/path",
            )
            .into());
        }
    };
    if json {
        print_json(&json!({"from": from, "to": to, "bytes": bytes}));
    }
    Ok(())
}

fn local_failure(path: &str, verb: &str, e: &std::io::Error) -> Failure {
    let exit = if e.kind() == std::io::ErrorKind::NotFound {
        Exit::NotFound
    } else {
        Exit::Error
    };
    Failure::new(exit, format!("cannot {verb} {path}: {e}"))
}

/// Local `src` (`-`: stdin) to `dst` in the sandbox: bytes written and
/// the path written to.
async fn upload(execd: &Execd<'_>, src: &str, dst: &str) -> Result<(u64, String), Failure> {
    let (part, len, name, mode) = if src == "-" {
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut data)
            .map_err(|e| local_failure("stdin", "read", &e))?;
        let len = data.len() as u64;
        (Part::bytes(data), len, "stdin".to_string(), 644)
    } else {
        let file = tokio::fs::File::open(src)
            .await
            .map_err(|e| local_failure(src, "read", &e))?;
        let md = file
            .metadata()
            .await
            .map_err(|e| local_failure(src, "read", &e))?;
        if md.is_dir() {
            return Err(Failure::new(
                Exit::Usage,
                format!("{src} is a directory: cp copies one file (tar it first)"),
            ));
        }
        let name = Path::new(src)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "file".to_string());
        (
            Part::stream_with_length(file, md.len()),
            md.len(),
            name,
            api_mode(std::os::unix::fs::PermissionsExt::mode(&md.permissions())),
        )
    };
    let dst = if dst.ends_with('/') {
        format!("{dst}{name}")
    } else {
        dst.to_string()
    };
    let metadata = serde_json::to_vec(&json!({"path": dst, "mode": mode})).expect("JSON");
    let form = Form::new()
        .part(
            "metadata",
            Part::bytes(metadata)
                .file_name("metadata")
                .mime_str("application/json")
                .expect("static mime"),
        )
        .part("file", part.file_name(name));
    let req = execd.request(Method::POST, "/files/upload").multipart(form);
    execd.send(req, &format!("writing {dst}")).await?;
    Ok((len, dst))
}

/// A file mode as the execd API spells it: octal digits read as a
/// decimal number (0o644 is 644).
fn api_mode(mode: u32) -> u32 {
    format!("{:o}", mode & 0o7777).parse().unwrap_or(644)
}

/// `src` in the sandbox to local `dst` (a directory: the file keeps its
/// name; `-`: stdout): bytes read and the local path written.
async fn download(execd: &Execd<'_>, src: &str, dst: &str) -> Result<(u64, String), Failure> {
    let req = execd
        .request(Method::GET, "/files/download")
        .query(&[("path", src)]);
    let resp = execd.send(req, &format!("reading {src}")).await?;
    let broken = |e: reqwest::Error| {
        Failure::new(
            Exit::Unreachable,
            format!("reading {src} from sandbox {} broke off: {e}", execd.id),
        )
    };
    let mut body = resp.bytes_stream();
    let mut n = 0u64;
    if dst == "-" {
        let mut out = tokio::io::stdout();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(broken)?;
            n += chunk.len() as u64;
            out.write_all(&chunk)
                .await
                .map_err(|e| local_failure("stdout", "write", &e))?;
        }
        out.flush()
            .await
            .map_err(|e| local_failure("stdout", "write", &e))?;
        return Ok((n, dst.to_string()));
    }
    let mut path = PathBuf::from(dst);
    if path.is_dir() {
        path.push(Path::new(src).file_name().unwrap_or("file".as_ref()));
    }
    let shown = path.display().to_string();
    let mut file = tokio::fs::File::create(&path)
        .await
        .map_err(|e| local_failure(&shown, "write", &e))?;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(broken)?;
        n += chunk.len() as u64;
        file.write_all(&chunk)
            .await
            .map_err(|e| local_failure(&shown, "write", &e))?;
    }
    file.flush()
        .await
        .map_err(|e| local_failure(&shown, "write", &e))?;
    Ok((n, shown))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_sides_name_a_sandbox_only_with_an_absolute_path() {
        assert_eq!(
            Side::parse("abc:/tmp/x"),
            Side::Sandbox {
                id: "abc".into(),
                path: "/tmp/x".into()
            }
        );
        assert_eq!(Side::parse("./a:/b"), Side::Local("./a:/b".into()));
        assert_eq!(Side::parse("a:b"), Side::Local("a:b".into()));
        assert_eq!(Side::parse("-"), Side::Local("-".into()));
    }

    #[test]
    fn events_give_output_and_the_exit_code() {
        let mut out = Some(Output::default());
        assert_eq!(
            relay_event(br#"{"type":"init","text":"1"}"#, &mut out),
            None
        );
        assert_eq!(
            relay_event(b"{\"type\":\"stdout\",\"text\":\"hi\\n\"}\n\n", &mut out),
            None
        );
        assert_eq!(
            relay_event(br#"data: {"type":"stderr","text":"e"}"#, &mut out),
            None
        );
        let error =
            br#"{"type":"error","error":{"ename":"CommandExecError","evalue":"7","traceback":[]}}"#;
        assert_eq!(relay_event(error, &mut out), Some(7));
        assert_eq!(
            relay_event(br#"{"type":"execution_complete"}"#, &mut out),
            Some(0)
        );
        let out = out.unwrap();
        assert_eq!((out.stdout.as_str(), out.stderr.as_str()), ("hi\n", "e"));
        assert_eq!(api_mode(0o100755), 755);
    }
}
