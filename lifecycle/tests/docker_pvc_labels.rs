//! A Docker `pvc` mounts only volumes sandbolt made: the engine holds other
//! applications' named volumes too, and a sandbox naming one must not read
//! or write their data. Real test-bed dockerd.

use crate::common;

use std::collections::HashMap;

use bollard::Docker;
use bollard::models::VolumeCreateRequest;
use bollard::query_parameters::RemoveVolumeOptions;
use common::{call, sh};
use reqwest::{Method as M, StatusCode};
use serde_json::{Value, json};

fn engine(env: &common::DockerEnv) -> Docker {
    Docker::connect_with_unix(
        env.socket().to_str().unwrap(),
        120,
        bollard::API_DEFAULT_VERSION,
    )
    .expect("bollard connects to the bed's dockerd")
}

fn body(image: &str, claim: &str, create_if_missing: bool) -> Value {
    json!({
        "image": {"uri": image},
        "entrypoint": ["sleep", "infinity"],
        "timeout": 600,
        "resourceLimits": {},
        "volumes": [{"name": "d", "mountPath": "/d",
                     "pvc": {"claimName": claim, "createIfNotExists": create_if_missing}}],
    })
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

async fn make_volume(docker: &Docker, name: &str, labels: &[(&str, &str)]) {
    docker
        .create_volume(VolumeCreateRequest {
            name: Some(name.to_string()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<HashMap<_, _>>(),
            ),
            ..Default::default()
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_volumes_sandbolt_made_are_mounted() {
    let env = common::docker_env();
    let docker = engine(&env);
    let h = env.start().await;
    let base = format!("http://{}", h.addr());

    // Another application's volume (as `docker volume create` leaves it,
    // and one with unrelated labels): refused with 403 naming it, whether
    // or not the request would have created it, and no sandbox is left.
    let foreign = unique("foreign");
    let labelled = unique("foreign-labelled");
    make_volume(&docker, &foreign, &[]).await;
    make_volume(
        &docker,
        &labelled,
        &[
            ("com.example.app", "db"),
            ("opensandbox.io/sandbolt-managed", "false"),
        ],
    )
    .await;
    for (name, create) in [(&foreign, false), (&foreign, true), (&labelled, false)] {
        let (s, v) = call(
            M::POST,
            format!("{base}/v1/sandboxes"),
            Some(body(&env.image, name, create)),
        )
        .await;
        assert_eq!(s, StatusCode::FORBIDDEN, "{name}: {v}");
        assert_eq!(v["code"], "VOLUME::NOT_MANAGED", "{v}");
        assert!(
            v["message"].as_str().unwrap().contains(name.as_str()),
            "{v}"
        );
    }
    let (_, list) = call(M::GET, format!("{base}/v1/sandboxes"), None).await;
    assert_eq!(list["pagination"]["totalItems"], 0, "{list}");
    // The foreign volume is untouched (not labelled, not removed).
    let v = docker.inspect_volume(&foreign).await.unwrap();
    assert!(v.labels.is_empty(), "{v:?}");

    // One labelled for sandboxes by an operator mounts.
    let provisioned = unique("provisioned");
    make_volume(
        &docker,
        &provisioned,
        &[("opensandbox.io/sandbolt-managed", "true")],
    )
    .await;
    let (s, a) = call(
        M::POST,
        format!("{base}/v1/sandboxes"),
        Some(body(&env.image, &provisioned, false)),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{a}");
    let a = a["id"].as_str().unwrap().to_string();
    let out = sh(&base, &a, "echo ok > /d/f && cat /d/f").await;
    assert_eq!(out.stdout, "ok\n", "{out:?}");

    // One a sandbox's create made carries the label, and a later sandbox
    // mounts it by name.
    let made = unique("made");
    let (s, b) = call(
        M::POST,
        format!("{base}/v1/sandboxes"),
        Some(body(&env.image, &made, true)),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    let b = b["id"].as_str().unwrap().to_string();
    let v = docker.inspect_volume(&made).await.unwrap();
    assert_eq!(
        v.labels
            .get("opensandbox.io/sandbolt-managed")
            .map(String::as_str),
        Some("true"),
        "{v:?}"
    );
    sh(&base, &b, "echo shared > /d/g").await;
    let (s, c) = call(
        M::POST,
        format!("{base}/v1/sandboxes"),
        Some(body(&env.image, &made, false)),
    )
    .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{c}");
    let c = c["id"].as_str().unwrap().to_string();
    let out = sh(&base, &c, "cat /d/g").await;
    assert_eq!(out.stdout, "shared\n", "{out:?}");

    for id in [a, b, c] {
        let (s, v) = call(M::DELETE, format!("{base}/v1/sandboxes/{id}"), None).await;
        assert_eq!(s, StatusCode::NO_CONTENT, "{v}");
    }
    for v in [foreign, labelled, provisioned, made] {
        docker
            .remove_volume(&v, None::<RemoveVolumeOptions>)
            .await
            .unwrap();
    }
    h.shutdown().await.unwrap();
}
