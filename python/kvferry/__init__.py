"""kvferry moves the KV cache of LLM requests from a prefill engine to a
decode engine (disaggregated serving).

A :class:`Node` is one prefill, decode or both-ways rank. Register the
engine's KV cache with :meth:`Node.register_kv_caches`, then open a
:class:`Sender` (prefill) or :class:`Receiver` (decode) per request::

    with kvferry.Node(role="prefill", engine_id="p") as p, \\
         kvferry.Node(role="decode", engine_id="d") as d:
        p.register_kv_caches([k0, v0], layout="hnd", total_kv_heads=8,
                             block_tokens=16, head_bytes=256)
        d.register_kv_caches([k1, v1], layout="hnd", total_kv_heads=8,
                             block_tokens=16, head_bytes=256)
        rx = d.receiver("req-1", side_channels=[p.side_channel_addr])
        rx.request([3, 4])
        p.sender("req-1").send([0, 1])
        assert rx.wait(5.0) is kvferry.Phase.Success

Every call that waits releases the GIL; ``wait`` returns on Ctrl-C with
``KeyboardInterrupt``. Errors are :class:`Error` subclasses that say whose
fault they are: :class:`MisuseError` (the caller), :class:`PeerError`,
:class:`TransportError`, :class:`TimeoutError`, :class:`BusyError`.
"""

from __future__ import annotations

import atexit
import ctypes
import enum
import json
import logging
import os
import threading
from typing import Any, Iterable, Optional, Sequence, Union

from . import _native
from ._native import (
    REQUEST_ID_MAX_BYTES,
    STORE_URLS,
    BootstrapServer,
    BusyError,
    Error,
    LoadMeta,
    MisuseError,
    ParamsError,
    PeerError,
    TimeoutError,
    TransportError,
)

__all__ = [
    "Node",
    "Sender",
    "Receiver",
    "Phase",
    "Scheduler",
    "LoadMeta",
    "BootstrapServer",
    "Error",
    "ParamsError",
    "MisuseError",
    "PeerError",
    "TransportError",
    "TimeoutError",
    "BusyError",
    "REQUEST_ID_MAX_BYTES",
    "STORE_URLS",
]

_log_pump_pid: Optional[int] = None
_log_pump: Optional[threading.Thread] = None
_log_stop = threading.Event()


def _pump_logs() -> None:
    """Hands kvferry's `tracing` events (filtered by ``KVFERRY_LOG``,
    ``warn`` by default) to the ``kvferry.*`` loggers of Python's
    ``logging``: ``kvferry::node::bridge`` logs as ``kvferry.node.bridge``."""
    dropped_before = 0
    while not _log_stop.is_set():
        records, dropped = _native._next_logs(1.0)
        for level, target, message in records:
            if level:  # 0: the wake-up of `_stop_log_pump`
                logging.getLogger(target.replace("::", ".")).log(level, "%s", message)
        if dropped > dropped_before:
            logging.getLogger("kvferry").warning(
                "%d kvferry log records dropped: Python took them too slowly",
                dropped - dropped_before,
            )
            dropped_before = dropped


def _ensure_log_pump() -> None:
    """Starts the log thread of this process (again in a forked child)."""
    global _log_pump_pid, _log_pump
    if _log_pump_pid != os.getpid():
        _log_pump_pid = os.getpid()
        _log_pump = threading.Thread(target=_pump_logs, name="kvferry-logs", daemon=True)
        _log_pump.start()


@atexit.register
def _stop_log_pump() -> None:
    # Before the interpreter finalizes: a daemon thread it ends inside a
    # native call would abort the process.
    _log_stop.set()
    _native._wake_logs()
    if _log_pump is not None and _log_pump_pid == os.getpid():
        _log_pump.join(5.0)


_ensure_log_pump()

TransferRef = Union[int, str]
BlockIds = Union[Sequence[int], Sequence[Sequence[int]]]


class Phase(enum.Enum):
    """Where a transfer is; the names of the Rust phases."""

    Bootstrapping = "Bootstrapping"
    WaitingForInput = "WaitingForInput"
    Transferring = "Transferring"
    Success = "Success"
    Failed = "Failed"
    Expired = "Expired"

    @property
    def is_terminal(self) -> bool:
        """True once the transfer ended: its blocks are the engine's again."""
        return self in (Phase.Success, Phase.Failed, Phase.Expired)


