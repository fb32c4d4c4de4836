"""kvferry as SGLang's transfer backend, under SGLang 0.5.23's own
disaggregation queues and scheduler mixins (`sglang_sched.py` says what is
SGLang and what is stood in). Every KV byte a decode request holds is
compared with the prefill's, and the first token arrives through SGLang's
metadata buffers. Runs in the SGLang environment (`scripts/engine-env.sh sglang`);
skipped where SGLang is not installed with its dependencies."""

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("sglang.srt.runtime_context")

# SGLang's own transfer timeouts, which the backend takes over: short, so
# that a prefill that never answers ends its decode request within the test.
os.environ["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = "3"
os.environ["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] = "3"
# SGLang's liveness knobs, which it takes over too; where kvferry's own
# variable is set as well, kvferry's wins.
os.environ["SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"] = "1.5"
os.environ["SGLANG_FAILED_SESSION_PROBE_INTERVAL_S"] = "0.25"
os.environ["SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"] = "5"
os.environ["KVFERRY_HEARTBEAT_MISSES"] = "3"

import torch  # noqa: E402
from sglang.srt.managers.schedule_batch import FINISH_ABORT  # noqa: E402

import kvferry.sglang  # noqa: E402
import sglang_sched  # noqa: E402
from sglang_sched import PAGE, Pair  # noqa: E402

PROMPT = list(range(11, 21))  # 10 tokens: two whole pages and a partial one


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # These engines hold a cluster key (docs/security.md): SGLang's decode
    # queries the bootstrap service signed, and every kvferry surface
    # between them authenticates. The variable stays set while they run.
    key = tmp_path_factory.mktemp("key") / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    os.environ["KVFERRY_CLUSTER_KEY_FILE"] = str(key)
    # A node with a key keeps its KV private by default: these engines,
    # on one host, share their KV pool as told.
    os.environ["KVFERRY_SHARED_MEMORY"] = "1"
    try:
        p = Pair()
    finally:
        del os.environ["KVFERRY_SHARED_MEMORY"]
    yield p
    p.close()
    del os.environ["KVFERRY_CLUSTER_KEY_FILE"]


def check_moved(pair, rid, n_tokens, first_token):
    src, dst = pair.kv("P", rid, n_tokens), pair.kv("D", rid, n_tokens)
    for i, (a, b) in enumerate(zip(src, dst)):
        assert torch.equal(a, b), f"{'KV'[i % 2]} of layer {i // 2} differs"
    assert sum(t.numel() for t in src) > 0
    assert list(pair.reqs[("D", rid)].output_ids[:1]) == [first_token]


def test_sglangs_own_plugin_loading_makes_the_mooncake_backend_kvferrys(pair):
    prefill, decode = pair.managers()
    assert isinstance(prefill, kvferry.sglang.KvferryKVManager)
    assert isinstance(decode, kvferry.sglang.KvferryKVManager)
    assert type(pair.bootstrap) is kvferry.sglang.KvferryKVBootstrapServer
    assert sglang_sched.CUDA_SUBSTITUTIONS, "the substituted CUDA calls are named"


def test_the_keyed_bootstrap_service_refuses_an_unsigned_registration(pair):
    import json
    import urllib.error
    import urllib.request

    base = f"http://{pair.bootstrap.server.addr}"
    body = {"engine_id": "sglang", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://10.6.6.6:1"}
    forged = urllib.request.Request(f"{base}/register", data=json.dumps(body).encode(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(forged, timeout=5)
    assert refused.value.code == 401
    # Reads are open (routers ask unsigned); the forged address is not there.
    with urllib.request.urlopen(f"{base}/query?engine_id=sglang", timeout=5) as r:
        assert "10.6.6.6" not in r.read().decode()


def test_sglangs_scheduler_start_builds_no_mooncake_engine_for_kvferry(pair):
    # What SGLang's scheduler calls at start (distributed/bootstrap.py):
    # without kvferry's hook it builds Mooncake's TransferEngine for the
    # `mooncake` transfer backend, and without the mooncake package dies.
    from sglang.srt import runtime_context as rc
    from sglang.srt.distributed import bootstrap

    with rc.use_context(pair.P):
        assert bootstrap.maybe_init_shared_mooncake_transfer_engine(gpu_id=0) is None


def test_the_kv_pool_is_shared_by_the_vllm_connectors_rule(monkeypatch):
    """On a node that serves its own host only (no key), off where peers
    are on other hosts; ``KVFERRY_SHARED_MEMORY`` decides when set."""
    from kvferry.sglang import _shares_kv

    for var in ("KVFERRY_SHARED_MEMORY", "KVFERRY_CLUSTER_KEY_FILE", "KVFERRY_ALLOW_UNAUTHENTICATED_REMOTE"):
        monkeypatch.delenv(var, raising=False)
    assert _shares_kv({})
    assert not _shares_kv({"cluster_key_file": "/etc/kvferry/cluster.key"})
    assert not _shares_kv({"allow_unauthenticated_remote": True})
    monkeypatch.setenv("KVFERRY_ALLOW_UNAUTHENTICATED_REMOTE", "1")
    assert not _shares_kv({})
    monkeypatch.setenv("KVFERRY_SHARED_MEMORY", "1")
    assert _shares_kv({"cluster_key_file": "/etc/kvferry/cluster.key"})
    monkeypatch.setenv("KVFERRY_SHARED_MEMORY", "0")
    assert not _shares_kv({})


def test_a_request_moves_every_byte_through_sglangs_queues(pair):
    free_p, free_d = pair.ps.free(), pair.ds.free()
    copied = kvferry._native._shm_copied_bytes()
    pair.add("r1", PROMPT, room=101)
    assert pair.run_until(lambda: pair.prefill_ended("r1") and pair.decode_transferred("r1"))
    check_moved(pair, "r1", len(PROMPT), first_token=1000)
    # SGLang's own KV pool, moved onto shared files in place at
    # registration: the prefill side copied straight into decode's.
    assert kvferry._native._shm_copied_bytes() > copied, "not through shared memory"
    assert pair.ps.free()[1] == free_p[1], "prefill's metadata slot is back"
    pair.release_decode("r1")
    assert pair.ds.free()[1] == free_d[1], "decode's metadata slot is back"


def test_sglangs_transfer_metrics_report_each_requests_bytes_and_time(pair):
    """What SGLang's prefill scheduler turns into `kv_transfer_latency_ms`
    and `kv_transfer_speed_gb_s`: the pages' KV and the aux slot moved,
    timed from the first chunk to Success."""
    reporter = pair.ps.metrics_reporter
    reporter.kv_transfer_latency_ms = None
    pair.add("t1", PROMPT, room=111)
    assert pair.run_until(lambda: pair.prefill_ended("t1") and pair.decode_transferred("t1"))
    token_bytes = sum(t.numel() for t in pair.kv("P", "t1", len(PROMPT))) // len(PROMPT)
    pages = -(-len(PROMPT) // PAGE)
    prefill, _ = pair.managers()
    moved = pages * PAGE * token_bytes + sum(prefill.kv_args.aux_item_lens)
    assert pair.reqs[("P", "t1")].time_stats.transfer_total_mb * 2**20 == pytest.approx(moved)
    assert reporter.kv_transfer_latency_ms is not None and reporter.kv_transfer_latency_ms > 0
    assert reporter.kv_transfer_speed_gb_s > 0
    pair.release_decode("t1")


def test_several_requests_in_one_step(pair):
    rooms = {f"m{i}": 200 + i for i in range(3)}
    for i, (rid, room) in enumerate(rooms.items()):
        pair.add(rid, [7 + i] * (5 + 4 * i), room=room)
    assert pair.run_until(
        lambda: all(pair.prefill_ended(r) and pair.decode_transferred(r) for r in rooms)
    )
    for i, rid in enumerate(rooms):
        check_moved(pair, rid, 5 + 4 * i, first_token=1000 + i)
        pair.release_decode(rid)


def test_an_abort_on_prefill_before_its_kv_is_ready_ends_both_sides(pair):
    free_d = pair.ds.free()
    pair.add("pa", PROMPT, room=301)
    pair.abort_prefill("pa")
    assert pair.run_until(lambda: pair.prefill_ended("pa") and pair.decode_aborted("pa"))
    for side in ("P", "D"):
        assert isinstance(pair.reqs[(side, "pa")].finished_reason, FINISH_ABORT), side
    assert pair.ds.free() == free_d, "decode freed its pages and metadata slot"


def test_an_abort_on_decode_before_its_pages_are_allocated_ends_both_sides(pair):
    free_p, free_d = pair.ps.free(), pair.ds.free()
    pair.add("da", PROMPT, room=302)
    pair.abort_decode("da")
    assert pair.run_until(lambda: pair.decode_aborted("da"))
    assert pair.ds.free() == free_d
    # The prefill learns it at the latest when its bootstrap timeout ends.
    assert pair.run_until(lambda: pair.prefill_ended("da"), within_s=10)
    assert isinstance(pair.reqs[("P", "da")].finished_reason, FINISH_ABORT)
    assert pair.ps.free()[1] == free_p[1]


def test_an_abort_on_decode_between_init_and_its_metadata_ends_the_prefill_at_once(pair, monkeypatch):
    """The receiver knows the prefill engine (`init`) but has not named
    its pages (`send_metadata` held back, as while decode memory is
    short): an abort then still reaches the prefill, which ends the
    request and frees what it holds within a second, not at its bootstrap
    timeout (3 s here, 300 s by default)."""
    held = []
    monkeypatch.setattr(kvferry.sglang.KvferryKVReceiver, "send_metadata",
                        lambda self, *a, **k: held.append(self.room))
    free_p = pair.ps.free()
    pair.add("win", PROMPT, room=307)

    def in_window():
        queue = pair.ds.disagg_decode_transfer_queue.queue
        return 307 in held and any(d.req.rid == "win" and d.kv_receiver.handle for d in queue)
    assert pair.run_until(in_window, within_s=1.0)
    assert not pair.prefill_ended("win")
    pair.abort_decode("win")
    aborted = time.monotonic()
    assert pair.run_until(lambda: pair.prefill_ended("win"), within_s=1.0), "the prefill still holds it"
    assert time.monotonic() - aborted < 1.0
    assert isinstance(pair.reqs[("P", "win")].finished_reason, FINISH_ABORT)
    assert pair.run_until(lambda: pair.decode_aborted("win"))
    assert pair.ps.free() == free_p


def test_an_abort_on_decode_while_the_prefill_computes_ends_both_sides(pair):
    free_d = pair.ds.free()
    pair.hold_prefill = True
    try:
        pair.add("dt", PROMPT, room=303)
        assert pair.run_until(lambda: bool(pair.ds.disagg_decode_transfer_queue.queue))
        pair.abort_decode("dt")
    finally:
        pair.hold_prefill = False
    assert pair.run_until(lambda: pair.decode_aborted("dt") and pair.prefill_ended("dt"))
    assert pair.ds.free() == free_d


def test_an_abort_on_decode_that_the_transfer_overtook_still_ends_the_request(pair):
    """SGLang's abort branch for the transfer queue only aborts the
    receiver and counts on the request failing; here the last byte lands
    before the abort is made, as it may before the node applies one."""
    pair.hold_prefill = True
    try:
        pair.add("late", PROMPT, room=306)
        assert pair.run_until(lambda: bool(pair.ds.disagg_decode_transfer_queue.queue))
    finally:
        pair.hold_prefill = False
    (d,) = [d for d in pair.ds.disagg_decode_transfer_queue.queue if d.req.rid == "late"]
    receiver = d.kv_receiver
    deadline = time.monotonic() + 10
    while receiver.handle.poll() is not kvferry.Phase.Success and time.monotonic() < deadline:
        with sglang_sched.rc.use_context(pair.P):
            pair._prefill_step(0)
    assert receiver.handle.poll() is kvferry.Phase.Success
    pair.abort_decode("late")
    assert pair.run_until(lambda: pair.decode_aborted("late") and pair.prefill_ended("late"))


def test_a_prefill_that_never_answers_ends_the_request_at_sglangs_timeout(pair):
    free_d = pair.ds.free()
    pair.add("lost", PROMPT, room=304, prefill=False)
    assert pair.run_until(lambda: pair.decode_aborted("lost"), within_s=15)
    reason = pair.reqs[("D", "lost")].finished_reason
    assert isinstance(reason, FINISH_ABORT)
    assert pair.ds.free() == free_d


def test_settings_come_from_sglang_then_kvferry_variables(pair):
    prefill, decode = pair.managers()
    s = prefill.node.settings
    assert (s["role"], s["tp_size"], s["tp_rank"], s["dp_rank"], s["pp_size"]) == (
        "prefill", 1, 0, 0, 1,
    )
    assert s["bootstrap"] == f"127.0.0.1:{pair.port}"
    assert s["host"] == "127.0.0.1", "SGLANG_HOST_IP, as SGLang's own backends"
    assert s["listen"] is None, "with the cluster key it listens where it advertises"
    assert s["waiting_timeout_ms"] == 3000 and s["bootstrap_timeout_ms"] == 3000
    assert (s["heartbeat_interval_ms"], s["probe_interval_ms"]) == (1500, 250)
    assert s["heartbeat_misses"] == 3, "KVFERRY_HEARTBEAT_MISSES wins over SGLang's variable"
    assert decode.node.settings["role"] == "decode"


def test_prefill_ranks_across_nodes_register_at_the_dist_init_addr_host():
    # SGLang's own backends: with --dist-init-addr the bootstrap service is
    # on that node (rank 0's); a rank on another node cannot reach it at
    # its own --host (0.0.0.0 there means its own loopback).
    from types import SimpleNamespace

    at = kvferry.sglang._bootstrap_host
    assert at(SimpleNamespace(dist_init_addr="10.1.2.3:5000", host="0.0.0.0")) == "10.1.2.3"
    assert at(SimpleNamespace(dist_init_addr="[fd00::7]:5000", host="::")) == "[fd00::7]"
    assert at(SimpleNamespace(dist_init_addr="node0.cluster:5000", host="0.0.0.0")) == "node0.cluster"
    assert at(SimpleNamespace(dist_init_addr=None, host="0.0.0.0")) == "127.0.0.1"
    assert at(SimpleNamespace(dist_init_addr=None, host="10.1.2.4")) == "10.1.2.4"


def test_attention_context_parallelism_is_refused_by_name(pair, monkeypatch):
    from types import SimpleNamespace

    from sglang.srt import runtime_context as rc

    prefill, _ = pair.managers()
    with rc.use_context(pair.P):
        seen = rc.get_parallel()
        # This rank's parallel layout with its attention split in two by
        # context parallelism (`--attn-cp-size 2`).
        layout = SimpleNamespace(**{n: getattr(seen, n) for n in (
            "attn_tp_size", "attn_tp_rank", "pp_size", "pp_rank", "tp_size", "tp_rank")}, attn_cp_size=2)
        monkeypatch.setattr(rc, "get_parallel", lambda: layout)
        with pytest.raises(kvferry.MisuseError, match="--attn-cp-size 2"):
            kvferry.sglang.node_settings(prefill.kv_args, prefill.disaggregation_mode, prefill.server_args)


def test_the_node_runs_on_sglangs_device_and_fails_clearly_without_a_driver():
    from types import SimpleNamespace

    from sglang.srt.disaggregation.base.conn import KVArgs

    # SGLang's KVArgs, its gpu_id set as its decode and prefill queues do
    # (`kv_args.gpu_id = get_device().gpu_id`); `--device` from ServerArgs.
    args = KVArgs()
    args.gpu_id = 3
    assert kvferry.sglang._engine_device(args, SimpleNamespace(device="cuda")) == "cuda:3"
    assert kvferry.sglang._engine_device(args, SimpleNamespace(device=None)) == "cuda:3"
    assert kvferry.sglang._engine_device(args, SimpleNamespace(device="cpu")) == "cpu"
    npu = SimpleNamespace(device="npu")
    with pytest.raises(kvferry.MisuseError, match="CPU and CUDA"):
        kvferry.sglang._engine_device(args, npu)
    # This machine has no CUDA driver: a node for SGLang's GPU fails at
    # start, naming the device, instead of handing device pointers to tcp.
    with pytest.raises(kvferry.MisuseError, match="cuda:3"):
        kvferry.Node(role="decode", engine_id="e", device="cuda:3")


@pytest.fixture(scope="module")
def radix_pair(pair):
    p = Pair(decode={"disaggregation_decode_enable_radix_cache": True})
    yield p
    p.close()


def test_a_decode_side_prefix_hit_takes_only_the_tail(radix_pair):
    pair = radix_pair
    sent = []
    receiver = kvferry.sglang.KvferryKVReceiver
    original = receiver.send_metadata

    def spy(self, *a, **k):
        sent.append(k.get("decode_prefix_len"))
        return original(self, *a, **k)

    receiver.send_metadata = spy
    try:
        pair.add("first", PROMPT, room=401)
        assert pair.run_until(lambda: pair.decode_transferred("first"))
        pair.release_decode("first")  # its pages go into decode's radix cache
        longer = PROMPT[: 2 * PAGE] + list(range(50, 58))
        pair.add("second", longer, room=402)
        assert pair.run_until(lambda: pair.decode_transferred("second"))
    finally:
        receiver.send_metadata = original
    assert sent[-1] == 2 * PAGE, f"decode reused two pages, not {sent[-1]} tokens"
    check_moved(pair, "second", len(longer), first_token=1000)


def run_processes(runs: "dict[str, list]", prefixes: "dict[str, list] | None" = None,
                  env: "dict[str, str] | None" = None) -> "dict[str, str]":
    """Runs `python sglang_sched.py ARGS...` once per named argument list,
    all at once (behind `prefixes[name]`, such as another host's
    `ip netns exec`, with `env` added); each must exit 0. Their outputs by
    name."""
    procs = {
        name: subprocess.Popen([*(prefixes or {}).get(name, []), sys.executable, sglang_sched.__file__,
                                *map(str, args)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, **(env or {})})
        for name, args in runs.items()
    }
    outs = {}
    try:
        for name, p in procs.items():
            outs[name] = p.communicate(timeout=180)[0]
    finally:
        for p in procs.values():
            p.kill()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} exited {p.returncode}:\n{outs[name][-3000:]}"
    return outs


def test_dp_attention_pairs_by_attention_tp_and_dp_rank():
    """Two processes, a world of two ranks on gloo: each is DP rank r of a
    prefill and a decode engine with TP 2, DP 2 and DP attention
    (attention TP 1), and moves a request SGLang's decode sends to prefill
    DP rank r."""
    rendezvous, port = sglang_sched.free_port(), sglang_sched.free_port()
    outs = run_processes({f"rank {r}": ["dp", r, rendezvous, port] for r in (0, 1)})
    for r in (0, 1):
        out = outs[f"rank {r}"]
        assert f"rank {r}:" in out and "bytes moved" in out, out[-3000:]


def test_a_prefill_engine_with_two_stages_feeds_a_decode_engine_without():
    """Three processes: the two pipeline stages of a prefill engine (a
    world of two ranks on gloo, SGLang's PP bootstrap and release
    consensus between them) and a decode engine without stages, which
    takes each stage's layers and the aux from the last stage."""
    rendezvous, port = sglang_sched.free_port(), sglang_sched.free_port()
    runs = {f"prefill stage {r}": ["pp-prefill", r, rendezvous, port] for r in (0, 1)}
    outs = run_processes({**runs, "decode": ["pp-decode", port]})
    assert "stage 0: layers 0..2 sent" in outs["prefill stage 0"]
    assert "stage 1: layers 2..4 sent" in outs["prefill stage 1"]
    assert "decode: 4 layers matched" in outs["decode"], outs["decode"][-3000:]


def test_a_prefill_engine_across_two_nodes_feeds_a_decode_engine_on_a_third(tmp_path):
    """Three hosts (network namespaces, a cluster key): the two pipeline
    stages of a prefill engine on nodes `p` and `q`, launched as SGLang
    launches across nodes (`--host 0.0.0.0`, `--dist-init-addr` on `p`),
    and a decode engine on `d`. Node `q`'s ranks register at the bootstrap
    service on `p`, where the decode finds them, and every layer moves."""
    from hosts import Hosts, require_hosts

    require_hosts()
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    rendezvous, port = sglang_sched.free_port(), sglang_sched.free_port()
    with Hosts(["p", "q", "d"]) as h:
        node0 = h.addr("p")
        runs = {f"node {r}": ["node-prefill", r, node0, rendezvous, port] for r in (0, 1)}
        runs["decode"] = ["pp-decode", port, node0]
        # The network namespace alone: `ip netns exec` also remounts /sys,
        # where SGLang sizes its host memory from the cgroup.
        on = {n: ["nsenter", f"--net=/var/run/netns/{h.netns(n)}"] for n in ("p", "q", "d")}
        prefixes = {"node 0": on["p"], "node 1": on["q"], "decode": on["d"]}
        # gloo finds each rank's address on the interface named here; each
        # node's address is found as SGLang finds it (no SGLANG_HOST_IP).
        env = {"KVFERRY_CLUSTER_KEY_FILE": str(key), "GLOO_SOCKET_IFNAME": "eth0", "SGLANG_HOST_IP": ""}
        outs = run_processes(runs, prefixes, env)
    assert "node 0: layers 0..2 sent" in outs["node 0"]
    assert "node 1: layers 2..4 sent" in outs["node 1"]
    assert "decode: 4 layers matched" in outs["decode"], outs["decode"][-3000:]


def test_prefill_and_decode_engines_with_two_stages_pair_stage_to_stage():
    """Two processes, a world of two ranks on gloo: stage r of a prefill
    and of a decode engine with two pipeline stages each, SGLang's PP
    consensus on both sides; each decode stage takes its layers and the
    first token from the prefill stage of its rank."""
    rendezvous, port = sglang_sched.free_port(), sglang_sched.free_port()
    outs = run_processes({f"stage {r}": ["pp-pair", r, rendezvous, port] for r in (0, 1)})
    assert "stage 0: layers 0..2 matched" in outs["stage 0"]
    assert "stage 1: layers 2..4 matched" in outs["stage 1"]
