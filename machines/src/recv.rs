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
    Msg, Next, PeerId, Phase, Posted, Resend, TouchLease, TransferId, TICKET_BIT,
};
use crate::machine::Machine;

/// One P rank this D rank must hear from, as the pairing helper says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResolvedPeer {
    /// The P rank.
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
    PeersResolved {
        /// The P ranks, with what each expects.
        peers: Vec<ResolvedPeer>,
        /// P ranks no D rank reads from that this rank tells so
        /// (`Unneeded`), by the rule that covers each exactly once.
        unneeded: Vec<PeerId>,
    },
    /// A control message from P rank `peer`.
    Msg {
        /// The peer, as the driver names it.
        peer: PeerId,
        /// The message.
        msg: Msg,
    },
    /// Pull mode: the transport finished the read of `chunk` from `peer`.
    ReadDone {
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
    /// The layouts of `peer` pair only by a rule kvferry does not
    /// implement (`PlanError::Unsupported`): the transfer fails
    /// [`FailReason::Unsupported`].
    Unsupported {
        /// The peer, as the driver names it.
        peer: PeerId,
    },
}

/// Outputs of a [`RecvMachine`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send `msg` to P rank `peer` for this transfer.
    Send {
        /// The peer, as the driver names it.
        peer: PeerId,
        /// The message.
        msg: Msg,
    },
    /// Send `msg` to P rank `peer` again: its answer may have been lost
    /// (see `Config::resend_after`). Carried like [`Action::Send`]; the
    /// driver counts it apart.
    Resend {
        /// The peer, as the driver names it.
        peer: PeerId,
        /// The message.
        msg: Msg,
    },
    /// Pull mode: read `src_blocks` (the peer's) into `dst_blocks` (ours),
    /// same lengths per group, then report [`Event::ReadDone`].
    Read {
        /// The peer, as the driver names it.
        peer: PeerId,
        /// The chunk index.
        chunk: u32,
        /// Source blocks, per group.
        src_blocks: BlockLists,
        /// Destination blocks, per group.
        dst_blocks: BlockLists,
    },
    /// Every paired P rank delivered: the KV is in the destination blocks.
    Received,
    /// The transfer failed; `block_ids` (all destination blocks of this
    /// transfer) hold no valid KV and may be reused now.
    LoadFailed {
        /// The destination blocks, which hold no valid KV.
        block_ids: Vec<BlockId>,
    },
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
    /// How many D ranks contact this P rank (repeated in a resent `Pull`).
    receivers_expected: u16,
    role: Role,
    /// When this rank sends its `Pull` again, until the peer finished.
    resend: Resend,
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
    ops: Vec<Posted>,
}

#[derive(Clone, Debug)]
enum State {
    /// P ranks not resolved yet.
    Bootstrapping {
        /// When the bootstrap timeout fails the request.
        deadline: Instant,
    },
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
    /// The unpaired P ranks this rank told `Unneeded`; told again when the
    /// request ends, in case the first word was lost.
    unneeded: Vec<PeerId>,
}

/// What a handler of an active request uses besides [`Active`]: the
/// machine's settings and destination, the time of the input and the
/// action queue, borrowed apart from the machine's state.
struct Cx<'a> {
    cfg: &'a Config,
    now: Instant,
    dst_blocks: &'a BlockLists,
    prefix_blocks: &'a [u32],
    actions: &'a mut VecDeque<Action>,
}

impl Cx<'_> {
    fn send(&mut self, peer: PeerId, msg: Msg) {
        self.actions.push_back(Action::Send { peer, msg });
    }

    /// The waiting deadline restarted by progress seen now.
    fn waiting_deadline(&self) -> Instant {
        after(self.now, self.cfg.waiting_timeout)
    }
}

/// A peer's layouts or block lists do not fit ours.
struct BadMetadata;

