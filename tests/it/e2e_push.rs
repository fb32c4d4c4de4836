//! End-to-end: prefill and decode nodes in one process, real side channel
//! (ZeroMQ over loopback), real data plane, every byte verified.

use std::time::{Duration, Instant};

use kvferry::machines::internal::common::Mode;
use kvferry::machines::LayoutKind;
use kvferry::machines::Phase;
use kvferry::node::TransportKind;
use kvferry::TransferId;
use kvferry_testkit::model::{self, ModelSpecExt};
use kvferry_testkit::synth::{Cluster, ClusterSpec};

fn spec(
    kind: LayoutKind,
    p_tp: u32,
    d_tp: u32,
    mode: Mode,
    transport: TransportKind,
) -> ClusterSpec {
    ClusterSpec {
        prefill_tp: p_tp,
        decode_tp: d_tp,
        transport,
        ..ClusterSpec::new(model::small().with_layout(kind), mode)
    }
}

/// Runs a few requests with different block placements and checks every byte.
fn run(spec: &ClusterSpec, requests: u64) {
    let c = Cluster::start(spec).expect("cluster starts");
    for t in 0..requests {
        let tid = 100 + t;
        let n = 1 + (t as u32 % 5);
        let src: Vec<u32> = (0..n).map(|i| 2 * i + t as u32 % 3).collect();
        let dst: Vec<u32> = (0..n).map(|i| 40 - 3 * i - t as u32 % 2).collect();
        c.fill(TransferId(tid), &src);
        for r in &c.decode {
            r.kv.clear(&dst);
        }
        c.start_request(TransferId(tid), &src, &dst, 0)
            .expect("request starts");
        let phases = c.wait_decode(TransferId(tid), Duration::from_secs(10));
        assert!(
            phases.iter().all(|p| *p == Phase::Success),
            "request {tid}: {phases:?}"
        );
        assert_eq!(
            c.verify(TransferId(tid), &dst, 0),
            0,
            "request {tid}: bytes differ on decode"
        );
        // Every prefill rank ends the request, the ones no decode rank
        // reads from (replicated heads) as well: they are told so, and do
        // not hold their blocks until the bootstrap timeout.
        let phases = c.wait_prefill(TransferId(tid), Duration::from_secs(10));
        assert!(
            phases.iter().all(|p| *p == Phase::Success),
            "request {tid}: prefill {phases:?}"
        );
    }
    let stats: u64 = c.decode.iter().map(|r| r.node.stats().ok).sum();
    assert_eq!(stats, requests * spec.decode_tp as u64);
    let stats: u64 = c.prefill.iter().map(|r| r.node.stats().ok).sum();
    assert_eq!(stats, requests * spec.prefill_tp as u64);
}

#[test]
fn push_tp1_to_tp1_local_transport() {
    run(
        &spec(LayoutKind::Hnd, 1, 1, Mode::Push, TransportKind::Local),
        8,
    );
}

#[test]
fn push_tp1_to_tp1_tcp_transport() {
    run(
        &spec(LayoutKind::Hnd, 1, 1, Mode::Push, TransportKind::Tcp),
        8,
    );
}

#[test]
fn push_tp2_to_tp1_hnd() {
    run(
        &spec(LayoutKind::Hnd, 2, 1, Mode::Push, TransportKind::Tcp),
        5,
    );
}

#[test]
fn push_tp1_to_tp2_nhd() {
    run(
        &spec(LayoutKind::Nhd, 1, 2, Mode::Push, TransportKind::Tcp),
        5,
    );
}

#[test]
fn push_tp4_to_tp2_hnd() {
    run(
        &spec(LayoutKind::Hnd, 4, 2, Mode::Push, TransportKind::Tcp),
        5,
    );
}

#[test]
fn push_tp8_to_tp2_gqa_replicated_heads() {
    // More P ranks than KV heads: heads are replicated, one replica sends.
    run(
        &spec(LayoutKind::Hnd, 8, 2, Mode::Push, TransportKind::Local),
        3,
    );
}

