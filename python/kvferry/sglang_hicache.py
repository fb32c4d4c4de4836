"""The module path SGLang's HiCache configuration names
(``"module_path": "kvferry.sglang_hicache"``) for kvferry's HiCache
storage backend, which lives in ``kvferry.sglang.hicache``."""

from kvferry.sglang.hicache import KvferryHiCacheStorage

__all__ = ["KvferryHiCacheStorage"]
