//! The simulated cluster: nodes hosting the real machines, the engines that
//! feed them, the control network, the data plane and the memory it
//! touches, all driven by one event queue on a simulated clock.
//!
//! The world is the machines' driver as docs/design.md §2 describes it: after
//! every input it drains `poll_action`, executes the actions, and arms a
//! timer at `poll_timeout`. Time is microseconds since a base `Instant`;
//! nothing reads a real clock and nothing runs on another thread, so a seed
//! replays exactly.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::time::{Duration, Instant};

use kvferry_machines::internal::common::{
    late_answer, BlockId, BlockLists, Config, Mode, Msg, PeerId, TICKET_BIT,
};
use kvferry_machines::internal::recv::{self, RecvMachine, ResolvedPeer};
use kvferry_machines::internal::send::{self, SendMachine};
use kvferry_machines::{AbortReason, FailReason, Machine, Phase, TransferId};
use kvferry_machines::{DeathCause, Liveness};

use super::checker::{self, us, Kind, Stats, Violation};
use super::memory::{Memory, Owner};
use super::network::{self, Envelope, Network};
use super::rng::Rng;
use super::scenario::{RequestSpec, Scenario, Side, T};

/// Messages a P node keeps for transfers its engine has not created yet.
const PENDING_LIMIT: usize = 256;
/// A run that takes more steps than this is itself a liveness failure.
const STEP_LIMIT: u64 = 5_000_000;

/// What happens at one instant. Within an instant, memory touches go first,
/// then the end of transfer spans, then everything else in a seeded random
/// order: a write that lands at `t` lands before a release at `t`.
#[derive(Clone, Debug)]
enum Ev {
    Arrive(usize),
    CreateP(usize, usize),
    CreateD(usize, usize),
    Resolve(usize, usize),
    Chunk(usize, usize, usize),
    Deliver {
        from: usize,
        to: usize,
        to_epoch: u32,
        bytes: Vec<u8>,
    },
    Timer {
        node: usize,
        epoch: u32,
        tid: TransferId,
        at: T,
    },
    Complete {
        op: u64,
        ok: bool,
    },
    /// One block of a transfer lands: it reads P's block `src` and writes D's block `dst`.
    Touch(Touch),
    SpanEnd {
        op: u64,
    },
    Abort {
        req: usize,
        side: Side,
        rank: usize,
        reason: AbortReason,
    },
    PlanFail {
        req: usize,
        side: Side,
        rank: usize,
    },
    FalseDead {
        req: usize,
        side: Side,
        rank: usize,
    },
    Crash(usize),
    Restart(usize),
    Partition(usize),
    Heal(usize),
    /// `node`'s heartbeat tick (of incarnation `epoch`): it hears the
    /// peers whose frames reach it and asks its liveness table who died.
    Beat {
        node: usize,
        epoch: u32,
    },
    EngineFree {
        node: usize,
        epoch: u32,
        tid: TransferId,
        blocks: Vec<BlockId>,
    },
}

#[derive(Clone, Copy, Debug)]
struct Touch {
    tid: TransferId,
    kind: OpKind,
    p_node: usize,
    p_epoch: u32,
    src: BlockId,
    d_node: usize,
    d_epoch: u32,
    dst: BlockId,
}

struct Entry {
    at: T,
    class: u8,
    tie: u64,
    seq: u64,
    ev: Ev,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    /// Reversed: `BinaryHeap` is a max-heap and we pop the earliest.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.class, other.tie, other.seq)
            .cmp(&(self.at, self.class, self.tie, self.seq))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpKind {
    /// Push: P writes its blocks into D's.
    Write,
    /// Pull: D reads P's blocks into its own.
    Read,
}

/// A posted write or read, as the data plane sees it.
#[derive(Clone, Debug)]
struct OpRec {
    tid: TransferId,
    kind: OpKind,
    chunk: u32,
    p_node: usize,
    p_epoch: u32,
    p_rank: usize,
    d_node: usize,
    d_epoch: u32,
    d_rank: usize,
    /// `(group, P block, D block, position in D's list)`.
    pairs: Vec<(usize, BlockId, BlockId, u32)>,
    /// True until no touch of this transfer can land anymore.
    active: bool,
    /// A completion is scheduled and was not delivered yet.
    completion_pending: bool,
    /// The transport never reports this transfer.
    hangs: bool,
    /// A push-mode write whose driver delivers `Status{ok: true}` to D
    /// once it landed.
    status_after: bool,
}

enum Kind2 {
    P(SendMachine),
    D(RecvMachine),
}

/// One machine and the ground truth the checker keeps about it.
struct Slot {
    req: usize,
    rank: usize,
    m: Kind2,
    created: T,
    released: Option<(T, Phase)>,
    armed: Option<T>,
    in_flight: BTreeSet<u64>,
    /// P: the request's source blocks; D: the destination blocks.
    blocks: BlockLists,
    /// Granter: end of the latest grant to each toucher node, counted
    /// from when this machine sent it.
    grants: BTreeMap<usize, T>,
    /// Granter: touchers whose lease-returning message arrived.
    returned: BTreeSet<usize>,
    /// Toucher: granters it sent a lease-returning message to.
    returned_to: BTreeSet<usize>,
    /// Peers whose success (`Status{ok: true}` or `Done{ok: true}`) was delivered.
    succeeded: BTreeSet<usize>,
    /// The input being fed is an `Abort` from a peer that had already
    /// reported success (a stale one).
    stale_abort_input: bool,
    /// `(peer rank, group, D position)` delivered by a transfer that completed ok.
    delivered: BTreeSet<(usize, usize, u32)>,
    resolved: Option<T>,
    last_progress: T,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RankRt {
    NotYet,
    Live(u32),
    Lost,
}

struct Node {
    up: bool,
    epoch: u32,
    mem: Memory,
    machines: BTreeMap<TransferId, Slot>,
    pending: VecDeque<(TransferId, PeerId, Msg)>,
    /// The node's liveness table over every other node, fed on its own
    /// clock: the real one the node's bridge keeps.
    live: Liveness,
    /// Ground truth beside the table: when this node last heard each
    /// node (local µs; since its incarnation began, if never).
    heard: Vec<T>,
    /// A `Beat` of this incarnation is queued.
    beating: bool,
}

enum Input {
    P(send::Event),
    D(recv::Event),
    Timeout,
    Abort(AbortReason),
}

enum Act {
    P(send::Action),
    D(recv::Action),
}

/// Result of one seed.
pub(crate) struct RunResult {
    pub stats: Stats,
    pub violation: Option<Violation>,
    pub trace: Vec<String>,
}

pub(crate) struct World<'a> {
    sc: &'a Scenario,
    cfg: Config,
    rng: Rng,
    base: Instant,
    now: T,
    seq: u64,
    queue: BinaryHeap<Entry>,
    nodes: Vec<Node>,
    ranks_p: Vec<Vec<RankRt>>,
    ranks_d: Vec<Vec<RankRt>>,
    ops: BTreeMap<u64, OpRec>,
    next_op: u64,
    /// Lease tickets handed to D ranks: id → (P node, its epoch, real time
    /// the P node "sent" it). The node's tickets are heartbeat replies P
    /// sent before D received them, so always before D's grant.
    tickets: BTreeMap<u64, (usize, u32, T)>,
    net: Network,
    /// Queued events other than heartbeats: while there are none, nothing
    /// but a heartbeat can happen, so the nodes stop beating and the run
    /// quiesces.
    work: u64,
    stats: Stats,
    violation: Option<Violation>,
    trace: Option<Vec<String>>,
}

pub(crate) fn run(sc: &Scenario, trace: bool) -> RunResult {
    let mut w = World::new(sc, trace);
    w.start();
    let mut steps = 0u64;
    loop {
        w.keep_beating();
        let Some(e) = w.queue.pop() else {
            break;
        };
        debug_assert!(e.at >= w.now, "time went backwards");
        w.now = e.at;
        if !matches!(e.ev, Ev::Beat { .. }) {
            w.work -= 1;
        }
        w.handle(e.ev);
        steps += 1;
        if w.violation.is_some() {
            break;
        }
        if steps > STEP_LIMIT {
            w.fail(
                Kind::Liveness,
                format!("more than {STEP_LIMIT} steps: the run does not quiesce"),
            );
            break;
        }
    }
    if w.violation.is_none() {
        w.final_checks();
    }
    w.stats.steps = steps;
    w.stats.sim_us = w.now;
    w.stats.runs = 1;
    w.stats.calm_runs = sc.calm as u64;
    w.stats.jittery_runs = sc.jittery as u64;
    let ns = &w.net.stats;
    w.stats.messages = ns.sent;
    w.stats.dropped = ns.dropped;
    w.stats.duplicated = ns.duplicated;
    w.stats.cut = ns.cut;
    RunResult {
        stats: w.stats,
        violation: w.violation,
        trace: w.trace.unwrap_or_default(),
    }
}

impl<'a> World<'a> {
    fn new(sc: &'a Scenario, trace: bool) -> Self {
        let base = Instant::now();
        let nodes = (0..sc.nodes())
            .map(|me| Node {
                up: true,
                epoch: 0,
                mem: Memory::new(sc.pool_blocks),
                machines: BTreeMap::new(),
                pending: VecDeque::new(),
                // Every clock reads 0 at real time 0.
                live: fresh_table(&sc.cfg, sc.nodes(), me, base),
                heard: vec![0; sc.nodes()],
                beating: false,
            })
            .collect();
        let mut seed_rng = Rng::new(sc.seed);
        World {
            sc,
            cfg: sc.cfg,
            rng: seed_rng.fork().fork(),
            base,
            now: 0,
            seq: 0,
            queue: BinaryHeap::new(),
            nodes,
            ranks_p: sc
                .requests
                .iter()
                .map(|r| vec![RankRt::NotYet; r.p_nodes.len()])
                .collect(),
            ranks_d: sc
                .requests
                .iter()
                .map(|r| vec![RankRt::NotYet; r.d_nodes.len()])
                .collect(),
            ops: BTreeMap::new(),
            next_op: 0,
            tickets: BTreeMap::new(),
            net: Network::new(sc.net.clone()),
            work: 0,
            stats: Stats::default(),
            violation: None,
            trace: trace.then(Vec::new),
        }
    }

