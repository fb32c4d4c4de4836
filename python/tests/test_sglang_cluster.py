"""SGLang engines on separate hosts behind SGLang's own router: real SGLang
0.5.23 servers on the CPU, a prefill on host ``p`` and a decode on host
``d`` (network namespaces, ``hosts.Hosts``, links at 1 Gbit/s), the stock
``sglang-router`` (0.3.2) and smg (1.13) on host ``r``, and a plain server
on ``r`` for the reference outputs.

The engines run kvferry as an operator switches to it: ``KVFERRY_SGLANG=1``
and ``--disaggregation-transfer-backend mooncake``, the cluster key in
``KVFERRY_CLUSTER_KEY_FILE``, nothing else (no ``SGLANG_HOST_IP``, no
kvferry setting; the prefill's bootstrap port is SGLang's default). The
routers send each request to both engines at once with a random 63-bit
``bootstrap_room`` and the prefill URL's host as ``bootstrap_host``;
``sglang-router``, given no bootstrap port, sends ``bootstrap_port`` null,
and smg, given SGLang's default, first probes it with a bare TCP
connection. Greedy outputs must equal the plain server's.

SGLang's CPU engine imports ``sgl_kernel``'s CPU ops, which PyPI has only
in CUDA builds: the servers run with ``sglang_cpu/`` on their
``PYTHONPATH``, as in ``test_sglang_servers.py``. Needs root for the
namespaces (``KVFERRY_SKIP_HOSTS=1`` skips where they cannot be made).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("sglang")

from engines import make_model, random_prompt  # noqa: E402
from hosts import Hosts, require_hosts  # noqa: E402

HERE = Path(__file__).resolve().parent
SHIM = HERE / "sglang_cpu"
PYTHON = os.environ.get("KVFERRY_SGLANG_PYTHON", sys.executable)
PORT, ROUTER_PORT, SMG_PORT = 30000, 30300, 30301
#: SGLang's default bootstrap port, which the prefill engine serves.
BOOTSTRAP_PORT = 8998
#: Each server's address-space limit, and how long any server may live.
AS_LIMIT = 8 << 30
LIFETIME_S = 900
START_TIMEOUT_S = 300
MAX_NEW_TOKENS = 8
LENGTHS = (11, 64, 200, 600)


def _limits() -> None:
    os.setsid()
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def _post(url: str, body: Any, timeout: float = 120.0) -> "tuple[int, Any]":
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


class Proc:
    """A process on one of the hosts, its output in a log file."""

    def __init__(self, hosts: Hosts, host: str, name: str, cmd: "list[str]", env: "dict[str, str]",
                 logdir: Path, port: int):
        self.name, self.log = name, logdir / f"{name}.log"
        self.url = f"http://{hosts.addr(host)}:{port}"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFERRY_", "SGLANG_"))}
        full_env.update(env)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [*hosts.prefix(host), "timeout", str(LIFETIME_S), *cmd], env=full_env,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=_limits,
            )

    def wait(self, path: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1)
        pytest.fail(f"{self.name} not serving in {timeout_s} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        lines = self.log.read_text(errors="replace").splitlines()
        return "\n".join(ln for ln in lines[-n:] if "server_args=" not in ln)

    def stop(self) -> None:
        import signal

        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=20)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


def sglang_server(hosts: Hosts, host: str, name: str, args: "list[str]", env: "dict[str, str]",
                  logdir: Path, model: str, cores: str) -> Proc:
    cmd = [
        PYTHON, "-m", "sglang.launch_server", "--model-path", model, "--device", "cpu",
        "--host", hosts.addr(host), "--port", str(PORT), "--tp", "1", "--dtype", "float32",
        "--max-total-tokens", "4096", "--max-running-requests", "4", *args,
    ]
    env = {
        "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": cores, "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(SHIM), **env,
    }
    return Proc(hosts, host, name, cmd, env, logdir, PORT)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator["dict[str, Proc]"]:
    require_hosts()
    model = make_model(os.environ.get("KVFERRY_SGLANG_MODEL") or tmp_path_factory.mktemp("model"))
    logdir = tmp_path_factory.mktemp("sglang_cluster")
    key = logdir / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    # What an operator adds to switch a Mooncake deployment to kvferry.
    pd_env = {"KVFERRY_SGLANG": "1", "KVFERRY_CLUSTER_KEY_FILE": str(key)}
    pd = ["--disaggregation-transfer-backend", "mooncake"]
    started: "list[Proc]" = []
    with Hosts(["p", "d", "r"]) as hosts:
        hosts.rate("p", "1gbit")
        hosts.rate("d", "1gbit")
        try:
            started.append(sglang_server(hosts, "r", "plain", [], {}, logdir, model, "0-1"))
            # CPU limits of SGLang 0.5.23, as in test_sglang_servers.py: the
            # overlap scheduler's early send records a CUDA event, and the
            # decode's default retraction backup pins host memory with CUDA.
            started.append(sglang_server(
                hosts, "p", "prefill", ["--disaggregation-mode", "prefill", "--disable-overlap-schedule", *pd],
                pd_env, logdir, model, "0"))
            started.append(sglang_server(
                hosts, "d", "decode",
                ["--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup", "cpu_tensor", *pd],
                pd_env, logdir, model, "1"))
            for s in started:
                s.wait("/health")
            prefill, decode = started[1], started[2]
            router = Proc(hosts, "r", "router", [
                PYTHON, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", prefill.url, "--decode", decode.url,
                "--host", hosts.addr("r"), "--port", str(ROUTER_PORT),
                "--prometheus-host", hosts.addr("r"), "--prometheus-port", str(ROUTER_PORT + 20000),
            ], {}, logdir, ROUTER_PORT)
            started.append(router)
            smg = Proc(hosts, "r", "smg", [
                str(Path(PYTHON).parent / "smg"), "launch", "--pd-disaggregation",
                "--prefill", prefill.url, str(BOOTSTRAP_PORT), "--decode", decode.url,
                "--host", hosts.addr("r"), "--port", str(SMG_PORT),
                "--prometheus-host", hosts.addr("r"), "--prometheus-port", str(SMG_PORT + 20000),
                "--worker-startup-check-interval", "1",
            ], {}, logdir, SMG_PORT)
            started.append(smg)
            # Ready: serving, with a healthy prefill and decode worker.
            router.wait("/readiness", 120)
            smg.wait("/readiness", 120)
            yield {s.name: s for s in started}
        finally:
            for s in started:
                s.stop()


def generate(server: Proc, ids: "list[int]") -> "list[int]":
    status, out = _post(server.url + "/generate", {
        "input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0},
    })
    assert status == 200, f"{server.name}: {out}"
    return list(out["output_ids"])


@pytest.mark.parametrize("router", ["router", "smg"])
def test_zero_config_with_a_key_behind_the_routers(cluster: "dict[str, Proc]", router: str) -> None:
    seed = {"router": 3000, "smg": 3500}[router]  # fresh prompts: no prefix-cache hit
    prompts = {n: random_prompt(n, seed=seed + n) for n in LENGTHS}
    want = {n: generate(cluster["plain"], ids) for n, ids in prompts.items()}
    got = {n: generate(cluster[router], ids) for n, ids in prompts.items()}
    # An SGLang decode engine never computes a prompt itself: its output
    # comes from the KV the prefill engine moved, or the request fails.
    assert got == want, cluster["decode"].tail()
