//! Synthetic KV cache with a known byte pattern, for the demo, the CLI nodes
//! and the end-to-end tests.
//!
//! Every byte is a function of `(transfer, layer, K/V, token, head, byte)`,
//! where `token` is the position in the request and `head` the model-wide
//! head index (not the rank-local one). A prefill rank fills the heads it
//! holds, a decode rank checks the heads it holds: since both sides name
//! bytes by model-wide coordinates, slices written by several prefill ranks
//! under heterogeneous TP must reassemble exactly, and a byte that lands in
//! the wrong head, token, layer or request fails verification.
//!
//! For MLA the latent cache is the same on every rank and has no heads:
//! `head` is 0 and `byte` runs over the latent of one token.

use std::sync::Arc;

use kvferry::transport::{HostDevice, SharedMem};
use kvferry_machines::internal::common::TransferId;
use kvferry_machines::{LayoutKind, ModelSpec, Pool, PoolKind, PoolRegion, RankLayout};

/// Where one rank's KV lives and how it is shaped, as the pattern needs it.
#[derive(Clone, Debug)]
pub struct SynthLayout {
    /// Model facts shared by both sides.
    pub model: ModelSpec,
    /// This rank's layout; regions come in (layer, K/V) order for HND/NHD
    /// (`region = 2·layer + kv`) and one per layer for MLA.
    pub rank: RankLayout,
}

/// A mismatch found by [`verify_blocks`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VerifyError {
    /// Region (layer and K/V) of the first bad byte.
    pub region: usize,
    /// Position of its block in the request's block list.
    pub position: u64,
    /// Offset of the byte in the block.
    pub offset: u64,
    /// Expected value.
    pub expected: u8,
    /// Value found.
    pub found: u8,
}

/// A mismatch found by [`SynthKv::verify_pool`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolVerifyError {
    /// The pool.
    pub pool: usize,
    /// The buffer of the pool.
    pub buffer: usize,
    /// Position of the item in the request's list for the pool.
    pub position: usize,
    /// Offset of the first bad byte in the item.
    pub offset: usize,
    /// Expected value.
    pub expected: u8,
    /// Value found.
    pub found: u8,
}

/// SplitMix64 finaliser: a cheap, well-mixed 64-bit hash.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Seed of one row: the bytes of one head of one token of one region.
#[inline]
fn row_seed(transfer: TransferId, region: usize, token: u64, head: u32) -> u64 {
    let a = mix(transfer.0 ^ 0x6b76_6665_7272_7921);
    let b = mix(a ^ (region as u64).wrapping_mul(0x1000_0000_01b3));
    let c = mix(b ^ token);
    mix(c ^ u64::from(head).wrapping_mul(0x9E37_79B9))
}

/// The expected byte `byte` of a row (public so tests can spot-check).
#[inline]
pub fn pattern_byte(transfer: TransferId, region: usize, token: u64, head: u32, byte: u64) -> u8 {
    let word = mix(row_seed(transfer, region, token, head).wrapping_add(byte / 8));
    (word >> ((byte % 8) * 8)) as u8
}

/// Writes the pattern of one row into `out` (`out.len()` bytes from byte 0).
#[inline]
fn fill_row(out: &mut [u8], seed: u64) {
    let mut chunks = out.chunks_exact_mut(8);
    let mut w = 0u64;
    for c in &mut chunks {
        c.copy_from_slice(&mix(seed.wrapping_add(w)).to_le_bytes());
        w += 1;
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let bytes = mix(seed.wrapping_add(w)).to_le_bytes();
        rest.copy_from_slice(&bytes[..rest.len()]);
    }
}

/// Checks one row; returns the offset of the first bad byte and its values.
#[inline]
fn check_row(row: &[u8], seed: u64) -> Option<(usize, u8, u8)> {
    let mut chunks = row.chunks_exact(8);
    let mut w = 0u64;
    for c in &mut chunks {
        let want = mix(seed.wrapping_add(w)).to_le_bytes();
        if c != want {
            let i = (0..8).find(|&i| c[i] != want[i]).unwrap_or(0);
            return Some((w as usize * 8 + i, want[i], c[i]));
        }
        w += 1;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let want = mix(seed.wrapping_add(w)).to_le_bytes();
        for (i, b) in rest.iter().enumerate() {
            if *b != want[i] {
                return Some((w as usize * 8 + i, want[i], *b));
            }
        }
    }
    None
}

/// Visits every row of block `block` of `region` whose request position is
/// `position`: `(offset in block, len, seed)`.
fn rows(
    layout: &SynthLayout,
    transfer: TransferId,
    region: usize,
    position: u64,
    mut visit: impl FnMut(u64, u64, u64) -> bool,
) -> bool {
    let model = &layout.model;
    let Some(r) = layout.rank.regions.get(region) else {
        return true;
    };
    // The pattern follows the model's region, whichever stage holds it.
    let region = layout.rank.stage.first_region as usize + region;
    let tokens = u64::from(model.block_tokens);
    match model.layout {
        LayoutKind::Mla => {
            // One latent row per token; the latent is kv_block_len / tokens bytes.
            let per_token = r.kv_block_len / tokens.max(1);
            for t in 0..tokens {
                let token = position * tokens + t;
                if !visit(
                    t * per_token,
                    per_token,
                    row_seed(transfer, region, token, 0),
                ) {
                    return false;
                }
            }
        }
        LayoutKind::Hnd | LayoutKind::Nhd => {
            let heads = model.heads_per_rank(layout.rank.tp_size);
            let first = model.first_head(layout.rank.tp_size, layout.rank.tp_rank);
            let hb = model.head_bytes;
            for h in 0..heads {
                for t in 0..tokens {
                    let off = match model.layout {
                        LayoutKind::Hnd => (u64::from(h) * tokens + t) * hb,
                        LayoutKind::Nhd | LayoutKind::Mla => {
                            (t * u64::from(heads) + u64::from(h)) * hb
                        }
                    };
                    let token = position * tokens + t;
                    if !visit(off, hb, row_seed(transfer, region, token, first + h)) {
                        return false;
                    }
                }
            }
        }
    }
    true
}

