use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use sandbolt_node::NodeError;
use sandbolt_node::containerd::Containerd;
use sandbolt_node::images::{Images, ImportProgress, ImportStage, NoProgress};

/// Archives smaller than this import in a moment: a bar would only flicker.
const PROGRESS_MIN_BYTES: u64 = 16 << 20;

#[derive(Debug, clap::Subcommand)]
pub(crate) enum ImageCommand {
    /// Import an image archive into containerd and unpack it, for nodes
    /// without a registry.
    ///
    /// Reads OCI image layouts in a tar (`tar -C layout -cf image.tar .`,
    /// `skopeo copy … oci-archive:image.tar`, `docker save` of Docker ≥ 25)
    /// and the older `docker save` format (`manifest.json`), plain or
    /// gzip-compressed. Of an index of platforms, only this machine's
    /// platform is imported. Prints the names it created, one a line.
    Import(ImportArgs),
    /// Pull an image from its registry into containerd, as an agent does
    /// for a create whose image the node lacks. Prints its name.
    Pull(PullArgs),
}

#[derive(Debug, clap::Args)]
pub(crate) struct PullArgs {
    /// Image reference (`docker.io/library/busybox:1.36`).
    reference: String,
    #[command(flatten)]
    containerd: crate::containerd::ContainerdArgs,
    #[arg(long, default_value = "overlayfs")]
    snapshotter: String,
    /// Registry host (`host[:port]`) to pull from over plain HTTP
    /// (repeatable); every other registry needs TLS.
    #[arg(long)]
    plain_http: Vec<String>,
    /// Longest the pull may take.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

#[derive(Debug, clap::Args)]
pub(crate) struct ImportArgs {
    /// The archive to import (`.tar` or `.tar.gz`).
    archive: PathBuf,
    /// Name of the imported image. For an archive of one image, its name
    /// instead of the archive's (needed when the archive gives none, e.g.
    /// `docker save <image id>`, or only a tag); in an archive of several,
    /// the name of the one it leaves unnamed, and the repository of those it
    /// tags without one.
    #[arg(long)]
    name: Option<String>,
    #[command(flatten)]
    containerd: crate::containerd::ContainerdArgs,
    #[arg(long, default_value = "overlayfs")]
    snapshotter: String,
}

pub(crate) async fn run(cmd: ImageCommand) -> anyhow::Result<()> {
    match cmd {
        ImageCommand::Import(args) => import(args).await,
        ImageCommand::Pull(args) => pull(args).await,
    }
}

async fn connect(args: &crate::containerd::ContainerdArgs) -> anyhow::Result<Containerd> {
    Containerd::connect(&args.socket, &args.namespace, Duration::from_secs(10))
        .await
        .with_context(|| format!("connecting to containerd at {}", args.socket.display()))
}

async fn pull(args: PullArgs) -> anyhow::Result<()> {
    let ctrd = connect(&args.containerd).await?;
    // containerd's pull reports no byte counts to us: a spinner with the
    // time spent, drawn only for a person watching.
    let bar = crate::people::spinner(format!("pulling {}", args.reference));
    let result = sandbolt_node::images::pull(
        &ctrd,
        &args.snapshotter,
        &args.reference,
        args.timeout,
        &args.plain_http,
    )
    .await;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    result.with_context(|| format!("cannot pull {}", args.reference))?;
    println!("{}", args.reference);
    Ok(())
}

async fn import(args: ImportArgs) -> anyhow::Result<()> {
    // Checked before connecting: a wrong path is the likelier mistake, and
    // its message should not depend on containerd being up.
    let size = std::fs::metadata(&args.archive)
        .with_context(|| format!("cannot import {}", args.archive.display()))?
        .len();
    let ctrd = connect(&args.containerd).await?;
    let images = Images::new(ctrd, args.snapshotter);
    let bar = (std::io::stderr().is_terminal() && size >= PROGRESS_MIN_BYTES)
        .then(|| Arc::new(Bar::new()));
    let progress: Arc<dyn ImportProgress> = match &bar {
        Some(b) => b.clone(),
        None => Arc::new(NoProgress),
    };
    let result = images
        .import_archive(&args.archive, args.name.as_deref(), progress)
        .await;
    if let Some(b) = &bar {
        b.bar.finish_and_clear();
    }
    let names = result.map_err(|e| match e {
        // The reason names the entry or document at fault; one line.
        NodeError::BadImage { reason, .. } => {
            anyhow::anyhow!("cannot import {}: {reason}", args.archive.display())
        }
        e => anyhow::Error::new(e).context(format!("cannot import {}", args.archive.display())),
    })?;
    for n in names {
        println!("{n}");
    }
    Ok(())
}

/// The progress bar: bytes of the archive read in each pass, then a
/// spinner while the layers are unpacked.
struct Bar {
    bar: ProgressBar,
}

impl Bar {
    fn new() -> Self {
        Self {
            bar: ProgressBar::new(0),
        }
    }
}

impl ImportProgress for Bar {
    fn stage(&self, stage: ImportStage, total: u64) {
        let template = if total > 0 {
            "{msg:>10} [{bar:40}] {bytes}/{total_bytes} ({eta})"
        } else {
            "{msg:>10} {spinner} {elapsed}"
        };
        self.bar.set_message(stage.to_string());
        self.bar.set_length(total);
        self.bar.set_position(0);
        self.bar.set_style(
            ProgressStyle::with_template(template)
                .expect("static template")
                .progress_chars("=> "),
        );
        // Ticks keep the spinner and the estimate moving between reads.
        self.bar.enable_steady_tick(Duration::from_millis(200));
    }

    fn position(&self, bytes: u64) {
        self.bar.set_position(bytes);
    }
}
