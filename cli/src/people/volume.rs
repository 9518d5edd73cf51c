//! `sandbolt volume …`: named volumes and their snapshots (the lifecycle's
//! `/volumes` routes; runtimes without named volumes answer 501, said as
//! such).

use reqwest::Method;
use serde_json::{Map, Value, json};

use super::CLIENT_HELP;
use super::client::{Lifecycle, Target, remove_one, show_one};
use super::config::ClientArgs;
use super::output::{Table, age, field, print_done, print_fields, print_json};

const LIST: &str = "sandbolt volume ls";

#[derive(Debug, clap::Args)]
#[command(after_long_help = CLIENT_HELP)]
pub(crate) struct VolumeArgs {
    #[command(flatten)]
    client: ClientArgs,
    #[command(subcommand)]
    command: VolumeCommand,
}

#[derive(Debug, clap::Subcommand)]
enum VolumeCommand {
    /// Create a named volume; prints its name.
    #[command(after_long_help = CLIENT_HELP)]
    Create(CreateArgs),
    /// List named volumes.
    #[command(alias = "list", after_long_help = CLIENT_HELP)]
    Ls,
    /// Show one volume.
    #[command(after_long_help = CLIENT_HELP)]
    Get { name: String },
    /// Remove a volume (it must be mounted nowhere).
    #[command(alias = "delete", after_long_help = CLIENT_HELP)]
    Rm { name: String },
    /// Snapshot a volume's data now.
    #[command(after_long_help = CLIENT_HELP)]
    Snapshot { name: String, snapshot: String },
    /// List a volume's snapshots.
    #[command(after_long_help = CLIENT_HELP)]
    Snapshots { name: String },
    /// Remove one snapshot of a volume.
    #[command(after_long_help = CLIENT_HELP)]
    RmSnapshot { name: String, snapshot: String },
    /// Put a volume's data back to a snapshot.
    #[command(after_long_help = CLIENT_HELP)]
    Restore { name: String, snapshot: String },
    /// Make a new volume from a volume's data (or one of its snapshots).
    #[command(after_long_help = CLIENT_HELP)]
    Fork(ForkArgs),
}

#[derive(Debug, clap::Args)]
struct CreateArgs {
    /// The name (a DNS-1123 label: `data-1`).
    name: String,
    /// Quota (`512Mi`, `10Gi`) [default: none]
    #[arg(long)]
    size: Option<String>,
    /// ReadWriteOnce or ReadWriteMany [default: ReadWriteOnce]
    #[arg(long)]
    access_mode: Option<String>,
    /// Node to keep it on [default: the server picks]
    #[arg(long)]
    node: Option<String>,
}

#[derive(Debug, clap::Args)]
struct ForkArgs {
    /// The volume to fork.
    name: String,
    /// The new volume's name.
    new_name: String,
    /// Fork this snapshot instead of the current data.
    #[arg(long)]
    snapshot: Option<String>,
    /// The new volume's quota [default: the source's]
    #[arg(long)]
    size: Option<String>,
    /// The new volume's access mode [default: the source's]
    #[arg(long)]
    access_mode: Option<String>,
}

/// `{key: value}` of the flags that were given.
fn given(pairs: &[(&str, &Option<String>)]) -> Map<String, Value> {
    pairs
        .iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| (k.to_string(), json!(v))))
        .collect()
}

