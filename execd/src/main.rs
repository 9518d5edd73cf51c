//! `execd [--init] [--listen ADDR] [--access-token TOKEN] [--exit-with-entrypoint] [--warm | -- ENTRYPOINT ARGS...]`

use std::ffi::OsString;

use sandbolt_execd::{Config, DEFAULT_LISTEN};

const USAGE: &str = "\
usage: execd [--init] [--listen ADDR] [--access-token TOKEN] [--exit-with-entrypoint]
             [--warm | -- ENTRYPOINT ARGS...]

  --listen ADDR            API address (default 0.0.0.0:44772, env EXECD_LISTEN)
  --access-token TOKEN     require X-EXECD-ACCESS-TOKEN (env EXECD_ACCESS_TOKEN)
  --init                   act as PID 1: run ENTRYPOINT, forward signals, reap zombies
  --exit-with-entrypoint   exit with the entrypoint's status when it exits
  --max-connections N      connections open at once; more are closed (default 10000)
  --header-read-timeout S  seconds a request head may take; also the keep-alive idle
                           time (default 30)
  --warm                   start without an entrypoint and wait for one
                           POST /sandbolt/claim, which brings it with a new token,
                           environment and working directory (no ENTRYPOINT then)
  -- ENTRYPOINT ARGS...    the user's program (started as execd's child)
";

fn parse(args: Vec<OsString>) -> Result<Config, String> {
    let mut cfg = Config::default();
    let mut listen = std::env::var("EXECD_LISTEN").ok().filter(|s| !s.is_empty());
    cfg.access_token = std::env::var("EXECD_ACCESS_TOKEN")
        .ok()
        .filter(|s| !s.is_empty());
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        let s = a
            .to_str()
            .ok_or_else(|| format!("invalid argument {a:?}"))?
            .to_string();
        let (flag, inline) = match s.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (s.clone(), None),
        };
        let mut value = |name: &str| -> Result<String, String> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => it
                    .next()
                    .and_then(|v| v.into_string().ok())
                    .ok_or_else(|| format!("{name} needs a value")),
            }
        };
        match flag.as_str() {
            "--init" => cfg.init = true,
            "--exit-with-entrypoint" => cfg.exit_with_entrypoint = true,
            "--warm" => cfg.warm = true,
            "--listen" => listen = Some(value("--listen")?),
            "--max-connections" => {
                cfg.limits.max_connections = value("--max-connections")?
                    .parse()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or("--max-connections needs a whole number above 0")?
            }
            "--header-read-timeout" => {
                cfg.limits.header_read_timeout = value("--header-read-timeout")?
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s > 0.0)
                    .map(std::time::Duration::from_secs_f64)
                    .ok_or("--header-read-timeout needs a number of seconds above 0")?
            }
            "--access-token" => {
                cfg.access_token = Some(value("--access-token")?).filter(|t| !t.is_empty())
            }
            "-h" | "--help" => return Err(String::new()),
            "--" => {
                cfg.entrypoint = it.collect();
                break;
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if cfg.warm && !cfg.entrypoint.is_empty() {
        return Err("--warm takes no ENTRYPOINT: the claim brings it".into());
    }
    let listen = listen.unwrap_or_else(|| DEFAULT_LISTEN.to_string());
    cfg.listen = listen
        .parse()
        .map_err(|_| format!("invalid listen address {listen:?} (want IP:PORT)"))?;
    Ok(cfg)
}

fn main() {
    let cfg = match parse(std::env::args_os().skip(1).collect()) {
        Ok(c) => c,
        Err(e) if e.is_empty() => {
            print!("{USAGE}");
            std::process::exit(0);
        }
        Err(e) => {
            eprintln!("execd: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    match sandbolt_execd::run(cfg) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("execd: {e}");
            std::process::exit(1);
        }
    }
}
