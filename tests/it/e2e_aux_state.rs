//! End-to-end with SGLang's aux and state buffers: prefill and decode
//! nodes in one process, real side channel and tcp data plane. Each rank
//! registers an aux pool (two buffers, as the first output token and its
//! metadata), a one-index state pool (Mamba) and a paged state pool
//! (SWA) beside its KV; a request names its items after its KV blocks,
//! and every byte of KV and items is verified on decode. State under
//! different TP sizes is refused on both sides with `Unsupported`.

use std::time::Duration;

use kvferry::machines::internal::common::Mode;
use kvferry::machines::internal::planner::PlanError;
use kvferry::machines::Phase;
use kvferry::machines::{ModelSpec, PoolKind};
use kvferry::node::{NodeConfig, PrefillTarget, Role, TransportKind};
use kvferry::{BlockId, FailReason, Misuse, NodeError, TransferId};
use kvferry_testkit::e2e_timeouts;
use kvferry_testkit::model;
use kvferry_testkit::synth::{Rank, SynthKv};

const WAIT: Duration = Duration::from_secs(10);
const LAYERS: u32 = 2;
const BLOCKS: u64 = 64;
const MODEL: ModelSpec = model::small();

/// A rank's KV and pools: an aux pool of two buffers (4 and 61 bytes per
/// item); with `state`, then a Mamba-like state pool (one index per
/// request, two buffers) and an SWA-like one (paged: several indices).
fn memory(tp: (u32, u32), state: bool) -> SynthKv {
    let kv = SynthKv::new(MODEL, tp.0, tp.1, LAYERS, BLOCKS).with_pool(PoolKind::Aux, 16, &[4, 61]);
    if !state {
        return kv;
    }
    kv.with_pool(PoolKind::State, 8, &[100, 36])
        .with_pool(PoolKind::State, 32, &[64])
}

/// A node of `role` over tcp in `mode`, with the end-to-end timeouts.
fn config(role: Role, mode: Mode) -> NodeConfig {
    let name = if role == Role::Prefill {
        "prefill"
    } else {
        "decode"
    };
    let mut c = NodeConfig::new(role, name);
    c.mode = mode;
    c.transport = TransportKind::Tcp;
    c.timeouts = e2e_timeouts();
    c
}

fn start(role: Role, mode: Mode, tp: (u32, u32), state: bool) -> Rank {
    let mut c = config(role, mode);
    (c.tp_size, c.tp_rank) = tp;
    Rank::start(c, memory(tp, state)).expect("rank starts")
}

/// Prefill ranks of TP `p_tp`, decode ranks of TP `d_tp`, and how decode
/// finds prefill.
fn ranks(mode: Mode, p_tp: u32, d_tp: u32, state: bool) -> (Vec<Rank>, Vec<Rank>, PrefillTarget) {
    let prefill: Vec<Rank> = (0..p_tp)
        .map(|r| start(Role::Prefill, mode, (p_tp, r), state))
        .collect();
    let decode = (0..d_tp)
        .map(|r| start(Role::Decode, mode, (d_tp, r), state))
        .collect();
    let target = PrefillTarget::Direct {
        tp_size: p_tp,
        pp_size: 1,
        side_channels: prefill.iter().map(|r| r.node.side_channel_addr()).collect(),
    };
    (prefill, decode, target)
}

/// One request's lists on one side: KV blocks, then one index list per pool.
#[derive(Clone)]
struct Lists(Vec<Vec<u32>>);

impl Lists {
    fn ids(&self) -> Vec<Vec<BlockId>> {
        (self.0.iter())
            .map(|l| l.iter().map(|&b| BlockId(b)).collect())
            .collect()
    }

    /// The lists of a first chunk holding the first `n` KV blocks and no
    /// item, and of the last chunk holding the rest and every item.
    fn chunks(&self, n: usize) -> (Lists, Lists) {
        let mut first = Lists(vec![Vec::new(); self.0.len()]);
        let mut last = self.clone();
        first.0[0] = last.0[0].drain(..n).collect();
        (first, last)
    }
}

/// Request `t`'s lists on prefill and on decode; with `state`, items of
/// the Mamba and SWA pools too. Indices differ between the sides.
fn request(t: u32, state: bool) -> (Lists, Lists) {
    let kv_p = vec![1 + t, 2 + t, 9 + t];
    let kv_d = vec![40 - t, 20 + t, 30];
    let mut p = vec![kv_p, vec![t % 16]];
    let mut d = vec![kv_d, vec![15 - t % 16]];
    if state {
        p.extend([vec![t % 8], vec![3 + t, 4 + t, 20]]);
        d.extend([vec![7 - t % 8], vec![30 - t, 10, 11]]);
    }
    (Lists(p), Lists(d))
}

