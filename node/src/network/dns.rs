//! The agent's DNS proxy: the only resolver a sandbox can reach (its
//! `/etc/resolv.conf` names the gateway; every other port 53/853 is dropped
//! by nftables). It is where FQDN policy is enforced:
//!
//! - a query from an address that is not one of this agent's attached
//!   sandboxes is REFUSED;
//! - a name the sandbox's policy denies gets NXDOMAIN, answered here, so the
//!   upstream resolvers never learn of it;
//! - an allowed name is forwarded to the upstreams, and every A address of
//!   the answer is opened for that sandbox ([`SandboxDirectory::allow_resolved`])
//!   BEFORE the answer leaves, so the client can never connect ahead of the
//!   rule. If opening fails the answer becomes SERVFAIL.
//!
//! Sandboxes are IPv4-only: AAAA records are removed from every answer, and
//! address records outside the answer section are removed too, so that every
//! address a client learns went through the policy. TTLs are capped at
//! [`MAX_ALLOW_TTL`] so that a client's cache never outlives the rule that
//! opened the address.
//!
//! Message parsing and building is `hickory-proto`'s; the proxy logic is here.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use parking_lot::Mutex;
use sandbolt_proto::egress::{Action, NetworkPolicy};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::{JoinHandle, JoinSet};

/// Shortest life of an opened address: a name with a tiny TTL must stay
/// reachable long enough for the client to connect after resolving it.
pub const MIN_ALLOW_TTL: Duration = Duration::from_secs(60);
/// Longest life of an opened address (and the cap on TTLs handed to clients).
pub const MAX_ALLOW_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// How long a TCP client may stay silent before its connection is closed.
const TCP_IDLE: Duration = Duration::from_secs(10);
/// The largest DNS message (TCP length prefix, UDP datagram).
const MAX_MESSAGE: usize = 65_535;
/// How many times a requested port 0 is retried until UDP and TCP share one.
const PORT_ZERO_TRIES: usize = 20;

/// What the proxy needs from the rest of the agent.
pub trait SandboxDirectory: Send + Sync + 'static {
    /// The policy of the attached sandbox with this source address (None = not ours).
    fn policy_for(&self, source: Ipv4Addr) -> Option<Arc<NetworkPolicy>>;
    /// Opens `addrs` for the sandbox at `source` (a_<m>, timeout `ttl`); resolves once the
    /// nft rule is in place. Errors are logged by the caller and the answer becomes SERVFAIL.
    fn allow_resolved(
        &self,
        source: Ipv4Addr,
        addrs: Vec<Ipv4Addr>,
        ttl: Duration,
    ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + '_>>;
}

/// Tuning of a [`DnsProxy`]; [`Default`] suits the agent.
#[derive(Debug, Clone)]
pub struct ProxyOptions {
    /// How long one upstream may take to answer one query before the next
    /// upstream is tried (each upstream is tried once, in order).
    pub upstream_timeout: Duration,
    /// Queries (UDP) and connections (TCP) handled at once, all sources together.
    pub max_in_flight: usize,
    /// Queries and connections handled at once for one source address, so a
    /// sandbox flooding a slow name cannot starve the others.
    pub max_in_flight_per_source: usize,
}

impl Default for ProxyOptions {
    fn default() -> Self {
        Self {
            upstream_timeout: Duration::from_secs(2),
            max_in_flight: 1024,
            max_in_flight_per_source: 64,
        }
    }
}

/// Why [`DnsProxy::resolve_a`] has no addresses to give.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DnsError {
    #[error("{name:?} is not a valid DNS name: {detail}")]
    BadName { name: String, detail: String },
    #[error("no upstream resolver answered for {name}: {detail}")]
    NoAnswer { name: String, detail: String },
    #[error("the upstream resolvers answered {code} for {name}")]
    Failed { name: String, code: ResponseCode },
}