    fn start(&mut self) {
        for (i, r) in self.sc.requests.iter().enumerate() {
            self.at(r.arrive, Ev::Arrive(i));
        }
        for c in &self.sc.crashes {
            self.at(c.at, Ev::Crash(c.node));
            self.at(c.at + c.down_for, Ev::Restart(c.node));
        }
        for (i, p) in self.sc.partitions.iter().enumerate() {
            self.at(p.at, Ev::Partition(i));
            self.at(p.at + p.heal_after, Ev::Heal(i));
        }
    }

    /// `node`'s clock at real time `t`: it runs `drift_ppm` fast or slow.
    fn local(&self, node: usize, t: T) -> T {
        let d = self.sc.drift_ppm[node] as i128;
        (t as i128 + t as i128 * d / 1_000_000) as T
    }

    /// The earliest real time at which `node`'s clock reads `local` or later.
    fn real(&self, node: usize, local: T) -> T {
        let d = self.sc.drift_ppm[node] as i128;
        let mut t = (local as i128 * 1_000_000 / (1_000_000 + d)) as T;
        while self.local(node, t) < local {
            t += 1;
        }
        while t > 0 && self.local(node, t - 1) >= local {
            t -= 1;
        }
        t
    }

    /// What `node`'s machines are told the time is at real time `t`.
    fn instant(&self, node: usize, t: T) -> Instant {
        self.base + Duration::from_micros(self.local(node, t))
    }

    /// A machine's deadline on `node`'s clock, in `node`'s local microseconds.
    fn local_of(&self, i: Instant) -> T {
        i.saturating_duration_since(self.base)
            .as_nanos()
            .div_ceil(1_000) as T
    }

    fn at(&mut self, t: T, ev: Ev) {
        let class = match ev {
            Ev::Touch(_) => 0,
            Ev::SpanEnd { .. } => 1,
            _ => 2,
        };
        if !matches!(ev, Ev::Beat { .. }) {
            self.work += 1;
        }
        self.seq += 1;
        let tie = self.rng.next_u64();
        self.queue.push(Entry {
            at: t.max(self.now),
            class,
            tie,
            seq: self.seq,
            ev,
        });
    }

    fn fail(&mut self, kind: Kind, detail: String) {
        if self.violation.is_none() {
            self.log(|| format!("VIOLATION {kind:?}: {detail}"));
            self.violation = Some(Violation {
                at: self.now,
                kind,
                detail,
            });
        }
    }

    fn log(&mut self, f: impl FnOnce() -> String) {
        if let Some(t) = &mut self.trace {
            let now = self.now;
            t.push(format!("{:>5}.{:03} {}", now / 1000, now % 1000, f()));
        }
    }

    /// The request's spec, borrowed from the scenario rather than from `self`.
    fn spec(&self, req: usize) -> &'a RequestSpec {
        let sc: &'a Scenario = self.sc;
        &sc.requests[req]
    }

    fn is_p(&self, node: usize) -> bool {
        self.sc.is_p_node(node)
    }

    // ----- events -------------------------------------------------------

    fn handle(&mut self, ev: Ev) {
        match ev {
            Ev::Arrive(req) => self.arrive(req),
            Ev::CreateP(req, rank) => self.create_p(req, rank),
            Ev::CreateD(req, rank) => self.create_d(req, rank),
            Ev::Resolve(req, rank) => self.resolve(req, rank),
            Ev::Chunk(req, rank, k) => self.chunk(req, rank, k),
            Ev::Deliver {
                from,
                to,
                to_epoch,
                bytes,
            } => self.deliver(from, to, to_epoch, &bytes),
            Ev::Timer {
                node,
                epoch,
                tid,
                at,
            } => {
                if self.nodes[node].epoch != epoch || !self.nodes[node].up {
                    return;
                }
                let Some(slot) = self.nodes[node].machines.get_mut(&tid) else {
                    return;
                };
                if slot.armed == Some(at) {
                    slot.armed = None;
                }
                // A timer that is no longer the earliest deadline still
                // calls `handle_timeout`: spurious calls must be no-ops.
                self.drive(node, tid, Input::Timeout);
            }
            Ev::Complete { op, ok } => self.complete(op, ok),
            Ev::Touch(t) => self.touch(t),
            Ev::SpanEnd { op } => {
                if let Some(rec) = self.ops.get_mut(&op) {
                    rec.active = false;
                    let rec = rec.clone();
                    if !rec.completion_pending {
                        self.ops.remove(&op);
                    }
                    if rec.hangs {
                        // The initiator never hears back; the op stops
                        // counting against its in-flight limit at the bound,
                        // when the machine itself gives it up.
                        let init = match rec.kind {
                            OpKind::Write => rec.p_node,
                            OpKind::Read => rec.d_node,
                        };
                        if let Some(s) = self.nodes[init].machines.get_mut(&rec.tid) {
                            s.in_flight.remove(&op);
                        }
                    }
                }
            }
            Ev::Abort {
                req,
                side,
                rank,
                reason,
            } => {
                let spec = self.spec(req);
                let node = match side {
                    Side::P => spec.p_nodes[rank],
                    Side::D => spec.d_nodes[rank],
                };
                if self.live_slot(node, spec.id) {
                    self.stats.aborts += 1;
                    self.log(|| format!("engine aborts {:?} on node {node} ({reason:?})", spec.id));
                    self.drive(node, spec.id, Input::Abort(reason));
                }
            }
            Ev::PlanFail { req, side, rank } => {
                let spec = self.spec(req);
                let (node, peer) = match side {
                    Side::P => (spec.p_nodes[rank], spec.d_nodes[spec.d_ranks_of(rank)[0]]),
                    Side::D => (spec.d_nodes[rank], spec.p_nodes[spec.pairs[rank][0]]),
                };
                if self.live_slot(node, spec.id) {
                    self.stats.plan_failures += 1;
                    let peer = PeerId(peer as u32);
                    let input = match side {
                        Side::P => Input::P(send::Event::PlanFailed { peer }),
                        Side::D => Input::D(recv::Event::PlanFailed { peer }),
                    };
                    self.drive(node, spec.id, input);
                }
            }
            Ev::FalseDead { req, side, rank } => {
                let spec = self.spec(req);
                let (node, peer) = match side {
                    Side::P => (spec.p_nodes[rank], spec.d_nodes[spec.d_ranks_of(rank)[0]]),
                    Side::D => (spec.d_nodes[rank], spec.p_nodes[spec.pairs[rank][0]]),
                };
                if self.live_slot(node, spec.id) {
                    self.stats.peer_dead += 1;
                    self.stats.false_dead += 1;
                    let peer = PeerId(peer as u32);
                    let input = match side {
                        Side::P => Input::P(send::Event::PeerDead { peer }),
                        Side::D => Input::D(recv::Event::PeerDead { peer }),
                    };
                    self.drive(node, spec.id, input);
                }
            }
            Ev::Crash(node) => self.crash(node),
            Ev::Restart(node) => self.restart(node),
            Ev::Partition(i) => {
                let (mask, one_way) = (
                    self.sc.partitions[i].side_mask,
                    self.sc.partitions[i].one_way,
                );
                self.stats.partitions += 1;
                self.log(|| {
                    format!("partition {i} starts: nodes {mask:#b} cut off (one way: {one_way})")
                });
                self.net.partition(i, mask, one_way);
            }
            Ev::Heal(i) => {
                self.log(|| format!("partition {i} heals"));
                self.net.heal(i);
            }
            Ev::Beat { node, epoch } => self.beat(node, epoch),
            Ev::EngineFree {
                node,
                epoch,
                tid,
                blocks,
            } => {
                if self.nodes[node].epoch != epoch {
                    return;
                }
                for b in blocks {
                    if let Err(e) = self.nodes[node].mem.engine_free(b, tid) {
                        self.fail(Kind::Leak, format!("node {node}: {e}"));
                    }
                }
            }
        }
    }

    fn live_slot(&self, node: usize, tid: TransferId) -> bool {
        self.nodes[node].up && self.nodes[node].machines.contains_key(&tid)
    }

