"""What every engine adapter (``kvferry.vllm``, ``kvferry.sglang``) does
with a node's settings before it opens the node: the host it advertises,
the engine's own variables it honours, the ports of each rank, and the
engine's KV buffers shared with peers on this host. Imports nothing of
the adapters: both build on it."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Mapping

from kvferry import _native
from kvferry._native import MisuseError


def with_detected_host(settings: "dict[str, Any]", detect: Callable[[], str]) -> None:
    """An engine adapter's advertised ``host`` when neither its settings nor
    ``KVFERRY_HOST`` name one. A node that may serve other hosts (a
    cluster key, or ``allow_unauthenticated_remote``) advertises what
    ``detect`` finds, as the engine's own connectors find it, and listens
    there. One that may not serves its own host: loopback, advertised and
    listened on. Peers on other hosts never learn that address: they ask
    the engine's bootstrap service first, which turns them away naming
    the two fixes (``kvferry.bootstrap``)."""
    if "host" in settings or os.environ.get("KVFERRY_HOST"):
        return
    if serves_other_hosts(settings):
        settings["host"] = detect()
    else:
        settings["host"] = "127.0.0.1"


def with_engine_knobs(settings: "dict[str, Any]", knobs: "Mapping[str, tuple[str, float]]") -> None:
    """The engine's own variables an operator already sets (``knobs``:
    variable → (setting, factor to the setting's unit)), each applied
    unless the setting is given or its ``KVFERRY_<KEY>`` variable is set:
    kvferry's names win. A value that is not a number is logged and
    ignored (a typo must not take the engine down)."""
    for var, (key, factor) in knobs.items():
        raw = os.environ.get(var)
        if not raw or key in settings or os.environ.get(f"KVFERRY_{key.upper()}"):
            continue
        try:
            settings[key] = int(float(raw) * factor)
        except ValueError:
            logging.getLogger("kvferry").warning("kvferry: %s=%r is not a number; ignored", var, raw)


#: Settings that name a port a rank listens on: given for an engine, each
#: is a base, and a rank listens at the base plus its index on its host.
RANK_PORTS = ("side_channel_port", "data_plane_port")


def with_rank_ports(settings: "dict[str, Any]", index: int) -> None:
    """A set ``side_channel_port`` / ``data_plane_port`` (setting or
    ``KVFERRY_<KEY>``) is a base port shared by every rank of the engines
    on a host; the rank at ``index`` among them listens at ``base + index``
    (docs/config.md gives each adapter's index), as the Mooncake
    connectors offset theirs. 0 stays 0: a free port."""
    for key in RANK_PORTS:
        base = settings.get(key) or os.environ.get(f"KVFERRY_{key.upper()}")
        if base and int(base):
            port = int(base) + index
            if port > 65535:
                raise MisuseError(f"{key} {base} + rank index {index} is past 65535")
            settings[key] = port


def flag(value: Any) -> bool:
    """A boolean setting given as a bool or as text."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off")
    return bool(value)


def serves_other_hosts(settings: "dict[str, Any]") -> bool:
    """Whether a node with these settings (and ``KVFERRY_*`` variables)
    may serve peers on other hosts: it holds a cluster key, or is told to
    trust anyone."""
    def given(key: str) -> Any:
        return settings.get(key) or os.environ.get(f"KVFERRY_{key.upper()}")

    allow = given("allow_unauthenticated_remote")
    if isinstance(allow, str):  # as the node reads a flag
        allow = allow.strip() in ("1", "true")
    return bool(given("cluster_key_file") or allow)


#: The objects owning buffers shared in place, never released: a freed
#: buffer's shared pages would go back to the allocator and hold other
#: objects, and a ``fork`` would then share those with the child instead
#: of copying them. KV caches live as long as their engine process anyway.
SHARED_OWNERS: "list[Any]" = []


def share_buffers(buffers: "Iterable[tuple[int, int]]", owners: "Iterable[Any]" = ()) -> "list[int]":
    """Moves the whole pages of each host buffer ``(address, length)`` onto
    a sealed ``memfd`` in place (``_native._share_pages``), so that a peer
    on this host (the other engine, a ``kvferry store serve``) copies
    straight into and out of it: the addresses and bytes stay as they are,
    as does every view the engine made. For an engine's KV cache, which
    the engine allocates itself, before its first step (nothing may touch
    the buffers during the call). ``owners`` (the objects that own the
    buffers) are kept alive for the life of the process: the buffers must
    never be freed. Returns the files' descriptors (keep them open until
    the memory is registered); a buffer that cannot be shared stays
    private and moves over tcp, logged."""
    SHARED_OWNERS.extend(owners)
    fds: "list[int]" = []
    seen: "set[int]" = set()
    for ptr, size in buffers:
        if ptr in seen or size <= 0:
            continue
        seen.add(ptr)
        try:
            fd = _native._share_pages(ptr, size)
        except MisuseError as e:
            logging.getLogger("kvferry").warning(
                "kvferry: a KV buffer stays private (%s); peers on this host use tcp", e
            )
            continue
        if fd >= 0:
            fds.append(fd)
    return fds
