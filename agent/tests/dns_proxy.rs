//! The agent's DNS proxy over real sockets: a [`StaticDns`] as the upstream,
//! the proxy on 127.0.0.1, clients bound to other 127.0.0.x addresses (the
//! source address is what identifies a sandbox), and an in-memory
//! [`SandboxDirectory`] standing in for the agent's attached sandboxes.

use std::collections::HashMap;
use std::future::Future;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, RecordType};
use parking_lot::Mutex;
use sandbolt_agent::network::dns::{
    DnsError, DnsProxy, MAX_ALLOW_TTL, MIN_ALLOW_TTL, ProxyOptions, SandboxDirectory,
};
use sandbolt_proto::egress::NetworkPolicy;
use sandbolt_test_support::dns::StaticDns;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SANDBOX: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 21);
const OTHER_SANDBOX: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 22);
const STRANGER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 99);
const ALLOWED_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const ALLOWED_IP_2: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 11);
const DENIED_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 66);
/// How long a test client waits for any reply.
const CLIENT_WAIT: Duration = Duration::from_secs(10);

/// One call of `allow_resolved`, recorded when the "rule" is in place.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Opened {
    source: Ipv4Addr,
    addrs: Vec<Ipv4Addr>,
    ttl: Duration,
}

/// The attached sandboxes of a pretend agent. Opening takes `open_delay`,
/// so a reply sent before the opening finished would arrive before it is
/// recorded.
#[derive(Default)]
struct Directory {
    policies: HashMap<Ipv4Addr, Arc<NetworkPolicy>>,
    opened: Mutex<Vec<Opened>>,
    open_delay: Duration,
    failing: bool,
}

impl Directory {
    fn with(policies: &[(Ipv4Addr, &str)]) -> Self {
        Self {
            policies: policies
                .iter()
                .map(|(ip, json)| (*ip, Arc::new(NetworkPolicy::parse(json).unwrap())))
                .collect(),
            ..Self::default()
        }
    }

    fn opened(&self) -> Vec<Opened> {
        self.opened.lock().clone()
    }
}

impl SandboxDirectory for Directory {
    fn policy_for(&self, source: Ipv4Addr) -> Option<Arc<NetworkPolicy>> {
        self.policies.get(&source).cloned()
    }

    fn allow_resolved(
        &self,
        source: Ipv4Addr,
        addrs: Vec<Ipv4Addr>,
        ttl: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + '_>> {
        Box::pin(async move {
            tokio::time::sleep(self.open_delay).await;
            if self.failing {
                return Err("nft: pretend failure".to_owned());
            }
            self.opened.lock().push(Opened { source, addrs, ttl });
            Ok(())
        })
    }
}

fn start_proxy(upstreams: Vec<SocketAddr>, dir: Arc<Directory>, timeout: Duration) -> DnsProxy {
    sandbolt_test_support::init_tracing("sandbolt_agent=debug");
    let options = ProxyOptions {
        upstream_timeout: timeout,
        ..ProxyOptions::default()
    };
    let listen = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0);
    DnsProxy::start_with(listen, upstreams, dir, options).expect("starting the DNS proxy")
}

fn question(name: &str, qtype: RecordType) -> Message {
    let mut m = Message::new();
    m.set_id(0x5b1d)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true)
        .add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
    m
}

/// Sends `query` over UDP from `source` and waits for the reply.
async fn ask_udp(proxy: SocketAddrV4, source: Ipv4Addr, query: &Message) -> Message {
    let socket = tokio::net::UdpSocket::bind((source, 0)).await.unwrap();
    socket
        .send_to(&query.to_vec().unwrap(), proxy)
        .await
        .unwrap();
    let mut buf = vec![0u8; 65_535];
    let (len, _) = tokio::time::timeout(CLIENT_WAIT, socket.recv_from(&mut buf))
        .await
        .expect("a UDP reply in time")
        .unwrap();
    let reply = Message::from_vec(&buf[..len]).unwrap();
    assert_eq!(reply.id(), query.id(), "the reply echoes the query id");
    assert_eq!(reply.message_type(), MessageType::Response);
    reply
}

