//! `sandbolt controller`: the controller's own entry point
//! ([`sandbolt_controller::cli`]), so its flags, environment names and
//! wiring are those of the `sandbolt-controller` binary.

pub(crate) use sandbolt_controller::cli::{ConsistencyArg, ControllerArgs};

pub(crate) async fn run(args: ControllerArgs) -> anyhow::Result<()> {
    sandbolt_controller::cli::run(args, crate::shutdown_signal()).await?;
    Ok(())
}
