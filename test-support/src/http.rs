//! A minimal HTTP/1.1 client for the agent's data-plane proxy, whose
//! endpoints FastPath hands out as `host:port/route` (no scheme): one
//! request, `Connection: close`, read to the end. Tests that talk to a
//! normal HTTP server use `reqwest` instead.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long one request may take before the test fails.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

/// One request to `endpoint` (`host:port` or `host:port/route`): `path` is
/// appended to the route. `body` is sent as JSON when not empty. Returns the
/// status code and the body.
pub async fn request(
    endpoint: &str,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: &str,
) -> (u16, String) {
    let (host, route) = endpoint.split_once('/').unwrap_or((endpoint, ""));
    let mut stream = tokio::net::TcpStream::connect(host)
        .await
        .unwrap_or_else(|e| panic!("connecting to {host}: {e}"));
    let mut head =
        format!("{method} /{route}{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    head.push_str(&format!("Content-Length: {}\r\n", body.len()));
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    head.push_str(body);
    stream
        .write_all(head.as_bytes())
        .await
        .unwrap_or_else(|e| panic!("sending to {host}: {e}"));
    let mut answer = Vec::new();
    tokio::time::timeout(ANSWER_WITHIN, stream.read_to_end(&mut answer))
        .await
        .unwrap_or_else(|_| {
            panic!("{host} did not answer {method} {path} within {ANSWER_WITHIN:?}")
        })
        .unwrap_or_else(|e| panic!("reading from {host}: {e}"));
    parse_answer(&String::from_utf8_lossy(&answer))
}

/// [`request`] with `GET` and no body.
pub async fn get(endpoint: &str, path: &str, headers: &[(String, String)]) -> (u16, String) {
    request(endpoint, "GET", path, headers, "").await
}

/// (status, body) of a whole HTTP/1.1 answer; panics on anything else.
fn parse_answer(text: &str) -> (u16, String) {
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default();
    (status, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_request_reaches_the_route_with_its_headers_and_body() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut seen = vec![0; 4096];
            let n = s.read(&mut seen).await.unwrap();
            s.write_all(b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
                .await
                .unwrap();
            String::from_utf8_lossy(&seen[..n]).into_owned()
        });
        let headers = [("X-Token".to_string(), "t".to_string())];
        let answer = request(&format!("{addr}/route"), "POST", "/x", &headers, "{}").await;
        assert_eq!(answer, (201, "ok".to_string()));
        let seen = server.await.unwrap();
        assert!(seen.starts_with("POST /route/x HTTP/1.1\r\n"), "{seen}");
        assert!(
            seen.contains("X-Token: t\r\n") && seen.ends_with("\r\n\r\n{}"),
            "{seen}"
        );
    }
}
