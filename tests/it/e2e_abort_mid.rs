//! End-to-end: a request is aborted while its KV is really moving.
//!
//! Real prefill (P) and decode (D) nodes on loopback, TCP data plane, both
//! push and pull modes. Each round starts a large request (several MiB in
//! chunks), lets P hand over some chunks, waits until bytes of one of them
//! have landed in D's memory (by reading D's destination blocks, not by
//! sleeping), and then aborts on D (most rounds) or on P. It then checks:
//!
//! 1. D reports a failed phase that names the abort, within the bound the
//!    lease protocol promises (lease + transfer bound + fence margin);
//! 2. P turns terminal and reports its release exactly once: one terminal
//!    notification per transfer, one `get_finished` entry, and the outcome
//!    counters in `stats()` move by exactly one. (The node's sink turns the
//!    machine's `ReleaseBlocks` action into exactly this terminal report;
//!    the action itself is not visible through the public API.)
//! 3. Once D reported the abort done, nothing writes its destination blocks
//!    anymore: the blocks are poisoned at that moment, P keeps trying to
//!    send the remaining chunks, and after P is terminal too (and a later
//!    transfer went through the same connections) the poison must be intact.
//! 4. The same nodes then complete a normal transfer, every byte verified.
//!
//! A self-test runs the same rounds with the safety of the protocol switched
//! off (`unsafe_disable_fence` / `unsafe_ignore_in_flight`) and requires the
//! poison check to catch the late writes that then happen, so check 3 is
//! known to be able to fail.
//!
//! Two tests (`*_outlive_their_bound`) use a 10 ms transfer bound so that
//! writes and reads outlive their bound. They found a real bug: bytes still
//! landed in D's blocks after D reported the transfer done (the transport's
//! timers started after the machine's op deadline, and D's TCP target kept
//! serving frames P had abandoned). The node's block fence
//! (`transport/src/fence.rs`) fixed it: blocks are closed in the executor
//! turn that reports the transfer terminal, and both transport ends check
//! the fence before every system call that touches registered memory. The
//! self-tests above switch the block fence off together with the machines'
//! own protection.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvferry::machines::internal::common::{BlockId, Config, Mode};
use kvferry::machines::{AbortReason, FailReason, Phase};
use kvferry::TransferId;
use kvferry_testkit::model::{self, ModelSpecExt};
use kvferry_testkit::synth::{Cluster, ClusterSpec, SynthKv};

/// Layers of the model (regions are layers × K/V).
const LAYERS: u32 = 4;
/// Chunks of one aborted request.
const CHUNKS: u32 = 8;
/// Blocks per chunk. A block is 4 KiB per region, 32 KiB over all regions,
/// so a chunk is 4 MiB and a request 32 MiB: tens of ms on loopback.
const CHUNK_BLOCKS: u32 = 128;
/// Blocks of one aborted request.
const REQUEST_BLOCKS: u32 = CHUNKS * CHUNK_BLOCKS;
/// First of the blocks (outside the request's) used by the normal transfers.
const SPARE: u32 = REQUEST_BLOCKS;
/// Blocks per side: the request's plus two spare ones.
const BLOCKS: u64 = REQUEST_BLOCKS as u64 + 2;
/// The byte D's destination blocks hold once the abort was reported.
const POISON: u8 = 0xA5;
/// Transfer id whose pattern fills P's source blocks once per cluster; every
/// aborted request sends these bytes (the bytes need not match the id).
const FILL_TID: u64 = 1;
/// Rounds per mode.
const ROUNDS: u64 = 20;
/// Most rounds per mode: past `ROUNDS`, rounds go on until two aborts cut
/// a transfer mid-way (a starved test thread can see most transfers land
/// before it aborts).
const MAX_ROUNDS: u64 = 200;
/// Bytes of the spot watched in D's memory to see a chunk land.
const SPOT_BYTES: u64 = 64;

fn timeouts() -> Config {
    Config {
        bootstrap_timeout: Duration::from_secs(5),
        waiting_timeout: Duration::from_secs(5),
        claim_timeout: Duration::from_secs(5),
        lease: Duration::from_millis(1000),
        hold_limit: Duration::from_secs(20),
        transfer_bound: Duration::from_secs(3),
        fence_margin: Duration::from_millis(100),
        heartbeat_interval: Duration::from_millis(100),
        // Generous: four tests share two cores and poll D's memory.
        heartbeat_misses: 20,
        ..Config::default()
    }
}

