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
    AbortReason, BlockLists, Config, Drain, End, FailReason, GrantLease, InputError, Mode, Msg, Op,
    PeerId, Phase, TouchLease, TransferId,
};
use crate::machine::Machine;

/// Inputs of a [`SendMachine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// A control message from D rank `peer`.
    Msg { peer: PeerId, msg: Msg },
    /// The engine finished a chunk of KV: its source blocks per group, in
    /// order after the previous chunks. Chunk ids are assigned 0, 1, 2, ...
    ChunkReady {
        src_blocks: BlockLists,
        is_last: bool,
    },
    /// Push mode: the transport finished the write of `chunk` to `peer`.
    WriteDone { peer: PeerId, chunk: u32, ok: bool },
    /// The driver declared `peer` dead (missed heartbeats, connection lost).
    PeerDead { peer: PeerId },
    /// The planner rejected the layouts or block lists of `peer`.
    PlanFailed { peer: PeerId },
    /// Push mode: `peer` granted a lease answering a ticket this node sent
    /// it at `sent_at` (see [`crate::common::TICKET_BIT`]); the driver
    /// turns the `LeaseGrant` naming that ticket into this event.
    TicketGrant {
        peer: PeerId,
        sent_at: Instant,
        duration_ms: u64,
    },
    /// Push mode: `peer`'s grant named a ticket this node does not know
    /// (any more): ask for a lease now instead of waiting for one.
    TicketRefused { peer: PeerId },
}

