//! Keep-alive connections survive requests whose body a handler did not read to its end.
//!
//! Raw TCP on purpose: an HTTP client library hides exactly what matters here — whether
//! the answer carries `Connection: close` and whether the server then really keeps the
//! connection for the next request. The failure this guards against (seen with the
//! OpenSandbox Python SDK) was an upload answered `200` without `Connection: close`
//! on a connection the server closed right after, so the client's next request on it
//! got "Server disconnected without sending a response".

use crate::common;

use std::time::Duration;

use common::Execd;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;

const BOUNDARY: &str = "sandboltkeepaliveboundary";

/// One parsed answer: status, lower-cased headers, body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn closes(&self) -> bool {
        self.headers
            .iter()
            .any(|(k, v)| k == "connection" && v.to_ascii_lowercase().contains("close"))
    }
}

/// Reads one `Content-Length`-framed answer (all execd answers used here are), keeping
/// whatever follows it in `buf`.
async fn read_answer(r: &mut OwnedReadHalf, buf: &mut Vec<u8>) -> Result<Answer, String> {
    let fut = async {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 8192];
            let n = r.read(&mut chunk).await.map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                return Err(format!(
                    "server closed the connection without an answer (got {:?})",
                    String::from_utf8_lossy(buf)
                ));
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("bad status line in {head:?}"))?;
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        let len: usize = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse().ok())
            .ok_or_else(|| format!("no content-length in {head:?}"))?;
        while buf.len() < head_end + len {
            let mut chunk = [0u8; 8192];
            let n = r.read(&mut chunk).await.map_err(|e| format!("read: {e}"))?;
            if n == 0 {
                return Err("server closed the connection inside an answer".into());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let body = buf[head_end..head_end + len].to_vec();
        buf.drain(..head_end + len);
        Ok(Answer {
            status,
            headers,
            body,
        })
    };
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .map_err(|_| "no answer within 20s".to_string())?
}

async fn connect(e: &Execd) -> TcpStream {
    let s = TcpStream::connect(&e.addr).await.expect("connect");
    s.set_nodelay(true).unwrap();
    s
}

/// A multipart body uploading `data` to `path`, as the SDK sends it (metadata as a file
/// part), ending with the closing boundary and its CRLF.
fn upload_body(path: &str, data: &[u8]) -> Vec<u8> {
    let meta = serde_json::json!({"path": path, "owner": null, "group": null, "mode": 644});
    let mut b = Vec::new();
    b.extend_from_slice(
        format!(
            "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"metadata\"; filename=\"metadata\"\r\n\
             Content-Type: application/json\r\n\r\n{meta}\r\n\
             --{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n"
        )
        .as_bytes(),
    );
    b.extend_from_slice(data);
    b.extend_from_slice(format!("\r\n--{BOUNDARY}--\r\n").as_bytes());
    b
}

fn upload_head(host: &str, framing: &str) -> String {
    format!(
        "POST /files/upload HTTP/1.1\r\nHost: {host}\r\n\
         Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n{framing}\r\n"
    )
}

fn list_request(host: &str, dir: &str) -> String {
    format!("GET /directories/list?path={dir} HTTP/1.1\r\nHost: {host}\r\n\r\n")
}

