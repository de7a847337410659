"""The Triton backend's paged step: fused K/V write, paged decode, paged FlashAttention.

From the neutral ``StepLayout`` it keeps only what the kernels take — the decode rows' block
tables and context lengths, and the prefill chunks as ``cu_seqlens`` / context lengths /
block tables — as views of the layout's tensors where it can (so a CUDA graph that captured
one step reads the next step's values from the same buffers). The kernels read the blocks in
place: prefill chunks read their keys, cached prefix and new tokens alike, from the pool.

An 8-bit pool (``kv_cache_dtype="int8"`` or ``"fp8"``) changes nothing here but the arguments:
``write_kv`` quantizes as it stores, and the attention kernels dequantize what they load. A
prefill chunk reads its own new tokens back from the pool too, so — as with the reference's
``write_kv`` returning the stored values — it attends over exactly what later decodes will read.
"""

from __future__ import annotations

import itertools

import torch

import minillm.hooks as hooks
from minillm.attention import decode_tuning, prefill_tuning
from minillm.attention.decode_tuning import GATHER_SDPA, SEARCH_SPACE, gather_sdpa_decode, shape_bucket
from minillm.attention.layout import StepLayout
from minillm.attention.prefill_tuning import FLASH, gather_sdpa_prefill, prefill_bucket


