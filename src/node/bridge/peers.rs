//! The bridge's peer table: slots for the peers it talks to, their dead
//! marks (from the liveness table) and refusals, and what a death does.

use super::*;
use crate::resolve::{HostPort, ResolveError};

impl Bridge {
    /// Answers a frame of another protocol version with the frozen
    /// `Refuse`, which the peer reads whatever version it speaks, so both
    /// sides report the mismatch. No slot is created for such a peer.
    pub(super) fn refuse(&mut self, peer: Sender, theirs: u16) {
        tracing::warn!(
            theirs,
            ours = wire::VERSION,
            "peer speaks another wire version; refused"
        );
        self.shared
            .counters
            .version_refusals_sent
            .fetch_add(1, Ordering::Relaxed);
        let refuse = wire::encode(&Frame::Refuse(wire::Refuse {
            version: wire::VERSION,
            reason: wire::RefuseReason::UnsupportedVersion,
        }));
        match peer {
            Ok(slot) => self.send_bytes(slot, refuse),
            Err(identity) => self.send_to_identity(&identity, refuse),
        }
    }

    /// Sends to a ROUTER peer that has no slot (it never said hello):
    /// with a key, sealed for its connection, or not at all when it has
    /// not authenticated.
    pub(super) fn send_to_identity(&mut self, identity: &[u8], bytes: Vec<u8>) {
        let bytes = match self.router_gates.session(identity) {
            _ if self.shared.key.is_none() => bytes,
            Some(gate) => match gate.outgoing(bytes) {
                auth::Outgoing::Send(b) => b,
                auth::Outgoing::Held | auth::Outgoing::Dropped => return,
            },
            None => return,
        };
        self.send_raw_to_identity(identity, bytes);
    }