fn spec(mode: Mode, timeouts: Config) -> ClusterSpec {
    ClusterSpec {
        layers: LAYERS,
        prefill_blocks: BLOCKS,
        decode_blocks: BLOCKS,
        timeouts,
        ..ClusterSpec::new(model::medium().with_heads(2), mode)
    }
}

fn ids(blocks: impl IntoIterator<Item = u32>) -> Vec<Vec<BlockId>> {
    vec![blocks.into_iter().map(BlockId).collect()]
}

/// Where block `block` of region `region` starts, and its KV length.
fn block_at(kv: &SynthKv, region: usize, block: u32) -> (*mut u8, usize) {
    let r = &kv.layout().rank.regions[region];
    assert!(u64::from(block) < kv.layout().rank.num_blocks);
    (
        (r.base + u64::from(block) * r.block_len) as usize as *mut u8,
        r.kv_block_len as usize,
    )
}

fn regions(kv: &SynthKv) -> usize {
    kv.layout().rank.regions.len()
}

/// True when the `SPOT_BYTES` at `offset` of D's block `block` of `region`
/// equal P's bytes at the same place (source block `block` maps to
/// destination block `block`). D's transport may be writing these bytes
/// right now, so they are read with volatile loads, one byte at a time.
fn spot_landed(p: &SynthKv, d: &SynthKv, region: usize, block: u32, offset: u64) -> bool {
    let (src, len) = block_at(p, region, block);
    let (dst, _) = block_at(d, region, block);
    assert!(offset + SPOT_BYTES <= len as u64);
    (offset..offset + SPOT_BYTES).all(|i| {
        // SAFETY: both addresses lie inside registered blocks that stay
        // allocated while the cluster lives; P's source bytes are only read
        // by the transport, D's may be written concurrently (hence volatile).
        unsafe {
            std::ptr::read_volatile(dst.add(i as usize))
                == std::ptr::read_volatile(src.add(i as usize))
        }
    })
}

/// Fills D's blocks `blocks` (every region) with the poison byte, last
/// blocks first: bytes still on their way most likely belong to the last
/// chunks, and poisoning them first leaves such bytes less time to land
/// unseen, before the poison covers them.
fn poison(d: &SynthKv, blocks: std::ops::Range<u32>) {
    for b in blocks.rev() {
        for region in 0..regions(d) {
            let (ptr, len) = block_at(d, region, b);
            // SAFETY: the block is D's and, once D reported the abort done,
            // the engine's again: the protocol promises no peer writes it.
            unsafe { std::ptr::write_bytes(ptr, POISON, len) };
        }
    }
}

/// A byte of D's memory that changed after it was poisoned.
#[derive(Debug)]
#[allow(dead_code)] // Read through `Debug` in assertion messages.
struct LateWrite {
    region: usize,
    block: u32,
    offset: usize,
    found: u8,
    /// True when the byte is what P's source holds there: P's data landed.
    equals_source: bool,
}

/// The first byte of D's blocks `blocks` that is no longer the poison.
fn find_late_write(p: &SynthKv, d: &SynthKv, blocks: std::ops::Range<u32>) -> Option<LateWrite> {
    for region in 0..regions(d) {
        for b in blocks.clone() {
            let (ptr, len) = block_at(d, region, b);
            // SAFETY: the block stays allocated; if a late write races with
            // this read, that write is the bug this test reports.
            let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, len) };
            if let Some(offset) = bytes.iter().position(|&x| x != POISON) {
                let (src, _) = block_at(p, region, b);
                // SAFETY: P's source block, only read by anyone.
                let source = unsafe { *src.add(offset) };
                return Some(LateWrite {
                    region,
                    block: b,
                    offset,
                    found: bytes[offset],
                    equals_source: bytes[offset] == source,
                });
            }
        }
    }
    None
}

/// Terminal notifications of both sides, by transfer, as they arrive.
struct Notes {
    prefill: HashMap<u64, Vec<Phase>>,
    decode: HashMap<u64, Vec<Phase>>,
}

impl Notes {
    fn new() -> Notes {
        Notes {
            prefill: HashMap::new(),
            decode: HashMap::new(),
        }
    }

    fn take(&mut self, c: &Cluster) {
        for e in c.prefill_events.try_iter() {
            if let Some(p) = e.finished() {
                self.prefill.entry(e.transfer_id.0).or_default().push(p);
            }
        }
        for e in c.decode_events.try_iter() {
            if let Some(p) = e.finished() {
                self.decode.entry(e.transfer_id.0).or_default().push(p);
            }
        }
    }

