"""kvferry's vLLM store connector driven by vLLM's own code (vLLM 0.32-0.34).

Two engines in this process, each with vLLM's real `Scheduler`, KV caches
from vLLM's allocator and the model runner's KV-connector wrapper (the
harness of `test_vllm.py`), share one kvferry store. Engine A's stand-in
forward pass writes random bytes into every computed token's slot and
saves its prompt prefix; engine B, given the same prompt, must find it,
load it and hold exactly A's bytes in its blocks, while the block it
computes itself stays its own. Keys are kvferry's chain over the token
ids, so B never needs A's vLLM block hashes.

Covered: a prefix saved by one engine and loaded byte-exact by another
(whole blocks, the last token computed), a chunked prefill saving each
block once, keys that follow the tokens and the model and nothing else, a
store that is down (the request computes), and the connector's refusals
(no store, a bad URL). With P/D in the same connector (`KvferryConnector`
with `store`): a decode engine takes the stored blocks from the store and
the rest from the prefill engine, and hears of the request once, when both
parts ended, a failed part failing it."""

import array
import os
import signal
import time
import types
import uuid
import zlib

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from engines import StoreServer, free_port  # noqa: E402
from test_vllm import (  # noqa: E402,F401  (model_dir is a fixture)
    BLOCK,
    LAYER_NAMES,
    PD,
    TOKEN,
    WITHIN_S,
    Engine,
    config,
    decode_params,
    model_dir,
    request,
    run_until,
)

import kvferry  # noqa: E402
from kvferry.vllm._store import chain_hashes, chain_root  # noqa: E402

#: 6 whole blocks and 4 tokens: the store can hold 6 blocks (B computes
#: at least the last token itself).
PROMPT = 6 * BLOCK + 4


def store_connector(store, **extra):
    return {
        "kv_connector": "KvferryStoreConnector",
        "kv_connector_module_path": "kvferry.vllm",
        "kv_connector_extra_config": {"store": store, **extra},
    }


def engine(model_dir, engine_id, store, *, writes=False, **extra):
    vc = config(model_dir, "kv_both", engine_id, {}, policy="recompute",
                connector=store_connector(store, **extra))
    return Engine(vc, writes=writes)


def stats(e, key):
    """A counter summed over every stats report of the engine's scheduler."""
    return sum(s.get(key, 0) for s in e.stats)


def pages(e, rid, blocks):
    return {(layer, i): e.page(layer, b) for layer in LAYER_NAMES
            for i, b in enumerate(e.blocks(rid)[:blocks])}


@pytest.fixture
def store():
    """A fresh in-process store, shared by the engines of a test."""
    return f"inproc://{uuid.uuid4().hex}"


def prompt_computed(e, rid):
    """The request's prompt is computed (or loaded) and it still runs."""
    req = e.sched.requests[rid]
    return req.num_computed_tokens >= req.num_prompt_tokens