    fn arrive(&mut self, req: usize) {
        let spec = self.spec(req);
        self.stats.requests += 1;
        match spec.mode {
            Mode::Push => self.stats.push += 1,
            Mode::Pull => self.stats.pull += 1,
        }
        let now = self.now;
        for (i, d) in spec.p_create.iter().enumerate() {
            self.at(now + d, Ev::CreateP(req, i));
        }
        for (j, d) in spec.d_create.iter().enumerate() {
            self.at(now + d, Ev::CreateD(req, j));
        }
        for a in &spec.aborts {
            self.at(
                now + a.at,
                Ev::Abort {
                    req,
                    side: a.side,
                    rank: a.rank,
                    reason: a.reason,
                },
            );
        }
        if let Some((side, rank, t)) = spec.plan_fail {
            self.at(now + t, Ev::PlanFail { req, side, rank });
        }
        if let Some((side, rank, t)) = spec.false_dead {
            self.at(now + t, Ev::FalseDead { req, side, rank });
        }
    }

    /// Allocates one rank's blocks, shaped like `sizes` per group.
    fn alloc(&mut self, node: usize, tid: TransferId, sizes: &[u32]) -> Option<BlockLists> {
        let n: u32 = sizes.iter().sum();
        let flat = self.nodes[node].mem.alloc(n as usize, tid)?;
        let mut it = flat.into_iter();
        Some(
            sizes
                .iter()
                .map(|&k| it.by_ref().take(k as usize).collect())
                .collect(),
        )
    }

    fn new_slot(&self, node: usize, req: usize, rank: usize, m: Kind2, blocks: BlockLists) -> Slot {
        let now = self.local(node, self.now);
        Slot {
            req,
            rank,
            m,
            created: now,
            released: None,
            armed: None,
            in_flight: BTreeSet::new(),
            blocks,
            grants: BTreeMap::new(),
            returned: BTreeSet::new(),
            returned_to: BTreeSet::new(),
            succeeded: BTreeSet::new(),
            stale_abort_input: false,
            delivered: BTreeSet::new(),
            resolved: None,
            last_progress: now,
        }
    }

    /// The P engine learns the request: it allocates the source blocks and
    /// creates the machine, or hands the blocks to the machine the driver
    /// already created on D's first `Pull`.
    fn create_p(&mut self, req: usize, rank: usize) {
        let spec = self.spec(req);
        let node = spec.p_nodes[rank];
        let tid = spec.id;
        match self.ranks_p[req][rank] {
            RankRt::NotYet => {}
            RankRt::Lost => return,
            RankRt::Live(e) => {
                let released = self.nodes[node]
                    .machines
                    .get(&tid)
                    .is_none_or(|s| s.released.is_some());
                if e != self.nodes[node].epoch || !self.nodes[node].up || released {
                    // The transfer already gave up: the engine drops the request.
                    self.stats.engine_late += 1;
                    return;
                }
                let Some(blocks) = self.alloc(node, tid, &spec.total) else {
                    self.stats.rejected_ranks += 1;
                    self.drive(node, tid, Input::Abort(AbortReason::Engine));
                    return;
                };
                if let Some(s) = self.nodes[node].machines.get_mut(&tid) {
                    s.blocks = blocks;
                }
                self.log(|| format!("P node {node} engine takes {tid:?}"));
                let now = self.now;
                for (k, d) in spec.chunk_at[rank].iter().enumerate() {
                    self.at(now + d, Ev::Chunk(req, rank, k));
                }
                return;
            }
        }
        let blocks = if self.nodes[node].up {
            self.alloc(node, tid, &spec.total)
        } else {
            None
        };
        let Some(blocks) = blocks else {
            self.stats.rejected_ranks += 1;
            self.ranks_p[req][rank] = RankRt::Lost;
            self.nodes[node].pending.retain(|(t, _, _)| *t != tid);
            return;
        };
        self.stats.machines += 1;
        let m = SendMachine::new(self.instant(node, self.now), &self.cfg, tid, spec.mode);
        let slot = self.new_slot(node, req, rank, Kind2::P(m), blocks);
        self.nodes[node].machines.insert(tid, slot);
        self.ranks_p[req][rank] = RankRt::Live(self.nodes[node].epoch);
        self.log(|| format!("P node {node} creates {tid:?} ({:?})", spec.mode));
        let now = self.now;
        for (k, d) in spec.chunk_at[rank].iter().enumerate() {
            self.at(now + d, Ev::Chunk(req, rank, k));
        }
        // Messages that arrived before the engine knew the request.
        let pending = std::mem::take(&mut self.nodes[node].pending);
        let (mine, rest): (VecDeque<_>, VecDeque<_>) =
            pending.into_iter().partition(|(t, _, _)| *t == tid);
        self.nodes[node].pending = rest;
        self.arm(node, tid);
        for (_, peer, msg) in mine {
            self.drive(node, tid, Input::P(send::Event::Msg { peer, msg }));
        }
    }

    /// The driver creates P's machine on D's first `Pull`, before the engine
    /// knows the request (the machines' documented choice); the blocks come
    /// with the engine.
    fn create_p_on_pull(&mut self, req: usize, rank: usize) {
        let spec = self.spec(req);
        let node = spec.p_nodes[rank];
        let tid = spec.id;
        self.stats.machines += 1;
        self.stats.created_on_pull += 1;
        let m = SendMachine::new(self.instant(node, self.now), &self.cfg, tid, spec.mode);
        let empty = vec![Vec::new(); spec.total.len()];
        let slot = self.new_slot(node, req, rank, Kind2::P(m), empty);
        self.nodes[node].machines.insert(tid, slot);
        self.ranks_p[req][rank] = RankRt::Live(self.nodes[node].epoch);
        self.log(|| format!("P node {node} creates {tid:?} on a Pull ({:?})", spec.mode));
        self.arm(node, tid);
    }

    fn create_d(&mut self, req: usize, rank: usize) {
        let spec = self.spec(req);
        let node = spec.d_nodes[rank];
        let tid = spec.id;
        let sizes: Vec<u32> = (0..spec.total.len()).map(|g| spec.dst_len(g)).collect();
        let blocks = if self.nodes[node].up {
            self.alloc(node, tid, &sizes)
        } else {
            None
        };
        let Some(blocks) = blocks else {
            self.stats.rejected_ranks += 1;
            self.ranks_d[req][rank] = RankRt::Lost;
            return;
        };
        let m = match RecvMachine::new(
            self.instant(node, self.now),
            &self.cfg,
            tid,
            spec.mode,
            blocks.clone(),
            spec.prefix.clone(),
        ) {
            Ok(m) => m,
            Err(e) => {
                self.fail(
                    Kind::Refused,
                    format!("RecvMachine::new refused a valid request: {e}"),
                );
                return;
            }
        };
        self.stats.machines += 1;
        let slot = self.new_slot(node, req, rank, Kind2::D(m), blocks);
        self.nodes[node].machines.insert(tid, slot);
        self.ranks_d[req][rank] = RankRt::Live(self.nodes[node].epoch);
        self.log(|| format!("D node {node} creates {tid:?} ({:?})", spec.mode));
        self.at(self.now + spec.resolve[rank], Ev::Resolve(req, rank));
        self.arm(node, tid);
    }

    fn resolve(&mut self, req: usize, rank: usize) {
        let spec = self.spec(req);
        let node = spec.d_nodes[rank];
        if !self.live_slot(node, spec.id) {
            return;
        }
        let mut peers: Vec<ResolvedPeer> = Vec::new();
        for &i in &spec.pairs[rank] {
            let p = spec.p_nodes[i];
            // Most push-mode requests carry a ticket, sent some time before
            // now (up to half a lease ago, as the node's freshness rule).
            let lease_ticket = match spec.mode {
                Mode::Push if self.rng.below(4) != 0 => {
                    let id = self.tickets.len() as u64 + 1;
                    let age = self.rng.below(us(self.cfg.lease) / 2 + 1);
                    let sent = self.now.saturating_sub(age);
                    self.tickets.insert(id, (p, self.nodes[p].epoch, sent));
                    Some(id)
                }
                Mode::Push | Mode::Pull => None,
            };
            peers.push(ResolvedPeer {
                peer: PeerId(p as u32),
                receivers_expected: spec.receivers_expected(i),
                lease_ticket,
            });
        }
        let local = self.local(node, self.now);
        if let Some(s) = self.nodes[node].machines.get_mut(&spec.id) {
            s.resolved = Some(local);
        }
        self.drive(
            node,
            spec.id,
            Input::D(recv::Event::PeersResolved {
                peers,
                unneeded: (spec.unneeded[rank].iter())
                    .map(|&i| PeerId(spec.p_nodes[i] as u32))
                    .collect(),
            }),
        );
        // Sessions to peers already declared dead fail fast.
        let dead: Vec<usize> = spec.pairs[rank]
            .iter()
            .map(|&i| spec.p_nodes[i])
            .filter(|&p| self.nodes[node].live.is_dead(p as u32))
            .collect();
        for p in dead {
            self.stats.peer_dead += 1;
            self.drive(
                node,
                spec.id,
                Input::D(recv::Event::PeerDead {
                    peer: PeerId(p as u32),
                }),
            );
        }
    }