/// The running proxy. Dropping it stops accepting queries;
/// [`DnsProxy::shutdown`] also waits for the queries in flight to be cancelled
/// and the sockets to be closed.
pub struct DnsProxy {
    local: SocketAddrV4,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl DnsProxy {
    /// Binds UDP and TCP on `listen` (with IP_FREEBIND: the address need not
    /// be on any interface yet; port 0 picks one free for both) and starts
    /// serving on the current Tokio runtime. `upstreams` are tried in order.
    pub fn start(
        listen: SocketAddrV4,
        upstreams: Vec<SocketAddr>,
        dir: Arc<dyn SandboxDirectory>,
    ) -> io::Result<DnsProxy> {
        Self::start_with(listen, upstreams, dir, ProxyOptions::default())
    }

    /// [`DnsProxy::start`] with explicit [`ProxyOptions`].
    #[tracing::instrument(skip_all, fields(%listen, ?upstreams))]
    pub fn start_with(
        listen: SocketAddrV4,
        upstreams: Vec<SocketAddr>,
        dir: Arc<dyn SandboxDirectory>,
        options: ProxyOptions,
    ) -> io::Result<DnsProxy> {
        if upstreams.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the DNS proxy needs at least one upstream resolver",
            ));
        }
        let (udp, tcp) = bind_listeners(listen)?;
        let local = match udp.local_addr()? {
            SocketAddr::V4(a) => a,
            SocketAddr::V6(a) => unreachable!("an IPv4 socket bound {a}"),
        };
        let shared = Arc::new(Shared {
            upstreams: Upstreams {
                addrs: upstreams,
                timeout: options.upstream_timeout,
            },
            dir,
            admission: Admission::new(options.max_in_flight, options.max_in_flight_per_source),
        });
        let (stop, stopped) = watch::channel(false);
        let tasks = vec![
            tokio::spawn(serve_udp(
                Arc::new(udp),
                Arc::clone(&shared),
                stopped.clone(),
            )),
            tokio::spawn(serve_tcp(tcp, Arc::clone(&shared), stopped)),
        ];
        tracing::info!(%local, "DNS proxy listening (UDP and TCP)");
        Ok(DnsProxy {
            local,
            shared,
            stop,
            tasks,
        })
    }

    /// Where the proxy listens (UDP and TCP).
    pub fn local_addr(&self) -> SocketAddrV4 {
        self.local
    }

    /// The agent's own A lookup through the upstreams (for the addresses of
    /// denied names). NXDOMAIN and no-data are an empty list. Each address
    /// comes with its TTL clamped to [[`MIN_ALLOW_TTL`], [`MAX_ALLOW_TTL`]].
    #[tracing::instrument(skip(self))]
    pub async fn resolve_a(&self, name: &str) -> Result<Vec<(Ipv4Addr, Duration)>, DnsError> {
        let mut fqdn = Name::from_ascii(name).map_err(|e| DnsError::BadName {
            name: name.to_owned(),
            detail: e.to_string(),
        })?;
        fqdn.set_fqdn(true);
        let mut query = Message::new();
        query
            .set_message_type(MessageType::Query)
            .set_op_code(OpCode::Query)
            .set_recursion_desired(true)
            .add_query(Query::query(fqdn, RecordType::A));
        let response = self
            .shared
            .upstreams
            .exchange(&query)
            .await
            .map_err(|detail| DnsError::NoAnswer {
                name: name.to_owned(),
                detail,
            })?;
        match response.response_code() {
            ResponseCode::NoError => {}
            ResponseCode::NXDomain => return Ok(Vec::new()),
            code => {
                return Err(DnsError::Failed {
                    name: name.to_owned(),
                    code,
                });
            }
        }
        Ok(response
            .answers()
            .iter()
            .filter_map(|r| match r.data() {
                RData::A(a) => Some((a.0, clamp_ttl(r.ttl()))),
                _ => None,
            })
            .collect())
    }

    /// Stops serving and waits until the sockets are closed and the queries
    /// in flight are cancelled (so the address can be bound again at once).
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        for task in std::mem::take(&mut self.tasks) {
            if let Err(e) = task.await {
                tracing::warn!(error = %e, "a DNS proxy listener ended abnormally");
            }
        }
        tracing::info!(local = %self.local, "DNS proxy stopped");
    }
}

