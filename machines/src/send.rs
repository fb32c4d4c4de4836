//! `SendMachine`: the prefill side of one transfer on one P rank.
//!
//! # Contract
//!
//! * Create it with [`SendMachine::new`] when the engine knows the request,
//!   or when D's first `Pull` for the transfer arrives, whichever comes
//!   first: `new` needs nothing from the engine, and chunks may follow later.
//! * After `ReleaseBlocks` the driver may drop the machine. If the transfer
//!   failed, it should then answer a late `Pull` for it with `Abort` (from a
//!   bounded memory of finished transfer ids), so that a late D rank fails
//!   fast instead of waiting for its deadline. After a success it ignores
//!   such a `Pull`: every D rank was sent `Status{ok: true}`, so the `Pull`
//!   is a duplicate, and an `Abort` overtaking that `Status` would fail a D
//!   rank whose KV all landed (found by the simulator, `tests/sim.rs`).
//! * Feed [`Event`]s: D's messages ([`Event::Msg`]), KV chunks as the engine
//!   finishes them ([`Event::ChunkReady`], the last one flagged; a whole
//!   request is one chunk with `is_last`), completions of the writes it
//!   asked for ([`Event::WriteDone`], push mode), and the driver's verdicts
//!   ([`Event::PeerDead`], [`Event::PlanFailed`]).
//! * Drain [`Action`]s after every input: send a message, post a write
//!   (push mode), and exactly once [`Action::ReleaseBlocks`].
//! * [`SendMachine::phase`] turns terminal in the same call that queues
//!   `ReleaseBlocks`: an engine that frees the request's blocks on a terminal
//!   phase is safe. While a failed transfer waits for in-flight transfers or
//!   for a lease to run out, the phase stays `Transferring`.
//!
//! In push mode P is the *toucher*: it writes into D's blocks and needs a
//! lease from each D rank before it starts a write. In pull mode P is the
//! *granter*: D ranks read P's blocks under leases P grants, and P releases
//! only after every D rank returned its lease (`Done`, `Abort`, `AbortAck`)
//! or the lease ran out plus the fence.

use std::collections::VecDeque;
use std::time::Instant;

use crate::common::{
    after, align_chunk, check_lists, chunk_end, covers_exactly, earliest, is_empty_lists,
    AbortReason, BlockLists, Config, Drain, End, FailReason, GrantLease, InputError, Mode, Msg,
    Next, PeerId, Phase, Posted, Resend, TouchLease, TransferId,
};
use crate::machine::Machine;

/// Inputs of a [`SendMachine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A control message from D rank `peer`.
    Msg {
        /// The peer, as the driver names it.
        peer: PeerId,
        /// The message.
        msg: Msg,
    },
    /// The engine finished a chunk of KV: its source blocks per group, in
    /// order after the previous chunks. Chunk ids are assigned 0, 1, 2, ...
    ChunkReady {
        /// Source blocks, per group.
        src_blocks: BlockLists,
        /// True on the request's last chunk.
        is_last: bool,
    },
    /// Push mode: the transport finished the write of `chunk` to `peer`.
    WriteDone {
        /// The peer, as the driver names it.
        peer: PeerId,
        /// The chunk index.
        chunk: u32,
        /// True when it succeeded.
        ok: bool,
    },
    /// The driver declared `peer` dead (missed heartbeats, connection lost).
    PeerDead {
        /// The peer, as the driver names it.
        peer: PeerId,
    },
    /// The planner rejected the layouts or block lists of `peer`.
    PlanFailed {
        /// The peer, as the driver names it.
        peer: PeerId,
    },
    /// `peer` sent a `Pull`, but by the layouts the driver knows it reads
    /// nothing from this P rank, or the pair needs a rule kvferry does not
    /// implement: the machine refuses it (`NotPaired`) and fails the
    /// transfer with `reason`. The driver turns such a `Pull` into this
    /// event instead of [`Event::Msg`].
    UnpairedPull {
        /// The peer, as the driver names it.
        peer: PeerId,
        /// [`FailReason::BadMetadata`] when the layouts pair but read
        /// nothing from each other, [`FailReason::Unsupported`] when they
        /// pair only by an unimplemented rule.
        reason: FailReason,
    },
    /// `peer`, whose `Pull` the driver would refuse with `reason` (see
    /// [`Event::UnpairedPull`]), reports a failure (`Done { ok: false }`):
    /// settled like that `Done`, but the transfer fails with `reason`, not
    /// [`FailReason::PeerReported`], so P and D end alike whichever of
    /// their two refusals came first. The driver turns such a `Done` into
    /// this event instead of [`Event::Msg`].
    UnpairedDone {
        /// The peer, as the driver names it.
        peer: PeerId,
        /// Why the driver refuses the peer.
        reason: FailReason,
    },
    /// Push mode: `peer` granted a lease answering a ticket this node sent
    /// it at `sent_at` (see [`crate::common::TICKET_BIT`]); the driver
    /// turns the `LeaseGrant` naming that ticket into this event.
    TicketGrant {
        /// The peer, as the driver names it.
        peer: PeerId,
        /// When the ticket went out.
        sent_at: Instant,
        /// Length of the lease in milliseconds, on each side's own clock.
        duration_ms: u64,
    },
    /// Push mode: `peer`'s grant named a ticket this node does not know
    /// (any more): ask for a lease now instead of waiting for one.
    TicketRefused {
        /// The peer, as the driver names it.
        peer: PeerId,
    },
    /// Push mode: the peer's last write (posted with `status_after`)
    /// landed, but the transport could not carry its `Status`; reported
    /// before that write's `WriteDone{ok: true}`. The machine then sends
    /// the `Status` itself.
    StatusNotCarried {
        /// The peer, as the driver names it.
        peer: PeerId,
    },
}