    fn chunk(&mut self, req: usize, rank: usize, k: usize) {
        let spec = self.spec(req);
        let node = spec.p_nodes[rank];
        let Some(slot) = self.nodes[node].machines.get(&spec.id) else {
            return;
        };
        if !self.nodes[node].up {
            return;
        }
        let src_blocks: BlockLists = (0..spec.total.len())
            .map(|g| {
                let start: u32 = spec.chunks[..k].iter().map(|c| c[g]).sum();
                slot.blocks[g][start as usize..(start + spec.chunks[k][g]) as usize].to_vec()
            })
            .collect();
        let is_last = k + 1 == spec.chunks.len();
        self.drive(
            node,
            spec.id,
            Input::P(send::Event::ChunkReady {
                src_blocks,
                is_last,
            }),
        );
    }

    fn deliver(&mut self, from: usize, to: usize, to_epoch: u32, bytes: &[u8]) {
        if !self.nodes[to].up || self.nodes[to].epoch != to_epoch || self.net.blocked(from, to) {
            return;
        }
        let env = match network::decode(bytes) {
            Ok(env) => env,
            Err(e) => {
                self.fail(
                    Kind::Protocol,
                    format!("a message from node {from} does not decode: {e}"),
                );
                return;
            }
        };
        // Every frame heard counts as a sign of life, as in the bridge.
        self.hear(to, from);
        let tid = env.transfer;
        let req = tid.0 as usize;
        let p_rank = if self.is_p(to) && req < self.sc.requests.len() {
            self.sc.requests[req].p_nodes.iter().position(|&n| n == to)
        } else {
            None
        };
        if let (Some(_), Msg::Unneeded) = (p_rank, &env.msg) {
            self.stats.unneeded += 1;
        }
        if let (Some(rank), Msg::Pull { .. } | Msg::Unneeded) = (p_rank, &env.msg) {
            if self.sc.create_on_pull && self.ranks_p[req][rank] == RankRt::NotYet {
                self.create_p_on_pull(req, rank);
            }
        }
        let failed = self.nodes[to].machines.get(&tid).is_some_and(|s| {
            s.released
                .is_some_and(|(_, o)| o != Phase::Success || self.sc.switches.abort_after_success)
        });
        let released = self.nodes[to]
            .machines
            .get(&tid)
            .and_then(|s| s.released.map(|(_, o)| o));
        if let (Some(outcome), true) = (released, self.sc.answer_like_node) {
            // The node's driver (`answer_unknown`), by the machines' rule:
            // after a success the ended machine's last words again, else
            // whoever still wants to touch the transfer is told to stop.
            let mode = self.spec(req).mode;
            if let Some(a) = late_answer(&env.msg, mode, Some(outcome)) {
                self.stats.late_pull_aborts += 1;
                self.send(to, env.from, tid, a);
            }
        } else if failed && self.sc.abort_late_pulls && matches!(env.msg, Msg::Pull { .. }) {
            // The driver answers a `Pull` for a transfer that failed with
            // `Abort`, so that a late D rank fails fast. Not after a
            // success: every D rank was then sent `Status{ok: true}`, so a
            // `Pull` can only be a duplicate, and an `Abort` overtaking that
            // `Status` would fail a D rank whose KV all landed (found by the
            // simulator, seed 18796 of the jittery profile).
            self.stats.late_pull_aborts += 1;
            self.send(to, env.from, tid, Msg::Abort);
        }
        if self.nodes[to].machines.contains_key(&tid) {
            if !self.is_p(to) {
                if let Msg::Status { .. } | Msg::Ready { .. } = env.msg {
                    let local = self.local(to, self.now);
                    if let Some(s) = self.nodes[to].machines.get_mut(&tid) {
                        s.last_progress = local;
                    }
                }
            }
            if let Some(s) = self.nodes[to].machines.get_mut(&tid) {
                let from = env.from.0 as usize;
                match env.msg {
                    Msg::Status { ok } | Msg::Done { ok } => {
                        s.returned.insert(from);
                        if ok {
                            s.succeeded.insert(from);
                        }
                    }
                    Msg::Abort => {
                        s.returned.insert(from);
                        s.stale_abort_input = s.released.is_none() && s.succeeded.contains(&from);
                    }
                    Msg::AbortAck | Msg::NotPaired => {
                        s.returned.insert(from);
                    }
                    Msg::Pull { .. }
                    | Msg::Ready { .. }
                    | Msg::LeaseRequest { .. }
                    | Msg::LeaseGrant { .. }
                    | Msg::Unneeded => {}
                }
            }
            let input = if self.is_p(to) {
                match env.msg {
                    // The node's driver turns a grant naming a ticket into
                    // a `TicketGrant` counted from when P sent the ticket,
                    // on P's clock; a ticket of another P (or of an earlier
                    // life of this one) is refused.
                    Msg::LeaseGrant { seq, duration_ms } if seq & TICKET_BIT != 0 => {
                        match self.tickets.get(&(seq & !TICKET_BIT)).copied() {
                            Some((p, epoch, sent)) if p == to && epoch == self.nodes[to].epoch => {
                                self.stats.ticket_grants += 1;
                                // The self-test's broken driver counts from
                                // arrival, after the grant.
                                let sent = if self.sc.switches.ticket_from_grant_time {
                                    self.now
                                } else {
                                    sent
                                };
                                Input::P(send::Event::TicketGrant {
                                    peer: env.from,
                                    sent_at: self.instant(to, sent),
                                    duration_ms,
                                })
                            }
                            _ => Input::P(send::Event::TicketRefused { peer: env.from }),
                        }
                    }
                    msg => Input::P(send::Event::Msg {
                        peer: env.from,
                        msg,
                    }),
                }
            } else {
                Input::D(recv::Event::Msg {
                    peer: env.from,
                    msg: env.msg,
                })
            };
            self.drive(to, tid, input);
            if let Some(s) = self.nodes[to].machines.get_mut(&tid) {
                s.stale_abort_input = false;
            }
            return;
        }
        // A P engine may learn of a request after D's `Pull` arrived: this
        // driver keeps such messages (bounded) until it creates the machine.
        {
            if let Some(rank) = p_rank {
                if self.ranks_p[req][rank] == RankRt::NotYet
                    && self.nodes[to].pending.len() < PENDING_LIMIT
                    && !matches!(env.msg, Msg::LeaseGrant { seq, .. } if seq & TICKET_BIT != 0)
                {
                    self.stats.buffered += 1;
                    self.nodes[to].pending.push_back((tid, env.from, env.msg));
                }
            }
        }
    }

    // ----- machines -----------------------------------------------------

    /// Feeds one input to a machine, drains and executes its actions, checks
    /// the per-step invariants and re-arms its timer.
    fn drive(&mut self, node: usize, tid: TransferId, input: Input) {
        let at = self.instant(node, self.now);
        let is_timeout = matches!(input, Input::Timeout);
        if self.trace.is_some() {
            let what = match &input {
                // Instants print as absolute times: show the local clock.
                Input::P(send::Event::TicketGrant {
                    peer,
                    sent_at,
                    duration_ms,
                }) => format!(
                    "TicketGrant {{ peer: {peer:?}, sent_at: {}, duration_ms: {duration_ms} }}",
                    self.local_of(*sent_at)
                ),
                Input::P(e) => format!("{e:?}"),
                Input::D(e) => format!("{e:?}"),
                Input::Timeout => "timeout".to_string(),
                Input::Abort(r) => format!("abort {r:?}"),
            };
            self.log(|| format!("node {node} {tid:?} <- {what}"));
        }
        let Some(slot) = self.nodes[node].machines.get_mut(&tid) else {
            return;
        };
        let res = match (&mut slot.m, input) {
            (Kind2::P(m), Input::P(e)) => m.handle_event(at, e),
            (Kind2::D(m), Input::D(e)) => m.handle_event(at, e),
            (Kind2::P(m), Input::Timeout) => {
                m.handle_timeout(at);
                Ok(())
            }
            (Kind2::D(m), Input::Timeout) => {
                m.handle_timeout(at);
                Ok(())
            }
            (Kind2::P(m), Input::Abort(r)) => {
                m.abort(at, r);
                Ok(())
            }
            (Kind2::D(m), Input::Abort(r)) => {
                m.abort(at, r);
                Ok(())
            }
            (Kind2::P(_), Input::D(_)) | (Kind2::D(_), Input::P(_)) => {
                unreachable!("the world routes P events to P nodes only")
            }
        };
        let mut acts = Vec::new();
        match &mut slot.m {
            Kind2::P(m) => acts.extend(std::iter::from_fn(|| m.poll_action()).map(Act::P)),
            Kind2::D(m) => acts.extend(std::iter::from_fn(|| m.poll_action()).map(Act::D)),
        }
        if let Err(e) = res {
            self.fail(
                Kind::Refused,
                format!("node {node} {tid:?} refused honest input: {e}"),
            );
            return;
        }
        // Bounded output: one input never produces more than a few actions
        // per peer and chunk (announce or post every chunk, plus the
        // lease, status and abort messages).
        let (req, rank) = match self.nodes[node].machines.get(&tid) {
            Some(s) => (s.req, s.rank),
            None => return,
        };
        let spec = self.spec(req);
        let peers = if self.is_p(node) {
            spec.d_ranks_of(rank).len()
        } else {
            spec.pairs[rank].len() + spec.unneeded[rank].len()
        };
        let limit = 4 + 2 * peers * (spec.chunks.len() + 2);
        if acts.len() > limit {
            self.fail(
                Kind::Unbounded,
                format!(
                    "node {node} {tid:?}: one input produced {} actions (limit {limit})",
                    acts.len()
                ),
            );
            return;
        }
        for a in acts {
            if self.violation.is_some() {
                return;
            }
            self.exec(node, tid, a);
        }
        self.after_step(node, tid, is_timeout);
    }

