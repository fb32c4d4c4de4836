//! The end of a request: how it ends ([`End`]), what each peer is owed,
//! and the wait until no transfer can touch the blocks ([`Drain`]).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{after, earliest, Config, FailReason, GrantLease, Msg, PeerId, Phase};

/// A write (push) or read (pull) the toucher posted and has not seen complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Posted {
    pub(crate) peer: PeerId,
    pub(crate) chunk: u32,
    /// Posted time plus the transfer bound: after this the op can no longer touch memory.
    pub(crate) deadline: Instant,
}

/// The end of a request after its outcome was decided: wait until no
/// transfer can touch the blocks anymore, then release.
///
/// Toucher: its own ops must complete or pass their bound; the
/// lease-returning message to a peer is sent once no op on that peer is left.
/// Granter: every peer must return its lease, or the lease must have run
/// out plus the fence.
#[derive(Clone, Debug)]
pub(crate) struct Drain {
    /// The terminal phase reported once the drain completes.
    pub(crate) outcome: Phase,
    pub(crate) ops: Vec<Posted>,
    /// Messages to send once the peer has no op in flight.
    pub(crate) returns: Vec<(PeerId, Msg)>,
    /// Leases we granted and that were not returned yet.
    pub(crate) leases: Vec<(PeerId, GrantLease)>,
}

impl Drain {
    /// Drops expired ops, sends the returns that are due and tells whether
    /// the blocks are free.
    pub(crate) fn advance(
        &mut self,
        now: Instant,
        fence: Duration,
        out: &mut VecDeque<(PeerId, Msg)>,
    ) -> bool {
        self.ops.retain(|op| now < op.deadline);
        let ops = &self.ops;
        let mut i = 0;
        while i < self.returns.len() {
            let peer = self.returns[i].0;
            if ops.iter().any(|op| op.peer == peer) {
                i += 1;
            } else {
                out.push_back(self.returns.remove(i));
            }
        }
        self.leases
            .retain(|(_, l)| l.until.is_some_and(|u| now < after(u, fence)));
        self.ops.is_empty() && self.returns.is_empty() && self.leases.is_empty()
    }

    /// A completion for an op; unknown ones are late and absorbed.
    pub(crate) fn handle_completion(&mut self, peer: PeerId, chunk: u32) {
        if let Some(i) = self
            .ops
            .iter()
            .position(|op| op.peer == peer && op.chunk == chunk)
        {
            self.ops.swap_remove(i);
        }
    }

    /// A message from `peer` after the outcome was decided: only the
    /// lease-returning ones (`Status`, `Done`, `Abort`, `AbortAck`, and
    /// `NotPaired`, which says the peer holds nothing) matter.
    pub(crate) fn handle_msg(&mut self, peer: PeerId, msg: &Msg) {
        match msg {
            Msg::Status { .. } | Msg::Done { .. } | Msg::Abort | Msg::AbortAck | Msg::NotPaired => {
                self.handle_return(peer)
            }
            Msg::Pull { .. }
            | Msg::Ready { .. }
            | Msg::LeaseRequest { .. }
            | Msg::LeaseGrant { .. }
            | Msg::Unneeded => {}
        }
    }

    /// A lease-returning message from `peer`.
    pub(crate) fn handle_return(&mut self, peer: PeerId) {
        self.leases.retain(|(p, _)| *p != peer);
    }

    pub(crate) fn poll_timeout(&self, fence: Duration) -> Option<Instant> {
        let ops = self.ops.iter().map(|op| op.deadline).min();
        let leases = self
            .leases
            .iter()
            .filter_map(|(_, l)| l.until.map(|u| after(u, fence)))
            .min();
        earliest(ops, leases)
    }
}

/// What a machine does after a handler applied an input to its live
/// request (`SendMachine` and `RecvMachine` alike).
#[must_use]
#[derive(Clone, Copy, Debug)]
pub(crate) enum Next {
    /// Nothing more.
    Stay,
    /// Post what can be posted, return finished leases and complete the
    /// request when every expected peer is finished.
    Progress,
    /// End the request.
    End(End),
}

/// How a live request ends; decides the outcome and what each peer is owed.
#[derive(Clone, Copy, Debug)]
pub(crate) enum End {
    Fail(FailReason),
    Expire,
    /// The peer aborted: it gets an `AbortAck`, the others an abort.
    PeerAbort(PeerId),
    /// The peer returned its lease while failing (`Status`/`Done` with
    /// `ok: false`). The reason is `PeerReported`, or the one this side
    /// refuses the peer for when it knows it (both sides then end alike,
    /// whichever side's refusal came first).
    PeerFailed(PeerId, FailReason),
    /// The peer refused the transfer (`NotPaired`) before touching
    /// anything or granting a lease: settled like a lease return.
    PeerRefused(PeerId),
}

impl End {
    /// The terminal phase reported once the drain completes.
    pub(crate) fn outcome(self) -> Phase {
        match self {
            End::Fail(r) => Phase::Failed(r),
            End::Expire => Phase::Expired,
            End::PeerAbort(_) => Phase::Failed(FailReason::PeerAborted),
            End::PeerFailed(_, reason) => Phase::Failed(reason),
            End::PeerRefused(_) => Phase::Failed(FailReason::BadMetadata),
        }
    }

    /// Starts the drain of a request that had `ops` in flight.
    pub(crate) fn drain(self, mut ops: Vec<Posted>, cfg: &Config) -> Drain {
        if cfg.unsafe_ignore_in_flight {
            ops.clear();
        }
        Drain {
            outcome: self.outcome(),
            ops,
            returns: Vec::new(),
            leases: Vec::new(),
        }
    }

    /// Settles one unfinished peer when the request ends, for both sides.
    ///
    /// `granted` is `Some` when the peer touches our blocks under a lease we
    /// granted, `None` when we touch its blocks. A toucher's lease-returning
    /// message (`failure_return`: `Status` from P, `Done` from D) waits in
    /// the drain until nothing of ours is in flight on that peer; a granter
    /// keeps the lease in the drain until it is returned or has run out plus
    /// the fence. Returns a message to send at once, if any.
    pub(crate) fn settle_peer(
        self,
        drain: &mut Drain,
        peer: PeerId,
        granted: Option<GrantLease>,
        failure_return: Msg,
        cfg: &Config,
    ) -> Option<Msg> {
        let aborter = matches!(self, End::PeerAbort(a) if a == peer);
        let failer = matches!(self, End::PeerFailed(a, _) | End::PeerRefused(a) if a == peer);
        match granted {
            None => {
                let msg = match self {
                    _ if aborter => Msg::AbortAck,
                    End::Fail(FailReason::Aborted(_)) => Msg::Abort,
                    End::Fail(_)
                    | End::Expire
                    | End::PeerAbort(_)
                    | End::PeerFailed(..)
                    | End::PeerRefused(_) => failure_return,
                };
                drain.returns.push((peer, msg));
                None
            }
            // The toucher's abort returned its lease.
            Some(_) if aborter => Some(Msg::AbortAck),
            // The toucher's failure report returned its lease.
            Some(_) if failer => None,
            Some(lease) => {
                if !cfg.unsafe_disable_fence {
                    drain.leases.push((peer, lease));
                }
                Some(Msg::Abort)
            }
        }
    }
}
