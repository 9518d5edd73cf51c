//! The public FastPath gRPC API, both versions on one port.

pub mod v1;
pub mod v2;