    /// Waits (bounded) until P notified a terminal phase of `tid`.
    fn wait_prefill(&mut self, c: &Cluster, tid: u64, timeout: Duration) {
        self.wait(c, tid, timeout, true);
    }

    /// Waits (bounded) until D notified a terminal phase of `tid`.
    fn wait_decode(&mut self, c: &Cluster, tid: u64, timeout: Duration) {
        self.wait(c, tid, timeout, false);
    }

    /// Events are sent once the phase is visible to the handles, so they
    /// may trail the phase that `wait` on a handle already saw.
    fn wait(&mut self, c: &Cluster, tid: u64, timeout: Duration, prefill: bool) {
        let deadline = Instant::now() + timeout;
        loop {
            self.take(c);
            let seen = if prefill { &self.prefill } else { &self.decode };
            if seen.contains_key(&tid) {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let channel = if prefill {
                &c.prefill_events
            } else {
                &c.decode_events
            };
            let e = channel.recv_timeout(left).unwrap_or_else(|_| {
                panic!("no terminal notification of transfer {tid} (prefill: {prefill})")
            });
            let (t, Some(p)) = (e.transfer_id, e.finished()) else {
                continue;
            };
            let map = if prefill {
                &mut self.prefill
            } else {
                &mut self.decode
            };
            map.entry(t.0).or_default().push(p);
        }
    }
}

/// Who aborts a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Aborter {
    Decode,
    Prefill,
}

/// What a round saw, for the summary and the self-test.
struct RoundResult {
    /// Bytes of the chunks handed over before the abort were still missing
    /// in D's memory when the abort was issued.
    cut_mid_way: bool,
    /// How long D took to report the abort done.
    abort_latency: Duration,
    /// The first byte written into D's blocks after the abort was done.
    late_write: Option<LateWrite>,
    /// The phases D and P ended in.
    phases: (Phase, Phase),
}

/// One aborted request plus one normal, verified transfer.
struct Rounds<'a> {
    c: &'a Cluster,
    mode: Mode,
    notes: Notes,
    /// Transfers started so far, by id.
    transfers: Vec<u64>,
    /// Timeouts of every node.
    cfg: Config,
    /// Self-test: report late writes instead of failing on them.
    expect_late_writes: bool,
    /// Accept any failed phase (a transport failure may beat the abort).
    lenient_phases: bool,
}

