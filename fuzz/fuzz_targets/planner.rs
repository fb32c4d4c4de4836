//! `kvferry_machines::internal::planner::plan` on structured input built with
//! `arbitrary`: small numbers so that most inputs pass validation and reach
//! the address arithmetic, plus raw `u64`s now and then for the overflow
//! paths. Checks every plan with `check.rs` (descriptors stay inside the
//! requested blocks' KV bytes, batches partition the plan, limits hold).

#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use kvferry_machines::{BatchLimits, LayoutKind, ModelSpec, RankLayout, Region};
use libfuzzer_sys::fuzz_target;

#[path = "check.rs"]
mod check;

/// A number that is usually small (so layouts validate) and sometimes any
/// `u64` (so overflow checks are exercised).
fn num(u: &mut Unstructured<'_>, small_max: u64) -> arbitrary::Result<u64> {
    if u.ratio(1, 16)? {
        u64::arbitrary(u)
    } else {
        u.int_in_range(0..=small_max)
    }
}

fn rank(
    u: &mut Unstructured<'_>,
    regions: usize,
    model: &ModelSpec,
) -> arbitrary::Result<RankLayout> {
    let tp_size = num(u, 8)? as u32;
    let tp_rank = num(u, 8)? as u32;
    let num_blocks = num(u, 64)?;
    // Often the exact KV length validation wants, so planning proceeds.
    let heads = model.heads_per_rank(tp_size.max(1)) as u64;
    // Saturating: huge raw fields are for the planner to reject, not us.
    let exact_kv = heads
        .saturating_mul(model.block_tokens as u64)
        .saturating_mul(model.head_bytes);
    let mut base = num(u, 1 << 20)?;
    let mut out = Vec::with_capacity(regions);
    for _ in 0..regions {
        let kv_block_len = if u.ratio(3, 4)? {
            exact_kv
        } else {
            num(u, 4096)?
        };
        let block_len = if u.ratio(3, 4)? {
            kv_block_len.saturating_mul(u.int_in_range(1..=2)?)
        } else {
            num(u, 8192)?
        };
        out.push(Region {
            base,
            block_len,
            kv_block_len,
        });
        // Usually disjoint regions laid end to end, sometimes anywhere.
        base = if u.ratio(7, 8)? {
            base.saturating_add(block_len.saturating_mul(num_blocks))
                .saturating_add(num(u, 64)?)
        } else {
            num(u, 1 << 24)?
        };
    }
    Ok(RankLayout {
        tp_size,
        tp_rank,
        num_blocks,
        regions: out,
        stage: kvferry_machines::Stage::SINGLE,
        pools: Vec::new(),
    })
}

fn blocks(
    u: &mut Unstructured<'_>,
    groups: usize,
    num_blocks: u64,
) -> arbitrary::Result<Vec<Vec<u64>>> {
    let mut out = Vec::with_capacity(groups);
    for _ in 0..groups {
        let n = u.int_in_range(0..=16)?;
        let mut g = Vec::with_capacity(n);
        for _ in 0..n {
            g.push(if u.ratio(15, 16)? {
                u.int_in_range(0..=num_blocks.saturating_add(1))?
            } else {
                u64::arbitrary(u)?
            });
        }
        out.push(g);
    }
    Ok(out)
}

#[derive(Debug)]
struct Input {
    model: ModelSpec,
    prefill: RankLayout,
    decode: RankLayout,
    prefill_blocks: Vec<Vec<u64>>,
    decode_blocks: Vec<Vec<u64>>,
    limits: BatchLimits,
}

impl<'a> Arbitrary<'a> for Input {
    fn arbitrary(u: &mut Unstructured<'a>) -> arbitrary::Result<Input> {
        let layout = *u.choose(&[LayoutKind::Hnd, LayoutKind::Nhd, LayoutKind::Mla])?;
        let model = ModelSpec {
            layout,
            total_kv_heads: num(u, 16)? as u32,
            block_tokens: num(u, 32)? as u32,
            head_bytes: num(u, 256)?,
        };
        let regions = u.int_in_range(0..=6)?;
        let prefill = rank(u, regions, &model)?;
        let decode_regions = if u.ratio(15, 16)? {
            regions
        } else {
            u.int_in_range(0..=6)?
        };
        let decode = rank(u, decode_regions, &model)?;
        let groups = u.int_in_range(0..=3)?;
        let prefill_blocks = blocks(u, groups, prefill.num_blocks)?;
        let decode_groups = if u.ratio(15, 16)? {
            groups
        } else {
            u.int_in_range(0..=3)?
        };
        let decode_blocks = blocks(u, decode_groups, decode.num_blocks)?;
        let limits = BatchLimits {
            batch_descriptors_max: num(u, 256)? as usize,
            batch_bytes_max: num(u, 1 << 20)?,
            // Bounded so one run stays fast; the planner must turn more into
            // an error, which the `check` below verifies.
            descriptors_max: num(u, 1 << 16)?.min(1 << 16) as usize,
        };
        Ok(Input {
            model,
            prefill,
            decode,
            prefill_blocks,
            decode_blocks,
            limits,
        })
    }
}

fuzz_target!(|input: Input| {
    let Input {
        model,
        prefill,
        decode,
        prefill_blocks,
        decode_blocks,
        limits,
    } = input;
    let Ok(plan) = kvferry_machines::internal::planner::plan(
        &model,
        &prefill,
        &decode,
        &prefill_blocks,
        &decode_blocks,
        &limits,
    ) else {
        return;
    };
    check::check_plan(
        &plan,
        &prefill,
        &decode,
        &prefill_blocks,
        &decode_blocks,
        &limits,
    );
});
