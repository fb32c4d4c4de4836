"""Real SGLang 0.5.23 servers on the CPU, a prefill and a decode with
kvferry moving the KV (``KVFERRY_SGLANG=1``,
``--disaggregation-transfer-backend mooncake``), against one plain server:
greedy outputs equal, SGLang's own KV checksum equal on both sides, a
decode request the prefill never sees fails instead of being computed, and
a dead prefill fails decode's requests while decode serves on.

Not in the test command: SGLang's CPU engine imports ``sgl_kernel``'s CPU
ops, and PyPI has only CUDA builds of it, so the servers run with
``sglang_cpu/`` on their ``PYTHONPATH``: a pure-torch stand-in for the two
ops SGLang imports (``sgl_kernel``) and a CPU stand-in for SGLang's CUDA
KV-checksum kernel (``kvferry_e2e_shim``, an SGLang plugin). Run it with
``KVFERRY_SGLANG_SERVERS=1`` in SGLang's environment (about 100 s)::

    KVFERRY_SGLANG_SERVERS=1 target/sglang-venv/bin/python -m pytest -q -s \
        python/tests/test_sglang_servers.py

Three ``python -m sglang.launch_server --device cpu`` processes, bound to
127.0.0.1, each under an 8 GiB address-space limit and ``timeout``. The
router is ``pd_generate``: what SGLang's router does for a P/D pair (one
random ``bootstrap_room``, the same request to both servers at once, the
decode's answer). Two SGLang CPU limits are worked around in the servers'
arguments (named where they are passed).

Knobs: ``KVFERRY_E2E_EXTRA_ARGS`` (more ``launch_server`` arguments for all
three), ``KVFERRY_E2E_DECODE_ARGS`` (for the decode server only),
``KVFERRY_E2E_LOGDIR`` (keep the servers' logs), ``KVFERRY_E2E_NO_CHECKSUM=1``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import re
import resource
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

if os.environ.get("KVFERRY_SGLANG_SERVERS") != "1":
    pytest.skip("real SGLang servers: KVFERRY_SGLANG_SERVERS=1", allow_module_level=True)
pytest.importorskip("sglang")

from engines import free_port, make_model  # noqa: E402

HERE = Path(__file__).resolve().parent
SHIM = HERE / "sglang_cpu"
REPO = HERE.parents[1]
MODEL = Path(os.environ.get("KVFERRY_SGLANG_MODEL", REPO / "target" / "bench-model"))
PYTHON = os.environ.get("KVFERRY_SGLANG_PYTHON", sys.executable)

#: Each server's address-space limit, and how long any server may live.
AS_LIMIT = 8 << 30
SERVER_LIFETIME_S = 900
START_TIMEOUT_S = 240
#: SGLang's transfer timeouts on both sides (kvferry takes them as its node's
#: bootstrap and waiting timeouts), short so the failure checks end soon.
TRANSFER_TIMEOUT_S = 20

PROMPTS = [
    [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [5, 900, 33, 2047, 77, 1234, 4000, 8],
    [100, 200, 300, 400, 500, 600],
    [3000, 17, 29, 3610, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
]
MAX_NEW_TOKENS = 8

TIMES: dict = {}

#: KVFERRY_E2E_NO_CHECKSUM=1: without SGLang's KV checksum (with the decode
#: radix cache on, kvferry's sender does not tell SGLang's prefill the
#: decode's prefix, so the two sides digest different ranges).
NO_CHECKSUM = os.environ.get("KVFERRY_E2E_NO_CHECKSUM", "") == "1"


def _post(url: str, body: dict, timeout: float = 120.0) -> "tuple[int, dict | str]":
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (OSError, urllib.error.URLError) as e:  # refused, reset, timed out
        return 0, f"{type(e).__name__}: {e}"


def _limits() -> None:
    os.setsid()
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


class Server:
    def __init__(self, name: str, logdir: Path, args: list, env: dict):
        self.name, self.port, self.log = name, free_port(), logdir / f"{name}.log"
        cmd = [
            "timeout", str(SERVER_LIFETIME_S), "nice", "-n", "10",
            PYTHON, "-m", "sglang.launch_server",
            "--model-path", str(MODEL), "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--nccl-port", str(free_port()),
            "--tp", "1", "--dtype", "float32",
            "--max-total-tokens", "4096", "--max-running-requests", "4",
        ] + shlex.split(os.environ.get("KVFERRY_E2E_EXTRA_ARGS", "")) + args
        full_env = dict(os.environ)
        for k in [k for k in full_env if k.startswith(("KVFERRY_", "SGLANG_"))]:
            del full_env[k]
        full_env.update(
            SGLANG_USE_CPU_ENGINE="1",
            SGLANG_HOST_IP="127.0.0.1",
            SGLANG_CPU_OMP_THREADS_BIND="0-1",
            OMP_NUM_THREADS="1",
            PYTHONUNBUFFERED="1",
            PYTHONPATH=str(SHIM),
        )
        full_env.update(env)
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=full_env, stdout=open(self.log, "wb"),
            stderr=subprocess.STDOUT, preexec_fn=_limits,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> float:
        deadline = self.t0 + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - self.t0
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1)
        pytest.fail(f"{self.name} server not ready in {START_TIMEOUT_S}s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        keep = [l for l in lines if "Ignore import error" not in l and "server_args=" not in l]
        return "\n".join(keep[-n:])

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    if not MODEL.exists():
        make_model(MODEL)
    logdir = Path(os.environ.get("KVFERRY_E2E_LOGDIR") or tmp_path_factory.mktemp("sglang_e2e"))
    logdir.mkdir(parents=True, exist_ok=True)
    bootstrap_port = free_port()
    pd_env = dict(
        KVFERRY_SGLANG="1",
        SGLANG_PLUGINS="kvferry,kvferry_e2e",  # kvferry's, and the checksum stand-in
        KVFERRY_LOG="info",
        SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=str(TRANSFER_TIMEOUT_S),
        SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(TRANSFER_TIMEOUT_S),
    )
    pd_args = [
        "--disaggregation-transfer-backend", "mooncake",
        "--disaggregation-bootstrap-port", str(bootstrap_port),
        "--enable-metrics",
    ] + ([] if NO_CHECKSUM else ["--disaggregation-enable-kv-checksum"])
    started = []
    t0 = time.monotonic()
    try:
        plain = Server("plain", logdir, [], {})
        started.append(plain)
        prefill = Server(
            "prefill",
            logdir,
            # Under the overlap scheduler a prefix hit's early send records a
            # CUDA event (disaggregation/prefill.py L1495-1497
            # maybe_send_cached_prefix_chunk): "expected stream to be a
            # torch.Stream or torch.cuda.Stream object" on the CPU.
            ["--disaggregation-mode", "prefill", "--disable-overlap-schedule"] + pd_args,
            pd_env,
        )
        started.append(prefill)
        decode = Server(
            "decode",
            logdir,
            # The default retraction backup pins a host pool with cudaHostRegister.
            ["--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup", "cpu_tensor"]
            + pd_args
            + shlex.split(os.environ.get("KVFERRY_E2E_DECODE_ARGS", "")),
            pd_env,
        )
        started.append(decode)
        for s in started:
            TIMES[f"ready_{s.name}_s"] = round(s.wait_ready(), 1)
        TIMES["all_ready_s"] = round(time.monotonic() - t0, 1)
        print(f"\nlogs in {logdir}; startup {TIMES}")
        yield dict(plain=plain, prefill=prefill, decode=decode, bootstrap_port=bootstrap_port)
    finally:
        for s in started:
            s.stop()
        print(f"\ntimes: {TIMES}")


def _body(ids: list) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}}


def plain_generate(srv, ids) -> list:
    status, out = _post(srv["plain"].url + "/generate", _body(ids))
    assert status == 200, out
    return out["output_ids"]


def pd_generate(srv, ids, room=None, to_prefill=True, timeout=120.0):
    """A router's P/D request: the same body, with the prefill's bootstrap
    address and one room, to both servers at once; the decode's answer."""
    body = _body(ids)
    body.update(
        bootstrap_host="127.0.0.1",
        bootstrap_port=srv["bootstrap_port"],
        bootstrap_room=random.getrandbits(63) if room is None else room,
    )
    with cf.ThreadPoolExecutor(2) as ex:
        p = ex.submit(_post, srv["prefill"].url + "/generate", body, timeout) if to_prefill else None
        d = ex.submit(_post, srv["decode"].url + "/generate", body, timeout)
        decoded = d.result()
        prefilled = p.result() if p else None
    return decoded, prefilled