    fn after_step(&mut self, node: usize, tid: TransferId, after_timeout: bool) {
        let now = self.now;
        let Some(slot) = self.nodes[node].machines.get(&tid) else {
            return;
        };
        let (phase, next) = match &slot.m {
            Kind2::P(m) => (m.phase(), m.poll_timeout()),
            Kind2::D(m) => (m.phase(), m.poll_timeout()),
        };
        if let Err(e) = checker::phase_consistent(phase, slot.released.map(|(_, p)| p)) {
            self.fail(Kind::PhaseMismatch, format!("node {node} {tid:?}: {e}"));
            return;
        }
        if slot.in_flight.len() > self.cfg.max_in_flight {
            let n = slot.in_flight.len();
            self.fail(
                Kind::Unbounded,
                format!("node {node} {tid:?}: {n} transfers in flight"),
            );
            return;
        }
        if after_timeout {
            if let Some(t) = next {
                if self.local_of(t) <= self.local(node, now) {
                    self.fail(
                        Kind::TimerStuck,
                        format!("node {node} {tid:?}: poll_timeout not after now"),
                    );
                    return;
                }
            }
        }
        self.arm(node, tid);
    }

    fn arm(&mut self, node: usize, tid: TransferId) {
        let now = self.now;
        let epoch = self.nodes[node].epoch;
        let Some(slot) = self.nodes[node].machines.get(&tid) else {
            return;
        };
        let next = match &slot.m {
            Kind2::P(m) => m.poll_timeout(),
            Kind2::D(m) => m.poll_timeout(),
        };
        let Some(next) = next else {
            return;
        };
        let t = self.real(node, self.local_of(next));
        let armed = slot.armed;
        if armed.is_none_or(|a| t < a || a < now) {
            if let Some(s) = self.nodes[node].machines.get_mut(&tid) {
                s.armed = Some(t);
            }
            if self.sc.switches.lose_timers && self.rng.below(4) == 0 {
                // A driver that forgets to arm the timer.
                return;
            }
            self.at(
                t,
                Ev::Timer {
                    node,
                    epoch,
                    tid,
                    at: t,
                },
            );
        }
    }

    fn exec(&mut self, node: usize, tid: TransferId, act: Act) {
        let now = self.now;
        if self.trace.is_some() {
            let what = match &act {
                Act::P(a) => format!("{a:?}"),
                Act::D(a) => format!("{a:?}"),
            };
            self.log(|| format!("node {node} {tid:?} -> {what}"));
        }
        let released = self.nodes[node].machines.get(&tid).and_then(|s| s.released);
        if let Some((t, outcome)) = released {
            let what = match &act {
                Act::P(a) => format!("{a:?}"),
                Act::D(a) => format!("{a:?}"),
            };
            let kind = match &act {
                Act::P(send::Action::ReleaseBlocks { .. })
                | Act::D(recv::Action::Received | recv::Action::LoadFailed { .. }) => {
                    Kind::ExactlyOnce
                }
                Act::P(_) | Act::D(_) => Kind::ActionAfterRelease,
            };
            self.fail(
                kind,
                format!(
                    "node {node} {tid:?} released at {t} with {outcome:?}, then emitted {what}"
                ),
            );
            return;
        }
        if let Act::P(send::Action::Resend { .. }) | Act::D(recv::Action::Resend { .. }) = act {
            self.stats.resent += 1;
        }
        match act {
            Act::P(send::Action::Send { peer, msg } | send::Action::Resend { peer, msg })
            | Act::D(recv::Action::Send { peer, msg } | recv::Action::Resend { peer, msg }) => {
                if let Msg::LeaseGrant { duration_ms, .. } = msg {
                    // The granter counts the lease on its own clock.
                    let until = self.real(node, self.local(node, now) + duration_ms * 1_000);
                    if let Some(s) = self.nodes[node].machines.get_mut(&tid) {
                        let g = s.grants.entry(peer.0 as usize).or_insert(0);
                        *g = (*g).max(until);
                    }
                }
                let spec = self.spec(tid.0 as usize);
                let toucher = match spec.mode {
                    Mode::Push => self.is_p(node),
                    Mode::Pull => !self.is_p(node),
                };
                let returns = matches!(
                    msg,
                    Msg::Status { .. } | Msg::Done { .. } | Msg::Abort | Msg::AbortAck
                );
                if toucher && returns {
                    // Returning the lease promises that nothing of ours
                    // touches the peer's blocks anymore.
                    let remote = peer.0 as usize;
                    let busy = self.ops.values().any(|o| {
                        o.active
                            && o.tid == tid
                            && match o.kind {
                                OpKind::Write => o.p_node == node && o.d_node == remote,
                                OpKind::Read => o.d_node == node && o.p_node == remote,
                            }
                    });
                    if busy {
                        self.fail(
                            Kind::ReleasedInFlight,
                            format!("node {node} {tid:?} returns its lease to node {remote} ({msg:?}) with a transfer to it in flight"),
                        );
                        return;
                    }
                    if let Some(s) = self.nodes[node].machines.get_mut(&tid) {
                        s.returned_to.insert(remote);
                    }
                }
                self.send(node, peer, tid, msg);
            }
            Act::P(send::Action::Write {
                peer,
                chunk,
                src_blocks,
                dst_blocks,
                status_after,
            }) => {
                self.post(
                    OpKind::Write,
                    tid,
                    node,
                    peer.0 as usize,
                    chunk,
                    src_blocks,
                    dst_blocks,
                    status_after,
                );
            }
            Act::D(recv::Action::Read {
                peer,
                chunk,
                src_blocks,
                dst_blocks,
            }) => {
                self.post(
                    OpKind::Read,
                    tid,
                    peer.0 as usize,
                    node,
                    chunk,
                    src_blocks,
                    dst_blocks,
                    false,
                );
            }
            Act::P(send::Action::ReleaseBlocks { outcome }) => {
                self.release(node, tid, outcome, None)
            }
            Act::D(recv::Action::Received) => self.release(node, tid, Phase::Success, None),
            Act::D(recv::Action::LoadFailed { block_ids }) => {
                let phase = match self.nodes[node].machines.get(&tid).map(|s| &s.m) {
                    Some(Kind2::D(m)) => m.phase(),
                    Some(Kind2::P(_)) | None => Phase::Transferring,
                };
                self.release(node, tid, phase, Some(block_ids));
            }
        }
    }

    fn send(&mut self, from: usize, peer: PeerId, tid: TransferId, msg: Msg) {
        let to = peer.0 as usize;
        let spec = self.spec(tid.0 as usize);
        let paired = if self.is_p(from) {
            spec.d_nodes.contains(&to)
        } else {
            spec.p_nodes.contains(&to)
        };
        if to >= self.nodes.len() || !paired {
            self.fail(
                Kind::Protocol,
                format!("node {from} {tid:?} sends to node {to}, not a peer of the request"),
            );
            return;
        }
        let env = Envelope {
            transfer: tid,
            from: PeerId(from as u32),
            msg,
        };
        let bytes = network::encode(&env);
        match network::decode(&bytes) {
            Ok(back) if back == env => {}
            other => {
                self.fail(
                    Kind::Protocol,
                    format!(
                        "{env:?} does not round-trip through the node's wire encoding: {other:?}"
                    ),
                );
                return;
            }
        }
        let to_epoch = self.nodes[to].epoch;
        let times = self
            .net
            .plan(&mut self.rng, self.now, from, to, bytes.len());
        for t in times {
            self.at(
                t,
                Ev::Deliver {
                    from,
                    to,
                    to_epoch,
                    bytes: bytes.clone(),
                },
            );
        }
    }

