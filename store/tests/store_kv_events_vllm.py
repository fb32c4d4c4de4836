"""Decodes kvferry's KV event messages with vLLM's own definitions.

Reads from stdin a JSON list of cases, each the three frames of one
published message (hex) and the batch it must hold, given as data:
block hashes as hex bytes and `int_hashes` saying whether vLLM, for
that data, would publish them as ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
Fails on any difference: each field of the decoded `KVEventBatch`
against the batch vLLM builds from the same data, and the payload's
bytes against vLLM's encoding of that batch. tests/it/store_kv_events.rs
runs it.
"""

import json
import os
import sys

import msgspec
from vllm.distributed import kv_events as ke
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash


def fail(msg):
    print(f"MISMATCH: {msg}", file=sys.stderr)
    sys.exit(1)


def vllm_hash(h):
    return None if h is None else maybe_convert_block_hash(bytes.fromhex(h))


def vllm_event(e):
    kind = e["type"]
    if kind == "BlockStored":
        return ke.BlockStored(
            block_hashes=[vllm_hash(h) for h in e["block_hashes"]],
            parent_block_hash=vllm_hash(e["parent_block_hash"]),
            token_ids=e["token_ids"],
            block_size=e["block_size"],
            lora_id=None,
            medium=e["medium"],
            lora_name=e["lora_name"],
            group_idx=e["group_idx"],
        )
    if kind == "BlockRemoved":
        return ke.BlockRemoved(
            block_hashes=[vllm_hash(h) for h in e["block_hashes"]],
            medium=e["medium"],
            group_idx=e["group_idx"],
        )
    if kind == "AllBlocksCleared":
        return ke.AllBlocksCleared()
    fail(f"unknown event type {kind}")


def compare(where, got, want):
    if type(got) is not type(want):
        fail(f"{where}: {type(got).__name__} != {type(want).__name__}")
    for f in want.__struct_fields__:
        g, w = getattr(got, f), getattr(want, f)
        if type(g) is not type(w) or g != w:
            fail(f"{where}.{f}: {g!r} != {w!r}")


def check(i, case):
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if case["int_hashes"] else "0"
    topic, seq, payload = (bytes.fromhex(f) for f in case["frames"])
    if topic != case["topic"].encode():
        fail(f"case {i}: topic {topic!r}")
    if len(seq) != 8 or int.from_bytes(seq, "big") != case["seq"]:
        fail(f"case {i}: sequence frame {seq.hex()}")
    got = msgspec.msgpack.Decoder(ke.KVEventBatch).decode(payload)
    b = case["batch"]
    want = ke.KVEventBatch(
        ts=b["ts"],
        events=[vllm_event(e) for e in b["events"]],
        data_parallel_rank=b["data_parallel_rank"],
    )
    if len(got.events) != len(want.events):
        fail(f"case {i}: {len(got.events)} events, want {len(want.events)}")
    for j, (g, w) in enumerate(zip(got.events, want.events)):
        compare(f"case {i} event {j}", g, w)
    compare(f"case {i} batch", got, want)
    encoded = msgspec.msgpack.Encoder().encode(want)
    if encoded != payload:
        fail(f"case {i}: payload\n  {payload.hex()}\nvLLM encodes\n  {encoded.hex()}")
    print(f"case {i}: {len(got.events)} events decode and re-encode identically")


def main():
    cases = json.load(sys.stdin)
    if not cases:
        fail("no cases")
    for i, case in enumerate(cases):
        check(i, case)


if __name__ == "__main__":
    main()