/// Handlers of the inputs of an active request. None changes the state;
/// each says what the machine does next ([`Next`]).
impl Active {
    fn handle_event(&mut self, cx: &mut Cx, event: Event) -> Result<Next, InputError> {
        match event {
            Event::PeersResolved { .. } => Err(InputError::Misuse("peers resolved twice")),
            Event::ReadDone { peer, chunk, ok } => self.handle_read_done(cx, peer, chunk, ok),
            Event::PeerDead { peer } => {
                if self.peers.iter().any(|p| p.id == peer && !p.is_finished()) {
                    Ok(Next::End(End::Fail(FailReason::PeerDead)))
                } else {
                    Ok(Next::Stay)
                }
            }
            Event::PlanFailed { peer } => Ok(self.handle_verdict(peer, FailReason::BadMetadata)),
            Event::Unsupported { peer } => Ok(self.handle_verdict(peer, FailReason::Unsupported)),
            Event::Msg { peer, msg } => self.handle_msg(cx, peer, msg),
        }
    }

    /// The driver's verdict on the layouts of `peer`.
    fn handle_verdict(&self, peer: PeerId, reason: FailReason) -> Next {
        if self.peers.iter().any(|p| p.id == peer) {
            Next::End(End::Fail(reason))
        } else {
            Next::Stay
        }
    }

