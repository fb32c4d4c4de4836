//! Sends the machines' side-channel messages: over a data-plane session to
//! the peer where the ordering rule allows it, over ZeroMQ otherwise.

use super::*;

/// Whether `msg` may travel over a data-plane session to its peer instead
/// of the side channel. Those are the messages on the critical path of a
/// request: push mode's `Pull` with its lease ticket and `Status`, pull
/// mode's `Pull`, `Ready` and closing `Done`. On loopback each saves about
/// five thread hand-offs (executor, bridge, two ZeroMQ I/O threads, bridge,
/// executor); a small pull-mode request took 0.43 ms at p50 with its `Ready`
/// over ZeroMQ and 0.36 ms without (0.29 and 0.18 ms on one core).
///
/// The others stay on the side channel because of ordering: the bridge
/// answers a `Ready`, `LeaseRequest` or `Pull` for a transfer that failed
/// with an `Abort` after flushing the machine's own last words from its
/// queue, and that flush cannot see a notification still on its way, so a
/// machine's last words must not be able to trail a message that draws
/// such an answer. A `Status` or `Done` is the sender's last word; after a
/// success, the answer to a resent `Pull` or `Ready` repeats it
/// (`late_answer`), which no reordering makes wrong.
/// The rule constrains the channel of last words, not of the message that
/// draws the answer: a `Ready` is never a last word, and the `Abort` a late
/// `Ready` draws takes the side channel whichever way the `Ready` came. A
/// `Ready` overtaken by a later `Abort` from P finds D's machine ended and
/// draws an `Abort` that P's ended machine ignores; D reads nothing for it,
/// and a read that raced the abort is refused by P's block fence anyway.
pub(super) fn over_data_plane(msg: &Msg) -> bool {
    match msg {
        Msg::Status { .. }
        | Msg::Done { .. }
        | Msg::Pull { .. }
        | Msg::LeaseGrant { .. }
        | Msg::Ready { .. } => true,
        // `NotPaired` is a last word like `Abort`; `Unneeded` goes to a
        // P rank this rank has no data-plane session with.
        Msg::LeaseRequest { .. } | Msg::Abort | Msg::AbortAck | Msg::NotPaired | Msg::Unneeded => {
            false
        }
    }
}

/// The two ways a machine's message leaves this node (a write's status
/// trailer is the third, counted where the write is started).
#[derive(Clone, Copy)]
enum Channel {
    /// ZeroMQ, through the bridge.
    SideChannel,
    /// A NOTIFY frame of the data-plane session to the peer.
    DataPlane,
}

/// Side-channel frames waiting for a data-plane notification, per peer
/// endpoint: (peer slot, transfer, encoded frame).
#[derive(Default)]
pub(super) struct NoteLane {
    pub(super) queue: Vec<(PeerId, TransferId, Vec<u8>)>,
    pub(super) pumping: bool,
}

pub(super) type NoteLanes = Rc<RefCell<HashMap<EndpointAddr, NoteLane>>>;
/// Peer endpoints that refused a data-plane notification (their node has
/// `data_plane_messages` off, or does not know us by that endpoint): their
/// messages take the side channel from then on.
pub(super) type Refusing = Rc<RefCell<std::collections::HashSet<EndpointAddr>>>;

/// Sends the machines' side-channel messages, over the data plane where
/// they may. Cheap to clone into the task that delivers a write's closing
/// `Status` when the write could not carry it.
#[derive(Clone)]
pub(super) struct Messenger {
    pub(super) shared: Arc<Shared>,
    pub(super) transport: Option<Rc<AnyTransport>>,
    pub(super) sessions: Sessions,
    /// Frames waiting to go over the data plane, per peer endpoint.
    pub(super) notes: NoteLanes,
    pub(super) refusing: Refusing,
}

impl Messenger {
    /// This node's data-plane endpoint, as notifications name their sender.
    pub(super) fn sender(&self) -> String {
        self.shared.endpoint.get().cloned().unwrap_or_default()
    }

    pub(super) fn send_frame(&self, tid: TransferId, peer: PeerId, msg: Msg) {
        let bytes = wire::encode(&self.shared.transfer_frame(tid, msg));
        self.shared.to_bridge(BridgeCmd::Send {
            peer: peer.0,
            tid: Some(tid),
            bytes,
        });
    }

