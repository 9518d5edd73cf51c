//! Shared state of a running double (store, faults, counters) and the
//! accept loop that serves it over HTTP/1.1.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinSet;

use crate::store::Store;

struct Fault {
    verb: String,
    plural: String,
    code: u16,
    remaining: usize,
}

pub(crate) struct Shared {
    pub store: Mutex<Store>,
    pub token: String,
    unavailable: AtomicBool,
    faults: Mutex<Vec<Fault>>,
    /// Requests per (verb, "plural" or "plural/subresource").
    counts: Mutex<HashMap<(String, String), usize>>,
}

/// `pattern` "*" matches anything; "sandboxes" also matches the
/// subresource "sandboxes/status"; "sandboxes/status" matches only it.
fn resource_matches(pattern: &str, resource: &str) -> bool {
    pattern == "*"
        || pattern == resource
        || resource
            .strip_prefix(pattern)
            .is_some_and(|rest| rest.starts_with('/'))
}

impl Shared {
    pub fn new(token: String) -> Self {
        Shared {
            store: Mutex::new(Store::new()),
            token,
            unavailable: AtomicBool::new(false),
            faults: Mutex::new(Vec::new()),
            counts: Mutex::new(HashMap::new()),
        }
    }

    pub fn is_unavailable(&self) -> bool {
        self.unavailable.load(Ordering::SeqCst)
    }

    pub fn set_unavailable(&self, unavailable: bool) {
        self.unavailable.store(unavailable, Ordering::SeqCst);
        if unavailable {
            self.store.lock().close_watches();
        }
    }

    pub fn add_fault(&self, verb: &str, plural: &str, code: u16, count: usize) {
        if count > 0 {
            self.faults.lock().push(Fault {
                verb: verb.to_string(),
                plural: plural.to_string(),
                code,
                remaining: count,
            });
        }
    }

    /// Consumes one injected failure matching this request, oldest first.
    pub fn take_fault(&self, verb: &str, resource: &str) -> Option<u16> {
        let mut faults = self.faults.lock();
        let i = faults.iter().position(|f| {
            (f.verb == "*" || f.verb == verb) && resource_matches(&f.plural, resource)
        })?;
        let code = faults[i].code;
        faults[i].remaining -= 1;
        if faults[i].remaining == 0 {
            faults.remove(i);
        }
        Some(code)
    }

    pub fn count(&self, verb: &str, resource: &str) {
        *self
            .counts
            .lock()
            .entry((verb.to_string(), resource.to_string()))
            .or_default() += 1;
    }

    pub fn requests(&self, verb: &str, plural: &str) -> usize {
        self.counts
            .lock()
            .iter()
            .filter(|((v, r), _)| (verb == "*" || verb == v) && resource_matches(plural, r))
            .map(|(_, n)| n)
            .sum()
    }
}

/// Serves until `stop` fires or the task is aborted. Connections live in a
/// JoinSet owned by this task, so ending it also ends every connection and
/// every open watch, as a server going away would.
pub(crate) async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let shared = shared.clone();
                conns.spawn(async move {
                    let svc = service_fn(move |req| crate::http::handle(shared.clone(), req));
                    if let Err(err) = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await
                    {
                        tracing::debug!(%err, "kube double connection ended");
                    }
                });
            }
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_and_counts() {
        let s = Shared::new("t".into());
        s.add_fault("update", "sandboxes", 409, 2);
        assert_eq!(s.take_fault("get", "sandboxes"), None);
        assert_eq!(s.take_fault("update", "sandboxes/status"), Some(409));
        assert_eq!(s.take_fault("update", "sandboxesx"), None);
        assert_eq!(s.take_fault("update", "sandboxes"), Some(409));
        assert_eq!(s.take_fault("update", "sandboxes"), None);
        s.count("update", "sandboxes");
        s.count("update", "sandboxes/status");
        assert_eq!(s.requests("update", "sandboxes"), 2);
        assert_eq!(s.requests("update", "sandboxes/status"), 1);
        assert_eq!(s.requests("*", "*"), 2);
    }
}
