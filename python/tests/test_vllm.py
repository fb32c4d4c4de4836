"""kvferry's vLLM connector driven by vLLM's own code (vLLM 0.32-0.34).

A prefill and a decode engine run in this process, each with vLLM's real
`Scheduler` (CPU device, a tiny local model config, no weights). Every
KV-cache tensor comes from vLLM's allocation code: the engine core's
`get_kv_cache_configs` / `generate_scheduler_kv_cache_config` turn per-layer
KV-cache specs into a `KVCacheConfig`, and the worker's `allocate_kv_cache`
views one buffer per layer in the configured `KVCacheLayout`. Each TP rank's
connector is created by vLLM's `KVConnectorFactory` and driven by the model
runner's own KV-connector wrapper (`vllm.v1.worker.gpu.kv_connector`), the
scheduler output crosses a pickle round trip as with vLLM's multiprocess
executor, and the ranks' outputs are merged by vLLM's `KVOutputAggregator`.
The prefill side's stand-in forward pass writes random bytes into each
computed token's slot through the views vLLM returned; the decode side must
hold exactly those bytes in the request's blocks (every layer, head, token,
K and V) and zeros everywhere else.

Covered: the KV-cache layouts kvferry moves and the ones it refuses, kernel
blocks smaller than the scheduler's blocks, MLA, hybrid (full and
sliding-window groups overlaying one buffer), a merged sliding-window spec
with the hybrid allocator off, heterogeneous TP, metadata pickling, the vLLM
release probe, kvferry as a `MultiConnector` child, and errors confined to
their request (bad `kv_transfer_params`, `n > 1`, failed loads under both
`kv_load_failure_policy` values). Skipped where vLLM is not installed."""

import contextlib
import copy
import dataclasses
import functools
import json
import os
import pickle
import time
import zlib

import pytest
from engines import free_port

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    SlidingWindowSpec,
    group_kernel_blocks,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

import kvferry  # noqa: E402
import kvferry.vllm as kv_vllm  # noqa: E402
import kvferry.vllm._base as kv_base  # noqa: E402
from kvferry.vllm import KvferryConnector, KvferryMetadata  # noqa: E402

try:  # vLLM 0.34: the engine core plans the KV cache in kv_cache_planning.
    from vllm.v1.core.kv_cache_planning import (  # noqa: E402
        get_global_kv_cache_groups,
        get_kv_cache_configs,
    )
except ImportError:  # vLLM 0.32, 0.33
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs  # noqa: E402

    get_global_kv_cache_groups = None

BLOCK = 16
NUM_BLOCKS = 96
MAX_MODEL_LEN = 1024
LAYERS, HEADS, HEAD_SIZE = 2, 4, 16  # the tiny OPT config below
LAYER_NAMES = [f"model.decoder.layers.{i}.self_attn.attn" for i in range(LAYERS)]
#: The sliding window of the hybrid model's sliding-window layer, in tokens.
WINDOW = 32
#: MLA's latent vector per token (kv_lora_rank + rope dims, scaled down).
MLA_HEAD_SIZE = 48
#: The token every "sampled" step produces (not the model's EOS).
TOKEN = 7
#: How long a test steps its engines for one outcome before giving up.
WITHIN_S = 30.0
MODEL = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": HEADS * HEAD_SIZE,
    "num_attention_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "ffn_dim": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "word_embed_proj_dim": HEADS * HEAD_SIZE,
    "torch_dtype": "float16",
    "do_layer_norm_before": True,
    "activation_function": "relu",
    "pad_token_id": 1,
    "bos_token_id": 2,
    "eos_token_id": 2,
}
#: Every node of a test advertises and listens on loopback (the vLLM
#: connector would otherwise advertise the host's outbound address).
LOOPBACK = {"host": "127.0.0.1"}
#: Timeouts that end a load whose prefill side never answers within a test.
QUICK = {"bootstrap_timeout_ms": 1000, "waiting_timeout_ms": 1000, "claim_timeout_ms": 1000}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-opt")
    (d / "config.json").write_text(json.dumps(MODEL))
    return str(d)


@contextlib.contextmanager
def no_kernel_check():
    """vLLM 0.34's CPU platform refuses, while it checks a config, an x86
    host without Triton's CPU backend, which its attention kernels need
    (the plain `vllm` wheel has none). These engines run no kernel: for the
    check, Triton counts as present."""
    import vllm.triton_utils as tu

    had = tu.HAS_TRITON
    tu.HAS_TRITON = True
    try:
        yield
    finally:
        tu.HAS_TRITON = had


def config(
    model_dir,
    kv_role,
    engine_id,
    extra,
    *,
    tp=1,
    layout="LBHNC",
    policy="fail",
    hybrid_allocator=None,
    connector=None,
):
    """A VllmConfig as the engine core holds it once the KV-cache layout
    is resolved. `connector` replaces the kvferry connector entry (a
    `MultiConnector` config)."""
    mc = ModelConfig(
        model=model_dir,
        tokenizer=None,
        skip_tokenizer_init=True,
        dtype="float16",
        seed=42,
        max_model_len=MAX_MODEL_LEN,
    )
    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        # None: vLLM decides (on, unless a connector cannot take it).
        disable_hybrid_kv_cache_manager=None if hybrid_allocator is None else not hybrid_allocator,
    )
    # Requests carry no block hashes here, so no prefix caching.
    cc = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=False)
    kt = KVTransferConfig(
        **(
            connector
            or {
                "kv_connector": "KvferryConnector",
                "kv_connector_module_path": "kvferry.vllm",
                "kv_connector_extra_config": {**LOOPBACK, **extra},
            }
        ),
        kv_role=kv_role,
        engine_id=engine_id,
        kv_load_failure_policy=policy,
    )
    with no_kernel_check():
        vc = VllmConfig(
            scheduler_config=sc,
            model_config=mc,
            cache_config=cc,
            kv_transfer_config=kt,
            device_config=DeviceConfig("cpu"),
            parallel_config=ParallelConfig(tensor_parallel_size=tp),
        )
    # What the engine core's resolve_kv_cache_layout records; a layout set
    # beforehand wins there as it does here.
    vc.cache_config.kv_cache_layout = layout
    vc.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    return vc