/// Three KV-cache groups with different block counts and a prefix hit in
/// one of them, push and pull, homogeneous and heterogeneous TP: each
/// group's blocks land in that group's destination blocks, every byte
/// verified.
#[test]
fn several_kv_cache_groups_move_end_to_end() {
    let src = vec![vec![1, 2, 3], vec![10], vec![20, 21, 22, 23]];
    let dst = vec![vec![30, 31, 32], vec![40], vec![50, 51, 52]];
    let prefix = [0, 0, 1];
    for (mode, p_tp, d_tp) in [
        (Mode::Push, 1, 1),
        (Mode::Push, 2, 1),
        (Mode::Pull, 1, 2),
        (Mode::Pull, 2, 2),
    ] {
        let c = Cluster::start(&spec(LayoutKind::Hnd, p_tp, d_tp, mode, TransportKind::Tcp))
            .expect("cluster starts");
        for (t, tid) in [(0u32, 600u64), (1, 601)] {
            // The second request swaps the groups' destination order.
            let dst: Vec<Vec<u32>> = match t {
                0 => dst.clone(),
                _ => dst
                    .iter()
                    .map(|g| g.iter().rev().copied().collect())
                    .collect(),
            };
            c.fill_groups(TransferId(tid), &src);
            for r in &c.decode {
                r.kv.clear(&dst.concat());
            }
            c.start_request_groups(TransferId(tid), &src, &dst, &prefix)
                .expect("request starts");
            let phases = c.wait_decode(TransferId(tid), Duration::from_secs(10));
            let ctx = format!("{mode:?} {p_tp}->{d_tp} request {tid}");
            assert!(
                phases.iter().all(|p| *p == Phase::Success),
                "{ctx}: {phases:?}"
            );
            assert_eq!(c.verify_groups(TransferId(tid), &dst, &prefix), 0, "{ctx}");
            // The groups' patterns differ: group 1's bytes are not group 0's.
            let swapped = [dst[1].clone(), dst[0].clone(), dst[2].clone()];
            assert!(
                c.verify_groups(TransferId(tid), &swapped, &prefix) > 0,
                "{ctx}"
            );
        }
    }
}

#[test]
fn pull_mla_tp4_to_tp2_unpaired_prefill_ranks_are_told() {
    // MLA: every P rank holds the whole KV; decode ranks 0 and 1 read P
    // ranks 0 and 1, and P ranks 2 and 3 are told they are not needed.
    run(
        &spec(LayoutKind::Mla, 4, 2, Mode::Pull, TransportKind::Tcp),
        3,
    );
}

#[test]
fn push_mla_tp2_to_tp4() {
    run(
        &spec(LayoutKind::Mla, 2, 4, Mode::Push, TransportKind::Tcp),
        4,
    );
}

#[test]
fn pull_tp1_to_tp1_and_tp2_to_tp1() {
    run(
        &spec(LayoutKind::Hnd, 1, 1, Mode::Pull, TransportKind::Tcp),
        5,
    );
    run(
        &spec(LayoutKind::Hnd, 2, 1, Mode::Pull, TransportKind::Tcp),
        5,
    );
}

#[test]
fn pull_mla_tp1_to_tp2() {
    run(
        &spec(LayoutKind::Mla, 1, 2, Mode::Pull, TransportKind::Local),
        4,
    );
}

#[test]
fn partial_prefix_hit_moves_only_the_tail() {
    for mode in [Mode::Push, Mode::Pull] {
        let c = Cluster::start(&spec(LayoutKind::Hnd, 2, 1, mode, TransportKind::Tcp)).unwrap();
        let tid = 7;
        let src: Vec<u32> = (10..16).collect();
        // D already holds the first 2 of P's 6 blocks; the rest land in 4 blocks.
        let dst: Vec<u32> = vec![30, 31, 33, 35];
        c.fill(TransferId(tid), &src);
        // Mark the destination: if the prefix were sent, it would overflow
        // or shift the tail and the position check below would fail.
        c.decode[0].kv.clear(&dst);
        c.start_request(TransferId(tid), &src, &dst, 2).unwrap();
        let phases = c.wait_decode(TransferId(tid), Duration::from_secs(10));
        assert_eq!(phases, vec![Phase::Success], "{mode:?}");
        assert_eq!(
            c.verify(TransferId(tid), &dst, 2),
            0,
            "{mode:?}: tail must hold positions 2..6"
        );
        assert!(
            c.decode[0].kv.verify(TransferId(tid), &dst, 0).is_err(),
            "positions are not shifted"
        );
    }
}

#[test]
fn bootstrap_service_resolves_prefill_ranks() {
    let mut s = spec(LayoutKind::Hnd, 2, 2, Mode::Push, TransportKind::Tcp);
    s.bootstrap = Some("127.0.0.1:0".into());
    run(&s, 4);
}

