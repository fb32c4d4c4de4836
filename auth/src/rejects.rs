//! What every surface counts when it refuses a peer: one counter per
//! surface, shared by whatever serves it (`kvferry_auth_rejected_total`).

use std::sync::atomic::{AtomicU64, Ordering};

/// A place a node, a bootstrap service or a store server authenticates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Surface {
    /// The HTTP endpoints: the bootstrap service's `/register` and
    /// `/query`, and `/metrics` where it is authenticated (a node's
    /// `metrics_listen` too).
    Bootstrap,
    /// The ZeroMQ side channel.
    SideChannel,
    /// The tcp data plane's connections.
    DataPlane,
    /// The shared-memory socket.
    Shm,
    /// The store server's connections.
    Store,
}

impl Surface {
    /// Every surface, in the order the counters are rendered.
    pub const ALL: [Surface; 5] = [
        Surface::Bootstrap,
        Surface::SideChannel,
        Surface::DataPlane,
        Surface::Shm,
        Surface::Store,
    ];

    /// Its `surface` label.
    pub fn label(self) -> &'static str {
        match self {
            Surface::Bootstrap => "bootstrap",
            Surface::SideChannel => "side_channel",
            Surface::DataPlane => "data_plane",
            Surface::Shm => "shm",
            Surface::Store => "store",
        }
    }

    fn index(self) -> usize {
        Surface::ALL
            .iter()
            .position(|s| *s == self)
            .expect("listed")
    }
}

/// Refusals and limited requests per surface. Shared (`Arc`) by the
/// servers of one process.
#[derive(Debug, Default)]
pub struct Rejects {
    counts: [AtomicU64; 5],
    limited: [AtomicU64; 5],
}

impl Rejects {
    /// Counts one refusal on `surface`.
    pub fn count(&self, surface: Surface) {
        self.counts[surface.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Refusals on `surface` so far.
    pub fn get(&self, surface: Surface) -> u64 {
        self.counts[surface.index()].load(Ordering::Relaxed)
    }

    /// Counts one request or connection turned away on `surface` for
    /// exceeding its address's budget.
    pub fn count_limited(&self, surface: Surface) {
        self.limited[surface.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Requests or connections limited on `surface` so far.
    pub fn limited(&self, surface: Surface) -> u64 {
        self.limited[surface.index()].load(Ordering::Relaxed)
    }
}