    /// A machine asked for a write (push) or read (pull). Checks it against
    /// ground truth and plans when its blocks land and when it completes.
    #[allow(clippy::too_many_arguments)]
    fn post(
        &mut self,
        kind: OpKind,
        tid: TransferId,
        p_node: usize,
        d_node: usize,
        chunk: u32,
        src: BlockLists,
        dst: BlockLists,
        status_after: bool,
    ) {
        let now = self.now;
        let req = tid.0 as usize;
        let spec = self.spec(req);
        let (Some(p_rank), Some(d_rank)) = (
            spec.p_nodes.iter().position(|&n| n == p_node),
            spec.d_nodes.iter().position(|&n| n == d_node),
        ) else {
            self.fail(Kind::Protocol, format!("{kind:?} of {tid:?} between nodes {p_node} and {d_node}, not both in the request"));
            return;
        };
        if !spec.pairs[d_rank].contains(&p_rank) {
            self.fail(
                Kind::Protocol,
                format!("{kind:?} of {tid:?} between unpaired ranks P{p_rank} and D{d_rank}"),
            );
            return;
        }
        let (initiator, remote) = match kind {
            OpKind::Write => (p_node, d_node),
            OpKind::Read => (d_node, p_node),
        };
        // A toucher that returned its lease may not start anything on that peer again.
        if self.nodes[initiator]
            .machines
            .get(&tid)
            .is_some_and(|s| s.returned_to.contains(&remote))
        {
            self.fail(
                Kind::NoLease,
                format!("node {initiator} posts {kind:?} of {tid:?} chunk {chunk} after returning its lease to node {remote}"),
            );
            return;
        }
        // The toucher must hold a live lease, as the granter counts it.
        let granter = self.nodes[remote].machines.get(&tid);
        if let Some(g) = granter {
            let until = g.grants.get(&initiator).copied();
            // Drifting clocks may stretch the toucher's lease past the
            // granter's by up to the fence margin, which the fence absorbs.
            let slack = if self.sc.drift_ppm.iter().all(|&d| d == 0) {
                0
            } else {
                us(self.cfg.fence_margin)
            };
            // The drift self-test turns this check off, to show that the
            // memory itself catches what the drift breaks.
            let late = until.is_none_or(|u| now >= u + slack);
            if late && !self.sc.switches.excess_drift {
                self.fail(
                    Kind::NoLease,
                    format!("node {initiator} posts {kind:?} of {tid:?} chunk {chunk} at {now} but node {remote} granted until {until:?}"),
                );
                return;
            }
        }
        // Positions: P's block at position `prefix + i` lands in D's block `i`.
        let p_blocks = self.alloc_of(p_node, tid, self.ranks_p[req][p_rank]);
        let d_blocks = self.alloc_of(d_node, tid, self.ranks_d[req][d_rank]);
        if src.len() != dst.len() || src.len() != spec.total.len() {
            self.fail(
                Kind::DataLoss,
                format!(
                    "{kind:?} of {tid:?} with group counts {} and {}",
                    src.len(),
                    dst.len()
                ),
            );
            return;
        }
        let mut pairs = Vec::new();
        for g in 0..src.len() {
            if src[g].len() != dst[g].len() {
                self.fail(
                    Kind::DataLoss,
                    format!(
                        "{kind:?} of {tid:?} group {g}: {} source and {} destination blocks",
                        src[g].len(),
                        dst[g].len()
                    ),
                );
                return;
            }
            for (s, d) in src[g].iter().zip(&dst[g]) {
                let pos_d = d_blocks
                    .as_ref()
                    .and_then(|b| b[g].iter().position(|x| x == d));
                let pos_s = p_blocks
                    .as_ref()
                    .and_then(|b| b[g].iter().position(|x| x == s));
                match (pos_s, pos_d) {
                    (Some(ps), Some(pd)) if ps as u32 == spec.prefix[g] + pd as u32 => {
                        pairs.push((g, *s, *d, pd as u32))
                    }
                    (None, _) if p_blocks.is_none() => {}
                    (_, None) if d_blocks.is_none() => {}
                    other => {
                        self.fail(
                            Kind::DataLoss,
                            format!("{kind:?} of {tid:?} maps P block {s:?} to D block {d:?} (positions {other:?}, prefix {})", spec.prefix[g]),
                        );
                        return;
                    }
                }
            }
        }
        // A transfer addresses the memory a rank registered for this
        // request. After a crash that registration is gone: nothing lands
        // in the restarted node's memory (an epoch no node ever reaches).
        let epoch_of = |rt: RankRt| match rt {
            RankRt::Live(e) => e,
            RankRt::NotYet | RankRt::Lost => u32::MAX,
        };
        let p_epoch = epoch_of(self.ranks_p[req][p_rank]);
        let d_epoch = epoch_of(self.ranks_d[req][d_rank]);
        // Starting a transfer on released blocks is caught here; the touch
        // events catch the ones that land late.
        for &(_, s, d, _) in &pairs {
            self.check_owner(p_node, p_epoch, s, tid, Kind::ReadAfterRelease, "posted on");
            self.check_owner(
                d_node,
                d_epoch,
                d,
                tid,
                Kind::WriteAfterRelease,
                "posted on",
            );
        }
        if self.violation.is_some() {
            return;
        }

        let id = self.next_op;
        self.next_op += 1;
        self.stats.ops += 1;
        // The transport contract holds on the initiator's clock: its own
        // timeout is what stops a transfer.
        let bound_end = self.real(
            initiator,
            self.local(initiator, now) + us(self.cfg.transfer_bound),
        );
        let bound = bound_end - now;
        let remote_epoch = match kind {
            OpKind::Write => d_epoch,
            OpKind::Read => p_epoch,
        };
        let reachable = self.nodes[remote].up
            && self.nodes[remote].epoch == remote_epoch
            && !self.net.blocked(p_node, d_node)
            && !self.net.blocked(d_node, p_node);
        let hang =
            (!reachable && self.rng.below(2) == 0) || self.rng.chance(self.sc.transport.hang_ppm);
        let (complete_at, ok) = if hang {
            self.stats.ops_hung += 1;
            (None, false)
        } else {
            // Most transfers finish well within the bound; some take all of
            // it. A success reported at the bound itself races the machine's
            // own deadline (which counts it failed), so successes come 1 µs
            // earlier; failures may come at the bound.
            let ok = reachable && !self.rng.chance(self.sc.transport.fail_ppm);
            let last = if ok { bound.saturating_sub(1) } else { bound };
            let c = if self.rng.below(8) == 0 {
                now + last
            } else {
                now + self.rng.below(last / 4 + 1)
            };
            (Some(c), ok)
        };
        let span_end = complete_at.unwrap_or(now + bound);
        let touch_end = if self.sc.switches.late_touches {
            now + 3 * bound
        } else {
            span_end
        };
        for &(_, src, dst, _) in &pairs {
            // A failed transfer may have landed partly; a good one landed all.
            if ok || self.rng.below(2) == 0 {
                // Half the touches land as late as the contract allows.
                let t = if self.rng.below(2) == 0 {
                    touch_end
                } else {
                    now + self.rng.below(touch_end - now + 1)
                };
                let touch = Touch {
                    tid,
                    kind,
                    p_node,
                    p_epoch,
                    src,
                    d_node,
                    d_epoch,
                    dst,
                };
                self.at(t, Ev::Touch(touch));
            }
        }
        self.ops.insert(
            id,
            OpRec {
                tid,
                kind,
                chunk,
                p_node,
                p_epoch,
                p_rank,
                d_node,
                d_epoch,
                d_rank,
                pairs,
                active: true,
                completion_pending: complete_at.is_some(),
                hangs: complete_at.is_none(),
                status_after,
            },
        );
        if let Some(s) = self.nodes[initiator].machines.get_mut(&tid) {
            s.in_flight.insert(id);
            if status_after {
                // The `Status` riding this write returns the lease: the
                // machine may post nothing more to that peer.
                s.returned_to.insert(remote);
            }
        }
        // The span the machines were promised; with `late_touches` the
        // touches outlive it and only the memory check can catch them.
        self.at(span_end, Ev::SpanEnd { op: id });
        if let Some(c) = complete_at {
            self.at(c, Ev::Complete { op: id, ok });
        }
    }

    /// The blocks a rank allocated for `tid`, if that allocation is the
    /// node's current memory.
    fn alloc_of(&self, node: usize, tid: TransferId, rt: RankRt) -> Option<BlockLists> {
        match rt {
            RankRt::Live(e) if e == self.nodes[node].epoch && self.nodes[node].up => self.nodes
                [node]
                .machines
                .get(&tid)
                .map(|s| s.blocks.clone()),
            RankRt::Live(_) | RankRt::NotYet | RankRt::Lost => None,
        }
    }

    fn check_owner(
        &mut self,
        node: usize,
        epoch: u32,
        b: BlockId,
        tid: TransferId,
        kind: Kind,
        how: &str,
    ) {
        let n = &self.nodes[node];
        if !n.up || n.epoch != epoch {
            // That memory died with the node: nothing to protect.
            return;
        }
        match n.mem.owner(b) {
            Some(Owner::Lent(t)) if t == tid => {}
            other => {
                let side = if self.is_p(node) { "P" } else { "D" };
                self.fail(
                    kind,
                    format!(
                        "{tid:?} {how} {side} node {node} block {} whose owner is {other:?}",
                        b.0
                    ),
                );
            }
        }
    }

    fn touch(&mut self, t: Touch) {
        let Touch {
            tid,
            kind,
            p_node,
            p_epoch,
            src: s,
            d_node,
            d_epoch,
            dst: d,
        } = t;
        let alive = |n: &Node, e: u32| n.up && n.epoch == e;
        if !alive(&self.nodes[p_node], p_epoch) || !alive(&self.nodes[d_node], d_epoch) {
            self.stats.late_drops += 1;
        }
        self.stats.touches += 1;
        let how = match kind {
            OpKind::Write => "write lands: reads",
            OpKind::Read => "read lands: reads",
        };
        self.check_owner(p_node, p_epoch, s, tid, Kind::ReadAfterRelease, how);
        let how = match kind {
            OpKind::Write => "write lands: writes",
            OpKind::Read => "read lands: writes",
        };
        self.check_owner(d_node, d_epoch, d, tid, Kind::WriteAfterRelease, how);
    }

