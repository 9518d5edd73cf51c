//! Resolve: the route to one port of a running sandbox through its agent's
//! proxy, and the headers the proxy and execd check.

use std::collections::BTreeMap;

use sandbolt_proto::wire::{EXECD_PORT, EXECD_TOKEN_HEADER};

use crate::error::{Error, Result};
use crate::ids::SandboxKey;
use crate::sandbox::{Core, Precondition};
use crate::store::{Phase, SandboxRecord};

/// Header the agent's proxy checks.
pub const PROXY_TOKEN_HEADER: &str = "X-Sandbolt-Access-Token";

/// What a caller wants to reach inside a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointTarget {
    Port(u32),
    /// A named component (only `execd` exists).
    Component(String),
}

pub struct ResolvedRoute {
    pub record: SandboxRecord,
    pub port: u32,
    /// The component asked for; empty when a port was.
    pub component: String,
    pub proxy_endpoint: String,
    pub headers: BTreeMap<String, String>,
}

/// `host[:port]` of a proxy endpoint, without scheme or trailing slash.
pub(crate) fn proxy_host(proxy_endpoint: &str) -> &str {
    proxy_endpoint
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/')
}

fn port_of(key: &SandboxKey, target: Option<EndpointTarget>) -> Result<(u32, String)> {
    match target {
        Some(EndpointTarget::Port(p)) if (1..=65535).contains(&p) => Ok((p, String::new())),
        Some(EndpointTarget::Port(p)) => {
            Err(Error::InvalidArgument(format!("port {p} is out of range")))
        }
        Some(EndpointTarget::Component(c)) if c == "execd" => Ok((EXECD_PORT.into(), c)),
        Some(EndpointTarget::Component(c)) if !c.is_empty() => Err(Error::NotFoundOther(format!(
            "sandbox {} has no component {c:?} (known: execd)",
            key.name
        ))),
        _ => Err(Error::InvalidArgument(
            "endpoint target is required (port or component)".into(),
        )),
    }
}

impl Core {
    pub fn resolve(
        &self,
        key: &SandboxKey,
        expect: &Precondition,
        target: Option<EndpointTarget>,
    ) -> Result<ResolvedRoute> {
        let r = self.get(key, expect)?;
        let (port, component) = port_of(key, target)?;
        if r.phase != Phase::Running {
            return Err(Error::FailedPrecondition(format!(
                "sandbox {key} is {:?}, not Running",
                r.phase
            )));
        }
        let agent = self.live_agent(&r)?;
        if agent.proxy_endpoint.is_empty() {
            return Err(Error::Unavailable(format!(
                "agent {} has no proxy endpoint",
                agent.agent_id
            )));
        }
        let token = self.access_token(&r);
        let headers = BTreeMap::from([
            (PROXY_TOKEN_HEADER.to_string(), token.clone()),
            (EXECD_TOKEN_HEADER.to_string(), token),
        ]);
        Ok(ResolvedRoute {
            proxy_endpoint: format!(
                "{}/{}/{port}",
                proxy_host(&agent.proxy_endpoint),
                r.sandbox_id
            ),
            port,
            component,
            headers,
            record: r,
        })
    }
}
