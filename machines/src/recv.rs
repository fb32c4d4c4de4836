//! `RecvMachine`: the decode side of one transfer on one D rank.
//!
//! # Contract
//!
//! * Create it with [`RecvMachine::new`] once the engine allocated the
//!   destination blocks. It starts in `Bootstrapping` until the driver
//!   resolved the P ranks to contact ([`Event::PeersResolved`], from the
//!   bootstrap service and the pairing helper).
//! * Feed [`Event`]s: P's messages ([`Event::Msg`]), completions of the reads
//!   it asked for ([`Event::ReadDone`], pull mode), and the driver's verdicts
//!   ([`Event::PeerDead`], [`Event::PlanFailed`]).
//! * Drain [`Action`]s after every input: send a message, post a read (pull
//!   mode), and exactly once the outcome: [`Action::Received`] or
//!   [`Action::LoadFailed`]. After either, the destination blocks are the
//!   engine's again: no P write or D read can touch them anymore.
//! * Messages come from the P ranks listed in `PeersResolved` only; the
//!   driver maps each sender to the [`PeerId`] it used there.
//! * [`RecvMachine::phase`] turns terminal in the same call that queues the
//!   outcome. While a failed transfer waits for leases to run out plus the
//!   fence (the D-side fence), the phase stays `Transferring`.
//!
//! In push mode D is the *granter*: P ranks write into D's blocks under
//! leases D grants, and D reuses its blocks only after every P rank returned
//! its lease (`Status`, `Abort`, `AbortAck`) or the lease ran out plus the
//! fence. In pull mode D is the *toucher*: it reads P's blocks under P's
//! lease and returns it with `Done` once its reads are over.

use std::collections::VecDeque;
use std::time::Instant;

use crate::common::{
    after, align_chunk, check_lists, chunk_end, covers_exactly, earliest, is_empty_lists,
    AbortReason, BlockId, BlockLists, Config, Drain, End, FailReason, GrantLease, InputError, Mode,
    Msg, Op, PeerId, Phase, TouchLease, TransferId, TICKET_BIT,
};
use crate::machine::Machine;

/// One P rank this D rank must hear from, as the pairing helper says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResolvedPeer {
    pub peer: PeerId,
    /// How many D ranks (this one included) contact that P rank for this transfer.
    pub receivers_expected: u16,
    /// Push mode: a lease ticket from that P rank (see
    /// [`crate::common::TICKET_BIT`]); with one, the `Pull` is followed at
    /// once by a grant answering it, so P need not ask.
    pub lease_ticket: Option<u64>,
}

/// Inputs of a [`RecvMachine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The P ranks to contact (once).
    PeersResolved { peers: Vec<ResolvedPeer> },
    /// A control message from P rank `peer`.
    Msg { peer: PeerId, msg: Msg },
    /// Pull mode: the transport finished the read of `chunk` from `peer`.
    ReadDone { peer: PeerId, chunk: u32, ok: bool },
    /// The driver declared `peer` dead (missed heartbeats, connection lost).
    PeerDead { peer: PeerId },
    /// The planner rejected the layouts or block lists of `peer`.
    PlanFailed { peer: PeerId },
}

