//! Addresses with host names: the one rule by which every `host:port` a
//! node is given (its own `host`, the bootstrap service, side channels,
//! data-plane endpoints in a peer's hello) is parsed and turned into a
//! socket address.
//!
//! Kubernetes deployments name engines by DNS name
//! (`prefill-0.prefill.svc:5600`), so names are accepted wherever an IP
//! literal is. A name is resolved
//!
//! * with a bound ([`Resolver::timeout`], `NodeConfig::resolve_timeout`):
//!   std's `ToSocketAddrs` has none, so the lookup runs on a helper thread
//!   and the caller waits for it with a deadline, and at most
//!   [`MAX_CONCURRENT_LOOKUPS`] lookups of the process run at once (a
//!   lookup that outlives its deadline keeps its place until the OS
//!   answers, so a hanging DNS server cannot pile up threads);
//! * never on a glommio executor: the node resolves its own host in
//!   `Node::start`, peers' names on the bridge thread, the bootstrap
//!   service's name on the threads that query it;
//! * again at every new connection attempt and whenever a peer is probed
//!   after its connection failed, never cached: a pod that restarted
//!   elsewhere keeps its name and is reached at its new address without
//!   restarting the node.
//!
//! Malformed input (empty host, missing or out-of-range port, a name over
//! 253 bytes or with characters DNS names do not have) is a typed
//! [`ResolveError`] before any lookup, never a panic.
//!
//! ```
//! use kvferry_transport::{HostPort, Resolver, ResolveError};
//! let r = Resolver::system(std::time::Duration::from_secs(2));
//! assert_eq!(r.resolve_str("127.0.0.1:8998").unwrap().port(), 8998);
//! assert!(matches!(HostPort::parse("prefill-0:"), Err(ResolveError::MissingPort(_))));
//! ```

use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, OnceLock};
use std::time::{Duration, Instant};

/// Longest host name DNS allows, in bytes (RFC 1035, without the root dot).
pub const MAX_NAME_BYTES: usize = 253;

/// Longest label (the part between dots) of a host name, in bytes.
const MAX_LABEL_BYTES: usize = 63;

/// Most lookups of the system resolver in flight at once, process-wide.
/// A node needs a few at a time (its peers' names when they come up); the
/// bound keeps a DNS server that never answers from costing a thread per
/// attempt.
pub const MAX_CONCURRENT_LOOKUPS: usize = 16;

/// `kvferry::NodeConfig::resolve_timeout`'s
/// default: glibc's own per-server timeout is 5 s, but a lookup on the
/// bridge thread holds every side-channel socket, so a node gives up sooner
/// and tries again at the next connection attempt or probe.
pub const DEFAULT_RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest `resolve_timeout` a node accepts (see above: the bridge waits
/// that long at most for a peer's name).
pub const MAX_RESOLVE_TIMEOUT: Duration = Duration::from_secs(60);

/// Why an address could not be parsed or resolved. The first five are the
/// caller's input; the others may succeed when tried again
/// ([`ResolveError::is_retryable`]).
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// `host:port` with nothing before the colon.
    #[error("empty host in {0:?}")]
    EmptyHost(String),
    /// No `:port` after the host.
    #[error("no port in {0:?} (expected host:port)")]
    MissingPort(String),
    /// The port is not a number from 0 to 65535.
    #[error("bad port in {0:?} (expected a number from 0 to 65535)")]
    BadPort(String),
    /// The host name is longer than [`MAX_NAME_BYTES`].
    #[error("host name of {len} bytes (at most {MAX_NAME_BYTES})")]
    NameTooLong {
        /// Its length.
        len: usize,
    },
    /// The host is neither an IP address nor a DNS name (a label is empty,
    /// longer than 63 bytes, or has a character other than letters,
    /// digits, `-` and `_`).
    #[error("bad host name {0:?}")]
    BadName(String),
    /// The resolver said the name does not exist (or failed).
    #[error("host {host:?} does not resolve: {source}")]
    NotFound {
        /// The name.
        host: String,
        /// What the resolver said.
        #[source]
        source: io::Error,
    },
    /// The name resolved to an empty list.
    #[error("host {host:?} resolves to no address")]
    NoAddress {
        /// The name.
        host: String,
    },
    /// The resolver did not answer within the bound.
    #[error("resolving host {host:?} took longer than {after_ms} ms")]
    Timeout {
        /// The name.
        host: String,
        /// The bound.
        after_ms: u64,
    },
    /// [`MAX_CONCURRENT_LOOKUPS`] lookups are in flight already, or no
    /// thread could be started for this one.
    #[error("no room for another host name lookup ({limit} in flight)")]
    Busy {
        /// The bound.
        limit: usize,
    },
}

