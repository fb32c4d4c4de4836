"""kvferry from Python: real nodes on 127.0.0.1, tcp data plane, every
byte compared."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import kvferry
import kvferry._adapters as adapters
from kvferry import Phase

HEADS, TOKENS, HEAD_BYTES, LAYERS, BLOCKS = 4, 4, 32, 2, 16
MODEL = dict(layout="hnd", total_kv_heads=HEADS, block_tokens=TOKENS, head_bytes=HEAD_BYTES)
WAIT = 10.0


def kv(tp_size=1, fill=False, seed=0):
    """One rank's KV: K and V of every layer, blocks first (HND: heads,
    then tokens, then bytes, within a block)."""
    shape = (BLOCKS, HEADS // tp_size, TOKENS, HEAD_BYTES)
    rng = np.random.default_rng(seed)
    return [
        rng.integers(0, 256, shape, dtype=np.uint8) if fill else np.zeros(shape, np.uint8)
        for _ in range(2 * LAYERS)
    ]


def node(role, name, mode="push", **kw):
    return kvferry.Node(role=role, engine_id=name, mode=mode, heartbeat_interval_ms=100, **kw)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_request_moves_every_byte(mode):
    with node("prefill", "p", mode) as p, node("decode", "d", mode) as d:
        pk, dk = kv(fill=True), kv()
        p.register_kv_caches(pk, **MODEL)
        d.register_kv_caches(dk, **MODEL)
        rx = d.receiver(7, side_channels=[p.side_channel_addr])
        rx.request([3, 4, 5])
        tx = p.sender(7)
        tx.send([0, 1, 2])
        assert rx.wait(WAIT) is Phase.Success, rx.failure
        assert tx.wait(WAIT) is Phase.Success
        for src, dst in zip(pk, dk):
            np.testing.assert_array_equal(dst[3:6], src[0:3])
        assert not dk[0][6:].any(), "no byte lands outside the requested blocks"
        assert d.get_finished() == (set(), {7})
        assert p.get_finished() == ({7}, set())
        assert d.stats()["ok"] == 1 and p.stats()["ok"] == 1


@pytest.mark.parametrize("p_tp, d_tp", [(2, 1), (1, 2)])
def test_heterogeneous_tp_moves_each_head_to_its_rank(p_tp, d_tp):
    ps = [node("prefill", "p", tp_size=p_tp, tp_rank=r) for r in range(p_tp)]
    ds = [node("decode", "d", tp_size=d_tp, tp_rank=r) for r in range(d_tp)]
    pks = [kv(p_tp, fill=True, seed=r) for r in range(p_tp)]
    dks = [kv(d_tp) for _ in range(d_tp)]
    try:
        for n, k in zip(ps + ds, pks + dks):
            n.register_kv_caches(k, **MODEL)
        channels = [p.side_channel_addr for p in ps]
        rxs = [d.receiver("cmpl-tp", side_channels=channels, prefill_tp_size=p_tp) for d in ds]
        for rx in rxs:
            rx.request([8, 9])
        txs = [p.sender("cmpl-tp") for p in ps]
        for tx in txs:
            tx.send([1, 2])
        assert [rx.wait(WAIT) for rx in rxs] == [Phase.Success] * d_tp
        assert [tx.wait(WAIT) for tx in txs] == [Phase.Success] * p_tp
        # The model's heads, in order, as prefill holds them and as decode got them.
        for region in range(2 * LAYERS):
            sent = np.concatenate([k[region][1:3] for k in pks], axis=1)
            got = np.concatenate([k[region][8:10] for k in dks], axis=1)
            np.testing.assert_array_equal(got, sent)
        assert all(d.get_finished() == (set(), {"cmpl-tp"}) for d in ds)
        assert all(p.get_finished() == ({"cmpl-tp"}, set()) for p in ps)
    finally:
        for n in ds + ps:
            n.shutdown()


def test_an_abort_on_decode_ends_both_sides():
    with node("prefill", "p") as p, node("decode", "d") as d:
        pk, dk = kv(fill=True), kv()
        p.register_kv_caches(pk, **MODEL)
        d.register_kv_caches(dk, **MODEL)
        rx = d.receiver(11, side_channels=[p.side_channel_addr])
        rx.request([0, 1])
        tx = p.sender(11)
        rx.abort()
        assert rx.wait(WAIT) is Phase.Failed
        assert rx.failure == "Aborted(Engine)"
        assert tx.wait(WAIT) is Phase.Failed
        assert not any(k.any() for k in dk)


def test_a_dead_prefill_fails_the_request_fast():
    with node("decode", "d", heartbeat_misses=2) as d:
        d.register_kv_caches(kv(), **MODEL)
        p = node("prefill", "p")
        p.register_kv_caches(kv(fill=True), **MODEL)
        channel = p.side_channel_addr
        p.shutdown()
        rx = d.receiver(3, side_channels=[channel])
        rx.request([0])
        started = time.monotonic()
        assert rx.wait(WAIT) in (Phase.Failed, Phase.Expired)
        assert time.monotonic() - started < WAIT


def test_keywords_win_over_kvferry_variables_which_win_over_defaults(monkeypatch):
    monkeypatch.setenv("KVFERRY_MAX_PEERS", "77")
    monkeypatch.setenv("KVFERRY_HEARTBEAT_MISSES", "9")
    monkeypatch.setenv("KVFERRY_TP_SIZE", "8")
    monkeypatch.setenv("KVFERRY_SGLANG", "1")  # not a node setting: ignored
    n = kvferry.Node(role="decode", engine_id="d", tp_size=1, host="127.0.0.1")
    try:
        s = n.settings
        assert s["max_peers"] == 77, "from the environment"
        assert s["heartbeat_misses"] == 9, "from the environment"
        assert s["tp_size"] == 1, "the keyword wins"
        assert s["host"] == "127.0.0.1"
        assert s["bootstrap_timeout_ms"] > 0, "a default"
        assert s["role"] == "decode" and s["engine_id"] == "d"
    finally:
        n.shutdown()
    monkeypatch.setenv("KVFERRY_MAX_PEERS", "many")
    with pytest.raises(kvferry.MisuseError, match="KVFERRY_MAX_PEERS"):
        kvferry.Node(role="decode", engine_id="d")


def test_a_detected_host_is_advertised_with_a_key_and_loopback_without(monkeypatch, tmp_path):
    detect = lambda: "10.1.2.3"  # noqa: E731
    for var in ("KVFERRY_HOST", "KVFERRY_LISTEN", "KVFERRY_CLUSTER_KEY_FILE",
                "KVFERRY_ALLOW_UNAUTHENTICATED_REMOTE"):
        monkeypatch.delenv(var, raising=False)
    s = {}
    adapters.with_detected_host(s, detect)
    assert s == {"host": "127.0.0.1"}, "no key: this host only"
    s = {"cluster_key_file": "k"}
    adapters.with_detected_host(s, detect)
    assert s == {"cluster_key_file": "k", "host": "10.1.2.3"}, "a key in the settings"
    s = {"allow_unauthenticated_remote": True}
    adapters.with_detected_host(s, detect)
    assert s["host"] == "10.1.2.3", "trusting anyone, said explicitly"
    monkeypatch.setenv("KVFERRY_ALLOW_UNAUTHENTICATED_REMOTE", "0")
    s = {}
    adapters.with_detected_host(s, detect)
    assert s == {"host": "127.0.0.1"}, "a flag that is off"
    monkeypatch.setenv("KVFERRY_CLUSTER_KEY_FILE", str(tmp_path / "k"))
    s = {}
    adapters.with_detected_host(s, detect)
    assert s == {"host": "10.1.2.3"}, "a key in the environment"
    s = {"host": "h"}
    adapters.with_detected_host(s, detect)
    assert s == {"host": "h"}, "a configured host is not detected"
    monkeypatch.setenv("KVFERRY_HOST", "h2")
    s = {}
    adapters.with_detected_host(s, detect)
    assert s == {}, "KVFERRY_HOST, read by the node, wins"


def test_keyed_nodes_move_kv_and_an_unkeyed_node_listens_on_loopback_only(tmp_path, monkeypatch):
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    with pytest.raises(kvferry.MisuseError, match="without a cluster key"):
        kvferry.Node(role="decode", engine_id="d", listen="0.0.0.0")
    # The key from the settings (vLLM's extra config) or the environment.
    monkeypatch.setenv("KVFERRY_CLUSTER_KEY_FILE", str(key))
    with node("prefill", "p", listen="0.0.0.0") as p, node(
        "decode", "d", cluster_key_file=str(key), listen="0.0.0.0"
    ) as d:
        assert p.settings["cluster_key_file"] == str(key)
        src, dst = kv(fill=True), kv()
        p.register_kv_caches(src, **MODEL)
        d.register_kv_caches(dst, **MODEL)
        rx = d.receiver(7, side_channels=[p.side_channel_addr])
        rx.request([3])
        p.sender(7).send([1])
        assert rx.wait(WAIT) is Phase.Success
        assert all(np.array_equal(s[1], t[3]) for s, t in zip(src, dst))


def test_bad_arguments_raise_and_never_crash():
    with node("prefill", "p") as p:
        with pytest.raises(kvferry.MisuseError, match="leas_ms"):
            node("decode", "d", leas_ms=5)
        with pytest.raises(kvferry.MisuseError):
            p.register_kv_caches(kv(), regions=[(0, 1, 1)], num_blocks=1, **MODEL)
        with pytest.raises(kvferry.MisuseError):
            p.register_kv_caches([np.zeros((4, 8), np.uint8)[:, ::2]], **MODEL)
        with pytest.raises(TypeError):
            p.register_kv_caches([object()], **MODEL)
        with pytest.raises(kvferry.MisuseError):
            p.sender(1)  # before register_kv_caches
        p.register_kv_caches(kv(), **MODEL)
        with pytest.raises(kvferry.MisuseError, match="not in 0..2"):
            p.sender(-1)
        with pytest.raises(TypeError):
            p.sender(1.5)
        tx = p.sender(2)
        with pytest.raises(kvferry.MisuseError, match="block id -3"):
            tx.send([-3])
        with pytest.raises(TypeError):
            tx.send(["a"])
        with pytest.raises(kvferry.MisuseError):
            tx.wait(-1.0)
        with pytest.raises(kvferry.MisuseError):
            p.receiver(4, side_channels=[p.side_channel_addr])  # a prefill node does not receive
        with pytest.raises(kvferry.MisuseError):
            p.sender("x" * (kvferry.REQUEST_ID_MAX_BYTES + 1))
        assert isinstance(kvferry.MisuseError("x"), kvferry.Error)


def test_a_kvferry_timeout_is_the_builtin_timeout_error_too():
    # `except TimeoutError` around an engine's waits catches kvferry's.
    assert issubclass(kvferry.TimeoutError, TimeoutError)
    assert issubclass(kvferry.TimeoutError, kvferry.Error)
    assert kvferry.TimeoutError is kvferry._native.TimeoutError


def test_wait_releases_the_gil():
    with node("prefill", "p") as p, node("decode", "d") as d:
        p.register_kv_caches(kv(), **MODEL)
        d.register_kv_caches(kv(), **MODEL)
        rx = d.receiver(5, side_channels=[p.side_channel_addr])
        rx.request([0])
        counts, stop = [0], threading.Event()

        def count():
            while not stop.is_set():
                counts[0] += 1

        t = threading.Thread(target=count)
        t.start()
        try:
            assert rx.wait(0.5) is not Phase.Success  # nothing was sent
            during = counts[0]
        finally:
            stop.set()
            t.join()
        assert during > 1000, f"the other thread counted {during} during the wait"


def test_ctrl_c_interrupts_a_long_wait():
    # Python raises KeyboardInterrupt only where SIGINT was not ignored when
    # it started; a shell's background jobs start with it ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        wait_interrupted_by_sigint()
    finally:
        signal.signal(signal.SIGINT, previous)


def wait_interrupted_by_sigint():
    with node("prefill", "p") as p, node("decode", "d") as d:
        p.register_kv_caches(kv(), **MODEL)
        d.register_kv_caches(kv(), **MODEL)
        rx = d.receiver(6, side_channels=[p.side_channel_addr])
        rx.request([0])
        timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            rx.wait(60.0)
        assert time.monotonic() - started < 1.2
        timer.join()


PREFILL_PROCESS = textwrap.dedent(
    """
    import sys, numpy as np, kvferry
    p = kvferry.Node(role="prefill", engine_id="p")
    k = [np.full((16, 4, 4, 32), i + 1, np.uint8) for i in range(4)]
    p.register_kv_caches(k, layout="hnd", total_kv_heads=4, block_tokens=4, head_bytes=32)
    print(p.side_channel_addr, flush=True)
    tx = p.sender("cross-process")
    tx.send([5, 6])
    phase = tx.wait(20.0)
    print(phase.name, flush=True)
    p.shutdown()
    """
)


def test_two_processes():
    proc = subprocess.Popen(
        [sys.executable, "-c", PREFILL_PROCESS], stdout=subprocess.PIPE, text=True
    )
    try:
        channel = proc.stdout.readline().strip()
        with node("decode", "d") as d:
            dk = kv()
            d.register_kv_caches(dk, **MODEL)
            rx = d.receiver("cross-process", side_channels=[channel])
            rx.request([0, 1])
            assert rx.wait(WAIT) is Phase.Success, rx.failure
            for i, k in enumerate(dk):
                assert (k[0:2] == i + 1).all()
            # Prefill's own word, while decode's node still answers.
            assert proc.stdout.readline().strip() == "Success"
    finally:
        proc.wait(timeout=20)
    assert proc.returncode == 0


def test_both_role_sends_and_receives():
    with node("both", "a") as a, node("both", "b") as b:
        ak, bk = kv(fill=True, seed=1), kv(fill=True, seed=2)
        a.register_kv_caches(ak, **MODEL)
        b.register_kv_caches(bk, **MODEL)
        ab = b.receiver("a-to-b", side_channels=[a.side_channel_addr])
        ba = a.receiver("b-to-a", side_channels=[b.side_channel_addr])
        ab.request([10, 11])
        ba.request([12, 13])
        txs = [a.sender("a-to-b"), b.sender("b-to-a")]
        txs[0].send([0, 1])
        txs[1].send([2, 3])
        assert (ab.wait(WAIT), ba.wait(WAIT)) == (Phase.Success, Phase.Success)
        assert [tx.wait(WAIT) for tx in txs] == [Phase.Success] * 2
        src_a = [k[0:2].copy() for k in ak]
        np.testing.assert_array_equal(bk[0][10:12], src_a[0])
        assert a.get_finished() == ({"a-to-b"}, {"b-to-a"})


# Hypothesis: whatever an engine passes, a call raises a typed exception or
# works; it never takes the interpreter down.
from hypothesis import given, settings, strategies as st  # noqa: E402

ids = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=300),
    st.floats(),
    st.none(),
    st.lists(st.integers(), max_size=3),
)
block_lists = st.one_of(
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=8),
    st.lists(st.lists(st.integers(min_value=-5, max_value=2**33), max_size=4), max_size=3),
    st.text(max_size=5),
    st.integers(),
)


@pytest.fixture(scope="module")
def prefill():
    with node("prefill", "fuzz") as p:
        p.register_kv_caches(kv(), **MODEL)
        yield p


@settings(max_examples=300, deadline=None)
@given(transfer_id=ids, blocks=block_lists, timeout=st.floats(allow_nan=True))
def test_any_argument_raises_a_typed_error_or_works(prefill, transfer_id, blocks, timeout):
    try:
        tx = prefill.sender(transfer_id)
    except (kvferry.Error, TypeError, ValueError):
        return
    try:
        tx.send(blocks)
    except (kvferry.Error, TypeError, ValueError):
        pass
    try:
        phase = tx.wait(min(abs(timeout), 0.01) if timeout == timeout else timeout)
        assert isinstance(phase, Phase)
    except kvferry.MisuseError:
        pass
    tx.abort()


def test_cpu_torch_tensors_are_registered_as_they_are():
    torch = pytest.importorskip("torch")
    shape = (BLOCKS, HEADS, TOKENS, HEAD_BYTES // 2)  # fp16: two bytes an element
    with node("prefill", "p") as p, node("decode", "d") as d:
        pk = [torch.randn(shape, dtype=torch.float16) for _ in range(2 * LAYERS)]
        dk = [torch.zeros(shape, dtype=torch.float16) for _ in range(2 * LAYERS)]
        p.register_kv_caches(pk, **MODEL)
        d.register_kv_caches(dk, **MODEL)
        rx = d.receiver("torch-1", side_channels=[p.side_channel_addr])
        rx.request([12, 13])
        p.sender("torch-1").send([2, 3])
        assert rx.wait(WAIT) is Phase.Success, rx.failure
        for src, dst in zip(pk, dk):
            assert torch.equal(dst[12:14], src[2:4])
        with pytest.raises(kvferry.MisuseError):
            d.register_kv_caches([torch.zeros(shape).transpose(1, 2)], **MODEL)


def test_kvferrys_warnings_reach_python_logging(caplog):
    caplog.set_level(logging.WARNING, logger="kvferry")
    with node("decode", "d") as d:
        d.register_kv_caches(kv(), **MODEL)
        rx = d.receiver(41, side_channels=["tcp://kvferry-nowhere.invalid:5600"])
        rx.request([0])
        assert rx.wait(WAIT) is Phase.Failed
        deadline = time.monotonic() + WAIT
        while not any("kvferry-nowhere.invalid" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.01)
        r = next(r for r in caplog.records if "kvferry-nowhere.invalid" in r.getMessage())
        assert r.name.startswith("kvferry.") and r.levelno == logging.WARNING


def test_a_node_used_after_fork_raises_in_the_child():
    with node("prefill", "p") as p:
        p.register_kv_caches(kv(), **MODEL)
        tx = p.sender(3)
        pid = os.fork()
        if pid == 0:  # the child: report by exit status only
            code = 1
            try:
                p.sender(4)
            except kvferry.MisuseError as e:
                code = 0 if "after fork()" in str(e) else 2
            try:
                tx.poll()
                code = 3
            except kvferry.MisuseError:
                pass
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert tx.poll() is not Phase.Failed  # the parent's node is unharmed


def test_the_interpreter_exits_cleanly_with_nodes_running():
    # The log thread stops before the interpreter finalizes: a thread the
    # interpreter ends inside a native call would abort the process. An
    # object slow to finalize keeps finalization going past the thread's
    # wait, which makes that abort certain if the thread were still there.
    script = textwrap.dedent(
        """
        import time, numpy as np, kvferry
        d = kvferry.Node(role="decode", engine_id="d")
        d.register_kv_caches([np.zeros((4, 64), np.uint8) for _ in range(2)], layout="hnd",
                             total_kv_heads=1, block_tokens=4, head_bytes=16)
        rx = d.receiver(1, side_channels=["tcp://127.0.0.1:9"])
        rx.request([0])
        class SlowToFinalize:
            def __del__(self):
                time.sleep(1.5)
        keep = SlowToFinalize()
        print("started", flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "started"
