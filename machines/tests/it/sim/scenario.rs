//! What one seed simulates: the cluster, the machines' configuration, the
//! requests and the faults, all drawn from the seed before the run starts.
//!
//! Drawing the plan up front (instead of deciding faults on the fly) keeps a
//! seed's scenario stable and printable; the run itself draws only the
//! per-message and per-transfer randomness from its own stream.

use std::time::Duration;

use kvferry_machines::internal::common::{Config, Mode};
use kvferry_machines::{AbortReason, TransferId};

use super::checker::us;
use super::rng::Rng;

/// Simulated time: microseconds since the start of the run.
pub(crate) type T = u64;

pub(crate) const MS: T = 1_000;

pub(crate) fn ms(m: u64) -> Duration {
    Duration::from_millis(m)
}

/// Safeguards the self-tests switch off to show the checker catches what
/// they prevent. All off in every normal run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Switches {
    /// Breaks the transport contract: a transfer may touch memory up to
    /// three transfer bounds after it was posted, although the machines
    /// were promised one.
    pub late_touches: bool,
    /// Sets `Config::unsafe_disable_fence` in every machine.
    pub disable_fence: bool,
    /// Sets `Config::unsafe_ignore_in_flight` in every machine.
    pub ignore_in_flight: bool,
    /// Clocks drift ten times more than `fence_margin` covers.
    pub excess_drift: bool,
    /// The driver forgets one timer in four (`poll_timeout` not armed).
    pub lose_timers: bool,
    /// P's driver answers every late `Pull` with `Abort`, also after a
    /// successful transfer (what the machines' docs asked at first).
    pub abort_after_success: bool,
    /// P's driver counts a lease ticket from when D *used* it plus a
    /// lease, not from when P sent it: the mistake the ticket rule exists
    /// to prevent (a lease counted from after the grant).
    pub ticket_from_grant_time: bool,
}

/// Faults of the control network, per message.
#[derive(Clone, Debug)]
pub(crate) struct NetParams {
    pub drop_ppm: u32,
    pub dup_ppm: u32,
    pub delay_min: T,
    pub delay_max: T,
    /// Share of messages that take a long detour (reordering across leases).
    pub tail_ppm: u32,
    pub tail_max: T,
    /// Messages on one link arrive in the order they were sent.
    pub fifo: bool,
}

/// Faults of the data plane, per posted write or read.
#[derive(Clone, Debug)]
pub(crate) struct TransportParams {
    /// The transfer completes with an error (and may have landed partly).
    pub fail_ppm: u32,
    /// The transfer never reports; it stops touching memory at the bound.
    pub hang_ppm: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    P,
    D,
}

/// An engine-side abort or a client disconnect of one rank's machine.
#[derive(Clone, Debug)]
pub(crate) struct AbortSpec {
    pub side: Side,
    pub rank: usize,
    /// Offset from the request's arrival.
    pub at: T,
    pub reason: AbortReason,
}

/// One request: which ranks take part, how its KV is laid out and chunked,
/// and when the engines act on it.
#[derive(Clone, Debug)]
pub(crate) struct RequestSpec {
    pub id: TransferId,
    pub arrive: T,
    pub mode: Mode,
    /// Nodes of the P ranks (one machine each).
    pub p_nodes: Vec<usize>,
    /// Nodes of the D ranks (one machine each).
    pub d_nodes: Vec<usize>,
    /// For each D rank, the P ranks (indices into `p_nodes`) it contacts.
    pub pairs: Vec<Vec<usize>>,
    /// For each D rank, the unpaired P ranks (in no D rank's `pairs`, as
    /// replicated heads leave them) it tells `Unneeded`: rank `i` is told
    /// by D rank `i % tp_d`, the node's rule.
    pub unneeded: Vec<Vec<usize>>,
    /// Per group: P's blocks for the whole prompt.
    pub total: Vec<u32>,
    /// Per group: leading blocks D already holds (prefix hit).
    pub prefix: Vec<u32>,
    /// Per chunk, per group: how many blocks the chunk adds.
    pub chunks: Vec<Vec<u32>>,
    /// Per P rank: creation offset from arrival.
    pub p_create: Vec<T>,
    /// Per D rank: creation offset from arrival.
    pub d_create: Vec<T>,
    /// Per D rank: offset from its creation until the P ranks are resolved.
    pub resolve: Vec<T>,
    /// Per P rank, per chunk: offset from the P machine's creation.
    pub chunk_at: Vec<Vec<T>>,
    pub aborts: Vec<AbortSpec>,
    /// The planner rejects one rank's peer (rare).
    pub plan_fail: Option<(Side, usize, T)>,
    /// A flaky detector declares a live, reachable peer dead (rare): safety
    /// must not depend on the detector being right.
    pub false_dead: Option<(Side, usize, T)>,
    /// How long D's engine decodes before it frees blocks that received KV.
    pub decode: T,
}