impl ResolveError {
    /// True when the same address may resolve later (the DNS record is not
    /// there yet, the server was slow, too many lookups at once); false
    /// when the address itself is malformed.
    pub fn is_retryable(&self) -> bool {
        match self {
            ResolveError::NotFound { .. }
            | ResolveError::NoAddress { .. }
            | ResolveError::Timeout { .. }
            | ResolveError::Busy { .. } => true,
            ResolveError::EmptyHost(_)
            | ResolveError::MissingPort(_)
            | ResolveError::BadPort(_)
            | ResolveError::NameTooLong { .. }
            | ResolveError::BadName(_) => false,
        }
    }
}

/// A checked `host:port`: the host is an IP literal or a well-formed DNS
/// name (IPv6 literals in brackets, `[::1]:7000`). Nothing is resolved.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostPort {
    host: Host,
    port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Host {
    Ip(IpAddr),
    Name(String),
}

impl HostPort {
    /// Parses `host:port`.
    pub fn parse(text: &str) -> Result<HostPort, ResolveError> {
        if let Ok(addr) = text.parse::<SocketAddr>() {
            return Ok(HostPort {
                host: Host::Ip(addr.ip()),
                port: addr.port(),
            });
        }
        let Some((host, port)) = text.rsplit_once(':') else {
            return Err(ResolveError::MissingPort(text.to_string()));
        };
        if host.is_empty() {
            return Err(ResolveError::EmptyHost(text.to_string()));
        }
        // An IPv6 literal takes brackets ("[::1]:80", which parsed above):
        // without them the port cannot be told from the address.
        if host.contains([':', '[', ']']) {
            return Err(ResolveError::BadName(text.to_string()));
        }
        if port.is_empty() {
            return Err(ResolveError::MissingPort(text.to_string()));
        }
        let port = port
            .parse::<u16>()
            .map_err(|_| ResolveError::BadPort(text.to_string()))?;
        Ok(HostPort {
            host: parse_host(host)?,
            port,
        })
    }

    /// A host (IP literal or name) and a port.
    pub fn new(host: &str, port: u16) -> Result<HostPort, ResolveError> {
        if host.is_empty() {
            return Err(ResolveError::EmptyHost(host.to_string()));
        }
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        Ok(HostPort {
            host: parse_host(bare)?,
            port,
        })
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The host as given (an IPv6 literal without brackets).
    pub fn host(&self) -> String {
        match &self.host {
            Host::Ip(ip) => ip.to_string(),
            Host::Name(n) => n.clone(),
        }
    }

    /// The address itself when the host is an IP literal (nothing to
    /// resolve).
    pub fn literal(&self) -> Option<SocketAddr> {
        match self.host {
            Host::Ip(ip) => Some(SocketAddr::new(ip, self.port)),
            Host::Name(_) => None,
        }
    }

    /// True when the host is a name (it may resolve differently later).
    pub fn is_name(&self) -> bool {
        matches!(self.host, Host::Name(_))
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Ip(ip) => write!(f, "{}", SocketAddr::new(*ip, self.port)),
            Host::Name(n) => write!(f, "{n}:{}", self.port),
        }
    }
}

fn parse_host(host: &str) -> Result<Host, ResolveError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(Host::Ip(ip));
    }
    if host.len() > MAX_NAME_BYTES + 1 || (host.len() > MAX_NAME_BYTES && !host.ends_with('.')) {
        return Err(ResolveError::NameTooLong { len: host.len() });
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= MAX_LABEL_BYTES
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    };
    // A name of digits and dots only would be a malformed IPv4 literal
    // that some resolvers read as one ("127.1").
    let numeric = name.bytes().all(|b| b.is_ascii_digit() || b == b'.');
    if name.is_empty() || numeric || !name.split('.').all(label_ok) {
        return Err(ResolveError::BadName(host.to_string()));
    }
    Ok(Host::Name(host.to_string()))
}

/// How a [`Resolver`] looks a name up: the system's resolver, or one a
/// test injects to change the answer between two connection attempts.
pub type LookupFn = dyn Fn(&str, u16) -> io::Result<Vec<SocketAddr>> + Send + Sync;