pub(crate) async fn run(args: VolumeArgs) -> anyhow::Result<()> {
    let lc = Lifecycle::new(args.client.connection()?)?;
    let json = args.client.json;
    let vol = |name: &str| Target::new(format!("volume {name}"), LIST);
    match args.command {
        VolumeCommand::Create(a) => {
            let mut body = given(&[
                ("size", &a.size),
                ("accessMode", &a.access_mode),
                ("nodeName", &a.node),
            ]);
            body.insert("name".into(), json!(a.name));
            let v = lc
                .json(
                    Method::POST,
                    "/volumes",
                    Some(&Value::Object(body)),
                    &vol(&a.name),
                )
                .await?;
            print_done(json, &a.name, &v);
        }
        VolumeCommand::Ls => list(&lc, json).await?,
        VolumeCommand::Get { name } => {
            show_one(&lc, &format!("/volumes/{name}"), &vol(&name), json, show).await?;
        }
        VolumeCommand::Rm { name } => {
            remove_one(&lc, &format!("/volumes/{name}"), &name, &vol(&name), json).await?;
        }
        VolumeCommand::Snapshot { name, snapshot } => {
            let body = json!({ "name": snapshot });
            let path = format!("/volumes/{name}/snapshots");
            let s = lc
                .json(Method::POST, &path, Some(&body), &vol(&name))
                .await?;
            print_done(json, &snapshot, &s);
        }
        VolumeCommand::Snapshots { name } => {
            let answer = lc
                .get(&format!("/volumes/{name}/snapshots"), &vol(&name))
                .await?;
            snapshots(&answer, json);
        }
        VolumeCommand::RmSnapshot { name, snapshot } => {
            let path = format!("/volumes/{name}/snapshots/{snapshot}");
            let what = Target::new(
                format!("snapshot {snapshot} of volume {name}"),
                "sandbolt volume snapshots VOLUME",
            );
            remove_one(&lc, &path, &snapshot, &what, json).await?;
        }
        VolumeCommand::Restore { name, snapshot } => {
            let body = json!({ "snapshot": snapshot });
            let path = format!("/volumes/{name}/restore");
            let v = lc
                .json(Method::POST, &path, Some(&body), &vol(&name))
                .await?;
            print_done(json, &name, &v);
        }
        VolumeCommand::Fork(a) => {
            let mut body = given(&[
                ("snapshot", &a.snapshot),
                ("size", &a.size),
                ("accessMode", &a.access_mode),
            ]);
            body.insert("name".into(), json!(a.new_name));
            let path = format!("/volumes/{}/fork", a.name);
            let v = lc
                .json(
                    Method::POST,
                    &path,
                    Some(&Value::Object(body)),
                    &vol(&a.name),
                )
                .await?;
            print_done(json, &a.new_name, &v);
        }
    }
    Ok(())
}

async fn list(lc: &Lifecycle, json: bool) -> anyhow::Result<()> {
    let answer = lc
        .get("/volumes", &Target::new("the volume list", LIST))
        .await?;
    let items = answer.get("items").cloned().unwrap_or(json!([]));
    if json {
        print_json(&items);
        return Ok(());
    }
    let mut t = Table::new(&[
        "NAME",
        "NODE",
        "SIZE",
        "USED",
        "ACCESS",
        "MOUNTS",
        "SNAPSHOTS",
        "AVAILABLE",
        "AGE",
    ]);
    for v in items.as_array().into_iter().flatten() {
        t.row(vec![
            field(v, "/name"),
            field(v, "/nodeName"),
            field(v, "/size"),
            field(v, "/usedBytes"),
            field(v, "/accessMode"),
            count(v, "/mounts"),
            count(v, "/snapshots"),
            field(v, "/available"),
            age(v, "/createdAt"),
        ]);
    }
    t.print();
    Ok(())
}

fn count(v: &Value, ptr: &str) -> String {
    v.pointer(ptr)
        .and_then(Value::as_array)
        .map_or(0, Vec::len)
        .to_string()
}

fn show(v: &Value) {
    let mounts: Vec<String> = v
        .get("mounts")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|m| format!("{}:{}", field(m, "/sandboxId"), field(m, "/mountPath")))
        .collect();
    let snapshots: Vec<String> = v
        .get("snapshots")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|s| field(s, "/name"))
        .collect();
    print_fields(&[
        ("name", field(v, "/name")),
        ("node", field(v, "/nodeName")),
        ("backend", field(v, "/capabilities/backend")),
        ("access", field(v, "/accessMode")),
        ("size", field(v, "/size")),
        ("used bytes", field(v, "/usedBytes")),
        ("created", field(v, "/createdAt")),
        ("forked from", field(v, "/forkedFrom")),
        ("available", field(v, "/available")),
        ("mounts", mounts.join(", ")),
        ("snapshots", snapshots.join(", ")),
    ]);
}

fn snapshots(answer: &Value, json: bool) {
    let items = answer.get("items").cloned().unwrap_or(json!([]));
    if json {
        print_json(&items);
        return;
    }
    let mut t = Table::new(&["NAME", "VOLUME", "AGE"]);
    for s in items.as_array().into_iter().flatten() {
        t.row(vec![
            field(s, "/name"),
            field(s, "/volume"),
            age(s, "/createdAt"),
        ]);
    }
    t.print();
}