/// Moves request `tid` from every prefill rank to every decode rank (the
/// prefill ranks' KV in `chunk`-block first chunks when given) and checks
/// every byte on decode.
fn move_one(
    prefill: &[Rank],
    decode: &[Rank],
    target: &PrefillTarget,
    tid: TransferId,
    state: bool,
    chunk: Option<usize>,
) {
    let (p, d) = request(tid.0 as u32 % 10, state);
    for r in prefill {
        r.kv.fill(tid, &p.0[0], 0);
        for (pool, list) in p.0[1..].iter().enumerate() {
            r.kv.fill_pool(tid, pool, list);
        }
    }
    for r in decode {
        r.kv.clear(&d.0[0]);
        for (pool, list) in d.0[1..].iter().enumerate() {
            r.kv.clear_pool(pool, list);
        }
    }
    let rx: Vec<_> = (decode.iter())
        .map(|r| r.node.receiver(tid, target).unwrap())
        .collect();
    for rx in &rx {
        rx.request(d.ids()).unwrap();
    }
    let tx: Vec<_> = prefill
        .iter()
        .map(|r| r.node.sender(tid).unwrap())
        .collect();
    for tx in &tx {
        match chunk {
            Some(n) => {
                let (first, last) = p.chunks(n);
                tx.send(first.ids(), false).unwrap();
                tx.send(last.ids(), true).unwrap();
            }
            None => tx.send(p.ids(), true).unwrap(),
        }
    }
    for (r, rx) in decode.iter().zip(&rx) {
        assert_eq!(rx.wait(WAIT), Phase::Success, "{tid} on decode");
        assert_eq!(r.kv.verify(tid, &d.0[0], 0), Ok(()), "KV of {tid}");
        for (pool, list) in d.0[1..].iter().enumerate() {
            assert_eq!(
                r.kv.verify_pool(tid, pool, list),
                Ok(()),
                "pool {pool} of {tid}"
            );
        }
    }
    for tx in &tx {
        assert_eq!(tx.wait(WAIT), Phase::Success, "{tid} on prefill");
    }
}

fn run(mode: Mode, p_tp: u32, d_tp: u32, state: bool) {
    let (prefill, decode, target) = ranks(mode, p_tp, d_tp, state);
    for t in 0..4 {
        let chunk = (t % 2 == 1).then_some(1 + (t as usize / 2) % 2);
        move_one(
            &prefill,
            &decode,
            &target,
            TransferId(100 + t),
            state,
            chunk,
        );
    }
}

#[test]
fn kv_aux_and_state_move_push_equal_tp() {
    run(Mode::Push, 2, 2, true);
}

#[test]
fn kv_aux_and_state_move_pull_equal_tp() {
    run(Mode::Pull, 2, 2, true);
}

#[test]
fn kv_aux_and_state_move_push_tp1() {
    run(Mode::Push, 1, 1, true);
}

/// Aux is the same on every TP rank, so it moves between TP sizes: each
/// decode rank takes it from its first prefill source.
#[test]
fn aux_moves_between_different_tp_sizes() {
    run(Mode::Push, 2, 1, false);
    run(Mode::Pull, 1, 2, false);
}

/// Prefill TP 2 → decode TP 1 with state pools: both sides learn it at
/// the hello and refuse the request with `Unsupported`; no byte of the
/// decode rank's items is written.
fn state_between_tp_sizes_is_refused(mode: Mode) {
    let (prefill, decode, target) = ranks(mode, 2, 1, true);
    let tid = TransferId(7);
    let (p, d) = request(7, true);
    for r in &prefill {
        r.kv.fill(tid, &p.0[0], 0);
        for (pool, list) in p.0[1..].iter().enumerate() {
            r.kv.fill_pool(tid, pool, list);
        }
    }
    let dr = &decode[0];
    dr.kv.clear(&d.0[0]);
    for (pool, list) in d.0[1..].iter().enumerate() {
        dr.kv.clear_pool(pool, list);
    }
    let rx = dr.node.receiver(tid, &target).unwrap();
    rx.request(d.ids()).unwrap();
    let tx: Vec<_> = prefill
        .iter()
        .map(|r| r.node.sender(tid).unwrap())
        .collect();
    for tx in &tx {
        tx.send(p.ids(), true).unwrap();
    }
    let unsupported = Phase::Failed(FailReason::Unsupported);
    assert_eq!(rx.wait(WAIT), unsupported, "decode");
    for (r, tx) in tx.iter().enumerate() {
        assert_eq!(tx.wait(WAIT), unsupported, "prefill rank {r}");
    }
    assert!(dr.untouched(&d.0[0]), "no KV byte landed");
    for (pool, list) in d.0[1..].iter().enumerate() {
        assert!(
            dr.kv.pool_untouched(pool, list),
            "no byte of pool {pool} landed"
        );
    }
}

