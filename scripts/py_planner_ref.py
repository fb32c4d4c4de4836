#!/usr/bin/env python3
"""The incumbent planner, timed: vLLM MooncakeConnector's descriptor building.

This is the algorithm of `_build_transfer_params` in vLLM's Mooncake connector
(see shared/reference/000_*.txt): per-group partial-hit trimming and
flattening, `group_concurrent_contiguous` (NumPy), then for every region a
Python loop over the contiguous groups appending (src, dst, len), coalescing a
group into one descriptor when the per-block copy is a whole block on both
sides. It builds the same inputs as `benches/planner.rs` (same xorshift64
shuffle and seeds), so the block ids are identical.

Usage: python3 scripts/py_planner_ref.py [--json]   (needs numpy)
"""

import json
import statistics
import sys
import time

import numpy as np

MASK = (1 << 64) - 1

# The benchmark layout, shared with benches/planner.rs.
HEADS, TOKENS, HEAD_BYTES = 8, 16, 256
KV_BLOCK_LEN = HEADS * TOKENS * HEAD_BYTES  # 32 KiB per block per region
LAYERS = 64
REGIONS = 2 * LAYERS  # K and V of every layer
NUM_BLOCKS = 16384  # pool size on each side
REQUEST_BLOCKS = 8192  # 128k tokens
P_BASE = 0x7F00_0000_0000
D_BASE = 0x7E00_0000_0000
SEED_P, SEED_D = 0x9E3779B97F4A7C15, 0xD1B54A32D192ED03


class XorShift64:
    def __init__(self, seed):
        self.x = seed

    def next(self):
        x = self.x
        x ^= (x << 13) & MASK
        x ^= x >> 7
        x ^= (x << 17) & MASK
        self.x = x
        return x


def shuffled_ids(seed, n, take):
    ids = list(range(n))
    rng = XorShift64(seed)
    for i in range(n - 1, 0, -1):
        j = rng.next() % (i + 1)
        ids[i], ids[j] = ids[j], ids[i]
    return ids[:take]


class Region:
    def __init__(self, base, block_len, kv_block_len):
        self.base_addr = base
        self.block_len = block_len
        self.kv_block_len = kv_block_len


def regions(base):
    stride = NUM_BLOCKS * KV_BLOCK_LEN
    return [Region(base + i * stride, KV_BLOCK_LEN, KV_BLOCK_LEN) for i in range(REGIONS)]


def group_concurrent_contiguous(src_indices, dst_indices):
    """vLLM's vectorised grouping of block ids contiguous on both sides."""
    src_indices = np.asarray(src_indices)
    dst_indices = np.asarray(dst_indices)
    if src_indices.size == 0:
        return [], []
    brk = np.where((np.diff(src_indices) != 1) | (np.diff(dst_indices) != 1))[0] + 1
    src_groups = np.split(src_indices, brk)
    dst_groups = np.split(dst_indices, brk)
    return [g.tolist() for g in src_groups], [g.tolist() for g in dst_groups]


def can_coalesce(local_block_len, remote_block_len, src_off, dst_off, transfer_len):
    return (
        src_off == 0
        and dst_off == 0
        and local_block_len == transfer_len
        and remote_block_len == transfer_len
    )


def build_transfer_params(local_groups, remote_groups, local_regions, remote_regions):
    src_ptrs, dst_ptrs, lengths = [], [], []
    local_block_ids, remote_block_ids = [], []
    for local_group, remote_group in zip(local_groups, remote_groups):
        if len(local_group) < len(remote_group):
            raise ValueError("P num blocks less than D")
        if len(local_group) > len(remote_group):
            local_group = local_group[-len(remote_group):]
        local_block_ids.extend(local_group)
        remote_block_ids.extend(remote_group)
    group_local, group_remote = group_concurrent_contiguous(local_block_ids, remote_block_ids)
    for local_region, remote_region in zip(local_regions, remote_regions):
        # Homogeneous TP: the whole KV of each block, offsets 0.
        src_off, dst_off, transfer_len = 0, 0, local_region.kv_block_len
        coalesce = can_coalesce(
            local_region.block_len, remote_region.block_len, src_off, dst_off, transfer_len
        )
        for gl, gr in zip(group_local, group_remote):
            if coalesce:
                src_ptrs.append(local_region.base_addr + gl[0] * local_region.block_len + src_off)
                dst_ptrs.append(remote_region.base_addr + gr[0] * remote_region.block_len + dst_off)
                lengths.append(transfer_len * len(gl))
            else:
                for lb, rb in zip(gl, gr):
                    src_ptrs.append(local_region.base_addr + lb * local_region.block_len + src_off)
                    dst_ptrs.append(remote_region.base_addr + rb * remote_region.block_len + dst_off)
                    lengths.append(transfer_len)
    return src_ptrs, dst_ptrs, lengths


def cases():
    contiguous = (list(range(100, 100 + REQUEST_BLOCKS)), list(range(5000, 5000 + REQUEST_BLOCKS)))
    random = (
        shuffled_ids(SEED_P, NUM_BLOCKS, REQUEST_BLOCKS),
        shuffled_ids(SEED_D, NUM_BLOCKS, REQUEST_BLOCKS),
    )
    return {"contiguous": contiguous, "random": random}


def main():
    as_json = "--json" in sys.argv[1:]
    local_regions, remote_regions = regions(P_BASE), regions(D_BASE)
    results = {}
    for name, (p_ids, d_ids) in cases().items():
        runs = 200 if name == "contiguous" else 7
        times = []
        count = 0
        for _ in range(runs):
            start = time.perf_counter()
            src, dst, lens = build_transfer_params([p_ids], [d_ids], local_regions, remote_regions)
            times.append(time.perf_counter() - start)
            count = len(lens)
        results[name] = {
            "descriptors": count,
            "median_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3,
            "runs": runs,
            "first_ids": [p_ids[:4], d_ids[:4]],
        }
    if as_json:
        print(json.dumps(results))
    else:
        for name, r in results.items():
            print(
                f"python {name}: {r['descriptors']} descriptors, median {r['median_ms']:.3f} ms, "
                f"min {r['min_ms']:.3f} ms over {r['runs']} runs (first ids {r['first_ids']})"
            )


if __name__ == "__main__":
    main()