    fn handle_read_done(
        &mut self,
        cx: &Cx,
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
                "completion of a read that is not in flight",
            ));
        };
        self.ops.swap_remove(i);
        if !ok {
            return Ok(Next::End(End::Fail(FailReason::Transport)));
        }
        if let Some(p) = self.peers.iter_mut().find(|p| p.id == peer) {
            p.resend.restart(cx.now, cx.cfg);
            if let Role::Toucher { chunks, .. } = &mut p.role {
                if let Some(Some(c)) = chunks.get_mut(chunk as usize) {
                    c.state = ReadState::Done;
                }
            }
        }
        self.waiting_deadline = cx.waiting_deadline();
        Ok(Next::Progress)
    }

    fn handle_msg(&mut self, cx: &mut Cx, peer: PeerId, msg: Msg) -> Result<Next, InputError> {
        let Some(i) = self.peers.iter().position(|p| p.id == peer) else {
            return Err(InputError::Peer(
                "message from a P rank not paired with this transfer",
            ));
        };
        let next = self.handle_peer_msg(cx, i, msg)?;
        // Heard only once the message was taken: refused junk changes nothing.
        self.peers[i].resend.heard(cx.now, cx.cfg);
        Ok(next)
    }

    fn handle_peer_msg(&mut self, cx: &mut Cx, i: usize, msg: Msg) -> Result<Next, InputError> {
        match msg {
            Msg::LeaseRequest { seq } => self.handle_lease_request(cx, i, seq),
            Msg::Status { ok } => self.handle_status(cx, i, ok),
            Msg::LeaseGrant { seq, duration_ms } => {
                self.handle_lease_grant(cx, i, seq, duration_ms)
            }
            Msg::Ready {
                chunk,
                start_blocks,
                src_blocks,
                is_last,
            } => self.handle_ready(cx, i, chunk, start_blocks, src_blocks, is_last),
            Msg::Abort => Ok(self.handle_abort(i)),
            Msg::AbortAck => Err(InputError::Peer("AbortAck while nothing was aborted")),
            Msg::NotPaired => Ok(Next::End(End::PeerRefused(self.peers[i].id))),
            Msg::Pull { .. } | Msg::Done { .. } | Msg::Unneeded => {
                Err(InputError::Peer("message D never receives"))
            }
        }
    }

    /// Push mode: the peer at `i` renews the lease on our blocks.
    fn handle_lease_request(
        &mut self,
        cx: &mut Cx,
        i: usize,
        seq: u64,
    ) -> Result<Next, InputError> {
        let p = &mut self.peers[i];
        match &mut p.role {
            Role::Granter { lease, finished } => {
                if !*finished {
                    let msg = lease.grant(cx.now, seq, cx.cfg.lease);
                    cx.send(p.id, msg);
                }
                Ok(Next::Stay)
            }
            Role::Toucher { .. } => Err(InputError::Peer("lease request in pull mode")),
        }
    }

    /// Push mode: the peer at `i` returns its lease; its writes are over.
    fn handle_status(&mut self, cx: &Cx, i: usize, ok: bool) -> Result<Next, InputError> {
        let p = &mut self.peers[i];
        match &mut p.role {
            Role::Granter { finished: true, .. } => Ok(Next::Stay),
            Role::Granter { finished, .. } => {
                if ok {
                    *finished = true;
                    p.resend.stop();
                    self.waiting_deadline = cx.waiting_deadline();
                    Ok(Next::Progress)
                } else {
                    Ok(Next::End(End::PeerFailed(p.id, FailReason::PeerReported)))
                }
            }
            Role::Toucher { .. } => Err(InputError::Peer("Status in pull mode")),
        }
    }

    /// Pull mode: the peer at `i` granted the lease on its blocks.
    fn handle_lease_grant(
        &mut self,
        cx: &Cx,
        i: usize,
        seq: u64,
        duration_ms: u64,
    ) -> Result<Next, InputError> {
        match &mut self.peers[i].role {
            Role::Toucher { lease, .. } => {
                lease.check_grant(seq)?;
                lease.handle_grant(seq, duration_ms, cx.cfg);
                Ok(Next::Progress)
            }
            Role::Granter { .. } => Err(InputError::Peer("lease grant in push mode")),
        }
    }

    /// Pull mode: the peer at `i` announces a chunk to read.
    fn handle_ready(
        &mut self,
        cx: &mut Cx,
        i: usize,
        chunk: u32,
        start_blocks: Vec<u32>,
        src_blocks: BlockLists,
        is_last: bool,
    ) -> Result<Next, InputError> {
        let peer = &mut self.peers[i];
        let Role::Toucher {
            chunks,
            last,
            finished,
            ..
        } = &mut peer.role
        else {
            return Err(InputError::Peer("Ready in push mode"));
        };
        let idx = chunk as usize;
        if idx >= cx.cfg.max_chunks {
            return Err(InputError::Peer("chunk index over max_chunks"));
        }
        if !check_lists(&src_blocks, cx.cfg) || start_blocks.len() != src_blocks.len() {
            return Err(InputError::Peer(
                "source block list malformed or over bounds",
            ));
        }
        if let Some(Some(c)) = chunks.get(idx) {
            if c.start_blocks != start_blocks
                || c.src_blocks != src_blocks
                || (*last == Some(chunk)) != is_last
            {
                return Err(InputError::Peer("chunk announced twice with other content"));
            }
            if *finished {
                // P resends its last `Ready` while it waits for our
                // `Done`: that one was lost.
                cx.actions.push_back(Action::Resend {
                    peer: peer.id,
                    msg: Msg::Done { ok: true },
                });
            }
            return Ok(Next::Stay);
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
        peer.resend.restart(cx.now, cx.cfg);
        self.waiting_deadline = cx.waiting_deadline();
        Ok(Next::Progress)
    }

    fn handle_abort(&self, i: usize) -> Next {
        let p = &self.peers[i];
        if p.is_finished() {
            // This peer already delivered everything and returned its
            // lease: its `Abort` is stale (its driver answering a
            // duplicated `Pull` after it ended, say). If the request
            // is really gone, the peers still at work abort as well.
            return Next::Stay;
        }
        Next::End(End::PeerAbort(p.id))
    }

    /// Time passed: a read past its bound, the waiting deadline, or a
    /// lease to renew.
    fn handle_timeout(&mut self, cx: &mut Cx) -> Next {
        let now = cx.now;
        if self.ops.iter().any(|op| now >= op.deadline) {
            // The transport did not report within its bound: the read
            // can no longer touch memory, and it failed.
            self.ops.retain(|op| now < op.deadline);
            return Next::End(End::Fail(FailReason::Transport));
        }
        if now >= self.waiting_deadline {
            return Next::End(End::Expire);
        }
        for p in &mut self.peers {
            if let Role::Toucher {
                lease,
                finished: false,
                ..
            } = &mut p.role
            {
                if lease.renew_at().is_some_and(|r| now >= r) {
                    let seq = lease.request(now, cx.cfg);
                    cx.send(p.id, Msg::LeaseRequest { seq });
                }
            }
        }
        for p in &mut self.peers {
            if !p.is_finished() && p.resend.fire(now, cx.cfg) {
                let lease_seq = match &mut p.role {
                    // The resent `Pull` also asks for a lease, as the first did.
                    Role::Toucher { lease, .. } => Some(lease.request(now, cx.cfg)),
                    // Push: without a ticket P asks for the lease itself.
                    Role::Granter { .. } => None,
                };
                let msg = pull_msg(cx, p.receivers_expected, lease_seq);
                cx.actions.push_back(Action::Resend { peer: p.id, msg });
            }
        }
        Next::Stay
    }

    /// Pull mode: posts the reads that can be posted from every peer and
    /// returns the leases of the peers whose KV all landed.
    fn post_reads(&mut self, cx: &mut Cx) -> Result<(), BadMetadata> {
        for p in &mut self.peers {
            read_from_peer(p, &mut self.ops, cx)?;
        }
        Ok(())
    }
}