class TritonPagedStep:
    def __init__(self, layout: StepLayout):
        self.layout = layout
        nd = layout.num_decodes
        context_lens = layout.context_lens_tensor
        if context_lens is None:
            context_lens = torch.tensor(layout.context_lens, dtype=torch.long, device=layout.slot_mapping.device)
        self.decode_block_tables = layout.block_tables[:nd]
        self.decode_context_lens = context_lens[:nd]
        # Fixed under CUDA graphs (the split-K layout must not change between replays).
        self.max_decode_context = layout.max_context or max(layout.context_lens[:nd], default=0)
        self.num_prefills = len(layout.query_lens) - nd
        if self.num_prefills:
            prefill_lens = layout.query_lens[nd:]
            cu = [0, *itertools.accumulate(prefill_lens)]
            self.prefill_cu_seqlens = torch.tensor(cu, dtype=torch.long, device=layout.slot_mapping.device)
            self.prefill_context_lens = context_lens[nd:]
            self.prefill_block_tables = layout.block_tables[nd:]
            self.prefill_max_tokens = max(prefill_lens)
            self.prefill_query_lens, self.prefill_context_list = list(prefill_lens), list(layout.context_lens[nd:])

    def _pool(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """This layer's K and V pools, and for an 8-bit pool its scales and how to read its bytes."""
        pool = self.layout.pool
        quant = {}
        if pool.k_scales is not None:
            quant = dict(
                k_scales=pool.k_scales[layer], v_scales=pool.v_scales[layer], kv_cache_dtype=pool.kv_cache_dtype
            )
        return pool.k_slots[layer], pool.v_slots[layer], quant

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """``q[1, N, H, D]``, ``k, v[1, N, KV, D]`` → ``[1, N, H, D]``."""
        from minillm.attention.triton_kernels import write_kv  # deferred: triton: imported only when a Triton step runs

        k_pool, v_pool, quant = self._pool(layer)
        write_kv(k[0], v[0], k_pool, v_pool, self.layout.slot_mapping, **quant)
        return self._attend_pool(q[0], k_pool, v_pool, scale, quant)

    def attend_rotary(self, layer: int, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                      heads: int, kv_heads: int, scale: float) -> torch.Tensor:  # fmt: skip
        """``attend`` from the fused projection's output ``qkv[1, N, heads + 2·kv_heads, D]``, before
        RoPE: one kernel rotates q and K and writes K and V (``rope_write_kv``) where the model
        would otherwise launch RoPE's three ops and this step the write. ``cos, signed_sin[1, N,
        1, D]`` as ``RotaryEmbedding.lookup`` gives them. The model calls this only while
        ``apply_rope`` is the package's own (a course check that plugs in its own RoPE is seen)."""
        from minillm.attention.triton_kernels import rope_write_kv  # deferred: triton
        from minillm.triton_setup import INTERPRETED  # deferred: triton

        if INTERPRETED and qkv.dtype != torch.float32:  # the interpreter rounds fp32 → bf16 wrongly: RoPE apart
            qk = hooks.apply_rope(qkv[:, :, : heads + kv_heads], cos, signed_sin)
            return self.attend(layer, qk[:, :, :heads], qk[:, :, heads:], qkv[:, :, heads + kv_heads :], scale)
        k_pool, v_pool, quant = self._pool(layer)
        q = rope_write_kv(qkv[0], cos[0, :, 0], signed_sin[0, :, 0], heads, kv_heads, k_pool, v_pool,
                          self.layout.slot_mapping, **quant)  # fmt: skip
        return self._attend_pool(q, k_pool, v_pool, scale, quant)

    def _attend_pool(self, q: torch.Tensor, k_pool, v_pool, scale: float, quant: dict) -> torch.Tensor:
        """``q[N, H, D]`` against the pool, this step's K/V already in it → ``[1, N, H, D]``."""
        layout = self.layout
        nd = layout.num_decodes
        if not self.num_prefills:  # a pure decode step: the kernel's output is the step's (no copy into place)
            return self._decode(q, k_pool, v_pool, scale, quant)[None]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if nd:
            out[:nd] = self._decode(q[:nd], k_pool, v_pool, scale, quant)
        if self.num_prefills:
            out[nd:] = self._prefill(q[nd:], k_pool, v_pool, scale, quant)
        return out[None]

    def _prefill(self, q: torch.Tensor, k_pool, v_pool, scale: float, quant: dict) -> torch.Tensor:
        """The prefill chunks, by our FlashAttention or gather + SDPA, whichever was measured
        faster for this shape (``prefill_tuning.py``; on a CPU, our kernel)."""
        # deferred: triton: imported only when a Triton step runs
        from minillm.attention.triton_kernels import flash_attention

        layout, block_size = self.layout, self.layout.pool.block_size

        def run(candidate):
            if candidate == FLASH:
                return flash_attention(q, k_pool, v_pool, self.prefill_cu_seqlens, self.prefill_context_lens,
                                       self.prefill_max_tokens, scale, causal=True,
                                       block_tables=self.prefill_block_tables, block_size=block_size,
                                       window=layout.window, **quant)  # fmt: skip
            return gather_sdpa_prefill(q, k_pool, v_pool, self.prefill_query_lens, self.prefill_context_list,
                                       self.prefill_block_tables, scale, block_size, layout.window)  # fmt: skip

        key = prefill_bucket(self.prefill_query_lens, self.prefill_context_list, q.shape[1], k_pool.shape[1],
                             q.shape[2], q.dtype, quant.get("kv_cache_dtype", "auto"), layout.window)  # fmt: skip
        candidates = (FLASH,) if quant else None  # SDPA reads an unquantized pool only
        return run(prefill_tuning.prefill_choice(q.device).pick(key, run, candidates))  # through the module: tests swap it

    def _decode(self, q: torch.Tensor, k_pool, v_pool, scale: float, quant: dict) -> torch.Tensor:
        """The decode rows, by the kernel and settings measured fastest for this shape
        (``decode_tuning.py``; on a CPU, the default settings)."""
        # deferred: triton: imported only when a Triton step runs
        from minillm.attention.triton_kernels import paged_decode

        layout, block_size = self.layout, self.layout.pool.block_size

        def run(candidate):
            if candidate == GATHER_SDPA:
                return gather_sdpa_decode(q, k_pool, v_pool, self.decode_block_tables, self.decode_context_lens, scale,
                                          block_size, layout.window)  # fmt: skip
            return paged_decode(q, k_pool, v_pool, self.decode_block_tables, self.decode_context_lens, scale,
                                block_size, self.max_decode_context, window=layout.window, config=candidate, **quant)  # fmt: skip

        heads, kv_heads = q.shape[1], k_pool.shape[1]
        key = shape_bucket(q.shape[0], self.max_decode_context, heads, kv_heads, q.shape[2], q.dtype,
                           quant.get("kv_cache_dtype", "auto"), layout.window)  # fmt: skip
        candidates = SEARCH_SPACE if quant else None  # gather + SDPA reads an unquantized pool only
        return run(decode_tuning.decode_choice(q.device).pick(key, run, candidates))  # through the module: tests swap it
