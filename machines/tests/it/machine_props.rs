//! Property tests: P and D machines wired together through a network that
//! delays, reorders, duplicates and drops messages, and a transport whose
//! completions come late, out of order, fail, or never come. After every
//! step the invariants of docs/design.md §2 are checked against ground truth that
//! the harness keeps itself (not the machines' own bookkeeping):
//!
//! * exactly once: each machine releases/reports at most once, and its phase
//!   is terminal exactly when it did;
//! * leases: every write/read starts strictly inside a lease the granter
//!   actually granted (counted on the granter's side);
//! * no touch after release: when a side releases its blocks, every transfer
//!   that touches them has completed or passed its bound, and none starts later;
//! * honest traffic is never refused; refused junk leaves a machine unchanged;
//! * deadlines progress: after any input, `poll_timeout` lies in the future;
//! * liveness: after silence (or free delivery) and enough time, every machine
//!   is terminal and has released exactly once;
//! * success means data: a D reporting `Received` got every block from every P.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use proptest::prelude::*;

use kvferry_machines::internal::common::{BlockId, Config, Mode, Msg, PeerId};
use kvferry_machines::internal::recv::{self, RecvMachine, ResolvedPeer};
use kvferry_machines::internal::send::{self, SendMachine};
use kvferry_machines::{AbortReason, Machine, Phase, TransferId};

fn cfg() -> Config {
    Config {
        bootstrap_timeout: Duration::from_secs(60),
        waiting_timeout: Duration::from_secs(60),
        claim_timeout: Duration::from_secs(20),
        lease: Duration::from_secs(10),
        hold_limit: Duration::from_secs(120),
        transfer_bound: Duration::from_secs(8),
        fence_margin: Duration::from_secs(2),
        heartbeat_interval: Duration::from_secs(5),
        max_in_flight: 3,
        ..Config::default()
    }
}

