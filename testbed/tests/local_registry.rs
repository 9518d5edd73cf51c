//! The local registry answers the distribution spec's read side, and the
//! bed's real `ctr images pull --plain-http` pulls an image from it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use sandbolt_testbed::{LocalRegistry, MT_OCI_INDEX, MT_OCI_MANIFEST, Testbed, busybox_image};
use sha2::{Digest, Sha256};

const NAMESPACE: &str = "sandbolt-registry";

struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 request on its own connection (`Connection: close`).
fn request(addr: SocketAddr, method: &str, path: &str) -> Answer {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete header block");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    Answer {
        status,
        headers,
        body: raw[split + 4..].to_vec(),
    }
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

#[test]
fn serves_manifests_and_blobs_with_the_headers_clients_read() {
    let image = busybox_image().unwrap();
    let registry = LocalRegistry::serve(&[("warm/busybox:1", &image)]).unwrap();
    let addr = registry.addr();
    let docs = image.documents();

    assert_eq!(request(addr, "GET", "/v2/").status, 200);

    // A tag names the index; HEAD says what GET would send, without a body.
    let head = request(addr, "HEAD", "/v2/warm/busybox/manifests/1");
    assert_eq!(head.status, 200);
    assert_eq!(head.header("Content-Type"), Some(MT_OCI_INDEX));
    assert_eq!(
        head.header("Docker-Content-Digest"),
        Some(sha256(&docs.index).as_str())
    );
    assert_eq!(
        head.header("Content-Length"),
        Some(docs.index.len().to_string().as_str())
    );
    assert!(head.body.is_empty());
    let get = request(addr, "GET", "/v2/warm/busybox/manifests/1");
    assert_eq!(get.body, docs.index);

    // The platform manifest by digest, with its own media type.
    let path = format!("/v2/warm/busybox/manifests/{}", sha256(&docs.manifest));
    let get = request(addr, "GET", &path);
    assert_eq!(get.status, 200);
    assert_eq!(get.header("Content-Type"), Some(MT_OCI_MANIFEST));
    assert_eq!(get.body, docs.manifest);

    // Blobs by digest: the layer and the config.
    let layer = format!("/v2/warm/busybox/blobs/{}", image.diff_id());
    let head = request(addr, "HEAD", &layer);
    assert_eq!(head.status, 200);
    assert_eq!(
        head.header("Content-Length"),
        Some(image.rootfs_tar().len().to_string().as_str())
    );
    assert_eq!(request(addr, "GET", &layer).body, image.rootfs_tar());
    let config = format!("/v2/warm/busybox/blobs/{}", sha256(&docs.config));
    assert_eq!(request(addr, "GET", &config).body, docs.config);

    // What it does not have, in the spec's error shape; no writes.
    let unknown_tag = request(addr, "GET", "/v2/warm/busybox/manifests/2");
    assert_eq!(unknown_tag.status, 404);
    assert!(String::from_utf8_lossy(&unknown_tag.body).contains("MANIFEST_UNKNOWN"));
    assert_eq!(
        request(addr, "GET", "/v2/nobody/manifests/1").status,
        404,
        "unknown repository"
    );
    let blob_as_manifest = format!("/v2/warm/busybox/manifests/{}", image.diff_id());
    assert_eq!(request(addr, "GET", &blob_as_manifest).status, 404);
    assert_eq!(request(addr, "DELETE", &layer).status, 405);

    assert_eq!(registry.requests(), 11);
    assert_eq!(
        registry.request_log()[1],
        "HEAD /v2/warm/busybox/manifests/1"
    );
}

#[test]
fn held_requests_are_counted_and_answered_on_release() {
    let image = busybox_image().unwrap();
    let registry = LocalRegistry::serve(&[("held:1", &image)]).unwrap();
    let addr = registry.addr();
    registry.hold();
    let pending = std::thread::spawn(move || request(addr, "GET", "/v2/held/manifests/1").status);
    let start = std::time::Instant::now();
    while registry.requests() == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the request never arrived"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Counted, but not answered while held.
    std::thread::sleep(Duration::from_millis(200));
    assert!(!pending.is_finished());
    registry.release();
    assert_eq!(pending.join().unwrap(), 200);
}

#[test]
fn dropping_the_registry_closes_its_port_even_with_a_request_held() {
    let image = busybox_image().unwrap();
    let registry = LocalRegistry::serve(&[("gone:1", &image)]).unwrap();
    let addr = registry.addr();
    registry.hold();
    let pending = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        write!(s, "GET /v2/ HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        out
    });
    while registry.requests() == 0 {
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(registry);
    assert!(
        pending.join().unwrap().is_empty(),
        "the held request is cut, not answered"
    );
    assert!(
        TcpStream::connect(addr).is_err(),
        "nothing listens any more"
    );
}

#[test]
fn ctr_pulls_an_image_from_the_local_registry_over_plain_http() {
    let bed = Testbed::start().expect("test bed");
    let image = busybox_image().unwrap();
    let registry = LocalRegistry::serve(&[("warm/busybox:1", &image)]).unwrap();
    let reference = registry.reference("warm/busybox:1");

    let out = bed
        .ctr(NAMESPACE)
        .args(["images", "pull", "--plain-http", &reference])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ctr images pull: {}\nregistry saw: {:?}",
        String::from_utf8_lossy(&out.stderr),
        registry.request_log()
    );

    // The image record names the index the tag resolved to.
    let docs = image.documents();
    let list = bed
        .ctr(NAMESPACE)
        .args(["images", "list"])
        .output()
        .unwrap();
    let list = String::from_utf8_lossy(&list.stdout).into_owned();
    let line = list
        .lines()
        .find(|l| l.starts_with(&reference))
        .unwrap_or_else(|| panic!("{reference} not in\n{list}"));
    assert!(line.contains(&sha256(&docs.index)), "{line}");

    // The layer came over the wire and was unpacked (ctr pull unpacks for
    // the default snapshotter): its chain id, the diff id, is a snapshot.
    let log = registry.request_log();
    let layer_get = format!("GET /v2/warm/busybox/blobs/{}", image.diff_id());
    assert!(log.contains(&layer_get), "{log:?}");
    let snaps = bed
        .ctr(NAMESPACE)
        .args(["snapshots", "--snapshotter", "overlayfs", "list"])
        .output()
        .unwrap();
    let snaps = String::from_utf8_lossy(&snaps.stdout).into_owned();
    assert!(
        snaps
            .lines()
            .any(|l| l.split_whitespace().next() == Some(image.diff_id().as_str())),
        "{snaps}"
    );
}