/// Outputs of a [`SendMachine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send `msg` to D rank `peer` for this transfer.
    Send {
        /// The peer, as the driver names it.
        peer: PeerId,
        /// The message.
        msg: Msg,
    },
    /// Send `msg` to D rank `peer` again: it may not have arrived (see
    /// `Config::resend_after`). Carried like [`Action::Send`]; the driver
    /// counts it apart.
    Resend {
        /// The peer, as the driver names it.
        peer: PeerId,
        /// The message.
        msg: Msg,
    },
    /// Push mode: write `src_blocks` (ours) into `dst_blocks` (the peer's),
    /// same lengths per group, then report [`Event::WriteDone`]. The driver
    /// turns the lists into descriptors with the planner.
    ///
    /// With `status_after`, this is the peer's last write and nothing else
    /// of the request is in flight to it: the driver carries
    /// `Status{ok: true}` right behind the write on the same connection,
    /// delivered only if the write landed in full, so D learns of it
    /// without waiting for P to hear the write's acknowledgement (the
    /// machine sends no `Status` then). A driver that cannot carry it
    /// reports [`Event::StatusNotCarried`] before `WriteDone{ok: true}`,
    /// and the machine sends the `Status` itself. `WriteDone{ok: false}` then leaves open
    /// whether the `Status` reached the peer (the write may have landed
    /// and only its acknowledgement been lost); either way every byte the
    /// peer was told of landed.
    Write {
        /// The peer, as the driver names it.
        peer: PeerId,
        /// The chunk index.
        chunk: u32,
        /// Source blocks, per group.
        src_blocks: BlockLists,
        /// Destination blocks, per group.
        dst_blocks: BlockLists,
        /// The driver carries the closing `Status` behind this write.
        status_after: bool,
    },
    /// The request's source blocks may go back to the engine. Emitted
    /// exactly once; `outcome` is the terminal phase.
    ReleaseBlocks {
        /// The terminal phase.
        outcome: Phase,
    },
}

/// One chunk of local KV.
#[derive(Clone, Debug)]
struct Chunk {
    start_blocks: Vec<u32>,
    src_blocks: BlockLists,
}

/// What P knows about one D rank, by mode.
#[derive(Clone, Debug)]
enum Role {
    /// Push: we write into the peer's blocks under its lease.
    Toucher {
        lease: TouchLease,
        /// Next chunk to post to this peer.
        next_chunk: u32,
        /// True once `Status{ok: true}` went out (the lease is returned).
        finished: bool,
        /// True once the last write went out with `status_after`: the
        /// driver returns the lease when that write lands.
        closing: bool,
    },
    /// Pull: the peer reads our blocks under our lease.
    Granter {
        lease: GrantLease,
        /// Chunks announced with `Ready`.
        announced: u32,
        /// True once the peer returned its lease with `Done{ok: true}`.
        finished: bool,
    },
}

#[derive(Clone, Debug)]
struct Peer {
    id: PeerId,
    dst_blocks: BlockLists,
    prefix_blocks: Vec<u32>,
    last_heard: Instant,
    role: Role,
    /// Pull mode: when this rank resends the last `Ready` while it waits
    /// for the peer's `Done`, which may have been lost.
    resend: Resend,
}

impl Peer {
    fn is_finished(&self) -> bool {
        match &self.role {
            Role::Toucher { finished, .. } | Role::Granter { finished, .. } => *finished,
        }
    }

    /// Push mode: the peer's last write is in flight with the `Status`
    /// riding behind it.
    fn is_closing(&self) -> bool {
        match &self.role {
            Role::Toucher { closing, .. } => *closing,
            Role::Granter { .. } => false,
        }
    }
}

/// Data of a request that is still moving.
#[derive(Clone, Debug)]
struct Live {
    bootstrap_deadline: Instant,
    receivers_expected: Option<u16>,
    peers: Vec<Peer>,
    chunks: Vec<Chunk>,
    last_seen: bool,
    /// Time of the first ready chunk: the claim counts from it.
    first_chunk_at: Option<Instant>,
    /// Creation time plus the hold limit. The hold counts from creation, not
    /// from the first chunk, so that a machine whose engine never produces
    /// KV still ends: the blocks are allocated from the start.
    hold_deadline: Instant,
    /// Push mode: writes posted and not completed.
    ops: Vec<Posted>,
    /// Push mode: ticket grants that overtook their peer's `Pull` (peer,
    /// ticket sent at, duration), applied when the `Pull` comes; at most
    /// `max_peers`. The two travel together but a node may route them
    /// differently (one to a live machine at once, one through its bridge).
    early_tickets: Vec<(PeerId, Instant, u64)>,
    /// A D rank said nobody reads from this rank (`Unneeded`): the
    /// request completes without waiting for the engine's last chunk.
    unneeded: bool,
}

#[derive(Clone, Debug)]
enum State {
    /// Bootstrapping, WaitingForInput or Transferring.
    Live(Live),
    /// Outcome decided; waiting until no transfer can touch the blocks.
    Draining(Drain),
    /// Released; absorbs every later input.
    Finished(Phase),
}

/// Prefill-side state machine of one transfer on one P rank. See the module docs.
#[derive(Clone, Debug)]
pub struct SendMachine {
    cfg: Config,
    transfer_id: TransferId,
    mode: Mode,
    state: State,
    actions: VecDeque<Action>,
}

/// What a handler of a live request uses besides [`Live`]: the machine's
/// settings, the time of the input and the action queue, borrowed apart
/// from the machine's state.
struct Cx<'a> {
    cfg: &'a Config,
    mode: Mode,
    now: Instant,
    actions: &'a mut VecDeque<Action>,
}

