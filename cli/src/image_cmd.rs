use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use sandbolt_agent::containerd::Containerd;
use sandbolt_agent::images::Images;

#[derive(Debug, clap::Subcommand)]
pub(crate) enum ImageCommand {
    /// Import an OCI image archive (an image layout tar) into containerd and
    /// unpack it, for nodes without a registry.
    Import(ImportArgs),
}

#[derive(Debug, clap::Args)]
pub(crate) struct ImportArgs {
    /// The OCI image layout tar to import.
    archive: PathBuf,
    /// Reference for images the archive does not name.
    #[arg(long)]
    name: Option<String>,
    #[arg(
        long,
        env = "SANDBOLT_CONTAINERD_SOCKET",
        default_value = "/run/containerd/containerd.sock"
    )]
    containerd_socket: PathBuf,
    #[arg(long, env = "SANDBOLT_CONTAINERD_NAMESPACE", default_value = "k8s.io")]
    containerd_namespace: String,
    #[arg(long, default_value = "overlayfs")]
    snapshotter: String,
}

pub(crate) async fn run(cmd: ImageCommand) -> anyhow::Result<()> {
    match cmd {
        ImageCommand::Import(args) => {
            let ctrd = Containerd::connect(
                &args.containerd_socket,
                &args.containerd_namespace,
                Duration::from_secs(10),
            )
            .await
            .with_context(|| {
                format!(
                    "connecting to containerd at {}",
                    args.containerd_socket.display()
                )
            })?;
            let images = Images::new(ctrd, args.snapshotter);
            let names = images
                .import_oci_tar(&args.archive, args.name.as_deref())
                .await
                .with_context(|| format!("importing {}", args.archive.display()))?;
            for n in names {
                println!("{n}");
            }
            Ok(())
        }
    }
}
