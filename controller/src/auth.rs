//! Bearer-token checks for the gRPC port: RegistryService always requires
//! the agent token; FastPath requires its token only when one is configured.

use tonic::{Request, Status};

#[derive(Clone)]
pub struct RequireBearer {
    expected: Option<Vec<u8>>,
    what: &'static str,
}

impl RequireBearer {
    pub fn new(token: Option<&str>, what: &'static str) -> Self {
        Self {
            expected: token
                .filter(|t| !t.is_empty())
                .map(|t| format!("Bearer {t}").into_bytes()),
            what,
        }
    }
}

/// Compares without an early exit, so timing does not leak the prefix.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl tonic::service::Interceptor for RequireBearer {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else {
            return Ok(req);
        };
        match req.metadata().get("authorization") {
            Some(v) if same(v.as_bytes(), expected) => Ok(req),
            Some(_) => Err(Status::unauthenticated(format!(
                "{}: wrong token",
                self.what
            ))),
            None => Err(Status::unauthenticated(format!(
                "{}: authorization: Bearer <token> required",
                self.what
            ))),
        }
    }
}
