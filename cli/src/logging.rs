use anyhow::Context;
use sandbolt_telemetry::otlp::OtlpGuard;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Where spans go besides the log: an OTLP/gRPC collector, and the name
/// this process has there.
pub(crate) struct OtlpExport<'a> {
    pub endpoint: &'a str,
    pub service_name: &'a str,
}

/// Installs the process's subscriber: log lines on stderr (text or JSON)
/// and, with `otlp`, spans exported to a collector. Must run inside the
/// tokio runtime when `otlp` is set; keep the guard until the end of main.
pub(crate) fn init(
    filter: &str,
    json: bool,
    otlp: Option<OtlpExport<'_>>,
) -> anyhow::Result<Option<OtlpGuard>> {
    let filter =
        EnvFilter::try_new(filter).with_context(|| format!("invalid --log filter {filter:?}"))?;
    let (otlp_layer, guard) = match otlp {
        Some(o) => {
            let (layer, guard) = sandbolt_telemetry::otlp::layer(o.endpoint, o.service_name)
                .context("--otlp-endpoint")?;
            (Some(layer), Some(guard))
        }
        None => (None, None),
    };
    // Colour only for a person at a terminal: escape codes in a log file or a
    // pod's log break grep and log shippers.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let text = (!json).then(|| {
        tracing_subscriber::fmt::layer()
            .with_ansi(ansi)
            .with_writer(std::io::stderr)
    });
    let json = json.then(|| {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
    });
    tracing_subscriber::registry()
        .with(otlp_layer)
        .with(filter)
        .with(text)
        .with(json)
        .try_init()
        .context("cannot install the log subscriber")?;
    Ok(guard)
}