impl Drop for DnsProxy {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// The nameservers of a resolv.conf (port 53), in order: the proxy's
/// default upstreams are the host's own resolvers.
pub fn upstreams_from_resolv_conf(text: &str) -> Vec<SocketAddr> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next() == Some("nameserver")).then(|| words.next())?
        })
        .filter_map(|addr| addr.parse::<std::net::IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .collect()
}

/// Both listeners on one address, with IP_FREEBIND.
fn bind_listeners(listen: SocketAddrV4) -> io::Result<(UdpSocket, TcpListener)> {
    let tries = if listen.port() == 0 {
        PORT_ZERO_TRIES
    } else {
        1
    };
    let mut last = None;
    for _ in 0..tries {
        let udp = bind_udp(listen)?;
        let SocketAddr::V4(bound) = udp.local_addr()? else {
            unreachable!("an IPv4 socket");
        };
        match bind_tcp(bound) {
            Ok(tcp) => return Ok((UdpSocket::from_std(udp)?, TcpListener::from_std(tcp)?)),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::other("no port free for both UDP and TCP")))
}

fn bind_udp(addr: SocketAddrV4) -> io::Result<std::net::UdpSocket> {
    let socket = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    socket.set_freebind_v4(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&SocketAddr::V4(addr).into())?;
    Ok(socket.into())
}

fn bind_tcp(addr: SocketAddrV4) -> io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
    socket.set_freebind_v4(true)?;
    // A restarted agent must rebind while old connections sit in TIME_WAIT.
    socket.set_reuse_address(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&SocketAddr::V4(addr).into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// The state every query handler shares.
struct Shared {
    upstreams: Upstreams,
    dir: Arc<dyn SandboxDirectory>,
    admission: Admission,
}

/// How the reply travels back (UDP replies must fit the client's size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    Udp,
    Tcp,
}

async fn serve_udp(
    socket: Arc<UdpSocket>,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut in_flight = JoinSet::new();
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            Some(done) = in_flight.join_next(), if !in_flight.is_empty() => log_panic(done),
            received = socket.recv_from(&mut buf) => {
                let (len, peer) = match received {
                    Ok((len, SocketAddr::V4(peer))) => (len, peer),
                    Ok(_) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "DNS proxy: UDP receive failed");
                        continue;
                    }
                };
                let Some(ticket) = shared.admission.admit(*peer.ip()) else {
                    // Never waits: under a flood, a reply that does not fit
                    // the socket buffer is dropped like the query would be.
                    if let Some(reply) = overloaded_reply(&buf[..len]) {
                        let _ = socket.try_send_to(&reply, peer.into());
                    }
                    continue;
                };
                let datagram = buf[..len].to_vec();
                let (socket, shared) = (Arc::clone(&socket), Arc::clone(&shared));
                in_flight.spawn(async move {
                    let reply = shared.answer(&datagram, *peer.ip(), Transport::Udp).await;
                    drop(ticket);
                    if let Some(reply) = reply
                        && let Err(e) = socket.send_to(&reply, peer).await
                    {
                        tracing::debug!(%peer, error = %e, "DNS proxy: UDP reply not sent");
                    }
                });
            }
        }
    }
    in_flight.shutdown().await;
}

async fn serve_tcp(listener: TcpListener, shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = stopped.changed() => break,
            Some(done) = connections.join_next(), if !connections.is_empty() => log_panic(done),
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok((stream, SocketAddr::V4(peer))) => (stream, peer),
                    Ok(_) => continue,
                    Err(e) => {
                        tracing::warn!(error = %e, "DNS proxy: TCP accept failed");
                        continue;
                    }
                };
                // A connection holds one admission for its whole life: its
                // queries are answered one after another.
                let Some(ticket) = shared.admission.admit(*peer.ip()) else {
                    tracing::debug!(
                        %peer,
                        "DNS proxy: too many queries in flight, TCP connection closed"
                    );
                    continue;
                };
                let shared = Arc::clone(&shared);
                connections.spawn(serve_connection(stream, *peer.ip(), shared, ticket));
            }
        }
    }
    connections.shutdown().await;
}

