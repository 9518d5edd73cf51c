//! A small authoritative DNS server for tests ([`StaticDns`]): it answers
//! from a table given at start, on 127.0.0.1 (UDP and TCP on one port), and
//! remembers every question it got, so that a test can prove a name never
//! reached it.
//!
//! It runs on its own thread and runtime, so a slow answer it was told to
//! give never stalls the test's runtime, and dropping it stops everything.

use std::collections::{HashMap, HashSet};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;

/// One question the server received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenQuery {
    /// Lowercase, without the trailing dot.
    pub name: String,
    pub record_type: RecordType,
    /// Whether it came over TCP (else UDP).
    pub tcp: bool,
}

/// What the server knows and how it misbehaves on purpose.
#[derive(Debug, Clone)]
struct Zone {
    ttl: u32,
    a: HashMap<String, Vec<Ipv4Addr>>,
    aaaa: HashMap<String, Vec<Ipv6Addr>>,
    cname: HashMap<String, String>,
    delay: HashMap<String, Duration>,
    truncate_over_udp: HashSet<String>,
}

/// Builds a [`StaticDns`]. Names are matched case-insensitively, with or
/// without the trailing dot.
#[derive(Debug, Clone)]
pub struct StaticDnsBuilder {
    zone: Zone,
}

impl StaticDnsBuilder {
    /// The TTL of every record (whole seconds; default 300 s).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.zone.ttl = u32::try_from(ttl.as_secs()).expect("a TTL fits in u32");
        self
    }

    /// A records of `name`.
    pub fn a(mut self, name: &str, addrs: impl IntoIterator<Item = Ipv4Addr>) -> Self {
        self.zone
            .a
            .entry(normalize(name))
            .or_default()
            .extend(addrs);
        self
    }

    /// AAAA records of `name` (answered to AAAA and ANY questions).
    pub fn aaaa(mut self, name: &str, addrs: impl IntoIterator<Item = Ipv6Addr>) -> Self {
        self.zone
            .aaaa
            .entry(normalize(name))
            .or_default()
            .extend(addrs);
        self
    }

    /// `alias` is a CNAME of `target`; answers carry the CNAME, then the
    /// target's records.
    pub fn cname(mut self, alias: &str, target: &str) -> Self {
        self.zone.cname.insert(normalize(alias), normalize(target));
        self
    }

    /// Questions for `name` are answered only after `delay`.
    pub fn delay(mut self, name: &str, delay: Duration) -> Self {
        self.zone.delay.insert(normalize(name), delay);
        self
    }

    /// Questions for `name` over UDP get an empty answer with the TC bit
    /// (the client must ask again over TCP).
    pub fn truncate_over_udp(mut self, name: &str) -> Self {
        self.zone.truncate_over_udp.insert(normalize(name));
        self
    }

    /// Binds 127.0.0.1:<free port> (UDP and TCP) and starts answering.
    pub fn start(self) -> StaticDns {
        StaticDns::serve(self.zone)
    }
}

/// A running test DNS server; stopped on drop.
pub struct StaticDns {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<SeenQuery>>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StaticDns {
    /// A server answering A questions from `records`, NXDOMAIN for other names.
    pub fn start<'a>(
        records: impl IntoIterator<Item = (&'a str, Vec<Ipv4Addr>)>,
        ttl: Duration,
    ) -> Self {
        records
            .into_iter()
            .fold(Self::builder().ttl(ttl), |b, (name, addrs)| {
                b.a(name, addrs)
            })
            .start()
    }

    /// An empty table (every name NXDOMAIN) with a 300 s TTL.
    pub fn builder() -> StaticDnsBuilder {
        StaticDnsBuilder {
            zone: Zone {
                ttl: 300,
                a: HashMap::new(),
                aaaa: HashMap::new(),
                cname: HashMap::new(),
                delay: HashMap::new(),
                truncate_over_udp: HashSet::new(),
            },
        }
    }

    /// Where it listens (UDP and TCP).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Every question received so far, in arrival order.
    pub fn seen(&self) -> Vec<SeenQuery> {
        self.seen.lock().expect("seen lock").clone()
    }

    /// How many questions it received in all.
    pub fn query_count(&self) -> usize {
        self.seen.lock().expect("seen lock").len()
    }

    /// How many questions for `name` it received (any type, any transport).
    pub fn queries_for(&self, name: &str) -> usize {
        let name = normalize(name);
        self.seen().iter().filter(|q| q.name == name).count()
    }

    /// How many questions for `name` came over TCP.
    pub fn tcp_queries_for(&self, name: &str) -> usize {
        let name = normalize(name);
        self.seen()
            .iter()
            .filter(|q| q.name == name && q.tcp)
            .count()
    }