class _Handle:
    """What a sender and a receiver share: phase, wait, abort."""

    def __init__(self, node: "Node", native: Any, transfer_id: TransferRef) -> None:
        # The node (and with it the registered memory) lives as long as
        # any handle of its transfers.
        self._node = node
        self._native = native
        self.transfer_id = transfer_id
        #: Why the transfer failed (``"PeerAborted"``, ``"Aborted(Engine)"``
        #: ...) as of the last :meth:`poll` or :meth:`wait`; ``None`` unless
        #: that phase was :attr:`Phase.Failed`.
        self.failure: Optional[str] = None

    def _phase(self, pair: "tuple[str, Optional[str]]") -> Phase:
        name, self.failure = pair
        return Phase(name)

    def poll(self) -> Phase:
        """The current phase, without waiting."""
        return self._phase(self._native.poll())

    def wait(self, timeout_s: float) -> Phase:
        """Waits up to ``timeout_s`` seconds for a terminal phase and
        returns the phase then (terminal or not)."""
        return self._phase(self._native.wait(float(timeout_s)))

    def abort(self) -> None:
        """Aborts the transfer; it turns terminal once no peer can touch
        its blocks any more."""
        self._native.abort()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.transfer_id!r})"


class Sender(_Handle):
    """The prefill side of one transfer (SGLang's ``KVSender``)."""

    def send(self, block_ids: BlockIds, is_last: bool = True) -> None:
        """Hands the KV in ``block_ids`` (a list of ids, or one list per
        KV-cache group) to the transfer; ``is_last`` on the last chunk."""
        self._native.send(block_ids, is_last)


class Receiver(_Handle):
    """The decode side of one transfer (SGLang's ``KVReceiver``)."""

    def request(
        self, block_ids: BlockIds, prefix_blocks: Optional[Sequence[int]] = None
    ) -> None:
        """Asks the prefill ranks for the KV, into ``block_ids`` (a list of
        ids, or one list per group). ``prefix_blocks``: per group, how many
        of the prefill side's leading blocks this rank holds already."""
        self._native.request(block_ids, prefix_blocks)


def tensor_device(t: Any) -> str:
    """A torch tensor's device as node settings name it: ``cpu`` or
    ``cuda:N``; anything else (``meta``, another accelerator) as torch
    names it."""
    dev: Any = getattr(t, "device", None)
    kind = getattr(dev, "type", "cpu")
    if kind == "cuda":
        index = dev.index
        if index is None:
            import torch

            index = torch.cuda.current_device()
        return f"cuda:{index}"
    return str(kind)


def check_device(t: Any, node_device: str) -> None:
    """Refuses a tensor in memory the node was not started for: device
    memory is registered as such only with the node's ``device`` setting
    naming that device, and moves only with transports that move it."""
    have = tensor_device(t)
    if have == node_device:
        return
    if have == "cpu" or have.startswith("cuda:"):
        raise MisuseError(
            f"a KV tensor is in {have} memory but the node runs with device={node_device!r}: "
            f"start it with device={have!r} (the vLLM connectors and the SGLang backend "
            "take it from the engine)"
        )
    raise MisuseError(f"{have} tensors cannot be registered: kvferry moves CPU and CUDA memory")


def _tensor_region(t: Any, node_device: str = "cpu") -> "tuple[int, int, int, Any]":
    """``(address, nbytes, blocks, keepalive)`` of a tensor whose leading
    dimension is the block: a torch tensor on the host or on the node's
    device, or any writable, C-contiguous buffer (numpy arrays among
    them)."""
    if hasattr(t, "data_ptr") and hasattr(t, "element_size"):
        check_device(t, node_device)
        if not t.is_contiguous():
            raise MisuseError("a KV tensor must be contiguous")
        return t.data_ptr(), t.numel() * t.element_size(), int(t.shape[0]), t
    try:
        view = memoryview(t)
    except TypeError:
        raise TypeError(
            f"a KV tensor is a CPU torch tensor or a writable buffer, not {type(t).__name__}"
        ) from None
    if view.readonly or not view.c_contiguous:
        raise MisuseError("a KV buffer must be writable and C-contiguous")
    if view.ndim == 0 or view.nbytes == 0:
        raise MisuseError("a KV buffer needs a leading block dimension and bytes")
    # Holding the ctypes view keeps the buffer exported (and alive) for as
    # long as the node may touch it.
    anchor = (ctypes.c_char * view.nbytes).from_buffer(view)
    # A view's len is its leading dimension.
    return ctypes.addressof(anchor), view.nbytes, len(view), (t, view, anchor)