/// Fills the blocks `blocks` (block ids of one group, in request order
/// starting at position `first_position`) of every region with the pattern
/// of `transfer`.
///
/// # Safety
///
/// Every region of `layout.rank` must point at memory valid for writes of
/// `num_blocks × block_len` bytes that nobody else accesses meanwhile, and
/// every block id must be below `num_blocks`.
pub unsafe fn fill_blocks(
    layout: &SynthLayout,
    transfer: TransferId,
    blocks: &[u32],
    first_position: u64,
) {
    for (region, r) in layout.rank.regions.iter().enumerate() {
        for (i, &b) in blocks.iter().enumerate() {
            let block = (r.base + u64::from(b) * r.block_len) as usize as *mut u8;
            rows(
                layout,
                transfer,
                region,
                first_position + i as u64,
                |off, len, seed| {
                    // SAFETY: the caller guarantees the block is valid and ours;
                    // rows stay inside kv_block_len <= block_len.
                    let row = unsafe {
                        std::slice::from_raw_parts_mut(block.add(off as usize), len as usize)
                    };
                    fill_row(row, seed);
                    true
                },
            );
        }
    }
}

/// Checks that blocks `blocks` (request positions from `first_position`)
/// hold the pattern of `transfer` in every region. Returns the first bad
/// byte, if any.
///
/// # Safety
///
/// As [`fill_blocks`], for reads.
pub unsafe fn verify_blocks(
    layout: &SynthLayout,
    transfer: TransferId,
    blocks: &[u32],
    first_position: u64,
) -> Result<(), VerifyError> {
    let mut error = None;
    for (region, r) in layout.rank.regions.iter().enumerate() {
        for (i, &b) in blocks.iter().enumerate() {
            let position = first_position + i as u64;
            let block = (r.base + u64::from(b) * r.block_len) as usize as *const u8;
            rows(layout, transfer, region, position, |off, len, seed| {
                // SAFETY: as in fill_blocks.
                let row =
                    unsafe { std::slice::from_raw_parts(block.add(off as usize), len as usize) };
                match check_row(row, seed) {
                    None => true,
                    Some((at, expected, found)) => {
                        error = Some(VerifyError {
                            region,
                            position,
                            offset: off + at as u64,
                            expected,
                            found,
                        });
                        false
                    }
                }
            });
            if let Some(e) = error {
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Zeroes blocks (so a test sees stale bytes as errors, not as old passes).
///
/// # Safety
///
/// As [`fill_blocks`].
pub unsafe fn clear_blocks(layout: &SynthLayout, blocks: &[u32]) {
    for r in &layout.rank.regions {
        for &b in blocks {
            let block = (r.base + u64::from(b) * r.block_len) as usize as *mut u8;
            // SAFETY: the caller guarantees the block is valid and ours.
            unsafe { std::ptr::write_bytes(block, 0, r.kv_block_len as usize) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelSpecExt;
    use kvferry_machines::Region;

    fn layout(kind: LayoutKind, tp: u32, rank: u32, buf: &mut [u8], blocks: u64) -> SynthLayout {
        let model = crate::model::small().with_layout(kind).with_head_bytes(12);
        let kv = match kind {
            LayoutKind::Mla => 4 * 12,
            LayoutKind::Hnd | LayoutKind::Nhd => u64::from(model.heads_per_rank(tp)) * 4 * 12,
        };
        assert!(buf.len() as u64 >= kv * blocks);
        SynthLayout {
            model,
            rank: RankLayout {
                tp_size: tp,
                tp_rank: rank,
                num_blocks: blocks,
                regions: vec![Region {
                    base: buf.as_mut_ptr() as u64,
                    block_len: kv,
                    kv_block_len: kv,
                }],
                stage: kvferry_machines::Stage::SINGLE,
                pools: Vec::new(),
            },
        }
    }

    #[test]
    fn fill_then_verify_and_detect_one_flipped_byte() {
        for kind in [LayoutKind::Hnd, LayoutKind::Nhd, LayoutKind::Mla] {
            let mut buf = vec![0u8; 4096];
            let l = layout(kind, 1, 0, &mut buf, 8);
            unsafe {
                fill_blocks(&l, TransferId(7), &[1, 3], 0);
                verify_blocks(&l, TransferId(7), &[1, 3], 0).unwrap();
                assert!(
                    verify_blocks(&l, TransferId(8), &[1, 3], 0).is_err(),
                    "other transfer must differ"
                );
                assert!(
                    verify_blocks(&l, TransferId(7), &[1, 3], 1).is_err(),
                    "other position must differ"
                );
            }
            let kv = l.rank.regions[0].kv_block_len as usize;
            buf[3 * kv + 5] ^= 1;
            let e = unsafe { verify_blocks(&l, TransferId(7), &[1, 3], 0) }.unwrap_err();
            assert_eq!((e.position, e.offset), (1, 5));
        }
    }

    #[test]
    fn heads_of_two_ranks_reassemble_on_one() {
        // TP 2 -> TP 1, HND: rank r holds heads 2r, 2r+1; D holds all four.
        let mut p0 = vec![0u8; 4096];
        let mut p1 = vec![0u8; 4096];
        let mut d = vec![0u8; 4096];
        let lp0 = layout(LayoutKind::Hnd, 2, 0, &mut p0, 4);
        let lp1 = layout(LayoutKind::Hnd, 2, 1, &mut p1, 4);
        let ld = layout(LayoutKind::Hnd, 1, 0, &mut d, 4);
        unsafe {
            fill_blocks(&lp0, TransferId(1), &[0], 0);
            fill_blocks(&lp1, TransferId(1), &[0], 0);
        }
        // HND: a rank's heads are consecutive halves of D's block.
        let half = lp0.rank.regions[0].kv_block_len as usize;
        d[..half].copy_from_slice(&p0[..half]);
        d[half..2 * half].copy_from_slice(&p1[..half]);
        unsafe { verify_blocks(&ld, TransferId(1), &[0], 0).unwrap() };
        d.swap(0, half);
        assert!(unsafe { verify_blocks(&ld, TransferId(1), &[0], 0) }.is_err());
    }

    #[test]
    fn pattern_byte_matches_fill() {
        let mut row = [0u8; 21];
        fill_row(&mut row, row_seed(TransferId(3), 2, 9, 1));
        for (i, b) in row.iter().enumerate() {
            assert_eq!(*b, pattern_byte(TransferId(3), 2, 9, 1, i as u64));
        }
    }
}

/// A rank's synthetic KV cache: one buffer per region (layer × K/V, or
/// layer for MLA), never moved or borrowed while the node may touch it.
pub struct SynthKv {
    /// Peers write into them behind Rust's back, so no `&mut` to them may
    /// exist while the node runs. Shared memory (a sealed `memfd` each), as an engine that lets
    /// peers on its host copy straight into its KV cache allocates it.
    bufs: Vec<SharedMem>,
    layout: SynthLayout,
}

// SAFETY: the buffers are plain heap memory addressed by raw pointers; all
// access goes through the unsafe fill/verify functions whose callers
// guarantee exclusive use of the blocks they touch.
unsafe impl Send for SynthKv {}
// SAFETY: as above.
unsafe impl Sync for SynthKv {}

impl SynthKv {
    /// Allocates `num_blocks` blocks for `layers` layers of `model` on rank
    /// `tp_rank` of a TP group of `tp_size`.
    pub fn new(
        model: ModelSpec,
        tp_size: u32,
        tp_rank: u32,
        layers: u32,
        num_blocks: u64,
    ) -> SynthKv {
        Self::new_stage(model, tp_size, tp_rank, layers, num_blocks, (1, 0))
    }

    /// Like [`SynthKv::new`], for pipeline stage `pp.1` of `pp.0`: it
    /// holds the stage's share of the model's `layers` layers, stage `s`
    /// layers `s·L/pp .. (s+1)·L/pp`.
    pub fn new_stage(
        model: ModelSpec,
        tp_size: u32,
        tp_rank: u32,
        layers: u32,
        num_blocks: u64,
        (pp_size, pp_rank): (u32, u32),
    ) -> SynthKv {
        let first_layer = pp_rank * layers / pp_size.max(1);
        let layers = (pp_rank + 1) * layers / pp_size.max(1) - first_layer;
        let per_layer = match model.layout {
            LayoutKind::Mla => 1,
            LayoutKind::Hnd | LayoutKind::Nhd => 2,
        };
        let stage = kvferry_machines::Stage {
            pp_size,
            pp_rank,
            first_region: first_layer * per_layer,
        };
        let kv_block_len = match model.layout {
            LayoutKind::Mla => u64::from(model.block_tokens) * model.head_bytes,
            LayoutKind::Hnd | LayoutKind::Nhd => {
                u64::from(model.heads_per_rank(tp_size))
                    * u64::from(model.block_tokens)
                    * model.head_bytes
            }
        };
        let regions_n = match model.layout {
            LayoutKind::Mla => layers,
            LayoutKind::Hnd | LayoutKind::Nhd => layers * 2,
        };
        let len = (kv_block_len * num_blocks) as usize;
        let mut bufs = Vec::new();
        let mut regions = Vec::new();
        for _ in 0..regions_n {
            let b = shared_zeroed(len.max(1));
            let p = b.as_ptr();
            bufs.push(b);
            regions.push(kvferry_machines::Region {
                base: p as u64,
                block_len: kv_block_len,
                kv_block_len,
            });
        }
        SynthKv {
            bufs,
            layout: SynthLayout {
                model,
                rank: RankLayout {
                    tp_size,
                    tp_rank,
                    num_blocks,
                    regions,
                    stage,
                    pools: Vec::new(),
                },
            },
        }
    }

    /// The same cache in `device`'s memory (a stand-in device's, which
    /// lives as long as the device): every region moves there, zeroed.
    pub fn on_device(mut self, device: &kvferry::transport::HostDevice) -> SynthKv {
        let len = (self.block_bytes_of_region() * self.layout.rank.num_blocks) as usize;
        for r in &mut self.layout.rank.regions {
            r.base = device.alloc(len.max(1));
        }
        self.bufs.clear();
        self
    }

    fn block_bytes_of_region(&self) -> u64 {
        self.layout.rank.regions.first().map_or(0, |r| r.block_len)
    }

    /// The layout to register with the node.
    pub fn kv_layout(&self) -> kvferry::node::KvLayout {
        kvferry::node::KvLayout {
            model: self.layout.model,
            num_blocks: self.layout.rank.num_blocks,
            regions: self.layout.rank.regions.clone(),
            first_region: self.layout.rank.stage.first_region,
            pools: self.layout.rank.pools.clone(),
        }
    }

    /// Adds a pool of `kind` with `items` items per buffer, one buffer per
    /// entry of `item_lens` (its item length), zeroed. Pools are declared
    /// in the order they are added.
    pub fn with_pool(mut self, kind: PoolKind, items: u64, item_lens: &[u64]) -> SynthKv {
        let mut regions = Vec::new();
        for &item_len in item_lens {
            let b = shared_zeroed((item_len * items).max(1) as usize);
            let p = b.as_ptr();
            self.bufs.push(b);
            regions.push(PoolRegion {
                base: p as u64,
                item_len,
            });
        }
        self.layout.rank.pools.push(Pool {
            kind,
            items,
            regions,
        });
        self
    }

    /// The seed of item `position` of a request's list for pool `pool`,
    /// buffer `buffer`. A state pool holds each rank's TP slice, so its
    /// pattern also depends on the TP rank; an aux pool is the same on
    /// every rank.
    fn item_seed(&self, transfer: TransferId, pool: usize, buffer: usize, position: u64) -> u64 {
        let slice = match self.layout.rank.pools[pool].kind {
            PoolKind::Aux => u64::MAX,
            PoolKind::State => u64::from(self.layout.rank.tp_rank),
        };
        let a = mix(transfer.0 ^ 0x706f_6f6c_6974_656d);
        let b = mix(a ^ ((pool as u64) << 32 | buffer as u64));
        mix(mix(b ^ position) ^ slice)
    }

    /// Item `index` of buffer `buffer` of pool `pool`, as a raw slice.
    fn item(&self, pool: usize, buffer: usize, index: u32) -> (*mut u8, usize) {
        let p = &self.layout.rank.pools[pool];
        assert!(u64::from(index) < p.items, "pool index out of range");
        let r = p.regions[buffer];
        let at = r.base + u64::from(index) * r.item_len;
        (at as usize as *mut u8, r.item_len as usize)
    }

    /// Fills the items `indices` of pool `pool` (a request's list for that
    /// pool, position `k` at `indices[k]`) in every buffer with the pattern
    /// of `transfer`. The caller must own the items. Panics on an index
    /// out of range.
    pub fn fill_pool(&self, transfer: TransferId, pool: usize, indices: &[u32]) {
        for buffer in 0..self.layout.rank.pools[pool].regions.len() {
            for (k, &i) in indices.iter().enumerate() {
                let (at, len) = self.item(pool, buffer, i);
                // SAFETY: the item lies in a buffer this rank allocated and
                // owns; the caller guarantees no transfer touches it now.
                let bytes = unsafe { std::slice::from_raw_parts_mut(at, len) };
                fill_row(bytes, self.item_seed(transfer, pool, buffer, k as u64));
            }
        }
    }

    /// Checks that the items `indices` of pool `pool` hold what
    /// [`SynthKv::fill_pool`] wrote for `transfer` on the rank that sent
    /// them (the same TP rank for a state pool).
    pub fn verify_pool(
        &self,
        transfer: TransferId,
        pool: usize,
        indices: &[u32],
    ) -> Result<(), PoolVerifyError> {
        for buffer in 0..self.layout.rank.pools[pool].regions.len() {
            for (k, &i) in indices.iter().enumerate() {
                let (at, len) = self.item(pool, buffer, i);
                // SAFETY: as in `fill_pool`, for reads.
                let bytes = unsafe { std::slice::from_raw_parts(at, len) };
                let seed = self.item_seed(transfer, pool, buffer, k as u64);
                if let Some((offset, expected, found)) = check_row(bytes, seed) {
                    return Err(PoolVerifyError {
                        pool,
                        buffer,
                        position: k,
                        offset,
                        expected,
                        found,
                    });
                }
            }
        }
        Ok(())
    }

    /// True when every byte of the items `indices` of pool `pool` is zero
    /// (the caller must know no transfer touches them meanwhile).
    pub fn pool_untouched(&self, pool: usize, indices: &[u32]) -> bool {
        (0..self.layout.rank.pools[pool].regions.len()).all(|buffer| {
            indices.iter().all(|&i| {
                let (at, len) = self.item(pool, buffer, i);
                // SAFETY: as in `fill_pool`, for reads.
                let bytes = unsafe { std::slice::from_raw_parts(at, len) };
                bytes.iter().all(|&b| b == 0)
            })
        })
    }

    /// Zeroes the items `indices` of pool `pool` in every buffer.
    pub fn clear_pool(&self, pool: usize, indices: &[u32]) {
        for buffer in 0..self.layout.rank.pools[pool].regions.len() {
            for &i in indices {
                let (at, len) = self.item(pool, buffer, i);
                // SAFETY: as in `fill_pool`.
                unsafe { std::ptr::write_bytes(at, 0, len) };
            }
        }
    }

    /// The pattern's view of this rank.
    pub fn layout(&self) -> &SynthLayout {
        &self.layout
    }

    /// Bytes of KV per block on this rank (all regions).
    pub fn block_bytes(&self) -> u64 {
        self.layout
            .rank
            .regions
            .iter()
            .map(|r| r.kv_block_len)
            .sum()
    }

    /// Fills `blocks` (request positions from `first_position`) with the
    /// pattern of `transfer`. The caller must own the blocks (no transfer
    /// in flight on them). Panics on a block id out of range.
    pub fn fill(&self, transfer: TransferId, blocks: &[u32], first_position: u64) {
        self.check(blocks);
        // SAFETY: buffers are valid for num_blocks blocks (checked above) and
        // the caller owns these blocks.
        unsafe { fill_blocks(&self.layout, transfer, blocks, first_position) }
    }

    /// Verifies `blocks` against the pattern of `transfer`.
    pub fn verify(
        &self,
        transfer: TransferId,
        blocks: &[u32],
        first_position: u64,
    ) -> Result<(), VerifyError> {
        self.check(blocks);
        // SAFETY: as in `fill`.
        unsafe { verify_blocks(&self.layout, transfer, blocks, first_position) }
    }

    /// Fills each group's blocks with the pattern of `transfer`; group
    /// `g`'s request positions start at `g · GROUP_POSITIONS`, so no two
    /// groups share a pattern.
    pub fn fill_groups(&self, transfer: TransferId, groups: &[Vec<u32>]) {
        for (g, blocks) in groups.iter().enumerate() {
            self.fill(transfer, blocks, g as u64 * GROUP_POSITIONS);
        }
    }

    /// Verifies each group's blocks against [`SynthKv::fill_groups`]'
    /// pattern; `skipped[g]` leading positions of group `g` were not
    /// transferred.
    pub fn verify_groups(
        &self,
        transfer: TransferId,
        groups: &[Vec<u32>],
        skipped: &[u32],
    ) -> Result<(), VerifyError> {
        for (g, (blocks, &s)) in groups.iter().zip(skipped).enumerate() {
            let first = g as u64 * GROUP_POSITIONS + u64::from(s);
            self.verify(transfer, blocks, first)?;
        }
        Ok(())
    }

    /// Zeroes `blocks`.
    pub fn clear(&self, blocks: &[u32]) {
        self.check(blocks);
        // SAFETY: as in `fill`.
        unsafe { clear_blocks(&self.layout, blocks) }
    }

    fn check(&self, blocks: &[u32]) {
        let n = self.layout.rank.num_blocks;
        assert!(
            blocks.iter().all(|&b| u64::from(b) < n),
            "block id out of range"
        );
    }
}

/// `len` zeroed bytes of shared memory.
fn shared_zeroed(len: usize) -> SharedMem {
    SharedMem::new("kvferry-synth-kv", len)
        .unwrap_or_else(|e| panic!("allocating {len} bytes of shared memory: {e}"))
}

/// What [`Cluster::start`] builds: P and D ranks of one model on one host.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// Model facts.
    pub model: ModelSpec,
    /// Layers (regions are layers × K/V, or layers for MLA).
    pub layers: u32,
    /// Blocks per prefill rank.
    pub prefill_blocks: u64,
    /// Blocks per decode rank.
    pub decode_blocks: u64,
    /// Prefill TP size.
    pub prefill_tp: u32,
    /// Decode TP size.
    pub decode_tp: u32,
    /// Prefill PP size (1: no pipeline parallelism); each stage holds its
    /// share of the layers ([`SynthKv::new_stage`]).
    pub prefill_pp: u32,
    /// Decode PP size: 1 or `prefill_pp`.
    pub decode_pp: u32,
    /// Push or pull.
    pub mode: kvferry_machines::internal::common::Mode,
    /// Data plane.
    pub transport: kvferry::node::TransportKind,
    /// The Mooncake engine's settings ([`kvferry::node::NodeConfig::mooncake`]).
    pub mooncake: kvferry::transport::MooncakeConfig,
    /// Timeouts of every node.
    pub timeouts: kvferry_machines::internal::common::Config,
    /// Serve an embedded bootstrap service from prefill rank 0 on this
    /// address and let decode find the prefill ranks through it; `None`:
    /// decode gets the side-channel addresses directly.
    pub bootstrap: Option<String>,
    /// Let idle executors spin this long before parking (lower wake-up
    /// latency, costs CPU); `None` parks at once.
    pub spin: Option<std::time::Duration>,
    /// [`kvferry::node::NodeConfig::data_plane_messages`] of every node.
    pub data_plane_messages: bool,
    /// [`kvferry::node::NodeConfig::drop_control_ppm`] of every node.
    pub drop_control_ppm: u32,
}

impl ClusterSpec {
    /// One prefill and one decode rank of `model` in `mode` over TCP: two
    /// layers of 64 blocks on each side, the end-to-end tests' timeouts
    /// ([`crate::e2e_timeouts`]), data-plane messages on, no bootstrap
    /// service, spinning or dropped messages. Tests name what they change
    /// with struct update syntax (`ClusterSpec { prefill_tp: 2, ..ClusterSpec::new(m, mode) }`).
    pub fn new(model: ModelSpec, mode: kvferry_machines::internal::common::Mode) -> ClusterSpec {
        ClusterSpec {
            model,
            layers: 2,
            prefill_blocks: 64,
            decode_blocks: 64,
            prefill_tp: 1,
            decode_tp: 1,
            prefill_pp: 1,
            decode_pp: 1,
            mode,
            transport: kvferry::node::TransportKind::Tcp,
            mooncake: kvferry::transport::MooncakeConfig::default(),
            timeouts: crate::e2e_timeouts(),
            bootstrap: None,
            spin: None,
            data_plane_messages: true,
            drop_control_ppm: 0,
        }
    }
}

/// One rank: its node and its synthetic KV memory. The node is shut down
/// before the memory is freed.
pub struct Rank {
    /// The node.
    pub node: kvferry::node::Node,
    /// Its registered memory.
    pub kv: SynthKv,
}

impl Drop for Rank {
    fn drop(&mut self) {
        // The memory must outlive every transfer that can touch it.
        self.node.shutdown(std::time::Duration::from_millis(50));
    }
}

impl Rank {
    /// Starts a node of `config` and registers `kv` as its KV caches.
    pub fn start(
        config: kvferry::node::NodeConfig,
        kv: SynthKv,
    ) -> Result<Rank, kvferry::node::NodeError> {
        Rank::register(kvferry::node::Node::start(config)?, kv)
    }

    /// Registers `kv` as the KV caches of `node`; together they form a rank.
    fn register(node: kvferry::node::Node, kv: SynthKv) -> Result<Rank, kvferry::node::NodeError> {
        // SAFETY: `kv` lives in the same `Rank`, whose drop shuts the node
        // down before the memory is freed.
        unsafe { node.register_kv_caches(kv.kv_layout())? };
        Ok(Rank { node, kv })
    }
}

/// Where one rank sits: `(tp_size, tp_rank)` and `(pp_size, pp_rank)`.
type Place = ((u32, u32), (u32, u32));

impl Rank {
    /// A decode engine of its own (one rank, its node and memory) in
    /// `spec`'s mode, transport and timeouts, beside a cluster's: a second
    /// engine asking the cluster's prefill ranks.
    pub fn lone_decode(spec: &ClusterSpec, name: &str) -> Rank {
        let mut c = kvferry::node::NodeConfig::new(kvferry::node::Role::Decode, name);
        c.mode = spec.mode;
        c.transport = spec.transport;
        c.mooncake = spec.mooncake.clone();
        c.timeouts = spec.timeouts;
        let kv = SynthKv::new(spec.model, 1, 0, spec.layers, spec.decode_blocks);
        Rank::start(c, kv).expect("decode node starts")
    }

    /// Moves `tid` from this prefill rank's blocks `src` into decode rank
    /// `d`'s blocks `dst` (one group), `d` finding this rank through
    /// `target`: fills `src`, clears `dst`, opens both sides, and returns
    /// D's phase, after checking every byte on success and that this rank
    /// ended the same way, each within `timeout`.
    pub fn send_one(
        &self,
        d: &Rank,
        target: &kvferry::node::PrefillTarget,
        tid: TransferId,
        (src, dst): (&[u32], &[u32]),
        timeout: std::time::Duration,
    ) -> kvferry_machines::Phase {
        use kvferry_machines::internal::common::BlockId;
        self.kv.fill(tid, src, 0);
        d.kv.clear(dst);
        let rx = d.node.receiver(tid, target).unwrap();
        rx.request(vec![dst.iter().map(|&b| BlockId(b)).collect()])
            .unwrap();
        let tx = self.node.sender(tid).unwrap();
        tx.send(vec![src.iter().map(|&b| BlockId(b)).collect()], true)
            .unwrap();
        let phase = rx.wait(timeout);
        if phase == kvferry_machines::Phase::Success {
            assert_eq!(d.kv.verify(tid, dst, 0), Ok(()), "bytes of {tid}");
        }
        assert_eq!(tx.wait(timeout), phase, "P's phase of {tid}");
        phase
    }

    /// True when every KV byte of blocks `ids` is zero on this rank (the
    /// caller must know no transfer touches them meanwhile).
    pub fn untouched(&self, ids: &[u32]) -> bool {
        self.kv.kv_layout().regions.iter().all(|r| {
            ids.iter().all(|&b| {
                let at = r.base + u64::from(b) * r.block_len;
                // SAFETY: the block lies in a region `self.kv` allocated and
                // still owns; the caller guarantees nothing writes it now.
                let bytes =
                    unsafe { std::slice::from_raw_parts(at as *const u8, r.kv_block_len as usize) };
                bytes.iter().all(|&x| x == 0)
            })
        })
    }
}

/// The configuration every rank of `spec` shares, for the rank at `place`
/// in `role`. Its events are tagged with its index among the ranks of its
/// role, `pp_rank · tp_size + tp_rank`.
fn node_config(
    spec: &ClusterSpec,
    role: kvferry::node::Role,
    name: &str,
    ((tp_size, tp_rank), (pp_size, pp_rank)): Place,
    events: &flume::Sender<kvferry::node::Event>,
) -> kvferry::node::NodeConfig {
    let mut c = kvferry::node::NodeConfig::new(role, name);
    c.tp_size = tp_size;
    c.tp_rank = tp_rank;
    c.pp_size = pp_size;
    c.pp_rank = pp_rank;
    c.mode = spec.mode;
    c.transport = spec.transport;
    c.mooncake = spec.mooncake.clone();
    c.timeouts = spec.timeouts;
    c.events = Some(kvferry::node::EventSink {
        tag: pp_rank * tp_size + tp_rank,
        tx: events.clone(),
    });
    c.data_plane_messages = spec.data_plane_messages;
    c.drop_control_ppm = spec.drop_control_ppm;
    if let Some(spin) = spec.spin {
        c.reactor.poll_policy = kvferry::reactor::PollPolicy::Spin { spin };
    }
    // `kvferry demo` and the soak run keyed when the environment names a key.
    c.with_auth_from_env()
}

/// Request positions reserved per KV-cache group by
/// [`Cluster::fill_groups`].
pub const GROUP_POSITIONS: u64 = 1 << 32;

/// P and D ranks in one process, wired together.
pub struct Cluster {
    /// Decode ranks, by stage then TP rank. Declared (so dropped) before the prefill
    /// ranks: a decode rank that outlives its prefill peers sees their
    /// connections drop and logs them as dead peers at every shutdown.
    pub decode: Vec<Rank>,
    /// Prefill ranks, by stage then TP rank (`pp_rank · tp + tp_rank`).
    pub prefill: Vec<Rank>,
    /// How decode ranks find the prefill ranks.
    pub target: kvferry::node::PrefillTarget,
    /// The decode ranks' events, tagged with the decode rank.
    pub decode_events: flume::Receiver<kvferry::node::Event>,
    /// The prefill ranks' events, tagged with the prefill rank.
    pub prefill_events: flume::Receiver<kvferry::node::Event>,
}

impl Cluster {
    /// Starts and registers every rank.
    pub fn start(spec: &ClusterSpec) -> Result<Cluster, kvferry::node::NodeError> {
        Self::start_on(spec, [None, None])
    }

    /// Like [`Cluster::start`], with the KV of prefill's ranks (`devices[0]`)
    /// and of decode's (`devices[1]`) in a stand-in device's memory, the
    /// nodes configured with that device.
    pub fn start_on(
        spec: &ClusterSpec,
        devices: [Option<Arc<HostDevice>>; 2],
    ) -> Result<Cluster, kvferry::node::NodeError> {
        use kvferry::node::PrefillTarget;
        let (dtx, drx) = flume::unbounded();
        let (ptx, prx) = flume::unbounded();
        let [p_dev, d_dev] = devices;
        let (prefill, bootstrap_addr) = Self::start_prefill(spec, &ptx, p_dev.as_ref())?;
        if let Some(addr) = &bootstrap_addr {
            Self::wait_for_prefill(spec, addr)?;
        }
        let decode = Self::start_decode(spec, &dtx, d_dev.as_ref())?;
        let target = match bootstrap_addr {
            Some(addr) => PrefillTarget::Bootstrap {
                addr,
                engine_id: "prefill".into(),
                dp_rank: Some(0),
            },
            None => PrefillTarget::Direct {
                tp_size: spec.prefill_tp,
                pp_size: spec.prefill_pp,
                side_channels: prefill.iter().map(|r| r.node.side_channel_addr()).collect(),
            },
        };
        Ok(Cluster {
            prefill,
            decode,
            target,
            decode_events: drx,
            prefill_events: prx,
        })
    }

    /// Starts the prefill ranks; with `spec.bootstrap`, rank 0 serves the
    /// bootstrap service (whose address comes back) and the others register
    /// with it.
    fn start_prefill(
        spec: &ClusterSpec,
        events: &flume::Sender<kvferry::node::Event>,
        device: Option<&Arc<HostDevice>>,
    ) -> Result<(Vec<Rank>, Option<String>), kvferry::node::NodeError> {
        use kvferry::node::Role;
        let mut prefill = Vec::new();
        let mut bootstrap_addr = None;
        let (tp, pp) = (spec.prefill_tp, spec.prefill_pp.max(1));
        for (s, r) in (0..pp).flat_map(|s| (0..tp).map(move |r| (s, r))) {
            let place = ((tp, r), (pp, s));
            let mut c = node_config(spec, Role::Prefill, "prefill", place, events);
            c.device = device.map(|d| Arc::clone(d) as Arc<dyn kvferry::transport::Device>);
            let first = (s, r) == (0, 0);
            if let Some(b) = &spec.bootstrap {
                if first {
                    c.serve_bootstrap = Some(b.clone());
                } else {
                    c.bootstrap = bootstrap_addr.clone();
                }
            }
            let node = kvferry::node::Node::start(c)?;
            if first {
                bootstrap_addr = node.bootstrap_addr();
            }
            let kv =
                SynthKv::new_stage(spec.model, tp, r, spec.layers, spec.prefill_blocks, (pp, s));
            let kv = match device {
                Some(d) => kv.on_device(d),
                None => kv,
            };
            prefill.push(Rank::register(node, kv)?);
        }
        Ok((prefill, bootstrap_addr))
    }

    /// Waits until the bootstrap service at `addr` lists every prefill rank.
    fn wait_for_prefill(spec: &ClusterSpec, addr: &str) -> Result<(), kvferry::node::NodeError> {
        // Registration runs in the background; decode asks only once
        // every prefill rank is listed, so no request waits for a retry.
        // Keyed like the nodes (`node_config`).
        let key = kvferry::auth::ClusterKey::from_env()?;
        let client = kvferry::bootstrap::BootstrapClient::new(addr)?.with_key(key);
        let policy = kvferry::bootstrap::RetryPolicy {
            deadline: std::time::Duration::from_secs(10),
            ..kvferry::bootstrap::RetryPolicy::default()
        };
        let (tp, pp) = (spec.prefill_tp as usize, spec.prefill_pp.max(1) as usize);
        client.wait_for_stages("prefill", tp, pp, policy)?;
        Ok(())
    }

    /// Starts the decode ranks.
    fn start_decode(
        spec: &ClusterSpec,
        events: &flume::Sender<kvferry::node::Event>,
        device: Option<&Arc<HostDevice>>,
    ) -> Result<Vec<Rank>, kvferry::node::NodeError> {
        use kvferry::node::Role;
        let mut decode = Vec::new();
        let (tp, pp) = (spec.decode_tp, spec.decode_pp.max(1));
        for (s, r) in (0..pp).flat_map(|s| (0..tp).map(move |r| (s, r))) {
            let mut c = node_config(spec, Role::Decode, "decode", ((tp, r), (pp, s)), events);
            c.device = device.map(|d| Arc::clone(d) as Arc<dyn kvferry::transport::Device>);
            let node = kvferry::node::Node::start(c)?;
            let kv =
                SynthKv::new_stage(spec.model, tp, r, spec.layers, spec.decode_blocks, (pp, s));
            let kv = match device {
                Some(d) => kv.on_device(d),
                None => kv,
            };
            decode.push(Rank::register(node, kv)?);
        }
        Ok(decode)
    }

    /// Fills the prefill blocks of `transfer` on every prefill rank.
    pub fn fill(&self, transfer: TransferId, src_blocks: &[u32]) {
        for r in &self.prefill {
            r.kv.fill(transfer, src_blocks, 0);
        }
    }

    /// Verifies the destination blocks of `transfer` on every decode rank;
    /// `prefix` leading positions were not transferred. Returns the number
    /// of decode ranks whose bytes are wrong.
    pub fn verify(&self, transfer: TransferId, dst_blocks: &[u32], prefix: u64) -> usize {
        self.decode
            .iter()
            .filter(|r| r.kv.verify(transfer, dst_blocks, prefix).is_err())
            .count()
    }

    /// Starts one single-group request on every rank: decode asks for
    /// `dst_blocks` (skipping `prefix` positions), prefill sends `src_blocks`
    /// as one last chunk.
    pub fn start_request(
        &self,
        transfer: TransferId,
        src_blocks: &[u32],
        dst_blocks: &[u32],
        prefix: u32,
    ) -> Result<(), kvferry::node::NodeError> {
        self.start_request_groups(
            transfer,
            &[src_blocks.to_vec()],
            &[dst_blocks.to_vec()],
            &[prefix],
        )
    }

    /// Like [`Cluster::start_request`] with several KV-cache groups: per
    /// group, prefill's blocks, decode's blocks and decode's prefix hit.
    pub fn start_request_groups(
        &self,
        transfer: TransferId,
        src_blocks: &[Vec<u32>],
        dst_blocks: &[Vec<u32>],
        prefix: &[u32],
    ) -> Result<(), kvferry::node::NodeError> {
        use kvferry_machines::internal::common::BlockId;
        let ids = |lists: &[Vec<u32>]| -> Vec<Vec<BlockId>> {
            lists
                .iter()
                .map(|l| l.iter().map(|&b| BlockId(b)).collect())
                .collect()
        };
        let (src, dst) = (ids(src_blocks), ids(dst_blocks));
        // Every rank's executor is woken once, after all of them were asked.
        kvferry::node::Node::batch(|| {
            for r in &self.decode {
                r.node
                    .receiver(transfer, &self.target)?
                    .request_with_prefix(dst.clone(), prefix.to_vec())?;
            }
            for r in &self.prefill {
                r.node.sender(transfer)?.send(src.clone(), true)?;
            }
            Ok(())
        })
    }

    /// Fills each group's prefill blocks of `transfer` on every prefill
    /// rank ([`SynthKv::fill_groups`]).
    pub fn fill_groups(&self, transfer: TransferId, src_blocks: &[Vec<u32>]) {
        for r in &self.prefill {
            r.kv.fill_groups(transfer, src_blocks);
        }
    }

    /// Verifies each group's destination blocks on every decode rank
    /// (`prefix[g]` leading positions of group `g` were not transferred);
    /// the number of decode ranks with a wrong byte.
    pub fn verify_groups(
        &self,
        transfer: TransferId,
        dst_blocks: &[Vec<u32>],
        prefix: &[u32],
    ) -> usize {
        self.decode
            .iter()
            .filter(|r| r.kv.verify_groups(transfer, dst_blocks, prefix).is_err())
            .count()
    }

    /// Waits until every decode rank reported a terminal phase for
    /// `transfer` (or `timeout` passed); returns the phases by decode rank.
    pub fn wait_decode(
        &self,
        transfer: TransferId,
        timeout: std::time::Duration,
    ) -> Vec<kvferry_machines::Phase> {
        wait_ranks(&self.decode, &self.decode_events, transfer, timeout)
    }

    /// Like [`Cluster::wait_decode`], for the prefill ranks.
    pub fn wait_prefill(
        &self,
        transfer: TransferId,
        timeout: std::time::Duration,
    ) -> Vec<kvferry_machines::Phase> {
        wait_ranks(&self.prefill, &self.prefill_events, transfer, timeout)
    }
}

/// Waits until every rank of `ranks` reported a terminal phase for
/// `transfer` on `events` (or `timeout` passed); the phases by rank. Other
/// events on the channel are consumed.
fn wait_ranks(
    ranks: &[Rank],
    events: &flume::Receiver<kvferry::node::Event>,
    transfer: TransferId,
    timeout: std::time::Duration,
) -> Vec<kvferry_machines::Phase> {
    use kvferry_machines::Phase;
    let mut phases: Vec<Option<Phase>> = ranks
        .iter()
        .map(|r| r.node.phase(transfer).filter(|p| p.is_terminal()))
        .collect();
    let deadline = std::time::Instant::now() + timeout;
    while phases.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match events.recv_timeout(left) {
            Ok(kvferry::node::Event {
                tag,
                transfer_id,
                kind: kvferry::node::EventKind::Finished(p),
            }) if transfer_id == transfer => phases[tag as usize] = Some(p),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    phases
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            p.or_else(|| ranks[i].node.phase(transfer))
                .unwrap_or(Phase::Bootstrapping)
        })
        .collect()
}