def test_pd_outputs_equal_plain(servers):
    t = time.monotonic()
    want = [plain_generate(servers, ids) for ids in PROMPTS]
    TIMES["plain_4_serial_s"] = round(time.monotonic() - t, 2)
    assert all(len(w) == MAX_NEW_TOKENS for w in want)

    t = time.monotonic()
    got = []
    for ids in PROMPTS:
        (status, out), (pstatus, pout) = pd_generate(servers, ids)
        assert status == 200, f"decode: {out}\n{servers['decode'].tail()}"
        assert pstatus == 200, f"prefill: {pout}\n{servers['prefill'].tail()}"
        got.append(out["output_ids"])
    TIMES["pd_4_serial_s"] = round(time.monotonic() - t, 2)
    assert got == want

    # Concurrently: several requests in the queues at once.
    t = time.monotonic()
    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
        res = list(ex.map(lambda ids: pd_generate(servers, ids), PROMPTS))
    TIMES["pd_4_concurrent_s"] = round(time.monotonic() - t, 2)
    for (status, out), _ in res:
        assert status == 200, out
    assert [out["output_ids"] for (_, out), _ in res] == want


DIGEST = re.compile(r"kvferry_e2e kv checksum: (\d+) pages x (\d+) buffers \((\d+) items\) -> (0x[0-9a-f]+)")


