//! The bridge's peer table: slots for the peers it talks to, their dead
//! marks (from the liveness table) and refusals, and what a death does.

use super::*;
use crate::resolve::{HostPort, ResolveError, Resolver};

impl Bridge {
    /// Answers a frame of another protocol version with the frozen
    /// `Refuse`, which the peer reads whatever version it speaks, so both
    /// sides report the mismatch. No slot is created for such a peer.
    pub(super) fn refuse(&mut self, peer: Result<u32, Vec<u8>>, theirs: u16) {
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

    /// Sends to a ROUTER peer that has no slot (it never said hello).
    pub(super) fn send_to_identity(&self, identity: &[u8], bytes: Vec<u8>) {
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

    /// The slot for prefill side channel `addr`, connecting a DEALER and
    /// saying hello the first time.
    pub(super) fn dealer_for(&mut self, addr: &str) -> Option<u32> {
        if let Some(&p) = self.by_addr.get(addr) {
            return Some(p);
        }
        // Prefill ranks that restart come back at new addresses: when the
        // table is full, reuse the slot of a dead one that no transfer
        // refers to any more.
        let Some(at) = self.room_for(true) else {
            tracing::warn!(
                addr,
                limit = self.shared.config.max_peers,
                "cannot connect to prefill side channel: max_peers reached"
            );
            self.shared
                .counters
                .limit_hits
                .fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let connected = match side_channel_endpoint(addr, &self.resolver) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(addr, %e, "cannot connect to prefill side channel");
                return None;
            }
        };
        let s = self.ctx.socket(zmq::DEALER).ok()?;
        // The monitor is attached before connecting, so no event is missed.
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
        if let Err(e) = configure(&s, &self.shared.config).and_then(|()| s.connect(&connected)) {
            tracing::warn!(addr, %e, "cannot connect to prefill side channel");
            return None;
        }
        let mut slot = Slot::new(Route::Dealer(s), monitor, addr.to_string());
        slot.connected = connected;
        let id = self.install(at, slot);
        self.by_addr.insert(addr.to_string(), id);
        if let Some(h) = self.own_hello() {
            self.send_frame(id, &Frame::Hello(h));
        }
        Some(id)
    }

    /// Decode, for dealer `i` whose peer is dead or silent: on a probe,
    /// starts looking its name up again; once the answer is in, moves the
    /// DEALER to the new address if the name moved (a prefill pod that
    /// restarted elsewhere). The bridge never waits for it.
    pub(super) fn reresolve(&mut self, i: usize, probe: bool) {
        let slot = &mut self.slots[i];
        let Route::Dealer(socket) = &slot.route else {
            return;
        };
        let Some(lookup) = &mut slot.lookup else {
            let named = side_channel_host(&slot.addr).is_ok_and(|h| h.is_name());
            if probe && named {
                let h = side_channel_host(&slot.addr).expect("parsed above");
                slot.lookup = self.resolver.start(&h).ok();
            }
            return;
        };
        let Some(answer) = lookup.poll() else {
            return;
        };
        slot.lookup = None;
        let now = match answer {
            Ok(a) => format!("tcp://{a}"),
            Err(e) => {
                tracing::debug!(addr = %slot.addr, %e, "prefill side channel not resolved again");
                return;
            }
        };
        if now == slot.connected {
            return;
        }
        tracing::info!(addr = %slot.addr, from = %slot.connected, to = %now, "prefill side channel moved");
        let _ = socket.disconnect(&slot.connected);
        match socket.connect(&now) {
            Ok(()) => slot.connected = now,
            Err(e) => {
                tracing::warn!(addr = %slot.addr, %e, "cannot connect to the moved side channel")
            }
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
                Dir::Querying | Dir::Failed(_) => true,
            });
        }
    }
}

/// The host and port of side-channel address `addr` (`tcp://host:port`).
fn side_channel_host(addr: &str) -> Result<HostPort, ResolveError> {
    HostPort::parse(addr.strip_prefix("tcp://").unwrap_or(addr))
}

/// The endpoint a DEALER connects to for side channel `addr`, its name
/// resolved first (within `resolve_timeout`, on the bridge thread).
/// ZeroMQ would take the name itself, but it looks it up with no bound,
/// on its I/O thread (stalling every socket of the node) and in
/// `connect`; resolving here gives a typed error within the bound, and
/// `reresolve` follows a name that moved.
fn side_channel_endpoint(addr: &str, resolver: &Resolver) -> Result<String, ResolveError> {
    let hp = side_channel_host(addr)?;
    Ok(format!("tcp://{}", resolver.resolve(&hp)?))
}
