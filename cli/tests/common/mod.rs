//! What the tests that run `sandbolt agent` processes share.

#![allow(dead_code)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use sandbolt_janitor::ControllerOwnership;

use sandbolt_proto::fastpath::v2 as fp;
use sandbolt_proto::fastpath::v2::fast_path_service_client::FastPathServiceClient;
use sandbolt_test_support::{free_port, http};
use sandbolt_testbed::Testbed;
use tonic::transport::Channel;

/// What an agent and a janitor on the same node are both told.
pub struct NodeFlags<'a> {
    pub node: &'a str,
    pub containerd_namespace: &'a str,
    /// The controller's endpoint (`http://…`).
    pub controller: String,
    /// The agents' API token, also the one presented to the controller.
    pub token: &'a str,
}

impl<'a> NodeFlags<'a> {
    pub fn new(
        node: &'a str,
        containerd_namespace: &'a str,
        controller: String,
        token: &'a str,
    ) -> Self {
        Self {
            node,
            containerd_namespace,
            controller,
            token,
        }
    }

    /// These flags and the bed's containerd socket, after the subcommand.
    fn apply(&self, cmd: &mut Command, bed: &Testbed) {
        cmd.args([
            "--node-name",
            self.node,
            "--containerd-namespace",
            self.containerd_namespace,
            "--controller",
            &self.controller,
            "--token",
            self.token,
        ])
        .arg("--containerd-socket")
        .arg(bed.containerd_socket());
    }
}

/// The flags of one `sandbolt agent` process on a test bed's containerd.
pub struct AgentFlags<'a> {
    pub id: &'a str,
    pub on_node: NodeFlags<'a>,
    /// Where its data-plane proxy listens (`host:port`).
    pub proxy_listen: &'a str,
    pub state_dir: &'a Path,
    /// Its own pool, so that placement cannot pick another agent.
    pub pool: Option<&'a str>,
}

impl AgentFlags<'_> {
    /// `cmd` (a `sandbolt` command) with `agent` and these flags; the
    /// static execd, the bed's socket and a free API port filled in.
    pub fn apply(&self, cmd: &mut Command, bed: &Testbed) {
        cmd.arg("agent");
        self.on_node.apply(cmd, bed);
        cmd.args([
            "--agent-id",
            self.id,
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--proxy-listen",
            self.proxy_listen,
        ])
        .arg("--execd-bin")
        .arg(sandbolt_testbed::execd_binary().expect("static execd"))
        .arg("--state-dir")
        .arg(self.state_dir)
        // These agents are killed with SIGKILL on purpose, and what a killed
        // agent's networking leaves is taken back by the next agent on the
        // same state dir, not by these tests: that is tested in
        // agent/tests/network.rs (`a_crashed_agents_network_is_taken_back`).
        .args(["--network", "none"]);
        if let Some(pool) = self.pool {
            cmd.args(["--pool", pool]);
        }
    }
}

/// The flags of one `sandbolt janitor` process on a test bed's containerd.
pub struct JanitorFlags<'a> {
    pub on_node: NodeFlags<'a>,
    /// The agents' state dir (their log files are the janitor's to reap).
    pub agent_state_dir: &'a Path,
    pub state_dir: &'a Path,
}

impl JanitorFlags<'_> {
    /// `cmd` (a `sandbolt` command) with `janitor`, these flags, the bed's
    /// socket, and then `extra` (intervals, `--once`).
    pub fn apply(&self, cmd: &mut Command, bed: &Testbed, extra: &[&str]) {
        cmd.arg("janitor");
        self.on_node.apply(cmd, bed);
        cmd.arg("--agent-state-dir")
            .arg(self.agent_state_dir)
            .arg("--state-dir")
            .arg(self.state_dir)
            .args(extra);
    }
}

/// Sandbox `name` in the `default` namespace, any uid.
pub fn reference(name: &str) -> fp::SandboxReference {
    fp::SandboxReference {
        namespaced_name: Some(fp::NamespacedName {
            namespace: "default".into(),
            name: name.into(),
        }),
        expected_uid: String::new(),
    }
}

/// One request to sandbox `name`'s execd through the agent's data-plane
/// proxy, as a client makes it: ResolveEndpoint gives the route and the
/// headers. Returns (status, body).
pub async fn execd_via_proxy(
    fastpath: &mut FastPathServiceClient<Channel>,
    name: &str,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String) {
    let ep = fastpath
        .resolve_endpoint(fp::ResolveEndpointRequest {
            sandbox: Some(reference(name)),
            target: Some(fp::EndpointTarget {
                target: Some(fp::endpoint_target::Target::ComponentName("execd".into())),
            }),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("resolve endpoint of {name}: {e:?}"))
        .into_inner();
    let headers: Vec<(String, String)> = ep.required_headers.into_iter().collect();
    http::request(&ep.proxy_endpoint, method, path, &headers, body).await
}

/// The janitor's view of the controller at `endpoint`, with the agents'
/// `token`.
pub fn ownership(endpoint: &str, token: &str) -> ControllerOwnership {
    ControllerOwnership::new(endpoint, token, Duration::from_secs(5)).expect("ownership client")
}

/// A FastPath v2 client of the controller at `endpoint`.
pub async fn fastpath(endpoint: &str) -> FastPathServiceClient<Channel> {
    FastPathServiceClient::connect(endpoint.to_string())
        .await
        .unwrap_or_else(|e| panic!("fastpath at {endpoint} connects: {e}"))
}
