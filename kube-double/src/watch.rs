//! The body of a watch response: newline-delimited `WatchEvent` JSON,
//! streamed as the store records writes.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use hyper::body::Frame;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::time::{Instant, Interval};

use crate::kinds::Kind;
use crate::selectors::{FieldSelector, LabelSelector};
use crate::server::Shared;
use crate::store::{Event, WatchSetup};

/// How often a watch that asked for bookmarks gets one. The real server
/// sends them about once a minute; tests want progress sooner.
pub const BOOKMARK_INTERVAL: Duration = Duration::from_secs(1);

pub(crate) struct WatchOptions {
    pub labels: LabelSelector,
    pub fields: FieldSelector,
    pub timeout: Option<Duration>,
    pub bookmarks: bool,
    /// `sendInitialEvents=true`: end the initial ADDED burst with a bookmark
    /// annotated `k8s.io/initial-events-end`.
    pub initial_events_end: Option<u64>,
}

struct State {
    shared: Arc<Shared>,
    kind: Kind,
    labels: LabelSelector,
    fields: FieldSelector,
    pending: VecDeque<Bytes>,
    rx: mpsc::UnboundedReceiver<Arc<Event>>,
    deadline: Option<Instant>,
    ticker: Option<Interval>,
    done: bool,
}

fn line(etype: &str, object: &Value) -> Bytes {
    let mut out = format!("{{\"type\":\"{etype}\",\"object\":").into_bytes();
    serde_json::to_writer(&mut out, object).expect("JSON values serialize");
    out.extend_from_slice(b"}\n");
    Bytes::from(out)
}

fn bookmark(kind: &Kind, rv: u64, initial_end: bool) -> Bytes {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line(
        "BOOKMARK",
        &json!({"kind": kind.kind, "apiVersion": kind.api_version(), "metadata": metadata}),
    )
}

impl State {
    fn push(&mut self, event: &Event) {
        if self.labels.matches(&event.object) && self.fields.matches(&event.object) {
            self.pending
                .push_back(line(event.etype.as_str(), &event.object));
        }
    }

    /// Bookmark at the store's current version. Holding the store lock
    /// while draining the channel guarantees every event at or below that
    /// version is sent before the bookmark that claims it.
    fn push_bookmark(&mut self) {
        let shared = self.shared.clone();
        let store = shared.store.lock();
        let rv = store.resource_version();
        while let Ok(event) = self.rx.try_recv() {
            self.push(&event);
        }
        drop(store);
        self.pending.push_back(bookmark(&self.kind, rv, false));
    }
}

async fn next_frame(mut st: State) -> Option<(Result<Frame<Bytes>, Infallible>, State)> {
    loop {
        if let Some(bytes) = st.pending.pop_front() {
            return Some((Ok(Frame::data(bytes)), st));
        }
        if st.done {
            return None;
        }
        let deadline = st.deadline;
        let timeout = async move {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => futures::future::pending().await,
            }
        };
        let ticker = st.ticker.as_mut();
        let tick = async move {
            match ticker {
                Some(t) => {
                    t.tick().await;
                }
                None => futures::future::pending().await,
            }
        };
        enum Wake {
            Event(Option<Arc<Event>>),
            Timeout,
            Tick,
        }
        let wake = tokio::select! {
            ev = st.rx.recv() => Wake::Event(ev),
            () = timeout => Wake::Timeout,
            () = tick => Wake::Tick,
        };
        match wake {
            Wake::Event(Some(ev)) => st.push(&ev),
            // The store dropped our sender: close_watches, an outage.
            Wake::Event(None) | Wake::Timeout => st.done = true,
            Wake::Tick => st.push_bookmark(),
        }
    }
}

/// The frames of one watch response.
pub(crate) fn stream(
    shared: Arc<Shared>,
    kind: Kind,
    setup: WatchSetup,
    opts: WatchOptions,
) -> impl Stream<Item = Result<Frame<Bytes>, Infallible>> + Send + 'static {
    let mut st = State {
        shared,
        kind,
        labels: opts.labels,
        fields: opts.fields,
        pending: VecDeque::new(),
        rx: setup.rx,
        deadline: opts.timeout.map(|t| Instant::now() + t),
        ticker: opts.bookmarks.then(|| {
            let mut t =
                tokio::time::interval_at(Instant::now() + BOOKMARK_INTERVAL, BOOKMARK_INTERVAL);
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            t
        }),
        done: false,
    };
    if let Some(err) = setup.expired {
        // The server answers 200 and reports the 410 inside the stream.
        st.pending.push_back(line("ERROR", &err.to_status()));
        st.done = true;
    } else {
        for event in &setup.initial {
            st.push(event);
        }
        if let Some(rv) = opts.initial_events_end {
            st.pending.push_back(bookmark(&st.kind, rv, true));
        }
    }
    futures::stream::unfold(st, next_frame)
}
