"""Paged addressing: the arithmetic that turns token positions into places in the KV pool.

Everything that asks "where does token ``p`` of this sequence live?", "how many blocks do ``n``
tokens need?" or "how many bytes is one token of K/V?" asks it here, so the runner, the
CUDA-graph path, the memory calculator and the chapter-03 exercise all use one answer.

- A sequence's **block table** lists its blocks in order; token ``p`` lives in block
  ``table[p // block_size]`` at offset ``p % block_size``, i.e. in flat **slot**
  ``table[p // block_size] * block_size + p % block_size`` of the pool.
- Tables of different lengths are **padded** to one width with the pool's *null block* (a
  spare block nothing owns), and entries released behind a sliding window (``-1``) become
  the null block too; attention masks those slots out.
"""

from __future__ import annotations

import torch

import minillm.hooks as hooks
from minillm.config import KVCacheDtype, ModelConfig

RELEASED = -1  # a block-table entry whose block was given back (it fell behind a sliding window)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (the last one possibly partly filled)."""
    return -(-num_tokens // block_size)


@hooks.reference("slot_mapping")  # the paged runner calls it through the hook (chapter 03's exercise)
def slot_mapping(block_table: list[int], start: int, num_tokens: int, block_size: int) -> list[int]:
    """Flat pool slots of positions ``start .. start+num_tokens-1``: token ``p`` lives in block
    ``block_table[p // block_size]`` at offset ``p % block_size``."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + num_tokens)]


def padded_block_tables(tables: list[list[int]], width: int, null_block: int) -> list[list[int]]:
    """Tables cut or padded to ``width`` entries; padding and released entries → ``null_block``."""
    return [[b if b >= 0 else null_block for b in t[:width]] + [null_block] * (width - len(t)) for t in tables]


def dtype_bytes(dtype: torch.dtype | str | float) -> float:
    """Bytes per stored value: a torch dtype, a name (``"fp16"``, ``"int8"``, ``"int4"``...) or a number."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if isinstance(dtype, str):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown KV dtype {dtype!r}; expected one of {sorted(DTYPE_BYTES)} or a torch dtype")
        return DTYPE_BYTES[dtype]
    return float(dtype)


#: Bytes per value of the element types a KV cache (or weights) may be stored in.
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


def kv_bytes_per_token_of(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype | str | float) -> float:
    """K and V of one token across all layers: ``2 × layers × kv_heads × head_dim × bytes``."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes(dtype)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype | str | float,
                       kv_cache_dtype: KVCacheDtype | str = "auto") -> int:  # fmt: skip
    """``kv_bytes_per_token_of`` for a model's shape, rounded up to whole bytes; an int8 pool
    (``kv_cache_dtype="int8"`` or ``"fp8"``) costs one byte per value plus a 4-byte scale per token and head."""
    if KVCacheDtype(kv_cache_dtype).quantized:
        dtype = 1 + 4 / config.head_dim
    return int(-(-kv_bytes_per_token_of(config.num_layers, config.num_kv_heads, config.head_dim, dtype) // 1))
