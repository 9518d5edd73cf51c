//! execd is a small static binary that does not link `sandbolt-proto`, so it
//! keeps its own copies of the wire constants every other component takes
//! from `sandbolt_proto::wire`. This test is what keeps the copies true.

use sandbolt_proto::wire::{EXECD_PORT, EXECD_TOKEN_HEADER};

#[test]
fn execd_listens_on_the_port_everyone_else_dials() {
    let listen: std::net::SocketAddr = sandbolt_execd::DEFAULT_LISTEN
        .parse()
        .expect("execd's default listen address parses");
    assert_eq!(listen.port(), EXECD_PORT);
}

#[test]
fn execd_checks_the_header_everyone_else_sends() {
    // HTTP header names compare without case; execd keeps the lower-case
    // form its router looks up, the rest of sandbolt OpenSandbox's spelling.
    assert!(
        sandbolt_execd::ACCESS_TOKEN_HEADER.eq_ignore_ascii_case(EXECD_TOKEN_HEADER),
        "execd checks {:?}, the agent and clients send {EXECD_TOKEN_HEADER:?}",
        sandbolt_execd::ACCESS_TOKEN_HEADER
    );
}
