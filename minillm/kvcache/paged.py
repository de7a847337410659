"""The paged KV pool: every layer's K and V as ``[num_blocks, block_size, kv_heads, head_dim]``.

The ``BlockManager`` decides which block each token goes to; this class only owns the
tensors. Attention backends see them as plain per-layer **slot** views
(``[num_blocks * block_size, kv_heads, head_dim]``: slot = block * block_size + offset) and
write new K/V through a slot mapping, read them through block tables
(``attention/paged.py``, ``attention/triton_kernels.py``). The pool itself only copies
blocks (copy-on-write) and slots (a speculative tree's accepted branch).
"""

from __future__ import annotations

import torch

from minillm.config import KVCacheDtype, ModelConfig
from minillm.kvcache.quantization import SCALE_DTYPE
from minillm.kvcache.zeroed import zeroed


class PagedKVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: KVCacheDtype | str = "auto",
    ):
        # One block more than the block manager hands out: the null block, which padded rows of
        # a batch (a CUDA graph's spare seats, a short block table's tail) write to and read from.
        self.null_block = num_blocks
        shape = (config.num_layers, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        # kv_cache_dtype="int8" | "fp8": 8-bit values plus one scale per (token, head)
        # (kvcache/quantization.py); attention computes in ``dtype`` after dequantizing.
        self.kv_cache_dtype, self.dtype = KVCacheDtype(kv_cache_dtype), dtype  # the pool's own, checked
        stored = self.kv_cache_dtype.storage or dtype
        # Zeroed, not empty: attention multiplies unused slots by a probability of exactly 0,
        # and 0 * NaN (uninitialised memory) would still be NaN. On a CPU the zeros cost nothing
        # until a page is written (kvcache/zeroed.py).
        self.k = zeroed(shape, stored, device)
        self.v = zeroed(shape, stored, device)
        self.k_scale = self.v_scale = None
        if self.kv_cache_dtype.quantized:
            self.k_scale = zeroed(shape[:-1], SCALE_DTYPE, device)
            self.v_scale = zeroed(shape[:-1], SCALE_DTYPE, device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Per layer, the same memory seen as one row per slot: [num_slots, kv_heads, head_dim].
        self.k_slots = [k.flatten(0, 1) for k in self.k.unbind(0)]
        self.v_slots = [v.flatten(0, 1) for v in self.v.unbind(0)]
        # ... and their scales, [num_slots, kv_heads] (None for an unquantized pool).
        self.k_scale_slots = None if self.k_scale is None else [s.flatten(0, 1) for s in self.k_scale.unbind(0)]
        self.v_scale_slots = None if self.v_scale is None else [s.flatten(0, 1) for s in self.v_scale.unbind(0)]

    @property
    def nbytes(self) -> int:
        scales = 0 if self.k_scale is None else self.k_scale.nbytes + self.v_scale.nbytes
        return self.k.nbytes + self.v.nbytes + scales

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Slot ``dst[i]`` becomes a copy of slot ``src[i]`` in every layer (sources read before
        any is written): a verified speculative tree's accepted branch moved to the addresses
        that follow the sequence (``LLMEngine``, ``speculative/tree.py``)."""
        if len(src) != len(dst):
            raise ValueError(f"copy_slots: {len(src)} sources for {len(dst)} destinations")
        if not src:
            return
        at, to = torch.tensor(src, device=self.k.device), torch.tensor(dst, device=self.k.device)
        pools = [self.k, self.v] + ([] if self.k_scale is None else [self.k_scale, self.v_scale])
        for pool in pools:
            slots = pool.flatten(1, 2)  # [layers, slots, ...]
            slots[:, to] = slots[:, at]

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` becomes a copy of ``src`` in every layer."""
        for src, dst in copies:
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]
            if self.k_scale is not None:
                self.k_scale[:, dst] = self.k_scale[:, src]
                self.v_scale[:, dst] = self.v_scale[:, src]