#[test]
fn state_between_tp_sizes_is_refused_push() {
    state_between_tp_sizes_is_refused(Mode::Push);
}

#[test]
fn state_between_tp_sizes_is_refused_pull() {
    state_between_tp_sizes_is_refused(Mode::Pull);
}

/// State pools under pipeline parallelism are refused when they are
/// registered (aux pools move from the last stage:
/// `aux_moves_from_the_last_pipeline_stage_*`).
#[test]
fn state_pools_under_pipeline_parallelism_are_refused_at_registration() {
    let mut c = NodeConfig::new(Role::Prefill, "prefill");
    c.pp_size = 2;
    let node = kvferry::node::Node::start(c).unwrap();
    let kv =
        SynthKv::new_stage(MODEL, 1, 0, LAYERS, BLOCKS, (2, 0)).with_pool(PoolKind::State, 4, &[8]);
    // SAFETY: `kv` outlives the node, which is shut down first.
    let refused = unsafe { node.register_kv_caches(kv.kv_layout()) };
    node.shutdown(Duration::from_millis(50));
    assert!(
        matches!(
            refused,
            Err(NodeError::Misuse(Misuse::Layout(
                PlanError::Unsupported { .. }
            )))
        ),
        "{refused:?}"
    );
}

/// A prefill engine of two pipeline stages feeds a decode engine without
/// stages: each stage moves its layers and the last stage the aux items.
/// Stage 0's aux holds another request's pattern, which must not land.
fn aux_from_the_last_stage(mode: Mode) {
    let stages: Vec<Rank> = (0..2)
        .map(|s| {
            let mut c = config(Role::Prefill, mode);
            (c.pp_size, c.pp_rank) = (2, s);
            let kv = SynthKv::new_stage(MODEL, 1, 0, LAYERS, BLOCKS, (2, s)).with_pool(
                PoolKind::Aux,
                16,
                &[4, 61],
            );
            Rank::start(c, kv).expect("stage starts")
        })
        .collect();
    let decode = start(Role::Decode, mode, (1, 0), false);
    let target = PrefillTarget::Direct {
        tp_size: 1,
        pp_size: 2,
        side_channels: stages.iter().map(|r| r.node.side_channel_addr()).collect(),
    };
    let tid = TransferId(300);
    let (p, d) = request(3, false);
    for (s, r) in stages.iter().enumerate() {
        r.kv.fill(tid, &p.0[0], 0);
        let aux_of = if s == 0 { TransferId(999) } else { tid };
        r.kv.fill_pool(aux_of, 0, &p.0[1]);
    }
    decode.kv.clear(&d.0[0]);
    decode.kv.clear_pool(0, &d.0[1]);
    let rx = decode.node.receiver(tid, &target).unwrap();
    rx.request(d.ids()).unwrap();
    let tx: Vec<_> = stages.iter().map(|r| r.node.sender(tid).unwrap()).collect();
    for tx in &tx {
        tx.send(p.ids(), true).unwrap();
    }
    assert_eq!(rx.wait(WAIT), Phase::Success, "{tid} on decode");
    assert_eq!(decode.kv.verify(tid, &d.0[0], 0), Ok(()), "KV of {tid}");
    assert_eq!(
        decode.kv.verify_pool(tid, 0, &d.0[1]),
        Ok(()),
        "aux of {tid}"
    );
    for tx in &tx {
        assert_eq!(tx.wait(WAIT), Phase::Success, "{tid} on prefill");
    }
}

#[test]
fn aux_moves_from_the_last_pipeline_stage_push() {
    aux_from_the_last_stage(Mode::Push);
}

#[test]
fn aux_moves_from_the_last_pipeline_stage_pull() {
    aux_from_the_last_stage(Mode::Pull);
}
