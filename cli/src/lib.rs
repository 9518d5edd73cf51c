//! The `sandbolt` command: every component behind one binary.
//!
//! `main.rs` only calls [`main`]; each subcommand lives in its own module
//! and turns flags into the component's library config.

mod agent_cmd;
mod containerd;
mod controller_cmd;
mod growth_args;
mod image_cmd;
mod janitor_cmd;
mod lifecycle_cmd;
mod logging;
mod people;
mod secrets;
mod security_args;
mod static_elf;
mod up;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

const ABOUT: &str = "sandbolt: a fast-path runtime for AI-agent sandboxes";

const LONG_ABOUT: &str = "\
sandbolt creates isolated Linux sandboxes in milliseconds. A controller places
each sandbox on a node agent by image affinity and records it (fast or strong
consistency); the agent creates the container directly over the containerd
socket with execd (the OpenSandbox execd API) as its PID 1; the lifecycle
server speaks the OpenSandbox Lifecycle REST API, so the official SDKs work
unchanged, on top of the controller or, where there is no containerd, Docker.

Start everything on one machine with `sandbolt up`; run the components
separately (controller, agent, lifecycle) in a cluster. `sandbolt sandbox`,
`volume` and `pool` manage sandboxes on a lifecycle server from a terminal.";

#[derive(Debug, Parser)]
#[command(name = "sandbolt", version, about = ABOUT, long_about = LONG_ABOUT)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,

    /// Log filter (tracing EnvFilter syntax), e.g. `info,sandbolt_agent=debug`
    /// [default: info; warn for `image`, whose output is its result]
    #[arg(long, global = true, env = "SANDBOLT_LOG")]
    log: Option<String>,

    /// Log as JSON lines instead of text.
    #[arg(long, global = true, env = "SANDBOLT_LOG_JSON")]
    log_json: bool,

    /// Export spans over OTLP/gRPC to this collector (`http://host:4317`),
    /// as service `sandbolt-<command>` [default: off]
    #[arg(long, global = true, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    otlp_endpoint: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run controller, agent and lifecycle in one process on this machine
    /// (containerd, or Docker where there is no containerd).
    Up(up::UpArgs),
    /// Run the controller: agent registry, placement, durable records, and
    /// the FastPath v1 + v2 gRPC API.
    Controller(controller_cmd::ControllerArgs),
    /// Run a node agent: creates sandboxes over the containerd socket and
    /// serves the data-plane proxy into them.
    // Boxed: the agent has many flags, and clap's enum holds one variant.
    Agent(Box<agent_cmd::AgentArgs>),
    /// Run the node janitor: removes orphaned sandbox containers (never a
    /// live one) and what they leave behind.
    Janitor(janitor_cmd::JanitorArgs),
    /// Run the OpenSandbox Lifecycle REST API on a controller or on Docker.
    Lifecycle(lifecycle_cmd::LifecycleArgs),
    /// Manage images on this node's containerd (no registry needed).
    #[command(subcommand)]
    Image(image_cmd::ImageCommand),
    /// Create, list, exec into, copy files to and from, and remove
    /// sandboxes on a lifecycle server.
    Sandbox(people::sandbox::SandboxArgs),
    /// Manage named volumes and their snapshots on a lifecycle server.
    Volume(people::volume::VolumeArgs),
    /// Manage warm pools on a lifecycle server.
    Pool(people::pool::PoolArgs),
    /// Print a shell completion script (`sandbolt completions bash >
    /// /etc/bash_completion.d/sandbolt`).
    Completions { shell: clap_complete::Shell },
}

impl Command {
    /// A command whose output is its result: its routine steps are not
    /// logged, and its error is printed once, not logged beside it.
    fn one_shot(&self) -> bool {
        matches!(
            self,
            Command::Image(_)
                | Command::Sandbox(_)
                | Command::Volume(_)
                | Command::Pool(_)
                | Command::Completions { .. }
        )
    }
}

/// Parses the command line, runs the subcommand, and maps its outcome to an
/// exit code (errors are printed with their causes).
pub fn main() -> ExitCode {
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| {
        e.format(&mut <Cli as clap::CommandFactory>::command())
            .exit()
    });
    // A trace backend tells processes apart by service.name.
    let service_name = format!("sandbolt-{}", matches.subcommand_name().unwrap_or("cli"));
    let one_shot = cli.command.one_shot();
    let filter = cli
        .log
        .as_deref()
        .unwrap_or(if one_shot { "warn" } else { "info" });
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("sandbolt")
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sandbolt: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The OTLP exporter's channel runs on the runtime, so logging starts
    // inside it; declared after it, the guard flushes the last spans first.
    let otlp = cli
        .otlp_endpoint
        .as_deref()
        .filter(|e| !e.is_empty())
        .map(|endpoint| logging::OtlpExport {
            endpoint,
            service_name: &service_name,
        });
    let initialized = {
        let _in_runtime = runtime.enter();
        logging::init(filter, cli.log_json, otlp)
    };
    let _otlp_guard = match initialized {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("sandbolt: {e:#}");
            return ExitCode::from(2);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Up(args) => up::run(args).await,
            Command::Controller(args) => controller_cmd::run(args).await,
            Command::Agent(args) => agent_cmd::run(*args).await,
            Command::Janitor(args) => janitor_cmd::run(args).await,
            Command::Lifecycle(args) => lifecycle_cmd::run(args).await,
            Command::Image(cmd) => image_cmd::run(cmd).await,
            Command::Sandbox(args) => people::sandbox::run(args).await,
            Command::Volume(args) => people::volume::run(args).await,
            Command::Pool(args) => people::pool::run(args).await,
            Command::Completions { shell } => {
                let mut cmd = <Cli as clap::CommandFactory>::command();
                clap_complete::generate(shell, &mut cmd, "sandbolt", &mut std::io::stdout());
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Scripts tell failures apart by code (see people::CLIENT_HELP).
            let (code, print) = people::exit_of(&e);
            if print {
                if !one_shot {
                    tracing::error!("{e:#}");
                }
                eprintln!("sandbolt: {e:#}");
            }
            ExitCode::from(code)
        }
    }
}

/// Resolves when the process is asked to stop (SIGINT or SIGTERM).
pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
    }
}

/// Parses one subcommand's flags as the command line would (`argv[0]` is
/// the subcommand's name), for the subcommands' tests.
#[cfg(test)]
pub(crate) fn try_parse_flags<A: clap::Args>(argv: &[&str]) -> Result<A, clap::Error> {
    #[derive(clap::Parser)]
    struct Cmd<A: clap::Args> {
        #[command(flatten)]
        args: A,
    }
    Cmd::<A>::try_parse_from(argv).map(|c| c.args)
}

/// [`try_parse_flags`] for flags that must parse.
#[cfg(test)]
pub(crate) fn parse_flags<A: clap::Args>(argv: &[&str]) -> A {
    try_parse_flags(argv).expect("parses")
}
