//! containerd's event stream → sandbox phases. When the stream breaks
//! (containerd restarted), resubscribe with backoff and re-read every task,
//! since exits may have happened while nobody listened.

use std::sync::Arc;
use std::time::Duration;

use backon::Retryable;
use containerd_client::events::{TaskExit, TaskOom};
use containerd_client::services::v1::SubscribeRequest;
use containerd_client::types::Envelope;
use futures::StreamExt;
use prost::Message;
use sandbolt_node::retry;
use tokio::sync::watch;
use tonic::Streaming;

use crate::sandbox::Sandboxes;

const TOPIC_EXIT: &str = "/tasks/exit";
const TOPIC_OOM: &str = "/tasks/oom";

/// Resubscribe delays: from [`FIRST_RETRY`], doubling, at most [`MAX_RETRY`].
const FIRST_RETRY: Duration = Duration::from_millis(50);
const MAX_RETRY: Duration = Duration::from_secs(5);

/// Runs until `shutdown` turns true.
pub async fn run(sandboxes: Arc<Sandboxes>, mut shutdown: watch::Receiver<bool>) {
    let ns = sandboxes.containerd().namespace().to_string();
    let filters = vec![
        format!("topic==\"{TOPIC_EXIT}\",namespace==\"{ns}\""),
        format!("topic==\"{TOPIC_OOM}\",namespace==\"{ns}\""),
    ];
    let mut after_break = false;
    loop {
        let subscribed = tokio::select! {
            _ = shutdown.wait_for(|s| *s) => return,
            s = subscribe(&sandboxes, &filters, after_break) => s,
        };
        if let Some(stream) = subscribed {
            tokio::select! {
                _ = shutdown.wait_for(|s| *s) => return,
                () = follow(&sandboxes, stream) => {}
            }
        }
        after_break = true;
    }
}

/// Subscribes, retrying with backoff until containerd answers. Every attempt
/// re-reads the tasks: exits between the last read (recovery, or before the
/// stream broke) and this subscription would otherwise be lost.
async fn subscribe(
    sandboxes: &Arc<Sandboxes>,
    filters: &[String],
    after_break: bool,
) -> Option<Streaming<Envelope>> {
    let ctrd = sandboxes.containerd();
    let mut after_failure = after_break;
    let attempt = || {
        let wait_ready = std::mem::replace(&mut after_failure, true);
        async move {
            // A failed subscribe or a broken stream means containerd is (or
            // was) down: make sure this attempt is not reconciled against a
            // half-up daemon.
            if wait_ready {
                let _ = ctrd.wait_ready(MAX_RETRY).await;
            }
            reconcile_soon(sandboxes.clone());
            ctrd.events()
                .subscribe(SubscribeRequest {
                    filters: filters.to_vec(),
                })
                .await
        }
    };
    attempt
        .retry(retry::doubling(FIRST_RETRY, MAX_RETRY))
        .notify(|s, retry_in| {
            tracing::warn!(error = %s, ?retry_in, "subscribing to containerd events failed; retrying");
        })
        .await
        .map(tonic::Response::into_inner)
        .ok()
}

/// containerd only answers a subscription with its first event, so the
/// re-read cannot wait for that answer; a short delay lets the subscription
/// register first, so an exit lands in the re-read or in the stream.
fn reconcile_soon(sandboxes: Arc<Sandboxes>) {
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        sandboxes.reconcile().await;
    });
}

/// Applies events until the stream breaks or ends.
async fn follow(sandboxes: &Sandboxes, mut stream: Streaming<Envelope>) {
    loop {
        match stream.next().await {
            Some(Ok(env)) => apply(sandboxes, env),
            Some(Err(s)) => {
                tracing::warn!(error = %s, "containerd event stream broke");
                return;
            }
            None => {
                tracing::warn!("containerd event stream ended");
                return;
            }
        }
    }
}

fn apply(sandboxes: &Sandboxes, env: Envelope) {
    let Some(any) = env.event else { return };
    match env.topic.as_str() {
        TOPIC_EXIT => match TaskExit::decode(any.value.as_slice()) {
            // Only the init process (id == container id) ends the sandbox;
            // exec'd processes do not.
            Ok(e) if e.id == e.container_id => sandboxes.on_exit(&e.container_id, e.exit_status),
            Ok(_) => {}
            Err(err) => tracing::warn!(error = %err, "undecodable TaskExit"),
        },
        TOPIC_OOM => {
            if let Ok(e) = TaskOom::decode(any.value.as_slice()) {
                sandboxes.on_oom(&e.container_id);
            }
        }
        _ => {}
    }
}