    fn complete(&mut self, op: u64, ok: bool) {
        let Some(rec) = self.ops.get_mut(&op) else {
            return;
        };
        rec.completion_pending = false;
        let rec = rec.clone();
        if !rec.active {
            self.ops.remove(&op);
        }
        // A transfer whose far side died meanwhile did not deliver.
        let landed = ok
            && self.nodes[rec.p_node].epoch == rec.p_epoch
            && self.nodes[rec.d_node].epoch == rec.d_epoch;
        let mut ok = landed;
        let (init, init_epoch, remote) = match rec.kind {
            OpKind::Write => (rec.p_node, rec.p_epoch, rec.d_node),
            OpKind::Read => (rec.d_node, rec.d_epoch, rec.p_node),
        };
        if landed {
            // `landed` implies both nodes still run the epoch the op started in.
            if let Some(s) = self.nodes[rec.d_node].machines.get_mut(&rec.tid) {
                s.delivered
                    .extend(rec.pairs.iter().map(|&(g, _, _, pos)| (rec.p_rank, g, pos)));
            }
            if let Some(s) = self.nodes[rec.p_node].machines.get_mut(&rec.tid) {
                s.delivered
                    .extend(rec.pairs.iter().map(|&(g, _, _, pos)| (rec.d_rank, g, pos)));
            }
        }
        // A write that landed with the `Status` behind it: the driver
        // delivers the `Status`, either on the data connection before the
        // acknowledgement (which may then be lost) or, when the write could
        // not carry it, over the side channel after it.
        if landed && rec.status_after {
            let env = Envelope {
                transfer: rec.tid,
                from: PeerId(rec.p_node as u32),
                msg: Msg::Status { ok: true },
            };
            if self.rng.below(4) == 0 {
                self.send(rec.p_node, PeerId(rec.d_node as u32), rec.tid, env.msg);
            } else {
                self.stats.status_riding += 1;
                let bytes = network::encode(&env);
                self.deliver(rec.p_node, rec.d_node, rec.d_epoch, &bytes);
                if self.rng.chance(self.sc.transport.fail_ppm) {
                    self.stats.acks_lost += 1;
                    ok = false;
                }
            }
        }
        if !ok {
            self.stats.ops_failed += 1;
        }
        if self.nodes[init].epoch != init_epoch || !self.nodes[init].up {
            return;
        }
        let now = self.now;
        let local = self.local(init, now);
        let Some(s) = self.nodes[init].machines.get_mut(&rec.tid) else {
            return;
        };
        s.in_flight.remove(&op);
        let peer = PeerId(remote as u32);
        let input = match rec.kind {
            OpKind::Write => Input::P(send::Event::WriteDone {
                peer,
                chunk: rec.chunk,
                ok,
            }),
            OpKind::Read => {
                s.last_progress = local;
                Input::D(recv::Event::ReadDone {
                    peer,
                    chunk: rec.chunk,
                    ok,
                })
            }
        };
        self.drive(init, rec.tid, input);
    }

    /// A machine released its blocks (P) or reported its outcome (D).
    fn release(
        &mut self,
        node: usize,
        tid: TransferId,
        outcome: Phase,
        load_failed: Option<Vec<BlockId>>,
    ) {
        let now = self.now;
        let is_p = self.is_p(node);
        let cfg = self.cfg;
        let Some(slot) = self.nodes[node].machines.get_mut(&tid) else {
            return;
        };
        slot.released = Some((now, outcome));
        let (req, rank, created, resolved, last_progress) = (
            slot.req,
            slot.rank,
            slot.created,
            slot.resolved,
            slot.last_progress,
        );
        let blocks = slot.blocks.clone();
        let delivered = std::mem::take(&mut slot.delivered);
        // A granter that gave up while a toucher still held its lease and
        // never returned it: the release had to wait for the fence.
        // Goodput, not safety: released, failed, right on an `Abort` from a
        // peer that had already reported success to us.
        let stale_abort =
            outcome == Phase::Failed(FailReason::PeerAborted) && slot.stale_abort_input;
        let fenced =
            outcome != Phase::Success && slot.grants.keys().any(|p| !slot.returned.contains(p));
        let spec = self.spec(req);
        let side = if is_p { "P" } else { "D" };

        // Liveness: by the deadline the documented timers imply, on the
        // node's own clock.
        let local = self.local(node, now);
        let bound = if is_p {
            checker::p_bound(&cfg, created)
        } else {
            checker::d_bound(&cfg, created, resolved, last_progress)
        };
        // A fast clock skips local microseconds, so a timer may fire up to
        // 1 µs past its deadline; a request goes through a few timers.
        let quantum = if self.sc.drift_ppm[node] > 0 { 10 } else { 0 };
        if local > bound + quantum {
            self.fail(
                Kind::Liveness,
                format!(
                    "{side} node {node} {tid:?} released at local {local}, after its bound {bound}"
                ),
            );
            return;
        }
        // Nothing that touches these blocks may still be in flight.
        let epoch = self.nodes[node].epoch;
        let busy: Vec<u64> = self
            .ops
            .iter()
            .filter(|(_, o)| {
                o.active
                    && o.tid == tid
                    && if is_p {
                        o.p_node == node && o.p_epoch == epoch
                    } else {
                        o.d_node == node && o.d_epoch == epoch
                    }
            })
            .map(|(id, _)| *id)
            .collect();
        if let Some(id) = busy.first() {
            let o = &self.ops[id];
            let detail = format!(
                "{side} node {node} {tid:?} released ({outcome:?}) while {:?} of chunk {} between P node {} and D node {} is in flight",
                o.kind, o.chunk, o.p_node, o.d_node
            );
            self.fail(Kind::ReleasedInFlight, detail);
            return;
        }
        if let Some(ids) = &load_failed {
            let all: Vec<BlockId> = blocks.iter().flatten().copied().collect();
            if *ids != all {
                self.fail(
                    Kind::Leak,
                    format!(
                        "D node {node} {tid:?} LoadFailed names {ids:?}, its blocks are {all:?}"
                    ),
                );
                return;
            }
        }
        // Success means data.
        if outcome == Phase::Success {
            let peers: Vec<usize> = if is_p {
                spec.d_ranks_of(rank)
            } else {
                spec.pairs[rank].clone()
            };
            for peer in peers {
                for g in 0..spec.total.len() {
                    for pos in 0..spec.dst_len(g) {
                        if !delivered.contains(&(peer, g, pos)) {
                            self.fail(
                                Kind::DataLoss,
                                format!("{side} node {node} {tid:?} reports success but block {pos} of group {g} from/to rank {peer} never landed"),
                            );
                            return;
                        }
                    }
                }
            }
        }
        self.stats.fenced += fenced as u64;
        if stale_abort {
            // Its data from that peer is complete and the peer holds no
            // lease: a stale `Abort` must not fail the request (it did
            // before the fix, seeds 4359 and 358).
            self.stats.stale_aborts += 1;
            self.fail(
                Kind::SpuriousFailure,
                format!("{side} node {node} {tid:?} failed on an Abort from a peer that had already reported success"),
            );
            return;
        }
        self.stats.min_slack_us = self.stats.min_slack_us.min(bound.saturating_sub(local));
        *self
            .stats
            .outcomes
            .entry(format!("{side} {outcome:?}"))
            .or_insert(0) += 1;
        match outcome {
            Phase::Success if is_p => self.stats.p_success += 1,
            Phase::Success => self.stats.d_received += 1,
            _ if is_p => self.stats.p_failed += 1,
            _ => self.stats.d_failed += 1,
        }
        if outcome == Phase::Expired {
            self.stats.expired += 1;
        }
        if self.sc.calm && self.stats.rejected_ranks == 0 && outcome != Phase::Success {
            self.fail(
                Kind::SpuriousFailure,
                format!("{side} node {node} {tid:?} ended {outcome:?} in a run without faults"),
            );
            return;
        }
        // Hand the blocks back. D keeps KV it received until decode is done.
        let keep = !is_p && outcome == Phase::Success;
        for b in blocks.iter().flatten() {
            if let Err(e) = self.nodes[node].mem.release(*b, tid, keep) {
                self.fail(Kind::ExactlyOnce, format!("{side} node {node}: {e}"));
                return;
            }
        }
        if keep {
            let t = now + spec.decode;
            self.at(
                t,
                Ev::EngineFree {
                    node,
                    epoch,
                    tid,
                    blocks: blocks.into_iter().flatten().collect(),
                },
            );
        }
    }

    // ----- faults -------------------------------------------------------

