//! `sandbolt pool …`: warm pools, sandboxes kept started ahead of the
//! creates that claim them (the lifecycle's `/pools` routes; runtimes
//! without warm pools answer 501, said as such).

use reqwest::Method;
use serde_json::{Map, Value, json};

use super::CLIENT_HELP;
use super::client::{Lifecycle, Target, remove_one, show_one};
use super::config::ClientArgs;
use super::output::{Table, age, field, print_done, print_fields, print_json};
use super::sandbox::key_value;

const LIST: &str = "sandbolt pool ls";

#[derive(Debug, clap::Args)]
#[command(after_long_help = CLIENT_HELP)]
pub(crate) struct PoolArgs {
    #[command(flatten)]
    client: ClientArgs,
    #[command(subcommand)]
    command: PoolCommand,
}

#[derive(Debug, clap::Subcommand)]
enum PoolCommand {
    /// Create a warm pool; prints its name. `sandbolt sandbox create
    /// --pool NAME` takes a sandbox from it.
    #[command(after_long_help = CLIENT_HELP)]
    Create(CreateArgs),
    /// List warm pools.
    #[command(alias = "list", after_long_help = CLIENT_HELP)]
    Ls,
    /// Show one pool.
    #[command(after_long_help = CLIENT_HELP)]
    Get { name: String },
    /// Change a pool's sizes (the ones not given stay as they are).
    #[command(after_long_help = CLIENT_HELP)]
    Resize(ResizeArgs),
    /// Remove a pool and its idle sandboxes.
    #[command(alias = "delete", after_long_help = CLIENT_HELP)]
    Rm { name: String },
}

#[derive(Debug, clap::Args)]
struct Capacity {
    /// Fewest idle (warm) sandboxes to keep.
    #[arg(long)]
    buffer_min: Option<i32>,
    /// Most idle sandboxes to keep.
    #[arg(long)]
    buffer_max: Option<i32>,
    /// Fewest sandboxes of the pool, idle and claimed.
    #[arg(long)]
    pool_min: Option<i32>,
    /// Most sandboxes of the pool, idle and claimed.
    #[arg(long)]
    pool_max: Option<i32>,
}

impl Capacity {
    /// The pool's `capacitySpec`: these sizes over `base`.
    fn over(&self, base: &Value) -> Value {
        let mut spec = base.as_object().cloned().unwrap_or_default();
        for (k, v) in [
            ("bufferMin", self.buffer_min),
            ("bufferMax", self.buffer_max),
            ("poolMin", self.pool_min),
            ("poolMax", self.pool_max),
        ] {
            if let Some(v) = v {
                spec.insert(k.into(), json!(v));
            }
        }
        Value::Object(spec)
    }
}

#[derive(Debug, clap::Args)]
struct CreateArgs {
    /// The name (a DNS-1123 label).
    name: String,
    /// Image of the pool's sandboxes.
    #[arg(long)]
    image: String,
    /// CPU limit of each sandbox (`500m`).
    #[arg(long)]
    cpu: Option<String>,
    /// Memory limit of each sandbox (`512Mi`).
    #[arg(long)]
    memory: Option<String>,
    /// Environment variable of each sandbox (repeatable).
    #[arg(long = "env", short = 'e', value_name = "NAME=VALUE", value_parser = key_value)]
    env: Vec<(String, String)>,
    /// Sizes [default: 1 idle sandbox, at most 10 in all]
    #[command(flatten)]
    capacity: Capacity,
}

#[derive(Debug, clap::Args)]
struct ResizeArgs {
    name: String,
    #[command(flatten)]
    capacity: Capacity,
}

/// The create request: the template is the Kubernetes pod template the
/// API takes, with the one container sandbolt reads.
fn create_body(a: &CreateArgs) -> Value {
    let mut limits = Map::new();
    for (k, v) in [("cpu", &a.cpu), ("memory", &a.memory)] {
        if let Some(v) = v {
            limits.insert(k.into(), json!(v));
        }
    }
    let env: Vec<Value> = a
        .env
        .iter()
        .map(|(k, v)| json!({"name": k, "value": v}))
        .collect();
    let defaults = json!({"bufferMin": 1, "bufferMax": 1, "poolMin": 0, "poolMax": 10});
    json!({
        "name": a.name,
        "template": {"spec": {"containers": [{
            "name": "sandbox",
            "image": a.image,
            "resources": {"limits": limits},
            "env": env,
        }]}},
        "capacitySpec": a.capacity.over(&defaults),
    })
}

pub(crate) async fn run(args: PoolArgs) -> anyhow::Result<()> {
    let lc = Lifecycle::new(args.client.connection()?)?;
    let json = args.client.json;
    let pool = |name: &str| Target::new(format!("pool {name}"), LIST);
    match args.command {
        PoolCommand::Create(a) => {
            let p = lc
                .json(
                    Method::POST,
                    "/pools",
                    Some(&create_body(&a)),
                    &pool(&a.name),
                )
                .await?;
            print_done(json, &a.name, &p);
        }
        PoolCommand::Ls => {
            let answer = lc
                .get("/pools", &Target::new("the pool list", LIST))
                .await?;
            let items = answer.get("items").cloned().unwrap_or(json!([]));
            if json {
                print_json(&items);
            } else {
                table(&items);
            }
        }
        PoolCommand::Get { name } => {
            show_one(&lc, &format!("/pools/{name}"), &pool(&name), json, show).await?;
        }
        PoolCommand::Resize(a) => {
            let path = format!("/pools/{}", a.name);
            let current = lc.get(&path, &pool(&a.name)).await?;
            let spec = a.capacity.over(&current["capacitySpec"]);
            let body = json!({ "capacitySpec": spec });
            let p = lc
                .json(Method::PUT, &path, Some(&body), &pool(&a.name))
                .await?;
            print_done(json, &a.name, &p);
        }
        PoolCommand::Rm { name } => {
            remove_one(&lc, &format!("/pools/{name}"), &name, &pool(&name), json).await?;
        }
    }
    Ok(())
}

/// `min..max` of a capacity pair.
fn range(p: &Value, min: &str, max: &str) -> String {
    format!(
        "{}..{}",
        field(p, &format!("/capacitySpec/{min}")),
        field(p, &format!("/capacitySpec/{max}"))
    )
}

fn table(items: &Value) {
    let mut t = Table::new(&[
        "NAME",
        "IDLE",
        "TOTAL",
        "BUFFER",
        "POOL",
        "ALLOCATED",
        "AGE",
    ]);
    for p in items.as_array().into_iter().flatten() {
        t.row(vec![
            field(p, "/name"),
            field(p, "/status/available"),
            field(p, "/status/total"),
            range(p, "bufferMin", "bufferMax"),
            range(p, "poolMin", "poolMax"),
            field(p, "/status/allocated"),
            age(p, "/createdAt"),
        ]);
    }
    t.print();
}

fn show(p: &Value) {
    print_fields(&[
        ("name", field(p, "/name")),
        ("buffer", range(p, "bufferMin", "bufferMax")),
        ("pool", range(p, "poolMin", "poolMax")),
        ("idle", field(p, "/status/available")),
        ("allocated", field(p, "/status/allocated")),
        ("total", field(p, "/status/total")),
        ("revision", field(p, "/status/revision")),
        ("created", field(p, "/createdAt")),
    ]);
}
