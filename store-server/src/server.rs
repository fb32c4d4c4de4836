//! What the executor's tasks share ([`Server`]): the arena registered
//! with the data plane, the space that indexes it, the counters, and the
//! connections open now, per address.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use glommio::net::TcpStream;
use kvferry_auth::{ClusterKey, Rejects, Surface};
use kvferry_store::internal::arena::Arena;
use kvferry_store::internal::space::Space;
use kvferry_transport::{TcpConfig, TcpTransport, Transport};

use crate::config::{ServeConfig, ServeError};
use crate::metrics::ServerCounters;

/// Everything the executor's tasks share.
pub(crate) struct Server {
    /// Dropped before `arena`: it may touch the arena until then.
    pub(crate) transport: TcpTransport,
    /// Zeroed, prefaulted pages, touched only by the transport (registered
    /// with it) while the server lives.
    arena: Arena,
    pub(crate) space: RefCell<Space>,
    pub(crate) counters: Arc<ServerCounters>,
    pub(crate) budget_max: Duration,
    pub(crate) idle_max: Duration,
    pub(crate) max_connections: usize,
    max_connections_per_addr: usize,
    /// Connections open now per address (entries only while above 0:
    /// at most `max_connections` of them).
    per_addr: RefCell<std::collections::HashMap<std::net::IpAddr, usize>>,
    /// The sockets of the connections served now.
    pub(crate) conns: RefCell<slab::Slab<std::os::fd::RawFd>>,
    /// Set once the server stops: a failed accept ends the loop.
    pub(crate) stopping: std::cell::Cell<bool>,
}

impl Server {
    pub(crate) fn new(
        cfg: &ServeConfig,
        counters: Arc<ServerCounters>,
    ) -> Result<Server, ServeError> {
        let mut arena =
            Arena::new(cfg.capacity_bytes).map_err(|e| ServeError::Alloc { bytes: e.bytes })?;
        arena.prefault();
        let data_addr = SocketAddr::new(cfg.listen.ip(), 0);
        let tcp = TcpConfig {
            key: cfg.key.clone(),
            ..cfg.tcp.clone()
        };
        let transport = TcpTransport::bind(data_addr, tcp)?;
        // SAFETY: the arena outlives the transport (`Server`'s field order)
        // and only the transport touches it.
        unsafe { transport.register(arena.as_ptr(), cfg.capacity_bytes as usize)? };
        Ok(Server {
            transport,
            arena,
            space: RefCell::new(Space::new(cfg.capacity_bytes, cfg.max_values)),
            counters,
            budget_max: cfg.budget_max,
            idle_max: cfg.idle_max,
            max_connections: cfg.max_connections,
            max_connections_per_addr: cfg.max_connections_per_addr,
            per_addr: RefCell::default(),
            conns: RefCell::new(slab::Slab::new()),
            stopping: std::cell::Cell::new(false),
        })
    }

    /// Counts a new connection against its address's share; `None`
    /// (counted, the connection dropped) when the address holds its
    /// share already.
    pub(crate) fn admit(&self, stream: &TcpStream) -> Option<Option<std::net::IpAddr>> {
        let Ok(ip) = stream.peer_addr().map(|a| a.ip()) else {
            return Some(None);
        };
        let mut per_addr = self.per_addr.borrow_mut();
        let n = per_addr.entry(ip).or_insert(0);
        if *n >= self.max_connections_per_addr {
            tracing::warn!(%ip, "store server: this address holds its share of connections; one more refused");
            self.rejects().count_limited(Surface::Store);
            return None;
        }
        *n += 1;
        Some(Some(ip))
    }

    /// Gives a closed connection's share back to its address.
    pub(crate) fn release(&self, addr: Option<std::net::IpAddr>) {
        let Some(ip) = addr else { return };
        let mut per_addr = self.per_addr.borrow_mut();
        if let Some(n) = per_addr.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                per_addr.remove(&ip);
            }
        }
    }

    /// The cluster key control connections must prove: the data plane's,
    /// one key for both.
    pub(crate) fn key(&self) -> Option<&ClusterKey> {
        self.transport.config().key.as_ref()
    }

    /// Where refusals are counted: the data plane's counters, shared with
    /// the metrics endpoint.
    pub(crate) fn rejects(&self) -> &Rejects {
        &self.transport.config().rejects
    }

    pub(crate) fn base(&self) -> u64 {
        self.arena.base()
    }

    /// Shuts every engine connection down (the tasks holding the sockets
    /// end with the executor).
    pub(crate) fn hang_up_all(&self) {
        for (_, &fd) in self.conns.borrow().iter() {
            // SAFETY: a socket a live connection task owns; shutting it
            // down does not close it, so the fd is not reused under it.
            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        }
    }

    pub(crate) fn publish(&self) {
        self.counters.publish(&self.space.borrow().stats());
    }
}
