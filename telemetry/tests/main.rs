//! The telemetry crate's integration tests: real servers on loopback.

mod grpc;
mod http;
mod ops;
mod otlp;
mod support;
