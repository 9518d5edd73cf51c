use anyhow::Context;
use tracing_subscriber::EnvFilter;

pub(crate) fn init(filter: &str, json: bool) -> anyhow::Result<()> {
    let filter =
        EnvFilter::try_new(filter).with_context(|| format!("invalid --log filter {filter:?}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
    Ok(())
}