/// Sends an upload whose last `tail` bytes arrive only after execd has parsed the
/// closing boundary (so its handler is done while the body is not at its end), then
/// lists the directory on the same connection, like the SDK's `list_directory` after
/// `write_files`.
async fn upload_with_late_tail(chunked: bool) {
    let e = Execd::start(&[], &[]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    let body = upload_body(&format!("{d}/f.txt"), b"hello keep-alive\n");
    // The tail is the CRLF after `--BOUNDARY--` (epilogue execd does not need) or,
    // chunked, the terminating zero-size chunk.
    let (first, tail) = if chunked {
        let mut first = upload_head(&e.addr, "Transfer-Encoding: chunked\r\n").into_bytes();
        first.extend_from_slice(format!("{:x}\r\n", body.len()).as_bytes());
        first.extend_from_slice(&body);
        first.extend_from_slice(b"\r\n");
        (first, b"0\r\n\r\n".to_vec())
    } else {
        let framing = format!("Content-Length: {}\r\n", body.len());
        let mut first = upload_head(&e.addr, &framing).into_bytes();
        first.extend_from_slice(&body[..body.len() - 2]);
        (first, body[body.len() - 2..].to_vec())
    };

    let (mut r, mut w) = connect(&e).await.into_split();
    w.write_all(&first).await.unwrap();
    // Long enough for execd to store the file and answer if it answers early.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The server may already have closed: a failed write shows up as a missing answer.
    let _ = w.write_all(&tail).await;
    let mut buf = Vec::new();
    let up = read_answer(&mut r, &mut buf).await.expect("upload answer");
    assert_eq!(up.status, 200, "{}", String::from_utf8_lossy(&up.body));
    assert_eq!(
        std::fs::read(format!("{d}/f.txt")).unwrap(),
        b"hello keep-alive\n"
    );
    assert!(
        !up.closes(),
        "the body was complete: the connection should stay usable"
    );

    let _ = w.write_all(list_request(&e.addr, &d).as_bytes()).await;
    let list = read_answer(&mut r, &mut buf)
        .await
        .expect("second request on the kept-alive connection");
    assert_eq!(list.status, 200, "{}", String::from_utf8_lossy(&list.body));
    assert!(String::from_utf8_lossy(&list.body).contains("f.txt"));
}

#[tokio::test]
async fn upload_epilogue_arriving_late_keeps_connection_usable() {
    upload_with_late_tail(false).await;
}

#[tokio::test]
async fn upload_last_chunk_arriving_late_keeps_connection_usable() {
    upload_with_late_tail(true).await;
}

/// An upload rejected at its first part (so the handler answers with most of the body
/// unread) is drained: the 400 arrives and the connection serves the next request.
#[tokio::test]
async fn rejected_upload_is_drained_and_connection_reused() {
    let e = Execd::start(&[], &[]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    let mut body = format!(
        "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"bogus\"; filename=\"x\"\r\n\r\n"
    )
    .into_bytes();
    body.extend(std::iter::repeat_n(b'x', 1024 * 1024));
    body.extend_from_slice(format!("\r\n--{BOUNDARY}--\r\n").as_bytes());
    let mut req = upload_head(&e.addr, &format!("Content-Length: {}\r\n", body.len())).into_bytes();
    req.extend_from_slice(&body);
    req.extend_from_slice(list_request(&e.addr, &d).as_bytes());

    let (mut r, mut w) = connect(&e).await.into_split();
    // Written concurrently: the server answers before it has read the whole body.
    let writer = tokio::spawn(async move {
        let _ = w.write_all(&req).await;
        w
    });
    let mut buf = Vec::new();
    let up = read_answer(&mut r, &mut buf).await.expect("upload answer");
    assert_eq!(up.status, 400, "{}", String::from_utf8_lossy(&up.body));
    assert!(String::from_utf8_lossy(&up.body).contains("unexpected multipart part"));
    assert!(!up.closes(), "a 1 MiB leftover is drained, not abandoned");
    let list = read_answer(&mut r, &mut buf)
        .await
        .expect("pipelined request after the rejected upload");
    assert_eq!(list.status, 200, "{}", String::from_utf8_lossy(&list.body));
    drop(writer.await.unwrap());
}

/// Requests rejected before their body is read (auth, unknown route, bad query) are
/// drained too when the body is small.
#[tokio::test]
async fn unread_small_bodies_do_not_cost_the_connection() {
    let e = Execd::start(&["--access-token", "secret"], &[]);
    let (mut r, mut w) = connect(&e).await.into_split();
    let host = e.addr.clone();
    let body = vec![b'{'; 200 * 1024];
    let mut req = Vec::new();
    for path in ["/files/upload", "/no/such/route", "/files/mv"] {
        req.extend_from_slice(
            format!(
                "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {}\r\n\r\n",
                body.len()
            )
            .as_bytes(),
        );
        req.extend_from_slice(&body);
    }
    req.extend_from_slice(format!("GET /ping HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes());
    let writer = tokio::spawn(async move {
        let _ = w.write_all(&req).await;
        w
    });
    let mut buf = Vec::new();
    for _ in 0..3 {
        let a = read_answer(&mut r, &mut buf).await.expect("rejection");
        assert_eq!(a.status, 401);
        assert!(!a.closes());
    }
    let ping = read_answer(&mut r, &mut buf).await.expect("ping");
    assert_eq!(ping.status, 200);
    assert_eq!(ping.body, b"pong");
    drop(writer.await.unwrap());
}

/// A body too large to drain is abandoned, and the answer says so with
/// `Connection: close`, so no client reuses a connection the server is about to drop.
#[tokio::test]
async fn abandoned_body_answers_connection_close() {
    let e = Execd::start(&[], &[]);
    let (mut r, mut w) = connect(&e).await.into_split();
    // Announces 1 GiB, sends a little: the server must not wait for (or read) it all.
    let req = format!(
        "POST /files/upload HTTP/1.1\r\nHost: {}\r\nContent-Type: text/plain\r\n\
         Content-Length: {}\r\n\r\nnot multipart",
        e.addr,
        1u64 << 30
    );
    w.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let a = read_answer(&mut r, &mut buf).await.expect("rejection");
    assert_eq!(a.status, 400, "{}", String::from_utf8_lossy(&a.body));
    assert!(a.closes(), "headers: {:?}", a.headers);
    // And the server does close it.
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(10), r.read_to_end(&mut rest))
        .await
        .expect("server closes the connection");
    assert!(n.is_err() || rest.is_empty(), "unexpected data {rest:?}");
}

/// A client waiting for `100 Continue` is not asked for a body the answer refuses: it
/// gets the rejection with `Connection: close` (it has not sent the body, and the server
/// will not wait for it), never a `100 Continue`.
#[tokio::test]
async fn refused_expect_continue_is_not_solicited() {
    let e = Execd::start(&["--access-token", "secret"], &[]);
    let (mut r, mut w) = connect(&e).await.into_split();
    let req = format!(
        "POST /files/upload HTTP/1.1\r\nHost: {}\r\nExpect: 100-continue\r\n\
         Content-Length: 100000\r\n\r\n",
        e.addr
    );
    w.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let a = read_answer(&mut r, &mut buf).await.expect("rejection");
    assert_eq!(a.status, 401);
    assert!(a.closes(), "headers: {:?}", a.headers);
}

/// An upload that fills its filesystem is answered 507 to a client that goes on
/// sending: execd reads the rest of the part instead of closing mid-body, so the
/// client's writes all succeed and it reads the answer (it used to get EPIPE or a
/// reset once more than the drain limit was left unsent).
#[tokio::test]
async fn upload_into_a_full_filesystem_is_answered_to_a_client_still_sending() {
    let e = Execd::start(&[], &[]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap().to_string();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs", &d])
        .status()
        .expect("run mount");
    assert!(mounted.success(), "mounting a 1 MiB tmpfs on {d}");
    struct Unmount(String);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(d.clone());

    let body = upload_body(&format!("{d}/big.bin"), &vec![7u8; 48 * 1024 * 1024]);
    let mut req = upload_head(&e.addr, &format!("Content-Length: {}\r\n", body.len())).into_bytes();
    req.extend_from_slice(&body);
    let (mut r, mut w) = connect(&e).await.into_split();
    // The write half is handed back, not dropped: dropping it half-closes the
    // connection, and hyper answers nothing to a client that did.
    let writer = tokio::spawn(async move { (w.write_all(&req).await, w) });
    let mut buf = Vec::new();
    let up = read_answer(&mut r, &mut buf).await.expect("upload answer");
    assert_eq!(up.status, 507, "{}", String::from_utf8_lossy(&up.body));
    let (written, _w) = writer.await.unwrap();
    written.expect("every byte of the upload was accepted before the answer");
    assert!(
        !std::path::Path::new(&format!("{d}/big.bin")).exists(),
        "nothing half-written under the target's name"
    );
}