async fn serve_connection(
    mut stream: TcpStream,
    source: Ipv4Addr,
    shared: Arc<Shared>,
    _ticket: Ticket,
) {
    loop {
        let Ok(Ok(len)) = tokio::time::timeout(TCP_IDLE, stream.read_u16()).await else {
            return;
        };
        let mut request = vec![0u8; usize::from(len)];
        match tokio::time::timeout(TCP_IDLE, stream.read_exact(&mut request)).await {
            Ok(Ok(_)) => {}
            _ => return,
        }
        let Some(reply) = shared.answer(&request, source, Transport::Tcp).await else {
            return;
        };
        let Ok(len) = u16::try_from(reply.len()) else {
            return;
        };
        if stream.write_u16(len).await.is_err() || stream.write_all(&reply).await.is_err() {
            return;
        }
    }
}

fn log_panic(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done
        && e.is_panic()
    {
        tracing::error!(error = %e, "a DNS query handler panicked");
    }
}

impl Shared {
    /// The reply to one raw query (None: nothing to answer, e.g. a response
    /// or bytes too short to carry a message id).
    async fn answer(
        &self,
        request: &[u8],
        source: Ipv4Addr,
        transport: Transport,
    ) -> Option<Vec<u8>> {
        let request = match Message::from_vec(request) {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(%source, error = %e, "DNS proxy: unparsable query");
                return raw_error_reply(request, ResponseCode::FormErr);
            }
        };
        if request.message_type() != MessageType::Query {
            return None;
        }
        let reply = self.reply_to(&request, source).await;
        encode_reply(&reply, transport, request.max_payload())
    }

    /// Judges the question and builds the reply (see the module docs).
    async fn reply_to(&self, request: &Message, source: Ipv4Addr) -> Message {
        let Some(policy) = self.dir.policy_for(source) else {
            tracing::debug!(%source, verdict = "refused", "DNS query from an unknown source");
            return error_reply(request, ResponseCode::Refused);
        };
        if request.op_code() != OpCode::Query {
            tracing::debug!(%source, op_code = ?request.op_code(), verdict = "notimp", "DNS query");
            return error_reply(request, ResponseCode::NotImp);
        }
        let [question] = request.queries() else {
            let questions = request.queries().len();
            tracing::debug!(%source, questions, verdict = "formerr", "DNS query");
            return error_reply(request, ResponseCode::FormErr);
        };
        let name = question.name().to_ascii();
        let qtype = question.query_type();
        if policy.verdict_for_name(&name) == Action::Deny {
            tracing::debug!(%source, %name, %qtype, verdict = "denied", "DNS query");
            return error_reply(request, ResponseCode::NXDomain);
        }
        let response = match self.upstreams.exchange(request).await {
            Ok(response) => response,
            Err(detail) => {
                tracing::warn!(
                    %source, %name, %qtype, %detail, verdict = "servfail",
                    "DNS query: no upstream answered"
                );
                return error_reply(request, ResponseCode::ServFail);
            }
        };
        let (reply, resolved) = filter_response(response, request.id());
        if let Some((addrs, ttl)) = resolved {
            let opened = addrs.clone();
            if let Err(e) = self.dir.allow_resolved(source, addrs, ttl).await {
                tracing::warn!(
                    %source, %name, error = %e, verdict = "servfail",
                    "DNS query: opening the resolved addresses failed"
                );
                return error_reply(request, ResponseCode::ServFail);
            }
            tracing::debug!(
                %source, %name, %qtype, verdict = "allowed", addrs = ?opened, ?ttl,
                "DNS query"
            );
        } else {
            let rcode = reply.response_code();
            tracing::debug!(%source, %name, %qtype, verdict = "allowed", %rcode, "DNS query");
        }
        reply
    }
}