#[test]
fn chunked_sends_arrive_in_order() {
    for mode in [Mode::Push, Mode::Pull] {
        let c = Cluster::start(&spec(LayoutKind::Nhd, 1, 1, mode, TransportKind::Tcp)).unwrap();
        use kvferry::machines::internal::common::BlockId;
        let tid = 11;
        let src: Vec<u32> = (0..6).collect();
        let dst: Vec<u32> = (20..26).collect();
        c.fill(TransferId(tid), &src);
        let rx = c.decode[0]
            .node
            .receiver(TransferId(tid), &c.target)
            .unwrap();
        rx.request(vec![dst.iter().map(|&b| BlockId(b)).collect()])
            .unwrap();
        let tx = c.prefill[0].node.sender(TransferId(tid)).unwrap();
        for (i, part) in src.chunks(2).enumerate() {
            tx.send(vec![part.iter().map(|&b| BlockId(b)).collect()], i == 2)
                .unwrap();
        }
        assert_eq!(rx.wait(Duration::from_secs(10)), Phase::Success);
        assert_eq!(tx.wait(Duration::from_secs(10)), Phase::Success);
        assert_eq!(c.verify(TransferId(tid), &dst, 0), 0);
    }
}

#[test]
fn embedded_bootstrap_serves_the_prefill_metrics() {
    let mut s = spec(LayoutKind::Hnd, 1, 1, Mode::Push, TransportKind::Tcp);
    s.bootstrap = Some("127.0.0.1:0".into());
    let c = Cluster::start(&s).unwrap();
    for tid in 1..=3u64 {
        c.fill(TransferId(tid), &[tid as u32]);
        c.start_request(TransferId(tid), &[tid as u32], &[10 + tid as u32], 0)
            .unwrap();
        assert_eq!(
            c.wait_decode(TransferId(tid), Duration::from_secs(10)),
            vec![Phase::Success]
        );
    }
    // P's release may trail D's success by a moment; wait on P's phases.
    for tid in 1..=3u64 {
        let tx = c.prefill[0].node.sender(TransferId(tid)).unwrap();
        assert_eq!(tx.wait(Duration::from_secs(10)), Phase::Success);
    }
    let addr = c.prefill[0].node.bootstrap_addr().unwrap();
    let text = kvferry::bootstrap::BootstrapClient::new(&addr)
        .unwrap()
        .metrics_text()
        .unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with("kvferry_transfers_total") && l.contains("\"ok\""))
        .unwrap_or_else(|| panic!("no ok counter in:\n{text}"));
    assert!(line.ends_with(" 3"), "{line}");
    let bytes = text
        .lines()
        .find(|l| l.starts_with("kvferry_transfer_bytes_total"))
        .unwrap();
    assert!(!bytes.ends_with(" 0"), "{bytes}");
}

/// Once a data-plane session to a peer is open, the messages on a request's
/// critical path (push: D's `Pull` and lease ticket, P's `Status`; pull:
/// D's `Pull` and `Done`, P's `Ready`) travel over it instead of ZeroMQ,
/// and every byte still verifies. Nothing falls back to ZeroMQ on a
/// healthy pair.
#[test]
fn critical_path_messages_take_the_data_plane() {
    for (mode, p_tp) in [(Mode::Push, 2), (Mode::Pull, 1)] {
        let s = spec(LayoutKind::Hnd, p_tp, 1, mode, TransportKind::Tcp);
        let c = Cluster::start(&s).expect("cluster starts");
        // Push: D sends a `Pull` and a ticket per P rank, P a `Status`;
        // pull: D sends a `Pull` and a `Done`, P a `Ready` and the grant
        // answering the lease ticket that rode D's `Pull`.
        let (per_d, per_p) = match mode {
            Mode::Push => (2 * u64::from(p_tp), 1),
            Mode::Pull => (2, 2),
        };
        let counts = |c: &Cluster| {
            let p: Vec<u64> = c
                .prefill
                .iter()
                .map(|r| r.node.stats().data_plane_messages)
                .collect();
            (c.decode[0].node.stats().data_plane_messages, p)
        };
        // The first requests open the sessions (their messages go over
        // ZeroMQ, and a session opened in the background may miss a few
        // more): warm up until one request's messages all took the data
        // plane, which needs every session open.
        let mut tid = 500;
        let mut warm = false;
        for _ in 0..WARM_UP_LIMIT {
            let before = counts(&c);
            run_verified(&c, mode, tid);
            tid += 1;
            let after = counts(&c);
            let p_all = before.1.iter().zip(&after.1).all(|(b, a)| a - b >= per_p);
            if after.0 - before.0 >= per_d && p_all {
                warm = true;
                break;
            }
        }
        assert!(warm, "{mode:?}: no request's messages took the data plane");
        // From now on every request's messages take it.
        let requests = 10;
        let before = counts(&c);
        for _ in 0..requests {
            run_verified(&c, mode, tid);
            tid += 1;
        }
        // The counters move once a send completed, which may trail the
        // request's end on D: wait (bounded) until they show every message.
        let deadline = Instant::now() + Duration::from_secs(10);
        let enough = |a: &(u64, Vec<u64>)| {
            a.0 - before.0 >= requests * per_d
                && a.1
                    .iter()
                    .zip(&before.1)
                    .all(|(a, b)| a - b >= requests * per_p)
        };
        let mut after = counts(&c);
        while !enough(&after) && Instant::now() < deadline {
            std::thread::yield_now();
            after = counts(&c);
        }
        let d = c.decode[0].node.stats();
        assert_eq!(d.data_plane_fallbacks, 0, "{mode:?} D: {d:?}");
        assert!(after.0 - before.0 >= requests * per_d, "{mode:?} D: {d:?}");
        for (rank, r) in c.prefill.iter().enumerate() {
            let p = r.node.stats();
            assert_eq!(p.data_plane_fallbacks, 0, "{mode:?} P{rank}: {p:?}");
            assert!(
                after.1[rank] - before.1[rank] >= requests * per_p,
                "{mode:?} P{rank}: {p:?}"
            );
        }
    }
}

