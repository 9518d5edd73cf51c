//! The OpenAPI document sandbolt serves at `/openapi.json`: the routes it
//! implements, in the OpenSandbox 1.1.1 shape.

pub const DOCUMENT: &str = include_str!("openapi.json");
