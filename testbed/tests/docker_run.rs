//! The test bed's dockerd runs the locally built busybox image through the
//! Docker engine API (bollard).

use bollard::Docker;
use bollard::models::ContainerCreateBody;
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, LogsOptionsBuilder, RemoveContainerOptionsBuilder,
    WaitContainerOptions,
};
use futures::StreamExt;
use sandbolt_testbed::{Testbed, busybox_image};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_busybox_through_docker_api() {
    let bed = Testbed::start_with_docker().expect("start test bed with docker");
    bed.docker_load(&busybox_image().unwrap())
        .expect("import busybox into docker");
    let socket = bed.docker_socket().unwrap().to_str().unwrap().to_string();
    let docker = Docker::connect_with_unix(&socket, 60, bollard::API_DEFAULT_VERSION)
        .expect("connect to the bed's dockerd");

    let body = ContainerCreateBody {
        image: Some("busybox:latest".into()),
        cmd: Some(vec![
            "sh".into(),
            "-c".into(),
            "echo hello-from-docker".into(),
        ]),
        ..Default::default()
    };
    let created = docker
        .create_container(
            Some(
                CreateContainerOptionsBuilder::new()
                    .name("tb-docker-echo")
                    .build(),
            ),
            body,
        )
        .await
        .expect("create container");
    docker
        .start_container(
            &created.id,
            None::<bollard::query_parameters::StartContainerOptions>,
        )
        .await
        .expect("start container");
    let waited: Vec<_> = docker
        .wait_container(&created.id, None::<WaitContainerOptions>)
        .collect()
        .await;
    assert!(
        waited.iter().all(|w| w.is_ok()),
        "container exited non-zero: {waited:?}"
    );
    let mut logs = docker.logs(
        &created.id,
        Some(LogsOptionsBuilder::new().stdout(true).stderr(true).build()),
    );
    let mut output = String::new();
    while let Some(chunk) = logs.next().await {
        output.push_str(&chunk.expect("log chunk").to_string());
    }
    assert_eq!(output.trim(), "hello-from-docker");
    docker
        .remove_container(
            &created.id,
            Some(RemoveContainerOptionsBuilder::new().force(true).build()),
        )
        .await
        .expect("remove container");
}