impl Cx<'_> {
    fn send(&mut self, peer: PeerId, msg: Msg) {
        self.actions.push_back(Action::Send { peer, msg });
    }

    fn resend(&mut self, peer: PeerId, msg: Msg) {
        self.actions.push_back(Action::Resend { peer, msg });
    }
}

/// A peer's layouts or block lists do not fit ours.
struct BadMetadata;

impl Role {
    /// The role of a peer that just became known, in `mode`.
    fn new(mode: Mode) -> Role {
        match mode {
            Mode::Push => Role::Toucher {
                lease: TouchLease::new(),
                next_chunk: 0,
                finished: false,
                closing: false,
            },
            Mode::Pull => Role::Granter {
                lease: GrantLease::new(),
                announced: 0,
                finished: false,
            },
        }
    }
}

/// Handlers of the inputs of a live request. None changes the state; each
/// says what the machine does next ([`Next`]).
impl Live {
    fn peer_mut(&mut self, peer: PeerId) -> Option<&mut Peer> {
        self.peers.iter_mut().find(|p| p.id == peer)
    }

    /// True once every D rank that will send a `Pull` did.
    fn all_known(&self) -> bool {
        self.receivers_expected
            .is_some_and(|n| n as usize == self.peers.len())
    }

    fn handle_event(&mut self, cx: &mut Cx, event: Event) -> Result<Next, InputError> {
        match event {
            Event::Msg { peer, msg } => self.handle_msg(cx, peer, msg),
            Event::ChunkReady {
                src_blocks,
                is_last,
            } => self.handle_chunk_ready(cx, src_blocks, is_last),
            Event::WriteDone { peer, chunk, ok } => self.handle_write_done(peer, chunk, ok),
            Event::PeerDead { peer } => Ok(self.handle_verdict(peer, FailReason::PeerDead)),
            Event::PlanFailed { peer } => Ok(self.handle_verdict(peer, FailReason::BadMetadata)),
            Event::UnpairedPull { peer, reason } => Ok(self.handle_unpaired_pull(cx, peer, reason)),
            Event::UnpairedDone { peer, reason } => self.handle_done(cx, peer, Err(reason)),
            Event::TicketGrant {
                peer,
                sent_at,
                duration_ms,
            } => self.handle_ticket_grant(cx, peer, sent_at, duration_ms),
            Event::TicketRefused { peer } => self.handle_ticket_refused(cx, peer),
            Event::StatusNotCarried { peer } => self.handle_status_not_carried(peer),
        }
    }

    fn handle_msg(&mut self, cx: &mut Cx, peer: PeerId, msg: Msg) -> Result<Next, InputError> {
        let next = self.handle_peer_msg(cx, peer, msg)?;
        // Heard only once the message was taken: refused junk changes nothing.
        if let Some(p) = self.peer_mut(peer) {
            p.resend.heard(cx.now, cx.cfg);
        }
        Ok(next)
    }

    fn handle_peer_msg(&mut self, cx: &mut Cx, peer: PeerId, msg: Msg) -> Result<Next, InputError> {
        match msg {
            Msg::Pull {
                receivers_expected,
                dst_blocks,
                prefix_blocks,
                lease_seq,
            } => self.handle_pull(
                cx,
                peer,
                receivers_expected,
                dst_blocks,
                prefix_blocks,
                lease_seq,
            ),
            Msg::LeaseGrant { seq, duration_ms } => {
                self.handle_lease_grant(cx, peer, seq, duration_ms)
            }
            Msg::LeaseRequest { seq } => self.handle_lease_request(cx, peer, seq),
            Msg::Done { ok } => {
                let done = if ok {
                    Ok(())
                } else {
                    Err(FailReason::PeerReported)
                };
                self.handle_done(cx, peer, done)
            }
            Msg::Abort => Ok(self.handle_abort(peer)),
            Msg::AbortAck => Err(InputError::Peer("AbortAck while nothing was aborted")),
            Msg::Unneeded => self.handle_unneeded(),
            Msg::Ready { .. } | Msg::Status { .. } | Msg::NotPaired => {
                Err(InputError::Peer("message P never receives"))
            }
        }
    }

    fn handle_chunk_ready(
        &mut self,
        cx: &mut Cx,
        src_blocks: BlockLists,
        is_last: bool,
    ) -> Result<Next, InputError> {
        if self.last_seen {
            return Err(InputError::Misuse("chunk after the last chunk"));
        }
        if self.chunks.len() >= cx.cfg.max_chunks {
            return Err(InputError::Misuse("more chunks than max_chunks"));
        }
        if !check_lists(&src_blocks, cx.cfg) {
            return Err(InputError::Misuse("block list over the configured bounds"));
        }
        let start_blocks: Vec<u32> = match self.chunks.last() {
            None => vec![0; src_blocks.len()],
            Some(prev) => {
                if prev.src_blocks.len() != src_blocks.len() {
                    return Err(InputError::Misuse("chunk with another group count"));
                }
                chunk_end(&prev.start_blocks, &prev.src_blocks)
            }
        };
        let index = self.chunks.len() as u32;
        self.chunks.push(Chunk {
            start_blocks,
            src_blocks,
        });
        self.last_seen = is_last;
        if self.first_chunk_at.is_none() {
            // The claim counts from when we started holding KV for D: a D rank
            // that was quiet while there was nothing to fetch is not late.
            self.first_chunk_at = Some(cx.now);
            for p in &mut self.peers {
                p.last_heard = p.last_heard.max(cx.now);
            }
        }
        match cx.mode {
            Mode::Push => {}
            Mode::Pull => self.announce(cx, index),
        }
        Ok(Next::Progress)
    }