@pytest.mark.skipif(NO_CHECKSUM, reason="KVFERRY_E2E_NO_CHECKSUM=1")
def test_kv_checksums_equal_on_both_sides(servers):
    # SGLang's own check: decode compares the prefill's digest (through the
    # aux buffers kvferry moved) with its digest of the KV kvferry wrote.
    (status, out), _ = pd_generate(servers, PROMPTS[1])
    assert status == 200, out
    time.sleep(1)
    pre = DIGEST.findall(servers["prefill"].text())
    dec = DIGEST.findall(servers["decode"].text())
    assert "KV checksum mismatch" not in servers["decode"].text()
    assert "kv checksum skipped" not in servers["decode"].text().lower()
    # Every P/D request so far: 4 + 4 + 1, each digested on both sides.
    assert len(dec) >= 2 * len(PROMPTS) + 1, servers["decode"].tail()
    assert {d[3] for d in dec} <= {p[3] for p in pre}
    # Non-trivial: the pages are the prompt's tokens, in all 2 x layers buffers.
    assert all(int(pages) > 0 and int(items) == int(pages) * int(bufs) for pages, bufs, items, _ in dec)


def _failed(status, out) -> bool:
    if status != 200:
        return True
    fr = (out.get("meta_info") or {}).get("finish_reason") or {}
    return fr.get("type") == "abort" or len(out.get("output_ids") or []) < MAX_NEW_TOKENS


def test_decode_alone_does_not_compute(servers):
    # The prefill never sees this room: decode must not produce tokens.
    t = time.monotonic()
    (status, out), _ = pd_generate(servers, PROMPTS[2], to_prefill=False, timeout=TRANSFER_TIMEOUT_S * 6)
    TIMES["decode_alone_fail_s"] = round(time.monotonic() - t, 1)
    assert _failed(status, out), out
    # And the pair still serves afterwards.
    (status, out), _ = pd_generate(servers, PROMPTS[0])
    assert status == 200 and len(out["output_ids"]) == MAX_NEW_TOKENS, out


def test_prefill_killed_decode_fails(servers):
    servers["prefill"].stop()
    t = time.monotonic()
    (status, out), (pstatus, _) = pd_generate(servers, PROMPTS[3], timeout=TRANSFER_TIMEOUT_S * 6)
    TIMES["prefill_dead_fail_s"] = round(time.monotonic() - t, 1)
    assert pstatus != 200
    assert _failed(status, out), out
    assert servers["decode"].proc.poll() is None, servers["decode"].tail()