def attention_specs(kind, heads=HEADS):
    """Per-layer KV-cache specs as one worker's attention layers report them
    (`get_kv_cache_spec`): `full` attention, `mla`, or `hybrid` (layer 0 full
    attention, layer 1 a sliding window)."""
    common = dict(block_size=BLOCK, dtype=torch.float16)
    if kind == "mla":
        spec = MLAAttentionSpec(num_kv_heads=1, head_size=MLA_HEAD_SIZE, **common)
        return {name: spec for name in LAYER_NAMES}
    full = FullAttentionSpec(num_kv_heads=heads, head_size=HEAD_SIZE, **common)
    if kind == "full":
        return {name: full for name in LAYER_NAMES}
    assert kind == "hybrid"
    window = SlidingWindowSpec(
        num_kv_heads=heads, head_size=HEAD_SIZE, sliding_window=WINDOW, **common
    )
    return {LAYER_NAMES[0]: full, LAYER_NAMES[1]: window}


def kv_cache_configs(vc, worker_specs):
    """The workers' and the scheduler's KVCacheConfig, as vLLM's engine core
    plans them from every worker's specs."""
    memory = [1 << 30] * len(worker_specs)
    if get_global_kv_cache_groups is not None:
        groups = get_global_kv_cache_groups(vc, worker_specs)
        workers = get_kv_cache_configs(vc, worker_specs, memory, groups)
    else:
        workers = get_kv_cache_configs(vc, worker_specs, memory)
    for c in workers:
        assert c.kv_cache_tensors and all(isinstance(t, KVCacheTensor) for t in c.kv_cache_tensors)
        c.kv_cache_layout = vc.cache_config.kv_cache_layout
    scheduler = generate_scheduler_kv_cache_config(workers)
    vc.cache_config.num_gpu_blocks = scheduler.num_blocks
    return workers, scheduler


def rank_config(vc, rank):
    """Rank `rank`'s copy of the config: outside vLLM's worker processes
    the connector reads its TP rank from `kv_connector_extra_config`."""
    c = copy.copy(vc)
    c.kv_transfer_config = copy.deepcopy(vc.kv_transfer_config)
    extra = c.kv_transfer_config.kv_connector_extra_config
    if "connectors" in extra:  # MultiConnector: each child's own config
        for child in extra["connectors"]:
            child.setdefault("kv_connector_extra_config", {})["tp_rank"] = rank
    else:
        extra["tp_rank"] = rank
    return c


def runner_output(req_ids, sampled, kv_output):
    """A ModelRunnerOutput on every tested vLLM (0.34 dropped
    `req_id_to_index`)."""
    fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    kw = dict(req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_output)
    if "req_id_to_index" in fields:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(**kw)


class Rank:
    """One TP worker: its connector (vLLM's factory), its KV cache
    (vLLM's allocator) and the model runner's KV-connector wrapper."""

    def __init__(self, vc, kv_cache_config, kernel_block_sizes):
        self.config = vc
        self.kv_cache_config = kv_cache_config
        layout = KVCacheLayout[vc.cache_config.kv_cache_layout]
        self.caches = allocate_kv_cache(
            kv_cache_config, torch.device("cpu"), layout, kernel_block_sizes
        )
        self.connector = KVConnectorFactory.create_connector(
            vc, KVConnectorRole.WORKER, kv_cache_config
        )
        # The model runner wraps the process's one connector and registers
        # the KV cache with it.
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        try:
            self.runner = ActiveKVConnector(vc, self.caches)
        except BaseException:
            self.connector.shutdown()
            raise
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = None

    def tokens(self, layer):
        """`layer`'s cache as bytes ``[blocks, heads, tokens, K|V bytes]``,
        whatever the layout and kernel block size (a view)."""
        t = group_kernel_blocks(self.caches[layer], self.kv_cache_config.num_blocks)
        if t.dim() == 4:
            t = t.unsqueeze(1)
        # [B, kernel blocks, H, N, C] -> [B, H, kernel blocks, N, C]
        return t.view(torch.uint8).permute(0, 2, 1, 3, 4)

    def page(self, layer, block):
        """Block `block` of `layer` as ``[heads, tokens, bytes]`` (a copy)."""
        t = self.tokens(layer)[block]
        return t.reshape(t.shape[0], -1, t.shape[-1]).clone()


