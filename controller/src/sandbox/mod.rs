//! The sandbox core: every API (the native control service, FastPath v1 and
//! v2) lands here as a plain Rust call; the wire modules only translate.
//!
//! One file per verb, each read top-down:
//! - `create.rs`: validate, place, agent create, record (strong and fast
//!   flows), idempotent retries and re-driving a create left Pending;
//! - `get.rs`: get (with uid/generation preconditions), diagnostics;
//! - `diagnostics.rs`: the record's events and the container log's end
//!   (read from the agent), for the diagnostics routes;
//! - `list.rs`: pages by namespace and metadata;
//! - `update.rs`: metadata, expiry, failure policy, reset-revision restart,
//!   egress policy;
//! - `policy.rs`: pushing a recorded egress policy to the agent, and
//!   re-sending it after an outage;
//! - `pause.rs`: pause and resume;
//! - `resolve.rs`: the proxy route and headers of a sandbox port;
//! - `delete.rs`: container, record, slot;
//! - `expire.rs`: the expiry sweep and deletions asked for in the store;
//! - `recover.rs`: restart rebuild, heartbeats, failure policies, orphans;
//! - `ownership.rs`: what janitors ask before they reap;
//! - `volumes.rs`: named volumes of sandboxes (placement where they are,
//!   creating missing ones, attach and detach, removal with the sandbox);
//! - `restore.rs`: creates from a sandbox snapshot (checks, the pin to the
//!   snapshot's node, its volumes as forks).
//!
//! `shared.rs` holds the [`Core`] itself and what every verb shares (record
//! read-modify-write, preconditions, the in-flight set, the expiry index,
//! the one conversion of a record into the agent's spec).

mod create;
mod delete;
mod diagnostics;
mod expire;
mod get;
mod list;
mod ownership;
mod pause;
mod policy;
mod recover;
mod resolve;
mod restore;
mod shared;
mod token;
mod update;
mod volumes;

pub use create::CreateRequest;
pub use diagnostics::{DiagnosticsBounds, LogTail, SandboxDiagnostics};
pub use get::{Diagnostics, Observed};
pub use list::page_size;
pub(crate) use resolve::proxy_host;
pub use resolve::{EndpointTarget, PROXY_TOKEN_HEADER, ResolvedRoute};
pub use shared::{Core, Precondition};
pub use update::{UpdateOp, UpdateSpec};