    fn handle_write_done(
        &mut self,
        peer: PeerId,
        chunk: u32,
        ok: bool,
    ) -> Result<Next, InputError> {
        let Some(i) = self
            .ops
            .iter()
            .position(|op| op.peer == peer && op.chunk == chunk)
        else {
            return Err(InputError::Misuse(
                "completion of a write that is not in flight",
            ));
        };
        self.ops.swap_remove(i);
        if ok {
            Ok(Next::Progress)
        } else {
            Ok(Next::End(End::Fail(FailReason::Transport)))
        }
    }

    /// The closing write to `peer` landed without its `Status`: the
    /// machine sends it when the write's completion arrives.
    fn handle_status_not_carried(&mut self, peer: PeerId) -> Result<Next, InputError> {
        let closing = self.peers.iter_mut().find_map(|p| match &mut p.role {
            Role::Toucher {
                closing,
                finished: false,
                ..
            } if p.id == peer && *closing => Some(closing),
            Role::Toucher { .. } | Role::Granter { .. } => None,
        });
        let Some(closing) = closing else {
            return Err(InputError::Misuse(
                "status not carried for a peer with no closing write",
            ));
        };
        *closing = false;
        Ok(Next::Stay)
    }

    /// A D rank says no D rank reads from this P rank: nothing is sent,
    /// the blocks go back as soon as the machine progresses.
    fn handle_unneeded(&mut self) -> Result<Next, InputError> {
        if !self.peers.is_empty() {
            return Err(InputError::Peer("Unneeded for a transfer D ranks pull"));
        }
        self.receivers_expected = Some(0);
        self.unneeded = true;
        Ok(Next::Progress)
    }

    /// `peer`'s `Pull` is not ours to serve: refuse it and fail.
    fn handle_unpaired_pull(&mut self, cx: &mut Cx, peer: PeerId, reason: FailReason) -> Next {
        if self.peers.iter().any(|p| p.id == peer) {
            // Its first `Pull` was taken, so the layouts changed under
            // us (a new hello): settle it like any peer whose plan failed.
            return self.handle_verdict(peer, reason);
        }
        cx.send(peer, Msg::NotPaired);
        Next::End(End::Fail(reason))
    }

    /// The driver's verdict on `peer` (dead, or its plan rejected).
    fn handle_verdict(&self, peer: PeerId, reason: FailReason) -> Next {
        // A finished peer returned its lease and needs nothing more from us.
        if self.peers.iter().any(|p| p.id == peer && !p.is_finished()) {
            Next::End(End::Fail(reason))
        } else {
            Next::Stay
        }
    }

    fn handle_ticket_grant(
        &mut self,
        cx: &mut Cx,
        peer: PeerId,
        sent_at: Instant,
        duration_ms: u64,
    ) -> Result<Next, InputError> {
        if cx.mode == Mode::Pull {
            return Err(InputError::Peer("ticket grant in pull mode"));
        }
        if !self.peers.iter().any(|p| p.id == peer) {
            // It overtook its `Pull`: keep it for when the `Pull` comes
            // (bounded; past the bound P asks the ordinary way).
            if !self.early_tickets.iter().any(|(p, _, _)| *p == peer)
                && self.early_tickets.len() < cx.cfg.max_peers
            {
                self.early_tickets.push((peer, sent_at, duration_ms));
            }
            return Ok(Next::Stay);
        }
        if self.apply_ticket(cx, peer, sent_at, duration_ms) {
            Ok(Next::Progress)
        } else {
            Ok(Next::Stay)
        }
    }

    /// Push mode: counts `peer`'s lease from when its ticket was sent.
    /// True when the lease changed (the caller then progresses).
    fn apply_ticket(&mut self, cx: &Cx, peer: PeerId, sent_at: Instant, duration_ms: u64) -> bool {
        let Some(p) = self.peer_mut(peer) else {
            return false;
        };
        match &mut p.role {
            // A ticket from the future would stretch the lease: count it
            // from now at the latest.
            Role::Toucher { lease, .. } => {
                lease.handle_ticket(sent_at.min(cx.now), duration_ms, cx.cfg)
            }
            Role::Granter { .. } => return false,
        }
        p.last_heard = cx.now;
        true
    }

    /// Push mode: `peer` refused the ticket: ask now, unless a lease is
    /// already live.
    fn handle_ticket_refused(&mut self, cx: &mut Cx, peer: PeerId) -> Result<Next, InputError> {
        match self.peers.iter().find(|p| p.id == peer).map(|p| &p.role) {
            Some(Role::Toucher {
                lease,
                finished: false,
                ..
            }) if !lease.is_live(cx.now) => self.request_lease(cx, peer),
            Some(Role::Granter { .. }) => {
                return Err(InputError::Peer("ticket refused in pull mode"))
            }
            // Unknown peer (it overtook its `Pull`), finished, or leased.
            Some(Role::Toucher { .. }) | None => {}
        }
        Ok(Next::Stay)
    }

    /// D rank `peer` takes part: a new peer, or a duplicate `Pull` that
    /// only shows it is alive.
    fn handle_pull(
        &mut self,
        cx: &mut Cx,
        peer: PeerId,
        receivers_expected: u16,
        dst_blocks: BlockLists,
        prefix_blocks: Vec<u32>,
        lease_seq: Option<u64>,
    ) -> Result<Next, InputError> {
        self.check_pull(cx.cfg, receivers_expected, &dst_blocks, &prefix_blocks)?;
        if let Some(p) = self.peer_mut(peer) {
            if p.dst_blocks != dst_blocks || p.prefix_blocks != prefix_blocks {
                return Err(InputError::Peer("second Pull with other blocks"));
            }
            // A duplicate: the peer is alive, and may have missed what we
            // told it (it resends its `Pull` until it hears back).
            p.last_heard = cx.now;
            self.answer_again(cx, peer, lease_seq);
            return Ok(Next::Stay);
        }
        if self.peers.len() >= receivers_expected as usize {
            return Err(InputError::Peer("more D ranks than announced"));
        }
        self.receivers_expected = Some(receivers_expected);
        self.peers.push(Peer {
            id: peer,
            dst_blocks,
            prefix_blocks,
            last_heard: cx.now,
            role: Role::new(cx.mode),
            resend: Resend::idle(),
        });
        self.greet(cx, peer, lease_seq);
        Ok(Next::Progress)
    }