impl RequestSpec {
    /// How many D ranks contact P rank `p`.
    pub(crate) fn receivers_expected(&self, p: usize) -> u16 {
        self.pairs.iter().filter(|ps| ps.contains(&p)).count() as u16
    }

    /// D ranks that contact P rank `p`.
    pub(crate) fn d_ranks_of(&self, p: usize) -> Vec<usize> {
        (0..self.d_nodes.len())
            .filter(|&j| self.pairs[j].contains(&p))
            .collect()
    }

    /// D's destination blocks per group.
    pub(crate) fn dst_len(&self, g: usize) -> u32 {
        self.total[g] - self.prefix[g]
    }
}

#[derive(Clone, Debug)]
pub(crate) struct CrashSpec {
    pub node: usize,
    pub at: T,
    pub down_for: T,
}

/// Nodes whose bit is set are cut off from the others (one way: they
/// still hear the others, but nobody hears them).
#[derive(Clone, Debug)]
pub(crate) struct PartitionSpec {
    pub side_mask: u64,
    pub one_way: bool,
    pub at: T,
    pub heal_after: T,
}

#[derive(Clone, Debug)]
pub(crate) struct Scenario {
    pub seed: u64,
    pub cfg: Config,
    /// P ranks live on nodes `0..n_p`, D ranks on `n_p..n_p + n_d`.
    pub n_p: usize,
    pub n_d: usize,
    pub pool_blocks: u32,
    pub net: NetParams,
    pub transport: TransportParams,
    /// Nodes tick their liveness tables, which declare silent peers dead;
    /// off: no ticks, silence only.
    pub detector: bool,
    /// A restarted peer is noticed at once (its connections reset).
    pub reset_on_restart: bool,
    pub requests: Vec<RequestSpec>,
    pub crashes: Vec<CrashSpec>,
    pub partitions: Vec<PartitionSpec>,
    pub switches: Switches,
    /// No fault that may fail a request (calm or jittery): every request
    /// must succeed.
    pub calm: bool,
    /// Calm, but the network duplicates, reorders and the clocks drift.
    pub jittery: bool,
    /// Per node: how fast its clock runs, in parts per million (negative: slow).
    pub drift_ppm: Vec<i64>,
    /// P's driver creates the machine on D's first `Pull` (else it buffers
    /// D's messages until the engine knows the request).
    pub create_on_pull: bool,
    /// P's driver answers a `Pull` for a finished transfer with `Abort`.
    pub abort_late_pulls: bool,
    /// On FIFO links, both drivers answer what arrives for a finished
    /// transfer as the node does: `Abort` to `Pull`, `Ready` and
    /// `LeaseRequest`, `AbortAck` to `Abort`, whatever the outcome.
    pub answer_like_node: bool,
}

impl Scenario {
    pub(crate) fn nodes(&self) -> usize {
        self.n_p + self.n_d
    }

    pub(crate) fn is_p_node(&self, node: usize) -> bool {
        node < self.n_p
    }

