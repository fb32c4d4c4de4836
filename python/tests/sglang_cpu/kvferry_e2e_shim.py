"""Test-only SGLang plugin (entry point ``kvferry_e2e``), not part of
kvferry: a host-memory stand-in for SGLang's CUDA KV-checksum kernel, so
that SGLang's own ``--disaggregation-enable-kv-checksum`` check runs on the
CPU in ``test_sglang_servers.py``.

SGLang's ``KvChecksumComputer.compute`` asserts CUDA index tensors and runs
a CUDA JIT Adler-32 (sglang/kernels/ops/memory/adler32.py). The stand-in
digests the same items in the same order (every KV buffer's selected
pages, then the state buffers') with zlib's Adler-32 and logs each digest.
SGLang itself ships the prefill's digest through the metadata (aux)
buffers kvferry moves and compares it with the decode's digest of the KV
kvferry wrote (disaggregation/decode.py ``_verify_kv_checksums``): a
mismatch is logged as "KV checksum mismatch" and aborts the request.
"""
import ctypes
import logging
import os
import zlib

logger = logging.getLogger("kvferry_e2e_shim")


def _host_kv_checksum(self, kv_page_indices, state_indices=None):
    ptrs = list(self._kv_data_ptrs)
    lens = list(self._kv_item_lens)
    indices = [kv_page_indices] * len(ptrs)
    if self._state_data_ptrs:
        ptrs += self._state_data_ptrs
        lens += self._state_item_lens
        indices += [state_indices] * len(self._state_data_ptrs)
    digest, items = 1, 0
    for base, item_len, idx in zip(ptrs, lens, indices):
        for i in idx.reshape(-1).tolist():
            digest = zlib.adler32(ctypes.string_at(base + int(i) * item_len, item_len), digest)
            items += 1
    logger.info(
        "kvferry_e2e kv checksum: %d pages x %d buffers (%d items) -> %#x",
        int(kv_page_indices.numel()), len(ptrs), items, digest,
    )
    return digest


def plugin() -> None:
    if os.environ.get("KVFERRY_SGLANG", "") not in ("1", "true", "yes"):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.disaggregation.checksum.KvChecksumComputer.compute",
        _host_kv_checksum,
        HookType.REPLACE,
    )