    /// Checks a `Pull` against the bounds and the other D ranks' `Pull`s.
    fn check_pull(
        &self,
        cfg: &Config,
        receivers_expected: u16,
        dst_blocks: &BlockLists,
        prefix_blocks: &[u32],
    ) -> Result<(), InputError> {
        if receivers_expected == 0 || receivers_expected as usize > cfg.max_peers {
            return Err(InputError::Peer("receivers_expected out of range"));
        }
        if self
            .receivers_expected
            .is_some_and(|n| n != receivers_expected)
        {
            return Err(InputError::Peer(
                "receivers_expected differs between D ranks",
            ));
        }
        if !check_lists(dst_blocks, cfg) || prefix_blocks.len() != dst_blocks.len() {
            return Err(InputError::Peer(
                "destination block list malformed or over bounds",
            ));
        }
        Ok(())
    }

    /// Answers a duplicate `Pull` from `peer` with what it may have missed:
    /// push mode, the `Status` of a peer whose KV all landed; pull mode, a
    /// grant for its lease request and every chunk announced so far.
    fn answer_again(&mut self, cx: &mut Cx, peer: PeerId, lease_seq: Option<u64>) {
        let Some(p) = self.peers.iter().find(|p| p.id == peer) else {
            return;
        };
        match &p.role {
            Role::Toucher { finished, .. } => {
                if *finished {
                    cx.resend(peer, Msg::Status { ok: true });
                }
            }
            Role::Granter { announced, .. } => {
                let announced = *announced;
                if let Some(seq) = lease_seq {
                    self.grant(cx, peer, seq);
                }
                for index in 0..announced {
                    cx.resend(peer, ready_msg(&self.chunks, self.last_seen, index));
                }
            }
        }
    }

    /// Pull mode: resends the last `Ready` to every peer whose `Done` is
    /// overdue; a D rank that finished answers it with its `Done` again.
    fn resend_last_ready(&mut self, cx: &mut Cx) {
        let Some(last) = self.chunks.len().checked_sub(1) else {
            return;
        };
        let mut due = Vec::new();
        for p in &mut self.peers {
            if !p.is_finished() && p.resend.fire(cx.now, cx.cfg) {
                due.push(p.id);
            }
        }
        for peer in due {
            cx.resend(peer, ready_msg(&self.chunks, self.last_seen, last as u32));
        }
    }

    /// Starts the lease with `peer`, just known, and in pull mode announces
    /// the chunks ready so far.
    fn greet(&mut self, cx: &mut Cx, peer: PeerId, lease_seq: Option<u64>) {
        let early = self
            .early_tickets
            .iter()
            .position(|(p, _, _)| *p == peer)
            .map(|i| self.early_tickets.swap_remove(i));
        match cx.mode {
            // Its ticket grant came first: apply it now (the `Pull` makes
            // the machine progress either way).
            Mode::Push if early.is_some() => {
                if let Some((_, sent_at, duration_ms)) = early {
                    self.apply_ticket(cx, peer, sent_at, duration_ms);
                }
            }
            // A `Pull` that announces a ticket grant right behind it
            // saves the lease round trip; should the grant get lost,
            // P asks when a lost answer would be resent (`resend_after`),
            // and a refused ticket makes it ask at once.
            Mode::Push if lease_seq.is_some() => self.defer_lease_request(cx, peer),
            Mode::Push => self.request_lease(cx, peer),
            Mode::Pull => {
                if let Some(seq) = lease_seq {
                    self.grant(cx, peer, seq);
                }
                for i in 0..self.chunks.len() as u32 {
                    self.announce(cx, i);
                }
            }
        }
    }

    fn handle_lease_grant(
        &mut self,
        cx: &mut Cx,
        peer: PeerId,
        seq: u64,
        duration_ms: u64,
    ) -> Result<Next, InputError> {
        let Some(p) = self.peer_mut(peer) else {
            return Err(InputError::Peer("lease grant from an unknown peer"));
        };
        match &mut p.role {
            Role::Toucher { lease, .. } => {
                lease.check_grant(seq)?;
                lease.handle_grant(seq, duration_ms, cx.cfg);
            }
            Role::Granter { .. } => return Err(InputError::Peer("lease grant in pull mode")),
        }
        p.last_heard = cx.now;
        Ok(Next::Progress)
    }

    fn handle_lease_request(
        &mut self,
        cx: &mut Cx,
        peer: PeerId,
        seq: u64,
    ) -> Result<Next, InputError> {
        match cx.mode {
            Mode::Push => return Err(InputError::Peer("lease request in push mode")),
            Mode::Pull => {}
        }
        // A request that overtook its `Pull` is dropped: the peer
        // renews within a heartbeat interval.
        if let Some(p) = self.peer_mut(peer) {
            p.last_heard = cx.now;
            self.grant(cx, peer, seq);
        }
        Ok(Next::Stay)
    }

