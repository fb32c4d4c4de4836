//! Peer liveness as a sans-IO table: the driver says what it heard and
//! that time passed; the table says which peers died.
//!
//! A peer is dead once nothing was heard from it for more than
//! `silence_max` (the node probes every peer each heartbeat interval, so
//! silence means it is gone, stuck or cut off), or at once when its
//! connection dropped. Anything heard from a dead peer revives it. Each
//! death is reported once by [`Liveness::poll_dead`]; the driver fails the
//! peer's transfers then. Like the machines, the table reads no clock:
//! every input carries `now`, which never goes backwards.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// Why a peer was declared dead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeathCause {
    /// Nothing heard for more than `silence_max`.
    Silent {
        /// How long it had been quiet.
        quiet: Duration,
    },
    /// Its connection dropped.
    Dropped,
}

#[derive(Clone, Copy, Debug)]
struct Peer {
    /// When the peer was added, or last heard from.
    heard: Instant,
    dead: bool,
}

/// The liveness of a node's peers, by the driver's peer id.
#[derive(Clone, Debug)]
pub struct Liveness {
    silence_max: Duration,
    peers: BTreeMap<u32, Peer>,
    /// Deaths not reported yet, oldest first.
    deaths: VecDeque<(u32, DeathCause)>,
    dead: usize,
}

impl Liveness {
    /// A table that declares a peer dead after `silence_max` of silence.
    pub fn new(silence_max: Duration) -> Liveness {
        Liveness {
            silence_max,
            peers: BTreeMap::new(),
            deaths: VecDeque::new(),
            dead: 0,
        }
    }

    /// A peer takes slot `peer` (new, or reusing the slot of a dead one):
    /// alive, its silence counted from `now`.
    pub fn handle_added(&mut self, now: Instant, peer: u32) {
        let fresh = Peer {
            heard: now,
            dead: false,
        };
        if let Some(old) = self.peers.insert(peer, fresh) {
            if old.dead {
                self.dead -= 1;
            }
        }
    }

    /// Something arrived from `peer`. True when it was dead: the mark is
    /// cleared.
    pub fn handle_heard(&mut self, now: Instant, peer: u32) -> bool {
        let Some(p) = self.peers.get_mut(&peer) else {
            return false;
        };
        p.heard = p.heard.max(now);
        let revived = p.dead;
        if revived {
            p.dead = false;
            self.dead -= 1;
        }
        revived
    }

    /// The connection to `peer` dropped: it is dead now.
    pub fn handle_dropped(&mut self, peer: u32) {
        self.kill(peer, DeathCause::Dropped);
    }

    /// Time passed: every live peer silent for more than `silence_max` dies.
    pub fn handle_tick(&mut self, now: Instant) {
        let silent: Vec<(u32, Duration)> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.dead)
            .map(|(&id, p)| (id, now.saturating_duration_since(p.heard)))
            .filter(|&(_, quiet)| quiet > self.silence_max)
            .collect();
        for (id, quiet) in silent {
            self.kill(id, DeathCause::Silent { quiet });
        }
    }

    /// The next death not reported yet. Drain after every `handle_*` call.
    #[must_use]
    pub fn poll_dead(&mut self) -> Option<(u32, DeathCause)> {
        self.deaths.pop_front()
    }

    /// True while `peer` is marked dead.
    pub fn is_dead(&self, peer: u32) -> bool {
        self.peers.get(&peer).is_some_and(|p| p.dead)
    }

    /// Peers marked dead now.
    pub fn dead_count(&self) -> usize {
        self.dead
    }

    fn kill(&mut self, peer: u32, cause: DeathCause) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        if p.dead {
            return;
        }
        p.dead = true;
        self.dead += 1;
        self.deaths.push_back((peer, cause));
    }
}
