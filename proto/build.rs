//! Compiles sandbolt's own protos with protox (pure Rust, no `protoc`).

use std::path::PathBuf;

use prost::Message;

const PROTOS: &[&str] = &[
    "fastpath/v1/fastpath.proto",
    "fastpath/v2/fastpath.proto",
    "sandbolt/agent/v1/agent.proto",
    "sandbolt/control/v1/control.proto",
];

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("proto");
    println!("cargo:rerun-if-changed={}", root.display());

    let fds = protox::compile(PROTOS, [&root]).unwrap_or_else(|e| panic!("protox: {e:?}"));
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    std::fs::write(out.join("descriptors.bin"), fds.encode_to_vec()).unwrap();

    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)
        .unwrap_or_else(|e| panic!("tonic-prost-build: {e}"));
}