    fn crash(&mut self, node: usize) {
        if !self.nodes[node].up {
            return;
        }
        self.stats.crashes += 1;
        self.log(|| format!("node {node} crashes"));
        let n = &mut self.nodes[node];
        n.up = false;
        n.epoch += 1;
        n.machines.clear();
        n.pending.clear();
        n.beating = false;
        n.mem.reset();
        for (r, spec) in self.sc.requests.iter().enumerate() {
            for (i, &p) in spec.p_nodes.iter().enumerate() {
                if p == node && matches!(self.ranks_p[r][i], RankRt::Live(_)) {
                    self.ranks_p[r][i] = RankRt::Lost;
                }
            }
            for (j, &d) in spec.d_nodes.iter().enumerate() {
                if d == node && matches!(self.ranks_d[r][j], RankRt::Live(_)) {
                    self.ranks_d[r][j] = RankRt::Lost;
                }
            }
        }
    }

    fn restart(&mut self, node: usize) {
        if self.nodes[node].up {
            return;
        }
        self.log(|| format!("node {node} restarts"));
        // The new incarnation knows every peer afresh.
        let fresh = fresh_table(
            &self.cfg,
            self.nodes.len(),
            node,
            self.instant(node, self.now),
        );
        let local = self.local(node, self.now);
        let n = &mut self.nodes[node];
        n.up = true;
        n.live = fresh;
        n.heard.fill(local);
        if self.sc.reset_on_restart {
            // The peers' connections to the old incarnation reset: each
            // peer's table hears the drop, and every session with a peer it
            // reports dead fails at once. Without a detector, the drop
            // fails the sessions directly.
            for obs in 0..self.nodes.len() {
                if obs == node || !self.nodes[obs].up {
                    continue;
                }
                if self.sc.detector {
                    self.nodes[obs].live.handle_dropped(node as u32);
                    self.report_deaths(obs);
                } else {
                    self.peer_dead_all(obs, node);
                }
                if self.violation.is_some() {
                    return;
                }
            }
        }
    }

    /// While the run has other work, every node that is up beats every
    /// `heartbeat_interval` on its own clock (from a random phase, so that
    /// the nodes' probes interleave); without a detector, nobody beats.
    fn keep_beating(&mut self) {
        if !self.sc.detector || self.work == 0 {
            return;
        }
        let hb = us(self.cfg.heartbeat_interval);
        for node in 0..self.nodes.len() {
            if self.nodes[node].up && !self.nodes[node].beating {
                let first = self.local(node, self.now) + 1 + self.rng.below(hb);
                self.queue_beat(node, first);
            }
        }
    }

    fn queue_beat(&mut self, node: usize, local: T) {
        self.nodes[node].beating = true;
        let epoch = self.nodes[node].epoch;
        let t = self.real(node, local);
        self.at(t, Ev::Beat { node, epoch });
    }

    /// `node`'s heartbeat tick: it hears every peer that is up and whose
    /// frames reach it (the peer answers the probe, or probes it), then its
    /// table says who stayed silent too long. The next tick is queued only
    /// while something else may still happen.
    fn beat(&mut self, node: usize, epoch: u32) {
        if self.nodes[node].epoch != epoch || !self.nodes[node].up {
            return;
        }
        for peer in 0..self.nodes.len() {
            if peer != node && self.nodes[peer].up && !self.net.blocked(peer, node) {
                self.hear(node, peer);
            }
        }
        self.stats.beats += 1;
        let now = self.instant(node, self.now);
        self.nodes[node].live.handle_tick(now);
        self.report_deaths(node);
        self.check_silent_are_dead(node);
        if self.work > 0 {
            let next = self.local(node, self.now) + us(self.cfg.heartbeat_interval);
            self.queue_beat(node, next);
        } else {
            self.nodes[node].beating = false;
        }
    }

    /// `observer` heard a frame from `peer`: a peer it had marked dead is
    /// alive again.
    fn hear(&mut self, observer: usize, peer: usize) {
        let now = self.instant(observer, self.now);
        self.nodes[observer].heard[peer] = self.local(observer, self.now);
        if self.nodes[observer].live.handle_heard(now, peer as u32) {
            self.stats.revivals += 1;
            self.log(|| format!("node {observer} hears node {peer} again"));
        }
    }

    /// After a tick, every peer `node` has not heard for more than
    /// `heartbeat_misses * heartbeat_interval` (on its clock) is marked
    /// dead: detection comes within a heartbeat of that silence.
    fn check_silent_are_dead(&mut self, node: usize) {
        let local = self.local(node, self.now);
        let silence_max = us(self.cfg.heartbeat_interval) * self.cfg.heartbeat_misses as u64;
        let missed = (0..self.nodes.len()).find(|&p| {
            p != node
                && local - self.nodes[node].heard[p] > silence_max
                && !self.nodes[node].live.is_dead(p as u32)
        });
        if let Some(p) = missed {
            let quiet = local - self.nodes[node].heard[p];
            self.fail(
                Kind::Liveness,
                format!("node {node} heard nothing from node {p} for {quiet} µs (more than {silence_max}) yet does not mark it dead"),
            );
        }
    }

    /// Acts on every death `observer`'s table reports: `PeerDead` to each
    /// of its machines paired with that peer.
    fn report_deaths(&mut self, observer: usize) {
        while let Some((peer, cause)) = self.nodes[observer].live.poll_dead() {
            let peer = peer as usize;
            match cause {
                DeathCause::Silent { .. } => self.stats.silent_deaths += 1,
                DeathCause::Dropped => self.stats.dropped_deaths += 1,
            }
            self.log(|| format!("node {observer} declares node {peer} dead ({cause:?})"));
            self.peer_dead_all(observer, peer);
            if self.violation.is_some() {
                return;
            }
        }
    }

    /// Delivers `PeerDead{peer}` to every machine on `observer` whose request pairs it with `peer`.
    fn peer_dead_all(&mut self, observer: usize, peer: usize) {
        let tids: Vec<TransferId> = self.nodes[observer]
            .machines
            .iter()
            .filter(|(_, s)| {
                let spec = &self.sc.requests[s.req];
                if self.is_p(observer) {
                    spec.d_ranks_of(s.rank)
                        .iter()
                        .any(|&j| spec.d_nodes[j] == peer)
                } else {
                    spec.pairs[s.rank].iter().any(|&i| spec.p_nodes[i] == peer)
                }
            })
            .map(|(t, _)| *t)
            .collect();
        let p = PeerId(peer as u32);
        for tid in tids {
            self.stats.peer_dead += 1;
            let input = if self.is_p(observer) {
                Input::P(send::Event::PeerDead { peer: p })
            } else {
                Input::D(recv::Event::PeerDead { peer: p })
            };
            self.drive(observer, tid, input);
            if self.violation.is_some() {
                return;
            }
        }
    }

    // ----- end of run ---------------------------------------------------

    fn final_checks(&mut self) {
        // Goodput, not safety: a D rank that failed with `PeerAborted`
        // although every P rank of the request released with success.
        let sc: &'a Scenario = self.sc;
        for spec in &sc.requests {
            let outcome = |w: &World, node: usize| {
                w.nodes[node]
                    .machines
                    .get(&spec.id)
                    .and_then(|s| s.released.map(|(_, o)| o))
            };
            // Goodput: a request counts when every rank of it was created
            // (a node was up and had blocks), and is good when every rank
            // ended in success.
            let ranks = || spec.p_nodes.iter().chain(&spec.d_nodes);
            if ranks().all(|&n| self.nodes[n].machines.contains_key(&spec.id)) {
                self.stats.requests_judged += 1;
                if ranks().all(|&n| outcome(self, n) == Some(Phase::Success)) {
                    self.stats.requests_ok += 1;
                }
            }
            let all_p_ok = spec
                .p_nodes
                .iter()
                .all(|&n| outcome(self, n) == Some(Phase::Success));
            for &d in &spec.d_nodes {
                if all_p_ok && outcome(self, d) == Some(Phase::Failed(FailReason::PeerAborted)) {
                    self.stats.spurious_aborts += 1;
                    self.log(|| format!("spurious abort: D node {d} {:?}", spec.id));
                }
            }
        }
        for node in 0..self.nodes.len() {
            if !self.nodes[node].up {
                continue;
            }
            let stuck: Vec<(TransferId, Phase)> = self.nodes[node]
                .machines
                .iter()
                .filter(|(_, s)| s.released.is_none())
                .map(|(t, s)| {
                    let phase = match &s.m {
                        Kind2::P(m) => m.phase(),
                        Kind2::D(m) => m.phase(),
                    };
                    (*t, phase)
                })
                .collect();
            if let Some((tid, phase)) = stuck.first() {
                self.fail(Kind::Liveness, format!("node {node} {tid:?} never became terminal (phase {phase:?}, no timer left)"));
                return;
            }
            let leaked = self.nodes[node].mem.leaked();
            if let Some((b, o)) = leaked.first() {
                self.fail(
                    Kind::Leak,
                    format!(
                        "node {node} block {b} still owned by {o:?} at the end ({} blocks)",
                        leaked.len()
                    ),
                );
                return;
            }
        }
    }
}

/// A liveness table of node `me` over every other node, all heard at `now`.
fn fresh_table(cfg: &Config, nodes: usize, me: usize, now: Instant) -> Liveness {
    let mut live = Liveness::new(cfg.heartbeat_interval * cfg.heartbeat_misses);
    for peer in (0..nodes).filter(|&p| p != me) {
        live.handle_added(now, peer as u32);
    }
    live
}