class Engine:
    """One engine: vLLM's scheduler (which creates the scheduler-side
    connector), and per TP rank a worker (`Rank`). `writes`: the forward
    pass writes each computed token's KV (a prefill engine)."""

    def __init__(self, vc, kind="full", kernel_block_sizes=None, writes=False):
        tp = vc.parallel_config.tensor_parallel_size
        specs = attention_specs(kind, HEADS // tp)
        workers, scheduler = kv_cache_configs(vc, [specs] * tp)
        self.config = vc
        self.kind = kind
        self.writes = writes
        self.sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=scheduler,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BLOCK,
            log_stats=True,
        )
        self.ranks = []
        try:
            for r in range(tp):
                self.ranks.append(Rank(rank_config(vc, r), workers[r], kernel_block_sizes))
        except BaseException:
            self.shutdown()
            raise
        self.aggregator = KVOutputAggregator.from_connector(self.ranks[0].connector, tp)
        self.rng = torch.Generator().manual_seed(zlib.crc32(vc.kv_transfer_config.engine_id.encode()))
        #: Finish reason of every request that finished, by request id.
        self.finished = {}
        #: The KV-connector stats vLLM's scheduler reported, per step.
        self.stats = []
        #: Every step's connector metadata, as the workers got it.
        self.metadata = []
        #: Requests any worker reported in `get_transfer_results`:
        #: `finished_recving` and `failed_recving`.
        self.loaded, self.failed_loads = set(), set()

    def shutdown(self):
        for r in self.ranks:
            r.connector.shutdown()
        if self.sched.connector is not None:
            self.sched.connector.shutdown()

    def step(self):
        """One engine step as vLLM's engine core and multiprocess executor
        run it: schedule; each worker gets the scheduler output through
        pickle, runs the connector hooks around its forward pass and
        reports; the reports are aggregated and handed back."""
        out = self.sched.schedule()
        wire = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        outputs = []
        for i, rank in enumerate(self.ranks):
            so = pickle.loads(wire)
            if i == 0:
                self.metadata.append(so.kv_connector_metadata)
            rank.runner.pre_forward(so)
            if self.writes:
                self.forward(rank, so)
            rank.runner.finish_forward()
            kv = rank.runner.post_forward(so.finished_req_ids)
            self.loaded |= kv.finished_recving or set()
            self.failed_loads |= kv.failed_recving or set()
            if i == 0:
                ids = list(so.num_scheduled_tokens)
                sampled = [[TOKEN] if self.prefilled(r) else [] for r in ids]
                outputs.append(runner_output(ids, sampled, kv))
            else:
                outputs.append(ModelRunnerOutput.with_kv_conn_output_only(kv))
        merged = self.aggregator.aggregate(outputs, 0)
        for eco in self.sched.update_from_output(out, merged).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o.finish_reason
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.stats.append(eco.scheduler_stats.kv_connector_stats)
        return out

    def prefilled(self, rid):
        req = self.sched.requests[rid]
        return req.num_computed_tokens >= req.num_tokens

    def forward(self, rank, so):
        """Writes random bytes as the KV of every token this step computes,
        in every layer of every group, through the views vLLM allocated."""
        groups = rank.kv_cache_config.kv_cache_groups
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            end = min(req.num_computed_tokens, req.num_prompt_tokens)
            start = req.num_computed_tokens - n
            block_ids = self.sched.kv_cache_manager.get_blocks(rid).get_block_ids()
            for g, group in enumerate(groups):
                for layer in group.layer_names:
                    t = rank.tokens(layer)
                    heads, kernel, per_kernel, width = t.shape[1:]
                    for tok in range(start, end):
                        b = block_ids[g][tok // BLOCK]
                        assert b != 0, "a computed token in vLLM's null block"
                        k, s = divmod(tok % BLOCK, per_kernel)
                        t[b, :, k, s] = torch.randint(
                            0, 256, (heads, width), generator=self.rng, dtype=torch.uint8
                        )

    def blocks(self, rid, group=0):
        return list(self.sched.kv_cache_manager.get_blocks(rid).get_block_ids()[group])

    def group_layers(self, group):
        return self.ranks[0].kv_cache_config.kv_cache_groups[group].layer_names

    def page(self, layer, block):
        """Block `block` of `layer` across every TP rank: ``[all heads,
        tokens, bytes]``."""
        return torch.cat([r.page(layer, block) for r in self.ranks], dim=0)

    def running(self, rid):
        return any(r.request_id == rid for r in self.sched.running)


def request(rid, prompt_len, params, max_tokens):
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(3, 3 + prompt_len)),
        # Where vLLM's API server puts the router's kv_transfer_params.
        sampling_params=SamplingParams(
            max_tokens=max_tokens, extra_args={"kv_transfer_params": params}
        ),
        pooling_params=None,
        block_hasher=None,
    )


def run_until(engines, done, what, within_s=WITHIN_S):
    """Steps the engines, as their busy loops do, until `done()`; `what`
    (text, or a function giving it) says what did not happen."""
    deadline = time.monotonic() + within_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"within {within_s} s: {what() if callable(what) else what}")
        for e in engines:
            e.step()


def decode_params(transfer_id, bootstrap, engine_id="p"):
    """What a MooncakeConnector deployment's router sends the decode half."""
    return {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap,
    }


class PD:
    """A prefill and a decode engine, both shut down at the end."""

    def __init__(self, model_dir, *, kind="full", p_tp=1, d_tp=1, layout="LBHNC",
                 kernel_block_sizes=None, p_extra=None, d_extra=None, policy="fail",
                 hybrid_allocator=None, p_connector=None, d_connector=None):
        self.bootstrap = f"127.0.0.1:{free_port()}"
        common = dict(layout=layout, hybrid_allocator=hybrid_allocator)
        self.p = Engine(
            config(model_dir, "kv_producer", "p", {"bootstrap": self.bootstrap, **(p_extra or {})},
                   tp=p_tp,
                   connector=p_connector and p_connector(self.bootstrap), **common),
            kind,
            kernel_block_sizes,
            writes=True,
        )
        try:
            self.d = Engine(
                config(model_dir, "kv_consumer", "d", dict(d_extra or {}), tp=d_tp, policy=policy,
                       connector=d_connector, **common),
                kind,
                kernel_block_sizes,
            )
        except BaseException:
            self.p.shutdown()
            raise

    def close(self):
        self.p.shutdown()
        self.d.shutdown()

    def prefill(self, rid, prompt_len, transfer_id):
        """Runs a prefill request (`do_remote_decode`) until vLLM holds its
        blocks for the send; returns its blocks per group."""
        params = {"do_remote_decode": True, "transfer_id": transfer_id}
        self.p.sched.add_request(request(rid, prompt_len, params, 1))
        run_until([self.p], lambda: rid in self.p.finished, f"prefill {rid} finishes")
        groups = len(self.p.sched.kv_cache_config.kv_cache_groups)
        return [self.p.blocks(rid, g) for g in range(groups)]