def save_on(a, rid, prompt_len, max_tokens=3):
    """Runs `rid` on `a` to its end, its blocks released once its saves are
    done; returns its prompt's pages as A computed them."""
    a.sched.add_request(request(rid, prompt_len, None, max_tokens))
    run_until([a], lambda: prompt_computed(a, rid), f"{rid} prefilled")
    before = pages(a, rid, prompt_len // BLOCK)
    run_until([a], lambda: rid not in a.sched.requests, f"{rid} finished and released")
    return before


def test_a_prefix_one_engine_saved_another_loads_byte_exact(model_dir, store):
    a = engine(model_dir, "a", store, writes=True)
    b = engine(model_dir, "b", store)
    try:
        saved = save_on(a, "r1", PROMPT)
        # One key per block (a value holds the block of every layer).
        assert stats(a, "store_saved_keys") == 6
        b.sched.add_request(request("r2", PROMPT, None, 3))
        run_until([b], lambda: prompt_computed(b, "r2"), "r2 prefilled on B")
        assert "r2" in b.loaded and "r2" not in b.failed_loads
        got = pages(b, "r2", 6)
        for key, page in saved.items():
            assert torch.equal(got[key], page), f"layer {key[0]} block {key[1]} differs from A's"
        # The 7th block B computed itself (its forward writes nothing).
        last = b.blocks("r2")[6]
        assert all(not b.page(layer, last).any() for layer in LAYER_NAMES)
        run_until([b], lambda: "r2" in b.finished, "r2 finished on B")
        assert stats(b, "store_promised_tokens") == 6 * BLOCK
    finally:
        a.shutdown()
        b.shutdown()


def test_a_chunked_prefill_saves_each_block_once(model_dir, store):
    """256 tokens per step: a 600-token prompt prefills in three chunks,
    each saving the blocks it completed; none is put twice."""
    a = engine(model_dir, "a", store, writes=True)
    try:
        prompt = 600
        save_on(a, "long", prompt)
        blocks = prompt // BLOCK
        assert stats(a, "store_saved_keys") == blocks
        assert stats(a, "store_saves_planned") == 3
    finally:
        a.shutdown()


class TokenEngine(Engine):
    """An engine whose forward pass writes, for each token, bytes that
    follow from the tokens up to it and the layer (as a model's KV does):
    what a block holds can be checked without the engine that made it."""

    def forward(self, rank, so):
        groups = rank.kv_cache_config.kv_cache_groups
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            end = req.num_computed_tokens
            start = end - n
            tokens = list(req.all_token_ids)
            block_ids = self.sched.kv_cache_manager.get_blocks(rid).get_block_ids()
            for g, group in enumerate(groups):
                for layer in group.layer_names:
                    t = rank.tokens(layer)
                    for tok in range(start, end):
                        b = block_ids[g][tok // BLOCK]
                        k, s = divmod(tok % BLOCK, t.shape[3])
                        t[b, :, k, s] = token_kv(layer, tokens[: tok + 1], t.shape[1], t.shape[4])


def token_kv(layer, prefix, heads, width):
    seed = zlib.crc32(layer.encode() + bytes(array.array("I", prefix)))
    return torch.randint(0, 256, (heads, width), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)


def expected_page(e, layer, prompt, block):
    heads, width = e.ranks[0].tokens(layer).shape[1], e.ranks[0].tokens(layer).shape[4]
    toks = range(block * BLOCK, (block + 1) * BLOCK)
    return torch.stack([token_kv(layer, prompt[: t + 1], heads, width) for t in toks], dim=1)


def token_request(rid, tokens, max_tokens):
    return Request(request_id=rid, prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(max_tokens=max_tokens), pooling_params=None,
                   block_hasher=None)


def test_preempted_requests_never_store_another_requests_bytes(model_dir, store):
    """A's KV cache holds 65 blocks (one longest request and the null block): three 300-token
    requests decoding 250 tokens each do not fit, and vLLM preempts, handing
    a preempted request's blocks to another while its save may still read
    them (the store connector waits for such saves in `handle_preemptions`).
    Every block B then loads holds exactly what its tokens make."""
    vc = config(model_dir, "kv_both", "a", {}, policy="recompute", connector=store_connector(store))
    vc.cache_config.num_gpu_blocks_override = 65
    a = TokenEngine(vc, writes=True)
    b = engine(model_dir, "b", store)
    prompts = {f"p{i}": [11 + i + 7 * j % 900 for j in range(300)] for i in range(3)}
    try:
        for rid, p in prompts.items():
            a.sched.add_request(token_request(rid, p, 250))
        preempted = set()
        deadline = time.monotonic() + WITHIN_S
        while any(r in a.sched.requests for r in prompts):
            assert time.monotonic() < deadline, "A's requests did not finish"
            preempted |= set(a.step().preempted_req_ids or ())
        assert preempted, "nothing was preempted: the test proves nothing"
        for rid, p in prompts.items():
            b.sched.add_request(token_request("b-" + rid, p, 2))
            run_until([b], lambda: prompt_computed(b, "b-" + rid), f"{rid} on B")
            assert "b-" + rid in b.loaded
            for i, blk in enumerate(b.blocks("b-" + rid)[: (len(p) - 1) // BLOCK]):
                for layer in LAYER_NAMES:
                    assert torch.equal(b.page(layer, blk), expected_page(b, layer, p, i)), \
                        f"{rid}: block {i} of {layer} holds bytes its tokens do not make"
    finally:
        a.shutdown()
        b.shutdown()


def test_decode_saves_let_the_next_turn_load_the_answer_too(model_dir, store):
    """With `save_decode_cache`, A saves the blocks its decode filled; B,
    given the next turn (A's prompt, A's answer, a new question), loads
    them as well, each holding what its tokens make."""
    vc = config(model_dir, "kv_both", "a", {}, policy="recompute",
                connector=store_connector(store, save_decode_cache=True))
    a = TokenEngine(vc, writes=True)
    b = engine(model_dir, "b", store)
    prompt = [20 + 3 * j % 700 for j in range(100)]
    try:
        a.sched.add_request(token_request("turn1", prompt, 40))
        run_until([a], lambda: "turn1" not in a.sched.requests, "turn 1 finished and released")
        # The stand-in model answers TOKEN at every step; A computed all
        # but its last token: 139 tokens, 8 whole blocks.
        turn2 = prompt + [TOKEN] * 40 + [5] * 10
        b.sched.add_request(token_request("turn2", turn2, 2))
        run_until([b], lambda: prompt_computed(b, "turn2"), "turn 2 prefilled on B")
        assert "turn2" in b.loaded
        assert stats(b, "store_promised_tokens") == 8 * BLOCK
        for i, blk in enumerate(b.blocks("turn2")[:8]):
            for layer in LAYER_NAMES:
                assert torch.equal(b.page(layer, blk), expected_page(b, layer, turn2, i)), \
                    f"block {i} of {layer} holds bytes its tokens do not make"
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("tp", [1, 2])
def test_kv_events_name_each_stored_block_once_every_shard_stored_it(model_dir, store, tp):
    """vLLM's scheduler publishes the store tier's events: one
    `BlockStored` per saved block, after every TP shard stored its part,
    chained by kvferry's hashes; a save the store already held publishes
    nothing."""
    vc = config(model_dir, "kv_both", "a", {}, tp=tp, policy="recompute",
                connector=store_connector(store))
    a = Engine(vc, writes=True)
    published = []
    a.sched.kv_event_publisher = types.SimpleNamespace(
        publish=lambda batch: published.extend(batch.events), shutdown=lambda: None)
    try:
        save_on(a, "r1", PROMPT)
        model = os.path.basename(vc.model_config.model.rstrip("/"))
        chain = chain_hashes(chain_root(model, BLOCK), list(range(3, 3 + PROMPT)), BLOCK)
        # As vLLM publishes hashes (bytes, or ints with its default
        # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
        want = [maybe_convert_block_hash(h) for h in chain]
        stored = [e for e in published if isinstance(e, BlockStored)]
        assert [e.block_hashes for e in stored] == [[h] for h in want]
        assert [e.parent_block_hash for e in stored] == [None, *want[:-1]]
        assert {(e.block_size, e.medium, e.group_idx) for e in stored} == {(BLOCK, "CPU", 0)}
        published.clear()
        save_on(a, "r2", PROMPT)
        assert not [e for e in published if isinstance(e, BlockStored)]
    finally:
        a.shutdown()


def refuse_blocks(side):
    """Makes a store connector's scheduler side refuse every request's
    blocks (a full table) until the returned function is called."""
    real = side._native

    class Refusing:
        def __getattr__(self, name):
            return getattr(real, name)

        def update_state_after_alloc(self, *args):
            raise kvferry.BusyError("full")

    side._native = Refusing()
    return lambda: setattr(side, "_native", real)


def test_a_load_the_scheduler_cannot_plan_fails_its_request_not_the_engine(model_dir, store):
    """B is promised A's prefix, then its scheduler side refuses the
    request's blocks (a full table): the request's wait for its load
    ends as a failed load, vLLM recomputes it (`recompute`), and the engine
    steps on."""
    a = engine(model_dir, "a", store, writes=True)
    b = engine(model_dir, "b", store)
    try:
        save_on(a, "r1", PROMPT)
        restore = refuse_blocks(b.sched.connector._sched)
        b.sched.add_request(request("r2", PROMPT, None, 3))
        run_until([b], lambda: "r2" in b.failed_loads, "r2 reported as a failed load")
        restore()
        run_until([b], lambda: "r2" in b.finished, "r2 recomputed and finished")
        assert stats(b, "store_fallbacks") == 1
    finally:
        a.shutdown()
        b.shutdown()


def test_reset_prefix_cache_forgets_this_models_keys_and_no_others(model_dir, store):
    """vLLM's `reset_prefix_cache(reset_connector=True)` on A empties the
    store of A's model: B (A's model) then misses, D (another model name
    over the same store) still hits what C of its model saved."""
    a = engine(model_dir, "a", store, writes=True)
    c = engine(model_dir, "c", store, writes=True, model_name="other")
    b = engine(model_dir, "b", store)
    d = engine(model_dir, "d", store, model_name="other")
    published = []
    a.sched.kv_event_publisher = types.SimpleNamespace(
        publish=lambda batch: published.extend(batch.events), shutdown=lambda: None)
    try:
        save_on(a, "r1", PROMPT)
        save_on(c, "r1", PROMPT)
        assert a.sched.reset_prefix_cache(reset_connector=True)
        a.step()
        assert any(isinstance(e, AllBlocksCleared) for e in published)
        for e, want in ((b, 0), (d, 6 * BLOCK)):
            e.sched.add_request(request("r2", PROMPT, None, 2))
            run_until([e], lambda: "r2" in e.finished, "r2 finished")
            assert stats(e, "store_promised_tokens") == want
    finally:
        for e in (a, b, c, d):
            e.shutdown()


def test_reset_of_an_unshared_store_says_it_did_not(model_dir):
    a = engine(model_dir, "a", "inproc")
    try:
        assert not a.sched.connector.reset_cache()
    finally:
        a.shutdown()


def test_a_store_that_is_down_is_a_miss_and_the_request_computes(model_dir):
    """Nothing listens where the store should be: lookups and saves fail,
    the request computes locally and finishes, the engine steps on."""
    b = engine(model_dir, "b", f"kvferry://127.0.0.1:{free_port()}", op_bound_ms=500)
    try:
        b.sched.add_request(request("r", PROMPT, None, 3))
        run_until([b], lambda: "r" in b.finished, "r finished", within_s=10)
        assert "r" not in b.loaded and "r" not in b.failed_loads
        assert stats(b, "store_lookup_failures") == 1
        assert stats(b, "store_promised_tokens") == 0
        run_until([b], lambda: "r" not in b.sched.requests, "r released", within_s=10)
    finally:
        b.shutdown()


def test_keys_follow_the_tokens_and_the_model_only():
    root = chain_root("m", BLOCK)
    tokens = list(range(3, 3 + 3 * BLOCK))
    h = chain_hashes(root, tokens, BLOCK)
    assert len(h) == 3 and len(set(h)) == 3 and all(len(x) == 32 for x in h)
    # A prefix's hashes are a prefix of the hashes.
    assert chain_hashes(root, tokens[: 2 * BLOCK + 5], BLOCK) == h[:2]
    # One token changed changes its block's hash and every later one.
    t2 = list(tokens)
    t2[BLOCK + 1] += 1
    h2 = chain_hashes(root, t2, BLOCK)
    assert h2[0] == h[0] and h2[1] != h[1] and h2[2] != h[2]
    # Another model or block size: other keys.
    assert chain_hashes(chain_root("m2", BLOCK), tokens, BLOCK)[0] != h[0]
    # Extra keys (a salt on block 0) change the chain from that block on.
    h3 = chain_hashes(root, tokens, BLOCK, [b"salt", None, None])
    assert h3[0] != h[0] and h3[2] != h[2]
    # Frozen: the keys are an interface between engines and releases.
    assert h[0].hex()[:16] == GOLDEN_FIRST


#: chain_hashes(chain_root("m", 16), [3, 4, ..., 50], 16)[0], first 8 bytes
#: (SHA-256 as hashlib computes it).
GOLDEN_FIRST = "bfdd62dec4a7cb00"


def test_a_store_connector_without_a_store_is_refused_by_name(model_dir):
    with pytest.raises(kvferry.MisuseError, match="needs kv_connector_extra_config.store"):
        vc = config(model_dir, "kv_both", "x", {}, connector={
            "kv_connector": "KvferryStoreConnector",
            "kv_connector_module_path": "kvferry.vllm",
            "kv_connector_extra_config": {},
        })
        Engine(vc)


def test_a_bad_store_url_is_refused_by_name(model_dir):
    with pytest.raises(kvferry.MisuseError, match="the stores are"):
        engine(model_dir, "x", "memcached://nowhere")


# -- P/D and the store in one connector ------------------------------------

#: A P/D prompt: 8 whole blocks and 4 tokens; the prefill engine first
#: stores the first 6 blocks alone (a request without kv_transfer_params).
PD_PROMPT = 8 * BLOCK + 4


def pd_with_store(model_dir, store, **kw):
    # The decode engine waits for every store answer (the default gives up
    # after 20 ms and takes the whole prompt from the prefill engine).
    d_extra = {"store": store, "pd_lookup_wait_ms": 10000}
    return PD(model_dir, p_extra={"store": store}, d_extra=d_extra, **kw)


def prefill_and_store(e, rid, prompt_len, tid):
    """Prefills `rid` for P/D and waits until the prefill engine stored its
    whole blocks (its send waits for the decode engine); its pages."""
    saved = stats(e.p, "store_saved_keys")
    blocks = e.prefill(rid, prompt_len, tid)[0]
    run_until([e.p], lambda: stats(e.p, "store_saved_keys") - saved == 2, f"{rid}'s new blocks saved")
    return pages(e.p, rid, len(blocks))


def test_pd_takes_stored_blocks_from_the_store_and_the_rest_from_the_prefill_engine(model_dir, store):
    e = pd_with_store(model_dir, store)
    try:
        # The prefill engine's forward pass writes random bytes, so the
        # blocks it stored alone differ from the same blocks of the P/D
        # prompt, which it computes again: each decode block shows its source.
        warm = save_on(e.p, "warm", 6 * BLOCK + 4)
        sent = prefill_and_store(e, "p-1", PD_PROMPT, "xfer-1")
        e.d.sched.add_request(request("d-1", PD_PROMPT, decode_params("xfer-1", e.bootstrap), 3))
        run_until([e.p, e.d], lambda: "d-1" in e.d.loaded, "d-1 loaded")
        # Blocks 0-5 the store's, as the prefill engine stored them alone;
        # 6 and 7 stored with p-1, 8 sent by the prefill engine.
        got = pages(e.d, "d-1", 9)
        assert got.keys() == sent.keys()
        for (layer, i), page in got.items():
            want = warm[(layer, i)] if i < 6 else sent[(layer, i)]
            assert torch.equal(page, want), (layer, i)
        assert "d-1" not in e.d.failed_loads
        run_until([e.p, e.d], lambda: "p-1" not in e.p.sched.requests, "the prefill engine frees p-1")
        assert stats(e.d, "store_loaded_keys") == 8
        assert stats(e.d, "ok") == 1
    finally:
        e.close()


def test_a_prefill_engine_loads_a_stored_prefix_and_sends_the_whole_prompt(model_dir, store):
    """The prefill engine loads (`load`) the prefix it stored apart instead
    of computing it, computes the rest, and sends the whole prompt: the
    decode engine's first six blocks hold the stored bytes, the others the
    bytes the prefill engine computed."""
    e = PD(model_dir, p_extra={"store": store, "load": True}, d_extra={"store": store})
    try:
        warm = save_on(e.p, "warm", 6 * BLOCK + 4)
        computed = stats(e.p, "store_loaded_keys")
        e.prefill("p-1", PD_PROMPT, "xfer-1")
        assert stats(e.p, "store_loaded_keys") - computed == 6
        sent = pages(e.p, "p-1", 9)
        e.d.sched.add_request(request("d-1", PD_PROMPT, decode_params("xfer-1", e.bootstrap), 3))
        run_until([e.p, e.d], lambda: "d-1" in e.d.loaded, "d-1 loaded")
        assert "d-1" not in e.d.failed_loads
        got = pages(e.d, "d-1", 9)
        assert got.keys() == sent.keys()
        for (layer, i), page in got.items():
            want = warm[(layer, i)] if i < 6 else sent[(layer, i)]
            assert torch.equal(page, want), (layer, i)
        run_until([e.p, e.d], lambda: "p-1" not in e.p.sched.requests, "the prefill engine frees p-1")
    finally:
        e.close()


def test_a_failed_store_part_fails_the_request_once_the_prefill_part_ended(model_dir, store):
    """The decode engine's store half refuses to plan its part (a full
    table) after the request was promised both: the request is reported
    failed once, after the prefill engine's part ended, vLLM ends it
    (`kv_load_failure_policy: fail`), and both engines free its blocks."""
    e = pd_with_store(model_dir, store)
    try:
        save_on(e.p, "warm", 6 * BLOCK + 4)
        prefill_and_store(e, "p-1", PD_PROMPT, "xfer-1")
        restore = refuse_blocks(e.d.sched.connector._sched.store)
        # Each half's reports and the joined ones, in order.
        log = []
        worker = e.d.ranks[0].connector._worker

        def spy(name, results):
            def call():
                out = results()
                log.append((name, out))
                return out
            return call

        worker.node.transfer_results = spy("node", worker.node.transfer_results)
        worker.store.transfer_results = spy("store", worker.store.transfer_results)
        worker.transfer_results = spy("joined", worker.transfer_results)
        e.d.sched.add_request(request("d-1", PD_PROMPT, decode_params("xfer-1", e.bootstrap), 3))
        run_until([e.p, e.d], lambda: "d-1" in e.d.finished and "p-1" not in e.p.sched.requests,
                  "d-1 ends and the prefill engine frees p-1")
        restore()

        def when(name, part):
            return [i for i, (n, out) in enumerate(log) if n == name and "d-1" in out[part]]

        (store_failed,), (node_loaded,) = when("store", 2), when("node", 1)
        assert when("joined", 1) == [], "reported loaded"
        both = max(store_failed, node_loaded)
        first_after = next(i for i, (n, _) in enumerate(log) if n == "joined" and i > both)
        assert when("joined", 2) == [first_after], \
            "not reported failed once, in the call that saw both parts end"
        assert e.d.failed_loads == {"d-1"}
        assert stats(e.d, "ok") == 1, "the prefill engine's part ran to its end"
        run_until([e.d], lambda: "d-1" not in e.d.sched.requests, "the decode engine frees d-1")
    finally:
        e.close()


def test_a_pd_request_does_not_wait_for_a_store_that_does_not_answer(model_dir, tmp_path):
    """The store server is stopped (SIGSTOP) and lookups would wait a
    minute for it: the decode engine's P/D request gives its lookup up
    after `pd_lookup_wait_ms` (20 ms), and its whole prompt comes from the
    prefill engine."""
    server = StoreServer(free_port(), tmp_path / "store.log").start()
    e = PD(model_dir, d_extra={"store": server.url, "lookup_timeout_ms": 60000})
    try:
        e.prefill("p-1", PD_PROMPT, "xfer-1")
        sent = pages(e.p, "p-1", 9)
        os.kill(server.proc.pid, signal.SIGSTOP)
        e.d.sched.add_request(request("d-1", PD_PROMPT, decode_params("xfer-1", e.bootstrap), 3))
        run_until([e.p, e.d], lambda: "d-1" in e.d.loaded, "d-1 loaded")
        assert "d-1" not in e.d.failed_loads
        got = pages(e.d, "d-1", 9)
        assert got.keys() == sent.keys()
        for key, page in got.items():
            assert torch.equal(page, sent[key]), key
        assert stats(e.d, "store_lookups_given_up") == 1
        assert stats(e.d, "ok") == 1
    finally:
        server.kill()
        e.close()
