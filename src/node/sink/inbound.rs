//! Side-channel frames that arrive over the data plane, handed to the
//! machines on this executor.

use super::*;

/// Takes the side-channel frames a peer sends over the data plane (see
/// [`pump_notes`]) on this node's executor. Messages for transfers this
/// executor holds live go straight to their machines; anything else takes
/// the bridge's path, as if it had come over ZeroMQ. Refuses (so the peer
/// resends over the side channel) when the sender is not a peer whose hello
/// named that endpoint.
pub(super) fn notify_handler(
    shared: Arc<Shared>,
    poster: EventPoster<Duplex>,
    live: Live,
) -> crate::transport::NotifyHandler {
    let router = Rc::new(NoteRouter {
        shared,
        poster,
        live,
        deferred: RefCell::new(Deferred::default()),
    });
    Rc::new(move |bytes: &[u8]| {
        let shared = &router.shared;
        let limits = shared.config.frame_limits;
        let (sender, frames) = match wire::decode_notify(bytes, &limits) {
            Ok(x) => x,
            Err(e) => {
                tracing::debug!(%e, "bad data-plane notification");
                shared.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
                return false;
            }
        };
        let Ok(endpoint) = sender.parse::<EndpointAddr>() else {
            tracing::debug!(sender, "data-plane notification names no endpoint");
            return false;
        };
        let peers = shared.peers_at(&endpoint);
        if peers.is_empty() {
            tracing::debug!(sender, "data-plane notification from an unknown endpoint");
            return false;
        }
        let mode = shared.config.mode;
        for f in frames {
            match wire::decode(f, &limits) {
                Ok(Frame::Transfer { transfer_id, msg }) => {
                    // Which of the sender's peer slots: the one it is a
                    // decode peer in, or the one it is a prefill peer in.
                    let peer = toward(&msg, mode).and_then(|d| peers.get(d));
                    match peer {
                        Some(peer) => router.route(peer, transfer_id, msg),
                        None => {
                            tracing::debug!(?msg, "no peer of that endpoint takes this message");
                            shared.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                Ok(other) => {
                    tracing::debug!(?other, "only transfer messages travel over the data plane");
                    shared.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::debug!(%e, "bad frame in a data-plane notification");
                    shared.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        true
    })
}

/// Where the data-plane notifications of one executor go.
pub(super) struct NoteRouter {
    pub(super) shared: Arc<Shared>,
    pub(super) poster: EventPoster<Duplex>,
    pub(super) live: Live,
    pub(super) deferred: RefCell<Deferred>,
}

/// Most messages waiting a turn in [`Deferred`] per executor.
pub(super) const MAX_DEFERRED_NOTES: usize = 1024;

/// Messages waiting for the executor's mailbox to be taken once.
#[derive(Default)]
pub(super) struct Deferred {
    /// In arrival order; while it is not empty every message joins it, so
    /// none overtakes an earlier one.
    pub(super) queue: std::collections::VecDeque<(u32, TransferId, Msg)>,
    pub(super) draining: bool,
}

impl NoteRouter {
    /// A message for a transfer that is not live here yet usually names one
    /// whose `Create` already sits in this executor's mailbox: the engine
    /// called `sender` (or `receiver`) and the peer's `Pull` overtook it in
    /// the same wake-up. It waits until the driver has had one turn, so it
    /// goes to the machine from here instead of through the bridge thread
    /// and back (two thread hand-offs; a quarter of small requests in the
    /// demo took that path). One turn only: a transfer this executor does
    /// not hold still takes the bridge's path, which creates machines.
    pub(super) fn route(self: &Rc<Self>, peer: u32, tid: TransferId, msg: Msg) {
        let mut d = self.deferred.borrow_mut();
        // Goes now unless it is one this executor could take but does not
        // hold yet, or earlier ones wait.
        let waits = over_data_plane(&msg) && !self.is_live(tid);
        if d.queue.is_empty() && !waits {
            drop(d);
            self.deliver(peer, tid, msg);
            return;
        }
        if d.queue.len() >= MAX_DEFERRED_NOTES {
            // A flood (a peer naming transfers nobody holds) waits no turn:
            // what waits goes now, in order, and this one behind it.
            drop(d);
            self.drain();
            self.deliver(peer, tid, msg);
            return;
        }
        d.queue.push_back((peer, tid, msg));
        if !d.draining {
            d.draining = true;
            let me = Rc::clone(self);
            glommio::spawn_local(async move {
                futures_lite::future::yield_now().await;
                me.drain();
            })
            .detach();
        }
    }

    pub(super) fn drain(&self) {
        loop {
            // Not borrowed across `deliver`: the bridge hand-off never calls
            // back, but the queue stays consistent if anything ever does.
            let next = self.deferred.borrow_mut().queue.pop_front();
            let Some((peer, tid, msg)) = next else { break };
            self.deliver(peer, tid, msg);
        }
        self.deferred.borrow_mut().draining = false;
    }

    pub(super) fn is_live(&self, tid: TransferId) -> bool {
        self.live.borrow().contains_key(&tid)
    }

    pub(super) fn deliver(&self, peer: u32, tid: TransferId, msg: Msg) {
        let shared = &self.shared;
        let direction =
            toward(&msg, shared.config.mode).filter(|_| over_data_plane(&msg) && self.is_live(tid));
        if let Some(direction) = direction {
            let event = inbound(shared, direction, PeerId(peer), msg.clone());
            // A full queue (or a closing executor) leaves it to the
            // bridge, whose hand-off waits for room.
            if self.poster.try_post(tid, event).is_ok() {
                shared.track(peer, tid);
                return;
            }
        }
        shared.to_bridge(BridgeCmd::Inbound { peer, tid, msg });
    }
}