/// A [`LookupFn`] a node is configured with
/// (`kvferry::NodeConfig::lookup`) instead of the
/// system's resolver: a test moves a name between two addresses with it.
#[derive(Clone)]
pub struct HostLookup(Arc<LookupFn>);

impl HostLookup {
    /// Looks names up with `lookup`.
    pub fn new(
        lookup: impl Fn(&str, u16) -> io::Result<Vec<SocketAddr>> + Send + Sync + 'static,
    ) -> HostLookup {
        HostLookup(Arc::new(lookup))
    }
}

impl fmt::Debug for HostLookup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HostLookup(..)")
    }
}

/// Resolves [`HostPort`]s with a bounded wait (see the module docs).
/// Cheap to clone; clones share the bound on concurrent lookups.
#[derive(Clone)]
pub struct Resolver {
    timeout: Duration,
    lookup: Arc<LookupFn>,
    in_flight: Arc<AtomicUsize>,
    /// Called when a lookup of [`Resolver::start`] has its answer (see
    /// [`Resolver::notifying`]).
    notify: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl fmt::Debug for Resolver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Resolver")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Default for Resolver {
    /// The system resolver with [`DEFAULT_RESOLVE_TIMEOUT`].
    fn default() -> Self {
        Resolver::system(DEFAULT_RESOLVE_TIMEOUT)
    }
}

fn system_lookup(host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
    (host, port).to_socket_addrs().map(Iterator::collect)
}

impl Resolver {
    /// The system's resolver (`getaddrinfo`: /etc/hosts, then DNS), each
    /// lookup waited for at most `timeout`. Every system resolver of the
    /// process shares [`MAX_CONCURRENT_LOOKUPS`].
    pub fn system(timeout: Duration) -> Resolver {
        static IN_FLIGHT: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
        Resolver {
            timeout,
            lookup: Arc::new(system_lookup),
            in_flight: IN_FLIGHT.get_or_init(Arc::default).clone(),
            notify: None,
        }
    }

    /// A resolver that asks `lookup` instead of the system (tests), with
    /// its own bound on concurrent lookups.
    pub fn with_lookup(
        timeout: Duration,
        lookup: impl Fn(&str, u16) -> io::Result<Vec<SocketAddr>> + Send + Sync + 'static,
    ) -> Resolver {
        Resolver {
            timeout,
            lookup: Arc::new(lookup),
            in_flight: Arc::default(),
            notify: None,
        }
    }

    /// A resolver that asks `lookup` (see [`HostLookup`]), or the system
    /// when it is `None`, waiting `timeout` for each lookup.
    pub fn configured(timeout: Duration, lookup: Option<&HostLookup>) -> Resolver {
        match lookup {
            Some(l) => Resolver {
                timeout,
                lookup: l.0.clone(),
                in_flight: Arc::default(),
                notify: None,
            },
            None => Resolver::system(timeout),
        }
    }

    /// This resolver, calling `notify` whenever a lookup it
    /// [started](Resolver::start) has its answer, so that whoever polls the
    /// [`Lookup`] (the node's bridge, between its socket reads) is woken
    /// instead of polling on a timer.
    pub fn notifying(mut self, notify: impl Fn() + Send + Sync + 'static) -> Resolver {
        self.notify = Some(Arc::new(notify));
        self
    }

    /// How long a lookup is waited for.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The socket address of `addr`: at once for an IP literal, otherwise
    /// by a lookup waited for at most [`Resolver::timeout`].
    pub fn resolve(&self, addr: &HostPort) -> Result<SocketAddr, ResolveError> {
        self.start(addr)?.wait()
    }

    /// [`HostPort::parse`], then [`Resolver::resolve`].
    pub fn resolve_str(&self, addr: &str) -> Result<SocketAddr, ResolveError> {
        self.resolve(&HostPort::parse(addr)?)
    }

    /// The IP address of a bare host (a node's own `host` setting).
    pub fn resolve_host(&self, host: &str) -> Result<IpAddr, ResolveError> {
        self.resolve(&HostPort::new(host, 0)?).map(|a| a.ip())
    }

