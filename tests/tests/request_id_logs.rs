//! One request id across the processes of one create (issue 20's Done-when):
//! the official Python SDK creates a sandbox through the lifecycle API with
//! a known `X-Request-ID`; the lifecycle, the controller and the agent each
//! run as their own process, and each one's log output carries that id on
//! the lines of that create. The delete goes without the id, so the id can
//! only reach the logs through the create.

use crate::support::observed::Stack;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_sdk_create_carries_its_request_id_into_every_components_log() {
    let stack = Stack::start().await;
    let request_id = format!("obs-{}", std::process::id());
    let run = stack.sdk("create", Some(&request_id)).await;
    stack.delete(&run.sandbox_id).await;
    stack.wait_no_containers().await;

    // As a span field (`grpc{request_id=… rpc=…}`, `http{request_id=…}`):
    // carried by the hop's own span, not merely echoed in a message.
    let field = format!("request_id={request_id}");
    let lines = |component: &str| -> Vec<String> {
        stack
            .output(component)
            .lines()
            .filter(|l| l.contains(&field))
            .map(str::to_string)
            .collect()
    };
    let lifecycle = lines("lifecycle");
    let controller = lines("controller");
    let agent = lines("agent");
    let logs = stack.logs();
    // Each hop's lines of the create: the REST call, then the gRPC calls it
    // made, named by their method.
    assert!(
        lifecycle.iter().any(|l| l.contains("POST")),
        "the lifecycle logged no create with {request_id}: {lifecycle:#?}\n{logs}"
    );
    assert!(
        controller.iter().any(|l| l.contains("CreateSandbox")),
        "the controller logged no create with {request_id}: {controller:#?}\n{logs}"
    );
    assert!(
        agent.iter().any(|l| l.contains("CreateSandbox")),
        "the agent logged no create with {request_id}: {agent:#?}\nits create lines: {:#?}\n{logs}",
        stack
            .output("agent")
            .lines()
            .filter(|l| l.contains("CreateSandbox"))
            .collect::<Vec<_>>()
    );
    stack.stop().await;
}
