//! Planner benchmarks.
//!
//! 1. A 128k-token request: 8192 blocks of 16 tokens, 64 layers × K/V (128
//!    regions), HND, homogeneous TP, with contiguous and with random block
//!    ids (the random ids are the same xorshift64 shuffle as
//!    `scripts/py_planner_ref.py`, so both planners see identical input).
//! 2. Heterogeneous TP 4→2, NHD, 8k tokens (512 blocks): per-token slices.
//!
//! After the timed groups, `vs_python` runs the incumbent algorithm
//! (vLLM's Python grouping and per-region loops) on the same inputs, when
//! `python3` with numpy is available, and prints Rust/Python ratios measured
//! in the same run.
//!
//! Run: `cargo bench --bench planner`.

use std::hint::black_box;

use kvferry::machines::internal::planner::{plan, PairLayout, Plan};
use kvferry::machines::{BatchLimits, LayoutKind, ModelSpec, RankLayout, Region};
use kvferry_testkit::bench;
use kvferry_testkit::model::ModelSpecExt;
use std::process::Command;
use std::time::{Duration, Instant};

const HEADS: u32 = 8;
const TOKENS: u32 = 16;
const HEAD_BYTES: u64 = 256;
const LAYERS: u64 = 64;
const REGIONS: u64 = 2 * LAYERS;
const NUM_BLOCKS: u64 = 16384;
const REQUEST_BLOCKS: usize = 8192;
const P_BASE: u64 = 0x7F00_0000_0000;
const D_BASE: u64 = 0x7E00_0000_0000;
const SEED_P: u64 = 0x9E37_79B9_7F4A_7C15;
const SEED_D: u64 = 0xD1B5_4A32_D192_ED03;

fn model(layout: LayoutKind) -> ModelSpec {
    kvferry_testkit::model::small()
        .with_layout(layout)
        .with_heads(HEADS)
        .with_block_tokens(TOKENS)
        .with_head_bytes(HEAD_BYTES)
}

fn rank(tp_size: u32, tp_rank: u32, base: u64) -> RankLayout {
    let kv = u64::from((HEADS / tp_size).max(1)) * u64::from(TOKENS) * HEAD_BYTES;
    RankLayout {
        tp_size,
        tp_rank,
        num_blocks: NUM_BLOCKS,
        regions: (0..REGIONS)
            .map(|i| Region {
                base: base + i * NUM_BLOCKS * kv,
                block_len: kv,
                kv_block_len: kv,
            })
            .collect(),
        stage: kvferry::machines::Stage::SINGLE,
        pools: Vec::new(),
    }
}

/// The same Fisher-Yates shuffle with xorshift64 as the Python script.
fn shuffled_ids(seed: u64, n: u64, take: usize) -> Vec<u64> {
    let mut ids: Vec<u64> = (0..n).collect();
    let mut x = seed;
    for i in (1..ids.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let j = (x % (i as u64 + 1)) as usize;
        ids.swap(i, j);
    }
    ids.truncate(take);
    ids
}

struct Case {
    name: &'static str,
    prefill: Vec<Vec<u64>>,
    decode: Vec<Vec<u64>>,
}

fn cases_128k() -> Vec<Case> {
    let n = REQUEST_BLOCKS as u64;
    vec![
        Case {
            name: "contiguous",
            prefill: vec![(100..100 + n).collect()],
            decode: vec![(5000..5000 + n).collect()],
        },
        Case {
            name: "random",
            prefill: vec![shuffled_ids(SEED_P, NUM_BLOCKS, REQUEST_BLOCKS)],
            decode: vec![shuffled_ids(SEED_D, NUM_BLOCKS, REQUEST_BLOCKS)],
        },
    ]
}