/// Outputs of a [`SendMachine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send `msg` to D rank `peer` for this transfer.
    Send { peer: PeerId, msg: Msg },
    /// Push mode: write `src_blocks` (ours) into `dst_blocks` (the peer's),
    /// same lengths per group, then report [`Event::WriteDone`]. The driver
    /// turns the lists into descriptors with the planner.
    ///
    /// With `status_after`, this is the peer's last write and nothing else
    /// of the request is in flight to it: the driver itself delivers
    /// `Status{ok: true}` to the peer once the write has landed in full,
    /// and before it reports `WriteDone{ok: true}` (the machine sends no
    /// `Status` then). A transport that can carries the `Status` right
    /// behind the write on the same connection, delivered only if the
    /// write landed, so D learns of it without waiting for P to hear the
    /// write's acknowledgement. `WriteDone{ok: false}` then leaves open
    /// whether the `Status` reached the peer (the write may have landed
    /// and only its acknowledgement been lost); either way every byte the
    /// peer was told of landed.
    Write {
        peer: PeerId,
        chunk: u32,
        src_blocks: BlockLists,
        dst_blocks: BlockLists,
        status_after: bool,
    },
    /// The request's source blocks may go back to the engine. Emitted
    /// exactly once; `outcome` is the terminal phase.
    ReleaseBlocks { outcome: Phase },
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
    ops: Vec<Op>,
    /// Push mode: ticket grants that overtook their peer's `Pull` (peer,
    /// ticket sent at, duration), applied when the `Pull` comes; at most
    /// `max_peers`. The two travel together but a node may route them
    /// differently (one to a live machine at once, one through its bridge).
    early_tickets: Vec<(PeerId, Instant, u64)>,
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
            }),
            actions: VecDeque::new(),
        }
    }

    pub fn transfer_id(&self) -> TransferId {
        self.transfer_id
    }

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

    fn handle_chunk_ready(
        &mut self,
        now: Instant,
        src_blocks: BlockLists,
        is_last: bool,
    ) -> Result<(), InputError> {
        let State::Live(live) = &mut self.state else {
            unreachable!("handle_chunk_ready on a machine that is not live");
        };
        let cfg = self.cfg;
        if live.last_seen {
            return Err(InputError::Misuse("chunk after the last chunk"));
        }
        if live.chunks.len() >= cfg.max_chunks {
            return Err(InputError::Misuse("more chunks than max_chunks"));
        }
        if !check_lists(&src_blocks, &cfg) {
            return Err(InputError::Misuse("block list over the configured bounds"));
        }
        let start_blocks: Vec<u32> = match live.chunks.last() {
            None => vec![0; src_blocks.len()],
            Some(prev) => {
                if prev.src_blocks.len() != src_blocks.len() {
                    return Err(InputError::Misuse("chunk with another group count"));
                }
                chunk_end(&prev.start_blocks, &prev.src_blocks)
            }
        };
        let index = live.chunks.len() as u32;
        live.chunks.push(Chunk {
            start_blocks,
            src_blocks,
        });
        live.last_seen = is_last;
        if live.first_chunk_at.is_none() {
            // The claim counts from when we started holding KV for D: a D rank
            // that was quiet while there was nothing to fetch is not late.
            live.first_chunk_at = Some(now);
            for p in &mut live.peers {
                p.last_heard = p.last_heard.max(now);
            }
        }
        match self.mode {
            Mode::Push => {}
            Mode::Pull => self.announce(index),
        }
        self.progress(now);
        Ok(())
    }

    fn handle_write_done(
        &mut self,
        now: Instant,
        peer: PeerId,
        chunk: u32,
        ok: bool,
    ) -> Result<(), InputError> {
        let State::Live(live) = &mut self.state else {
            unreachable!("handle_write_done on a machine that is not live");
        };
        let Some(i) = live
            .ops
            .iter()
            .position(|op| op.peer == peer && op.chunk == chunk)
        else {
            return Err(InputError::Misuse(
                "completion of a write that is not in flight",
            ));
        };
        live.ops.swap_remove(i);
        if ok {
            self.progress(now);
        } else {
            self.end(now, End::Fail(FailReason::Transport));
        }
        Ok(())
    }

    /// The driver's verdict on `peer` (dead, or its plan rejected).
    fn handle_verdict(&mut self, now: Instant, peer: PeerId, reason: FailReason) {
        let State::Live(live) = &self.state else {
            return;
        };
        // A finished peer returned its lease and needs nothing more from us.
        if live.peers.iter().any(|p| p.id == peer && !p.is_finished()) {
            self.end(now, End::Fail(reason));
        }
    }

    /// Pull mode: sends `Ready` for chunk `index` to every known peer.
    fn announce(&mut self, index: u32) {
        let State::Live(live) = &mut self.state else {
            return;
        };
        let chunk = &live.chunks[index as usize];
        let is_last = live.last_seen && index as usize + 1 == live.chunks.len();
        for p in &mut live.peers {
            if let Role::Granter {
                announced,
                finished: false,
                ..
            } = &mut p.role
            {
                if *announced == index {
                    *announced += 1;
                    self.actions.push_back(Action::Send {
                        peer: p.id,
                        msg: Msg::Ready {
                            chunk: index,
                            start_blocks: chunk.start_blocks.clone(),
                            src_blocks: chunk.src_blocks.clone(),
                            is_last,
                        },
                    });
                }
            }
        }
    }

    fn handle_ticket_grant(
        &mut self,
        now: Instant,
        peer: PeerId,
        sent_at: Instant,
        duration_ms: u64,
    ) -> Result<(), InputError> {
        let State::Live(live) = &mut self.state else {
            unreachable!("handle_ticket_grant on a machine that is not live");
        };
        let cfg = self.cfg;
        if self.mode == Mode::Pull {
            return Err(InputError::Peer("ticket grant in pull mode"));
        }
        if !live.peers.iter().any(|p| p.id == peer) {
            // It overtook its `Pull`: keep it for when the `Pull` comes
            // (bounded; past the bound P asks the ordinary way).
            if !live.early_tickets.iter().any(|(p, _, _)| *p == peer)
                && live.early_tickets.len() < cfg.max_peers
            {
                live.early_tickets.push((peer, sent_at, duration_ms));
            }
            return Ok(());
        }
        self.apply_ticket(now, peer, sent_at, duration_ms);
        Ok(())
    }

    /// Push mode: counts `peer`'s lease from when its ticket was sent.
    fn apply_ticket(&mut self, now: Instant, peer: PeerId, sent_at: Instant, duration_ms: u64) {
        let State::Live(live) = &mut self.state else {
            return;
        };
        let cfg = self.cfg;
        let Some(p) = live.peers.iter_mut().find(|p| p.id == peer) else {
            return;
        };
        match &mut p.role {
            // A ticket from the future would stretch the lease: count it
            // from now at the latest.
            Role::Toucher { lease, .. } => lease.handle_ticket(sent_at.min(now), duration_ms, &cfg),
            Role::Granter { .. } => return,
        }
        p.last_heard = now;
        self.progress(now);
    }

    fn handle_msg(&mut self, now: Instant, peer: PeerId, msg: Msg) -> Result<(), InputError> {
        let State::Live(live) = &mut self.state else {
            unreachable!("handle_msg on a machine that is not live");
        };
        let cfg = self.cfg;
        let mode = self.mode;
        let known = live.peers.iter().position(|p| p.id == peer);
        match msg {
            Msg::Pull {
                receivers_expected,
                dst_blocks,
                prefix_blocks,
                lease_seq,
            } => {
                if receivers_expected == 0 || receivers_expected as usize > cfg.max_peers {
                    return Err(InputError::Peer("receivers_expected out of range"));
                }
                if live
                    .receivers_expected
                    .is_some_and(|n| n != receivers_expected)
                {
                    return Err(InputError::Peer(
                        "receivers_expected differs between D ranks",
                    ));
                }
                if !check_lists(&dst_blocks, &cfg) || prefix_blocks.len() != dst_blocks.len() {
                    return Err(InputError::Peer(
                        "destination block list malformed or over bounds",
                    ));
                }
                if let Some(i) = known {
                    let p = &live.peers[i];
                    if p.dst_blocks != dst_blocks || p.prefix_blocks != prefix_blocks {
                        return Err(InputError::Peer("second Pull with other blocks"));
                    }
                    // A duplicate: it only shows the peer is alive. Its lease
                    // request (pull mode) is answered like any other.
                    live.peers[i].last_heard = now;
                    if let (Some(seq), Mode::Pull) = (lease_seq, mode) {
                        self.grant(now, peer, seq);
                    }
                    return Ok(());
                }
                if live.peers.len() >= receivers_expected as usize {
                    return Err(InputError::Peer("more D ranks than announced"));
                }
                live.receivers_expected = Some(receivers_expected);
                let role = match mode {
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
                };
                live.peers.push(Peer {
                    id: peer,
                    dst_blocks,
                    prefix_blocks,
                    last_heard: now,
                    role,
                });
                let early = live
                    .early_tickets
                    .iter()
                    .position(|(p, _, _)| *p == peer)
                    .map(|i| live.early_tickets.swap_remove(i));
                match mode {
                    // Its ticket grant came first: apply it now.
                    Mode::Push if early.is_some() => {
                        if let Some((_, sent_at, duration_ms)) = early {
                            self.apply_ticket(now, peer, sent_at, duration_ms);
                        }
                    }
                    // A `Pull` that announces a ticket grant right behind it
                    // saves the lease round trip; should the grant get lost,
                    // P asks one heartbeat interval from now, and a refused
                    // ticket makes it ask at once.
                    Mode::Push if lease_seq.is_some() => self.defer_lease_request(now, peer),
                    Mode::Push => self.request_lease(now, peer),
                    Mode::Pull => {
                        if let Some(seq) = lease_seq {
                            self.grant(now, peer, seq);
                        }
                        let n = match &self.state {
                            State::Live(live) => live.chunks.len() as u32,
                            State::Draining(_) | State::Finished(_) => 0,
                        };
                        for i in 0..n {
                            self.announce(i);
                        }
                    }
                }
                self.progress(now);
                Ok(())
            }
            Msg::LeaseGrant { seq, duration_ms } => {
                let Some(i) = known else {
                    return Err(InputError::Peer("lease grant from an unknown peer"));
                };
                let p = &mut live.peers[i];
                match &mut p.role {
                    Role::Toucher { lease, .. } => {
                        lease.check_grant(seq)?;
                        lease.handle_grant(seq, duration_ms, &cfg);
                    }
                    Role::Granter { .. } => {
                        return Err(InputError::Peer("lease grant in pull mode"))
                    }
                }
                p.last_heard = now;
                self.progress(now);
                Ok(())
            }
            Msg::LeaseRequest { seq } => {
                match mode {
                    Mode::Push => return Err(InputError::Peer("lease request in push mode")),
                    Mode::Pull => {}
                }
                // A request that overtook its `Pull` is dropped: the peer
                // renews within a heartbeat interval.
                if let Some(i) = known {
                    live.peers[i].last_heard = now;
                    self.grant(now, peer, seq);
                }
                Ok(())
            }
            Msg::Done { ok } => {
                let Some(i) = known else {
                    if ok {
                        return Err(InputError::Peer("Done from an unknown peer"));
                    }
                    // A D rank that failed before its `Pull` reached us (or
                    // whose `Pull` was lost): the request is gone.
                    self.end(now, End::PeerFailed(peer));
                    return Ok(());
                };
                let chunks = live.chunks.len() as u32;
                let last_seen = live.last_seen;
                let p = &mut live.peers[i];
                match &mut p.role {
                    Role::Toucher { .. } => return Err(InputError::Peer("Done in push mode")),
                    Role::Granter { finished: true, .. } => return Ok(()),
                    Role::Granter {
                        announced,
                        finished,
                        ..
                    } => {
                        if ok && !(last_seen && *announced == chunks) {
                            return Err(InputError::Peer(
                                "Done before the last chunk was announced",
                            ));
                        }
                        p.last_heard = now;
                        if ok {
                            *finished = true;
                            self.progress(now);
                        } else {
                            self.end(now, End::PeerFailed(peer));
                        }
                    }
                }
                Ok(())
            }
            Msg::Abort => {
                if known.is_some_and(|i| live.peers[i].is_finished()) {
                    // This D rank already has everything and returned its
                    // lease: its `Abort` is stale (its driver answering a
                    // duplicated message after it ended, say). If the
                    // request is really gone, the D ranks still at work
                    // abort as well.
                    return Ok(());
                }
                if known.is_some_and(|i| live.peers[i].is_closing()) {
                    // The last write is in flight with the `Status` behind
                    // it; the D rank may have had both and ended, and this
                    // answers a lease renewal that crossed them. If the
                    // abort is real, D's fence fails the write and its
                    // completion ends the request; if the write landed,
                    // everything D was told of is there.
                    return Ok(());
                }
                // An abort from a D rank we do not know yet still ends the
                // request: any D rank aborting means the request is gone.
                self.end(now, End::PeerAbort(peer));
                Ok(())
            }
            Msg::AbortAck => Err(InputError::Peer("AbortAck while nothing was aborted")),
            Msg::Ready { .. } | Msg::Status { .. } => {
                Err(InputError::Peer("message P never receives"))
            }
        }
    }

    /// Pull mode: grants `peer` a lease for its request `seq`, capped by the hold limit.
    fn grant(&mut self, now: Instant, peer: PeerId, seq: u64) {
        let State::Live(live) = &mut self.state else {
            return;
        };
        let d = self
            .cfg
            .lease
            .min(live.hold_deadline.saturating_duration_since(now));
        if d.is_zero() {
            return;
        }
        let Some(p) = live.peers.iter_mut().find(|p| p.id == peer) else {
            return;
        };
        if let Role::Granter {
            lease,
            finished: false,
            ..
        } = &mut p.role
        {
            let msg = lease.grant(now, seq, d);
            self.actions.push_back(Action::Send { peer, msg });
        }
    }

    /// Push mode: plans to ask `peer` for a lease one heartbeat interval
    /// from now, unless a grant makes that moot.
    fn defer_lease_request(&mut self, now: Instant, peer: PeerId) {
        let State::Live(live) = &mut self.state else {
            return;
        };
        let cfg = self.cfg;
        if let Some(p) = live.peers.iter_mut().find(|p| p.id == peer) {
            if let Role::Toucher { lease, .. } = &mut p.role {
                lease.defer_request(now, &cfg);
            }
        }
    }

    /// Push mode: `peer` refused the ticket: ask now, unless a lease is
    /// already live.
    fn handle_ticket_refused(&mut self, now: Instant, peer: PeerId) -> Result<(), InputError> {
        let State::Live(live) = &self.state else {
            unreachable!("handle_ticket_refused on a machine that is not live");
        };
        match live.peers.iter().find(|p| p.id == peer).map(|p| &p.role) {
            Some(Role::Toucher {
                lease,
                finished: false,
                ..
            }) if !lease.is_live(now) => self.request_lease(now, peer),
            Some(Role::Granter { .. }) => {
                return Err(InputError::Peer("ticket refused in pull mode"))
            }
            // Unknown peer (it overtook its `Pull`), finished, or leased.
            Some(Role::Toucher { .. }) | None => {}
        }
        Ok(())
    }

    /// Push mode: asks `peer` for a lease, counting from now.
    fn request_lease(&mut self, now: Instant, peer: PeerId) {
        let State::Live(live) = &mut self.state else {
            return;
        };
        let cfg = self.cfg;
        if let Some(p) = live.peers.iter_mut().find(|p| p.id == peer) {
            if let Role::Toucher {
                lease,
                finished: false,
                ..
            } = &mut p.role
            {
                let seq = lease.request(now, &cfg);
                self.actions.push_back(Action::Send {
                    peer,
                    msg: Msg::LeaseRequest { seq },
                });
            }
        }
    }

    /// Posts what can be posted, returns finished leases and completes the
    /// request when every expected peer is finished.
    fn progress(&mut self, now: Instant) {
        let State::Live(live) = &mut self.state else {
            return;
        };
        let cfg = self.cfg;
        let mut bad_metadata = false;
        for p in &mut live.peers {
            let Role::Toucher {
                lease,
                next_chunk,
                finished,
                closing,
            } = &mut p.role
            else {
                continue;
            };
            if *finished {
                continue;
            }
            if live.last_seen {
                let last = &live.chunks[live.chunks.len() - 1];
                let end = chunk_end(&last.start_blocks, &last.src_blocks);
                if !covers_exactly(&end, &p.dst_blocks, &p.prefix_blocks) {
                    bad_metadata = true;
                    break;
                }
            }
            while (*next_chunk as usize) < live.chunks.len() && lease.is_live(now) {
                let chunk = &live.chunks[*next_chunk as usize];
                let Some((src, dst)) = align_chunk(
                    &chunk.start_blocks,
                    &chunk.src_blocks,
                    &p.dst_blocks,
                    &p.prefix_blocks,
                ) else {
                    bad_metadata = true;
                    break;
                };
                if !is_empty_lists(&src) {
                    if live.ops.len() >= cfg.max_in_flight {
                        break;
                    }
                    // The `Status` may ride this write when it is the
                    // peer's last and nothing else is in flight to it: then
                    // the write landing means all of the peer's KV landed.
                    let last = live.last_seen && *next_chunk as usize + 1 == live.chunks.len();
                    let status_after = last && !live.ops.iter().any(|op| op.peer == p.id);
                    *closing |= status_after;
                    live.ops.push(Op {
                        peer: p.id,
                        chunk: *next_chunk,
                        deadline: after(now, cfg.transfer_bound),
                    });
                    self.actions.push_back(Action::Write {
                        peer: p.id,
                        chunk: *next_chunk,
                        src_blocks: src,
                        dst_blocks: dst,
                        status_after,
                    });
                }
                *next_chunk += 1;
            }
            if bad_metadata {
                break;
            }
            let all_posted = live.last_seen && *next_chunk as usize == live.chunks.len();
            if all_posted && !live.ops.iter().any(|op| op.peer == p.id) {
                *finished = true;
                // A closing write's driver delivered the `Status` already.
                if !*closing {
                    self.actions.push_back(Action::Send {
                        peer: p.id,
                        msg: Msg::Status { ok: true },
                    });
                }
            }
        }
        if bad_metadata {
            self.end(now, End::Fail(FailReason::BadMetadata));
            return;
        }
        let State::Live(live) = &mut self.state else {
            return;
        };
        let complete = live
            .receivers_expected
            .is_some_and(|n| n as usize == live.peers.len())
            && live.last_seen
            && live.peers.iter().all(Peer::is_finished);
        if complete {
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

    /// The claim (D silent while we hold KV for it) capped by the hold limit.
    fn claim_deadline(&self, live: &Live) -> Option<Instant> {
        let hold = live.hold_deadline;
        if live.first_chunk_at.is_none() {
            return Some(hold);
        }
        // D ranks that never showed up are bounded by the bootstrap deadline;
        // the claim is about known D ranks going silent while we hold KV for them.
        let mut claim = None;
        for p in &live.peers {
            if !p.is_finished() {
                claim = earliest(claim, Some(after(p.last_heard, self.cfg.claim_timeout)));
            }
        }
        Some(claim.map_or(hold, |c| c.min(hold)))
    }
}

impl Machine for SendMachine {
    type Event = Event;
    type Action = Action;

    fn handle_event(&mut self, now: Instant, event: Event) -> Result<(), InputError> {
        match &mut self.state {
            State::Live(_) => match event {
                Event::Msg { peer, msg } => self.handle_msg(now, peer, msg),
                Event::ChunkReady {
                    src_blocks,
                    is_last,
                } => self.handle_chunk_ready(now, src_blocks, is_last),
                Event::WriteDone { peer, chunk, ok } => {
                    self.handle_write_done(now, peer, chunk, ok)
                }
                Event::PeerDead { peer } => {
                    self.handle_verdict(now, peer, FailReason::PeerDead);
                    Ok(())
                }
                Event::PlanFailed { peer } => {
                    self.handle_verdict(now, peer, FailReason::BadMetadata);
                    Ok(())
                }
                Event::TicketGrant {
                    peer,
                    sent_at,
                    duration_ms,
                } => self.handle_ticket_grant(now, peer, sent_at, duration_ms),
                Event::TicketRefused { peer } => self.handle_ticket_refused(now, peer),
            },
            State::Draining(drain) => {
                match event {
                    Event::WriteDone { peer, chunk, .. } => drain.handle_completion(peer, chunk),
                    Event::Msg { peer, msg } => drain.handle_msg(peer, &msg),
                    // The outcome is decided; neither changes when the blocks are free.
                    Event::ChunkReady { .. }
                    | Event::PeerDead { .. }
                    | Event::PlanFailed { .. }
                    | Event::TicketGrant { .. }
                    | Event::TicketRefused { .. } => {}
                }
                self.advance_drain(now);
                Ok(())
            }
            State::Finished(_) => Ok(()),
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        match &mut self.state {
            State::Live(live) => {
                if live.ops.iter().any(|op| now >= op.deadline) {
                    // The transport did not report within its bound: the write
                    // can no longer land, and it failed.
                    live.ops.retain(|op| now < op.deadline);
                    self.end(now, End::Fail(FailReason::Transport));
                    return;
                }
                let all_known = live
                    .receivers_expected
                    .is_some_and(|n| n as usize == live.peers.len());
                if !all_known && now >= live.bootstrap_deadline {
                    self.end(now, End::Expire);
                    return;
                }
                let live_ref = match &self.state {
                    State::Live(l) => l,
                    State::Draining(_) | State::Finished(_) => return,
                };
                if self.claim_deadline(live_ref).is_some_and(|d| now >= d) {
                    self.end(now, End::Expire);
                    return;
                }
                let due: Vec<PeerId> = live_ref
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
                    self.request_lease(now, peer);
                }
                // A lease may have run out: nothing to do, posting stops by itself.
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
                let all_known = live
                    .receivers_expected
                    .is_some_and(|n| n as usize == live.peers.len());
                let mut t = live.ops.iter().map(|op| op.deadline).min();
                if !all_known {
                    t = earliest(t, Some(live.bootstrap_deadline));
                }
                t = earliest(t, self.claim_deadline(live));
                for p in &live.peers {
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
                let all_known = live
                    .receivers_expected
                    .is_some_and(|n| n as usize == live.peers.len());
                if !all_known {
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
