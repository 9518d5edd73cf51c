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
