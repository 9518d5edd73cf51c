//! Talking to a server inside a sandbox's network namespace (execd's
//! `/ping`), over a socket created in that namespace by
//! [`crate::proxy::dial_in_sandbox`].

use std::io;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `GET <path>` over a fresh in-namespace connection; returns the status code.
pub async fn http_get_status(
    pid: u32,
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> io::Result<u16> {
    let fut = async {
        let mut s = crate::proxy::dial_in_sandbox(pid, port).await?;
        let mut req =
            format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).await?;
        let mut buf = Vec::with_capacity(256);
        let mut chunk = [0u8; 256];
        // The status line is all that is needed.
        while !buf.contains(&b'\n') {
            let n = s.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        let line = String::from_utf8_lossy(&buf);
        line.split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad HTTP response {line:?}"),
                )
            })
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "HTTP GET timed out"))?
}

/// `POST <path>` with a JSON body over a fresh in-namespace connection;
/// returns the status code and the response body (execd's
/// `/sandbolt/claim`). The connection is closed by the server after one
/// answer, so the body is everything after the headers.
pub async fn http_post_json(
    pid: u32,
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> io::Result<(u16, Vec<u8>)> {
    let fut = async {
        let mut s = crate::proxy::dial_in_sandbox(pid, port).await?;
        let mut req = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).await?;
        s.write_all(body).await?;
        let mut buf = Vec::with_capacity(512);
        s.read_to_end(&mut buf).await?;
        parse_response(&buf)
    };
    tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "HTTP POST timed out"))?
}

/// Status code and body of a whole HTTP/1.1 response (plain or chunked).
fn parse_response(buf: &[u8]) -> io::Result<(u16, Vec<u8>)> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, what.to_string());
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| bad("HTTP response without the end of its headers"))?;
    let head = String::from_utf8_lossy(&buf[..end]);
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| bad(&format!("bad HTTP status line in {head:?}")))?;
    let body = &buf[end + 4..];
    let chunked = head.lines().any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    Ok((
        code,
        if chunked {
            dechunk(body)
        } else {
            body.to_vec()
        },
    ))
}

/// The payload of a chunked body (best effort: a malformed one ends early).
fn dechunk(mut body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = body.windows(2).position(|w| w == b"\r\n") {
        let size = std::str::from_utf8(&body[..eol])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next().unwrap_or("").trim(), 16).ok());
        let Some(size) = size.filter(|n| *n > 0) else {
            break;
        };
        let start = eol + 2;
        let Some(chunk) = body.get(start..start + size) else {
            break;
        };
        out.extend_from_slice(chunk);
        body = body.get(start + size + 2..).unwrap_or_default();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_are_parsed_plain_and_chunked() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{\"pid\":7}";
        assert_eq!(
            parse_response(plain).unwrap(),
            (200, b"{\"pid\":7}".to_vec())
        );
        let chunked = b"HTTP/1.1 409 Conflict\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcd\r\n2\r\nef\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked).unwrap(), (409, b"abcdef".to_vec()));
        assert!(parse_response(b"garbage").is_err());
    }
}