    /// Pull mode: D rank `peer` returns its lease; its reads are over,
    /// done, or failed (with the reason this request then fails for).
    fn handle_done(
        &mut self,
        cx: &mut Cx,
        peer: PeerId,
        done: Result<(), FailReason>,
    ) -> Result<Next, InputError> {
        // `why` matters only when `done` failed.
        let (ok, why) = match done {
            Ok(()) => (true, FailReason::PeerReported),
            Err(reason) => (false, reason),
        };
        let chunks = self.chunks.len() as u32;
        let last_seen = self.last_seen;
        let Some(p) = self.peer_mut(peer) else {
            if ok {
                return Err(InputError::Peer("Done from an unknown peer"));
            }
            // A D rank that failed before its `Pull` reached us (or
            // whose `Pull` was lost): the request is gone.
            return Ok(Next::End(End::PeerFailed(peer, why)));
        };
        match &mut p.role {
            Role::Toucher { .. } => Err(InputError::Peer("Done in push mode")),
            Role::Granter { finished: true, .. } => Ok(Next::Stay),
            Role::Granter {
                announced,
                finished,
                ..
            } => {
                if ok && !(last_seen && *announced == chunks) {
                    return Err(InputError::Peer("Done before the last chunk was announced"));
                }
                p.last_heard = cx.now;
                if ok {
                    *finished = true;
                    p.resend.stop();
                    Ok(Next::Progress)
                } else {
                    Ok(Next::End(End::PeerFailed(peer, why)))
                }
            }
        }
    }

    fn handle_abort(&self, peer: PeerId) -> Next {
        let known = self.peers.iter().find(|p| p.id == peer);
        if known.is_some_and(Peer::is_finished) {
            // This D rank already has everything and returned its
            // lease: its `Abort` is stale (its driver answering a
            // duplicated message after it ended, say). If the
            // request is really gone, the D ranks still at work
            // abort as well.
            return Next::Stay;
        }
        if known.is_some_and(Peer::is_closing) {
            // The last write is in flight with the `Status` behind
            // it; the D rank may have had both and ended, and this
            // answers a lease renewal that crossed them. If the
            // abort is real, D's fence fails the write and its
            // completion ends the request; if the write landed,
            // everything D was told of is there.
            return Next::Stay;
        }
        // An abort from a D rank we do not know yet still ends the
        // request: any D rank aborting means the request is gone.
        Next::End(End::PeerAbort(peer))
    }

    /// Time passed: a write past its bound, a missed deadline, or a lease
    /// to renew.
    fn handle_timeout(&mut self, cx: &mut Cx) -> Next {
        let now = cx.now;
        if self.ops.iter().any(|op| now >= op.deadline) {
            // The transport did not report within its bound: the write
            // can no longer land, and it failed.
            self.ops.retain(|op| now < op.deadline);
            return Next::End(End::Fail(FailReason::Transport));
        }
        if !self.all_known() && now >= self.bootstrap_deadline {
            return Next::End(End::Expire);
        }
        if self.claim_deadline(cx.cfg).is_some_and(|d| now >= d) {
            return Next::End(End::Expire);
        }
        let due: Vec<PeerId> = self
            .peers
            .iter()
            .filter(|p| match &p.role {
                Role::Toucher {
                    lease, finished, ..
                } => !finished && lease.renew_at().is_some_and(|r| now >= r),
                Role::Granter { .. } => false,
            })
            .map(|p| p.id)
            .collect();
        for peer in due {
            self.request_lease(cx, peer);
        }
        self.resend_last_ready(cx);
        // A lease may have run out: nothing to do, posting stops by itself.
        Next::Stay
    }

    /// Pull mode: sends `Ready` for chunk `index` to every known peer.
    fn announce(&mut self, cx: &mut Cx, index: u32) {
        let is_last = self.last_seen && index as usize + 1 == self.chunks.len();
        for p in &mut self.peers {
            if let Role::Granter {
                announced,
                finished: false,
                ..
            } = &mut p.role
            {
                if *announced == index {
                    *announced += 1;
                    if is_last {
                        // From now on only the peer's `Done` is missing.
                        p.resend.restart(cx.now, cx.cfg);
                    }
                    cx.send(p.id, ready_msg(&self.chunks, self.last_seen, index));
                }
            }
        }
    }

    /// Pull mode: grants `peer` a lease for its request `seq`, capped by the hold limit.
    fn grant(&mut self, cx: &mut Cx, peer: PeerId, seq: u64) {
        let d = cx
            .cfg
            .lease
            .min(self.hold_deadline.saturating_duration_since(cx.now));
        if d.is_zero() {
            return;
        }
        let Some(p) = self.peer_mut(peer) else {
            return;
        };
        if let Role::Granter {
            lease,
            finished: false,
            ..
        } = &mut p.role
        {
            let msg = lease.grant(cx.now, seq, d);
            cx.send(peer, msg);
        }
    }

    /// Push mode: plans to ask `peer` for a lease soon (see
    /// `TouchLease::defer_request`), unless a grant makes that moot.
    fn defer_lease_request(&mut self, cx: &Cx, peer: PeerId) {
        if let Some(p) = self.peer_mut(peer) {
            if let Role::Toucher { lease, .. } = &mut p.role {
                lease.defer_request(cx.now, cx.cfg);
            }
        }
    }

    /// Push mode: asks `peer` for a lease, counting from now.
    fn request_lease(&mut self, cx: &mut Cx, peer: PeerId) {
        if let Some(p) = self.peer_mut(peer) {
            if let Role::Toucher {
                lease,
                finished: false,
                ..
            } = &mut p.role
            {
                let seq = lease.request(cx.now, cx.cfg);
                cx.send(peer, Msg::LeaseRequest { seq });
            }
        }
    }

