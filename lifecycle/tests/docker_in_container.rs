//! Station PRD: sandbolt's lifecycle runs INSIDE a container on the test
//! bed's dockerd, with the Docker socket as its only mount, and the official
//! SDK creates a sandbox through it, writes and reads a file, runs a command.
//! The image is built from scratch out of the static `sandbolt` and execd
//! binaries; its `sandbolt --version` must run too (issue 8).

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use bollard::Docker;
use bollard::models::{ContainerCreateBody, HostConfig, PortBinding};
use bollard::query_parameters::{
    CreateContainerOptions, ListContainersOptions, LogsOptions, RemoveContainerOptions,
    WaitContainerOptions,
};
use futures::StreamExt;
use sandbolt_testbed::{SANDBOLT_IMAGE_REF, sandbolt_image};

const LIFECYCLE_PORT: &str = "8080/tcp";
/// Where the socket is mounted inside the lifecycle container.
const SOCKET_IN_CONTAINER: &str = "/var/run/docker.sock";

fn connect(env: &common::DockerEnv) -> Docker {
    let socket = env.socket().to_str().expect("utf-8 socket path");
    Docker::connect_with_unix(socket, 120, bollard::API_DEFAULT_VERSION)
        .expect("bollard connects to the bed's dockerd")
}

async fn remove(docker: &Docker, name: &str) {
    let _ = docker
        .remove_container(
            name,
            Some(RemoveContainerOptions {
                force: true,
                ..Default::default()
            }),
        )
        .await;
}

async fn logs(docker: &Docker, name: &str) -> String {
    let opts = LogsOptions {
        stdout: true,
        stderr: true,
        ..Default::default()
    };
    let mut stream = docker.logs(name, Some(opts));
    let mut out = String::new();
    while let Some(chunk) = stream.next().await {
        match chunk {
            Ok(c) => out.push_str(&c.to_string()),
            Err(e) => {
                out.push_str(&format!("<logs error: {e}>"));
                break;
            }
        }
    }
    out
}