/// P rank `i` as D names it, and D rank `j` as P names it.
fn p_id(i: usize) -> PeerId {
    PeerId(100 + i as u32)
}
fn d_id(j: usize) -> PeerId {
    PeerId(200 + j as u32)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Node {
    P(usize),
    D(usize),
}

#[derive(Clone, Debug)]
enum Step {
    Advance(u64),
    Deliver(usize),
    Drop(usize),
    Duplicate(usize),
    Complete(usize, bool),
    /// A write carrying the `Status` behind it lands in full (so the
    /// `Status` goes out) but its acknowledgement is lost: P hears a
    /// failure. Other transfers just fail.
    AckLost(usize),
    ChunkReady(usize),
    Resolve(usize),
    Abort(bool, usize, u8),
    PeerDead(bool, usize, usize),
    PlanFailed(bool, usize, usize),
    SpuriousTimeout(bool, usize),
    Junk(bool, usize, usize, u8, u64),
    StaleCompletion(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        20 => prop_oneof![9 => 0u64..2_000, 1 => 0u64..30_000].prop_map(Step::Advance),
        60 => any::<usize>().prop_map(Step::Deliver),
        2 => any::<usize>().prop_map(Step::Drop),
        3 => any::<usize>().prop_map(Step::Duplicate),
        30 => (any::<usize>(), prop::bool::weighted(0.95)).prop_map(|(i, ok)| Step::Complete(i, ok)),
        1 => any::<usize>().prop_map(Step::AckLost),
        10 => any::<usize>().prop_map(Step::ChunkReady),
        8 => any::<usize>().prop_map(Step::Resolve),
        1 => (any::<bool>(), any::<usize>(), 0u8..3).prop_map(|(s, i, r)| Step::Abort(s, i, r)),
        1 => (any::<bool>(), any::<usize>(), any::<usize>()).prop_map(|(s, i, p)| Step::PeerDead(s, i, p)),
        1 => (any::<bool>(), any::<usize>(), any::<usize>()).prop_map(|(s, i, p)| Step::PlanFailed(s, i, p)),
        2 => (any::<bool>(), any::<usize>()).prop_map(|(s, i)| Step::SpuriousTimeout(s, i)),
        6 => (any::<bool>(), any::<usize>(), any::<usize>(), 0u8..9, 0u64..4).prop_map(|(s, i, p, k, x)| Step::Junk(s, i, p, k, x)),
        2 => any::<usize>().prop_map(Step::StaleCompletion),
    ]
}

/// Calm runs replace the steps that end a request early (abort, death, plan
/// failure, loss) by deliveries, so that many runs get to the end.
fn calm(s: Step) -> Step {
    match s {
        Step::Abort(..) | Step::PeerDead(..) | Step::PlanFailed(..) | Step::Drop(_) => {
            Step::Deliver(0)
        }
        Step::Complete(k, _) | Step::AckLost(k) => Step::Complete(k, true),
        other => other,
    }
}

#[derive(Clone, Debug)]
struct Scenario {
    mode: Mode,
    n_p: usize,
    n_d: usize,
    dst_len: usize,
    prefix: u32,
    /// Sizes of P's chunks; they add up to `prefix + dst_len`.
    chunk_sizes: Vec<usize>,
    steps: Vec<Step>,
    /// Liveness finale: true delivers every message at once, false drops them (silence).
    finale_delivers: bool,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (
        prop_oneof![Just(Mode::Push), Just(Mode::Pull)],
        1usize..=3,
        1usize..=3,
        1usize..=5,
        0u32..3,
        prop::collection::vec(1usize..4, 1..4),
        prop::collection::vec(step(), 1..200),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(mode, n_p, n_d, dst_len, prefix, raw, steps, finale_delivers, chaos)| {
                let steps = if chaos {
                    steps
                } else {
                    steps.into_iter().map(calm).collect()
                };
                // Cut prefix + dst_len blocks into chunks shaped by `raw`.
                let total = prefix as usize + dst_len;
                let mut chunk_sizes = Vec::new();
                let mut left = total;
                for r in raw {
                    if left == 0 {
                        break;
                    }
                    let s = r.min(left);
                    chunk_sizes.push(s);
                    left -= s;
                }
                if left > 0 {
                    chunk_sizes.push(left);
                }
                Scenario {
                    mode,
                    n_p,
                    n_d,
                    dst_len,
                    prefix,
                    chunk_sizes,
                    steps,
                    finale_delivers,
                }
            },
        )
}

#[derive(Clone, Debug)]
struct Packet {
    from: Node,
    to: Node,
    msg: Msg,
}

/// A write or read the transport carries, as the harness sees it physically.
#[derive(Clone, Debug)]
struct Transfer {
    /// The machine that posted it.
    toucher: Node,
    /// The machine whose blocks it touches on the other side.
    granter: Node,
    chunk: u32,
    dst_blocks: Vec<BlockId>,
    posted_at: Instant,
    /// When its completion was delivered.
    completed_at: Option<Instant>,
    /// Push mode: the driver owes the granter `Status{ok: true}` once the
    /// write lands.
    status_after: bool,
}

struct World {
    sc: Scenario,
    cfg: Config,
    now: Instant,
    t0: Instant,
    ps: Vec<SendMachine>,
    ds: Vec<RecvMachine>,
    chunks_given: Vec<usize>,
    resolved: Vec<bool>,
    net: Vec<Packet>,
    transfers: Vec<Transfer>,
    /// Granter-side end of the latest grant: (granter, toucher) -> end.
    granted_until: BTreeMap<(Node, Node), Instant>,
    released_at: BTreeMap<Node, (Instant, usize)>,
    /// Blocks landed in D's memory from each P: (p, d) -> blocks.
    landed: BTreeMap<(usize, usize), BTreeSet<BlockId>>,
    /// Junk reaches the real machines: a lying peer can break safety (it may
    /// claim data it never sent), so only exactly-once, the phase/release
    /// agreement, deadlines and liveness are checked.
    hostile: bool,
}

impl World {
    fn new(sc: Scenario) -> Self {
        let cfg = cfg();
        let t0 = Instant::now();
        let ps = (0..sc.n_p)
            .map(|_| SendMachine::new(t0, &cfg, TransferId(1), sc.mode))
            .collect();
        let ds = (0..sc.n_d)
            .map(|j| {
                RecvMachine::new(
                    t0,
                    &cfg,
                    TransferId(1),
                    sc.mode,
                    vec![dst_of(j, sc.dst_len)],
                    vec![sc.prefix],
                )
                .unwrap()
            })
            .collect();
        World {
            cfg,
            now: t0,
            t0,
            ps,
            ds,
            chunks_given: vec![0; sc.n_p],
            resolved: vec![false; sc.n_d],
            net: Vec::new(),
            transfers: Vec::new(),
            granted_until: BTreeMap::new(),
            released_at: BTreeMap::new(),
            landed: BTreeMap::new(),
            hostile: false,
            sc,
        }
    }

    fn is_released(&self, n: Node) -> bool {
        self.released_at.contains_key(&n)
    }

    fn mark_release(&mut self, n: Node) {
        let now = self.now;
        let e = self.released_at.entry(n).or_insert((now, 0));
        e.1 += 1;
        assert_eq!(e.1, 1, "{n:?} released twice");
        if self.hostile {
            return;
        }
        // No transfer touching this node's blocks may still be able to land.
        let bound = self.cfg.transfer_bound;
        for t in &self.transfers {
            if t.toucher == n || t.granter == n {
                let physically_done =
                    t.completed_at.is_some_and(|c| c <= now) || t.posted_at + bound <= now;
                assert!(
                    physically_done,
                    "{n:?} released at {:?} while {t:?} may still touch its blocks",
                    now - self.t0
                );
            }
        }
    }

    fn start_transfer(
        &mut self,
        toucher: Node,
        granter: Node,
        chunk: u32,
        dst_blocks: Vec<BlockId>,
        status_after: bool,
    ) {
        let until = self.granted_until.get(&(granter, toucher)).copied();
        self.transfers.push(Transfer {
            toucher,
            granter,
            chunk,
            dst_blocks,
            posted_at: self.now,
            completed_at: None,
            status_after,
        });
        if self.hostile {
            return;
        }
        assert!(
            until.is_some_and(|u| self.now < u),
            "{toucher:?} started a transfer on {granter:?} at {:?} outside any lease (granted until {:?})",
            self.now - self.t0,
            until.map(|u| u - self.t0)
        );
        assert!(
            !self.is_released(granter),
            "{toucher:?} touches {granter:?} after it released"
        );
        assert!(
            !self.is_released(toucher),
            "{toucher:?} started a transfer after its own release"
        );
    }

    fn route_p(&mut self, i: usize) {
        while let Some(a) = self.ps[i].poll_action() {
            match a {
                send::Action::Send { peer, msg } | send::Action::Resend { peer, msg } => {
                    let j = (peer.0 - 200) as usize;
                    if j >= self.sc.n_d {
                        assert!(self.hostile, "P{i} addresses a D rank that does not exist");
                        continue;
                    }
                    self.note_grant(Node::P(i), Node::D(j), &msg);
                    self.net.push(Packet {
                        from: Node::P(i),
                        to: Node::D(j),
                        msg,
                    });
                }
                send::Action::Write {
                    peer,
                    chunk,
                    src_blocks,
                    dst_blocks,
                    status_after,
                } => {
                    assert_eq!(self.sc.mode, Mode::Push);
                    assert_eq!(src_blocks[0].len(), dst_blocks[0].len());
                    let j = (peer.0 - 200) as usize;
                    if j >= self.sc.n_d {
                        assert!(self.hostile, "P{i} addresses a D rank that does not exist");
                        continue;
                    }
                    self.start_transfer(
                        Node::P(i),
                        Node::D(j),
                        chunk,
                        dst_blocks[0].clone(),
                        status_after,
                    );
                }
                send::Action::ReleaseBlocks { outcome } => {
                    assert!(outcome.is_terminal());
                    assert_eq!(self.ps[i].phase(), outcome);
                    self.mark_release(Node::P(i));
                }
            }
        }
    }

    fn route_d(&mut self, j: usize) {
        while let Some(a) = self.ds[j].poll_action() {
            match a {
                recv::Action::Send { peer, msg } | recv::Action::Resend { peer, msg } => {
                    let i = (peer.0 - 100) as usize;
                    if i >= self.sc.n_p {
                        assert!(self.hostile, "D{j} addresses a P rank that does not exist");
                        continue;
                    }
                    self.note_grant(Node::D(j), Node::P(i), &msg);
                    self.net.push(Packet {
                        from: Node::D(j),
                        to: Node::P(i),
                        msg,
                    });
                }
                recv::Action::Read {
                    peer,
                    chunk,
                    src_blocks,
                    dst_blocks,
                } => {
                    assert_eq!(self.sc.mode, Mode::Pull);
                    assert_eq!(src_blocks[0].len(), dst_blocks[0].len());
                    let i = (peer.0 - 100) as usize;
                    if i >= self.sc.n_p {
                        assert!(self.hostile, "D{j} addresses a P rank that does not exist");
                        continue;
                    }
                    self.start_transfer(
                        Node::D(j),
                        Node::P(i),
                        chunk,
                        dst_blocks[0].clone(),
                        false,
                    );
                }
                recv::Action::Received => {
                    assert_eq!(self.ds[j].phase(), Phase::Success);
                    let all: BTreeSet<BlockId> = dst_of(j, self.sc.dst_len).into_iter().collect();
                    for i in (0..self.sc.n_p).filter(|_| !self.hostile) {
                        let got = self.landed.get(&(i, j)).cloned().unwrap_or_default();
                        assert!(
                            got.is_superset(&all),
                            "D{j} reports Received but P{i} delivered only {got:?}"
                        );
                    }
                    self.mark_release(Node::D(j));
                }
                recv::Action::LoadFailed { block_ids } => {
                    assert!(matches!(
                        self.ds[j].phase(),
                        Phase::Failed(_) | Phase::Expired
                    ));
                    assert_eq!(block_ids, dst_of(j, self.sc.dst_len));
                    self.mark_release(Node::D(j));
                }
            }
        }
    }

    fn note_grant(&mut self, granter: Node, toucher: Node, msg: &Msg) {
        if let Msg::LeaseGrant { duration_ms, .. } = msg {
            let end = self.now + Duration::from_millis(*duration_ms);
            let e = self.granted_until.entry((granter, toucher)).or_insert(end);
            *e = (*e).max(end);
        }
    }

    fn route(&mut self, n: Node) {
        match n {
            Node::P(i) => self.route_p(i),
            Node::D(j) => self.route_d(j),
        }
    }

    fn check_all(&self) {
        for (i, p) in self.ps.iter().enumerate() {
            assert_eq!(
                p.phase().is_terminal(),
                self.is_released(Node::P(i)),
                "P{i} phase vs release"
            );
            assert_eq!(p.is_released(), self.is_released(Node::P(i)));
            if let Some(t) = p.poll_timeout() {
                assert!(t > self.now, "P{i} has an overdue deadline");
            }
        }
        for (j, d) in self.ds.iter().enumerate() {
            assert_eq!(
                d.phase().is_terminal(),
                self.is_released(Node::D(j)),
                "D{j} phase vs report"
            );
            assert_eq!(d.is_reported(), self.is_released(Node::D(j)));
            if let Some(t) = d.poll_timeout() {
                assert!(t > self.now, "D{j} has an overdue deadline");
            }
        }
    }

    fn deliver(&mut self, pkt: Packet) {
        let now = self.now;
        match (pkt.from, pkt.to) {
            (Node::D(j), Node::P(i)) => {
                let r = self.ps[i].handle_event(
                    now,
                    send::Event::Msg {
                        peer: d_id(j),
                        msg: pkt.msg.clone(),
                    },
                );
                assert!(
                    self.hostile || r.is_ok(),
                    "honest {:?} from D{j} refused by P{i}: {r:?}",
                    pkt.msg
                );
                self.route_p(i);
            }
            (Node::P(i), Node::D(j)) => {
                let r = self.ds[j].handle_event(
                    now,
                    recv::Event::Msg {
                        peer: p_id(i),
                        msg: pkt.msg.clone(),
                    },
                );
                assert!(
                    self.hostile || r.is_ok(),
                    "honest {:?} from P{i} refused by D{j}: {r:?}",
                    pkt.msg
                );
                self.route_d(j);
            }
            (from, to) => panic!("no link {from:?} -> {to:?}"),
        }
    }

    /// Completes transfer `k`: it landed when `ok` (and not past its
    /// bound); with `ack_lost` its initiator hears a failure all the same.
    fn complete(&mut self, k: usize, ok: bool, ack_lost: bool) {
        let t = &mut self.transfers[k];
        // A transfer past its bound can no longer land: only a late, failed
        // notification can still arrive.
        let late = t.posted_at + self.cfg.transfer_bound <= self.now;
        let landed = ok && !late;
        t.completed_at = Some(self.now.min(t.posted_at + self.cfg.transfer_bound));
        let (toucher, granter, chunk) = (t.toucher, t.granter, t.chunk);
        let status_after = t.status_after;
        if landed {
            let (pi, dj) = match (toucher, granter) {
                (Node::P(i), Node::D(j)) | (Node::D(j), Node::P(i)) => (i, j),
                _ => unreachable!(),
            };
            let blocks = t.dst_blocks.clone();
            self.landed.entry((pi, dj)).or_default().extend(blocks);
            if status_after {
                // The driver's `Status`, sent once the write landed.
                self.net.push(Packet {
                    from: toucher,
                    to: granter,
                    msg: Msg::Status { ok: true },
                });
            }
        }
        let ok = landed && !ack_lost;
        let now = self.now;
        match (toucher, granter) {
            (Node::P(i), Node::D(j)) => {
                let r = self.ps[i].handle_event(
                    now,
                    send::Event::WriteDone {
                        peer: d_id(j),
                        chunk,
                        ok,
                    },
                );
                assert_eq!(r, Ok(()), "completion refused by P{i}");
                self.route_p(i);
            }
            (Node::D(j), Node::P(i)) => {
                let r = self.ds[j].handle_event(
                    now,
                    recv::Event::ReadDone {
                        peer: p_id(i),
                        chunk,
                        ok,
                    },
                );
                assert_eq!(r, Ok(()), "completion refused by D{j}");
                self.route_d(j);
            }
            _ => unreachable!(),
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        let p = self.ps.iter().filter_map(|m| m.poll_timeout()).min();
        let d = self.ds.iter().filter_map(|m| m.poll_timeout()).min();
        match (p, d) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, None) => a,
            (None, b) => b,
        }
    }

    /// Moves time forward the way a driver's timer does: every deadline on
    /// the way fires at its time.
    fn advance_to(&mut self, target: Instant) {
        for _ in 0..10_000 {
            match self.next_deadline() {
                Some(t) if t <= target => {
                    self.now = self.now.max(t);
                    self.fire_due();
                }
                Some(_) | None => {
                    self.now = self.now.max(target);
                    return;
                }
            }
        }
        panic!("deadlines do not progress");
    }

    fn fire_due(&mut self) {
        let now = self.now;
        for i in 0..self.ps.len() {
            if self.ps[i].poll_timeout().is_some_and(|t| t <= now) {
                self.ps[i].handle_timeout(now);
                self.route_p(i);
            }
        }
        for j in 0..self.ds.len() {
            if self.ds[j].poll_timeout().is_some_and(|t| t <= now) {
                self.ds[j].handle_timeout(now);
                self.route_d(j);
            }
        }
    }

    fn in_flight(&self) -> Vec<usize> {
        (0..self.transfers.len())
            .filter(|&k| self.transfers[k].completed_at.is_none())
            .collect()
    }

    fn junk_msg(kind: u8, x: u64) -> Msg {
        match kind {
            0 => Msg::Pull {
                receivers_expected: x as u16,
                dst_blocks: vec![vec![BlockId(x as u32)]],
                prefix_blocks: vec![0],
                lease_seq: Some(x),
            },
            1 => Msg::Ready {
                chunk: x as u32,
                start_blocks: vec![0],
                src_blocks: vec![vec![BlockId(7)]],
                is_last: x.is_multiple_of(2),
            },
            2 => Msg::LeaseRequest { seq: x },
            3 => Msg::LeaseGrant {
                seq: x + 1000,
                duration_ms: 5_000,
            },
            4 => Msg::Status {
                ok: x.is_multiple_of(2),
            },
            5 => Msg::Done {
                ok: x.is_multiple_of(2),
            },
            6 => Msg::Abort,
            7 => Msg::AbortAck,
            _ => Msg::Ready {
                chunk: u32::MAX,
                start_blocks: vec![],
                src_blocks: vec![vec![]; 100],
                is_last: true,
            },
        }
    }

    fn apply(&mut self, s: &Step) {
        let now = self.now;
        match *s {
            Step::Advance(ms) => self.advance_to(now + Duration::from_millis(ms)),
            Step::Deliver(k) => {
                if !self.net.is_empty() {
                    let pkt = self.net.remove(k % self.net.len());
                    self.deliver(pkt);
                }
            }
            Step::Drop(k) => {
                if !self.net.is_empty() {
                    self.net.remove(k % self.net.len());
                }
            }
            Step::Duplicate(k) => {
                if !self.net.is_empty() {
                    let pkt = self.net[k % self.net.len()].clone();
                    self.net.push(pkt);
                }
            }
            Step::Complete(k, ok) => {
                let open = self.in_flight();
                if !open.is_empty() {
                    self.complete(open[k % open.len()], ok, false);
                }
            }
            Step::AckLost(k) => {
                let open = self.in_flight();
                if !open.is_empty() {
                    self.complete(open[k % open.len()], true, true);
                }
            }
            Step::StaleCompletion(k) => {
                // A completion delivered twice: a live machine refuses it as misuse
                // without changing; a finished one absorbs it.
                let done: Vec<usize> = (0..self.transfers.len())
                    .filter(|&k| self.transfers[k].completed_at.is_some())
                    .collect();
                if let Some(&k) = done.get(k % done.len().max(1)) {
                    let t = self.transfers[k].clone();
                    match (t.toucher, t.granter) {
                        (Node::P(i), Node::D(j)) => {
                            let mut m = self.ps[i].clone();
                            let before = format!("{m:?}");
                            if m.handle_event(
                                now,
                                send::Event::WriteDone {
                                    peer: d_id(j),
                                    chunk: t.chunk,
                                    ok: true,
                                },
                            )
                            .is_err()
                            {
                                assert_eq!(before, format!("{m:?}"));
                            }
                        }
                        (Node::D(j), Node::P(i)) => {
                            let mut m = self.ds[j].clone();
                            let before = format!("{m:?}");
                            if m.handle_event(
                                now,
                                recv::Event::ReadDone {
                                    peer: p_id(i),
                                    chunk: t.chunk,
                                    ok: true,
                                },
                            )
                            .is_err()
                            {
                                assert_eq!(before, format!("{m:?}"));
                            }
                        }
                        _ => unreachable!(),
                    }
                }
            }
            Step::ChunkReady(i) => {
                let i = i % self.sc.n_p;
                let given = self.chunks_given[i];
                if given < self.sc.chunk_sizes.len() {
                    let start: usize = self.sc.chunk_sizes[..given].iter().sum();
                    let size = self.sc.chunk_sizes[given];
                    let src = (start..start + size)
                        .map(|b| BlockId((i * 100 + b) as u32))
                        .collect();
                    let is_last = given + 1 == self.sc.chunk_sizes.len();
                    self.chunks_given[i] += 1;
                    let r = self.ps[i].handle_event(
                        now,
                        send::Event::ChunkReady {
                            src_blocks: vec![src],
                            is_last,
                        },
                    );
                    assert_eq!(r, Ok(()));
                    self.route_p(i);
                }
            }
            Step::Resolve(j) => {
                let j = j % self.sc.n_d;
                if !self.resolved[j] {
                    self.resolved[j] = true;
                    let peers = (0..self.sc.n_p)
                        .map(|i| ResolvedPeer {
                            peer: p_id(i),
                            receivers_expected: self.sc.n_d as u16,
                            lease_ticket: None,
                        })
                        .collect();
                    let r = self.ds[j].handle_event(
                        now,
                        recv::Event::PeersResolved {
                            peers,
                            unneeded: Vec::new(),
                        },
                    );
                    assert_eq!(r, Ok(()));
                    self.route_d(j);
                }
            }
            Step::Abort(side, k, r) => {
                let reason = [
                    AbortReason::Engine,
                    AbortReason::ClientDisconnect,
                    AbortReason::Shutdown,
                ][r as usize];
                let n = self.pick(side, k);
                match n {
                    Node::P(i) => self.ps[i].abort(now, reason),
                    Node::D(j) => self.ds[j].abort(now, reason),
                }
                self.route(n);
            }
            Step::PeerDead(side, k, p) | Step::PlanFailed(side, k, p) => {
                let dead = matches!(s, Step::PeerDead(..));
                let n = self.pick(side, k);
                let r = match n {
                    Node::P(i) => {
                        let peer = d_id(p % (self.sc.n_d + 1));
                        let e = if dead {
                            send::Event::PeerDead { peer }
                        } else {
                            send::Event::PlanFailed { peer }
                        };
                        self.ps[i].handle_event(now, e)
                    }
                    Node::D(j) => {
                        let peer = p_id(p % (self.sc.n_p + 1));
                        let e = if dead {
                            recv::Event::PeerDead { peer }
                        } else {
                            recv::Event::PlanFailed { peer }
                        };
                        self.ds[j].handle_event(now, e)
                    }
                };
                assert_eq!(r, Ok(()));
                self.route(n);
            }
            Step::SpuriousTimeout(side, k) => {
                let n = self.pick(side, k);
                match n {
                    Node::P(i) => self.ps[i].handle_timeout(now),
                    Node::D(j) => self.ds[j].handle_timeout(now),
                }
                self.route(n);
            }
            Step::Junk(side, k, p, kind, x) => {
                // Junk goes to a clone: a refused input must leave it unchanged,
                // an accepted one is a lie we cannot defend against, so the
                // clone is thrown away either way. Nothing may panic.
                let msg = Self::junk_msg(kind, x);
                if self.hostile {
                    let n = self.pick(side, k);
                    let _ = match n {
                        Node::P(i) => self.ps[i].handle_event(
                            now,
                            send::Event::Msg {
                                peer: d_id(p % 5),
                                msg,
                            },
                        ),
                        Node::D(j) => self.ds[j].handle_event(
                            now,
                            recv::Event::Msg {
                                peer: p_id(p % 5),
                                msg,
                            },
                        ),
                    };
                    self.route(n);
                    return;
                }
                match self.pick(side, k) {
                    Node::P(i) => {
                        let mut m = self.ps[i].clone();
                        let before = format!("{m:?}");
                        if m.handle_event(
                            now,
                            send::Event::Msg {
                                peer: d_id(p % 5),
                                msg,
                            },
                        )
                        .is_err()
                        {
                            assert_eq!(before, format!("{m:?}"), "refused junk changed P{i}");
                        }
                        while m.poll_action().is_some() {}
                    }
                    Node::D(j) => {
                        let mut m = self.ds[j].clone();
                        let before = format!("{m:?}");
                        if m.handle_event(
                            now,
                            recv::Event::Msg {
                                peer: p_id(p % 5),
                                msg,
                            },
                        )
                        .is_err()
                        {
                            assert_eq!(before, format!("{m:?}"), "refused junk changed D{j}");
                        }
                        while m.poll_action().is_some() {}
                    }
                }
            }
        }
    }

    fn pick(&self, side: bool, k: usize) -> Node {
        if side {
            Node::P(k % self.sc.n_p)
        } else {
            Node::D(k % self.sc.n_d)
        }
    }

    /// Liveness: no more engine input; messages either all dropped or all
    /// delivered at once; time runs until nothing is pending.
    fn finale(&mut self) {
        let start = self.now;
        for _ in 0..100_000 {
            if self.sc.finale_delivers {
                while !self.net.is_empty() {
                    let pkt = self.net.remove(0);
                    self.deliver(pkt);
                }
            } else {
                self.net.clear();
            }
            self.check_all();
            match self.next_deadline() {
                Some(t) => {
                    self.now = self.now.max(t);
                    self.fire_due();
                }
                None => break,
            }
        }
        let c = self.cfg;
        let bound = c.bootstrap_timeout
            + c.waiting_timeout
            + c.hold_limit
            + c.lease
            + c.fence()
            + c.transfer_bound;
        assert!(
            self.now <= start + bound,
            "took {:?} after the last input",
            self.now - start
        );
        for i in 0..self.sc.n_p {
            assert!(
                self.is_released(Node::P(i)),
                "P{i} never released (phase {:?})",
                self.ps[i].phase()
            );
        }
        for j in 0..self.sc.n_d {
            assert!(
                self.is_released(Node::D(j)),
                "D{j} never reported (phase {:?})",
                self.ds[j].phase()
            );
        }
    }
}