class Scheduler:
    """The scheduler half of a vLLM connector: what each request needs
    loaded or sent, handed to the worker's :meth:`Node.start_load_kv` once
    per step. Pure bookkeeping, no IO. ``kv_role`` is vLLM's
    (``"kv_producer"``, ``"kv_consumer"``, ``"kv_both"``); ``params`` are a
    request's ``kv_transfer_params`` as the router sent them."""

    def __init__(
        self,
        kv_role: str,
        engine_id: str,
        bootstrap_addr: str = "",
        block_size: int = 16,
        *,
        dp_rank: int = 0,
        window_tokens: Optional[Sequence[int]] = None,
        max_tracked_requests: Optional[int] = None,
    ) -> None:
        self._native = _native.Scheduler(
            kv_role,
            engine_id,
            bootstrap_addr,
            block_size,
            dp_rank,
            None if window_tokens is None else list(window_tokens),
            max_tracked_requests,
        )

    @staticmethod
    def _json(params: "Optional[dict[str, Any]]") -> Optional[str]:
        return None if params is None else json.dumps(params)

    def get_num_new_matched_tokens(
        self,
        request_id: str,
        prompt_len: int,
        computed_len: int,
        params: "Optional[dict[str, Any]]",
    ) -> "tuple[int, bool]":
        """``(tokens the remote prefill provides, loaded asynchronously)``."""
        return self._native.get_num_new_matched_tokens(
            request_id, prompt_len, computed_len, self._json(params)
        )

    def update_state_after_alloc(
        self,
        request_id: str,
        prompt_len: int,
        computed_len: int,
        block_ids: BlockIds,
        params: "Optional[dict[str, Any]]",
        num_external_tokens: int,
    ) -> None:
        """Records what the request's blocks (per group, token order) need."""
        self._native.update_state_after_alloc(
            request_id, prompt_len, computed_len, block_ids, self._json(params), num_external_tokens
        )

    def request_finished(
        self,
        request_id: str,
        prompt_len: int,
        computed_len: int,
        block_ids: BlockIds,
        params: "Optional[dict[str, Any]]",
        status: str,
    ) -> "tuple[bool, Optional[dict[str, Any]]]":
        """``(keep the blocks until reported finished, params for the
        decode engine)``; ``status`` is ``"length_capped"``, ``"stopped"``,
        ``"aborted"``, ``"ignored"`` or ``"error"``."""
        delay, out = self._native.request_finished(
            request_id, prompt_len, computed_len, block_ids, self._json(params), status
        )
        return delay, None if out is None else json.loads(out)

    def build_connector_meta(self) -> LoadMeta:
        """Everything recorded since the last call, for the worker."""
        return self._native.build_connector_meta()

    def handle_finished(
        self, sent: Iterable[int], received: Iterable[int]
    ) -> "tuple[list[str], list[str], list[str]]":
        """The node's finished transfer ids as ``(finished_sending,
        finished_recving, freed)`` request ids."""
        return self._native.handle_finished(list(sent), list(received))

    def poll_abort(self) -> Optional[int]:
        """The next transfer worth aborting (its request ended mid-load)."""
        return self._native.poll_abort()

    def request_id_of(self, transfer_id: int) -> Optional[str]:
        return self._native.request_id_of(transfer_id)

    def transfer_id_of(self, request_id: str) -> Optional[int]:
        return self._native.transfer_id_of(request_id)