/// Runs the image with `args` to completion; returns (exit code, output).
async fn run_once(docker: &Docker, name: &str, args: &[&str]) -> (i64, String) {
    let body = ContainerCreateBody {
        image: Some(SANDBOLT_IMAGE_REF.into()),
        cmd: Some(args.iter().map(|s| s.to_string()).collect()),
        host_config: Some(HostConfig {
            network_mode: Some("none".into()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let opts = CreateContainerOptions {
        name: Some(name.into()),
        ..Default::default()
    };
    docker
        .create_container(Some(opts), body)
        .await
        .expect("create container");
    docker
        .start_container(name, None)
        .await
        .expect("start container");
    let mut wait = docker.wait_container(name, None::<WaitContainerOptions>);
    let code = match wait.next().await {
        Some(Ok(r)) => r.status_code,
        Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. })) => code,
        other => panic!("waiting for {name}: {other:?}"),
    };
    let out = logs(docker, name).await;
    remove(docker, name).await;
    (code, out)
}

/// IPv4 gateway of the engine's default bridge: an address of the Docker
/// host that both the host and containers on the bridge can reach.
async fn bridge_gateway(docker: &Docker) -> String {
    let net = docker
        .inspect_network("bridge", None)
        .await
        .expect("inspect the default bridge network");
    net.ipam
        .and_then(|i| i.config)
        .into_iter()
        .flatten()
        .find_map(|c| {
            c.gateway
                .filter(|g| g.parse::<std::net::Ipv4Addr>().is_ok())
        })
        .expect("the default bridge has an IPv4 gateway")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_in_a_container_with_only_the_docker_socket() {
    let env = common::docker_env();
    let image = tokio::task::spawn_blocking(sandbolt_image)
        .await
        .unwrap()
        .expect("sandbolt image builds from the static binaries");
    env.bed
        .docker_load(&image)
        .expect("sandbolt image loads into dockerd");
    let docker = connect(&env);

    // The shipped binary runs in its from-scratch image (no network at all).
    let (code, out) = run_once(&docker, "sandbolt-version", &["--version"]).await;
    assert_eq!(code, 0, "sandbolt --version failed in the image:\n{out}");
    assert_eq!(
        out.trim(),
        format!("sandbolt {}", env!("CARGO_PKG_VERSION")),
        "unexpected --version output"
    );

    let gateway = bridge_gateway(&docker).await;
    let name = "sandbolt-lifecycle";
    let socket = env.socket().to_str().unwrap().to_string();
    let cmd: Vec<String> = [
        "lifecycle",
        "--listen",
        "0.0.0.0:8080",
        "--api-key",
        common::API_KEY,
        "--docker-socket",
        SOCKET_IN_CONTAINER,
        "--data-dir",
        "/var/lib/sandbolt/lifecycle",
        // Sandbox ports go on the Docker host's bridge address: the test
        // (on the host) and this container (for the proxy) both reach it.
        "--publish-host-ip",
        &gateway,
        // The lifecycle is not in the engine's network namespace here: it
        // cannot install the isolation rules.
        "--docker-isolation",
        "off",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let body = ContainerCreateBody {
        image: Some(SANDBOLT_IMAGE_REF.into()),
        cmd: Some(cmd),
        exposed_ports: Some(vec![LIFECYCLE_PORT.into()]),
        host_config: Some(HostConfig {
            binds: Some(vec![format!("{socket}:{SOCKET_IN_CONTAINER}")]),
            port_bindings: Some(HashMap::from([(
                LIFECYCLE_PORT.to_string(),
                Some(vec![PortBinding {
                    host_ip: Some("127.0.0.1".into()),
                    host_port: Some(String::new()),
                }]),
            )])),
            security_opt: Some(vec!["no-new-privileges:true".into()]),
            ..Default::default()
        }),
        ..Default::default()
    };
    remove(&docker, name).await;
    docker
        .create_container(
            Some(CreateContainerOptions {
                name: Some(name.into()),
                ..Default::default()
            }),
            body,
        )
        .await
        .expect("create the lifecycle container");
    docker
        .start_container(name, None)
        .await
        .expect("start the lifecycle container");

    let info = docker
        .inspect_container(name, None)
        .await
        .expect("inspect the lifecycle container");
    // Only the Docker socket is mounted: no execd, no data dir from the host.
    let mounts = info.mounts.clone().unwrap_or_default();
    assert_eq!(mounts.len(), 1, "mounts: {mounts:?}");
    assert_eq!(
        mounts[0].destination.as_deref(),
        Some(SOCKET_IN_CONTAINER),
        "{mounts:?}"
    );
    let host_port: u16 = info
        .network_settings
        .and_then(|n| n.ports)
        .and_then(|p| p.get(LIFECYCLE_PORT).cloned().flatten())
        .and_then(|b| b.into_iter().find_map(|b| b.host_port?.parse().ok()))
        .expect("the lifecycle port is published");
    let domain = format!("127.0.0.1:{host_port}");

    // Ready when /health answers; bounded so a crash fails with its logs.
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ok = client
            .get(format!("http://{domain}/health"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ok {
            break;
        }
        if Instant::now() > deadline {
            let l = logs(&docker, name).await;
            remove(&docker, name).await;
            panic!("the containerized lifecycle never became healthy; its logs:\n{l}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The key is enforced in the container too.
    let r = client
        .get(format!("http://{domain}/v1/sandboxes"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), reqwest::StatusCode::UNAUTHORIZED);

    let addr = domain.parse().unwrap();
    let sandbox_image = env.image.clone();
    let gw = gateway.clone();
    let result = tokio::task::spawn_blocking(move || {
        std::panic::catch_unwind(|| {
            common::run_pytest_env(
                "lifecycle_container_test.py",
                addr,
                &sandbox_image,
                "docker-in-container",
                None,
                &[("SANDBOLT_ENDPOINT_HOST", gw.as_str())],
            )
        })
    })
    .await
    .unwrap();
    let lifecycle_logs = logs(&docker, name).await;
    if result.is_err() {
        println!("lifecycle container logs:\n{lifecycle_logs}");
    }

    // The SDK's kill went through the containerized lifecycle: no sandbox
    // (label opensandbox.io/id) is left on the engine.
    let left = docker
        .list_containers(Some(ListContainersOptions {
            all: true,
            filters: Some(HashMap::from([(
                "label".to_string(),
                vec![sandbolt_lifecycle::docker::LABEL_ID.to_string()],
            )])),
            ..Default::default()
        }))
        .await
        .unwrap();
    remove(&docker, name).await;
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
    assert!(left.is_empty(), "sandboxes left behind: {left:?}");
    assert!(
        lifecycle_logs.contains("sandbox created"),
        "the sandbox was not created by the containerized lifecycle:\n{lifecycle_logs}"
    );
}