/// The upstream answer as the sandbox may see it, and the A addresses it
/// carries with the time they stay open: AAAA records removed everywhere,
/// address records outside the answer section removed, TTLs capped.
fn filter_response(
    mut response: Message,
    client_id: u16,
) -> (Message, Option<(Vec<Ipv4Addr>, Duration)>) {
    response.set_id(client_id);
    let max_ttl = u32::try_from(MAX_ALLOW_TTL.as_secs()).expect("24 h fits in u32");
    let mut answers = response.take_answers();
    answers.retain(|r| r.record_type() != RecordType::AAAA);
    for record in &mut answers {
        if record.ttl() > max_ttl {
            record.set_ttl(max_ttl);
        }
    }
    let (addrs, longest) =
        answers
            .iter()
            .fold((Vec::new(), 0u32), |(mut addrs, longest), r| {
                match r.data() {
                    RData::A(a) => {
                        addrs.push(a.0);
                        (addrs, longest.max(r.ttl()))
                    }
                    _ => (addrs, longest),
                }
            });
    response.insert_answers(answers);
    let without_addresses = |records: Vec<Record>| -> Vec<Record> {
        records
            .into_iter()
            .filter(|r| !matches!(r.record_type(), RecordType::A | RecordType::AAAA))
            .collect()
    };
    let name_servers = without_addresses(response.take_name_servers());
    response.insert_name_servers(name_servers);
    let additionals = without_addresses(response.take_additionals());
    response.insert_additionals(additionals);
    let resolved = (!addrs.is_empty()).then(|| (addrs, clamp_ttl(longest)));
    (response, resolved)
}

fn clamp_ttl(ttl: u32) -> Duration {
    Duration::from_secs(u64::from(ttl)).clamp(MIN_ALLOW_TTL, MAX_ALLOW_TTL)
}

/// A reply carrying only the question and `code`.
fn error_reply(request: &Message, code: ResponseCode) -> Message {
    let mut reply = Message::new();
    reply
        .set_id(request.id())
        .set_message_type(MessageType::Response)
        .set_op_code(request.op_code())
        .set_recursion_desired(request.recursion_desired())
        .set_recursion_available(true)
        .set_response_code(code)
        .add_queries(request.queries().iter().cloned());
    reply
}

/// An error reply to bytes that did not parse: only the id is echoed.
fn raw_error_reply(request: &[u8], code: ResponseCode) -> Option<Vec<u8>> {
    // Too short for a header, or itself a response: answering could loop.
    if request.len() < 12 || request[2] & 0x80 != 0 {
        return None;
    }
    let id = u16::from_be_bytes([request[0], request[1]]);
    Message::error_msg(id, OpCode::Query, code).to_vec().ok()
}

/// SERVFAIL for a query turned away by admission (the client retries later).
fn overloaded_reply(request: &[u8]) -> Option<Vec<u8>> {
    match Message::from_vec(request) {
        Ok(m) if m.message_type() == MessageType::Query => {
            error_reply(&m, ResponseCode::ServFail).to_vec().ok()
        }
        Ok(_) => None,
        Err(_) => raw_error_reply(request, ResponseCode::ServFail),
    }
}

/// The reply's bytes; over UDP, a reply larger than the client accepts is
/// sent truncated (TC) so that the client asks again over TCP.
fn encode_reply(reply: &Message, transport: Transport, client_max: u16) -> Option<Vec<u8>> {
    let bytes = match reply.to_vec() {
        Ok(bytes) => bytes,
        Err(e) => {
            tracing::warn!(error = %e, "DNS proxy: encoding a reply failed");
            return None;
        }
    };
    if transport == Transport::Udp && bytes.len() > usize::from(client_max) {
        return reply.truncate().to_vec().ok();
    }
    Some(bytes)
}

/// The upstream resolvers and how long each may take.
struct Upstreams {
    addrs: Vec<SocketAddr>,
    timeout: Duration,
}

impl Upstreams {
    /// Asks the upstreams in order until one answers with anything but
    /// SERVFAIL/REFUSED; the error lists what each one did.
    async fn exchange(&self, request: &Message) -> Result<Message, String> {
        let mut failures = Vec::with_capacity(self.addrs.len());
        for upstream in &self.addrs {
            match self.exchange_one(*upstream, request).await {
                Ok(response)
                    if matches!(
                        response.response_code(),
                        ResponseCode::ServFail | ResponseCode::Refused
                    ) =>
                {
                    failures.push(format!("{upstream}: {}", response.response_code()));
                }
                Ok(response) => return Ok(response),
                Err(e) => failures.push(format!("{upstream}: {e}")),
            }
        }
        Err(failures.join("; "))
    }

