"""KV caches: where attention keys and values live between decoding steps."""

from minillm.kvcache.contiguous import ContiguousKVCache, kv_cache_bytes

__all__ = ["ContiguousKVCache", "kv_cache_bytes"]
