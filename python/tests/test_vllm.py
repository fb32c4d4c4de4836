"""vLLM's own scheduler drives KvferryConnector: a prefill and a decode
engine in this process, each with vLLM's real `Scheduler` (CPU device, a
tiny local model config, no weights) and its worker-side connectors
called in the order of vLLM's `kv_connector_model_runner_mixin.py`, KV
tensors in FlashAttention's shape and HND stride order, every
transferred block compared. Runs where vLLM 0.33 is installed
(`scripts/test-vllm.sh`); skipped elsewhere."""

import json
import os
import socket
import time

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
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
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvferry.vllm import KvferryConnector  # noqa: E402

BLOCK = 16
NUM_BLOCKS = 64
LAYERS, HEADS, HEAD_SIZE = 2, 4, 16  # the tiny OPT config below
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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-opt")
    (d / "config.json").write_text(json.dumps(MODEL))
    return str(d)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(model_dir, kv_role, engine_id, extra, tp=1, load_failure="fail"):
    mc = ModelConfig(
        model=model_dir,
        tokenizer=None,
        skip_tokenizer_init=True,
        dtype="float16",
        seed=42,
        max_model_len=2048,
    )
    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=2048,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cc = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto")
    kt = KVTransferConfig(
        kv_connector="KvferryConnector",
        kv_connector_module_path="kvferry.vllm",
        kv_role=kv_role,
        engine_id=engine_id,
        kv_connector_extra_config=extra,
        kv_load_failure_policy=load_failure,
    )
    vc = VllmConfig(
        scheduler_config=sc,
        model_config=mc,
        cache_config=cc,
        kv_transfer_config=kt,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    return vc


#: The sliding window of the hybrid model's second group, in tokens.
WINDOW = 32


def kv_cache_config(hybrid=False):
    """One full-attention group of every layer; or (`hybrid`) layer 0 full
    attention and layer 1 a sliding window, two groups as vLLM's hybrid
    allocator makes them."""
    args = dict(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float16)
    if not hybrid:
        groups = [KVCacheGroupSpec([f"layers.{i}" for i in range(LAYERS)], FullAttentionSpec(**args))]
    else:
        groups = [
            KVCacheGroupSpec(["layers.0"], FullAttentionSpec(**args)),
            KVCacheGroupSpec(["layers.1"], SlidingWindowSpec(**args, sliding_window=WINDOW)),
        ]
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)


class Engine:
    """One engine: vLLM's scheduler, and per TP rank a worker connector
    with its KV tensors (FlashAttention's logical shape, HND in memory)."""

    def __init__(self, vc, tp=1, hybrid=False):
        self.hybrid = hybrid
        self.sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kv_cache_config(hybrid),
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BLOCK,
        )
        self.workers, self.kv = [], []
        #: (sending, receiving): per request, the workers that reported it.
        self.reported = ({}, {})
        heads = HEADS // tp
        for rank in range(tp):
            wc = config_for_rank(vc, rank)
            w = KvferryConnector(wc, KVConnectorRole.WORKER, kv_cache_config(hybrid))
            caches = {}
            for layer in range(LAYERS):
                hnd = torch.zeros(2, NUM_BLOCKS, heads, BLOCK, HEAD_SIZE, dtype=torch.float16)
                caches[f"layers.{layer}"] = hnd.permute(0, 1, 3, 2, 4)
            if hybrid:
                # The groups' layers share one tensor: a block belongs to
                # one group at a time (vLLM's KVCacheTensor aliasing).
                caches["layers.1"] = caches["layers.0"]
            w.register_kv_caches(caches)
            self.workers.append(w)
            self.kv.append(caches)

    def step(self):
        """One engine step: schedule, the workers' connector calls in
        vLLM's order, a sampled token for every scheduled request, and the
        finished transfers every worker reported (vLLM's aggregator waits
        for all of them)."""
        out = self.sched.schedule()
        invalid = set()
        for w in self.workers:
            w.bind_connector_metadata(out.kv_connector_metadata)
            w.start_load_kv(None)
            w.wait_for_save()
            # What vLLM's model runner calls (the base class wraps
            # get_finished).
            done = w.get_transfer_results(out.finished_req_ids)
            for seen, ids in zip(self.reported, (done.finished_sending, done.finished_recving)):
                for rid in ids or ():
                    seen[rid] = seen.get(rid, 0) + 1
            invalid |= w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
        # As vLLM's KVOutputAggregator: finished once every worker said so.
        sent, recvd = (
            {r for r, n in seen.items() if n == len(self.workers)} for seen in self.reported
        )
        for seen, done in zip(self.reported, (sent, recvd)):
            for r in done:
                del seen[r]
        ids = list(out.num_scheduled_tokens)
        for rid in ids:
            self.on_forward(rid, out)
        mro = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sent or None,
                finished_recving=recvd or None,
                invalid_block_ids=invalid,
            ),
        )
        self.sched.update_from_output(out, mro)
        return out

    def on_forward(self, rid, out):
        """The forward pass of a prefill writes the request's KV."""

    def blocks(self, rid, group=0):
        return self.sched.kv_cache_manager.get_blocks(rid).get_block_ids()[group]