    /// Sends `bytes` as they are to ROUTER identity `identity`.
    pub(super) fn send_raw_to_identity(&self, identity: &[u8], bytes: Vec<u8>) {
        let sent = self.router.as_ref().map(|router| {
            router
                .send(identity, zmq::SNDMORE | zmq::DONTWAIT)
                .and_then(|()| router.send(bytes, zmq::DONTWAIT))
        });
        if let Some(Ok(())) = sent {
            Counters::inc(&self.shared.counters.sidechannel_sent);
        } else {
            self.shared
                .counters
                .dropped_frames
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The peer will not read our frames: its transfers cannot run. The
    /// requests waiting for it fail at once (see `try_resolve`) instead of
    /// waiting out the bootstrap timeout.
    pub(super) fn on_refused(&mut self, peer: Option<u32>, refuse: wire::Refuse) {
        tracing::warn!(
            peer,
            theirs = refuse.version,
            ours = wire::VERSION,
            reason = ?refuse.reason,
            "peer refused our frames"
        );
        self.shared
            .counters
            .version_refusals_received
            .fetch_add(1, Ordering::Relaxed);
        let Some(slot) = peer.and_then(|p| self.slots.get_mut(p as usize)) else {
            return;
        };
        slot.refused = Some(refuse.version);
        slot.ready = false;
        self.routes_changed(None);
        self.retry_pending();
    }

    /// Where a new peer goes under `max_peers`: `Some(None)` a new slot,
    /// `Some(Some(i))` slot `i` of a dead peer of the same kind (a DEALER
    /// we connected, or a ROUTER identity) that no transfer refers to any
    /// more, `None` no room.
    pub(super) fn room_for(&self, dealer: bool) -> Option<Option<usize>> {
        if self.slots.len() < self.shared.config.max_peers {
            return Some(None);
        }
        self.slots
            .iter()
            .enumerate()
            .position(|(i, s)| {
                self.liveness.is_dead(i as u32)
                    && s.transfers.is_empty()
                    && matches!(s.route, Route::Dealer(_)) == dealer
            })
            .map(Some)
    }

    /// Puts `slot` where [`Bridge::room_for`] said; a reused slot's peer is
    /// forgotten (its index entry, its dead mark, its hello).
    pub(super) fn install(&mut self, at: Option<usize>, slot: Slot) -> u32 {
        let now = Instant::now();
        let Some(i) = at else {
            self.slots.push(slot);
            let id = self.slots.len() as u32 - 1;
            self.liveness.handle_added(now, id);
            return id;
        };
        self.routes_changed(Some(i as u32));
        self.resolving.remove(&(i as u32));
        let old = std::mem::replace(&mut self.slots[i], slot);
        match &old.route {
            Route::Identity(id) => self.by_identity.remove(id),
            Route::Dealer(_) => self.by_addr.remove(&old.addr),
        };
        self.liveness.handle_added(now, i as u32);
        self.publish_dead_count();
        self.shared.remove_peer(i as u32);
        i as u32
    }

    /// The slot for prefill side channel `addr`, making a DEALER the first
    /// time: connected and saying hello at once for an IP address; for a
    /// name, once its lookup (started here, answered on another thread)
    /// has an answer, so the bridge never waits for a lookup. `None` when
    /// there is no room, or when the address is malformed or its latest
    /// lookup failed: the request fails at once. A probe looks a failed
    /// name up again.
    pub(super) fn dealer_for(&mut self, addr: &str) -> Option<u32> {
        if let Some(&p) = self.by_addr.get(addr) {
            return (!self.slots[p as usize].unresolved).then_some(p);
        }
        let host = side_channel_host(addr)
            .inspect_err(|e| tracing::warn!(addr, %e, "cannot connect to prefill side channel"))
            .ok()?;
        // Prefill ranks that restart come back at new addresses: when the
        // table is full, reuse the slot of a dead one that no transfer
        // refers to any more.
        let Some(at) = self.room_for(true) else {
            let limit = self.shared.config.max_peers;
            let what = format_args!("cannot connect to prefill side channel {addr}");
            self.shared.limit_reached("max_peers", limit, what);
            return None;
        };
        let (s, monitor) = self.new_dealer(addr)?;
        let id = self.install(at, Slot::new(Route::Dealer(s), monitor, addr.to_string()));
        self.by_addr.insert(addr.to_string(), id);
        match host.literal() {
            Some(ip) => self.connect_dealer(id as usize, format!("tcp://{ip}")),
            None => self.start_lookup(id as usize, &host),
        }
        (!self.slots[id as usize].unresolved).then_some(id)
    }

    /// A DEALER for side channel `addr`, with its monitor attached before
    /// it connects, so no event is missed.
    fn new_dealer(&mut self, addr: &str) -> Option<(zmq::Socket, Option<zmq::Socket>)> {
        let s = self.ctx.socket(zmq::DEALER).ok()?;
        if let Err(e) = configure(&s, &self.shared.config) {
            tracing::warn!(addr, %e, "cannot set up a prefill side-channel socket");
            return None;
        }
        self.monitors += 1;
        let endpoint = format!("inproc://kvferry-node-monitor-{}", self.monitors);
        let monitor = s
            .monitor(&endpoint, zmq::SocketEvent::DISCONNECTED as i32)
            .and_then(|()| self.ctx.socket(zmq::PAIR))
            .and_then(|m| {
                m.set_linger(0)
                    .and_then(|()| m.connect(&endpoint))
                    .map(|()| m)
            });
        let monitor = match monitor {
            Ok(m) => Some(m),
            Err(e) => {
                // Heartbeat silence still finds a dead peer, only later.
                tracing::warn!(addr, %e, "no socket monitor; relying on heartbeats");
                None
            }
        };
        Some((s, monitor))
    }

    /// Connects dealer `i` to `endpoint` (`tcp://ip:port`), leaving the
    /// one it was connected to (a name that moved); the first time, says
    /// hello.
    pub(super) fn connect_dealer(&mut self, i: usize, endpoint: String) {
        let hello = self.own_hello();
        let slot = &mut self.slots[i];
        let Route::Dealer(socket) = &slot.route else {
            return;
        };
        if endpoint == slot.connected {
            slot.unresolved = false;
            return;
        }
        let first = slot.connected.is_empty();
        if !first {
            tracing::info!(addr = %slot.addr, from = %slot.connected, to = %endpoint, "prefill side channel moved");
            let _ = socket.disconnect(&slot.connected);
        }
        match socket.connect(&endpoint) {
            Ok(()) => {
                slot.connected = endpoint;
                slot.unresolved = false;
                // A new connection: a new handshake opens it.
                self.rekey_dealer(i as u32);
            }
            Err(e) => {
                tracing::warn!(addr = %slot.addr, %e, "cannot connect to prefill side channel");
                slot.unresolved = slot.connected.is_empty();
                return;
            }
        }
        if let (true, Some(h)) = (first, hello) {
            self.send_frame(i as u32, &Frame::Hello(h));
        }
    }

    /// Starts looking up dealer `i`'s side-channel name; the answer wakes
    /// the bridge, which polls it in [`Bridge::poll_lookups`].
    fn start_lookup(&mut self, i: usize, host: &HostPort) {
        match self.resolver.start(host) {
            Ok(l) => {
                self.slots[i].lookup = Some(l);
                self.resolving.insert(i as u32);
            }
            Err(e) => {
                let slot = &mut self.slots[i];
                tracing::warn!(addr = %slot.addr, %e, "prefill side channel not looked up");
                slot.unresolved = slot.connected.is_empty();
            }
        }
    }

    /// Decode, for dealer `i` whose peer is dead or silent: on a probe,
    /// looks its side channel's name up again, so a rank that moved (a
    /// restarted pod) is reached at its new address.
    pub(super) fn reresolve(&mut self, i: usize, probe: bool) {
        let slot = &self.slots[i];
        if !probe || slot.lookup.is_some() || !matches!(slot.route, Route::Dealer(_)) {
            return;
        }
        if let Some(h) = side_channel_host(&slot.addr).ok().filter(HostPort::is_name) {
            self.start_lookup(i, &h);
        }
    }

    /// Takes the answers of the lookups under way (side-channel names and
    /// the data-plane endpoints of hellos): connects the dealers whose name
    /// resolved, finishes the hellos, and lets waiting requests go on (or
    /// fail, for a name that did not resolve).
    pub(super) fn poll_lookups(&mut self) {
        let mut changed = false;
        let waiting: Vec<u32> = self.resolving.iter().copied().collect();
        for i in waiting {
            let i = i as usize;
            let side_channel = self.slots[i].lookup.as_mut().and_then(|l| l.poll());
            if let Some(answer) = side_channel {
                self.slots[i].lookup = None;
                changed = true;
                match answer {
                    Ok(a) => self.connect_dealer(i, format!("tcp://{a}")),
                    Err(e) => {
                        let slot = &mut self.slots[i];
                        tracing::warn!(addr = %slot.addr, %e, "prefill side channel not resolved");
                        slot.unresolved = slot.connected.is_empty();
                    }
                }
            }
            if let Some(hello) = self.take_hello_answer(i) {
                changed = true;
                self.complete_hello(i as u32, hello);
            }
            let slot = &self.slots[i];
            if slot.lookup.is_none() && slot.hello_lookup.is_none() {
                self.resolving.remove(&(i as u32));
            }
        }
        if changed {
            self.retry_pending();
        }
    }

    /// Something a cached route depends on changed (a peer died, a slot
    /// was reused, the directory changed): forget the routes, and tie the
    /// transfers resolved from them so far to their peers, under the lock
    /// the engine threads resolve under. After this no engine thread uses
    /// the old routes, and every transfer that did is in its peers' sets.
    pub(super) fn routes_changed(&mut self, reused: Option<u32>) {
        let mut routes = self.shared.routes();
        routes.clear(reused);
        for (peer, tid) in self.shared.take_tracked() {
            if let Some(s) = self.slots.get_mut(peer as usize) {
                s.transfers.insert(tid);
            }
        }
        drop(routes);
    }

    /// Handles the deaths the liveness table reports.
    pub(super) fn on_deaths(&mut self) {
        while let Some((peer, cause)) = self.liveness.poll_dead() {
            self.on_dead(peer as usize, cause);
        }
        self.publish_dead_count();
    }

    pub(super) fn publish_dead_count(&self) {
        let dead = self.liveness.dead_count() as u64;
        self.shared.counters.dead_now.store(dead, Ordering::Relaxed);
    }

    /// Slot `i` died: its routes go and its transfers fail with `PeerDead`.
    pub(super) fn on_dead(&mut self, i: usize, cause: DeathCause) {
        self.routes_changed(None);
        let Some(s) = self.slots.get_mut(i) else {
            return;
        };
        // The gauge first: whoever sees the death counted sees it dead.
        let dead = self.liveness.dead_count() as u64;
        self.shared.counters.dead_now.store(dead, Ordering::Relaxed);
        Counters::inc(&self.shared.counters.peers_marked_dead);
        tracing::warn!(peer = i, addr = %s.addr, ?cause, "peer marked dead");
        let tids: Vec<TransferId> = s.transfers.drain().collect();
        let addr = s.addr.clone();
        for tid in tids {
            self.peer_dead(tid, i as u32);
        }
        if !addr.is_empty() {
            // A replacement may register elsewhere: ask again next time.
            self.directory.retain(|_, d| match d {
                Dir::Known(ranks) => !ranks.addrs.contains(&addr),
                Dir::Querying | Dir::Failed(_) | Dir::Refused(_) => true,
            });
        }
    }
}

/// The host and port of side-channel address `addr` (`tcp://host:port`).
fn side_channel_host(addr: &str) -> Result<HostPort, ResolveError> {
    HostPort::parse(addr.strip_prefix("tcp://").unwrap_or(addr))
}