impl Rounds<'_> {
    fn round(&mut self, seed: u64) -> RoundResult {
        let c = self.c;
        let mode = self.mode;
        let (p, d) = (&c.prefill[0], &c.decode[0]);
        let cfg = self.cfg;
        let mut rng = fastrand::Rng::with_seed(seed);
        // Chunks handed to P before the abort (at least one is held back,
        // so the request cannot complete), which of them to watch for, and
        // where in that chunk: the abort lands at a different point of the
        // byte stream each round.
        let sent_before = rng.u32(1..CHUNKS);
        // Mostly the first bytes of the last chunk handed over, so that
        // most aborts land while bytes are still moving.
        let watched = if rng.u32(0..4) > 0 {
            sent_before - 1
        } else {
            rng.u32(0..sent_before)
        };
        let region = rng.usize(0..regions(&d.kv));
        let in_chunk = if rng.bool() {
            0
        } else {
            rng.u32(0..CHUNK_BLOCKS)
        };
        let block = watched * CHUNK_BLOCKS + in_chunk;
        let kv_len = block_at(&d.kv, 0, 0).1 as u64;
        let offset = rng.u64(0..kv_len / SPOT_BYTES) * SPOT_BYTES;
        let aborter = if seed % 4 == 3 {
            Aborter::Prefill
        } else {
            Aborter::Decode
        };
        let tid = 1000 + seed;
        let ctx = format!(
            "{mode:?} seed {seed}: {aborter:?} aborts after chunk {watched} of {sent_before} \
             (region {region}, block {block}, offset {offset})"
        );

        // Stale bytes from the previous round must not pass for arrivals.
        poison(&d.kv, 0..REQUEST_BLOCKS);
        let ok_before = p.node.stats();
        self.transfers.push(tid);
        let rx = d.node.receiver(TransferId(tid), &c.target).unwrap();
        rx.request(ids(0..REQUEST_BLOCKS)).unwrap();
        let tx = p.node.sender(TransferId(tid)).unwrap();
        for k in 0..sent_before {
            let blocks = k * CHUNK_BLOCKS..(k + 1) * CHUNK_BLOCKS;
            tx.send(ids(blocks), false).unwrap();
        }

        // Wait for the watched bytes to land in D's memory.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !spot_landed(&p.kv, &d.kv, region, block, offset) {
            if self.lenient_phases && rx.poll().is_terminal() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{ctx}: the watched bytes never landed (D {:?}, P {:?})",
                rx.poll(),
                tx.poll()
            );
            std::thread::yield_now();
        }
        // Was anything handed over still on its way? The last bytes of the
        // last chunk handed over are among the latest to land.
        let last_block = sent_before * CHUNK_BLOCKS - 1;
        let cut_mid_way = (0..regions(&d.kv))
            .any(|r| !spot_landed(&p.kv, &d.kv, r, last_block, kv_len - SPOT_BYTES));
        let t0 = Instant::now();
        let aborted = match aborter {
            Aborter::Decode => rx.abort(),
            Aborter::Prefill => tx.abort(),
        };
        // A transport failure may have ended the transfer first.
        if !self.lenient_phases {
            aborted.unwrap();
        }

        // (1) D reports a failed phase naming the abort, within its bound.
        let bound = cfg.lease + cfg.transfer_bound + cfg.fence_margin + Duration::from_secs(1);
        let d_phase = rx.wait(bound);
        let abort_latency = t0.elapsed();
        // (3) From this moment on, D's blocks are the engine's again.
        poison(&d.kv, 0..REQUEST_BLOCKS);
        let (want_d, want_p) = match aborter {
            Aborter::Decode => (
                Phase::Failed(FailReason::Aborted(AbortReason::Engine)),
                Phase::Failed(FailReason::PeerAborted),
            ),
            Aborter::Prefill => (
                Phase::Failed(FailReason::PeerAborted),
                Phase::Failed(FailReason::Aborted(AbortReason::Engine)),
            ),
        };
        let (want_d, want_p) = if self.lenient_phases && matches!(d_phase, Phase::Failed(_)) {
            (d_phase, want_p)
        } else {
            (want_d, want_p)
        };
        assert_eq!(d_phase, want_d, "{ctx}: D's phase after the abort");
        assert!(
            abort_latency < bound,
            "{ctx}: D took {abort_latency:?} to finish the abort (bound {bound:?})"
        );

        // P keeps trying to send the rest; it may refuse (the transfer is
        // over), it must not write D's blocks.
        for k in sent_before..CHUNKS {
            let blocks = k * CHUNK_BLOCKS..(k + 1) * CHUNK_BLOCKS;
            let _ = tx.send(ids(blocks), k == CHUNKS - 1);
        }
        // (2) P ends terminal with the matching failure, released once.
        let p_phase = tx.wait(bound);
        // Without the fence (self-test), D does not wait for P's answer, so
        // P may even finish the request before the abort reaches it.
        let want_p = if self.lenient_phases && p_phase.is_terminal() {
            p_phase
        } else {
            want_p
        };
        assert_eq!(
            p_phase,
            want_p,
            "{ctx}: P's phase after the abort (P {:?}, D {:?})",
            p.node.stats(),
            d.node.stats()
        );
        self.notes.wait_prefill(c, tid, Duration::from_secs(5));
        let after = p.node.stats();
        assert_eq!(
            (after.ok + after.failed + after.expired)
                - (ok_before.ok + ok_before.failed + ok_before.expired),
            1,
            "{ctx}: P's outcome counters must move by exactly one"
        );
        if !self.lenient_phases {
            assert_eq!(after.failed - ok_before.failed, 1, "{ctx}: P failed once");
        }

        // (4) A normal transfer on the same nodes (and the same data-plane
        // connections, so bytes of the aborted request still queued in them
        // would have landed by its end), every byte verified.
        let normal = 100_000 + seed;
        self.transfers.push(normal);
        p.kv.fill(TransferId(normal), &[SPARE], 0);
        d.kv.clear(&[SPARE + 1]);
        c.start_request(TransferId(normal), &[SPARE], &[SPARE + 1], 0)
            .unwrap();
        let rx_normal = d.node.receiver(TransferId(normal), &c.target).unwrap();
        let normal_phase = rx_normal.wait(Duration::from_secs(10));
        // Not `sender(normal)`: once finished, that would start a new transfer.
        self.notes.wait_prefill(c, normal, Duration::from_secs(10));
        // With a bound shorter than the transfers, the next one may fail
        // too, on either side: P's write may run past its bound after its
        // bytes and `Status` left, so D succeeds while P reports the
        // transport failure. A success on D always means every byte.
        let p_normal = self.notes.prefill[&normal].clone();
        if normal_phase == Phase::Success {
            assert_eq!(
                d.kv.verify(TransferId(normal), &[SPARE + 1], 0),
                Ok(()),
                "{ctx}: bytes of the next transfer"
            );
        }
        if !self.lenient_phases {
            assert_eq!(normal_phase, Phase::Success, "{ctx}: the next transfer");
            assert_eq!(
                p_normal,
                vec![Phase::Success],
                "{ctx}: P's side of the next transfer"
            );
        } else {
            assert!(
                normal_phase.is_terminal() && p_normal.len() == 1 && p_normal[0].is_terminal(),
                "{ctx}: the next transfer ends on both sides (D {normal_phase:?}, P {p_normal:?})"
            );
        }

        // (2) Every release so far was reported exactly once (a duplicate of
        // this round's would have been queued before the next transfer's).
        self.notes.wait_decode(c, tid, Duration::from_secs(5));
        self.notes.wait_decode(c, normal, Duration::from_secs(5));
        for t in &self.transfers {
            let got = self.notes.prefill.get(t).map_or(0, Vec::len);
            assert_eq!(got, 1, "{ctx}: P's terminal reports of transfer {t}");
        }
        assert_eq!(self.notes.prefill[&tid], vec![want_p], "{ctx}");
        assert_eq!(self.notes.decode.get(&tid), Some(&vec![want_d]), "{ctx}");

        // (3) The poison laid when D reported the abort done is intact.
        let late_write = find_late_write(&p.kv, &d.kv, 0..REQUEST_BLOCKS);
        if !self.expect_late_writes {
            assert!(
                late_write.is_none(),
                "{ctx}: D's blocks were written after D reported the transfer done \
                 (D {d_phase:?} after {abort_latency:?}, P {p_phase:?}): {late_write:?}"
            );
        }
        RoundResult {
            cut_mid_way,
            abort_latency,
            late_write,
            phases: (d_phase, p_phase),
        }
    }
}