/// Sends `query` over TCP from `source` and waits for the reply.
async fn ask_tcp(proxy: SocketAddrV4, source: Ipv4Addr, query: &Message) -> Message {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind((source, 0).into()).unwrap();
    let mut stream = socket.connect(proxy.into()).await.unwrap();
    let bytes = query.to_vec().unwrap();
    stream
        .write_u16(u16::try_from(bytes.len()).unwrap())
        .await
        .unwrap();
    stream.write_all(&bytes).await.unwrap();
    let read = async {
        let len = stream.read_u16().await.unwrap();
        let mut buf = vec![0u8; usize::from(len)];
        stream.read_exact(&mut buf).await.unwrap();
        buf
    };
    let buf = tokio::time::timeout(CLIENT_WAIT, read)
        .await
        .expect("a TCP reply in time");
    let reply = Message::from_vec(&buf).unwrap();
    assert_eq!(reply.id(), query.id());
    reply
}

fn a_records(reply: &Message) -> Vec<Ipv4Addr> {
    reply
        .answers()
        .iter()
        .filter_map(|r| match r.data() {
            RData::A(a) => Some(a.0),
            _ => None,
        })
        .collect()
}

const ONLY_ALLOWED: &str =
    r#"{"defaultAction":"deny","egress":[{"action":"allow","target":"allowed.test"}]}"#;