fn bench_128k() {
    let m = model(LayoutKind::Hnd);
    let (p, d) = (rank(1, 0, P_BASE), rank(1, 0, D_BASE));
    let limits = BatchLimits::default();
    let pair = PairLayout::new(&m, &p, &d).expect("valid layout");
    let mut group = bench::group("plan_128k_hnd");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    for case in cases_128k() {
        // Per request, layouts validated once per peer, output reused: the
        // hot path of a running node.
        let mut out = Plan::default();
        group.bench(&format!("{}/plan_into", case.name), |b| {
            b.iter(|| {
                pair.plan_into(&case.prefill, &case.decode, &limits, &mut out)
                    .expect("plan");
                black_box(out.descriptors.len())
            })
        });
        // Everything from scratch: validate 128 regions per side, fresh output.
        group.bench(&format!("{}/plan_fresh", case.name), |b| {
            b.iter(|| {
                let out = plan(&m, &p, &d, &case.prefill, &case.decode, &limits).expect("plan");
                black_box(out.descriptors.len())
            })
        });
    }
}

fn bench_hetero_nhd() {
    // Prefill rank 1 of 4 holds heads 2..4; decode rank 0 of 2 holds 0..4.
    let m = model(LayoutKind::Nhd);
    let (p, d) = (rank(4, 1, P_BASE), rank(2, 0, D_BASE));
    let limits = BatchLimits::default();
    let pair = PairLayout::new(&m, &p, &d).expect("valid layout");
    let blocks = 8192 / TOKENS as u64;
    let pb = vec![(100..100 + blocks).collect::<Vec<u64>>()];
    let db = vec![(5000..5000 + blocks).collect::<Vec<u64>>()];
    let mut out = Plan::default();
    let mut group = bench::group("plan_8k_nhd_tp4to2");
    group
        .sample_size(20)
        .measurement_time(Duration::from_secs(4));
    group.bench("plan_into", |b| {
        b.iter(|| {
            pair.plan_into(&pb, &db, &limits, &mut out).expect("plan");
            black_box(out.descriptors.len())
        })
    });
    eprintln!(
        "plan_8k_nhd_tp4to2: {} descriptors, {} batches",
        out.descriptors.len(),
        out.batches.len()
    );
}

/// Median wall time of `runs` calls of `f`.
fn median_of(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    times.sort_unstable();
    times[times.len() / 2]
}

fn vs_python() {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/py_planner_ref.py");
    let output = match Command::new("python3").args([script, "--json"]).output() {
        Ok(o) if o.status.success() => o,
        Ok(o) => {
            eprintln!(
                "vs_python: skipped (python3 failed: {}); `pip install numpy` first",
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .last()
                    .unwrap_or("")
            );
            return;
        }
        Err(e) => {
            eprintln!("vs_python: skipped (no python3: {e})");
            return;
        }
    };
    let py: serde_json::Value = match serde_json::from_slice(&output.stdout) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("vs_python: skipped (unreadable python output: {e})");
            return;
        }
    };
    let m = model(LayoutKind::Hnd);
    let (p, d) = (rank(1, 0, P_BASE), rank(1, 0, D_BASE));
    let limits = BatchLimits::default();
    let pair = PairLayout::new(&m, &p, &d).expect("valid layout");
    for case in cases_128k() {
        let first: Vec<Vec<u64>> =
            vec![case.prefill[0][..4].to_vec(), case.decode[0][..4].to_vec()];
        let py_first: Vec<Vec<u64>> =
            serde_json::from_value(py[case.name]["first_ids"].clone()).unwrap_or_default();
        assert_eq!(first, py_first, "Python and Rust inputs differ");
        let mut out = Plan::default();
        let reuse = median_of(50, || {
            pair.plan_into(&case.prefill, &case.decode, &limits, &mut out)
                .expect("plan");
        });
        let fresh = median_of(50, || {
            black_box(plan(&m, &p, &d, &case.prefill, &case.decode, &limits).expect("plan"));
        });
        let py_ms = py[case.name]["median_ms"].as_f64().unwrap_or(f64::NAN);
        let ms = |t: Duration| t.as_secs_f64() * 1e3;
        eprintln!(
            "vs_python {}: python {:.3} ms ({} descriptors) | rust plan_into {:.4} ms ({} descriptors, {} batches) = {:.0}x | rust plan_fresh {:.4} ms = {:.0}x",
            case.name,
            py_ms,
            py[case.name]["descriptors"],
            ms(reuse),
            out.descriptors.len(),
            out.batches.len(),
            py_ms / ms(reuse),
            ms(fresh),
            py_ms / ms(fresh),
        );
    }
}

fn main() {
    bench_128k();
    bench_hetero_nhd();
    vs_python();
}
