//! containerd's event stream → sandbox phases. When the stream breaks
//! (containerd restarted), resubscribe with backoff and re-read every task,
//! since exits may have happened while nobody listened.

use std::sync::Arc;
use std::time::Duration;

use containerd_client::events::{TaskExit, TaskOom};
use containerd_client::services::v1::SubscribeRequest;
use futures::StreamExt;
use prost::Message;
use tokio::sync::watch;

use crate::sandbox::Sandboxes;

const TOPIC_EXIT: &str = "/tasks/exit";
const TOPIC_OOM: &str = "/tasks/oom";

/// Runs until `shutdown` turns true.
pub async fn run(sandboxes: Arc<Sandboxes>, mut shutdown: watch::Receiver<bool>) {
    let ns = sandboxes.containerd().namespace().to_string();
    let filters = vec![
        format!("topic==\"{TOPIC_EXIT}\",namespace==\"{ns}\""),
        format!("topic==\"{TOPIC_OOM}\",namespace==\"{ns}\""),
    ];
    let mut backoff = Duration::from_millis(50);
    loop {
        if *shutdown.borrow() {
            return;
        }
        let ctrd = sandboxes.containerd().clone();
        // Exits between the last read of the tasks (recovery, or before the
        // stream broke) and this subscription would be lost: re-read every
        // task. containerd only answers a subscription with its first event,
        // so the re-read cannot wait for that answer; a short delay lets the
        // subscription register first, so an exit lands in the re-read or in
        // the stream.
        let s = sandboxes.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            s.reconcile().await;
        });
        let mut events_client = ctrd.events();
        let sub = tokio::select! {
            _ = shutdown.wait_for(|s| *s) => return,
            sub = events_client.subscribe(SubscribeRequest { filters: filters.clone() }) => sub,
        };
        match sub {
            Ok(stream) => {
                backoff = Duration::from_millis(50);
                let mut stream = stream.into_inner();
                loop {
                    let next = tokio::select! {
                        _ = shutdown.wait_for(|s| *s) => return,
                        n = stream.next() => n,
                    };
                    match next {
                        Some(Ok(env)) => {
                            let Some(any) = env.event else { continue };
                            match env.topic.as_str() {
                                TOPIC_EXIT => match TaskExit::decode(any.value.as_slice()) {
                                    // Only the init process (id == container id)
                                    // ends the sandbox; exec'd processes do not.
                                    Ok(e) if e.id == e.container_id => {
                                        sandboxes.on_exit(&e.container_id, e.exit_status)
                                    }
                                    Ok(_) => {}
                                    Err(err) => {
                                        tracing::warn!(error = %err, "undecodable TaskExit")
                                    }
                                },
                                TOPIC_OOM => {
                                    if let Ok(e) = TaskOom::decode(any.value.as_slice()) {
                                        sandboxes.on_oom(&e.container_id);
                                    }
                                }
                                _ => {}
                            }
                        }
                        Some(Err(s)) => {
                            tracing::warn!(error = %s, "containerd event stream broke");
                            break;
                        }
                        None => {
                            tracing::warn!("containerd event stream ended");
                            break;
                        }
                    }
                }
            }
            Err(s) => {
                tracing::warn!(error = %s, ?backoff, "subscribing to containerd events failed; retrying");
            }
        }
        tokio::select! {
            _ = shutdown.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
        // A failed subscribe means containerd is down: make sure the next
        // attempt is not reconciled against a half-up daemon.
        let _ = ctrd.wait_ready(backoff).await;
    }
}