    /// One upstream, UDP first, TCP when the UDP answer is truncated; the
    /// whole exchange shares one timeout.
    async fn exchange_one(
        &self,
        upstream: SocketAddr,
        request: &Message,
    ) -> Result<Message, String> {
        let mut query = request.clone();
        // A fresh random id (and a fresh port per query) so that an off-path
        // forger cannot guess what the proxy waits for.
        query.set_id(random_id());
        let bytes = query
            .to_vec()
            .map_err(|e| format!("encoding the query: {e}"))?;
        let exchange = async {
            let response = udp_exchange(upstream, &bytes, &query).await?;
            if response.truncated() {
                return tcp_exchange(upstream, &bytes, &query).await;
            }
            Ok(response)
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| format!("no answer within {:?}", self.timeout))?
    }
}

async fn udp_exchange(
    upstream: SocketAddr,
    bytes: &[u8],
    query: &Message,
) -> Result<Message, String> {
    let local: SocketAddr = if upstream.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(local)
        .await
        .map_err(|e| format!("UDP bind: {e}"))?;
    // Connected: the kernel drops datagrams from anyone but the upstream.
    socket
        .connect(upstream)
        .await
        .map_err(|e| format!("UDP connect: {e}"))?;
    socket
        .send(bytes)
        .await
        .map_err(|e| format!("UDP send: {e}"))?;
    let mut buf = vec![0u8; MAX_MESSAGE];
    loop {
        let len = socket
            .recv(&mut buf)
            .await
            .map_err(|e| format!("UDP receive: {e}"))?;
        if let Some(response) = matching_response(&buf[..len], query) {
            return Ok(response);
        }
    }
}

async fn tcp_exchange(
    upstream: SocketAddr,
    bytes: &[u8],
    query: &Message,
) -> Result<Message, String> {
    let mut stream = TcpStream::connect(upstream)
        .await
        .map_err(|e| format!("TCP connect: {e}"))?;
    let len = u16::try_from(bytes.len()).map_err(|_| "query too large for TCP".to_owned())?;
    stream
        .write_u16(len)
        .await
        .map_err(|e| format!("TCP send: {e}"))?;
    stream
        .write_all(bytes)
        .await
        .map_err(|e| format!("TCP send: {e}"))?;
    let len = stream
        .read_u16()
        .await
        .map_err(|e| format!("TCP receive: {e}"))?;
    let mut buf = vec![0u8; usize::from(len)];
    stream
        .read_exact(&mut buf)
        .await
        .map_err(|e| format!("TCP receive: {e}"))?;
    matching_response(&buf, query).ok_or_else(|| "TCP answer does not match the query".to_owned())
}

/// The bytes as the answer to `query` (same id, a response, same question).
fn matching_response(bytes: &[u8], query: &Message) -> Option<Message> {
    let response = Message::from_vec(bytes).ok()?;
    (response.id() == query.id()
        && response.message_type() == MessageType::Response
        && response.queries() == query.queries())
    .then_some(response)
}

fn random_id() -> u16 {
    let bytes = uuid::Uuid::new_v4().into_bytes();
    u16::from_be_bytes([bytes[0], bytes[1]])
}

/// Bounds on the work in flight: all sources together, and per source.
struct Admission {
    total: Arc<Semaphore>,
    per_source: Arc<Mutex<HashMap<Ipv4Addr, usize>>>,
    per_source_max: usize,
}

/// One admitted query or connection; releases its place on drop.
struct Ticket {
    _permit: OwnedSemaphorePermit,
    source: Ipv4Addr,
    per_source: Arc<Mutex<HashMap<Ipv4Addr, usize>>>,
}

impl Admission {
    fn new(total: usize, per_source_max: usize) -> Self {
        Self {
            total: Arc::new(Semaphore::new(total.max(1))),
            per_source: Arc::new(Mutex::new(HashMap::new())),
            per_source_max: per_source_max.max(1),
        }
    }