    /// Starts resolving `addr` without waiting: the bridge polls the
    /// [`Lookup`] on its ticks instead of holding its sockets.
    pub fn start(&self, addr: &HostPort) -> Result<Lookup, ResolveError> {
        let name = match &addr.host {
            Host::Ip(ip) => {
                let addr = SocketAddr::new(*ip, addr.port);
                return Ok(Lookup(State::Done(Some(Ok(addr)))));
            }
            Host::Name(n) => n.clone(),
        };
        let busy = ResolveError::Busy {
            limit: MAX_CONCURRENT_LOOKUPS,
        };
        if self.in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_CONCURRENT_LOOKUPS {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(busy);
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let (lookup, in_flight, port) = (self.lookup.clone(), self.in_flight.clone(), addr.port);
        let notify = self.notify.clone();
        let host = name.clone();
        let spawned = std::thread::Builder::new()
            .name("kvferry-resolve".into())
            .spawn(move || {
                let answer = lookup(&host, port);
                in_flight.fetch_sub(1, Ordering::AcqRel);
                // The caller may have given up (timed out): nobody listens.
                let _ = tx.send(answer);
                if let Some(n) = notify {
                    n();
                }
            });
        if spawned.is_err() {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(busy);
        }
        Ok(Lookup(State::Pending {
            host: name,
            rx,
            deadline: Instant::now() + self.timeout,
            timeout: self.timeout,
        }))
    }
}

/// A lookup under way ([`Resolver::start`]).
#[derive(Debug)]
pub struct Lookup(State);

#[derive(Debug)]
enum State {
    /// Answered already (an IP literal), until taken.
    Done(Option<Result<SocketAddr, ResolveError>>),
    /// Running on a helper thread.
    Pending {
        host: String,
        rx: mpsc::Receiver<io::Result<Vec<SocketAddr>>>,
        deadline: Instant,
        timeout: Duration,
    },
}

impl Lookup {
    /// The answer if there is one by now (or the timeout, once the
    /// deadline passed); `None`: ask again later. After it answered once,
    /// the lookup is spent.
    pub fn poll(&mut self) -> Option<Result<SocketAddr, ResolveError>> {
        match &mut self.0 {
            State::Done(r) => r.take(),
            State::Pending {
                host,
                rx,
                deadline,
                timeout,
            } => match rx.try_recv() {
                Ok(answer) => Some(pick(host, answer)),
                Err(mpsc::TryRecvError::Disconnected) => Some(Err(gone(host))),
                Err(mpsc::TryRecvError::Empty) if Instant::now() >= *deadline => {
                    Some(Err(timed_out(host, *timeout)))
                }
                Err(mpsc::TryRecvError::Empty) => None,
            },
        }
    }

    /// Waits for the answer until the deadline.
    pub fn wait(self) -> Result<SocketAddr, ResolveError> {
        match self.0 {
            State::Done(r) => r.unwrap_or_else(|| Err(gone("(spent lookup)"))),
            State::Pending {
                host,
                rx,
                deadline,
                timeout,
            } => match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(answer) => pick(&host, answer),
                Err(mpsc::RecvTimeoutError::Timeout) => Err(timed_out(&host, timeout)),
                Err(mpsc::RecvTimeoutError::Disconnected) => Err(gone(&host)),
            },
        }
    }
}

/// The address of a lookup's answer that a node uses. IPv4 first: a node
/// binds its own name's address by this rule and its peers connect to
/// that name by the same rule, so both ends of a dual-stack name
/// (`localhost`: 127.0.0.1 and ::1) agree on one address, which matters
/// where a peer is recognised by the endpoint it advertised.
fn pick(host: &str, answer: io::Result<Vec<SocketAddr>>) -> Result<SocketAddr, ResolveError> {
    let addrs = answer.map_err(|source| ResolveError::NotFound {
        host: host.to_string(),
        source,
    })?;
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| ResolveError::NoAddress {
            host: host.to_string(),
        })
}

fn timed_out(host: &str, timeout: Duration) -> ResolveError {
    ResolveError::Timeout {
        host: host.to_string(),
        after_ms: timeout.as_millis() as u64,
    }
}

/// The lookup thread ended without answering (the injected lookup
/// panicked).
fn gone(host: &str) -> ResolveError {
    ResolveError::NotFound {
        host: host.to_string(),
        source: io::Error::other("the lookup ended without an answer"),
    }
}

/// What a node advertises for an endpoint it bound: the host the operator
/// configured, with the bound port. A name stays a name (peers resolve
/// it, and re-resolve it after a restart moved the node); an address is
/// advertised as configured even when the node listens elsewhere
/// (`NodeConfig::listen`, e.g. `0.0.0.0`); an unspecified address
/// (`0.0.0.0`, `::`) names no host, so the bound address is advertised.
/// `bound` is `scheme://ip:port`, as the transports and ZeroMQ report it.
pub fn advertised(configured_host: &str, bound: &str) -> String {
    let Some((scheme, rest)) = bound.split_once("://") else {
        return bound.to_string();
    };
    let Ok(b) = HostPort::parse(rest) else {
        return bound.to_string();
    };
    match HostPort::new(configured_host, b.port()) {
        Ok(h) if !h.literal().is_some_and(|a| a.ip().is_unspecified()) => format!("{scheme}://{h}"),
        _ => bound.to_string(),
    }
}

