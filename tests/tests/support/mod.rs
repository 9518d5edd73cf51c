//! Pieces the end-to-end tests share, one module per concern.

pub mod agent_proc;
pub mod execd;
pub mod observed;
pub mod rig;
pub mod snapshots;
pub mod volumes;
pub mod warm;