    /// Draws the scenario of `seed`.
    pub(crate) fn generate(seed: u64, switches: Switches) -> Scenario {
        Scenario::draw(seed, switches, None)
    }

    /// The goodput profile: no fault but `drop_ppm` of the control
    /// messages lost, with the node's drivers (machines created on the
    /// first `Pull`, late messages answered as the node does).
    pub(crate) fn lossy(seed: u64, drop_ppm: u32) -> Scenario {
        Scenario::draw(seed, Switches::default(), Some(drop_ppm))
    }

    fn draw(seed: u64, switches: Switches, lossy: Option<u32>) -> Scenario {
        let mut rng = Rng::new(seed);
        // One run in eight has no faults, so that the success path (and the
        // data check of `Received`) is exercised in bulk too; one in eight
        // is jittery: duplicates, reordering and drift, which must not fail
        // a request either.
        let profile = rng.below(8);
        // The late-`Pull` self-test needs duplicates that arrive late and
        // overtake: every run is jittery there. A lossy run is drawn as a
        // calm one, then loses messages.
        let calm = profile <= 1 || switches.abort_after_success || lossy.is_some();
        let jittery = (profile == 1 || switches.abort_after_success) && lossy.is_none();
        let hb = rng.range(2, 5);
        let mut cfg = Config {
            bootstrap_timeout: ms(rng.range(40, 120)),
            waiting_timeout: ms(rng.range(60, 150)),
            claim_timeout: ms(rng.range(20, 60)),
            lease: ms(hb * rng.range(2, 5)),
            hold_limit: ms(rng.range(150, 400)),
            transfer_bound: ms(rng.range(1, 10)),
            fence_margin: ms(rng.range(0, 2)),
            heartbeat_interval: ms(hb),
            heartbeat_misses: rng.range(2, 3) as u32,
            max_in_flight: rng.range(1, 8) as usize,
            max_lease_requests: rng.range(1, 4) as usize,
            resend_after: ms(rng.range(1, hb + 1)),
            // Off in one seed in nine (a lossy run always resends).
            max_resends: rng.range(u64::from(lossy.is_some()) * 4, 9) as u32,
            ..Config::default()
        };
        if calm {
            // Without faults every request must succeed, so no timer may be
            // shorter than a healthy transfer (prefill, chunks and writes
            // serialised by a small `max_in_flight`).
            cfg.bootstrap_timeout = ms(300);
            cfg.waiting_timeout = ms(300);
            cfg.claim_timeout = ms(200);
            cfg.hold_limit = ms(800);
        }
        apply_switches(&mut cfg, switches);
        cfg.validate()
            .expect("the simulator draws valid configurations");
        let n_p = rng.range(1, 6) as usize;
        let n_d = rng.range(1, 6) as usize;
        let nodes = n_p + n_d;

        let net = if jittery {
            // Delays well inside a lease, so that grants arrive in time.
            let delay_min = rng.range(10, 200);
            NetParams {
                drop_ppm: 0,
                dup_ppm: if switches.abort_after_success {
                    300_000
                } else {
                    rng.range(0, 50_000) as u32
                },
                delay_min,
                // and before the toucher forgets its request: with
                // `max_lease_requests` remembered and one asked every
                // heartbeat, a grant must come back within that many
                // heartbeats or it is ignored (a round trip longer than
                // that starves the toucher of leases: found by seed 5334).
                delay_max: (delay_min + rng.range(100, 3_000))
                    .min(us(cfg.lease) / 4)
                    .min(us(cfg.heartbeat_interval) * cfg.max_lease_requests as u64 / 3)
                    .max(delay_min),
                tail_ppm: 0,
                tail_max: 0,
                fifo: rng.below(2) == 0 && !switches.abort_after_success,
            }
        } else if calm {
            NetParams {
                drop_ppm: lossy.unwrap_or(0),
                dup_ppm: 0,
                delay_min: 20,
                delay_max: 500,
                tail_ppm: 0,
                tail_max: 0,
                fifo: rng.below(2) == 0,
            }
        } else {
            let delay_min = rng.range(10, 200);
            NetParams {
                drop_ppm: rng.range(0, 40_000) as u32,
                dup_ppm: rng.range(0, 40_000) as u32,
                delay_min,
                delay_max: delay_min + rng.range(100, 3_000),
                tail_ppm: rng.range(0, 20_000) as u32,
                tail_max: rng.range(1, 40) * MS,
                fifo: rng.below(2) == 0,
            }
        };
        let transport = if calm {
            TransportParams {
                fail_ppm: 0,
                hang_ppm: 0,
            }
        } else {
            TransportParams {
                fail_ppm: rng.range(0, 30_000) as u32,
                hang_ppm: rng.range(0, 10_000) as u32,
            }
        };

        let n_req = rng.range(4, 40) as usize;
        let horizon = 150 * MS;
        let mut requests = Vec::with_capacity(n_req);
        for r in 0..n_req {
            requests.push(gen_request(&mut rng, r, n_p, n_d, horizon, calm));
        }

        let mut crashes = Vec::new();
        let mut partitions = Vec::new();
        if !calm {
            for _ in 0..rng.below(3) {
                crashes.push(CrashSpec {
                    node: rng.below(nodes as u64) as usize,
                    at: rng.below(horizon + 50 * MS),
                    down_for: rng.range(1, 80) * MS,
                });
            }
            for _ in 0..rng.below(4) {
                let side_mask = if rng.below(2) == 0 {
                    1u64 << rng.below(nodes as u64)
                } else {
                    rng.next_u64() & ((1u64 << nodes) - 1)
                };
                partitions.push(PartitionSpec {
                    side_mask,
                    one_way: rng.below(3) == 0,
                    at: rng.below(horizon + 50 * MS),
                    heal_after: rng.range(1, 60) * MS,
                });
            }
        }
        // Clock-rate drift. With the toucher's clock slow by `r` and the
        // granter's fast by `r`, the toucher's last touch (lease plus bound
        // on its clock) must come before the granter's fence ends (lease,
        // margin and bound on its clock): `(l + b)(1 + r) <= (l + b + m)(1 - r)`,
        // so `r <= m / (2(l + b) + m)`. Keep within that, or go ten times
        // past it for the self-test.
        let exposure = us(cfg.lease + cfg.transfer_bound) as i64;
        let margin = us(cfg.fence_margin) as i64;
        let covered = margin * 1_000_000 / (2 * exposure + margin);
        let max_drift = if switches.excess_drift {
            // Capped so that every clock still runs forward.
            (10 * covered.max(5_000)).min(500_000)
        } else if calm && !jittery {
            0
        } else {
            covered
        };
        let drift_ppm = (0..nodes)
            .map(|_| rng.range(0, 2 * max_drift as u64) as i64 - max_drift)
            .collect();
        // The node's answers hold on any link: after a success they repeat
        // the machine's last words, which no reordering makes wrong.
        let answer_like_node = rng.below(2) == 0 || lossy.is_some();
        Scenario {
            seed,
            cfg,
            n_p,
            n_d,
            pool_blocks: 1024,
            net,
            transport,
            detector: rng.below(4) != 0,
            reset_on_restart: rng.below(2) == 0,
            requests,
            crashes,
            partitions,
            switches,
            // Lost messages may fail a request: only goodput is measured.
            calm: calm && lossy.is_none(),
            jittery,
            drift_ppm,
            create_on_pull: rng.below(2) == 0 || lossy.is_some(),
            abort_late_pulls: rng.below(4) != 0 || switches.abort_after_success,
            answer_like_node,
        }
    }
}

