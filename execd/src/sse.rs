//! Stream events of `/command` and `/session/{id}/run`.
//!
//! The wire format is the original execd's: each event is one bare JSON object
//! followed by a blank line (`{...}\n\n`), no `data:` prefix.

use std::convert::Infallible;

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use bytes::Bytes;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::util::now_millis;

#[derive(Serialize, Debug, Clone, Default)]
pub struct ErrorDetail {
    pub ename: String,
    pub evalue: String,
    pub traceback: Vec<String>,
}

/// One `ServerStreamEvent`.
#[derive(Serialize, Debug, Clone)]
pub struct Event {
    #[serde(rename = "type")]
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub execution_time: Option<i64>,
    pub timestamp: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorDetail>,
}

impl Event {
    fn new(kind: &'static str) -> Self {
        Self {
            kind,
            text: None,
            execution_time: None,
            timestamp: now_millis(),
            error: None,
        }
    }
    pub fn init(id: &str) -> Self {
        Self {
            text: Some(id.to_string()),
            ..Self::new("init")
        }
    }
    pub fn stdout(text: String) -> Self {
        Self {
            text: Some(text),
            ..Self::new("stdout")
        }
    }
    pub fn stderr(text: String) -> Self {
        Self {
            text: Some(text),
            ..Self::new("stderr")
        }
    }
    pub fn ping() -> Self {
        Self {
            text: Some("pong".into()),
            ..Self::new("ping")
        }
    }
    pub fn complete(elapsed_ms: i64) -> Self {
        Self {
            execution_time: Some(elapsed_ms),
            ..Self::new("execution_complete")
        }
    }
    /// The terminal event of a failed command: `evalue` is the exit code as a string.
    pub fn error(exit_code: i32, message: String) -> Self {
        Self {
            error: Some(ErrorDetail {
                ename: "CommandExecError".into(),
                evalue: exit_code.to_string(),
                traceback: vec![message],
            }),
            ..Self::new("error")
        }
    }

    pub fn frame(&self) -> Bytes {
        let mut v = serde_json::to_vec(self).unwrap_or_else(|_| b"{}".to_vec());
        v.extend_from_slice(b"\n\n");
        Bytes::from(v)
    }
}

/// Sender half of an event stream; `send` reports whether the client is still there.
#[derive(Clone)]
pub struct EventTx(mpsc::Sender<Result<Bytes, Infallible>>);

impl EventTx {
    pub async fn send(&self, ev: Event) -> bool {
        self.0.send(Ok(ev.frame())).await.is_ok()
    }
    /// Resolves when the client has gone away.
    pub async fn closed(&self) {
        self.0.closed().await
    }
}

/// A streaming SSE answer and the sender feeding it.
pub fn stream() -> (EventTx, Response) {
    let (tx, rx) = mpsc::channel(64);
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut resp = Response::new(body);
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    (EventTx(tx), resp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_bare_json_and_blank_line() {
        let f = Event::init("abc").frame();
        let s = std::str::from_utf8(&f).unwrap();
        assert!(s.starts_with("{\"type\":\"init\",\"text\":\"abc\",\"timestamp\":"));
        assert!(s.ends_with("}\n\n"));
        let e = Event::error(3, "exit status 3".into()).frame();
        let v: serde_json::Value = serde_json::from_slice(&e[..e.len() - 2]).unwrap();
        assert_eq!(v["error"]["evalue"], "3");
        assert_eq!(v["type"], "error");
    }
}