/// Outputs of a [`RecvMachine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send `msg` to P rank `peer` for this transfer.
    Send { peer: PeerId, msg: Msg },
    /// Pull mode: read `src_blocks` (the peer's) into `dst_blocks` (ours),
    /// same lengths per group, then report [`Event::ReadDone`].
    Read {
        peer: PeerId,
        chunk: u32,
        src_blocks: BlockLists,
        dst_blocks: BlockLists,
    },
    /// Every paired P rank delivered: the KV is in the destination blocks.
    Received,
    /// The transfer failed; `block_ids` (all destination blocks of this
    /// transfer) hold no valid KV and may be reused now.
    LoadFailed { block_ids: Vec<BlockId> },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ReadState {
    Pending,
    Posted,
    Done,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct RemoteChunk {
    start_blocks: Vec<u32>,
    src_blocks: BlockLists,
    state: ReadState,
}

#[derive(Clone, Debug)]
enum Role {
    /// Push: the peer writes our blocks under our lease.
    Granter {
        lease: GrantLease,
        /// True once the peer returned its lease with `Status{ok: true}`.
        finished: bool,
    },
    /// Pull: we read the peer's blocks under its lease.
    Toucher {
        lease: TouchLease,
        /// Chunks announced by the peer, by index.
        chunks: Vec<Option<RemoteChunk>>,
        last: Option<u32>,
        /// True once `Done{ok: true}` went out (the lease is returned).
        finished: bool,
    },
}

#[derive(Clone, Debug)]
struct Peer {
    id: PeerId,
    role: Role,
}

impl Peer {
    fn is_finished(&self) -> bool {
        match &self.role {
            Role::Granter { finished, .. } | Role::Toucher { finished, .. } => *finished,
        }
    }
}

#[derive(Clone, Debug)]
struct Active {
    peers: Vec<Peer>,
    waiting_deadline: Instant,
    /// Pull mode: reads posted and not completed.
    ops: Vec<Op>,
}

#[derive(Clone, Debug)]
enum State {
    /// P ranks not resolved yet.
    Bootstrapping { deadline: Instant },
    /// `Pull` sent: WaitingForInput, then Transferring.
    Active(Active),
    /// Outcome decided; the fence: waiting until nothing can touch the blocks.
    Draining(Drain),
    /// Outcome reported; absorbs every later input.
    Finished(Phase),
}

/// Decode-side state machine of one transfer on one D rank. See the module docs.
#[derive(Clone, Debug)]
pub struct RecvMachine {
    cfg: Config,
    transfer_id: TransferId,
    mode: Mode,
    dst_blocks: BlockLists,
    prefix_blocks: Vec<u32>,
    state: State,
    actions: VecDeque<Action>,
}

impl RecvMachine {
    /// A machine for `transfer_id` on this D rank, in `Bootstrapping`.
    /// `dst_blocks` are the destination blocks per group; `prefix_blocks`
    /// per group how many of P's leading blocks D already holds (prefix hit).
    pub fn new(
        now: Instant,
        config: &Config,
        transfer_id: TransferId,
        mode: Mode,
        dst_blocks: BlockLists,
        prefix_blocks: Vec<u32>,
    ) -> Result<Self, InputError> {
        if !check_lists(&dst_blocks, config) {
            return Err(InputError::Misuse(
                "destination block list over the configured bounds",
            ));
        }
        if prefix_blocks.len() != dst_blocks.len() {
            return Err(InputError::Misuse(
                "prefix_blocks and dst_blocks differ in group count",
            ));
        }
        Ok(RecvMachine {
            cfg: *config,
            transfer_id,
            mode,
            dst_blocks,
            prefix_blocks,
            state: State::Bootstrapping {
                deadline: after(now, config.bootstrap_timeout),
            },
            actions: VecDeque::new(),
        })
    }

    pub fn transfer_id(&self) -> TransferId {
        self.transfer_id
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// True once `Received` or `LoadFailed` was queued.
    pub fn is_reported(&self) -> bool {
        match self.state {
            State::Bootstrapping { .. } | State::Active(_) | State::Draining(_) => false,
            State::Finished(_) => true,
        }
    }

    fn send(&mut self, peer: PeerId, msg: Msg) {
        self.actions.push_back(Action::Send { peer, msg });
    }

    fn handle_resolved(
        &mut self,
        now: Instant,
        peers: Vec<ResolvedPeer>,
    ) -> Result<(), InputError> {
        match self.state {
            State::Bootstrapping { .. } => {}
            State::Active(_) => return Err(InputError::Misuse("peers resolved twice")),
            State::Draining(_) | State::Finished(_) => return Ok(()),
        }
        if peers.is_empty() || peers.len() > self.cfg.max_peers {
            return Err(InputError::Misuse("number of P ranks out of range"));
        }
        for (i, p) in peers.iter().enumerate() {
            if peers[..i].iter().any(|q| q.peer == p.peer) {
                return Err(InputError::Misuse("a P rank listed twice"));
            }
            if p.receivers_expected == 0 || p.receivers_expected as usize > self.cfg.max_peers {
                return Err(InputError::Misuse("receivers_expected out of range"));
            }
        }
        let mut active = Active {
            peers: Vec::with_capacity(peers.len()),
            waiting_deadline: after(now, self.cfg.waiting_timeout),
            ops: Vec::new(),
        };
        for rp in peers {
            let mut ticket_grant = None;
            let (role, lease_seq) = match self.mode {
                Mode::Push => {
                    let mut lease = GrantLease::new();
                    if let Some(t) = rp.lease_ticket {
                        ticket_grant = Some(lease.grant(now, t | TICKET_BIT, self.cfg.lease));
                    }
                    (
                        Role::Granter {
                            lease,
                            finished: false,
                        },
                        rp.lease_ticket,
                    )
                }
                Mode::Pull => {
                    let mut lease = TouchLease::new();
                    let seq = lease.request(now, &self.cfg);
                    (
                        Role::Toucher {
                            lease,
                            chunks: Vec::new(),
                            last: None,
                            finished: false,
                        },
                        Some(seq),
                    )
                }
            };
            self.actions.push_back(Action::Send {
                peer: rp.peer,
                msg: Msg::Pull {
                    receivers_expected: rp.receivers_expected,
                    dst_blocks: self.dst_blocks.clone(),
                    prefix_blocks: self.prefix_blocks.clone(),
                    lease_seq,
                },
            });
            if let Some(msg) = ticket_grant {
                self.actions.push_back(Action::Send { peer: rp.peer, msg });
            }
            active.peers.push(Peer { id: rp.peer, role });
        }
        self.state = State::Active(active);
        Ok(())
    }

    fn handle_active(&mut self, now: Instant, event: Event) -> Result<(), InputError> {
        let cfg = self.cfg;
        let State::Active(active) = &mut self.state else {
            unreachable!("handle_active on a machine that is not active");
        };
        match event {
            Event::PeersResolved { .. } => Err(InputError::Misuse("peers resolved twice")),
            Event::ReadDone { peer, chunk, ok } => {
                let Some(i) = active
                    .ops
                    .iter()
                    .position(|op| op.peer == peer && op.chunk == chunk)
                else {
                    return Err(InputError::Misuse(
                        "completion of a read that is not in flight",
                    ));
                };
                active.ops.swap_remove(i);
                if !ok {
                    self.end(now, End::Fail(FailReason::Transport));
                    return Ok(());
                }
                if let Some(p) = active.peers.iter_mut().find(|p| p.id == peer) {
                    if let Role::Toucher { chunks, .. } = &mut p.role {
                        if let Some(Some(c)) = chunks.get_mut(chunk as usize) {
                            c.state = ReadState::Done;
                        }
                    }
                }
                active.waiting_deadline = after(now, cfg.waiting_timeout);
                self.progress(now);
                Ok(())
            }
            Event::PeerDead { peer } => {
                if active
                    .peers
                    .iter()
                    .any(|p| p.id == peer && !p.is_finished())
                {
                    self.end(now, End::Fail(FailReason::PeerDead));
                }
                Ok(())
            }
            Event::PlanFailed { peer } => {
                if active.peers.iter().any(|p| p.id == peer) {
                    self.end(now, End::Fail(FailReason::BadMetadata));
                }
                Ok(())
            }
            Event::Msg { peer, msg } => {
                let Some(i) = active.peers.iter().position(|p| p.id == peer) else {
                    return Err(InputError::Peer(
                        "message from a P rank not paired with this transfer",
                    ));
                };
                let p = &mut active.peers[i];
                match msg {
                    Msg::LeaseRequest { seq } => match &mut p.role {
                        Role::Granter { lease, finished } => {
                            if !*finished {
                                let msg = lease.grant(now, seq, cfg.lease);
                                self.send(peer, msg);
                            }
                            Ok(())
                        }
                        Role::Toucher { .. } => Err(InputError::Peer("lease request in pull mode")),
                    },
                    Msg::Status { ok } => match &mut p.role {
                        Role::Granter { finished: true, .. } => Ok(()),
                        Role::Granter { finished, .. } => {
                            if ok {
                                *finished = true;
                                active.waiting_deadline = after(now, cfg.waiting_timeout);
                                self.progress(now);
                            } else {
                                self.end(now, End::PeerFailed(peer));
                            }
                            Ok(())
                        }
                        Role::Toucher { .. } => Err(InputError::Peer("Status in pull mode")),
                    },
                    Msg::LeaseGrant { seq, duration_ms } => match &mut p.role {
                        Role::Toucher { lease, .. } => {
                            lease.check_grant(seq)?;
                            lease.handle_grant(seq, duration_ms, &cfg);
                            self.progress(now);
                            Ok(())
                        }
                        Role::Granter { .. } => Err(InputError::Peer("lease grant in push mode")),
                    },
                    Msg::Ready {
                        chunk,
                        start_blocks,
                        src_blocks,
                        is_last,
                    } => {
                        let Role::Toucher {
                            chunks,
                            last,
                            finished,
                            ..
                        } = &mut p.role
                        else {
                            return Err(InputError::Peer("Ready in push mode"));
                        };
                        let idx = chunk as usize;
                        if idx >= cfg.max_chunks {
                            return Err(InputError::Peer("chunk index over max_chunks"));
                        }
                        if !check_lists(&src_blocks, &cfg) || start_blocks.len() != src_blocks.len()
                        {
                            return Err(InputError::Peer(
                                "source block list malformed or over bounds",
                            ));
                        }
                        if let Some(Some(c)) = chunks.get(idx) {
                            if c.start_blocks != start_blocks
                                || c.src_blocks != src_blocks
                                || (*last == Some(chunk)) != is_last
                            {
                                return Err(InputError::Peer(
                                    "chunk announced twice with other content",
                                ));
                            }
                            return Ok(());
                        }
                        if last.is_some_and(|l| chunk > l) {
                            return Err(InputError::Peer("chunk after the last chunk"));
                        }
                        if is_last && (last.is_some() || chunks.len() > idx + 1) {
                            return Err(InputError::Peer("second last chunk"));
                        }
                        if *finished {
                            return Err(InputError::Peer("chunk after the transfer finished"));
                        }
                        if chunks.len() <= idx {
                            chunks.resize(idx + 1, None);
                        }
                        chunks[idx] = Some(RemoteChunk {
                            start_blocks,
                            src_blocks,
                            state: ReadState::Pending,
                        });
                        if is_last {
                            *last = Some(chunk);
                        }
                        active.waiting_deadline = after(now, cfg.waiting_timeout);
                        self.progress(now);
                        Ok(())
                    }
                    Msg::Abort => {
                        if p.is_finished() {
                            // This peer already delivered everything and returned its
                            // lease: its `Abort` is stale (its driver answering a
                            // duplicated `Pull` after it ended, say). If the request
                            // is really gone, the peers still at work abort as well.
                            return Ok(());
                        }
                        self.end(now, End::PeerAbort(peer));
                        Ok(())
                    }
                    Msg::AbortAck => Err(InputError::Peer("AbortAck while nothing was aborted")),
                    Msg::Pull { .. } | Msg::Done { .. } => {
                        Err(InputError::Peer("message D never receives"))
                    }
                }
            }
        }
    }

    /// Posts the reads that can be posted, returns finished leases and
    /// completes the transfer when every peer is finished.
    fn progress(&mut self, now: Instant) {
        let cfg = self.cfg;
        let State::Active(active) = &mut self.state else {
            return;
        };
        let mut bad_metadata = false;
        for p in &mut active.peers {
            let Role::Toucher {
                lease,
                chunks,
                last,
                finished,
            } = &mut p.role
            else {
                continue;
            };
            if *finished {
                continue;
            }
            if let Some(Some(c)) = last.and_then(|l| chunks.get(l as usize)) {
                let end = chunk_end(&c.start_blocks, &c.src_blocks);
                if !covers_exactly(&end, &self.dst_blocks, &self.prefix_blocks) {
                    bad_metadata = true;
                    break;
                }
            }
            for (idx, slot) in chunks.iter_mut().enumerate() {
                let Some(c) = slot else { continue };
                match c.state {
                    ReadState::Posted | ReadState::Done => continue,
                    ReadState::Pending => {}
                }
                if !lease.is_live(now) {
                    break;
                }
                let Some((src, dst)) = align_chunk(
                    &c.start_blocks,
                    &c.src_blocks,
                    &self.dst_blocks,
                    &self.prefix_blocks,
                ) else {
                    bad_metadata = true;
                    break;
                };
                if is_empty_lists(&src) {
                    c.state = ReadState::Done;
                    continue;
                }
                if active.ops.len() >= cfg.max_in_flight {
                    break;
                }
                c.state = ReadState::Posted;
                active.ops.push(Op {
                    peer: p.id,
                    chunk: idx as u32,
                    deadline: after(now, cfg.transfer_bound),
                });
                self.actions.push_back(Action::Read {
                    peer: p.id,
                    chunk: idx as u32,
                    src_blocks: src,
                    dst_blocks: dst,
                });
            }
            if bad_metadata {
                break;
            }
            let complete = last.is_some_and(|l| chunks.len() == l as usize + 1)
                && chunks
                    .iter()
                    .all(|c| c.as_ref().is_some_and(|c| c.state == ReadState::Done));
            if complete {
                *finished = true;
                self.actions.push_back(Action::Send {
                    peer: p.id,
                    msg: Msg::Done { ok: true },
                });
            }
        }
        if bad_metadata {
            self.end(now, End::Fail(FailReason::BadMetadata));
            return;
        }
        if active.peers.iter().all(Peer::is_finished) {
            self.finish(Phase::Success);
        }
    }

    fn finish(&mut self, outcome: Phase) {
        self.state = State::Finished(outcome);
        let action = match outcome {
            Phase::Success => Action::Received,
            Phase::Bootstrapping
            | Phase::WaitingForInput
            | Phase::Transferring
            | Phase::Failed(_)
            | Phase::Expired => Action::LoadFailed {
                block_ids: self.dst_blocks.iter().flatten().copied().collect(),
            },
        };
        self.actions.push_back(action);
    }

    /// Ends the request: tells the peers and starts the fence.
    fn end(&mut self, now: Instant, end: End) {
        let active = match &mut self.state {
            State::Bootstrapping { .. } => {
                // Nobody was told about this transfer: nothing can touch the blocks.
                self.finish(end.outcome());
                return;
            }
            State::Active(active) => active,
            State::Draining(_) | State::Finished(_) => return,
        };
        let mut drain = end.drain(std::mem::take(&mut active.ops), &self.cfg);
        for p in &active.peers {
            if p.is_finished() {
                continue;
            }
            let granted = match &p.role {
                Role::Granter { lease, .. } => Some(*lease),
                Role::Toucher { .. } => None,
            };
            let failure_return = Msg::Done { ok: false };
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

impl Machine for RecvMachine {
    type Event = Event;
    type Action = Action;

    fn handle_event(&mut self, now: Instant, event: Event) -> Result<(), InputError> {
        match &mut self.state {
            State::Bootstrapping { .. } => match event {
                Event::PeersResolved { peers } => self.handle_resolved(now, peers),
                Event::Msg { .. } => {
                    Err(InputError::Peer("message before any P rank was contacted"))
                }
                Event::ReadDone { .. } => Err(InputError::Misuse(
                    "completion of a read that is not in flight",
                )),
                Event::PeerDead { .. } | Event::PlanFailed { .. } => Ok(()),
            },
            State::Active(_) => self.handle_active(now, event),
            State::Draining(drain) => {
                match event {
                    Event::ReadDone { peer, chunk, .. } => drain.handle_completion(peer, chunk),
                    Event::Msg { peer, msg } => drain.handle_msg(peer, &msg),
                    // The outcome is decided; none of these frees the blocks sooner.
                    Event::PeersResolved { .. }
                    | Event::PeerDead { .. }
                    | Event::PlanFailed { .. } => {}
                }
                self.advance_drain(now);
                Ok(())
            }
            State::Finished(_) => Ok(()),
        }
    }

    fn handle_timeout(&mut self, now: Instant) {
        let cfg = self.cfg;
        match &mut self.state {
            State::Bootstrapping { deadline } => {
                if now >= *deadline {
                    self.end(now, End::Expire);
                }
            }
            State::Active(active) => {
                if active.ops.iter().any(|op| now >= op.deadline) {
                    // The transport did not report within its bound: the read
                    // can no longer touch memory, and it failed.
                    active.ops.retain(|op| now < op.deadline);
                    self.end(now, End::Fail(FailReason::Transport));
                    return;
                }
                if now >= active.waiting_deadline {
                    self.end(now, End::Expire);
                    return;
                }
                for p in &mut active.peers {
                    if let Role::Toucher {
                        lease,
                        finished: false,
                        ..
                    } = &mut p.role
                    {
                        if lease.renew_at().is_some_and(|r| now >= r) {
                            let seq = lease.request(now, &cfg);
                            self.actions.push_back(Action::Send {
                                peer: p.id,
                                msg: Msg::LeaseRequest { seq },
                            });
                        }
                    }
                }
            }
            State::Draining(_) => self.advance_drain(now),
            State::Finished(_) => {}
        }
    }

    fn abort(&mut self, now: Instant, reason: AbortReason) {
        match self.state {
            State::Bootstrapping { .. } | State::Active(_) => {
                self.end(now, End::Fail(FailReason::Aborted(reason)))
            }
            State::Draining(_) | State::Finished(_) => {}
        }
    }

    fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    fn poll_timeout(&self) -> Option<Instant> {
        match &self.state {
            State::Bootstrapping { deadline } => Some(*deadline),
            State::Active(active) => {
                let mut t = active.ops.iter().map(|op| op.deadline).min();
                t = earliest(t, Some(active.waiting_deadline));
                for p in &active.peers {
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
            State::Bootstrapping { .. } => Phase::Bootstrapping,
            State::Active(active) => {
                let any_data = active.peers.iter().any(|p| match &p.role {
                    Role::Granter { lease, finished } => *finished || lease.until.is_some(),
                    Role::Toucher { chunks, .. } => chunks.iter().any(Option::is_some),
                });
                if any_data {
                    Phase::Transferring
                } else {
                    Phase::WaitingForInput
                }
            }
            State::Draining(_) => Phase::Transferring,
            State::Finished(phase) => *phase,
        }
    }
}