    /// A place for one more query from `source`, if both bounds allow it.
    fn admit(&self, source: Ipv4Addr) -> Option<Ticket> {
        let permit = Arc::clone(&self.total).try_acquire_owned().ok()?;
        let mut counts = self.per_source.lock();
        let count = counts.entry(source).or_insert(0);
        if *count >= self.per_source_max {
            tracing::debug!(%source, "DNS proxy: too many queries in flight from this source");
            return None;
        }
        *count += 1;
        Some(Ticket {
            _permit: permit,
            source,
            per_source: Arc::clone(&self.per_source),
        })
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut counts = self.per_source.lock();
        if let Some(count) = counts.get_mut(&self.source) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.source);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_nameservers_become_upstreams_in_order() {
        let text = "# generated\nsearch example.internal\nnameserver 192.0.2.1\n\
                    nameserver  2001:db8::1 \noptions ndots:2\nnameserver bogus\n";
        assert_eq!(
            upstreams_from_resolv_conf(text),
            vec![
                "192.0.2.1:53".parse::<SocketAddr>().unwrap(),
                "[2001:db8::1]:53".parse().unwrap()
            ]
        );
    }

    #[test]
    fn ttls_are_clamped_to_a_minute_and_a_day() {
        assert_eq!(clamp_ttl(0), MIN_ALLOW_TTL);
        assert_eq!(clamp_ttl(300), Duration::from_secs(300));
        assert_eq!(clamp_ttl(u32::MAX), MAX_ALLOW_TTL);
    }

    #[test]
    fn garbage_gets_formerr_but_a_stray_response_gets_nothing() {
        let mut query = vec![0xab, 0xcd, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 0xff];
        let reply =
            Message::from_vec(&raw_error_reply(&query, ResponseCode::FormErr).unwrap()).unwrap();
        assert_eq!(
            (reply.id(), reply.response_code()),
            (0xabcd, ResponseCode::FormErr)
        );
        query[2] |= 0x80;
        assert!(raw_error_reply(&query, ResponseCode::FormErr).is_none());
        assert!(raw_error_reply(&query[..5], ResponseCode::FormErr).is_none());
    }

    #[test]
    fn admission_bounds_each_source_and_releases_on_drop() {
        let admission = Admission::new(3, 2);
        let a = Ipv4Addr::new(10, 0, 0, 2);
        let b = Ipv4Addr::new(10, 0, 0, 3);
        let first = admission.admit(a).unwrap();
        let _second = admission.admit(a).unwrap();
        assert!(
            admission.admit(a).is_none(),
            "a third query from one source"
        );
        let _other = admission.admit(b).unwrap();
        assert!(admission.admit(b).is_none(), "the total bound");
        drop(first);
        assert!(admission.admit(a).is_some(), "a released place is reused");
    }

    #[tokio::test]
    async fn the_listen_address_need_not_exist_yet() {
        struct Nobody;
        impl SandboxDirectory for Nobody {
            fn policy_for(&self, _: Ipv4Addr) -> Option<Arc<NetworkPolicy>> {
                None
            }
            fn allow_resolved(
                &self,
                _: Ipv4Addr,
                _: Vec<Ipv4Addr>,
                _: Duration,
            ) -> Pin<Box<dyn Future<Output = Result<(), String>> + Send + '_>> {
                Box::pin(async { Ok(()) })
            }
        }
        // A documentation address no interface of this host carries:
        // binding it works only with IP_FREEBIND.
        let listen = SocketAddrV4::new(Ipv4Addr::new(198, 51, 100, 53), 0);
        let plain = std::net::UdpSocket::bind(listen);
        assert!(
            plain.is_err(),
            "198.51.100.53 is on an interface; the test proves nothing"
        );
        let upstream = "127.0.0.1:53".parse().unwrap();
        let proxy = DnsProxy::start(listen, vec![upstream], Arc::new(Nobody)).unwrap();
        assert_eq!(proxy.local_addr().ip(), listen.ip());
        proxy.shutdown().await;
    }
}
