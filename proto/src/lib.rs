//! sandbolt's wire contracts, compiled from `proto/`.
//!
//! - [`fastpath::v1`] and [`fastpath::v2`]: the public FastPath gRPC API,
//!   wire-identical to fast-sandbox (v1) and to what the OpenSandbox server
//!   1.1.x calls (v2). `tests/contract_drift.rs` holds them to the contract
//!   files field by field.
//! - [`agent::v1`]: sandbolt's own controller ⇄ agent ⇄ janitor API.
//! - [`control::v1`]: sandbolt's native control API (the whole sandbox),
//!   served beside FastPath on the controller's port.
//! - [`auth`]: bearer tokens on every gRPC port, client and server side.
//! - [`wire`]: constants every component must agree on (execd's port, header).
//! - [`egress`]: the OpenSandbox egress policy (`networkPolicy`), one model for all.

pub mod auth;
pub mod egress;
pub mod quantity;
pub mod tls;
pub mod wire;

// Generated code: its style is tonic-build's, not ours.
#[allow(unused_qualifications, rust_2018_idioms, clippy::too_many_lines)]
pub mod fastpath {
    pub mod v1 {
        tonic::include_proto!("fastpath.v1");
    }
    pub mod v2 {
        tonic::include_proto!("fastpath.v2");
    }
}

// Generated code: its style is tonic-build's, not ours.
#[allow(unused_qualifications, rust_2018_idioms, clippy::too_many_lines)]
pub mod agent {
    pub mod v1 {
        tonic::include_proto!("sandbolt.agent.v1");
    }
}

// Generated code: its style is tonic-build's, not ours.
#[allow(unused_qualifications, rust_2018_idioms, clippy::too_many_lines)]
pub mod control {
    pub mod v1 {
        tonic::include_proto!("sandbolt.control.v1");
    }
}

/// Encoded `FileDescriptorSet` of every proto in this crate (for reflection
/// and for the contract drift test).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));