    /// Push mode: posts what can be posted to every peer and returns the
    /// leases of the peers that have all their KV.
    fn post_writes(&mut self, cx: &mut Cx) -> Result<(), BadMetadata> {
        for p in &mut self.peers {
            post_to_peer(p, &self.chunks, self.last_seen, &mut self.ops, cx)?;
        }
        Ok(())
    }

    /// True when every expected peer is known and finished, and the last
    /// chunk was seen.
    fn is_complete(&self) -> bool {
        self.all_known()
            && (self.last_seen || self.unneeded)
            && self.peers.iter().all(Peer::is_finished)
    }

    /// The claim (D silent while we hold KV for it) capped by the hold limit.
    fn claim_deadline(&self, cfg: &Config) -> Option<Instant> {
        let hold = self.hold_deadline;
        if self.first_chunk_at.is_none() {
            return Some(hold);
        }
        // D ranks that never showed up are bounded by the bootstrap deadline;
        // the claim is about known D ranks going silent while we hold KV for them.
        let mut claim = None;
        for p in &self.peers {
            if !p.is_finished() {
                claim = earliest(claim, Some(after(p.last_heard, cfg.claim_timeout)));
            }
        }
        Some(claim.map_or(hold, |c| c.min(hold)))
    }
}

/// Pull mode: the `Ready` announcing chunk `index` of `chunks`.
fn ready_msg(chunks: &[Chunk], last_seen: bool, index: u32) -> Msg {
    let chunk = &chunks[index as usize];
    Msg::Ready {
        chunk: index,
        start_blocks: chunk.start_blocks.clone(),
        src_blocks: chunk.src_blocks.clone(),
        is_last: last_seen && index as usize + 1 == chunks.len(),
    }
}

/// Push mode: posts the writes to `p` that its lease and the in-flight
/// bound allow, and returns its lease (`Status{ok: true}`) once all of
/// its KV landed.
fn post_to_peer(
    p: &mut Peer,
    chunks: &[Chunk],
    last_seen: bool,
    ops: &mut Vec<Posted>,
    cx: &mut Cx,
) -> Result<(), BadMetadata> {
    let Role::Toucher {
        lease,
        next_chunk,
        finished,
        closing,
    } = &mut p.role
    else {
        return Ok(());
    };
    if *finished {
        return Ok(());
    }
    if last_seen {
        let last = &chunks[chunks.len() - 1];
        let end = chunk_end(&last.start_blocks, &last.src_blocks);
        if !covers_exactly(&end, &p.dst_blocks, &p.prefix_blocks) {
            return Err(BadMetadata);
        }
    }
    while (*next_chunk as usize) < chunks.len() && lease.is_live(cx.now) {
        let chunk = &chunks[*next_chunk as usize];
        let (src, dst) = align_chunk(
            &chunk.start_blocks,
            &chunk.src_blocks,
            &p.dst_blocks,
            &p.prefix_blocks,
        )
        .ok_or(BadMetadata)?;
        if !is_empty_lists(&src) {
            if ops.len() >= cx.cfg.max_in_flight {
                break;
            }
            // The `Status` may ride this write when it is the
            // peer's last and nothing else is in flight to it: then
            // the write landing means all of the peer's KV landed.
            let last = last_seen && *next_chunk as usize + 1 == chunks.len();
            let status_after = last && !ops.iter().any(|op| op.peer == p.id);
            *closing |= status_after;
            ops.push(Posted {
                peer: p.id,
                chunk: *next_chunk,
                deadline: after(cx.now, cx.cfg.transfer_bound),
            });
            cx.actions.push_back(Action::Write {
                peer: p.id,
                chunk: *next_chunk,
                src_blocks: src,
                dst_blocks: dst,
                status_after,
            });
        }
        *next_chunk += 1;
    }
    let all_posted = last_seen && *next_chunk as usize == chunks.len();
    if all_posted && !ops.iter().any(|op| op.peer == p.id) {
        *finished = true;
        // A closing write's driver delivered the `Status` already.
        if !*closing {
            cx.send(p.id, Msg::Status { ok: true });
        }
    }
    Ok(())
}

/// Why the live request ends, with the peer that caused it if any.
impl SendMachine {
    /// A machine for `transfer_id` on this P rank, in `Bootstrapping`.
    pub fn new(now: Instant, config: &Config, transfer_id: TransferId, mode: Mode) -> Self {
        SendMachine {
            cfg: *config,
            transfer_id,
            mode,
            state: State::Live(Live {
                bootstrap_deadline: after(now, config.bootstrap_timeout),
                receivers_expected: None,
                peers: Vec::new(),
                chunks: Vec::new(),
                last_seen: false,
                first_chunk_at: None,
                hold_deadline: after(now, config.hold_limit),
                ops: Vec::new(),
                early_tickets: Vec::new(),
                unneeded: false,
            }),
            actions: VecDeque::new(),
        }
    }

    /// The transfer this machine moves.
    pub fn transfer_id(&self) -> TransferId {
        self.transfer_id
    }

    /// Push or pull.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// True once `ReleaseBlocks` was queued.
    pub fn is_released(&self) -> bool {
        match self.state {
            State::Live(_) | State::Draining(_) => false,
            State::Finished(_) => true,
        }
    }

    /// Push mode: the end of the lease of `peer` as this toucher counts it.
    pub fn lease_valid_until(&self, peer: PeerId) -> Option<Instant> {
        match &self.state {
            State::Live(live) => {
                live.peers
                    .iter()
                    .find(|p| p.id == peer)
                    .and_then(|p| match &p.role {
                        Role::Toucher { lease, .. } => lease.valid_until(),
                        Role::Granter { .. } => None,
                    })
            }
            State::Draining(_) | State::Finished(_) => None,
        }
    }

    fn send(&mut self, peer: PeerId, msg: Msg) {
        self.actions.push_back(Action::Send { peer, msg });
    }