/// Pull mode: posts the reads from `p` that its lease and the in-flight
/// bound allow, and returns its lease (`Done{ok: true}`) once every chunk
/// was read.
fn read_from_peer(p: &mut Peer, ops: &mut Vec<Posted>, cx: &mut Cx) -> Result<(), BadMetadata> {
    let Role::Toucher {
        lease,
        chunks,
        last,
        finished,
    } = &mut p.role
    else {
        return Ok(());
    };
    if *finished {
        return Ok(());
    }
    if let Some(Some(c)) = last.and_then(|l| chunks.get(l as usize)) {
        let end = chunk_end(&c.start_blocks, &c.src_blocks);
        if !covers_exactly(&end, cx.dst_blocks, cx.prefix_blocks) {
            return Err(BadMetadata);
        }
    }
    for (idx, slot) in chunks.iter_mut().enumerate() {
        let Some(c) = slot else { continue };
        match c.state {
            ReadState::Posted | ReadState::Done => continue,
            ReadState::Pending => {}
        }
        if !lease.is_live(cx.now) {
            break;
        }
        let (src, dst) = align_chunk(
            &c.start_blocks,
            &c.src_blocks,
            cx.dst_blocks,
            cx.prefix_blocks,
        )
        .ok_or(BadMetadata)?;
        if is_empty_lists(&src) {
            c.state = ReadState::Done;
            continue;
        }
        if ops.len() >= cx.cfg.max_in_flight {
            break;
        }
        c.state = ReadState::Posted;
        ops.push(Posted {
            peer: p.id,
            chunk: idx as u32,
            deadline: after(cx.now, cx.cfg.transfer_bound),
        });
        cx.actions.push_back(Action::Read {
            peer: p.id,
            chunk: idx as u32,
            src_blocks: src,
            dst_blocks: dst,
        });
    }
    let complete = last.is_some_and(|l| chunks.len() == l as usize + 1)
        && chunks
            .iter()
            .all(|c| c.as_ref().is_some_and(|c| c.state == ReadState::Done));
    if complete {
        *finished = true;
        p.resend.stop();
        cx.send(p.id, Msg::Done { ok: true });
    }
    Ok(())
}

/// The `Pull` this rank sends (and resends) to a P rank.
fn pull_msg(cx: &Cx, receivers_expected: u16, lease_seq: Option<u64>) -> Msg {
    Msg::Pull {
        receivers_expected,
        dst_blocks: cx.dst_blocks.clone(),
        prefix_blocks: cx.prefix_blocks.to_vec(),
        lease_seq,
    }
}