@pytest.fixture
def pd(model_dir):
    made = []

    def make(**kw):
        e = PD(model_dir, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def assert_moved(p, d, pairs, layers):
    """Every byte of every `(prefill block, decode block)` pair, in every
    layer of `layers`, landed; each page had KV to move."""
    for layer in layers:
        for pb, db in pairs:
            sent, got = p.page(layer, pb), d.page(layer, db)
            assert sent.any(), (layer, pb, "the prefill forward pass wrote nothing here")
            assert torch.equal(sent, got), (layer, pb, db)


def assert_rest_zero(d, rid):
    """No byte outside the blocks of `rid` was written on the decode side."""
    groups = len(d.sched.kv_cache_config.kv_cache_groups)
    used = {b for g in range(groups) for b in d.blocks(rid, g) if b}
    for layer in LAYER_NAMES:
        for rank in d.ranks:
            t = rank.tokens(layer)
            idle = [b for b in range(t.shape[0]) if b not in used]
            assert not t[idle].any(), (layer, "bytes outside the request's blocks")


def transfer(pd_, prompt, *, rid="1"):
    """Prefills `prompt` tokens, loads them into the decode engine, and
    returns (prefill blocks per group, decode blocks per group)."""
    tid = f"xfer-{rid}"
    p_blocks = pd_.prefill(f"p-{rid}", prompt, tid)
    d = pd_.d
    d.sched.add_request(request(f"d-{rid}", prompt, decode_params(tid, pd_.bootstrap), 1000))
    d.step()
    assert d.sched.requests[f"d-{rid}"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    groups = len(d.sched.kv_cache_config.kv_cache_groups)
    d_blocks = [d.blocks(f"d-{rid}", g) for g in range(groups)]
    run_until(
        [pd_.p, d],
        lambda: d.running(f"d-{rid}") and f"p-{rid}" not in pd_.p.sched.requests,
        "the decode request runs and prefill frees its blocks",
    )
    return p_blocks, d_blocks


# -- layouts --------------------------------------------------------------


def assert_prompt_moved(e, prompt):
    """Moves a `prompt`-token request through `e` (one KV-cache group):
    every block holding the prompt landed, and nothing else was written."""
    (p_full,), (d_full,) = transfer(e, prompt)
    n = -(-prompt // BLOCK)
    assert_moved(e.p, e.d, list(zip(p_full[:n], d_full[:n])), LAYER_NAMES)
    assert_rest_zero(e.d, "d-1")


def memfd_backed(addr):
    """Whether `addr` lies in a shared mapping of a memfd here."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms, *rest = line.split()
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return perms[3] == "s" and len(rest) >= 4 and rest[3].startswith("/memfd:")
    return False


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_a_request_moves_in_every_dense_layout(pd, layout):
    e = pd(layout=layout)
    prompt = 40  # 3 blocks, the last one partial
    before = kvferry._native._shm_copied_bytes()
    assert_prompt_moved(e, prompt)
    # The engines' own KV buffers, allocated by vLLM, now live on shared
    # files at the same addresses (the forward pass wrote through vLLM's
    # views), and prefill copied straight into decode's.
    t = e.d.ranks[0].tokens(LAYER_NAMES[0])
    assert memfd_backed(t.data_ptr() + t.untyped_storage().nbytes() // 2)
    assert kvferry._native._shm_copied_bytes() > before, "the bytes went through shared memory"


def test_with_shared_memory_off_the_kv_stays_private_and_moves_over_tcp(pd):
    off = {"shared_memory": "false"}
    e = pd(p_extra=off, d_extra=off)
    before = kvferry._native._shm_copied_bytes()
    assert_prompt_moved(e, 40)
    t = e.d.ranks[0].tokens(LAYER_NAMES[0])
    assert not memfd_backed(t.data_ptr() + t.untyped_storage().nbytes() // 2)
    assert kvferry._native._shm_copied_bytes() == before


@pytest.mark.parametrize("layout", ["LHBNC", "BHLNC"])
def test_a_layout_without_dense_pages_is_refused_by_name(model_dir, layout):
    # Heads outside blocks: a block of a layer is no run of bytes.
    vc = config(model_dir, "kv_consumer", "d", {}, layout=layout)
    with pytest.raises(kvferry.MisuseError, match=layout):
        Engine(vc)


def test_the_node_takes_the_engines_device_and_a_missing_driver_fails_it_clearly(model_dir):
    # vLLM's CPU worker: the node runs on the host.
    vc = config(model_dir, "kv_consumer", "d", {})
    assert kvferry.vllm._base._engine_device(vc) == "cpu"
    # Device memory asked for where there is no CUDA driver: the engine's
    # connector fails at start, naming the device, and nothing is registered.
    vc = config(model_dir, "kv_consumer", "d", {"device": "cuda:0"})
    with pytest.raises(kvferry.MisuseError, match="cuda:0"):
        Engine(vc)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_kernel_blocks_half_the_block_size_move(pd, layout):
    # The attention backend splits each 16-token block into two kernel
    # blocks of 8 (vLLM's kernel_block_sizes): the views have twice the
    # blocks, and scheduler block b is kernel blocks 2b and 2b + 1.
    e = pd(layout=layout, kernel_block_sizes=[BLOCK // 2])
    assert e.d.ranks[0].caches[LAYER_NAMES[0]].shape[:3] == (2 * NUM_BLOCKS, HEADS, BLOCK // 2)
    prompt = 40
    assert_prompt_moved(e, prompt)


def test_mla_moves_its_latent_cache(pd):
    e = pd(kind="mla")
    spec = e.d.ranks[0].kv_cache_config.kv_cache_groups[0].kv_cache_spec
    assert isinstance(spec, MLAAttentionSpec)
    assert e.d.ranks[0].caches[LAYER_NAMES[0]].shape[1:] == (1, BLOCK, MLA_HEAD_SIZE)
    prompt = 40
    assert_prompt_moved(e, prompt)


def window_positions(prompt):
    """The block positions holding a prompt's last WINDOW tokens."""
    return range((prompt - WINDOW) // BLOCK, -(-prompt // BLOCK))


def test_hybrid_groups_move_every_full_block_and_the_windows_blocks(pd):
    # vLLM's hybrid allocator: a full-attention group and a sliding-window
    # group, whose KVCacheTensors overlay one buffer (a block belongs to
    # one group at a time).
    e = pd(kind="hybrid")
    cfg = e.d.ranks[0].kv_cache_config
    assert [type(g.kv_cache_spec) for g in cfg.kv_cache_groups] == [FullAttentionSpec, SlidingWindowSpec]
    assert {t.offset for t in cfg.kv_cache_tensors} == {0}
    c0, c1 = (e.d.ranks[0].caches[n] for n in LAYER_NAMES)
    assert c0.data_ptr() == c1.data_ptr()
    prompt = 100  # 7 blocks; the window's 32 tokens are in the last 3
    (p_full, p_win), (d_full, d_win) = transfer(e, prompt)
    n = -(-prompt // BLOCK)
    assert_moved(e.p, e.d, list(zip(p_full[:n], d_full[:n])), e.d.group_layers(0))
    window = [(p_win[i], d_win[i]) for i in window_positions(prompt)]
    assert_moved(e.p, e.d, window, e.d.group_layers(1))
    assert_rest_zero(e.d, "d-1")


def test_a_merged_sliding_window_spec_moves_every_block(pd):
    # With the hybrid allocator off vLLM gives every layer full-attention
    # blocks, the sliding-window layer's spec a FullAttentionSpec that
    # records its window: its early blocks are still read by the
    # full-attention layer, so none may be dropped.
    e = pd(kind="hybrid", hybrid_allocator=False)
    for cfg in (e.d.sched.kv_cache_config, e.d.ranks[0].kv_cache_config):
        (group,) = cfg.kv_cache_groups
        assert type(group.kv_cache_spec) is FullAttentionSpec
        assert group.kv_cache_spec.sliding_window == WINDOW
    prompt = 100
    assert_prompt_moved(e, prompt)


@pytest.mark.parametrize("layout", ["LBHNC", "BLNHC"])
@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
def test_heterogeneous_tp_moves_each_heads_bytes(pd, p_tp, d_tp, layout):
    # [B, H, N, K|V]: a rank holds HEADS / tp heads, K and V of a head side
    # by side per token (BLNHC: tokens outside heads, layers inside
    # blocks). Decode's heads, concatenated over its ranks, must equal
    # prefill's concatenated over its ranks.
    e = pd(p_tp=p_tp, d_tp=d_tp, layout=layout)
    assert e.p.ranks[0].caches[LAYER_NAMES[0]].shape[1] == HEADS // p_tp
    assert e.d.ranks[0].caches[LAYER_NAMES[0]].shape[1] == HEADS // d_tp
    prompt = 40
    assert_prompt_moved(e, prompt)
    # The prefill workers' counters as vLLM's scheduler stats carry them,
    # summed over the TP workers by vLLM's aggregator.
    rebuilt = [KvferryConnector.build_kv_connector_stats(s).reduce() for s in e.p.stats]
    assert sum(r.get("ok", 0) for r in rebuilt) == p_tp
    assert sum(r.get("bytes", 0) for r in rebuilt) > 0
    # Each decode worker timed its load.
    loads = [KvferryConnector.build_kv_connector_stats(s).reduce().get("loads", 0) for s in e.d.stats]
    assert sum(loads) == d_tp


def test_base_ports_offset_by_rank_let_every_tp_rank_bind_and_move(pd):
    # One side-channel and one data-plane port for the engine, as an
    # operator opening a firewall sets them: each rank listens at the base
    # plus its index, and the request moves through both.
    side, data = free_port(), free_port()
    e = pd(p_tp=2, p_extra={"side_channel_port": side, "data_plane_port": data, "shared_memory": "false"})
    nodes = [r.connector._worker.node for r in e.p.ranks]
    assert [n.settings["side_channel_port"] for n in nodes] == [side, side + 1]
    assert [n.settings["data_plane_port"] for n in nodes] == [data, data + 1]
    assert_prompt_moved(e, 40)


def test_mooncakes_abort_timeout_sets_how_long_a_prefill_holds_unasked_kv(pd, monkeypatch):
    monkeypatch.setenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "7")
    e = pd()
    assert e.p.ranks[0].connector._worker.node.settings["bootstrap_timeout_ms"] == 7000
    monkeypatch.setenv("KVFERRY_BOOTSTRAP_TIMEOUT_MS", "9000")
    e = pd()
    assert e.p.ranks[0].connector._worker.node.settings["bootstrap_timeout_ms"] == 9000, "kvferry's name wins"


def test_the_dp_rank_is_vllms_dp_index_not_its_reset_rank():
    # vLLM resets `data_parallel_rank` to 0 in every engine of a dense
    # model; `data_parallel_index` keeps the engine's place. With hybrid or
    # external load balancing each node numbers its own engines.
    pc = ParallelConfig(data_parallel_size=2)
    pc.data_parallel_index = 1
    pc.reconfigure_for_independent_dp_rank()  # what a dense model's engine gets
    assert (pc.data_parallel_rank, pc.data_parallel_size) == (0, 1)
    assert kv_base._dp_layout(pc) == (1, 2)
    moe = ParallelConfig(data_parallel_size=2)
    moe.data_parallel_index = moe.data_parallel_rank = 1  # what a MoE model's engine gets
    assert kv_base._dp_layout(moe) == (1, 2)
    pc.data_parallel_external_lb = True
    pc.data_parallel_rank_local, pc.data_parallel_size_local = 0, 1
    assert kv_base._dp_layout(pc) == (0, 1)
    pc.data_parallel_rank_local, pc.tensor_parallel_size = 1, 2
    assert kv_base._rank_index(pc, tp_rank=1, pp_rank=0) == 3


@pytest.mark.parametrize("field, flag", [
    ("decode_context_parallel_size", "--decode-context-parallel-size"),
    ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
])
def test_context_parallelism_is_refused_at_start_by_name(model_dir, field, flag):
    vc = config(model_dir, "kv_producer", "p", {})
    setattr(vc.parallel_config, field, 2)
    with pytest.raises(kvferry.MisuseError, match=flag):
        KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, None)


# -- metadata ---------------------------------------------------------------


def test_every_steps_metadata_crosses_pickle(pd):
    # Engine.step pickles each scheduler output before a worker sees it,
    # as vLLM's multiprocess executor does: the transfer moving at all
    # shows the round trip keeps the loads and sends.
    e = pd()
    prompt = 40
    (p_full,), (d_full,) = transfer(e, prompt)
    assert_moved(e.p, e.d, list(zip(p_full[:3], d_full[:3])), LAYER_NAMES)
    metas = e.p.metadata + e.d.metadata
    assert all(isinstance(m, KvferryMetadata) for m in metas)
    sends = [m for m in e.p.metadata if m.meta.transfer_ids()[1]]
    loads = [m for m in e.d.metadata if m.meta.transfer_ids()[0]]
    assert sends and loads
    for m in sends + loads:
        wire = pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL)
        # Compact: one request's block ids and names, no Python objects.
        assert len(wire) < 512, len(wire)
        back = pickle.loads(wire)
        assert back.meta.to_bytes() == m.meta.to_bytes()
        assert (back.names, back.aborts, back.failed) == (m.names, m.aborts, m.failed)
    assert set(loads[0].names.values()) == {"d-1"}
    assert set(sends[0].names.values()) == {"p-1"}


transfer_ids = st.one_of(
    st.integers(min_value=0, max_value=2**64 - 1),
    st.text(min_size=1, max_size=64),  # at most 256 bytes of UTF-8
)


@st.composite
def scheduled_steps(draw):
    """A kvferry scheduler (both roles) after a step's loads and sends were
    recorded: decode requests with their destination blocks, prefill
    requests that finished and send their blocks."""
    sched = kvferry.Scheduler("kv_both", "e", "127.0.0.1:9", BLOCK)
    tids = draw(st.lists(transfer_ids, max_size=6, unique_by=lambda t: str(t)))
    for i, tid in enumerate(tids):
        prompt = draw(st.integers(min_value=1, max_value=200))
        blocks = draw(
            st.lists(st.integers(0, 2**31 - 1), min_size=-(-prompt // BLOCK),
                     max_size=-(-prompt // BLOCK), unique=True)
        )
        rid = f"r{i}"
        if draw(st.booleans()):
            params = decode_params(tid, "127.0.0.1:9", engine_id=draw(st.text(min_size=1, max_size=8)))
            found, _ = sched.get_num_new_matched_tokens(rid, prompt, 0, params)
            sched.update_state_after_alloc(rid, prompt, 0, [blocks], params, found)
        else:
            params = {"do_remote_decode": True, "transfer_id": tid}
            sched.get_num_new_matched_tokens(rid, prompt, 0, params)
            sched.update_state_after_alloc(rid, prompt, 0, [blocks], params, 0)
            sched.request_finished(rid, prompt, 0, [blocks], params, "length_capped")
    return sched.build_connector_meta()


@settings(max_examples=60, deadline=None)
@given(meta=scheduled_steps(), cut=st.integers(min_value=1), extra=st.binary(min_size=1, max_size=8))
def test_load_meta_round_trips_through_bytes_and_pickle(meta, cut, extra):
    data = meta.to_bytes()
    back = kvferry.LoadMeta.from_bytes(data)
    assert back.to_bytes() == data
    assert back.transfer_ids() == meta.transfer_ids() and len(back) == len(meta)
    assert pickle.loads(pickle.dumps(meta)).to_bytes() == data
    # Bytes that are not one LoadMeta are refused, never misread.
    with pytest.raises(kvferry.MisuseError):
        kvferry.LoadMeta.from_bytes(data + extra)
    if len(meta):
        with pytest.raises(kvferry.MisuseError):
            kvferry.LoadMeta.from_bytes(data[: cut % len(data)])


@settings(max_examples=200, deadline=None)
@given(garbage=st.binary(max_size=64))
def test_load_meta_from_arbitrary_bytes_decodes_or_raises_misuse(garbage):
    try:
        meta = kvferry.LoadMeta.from_bytes(garbage)
    except kvferry.MisuseError:
        return
    # What decodes is a LoadMeta that encodes again.
    assert kvferry.LoadMeta.from_bytes(meta.to_bytes()).to_bytes() == meta.to_bytes()


# -- vLLM releases ----------------------------------------------------------


def test_an_untested_vllm_release_is_refused_unless_allowed(pd, model_dir, monkeypatch):
    monkeypatch.delenv(kv_vllm.ANY_VERSION_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with pytest.raises(RuntimeError) as refused:
        Engine(config(model_dir, "kv_consumer", "d", {}))
    text = str(refused.value)
    assert "0.31.0" in text and "0.32, 0.33, 0.34" in text and kv_vllm.ANY_VERSION_ENV in text
    monkeypatch.setenv(kv_vllm.ANY_VERSION_ENV, "1")
    e = pd()
    (p_full,), (d_full,) = transfer(e, 40)
    assert_moved(e.p, e.d, list(zip(p_full[:3], d_full[:3])), LAYER_NAMES)


def multi_connector(kv_role, kvferry_extra, storage):
    """A MultiConnector config: kvferry first, vLLM's ExampleConnector
    (a disk store) second."""
    return {
        "kv_connector": "MultiConnector",
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "KvferryConnector",
                    "kv_connector_module_path": "kvferry.vllm",
                    "kv_role": kv_role,
                    "kv_connector_extra_config": {**LOOPBACK, **kvferry_extra},
                },
                {
                    "kv_connector": "ExampleConnector",
                    "kv_role": kv_role,
                    "kv_connector_extra_config": {"shared_storage_path": str(storage)},
                },
            ]
        },
    }


def test_kvferry_moves_a_request_as_a_multiconnector_child(pd, tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    e = pd(
        p_connector=lambda bootstrap: multi_connector(
            "kv_producer", {"bootstrap": bootstrap}, tmp_path
        ),
        d_connector=multi_connector("kv_consumer", {}, tmp_path),
    )
    for engine in (e.p, e.d):
        assert isinstance(engine.sched.connector, MultiConnector)
        assert isinstance(engine.sched.connector.sub_connectors[0], KvferryConnector)
        assert isinstance(engine.ranks[0].connector.sub_connectors[0], KvferryConnector)
    (p_full,), (d_full,) = transfer(e, 40)
    assert_moved(e.p, e.d, list(zip(p_full[:3], d_full[:3])), LAYER_NAMES)
    assert_rest_zero(e.d, "d-1")
    # The stats vLLM's scheduler reported, as its stat loggers take them:
    # MultiConnector's per-child dicts, rebuilt and exported to Prometheus.
    assert e.p.stats, "the prefill workers reported no kvferry counters"
    sample, logged = exported(e.p, "0")
    assert sample("vllm:kvferry_ok_total") == 1
    assert logged["ok"] == 1
    # The decode worker timed its one load: a histogram sample in
    # Prometheus, a count and percentiles in vLLM's log line.
    sample, logged = exported(e.d, "1")
    assert sample("vllm:kvferry_load_seconds_count") == 1
    assert 0 < sample("vllm:kvferry_load_seconds_sum") < 30
    assert logged["loads"] == 1


def exported(engine, engine_idx):
    """`engine`'s reported stats through MultiConnector's Prometheus
    metrics and vLLM's stats logging: a reader of one sample by name (the
    engine's labels), and what the log line shows of kvferry."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    registry = CollectorRegistry()
    types = {
        cls: functools.partial(cls, registry=registry) for cls in (Gauge, Counter, Histogram)
    }
    labels = {"model_name": "tiny", "engine": engine_idx}
    prom = MultiConnector.build_prom_metrics(
        engine.config, types, list(labels), {int(engine_idx): list(labels.values())}
    )
    logging_ = KVConnectorLogging(engine.config.kv_transfer_config)
    for stats in engine.stats:
        assert set(stats) == {"KvferryConnector"}
        prom.observe(stats, int(engine_idx))
        logging_.observe(stats)
    logged = logging_.transfer_stats_accumulator.reduce()["KvferryConnector"]
    return (lambda name: registry.get_sample_value(name, labels)), logged


# -- a request fails, never the engine -------------------------------------


BAD_DECODE_PARAMS = {
    "no address, engine or transfer id": {"do_remote_prefill": True},
    "no bootstrap address": {
        "do_remote_prefill": True,
        "transfer_id": "t-1",
        "remote_engine_id": "p",
    },
    "garbage types": {
        "do_remote_prefill": "yes",
        "transfer_id": [1, 2],
        "remote_engine_id": 5,
        "remote_bootstrap_addr": {"host": 1},
    },
    "a transfer id over 256 bytes": decode_params("x" * 300, "127.0.0.1:9"),
    "a negative transfer id": decode_params(-1, "127.0.0.1:9"),
}


@pytest.mark.parametrize("params", BAD_DECODE_PARAMS.values(), ids=BAD_DECODE_PARAMS.keys())
def test_bad_kv_transfer_params_are_computed_locally(model_dir, params):
    d = Engine(config(model_dir, "kv_consumer", "d", {}))
    try:
        prompt = 40
        d.sched.add_request(request("d-bad", prompt, params, 2))
        d.sched.add_request(request("d-plain", prompt, None, 2))
        d.step()  # vLLM treats an exception here as fatal to the engine
        req = d.sched.requests["d-bad"]
        assert req.status == RequestStatus.RUNNING
        assert req.num_computed_tokens == prompt  # its whole prompt, locally
        run_until(
            [d],
            lambda: {"d-bad", "d-plain"} <= d.finished.keys()
            and not {"d-bad", "d-plain"} & d.sched.requests.keys(),
            "both finish and free their blocks",
        )
        assert d.finished["d-bad"] == FinishReason.LENGTH
        assert sum(s.get("local_fallbacks", 0) for s in d.stats) == 1
    finally:
        d.shutdown()


def test_vllm_ascends_proxy_params_are_computed_locally_and_said_once(model_dir, caplog):
    ascend = {"do_remote_prefill": True, "transfer_id": "t-a", "remote_engine_id": "p",
              "remote_host": "10.0.0.1", "remote_port": 30000, "remote_block_ids": [0, 1]}
    d = Engine(config(model_dir, "kv_consumer", "d", {}))
    try:
        for rid in ("a-1", "a-2"):
            d.sched.add_request(request(rid, 40, {**ascend, "transfer_id": rid}, 2))
        with caplog.at_level("WARNING", logger="kvferry.vllm"):
            run_until([d], lambda: {"a-1", "a-2"} <= d.finished.keys(), "both finish")
        assert d.finished["a-1"] == d.finished["a-2"] == FinishReason.LENGTH
        assert sum(s.get("local_fallbacks", 0) for s in d.stats) == 2
        said = [r for r in caplog.records if "remote_bootstrap_addr" in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
    finally:
        d.shutdown()


def test_a_prefill_request_without_transfer_id_is_computed_and_not_sent(model_dir):
    p = Engine(
        config(model_dir, "kv_producer", "p", {"bootstrap": f"127.0.0.1:{free_port()}"}),
        writes=True,
    )
    try:
        p.sched.add_request(request("p-bad", 40, {"do_remote_decode": True}, 1))
        run_until([p], lambda: "p-bad" in p.finished, "the request finishes")
        run_until([p], lambda: "p-bad" not in p.sched.requests, "its blocks are freed")
        assert not any(m.meta.transfer_ids()[1] for m in p.metadata)
    finally:
        p.shutdown()


def test_n_children_sharing_a_transfer_id_one_loads_the_others_compute(pd):
    # vLLM's n > 1 gives every child request the parent's
    # kv_transfer_params, hence one transfer id.
    e = pd()
    prompt = 40
    p_blocks = e.prefill("p-1", prompt, "xfer-n")
    params = decode_params("xfer-n", e.bootstrap)
    for i in range(3):
        e.d.sched.add_request(request(f"d-{i}", prompt, params, 2))
    e.d.step()
    waiting = [
        r for r in ("d-0", "d-1", "d-2")
        if e.d.sched.requests[r].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    ]
    assert waiting == ["d-0"]
    for r in ("d-1", "d-2"):
        assert e.d.sched.requests[r].num_computed_tokens == prompt
    d_blocks = e.d.blocks("d-0")
    run_until(
        [e.p, e.d],
        lambda: {"d-0", "d-1", "d-2"} <= e.d.finished.keys(),
        "every child finishes",
    )
    assert all(e.d.finished[r] == FinishReason.LENGTH for r in ("d-0", "d-1", "d-2"))
    assert "d-0" in e.d.loaded and not e.d.failed_loads
    assert_moved(e.p, e.d, list(zip(p_blocks[0][:3], d_blocks[:3])), LAYER_NAMES)


def test_a_decode_request_allocated_without_external_tokens_is_not_reported_loaded(pd):
    # vLLM allocates a decode request with no external tokens when the
    # connector offers none: kvferry only releases the prefill side's
    # blocks, and vLLM must not hear of that release as the request's load
    # (its scheduler asserts a request reported loaded waited for a load).
    e = pd()
    prompt = 40
    e.prefill("p-1", prompt, "xfer-none")
    sched = e.d.sched.connector._sched._sched
    offer = sched.get_num_new_matched_tokens
    sched.get_num_new_matched_tokens = lambda *a: (0, False)
    try:
        e.d.sched.add_request(request("d-1", prompt, decode_params("xfer-none", e.bootstrap), 4))
        e.d.step()
    finally:
        sched.get_num_new_matched_tokens = offer
    run_until(
        [e.p, e.d],
        lambda: "d-1" in e.d.finished and "p-1" not in e.p.sched.requests,
        "the decode request finishes and the prefill side frees its blocks",
    )
    assert e.d.finished["d-1"] == FinishReason.LENGTH
    assert "d-1" not in e.d.loaded and not e.d.failed_loads


class AbortLog:
    """Stands in front of a worker's node and records the transfers the
    worker aborts."""

    def __init__(self, node):
        self.node = node
        self.aborted = []

    @classmethod
    def install(cls, rank):
        worker = rank.connector._worker
        worker.node = log = cls(worker.node)
        return log

    def abort(self, transfer_id):
        self.aborted.append(transfer_id)
        return self.node.abort(transfer_id)

    def __getattr__(self, name):
        return getattr(self.node, name)


def lose_a_load(e, prompt, how):
    """Adds decode request `d-lost`, whose load fails: `times-out` (no
    prefill engine runs at its bootstrap address), or `refused-at-start`
    (a client aborted `d-aborted` before it was scheduled and the router
    retried it under the same transfer id: the release-only load the abort
    queued holds that id on the worker, so the retry's load, in the same
    step, is refused when it starts)."""
    if how == "times-out":
        dead = f"127.0.0.1:{free_port()}"  # nothing listens there
        params = decode_params("xfer-lost", dead, "nobody")
    else:
        e.prefill("p-lost", prompt, "xfer-lost")
        params = decode_params("xfer-lost", e.bootstrap)
        e.d.sched.add_request(request("d-aborted", prompt, params, 2))
        e.d.sched.finish_requests(["d-aborted"], RequestStatus.FINISHED_ABORTED)
    e.d.sched.add_request(request("d-lost", prompt, params, 2))


@pytest.mark.parametrize("how", ["times-out", "refused-at-start"])
@pytest.mark.parametrize("kind", ["full", "hybrid"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_load_ends_its_request_per_policy_and_spares_the_others(pd, how, kind, policy):
    # One step holds two loads, the failing one first. Only it fails; the
    # worker reports it per request (failed_recving, which vLLM requires
    # with several KV-cache groups) and vLLM's kv_load_failure_policy
    # decides its fate; the other request loads and finishes.
    # Short decode timeouts only where a load is to time out: elsewhere a
    # busy machine could let the release of `p-lost` expire on decode
    # before it reaches prefill, which then holds its blocks for its whole
    # claim timeout (30 s, this test's bound).
    e = pd(kind=kind, policy=policy, d_extra=QUICK if how == "times-out" else None)
    aborts = [AbortLog.install(r) for r in e.d.ranks]
    prompt = 40
    p_blocks = e.prefill("p-ok", prompt, "xfer-ok")
    lose_a_load(e, prompt, how)
    e.d.sched.add_request(request("d-ok", prompt, decode_params("xfer-ok", e.bootstrap), 2))
    e.d.step()
    assert e.d.sched.requests["d-ok"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (step,) = e.d.metadata
    loads, _ = step.meta.transfer_ids()
    assert [step.names.get(t) for t in loads][-2:] == ["d-lost", "d-ok"]
    if how == "refused-at-start":  # reported in the step it failed to start
        assert e.d.failed_loads == {"d-lost"}
    d_blocks = e.d.blocks("d-ok")
    run_until(
        [e.p, e.d],
        lambda: {"d-ok", "d-lost"} <= e.d.finished.keys()
        and not {"p-ok", "p-lost"} & e.p.sched.requests.keys(),
        lambda: "both requests finish and prefill frees every block (decode finished "
        f"{sorted(e.d.finished)}, prefill holds {sorted(e.p.sched.requests)})",
    )
    assert e.d.failed_loads == {"d-lost"}
    # `d-lost`'s load had ended (or never started) when vLLM finished the
    # request: the abort that finish queues must not reach the node, where
    # under `refused-at-start` it would end the aborted request's release.
    assert all(loads[-2] not in log.aborted for log in aborts)
    assert {"d-ok", "d-lost"} <= e.d.loaded
    assert e.d.finished["d-ok"] == FinishReason.LENGTH
    assert e.d.finished["d-lost"] == (
        FinishReason.ERROR if policy == "fail" else FinishReason.LENGTH
    )
    assert_moved(e.p, e.d, list(zip(p_blocks[0][:3], d_blocks[:3])), e.d.group_layers(0))
