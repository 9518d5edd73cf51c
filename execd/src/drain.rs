//! Request bodies are read to their end before the answer goes out (or the answer says
//! `Connection: close`).
//!
//! Why this exists: hyper's HTTP/1 server writes the response head in the same poll in
//! which the handler's future completes. Only on its *next* read pass does it notice that
//! the handler dropped the request body before its end; it then reads what is already
//! buffered and, if the body is still not complete, stops reading and closes the
//! connection once the answer is out. The head has already gone out as keep-alive
//! (no `Connection: close`), so the client pools the connection, sends its next request
//! on it, and gets "Server disconnected without sending a response" (httpx/httpcore).
//!
//! Any handler can leave a body unfinished: the upload handler stops at multipart's
//! closing boundary, so the epilogue CRLF or the chunked terminator are unread when
//! they arrive in a later segment; rejections (401, 404, 405, a bad upload part) return
//! without reading at all. Hence one layer around the whole router rather than care in
//! each handler: it hands the handler a body that gives itself back when dropped
//! unfinished, and after the handler drains that leftover, bounded in bytes and time,
//! before returning the answer. If the leftover is too big, too slow, or broken, the
//! answer carries an explicit `Connection: close`, which hyper honours and clients
//! respect, instead of a keep-alive promise the server then breaks.
//!
//! A body still held elsewhere when the handler returns (the proxy's upstream
//! connection streaming it) is left to its holder: it is being read.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::http::{HeaderValue, header};
use axum::middleware::Next;
use axum::response::Response;
use http_body_util::BodyExt;
use hyper::body::{Frame, SizeHint};

/// Most leftover body bytes read to keep a connection alive. Leftovers are normally a
/// few bytes (epilogue, chunked terminator) or a rejected request's body; past this, a
/// new connection is cheaper than reading on.
pub const DRAIN_LIMIT: u64 = 8 * 1024 * 1024;
/// Longest wait for the leftover of a body (a stalled client must not hold its answer).
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// What the handler left unread, handed back by [`Tracked`]'s `Drop`.
struct Leftover {
    body: Body,
    /// Whether the handler read from the body at all.
    polled: bool,
}

type Slot = Arc<Mutex<Option<Leftover>>>;

/// The request body as the handler sees it: the original, which it puts into `slot`
/// when dropped before its end.
struct Tracked {
    inner: Body,
    polled: bool,
    slot: Slot,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        self.polled = true;
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if !self.inner.is_end_stream() {
            let body = std::mem::take(&mut self.inner);
            *self.slot.lock().unwrap_or_else(PoisonError::into_inner) = Some(Leftover {
                body,
                polled: self.polled,
            });
        }
    }
}

/// Middleware: see the module documentation.
pub async fn drain_request_body(req: Request, next: Next) -> Response {
    // A client waiting for `100 Continue` has not sent the body; reading it would ask
    // for an upload the answer already refuses.
    let expects_continue = req
        .headers()
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let slot = Slot::default();
    let req = req.map(|inner| {
        Body::new(Tracked {
            inner,
            polled: false,
            slot: slot.clone(),
        })
    });
    let mut resp = next.run(req).await;
    let leftover = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
    if let Some(l) = leftover {
        // Unsolicited (100-continue never sent): nothing to drain, the client must not
        // send the body on this connection.
        let solicited = l.polled || !expects_continue;
        let clean = solicited && drain(l.body, DRAIN_LIMIT, DRAIN_TIMEOUT).await;
        if !clean {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
    }
    resp
}

/// Reads `body` to its end; `false` if that takes more than `limit` bytes or `timeout`,
/// or the body fails.
pub async fn drain(mut body: Body, limit: u64, timeout: Duration) -> bool {
    // A declared length beyond the limit is refused without reading any of it.
    if body.size_hint().lower() > limit {
        return false;
    }
    let read = async {
        let mut left = limit;
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { return false };
            if let Some(data) = frame.data_ref() {
                let n = data.len() as u64;
                if n > left {
                    return false;
                }
                left -= n;
            }
        }
        true
    };
    tokio::time::timeout(timeout, read).await.unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(chunks: Vec<&'static [u8]>, then_hang: bool) -> Body {
        let items = futures::stream::iter(
            chunks
                .into_iter()
                .map(|c| Ok::<_, std::io::Error>(Bytes::from_static(c))),
        );
        if then_hang {
            Body::from_stream(futures::StreamExt::chain(items, futures::stream::pending()))
        } else {
            Body::from_stream(items)
        }
    }

    #[tokio::test]
    async fn drains_within_bounds() {
        let t = Duration::from_secs(5);
        assert!(drain(stream(vec![b"ab", b"cd"], false), 4, t).await);
        assert!(drain(Body::empty(), 0, t).await);
    }

    #[tokio::test]
    async fn gives_up_past_the_byte_limit() {
        let t = Duration::from_secs(5);
        assert!(!drain(stream(vec![b"ab", b"cde"], false), 4, t).await);
        // Known too long from its length: not read at all.
        assert!(!drain(Body::from(vec![0u8; 5]), 4, t).await);
    }

    #[tokio::test]
    async fn gives_up_on_a_stalled_body() {
        let t0 = std::time::Instant::now();
        assert!(!drain(stream(vec![b"ab"], true), 100, Duration::from_millis(50)).await);
        assert!(t0.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn gives_up_on_a_broken_body() {
        let items = futures::stream::iter(vec![
            Ok(Bytes::from_static(b"ab")),
            Err(std::io::Error::other("reset")),
        ]);
        assert!(!drain(Body::from_stream(items), 100, Duration::from_secs(5)).await);
    }
}
