"""kvferry as SGLang's transfer backend, driven through SGLang's own base
classes (sglang 0.5.23 installed without its dependencies, as
`scripts/test-vllm.sh` does): KV pages, an aux buffer and a state buffer
move from a prefill to a decode manager, every byte compared; and after
SGLang's plugin loading, the mooncake backend's classes are kvferry's.
Skipped where SGLang is not installed."""

import importlib.metadata
import os
import time
import types

import numpy as np
import pytest
from engines import free_port

pytest.importorskip("sglang.srt.disaggregation.base.conn")

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll  # noqa: E402
from sglang.srt.disaggregation.utils import (  # noqa: E402
    DisaggregationMode,
    KVClassType,
    TransferBackend,
)

from kvferry.sglang import (  # noqa: E402
    KvferryKVBootstrapServer,
    KvferryKVManager,
    KvferryKVReceiver,
    KvferryKVSender,
)

PAGE, HEADS, HEAD_DIM, LAYERS, PAGES = 4, 2, 8, 2, 32
ITEM = PAGE * HEADS * HEAD_DIM * 2  # fp16 bytes of one page of one layer's K
AUX_ITEM, STATE_ITEM, ROWS = 16, 64, 8


def buffers(fill, seed):
    rng = np.random.default_rng(seed)
    make = (lambda n: rng.integers(0, 256, n, dtype=np.uint8)) if fill else (
        lambda n: np.zeros(n, np.uint8)
    )
    # K of every layer, then V of every layer, as SGLang lists them.
    kv = [make(PAGES * ITEM) for _ in range(2 * LAYERS)]
    return kv, make(ROWS * AUX_ITEM), make(ROWS * STATE_ITEM)


def kv_args(kv, aux, state):
    a = KVArgs()
    a.engine_rank = 0
    a.kv_data_ptrs = [b.ctypes.data for b in kv]
    a.kv_data_lens = [b.nbytes for b in kv]
    a.kv_item_lens = [ITEM] * len(kv)
    a.kv_layer_ids = list(range(LAYERS)) * 2
    a.aux_data_ptrs = [aux.ctypes.data]
    a.aux_data_lens = [aux.nbytes]
    a.aux_item_lens = [AUX_ITEM]
    a.state_data_ptrs = [[state.ctypes.data]]
    a.state_data_lens = [[state.nbytes]]
    a.state_item_lens = [[STATE_ITEM]]
    a.kv_head_num = HEADS
    a.total_kv_head_num = HEADS
    a.page_size = PAGE
    a.system_dp_rank = 0
    return a


def server_args(port):
    return types.SimpleNamespace(tp_size=1, host="127.0.0.1", disaggregation_bootstrap_port=port)


def wait(*transfers, within_s=20.0):
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        polls = [t.poll() for t in transfers]
        if all(p in (KVPoll.Success, KVPoll.Failed) for p in polls):
            return polls
    raise AssertionError([t.poll() for t in transfers])


def test_kv_aux_and_state_move_through_sglangs_interface():
    port = free_port()
    server = KvferryKVBootstrapServer("127.0.0.1", port)
    pkv, paux, pstate = buffers(True, 1)
    dkv, daux, dstate = buffers(False, 0)
    p = KvferryKVManager(kv_args(pkv, paux, pstate), DisaggregationMode.PREFILL, server_args(port))
    d = KvferryKVManager(kv_args(dkv, daux, dstate), DisaggregationMode.DECODE, server_args(port))
    try:
        room = 987654321
        rx = KvferryKVReceiver(d, f"127.0.0.1:{port}", room)
        rx.init(prefill_dp_rank=0)
        rx.send_metadata(np.array([7, 8, 9], np.int32), aux_index=5, state_indices=[[6]])
        tx = KvferryKVSender(p, f"127.0.0.1:{port}", room)
        tx.init(num_kv_indices=3, aux_index=2)
        # Two chunks, as SGLang sends a long prefill.
        tx.send(np.array([1, 2], np.int32))
        tx.send(np.array([3], np.int32), state_indices=[[4]])
        assert wait(rx, tx) == [KVPoll.Success, KVPoll.Success]
        for src, dst in zip(pkv, dkv):
            for sp, dp in zip([1, 2, 3], [7, 8, 9]):
                assert (dst[dp * ITEM : (dp + 1) * ITEM] == src[sp * ITEM : (sp + 1) * ITEM]).all()
        assert (daux[5 * AUX_ITEM : 6 * AUX_ITEM] == paux[2 * AUX_ITEM : 3 * AUX_ITEM]).all()
        assert (dstate[6 * STATE_ITEM : 7 * STATE_ITEM] == pstate[4 * STATE_ITEM : 5 * STATE_ITEM]).all()
        assert not daux[: 5 * AUX_ITEM].any() and not dstate[: 6 * STATE_ITEM].any()
        # A request the prefill side aborts fails on both sides.
        rx2 = KvferryKVReceiver(d, f"127.0.0.1:{port}", room + 1)
        rx2.init(0)
        rx2.send_metadata(np.array([10], np.int32), aux_index=1, state_indices=[[1]])
        tx2 = KvferryKVSender(p, f"127.0.0.1:{port}", room + 1)
        tx2.abort()
        assert wait(rx2, tx2) == [KVPoll.Failed, KVPoll.Failed]
        with pytest.raises(Exception, match="failed"):
            rx2.failure_exception()
    finally:
        p.node.shutdown()
        d.node.shutdown()
        server.close()


def test_sglangs_plugin_loading_puts_kvferry_behind_the_mooncake_backend(monkeypatch):
    # The entry point SGLang discovers is installed with the package.
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert "kvferry.sglang:plugin" in {ep.value for ep in eps}
    monkeypatch.setenv("KVFERRY_SGLANG", "1")
    monkeypatch.setenv("SGLANG_PLUGINS", "kvferry")
    import sglang.srt.plugins as plugins
    from sglang.srt.disaggregation import utils

    plugins.load_plugins()
    assert utils.get_kv_class(TransferBackend.MOONCAKE, KVClassType.MANAGER) is KvferryKVManager
    assert utils.get_kv_class(TransferBackend.MOONCAKE, KVClassType.SENDER) is KvferryKVSender
    assert utils.get_kv_class(TransferBackend.MOONCAKE, KVClassType.RECEIVER) is KvferryKVReceiver
    assert (
        utils.get_kv_class(TransferBackend.MOONCAKE, KVClassType.BOOTSTRAP_SERVER)
        is KvferryKVBootstrapServer
    )
    # Other backends are left alone.
    assert utils.get_kv_class(TransferBackend.FAKE, KVClassType.MANAGER).__name__ == "FakeKVManager"
    assert os.environ["KVFERRY_SGLANG"] == "1"
