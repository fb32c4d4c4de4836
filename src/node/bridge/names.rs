//! String request ids at the bridge (docs/design.md §7, "Transfer ids"):
//! prefill checks the request id a decode rank's `Pull` names against the
//! one it holds for that transfer id, and decode fails a request whose
//! `Pull` prefill refused for naming another one.

use std::collections::VecDeque;

use super::*;
use crate::node::IdCollision;

/// Most (decode peer, transfer) pairs remembered whose `Pull` was refused
/// for an id collision; the oldest are forgotten first.
pub(super) const MAX_REFUSED_IDS: usize = 4096;

/// The (decode peer, transfer) pairs whose `Pull` this prefill rank refused
/// for an id collision. That peer's later messages for the transfer (the
/// ticket grant behind its `Pull`, its `Abort`) are about its own request,
/// so they must not reach the machine of the request that holds the id.
#[derive(Default)]
pub(super) struct RefusedIds(VecDeque<(u32, TransferId)>);

impl RefusedIds {
    fn insert(&mut self, peer: u32, tid: TransferId) {
        // A resent `Pull` is refused again; one entry covers both.
        if self.0.contains(&(peer, tid)) {
            return;
        }
        if self.0.len() >= MAX_REFUSED_IDS {
            self.0.pop_front();
        }
        self.0.push_back((peer, tid));
    }
}

impl Bridge {
    /// A decode rank's `Pull` naming its request id: taken if this rank
    /// holds no other string for the transfer id, refused otherwise.
    pub(super) fn on_named_transfer(
        &mut self,
        peer: u32,
        tid: TransferId,
        request_id: String,
        msg: Msg,
    ) {
        if self.direction(peer) != Some(Direction::Send) {
            self.bad_frame("named transfer sent by a prefill peer");
            return;
        }
        match self.shared.claim_name(tid, &request_id) {
            Ok(fresh) => {
                tracing::debug!(transfer_id = %tid, request_id = %request_id, peer, "pull names its request");
                self.on_transfer_msg(peer, tid, msg);
                // No machine took it (no room, say): the string names nothing.
                if fresh && self.handle.poll(tid).is_none() {
                    self.shared.release_name(tid);
                }
            }
            Err(c) => self.refuse_collision(peer, c),
        }
    }

    fn refuse_collision(&mut self, peer: u32, c: IdCollision) {
        tracing::warn!(
            transfer_id = %c.transfer_id,
            request_id = %c.request_id,
            held = %c.held,
            peer,
            "refusing a pull whose request id has the transfer id of another request"
        );
        self.refused_ids.insert(peer, c.transfer_id);
        self.send_frame(
            peer,
            &Frame::IdCollision {
                transfer_id: c.transfer_id,
            },
        );
    }

    /// True when `msg` comes from a decode rank whose `Pull` for `tid` was
    /// refused: it is answered here (an `Abort` with `AbortAck`, which
    /// returns the lease its ticket grant gave) or dropped.
    pub(super) fn intercept_refused(&mut self, peer: u32, tid: TransferId, msg: &Msg) -> bool {
        if self.refused_ids.0.is_empty() {
            return false;
        }
        let Some(i) = self.refused_ids.0.iter().position(|e| *e == (peer, tid)) else {
            return false;
        };
        if let Msg::Abort = msg {
            self.refused_ids.0.remove(i);
            self.send_frame(
                peer,
                &Frame::Transfer {
                    transfer_id: tid,
                    msg: Msg::AbortAck,
                },
            );
        }
        true
    }

    /// Prefill refused this decode rank's `Pull` for `tid`: it holds the
    /// transfer id for another request id. The request fails
    /// `Aborted(IdCollision)`; its abort tells the other prefill ranks.
    pub(super) fn on_id_collision(&mut self, peer: u32, tid: TransferId) {
        if self.direction(peer) != Some(Direction::Recv) {
            self.bad_frame("id collision sent by a decode peer");
            return;
        }
        let h = &self.handle;
        let request_id = self.shared.name_of(tid);
        tracing::warn!(
            transfer_id = %tid,
            request_id = request_id.as_deref().unwrap_or(""),
            peer,
            "prefill holds this transfer id for another request id; failing the request"
        );
        match h.abort(tid, AbortReason::IdCollision) {
            Ok(()) => Counters::inc(&self.shared.counters.id_collisions),
            Err(e) => {
                tracing::debug!(transfer_id = %tid, %e, "id collision for a transfer not live here")
            }
        }
    }
}