    fn serve(zone: Zone) -> Self {
        let (udp, tcp) = bind_pair();
        let addr = udp.local_addr().expect("UDP local address");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (stop, stopped) = oneshot::channel();
        let server = Server {
            zone: Arc::new(zone),
            seen: Arc::clone(&seen),
        };
        let thread = std::thread::Builder::new()
            .name("static-dns".into())
            .spawn(move || server.run(udp, tcp, stopped))
            .expect("spawning the static DNS thread");
        StaticDns {
            addr,
            seen,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for StaticDns {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// UDP and TCP sockets on the same free port of 127.0.0.1.
fn bind_pair() -> (UdpSocket, TcpListener) {
    for _ in 0..20 {
        let udp = UdpSocket::bind("127.0.0.1:0").expect("binding UDP 127.0.0.1:0");
        let addr = udp.local_addr().expect("UDP local address");
        if let Ok(tcp) = TcpListener::bind(addr) {
            udp.set_nonblocking(true).expect("non-blocking UDP");
            tcp.set_nonblocking(true).expect("non-blocking TCP");
            return (udp, tcp);
        }
    }
    panic!("no port of 127.0.0.1 was free for both UDP and TCP after 20 tries");
}

fn normalize(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

#[derive(Clone)]
struct Server {
    zone: Arc<Zone>,
    seen: Arc<Mutex<Vec<SeenQuery>>>,
}

impl Server {
    fn run(self, udp: UdpSocket, tcp: TcpListener, stopped: oneshot::Receiver<()>) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("the static DNS runtime");
        // Dropping the runtime at the end cancels answers still being delayed.
        runtime.block_on(async move {
            let udp = Arc::new(tokio::net::UdpSocket::from_std(udp).expect("tokio UDP"));
            let tcp = tokio::net::TcpListener::from_std(tcp).expect("tokio TCP");
            tokio::select! {
                _ = stopped => {}
                () = self.clone().serve_udp(udp) => {}
                () = self.serve_tcp(tcp) => {}
            }
        });
    }

    async fn serve_udp(self, socket: Arc<tokio::net::UdpSocket>) {
        let mut buf = vec![0u8; 65_535];
        loop {
            let Ok((len, peer)) = socket.recv_from(&mut buf).await else {
                continue;
            };
            let request = buf[..len].to_vec();
            let (server, socket) = (self.clone(), Arc::clone(&socket));
            tokio::spawn(async move {
                if let Some(reply) = server.answer(&request, false).await {
                    let _ = socket.send_to(&reply, peer).await;
                }
            });
        }
    }

    async fn serve_tcp(self, listener: tokio::net::TcpListener) {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(self.clone().serve_connection(stream));
        }
    }

    async fn serve_connection(self, mut stream: tokio::net::TcpStream) {
        loop {
            let Ok(len) = stream.read_u16().await else {
                return;
            };
            let mut request = vec![0u8; usize::from(len)];
            if stream.read_exact(&mut request).await.is_err() {
                return;
            }
            let Some(reply) = self.answer(&request, true).await else {
                return;
            };
            let len = u16::try_from(reply.len()).expect("a DNS message fits in 64 KiB");
            if stream.write_u16(len).await.is_err() || stream.write_all(&reply).await.is_err() {
                return;
            }
        }
    }

    async fn answer(&self, request: &[u8], tcp: bool) -> Option<Vec<u8>> {
        let request = Message::from_vec(request).ok()?;
        let query = request.queries().first()?.clone();
        let name = normalize(&query.name().to_ascii());
        self.seen.lock().expect("seen lock").push(SeenQuery {
            name: name.clone(),
            record_type: query.query_type(),
            tcp,
        });
        if let Some(delay) = self.zone.delay.get(&name) {
            tokio::time::sleep(*delay).await;
        }
        let mut reply = Message::new();
        reply
            .set_id(request.id())
            .set_message_type(MessageType::Response)
            .set_op_code(OpCode::Query)
            .set_authoritative(true)
            .set_recursion_desired(request.recursion_desired())
            .add_query(query.clone());
        if !tcp && self.zone.truncate_over_udp.contains(&name) {
            reply.set_truncated(true);
        } else {
            match self.zone.records(&name, query.query_type()) {
                Some(records) => reply.add_answers(records),
                None => reply.set_response_code(ResponseCode::NXDomain),
            };
        }
        reply.to_vec().ok()
    }
}

impl Zone {
    /// The answer for `name` (the CNAME chain, then the records of the
    /// asked type); None when the name does not exist.
    fn records(&self, name: &str, record_type: RecordType) -> Option<Vec<Record>> {
        let mut records = Vec::new();
        let mut current = name.to_owned();
        // A bounded walk: a CNAME loop in a test table must not hang the server.
        for _ in 0..8 {
            let Some(target) = self.cname.get(&current) else {
                break;
            };
            records.push(Record::from_rdata(
                fqdn(&current),
                self.ttl,
                RData::CNAME(CNAME(fqdn(target))),
            ));
            current.clone_from(target);
        }
        let a = self.a.get(&current);
        let aaaa = self.aaaa.get(&current);
        if records.is_empty() && a.is_none() && aaaa.is_none() {
            return None;
        }
        let owner = fqdn(&current);
        if matches!(record_type, RecordType::A | RecordType::ANY) {
            for addr in a.into_iter().flatten() {
                records.push(Record::from_rdata(
                    owner.clone(),
                    self.ttl,
                    RData::A(A(*addr)),
                ));
            }
        }
        if matches!(record_type, RecordType::AAAA | RecordType::ANY) {
            for addr in aaaa.into_iter().flatten() {
                let rdata = RData::AAAA(AAAA(*addr));
                records.push(Record::from_rdata(owner.clone(), self.ttl, rdata));
            }
        }
        Some(records)
    }
}

fn fqdn(name: &str) -> Name {
    let mut name = Name::from_ascii(name).expect("a valid test DNS name");
    name.set_fqdn(true);
    name
}
