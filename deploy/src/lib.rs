//! sandbolt on Kubernetes: the custom resource types and the CRDs generated
//! from them.
//!
//! - [`sandbox::Sandbox`] (`sandbox.fast.io/v1alpha2`): one sandbox's durable
//!   record, in the shape the OpenSandbox server's fast-sandbox backend reads.
//! - [`pool::SandboxPool`] (`sandbolt.io/v1alpha1`): the project's own pool of
//!   agents: where they run, how many sandboxes each holds, which OCI runtime,
//!   which images stay warm.
//! - [`warm_pool::SandboxWarmPool`] (`sandbolt.io/v1alpha1`): a buffer of
//!   started, idle sandboxes of one image on an agent pool's agents, claimed
//!   by creates.
//! - [`snapshot::SandboxSnapshot`] (`sandbolt.io/v1alpha1`): one sandbox
//!   snapshot's record (a sandbox's filesystem committed on its node, the
//!   parent of the sandboxes restored from it).
//! - [`template::SandboxTemplate`] (`sandbox.fast.io/v1alpha2`): an image and
//!   its defaults that creates name, in the shape the OpenSandbox server
//!   writes.
//!
//! [`dashboard`] is the Grafana dashboard the chart ships, and what makes it
//! one.
//!
//! The CRD YAML in `deploy/crds/` and `deploy/helm/sandbolt/crds/` is
//! generated from these types by [`crd`] (`cargo run -p sandbolt-deploy --bin
//! crdgen`); a test fails when the checked-in files drift from the types.

pub mod crd;
pub mod dashboard;
pub mod pool;
pub mod sandbox;
pub mod snapshot;
pub mod template;
pub mod warm_pool;

pub use pool::{SandboxPool, SandboxPoolSpec, SandboxPoolStatus};
pub use sandbox::{Sandbox, SandboxSpec, SandboxStatus};
pub use snapshot::{SandboxSnapshot, SandboxSnapshotSpec};
pub use template::{SandboxTemplate, SandboxTemplateSpec, SandboxTemplateStatus};
pub use warm_pool::{SandboxWarmPool, SandboxWarmPoolSpec, SandboxWarmPoolStatus};