#[tokio::test]
async fn an_allowed_name_is_answered_only_after_its_addresses_are_opened() {
    let upstream = StaticDns::start(
        [("allowed.test", vec![ALLOWED_IP, ALLOWED_IP_2])],
        Duration::from_secs(5),
    );
    let dir = Arc::new(Directory {
        open_delay: Duration::from_millis(300),
        ..Directory::with(&[(SANDBOX, ONLY_ALLOWED)])
    });
    let proxy = start_proxy(
        vec![upstream.addr()],
        Arc::clone(&dir),
        Duration::from_secs(2),
    );

    let started = Instant::now();
    let reply = ask_udp(
        proxy.local_addr(),
        SANDBOX,
        &question("Allowed.Test.", RecordType::A),
    )
    .await;
    // Read before anything else: the record must already be there.
    let opened = dir.opened();
    assert_eq!(reply.response_code(), ResponseCode::NoError);
    assert_eq!(a_records(&reply), vec![ALLOWED_IP, ALLOWED_IP_2]);
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "the reply did not wait for the opening"
    );
    assert_eq!(
        opened,
        vec![Opened {
            source: SANDBOX,
            addrs: vec![ALLOWED_IP, ALLOWED_IP_2],
            ttl: MIN_ALLOW_TTL, // 5 s TTL clamped up to a minute
        }]
    );
    assert_eq!(upstream.queries_for("allowed.test"), 1);
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_long_ttl_is_capped_for_the_rule_and_for_the_client() {
    let two_days = Duration::from_secs(2 * 24 * 3600);
    let upstream = StaticDns::start([("allowed.test", vec![ALLOWED_IP])], two_days);
    let dir = Arc::new(Directory::with(&[(SANDBOX, ONLY_ALLOWED)]));
    let proxy = start_proxy(
        vec![upstream.addr()],
        Arc::clone(&dir),
        Duration::from_secs(2),
    );

    let reply = ask_udp(
        proxy.local_addr(),
        SANDBOX,
        &question("allowed.test.", RecordType::A),
    )
    .await;
    assert_eq!(
        u64::from(reply.answers()[0].ttl()),
        MAX_ALLOW_TTL.as_secs(),
        "a client must not cache longer than the rule lives"
    );
    assert_eq!(dir.opened()[0].ttl, MAX_ALLOW_TTL);
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_denied_name_gets_nxdomain_and_never_reaches_the_upstream() {
    let upstream = StaticDns::start(
        [
            ("denied.test", vec![DENIED_IP]),
            ("fine.test", vec![ALLOWED_IP]),
        ],
        Duration::from_secs(300),
    );
    let default_allow =
        r#"{"defaultAction":"allow","egress":[{"action":"deny","target":"denied.test"}]}"#;
    let dir = Arc::new(Directory::with(&[
        (SANDBOX, default_allow),
        (OTHER_SANDBOX, ONLY_ALLOWED),
    ]));
    let proxy = start_proxy(
        vec![upstream.addr()],
        Arc::clone(&dir),
        Duration::from_secs(2),
    );
    let at = proxy.local_addr();

    let denied = ask_udp(at, SANDBOX, &question("denied.test.", RecordType::A)).await;
    assert_eq!(denied.response_code(), ResponseCode::NXDomain);
    assert!(denied.answers().is_empty());
    // Same name over TCP, and a name outside a default-deny policy.
    let denied_tcp = ask_tcp(at, SANDBOX, &question("DENIED.test.", RecordType::A)).await;
    assert_eq!(denied_tcp.response_code(), ResponseCode::NXDomain);
    let unlisted = ask_udp(at, OTHER_SANDBOX, &question("fine.test.", RecordType::A)).await;
    assert_eq!(unlisted.response_code(), ResponseCode::NXDomain);

    // The counter works: a name the default allows does reach the upstream.
    let fine = ask_udp(at, SANDBOX, &question("fine.test.", RecordType::A)).await;
    assert_eq!(a_records(&fine), vec![ALLOWED_IP]);
    assert_eq!(upstream.queries_for("fine.test"), 1);
    assert_eq!(
        upstream.queries_for("denied.test"),
        0,
        "{:?}",
        upstream.seen()
    );
    assert_eq!(
        dir.opened()
            .iter()
            .map(|o| o.addrs.clone())
            .collect::<Vec<_>>(),
        vec![vec![ALLOWED_IP]]
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn wildcard_rules_match_names_below_in_rule_order() {
    let upstream = StaticDns::builder()
        .a("mirror.pkg.test", [ALLOWED_IP])
        .a("deep.cdn.pkg.test", [ALLOWED_IP_2])
        .a("bad.pkg.test", [DENIED_IP])
        .a("pkg.test", [DENIED_IP])
        .start();
    let policy = r#"{"defaultAction":"deny","egress":[
        {"action":"deny","target":"bad.pkg.test"},
        {"action":"allow","target":"*.pkg.test"}]}"#;
    let dir = Arc::new(Directory::with(&[(SANDBOX, policy)]));
    let proxy = start_proxy(
        vec![upstream.addr()],
        Arc::clone(&dir),
        Duration::from_secs(2),
    );
    let at = proxy.local_addr();

    for (name, expected) in [
        ("mirror.pkg.test.", vec![ALLOWED_IP]),
        ("DEEP.cdn.pkg.test.", vec![ALLOWED_IP_2]),
    ] {
        let reply = ask_udp(at, SANDBOX, &question(name, RecordType::A)).await;
        assert_eq!(reply.response_code(), ResponseCode::NoError, "{name}");
        assert_eq!(a_records(&reply), expected, "{name}");
    }
    for name in ["bad.pkg.test.", "pkg.test."] {
        let reply = ask_udp(at, SANDBOX, &question(name, RecordType::A)).await;
        assert_eq!(reply.response_code(), ResponseCode::NXDomain, "{name}");
    }
    assert_eq!(upstream.queries_for("bad.pkg.test"), 0);
    assert_eq!(upstream.queries_for("pkg.test"), 0);
    assert_eq!(dir.opened().len(), 2);
    proxy.shutdown().await;
}

#[tokio::test]
async fn an_unknown_source_is_refused_over_udp_and_tcp() {
    let upstream = StaticDns::start(
        [("allowed.test", vec![ALLOWED_IP])],
        Duration::from_secs(60),
    );
    let dir = Arc::new(Directory::with(&[(SANDBOX, "{}")]));
    let proxy = start_proxy(
        vec![upstream.addr()],
        Arc::clone(&dir),
        Duration::from_secs(2),
    );
    let q = question("allowed.test.", RecordType::A);

    let udp = ask_udp(proxy.local_addr(), STRANGER, &q).await;
    assert_eq!(udp.response_code(), ResponseCode::Refused);
    let tcp = ask_tcp(proxy.local_addr(), STRANGER, &q).await;
    assert_eq!(tcp.response_code(), ResponseCode::Refused);
    assert_eq!(upstream.query_count(), 0);
    // The same question from the sandbox (allow-all policy) is answered.
    let ours = ask_udp(proxy.local_addr(), SANDBOX, &q).await;
    assert_eq!(a_records(&ours), vec![ALLOWED_IP]);
    assert!(dir.opened().iter().all(|o| o.source == SANDBOX));
    proxy.shutdown().await;
}

#[tokio::test]
async fn aaaa_records_never_reach_a_sandbox() {
    let v6: Ipv6Addr = "2001:db8::10".parse().unwrap();
    let upstream = StaticDns::builder()
        .a("allowed.test", [ALLOWED_IP])
        .aaaa("allowed.test", [v6])
        .start();
    let dir = Arc::new(Directory::with(&[(SANDBOX, ONLY_ALLOWED)]));
    let proxy = start_proxy(
        vec![upstream.addr()],
        Arc::clone(&dir),
        Duration::from_secs(2),
    );
    let at = proxy.local_addr();

    let aaaa = ask_udp(at, SANDBOX, &question("allowed.test.", RecordType::AAAA)).await;
    assert_eq!(aaaa.response_code(), ResponseCode::NoError);
    assert!(aaaa.answers().is_empty(), "{:?}", aaaa.answers());
    let any = ask_tcp(at, SANDBOX, &question("allowed.test.", RecordType::ANY)).await;
    assert_eq!(
        any.answers()
            .iter()
            .map(|r| r.record_type())
            .collect::<Vec<_>>(),
        vec![RecordType::A]
    );
    // Proof the upstream did send AAAA: both questions reached it.
    assert_eq!(upstream.queries_for("allowed.test"), 2);
    assert_eq!(
        dir.opened()
            .iter()
            .map(|o| o.addrs.clone())
            .collect::<Vec<_>>(),
        vec![vec![ALLOWED_IP]],
        "only the ANY answer carried an A record"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_failed_opening_turns_the_answer_into_servfail() {
    let upstream = StaticDns::start(
        [("allowed.test", vec![ALLOWED_IP])],
        Duration::from_secs(60),
    );
    let dir = Arc::new(Directory {
        failing: true,
        ..Directory::with(&[(SANDBOX, ONLY_ALLOWED)])
    });
    let proxy = start_proxy(
        vec![upstream.addr()],
        Arc::clone(&dir),
        Duration::from_secs(2),
    );

    let reply = ask_udp(
        proxy.local_addr(),
        SANDBOX,
        &question("allowed.test.", RecordType::A),
    )
    .await;
    assert_eq!(reply.response_code(), ResponseCode::ServFail);
    assert!(reply.answers().is_empty(), "no address may leak");
    assert_eq!(upstream.queries_for("allowed.test"), 1);
    proxy.shutdown().await;
}

#[tokio::test]
async fn tcp_queries_and_truncated_upstream_answers_are_served() {
    let upstream = StaticDns::builder()
        .a("allowed.test", [ALLOWED_IP])
        .a("big.allowed.test", [ALLOWED_IP_2])
        .truncate_over_udp("big.allowed.test")
        .cname("alias.allowed.test", "target.elsewhere.test")
        .a("target.elsewhere.test", [DENIED_IP])
        .start();
    let policy = r#"{"defaultAction":"deny","egress":[
        {"action":"allow","target":"allowed.test"},
        {"action":"allow","target":"*.allowed.test"}]}"#;
    let dir = Arc::new(Directory::with(&[(SANDBOX, policy)]));
    let proxy = start_proxy(
        vec![upstream.addr()],
        Arc::clone(&dir),
        Duration::from_secs(2),
    );
    let at = proxy.local_addr();

    let tcp = ask_tcp(at, SANDBOX, &question("allowed.test.", RecordType::A)).await;
    assert_eq!(a_records(&tcp), vec![ALLOWED_IP]);

    // Over UDP, the upstream says TC: the proxy asks again over TCP itself.
    let big = ask_udp(at, SANDBOX, &question("big.allowed.test.", RecordType::A)).await;
    assert!(!big.truncated());
    assert_eq!(a_records(&big), vec![ALLOWED_IP_2]);
    assert_eq!(upstream.tcp_queries_for("big.allowed.test"), 1);
    assert_eq!(upstream.queries_for("big.allowed.test"), 2);

    // The question's name is what is judged: a CNAME target's address opens too.
    let alias = ask_udp(at, SANDBOX, &question("alias.allowed.test.", RecordType::A)).await;
    assert_eq!(a_records(&alias), vec![DENIED_IP]);
    assert_eq!(
        dir.opened()
            .iter()
            .map(|o| o.addrs.clone())
            .collect::<Vec<_>>(),
        vec![vec![ALLOWED_IP], vec![ALLOWED_IP_2], vec![DENIED_IP]]
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_slow_upstream_gives_servfail_without_stalling_other_queries() {
    let timeout = Duration::from_secs(1);
    let upstream = StaticDns::builder()
        .a("slow.test", [DENIED_IP])
        .delay("slow.test", Duration::from_secs(60))
        .a("fast.test", [ALLOWED_IP])
        .start();
    let dir = Arc::new(Directory::with(&[(SANDBOX, "{}"), (OTHER_SANDBOX, "{}")]));
    let proxy = start_proxy(vec![upstream.addr()], Arc::clone(&dir), timeout);
    let at = proxy.local_addr();

    let started = Instant::now();
    let slow = tokio::spawn(async move {
        let reply = ask_udp(at, SANDBOX, &question("slow.test.", RecordType::A)).await;
        (reply, Instant::now())
    });
    // The slow question is in flight before the fast one is asked.
    sandbolt_test_support::eventually("slow.test at the upstream", CLIENT_WAIT, || {
        (upstream.queries_for("slow.test") == 1).then_some(())
    })
    .await;
    let fast = ask_udp(at, OTHER_SANDBOX, &question("fast.test.", RecordType::A)).await;
    let fast_at = Instant::now();
    assert_eq!(a_records(&fast), vec![ALLOWED_IP]);

    let (slow, slow_at) = slow.await.unwrap();
    assert_eq!(slow.response_code(), ResponseCode::ServFail);
    assert!(fast_at < slow_at, "the fast answer waited for the slow one");
    assert!(
        slow_at - started >= timeout,
        "SERVFAIL came before the upstream timeout"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn upstreams_are_tried_in_order_past_a_silent_one() {
    let timeout = Duration::from_millis(500);
    // Bound but never read: every query to it times out.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let upstream = StaticDns::start(
        [("allowed.test", vec![ALLOWED_IP])],
        Duration::from_secs(60),
    );
    let dir = Arc::new(Directory::with(&[(SANDBOX, ONLY_ALLOWED)]));
    let proxy = start_proxy(
        vec![silent.local_addr().unwrap(), upstream.addr()],
        Arc::clone(&dir),
        timeout,
    );

    let started = Instant::now();
    let reply = ask_udp(
        proxy.local_addr(),
        SANDBOX,
        &question("allowed.test.", RecordType::A),
    )
    .await;
    assert_eq!(a_records(&reply), vec![ALLOWED_IP]);
    assert!(
        started.elapsed() >= timeout,
        "the silent upstream was not asked first"
    );
    let mut buf = [0u8; 512];
    silent.set_nonblocking(true).unwrap();
    assert!(
        silent.recv_from(&mut buf).is_ok(),
        "the silent upstream got the query"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn a_query_must_carry_exactly_one_question() {
    let upstream = StaticDns::start(
        [("allowed.test", vec![ALLOWED_IP])],
        Duration::from_secs(60),
    );
    let dir = Arc::new(Directory::with(&[(SANDBOX, "{}")]));
    let proxy = start_proxy(
        vec![upstream.addr()],
        Arc::clone(&dir),
        Duration::from_secs(2),
    );

    let mut two = question("allowed.test.", RecordType::A);
    two.add_query(Query::query(
        Name::from_ascii("other.test.").unwrap(),
        RecordType::A,
    ));
    let reply = ask_udp(proxy.local_addr(), SANDBOX, &two).await;
    assert_eq!(reply.response_code(), ResponseCode::FormErr);
    let mut none = question("allowed.test.", RecordType::A);
    none.take_queries();
    let reply = ask_udp(proxy.local_addr(), SANDBOX, &none).await;
    assert_eq!(reply.response_code(), ResponseCode::FormErr);
    assert_eq!(upstream.query_count(), 0);
    proxy.shutdown().await;
}

#[tokio::test]
async fn resolve_a_is_the_agents_own_lookup() {
    let upstream = StaticDns::start(
        [("denied.test", vec![DENIED_IP, ALLOWED_IP])],
        Duration::from_secs(3600),
    );
    let dir = Arc::new(Directory::default());
    let proxy = start_proxy(vec![upstream.addr()], dir, Duration::from_millis(500));

    let found = proxy.resolve_a("Denied.Test").await.unwrap();
    let hour = Duration::from_secs(3600);
    assert_eq!(found, vec![(DENIED_IP, hour), (ALLOWED_IP, hour)]);
    assert_eq!(proxy.resolve_a("missing.test.").await.unwrap(), vec![]);
    assert!(matches!(
        proxy.resolve_a("bad..name").await,
        Err(DnsError::BadName { .. })
    ));
    proxy.shutdown().await;

    // Nobody answers: the error says so instead of an empty list.
    let silent = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let proxy = start_proxy(
        vec![silent.local_addr().unwrap()],
        Arc::new(Directory::default()),
        Duration::from_millis(300),
    );
    let err = proxy.resolve_a("denied.test").await.unwrap_err();
    assert!(matches!(err, DnsError::NoAnswer { .. }), "{err}");
    proxy.shutdown().await;
}

#[tokio::test]
async fn after_shutdown_the_address_can_be_bound_again() {
    let upstream = StaticDns::start(
        [("allowed.test", vec![ALLOWED_IP])],
        Duration::from_secs(60),
    );
    let dir = Arc::new(Directory::with(&[(SANDBOX, "{}")]));
    let proxy = start_proxy(
        vec![upstream.addr()],
        Arc::clone(&dir),
        Duration::from_secs(2),
    );
    let at = proxy.local_addr();
    let reply = ask_tcp(at, SANDBOX, &question("allowed.test.", RecordType::A)).await;
    assert_eq!(a_records(&reply), vec![ALLOWED_IP]);
    proxy.shutdown().await;

    let again =
        DnsProxy::start(at, vec![upstream.addr()], dir).expect("rebinding the same address");
    let reply = ask_udp(at, SANDBOX, &question("allowed.test.", RecordType::A)).await;
    assert_eq!(a_records(&reply), vec![ALLOWED_IP]);
    again.shutdown().await;
}
