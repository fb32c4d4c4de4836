"""A prefill and a decode scheduler of SGLang in one process, on the CPU,
driven step by step through SGLang's own disaggregation code.

Real SGLang: `ServerArgs` and one runtime context per role
(`runtime_context.use_context`); torch.distributed on gloo with SGLang's
group coordinators; `MHATokenToKVPool`, `ReqToTokenPool`,
`DecodeReqToTokenPool`, `PagedTokenToKVPoolAllocator` and the tree cache of
`kv_cache_builder.build_kv_cache` in host memory; `MetadataBuffers`;
`PrefillBootstrapQueue`, `DecodePreallocQueue`, `DecodeTransferQueue`;
`Req`, `ScheduleBatch.init_new` / `prepare_for_extend`; the scheduler mixin
methods `process_batch_result_disagg_prefill` (which sends the KV),
`process_disagg_prefill_inflight_queue` and `process_decode_queue`; the
transfer backend chosen by SGLang's `get_kv_class` after SGLang's own
`load_plugins()`, and the bootstrap service started by SGLang's
`start_disagg_service()`.

Stood in: the `Scheduler` object itself (only the attributes the queues and
mixins read), the model forward (KV bytes written where SGLang allocated
the batch's tokens; next token 1000 + i), the batch admission of
`PrefillAdder` for whole prompts, record-only output streaming and
metrics, and `Scheduler.abort_request`'s disaggregation branches
(`abort_prefill`, `abort_decode`: the same calls on the same queues).

The one CUDA-only call substituted: `cudaHostRegister` of the decode
retraction backup's host pool (`CUDA_SUBSTITUTIONS`).
"""

from __future__ import annotations

import os
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

from engines import free_port, make_model

# One host unless told otherwise; an empty value (the multi-host tests)
# lets SGLang find the host's address itself.
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
os.environ["KVFERRY_SGLANG"] = "1"
os.environ["SGLANG_PLUGINS"] = "kvferry"

import torch  # noqa: E402
from sglang.srt import runtime_context as rc  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.disaggregation.decode import (  # noqa: E402
    DecodePreallocQueue,
    DecodeReqToTokenPool,
    DecodeTransferQueue,
    SchedulerDisaggregationDecodeMixin,
)
from sglang.srt.disaggregation.prefill import (  # noqa: E402
    PrefillBootstrapQueue,
    SchedulerDisaggregationPrefillMixin,
)
from sglang.srt.disaggregation.utils import (  # noqa: E402
    DisaggregationMode,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    TransferBackend,
)
from sglang.srt.distributed import parallel_state  # noqa: E402
from sglang.srt.distributed.utils import get_pp_indices  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.scheduler_pp_mixin import SchedulerPPMixin  # noqa: E402
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.mem_cache import kv_cache_builder  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.pool_host import common as pool_host_common  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

# SGLang's plugin loading, after the modules that bind `get_kv_class` by
# name are imported, so its hook reaches them.
from sglang.srt.plugins import load_plugins  # noqa: E402

load_plugins()


def _no_cuda_host_register(buffer, registration_granularity_bytes=None):
    """Stands in for cudaHostRegister (no CUDA driver here)."""


pool_host_common._cuda_host_register = _no_cuda_host_register
CUDA_SUBSTITUTIONS = [
    "sglang.srt.mem_cache.pool_host.common._cuda_host_register: cudaHostRegister of the "
    "decode retraction backup's host pool (mem_cache/pool_host/common.py)"
]

#: The test model (a tiny random-weight Llama, made once), or the model
#: `KVFERRY_SGLANG_MODEL` names.
MODEL = os.environ.get("KVFERRY_SGLANG_MODEL") or make_model(
    Path(__file__).resolve().parents[2] / "target" / "bench-model"
)
PAGE = 4
POOL_TOKENS = 256
DTYPE = torch.float16
GROUPS = [
    "world_group", "tp_group", "pp_group", "attn_tp_group", "attn_cp_group",
    "moe_ep_group", "moe_dp_group", "moe_tp_group",
]
_world: dict = {}