/// Turns the self-test switches into the machines' test-only settings.
fn apply_switches(cfg: &mut Config, switches: Switches) {
    cfg.unsafe_disable_fence = switches.disable_fence;
    cfg.unsafe_ignore_in_flight = switches.ignore_in_flight;
}

/// Ranks `start, start + 1, ...` (wrapping) of a pool of `n` nodes, `k` of them.
fn ranks(start: u64, k: usize, n: usize, offset: usize) -> Vec<usize> {
    (0..k).map(|i| offset + (start as usize + i) % n).collect()
}

fn gen_request(
    rng: &mut Rng,
    r: usize,
    n_p: usize,
    n_d: usize,
    horizon: T,
    calm: bool,
) -> RequestSpec {
    let tp = |rng: &mut Rng, n: usize| -> usize {
        let choices: Vec<usize> = [1usize, 2, 4].into_iter().filter(|&k| k <= n).collect();
        choices[rng.below(choices.len() as u64) as usize]
    };
    let tp_p = tp(rng, n_p);
    let tp_d = tp(rng, n_d);
    let p_nodes = ranks(rng.below(n_p as u64), tp_p, n_p, 0);
    let d_nodes = ranks(rng.below(n_d as u64), tp_d, n_d, n_p);

    // Pairing: the heterogeneous-TP plan (each P rank feeds the D rank that
    // holds its heads, or each D rank reads the P rank that holds its
    // heads), or an arbitrary bipartite one in which every rank has a peer.
    let pairs: Vec<Vec<usize>> = if rng.below(5) == 0 {
        let mut pairs: Vec<Vec<usize>> = (0..tp_d)
            .map(|_| (0..tp_p).filter(|_| rng.below(2) == 0).collect())
            .collect();
        for (j, ps) in pairs.iter_mut().enumerate() {
            if ps.is_empty() {
                ps.push(j % tp_p);
            }
        }
        for i in 0..tp_p {
            if !pairs.iter().any(|ps| ps.contains(&i)) {
                let j = rng.below(tp_d as u64) as usize;
                pairs[j].push(i);
                pairs[j].sort_unstable();
            }
        }
        pairs
    } else if tp_p >= tp_d {
        (0..tp_d)
            .map(|j| (0..tp_p).filter(|&i| i * tp_d / tp_p == j).collect())
            .collect()
    } else {
        (0..tp_d).map(|j| vec![j * tp_p / tp_d]).collect()
    };

    let groups = rng.range(1, 2) as usize;
    let mut total = Vec::with_capacity(groups);
    let mut prefix = Vec::with_capacity(groups);
    for _ in 0..groups {
        let pre = if rng.below(3) == 0 {
            rng.range(0, 3) as u32
        } else {
            0
        };
        // With a prefix hit D may already hold the whole group (nothing to
        // move for it); without one it needs at least a block.
        let dst = rng.range(if pre > 0 { 0 } else { 1 }, 8) as u32;
        total.push(dst + pre);
        prefix.push(pre);
    }
    // Chunks: cut every group's blocks at random points (a chunk may add no
    // block to a group, or only prefix blocks D does not need).
    let n_chunks = rng.range(1, 4) as usize;
    let mut chunks = vec![vec![0u32; groups]; n_chunks];
    for g in 0..groups {
        for _ in 0..total[g] {
            chunks[rng.below(n_chunks as u64) as usize][g] += 1;
        }
    }
    // One request in twenty has a slow engine or bootstrap: its P ranks,
    // chunks or D resolution come later than some timeouts, so that
    // bootstrap, claim and waiting expiries and messages to machines that
    // gave up are exercised too.
    let scale = if !calm && rng.below(20) == 0 { 30 } else { 1 };
    let p_create: Vec<T> = (0..tp_p).map(|_| rng.below(5 * MS * scale)).collect();
    let d_create: Vec<T> = (0..tp_d).map(|_| rng.below(2 * MS)).collect();
    let resolve: Vec<T> = (0..tp_d).map(|_| rng.below(6 * MS * scale)).collect();
    let mut chunk_at = Vec::with_capacity(tp_p);
    for _ in 0..tp_p {
        let mut t = 0;
        let mut at = Vec::with_capacity(n_chunks);
        for _ in 0..n_chunks {
            // Strictly increasing: the engine hands chunks over in order.
            t += 1 + rng.below(5 * MS * scale);
            at.push(t);
        }
        chunk_at.push(at);
    }
    let mut aborts = Vec::new();
    if !calm {
        let reason = |rng: &mut Rng| match rng.below(3) {
            0 => AbortReason::Engine,
            1 => AbortReason::ClientDisconnect,
            _ => AbortReason::Shutdown,
        };
        match rng.below(20) {
            0..=2 => {
                let side = if rng.below(2) == 0 { Side::P } else { Side::D };
                let n = match side {
                    Side::P => tp_p,
                    Side::D => tp_d,
                };
                aborts.push(AbortSpec {
                    side,
                    rank: rng.below(n as u64) as usize,
                    at: rng.below(40 * MS),
                    reason: reason(rng),
                });
            }
            3 => {
                // A client disconnect on D reaches every D rank of the request.
                let at = rng.below(40 * MS);
                for rank in 0..tp_d {
                    aborts.push(AbortSpec {
                        side: Side::D,
                        rank,
                        at: at + rng.below(MS),
                        reason: AbortReason::ClientDisconnect,
                    });
                }
            }
            _ => {}
        }
    }
    let verdict = |rng: &mut Rng, one_in: u64| {
        if calm || rng.below(one_in) != 0 {
            return None;
        }
        let side = if rng.below(2) == 0 { Side::P } else { Side::D };
        let n = match side {
            Side::P => tp_p,
            Side::D => tp_d,
        };
        Some((side, rng.below(n as u64) as usize, rng.below(20 * MS)))
    };
    let plan_fail = verdict(rng, 50);
    let false_dead = verdict(rng, 30);
    let mut spec = RequestSpec {
        id: TransferId(r as u64),
        arrive: rng.below(horizon),
        mode: if rng.below(2) == 0 {
            Mode::Push
        } else {
            Mode::Pull
        },
        p_nodes,
        d_nodes,
        pairs,
        total,
        prefix,
        chunks,
        p_create,
        d_create,
        resolve,
        chunk_at,
        aborts,
        plan_fail,
        false_dead,
        decode: rng.below(20 * MS),
        unneeded: Vec::new(),
    };
    unpair_some(&mut spec, r);
    spec
}

