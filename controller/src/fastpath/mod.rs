//! The public FastPath gRPC API, both versions on one port.
//!
//! What v1 and v2 read alike is read once here: the spec fields their create
//! requests share (same names in both contracts) and the failure policy
//! (numbered alike in both).

use sandbolt_proto::fastpath::{v1 as pb1, v2 as pb2};
use tonic::Status;

use crate::store::FailurePolicy;

/// A [`SandboxSpec`](crate::store::SandboxSpec) from the fields every
/// FastPath create request has (moved out of `$q`), plus `$rest`; the other
/// fields keep their defaults.
macro_rules! fastpath_spec {
    ($q:ident { $($rest:tt)* }) => {
        crate::store::SandboxSpec {
            pool: $q.pool_ref,
            image: $q.image,
            command: $q.command,
            args: $q.args,
            envs: $q.envs.into_iter().collect(),
            working_dir: $q.working_dir,
            $($rest)*
            ..Default::default()
        }
    };
}

pub mod v1;
pub mod v2;

// v1 sends its own enum's numbers to `failure_policy`.
const _: () = assert!(
    pb1::FailurePolicy::Manual as i32 == pb2::FailurePolicy::Manual as i32
        && pb1::FailurePolicy::AutoRecreate as i32 == pb2::FailurePolicy::AutoRecreate as i32
);

/// A FastPath failure policy (v1 and v2 number it alike).
fn failure_policy(p: i32) -> Result<FailurePolicy, Status> {
    match pb2::FailurePolicy::try_from(p) {
        Ok(pb2::FailurePolicy::Manual) => Ok(FailurePolicy::Manual),
        Ok(pb2::FailurePolicy::AutoRecreate) => Ok(FailurePolicy::AutoRecreate),
        Err(_) => Err(Status::invalid_argument(format!(
            "unknown failure policy {p}"
        ))),
    }
}