    /// Sends a machine's `msg` over the data-plane session of `peer` when
    /// it may ([`over_data_plane`]) and one is open, else over the side
    /// channel (and then opens a session in the background for the next
    /// ones). `resent`: the machine sends it again (counted per channel).
    pub(super) fn send_msg(&self, tid: TransferId, peer: PeerId, msg: Msg, resent: bool) {
        if self.names_request(tid, &msg) {
            return self.side_channel(tid, peer, msg, resent);
        }
        let Some(endpoint) = self.data_plane_endpoint(peer, &msg) else {
            return self.side_channel(tid, peer, msg, resent);
        };
        let open = self
            .sessions
            .borrow()
            .get(&endpoint)
            .and_then(|slot| slot.try_lock().map(|g| g.is_some()));
        match open {
            Some(true) => {}
            Some(false) => return self.side_channel(tid, peer, msg, resent),
            None => {
                self.open_session(endpoint);
                return self.side_channel(tid, peer, msg, resent);
            }
        }
        if !self.goes_out(Channel::DataPlane, resent) {
            return;
        }
        self.shared.track(peer.0, tid);
        let bytes = wire::encode(&Frame::Transfer {
            transfer_id: tid,
            msg,
        });
        let start = {
            let mut notes = self.notes.borrow_mut();
            let lane = notes.entry(endpoint).or_default();
            lane.queue.push((peer, tid, bytes));
            !std::mem::replace(&mut lane.pumping, true)
        };
        if start {
            glommio::spawn_local(pump_notes(endpoint, self.clone())).detach();
        }
    }

    /// True for the `Pull` of a transfer opened by string request id, and
    /// for the lease grants that follow it: the `Pull` names the string
    /// and goes to the peer's bridge, which checks it (docs/design.md §7),
    /// and its ticket grant takes the same way so it cannot overtake it.
    fn names_request(&self, tid: TransferId, msg: &Msg) -> bool {
        matches!(msg, Msg::Pull { .. } | Msg::LeaseGrant { .. })
            && self.shared.name_of(tid).is_some()
    }

    /// A machine's `msg` over the side channel, unless fault injection
    /// drops it.
    fn side_channel(&self, tid: TransferId, peer: PeerId, msg: Msg, resent: bool) {
        if self.goes_out(Channel::SideChannel, resent) {
            self.send_frame(tid, peer, msg);
        }
    }