fn run(mode: Mode) {
    let cfg = timeouts();
    let c = Cluster::start(&spec(mode, cfg)).unwrap();
    c.fill(
        TransferId(FILL_TID),
        &(0..REQUEST_BLOCKS).collect::<Vec<_>>(),
    );
    let mut rounds = Rounds {
        c: &c,
        mode,
        notes: Notes::new(),
        transfers: Vec::new(),
        cfg,
        expect_late_writes: false,
        lenient_phases: false,
    };
    let mut cut = 0;
    let mut slowest = Duration::ZERO;
    let mut seed = 0;
    while seed < ROUNDS || (cut < 2 && seed < MAX_ROUNDS) {
        let r = rounds.round(seed);
        cut += usize::from(r.cut_mid_way);
        slowest = slowest.max(r.abort_latency);
        seed += 1;
    }
    // The test only means something if aborts really cut transfers (about
    // two thirds of the rounds do on an idle machine, more under load).
    assert!(
        cut >= 2,
        "{mode:?}: no abort was issued while handed-over bytes were still missing"
    );
    eprintln!("{mode:?}: {cut}/{seed} aborts cut a transfer mid-way; slowest abort {slowest:?}");

    // Release exactly once, seen through the vLLM-style call as well.
    let p = &c.prefill[0].node;
    let (sent, received) = p.get_finished();
    assert!(received.is_empty());
    let mut counts: HashMap<u64, usize> = HashMap::new();
    for t in sent {
        *counts.entry(t.0).or_default() += 1;
    }
    for t in &rounds.transfers {
        assert_eq!(counts.get(t), Some(&1), "{mode:?}: get_finished of {t}");
    }
    let s = p.stats();
    assert_eq!(s.ok + s.failed + s.expired, 2 * seed, "{mode:?}: {s:?}");
    assert_eq!(s.ok, seed, "{mode:?}: {s:?}");
    // Nothing more arrived for any transfer since the rounds ended.
    rounds.notes.take(&c);
    for t in &rounds.transfers {
        assert_eq!(rounds.notes.prefill.get(t).map_or(0, Vec::len), 1);
        assert_eq!(rounds.notes.decode.get(t).map_or(0, Vec::len), 1);
    }
}

#[test]
fn push_abort_mid_transfer() {
    run(Mode::Push);
}