/// Requests a cluster runs to open its data-plane sessions before they
/// carry every message (a bound, so a transport that never opens one fails).
const WARM_UP_LIMIT: usize = 50;

/// Runs request `tid` (two blocks) and checks it succeeded with every byte.
fn run_verified(c: &Cluster, mode: Mode, tid: u64) {
    let t = (tid % 8) as u32;
    let blocks: Vec<u32> = vec![t, 20 + t];
    c.fill(TransferId(tid), &blocks);
    c.decode[0].kv.clear(&blocks);
    c.start_request(TransferId(tid), &blocks, &blocks, 0)
        .expect("request starts");
    let phases = c.wait_decode(TransferId(tid), Duration::from_secs(10));
    assert_eq!(phases, vec![Phase::Success], "{mode:?} request {tid}");
    assert_eq!(
        c.verify(TransferId(tid), &blocks, 0),
        0,
        "{mode:?} request {tid}"
    );
}

/// Transfers whose messages take the data plane are tied to their peers by
/// the bridge, which an otherwise idle bridge (long heartbeat interval) must
/// still do under load: more such messages than `bridge_queue_capacity`
/// between two bridge ticks were once dropped and counted as limit hits.
#[test]
fn data_plane_traffic_between_bridge_ticks_hits_no_limit() {
    let mut s = spec(LayoutKind::Hnd, 1, 1, Mode::Push, TransportKind::Tcp);
    s.timeouts.heartbeat_interval = Duration::from_secs(20);
    s.timeouts.lease = Duration::from_secs(60);
    s.timeouts.hold_limit = Duration::from_secs(120);
    s.timeouts.bootstrap_timeout = Duration::from_secs(60);
    s.timeouts.waiting_timeout = Duration::from_secs(60);
    s.timeouts.claim_timeout = Duration::from_secs(60);
    s.prefill_blocks = 256;
    s.decode_blocks = 256;
    let c = Cluster::start(&s).expect("cluster starts");
    // Three tracked messages per request (Pull, ticket, Status): well over
    // the default 65 536 long before the first tick at 20 s. A slot's
    // blocks are reused once both sides are done with its request.
    let (total, window) = (24_000u64, 256u32);
    let mut free: Vec<u32> = (0..window).collect();
    let mut live: std::collections::HashMap<u64, (u32, bool, bool)> = Default::default();
    let (mut next, mut done, mut ok) = (0u64, 0u64, 0u64);
    while done < total {
        while next < total {
            let Some(slot) = free.pop() else { break };
            c.start_request(TransferId(1 + next), &[slot], &[slot], 0)
                .expect("request starts");
            live.insert(1 + next, (slot, false, false));
            next += 1;
        }
        let (decode, e) = match c.decode_events.try_recv() {
            Ok(e) => (true, e),
            Err(_) => match c.prefill_events.try_recv() {
                Ok(e) => (false, e),
                Err(_) => flume::Selector::new()
                    .recv(&c.decode_events, |r| r.map(|e| (true, e)))
                    .recv(&c.prefill_events, |r| r.map(|e| (false, e)))
                    .wait_timeout(Duration::from_secs(30))
                    .expect("progress")
                    .expect("channels open"),
            },
        };
        let (tid, Some(phase)) = (e.transfer_id, e.finished()) else {
            continue;
        };
        let e = live.get_mut(&tid.0).expect("a request we started");
        if decode {
            e.1 = true;
            done += 1;
            ok += u64::from(phase == Phase::Success);
        } else {
            e.2 = true;
        }
        if e.1 && e.2 {
            free.push(e.0);
            live.remove(&tid.0);
        }
    }
    assert_eq!(ok, total);
    for r in c.prefill.iter().chain(&c.decode) {
        let st = r.node.stats();
        assert_eq!(st.limit_hits, 0, "{st:?}");
        assert_eq!(st.data_plane_fallbacks, 0, "{st:?}");
    }
}