class Node:
    """One prefill, decode or both-ways rank.

    Keywords are the node's settings (``docs/config.md``): ``role``
    (``"prefill"``, ``"decode"``, ``"both"``), ``engine_id``, ``tp_size``,
    ``tp_rank``, ``dp_rank``, ``pp_size``, ``pp_rank``, ``mode`` (``"push"``
    or ``"pull"``), ``transport`` (``"tcp"``, ``"local"`` or ``"mooncake"``
    with ``mooncake_protocol``), ``host``,
    ``bootstrap`` (``"HOST:PORT"`` to register at or ask), ``serve_bootstrap``
    and every other key, timeouts as ``*_ms``. An unknown key raises
    :class:`MisuseError`. A key not given here is read from its
    ``KVFERRY_<KEY>`` environment variable (``KVFERRY_HOST``,
    ``KVFERRY_TRANSPORT``, ``KVFERRY_LEASE_MS``), else it keeps its
    default; :attr:`settings` shows the outcome.
    """

    def __init__(self, *, role: str, engine_id: str, **settings: Any) -> None:
        _ensure_log_pump()
        config = {"role": role, "engine_id": engine_id}
        config.update({k: v for k, v in settings.items() if v is not None})
        self._native = _native.Node(json.dumps(config))
        #: Where the KV cache lives: ``cpu`` or ``cuda:N`` (setting ``device``).
        self.device: str = self.settings.get("device") or "cpu"
        #: Tensors registered, kept alive until the node stops.
        self._memory: "list[Any]" = []
        #: String request ids of transfers opened by one, by transfer id,
        #: until ``get_finished`` reports them.
        self._names: "dict[int, str]" = {}

    @property
    def settings(self) -> "dict[str, Any]":
        """Every setting this node runs with: the keywords given, then
        ``KVFERRY_*`` variables, then defaults (``docs/config.md``)."""
        settings: "dict[str, Any]" = json.loads(self._native.settings())
        return settings

    # -- memory --------------------------------------------------------

    def register_kv_caches(
        self,
        tensors: Optional[Iterable[Any]] = None,
        *,
        regions: Optional[Sequence["tuple[int, int, int]"]] = None,
        num_blocks: Optional[int] = None,
        layout: str = "hnd",
        total_kv_heads: int,
        block_tokens: int,
        head_bytes: int,
        first_region: int = 0,
        pools: Optional[Sequence["tuple[str, int, Sequence[tuple[int, int]]]"]] = None,
    ) -> None:
        """Registers the KV cache: exactly one of ``tensors`` (one region
        per tensor, leading dimension the block, all with as many blocks)
        or raw ``regions`` ``[(base_address, block_len, kv_block_len)]``
        of ``num_blocks`` blocks each. Raw addresses must stay valid until
        :meth:`shutdown`; tensors are kept alive by the node.

        ``pools``: per-request items beside the KV (SGLang's aux and state
        buffers), each ``(kind, items, [(base_address, item_len)])`` with
        ``kind`` ``"aux"`` (copied whole to every decode rank) or
        ``"state"`` (rank to rank, equal TP only). A request's block lists
        then end with one index list per pool, in this order."""
        if tensors is not None and regions is None:
            if num_blocks is not None:
                raise MisuseError("num_blocks comes from the tensors' leading dimension")
            regions, num_blocks, keep = self._regions_of(list(tensors), self.device)
        elif regions is not None and tensors is None:
            if num_blocks is None:
                raise MisuseError("raw regions need num_blocks")
            keep = []
        else:
            raise MisuseError("give exactly one of tensors and regions")
        self._native.register_regions(
            [(int(base), int(block), int(kv_block)) for base, block, kv_block in regions],
            int(num_blocks),
            layout,
            int(total_kv_heads),
            int(block_tokens),
            int(head_bytes),
            int(first_region),
            None
            if pools is None
            else [(k, int(n), [(base, size) for base, size in rs]) for k, n, rs in pools],
        )
        self._memory.extend(keep)

    @staticmethod
    def _regions_of(
        tensors: "list[Any]", device: str
    ) -> "tuple[list[tuple[int, int, int]], int, list[Any]]":
        if not tensors:
            raise MisuseError("no tensors to register")
        found = [_tensor_region(t, device) for t in tensors]
        blocks = {b for _, _, b, _ in found}
        if len(blocks) != 1:
            raise MisuseError(f"every KV tensor needs as many blocks; got {sorted(blocks)}")
        (num_blocks,) = blocks
        regions = []
        for addr, nbytes, b, _ in found:
            if b <= 0 or nbytes % b:
                raise MisuseError(f"{nbytes} bytes do not split into {b} blocks")
            regions.append((addr, nbytes // b, nbytes // b))
        return regions, num_blocks, [k for _, _, _, k in found]

    def engine_handoff(self, stream: Optional[int] = None) -> None:
        """Orders the node's device copies after the engine's kernels:
        records an event on the engine's CUDA stream (``stream``, a
        ``CUstream`` handle; by default torch's current stream) that every
        later copy out of the KV cache waits for on the device. Call it
        after the engine's step wrote blocks it is about to hand over. A
        no-op for a node on the host."""
        if self.device == "cpu":
            return
        if stream is None:
            import torch

            stream = torch.cuda.current_stream().cuda_stream
        self._native.engine_handoff(int(stream))

    # -- requests ------------------------------------------------------

    def _named(self, transfer_id: TransferRef) -> None:
        if isinstance(transfer_id, str):
            self._names[self._native.transfer_id_of(transfer_id)] = transfer_id

    def sender(self, transfer_id: TransferRef) -> Sender:
        """The prefill side of ``transfer_id`` (an int, or a string
        request id of up to :data:`REQUEST_ID_MAX_BYTES` bytes)."""
        tx = Sender(self, self._native.sender(transfer_id), transfer_id)
        self._named(transfer_id)
        return tx

    def receiver(
        self,
        transfer_id: TransferRef,
        *,
        prefill_engine_id: Optional[str] = None,
        bootstrap: Optional[str] = None,
        prefill_dp_rank: Optional[int] = None,
        side_channels: Optional[Sequence[str]] = None,
        prefill_tp_size: int = 1,
        prefill_pp_size: int = 1,
    ) -> Receiver:
        """The decode side of ``transfer_id``, from the prefill engine
        ``prefill_engine_id`` (at data-parallel rank ``prefill_dp_rank``;
        ``None``: the engine's one rank, whichever it is)
        as the bootstrap service ``bootstrap`` lists it (default: this
        node's), or from the ranks at ``side_channels`` (stage by stage,
        ``prefill_tp_size`` per stage)."""
        rx = self._native.receiver(
            transfer_id,
            prefill_engine_id,
            bootstrap,
            prefill_dp_rank,
            None if side_channels is None else list(side_channels),
            prefill_tp_size,
            prefill_pp_size,
        )
        self._named(transfer_id)
        return Receiver(self, rx, transfer_id)

    def transfer_id_of(self, request_id: str) -> int:
        """The transfer id every node computes for ``request_id``."""
        return self._native.transfer_id_of(request_id)

    def start_load_kv(self, meta: LoadMeta) -> None:
        """vLLM-style: starts every load (decode) and send (prefill) of
        one step's ``meta`` (:meth:`Scheduler.build_connector_meta`)."""
        self._native.start_load_kv(meta)

    def start_load_kv_each(
        self, meta: LoadMeta, kernel_blocks_per_block: int = 1
    ) -> "tuple[list[tuple[int, str]], list[tuple[int, str]]]":
        """Like :meth:`start_load_kv`, but one failing request does not stop
        the others: returns ``(failed loads, failed sends)`` as ``(transfer
        id, reason)``. ``kernel_blocks_per_block``: the registered blocks
        are that many times smaller than ``meta``'s (vLLM's kernel blocks)."""
        return self._native.start_load_kv_each(meta, int(kernel_blocks_per_block))

    def abort(self, transfer_id: int) -> None:
        """Aborts the transfer ``transfer_id`` (a number), either direction."""
        self._native.abort(transfer_id)

    def get_finished(self) -> "tuple[set[TransferRef], set[TransferRef]]":
        """vLLM-style: the transfers that ended since the last call, as
        ``(finished sending, finished receiving)``, by the ids they were
        opened with."""
        sent, received = self._native.get_finished()

        def name(t: int) -> TransferRef:
            return self._names.pop(t, t)

        return {name(t) for t in sent}, {name(t) for t in received}

    def get_finished_loads(self) -> "tuple[list[int], list[int], list[int]]":
        """The transfer ids that ended since the last call, as ``(finished
        sending, loads that succeeded, loads that failed)``."""
        return self._native.get_finished_loads()

    def block_ids_with_load_errors(self) -> "set[int]":
        """Destination blocks whose load failed since the last call."""
        return set(self._native.block_ids_with_load_errors())

    def stats(self) -> "dict[str, int]":
        """The node's counters by name (``ok``, ``failed``, ``bytes``...)."""
        return dict(self._native.stats())

    # -- the node ------------------------------------------------------

    @property
    def role(self) -> str:
        return self._native.role

    @property
    def side_channel_addr(self) -> str:
        """Where peers reach this node's side channel (empty on decode)."""
        return self._native.side_channel_addr

    @property
    def endpoint(self) -> str:
        """The data-plane endpoint."""
        return self._native.endpoint

    @property
    def bootstrap_addr(self) -> Optional[str]:
        """The bootstrap service this node registers at or serves."""
        return self._native.bootstrap_addr

    def shutdown(self, grace_s: float = 0.2) -> None:
        """Stops the node; live requests get ``grace_s`` seconds to tell
        their peers. The registered tensors are released after it."""
        self._native.shutdown(float(grace_s))
        self._memory.clear()

    def __del__(self) -> None:
        # Stop the node before its memory goes: nothing may touch the
        # tensors once they are released.
        native = getattr(self, "_native", None)
        if native is not None:
            native.shutdown(0.05)

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"kvferry.Node(role={self.role!r}, endpoint={self.endpoint!r})"