def process_groups(context, world=(1, 0, None), host="127.0.0.1") -> dict:
    """SGLang's process groups on gloo, made once per process (SGLang keeps
    them in module globals; `world` is (size, rank, rendezvous port), the
    rendezvous on `host`) and stamped into every further context as
    `initialize_model_parallel` stamps them."""
    size, rank, port = world
    with rc.use_context(context):
        if not _world:
            parallel_state.init_distributed_environment(
                world_size=size, rank=rank, local_rank=rank, backend="gloo",
                distributed_init_method=f"tcp://{host}:{port or free_port()}",
            )
            parallel_state.initialize_model_parallel()
            _world.update({n: getattr(rc.get_parallel(), n) for n in GROUPS})
        else:
            rc.get_parallel().override_permanently(**_world)
    return _world


class Recorder:
    """Output streaming and metrics: records what SGLang streams."""

    def __init__(self):
        self.streamed = []
        self.enable_metrics = False
        self.kv_transfer_latency_ms = None
        self.kv_transfer_speed_gb_s = None

    def stream_output(self, reqs, return_logprob=False, *a, **k):
        self.streamed.extend(reqs)

    def report_prefill_stats(self, **k):
        pass


class BatchResultsStandIn:
    """The batch-result hooks the disaggregation paths call; with logprobs
    off none of them touches KV."""

    def snapshot_auxiliary_output_starts(self, batch, result):
        return None

    def move_logprobs_to_cpu(self, batch, logits_output):
        pass

    def consume_auxiliary_output(self, *a, **k):
        pass

    def _maybe_update_reasoning_tokens(self, req, token):
        pass