#[test]
fn pull_abort_mid_transfer() {
    run(Mode::Pull);
}

/// Self-test of check 3: with the protocol's protection switched off, D
/// hands its blocks back while bytes are still on their way, and the poison
/// check must see them land. In push mode D (the lease granter) skips the
/// fence and the wait for P's `AbortAck`; in pull mode D (the toucher)
/// forgets its reads in flight.
fn run_unprotected(mode: Mode) {
    let mut cfg = timeouts();
    match mode {
        Mode::Push => cfg.unsafe_disable_fence = true,
        Mode::Pull => cfg.unsafe_ignore_in_flight = true,
    }
    let c = Cluster::start(&spec(mode, cfg)).unwrap();
    c.fill(
        TransferId(FILL_TID),
        &(0..REQUEST_BLOCKS).collect::<Vec<_>>(),
    );
    let mut rounds = Rounds {
        c: &c,
        mode,
        notes: Notes::new(),
        transfers: Vec::new(),
        cfg,
        expect_late_writes: true,
        lenient_phases: true,
    };
    // Until the first late write: on a loaded machine a starved test thread
    // can see whole runs of transfers land before it aborts.
    let mut caught = None;
    for seed in 0..MAX_ROUNDS {
        let r = rounds.round(seed);
        if let Some(w) = r.late_write {
            caught = Some((seed, w, r.phases));
            break;
        }
    }
    let (seed, w, phases) = caught.unwrap_or_else(|| {
        panic!("{mode:?}: no late write caught in {MAX_ROUNDS} unprotected rounds")
    });
    assert!(
        w.equals_source,
        "{mode:?} seed {seed}: {w:?} is not P's data"
    );
    eprintln!("{mode:?} unprotected: seed {seed} caught {w:?}; D and P ended {phases:?}");
}

#[test]
fn push_without_fence_is_caught_writing_after_abort() {
    run_unprotected(Mode::Push);
}

#[test]
fn pull_ignoring_reads_in_flight_is_caught_writing_after_abort() {
    run_unprotected(Mode::Pull);
}

/// Aborts while writes (push) or reads (pull) outlive the transfer bound
/// (10 ms here, so that 4 MiB chunks outlive it; with the default 10 s the
/// same happens to any transfer that stalls that long).
///
/// The machines rely on the transport contract of `Config::transfer_bound`:
/// a write or read posted at `t` touches no memory after `t + bound`. The
/// node used not to keep it (the transport's own timers started after the
/// machine's op deadline, and D's TCP target had no deadline at all), and
/// these rounds saw bytes land in D's blocks after D reported the transfer
/// done, in 7 of 8 runs (D/P outcomes: push `Aborted(Engine)`/`PeerAborted`,
/// `Aborted(Engine)`/`Transport`, `PeerReported`/`Transport`; pull
/// `Transport`/`PeerReported`). The block fence makes the contract exact;
/// these rounds must now never see a late write.
fn abort_while_transfers_outlive_their_bound(mode: Mode) {
    let mut cfg = timeouts();
    cfg.transfer_bound = Duration::from_millis(10);
    let c = Cluster::start(&spec(mode, cfg)).unwrap();
    c.fill(
        TransferId(FILL_TID),
        &(0..REQUEST_BLOCKS).collect::<Vec<_>>(),
    );
    // Opening the data-plane session counts against the first bound.
    let warm = 7;
    c.fill(TransferId(warm), &[SPARE]);
    c.start_request(TransferId(warm), &[SPARE], &[SPARE], 0)
        .unwrap();
    let rx = c.decode[0]
        .node
        .receiver(TransferId(warm), &c.target)
        .unwrap();
    assert!(rx.wait(Duration::from_secs(5)).is_terminal());
    let mut rounds = Rounds {
        c: &c,
        mode,
        notes: Notes::new(),
        transfers: vec![warm],
        cfg,
        expect_late_writes: false,
        lenient_phases: true,
    };
    // P ends the warm-up after D: its outcome must be counted before the
    // first round reads P's counters.
    rounds.notes.wait_prefill(&c, warm, Duration::from_secs(5));
    for seed in 0..2 * ROUNDS {
        rounds.round(seed);
    }
}

#[test]
fn push_abort_while_writes_outlive_their_bound() {
    abort_while_transfers_outlive_their_bound(Mode::Push);
}

#[test]
fn pull_abort_while_reads_outlive_their_bound() {
    abort_while_transfers_outlive_their_bound(Mode::Pull);
}