/// Whether `ip` is an address of this host: loopback, or assigned to one
/// of its interfaces (`getifaddrs`). A server without a cluster key serves
/// callers that pass this and turns the rest away: a connection from this
/// host to one of its own addresses comes from that address (or loopback).
/// False when the interfaces cannot be listed.
pub fn is_own_address(ip: std::net::IpAddr) -> bool {
    ip.is_loopback() || own_addresses().contains(&ip)
}

/// The addresses assigned to this host's interfaces.
fn own_addresses() -> Vec<std::net::IpAddr> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `getifaddrs` fills `head` with a list it allocated, which is
    // read below and freed once by `freeifaddrs`.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list `getifaddrs` returned, not yet
        // freed; `ifa_addr` is null or points at a sockaddr of its family.
        unsafe {
            let addr = (*cur).ifa_addr;
            if !addr.is_null() {
                match i32::from((*addr).sa_family) {
                    libc::AF_INET => {
                        let a = &*(addr as *const libc::sockaddr_in);
                        out.push(std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)).into());
                    }
                    libc::AF_INET6 => {
                        let a = &*(addr as *const libc::sockaddr_in6);
                        out.push(std::net::Ipv6Addr::from(a.sin6_addr.s6_addr).into());
                    }
                    _ => {}
                }
            }
            cur = (*cur).ifa_next;
        }
    }
    // SAFETY: `head` came from `getifaddrs` and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_addresses_are_loopback_and_the_interfaces_but_no_other() {
        assert!(is_own_address("127.0.0.1".parse().unwrap()));
        assert!(is_own_address("::1".parse().unwrap()));
        // The address the outbound route leaves from is this host's, when
        // there is such a route; a documentation address never is.
        let udp = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        if udp.connect("192.0.2.1:9").is_ok() {
            assert!(is_own_address(udp.local_addr().unwrap().ip()));
        }
        assert!(!is_own_address("192.0.2.1".parse().unwrap()));
        assert!(!is_own_address("2001:db8::1".parse().unwrap()));
    }

    #[test]
    fn malformed_addresses_are_typed_errors() {
        let long = format!("{}.svc:1", "a.".repeat(130));
        type Is = fn(&ResolveError) -> bool;
        let cases: &[(&str, Is)] = &[
            ("", |e| matches!(e, ResolveError::MissingPort(_))),
            (":80", |e| matches!(e, ResolveError::EmptyHost(_))),
            ("host", |e| matches!(e, ResolveError::MissingPort(_))),
            ("host:", |e| matches!(e, ResolveError::MissingPort(_))),
            ("host:65536", |e| matches!(e, ResolveError::BadPort(_))),
            ("host:-1", |e| matches!(e, ResolveError::BadPort(_))),
            ("host:http", |e| matches!(e, ResolveError::BadPort(_))),
            (&long, |e| matches!(e, ResolveError::NameTooLong { .. })),
            ("a..b:1", |e| matches!(e, ResolveError::BadName(_))),
            ("a b:1", |e| matches!(e, ResolveError::BadName(_))),
            ("h\r\nX: y:1", |e| matches!(e, ResolveError::BadName(_))),
            ("::1:80", |e| matches!(e, ResolveError::BadName(_))),
            ("127.1:80", |e| matches!(e, ResolveError::BadName(_))),
        ];
        for (text, ok) in cases {
            let e = HostPort::parse(text).unwrap_err();
            assert!(ok(&e), "{text:?}: {e:?}");
            assert!(!e.is_retryable(), "{text:?}");
        }
        let label = format!("{}.svc", "a".repeat(64));
        assert!(matches!(
            HostPort::new(&label, 1),
            Err(ResolveError::BadName(_))
        ));
        assert!(matches!(
            HostPort::new("", 1),
            Err(ResolveError::EmptyHost(_))
        ));
    }

    #[test]
    fn literals_and_names_parse() {
        let v6 = HostPort::parse("[::1]:7000").unwrap();
        assert_eq!(v6.literal(), Some("[::1]:7000".parse().unwrap()));
        assert_eq!(v6.to_string(), "[::1]:7000");
        let n = HostPort::parse("prefill-0.prefill.svc:5600").unwrap();
        assert!(n.is_name() && n.literal().is_none());
        assert_eq!(
            (n.host(), n.port()),
            ("prefill-0.prefill.svc".to_string(), 5600)
        );
        assert_eq!(n.to_string(), "prefill-0.prefill.svc:5600");
        assert!(HostPort::parse(&format!("{}:1", "a".repeat(MAX_NAME_BYTES))).is_err());
        let l63 = "a".repeat(63);
        let at_limit = format!("{l63}.{l63}.{l63}.{}", "b".repeat(61));
        assert_eq!(at_limit.len(), MAX_NAME_BYTES);
        assert!(HostPort::parse(&format!("{at_limit}:1")).is_ok());
        assert!(matches!(
            HostPort::parse(&format!("{at_limit}b:1")),
            Err(ResolveError::NameTooLong { len: 254 })
        ));
        assert_eq!(HostPort::new("[::1]", 5).unwrap().to_string(), "[::1]:5");
    }

    #[test]
    fn every_resolution_asks_again() {
        let answers = Arc::new(std::sync::Mutex::new(vec![
            "10.0.0.2:5600".parse::<SocketAddr>().unwrap(),
            "10.0.0.1:5600".parse().unwrap(),
        ]));
        let a = answers.clone();
        let r = Resolver::with_lookup(Duration::from_secs(5), move |_, _| {
            Ok(vec![a.lock().unwrap().pop().expect("asked too often")])
        });
        let name = HostPort::parse("prefill-0.svc:5600").unwrap();
        assert_eq!(r.resolve(&name).unwrap().to_string(), "10.0.0.1:5600");
        assert_eq!(r.resolve(&name).unwrap().to_string(), "10.0.0.2:5600");
    }

    #[test]
    fn ipv4_is_preferred_and_an_empty_answer_is_an_error() {
        let r = Resolver::with_lookup(Duration::from_secs(5), |h, p| match h {
            "dual" => Ok(vec![
                SocketAddr::new("::1".parse().unwrap(), p),
                SocketAddr::new("127.0.0.1".parse().unwrap(), p),
            ]),
            _ => Ok(Vec::new()),
        });
        assert_eq!(r.resolve_str("dual:9").unwrap().to_string(), "127.0.0.1:9");
        let e = r.resolve_str("empty:9").unwrap_err();
        assert!(matches!(e, ResolveError::NoAddress { .. }) && e.is_retryable());
    }

    #[test]
    fn a_lookup_that_does_not_answer_times_out_and_keeps_its_place() {
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let release_rx = std::sync::Mutex::new(release_rx);
        let r = Resolver::with_lookup(Duration::from_millis(20), move |_, _| {
            let _ = release_rx.lock().unwrap().recv();
            Ok(Vec::new())
        });
        let e = r.resolve_str("slow.example:1").unwrap_err();
        assert!(
            matches!(&e, ResolveError::Timeout { host, after_ms: 20 } if host == "slow.example"),
            "{e:?}"
        );
        // The lookups that outlived their deadline still hold their
        // places: past the bound, new ones are refused at once.
        for _ in 1..MAX_CONCURRENT_LOOKUPS {
            assert!(matches!(
                r.resolve_str("slow.example:1"),
                Err(ResolveError::Timeout { .. })
            ));
        }
        let e = r.resolve_str("slow.example:1").unwrap_err();
        assert!(matches!(e, ResolveError::Busy { .. }), "{e:?}");
        drop(release_tx);
    }

    #[test]
    fn names_are_advertised_as_configured() {
        assert_eq!(
            advertised("prefill-0.svc", "tcp://10.1.2.3:5600"),
            "tcp://prefill-0.svc:5600"
        );
        assert_eq!(
            advertised("127.0.0.1", "tcp://127.0.0.1:5600"),
            "tcp://127.0.0.1:5600"
        );
        assert_eq!(advertised("localhost", "local://3"), "local://3");
        // Listening on every interface, advertising the configured address.
        assert_eq!(
            advertised("10.1.2.3", "tcp://0.0.0.0:5600"),
            "tcp://10.1.2.3:5600"
        );
        assert_eq!(advertised("::1", "tcp://[::]:5600"), "tcp://[::1]:5600");
        assert_eq!(
            advertised("0.0.0.0", "tcp://0.0.0.0:5600"),
            "tcp://0.0.0.0:5600"
        );
    }
}