/// Checks the P ranks the driver resolved.
fn check_resolved(
    peers: &[ResolvedPeer],
    unneeded: &[PeerId],
    cfg: &Config,
) -> Result<(), InputError> {
    if peers.is_empty() || peers.len() > cfg.max_peers || unneeded.len() > cfg.max_peers {
        return Err(InputError::Misuse("number of P ranks out of range"));
    }
    if (unneeded.iter().enumerate())
        .any(|(i, u)| unneeded[..i].contains(u) || peers.iter().any(|p| p.peer == *u))
    {
        return Err(InputError::Misuse("a P rank listed twice"));
    }
    for (i, p) in peers.iter().enumerate() {
        if peers[..i].iter().any(|q| q.peer == p.peer) {
            return Err(InputError::Misuse("a P rank listed twice"));
        }
        if p.receivers_expected == 0 || p.receivers_expected as usize > cfg.max_peers {
            return Err(InputError::Misuse("receivers_expected out of range"));
        }
    }
    Ok(())
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
            unneeded: Vec::new(),
        })
    }

    /// The transfer this machine moves.
    pub fn transfer_id(&self) -> TransferId {
        self.transfer_id
    }

    /// Push or pull.
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
        unneeded: Vec<PeerId>,
    ) -> Result<(), InputError> {
        match self.state {
            State::Bootstrapping { .. } => {}
            State::Active(_) => return Err(InputError::Misuse("peers resolved twice")),
            State::Draining(_) | State::Finished(_) => return Ok(()),
        }
        check_resolved(&peers, &unneeded, &self.cfg)?;
        for &peer in &unneeded {
            self.actions.push_back(Action::Send {
                peer,
                msg: Msg::Unneeded,
            });
        }
        if self.cfg.max_resends > 0 {
            self.unneeded = unneeded;
        }
        let mut active = Active {
            peers: Vec::with_capacity(peers.len()),
            waiting_deadline: after(now, self.cfg.waiting_timeout),
            ops: Vec::new(),
        };
        for rp in peers {
            let peer = self.contact(now, rp);
            active.peers.push(peer);
        }
        self.state = State::Active(active);
        Ok(())
    }

    /// Sends `Pull` to `rp` (in push mode followed by the grant answering
    /// its lease ticket, if any) and returns what this rank keeps of it.
    fn contact(&mut self, now: Instant, rp: ResolvedPeer) -> Peer {
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
        let (_, cx) = self.split(now);
        let pull = pull_msg(&cx, rp.receivers_expected, lease_seq);
        self.send(rp.peer, pull);
        if let Some(msg) = ticket_grant {
            self.send(rp.peer, msg);
        }
        let mut resend = Resend::idle();
        resend.restart(now, &self.cfg);
        Peer {
            id: rp.peer,
            receivers_expected: rp.receivers_expected,
            role,
            resend,
        }
    }

    /// The machine's state and, borrowed apart from it, what the handlers
    /// of an active request use.
    fn split(&mut self, now: Instant) -> (&mut State, Cx<'_>) {
        let RecvMachine {
            cfg,
            dst_blocks,
            prefix_blocks,
            state,
            actions,
            ..
        } = self;
        let cx = Cx {
            cfg,
            now,
            dst_blocks,
            prefix_blocks,
            actions,
        };
        (state, cx)
    }

    /// Carries out what a handler of an active request decided.
    fn apply(&mut self, now: Instant, next: Next) {
        match next {
            Next::Stay => {}
            Next::Progress => self.progress(now),
            Next::End(end) => self.end(now, end),
        }
    }

    /// Posts the reads that can be posted, returns finished leases and
    /// completes the transfer when every peer is finished.
    fn progress(&mut self, now: Instant) {
        let (State::Active(active), mut cx) = self.split(now) else {
            return;
        };
        if active.post_reads(&mut cx).is_err() {
            self.end(now, End::Fail(FailReason::BadMetadata));
        } else if active.peers.iter().all(Peer::is_finished) {
            self.finish(Phase::Success);
        }
    }

    fn finish(&mut self, outcome: Phase) {
        self.state = State::Finished(outcome);
        for peer in std::mem::take(&mut self.unneeded) {
            self.actions.push_back(Action::Resend {
                peer,
                msg: Msg::Unneeded,
            });
        }
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
        let (state, mut cx) = self.split(now);
        match state {
            State::Bootstrapping { .. } => match event {
                Event::PeersResolved { peers, unneeded } => {
                    self.handle_resolved(now, peers, unneeded)
                }
                Event::Msg { .. } => {
                    Err(InputError::Peer("message before any P rank was contacted"))
                }
                Event::ReadDone { .. } => Err(InputError::Misuse(
                    "completion of a read that is not in flight",
                )),
                Event::PeerDead { .. } | Event::PlanFailed { .. } | Event::Unsupported { .. } => {
                    Ok(())
                }
            },
            State::Active(active) => {
                let next = active.handle_event(&mut cx, event)?;
                self.apply(now, next);
                Ok(())
            }
            State::Draining(drain) => {
                match event {
                    Event::ReadDone { peer, chunk, .. } => drain.handle_completion(peer, chunk),
                    Event::Msg { peer, msg } => drain.handle_msg(peer, &msg),
                    // The outcome is decided; none of these frees the blocks sooner.
                    Event::PeersResolved { .. }
                    | Event::PeerDead { .. }
                    | Event::PlanFailed { .. }
                    | Event::Unsupported { .. } => {}
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
            State::Bootstrapping { deadline } => {
                if now >= *deadline {
                    self.end(now, End::Expire);
                }
            }
            State::Active(active) => {
                let next = active.handle_timeout(&mut cx);
                self.apply(now, next);
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
