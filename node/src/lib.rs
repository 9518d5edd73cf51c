//! What every sandbolt process on a node shares to work with containerd:
//! one client ([`containerd`]), the one way a sandbox is torn down
//! ([`teardown`]), the container labels that are the agent's durable state
//! ([`labels`]) and the image store ([`images`]: resolve, unpack, pull,
//! import archives).
//!
//! The agent creates and serves sandboxes with it; the janitor reaps them
//! with it without depending on the agent; `sandbolt image import` imports
//! archives with it.

pub mod containerd;
pub mod error;
pub mod images;
pub mod labels;
pub mod network;
pub mod retry;
pub mod teardown;

pub use containerd::Containerd;
pub use error::{NodeError, Result};
