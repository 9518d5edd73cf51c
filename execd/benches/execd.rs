//! execd round trips over loopback:
//! * `command_echo_hi`: `POST /command {"command":"echo hi"}`, whole SSE stream read;
//! * `upload_download_1mib`: 1 MiB multipart upload, then its download.
//!
//! By default execd runs as a local process. With `EXECD_BENCH_CONTAINER=1` (root, test
//! bed) it runs as PID 1 in a busybox container on the host network, as in a sandbox.
//! Besides criterion's estimates, p50/p99 over 500 timed iterations are printed.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group};
use sandbolt_testbed::{Testbed, busybox_image, execd_binary};

struct Target {
    addr: String,
    _local: Option<Child>,
    _bed: Option<(Testbed, String)>,
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(c) = self._local.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some((bed, id)) = &self._bed {
            let _ = bed
                .ctr("default")
                .args(["tasks", "kill", "-a", "-s", "SIGKILL", id])
                .output();
            std::thread::sleep(Duration::from_millis(200));
            let _ = bed
                .ctr("default")
                .args(["tasks", "delete", "-f", id])
                .output();
            let _ = bed
                .ctr("default")
                .args(["containers", "delete", id])
                .output();
        }
    }
}

fn local() -> Target {
    let mut child = Command::new(env!("CARGO_BIN_EXE_execd"))
        .args(["--listen", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("start execd");
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let l = lines.next().expect("execd exited").unwrap();
        if let Some(a) = l.strip_prefix("execd: listening on ") {
            break a.to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    Target {
        addr,
        _local: Some(child),
        _bed: None,
    }
}

fn container() -> Target {
    let bed = Testbed::start().expect("test bed");
    bed.import_image(&busybox_image().unwrap(), "default")
        .unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let id = format!("execd-bench-{port}");
    let mount = format!(
        "type=bind,src={},dst=/opt/sandbolt/execd,options=rbind:ro",
        execd_binary().unwrap().display()
    );
    let listen = format!("127.0.0.1:{port}");
    let out = bed
        .ctr("default")
        .args([
            "run",
            "-d",
            "--net-host",
            "--mount",
            &mount,
            sandbolt_testbed::BUSYBOX_REF,
            &id,
        ])
        .args([
            "/opt/sandbolt/execd",
            "--init",
            "--listen",
            &listen,
            "--",
            "sleep",
            "100000",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(&listen).is_err() {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(50));
    }
    Target {
        addr: listen,
        _local: None,
        _bed: Some((bed, id)),
    }
}

async fn echo_hi(c: &reqwest::Client, base: &str) {
    let body = c
        .post(format!("{base}/command"))
        .body(r#"{"command":"echo hi"}"#)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(body.contains("execution_complete"), "{body}");
}

async fn up_down(c: &reqwest::Client, base: &str, data: &[u8]) {
    let meta =
        reqwest::multipart::Part::bytes(br#"{"path":"/tmp/bench/1mib.bin","mode":644}"#.to_vec())
            .file_name("metadata");
    let file = reqwest::multipart::Part::bytes(data.to_vec()).file_name("1mib.bin");
    let form = reqwest::multipart::Form::new()
        .part("metadata", meta)
        .part("file", file);
    let r = c
        .post(format!("{base}/files/upload"))
        .multipart(form)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let got = c
        .get(format!("{base}/files/download?path=/tmp/bench/1mib.bin"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(got.len(), data.len());
}

fn percentiles(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let at = |p: f64| samples[((samples.len() as f64 - 1.0) * p).round() as usize];
    println!(
        "{name}: n={} p50={:.3} ms p99={:.3} ms",
        samples.len(),
        at(0.50).as_secs_f64() * 1e3,
        at(0.99).as_secs_f64() * 1e3
    );
}

fn benches(c: &mut Criterion) {
    let target = if std::env::var("EXECD_BENCH_CONTAINER").is_ok_and(|v| v == "1") {
        container()
    } else {
        local()
    };
    let base = format!("http://{}", target.addr);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = reqwest::Client::new();
    let data: Vec<u8> = (0..1024 * 1024u32).map(|i| (i % 251) as u8).collect();

    c.bench_function("command_echo_hi", |b| {
        b.iter(|| rt.block_on(echo_hi(&client, &base)))
    });
    c.bench_function("upload_download_1mib", |b| {
        b.iter(|| rt.block_on(up_down(&client, &base, &data)))
    });

    let mut s = Vec::new();
    for _ in 0..500 {
        let t = Instant::now();
        rt.block_on(echo_hi(&client, &base));
        s.push(t.elapsed());
    }
    percentiles("command_echo_hi", s);
    let mut s = Vec::new();
    for _ in 0..500 {
        let t = Instant::now();
        rt.block_on(up_down(&client, &base, &data));
        s.push(t.elapsed());
    }
    percentiles("upload_download_1mib", s);
}

criterion_group! {
    name = execd;
    config = Criterion::default().sample_size(50).measurement_time(Duration::from_secs(5)).warm_up_time(Duration::from_secs(1));
    targets = benches
}

fn main() {
    execd();
    Criterion::default().configure_from_args().final_summary();
}