    /// The machine's state and, borrowed apart from it, what the handlers
    /// of a live request use.
    fn split(&mut self, now: Instant) -> (&mut State, Cx<'_>) {
        let SendMachine {
            cfg,
            mode,
            state,
            actions,
            ..
        } = self;
        let cx = Cx {
            cfg,
            mode: *mode,
            now,
            actions,
        };
        (state, cx)
    }

    /// Carries out what a handler of a live input decided.
    fn apply(&mut self, now: Instant, next: Next) {
        match next {
            Next::Stay => {}
            Next::Progress => self.progress(now),
            Next::End(end) => self.end(now, end),
        }
    }

    /// Posts what can be posted, returns finished leases and completes the
    /// request when every expected peer is finished.
    fn progress(&mut self, now: Instant) {
        let (State::Live(live), mut cx) = self.split(now) else {
            return;
        };
        if live.post_writes(&mut cx).is_err() {
            self.end(now, End::Fail(FailReason::BadMetadata));
        } else if live.is_complete() {
            self.finish(Phase::Success);
        }
    }

    fn finish(&mut self, outcome: Phase) {
        self.state = State::Finished(outcome);
        self.actions.push_back(Action::ReleaseBlocks { outcome });
    }

    /// Ends a live request: tells the peers and starts draining.
    fn end(&mut self, now: Instant, end: End) {
        let State::Live(live) = &mut self.state else {
            return;
        };
        let mut drain = end.drain(std::mem::take(&mut live.ops), &self.cfg);
        if let End::PeerAbort(peer) = end {
            if !live.peers.iter().any(|p| p.id == peer) {
                // Not a peer we deal with: answer at once, nothing of ours is on it.
                self.actions.push_back(Action::Send {
                    peer,
                    msg: Msg::AbortAck,
                });
            }
        }
        for p in &live.peers {
            if p.is_finished() {
                continue;
            }
            let granted = match &p.role {
                Role::Toucher { .. } => None,
                Role::Granter { lease, .. } => Some(*lease),
            };
            let failure_return = Msg::Status { ok: false };
            if let Some(msg) = end.settle_peer(&mut drain, p.id, granted, failure_return, &self.cfg)
            {
                self.actions.push_back(Action::Send { peer: p.id, msg });
            }
        }
        self.state = State::Draining(drain);
        self.advance_drain(now);
    }

    fn advance_drain(&mut self, now: Instant) {
        let State::Draining(drain) = &mut self.state else {
            return;
        };
        let mut out = VecDeque::new();
        let free = drain.advance(now, self.cfg.fence(), &mut out);
        let outcome = drain.outcome;
        for (peer, msg) in out {
            self.send(peer, msg);
        }
        if free {
            self.finish(outcome);
        }
    }
}

impl Machine for SendMachine {
    type Event = Event;
    type Action = Action;

    fn handle_event(&mut self, now: Instant, event: Event) -> Result<(), InputError> {
        let (state, mut cx) = self.split(now);
        match state {
            State::Live(live) => {
                let next = live.handle_event(&mut cx, event)?;
                self.apply(now, next);
                Ok(())
            }
            State::Draining(drain) => {
                match event {
                    Event::WriteDone { peer, chunk, .. } => drain.handle_completion(peer, chunk),
                    Event::Msg { peer, msg } => drain.handle_msg(peer, &msg),
                    // Refused as when live; the outcome is decided already.
                    Event::UnpairedDone { peer, .. } => {
                        drain.handle_msg(peer, &Msg::Done { ok: false })
                    }
                    Event::UnpairedPull { peer, .. } => self.actions.push_back(Action::Send {
                        peer,
                        msg: Msg::NotPaired,
                    }),
                    // The outcome is decided; neither changes when the blocks are free.
                    Event::ChunkReady { .. }
                    | Event::PeerDead { .. }
                    | Event::PlanFailed { .. }
                    | Event::TicketGrant { .. }
                    | Event::TicketRefused { .. }
                    | Event::StatusNotCarried { .. } => {}
                }
                self.advance_drain(now);
                Ok(())
            }
            State::Finished(_) => Ok(()),
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        let (state, mut cx) = self.split(now);
        match state {
            State::Live(live) => {
                let next = live.handle_timeout(&mut cx);
                self.apply(now, next);
            }
            State::Draining(_) => self.advance_drain(now),
            State::Finished(_) => {}
        }
    }

    fn abort(&mut self, now: Instant, reason: AbortReason) {
        match self.state {
            State::Live(_) => self.end(now, End::Fail(FailReason::Aborted(reason))),
            State::Draining(_) | State::Finished(_) => {}
        }
    }

    fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::Live(live) => {
                let mut t = live.ops.iter().map(|op| op.deadline).min();
                if !live.all_known() {
                    t = earliest(t, Some(live.bootstrap_deadline));
                }
                t = earliest(t, live.claim_deadline(&self.cfg));
                for p in &live.peers {
                    if !p.is_finished() {
                        t = earliest(t, p.resend.due());
                    }
                    if let Role::Toucher {
                        lease,
                        finished: false,
                        ..
                    } = &p.role
                    {
                        t = earliest(t, lease.renew_at());
                    }
                }
                t
            }
            State::Draining(drain) => drain.poll_timeout(self.cfg.fence()),
            State::Finished(_) => None,
        }
    }

    fn phase(&self) -> Phase {
        match &self.state {
            State::Live(live) => {
                if !live.all_known() {
                    Phase::Bootstrapping
                } else if live.chunks.is_empty() {
                    Phase::WaitingForInput
                } else {
                    Phase::Transferring
                }
            }
            State::Draining(_) => Phase::Transferring,
            State::Finished(phase) => *phase,
        }
    }
}
