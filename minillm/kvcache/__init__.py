"""KV caches: where attention keys and values live between decoding steps."""

from minillm.kvcache.contiguous import ContiguousKVCache

__all__ = ["ContiguousKVCache"]