/// In one request in four with several P ranks, leaves some P ranks
/// unpaired (as replicated KV heads do) and names who tells them. Drawn
/// from a generator of its own, so the other draws of every seed stay as
/// they were. Verdicts aimed at an unpaired P rank are dropped (it has no
/// peer to judge).
fn unpair_some(spec: &mut RequestSpec, r: usize) {
    let (tp_p, tp_d) = (spec.p_nodes.len(), spec.d_nodes.len());
    spec.unneeded = vec![Vec::new(); tp_d];
    let mut rng = Rng::new(spec.arrive ^ (r as u64).rotate_left(32) ^ 0x756e_7061_6972);
    if tp_p < 2 || rng.below(4) != 0 {
        return;
    }
    for _ in 0..rng.range(1, 2) {
        let i = rng.below(tp_p as u64) as usize;
        for ps in &mut spec.pairs {
            if ps.len() > 1 {
                ps.retain(|&p| p != i);
            }
        }
    }
    for i in 0..tp_p {
        if !spec.pairs.iter().any(|ps| ps.contains(&i)) {
            spec.unneeded[i % tp_d].push(i);
        }
    }
    let unpaired = |v: &Option<(Side, usize, T)>| matches!(v, Some((Side::P, i, _)) if spec.unneeded.iter().any(|u| u.contains(i)));
    if unpaired(&spec.plan_fail) {
        spec.plan_fail = None;
    }
    if unpaired(&spec.false_dead) {
        spec.false_dead = None;
    }
}