    /// Whether a machine's message about to take `channel` goes out: false
    /// when fault injection drops it (counted); a resent one is counted.
    fn goes_out(&self, channel: Channel, resent: bool) -> bool {
        let c = &self.shared.counters;
        let (dropped, resends) = match channel {
            Channel::SideChannel => (&c.dropped_sidechannel, &c.resent_sidechannel),
            Channel::DataPlane => (&c.dropped_data_plane, &c.resent_data_plane),
        };
        if self.shared.drops_control() {
            dropped.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        if resent {
            resends.fetch_add(1, Ordering::Relaxed);
        }
        true
    }

    /// The endpoint of `peer`'s node when `msg` may go to it over the data
    /// plane (see [`Messenger::may_carry`]).
    pub(super) fn data_plane_endpoint(&self, peer: PeerId, msg: &Msg) -> Option<EndpointAddr> {
        if !self.carries(msg) {
            return None;
        }
        self.shared
            .peer(peer.0)
            .and_then(|d| d.endpoint)
            .filter(|e| !self.refusing.borrow().contains(e))
    }

    /// Whether `msg` may go over the data plane to the node at `endpoint`:
    /// [`Messenger::carries`] it, and that node did not refuse.
    pub(super) fn may_carry(&self, endpoint: &EndpointAddr, msg: &Msg) -> bool {
        self.carries(msg) && !self.refusing.borrow().contains(endpoint)
    }

    /// Whether this node sends `msg` over the data plane at all: a
    /// transport that carries notifications, data-plane messages on, and
    /// [`over_data_plane`].
    pub(super) fn carries(&self, msg: &Msg) -> bool {
        self.shared.config.data_plane_messages
            && over_data_plane(msg)
            && (self.transport.as_deref()).is_some_and(Transport::carries_notifications)
    }

    /// Opens a session to `endpoint` in the background, unless one is open
    /// or opening; a failure is only logged (the side channel still works).
    pub(super) fn open_session(&self, endpoint: EndpointAddr) {
        let (Some(transport), Ok(())) = (
            self.transport.clone(),
            make_room(
                &self.sessions,
                &endpoint,
                self.shared.config.max_data_sessions,
            ),
        ) else {
            return;
        };
        let slot = self
            .sessions
            .borrow_mut()
            .entry(endpoint)
            .or_default()
            .clone();
        glommio::spawn_local(async move {
            let mut guard = slot.lock().await;
            if guard.is_none() {
                match transport.open(&endpoint).await {
                    Ok(s) => *guard = Some(Rc::new(s)),
                    Err(e) => tracing::debug!(%endpoint, %e, "no data-plane session for messages"),
                }
            }
        })
        .detach();
    }
}

/// Sends what the note lane of `endpoint` holds, one notification per
/// turn (everything queued meanwhile shares the next), until it is empty.
/// Whatever the peer did not take goes over the side channel instead.
pub(super) async fn pump_notes(endpoint: EndpointAddr, msgr: Messenger) {
    let shared = &msgr.shared;
    let sender = msgr.sender();
    loop {
        // Let the executor finish its turn first: a machine's messages of
        // one step (a `Pull` and its lease ticket) then share a frame.
        futures_lite::future::yield_now().await;
        let Some(batch) = next_notes(&msgr.notes, endpoint, &sender) else {
            return;
        };
        let sent = send_notes(&msgr, endpoint, &sender, &batch).await;
        let counter = if sent {
            &shared.counters.data_plane_messages
        } else {
            &shared.counters.data_plane_fallbacks
        };
        counter.fetch_add(batch.len() as u64, Ordering::Relaxed);
        if !sent {
            for (peer, tid, bytes) in batch {
                shared.to_bridge(BridgeCmd::Send {
                    peer: peer.0,
                    tid: Some(tid),
                    bytes,
                });
            }
        }
    }
}

/// Takes the frames of the next notification off the note lane of
/// `endpoint` (at least one, as many as fit); `None` once the lane is
/// empty, which also removes it.
fn next_notes(
    notes: &NoteLanes,
    endpoint: EndpointAddr,
    sender: &str,
) -> Option<Vec<(PeerId, TransferId, Vec<u8>)>> {
    let mut map = notes.borrow_mut();
    let lane = map.get_mut(&endpoint)?;
    if lane.queue.is_empty() {
        map.remove(&endpoint);
        return None;
    }
    let mut bytes = wire::notify_endpoint_len(sender);
    let n = lane
        .queue
        .iter()
        .take(wire::MAX_NOTIFY_FRAMES)
        .take_while(|(_, _, f)| {
            bytes += wire::notify_frame_len(f);
            bytes <= crate::transport::internal::wire::MAX_NOTIFY_BYTES
        })
        .count()
        .max(1);
    Some(lane.queue.drain(..n).collect::<Vec<_>>())
}

/// Sends `batch` as one notification over the data-plane session to
/// `endpoint`; true if the peer took it. A peer that takes no data-plane
/// messages joins `refusing`.
async fn send_notes(
    msgr: &Messenger,
    endpoint: EndpointAddr,
    sender: &str,
    batch: &[(PeerId, TransferId, Vec<u8>)],
) -> bool {
    let slot = msgr.sessions.borrow().get(&endpoint).cloned();
    let session = match slot {
        Some(slot) => slot.lock().await.clone(),
        None => None,
    };
    let Some(s) = session.as_deref() else {
        return false;
    };
    let payload = wire::encode_notify(sender, batch.iter().map(|(_, _, f)| &f[..]));
    match s.notify_peer(&payload).await {
        // `false`: the transport carries no messages; the side channel does.
        Ok(taken) => taken,
        Err(TransportError::Peer(PeerError::Rejected {
            reason: RejectReason::Undeliverable,
            ..
        })) => {
            tracing::info!(%endpoint, "peer takes no data-plane messages; using the side channel for it");
            let mut r = msgr.refusing.borrow_mut();
            if r.len() >= msgr.shared.config.max_data_sessions {
                r.clear();
            }
            r.insert(endpoint);
            false
        }
        Err(e) => {
            tracing::debug!(%endpoint, %e, "data-plane notification not taken; using the side channel");
            false
        }
    }
}