class Prefill(Engine):
    def on_forward(self, rid, out):
        groups = 2 if self.hybrid else 1
        for rank, caches in enumerate(self.kv):
            for name, t in caches.items():
                for g in range(groups):
                    for b in self.blocks(rid, g):
                        if b:  # 0: vLLM's null block (outside a window)
                            t[:, b] = float((b * 7 + rank + 13 * g + len(name)) % 61)


def config_for_rank(vc, rank):
    import copy

    c = copy.deepcopy(vc)
    c.kv_transfer_config.kv_connector_extra_config["tp_rank"] = rank
    return c


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


def running(e, rid):
    return any(r.request_id == rid for r in e.sched.running)


def run_until(engines, done, within_s=30.0):
    """Steps the engines, as their busy loops do, until `done()`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for e in engines:
            e.step()
        if done():
            return
    raise AssertionError("did not finish")


@pytest.mark.parametrize("p_tp, d_tp", [(1, 1), (2, 1), (1, 2)])
def test_vllm_schedulers_move_a_request_prefill_to_decode(model_dir, p_tp, d_tp):
    bootstrap = f"127.0.0.1:{free_port()}"
    p = Prefill(config(model_dir, "kv_producer", "p", {"bootstrap": bootstrap}, p_tp), p_tp)
    d = Engine(config(model_dir, "kv_consumer", "d", {}, d_tp), d_tp)
    prompt = 40  # 3 blocks, the last one partial
    # What a MooncakeConnector deployment's router sends each half.
    p.sched.add_request(
        request("p-1", prompt, {"do_remote_decode": True, "transfer_id": "xfer-1"}, 1)
    )
    run_until([p], lambda: not running(p, "p-1"))
    p_blocks = p.blocks("p-1")
    assert len(p_blocks) == 3
    d_params = {
        "do_remote_prefill": True,
        "transfer_id": "xfer-1",
        "remote_engine_id": "p",
        "remote_bootstrap_addr": bootstrap,
    }
    d.sched.add_request(request("d-1", prompt, d_params, 1000))
    d.step()
    assert d.sched.requests["d-1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d_blocks = d.blocks("d-1")
    run_until([p, d], lambda: running(d, "d-1") and "p-1" not in p.sched.requests)
    # Every head of every block, as prefill's ranks hold them, landed in
    # decode's blocks of the request.
    for name in p.kv[0]:
        for pb, db in zip(p_blocks[:3], d_blocks[:3]):
            sent = torch.cat([caches[name][:, pb] for caches in p.kv], dim=2)
            got = torch.cat([caches[name][:, db] for caches in d.kv], dim=2)
            assert torch.equal(sent, got), (name, pb, db)
            assert sent.abs().sum() > 0
    # The workers' counters, as vLLM's stats loggers get them, summed over
    # prefill's TP workers.
    stats = [w.get_kv_connector_stats() for w in p.workers]
    total = stats[0]
    for other in stats[1:]:
        total = total.aggregate(other)
    rebuilt = KvferryConnector.build_kv_connector_stats(total.to_dict())
    assert rebuilt.reduce()["ok"] == p_tp and rebuilt.reduce()["bytes"] > 0
    assert all(w.get_kv_connector_stats() is None for w in p.workers)  # nothing new
    for w in p.workers + d.workers:
        w.shutdown()


def test_an_aborted_decode_request_frees_both_sides(model_dir):
    bootstrap = f"127.0.0.1:{free_port()}"
    p = Prefill(config(model_dir, "kv_producer", "p", {"bootstrap": bootstrap}))
    d = Engine(config(model_dir, "kv_consumer", "d", {}))
    p.sched.add_request(request("p-2", 20, {"do_remote_decode": True, "transfer_id": 77}, 1))
    run_until([p], lambda: not running(p, "p-2"))
    d_params = {
        "do_remote_prefill": True,
        "transfer_id": 77,
        "remote_engine_id": "p",
        "remote_bootstrap_addr": bootstrap,
    }
    # Aborted before it was ever scheduled: the prefill side is told and
    # frees its blocks (a release-only load).
    d.sched.add_request(request("d-2", 20, d_params, 4))
    d.sched.finish_requests(["d-2"], RequestStatus.FINISHED_ABORTED)
    run_until([p, d], lambda: "p-2" not in p.sched.requests and "d-2" not in d.sched.requests)
    for w in p.workers + d.workers:
        w.shutdown()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_load_follows_the_load_failure_policy(model_dir, policy):
    # A prefill engine that never ran the request: decode's load fails when
    # its waiting timeout passes, and vLLM applies kv_load_failure_policy to
    # the blocks the connector reports.
    bootstrap = f"127.0.0.1:{free_port()}"
    p = Prefill(config(model_dir, "kv_producer", "p", {"bootstrap": bootstrap}))
    quick = {"waiting_timeout_ms": 500, "bootstrap_timeout_ms": 1000, "claim_timeout_ms": 500}
    d = Engine(config(model_dir, "kv_consumer", "d", quick, load_failure=policy))
    d_params = {
        "do_remote_prefill": True,
        "transfer_id": "never-prefilled",
        "remote_engine_id": "p",
        "remote_bootstrap_addr": bootstrap,
    }
    d.sched.add_request(request("d-3", 40, d_params, 1000))
    d.step()
    assert d.sched.requests["d-3"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    if policy == "fail":
        run_until([p, d], lambda: "d-3" not in d.sched.requests)
    else:
        # Recomputed locally: scheduled for its whole prompt.
        run_until([p, d], lambda: running(d, "d-3"))
        assert d.sched.requests["d-3"].num_computed_tokens >= 40
    for w in p.workers + d.workers:
        w.shutdown()


def test_hybrid_groups_move_every_full_block_and_the_windows_blocks(model_dir):
    # Two KV-cache groups (full attention, and a 32-token sliding window):
    # vLLM's hybrid allocator hands the connector a block list per group.
    bootstrap = f"127.0.0.1:{free_port()}"
    p = Prefill(config(model_dir, "kv_producer", "p", {"bootstrap": bootstrap}), hybrid=True)
    d = Engine(config(model_dir, "kv_consumer", "d", {}), hybrid=True)
    prompt = 100  # 7 blocks; the window needs the last ceil(32/16) + 1 = 3
    p.sched.add_request(request("p-h", prompt, {"do_remote_decode": True, "transfer_id": "h-1"}, 1))
    run_until([p], lambda: not running(p, "p-h"))
    p_full, p_window = p.blocks("p-h", 0), p.blocks("p-h", 1)
    d_params = {
        "do_remote_prefill": True,
        "transfer_id": "h-1",
        "remote_engine_id": "p",
        "remote_bootstrap_addr": bootstrap,
    }
    d.sched.add_request(request("d-h", prompt, d_params, 1000))
    d.step()
    d_full, d_window = d.blocks("d-h", 0), d.blocks("d-h", 1)
    run_until([p, d], lambda: running(d, "d-h") and "p-h" not in p.sched.requests)
    t_p, t_d = p.kv[0]["layers.0"], d.kv[0]["layers.0"]
    for pb, db in zip(p_full[:7], d_full[:7]):
        assert torch.equal(t_p[:, pb], t_d[:, db]), ("full", pb, db)
    for pb, db in list(zip(p_window[:7], d_window[:7]))[-3:]:
        assert pb and db and torch.equal(t_p[:, pb], t_d[:, db]), ("window", pb, db)
        assert t_p[:, pb].abs().sum() > 0
    for w in p.workers + d.workers:
        w.shutdown()