fn dst_of(j: usize, len: usize) -> Vec<BlockId> {
    (0..len)
        .map(|k| BlockId((1000 + j * 100 + k) as u32))
        .collect()
}

fn run(sc: Scenario) -> World {
    run_with(sc, false)
}

fn run_with(sc: Scenario, hostile: bool) -> World {
    let steps = sc.steps.clone();
    let mut w = World::new(sc);
    w.hostile = hostile;
    w.check_all();
    for s in &steps {
        w.apply(s);
        w.check_all();
    }
    w.finale();
    w
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_for_random_pairs(sc in scenario()) {
        run(sc);
    }

    /// Peers that send junk into the live machines: nothing panics, every
    /// machine still releases exactly once and by its deadlines.
    #[test]
    fn hostile_peers_cannot_break_exactly_once_or_liveness(sc in scenario()) {
        run_with(sc, true);
    }
}

/// The random runs reach every kind of ending, so the properties above are
/// not checked on trivial runs only.
#[test]
fn random_runs_cover_every_outcome() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let mut seen: BTreeMap<(String, String), usize> = BTreeMap::new();
    let mut transfers = 0;
    for _ in 0..400 {
        let sc = scenario().new_tree(&mut runner).unwrap().current();
        let mode = format!("{:?}", sc.mode);
        let w = run(sc);
        transfers += w.transfers.len();
        for p in &w.ps {
            *seen
                .entry((mode.clone(), format!("P {:?}", p.phase())))
                .or_default() += 1;
        }
        for d in &w.ds {
            *seen
                .entry((mode.clone(), format!("D {:?}", d.phase())))
                .or_default() += 1;
        }
    }
    eprintln!("{transfers} transfers; outcomes: {seen:?}");
    assert!(transfers > 500, "only {transfers} transfers started");
    for mode in ["Push", "Pull"] {
        for side in ["P", "D"] {
            for phase in [
                "Success",
                "Expired",
                "Failed(Aborted",
                "Failed(PeerDead)",
                "Failed(PeerAborted)",
            ] {
                let n: usize = seen
                    .iter()
                    .filter(|((m, p), _)| m == mode && p.starts_with(&format!("{side} {phase}")))
                    .map(|(_, n)| n)
                    .sum();
                assert!(n > 0, "no {mode} run ends with {side} {phase}: {seen:?}");
            }
        }
    }
}

/// A cooperative run must succeed: the harness is not vacuously permissive.
#[test]
fn cooperative_runs_succeed_in_both_modes() {
    for mode in [Mode::Push, Mode::Pull] {
        let mut steps = Vec::new();
        steps.extend((0..3).map(Step::Resolve));
        steps.extend((0..3).map(Step::ChunkReady));
        steps.extend((0..3).map(Step::ChunkReady));
        for _ in 0..40 {
            steps.push(Step::Deliver(0));
            steps.push(Step::Complete(0, true));
        }
        let sc = Scenario {
            mode,
            n_p: 3,
            n_d: 2,
            dst_len: 3,
            prefix: 1,
            chunk_sizes: vec![2, 2],
            steps: steps.clone(),
            finale_delivers: true,
        };
        let mut w = World::new(sc);
        for s in &steps {
            w.apply(s);
            w.check_all();
        }
        for (i, p) in w.ps.iter().enumerate() {
            assert_eq!(p.phase(), Phase::Success, "{mode:?} P{i}");
        }
        for (j, d) in w.ds.iter().enumerate() {
            assert_eq!(d.phase(), Phase::Success, "{mode:?} D{j}");
        }
    }
}