def build_pools(mode: str, model_config: ModelConfig):
    """SGLang's own host-memory pools and tree cache for one role."""
    hf = model_config.hf_config
    parallel = rc.get_parallel()
    # A pipeline stage holds its own layers, as SGLang's model runner splits them.
    start, end = get_pp_indices(hf.num_hidden_layers, parallel.pp_rank, parallel.pp_size)
    pool = MHATokenToKVPool(
        size=POOL_TOKENS, page_size=PAGE, dtype=DTYPE,
        head_num=model_config.get_num_kv_heads(parallel.attn_tp_size),
        head_dim=hf.head_dim, layer_num=end - start, start_layer=start, end_layer=end,
        device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )
    if mode == "decode":
        req_pool = DecodeReqToTokenPool(
            size=8, max_context_len=512, device="cpu", enable_memory_saver=False,
            pre_alloc_size=8,
        )
    else:
        req_pool = ReqToTokenPool(size=8, max_context_len=512, device="cpu",
                                  enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(
        size=POOL_TOKENS, page_size=PAGE, dtype=DTYPE, device="cpu", kvcache=pool,
        need_sort=False,
    )
    runner = SimpleNamespace(
        token_to_kv_pool=pool, model_config=model_config, kv_cache_dtype_str="auto",
        effective_logical_max_total_num_tokens=POOL_TOKENS, mtp_draft_device_pools=(),
        mtp_draft_mamba_pools=(), spec_algorithm=SpeculativeAlgorithm.NONE,
        forward_stream=None, canary_manager=None,
    )
    worker = SimpleNamespace(
        model_runner=runner, is_hybrid_swa=False,
        get_memory_pool=lambda: (req_pool, allocator),
        get_tokens_per_layer_info=lambda: (POOL_TOKENS, None),
        hicache_layer_transfer_counter=None,
    )
    worker.register_hicache_layer_transfer_counter = (
        lambda counter: setattr(worker, "hicache_layer_transfer_counter", counter)
    )
    built = kv_cache_builder.build_kv_cache(
        server_args=rc.get_server_args(), model_config=model_config, tp_worker=worker,
        page_size=PAGE, spec_algorithm=SpeculativeAlgorithm.NONE, enable_metrics=False,
        enable_kv_cache_events=False, enable_hierarchical_cache=False,
    )
    return worker, built


class SchedBase:
    """The `Scheduler` attributes the queues and both mixins read
    (`Scheduler.init_disaggregation` builds the queues from the same)."""

    def __init__(self, mode, model_config, sa):
        self.server_args = sa
        self.model_config = model_config
        self.disaggregation_mode = DisaggregationMode(mode)
        self.transfer_backend = TransferBackend.MOONCAKE
        self.tp_worker, built = build_pools(mode, model_config)
        self.req_to_token_pool = built.req_to_token_pool
        self.token_to_kv_pool_allocator = built.token_to_kv_pool_allocator
        self.tree_cache = built.tree_cache
        self.max_total_num_tokens = POOL_TOKENS
        self.kv_shard_widening = 1
        self.rust_server = None
        self.scheduler_stage_metrics = None
        self.output_streamer = Recorder()
        self.metrics_reporter = Recorder()
        self.metrics_collector = None
        self.batch_result_processor = BatchResultsStandIn()
        self.spec_algorithm = SpeculativeAlgorithm.NONE
        self.enable_overlap = self.enable_staging = self.enable_hisparse = False
        self.enable_decode_hicache = self.enable_lora = False
        self.enable_priority_scheduling = False
        self.random_seed = 0
        self.waiting_queue = []
        self.running_batch = ScheduleBatch(reqs=[])
        self.last_batch = None
        self.chunked_req = None
        self.processed_tokens_counter = 0
        parallel = rc.get_parallel()
        self.tp_size = parallel.tp_size
        self.attn_tp_cpu_group = parallel.attn_tp_group.cpu_group
        self.attn_cp_cpu_group = parallel.attn_cp_group.cpu_group
        self.pp_group = parallel.pp_group
        self.kv_checksum_computer = None
        self.pool = self.token_to_kv_pool_allocator.get_kvcache()
        self.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(16)
        self.disagg_metadata_buffers = MetadataBuffers(
            16, hidden_size=16, hidden_states_dtype=torch.float32,
            max_sampling_mask_tokens=sa.sampling_mask_max_tokens,
        )

    def maybe_send_health_check_signal(self):
        pass

    def _release_aborted_request(self, req):
        # After release_kv_cache only the metadata slot is left, which the
        # failure paths free themselves.
        pass

    def free(self) -> "tuple[int, int]":
        """Free KV tokens and free metadata slots."""
        return (self.token_to_kv_pool_allocator.available_size(),
                self.req_to_metadata_buffer_idx_allocator.available_size())


class PrefillSched(SchedBase, SchedulerDisaggregationPrefillMixin, SchedulerPPMixin):
    def __init__(self, model_config, sa):
        super().__init__("prefill", model_config, sa)
        self.world_group = rc.get_parallel().world_group
        self.disagg_prefill_bootstrap_queue = PrefillBootstrapQueue(
            token_to_kv_pool=self.pool, draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=self.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=self.disagg_metadata_buffers, gpu_id=0,
            bootstrap_port=sa.disaggregation_bootstrap_port,
            max_total_num_tokens=POOL_TOKENS, scheduler=self,
            scheduler_stage_metrics=None, transfer_backend=TransferBackend.MOONCAKE,
        )
        self.disagg_prefill_inflight_queue = []
        self.disagg_prefill_pending_chunk_rids = set()

    def forward(self, reqs, seed):
        """SGLang's batch construction and allocation for whole prompts,
        then a stand-in forward that writes seeded bytes into the KV of
        every token SGLang allocated."""
        for r in reqs:
            r.init_next_round_input(self.tree_cache)
            r.extend_end = len(r.full_untruncated_fill_ids)
            r.lock = self.tree_cache.lock(r.last_node)
        batch = ScheduleBatch.init_new(
            reqs, self.req_to_token_pool, self.token_to_kv_pool_allocator,
            self.tree_cache, self.model_config, False, SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        loc = batch.out_cache_loc.to(torch.int64)
        for i in range(self.pool.layer_num):
            k, v = self.pool.k_buffer[i], self.pool.v_buffer[i]
            k[loc], v[loc] = layer_kv(seed, self.pool.start_layer + i, k[loc].shape)
        next_ids = torch.tensor([1000 + i for i in range(len(reqs))], dtype=torch.int64)
        return batch, GenerationBatchResult(next_token_ids=next_ids)


def layer_kv(seed: int, layer: int, shape) -> "tuple[torch.Tensor, torch.Tensor]":
    """The stand-in forward's K and V of one model layer for a batch's
    tokens: a function of the seed and the layer alone, so a process that
    holds other layers (a decode fed by pipeline stages) can check them."""
    g = torch.Generator().manual_seed(seed * 1000 + layer)
    return tuple(torch.randn(shape, generator=g).to(DTYPE) for _ in range(2))


class DecodeSched(SchedBase, SchedulerDisaggregationDecodeMixin, SchedulerPPMixin):
    def __init__(self, model_config, sa):
        super().__init__("decode", model_config, sa)
        self.world_group = rc.get_parallel().world_group
        self.disagg_decode_prealloc_queue = None
        self.disagg_decode_transfer_queue = DecodeTransferQueue(
            req_to_metadata_buffer_idx_allocator=self.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=self.disagg_metadata_buffers, scheduler=self,
            tree_cache=self.tree_cache,
        )
        self.disagg_decode_prealloc_queue = DecodePreallocQueue(
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=self.req_to_metadata_buffer_idx_allocator,
            metadata_buffers=self.disagg_metadata_buffers, scheduler=self,
            transfer_queue=self.disagg_decode_transfer_queue, tree_cache=self.tree_cache,
            gpu_id=0, bootstrap_port=sa.disaggregation_bootstrap_port,
            max_total_num_tokens=POOL_TOKENS,
            num_reserved_decode_tokens=rc.get_disagg().num_reserved_decode_tokens,
            transfer_backend=TransferBackend.MOONCAKE,
        )
        self.decode_offload_manager = None


def server_args(mode: str, port: int, **over) -> ServerArgs:
    sa = ServerArgs(**{
        "model_path": MODEL, "device": "cpu", "disaggregation_mode": mode,
        "disaggregation_transfer_backend": "mooncake", "host": "127.0.0.1",
        "disaggregation_bootstrap_port": port, "page_size": PAGE, "max_running_requests": 8,
        "dtype": "float16", **over,
    })
    # The default reserve (512 tokens per request) admits nothing into a
    # 256-token decode pool.
    sa.num_reserved_decode_tokens = 16
    return sa


def req(rid, ids, room, port, mode, max_new_tokens=4, bootstrap_host="127.0.0.1") -> Req:
    sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    sp.normalize(None)
    sp.verify(4096)
    return Req(rid, "", array("q", ids), sp, bootstrap_host=bootstrap_host, bootstrap_port=port,
               bootstrap_room=room, disagg_mode=mode, vocab_size=4096)


def pp_round(sched, gather, process) -> None:
    """One consensus of SGLang's PP event loops, its microbatch ring stood
    in by one round per step: each stage's `gather` intersects its own
    requests with the previous stage's, the last stage's list goes round to
    the first, and every stage `process`es that list."""
    rids = gather()
    sched._pp_send_pyobj_to_next_stage(rids)
    if sched.pp_group.is_first_rank:
        rids = sched._pp_recv_pyobj_from_prev_stage()
    process(rids)


class Pair:
    """A prefill and a decode scheduler sharing one bootstrap service;
    `step` runs one turn of each one's event loop."""

    def __init__(self, parallel=None, decode=None, world=(1, 0, None), dp_rank=None,
                 port=None, sides="PD", rendezvous_host="127.0.0.1", bootstrap_host="127.0.0.1"):
        """`world`: see `process_groups`; rank 0 of a wider world serves
        the bootstrap service on `port`, the others register there.
        `sides`: the engines this process runs ("P", "D" or both);
        `bootstrap_host`: where requests say the prefill's service is."""
        self.port = port or free_port()
        self.bootstrap_host = bootstrap_host
        ranks = SpawnRanks(world_rank=world[1], dp_rank=dp_rank, gpu_id=0)
        self.P = self.D = self.ps = self.ds = self.bootstrap = None
        if "P" in sides:
            self.P = rc.create_context(server_args("prefill", self.port, **(parallel or {})),
                                       role="scheduler", ranks=ranks)
            process_groups(self.P, world, rendezvous_host)
            with rc.use_context(self.P):
                from sglang.srt.managers.disagg_service import start_disagg_service

                if world[1] == 0:
                    self.bootstrap = start_disagg_service()
                sa = rc.get_server_args()
                self.ps = PrefillSched(ModelConfig.from_server_args(sa), sa)
        if "D" in sides:
            self.D = rc.create_context(
                server_args("decode", self.port, **(parallel or {}), **(decode or {})),
                role="scheduler", ranks=ranks)
            process_groups(self.D, world)
            with rc.use_context(self.D):
                sa = rc.get_server_args()
                self.ds = DecodeSched(ModelConfig.from_server_args(sa), sa)
        self.hold_prefill = False
        self.reqs: dict = {}
        #: The prefill's KV bytes of each request, as its forward left them.
        self.computed: dict = {}

    def add(self, rid, ids, room, prefill=True, decode=True):
        """A request as `Scheduler._add_request_to_queue` takes it, on
        each side."""
        if prefill and self.P is not None:
            with rc.use_context(self.P):
                r = req(rid, ids, room, self.port, DisaggregationMode.PREFILL,
                        bootstrap_host=self.bootstrap_host)
                self.ps.disagg_prefill_bootstrap_queue.add(r, self.ps.model_config.num_key_value_heads)
                self.reqs[("P", rid)] = r
        if decode and self.D is not None:
            with rc.use_context(self.D):
                r = req(rid, ids, room, self.port, DisaggregationMode.DECODE,
                        bootstrap_host=self.bootstrap_host)
                self.ds.disagg_decode_prealloc_queue.add(r)
                self.reqs[("D", rid)] = r

    def step(self, seed=0):
        """One turn of `event_loop_normal_disagg_prefill` (its batch and
        forward stood in) and of `event_loop_normal_disagg_decode`'s queue
        part."""
        if self.P is not None:
            with rc.use_context(self.P):
                self._prefill_step(seed)
        if self.D is not None:
            with rc.use_context(self.D):
                self._decode_step()

    def _decode_step(self):
        ds = self.ds
        if ds.pp_group.world_size == 1:
            ds.process_decode_queue()
            return
        # `event_loop_pp_disagg_decode`'s consensus on preallocation and on
        # release.
        pp_round(ds, ds._pp_pd_get_prealloc_ids, ds.process_prealloc_queue)
        pp_round(ds, ds._pp_pd_get_decode_transferred_ids, ds.process_decode_transfer_queue)

    def _prefill_step(self, seed):
        ps = self.ps
        # With stages, PP rank 0 polls every request's consensus
        # (`poll_pp_consensus`) and the other stages receive its verdict.
        ps.waiting_queue.extend(ps.disagg_prefill_bootstrap_queue.pop_bootstrapped())
        if ps.waiting_queue and not self.hold_prefill:
            reqs, ps.waiting_queue = ps.waiting_queue, []
            batch, result = ps.forward(reqs, seed)
            for r in reqs:
                # Read before the send: a finished prefill frees its row.
                self.computed[r.rid] = self._kv(ps, r, len(r.origin_input_ids))
            ps.process_batch_result_disagg_prefill(batch, result)
        if ps.pp_group.world_size == 1:
            ps.process_disagg_prefill_inflight_queue()
            return
        # `event_loop_pp_disagg_prefill`'s release consensus.
        pp_round(ps, ps._pp_pd_get_prefill_transferred_ids,
                 ps.process_disagg_prefill_inflight_queue)

    def run_until(self, done, within_s=20.0):
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            self.step()
            if done():
                return True
            time.sleep(0.005)
        return False

    def prefill_ended(self, rid) -> bool:
        return any(r is self.reqs[("P", rid)] for r in self.ps.output_streamer.streamed)

    def decode_transferred(self, rid) -> bool:
        return any(r is self.reqs[("D", rid)] for r in self.ds.waiting_queue)

    def decode_aborted(self, rid) -> bool:
        return any(r is self.reqs[("D", rid)] for r in self.ds.output_streamer.streamed)

    def abort_prefill(self, rid):
        """`Scheduler.abort_request`'s prefill branch."""
        with rc.use_context(self.P):
            for r in self.ps.disagg_prefill_bootstrap_queue.queue:
                if r.rid == rid:
                    self.ps._release_aborted_request(r)
                    r.disagg_kv_sender.abort()
            for r in self.ps.disagg_prefill_inflight_queue:
                if r.rid == rid:
                    r.disagg_kv_sender.abort()

    def abort_decode(self, rid):
        """`Scheduler.abort_request`'s decode branch."""
        with rc.use_context(self.D):
            queues = (self.ds.disagg_decode_prealloc_queue.queue,
                      self.ds.disagg_decode_transfer_queue.queue)
            for queue in queues:
                for d in queue:
                    if d.req.rid == rid:
                        d.kv_receiver.abort()

    def kv(self, side, rid, n_tokens):
        """The K and V bytes of a request's first `n_tokens` tokens, layer
        by layer: the prefill's as computed, the decode's as they are."""
        if side == "P":
            return [t[:n_tokens] for t in self.computed[rid]]
        return self._kv(self.ds, self.reqs[("D", rid)], n_tokens)

    @staticmethod
    def _kv(sched, r, n_tokens):
        """Read through SGLang's request-to-token table."""
        locs = sched.req_to_token_pool.req_to_token[r.kv.req_pool_idx, :n_tokens].to(torch.int64)
        out = []
        for layer in range(sched.pool.layer_num):
            out.append(sched.pool.k_buffer[layer][locs].clone().view(torch.uint8))
            out.append(sched.pool.v_buffer[layer][locs].clone().view(torch.uint8))
        return out

    def release_decode(self, rid):
        """The decode request finished: its KV goes into decode's tree."""
        with rc.use_context(self.D):
            r = self.reqs[("D", rid)]
            self.ds.waiting_queue.remove(r)
            release_kv_cache(r, self.ds.tree_cache, checkpoint=True)

    def managers(self):
        out = []
        if self.ps is not None:
            out.append(self.ps.disagg_prefill_bootstrap_queue.kv_manager)
        if self.ds is not None:
            out.append(self.ds.disagg_decode_prealloc_queue.kv_manager)
        return tuple(out)

    def close(self):
        for m in self.managers():
            m.node.shutdown()
        if self.bootstrap is not None:
            self.bootstrap.close()


def no_nccl_for_groups_of_two() -> None:
    """The second CUDA-only substitution, for worlds of more than one rank:
    SGLang's groups of two or more open NCCL and custom all-reduce
    communicators; here they use gloo alone."""
    make = parallel_state.init_model_parallel_group

    def gloo_only(*a, **k):
        k.update(use_pynccl=False, use_custom_allreduce=False)
        return make(*a, **k)

    parallel_state.init_model_parallel_group = gloo_only
    CUDA_SUBSTITUTIONS.append(
        "sglang.srt.distributed.parallel_state.init_model_parallel_group: NCCL and "
        "custom all-reduce communicators off in worlds of two (gloo only)"
    )


def dp_attention_rank(rank: int, rendezvous: int, port: int) -> None:
    """One world rank of a prefill and a decode engine with DP attention
    (TP 2, DP 2, so attention TP 1): moves one request whose room SGLang's
    decode sends to this DP rank, and exits 0 once every byte matched.
    Run as `python sglang_sched.py dp RANK RENDEZVOUS_PORT BOOTSTRAP_PORT`,
    both ranks at once."""
    no_nccl_for_groups_of_two()
    pair = Pair(parallel={"tp_size": 2, "dp_size": 2, "enable_dp_attention": True},
                world=(2, rank, rendezvous), dp_rank=rank, port=port)
    settings = [m.node.settings for m in pair.managers()]
    for s in settings:
        assert (s["tp_size"], s["tp_rank"], s["dp_rank"]) == (1, 0, rank), s
    prompt = list(range(11 + rank, 21 + rank))
    room = 500 + rank  # room % dp_size is this rank
    pair.add("dp", prompt, room=room)
    assert pair.run_until(lambda: pair.prefill_ended("dp") and pair.decode_transferred("dp"),
                          within_s=30), f"rank {rank}: request {room} did not move"
    src, dst = pair.kv("P", "dp", len(prompt)), pair.kv("D", "dp", len(prompt))
    assert all(torch.equal(a, b) for a, b in zip(src, dst)), f"rank {rank}: bytes differ"
    print(f"rank {rank}: {sum(t.numel() for t in src)} bytes moved", flush=True)
    # Rank 0 serves the bootstrap service: it stays until rank 1 is done.
    torch.distributed.barrier(group=_world["world_group"].cpu_group)
    pair.close()


PP_PROMPT = list(range(31, 45))
#: How long a pipeline test's process waits for its request: a bound for a
#: hang, not a timing (three processes import SGLang at once on two cores,
#: and the decode may start its scheduler after the prefill's).
PP_WITHIN_S = 90
PP_ROOM = 700
PP_SEED = 7


def lockstep(pair: Pair, done) -> bool:
    """`Pair.run_until` for the ranks of one world: every rank steps until
    `done()` holds on all of them or one ran out of time. Their queues
    exchange verdicts each step, so they stop together."""
    world = _world["world_group"].cpu_group
    deadline = time.monotonic() + PP_WITHIN_S
    while True:
        pair.step(seed=PP_SEED)
        flags = torch.tensor([int(done()), int(time.monotonic() > deadline)])
        torch.distributed.all_reduce(flags, group=world)
        if flags[0] == world.size() or flags[1] > 0:
            return bool(flags[0] == world.size())
        time.sleep(0.005)


def pp_prefill_stage(rank: int, rendezvous: int, port: int) -> None:
    """One stage of a prefill engine with two pipeline stages (a world of
    two ranks; rank 0 serves the bootstrap service): prefills one request
    and exits 0 once SGLang's release consensus ended it on both stages.
    Run as `python sglang_sched.py pp-prefill RANK RENDEZVOUS_PORT BOOTSTRAP_PORT`."""
    no_nccl_for_groups_of_two()
    pair = Pair(parallel={"pp_size": 2}, world=(2, rank, rendezvous), port=port, sides="P")
    (mgr,) = pair.managers()
    assert (mgr.node.settings["pp_size"], mgr.node.settings["pp_rank"]) == (2, rank)
    prefill_one_request(pair, f"stage {rank}")


def prefill_one_request(pair: "Pair", who: str) -> None:
    """Prefills one request on this stage of a two-stage prefill engine,
    prints `who` and the layers it sent once SGLang's release consensus
    ended the request on both stages, and closes the stage."""
    pair.add("pp", PP_PROMPT, room=PP_ROOM)
    done = lockstep(pair, lambda: pair.prefill_ended("pp"))
    assert done, f"{who}: request {PP_ROOM} did not end on both stages"
    print(f"{who}: layers {pair.ps.pool.start_layer}..{pair.ps.pool.end_layer} sent", flush=True)
    # Rank 0 serves the bootstrap service: it stays until rank 1 is done.
    torch.distributed.barrier(group=_world["world_group"].cpu_group)
    pair.close()


def node_prefill_stage(rank: int, node0: str, rendezvous: int, port: int) -> None:
    """Stage `rank` of a prefill engine whose two pipeline stages run on
    two nodes, as an operator launches SGLang across nodes: every rank
    listens on every interface (`--host 0.0.0.0`) and `--dist-init-addr`
    names node 0, which serves the bootstrap service. Exits 0 once the
    request ended on both stages. Run as `python sglang_sched.py
    node-prefill RANK NODE0_ADDRESS RENDEZVOUS_PORT BOOTSTRAP_PORT`."""
    no_nccl_for_groups_of_two()
    across = {"pp_size": 2, "host": "0.0.0.0", "dist_init_addr": f"{node0}:{rendezvous}"}
    pair = Pair(parallel=across, world=(2, rank, rendezvous), port=port, sides="P",
                rendezvous_host=node0, bootstrap_host=node0)
    (mgr,) = pair.managers()
    assert mgr.node.settings["bootstrap"] == f"{node0}:{port}", mgr.node.settings["bootstrap"]
    prefill_one_request(pair, f"node {rank}")


def pp_stage_pair(rank: int, rendezvous: int, port: int) -> None:
    """Stage `rank` of a prefill and of a decode engine with two pipeline
    stages each (a world of two ranks; rank 0 serves the bootstrap
    service): stage r feeds stage r; exits 0 once the request's layers of
    this stage and its first token matched on decode.
    Run as `python sglang_sched.py pp-pair RANK RENDEZVOUS_PORT BOOTSTRAP_PORT`."""
    no_nccl_for_groups_of_two()
    pair = Pair(parallel={"pp_size": 2}, world=(2, rank, rendezvous), port=port)
    for m in pair.managers():
        assert (m.node.settings["pp_size"], m.node.settings["pp_rank"]) == (2, rank)
    pair.add("pp", PP_PROMPT, room=PP_ROOM)
    done = lockstep(pair, lambda: pair.prefill_ended("pp") and pair.decode_transferred("pp"))
    assert done, f"stage {rank}: request {PP_ROOM} did not move on both stages"
    n = len(PP_PROMPT)
    src, dst = pair.kv("P", "pp", n), pair.kv("D", "pp", n)
    assert len(src) == 4 and all(torch.equal(a, b) for a, b in zip(src, dst)), \
        f"stage {rank}: bytes differ"
    first = list(pair.reqs[("D", "pp")].output_ids[:1])
    assert first == [1000], f"stage {rank}: first token {first}"
    print(f"stage {rank}: layers {pair.ds.pool.start_layer}..{pair.ds.pool.end_layer} matched",
          flush=True)
    torch.distributed.barrier(group=_world["world_group"].cpu_group)
    pair.close()


def pp_decode(port: int, host: str = "127.0.0.1") -> None:
    """A decode engine without stages fed by both stages of the prefill
    engine whose bootstrap service is `host`:`port`: exits 0 once every
    layer of the request matched what the stand-in forward of its stage
    wrote. Run as `python sglang_sched.py pp-decode BOOTSTRAP_PORT [HOST]`."""
    pair = Pair(port=port, sides="D", bootstrap_host=host)
    pair.add("pp", PP_PROMPT, room=PP_ROOM)
    assert pair.run_until(lambda: pair.decode_transferred("pp"), within_s=PP_WITHIN_S), \
        f"request {PP_ROOM} did not move"
    n = len(PP_PROMPT)
    got = pair.kv("D", "pp", n)
    pool = pair.ds.pool
    for layer in range(pool.layer_num):
        k, v = layer_kv(PP_SEED, layer, pool.k_buffer[layer][:n].shape)
        assert torch.equal(got[2 * layer], k.view(torch.uint8)), f"layer {layer}: K differs"
        assert torch.equal(got[2 * layer + 1], v.view(torch.uint8)), f"layer {layer}: V differs"
    # The first output token comes in the aux buffer, from the last stage.
    first = list(pair.reqs[("D", "pp")].output_ids[:1])
    assert first == [1000], f"first token {first}"
    print(f"decode: {pool.layer_num} layers matched", flush=True)
    pair.close()


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["dp"]:
        dp_attention_rank(*(int(a) for a in sys.argv[2:5]))
        os._exit(0)
    if sys.argv[1:2] == ["pp-prefill"]:
        pp_prefill_stage(*(int(a) for a in sys.argv[2:5]))
        os._exit(0)
    if sys.argv[1:2] == ["pp-pair"]:
        pp_stage_pair(*(int(a) for a in sys.argv[2:5]))
        os._exit(0)
    if sys.argv[1:2] == ["pp-decode"]:
        pp_decode(int(sys.argv[2]), *sys.argv[3:4])
        os._exit(0)
    if sys.argv[1:2] == ["node-prefill"]:
        node_prefill_stage(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        os._exit(0)
